//! The CPU lane under expert offload: a layer's host experts computed from the bank in place while the GPU runs
//! everything else, waited for only where their products are summed. The lane ([`HostLane`]) lives on a thread of
//! its own that takes one job at a time (polling for it, and computing a worker's share of it), so the thread
//! driving the GPU never blocks inside a layer: it starts the job, queues the GPU's share, then queues on the
//! compute stream a host function that returns once the job is done, the products' upload behind it and
//! moe_combine behind that, and goes on to queue the rest of the layer and the next one's attention. The stream,
//! not the host, waits for the lane, and only at the combine.
//!
//! The buffers the lane reads and writes (the layer's input rows, read with its routed ids, and the products) are
//! pinned and stay where they are; a job's rows are next overwritten by the next MoE layer's download and its
//! products by the next job, both queued or started after the stream has passed this job's host function. The
//! bank's blocks are read in place, bf16, FP8 (matrices, then the f32 scales) or MXFP4 (each matrix packed and
//! padded), with their f32 biases when they have them (expert_format.rs), as the CPU backend reads the same experts.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, PinnedHostSlice};

use super::expert_format::{grid, mxfp4_matrix_bytes, ExpertFormat, ExpertGlu};
use super::{cuda_err, CudaTensor};
use crate::backend::cpu::gemv::{BlockScales, WeightDType};
use crate::backend::cpu::lane::{HostLane, LaneDType, LaneExpert, LaneWork, POLL_BEFORE_SLEEP};
use crate::backend::ExpertActivation;
use crate::loader::DType;
use crate::{Error, Result};

/// What one job computed, for the offload's counters and the planner's calibration.
pub(super) struct LaneDone {
    pub experts: usize,
    pub pairs: usize,
    pub bytes: usize,
    /// The lane's own time.
    pub busy: Duration,
    /// The rows of each of the job's experts.
    pub rows: Vec<usize>,
    /// What the job cost the pipeline, from its start on the host: until the stream was let go past its wait when
    /// the stream had to wait (the products being on their way then), else until the job was done.
    pub pipeline: Duration,
}

/// A borrowed slice sent to the lane's thread as its address: see [`OffloadLane::start`] for why it stays valid.
struct Raw<T>(*const T, usize);

// SAFETY: only the address crosses threads; who reads or writes through it, and when, is what
// `OffloadLane::start` documents.
unsafe impl<T> Send for Raw<T> {}

impl<T> Raw<T> {
    fn of(slice: &[T]) -> Self {
        Raw(slice.as_ptr(), slice.len())
    }
}

/// One layer's host experts, as the lane's thread receives them.
struct LaneJob {
    seq: u64,
    rows: Raw<f32>,
    products: Raw<f32>,
    blocks: Vec<Raw<u8>>,
    format: ExpertFormat,
    glu: ExpertGlu,
    hidden: usize,
    inter: usize,
    pairs: Vec<(u32, u32)>,
}

/// The last finished job's number, outcome and time (`u64::MAX` once the lane's thread has ended, so no one waits
/// on it), and the last job the stream waited for.
struct Finished {
    seq: u64,
    result: Result<Duration>,
    at: Instant,
    released: Option<Released>,
}

/// The stream let go past job `seq`'s wait at `at`; `waited` when the job was not done as the stream got there.
#[derive(Clone, Copy)]
struct Released {
    seq: u64,
    at: Instant,
    waited: bool,
}

struct LaneSignal {
    finished: Mutex<Finished>,
    changed: Condvar,
}

impl LaneSignal {
    fn lock(&self) -> MutexGuard<'_, Finished> {
        self.finished.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn finish(&self, seq: u64, result: Result<Duration>) {
        let mut finished = self.lock();
        (finished.seq, finished.result, finished.at) = (seq, result, Instant::now());
        self.changed.notify_all();
    }

    /// Waits until job `seq` (or a later one) has finished.
    fn wait_until(&self, seq: u64) -> MutexGuard<'_, Finished> {
        let mut finished = self.lock();
        while finished.seq < seq {
            finished = self.changed.wait(finished).unwrap_or_else(|e| e.into_inner());
        }
        finished
    }

    /// The stream's side: waits for job `seq`, then notes when the stream was let go and whether it waited.
    fn release(&self, seq: u64) {
        let waited = self.lock().seq < seq;
        let mut finished = self.wait_until(seq);
        finished.released = Some(Released {
            seq,
            at: Instant::now(),
            waited,
        });
    }
}

/// Ends the lane's thread's waiters however the thread ends.
struct EndOnDrop(Arc<LaneSignal>);

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        self.0
            .finish(u64::MAX, Err(Error::Shape("the CPU lane's thread has ended".into())));
    }
}

/// A job that was started and not yet collected.
struct Pending {
    seq: u64,
    started: Instant,
    rows: Vec<usize>,
    pairs: usize,
    bytes: usize,
}

pub(super) struct OffloadLane {
    jobs: Option<Sender<LaneJob>>,
    thread: Option<JoinHandle<()>>,
    signal: Arc<LaneSignal>,
    pending: Option<Pending>,
    next_seq: u64,
    /// The layer's input rows, read with its routed ids, and the lane's products.
    rows_host: Option<PinnedHostSlice<f32>>,
    products_host: Option<PinnedHostSlice<f32>>,
}

impl OffloadLane {
    /// Starts the lane's thread and its workers ([`HostLane::default_threads`]).
    pub fn new() -> Result<Self> {
        let lane = HostLane::new(HostLane::default_threads())?;
        let signal = Arc::new(LaneSignal {
            finished: Mutex::new(Finished {
                seq: 0,
                result: Ok(Duration::ZERO),
                at: Instant::now(),
                released: None,
            }),
            changed: Condvar::new(),
        });
        let (jobs, received) = channel();
        let ends = EndOnDrop(signal.clone());
        let thread = std::thread::Builder::new()
            .name("ferry-lane".into())
            .spawn(move || run_jobs(lane, received, ends))
            .map_err(|e| Error::Config(format!("starting the CPU lane's thread: {e}")))?;
        Ok(OffloadLane {
            jobs: Some(jobs),
            thread: Some(thread),
            signal,
            pending: None,
            next_seq: 1,
            rows_host: None,
            products_host: None,
        })
    }

    /// Queues the download of the layer's input `x` on `compute`, ahead of the routed ids, into the rows buffer:
    /// behind the last job's host function in stream order, so it lands after that job has read the rows.
    pub fn read_rows(&mut self, ctx: &Arc<CudaContext>, compute: &Arc<CudaStream>, x: &CudaTensor) -> Result<()> {
        let values = x.rows * x.cols;
        if self.rows_host.as_ref().is_none_or(|h| h.len() < values) {
            // The old buffer may still be read by a job: wait for it before letting it go.
            self.finish_pending()?;
            self.rows_host = Some(
                unsafe { ctx.alloc_pinned_with_flags::<f32>(values.next_power_of_two(), 0) }
                    .map_err(cuda_err("pinning the lane's rows"))?,
            );
        }
        let Some(host) = self.rows_host.as_mut() else {
            return Err(Error::Cuda("no buffer for the lane's rows".into()));
        };
        let dst = &mut host.as_mut_slice().map_err(cuda_err("lane rows"))?[..values];
        let src = x.data.device_ptr(compute).0;
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, compute.cu_stream()) }
            .map_err(cuda_err("the lane's rows to the host"))
    }

    /// The last job's outcome, once it is done (at once after the host has waited for a later router: the stream
    /// passed its host function before), or `None` when no job is pending.
    pub fn collect(&mut self) -> Result<Option<LaneDone>> {
        let Some(pending) = self.pending.take() else {
            return Ok(None);
        };
        let finished = self.signal.wait_until(pending.seq);
        let busy = match &finished.result {
            Ok(busy) => *busy,
            Err(e) => return Err(Error::Shape(format!("the CPU lane failed: {e}"))),
        };
        let until = match finished.released {
            Some(released) if released.seq == pending.seq && released.waited => released.at,
            _ => finished.at,
        };
        Ok(Some(LaneDone {
            experts: pending.rows.len(),
            pairs: pending.pairs,
            bytes: pending.bytes,
            busy,
            pipeline: until.saturating_duration_since(pending.started),
            rows: pending.rows,
        }))
    }

    fn finish_pending(&mut self) -> Result<()> {
        self.collect().map(drop)
    }

    /// Starts computing `pairs` (row of the rows read last, index into `blocks`) of the bank `blocks` (each an
    /// expert stored as `format`, `[inter, hidden]`, computing what `glu` says) and returns at once.
    ///
    /// The lane's thread reads the rows buffer, the products buffer and the blocks through their addresses until
    /// the job is done. That holds because: the blocks are the bank's, which is filled at load and dropped after
    /// this lane (`Offload` declares its lane first); the rows are next written by a download queued on the
    /// stream behind this job's host function ([`OffloadLane::queue_products`]), or after waiting for the job when
    /// the buffer must grow; the products buffer is written only by the next job, started after this one is
    /// collected, and read by the upload behind the host function; and dropping the lane waits for its thread.
    pub fn start(
        &mut self,
        ctx: &Arc<CudaContext>,
        (rows, hidden): (usize, usize),
        inter: usize,
        blocks: &[&[u8]],
        (format, glu): (ExpertFormat, ExpertGlu),
        pairs: Vec<(u32, u32)>,
    ) -> Result<()> {
        self.finish_pending()?;
        let values = pairs.len() * hidden;
        if self.products_host.as_ref().is_none_or(|h| h.len() < values) {
            self.products_host = Some(
                unsafe { ctx.alloc_pinned_with_flags::<f32>(values.next_power_of_two(), 0) }
                    .map_err(cuda_err("pinning the lane's products"))?,
            );
        }
        let (Some(rows_host), Some(products_host), Some(jobs)) =
            (self.rows_host.as_ref(), self.products_host.as_mut(), self.jobs.as_ref())
        else {
            return Err(Error::Cuda("the CPU lane has no rows read for this layer".into()));
        };
        let row_values = rows * hidden;
        if rows_host.len() < row_values {
            return Err(Error::Shape(format!(
                "the CPU lane's {} row values are fewer than {rows} x {hidden}",
                rows_host.len()
            )));
        }
        let seq = self.next_seq;
        let mut expert_rows = vec![0; blocks.len()];
        for &(_, e) in &pairs {
            if let Some(rows) = expert_rows.get_mut(e as usize) {
                *rows += 1;
            }
        }
        let job = LaneJob {
            seq,
            rows: Raw::of(&rows_host.as_slice().map_err(cuda_err("lane rows"))?[..row_values]),
            products: Raw::of(&products_host.as_mut_slice().map_err(cuda_err("lane products"))?[..values]),
            blocks: blocks.iter().map(|b| Raw::of(b)).collect(),
            format,
            glu,
            hidden,
            inter,
            pairs,
        };
        let (pairs, bytes) = (job.pairs.len(), blocks.iter().map(|b| b.len()).sum());
        let started = Instant::now();
        jobs.send(job)
            .map_err(|_| Error::Cuda("the CPU lane's thread has ended".into()))?;
        self.next_seq += 1;
        self.pending = Some(Pending {
            seq,
            started,
            rows: expert_rows,
            pairs,
            bytes,
        });
        Ok(())
    }

    /// Queues on `compute` the wait for the started job (a host function that returns once it is done) and the
    /// upload of its products into the first rows of `products` (`[pairs or more, hidden]`) behind it. Everything
    /// queued on `compute` before this runs while the lane computes.
    pub fn queue_products(&mut self, compute: &Arc<CudaStream>, products: &CudaTensor) -> Result<()> {
        let (Some(pending), Some(products_host)) = (self.pending.as_ref(), self.products_host.as_ref()) else {
            return Err(Error::Cuda("no CPU lane job to wait for".into()));
        };
        if products.rows < pending.pairs {
            return Err(Error::Shape(format!(
                "{} rows for the CPU lane's {} products",
                products.rows, pending.pairs
            )));
        }
        let wait = Box::into_raw(Box::new((self.signal.clone(), pending.seq)));
        // SAFETY: the callback makes no CUDA call and owns `wait` once queued; a failed launch leaves it ours.
        let queued = unsafe {
            cudarc::driver::result::stream::launch_host_function(compute.cu_stream(), wait_for_job, wait.cast())
        };
        if let Err(error) = queued {
            // SAFETY: not handed to the driver.
            drop(unsafe { Box::from_raw(wait) });
            return Err(cuda_err("waiting for the CPU lane")(error));
        }
        let values = pending.pairs * products.cols;
        let src = &products_host.as_slice().map_err(cuda_err("lane products"))?[..values];
        let dst = products.data.device_ptr(compute).0;
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, compute.cu_stream()) }
            .map_err(cuda_err("the lane's products to the GPU"))
    }
}

impl Drop for OffloadLane {
    fn drop(&mut self) {
        // Closing the channel ends the thread once it has run what it was sent.
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The stream's wait for a job: `data` is the `(signal, seq)` [`OffloadLane::queue_products`] boxed.
unsafe extern "C" fn wait_for_job(data: *mut c_void) {
    // SAFETY: the box was handed to this call alone.
    let wait = unsafe { Box::from_raw(data.cast::<(Arc<LaneSignal>, u64)>()) };
    // A failed job is reported by `collect`; the stream goes on either way.
    wait.0.release(wait.1);
}

/// The lane's thread: runs each job (taking a worker's share of it) and reports it, until the channel closes.
fn run_jobs(mut lane: HostLane, jobs: Receiver<LaneJob>, ends: EndOnDrop) {
    while let Some(job) = next_job(&jobs) {
        let result = catch_unwind(AssertUnwindSafe(|| run_job(&mut lane, &job)))
            .unwrap_or_else(|_| Err(Error::Shape("the CPU lane panicked".into())));
        ends.0.finish(job.seq, result);
    }
}

/// The next job, polled for as the lane's workers poll ([`POLL_BEFORE_SLEEP`]), then waited for: decode sends one
/// per MoE layer, and a thread asleep on the channel costs the layer a wake-up through the kernel before the job
/// can even be handed to the workers. `None` once the channel has closed.
fn next_job(jobs: &Receiver<LaneJob>) -> Option<LaneJob> {
    let polling = Instant::now();
    while polling.elapsed() < POLL_BEFORE_SLEEP {
        match jobs.try_recv() {
            Ok(job) => return Some(job),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) => std::hint::spin_loop(),
        }
    }
    jobs.recv().ok()
}

fn run_job(lane: &mut HostLane, job: &LaneJob) -> Result<Duration> {
    // SAFETY: see `OffloadLane::start`: each address stays valid, and no one else writes what the job reads or
    // touches the products, until the job is reported finished.
    let rows = unsafe { std::slice::from_raw_parts(job.rows.0, job.rows.1) };
    let products = unsafe { std::slice::from_raw_parts_mut(job.products.0.cast_mut(), job.products.1) };
    let experts = job
        .blocks
        .iter()
        .map(|b| {
            lane_expert(
                unsafe { std::slice::from_raw_parts(b.0, b.1) },
                (job.format, job.glu),
                job.inter,
                job.hidden,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let work = LaneWork {
        x: rows,
        hidden: job.hidden,
        inter: job.inter,
        activation: activation(job.glu),
        experts: &experts,
        pairs: &job.pairs,
    };
    Ok(lane.compute(&work, products, || ())?.1)
}

/// The CPU lane's share of a step.
pub(super) struct HostPairs {
    /// Per (row, k) pair of the step, its row among the lane's products, or -1.
    pub index: Vec<i32>,
    /// The lane's pairs, (row, index into its experts), in pair order.
    pub pairs: Vec<(u32, u32)>,
}

/// The CPU lane's share of a step whose routed ids are `ids` (`[rows * top_k]`) in a layer of `experts` experts,
/// the lane computing `host`.
pub(super) fn host_pairs(ids: &[i32], top_k: usize, host: &[u32], experts: usize) -> Result<HostPairs> {
    let mut host_at = vec![-1i32; experts];
    for (at, &e) in host.iter().enumerate() {
        *host_at
            .get_mut(e as usize)
            .ok_or_else(|| Error::Cuda(format!("routed to expert {e} of a layer of {experts} experts")))? = at as i32;
    }
    let mut index = vec![-1i32; ids.len()];
    let mut pairs: Vec<(u32, u32)> = Vec::new();
    for (pair, &e) in ids.iter().enumerate() {
        let at = usize::try_from(e)
            .ok()
            .and_then(|e| host_at.get(e))
            .copied()
            .unwrap_or(-1);
        if at >= 0 {
            index[pair] = pairs.len() as i32;
            pairs.push(((pair / top_k) as u32, at as u32));
        }
    }
    Ok(HostPairs { index, pairs })
}

/// The activation the expert kernels' `glu` arguments stand for.
fn activation(glu: ExpertGlu) -> ExpertActivation {
    match glu.clamped {
        0 => ExpertActivation::SiluGlu,
        _ => ExpertActivation::ClampedSwiGlu {
            alpha: glu.alpha,
            limit: glu.limit,
        },
    }
}

/// A bank block as the lane reads it (expert_format.rs's layout): gate, up and down, bf16 back to back, FP8 back
/// to back followed by their scales, or MXFP4 each padded to 16 bytes; then, where `glu` says, the f32 biases.
fn lane_expert(
    block: &[u8],
    (format, glu): (ExpertFormat, ExpertGlu),
    inter: usize,
    hidden: usize,
) -> Result<LaneExpert<'_>> {
    if block.len() < format.block_bytes(inter, hidden, glu.biased()) {
        return Err(Error::Shape(format!(
            "a bank block of {} bytes for a {format:?} expert",
            block.len()
        )));
    }
    let (dtype, scales) = match format {
        ExpertFormat::Bf16 => (LaneDType::Gemv(WeightDType::BF16), None),
        ExpertFormat::Fp8(blocks) => {
            let grids = [
                (inter, hidden, blocks.gate_up),
                (inter, hidden, blocks.gate_up),
                (hidden, inter, blocks.down),
            ];
            let mut at = ExpertFormat::scales_at(inter, hidden);
            let scales = grids.map(|(n, k, [block_rows, block_cols])| {
                let start = at;
                at += 4 * grid(n, k, [block_rows, block_cols]);
                BlockScales {
                    bytes: &block[start..at],
                    block_rows,
                    block_cols,
                }
            });
            (LaneDType::Gemv(WeightDType::F8E4M3), Some(scales))
        }
        ExpertFormat::Mxfp4 => (LaneDType::Mxfp4, None),
    };
    let (matrix, stride) = match dtype {
        LaneDType::Gemv(dtype) => (inter * hidden * dtype.size_bytes(), inter * hidden * dtype.size_bytes()),
        LaneDType::Mxfp4 => (
            DType::Mxfp4.bytes_for(inter * hidden),
            mxfp4_matrix_bytes(inter, hidden),
        ),
    };
    let [gate_bias, up_bias, down_bias] = match glu.biased() {
        true => {
            let at = glu.bias_at as usize;
            let biases = f32_values(&block[at..at + 4 * (2 * inter + hidden)])?;
            let (gate, rest) = biases.split_at(inter);
            let (up, down) = rest.split_at(inter);
            [Some(gate), Some(up), Some(down)]
        }
        false => [None; 3],
    };
    Ok(LaneExpert {
        gate: &block[..matrix],
        up: &block[stride..stride + matrix],
        down: &block[2 * stride..2 * stride + matrix],
        dtype,
        scales,
        gate_bias,
        up_bias,
        down_bias,
    })
}

/// `bytes` as the f32 values they hold in place: the bank's blocks start 16-byte aligned, and so do their biases.
fn f32_values(bytes: &[u8]) -> Result<&[f32]> {
    // SAFETY: every bit pattern is an f32; `align_to` puts only whole, aligned values in the middle.
    let (before, values, after) = unsafe { bytes.align_to::<f32>() };
    match before.is_empty() && after.is_empty() {
        true => Ok(values),
        false => Err(Error::Shape("a bank block's biases not 4-byte aligned".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::expert_format::with_f32_biases;
    use crate::backend::ExpertTensors;
    use crate::loader::TensorRef;

    /// Two rows of top 3, the lane computing experts 7 and 2: each of their pairs gets the next row of the lane's
    /// products in pair order, with its row and place in `host`; the others stay on the GPU; a host expert outside
    /// the layer is refused.
    #[test]
    fn the_lanes_pairs_follow_the_routed_pairs_in_order() {
        let ids = [2, 5, 7, 7, 1, 2];
        let share = host_pairs(&ids, 3, &[7, 2], 8).unwrap();
        assert_eq!(share.index, [0, -1, 1, 2, -1, 3]);
        assert_eq!(share.pairs, [(0, 1), (0, 0), (1, 0), (1, 1)]);
        let none = host_pairs(&ids, 3, &[], 8).unwrap();
        assert_eq!(none.index, [-1; 6]);
        assert!(none.pairs.is_empty());
        assert!(matches!(host_pairs(&ids, 3, &[8], 8), Err(Error::Cuda(_))));
    }

    /// gpt-oss's bank block (MXFP4 gate, up and down, then the f32 biases, a missing one as zeros) read back by the
    /// lane as the tensors it was made of, with the clamped SwiGLU its kernel arguments stand for; a short block is
    /// refused.
    #[test]
    fn the_lane_reads_every_part_of_a_biased_mxfp4_block_where_it_lies() {
        let (inter, hidden) = (64, 96);
        let matrix = |name: &str, n: usize, k: usize, seed: u8| {
            let bytes = (0..DType::Mxfp4.bytes_for(n * k))
                .map(|i| (i as u8).wrapping_mul(seed))
                .collect();
            TensorRef::from_bytes(name, DType::Mxfp4, vec![n, k], bytes).unwrap()
        };
        let bias = |name: &str, len: usize, step: f32| {
            let values: Vec<f32> = (0..len).map(|i| i as f32 * step).collect();
            TensorRef::from_f32(name, vec![len], &values).unwrap()
        };
        let e = ExpertTensors {
            gate_bias: Some(bias("gate.bias", inter, 0.5)),
            down_bias: Some(bias("down.bias", hidden, -0.25)),
            ..ExpertTensors::unbiased(
                matrix("gate", inter, hidden, 3),
                matrix("up", inter, hidden, 5),
                matrix("down", hidden, inter, 7),
            )
        };
        let e = with_f32_biases(e, true).unwrap();
        let format = ExpertFormat::of(std::slice::from_ref(&e)).unwrap();
        let clamped = ExpertActivation::ClampedSwiGlu {
            alpha: 1.702,
            limit: 7.0,
        };
        let glu = ExpertGlu::new(clamped, format, inter, hidden, true);
        let bytes: Vec<u8> = format.block_parts(&e).unwrap().concat();
        // The bank's blocks start 16-byte aligned: so does this copy.
        let mut words = vec![0u128; bytes.len().div_ceil(16)];
        // SAFETY: any u128 is 16 initialised bytes.
        let block = &mut unsafe { words.align_to_mut::<u8>() }.1[..bytes.len()];
        block.copy_from_slice(&bytes);
        let expert = lane_expert(block, (format, glu), inter, hidden).unwrap();
        assert_eq!(expert.dtype, LaneDType::Mxfp4);
        assert!(expert.scales.is_none());
        assert_eq!(
            [expert.gate, expert.up, expert.down],
            [e.gate.bytes(), e.up.bytes(), e.down.bytes()]
        );
        let biases = [&e.gate_bias, &e.up_bias, &e.down_bias].map(|b| b.as_ref().unwrap().to_f32_vec());
        assert_eq!(expert.up_bias, Some(&vec![0.0; inter][..]));
        assert_eq!(
            [expert.gate_bias, expert.up_bias, expert.down_bias],
            [0, 1, 2].map(|i| Some(&biases[i][..]))
        );
        assert_eq!(activation(glu), clamped);
        assert!(matches!(
            lane_expert(&block[..block.len() - 16], (format, glu), inter, hidden),
            Err(Error::Shape(_))
        ));
    }
}

//! The CPU lane: routed experts computed on the host straight from where their weights lie (the GPU offload's
//! pinned bank, read in place), on a persistent pool of pinned threads and the thread that hands it the job (under
//! offload, the lane's own thread, so the thread driving the GPU goes on).
//! f32 activations and accumulation through the CPU backend's GEMV kernels ([`matmul_serial`]) and the same
//! activation and bias arithmetic as `cpu/moe.rs`, so each (row, expert) product equals the CPU backend's to the
//! bit, for bf16 experts, FP8 ones (E4M3 with block scales, read in place like the bf16 ones) and MXFP4 ones
//! (gpt-oss's, through cpu/mxfp4.rs's `product_rows` as the CPU backend's: read packed for a few rows, else
//! widened a tile of rows at a time into each worker's own buffer), with or without biases. What it returns is
//! each pair's unweighted product; the caller weights and sums them in router order (on the GPU, moe_combine
//! does). Not for the CPU backend's own MoE layers, which rayon runs.
//!
//! A job runs in three phases over all its experts, every worker taking items from a shared counter and waiting
//! at the end of each phase for the others: gather each expert's rows of `x`; gate and up in chunks of output rows
//! (each chunk a multiple of 16 rows, so the kernels meet the same 4-row blocks, and MXFP4 the same tiles, as over
//! the whole matrix, and of an FP8 matrix's scale block rows, so each chunk reads whole rows of the scale grid), with
//! the activation; down in chunks of output features. An expert used by one row is read once, spread over every
//! thread; one used by many rows is read once too, each chunk serving all its rows.

mod pool;

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use super::gemv::{matmul_serial, BlockScales, WeightDType, WeightEncoding};
use super::mxfp4::{product_rows, tile_len, TILE_ROWS};
use super::{sigmoid, silu};
use crate::backend::ExpertActivation;
use crate::loader::mxfp4::MXFP4_BLOCK;
use crate::loader::DType;
use crate::{Error, Result};
use pool::WorkerPool;
pub use pool::POLL_BEFORE_SLEEP;

/// Bytes of weights one work item reads: small enough that a one-row expert spreads over every thread, large
/// enough that the shared counter is not the bottleneck.
const ITEM_BYTES: usize = 256 << 10;
/// Output rows of a work item are a multiple of this (the GEMV kernels' row blocks and the MXFP4 tiles divide it).
const ITEM_ROWS_MULTIPLE: usize = 16;
const _: () = assert!(ITEM_ROWS_MULTIPLE.is_multiple_of(TILE_ROWS));
/// (row, expert) pairs one job takes at most; more are run in several jobs, bounding the lane's buffers.
const MAX_JOB_PAIRS: usize = 4096;

/// How an expert's matrices are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaneDType {
    /// What the GEMV kernels read in place: bf16, or FP8 with its scales.
    Gemv(WeightDType),
    /// Packed as loader/mxfp4.rs packs a matrix: every row's e2m1 values, then every row's e8m0 scales.
    Mxfp4,
}

impl LaneDType {
    /// Bytes of a `[n, k]` matrix.
    fn matrix_bytes(self, n: usize, k: usize) -> usize {
        match self {
            LaneDType::Gemv(dtype) => n * k * dtype.size_bytes(),
            LaneDType::Mxfp4 => DType::Mxfp4.bytes_for(n * k),
        }
    }
}

/// One expert's weights as the lane reads them, in place: `gate` and `up` `[inter, hidden]`, `down` `[hidden,
/// inter]`, all in `dtype` (FP8 with each matrix's scales, gate's, up's and down's), and optional f32 biases.
#[derive(Clone, Copy)]
pub struct LaneExpert<'a> {
    pub gate: &'a [u8],
    pub up: &'a [u8],
    pub down: &'a [u8],
    pub dtype: LaneDType,
    pub scales: Option<[BlockScales<'a>; 3]>,
    pub gate_bias: Option<&'a [f32]>,
    pub up_bias: Option<&'a [f32]>,
    pub down_bias: Option<&'a [f32]>,
}

/// What a lane computes: each pair's product `down_e(act(gate_e x_r, up_e x_r))`.
pub struct LaneWork<'a> {
    /// The rows, `[rows, hidden]`.
    pub x: &'a [f32],
    pub hidden: usize,
    pub inter: usize,
    pub activation: ExpertActivation,
    pub experts: &'a [LaneExpert<'a>],
    /// (row of `x`, index into `experts`) per pair.
    pub pairs: &'a [(u32, u32)],
}

/// A mutable buffer shared by the workers, each writing ranges no other worker touches in the same phase.
#[derive(Clone, Copy)]
struct SharedMut(*mut f32, usize);

// SAFETY: workers write disjoint ranges (each phase's items partition what they write) and read only what an
// earlier phase finished writing; the phases are separated by the barrier in `Layout::job`.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    fn new(buffer: &mut [f32]) -> Self {
        SharedMut(buffer.as_mut_ptr(), buffer.len())
    }

    /// # Safety
    /// No other live reference may overlap `range` (see the impl's SAFETY note).
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, range: Range<usize>) -> &mut [f32] {
        assert!(range.start <= range.end && range.end <= self.1);
        std::slice::from_raw_parts_mut(self.0.add(range.start), range.end - range.start)
    }
}

/// One expert's group in a job: its pairs `order[start..start + rows]`.
#[derive(Clone, Copy, Default)]
struct Group {
    expert: u32,
    start: usize,
    rows: usize,
}

/// A work item: a group and a range of its output rows (gate/up) or features (down).
#[derive(Clone, Copy)]
struct Item {
    group: usize,
    rows: (usize, usize),
}

/// The host's expert lane: its worker pool, a job's layout and its buffers, which grow to the largest job and are
/// then reused.
pub struct HostLane {
    pool: WorkerPool,
    layout: Layout,
    /// Gathered rows `[pairs, hidden]`, gate and up `[pairs, 2 * inter]`, activations `[pairs, inter]`, down
    /// `[pairs, hidden]`, all in grouped order; then each worker's MXFP4 tile buffer (`Layout::tile_values` each,
    /// empty for other experts).
    buffers: [Vec<f32>; 5],
}

/// What the workers of a job read: the pairs grouped by expert, the work items, the shared counters.
#[derive(Default)]
struct Layout {
    order: Vec<u32>,
    filled: Vec<usize>,
    groups: Vec<Group>,
    gate_up_items: Vec<Item>,
    down_items: Vec<Item>,
    /// Values of one worker's MXFP4 tile buffer (cpu/mxfp4.rs's `tile_len` for the job's largest group).
    tile_values: usize,
    next: [AtomicUsize; 3],
    done: [AtomicUsize; 3],
    failed: AtomicBool,
}

impl HostLane {
    /// A lane of `threads` workers, the thread that calls [`HostLane::compute`] one of them;
    /// [`HostLane::default_threads`] leaves half the cores to the GPU-driving thread and the driver's threads.
    pub fn new(threads: usize) -> Result<Self> {
        Ok(HostLane {
            pool: WorkerPool::new(threads)?,
            layout: Layout::default(),
            buffers: Default::default(),
        })
    }

    /// Half the cores, at least one. The lane's products are bound by host memory bandwidth, which half the
    /// cores nearly reach (on the H200's host, 8 of 16 threads read 50 GB/s against 15 threads' 63), and a lane
    /// that took all but one starved the GPU-driving thread and the driver's host-function thread: hybrid decode
    /// of a 12-layer Qwen3-30B-A3B under locality ran at 99.9 tok/s with 15 threads polling 2 ms, 193.9 with 8
    /// polling 50 µs (offload alone: 165.1).
    pub fn default_threads() -> usize {
        std::thread::available_parallelism().map_or(1, |n| n.get() / 2).max(1)
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// Computes `work`'s pairs into `out` (`[pairs, hidden]`, pair order) on the workers while the calling thread
    /// runs `during`, then on the calling thread too; returns what `during` returned and the lane's own time.
    pub fn compute<R>(
        &mut self,
        work: &LaneWork<'_>,
        out: &mut [f32],
        during: impl FnOnce() -> R,
    ) -> Result<(R, Duration)> {
        check(work, out)?;
        let mut during = Some(during);
        let (mut result, mut busy) = (None, Duration::ZERO);
        for first in (0..work.pairs.len().max(1)).step_by(MAX_JOB_PAIRS) {
            let pairs = &work.pairs[first..(first + MAX_JOB_PAIRS).min(work.pairs.len())];
            let out = SharedMut::new(&mut out[first * work.hidden..(first + pairs.len()) * work.hidden]);
            self.layout.lay_out(work, pairs, self.pool.threads(), &mut self.buffers);
            let buffers = self.buffers.each_mut().map(|b| SharedMut::new(b));
            let layout = &self.layout;
            let job = |worker: usize| layout.job(work, pairs, worker, &buffers, out);
            match during.take() {
                Some(during) => {
                    let (r, took) = self.pool.run_while(&job, during)?;
                    (result, busy) = (Some(r), busy + took);
                }
                None => busy += self.pool.run_while(&job, || ())?.1,
            }
            if layout.failed.load(Ordering::Relaxed) {
                return Err(Error::Shape("the CPU lane's kernels failed".into()));
            }
        }
        let result = result.ok_or_else(|| Error::Shape("the CPU lane ran no job".into()))?;
        Ok((result, busy))
    }
}

impl Layout {
    /// Groups `pairs` of `work` by expert (stably, so each expert's rows keep their order) and sizes the buffers
    /// and work items for them.
    fn lay_out(&mut self, work: &LaneWork<'_>, pairs: &[(u32, u32)], threads: usize, buffers: &mut [Vec<f32>; 5]) {
        let (hidden, inter) = (work.hidden, work.inter);
        self.groups.clear();
        self.groups.resize(work.experts.len(), Group::default());
        for &(_, e) in pairs {
            self.groups[e as usize].rows += 1;
        }
        let mut start = 0;
        for (e, group) in self.groups.iter_mut().enumerate() {
            (group.expert, group.start) = (e as u32, start);
            start += group.rows;
        }
        self.order.clear();
        self.order.resize(pairs.len(), 0);
        self.filled.clear();
        self.filled.extend(self.groups.iter().map(|g| g.start));
        for (p, &(_, e)) in pairs.iter().enumerate() {
            self.order[self.filled[e as usize]] = p as u32;
            self.filled[e as usize] += 1;
        }
        self.groups.retain(|g| g.rows > 0);
        let first = work.experts.first();
        let row_bytes = |k: usize| first.map_or(2 * k, |e| e.dtype.matrix_bytes(1, k));
        // Chunks start on whole rows of the scale grid (every expert of a layer is stored alike).
        let scale_rows = |m: usize| first.and_then(|e| e.scales).map_or(1, |s| s[m].block_rows);
        let chunk = |rows_of_k: usize, scale_rows: usize| {
            (ITEM_BYTES / rows_of_k).next_multiple_of(lcm(ITEM_ROWS_MULTIPLE, scale_rows))
        };
        let (gate_up_chunk, down_chunk) = (
            chunk(2 * row_bytes(hidden), lcm(scale_rows(0), scale_rows(1))),
            chunk(row_bytes(inter), scale_rows(2)),
        );
        for (items, chunk, len) in [
            (&mut self.gate_up_items, gate_up_chunk, inter),
            (&mut self.down_items, down_chunk, hidden),
        ] {
            items.clear();
            for group in 0..self.groups.len() {
                items.extend((0..len).step_by(chunk).map(|a| Item {
                    group,
                    rows: (a, (a + chunk).min(len)),
                }));
            }
        }
        let n = pairs.len();
        let most_rows = self.groups.iter().map(|g| g.rows).max().unwrap_or(0);
        self.tile_values = match first.map(|e| e.dtype) {
            Some(LaneDType::Mxfp4) => tile_len(most_rows, hidden.max(inter)),
            _ => 0,
        };
        for (buffer, len) in buffers.iter_mut().zip([
            n * hidden,
            2 * n * inter,
            n * inter,
            n * hidden,
            threads * self.tile_values,
        ]) {
            if buffer.len() < len {
                buffer.resize(len, 0.0);
            }
        }
        for counter in self.next.iter().chain(&self.done) {
            counter.store(0, Ordering::Relaxed);
        }
        self.failed.store(false, Ordering::Relaxed);
    }

    /// A worker's share of the job: the three phases, each item from the shared counter, a barrier after each.
    fn job(&self, work: &LaneWork<'_>, pairs: &[(u32, u32)], worker: usize, buffers: &[SharedMut; 5], out: SharedMut) {
        // SAFETY: each worker's tile buffer is its own.
        let tile = unsafe { buffers[4].slice(worker * self.tile_values..(worker + 1) * self.tile_values) };
        let counts = [pairs.len(), self.gate_up_items.len(), self.down_items.len()];
        for (phase, &count) in counts.iter().enumerate() {
            loop {
                let item = self.next[phase].fetch_add(1, Ordering::Relaxed);
                if item >= count {
                    break;
                }
                let ran = catch_unwind(AssertUnwindSafe(|| match phase {
                    0 => self.gather(work, pairs, item, buffers),
                    1 => self.gate_up_item(work, self.gate_up_items[item], buffers, tile),
                    _ => self.down_item(work, self.down_items[item], buffers, out, tile),
                }));
                if ran.is_err() {
                    self.failed.store(true, Ordering::Relaxed);
                }
                self.done[phase].fetch_add(1, Ordering::Release);
            }
            while self.done[phase].load(Ordering::Acquire) < count {
                std::hint::spin_loop();
            }
        }
    }

    /// Phase 0: the row of grouped position `at` (pair `order[at]`) copied into `gathered`.
    fn gather(&self, work: &LaneWork<'_>, pairs: &[(u32, u32)], at: usize, buffers: &[SharedMut; 5]) {
        let hidden = work.hidden;
        let row = pairs[self.order[at] as usize].0 as usize;
        // SAFETY: position `at`'s row is this item's alone.
        let dst = unsafe { buffers[0].slice(at * hidden..(at + 1) * hidden) };
        dst.copy_from_slice(&work.x[row * hidden..(row + 1) * hidden]);
    }

    /// Phase 1: gate and up rows `a..b` of a group's expert for all its rows, then the activation into `act`.
    fn gate_up_item(&self, work: &LaneWork<'_>, item: Item, buffers: &[SharedMut; 5], tile: &mut [f32]) {
        let Group { expert, start, rows } = self.groups[item.group];
        let e = &work.experts[expert as usize];
        let (hidden, inter) = (work.hidden, work.inter);
        let (a, b) = item.rows;
        let n = b - a;
        // SAFETY: phase 0 finished writing these rows; this phase only reads them.
        let x = unsafe { buffers[0].slice(start * hidden..(start + rows) * hidden) };
        // The group's gate/up scratch is `2 * rows * inter` values; this item's part is `2 * rows * n` of them.
        let scratch_at = 2 * inter * start + 2 * rows * a;
        // SAFETY: items of one group cover disjoint row ranges, so their scratch parts are disjoint.
        let scratch = unsafe { buffers[1].slice(scratch_at..scratch_at + 2 * rows * n) };
        let (gate, up) = scratch.split_at_mut(rows * n);
        product(x, rows, e, 0, (inter, hidden), a..b, gate, tile);
        product(x, rows, e, 1, (inter, hidden), a..b, up, tile);
        for (values, bias) in [(&mut *gate, e.gate_bias), (&mut *up, e.up_bias)] {
            add_bias(values, bias.map(|bias| &bias[a..b]));
        }
        for t in 0..rows {
            // SAFETY: columns a..b of the group's row t are this item's alone.
            let act_at = (start + t) * inter;
            let act = unsafe { buffers[2].slice(act_at + a..act_at + b) };
            let (g, u) = (&gate[t * n..(t + 1) * n], &up[t * n..(t + 1) * n]);
            for ((out, &g), &u) in act.iter_mut().zip(g).zip(u) {
                *out = activate(work.activation, g, u);
            }
        }
    }

    /// Phase 2: down features `a..b` of a group's expert for all its rows, into their pairs' rows of `out`.
    fn down_item(&self, work: &LaneWork<'_>, item: Item, buffers: &[SharedMut; 5], out: SharedMut, tile: &mut [f32]) {
        let Group { expert, start, rows } = self.groups[item.group];
        let e = &work.experts[expert as usize];
        let (hidden, inter) = (work.hidden, work.inter);
        let (a, b) = item.rows;
        let n = b - a;
        // SAFETY: phase 1 finished writing the group's activations; this phase only reads them.
        let act = unsafe { buffers[2].slice(start * inter..(start + rows) * inter) };
        let scratch_at = hidden * start + rows * a;
        // SAFETY: disjoint per item, as in phase 1.
        let scratch = unsafe { buffers[3].slice(scratch_at..scratch_at + rows * n) };
        product(act, rows, e, 2, (hidden, inter), a..b, scratch, tile);
        add_bias(scratch, e.down_bias.map(|bias| &bias[a..b]));
        for t in 0..rows {
            let pair = self.order[start + t] as usize;
            // SAFETY: features a..b of each of the group's pairs are this item's alone.
            let dst = unsafe { out.slice(pair * hidden + a..pair * hidden + b) };
            dst.copy_from_slice(&scratch[t * n..(t + 1) * n]);
        }
    }
}

/// Rows `rows` of matrix `m` (gate, up, down; `[n, k]`) of `e` against the `tokens` rows of `x`, into `out`
/// (`[tokens, rows.len()]`): in place through the GEMV kernels, or for MXFP4 through cpu/mxfp4.rs with `tile` (a
/// worker's tile buffer).
#[allow(clippy::too_many_arguments)]
fn product(
    x: &[f32],
    tokens: usize,
    e: &LaneExpert<'_>,
    m: usize,
    (n, k): (usize, usize),
    rows: Range<usize>,
    out: &mut [f32],
    tile: &mut [f32],
) {
    let w = [e.gate, e.up, e.down][m];
    let width = rows.len();
    match e.dtype {
        LaneDType::Gemv(dtype) => {
            let row_bytes = k * dtype.size_bytes();
            let w = &w[rows.start * row_bytes..rows.end * row_bytes];
            matmul_serial(x, tokens, k, w, encoding(e, dtype, m, rows, k), width, out);
        }
        LaneDType::Mxfp4 => product_rows(x, tokens, k, w, n, rows, out, tile),
    }
}

/// How rows `rows` of matrix `m` (gate, up, down) of `e`, each of `k` columns, are stored in `dtype`: for FP8 the
/// scale grid's rows that cover them (`rows.start` is a multiple of the scale blocks' rows, as the chunks are).
fn encoding<'a>(e: &LaneExpert<'a>, dtype: WeightDType, m: usize, rows: Range<usize>, k: usize) -> WeightEncoding<'a> {
    let scales = e.scales.map(|all| {
        let s = all[m];
        let per_row = 4 * k.div_ceil(s.block_cols);
        let grid_rows = rows.start / s.block_rows..rows.end.div_ceil(s.block_rows);
        BlockScales {
            bytes: &s.bytes[grid_rows.start * per_row..grid_rows.end * per_row],
            ..s
        }
    });
    WeightEncoding { dtype, scales }
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b) * b
}

/// `values` (rows of `bias.len()` features) plus `bias` in every row, as `cpu/moe.rs`'s `with_bias` adds it.
fn add_bias(values: &mut [f32], bias: Option<&[f32]>) {
    if let Some(bias) = bias {
        for row in values.chunks_mut(bias.len()) {
            row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
        }
    }
}

/// The expert's activation of one gate and up value, as `cpu/moe.rs` computes it.
fn activate(activation: ExpertActivation, g: f32, u: f32) -> f32 {
    match activation {
        ExpertActivation::SiluGlu => silu(g) * u,
        ExpertActivation::ClampedSwiGlu { alpha, limit } => {
            let g = g.min(limit);
            (u.clamp(-limit, limit) + 1.0) * g * sigmoid(alpha * g)
        }
    }
}

/// Every shape of `work` and `out`, as `Error::Shape` (the lane's callers build them).
fn check(work: &LaneWork<'_>, out: &[f32]) -> Result<()> {
    let (hidden, inter) = (work.hidden, work.inter);
    let fail = |what: String| Err(Error::Shape(format!("CPU lane: {what}")));
    if hidden == 0 || !work.x.len().is_multiple_of(hidden) {
        return fail(format!("{} values are not rows of {hidden}", work.x.len()));
    }
    if out.len() != work.pairs.len() * hidden {
        return fail(format!(
            "{} outputs for {} pairs of {hidden}",
            out.len(),
            work.pairs.len()
        ));
    }
    let rows = work.x.len() / hidden;
    if let Some(&(r, e)) = work
        .pairs
        .iter()
        .find(|&&(r, e)| r as usize >= rows || e as usize >= work.experts.len())
    {
        return fail(format!(
            "pair (row {r}, expert {e}) of {rows} rows and {} experts",
            work.experts.len()
        ));
    }
    let first = work.experts.first();
    for e in work.experts {
        let packs =
            e.dtype != LaneDType::Mxfp4 || (hidden.is_multiple_of(MXFP4_BLOCK) && inter.is_multiple_of(MXFP4_BLOCK));
        let matrices = packs
            && [e.gate.len(), e.up.len(), e.down.len()]
                == [
                    e.dtype.matrix_bytes(inter, hidden),
                    e.dtype.matrix_bytes(inter, hidden),
                    e.dtype.matrix_bytes(hidden, inter),
                ];
        let biases = [(e.gate_bias, inter), (e.up_bias, inter), (e.down_bias, hidden)]
            .iter()
            .all(|(b, len)| b.is_none_or(|b| b.len() == *len));
        if !matrices || !biases {
            return fail(format!(
                "an expert that is not [{inter}, {hidden}] x 2 + [{hidden}, {inter}] with biases to match (MXFP4: \
                 both multiples of 32)"
            ));
        }
        let blocks = |e: &LaneExpert| e.scales.map(|s| s.map(|s| (s.block_rows, s.block_cols)));
        let scales = match e.scales {
            None => e.dtype != LaneDType::Gemv(WeightDType::F8E4M3),
            Some(s) => {
                e.dtype == LaneDType::Gemv(WeightDType::F8E4M3)
                    && blocks(e) == first.and_then(blocks)
                    && s.iter()
                        .zip([(inter, hidden), (inter, hidden), (hidden, inter)])
                        .all(|(s, (n, k))| {
                            s.block_rows > 0
                                && s.block_cols > 0
                                && s.bytes.len() == 4 * n.div_ceil(s.block_rows) * k.div_ceil(s.block_cols)
                        })
            }
        };
        if !scales || e.dtype != first.map_or(e.dtype, |f| f.dtype) {
            return fail(format!(
                "an expert stored unlike the first, or FP8 without its [{inter}, {hidden}] and [{hidden}, {inter}] \
                 scale grids"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;

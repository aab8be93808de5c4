//! CUDA graphs of decode steps: the one place where the backend captures and replays a forward pass
//! ([`crate::backend::Backend::run_forward`]). A decode step of up to [`GEMV_MAX_ROWS`] rows issues about a dozen
//! short kernels per layer; replayed as one graph, the GPU runs them back to back instead of waiting on the host's
//! launches.
//!
//! What a graph bakes in, and how each stays true: the step's inputs (token ids, positions, KV slots, block
//! tables) sit in a persistent buffer per row count, written by one upload before every launch; every other
//! buffer of the step is allocated and freed inside the captured region (the stream-ordered allocator's graph
//! memory nodes), the logits copied into a persistent buffer before they are freed; attention's splits are sized
//! by the batch's key span ([`super::kv::key_span`]), which is part of the graph's key along with the row count,
//! the model (`owner`) and the KV pools. A new span, a regrown input buffer or another cache captures anew.
//!
//! Not for: steps with prefill rows, more than [`GEMV_MAX_ROWS`] rows (the MoE's grouped path reads routed ids
//! on the host), offloaded experts (the offload reads routes and rewrites slot tables each layer; its seam is
//! [`capturable`]) or recurrent state (the Gated DeltaNet kernels are chosen by slice lengths on the host). Those
//! run eagerly, as does every step when graphs are off (`--no-cuda-graphs`), the reference the tests hold
//! graphs to.

use std::collections::HashMap;

use cudarc::driver::{sys, CudaGraph, CudaSlice};
use ferry_kernels::constants::GEMV_MAX_ROWS;

use super::kv::{BatchLayout, DeviceBatch, DeviceKv};
use super::launch::{ptr, Ptr};
use super::{cuda_err, CudaBackend, CudaTensor};
use crate::backend::ForwardStep;
use crate::kv::KvCache;
use crate::{Error, Result};

/// Captured steps kept at once; the least recently replayed goes first.
const MAX_GRAPHS: usize = 32;

/// What a captured step's pointers and launch shapes depend on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct GraphKey {
    owner: u64,
    pools: (u64, usize),
    rows: usize,
    key_span: usize,
}

/// The persistent buffers of steps of one row count.
struct StepBuffers {
    /// The token ids, then the batch's words ([`super::kv::BatchWords`]).
    inputs: CudaSlice<u32>,
    /// `[rows, logits_width]`.
    logits: CudaSlice<f32>,
}

struct Captured {
    graph: CudaGraph,
    last_used: u64,
}

// SAFETY: CUDA requires that a graph's uses be serialised, not that they stay on one thread; every use of a
// `Captured` is under the mutex the backend keeps its `StepGraphs` in.
unsafe impl Send for Captured {}

/// The backend's captured decode steps and their input buffers.
#[derive(Default)]
pub(super) struct StepGraphs {
    buffers: HashMap<usize, StepBuffers>,
    graphs: HashMap<GraphKey, Captured>,
    clock: u64,
    /// Steps captured so far (the GPU tests check that graphs ran).
    captures: usize,
    /// Set when a capture failed: every step runs eagerly from then on.
    off: bool,
}

/// Where a captured step's ops find its inputs: set while the step's forward pass is issued, read by
/// `prepare_batch` and `embed` in place of the host's ids and batch.
/// Addresses, not [`Ptr`]s, so that the backend holding them stays `Send`.
#[derive(Clone, Copy)]
pub(super) struct StepInputs {
    ids: u64,
    batch: u64,
    layout: BatchLayout,
}

impl StepInputs {
    /// The step's token ids on the device, checked against the `ids` the model passes.
    pub(super) fn ids(&self, ids: &[u32]) -> Result<Ptr<u32>> {
        if ids.len() != self.layout.rows {
            return Err(Error::Shape(format!(
                "embed: {} ids in a captured step of {} rows",
                ids.len(),
                self.layout.rows
            )));
        }
        Ok(Ptr::at(self.ids))
    }

    /// The step's batch, read from its persistent inputs.
    pub(super) fn batch(&self) -> DeviceBatch {
        self.layout.on_device(Ptr::at(self.batch), None)
    }
}

/// Whether `step` can run as a graph on `kv`: decode rows only, few enough for the decode kernels, on a cache
/// without recurrent state, with experts resident (the caller keeps graphs off under offload).
fn capturable(kv: &DeviceKv, step: &ForwardStep<'_>) -> bool {
    let rows = step.ids.len();
    (1..=GEMV_MAX_ROWS).contains(&rows)
        && step.batch.len() == rows
        && step.batch.iter().all(|s| s.len == 1)
        && !kv.has_recurrent_state()
}

/// [`crate::backend::Backend::run_forward`] on the CUDA backend.
pub(super) fn run_forward(
    cuda: &CudaBackend,
    kv: &mut DeviceKv,
    step: &ForwardStep<'_>,
    forward: &mut dyn FnMut(&mut DeviceKv) -> Result<CudaTensor>,
) -> Result<CudaTensor> {
    let Some(graphs) = cuda.graphs.as_ref().filter(|_| capturable(kv, step)) else {
        return forward(kv);
    };
    let mut graphs = graphs.lock().unwrap_or_else(|e| e.into_inner());
    if graphs.off {
        return forward(kv);
    }
    let rows = step.ids.len();
    let words = kv.batch_words(step.batch)?;
    let StepGraphs {
        buffers,
        graphs: captured,
        clock,
        captures,
        off,
    } = &mut *graphs;
    let capacity = rows + words.layout.words_for(kv.blocks().num_blocks());
    let buffers = buffers_for(buffers, captured, cuda, rows, capacity, step.logits_width)?;
    let mut host = Vec::with_capacity(rows + words.words.len());
    host.extend_from_slice(step.ids);
    host.extend_from_slice(&words.words);
    cuda.stream
        .memcpy_htod(&host, &mut buffers.inputs.slice_mut(..host.len()))
        .map_err(cuda_err("uploading a step's inputs"))?;
    let inputs = StepInputs {
        ids: ptr(&buffers.inputs).address(),
        batch: ptr(&buffers.inputs).offset(rows).address(),
        layout: words.layout,
    };
    let key = GraphKey {
        owner: step.owner,
        pools: kv.pools_id(),
        rows,
        key_span: words.layout.key_span,
    };
    *clock += 1;
    if !captured.contains_key(&key) {
        match capture(cuda, kv, inputs, &mut buffers.logits, forward) {
            Ok(graph) => {
                evict_to(captured, MAX_GRAPHS - 1);
                *captures += 1;
                captured.insert(key, Captured { graph, last_used: 0 });
            }
            // The KV blocks of this step are taken: it runs eagerly over the inputs already uploaded, and so do
            // the steps after it.
            Err(e) => {
                tracing::warn!("CUDA graphs off: capturing a decode step failed: {e}");
                *off = true;
                return with_step_inputs(cuda, inputs, || forward(kv));
            }
        }
    }
    let graph = captured
        .get_mut(&key)
        .ok_or_else(|| Error::Cuda("a captured step went missing".into()))?;
    graph.last_used = *clock;
    graph.graph.launch().map_err(cuda_err("launching a captured step"))?;
    let out = cuda.tensor(rows, step.logits_width)?;
    let mut data = out.data;
    cuda.stream
        .memcpy_dtod(&buffers.logits, &mut data)
        .map_err(cuda_err("copying a step's logits"))?;
    Ok(CudaTensor { data, ..out })
}

/// Runs `issue` with the backend's ops reading the step's inputs from `inputs`.
fn with_step_inputs<T>(cuda: &CudaBackend, inputs: StepInputs, issue: impl FnOnce() -> Result<T>) -> Result<T> {
    *cuda.step_inputs.lock().unwrap_or_else(|e| e.into_inner()) = Some(inputs);
    let result = issue();
    *cuda.step_inputs.lock().unwrap_or_else(|e| e.into_inner()) = None;
    result
}

/// Captures `forward` over the step whose inputs are at `inputs`, its logits copied into `logits_out` (`[rows,
/// logits_width]`) before they are freed. The capture only records: the caller launches the graph.
fn capture(
    cuda: &CudaBackend,
    kv: &mut DeviceKv,
    inputs: StepInputs,
    logits_out: &mut CudaSlice<f32>,
    forward: &mut dyn FnMut(&mut DeviceKv) -> Result<CudaTensor>,
) -> Result<CudaGraph> {
    let issued = with_step_inputs(cuda, inputs, || {
        cuda.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(cuda_err("starting a step's capture"))?;
        let logits = forward(kv)?;
        if logits.data.len() != logits_out.len() {
            return Err(Error::Shape(format!(
                "a captured step returned [{}, {}] logits, not {} values",
                logits.rows,
                logits.cols,
                logits_out.len()
            )));
        }
        cuda.stream
            .memcpy_dtod(&logits.data, logits_out)
            .map_err(cuda_err("copying a step's logits"))
    });
    // Whatever happened, the capture ends here, so that the stream runs work again.
    let ended = cuda.stream.end_capture(sys::CUgraphInstantiate_flags(0));
    issued?;
    ended
        .map_err(cuda_err("capturing a step"))?
        .ok_or_else(|| Error::Cuda("a step's capture recorded nothing".into()))
}

/// The persistent buffers for steps of `rows` rows, (re)allocated when they are missing or too small; a new buffer
/// drops the graphs that read the old one.
fn buffers_for<'a>(
    buffers: &'a mut HashMap<usize, StepBuffers>,
    graphs: &mut HashMap<GraphKey, Captured>,
    cuda: &CudaBackend,
    rows: usize,
    input_words: usize,
    logits_width: usize,
) -> Result<&'a mut StepBuffers> {
    let fits = buffers
        .get(&rows)
        .is_some_and(|b| b.inputs.len() >= input_words && b.logits.len() == rows * logits_width);
    if !fits {
        graphs.retain(|key, _| key.rows != rows);
        buffers.insert(
            rows,
            StepBuffers {
                inputs: cuda.alloc(input_words)?,
                logits: cuda.alloc(rows * logits_width)?,
            },
        );
    }
    buffers
        .get_mut(&rows)
        .ok_or_else(|| Error::Cuda("a step's buffers went missing".into()))
}

/// Drops the least recently replayed graphs until at most `keep` are left.
fn evict_to(graphs: &mut HashMap<GraphKey, Captured>, keep: usize) {
    while graphs.len() > keep {
        let Some(oldest) = graphs.iter().min_by_key(|(_, c)| c.last_used).map(|(k, _)| *k) else {
            break;
        };
        graphs.remove(&oldest);
    }
}

impl StepGraphs {
    /// Steps captured so far.
    pub(super) fn captures(&self) -> usize {
        self.captures
    }
}

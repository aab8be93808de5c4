//! The CUDA backend: the same ops as the CPU backend on an NVIDIA GPU, with f32 activations and bf16 weights.
//!
//! Kernels come precompiled from ferry-kernels; the driver and cuBLAS are found and loaded at run time
//! ([`libs`]). Decode-sized products (up to [`GEMV_MAX_ROWS`] rows) run as GEMV kernels that read each weight
//! once; larger ones run on cuBLAS's bf16 tensor cores with the activations split into two bf16 halves
//! (`x = hi + lo`), which keeps f32 accuracy. Routed experts sit in one slab per layer and are read through a
//! per-layer table of device pointers, so an expert cache only has to rewrite the table.
//!
//! This file holds the backend's types and its [`Backend`] impl, each op handed to the file that owns its job:
//! context.rs (opening the GPU, the kernel table), launch.rs (typed kernel launches), memory.rs (buffers and
//! copies), linear.rs (GEMV and cuBLAS products), elementwise.rs, attention.rs, mla.rs (multi-head latent
//! attention), gdn.rs (Gated DeltaNet), moe.rs
//! (routing and the expert kernels), kv.rs (the paged KV cache), offload.rs and bank.rs (expert offload),
//! offload_lane.rs (its CPU lane), lane_ceilings.rs (the lanes' rates measured).

mod attention;
mod bank;
mod builder;
mod ceilings;
mod collective;
mod context;
mod elementwise;
mod expert_format;
mod flash_attention;
mod gdn;
mod graph;
mod kv;
mod lane_ceilings;
mod launch;
mod libs;
mod linear;
mod memory;
mod mla;
mod moe;
mod offload;
mod offload_lane;
pub mod workspace;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream};

use super::{
    AttentionParams, Backend, DeltaRuleParams, ExpertActivation, ExpertTensors, ForwardStep, MlaParams, QkNormWeights,
    ResidualNorm, Rope, Router, RouterKind, SeqSlice,
};
use crate::kv::{KvSpec, SeqId};
use crate::loader::TensorRef;
use crate::moe::OffloadStats;
use crate::{Error, Result};
pub use builder::CudaBackendBuilder;
pub use ceilings::GpuCeilings;
pub use collective::{HostStagedSum, NcclSum};
use context::{blas_err, cuda_err};
pub use ferry_kernels::constants::GEMV_MAX_ROWS;
pub use kv::{DeviceBatch, DeviceKv};
pub use lane_ceilings::LaneCeilings;
use launch::{ptr, Ptr};
pub use libs::CudaLibraries;
use linear::LinearWeight;
pub use offload::OffloadConfig;

/// A `[rows, cols]` f32 tensor in device memory.
pub struct CudaTensor {
    data: CudaSlice<f32>,
    rows: usize,
    cols: usize,
}

/// A weight on the device: a bf16 matrix `[rows, cols]`, or a vector widened to f32 (norms, biases).
pub enum CudaWeight {
    Matrix {
        data: CudaSlice<u8>,
        rows: usize,
        cols: usize,
    },
    /// A dense FP8 matrix, kept as stored (linear.rs reads it exactly): E4M3 `[rows, cols]` and its f32 scales,
    /// one per `block` of rows and columns.
    Fp8Matrix {
        data: CudaSlice<u8>,
        scales: CudaSlice<f32>,
        rows: usize,
        cols: usize,
        block: [usize; 2],
    },
    Vector(CudaSlice<f32>),
}

impl CudaWeight {
    /// The weight as a bf16 matrix, for the ops that take one.
    fn matrix(&self) -> Result<Bf16Matrix> {
        match self {
            CudaWeight::Matrix { data, rows, cols } => Ok(Bf16Matrix {
                data: ptr(data).cast(),
                rows: *rows,
                cols: *cols,
            }),
            CudaWeight::Fp8Matrix { .. } => Err(Error::Shape("an FP8 weight where bf16 is read".into())),
            CudaWeight::Vector(_) => Err(Error::Shape("a vector weight used as a matrix".into())),
        }
    }

    /// The weight as a linear layer's (bf16 or FP8) matrix.
    fn linear(&self) -> Result<LinearWeight> {
        match self.fp8_matrix() {
            Some(fp8) => Ok(LinearWeight::Fp8(fp8)),
            None => self.matrix().map(LinearWeight::Bf16),
        }
    }

    /// The weight as an FP8 matrix, if it is one.
    fn fp8_matrix(&self) -> Option<Fp8Matrix> {
        match self {
            CudaWeight::Fp8Matrix {
                data,
                scales,
                rows,
                cols,
                block,
            } => Some(Fp8Matrix {
                data: ptr(data),
                scales: ptr(scales),
                rows: *rows,
                cols: *cols,
                block: *block,
            }),
            _ => None,
        }
    }

    /// The weight as an f32 vector, for the ops that take one.
    fn vector(&self) -> Result<Ptr<f32>> {
        match self {
            CudaWeight::Vector(v) => Ok(ptr(v)),
            CudaWeight::Matrix { .. } | CudaWeight::Fp8Matrix { .. } => {
                Err(Error::Shape("a matrix weight used as a vector".into()))
            }
        }
    }
}

/// A bf16 matrix `[rows, cols]` on the device, by address: a weight, or one part of an expert's block.
#[derive(Clone, Copy)]
struct Bf16Matrix {
    data: Ptr<u16>,
    rows: usize,
    cols: usize,
}

/// A dense FP8 matrix `[rows, cols]` on the device, by address: E4M3 weights and their f32 scales, one per `block`
/// of rows and columns, row-major.
#[derive(Clone, Copy)]
struct Fp8Matrix {
    data: Ptr<u8>,
    scales: Ptr<f32>,
    rows: usize,
    cols: usize,
    block: [usize; 2],
}

/// One layer's routed experts, read by the expert kernels through a device table of block addresses indexed by
/// expert id. All resident: a slab of the layer's blocks (gate, up, down, bf16 or FP8 with their scales: see
/// expert_format.rs). Offloaded: the blocks live in the host bank and the table points into the shared cache slab,
/// rewritten each step for the routed experts.
pub enum CudaExperts {
    Resident {
        _slab: CudaSlice<u8>,
        table: CudaSlice<u64>,
        addresses: Vec<u64>,
        hidden: usize,
        inter: usize,
        format: expert_format::ExpertFormat,
        glu: expert_format::ExpertGlu,
        /// A rank's share under expert parallelism: the other ranks' entries of `table` are null.
        shard: bool,
    },
    Offloaded {
        layer: usize,
        table: CudaSlice<u64>,
        hidden: usize,
        inter: usize,
        format: expert_format::ExpertFormat,
        glu: expert_format::ExpertGlu,
        /// A rank's share under expert parallelism: the other ranks' experts are never in `table`.
        shard: bool,
    },
}

impl CudaExperts {
    fn shape(&self) -> (usize, usize) {
        match self {
            CudaExperts::Resident { hidden, inter, .. } | CudaExperts::Offloaded { hidden, inter, .. } => {
                (*hidden, *inter)
            }
        }
    }

    fn format(&self) -> expert_format::ExpertFormat {
        match self {
            CudaExperts::Resident { format, .. } | CudaExperts::Offloaded { format, .. } => *format,
        }
    }

    fn glu(&self) -> expert_format::ExpertGlu {
        match self {
            CudaExperts::Resident { glu, .. } | CudaExperts::Offloaded { glu, .. } => *glu,
        }
    }

    fn shard(&self) -> bool {
        match self {
            CudaExperts::Resident { shard, .. } | CudaExperts::Offloaded { shard, .. } => *shard,
        }
    }
}

/// RoPE frequencies on the device.
pub struct CudaRope {
    inv_freq: CudaSlice<f32>,
    rotary_dim: usize,
    attention_factor: f32,
}

/// Routing kept on the device: `ids` and `weights` are `[rows, top_k]`.
pub struct CudaRouting {
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    rows: usize,
    top_k: usize,
}

/// One GPU opened for ferry (context.rs's [`CudaBackend::new`]): its context, the compute stream every op runs on
/// in order, cuBLAS on that stream, and the loaded kernels.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// Every kernel of context.rs's table, by name.
    functions: HashMap<&'static str, CudaFunction>,
    /// The block count of the kernels with a last-block epilogue (common.cuh's `last_block_done`: the fused
    /// residual norm and router GEMVs, moe_down's residual epilogue); zero between launches, which run in order on
    /// `stream`.
    block_counter: CudaSlice<u32>,
    /// Whether kernels launch as programmatic dependents of the kernel before them (sm_90 on, unless
    /// [`CudaBackendBuilder::dependent_launch`] turns it off: launch.rs).
    dependent_launch: bool,
    /// Built with the backend ([`CudaBackend::builder`]) when the routed experts are offloaded.
    offload: Option<Mutex<offload::Offload>>,
    /// Captured decode steps (graph.rs); None when graphs are off (`--no-cuda-graphs`, or experts offloaded).
    graphs: Option<Mutex<graph::StepGraphs>>,
    /// While a step is captured: where its ops read the step's inputs (graph.rs).
    step_inputs: Mutex<Option<graph::StepInputs>>,
    device: String,
    /// Streaming multiprocessors: decode attention splits its keys so as to fill them.
    multiprocessors: usize,
    /// The most shared memory a block may opt into (the attention kernel's pipeline depth depends on it).
    max_shared_per_block: usize,
    /// Attention blocks one multiprocessor runs at once, by (kernel, threads, shared bytes) of the block: asked of the
    /// driver once per shape, not at every decode step.
    attention_blocks_per_multiprocessor: Mutex<HashMap<(&'static str, u32, usize), usize>>,
    pub libraries: CudaLibraries,
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Experts = CudaExperts;
    type Kv = DeviceKv;
    type Batch = DeviceBatch;
    type Routing = CudaRouting;
    type RopeTable = CudaRope;

    fn name(&self) -> String {
        format!("cuda: {}", self.device)
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(cuda_err("synchronize"))
    }

    fn offload_stats(&self) -> Option<OffloadStats> {
        self.offload
            .as_ref()
            .map(|o| o.lock().unwrap_or_else(|e| e.into_inner()).stats())
    }

    fn weight(&self, tensor: TensorRef) -> Result<CudaWeight> {
        self.upload_weight(tensor)
    }

    fn check_router(&self, kind: RouterKind) -> Result<()> {
        moe::check_router(kind)
    }

    fn experts(&self, experts: Vec<ExpertTensors>, activation: ExpertActivation) -> Result<CudaExperts> {
        moe::upload_experts(self, experts, activation)
    }

    fn expert_shard(&self, experts: Vec<Option<ExpertTensors>>, activation: ExpertActivation) -> Result<CudaExperts> {
        moe::upload_expert_shard(self, experts, activation)
    }

    fn rope_table(&self, rope: &Rope) -> Result<CudaRope> {
        self.upload_rope(rope)
    }

    fn new_kv(&self, spec: KvSpec) -> Result<DeviceKv> {
        DeviceKv::new(&self.stream, spec)
    }

    fn prepare_batch(&self, kv: &mut DeviceKv, batch: &[SeqSlice]) -> Result<DeviceBatch> {
        // A captured step's blocks were taken and its batch uploaded before the capture began.
        if let Some(inputs) = *self.step_inputs.lock().unwrap_or_else(|e| e.into_inner()) {
            return Ok(inputs.batch());
        }
        if let Some(offload) = &self.offload {
            offload.lock().unwrap_or_else(|e| e.into_inner()).start_batch(batch);
        }
        kv.prepare(&self.stream, batch)
    }

    fn save_state(&self, kv: &mut DeviceKv, seq: SeqId, slot: usize) -> Result<()> {
        kv.save_state(&self.stream, seq, slot)
    }

    fn restore_state(&self, kv: &mut DeviceKv, seq: SeqId, slot: usize) -> Result<()> {
        kv.restore_state(&self.stream, seq, slot)
    }

    fn run_forward(
        &self,
        kv: &mut DeviceKv,
        step: &ForwardStep<'_>,
        forward: &mut dyn FnMut(&mut DeviceKv) -> Result<CudaTensor>,
    ) -> Result<CudaTensor> {
        let started = std::time::Instant::now();
        let out = graph::run_forward(self, kv, step, forward);
        if let Some(offload) = &self.offload {
            let seconds = started.elapsed().as_secs_f64();
            offload.lock().unwrap_or_else(|e| e.into_inner()).end_step(seconds);
        }
        out
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaTensor> {
        self.upload_tensor(data, rows, cols)
    }

    fn to_host(&self, x: &CudaTensor) -> Result<Vec<f32>> {
        self.tensor_to_host(x)
    }

    fn argmax_rows(&self, x: &CudaTensor, cols: usize) -> Result<Vec<u32>> {
        elementwise::argmax_rows(self, x, cols)
    }

    fn shape(&self, x: &CudaTensor) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32]) -> Result<CudaTensor> {
        let captured = *self.step_inputs.lock().unwrap_or_else(|e| e.into_inner());
        match captured {
            // The captured step's ids, uploaded with its batch (the same ids).
            Some(inputs) => elementwise::embed_from(self, table, inputs.ids(ids)?, ids.len()),
            None => elementwise::embed(self, table, ids),
        }
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaWeight, group: usize, eps: f32) -> Result<CudaTensor> {
        elementwise::rms_norm(self, x, weight, group, eps)
    }

    fn linear(&self, x: &CudaTensor, w: &CudaWeight, bias: Option<&CudaWeight>) -> Result<CudaTensor> {
        let bias = bias.map(|b| b.vector()).transpose()?;
        self.matmul(x, w.linear()?, bias)
    }

    fn linear_add_rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        into: ResidualNorm<'_, CudaTensor, CudaWeight>,
    ) -> Result<CudaTensor> {
        if (1..=GEMV_MAX_ROWS).contains(&x.rows) {
            let bias = bias.map(|b| b.vector()).transpose()?;
            let norm = into.weight.vector()?;
            return self.matmul_add_rms_norm(x, w.linear()?, bias, into.residual, norm, into.eps);
        }
        let y = self.linear(x, w, bias)?;
        self.add_rms_norm(into.residual, &y, into.weight, into.eps)
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        elementwise::add_assign(self, x, y)
    }

    fn add_rms_norm(&self, x: &mut CudaTensor, y: &CudaTensor, weight: &CudaWeight, eps: f32) -> Result<CudaTensor> {
        elementwise::add_rms_norm(self, x, y, weight, eps)
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
        elementwise::silu_mul(self, gate, up)
    }

    fn sigmoid_gate(&self, x: &mut CudaTensor, gate: &CudaTensor) -> Result<()> {
        elementwise::sigmoid_gate(self, x, gate)
    }

    fn causal_conv1d(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        kv: &mut DeviceKv,
        layer: usize,
        batch: &DeviceBatch,
    ) -> Result<CudaTensor> {
        gdn::causal_conv1d(self, x, weight, kv.recurrent_offsets(layer)?.conv, batch)
    }

    fn gated_delta_rule(
        &self,
        qkv: &CudaTensor,
        a: &CudaTensor,
        b: &CudaTensor,
        a_log: &CudaWeight,
        dt_bias: &CudaWeight,
        kv: &mut DeviceKv,
        layer: usize,
        batch: &DeviceBatch,
        params: &DeltaRuleParams,
    ) -> Result<CudaTensor> {
        let gates = gdn::Gates { a, b, a_log, dt_bias };
        let delta_offset = kv.recurrent_offsets(layer)?.delta;
        gdn::gated_delta_rule(self, qkv, &gates, delta_offset, batch, params)
    }

    fn attention(
        &self,
        qkv: &CudaTensor,
        qk_norm: Option<QkNormWeights<'_, CudaWeight>>,
        sinks: Option<&CudaWeight>,
        rope: &CudaRope,
        kv: &mut DeviceKv,
        layer: usize,
        batch: &DeviceBatch,
        p: &AttentionParams,
    ) -> Result<CudaTensor> {
        let pools = kv.layer_pools(layer, p.num_kv_heads * p.head_dim)?;
        let q = attention::qkv_rope_kv_append(self, qkv, qk_norm, rope, pools, batch, p)?;
        attention::attend(self, &q, sinks, kv, layer, batch, p)
    }

    fn mla_attention(
        &self,
        q: &CudaTensor,
        compressed: &CudaTensor,
        kv_norm: &CudaWeight,
        kv_b: &CudaWeight,
        rope: &CudaRope,
        kv: &mut DeviceKv,
        layer: usize,
        batch: &DeviceBatch,
        params: &MlaParams,
    ) -> Result<CudaTensor> {
        mla::mla_attention(self, q, compressed, kv_norm, kv_b, rope, kv, layer, batch, params)
    }

    fn route(&self, logits: &CudaTensor, router: Router<'_, CudaWeight>) -> Result<CudaRouting> {
        moe::route(self, logits, router)
    }

    fn route_linear(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        router: Router<'_, CudaWeight>,
    ) -> Result<CudaRouting> {
        match moe::route_linear(self, x, w, bias, &router)? {
            Some(routing) => Ok(routing),
            None => self.route(&self.linear(x, w, bias)?, router),
        }
    }

    fn routing_to_host(&self, routing: &CudaRouting) -> Result<Vec<u32>> {
        moe::routing_to_host(self, routing)
    }

    fn routing_from_host(&self, ids: &[u32], weights: &[f32], top_k: usize) -> Result<CudaRouting> {
        moe::routing_from_host(self, ids, weights, top_k)
    }

    fn moe_experts(&self, x: &CudaTensor, routing: &CudaRouting, experts: &CudaExperts) -> Result<CudaTensor> {
        moe::moe_experts(self, x, routing, experts, None).map(|(out, _)| out)
    }

    fn moe_experts_add_rms_norm(
        &self,
        x: &CudaTensor,
        routing: &CudaRouting,
        experts: &CudaExperts,
        shared: Option<&CudaTensor>,
        into: ResidualNorm<'_, CudaTensor, CudaWeight>,
    ) -> Result<CudaTensor> {
        let hidden = experts.shape().0;
        let mismatch = |t: &CudaTensor| (t.rows, t.cols) != (x.rows, hidden);
        if mismatch(into.residual) || shared.is_some_and(mismatch) {
            return Err(Error::Shape(format!(
                "moe_experts_add_rms_norm: a residual or shared expert output that is not [{}, {hidden}]",
                x.rows
            )));
        }
        let epilogue = moe::ResidualEpilogue {
            shared: shared.map_or(Ptr::null(), |s| ptr(&s.data)),
            residual: ptr(&into.residual.data),
            norm: into.weight.vector()?,
            eps: into.eps,
        };
        let (mut out, fused) = moe::moe_experts(self, x, routing, experts, Some(epilogue))?;
        if fused {
            return Ok(out);
        }
        if let Some(shared) = shared {
            self.add_assign(&mut out, shared)?;
        }
        self.add_rms_norm(into.residual, &out, into.weight, into.eps)
    }

    fn wants_routing_guess(&self, rows: usize) -> bool {
        self.offload.as_ref().is_some_and(|o| {
            o.lock()
                .unwrap_or_else(|e| e.into_inner())
                .wants_guess(rows, moe::MOE_DECODE_MAX_ROWS)
        })
    }

    fn guess_routing(&self, experts: &CudaExperts, routing: CudaRouting) -> Result<()> {
        if let (Some(offload), CudaExperts::Offloaded { layer, .. }) = (&self.offload, experts) {
            offload
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .guess_next(*layer, routing);
        }
        Ok(())
    }

    fn guess_routing_now(&self, experts: &CudaExperts, routing: CudaRouting) -> Result<()> {
        if let (Some(offload), CudaExperts::Offloaded { layer, .. }) = (&self.offload, experts) {
            offload
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .guess_now(&self.stream, *layer, routing)?;
        }
        Ok(())
    }

    fn select_rows(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
        elementwise::select_rows(self, x, rows)
    }
}

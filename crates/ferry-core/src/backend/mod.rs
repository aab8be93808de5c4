//! The contract between model code and the hardware that runs it.
//!
//! Model families are written once against [`Backend`]; a backend owns where activations, weights, experts and
//! the KV cache live and how each op runs. The CPU backend ([`cpu::CpuBackend`]) is the numerical reference; the
//! CUDA backend ([`cuda::CudaBackend`]) runs the same ops on an NVIDIA GPU. Activations are 2-D `[rows, cols]`
//! f32 tensors whose rows are the tokens of a batch, one sequence after another as the batch's [`SeqSlice`]s say.
//! Every op returns a `Result`: a device can fail (out of memory, a lost context), and that must reach the caller
//! as an error, never a panic.

pub mod cpu;
pub mod cuda;

use crate::kv::{KvCache, KvSpec, SeqId};
use crate::loader::TensorRef;
use crate::Result;

/// A run of `len` consecutive batch rows belonging to sequence `seq`, at positions `start_pos..start_pos + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSlice {
    pub seq: SeqId,
    pub start_pos: usize,
    pub len: usize,
}

/// The positions of every row of a batch, in order.
pub fn batch_positions(batch: &[SeqSlice]) -> Vec<u32> {
    batch
        .iter()
        .flat_map(|s| (s.start_pos..s.start_pos + s.len).map(|p| p as u32))
        .collect()
}

/// Rotary position embedding (HF's rotate-half layout) over the first `rotary_dim` features of each head.
#[derive(Clone, Debug)]
pub struct Rope {
    pub head_dim: usize,
    pub rotary_dim: usize,
    /// `1 / theta^(2i / rotary_dim)` for i in 0..rotary_dim / 2, computed in f32 as transformers does.
    pub inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(theta: f32, head_dim: usize, rotary_dim: usize) -> Self {
        let inv_freq = (0..rotary_dim / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / rotary_dim as f32))
            .collect();
        Rope {
            head_dim,
            rotary_dim,
            inv_freq,
        }
    }
}

#[derive(Clone, Debug)]
pub struct AttentionParams {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Keys further back than this many positions are masked (Mixtral's sliding window); None: full causal.
    pub sliding_window: Option<usize>,
}

/// How a router turns logits into routing weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterKind {
    /// Softmax over all experts, keep the top k; `renormalize` rescales the kept weights to sum to one.
    SoftmaxTopK { renormalize: bool },
}

/// One routed expert's SwiGLU weights, `down(silu(gate x) * up x)`, as stored in the checkpoint.
#[derive(Clone, Debug)]
pub struct ExpertTensors {
    pub gate: TensorRef,
    pub up: TensorRef,
    pub down: TensorRef,
}

pub trait Backend: Send + Sync + Sized {
    /// A `[rows, cols]` f32 activation tensor.
    type Tensor: Send;
    /// A weight in its stored dtype: a matrix `[out, in]` or a vector.
    type Weight: Send + Sync;
    /// The routed experts of one MoE layer, wherever the backend keeps them.
    type Experts: Send + Sync;
    /// The KV cache of every running sequence.
    type Kv: KvCache;
    /// What the ops of one forward pass need to know about its batch (positions, KV slots), prepared once.
    type Batch;
    /// Each row's chosen experts and their weights, as [`Backend::route`] leaves them.
    type Routing;
    /// A [`Rope`]'s frequencies where the rope op reads them.
    type RopeTable: Send + Sync;

    fn name(&self) -> String;

    /// A weight matrix `[out, in]` (also embedding tables `[vocab, hidden]`) or vector.
    fn weight(&self, tensor: TensorRef) -> Result<Self::Weight>;
    /// One MoE layer's routed experts.
    fn experts(&self, experts: Vec<ExpertTensors>) -> Result<Self::Experts>;
    fn rope_table(&self, rope: &Rope) -> Result<Self::RopeTable>;
    fn new_kv(&self, spec: KvSpec) -> Result<Self::Kv>;
    /// Reserves KV room for the batch's new tokens and prepares its per-row positions and slots; fails (before
    /// any work) when a sequence is unknown, out of step with the batch, or the cache is full.
    fn prepare_batch(&self, kv: &mut Self::Kv, batch: &[SeqSlice]) -> Result<Self::Batch>;

    /// A tensor holding `data` (`rows * cols` values).
    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Tensor>;
    fn to_host(&self, x: &Self::Tensor) -> Result<Vec<f32>>;
    fn shape(&self, x: &Self::Tensor) -> (usize, usize);

    /// Rows of `table` for `ids`.
    fn embed(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Tensor>;
    /// RMSNorm of each `group`-wide chunk of every row, times `weight` (`group` features). `group == cols` is a
    /// plain norm; `group == head_dim` is a per-head q/k norm.
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Weight, group: usize, eps: f32) -> Result<Self::Tensor>;
    /// `x W^T (+ bias)`.
    fn linear(&self, x: &Self::Tensor, w: &Self::Weight, bias: Option<&Self::Weight>) -> Result<Self::Tensor>;
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    /// `silu(gate) * up`, elementwise.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;
    /// `x[r, :] *= sigmoid(gate[r, 0])`.
    fn sigmoid_gate(&self, x: &mut Self::Tensor, gate: &Self::Tensor) -> Result<()>;
    /// Rotates `x` (`[rows, heads * head_dim]`) in place, each row at its position in the batch.
    fn rope(&self, x: &mut Self::Tensor, batch: &Self::Batch, rope: &Self::RopeTable) -> Result<()>;
    /// Writes k and v of the batch into the cache of `layer`, then causal attention of q over each sequence.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        kv: &mut Self::Kv,
        layer: usize,
        batch: &Self::Batch,
        params: &AttentionParams,
    ) -> Result<Self::Tensor>;
    /// Router logits `[rows, experts]` to each row's top-k experts and weights.
    fn route(&self, logits: &Self::Tensor, top_k: usize, kind: RouterKind) -> Result<Self::Routing>;
    /// `sum_k weight_k * expert_k(x)` for each row, summed in router order: the routed part of a MoE block.
    fn moe_experts(&self, x: &Self::Tensor, routing: &Self::Routing, experts: &Self::Experts) -> Result<Self::Tensor>;
    /// The rows `rows` of `x`, in that order.
    fn select_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor>;
}

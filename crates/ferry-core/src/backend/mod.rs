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
pub mod expert_parallel;
pub mod profiled;

use std::sync::atomic::{AtomicU64, Ordering};

use crate::kv::{KvCache, KvSpec, SeqId};
use crate::loader::TensorRef;
use crate::moe::OffloadStats;
use crate::{Error, Result};

/// A run of `len` consecutive batch rows belonging to sequence `seq`, at positions `start_pos..start_pos + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSlice {
    pub seq: SeqId,
    pub start_pos: usize,
    pub len: usize,
}

/// What [`Backend::run_forward`] knows of a forward pass besides its closure: the rows' token ids and slices, who
/// runs it (`owner`: one id per model and KV cache, so that a step captured for one is never replayed for another)
/// and the width of the logits it returns.
pub struct ForwardStep<'a> {
    pub ids: &'a [u32],
    pub batch: &'a [SeqSlice],
    pub owner: u64,
    pub logits_width: usize,
}

impl ForwardStep<'_> {
    /// An owner id no other model and cache of this process has.
    pub fn new_owner() -> u64 {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }
}

/// The positions of every row of a batch, in order.
pub fn batch_positions(batch: &[SeqSlice]) -> Vec<u32> {
    batch
        .iter()
        .flat_map(|s| (s.start_pos..s.start_pos + s.len).map(|p| p as u32))
        .collect()
}

/// Rotary position embedding (HF's rotate-half layout) over the first `rotary_dim` features of each head: feature
/// pair (i, i + rotary_dim / 2) at position p is rotated by the angle `p * inv_freq[i]`, with cos and sin both
/// multiplied by `attention_factor` (YaRN's; 1 otherwise), as transformers multiplies its cos/sin tables.
#[derive(Clone, Debug)]
pub struct Rope {
    pub head_dim: usize,
    pub rotary_dim: usize,
    /// One frequency per feature pair, `rotary_dim / 2` of them.
    pub inv_freq: Vec<f32>,
    pub attention_factor: f32,
}

impl Rope {
    /// Plain RoPE: `inv_freq[i] = 1 / theta^(2i / rotary_dim)`, computed in f32 as transformers does.
    pub fn new(theta: f32, head_dim: usize, rotary_dim: usize) -> Self {
        Rope {
            head_dim,
            rotary_dim,
            inv_freq: plain_inv_freq(theta, rotary_dim),
            attention_factor: 1.0,
        }
    }
}

/// `theta^(2i / rotary_dim)` for i in 0..rotary_dim / 2, in f32: the wavelengths (over 2 pi) of plain RoPE.
pub fn rope_wavelengths(theta: f32, rotary_dim: usize) -> impl Iterator<Item = f32> {
    (0..rotary_dim / 2).map(move |i| theta.powf((2 * i) as f32 / rotary_dim as f32))
}

fn plain_inv_freq(theta: f32, rotary_dim: usize) -> Vec<f32> {
    rope_wavelengths(theta, rotary_dim).map(|w| 1.0 / w).collect()
}

#[derive(Clone, Debug)]
pub struct AttentionParams {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Keys further back than this many positions are masked (the layer's attention window); None: full causal.
    pub sliding_window: Option<usize>,
}

impl AttentionParams {
    /// Checks that a fused q/k/v projection (what [`Backend::attention`] takes) has `cols` features: the queries,
    /// keys and values of every head.
    pub fn check_qkv_width(&self, cols: usize) -> Result<()> {
        let expected = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim;
        if cols != expected {
            return Err(Error::Shape(format!(
                "attention: {cols} projected features, expected {expected}"
            )));
        }
        Ok(())
    }
}

/// The shape of a multi-head latent attention layer (DeepSeek-V2/V3's and Kimi-K2's MLA; see
/// [`Backend::mla_attention`]).
#[derive(Clone, Debug, PartialEq)]
pub struct MlaParams {
    pub num_heads: usize,
    /// Features of the compressed kv each token keeps (`c`).
    pub kv_lora_rank: usize,
    /// Per head: query and key features without position (`nope`) and with RoPE (`rope`), value features.
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub scale: f32,
    /// RoPE rotates features (2i, 2i + 1) together (DeepSeek's `rope_interleave`) rather than (i, i + rope / 2).
    pub rope_interleaved: bool,
    /// `kv_a_layernorm`'s epsilon.
    pub eps: f32,
}

impl MlaParams {
    /// Features of one row of queries: per head `nope` then `rope`.
    pub fn q_width(&self) -> usize {
        self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
    }

    /// Features one token keeps in the latent cache: `c`, then the shared RoPE key.
    pub fn latent_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// Rows of `kv_b_proj`: per head its key (`nope`) rows, then its value rows.
    pub fn kv_b_rows(&self) -> usize {
        self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
    }

    pub fn out_width(&self) -> usize {
        self.num_heads * self.v_head_dim
    }
}

/// Checks that `len` values fill a `[rows, cols]` tensor (what [`Backend::upload`] is given).
pub(crate) fn check_upload(len: usize, rows: usize, cols: usize) -> Result<()> {
    if len != rows * cols {
        return Err(Error::Shape(format!("{len} values for a [{rows}, {cols}] tensor")));
    }
    Ok(())
}

/// Checks that [`Backend::argmax_rows`] is asked for 1 to `width` (the tensor's cols) columns.
pub(crate) fn check_argmax_cols(cols: usize, width: usize) -> Result<()> {
    if !(1..=width).contains(&cols) {
        return Err(Error::Shape(format!("argmax_rows: {cols} columns of {width}")));
    }
    Ok(())
}

/// The q/k RMSNorm some families apply before RoPE (Qwen3, OLMoE): scales for the queries and the keys, each
/// normalised per head (`per_head`, scales of `head_dim`) or over all its heads at once (scales of the full width).
#[derive(Clone, Copy, Debug)]
pub struct QkNormWeights<'a, W> {
    pub q: &'a W,
    pub k: &'a W,
    pub per_head: bool,
    pub eps: f32,
}

/// The shape of a Gated DeltaNet layer's delta rule (see [`Backend::gated_delta_rule`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeltaRuleParams {
    pub num_k_heads: usize,
    /// A multiple of `num_k_heads`; value head `h` reads key (and query) head `h / (num_v_heads / num_k_heads)`.
    pub num_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
}

/// Tokens per chunk of the chunked gated delta rule (HF's and flash-linear-attention's 64), the kernels' own.
pub(crate) const DELTA_RULE_CHUNK: usize = ferry_kernels::constants::DELTA_CHUNK;

/// Slices of at least this many tokens take the chunked gated delta rule, shorter ones (decode) the
/// token-by-token recurrence; both backends choose alike, so that they compute a batch the same way. Measured on
/// an H200 at Qwen3.5's shapes (32 value heads of 128 x 128), one sequence's slice takes, token by token against
/// chunked: 15 against 33 us for 1 token, 35 us either way for 8, 58 against 40 us for 16, 12.7 against 4.5 ms
/// for 4096.
pub(crate) const DELTA_RULE_CHUNKED_MIN_LEN: usize = 16;

/// How a router turns logits into routing weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RouterKind {
    /// Softmax over all experts, keep the top k; `renormalize` rescales the kept weights to sum to one.
    SoftmaxTopK { renormalize: bool },
    /// DeepSeek-V3's and GLM-4.5's router (transformers' `DeepseekV3TopkRouter`): each expert's score is the
    /// sigmoid of its logit. Experts are chosen by score plus a per-expert correction bias
    /// (`e_score_correction_bias`, for the choice only) among the best `topk_group` of `n_group` equal groups of
    /// consecutive experts, a group ranking by the sum of its two best biased scores. The chosen are weighted by
    /// their unbiased scores, divided by the scores' sum when `renormalize`, times `scaling`.
    SigmoidGroupedTopK {
        n_group: usize,
        topk_group: usize,
        renormalize: bool,
        scaling: f32,
    },
}

impl RouterKind {
    /// Whether [`Backend::route`] needs the per-expert correction bias.
    pub fn has_correction_bias(&self) -> bool {
        matches!(self, RouterKind::SigmoidGroupedTopK { .. })
    }

    /// Why this router cannot choose `top_k` of `num_experts` experts, if it cannot.
    pub fn check(&self, num_experts: usize, top_k: usize) -> std::result::Result<(), String> {
        if top_k == 0 || top_k > num_experts {
            return Err(format!("top-{top_k} of {num_experts} experts"));
        }
        if let RouterKind::SigmoidGroupedTopK {
            n_group, topk_group, ..
        } = *self
        {
            // A group ranks by its two best scores, so it must hold two experts.
            if n_group == 0 || !num_experts.is_multiple_of(n_group) || num_experts / n_group < 2 {
                return Err(format!("{num_experts} experts in {n_group} groups of at least two"));
            }
            if topk_group == 0 || topk_group > n_group || top_k > topk_group * (num_experts / n_group) {
                return Err(format!(
                    "top-{top_k} of the experts in the best {topk_group} of {n_group} groups of {}",
                    num_experts / n_group
                ));
            }
        }
        Ok(())
    }
}

/// How a MoE block routes, besides its logits (see [`Backend::route`]).
#[derive(Clone, Copy, Debug)]
pub struct Router<'a, W> {
    pub kind: RouterKind,
    /// Experts per row.
    pub top_k: usize,
    /// The per-expert correction bias (`[experts]`) of the kinds that have one ([`RouterKind::has_correction_bias`]).
    pub correction_bias: Option<&'a W>,
}

/// Where the fused ops put their result ([`Backend::linear_add_rms_norm`], [`Backend::moe_experts_add_rms_norm`]):
/// added to the residual stream `residual`, whose rows are then RMS-normalised times `weight`, as
/// [`Backend::add_rms_norm`] does: a layer's last product, the residual add and the next norm in one op.
pub struct ResidualNorm<'a, T, W> {
    pub residual: &'a mut T,
    pub weight: &'a W,
    pub eps: f32,
}

/// What an expert computes between its gate/up projections and its down projection.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertActivation {
    /// `silu(gate) * up` (SwiGLU: Mixtral, the Qwen families, OLMoE).
    SiluGlu,
    /// gpt-oss's (transformers' `GptOssExperts`): `(up + 1) * g * sigmoid(alpha * g)`, with the gate clamped to
    /// `g = min(gate, limit)` and `up` to `[-limit, limit]`.
    ClampedSwiGlu { alpha: f32, limit: f32 },
}

/// One routed expert's weights as stored in the checkpoint: `down(act(gate x + gate_bias, up x + up_bias)) +
/// down_bias`, each bias optional.
#[derive(Clone, Debug)]
pub struct ExpertTensors {
    pub gate: TensorRef,
    pub up: TensorRef,
    pub down: TensorRef,
    pub gate_bias: Option<TensorRef>,
    pub up_bias: Option<TensorRef>,
    pub down_bias: Option<TensorRef>,
}

impl ExpertTensors {
    /// An expert without biases (every family ferry runs today).
    pub fn unbiased(gate: TensorRef, up: TensorRef, down: TensorRef) -> Self {
        ExpertTensors {
            gate,
            up,
            down,
            gate_bias: None,
            up_bias: None,
            down_bias: None,
        }
    }

    pub fn has_bias(&self) -> bool {
        self.gate_bias.is_some() || self.up_bias.is_some() || self.down_bias.is_some()
    }
}

pub trait Backend: Send + Sync + Sized {
    /// A `[rows, cols]` f32 activation tensor.
    type Tensor: Send;
    /// A weight in its stored dtype: a matrix `[out, in]` or a vector.
    type Weight: Send + Sync;
    /// The routed experts of one MoE layer, wherever the backend keeps them.
    type Experts: Send + Sync;
    /// What running sequences keep between forward calls: the KV cache of attention layers and, for hybrid models,
    /// each sequence's recurrent-state slot (conv state and delta-rule state of every Gated DeltaNet layer).
    type Kv: KvCache;
    /// What the ops of one forward pass need to know about its batch (positions, KV slots), prepared once.
    type Batch;
    /// Each row's chosen experts and their weights, as [`Backend::route`] leaves them.
    type Routing;
    /// A [`Rope`]'s frequencies where the rope op reads them.
    type RopeTable: Send + Sync;

    fn name(&self) -> String;
    /// Waits until every op issued so far has finished (a no-op where ops finish before they return).
    fn synchronize(&self) -> Result<()>;
    /// The expert offload's counters, when this backend offloads experts.
    fn offload_stats(&self) -> Option<OffloadStats> {
        None
    }

    /// A weight matrix `[out, in]` (also embedding tables `[vocab, hidden]`) or vector.
    fn weight(&self, tensor: TensorRef) -> Result<Self::Weight>;
    /// Fails with [`Error::Config`] when this backend has no router of `kind`: MoE blocks ask at load, so that a
    /// model the backend cannot run fails before its weights are read.
    fn check_router(&self, kind: RouterKind) -> Result<()>;
    /// One MoE layer's routed experts, each computing `activation` between its projections.
    fn experts(&self, experts: Vec<ExpertTensors>, activation: ExpertActivation) -> Result<Self::Experts>;
    /// One rank's part of a MoE layer's routed experts in an expert-parallel group
    /// ([`expert_parallel::ExpertParallel`]): `experts[e]` is None for an expert another rank holds, and
    /// [`Backend::moe_experts`] then sums only the pairs routed to this rank's experts, in router order. A backend
    /// that cannot hold part of a layer says so.
    fn expert_shard(&self, experts: Vec<Option<ExpertTensors>>, activation: ExpertActivation) -> Result<Self::Experts> {
        let _ = (experts, activation);
        Err(Error::Config(format!(
            "the {} backend cannot hold part of a MoE layer's experts (expert parallelism)",
            self.name()
        )))
    }
    fn rope_table(&self, rope: &Rope) -> Result<Self::RopeTable>;
    fn new_kv(&self, spec: KvSpec) -> Result<Self::Kv>;
    /// Reserves KV room for the batch's new tokens and prepares its per-row positions and slots; fails (before
    /// any work) when a sequence is unknown, out of step with the batch, or the cache is full.
    fn prepare_batch(&self, kv: &mut Self::Kv, batch: &[SeqSlice]) -> Result<Self::Batch>;
    /// Runs one forward pass of `step` over `kv`: `forward` itself (the default), or, on a backend that captures
    /// decode steps (the CUDA backend's graphs, backend/cuda/graph.rs), a replay of what `forward` issued for an
    /// earlier step of the same shape, the step's inputs uploaded first. `forward` must be the model's whole forward
    /// pass over `kv` for `step.ids` and `step.batch`, with nothing read back to the host in between.
    fn run_forward(
        &self,
        kv: &mut Self::Kv,
        _step: &ForwardStep<'_>,
        forward: &mut dyn FnMut(&mut Self::Kv) -> Result<Self::Tensor>,
    ) -> Result<Self::Tensor> {
        forward(kv)
    }
    /// Copies `seq`'s recurrent state (every Gated DeltaNet layer's conv and delta-rule state) into the cache's
    /// snapshot slot `slot`, replacing what the slot held: prefix caching's anchor for a hybrid model. Ordered
    /// after every op issued before it.
    fn save_state(&self, kv: &mut Self::Kv, seq: SeqId, slot: usize) -> Result<()>;
    /// Replaces `seq`'s recurrent state with a copy of snapshot `slot`, so that `seq` continues from the prefix
    /// the snapshot was saved after; an empty slot is an error.
    fn restore_state(&self, kv: &mut Self::Kv, seq: SeqId, slot: usize) -> Result<()>;

    /// A tensor holding `data` (`rows * cols` values).
    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Tensor>;
    fn to_host(&self, x: &Self::Tensor) -> Result<Vec<f32>>;
    /// Each row's argmax over its first `cols` values (1 to x's cols): the index of the largest, the lowest among
    /// equals, NaN below every number, 0 for a row of NaN ([`cpu::argmax`]). The greedy sampler's choice made
    /// where the logits are, so that only the ids come to the host.
    fn argmax_rows(&self, x: &Self::Tensor, cols: usize) -> Result<Vec<u32>>;
    fn shape(&self, x: &Self::Tensor) -> (usize, usize);

    /// Rows of `table` for `ids`.
    fn embed(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Tensor>;
    /// RMSNorm of each `group`-wide chunk of every row, times `weight` (`group` features). `group == cols` is a
    /// plain norm; `group == head_dim` is a per-head q/k norm.
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Weight, group: usize, eps: f32) -> Result<Self::Tensor>;
    /// `x W^T (+ bias)`.
    fn linear(&self, x: &Self::Tensor, w: &Self::Weight, bias: Option<&Self::Weight>) -> Result<Self::Tensor>;
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    /// `x += y`, then the RMSNorm of each row of `x` times `weight`: the residual add and the next norm in one op.
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        weight: &Self::Weight,
        eps: f32,
    ) -> Result<Self::Tensor>;
    /// [`Backend::linear`] of `x`, added to `into`'s residual and normalised ([`Backend::add_rms_norm`]); returns the
    /// normalised rows: a layer's output projection, the residual add and the next norm in one op. The default is
    /// that composition; a backend that fuses must match it.
    fn linear_add_rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        into: ResidualNorm<'_, Self::Tensor, Self::Weight>,
    ) -> Result<Self::Tensor> {
        let y = self.linear(x, w, bias)?;
        self.add_rms_norm(into.residual, &y, into.weight, into.eps)
    }
    /// `silu(gate) * up`, elementwise.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;
    /// Scales `x` by the sigmoid of `gate`: per row (`gate` `[rows, 1]`: `x[r, c] *= sigmoid(gate[r, 0])`, the
    /// shared expert's gate) or per element (`gate` the shape of `x`: `x[r, c] *= sigmoid(gate[r, c])`, gated
    /// attention's output gate).
    fn sigmoid_gate(&self, x: &mut Self::Tensor, gate: &Self::Tensor) -> Result<()>;
    /// Attention of one layer from its fused projection `qkv` (`[rows, (num_heads + 2 * num_kv_heads) * head_dim]`:
    /// each row's queries, then keys, then values): q and k are normalised (`qk_norm`) and rotated at each row's
    /// position (RoPE over the first `rotary_dim` features of each head, halves rotated against each other), k and
    /// v are written into the cache of `layer`, then causal attention of q over each sequence. With `sinks`
    /// (`[num_heads]`, gpt-oss's attention sinks), head h's softmax has one more logit, `sinks[h]`, in its
    /// denominator only: key j weighs `exp(s_j) / (sum_i exp(s_i) + exp(sinks[h]))`.
    /// Returns `[rows, num_heads * head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        qkv: &Self::Tensor,
        qk_norm: Option<QkNormWeights<'_, Self::Weight>>,
        sinks: Option<&Self::Weight>,
        rope: &Self::RopeTable,
        kv: &mut Self::Kv,
        layer: usize,
        batch: &Self::Batch,
        params: &AttentionParams,
    ) -> Result<Self::Tensor>;
    /// Multi-head latent attention of one layer. `q` is `[rows, q_width]` (per head `nope` features, then `rope`);
    /// `compressed` `[rows, kv_lora_rank + rope]` is `kv_a_proj_with_mqa`'s output: `c`, then the shared key `k_r`.
    /// `c` is RMS-normalised times `kv_norm` and the rope part of each query head and `k_r` are rotated at each
    /// row's position (RoPE over the rope features, pairs as `rope_interleaved` says, cos and sin times the RoPE's
    /// attention factor); the row
    /// `[c, k_r]` is written into the latent cache of `layer`. Then, with `kv_b` (`[kv_b_rows, kv_lora_rank]`) holding
    /// per head h its key rows `W_k[h]` (`[nope, kv_lora_rank]`) then its value rows `W_v[h]` (`[v, kv_lora_rank]`),
    /// causal attention of each head over its sequence with keys `[W_k[h] c_j, k_r_j]` and values `W_v[h] c_j`:
    /// `score_j = (q_nope . W_k[h] c_j + q_rope . k_r_j) * scale`. Returns `[rows, num_heads * v]`. How a backend
    /// evaluates it (keys expanded, or `W_k` and `W_v` absorbed into the query and output sides so that only the
    /// latent rows are read) is its own affair.
    #[allow(clippy::too_many_arguments)]
    fn mla_attention(
        &self,
        q: &Self::Tensor,
        compressed: &Self::Tensor,
        kv_norm: &Self::Weight,
        kv_b: &Self::Weight,
        rope: &Self::RopeTable,
        kv: &mut Self::Kv,
        layer: usize,
        batch: &Self::Batch,
        params: &MlaParams,
    ) -> Result<Self::Tensor>;
    /// Depthwise causal convolution along each sequence's tokens, then SiLU. `x` is `[rows, C]`, `weight` `[C, K]`;
    /// for row t of a slice at position p and channel c:
    /// `y[t, c] = silu(sum_{j < K} weight[c, j] * in[p - (K - 1) + j, c])`, where `in` is the sequence's input
    /// history (this call's rows after every earlier call's) and positions before 0 read as zero. Each sequence's
    /// last `K - 1` inputs (zeros at first) live in its recurrent-state slot for Gated DeltaNet layer `layer` (the
    /// layer's index among the model's Gated DeltaNet layers) and are read, then replaced, so the next call
    /// continues where this one ended. A slice must start where its sequence's conv state ends.
    fn causal_conv1d(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        kv: &mut Self::Kv,
        layer: usize,
        batch: &Self::Batch,
    ) -> Result<Self::Tensor>;
    /// The gated delta rule of Gated DeltaNet layer `layer` over each sequence's rows, from and into its
    /// delta-rule state: per value head h a `[k_head_dim, v_head_dim]` matrix S (zeros at first). `qkv`
    /// (`[rows, 2 * Hk * dk + Hv * dv]`) holds each row's queries (Hk heads of dk), keys (likewise) and values (Hv
    /// heads of dv); `a` and `b` are `[rows, Hv]`; `a_log` and `dt_bias` are `[Hv]` vectors. For each row in order
    /// and each value head h, with i = h / (Hv / Hk):
    ///
    /// - `q = l2norm(q_i) / sqrt(dk)`, `k = l2norm(k_i)`, where `l2norm(x) = x / sqrt(sum x^2 + 1e-6)`;
    /// - `g = -exp(a_log[h]) * softplus(a[h] + dt_bias[h])` (softplus(x) = x above 20, as torch's) and
    ///   `beta = sigmoid(b[h])`;
    /// - `S *= exp(g)`; `S += k (beta (v_h - S^T k))^T`; the output is `S^T q` (dv values).
    ///
    /// Returns `[rows, Hv * dv]`. A slice must start where its sequence's delta-rule state ends. How a backend
    /// evaluates it (token by token, or in parallel chunks for long prefills) is its own affair; the result is this
    /// recurrence.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule(
        &self,
        qkv: &Self::Tensor,
        a: &Self::Tensor,
        b: &Self::Tensor,
        a_log: &Self::Weight,
        dt_bias: &Self::Weight,
        kv: &mut Self::Kv,
        layer: usize,
        batch: &Self::Batch,
        params: &DeltaRuleParams,
    ) -> Result<Self::Tensor>;
    /// Router logits `[rows, experts]` to each row's top-k experts and weights.
    fn route(&self, logits: &Self::Tensor, router: Router<'_, Self::Weight>) -> Result<Self::Routing>;
    /// [`Backend::route`] of the router's logits `x W^T (+ bias)`: the router's product and its top-k in one op (on
    /// the GPU one launch for a decode step). The default is that composition; a backend that fuses must match it.
    fn route_linear(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        router: Router<'_, Self::Weight>,
    ) -> Result<Self::Routing> {
        self.route(&self.linear(x, w, bias)?, router)
    }
    /// The routed expert ids, `[rows * top_k]`, on the host (to record a routing trace).
    fn routing_to_host(&self, routing: &Self::Routing) -> Result<Vec<u32>>;
    /// A routing from the host: `ids` and `weights` are `[rows * top_k]` (to replay a routing trace).
    fn routing_from_host(&self, ids: &[u32], weights: &[f32], top_k: usize) -> Result<Self::Routing>;
    /// `sum_k weight_k * expert_k(x)` for each row, summed in router order: the routed part of a MoE block.
    fn moe_experts(&self, x: &Self::Tensor, routing: &Self::Routing, experts: &Self::Experts) -> Result<Self::Tensor>;
    /// [`Backend::moe_experts`], plus `shared` (`[rows, hidden]`, a shared expert's output) when given, added to
    /// `into`'s residual and normalised ([`Backend::add_rms_norm`]); returns the normalised rows. The default is that
    /// composition (`add_assign` of `shared`, then `add_rms_norm`); a backend that fuses must match it.
    fn moe_experts_add_rms_norm(
        &self,
        x: &Self::Tensor,
        routing: &Self::Routing,
        experts: &Self::Experts,
        shared: Option<&Self::Tensor>,
        into: ResidualNorm<'_, Self::Tensor, Self::Weight>,
    ) -> Result<Self::Tensor> {
        let mut out = self.moe_experts(x, routing, experts)?;
        if let Some(shared) = shared {
            self.add_assign(&mut out, shared)?;
        }
        self.add_rms_norm(into.residual, &out, into.weight, into.eps)
    }
    /// Whether the MoE blocks of a step of `rows` rows should hand [`Backend::guess_routing`] a guess of the next
    /// MoE layer's routing: only a backend that can copy experts ahead of their use (expert offload) wants one, so
    /// that no other pays for the guess.
    fn wants_routing_guess(&self, rows: usize) -> bool {
        let _ = rows;
        false
    }
    /// A guess of how the MoE layer of `experts` will route this step (that layer's router applied to an earlier
    /// layer's input), handed over before the current layer's [`Backend::moe_experts`]: an offloading backend may
    /// copy the guessed experts ahead. A guess changes no result, only what is copied when; a backend that keeps
    /// its experts where they run has nothing to copy and ignores it.
    fn guess_routing(&self, experts: &Self::Experts, routing: Self::Routing) -> Result<()> {
        let _ = (experts, routing);
        Ok(())
    }
    /// [`Backend::guess_routing`] for a guess made where no MoE layer runs before the guessed one (a dense layer
    /// just before the first MoE layer), so that no router's wait would bring it to the host in time: an
    /// offloading backend reads it at once (one wait for the device) and copies the guessed experts while the
    /// layers before compute.
    fn guess_routing_now(&self, experts: &Self::Experts, routing: Self::Routing) -> Result<()> {
        let _ = (experts, routing);
        Ok(())
    }
    /// The rows `rows` of `x`, in that order.
    fn select_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor>;
}

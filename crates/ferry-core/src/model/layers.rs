//! The building blocks every family's decoder is made of: attention (GQA, RoPE, optional biases, q/k norms,
//! output gate and window), Gated DeltaNet, the SwiGLU MLP, and the MoE block (router of any [`RouterKind`],
//! routed experts of any activation, optional shared expert, sigmoid-gated or added as is). Each block's forward
//! ends by adding its output to the residual stream and normalising it for what comes next ([`Residual`]), so that
//! a backend can fuse the block's last product with both.

use std::cell::Cell;
use std::ops::Range;
use std::time::{Duration, Instant};

use super::config::{
    ExpertLayout, ExpertNaming, FfnKind, GatedDeltaNetSpec, GdnProjections, ModelSpec, MoeSpec, QkNorm,
    STANDARD_EXPERTS,
};
use crate::backend::{
    AttentionParams, Backend, DeltaRuleParams, ExpertTensors, QkNormWeights, ResidualNorm, Router, RouterKind,
};
use crate::loader::{TensorRef, WeightStore};
use crate::moe::RoutingTap;
use crate::{Error, Result};

/// The residual stream a block's output is added to, and the norm applied after it.
pub type Residual<'a, B> = ResidualNorm<'a, <B as Backend>::Tensor, <B as Backend>::Weight>;

/// Loads weights by name, checks their shapes, and hands them to the backend.
pub struct WeightLoader<'a, B: Backend> {
    pub backend: &'a B,
    pub store: &'a WeightStore,
    /// Time spent getting tensors from the store (mapping them, generating synthetic ones, quantizing experts at
    /// load): of a load's time, what is not the backend's.
    reading: Cell<Duration>,
}

impl<'a, B: Backend> WeightLoader<'a, B> {
    pub fn new(backend: &'a B, store: &'a WeightStore) -> Self {
        WeightLoader {
            backend,
            store,
            reading: Cell::default(),
        }
    }

    /// The time [`WeightLoader::tensor`] has spent so far.
    pub fn reading_time(&self) -> Duration {
        self.reading.get()
    }

    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<TensorRef> {
        let started = Instant::now();
        let tensor = self.store.get_shaped(name, shape);
        self.reading.set(self.reading.get() + started.elapsed());
        tensor
    }

    pub fn load(&self, name: &str, shape: &[usize]) -> Result<B::Weight> {
        self.backend.weight(self.tensor(name, shape)?)
    }

    /// An RMSNorm scale of `width` features. Families that store it as an offset from one (`offset`) get `1 + w`,
    /// computed once here in f32 exactly as transformers computes it in every forward.
    pub fn norm(&self, name: &str, width: usize, offset: bool) -> Result<B::Weight> {
        let stored = self.tensor(name, &[width])?;
        if !offset {
            return self.backend.weight(stored);
        }
        let scale: Vec<f32> = stored.to_f32_vec().iter().map(|w| 1.0 + w).collect();
        self.backend.weight(TensorRef::from_f32(name, vec![width], &scale)?)
    }

    /// A tensor the checkpoint may leave out (a bias); present with the wrong shape is still an error.
    pub fn optional(&self, name: &str, shape: &[usize]) -> Result<Option<TensorRef>> {
        self.store.find(name).map(|t| t.expect_shape(shape)).transpose()
    }
}

/// The row ranges of a projection whose output is `groups` groups of `group` features, taking `start..start + len`
/// of each group: how interleaved per-head (or per-head-group) projections are split into plain ones at load.
fn group_rows(groups: usize, group: usize, start: usize, len: usize) -> Vec<Range<usize>> {
    (0..groups)
        .map(|g| g * group + start..g * group + start + len)
        .collect()
}

pub struct Attention<B: Backend> {
    /// The q, k and v projections stacked into one product, `[(heads + 2 * kv_heads) * head_dim, hidden]`, and
    /// their biases (zeros for a part without one) when the family has any.
    qkv_proj: B::Weight,
    qkv_bias: Option<B::Weight>,
    /// Gated attention's output gate projection (and bias): split out of q_proj, whose rows hold each head's query
    /// then its gate.
    output_gate: Option<(B::Weight, Option<B::Weight>)>,
    o_proj: B::Weight,
    o_bias: Option<B::Weight>,
    /// The per-head sink logits of families that have them ([`ModelSpec::attention_sinks`]).
    sinks: Option<B::Weight>,
    /// q_norm and k_norm scales, and whether they apply per head.
    qk_norm: Option<(B::Weight, B::Weight, bool)>,
    eps: f32,
    params: AttentionParams,
}

impl<B: Backend> Attention<B> {
    /// `window`: the layer's attention window ([`super::Mixer::Attention`]).
    pub fn load(w: &WeightLoader<B>, prefix: &str, spec: &ModelSpec, window: Option<usize>) -> Result<Self> {
        let (h, d) = (spec.hidden_size, spec.head_dim);
        let (q_width, kv_width) = (spec.num_heads * d, spec.num_kv_heads * d);
        let name = |n: &str| format!("{prefix}.{n}");
        let optional = |n: &str, width: usize| w.optional(&name(n), &[width]);
        let (q_proj, q_bias, output_gate) = if spec.attention_output_gate {
            let heads = spec.num_heads;
            let split = |t: TensorRef| -> Result<(TensorRef, TensorRef)> {
                Ok((
                    t.gather_rows(&group_rows(heads, 2 * d, 0, d))?,
                    t.gather_rows(&group_rows(heads, 2 * d, d, d))?,
                ))
            };
            let (query, gate) = split(w.tensor(&name("q_proj.weight"), &[2 * q_width, h])?)?;
            let (query_bias, gate_bias) = match optional("q_proj.bias", 2 * q_width)? {
                Some(t) => {
                    let (q, g) = split(t)?;
                    (Some(q), Some(w.backend.weight(g)?))
                }
                None => (None, None),
            };
            (query, query_bias, Some((w.backend.weight(gate)?, gate_bias)))
        } else {
            (
                w.tensor(&name("q_proj.weight"), &[q_width, h])?,
                optional("q_proj.bias", q_width)?,
                None,
            )
        };
        let qkv_proj = TensorRef::concat_rows(
            &name("qkv_proj.weight"),
            &[
                q_proj,
                w.tensor(&name("k_proj.weight"), &[kv_width, h])?,
                w.tensor(&name("v_proj.weight"), &[kv_width, h])?,
            ],
        )?;
        let biases = [
            (q_bias, q_width),
            (optional("k_proj.bias", kv_width)?, kv_width),
            (optional("v_proj.bias", kv_width)?, kv_width),
        ];
        let qkv_bias = if biases.iter().any(|(b, _)| b.is_some()) {
            let values: Vec<f32> = biases
                .iter()
                .flat_map(|(b, width)| b.as_ref().map_or_else(|| vec![0.0; *width], |b| b.to_f32_vec()))
                .collect();
            let bias = TensorRef::from_f32(&name("qkv_proj.bias"), vec![values.len()], &values)?;
            Some(w.backend.weight(bias)?)
        } else {
            None
        };
        let qk_norm = match spec.qk_norm {
            QkNorm::None => None,
            QkNorm::PerHead | QkNorm::Full => {
                let per_head = spec.qk_norm == QkNorm::PerHead;
                let (q_norm_width, k_norm_width) = if per_head { (d, d) } else { (q_width, kv_width) };
                let norm = |n: &str, width| w.norm(&name(n), width, spec.norm_weight_offset);
                Some((
                    norm("q_norm.weight", q_norm_width)?,
                    norm("k_norm.weight", k_norm_width)?,
                    per_head,
                ))
            }
        };
        Ok(Attention {
            qkv_proj: w.backend.weight(qkv_proj)?,
            qkv_bias,
            output_gate,
            o_proj: w.load(&name("o_proj.weight"), &[h, q_width])?,
            o_bias: optional("o_proj.bias", h)?.map(|b| w.backend.weight(b)).transpose()?,
            sinks: match spec.attention_sinks {
                true => Some(w.load(&name("sinks"), &[spec.num_heads])?),
                false => None,
            },
            qk_norm,
            eps: spec.rms_norm_eps,
            params: AttentionParams {
                num_heads: spec.num_heads,
                num_kv_heads: spec.num_kv_heads,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
                sliding_window: window,
            },
        })
    }

    /// Adds the attention's output to `into`'s residual and returns the normalised residual.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        be: &B,
        x: &B::Tensor,
        rope: &B::RopeTable,
        kv: &mut B::Kv,
        layer: usize,
        batch: &B::Batch,
        into: Residual<'_, B>,
    ) -> Result<B::Tensor> {
        let qkv = be.linear(x, &self.qkv_proj, self.qkv_bias.as_ref())?;
        let gate = self
            .output_gate
            .as_ref()
            .map(|(w, bias)| be.linear(x, w, bias.as_ref()))
            .transpose()?;
        let qk_norm = self.qk_norm.as_ref().map(|(q, k, per_head)| QkNormWeights {
            q,
            k,
            per_head: *per_head,
            eps: self.eps,
        });
        let mut out = be.attention(&qkv, qk_norm, self.sinks.as_ref(), rope, kv, layer, batch, &self.params)?;
        if let Some(gate) = &gate {
            be.sigmoid_gate(&mut out, gate)?;
        }
        be.linear_add_rms_norm(&out, &self.o_proj, self.o_bias.as_ref(), into)
    }
}

/// Gated DeltaNet (Qwen3-Next, Qwen3.5): input projections -> causal conv1d + SiLU over q, k, v -> the gated delta
/// rule over the sequence's recurrent state -> per-head RMSNorm gated by `silu(z)` -> out_proj.
pub struct GatedDeltaNet<B: Backend> {
    in_proj_qkv: B::Weight,
    in_proj_z: B::Weight,
    in_proj_b: B::Weight,
    in_proj_a: B::Weight,
    /// `[conv_dim, kernel]`.
    conv1d: B::Weight,
    a_log: B::Weight,
    dt_bias: B::Weight,
    norm: B::Weight,
    out_proj: B::Weight,
    eps: f32,
    params: DeltaRuleParams,
}

impl<B: Backend> GatedDeltaNet<B> {
    pub fn load(w: &WeightLoader<B>, prefix: &str, spec: &ModelSpec, g: &GatedDeltaNetSpec) -> Result<Self> {
        let h = spec.hidden_size;
        let (value_dim, conv_dim) = (g.value_dim(), g.conv_dim());
        let (heads, k_heads) = (g.num_v_heads, g.num_k_heads);
        let name = |n: &str| format!("{prefix}.{n}");
        let [qkv, z, b, a] = match g.projections {
            GdnProjections::Separate => [
                w.tensor(&name("in_proj_qkv.weight"), &[conv_dim, h])?,
                w.tensor(&name("in_proj_z.weight"), &[value_dim, h])?,
                w.tensor(&name("in_proj_b.weight"), &[heads, h])?,
                w.tensor(&name("in_proj_a.weight"), &[heads, h])?,
            ],
            GdnProjections::GroupedByKeyHead => {
                // Per key head: its q (dk), its k (dk), then v and z of the value heads it serves (r dv each);
                // in_proj_ba likewise holds their b (r), then their a (r).
                let (dk, r) = (g.k_head_dim, heads / k_heads);
                let vz = r * g.v_head_dim;
                let group = 2 * dk + 2 * vz;
                let qkvz = w.tensor(&name("in_proj_qkvz.weight"), &[conv_dim + value_dim, h])?;
                let ba = w.tensor(&name("in_proj_ba.weight"), &[2 * heads, h])?;
                let qkv_rows: Vec<Range<usize>> = [(0, dk), (dk, dk), (2 * dk, vz)]
                    .iter()
                    .flat_map(|&(start, len)| group_rows(k_heads, group, start, len))
                    .collect();
                [
                    qkvz.gather_rows(&qkv_rows)?,
                    qkvz.gather_rows(&group_rows(k_heads, group, 2 * dk + vz, vz))?,
                    ba.gather_rows(&group_rows(k_heads, 2 * r, 0, r))?,
                    ba.gather_rows(&group_rows(k_heads, 2 * r, r, r))?,
                ]
            }
        };
        let conv1d = w
            .tensor(&name("conv1d.weight"), &[conv_dim, 1, g.conv_kernel])?
            .reshape(vec![conv_dim, g.conv_kernel])?;
        let be = w.backend;
        Ok(GatedDeltaNet {
            in_proj_qkv: be.weight(qkv)?,
            in_proj_z: be.weight(z)?,
            in_proj_b: be.weight(b)?,
            in_proj_a: be.weight(a)?,
            conv1d: be.weight(conv1d)?,
            a_log: w.load(&name("A_log"), &[heads])?,
            dt_bias: w.load(&name("dt_bias"), &[heads])?,
            norm: w.norm(&name("norm.weight"), g.v_head_dim, false)?,
            out_proj: w.load(&name("out_proj.weight"), &[h, value_dim])?,
            eps: spec.rms_norm_eps,
            params: DeltaRuleParams {
                num_k_heads: k_heads,
                num_v_heads: heads,
                k_head_dim: g.k_head_dim,
                v_head_dim: g.v_head_dim,
            },
        })
    }

    /// `layer` is this layer's index among the model's Gated DeltaNet layers (its recurrent-state slot). Adds the
    /// layer's output to `into`'s residual and returns the normalised residual.
    pub fn forward(
        &self,
        be: &B,
        x: &B::Tensor,
        kv: &mut B::Kv,
        layer: usize,
        batch: &B::Batch,
        into: Residual<'_, B>,
    ) -> Result<B::Tensor> {
        let qkv = be.linear(x, &self.in_proj_qkv, None)?;
        let z = be.linear(x, &self.in_proj_z, None)?;
        let b = be.linear(x, &self.in_proj_b, None)?;
        let a = be.linear(x, &self.in_proj_a, None)?;
        let qkv = be.causal_conv1d(&qkv, &self.conv1d, kv, layer, batch)?;
        let core = be.gated_delta_rule(&qkv, &a, &b, &self.a_log, &self.dt_bias, kv, layer, batch, &self.params)?;
        let normed = be.rms_norm(&core, &self.norm, self.params.v_head_dim, self.eps)?;
        be.linear_add_rms_norm(&be.silu_mul(&z, &normed)?, &self.out_proj, None, into)
    }
}

/// A SwiGLU MLP: `down(silu(gate x) * up x)`, stored as `gate_proj`, `up_proj` and `down_proj`.
pub struct Mlp<B: Backend> {
    gate: B::Weight,
    up: B::Weight,
    down: B::Weight,
}

impl<B: Backend> Mlp<B> {
    pub fn load(w: &WeightLoader<B>, prefix: &str, hidden: usize, inter: usize) -> Result<Self> {
        let [gate, up, down] = STANDARD_EXPERTS.projections;
        Ok(Mlp {
            gate: w.load(&format!("{prefix}.{gate}.weight"), &[inter, hidden])?,
            up: w.load(&format!("{prefix}.{up}.weight"), &[inter, hidden])?,
            down: w.load(&format!("{prefix}.{down}.weight"), &[hidden, inter])?,
        })
    }

    pub fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        be.linear(&self.activation(be, x)?, &self.down, None)
    }

    /// [`Mlp::forward`] added to `into`'s residual; returns the normalised residual.
    pub fn forward_into(&self, be: &B, x: &B::Tensor, into: Residual<'_, B>) -> Result<B::Tensor> {
        be.linear_add_rms_norm(&self.activation(be, x)?, &self.down, None, into)
    }

    /// `silu(gate x) * up x`, what the down projection reads.
    fn activation(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        be.silu_mul(&be.linear(x, &self.gate, None)?, &be.linear(x, &self.up, None)?)
    }
}

struct SharedExpert<B: Backend> {
    mlp: Mlp<B>,
    /// The sigmoid gate of Qwen's kind (`shared_expert_gate`); None: added as is.
    gate: Option<B::Weight>,
}

pub struct MoeBlock<B: Backend> {
    router: B::Weight,
    router_bias: Option<B::Weight>,
    router_kind: RouterKind,
    /// The router's per-expert correction bias, for the kinds that have one.
    correction_bias: Option<B::Weight>,
    top_k: usize,
    num_experts: usize,
    experts: B::Experts,
    shared: Option<SharedExpert<B>>,
}

/// Expert `e`'s gate, up and down projections: per-expert tensors, or views into the fused 3-D tensors
/// `experts.gate_up_proj` `[E, 2 * inter, hidden]` (gate rows, then up rows) and `experts.down_proj`
/// `[E, hidden, inter]` that transformers 5 and some checkpoints use.
fn expert_tensors(
    w: &WeightLoader<impl Backend>,
    block: &str,
    naming: &ExpertNaming,
    moe: &MoeSpec,
    hidden: usize,
) -> Result<Vec<ExpertTensors>> {
    if let ExpertLayout::GptOss { mxfp4 } = naming.layout {
        return super::gpt_oss::experts(w, block, moe, hidden, mxfp4);
    }
    let (n, inter) = (moe.num_experts, moe.intermediate);
    let fused = format!("{block}.experts.gate_up_proj");
    if w.store.contains(&fused) {
        let gate_up = w.tensor(&fused, &[n, 2 * inter, hidden])?;
        let down = w.tensor(&format!("{block}.experts.down_proj"), &[n, hidden, inter])?;
        return (0..n)
            .map(|e| {
                let pair = gate_up.select(e)?;
                Ok(ExpertTensors::unbiased(
                    pair.rows(0, inter)?,
                    pair.rows(inter, 2 * inter)?,
                    down.select(e)?,
                ))
            })
            .collect();
    }
    let [gate, up, down] = naming.projections;
    (0..n)
        .map(|e| {
            let name = |proj: &str| format!("{block}.experts.{e}.{proj}.weight");
            Ok(ExpertTensors::unbiased(
                w.tensor(&name(gate), &[inter, hidden])?,
                w.tensor(&name(up), &[inter, hidden])?,
                w.tensor(&name(down), &[hidden, inter])?,
            ))
        })
        .collect()
}

impl<B: Backend> MoeBlock<B> {
    pub fn load(w: &WeightLoader<B>, layer_prefix: &str, moe: &MoeSpec, hidden: usize) -> Result<Self> {
        let block = format!("{layer_prefix}.{}", moe.naming.block);
        moe.router
            .check(moe.num_experts, moe.top_k)
            .map_err(|e| Error::Config(format!("router: {e}")))?;
        w.backend.check_router(moe.router)?;
        let experts = w
            .backend
            .experts(expert_tensors(w, &block, &moe.naming, moe, hidden)?, moe.activation)?;
        let shared = match moe.shared_expert {
            Some(s) if s.sigmoid_gated => Some(SharedExpert {
                mlp: Mlp::load(w, &format!("{block}.shared_expert"), hidden, s.intermediate)?,
                gate: Some(w.load(&format!("{block}.shared_expert_gate.weight"), &[1, hidden])?),
            }),
            Some(s) => Some(SharedExpert {
                mlp: Mlp::load(w, &format!("{block}.shared_experts"), hidden, s.intermediate)?,
                gate: None,
            }),
            None => None,
        };
        let correction_bias = match moe.router.has_correction_bias() {
            true => Some(w.load(&format!("{block}.gate.e_score_correction_bias"), &[moe.num_experts])?),
            false => None,
        };
        let router = format!("{block}.{}", moe.naming.router);
        Ok(MoeBlock {
            router: w.load(&format!("{router}.weight"), &[moe.num_experts, hidden])?,
            router_bias: w
                .optional(&format!("{router}.bias"), &[moe.num_experts])?
                .map(|b| w.backend.weight(b))
                .transpose()?,
            router_kind: moe.router,
            correction_bias,
            num_experts: moe.num_experts,
            top_k: moe.top_k,
            experts,
            shared,
        })
    }

    fn router(&self) -> Router<'_, B::Weight> {
        Router {
            kind: self.router_kind,
            top_k: self.top_k,
            correction_bias: self.correction_bias.as_ref(),
        }
    }

    /// A guess of how this block (MoE layer `moe_layer`) will route the rows of `x`, an earlier layer's input:
    /// its router applied to `x`, or, when `replaying` (a tap that replaces the routers' choices), the tap's guess
    /// if it makes one (the router could not predict replayed routes).
    fn guess(
        &self,
        be: &B,
        x: &B::Tensor,
        moe_layer: usize,
        replaying: Option<&mut (dyn RoutingTap + '_)>,
    ) -> Result<Option<B::Routing>> {
        let Some(tap) = replaying else {
            return be
                .route_linear(x, &self.router, self.router_bias.as_ref(), self.router())
                .map(Some);
        };
        let Some(ids) = tap.guess(moe_layer, be.shape(x).0, self.top_k)? else {
            return Ok(None);
        };
        let weights = vec![1.0 / self.top_k as f32; ids.len()];
        be.routing_from_host(&ids, &weights, self.top_k).map(Some)
    }

    /// Before a dense layer's MLP whose next layer is this block's (MoE layer `moe_layer`): when the backend
    /// wants guesses, this block's guess from the MLP's input `x`, read at once ([`Backend::guess_routing_now`]),
    /// so that the first MoE layer's experts are copied while the dense layer and the next attention compute
    /// (no MoE layer before it hands its guess over). `tap` as in [`MoeBlock::forward`].
    pub fn guess_ahead(
        &self,
        be: &B,
        x: &B::Tensor,
        moe_layer: usize,
        tap: Option<&mut (dyn RoutingTap + '_)>,
    ) -> Result<()> {
        if !be.wants_routing_guess(be.shape(x).0) {
            return Ok(());
        }
        // A tap that only records leaves guessing to the router; one that replays guesses itself, if at all.
        let replaying = tap.filter(|t| t.replays());
        if let Some(guess) = self.guess(be, x, moe_layer, replaying)? {
            be.guess_routing_now(&self.experts, guess)?;
        }
        Ok(())
    }

    /// `moe_layer` is this block's index among the model's MoE layers; `tap` sees (and may replace) its routing.
    /// `next`, the model's next MoE block: when the backend wants a guess of its routing (expert offload in
    /// decode), its router is applied to this block's input `x`, available before this block's experts run, so
    /// the guess reaches the host with this block's own routing and its experts can be copied while this block
    /// computes. The input of the next block differs by one layer's residual update and that block's norm; the
    /// guess is only ever a prefetch, never a result. When a tap replays routes the router's guess would not
    /// predict them: the tap guesses instead ([`RoutingTap::guess`]), or nothing is guessed. Adds the block's output to `into`'s residual and returns the normalised
    /// residual.
    pub fn forward(
        &self,
        be: &B,
        x: &B::Tensor,
        moe_layer: usize,
        mut tap: Option<&mut (dyn RoutingTap + '_)>,
        next: Option<&MoeBlock<B>>,
        into: Residual<'_, B>,
    ) -> Result<B::Tensor> {
        let mut routing = be.route_linear(x, &self.router, self.router_bias.as_ref(), self.router())?;
        let mut replayed = false;
        let rows = be.shape(x).0;
        if let Some(tap) = tap.as_deref_mut() {
            let routed = match tap.wants_router_choice() {
                true => Some(be.routing_to_host(&routing)?),
                false => None,
            };
            if let Some(ids) = tap.routed(moe_layer, rows, self.top_k, routed.as_deref())? {
                if let Some(&bad) = ids.iter().find(|&&e| e as usize >= self.num_experts) {
                    return Err(Error::Cache(format!(
                        "a replayed route names expert {bad}; this model's layers have {}",
                        self.num_experts
                    )));
                }
                // A replayed choice, weighted uniformly: the trace records which experts, not how much.
                let weights = vec![1.0 / self.top_k as f32; ids.len()];
                routing = be.routing_from_host(&ids, &weights, self.top_k)?;
                replayed = true;
            }
        }
        if let Some(next) = next.filter(|_| be.wants_routing_guess(rows)) {
            if let Some(guess) = next.guess(be, x, moe_layer + 1, tap.filter(|_| replayed))? {
                be.guess_routing(&next.experts, guess)?;
            }
        }
        let shared = match &self.shared {
            Some(shared) => {
                let mut y = shared.mlp.forward(be, x)?;
                if let Some(gate) = &shared.gate {
                    be.sigmoid_gate(&mut y, &be.linear(x, gate, None)?)?;
                }
                Some(y)
            }
            None => None,
        };
        be.moe_experts_add_rms_norm(x, &routing, &self.experts, shared.as_ref(), into)
    }
}

/// A decoder layer's feed-forward block, as loaded.
pub enum Ffn<B: Backend> {
    Dense(Mlp<B>),
    Moe(MoeBlock<B>),
}

impl<B: Backend> Ffn<B> {
    pub fn load(w: &WeightLoader<B>, layer_prefix: &str, kind: FfnKind, spec: &ModelSpec) -> Result<Self> {
        match (kind, &spec.moe) {
            (FfnKind::Dense { intermediate }, _) => Ok(Ffn::Dense(Mlp::load(
                w,
                &format!("{layer_prefix}.mlp"),
                spec.hidden_size,
                intermediate,
            )?)),
            (FfnKind::Moe, Some(moe)) => Ok(Ffn::Moe(MoeBlock::load(w, layer_prefix, moe, spec.hidden_size)?)),
            (FfnKind::Moe, None) => Err(Error::Config("a MoE layer in a model without experts".into())),
        }
    }
}

//! The building blocks every family's decoder is made of: attention (GQA, RoPE, optional biases and q/k norms),
//! the SwiGLU MLP, and the MoE block (router, routed experts, optional sigmoid-gated shared expert).

use super::config::{ExpertNaming, FfnKind, ModelSpec, MoeSpec, QkNorm};
use crate::backend::{AttentionParams, Backend, ExpertTensors, RouterKind};
use crate::loader::{TensorRef, WeightStore};
use crate::Result;

/// Loads weights by name, checks their shapes, and hands them to the backend.
pub struct WeightLoader<'a, B: Backend> {
    pub backend: &'a B,
    pub store: &'a WeightStore,
}

impl<B: Backend> WeightLoader<'_, B> {
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<TensorRef> {
        self.store.get_shaped(name, shape)
    }

    pub fn load(&self, name: &str, shape: &[usize]) -> Result<B::Weight> {
        self.backend.weight(self.tensor(name, shape)?)
    }

    /// A tensor the checkpoint may leave out (a bias); present with the wrong shape is still an error.
    pub fn optional(&self, name: &str, shape: &[usize]) -> Result<Option<B::Weight>> {
        match self.store.find(name) {
            Some(t) => Ok(Some(self.backend.weight(t.expect_shape(shape)?)?)),
            None => Ok(None),
        }
    }
}

pub struct Attention<B: Backend> {
    q_proj: B::Weight,
    k_proj: B::Weight,
    v_proj: B::Weight,
    o_proj: B::Weight,
    q_bias: Option<B::Weight>,
    k_bias: Option<B::Weight>,
    v_bias: Option<B::Weight>,
    q_norm: Option<B::Weight>,
    k_norm: Option<B::Weight>,
    norm_group: usize,
    eps: f32,
    params: AttentionParams,
}

impl<B: Backend> Attention<B> {
    pub fn load(w: &WeightLoader<B>, prefix: &str, spec: &ModelSpec) -> Result<Self> {
        let (h, d) = (spec.hidden_size, spec.head_dim);
        let (q_width, kv_width) = (spec.num_heads * d, spec.num_kv_heads * d);
        let (q_norm_width, k_norm_width, norm_group) = match spec.qk_norm {
            QkNorm::None | QkNorm::PerHead => (d, d, d),
            QkNorm::Full => (q_width, kv_width, 0),
        };
        let has_norm = spec.qk_norm != QkNorm::None;
        let norm = |name: &str, width: usize| -> Result<Option<B::Weight>> {
            has_norm
                .then(|| w.load(&format!("{prefix}.{name}.weight"), &[width]))
                .transpose()
        };
        Ok(Attention {
            q_proj: w.load(&format!("{prefix}.q_proj.weight"), &[q_width, h])?,
            k_proj: w.load(&format!("{prefix}.k_proj.weight"), &[kv_width, h])?,
            v_proj: w.load(&format!("{prefix}.v_proj.weight"), &[kv_width, h])?,
            o_proj: w.load(&format!("{prefix}.o_proj.weight"), &[h, q_width])?,
            q_bias: w.optional(&format!("{prefix}.q_proj.bias"), &[q_width])?,
            k_bias: w.optional(&format!("{prefix}.k_proj.bias"), &[kv_width])?,
            v_bias: w.optional(&format!("{prefix}.v_proj.bias"), &[kv_width])?,
            q_norm: norm("q_norm", q_norm_width)?,
            k_norm: norm("k_norm", k_norm_width)?,
            norm_group,
            eps: spec.rms_norm_eps,
            params: AttentionParams {
                num_heads: spec.num_heads,
                num_kv_heads: spec.num_kv_heads,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
                sliding_window: spec.sliding_window,
            },
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        be: &B,
        x: &B::Tensor,
        rope: &B::RopeTable,
        kv: &mut B::Kv,
        layer: usize,
        batch: &B::Batch,
    ) -> Result<B::Tensor> {
        let mut q = be.linear(x, &self.q_proj, self.q_bias.as_ref())?;
        let mut k = be.linear(x, &self.k_proj, self.k_bias.as_ref())?;
        let v = be.linear(x, &self.v_proj, self.v_bias.as_ref())?;
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            let group = |t: &B::Tensor| {
                if self.norm_group == 0 {
                    be.shape(t).1
                } else {
                    self.norm_group
                }
            };
            q = be.rms_norm(&q, qn, group(&q), self.eps)?;
            k = be.rms_norm(&k, kn, group(&k), self.eps)?;
        }
        be.rope(&mut q, batch, rope)?;
        be.rope(&mut k, batch, rope)?;
        let out = be.attention(&q, &k, &v, kv, layer, batch, &self.params)?;
        be.linear(&out, &self.o_proj, None)
    }
}

/// A SwiGLU MLP: `down(silu(gate x) * up x)`.
pub struct Mlp<B: Backend> {
    gate: B::Weight,
    up: B::Weight,
    down: B::Weight,
}

impl<B: Backend> Mlp<B> {
    pub fn load(w: &WeightLoader<B>, prefix: &str, names: [&str; 3], hidden: usize, inter: usize) -> Result<Self> {
        Ok(Mlp {
            gate: w.load(&format!("{prefix}.{}.weight", names[0]), &[inter, hidden])?,
            up: w.load(&format!("{prefix}.{}.weight", names[1]), &[inter, hidden])?,
            down: w.load(&format!("{prefix}.{}.weight", names[2]), &[hidden, inter])?,
        })
    }

    pub fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        let act = be.silu_mul(&be.linear(x, &self.gate, None)?, &be.linear(x, &self.up, None)?)?;
        be.linear(&act, &self.down, None)
    }
}

struct SharedExpert<B: Backend> {
    mlp: Mlp<B>,
    gate: B::Weight,
}

pub struct MoeBlock<B: Backend> {
    router: B::Weight,
    router_kind: RouterKind,
    top_k: usize,
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
    let (n, inter) = (moe.num_experts, moe.intermediate);
    let fused = format!("{block}.experts.gate_up_proj");
    if w.store.contains(&fused) {
        let gate_up = w.tensor(&fused, &[n, 2 * inter, hidden])?;
        let down = w.tensor(&format!("{block}.experts.down_proj"), &[n, hidden, inter])?;
        return (0..n)
            .map(|e| {
                let pair = gate_up.select(e)?;
                Ok(ExpertTensors {
                    gate: pair.rows(0, inter)?,
                    up: pair.rows(inter, 2 * inter)?,
                    down: down.select(e)?,
                })
            })
            .collect();
    }
    let [gate, up, down] = naming.projections;
    (0..n)
        .map(|e| {
            let name = |proj: &str| format!("{block}.experts.{e}.{proj}.weight");
            Ok(ExpertTensors {
                gate: w.tensor(&name(gate), &[inter, hidden])?,
                up: w.tensor(&name(up), &[inter, hidden])?,
                down: w.tensor(&name(down), &[hidden, inter])?,
            })
        })
        .collect()
}

impl<B: Backend> MoeBlock<B> {
    pub fn load(w: &WeightLoader<B>, layer_prefix: &str, moe: &MoeSpec, hidden: usize) -> Result<Self> {
        let block = format!("{layer_prefix}.{}", moe.naming.block);
        let experts = w
            .backend
            .experts(expert_tensors(w, &block, &moe.naming, moe, hidden)?)?;
        let shared = match moe.shared_expert_intermediate {
            Some(inter) => Some(SharedExpert {
                mlp: Mlp::load(
                    w,
                    &format!("{block}.shared_expert"),
                    ["gate_proj", "up_proj", "down_proj"],
                    hidden,
                    inter,
                )?,
                gate: w.load(&format!("{block}.shared_expert_gate.weight"), &[1, hidden])?,
            }),
            None => None,
        };
        Ok(MoeBlock {
            router: w.load(&format!("{block}.gate.weight"), &[moe.num_experts, hidden])?,
            router_kind: moe.router,
            top_k: moe.top_k,
            experts,
            shared,
        })
    }

    pub fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        let routing = be.route(&be.linear(x, &self.router, None)?, self.top_k, self.router_kind)?;
        let mut out = be.moe_experts(x, &routing, &self.experts)?;
        if let Some(shared) = &self.shared {
            let mut y = shared.mlp.forward(be, x)?;
            be.sigmoid_gate(&mut y, &be.linear(x, &shared.gate, None)?)?;
            be.add_assign(&mut out, &y)?;
        }
        Ok(out)
    }
}

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
                ["gate_proj", "up_proj", "down_proj"],
                spec.hidden_size,
                intermediate,
            )?)),
            (FfnKind::Moe, Some(moe)) => Ok(Ffn::Moe(MoeBlock::load(w, layer_prefix, moe, spec.hidden_size)?)),
            (FfnKind::Moe, None) => Err(crate::Error::Config("a MoE layer in a model without experts".into())),
        }
    }

    pub fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        match self {
            Ffn::Dense(mlp) => mlp.forward(be, x),
            Ffn::Moe(moe) => moe.forward(be, x),
        }
    }
}

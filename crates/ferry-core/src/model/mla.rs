//! Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), the block: queries through a low-rank bottleneck
//! (`q_a_proj`, `q_a_layernorm`, `q_b_proj`) or one `q_proj`; keys and values compressed by `kv_a_proj_with_mqa`
//! into a latent `c` (normalised by `kv_a_layernorm`) plus one RoPE key all heads share; `kv_b_proj` expanding `c`
//! into each head's key and value, which [`Backend::mla_attention`] applies as it sees fit (the KV cache keeps
//! only the latent); `o_proj`. Not for the softmax scale or the RoPE: those come from the spec.

use super::config::{MlaSpec, ModelSpec};
use super::layers::{Residual, WeightLoader};
use crate::backend::{Backend, MlaParams};
use crate::Result;

/// The epsilon of `q_a_layernorm` and `kv_a_layernorm`: transformers builds both with its RMSNorm's default, not
/// the config's `rms_norm_eps`.
const LATENT_NORM_EPS: f32 = 1e-6;

/// How the queries are projected.
enum QueryProjection<B: Backend> {
    /// `q_b_proj(q_a_layernorm(q_a_proj(x)))`.
    LowRank {
        a: B::Weight,
        a_bias: Option<B::Weight>,
        norm: B::Weight,
        b: B::Weight,
    },
    /// `q_proj(x)`.
    Full(B::Weight),
}

pub struct LatentAttention<B: Backend> {
    q: QueryProjection<B>,
    kv_a_proj: B::Weight,
    kv_a_bias: Option<B::Weight>,
    kv_a_norm: B::Weight,
    kv_b_proj: B::Weight,
    o_proj: B::Weight,
    o_bias: Option<B::Weight>,
    params: MlaParams,
}

impl<B: Backend> LatentAttention<B> {
    pub fn load(w: &WeightLoader<B>, prefix: &str, spec: &ModelSpec, mla: &MlaSpec) -> Result<Self> {
        let params = MlaParams {
            num_heads: spec.num_heads,
            kv_lora_rank: mla.kv_lora_rank,
            qk_nope_head_dim: mla.qk_nope_head_dim,
            qk_rope_head_dim: mla.qk_rope_head_dim,
            v_head_dim: mla.v_head_dim,
            scale: mla.softmax_scale,
            rope_interleaved: mla.rope_interleaved,
            eps: LATENT_NORM_EPS,
        };
        let h = spec.hidden_size;
        let name = |n: &str| format!("{prefix}.{n}");
        let bias = |n: &str, width: usize| -> Result<Option<B::Weight>> {
            w.optional(&name(n), &[width])?.map(|t| w.backend.weight(t)).transpose()
        };
        let q = match mla.q_lora_rank {
            Some(rank) => QueryProjection::LowRank {
                a: w.load(&name("q_a_proj.weight"), &[rank, h])?,
                a_bias: bias("q_a_proj.bias", rank)?,
                norm: w.norm(&name("q_a_layernorm.weight"), rank, false)?,
                b: w.load(&name("q_b_proj.weight"), &[params.q_width(), rank])?,
            },
            None => QueryProjection::Full(w.load(&name("q_proj.weight"), &[params.q_width(), h])?),
        };
        let latent = params.latent_width();
        Ok(LatentAttention {
            q,
            kv_a_proj: w.load(&name("kv_a_proj_with_mqa.weight"), &[latent, h])?,
            kv_a_bias: bias("kv_a_proj_with_mqa.bias", latent)?,
            kv_a_norm: w.norm(&name("kv_a_layernorm.weight"), mla.kv_lora_rank, false)?,
            kv_b_proj: w.load(&name("kv_b_proj.weight"), &[params.kv_b_rows(), mla.kv_lora_rank])?,
            o_proj: w.load(&name("o_proj.weight"), &[h, params.out_width()])?,
            o_bias: bias("o_proj.bias", h)?,
            params,
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
        let q = match &self.q {
            QueryProjection::LowRank { a, a_bias, norm, b } => {
                let compressed = be.linear(x, a, a_bias.as_ref())?;
                let normed = be.rms_norm(&compressed, norm, be.shape(&compressed).1, LATENT_NORM_EPS)?;
                be.linear(&normed, b, None)?
            }
            QueryProjection::Full(q_proj) => be.linear(x, q_proj, None)?,
        };
        let compressed = be.linear(x, &self.kv_a_proj, self.kv_a_bias.as_ref())?;
        let out = be.mla_attention(
            &q,
            &compressed,
            &self.kv_a_norm,
            &self.kv_b_proj,
            rope,
            kv,
            layer,
            batch,
            &self.params,
        )?;
        be.linear_add_rms_norm(&out, &self.o_proj, self.o_bias.as_ref(), into)
    }
}

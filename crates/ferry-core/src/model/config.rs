//! What every family's config.json has in common, and the description of a model the shared decoder is built
//! from ([`ModelSpec`]). Each family file maps its own config onto a `ModelSpec`.

use serde::Deserialize;

use crate::backend::RouterKind;
use crate::{Error, Result};

/// The fields of config.json shared by the decoder-only families.
#[derive(Clone, Debug, Deserialize)]
pub struct BaseConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    /// transformers < 5 writes `rope_theta`; 5 writes `rope_parameters: {rope_type, rope_theta, ...}`.
    pub rope_theta: Option<f64>,
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

#[derive(Clone, Debug, Deserialize)]
pub struct RopeParameters {
    pub rope_theta: Option<f64>,
    pub rope_type: Option<String>,
    pub partial_rotary_factor: Option<f64>,
}

/// How q and k are normalised after their projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// RMSNorm over each head's `head_dim` features (Qwen3).
    PerHead,
    /// RMSNorm over the whole projected width, all heads together (OLMoE).
    Full,
}

/// Where a family keeps its MoE tensors, relative to `model.layers.N.`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertNaming {
    /// The MoE block: `mlp` or Mixtral's `block_sparse_moe`.
    pub block: &'static str,
    /// Per-expert gate, up and down projections: `gate_proj`/`up_proj`/`down_proj` or Mixtral's `w1`/`w3`/`w2`.
    pub projections: [&'static str; 3],
}

pub const STANDARD_EXPERTS: ExpertNaming = ExpertNaming {
    block: "mlp",
    projections: ["gate_proj", "up_proj", "down_proj"],
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    /// A dense SwiGLU MLP of this intermediate size.
    Dense {
        intermediate: usize,
    },
    Moe,
}

#[derive(Clone, Debug)]
pub struct MoeSpec {
    pub num_experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
    pub router: RouterKind,
    /// A shared expert of this intermediate size, scaled by `sigmoid(shared_expert_gate(x))` (Qwen2-MoE).
    pub shared_expert_intermediate: Option<usize>,
    pub naming: ExpertNaming,
}

/// Everything the shared decoder needs to know about a model.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub model_type: &'static str,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rotary_dim: usize,
    pub max_position_embeddings: usize,
    pub sliding_window: Option<usize>,
    pub qk_norm: QkNorm,
    pub tie_word_embeddings: bool,
    /// One entry per decoder layer.
    pub ffn: Vec<FfnKind>,
    pub moe: Option<MoeSpec>,
}

impl BaseConfig {
    /// The spec's attention and embedding part; the family fills in `ffn`, `moe`, `qk_norm` and `sliding_window`.
    pub fn spec(&self, model_type: &'static str) -> Result<ModelSpec> {
        let num_kv_heads = self.num_key_value_heads.unwrap_or(self.num_attention_heads);
        if self.num_attention_heads == 0 || num_kv_heads == 0 || !self.num_attention_heads.is_multiple_of(num_kv_heads)
        {
            return Err(Error::Config(format!(
                "num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({num_kv_heads})",
                self.num_attention_heads
            )));
        }
        let head_dim = self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(Error::Config(format!("head_dim {head_dim} must be even and positive")));
        }
        if let Some(scaling) = self.rope_scaling.as_ref().filter(|v| !v.is_null()) {
            return Err(Error::Config(format!("rope_scaling {scaling} is not supported yet")));
        }
        let rope = self.rope_parameters.as_ref();
        if let Some(kind) = rope.and_then(|r| r.rope_type.as_deref()).filter(|t| *t != "default") {
            return Err(Error::Config(format!("rope_type \"{kind}\" is not supported yet")));
        }
        let rope_theta = self
            .rope_theta
            .or(rope.and_then(|r| r.rope_theta))
            .ok_or_else(|| Error::Config("no rope_theta (top level or in rope_parameters)".into()))?;
        let partial = rope.and_then(|r| r.partial_rotary_factor).unwrap_or(1.0);
        let rotary_dim = ((head_dim as f64 * partial) as usize) & !1;
        Ok(ModelSpec {
            model_type,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_heads: self.num_attention_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: self.rms_norm_eps as f32,
            rope_theta: rope_theta as f32,
            rotary_dim,
            max_position_embeddings: self.max_position_embeddings,
            sliding_window: None,
            qk_norm: QkNorm::None,
            tie_word_embeddings: self.tie_word_embeddings,
            ffn: vec![FfnKind::Moe; self.num_hidden_layers],
            moe: None,
        })
    }
}

/// Parses a family's config struct, naming the field at fault.
pub fn parse<T: serde::de::DeserializeOwned>(config: &serde_json::Value) -> Result<T> {
    serde_json::from_value(config.clone()).map_err(|e| Error::Config(format!("config.json: {e}")))
}

/// Qwen's rule for which layers are MoE: not listed in `mlp_only_layers`, and every `decoder_sparse_step`-th.
pub fn qwen_ffn_layers(
    num_layers: usize,
    num_experts: usize,
    decoder_sparse_step: usize,
    mlp_only_layers: &[usize],
    dense_intermediate: usize,
) -> Vec<FfnKind> {
    (0..num_layers)
        .map(|i| {
            let sparse = !mlp_only_layers.contains(&i)
                && num_experts > 0
                && decoder_sparse_step > 0
                && (i + 1) % decoder_sparse_step == 0;
            if sparse {
                FfnKind::Moe
            } else {
                FfnKind::Dense {
                    intermediate: dense_intermediate,
                }
            }
        })
        .collect()
}

pub fn check_top_k(num_experts: usize, top_k: usize) -> Result<()> {
    if top_k == 0 || top_k > num_experts {
        return Err(Error::Config(format!(
            "num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({num_experts})"
        )));
    }
    Ok(())
}

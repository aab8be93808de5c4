//! Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head q/k RMSNorm, softmax top-k router with optional
//! renormalisation, dense layers chosen by `mlp_only_layers` and `decoder_sparse_step`.

use serde::Deserialize;

use super::config::{check_top_k, parse, qwen_ffn_layers, BaseConfig, ModelSpec, MoeSpec, QkNorm, STANDARD_EXPERTS};
use crate::backend::RouterKind;
use crate::{Error, Result};

#[derive(Deserialize)]
struct Qwen3MoeConfig {
    #[serde(flatten)]
    base: BaseConfig,
    /// transformers 5 writes `num_local_experts`.
    #[serde(alias = "num_local_experts")]
    num_experts: usize,
    num_experts_per_tok: usize,
    moe_intermediate_size: usize,
    intermediate_size: usize,
    #[serde(default = "one")]
    decoder_sparse_step: usize,
    #[serde(default)]
    mlp_only_layers: Vec<usize>,
    #[serde(default)]
    norm_topk_prob: bool,
    #[serde(default)]
    use_sliding_window: bool,
}

fn one() -> usize {
    1
}

pub fn spec(config: &serde_json::Value) -> Result<ModelSpec> {
    let c: Qwen3MoeConfig = parse(config)?;
    if c.use_sliding_window {
        return Err(Error::Config(
            "use_sliding_window is not supported for qwen3_moe".into(),
        ));
    }
    check_top_k(c.num_experts, c.num_experts_per_tok)?;
    let mut spec = c.base.spec("qwen3_moe")?;
    spec.qk_norm = QkNorm::PerHead;
    spec.ffn = qwen_ffn_layers(
        c.base.num_hidden_layers,
        c.num_experts,
        c.decoder_sparse_step,
        &c.mlp_only_layers,
        c.intermediate_size,
    );
    spec.moe = Some(MoeSpec {
        num_experts: c.num_experts,
        top_k: c.num_experts_per_tok,
        intermediate: c.moe_intermediate_size,
        router: RouterKind::SoftmaxTopK {
            renormalize: c.norm_topk_prob,
        },
        shared_expert_intermediate: None,
        naming: STANDARD_EXPERTS,
    });
    Ok(spec)
}

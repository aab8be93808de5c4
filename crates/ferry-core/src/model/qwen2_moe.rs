//! Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): biases on q/k/v, softmax top-k router, and a shared expert
//! scaled by `sigmoid(shared_expert_gate(x))`.

use serde::Deserialize;

use super::config::{check_top_k, parse, qwen_ffn_layers, BaseConfig, ModelSpec, MoeSpec, STANDARD_EXPERTS};
use crate::backend::RouterKind;
use crate::{Error, Result};

#[derive(Deserialize)]
struct Qwen2MoeConfig {
    #[serde(flatten)]
    base: BaseConfig,
    num_experts: usize,
    num_experts_per_tok: usize,
    moe_intermediate_size: usize,
    shared_expert_intermediate_size: usize,
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
    let c: Qwen2MoeConfig = parse(config)?;
    if c.use_sliding_window {
        return Err(Error::Config(
            "use_sliding_window is not supported for qwen2_moe".into(),
        ));
    }
    check_top_k(c.num_experts, c.num_experts_per_tok)?;
    let mut spec = c.base.spec("qwen2_moe")?;
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
        shared_expert_intermediate: Some(c.shared_expert_intermediate_size),
        naming: STANDARD_EXPERTS,
    });
    Ok(spec)
}

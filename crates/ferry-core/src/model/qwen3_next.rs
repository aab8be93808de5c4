//! Qwen3-Next (Qwen3-Next-80B-A3B): the hybrid of three Gated DeltaNet layers to one gated-attention layer, with
//! the Gated DeltaNet projections fused per key head (`in_proj_qkvz`, `in_proj_ba`), (1 + w) RMSNorms, and a
//! softmax top-k router with a sigmoid-gated shared expert; `mlp_only_layers` / `decoder_sparse_step` make some
//! layers dense.

use serde::Deserialize;

use super::config::{
    check_top_k, parse, qwen_ffn_layers, BaseConfig, GdnProjections, HybridConfig, ModelSpec, MoeSpec, STANDARD_EXPERTS,
};
use crate::backend::RouterKind;
use crate::Result;

#[derive(Deserialize)]
struct Qwen3NextConfig {
    #[serde(flatten)]
    base: BaseConfig,
    #[serde(flatten)]
    hybrid: HybridConfig,
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
}

fn one() -> usize {
    1
}

pub fn spec(config: &serde_json::Value) -> Result<ModelSpec> {
    let c: Qwen3NextConfig = parse(config)?;
    check_top_k(c.num_experts, c.num_experts_per_tok)?;
    let mut spec = c.base.spec("qwen3_next")?;
    spec.ffn = qwen_ffn_layers(
        c.base.num_hidden_layers,
        c.num_experts,
        c.decoder_sparse_step,
        &c.mlp_only_layers,
        c.intermediate_size,
    );
    c.hybrid.apply(&mut spec, GdnProjections::GroupedByKeyHead)?;
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

//! Mixtral (8x7B, 8x22B): softmax top-2 router renormalised over the chosen experts, experts stored as
//! `block_sparse_moe.experts.N.w1/w3/w2` (gate/up/down), optional sliding-window attention.

use serde::Deserialize;

use super::config::{check_top_k, parse, BaseConfig, ExpertLayout, ExpertNaming, ModelSpec, MoeSpec};
use crate::backend::{ExpertActivation, RouterKind};
use crate::Result;

#[derive(Deserialize)]
struct MixtralConfig {
    #[serde(flatten)]
    base: BaseConfig,
    num_local_experts: usize,
    num_experts_per_tok: usize,
    intermediate_size: usize,
    #[serde(default)]
    sliding_window: Option<usize>,
}

pub fn spec(config: &serde_json::Value) -> Result<ModelSpec> {
    let c: MixtralConfig = parse(config)?;
    check_top_k(c.num_local_experts, c.num_experts_per_tok)?;
    let mut spec = c.base.spec("mixtral")?;
    spec.set_attention_window(c.sliding_window);
    spec.moe = Some(MoeSpec {
        num_experts: c.num_local_experts,
        top_k: c.num_experts_per_tok,
        intermediate: c.intermediate_size,
        router: RouterKind::SoftmaxTopK { renormalize: true },
        activation: ExpertActivation::SiluGlu,
        shared_expert: None,
        naming: ExpertNaming {
            block: "block_sparse_moe",
            router: "gate",
            projections: ["w1", "w3", "w2"],
            layout: ExpertLayout::Standard,
        },
    });
    Ok(spec)
}

//! Qwen3-Next (Qwen3-Next-80B-A3B): the hybrid of three Gated DeltaNet layers to one gated-attention layer, with
//! the Gated DeltaNet projections fused per key head (`in_proj_qkvz`, `in_proj_ba`), (1 + w) RMSNorms, and a
//! softmax top-k router with a sigmoid-gated shared expert; `mlp_only_layers` / `decoder_sparse_step` make some
//! layers dense.

use serde::Deserialize;

use super::config::{parse, BaseConfig, GdnProjections, HybridConfig, ModelSpec, QwenMoeConfig};
use crate::Result;

#[derive(Deserialize)]
struct Qwen3NextConfig {
    #[serde(flatten)]
    base: BaseConfig,
    #[serde(flatten)]
    hybrid: HybridConfig,
    #[serde(flatten)]
    moe: QwenMoeConfig,
    shared_expert_intermediate_size: usize,
}

pub fn spec(config: &serde_json::Value) -> Result<ModelSpec> {
    let c: Qwen3NextConfig = parse(config)?;
    let mut spec = c
        .moe
        .spec(&c.base, "qwen3_next", Some(c.shared_expert_intermediate_size))?;
    c.hybrid.apply(&mut spec, GdnProjections::GroupedByKeyHead)?;
    Ok(spec)
}

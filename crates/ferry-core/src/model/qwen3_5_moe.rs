//! Qwen3.5 / Qwen3.6 MoE (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B): the Qwen3-Next hybrid (three Gated DeltaNet layers to
//! one gated-attention layer, (1 + w) RMSNorms, sigmoid-gated shared expert) with separate Gated DeltaNet
//! projections (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), every layer MoE, and a router that always
//! renormalises its top-k weights.
//!
//! Published as `qwen3_5_moe` (Qwen3_5MoeForConditionalGeneration): the text config under `text_config`, the text
//! weights under `model.language_model.`, beside a vision tower (`model.visual.*`) and a multi-token-prediction
//! head (`mtp.*`) that text generation does not load. `qwen3_5_moe_text` (Qwen3_5MoeForCausalLM) is the text model
//! alone.

use serde::Deserialize;

use super::config::{parse, BaseConfig, GdnProjections, HybridConfig, ModelSpec, QwenExpertsConfig};
use crate::Result;

#[derive(Deserialize)]
struct Qwen3_5MoeConfig {
    #[serde(flatten)]
    base: BaseConfig,
    #[serde(flatten)]
    hybrid: HybridConfig,
    #[serde(flatten)]
    experts: QwenExpertsConfig,
    shared_expert_intermediate_size: usize,
}

pub fn spec(config: &serde_json::Value) -> Result<ModelSpec> {
    let c: Qwen3_5MoeConfig = parse(config)?;
    let moe = c.experts.moe_spec(true, Some(c.shared_expert_intermediate_size))?;
    let mut spec = c.base.spec("qwen3_5_moe")?;
    c.hybrid.apply(&mut spec, GdnProjections::Separate)?;
    spec.moe = Some(moe);
    Ok(spec)
}

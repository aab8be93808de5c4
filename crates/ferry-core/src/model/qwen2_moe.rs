//! Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): biases on q/k/v, softmax top-k router, and a shared expert
//! scaled by `sigmoid(shared_expert_gate(x))`.

use serde::Deserialize;

use super::config::{parse, BaseConfig, ModelSpec, QwenMoeConfig};
use crate::Result;

#[derive(Deserialize)]
struct Qwen2MoeConfig {
    #[serde(flatten)]
    base: BaseConfig,
    #[serde(flatten)]
    moe: QwenMoeConfig,
    shared_expert_intermediate_size: usize,
}

pub fn spec(config: &serde_json::Value) -> Result<ModelSpec> {
    let c: Qwen2MoeConfig = parse(config)?;
    c.moe
        .spec(&c.base, "qwen2_moe", Some(c.shared_expert_intermediate_size))
}

//! Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head q/k RMSNorm, softmax top-k router with optional
//! renormalisation, dense layers chosen by `mlp_only_layers` and `decoder_sparse_step`.

use serde::Deserialize;

use super::config::{parse, BaseConfig, ModelSpec, QkNorm, QwenMoeConfig};
use crate::Result;

#[derive(Deserialize)]
struct Qwen3MoeConfig {
    #[serde(flatten)]
    base: BaseConfig,
    #[serde(flatten)]
    moe: QwenMoeConfig,
}

pub fn spec(config: &serde_json::Value) -> Result<ModelSpec> {
    let c: Qwen3MoeConfig = parse(config)?;
    let mut spec = c.moe.spec(&c.base, "qwen3_moe", None)?;
    spec.qk_norm = QkNorm::PerHead;
    Ok(spec)
}

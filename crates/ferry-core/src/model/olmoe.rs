//! OLMoE (OLMoE-1B-7B): q/k RMSNorm over the full projected width (all heads together), softmax top-k router
//! without renormalisation by default.

use serde::Deserialize;

use super::config::{check_top_k, parse, BaseConfig, ModelSpec, MoeSpec, QkNorm, STANDARD_EXPERTS};
use crate::backend::{ExpertActivation, RouterKind};
use crate::{Error, Result};

#[derive(Deserialize)]
struct OlmoeConfig {
    #[serde(flatten)]
    base: BaseConfig,
    num_experts: usize,
    num_experts_per_tok: usize,
    intermediate_size: usize,
    #[serde(default)]
    norm_topk_prob: bool,
    #[serde(default)]
    clip_qkv: Option<f64>,
}

pub fn spec(config: &serde_json::Value) -> Result<ModelSpec> {
    let c: OlmoeConfig = parse(config)?;
    if let Some(clip) = c.clip_qkv {
        return Err(Error::Config(format!("clip_qkv ({clip}) is not supported for olmoe")));
    }
    check_top_k(c.num_experts, c.num_experts_per_tok)?;
    let mut spec = c.base.spec("olmoe")?;
    spec.qk_norm = QkNorm::Full;
    spec.moe = Some(MoeSpec {
        num_experts: c.num_experts,
        top_k: c.num_experts_per_tok,
        intermediate: c.intermediate_size,
        router: RouterKind::SoftmaxTopK {
            renormalize: c.norm_topk_prob,
        },
        activation: ExpertActivation::SiluGlu,
        shared_expert: None,
        naming: STANDARD_EXPERTS,
    });
    Ok(spec)
}

//! DeepSeek-V3 / R1 and Kimi-K2 (`deepseek_v3`, `kimi_k2`: the same modeling): multi-head latent attention with
//! YaRN, the first `first_k_dense_replace` layers dense, then MoE layers routed by sigmoid scores with a
//! correction bias among groups of experts, and a shared expert added as is. The checkpoints' MTP layers (stored as
//! decoder layers past `num_hidden_layers`) are not part of the spec; `Model::load` logs them as skipped.

use serde::Deserialize;

use super::config::{parse, BaseConfig, GroupedSigmoidMoe, MlaSpec, ModelSpec};
use crate::{Error, Result};

#[derive(Deserialize)]
struct DeepseekV3Config {
    #[serde(flatten)]
    base: BaseConfig,
    #[serde(flatten)]
    moe: GroupedSigmoidMoe,
    /// Every `moe_layer_freq`-th layer past the dense ones is MoE; DeepSeek-V3 and Kimi-K2 use 1.
    moe_layer_freq: Option<usize>,
    /// Hub configs say how experts are scored and chosen; transformers' DeepSeek-V3 knows only these.
    scoring_func: Option<String>,
    topk_method: Option<String>,
    q_lora_rank: Option<usize>,
    kv_lora_rank: usize,
    qk_nope_head_dim: usize,
    qk_rope_head_dim: usize,
    v_head_dim: usize,
    #[serde(default = "default_true")]
    rope_interleave: bool,
}

fn default_true() -> bool {
    true
}

fn refuse_other(field: &str, value: Option<&str>, supported: &str) -> Result<()> {
    match value {
        Some(v) if v != supported => Err(Error::Config(format!(
            "{field} \"{v}\" is not supported (DeepSeek-V3's is \"{supported}\")"
        ))),
        _ => Ok(()),
    }
}

pub fn spec(config: &serde_json::Value, model_type: &'static str) -> Result<ModelSpec> {
    let c: DeepseekV3Config = parse(config)?;
    refuse_other("scoring_func", c.scoring_func.as_deref(), "sigmoid")?;
    refuse_other("topk_method", c.topk_method.as_deref(), "noaux_tc")?;
    if let Some(freq) = c.moe_layer_freq.filter(|&f| f != 1) {
        return Err(Error::Config(format!("moe_layer_freq {freq} is not supported (1)")));
    }
    let rope = c.qk_rope_head_dim;
    if rope == 0 || !rope.is_multiple_of(2) || c.kv_lora_rank == 0 || c.v_head_dim == 0 {
        return Err(Error::Config(format!(
            "qk_rope_head_dim ({rope}) must be even and positive, kv_lora_rank ({}) and v_head_dim ({}) positive",
            c.kv_lora_rank, c.v_head_dim
        )));
    }
    let mut spec = c.base.spec(model_type)?;
    let qk_head_dim = c.qk_nope_head_dim + rope;
    spec.num_kv_heads = spec.num_heads;
    spec.head_dim = qk_head_dim;
    spec.rotary_dim = rope;
    // transformers' yarn_apply_mscale (YaRN's `mscale_all_dim` corrects the softmax scale), in f64 and rounded once
    // as transformers computes it in Python floats.
    let mscale_all_dim = ["rope_parameters", "rope_scaling"]
        .iter()
        .filter_map(|key| config.get(key)?.get("mscale_all_dim")?.as_f64())
        .find(|&m| m != 0.0);
    let mscale = match (&spec.rope_scaling, mscale_all_dim) {
        (Some(yarn), Some(all)) if yarn.factor > 1.0 => 0.1 * all * yarn.factor.ln() + 1.0,
        _ => 1.0,
    };
    let softmax_scale = ((qk_head_dim as f64).powf(-0.5) * mscale * mscale) as f32;
    spec.mla = Some(MlaSpec {
        q_lora_rank: c.q_lora_rank,
        kv_lora_rank: c.kv_lora_rank,
        qk_nope_head_dim: c.qk_nope_head_dim,
        qk_rope_head_dim: rope,
        v_head_dim: c.v_head_dim,
        rope_interleaved: c.rope_interleave,
        softmax_scale,
    });
    c.moe.apply(&mut spec)?;
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::info::ModelInfo;
    use crate::model::FfnKind;

    /// DeepSeek-V3's published config.json (4.x conventions, YaRN in rope_scaling), as bench/dsv3.json holds it.
    fn deepseek_v3() -> serde_json::Value {
        let path = format!("{}/../../bench/dsv3.json", env!("CARGO_MANIFEST_DIR"));
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    #[test]
    fn deepseek_v3s_config() {
        let spec = spec(&deepseek_v3(), "deepseek_v3").unwrap();
        let mla = spec.mla.as_ref().unwrap();
        let mscale = 0.1 * 40f32.ln() + 1.0;
        assert!((mla.softmax_scale - mscale * mscale / 192f32.sqrt()).abs() < 1e-6);
        assert_eq!(
            (mla.q_lora_rank, mla.kv_lora_rank, mla.rope_interleaved),
            (Some(1536), 512, true)
        );
        assert_eq!(
            spec.layers.iter().filter(|l| l.ffn == FfnKind::Moe).count(),
            58,
            "three dense layers"
        );
        let info = ModelInfo::new(
            &spec,
            crate::loader::WeightFormat {
                dtype: crate::loader::DType::BF16,
                experts_fp8: None,
                dense_fp8: None,
            },
        );
        assert_eq!(
            info.kv_bytes_per_token_bf16,
            61 * (512 + 64) * 2,
            "the KV cache keeps the latent and the rope key, not expanded keys and values"
        );
        assert!(
            (670e9..672e9).contains(&(info.params_total as f64)),
            "671B parameters: {}",
            info.params_total
        );
        assert!(
            (36e9..39e9).contains(&(info.params_active_per_token as f64)),
            "37B active: {}",
            info.params_active_per_token
        );
    }

    #[test]
    fn other_scoring_is_refused() {
        let mut config = deepseek_v3();
        config["scoring_func"] = "softmax".into();
        assert!(spec(&config, "deepseek_v3")
            .unwrap_err()
            .to_string()
            .contains("scoring_func"));
    }
}

//! GLM-4.5, GLM-4.5-Air and GLM-4.6 (`glm4_moe`): partial rotary (half of each head by default), optional
//! per-head q/k norm, q/k/v biases, DeepSeek-V3's sigmoid router with its correction bias (`n_group` groups,
//! one in the released models), shared experts added as is, and the first `first_k_dense_replace` layers dense.
//! The checkpoints' multi-token-prediction layers (`model.layers.{num_hidden_layers + i}`) are not the decoder's:
//! the weight store counts them outside the text model and loading logs them as skipped.

use serde::Deserialize;

use super::config::{parse, with_defaults, BaseConfig, GroupedSigmoidMoe, ModelSpec, QkNorm};
use crate::Result;

#[derive(Deserialize)]
struct Glm4MoeConfig {
    #[serde(flatten)]
    base: BaseConfig,
    #[serde(flatten)]
    moe: GroupedSigmoidMoe,
    #[serde(default)]
    use_qk_norm: bool,
}

/// transformers' `Glm4MoeConfig` defaults for the MoE fields a config may leave out.
fn moe_defaults() -> [(&'static str, serde_json::Value); 5] {
    [
        ("n_shared_experts", 1.into()),
        ("n_group", 1.into()),
        ("topk_group", 1.into()),
        ("first_k_dense_replace", 1.into()),
        ("routed_scaling_factor", 1.0.into()),
    ]
}

/// transformers' `Glm4MoeConfig` rotates half of each head when the config names no factor.
const DEFAULT_PARTIAL_ROTARY_FACTOR: f64 = 0.5;

pub fn spec(config: &serde_json::Value) -> Result<ModelSpec> {
    let mut c: Glm4MoeConfig = parse(&with_defaults(config, &moe_defaults()))?;
    let named = c.base.rope_parameters.as_ref().and_then(|r| r.partial_rotary_factor);
    if named.is_none() && c.base.partial_rotary_factor.is_none() {
        c.base.partial_rotary_factor = Some(DEFAULT_PARTIAL_ROTARY_FACTOR);
    }
    let mut spec = c.base.spec("glm4_moe")?;
    if c.use_qk_norm {
        spec.qk_norm = QkNorm::PerHead;
    }
    c.moe.apply(&mut spec)?;
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::RouterKind;
    use crate::model::config::SharedExpert;
    use crate::model::{FfnKind, LayerSpec, Mixer, ModelInfo};
    use crate::Error;

    fn bench_config() -> serde_json::Value {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench/glm45air.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    #[test]
    fn glm45_air_is_one_dense_layer_then_45_moe_layers_of_128_experts_and_a_shared_one() {
        let spec = spec(&bench_config()).unwrap();
        assert_eq!(spec.layers.len(), 46);
        let dense = LayerSpec {
            mixer: Mixer::FULL_ATTENTION,
            ffn: FfnKind::Dense { intermediate: 10944 },
        };
        assert_eq!(spec.layers[0], dense);
        assert!(spec.layers[1..].iter().all(|l| l.ffn == FfnKind::Moe));
        assert_eq!(
            (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rotary_dim),
            (96, 8, 128, 64)
        );
        assert_eq!(spec.qk_norm, QkNorm::None);
        let moe = spec.moe.as_ref().unwrap();
        assert_eq!((moe.num_experts, moe.top_k, moe.intermediate), (128, 8, 1408));
        assert_eq!(
            moe.router,
            RouterKind::SigmoidGroupedTopK {
                n_group: 1,
                topk_group: 1,
                renormalize: true,
                scaling: 1.0
            }
        );
        assert_eq!(
            moe.shared_expert,
            Some(SharedExpert {
                intermediate: 1408,
                sigmoid_gated: false
            })
        );
        // 106B parameters as published (its MTP layer aside), and 12B active, a count that leaves out the
        // embedding table and the output head.
        let info = ModelInfo::new(
            &spec,
            crate::loader::WeightFormat {
                dtype: crate::loader::DType::BF16,
                experts_fp8: None,
                dense_fp8: None,
            },
        );
        assert!(
            (105e9..108e9).contains(&(info.params_total as f64)),
            "{}",
            info.params_total
        );
        let active = info.params_active_per_token - 2 * 151552 * 4096;
        assert!((11.5e9..12.5e9).contains(&(active as f64)), "{active}");
    }

    #[test]
    fn half_of_each_head_rotates_when_the_config_names_no_factor() {
        let mut config = bench_config();
        config.as_object_mut().unwrap().remove("partial_rotary_factor");
        assert_eq!(spec(&config).unwrap().rotary_dim, 64);
        config["partial_rotary_factor"] = 1.0.into();
        assert_eq!(spec(&config).unwrap().rotary_dim, 128);
        config["first_k_dense_replace"] = 47.into();
        assert!(matches!(spec(&config), Err(Error::Config(_))));
    }
}

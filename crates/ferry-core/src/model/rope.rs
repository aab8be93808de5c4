//! Rotary position embedding from config.json: plain RoPE, or YaRN (`rope_type: yarn`, as gpt-oss and DeepSeek-V3
//! ship it), turned into the [`Rope`] both backends apply. YaRN's frequencies and attention factor are computed
//! here exactly as transformers' `_compute_yarn_parameters` computes them (f32 tensors, f64 Python scalars).

use serde::Deserialize;

use super::config::ModelSpec;
use crate::backend::{rope_wavelengths, Rope};
use crate::{Error, Result};

/// RoPE settings as config.json writes them: transformers 5's `rope_parameters`, or the older `rope_scaling`
/// (which names its kind `type` or `rope_type`).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct RopeParameters {
    pub rope_theta: Option<f64>,
    pub rope_type: Option<String>,
    #[serde(rename = "type")]
    legacy_type: Option<String>,
    pub partial_rotary_factor: Option<f64>,
    factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
    beta_fast: Option<f64>,
    beta_slow: Option<f64>,
    truncate: Option<bool>,
    attention_factor: Option<f64>,
    mscale: Option<f64>,
    mscale_all_dim: Option<f64>,
}

impl RopeParameters {
    fn kind(&self) -> &str {
        self.rope_type
            .as_deref()
            .or(self.legacy_type.as_deref())
            .unwrap_or("default")
    }
}

/// YaRN's settings, resolved as transformers resolves them: frequencies below `beta_slow` rotations over the
/// original context are interpolated (divided by `factor`), those above `beta_fast` kept, a linear ramp between;
/// cos and sin are scaled by `attention_factor`.
#[derive(Clone, Debug, PartialEq)]
pub struct YarnScaling {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Round the ramp's ends outwards to whole dimensions (transformers' default; gpt-oss sets false).
    pub truncate: bool,
    pub attention_factor: f64,
}

/// YaRN's scaling from `rope_parameters` or `rope_scaling` (whichever names a kind other than default); None for
/// plain RoPE. Any other kind is an error naming it.
pub fn scaling_from_config(
    rope_parameters: Option<&RopeParameters>,
    rope_scaling: Option<&RopeParameters>,
    max_position_embeddings: usize,
) -> Result<Option<YarnScaling>> {
    let Some(p) = [rope_parameters, rope_scaling]
        .into_iter()
        .flatten()
        .find(|p| p.kind() != "default")
    else {
        return Ok(None);
    };
    if p.kind() != "yarn" {
        return Err(Error::Config(format!(
            "rope_type \"{}\" is not supported (default, yarn)",
            p.kind()
        )));
    }
    let original = p
        .original_max_position_embeddings
        .unwrap_or(max_position_embeddings as f64);
    let factor = p.factor.unwrap_or(max_position_embeddings as f64 / original);
    if !(factor > 0.0 && original > 0.0) {
        return Err(Error::Config(format!(
            "YaRN needs a positive factor ({factor}) and original_max_position_embeddings ({original})"
        )));
    }
    let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
    // Python's truthiness: an mscale of 0 counts as absent, as does a beta of 0.
    let attention_factor = p.attention_factor.unwrap_or(match (p.mscale, p.mscale_all_dim) {
        (Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(factor, m) / mscale(factor, all),
        _ => mscale(factor, 1.0),
    });
    Ok(Some(YarnScaling {
        factor,
        original_max_position_embeddings: original,
        beta_fast: p.beta_fast.filter(|&b| b != 0.0).unwrap_or(32.0),
        beta_slow: p.beta_slow.filter(|&b| b != 0.0).unwrap_or(1.0),
        truncate: p.truncate.unwrap_or(true),
        attention_factor,
    }))
}

impl YarnScaling {
    /// The blended frequencies for `rotary_dim` rotated features at base `theta`.
    pub fn inv_freq(&self, theta: f64, rotary_dim: usize) -> Vec<f32> {
        let dim = rotary_dim as f64;
        // The dimension whose wavelength fits `rotations` times into the original context.
        let correction_dim = |rotations: f64| {
            dim * (self.original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (correction_dim(self.beta_fast), correction_dim(self.beta_slow));
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
        if low == high {
            high += 0.001;
        }
        // torch computes the ramp in f32, the Python scalars rounded to it.
        let (span, low) = ((high - low) as f32, low as f32);
        let factor = self.factor as f32;
        rope_wavelengths(theta as f32, rotary_dim)
            .enumerate()
            .map(|(i, wavelength)| {
                let ramp = ((i as f32 - low) / span).clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                let interpolated = 1.0 / (factor * wavelength);
                interpolated * (1.0 - extrapolation) + (1.0 / wavelength) * extrapolation
            })
            .collect()
    }
}

/// The RoPE of a model's attention layers.
pub fn rope_for(spec: &ModelSpec) -> Rope {
    let mut rope = Rope::new(spec.rope_theta as f32, spec.head_dim, spec.rotary_dim);
    if let Some(yarn) = &spec.rope_scaling {
        rope.inv_freq = yarn.inv_freq(spec.rope_theta, spec.rotary_dim);
        rope.attention_factor = yarn.attention_factor as f32;
    }
    rope
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yarn(config: serde_json::Value, max_position_embeddings: usize) -> YarnScaling {
        let p: RopeParameters = serde_json::from_value(config).unwrap();
        scaling_from_config(Some(&p), None, max_position_embeddings)
            .unwrap()
            .unwrap()
    }

    /// `want` as torch printed its f32 values (in f64).
    fn assert_close(got: &[f32], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, &w)) in got.iter().zip(want).enumerate() {
            let w = w as f32;
            // f32 arithmetic in another order than torch's may differ in the last bit.
            assert!(
                (g - w).abs() <= 2.0 * f32::EPSILON * w.abs(),
                "inv_freq[{i}]: {g} against {w}"
            );
        }
    }

    // The expected values are transformers 5.17.0's `_compute_yarn_parameters` for the same settings:
    //   from transformers import GptOssConfig, DeepseekV3Config
    //   from transformers.modeling_rope_utils import _compute_yarn_parameters
    //   c = GptOssConfig(head_dim=64, num_attention_heads=64, hidden_size=2880, max_position_embeddings=131072,
    //       rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
    //       "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False})
    //   d = DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters={"rope_type":
    //       "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
    //       "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096})
    //   print(_compute_yarn_parameters(c), _compute_yarn_parameters(d))
    #[test]
    fn gpt_oss_yarn_matches_transformers() {
        let scaling = yarn(
            serde_json::json!({"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": false}),
            131072,
        );
        assert!((scaling.attention_factor - 1.3465735902799727).abs() < 1e-12);
        let want: [f64; 32] = [
            1.0,
            0.6890442967414856,
            0.4747820496559143,
            0.32714587450027466,
            0.22541800141334534,
            0.15532298386096954,
            0.1070244237780571,
            0.07374456524848938,
            0.05081327259540558,
            0.031705696135759354,
            0.019334999844431877,
            0.011592049151659012,
            0.006794959306716919,
            0.0038603590801358223,
            0.002093792660161853,
            0.00105260219424963,
            0.0004564839182421565,
            0.00012931869423482567,
            3.830881178146228e-05,
            2.6396468456368893e-05,
            1.818833698052913e-05,
            1.253256959898863e-05,
            8.635495760245249e-06,
            5.95023948335438e-06,
            4.099978468730114e-06,
            2.8250667583051836e-06,
            1.9465962850517826e-06,
            1.3412909538601525e-06,
            9.242089618055616e-07,
            6.368209142237902e-07,
            4.38797854940276e-07,
            3.023511396804679e-07,
        ];
        assert_close(&scaling.inv_freq(150000.0, 64), &want);
    }

    #[test]
    fn truncated_yarn_with_mscale_matches_transformers() {
        // DeepSeek-V3's settings, in the older `rope_scaling` spelling (`type`); truncate defaults to true.
        let p: RopeParameters = serde_json::from_value(serde_json::json!({"type": "yarn", "factor": 40.0,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096}))
        .unwrap();
        let plain = RopeParameters::default();
        let scaling = scaling_from_config(Some(&plain), Some(&p), 163840).unwrap().unwrap();
        assert_eq!(scaling.attention_factor, 1.0);
        let want: [f64; 32] = [
            1.0,
            0.7498942017555237,
            0.5623413324356079,
            0.4216965138912201,
            0.3162277638912201,
            0.23713736236095428,
            0.17782793939113617,
            0.1333521455526352,
            0.10000000149011612,
            0.07498941570520401,
            0.05623412877321243,
            0.039006926119327545,
            0.026879360899329185,
            0.01837814413011074,
            0.012447956018149853,
            0.0083345090970397,
            0.005500000435858965,
            0.0035619973205029964,
            0.002249365206807852,
            0.0013705134624615312,
            0.0007905694073997438,
            0.0004149904125370085,
            0.00017782794020604342,
            3.333803397254087e-05,
            2.499999936844688e-05,
            1.8747354260995053e-05,
            1.4058532542549074e-05,
            1.0542412383074407e-05,
            7.905694474175107e-06,
            5.928434347879374e-06,
            4.445698323252145e-06,
            3.3338035336782923e-06,
        ];
        assert_close(&scaling.inv_freq(10000.0, 64), &want);
    }

    #[test]
    fn the_attention_factor_follows_mscale_and_may_be_given() {
        let with = |extra: serde_json::Value| {
            let mut config = serde_json::json!({"rope_type": "yarn", "factor": 40.0,
                "original_max_position_embeddings": 4096});
            config
                .as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            yarn(config, 163840).attention_factor
        };
        let m = |scale: f64, m: f64| 0.1 * m * scale.ln() + 1.0;
        assert_eq!(
            with(serde_json::json!({"mscale": 1.0, "mscale_all_dim": 0.5})),
            m(40.0, 1.0) / m(40.0, 0.5)
        );
        assert_eq!(with(serde_json::json!({})), m(40.0, 1.0));
        assert_eq!(with(serde_json::json!({"attention_factor": 0.75})), 0.75);
    }

    #[test]
    fn other_rope_kinds_are_refused_by_name() {
        let p: RopeParameters = serde_json::from_value(serde_json::json!({"rope_type": "llama3"})).unwrap();
        let err = scaling_from_config(Some(&p), None, 8192).unwrap_err().to_string();
        assert!(err.contains("llama3"), "{err}");
    }
}

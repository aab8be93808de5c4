//! YaRN, the RoPE frequency scaling of DeepSeek-V3 and Kimi-K2 (rope_type "yarn"), as transformers'
//! `_compute_yarn_parameters` computes it: the scaled frequencies, the attention factor that scales cos and sin,
//! and the softmax-scale correction DeepSeek applies from `mscale_all_dim`.

use serde::Deserialize;

use crate::{Error, Result};

/// A config's YaRN settings (`rope_parameters` in transformers 5, `rope_scaling` in hub configs of 4.x).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: usize,
    pub beta_fast: Option<f64>,
    pub beta_slow: Option<f64>,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    pub attention_factor: Option<f64>,
    pub truncate: Option<bool>,
}

/// `0.1 * mscale * ln(scale) + 1`, or 1 when the scale does not extend the context.
fn get_mscale(scale: f64, mscale: f64) -> f64 {
    match scale <= 1.0 {
        true => 1.0,
        false => 0.1 * mscale * scale.ln() + 1.0,
    }
}

impl Yarn {
    /// The YaRN settings of `config` (from `rope_parameters`, else `rope_scaling`), None when its RoPE is the
    /// default; any other RoPE type is an error.
    pub fn from_config(config: &serde_json::Value) -> Result<Option<Yarn>> {
        let Some(rope) = ["rope_parameters", "rope_scaling"]
            .iter()
            .filter_map(|key| config.get(key))
            .find(|v| !v.is_null())
        else {
            return Ok(None);
        };
        let kind = rope
            .get("rope_type")
            .or_else(|| rope.get("type"))
            .and_then(|t| t.as_str());
        match kind {
            None | Some("default") => Ok(None),
            Some("yarn") => serde_json::from_value(rope.clone())
                .map(Some)
                .map_err(|e| Error::Config(format!("config.json: YaRN RoPE settings: {e}"))),
            Some(other) => Err(Error::Config(format!("rope_type \"{other}\" is not supported yet"))),
        }
    }

    /// The factor cos and sin are scaled by.
    pub fn attention_factor(&self) -> f32 {
        let factor = match (self.attention_factor, self.mscale, self.mscale_all_dim) {
            (Some(a), _, _) => a,
            (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                get_mscale(self.factor, m) / get_mscale(self.factor, all)
            }
            _ => get_mscale(self.factor, 1.0),
        };
        factor as f32
    }

    /// What DeepSeek's attention multiplies its softmax scale by: `mscale(factor, mscale_all_dim)` squared.
    pub fn softmax_scale_factor(&self) -> f64 {
        match self.mscale_all_dim.filter(|&m| m != 0.0) {
            Some(all) => get_mscale(self.factor, all) * get_mscale(self.factor, all),
            None => 1.0,
        }
    }

    /// The inverse frequencies of `dim` rotary features at base `theta`: interpolated (divided by the factor) for
    /// the slow dimensions, extrapolated (unchanged) for the fast ones, with a linear ramp between, in f32 as
    /// transformers computes them.
    pub fn inv_freq(&self, theta: f32, dim: usize) -> Vec<f32> {
        let (beta_fast, beta_slow) = (self.beta_fast.unwrap_or(32.0), self.beta_slow.unwrap_or(1.0));
        let base = theta as f64;
        let original = self.original_max_position_embeddings as f64;
        let correction_dim = |rotations: f64| {
            dim as f64 * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
        };
        let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
        if self.truncate.unwrap_or(true) {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0) as f32, high.min(dim as f64 - 1.0) as f32);
        if low == high {
            high += 0.001;
        }
        let factor = self.factor as f32;
        (0..dim / 2)
            .map(|i| {
                let pos_freq = theta.powf((2 * i) as f32 / dim as f32);
                let (extrapolation, interpolation) = (1.0 / pos_freq, 1.0 / (factor * pos_freq));
                let extrapolation_weight = 1.0 - ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                interpolation * (1.0 - extrapolation_weight) + extrapolation * extrapolation_weight
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deepseek_v3() -> serde_json::Value {
        serde_json::json!({
            "rope_theta": 10000,
            "rope_scaling": {
                "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0
            }
        })
    }

    #[test]
    fn deepseek_v3s_yarn() {
        let yarn = Yarn::from_config(&deepseek_v3()).unwrap().unwrap();
        assert_eq!(yarn.attention_factor(), 1.0, "mscale equals mscale_all_dim");
        let mscale = 0.1 * 40f64.ln() + 1.0;
        assert!((yarn.softmax_scale_factor() - mscale * mscale).abs() < 1e-12);
        let inv_freq = yarn.inv_freq(1e4, 64);
        // The fastest dimensions keep their frequency, the slowest are divided by the factor.
        assert_eq!(inv_freq[0], 1.0);
        let slowest = 1.0 / 1e4f32.powf(62.0 / 64.0);
        assert!((inv_freq[31] - slowest / 40.0).abs() < 1e-12);
        assert!(inv_freq.windows(2).all(|w| w[1] < w[0]));
    }

    #[test]
    fn default_rope_is_none_and_other_kinds_are_refused() {
        let default = serde_json::json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}});
        assert_eq!(Yarn::from_config(&default).unwrap(), None);
        assert_eq!(
            Yarn::from_config(&serde_json::json!({"rope_scaling": null})).unwrap(),
            None
        );
        let linear = serde_json::json!({"rope_scaling": {"type": "linear", "factor": 2.0}});
        assert!(Yarn::from_config(&linear).unwrap_err().to_string().contains("linear"));
        let missing = serde_json::json!({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}});
        let err = Yarn::from_config(&missing).unwrap_err().to_string();
        assert!(err.contains("original_max_position_embeddings"), "{err}");
    }
}

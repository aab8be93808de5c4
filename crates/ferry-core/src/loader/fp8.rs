//! FP8 (E4M3) weights: the two published checkpoint layouts, the scales that dequantize them, and the one
//! quantizer ferry applies itself.
//!
//! - Block FP8 (`quantization_config.quant_method: fp8`, Qwen's and DeepSeek's `*-FP8`): each FP8 `X.weight` has
//!   `X.weight_scale_inv` (f32 or bf16), one scale per `weight_block_size` block (128 × 128); a fused expert
//!   tensor `X` (no `.weight` suffix) has `X_scale_inv`.
//! - compressed-tensors (`quant_method: compressed-tensors`, `format: float-quantized`, the `FP8-Dynamic`
//!   checkpoints): `X.weight_scale`, one scale per output channel (`[out, 1]`), or per block under the `block`
//!   strategy.
//!
//! Either way the weight's value is `fp8 × scale` of its block, and activations stay in f32: ferry dequantizes
//! weights only (the `dynamic` activation quantization the configs name is a speed choice of the kernels that
//! wrote them, not part of the model's definition). Static activation scales are refused rather than ignored.
//! Not for the arithmetic: the CPU's gemv kernels and the CUDA kernels dequantize in their own loops.

use serde_json::Value;

use super::weights::{DType, TensorRef};
use crate::{Error, Result};

/// The largest finite E4M3 value.
pub const FP8_E4M3_MAX: f32 = 448.0;

/// Rows and columns of the blocks `--expert-dtype fp8` quantizes with (the published block-FP8 layout's).
pub const FP8_BLOCK: usize = 128;

/// How the scales of an FP8 checkpoint cover its matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Scheme {
    /// One scale per `rows × cols` block (the last blocks of a matrix may be partial).
    Blocks { rows: usize, cols: usize },
    /// One scale per output row (compressed-tensors' `channel` strategy).
    PerChannel,
}

impl Fp8Scheme {
    /// The published block-FP8 scheme, 128 × 128.
    pub const BLOCK_128: Fp8Scheme = Fp8Scheme::Blocks {
        rows: FP8_BLOCK,
        cols: FP8_BLOCK,
    };

    /// The block of a `[rows, cols]` matrix: weight rows and columns per scale.
    pub fn block(self, cols: usize) -> [usize; 2] {
        match self {
            Fp8Scheme::Blocks { rows, cols } => [rows, cols],
            Fp8Scheme::PerChannel => [1, cols.max(1)],
        }
    }

    /// Scales of a `[rows, cols]` matrix.
    pub fn scale_count(self, rows: usize, cols: usize) -> usize {
        let [br, bc] = self.block(cols);
        rows.div_ceil(br) * cols.div_ceil(bc)
    }

    /// Bytes of a `[rows, cols]` matrix in this scheme: one byte per weight and an f32 per scale.
    pub fn matrix_bytes(self, rows: usize, cols: usize) -> u64 {
        (rows * cols + 4 * self.scale_count(rows, cols)) as u64
    }

    pub fn describe(self) -> String {
        match self {
            Fp8Scheme::Blocks { rows, cols } => format!("fp8 e4m3, {rows}x{cols} blocks"),
            Fp8Scheme::PerChannel => "fp8 e4m3, per channel".to_string(),
        }
    }
}

/// An FP8 checkpoint's `quantization_config`, as far as loading needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Config {
    pub scheme: Fp8Scheme,
    /// The suffix of a weight's name that names its scales: `_scale_inv` or `_scale`.
    scale_suffix: &'static str,
    /// Modules the config keeps unquantized (name prefixes or fragments): an FP8 tensor among them is an error.
    unconverted: Vec<String>,
}

impl Fp8Config {
    /// The FP8 configuration of a config.json (its top level, where multimodal wrappers keep it too), None when the
    /// checkpoint is not quantized. A quantization ferry cannot read is an error naming the setting.
    pub fn from_config(config: &Value) -> Result<Option<Self>> {
        let Some(q) = config.get("quantization_config") else {
            return Ok(None);
        };
        let field = |name: &str| q.get(name).and_then(Value::as_str).unwrap_or_default();
        let names = |name: &str| -> Vec<String> {
            q.get(name)
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
                .unwrap_or_default()
        };
        let bad = |what: String| Err(Error::Config(format!("quantization_config: {what}")));
        match field("quant_method") {
            "fp8" => {
                if !matches!(field("fmt"), "" | "e4m3") {
                    return bad(format!("fmt {:?} (only e4m3 is supported)", field("fmt")));
                }
                if !matches!(field("activation_scheme"), "" | "dynamic") {
                    return bad(format!(
                        "activation_scheme {:?} (only dynamic is supported)",
                        field("activation_scheme")
                    ));
                }
                let block: Vec<usize> = q
                    .get("weight_block_size")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(|v| v.as_u64().map(|v| v as usize)).collect())
                    .unwrap_or_default();
                let &[rows, cols] = block.as_slice() else {
                    return bad(
                        "weight_block_size must be two positive integers (per-tensor FP8 is not supported)".into(),
                    );
                };
                if rows == 0 || cols == 0 {
                    return bad(format!("weight_block_size {block:?}"));
                }
                Ok(Some(Fp8Config {
                    scheme: Fp8Scheme::Blocks { rows, cols },
                    scale_suffix: "_scale_inv",
                    unconverted: names("modules_to_not_convert"),
                }))
            }
            "compressed-tensors" => Self::compressed_tensors(q).map(Some),
            // gpt-oss's MXFP4 experts: not FP8, and read by their family (model/gpt_oss.rs).
            "mxfp4" => Ok(None),
            other => bad(format!("quant_method {other:?} (supported: fp8, compressed-tensors)")),
        }
    }

    /// compressed-tensors' float-quantized layout: every config group must quantize weights to 8-bit floats,
    /// per channel or per block, with activations dynamic or not quantized.
    fn compressed_tensors(q: &Value) -> Result<Self> {
        let bad = |what: String| {
            Err(Error::Config(format!(
                "quantization_config (compressed-tensors): {what}"
            )))
        };
        let format = q.get("format").and_then(Value::as_str).unwrap_or_default();
        if format != "float-quantized" {
            return bad(format!("format {format:?} (only float-quantized is supported)"));
        }
        let groups = q.get("config_groups").and_then(Value::as_object);
        let mut scheme = None;
        for (name, group) in groups.into_iter().flatten() {
            let weights = &group["weights"];
            if weights["num_bits"].as_u64() != Some(8) || weights["type"].as_str() != Some("float") {
                return bad(format!(
                    "config_groups.{name}.weights: only 8-bit float weights are supported"
                ));
            }
            let group_scheme = match weights["strategy"].as_str() {
                Some("channel") => Fp8Scheme::PerChannel,
                Some("block") => match weights["block_structure"].as_array().map(Vec::as_slice) {
                    Some([r, c]) if r.as_u64().unwrap_or(0) > 0 && c.as_u64().unwrap_or(0) > 0 => Fp8Scheme::Blocks {
                        rows: r.as_u64().unwrap_or(0) as usize,
                        cols: c.as_u64().unwrap_or(0) as usize,
                    },
                    _ => return bad(format!("config_groups.{name}.weights.block_structure")),
                },
                other => {
                    return bad(format!(
                        "config_groups.{name}.weights.strategy {other:?} (supported: channel, block)"
                    ))
                }
            };
            let activations = &group["input_activations"];
            if !activations.is_null() && activations["dynamic"].as_bool() != Some(true) {
                return bad(format!(
                    "config_groups.{name}.input_activations: static activation scales are not supported"
                ));
            }
            if scheme.is_some_and(|s| s != group_scheme) {
                return bad("config groups with different weight strategies".into());
            }
            scheme = Some(group_scheme);
        }
        let Some(scheme) = scheme else {
            return bad("no config_groups".into());
        };
        let unconverted = q
            .get("ignore")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
            .unwrap_or_default();
        Ok(Fp8Config {
            scheme,
            scale_suffix: "_scale",
            unconverted,
        })
    }

    /// The name of the scales of the FP8 tensor `name`.
    pub fn scale_name(&self, name: &str) -> String {
        format!("{name}{}", self.scale_suffix)
    }

    /// Whether the config keeps the module of tensor `name` unquantized: a `modules_to_not_convert` entry is a
    /// module name (a prefix or a fragment of the tensor's), an `ignore` entry a module name or a `re:` pattern,
    /// matched as a regular expression against the module's name.
    pub fn keeps_unconverted(&self, name: &str) -> bool {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        self.unconverted.iter().any(|entry| match entry.strip_prefix("re:") {
            Some(pattern) => regex_lite_match(pattern, module),
            None => module == entry || module.ends_with(&format!(".{entry}")) || module.contains(&format!("{entry}.")),
        })
    }

    /// `weight` (FP8) with its scales `scales` attached, in this config's scheme.
    pub fn attach(&self, weight: TensorRef, scales: TensorRef) -> Result<TensorRef> {
        if self.keeps_unconverted(&weight.name) {
            return Err(Error::tensor(
                &weight.name,
                "stored as FP8, but the quantization_config keeps its module unquantized",
            ));
        }
        let cols = *weight.shape.last().unwrap_or(&0);
        weight.with_scales(scales.to_f32_tensor()?, self.scheme.block(cols))
    }
}

/// The subset of regular expressions compressed-tensors' `ignore` lists use: `.` any character, `.*` any run,
/// `$` the end, `^` the start, `\.` a literal dot; anything else literal. Matches anywhere unless anchored.
fn regex_lite_match(pattern: &str, text: &str) -> bool {
    fn at(p: &[char], t: &[char]) -> bool {
        match p {
            [] => true,
            ['$'] => t.is_empty(),
            ['.', '*', rest @ ..] => (0..=t.len()).any(|i| at(rest, &t[i..])),
            ['\\', c, rest @ ..] => t.first() == Some(c) && at(rest, &t[1..]),
            ['.', rest @ ..] => !t.is_empty() && at(rest, &t[1..]),
            [c, rest @ ..] => t.first() == Some(c) && at(rest, &t[1..]),
        }
    }
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    match p.split_first() {
        Some(('^', rest)) => at(rest, &t),
        _ => (0..=t.len()).any(|i| at(&p, &t[i..])),
    }
}

/// The value of an E4M3 (`float8_e4m3fn`) byte: 4 exponent bits of bias 7, 3 mantissa bits, no infinities,
/// `S.1111.111` NaN. Exact: the byte's magnitude bits placed as an f32's (a subnormal f32 for exponent 0) times
/// 2^120 rebias the exponent.
pub fn fp8_e4m3_to_f32(byte: u8) -> f32 {
    let magnitude = byte & 0x7f;
    let value = if magnitude == 0x7f {
        f32::NAN
    } else {
        f32::from_bits(u32::from(magnitude) << 20) * f32::from_bits((120 + 127) << 23)
    };
    if byte & 0x80 != 0 {
        -value
    } else {
        value
    }
}

/// The nearest E4M3 byte to `x` (ties to even), saturating at ±448; NaN stays NaN.
pub fn f32_to_fp8_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs().min(FP8_E4M3_MAX);
    let magnitude = if a < power_of_two(-6) {
        // Subnormals are multiples of 2^-9; 8 × 2^-9 is the smallest normal, code 8.
        round_ties_even_small(a * 512.0)
    } else {
        let exponent = (a.to_bits() >> 23) as i32 - 127;
        // Eight steps per binade; a mantissa rounding up to 16 carries into the next exponent by itself.
        let steps = round_ties_even_small(a * power_of_two(3 - exponent));
        (((exponent + 7) as u32) << 3) + steps - 8
    };
    sign | magnitude as u8
}

/// 2^`exponent`, exactly, for a normal f32's exponents (-126 to 127).
fn power_of_two(exponent: i32) -> f32 {
    f32::from_bits(((127 + exponent) as u32) << 23)
}

/// `x` rounded to the nearest integer, ties to even, for 0 <= x < 2^22: adding 2^23 leaves that integer in the
/// sum's mantissa (the addition rounds so, and 2^23..2^24 has unit steps). A conversion runs it per weight: the
/// library rounding is a call.
fn round_ties_even_small(x: f32) -> u32 {
    const TWO_TO_23: f32 = 8_388_608.0;
    (x + TWO_TO_23).to_bits() - TWO_TO_23.to_bits()
}

/// `weight` (a `[rows, cols]` matrix, or `[n, rows, cols]` of them) quantized to FP8 in `scheme`: each block's
/// scale is its largest magnitude / 448 (1 for an all-zero block), each weight the nearest E4M3 value of
/// weight / scale. How `--expert-dtype fp8` makes a checkpoint's experts FP8.
pub fn quantize_fp8(weight: &TensorRef, scheme: Fp8Scheme) -> Result<TensorRef> {
    use rayon::prelude::*;
    let layout = Fp8Layout::of(&weight.name, &weight.shape, scheme)?;
    let Fp8Layout {
        matrices,
        rows,
        cols,
        block: [br, bc],
        ..
    } = layout;
    // Widened a row of blocks at a time in each task where the dtype allows (no f32 copy of the whole tensor).
    let widened_whole = match weight.dtype {
        DType::BF16 | DType::F16 | DType::F32 => None,
        _ => Some(weight.to_f32_vec()),
    };
    let (scale_rows, scale_cols) = (rows.div_ceil(br), cols.div_ceil(bc));
    // One task per row of blocks: its scales, then its bytes.
    let per_block_row: Vec<(Vec<f32>, Vec<u8>)> = (0..matrices * scale_rows)
        .into_par_iter()
        .map(|index| {
            let (m, block_row) = (index / scale_rows, index % scale_rows);
            let row_range = block_row * br..((block_row + 1) * br).min(rows);
            let first = (m * rows + row_range.start) * cols;
            let elements = first..(m * rows + row_range.end) * cols;
            let values = match &widened_whole {
                Some(all) => all[elements].to_vec(),
                None => weight.float_range_to_f32(elements),
            };
            let top = row_range.start;
            let row = |r: usize| &values[(r - top) * cols..(r - top + 1) * cols];
            let scales: Vec<f32> = (0..scale_cols)
                .map(|c| {
                    let amax = row_range
                        .clone()
                        .flat_map(|r| row(r)[c * bc..((c + 1) * bc).min(cols)].iter())
                        .fold(0f32, |a, v| a.max(v.abs()));
                    if amax > 0.0 {
                        amax / FP8_E4M3_MAX
                    } else {
                        1.0
                    }
                })
                .collect();
            let mut bytes = Vec::with_capacity(row_range.len() * cols);
            for r in row_range {
                for (block, &scale) in row(r).chunks(bc).zip(&scales) {
                    bytes.extend(block.iter().map(|&v| f32_to_fp8_e4m3(v / scale)));
                }
            }
            (scales, bytes)
        })
        .collect();
    let (scales, bytes): (Vec<Vec<f32>>, Vec<Vec<u8>>) = per_block_row.into_iter().unzip();
    layout.tensor(&weight.name, bytes.concat(), &scales.concat())
}

/// A weight of `[rows, cols]` or `[matrices, rows, cols]` in FP8 under a scheme: its sizes, its scale blocks and
/// the shape of its scales.
pub struct Fp8Layout {
    pub matrices: usize,
    pub rows: usize,
    pub cols: usize,
    /// Weight rows and columns per scale.
    pub block: [usize; 2],
    scale_shape: Vec<usize>,
}

impl Fp8Layout {
    /// The layout of weight `name` of `shape`; an error for a shape that is not one or several matrices.
    pub fn of(name: &str, shape: &[usize], scheme: Fp8Scheme) -> Result<Self> {
        let (matrices, rows, cols) = match *shape {
            [rows, cols] => (1, rows, cols),
            [n, rows, cols] => (n, rows, cols),
            _ => return Err(Error::tensor(name, format!("cannot quantize shape {shape:?} to FP8"))),
        };
        let block = scheme.block(cols);
        let (scale_rows, scale_cols) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
        let scale_shape = match shape.len() {
            2 => vec![scale_rows, scale_cols],
            _ => vec![matrices, scale_rows, scale_cols],
        };
        Ok(Fp8Layout {
            matrices,
            rows,
            cols,
            block,
            scale_shape,
        })
    }

    /// Scales the weight has.
    pub fn scale_count(&self) -> usize {
        self.scale_shape.iter().product()
    }

    /// The FP8 tensor `name` of these E4M3 `bytes` (row-major) and `scales` (one per block, row-major).
    pub fn tensor(&self, name: &str, bytes: Vec<u8>, scales: &[f32]) -> Result<TensorRef> {
        let shape = match self.scale_shape.len() {
            2 => vec![self.rows, self.cols],
            _ => vec![self.matrices, self.rows, self.cols],
        };
        let scales = TensorRef::from_f32(&format!("{name}_scale"), self.scale_shape.clone(), scales)?;
        TensorRef::from_bytes(name, DType::F8E4M3, shape, bytes)?.with_scales(scales, self.block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_e4m3_byte_round_trips() {
        for byte in 0..=255u8 {
            let value = fp8_e4m3_to_f32(byte);
            if byte & 0x7f == 0x7f {
                assert!(value.is_nan(), "{byte:#x}");
                continue;
            }
            assert_eq!(f32_to_fp8_e4m3(value), byte, "{byte:#x} = {value}");
        }
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), f32::powi(2.0, -9));
        assert_eq!(fp8_e4m3_to_f32(0x08), f32::powi(2.0, -6));
        assert_eq!(fp8_e4m3_to_f32(0xb8), -1.0);
    }

    #[test]
    fn quantizing_rounds_to_nearest_even_and_saturates() {
        // 1.0625 lies halfway between 1 and 1.125 (mantissa 0 and 1): ties go to the even mantissa, 1.
        assert_eq!(fp8_e4m3_to_f32(f32_to_fp8_e4m3(1.0625)), 1.0);
        assert_eq!(fp8_e4m3_to_f32(f32_to_fp8_e4m3(1.1875)), 1.25);
        assert_eq!(fp8_e4m3_to_f32(f32_to_fp8_e4m3(1.2)), 1.25);
        assert_eq!(fp8_e4m3_to_f32(f32_to_fp8_e4m3(1e6)), 448.0);
        assert_eq!(fp8_e4m3_to_f32(f32_to_fp8_e4m3(-1e6)), -448.0);
        assert_eq!(fp8_e4m3_to_f32(f32_to_fp8_e4m3(15.5)), 16.0);
        assert_eq!(f32_to_fp8_e4m3(1e-4), 0);
    }

    /// Against the nearest E4M3 value found by search (ties to the even code), at every value, every midpoint
    /// between two neighbours and just either side of it, and a sweep of 2^-12 .. 2^10.
    #[test]
    fn conversion_is_the_nearest_value_ties_to_even() {
        let nearest = |x: f32| -> u8 {
            let a = x.abs().min(FP8_E4M3_MAX);
            let best = (0..=0x7eu8)
                .min_by(|&p, &q| {
                    let (dp, dq) = ((fp8_e4m3_to_f32(p) - a).abs(), (fp8_e4m3_to_f32(q) - a).abs());
                    dp.total_cmp(&dq).then((p % 2).cmp(&(q % 2)))
                })
                .unwrap();
            best | if x.is_sign_negative() { 0x80 } else { 0 }
        };
        let mut values: Vec<f32> = Vec::new();
        for code in 0..0x7eu8 {
            let (low, high) = (fp8_e4m3_to_f32(code), fp8_e4m3_to_f32(code + 1));
            let middle = (low + high) / 2.0;
            values.extend([low, middle, middle.next_down(), middle.next_up()]);
        }
        values.extend((0..2000).map(|i| 2f32.powf(-12.0 + 22.0 * i as f32 / 2000.0)));
        for x in values.iter().flat_map(|&v| [v, -v]) {
            assert_eq!(f32_to_fp8_e4m3(x), nearest(x), "{x}");
        }
    }

    #[test]
    fn quantized_blocks_dequantize_within_half_a_step() {
        let (rows, cols) = (5, 7);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.013)
            .collect();
        let weight = TensorRef::from_f32("w", vec![rows, cols], &values).unwrap();
        for scheme in [Fp8Scheme::Blocks { rows: 2, cols: 3 }, Fp8Scheme::PerChannel] {
            let q = quantize_fp8(&weight, scheme).unwrap();
            assert_eq!(q.dtype, DType::F8E4M3);
            assert_eq!(q.scales().unwrap().values.numel(), scheme.scale_count(rows, cols));
            for (got, want) in q.to_f32_vec().iter().zip(&values) {
                // 3 mantissa bits: within 2^-4 of the value, relative, or of the block's smallest step.
                assert!(
                    (got - want).abs() <= want.abs() / 16.0 + 1e-4,
                    "{scheme:?}: {got} for {want}"
                );
            }
        }
    }

    #[test]
    fn block_fp8_config_is_read() {
        let config: Value = serde_json::from_str(
            r#"{"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}}"#,
        )
        .unwrap();
        let fp8 = Fp8Config::from_config(&config).unwrap().unwrap();
        assert_eq!(fp8.scheme, Fp8Scheme::BLOCK_128);
        assert_eq!(fp8.scale_name("a.weight"), "a.weight_scale_inv");
        assert!(fp8.keeps_unconverted("lm_head.weight"));
        assert!(fp8.keeps_unconverted("model.layers.0.mlp.gate.weight"));
        assert!(!fp8.keeps_unconverted("model.layers.0.mlp.gate_proj.weight"));
        assert!(Fp8Config::from_config(&serde_json::json!({})).unwrap().is_none());
    }

    #[test]
    fn compressed_tensors_config_is_read() {
        let config = serde_json::json!({"quantization_config": {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true}}},
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*linear_attn.*"]}});
        let fp8 = Fp8Config::from_config(&config).unwrap().unwrap();
        assert_eq!(fp8.scheme, Fp8Scheme::PerChannel);
        assert_eq!(fp8.scale_name("a.weight"), "a.weight_scale");
        assert!(fp8.keeps_unconverted("model.layers.3.mlp.gate.weight"));
        assert!(fp8.keeps_unconverted("model.layers.0.linear_attn.in_proj_a.weight"));
        assert!(!fp8.keeps_unconverted("model.layers.3.mlp.gate_up_proj"));
    }

    #[test]
    fn unsupported_quantizations_name_the_setting() {
        let cases = [
            (serde_json::json!({"quant_method": "gptq"}), "quant_method \"gptq\""),
            (
                serde_json::json!({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}),
                "activation_scheme \"static\"",
            ),
            (serde_json::json!({"quant_method": "fp8"}), "weight_block_size"),
            (
                serde_json::json!({"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                        "input_activations": {"dynamic": false}}}}),
                "static activation scales",
            ),
        ];
        for (q, expected) in cases {
            let err = Fp8Config::from_config(&serde_json::json!({ "quantization_config": q })).unwrap_err();
            assert!(err.to_string().contains(expected), "{err} lacks {expected}");
        }
    }
}

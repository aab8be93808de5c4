//! gpt-oss (20b, 120b), as transformers' `GptOssForCausalLM` defines it: attention with biases and a learned
//! per-head sink logit, sliding-window (`sliding_attention`, 128 keys) and full layers alternating by
//! `layer_types`, YaRN RoPE, a router with bias (top-k of the logits, softmax over the chosen), and experts with
//! biases computing the clamped SwiGLU. The experts come fused: `experts.gate_up_proj` with gate and up
//! interleaved (output feature 2i is gate i, 2i + 1 is up i) and `experts.down_proj`, either in bf16 as
//! transformers stores them (`[E, in, out]`, transposed) or in MXFP4 as OpenAI ships them (`*_blocks`, `*_scales`,
//! `[E, out, in / 32, ...]`). Either way they are rearranged once, at load, into per-expert `[out, in]` gate, up
//! and down matrices in their stored format (de-interleaved, not read strided), so the backends' expert kernels see
//! the layout every family has.

use serde::Deserialize;

use super::config::{
    check_top_k, parse, set_layer_mixers, BaseConfig, ExpertLayout, ExpertNaming, Mixer, ModelSpec, MoeSpec,
};
use super::layers::WeightLoader;
use crate::backend::{Backend, ExpertActivation, ExpertTensors, RouterKind};
use crate::loader::TensorRef;
use crate::{Error, Result};

/// transformers' `GptOssExperts.alpha`, a constant of the architecture (not in config.json).
const SWIGLU_ALPHA: f32 = 1.702;

#[derive(Deserialize)]
struct GptOssConfig {
    #[serde(flatten)]
    base: BaseConfig,
    num_local_experts: usize,
    num_experts_per_tok: usize,
    intermediate_size: usize,
    sliding_window: usize,
    layer_types: Option<Vec<String>>,
    #[serde(default = "default_swiglu_limit")]
    swiglu_limit: f32,
    quantization_config: Option<QuantizationConfig>,
}

fn default_swiglu_limit() -> f32 {
    7.0
}

#[derive(Deserialize)]
struct QuantizationConfig {
    quant_method: String,
    /// Module name patterns (`*` matches any run of characters) left unquantized.
    #[serde(default)]
    modules_to_not_convert: Vec<String>,
}

/// Whether `name` matches `pattern`, where `*` stands for any run of characters.
fn glob_match(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, rest)) => name
            .strip_prefix(head)
            .is_some_and(|tail| (0..=tail.len()).any(|i| glob_match(rest, &tail[i..]))),
    }
}

pub fn spec(config: &serde_json::Value) -> Result<ModelSpec> {
    let c: GptOssConfig = parse(config)?;
    check_top_k(c.num_local_experts, c.num_experts_per_tok)?;
    let mut spec = c.base.spec("gpt_oss")?;
    let layers = spec.layers.len();
    let sliding = Mixer::Attention {
        window: Some(c.sliding_window),
    };
    // transformers' default: even layers banded, odd layers full.
    set_layer_mixers(
        &mut spec,
        c.layer_types.as_deref(),
        &[
            ("sliding_attention", sliding),
            ("full_attention", Mixer::FULL_ATTENTION),
        ],
        |i| match i % 2 {
            0 => sliding,
            _ => Mixer::FULL_ATTENTION,
        },
    )?;
    let mxfp4 = match &c.quantization_config {
        None => false,
        Some(q) if q.quant_method == "mxfp4" => {
            let kept: Vec<bool> = (0..layers)
                .map(|i| {
                    let module = format!("model.layers.{i}.mlp.experts");
                    q.modules_to_not_convert.iter().any(|p| glob_match(p, &module))
                })
                .collect();
            if kept.iter().any(|&k| k != kept[0]) {
                return Err(Error::Config(
                    "modules_to_not_convert keeps some layers' experts unquantized and not others".into(),
                ));
            }
            !kept[0]
        }
        Some(q) => {
            return Err(Error::Config(format!(
                "quant_method \"{}\" is not supported for gpt_oss (mxfp4)",
                q.quant_method
            )))
        }
    };
    spec.attention_sinks = true;
    spec.moe = Some(MoeSpec {
        num_experts: c.num_local_experts,
        top_k: c.num_experts_per_tok,
        intermediate: c.intermediate_size,
        // Softmax over the top-k logits is the softmax over all, renormalised over the chosen.
        router: RouterKind::SoftmaxTopK { renormalize: true },
        activation: ExpertActivation::ClampedSwiGlu {
            alpha: SWIGLU_ALPHA,
            limit: c.swiglu_limit,
        },
        shared_expert: None,
        naming: ExpertNaming {
            block: "mlp",
            router: "router",
            projections: ["gate_up_proj", "gate_up_proj", "down_proj"],
            layout: ExpertLayout::GptOss { mxfp4 },
        },
    });
    Ok(spec)
}

/// The columns `columns` of the matrix `t` (`[rows, cols]`), each made a row (`[columns, rows]`), copied in the
/// stored dtype: transformers' `[in, out]` expert weights as the `[out, in]` the backends multiply by.
fn transposed_columns(t: &TensorRef, columns: impl Iterator<Item = usize>, name: &str) -> Result<TensorRef> {
    let &[rows, cols] = t.shape.as_slice() else {
        return Err(Error::tensor(
            &t.name,
            format!("expected a matrix, found {:?}", t.shape),
        ));
    };
    let size = t.dtype.size();
    let bytes = t.bytes();
    let mut out = Vec::with_capacity(rows * cols * size);
    let mut taken = 0;
    for c in columns {
        for r in 0..rows {
            out.extend_from_slice(&bytes[(r * cols + c) * size..][..size]);
        }
        taken += 1;
    }
    TensorRef::from_bytes(name, t.dtype, vec![taken, rows], out)
}

/// The even (`offset` 0) or odd (1) values of a bias vector.
fn alternate(bias: &TensorRef, offset: usize, name: &str) -> Result<TensorRef> {
    let values: Vec<f32> = bias.to_f32_vec().into_iter().skip(offset).step_by(2).collect();
    TensorRef::from_f32(name, vec![values.len()], &values)
}

/// gpt-oss's fused expert tensors of one layer: bf16 `[E, in, out]`, or MXFP4 blocks and scales `[E, out, ..]`.
enum Fused {
    Bf16 {
        gate_up: TensorRef,
        down: TensorRef,
    },
    Mxfp4 {
        gate_up: [TensorRef; 2],
        down: [TensorRef; 2],
    },
}

/// One MoE layer's experts from gpt-oss's fused tensors under `block` (`model.layers.N.mlp`), each projection
/// copied out as its own `[out, in]` matrix in the stored format, gate and up de-interleaved.
pub(super) fn experts(
    w: &WeightLoader<impl Backend>,
    block: &str,
    moe: &MoeSpec,
    hidden: usize,
    mxfp4: bool,
) -> Result<Vec<ExpertTensors>> {
    if w.store.experts_quantized_to().is_some() {
        // Quantizing as they are read would cut FP8 blocks across the fused tensors before the rearrangement.
        return Err(Error::Config(
            "gpt_oss experts cannot be quantized to FP8 at load (--expert-dtype fp8); load them as stored".into(),
        ));
    }
    let (n, inter) = (moe.num_experts, moe.intermediate);
    let name = |part: &str| format!("{block}.experts.{part}");
    let gate_up_bias = w.tensor(&name("gate_up_proj_bias"), &[n, 2 * inter])?;
    let down_bias = w.tensor(&name("down_proj_bias"), &[n, hidden])?;
    let fused = match mxfp4 {
        true => {
            for (size, what) in [(hidden, "hidden_size"), (inter, "intermediate_size")] {
                if !size.is_multiple_of(32) {
                    return Err(Error::Config(format!(
                        "MXFP4 experts need a {what} divisible by 32, not {size}"
                    )));
                }
            }
            let packed = |proj: &str, out: usize, input: usize| -> Result<[TensorRef; 2]> {
                Ok([
                    w.tensor(&name(&format!("{proj}_blocks")), &[n, out, input / 32, 16])?,
                    w.tensor(&name(&format!("{proj}_scales")), &[n, out, input / 32])?,
                ])
            };
            Fused::Mxfp4 {
                gate_up: packed("gate_up_proj", 2 * inter, hidden)?,
                down: packed("down_proj", hidden, inter)?,
            }
        }
        false => Fused::Bf16 {
            gate_up: w.tensor(&name("gate_up_proj"), &[n, hidden, 2 * inter])?,
            down: w.tensor(&name("down_proj"), &[n, inter, hidden])?,
        },
    };
    // Output feature 2i of gate_up is gate i, 2i + 1 is up i.
    let gate_rows = || (0..inter).map(|i| 2 * i);
    let up_rows = || (0..inter).map(|i| 2 * i + 1);
    (0..n)
        .map(|e| {
            let label = |proj: &str| format!("{block}.experts.{e}.{proj}");
            let (gate, up, down) = match &fused {
                Fused::Mxfp4 { gate_up, down } => {
                    let [blocks, scales] = [gate_up[0].select(e)?, gate_up[1].select(e)?];
                    let down =
                        TensorRef::mxfp4(&label("down_proj"), &down[0].select(e)?, &down[1].select(e)?, 0..hidden)?;
                    (
                        TensorRef::mxfp4(&label("gate_proj"), &blocks, &scales, gate_rows())?,
                        TensorRef::mxfp4(&label("up_proj"), &blocks, &scales, up_rows())?,
                        down,
                    )
                }
                Fused::Bf16 { gate_up, down } => {
                    let gate_up = gate_up.select(e)?;
                    (
                        transposed_columns(&gate_up, gate_rows(), &label("gate_proj"))?,
                        transposed_columns(&gate_up, up_rows(), &label("up_proj"))?,
                        transposed_columns(&down.select(e)?, 0..hidden, &label("down_proj"))?,
                    )
                }
            };
            let bias = gate_up_bias.select(e)?;
            Ok(ExpertTensors {
                gate,
                up,
                down,
                gate_bias: Some(alternate(&bias, 0, &label("gate_proj.bias"))?),
                up_bias: Some(alternate(&bias, 1, &label("up_proj.bias"))?),
                down_bias: Some(down_bias.select(e)?),
            })
        })
        .collect()
}

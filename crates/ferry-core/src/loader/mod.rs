//! A Hugging Face checkpoint directory: `config.json`, safetensors weights (one file or shards with an index),
//! `tokenizer.json`, `tokenizer_config.json` (chat template, special tokens) and `generation_config.json`.

mod fp8;
mod generation;
pub mod mxfp4;
mod template_functions;
mod tokenizer;
mod weights;

use std::path::{Path, PathBuf};

pub use fp8::{f32_to_fp8_e4m3, fp8_e4m3_to_f32, quantize_fp8, Fp8Config, Fp8Scheme, FP8_BLOCK, FP8_E4M3_MAX};
pub use generation::GenerationConfig;
pub use template_functions::python_json;
pub use tokenizer::{ChatEnding, ChatMessage, ChatPrompt, Detokenizer, FunctionCall, TextDecoder, Tokenizer, ToolCall};
pub use weights::{DType, Fp8Scales, NonFinite, TensorRef, WeightStore};

use crate::{Error, Result};

/// `path`, if it is a regular file (or a symlink to one): a FIFO would block the open forever, a device would map
/// whatever it holds, and a directory would fail with a message that does not say why.
fn regular_file(path: &Path) -> Result<&Path> {
    let kind = std::fs::metadata(path).map_err(|e| Error::io(path, e))?.file_type();
    if kind.is_file() {
        Ok(path)
    } else if kind.is_dir() {
        Err(Error::file(path, "is a directory, not a file"))
    } else {
        Err(Error::file(path, "not a regular file (a FIFO, socket or device?)"))
    }
}

/// The text of `path`, a regular file (see [`regular_file`]).
fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(regular_file(path)?).map_err(|e| Error::io(path, e))
}

/// A config.json's `model_type`, the text model's configuration (`text_config` of multimodal checkpoints) and its
/// FP8 quantization, if any (read from the top level, where multimodal wrappers keep it).
fn read_config(path: &Path) -> Result<(String, serde_json::Value, Option<Fp8Config>)> {
    let text = read_text(path)?;
    let config: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::file(path, format!("invalid JSON: {e}")))?;
    let model_type = config
        .get("model_type")
        .and_then(|v| v.as_str())
        .ok_or_else(|| Error::file(path, "no \"model_type\" string"))?
        .to_string();
    let fp8 = Fp8Config::from_config(&config)?;
    let Some(mut text_config) = config.get("text_config").cloned() else {
        return Ok((model_type, config, fp8));
    };
    // Multimodal wrappers say whether the output head is tied at the top level; the text config may not.
    if let (Some(tie), Some(text)) = (config.get("tie_word_embeddings"), text_config.as_object_mut()) {
        text.entry("tie_word_embeddings").or_insert(tie.clone());
    }
    Ok((model_type, text_config, fp8))
}

/// How a checkpoint's weights are stored: the dtype of its unquantized weights (the embedding table's) and, when
/// its routed experts are FP8, their scheme. What [`crate::model::ModelInfo`] counts bytes by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightFormat {
    pub dtype: DType,
    pub experts_fp8: Option<Fp8Scheme>,
    /// The FP8 scheme of the dense linear weights (attention projections, dense MLPs, shared experts) when every
    /// one of them is FP8, as in the hub's FP8 checkpoints.
    pub dense_fp8: Option<Fp8Scheme>,
}

impl WeightFormat {
    /// `bf16`, or e.g. `bf16, experts fp8 e4m3, 128x128 blocks` or `bf16, dense linears and experts fp8 e4m3,
    /// 128x128 blocks`.
    pub fn describe(&self) -> String {
        let dtype = self.dtype.name();
        match (self.dense_fp8, self.experts_fp8) {
            (None, None) => dtype.to_string(),
            (None, Some(experts)) => format!("{dtype}, experts {}", experts.describe()),
            (Some(dense), None) => format!("{dtype}, dense linears {}", dense.describe()),
            (Some(dense), Some(experts)) if dense == experts => {
                format!("{dtype}, dense linears and experts {}", dense.describe())
            }
            (Some(dense), Some(experts)) => {
                format!(
                    "{dtype}, dense linears {}, experts {}",
                    dense.describe(),
                    experts.describe()
                )
            }
        }
    }
}

/// An opened checkpoint. Weights are mapped, not read; the tokenizer is optional (`--prompt-ids` needs none).
pub struct Checkpoint {
    pub dir: PathBuf,
    pub model_type: String,
    /// The text model's configuration (`text_config` of multimodal checkpoints, else the whole config.json).
    pub config: serde_json::Value,
    pub generation: GenerationConfig,
    pub tokenizer: Option<Tokenizer>,
    pub weights: WeightStore,
    /// The checkpoint's FP8 quantization (its FP8 tensors carry their scales).
    pub fp8: Option<Fp8Config>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::file(dir, "checkpoint directory not found"));
        }
        let (model_type, config, fp8) = read_config(&dir.join("config.json"))?;
        let generation = GenerationConfig::load(dir)?;
        let tokenizer = Tokenizer::load(dir)?;
        let mut weights = WeightStore::open(dir)?;
        weights.attach_fp8_scales(fp8.as_ref())?;
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            model_type,
            config,
            generation,
            tokenizer,
            weights,
            fp8,
        })
    }

    /// A checkpoint of the model `config_path` describes (a config.json) with seeded random weights and no files:
    /// full-size benchmarks without a download.
    /// With a quantization_config, it is laid out as the hub's FP8 checkpoints are: the routed experts and the
    /// dense linear weights the config does not keep unquantized are FP8 in its scheme, the rest bf16.
    pub fn synthetic(config_path: &Path, seed: u64) -> Result<Self> {
        let (model_type, config, fp8) = read_config(config_path)?;
        let mut weights = WeightStore::synthetic(seed);
        if let Some(fp8) = &fp8 {
            weights.quantize_experts(fp8.scheme);
            weights.quantize_dense_linears(fp8.clone());
        }
        Ok(Checkpoint {
            dir: config_path.to_path_buf(),
            model_type,
            config,
            generation: GenerationConfig::default(),
            tokenizer: None,
            weights,
            fp8,
        })
    }

    /// The stored dtype of the unquantized weights (the embedding table's; synthetic weights are bf16).
    pub fn weight_dtype(&self) -> DType {
        self.weights
            .find("model.embed_tokens.weight")
            .map_or(DType::BF16, |t| t.dtype)
    }

    /// How the weights are stored, as the model will hold them: the unquantized dtype, the FP8 scheme of the
    /// routed experts when the checkpoint's are FP8 or [`WeightStore::quantize_experts`] makes them so, and that
    /// of the dense linear weights when all of them are FP8.
    pub fn weight_format(&self) -> WeightFormat {
        // A checkpoint's own FP8 weights are never quantized again.
        let stored_fp8 = self.fp8.as_ref().map(|f| f.scheme);
        WeightFormat {
            dtype: self.weight_dtype(),
            experts_fp8: stored_fp8.or(self.weights.experts_quantized_to()),
            dense_fp8: stored_fp8.filter(|_| self.weights.dense_linears_are_fp8()),
        }
    }

    /// The ids that end generation: generation_config.json's, else the tokenizer's eos token.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        if !self.generation.eos_token_ids.is_empty() {
            return self.generation.eos_token_ids.clone();
        }
        self.tokenizer
            .as_ref()
            .and_then(|t| t.eos_token_id())
            .into_iter()
            .collect()
    }
}

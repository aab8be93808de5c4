//! A Hugging Face checkpoint directory: `config.json`, safetensors weights (one file or shards with an index),
//! `tokenizer.json`, `tokenizer_config.json` (chat template, special tokens) and `generation_config.json`.

mod generation;
pub mod mxfp4;
mod tokenizer;
mod weights;

use std::path::{Path, PathBuf};

pub use generation::GenerationConfig;
pub use tokenizer::{ChatMessage, ChatPrompt, Detokenizer, FunctionCall, TextDecoder, Tokenizer, ToolCall};
pub use weights::{DType, NonFinite, TensorRef, WeightStore};

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

/// A config.json's `model_type` and the text model's configuration (`text_config` of multimodal checkpoints).
fn read_config(path: &Path) -> Result<(String, serde_json::Value)> {
    let text = read_text(path)?;
    let config: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::file(path, format!("invalid JSON: {e}")))?;
    let model_type = config
        .get("model_type")
        .and_then(|v| v.as_str())
        .ok_or_else(|| Error::file(path, "no \"model_type\" string"))?
        .to_string();
    let Some(mut text_config) = config.get("text_config").cloned() else {
        return Ok((model_type, config));
    };
    // Multimodal wrappers say whether the output head is tied at the top level; the text config may not.
    if let (Some(tie), Some(text)) = (config.get("tie_word_embeddings"), text_config.as_object_mut()) {
        text.entry("tie_word_embeddings").or_insert(tie.clone());
    }
    Ok((model_type, text_config))
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
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::file(dir, "checkpoint directory not found"));
        }
        let (model_type, config) = read_config(&dir.join("config.json"))?;
        let generation = GenerationConfig::load(dir)?;
        let tokenizer = Tokenizer::load(dir)?;
        let weights = WeightStore::open(dir)?;
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            model_type,
            config,
            generation,
            tokenizer,
            weights,
        })
    }

    /// A checkpoint of the model `config_path` describes (a config.json) with seeded random weights and no files:
    /// full-size benchmarks without a download.
    pub fn synthetic(config_path: &Path, seed: u64) -> Result<Self> {
        let (model_type, config) = read_config(config_path)?;
        Ok(Checkpoint {
            dir: config_path.to_path_buf(),
            model_type,
            config,
            generation: GenerationConfig::default(),
            tokenizer: None,
            weights: WeightStore::synthetic(seed),
        })
    }

    /// The stored dtype of the weights (the embedding table's; synthetic weights are bf16).
    pub fn weight_dtype(&self) -> DType {
        self.weights
            .find("model.embed_tokens.weight")
            .map_or(DType::BF16, |t| t.dtype)
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

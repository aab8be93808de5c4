//! A Hugging Face checkpoint directory: `config.json`, safetensors weights (one file or shards with an index),
//! `tokenizer.json`, `tokenizer_config.json` (chat template, special tokens) and `generation_config.json`.

mod generation;
mod tokenizer;
mod weights;

use std::path::{Path, PathBuf};

pub use generation::GenerationConfig;
pub use tokenizer::{ChatMessage, Detokenizer, TextDecoder, Tokenizer};
pub use weights::{DType, TensorRef, WeightStore};

use crate::{Error, Result};

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
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
        let mut config: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::file(&config_path, format!("invalid JSON: {e}")))?;
        let model_type = config
            .get("model_type")
            .and_then(|v| v.as_str())
            .ok_or_else(|| Error::file(&config_path, "no \"model_type\" string"))?
            .to_string();
        if let Some(text_config) = config.get("text_config").cloned() {
            config = text_config;
        }
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

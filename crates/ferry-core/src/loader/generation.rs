//! `generation_config.json`: eos ids and the checkpoint's sampling defaults.

use std::path::Path;

use serde::Deserialize;

use crate::{Error, Result};

#[derive(Clone, Debug, Default)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Deserialize)]
struct RawGenerationConfig {
    eos_token_id: Option<OneOrMany>,
    bos_token_id: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
}

impl GenerationConfig {
    /// Reads `generation_config.json` if the checkpoint has one; a missing file means no defaults.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return Ok(Self::default());
        }
        let text = super::read_text(&path)?;
        let raw: RawGenerationConfig =
            serde_json::from_str(&text).map_err(|e| Error::file(&path, format!("invalid generation config: {e}")))?;
        Ok(GenerationConfig {
            eos_token_ids: match raw.eos_token_id {
                None => vec![],
                Some(OneOrMany::One(id)) => vec![id],
                Some(OneOrMany::Many(ids)) => ids,
            },
            bos_token_id: raw.bos_token_id,
            temperature: raw.temperature,
            top_p: raw.top_p,
            top_k: raw.top_k,
        })
    }
}

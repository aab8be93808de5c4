//! Model families, one file each, mapping their config.json onto a [`ModelSpec`]; the decoder they share is
//! [`Model`], built from [`layers`] and written once against [`Backend`].

pub mod config;
pub mod info;
pub mod layers;
mod mixtral;
mod olmoe;
mod qwen2_moe;
mod qwen3_moe;

pub use config::{FfnKind, ModelSpec, MoeSpec, QkNorm};
pub use info::ModelInfo;

use crate::backend::{Backend, Rope, SeqSlice};
use crate::kv::KvSpec;
use crate::loader::Checkpoint;
use crate::{Error, Result};
use layers::{Attention, Ffn, WeightLoader};

/// The `model_type`s ferry runs.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"];

/// The spec of a checkpoint's model, from its `model_type` and config.
pub fn spec_for(model_type: &str, config: &serde_json::Value) -> Result<ModelSpec> {
    match model_type {
        "qwen3_moe" => qwen3_moe::spec(config),
        "qwen2_moe" => qwen2_moe::spec(config),
        "mixtral" => mixtral::spec(config),
        "olmoe" => olmoe::spec(config),
        other => Err(Error::Config(format!(
            "unsupported model_type \"{other}\"; supported: {}",
            SUPPORTED_MODEL_TYPES.join(", ")
        ))),
    }
}

struct DecoderLayer<B: Backend> {
    input_norm: B::Weight,
    attention: Attention<B>,
    post_attention_norm: B::Weight,
    ffn: Ffn<B>,
}

/// A decoder-only MoE transformer on backend `B`.
pub struct Model<B: Backend> {
    pub spec: ModelSpec,
    embed_tokens: B::Weight,
    layers: Vec<DecoderLayer<B>>,
    norm: B::Weight,
    /// None when the output head is tied to the embedding table.
    lm_head: Option<B::Weight>,
    rope: B::RopeTable,
}

impl<B: Backend> Model<B> {
    pub fn load(backend: &B, checkpoint: &Checkpoint) -> Result<Self> {
        let spec = spec_for(&checkpoint.model_type, &checkpoint.config)?;
        let w = WeightLoader {
            backend,
            store: &checkpoint.weights,
        };
        let h = spec.hidden_size;
        let layers = spec
            .ffn
            .iter()
            .enumerate()
            .map(|(i, &kind)| {
                let prefix = format!("model.layers.{i}");
                Ok(DecoderLayer {
                    input_norm: w.load(&format!("{prefix}.input_layernorm.weight"), &[h])?,
                    attention: Attention::load(&w, &format!("{prefix}.self_attn"), &spec)?,
                    post_attention_norm: w.load(&format!("{prefix}.post_attention_layernorm.weight"), &[h])?,
                    ffn: Ffn::load(&w, &prefix, kind, &spec)?,
                })
            })
            .collect::<Result<_>>()?;
        let lm_head = match spec.tie_word_embeddings {
            true => None,
            false => Some(w.load("lm_head.weight", &[spec.vocab_size, h])?),
        };
        Ok(Model {
            embed_tokens: w.load("model.embed_tokens.weight", &[spec.vocab_size, h])?,
            layers,
            norm: w.load("model.norm.weight", &[h])?,
            lm_head,
            rope: backend.rope_table(&Rope::new(spec.rope_theta, spec.head_dim, spec.rotary_dim))?,
            spec,
        })
    }

    /// The KV cache shape for `capacity_tokens` tokens across all sequences.
    pub fn kv_spec(&self, capacity_tokens: usize) -> KvSpec {
        KvSpec {
            num_layers: self.layers.len(),
            num_kv_heads: self.spec.num_kv_heads,
            head_dim: self.spec.head_dim,
            capacity_tokens,
        }
    }

    /// Runs the batch (`ids` are the rows of `batch`'s slices, in order), appending to each sequence's KV cache,
    /// and returns the logits `[slices, vocab]` of each slice's last token.
    pub fn forward(&self, be: &B, ids: &[u32], batch: &[SeqSlice], kv: &mut B::Kv) -> Result<B::Tensor> {
        let rows: usize = batch.iter().map(|s| s.len).sum();
        if rows != ids.len() || batch.iter().any(|s| s.len == 0) {
            return Err(Error::Request(format!(
                "batch of {} tokens does not match its {} sequence slices",
                ids.len(),
                batch.len()
            )));
        }
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.spec.vocab_size) {
            return Err(Error::Request(format!(
                "token id {bad} is outside the vocabulary (size {})",
                self.spec.vocab_size
            )));
        }
        let prepared = be.prepare_batch(kv, batch)?;
        let eps = self.spec.rms_norm_eps;
        let h = self.spec.hidden_size;
        let mut x = be.embed(&self.embed_tokens, ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let normed = be.rms_norm(&x, &layer.input_norm, h, eps)?;
            let attn = layer.attention.forward(be, &normed, &self.rope, kv, i, &prepared)?;
            be.add_assign(&mut x, &attn)?;
            let normed = be.rms_norm(&x, &layer.post_attention_norm, h, eps)?;
            be.add_assign(&mut x, &layer.ffn.forward(be, &normed)?)?;
        }
        let last_rows: Vec<usize> = batch
            .iter()
            .scan(0, |end, s| {
                *end += s.len;
                Some(*end - 1)
            })
            .collect();
        let last = be.rms_norm(&be.select_rows(&x, &last_rows)?, &self.norm, h, eps)?;
        be.linear(&last, self.lm_head.as_ref().unwrap_or(&self.embed_tokens), None)
    }
}

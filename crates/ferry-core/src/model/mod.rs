//! Model families, one file each, mapping their config.json onto a [`ModelSpec`] (the model's layers one by one:
//! each one's token mixer with its attention window, and its feed-forward block; the router kind and expert
//! activation of its MoE block); the decoder they share is [`Model`], built from [`layers`] and written once
//! against [`Backend`].

pub mod config;
mod deepseek_v3;
mod glm4_moe;
mod gpt_oss;
pub mod info;
pub mod layers;
mod mixtral;
mod mla;
mod olmoe;
mod qwen2_moe;
mod qwen3_5_moe;
mod qwen3_moe;
mod qwen3_next;
pub mod rope;

pub use config::{FfnKind, GatedDeltaNetSpec, LayerSpec, Mixer, MlaSpec, ModelSpec, MoeSpec, QkNorm};
pub use info::ModelInfo;

use crate::backend::{Backend, ResidualNorm, SeqSlice};
use crate::kv::{KvLayerSpec, KvSpec, RecurrentSpec};
use crate::loader::{Checkpoint, WeightStore};
use crate::moe::RoutingTap;
use crate::{Error, Result};
use layers::{Attention, Ffn, GatedDeltaNet, WeightLoader};
use mla::LatentAttention;

/// The `model_type`s ferry runs.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &[
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "qwen3_next",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "deepseek_v3",
    "kimi_k2",
    "glm4_moe",
    "gpt_oss",
];

/// The spec of a checkpoint's model, from its `model_type` and config.
pub fn spec_for(model_type: &str, config: &serde_json::Value) -> Result<ModelSpec> {
    match model_type {
        "qwen3_moe" => qwen3_moe::spec(config),
        "qwen2_moe" => qwen2_moe::spec(config),
        "mixtral" => mixtral::spec(config),
        "olmoe" => olmoe::spec(config),
        "qwen3_next" => qwen3_next::spec(config),
        "qwen3_5_moe" | "qwen3_5_moe_text" => qwen3_5_moe::spec(config),
        "deepseek_v3" => deepseek_v3::spec(config, "deepseek_v3"),
        "kimi_k2" => deepseek_v3::spec(config, "kimi_k2"),
        "glm4_moe" => glm4_moe::spec(config),
        "gpt_oss" => gpt_oss::spec(config),
        other => Err(Error::Config(format!(
            "unsupported model_type \"{other}\"; supported: {}",
            SUPPORTED_MODEL_TYPES.join(", ")
        ))),
    }
}

/// A layer's token mixer, with its slot in what sequences keep: its KV layer, or its recurrent-state layer.
enum TokenMixer<B: Backend> {
    Attention { attention: Attention<B>, kv_layer: usize },
    LatentAttention { mla: LatentAttention<B>, kv_layer: usize },
    GatedDeltaNet { gdn: GatedDeltaNet<B>, state_layer: usize },
}

struct DecoderLayer<B: Backend> {
    input_norm: B::Weight,
    mixer: TokenMixer<B>,
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
        Self::load_with_progress(backend, checkpoint, &mut |_, _| {})
    }

    /// [`load`](Self::load), calling `progress(layers_loaded, layers)` as each layer is handed to the backend
    /// (which is where a large checkpoint spends its load time: uploads, pinned host memory, synthetic weights).
    /// Weights that are NaN or infinite are counted first and logged as a warning, tensor by tensor.
    pub fn load_with_progress(
        backend: &B,
        checkpoint: &Checkpoint,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let spec = spec_for(&checkpoint.model_type, &checkpoint.config)?;
        for bad in checkpoint.weights.non_finite() {
            tracing::warn!(
                "{} holds {} NaN and {} infinite values (`ferry info --check` lists them all)",
                bad.tensor,
                bad.nan,
                bad.inf
            );
        }
        for (part, count) in checkpoint.weights.outside_text_model(spec.layers.len()) {
            let what = match part.as_str() {
                "model.visual." => "the vision tower",
                "mtp." => "the multi-token-prediction head",
                p if p.contains(".layers.") => "a multi-token-prediction layer, past the decoder's",
                _ => "not part of the text model",
            };
            tracing::info!("not loading {count} tensors under {part}: {what}, which text generation does not use");
        }
        Self::build(backend, spec, &checkpoint.weights, progress)
    }

    /// The model `spec` describes, with its weights from `store`.
    pub fn from_spec(backend: &B, spec: ModelSpec, store: &WeightStore) -> Result<Self> {
        Self::build(backend, spec, store, &mut |_, _| {})
    }

    fn build(
        backend: &B,
        spec: ModelSpec,
        store: &WeightStore,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let started = std::time::Instant::now();
        let w = WeightLoader::new(backend, store);
        let h = spec.hidden_size;
        let offset = spec.norm_weight_offset;
        let (mut kv_layers, mut state_layers) = (0, 0);
        let mut layers = Vec::with_capacity(spec.layers.len());
        for (i, layer) in spec.layers.iter().enumerate() {
            let prefix = format!("model.layers.{i}");
            let mixer = match (layer.mixer, &spec.gated_delta_net, &spec.mla) {
                (Mixer::Attention { window: None }, _, Some(mla)) => {
                    kv_layers += 1;
                    TokenMixer::LatentAttention {
                        mla: LatentAttention::load(&w, &format!("{prefix}.self_attn"), &spec, mla)?,
                        kv_layer: kv_layers - 1,
                    }
                }
                (Mixer::Attention { window: Some(_) }, _, Some(_)) => {
                    return Err(Error::Config(
                        "latent attention within a window is not supported".into(),
                    ))
                }
                (Mixer::Attention { window }, _, None) => {
                    kv_layers += 1;
                    TokenMixer::Attention {
                        attention: Attention::load(&w, &format!("{prefix}.self_attn"), &spec, window)?,
                        kv_layer: kv_layers - 1,
                    }
                }
                (Mixer::GatedDeltaNet, Some(g), _) => {
                    state_layers += 1;
                    TokenMixer::GatedDeltaNet {
                        gdn: GatedDeltaNet::load(&w, &format!("{prefix}.linear_attn"), &spec, g)?,
                        state_layer: state_layers - 1,
                    }
                }
                (Mixer::GatedDeltaNet, None, _) => {
                    return Err(Error::Config(
                        "a Gated DeltaNet layer in a model without its settings".into(),
                    ))
                }
            };
            layers.push(DecoderLayer {
                input_norm: w.norm(&format!("{prefix}.input_layernorm.weight"), h, offset)?,
                mixer,
                post_attention_norm: w.norm(&format!("{prefix}.post_attention_layernorm.weight"), h, offset)?,
                ffn: Ffn::load(&w, &prefix, layer.ffn, &spec)?,
            });
            progress(i + 1, spec.layers.len());
        }
        let lm_head = match spec.tie_word_embeddings {
            true => None,
            false => Some(w.load("lm_head.weight", &[spec.vocab_size, h])?),
        };
        let model = Model {
            embed_tokens: w.load("model.embed_tokens.weight", &[spec.vocab_size, h])?,
            layers,
            norm: w.norm("model.norm.weight", h, offset)?,
            lm_head,
            rope: backend.rope_table(&rope::rope_for(&spec))?,
            spec,
        };
        // Where a load's time goes: a slow one is either the store's (disk, generation, quantization) or the
        // backend's (uploads, pinned host memory, repacking).
        let (total, reading) = (started.elapsed(), w.reading_time());
        tracing::info!(
            "weights loaded in {:.1} s: {:.1} s getting them from the checkpoint (mapping, synthetic generation, \
             quantization at load), {:.1} s in the backend ({})",
            total.as_secs_f64(),
            reading.as_secs_f64(),
            total.saturating_sub(reading).as_secs_f64(),
            backend.name()
        );
        Ok(model)
    }

    /// The KV cache shape for `capacity_tokens` tokens across all sequences: keys and values for the attention
    /// layers (latent layers for MLA) and, in hybrid models, a recurrent-state slot per sequence.
    pub fn kv_spec(&self, capacity_tokens: usize) -> KvSpec {
        let attention = match &self.spec.mla {
            Some(m) => KvLayerSpec::latent(m.kv_lora_rank + m.qk_rope_head_dim),
            None => KvLayerSpec::heads(self.spec.num_kv_heads, self.spec.head_dim),
        };
        KvSpec {
            layers: vec![attention; self.spec.num_attention_layers()],
            capacity_tokens,
            recurrent: recurrent_spec(&self.spec),
        }
    }

    /// Runs the batch (`ids` are the rows of `batch`'s slices, in order), appending to each sequence's KV cache,
    /// and returns the logits `[slices, vocab]` of each slice's last token.
    pub fn forward(&self, be: &B, ids: &[u32], batch: &[SeqSlice], kv: &mut B::Kv) -> Result<B::Tensor> {
        self.forward_routed(be, ids, batch, kv, None)
    }

    /// Fails unless `ids` are the rows of `batch`'s slices, none empty, and every id is in the vocabulary.
    pub fn check_batch(&self, ids: &[u32], batch: &[SeqSlice]) -> Result<()> {
        let rows: usize = batch.iter().map(|s| s.len).sum();
        if rows != ids.len() || batch.iter().any(|s| s.len == 0) {
            return Err(Error::Shape(format!(
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
        Ok(())
    }

    /// [`forward`](Self::forward), with `tap` seeing every MoE layer's routing (to record or replay traces).
    pub fn forward_routed(
        &self,
        be: &B,
        ids: &[u32],
        batch: &[SeqSlice],
        kv: &mut B::Kv,
        mut tap: Option<&mut (dyn RoutingTap + '_)>,
    ) -> Result<B::Tensor> {
        self.check_batch(ids, batch)?;
        let prepared = be.prepare_batch(kv, batch)?;
        let eps = self.spec.rms_norm_eps;
        let h = self.spec.hidden_size;
        let mut x = be.embed(&self.embed_tokens, ids)?;
        let mut normed = match self.layers.first() {
            Some(first) => be.rms_norm(&x, &first.input_norm, h, eps)?,
            None => return Err(Error::Config("a model without layers".into())),
        };
        let mut moe_layer = 0;
        for (i, layer) in self.layers.iter().enumerate() {
            // Each block adds its output to the residual stream x and returns x normalised for what follows: the
            // post-attention norm, the next layer's input norm, or after the last layer the final norm.
            let post_attention = ResidualNorm {
                residual: &mut x,
                weight: &layer.post_attention_norm,
                eps,
            };
            normed = match &layer.mixer {
                TokenMixer::Attention { attention, kv_layer } => {
                    attention.forward(be, &normed, &self.rope, kv, *kv_layer, &prepared, post_attention)?
                }
                TokenMixer::LatentAttention { mla, kv_layer } => {
                    mla.forward(be, &normed, &self.rope, kv, *kv_layer, &prepared, post_attention)?
                }
                TokenMixer::GatedDeltaNet { gdn, state_layer } => {
                    gdn.forward(be, &normed, kv, *state_layer, &prepared, post_attention)?
                }
            };
            let into = ResidualNorm {
                residual: &mut x,
                weight: self.layers.get(i + 1).map_or(&self.norm, |next| &next.input_norm),
                eps,
            };
            normed = match &layer.ffn {
                Ffn::Dense(mlp) => {
                    if let Some(Ffn::Moe(next)) = self.layers.get(i + 1).map(|l| &l.ffn) {
                        next.guess_ahead(be, &normed, moe_layer, tap.as_deref_mut())?;
                    }
                    mlp.forward_into(be, &normed, into)?
                }
                Ffn::Moe(moe) => {
                    moe_layer += 1;
                    let next = self.layers[i + 1..].iter().find_map(|l| match &l.ffn {
                        Ffn::Moe(next) => Some(next),
                        Ffn::Dense(_) => None,
                    });
                    moe.forward(be, &normed, moe_layer - 1, tap.as_deref_mut(), next, into)?
                }
            };
        }
        // normed holds every row after the final norm (a row-wise op, so normalising all rows and then selecting
        // equals selecting, then normalising). A batch of one row per slice (decode) needs no selection (nor its
        // upload, which a captured step cannot hold).
        let last = match batch.iter().all(|s| s.len == 1) {
            true => normed,
            false => {
                let rows: Vec<usize> = batch
                    .iter()
                    .scan(0, |end, s| {
                        *end += s.len;
                        Some(*end - 1)
                    })
                    .collect();
                be.select_rows(&normed, &rows)?
            }
        };
        be.linear(&last, self.lm_head.as_ref().unwrap_or(&self.embed_tokens), None)
    }
}

/// Each sequence's recurrent state in a hybrid model; None for models without Gated DeltaNet layers.
pub fn recurrent_spec(spec: &ModelSpec) -> Option<RecurrentSpec> {
    spec.gated_delta_net.as_ref().map(|g| RecurrentSpec {
        num_layers: spec.layers.len() - spec.num_attention_layers(),
        conv_channels: g.conv_dim(),
        conv_kernel: g.conv_kernel,
        num_heads: g.num_v_heads,
        k_head_dim: g.k_head_dim,
        v_head_dim: g.v_head_dim,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{ExpertActivation, RouterKind};
    use crate::kv::KvCache;

    /// A three-layer spec with what no shipped family has yet: a different attention window per layer (2, full,
    /// 3), a dense layer between MoE layers, DeepSeek-V3's grouped sigmoid router and gpt-oss's clamped SwiGLU.
    fn tiny_spec(windows: [Option<usize>; 3]) -> ModelSpec {
        let ffn = [FfnKind::Moe, FfnKind::Dense { intermediate: 24 }, FfnKind::Moe];
        ModelSpec {
            model_type: "tiny",
            vocab_size: 32,
            hidden_size: 16,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            rms_norm_eps: 1e-6,
            rope_theta: 1e4,
            rope_scaling: None,
            rotary_dim: 8,
            max_position_embeddings: 64,
            qk_norm: QkNorm::PerHead,
            attention_output_gate: false,
            attention_sinks: false,
            norm_weight_offset: false,
            tie_word_embeddings: false,
            layers: windows
                .iter()
                .zip(ffn)
                .map(|(&window, ffn)| LayerSpec {
                    mixer: Mixer::Attention { window },
                    ffn,
                })
                .collect(),
            gated_delta_net: None,
            moe: Some(MoeSpec {
                num_experts: 8,
                top_k: 2,
                intermediate: 12,
                router: RouterKind::SigmoidGroupedTopK {
                    n_group: 4,
                    topk_group: 2,
                    renormalize: true,
                    scaling: 2.5,
                },
                activation: ExpertActivation::ClampedSwiGlu {
                    alpha: 1.702,
                    limit: 7.0,
                },
                shared_expert: None,
                naming: config::STANDARD_EXPERTS,
            }),
            mla: None,
        }
    }

    /// The last token's logits after a prefill of `ids[..split]` and a second step of the rest.
    fn logits(model: &Model<CpuBackend>, ids: &[u32], split: usize) -> Vec<f32> {
        let be = CpuBackend;
        let mut kv = be.new_kv(model.kv_spec(64)).unwrap();
        let seq = kv.alloc_seq();
        let mut last = Vec::new();
        for (start, part) in [(0, &ids[..split]), (split, &ids[split..])] {
            let slice = SeqSlice {
                seq,
                start_pos: start,
                len: part.len(),
            };
            last = be
                .to_host(&model.forward(&be, part, &[slice], &mut kv).unwrap())
                .unwrap();
        }
        last
    }

    #[test]
    fn a_spec_of_per_layer_windows_grouped_router_and_clamped_experts_runs_on_the_cpu() {
        let store = WeightStore::synthetic(3);
        let model = Model::from_spec(&CpuBackend, tiny_spec([Some(2), None, Some(3)]), &store).unwrap();
        assert_eq!(model.kv_spec(64).layers.len(), 3);
        let ids = [5, 17, 2, 30, 9, 9, 1];
        let prefilled = logits(&model, &ids, 6);
        let stepped = logits(&model, &ids, 3);
        let err = prefilled
            .iter()
            .zip(&stepped)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err < 1e-4, "a prefill and two steps differ by {err}");
        let full = Model::from_spec(&CpuBackend, tiny_spec([None; 3]), &store).unwrap();
        let err = logits(&full, &ids, 6)
            .iter()
            .zip(&prefilled)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err > 1e-3, "the windows change what the last token sees");
    }
}

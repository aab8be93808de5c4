//! What a user needs to size a GPU cache for a model: parameters total and active per token, bytes per expert,
//! the expert bank against the dense part, KV bytes per token and, for hybrid models, recurrent-state bytes per
//! sequence.

use serde::Serialize;

use super::config::{ExpertLayout, FfnKind, Mixer, ModelSpec, QkNorm};
use super::recurrent_spec;
use crate::backend::expert_parallel::home_experts;
use crate::loader::{DType, WeightFormat};

#[derive(Clone, Debug, Serialize)]
pub struct ModelInfo {
    pub model_type: String,
    pub num_layers: usize,
    /// Layers with softmax attention (all of them, except in hybrid models).
    pub num_attention_layers: usize,
    /// Hybrid models' Gated DeltaNet layers.
    pub num_gated_delta_net_layers: usize,
    pub num_moe_layers: usize,
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub shared_expert: bool,
    pub hidden_size: usize,
    pub moe_intermediate_size: usize,
    pub vocab_size: usize,
    /// The weights' format: the unquantized dtype, and the routed experts' FP8 scheme or MXFP4 when they are.
    pub weight_dtype: String,
    pub params_total: u64,
    pub params_active_per_token: u64,
    /// Real bytes: FP8 experts count one byte per weight plus their f32 scales, MXFP4 ones 17 bytes per 32 weights.
    pub bytes_per_expert: u64,
    /// Every routed expert of every MoE layer: what lives in host RAM under offload.
    pub expert_bank_bytes: u64,
    /// Everything else (embeddings, attention, norms, routers, dense MLPs, shared experts): always on the GPU.
    /// Dense linear weights count their real bytes when they are FP8 (the GPU reads them so), the rest the
    /// unquantized dtype.
    pub dense_bytes: u64,
    /// Weight bytes one decoded token reads: the dense part less the input embedding rows it does not look up
    /// (all but one; a head tied to the embeddings reads them all), and its routed experts in real bytes.
    pub bytes_active_per_token: u64,
    /// Keys and values of one token over all attention layers, stored as bf16 (for latent attention, the latent and
    /// the shared rope key).
    pub kv_bytes_per_token_bf16: u64,
    /// A sequence's fixed-size recurrent state over all Gated DeltaNet layers (conv and delta-rule state, f32).
    pub recurrent_state_bytes_per_seq: u64,
    /// Weights of the largest dense FP8 matrix (0 when the dense linears are not FP8): a product of more rows
    /// than a GEMV takes holds it dequantized while it runs, which the GPU workspace counts.
    #[serde(skip)]
    pub largest_fp8_dense_linear: u64,
}

impl ModelInfo {
    /// What rank `rank` of an expert-parallel group of `ranks` GPUs holds: the dense part whole and its home experts
    /// of each MoE layer ([`home_experts`]), so that a memory plan for it sizes one GPU of the group. One rank: the
    /// model as it is.
    pub fn rank_share(&self, ranks: usize, rank: usize) -> ModelInfo {
        let held = home_experts(self.num_experts, ranks, rank);
        ModelInfo {
            num_experts: held,
            expert_bank_bytes: self.num_moe_layers as u64 * held as u64 * self.bytes_per_expert,
            ..self.clone()
        }
    }

    pub fn new(spec: &ModelSpec, format: WeightFormat) -> Self {
        let h = spec.hidden_size as u64;
        let (heads, kv_heads, d) = (spec.num_heads as u64, spec.num_kv_heads as u64, spec.head_dim as u64);
        let qk_norm = match spec.qk_norm {
            QkNorm::None => 0,
            QkNorm::PerHead => 2 * d,
            QkNorm::Full => (heads + kv_heads) * d,
        };
        let q_rows = if spec.attention_output_gate { 2 } else { 1 } * heads * d;
        // The dense linear weights as (output, input) features: what FP8 checkpoints store in FP8.
        let (attention_linears, attention_other, kv_per_layer): (Vec<(u64, u64)>, u64, u64) = match &spec.mla {
            Some(m) => {
                let (rank, rope) = (m.kv_lora_rank as u64, m.qk_rope_head_dim as u64);
                let q_width = heads * d;
                let mut linears = match m.q_lora_rank {
                    Some(r) => vec![(r as u64, h), (q_width, r as u64)],
                    None => vec![(q_width, h)],
                };
                linears.extend([
                    (rank + rope, h),
                    (heads * (m.qk_nope_head_dim + m.v_head_dim) as u64, rank),
                    (h, heads * m.v_head_dim as u64),
                ]);
                // The two low-rank norms.
                (linears, m.q_lora_rank.map_or(0, |r| r as u64) + rank, rank + rope)
            }
            None => (
                vec![(q_rows, h), (kv_heads * d, h), (kv_heads * d, h), (h, heads * d)],
                qk_norm,
                2 * kv_heads * d,
            ),
        };
        let gated_delta_net = spec.gated_delta_net.as_ref().map_or(0, |g| {
            let (conv, value, heads) = (g.conv_dim() as u64, g.value_dim() as u64, g.num_v_heads as u64);
            // in_proj_qkv, in_proj_z, in_proj_b + in_proj_a, conv1d, A_log + dt_bias, the gated norm, out_proj.
            h * conv
                + h * value
                + 2 * h * heads
                + conv * g.conv_kernel as u64
                + 2 * heads
                + g.v_head_dim as u64
                + value * h
        });
        let mlp = |inter: u64| [(inter, h), (inter, h), (h, inter)];
        let (num_experts, top_k, moe_inter, shared_linears, shared_gate) =
            spec.moe.as_ref().map_or((0, 0, 0, None, 0), |m| {
                let shared = m.shared_expert.map(|s| mlp(s.intermediate as u64));
                let gate = m.shared_expert.map_or(0, |s| s.sigmoid_gated as u64 * h);
                (
                    m.num_experts as u64,
                    m.top_k as u64,
                    m.intermediate as u64,
                    shared,
                    gate,
                )
            });
        let expert_params = 3 * h * moe_inter;
        let bytes = format.dtype.size() as u64;
        // Dense linear weights: their parameters and bytes, apart from the rest of the dense part.
        let (mut linear_params, mut linear_bytes, mut largest_linear) = (0u64, 0u64, 0u64);
        let mut add_linears = |linears: &[(u64, u64)]| {
            for &(rows, cols) in linears {
                linear_params += rows * cols;
                largest_linear = largest_linear.max(rows * cols);
                linear_bytes += match format.dense_fp8 {
                    Some(scheme) => scheme.matrix_bytes(rows as usize, cols as usize),
                    None => rows * cols * bytes,
                };
            }
        };
        let mut dense = spec.vocab_size as u64 * h * if spec.tie_word_embeddings { 1 } else { 2 } + h;
        let mut moe_layers = 0u64;
        for layer in &spec.layers {
            // The mixer, and the layer's two norms.
            dense += 2 * h;
            match layer.mixer {
                Mixer::Attention { .. } => {
                    dense += attention_other;
                    add_linears(&attention_linears);
                }
                Mixer::GatedDeltaNet => dense += gated_delta_net,
            }
            match layer.ffn {
                FfnKind::Dense { intermediate } => add_linears(&mlp(intermediate as u64)),
                FfnKind::Moe => {
                    moe_layers += 1;
                    dense += num_experts * h + shared_gate;
                    add_linears(shared_linears.as_ref().map_or(&[][..], |s| &s[..]));
                }
            }
        }
        let dense_bytes = dense * bytes + linear_bytes;
        let dense = dense + linear_params;
        let bank_params = moe_layers * num_experts * expert_params;
        let gpt_oss_experts = match spec.moe.as_ref().map(|m| m.naming.layout) {
            Some(ExpertLayout::GptOss { mxfp4 }) => Some(mxfp4),
            _ => None,
        };
        // What one expert's weights occupy where they are kept: FP8's byte per weight and f32 scales, MXFP4's 17
        // bytes per 32 weights (gpt-oss), or the stored dtype.
        let expert_weight_bytes = match (format.experts_fp8, gpt_oss_experts) {
            (Some(scheme), _) => {
                let (h, i) = (spec.hidden_size, moe_inter as usize);
                2 * scheme.matrix_bytes(i, h) + scheme.matrix_bytes(h, i)
            }
            (None, Some(true)) => DType::Mxfp4.bytes_for(expert_params as usize) as u64,
            (None, _) => expert_params * bytes,
        };
        // gpt-oss's experts also carry gate, up and down biases, counted in f32 as the GPU's expert blocks hold
        // them (the CPU keeps the down bias in the stored dtype: 2 bytes per feature fewer).
        let bytes_per_expert = match gpt_oss_experts {
            Some(_) => expert_weight_bytes + 4 * (2 * moe_inter + h),
            None => expert_weight_bytes,
        };
        let unread_embedding_rows = if spec.tie_word_embeddings {
            0
        } else {
            spec.vocab_size.saturating_sub(1) as u64
        };
        ModelInfo {
            model_type: spec.model_type.to_string(),
            num_layers: spec.layers.len(),
            num_attention_layers: spec.num_attention_layers(),
            num_gated_delta_net_layers: spec.layers.len() - spec.num_attention_layers(),
            num_moe_layers: moe_layers as usize,
            num_experts: num_experts as usize,
            experts_per_token: top_k as usize,
            shared_expert: shared_linears.is_some(),
            hidden_size: spec.hidden_size,
            moe_intermediate_size: moe_inter as usize,
            vocab_size: spec.vocab_size,
            weight_dtype: match (format.experts_fp8, gpt_oss_experts) {
                (None, Some(true)) => format!("{}, experts mxfp4", format.dtype.name()),
                _ => format.describe(),
            },
            params_total: dense + bank_params,
            params_active_per_token: dense + moe_layers * top_k * expert_params,
            bytes_per_expert,
            expert_bank_bytes: moe_layers * num_experts * bytes_per_expert,
            dense_bytes,
            bytes_active_per_token: dense_bytes - unread_embedding_rows * h * bytes
                + moe_layers * top_k * bytes_per_expert,
            kv_bytes_per_token_bf16: spec.num_attention_layers() as u64 * kv_per_layer * 2,
            recurrent_state_bytes_per_seq: recurrent_spec(spec).map_or(0, |r| r.bytes_per_seq() as u64),
            largest_fp8_dense_linear: if format.dense_fp8.is_some() { largest_linear } else { 0 },
        }
    }
}

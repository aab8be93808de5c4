//! What every family's config.json has in common, and the description of a model the shared decoder is built
//! from ([`ModelSpec`]). Each family file maps its own config onto a `ModelSpec`.

use serde::Deserialize;

use super::rope::{scaling_from_config, RopeParameters, YarnScaling};
use crate::backend::{ExpertActivation, RouterKind};
use crate::{Error, Result};

/// The fields of config.json shared by the decoder-only families.
#[derive(Clone, Debug, Deserialize)]
pub struct BaseConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    /// transformers < 5 writes `rope_theta`; 5 writes `rope_parameters: {rope_type, rope_theta, ...}`.
    pub rope_theta: Option<f64>,
    pub rope_parameters: Option<RopeParameters>,
    /// Qwen3-Next's 4.x-era configs put the partial rotary factor at the top level rather than in `rope_parameters`.
    pub partial_rotary_factor: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<RopeParameters>,
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

/// How q and k are normalised after their projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// RMSNorm over each head's `head_dim` features (Qwen3).
    PerHead,
    /// RMSNorm over the whole projected width, all heads together (OLMoE).
    Full,
}

/// Where a family keeps its MoE tensors, relative to `model.layers.N.`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertNaming {
    /// The MoE block: `mlp` or Mixtral's `block_sparse_moe`.
    pub block: &'static str,
    /// The router under the block: `gate`, or gpt-oss's `router` (which has a bias).
    pub router: &'static str,
    /// Per-expert gate, up and down projections: `gate_proj`/`up_proj`/`down_proj` or Mixtral's `w1`/`w3`/`w2`.
    pub projections: [&'static str; 3],
    pub layout: ExpertLayout,
}

/// How the routed experts are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertLayout {
    /// Per-expert tensors under `projections`, or transformers 5's fused `gate_up_proj` (gate rows, then up rows)
    /// and `down_proj`, `[out, in]` per expert.
    Standard,
    /// gpt-oss's fused tensors with biases, gate and up interleaved: bf16 `[E, in, out]` as transformers stores
    /// them, or (`mxfp4`) OpenAI's `*_blocks`/`*_scales` (see `gpt_oss.rs`).
    GptOss { mxfp4: bool },
}

pub const STANDARD_EXPERTS: ExpertNaming = ExpertNaming {
    block: "mlp",
    router: "gate",
    projections: ["gate_proj", "up_proj", "down_proj"],
    layout: ExpertLayout::Standard,
};

/// A decoder layer's feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    /// A dense SwiGLU MLP of this intermediate size.
    Dense { intermediate: usize },
    /// The model's MoE block ([`MoeSpec`]).
    Moe,
}

#[derive(Clone, Debug)]
pub struct MoeSpec {
    pub num_experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
    pub router: RouterKind,
    pub activation: ExpertActivation,
    pub shared_expert: Option<SharedExpert>,
    pub naming: ExpertNaming,
}

/// A MoE block's shared expert: a SwiGLU MLP every token passes through, added to the routed experts' sum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedExpert {
    pub intermediate: usize,
    /// Qwen2-MoE's kind: stored as `shared_expert` and scaled by `sigmoid(shared_expert_gate(x))`. Otherwise
    /// DeepSeek-V3's and GLM-4.5's: stored as `shared_experts` (all `n_shared_experts` as one MLP), added as is.
    pub sigmoid_gated: bool,
}

impl SharedExpert {
    /// Qwen's shared expert of `intermediate` features, scaled by its sigmoid gate.
    pub fn sigmoid_gated(intermediate: usize) -> Self {
        SharedExpert {
            intermediate,
            sigmoid_gated: true,
        }
    }
}

/// How a layer mixes information across tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mixer {
    /// Softmax attention over the KV cache; keys further back than `window` positions are masked (Mixtral's
    /// sliding window, gpt-oss's banded layers), None: full causal.
    Attention { window: Option<usize> },
    /// Gated DeltaNet: a short causal convolution and the gated delta rule over a fixed-size recurrent state.
    GatedDeltaNet,
}

impl Mixer {
    pub const FULL_ATTENTION: Mixer = Mixer::Attention { window: None };

    pub fn is_attention(&self) -> bool {
        matches!(self, Mixer::Attention { .. })
    }
}

/// One decoder layer: how it mixes tokens, then its feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    pub mixer: Mixer,
    pub ffn: FfnKind,
}

/// Where a Gated DeltaNet layer's input projections put q, k, v, the output gate z, and the per-head b and a.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnProjections {
    /// Qwen3.5: `in_proj_qkv` (all q, then all k, then all v), `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Separate,
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, each grouped by key head: per key head its q, its k, then the v
    /// and z of the value heads it serves (and for ba: their b, then their a).
    GroupedByKeyHead,
}

/// The shape of a model's Gated DeltaNet layers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatedDeltaNetSpec {
    pub num_k_heads: usize,
    /// A multiple of `num_k_heads`: each key head serves `num_v_heads / num_k_heads` consecutive value heads.
    pub num_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    pub conv_kernel: usize,
    pub projections: GdnProjections,
}

impl GatedDeltaNetSpec {
    pub fn key_dim(&self) -> usize {
        self.num_k_heads * self.k_head_dim
    }

    pub fn value_dim(&self) -> usize {
        self.num_v_heads * self.v_head_dim
    }

    /// Channels of the causal convolution: q, k and v together.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

/// Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): the shape of every attention layer of a model that has it.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaSpec {
    /// Queries through a low-rank bottleneck of this rank (`q_a_proj`, `q_a_layernorm`, `q_b_proj`); None: one
    /// `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// RoPE pairs features (2i, 2i + 1) (`rope_interleave`).
    pub rope_interleaved: bool,
    /// `1 / sqrt(qk_nope + qk_rope)`, times YaRN's softmax-scale correction.
    pub softmax_scale: f32,
}

/// Everything the shared decoder needs to know about a model.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub model_type: &'static str,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    /// YaRN's frequency blend and attention factor, when config.json asks for it.
    pub rope_scaling: Option<YarnScaling>,
    pub rotary_dim: usize,
    pub max_position_embeddings: usize,
    pub qk_norm: QkNorm,
    /// q_proj also yields a per-head output gate: the attention output is scaled by `sigmoid(gate)` before o_proj.
    pub attention_output_gate: bool,
    /// Attention has a learned per-head sink logit (`self_attn.sinks`) in its softmax's denominator (gpt-oss).
    pub attention_sinks: bool,
    /// RMSNorm weights are stored as offsets from one: the scale is `1 + w` (Qwen3-Next, Qwen3.5).
    pub norm_weight_offset: bool,
    pub tie_word_embeddings: bool,
    /// The decoder layers, in order.
    pub layers: Vec<LayerSpec>,
    /// The shape of the Gated DeltaNet layers, when there are any.
    pub gated_delta_net: Option<GatedDeltaNetSpec>,
    /// The MoE block of the layers whose `ffn` is [`FfnKind::Moe`].
    pub moe: Option<MoeSpec>,
    /// Every attention layer is multi-head latent attention of this shape; `head_dim` is then `qk_nope + qk_rope`
    /// and `rotary_dim` `qk_rope`.
    pub mla: Option<MlaSpec>,
}

impl ModelSpec {
    pub fn num_attention_layers(&self) -> usize {
        self.layers.iter().filter(|l| l.mixer.is_attention()).count()
    }

    pub fn num_moe_layers(&self) -> usize {
        self.layers.iter().filter(|l| l.ffn == FfnKind::Moe).count()
    }

    /// Gives every attention layer the same window (Mixtral's `sliding_window`).
    pub fn set_attention_window(&mut self, window: Option<usize>) {
        for layer in &mut self.layers {
            if let Mixer::Attention { window: w } = &mut layer.mixer {
                *w = window;
            }
        }
    }
}

impl BaseConfig {
    /// The spec's attention and embedding part, every layer full attention and MoE; the family fills in `moe`,
    /// `qk_norm` and what differs per layer.
    pub fn spec(&self, model_type: &'static str) -> Result<ModelSpec> {
        let num_kv_heads = self.num_key_value_heads.unwrap_or(self.num_attention_heads);
        if self.num_attention_heads == 0 || num_kv_heads == 0 || !self.num_attention_heads.is_multiple_of(num_kv_heads)
        {
            return Err(Error::Config(format!(
                "num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({num_kv_heads})",
                self.num_attention_heads
            )));
        }
        let head_dim = self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(Error::Config(format!("head_dim {head_dim} must be even and positive")));
        }
        let rope = self.rope_parameters.as_ref();
        let rope_scaling = scaling_from_config(rope, self.rope_scaling.as_ref(), self.max_position_embeddings)?;
        let rope_theta = self
            .rope_theta
            .or(rope.and_then(|r| r.rope_theta))
            .ok_or_else(|| Error::Config("no rope_theta (top level or in rope_parameters)".into()))?;
        let partial = rope
            .and_then(|r| r.partial_rotary_factor)
            .or(self.partial_rotary_factor)
            .unwrap_or(1.0);
        let rotary_dim = ((head_dim as f64 * partial) as usize) & !1;
        Ok(ModelSpec {
            model_type,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_heads: self.num_attention_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: self.rms_norm_eps as f32,
            rope_theta,
            rope_scaling,
            rotary_dim,
            max_position_embeddings: self.max_position_embeddings,
            qk_norm: QkNorm::None,
            attention_output_gate: false,
            attention_sinks: false,
            norm_weight_offset: false,
            tie_word_embeddings: self.tie_word_embeddings,
            layers: vec![
                LayerSpec {
                    mixer: Mixer::FULL_ATTENTION,
                    ffn: FfnKind::Moe,
                };
                self.num_hidden_layers
            ],
            gated_delta_net: None,
            moe: None,
            mla: None,
        })
    }
}

/// Parses a family's config struct, naming the field at fault.
pub fn parse<T: serde::de::DeserializeOwned>(config: &serde_json::Value) -> Result<T> {
    serde_json::from_value(config.clone()).map_err(|e| Error::Config(format!("config.json: {e}")))
}

/// The routed experts' settings the Qwen families name alike.
#[derive(Clone, Debug, Deserialize)]
pub struct QwenExpertsConfig {
    /// transformers 5 writes `num_local_experts`.
    #[serde(alias = "num_local_experts")]
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
}

impl QwenExpertsConfig {
    /// A softmax top-k router (`renormalize`: over the chosen), SiLU-gated experts under standard names, and a
    /// sigmoid-gated shared expert of `shared_expert_intermediate` if any.
    pub fn moe_spec(&self, renormalize: bool, shared_expert_intermediate: Option<usize>) -> Result<MoeSpec> {
        check_top_k(self.num_experts, self.num_experts_per_tok)?;
        Ok(MoeSpec {
            num_experts: self.num_experts,
            top_k: self.num_experts_per_tok,
            intermediate: self.moe_intermediate_size,
            router: RouterKind::SoftmaxTopK { renormalize },
            activation: ExpertActivation::SiluGlu,
            shared_expert: shared_expert_intermediate.map(SharedExpert::sigmoid_gated),
            naming: STANDARD_EXPERTS,
        })
    }
}

/// The MoE settings Qwen2-MoE, Qwen3-MoE and Qwen3-Next share: the experts, and which layers are dense.
#[derive(Clone, Debug, Deserialize)]
pub struct QwenMoeConfig {
    #[serde(flatten)]
    pub experts: QwenExpertsConfig,
    pub intermediate_size: usize,
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub use_sliding_window: bool,
}

fn one() -> usize {
    1
}

impl QwenMoeConfig {
    /// The spec of a Qwen MoE family: `base`'s attention, dense layers by Qwen's rule (listed in
    /// `mlp_only_layers`, or off every `decoder_sparse_step`-th layer), a softmax top-k router and standard expert
    /// names, with a sigmoid-gated shared expert of `shared_expert_intermediate` if any.
    pub fn spec(
        &self,
        base: &BaseConfig,
        model_type: &'static str,
        shared_expert_intermediate: Option<usize>,
    ) -> Result<ModelSpec> {
        if self.use_sliding_window {
            return Err(Error::Config(format!(
                "use_sliding_window is not supported for {model_type}"
            )));
        }
        let moe = self.experts.moe_spec(self.norm_topk_prob, shared_expert_intermediate)?;
        let mut spec = base.spec(model_type)?;
        for (i, layer) in spec.layers.iter_mut().enumerate() {
            let sparse = !self.mlp_only_layers.contains(&i)
                && self.decoder_sparse_step > 0
                && (i + 1) % self.decoder_sparse_step == 0;
            if !sparse {
                layer.ffn = FfnKind::Dense {
                    intermediate: self.intermediate_size,
                };
            }
        }
        spec.moe = Some(moe);
        Ok(spec)
    }
}

pub fn check_top_k(num_experts: usize, top_k: usize) -> Result<()> {
    if top_k == 0 || top_k > num_experts {
        return Err(Error::Config(format!(
            "num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({num_experts})"
        )));
    }
    Ok(())
}

/// DeepSeek-V3's MoE, as its config.json names it and GLM-4.5's does alike: the first `first_k_dense_replace` layers
/// a dense MLP of `intermediate_size`, the others routed by sigmoid scores with a correction bias among `n_group`
/// groups of experts, plus `n_shared_experts` shared experts (one MLP that many times as wide) added as is. A family
/// whose configs may leave some of these out fills in its own defaults first ([`with_defaults`]).
#[derive(Deserialize)]
pub struct GroupedSigmoidMoe {
    /// transformers 5 reads GLM's as `num_local_experts` too.
    #[serde(alias = "num_local_experts")]
    n_routed_experts: usize,
    num_experts_per_tok: usize,
    moe_intermediate_size: usize,
    /// The dense layers' MLP width.
    intermediate_size: usize,
    n_shared_experts: Option<usize>,
    n_group: usize,
    topk_group: usize,
    first_k_dense_replace: usize,
    #[serde(default = "default_true")]
    norm_topk_prob: bool,
    routed_scaling_factor: f32,
}

fn default_true() -> bool {
    true
}

/// `config` with each of `defaults` set where the config leaves it out.
pub fn with_defaults(config: &serde_json::Value, defaults: &[(&str, serde_json::Value)]) -> serde_json::Value {
    let mut config = config.clone();
    if let Some(fields) = config.as_object_mut() {
        for (name, value) in defaults {
            fields.entry(*name).or_insert_with(|| value.clone());
        }
    }
    config
}

impl GroupedSigmoidMoe {
    /// Makes `spec`'s first layers dense and the others this MoE.
    pub fn apply(&self, spec: &mut ModelSpec) -> Result<()> {
        check_top_k(self.n_routed_experts, self.num_experts_per_tok)?;
        let (layers, first_k_dense) = (spec.layers.len(), self.first_k_dense_replace);
        if first_k_dense > layers {
            return Err(Error::Config(format!(
                "first_k_dense_replace ({first_k_dense}) is over num_hidden_layers ({layers})"
            )));
        }
        for layer in &mut spec.layers[..first_k_dense] {
            layer.ffn = FfnKind::Dense {
                intermediate: self.intermediate_size,
            };
        }
        let n_shared = self.n_shared_experts.unwrap_or(0);
        spec.moe = Some(MoeSpec {
            num_experts: self.n_routed_experts,
            top_k: self.num_experts_per_tok,
            intermediate: self.moe_intermediate_size,
            router: RouterKind::SigmoidGroupedTopK {
                n_group: self.n_group,
                topk_group: self.topk_group,
                renormalize: self.norm_topk_prob,
                scaling: self.routed_scaling_factor,
            },
            activation: ExpertActivation::SiluGlu,
            shared_expert: (n_shared > 0).then_some(SharedExpert {
                intermediate: n_shared * self.moe_intermediate_size,
                sigmoid_gated: false,
            }),
            naming: STANDARD_EXPERTS,
        });
        Ok(())
    }
}

/// Sets each layer's mixer from config.json's `layer_types` (one name per layer, each one of `kinds`), or from
/// `default(layer)` when the config lists none.
pub fn set_layer_mixers(
    spec: &mut ModelSpec,
    layer_types: Option<&[String]>,
    kinds: &[(&str, Mixer)],
    default: impl Fn(usize) -> Mixer,
) -> Result<()> {
    let layers = spec.layers.len();
    let mixers: Vec<Mixer> = match layer_types {
        Some(types) if types.len() != layers => {
            return Err(Error::Config(format!(
                "layer_types has {} entries for {layers} layers",
                types.len()
            )))
        }
        Some(types) => types
            .iter()
            .map(|t| {
                kinds
                    .iter()
                    .find(|(name, _)| name == t)
                    .map(|&(_, mixer)| mixer)
                    .ok_or_else(|| {
                        let names: Vec<&str> = kinds.iter().map(|&(name, _)| name).collect();
                        Error::Config(format!("layer type \"{t}\" is not supported ({})", names.join(", ")))
                    })
            })
            .collect::<Result<_>>()?,
        None => (0..layers).map(default).collect(),
    };
    for (layer, mixer) in spec.layers.iter_mut().zip(mixers) {
        layer.mixer = mixer;
    }
    Ok(())
}

/// The hybrid families' (Qwen3-Next, Qwen3.5) Gated DeltaNet settings and layer pattern.
#[derive(Clone, Debug, Deserialize)]
pub struct HybridConfig {
    /// `linear_attention` or `full_attention` per layer; absent in 4.x-era configs, which give the interval instead.
    pub layer_types: Option<Vec<String>>,
    #[serde(default = "default_full_attention_interval")]
    pub full_attention_interval: usize,
    pub linear_conv_kernel_dim: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
}

fn default_full_attention_interval() -> usize {
    4
}

impl HybridConfig {
    /// Makes `spec` hybrid: the layer pattern, the Gated DeltaNet shape, gated attention and (1 + w) norms.
    pub fn apply(&self, spec: &mut ModelSpec, projections: GdnProjections) -> Result<()> {
        if self.layer_types.is_none() && self.full_attention_interval == 0 {
            return Err(Error::Config("full_attention_interval must be positive".into()));
        }
        let interval = self.full_attention_interval;
        set_layer_mixers(
            spec,
            self.layer_types.as_deref(),
            &[
                ("full_attention", Mixer::FULL_ATTENTION),
                ("linear_attention", Mixer::GatedDeltaNet),
            ],
            |i| match (i + 1) % interval {
                0 => Mixer::FULL_ATTENTION,
                _ => Mixer::GatedDeltaNet,
            },
        )?;
        if !spec.layers.iter().any(|l| l.mixer.is_attention()) {
            // Sequences are tracked through their attention layers' KV; a model of Gated DeltaNet layers alone has none.
            return Err(Error::Config(
                "no full_attention layer: models of Gated DeltaNet layers alone are not supported".into(),
            ));
        }
        let (k_heads, v_heads) = (self.linear_num_key_heads, self.linear_num_value_heads);
        if k_heads == 0 || !v_heads.is_multiple_of(k_heads) || v_heads == 0 {
            return Err(Error::Config(format!(
                "linear_num_value_heads ({v_heads}) must be a positive multiple of linear_num_key_heads ({k_heads})"
            )));
        }
        if self.linear_conv_kernel_dim == 0 {
            return Err(Error::Config("linear_conv_kernel_dim must be positive".into()));
        }
        spec.gated_delta_net = Some(GatedDeltaNetSpec {
            num_k_heads: k_heads,
            num_v_heads: v_heads,
            k_head_dim: self.linear_key_head_dim,
            v_head_dim: self.linear_value_head_dim,
            conv_kernel: self.linear_conv_kernel_dim,
            projections,
        });
        spec.qk_norm = QkNorm::PerHead;
        spec.attention_output_gate = true;
        spec.norm_weight_offset = true;
        Ok(())
    }
}

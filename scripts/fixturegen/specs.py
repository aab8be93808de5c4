"""The fixture list: for each fixture its transformers class and config, tokenizer style, seed, and how its
checkpoint is laid out on disk (expert tensor names, config conventions, MTP tensors, FP8 layout)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .quantize import DEEPSEEK_V3_FP8, GLM4_MOE_FP8, QWEN3_5_FP8_DYNAMIC, QWEN3_FP8, Fp8Layout
from .tokenizer import (
    MIXTRAL_TOKENIZER,
    OLMOE_TOKENIZER,
    QWEN2_MOE_TOKENIZER,
    QWEN_TOKENIZER,
    VOCAB_SIZE,
    TokenizerStyle,
)
from .weights import LINEAR_STD

COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    initializer_range=LINEAR_STD,
)


# The hybrid families (Qwen3-Next, Qwen3.5/3.6-MoE): three Gated DeltaNet layers, then one gated
# full-attention layer (partial rotary 0.25: 4 of head_dim 16); the linear layers have 2 key heads
# serving 4 value heads, as the real models' 16 serve 32.
QWEN3_NEXT_HYBRID = dict(
    COMMON,
    head_dim=16,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=8,
    num_experts_per_tok=2,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)
QWEN3_5_TEXT = QWEN3_NEXT_HYBRID  # Qwen3.5 has no dense layers and always renormalises the top-k weights

# gpt-oss: a banded layer then a full one (a window of 16, so the long prompt leaves most keys outside it),
# YaRN as gpt-oss's config sets it but with an original context of 256 so that head_dim 16's frequencies fall on
# both sides of the ramp, and hidden and expert sizes divisible by MXFP4's 32.
GPT_OSS = dict(
    COMMON,
    head_dim=16,
    max_position_embeddings=8192,  # factor x original_max_position_embeddings, as transformers expects
    num_hidden_layers=2,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=16,
    intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    swiglu_limit=7.0,
    attention_bias=True,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 256,
        "truncate": False,
    },
)


@dataclass
class Fixture:
    name: str
    config_class: str  # transformers config class name
    architecture: str
    config: dict
    tokenizer: TokenizerStyle
    seed: int
    num_shards: int
    # "per_expert" (gate/up/down_proj), "w1w3w2" (Mixtral), "fused" (v5 3-D), "gpt_oss" (transformers' gpt-oss
    # tensors as they are) or "mxfp4" (gpt-oss's experts as *_blocks and *_scales)
    expert_names: str
    moe_prefix: str = "mlp"  # hub module name of the sparse block ("block_sparse_moe" for Mixtral)
    hub_config: bool = True  # rewrite config.json to the transformers 4.x hub conventions
    mtp_head: bool = False  # add mtp.* tensors as published checkpoints carry them (transformers skips them)
    mtp_layer: bool = False  # add model.layers.{num_hidden_layers}.* tensors, GLM-4.5's and DeepSeek-V3's MTP layer
    fp8: Fp8Layout | None = None  # the FP8 layout its family publishes (quantize.py), None for unquantized



FIXTURES = [
    Fixture(
        name="qwen3_moe",
        config_class="Qwen3MoeConfig",
        architecture="Qwen3MoeForCausalLM",
        config=dict(
            COMMON,
            head_dim=16,
            num_hidden_layers=3,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        tokenizer=QWEN_TOKENIZER,
        seed=1000,
        num_shards=3,
        expert_names="per_expert",
    ),
    Fixture(
        name="mixtral",
        config_class="MixtralConfig",
        architecture="MixtralForCausalLM",
        config=dict(
            COMMON,
            head_dim=16,
            num_hidden_layers=2,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            router_jitter_noise=0.0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        tokenizer=MIXTRAL_TOKENIZER,
        seed=3000,
        num_shards=2,
        expert_names="w1w3w2",
        moe_prefix="block_sparse_moe",
    ),
    Fixture(
        name="olmoe",
        config_class="OlmoeConfig",
        architecture="OlmoeForCausalLM",
        config=dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            clip_qkv=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        tokenizer=OLMOE_TOKENIZER,
        seed=4000,
        num_shards=2,
        expert_names="per_expert",
    ),
    Fixture(
        name="qwen2_moe",
        config_class="Qwen2MoeConfig",
        architecture="Qwen2MoeForCausalLM",
        config=dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=False,
            qkv_bias=True,
            use_sliding_window=False,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        tokenizer=QWEN2_MOE_TOKENIZER,
        seed=5000,
        num_shards=2,
        expert_names="per_expert",
    ),
    Fixture(
        name="qwen3_5_moe",
        config_class="Qwen3_5MoeConfig",
        architecture="Qwen3_5MoeForConditionalGeneration",
        config=dict(
            text_config=dict(QWEN3_5_TEXT),
            vision_config=dict(
                depth=1,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                patch_size=4,
                temporal_patch_size=2,
                spatial_merge_size=2,
                out_hidden_size=64,
                num_position_embeddings=16,
            ),
            tie_word_embeddings=False,
        ),
        tokenizer=QWEN_TOKENIZER,
        seed=6000,
        num_shards=3,
        expert_names="fused",
        hub_config=False,
        mtp_head=True,
    ),
    Fixture(
        name="qwen3_5_moe_text",
        config_class="Qwen3_5MoeTextConfig",
        architecture="Qwen3_5MoeForCausalLM",
        config=dict(QWEN3_5_TEXT, tie_word_embeddings=True),
        tokenizer=QWEN_TOKENIZER,
        seed=7000,
        num_shards=2,
        expert_names="fused",
        hub_config=False,
    ),
    Fixture(
        name="qwen3_next",
        config_class="Qwen3NextConfig",
        architecture="Qwen3NextForCausalLM",
        config=dict(
            QWEN3_NEXT_HYBRID,
            intermediate_size=96,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        tokenizer=QWEN_TOKENIZER,
        seed=8000,
        num_shards=3,
        expert_names="per_expert",
    ),
    Fixture(
        name="deepseek_v3",
        config_class="DeepseekV3Config",
        architecture="DeepseekV3ForCausalLM",
        config=dict(
            COMMON,
            num_key_value_heads=4,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            rope_interleave=True,
            max_position_embeddings=512,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        ),
        tokenizer=QWEN_TOKENIZER,
        seed=10000,
        num_shards=2,
        expert_names="per_expert",
        hub_config=False,
        mtp_layer=True,
    ),
    Fixture(
        name="glm4_moe",
        config_class="Glm4MoeConfig",
        architecture="Glm4MoeForCausalLM",
        config=dict(
            COMMON,
            head_dim=16,
            num_hidden_layers=3,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            use_qk_norm=True,
            attention_bias=True,
            num_nextn_predict_layers=1,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        ),
        tokenizer=QWEN_TOKENIZER,
        seed=9000,
        num_shards=2,
        expert_names="per_expert",
        mtp_layer=True,
    ),
    Fixture(
        name="gpt_oss",
        config_class="GptOssConfig",
        architecture="GptOssForCausalLM",
        config=GPT_OSS,
        tokenizer=QWEN_TOKENIZER,
        seed=9000,
        num_shards=2,
        expert_names="gpt_oss",
        hub_config=False,
    ),
]


def _fixture(name: str) -> Fixture:
    return next(fx for fx in FIXTURES if fx.name == name)


FIXTURES += [
    dataclasses.replace(
        _fixture("qwen3_moe"),
        name="qwen3_moe_fused",
        config=dict(
            _fixture("qwen3_moe").config,
            decoder_sparse_step=2,
            mlp_only_layers=[],
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        seed=2000,
        num_shards=2,
        expert_names="fused",
        hub_config=False,
    ),
    dataclasses.replace(_fixture("gpt_oss"), name="gpt_oss_mxfp4", seed=9100, expert_names="mxfp4"),
    dataclasses.replace(_fixture("qwen3_moe"), name="qwen3_moe_fp8", fp8=QWEN3_FP8),
    dataclasses.replace(_fixture("qwen3_5_moe_text"), name="qwen3_5_moe_fp8_dynamic", fp8=QWEN3_5_FP8_DYNAMIC),
    dataclasses.replace(_fixture("deepseek_v3"), name="deepseek_v3_fp8", fp8=DEEPSEEK_V3_FP8),
    dataclasses.replace(_fixture("glm4_moe"), name="glm4_moe_fp8", fp8=GLM4_MOE_FP8),
]

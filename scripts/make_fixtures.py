#!/usr/bin/env python3
"""Build tiny random Mixture-of-Experts checkpoints and Hugging Face reference outputs.

For every fixture this writes a directory laid out like a Hugging Face hub repository:

    config.json                       model config (hub style, or v5 style for the fused fixture)
    generation_config.json            bos/eos ids
    model-0000K-of-0000N.safetensors  bf16 weights, sharded, hub tensor names
    model.safetensors.index.json      metadata.total_size + weight_map
    tokenizer.json                    tiny byte-level BPE (shared by all fixtures)
    tokenizer_config.json             family chat template, bos/eos, tokenizer_class
    reference.json                    float32 transformers outputs (greedy ids, margins, logits)

The weights are random but seeded, scaled so that logits have a spread of order one and
router logits are well separated, and rounded to bf16, so the bf16 files hold exactly the
weights the float32 reference ran with. The reference runs transformers' own model classes
in float32 on the CPU with eager attention. Afterwards every fixture is loaded back with
`from_pretrained` (which applies transformers' own checkpoint conversion) and must
reproduce the reference weights and logits bit for bit.

Fixtures:
    qwen3_moe        Qwen3MoeForCausalLM, per-expert hub tensors, tied embeddings, one dense layer
    qwen3_moe_fused  Qwen3MoeForCausalLM, experts as fused 3-D tensors (transformers v5 layout)
    mixtral          MixtralForCausalLM, block_sparse_moe.experts.E.w1/w2/w3
    olmoe            OlmoeForCausalLM, q/k norm over the full projected width
    qwen2_moe        Qwen2MoeForCausalLM, shared expert + sigmoid gate, q/k/v bias
    qwen3_5_moe      Qwen3_5MoeForConditionalGeneration: hybrid Gated DeltaNet / gated attention text model
                     nested under text_config and model.language_model., a tiny vision tower, mtp.* tensors,
                     fused expert tensors
    qwen3_5_moe_text Qwen3_5MoeForCausalLM: the same text model on its own, tied embeddings
    qwen3_next       Qwen3NextForCausalLM: in_proj_qkvz / in_proj_ba layout, a dense layer, hub-style config
    deepseek_v3      DeepseekV3ForCausalLM: MLA (low-rank q, compressed kv, interleaved decoupled RoPE), YaRN
                     with its softmax-scale correction, the grouped sigmoid router with a non-zero (float32)
                     correction bias in four groups (two kept), a plain-added shared expert, a dense first layer,
                     an MTP layer's tensors after the decoder's
    glm4_moe         Glm4MoeForCausalLM: partial rotary, q/k norm, q/k/v bias, the grouped sigmoid router with a
                     non-zero (float32) correction bias in two groups, a plain-added shared expert, a dense first
                     layer, and a multi-token-prediction layer's tensors after the decoder's (which transformers skips)
    qwen3_moe_fp8    qwen3_moe in block FP8 as Qwen publishes it (quant_method fp8, weight_block_size [128, 128]):
                     attention, dense MLP and experts as float8_e4m3fn with f32 `weight_scale_inv` per block;
                     routers, norms and embeddings bf16 (modules_to_not_convert)
    qwen3_5_moe_fp8_dynamic
                     qwen3_5_moe_text in compressed-tensors FP8-Dynamic (per-channel bf16 `weight_scale`):
                     attention, shared and fused routed experts FP8; Gated DeltaNet, routers, gates bf16 (ignore)
    gpt_oss          GptOssForCausalLM: attention sinks and biases, a sliding-window and a full layer, YaRN,
                     router bias, bf16 fused experts as transformers stores them (gate/up interleaved, [E, in, out])
    gpt_oss_mxfp4    the same model with MXFP4 experts as OpenAI ships them (*_blocks, *_scales, bf16 biases;
                     quantization_config mxfp4); the reference runs on the dequantized weights, which
                     from_pretrained with Mxfp4Config(dequantize=True) must reproduce bit for bit

FP8 references are weight-only: the fixture's weights are quantized (per 128 x 128 block or per output channel,
scale = largest magnitude / 448) and the float32 reference runs transformers on the *dequantized* weights (FP8 value
times its scale, in float32), with activations in float32. The `dynamic` activation quantization the configs
name is left out on purpose: it is a speed choice of FP8 matmul kernels, which ferry does not make, so the CPU
reference path has none. Their transformers reload check is the dequantized weights read back from the files
(transformers' FP8 loaders need a GPU or dequantize to bf16).

Needs torch, transformers (5.x), tokenizers and safetensors. Usage:

    python3 scripts/make_fixtures.py [--out tests/fixtures] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, GenerationConfig

# ---------------------------------------------------------------------------------------------
# Shared constants
# ---------------------------------------------------------------------------------------------

VOCAB_SIZE = 512  # model vocab (embedding rows); the tokenizer uses BPE_VOCAB_SIZE + 7 of them
BPE_VOCAB_SIZE = 500  # 256 byte symbols + learned merges
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
PLAIN_ADDED_TOKENS = ["<think>", "</think>"]  # added but not "special", as in Qwen3's tokenizer

NUM_GENERATED = 16
MIN_MARGIN = 2e-3  # top-1 vs top-2 logit margin wanted at every greedy step
MIN_ROUTER_GAP = 1e-3  # k-th vs (k+1)-th router logit gap wanted for every token
SEED_TRIES = 8

# Init scales (see init_weights). initializer_range is written into the config for reference.
LINEAR_STD = 0.15
EMBED_STD = 0.4  # embed_tokens and lm_head: final logits get std ~ 0.4 * sqrt(64) ~ 3
ROUTER_STD = 0.5  # router logits get std ~ 0.5 * sqrt(64) = 4
NORM_JITTER = 0.1  # RMSNorm weights are 1 + 0.1 * randn
BIAS_STD = 0.1
CORRECTION_BIAS_STD = 0.1  # the sigmoid router's e_score_correction_bias, stored in float32 as published
# Gated DeltaNet: conv taps large enough that the conv keeps the projections' scale; decay rates
# A = exp(A_log) around 1 and dt = softplus(a + dt_bias) around 0.15 give a per-token state decay of
# about 0.85, so the recurrent state carries a dozen tokens (and across prefill chunks).
CONV_STD = 0.5
A_LOG_STD = 0.5
DT_BIAS_MEAN = -2.0
DT_BIAS_STD = 0.5

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model can still learn the shape of a language
if it sees enough text, and a tokenizer only needs a little text to learn which pairs of letters
belong together. This paragraph is the whole of its education.

Once upon a time there was a quiet village by the sea. Every morning the fishermen went out in
their boats, and every evening they came back with the day's catch. The children ran along the
shore and counted the boats as they returned: one, two, three, four, five. When the weather was
bad, the boats stayed in the harbour and the village waited for the wind to change.

Computers read numbers, not words. Before a language model can read a sentence, the sentence is
split into pieces called tokens, and each token is given a number. The model then predicts the
next token, one step at a time. Greedy decoding always picks the token with the highest score.
Sampling picks a token at random, with more likely tokens chosen more often.

A mixture of experts replaces one large feed-forward layer with many small ones. A router looks at
each token and chooses which experts should process it. Only the chosen experts run, so the model
can hold many parameters while spending little compute on each token. The router's choice depends
on the hidden state, and the outputs of the chosen experts are added together with weights.

Hello there! How are you today? I am fine, thank you. What would you like to talk about? We could
talk about the weather, about books, about music, or about the history of mathematics. Questions
and answers, requests and replies: that is what a conversation is made of.

In the spring the gardens were full of flowers: red roses, yellow tulips, white lilies and blue
irises. The bees moved from one flower to the next, and the birds sang in the trees. In the summer
the days were long and warm; in the autumn the leaves turned gold and fell; in the winter the snow
covered the hills and the rivers froze.

The numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 and 42 appear in many texts, as do
symbols such as + - * / = < > ( ) [ ] { } # @ & % $ and the quotation marks ' and ".
"""

SHORT_PROMPT = "The quick brown fox"

LONG_PROMPT = (
    "Once upon a time, in a village by the sea, there lived an old clockmaker who repaired every "
    "clock in the valley. Each morning he opened his small shop, lit the stove, and listened to the "
    "ticking of a hundred clocks. Some ran fast and some ran slow; a few had stopped years ago and "
    "waited on the shelf for someone to remember them. Travellers from the city said that time "
    "moved differently in his shop, and the children believed it. When the storm of 1887 broke the "
    "great clock on the church tower, the mayor asked him to fix it before the festival. He worked "
    "for nine days and nine nights, counting gears, cleaning springs and whistling old songs. "
    "On the tenth morning the bells rang again, and the whole village came out to listen. "
    "Naïve café owners still tell the story — “the clock that slept” — to visitors from "
    "Tōkyō and München. 🕰️ What happened next?"
)

CHAT_MESSAGES = [{"role": "user", "content": "Hello there"}]

# ---------------------------------------------------------------------------------------------
# Chat templates (verbatim from the families' published tokenizer_config.json files)
# ---------------------------------------------------------------------------------------------

# Qwen3 (Qwen/Qwen3-30B-A3B, as released).
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Qwen2-MoE (Qwen/Qwen1.5-MoE-A2.7B-Chat): ChatML with a default system prompt.
QWEN2_MOE_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Mixtral (mistralai/Mixtral-8x7B-Instruct-v0.1).
MIXTRAL_CHAT_TEMPLATE = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}"""

# OLMoE (allenai/OLMoE-1B-7B-0924-Instruct): Tulu format.
OLMOE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'assistant' %}"
    "{% if not loop.last %}{{ '<|assistant|>\n'  + message['content'] + eos_token + '\n' }}"
    "{% else %}{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}"
)

# ---------------------------------------------------------------------------------------------
# Fixture specifications
# ---------------------------------------------------------------------------------------------


@dataclass
class TokenizerStyle:
    """How a family's tokenizer files look."""

    chat_template: str
    eos_token: str
    bos_token: str | None
    add_bos_token: bool
    pad_token: str | None
    extra_special_tokens: list[str] = field(default_factory=list)
    generation_eos: list[str] = field(default_factory=list)  # generation_config eos ids (first = config eos)
    generation_extra: dict = field(default_factory=dict)


QWEN_TOKENIZER = TokenizerStyle(
    chat_template=QWEN3_CHAT_TEMPLATE,
    eos_token="<|im_end|>",
    bos_token=None,
    add_bos_token=False,
    pad_token="<|endoftext|>",
    extra_special_tokens=["<|im_start|>", "<|im_end|>"],
    generation_eos=["<|im_end|>", "<|endoftext|>"],
    generation_extra={"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95},
)
QWEN2_MOE_TOKENIZER = copy.deepcopy(QWEN_TOKENIZER)
QWEN2_MOE_TOKENIZER.chat_template = QWEN2_MOE_CHAT_TEMPLATE
QWEN2_MOE_TOKENIZER.generation_extra = {}
MIXTRAL_TOKENIZER = TokenizerStyle(
    chat_template=MIXTRAL_CHAT_TEMPLATE,
    eos_token="</s>",
    bos_token="<s>",
    add_bos_token=True,
    pad_token=None,
    generation_eos=["</s>"],
)
OLMOE_TOKENIZER = TokenizerStyle(
    chat_template=OLMOE_CHAT_TEMPLATE,
    eos_token="<|endoftext|>",
    bos_token="<|endoftext|>",
    add_bos_token=False,
    pad_token=None,
    generation_eos=["<|endoftext|>"],
)

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
# Sinks of the order of the attention scores, so that they take a visible share of the softmax.
SINK_STD = 1.0
# MXFP4 expert weights: scales 2^-4 .. 2^-2 times e2m1 values up to 6, about LINEAR_STD's spread.
MXFP4_SCALE_EXPONENTS = (-4, -2)


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
    fp8: str | None = None  # "block" (quant_method fp8, 128 x 128) or "channel" (compressed-tensors FP8-Dynamic)


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
    dataclasses.replace(_fixture("qwen3_moe"), name="qwen3_moe_fp8", fp8="block"),
    dataclasses.replace(_fixture("qwen3_5_moe_text"), name="qwen3_5_moe_fp8_dynamic", fp8="channel"),
]

# ---------------------------------------------------------------------------------------------
# FP8 (weight-only: see the docstring)
# ---------------------------------------------------------------------------------------------

FP8_MAX = 448.0
FP8_BLOCK = (128, 128)
# The projections the FP8 fixtures store in FP8 (hub and transformers names); everything else stays bf16.
FP8_TARGET = re.compile(
    r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|shared_expert\.(gate|up|down)_proj"
    r"|experts\.\d+\.(gate|up|down)_proj)\.weight$|\.experts\.(gate_up_proj|down_proj)$"
)


def fp8_scale_name(fx: Fixture, name: str) -> str:
    return name + ("_scale_inv" if fx.fp8 == "block" else "_scale")


def fp8_quantize(w: torch.Tensor, fx: Fixture) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, scales) of a [rows, cols] matrix, or of each matrix of an [n, rows, cols] stack:
    f32 scales per 128 x 128 block (block), bf16 scales per row (channel); scale = amax / 448."""
    if w.dim() == 3:
        parts = [fp8_quantize(m, fx) for m in w]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
    rows, cols = w.shape
    if fx.fp8 == "block":
        br, bc = FP8_BLOCK
        padded = torch.nn.functional.pad(w.abs(), (0, -cols % bc, 0, -rows % br))
        amax = padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc).amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()
    else:
        amax = w.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(torch.bfloat16)
    q = (w / fp8_expand(scale, rows, cols)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A [rows, cols] matrix's scales, one per weight, in float32."""
    br, bc = -(-rows // scale.shape[0]), -(-cols // scale.shape[1])
    return scale.float().repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if q.dim() == 3:
        return torch.stack([fp8_dequantize(m, s) for m, s in zip(q, scale)])
    return q.float() * fp8_expand(scale, *q.shape)


@torch.no_grad()
def fp8_round_trip_model(model: torch.nn.Module, fx: Fixture) -> dict[str, torch.Tensor]:
    """Replace every FP8 target weight by its dequantized FP8 value, matrix by matrix as the hub stores them (a
    per-expert fixture's fused gate_up_proj is two matrices per expert); returns the weights as they were."""
    originals = {}
    for name, param in model.named_parameters():
        if not FP8_TARGET.search(name):
            continue
        originals[name] = param.detach().clone()
        if name.endswith("gate_up_proj") and fx.expert_names != "fused":
            inter = param.shape[1] // 2
            halves = [param[:, :inter], param[:, inter:]]
            param.copy_(torch.cat([fp8_dequantize(*fp8_quantize(h, fx)) for h in halves], dim=1))
        else:
            param.copy_(fp8_dequantize(*fp8_quantize(param, fx)))
    return originals


def fp8_hub_state(model: torch.nn.Module, fx: Fixture, originals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hub tensors of the unquantized weights, with every FP8 target quantized and its scales added."""
    quantized = {n: p.detach().clone() for n, p in model.named_parameters() if n in originals}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in originals:
                param.copy_(originals[name])
        state = hub_state_dict(model, fx)
        for name, param in model.named_parameters():
            if name in quantized:
                param.copy_(quantized[name])
    out = {}
    for name, tensor in state.items():
        if FP8_TARGET.search(name):
            q, scale = fp8_quantize(tensor.float(), fx)
            out[name], out[fp8_scale_name(fx, name)] = q, scale
        else:
            out[name] = tensor
    return out


def fp8_quantization_config(fx: Fixture, state: dict[str, torch.Tensor]) -> dict:
    """The config.json entry the published checkpoints of fx.fp8's layout carry."""
    if fx.fp8 == "block":
        routers = sorted({n.removesuffix(".weight") for n in state if n.endswith("mlp.gate.weight")}, key=natural_key)
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK),
            "modules_to_not_convert": ["lm_head", *routers],
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True},
            }
        },
        "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$", "re:.*linear_attn.*"],
    }


def verify_fp8_fixture(out: Path, fx: Fixture, model) -> None:
    """Read the shards back, dequantize, and demand exactly the weights the reference ran with."""
    from safetensors.torch import load_file

    stored = {}
    for f in sorted(out.glob("*.safetensors")):
        stored.update(load_file(str(f)))
    expected = hub_state_dict(model, fx, dtype=torch.float32)
    for name, want in expected.items():
        got = stored[name]
        if FP8_TARGET.search(name):
            assert got.dtype == torch.float8_e4m3fn, name
            got = fp8_dequantize(got, stored[fp8_scale_name(fx, name)])
        if not torch.equal(got.float(), want):
            raise RuntimeError(f"{name} differs from the reference's weights after reading back")
    print(f"  verified: {len(expected)} tensors read back and dequantized equal the reference's weights")


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def train_base_tokenizer() -> Tokenizer:
    """Train the shared byte-level BPE on TRAINING_TEXT and append the added tokens.

    Learned tokens get ids 0..BPE_VOCAB_SIZE-1; the special and plain added tokens follow
    (as in Qwen's tokenizer, where they sit after the BPE vocabulary).
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer)
    if tok.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE vocab is {tok.get_vocab_size()}, expected {BPE_VOCAB_SIZE}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    if tok.get_vocab_size(with_added_tokens=True) > VOCAB_SIZE:
        raise RuntimeError("tokenizer does not fit the model vocab")
    return tok


def family_tokenizer(base: Tokenizer, style: TokenizerStyle) -> Tokenizer:
    """Copy of the base tokenizer with the family's post-processor (BOS or not)."""
    tok = Tokenizer.from_str(base.to_str())
    if style.add_bos_token:
        bos, bos_id = style.bos_token, tok.token_to_id(style.bos_token)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(tok: Tokenizer, style: TokenizerStyle) -> dict:
    """tokenizer_config.json contents, in the hub's usual key order."""
    added = {}
    for token_id, token in sorted(tok.get_added_tokens_decoder().items()):
        added[str(token_id)] = {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
    cfg = {
        "add_bos_token": style.add_bos_token,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
    }
    if style.extra_special_tokens:
        cfg["additional_special_tokens"] = style.extra_special_tokens
    cfg.update(
        {
            "bos_token": style.bos_token,
            "chat_template": style.chat_template,
            "clean_up_tokenization_spaces": False,
            "eos_token": style.eos_token,
            "model_max_length": 4096,
            "pad_token": style.pad_token,
            "split_special_tokens": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": None,
        }
    )
    return cfg


def write_tokenizer(out: Path, base: Tokenizer, style: TokenizerStyle) -> Tokenizer:
    tok = family_tokenizer(base, style)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    write_json(out / "tokenizer_config.json", tokenizer_config(tok, style))
    return tok


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def make_config(fx: Fixture, tok: Tokenizer):
    style = fx.tokenizer
    ids = {
        "bos_token_id": tok.token_to_id(style.bos_token or "<|endoftext|>"),
        "eos_token_id": tok.token_to_id(style.eos_token),
        "pad_token_id": tok.token_to_id(style.pad_token) if style.pad_token else None,
    }
    fields = copy.deepcopy(fx.config)
    if "text_config" in fields:  # multimodal: the token ids belong to the text model
        fields["text_config"].update(ids)
    else:
        fields.update(ids)
    config = getattr(transformers, fx.config_class)(**fields)
    config.architectures = [fx.architecture]
    return config


def hub_style_config(config_dict: dict, model_type: str) -> dict:
    """Rewrite a transformers 5 config dict to the 4.x conventions the hub's checkpoints use.

    `rope_parameters` -> `rope_theta` (+ `rope_scaling: null`), `dtype` -> `torch_dtype`,
    Qwen3-MoE's `num_local_experts` -> `num_experts`, and Qwen2-MoE's disabled sliding window
    written as a number (with `use_sliding_window: false`) rather than 0. transformers 5 reads
    both spellings.
    """
    d = dict(config_dict)
    rope = d.pop("rope_parameters")
    assert rope.get("rope_type", "default") == "default", rope
    d["rope_theta"] = rope["rope_theta"]
    d["rope_scaling"] = None
    d["torch_dtype"] = d.pop("dtype")
    if model_type == "qwen3_moe":
        d["num_experts"] = d.pop("num_local_experts")
    if model_type in ("qwen3_next", "glm4_moe"):  # as their published configs: the factor at the top level
        d["partial_rotary_factor"] = rope["partial_rotary_factor"]
    if model_type == "qwen3_next":  # as Qwen3-Next-80B-A3B's config: layer pattern by interval
        interval = 4
        assert d.pop("layer_types") == [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(d["num_hidden_layers"])
        ]
        d["full_attention_interval"] = interval
    if d.get("use_sliding_window") is False and d.get("sliding_window") == 0:
        d["sliding_window"] = d["max_position_embeddings"]  # as Qwen1.5-MoE's config: set but unused
    return dict(sorted(d.items()))


def write_configs(out: Path, fx: Fixture, config, tok: Tokenizer) -> None:
    config = copy.deepcopy(config)
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    if fx.hub_config:
        saved = json.loads((out / "config.json").read_text())
        write_json(out / "config.json", hub_style_config(saved, config.model_type))
    if fx.expert_names == "mxfp4":  # as openai/gpt-oss-20b's config.json says it
        saved = json.loads((out / "config.json").read_text())
        saved["quantization_config"] = {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4",
        }
        write_json(out / "config.json", saved)

    style = fx.tokenizer
    eos = [tok.token_to_id(t) for t in style.generation_eos]
    text = config.get_text_config()
    gen = GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else eos,
        pad_token_id=text.pad_token_id,
        **style.generation_extra,
    )
    gen.save_pretrained(out)


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded random weights with useful scales, rounded to bf16 (kept in float32)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight") and type(model).__name__.startswith(("Qwen3_5Moe", "Qwen3Next")) and (
                "linear_attn.norm" not in name and ".visual." not in name
            ):  # the hybrids' RMSNorm scales by (1 + weight); the gated norm and the vision tower's do not
                value = NORM_JITTER * noise
            elif name.endswith("norm.weight"):
                value = 1.0 + NORM_JITTER * noise
            elif name.endswith("conv1d.weight"):
                value = CONV_STD * noise
            elif name.endswith("A_log"):
                value = A_LOG_STD * noise
            elif name.endswith("dt_bias"):
                value = DT_BIAS_MEAN + DT_BIAS_STD * noise
            elif name.endswith((".bias", "_bias")):
                value = BIAS_STD * noise
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # router
                value = ROUTER_STD * noise
            elif name.endswith("self_attn.sinks"):
                value = SINK_STD * noise
            elif "embed_tokens" in name or "lm_head" in name:
                value = EMBED_STD * noise
            else:
                value = LINEAR_STD * noise
            param.copy_(value.to(torch.bfloat16).to(torch.float32))
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):  # zeros in transformers' init; trained routers' are not
                buffer.copy_(CORRECTION_BIAS_STD * torch.randn(buffer.shape, generator=gen))


def hub_state_dict(model: torch.nn.Module, fx: Fixture, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """The model's weights under the fixture's on-disk tensor names, as bf16 (or `dtype`).

    transformers 5 keeps experts as fused tensors: `experts.gate_up_proj` [E, 2*I, H] (rows
    0..I-1 are the gate projection, rows I..2I-1 the up projection) and `experts.down_proj`
    [E, H, I]. Hub checkpoints store one [I, H] / [H, I] matrix per expert instead.
    """
    tied = model.config.tie_word_embeddings
    out = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        # The router's correction bias stays float32, as transformers keeps it and the published checkpoints store it.
        stored = torch.float32 if name.endswith("e_score_correction_bias") else dtype
        tensor = tensor.detach().to(stored)
        if fx.moe_prefix != "mlp":
            name = name.replace(".mlp.", f".{fx.moe_prefix}.")
        if fx.expert_names == "mxfp4" and name in model.mxfp4_packed:
            blocks, scales = model.mxfp4_packed[name]
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
            continue
        if fx.expert_names in ("fused", "gpt_oss", "mxfp4") or ".experts." not in name:
            out[name] = tensor.contiguous()
            continue
        prefix, kind = name.rsplit(".", 1)  # "...experts", "gate_up_proj" | "down_proj"
        per_expert = {}
        if kind == "gate_up_proj":
            inter = tensor.shape[1] // 2
            per_expert["gate"] = tensor[:, :inter]
            per_expert["up"] = tensor[:, inter:]
        elif kind == "down_proj":
            per_expert["down"] = tensor
        else:
            raise ValueError(f"unexpected expert tensor {name}")
        names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
        if fx.expert_names == "w1w3w2":
            names = {"gate": "w1", "up": "w3", "down": "w2"}
        for role, stacked in per_expert.items():
            for e in range(stacked.shape[0]):
                out[f"{prefix}.{e}.{names[role]}.weight"] = stacked[e].clone().contiguous()
    if fx.mtp_head:
        out.update(mtp_tensors(model.config.get_text_config()))
    if fx.mtp_layer:
        out.update(mtp_layer_tensors(model.config))
    return dict(sorted(out.items(), key=lambda kv: natural_key(kv[0])))


def mtp_tensors(text) -> dict[str, torch.Tensor]:
    """A few of the multi-token-prediction head's tensors, named as Qwen3.5's published checkpoints name them.

    transformers does not load them (`_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]`) and text
    serving does not need them; they are here so loaders prove they skip them.
    """
    gen = torch.Generator().manual_seed(0)
    h = text.hidden_size
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        "mtp.layers.0.input_layernorm.weight": (h,),
    }
    return {name: (LINEAR_STD * torch.randn(shape, generator=gen)).to(torch.bfloat16) for name, shape in shapes.items()}


def mtp_layer_tensors(config) -> dict[str, torch.Tensor]:
    """A few tensors of the multi-token-prediction layer GLM-4.5 (and DeepSeek-V3) store after the decoder's
    layers, as `model.layers.{num_hidden_layers}.*`; transformers does not load them, and text serving must not."""
    gen = torch.Generator().manual_seed(0)
    h, n = config.hidden_size, config.num_local_experts
    layer = f"model.layers.{config.num_hidden_layers}"
    shapes = {
        f"{layer}.eh_proj.weight": (h, 2 * h),
        f"{layer}.enorm.weight": (h,),
        f"{layer}.hnorm.weight": (h,),
        f"{layer}.shared_head.norm.weight": (h,),
        f"{layer}.input_layernorm.weight": (h,),
        f"{layer}.mlp.gate.weight": (n, h),
    }
    return {name: (LINEAR_STD * torch.randn(shape, generator=gen)).to(torch.bfloat16) for name, shape in shapes.items()}


def check_hub_names(fx: Fixture, config, state: dict[str, torch.Tensor]) -> None:
    """Assert the on-disk names and shapes are the family's hub layout."""
    tied = config.tie_word_embeddings
    config = config.get_text_config()
    hidden = config.hidden_size
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    n_exp = getattr(config, "num_experts", None) or config.num_local_experts
    if tied:
        assert "lm_head.weight" not in state, "tied checkpoint must not store lm_head"
    else:
        assert "lm_head.weight" in state
    for name, t in state.items():
        if fx.expert_names in ("gpt_oss", "mxfp4"):
            if name.endswith("experts.gate_up_proj"):
                assert t.shape == (n_exp, hidden, 2 * inter), (name, t.shape)
            elif name.endswith("experts.gate_up_proj_blocks"):
                assert t.shape == (n_exp, 2 * inter, hidden // 32, 16) and t.dtype == torch.uint8, (name, t.shape)
            elif name.endswith("experts.down_proj_scales"):
                assert t.shape == (n_exp, hidden, inter // 32) and t.dtype == torch.uint8, (name, t.shape)
            packed = name.endswith(("_blocks", "_scales"))
            assert not packed or (fx.expert_names == "mxfp4" and ".mlp.experts." in name), name
            assert not name.endswith(("experts.gate_up_proj", "experts.down_proj")) or fx.expert_names == "gpt_oss"
            continue
        if fx.expert_names == "fused":
            if name.endswith("experts.gate_up_proj"):
                assert t.shape == (n_exp, 2 * inter, hidden), (name, t.shape)
            elif name.endswith("experts.down_proj"):
                assert t.shape == (n_exp, hidden, inter), (name, t.shape)
            continue
        m = re.search(r"\.experts\.(\d+)\.(\w+)\.weight$", name)
        if m:
            assert f".{fx.moe_prefix}.experts." in name, name
            proj = m.group(2)
            down = proj in ("down_proj", "w2")
            assert proj in (("gate_proj", "up_proj", "down_proj") if fx.expert_names == "per_expert" else ("w1", "w2", "w3"))
            assert t.shape == ((hidden, inter) if down else (inter, hidden)), (name, t.shape)
        assert "gate_up_proj" not in name and not name.endswith("experts.down_proj"), name
        if name.endswith(".gate.weight"):
            assert name.endswith(f".{fx.moe_prefix}.gate.weight") and t.shape == (n_exp, hidden), name


def write_shards(out: Path, state: dict[str, torch.Tensor], num_shards: int) -> None:
    """Split the (ordered) tensors into num_shards files of about equal size + the index."""
    sizes = {k: t.numel() * t.element_size() for k, t in state.items()}
    total = sum(sizes.values())
    shards: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for name, tensor in state.items():
        if shards[-1] and filled >= total * len(shards) / num_shards and len(shards) < num_shards:
            shards.append({})
        shards[-1][name] = tensor
        filled += sizes[name]
    assert len(shards) == num_shards, f"could not make {num_shards} shards"
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{num_shards:05d}.safetensors"
        save_file(shard, str(out / filename), metadata={"format": "pt"})
        weight_map.update({name: filename for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out / "model.safetensors.index.json", index)


# ---------------------------------------------------------------------------------------------
# Reference generation
# ---------------------------------------------------------------------------------------------


class RouterGapMonitor:
    """Records the smallest gap between the k-th and (k+1)-th router logit of any token."""

    def __init__(self, model: torch.nn.Module):
        self.gaps: list[torch.Tensor] = []
        self.handles = [
            m.register_forward_hook(self._hook)
            for m in model.modules()
            if type(m).__name__.lower().endswith("topkrouter")
        ]

    def _hook(self, module, args, output):
        logits = output[0].detach().float()
        if hasattr(module, "e_score_correction_bias"):
            logits = self._grouped_choice(module, logits)
        top = logits.topk(module.top_k + 1, dim=-1).values
        self.gaps.append(top[:, -2] - top[:, -1])

    def _grouped_choice(self, module, logits: torch.Tensor) -> torch.Tensor:
        """The sigmoid router's choice scores (biased, the groups left out at -inf); records the gap between the
        last kept group and the first left out."""
        scores = logits.sigmoid() + module.e_score_correction_bias
        grouped = scores.view(scores.shape[0], module.num_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        if module.topk_group < module.num_group:
            top = group_scores.topk(module.topk_group + 1, dim=-1)
            self.gaps.append(top.values[:, -2] - top.values[:, -1])
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(module.topk_group, dim=-1).indices, True)
        return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(scores)

    def stats(self) -> tuple[float, int, int]:
        gaps = torch.cat(self.gaps)
        return gaps.min().item(), int((gaps < 1e-2).sum()), gaps.numel()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt_ids: list[int], steps: int = NUM_GENERATED) -> dict:
    """Greedy decoding by full forward passes over the growing sequence (no cache, no eos stop)."""
    ids = list(prompt_ids)
    generated, margins, first_logits = [], [], None
    for step in range(steps):
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        top = logits.topk(2)
        next_id = int(top.indices[0])
        if step == 0:
            first_logits = logits
        generated.append(next_id)
        margins.append(float(top.values[0] - top.values[1]))
        ids.append(next_id)
    return {"generated_ids": generated, "top2_margins": margins, "first_logits": first_logits}


def prompt_cases(hf_tok, raw_tok: Tokenizer) -> list[dict]:
    """The three prompts, tokenized as transformers does it (cross-checked with `tokenizers`)."""
    cases = []
    for name, text in (("short", SHORT_PROMPT), ("long", LONG_PROMPT)):
        ids = hf_tok(text, add_special_tokens=True).input_ids
        cases.append({"name": name, "prompt_text": text, "prompt_ids": ids})
    chat_text = hf_tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = hf_tok(chat_text, add_special_tokens=False).input_ids
    cases.append({"name": "chat", "messages": CHAT_MESSAGES, "chat_text": chat_text, "prompt_ids": ids})

    for case in cases:
        text = case.get("prompt_text", case.get("chat_text"))
        raw = raw_tok.encode(text, add_special_tokens=case["name"] != "chat").ids
        if raw != case["prompt_ids"]:
            raise RuntimeError(f"transformers and tokenizers disagree on {case['name']}: {case['prompt_ids']} vs {raw}")
        if raw_tok.decode(raw, skip_special_tokens=case["name"] != "chat") != text:
            raise RuntimeError(f"{case['name']} prompt does not round-trip through the tokenizer")
    long_len = len(cases[1]["prompt_ids"])
    if long_len < 140:
        raise RuntimeError(f"long prompt has only {long_len} tokens")
    return cases


def build_model(fx: Fixture, config, seed: int):
    torch.manual_seed(seed)
    model_class = getattr(transformers, fx.architecture)
    model = model_class._from_config(config, attn_implementation="eager", dtype=torch.float32)
    init_weights(model, seed)
    if fx.fp8:
        model.fp8_originals = fp8_round_trip_model(model, fx)
    if fx.expert_names == "mxfp4":
        mxfp4_experts(model, seed)
    return model.eval()


def mxfp4_experts(model, seed: int) -> None:
    """Random MXFP4 expert weights: packed blocks and scales kept for the checkpoint (`model.mxfp4_packed`, by
    parameter name), and the model's float32 weights set to their exact dequantization ([E, in, out])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(seed + 1)
    packed = {}
    for name, param in sorted(model.named_parameters()):
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        experts, inputs, outputs = param.shape
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=gen, dtype=torch.uint8)
        low, high = MXFP4_SCALE_EXPONENTS
        scales = (127 + torch.randint(low, high + 1, (experts, outputs, inputs // 32), generator=gen)).to(torch.uint8)
        param.copy_(convert_moe_packed_tensors(blocks, scales).to(torch.float32))
        packed[name] = (blocks, scales)
    model.mxfp4_packed = packed


def run_reference(model, cases: list[dict]) -> tuple[list[dict], dict]:
    monitor = RouterGapMonitor(model)
    results = []
    for case in cases:
        res = greedy(model, case["prompt_ids"])
        results.append(dict(case, **res))
    gap_min, gap_small, gap_total = monitor.stats()
    monitor.close()
    margins = [m for r in results for m in r["top2_margins"]]
    stats = {
        "min_margin": min(margins),
        "margins_below": sum(m < MIN_MARGIN for m in margins),
        "router_gap_min": gap_min,
        "router_gaps_below_1e-2": gap_small,
        "router_gaps_total": gap_total,
    }
    return results, stats


def choose_seed(fx: Fixture, config, cases: list[dict]):
    """Try seeds fx.seed, fx.seed+1, ... and keep the first with clear margins and routing."""
    best = None
    for seed in range(fx.seed, fx.seed + SEED_TRIES):
        model = build_model(fx, config, seed)
        results, stats = run_reference(model, cases)
        print(f"  seed {seed}: {fmt_stats(stats)}")
        ok = stats["margins_below"] == 0 and stats["router_gap_min"] >= MIN_ROUTER_GAP
        if best is None or (ok, stats["min_margin"]) > (best[0], best[3]["min_margin"]):
            best = (ok, seed, model, stats, results)
        if ok:
            break
    ok, seed, model, stats, results = best
    if not ok:
        print(f"  WARNING: no seed met the margin/router targets; using seed {seed}")
    return seed, model, results, stats


def reference_json(config, results: list[dict]) -> dict:
    cases = []
    for r in results:
        case = {k: r[k] for k in ("name", "prompt_text", "messages", "chat_text") if k in r}
        case["prompt_ids"] = r["prompt_ids"]
        case["generated_ids"] = r["generated_ids"]
        case["top2_margins"] = r["top2_margins"]
        case["first_logits"] = [float(f"{x:.9g}") for x in r["first_logits"].tolist()]
        cases.append(case)
    return {
        "model_type": config.model_type,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__.split("+")[0],
        "cases": cases,
    }


# ---------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def verify_fixture(out: Path, fx: Fixture, model, results: list[dict]) -> None:
    """Reload the directory the way a user would and demand bit-identical weights and outputs."""
    hf_tok = AutoTokenizer.from_pretrained(out)
    for r in results:
        if "chat_text" in r:
            text = hf_tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
            assert text == r["chat_text"], "chat template renders differently after reload"
            ids = hf_tok(text, add_special_tokens=False).input_ids
        else:
            ids = hf_tok(r["prompt_text"]).input_ids
        assert ids == r["prompt_ids"], f"tokenizer reload changed {r['name']} ids"

    quantization = {}
    if fx.expert_names == "mxfp4":  # the reference is transformers' own dequantization of the packed experts
        quantization["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    loaded, info = getattr(transformers, fx.architecture).from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True, **quantization
    )
    # Mxfp4Config(dequantize=True) leaves the dequantized experts in bf16 (exact: e2m1 times a power of two); the
    # reference computes in float32 on those same values.
    loaded = loaded.to(torch.float32).eval()
    problems = {k: v for k, v in info.items() if v}
    if problems:  # the weight comparison below decides; this is for the log
        print(f"  from_pretrained loading info: {problems}")
    ref_state, new_state = model.state_dict(), loaded.state_dict()
    if ref_state.keys() != new_state.keys():
        raise RuntimeError(f"parameter names differ: {set(ref_state) ^ set(new_state)}")
    for name, t in ref_state.items():
        if not torch.equal(t, new_state[name]):
            raise RuntimeError(f"{name} differs after from_pretrained")
    worst = 0.0
    for r in results:
        logits = loaded(torch.tensor([r["prompt_ids"]]), use_cache=False).logits[0, -1].float()
        worst = max(worst, (logits - r["first_logits"]).abs().max().item())
    if worst > 1e-5:
        raise RuntimeError(f"reloaded logits differ by {worst}")
    assert greedy(loaded, results[0]["prompt_ids"])["generated_ids"] == results[0]["generated_ids"]
    print(f"  verified: from_pretrained gives identical weights ({len(new_state)} tensors), logits max diff {worst}")


def describe_v5_save(model) -> None:
    """Print which expert tensor names transformers' own save_pretrained writes (for the README)."""
    import tempfile

    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as tmp:
        try:
            model.save_pretrained(tmp)
        except Exception as err:  # informational only
            print(f"  transformers save_pretrained failed: {err!r}")
            return
        names = []
        for f in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                names += [k for k in h.keys() if ".experts." in k]
    sample = sorted(names, key=natural_key)[:4]
    print(f"  transformers save_pretrained writes {len(names)} expert tensors, e.g. {sample}")


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def fmt_stats(s: dict) -> str:
    return (
        f"min margin {s['min_margin']:.4g}, {s['margins_below']} below {MIN_MARGIN}; "
        f"router gap min {s['router_gap_min']:.3g} ({s['router_gaps_below_1e-2']}/{s['router_gaps_total']} < 1e-2)"
    )


def make_fixture(fx: Fixture, base_tok: Tokenizer, out_root: Path) -> dict:
    print(f"== {fx.name}")
    out = out_root / fx.name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    raw_tok = write_tokenizer(out, base_tok, fx.tokenizer)
    hf_tok = AutoTokenizer.from_pretrained(out)
    cases = prompt_cases(hf_tok, raw_tok)
    config = make_config(fx, raw_tok)

    seed, model, results, stats = choose_seed(fx, config, cases)
    write_configs(out, fx, config, raw_tok)
    state = hub_state_dict(model, fx)
    check_hub_names(fx, config, state)
    if fx.fp8:
        state = fp8_hub_state(model, fx, model.fp8_originals)
        saved = json.loads((out / "config.json").read_text())
        write_json(out / "config.json", dict(saved, quantization_config=fp8_quantization_config(fx, state)))
    write_shards(out, state, fx.num_shards)
    write_json(out / "reference.json", reference_json(config, results))

    if fx.fp8:
        verify_fp8_fixture(out, fx, model)
    else:
        verify_fixture(out, fx, model, results)
        describe_v5_save(model)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"  seed {seed}, {len(state)} tensors in {fx.num_shards} shards, {size / 1024:.0f} KiB")
    return dict(stats, seed=seed, size=size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures"), help="output directory")
    parser.add_argument("--only", nargs="*", help="fixture names to build (default: all)")
    args = parser.parse_args(argv)

    torch.set_grad_enabled(False)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    base_tok = train_base_tokenizer()
    if Tokenizer.from_str(train_base_tokenizer().to_str()).to_str() != base_tok.to_str():
        raise RuntimeError("tokenizer training is not deterministic")

    summary = {}
    for fx in FIXTURES:
        if args.only and fx.name not in args.only:
            continue
        summary[fx.name] = make_fixture(fx, base_tok, args.out)

    print("== summary")
    for name, s in summary.items():
        print(f"  {name:16s} seed {s['seed']}, {s['size'] / 1024:.0f} KiB, {fmt_stats(s)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

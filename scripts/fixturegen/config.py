"""config.json and generation_config.json: a fixture's transformers config, rewritten to the hub's 4.x
conventions where the family's published configs use them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING

import transformers
from tokenizers import Tokenizer
from transformers import GenerationConfig

from .files import write_json

if TYPE_CHECKING:
    from .specs import Fixture

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


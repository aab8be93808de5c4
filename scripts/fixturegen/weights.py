"""A fixture's weights: seeded random values at useful scales (rounded to bf16), the model's tensors under the
family's hub names (per-expert or fused experts, MTP tensors), their layout checks, and the sharded safetensors
files with their index."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from .files import natural_key, write_json

if TYPE_CHECKING:
    from .specs import Fixture

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
# Sinks of the order of the attention scores, so that they take a visible share of the softmax.
SINK_STD = 1.0


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


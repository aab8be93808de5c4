"""The quantized fixtures' weights. FP8 (weight-only, see scripts/make_fixtures.py): the model's weights replaced
by their dequantized FP8 values, the hub tensors quantized with their scales, the quantization_config entry, and
the read-back check. MXFP4: gpt-oss's packed experts and their exact dequantization."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from .files import natural_key
from .weights import hub_state_dict

if TYPE_CHECKING:
    from .specs import Fixture

FP8_MAX = 448.0
FP8_BLOCK = (128, 128)
# The projections the FP8 fixtures store in FP8 (hub and transformers names): attention (MLA's low-rank and
# latent projections included), dense MLPs, shared and routed experts; everything else stays bf16.
FP8_TARGET = re.compile(
    r"\.(self_attn\.([qkvo]_proj|q_[ab]_proj|kv_a_proj_with_mqa|kv_b_proj)|mlp\.(gate|up|down)_proj"
    r"|shared_experts?\.(gate|up|down)_proj|experts\.\d+\.(gate|up|down)_proj)\.weight$"
    r"|\.experts\.(gate_up_proj|down_proj)$"
)


@dataclass(frozen=True)
class Fp8Layout:
    """An FP8 checkpoint as a family publishes it: the scheme, and how config.json lists the modules it keeps
    unquantized (`modules_to_not_convert` for block FP8, `ignore` for compressed-tensors), made from the names of
    the hub tensors left in bf16; None where the published config lists none."""

    scheme: str  # "block" (quant_method fp8, 128 x 128, f32 `_scale_inv`) or "channel" (compressed-tensors)
    unconverted: Callable[[list[str]], list[str]] | None


def lm_head_and_routers(kept: list[str]) -> list[str]:
    """Qwen3's FP8 checkpoints: lm_head and each MoE layer's router by name."""
    routers = sorted({n.removesuffix(".weight") for n in kept if n.endswith("mlp.gate.weight")}, key=natural_key)
    return ["lm_head", *routers]


def qwen3_5_ignore(_kept: list[str]) -> list[str]:
    """Qwen3.5's FP8-Dynamic checkpoints: lm_head, then patterns for the routers, shared-expert gates and Gated
    DeltaNet layers."""
    return ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$", "re:.*linear_attn.*"]


def every_kept_module(kept: list[str]) -> list[str]:
    """GLM-4.5's FP8 checkpoints: every tensor left unquantized, named without `.weight` (so biases, the router's
    correction bias and the MTP layer's tensors appear by their full names), norms and embeddings included."""
    return sorted({n.removesuffix(".weight") for n in kept}, key=natural_key)


QWEN3_FP8 = Fp8Layout("block", lm_head_and_routers)
QWEN3_5_FP8_DYNAMIC = Fp8Layout("channel", qwen3_5_ignore)
# DeepSeek-V3's (and Kimi-K2's) config names no modules: its bf16 tensors (embeddings, norms, routers, lm_head) are
# simply stored without scales.
DEEPSEEK_V3_FP8 = Fp8Layout("block", None)
# GLM-4.5, 4.5-Air and 4.6 publish per-channel FP8 in compressed-tensors (`weight_scale`), not block FP8.
GLM4_MOE_FP8 = Fp8Layout("channel", every_kept_module)


def fp8_scale_name(fx: Fixture, name: str) -> str:
    return name + ("_scale_inv" if fx.fp8.scheme == "block" else "_scale")


def fp8_quantize(w: torch.Tensor, fx: Fixture) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, scales) of a [rows, cols] matrix, or of each matrix of an [n, rows, cols] stack:
    f32 scales per 128 x 128 block (block), bf16 scales per row (channel); scale = amax / 448."""
    if w.dim() == 3:
        parts = [fp8_quantize(m, fx) for m in w]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
    rows, cols = w.shape
    if fx.fp8.scheme == "block":
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


def fp8_quantization_config(fx: Fixture, names: list[str]) -> dict:
    """The config.json entry the published checkpoints of fx.fp8's layout carry, for the hub tensors `names`."""
    layout = fx.fp8
    unconverted = layout.unconverted([n for n in names if not FP8_TARGET.search(n)]) if layout.unconverted else None
    if layout.scheme == "block":
        config = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK),
        }
        return config if unconverted is None else dict(config, modules_to_not_convert=unconverted)
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
        "ignore": unconverted or [],
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

# MXFP4 expert weights: scales 2^-4 .. 2^-2 times e2m1 values up to 6, about LINEAR_STD's spread.
MXFP4_SCALE_EXPONENTS = (-4, -2)


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


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
    deepseek_v3_fp8  deepseek_v3 in block FP8 as DeepSeek publishes it (quant_method fp8, 128 x 128, no module list):
                     every projection FP8 (q_a/q_b, kv_a_proj_with_mqa, kv_b_proj, o_proj, dense MLP, shared and
                     routed experts) with f32 `weight_scale_inv`; embeddings, norms, routers, lm_head and the MTP
                     layer's tensors bf16, the correction bias float32
    glm4_moe_fp8     glm4_moe in FP8 as zai-org publishes GLM-4.5/4.5-Air/4.6 (compressed-tensors, per-channel bf16
                     `weight_scale`): attention, dense MLP, shared and routed experts FP8; `ignore` lists every
                     tensor left in bf16 (norms, q/k/v biases, routers and their correction biases, embeddings,
                     lm_head, the MTP layer's)
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

The code is in scripts/fixturegen/, one module per job (its __init__ lists them); this script runs it.

Needs torch, transformers (5.x), tokenizers and safetensors. Usage:

    python3 scripts/make_fixtures.py [--out tests/fixtures] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from fixturegen.config import make_config, write_configs
from fixturegen.files import write_json
from fixturegen.quantize import fp8_hub_state, fp8_quantization_config, verify_fp8_fixture
from fixturegen.reference import choose_seed, describe_v5_save, fmt_stats, prompt_cases, reference_json, verify_fixture
from fixturegen.specs import FIXTURES, Fixture
from fixturegen.tokenizer import train_base_tokenizer, write_tokenizer
from fixturegen.weights import check_hub_names, hub_state_dict, write_shards


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
        saved = json.loads((out / "config.json").read_text())
        write_json(out / "config.json", dict(saved, quantization_config=fp8_quantization_config(fx, list(state))))
        state = fp8_hub_state(model, fx, model.fp8_originals)
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

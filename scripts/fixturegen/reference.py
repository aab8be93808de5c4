"""The float32 transformers reference: the prompts, a model built from seeded weights, the seed whose greedy
runs have clear margins and router gaps, reference.json, and the reload checks (from_pretrained must give the
same weights and logits)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from .files import natural_key
from .quantize import fp8_round_trip_model, mxfp4_experts
from .weights import init_weights

if TYPE_CHECKING:
    from .specs import Fixture

NUM_GENERATED = 16
MIN_MARGIN = 2e-3  # top-1 vs top-2 logit margin wanted at every greedy step
MIN_ROUTER_GAP = 1e-3  # k-th vs (k+1)-th router logit gap wanted for every token
SEED_TRIES = 8

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



def fmt_stats(s: dict) -> str:
    return (
        f"min margin {s['min_margin']:.4g}, {s['margins_below']} below {MIN_MARGIN}; "
        f"router gap min {s['router_gap_min']:.3g} ({s['router_gaps_below_1e-2']}/{s['router_gaps_total']} < 1e-2)"
    )



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


#!/usr/bin/env python3
"""Writes a routing trace (the format of `ferry bench --record-routing`) in which every token picks its top-k experts
uniformly at random in every MoE layer: the routing of random dummy weights, under which a cache of N slots hits
about N / (layers x experts) of the time. Replayed with `ferry bench --routing-trace`, it reproduces the condition
the FreeToken comparison numbers on synthetic weights were measured in (shared/design/performance.md).

  python3 bench/uniform_trace.py --config bench/q30.json --tokens 4096 --out /tmp/q30-uniform.jsonl
"""

import argparse
import json
import random


def moe_shape(config):
    """(MoE layers, experts per layer, top-k) of a model's config.json; bench/locality_trace.py shares it."""
    text = config.get("text_config", config)
    dense = set(text.get("mlp_only_layers", []))
    step = text.get("decoder_sparse_step", 1)
    # DeepSeek-V3 and GLM-4.5 keep their first layers dense.
    first_moe = text.get("first_k_dense_replace", 0)
    layers = sum(
        1 for i in range(first_moe, text["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0
    )
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    return layers, experts, text["num_experts_per_tok"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the model's config.json (its MoE shape)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.config) as f:
        config = json.load(f)
    layers, experts, top_k = moe_shape(config)
    rng = random.Random(args.seed)
    with open(args.out, "w") as out:
        out.write(json.dumps({"num_layers": layers, "num_experts": experts, "top_k": top_k}) + "\n")
        for _ in range(args.tokens):
            out.write(json.dumps([rng.sample(range(experts), top_k) for _ in range(layers)]) + "\n")


if __name__ == "__main__":
    main()

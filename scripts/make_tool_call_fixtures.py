#!/usr/bin/env python3
"""Builds the scripted checkpoints: tiny models whose weights make them write a tool call, so that tool calling can
be tested end to end (a random tiny model never calls a tool by itself).

How: every token mixer's and every expert's (and dense MLP's, and shared expert's) output projection is zero (with
its bias, where it has one), so
the residual stream leaves the embedding untouched and the logits depend on the last token alone. Each scripted
token's embedding is its own one-hot direction, and the LM head maps that direction to the next scripted token
(the last one to `<|im_end|>`, the end of the turn); every other token shares one direction that predicts the first
scripted token. Whatever the prompt says, generation runs through the script, from the generation prompt's last
token, with a margin of 80 logits (any temperature a test uses picks the same tokens).

The script's pieces are added tokens (non-special) of the source fixture's tokenizer, cut so that tags fall across
pieces, as a streaming parser must handle. The other weights are the source fixture's (so attention, routing and
the delta rule still run on real numbers), in one bf16 shard; the vision tower and MTP head of qwen3_5_moe are left
out.

- tests/fixtures/tool_calls_hermes: from tests/fixtures/qwen3_moe (Qwen3's template): reasoning, a sentence, then
  one Hermes JSON call of `get_weather` with {"city": "Paris", "days": 3}.
- tests/fixtures/tool_calls_qwen3_xml: from tests/fixtures/qwen3_5_moe with Qwen3.5's template
  (tests/fixtures/chat_templates/qwen3_5.jinja, whose generation prompt opens <think>): reasoning, then two XML
  calls of `get_weather`, {"city": "Paris", "days": "3"} (an integer once converted by a schema that says so) and
  {"city": "Oslo"}.
- tests/fixtures/tool_calls_harmony: a gpt_oss model (from tests/fixtures/gpt_oss: attention sinks, sliding and
  full layers, biased experts) with gpt-oss's template (tests/fixtures/chat_templates/gpt_oss.jinja) and Harmony's
  markup tokens added as special tokens, as gpt-oss's o200k_harmony tokenizer has them (the rest of its tokenizer is
  the fixture's small BPE, which keeps the embedding small): an `analysis` message, then a `commentary` message to `functions.get_weather` with
  {"city": "Paris", "days": 3}, ended by `<|call|>` (an end-of-sequence token, as in gpt-oss's
  generation_config.json, with `<|return|>`). Each scripted token predicts one next token, so the second header,
  whose markup tokens the first message already used, is one plain added token spelling the same text.
- tests/fixtures/tool_calls_glm: from tests/fixtures/qwen3_moe with GLM-4.5's template
  (tests/fixtures/chat_templates/glm4_5.jinja): `<think>` reasoning, then one call of `get_weather` in GLM's keys
  and values, {"city": "Paris", "days": "3"} (an integer once converted by the schema).

The format lives in the tokenizer and the template, not the weights: the Qwen formats' models are of the qwen3_moe
family; Harmony's is of gpt-oss's own, so that `ferry serve` of the gpt_oss family is what the test drives.

Pure Python (no numpy, torch or safetensors needed). Usage: python3 scripts/make_tool_call_fixtures.py [REPO_ROOT]
[--only NAME]
"""

import json
import os
import shutil
import struct
import sys

ROOT = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "--only" else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIXTURES = os.path.join(ROOT, "tests/fixtures")

END_OF_TURN = "<|im_end|>"
LOGIT = 10.0  # the LM head's weight; the final norm scales a one-hot row to sqrt(hidden) = 8, so logits are 80

HARMONY_MARKUP = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]

SCRIPTS = {
    "tool_calls_hermes": {
        "source": "qwen3_moe",
        "template": None,
        "pieces": [
            "<think>",
            "\nThe user wants the weather.\n",
            "</think>",
            "\n\nLet me check.\n\n<tool",
            '_call>\n{"name": "get_weather", ',
            '"arguments": {"city": "Paris", ',
            '"days": 3}}\n</tool_call>',
        ],
    },
    "tool_calls_qwen3_xml": {
        "source": "qwen3_5_moe",
        "template": "tests/fixtures/chat_templates/qwen3_5.jinja",
        "pieces": [
            "Two cities, two calls.\n",
            "</think>",
            "\n\n<tool_call>\n<function=get_weather>\n<param",
            "eter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</para",
            "meter>\n</function>\n</tool_call>\n<tool_",
            "call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
        ],
    },
    "tool_calls_glm": {
        "source": "qwen3_moe",
        "template": "tests/fixtures/chat_templates/glm4_5.jinja",
        "pieces": [
            "<think>",
            "The user wants the weather.",
            "</think>",
            "\n<tool_call>get_weather\n<arg_",
            "key>city</arg_key>\n<arg_value>Paris</arg_",
            "value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        ],
    },
    "tool_calls_harmony": {
        "source": "gpt_oss",
        "template": "tests/fixtures/chat_templates/gpt_oss.jinja",
        "special": HARMONY_MARKUP,
        "end_of_sequence": ["<|return|>", "<|call|>"],
        "pieces": [
            "<|channel|>",
            "analysis",
            "<|message|>",
            "The user wants the weather in Paris.",
            "<|end|>",
            "<|start|>",
            "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
            '{"city": "Paris", ',
            '"days": 3}',
            "<|call|>",
        ],
    },
}


def bf16(values):
    """Little-endian bf16 bytes of floats (exact for the values used here: 0, 1, LOGIT)."""
    return b"".join(struct.pack("<f", v)[2:] for v in values)


def read_shards(directory):
    """{name: (dtype, shape, bytes)} of every tensor of a fixture."""
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for shard in shards:
        with open(os.path.join(directory, shard), "rb") as f:
            data = f.read()
        (header_len,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_len])
        header.pop("__metadata__", None)
        for name, info in header.items():
            start, end = info["data_offsets"]
            tensors[name] = (info["dtype"], info["shape"], data[8 + header_len + start : 8 + header_len + end])
    return tensors


def write_safetensors(path, tensors):
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name in sorted(tensors):
        dtype, shape, blob = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def is_output_projection(name):
    return name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj", "o_proj.bias",
                          "experts.down_proj_bias"))


def build(name, source, template, pieces, special=(), end_of_sequence=()):
    src = os.path.join(FIXTURES, source)
    out = os.path.join(FIXTURES, name)
    os.makedirs(out, exist_ok=True)

    with open(os.path.join(src, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    next_id = max(max(ids.values()), max(tokenizer["model"]["vocab"].values())) + 1
    for content in [*special, *pieces]:
        if content not in ids:
            token = {"id": next_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                     "normalized": False, "special": content in special}
            tokenizer["added_tokens"].append(token)
            tokenizer_config["added_tokens_decoder"][str(next_id)] = {k: v for k, v in token.items() if k != "id"}
            ids[content] = next_id
            next_id += 1
    chain = [ids[piece] for piece in pieces]
    assert len(set(chain)) == len(chain), "each scripted token must predict one next token"
    if template:
        tokenizer_config.pop("chat_template", None)
        shutil.copy(os.path.join(ROOT, template), os.path.join(out, "chat_template.jinja"))
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f, ensure_ascii=False, indent=2)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f, ensure_ascii=False, indent=2)
    shutil.copy(os.path.join(src, "generation_config.json"), out)
    if end_of_sequence:
        with open(os.path.join(out, "generation_config.json")) as f:
            generation_config = json.load(f)
        generation_config["eos_token_id"] += [ids[token] for token in end_of_sequence]
        with open(os.path.join(out, "generation_config.json"), "w") as f:
            json.dump(generation_config, f, indent=2)
            f.write("\n")

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config", config)
    hidden = text["hidden_size"]
    vocab = (next_id + 15) // 16 * 16
    assert len(chain) < hidden, "one hidden direction per scripted token, plus one for every other token"
    text["vocab_size"] = vocab
    config["tie_word_embeddings"] = False
    text["tie_word_embeddings"] = False
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")

    end_of_turn = ids[END_OF_TURN]
    other = hidden - 1  # the direction of every token outside the script
    direction = {token: i for i, token in enumerate(chain)}
    successor = {other: chain[0]}
    successor.update({direction[a]: b for a, b in zip(chain, chain[1:])})
    successor[direction[chain[-1]]] = end_of_turn
    predicted_by = {token: d for d, token in successor.items()}

    def row(d, value):
        return [value if i == d else 0.0 for i in range(hidden)]

    tensors = read_shards(src)
    prefix = "model.language_model." if "text_config" in config else "model."
    result = {}
    for tensor, (dtype, shape, blob) in tensors.items():
        if tensor.startswith(("model.visual.", "mtp.", "lm_head.")):
            continue
        if tensor == prefix + "embed_tokens.weight":
            blob, shape = bf16(v for t in range(vocab) for v in row(direction.get(t, other), 1.0)), [vocab, hidden]
        elif tensor == prefix + "norm.weight":
            # Qwen3.5's norms scale by 1 + weight, Qwen3's by weight: either way the final norm scales by 1.
            blob = bf16([0.0 if "text_config" in config else 1.0] * hidden)
        elif is_output_projection(tensor):
            blob = bytes(len(blob))
        result[tensor] = (dtype, shape, blob)
    lm_head = [v for t in range(vocab) for v in (row(predicted_by[t], LOGIT) if t in predicted_by else [0.0] * hidden)]
    result["lm_head.weight"] = ("BF16", [vocab, hidden], bf16(lm_head))
    write_safetensors(os.path.join(out, "model.safetensors"), result)
    print(f"{out}: {len(chain)} scripted tokens {chain}, vocab {vocab}")


def main():
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    for name, script in SCRIPTS.items():
        if only and name != only:
            continue
        build(name, script["source"], script["template"], script["pieces"], script.get("special", ()),
              script.get("end_of_sequence", ()))


if __name__ == "__main__":
    main()

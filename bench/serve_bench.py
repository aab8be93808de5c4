#!/usr/bin/env python3
"""Serving benchmark for any OpenAI-compatible server (ferry, vLLM, llama.cpp, ...), measured the way the reference
comparisons in the design notes were: standard library only.

Phases:
  1. warm-up: one request of 256 tokens, then 4 concurrent requests of 128;
  2. decode: 3 sequential streamed requests of 512 tokens at temperature 0. TTFT is taken at the first content or
     reasoning token; established decode = completion tokens / (total time - TTFT);
  3. prefill: a ~4K-token prompt with 1 output token (prefill tok/s = prompt tokens / request time), sized with
     the server's own token counts of two shorter prompts;
  4. concurrency: 4 concurrent streamed requests of 512 tokens (aggregate tok/s = all completion tokens / wall time).

Every prompt starts with a distinct nonce so that prefix caches cannot serve it.

`--workload agent-loop` measures prefix caching instead: an agent's conversation of 8 turns from a ~4K-token system
prompt describing tools, each turn = the last turn's messages + the assistant's reply + a ~200-token tool result.
Per turn it reports TTFT, the prompt tokens the server says were cached, and the TTFT of a cold prompt of the same
length (the same conversation behind a fresh nonce) with their ratio; it keeps every reply, and `--compare FILE`
(a run against a server with prefix caching off) checks the greedy replies are identical. Requests ask for `ignore_eos`
(honoured by ferry and vLLM) so that each runs to its max_tokens; the completion tokens actually generated come
from the server's usage report.

  python3 bench/serve_bench.py --base-url http://127.0.0.1:8000 [--api-key KEY] [--model NAME] [--out results.json]
"""

import argparse
import concurrent.futures
import json
import random
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit
import http.client

WORDS = (
    "river ferry harbour tide current engine cargo deck captain signal lantern rope anchor channel island bridge "
    "morning evening passenger ticket schedule weather storm calm wave shore light north south east west journey "
    "station market story history question answer reason number letter garden window mountain valley forest field"
).split()


class Client:
    def __init__(self, base_url, api_key, timeout):
        parts = urlsplit(base_url.rstrip("/"))
        self.scheme, self.host, self.prefix = parts.scheme, parts.netloc, parts.path
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout

    def _connection(self):
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, timeout=self.timeout)

    def get_json(self, path):
        conn = self._connection()
        conn.request("GET", self.prefix + path, headers=self.headers)
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"GET {path}: {response.status} {body[:500]!r}")
        return json.loads(body)

    def chat_stream(self, model, prompt, max_tokens, messages=None):
        """One streamed chat completion (of `prompt` as the user's message, or of `messages`); returns its timings,
        token counts and text."""
        body = {
            "model": model,
            "messages": messages or [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        conn = self._connection()
        started = time.perf_counter()
        conn.request("POST", self.prefix + "/v1/chat/completions", body=json.dumps(body), headers=self.headers)
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"chat completion: {response.status} {response.read()[:500]!r}")
        first_token_at = None
        usage = None
        chunks = 0
        text = []
        for raw in response:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
                    text.append(delta.get("content") or "")
                    chunks += 1
                    if first_token_at is None:
                        first_token_at = time.perf_counter()
        finished = time.perf_counter()
        conn.close()
        completion = usage["completion_tokens"] if usage else chunks
        prompt_tokens = usage["prompt_tokens"] if usage else None
        total = finished - started
        ttft = (first_token_at or finished) - started
        decode_time = total - ttft
        return {
            "prompt_tokens": prompt_tokens,
            "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
            "completion_tokens": completion,
            "text": "".join(text),
            "ttft_s": ttft,
            "total_s": total,
            "established_decode_tok_s": completion / decode_time if decode_time > 0 else None,
            "per_request_tok_s": completion / total if total > 0 else None,
        }


def make_prompt(rng, words, nonce):
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"[{nonce}] Continue this text for as long as you can.\n\n{text}"


def concurrent_run(client, model, prompts, max_tokens):
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: client.chat_stream(model, p, max_tokens), prompts))
    wall = time.perf_counter() - started
    tokens = sum(r["completion_tokens"] for r in results)
    return {"requests": results, "wall_s": wall, "completion_tokens": tokens, "aggregate_tok_s": tokens / wall}


def words_text(rng, words):
    return " ".join(rng.choice(WORDS) for _ in range(words))


def agent_loop(client, model, turns, reply_tokens, system_tokens):
    """An agent's conversation: a system prompt of ~`system_tokens` with tools, then per turn the assistant's reply and a
    ~200-token tool result. Each turn's TTFT beside a cold prompt of the same length (a fresh nonce in front)."""
    rng = random.Random(1)
    # Tokens per word of this vocabulary, from the server's own counts (probes behind fresh nonces).
    probe = lambda words: client.chat_stream(model, f"[probe {time.time_ns()}] {words_text(rng, words)}", 1)
    per_word = (probe(400)["prompt_tokens"] - probe(40)["prompt_tokens"]) / 360
    tools = "\n".join(
        f'{{"name": "tool_{i}", "description": "{words_text(rng, 12)}", "parameters": {{"type": "object", '
        f'"properties": {{"arg": {{"type": "string", "description": "{words_text(rng, 8)}"}}}}}}}}'
        for i in range(8)
    )
    system = f"You are an agent. Call the tools below as needed.\n\n# Tools\n{tools}\n\n# Rules\n"
    probe_system = [{"role": "system", "content": f"[probe {time.time_ns()}] {system}"}]
    tools_tokens = client.chat_stream(model, None, 1, messages=probe_system)["prompt_tokens"]
    system += words_text(rng, max(1, round((system_tokens - tools_tokens) / per_word)))
    tool_words = max(1, round(200 / per_word))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Begin the task."}]
    results = []
    for turn in range(1, turns + 1):
        warm = client.chat_stream(model, None, reply_tokens, messages=messages)
        cold_messages = [{"role": "system", "content": f"[cold {time.time_ns()}] {system}"}] + messages[1:]
        cold = client.chat_stream(model, None, reply_tokens, messages=cold_messages)
        ratio = warm["ttft_s"] / cold["ttft_s"] if cold["ttft_s"] > 0 else None
        results.append({"turn": turn, "warm": warm, "cold": cold, "ttft_ratio": ratio})
        print(
            f"turn {turn}: {warm['prompt_tokens']} prompt tokens, {warm['cached_tokens']} cached, "
            f"TTFT {warm['ttft_s']:.3f} s vs cold {cold['ttft_s']:.3f} s ({ratio:.3f})",
            file=sys.stderr,
        )
        messages = messages + [
            {"role": "assistant", "content": warm["text"]},
            {"role": "user", "content": f"Tool result (tool_{turn % 8}):\n{words_text(rng, tool_words)}"},
        ]
    return results


def run_agent_loop(client, model, args):
    turns = agent_loop(client, model, 8, args.reply_tokens, args.system_tokens)
    later = [t["ttft_ratio"] for t in turns[1:] if t["ttft_ratio"] is not None]
    summary = {
        "turns": len(turns),
        "first_turn_prompt_tokens": turns[0]["warm"]["prompt_tokens"],
        "max_ttft_ratio_turn_2_on": max(later) if later else None,
        "mean_ttft_ratio_turn_2_on": mean(later),
    }
    print(f"\n{'turn':<6}{'prompt':>8}{'cached':>8}{'TTFT s':>10}{'cold s':>10}{'ratio':>8}")
    for t in turns:
        w, c = t["warm"], t["cold"]
        print(f"{t['turn']:<6}{w['prompt_tokens']:>8}{w['cached_tokens'] or 0:>8}{w['ttft_s']:>10.3f}"
              f"{c['ttft_s']:>10.3f}{t['ttft_ratio']:>8.3f}")
    results = {"workload": "agent-loop", "summary": summary, "turns": turns}
    if args.compare:
        with open(args.compare) as f:
            other = json.load(f)["turns"]
        differing = [t["turn"] for t, o in zip(turns, other) if t["warm"]["text"] != o["warm"]["text"]]
        results["replies_equal_to"] = {"file": args.compare, "differing_turns": differing}
        print(f"replies vs {args.compare}: " + (f"turns {differing} differ" if differing else "identical"))
    return results


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    parser.add_argument("--out", default="serve_bench.json", help="where the JSON results go")
    parser.add_argument("--decode-tokens", type=int, default=512)
    parser.add_argument(
        "--prefill-tokens",
        type=int,
        default=4096,
        help="size of the prefill prompt; its word count comes from the tokens per word the earlier requests used",
    )
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--label", default="", help="free text stored in the JSON (machine, budget, ...)")
    parser.add_argument("--workload", choices=["standard", "agent-loop"], default="standard")
    parser.add_argument("--reply-tokens", type=int, default=64, help="agent-loop: tokens of each assistant reply")
    parser.add_argument("--system-tokens", type=int, default=4096, help="agent-loop: the system prompt's size")
    parser.add_argument("--compare", help="agent-loop: another run's JSON whose replies must be identical")
    args = parser.parse_args()

    client = Client(args.base_url, args.api_key, args.timeout)
    model = args.model or client.get_json("/v1/models")["data"][0]["id"]
    if args.workload == "agent-loop":
        results = run_agent_loop(client, model, args)
        results.update({"model": model, "label": args.label, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nwrote {args.out}", file=sys.stderr)
        if results.get("replies_equal_to", {}).get("differing_turns"):
            sys.exit(1)
        return
    rng = random.Random(0)
    nonce = iter(range(10**6))
    prompt = lambda words=40: make_prompt(rng, words, f"{time.time_ns()}-{next(nonce)}")

    print(f"model {model} at {args.base_url}", file=sys.stderr)
    print("warm-up ...", file=sys.stderr)
    client.chat_stream(model, prompt(), 256)
    concurrent_run(client, model, [prompt() for _ in range(4)], 128)

    print("3 sequential requests ...", file=sys.stderr)
    sequential = [client.chat_stream(model, prompt(), args.decode_tokens) for _ in range(3)]
    # Tokenizers differ in tokens per word; two measured prompt sizes give the chat template's overhead and the
    # words that make a prompt of about --prefill-tokens.
    small, large = client.chat_stream(model, prompt(40), 1), client.chat_stream(model, prompt(400), 1)
    per_word = (large["prompt_tokens"] - small["prompt_tokens"]) / 360
    words = max(1, round((args.prefill_tokens - small["prompt_tokens"]) / per_word) + 40)
    print(f"~{args.prefill_tokens}-token prefill ({words} words) ...", file=sys.stderr)
    prefill = client.chat_stream(model, prompt(words), 1)
    prefill["prefill_tok_s"] = prefill["prompt_tokens"] / prefill["total_s"] if prefill["prompt_tokens"] else None
    print("4 concurrent requests ...", file=sys.stderr)
    concurrent = concurrent_run(client, model, [prompt() for _ in range(4)], args.decode_tokens)

    summary = {
        "ttft_s": mean(r["ttft_s"] for r in sequential),
        "established_decode_tok_s": mean(r["established_decode_tok_s"] for r in sequential),
        "per_request_tok_s": mean(r["per_request_tok_s"] for r in sequential),
        "prefill_prompt_tokens": prefill["prompt_tokens"],
        "prefill_tok_s": prefill["prefill_tok_s"],
        "aggregate_tok_s_4_concurrent": concurrent["aggregate_tok_s"],
    }
    n = args.decode_tokens
    rows = [
        (f"TTFT, {n}-token requests (mean of 3)", summary["ttft_s"], "s"),
        ("established decode (mean of 3)", summary["established_decode_tok_s"], "tok/s"),
        ("per-request decode incl. TTFT (mean of 3)", summary["per_request_tok_s"], "tok/s"),
        (f"prefill, {summary['prefill_prompt_tokens']}-token prompt", summary["prefill_tok_s"], "tok/s"),
        (f"aggregate, 4 concurrent x {n}", summary["aggregate_tok_s_4_concurrent"], "tok/s"),
    ]
    print(f"\n{'measure':<44}{'value':>16}")
    for name, value, unit in rows:
        shown = f"{value:.2f} {unit}" if value is not None else "n/a"
        print(f"{name:<44}{shown:>16}")
    results = {
        "model": model,
        "base_url": args.base_url,
        "label": args.label,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "summary": summary,
        "sequential": sequential,
        "prefill": prefill,
        "concurrent": concurrent,
    }
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

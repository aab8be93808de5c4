#!/usr/bin/env python3
"""Soak test of `ferry serve`: many streaming clients for N minutes, some hanging up mid-stream, then checks that
the server is whole.

Starts `ferry serve` on a checkpoint (the bundled CPU fixture by default), warms it up, notes its RSS, then runs
--clients threads that each send streamed chat completions back to back for --minutes; --disconnect of them hang
up after a few chunks. It passes when no request failed (every response a 200 whose stream ends with
`data: [DONE]`, or was cut by the client on purpose), the KV cache is empty afterwards (`ferry_kv_blocks_used` 0
on /metrics, no request running or queued) and the server's RSS is within --rss-tolerance of where it started.

    scripts/soak.py --ferry target/debug/ferry --minutes 10

Standard library only. Prints a JSON summary; exits 1 on a failed check.
"""

import argparse
import http.client
import json
import os
import random
import re
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "river stone light quiet ember harbor lantern meadow copper signal".split()


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def metric(address, name):
    """The value of an unlabelled metric on /metrics."""
    connection = http.client.HTTPConnection(*address, timeout=30)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise RuntimeError(f"no {name} on /metrics")


def health(address):
    try:
        connection = http.client.HTTPConnection(*address, timeout=5)
        connection.request("GET", "/health")
        status = connection.getresponse().status
        connection.close()
        return status
    except OSError:
        return None


class Server:
    """`ferry serve` on a free port; its log is kept for the summary."""

    def __init__(self, ferry, model, extra):
        self.process = subprocess.Popen(
            [ferry, "serve", "--model", model, "--port", "0", "--served-model-name", "soak", *extra],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "NO_COLOR": "1"},
        )
        self.log = []
        found = threading.Event()
        self.address = None

        def read_log():
            for line in self.process.stderr:
                self.log.append(line.rstrip("\n"))
                match = re.search(r"listening on http://([\d.]+):(\d+)", line)
                if match and not found.is_set():
                    self.address = (match.group(1), int(match.group(2)))
                    found.set()

        threading.Thread(target=read_log, daemon=True).start()
        if not found.wait(60):
            self.stop()
            sys.exit("ferry serve did not start:\n" + "\n".join(self.log))
        deadline = time.time() + 600
        while health(self.address) != 200:
            if self.process.poll() is not None or time.time() > deadline:
                sys.exit("ferry serve never became ready:\n" + "\n".join(self.log))
            time.sleep(0.2)

    def stop(self):
        self.process.terminate()
        try:
            return self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.completed = 0
        self.disconnected = 0
        self.errors = []

    def add(self, outcome, error=None):
        with self.lock:
            if error is not None:
                self.errors.append(error)
            elif outcome == "disconnected":
                self.disconnected += 1
            else:
                self.completed += 1


def one_request(address, rng, disconnect_share):
    """Sends one streamed chat completion; returns ("completed" | "disconnected", error or None)."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    body = {
        "model": "soak",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": rng.randint(1, 48),
        "temperature": rng.choice([0, 0.8]),
        "stream": True,
    }
    hang_up_after = rng.randint(0, 4) if rng.random() < disconnect_share else None
    connection = http.client.HTTPConnection(*address, timeout=120)
    try:
        connection.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        if response.status != 200:
            return "completed", f"status {response.status}: {response.read()[:200]!r}"
        chunks = 0
        finished = False
        while True:
            line = response.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                return "completed", None if finished else "stream ended without a finish_reason"
            chunk = json.loads(line[len(b"data: "):])
            if "error" in chunk:
                return "completed", f"error in the stream: {chunk['error']}"
            finished |= any(c.get("finish_reason") for c in chunk.get("choices", []))
            chunks += 1
            if hang_up_after is not None and chunks > hang_up_after:
                return "disconnected", None
        if hang_up_after is not None and finished:
            return "disconnected", None
        return "completed", "the stream ended before data: [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as e:
        return "completed", f"{type(e).__name__}: {e}"
    finally:
        connection.close()


def client(address, seed, deadline, disconnect_share, tally):
    rng = random.Random(seed)
    while time.time() < deadline:
        outcome, error = one_request(address, rng, disconnect_share)
        tally.add(outcome, error)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ferry", default=os.path.join(ROOT, "target/debug/ferry"))
    parser.add_argument("--model", default=os.path.join(ROOT, "tests/fixtures/qwen3_moe"))
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--disconnect", type=float, default=0.3, help="share of requests the client cuts short")
    parser.add_argument("--rss-tolerance", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("serve_args", nargs="*", help="more `ferry serve` options, after --")
    args = parser.parse_args()

    # Room for every client in the queue, so a refusal (503) is an error, not load shedding.
    server = Server(args.ferry, args.model, ["--max-queued-requests", str(2 * args.clients), *args.serve_args])
    try:
        # A warm-up round reaches the allocator's steady state before the reference RSS is taken.
        warm = Tally()
        client(server.address, args.seed - 1, time.time() + 5, 0.0, warm)
        rss_start = rss_bytes(server.process.pid)

        tally = Tally()
        deadline = time.time() + 60 * args.minutes
        threads = [
            threading.Thread(
                target=client, args=(server.address, args.seed + i, deadline, args.disconnect, tally)
            )
            for i in range(args.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        # Hung-up requests are cancelled when the server notices; give it a moment to drain.
        drain_deadline = time.time() + 60
        while True:
            busy = [metric(server.address, m) for m in
                    ("ferry_kv_blocks_used", "ferry_running_requests", "ferry_queued_requests")]
            if busy == [0, 0, 0] or time.time() > drain_deadline:
                break
            time.sleep(0.5)
        time.sleep(2)
        rss_end = rss_bytes(server.process.pid)
        summary = {
            "minutes": args.minutes,
            "clients": args.clients,
            "completed": tally.completed,
            "disconnected": tally.disconnected,
            "errors": len(tally.errors) + len(warm.errors),
            "first_errors": (warm.errors + tally.errors)[:10],
            "kv_blocks_used": busy[0],
            "running": busy[1],
            "queued": busy[2],
            "rss_start_mib": round(rss_start / 2**20, 1),
            "rss_end_mib": round(rss_end / 2**20, 1),
            "rss_change": round(rss_end / rss_start - 1, 3),
        }
    finally:
        exit_code = server.stop()
    summary["server_exit_code"] = exit_code
    print(json.dumps(summary, indent=2))
    failed = (
        summary["errors"] > 0
        or busy != [0, 0, 0]
        or summary["rss_change"] > args.rss_tolerance
        or tally.completed == 0
    )
    if failed:
        print("soak FAILED; the server's log ends:\n" + "\n".join(server.log[-20:]), file=sys.stderr)
        sys.exit(1)
    print("soak passed", file=sys.stderr)


if __name__ == "__main__":
    main()

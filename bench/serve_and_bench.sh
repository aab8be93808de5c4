#!/usr/bin/env bash
# Starts `ferry serve` with the given arguments, waits until /health says ready, runs bench/serve_bench.py against
# it and stops the server. For the GPU machine, where the staged binary is .stage/ferry:
#   bench/serve_and_bench.sh OUT.json LABEL --synthetic bench/q30.json --tokenizer tests/fixtures/qwen3_moe \
#       --device cuda --gpu-memory-budget 22.3GiB
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1 label=$2
shift 2
ferry=${FERRY:-.stage/ferry}
port=${PORT:-8471}
log=${out%.json}.server.log
"$ferry" serve --port "$port" "$@" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
    if ! kill -0 $server 2>/dev/null; then
        echo "ferry serve exited; its log:" >&2
        tail -20 "$log" >&2
        exit 1
    fi
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" = 200 ] && break
    sleep 1
done
# SERVE_BENCH_ARGS: more arguments for serve_bench.py (e.g. "--decode-tokens 256").
python3 bench/serve_bench.py --base-url "http://127.0.0.1:$port" --out "$out" --label "$label" ${SERVE_BENCH_ARGS:-}
curl -s "http://127.0.0.1:$port/metrics" >"${out%.json}.metrics.txt"

#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .stage/ carried (scripts/device/stage.sh made it):
# every GPU test (the CUDA ops against the CPU backend, and every family's parity with HF transformers'
# references on the GPU), then prints a table. Logs go to $OUT when set.
set -uo pipefail
cd "$(dirname "$0")/../.."
scripts/device/unstage.sh
out=${OUT:-/tmp/ferry-gpu-tests}
mkdir -p "$out"
export FERRY_FIXTURES=$PWD/tests/fixtures FERRY_BENCH_DIR=$PWD/bench
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
status=0
for test in .stage/tests/*; do
    name=$(basename "$test")
    "$test" --ignored --test-threads=1 --nocapture >"$out/$name.log" 2>&1 || status=1
done
printf '\n%-60s %s\n' "GPU test" "result"
grep -h '^test .* \.\.\. ' "$out"/*.log | sed -E 's/^test (.*) \.\.\. (.*)$/\1|\2/' \
    | awk -F'|' '{ printf "%-60s %s\n", $1, $2 }'
grep -h 'rel err' "$out"/*.log || true
grep -h -A8 'panicked' "$out"/*.log | head -60 || true
exit $status

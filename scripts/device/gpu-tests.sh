#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .stage/ carried (scripts/device/stage.sh made it):
# every GPU test (the CUDA ops against the CPU backend, and every family's parity with HF transformers'
# references on the GPU), then prints a table. Logs go to $OUT when set.
#   scripts/device/gpu-tests.sh [BINARY...] [-- TEST-ARGS...]
# BINARY: test binaries by the name after the package's (cuda_ops, parity, cuda_offload, ...; all by default);
# TEST-ARGS go to each (e.g. `--exact NAME` or `--skip NAME`): the whole suite outgrows one 10-minute call of the
# device tool (cuda_offload alone takes about 9 minutes), so a session runs it in two or three.
set -uo pipefail
cd "$(dirname "$0")/../.."
scripts/device/unstage.sh
out=${OUT:-/tmp/ferry-gpu-tests}
mkdir -p "$out"
export FERRY_FIXTURES=$PWD/tests/fixtures FERRY_BENCH_DIR=$PWD/bench
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
binaries=() test_args=()
while [ $# -gt 0 ]; do
    case $1 in
    --) shift; test_args=("$@"); break ;;
    *) binaries+=("$1"); shift ;;
    esac
done
# Tests that need two GPUs (named `two_gpus`) are skipped, and said to be, on a machine of one.
gpus=$(nvidia-smi -L | grep -c '^GPU')
skip=()
if [ "$gpus" -lt 2 ]; then
    skip=(--skip two_gpus)
    echo "one GPU: the two_gpus tests are skipped" | tee "$out/skipped.txt"
fi
status=0
for test in .stage/tests/*; do
    name=$(basename "$test")
    if [ ${#binaries[@]} -gt 0 ] && ! printf '%s\n' "${binaries[@]}" | grep -qx "${name#*-*-}"; then
        continue
    fi
    "$test" --ignored --test-threads=1 --nocapture "${skip[@]}" "${test_args[@]}" >"$out/$name.log" 2>&1 || status=1
done
printf '\n%-60s %s\n' "GPU test" "result"
grep -h '^test .* \.\.\. ' "$out"/*.log | sed -E 's/^test (.*) \.\.\. (.*)$/\1|\2/' \
    | awk -F'|' '{ printf "%-60s %s\n", $1, $2 }'
grep -h 'rel err' "$out"/*.log || true
grep -h -A8 'panicked' "$out"/*.log | head -60 || true
exit $status

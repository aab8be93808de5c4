#!/usr/bin/env bash
# Runs, on the GPU machine, an A/B of ferry binaries on resident decode: the staged binary (scripts/device/stage.sh;
# named `stage`) and each candidate in .stage/ab/ (scripts/device/stage-ab.sh), one after another on each config,
# the whole round ROUNDS times (default 2): one run's decode speed moves by 2-3 %, so only an alternated difference
# larger than that says something. Prints a line per run (batch-1 and 4-sequence decode, prefill, in tok/s) and the
# median of each binary's runs per config. With PROFILE=1, then each binary's decode kernels under ncu on each config
# (batch 1 and 4 sequences, each kernel timed alone; bench/ncu_summary.py's medians, one layer's cost each): where a
# difference comes from (ROUNDS=0 PROFILE=1: the profiles alone). Results (JSON, CSV) go to $OUT/ferry-ab, or
# /tmp/ferry-ab.
#   scripts/device/ab.sh [CONFIG...]
# CONFIG: bench configs (default: q30 cut to 12 layers, bench/q30-12layers.json, in bf16 and in FP8).
set -uo pipefail
cd "$(dirname "$0")/../.."
scripts/device/unstage.sh
out=${OUT:-/tmp}/ferry-ab
rm -rf "$out" && mkdir -p "$out"
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(bench/q30-12layers.json bench/q30-fp8-12layers.json)
# Each binary's name (in the results) and path.
binaries=()
declare -A path_of
if [ -x .stage/ferry ]; then
    binaries+=(stage)
    path_of[stage]=.stage/ferry
fi
for packed in .stage/ab/*.xz; do
    [ -e "$packed" ] || continue
    xz -dkf "$packed"
    chmod +x "${packed%.xz}"
    name=$(basename "${packed%.xz}")
    binaries+=("$name")
    path_of[$name]=${packed%.xz}
done
for round in $(seq "${ROUNDS:-2}"); do
    for config in "${configs[@]}"; do
        for binary in "${binaries[@]}"; do
            name=$(basename "$config" .json)__${binary}__$round
            "${path_of[$binary]}" bench --synthetic "$config" --device cuda --decode-tokens 64 \
                --output "$out/$name.json" \
                >"$out/$name.log" 2>&1 || { echo "$name failed:"; tail -3 "$out/$name.log"; }
        done
    done
done
python3 - "$out" <<'PY'
import json, pathlib, statistics, sys
from collections import defaultdict
runs = defaultdict(list)
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    config, binary, _ = path.stem.split("__")
    result = json.loads(path.read_text())
    row = (result["decode_tok_s_batch1"], result["decode_tok_s_aggregate"], result["prefill_tok_s"])
    runs[config, binary].append(row)
    sequences = result["concurrency"]
    print(f"{path.stem:40} batch 1 {row[0]:8.1f}  {sequences} sequences {row[1]:8.1f}  prefill {row[2]:8.0f}")
print("medians:")
for (config, binary), rows in sorted(runs.items()):
    medians = [statistics.median(column) for column in zip(*rows)]
    print(f"{config:24} {binary:16} batch 1 {medians[0]:8.1f}  concurrent {medians[1]:8.1f}  prefill {medians[2]:8.0f}")
PY
[ -n "${PROFILE:-}" ] || exit 0
# The decode kernels only: prefill's launch thousands of others.
decode_kernels='gemv|moe_gate_up|moe_down|attention_d|attention_combine|qkv_rope|route'
for config in "${configs[@]}"; do
    for binary in "${binaries[@]}"; do
        name=$(basename "$config" .json)__${binary}
        ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --print-units base \
            --kernel-name "regex:$decode_kernels" --launch-count 2000 \
            "${path_of[$binary]}" bench --synthetic "$config" --device cuda --decode-tokens 6 --concurrency 4 \
            >"$out/$name.csv" 2>"$out/$name.ncu.log" \
            || { echo "$name: ncu failed"; tail -3 "$out/$name.ncu.log"; continue; }
        echo "== $name"
        python3 bench/ncu_summary.py "$out/$name.csv" --min-launches 30 | head -24
    done
done

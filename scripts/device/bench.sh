#!/usr/bin/env bash
# Runs, on the GPU machine, the benchmarks docs/perf.md records, with the staged binary (scripts/device/stage.sh):
#   scripts/device/bench.sh WORKLOAD...
# WORKLOAD: q30-resident | q30x12-resident and q30x12-lanes (q30 cut to 12 layers, bench/q30-12layers.json: a 7 s
# load, for A/B runs and kernel profiles; the lanes at a 10 GiB budget, 384 slots, both traces, auto, offload and
# hybrid) | q30x12-launch (q30x12-resident with and without --no-dependent-launch, twice) | q30x12-profile (ncu's
# time of every kernel of a resident decode step; NCU_KERNEL=REGEX adds ncu's sections for those kernels) | q30-1536 (the model's routing; 1536 slots, KV for 16384 tokens, FreeToken's setting) |
# q30-1536-lanes (the same under the uniform and the locality trace with --moe-strategy auto, offload and hybrid, or
# the comma-separated LANE_STRATEGIES (cpu too), and a 75-token prompt; -uniform or -locality: one trace) |
# q30-1536-uniform (the same under a uniformly random routing trace) | q30-1536-locality (the same under
# bench/locality_trace.py's trace, calibrated to Qwen3-30B-A3B's published locality) | q30-15.8 | q36-22.3 |
# q36-15.8 (4K and 32K prompts) | q36-22.3-uniform | q36-22.3-locality (q36-22.3 under each trace) | serve-q30 |
# serve-q36 (bench/serve_bench.py against `ferry serve`; SERVE_BENCH_ARGS passes more arguments to it) | agent-q30 |
# agent-q36 (serve_bench.py's agent loop with prefix caching, then with --no-prefix-cache, whose greedy replies must
# be identical) | dsv3x4-profile (ncu's time of each MLA kernel of DeepSeek-V3's shape cut to 4 layers, resident in FP8, at a
# 4K context) | dsv3-10 (DeepSeek-V3's shape cut to its 3 dense + 7 MoE layers, in FP8 as DeepSeek ships it, dense
# linears and experts: 73.5 GiB of the full model's 650 GB bank, which does not fit the host's 128 GB) | glm45air-fp8
# (GLM-4.5-Air's shape in FP8 likewise: a 97 GiB bank), both under the uniform and the locality trace | q30-fp8 (issue 18: q30 in BF16
# and in FP8 as Qwen's FP8 release stores it, dense linears and experts, at 22.3 GiB under one uniform trace, then
# both all resident) | q30-fp8-resident (the last alone) | gptoss120-22.3 |
# gptoss120-15.8 (gpt-oss-120b's shape, MXFP4 experts, under both traces with --moe-strategy offload, auto and cpu, or the
# comma-separated GPTOSS_STRATEGIES; -uniform or -locality: one trace). Where a workload names several traces or
# strategies, `ferry bench` measures each in turn on one load (a large model's load costs minutes of device time).
# MOE_STRATEGY=S adds `--moe-strategy S` to every run (bench and serve) and `-S` to the result names, except in the
# lanes and gptoss120 workloads, which set it themselves. GUESS_PRECISION=P adds `--routing-guess-precision P` to
# every run that replays a trace (the offload's next-layer prefetch, guessed P right as a real model's router would)
# and `-guessP` to its result names. Results (JSON and logs) go to $OUT, or /tmp/ferry-bench.
set -uo pipefail
cd "$(dirname "$0")/../.."
scripts/device/unstage.sh
out=${OUT:-/tmp/ferry-bench}
mkdir -p "$out"
ferry=.stage/ferry
q30="--synthetic bench/q30.json --device cuda"
q36="--synthetic bench/q36.json --device cuda"
strategy_args=() suffix=
if [ -n "${MOE_STRATEGY:-}" ]; then
    strategy_args=(--moe-strategy "$MOE_STRATEGY") suffix=-$MOE_STRATEGY
fi
bench() {
    local name=$1$suffix
    shift
    case " $* " in *" --moe-strategy "*) ;; *) set -- "$@" "${strategy_args[@]}" ;; esac
    case " $* " in *" --routing-trace "*)
        if [ -n "${GUESS_PRECISION:-}" ]; then
            set -- "$@" --routing-guess-precision "$GUESS_PRECISION"
            name+=-guess$GUESS_PRECISION
        fi ;;
    esac
    echo "== $name: ferry bench $*"
    "$ferry" bench "$@" --output "$out/$name.json" >"$out/$name.log" 2>&1 || echo "$name failed (rc $?)"
    grep -v INFO "$out/$name.log" | tail -25
}
# Writes the routing traces that ROUTING asks for ("-uniform", "-locality", or "" for both) for the model CONFIG as
# uniform.jsonl and locality.jsonl in $traces (not $out: the device tool brings back 8 files at most), and prints
# their --routing-trace arguments: each is a variant of one load, its results named NAME-uniform and NAME-locality
# when there are both.
traces=$(mktemp -d)
trap 'rm -rf "$traces"' EXIT
traces() {
    local config=$1 routings=${2#-} routing
    for routing in ${routings:-uniform locality}; do
        python3 "bench/${routing}_trace.py" --config "$config" --tokens 8192 --out "$traces/$routing.jsonl" >&2
        printf -- '--routing-trace %s ' "$traces/$routing.jsonl"
    done
}
# The agent loop on a server with prefix caching, then on one without, comparing their replies.
agent() {
    local name=$1$suffix label="$2${MOE_STRATEGY:+, --moe-strategy $MOE_STRATEGY}"
    shift 2
    set -- "$@" "${strategy_args[@]}"
    SERVE_BENCH_ARGS="--workload agent-loop" bench/serve_and_bench.sh "$out/$name.json" "$label" "$@" || return 1
    SERVE_BENCH_ARGS="--workload agent-loop --compare $out/$name.json" \
        bench/serve_and_bench.sh "$out/$name-no-prefix-cache.json" "$label, --no-prefix-cache" "$@" --no-prefix-cache
}
status=0
for workload in "$@"; do
    case $workload in
    q30-resident) bench q30-resident $q30 --decode-tokens 64 ;;
    q30x12-resident) bench q30x12-resident --synthetic bench/q30-12layers.json --device cuda --decode-tokens 64 ;;
    q30x12-launch)
        # Dependent launches against plain ones, alternated twice on one machine (one run's decode speed moves by
        # up to 10 %).
        for run in 1 2; do
            bench "q30x12-resident-$run" --synthetic bench/q30-12layers.json --device cuda --decode-tokens 64
            bench "q30x12-resident-plain-launch-$run" --synthetic bench/q30-12layers.json --device cuda \
                --decode-tokens 64 --no-dependent-launch
        done
        ;;
    q30x12-profile)
        # Where a resident decode step's time goes: every kernel of a 12-layer q30 decoding 6 tokens at a 4K
        # context under ncu (clocks and caches as the GPU has them), summarised per kernel by bench/ncu_summary.py
        # (each decode kernel 72 times: its median is one layer's cost). With NCU_KERNEL=REGEX, ncu's stall,
        # memory and occupancy sections for the first 3 decode launches of the kernels it matches, after.
        ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --print-units base \
            --launch-count 1500 "$ferry" bench --synthetic bench/q30-12layers.json --device cuda --decode-tokens 6 \
            --concurrency 2 >"$out/q30x12-profile.csv" 2>"$out/q30x12-profile.log" || echo "q30x12-profile failed"
        python3 bench/ncu_summary.py "$out/q30x12-profile.csv" --min-launches 70 | tee "$out/q30x12-profile.txt"
        if [ -n "${NCU_KERNEL:-}" ]; then
            ncu --clock-control none --cache-control none --kernel-name "regex:$NCU_KERNEL" --launch-count 3 \
                --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
                --section Occupancy --section LaunchStats --section SchedulerStats \
                "$ferry" bench --synthetic bench/q30-12layers.json --device cuda --decode-tokens 6 --concurrency 2 \
                >"$out/q30x12-profile-sections.txt" 2>>"$out/q30x12-profile.log" || echo "q30x12-profile sections failed"
            grep -v '^==PROF==' "$out/q30x12-profile-sections.txt" | head -400
        fi
        ;;
    dsv3x4-profile)
        # MLA's kernels under ncu (those alone: a 4K prefill launches thousands of others): DeepSeek-V3's shape cut
        # to 3 dense layers and 1 MoE layer, all resident in FP8, a 4K prompt then 6 decode steps; prefill and decode
        # launches of one kernel differ in grid, so bench/ncu_summary.py keeps them apart (each decode kernel's
        # median is one layer's cost at a 4K context).
        ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --print-units base \
            --kernel-name "regex:mla_|attention_combine" --launch-count 3000 "$ferry" bench \
            --synthetic bench/dsv3-4layers-fp8.json --device cuda --prompt-tokens 4096 --decode-tokens 6 --concurrency 2 >"$out/dsv3x4-profile.csv" \
            2>"$out/dsv3x4-profile.log" || echo "dsv3x4-profile failed"
        python3 bench/ncu_summary.py "$out/dsv3x4-profile.csv" --min-launches 6 | tee "$out/dsv3x4-profile.txt"
        ;;
    q30x12-lanes)
        bench q30x12-10GiB-384 --synthetic bench/q30-12layers.json --device cuda --gpu-memory-budget 10GiB \
            --moe-cache-slots 384 --kv-reserve-tokens 16384 --decode-tokens 32 --prompt-tokens 75 \
            $(traces bench/q30-12layers.json "") --moe-strategy "${LANE_STRATEGIES:-auto,offload,hybrid}"
        ;;
    q30-1536)
        bench q30-22.3GiB-1536 $q30 --gpu-memory-budget 22.3GiB --moe-cache-slots 1536 --kv-reserve-tokens 16384 \
            --decode-tokens 64
        ;;
    q30-1536-uniform | q30-1536-locality)
        routing=${workload#q30-1536-}
        python3 "bench/${routing}_trace.py" --config bench/q30.json --tokens 8192 --out "$out/q30-$routing.jsonl"
        bench "q30-22.3GiB-1536-$routing" $q30 --gpu-memory-budget 22.3GiB --moe-cache-slots 1536 \
            --kv-reserve-tokens 16384 --decode-tokens 32 --routing-trace "$out/q30-$routing.jsonl"
        rm -f "$out/q30-$routing.jsonl"
        ;;
    q30-1536-lanes | q30-1536-lanes-uniform | q30-1536-lanes-locality)
        # The CPU lane (issue 13) beside the link alone: --moe-strategy auto (the split on rates calibrated as it
        # runs), offload and hybrid (the startup rates alone), with a 75-token prompt (its time to first token is
        # the issue's third target), each trace and strategy in turn on one load.
        # 128 decode steps: auto's guard spends its first 12 at each batch size measuring its three regimes.
        routing=${workload#q30-1536-lanes}
        bench "q30-22.3GiB-1536$routing" $q30 --gpu-memory-budget 22.3GiB --moe-cache-slots 1536 \
            --kv-reserve-tokens 16384 --decode-tokens 128 --prompt-tokens 75 $(traces bench/q30.json "$routing") \
            --moe-strategy "${LANE_STRATEGIES:-auto,offload,hybrid}"
        ;;
    q30-fp8)
        python3 bench/uniform_trace.py --config bench/q30.json --tokens 8192 --out "$out/q30-uniform.jsonl"
        for model in q30 q30-fp8; do
            bench "$model-22.3GiB-uniform" --synthetic "bench/$model.json" --device cuda --gpu-memory-budget 22.3GiB \
                --kv-reserve-tokens 16384 --decode-tokens 32 --routing-trace "$out/q30-uniform.jsonl"
        done
        rm -f "$out/q30-uniform.jsonl"
        bench q30-resident $q30 --decode-tokens 64
        bench q30-fp8-resident --synthetic bench/q30-fp8.json --device cuda --decode-tokens 64
        ;;
    q30-fp8-resident) bench q30-fp8-resident --synthetic bench/q30-fp8.json --device cuda --decode-tokens 64 ;;
    gptoss120-22.3 | gptoss120-22.3-uniform | gptoss120-22.3-locality | gptoss120-15.8 | gptoss120-15.8-uniform | \
        gptoss120-15.8-locality)
        spec=${workload#gptoss120-}
        budget=${spec%%-*}GiB routing=${spec#"${spec%%-*}"}
        bench "gptoss120-$budget$routing" --synthetic bench/gptoss120.json --device cuda --gpu-memory-budget "$budget" \
            --kv-reserve-tokens 16384 --decode-tokens 32 $(traces bench/gptoss120.json "$routing") \
            --moe-strategy "${GPTOSS_STRATEGIES:-offload,auto,cpu}"
        ;;
    q30-15.8) bench q30-15.8GiB $q30 --gpu-memory-budget 15.8GiB --decode-tokens 64 ;;
    q36-22.3 | q36-15.8)
        budget=${workload#q36-}GiB
        bench "q36-$budget" $q36 --gpu-memory-budget "$budget" --kv-reserve-tokens 33000 --decode-tokens 32 \
            --long-prompt-tokens 32768
        ;;
    q36-22.3-uniform | q36-22.3-locality)
        routing=${workload#q36-22.3-}
        python3 "bench/${routing}_trace.py" --config bench/q36.json --tokens 8192 --out "$out/q36-$routing.jsonl"
        bench "q36-22.3GiB-$routing" $q36 --gpu-memory-budget 22.3GiB --kv-reserve-tokens 33000 --decode-tokens 32 \
            --long-prompt-tokens 32768 --routing-trace "$out/q36-$routing.jsonl"
        rm -f "$out/q36-$routing.jsonl"
        ;;
    serve-q30)
        bench/serve_and_bench.sh "$out/serve-q30-22.3GiB.json" "H200, q30, --gpu-memory-budget 22.3GiB" \
            $q30 --tokenizer tests/fixtures/qwen3_moe --gpu-memory-budget 22.3GiB --kv-reserve-tokens 16384 ;;
    serve-q36)
        # KV for a 32K-token request, so that SERVE_BENCH_ARGS="--prefill-tokens 32768" can measure one.
        bench/serve_and_bench.sh "$out/serve-q36-15.8GiB.json" "H200, q36, --gpu-memory-budget 15.8GiB" \
            $q36 --tokenizer tests/fixtures/qwen3_5_moe --gpu-memory-budget 15.8GiB --kv-reserve-tokens 33000 \
            --max-model-len 33000 ;;
    agent-q30)
        agent agent-q30-22.3GiB "H200, q30, --gpu-memory-budget 22.3GiB" $q30 --tokenizer tests/fixtures/qwen3_moe \
            --gpu-memory-budget 22.3GiB --kv-reserve-tokens 16384 || status=1 ;;
    agent-q36)
        agent agent-q36-15.8GiB "H200, q36, --gpu-memory-budget 15.8GiB" $q36 --tokenizer tests/fixtures/qwen3_5_moe \
            --gpu-memory-budget 15.8GiB --kv-reserve-tokens 16384 || status=1 ;;
    dsv3-10)
        bench dsv3-10layers-fp8-22.3GiB --synthetic bench/dsv3-10layers-fp8.json --device cuda \
            --gpu-memory-budget 22.3GiB --kv-reserve-tokens 16384 --decode-tokens 32 --prompt-tokens 4096 \
            $(traces bench/dsv3-10layers.json "")
        ;;
    glm45air-fp8)
        bench glm45air-fp8-22.3GiB --synthetic bench/glm45air-fp8.json --device cuda \
            --gpu-memory-budget 22.3GiB --kv-reserve-tokens 16384 --decode-tokens 32 --prompt-tokens 4096 \
            $(traces bench/glm45air.json "")
        ;;
    *)
        echo "unknown workload $workload" >&2
        status=1
        ;;
    esac
done
exit $status

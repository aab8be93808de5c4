#!/usr/bin/env bash
# Builds, here, what the GPU machine runs (it has no cargo): the release `ferry` binary and the release test
# binaries, copied into .stage/ (git-ignored). Carry `.stage` to the GPU machine and run
# scripts/device/gpu-tests.sh there (docs/gpu-testing.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .cuda-toolchain/nvidia/cu13/bin/nvcc ] || command -v nvcc >/dev/null || scripts/install-cuda-toolchain.sh
cargo build --release -p ferry-cli
rm -rf .stage && mkdir -p .stage/tests
cp target/release/ferry .stage/
cargo test --release --workspace --no-run --message-format=json 2>/dev/null | python3 -c '
import json, os, shutil, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["profile"]["test"]:
        package = msg["package_id"].split("#")[0].rsplit("/", 1)[-1]
        shutil.copy(msg["executable"], os.path.join(".stage/tests", package + "-" + msg["target"]["name"]))
'
# Only test binaries with GPU tests travel, without debug info: the device tool carries 64 MiB at most.
for test in .stage/tests/*; do
    listed=$("$test" --list --ignored 2>/dev/null || true)
    grep -q ': test$' <<<"$listed" || rm "$test"
done
strip --strip-debug .stage/ferry .stage/tests/*
du -sh .stage/ferry .stage/tests/*
# The binaries together outgrow what the device tool carries beside the tree (64 MiB): they travel as one xz
# archive, which gpu-tests.sh and bench.sh unpack (scripts/device/unstage.sh) before they run anything.
(cd .stage && tar cf - ferry tests | xz -T0 -6 >stage.tar.xz && rm -rf ferry tests)
du -sh .stage/stage.tar.xz

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
cargo test --release --workspace --no-run --message-format=json 2>/dev/null \
    | python3 -c '
import json, shutil, sys, os
for line in sys.stdin:
    msg = json.loads(line)
    exe = msg.get("executable")
    if msg.get("reason") == "compiler-artifact" and exe and msg.get("profile", {}).get("test"):
        name = msg["target"]["name"]
        shutil.copy(exe, os.path.join(".stage/tests", f"{msg[\"package_id\"].split(\"#\")[0].split(\"/\")[-1]}-{name}"))
'
ls -la .stage .stage/tests

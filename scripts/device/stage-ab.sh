#!/usr/bin/env bash
# Builds, here, the release `ferry` binary of the current tree as an A/B candidate for scripts/device/ab.sh:
# stripped and xz-packed into .stage/ab/NAME.xz (about 8 MB, so two candidates travel beside the staged binaries
# within the device tool's 64 MiB). Build the baseline with scripts/device/stage.sh (or a candidate of its own),
# then change the tree and run this; carry `.stage` to the GPU machine.
#   scripts/device/stage-ab.sh NAME
set -euo pipefail
cd "$(dirname "$0")/../.."
name=${1:?usage: scripts/device/stage-ab.sh NAME}
[ -x .cuda-toolchain/nvidia/cu13/bin/nvcc ] || command -v nvcc >/dev/null || scripts/install-cuda-toolchain.sh
cargo build --release -p ferry-cli
mkdir -p .stage/ab
strip --strip-debug target/release/ferry -o ".stage/ab/$name"
xz -T0 -6 -f ".stage/ab/$name"
du -sh ".stage/ab/$name.xz"

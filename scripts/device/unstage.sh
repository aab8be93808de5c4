#!/usr/bin/env bash
# Unpacks, on the GPU machine, what scripts/device/stage.sh packed (.stage/stage.tar.xz), once; gpu-tests.sh and
# bench.sh call it first.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -f .stage/stage.tar.xz ]; then
    (cd .stage && tar xJf stage.tar.xz && rm stage.tar.xz)
fi

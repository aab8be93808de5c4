#!/usr/bin/env bash
# Installs nvcc 13.0 from PyPI into .cuda-toolchain/ (git-ignored), so ferry's kernels build on any machine
# without a system CUDA install. It downloads about 270 MB. Every part is pinned: left unpinned, pip mixes in 13.x
# parts whose PTX the 580 driver refuses. The kernels crate's build.rs finds nvcc there; see docs/gpu-testing.md.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.cuda-toolchain
echo "install-cuda-toolchain: downloading nvcc 13.0 from PyPI (about 270 MB) into $dest" >&2
python3 -m pip install --quiet --disable-pip-version-check --target "$dest" \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
nvcc=$(find "$dest" -type f -name nvcc -path '*/bin/*' | head -n 1)
[ -n "$nvcc" ] || { echo "install-cuda-toolchain: nvcc not found under $dest" >&2; exit 1; }
chmod +x "$nvcc"
"$nvcc" --version | tail -n 2
echo "nvcc installed at $nvcc"

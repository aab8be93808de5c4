#!/usr/bin/env bash
# ferry's test suite, as CI runs it (.ci/run calls this script): formatting, lints, every Rust test, then the
# official `openai` and `anthropic` Python packages as clients of `ferry serve` (installed from PyPI into .venv-ci).
# Runs on a machine without a GPU; GPU tests live in scripts/device/.
set -euo pipefail
cd "$(dirname "$0")/.."

# The CUDA kernels are compiled in every build (a kernel that does not compile fails CI); nvcc comes from PyPI.
command -v nvcc >/dev/null || [ -x .cuda-toolchain/nvidia/cu13/bin/nvcc ] || scripts/install-cuda-toolchain.sh

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace

# `cargo test` built the ferry binary for the CLI's integration tests; the SDK test runs that same binary.
if [ ! -x .venv-ci/bin/python ]; then
    python3 -m venv .venv-ci
fi
.venv-ci/bin/python -m pip install --quiet --disable-pip-version-check "openai==3.51.0" "anthropic==2.15.0" "tokenizers==0.23.3"
.venv-ci/bin/python scripts/openai_client_test.py "${CARGO_TARGET_DIR:-target}/debug/ferry"
.venv-ci/bin/python scripts/anthropic_client_test.py "${CARGO_TARGET_DIR:-target}/debug/ferry"

#!/usr/bin/env bash
# ferry's test suite, as CI runs it (.ci/run calls this script): formatting, lints, then every test.
# Runs on a machine without a GPU; GPU tests live in scripts/device/.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace

#!/usr/bin/env bash
# The GPU tests: every CUDA kernel against the CPU reference, and SmolLM2 on CUDA against
# transformers (the default model must be in $AXIOM_CACHE or the default cache). On a machine
# with an NVIDIA GPU and CUDA 12/13 libraries:
#
#     scripts/cuda_device_tests.sh
#
# From a machine without a GPU, build here and carry the binary: `cargo test --release --test cuda
# --no-run` prints its path; run it there with `--ignored` from crates/axiom.
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec cargo test --release --test cuda -- --ignored --test-threads 1 "$@"

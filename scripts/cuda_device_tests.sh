#!/usr/bin/env bash
# The GPU tests: every CUDA kernel against the CPU reference, SmolLM2 on CUDA against
# transformers (the default model must be in $AXIOM_CACHE or the default cache), then the same
# requests served alone and together, chunked and cached, giving the same answers under
# `--deterministic` (scripts/reproducible.py). On a machine with an NVIDIA GPU and CUDA 12/13 libraries:
#
#     scripts/cuda_device_tests.sh
#
# From a machine without a GPU, build here and carry the binaries: `cargo test --release --test cuda
# --no-run` prints the test's path; run it there with `--ignored` from crates/axiom, and the
# script with `--axiom` naming the carried `axiom`.
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NCCL for the tensor-parallel tests: pip's nvidia-nccl-cu13 ships libnccl.so.2, which cudarc
# loads by the name libnccl.so.
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib"))' 2>/dev/null || true)
if [ -n "$nccl" ] && [ -e "$nccl/libnccl.so.2" ]; then
    mkdir -p target/nccl && ln -sf "$nccl/libnccl.so.2" target/nccl/libnccl.so
    export LD_LIBRARY_PATH="$PWD/target/nccl:$LD_LIBRARY_PATH"
fi
cargo test --release --test cuda -- --ignored --test-threads 1 "$@"
cargo build --release --quiet -p axiom-cli
python3 scripts/reproducible.py --axiom target/release/axiom --backend cuda --requests 16 --max-tokens 96 \
    -- --deterministic

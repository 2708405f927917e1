#!/usr/bin/env bash
# The serving load test on a GPU with the Llama-3-8B-shaped bf16 model of random weights
# (written by bench_cuda_8b.py): 1, 8 and 32 concurrent streams, 128-token prompts and
# 128 generated tokens per request. Usage: scripts/load_test_8b.sh AXIOM_BINARY [OUT.json]
set -euo pipefail
cd "$(dirname "$0")/.."
axiom=$1
out=${2:-load_8b.json}
model=${MODEL_DIR:-/tmp}/llama3-8b-shaped-bf16.gguf
[ -f "$model" ] || python3 -c "import sys; sys.path.insert(0, 'scripts'); import bench_cuda_8b as b; b.write_gguf('$model', 'bf16')"
python3 scripts/load_test.py --axiom "$axiom" --model "$model" --backend cuda --concurrency 1,8,32 \
    --requests 2 --prompt-tokens 128 --max-tokens 128 --json "$out" -- --kv-memory 0.5

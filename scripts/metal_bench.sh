#!/usr/bin/env bash
# The Metal backend's speed on a Mac, beside llama.cpp's: `axiom bench --backend metal` on
# Llama-2-7B Q4_0, prompt processing of 512 tokens (pp512, the tiled matmul) and generation of 128
# (tg128, the row matmul), printed next to llama.cpp's Metal figures for an M4 (10-core GPU) from
# its public Apple Silicon benchmark discussion (github.com/ggml-org/llama.cpp/discussions/4167).
# Those were measured on an M4: on another chip the comparison only gives the order of magnitude.
#
#     scripts/metal_bench.sh LLAMA-2-7B-Q4_0.gguf [REPETITIONS]
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(uname -s)" = Darwin ] || { echo "the Metal backend runs on macOS only" >&2; exit 1; }
model=${1:?usage: scripts/metal_bench.sh LLAMA-2-7B-Q4_0.gguf [REPETITIONS]}
[ -f "$model" ] || { echo "no model file at $model" >&2; exit 1; }
reps=${2:-3}
cargo build --release --quiet -p axiom-cli
target/release/axiom bench -m "$model" --backend metal -p 512 -n 128 -r "$reps" --json >"${TMPDIR:-/tmp}/axiom_metal_bench.json"
python3 - "${TMPDIR:-/tmp}/axiom_metal_bench.json" <<'PY'
import json, sys
llama_cpp_m4 = {"pp512": 221.0, "tg128": 24.0}  # Llama-2-7B Q4_0, llama.cpp Metal, M4
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
if rows and "Q4_0" not in rows[0]["model"]:
    print(f"note: the llama.cpp figures are for Llama-2-7B Q4_0; this model is {rows[0]['model']}")
print(f"{rows[0]['backend']}, {rows[0]['model']}")
print("| test | axiom t/s | llama.cpp M4 t/s | axiom / llama.cpp |")
print("| --- | ---: | ---: | ---: |")
for r in rows:
    ref = llama_cpp_m4[r["test"]]
    print(f"| {r['test']} | {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} | {ref:.0f} | {r['avg_ts'] / ref:.2f} |")
PY

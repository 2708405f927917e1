#!/usr/bin/env bash
# axiom binaries compared on CUDA in one run: each in turn, two rounds, on the 8B-shaped models of
# scripts/bench_cuda_8b.py (types as its --types) or, for a type named moe_TYPE, the
# Qwen3-30B-A3B-shaped mixture of scripts/bench_cuda_moe.py, so that the spread between machines
# and calls stays out of the comparison. On the GPU machine, with the binaries built elsewhere and
# carried:
#
#     scripts/cuda_ab.sh "q8_0 q4_k moe_q4_k" base/axiom new/axiom
#
# AB_ARGS sets what `axiom bench` measures (default "-p 0 -n 64 -r 2", decode; for prefill e.g.
# "-p 2048 -n 0 -r 3 --ubatch-size 2048"). The models are written once into AB_DIR (default /root).
set -euo pipefail
types=$1
shift
bins=()
for bin in "$@"; do bins+=("$(realpath "$bin")"); done
cd "$(dirname "$0")"
dir=${AB_DIR:-/root}
read -r -a args <<< "${AB_ARGS:--p 0 -n 64 -r 2}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for ty in $types; do
    model="$dir/$ty.gguf"
    case $ty in
        moe_*) writer="import bench_cuda_moe as b; b.write_gguf('$model', '${ty#moe_}')" ;;
        *) writer="import bench_cuda_8b as b; b.write_gguf('$model', '$ty')" ;;
    esac
    [ -f "$model" ] || python3 -c "$writer" > /dev/null
    for round in 1 2; do
        for bin in "${bins[@]}"; do
            figures=$("$bin" bench --backend cuda -m "$model" "${args[@]}" 2>&1 |
                grep -E '^\| .*(pp|tg)[0-9]|rror' | cut -d'|' -f7,8 | tr '\n' ' ' || true)
            echo "$ty, round $round, $bin: $figures"
        done
    done
done

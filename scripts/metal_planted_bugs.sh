#!/usr/bin/env bash
# Shows that the two Linux checks of the Metal backend catch real bugs: each bug below is
# planted in a copy, and the check must then fail (this script fails if one is not caught).
#
#   MSL run on the CPU (crates/metal-on-cpu, tests/kernels.rs):
#     - a missing barrier between levels of attention_pv's tree reduction
#     - a missing barrier in rms_norm between writing and summing the simdgroups' partial sums
#     - attention_qk's causal mask off by one (position p + 1 visible), and its window's
#     - the fused attention ignoring the window
#     - the tiled matmul's edge off by one (the last row of a partial tile of rows staged as zeros)
#   The same run under ThreadSanitizer (AXIOM_MSL_TSAN=1), on the quick kernels with threadgroup
#   memory and one tile of the tiled matmul (under TSan every GPU thread is still an OS thread:
#   the attention tests and the tiled matmul's every type take many minutes):
#     - clean as written, then the missing barrier in rms_norm reported as a data race
#     - a tiled matmul whose simdgroups read the staged tiles without waiting at the barrier
#   Type-check (scripts/metal_check.sh):
#     - a usize passed where a kernel's u32 argument goes
#     - a Metal method called with the wrong argument type
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

# replace FILE OLD NEW: OLD must occur exactly once in FILE.
replace() {
    python3 - "$@" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
assert text.count(old) == 1, f"{old!r} does not occur exactly once in {path}"
open(path, "w").write(text.replace(old, new))
PY
}

expect_failure() {
    local what=$1
    shift
    if "$@" >"$work/log" 2>&1; then
        echo "NOT CAUGHT: $what"
        failures=$((failures + 1))
    else
        echo "caught: $what -- $(grep -m1 -E 'panicked at|^error(\[E[0-9]+\])?:|relative error|must be|SUMMARY: ThreadSanitizer' "$work/log" | head -c 200)"
    fi
}

# kernel_tests [ENV...]: the MSL tests, with the environment given.
kernel_tests() {
    env "$@" cargo test --release --quiet -p metal-on-cpu --test kernels
}

# tsan_tests [ENV...]: the quick kernels with threadgroup memory, under ThreadSanitizer.
tsan_tests() {
    env AXIOM_MSL_TSAN=1 TSAN_OPTIONS="suppressions=$root/crates/metal-on-cpu/tsan.supp halt_on_error=1 exitcode=66" \
        "$@" cargo test --release --quiet -p metal-on-cpu --test kernels -- --test-threads 1 rms_norm argmax matmul_tiled_one_partial_tile
}

# plant_kernel WHAT FILE OLD NEW [RUNNER]: the tests must fail on the altered kernels.
plant_kernel() {
    local what=$1 file=$2 old=$3 new=$4 runner=${5:-kernel_tests}
    rm -rf "$work/kernels"
    cp -r crates/axiom/src/backend/metal/kernels "$work/kernels"
    replace "$work/kernels/$file" "$old" "$new"
    expect_failure "$what" "$runner" AXIOM_METAL_KERNELS="$work/kernels"
}

plant_kernel "missing barrier in attention_pv's reduction" attention_pv.metal \
    "        if (tid < stride) scratch[tid] = max(scratch[tid], scratch[tid + stride]);
        threadgroup_barrier(mem_flags::mem_threadgroup);" \
    "        if (tid < stride) scratch[tid] = max(scratch[tid], scratch[tid + stride]);"
plant_kernel "missing barrier in rms_norm" rms_norm.metal \
    "    if (lane == 0) partial[simd] = sum;
    threadgroup_barrier(mem_flags::mem_threadgroup);" \
    "    if (lane == 0) partial[simd] = sum;"
plant_kernel "causal mask off by one in attention_qk" attention_qk.metal \
    "if (p <= pos && " "if (p <= pos + 1 && "
plant_kernel "window off by one in attention_qk" attention_qk.metal \
    "pos - p < window" "pos - p <= window"
plant_kernel "window ignored by the fused attention" attention.metal \
    "lo = window > 0 && n_ctx > window ? n_ctx - window : 0;" "lo = 0;"
plant_kernel "the tiled matmul's row edge off by one" matmul_tiled.metal \
    "if (o0 + r < n_out && k < n_in) {" "if (o0 + r + 1 < n_out && k < n_in) {"

if tsan_tests >"$work/log" 2>&1; then
    echo "clean under ThreadSanitizer: rms_norm, argmax, one tile of matmul_tiled"
else
    echo "the kernels race under ThreadSanitizer:" && cat "$work/log"
    failures=$((failures + 1))
fi
plant_kernel "missing barrier in rms_norm, under ThreadSanitizer" rms_norm.metal \
    "    if (lane == 0) partial[simd] = sum;
    threadgroup_barrier(mem_flags::mem_threadgroup);" \
    "    if (lane == 0) partial[simd] = sum;" tsan_tests
plant_kernel "the tiled matmul reading its tiles before the barrier, under ThreadSanitizer" matmul_tiled.metal \
    "        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint kk = 0; kk < TILE_K; kk += 8) {" \
    "        for (uint kk = 0; kk < TILE_K; kk += 8) {" tsan_tests

# The type-check plants go into a copy of the workspace's sources.
plant_rust() {
    local what=$1 old=$2 new=$3
    rm -rf "$work/ws"
    mkdir -p "$work/ws"
    git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$work/ws"
    replace "$work/ws/crates/axiom/src/backend/metal/mod.rs" "$old" "$new"
    expect_failure "$what" scripts/metal_check.sh "$work/ws"
}

plant_rust "a usize where a kernel takes u32" "                u32_arg(kv_width)," "                Arg::U32(kv_width),"
plant_rust "a wrong argument type to setBuffer:offset:atIndex:" \
    "encoder.setBuffer_offset_atIndex(Some(buffer), block.offset, index)" \
    "encoder.setBuffer_offset_atIndex(Some(buffer), block, index)"

if [ "$failures" -gt 0 ]; then
    echo "$failures planted bug(s) went unnoticed" >&2
    exit 1
fi
echo "every planted bug was caught"

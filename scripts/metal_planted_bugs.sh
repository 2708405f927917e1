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
#     - the prompt attention's key tile edge off by one (a sequence's last position staged as zeros)
#     - the router passing over experts tied with the one it chose last
#     - E4M3 decoded with exponent bias 8, its subnormals at twice their value, and the negative
#       NaN code (0xff) decoded as a number
#   The same run under ThreadSanitizer (AXIOM_MSL_TSAN=1), on the quick kernels with threadgroup
#   memory and one tile of the tiled matmul and of the prompt attention (under TSan every GPU
#   thread is still an OS thread: the other attention tests and the tiled matmul's every type
#   take many minutes):
#     - clean as written, then the missing barrier in rms_norm reported as a data race
#     - a tiled matmul whose simdgroups read the staged tiles without waiting at the barrier
#     - a prompt attention that stages the values over keys other simdgroups still read
#   Each plant runs the one test (one score rule, one cache type) that catches it: the kernels are
#   rebuilt for every plant, and the whole suite would take most of the time.
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

# kernel_tests ENV TEST...: the MSL tests named (exactly), with the environment given.
kernel_tests() {
    local env=$1
    shift
    env $env cargo test --release --quiet -p metal-on-cpu --test kernels -- --exact "$@"
}

# tsan_tests ENV TEST...: as kernel_tests, under ThreadSanitizer.
tsan_tests() {
    local env=$1
    shift
    env AXIOM_MSL_TSAN=1 TSAN_OPTIONS="suppressions=$root/crates/metal-on-cpu/tsan.supp halt_on_error=1 exitcode=66" \
        $env cargo test --release --quiet -p metal-on-cpu --test kernels -- --test-threads 1 --exact "$@"
}

# The quick kernels with threadgroup memory, and one tile of each tiled kernel.
tsan_quick=(rms_norm_matches_the_reference argmax_takes_the_first_of_equal_maxima
    matmul_tiled_one_partial_tile_matches_the_reference flash_attention_one_partial_tile_matches_the_reference)

# plant_kernel WHAT FILE OLD NEW RUNNER TEST: the test must fail on the altered kernels.
plant_kernel() {
    local what=$1 file=$2 old=$3 new=$4 runner=$5 test=$6
    rm -rf "$work/kernels"
    cp -r crates/axiom/src/backend/metal/kernels "$work/kernels"
    replace "$work/kernels/$file" "$old" "$new"
    expect_failure "$what" "$runner" AXIOM_METAL_KERNELS="$work/kernels" "$test"
}

plant_kernel "missing barrier in attention_pv's reduction" attention_pv.metal \
    "        if (tid < stride) scratch[tid] = max(scratch[tid], scratch[tid + stride]);
        threadgroup_barrier(mem_flags::mem_threadgroup);" \
    "        if (tid < stride) scratch[tid] = max(scratch[tid], scratch[tid + stride]);" \
    kernel_tests attention_pair::causal::f32_cache
plant_kernel "missing barrier in rms_norm" rms_norm.metal \
    "    if (lane == 0) partial[simd] = sum;
    threadgroup_barrier(mem_flags::mem_threadgroup);" \
    "    if (lane == 0) partial[simd] = sum;" kernel_tests rms_norm_matches_the_reference
plant_kernel "causal mask off by one in attention_qk" attention_qk.metal \
    "if (p <= pos && " "if (p <= pos + 1 && " kernel_tests attention_pair::causal::f32_cache
plant_kernel "window off by one in attention_qk" attention_qk.metal \
    "pos - p < window" "pos - p <= window" kernel_tests attention_pair::window_3::f32_cache
plant_kernel "window ignored by the fused attention" attention.metal \
    "lo = window > 0 && n_ctx > window ? n_ctx - window : 0;" "lo = 0;" \
    kernel_tests fused_attention::window_3::f32_cache
plant_kernel "the tiled matmul's row edge off by one" matmul_tiled.metal \
    "if (o0 + r < n_out && k < n_in) {" "if (o0 + r + 1 < n_out && k < n_in) {" \
    kernel_tests matmul_tiled_one_partial_tile_matches_the_reference
plant_kernel "the prompt attention's key tile edge off by one" flash_attention.metal \
    "p <= hi && d < head_dim ? kv_load(k_cache" "p < hi && d < head_dim ? kv_load(k_cache" \
    kernel_tests flash_attention_one_partial_tile_matches_the_reference
plant_kernel "the router passing over experts tied with its last choice" route.metal \
    "bool after = p < last_p || (p == last_p && e > last_e);" "bool after = p < last_p;" \
    kernel_tests route_matches_the_reference_with_ties
plant_kernel "E4M3 decoded with exponent bias 8" common.metal \
    "((exponent + 127 - 7) << 23)" "((exponent + 127 - 8) << 23)" kernel_tests fp8_every_e4m3_code_decodes_exactly
plant_kernel "E4M3's negative NaN code decoded as a number" common.metal \
    "(code & 0x7f) == 0x7f ? 0x7fc00000u" "code == 0x7f ? 0x7fc00000u" kernel_tests fp8_every_e4m3_code_decodes_exactly
plant_kernel "E4M3's subnormals at twice their value" common.metal \
    "float(mantissa) * (1.0f / 512.0f)" "float(mantissa) * (1.0f / 256.0f)" kernel_tests fp8_every_e4m3_code_decodes_exactly

if tsan_tests "" "${tsan_quick[@]}" >"$work/log" 2>&1; then
    echo "clean under ThreadSanitizer: rms_norm, argmax, one tile of matmul_tiled and of flash_attention"
else
    echo "the kernels race under ThreadSanitizer:" && cat "$work/log"
    failures=$((failures + 1))
fi
plant_kernel "missing barrier in rms_norm, under ThreadSanitizer" rms_norm.metal \
    "    if (lane == 0) partial[simd] = sum;
    threadgroup_barrier(mem_flags::mem_threadgroup);" \
    "    if (lane == 0) partial[simd] = sum;" tsan_tests rms_norm_matches_the_reference
plant_kernel "the tiled matmul reading its tiles before the barrier, under ThreadSanitizer" matmul_tiled.metal \
    "        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint kk = 0; kk < TILE_K; kk += 8) {" \
    "        for (uint kk = 0; kk < TILE_K; kk += 8) {" tsan_tests matmul_tiled_one_partial_tile_matches_the_reference
plant_kernel "the prompt attention staging values over keys still read, under ThreadSanitizer" \
    flash_attention.metal "            threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done with the keys
" "" tsan_tests flash_attention_one_partial_tile_matches_the_reference

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

#!/usr/bin/env bash
# Fuzzing with cargo-fuzz (libFuzzer). `scripts/fuzz.sh smoke [SECONDS]` runs every target
# briefly (CI); `scripts/fuzz.sh campaign [SECONDS]` runs each for longer (default 30 minutes).
# Each target starts from fuzz/seeds/<target> plus its working corpus in fuzz/corpus/<target>
# (not committed). A crash lands in fuzz/artifacts/<target>/: copy it into
# fuzz/regressions/<target>/, where `cargo test` replays it from then on.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
mode=${1:-smoke}
seconds=${2:-$([ "$mode" = campaign ] && echo 1800 || echo 20)}
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
# cargo-fuzz passes nightly-only flags (the sanitizer coverage passes); the stable compiler
# accepts them under RUSTC_BOOTSTRAP.
export RUSTC_BOOTSTRAP=1
cargo fuzz build -O
for target in gguf safetensors chat_template tokenizer request; do
    mkdir -p "corpus/$target"
    echo "== $target, ${seconds}s"
    status=0
    cargo fuzz run -O "$target" "corpus/$target" "seeds/$target" "regressions/$target" -- \
        -max_total_time="$seconds" -max_len=1048576 -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        >"artifacts-$target.log" 2>&1 || status=$?
    grep -E "^(Done|stat::number_of_executed_units|stat::peak_rss_mb)|ERROR|panicked|deadly signal|left:|right:" \
        "artifacts-$target.log" || true
    if [ "$status" -ne 0 ] || ls "artifacts/$target"/crash-* "artifacts/$target"/timeout-* "artifacts/$target"/oom-* >/dev/null 2>&1; then
        echo "fuzz target $target found a failure: see fuzz/artifacts/$target" >&2
        exit 1
    fi
done

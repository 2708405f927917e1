#!/usr/bin/env bash
# Type-checks the Metal backend (and the CLI's use of it) on a machine that is not a Mac.
#
# objc2 refuses non-Apple targets unless it targets GNUstep's Objective-C runtime, and
# objc2-metal links the Metal framework, which only Apple targets have (error E0455). So this
# checks with `--cfg axiom_metal_check` (which gives objc2 its gnustep-2-1 feature, see
# crates/axiom/Cargo.toml) against a copy of objc2-metal whose link attribute is made
# conditional on Apple targets, in a target directory of its own. It catches wrong method names,
# argument types, missing `unsafe`, Send/Sync mistakes; it cannot link or run anything.
#
#     scripts/metal_check.sh [WORKSPACE]     (default: this repository)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
workspace=$(cd "${1:-$root}" && pwd)
target=$root/target/metal-check
mkdir -p "$target"

version=$(grep -A1 '^name = "objc2-metal"$' "$workspace/Cargo.lock" | sed -n 's/^version = "\(.*\)"$/\1/p')
[ -n "$version" ] || { echo "objc2-metal is not in Cargo.lock" >&2; exit 1; }
(cd "$workspace" && cargo fetch --quiet)
src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"objc2-metal-$version" | head -1)
patched=$target/objc2-metal-$version
if [ ! -d "$patched" ]; then
    cp -r "$src" "$patched.tmp"
    sed -i 's/^#\[link(name = "Metal", kind = "framework")\]$/#[cfg_attr(target_vendor = "apple", link(name = "Metal", kind = "framework"))]/' \
        "$patched.tmp/src/generated/mod.rs"
    grep -q '^#\[cfg_attr(target_vendor = "apple", link(name = "Metal"' "$patched.tmp/src/generated/mod.rs" ||
        { echo "objc2-metal $version: the link attribute to patch was not found" >&2; exit 1; }
    mv "$patched.tmp" "$patched"
fi

# The patch rewrites Cargo.lock's entry for objc2-metal; the workspace's own lock stays as it was.
cp "$workspace/Cargo.lock" "$target/Cargo.lock.saved"
trap 'cp "$target/Cargo.lock.saved" "$workspace/Cargo.lock"' EXIT
cd "$workspace"
RUSTFLAGS="--cfg axiom_metal_check" cargo check --quiet --target-dir "$target" \
    --config "patch.crates-io.objc2-metal.path=\"$patched\"" \
    -p axiom -p axiom-cli --lib --bins --tests
echo "Metal backend type-checks (objc2-metal $version, GNUstep runtime, not linked)"

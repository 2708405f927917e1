#!/usr/bin/env bash
# The test suite, as CI runs it. Installs NVRTC from PyPI if it is missing (the CUDA kernels are
# compiled by it in a test; no GPU is needed for that), then runs every default test.
# The GPU tests are separate: scripts/cuda_device_tests.sh, on a machine with an NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
nvrtc_dir() {
    python3 - <<'PY' 2>/dev/null
import glob, os, nvidia
for root in nvidia.__path__:
    for lib in glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")):
        print(os.path.dirname(lib)); raise SystemExit
raise SystemExit(1)
PY
}
dir=$(nvrtc_dir) || { python3 -m pip install --quiet --disable-pip-version-check nvidia-cuda-nvrtc && dir=$(nvrtc_dir); }
export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec cargo test --release --workspace "$@"

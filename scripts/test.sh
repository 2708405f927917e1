#!/usr/bin/env bash
# The test suite, as CI runs it. Installs what it needs if missing: g++ (Debian), for the Metal
# kernels run on the CPU, and NVRTC (PyPI), which compiles every CUDA kernel in a test (no GPU is
# needed for that), and huggingface_hub (PyPI). Then it runs every default test.
# Then `axiom serve` is checked through the official OpenAI Python client and LangChain (installed
# if missing),
# against hostile clients, and by a one-minute soak.
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
# The Metal kernels run on the CPU as C++ (crates/metal-on-cpu): a C++ compiler is needed.
command -v c++ >/dev/null || { apt-get update && apt-get install -y g++; }
dir=$(nvrtc_dir) || { python3 -m pip install --quiet --disable-pip-version-check nvidia-cuda-nvrtc && dir=$(nvrtc_dir); }
export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# crates/axiom-cli/tests/hub.rs checks the shared model cache against huggingface_hub's own code.
python3 -c "import huggingface_hub" 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check huggingface_hub
cargo test --release --workspace "$@"
python3 -c "import openai" 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check openai
# LangChain drives the server in test_openai.py as agent frameworks do.
python3 -c "import langchain_openai" 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check langchain-openai
cargo build --release --quiet -p axiom-cli
python3 scripts/test_openai.py target/release/axiom
python3 scripts/test_hardening.py target/release/axiom
python3 scripts/soak.py --axiom target/release/axiom --duration 60

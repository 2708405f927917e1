#!/usr/bin/env python3
"""axiom against llama.cpp on the CPU, side by side: same model, same threads, alternating runs.

Builds llama.cpp's llama-bench and llama-completion from the sources vendored in the PyPI sdist of
llama-cpp-python (into ~/.cache/axiom-bench, once; needs cmake and ninja, e.g. `pip install cmake
ninja scikit-build-core`), then runs A B A B: `axiom bench` and `llama-bench`, one repetition each,
`--runs` times, and prints the medians and ratios for pp512 and tg128 (and both again after
`--depth` tokens of context, as llama-bench's `-d`). Also compares the peak RSS of one generation
run of each (`/usr/bin/time -v`).

    cargo build --release && python3 scripts/bench_cpu_vs_llamacpp.py [--runs 5] [--threads 2] [--depth 2048]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("AXIOM_BENCH_CACHE", Path.home() / ".cache" / "axiom-bench"))
SDIST = "llama-cpp-python==0.3.36"


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw).stdout


def llama_cpp() -> Path:
    """The llama.cpp build directory, building it on first use."""
    build = CACHE / "llama.cpp" / "build"
    if (build / "bin" / "llama-bench").exists() and (build / "bin" / "llama-completion").exists():
        return build
    CACHE.mkdir(parents=True, exist_ok=True)
    sh([sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "--no-binary", ":all:",
        SDIST, "-d", str(CACHE)])
    archive = next(CACHE.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(CACHE, filter="data")
    src = next(CACHE.glob("llama_cpp_python-*/vendor/llama.cpp"))
    (CACHE / "llama.cpp").unlink(missing_ok=True)
    (CACHE / "llama.cpp").symlink_to(src)
    sh(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"])
    print("building llama.cpp (about 10 minutes on 2 cores)...", file=sys.stderr)
    sh(["cmake", "--build", str(build), "--target", "llama-bench", "llama-completion", "-j", str(os.cpu_count())])
    return build


def bench_flags(test, depth):
    """The flags both benches share for one test: ("pp512" or "tg128", depth)."""
    sizes = ["-p", "512", "-n", "0"] if test == "pp512" else ["-p", "0", "-n", "128"]
    return [*sizes, "-d", str(depth)]


def axiom_run(axiom, model, threads, test, depth):
    out = sh([axiom, "bench", "-m", model, "-t", str(threads), "-r", "1", "--json", *bench_flags(test, depth)])
    return json.loads(out.strip().splitlines()[-1])["avg_ts"]


def llama_run(build, model, threads, test, depth):
    out = sh([str(build / "bin" / "llama-bench"), "-m", model, "-t", str(threads), "-r", "1", "-o", "json",
              *bench_flags(test, depth)])
    return json.loads(out)[0]["avg_ts"]


def peak_rss_kib(cmd):
    err = subprocess.run(["/usr/bin/time", "-v", *cmd], text=True, capture_output=True, stdin=subprocess.DEVNULL).stderr
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", err).group(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", help="GGUF (default: axiom's default model)")
    ap.add_argument("--depth", type=int, default=0, help="also run both tests after this many tokens of context")
    args = ap.parse_args()
    axiom = str(ROOT / "target" / "release" / "axiom")
    model = args.model or sh([axiom, "info"]).split("(")[0].split("file:")[1].strip()
    build = llama_cpp()
    print(f"model {model}, {args.threads} threads, {args.runs} alternating runs per test")
    depths = [0, args.depth] if args.depth else [0]
    for test, depth in [(t, d) for d in depths for t in ["pp512", "tg128"]]:
        ours, theirs = [], []
        for _ in range(args.runs):
            ours.append(axiom_run(axiom, model, args.threads, test, depth))
            theirs.append(llama_run(build, model, args.threads, test, depth))
        a, l = statistics.median(ours), statistics.median(theirs)
        name = f"{test} @ d{depth}" if depth else test
        print(f"{name}: axiom {a:7.1f} tok/s  llama.cpp {l:7.1f} tok/s  ratio {a / l:.2f}x"
              f"   (axiom {['%.1f' % x for x in ours]}, llama.cpp {['%.1f' % x for x in theirs]})")
    prompt = "Why is the sky blue?"
    ours = peak_rss_kib([axiom, "run", "-m", model, "-t", str(args.threads), "-n", "128", "--temp", "0", prompt])
    theirs = peak_rss_kib([str(build / "bin" / "llama-completion"), "-m", model, "-t", str(args.threads), "-n", "128",
                           "--temp", "0", "-no-cnv", "-p", prompt])
    print(f"peak RSS, run -n 128: axiom {ours / 1024:.1f} MiB, llama.cpp {theirs / 1024:.1f} MiB")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Throughput and latency of `axiom serve` under concurrent streaming clients, on loopback.

Starts the server, then for each concurrency level runs that many client threads, each
sending `--requests` streaming completions one after another (prompts of random token ids,
greedy, `ignore_eos` so every request generates exactly `--max-tokens`). Reports per level:
aggregate generated tokens per second over the level's wall time, time to first token and
inter-token latency percentiles. Bounded in requests and in time (`--time-limit` per level).
`--json-schema FILE` holds every request's output to that schema (`response_format`), to measure
constrained decoding. Standard library only, so it runs anywhere Python does.

    python3 scripts/load_test.py --axiom target/release/axiom [--model M.gguf] [--backend cpu]
        [--concurrency 1,8,32] [--requests 2] [--prompt-tokens 128] [--max-tokens 64]
        [--json-schema schema.json] [--json out.json]
"""
import argparse
import http.client
import json
import random
import re
import statistics
import subprocess
import threading
import time


def start_server(args):
    cmd = [args.axiom, "serve", "--port", "0", "--max-seqs", str(max(args.levels)), *args.server_args]
    if args.model:
        cmd += ["--model", args.model]
    if args.backend:
        cmd += ["--backend", args.backend]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + args.load_timeout
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit("server exited before listening")
        m = re.search(r"on http://([\d.]+):(\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1), int(m.group(2)), line.strip()
    raise SystemExit("server did not start in time")


def one_request(host, port, prompt, max_tokens, deadline, schema=None):
    """Streams one completion; returns (ttft, [gaps], completion tokens)."""
    conn = http.client.HTTPConnection(host, port, timeout=max(1.0, deadline - time.time()))
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "load", "schema": schema}}
    body = json.dumps(body)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    ttft, last, gaps, tokens = None, None, [], 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        now = time.perf_counter()
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        elif chunk["choices"] and chunk["choices"][0].get("text"):
            if ttft is None:
                ttft = now - start
            else:
                gaps.append(now - last)
            last = now
    conn.close()
    return ttft, gaps, tokens


def run_level(args, host, port, streams):
    rng = random.Random(streams)
    results, errors = [], []
    deadline = time.time() + args.time_limit
    lock = threading.Lock()

    def client():
        for _ in range(args.requests):
            if time.time() > deadline:
                return
            prompt = [rng.randrange(1000, 20000) for _ in range(args.prompt_tokens)]
            try:
                r = one_request(host, port, prompt, args.max_tokens, deadline, args.schema)
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(str(e))

    threads = [threading.Thread(target=client) for _ in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(r[2] for r in results)
    ttfts = sorted(r[0] for r in results if r[0] is not None)
    gaps = sorted(g for r in results for g in r[1])
    pct = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] * 1000 if xs else float("nan")
    return {
        "streams": streams, "requests": len(results), "errors": len(errors), "wall_s": round(wall, 2),
        "generated_tokens": tokens, "throughput_tok_s": round(tokens / wall, 1),
        "per_stream_tok_s": round(1 / statistics.mean(gaps), 1) if gaps else None,
        "ttft_ms_p50": round(pct(ttfts, 0.5), 1), "ttft_ms_p99": round(pct(ttfts, 0.99), 1),
        "itl_ms_p50": round(pct(gaps, 0.5), 2), "itl_ms_p99": round(pct(gaps, 0.99), 2),
        "first_error": errors[0] if errors else None,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--axiom", required=True)
    ap.add_argument("--model")
    ap.add_argument("--backend")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=2, help="requests per client thread")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=120, help="seconds per level")
    ap.add_argument("--load-timeout", type=float, default=300)
    ap.add_argument("--json-schema", help="a JSON schema file every request's output must follow")
    ap.add_argument("--json")
    ap.add_argument("server_args", nargs="*", help="more `axiom serve` arguments (after --)")
    args = ap.parse_args()
    args.levels = [int(c) for c in args.concurrency.split(",")]
    args.schema = None
    if args.json_schema:
        with open(args.json_schema) as f:
            args.schema = json.load(f)
    proc, host, port, banner = start_server(args)
    print(banner)
    rows = []
    try:
        # One short request first so no level pays for warm-up (graph recording, page faults).
        one_request(host, port, [1000] * 8, 4, time.time() + 60)
        for streams in args.levels:
            row = run_level(args, host, port, streams)
            rows.append(row)
            print(json.dumps(row))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print("\n| streams | requests | tok/s (all streams) | tok/s per stream | TTFT p50 / p99 ms | ITL p50 / p99 ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['streams']} | {r['requests']} | {r['throughput_tok_s']} | {r['per_stream_tok_s']} | "
              f"{r['ttft_ms_p50']} / {r['ttft_ms_p99']} | {r['itl_ms_p50']} / {r['itl_ms_p99']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"server": banner, "levels": rows}, f, indent=1)


if __name__ == "__main__":
    main()

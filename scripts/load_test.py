#!/usr/bin/env python3
"""Throughput and latency of `axiom serve` or llama-server under concurrent streaming clients,
on loopback.

Starts the server (`--axiom BIN`, or `--llama-server BIN` with one slot per stream of the largest
level and each slot the context a request needs), then for each concurrency level runs that many
client threads, each
sending `--requests` streaming completions one after another (prompts of random token ids,
greedy, `ignore_eos` so every request generates exactly `--max-tokens`). Reports per level:
aggregate generated tokens per second over the level's wall time, time to first token and
inter-token latency percentiles. Bounded in requests and in time (`--time-limit` per level).
`--json-schema FILE` holds every request's output to that schema (`response_format`), to measure
constrained decoding. `--long-prompt N` measures prompt latency under load: once every stream of a
level has its first token, one request of N prompt tokens joins them; the level then reports
that request's time to first token and the longest gap between two tokens of any stream while
it was prefilled (a level of 0 streams gives the idle server's). Standard library only, so it
runs anywhere Python does.

    python3 scripts/load_test.py --axiom target/release/axiom [--model M.gguf] [--backend cpu]
        [--concurrency 1,8,32] [--requests 2] [--prompt-tokens 128] [--max-tokens 64]
        [--json-schema schema.json] [--long-prompt 7600] [--json out.json] [-- more server arguments]
    python3 scripts/load_test.py --llama-server llama-server --model M.gguf [...] [-- -ngl 99]
"""
import argparse
import http.client
import json
import random
import re
import socket
import statistics
import subprocess
import threading
import time


def start_server(args):
    if args.axiom:
        return start_axiom(args)
    return start_llama_server(args)


def start_axiom(args):
    cmd = [args.axiom, "serve", "--port", "0", "--max-seqs", str(max(1, *args.levels) + (1 if args.long_prompt else 0)), *args.server_args]
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


def start_llama_server(args):
    """llama-server with continuous batching over one slot per stream; ready once /health says so."""
    if not args.model:
        raise SystemExit("--llama-server needs --model")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    slots = max(1, *args.levels) + (1 if args.long_prompt else 0)
    # llama-server divides its context among the slots: each gets what one request needs.
    ctx = slots * (max(args.prompt_tokens, args.long_prompt) + args.max_tokens + 8)
    cmd = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-c", str(ctx), *args.server_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + args.load_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited ({proc.returncode}) before it was ready: {' '.join(cmd)}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, "127.0.0.1", port, f"llama-server on port {port}: {' '.join(cmd)}"
        except OSError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("llama-server did not become ready in time")


def one_request(host, port, prompt, max_tokens, deadline, schema=None, on_first=None):
    """Streams one completion; returns (ttft, [(gap, its end)], completion tokens). Calls on_first
    at its first token."""
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
    ttft, last, gaps, tokens, chunks = None, None, [], None, 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        now = time.perf_counter()
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            chunks += 1
            if ttft is None:
                ttft = now - start
                if on_first:
                    on_first()
            else:
                gaps.append((now - last, now))
            last = now
    conn.close()
    # A server that reports no usage is counted by its streamed pieces, a token each.
    return ttft, gaps, chunks if tokens is None else tokens


def run_level(args, host, port, streams):
    rng = random.Random(streams)
    results, errors = [], []
    deadline = time.time() + args.time_limit
    lock = threading.Lock()

    started = threading.Semaphore(0)
    prompts = [[[rng.randrange(1000, 20000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
               for _ in range(streams)]

    def client(mine):
        first = started.release
        for prompt in mine:
            if time.time() > deadline:
                return
            try:
                r = one_request(host, port, prompt, args.max_tokens, deadline, args.schema, first)
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(str(e))
                started.release()  # no first token will come: the long request must not wait for it
            first = None

    long = {}

    def long_client():
        # Joins once every stream decodes, so that its prefill shares steps with all of them.
        for _ in range(streams):
            started.acquire(timeout=max(0.0, deadline - time.time()))
        prompt = [rng.randrange(1000, 20000) for _ in range(args.long_prompt)]
        long["start"] = time.perf_counter()
        try:
            long["ttft"] = one_request(host, port, prompt, 4, deadline)[0]
        except Exception as e:  # noqa: BLE001 - reported below
            with lock:
                errors.append(f"long prompt: {e}")

    threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
    if args.long_prompt:
        threads.append(threading.Thread(target=long_client))
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(r[2] for r in results)
    ttfts = sorted(r[0] for r in results if r[0] is not None)
    gaps = sorted(g for r in results for g, _ in r[1])
    pct = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] * 1000 if xs else float("nan")
    extra = {}
    if long.get("ttft") is not None:
        # A gap overlaps the prefill if it ends after the request was sent and starts before its
        # first token came.
        end = long["start"] + long["ttft"]
        during = [g for r in results for g, at in r[1] if at > long["start"] and at - g < end]
        extra = {"long_prompt_ttft_ms": round(long["ttft"] * 1000, 1),
                 "itl_ms_max_during_long": round(max(during) * 1000, 2) if during else None}
    return {
        "streams": streams, "requests": len(results), "errors": len(errors), "wall_s": round(wall, 2),
        "generated_tokens": tokens, "throughput_tok_s": round(tokens / wall, 1),
        "per_stream_tok_s": round(1 / statistics.mean(gaps), 1) if gaps else None,
        "ttft_ms_p50": round(pct(ttfts, 0.5), 1), "ttft_ms_p99": round(pct(ttfts, 0.99), 1),
        "itl_ms_p50": round(pct(gaps, 0.5), 2), "itl_ms_p99": round(pct(gaps, 0.99), 2),
        "first_error": errors[0] if errors else None, **extra,
    }


def main():
    ap = argparse.ArgumentParser()
    server = ap.add_mutually_exclusive_group(required=True)
    server.add_argument("--axiom", help="the axiom binary to serve with")
    server.add_argument("--llama-server", help="the llama-server binary to serve with, for comparison")
    ap.add_argument("--model")
    ap.add_argument("--backend")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=2, help="requests per client thread")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=120, help="seconds per level")
    ap.add_argument("--load-timeout", type=float, default=300)
    ap.add_argument("--json-schema", help="a JSON schema file every request's output must follow")
    ap.add_argument("--long-prompt", type=int, default=0,
                    help="prompt tokens of one request sent once each level's streams decode (0: none)")
    ap.add_argument("--json")
    ap.add_argument("server_args", nargs="*", help="more server arguments (after --)")
    args = ap.parse_args()
    if args.llama_server and args.backend:
        ap.error("--backend is axiom's: give llama-server its own flags after --")
    args.levels = [int(c) for c in args.concurrency.split(",")]
    if any(level < 0 for level in args.levels) or (0 in args.levels and not args.long_prompt):
        ap.error("--concurrency takes stream counts of at least 1 (0 only with --long-prompt)")
    if args.long_prompt < 0:
        ap.error("--long-prompt must be a token count")
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
        if args.long_prompt:
            # And one long prompt, so that the first level's does not pay for the large steps' setup.
            warm = random.Random(-1)
            one_request(host, port, [warm.randrange(1000, 20000) for _ in range(args.long_prompt)], 4,
                        time.time() + 120)
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
    if args.long_prompt:
        print(f"\n| streams | TTFT of a {args.long_prompt}-token prompt ms | longest stream gap meanwhile ms |")
        print("| ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['streams']} | {r.get('long_prompt_ttft_ms')} | {r.get('itl_ms_max_during_long')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"server": banner, "levels": rows}, f, indent=1)


if __name__ == "__main__":
    main()

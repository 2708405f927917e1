#!/usr/bin/env python3
"""Soak `axiom serve` with a crowd of clients, some of them careless or hostile, on 127.0.0.1.

Keeps `--streams` clients busy for `--duration` seconds against a server it starts itself (with
an API key): most stream a completion to its end; a third hang up at a random point; a tenth
send malformed requests; some send 1 MB prompts; some the wrong key. Then it checks that the
server is alive, holds no KV page, and that the well-behaved streams' inter-token gaps stayed
even (p99 under 3x p50), and prints a Markdown report (requests by outcome, RSS, KV pages,
gaps) for docs/robustness.md.

    python3 scripts/soak.py [--axiom target/release/axiom] [--duration 60] [--streams 64]

Bounded in time and count, and only ever talks to the loopback server it started.
"""
import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter

import test_openai
from test_openai import Server

KEY = "soak-key"
PROMPTS = [
    "Once upon a time, in a village by the sea,",
    "The three most important inventions of the last century are",
    "Here is a recipe for bread:",
    "Dear diary, today I learned",
    "The quick brown fox",
    "In the beginning of the universe",
]


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Soak:
    def __init__(self, server, duration, max_requests):
        self.server = server
        self.host, port = server.url.removeprefix("http://").split(":")
        self.port = int(port)
        self.deadline = time.time() + duration
        self.budget = max_requests
        self.lock = threading.Lock()
        self.outcomes = Counter()
        self.gaps = []

    def take(self):
        """Whether another request may start (time and count both bound the run)."""
        with self.lock:
            if time.time() >= self.deadline or self.budget == 0:
                return False
            self.budget -= 1
            return True

    def record(self, outcome, gaps=()):
        with self.lock:
            self.outcomes[outcome] += 1
            self.gaps.extend(gaps)

    def post(self, body, key=KEY):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", "/v1/completions", body=data,
                     headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
        return conn, conn.getresponse()

    def one(self, rng):
        kind = rng.random()
        if kind < 0.10:
            bad = rng.choice([b"{not json", b'{"prompt": "x", "temperature": 9}', b'{"prompt": 5}', b"[]"])
            conn, resp = self.post(bad)
            resp.read()
            conn.close()
            self.record(f"malformed -> {resp.status}")
        elif kind < 0.15:
            conn, resp = self.post({"prompt": "y" * (1 << 20), "max_tokens": 8})
            resp.read()
            conn.close()
            self.record(f"1 MB prompt -> {resp.status}")
        elif kind < 0.20:
            conn, resp = self.post({"prompt": "hello", "max_tokens": 8}, key="wrong")
            resp.read()
            conn.close()
            self.record(f"wrong key -> {resp.status}")
        else:
            hang_up = kind < 0.20 + 0.33
            body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(32, 128), "stream": True,
                    "temperature": 0.8, "seed": rng.randint(0, 1 << 30), "logprobs": 0}
            conn, resp = self.post(body)
            if resp.status != 200:
                resp.read()
                conn.close()
                self.record(f"stream -> {resp.status}")
                return
            stop_after = rng.randint(1, 40) if hang_up else None
            gaps, last, chunks, finished = [], None, 0, False
            for line in resp:
                if not line.startswith(b"data:"):
                    continue
                now = time.time()
                if line.strip() == b"data: [DONE]":
                    finished = True
                    break
                if last is not None:
                    gaps.append(now - last)
                last = now
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    break
            conn.close()
            if stop_after is not None and not finished:
                self.record("stream, hung up")
            else:
                # The last gap is the finish chunk's, sent in the same step as the last token.
                self.record("stream, completed" if finished else "stream, cut short", gaps[:-1] if finished else [])

    def client(self, seed):
        rng = random.Random(seed)
        while self.take():
            try:
                self.one(rng)
            except (OSError, http.client.HTTPException) as e:
                self.record(f"client error: {type(e).__name__}")


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--axiom", default=None, help="the axiom binary (default target/release/axiom)")
    ap.add_argument("--duration", type=float, default=60, help="seconds of load")
    ap.add_argument("--streams", type=int, default=64, help="concurrent clients")
    ap.add_argument("--max-requests", type=int, default=200_000, help="stop after this many requests")
    args = ap.parse_args()
    test_openai.AXIOM = args.axiom or test_openai.ROOT / "target/release/axiom"

    server = Server("--api-key", KEY, "--max-seqs", str(args.streams))
    server.headers = {"authorization": f"Bearer {KEY}"}
    try:
        pid = server.proc.pid
        rss_start = rss_kib(pid)
        soak = Soak(server, args.duration, args.max_requests)
        started = time.time()
        threads = [threading.Thread(target=soak.client, args=(i,)) for i in range(args.streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.time() - started
        deadline = time.time() + 30
        while time.time() < deadline and (server.metric("axiom_kv_pages_used") or server.metric("axiom_running_sequences")):
            time.sleep(0.2)
        pages = int(server.metric("axiom_kv_pages_used"))
        rss_end = rss_kib(pid)
        health = json.loads(server.get("/health"))["status"]
        metrics = {line.split("{")[1].split("}")[0].removeprefix('outcome="').rstrip('"'): int(float(line.split()[-1]))
                   for line in server.get("/metrics").splitlines() if line.startswith("axiom_requests_total{")}
    finally:
        code = server.stop()

    p50, p99 = percentile(soak.gaps, 0.50), percentile(soak.gaps, 0.99)
    print(f"## Soak: {args.streams} clients for {took:.0f} s ({sum(soak.outcomes.values())} requests)\n")
    print("| client saw | requests |\n|---|---:|")
    for outcome, n in sorted(soak.outcomes.items()):
        print(f"| {outcome} | {n} |")
    print("\n| server counted (`axiom_requests_total`) | requests |\n|---|---:|")
    for outcome, n in sorted(metrics.items()):
        print(f"| {outcome} | {n} |")
    print(f"\n| measure | value |\n|---|---:|")
    print(f"| RSS at start / end | {rss_start / 1024:.0f} / {rss_end / 1024:.0f} MiB |")
    print(f"| KV pages used at the end | {pages} |")
    print(f"| inter-token gap p50 / p99 (completed streams, {len(soak.gaps)} gaps) | {p50 * 1e3:.1f} / {p99 * 1e3:.1f} ms |")
    print(f"| server exit on SIGTERM | {code} |")

    failures = []
    if health != "ok":
        failures.append("the server stopped answering /health")
    if pages != 0:
        failures.append(f"{pages} KV pages still in use")
    if not soak.gaps or p99 >= 3 * p50:
        failures.append(f"p99 gap {p99 * 1e3:.1f} ms is not under 3x p50 {p50 * 1e3:.1f} ms")
    bad = {k: n for k, n in soak.outcomes.items() if "client error" in k or "cut short" in k or "-> 5" in k}
    if bad:
        failures.append(f"unexpected outcomes: {bad}")
    expected = {"malformed -> 400", "1 MB prompt -> 400", "wrong key -> 401", "stream, completed", "stream, hung up"}
    if missing := expected - soak.outcomes.keys():
        failures.append(f"no request of each kind ran: missing {sorted(missing)}")
    if code != 0:
        failures.append(f"the server exited with {code}")
    if failures:
        print("\nFAILED: " + "; ".join(failures))
        sys.exit(1)
    print("\nsoak passed")


if __name__ == "__main__":
    main()

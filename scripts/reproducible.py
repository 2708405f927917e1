#!/usr/bin/env python3
"""Reproducible answers through `axiom serve` (issue 52): a request's answer must not depend on
what else the server runs, how its prompt was chunked, or whether its prefix came from the cache.

Three servers, each started fresh so that no phase finds another's pages in the prefix cache:
  1. alone: N chat requests, each greedy and each seeded (temperature 0.8, logprobs with the top
     5), one at a time; then a long prompt (about 400 tokens, one step of the default 512),
     seeded, twice (the second from the prefix cache);
  2. together: the same 2N requests all at once;
  3. chunked: `--max-batch-tokens` small and odd, so the long prompt is prefilled in many
     chunks; it runs twice (the second from the prefix cache).
Every answer (text, and for the seeded ones every token's log-probability and top 5) must equal
the one of its request in phase 1; any difference fails with a non-zero exit status.

    python3 scripts/reproducible.py --axiom target/release/axiom [--model M.gguf] [--backend cuda]
        [--requests 16] [--max-tokens 96] [--chunk 40] [-- more serve arguments]
"""
import argparse
import http.client
import json
import re
import subprocess
import sys
import threading
import time

SUBJECTS = ["a lighthouse keeper", "a baker", "a cartographer", "a beekeeper", "a tram driver",
            "a glassblower", "a cellist", "a mountain guide"]


def start_server(args, extra):
    cmd = [args.axiom, "serve", "--port", "0", "--max-seqs", str(2 * args.requests), *extra, *args.server_args]
    if args.model:
        cmd += ["--model", args.model]
    if args.backend:
        cmd += ["--backend", args.backend]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + args.load_timeout
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit(f"server exited before listening: {' '.join(cmd)}")
        m = re.search(r"on http://([\d.]+):(\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, (m.group(1), int(m.group(2)))
    proc.kill()
    raise SystemExit("server did not start in time")


def chat(address, request, timeout):
    conn = http.client.HTTPConnection(*address, timeout=timeout)
    conn.request("POST", "/v1/chat/completions", json.dumps(request), {"content-type": "application/json"})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {body[:300]!r}")
    return json.loads(body)


def answer(response):
    """What must not change: the text and, where asked, each token's log-probabilities."""
    choice = response["choices"][0]
    logprobs = choice.get("logprobs") or {}
    tokens = [(t["token"], t["logprob"], [(a["token"], a["logprob"]) for a in t["top_logprobs"]])
              for t in logprobs.get("content") or []]
    return choice["message"]["content"], tokens


def requests(args):
    """N prompts of different lengths, each greedy and seeded, then the long prompt seeded."""
    out = []
    for i in range(args.requests):
        text = f"Write the first lines of a letter from {SUBJECTS[i % len(SUBJECTS)]}, dated {1800 + 17 * i}. "
        message = {"role": "user", "content": text * (1 + 3 * (i % 3))}
        base = {"model": "m", "messages": [message], "max_tokens": args.max_tokens, "ignore_eos": True}
        out.append({**base, "temperature": 0})
        out.append({**base, "temperature": 0.8, "seed": 100 + i, "logprobs": True, "top_logprobs": 5})
    return out


def long_request(args):
    story = " ".join(f"On day {d} the {SUBJECTS[d % len(SUBJECTS)]} walked to the harbour and back." for d in range(24))
    message = {"role": "user", "content": f"{story} Summarise the story."}
    return {"model": "m", "messages": [message], "max_tokens": args.max_tokens, "ignore_eos": True,
            "temperature": 0.8, "seed": 7, "logprobs": True, "top_logprobs": 5}


def serve_phase(args, extra, run):
    proc, address = start_server(args, extra)
    try:
        return run(address)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def one_at_a_time(address, reqs, timeout):
    return [chat(address, r, timeout) for r in reqs]


def all_at_once(address, reqs, timeout):
    results = [None] * len(reqs)

    def send(i):
        results[i] = chat(address, reqs[i], timeout)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(r is None for r in results):
        raise SystemExit("a request of the concurrent phase failed")
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--axiom", required=True)
    ap.add_argument("--model")
    ap.add_argument("--backend")
    ap.add_argument("--requests", type=int, default=16, help="prompts, each sent greedy and seeded")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--chunk", type=int, default=40, help="--max-batch-tokens of the chunked phase")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--load-timeout", type=float, default=600)
    ap.add_argument("server_args", nargs="*", help="more `axiom serve` arguments (after --)")
    args = ap.parse_args()
    reqs, long = requests(args), long_request(args)
    start = time.time()

    def alone_run(address):
        return one_at_a_time(address, reqs + [long, long], args.timeout)

    alone = serve_phase(args, [], alone_run)
    together = serve_phase(args, [], lambda address: all_at_once(address, reqs, args.timeout))
    chunked = serve_phase(args, ["--max-batch-tokens", str(args.chunk)],
                          lambda address: one_at_a_time(address, [long, long], args.timeout))

    failures = []
    reference = [answer(r) for r in alone]
    for kind, offset in (("greedy", 0), ("seeded", 1)):
        same_text = same_all = 0
        for i in range(offset, len(reqs), 2):
            got = answer(together[i])
            same_text += got[0] == reference[i][0]
            same_all += got == reference[i]
            if got != reference[i]:
                what = "text" if got[0] != reference[i][0] else "log-probabilities"
                failures.append(f"request {i} ({kind}) together: its {what} differ")
        print(f"{kind}, alone vs {args.requests} together: identical text {same_text}/{args.requests}, "
              f"identical text and log-probabilities {same_all}/{args.requests}")
    cached = lambda r: r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    runs = [("from the prefix cache", alone[-1]), (f"prefilled in steps of {args.chunk} tokens", chunked[0]),
            (f"in steps of {args.chunk} tokens, from the prefix cache", chunked[1])]
    # The first runs may share the chat template's opening with earlier prompts: no more.
    if cached(alone[-1]) <= cached(alone[-2]) or cached(chunked[1]) <= cached(chunked[0]):
        failures.append("the long prompt's second runs must take more of it from the prefix cache")
    for how, response in runs:
        same = answer(response) == reference[-2]
        print(f"long prompt ({response['usage']['prompt_tokens']} tokens) {how}: "
              f"{'identical' if same else 'DIFFERENT'} (cached tokens {cached(response)})")
        if not same:
            failures.append(f"the long prompt {how} differs")
    print(f"{len(failures)} differences in {time.time() - start:.0f} s")
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""`axiom serve` through the official `openai` client, on 127.0.0.1 with the default model.

Chat and completions, streaming and not, stop strings, max_tokens, seeds, logprobs, errors,
several choices (n) sharing their prompt's KV pages,
structured output (response_format json_schema, guided_choice, logit_bias, stop_token_ids),
forced tool calls (tool_choice required and named) on a template without tools, LangChain's
bind_tools and with_structured_output,
every refused field named in `error.param`, /tokenize and /detokenize, tools through Qwen 2.5's
chat template (on the tiny qwen2 fixture), a full queue, stalled uploads, 32 concurrent streams (some abandoned mid-stream) that must each equal their solo
greedy output and leave no KV page in use, and a SIGTERM that lets an open stream finish.

    python3 scripts/test_openai.py [path/to/axiom]

scripts/test.sh runs it after `cargo test` (it installs `openai` from PyPI if missing).
"""
import http.client
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
AXIOM = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "target/release/axiom"


class Server:
    """An `axiom serve` on a free loopback port."""

    def __init__(self, *extra):
        cmd = [str(AXIOM), "serve", "--port", "0", "--threads", "2", "--kv-memory", "256MiB", *extra]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        self.log = []
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("server exited:\n" + "".join(self.log))
            self.log.append(line)
            m = re.search(r"on http://([\d.]+:\d+)", line)
            if m:
                self.url = "http://" + m.group(1)
                break
        else:
            raise RuntimeError("server did not start")
        threading.Thread(target=self._drain, daemon=True).start()
        # Sent with `get` (an API key, say).
        self.headers = {}
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)

    def _drain(self):
        for line in self.proc.stderr:
            self.log.append(line)

    def get(self, path):
        request = urllib.request.Request(self.url + path, headers=self.headers)
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.read().decode()

    def post(self, path, body):
        """The status and JSON body of a POST, errors included."""
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={**self.headers, "content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metric(self, name):
        for line in self.get("/metrics").splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.split()[-1])
        raise KeyError(name)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def chat(server, content, **kw):
    return server.client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": content}], **kw
    )


def streamed_chat(server, content, **kw):
    stream = chat(server, content, stream=True, **kw)
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"ok - {what}")


def basics(s):
    models = s.client.models.list()
    check(len(models.data) == 1 and models.data[0].id, "/v1/models lists the model")
    check(json.loads(s.get("/health"))["status"] == "ok", "/health answers")

    r = chat(s, "Write a long story about a dragon.", max_tokens=16, temperature=0)
    check(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16, "max_tokens ends a chat reply")
    text, finish = streamed_chat(s, "Write a long story about a dragon.", max_tokens=16, temperature=0)
    check((text, finish) == (r.choices[0].message.content, "length"), "a streamed chat equals the whole one")

    c = s.client.completions.create(model="any", prompt="Once upon a time", max_tokens=20, temperature=0)
    parts = [
        ch.choices[0].text
        for ch in s.client.completions.create(
            model="any", prompt="Once upon a time", max_tokens=20, temperature=0, stream=True
        )
        if ch.choices
    ]
    check("".join(parts) == c.choices[0].text and c.usage.completion_tokens == 20, "a streamed completion equals the whole one")

    full = c.choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = s.client.completions.create(model="any", prompt="Once upon a time", max_tokens=20, temperature=0, stop=[stop])
    check(
        cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[: full.index(stop)],
        f"a stop string ({stop!r}) ends the text before it",
    )

    sampled = [
        chat(s, "Tell me a story.", max_tokens=24, temperature=1.0, seed=seed).choices[0].message.content
        for seed in (7, 7, 8)
    ]
    check(sampled[0] == sampled[1], "the same seed gives the same sampled text")
    check(sampled[0] != sampled[2], "another seed gives another text")

    lp = chat(s, "Say hi.", max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = lp.choices[0].logprobs.content
    check(
        len(content) == 5 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content),
        "chat logprobs give each token and three alternatives",
    )
    check(
        all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-4 for t in content),
        "greedy tokens are the most likely ones",
    )

    try:
        chat(s, "hello", max_tokens=10**6)
        check(False, "an oversized max_tokens is refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and "context length" in str(e), "an oversized max_tokens gets 400 with the lengths")
    try:
        chat(s, "hello", temperature=7)
        check(False, "a bad temperature is refused")
    except openai.BadRequestError as e:
        check("temperature" in str(e), "a bad temperature gets 400 naming the field")
    try:
        chat(s, "word " * 9000, max_tokens=4)
        check(False, "a prompt longer than the context is refused")
    except openai.BadRequestError as e:
        check("maximum context length is 8192" in str(e), "a prompt longer than the context gets 400 with the lengths")
    # Announce a body over the 4 MiB limit and send none of it: the server must answer from the
    # length alone (sending the body would race its early close against our writes).
    host, port = s.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("content-type", "application/json")
    conn.putheader("content-length", str(5 << 20))
    conn.endheaders()
    resp = conn.getresponse()
    check(resp.status == 413 and "error" in json.loads(resp.read()), "a body over the limit gets 413 and an error object")
    conn.close()
    req = urllib.request.Request(s.url + "/v1/chat/completions", data=b"{not json", headers={"content-type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=30)
        check(False, "malformed JSON is refused")
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
        check(e.code == 400 and body["error"]["type"] == "invalid_request_error", "malformed JSON gets an OpenAI error object")


def refused(what, param, call):
    try:
        call()
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.param == param, f"{what} gets 400 naming {param}")
        return
    check(False, f"{what} is refused")


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def strictness(s):
    """Each field is honoured or refused by name, as OpenAI's API answers an unknown one."""
    user = [{"role": "user", "content": "hi"}]
    create = s.client.chat.completions.create
    cases = [
        ("an unknown field", "frobnicate", dict(extra_body={"frobnicate": 1})),
        ("a logit_bias key that is no token id", "logit_bias", dict(logit_bias={"x": 5})),
        ("an unknown response_format type", "response_format", dict(response_format={"type": "yaml"})),
        ("n = 17", "n", dict(n=17)),
        ("store = true", "store", dict(store=True)),
        ("the deprecated functions", "functions", dict(functions=[WEATHER["function"]])),
        ("reasoning_effort", "reasoning_effort", dict(reasoning_effort="low")),
        ("tools on a template without them", "tools", dict(tools=[WEATHER])),
        ("an unknown message field", "messages[0].weight", dict(messages=[{"role": "user", "content": "x", "weight": 2}])),
        ("an image part", "messages[0].content[1].type", dict(messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])),
    ]
    for what, param, kw in cases:
        refused(what, param, lambda: create(model="any", **{"messages": user, "max_tokens": 2, **kw}))
    refused("best_of = 2", "best_of", lambda: s.client.completions.create(model="any", prompt="x", best_of=2))
    refused("tools on /v1/completions", "tools", lambda: s.client.completions.create(
        model="any", prompt="x", extra_body={"tools": [WEATHER]}))
    r = create(model="any", messages=user, max_tokens=2, n=1, store=False, user="tester", seed=1, logit_bias=None)
    check(r.choices[0].finish_reason == "length", "n = 1, store = false, user and a null field are accepted")
    # The access log's line is written once the response body has ended, a moment after the reply.
    deadline = time.time() + 5
    while not any('user="tester"' in line for line in s.log) and time.time() < deadline:
        time.sleep(0.05)
    check(any('user="tester"' in line for line in s.log), "the user field is written to the access log")


def tokenize(s):
    status, body = s.post("/tokenize", {"content": "Hello world", "with_pieces": True})
    pieces = "".join(t["piece"] for t in body["tokens"])
    check(status == 200 and pieces == "Hello world" and body["count"] == len(body["tokens"]), "/tokenize (llama-server's shape) gives each id's piece")
    ids = [t["id"] for t in body["tokens"]]
    status, back = s.post("/detokenize", {"tokens": ids})
    check(status == 200 and back["content"] == back["prompt"] == "Hello world", "/detokenize gives the text back")
    messages = [{"role": "user", "content": "Say hi."}]
    status, body = s.post("/tokenize", {"messages": messages})
    r = s.client.chat.completions.create(model="any", messages=messages, max_tokens=1)
    check(status == 200 and body["count"] == r.usage.prompt_tokens and body["max_model_len"] == 8192,
          "/tokenize (vLLM's messages shape) counts the chat prompt and gives max_model_len")
    status, body = s.post("/tokenize", {"prompt": "x", "add_bos": True})
    check(status == 400 and body["error"]["param"] == "add_bos", "an unknown /tokenize field gets 400 naming it")
    status, body = s.post("/detokenize", {"tokens": [10**9]})
    check(status == 400 and body["error"]["param"] == "tokens", "an id outside the vocabulary gets 400")
    model = json.loads(s.get("/v1/models"))["data"][0]
    check(model["max_model_len"] == 8192, "/v1/models gives the context length")


def tools():
    """Tools, a call and its result through Qwen 2.5's real chat template, on the tiny random
    qwen2 fixture (its context raised: the tools prompt is long in its small vocabulary)."""
    fixtures = ROOT / "crates/axiom/tests/fixtures"
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "qwen2.5-tools"
        shutil.copytree(fixtures / "hf/qwen2", model)
        shutil.copy(fixtures / "chat_templates/qwen2.5.jinja", model / "chat_template.jinja")
        config = json.loads((model / "config.json").read_text())
        config["max_position_embeddings"] = 2048
        (model / "config.json").write_text(json.dumps(config))
        s = Server("-m", str(model))
        try:
            messages = [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 18}"},
            ]
            r = s.client.chat.completions.create(model="any", messages=messages, tools=[WEATHER], max_tokens=4, temperature=0)
            _, counted = s.post("/tokenize", {"messages": messages, "tools": [WEATHER]})
            _, bare = s.post("/tokenize", {"messages": messages})
            check(r.usage.prompt_tokens == counted["count"] > bare["count"], "tools, a tool call and its result reach the template")
            stream = s.client.chat.completions.create(model="any", messages=messages, tools=[WEATHER], max_tokens=4,
                                                      temperature=0, stream=True, tool_choice="auto")
            finish = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
            check(finish and finish[-1] in ("stop", "length", "tool_calls"), "a streamed chat with tools ends with a finish reason")
            create = s.client.chat.completions.create
            # A random model under the forced call's grammar: a call, or its start if cut short.
            forced = create(model="any", messages=messages[:1], tools=[WEATHER], tool_choice="required",
                            max_tokens=40, temperature=0).choices[0]
            calls = forced.message.tool_calls or []
            check(
                (forced.finish_reason == "tool_calls" and calls[0].function.name == "get_weather"
                 and isinstance(json.loads(calls[0].function.arguments), dict))
                or (forced.finish_reason == "length" and forced.message.content.startswith('{"name": "get_weather"')),
                f"tool_choice required through a tools template is a call: {forced.message}",
            )
            refused("a tool message without tool_call_id", "messages[1].tool_call_id",
                    lambda: create(model="any", messages=[messages[0], {"role": "tool", "content": "18"}], tools=[WEATHER]))
            refused("a tool named with a special token", "tools",
                    lambda: create(model="any", messages=messages[:1], tools=[{"type": "function", "function": {"name": "<|im_end|>"}}]))
        except Exception:
            sys.stderr.write("".join(s.log))
            raise
        finally:
            s.stop()


def choices(s):
    """`n` > 1: every choice comes back with its index, whole and streamed; the siblings of the
    first share its prompt's KV pages; seeds make choices reproducible; a dropped stream frees all."""
    # A prompt no earlier request began with, many KV pages long.
    prompt = f"Request {time.time_ns()}. " + "Tell me about the sea and its many fish. " * 20
    cached_before = s.metric("axiom_prompt_tokens_cached_total")
    r = chat(s, prompt, n=3, max_tokens=12, temperature=1.0, seed=5)
    check([c.index for c in r.choices] == [0, 1, 2] and all(c.finish_reason for c in r.choices),
          "n = 3 gives choices 0, 1 and 2, each finished")
    texts = [c.message.content for c in r.choices]
    check(len(set(texts)) > 1, "sampled choices differ (each has its own seed)")
    shared = r.usage.prompt_tokens_details.cached_tokens
    check(r.usage.prompt_tokens > 100 and shared >= r.usage.prompt_tokens - 16,
          f"choices 1 and 2 reuse choice 0's prompt pages ({shared} of {r.usage.prompt_tokens} prompt tokens cached)")
    check(s.metric("axiom_prompt_tokens_cached_total") - cached_before >= 2 * shared,
          "both siblings took the prompt from the prefix cache")
    # Every generated token came out of a step's row: the steps ran at least as many tokens.
    check(0 < s.metric("axiom_step_tokens_count") and
          s.metric("axiom_generated_tokens_total") <= s.metric("axiom_step_tokens_sum"),
          "/metrics counts the steps and the tokens they ran")
    again = chat(s, prompt, n=3, max_tokens=12, temperature=1.0, seed=5)
    check([c.message.content for c in again.choices] == texts, "the same seed gives the same n choices")
    one = chat(s, prompt, max_tokens=12, temperature=1.0, seed=5)
    check(one.choices[0].message.content == texts[0], "choice 0 samples as the same request with n = 1")
    greedy = chat(s, prompt, n=3, max_tokens=12, temperature=0)
    check(len({c.message.content for c in greedy.choices}) == 1, "greedy choices are equal")

    stream = chat(s, prompt, n=3, max_tokens=12, temperature=1.0, seed=5, stream=True,
                  stream_options={"include_usage": True})
    streamed, finishes, usage = {}, {}, []
    for chunk in stream:
        if chunk.usage:
            usage.append(chunk.usage)
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    check([streamed.get(i) for i in range(3)] == texts and sorted(finishes) == [0, 1, 2],
          "streamed choices interleave by index, each finishes, and equal the whole ones")
    check(len(usage) == 1 and usage[0].completion_tokens == r.usage.completion_tokens, "one usage chunk counts every choice")

    c = s.client.completions.create(model="any", prompt=prompt, n=2, best_of=2, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    solo = s.client.completions.create(model="any", prompt=prompt, max_tokens=5, temperature=0)
    check([x.index for x in c.choices] == [0, 1] and c.choices[0].text == c.choices[1].text,
          "completions take n = 2 with best_of = 2")
    check((c.usage.prompt_tokens, c.usage.completion_tokens) == (solo.usage.prompt_tokens, 10),
          "usage counts the prompt once and sums the choices' completions")
    refused("best_of other than n", "best_of", lambda: s.client.completions.create(
        model="any", prompt="x", n=2, best_of=3))
    refused("n = 0", "n", lambda: s.client.completions.create(model="any", prompt="x", n=0))
    guided = s.client.completions.create(model="any", prompt="My favourite colour is", n=3, max_tokens=5,
                                         temperature=1.0, extra_body={"guided_choice": ["red", "green", "blue"]})
    check(all(x.text in ("red", "green", "blue") for x in guided.choices) and len(guided.choices) == 3,
          f"each choice has its own constraint: {[x.text for x in guided.choices]}")

    stream = chat(s, prompt, n=3, max_tokens=400, temperature=1.0, stream=True)
    for i, _ in enumerate(stream):
        if i == 6:
            stream.close()
            break
    deadline = time.time() + 10
    while time.time() < deadline and (s.metric("axiom_kv_pages_used") or s.metric("axiom_running_sequences")):
        time.sleep(0.1)
    check(s.metric("axiom_kv_pages_used") == 0 and s.metric("axiom_running_sequences") == 0,
          "a dropped stream of 3 choices cancels them all: no KV page in use")


def concurrency(s):
    prompts = [f"Write a short poem about the number {i}." for i in range(32)]
    solo = [chat(s, p, max_tokens=24, temperature=0).choices[0].message.content for p in prompts]
    abandon = set(range(0, 32, 4))

    def client(i):
        stream = chat(s, prompts[i], max_tokens=24 if i not in abandon else 200, temperature=0, stream=True)
        text, n = "", 0
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            n += 1
            if i in abandon and n == 3:
                stream.close()
                return None
        return text

    start = time.time()
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(client, range(32)))
    took = time.time() - start
    same = [i for i in range(32) if i not in abandon and results[i] == solo[i]]
    check(len(same) == 32 - len(abandon), f"24 completed streams equal their solo greedy output ({took:.1f} s)")
    deadline = time.time() + 10
    while time.time() < deadline and (s.metric("axiom_kv_pages_used") or s.metric("axiom_running_sequences")):
        time.sleep(0.1)
    check(s.metric("axiom_kv_pages_used") == 0, "no KV page is in use once every stream ended or was dropped")
    check(s.metric('axiom_requests_total{outcome="cancelled"}') >= len(abandon), "dropped streams were cancelled")


def full_queue():
    s = Server("--max-seqs", "1", "--max-queue", "1")
    try:
        def slow(_):
            try:
                chat(s, "Count to one hundred.", max_tokens=60, temperature=0)
                return 200
            except openai.APIStatusError as e:
                return e.status_code

        with ThreadPoolExecutor(6) as pool:
            codes = list(pool.map(slow, range(6)))
        check(200 in codes and 503 in codes, f"a full queue answers 503 at once ({sorted(codes)})")
        r = chat(s, "Say hi.", n=2, max_tokens=4, temperature=0)
        check(len(r.choices) == 2, "with one running sequence, the second choice waits its turn")
        refused("n beyond the queue", "n", lambda: chat(s, "Say hi.", n=3, max_tokens=4))
    finally:
        s.stop()


def drain_on_sigterm():
    s = Server()
    stream = chat(s, "Tell me about rivers.", max_tokens=40, temperature=0, stream=True)
    first = next(iter(stream))
    s.proc.send_signal(signal.SIGTERM)
    chunks = [first, *stream]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    check(finish == ["length"], "SIGTERM lets an open stream finish")
    check(s.proc.wait(timeout=60) == 0, "then the server exits cleanly")


def stalled_upload():
    """Clients that stop sending mid-body get 408 after --read-timeout, with a length or chunked,
    and a stalled one still connected does not hold SIGTERM's drain open."""
    s = Server("--read-timeout", "2")
    host, port = s.url.removeprefix("http://").split(":")

    def stall(framing, partial):
        sock = socket.create_connection((host, int(port)), timeout=60)
        head = f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n{framing}\r\n\r\n"
        sock.sendall(head.encode() + partial)
        return sock

    try:
        for framing, partial in [("content-length: 100", b'{"model"'), ("transfer-encoding: chunked", b'8\r\n{"model"\r\n')]:
            sock = stall(framing, partial)
            started = time.time()
            reply = sock.recv(4096)
            waited = time.time() - started
            sock.close()
            check(reply.startswith(b"HTTP/1.1 408") and 1.5 < waited < 30, f"a stalled upload ({framing}) gets 408 after the read timeout")
        sock = stall("content-length: 100", b"{")
        s.proc.send_signal(signal.SIGTERM)
        check(s.proc.wait(timeout=30) == 0, "SIGTERM exits while a stalled upload is connected")
        sock.close()
    finally:
        if s.proc.poll() is None:
            s.stop()


def structured(s):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    for seed in range(4):
        r = chat(s, "Describe a person as JSON.", max_tokens=120, temperature=1.0, seed=seed, response_format=response_format)
        person = json.loads(r.choices[0].message.content)
        check(
            r.choices[0].finish_reason == "stop" and set(person) == {"name", "age"}
            and isinstance(person["name"], str) and isinstance(person["age"], int),
            f"response_format json_schema holds (seed {seed}): {person}",
        )
    text, finish = streamed_chat(s, "Describe a person as JSON.", max_tokens=120, temperature=1.0, seed=9, response_format=response_format)
    check(finish == "stop" and set(json.loads(text)) == {"name", "age"}, "a streamed reply follows the schema too")
    c = s.client.completions.create(
        model="any", prompt="My favourite colour is", max_tokens=8, temperature=1.0,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )
    check(c.choices[0].text in ("red", "green", "blue"), f"guided_choice picks one choice: {c.choices[0].text!r}")

    plain = s.client.completions.create(model="any", prompt="Once upon a time", max_tokens=6, temperature=0).choices[0].text
    ids = json.loads(subprocess.run([str(AXIOM), "tokenize", plain], capture_output=True, text=True, check=True).stdout)
    banned = s.client.completions.create(
        model="any", prompt="Once upon a time", max_tokens=6, temperature=0, logit_bias={str(ids[0]): -100}
    ).choices[0].text
    check(banned != plain, f"logit_bias -100 bans the greedy first token ({plain!r} became {banned!r})")
    stopped = s.client.completions.create(
        model="any", prompt="Once upon a time", max_tokens=6, temperature=0, extra_body={"stop_token_ids": [ids[2]]}
    ).choices[0]
    check(
        stopped.finish_reason == "stop" and plain.startswith(stopped.text) and len(stopped.text) < len(plain),
        f"stop_token_ids stops before the token ({stopped.text!r})",
    )

    def error(**body):
        try:
            chat(s, "hi", max_tokens=4, **body)
        except openai.BadRequestError as e:
            return e.body.get("param") if isinstance(e.body, dict) else None
        return None

    check(error(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
          == "response_format", "a bad schema is a 400 naming response_format")
    check(error(extra_body={"guided_regex": "[0-9"}) == "guided_regex", "a bad regex is a 400 naming guided_regex")
    check(error(response_format={"type": "json_object"}, extra_body={"guided_choice": ["a"]}) == "guided_choice",
          "two constraints are a 400 naming the second")
    check(error(logit_bias={"999999999": 5}) == "logit_bias", "an out-of-vocabulary logit_bias is a 400")
    check(error(logit_bias={"5": 101}) == "logit_bias", "a bias over 100 is a 400")
    check(error(extra_body={"stop_token_ids": [999999999]}) == "stop_token_ids", "an out-of-vocabulary stop token is a 400")


CLOCK = {"type": "function", "function": {"name": "now", "description": "The time now."}}


def forced_tools(s):
    """tool_choice required / named on SmolLM2, whose template knows no tools: a grammar forces the call."""
    question = "What is the weather like in Paris today?"
    for seed in range(3):
        r = chat(s, question, tools=[WEATHER, CLOCK], temperature=1.0, seed=seed, max_tokens=60,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = r.choices[0]
        calls = choice.message.tool_calls or []
        args = json.loads(calls[0].function.arguments) if calls else None
        check(
            choice.finish_reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == "get_weather"
            and calls[0].id.startswith("call_") and isinstance(args.get("city"), str)
            and not choice.message.content,
            f"a named tool_choice is that call, its arguments under the schema (seed {seed}): {args}",
        )
    r = chat(s, question, tools=[WEATHER, CLOCK], tool_choice="required", temperature=0, max_tokens=60)
    calls = r.choices[0].message.tool_calls or []
    check(len(calls) == 1 and calls[0].function.name in ("get_weather", "now"),
          f"tool_choice required makes a call ({calls[0].function.name if calls else None})")
    stream = chat(s, question, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60, stream=True)
    deltas, finish = [], None
    for chunk in stream:
        if chunk.choices:
            deltas += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    check(finish == "tool_calls" and deltas and deltas[0].function.name == "get_weather"
          and "city" in json.loads("".join(d.function.arguments or "" for d in deltas)),
          "a forced call streams as tool_calls deltas")
    for body, param in [
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}}), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        (dict(tools=[WEATHER]), "tools"),
    ]:
        refused(f"{sorted(body)} on a template without tools", param, lambda: chat(s, "hi", max_tokens=4, **body))


def langchain(s):
    """LangChain's bind_tools and with_structured_output, as an agent framework drives the server."""
    try:
        from langchain_openai import ChatOpenAI
        from pydantic import BaseModel
    except ImportError:
        raise SystemExit("langchain-openai is missing: pip install langchain-openai (scripts/test.sh does)")

    class Person(BaseModel):
        name: str
        age: int

    def get_weather(city: str) -> str:
        """The weather in a city now."""
        return "sunny"

    llm = ChatOpenAI(base_url=s.url + "/v1", api_key="none", model="any", temperature=0, max_tokens=60, max_retries=0)
    reply = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    check(len(reply.tool_calls) == 1 and reply.tool_calls[0]["name"] == "get_weather"
          and isinstance(reply.tool_calls[0]["args"].get("city"), str),
          f"LangChain bind_tools gets the call: {reply.tool_calls}")
    person = llm.with_structured_output(Person).invoke("Describe a person.")
    check(isinstance(person, Person), f"LangChain with_structured_output returns the model: {person!r}")


def main():
    s = Server()
    try:
        basics(s)
        structured(s)
        forced_tools(s)
        langchain(s)
        strictness(s)
        choices(s)
        tokenize(s)
        concurrency(s)
    except Exception:
        sys.stderr.write("".join(s.log))
        raise
    finally:
        s.stop()
    tools()
    full_queue()
    stalled_upload()
    drain_on_sigterm()
    print("all OpenAI client checks passed")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""`axiom serve` against hostile and careless clients, on 127.0.0.1 with the default model.

Huge prompts must not stall other streams; half-sent requests, idle connections and a flood of
sockets are bounded; SIGTERM ends within its deadline; an API key, JSON-only POSTs, the Host
check and CORS decide who may call; errors are OpenAI error objects, counted in /metrics and
written to the access log.

    python3 scripts/test_hardening.py [path/to/axiom]

scripts/test.sh runs it after `cargo test`. Each check prints "ok - ..."; the first failure
raises with the server's log.
"""
import http.client
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai

from test_openai import Server, check

KEY = "test-key-7f3a"


def request(server, method, path, body=None, headers=None, timeout=60):
    """(status, headers, body) of one request on a fresh connection."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    hdrs = {"content-type": "application/json"} if data is not None else {}
    hdrs.update(headers or {})
    conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def error_of(body):
    """The OpenAI error object in a response body."""
    err = json.loads(body)["error"]
    assert {"message", "type", "param", "code"} <= err.keys(), err
    return err


def raw_socket(server):
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def closed_within(sock, seconds):
    """Whether the server closes `sock` (reads EOF or a reset) within `seconds`."""
    sock.settimeout(seconds)
    start = time.time()
    try:
        while sock.recv(4096):
            pass
        return time.time() - start
    except ConnectionResetError:
        return time.time() - start
    except socket.timeout:
        return None


def stream_gaps(server, headers, tokens, started):
    """Streams a completion; returns the largest gap between its chunks, in seconds."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json", **headers})
    resp = conn.getresponse()
    last, largest, first = None, 0.0, True
    for line in resp:
        if not line.startswith(b"data:"):
            continue
        now = time.time()
        if first:
            started.set()
            first = False
        elif last is not None:
            largest = max(largest, now - last)
        last = now
    conn.close()
    return largest


def neighbours():
    """Two clients sending 4 MB prompts do not stall a running stream or /health."""
    s = Server()
    try:
        started = threading.Event()
        with ThreadPoolExecutor(4) as pool:
            stream = pool.submit(stream_gaps, s, {}, 160, started)
            started.wait(60)
            big = "All work and no play makes Jack a dull boy. " * (4_000_000 // 44)
            bombs = [
                pool.submit(request, s, "POST", "/v1/completions", {"prompt": big, "max_tokens": 4}),
                pool.submit(request, s, "POST", "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": big}], "max_tokens": 4}),
            ]
            health = []
            while not all(b.done() for b in bombs):
                t = time.time()
                request(s, "GET", "/health", timeout=30)
                health.append(time.time() - t)
                time.sleep(0.05)
            codes = [b.result()[0] for b in bombs]
            gap = stream.result()
        check(codes == [400, 400], f"4 MB prompts get 400 ({codes})")
        check(gap < 1.0, f"the stream's largest inter-token gap stays under 1 s meanwhile ({gap:.3f} s)")
        check(max(health) < 1.0, f"/health answers within 1 s meanwhile ({max(health):.3f} s)")
    finally:
        s.stop()


def connections():
    """Header and keep-alive timeouts, the connection cap, and SIGTERM's deadline."""
    s = Server("--header-timeout", "1", "--keep-alive-timeout", "1", "--max-connections", "6",
               "--shutdown-timeout", "2")
    try:
        half = raw_socket(s)
        half.sendall(b"GET /health HTTP/1.1\r\nhost: localhost\r\n")
        took = closed_within(half, 10)
        check(took is not None and took < 5, f"a connection that never finishes its headers is closed ({took} s)")

        idle = raw_socket(s)
        idle.sendall(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
        first = idle.recv(4096)
        took = closed_within(idle, 10)
        check(first.startswith(b"HTTP/1.1 200") and took is not None and took < 5,
              f"an idle keep-alive connection is closed after its timeout ({took} s)")

        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(stream_gaps, s, {}, 120, started)
            started.wait(60)
            held = [raw_socket(s) for _ in range(5)]
            time.sleep(0.3)
            extra = raw_socket(s)
            extra.sendall(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
            reply = extra.recv(4096)
            check(reply.startswith(b"HTTP/1.1 503") and b'"error"' in reply,
                  "past --max-connections a connection gets 503 with an error object")
            for h in held:
                h.close()
            time.sleep(0.3)
            check(request(s, "GET", "/health")[0] == 200, "closing connections frees their places")
            long.result()
        check(True, "a stream longer than the keep-alive timeout is not cut by it")
        check(s.metric('axiom_requests_total{outcome="rejected_503"}') >= 1, "refused connections are counted")

        # A stream that would run for minutes and a half-sent request: SIGTERM still ends the
        # server within its deadline.
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            pool.submit(stream_gaps, s, {}, 4000, started)
            started.wait(60)
            stuck = raw_socket(s)
            stuck.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\n")
            t = time.time()
            s.proc.send_signal(signal.SIGTERM)
            code = s.proc.wait(timeout=60)
            took = time.time() - t
        check(code == 0 and took < 10, f"SIGTERM exits within --shutdown-timeout despite open work ({took:.1f} s)")
        check(any("still open after 2 s" in line for line in s.log), "the log says connections were closed at the deadline")
    finally:
        if s.proc.poll() is None:
            s.stop()


def callers():
    """The API key (from a file), JSON-only POSTs, the Host check, CORS off by default."""
    with tempfile.NamedTemporaryFile("w", suffix=".key", delete=False) as f:
        f.write(KEY + "\n")
    s = Server("--api-key-file", f.name)
    try:
        auth = {"authorization": f"Bearer {KEY}"}
        s.headers = auth
        check(KEY not in " ".join(s.proc.args), "the key from a file stays out of the command line")
        check(request(s, "GET", "/health")[0] == 200, "/health needs no key")
        for path in ["/v1/models", "/metrics"]:
            status, headers, body = request(s, "GET", path)
            check(status == 401 and error_of(body)["type"] == "authentication_error"
                  and headers.get("www-authenticate") == "Bearer", f"{path} without the key gets 401 and an error object")
        status, _, _ = request(s, "GET", "/v1/models", headers={"authorization": "Bearer wrong"})
        check(status == 401, "a wrong key gets 401")
        check(request(s, "GET", "/v1/models", headers=auth)[0] == 200, "the right key is let in")
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        r = client.completions.create(model="any", prompt="Hello", max_tokens=3, temperature=0)
        check(r.usage.completion_tokens == 3, "the official client with the key is served")
        try:
            openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0).models.list()
            check(False, "the client with a wrong key is refused")
        except openai.AuthenticationError:
            check(True, "the official client with a wrong key gets AuthenticationError")

        before = s.metric('axiom_requests_total{outcome="length"}')
        body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
        status, _, reply = request(s, "POST", "/v1/completions", body, headers={**auth, "content-type": "text/plain"})
        check(status == 415 and "application/json" in error_of(reply)["message"], "a text/plain POST gets 415")
        check(s.metric('axiom_requests_total{outcome="length"}') == before, "and starts no generation")

        origin = {"origin": "http://evil.example"}
        _, headers, _ = request(s, "GET", "/v1/models", headers={**auth, **origin})
        check("access-control-allow-origin" not in headers, "CORS is off by default")
        status, headers, _ = request(s, "OPTIONS", "/v1/chat/completions",
                                     headers={**origin, "access-control-request-method": "POST"})
        check("access-control-allow-origin" not in headers, "a preflight is not granted by default")

        for host in ["evil.example", "evil.example:8080", "127.0.0.1.evil.example"]:
            status, _, body = request(s, "GET", "/v1/models", headers={**auth, "host": host})
            check(status == 403 and "Host" in error_of(body)["message"], f"Host {host} gets 403 on a loopback server")
        for host in ["localhost", "localhost:1234", "127.0.0.1", "[::1]:80"]:
            check(request(s, "GET", "/v1/models", headers={**auth, "host": host})[0] == 200, f"Host {host} is served")
    finally:
        s.stop()
        os.unlink(f.name)

    os.environ["AXIOM_API_KEY"] = KEY
    try:
        s = Server("--metrics-public", "--cors-origin", "http://app.example", "--allowed-host", "box.lan")
    finally:
        del os.environ["AXIOM_API_KEY"]
    try:
        check(request(s, "GET", "/v1/models")[0] == 401, "AXIOM_API_KEY sets the key")
        check(request(s, "GET", "/metrics")[0] == 200, "--metrics-public opens /metrics")
        status, headers, _ = request(s, "OPTIONS", "/v1/chat/completions", headers={
            "origin": "http://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        check(status == 200 and headers.get("access-control-allow-origin") == "http://app.example"
              and "POST" in headers.get("access-control-allow-methods", ""), "--cors-origin answers its preflight")
        _, headers, _ = request(s, "OPTIONS", "/v1/chat/completions", headers={
            "origin": "http://other.example", "access-control-request-method": "POST"})
        check("access-control-allow-origin" not in headers, "another origin's preflight is not granted")
        status = request(s, "GET", "/v1/models", headers={"authorization": f"Bearer {KEY}", "host": "box.lan:8080"})[0]
        check(status == 200, "--allowed-host widens the Host check")
    finally:
        s.stop()

    s = Server("--host", "0.0.0.0")
    s.stop()
    check(any("without --api-key" in line for line in s.log), "binding 0.0.0.0 without --api-key warns")


def operators():
    """Errors are OpenAI objects and counted by status; one access-log line per request; ids
    are unique across restarts."""
    s = Server("--read-timeout", "1")
    try:
        status, _, body = request(s, "GET", "/v1/nothing")
        check(status == 404 and "/v1/nothing" in error_of(body)["message"], "404 carries an OpenAI error object")
        status, headers, body = request(s, "DELETE", "/v1/models")
        check(status == 405 and error_of(body)["type"] == "invalid_request_error", "405 carries an OpenAI error object")
        request(s, "POST", "/v1/completions", b"{}", headers={"content-type": "text/plain"})
        # A body over the limit, announced and not sent: the answer comes from the length alone.
        sock = raw_socket(s)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
                     b"content-length: 5242880\r\n\r\n")
        check(sock.recv(4096).startswith(b"HTTP/1.1 413"), "an announced oversize body gets 413")
        sock.close()
        sock = raw_socket(s)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
                     b"content-length: 50\r\n\r\n{")
        reply = sock.recv(4096)
        sock.close()
        check(reply.startswith(b"HTTP/1.1 408"), "a stalled body gets 408")
        for code in [404, 405, 408, 413, 415]:
            check(s.metric(f'axiom_requests_total{{outcome="rejected_{code}"}}') >= 1, f"/metrics counts {code}")

        status, headers, body = request(s, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
        rid = headers.get("x-request-id", "")
        check(status == 200 and len(rid) == 36, "responses carry an x-request-id")
        time.sleep(0.2)
        lines = [line for line in s.log if rid in line]
        check(len(lines) == 1 and all(f in lines[0] for f in
              ["POST /v1/completions 200", "prompt_tokens=", "completion_tokens=3", "ttft_ms=", "total_ms=", "finish=length"]),
              f"one access-log line for the request ({lines[:1]})")
        first_id = json.loads(body)["id"]
    finally:
        s.stop()
    s = Server()
    try:
        _, _, body = request(s, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
        second_id = json.loads(body)["id"]
        check(first_id != second_id and len(first_id) > 20, f"ids differ across restarts ({first_id}, {second_id})")
    finally:
        s.stop()


def main():
    neighbours()
    connections()
    callers()
    operators()
    print("all hardening checks passed")


if __name__ == "__main__":
    main()

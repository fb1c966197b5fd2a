"""Load and abuse check of ``colibri serve`` (the default engine, the bundled demo model).

Starts ``colibri serve`` as a subprocess on a free port and throws at it what a hostile or careless
client sends: broken HTTP (bad request lines, oversized URL/headers/body, Content-Length lies,
chunked bodies, HTTP/1.0, keep-alive, pipelining, slowloris, thousands of half-sent requests),
broken JSON (invalid, lone surrogates, deep nesting, huge numbers, NaN), every request field with a
wrong type or value, prompts beyond the context, crowds of clients (the ``openai`` package and raw
sockets), clients that leave, and SIGINT/SIGTERM with many streams running.

Every answer must be an OpenAI-shaped JSON error or a proper success: never HTML, never a closed
connection without a response, never 5xx other than 503 (with ``Retry-After``) when full; the
server stays up and ends with exit status 0. One PASS/FAIL line per check; exit status 1 on any FAIL.

    PYTHONPATH=$PWD python scripts/serve/abuse_check.py [-k SUBSTRING] [-v]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

API_KEY = "sekrit"
ORIGIN = "https://app.example"
READ_TIMEOUT = 3.0
AUTH = f"Authorization: Bearer {API_KEY}\r\n"


# -- the server --------------------------------------------------------------------------------

class Server:
    def __init__(self, *extra: str):
        cmd = [sys.executable, "-X", "faulthandler", "-m", "colibri_mlx", "serve", "--port", "0",
               "--prefill-step-size", "128",
               "--api-key", API_KEY, "--allow-origin", ORIGIN, "--read-timeout", str(READ_TIMEOUT),
               "--max-tokens", "16", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     errors="replace")
        self.log: list[str] = []
        self.port = None
        ready = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"at http://[^:]+:(\d+)/v1", line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(120) or self.port is None:
            self.proc.kill()
            raise SystemExit("colibri serve did not start:\n" + "".join(self.log)[-4000:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig=signal.SIGINT, timeout=30.0) -> int:
        if self.alive():
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -999

    def text(self) -> str:
        return "".join(self.log)


# -- raw HTTP ----------------------------------------------------------------------------------

class Reply:
    def __init__(self, status, headers, body, raw):
        self.status, self.headers, self.body, self.raw = status, headers, body, raw

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return f"<{self.status} {self.body[:200]!r}>"


def connect(port, timeout=30.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_reply(sock, buf=b"", head_only=False) -> tuple[Reply, bytes]:
    """One response from ``sock`` (``buf``: bytes already read). Raises ConnectionError when the
    connection ends without a whole head."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed without a response (got {buf[:200]!r})")
        buf += chunk
    head, buf = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if head_only or status in (204, 304):
        return Reply(status, headers, b"", head), buf
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(buf) < n:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"body ended after {len(buf)} of {n} bytes")
            buf += chunk
        return Reply(status, headers, buf[:n], head), buf[n:]
    while True:  # until the connection closes (a stream)
        chunk = sock.recv(65536)
        if not chunk:
            return Reply(status, headers, buf, head), b""
        buf += chunk


def raw(port, data: bytes, timeout=30.0, head_only=False) -> Reply:
    with connect(port, timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer before reading all of it
        return read_reply(s, head_only=head_only)[0]


def request_bytes(method, path, body=None, headers="", auth=True, version="HTTP/1.1", close=True) -> bytes:
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    elif isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    h = f"{method} {path} {version}\r\nHost: x\r\n" + (AUTH if auth else "") + headers
    if close:
        h += "Connection: close\r\n"
    if body is not None:
        h += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return h.encode("latin-1") + b"\r\n" + (body or b"")


def is_openai_error(r: Reply, statuses) -> str:
    """'' when ``r`` is an OpenAI-shaped JSON error with a status in ``statuses``; else why not."""
    if r.status not in statuses:
        return f"status {r.status} not in {sorted(statuses)}: {r.body[:300]!r}"
    if not r.headers.get("content-type", "").startswith("application/json"):
        return f"content-type {r.headers.get('content-type')!r}: {r.body[:200]!r}"
    try:
        err = r.json()["error"]
    except Exception:
        return f"not an OpenAI error body: {r.body[:300]!r}"
    if not isinstance(err.get("message"), str) or not err["message"] or "type" not in err:
        return f"error without message/type: {err}"
    if r.status == 503 and "retry-after" not in r.headers:
        return "503 without Retry-After"
    return ""


def sse_events(body: bytes) -> list:
    out = []
    for line in body.decode("utf-8", "replace").split("\n"):
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


# -- checks ------------------------------------------------------------------------------------

RESULTS: list[tuple[str, bool, str]] = []
VERBOSE = False


def check(name, fn, *args):
    t0 = time.monotonic()
    try:
        why = fn(*args) or ""
    except Exception as e:  # noqa: BLE001 (a check that raises fails)
        why = f"raised {type(e).__name__}: {e}"
    ok = not why
    RESULTS.append((name, ok, why))
    print(f"{'PASS' if ok else 'FAIL'} {name} ({time.monotonic() - t0:.1f} s){'' if ok else ': ' + why}", flush=True)
    return ok


def expect_error(port, req: bytes, statuses=(400,), timeout=30.0) -> str:
    r = raw(port, req, timeout)
    return is_openai_error(r, set(statuses))


def expect_ok(port, path, body, timeout=60.0) -> str:
    r = raw(port, request_bytes("POST", path, body), timeout)
    if r.status != 200:
        return f"status {r.status}: {r.body[:300]!r}"
    if body.get("stream"):
        ev = sse_events(r.body)
        if not ev or ev[-1] != "[DONE]":
            return f"stream without [DONE]: {r.body[-200:]!r}"
        return ""
    j = r.json()
    if not j.get("choices"):
        return f"no choices: {j}"
    return ""


QUICK_STOPS = ["Israel", "LORD", "\n"]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def msgs(text="Hello"):
    return [{"role": "user", "content": text}]


def bad_bodies(vocab: int, context: int):
    """(name, path, body-or-bytes, allowed statuses): each must be an OpenAI error (or 200 where allowed)."""
    c = {"messages": msgs(), "max_tokens": 4}
    p = {"prompt": "Hello", "max_tokens": 4}
    B = []
    # JSON itself
    B += [("json: invalid", CHAT, b"{not json", (400,)),
          ("json: empty body", CHAT, b"", (400,)),
          ("json: top-level list", CHAT, b"[1,2]", (400,)),
          ("json: top-level string", CHAT, b'"hi"', (400,)),
          ("json: null", CHAT, b"null", (400,)),
          ("json: invalid utf-8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', (400,)),
          ("json: raw surrogate bytes", COMP, b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}', (400,)),
          ("json: escaped lone surrogate prompt", COMP, b'{"prompt": "a\\ud800b", "max_tokens": 2}', (400,)),
          ("json: escaped lone surrogate chat", CHAT,
           b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', (400,)),
          ("json: lone surrogate in a key", CHAT,
           b'{"messages": [{"role": "user", "content": "x"}], "\\ud800": 1, "max_tokens": 2}', (400,)),
          ("json: lone surrogate in stop", COMP, b'{"prompt": "x", "stop": ["\\ud800"], "max_tokens": 2}', (400,)),
          ("json: nested lists 100k", CHAT, b"[" * 100000 + b"]" * 100000, (400,)),
          ("json: nested objects 50k", CHAT, b'{"a":' * 50000 + b"1" + b"}" * 50000, (400,)),
          ("json: nested in messages 1000", CHAT,
           ('{"messages": [{"role": "user", "content": ' + "[" * 1000 + "]" * 1000 + "}]}").encode(), (400,)),
          ("json: huge int max_tokens", COMP, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", (400,)),
          ("json: 1e400 temperature", COMP, b'{"prompt": "x", "max_tokens": 2, "temperature": 1e400}', (400,)),
          ("json: NaN temperature", COMP, b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}', (400,)),
          ("json: Infinity top_p", COMP, b'{"prompt": "x", "max_tokens": 2, "top_p": Infinity}', (400,)),
          ("json: -Infinity max_tokens", COMP, b'{"prompt": "x", "max_tokens": -Infinity}', (400,)),
          ("json: huge int in prompt ids", COMP, b'{"prompt": [1' + b"0" * 400 + b"], \"max_tokens\": 2}", (400,)),
          ("json: 100k-digit seed", COMP, b'{"prompt": "x", "max_tokens": 2, "seed": ' + b"9" * 100000 + b"}",
           (400,)),
          ]
    # field types and values
    for name, val in [("max_tokens", "8"), ("max_tokens", 2.5), ("max_tokens", -1), ("max_tokens", 0),
                      ("max_tokens", 10 ** 12), ("max_tokens", True), ("max_tokens", [4]),
                      ("temperature", -1), ("temperature", "hot"), ("temperature", 1e308),
                      ("top_p", 1.5), ("top_p", -0.1), ("top_p", "x"), ("top_k", -3), ("top_k", 1.5),
                      ("min_p", 2), ("n", 2), ("n", 0), ("n", "1"),
                      ("stop", 5), ("stop", [1, 2]), ("stop", ["s%d" % i for i in range(50)]), ("stop", ""),
                      ("stop", {"a": 1}),
                      ("seed", 2 ** 64), ("seed", -1), ("seed", 1.5), ("seed", "42"),
                      ("logit_bias", {"abc": 1}), ("logit_bias", {"1": 1000}), ("logit_bias", {"1": "x"}),
                      ("logit_bias", {str(vocab + 5): 1}), ("logit_bias", {"-1": 1}), ("logit_bias", [1]),
                      ("logit_bias", {"1": None}),
                      ("presence_penalty", 3), ("frequency_penalty", "x"), ("repetition_penalty", -1),
                      ("stream", "yes"), ("stream_options", {"include_usage": True}),
                      ("response_format", {"type": "json_object"}), ("response_format", "json"),
                      ("draft", "eagle"), ("draft", 3), ("draft", "mtp"), ("num_draft", 100), ("num_draft", 0)]:
        allowed = (400,)
        if name == "stop" and isinstance(val, list) and len(val) == 50:
            allowed = (200, 400)
        if name == "max_tokens" and val == 10 ** 12:
            allowed = (200, 400)  # clipped to the context, or refused
        if name == "temperature" and val == 1e308:
            allowed = (200, 400)
        if name == "draft" and val == "mtp":
            allowed = (200,)  # the demo model has an MTP layer
        body = dict(p, **{name: val})
        if 200 in allowed:  # accepted: the demo model's greedy text meets one of these soon
            body.setdefault("stop", QUICK_STOPS)
        B.append((f"field: {name}={json.dumps(val)[:40]}", COMP, body, allowed))
    B += [("field: chat logprobs top_logprobs=21", CHAT, dict(c, logprobs=True, top_logprobs=21), (400,)),
          ("field: chat top_logprobs without logprobs", CHAT, dict(c, top_logprobs=3), (400,)),
          ("field: chat logprobs='yes'", CHAT, dict(c, logprobs="yes"), (400,)),
          ("field: completion logprobs=21", COMP, dict(p, logprobs=21), (400,)),
          ("field: completion logprobs=-1", COMP, dict(p, logprobs=-1), (400,)),
          ("field: prompt missing", COMP, {"max_tokens": 2}, (400,)),
          ("field: prompt empty list", COMP, {"prompt": [], "max_tokens": 2}, (400,)),
          ("field: prompt list of strings", COMP, {"prompt": ["a", "b"], "max_tokens": 2}, (400,)),
          ("field: prompt ids out of vocab", COMP, {"prompt": [vocab + 10], "max_tokens": 2}, (400,)),
          ("field: prompt ids negative", COMP, {"prompt": [-1], "max_tokens": 2}, (400,)),
          ("field: prompt ids floats", COMP, {"prompt": [1.5], "max_tokens": 2}, (400,)),
          ("field: prompt ids bools", COMP, {"prompt": [True], "max_tokens": 2}, (400,)),
          ("field: prompt nested lists", COMP, {"prompt": [[1, 2]], "max_tokens": 2}, (400,)),
          ("field: prompt = number", COMP, {"prompt": 5, "max_tokens": 2}, (400,)),
          ("field: prompt = null", COMP, {"prompt": None, "max_tokens": 2}, (400,)),
          ("messages: missing", CHAT, {"max_tokens": 2}, (400,)),
          ("messages: empty", CHAT, {"messages": [], "max_tokens": 2}, (400,)),
          ("messages: not a list", CHAT, {"messages": "hi", "max_tokens": 2}, (400,)),
          ("messages: item not an object", CHAT, {"messages": ["hi"], "max_tokens": 2}, (400,)),
          ("messages: no role", CHAT, {"messages": [{"content": "hi"}], "max_tokens": 2}, (400,)),
          ("messages: role not a string", CHAT, {"messages": [{"role": 5, "content": "hi"}], "max_tokens": 2}, (400,)),
          ("messages: unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2},
           (200, 400)),
          ("messages: only assistant", CHAT, {"messages": [{"role": "assistant", "content": "hi"}], "max_tokens": 2},
           (200, 400)),
          ("messages: two systems", CHAT, {"messages": [{"role": "system", "content": "a"},
                                                        {"role": "system", "content": "b"}], "max_tokens": 2},
           (200, 400)),
          ("messages: content null (user)", CHAT, {"messages": [{"role": "user", "content": None}], "max_tokens": 2},
           (400,)),
          ("messages: content number", CHAT, {"messages": [{"role": "user", "content": 5}], "max_tokens": 2},
           (400,)),
          ("messages: content image part", CHAT, {"messages": [{"role": "user", "content": [
              {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], "max_tokens": 2}, (400,)),
          ("messages: text+image parts", CHAT, {"messages": [{"role": "user", "content": [
              {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
              "max_tokens": 2}, (400,)),
          ("messages: input_audio part", CHAT, {"messages": [{"role": "user", "content": [
              {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}], "max_tokens": 2}, (400,)),
          ("messages: text part without text", CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}],
                                                      "max_tokens": 2}, (400,)),
          ("messages: text part text=5", CHAT, {"messages": [{"role": "user", "content": [
              {"type": "text", "text": 5}]}], "max_tokens": 2}, (400,)),
          ("messages: bad tool_calls", CHAT, {"messages": [{"role": "user", "content": "x"},
                                                           {"role": "assistant", "content": None, "tool_calls": "x"}],
                                              "max_tokens": 2}, (400,)),
          ("messages: tool_calls args not string", CHAT, {"messages": [
              {"role": "user", "content": "x"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": [1]}}}]}],
              "max_tokens": 2}, (200, 400)),
          ("messages: tool msg without id", CHAT, {"messages": [{"role": "user", "content": "x"},
                                                               {"role": "tool", "content": "r"}], "max_tokens": 2},
           (200, 400)),
          ("messages: extra fields", CHAT, {"messages": [{"role": "user", "content": "x", "name": {"a": 1},
                                                          "weird": [1, 2]}], "max_tokens": 2}, (200, 400)),
          ("tools: not a list", CHAT, dict(c, tools="x"), (400,)),
          ("tools: item not an object", CHAT, dict(c, tools=[1]), (400,)),
          ("tools: no function", CHAT, dict(c, tools=[{"type": "function"}]), (400,)),
          ("tools: function without name", CHAT, dict(c, tools=[{"type": "function", "function": {}}]), (400,)),
          ("tools: name not a string", CHAT, dict(c, tools=[{"type": "function", "function": {"name": 5}}]), (400,)),
          ("tools: parameters not an object", CHAT, dict(c, tools=[{"type": "function", "function": {
              "name": "f", "parameters": "x"}}]), (200, 400)),
          ("tools: deep parameters", CHAT, dict(c, tools=[{"type": "function", "function": {
              "name": "f", "parameters": json.loads('{"a":' * 60 + "1" + "}" * 60)}}]), (200, 400)),
          ("tools: tool_choice required", CHAT, dict(c, tools=[{"type": "function", "function": {"name": "f"}}],
                                                     tool_choice="required"), (400,)),
          ("tools: tool_choice bogus", CHAT, dict(c, tools=[{"type": "function", "function": {"name": "f"}}],
                                                  tool_choice="sometimes"), (400,)),
          ("tools: tool_choice auto without tools", CHAT, dict(c, tool_choice="auto"), (200, 400)),
          ("tools: tool_choice required without tools", CHAT, dict(c, tool_choice="required"), (400,)),
          ("tools: 500 tools", CHAT, dict(c, tools=[{"type": "function", "function": {"name": f"f{i}"}}
                                                    for i in range(500)]), (200, 400)),
          ("context: prompt ids > context", COMP, {"prompt": [1] * (context + 1), "max_tokens": 2}, (400,)),
          ("context: 1M-character prompt", COMP, {"prompt": "a " * 500000, "max_tokens": 2}, (400,)),
          ("context: 15 MB prompt", COMP, {"prompt": "x" * (15 << 20), "max_tokens": 2}, (400, 413)),
          ("context: 1M-character chat", CHAT, {"messages": msgs("hello " * 200000), "max_tokens": 2}, (400,)),
          ("context: 20k messages", CHAT, {"messages": [{"role": "user", "content": "hi"}] * 20000,
                                           "max_tokens": 2}, (400,)),
          ("context: prompt = context exactly", COMP, {"prompt": [1] * context, "max_tokens": 2}, (200, 400)),
          ("context: prompt = context - 1", COMP, {"prompt": [1] * (context - 1), "max_tokens": 50}, (200, 400)),
          ("context: max_tokens beyond context", COMP, {"prompt": "Hello", "max_tokens": context * 4,
                                                        "stop": QUICK_STOPS}, (200, 400)),
          ]
    return B


def body_check(port, path, body, allowed):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = raw(port, request_bytes("POST", path, data), timeout=60)
    if r.status == 200 and 200 in allowed:
        j = r.json()
        return "" if j.get("choices") else f"200 without choices: {j}"
    return is_openai_error(r, set(allowed) - {200})


# protocol-level -----------------------------------------------------------------------------

def protocol_checks(port, context):
    ok_body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    P = []

    def err(data, statuses=(400,)):
        return lambda: expect_error(port, data, statuses)

    P += [("http: garbage request line", err(b"GARBAGE\r\n\r\n")),
          ("http: binary junk", err(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64) + b"\r\n\r\n")),
          ("http: TLS client hello", err(bytes.fromhex("16030100a5010000a10303") + os.urandom(160), (400, 408))),
          ("http: bad version", err(b"GET /health HTTP/9.9\r\n\r\n", (400, 505))),
          ("http: empty line then EOF", lambda: _closed_quietly(port, b"\r\n")),
          ("http: 100 kB URL", err(b"GET /" + b"a" * 100000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", (414,))),
          ("http: 100 kB header", err(b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 100000 + b"\r\n\r\n", (431, 400))),
          ("http: 500 headers", err(b"GET /v1/models HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(500))
                                    + b"\r\n", (431, 400))),
          ("http: header without colon", lambda: _ok_or_error(port, b"GET /health HTTP/1.1\r\nnocolon\r\n\r\n")),
          ("http: 17 MB Content-Length", err(b"POST /v1/completions HTTP/1.1\r\n" + AUTH.encode()
                                            + b"Content-Length: 17000000\r\n\r\n{", (413,))),
          ("http: negative Content-Length", err(b"POST /v1/completions HTTP/1.1\r\n" + AUTH.encode()
                                               + b"Content-Length: -5\r\n\r\n", (400,))),
          ("http: Content-Length junk", err(b"POST /v1/completions HTTP/1.1\r\n" + AUTH.encode()
                                           + b"Content-Length: abc\r\n\r\n", (400,))),
          ("http: Content-Length 1e3", err(b"POST /v1/completions HTTP/1.1\r\n" + AUTH.encode()
                                          + b"Content-Length: 1e3\r\n\r\n", (400,))),
          ("http: two Content-Lengths", err(b"POST /v1/completions HTTP/1.1\r\n" + AUTH.encode()
                                           + b"Content-Length: 5\r\nContent-Length: %d\r\n\r\n" % len(ok_body)
                                           + ok_body, (400,))),
          ("http: Content-Length too short", err(b"POST /v1/completions HTTP/1.1\r\n" + AUTH.encode()
                                                + b"Content-Length: 10\r\nConnection: close\r\n\r\n" + ok_body,
                                                (400,))),
          ("http: Content-Length too long (read timeout)",
           err(b"POST /v1/completions HTTP/1.1\r\n" + AUTH.encode() + b"Content-Length: %d\r\n\r\n" % (len(ok_body) + 50)
               + ok_body, (400, 408))),
          ("http: chunked body", err(b"POST /v1/completions HTTP/1.1\r\n" + AUTH.encode()
                                    + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(ok_body) + ok_body
                                    + b"\r\n0\r\n\r\n", (400, 411, 501))),
          ("http: chunked + Content-Length", err(b"POST /v1/completions HTTP/1.1\r\n" + AUTH.encode()
                                                + b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n"
                                                % len(ok_body) + ok_body, (400, 411, 501))),
          ("http: unknown path GET", err(request_bytes("GET", "/nope"), (404,))),
          ("http: unknown path POST", err(request_bytes("POST", "/v1/nope", {"a": 1}), (404,))),
          ("http: path traversal", err(request_bytes("GET", "/../../etc/passwd"), (404, 400))),
          ("http: absolute-form URL", lambda: _status_in(port, request_bytes("GET", "http://x/v1/models"), (200, 404))),
          ("http: asterisk GET", err(request_bytes("GET", "*"), (404, 400))),
          ("http: GET on a POST route", err(request_bytes("GET", "/v1/chat/completions"), (404, 405))),
          ("http: POST on a GET route", err(request_bytes("POST", "/v1/models", {"a": 1}), (404, 405))),
          ("http: HEAD unknown path", lambda: _head(port, "/nope", 404)),
          ("http: HEAD /v1/models", lambda: _head(port, "/v1/models", 200)),
          ("http: HEAD /health", lambda: _head(port, "/health", 200)),
          ("http: /v1/models/unknown", err(request_bytes("GET", "/v1/models/nope"), (404,))),
          ("http: /v1/models/%00", err(request_bytes("GET", "/v1/models/%00"), (404,))),
          ("http: query string", lambda: _status_in(port, request_bytes("GET", "/v1/models?x=%ff&&=="), (200,))),
          ]
    for m in ("PUT", "DELETE", "PATCH", "TRACE", "CONNECT", "FOO", "get"):
        P.append((f"http: method {m}", err(request_bytes(m, "/v1/models"), (400, 404, 405, 501))))
    P += [("http: HTTP/1.0", lambda: _http10(port)),
          ("http: HTTP/1.0 keep-alive", lambda: _http10(port, keep=True)),
          ("http: keep-alive reuse x5", lambda: _keepalive(port)),
          ("http: pipelined 4 requests", lambda: _pipelined(port, PIPELINED, [200] * 4)),
          ("http: pipelined error then ok", lambda: _pipelined(port, PIPELINED_ERROR, [400, 200])),
          ("cors: preflight", lambda: _preflight(port)),
          ("cors: origin on errors", lambda: _cors_on_error(port)),
          ("auth: missing key", err(request_bytes("POST", COMP, {"prompt": "x"}, auth=False), (401,))),
          ("auth: wrong key", err(request_bytes("POST", COMP, {"prompt": "x"}, auth=False,
                                                headers="Authorization: Bearer nope\r\n"), (401,))),
          ("auth: Basic scheme", err(request_bytes("POST", COMP, {"prompt": "x"}, auth=False,
                                                   headers="Authorization: Basic c2Vrcml0\r\n"), (401,))),
          ("auth: non-ASCII key", err(request_bytes("GET", "/v1/models", auth=False,
                                                    headers="Authorization: Bearer \xe9\xe9\r\n"), (401,))),
          ("auth: key on GET /v1/models", err(request_bytes("GET", "/v1/models", auth=False), (401,))),
          ("auth: unknown path without key", err(request_bytes("GET", "/nope", auth=False), (401, 404))),
          ("auth: health open", lambda: _status_in(port, request_bytes("GET", "/health", auth=False), (200,))),
          ("auth: right key", lambda: expect_ok(port, COMP, {"prompt": "Hello", "max_tokens": 2})),
          ]
    return P


def _status_in(port, data, statuses):
    r = raw(port, data)
    return "" if r.status in statuses else f"status {r.status}: {r.body[:200]!r}"


def _ok_or_error(port, data):
    r = raw(port, data)
    return "" if r.status == 200 else is_openai_error(r, {400})


def _closed_quietly(port, data):
    with connect(port, 10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        try:
            got = s.recv(65536)
        except ConnectionResetError:
            return "reset"
        if got and not got.startswith(b"HTTP/1.1 4"):
            return f"answered {got[:100]!r}"
    return ""


def _head(port, path, status):
    with connect(port, 10) as s:
        s.sendall(request_bytes("HEAD", path, close=False))
        r, rest = read_reply(s, head_only=True)
        if r.status != status:
            return f"status {r.status}"
        s.sendall(request_bytes("GET", "/health"))  # no body was sent: the connection is in step
        r2, _ = read_reply(s, rest)
        if r2.status != 200 or r2.json() != {"status": "ok"}:
            return f"the HEAD response carried a body: next reply {r2}"
    return ""


def _http10(port, keep=False):
    hdr = "Connection: keep-alive\r\n" if keep else ""
    with connect(port, 30) as s:
        s.sendall(request_bytes("POST", COMP, {"prompt": "Hello", "max_tokens": 2}, version="HTTP/1.0", close=False,
                                headers=hdr))
        r, _ = read_reply(s)
        if r.status != 200 or not r.json().get("choices"):
            return f"{r}"
        if not r.raw.startswith(b"HTTP/1."):
            return f"status line {r.raw[:20]!r}"
    return ""


def _keepalive(port):
    with connect(port, 30) as s:
        rest = b""
        for i in range(5):
            body = {"prompt": "Hello", "max_tokens": 2} if i % 2 == 0 else {"prompt": 5}
            s.sendall(request_bytes("POST", COMP, body, close=False))
            r, rest = read_reply(s, rest)
            if r.status != (200 if i % 2 == 0 else 400):
                return f"request {i}: {r}"
    return ""


def _pipelined(port, reqs: list, expected: list) -> str:
    """``reqs`` sent in one write on one connection: answered in order with ``expected`` statuses."""
    with connect(port, 30) as s:
        s.sendall(b"".join(reqs))
        rest, statuses = b"", []
        for _ in reqs:
            r, rest = read_reply(s, rest)
            statuses.append(r.status)
    return "" if statuses == expected else f"statuses {statuses}"


PIPELINED = [request_bytes("POST", COMP, {"prompt": "Hello", "max_tokens": 2}, close=False),
             request_bytes("GET", "/v1/models", close=False),
             request_bytes("POST", CHAT, {"messages": msgs(), "max_tokens": 2}, close=False),
             request_bytes("GET", "/health")]
PIPELINED_ERROR = [request_bytes("POST", COMP, b"{bad", close=False), request_bytes("GET", "/health")]


def _preflight(port):
    data = (b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: " + ORIGIN.encode()
            + b"\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type"
              b"\r\nConnection: close\r\n\r\n")
    r = raw(port, data)
    if r.status not in (200, 204):
        return f"{r}"
    h = r.headers
    if h.get("access-control-allow-origin") != ORIGIN or "POST" not in h.get("access-control-allow-methods", ""):
        return f"CORS headers missing: {h}"
    if "authorization" not in h.get("access-control-allow-headers", "").lower():
        return f"Authorization not allowed: {h}"
    return ""


def _cors_on_error(port):
    r = raw(port, request_bytes("POST", COMP, {"prompt": 5}, headers=f"Origin: {ORIGIN}\r\n"))
    if r.headers.get("access-control-allow-origin") != ORIGIN:
        return f"no CORS header on a 400: {r.headers}"
    r = raw(port, request_bytes("POST", COMP, {"prompt": "x"}, auth=False, headers=f"Origin: {ORIGIN}\r\n"))
    if r.headers.get("access-control-allow-origin") != ORIGIN:
        return f"no CORS header on a 401: {r.headers}"
    return ""


# load ----------------------------------------------------------------------------------------

def _openai_crowd(port, n):
    import openai
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait()
        try:
            if i % 2:
                r = client.chat.completions.create(model="m", messages=msgs(f"Hi {i}"), max_tokens=4)
                return "ok" if r.choices[0].finish_reason in ("stop", "length") else f"finish {r.choices[0]}"
            chunks = list(client.completions.create(model="m", prompt=f"Hi {i}", max_tokens=4, stream=True))
            return "ok" if chunks and chunks[-1].choices[0].finish_reason in ("stop", "length") else "no finish"
        except openai.APIStatusError as e:
            return "busy" if e.status_code == 503 else f"status {e.status_code}: {e}"
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"

    with ThreadPoolExecutor(n) as ex:
        res = list(ex.map(one, range(n)))
    bad = [r for r in res if r not in ("ok", "busy")]
    return f"{len(bad)}/{n} failed: {bad[:3]}" if bad else ""


def _raw_crowd(port, n, stream=False):
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait()
        try:
            body = {"prompt": f"Crowd {i}", "max_tokens": 3, "stream": stream}
            r = raw(port, request_bytes("POST", COMP, body), timeout=120)
            if r.status == 503:
                return is_openai_error(r, {503}) or "busy"
            if r.status != 200:
                return f"status {r.status}"
            if stream:
                ev = sse_events(r.body)
                return "ok" if ev and ev[-1] == "[DONE]" else "stream without [DONE]"
            return "ok"
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"

    with ThreadPoolExecutor(n) as ex:
        res = list(ex.map(one, range(n)))
    bad = [r for r in res if r not in ("ok", "busy")]
    busy = res.count("busy")
    if VERBOSE:
        print(f"    {n} raw: {res.count('ok')} ok, {busy} busy")
    return f"{len(bad)}/{n} failed: {bad[:3]}" if bad else ""


def _connect_storm(port, n):
    """n connections opened at once (before any sends): none refused or reset."""
    socks, errors = [], []
    try:
        for _ in range(n):
            try:
                socks.append(connect(port, 30))
            except OSError as e:
                errors.append(repr(e))
        for s in socks:
            s.sendall(request_bytes("GET", "/health"))
        answered = 0
        for s in socks:
            try:
                r, _ = read_reply(s)
                answered += r.status in (200, 503)
            except OSError as e:
                errors.append(repr(e))
    finally:
        for s in socks:
            s.close()
    return f"{len(errors)} errors {errors[:3]}, {answered}/{n} answered" if errors or answered != n else ""


def _half_sent(port, n):
    """n connections each sending half a request head; meanwhile a normal request is answered quickly;
    the half requests get 408 or a quiet close after the read timeout."""
    socks = []
    try:
        for i in range(n):
            s = connect(port, 30)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            socks.append(s)
        t0 = time.monotonic()
        why = expect_ok(port, COMP, {"prompt": "Hello", "max_tokens": 2}, timeout=20)
        if why:
            return f"normal request with {n} half-sent: {why}"
        if time.monotonic() - t0 > 5:
            return f"normal request took {time.monotonic() - t0:.1f} s with {n} half-sent"
        # half a body too
        s = connect(port, 30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH.encode() + b"Content-Length: 100\r\n\r\n{\"pro")
        socks.append(s)
        deadline = time.monotonic() + READ_TIMEOUT + 15
        pending = list(socks)
        bad = []
        for s in pending:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                got = s.recv(65536)
            except ConnectionResetError:
                bad.append("reset")
                continue
            except socket.timeout:
                bad.append("still open past the read timeout")
                continue
            if got and not got.startswith(b"HTTP/1.1 408"):
                bad.append(got[:60])
        if bad:
            return f"{len(bad)}/{len(pending)} bad: {bad[:3]}"
        return ""
    finally:
        for s in socks:
            s.close()


def _slowloris(port):
    """Headers at one byte a second: cut at the read timeout (408 or close), while others are served."""
    data = request_bytes("POST", COMP, {"prompt": "x", "max_tokens": 2})
    s = connect(port, 30)
    t0 = time.monotonic()
    result = {}

    def drip():
        try:
            for b in data:
                s.sendall(bytes([b]))
                time.sleep(1.0)
                if time.monotonic() - t0 > READ_TIMEOUT + 8:
                    result["why"] = "still reading after read timeout + 8 s"
                    return
        except OSError:
            pass

    th = threading.Thread(target=drip, daemon=True)
    th.start()
    why = expect_ok(port, COMP, {"prompt": "Hello", "max_tokens": 2}, timeout=10)
    s.settimeout(READ_TIMEOUT + 10)
    try:
        got = s.recv(65536)
    except ConnectionResetError:
        got = b"reset"
    except socket.timeout:
        got = b"timeout"
    s.close()
    th.join(12)
    if why:
        return f"others blocked: {why}"
    if "why" in result:
        return result["why"]
    if got not in (b"",) and not got.startswith(b"HTTP/1.1 408"):
        return f"got {got[:80]!r}"
    if not got.startswith(b"HTTP/1.1 408"):
        return "closed without a 408"
    return ""


def _longer_than_read_timeout(port, stream):
    """A generation running past --read-timeout is answered in full (the timeout is for reading requests)."""
    eos = [str(i) for i in range(3)]  # the demo model's special ids; banning them keeps it talking
    body = {"prompt": "And the LORD spake unto Moses, saying", "max_tokens": 240, "stream": stream,
            "logit_bias": {i: -100 for i in eos}}
    t0 = time.monotonic()
    r = raw(port, request_bytes("POST", COMP, body), timeout=60)
    dt = time.monotonic() - t0
    if r.status != 200:
        return f"{r}"
    if stream:
        ev = sse_events(r.body)
        n = sum(1 for e in ev if e != "[DONE]" and e["choices"] and e["choices"][0]["text"])
        if ev[-1] != "[DONE]":
            return "no [DONE]"
    else:
        n = r.json()["usage"]["completion_tokens"]
    if dt < READ_TIMEOUT:
        return f"ran {dt:.1f} s, not longer than the read timeout: inconclusive"
    return "" if n >= 200 else f"only {n} tokens"


def _idle_keepalive(port):
    with connect(port, READ_TIMEOUT + 10) as s:
        s.sendall(request_bytes("GET", "/health", close=False))
        r, rest = read_reply(s)
        t0 = time.monotonic()
        got = s.recv(100)
        dt = time.monotonic() - t0
    if r.status != 200 or got:
        return f"{r} then {got[:80]!r}"
    return "" if dt < READ_TIMEOUT + 5 else f"closed after {dt:.1f} s"


def _short_during_long_prefill(port):
    """A short request sent while a long prompt is in prefill is not held up until that prefill ends."""
    box = {}
    long = threading.Thread(target=lambda: box.setdefault("r", raw(port, request_bytes(
        "POST", COMP, {"prompt": [11 + i % 3000 for i in range(1000)], "max_tokens": 1}), timeout=120)))
    t0 = time.monotonic()
    long.start()
    time.sleep(0.5)
    t1 = time.monotonic()
    why = expect_ok(port, COMP, {"prompt": "Hello", "max_tokens": 2}, timeout=60)
    short = time.monotonic() - t1
    long.join(120)
    total = time.monotonic() - t0
    if why or box.get("r") is None or box["r"].status != 200:
        return why or f"long: {box.get('r')}"
    return "" if short < max(2.0, total / 3) else f"the short request took {short:.1f} s of the long one's {total:.1f} s"


def _full_server():
    """A server with 2 slots (and 8 waiting places) under 40 requests at once: each one answered, the
    ones past the waiting places with 503 and Retry-After, none reset."""
    srv = Server("--max-connections", "2")
    try:
        barrier = threading.Barrier(40)

        def one(i):
            barrier.wait()
            try:
                r = raw(srv.port, request_bytes("POST", COMP, {"prompt": f"Full {i}", "max_tokens": 8}), 60)
            except Exception as e:  # noqa: BLE001
                return f"{type(e).__name__}: {e}"
            return r.status if r.status == 200 else (is_openai_error(r, {503}) or 503)

        with ThreadPoolExecutor(40) as ex:
            res = list(ex.map(one, range(40)))
        bad = [r for r in res if r not in (200, 503)]
        if bad:
            return f"{len(bad)} bad: {bad[:3]}"
        if 503 not in res or 200 not in res:
            return f"expected both 200 and 503: {res.count(200)} x 200, {res.count(503)} x 503"
        why = expect_ok(srv.port, COMP, {"prompt": "after", "max_tokens": 2})
        rc = srv.stop(signal.SIGTERM)
        return why or ("" if rc == 0 else f"exit {rc}")
    finally:
        srv.stop(signal.SIGKILL, 5)


def _template_failures(base: str):
    """A chat template that raises, divides by zero or loops without end: a 400 each, quickly."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for f in os.listdir(base):
            if f != "tokenizer_config.json":
                shutil.copy(os.path.join(base, f), os.path.join(d, f))
        cfg = json.load(open(os.path.join(base, "tokenizer_config.json")))
        cfg["chat_template"] = (
            "{{ bos_token }}{% for m in messages %}"
            "{% if m['content'] == 'raise' %}{{ raise_exception('the template refuses') }}{% endif %}"
            "{% if m['content'] == 'zero' %}{{ 1 // 0 }}{% endif %}"
            "{% if m['content'] == 'undefined' %}{{ m.nothing.deeper }}{% endif %}"
            "{% if m['content'] == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}x"
            "{% endfor %}{% endfor %}{% endif %}"
            "{% if m['content'] == 'grow' %}{% set ns = namespace(s='x') %}{% for i in range(40) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}{% endif %}"
            "{% if m['content'] == 'attr' %}{{ m.__class__.__mro__ }}{% endif %}"
            "{{ m['content'] }}\n{% endfor %}")
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f)
        srv = Server("-m", d)
        try:
            bad = []
            for what in ("raise", "zero", "undefined", "loop", "grow", "attr"):
                t0 = time.monotonic()
                try:
                    r = raw(srv.port, request_bytes("POST", CHAT, {"messages": msgs(what), "max_tokens": 2}), 60)
                except Exception as e:  # noqa: BLE001
                    bad.append(f"{what}: {e}")
                    continue
                dt = time.monotonic() - t0
                why = "" if r.status == 200 and what == "undefined" else is_openai_error(r, {400})
                if why or dt > 10:
                    bad.append(f"{what}: {why or f'{dt:.1f} s'}")
            why = expect_ok(srv.port, CHAT, {"messages": msgs("fine"), "max_tokens": 2})
            if why:
                bad.append(f"after: {why}")
            rc = srv.stop(signal.SIGTERM)
            if rc != 0 or "Traceback" in srv.text():
                bad.append(f"exit {rc}: {srv.text()[-1000:]}")
            return "; ".join(bad)
        finally:
            srv.stop(signal.SIGKILL, 5)


def _disconnects(port, stream):
    """Clients that send long requests and leave (streaming or not): a short request afterwards is served
    quickly, i.e. the abandoned generations were cancelled and do not hold the batch."""
    long = {"prompt": "Tell me a long story", "max_tokens": 4000, "stream": stream, "temperature": 0.8}
    socks = []
    for _ in range(40):
        s = connect(port, 30)
        s.sendall(request_bytes("POST", COMP, long, close=False))
        socks.append(s)
    time.sleep(1.5)
    for s in socks:
        if stream:
            s.recv(100)  # the stream began
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        s.close()
    time.sleep(1.0)
    t0 = time.monotonic()
    why = expect_ok(port, COMP, {"prompt": "Hello", "max_tokens": 8}, timeout=30)
    dt = time.monotonic() - t0
    if why:
        return why
    # a short request alone takes well under a second on the demo model; 40 rows running alongside slow it
    return "" if dt < 3.0 else f"a short request took {dt:.1f} s after 40 clients left"


def _signal_mid_stream(sig, n=24):
    srv = Server()
    try:
        port = srv.port
        socks = []
        for i in range(n):
            s = connect(port, 60)
            stream = i % 3 != 2
            body = {"prompt": f"Story {i}", "max_tokens": 2000, "stream": stream}
            if i % 2:
                body = {"messages": msgs(f"Story {i}"), "max_tokens": 2000, "stream": stream}
                path = CHAT
            else:
                path = COMP
            s.sendall(request_bytes("POST", path, body))
            socks.append((s, stream))
        time.sleep(2.0)
        srv.proc.send_signal(sig)
        bad = []
        for i, (s, stream) in enumerate(socks):
            try:
                r, _ = read_reply(s)
            except Exception as e:  # noqa: BLE001
                bad.append(f"{i}: {e}")
                continue
            if stream:
                if r.status != 200:
                    bad.append(f"{i}: {r}")
                    continue
                ev = sse_events(r.body)
                fins = [e for e in ev if e != "[DONE]" and e.get("choices") and e["choices"][0].get("finish_reason")]
                if not ev or ev[-1] != "[DONE]" or not fins:
                    bad.append(f"{i}: stream ended without a final chunk: {r.body[-200:]!r}")
            elif r.status != 200 and is_openai_error(r, {503}):
                bad.append(f"{i}: {r}")
            s.close()
        rc = srv.proc.wait(30)
        if "terminate called" in srv.text() or "Traceback" in srv.text():
            bad.append("log: " + srv.text()[-1500:])
        if rc != 0:
            bad.append(f"exit status {rc}")
        return "; ".join(bad[:4])
    finally:
        srv.stop(signal.SIGKILL, 5)


def _second_signal_during_drain():
    srv = Server()
    try:
        s = connect(srv.port, 60)
        s.sendall(request_bytes("POST", COMP, {"prompt": "x", "max_tokens": 2000, "stream": True}))
        s.recv(100)
        srv.proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        srv.proc.send_signal(signal.SIGINT)
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(30)
        s.close()
        if "terminate called" in srv.text():
            return "terminate called"
        return "" if rc == 0 else f"exit status {rc}: {srv.text()[-800:]}"
    finally:
        srv.stop(signal.SIGKILL, 5)


# main ----------------------------------------------------------------------------------------

def main():
    global VERBOSE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-k", default="", help="run only the checks whose name contains this")
    ap.add_argument("-v", action="store_true")
    args = ap.parse_args()
    VERBOSE = args.v
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))  # the server inherits it

    t_start = time.monotonic()
    srv = Server()
    port = srv.port
    models = json.loads(raw(port, request_bytes("GET", "/v1/models")).body)
    import colibri_mlx
    model, tokenizer = colibri_mlx.load(None)
    vocab, context = tokenizer.vocab_size, model.max_length
    del model
    print(f"serving on port {port}; vocab {vocab}, context {context}; {models['data'][0]['id']}", flush=True)

    def run(name, fn, *a):
        if args.k in name:
            check(name, fn, *a)
            if not srv.alive():
                print(f"FAIL server died after {name}:\n{srv.text()[-3000:]}")
                sys.exit(1)

    for name, fn in protocol_checks(port, context):
        run(name, fn)
    for name, path, body, allowed in bad_bodies(vocab, context):
        run(name, body_check, port, path, body, allowed)
    run("openai: chat, logprobs, usage, stream_options", _openai_fidelity, port)
    run("slow: whole answer longer than the read timeout", _longer_than_read_timeout, port, False)
    run("slow: stream longer than the read timeout", _longer_than_read_timeout, port, True)
    run("slow: idle keep-alive closed after the read timeout", _idle_keepalive, port)
    run("load: a short request during a long prefill", _short_during_long_prefill, port)
    run("load: 64 openai clients at once", _openai_crowd, port, 64)
    run("load: 200 openai clients at once", _openai_crowd, port, 200)
    run("load: 200 raw clients at once", _raw_crowd, port, 200)
    run("load: 200 raw streams at once", _raw_crowd, port, 200, True)
    run("load: 1000 connections opened before sending", _connect_storm, port, 1000)
    run("load: 2000 half-sent requests", _half_sent, port, 2000)
    run("load: slowloris (1 byte/s)", _slowloris, port)
    run("disconnect: 40 whole requests leave", _disconnects, port, False)
    run("disconnect: 40 streams leave", _disconnects, port, True)
    run("alive: a request after everything", expect_ok, port, CHAT, {"messages": msgs(), "max_tokens": 4})
    if srv.text().count("Traceback"):
        RESULTS.append(("log: no tracebacks", False, srv.text()[srv.text().find("Traceback"):][:1500]))
        print("FAIL log: tracebacks in the server log:\n" + srv.text()[srv.text().find("Traceback"):][:1500])
    rc = srv.stop(signal.SIGTERM)
    if args.k in "shutdown: idle SIGTERM exits 0":
        RESULTS.append(("shutdown: idle SIGTERM exits 0", rc == 0, f"exit {rc}"))
        print(f"{'PASS' if rc == 0 else 'FAIL'} shutdown: idle SIGTERM exits 0 (exit {rc})")
    for sig in (signal.SIGINT, signal.SIGTERM):
        name = f"shutdown: {sig.name} with 24 requests running"
        if args.k in name:
            check(name, _signal_mid_stream, sig)
    if args.k in "shutdown: second signal during the drain":
        check("shutdown: second signal during the drain", _second_signal_during_drain)
    if args.k in "load: 503 with Retry-After when full":
        check("load: 503 with Retry-After when full", _full_server)
    if args.k in "template: failing chat templates":
        check("template: failing chat templates", _template_failures,
              os.path.join(os.path.dirname(colibri_mlx.__file__), "demo"))
    failed = [r for r in RESULTS if not r[1]]
    print(f"\n{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed in {time.monotonic() - t_start:.0f} s")
    for name, _, why in failed:
        print(f"  FAIL {name}: {why[:300]}")
    sys.exit(1 if failed else 0)


def _openai_fidelity(port):
    import openai
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    r = c.chat.completions.create(model="m", messages=msgs(), max_tokens=4, logprobs=True, top_logprobs=3)
    if not r.choices[0].logprobs or len(r.choices[0].logprobs.content[0].top_logprobs) != 3:
        return f"chat logprobs: {r.choices[0].logprobs}"
    if not r.system_fingerprint:
        return "no system_fingerprint"
    r = c.completions.create(model="m", prompt="Hello", max_tokens=4, logprobs=2)
    if not r.choices[0].logprobs or len(r.choices[0].logprobs.top_logprobs[0]) != 2:
        return f"completion logprobs: {r.choices[0].logprobs}"
    chunks = list(c.chat.completions.create(model="m", messages=msgs(), max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    if chunks[-1].choices or not chunks[-1].usage or any(ch.usage for ch in chunks[:-1]):
        return f"include_usage: last chunk {chunks[-1]}"
    chunks = list(c.chat.completions.create(model="m", messages=msgs(), max_tokens=4, stream=True))
    if any(ch.usage for ch in chunks):
        return "usage without include_usage"
    if c.models.retrieve(c.models.list().data[0].id).object != "model":
        return "models.retrieve"
    try:
        c.models.retrieve("nope")
        return "models.retrieve('nope') did not raise"
    except openai.NotFoundError:
        pass
    r = c.chat.completions.create(model="m", messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], max_tokens=4,
        tools=[{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}],
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"1": -100}, seed=7, temperature=0.7)
    if r.choices[0].finish_reason not in ("stop", "length", "tool_calls"):
        return f"tool round trip: {r}"
    for kw in ({"response_format": {"type": "json_object"}}, {"n": 2}):
        try:
            c.chat.completions.create(model="m", messages=msgs(), max_tokens=2, **kw)
            return f"{kw} accepted"
        except openai.BadRequestError:
            pass
    return ""


if __name__ == "__main__":
    main()

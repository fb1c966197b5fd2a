"""`colibri serve` driven by the official `openai` client: logprobs against a direct forward of the
model, penalties and logit_bias against a float64 numpy re-implementation, tool calls (the three
output formats on exact strings, and end to end through a scripted engine), OpenAI-shaped errors
for protocol-level failures, and the robustness points (bounded pool, read timeouts, client
disconnects, API key, CORS, graceful shutdown on SIGINT).
"""

from __future__ import annotations

import copy
import errno
import http.client
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")

import mlx.core as mx  # noqa: E402

import colibri_mlx  # noqa: E402
from colibri_mlx.serve import ModelServer  # noqa: E402
from colibri_mlx.serve_engine import TokenEvent  # noqa: E402
from colibri_mlx.serve_reader import request_ready  # noqa: E402
from colibri_mlx.serve_tools import ToolCallFilter, parse_tool_calls  # noqa: E402

PROMPT = "And the LORD spake unto Moses, saying"
CHAT = [{"role": "user", "content": "In the beginning God created the heaven and the earth."}]


@pytest.fixture(scope="module")
def demo():
    return colibri_mlx.load(None)


def start(srv):
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    return thread


def stop(srv, thread):
    srv.shutdown()
    srv.server_close()
    thread.join(5)


@pytest.fixture(scope="module")
def server(demo):
    srv = ModelServer(("127.0.0.1", 0), *demo, "colibri-demo", log=io.StringIO())
    thread = start(srv)
    yield srv
    stop(srv, thread)


def client(srv, **kw):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0,
                         timeout=60, **kw)


def forward_logprobs(demo, ids) -> np.ndarray:
    """float64 log-softmax of a full forward (no cache) over ``ids``: row i predicts token i+1."""
    model, _ = demo
    logits = np.array(model(mx.array([ids]), model.make_cache())[0].astype(mx.float32), dtype=np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)


def greedy_ids(demo, prompt_ids, n):
    return [r.token for r in colibri_mlx.stream_generate(*demo, prompt_ids, max_tokens=n)]


# --- OpenAI fidelity -------------------------------------------------------------------------

def test_completion_logprobs_match_a_direct_forward(server, demo):
    _, tok = demo
    n, k = 5, 3
    r = client(server).completions.create(model="colibri-demo", prompt=PROMPT, max_tokens=n, logprobs=k)
    prompt_ids = tok.encode(PROMPT)
    gen = greedy_ids(demo, prompt_ids, n)
    lp = forward_logprobs(demo, prompt_ids + gen[:-1])[len(prompt_ids) - 1:]
    got = r.choices[0].logprobs
    assert got.tokens == [tok.decode([t]) for t in gen]
    np.testing.assert_allclose(got.token_logprobs, [lp[i, t] for i, t in enumerate(gen)], atol=2e-3)
    for i, top in enumerate(got.top_logprobs):
        best = np.argsort(-lp[i])[:k]
        assert list(top) == [tok.decode([int(t)]) for t in best]
        np.testing.assert_allclose(list(top.values()), lp[i, best], atol=2e-3)
    assert got.text_offset == list(np.cumsum([0] + [len(t) for t in got.tokens[:-1]]))
    assert r.system_fingerprint and r.system_fingerprint.startswith("fp_")


def test_chat_logprobs_streamed_and_whole(server, demo):
    _, tok = demo
    n, k = 4, 2
    c = client(server)
    whole = c.chat.completions.create(model="colibri-demo", messages=CHAT, max_tokens=n, logprobs=True,
                                      top_logprobs=k)
    prompt_ids = tok.encode_chat(CHAT)
    gen = greedy_ids(demo, prompt_ids, n)
    lp = forward_logprobs(demo, prompt_ids + gen[:-1])[len(prompt_ids) - 1:]
    content = whole.choices[0].logprobs.content
    assert [e.token for e in content] == [tok.decode([t]) for t in gen]
    np.testing.assert_allclose([e.logprob for e in content], [lp[i, t] for i, t in enumerate(gen)], atol=2e-3)
    assert all(e.top_logprobs[0].token == e.token and len(e.top_logprobs) == k for e in content)  # greedy
    assert content[0].bytes == list(content[0].token.encode())
    streamed = [e for ch in c.chat.completions.create(model="x", messages=CHAT, max_tokens=n, logprobs=True,
                                                      top_logprobs=k, stream=True)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    # the second request starts from the prompt cache: its last prompt row is a decode row, not
    # a prefill row (the same values up to float32 rounding)
    assert [e.token for e in streamed] == [e.token for e in content]
    np.testing.assert_allclose([e.logprob for e in streamed], [e.logprob for e in content], atol=1e-4)
    plain = c.chat.completions.create(model="x", messages=CHAT, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_logprobs_do_not_change_seeded_sampling(server):
    c = client(server)
    kw = dict(model="x", prompt=PROMPT, max_tokens=6, temperature=1.5, seed=7)
    plain = c.completions.create(**kw).choices[0].text
    with_lp = c.completions.create(**kw, logprobs=2).choices[0]
    assert with_lp.text == plain and "".join(with_lp.logprobs.tokens) == plain


def test_logprobs_under_a_server_default_draft(demo):
    from colibri_mlx.serve import SamplingDefaults

    srv = ModelServer(("127.0.0.1", 0), *demo, "colibri-demo", defaults=SamplingDefaults(draft="ngram"),
                      log=io.StringIO())
    thread = start(srv)
    try:
        c = client(srv)
        r = c.completions.create(model="x", prompt=PROMPT, max_tokens=2, logprobs=1)  # plain decoding for it
        assert len(r.choices[0].logprobs.token_logprobs) == 2
        with pytest.raises(openai.BadRequestError, match="need draft='none'"):
            c.completions.create(model="x", prompt=PROMPT, max_tokens=2, logprobs=1, extra_body={"draft": "ngram"})
    finally:
        stop(srv, thread)


def test_models_retrieve_and_unknown_is_404(server):
    c = client(server)
    assert c.models.retrieve("colibri-demo").id == "colibri-demo"
    assert [m.id for m in c.models.list()] == ["colibri-demo"]
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-7")
    assert e.value.body["code"] == "model_not_found"


def test_usage_chunk_only_when_asked(server):
    c = client(server)
    plain = list(c.completions.create(model="x", prompt=PROMPT, max_tokens=3, stream=True))
    assert all(ch.usage is None for ch in plain) and plain[-1].choices[0].finish_reason == "length"
    asked = list(c.completions.create(model="x", prompt=PROMPT, max_tokens=3, stream=True,
                                      stream_options={"include_usage": True}))
    assert asked[-1].choices == [] and asked[-1].usage.completion_tokens == 3
    assert all(ch.usage is None for ch in asked[:-1])
    assert "".join(ch.choices[0].text for ch in asked[:-1]) == "".join(ch.choices[0].text for ch in plain)
    with pytest.raises(openai.BadRequestError, match="only allowed with"):
        c.completions.create(model="x", prompt=PROMPT, max_tokens=3, stream_options={"include_usage": True})


def penalized_greedy(demo, prompt_ids, n, presence=0.0, frequency=0.0, bias=None):
    """The oracle: full forwards, OpenAI's penalty rule in float64 numpy, argmax; the tokens and
    their log-probabilities under the penalized logits."""
    gen, lps = [], []
    for _ in range(n):
        logits = forward_logprobs(demo, prompt_ids + gen)[-1]  # a log-softmax: logits up to a constant
        if bias:
            for t, b in bias.items():
                logits[t] += b
        for t in set(gen):
            logits[t] -= gen.count(t) * frequency + presence
        gen.append(int(np.argmax(logits)))
        lps.append(logits[gen[-1]] - np.log(np.exp(logits - logits.max()).sum()) - logits.max())
    return gen, lps


def test_presence_frequency_penalties_and_logit_bias(server, demo):
    _, tok = demo
    c = client(server)
    prompt = "The LORD is my shepherd"
    prompt_ids = tok.encode(prompt)
    n = 10
    plain = greedy_ids(demo, prompt_ids, n)
    expected, lps = penalized_greedy(demo, prompt_ids, n, presence=1.5, frequency=0.75)
    assert expected != plain  # the premise: the penalties change the greedy text
    r = c.completions.create(model="x", prompt=prompt, max_tokens=n, presence_penalty=1.5, frequency_penalty=0.75,
                             logprobs=0)
    assert r.choices[0].text == tok.decode(expected)
    # The log-probabilities are those of the penalized logits: each penalty's size shows in them.
    np.testing.assert_allclose(r.choices[0].logprobs.token_logprobs, lps, atol=2e-3)
    # -100 on the greedy first token: the runner-up comes first.
    bias = {plain[0]: -100.0}
    expected, _ = penalized_greedy(demo, prompt_ids, 3, bias=bias)
    assert expected[0] != plain[0]
    r = c.completions.create(model="x", prompt=prompt, max_tokens=3, logit_bias={str(plain[0]): -100})
    assert r.choices[0].text == tok.decode(expected)
    for bad in ({"99999": 1}, {"x": 1}, {"5": 101}):
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            c.completions.create(model="x", prompt=PROMPT, max_tokens=1, logit_bias=bad)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        c.completions.create(model="x", prompt=PROMPT, max_tokens=1, presence_penalty=3)


def test_response_format_json_is_a_clear_400(server):
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}):
        with pytest.raises(openai.BadRequestError, match="no constrained decoding") as e:
            client(server).chat.completions.create(model="x", messages=CHAT, response_format=fmt)
        assert e.value.body["param"] == "response_format"
    assert client(server).chat.completions.create(model="x", messages=CHAT, max_tokens=1,
                                                  response_format={"type": "text"}).choices[0].message.content


# --- tool calls --------------------------------------------------------------------------------

DS = ("Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
      '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
      '{"tz": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
KIMI = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
        '{"tz": "CET"}<|tool_call_end|><|tool_calls_section_end|>')
GLM = ("ok<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
       "<arg_value>3</arg_value>\n</tool_call><tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>CET</arg_value>\n"
       "</tool_call>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}}]


@pytest.mark.parametrize("text,content,calls", [
    (DS, "Let me look.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    (KIMI, "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    (GLM, "ok", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "CET"})]),
], ids=["deepseek-v3", "kimi-k2", "glm"])
def test_tool_call_formats(text, content, calls):
    got_content, got = parse_tool_calls(text, TOOLS)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"] for c in got)
    if text is KIMI:
        assert [c["id"] for c in got] == ["functions.get_weather:0", "functions.get_time:1"]
    # Streaming: one character at a time, nothing of the call section leaks out.
    f = ToolCallFilter()
    sent = "".join(f.add(ch) for ch in text)
    rest, streamed = f.finish(TOOLS)
    assert sent + rest == content and [c["function"] for c in streamed] == [c["function"] for c in got]


def test_text_without_a_complete_call_is_content():
    for text in ("plain text", "a <tool_call> without its end", "<｜tool▁calls▁begin｜>broken"):
        assert parse_tool_calls(text, TOOLS) == (text, [])
        f = ToolCallFilter()
        assert "".join(f.add(ch) for ch in text) + f.finish(TOOLS)[0] == text


class ScriptedHandle:
    cached_tokens = 0

    def __init__(self, ids, delay, fail_at=None):
        self.ids, self.delay, self.fail_at = ids, delay, fail_at
        self.cancelled = threading.Event()
        self.emitted = 0

    def cancel(self):
        self.cancelled.set()

    def __iter__(self):
        for i, t in enumerate(self.ids):
            if self.cancelled.wait(self.delay) if self.delay else self.cancelled.is_set():
                return
            if i == self.fail_at:
                raise RuntimeError("the engine broke")
            self.emitted += 1
            yield TokenEvent(t, None, None, "length" if i == len(self.ids) - 1 else None)


class ScriptedEngine:
    """Answers every request with the same token ids, ``delay`` seconds apart."""

    def __init__(self, ids, delay=0.0, fail_at=None):
        self.ids, self.delay, self.fail_at = ids, delay, fail_at
        self.handles, self.prompts = [], []

    def submit(self, prompt_ids, params, max_tokens, seed=None, logprobs=None):
        h = ScriptedHandle(self.ids[:max_tokens], self.delay, self.fail_at)
        self.handles.append(h)
        self.prompts.append(prompt_ids)
        return h

    def cancel_all(self):
        for h in self.handles:
            h.cancel()

    def close(self, timeout=None):
        self.cancel_all()


TOOL_TEMPLATE = (
    "{% if messages[0].content == 'fail at run time' %}{{ raise_exception('refused by the template') }}{% endif %}"
    "{% if messages[0].content == 'loop' %}{% for i in range(10**6) %}{% for j in range(10**6) %}x{% endfor %}"
    "{% endfor %}{% endif %}"
    "{% for t in tools or [] %}[tool {{ t.function.name }}]{{ '\\n' }}{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.function.name }}"
    "{% for k, v in c.function.arguments.items() %} {{ k }}={{ v }}{% endfor %}>{% endfor %}{{ '\\n' }}{% endfor %}")


@pytest.fixture(scope="module")
def tool_server(demo):
    model, tok = demo
    tok = copy.copy(tok)
    tok.chat_template = TOOL_TEMPLATE
    engine = ScriptedEngine(tok.encode(DS, add_special_tokens=False))
    srv = ModelServer(("127.0.0.1", 0), model, tok, "colibri-demo", log=io.StringIO(), engine=engine)
    thread = start(srv)
    yield srv
    stop(srv, thread)


@pytest.mark.parametrize("text,content,calls", [
    (DS, "Let me look.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    (KIMI, None, [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    (GLM, "ok", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "CET"})]),
], ids=["deepseek-v3", "kimi-k2", "glm"])
def test_tool_calls_end_to_end(tool_server, text, content, calls):
    c = client(tool_server)
    engine, tok = tool_server.engine, tool_server.tokenizer
    engine.ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(engine.ids) == text  # the premise: the scripted tokens spell the text
    try:
        r = c.chat.completions.create(model="x", messages=CHAT, tools=TOOLS, max_tokens=500)
        assert "[tool get_weather]\n[tool get_time]\n" in tok.decode(engine.prompts[-1])  # rendered by the template
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content == content
        assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == calls
        chunks = list(c.chat.completions.create(model="x", messages=CHAT, tools=TOOLS, max_tokens=500,
                                                stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == (content or "")
        streamed = [t for ch in chunks for t in ch.choices[0].delta.tool_calls or []]
        assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == \
            [(i, t.function.name, t.function.arguments) for i, t in enumerate(msg.tool_calls)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # tool_choice "none": no tools in the prompt, the text comes back as it is.
        r = c.chat.completions.create(model="x", messages=CHAT, tools=TOOLS, tool_choice="none", max_tokens=500)
        assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
        assert "[tool" not in tok.decode(engine.prompts[-1])
    finally:
        engine.ids = tok.encode(DS, add_special_tokens=False)


def test_tool_results_in_the_conversation(tool_server):
    messages = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    client(tool_server).chat.completions.create(model="x", messages=messages, tools=TOOLS, max_tokens=1)
    # The template iterates over the arguments as a mapping: the JSON text is given as one.
    assert "assistant: <call get_weather city=Paris>\ntool: sunny\n" in \
        tool_server.tokenizer.decode(tool_server.engine.prompts[-1])
    with pytest.raises(openai.BadRequestError, match="null only with tool_calls"):
        client(tool_server).chat.completions.create(model="x", messages=[{"role": "user", "content": None}])
    with pytest.raises(openai.BadRequestError, match="refused by the template"):
        client(tool_server).chat.completions.create(model="x", messages=[{"role": "user",
                                                                           "content": "fail at run time"}])
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client(tool_server).chat.completions.create(model="x", messages=CHAT, tools=TOOLS, tool_choice="required")
    for tools in (None, []):  # a tool_choice without tools, even "none" or "auto": a 400 as OpenAI gives
        for choice in ("none", "auto"):
            extra = {} if tools is None else {"tools": tools}
            with pytest.raises(openai.BadRequestError, match="'tool_choice' is only allowed when 'tools'"):
                client(tool_server).chat.completions.create(model="x", messages=CHAT, tool_choice=choice,
                                                            max_tokens=1, **extra)
    t0 = time.perf_counter()
    with pytest.raises(openai.BadRequestError, match="runaway"):  # 10**12 iterations: the render budget stops it
        client(tool_server).chat.completions.create(model="x", messages=[{"role": "user", "content": "loop"}])
    assert time.perf_counter() - t0 < 10


# --- errors ------------------------------------------------------------------------------------

def raw(srv, data: bytes, timeout=10) -> tuple[int, dict, bytes]:
    """Send bytes, read the whole answer (the server closes after an error)."""
    with socket.create_connection(srv.server_address[:2], timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def post_raw(body: bytes) -> bytes:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
    return head % len(body) + body


PROTOCOL_ERRORS = [
    ("bad request line", b"GARBAGE\r\n\r\n", 400),
    ("URI too long", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
    ("header line too long", b"GET /health HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n", 431),
    ("too many headers", b"GET /health HTTP/1.1\r\n" + b"".join(b"X%d: y\r\n" % i for i in range(200)) + b"\r\n", 431),
    ("unknown method", b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n", 501),
    ("bad HTTP version", b"GET /health HTTP/9.9\r\n\r\n", 505),
    ("negative Content-Length", b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400),
    # int() takes "1_0" (10) and "+2": the server waited a read timeout for bytes that never came
    ("Content-Length 1_0", b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1_0\r\n\r\n{}", 400),
    ("Content-Length +2", b"POST /v1/completions HTTP/1.1\r\nContent-Length: +2\r\n\r\n{}", 400),
    ("two Content-Lengths", b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 50\r\n\r\n{}",
     400),
    ("HTTP/0.9 request line", b"GET /v1/models\r\n\r\n", 400),  # was answered with a bare body, no status line
    ("lone surrogate", post_raw(b'{"prompt": "a\\ud800b", "max_tokens": 1}'), 400),
    ("deeply nested JSON", post_raw(b'{"prompt": "a", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}"), 400),
    ("nested past the limit", post_raw(b'{"prompt": "a", "x": ' + b"[" * 80 + b"]" * 80 + b"}"), 400),
    ("seed 2**64", post_raw(b'{"prompt": "a", "max_tokens": 1, "seed": 18446744073709551616}'), 400),
]


@pytest.mark.parametrize("what,data,status", PROTOCOL_ERRORS, ids=[p[0] for p in PROTOCOL_ERRORS])
def test_protocol_errors_are_openai_json(server, what, data, status):
    got, headers, body = raw(server, data)
    assert got == status, body
    assert headers["Content-Type"] == "application/json"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"


def test_address_in_use_is_the_bind_error(server, demo):
    """A failed bind (the port taken) raises its OSError, which the command reports, not an
    AttributeError from a drain of a server whose __init__ never finished."""
    with pytest.raises(OSError) as e:
        ModelServer(server.server_address[:2], *demo, "colibri-demo", log=io.StringIO())
    assert e.value.errno == errno.EADDRINUSE


def test_ipv6_loopback_is_served(demo):
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        srv = ModelServer(("::1", 0), *demo, "colibri-demo", log=io.StringIO())
    except OSError as e:  # the kernel has IPv6 off
        pytest.skip(f"cannot bind ::1: {e}")
    thread = start(srv)
    try:
        assert srv.url.startswith("http://[::1]:")
        conn = http.client.HTTPConnection("::1", srv.server_address[1], timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        stop(srv, thread)


def test_pipelined_requests_on_one_connection(server):
    get = b"GET /v1/models/colibri-demo HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(server.server_address[:2], timeout=10) as s:
        s.sendall(get + get + b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert out.count(b"HTTP/1.1 200 OK") == 3 and out.count(b'"id": "colibri-demo"') == 2
    assert out.endswith(b'{"status": "ok"}')


def test_huge_prompt_is_refused_before_it_is_tokenized(server):
    body = json.dumps({"prompt": "word " * 3_000_000, "max_tokens": 1}).encode()  # 15 MB
    t0 = time.perf_counter()
    status, _, text = raw(server, post_raw(body), timeout=60)
    assert status == 400 and b"exceeds the context limit of 1024 tokens" in text
    assert time.perf_counter() - t0 < 5  # tokenizing it all takes far longer


# --- robustness --------------------------------------------------------------------------------

@pytest.fixture
def scripted(demo):
    servers = []

    def make(ids=(65, 66, 67), delay=0.0, fail_at=None, **options):
        srv = ModelServer(("127.0.0.1", 0), demo[0], demo[1], "colibri-demo", log=io.StringIO(),
                          engine=ScriptedEngine(list(ids), delay, fail_at), **options)
        servers.append((srv, start(srv)))
        return srv

    yield make
    for srv, thread in servers:
        stop(srv, thread)


@pytest.mark.parametrize("data,wait_for_body,ready", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n", True, False),                          # head not ended
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", True, True),
    (b"GET / HTTP/1.1\nHost: x\n\n", True, True),                               # bare newlines
    (b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\n1234", True, False),       # body not all there
    (b"POST / HTTP/1.1\r\ncontent-length:5\r\n\r\n12345", True, True),
    (b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\n1234", False, True),      # over the buffer budget
    (b"POST / HTTP/1.1\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n", True, True),
    (b"POST / HTTP/1.1\r\nContent-Length: -5\r\n\r\n", True, True),          # the handler answers 400
    (b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n", True, True),
    (b"POST / HTTP/1.1\r\nContent-Length: 1_0\r\n\r\n{}", True, True),      # int() reads 10: not digits
    (b"POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 9\r\n\r\n{}", True, True),
    (b"POST / HTTP/1.1\r\nContent-Length: 2000000\r\n\r\n{", True, True),    # a large body: the worker reads it
    (b"GET /" + b"a" * 80000, True, True),                                      # too long: the handler answers 414
])
def test_request_ready(data, wait_for_body, ready):
    assert request_ready(data, wait_for_body) is ready


def test_64_concurrent_clients_all_answered(scripted):
    srv = scripted()
    c = client(srv)
    results, errors = [], []

    def one(i):
        try:
            results.append(c.completions.create(model="x", prompt=f"p{i}", max_tokens=3).choices[0].text)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and results == [srv.tokenizer.decode([65, 66, 67])] * 64


def test_half_sent_requests_hold_no_thread_and_time_out(scripted):
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 2600:
        pytest.skip("needs 2600 open files (ulimit -n)")
    srv = scripted(delay=0.1, max_connections=2, read_timeout=1.0)
    # 1100 silent ones: the request below gets a descriptor number past select()'s FD_SETSIZE.
    silent = [socket.create_connection(srv.server_address[:2]) for _ in range(1100)]
    heads = [socket.create_connection(srv.server_address[:2]) for _ in range(50)]
    bodies = [socket.create_connection(srv.server_address[:2]) for _ in range(50)]
    for s in heads:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    for s in bodies:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"pro")
    time.sleep(0.1)
    before = threading.active_count()
    # 150 connections wait, but only for bytes: a whole request is served at once.
    status, _, body = raw(srv, post_raw(b'{"prompt": "a", "max_tokens": 2}'))
    assert status == 200 and json.loads(body)["choices"][0]["text"]
    assert threading.active_count() <= before + 2
    for group, expected in ((silent, None), (heads, 408), (bodies, 408)):
        for s in group:
            s.settimeout(5)
            answer = s.recv(65536)
            if expected is None:
                assert answer == b""  # closed without a word: it never asked anything
            else:
                assert answer.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1 s" in answer
            s.close()


def test_full_pool_waits_then_is_503_with_retry_after(scripted):
    srv = scripted(ids=list(range(65, 85)), delay=0.05, max_connections=1, max_pending=1)  # 1 s per request
    answers = []
    request = post_raw(b'{"prompt": "a", "max_tokens": 20}')
    slow = [threading.Thread(target=lambda: answers.append(raw(srv, request))) for _ in range(2)]
    for t in slow:  # one runs, one waits for the slot
        t.start()
    time.sleep(0.3)
    status, headers, body = raw(srv, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert status == 503 and headers["Retry-After"] == "1" and json.loads(body)["error"]["type"] == "server_error"
    for t in slow:
        t.join(10)
    assert [a[0] for a in answers] == [200, 200]
    status, headers, body = raw(srv, b"HEAD /health HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert status == 200 and headers["Content-Type"] == "application/json" and body == b""


def test_non_streaming_client_disconnect_cancels(scripted):
    srv = scripted(ids=list(range(65, 265)), delay=0.02)  # 4 s in all
    body = json.dumps({"prompt": "x", "max_tokens": 200}).encode()
    with socket.create_connection(srv.server_address[:2]) as s:
        s.sendall(post_raw(body))
        time.sleep(0.3)
    handle = srv.engine.handles[-1]
    assert handle.cancelled.wait(2)
    assert handle.emitted < 100


def test_engine_failure_is_a_500_or_an_error_event(scripted):
    srv = scripted(fail_at=2)
    c = client(srv)
    with pytest.raises(openai.InternalServerError, match="the engine broke"):
        c.completions.create(model="x", prompt="a", max_tokens=3)
    chunks = []
    with pytest.raises(openai.APIError, match="the engine broke"):
        for chunk in c.completions.create(model="x", prompt="a", max_tokens=3, stream=True):
            chunks.append(chunk)
    assert "".join(ch.choices[0].text for ch in chunks) == srv.tokenizer.decode([65, 66])
    assert c.completions.create(model="x", prompt="a", max_tokens=2).choices[0].text  # still serving


def test_api_key_and_cors(scripted):
    srv = scripted(api_key="sekrit", allow_origin="https://app.example")
    with pytest.raises(openai.AuthenticationError):
        client(srv, api_key="wrong").models.list()
    assert client(srv, api_key="sekrit").completions.create(model="x", prompt="a", max_tokens=1).choices[0].text
    conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=10)
    conn.request("GET", "/health")
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Access-Control-Allow-Origin") == "https://app.example"
    r.read()
    conn.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    r = conn.getresponse()
    assert r.status == 204 and "POST" in r.getheader("Access-Control-Allow-Methods")
    assert r.getheader("Access-Control-Allow-Headers") == "authorization, content-type"
    r.read()
    conn.request("POST", "/v1/completions", body=b'{"prompt": "a"}')
    r = conn.getresponse()
    assert r.status == 401 and json.loads(r.read())["error"]["code"] == "invalid_api_key"
    conn.close()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_mid_stream_ends_the_requests_and_exits_0(signum):
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "colibri_mlx", "serve", "--port", "0",
                             "--host", "0.0.0.0"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        url, seen = None, []
        for line in proc.stderr:
            seen.append(line)
            m = re.search(r"at http://[^:]+:(\d+)/v1", line)
            if m:
                url = m.group(1)
                break
        assert url, "no URL printed"
        assert any("WARNING" in line and "without --api-key" in line for line in seen)
        conn = http.client.HTTPConnection("127.0.0.1", int(url), timeout=30)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {"messages": CHAT, "max_tokens": 500, "stream": True}))
        r = conn.getresponse()
        assert r.status == 200
        first = r.readline()
        assert first.startswith(b"data: ")
        queued = {}  # a whole request waiting behind the stream is answered too

        def whole():
            c = http.client.HTTPConnection("127.0.0.1", int(url), timeout=30)
            c.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 500}))
            answer = c.getresponse()
            queued["status"], queued["body"] = answer.status, json.loads(answer.read())

        waiting = threading.Thread(target=whole)
        waiting.start()
        time.sleep(0.3)
        proc.send_signal(signum)
        rest = r.read().decode()
        events = [e[len("data: "):] for e in rest.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        waiting.join(20)
        assert queued["status"] == 200 and queued["body"]["choices"][0]["finish_reason"] == "length"
        try:
            code = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            pytest.fail(f"still running 20 s after the signal:\n{proc.communicate(timeout=10)[1][-6000:]}")
        err = proc.stderr.read()
        assert code == 0, err[-3000:]
        assert "terminate called" not in err and "shutting down" in err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_abandoned_whole_request_does_not_block_the_next(server):
    # A 300-token request (30 s or more of the demo model here) whose client leaves: the next one
    # must not wait for it.
    body = json.dumps({"prompt": PROMPT, "max_tokens": 300}).encode()
    before = len(re.findall(r"generation: (\d+) tokens", server.log.getvalue()))
    with socket.create_connection(server.server_address[:2]) as s:
        s.sendall(post_raw(body))
        time.sleep(0.5)
    t0 = time.perf_counter()
    r = client(server).completions.create(model="x", prompt=PROMPT, max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    assert time.perf_counter() - t0 < 15
    deadline = time.time() + 10
    while time.time() < deadline:  # both requests' stats lines, in either order
        new = [int(n) for n in re.findall(r"generation: (\d+) tokens", server.log.getvalue())][before:]
        if len(new) >= 2:
            break
        time.sleep(0.05)
    assert sorted(new)[-1] < 300, new  # the abandoned one was cut short

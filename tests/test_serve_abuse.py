"""`colibri serve` against hostile and careless clients, the cases scripts/serve/abuse_check.py
found: each must get a proper answer (an OpenAI-shaped JSON error or the whole completion)."""

from __future__ import annotations

import io
import json
import socket
import time

import pytest

import colibri_mlx
from colibri_mlx.serve import ModelServer
from test_serve_openai import start, stop

READ_TIMEOUT = 0.5


@pytest.fixture(scope="module")
def server():
    srv = ModelServer(("127.0.0.1", 0), *colibri_mlx.load(None), "colibri-demo", log=io.StringIO(),
                      read_timeout=READ_TIMEOUT)
    thread = start(srv)
    yield srv
    stop(srv, thread)


def exchange(srv, data: bytes, timeout: float = 60.0) -> tuple[int, dict, bytes]:
    """Send ``data``, read until the server closes: (status, body as JSON, the rest after the body)."""
    with socket.create_connection(srv.server_address[:2], timeout=timeout) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert got, "the connection closed without a response"
    head, _, rest = got.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    return status, json.loads(rest[:length]), rest[length:]


def test_whole_answer_that_takes_longer_than_the_read_timeout(server):
    """The disconnect watcher must not take the read timeout's expiry for the client leaving."""
    n = 200     # about 2 s of the demo model on a CPU: well past 2 read timeouts on a fast machine too
    body = json.dumps({"prompt": "And the LORD spake unto Moses, saying", "max_tokens": n,
                       "logit_bias": {str(i): -100 for i in server.tokenizer.eos_token_ids}}).encode()
    t0 = time.monotonic()
    status, answer, _ = exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    took = time.monotonic() - t0
    assert took > 2 * READ_TIMEOUT, f"{n} tokens in {took:.2f} s: the request must outlast the read timeout"
    assert status == 200 and answer["usage"]["completion_tokens"] == n, answer


def test_transfer_encoding_with_content_length_is_refused(server):
    """Both framings at once (request smuggling): refused, the connection closed, the body not
    taken as a request."""
    inner = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    body = b'{"prompt": "x", "max_tokens": 1}' + inner
    status, answer, rest = exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                                            b"Content-Length: 32\r\n\r\n" + body)
    assert status == 411 and answer["error"]["type"] == "invalid_request_error", answer
    assert rest == b"", f"the smuggled request was answered: {rest[:200]!r}"


def test_short_prompt_is_not_queued_behind_a_long_prefill():
    """A short prompt submitted with a long one gets its first token while the long one is still
    in prefill (the prompt step serves the shortest remaining prompt first)."""
    from colibri_mlx.batch_engine import BatchEngine

    model, tokenizer = colibri_mlx.load(None)
    engine = BatchEngine(model, tokenizer, prefill_step_size=16)
    try:
        long, short = engine.submit_all([dict(prompt_ids=list(range(10, 210)), max_tokens=1),
                                         dict(prompt_ids=[5, 6, 7, 8], max_tokens=1)])
        next(iter(short))
        long_started = not long._request.events.empty()
        assert not long_started, "the short prompt waited for the long prompt's whole prefill"
        assert len(list(long)) == 1
    finally:
        engine.close()


def test_stats_line_of_a_one_token_answer_has_no_made_up_rate(server):
    body = json.dumps({"prompt": "In the beginning", "max_tokens": 1}).encode()
    status, _, _ = exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert status == 200
    line = [x for x in server.log.getvalue().splitlines() if "generation:" in x][-1]
    assert "generation: 1 tokens, - tok/s" in line, line

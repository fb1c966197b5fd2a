"""``colibri serve``: an OpenAI-compatible HTTP server on the standard library, like ``mlx_lm.server``.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` answers with Server-Sent Events ending in ``data: [DONE]``). One model, one
generation at a time: MLX evaluation and the latent cache are not thread-safe, so requests queue
on a lock while the HTTP threads keep accepting. docs/serve.md lists the request fields.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator, Optional

from .generate import SamplingParams
from .speculative import DEFAULT_NUM_DRAFT, DRAFT_KINDS, MAX_NUM_DRAFT

MAX_BODY_BYTES = 16 << 20


class RequestError(ValueError):
    """A bad request: answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True)
class SamplingDefaults(SamplingParams):
    """Server-wide defaults (the command line); each request may override them."""

    max_tokens: int = 256
    draft: Optional[str] = None   # speculative decoding (docs/speculative.md); None: the model's default
    num_draft: int = DEFAULT_NUM_DRAFT


@dataclass
class CompletionRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict  # stream_generate keyword arguments: temperature, top_p, top_k, min_p, repetition_penalty, seed,
    #                 draft, num_draft
    stop: list[str] = field(default_factory=list)
    stream: bool = False


# --- request parsing -----------------------------------------------------------------------

def _field(body: dict, name: str, types, default, check=None, what=None):
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int subclass: `"max_tokens": true` must not pass as 1.
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise RequestError(f"'{name}' must be {what or ' or '.join(t.__name__ for t in types)}, "
                           f"got {json.dumps(value)}", name)
    if check is not None and not check(value):
        raise RequestError(f"'{name}' must be {what}, got {json.dumps(value)}", name)
    return value


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"'stop' must be a non-empty string or a list of them, got {json.dumps(stop)}", "stop")
    return stops


def parse_sampling(body: dict, defaults: SamplingDefaults) -> tuple[int, dict, list[str], bool]:
    """``(max_tokens, sampling kwargs, stop strings, stream)`` of a request body."""
    number = (int, float)
    max_tokens = _field(body, "max_tokens", (int,), None, lambda v: v >= 1, "an integer >= 1")
    if max_tokens is None:  # the chat API's newer name
        max_tokens = _field(body, "max_completion_tokens", (int,), defaults.max_tokens, lambda v: v >= 1,
                            "an integer >= 1")
    n = _field(body, "n", (int,), 1)
    if n != 1:
        raise RequestError(f"'n' must be 1 (one choice per request), got {n}", "n")
    sampling = dict(
        temperature=float(_field(body, "temperature", number, defaults.temperature, lambda v: v >= 0, "a number >= 0")),
        top_p=float(_field(body, "top_p", number, defaults.top_p, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        top_k=_field(body, "top_k", (int,), defaults.top_k, lambda v: v >= 0, "an integer >= 0"),
        min_p=float(_field(body, "min_p", number, defaults.min_p, lambda v: 0 <= v <= 1, "a number in [0, 1]")),
        repetition_penalty=float(_field(body, "repetition_penalty", number, defaults.repetition_penalty,
                                        lambda v: v > 0, "a number > 0")),
        seed=_field(body, "seed", (int,), None, lambda v: v >= 0, "an integer >= 0"),
        draft=_field(body, "draft", (str,), defaults.draft, lambda v: v in DRAFT_KINDS,
                     "one of " + ", ".join(map(repr, DRAFT_KINDS))),
        num_draft=_field(body, "num_draft", (int,), defaults.num_draft, lambda v: 1 <= v <= MAX_NUM_DRAFT,
                         f"an integer in 1..{MAX_NUM_DRAFT}"),
    )
    stream = _field(body, "stream", (bool,), False)
    return max_tokens, sampling, _stop_strings(body), stream


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"'prompt' has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", "prompt")
        return list(prompt)
    raise RequestError("'prompt' must be a string or a non-empty list of token ids (one prompt per request)",
                       "prompt")


def _message_text(i: int, content) -> str:
    if isinstance(content, str):
        return content
    # The content-parts form: [{"type": "text", "text": ...}, ...]
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'", "messages")
        out.append({"role": m["role"], "content": _message_text(i, m.get("content"))})
    return out


def parse_completion(body, tokenizer, defaults: SamplingDefaults, chat: bool) -> CompletionRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if chat:
        if not tokenizer.chat_template:
            raise RequestError("the model's tokenizer has no chat template; use /v1/completions")
        try:
            ids = tokenizer.encode_chat(_messages(body))
        except ValueError as e:  # TokenizerError: the template itself refused the messages
            raise RequestError(str(e), "messages") from None
    else:
        if "prompt" not in body:
            raise RequestError("missing field 'prompt'", "prompt")
        ids = _prompt_ids(tokenizer, body["prompt"])
    max_tokens, sampling, stop, stream = parse_sampling(body, defaults)
    return CompletionRequest(ids, max_tokens, sampling, stop, stream)


# --- generation with stop strings ------------------------------------------------------------

class StopStringFilter:
    """Cuts the text at the first stop string. Holds back a tail that could still become one,
    so that streamed deltas never contain text that a later token turns into a stop."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.text = ""
        self.sent = 0

    def add(self, delta: str) -> tuple[str, bool]:
        """``(text safe to send, stopped)``."""
        self.text += delta
        start = max(0, len(self.text) - len(delta) - self.longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return self._send(len(self.text)), True
        return self._send(len(self.text) - self._pending_prefix()), False

    def flush(self) -> str:
        return self._send(len(self.text))

    def _pending_prefix(self) -> int:
        for k in range(min(self.longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _send(self, end: int) -> str:
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out


@dataclass
class Outcome:
    completion_tokens: int = 0
    finish_reason: Optional[str] = None
    last: object = None  # the final GenerationResponse (timing stats)


def generate_deltas(model, tokenizer, req: CompletionRequest, outcome: Outcome) -> Iterator[str]:
    """Text deltas of the completion; ``outcome`` holds the token count and finish reason at the end."""
    from .generate import stream_generate

    stopper = StopStringFilter(req.stop)
    for r in stream_generate(model, tokenizer, req.prompt_ids, max_tokens=req.max_tokens, **req.sampling):
        outcome.completion_tokens, outcome.last = r.generation_tokens, r
        text, stopped = stopper.add(r.text)
        if text:
            yield text
        if stopped:
            outcome.finish_reason = "stop"
            store = getattr(model, "expert_store", None)
            if store is not None:  # stream_generate saves it only when it runs to the end
                store.save_usage()
            return
        if r.finish_reason is not None:
            outcome.finish_reason = r.finish_reason
            break
    tail = stopper.flush()
    if tail:
        yield tail


# --- responses -----------------------------------------------------------------------------

def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Response:
    """The OpenAI response shapes of one request (completion or chat, whole or chunked)."""

    def __init__(self, chat: bool, model_id: str):
        self.chat, self.model_id = chat, model_id
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id, "choices": choices,
                **extra}

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
            return self._envelope("chat.completion", [choice], usage=usage)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], usage=usage)

    def chunk(self, text: Optional[str], finish_reason: Optional[str] = None, usage: Optional[dict] = None,
              role: bool = False) -> dict:
        extra = {} if usage is None else {"usage": usage}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice], **extra)
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], **extra)


def error_body(message: str, status: int, param: Optional[str] = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# --- HTTP ----------------------------------------------------------------------------------

class ModelServer(ThreadingHTTPServer):
    """The HTTP server holding the model, its lock and the sampling defaults."""

    daemon_threads = True  # Ctrl-C must not wait for a client that keeps a stream open

    def __init__(self, address, model, tokenizer, model_id: str = "colibri",
                 defaults: SamplingDefaults = SamplingDefaults(), log=sys.stderr):
        super().__init__(address, RequestHandler)
        self.model, self.tokenizer, self.model_id, self.defaults = model, tokenizer, model_id, defaults
        self.generation_lock = threading.Lock()
        self.created = int(time.time())
        self.log = log

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class RequestHandler(BaseHTTPRequestHandler):
    server: ModelServer
    protocol_version = "HTTP/1.1"
    server_version = "colibri"

    def log_message(self, format, *args):
        if self.server.log is not None:
            print(f"{self.address_string()} - {format % args}", file=self.server.log, flush=True)

    # -- plumbing --

    def _send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, e: RequestError) -> None:
        self._send_json(e.status, error_body(str(e), e.status, e.param))

    def _read_json(self):
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True  # the unread body would be taken for the next request
            raise RequestError("missing Content-Length (chunked request bodies are not supported)",
                               status=HTTPStatus.LENGTH_REQUIRED)
        try:
            n = int(length)
        except ValueError:
            raise RequestError(f"bad Content-Length {length!r}") from None
        if not 0 <= n <= MAX_BODY_BYTES:
            self.close_connection = True
            raise RequestError(f"request body of {n} bytes (limit {MAX_BODY_BYTES})",
                               status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        raw = self.rfile.read(n)
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(f"invalid JSON in the request body: {e}") from None

    # -- routes --

    def do_GET(self):
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/health":
            self._send_json(HTTPStatus.OK, {"status": "ok"})
        elif path == "/v1/models":
            model = {"id": self.server.model_id, "object": "model", "created": self.server.created,
                     "owned_by": "colibri"}
            self._send_json(HTTPStatus.OK, {"object": "list", "data": [model]})
        else:
            self._send_error(RequestError(f"no route GET {self.path}", status=HTTPStatus.NOT_FOUND))

    def do_POST(self):
        path = self.path.split("?", 1)[0].rstrip("/")
        routes = {"/v1/completions": False, "/v1/chat/completions": True}
        try:
            if path not in routes:
                if self.headers.get("Content-Length"):  # keep the connection usable
                    self.rfile.read(int(self.headers["Content-Length"]))
                raise RequestError(f"no route POST {self.path}", status=HTTPStatus.NOT_FOUND)
            chat = routes[path]
            body = self._read_json()
            req = parse_completion(body, self.server.tokenizer, self.server.defaults, chat)
        except RequestError as e:
            self._send_error(e)
            return
        except ValueError as e:
            self._send_error(RequestError(f"bad Content-Length: {e}"))
            return
        with self.server.generation_lock:
            try:
                self._complete(req, _Response(chat, self.server.model_id))
            except Exception as e:  # a bug, not the client's fault: say so instead of dropping the connection
                self.log_error("generation failed: %r", e)
                if not self.headers_sent_for_stream:
                    self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR,
                                    error_body(f"generation failed: {e!r}", HTTPStatus.INTERNAL_SERVER_ERROR))
                self.close_connection = True

    def _complete(self, req: CompletionRequest, resp: _Response) -> None:
        outcome = Outcome()
        deltas = generate_deltas(self.server.model, self.server.tokenizer, req, outcome)
        try:
            # The first step runs the prompt: its errors (context limit, bad sampling values)
            # must become a 400 before any 200 header goes out.
            first = next(deltas, None)
        except ValueError as e:
            self._send_error(RequestError(str(e)))
            return
        if req.stream:
            self._stream(req, resp, first, deltas, outcome)
        else:
            text = (first or "") + "".join(deltas)
            usage = _usage(len(req.prompt_ids), outcome.completion_tokens)
            self._send_json(HTTPStatus.OK, resp.whole(text, outcome.finish_reason, usage))
        self._log_stats(outcome)

    headers_sent_for_stream = False

    def _stream(self, req, resp: _Response, first, deltas, outcome: Outcome) -> None:
        self.headers_sent_for_stream = True
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # no Content-Length: the body ends when the connection does
        self.end_headers()
        self.close_connection = True
        try:
            if resp.chat:
                self._event(resp.chunk(None, role=True))
            if first is not None:
                self._event(resp.chunk(first))
                for text in deltas:
                    self._event(resp.chunk(text))
            usage = _usage(len(req.prompt_ids), outcome.completion_tokens)
            self._event(resp.chunk(None, outcome.finish_reason, usage))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            deltas.close()  # the client left: stop generating and free the lock

    def _event(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    def _log_stats(self, outcome: Outcome) -> None:
        r = outcome.last
        if r is not None and self.server.log is not None:
            print(f"  prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tok/s | generation: "
                  f"{r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s | finish: {outcome.finish_reason}"
                  + _draft_note(r), file=self.server.log, flush=True)


def _draft_note(r) -> str:
    from .speculative import acceptance_summary

    summary = acceptance_summary(r.draft_stats or {})
    return f" | {summary}" if summary else ""


def model_id_for(path: Optional[str]) -> str:
    return "colibri-demo" if path is None else os.path.basename(os.path.normpath(os.path.abspath(path)))


def serve(model, tokenizer, host: str = "127.0.0.1", port: int = 8080, model_id: str = "colibri",
          defaults: SamplingDefaults = SamplingDefaults()) -> None:
    """Serve until Ctrl-C."""
    server = ModelServer((host, port), model, tokenizer, model_id, defaults)
    print(f"colibri serve: {model_id} at {server.url}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("colibri serve: shutting down", file=sys.stderr, flush=True)
    finally:
        server.server_close()

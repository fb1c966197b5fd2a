"""``colibri serve``: an OpenAI-compatible HTTP server on the standard library, like ``mlx_lm.server``.

Endpoints: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` answers with Server-Sent Events ending in
``data: [DONE]``). This module is the HTTP layer: connections wait on one reader thread
(:mod:`colibri_mlx.serve_reader`) and requests run on a bounded pool of threads; read timeouts,
API key and CORS, OpenAI-shaped errors for every failure (protocol-level ones too), client
disconnects and a graceful shutdown. Requests are checked and shaped in
:mod:`colibri_mlx.serve_openai`; generation goes through an engine (:mod:`colibri_mlx.serve_engine`).
docs/serve.md lists the request fields and flags.
"""

from __future__ import annotations

import collections
import hmac
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from .batch_engine import BatchEngine
from .serve_engine import ENGINE_OPTIONS, SerialEngine
from .serve_reader import ConnectionReader, RequestReader, content_length
from .serve_openai import (CompletionRequest, CompletionText, RequestError, Response, SamplingDefaults,  # noqa: F401
                           StopStringFilter, error_body, model_card, parse_completion, parse_sampling)

MAX_BODY_BYTES = 16 << 20
LISTEN_BACKLOG = 512
DEFAULT_MAX_CONNECTIONS = 128
DEFAULT_READ_TIMEOUT = 30.0
SHUTDOWN_GRACE_S = 10.0
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


class ModelServer(ThreadingHTTPServer):
    """The HTTP server holding the engine, the tokenizer and the sampling defaults.

    Connections wait for their next request on one reader thread (:mod:`serve_reader`); a
    request that has arrived gets a thread, at most ``max_connections`` at once; up to
    ``max_pending`` more (default 4 x ``max_connections``) wait for a thread in arrival order, and
    one more is answered 503 with ``Retry-After``. A request (head, and a body of up to 1 MiB) must arrive
    within ``read_timeout`` seconds: otherwise 408, or the connection is closed when it sent
    nothing (an idle keep-alive).
    """

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address, model, tokenizer, model_id: str = "colibri",
                 defaults: SamplingDefaults = SamplingDefaults(), log=sys.stderr, engine=None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, read_timeout: float = DEFAULT_READ_TIMEOUT,
                 api_key: Optional[str] = None, allow_origin: Optional[str] = None,
                 max_pending: Optional[int] = None):
        if ":" in address[0]:  # an IPv6 address (--host ::1 or ::): the default family is IPv4's
            self.address_family = socket.AF_INET6
        super().__init__(address, RequestHandler)
        self.model, self.tokenizer, self.model_id, self.defaults = model, tokenizer, model_id, defaults
        self.engine = engine if engine is not None else make_engine(model, tokenizer, defaults)
        self.context_limit = model.max_length
        self.created = int(time.time())
        self.log = log
        self.max_connections, self.read_timeout = max_connections, read_timeout
        self.api_key, self.allow_origin = api_key, allow_origin
        self.slots = threading.BoundedSemaphore(max_connections)
        self.connections: dict[threading.Thread, socket.socket] = {}
        self.connections_lock = threading.Lock()
        self.pending: collections.deque = collections.deque()
        self.max_pending = max_pending if max_pending is not None else 4 * max_connections
        self.stopping = threading.Event()
        self.refused = 0
        self.reader = RequestReader(self._dispatch, read_timeout, log)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    # -- the bounded pool --

    def process_request(self, request, client_address):
        """From the accepting thread: the connection waits for its request on the reader."""
        self.reader.add(request, client_address)

    def _dispatch(self, sock, client_address, data: bytes) -> None:
        """From the reader: a whole request (or a head too long to be one) is in ``data``. It runs
        on a free slot, or waits for one among at most ``max_pending``; past that it gets a 503."""
        with self.connections_lock:
            if not self.stopping.is_set():
                if self.slots.acquire(blocking=False):
                    self._start(sock, client_address, data)
                    return
                if len(self.pending) < self.max_pending:
                    self.pending.append((sock, client_address, data))
                    return
        self.refused += 1
        _refuse_busy(sock, self.allow_origin)
        self.shutdown_request(sock)

    def _start(self, sock, client_address, data: bytes) -> None:
        t = threading.Thread(target=self._serve_connection, args=(sock, client_address, data), daemon=True)
        self.connections[t] = sock
        t.start()

    def _serve_connection(self, sock, client_address, data: bytes):
        keep = False
        try:
            sock.settimeout(self.read_timeout)
            handler = self.RequestHandlerClass(sock, client_address, self, data)
            keep = not handler.close_connection and not self.stopping.is_set()
            if keep:  # the next request of a keep-alive connection waits on the reader, not on a thread
                self.reader.add(sock, client_address, handler.rfile.leftover())
        except Exception:
            self.handle_error(sock, client_address)
        finally:
            if not keep:
                self.shutdown_request(sock)
            with self.connections_lock:
                self.connections.pop(threading.current_thread(), None)
                if self.pending and not self.stopping.is_set():
                    self._start(*self.pending.popleft())  # the slot passes to the oldest waiting request
                else:
                    self.slots.release()

    def handle_error(self, request, client_address):
        if self.log is not None:
            import traceback

            print(f"{client_address[0]} - connection error: {traceback.format_exc(limit=3)}", file=self.log,
                  flush=True)

    def drain(self, timeout: float = SHUTDOWN_GRACE_S) -> None:
        """Stop taking requests, cancel the running generations (their streams end with a final
        chunk), wait for the connection threads, then close the engine (no MLX work left)."""
        with self.connections_lock:
            self.stopping.set()
            pending, self.pending = list(self.pending), collections.deque()
        for sock, _, _ in pending:
            _refuse_busy(sock, self.allow_origin, "the server is shutting down")
            self.shutdown_request(sock)
        self.reader.close()  # closes the connections waiting for a request
        self.engine.cancel_all()
        with self.connections_lock:
            sockets = list(self.connections.values())
        for sock in sockets:  # a handler still reading a large body reads end-of-file; answers still go out
            try:
                sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.connections_lock:
                alive = [t for t in self.connections if t.is_alive()]
            if not alive:
                break
            self.engine.cancel_all()  # a request queued behind the cancelled one
            alive[0].join(0.05)
        self.engine.close()  # waits: the generation stops at the next token (a prompt step runs to its end)

    def server_close(self):
        super().server_close()
        # TCPServer.__init__ calls this when the bind fails (address in use), before the rest of
        # __init__ ran: there is nothing to drain, and the OSError must come through.
        if hasattr(self, "stopping") and not self.stopping.is_set():
            self.drain()


def _bytes_text(n: Optional[int]) -> str:
    return "unbounded" if n is None else f"up to {n:,} bytes"


def _refuse_busy(sock, allow_origin: Optional[str] = None,
                 message: str = "the server is busy: too many requests at once; retry later") -> None:
    body = json.dumps(error_body(message, HTTPStatus.SERVICE_UNAVAILABLE)).encode()
    cors = b"" if allow_origin is None else b"Access-Control-Allow-Origin: %s\r\n" % allow_origin.encode()
    try:
        sock.settimeout(0.5)
        sock.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                     b"%sConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (cors, len(body), body))
    except OSError:
        pass

class RequestHandler(BaseHTTPRequestHandler):
    server: ModelServer
    protocol_version = "HTTP/1.1"
    server_version = "colibri"
    error_content_type = "application/json"
    disable_nagle_algorithm = True  # a streamed token goes out at once, not after the client's delayed ACK

    def __init__(self, request, client_address, server, data: bytes = b""):
        self.received = data
        super().__init__(request, client_address, server)

    def setup(self):
        super().setup()
        self.rfile.close()
        self.rfile = ConnectionReader(self.received, self.connection)

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.request_version == "HTTP/0.9":  # "GET /": the answer would go out without a status line
            self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request line {self.requestline[:100]!r}: no HTTP version "
                                                    "(HTTP/0.9 is not served)")
            return False
        return True

    def handle(self):
        """One request: the server hands the connection back to the reader between requests."""
        self.close_connection = True
        self.handle_one_request()

    def log_message(self, format, *args):
        if self.server.log is not None:
            print(f"{self.address_string()} - {format % args}", file=self.server.log, flush=True)

    # -- plumbing --

    def end_headers(self):
        origin = self.server.allow_origin
        if origin is not None:
            self.send_header("Access-Control-Allow-Origin", origin)
            if origin != "*":
                self.send_header("Vary", "Origin")
        super().end_headers()

    def send_error(self, code, message=None, explain=None):
        """Protocol-level errors (bad request line, 414, 431, 501, ...) as OpenAI-style JSON."""
        try:
            short, long = self.responses[code]
        except KeyError:
            short, long = "error", ""
        self.log_error("code %d, message %s", code, message)
        if self.request_version == "HTTP/0.9":  # the request line did not parse: answer in HTTP/1.1 anyway
            self.request_version = "HTTP/1.1"
        self.close_connection = True
        self._send_json(code, error_body(message or explain or long or short, code), close=True)

    def _send_json(self, status: int, obj: dict, close: bool = False, headers: dict = {}) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers.items():
            self.send_header(k, v)
        if close:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_error(self, e: RequestError) -> None:
        close = self.close_connection or e.status >= 500
        headers = {"WWW-Authenticate": "Bearer"} if e.status == HTTPStatus.UNAUTHORIZED else {}
        self._send_json(e.status, error_body(str(e), e.status, e.param, e.code), close=close, headers=headers)

    def _read_json(self):
        length = self.headers.get("Content-Length")
        if length is None or "Transfer-Encoding" in self.headers:  # both: a smuggling attempt, refused
            self.close_connection = True  # the unread body would be taken for the next request
            raise RequestError("missing Content-Length (chunked request bodies are not supported)",
                               status=HTTPStatus.LENGTH_REQUIRED)
        try:
            n = content_length(self.headers.get_all("Content-Length"))
        except ValueError as e:
            self.close_connection = True
            raise RequestError(str(e)) from None
        if n > MAX_BODY_BYTES:
            self.close_connection = True
            raise RequestError(f"request body of {n} bytes (limit {MAX_BODY_BYTES})",
                               status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        try:
            raw = self.rfile.read(n)
        except (TimeoutError, socket.timeout):
            self.close_connection = True
            raise RequestError(f"the request body did not arrive within {self.server.read_timeout:g} s",
                               status=HTTPStatus.REQUEST_TIMEOUT) from None
        if len(raw) < n:
            self.close_connection = True
            raise RequestError(f"the request body ended after {len(raw)} of {n} bytes")
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(f"invalid JSON in the request body: {e}") from None
        except RecursionError:
            raise RequestError("the request body is nested too deeply") from None

    def _authorized(self) -> bool:
        key = self.server.api_key
        if key is None:
            return True
        given = self.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
            return True
        self._send_error(RequestError("invalid or missing API key (send 'Authorization: Bearer KEY')",
                                      status=HTTPStatus.UNAUTHORIZED, code="invalid_api_key"))
        return False

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/")

    # -- routes --

    def do_OPTIONS(self):  # CORS preflight
        self.send_response(HTTPStatus.NO_CONTENT)
        self.send_header("Allow", "GET, POST, OPTIONS")
        if self.server.allow_origin is not None:
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers",
                             self.headers.get("Access-Control-Request-Headers") or "Authorization, Content-Type")
            self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        path = self._path()
        if path == "/health":
            self._send_json(HTTPStatus.OK, {"status": "ok"})
            return
        if not self._authorized():
            return
        if path == "/v1/models":
            self._send_json(HTTPStatus.OK, {"object": "list",
                                            "data": [model_card(self.server.model_id, self.server.created)]})
        elif path.startswith("/v1/models/"):
            wanted = path[len("/v1/models/"):]
            if wanted == self.server.model_id:
                self._send_json(HTTPStatus.OK, model_card(self.server.model_id, self.server.created))
            else:
                self._send_error(RequestError(f"the model {wanted!r} does not exist (this server has "
                                              f"{self.server.model_id!r})", "model", HTTPStatus.NOT_FOUND,
                                              "model_not_found"))
        else:
            self._send_error(RequestError(f"no route GET {self.path}", status=HTTPStatus.NOT_FOUND))

    do_HEAD = do_GET  # the same status and headers, no body (_send_json)

    def do_POST(self):
        routes = {"/v1/completions": False, "/v1/chat/completions": True}
        try:
            if not self._authorized():
                self.close_connection = True
                return
            chat = routes.get(self._path())
            if chat is None:
                self._read_json_or_none()
                raise RequestError(f"no route POST {self.path}", status=HTTPStatus.NOT_FOUND)
            body = self._read_json()
            req = parse_completion(body, self.server.tokenizer, self.server.defaults, chat, self.server.context_limit)
            handle = self._submit(req)
        except RequestError as e:
            self._send_error(e)
            return
        except ValueError as e:  # SamplingParams, the engine's checks
            self._send_error(RequestError(str(e)))
            return
        except RuntimeError as e:  # the engine is closed: shutting down
            self._send_json(HTTPStatus.SERVICE_UNAVAILABLE, error_body(str(e), HTTPStatus.SERVICE_UNAVAILABLE),
                            close=True, headers={"Retry-After": "1"})
            return
        self.stream_started = False
        try:
            self._complete(req, handle, Response(chat, self.server.model_id, req.logprobs is not None))
        except Exception as e:  # a bug, not the client's fault: say so instead of dropping the connection
            handle.cancel()
            self.log_error("generation failed: %r", e)
            error = error_body(f"generation failed: {e!r}", HTTPStatus.INTERNAL_SERVER_ERROR)
            try:
                if not self.stream_started:
                    self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, error, close=True)
                else:  # the 200 went out: the error comes as an event, as OpenAI's streams send one
                    self._event(error, done=True)
            except _ClientGone:
                pass
            self.close_connection = True

    def _submit(self, req: CompletionRequest):
        engine = self.server.engine
        if req.engine_extras and not getattr(engine, "takes_draft", False):
            raise RequestError(f"this server's engine ({type(engine).__name__}) does not take "
                               f"{' or '.join(map(repr, req.engine_extras))}", next(iter(req.engine_extras)))
        return engine.submit(req.prompt_ids, req.params, req.max_tokens, req.seed, req.logprobs, **req.engine_extras)

    def _read_json_or_none(self):
        if self.headers.get("Content-Length"):  # keep the connection usable
            try:
                self._read_json()
            except RequestError:
                pass

    def _complete(self, req: CompletionRequest, handle, resp: Response) -> None:
        text = CompletionText(self.server.tokenizer, req, handle)
        events = iter(handle)
        try:
            # The first event comes after the prompt step: its errors (context limit, bad sampling
            # values) must become a 400 before any 200 header goes out.
            first = next(events, None)
        except ValueError as e:
            self._send_error(RequestError(str(e)))
            return
        pieces = text.pieces(_chain(first, events))
        if req.stream:
            self._stream(req, handle, resp, text, pieces)
        else:
            self._whole(req, handle, resp, text, pieces)
        self._log_stats(req, handle, text)

    def _whole(self, req, handle, resp: Response, text: CompletionText, pieces) -> None:
        done = threading.Event()
        watcher = threading.Thread(target=self._watch_disconnect, args=(handle, done), daemon=True)
        watcher.start()
        try:
            parts, logprobs = [], []
            for p in pieces:
                parts.append(p.text)
                logprobs.extend(p.logprobs)
        finally:
            done.set()
        if self.client_gone:
            self.close_connection = True
            return
        self._send_json(HTTPStatus.OK, resp.whole("".join(parts), text.finish_reason, text.usage(), logprobs,
                                                  text.tool_calls))

    client_gone = False

    def _watch_disconnect(self, handle, done: threading.Event) -> None:
        """Cancel the request when the client closes its connection while it waits for a whole answer."""
        sock = self.connection
        poller = select.poll()  # not select(): connection numbers go past its FD_SETSIZE under load
        poller.register(sock, select.POLLIN)
        while not done.wait(0.1):
            if self.server.stopping.is_set():  # drain() shut the reading side: not the client leaving
                return
            # poll first: the socket has the read timeout, so recv would wait that long for data and
            # then raise a TimeoutError, which is not the client leaving
            if not poller.poll(0):
                continue
            try:
                gone = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except (BlockingIOError, InterruptedError, TimeoutError):
                continue
            except OSError:
                gone = True
            if gone and self.server.stopping.is_set():
                return  # drain() set stopping before it shut the reading side: that end-of-file is its own
            if gone:
                self.client_gone = True
                handle.cancel()
                return
            done.wait(0.5)  # the client sent more (a pipelined request): look again later

    def _stream(self, req, handle, resp: Response, text: CompletionText, pieces) -> None:
        self.stream_started = True
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # no Content-Length: the body ends when the connection does
        self.end_headers()
        self.close_connection = True
        try:
            if resp.chat:
                self._event(resp.chunk(None, role=True))
            for p in pieces:
                self._event(resp.chunk(p.text, logprobs=p.logprobs))
            if text.tool_calls:
                self._event(resp.chunk(None, tool_calls=text.tool_calls))
            self._event(resp.chunk(None, text.finish_reason), done=not req.include_usage)
            if req.include_usage:
                self._event(resp.usage_chunk(text.usage()), done=True)
        except _ClientGone:  # stop generating
            handle.cancel()
            pieces.close()

    def _event(self, obj: dict, done: bool = False) -> None:
        try:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n" + (b"data: [DONE]\n\n" if done else b""))
            self.wfile.flush()
        except (OSError, ValueError):  # broken pipe, reset, write timeout; ValueError: the file is closed
            raise _ClientGone from None

    def _log_stats(self, req, handle, text: CompletionText) -> None:
        if self.server.log is None:
            return
        s = getattr(handle, "stats", None) or {}
        prompt_tps = _rate(len(req.prompt_ids), s.get("prompt_time", 0.0))
        gen_tps = _rate(s.get("generation_tokens", 0), s.get("generation_time", 0.0))
        note = _draft_note(s) if "draft_steps" in s else ""
        print(f"  prompt: {len(req.prompt_ids)} tokens, {prompt_tps} tok/s | generation: "
              f"{text.completion_tokens} tokens, {gen_tps} tok/s | finish: {text.finish_reason}{note}",
              file=self.server.log, flush=True)


class _ClientGone(Exception):
    """The client of a stream left."""


def _rate(tokens: int, seconds: float) -> str:
    """Tokens per second; "-" without a measured time (one token: the first comes with the prompt)."""
    return f"{tokens / seconds:.1f}" if seconds > 0 else "-"


def _chain(first, rest):
    if first is not None:
        yield first
        yield from rest


def _draft_note(stats: dict) -> str:
    from .generate import DRAFT_STATS
    from .speculative import acceptance_summary

    summary = acceptance_summary({k: stats[k] for k in DRAFT_STATS})
    return f" | {summary}" if summary else ""


def engine_class_for(model, defaults: SamplingDefaults):
    """:class:`BatchEngine` (continuous batching, prompt cache, speculative decoding);
    :class:`SerialEngine` (one request at a time) for a model spread over processes
    (mlx.launch), whose other ranks mirror only the single-sequence forward."""
    from .distributed import DistributedModel

    return SerialEngine if isinstance(model, DistributedModel) else BatchEngine


def make_engine(model, tokenizer, defaults: SamplingDefaults, engine_class=None, **engine_options):
    """The server's engine: ``engine_class`` (default :func:`engine_class_for`) with the defaults'
    draft and :data:`serve_engine.ENGINE_OPTIONS` overridden by ``engine_options``."""
    engine_class = engine_class or engine_class_for(model, defaults)
    return engine_class(model, tokenizer, draft=defaults.draft, num_draft=defaults.num_draft,
                        **dict(ENGINE_OPTIONS, **engine_options))


def model_id_for(path: Optional[str]) -> str:
    return "colibri-demo" if path is None else os.path.basename(os.path.normpath(os.path.abspath(path)))


def serve(model, tokenizer, host: str = "127.0.0.1", port: int = 8080, model_id: str = "colibri",
          defaults: SamplingDefaults = SamplingDefaults(), engine_class=None, engine_options: dict = {},
          **server_options) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully: stop accepting, end the running
    streams with a final chunk, wait for the generation thread, return (exit status 0).
    ``engine_class``: default :func:`engine_class_for`; ``engine_options``:
    :data:`serve_engine.ENGINE_OPTIONS`; ``server_options``: ModelServer's."""
    engine = make_engine(model, tokenizer, defaults, engine_class, **engine_options)
    try:
        server = ModelServer((host, port), model, tokenizer, model_id, defaults, engine=engine, **server_options)
    except BaseException:
        engine.close()
        raise
    if host not in LOOPBACK_HOSTS and server.api_key is None:
        print(f"colibri serve: WARNING: listening on {host} (not loopback) without --api-key: anyone who can "
              "reach this address can use the model", file=sys.stderr, flush=True)
    if isinstance(engine, BatchEngine):
        drafts = "no speculative decoding by default" if engine.draft == "none" else \
            f"speculative decoding --draft {engine.draft} --num-draft {engine.num_draft}"
        print(f"colibri serve: continuous batching (--decode-concurrency {engine.decode_concurrency}, "
              f"--prompt-concurrency {engine.prompt_concurrency}, --prefill-step-size {engine.prefill_step_size}, "
              f"prompt cache {_bytes_text(engine.prompt_cache.max_bytes)}), {drafts}", file=sys.stderr, flush=True)
    elif isinstance(engine, SerialEngine):
        print("colibri serve: one request at a time (a model over several processes)", file=sys.stderr, flush=True)
    print(f"colibri serve: {model_id} at {server.url}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too: a process started in the background by a shell inherits SIGINT ignored.
    previous = signal.signal(signal.SIGTERM, interrupt), signal.signal(signal.SIGINT, interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("colibri serve: shutting down", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the drain short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            server.socket.close()  # stop accepting
            server.drain()
        finally:
            signal.signal(signal.SIGTERM, previous[0])
            signal.signal(signal.SIGINT, previous[1])

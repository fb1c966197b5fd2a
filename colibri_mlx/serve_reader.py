"""Connections waiting for a request, for ``colibri serve``: read on one selector thread, so that
a client that connects and sends nothing, or half a request, costs a file descriptor and a buffer,
not a thread. A request goes to a worker thread (a slot of the bounded pool) once its head and,
up to ``BODY_WAIT_BYTES``, its body have arrived; an idle keep-alive connection comes back here.
"""

from __future__ import annotations

import json
import re
import selectors
import socket
import threading
import time
from http import HTTPStatus
from typing import Callable

MAX_HEAD_BYTES = 70 << 10     # past it the handler answers 414 / 431 (http.server's 64 KiB line limits)
BODY_WAIT_BYTES = 1 << 20     # bodies up to this size are read here; larger ones by the worker
BUFFER_BUDGET = 256 << 20     # all connections' buffers together; over it requests go on without their body
_CONTENT_LENGTH = re.compile(rb"\ncontent-length:[ \t]*([^\r\n]*)", re.IGNORECASE)
_EXPECT_CONTINUE = re.compile(rb"\nexpect:[ \t]*100-continue", re.IGNORECASE)


def request_ready(buf: bytes, wait_for_body: bool) -> bool:
    """Whether ``buf`` holds a request the handler can take without waiting on the socket for its
    head (or a head too long to be one), and its body when it is small enough to wait for."""
    end = buf.find(b"\r\n\r\n")
    sep = 4
    if end < 0:
        end, sep = buf.find(b"\n\n"), 2
    if end < 0:
        return len(buf) > MAX_HEAD_BYTES
    if not wait_for_body or _EXPECT_CONTINUE.search(buf, 0, end + 1):
        return True  # (a client that expects "100 Continue" sends its body after the handler's answer)
    values = [v.decode("latin-1") for v in _CONTENT_LENGTH.findall(buf, 0, end + 1)]
    try:
        n = content_length(values) if values else 0
    except ValueError:
        return True  # the handler answers 400
    return n > BODY_WAIT_BYTES or len(buf) - end - sep >= n


def content_length(values) -> int:
    """The body length that a request's Content-Length header values give: one value, ASCII digits
    (int() also takes "+5", "1_0" and " 5", and with two lengths a proxy in front may frame the body
    by the other one: request smuggling). ValueError, saying which, otherwise."""
    lengths = {v.strip() for v in values}
    if len(lengths) > 1:
        raise ValueError(f"several Content-Length values: {', '.join(sorted(lengths))[:200]}")
    (length,) = lengths
    if not (length.isascii() and length.isdigit()):
        raise ValueError(f"bad Content-Length {length[:100]!r}: not a number of bytes")
    return int(length)


class _Waiting:
    __slots__ = ("addr", "buf", "deadline")

    def __init__(self, addr, buf: bytes, deadline: float):
        self.addr, self.buf, self.deadline = addr, bytearray(buf), deadline


class RequestReader:
    """Reads requests on one thread; ``dispatch(sock, addr, data)`` gets each ready one (the
    socket back in blocking mode). A connection whose request has not come within ``timeout``
    seconds is closed: silently when it sent nothing, with a 408 when it sent part of one."""

    def __init__(self, dispatch: Callable, timeout: float, log=None):
        self.dispatch, self.timeout, self.log = dispatch, timeout, log
        self.selector = selectors.DefaultSelector()
        self.waiting: dict[socket.socket, _Waiting] = {}
        self.incoming: list = []
        self.lock = threading.Lock()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.closed = False
        self.buffered = 0  # bytes in all the buffers of self.waiting
        self.next_expiry_check = 0.0
        self.thread = threading.Thread(target=self._run, name="colibri-reader", daemon=True)
        self.thread.start()

    def add(self, sock: socket.socket, addr, data: bytes = b"") -> None:
        """Wait for the next request on ``sock`` (``data``: what already came of it)."""
        with self.lock:
            if self.closed:
                _close(sock)
                return
            self.incoming.append((sock, addr, data))
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass

    def close(self) -> None:
        with self.lock:
            self.closed = True
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(5)


    def _run(self) -> None:
        try:
            while not self.closed:
                now = time.monotonic()
                next_deadline = min((w.deadline for w in self.waiting.values()), default=now + 1.0)
                for key, _ in self.selector.select(max(0.0, min(next_deadline - now, 1.0))):
                    if key.fileobj is self.wake_r:
                        self._take_incoming()
                    else:
                        self._read(key.fileobj)
                now = time.monotonic()
                if now >= self.next_expiry_check:  # not on every event: it walks every connection
                    self.next_expiry_check = now + 0.05
                    self._expire(now)
        finally:
            for sock in list(self.waiting):
                self._drop(sock)
            with self.lock:
                for sock, _, _ in self.incoming:
                    _close(sock)
                self.incoming.clear()
            self.selector.close()
            self.wake_r.close()
            self.wake_w.close()

    def _take_incoming(self) -> None:
        try:
            while self.wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        with self.lock:
            incoming, self.incoming = self.incoming, []
        for sock, addr, data in incoming:
            w = _Waiting(addr, data, time.monotonic() + self.timeout)
            try:
                sock.setblocking(False)
                self.selector.register(sock, selectors.EVENT_READ)
            except (OSError, ValueError):
                _close(sock)
                continue
            self.waiting[sock] = w
            self.buffered += len(w.buf)
            if data and request_ready(bytes(w.buf), True):  # a pipelined request came with the last one
                self._hand_over(sock)

    def _read(self, sock) -> None:
        w = self.waiting.get(sock)
        if w is None:
            return
        try:
            chunk = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client closed (an idle keep-alive, or it gave up)
            self._drop(sock)
            return
        w.buf += chunk
        self.buffered += len(chunk)
        if request_ready(bytes(w.buf), self.buffered <= BUFFER_BUDGET):
            self._hand_over(sock)

    def _expire(self, now: float) -> None:
        for sock, w in list(self.waiting.items()):
            if w.deadline > now:
                continue
            if w.buf:
                body = json.dumps({"error": {"message": f"the request did not arrive within {self.timeout:g} s",
                                             "type": "invalid_request_error", "param": None, "code": None}})
                _try_send(sock, f"HTTP/1.1 {HTTPStatus.REQUEST_TIMEOUT.value} Request Timeout\r\n"
                                f"Content-Type: application/json\r\nConnection: close\r\n"
                                f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
            self._drop(sock)

    def _hand_over(self, sock) -> None:
        w = self.waiting.pop(sock)
        self.buffered -= len(w.buf)
        self.selector.unregister(sock)
        try:
            sock.setblocking(True)
        except OSError:
            _close(sock)
            return
        self.dispatch(sock, w.addr, bytes(w.buf))

    def _drop(self, sock) -> None:
        w = self.waiting.pop(sock, None)
        if w is not None:
            self.buffered -= len(w.buf)
        try:
            self.selector.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass
        _close(sock)


def _try_send(sock, data: bytes) -> None:
    try:
        sock.send(data)
    except OSError:
        pass


def _close(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sock.close()


class ConnectionReader:
    """The handler's ``rfile``: what the reader already received, then the socket."""

    def __init__(self, data: bytes, sock: socket.socket):
        self.buf, self.sock = bytearray(data), sock

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def readline(self, limit: int = -1) -> bytes:
        while True:
            i = self.buf.find(b"\n")
            if i >= 0 and (limit < 0 or i < limit):
                n = i + 1
                break
            if 0 <= limit <= len(self.buf):
                n = limit
                break
            if not self._fill():
                n = len(self.buf)
                break
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            raise ValueError("read() of a connection needs a size")
        while len(self.buf) < n and self._fill():
            pass
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def leftover(self) -> bytes:
        return bytes(self.buf)

    def close(self) -> None:
        pass

"""A small priority thread pool for expert reads.

Expert reads are ``os.preadv`` calls, which release the GIL, so plain threads overlap disk
I/O with MLX compute. A ``ThreadPoolExecutor`` runs jobs first-in first-out; here reads the
current layer is waiting for (``DEMAND``) overtake speculative ones (``PREFETCH``) queued
earlier, and a speculative read that was cancelled before it started costs nothing.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from concurrent.futures import Future
from typing import Callable

DEMAND = 0  # the model is (or soon will be) blocked on this read
PREFETCH = 1  # a guess: the previous token's experts of an upcoming layer
BACKGROUND = 2  # warming the pinned set


class ReadPool:
    """``submit(fn, priority) -> Future``; lower priority values run first, FIFO within one."""

    def __init__(self, workers: int, name: str = "colibri-expert-read"):
        if workers < 1:
            raise ValueError(f"ReadPool needs at least one worker, got {workers}")
        self._heap: list = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, priority: int = DEMAND) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("ReadPool is closed")
            heapq.heappush(self._heap, (priority, next(self._order), fut, fn))
            self._cv.notify()
        return fut

    def close(self) -> None:
        """Cancel queued jobs, let running ones finish, stop the workers."""
        with self._cv:
            self._closed = True
            for _, _, fut, _ in self._heap:
                fut.cancel()
            self._heap.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if self._closed and not self._heap:
                    return
                _, _, fut, fn = heapq.heappop(self._heap)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to whoever waits on the future
                fut.set_exception(e)

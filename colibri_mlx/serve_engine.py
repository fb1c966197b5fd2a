"""The generation engine behind ``colibri serve``: the one seam between HTTP and the model.

The server hands every completion to an engine and reads tokens back; stop strings,
detokenisation, tool-call parsing and the OpenAI response shapes stay in the server. An engine
implements::

    engine.submit(prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                  seed: int | None, logprobs: int | None) -> handle

``logprobs`` is the number of top alternatives wanted per token (0: the chosen token's
log-probability only; None: none). ``submit`` checks the request (a ValueError is the client's
fault: an HTTP 400) and returns at once. The ``handle``

* iterates over :class:`TokenEvent` (``token``, ``logprob``, ``top_logprobs``,
  ``finish_reason``): one per generated token, the last with ``finish_reason`` "stop" (an
  end-of-sequence token, which is yielded) or "length". An error of the prompt step (context
  limit, bad sampling values) is raised as ValueError by the first ``next()``.
* ``cancel()``: from any thread; the engine stops the sequence between two tokens and the
  iteration ends without a ``finish_reason``.
* ``cached_tokens``: how many prompt tokens came from a prompt cache (0 without one).

``engine.close()`` cancels everything in flight and returns once no MLX work is left running
(the process may then exit: MLX work on a thread at interpreter exit aborts the process).
Engines are built as ``Engine(model, tokenizer, draft=..., num_draft=..., **ENGINE_OPTIONS values)``
(the draft values: the server's defaults for speculative decoding); :class:`SerialEngine` accepts
and ignores the batching options. An engine with ``takes_draft = True`` also takes ``draft=`` and
``num_draft=`` keywords in ``submit`` (a request's own choice); the server refuses requests that
name them otherwise.

The engines: :class:`colibri_mlx.batch_engine.BatchEngine` (continuous batching, a prompt
cache and speculative decoding; the server's engine) and :class:`SerialEngine` (one request at a
time, with speculative decoding; the server's engine for a model over several processes).

Log-probabilities are those of the logits the sampler saw: after ``logit_bias`` and the
penalties, before temperature and the top-k/top-p/min-p filters (``generate_tokens``).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import mlx.core as mx

from .generate import SamplingParams, needs_plain_decoding

# mlx_lm.server's defaults (its --decode-concurrency, --prompt-concurrency, --prefill-step-size,
# --prompt-cache-bytes: None is unbounded).
ENGINE_OPTIONS = {"decode_concurrency": 32, "prompt_concurrency": 8, "prefill_step_size": 2048,
                  "prompt_cache_bytes": None}
MAX_TOP_LOGPROBS = 20


def top_logprobs(logp, k: int) -> tuple:
    """The ``k`` largest entries of a log-softmax row, lazily and unordered: ``(ids, values)``
    (a partition, not a sort of the vocabulary)."""
    ids = mx.argpartition(-logp, k - 1)[:k]
    return ids, logp[ids]


def sorted_pairs(ids, values) -> list:
    """``[(token id, logprob)]`` of :func:`top_logprobs`'s arrays, most likely first."""
    return sorted(zip(ids.tolist(), values.tolist()), key=lambda p: -p[1])


def end_model_thread() -> None:
    """The last call of an engine's model thread: wait for the work it queued, then destroy the
    streams MLX made for the thread (``mx.clear_streams``, as MLX's own threaded tests end),
    so that their teardown runs here and not in the thread's exit, which may run beside the
    interpreter's teardown when the process exits right after the engine closes."""
    mx.synchronize()
    mx.clear_streams()


@dataclass(frozen=True)
class TokenEvent:
    token: int
    logprob: Optional[float] = None
    top_logprobs: Optional[list] = None  # [(token id, logprob)], most likely first
    finish_reason: Optional[str] = None  # "stop", "length", or None while generating


_DONE = object()


class SerialHandle:
    """One submitted request of :class:`SerialEngine`: the events come through a queue."""

    cached_tokens = 0

    def __init__(self, job: tuple):
        self.job = job
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            item = self.events.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class SerialEngine:
    """One request at a time on one worker thread (MLX evaluation and the latent cache are not
    thread-safe), through ``generate_tokens``; requests queue in arrival order. A cancelled
    request stops between two tokens."""

    takes_draft = True

    def __init__(self, model, tokenizer, draft: Optional[str] = None, num_draft: int = 3, **batching_options):
        unknown = set(batching_options) - set(ENGINE_OPTIONS)
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        from .generate import _stop_ids

        self.model, self.tokenizer = model, tokenizer
        self.draft, self.num_draft = draft, num_draft
        self.stop_ids = _stop_ids(model, tokenizer)
        self.jobs: queue.Queue = queue.Queue()
        self.live: set[SerialHandle] = set()
        self.lock = threading.Lock()
        self.closed = False
        self.worker = threading.Thread(target=self._run, name="colibri-generate", daemon=True)
        self.worker.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, seed: Optional[int] = None,
               logprobs: Optional[int] = None, draft: Optional[str] = None,
               num_draft: Optional[int] = None) -> SerialHandle:
        """Queue a completion (the module docstring has the protocol; ``draft`` and ``num_draft``
        are this engine's extras, speculative decoding, docs/speculative.md)."""
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {logprobs}")
        if draft is None and not needs_plain_decoding(params, logprobs is not None):
            draft = self.draft  # the server's default; a request that needs plain decoding gets it
        job = (list(prompt_ids), params, max_tokens, seed, logprobs, draft,
               self.num_draft if num_draft is None else num_draft)
        handle = SerialHandle(job)
        with self.lock:
            if self.closed:
                raise RuntimeError("the engine is closed")
            self.live.add(handle)
        self.jobs.put(handle)
        return handle

    def cancel_all(self) -> None:
        with self.lock:
            for h in self.live:
                h.cancel()

    def close(self, timeout: Optional[float] = None) -> None:
        with self.lock:
            self.closed = True
        self.cancel_all()
        self.jobs.put(None)
        self.worker.join(timeout)

    @property
    def busy(self) -> bool:
        return bool(self.live)

    # -- the worker thread --

    def _run(self) -> None:
        try:
            self._serve_jobs()
        finally:
            end_model_thread()

    def _serve_jobs(self) -> None:
        while True:
            handle = self.jobs.get()
            if handle is None:
                return
            try:
                if not handle.cancelled.is_set():
                    self._generate(handle)
            except Exception as e:  # to the request's thread: a ValueError there is a 400
                handle.events.put(e)
            finally:
                handle.events.put(_DONE)
                with self.lock:
                    self.live.discard(handle)

    def _generate(self, handle: SerialHandle) -> None:
        from .generate import generate_tokens

        prompt_ids, params, max_tokens, seed, logprobs, draft, num_draft = handle.job
        tokens = generate_tokens(self.model, prompt_ids, max_tokens, params, seed, stop_ids=self.stop_ids,
                                 draft=draft, num_draft=num_draft, logprobs=logprobs is not None)
        try:
            for token, stats in tokens:
                chosen, top = None, None
                if logprobs is not None:
                    lp = stats["logprobs"]
                    chosen = lp[token].item()
                    if logprobs > 0:
                        top = sorted_pairs(*top_logprobs(lp, logprobs))
                handle.events.put(TokenEvent(token, chosen, top, stats["finish_reason"]))
                handle.stats = stats
                if handle.cancelled.is_set():
                    return
        finally:
            tokens.close()
            store = getattr(self.model, "expert_store", None)
            if store is not None:
                store.save_usage()

"""Continuous batching: many requests decoded together, joining and leaving between steps.

    engine = BatchEngine(model, tokenizer)
    handle = engine.submit(prompt_ids, SamplingParams(), max_tokens=64, seed=None, logprobs=None)
    for ev in handle:          # TokenEvent(token, logprob, top_logprobs, finish_reason)
        ...
    engine.close()

It is the engine of ``colibri serve`` and implements the server's engine seam
(colibri_mlx.serve_engine: ``submit``, ``handle.cancel()``, ``handle.cached_tokens``,
``cancel_all``, ``close``), speculative decoding included (``draft`` / ``num_draft``, the
engine's default and each request's own: colibri_mlx.speculative).

One background thread owns the model: every MLX operation runs on it. ``submit`` is
thread-safe and returns at once; each request's events flow through its own queue.

A loop iteration (a *step*):

1. requests that were cancelled leave (their iteration ends without a ``finish_reason``);
2. waiting requests are admitted while fewer than ``prompt_concurrency`` prompts are in
   prefill and fewer than ``decode_concurrency`` requests are admitted in all; an admitted
   request starts from the prompt cache's longest matching prefix (colibri_mlx.prompt_cache);
3. prompts in prefill advance by one chunk each, the shortest remaining first (at most
   ``prefill_step_size`` tokens a chunk, and about as many in all for the step), so a long
   prompt never stalls the running decode, nor a short prompt that arrives after it, for longer
   than one chunk; the chunk that ends a prompt gives the request's first token;
4. every running request gets one token from one batched decode step
   (colibri_mlx.models.batch_decode), each sampled with the request's own sampler: its own
   parameters and seed, so seeded output does not depend on what else is in the batch.
   While some running request speculates, the step is a verify step instead
   (``DecodeBatch.verify``): each speculating request feeds its pending token and its drafts
   (MTP or n-gram), the others their pending token, all as rows of one step; each keeps the
   drafts its model agrees with plus one token of its own (speculative.Acceptor: the same
   tokens as without speculation when greedy, the same distribution when sampling) and its
   rows past them are rolled back.

Drafts fill the decode rows a step has room for: a request drafts up to
``ROW_GROUP // running - 1`` tokens (7 alone, 3 beside one other, 1 with three others, none
with five or more), so a verify step reads every weight once, as a decode step does, and a
large batch decodes plainly. A seeded sampling request always drafts its own ``num_draft``
(its random draws then do not depend on the batch). An MTP request's draft layer sees the rows
of the verify steps it takes part in; after plain steps it lags, drafts nothing in the next
verify step and catches up there (drafts are verified, so a lag only costs acceptance).

A request ends at ``max_tokens``, at one of the model's stop token ids (``finish_reason="stop"``,
the stop token is the last event's token) or at the context limit (``"length"``). Stop strings
are the caller's business. A finished or cancelled request leaves its cache in the prompt cache.

Each request's logits go through ``generate.adjust_logits`` (``logit_bias``, presence/frequency
and repetition penalties), as in ``generate_tokens``. Logprobs (``logprobs`` is the number of top
alternatives, 0 for the chosen token only, None for none) are the float32 log-softmax of those
logits, before temperature and the top-k/top-p/min-p filters.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import mlx.core as mx

from .generate import (SamplingParams, _stop_ids, adjust_logits, log_softmax32, make_sampler,
                       needs_plain_decoding)
from .models.batch_decode import ROW_GROUP, DecodeBatch
from .models.deepseek_v3 import rms_norm
from .prompt_cache import PromptCache
from .serve_engine import ENGINE_OPTIONS, TokenEvent, end_model_thread, sorted_pairs, top_logprobs
from .speculative import (DEFAULT_NUM_DRAFT, Acceptor, DraftLength, DraftStats, MTPDraft, NgramIndex,
                          check_num_draft, greedy_accept, observe_rows, propose_rows, resolve_draft)

PROMPT_CACHE_ENTRIES = 10      # mlx-lm's server default (--prompt-cache-size)


_CANCELLED = object()           # a request's queue: it ended without a finish_reason


@dataclass(eq=False)             # compared by identity (two requests may be alike)
class _Request:
    prompt: list
    params: SamplingParams
    max_tokens: int
    seed: Optional[int]
    logprobs: Optional[int]
    draft: str = "none"
    num_draft: int = DEFAULT_NUM_DRAFT
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: bool = False
    cached_tokens: int = 0
    cache: object = None
    sampler: object = None
    prefilled: int = 0           # prompt tokens in the cache
    generated: list = field(default_factory=list)
    done: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    acceptor: Optional[Acceptor] = None        # speculating: drafts' choice and acceptance
    draft_length: Optional[DraftLength] = None
    mtp: Optional[MTPDraft] = None
    ngrams: Optional[NgramIndex] = None         # draft="ngram": the context's lookup index
    draft_stats: DraftStats = field(default_factory=DraftStats)

    @property
    def seeded_sampling(self) -> bool:
        return self.params.temperature > 0 and self.seed is not None


class RequestHandle:
    """Iterate for the request's :class:`TokenEvent` s; the iteration ends after the one with a
    ``finish_reason``, or without one when the request was cancelled, and raises the error a
    failed request met (a bad prompt step's ValueError on the first ``next()``)."""

    def __init__(self, engine: "BatchEngine", request: _Request):
        self._engine, self._request = engine, request

    def __iter__(self):
        while True:
            item = self._request.events.get()
            if item is _CANCELLED:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    def cancel(self) -> None:
        """Stop generating (from any thread); the iteration ends without a ``finish_reason``
        (unless the request finished first)."""
        self._request.cancelled = True
        self._engine._wake()

    @property
    def stats(self) -> dict:
        """Timing as ``generate_tokens`` reports it: ``prompt_time`` (submission to the first
        token, the wait for a batch slot included), ``generation_tokens``, ``generation_time``."""
        r = self._request
        if r.first_token_at is None:
            return {}
        stats = {"prompt_tokens": len(r.prompt), "prompt_time": r.first_token_at - r.submitted,
                 "generation_tokens": len(r.generated), "generation_time": r.last_token_at - r.first_token_at}
        if r.draft != "none":
            stats.update(r.draft_stats.as_dict())
        return stats

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prompt cache (known once the first event has come)."""
        return self._request.cached_tokens


class BatchEngine:
    """Serves :meth:`submit` calls from one model thread (module docstring)."""

    takes_draft = True

    def __init__(self, model, tokenizer=None, draft: Optional[str] = None, num_draft: Optional[int] = None,
                 decode_concurrency: int = ENGINE_OPTIONS["decode_concurrency"],
                 prompt_concurrency: int = ENGINE_OPTIONS["prompt_concurrency"],
                 prefill_step_size: int = ENGINE_OPTIONS["prefill_step_size"],
                 prompt_cache_bytes: Optional[int] = ENGINE_OPTIONS["prompt_cache_bytes"],
                 prompt_cache_entries: int = PROMPT_CACHE_ENTRIES, stop_ids: Optional[Sequence[int]] = None):
        from .distributed import DistributedModel

        if isinstance(model, DistributedModel):   # the other ranks mirror the single-sequence forward only
            raise ValueError("the batching engine runs a model in one process, not under mlx.launch: "
                             "use SerialEngine")
        for name, value in (("decode_concurrency", decode_concurrency), ("prompt_concurrency", prompt_concurrency),
                            ("prefill_step_size", prefill_step_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.model = model
        # the requests' default: None is "none" (a request speculates when it asks, or by --draft)
        self.draft = resolve_draft(model, "none" if draft is None else draft)
        self.num_draft = check_num_draft(DEFAULT_NUM_DRAFT if num_draft is None else num_draft)
        self.decode_concurrency = decode_concurrency
        self.prompt_concurrency = min(prompt_concurrency, decode_concurrency)
        self.prefill_step_size = prefill_step_size
        self.prompt_cache = PromptCache(prompt_cache_bytes, prompt_cache_entries)
        self.stop_ids = frozenset(int(s) for s in (_stop_ids(model, tokenizer) if stop_ids is None else stop_ids))
        self.vocab_size = model.args.vocab_size
        self.stats = {"steps": 0, "decode_rows": 0, "prefill_chunks": 0, "prefill_tokens": 0, "cached_tokens": 0,
                      "steps_ahead": 0, "verify_steps": 0, "draft_proposed": 0, "draft_accepted": 0}
        self._cond = threading.Condition()
        self._inbox: deque = deque()
        self._live: set = set()       # submitted and not ended (guarded by _cond)
        self._waiting: deque = deque()
        self._prefilling: list = []
        self._running: list = []     # in the order of the decode batch's sequences
        self._batch = DecodeBatch(model)
        self._ahead = None           # (logits, rows): the next step, built before this one's tokens were read
        self._stopping = False
        self._cancel_all = False
        self._thread = threading.Thread(target=self._loop, name="colibri-batch-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------ caller side

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(), max_tokens: int = 256,
               seed: Optional[int] = None, logprobs: Optional[int] = None, draft: Optional[str] = None,
               num_draft: Optional[int] = None) -> RequestHandle:
        """Queue a request; raises ValueError for a bad one (nothing is queued then). ``draft``
        ("mtp", "ngram", "none"; None: the engine's default, "none" for a request that needs plain
        decoding) and ``num_draft`` (None: the engine's) are its speculative decoding."""
        return self.submit_all([dict(prompt_ids=prompt_ids, params=params, max_tokens=max_tokens, seed=seed,
                                     logprobs=logprobs, draft=draft, num_draft=num_draft)])[0]

    def submit_all(self, requests: Sequence[dict]) -> list[RequestHandle]:
        """Queue several requests (each a dict of :meth:`submit`'s arguments) at once: the engine
        sees them together. All are checked first; a bad one raises and none is queued."""
        made = [self._request(**r) for r in requests]
        with self._cond:
            if self._stopping:
                raise RuntimeError("the batch engine is shut down")
            self._inbox.extend(made)
            self._live.update(made)
            self._cond.notify()
        return [RequestHandle(self, r) for r in made]

    def _request(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(), max_tokens: int = 256,
                 seed: Optional[int] = None, logprobs: Optional[int] = None, draft: Optional[str] = None,
                 num_draft: Optional[int] = None) -> _Request:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("empty prompt")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the model's vocabulary (vocab_size={self.vocab_size})")
        if len(prompt) > self.model.max_length:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds the context limit of {self.model.max_length} "
                             "tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= self.vocab_size):
            raise ValueError(f"logprobs must be an integer in 0..{self.vocab_size} or None, got {logprobs!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        plain = needs_plain_decoding(params, logprobs is not None)
        if draft is None:
            draft = "none" if plain else self.draft
        elif plain and draft != "none":
            raise ValueError("logprobs, logit_bias and the presence/frequency penalties need draft='none'")
        draft = resolve_draft(self.model, draft)
        num_draft = check_num_draft(self.num_draft if num_draft is None else num_draft)
        return _Request(prompt, params, max_tokens, seed, logprobs, draft, num_draft)

    def shutdown(self, cancel: bool = True, timeout: Optional[float] = None) -> None:
        """Stop the model thread: with ``cancel`` every request not finished ends (without a
        ``finish_reason``), else the requests submitted so far are finished first. Returns once
        the thread has ended and no MLX work it queued is left running (or after ``timeout``)."""
        with self._cond:
            self._stopping = True
            self._cancel_all = cancel
            self._cond.notify()
        self._thread.join(timeout)

    def close(self, timeout: Optional[float] = None) -> None:
        """The server seam's name for ``shutdown(cancel=True)``."""
        self.shutdown(cancel=True, timeout=timeout)

    def cancel_all(self) -> None:
        """Cancel every request submitted so far (they end between two steps)."""
        with self._cond:
            for r in self._live:
                r.cancelled = True
            self._cond.notify()

    @property
    def busy(self) -> bool:
        """Whether any request is waiting, in prefill or decoding."""
        with self._cond:
            return bool(self._live)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # ------------------------------------------------------------------------ model thread

    def _loop(self) -> None:
        try:
            self._serve_steps()
        finally:
            self._ahead = None
            end_model_thread()   # no queued step or MLX thread state may outlive the thread

    def _serve_steps(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._waiting or self._prefilling or self._running or self._stopping):
                    self._cond.wait()
                self._waiting.extend(self._inbox)
                self._inbox.clear()
                if self._stopping and self._cancel_all:
                    for r in self._all():
                        r.cancelled = True
                idle = not (self._waiting or self._prefilling or self._running)
            if self._stopping and idle:
                return
            try:
                self._step()
            except Exception as e:  # noqa: BLE001 (an engine fault: every request hears of it, none hangs)
                everyone = self._all()
                self._batch, self._running, self._prefilling, self._ahead = DecodeBatch(self.model), [], [], None
                self._waiting.clear()
                self._fail(everyone, e)

    def _step(self) -> None:
        self._leave_cancelled()
        if not self._running:
            self._ahead = None
        if self._ahead is None:          # a step queued ahead holds the batch's composition
            self._admit()
            self._prefill_step()
        if self._running:
            self._decode_step()
        self.stats["steps"] += 1

    def _all(self):
        return list(self._waiting) + self._prefilling + self._running

    def _leave_cancelled(self) -> None:
        for r in [r for r in self._all() if r.cancelled]:
            self._finish(r, _CANCELLED)

    def _admit(self) -> None:
        while (self._waiting and len(self._prefilling) < self.prompt_concurrency
               and len(self._prefilling) + len(self._running) < self.decode_concurrency):
            r = self._waiting.popleft()
            try:
                r.cache, r.prefilled = self.prompt_cache.fetch(r.prompt)
                if r.cache is None:
                    r.cache = self.model.make_cache()
                r.cached_tokens = r.prefilled
                self.stats["cached_tokens"] += r.prefilled
                r.sampler = make_sampler(r.params, r.seed)
                if r.draft != "none":
                    r.acceptor = Acceptor(r.params, r.seed, list(r.prompt))
                    r.draft_length = DraftLength(r.num_draft, adaptive=r.draft == "mtp")
                    r.mtp = MTPDraft(self.model, r.cache) if r.draft == "mtp" else None
                    r.ngrams = NgramIndex(r.prompt) if r.draft == "ngram" else None
            except Exception as e:  # noqa: BLE001 (the request's error, not the engine's)
                self._fail([r], e)
                continue
            self._prefilling.append(r)

    def _prefill_step(self) -> None:
        budget = self.prefill_step_size
        # shortest remaining prompt first: a short request that arrives while a long prompt is in
        # prefill gets its first token at once instead of after the long one's last chunk
        for r in sorted(self._prefilling, key=lambda r: len(r.prompt) - r.prefilled):
            if budget <= 0:
                break
            n = min(self.prefill_step_size, len(r.prompt) - r.prefilled, budget)
            budget -= n
            try:
                start = r.prefilled
                x = self.model.hidden_states(mx.array([r.prompt[start: start + n]]), r.cache)
                r.prefilled += n
                self.stats["prefill_chunks"] += 1
                self.stats["prefill_tokens"] += n
                # the MTP layer sees every prompt row, with the token after it
                h = None if r.mtp is None else rms_norm(x, self.model.norm, self.model.args.rms_norm_eps)
                if r.prefilled < len(r.prompt):
                    if h is not None:
                        r.mtp.observe(h, r.prompt[start + 1: r.prefilled + 1])
                    mx.eval(x, *self._mtp_state(r))
                    continue
                logits = self.model.head(x[:, -1:])[0, -1]       # the last row only
                self._prefilling.remove(r)
                self._emit([r], *self._sample([r], logits[None]))
                if h is not None and not r.done:
                    r.mtp.observe(h, r.prompt[start + 1:] + r.generated[-1:])
                if not r.done:
                    self._batch.add(r.cache)
                    r.cache = None
                    self._running.append(r)
            except Exception as e:  # noqa: BLE001
                self._fail([r], e)

    def _decode_step(self) -> None:
        """One token for every running request. The next step is built and queued (fed with
        this step's tokens, still on the device) before this step's tokens are read, so the
        host builds step n + 1 while the device runs step n, as mlx-lm's generate loop does;
        a request that ends takes its fed-ahead row back (DecodeBatch.take_back)."""
        rows = list(self._running)
        if self._ahead is None:
            counts = self._draft_counts(rows)
            if counts is not None:
                return self._verify_step(rows, counts)
        try:
            if self._ahead is not None:
                logits, ahead_rows = self._ahead
                self._ahead = None
                if ahead_rows != rows:                      # some left (finished or cancelled)
                    logits = logits[mx.array([ahead_rows.index(r) for r in rows])]
            else:
                logits = self._batch.step([r.generated[-1] for r in rows])
            self.stats["decode_rows"] += len(rows)
            tokens, extras = self._sample(rows, logits)
            if self._runs_ahead(rows):
                mx.async_eval(tokens, extras)
                self._ahead = (self._batch.step(tokens), rows)
                self.stats["steps_ahead"] += 1
                mx.async_eval(self._ahead[0])
            self._emit(rows, tokens, extras)
        except Exception as e:  # noqa: BLE001
            self._batch = DecodeBatch(self.model)      # its rows may be half written: start afresh
            self._running, self._ahead = [], None
            self._fail(rows, e)

    def _runs_ahead(self, rows: list) -> bool:
        """Whether to queue the next step before reading this one's tokens: the batch stays as
        it is (no prompt waits to join), the pooled layout takes lazy tokens, some request
        continues, and no row can reach the context limit."""
        if not self._batch.pooled or self._waiting or self._prefilling or self._inbox:
            return False
        if self._draft_counts(rows) is not None:     # the next step verifies drafts of these tokens
            return False
        limit = self.model.max_length
        return (any(len(r.generated) + 1 < r.max_tokens for r in rows)
                and all(len(r.prompt) + len(r.generated) + 2 < limit for r in rows))

    def _sample(self, rows: list, logits: mx.array) -> tuple[mx.array, list]:
        """One token per request from its row of ``logits [n, V]`` (lazy ``[n]`` int32), and
        the logprob arrays asked for. Plain greedy rows share one argmax; a row with penalties
        or ``logit_bias`` is adjusted first (``generate.adjust_logits``)."""
        greedy = mx.argmax(logits, axis=-1)
        tokens, extras = [], []
        for i, r in enumerate(rows):
            p = r.params
            row = logits[i]
            if r.acceptor is not None and not r.acceptor.lazy_greedy:
                # a speculating request draws every token through its acceptor (its own random
                # stream, whether the step verifies drafts or not)
                r.acceptor.seen = r.prompt + r.generated
                tokens.append(mx.array(r.acceptor.accept(row[None], [], [])[0], dtype=mx.int32))
                extras.append(())
                continue
            adjusted = p.counts_tokens or bool(p.logit_bias)
            if adjusted:
                row = adjust_logits(row, p, r.prompt + r.generated, len(r.prompt))
            tok = greedy[i] if p.temperature == 0 and not adjusted else r.sampler(row)
            tokens.append(tok)
            if r.logprobs is None:
                extras.append(())
                continue
            logp = log_softmax32(row)
            if r.logprobs == 0:
                extras.append((logp[tok],))
            else:
                extras.append((logp[tok], *top_logprobs(logp, r.logprobs)))
        return mx.stack(tokens).astype(mx.int32), extras

    def _emit(self, rows: list, tokens: mx.array, extras: list) -> None:
        """Read the tokens (one transfer) and hand out the events."""
        values = tokens.tolist()
        mx.eval([a for e in extras for a in e])
        self._deliver(rows, [[v] for v in values], [[e] for e in extras])

    def _finish_reason(self, r: _Request, token: int, generated: int) -> Optional[str]:
        """How ``r`` ends with ``token`` as its ``generated``-th token, or None."""
        if token in self.stop_ids:
            return "stop"
        if generated >= r.max_tokens or len(r.prompt) + generated > self.model.max_length:
            return "length"
        return None

    def _deliver(self, rows: list, outs: list, extras: list) -> None:
        """Hand out each row's tokens ``outs[i]`` (with their logprob arrays ``extras[i]``),
        ending a request at the token that finishes it."""
        now = time.perf_counter()
        for r, out, extra_list in zip(rows, outs, extras):
            for token, extra in zip(out, extra_list):
                r.generated.append(token)
                if r.ngrams is not None:
                    r.ngrams.extend([token])
                if r.first_token_at is None:
                    r.first_token_at = now
                r.last_token_at = now
                logprob = top = None
                if extra:
                    logprob = float(extra[0].item())
                    if len(extra) == 3:
                        top = sorted_pairs(*extra[1:])
                finish = self._finish_reason(r, token, len(r.generated))
                ev = TokenEvent(token, logprob, top, finish)
                if finish is not None:
                    self._finish(r, ev)
                    break
                r.events.put(ev)

    # ------------------------------------------------------------------------ speculation

    def _draft_counts(self, rows: list) -> Optional[list]:
        """Drafts each running request feeds the next step, or None when no request has any to
        feed (a plain decode step). Drafts fill the rows one GEMV launch takes (module docstring);
        a request whose MTP layer lags drafts none and catches up in the step."""
        budget = ROW_GROUP // len(rows) - 1
        counts, wanted = [], False
        for r in rows:
            k = 0
            if r.draft != "none":
                held = len(r.prompt) + len(r.generated) - 1          # rows in the cache
                room = min(r.max_tokens - len(r.generated), self.model.max_length - held)
                k = max(min(r.draft_length.k, room - 1, r.draft_length.k if r.seeded_sampling else budget), 0)
                wanted = wanted or k > 0
                if r.mtp is not None and r.mtp.cache.offset != held:
                    k = 0
            counts.append(k)
        return counts if wanted else None

    def _drafts(self, rows: list, counts: list) -> list:
        """Each request's ``counts[i]`` drafts (ints, or lazy arrays: greedy MTP drafts) and their
        q's; the MTP requests draft together (speculative.propose_rows)."""
        drafted = [([], []) for _ in rows]
        mtp = [i for i, (r, k) in enumerate(zip(rows, counts)) if k > 0 and r.mtp is not None]
        for i in mtp:
            rows[i].acceptor.seen = rows[i].prompt + rows[i].generated
        proposed = propose_rows([rows[i].mtp for i in mtp], [counts[i] for i in mtp],
                                [rows[i].acceptor.choose for i in mtp]) if mtp else []
        for i, d in zip(mtp, proposed):
            drafted[i] = d
        for i, (r, k) in enumerate(zip(rows, counts)):
            if k > 0 and r.ngrams is not None:
                drafts = r.ngrams.drafts(k)
                drafted[i] = (drafts, [None] * len(drafts))
        return drafted

    @staticmethod
    def _mtp_state(r: _Request) -> list:
        """The arrays of ``r``'s MTP layer a step leaves (evaluated with the step)."""
        if r.mtp is None or r.mtp.logits is None:
            return []
        return [r.mtp.logits, r.mtp.x, *r.mtp.cache.layers[0].buffers.values()]

    def _verify_step(self, rows: list, counts: list) -> None:
        """One verify step (module docstring): every running request's pending token and its
        ``counts[i]`` drafts as rows of one step."""
        try:
            drafted = self._drafts(rows, counts)
            pieces = []
            for r, (drafts, _) in zip(rows, drafted):
                pieces.append(mx.array([r.generated[-1]], dtype=mx.int32))
                pieces += [d.astype(mx.int32).reshape(1) if isinstance(d, mx.array) else mx.array([d], dtype=mx.int32)
                           for d in drafts]
            ids = mx.concatenate(pieces)
            fed = [1 + len(d) for d, _ in drafted]
            starts = [sum(fed[:i]) for i in range(len(rows))]
            held = [self._batch.length(i) for i in range(len(rows))]
            h, logits = self._batch.verify(ids, fed)
            self.stats["verify_steps"] += 1
            self.stats["decode_rows"] += ids.size
            plain = [i for i, r in enumerate(rows) if r.acceptor is None]
            plain_tokens, plain_extras = self._sample([rows[i] for i in plain],
                                                      logits[mx.array([starts[i] for i in plain])]) if plain else \
                (mx.zeros((0,), mx.int32), [])
            # the drafts (lazy MTP ones included), the greedy targets and the plain rows' tokens: one read
            values = mx.concatenate([ids, mx.argmax(logits, axis=-1).astype(mx.int32), plain_tokens]).tolist()
            mx.eval([a for e in plain_extras for a in e])
            R = ids.size
            outs, extras = [], []
            for i, r in enumerate(rows):
                a, m = starts[i], fed[i]
                if r.acceptor is None:
                    outs.append([values[2 * R + plain.index(i)]])
                    extras.append([plain_extras[plain.index(i)]])
                    continue
                drafts = values[a + 1: a + m]
                if r.acceptor.lazy_greedy:
                    out = greedy_accept(values[R + a: R + a + m], drafts)
                else:
                    r.acceptor.seen = r.prompt + r.generated
                    out = r.acceptor.accept(logits[a: a + m], drafts, drafted[i][1])
                r.draft_stats.steps += 1
                r.draft_stats.proposed += len(drafts)
                r.draft_stats.accepted += len(out) - 1
                self.stats["draft_proposed"] += len(drafts)
                self.stats["draft_accepted"] += len(out) - 1
                r.draft_length.update(len(drafts), len(out) - 1)
                outs.append(out)
                extras.append([()] * len(out))
            observing = []
            for i, r in enumerate(rows):
                out = outs[i] = self._emitted(r, outs[i])
                self._batch.rewind(i, held[i] + len(out))          # the rows of rejected drafts go
                if r.mtp is not None:       # also as the request ends: its rows go to the prompt cache
                    r.mtp.cache.offset = held[i]                  # a lagging layer skips the rows it missed
                    observing.append(i)
            if observing:
                observe_rows([rows[i].mtp for i in observing],
                             [h[starts[i]: starts[i] + len(outs[i])] for i in observing], [outs[i] for i in observing])
            mx.eval([a for r in rows for a in self._mtp_state(r)])
            self._deliver(rows, outs, extras)
        except Exception as e:  # noqa: BLE001
            self._batch = DecodeBatch(self.model)      # its rows may be half written: start afresh
            self._running, self._ahead = [], None
            self._fail(rows, e)

    def _emitted(self, r: _Request, out: list) -> list:
        """``out`` up to the token that ends ``r`` (that token included)."""
        for j, token in enumerate(out):
            if self._finish_reason(r, token, len(r.generated) + j + 1) is not None:
                return out[: j + 1]
        return out

    def _finish(self, r: _Request, last) -> None:
        """End ``r`` with ``last`` (its final event, or ``_CANCELLED``) and leave its cache to the
        prompt cache."""
        cache, r.cache = r.cache, None
        if r in self._running:
            i = self._running.index(r)
            if self._ahead is not None:          # its next row was fed ahead: not part of its history
                self._batch.take_back(i)
            cache = self._batch.remove(i)
            self._running[i] = self._running[-1]
            self._running.pop()
        if r in self._prefilling:
            self._prefilling.remove(r)
        if r in self._waiting:
            self._waiting.remove(r)
        if r.mtp is not None and cache is not None:
            cache.mtp_cache = r.mtp.cache          # kept with the cache by the prompt cache
        r.done = True
        r.mtp = r.acceptor = r.ngrams = None
        self._ended(r)
        r.events.put(last)
        if cache is None or cache.offset == 0:
            return
        held = r.prompt[: r.prefilled] if r.prefilled < len(r.prompt) else r.prompt + r.generated[:-1]
        if len(held) == cache.offset:
            self.prompt_cache.insert(held, cache)

    def _fail(self, rows: list, error: BaseException) -> None:
        for r in rows:
            for group in (self._prefilling, self._running):
                if r in group:
                    group.remove(r)
            r.done = True
            r.cache = r.mtp = r.acceptor = None
            self._ended(r)
            r.events.put(error)

    def _ended(self, r: _Request) -> None:
        with self._cond:
            self._live.discard(r)

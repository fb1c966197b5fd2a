"""Lossless speculative decoding: draft k tokens cheaply, verify them in one step of the model.

A draft proposes ``d_1 .. d_k`` after the pending token ``t``; the model runs ``[t, d_1 .. d_k]``
as k + 1 rows of one step (the multi-row decode paths of qgemv, moe_block and mla_decode), which
gives its next-token distribution after each prefix. The longest prefix of drafts the model
agrees with is kept, plus one token of the model's own; the caches are rolled back to the kept
tokens (every cache writes rows at its offset and reads up to it, so setting the offset back is
an exact rollback: the latent KV, the DSA indexer keys and the MTP layer's cache alike).

* Greedy (``temperature == 0``): a draft is kept when it is the model's argmax, so the output is
  the output without speculation, token for token.
* Sampling: the speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023): with ``p``
  the model's and ``q`` the draft's distribution, both after the sampler's repetition penalty,
  temperature, top-k, top-p and min-p (:func:`generate.filter_logits`), a draft ``d`` is kept
  with probability ``min(1, p(d) / q(d))``; on rejection the token is drawn from
  ``max(0, p - q)`` renormalized; after k kept drafts one more is drawn from ``p``. Every token
  is then distributed exactly as without speculation; the random stream differs, so a seeded
  run gives other (equally distributed) text than a seeded run without speculation.

Drafts:

* ``mtp``: the model's multi-token-prediction layer (models/mtp.py), applied recurrently.
* ``ngram``: prompt lookup: the tokens that followed the latest earlier occurrence of the
  context's last n tokens (n = 3, 2, 1), for models without an MTP layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np

from . import kernels

DRAFT_KINDS = ("mtp", "ngram", "none")
DEFAULT_NUM_DRAFT = 3
MAX_NUM_DRAFT = 7        # a verify step feeds 1 + num_draft rows; the decode paths take 8
NGRAM_MAX = 3


def resolve_draft(model, draft: Optional[str], seeded_sampling: bool = False) -> str:
    """``draft`` checked against the model. None (the default) is "mtp" when the model has an
    MTP layer, else "none"; and "none" for seeded sampling, whose text then stays the same
    whether the model has an MTP layer or not (speculation draws other random numbers), and for
    a model over several processes (which speculation refuses)."""
    from .distributed import DistributedModel

    has_mtp = bool(getattr(model, "mtp_layers", None))
    several_ranks = isinstance(model, DistributedModel)
    if draft is None:
        return "mtp" if has_mtp and not seeded_sampling and not several_ranks else "none"
    if draft not in DRAFT_KINDS:
        raise ValueError(f"draft must be one of {DRAFT_KINDS}, got {draft!r}")
    if several_ranks and draft != "none":
        # The other ranks mirror rank 0's forward steps; a rejected draft rewinds rank 0's cache
        # outside them.
        raise ValueError("speculative decoding runs in one process, not under mlx.launch: use draft='none'")
    if draft == "mtp" and not has_mtp:
        raise ValueError("draft='mtp' needs the model's multi-token-prediction layer (model.layers."
                         f"{model.args.num_hidden_layers}.*: out-mtp-* shards of a container, see "
                         "`colibri convert --mtp`); this model has none: use draft='ngram' or 'none'")
    return draft


def check_num_draft(num_draft) -> int:
    if isinstance(num_draft, bool) or not isinstance(num_draft, int) or not 1 <= num_draft <= MAX_NUM_DRAFT:
        raise ValueError(f"num_draft must be an integer in 1..{MAX_NUM_DRAFT} (rows of a verify step: "
                         f"1 + num_draft <= {MAX_NUM_DRAFT + 1}), got {num_draft!r}")
    return num_draft


# ----------------------------------------------------------------------------- drafts


class NgramIndex:
    """Prompt lookup over a growing context: each token's positions are kept, so a lookup visits
    the earlier occurrences of the context's last token, latest first, instead of scanning the
    whole context each step (a host cost that grows with the context)."""

    def __init__(self, tokens: Sequence[int] = ()):
        self.tokens: list[int] = []
        self.positions: dict[int, list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.positions.setdefault(t, []).append(len(self.tokens))
            self.tokens.append(t)

    def drafts(self, k: int, max_n: int = NGRAM_MAX) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens
        (n = ``max_n`` down to 1)."""
        seq, L = self.tokens, len(self.tokens)
        if L < 2:
            return []
        ends = self.positions[seq[-1]]          # where an occurrence of the last n tokens can end
        for n in range(min(max_n, L - 1), 0, -1):
            tail = seq[-n:]
            for p in reversed(ends):
                if p > L - 2:                     # the last token itself: no token follows it yet
                    continue
                if p < n - 1:
                    break
                if seq[p - n + 1: p + 1] == tail:
                    return seq[p + 1: p + 1 + k]
        return []


class MTPDraft:
    """The MTP layer's state: its cache (one row per position the main model has seen) and its
    prediction for the token after the pending one."""

    def __init__(self, model, cache):
        from .models.deepseek_v3 import commits_layers
        from .models.mtp import mtp_head

        self.head = mtp_head(model)
        # On a GPU the device starts on an MTP step while the next one is built (as a decode
        # step's layers are handed over: deepseek_v3.commits_layers).
        self._async = commits_layers(1)
        self.cache = getattr(cache, "mtp_cache", None)
        if self.cache is None:
            self.cache = cache.mtp_cache = self.head.make_cache()
        if self.cache.offset != cache.offset:
            # A cache extended without the MTP layer: the rows it lacks stay zero, which only
            # lowers the acceptance rate (drafts are verified).
            if self.cache.left_padding is None:
                self.cache.set_left_padding(None, 1)
            self.cache.offset = cache.offset
        self.logits = self.x = None

    def observe(self, hidden: mx.array, next_tokens: Sequence[int]) -> None:
        """The main model's normed hidden states of the rows it kept, and the tokens after them."""
        self.logits, self.x = self.head(hidden, mx.array([list(next_tokens)], dtype=mx.int32), self.cache,
                                        last_only=True)
        self._commit(self.logits)

    def _commit(self, *arrays) -> None:
        if self._async:
            mx.async_eval(*arrays)

    def propose(self, k: int, choose) -> tuple[list, list]:
        """``k`` drafts from ``choose(logits, drafts so far) -> (token, q)`` (ints or lazy
        scalar arrays), their q's (:func:`propose_rows` of this drafter alone)."""
        return propose_rows([self], [k], [choose])[0]


def _token_row(token) -> mx.array:
    """A draft token (an int, or a lazy scalar array) as an int32 ``[1]``."""
    return token.astype(mx.int32).reshape(1) if isinstance(token, mx.array) else mx.array([token], dtype=mx.int32)


def observe_rows(drafters: Sequence[MTPDraft], hidden: Sequence[mx.array],
                 next_tokens: Sequence[Sequence[int]]) -> None:
    """``drafters[i].observe(hidden[i][None], next_tokens[i])`` for every ``i`` (``hidden[i]
    [L_i, D]``), the MTP layer run once over the rows of several drafters (MTPHead.rows), in
    groups of at most DECODE_ROWS rows: a continuous batch's requests after a verify step."""
    from .models.deepseek_v3 import DECODE_ROWS

    groups, in_group = [], DECODE_ROWS
    for i, tokens in enumerate(next_tokens):
        if in_group + len(tokens) > DECODE_ROWS:
            groups.append([])
            in_group = 0
        groups[-1].append(i)
        in_group += len(tokens)
    for group in groups:
        counts = [len(next_tokens[i]) for i in group]
        ids = mx.array([t for i in group for t in next_tokens[i]], dtype=mx.int32)
        logits, x = drafters[group[0]].head.rows(mx.concatenate([hidden[i] for i in group]), ids,
                                                 [drafters[i].cache for i in group], counts)
        a = 0
        for n, (i, m) in enumerate(zip(group, counts)):
            drafters[i].logits, drafters[i].x = logits[n][None, None], x[a: a + m][None]
            a += m
        drafters[group[0]]._commit(logits, x)


def propose_rows(drafters: Sequence[MTPDraft], ks: Sequence[int], chooses: Sequence) -> list[tuple[list, list]]:
    """``drafters[i].propose(ks[i], chooses[i])`` for every ``i``: each step of the MTP layer
    runs once for every drafter still drafting (MTPHead.rows, a row each), so ``n`` requests
    drafting ``k`` tokens take ``k - 1`` steps of the layer instead of ``n (k - 1)``."""
    starts = [d.cache.offset for d in drafters]
    out = [([], []) for _ in drafters]
    logits = [d.logits[0, -1] for d in drafters]
    xs = [d.x[0, -1] for d in drafters]
    for j in range(max(ks)):
        lazy = []
        for i, (k, choose) in enumerate(zip(ks, chooses)):
            if k > j:
                token, q = choose(logits[i], out[i][0])
                out[i][0].append(token)
                out[i][1].append(q)
                if isinstance(token, mx.array):
                    lazy.append(token)
        if lazy:
            drafters[0]._commit(*lazy)
        stepping = [i for i, k in enumerate(ks) if j + 1 < k]
        if not stepping:
            continue
        step_logits, x = drafters[0].head.rows(mx.stack([xs[i] for i in stepping]),
                                               mx.concatenate([_token_row(out[i][0][-1]) for i in stepping]),
                                               [drafters[i].cache for i in stepping], [1] * len(stepping))
        for n, i in enumerate(stepping):
            logits[i], xs[i] = step_logits[n], x[n]
    for d, start in zip(drafters, starts):
        d.cache.offset = start    # the drafts' rows are rewritten by the next observe
    return out


class DraftLength:
    """MTP drafts per step, between 1 and ``num_draft``: one more after a step that kept every
    draft, one fewer after a step that did not (the schedule of Hugging Face's assisted
    generation, by ones). Each MTP draft costs a step of the MTP layer whether it is kept or
    not, so while few are kept fewer are drafted. Verification is exact for any count, so greedy
    output stays token for token and sampling stays in distribution."""

    def __init__(self, num_draft: int, adaptive: bool = True):
        self.max = num_draft
        self.adaptive = adaptive
        self.k = num_draft

    def update(self, proposed: int, kept: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        self.k = min(self.k + 1, self.max) if kept == proposed else max(self.k - 1, 1)


# ----------------------------------------------------------------------------- acceptance


@dataclass
class DraftStats:
    steps: int = 0       # verify steps
    proposed: int = 0    # draft tokens proposed
    accepted: int = 0    # draft tokens kept

    def as_dict(self) -> dict:
        return {"draft_steps": self.steps, "draft_proposed": self.proposed, "draft_accepted": self.accepted}


class Acceptor:
    """Chooses drafts and accepts them: greedy, or the speculative-sampling rule."""

    def __init__(self, params, seed: Optional[int], seen: list[int]):
        from .generate import reduce_seed

        self.params, self.seen = params, seen
        self.greedy = params.temperature == 0
        seed = reduce_seed(seed)
        self.rng = np.random.default_rng(seed if seed is not None else time.time_ns())

    def probs(self, logits: mx.array, extra: Sequence[int]) -> np.ndarray:
        """The sampler's distribution (float64) of ``logits [V]`` after ``seen + extra``."""
        from .generate import apply_repetition_penalty, filter_logits

        logits = apply_repetition_penalty(logits, self.seen + list(extra), self.params.repetition_penalty)
        z = np.array(filter_logits(logits, self.params).astype(mx.float32), dtype=np.float64)
        z = np.exp(z - z.max())
        return z / z.sum()

    def sample(self, p: np.ndarray) -> int:
        return int(self.rng.choice(p.size, p=p))

    @property
    def lazy_greedy(self) -> bool:
        """Greedy without a repetition penalty: a row's target is the plain argmax, which stays
        on the device (a penalized row's target depends on the tokens kept before it)."""
        return self.greedy and self.params.repetition_penalty == 1.0

    def greedy_token(self, logits: mx.array, extra: Sequence[int]) -> int:
        """The argmax of ``logits [V]`` after the repetition penalty over ``seen + extra``."""
        from .generate import apply_repetition_penalty

        penalized = apply_repetition_penalty(logits, self.seen + list(extra), self.params.repetition_penalty)
        return int(mx.argmax(penalized).item())

    def choose(self, logits: mx.array, drafts: Sequence) -> tuple:
        """A draft token from draft logits and its q. Greedy: a lazy token (an ``mx.array``,
        read with the verify step's logits: no device round trip per draft) and q None."""
        if self.lazy_greedy:
            return mx.argmax(logits), None
        if self.greedy:
            return self.greedy_token(logits, drafts), None
        q = self.probs(logits, drafts)
        return self.sample(q), q

    def accept(self, logits: mx.array, drafts: Sequence[int], qs: Sequence) -> list[int]:
        """Kept drafts plus the model's own token, from the verify logits ``[k + 1, V]``.
        ``qs[j]`` None means a deterministic draft (one-hot q)."""
        if self.lazy_greedy:
            return greedy_accept(np.array(mx.argmax(logits, axis=-1)).tolist(), drafts)
        if self.greedy:
            out: list[int] = []
            for j, d in enumerate(drafts):
                out.append(self.greedy_token(logits[j], out))
                if out[-1] != d:
                    return out
            return out + [self.greedy_token(logits[len(drafts)], out)]
        out: list[int] = []
        for j, d in enumerate(drafts):
            p = self.probs(logits[j], out)
            q = qs[j]
            qd = 1.0 if q is None else q[d]
            if self.rng.random() < min(1.0, p[d] / qd):
                out.append(d)
                continue
            if q is None:
                residual = p.copy()
                residual[d] = 0.0
            else:
                residual = np.maximum(p - q, 0.0)
            total = residual.sum()
            out.append(self.sample(residual / total) if total > 0 else self.sample(p))
            return out
        out.append(self.sample(self.probs(logits[len(drafts)], out)))
        return out


def greedy_accept(targets: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The drafts that equal the model's argmax ``targets`` (one a row of the verify step), up to
    the first that does not, then the model's own token."""
    m = 0
    while m < len(drafts) and drafts[m] == targets[m]:
        m += 1
    return list(drafts[:m]) + [targets[m]]


# ----------------------------------------------------------------------------- generation


def verify_head(model):
    """The final norm and the head of a verify step's rows as one compiled graph (kernels.compiled,
    per row count): ``x [1, L, D] -> (normed x, float32 logits [1, L, V])``. Kept on the model."""
    block = getattr(model, "verify_head", None)
    if block is None:
        from .models.deepseek_v3 import stream_norm

        eps = model.args.rms_norm_eps

        def head(x):
            h = stream_norm(x, model.norm, eps)
            return h, kernels.qmatmul(h, model.lm_head, out_dtype=mx.float32)

        block = model.verify_head = kernels.compiled.CompiledBlock(head, "verify_head")
    return block


def verify_logits(model, x: mx.array) -> tuple[mx.array, mx.array]:
    """``(final norm of x, float32 logits)`` of verify rows ``x [R, D]``: up to DECODE_ROWS rows
    through :func:`verify_head`'s compiled graph, more through the norm and the head's matmul."""
    from .models.deepseek_v3 import DECODE_ROWS, rms_norm

    if x.shape[0] <= DECODE_ROWS:
        h, logits = verify_head(model)(x[None])
        return h[0], logits[0]
    h = rms_norm(x, model.norm, model.args.rms_norm_eps)
    return h, kernels.qmatmul(h, model.lm_head, out_dtype=mx.float32)


def speculative_tokens(model, prompt_ids: list[int], max_tokens: int, params, seed, cache, stop_ids,
                       draft: str, num_draft: int) -> Iterator[tuple[int, dict]]:
    """:func:`generate.generate_tokens` with speculation (same tokens when greedy, same
    distribution when sampling; same stats plus ``draft_*`` counts and the cache left holding
    the prompt and every generated token but the last)."""
    from .models.deepseek_v3 import rms_norm

    limit = model.max_length
    stop = set(int(s) for s in stop_ids)
    seen = list(prompt_ids)
    acceptor = Acceptor(params, seed, seen)
    counts = DraftStats()
    eps = model.args.rms_norm_eps

    def verify(rows, last_only=False):
        x = model.hidden_states(rows if isinstance(rows, mx.array) else mx.array([rows], dtype=mx.int32), cache)
        if not last_only:
            h, logits = verify_logits(model, x[0])
            return h[None], logits
        h = rms_norm(x, model.norm, eps)
        return h, kernels.qmatmul(h[:, -1:], model.lm_head, out_dtype=mx.float32)[0]

    mtp = MTPDraft(model, cache) if draft == "mtp" else None
    ngrams = NgramIndex(seen) if draft == "ngram" else None
    length = DraftLength(num_draft, adaptive=draft == "mtp")   # n-gram drafts cost no model step
    t0 = time.perf_counter()
    h, logits = verify(prompt_ids, last_only=True)
    out = acceptor.accept(logits, [], [])
    if mtp is not None:
        mtp.observe(h, prompt_ids[1:] + out)
    stats = {"prompt_tokens": len(prompt_ids), "prompt_time": time.perf_counter() - t0}
    t1 = time.perf_counter()
    n = 0
    base = cache.offset   # the position of out[0]; out[-1] is the one token not fed
    while True:
        for i, token in enumerate(out):
            n += 1
            seen.append(token)
            if ngrams is not None:
                ngrams.extend([token])
            continues = n < max_tokens and base + i < limit
            reason = "stop" if token in stop else (None if continues else "length")
            stats.update(generation_tokens=n, generation_time=time.perf_counter() - t1, finish_reason=reason,
                         **counts.as_dict())
            yield token, dict(stats)
            if reason is not None:
                cache.offset = base + i   # the tokens before this one
                if mtp is not None:
                    mtp.cache.offset = min(mtp.cache.offset, cache.offset)
                return
        P = cache.offset   # out[-1]'s position
        room = min(max_tokens - n, limit - P)   # rows this step may feed (>= 1)
        k = min(length.k, room - 1)
        if draft == "mtp" and k > 0:
            drafts, qs = mtp.propose(k, acceptor.choose)
        elif draft == "ngram" and k > 0:
            drafts = ngrams.drafts(k)
            qs = [None] * len(drafts)
        else:
            drafts, qs = [], []
        if drafts and isinstance(drafts[0], mx.array):
            # Lazy greedy drafts: drafted, verified and the model's argmax taken in one graph,
            # read in one host round trip (drafts and targets together).
            lazy = mx.stack([d.astype(mx.int32) for d in drafts])
            h, logits = verify(mx.concatenate([mx.array([out[-1]], dtype=mx.int32), lazy])[None])
            both = np.array(mx.concatenate([lazy, mx.argmax(logits, axis=-1).astype(mx.int32)])).tolist()
            drafts = both[:len(drafts)]
            out = greedy_accept(both[len(drafts):], drafts)
        else:
            h, logits = verify([out[-1]] + drafts)
            out = acceptor.accept(logits, drafts, qs)
        counts.steps += 1
        counts.proposed += len(drafts)
        counts.accepted += len(out) - 1
        length.update(len(drafts), len(out) - 1)
        cache.offset = P + len(out)     # out[-1] and the kept drafts; rejected rows are rolled back
        base = P + 1
        if mtp is not None:
            mtp.observe(h[:, :len(out)], out)


def acceptance_summary(stats: dict) -> str:
    """``draft: 71% accepted, 3.1 tokens/step`` from a stats dict (empty without verify steps)."""
    steps = stats.get("draft_steps", 0)
    if not steps:
        return ""
    rate = stats["draft_accepted"] / max(stats["draft_proposed"], 1)
    return f"draft: {100 * rate:.0f}% accepted, {(stats['draft_accepted'] + steps) / steps:.2f} tokens/step"

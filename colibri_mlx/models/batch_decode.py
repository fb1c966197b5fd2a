"""One decode step of several independent sequences at their own positions (ragged lengths),
as a continuously batched server needs (colibri_mlx.batch_engine).

:class:`DecodeBatch` holds the running sequences, which join and leave between steps; its
pooled layout keeps their cache rows in one buffer a layer, so that a step's launches do not
grow with the batch. :func:`decode_rows` steps sequences that each keep their own
:class:`LatentCache` (attention then runs per sequence).

Rows run in groups of at most :data:`ROW_GROUP` (the GEMV and MoE kernels' decode rows: every
projection reads its weights once per group, and ``moe_block`` groups the rows by expert). A
model with a DSA indexer runs its projections and MoE the same way, and each sequence's indexer
selects over that sequence's cache. A single sequence goes through the model's own forward pass;
:func:`batch_reason` says why, and it is counted.
"""

from __future__ import annotations

import functools
import weakref
from typing import Sequence

import mlx.core as mx

from .. import kernels
from ..kernels import qgemv
from ..speculative import verify_logits
from .cache import LatentCache, capacity_for
from .deepseek_v3 import CACHE_STREAM, embedding_rows, stream_norm

ROW_GROUP = qgemv.MAX_ROWS     # rows a GEMV / moe_block launch takes as decode rows


def batch_reason(model, caches: Sequence[LatentCache]) -> str | None:
    """Why these sequences do not take the batched step (each then runs the model alone), or None."""
    if len(caches) < 2:
        return "one sequence (the model's own decode step)"
    if getattr(model, "pipeline", None) is not None or len(model.layers) != model.args.num_hidden_layers:
        return "pipeline stage holds a part of the layers"
    for c in caches:
        if c.offset == 0 or c.batch_size != 1 or c.padded:
            return "a cache that is empty, padded or holds several sequences"
    return None


def decode_rows(model, tokens: Sequence[int], caches: Sequence[LatentCache]) -> mx.array:
    """Logits ``[B, vocab]`` float32 of one new token per sequence; advances every cache by one."""
    if len(tokens) != len(caches):
        raise ValueError(f"decode_rows: {len(tokens)} tokens for {len(caches)} caches")
    for c in caches:
        if c.offset + 1 > model.max_length:
            raise ValueError(f"context of {c.offset + 1} tokens exceeds max_position_embeddings={model.max_length}")
    reason = batch_reason(model, caches)
    if reason is not None:
        kernels.dispatch.record_call("batch_decode", f"declined: {reason}")
        return mx.concatenate([model(mx.array([[int(t)]]), c)[:, -1] for t, c in zip(tokens, caches)])
    kernels.dispatch.record_call("batch_decode", "rows")
    out = [model.head(rows_forward(model, mx.array([int(t) for t in tokens[a:b]], dtype=mx.int32), caches[a:b],
                                   [1] * (b - a)))[:, -1] for a, b in row_groups(len(tokens))]
    return out[0] if len(out) == 1 else mx.concatenate(out)


def rows_forward(model, ids: mx.array, caches: Sequence[LatentCache], counts: Sequence[int]) -> mx.array:
    """The last layer's output ``[R, 1, D]`` (before the final norm) of ``counts[b]`` rows of
    sequence ``b`` at its next positions (``ids [R]``, sequence 0's first; at most
    :data:`ROW_GROUP` rows): the projections and the MoE over all the rows together, each
    sequence's cache rows, DSA selection and attention (causal over its rows) on its own cache.
    Advances every cache by its count."""
    R = ids.size
    starts, offsets, cos, sin = row_positions(model, caches, counts)
    x = embedding_rows(model.embed_tokens, ids.reshape(R, 1).astype(mx.int32)).astype(model.dtype)
    selections = [None] * len(caches)                    # each sequence's DSA selection (shared layers reuse it)
    for i, layer in enumerate(model.layers):
        x = rows_layer(layer, x, [c.layers[i] for c in caches], starts, counts, offsets, cos, sin, selections)
    for c, m in zip(caches, counts):
        c.advance(m)
    return x


def row_positions(model, caches: Sequence[LatentCache], counts: Sequence[int]) -> tuple:
    """``(starts, offsets, cos, sin)`` of ``counts[b]`` rows of sequence ``b`` at its cache's
    offset: each sequence's first position, each row's position ``[R]`` int32, and the rows'
    rope cos/sin where the model has a DSA indexer (which rotates with them; else None)."""
    starts = [c.offset for c in caches]
    offsets = mx.array([s + j for s, m in zip(starts, counts) for j in range(m)], dtype=mx.int32)
    cos = sin = None
    if model.args.dsa:
        cos, sin = model.rope.cos_sin(offsets[:, None])
    return starts, offsets, cos, sin


def rows_layer(layer, x: mx.array, layer_caches: Sequence, starts: Sequence[int], counts: Sequence[int],
               offsets: mx.array, cos=None, sin=None, selections: list | None = None) -> mx.array:
    """One decoder layer of :func:`rows_forward` over rows ``x [R, 1, D]`` (``counts[b]`` rows of
    sequence ``b`` at positions ``offsets [R]``, its cache rows from ``starts[b]`` in
    ``layer_caches[b]``): the projections and the MLP over all the rows, each sequence's cache
    write, DSA selection (``selections[b]``, set by an indexer layer and reused by the layers that
    share it) and attention on its own cache. The layer's output ``[R, 1, D]``."""
    R, _, D = x.shape
    attn = layer.self_attn
    selections = [None] * len(layer_caches) if selections is None else selections
    normed = stream_norm(x, layer.input_norm, layer.eps)
    q_nope, q_rope, kv, q_latent = attn.rows(normed, rope_offset=offsets)      # rows of [R, 1, ...]
    cores, a = [], 0
    for b, (layer_cache, start, m) in enumerate(zip(layer_caches, starts, counts)):
        rows = slice(a, a + m)
        a += m
        seen = attn.cached(kv[rows].reshape(1, m, -1), layer_cache, start)   # [1, start + m, R + rope]
        mask = None if m == 1 else kernels.mla.causal_mask(m, start + m)
        if attn.indexer is not None:
            selections[b] = attn.indexer.select(normed[rows].reshape(1, m, D), q_latent[rows].reshape(1, m, -1),
                                                cos[rows].reshape(1, m, -1), sin[rows].reshape(1, m, -1), mask,
                                                layer_cache, start)
        if selections[b] is not None:
            mask = selections[b] if mask is None else mask & selections[b]
        # a sequence's rows as the query rows of one attention: [1, H, m, d]
        cores.append(attn.attend(q_nope[rows].transpose(2, 1, 0, 3), q_rope[rows].transpose(2, 1, 0, 3), seen,
                                 mask))
    core = cores[0] if len(cores) == 1 else mx.concatenate(cores)       # [R, H * v]
    x = attn.output(core, x.reshape(R, D)).reshape(R, 1, D)
    return layer._feed_forward(x)


def row_groups(n: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of ``n`` rows in groups of at most :data:`ROW_GROUP`, sizes balanced
    (9 rows: 5 + 4) so that no group is a single row when ``n > 1`` (the layers would take a
    single row down their one-sequence path)."""
    count = -(-n // ROW_GROUP)
    bounds = [n * g // count for g in range(count + 1)]
    return list(zip(bounds, bounds[1:]))


class DecodeBatch:
    """The running sequences of a continuously batched decode, in one of two layouts.

    Pooled (the default): their cache rows live in one buffer per layer ``[slots, capacity,
    R + rope]``, sequence ``i`` in slot ``i``. A step writes every sequence's new row with one
    scatter and runs attention once over the first ``n`` slots (``kernels.mla_decode`` with a
    mask: sequence ``i`` attends to its own ``length_i + 1`` rows), so a step's launches do not
    grow with the batch. Slots stay dense: a sequence that leaves takes its rows out (as a
    :class:`LatentCache`) and the last slot moves into its place. A lone sequence runs in its
    own cache through the model's single-sequence decode step (compiled on GPUs).

    Separate (:func:`model_batch_reason` declines pooling: DSA selection): one cache per
    sequence and :func:`decode_rows` (the projections and the MoE over the rows together, each
    sequence's indexer and attention over its own cache).
    """

    def __init__(self, model):
        self.model = model
        self.pooled = model_batch_reason(model) is None
        if not self.pooled:
            kernels.dispatch.record_call("batch_decode", f"separate caches: {model_batch_reason(model)}")
        self.single: LatentCache | None = None       # a lone sequence's own cache
        self.caches: list[LatentCache] = []          # separate layout
        self.buffers: list[dict] = []                # pooled: per layer, stream -> [slots, capacity, W]
        self.lengths: list[int] = []                 # pooled: rows each slot holds

    def __len__(self) -> int:
        if not self.pooled:
            return len(self.caches)
        return 1 if self.single is not None else len(self.lengths)

    def add(self, cache: LatentCache) -> None:
        """Append a sequence whose rows are ``cache``'s (prefilled: offset > 0)."""
        if cache.offset == 0 or cache.batch_size != 1 or cache.padded:
            raise ValueError("DecodeBatch.add: a cache of one unpadded, prefilled sequence is expected")
        if not self.pooled:
            self.caches.append(cache)
        elif len(self) == 0:
            self.single = cache
        else:
            if self.single is not None:
                lone, self.single = self.single, None
                self._pool_add(lone)
            self._pool_add(cache)

    def remove(self, i: int) -> LatentCache:
        """Take sequence ``i`` out; the last sequence becomes sequence ``i``. Returns its cache."""
        if not self.pooled:
            last = self.caches.pop()
            if i == len(self.caches):
                return last
            out, self.caches[i] = self.caches[i], last
            return out
        if self.single is not None:
            out, self.single = self.single, None
            return out
        out = self._pool_take(i)
        if len(self.lengths) == 1:                   # the one left runs in its own cache
            self.single = self._pool_take(0)
            self.buffers = []
        return out

    def take_back(self, i: int) -> None:
        """Forget sequence ``i``'s last row (a row fed ahead of a token that ended it)."""
        if not self.pooled:
            self.caches[i].offset -= 1
        elif self.single is not None:
            self.single.offset -= 1
        else:
            self.lengths[i] -= 1

    def length(self, i: int) -> int:
        """Rows sequence ``i`` holds (its next row's position)."""
        if not self.pooled:
            return self.caches[i].offset
        return self.single.offset if self.single is not None else self.lengths[i]

    def rewind(self, i: int, length: int) -> None:
        """Keep sequence ``i``'s first ``length`` rows (rows past them are rewritten before they
        are read: every step writes at a sequence's length and attends up to its position)."""
        if not 0 < length <= self.length(i):
            raise ValueError(f"DecodeBatch.rewind: {length} rows of a sequence holding {self.length(i)}")
        if not self.pooled:
            self.caches[i].offset = length
        elif self.single is not None:
            self.single.offset = length
        else:
            self.lengths[i] = length

    def verify(self, ids: mx.array, counts: Sequence[int]) -> tuple[mx.array, mx.array]:
        """A speculative verify step: ``counts[i]`` rows of sequence ``i`` (``ids [R]`` int32,
        sequence 0's rows first, each sequence's at its next positions). Returns the rows'
        hidden states after the final norm ``[R, D]`` (the MTP layer's input) and float32 logits
        ``[R, vocab]``; every sequence advances by its count (:meth:`rewind` drops rejected rows)."""
        if len(counts) != len(self) or sum(counts) != ids.size or min(counts) < 1:
            raise ValueError(f"DecodeBatch.verify: rows {list(counts)} for {len(self)} sequences and {ids.size} ids")
        model = self.model
        if self.pooled and self.single is None:
            x = self._pool_verify(ids, counts)
        elif not self.pooled and ids.size <= ROW_GROUP and batch_reason(model, self.caches) is None:
            kernels.dispatch.record_call("batch_decode", "rows verify")
            x = rows_forward(model, ids, self.caches, counts)[:, 0]
        else:
            caches = [self.single] if self.pooled else self.caches
            x, a = [], 0
            for cache, m in zip(caches, counts):      # each sequence's rows through the model's own pass
                x.append(model.hidden_states(ids[a: a + m].reshape(1, m), cache)[0])
                a += m
            x = x[0] if len(x) == 1 else mx.concatenate(x)
        return verify_logits(model, x)

    def step(self, tokens: Sequence[int] | mx.array) -> mx.array:
        """Logits ``[n, vocab]`` (float32) of one new token per sequence, in slot order."""
        if not self.pooled:
            return decode_rows(self.model, [int(t) for t in _ints(tokens)], self.caches)
        if self.single is not None:
            ids = tokens.reshape(1, 1) if isinstance(tokens, mx.array) else mx.array([[int(tokens[0])]])
            return self.model(ids, self.single)[:, -1]
        return self._pool_step(tokens)

    # ------------------------------------------------------------------ pooled layout

    def _reserve(self, slots: int, end: int) -> None:
        """Grow every pooled buffer to hold ``slots`` slots of ``end`` rows."""
        for layer in self.buffers:
            for stream, buf in layer.items():
                S, T, W = buf.shape
                if S >= slots and T >= end:
                    continue
                grown = mx.zeros((max(S, 1 << (slots - 1).bit_length()), max(T, capacity_for(end)), W), buf.dtype)
                grown[:S, :T] = buf
                layer[stream] = grown

    def _pool_add(self, cache: LatentCache) -> None:
        i, n = len(self.lengths), cache.offset
        if not self.buffers:
            self.buffers = [{s: mx.zeros((2, capacity_for(n + 1), b.shape[2]), b.dtype) for s, b in lc.buffers.items()}
                            for lc in cache.layers]
        self._reserve(i + 1, n + 1)
        for layer, lc in zip(self.buffers, cache.layers):
            for stream, buf in layer.items():
                buf[i: i + 1, :n] = lc.buffers[stream][:, :n]
        self.lengths.append(n)

    def _pool_take(self, i: int) -> LatentCache:
        n, last = self.lengths[i], len(self.lengths) - 1
        out = LatentCache(len(self.buffers), self.model.max_length)
        out.set_left_padding(None, 1)
        for layer, lc in zip(self.buffers, out.layers):
            for stream, buf in layer.items():
                rows = mx.zeros((1, capacity_for(n), buf.shape[2]), buf.dtype)
                rows[:, :n] = buf[i: i + 1, :n]
                lc.buffers[stream] = rows
                if i != last:
                    buf[i: i + 1, : self.lengths[last]] = buf[last: last + 1, : self.lengths[last]]
            lc.length = n
        out.offset = n
        mx.eval([b for lc in out.layers for b in lc.buffers.values()], [b for la in self.buffers for b in la.values()])
        self.lengths[i] = self.lengths[last]
        self.lengths.pop()
        return out

    def _pool_verify(self, ids: mx.array, counts: Sequence[int]) -> mx.array:
        model = self.model
        positions = [self.lengths[i] + j for i, m in enumerate(counts) for j in range(m)]
        end = max(positions) + 1
        if end > model.max_length:
            raise ValueError(f"context of {end} tokens exceeds max_position_embeddings={model.max_length}")
        self._reserve(len(counts), end)
        kernels.dispatch.record_call("batch_decode", "pooled verify")
        R, m = len(positions), max(counts)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        order = mx.array([[a + min(j, c - 1) for j in range(m)] for a, c in zip(starts, counts)], dtype=mx.int32)
        back = mx.array([i * m + j for i, c in enumerate(counts) for j in range(c)], dtype=mx.int32)
        positions = mx.array(positions, dtype=mx.int32)
        x = embedding_rows(model.embed_tokens, ids.reshape(R, 1).astype(mx.int32)).astype(model.dtype)
        for layer, block, buffers in zip(model.layers, _pooled_blocks(model, "pooled_verify"), self.buffers):
            x, buffers[CACHE_STREAM] = block(x, positions, buffers[CACHE_STREAM], order, back,
                                             static=layer.mlp.host_reason(x[: ROW_GROUP]))
        self.lengths = [t + m for t, m in zip(self.lengths, counts)]
        return x[:, 0]

    def _pool_step(self, tokens) -> mx.array:
        model = self.model
        n = len(self.lengths)
        end = max(self.lengths) + 1
        if end > model.max_length:
            raise ValueError(f"context of {end} tokens exceeds max_position_embeddings={model.max_length}")
        self._reserve(n, end)
        kernels.dispatch.record_call("batch_decode", "pooled")
        positions = mx.array(self.lengths, dtype=mx.int32)           # each new row's position and slot
        ids = tokens.reshape(n, 1) if isinstance(tokens, mx.array) else mx.array([[int(t)] for t in tokens])
        x = embedding_rows(model.embed_tokens, ids.astype(mx.int32)).astype(model.dtype)   # [n, 1, D]
        blocks = _pooled_blocks(model)
        for layer, block, buffers in zip(model.layers, blocks, self.buffers):
            x, buffers[CACHE_STREAM] = block(x, positions, buffers[CACHE_STREAM],
                                             static=layer.mlp.host_reason(x[: ROW_GROUP]))
        self.lengths = [t + 1 for t in self.lengths]
        logits = [model._compiled_head(x[a:b]) for a, b in row_groups(n)]
        return (logits[0] if len(logits) == 1 else mx.concatenate(logits))[:, -1]


def pooled_layer(layer, x: mx.array, positions: mx.array, buf: mx.array,
                 order: mx.array | None = None, back: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """One decoder layer over ``n`` pooled sequences (:class:`DecodeBatch`): ``x [n, 1, D]``,
    ``positions [n]`` (each new row's position and cache slot), ``buf [slots, capacity, W]``.
    Returns the layer's output and the buffer with the new rows. Attention reads the whole
    capacity of the first ``n`` slots under a mask (row ``i`` sees its first ``positions[i] + 1``
    rows), so the graph's shapes change only when the pool grows: compiled on GPUs, one trace
    per batch size and pool shape.

    A verify step (several rows a sequence, :meth:`DecodeBatch.verify`): ``order [S, m]`` holds
    the rows of slot ``s`` in ``order[s]`` (m the most rows a sequence has; a shorter one repeats
    its last row), ``back [n]`` each row's place ``s * m + j`` in it. Every row is written before
    any is attended, so a row sees the rows of its sequence before it in this step; attention
    runs once over the first ``S`` slots with ``m`` query rows each (mla_decode's rows of a
    sequence under the mask), and ``back`` takes the rows' outputs from it."""
    n = x.shape[0]
    attn = layer.self_attn
    groups = row_groups(n)
    parts = [layer._decode_in(x[a:b], positions[a:b]) for a, b in groups]   # q_rope left unrotated
    q_nope, q_rope, kv = (p[0] if len(p) == 1 else mx.concatenate(p) for p in zip(*parts))
    q_rope = attn.rope.apply_fast(q_rope, positions)
    keys = mx.arange(buf.shape[1], dtype=mx.int32)
    if order is None:
        buf[mx.arange(n), positions] = kv[:, 0].astype(buf.dtype)
        mask = (keys[None] <= positions[:, None])[:, None, None]
        core = attn.attend(q_nope, q_rope, buf[:n], mask)                     # [n, H * v]
    else:
        S, m = order.shape
        buf[back // m, positions] = kv[:, 0].astype(buf.dtype)
        rows = order.reshape(-1)

        def by_sequence(q):       # [n, H, 1, d] -> [S, H, m, d]
            return q[rows].reshape(S, m, *q.shape[1:2], q.shape[-1]).transpose(0, 2, 1, 3)

        mask = (keys[None, None] <= positions[order][..., None])[:, None]     # [S, 1, m, capacity]
        core = attn.attend(by_sequence(q_nope), by_sequence(q_rope), buf[:S], mask)[back]
    out = [layer._decode_out(x[a:b], core[a:b]) for a, b in groups]
    return (out[0] if len(out) == 1 else mx.concatenate(out)), buf


_BLOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _pooled_blocks(model, name: str = "pooled_layer") -> list:
    """The compiled :func:`pooled_layer` of each layer of ``model`` (made once per model and
    ``name``: "pooled_layer" for decode steps, "pooled_verify" for verify steps)."""
    made = _BLOCKS.setdefault(model, {})
    if name not in made:
        made[name] = [kernels.compiled.CompiledBlock(functools.partial(pooled_layer, layer), name)
                      for layer in model.layers]
    return made[name]


def model_batch_reason(model) -> str | None:
    """Why ``model`` cannot pool its sequences' caches (:class:`DecodeBatch`), or None."""
    if model.args.dsa:
        return "DSA indexer selects over each cache"
    if len(model.layers) != model.args.num_hidden_layers:
        return "pipeline stage holds a part of the layers"
    return None


def _ints(tokens):
    return tokens.tolist() if isinstance(tokens, mx.array) else tokens

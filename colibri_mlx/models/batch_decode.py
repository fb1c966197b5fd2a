"""One decode step of several independent sequences, each with its own :class:`LatentCache`.

``decode_rows(model, tokens, caches)`` feeds token ``tokens[b]`` to sequence ``b`` at its own
position (its cache's offset) and returns the next-token logits ``[B, vocab]`` (float32). The
caches may hold different lengths (ragged), and sequences join or leave between steps, as a
continuously batched server needs (colibri_mlx.batch_engine).

Rows run in groups of at most :data:`ROW_GROUP` (the GEMV and MoE kernels' decode rows: every
projection reads its weights once per group, and ``moe_block`` groups the rows by expert).
Attention runs per sequence over its own cache with ``kernels.mla_decode``. A model with a DSA
indexer (selection over each cache) or a single sequence goes through the model's own forward
pass per sequence; :func:`batch_reason` says why, and the decline is counted.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from .. import kernels
from ..kernels import qgemv
from .cache import LatentCache
from .deepseek_v3 import embedding_rows, stream_norm

ROW_GROUP = qgemv.MAX_ROWS     # rows a GEMV / moe_block launch takes as decode rows


def batch_reason(model, caches: Sequence[LatentCache]) -> str | None:
    """Why these sequences do not take the batched step (each then runs the model alone), or None."""
    if len(caches) < 2:
        return "one sequence (the model's own decode step)"
    if model.args.dsa:
        return "DSA indexer selects over each cache"
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
    # Groups of balanced sizes (9 rows: 5 + 4), never a single row, which the layers would take
    # down their one-sequence path.
    n_groups = -(-len(tokens) // ROW_GROUP)
    bounds = [len(tokens) * g // n_groups for g in range(n_groups + 1)]
    out = [_group(model, tokens[a:b], caches[a:b]) for a, b in zip(bounds, bounds[1:])]
    return out[0] if len(out) == 1 else mx.concatenate(out)


def _group(model, tokens: Sequence[int], caches: Sequence[LatentCache]) -> mx.array:
    n = len(tokens)
    D = model.args.hidden_size
    starts = [c.offset for c in caches]
    offsets = mx.array(starts, dtype=mx.int32)           # each row's position (mx.fast.rope per row)
    x = embedding_rows(model.embed_tokens, mx.array([[int(t)] for t in tokens], dtype=mx.int32)).astype(model.dtype)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        q_nope, q_rope, kv, _ = attn.rows(stream_norm(x, layer.input_norm, layer.eps), rope_offset=offsets)
        cores = []
        for b, (cache, start) in enumerate(zip(caches, starts)):
            seen = attn.cached(kv[b: b + 1], cache.layers[i], start)        # [1, start + 1, R + rope]
            cores.append(attn.attend(q_nope[b: b + 1], q_rope[b: b + 1], seen, None))
        core = cores[0] if n == 1 else mx.concatenate(cores)               # [n, H * v]
        x = attn.output(core, x.reshape(n, D)).reshape(n, 1, D)
        x = layer._feed_forward(x)
    for c in caches:
        c.advance(1)
    return model.head(x)[:, -1]

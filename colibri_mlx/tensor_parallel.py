"""Tensor-parallel attention and head under expert parallel (``--shard-attention``, docs/distributed.md).

Replicated, attention and the head are on every rank in full; sharded, rank r of N holds:

* MLA heads ``[r*H/N, (r+1)*H/N)``: their rows of ``q_b_proj`` (``q_proj`` without a query
  LoRA) and ``kv_b_proj``, their columns of ``o_proj``. The x projections (``q_a``,
  ``kv_a_proj_with_mqa``), their norms, the DSA indexer and the latent cache stay replicated (the
  cache is one latent row per token, shared by every head). Each rank runs attention for its
  heads and ``o_proj`` of their outputs; one ``all_sum`` adds the ranks' partial sums (the bias
  is rank 0's alone, so it is added once).
* The head's vocabulary rows ``[v_r, v_{r+1})`` (an even split); each rank writes its logits into
  a zero row of the whole vocabulary and one ``all_sum`` assembles them (adding zeros is exact).
  A head tied to the embeddings stays replicated (the embedding table is needed whole).

Row shares are read alone from the shards (the rows of a stored tensor lie together); column
shares (``o_proj``) are read whole and cut. The model file is unchanged: the rank's model is built with ``num_attention_heads = H/N`` from a
weight table that hands out the slices (:class:`ShardedTable`), and the hooks replace
``Attention.output`` and ``Model.head`` on the instances.
"""

from __future__ import annotations

import dataclasses
import re

import mlx.core as mx
import numpy as np

from .formats.qtensor import QTensor

_ATTN = re.compile(r"^model\.layers\.\d+\.self_attn\.(q_b_proj|q_proj|kv_b_proj|o_proj)\.(weight|bias)$")
HEAD = "lm_head.weight"
# Stored bytes per column of a QTensor row, as (bytes, columns): a column slice must start and
# end on a whole byte and a whole scale group.
_COLUMN_BYTES = {0: (4, 1), 1: (1, 1), 2: (1, 2), 3: (1, 4), 4: (1, 2)}


def vocab_range(V: int, rank: int, world: int) -> tuple[int, int]:
    bounds = np.linspace(0, V, world + 1).round().astype(int)
    return int(bounds[rank]), int(bounds[rank + 1])


def sharded_args(args, world: int):
    """``args`` with this rank's share of the attention heads."""
    H = args.num_attention_heads
    if H % world:
        raise ValueError(f"--shard-attention: num_attention_heads={H} is not divisible by {world} ranks")
    return dataclasses.replace(args, num_attention_heads=H // world)


def row_slice(w, r0: int, r1: int):
    """Rows ``r0:r1`` of a float weight or QTensor (MLX or memory-mapped numpy arrays) as an owned
    MLX copy: the whole tensor is not kept, and of a memory map only these rows are read."""
    if isinstance(w, mx.array):
        return mx.array(np.array(w[r0:r1]))
    from .kernels.reference import row_bytes, scales_per_row

    rb, spr = row_bytes(w.fmt, w.I), scales_per_row(w.fmt, w.I, w.gs)
    packed = mx.array(np.array(w.packed[r0 * rb: r1 * rb]))
    # fmt 0 and 6 have no per-row scales (fmt 6's .qs is a tag): kept whole.
    scales = mx.array(np.array(w.scales if spr == 0 else w.scales[r0 * spr: r1 * spr]))
    return QTensor(packed, scales, w.fmt, r1 - r0, w.I, w.gs, w.name)


def column_slice(w, c0: int, c1: int, name: str):
    """Columns ``c0:c1`` of a float weight or QTensor (fmt 0-4; rows are stored independently, a
    slice on whole bytes and whole scale groups keeps every stored value and scale)."""
    if isinstance(w, mx.array):
        return mx.array(np.array(w[:, c0:c1]))
    if w.fmt not in _COLUMN_BYTES:
        raise ValueError(f"--shard-attention: {name} is stored as fmt {w.fmt}, whose rows cannot be split by "
                         "columns (fmt 0-4 can); run without --shard-attention")
    nbytes, ncols = _COLUMN_BYTES[w.fmt]
    group = ncols if w.fmt != 4 else int(np.lcm(ncols, w.gs))
    if c0 % group or c1 % group or w.I % ncols:
        raise ValueError(f"--shard-attention: {name} [{w.O}, {w.I}] fmt {w.fmt}: columns {c0}:{c1} do not fall "
                         f"on whole bytes and scale groups (multiples of {group})")
    packed = np.array(w.packed).reshape(w.O, -1)[:, c0 * nbytes // ncols: c1 * nbytes // ncols]
    scales = np.array(w.scales).reshape(w.O, -1)
    if w.fmt == 4:
        scales = scales[:, c0 // w.gs: c1 // w.gs]
    return QTensor(mx.array(np.ascontiguousarray(packed).reshape(-1)),
                   mx.array(np.ascontiguousarray(scales).reshape(-1)), w.fmt, w.O, c1 - c0, w.gs, w.name)


def shard_fetch(fetch, args, rank: int, world: int, tied_head: bool, fetch_rows=None):
    """``fetch(name, shape)`` handing out this rank's slice of the sharded tensors; ``shape`` is
    the rank's (its heads, its vocabulary rows). ``fetch_rows(name, shape, r0, r1)``: rows of a
    stored tensor, reading only those (default: the whole tensor fetched, then sliced)."""
    if fetch_rows is None:
        def fetch_rows(name, shape, r0, r1):
            return row_slice(fetch(name, shape), r0, r1)

    Hl = args.num_attention_heads // world
    h0 = rank * Hl
    qk, vd = args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    per_head_rows = {"q_b_proj": qk, "q_proj": qk, "kv_b_proj": args.qk_nope_head_dim + vd}
    H = args.num_attention_heads

    def sharded(name, shape):
        m = _ATTN.match(name)
        if name == HEAD and not tied_head:
            v0, v1 = vocab_range(args.vocab_size, rank, world)
            return fetch_rows(name, (args.vocab_size, shape[1]), v0, v1)
        if m is None:
            return fetch(name, shape)
        proj, kind = m.groups()
        if proj == "o_proj":
            if kind == "bias":   # added once: rank 0's
                full = fetch(name, shape)
                return full if rank == 0 else mx.zeros_like(full)
            return column_slice(fetch(name, (shape[0], H * vd)), h0 * vd, (h0 + Hl) * vd, name)
        rows = per_head_rows[proj]
        return fetch_rows(name, (H * rows, shape[1]), h0 * rows, (h0 + Hl) * rows)

    return sharded


def head_shape_hook(table, args, rank: int, world: int) -> None:
    """The rank's table expects its vocabulary rows for ``lm_head.weight``."""
    v0, v1 = vocab_range(args.vocab_size, rank, world)
    take = table.take

    def take_head(name, shape, dtype=None):
        if name == HEAD and tuple(shape) == (args.vocab_size, args.hidden_size):
            shape = (v1 - v0, args.hidden_size)
        return take(name, shape, dtype)

    table.take = take_head


def install(model, comm, args) -> None:
    """Replace attention's output projection and the head with their sharded forms (the partial
    sums crossing processes: never inside a compiled graph)."""
    reason = "tensor-parallel attention: o_proj's partial sums cross processes (all_sum)"
    for layer in model.layers:
        attn = layer.self_attn

        def output(out, residual=None, local_output=attn.output):
            y = comm.all_sum(local_output(out), "attention all_sum")
            return y if residual is None else residual + y

        attn.output = output
        attn.steps_compiled = lambda *a, **k: False
        if not hasattr(layer.mlp, "expert_ids"):
            layer.mlp.host_reason = lambda x: reason
    if model.lm_head is model.embed_tokens:
        return                       # tied: the embedding table is replicated, so is the head
    V = args.vocab_size
    v0, v1 = vocab_range(V, comm.rank, comm.size)

    local_head = model.head

    def head(x):
        local = local_head(x)
        lead = local.shape[:-1]
        placed = mx.concatenate([mx.zeros((*lead, v0), mx.float32), local,
                                 mx.zeros((*lead, V - v1), mx.float32)], axis=-1)
        return comm.all_sum(placed, "head all_sum")

    model.head = head
    model._compiled_head = head

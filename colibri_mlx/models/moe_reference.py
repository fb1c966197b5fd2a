"""Reference routed-expert block (pure MLX): the oracle a fused ``kernels.moe_block`` must match.

``moe_block(x, experts, ids, weights)``: ``x [N, D]`` activations, ``experts[e] = (gate, up, down)``
with each weight a float ``mx.array [O, I]`` or a QTensor (any fmt, per expert), ``ids [N, K]``
selected expert ids, ``weights [N, K]`` float32 gate weights. Returns ``[N, D]``:
``sum_k weights[n, k] * down_e(silu(gate_e x_n) * up_e x_n)``.

Each selected expert is visited once with all tokens routed to it (transformers' loop), so an
expert's bytes are read once per call whatever the number of tokens.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import kernels
from ..formats.qtensor import QTensor

E8_FMT = 6


def _rotated_for(x: mx.array, w) -> mx.array:
    # fmt 6 stores W @ Q, so the input must be rotated by Q first (docs/format.md#rotation).
    if isinstance(w, QTensor) and w.fmt == E8_FMT:
        from ..formats.e8 import rotate

        return rotate(x)
    return x


def expert_mlp(x: mx.array, gate, up, down) -> mx.array:
    h = silu(kernels.qmatmul(_rotated_for(x, gate), gate)) * kernels.qmatmul(_rotated_for(x, up), up)
    return kernels.qmatmul(_rotated_for(h, down), down)


def silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def moe_block(x: mx.array, experts, ids: mx.array, weights: mx.array) -> mx.array:
    ids_np = np.array(ids)
    prepare = getattr(experts, "prepare", None)  # a streamed expert store starts its reads here
    if prepare is not None:
        prepare(ids_np)
    eval_each = getattr(experts, "eval_each", False)  # streaming: bound the experts the graph holds
    out = mx.zeros(x.shape, dtype=mx.float32)
    for e in np.unique(ids_np):
        if e < 0:
            continue  # slot dropped by router top-p (experts.router_topp)
        token_idx, slot = np.nonzero(ids_np == e)
        tok = mx.array(token_idx.astype(np.int32))
        y = expert_mlp(x[tok], *experts[int(e)])
        w = weights[tok, mx.array(slot.astype(np.int32))][:, None]
        out = out.at[tok].add(y.astype(mx.float32) * w)
        if eval_each:
            mx.eval(out)
    return out.astype(x.dtype)

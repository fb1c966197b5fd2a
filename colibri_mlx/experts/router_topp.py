"""Router top-p over the selected experts (upstream's ``TOPP``). Changes results.

Per position: sort the K selected experts by gate weight (the bias-free sigmoid score)
descending, keep the shortest prefix whose cumulative weight reaches ``p`` x (sum of the K
weights), then renormalise over the kept experts (if ``norm_topk_prob``) and scale by
``routed_scaling_factor``. Dropped slots get id -1 and weight 0, so the MoE block neither
reads nor multiplies them. Fewer expert reads (upstream measured ~1.6x at p 0.7) for a small
quality cost.
"""

from __future__ import annotations

import mlx.core as mx

DROPPED = -1


def expert_top_p(ids: mx.array, gate_weights: mx.array, p: float, norm_topk_prob: bool,
                 scaling: float) -> tuple[mx.array, mx.array]:
    """``ids [..., K]``, unnormalised ``gate_weights [..., K]`` -> (ids with -1 for dropped, weights)."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"expert top-p must be in (0, 1], got {p}")
    K = ids.shape[-1]
    order = mx.argsort(-gate_weights, axis=-1)
    sorted_w = mx.take_along_axis(gate_weights, order, axis=-1)
    target = p * sorted_w.sum(axis=-1, keepdims=True)
    # Prefix of length m reaches the target iff cumsum[m-1] >= target: keep every slot whose
    # preceding prefix is still short of it (the first slot always).
    before = mx.cumsum(sorted_w, axis=-1, inclusive=False)
    keep_sorted = (before < target) | (mx.arange(K) == 0)
    keep = mx.put_along_axis(mx.zeros(ids.shape, mx.bool_), order, keep_sorted, axis=-1)
    weights = mx.where(keep, gate_weights, 0.0)
    if norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return mx.where(keep, ids.astype(mx.int32), DROPPED), weights * scaling  # int32: router ids are uint32


def set_expert_top_p(model, p: float | None) -> None:
    """Turn router top-p on (``p`` in (0, 1]) or off (None) in every MoE layer of ``model``."""
    if p is not None and not 0.0 < p <= 1.0:
        raise ValueError(f"expert top-p must be in (0, 1], got {p}")
    layers = list(model.layers) + [m.layer for m in getattr(model, "mtp_layers", [])]
    for layer in layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            router.top_p = p

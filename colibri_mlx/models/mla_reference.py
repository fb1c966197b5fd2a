"""Reference multi-head latent attention over the latent cache (pure MLX).

Shapes: ``q_nope [B, H, L, nope]``, ``q_rope [B, H, L, rope]`` (already roped), ``latent
[B, T, R]`` (normalized, R = kv_lora_rank), ``k_rope [B, T, rope]`` (roped, shared by all heads),
``kv_b`` the ``kv_b_proj`` weight ``[H*(nope+v), R]`` (float ``mx.array`` or QTensor), ``mask``
bool ``[B, 1, L, T]`` (True = may attend) or None. Both functions return ``[B, H, L, v]`` in
q_nope's dtype; scores, softmax and the weighted sums run in float32 whatever the activation
dtype (a half-precision score carries an absolute error of ~2^-9 x |score| into the exponent).

Row block of head h in ``kv_b``: ``h*(nope+v) + [0, nope)`` is W_UK (latent -> key),
``+ [nope, nope+v)`` is W_UV (latent -> value).

* :func:`mla_decode` is the absorbed form used for a few query tokens: ``q' = W_UK^T q_nope``
  scores directly against the latent rows, the softmax-weighted latent is mapped through W_UV
  once. ``kernels.mla_decode`` must match it.
* :func:`mla_prefill` rebuilds per-head keys and values for the whole context with one kv_b
  matmul (transformers' ``expand_kv``), for long query blocks.
"""

from __future__ import annotations

import mlx.core as mx

from .. import kernels
from ..formats.qtensor import QTensor

# Fill for masked scores: finite, so a row with nothing to attend to (left padding) stays finite.
MASKED = -1e30


def _float_weight(w) -> mx.array:
    if isinstance(w, QTensor):
        return mx.array(w.dequantize())
    return w.astype(mx.float32)


def _softmax(scores: mx.array, mask: mx.array | None) -> mx.array:
    if mask is not None:
        scores = mx.where(mask, scores, MASKED)
    return mx.softmax(scores, axis=-1, precise=True)


def mla_decode(q_nope, q_rope, latent, k_rope, kv_b, scale, mask, qk_nope_head_dim, v_head_dim):
    H = q_nope.shape[1]
    f32 = mx.float32
    w = _float_weight(kv_b).reshape(H, qk_nope_head_dim + v_head_dim, -1)
    w_uk, w_uv = w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]
    latent = latent.astype(f32)
    q_abs = q_nope.astype(f32) @ w_uk  # [B, H, L, R]
    latent_t = latent[:, None].swapaxes(-1, -2)
    scores = (q_abs @ latent_t + q_rope.astype(f32) @ k_rope.astype(f32)[:, None].swapaxes(-1, -2)) * scale
    context = _softmax(scores, mask) @ latent[:, None]  # [B, H, L, R]
    return (context @ w_uv.swapaxes(-1, -2)).astype(q_nope.dtype)


def mla_prefill(q_nope, q_rope, latent, k_rope, kv_b, scale, mask, qk_nope_head_dim, v_head_dim):
    B, H, L, _ = q_nope.shape
    T = latent.shape[1]
    kv = kernels.qmatmul(latent, kv_b).reshape(B, T, H, qk_nope_head_dim + v_head_dim).transpose(0, 2, 1, 3)
    f32 = mx.float32
    k_nope, values = kv[..., :qk_nope_head_dim].astype(f32), kv[..., qk_nope_head_dim:].astype(f32)
    scores = (q_nope.astype(f32) @ k_nope.swapaxes(-1, -2)
              + q_rope.astype(f32) @ k_rope.astype(f32)[:, None].swapaxes(-1, -2)) * scale
    return (_softmax(scores, mask) @ values).astype(q_nope.dtype)

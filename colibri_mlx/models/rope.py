"""Rotary position embedding for the DeepSeek-V3 family: plain and YaRN, interleaved or half-split.

config.json carries the RoPE settings in two styles: older files (hub DeepSeek-V3, Kimi-K2) use
``rope_theta`` + ``rope_scaling``; files written by transformers 5 (GLM-5) use one
``rope_parameters`` dict. :func:`rope_parameters` reads both into one dict.

Numerics follow transformers 5.23 (``modeling_rope_utils._compute_yarn_parameters`` and
``deepseek_v3.apply_rotary_pos_emb_interleave``): inverse frequencies in float32, angles
``position * inv_freq`` in float32, cos/sin multiplied by the YaRN attention factor, and the
rotated pairs written out de-interleaved (``[a*cos - b*sin, b*cos + a*sin]``). The output layout is
the same for query and key, so dot products equal those of a layout-preserving rotation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np

YARN_TYPES = ("yarn", "deepseek_yarn")


def rope_parameters(config: dict) -> dict:
    """One RoPE dict (``rope_type``, ``rope_theta``, ``factor``, ...) from either config style."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params:
        params = dict(params)
    else:
        params = dict(config.get("rope_scaling") or {})
    if "rope_theta" not in params:
        params["rope_theta"] = config.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(params: dict, qk_head_dim: int) -> float:
    """``qk_head_dim**-0.5``, times mscale(factor, mscale_all_dim)² under YaRN (transformers'
    ``yarn_apply_mscale``)."""
    scale = qk_head_dim**-0.5
    if params["rope_type"] != "default":
        mscale_all_dim = params.get("mscale_all_dim") or 0
        if mscale_all_dim:
            m = yarn_get_mscale(params["factor"], mscale_all_dim)
            scale = scale * m * m
    return scale


@dataclass(frozen=True)
class RoPE:
    """Precomputed inverse frequencies ``[dim/2]`` and the cos/sin multiplier."""

    inv_freq: mx.array
    attention_factor: float
    interleaved: bool

    def cos_sin(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """positions int ``[B, L]`` -> cos, sin ``[B, L, dim/2]`` float32."""
        angles = positions.astype(mx.float32)[..., None] * self.inv_freq
        return mx.cos(angles) * self.attention_factor, mx.sin(angles) * self.attention_factor

    @cached_property
    def fast_freqs(self) -> mx.array:
        """``freqs`` for ``mx.fast.rope``, which turns by ``position / freqs``: float32
        reciprocals of ``inv_freq``, each moved by one ulp where that makes ``1 / freqs`` (float32
        or float64 division, as MLX's kernels do) give back ``inv_freq`` exactly."""
        return mx.array(reciprocals_that_round_trip(np.asarray(self.inv_freq, dtype=np.float32)))

    def apply_fast(self, x: mx.array, offset) -> mx.array:
        """Half-split rotation of ``x [B, *, L, dim]`` at positions ``offset + l`` in one
        ``mx.fast.rope`` op (one kernel on GPUs). Equals :func:`apply_rope` with this RoPE's
        cos/sin and ``interleaved=False`` up to float rounding: the attention factor multiplies
        the rotated values instead of cos and sin, and the GPU kernels evaluate cos/sin themselves."""
        y = mx.fast.rope(x, x.shape[-1], traditional=False, base=None, scale=1.0, offset=offset,
                         freqs=self.fast_freqs)
        return y if self.attention_factor == 1.0 else y * self.attention_factor


def reciprocals_that_round_trip(inv_freq: np.ndarray) -> np.ndarray:
    """float32 ``f`` with ``float32(1 / f) == inv_freq`` where one exists among the nearest
    float32 values of the reciprocal (else the nearest reciprocal: one ulp off in the angle)."""
    def exact(f, want):
        return np.float32(1.0 / np.float64(f)) == want and np.float32(1) / f == want

    out = (1.0 / inv_freq.astype(np.float64)).astype(np.float32)
    for j, want in enumerate(inv_freq):
        if exact(out[j], want):
            continue
        for cand in (np.nextafter(out[j], np.float32(np.inf)), np.nextafter(out[j], np.float32(0))):
            if exact(cand, want):
                out[j] = cand
                break
    return out


def make_rope(params: dict, dim: int, max_position_embeddings: int, interleaved: bool = True) -> RoPE:
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(base), exponents, dtype=np.float32)
    if rope_type == "default":
        return RoPE(mx.array((1.0 / pos_freqs).astype(np.float32)), 1.0, interleaved)
    if rope_type not in YARN_TYPES:
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported (expected 'default' or 'yarn')")
    return _yarn(params, dim, base, pos_freqs, max_position_embeddings, interleaved)


def _yarn(params, dim, base, pos_freqs, max_position_embeddings, interleaved) -> RoPE:
    if "original_max_position_embeddings" not in params:
        raise ValueError("config.json: YaRN rope needs 'original_max_position_embeddings'")
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = (1 - ramp).astype(np.float32)
    inv_extra = (1.0 / pos_freqs).astype(np.float32)
    inv_inter = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    inv_freq = inv_inter * (1 - extrapolation_factor) + inv_extra * extrapolation_factor
    return RoPE(mx.array(inv_freq.astype(np.float32)), float(attention_factor), interleaved)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array, interleaved: bool) -> mx.array:
    """Rotate the last axis of ``x`` ``[B, heads, L, dim]``; cos/sin ``[B, L, dim/2]``.

    Interleaved pairs are ``(2j, 2j+1)`` (DeepSeek's layout), half-split pairs ``(j, j+dim/2)``.
    The rotation is computed in float32 (cos/sin are float32) and returned in x's dtype.
    """
    cos, sin = cos[:, None], sin[:, None]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
    return mx.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)

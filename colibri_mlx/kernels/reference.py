"""Pure-MLX reference for qmatmul: dequantize the container bytes with ``mx`` ops, then matmul.

This is the oracle for the GPU kernels and the path on MLX's CPU backend. It reads exactly
the bytes docs/format.md#formats describes (bit shifts and masks on uint8 arrays, a gather into the
fmt 6 grid) and multiplies in float32.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict

import mlx.core as mx
import numpy as np

from ..formats.gguf_quant import is_gguf_fmt

E8_BLOCK = 256        # weights per fmt 6 super-block
E8_BLOCK_BYTES = 98   # 64 grid indices + 8 sign/scale words + fp16 d
I3_GROUP = 64
I3_GROUP_BYTES = 24

# Rows are dequantized in tiles of about this many weights so prefill of a large matrix
# never materializes the whole float matrix at once.
TILE_WEIGHTS = 1 << 24


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def row_bytes(fmt: int, I: int) -> int:
    """Bytes of one stored row (docs/format.md#formats: every row is padded independently)."""
    if fmt == 0:
        return 4 * I
    if fmt == 1:
        return I
    if fmt in (2, 4):
        return _ceil_div(I, 2)
    if fmt == 3:
        return _ceil_div(I, 4)
    if fmt == 5:
        return I3_GROUP_BYTES * _ceil_div(I, I3_GROUP)
    if fmt == 6:
        return E8_BLOCK_BYTES * _ceil_div(I, E8_BLOCK)
    raise ValueError(f"unknown fmt {fmt}")


def scales_per_row(fmt: int, I: int, gs) -> int:
    if fmt in (1, 2, 3):
        return 1
    if fmt == 4:
        return _ceil_div(I, gs)
    if fmt == 5:
        return _ceil_div(I, I3_GROUP)
    return 0


_grid_cache: dict = {}


def e8_grid() -> mx.array:
    """The fmt 6 grid ``[256, 4]`` uint8 (doubled magnitudes), built once."""
    g = _grid_cache.get("grid")
    if g is None:
        from ..formats import e8

        words = np.ascontiguousarray(np.asarray(e8.GRID))
        g = mx.array(_grid_as_bytes(words))
        _grid_cache["grid"] = g
    return g


def _grid_as_bytes(grid) -> np.ndarray:
    """Accept the grid as 256 little-endian u32 words or as a [256, 4] byte table."""
    grid = np.asarray(grid)
    if grid.size == 256:
        return grid.astype("<u4").view(np.uint8).reshape(256, 4)
    return grid.reshape(256, 4).astype(np.uint8)


def e8_grid_words() -> np.ndarray:
    """The grid as 256 little-endian u32 words (what the kernels take as an input)."""
    b = np.asarray(e8_grid()).astype(np.uint32)
    return (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)).astype(np.uint32)


# ---------------------------------------------------------------------------------------
# Dequantizers: packed uint8 [rows * rb] -> float32 [rows, I]


def _codes(b: mx.array, bits: int) -> mx.array:
    """Unpack LSB-first ``bits``-wide codes from bytes ``[..., n]`` -> ``[..., n * 8 // bits]``."""
    per = 8 // bits
    mask = (1 << bits) - 1
    shifts = mx.array([bits * k for k in range(per)], dtype=mx.uint8)
    c = mx.bitwise_and(mx.right_shift(b[..., None], shifts), mask)
    return c.reshape(*b.shape[:-1], b.shape[-1] * per)


def _deq_f32(packed, scales, rows, I, gs):
    return packed.view(mx.float32).reshape(rows, I)


def _deq_int8(packed, scales, rows, I, gs):
    q = packed.reshape(rows, I).view(mx.int8).astype(mx.float32)
    return q * scales.reshape(rows, 1)


def _deq_int4_row(packed, scales, rows, I, gs):
    c = _codes(packed.reshape(rows, -1), 4)[:, :I]
    return (c.astype(mx.float32) - 8.0) * scales.reshape(rows, 1)


def _deq_int2_row(packed, scales, rows, I, gs):
    c = _codes(packed.reshape(rows, -1), 2)[:, :I]
    return (c.astype(mx.float32) - 2.0) * scales.reshape(rows, 1)


def _deq_int4_grouped(packed, scales, rows, I, gs):
    ng = _ceil_div(I, gs)
    c = _codes(packed.reshape(rows, -1), 4)[:, :I]
    s = mx.repeat(scales.reshape(rows, ng), gs, axis=1)[:, :I]
    return (c.astype(mx.float32) - 8.0) * s


def _deq_int3_g64(packed, scales, rows, I, gs):
    ng = _ceil_div(I, I3_GROUP)
    g = packed.reshape(rows, ng, I3_GROUP_BYTES)
    u = mx.bitwise_or(_codes(g[..., :16], 2), mx.left_shift(_codes(g[..., 16:], 1), 2))
    v = (u.astype(mx.float32) - 4.0) * scales.reshape(rows, ng, 1)
    return v.reshape(rows, ng * I3_GROUP)[:, :I]


def _deq_e8(packed, scales, rows, I, gs):
    nb = _ceil_div(I, E8_BLOCK)
    blk = packed.reshape(rows, nb, E8_BLOCK_BYTES)
    # 64 grid indices, each 4 weights, already in weight order (docs/format.md#fmt-6-e8-iq3-lattice).
    mags = e8_grid()[blk[..., :64].astype(mx.uint32)].reshape(rows, nb, 8, 32).astype(mx.float32)
    wb = blk[..., 64:96].reshape(rows, nb, 8, 4).astype(mx.uint32)
    word = wb[..., 0] | (wb[..., 1] << 8) | (wb[..., 2] << 16) | (wb[..., 3] << 24)
    code = (word >> 28).astype(mx.float32)
    seven = mx.bitwise_and(mx.right_shift(word[..., None], mx.array([0, 7, 14, 21], mx.uint32)), 0x7F)
    bits7 = mx.bitwise_and(mx.right_shift(seven[..., None], mx.arange(7, dtype=mx.uint32)), 1)
    parity = mx.bitwise_and(bits7.sum(axis=-1, keepdims=True), 1)  # 8th sign closes the lane
    neg = mx.concatenate([bits7, parity], axis=-1).reshape(rows, nb, 8, 32)
    sign = 1.0 - 2.0 * neg.astype(mx.float32)
    d16 = blk[..., 96].astype(mx.uint16) | (blk[..., 97].astype(mx.uint16) << 8)
    d = d16.view(mx.float16).astype(mx.float32)
    db = d[..., None] * (0.5 + code) * 0.25          # grid stores doubled magnitudes
    w = mags * sign * db[..., None]
    return w.reshape(rows, nb * E8_BLOCK)[:, :I]


DEQUANTIZERS = {
    0: _deq_f32, 1: _deq_int8, 2: _deq_int4_row, 3: _deq_int2_row,
    4: _deq_int4_grouped, 5: _deq_int3_g64, 6: _deq_e8,
}


def _as_mx(a, dtype) -> mx.array:
    return a if isinstance(a, mx.array) else mx.array(np.ascontiguousarray(np.asarray(a)))


def dequantize_rows(qt, r0: int, r1: int) -> mx.array:
    """float32 ``[r1 - r0, I]`` of rows ``r0 .. r1`` of a QTensor (rotated basis for fmt 6;
    fmt 7-10, MLX's formats: kernels/mlx_formats.py; fmt 11-28, GGUF's: kernels/gguf_formats.py)."""
    if is_gguf_fmt(qt.fmt):
        from . import gguf_formats

        return gguf_formats.dequantize_rows(qt, r0, r1)
    if qt.fmt >= 7:
        from . import mlx_formats

        return mlx_formats.dequantize_rows(qt, r0, r1)
    rb = row_bytes(qt.fmt, qt.I)
    packed = _as_mx(qt.packed, mx.uint8).reshape(-1)[r0 * rb: r1 * rb]
    spr = scales_per_row(qt.fmt, qt.I, qt.gs)
    scales = _as_mx(qt.scales, mx.float32).reshape(-1)
    scales = scales[r0 * spr: r1 * spr] if spr else scales
    return DEQUANTIZERS[qt.fmt](packed, scales, r1 - r0, qt.I, qt.gs)


# Formats whose rows are independent byte runs with per-row-ordered scales (fmt 1-5): a row can
# be gathered by id on the device.
GATHER_FMTS = (1, 2, 3, 4, 5)


def dequantize_take(qt, ids: mx.array) -> mx.array:
    """float32 ``[*ids.shape, I]``: rows ``ids`` of a QTensor fmt 1-5, gathered and decoded as
    graph ops (no host read of ``ids``: a lazily computed token stays on the device)."""
    if qt.fmt not in GATHER_FMTS:
        raise ValueError(f"{qt.name}: fmt {qt.fmt} rows cannot be gathered (fmt {GATHER_FMTS} only)")
    rb, spr = row_bytes(qt.fmt, qt.I), scales_per_row(qt.fmt, qt.I, qt.gs)
    flat = ids.reshape(-1)
    n = flat.size
    packed = _as_mx(qt.packed, mx.uint8).reshape(qt.O, rb)[flat].reshape(-1)
    scales = _as_mx(qt.scales, mx.float32).reshape(qt.O, spr)[flat].reshape(-1)
    return DEQUANTIZERS[qt.fmt](packed, scales, n, qt.I, qt.gs).reshape(*ids.shape, qt.I)


def dequantize(qt) -> mx.array:
    """float32 ``[O, I]`` of the whole QTensor."""
    return dequantize_rows(qt, 0, qt.O)


class DequantCache:
    """float32 copies of dequantized weights for the CPU backend's decode, least recently used
    first out, within ``budget_bytes`` (``COLIBRI_DEQUANT_CACHE_MB``, default 2048; 0 turns it off).

    The reference path otherwise dequantizes every weight on every call, which is most of a CPU
    decode step. The copies are bit-identical to a fresh dequantization; an entry dies with its
    QTensor (weak reference), so a recycled ``id()`` can never hit a stale entry.
    """

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict = OrderedDict()   # id(qt) -> float32 [O, I]
        self._watched: set = set()   # ids with a finalizer: one per QTensor, however often re-cached

    def get(self, qt) -> mx.array | None:
        nbytes = 4 * qt.O * qt.I
        if nbytes > self.budget or qt.streamed:   # streamed experts live within the RAM budget
            return None
        key = id(qt)
        w = self._entries.get(key)
        if w is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return w
        self.misses += 1
        w = dequantize(qt)
        mx.eval(w)
        while self.used + nbytes > self.budget and self._entries:
            self._drop(next(iter(self._entries)))
        self._entries[key] = w
        self.used += nbytes
        if key not in self._watched:
            self._watched.add(key)
            weakref.finalize(qt, self._forget, key)
        return w

    def _forget(self, key) -> None:
        self._watched.discard(key)
        self._drop(key)

    def _drop(self, key) -> None:
        w = self._entries.pop(key, None)
        if w is not None:
            self.used -= w.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.used = 0


dequant_cache = DequantCache(int(float(os.environ.get("COLIBRI_DEQUANT_CACHE_MB", "2048")) * 2**20))


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm`` over the last axis. One row is normalized as a 1-D view: MLX's GPU
    rms_norm copies an input whose row stride is not its width (a launch of its own), and a decode
    row's parts of a stacked projection are such slices; a 1-D view has no row stride to check."""
    if x.ndim > 1 and x.size == x.shape[-1]:
        return mx.fast.rms_norm(x.reshape(-1), weight, eps).reshape(x.shape)
    return mx.fast.rms_norm(x, weight, eps)


def cached_qmatmul(x: mx.array, qt) -> mx.array:
    """:func:`qmatmul` through :data:`dequant_cache` (same result bit for bit); weights over the
    budget are dequantized per call as before."""
    w = dequant_cache.get(qt)
    if w is None:
        return qmatmul(x, qt)
    return (x.astype(mx.float32) @ w.T).astype(x.dtype)


def qmatmul(x: mx.array, qt, compute_dtype=mx.float32) -> mx.array:
    """``x[N, I] @ W.T`` -> ``[N, O]`` in x's dtype; dequantized in row tiles, float32 accumulate.

    ``compute_dtype`` is what the dequantized tile and x are cast to for the matmul (float32 for
    the oracle; the prefill path may pass bf16/f16 on GPUs, where the matmul still accumulates
    in float32).
    """
    xc = x.astype(compute_dtype)
    tile = max(1, TILE_WEIGHTS // max(qt.I, 1))
    parts = []
    for r0 in range(0, qt.O, tile):
        r1 = min(qt.O, r0 + tile)
        w = dequantize_rows(qt, r0, r1).astype(compute_dtype)
        parts.append(xc @ w.T)
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    return y.astype(x.dtype)

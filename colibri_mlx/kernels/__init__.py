"""Hot paths behind small functions: ``qmatmul`` (``moe_block`` and ``mla_decode`` later).

Every hot path has a pure-MLX reference, a Metal kernel and its CUDA twin; :mod:`.dispatch`
picks one by backend (``COLIBRI_KERNELS=reference`` or :func:`force_reference` force the
reference) and counts every call and every fallback (:func:`counters`,
:func:`format_counters` for the stats line).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..formats.qtensor import QTensor
from . import compiled, dispatch, gguf_formats, mlx_formats, mlx_qmm, qgemv as _qgemv, reference, router
from .mla import mla_decode
from . import device_inputs  # noqa: F401 (kernels.device_inputs)
from .rows import mla_rows
from .moe import moe_block
from .dispatch import (
    CUDA,
    METAL,
    REFERENCE,
    backend,
    counters,
    force_reference,
    format_counters,
    reset_counters,
)

__all__ = [
    "CUDA", "METAL", "REFERENCE", "backend", "compiled", "counters", "force_reference", "format_counters",
    "concat_rows", "gather_rows", "mla_decode", "mla_rows", "moe_block", "qmatmul", "reset_counters", "router",
]

# Formats whose rows are independent byte runs with their scales in per-row order (docs/format.md#formats:
# row o starts at o * row_bytes, scales [O] or [O, ng] row-major): stacking two tensors' rows is
# concatenating their byte streams and their scale arrays. fmt 6 is row-wise too but holds the
# rotated matrix and only routed experts use it, fmt 0 takes the dequant-matmul path anyway: both
# are left out rather than special-cased.
ROW_CONCAT_FMTS = (1, 2, 3, 4, 5)


def qmatmul(x: mx.array, w, residual: mx.array | None = None, out_dtype: mx.Dtype | None = None) -> mx.array:
    """``x[..., I] @ W.T -> [..., O]`` in x's dtype (or ``out_dtype``: float32 logits without a
    rounding to x's dtype or a cast launch), float32 accumulation; plus ``residual`` (``[..., O]``,
    x's dtype) when given, rounded as a separate add would round it.

    ``w`` is a float ``mx.array [O, I]`` or a :class:`QTensor` (fmt 0-6; for fmt 6 ``x`` must
    already be rotated, docs/format.md#rotation). Up to 8 rows of x go to the GEMV kernel, which reads
    every weight byte once (and adds the residual as it writes: no launch of its own), up to
    QMM_MIN_ROWS[backend] - 1 where MLX's quantized matmul reads the format; more rows (prefill)
    go to that quantized matmul, else dequantize row tiles and use matmul.
    """
    if residual is not None and out_dtype is not None and out_dtype != x.dtype:
        raise ValueError(f"qmatmul: a residual add keeps x's dtype {x.dtype}, not {out_dtype}")
    if not isinstance(w, QTensor):
        dispatch.record_call("dense", "matmul")
        y = x @ w.T
        y = y if residual is None else residual + y
        return y if out_dtype is None else y.astype(out_dtype)
    shape = x.shape
    if shape[-1] != w.I:
        raise ValueError(f"qmatmul: x has {shape[-1]} features but {w.name or 'weight'} "
                         f"is [{w.O}, {w.I}] (fmt {w.fmt})")
    if residual is not None and (residual.shape[:-1] != shape[:-1] or residual.shape[-1] != w.O
                                 or residual.dtype != x.dtype):
        raise ValueError(f"qmatmul: residual {residual.shape} {residual.dtype} does not match the output "
                         f"{(*shape[:-1], w.O)} {x.dtype} of {w.name or 'weight'}")
    S = x.size // shape[-1]
    if len(shape) == 2 or _gemv_takes(x, w, S):
        # MLX records even a no-op reshape as a graph node; the kernel reads x and the residual
        # as flat rows and writes [..., O] itself, so rows of any rank go to it as they are.
        return _qmatmul_2d(x, w, S, residual, out_dtype)
    x2 = x.reshape(-1, w.I)
    y = _qmatmul_2d(x2, w, x2.shape[0], None if residual is None else residual.reshape(-1, w.O), out_dtype)
    return y.reshape(*shape[:-1], w.O)


# Rows from which MLX's quantized matmul on the stored bytes (kernels.mlx_qmm) runs instead of the
# GEMV kernel, per backend. H200, fmt 4 g64 as MLX affine 4-bit, scripts/bench/bench_qgemv.py
# --rows S --fmts 4 --no-variants, 18432 x 7168: qgemv 129.9 us against 434.5 at 6 rows, 233.4
# against 65.6 at 8 (MLX leaves its per-row kernel there); 7168 x 2048: 32.5 / 58.6, 37.6 / 16.0.
QMM_MIN_ROWS = {CUDA: 8}


def _mlx_qmm_takes(x: mx.array, qt: QTensor, S: int, impl: str) -> bool:
    """Whether these ``S`` decode rows go to MLX's quantized matmul (QMM_MIN_ROWS)."""
    return (S >= QMM_MIN_ROWS.get(impl, _qgemv.MAX_ROWS + 1) and x.dtype in (mx.float16, mx.bfloat16)
            and mlx_qmm.decline_reason(qt, x.dtype) is None)


def _gemv_takes(x: mx.array, qt: QTensor, S: int) -> bool:
    """Whether the qgemv kernel runs these ``S`` rows (a decline is counted by _qmatmul_2d)."""
    impl = backend()
    return (qt.fmt != 0 and S <= _qgemv.MAX_ROWS and impl != REFERENCE
            and not _mlx_qmm_takes(x, qt, S, impl) and _qgemv.decline_reason_for(qt, S, x.dtype) is None)


def _qmatmul_2d(x: mx.array, qt: QTensor, S: int, residual: mx.array | None = None, out_dtype=None) -> mx.array:
    """``S`` rows of x: ``[S, I]``, or any rank when the GEMV kernel takes them (_gemv_takes)."""
    impl = backend()
    # The reference computes in float32: float32 logits skip the rounding to x's dtype there too.
    xr = x.astype(mx.float32) if out_dtype is not None and out_dtype == mx.float32 and residual is None else x
    if qt.fmt != 0 and impl != REFERENCE and _mlx_qmm_takes(x, qt, S, impl):
        dispatch.record_call("qmm", "mlx-quantized-matmul")
        y = mlx_qmm.qmatmul(x, qt)
    elif qt.fmt != 0 and S <= _qgemv.MAX_ROWS and impl != REFERENCE:
        reason = _qgemv.decline_reason_for(qt, S, x.dtype)
        if reason is None:
            dispatch.record_call("qgemv", impl)
            return _qgemv.qgemv(x, qt, impl, residual, out_dtype)
        dispatch.record_fallback("qgemv", reason)
        y = reference.qmatmul(xr, qt)
    elif qt.fmt == 0 or S > _qgemv.MAX_ROWS:
        # Prefill / f32 weights on a GPU: MLX's quantized matmul where it reads the stored
        # layout (kernels.mlx_qmm), else dequantized tiles + matmul (in x's dtype on GPUs, where
        # the matmul accumulates in float32; float32 on the CPU backend).
        gpu = impl in (METAL, CUDA) and x.dtype in (mx.float16, mx.bfloat16)
        if gpu and qt.fmt != 0 and mlx_qmm.decline_reason(qt, x.dtype) is None:
            dispatch.record_call("qmm", "mlx-quantized-matmul")
            y = mlx_qmm.qmatmul(x, qt)
        else:
            dispatch.record_call("f32" if qt.fmt == 0 else "qmm", "dequant-matmul")
            if not gpu and qt.fmt != 0:
                y = reference.cached_qmatmul(xr, qt)
            else:
                y = reference.qmatmul(x, qt, compute_dtype=x.dtype if gpu else mx.float32)
    else:
        dispatch.record_call("qgemv", REFERENCE)
        y = reference.cached_qmatmul(xr, qt)
    y = y if residual is None else residual + y
    return y if out_dtype is None or y.dtype == out_dtype else y.astype(out_dtype)


def gather_rows(qt: QTensor, ids: mx.array, compiled_block: bool = True) -> mx.array:
    """float32 rows ``ids`` of a QTensor fmt 1-5 (an embedding lookup), gathered and decoded on
    the device (:func:`reference.dequantize_take`): a lazily computed token needs no host read.
    ``compiled_block``: as one compiled graph (kernels.compiled, per ids shape; the gather and
    decode are a dozen small ops); False inside a caller's own compiled graph."""
    if not compiled_block:
        return reference.dequantize_take(qt, ids)
    block = vars(qt).get("_gather_rows") or compiled.kept_block(
        qt, "_gather_rows", functools.partial(reference.dequantize_take, qt), "gather_rows")
    return block(ids)


def concat_rows(weights) -> "mx.array | QTensor | None":
    """One weight holding the rows of ``weights`` in order, so projections of the same input run
    as one qmatmul (one launch) whose output is split with slices; None when they cannot share
    one: mixed float/quantized, different fmt, input width, group size or float dtype.

    The result is evaluated at once and is the only copy the caller should keep (drop the parts).
    """
    first = weights[0]
    if all(isinstance(w, mx.array) for w in weights):
        if any(w.ndim != 2 or w.shape[1] != first.shape[1] or w.dtype != first.dtype for w in weights):
            return None
        fused = mx.concatenate(list(weights), axis=0)
    elif all(isinstance(w, QTensor) for w in weights) and gguf_formats.is_gguf(first):
        return gguf_formats.concat_rows(weights)
    elif all(isinstance(w, QTensor) for w in weights) and first.fmt >= 7:
        return mlx_formats.concat_rows(weights)
    elif all(isinstance(w, QTensor) for w in weights):
        if first.fmt not in ROW_CONCAT_FMTS or any(
                (w.fmt, w.I, w.gs if w.fmt == 4 else None) != (first.fmt, first.I, first.gs if first.fmt == 4 else None)
                for w in weights):
            return None
        packed = mx.concatenate([_qgemv._as_mx(w.packed, mx.uint8).reshape(-1) for w in weights])
        scales = mx.concatenate([_qgemv._as_mx(w.scales, mx.float32).reshape(-1) for w in weights])
        fused = QTensor(packed, scales, first.fmt, sum(w.O for w in weights), first.I, first.gs,
                        "+".join(w.name for w in weights))
    else:
        return None
    mx.eval(fused.packed, fused.scales) if isinstance(fused, QTensor) else mx.eval(fused)
    return fused


def rows_of(w, r0: int, r1: int):
    """Rows ``r0:r1`` of a float weight or QTensor fmt 1-5 or 7-28 as a view (no copy), e.g. one part of a
    :func:`concat_rows` weight for statistics."""
    if isinstance(w, mx.array):
        return w[r0:r1]
    if gguf_formats.is_gguf(w):
        return gguf_formats.rows(w, r0, r1)
    if w.fmt >= 7:
        return mlx_formats.rows(w, r0, r1)
    from .reference import row_bytes, scales_per_row

    rb, spr = row_bytes(w.fmt, w.I), scales_per_row(w.fmt, w.I, w.gs)
    return QTensor(w.packed[r0 * rb: r1 * rb], w.scales[r0 * spr: r1 * spr], w.fmt, r1 - r0, w.I, w.gs, w.name)


def take_rows(w, order):
    """``w`` with its rows in ``order`` (a permutation of ``range(O)``), evaluated: the same
    bytes and scales per row, so every output of a qmatmul is the same number, moved. Float
    weights or QTensor fmt 0-6 (every fmt stores rows independently, docs/format.md#formats; fmt 0 and 6
    carry no per-row scales)."""
    import numpy as np

    from .reference import _as_mx, scales_per_row

    order = np.asarray(order)
    if sorted(order.tolist()) != list(range(w.shape[0])):
        raise ValueError(f"take_rows: not a permutation of the {w.shape[0]} rows")
    idx = mx.array(order.astype(np.int32))
    if not isinstance(w, QTensor):
        out = w[idx]
        mx.eval(out)
        return out
    if gguf_formats.is_gguf(w):
        return gguf_formats.take_rows(w, idx)
    if w.fmt >= 7:
        return mlx_formats.take_rows(w, idx)
    packed = _as_mx(w.packed, None)                       # any element type: rows are equal runs
    packed = packed.reshape(w.O, -1)[idx].reshape(packed.shape)
    spr = scales_per_row(w.fmt, w.I, w.gs)
    scales = _as_mx(w.scales, None)
    scales = scales.reshape(w.O, spr)[idx].reshape(scales.shape) if spr else scales
    mx.eval(packed, scales)
    return QTensor(packed, scales, w.fmt, w.O, w.I, w.gs, w.name)

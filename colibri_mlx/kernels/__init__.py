"""Hot paths behind small functions: ``qmatmul`` (``moe_block`` and ``mla_decode`` later).

Every hot path has a pure-MLX reference, a Metal kernel and its CUDA twin; :mod:`.dispatch`
picks one by backend (``COLIBRI_KERNELS=reference`` or :func:`force_reference` force the
reference) and counts every call and every fallback (:func:`counters`,
:func:`format_counters` for the stats line).
"""

from __future__ import annotations

import mlx.core as mx

from ..formats.qtensor import QTensor
from . import dispatch, qgemv as _qgemv, reference, router
from .mla import mla_decode
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
    "CUDA", "METAL", "REFERENCE", "backend", "counters", "force_reference", "format_counters",
    "mla_decode", "moe_block", "qmatmul", "reset_counters", "router",
]


def qmatmul(x: mx.array, w) -> mx.array:
    """``x[..., I] @ W.T -> [..., O]`` in x's dtype, float32 accumulation.

    ``w`` is a float ``mx.array [O, I]`` or a :class:`QTensor` (fmt 0-6; for fmt 6 ``x`` must
    already be rotated, FORMAT.md §3.6). Up to 8 rows of x go to the GEMV kernel, which reads
    every weight byte once; more rows (prefill) dequantize row tiles and use matmul.
    """
    if not isinstance(w, QTensor):
        dispatch.record_call("dense", "matmul")
        return x @ w.T
    if x.shape[-1] != w.I:
        raise ValueError(f"qmatmul: x has {x.shape[-1]} features but {w.name or 'weight'} "
                         f"is [{w.O}, {w.I}] (fmt {w.fmt})")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.I)
    y = _qmatmul_2d(x2, w)
    return y.reshape(*lead, w.O)


def _qmatmul_2d(x: mx.array, qt: QTensor) -> mx.array:
    S = x.shape[0]
    impl = backend()
    if qt.fmt == 0 or S > _qgemv.MAX_ROWS:
        # Prefill / f32 weights: dequantized tiles + matmul (in x's dtype on GPUs, where the
        # matmul accumulates in float32; float32 on the CPU backend).
        path = "f32" if qt.fmt == 0 else "qmm"
        dispatch.record_call(path, "dequant-matmul")
        gpu = impl in (METAL, CUDA) and x.dtype in (mx.float16, mx.bfloat16)
        return reference.qmatmul(x, qt, compute_dtype=x.dtype if gpu else mx.float32)
    if impl == REFERENCE:
        dispatch.record_call("qgemv", REFERENCE)
        return reference.qmatmul(x, qt)
    reason = _qgemv.decline_reason(x, qt)
    if reason is not None:
        dispatch.record_fallback("qgemv", reason)
        return reference.qmatmul(x, qt)
    dispatch.record_call("qgemv", impl)
    return _qgemv.qgemv(x, qt, impl)

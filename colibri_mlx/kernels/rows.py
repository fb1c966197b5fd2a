"""mla_rows (``kernels.mla_rows``): a decode row's norms and rope key, before the cache write.

The stacked q_a / kv_a projection of a decode row becomes q_latent (RMS-normalized) and the
joint cache row (the normalized latent, then the rope key rotated half-split) in one launch on
GPUs, the ``mla_rows`` / ``mla_rows_into`` bodies of metal_kernels/mla_decode.metal and its CUDA
twin, instead of two rms_norms, a rope and a concat; ``mla_rows_into`` writes the row into the
cache buffer in place.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import dispatch
from .mla import CACHE_DTYPES, SIMD, _int32s
from .moe import kernel_header, read_kernel_sections
from .reference import rms_norm

ROWS_NSG = 4              # SIMD groups of mla_rows' threadgroup (one per row)


def rows_decline_reason(y: mx.array, q_rows: int, qa_norm, kv_norm, factor: float,
                        offset: Optional[mx.array] = None) -> Optional[str]:
    """Why :func:`mla_rows` runs the reference on a GPU, or None."""
    n = y.size // y.shape[-1]
    if n != (1 if offset is None else offset.size):
        return f"rows of shape {tuple(y.shape)} at {1 if offset is None else offset.size} position(s): one a row"
    if y.dtype not in CACHE_DTYPES:
        return f"rows in {y.dtype}"
    if qa_norm is None or q_rows < 1:
        return "no q_a projection"
    if qa_norm.dtype != y.dtype or kv_norm.dtype != y.dtype:
        return f"norm weights in {qa_norm.dtype} / {kv_norm.dtype} with rows in {y.dtype}"
    rope = y.shape[-1] - q_rows - kv_norm.shape[0]
    if rope < 2 or rope % 2:
        return f"rope width {rope}"
    if factor != 1.0:
        return f"rope attention factor {factor} (mx.fast.rope's product by it rounds once more)"
    return None


def rows_spec(y, q_rows: int, qa_norm, kv_norm, eps: float, inv_freq, offset, backend: str,
              cache: Optional[mx.array] = None) -> dispatch.LaunchSpec:
    """mla_rows' launch: one threadgroup per row of ``y [..., W]`` (outputs ``[..., q_rows]`` and
    ``[..., R + rope]``: y's leading shape, no reshape nodes); ``inv_freq`` float32 ``[rope / 2]``.
    ``cache`` (``[1, capacity, R + rope]``): ``mla_rows_into``, which writes the cache row into
    that buffer at slot ``offset`` instead (output q_a only)."""
    W = y.shape[-1]
    BL, lead = y.size // W, y.shape[:-1]
    R = kv_norm.shape[0]
    rope = W - q_rows - R
    into = cache is not None        # mla_rows_into: the buffer's capacity bounds the slot
    name = "mla_rows_into" if into else "mla_rows"
    names = ("y", "qnorm", "knorm", "invf", "pos", "params", "fparams") + (("cache",) if into else ())
    ints = (q_rows, R, rope, W) + ((cache.shape[1],) if into else ())
    inputs = [y, qa_norm, kv_norm, inv_freq, dispatch.reshaped(offset, BL), _int32s(*ints),
              dispatch.float_params(eps, eps)] + ([cache] if into else [])
    outputs = [("qa", q_rows)] + ([] if into else [("kv", R + rope)])
    return dispatch.LaunchSpec(
        name=name, input_names=names, output_names=tuple(o for o, _ in outputs),
        source=read_kernel_sections("mla_decode", backend)[1][name], header=kernel_header("mla_decode", backend),
        inputs=inputs, output_shapes=[(*lead, width) for _, width in outputs],
        output_dtypes=[y.dtype] * len(outputs), grid=(SIMD * ROWS_NSG, 1, BL), threadgroup=(SIMD * ROWS_NSG, 1, 1),
        template=[("T", y.dtype), ("NSG", ROWS_NSG)], written_inputs=("cache",) if into else ())


def into_decline_reason(y: mx.array, q_rows: int, cache: mx.array) -> Optional[str]:
    """Why :func:`mla_rows` cannot write its row into ``cache`` in place, or None."""
    width = y.shape[-1] - q_rows
    if cache.size < 8:      # Metal: MLX passes inputs of fewer than 8 values as constant memory
        return f"cache of {cache.size} values"
    if cache.ndim != 3 or cache.shape[0] != 1 or cache.shape[2] != width or cache.dtype != y.dtype:
        return (f"cache of shape {tuple(cache.shape)} in {cache.dtype}: expected [1, capacity, {width}] "
                f"in {y.dtype}")
    return None


def mla_rows(y: mx.array, q_rows: int, qa_norm, kv_norm, eps: float, rope,
             offset: mx.array, cache: Optional[mx.array] = None) -> tuple[mx.array, Optional[mx.array]]:
    """``(q_latent [BL, q_rows], kv [BL, R + rope])`` from ``y [BL, q_rows + R + rope]`` (any
    leading shape, kept by both outputs), the stacked q_a / kv_a projection of decode rows at
    position ``offset`` (int32 array: one row's position, mx.fast.rope's offset; or ``[BL]``, the
    consecutive positions of one sequence's rows, a verify step): q_a and the latent RMS-normalized
    by ``qa_norm`` / ``kv_norm`` (eps),
    the rope key rotated half-split by ``rope`` (models/rope.RoPE: ``inv_freq``, ``fast_freqs``
    for mx.fast.rope, ``attention_factor``), ``kv`` the joint cache row (the latent, then the
    rope key). One launch on GPUs (``mla_rows``) instead of two rms_norms, a rope and a concat.

    ``cache`` (the joint cache's whole buffer ``[1, capacity, R + rope]``, one sequence whose
    position is its slot): on the kernel path the rows are written into that buffer at slots
    ``offset`` in place and ``kv`` is None (``mla_rows_into``: no scatter, and no copy of the
    cache when MLX could not donate it); otherwise the caller writes ``kv``. The buffer must own
    row-contiguous memory (LayerCache's buffers do: made by ``mx.zeros`` and slice updates, then
    passed from step to step), or MLX would hand the kernel a contiguous copy to write into; and
    every reader of the row must depend on q_a (the attention does, through q_b; the next step,
    through the buffer made to depend on it: models/deepseek_v3.written_in_place)."""
    impl = dispatch.backend()
    factor = rope.attention_factor
    reason = None if impl == dispatch.REFERENCE else rows_decline_reason(y, q_rows, qa_norm, kv_norm, factor, offset)
    if impl == dispatch.REFERENCE or reason is not None:
        if reason is None:
            dispatch.record_call("mla_rows", dispatch.REFERENCE)
        else:
            dispatch.record_fallback("mla_rows", reason)
        if y.ndim == 2:
            return reference_rows(y, q_rows, qa_norm, kv_norm, eps, rope, offset)
        qa, kv = reference_rows(y.reshape(-1, y.shape[-1]), q_rows, qa_norm, kv_norm, eps, rope, offset)
        return qa.reshape(*y.shape[:-1], -1), kv.reshape(*y.shape[:-1], -1)
    if cache is not None:
        reason = into_decline_reason(y, q_rows, cache)
        if reason is not None:
            dispatch.record_fallback("mla_rows_into", reason)
            cache = None
    dispatch.record_call("mla_rows", impl)
    out = dispatch.launch(impl, rows_spec(y, q_rows, qa_norm, kv_norm, eps, rope.inv_freq, offset, impl, cache))
    return (out[0], None) if cache is not None else (out[0], out[1])


def reference_rows(y, q_rows, qa_norm, kv_norm, eps, rope, offset):
    """:func:`mla_rows` as the ops it replaces: the norms (reference.rms_norm) and the rope
    key's mx.fast.rope (``rope.apply_fast``)."""
    R = kv_norm.shape[0]
    q_latent = rms_norm(y[:, :q_rows], qa_norm, eps) if q_rows else y[:, :0]
    latent = rms_norm(y[:, q_rows:q_rows + R], kv_norm, eps)
    if offset.size > 1:     # rows of one sequence at consecutive positions: [1, BL, rope] from the first
        k_rope = rope.apply_fast(y[None, :, q_rows + R:], offset.reshape(-1)[0])[0]
    else:
        k_rope = rope.apply_fast(y[:, None, q_rows + R:], offset)[:, 0]   # [BL, 1, rope]: [..., L, dims]
    return q_latent, mx.concatenate([latent, k_rope], axis=-1)

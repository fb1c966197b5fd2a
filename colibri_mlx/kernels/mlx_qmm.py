"""Prefill rows through MLX's own quantized matmul, for the weights it reads as they are stored.

Above ``qgemv.MAX_ROWS`` rows on a GPU, ``kernels.qmatmul`` multiplies instead of running the
GEMV kernel. Dequantizing writes a float copy of every weight and reads it back;
``mx.quantized_matmul`` reads the packed codes once, as mlx-lm's prefill does:

* MLX's formats (fmt 7-10, mlx-lm checkpoints): the arrays as stored;
* fmt 4 (int4 grouped): MLX's affine layout carries the same numbers. Codes are packed LSB-first
  in both, so the bytes read as uint32 words are MLX's packed weight; ``w = (q - 8) s`` is
  ``q s + b`` with ``b = -8 s``. (The per-row formats would need their scale repeated over the
  row's groups; on the H200, MLX's quantized matmul read such a repeated scale array wrong, so
  they keep the dequantizing route.)

Scales and biases go in x's dtype, as MLX's kernels take them (cast per call: they are 1/16 of
the weight bytes or less). With bfloat16 x that rounds a float32 scale to bfloat16; ``-z s``
stays exact (z = 8 is a power of two), so a weight becomes ``(q - z) * bf16(s)``: off by at most
2^-9 relatively, as the dequantized bfloat16 weight of the other route is.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ..formats.mlx_quant import MLX_FMTS
from ..formats.qtensor import QTensor
from .mlx_formats import _float_scales, _mx, is_mlx_kernel_fmt, kernel_bits

AFFINE_FMT = 4                   # colibri's int4 grouped: w = (q - 8) * scale, q unsigned 4-bit
AFFINE_BITS, AFFINE_ZERO = 4, 8
GROUP_SIZES = (128, 64, 32)      # MLX's affine group sizes
FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
# The kernels' FMT codes of MLX's formats (kernels/mlx_formats.py): affine 70 / 80 / 90 + bits
# with bfloat16 / float16 / float32 scales, then the fp modes.
AFFINE_SCALE_DTYPES = {70: mx.bfloat16, 80: mx.float16, 90: mx.float32}
FP_KERNEL_MODES = {8: "mxfp4", 9: "nvfp4", 10: "mxfp8"}


def layout_reason(fmt: int, gs, I: int) -> Optional[str]:
    """Why a matrix of rows of ``I`` weights of colibri fmt ``fmt`` has no MLX affine reading, or None."""
    if fmt != AFFINE_FMT:
        return f"fmt {fmt} has no MLX layout"
    if gs not in GROUP_SIZES:
        return f"group size {gs} is not one of MLX's {GROUP_SIZES}"
    if I % gs:
        return f"row of {I} weights ends in a partial group of {gs}"
    return None


def decline_reason(qt: QTensor, dtype) -> Optional[str]:
    """Why ``mx.quantized_matmul`` cannot take ``qt`` with x of ``dtype`` as stored, or None."""
    if dtype not in FLOAT_DTYPES:
        return f"x dtype {dtype}"
    if qt.fmt in MLX_FMTS:
        return None
    return layout_reason(qt.fmt, qt.gs, qt.I)


def affine_arrays(gs: int, lead: tuple, O: int, I: int, packed: mx.array, scales: mx.array, dtype) -> tuple:
    """``(w uint32 [*lead, O, I/8], scales, biases [*lead, O, I/gs])`` of fmt 4 matrices stored
    back to back in ``packed`` (bytes or words) and ``scales`` (float32 a group; only the first
    ones are read)."""
    w = packed.reshape(-1).view(mx.uint32).reshape(*lead, O, I * AFFINE_BITS // 32)
    n = int(np.prod(lead, dtype=np.int64)) * O
    s = scales.reshape(-1)[: n * (I // gs)].reshape(*lead, O, I // gs).astype(dtype)
    return w, s, s * -float(AFFINE_ZERO)


def qmatmul(x: mx.array, qt: QTensor) -> mx.array:
    """``x [N, I] @ W.T`` in x's dtype by ``mx.quantized_matmul`` (:func:`decline_reason` None)."""
    if qt.fmt in MLX_FMTS:
        m = MLX_FMTS[qt.fmt]
        if m.has_biases:
            scales, biases = _float_scales(qt.scales), _float_scales(qt.biases)
            if scales.dtype != x.dtype:
                scales, biases = scales.astype(x.dtype), biases.astype(x.dtype)
        else:
            scales, biases = _mx(qt.scales), None
        return mx.quantized_matmul(x, _mx(qt.packed), scales, biases, transpose=True, group_size=qt.gs,
                                   bits=qt.bits, mode=m.mode)
    w, s, b = affine_arrays(qt.gs, (), qt.O, qt.I, _mx(qt.packed), _mx(qt.scales), x.dtype)
    return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=qt.gs, bits=AFFINE_BITS, mode="affine")


def stacked_reason(kfmt: int, gs, I: int) -> Optional[str]:
    """:func:`layout_reason` for stacked matrices of kernel FMT code ``kfmt`` (moe's banks)."""
    return None if is_mlx_kernel_fmt(kfmt) else layout_reason(kfmt, gs, I)


def stacked_arrays(kfmt: int, gs, lead: tuple, O: int, I: int, packed: mx.array, scales: mx.array,
                   dtype) -> tuple:
    """``(w, scales, biases or None, group_size, bits, mode)`` for ``mx.gather_qmm`` of matrices
    stored back to back as the kernels take them (moe's ExpertBank): fmt 4 read as affine
    (:func:`affine_arrays`); MLX's formats from their kernel inputs (mlx_formats.kernel_scales:
    affine 16-bit scale and bias in one word, or two float32 words; fp modes the scale bytes,
    rows padded to whole words)."""
    if not is_mlx_kernel_fmt(kfmt):
        return (*affine_arrays(gs, lead, O, I, packed, scales, dtype), gs, AFFINE_BITS, "affine")
    bits = kernel_bits(kfmt)
    n, ng = int(np.prod(lead, dtype=np.int64)) * O, I // gs
    w = packed.reshape(-1).view(mx.uint32).reshape(*lead, O, I * bits // 32)
    if kfmt in FP_KERNEL_MODES:
        padded = 4 * -(-ng // 4)
        s = scales.reshape(-1).view(mx.uint8)[: n * padded].reshape(*lead, O, padded)[..., :ng]
        return w, mx.contiguous(s), None, gs, bits, FP_KERNEL_MODES[kfmt]
    stored = AFFINE_SCALE_DTYPES[kfmt - bits]
    if stored == mx.float32:
        pairs = scales.reshape(-1)[: 2 * n * ng].reshape(*lead, O, ng, 2)
        s, b = mx.contiguous(pairs[..., 0]), mx.contiguous(pairs[..., 1])
    else:
        words = scales.reshape(-1).view(mx.uint32)[: n * ng].reshape(*lead, O, ng)
        s = (words & 0xFFFF).astype(mx.uint16).view(stored)
        b = (words >> 16).astype(mx.uint16).view(stored)
    return w, s.astype(dtype), b.astype(dtype), gs, bits, "affine"

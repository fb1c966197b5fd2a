"""The MLX quantization formats (fmt 7-10, formats/mlx_quant.py) in the hot paths.

* :func:`dequantize_rows`: the pure-MLX reference decode: affine ``q * s + b`` in float32 from the
  widened scales, as ``mx.quantized_matmul`` computes it (bit-equal to ``mx.dequantize`` of the
  float32-widened scales and biases); :func:`embedding_rows` rounds in the stored dtype as
  ``mx.dequantize`` itself does.
* :func:`kernel_fmt`, :func:`kernel_weights`, :func:`kernel_scales`: what the GPU kernels take. The
  kernels see one FMT template code per layout (qdecode.h): affine ``70 + bits`` (bfloat16 scales),
  ``80 + bits`` (float16), ``90 + bits`` (float32); 8 mxfp4, 9 nvfp4, 10 mxfp8. Units are 32
  weights (``bits`` words); the weights are the stored uint32 words viewed as bytes. The scales
  input is built once per weight (:func:`kernel_scales`): affine one 32-bit word per group holding
  the 16-bit scale (low half) and bias (high half), or two float32 words; fp modes the stored
  scale bytes, rows padded to whole words.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from ..formats.mlx_quant import CODE_TABLES, MLX_FMTS, SCALE_TABLES

MLX_FMT_MIN = 7
MLX_FMT_MAX = 10      # fmt 11-28 are GGUF's (formats/gguf_quant.py, kernels/gguf_decode.py)
UNIT = 32             # weights per kernel unit, every MLX format
AFFINE_KERNEL_BASE = {"bfloat16": 70, "float16": 80, "float32": 90}
FP_KERNEL_FMT = {8: 8, 9: 9, 10: 10}


def is_mlx(qt) -> bool:
    return qt.fmt in MLX_FMTS


def _dtype_name(a) -> str:
    return str(a.dtype).replace("mlx.core.", "")


def kernel_fmt(qt) -> int:
    """The FMT template code of a QTensor (fmt 0-6 and the GGUF fmt 11-28: its fmt)."""
    if not is_mlx(qt):
        return qt.fmt
    if qt.fmt == 7:
        name = _dtype_name(qt.scales)
        if name == "uint16":   # bfloat16 held as raw bits in numpy
            name = "bfloat16"
        return AFFINE_KERNEL_BASE[name] + int(qt.bits)
    return FP_KERNEL_FMT[qt.fmt]


def row_bytes(qt) -> int:
    return qt.I * qt.bits // 8


def is_mlx_kernel_fmt(kfmt: int) -> bool:
    """Whether a kernel FMT code is an MLX format's (qdecode.h qd_mlx): 8-10 and 70+."""
    return 8 <= kfmt <= MLX_FMT_MAX or kfmt >= 70


def kernel_bits(kfmt: int) -> int:
    """Code width of a kernel FMT code of the MLX formats (qdecode.h qd_mlx_bits)."""
    return kfmt % 10 if kfmt >= 70 else (8 if kfmt == 10 else 4)


def kernel_row_bytes(kfmt: int, I: int) -> int:
    return I * kernel_bits(kfmt) // 8


def kernel_scale_words(kfmt: int, I: int, gs: int) -> int:
    """:func:`scale_words_per_row` from a kernel FMT code."""
    ng = I // gs
    if kfmt >= 70:
        return 2 * ng if kfmt >= 90 else ng
    return -(-ng // 4)


def decline_reason(qt):
    """Why the kernels cannot read this MLX-format weight, or None (also for the other formats)."""
    if not is_mlx(qt):
        return None
    if qt.I % UNIT:
        return f"fmt {qt.fmt} with I={qt.I} (needs a multiple of {UNIT})"
    if qt.fmt == 7 and _dtype_name(qt.scales) not in ("bfloat16", "uint16", "float16", "float32"):
        return f"fmt 7 scales of dtype {_dtype_name(qt.scales)}"
    return None


def _mx(a) -> mx.array:
    """An ``mx.array`` of a stored array; numpy bfloat16 (ml_dtypes) comes over as its uint16 bits."""
    if isinstance(a, mx.array):
        return a
    a = np.ascontiguousarray(np.asarray(a))
    if a.dtype.name == "bfloat16":
        return mx.array(a.view(np.uint16)).view(mx.bfloat16)
    return mx.array(a)


def _float_scales(a) -> mx.array:
    """Affine scales/biases as an mx float array in their stored dtype (numpy uint16 = bfloat16 bits)."""
    a = _mx(a)
    return a.view(mx.bfloat16) if a.dtype == mx.uint16 else a


def kernel_weights(qt) -> mx.array:
    """The stored uint32 words as a flat uint8 array (a view, no copy)."""
    return _mx(qt.packed).reshape(-1).view(mx.uint8)


def scale_words_per_row(qt) -> int:
    """32-bit words of :func:`kernel_scales` per row: the kernels' ``ng`` (so a row's scales start
    at ``row * ng`` words whatever the format, and stacked experts offset them in words)."""
    return kernel_scale_words(kernel_fmt(qt), qt.I, qt.gs)


def kernel_scales(qt) -> mx.array:
    """The kernels' scales input, float32-typed words (the kernels reinterpret them), ``[O, ng]``
    with ng = :func:`scale_words_per_row`: affine one word per group, scale in the low and bias
    in the high half (16-bit dtypes), or scale and bias as two float32 words; the fp modes the
    stored scale bytes, each row padded to whole words (a copy only when I / gs % 4 != 0)."""
    if qt.fmt == 7:
        s, b = _float_scales(qt.scales), _float_scales(qt.biases)
        if s.dtype == mx.float32:
            words = mx.stack([s.view(mx.uint32), b.view(mx.uint32)], axis=-1)
        else:
            words = s.view(mx.uint16).astype(mx.uint32) | (b.view(mx.uint16).astype(mx.uint32) << 16)
        return words.reshape(-1).view(mx.float32)
    raw = _mx(qt.scales).reshape(qt.O, -1)
    pad = 4 * scale_words_per_row(qt) - raw.shape[1]
    if pad:
        raw = mx.concatenate([raw, mx.zeros((qt.O, pad), mx.uint8)], axis=1)
    return raw.reshape(-1).view(mx.float32)


# ---------------------------------------------------------------------------------------
# Pure-MLX reference decode


@functools.lru_cache(maxsize=None)
def _straddle_index(I: int, bits: int):
    """Word index, next word index and shift of every code of a row (3-, 5-, 6-bit codes)."""
    off = np.arange(I, dtype=np.int64) * bits
    word = off >> 5
    shift = (off & 31).astype(np.uint32)
    n_words = I * bits // 32
    nxt = np.minimum(word + 1, n_words - 1)
    spill = (shift + bits > 32)
    return (mx.array(word.astype(np.int32)), mx.array(nxt.astype(np.int32)), mx.array(shift),
            mx.array(np.where(spill, 32 - shift, 0).astype(np.uint32)), mx.array(spill))


def codes(words: mx.array, bits: int, I: int) -> mx.array:
    """uint32 ``[R, I*bits/32]`` -> codes uint32 ``[R, I]`` (each row one LSB-first bit stream)."""
    R = words.shape[0]
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        per = 32 // bits
        shifts = mx.array([bits * k for k in range(per)], dtype=mx.uint32)
        return mx.bitwise_and(mx.right_shift(words[..., None], shifts), mask).reshape(R, I)
    word, nxt, shift, up, spill = _straddle_index(I, bits)
    lo = mx.right_shift(mx.take(words, word, axis=1), shift)
    hi = mx.where(spill, mx.left_shift(mx.take(words, nxt, axis=1), up), 0)
    return mx.bitwise_and(mx.bitwise_or(lo, hi.astype(mx.uint32)), mask)


_tables: dict = {}


def _table(name: str, values: np.ndarray) -> mx.array:
    t = _tables.get(name)
    if t is None:
        t = _tables[name] = mx.array(values)
    return t


def dequantize_rows(qt, r0: int, r1: int, *, stored_dtype: bool = False) -> mx.array:
    """float32 ``[r1 - r0, I]`` of rows ``r0 .. r1`` of an MLX-format QTensor.

    Affine ``q * s + b`` is computed in float32 from the widened scales and biases, as MLX's
    ``quantized_matmul`` (and our kernels) use them. ``stored_dtype``: in the scales' dtype,
    rounded twice as ``mx.dequantize`` returns it (what mlx-lm's QuantizedEmbedding looks up);
    with bfloat16 scales the two differ by up to a bfloat16 ulp of the weight."""
    m = MLX_FMTS[qt.fmt]
    R, ng, gs = r1 - r0, qt.I // qt.gs, qt.gs
    words = _mx(qt.packed).reshape(qt.O, -1)[r0:r1]
    c = codes(words, qt.bits, qt.I).reshape(R, ng, gs)
    if m.has_biases:
        s = _float_scales(qt.scales).reshape(qt.O, ng)[r0:r1, :, None]
        b = _float_scales(qt.biases).reshape(qt.O, ng)[r0:r1, :, None]
        if not stored_dtype:
            s, b = s.astype(mx.float32), b.astype(mx.float32)
        w = (c.astype(s.dtype) * s + b).astype(mx.float32)
    else:
        codes_f = _table(m.code_kind, CODE_TABLES[m.code_kind])
        scales_f = _table(m.scale_kind, SCALE_TABLES[m.scale_kind])
        sc = _mx(qt.scales).reshape(qt.O, ng)[r0:r1].astype(mx.uint32)
        w = mx.take(codes_f, c) * mx.take(scales_f, sc)[..., None]
    return w.reshape(R, qt.I)


# ---------------------------------------------------------------------------------------
# Row operations (kernels.take_rows / concat_rows / rows_of): weights, scales and biases are
# all [O, ...] arrays, so rows move together.


def _with_arrays(qt, packed, scales, biases, O: int, name: str):
    from ..formats.qtensor import QTensor

    return QTensor(packed, scales, qt.fmt, O, qt.I, qt.gs, name, bits=qt.bits, biases=biases)


def _rows_2d(a, O: int) -> mx.array:
    return _mx(a).reshape(O, -1)


def take_rows(qt, idx: mx.array):
    """``qt`` with its rows in the order ``idx`` (evaluated)."""
    out = take_rows_lazy(qt, idx)
    mx.eval(out.packed, out.scales, *(() if out.biases is None else (out.biases,)))
    return out


def rows(qt, r0: int, r1: int):
    """Rows ``r0:r1`` of ``qt`` (slices, no copy)."""
    biases = None if qt.biases is None else _rows_2d(qt.biases, qt.O)[r0:r1]
    return _with_arrays(qt, _rows_2d(qt.packed, qt.O)[r0:r1], _rows_2d(qt.scales, qt.O)[r0:r1], biases,
                        r1 - r0, qt.name)


def concat_rows(weights):
    """One QTensor holding the rows of ``weights`` in order, or None when their layouts differ."""
    first = weights[0]
    key = (kernel_fmt(first), first.I, first.gs)
    if any(not is_mlx(w) or (kernel_fmt(w), w.I, w.gs) != key for w in weights):
        return None
    packed = mx.concatenate([_rows_2d(w.packed, w.O) for w in weights])
    scales = mx.concatenate([_float_scales(w.scales).reshape(w.O, -1) if first.fmt == 7 else _rows_2d(w.scales, w.O)
                             for w in weights])
    biases = None if first.biases is None else mx.concatenate(
        [_float_scales(w.biases).reshape(w.O, -1) for w in weights])
    mx.eval(packed, scales, *(() if biases is None else (biases,)))
    return _with_arrays(first, packed, scales, biases, sum(w.O for w in weights), "+".join(w.name for w in weights))


def embedding_rows(qt, ids: mx.array) -> mx.array:
    """float32 rows ``ids`` (any shape) of an MLX-format table ``[V, D]``: only those rows are
    decoded, bit-equal to ``mx.dequantize`` as mlx-lm's QuantizedEmbedding looks them up.

    A decode step's single id runs as one compiled graph (kernels.compiled, kept on the table):
    the lookup and decode are a dozen ops (three row gathers, the bit unpacking, scale and bias)
    that would otherwise be built and launched one by one every token."""
    if ids.size != 1:
        return _embedding_rows(qt, ids)
    block = vars(qt).get("_embedding_block")
    if block is None:
        from . import compiled

        block = compiled.kept_block(qt, "_embedding_block", functools.partial(_embedding_rows, qt), "embedding")
    return block(ids)


def _embedding_rows(qt, ids: mx.array) -> mx.array:
    flat = ids.reshape(-1).astype(mx.int32)
    part = take_rows_lazy(qt, flat)
    return dequantize_rows(part, 0, part.O, stored_dtype=True).reshape(*ids.shape, qt.I)


def take_rows_lazy(qt, idx: mx.array):
    """Rows ``idx`` of ``qt`` (repeats allowed), not evaluated."""
    biases = None if qt.biases is None else _float_scales(qt.biases).reshape(qt.O, -1)[idx]
    scales = (_float_scales(qt.scales) if qt.fmt == 7 else _mx(qt.scales)).reshape(qt.O, -1)[idx]
    return _with_arrays(qt, _rows_2d(qt.packed, qt.O)[idx], scales, biases, int(idx.size), qt.name)

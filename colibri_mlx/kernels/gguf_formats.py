"""llama.cpp's GGUF types (fmt 11-28, formats/gguf_quant.py) in the hot paths.

* :func:`dequantize_rows`: the pure-MLX reference decode. It runs the decoders of
  formats/gguf_quant.py on MLX ops (bit shifts, masks and gathers on the grids as ``mx.array``),
  the same float32 operations in the same order as ggml, so on the CPU it is bit-equal to
  :func:`~colibri_mlx.formats.gguf_quant.dequantize_gguf` and to ``gguf.quants.dequantize``.
* Row operations (:func:`take_rows`, :func:`rows`, :func:`concat_rows`, :func:`embedding_rows`):
  a GGUF weight's rows are independent runs of whole blocks (``packed [O, row_bytes]``, no
  separate scales), so moving rows moves byte rows.
* :func:`decline_reason`: why the kernels cannot read a GGUF weight, None for the other formats.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..formats.gguf_quant import DECODERS, GGUF_FMTS, ArrayOps, is_gguf_fmt, row_nbytes

_consts: dict = {}


def _const(table: np.ndarray) -> mx.array:
    """A module-level numpy table of formats/gguf_quant.py as an ``mx.array``, made once."""
    hit = _consts.get(id(table))
    if hit is None:
        hit = _consts[id(table)] = (table, mx.array(table))   # keeps ``table`` alive: its id stays unique
    return hit[1]


MLX = ArrayOps(mx, _const)


def is_gguf(qt) -> bool:
    return is_gguf_fmt(qt.fmt)


def gguf_type(qt):
    return GGUF_FMTS[qt.fmt]


def row_bytes(qt) -> int:
    return row_nbytes(gguf_type(qt), qt.I)


def decline_reason(qt):
    """Why the kernels cannot read this GGUF weight, or None (also for the other formats): its
    bytes must be ``O`` rows of whole blocks."""
    if not is_gguf(qt):
        return None
    t = gguf_type(qt)
    if qt.I % t.block_size:
        return f"{t.name} with I={qt.I} (needs a multiple of {t.block_size})"
    if int(qt.packed.size) != qt.O * row_bytes(qt):
        return f"{t.name} {qt.name or 'weight'}: {int(qt.packed.size)} bytes for {qt.O} rows of {row_bytes(qt)}"
    return None


def _mx(a) -> mx.array:
    return a if isinstance(a, mx.array) else mx.array(np.ascontiguousarray(np.asarray(a)))


def _rows_2d(qt) -> mx.array:
    return _mx(qt.packed).reshape(qt.O, -1)


def _packed_rows(qt, idx) -> mx.array:
    """Byte rows ``idx`` (a slice or an index array) of ``qt``. Weights held in numpy (memory-mapped
    from the file) are indexed there first, so only those rows are read and copied."""
    if isinstance(qt.packed, mx.array):
        return qt.packed.reshape(qt.O, -1)[idx]
    if isinstance(idx, mx.array):
        idx = np.array(idx)
    return mx.array(np.ascontiguousarray(np.asarray(qt.packed).reshape(qt.O, -1)[idx]))


def kernel_weights(qt) -> mx.array:
    """The stored blocks as one flat uint8 array (a view, no copy)."""
    return _mx(qt.packed).reshape(-1)


def dequantize_rows(qt, r0: int, r1: int) -> mx.array:
    """float32 ``[r1 - r0, I]`` of rows ``r0 .. r1`` of a GGUF QTensor (MLX ops; on the CPU
    bit-equal to ggml's dequantization)."""
    t = gguf_type(qt)
    blocks = _packed_rows(qt, slice(r0, r1)).reshape(-1, t.type_size)
    return DECODERS[t.name].dequantize_blocks(blocks, MLX).reshape(r1 - r0, qt.I)


def _with_packed(qt, packed: mx.array, O: int, name: str):
    from ..formats.qtensor import QTensor

    return QTensor(packed, qt.scales, qt.fmt, O, qt.I, qt.gs, name, bits=qt.bits)


def take_rows_lazy(qt, idx: mx.array):
    """Rows ``idx`` of ``qt`` (repeats allowed), not evaluated."""
    return _with_packed(qt, _packed_rows(qt, idx), int(idx.size), qt.name)


def take_rows(qt, idx: mx.array):
    """``qt`` with its rows in the order ``idx`` (evaluated)."""
    out = take_rows_lazy(qt, idx)
    mx.eval(out.packed)
    return out


def rows(qt, r0: int, r1: int):
    """Rows ``r0:r1`` of ``qt`` (a slice, no copy)."""
    packed = qt.packed if isinstance(qt.packed, mx.array) else np.asarray(qt.packed)
    return _with_packed(qt, packed.reshape(qt.O, -1)[r0:r1], r1 - r0, qt.name)


def concat_rows(weights):
    """One QTensor holding the rows of ``weights`` in order, or None unless all are the same GGUF
    type with the same row length."""
    first = weights[0]
    if any(not is_gguf(w) or (w.fmt, w.I) != (first.fmt, first.I) for w in weights):
        return None
    packed = mx.concatenate([_rows_2d(w) for w in weights])
    mx.eval(packed)
    return _with_packed(first, packed, sum(w.O for w in weights), "+".join(w.name for w in weights))


def embedding_rows(qt, ids: mx.array) -> mx.array:
    """float32 rows ``ids`` (any shape) of a GGUF table ``[V, D]``: only those rows are decoded."""
    part = take_rows_lazy(qt, ids.reshape(-1).astype(mx.int32))
    return dequantize_rows(part, 0, part.O).reshape(*ids.shape, qt.I)

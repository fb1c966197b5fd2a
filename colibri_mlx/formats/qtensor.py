"""QTensor: one quantized weight matrix exactly as the container stores it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class QTensor:
    """Raw container bytes of a quantized ``W[O, I]`` plus what is needed to read them.

    ``packed`` is the 1-D uint8 weight stream and ``scales`` the 1-D float32 ``.qs`` array
    (a 1-element tag for fmt 6). Both may be numpy arrays (memory-mapped views from the
    container) or ``mx.array`` (after :meth:`to_mlx`). fmt 6 holds the *rotated* matrix
    ``W @ Q``: inputs must be rotated before multiplying (docs/format.md#rotation).

    fmt 7-10 are MLX's quantization modes as mlx-lm checkpoints store them
    (:mod:`colibri_mlx.formats.mlx_quant`): ``packed`` is uint32 ``[O, I*bits/32]``, ``scales``
    ``[O, I/gs]`` in the stored dtype, ``biases`` (fmt 7 only) like ``scales``.

    fmt 11-28 are llama.cpp's GGUF types (:mod:`colibri_mlx.formats.gguf_quant`): ``packed`` is
    uint8 ``[O, I/gs * type_size]`` (the ggml blocks as stored), ``scales`` empty, ``gs`` the block size.
    """

    packed: Any
    scales: Any
    fmt: int
    O: int
    I: int
    gs: Optional[int] = None
    name: str = ""
    streamed: bool = False   # an expert read on demand by ExpertStore (never cached dequantized)
    bits: Optional[int] = None   # code width of the MLX formats fmt 7-10 (formats/mlx_quant.py)
    biases: Any = None           # fmt 7 (MLX affine): per-group biases, like ``scales``

    @property
    def shape(self) -> tuple[int, int]:
        return (self.O, self.I)

    @property
    def nbytes(self) -> int:
        n = int(self.packed.nbytes) + int(self.scales.nbytes)
        return n + (int(self.biases.nbytes) if self.biases is not None else 0)

    def dequantize(self):
        """float32 numpy ``[O, I]`` (rotated basis for fmt 6)."""
        import numpy as np

        from . import decode
        from .gguf_quant import dequantize_gguf, is_gguf_fmt

        if is_gguf_fmt(self.fmt):
            return dequantize_gguf(self.fmt, np.asarray(self.packed).reshape(self.O, -1))
        if self.fmt >= 7:
            from .mlx_quant import decode_mlx

            return decode_mlx(self)
        return decode(self.fmt, np.asarray(self.packed), np.asarray(self.scales), self.O, self.I, self.gs)

    def to_mlx(self) -> "QTensor":
        import mlx.core as mx
        import numpy as np

        if isinstance(self.packed, mx.array):
            return self
        if self.fmt >= 7:
            def conv(a):
                if a is None or isinstance(a, mx.array):
                    return a
                a = np.asarray(a)
                if a.dtype.name == "bfloat16":   # ml_dtypes: over as its bits, back to mx.bfloat16
                    return mx.array(a.view(np.uint16)).view(mx.bfloat16)
                return mx.array(a)
            return QTensor(conv(self.packed), conv(self.scales), self.fmt, self.O, self.I, self.gs,
                           self.name, self.streamed, self.bits, conv(self.biases))
        return QTensor(mx.array(np.asarray(self.packed)), mx.array(np.asarray(self.scales)),
                       self.fmt, self.O, self.I, self.gs, self.name, self.streamed)

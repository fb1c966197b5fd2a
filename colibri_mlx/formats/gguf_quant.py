"""llama.cpp's GGUF tensor types as QTensor fmt 11-28.

One table row per ggml type (docs/format.md#gguf-formats). A GGUF weight ``W[O, I]`` stores each
row as ``I / block_size`` consecutive blocks of ``type_size`` bytes, exactly as ggml lays them out;
a QTensor of a GGUF fmt keeps those bytes untouched: ``packed`` is uint8 ``[O, I / block_size *
type_size]``, ``scales`` is an empty float32 array (every scale lives inside the blocks), ``gs`` is
the block size. Blocks are not aligned beyond 2 bytes (Q8_0 is 34 bytes), so kernels read them
byte- or half-wise.

F32, F16 and BF16 tensors are plain float weights, not QTensors.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GgufType:
    fmt: int          # QTensor fmt
    name: str         # ggml's name (gguf.GGMLQuantizationType member)
    ggml_type: int    # ggml's type id as stored in the file
    block_size: int   # weights per block
    type_size: int    # bytes per block


GGUF_TYPES = {
    t.name: t
    for t in (
        GgufType(11, "Q8_0", 8, 32, 34),
        GgufType(12, "Q4_0", 2, 32, 18),
        GgufType(13, "Q5_0", 6, 32, 22),
        GgufType(14, "Q5_1", 7, 32, 24),
        GgufType(15, "Q2_K", 10, 256, 84),
        GgufType(16, "Q3_K", 11, 256, 110),
        GgufType(17, "Q4_K", 12, 256, 144),
        GgufType(18, "Q5_K", 13, 256, 176),
        GgufType(19, "Q6_K", 14, 256, 210),
        GgufType(20, "IQ4_NL", 20, 32, 18),
        GgufType(21, "IQ4_XS", 23, 256, 136),
        GgufType(22, "IQ3_XXS", 18, 256, 98),
        GgufType(23, "IQ3_S", 21, 256, 110),
        GgufType(24, "IQ2_XXS", 16, 256, 66),
        GgufType(25, "IQ2_XS", 17, 256, 74),
        GgufType(26, "IQ2_S", 22, 256, 82),
        GgufType(27, "IQ1_S", 19, 256, 50),
        GgufType(28, "IQ1_M", 29, 256, 56),
    )
}
GGUF_FMTS = {t.fmt: t for t in GGUF_TYPES.values()}
GGUF_BY_GGML_TYPE = {t.ggml_type: t for t in GGUF_TYPES.values()}
GGUF_FMT_NAMES = {t.fmt: f"gguf-{t.name.lower()}" for t in GGUF_TYPES.values()}
# Unquantized ggml types: name -> (ggml type id, bytes per weight).
GGUF_FLOAT_TYPES = {"F32": (0, 4), "F16": (1, 2), "BF16": (30, 2)}


def is_gguf_fmt(fmt: int) -> bool:
    return fmt in GGUF_FMTS


def row_nbytes(gtype: GgufType, I: int) -> int:
    """Bytes of one row of ``I`` weights; ``I`` must be a whole number of blocks."""
    if I % gtype.block_size:
        raise ValueError(f"{gtype.name}: a row of {I} weights is not a whole number of "
                         f"{gtype.block_size}-weight blocks")
    return I // gtype.block_size * gtype.type_size

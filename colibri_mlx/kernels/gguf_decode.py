"""llama.cpp's GGUF block formats (QTensor fmt 11-28) in the GPU kernels.

The kernels read a GGUF QTensor's ``packed`` bytes as they are (raw ggml blocks, rows of
``I / block_size * type_size`` bytes) through the decoders of ``metal_kernels/gguf_decode.h`` and
its CUDA twin; the FMT template code is the QTensor fmt. :data:`KERNEL_FMTS` names the types with a
decoder and their unit (weights a kernel thread decodes as one piece). The IQ types' grids come
in through the kernels' lookup-table input (:func:`lookup_words`), laid out as gguf_decode.h says.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from ..formats.gguf_quant import GGUF_FMTS, is_gguf_fmt
from . import gguf_tables

# fmt -> weights per kernel unit (gguf_decode.h qd_gg_wpu).
KERNEL_FMTS = {11: 32, 17: 64, 19: 32, 21: 32, 24: 32}

# Word offsets of the tables in lookup_words() (gguf_decode.h QD_GG_*).
IQ2XXS_OFFSET = 256
IQ4NL_OFFSET = 768
LOOKUP_WORDS = 784


def table(name: str) -> np.ndarray:
    """One of ggml's tables (kernels/gguf_tables.py) as a uint8 / uint32 / uint64 array (int8 for
    kvalues_iq4nl)."""
    width = gguf_tables.WIDTH[name]
    raw = bytes.fromhex("".join(gguf_tables.HEX[name]))
    dtype = {1: np.int8 if name.startswith("kvalues") else np.uint8, 4: "<u4", 8: "<u8"}[width]
    return np.frombuffer(raw, dtype=dtype).copy()


@functools.lru_cache(maxsize=None)
def lookup_words() -> np.ndarray:
    """The kernels' lookup-table input, uint32: the fmt 6 / IQ3_XXS grid (256 words), iq2xxs_grid
    (two words an entry), kvalues_iq4nl as float32 bits."""
    out = np.zeros(LOOKUP_WORDS, np.uint32)
    out[:256] = table("iq3xxs_grid")
    out[IQ2XXS_OFFSET:IQ2XXS_OFFSET + 512] = table("iq2xxs_grid").view("<u4")
    out[IQ4NL_OFFSET:IQ4NL_OFFSET + 16] = table("kvalues_iq4nl").astype(np.float32).view(np.uint32)
    return out


def is_gguf(qt) -> bool:
    return is_gguf_fmt(qt.fmt)


def row_bytes(qt) -> int:
    return kernel_row_bytes(qt.fmt, qt.I)


def kernel_row_bytes(fmt: int, I: int) -> int:
    t = GGUF_FMTS[fmt]
    return I // t.block_size * t.type_size


def decline_reason(qt) -> Optional[str]:
    """Why the kernels cannot read this GGUF weight, or None (also for every other format)."""
    if not is_gguf(qt):
        return None
    t = GGUF_FMTS[qt.fmt]
    if qt.fmt not in KERNEL_FMTS:
        return f"GGUF {t.name} (fmt {qt.fmt}) has no kernel decoder"
    if qt.I % t.block_size:
        return f"GGUF {t.name} with I={qt.I} (needs a multiple of {t.block_size})"
    return None

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

# fmt -> weights per kernel unit (gguf_decode.h qd_gg_wpu): every GGUF type has a decoder.
KERNEL_FMTS = {fmt: (64 if fmt == 17 else 32) for fmt in GGUF_FMTS}

# Word offsets of the tables in lookup_words() (gguf_decode.h QD_GG_*): name -> (offset, words).
LOOKUP_LAYOUT = {"iq3xxs_grid": (0, 256), "iq2xxs_grid": (256, 512), "kvalues_iq4nl": (768, 16),
                 "iq3s_grid": (784, 512), "iq2xs_grid": (1296, 1024), "iq2s_grid": (2320, 2048),
                 "iq1s_grid": (4368, 4096)}
LOOKUP_WORDS = 8464


def table(name: str) -> np.ndarray:
    """One of ggml's tables (kernels/gguf_tables.py) as a uint8 / uint32 / uint64 array (int8 for
    kvalues_iq4nl)."""
    width = gguf_tables.WIDTH[name]
    raw = bytes.fromhex("".join(gguf_tables.HEX[name]))
    dtype = {1: np.int8 if name.startswith("kvalues") else np.uint8, 4: "<u4", 8: "<u8"}[width]
    return np.frombuffer(raw, dtype=dtype).copy()


@functools.lru_cache(maxsize=None)
def lookup_words() -> np.ndarray:
    """The kernels' lookup-table input, uint32, laid out as LOOKUP_LAYOUT: the 4-byte grids one word
    an entry, the 8-byte grids two, kvalues_iq4nl as float32 bits."""
    out = np.zeros(LOOKUP_WORDS, np.uint32)
    for name, (offset, n) in LOOKUP_LAYOUT.items():
        t = table(name)
        words = t.astype(np.float32).view(np.uint32) if name == "kvalues_iq4nl" else t.view("<u4")
        assert words.size == n, name
        out[offset:offset + n] = words
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

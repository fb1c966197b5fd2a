"""llama.cpp's GGUF block formats (QTensor fmt 11-28) in the GPU kernels.

The kernels read a GGUF QTensor's ``packed`` bytes as they are (raw ggml blocks, rows of
``I / block_size * type_size`` bytes) through the decoders of ``metal_kernels/gguf_decode.h`` and
its CUDA twin; the FMT template code is the QTensor fmt. :data:`KERNEL_FMTS` gives each type's unit
(the weights a kernel thread decodes as one piece). The IQ types' grids and IQ4's values come in
through the kernels' lookup-table input (:func:`lookup_words`), laid out as :data:`LOOKUP_LAYOUT`
(gguf_decode.h's ``QD_GG_*`` offsets). Which GGUF weights the kernels take:
:func:`colibri_mlx.kernels.gguf_formats.decline_reason`.
"""

from __future__ import annotations

import functools

import numpy as np

from ..formats import gguf_grids
from ..formats.gguf_quant import GGUF_FMTS, kvalues_iq4nl

# fmt -> weights per kernel unit (gguf_decode.h qd_gg_wpu): every GGUF type has a decoder.
KERNEL_FMTS = {fmt: (64 if fmt == 17 else 32) for fmt in GGUF_FMTS}

# name -> (word offset, words) in lookup_words(): the 4-byte grids one word an entry, the 8-byte
# grids two, kvalues_iq4nl as float32. iq3xxs_grid at 0 is also the fmt 6 grid.
LOOKUP_LAYOUT = {"iq3xxs_grid": (0, 256), "iq2xxs_grid": (256, 512), "kvalues_iq4nl": (768, 16),
                 "iq3s_grid": (784, 512), "iq2xs_grid": (1296, 1024), "iq2s_grid": (2320, 2048),
                 "iq1s_grid": (4368, 4096)}
LOOKUP_WORDS = 8464


@functools.lru_cache(maxsize=None)
def lookup_words() -> np.ndarray:
    """The kernels' lookup-table input, uint32 [LOOKUP_WORDS] (formats/gguf_grids.py's byte tables
    as little-endian words)."""
    out = np.zeros(LOOKUP_WORDS, np.uint32)
    for name, (offset, n) in LOOKUP_LAYOUT.items():
        if name == "kvalues_iq4nl":
            words = kvalues_iq4nl.astype(np.float32).view(np.uint32)
        else:
            words = np.ascontiguousarray(getattr(gguf_grids, name)).view(np.uint8).reshape(-1).view("<u4")
        if words.size != n:
            raise AssertionError(f"{name}: {words.size} words, the kernels expect {n}")
        out[offset:offset + n] = words
    return out

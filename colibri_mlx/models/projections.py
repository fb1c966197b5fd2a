"""Row orders the kernels want the attention projections in, applied once at load.

q comes out of its projection as every head's nope part, then every head's rope part (each one
contiguous slice), and the rope dims of q and of kv_a's key de-interleaved: DeepSeek's
interleaved pairs ``(2j, 2j+1)`` become ``(j, j + dim/2)``, the layout transformers writes out
(``apply_rotary_pos_emb_interleave``), so the half-split rotation applies and caches and dot
products are unchanged.
"""

from __future__ import annotations

import numpy as np


def rope_order(rope_dim: int, interleaved: bool) -> np.ndarray:
    r = np.arange(rope_dim)
    return np.concatenate([r[0::2], r[1::2]]) if interleaved else r


def query_rows(n_heads: int, head_dim: int, nope: int, rope_dim: int, interleaved: bool) -> np.ndarray:
    """q rows: head-major ``[h][nope | rope]`` -> ``[every head's nope][every head's rope]``."""
    heads = np.arange(n_heads)[:, None] * head_dim
    nope_rows = (heads + np.arange(nope)).reshape(-1)
    rope_rows = (heads + nope + rope_order(rope_dim, interleaved)).reshape(-1)
    return np.concatenate([nope_rows, rope_rows])


def kv_a_rows(kv_lora_rank: int, rope_dim: int, interleaved: bool) -> np.ndarray:
    """kv_a_proj_with_mqa rows: the latent as is, then the rope key de-interleaved."""
    return np.concatenate([np.arange(kv_lora_rank), kv_lora_rank + rope_order(rope_dim, interleaved)])

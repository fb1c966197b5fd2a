"""GGUF test data: llama.cpp-quantized fixtures (tests/data/gguf_quants.npz, made by
scripts/gguf/make_quant_fixtures.py) and random GGUF weights with finite scales of a chosen size.

``random_gguf_qtensor(type, O, I, seed, rms)``: random blocks (every code, grid index and sign
pattern valid) whose float16 scale fields are set so the weight's RMS is about ``rms``: every
type decodes linearly in them (``d`` and ``dmin`` together), so the scales are set to 1, the
weight decoded, and the scales set to ``rms / rms_at_1``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from colibri_mlx.formats.gguf_quant import GGUF_TYPES, dequantize_gguf, qtensor_from_gguf

FIXTURES = Path(__file__).parent / "data" / "gguf_quants.npz"

# Byte offsets of the float16 scale fields in a block (IQ1_M holds its scale in the top nibbles
# of its four 16-bit scale words, bytes 48-55).
FP16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ3_XXS": (0,),
    "IQ3_S": (0,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ1_S": (0,), "IQ1_M": (),
}


def assert_bits_equal(mine, ref):
    """float32 arrays equal bit for bit (any NaN matches any NaN)."""
    mine, ref = np.asarray(mine), np.asarray(ref)
    assert mine.dtype == np.float32 and ref.dtype == np.float32 and mine.shape == ref.shape
    same = (mine.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(mine) & np.isnan(ref))
    assert same.all(), f"{(~same).sum()} of {same.size} values differ, first at {np.argwhere(~same)[0]}"


def fixtures() -> dict:
    with np.load(FIXTURES) as f:
        return {k: f[k] for k in f.files}


def fixture_keys() -> list:
    with np.load(FIXTURES) as f:
        return [k for k in f.files if k not in ("x", "imatrix")]


def set_half(blocks: np.ndarray, off: int, values) -> None:
    """Set the fp16 field at byte ``off`` of every block ``blocks [..., type_size]`` to ``values``
    (a scalar or one value per block)."""
    bits = np.broadcast_to(np.asarray(values, np.float16).astype("<f2"), blocks.shape[:-1])
    blocks[..., off:off + 2] = np.ascontiguousarray(bits)[..., None].view(np.uint8)


def set_iq1m_scale(blocks: np.ndarray, values) -> None:
    """Set IQ1_M's block scale (nibble k of its fp16 bits in the top nibble of scale word k,
    bytes 48-55) to ``values`` (a scalar or one value per block)."""
    bits = np.broadcast_to(np.asarray(values, np.float16).view(np.uint16), blocks.shape[:-1])
    words = blocks[..., 48:56].copy().view("<u2")
    for k in range(4):
        words[..., k] = (words[..., k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
    blocks[..., 48:56] = words.view(np.uint8)


def _set_scales(name: str, blocks: np.ndarray, value: float) -> None:
    if name == "IQ1_M":
        set_iq1m_scale(blocks, value)
    for off in FP16_FIELDS[name]:
        set_half(blocks, off, value)


def random_gguf_raw(name: str, O: int, I: int, seed: int = 0, rms: float = 0.05) -> np.ndarray:
    """uint8 ``[O, row_bytes]`` of random ``name`` blocks with weights of RMS about ``rms``."""
    t = GGUF_TYPES[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (O, I // t.block_size * t.type_size), dtype=np.uint8)
    blocks = raw.reshape(O, -1, t.type_size)
    _set_scales(name, blocks, 1.0)
    at_1 = float(np.sqrt(np.mean(dequantize_gguf(t, raw).astype(np.float64) ** 2)))
    _set_scales(name, blocks, rms / at_1)
    return raw


def random_gguf_qtensor(name: str, O: int, I: int, seed: int = 0, rms: float = 0.05, tensor: str | None = None):
    return qtensor_from_gguf(tensor or f"test.{name.lower()}", name, random_gguf_raw(name, O, I, seed, rms), (O, I))

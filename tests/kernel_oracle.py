"""Test helpers for the kernel tests: random QTensors and a float64 numpy oracle.

Weights are random *bytes* (every code of every format occurs, including int8 -128 and the
fmt 5 code -4 the encoders never emit) with random scales, so a test exercises the decoder on
the whole byte space, not only on what an encoder produces.

Tolerance: the kernels and the reference accumulate in float32. Each product x_i * w_i is
exact to 2^-24 relative, and a float32 sum of n terms errs by at most ~n * 2^-24 * sum|terms|
(pairwise/blocked orders do far better). We allow |y - y64| <= 1e-4 * sum_i |x_i w_i|:
n * 6e-8 stays under 1e-4 for n <= ~1700 worst case and in practice (random-sign rounding,
error ~ sqrt(n) * 2^-24) up to far larger rows. Outputs stored in float16/bfloat16 add their own
rounding: 2^-11 / 2^-8 of |y| <= sum|x w|.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from colibri_mlx.formats import QTensor, decode, scale_nbytes, weight_nbytes

FMT6_BLOCK_BYTES = 98
REL_TOL = {mx.float32: 1e-4, mx.float16: 1e-4 + 2.0**-11, mx.bfloat16: 1e-4 + 2.0**-8}


def random_qtensor(fmt: int, O: int, I: int, gs=None, seed: int = 0) -> QTensor:
    rng = np.random.default_rng(seed)
    gs = gs if fmt == 4 else None
    nb = weight_nbytes(fmt, O, I, gs)
    packed = rng.integers(0, 256, size=nb, dtype=np.uint8)
    ns = scale_nbytes(fmt, O, I, gs) // 4
    if fmt == 6:
        blocks = packed.reshape(O, -1, FMT6_BLOCK_BYTES)
        d = (rng.uniform(0.002, 0.05, size=blocks.shape[:2]) * rng.choice([-1, 1], size=blocks.shape[:2]))
        blocks[..., 96:98] = d.astype("<f2").view(np.uint8).reshape(*blocks.shape[:2], 2)
        scales = np.array([6.0], np.float32)
    else:
        scales = (rng.uniform(0.5, 2.0, size=ns) * rng.choice([-1, 1], size=ns) * 0.01).astype(np.float32)
    return QTensor(packed, scales, fmt, O, I, gs, name=f"test.fmt{fmt}")


def random_mlx_qtensor(mode: str, bits: int, gs: int, O: int, I: int, scale_dtype=mx.bfloat16,
                       seed: int = 0) -> QTensor:
    """An MLX-format QTensor (fmt 7-10) from ``mx.quantize`` of random weights in ``scale_dtype``."""
    from colibri_mlx.formats import qtensor_from_mlx

    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((O, I)).astype(np.float32) * 0.05).astype(scale_dtype)
    parts = mx.quantize(w, group_size=gs, bits=bits, mode=mode)
    return qtensor_from_mlx(parts[0], parts[1], parts[2] if len(parts) > 2 else None, mode=mode, bits=bits,
                            group_size=gs, name=f"test.{mode}{bits}g{gs}")


# One of each kernel FMT family of the MLX formats (kernels/mlx_formats.py): every affine bits
# with one of the scale dtypes, every fp mode.
MLX_KERNEL_CASES = [("affine", 4, 64, mx.bfloat16), ("affine", 3, 32, mx.float16), ("affine", 5, 128, mx.bfloat16),
                    ("affine", 6, 64, mx.float32), ("affine", 2, 32, mx.bfloat16), ("affine", 8, 128, mx.float16),
                    ("mxfp4", 4, 32, mx.bfloat16), ("nvfp4", 4, 16, mx.bfloat16), ("mxfp8", 8, 32, mx.bfloat16)]


def random_x(S: int, I: int, dtype=mx.float32, seed: int = 1) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal((S, I)).astype(np.float32)).astype(dtype)


# ---------------------------------------------------------------------------------------
# float64 oracle


def _iq3_grid_bytes() -> np.ndarray:
    """The fmt 6 grid from gguf (an independent copy of GGML's iq3xxs_grid), [256, 4]."""
    try:
        from gguf.quants import IQ3_XXS
    except ImportError:  # the GPU machine has no gguf: fall back to the package's copy
        from colibri_mlx.formats.e8 import GRID

        return np.asarray(GRID).reshape(256, 4).astype(np.float64)
    IQ3_XXS.init_grid()
    return np.asarray(IQ3_XXS.grid).reshape(256, 4).astype(np.float64)


def decode_e8_f64(packed: np.ndarray, O: int, I: int) -> np.ndarray:
    """docs/format.md#fmt-6-e8-iq3-lattice written out per field in float64 (loops over the 8 sub-blocks only)."""
    grid = _iq3_grid_bytes()
    blk = packed.reshape(O, -1, FMT6_BLOCK_BYTES)
    nb = blk.shape[1]
    d = blk[..., 96:98].copy().view("<f2")[..., 0].astype(np.float64)
    out = np.empty((O, nb, 256), np.float64)
    for ib in range(8):
        word = blk[..., 64 + 4 * ib: 68 + 4 * ib].copy().view("<u4")[..., 0].astype(np.uint64)
        db = d * (0.5 + (word >> 28).astype(np.float64)) * 0.5
        for lane in range(4):
            seven = (word >> np.uint64(7 * lane)) & np.uint64(0x7F)
            bits = [(seven >> np.uint64(j)) & np.uint64(1) for j in range(7)]
            bits.append(sum(bits) & np.uint64(1))
            for j in range(8):
                g = grid[blk[..., 8 * ib + 2 * lane + j // 4]][..., j % 4] * 0.5
                sign = np.where(bits[j] == 1, -1.0, 1.0)
                out[..., 32 * ib + 8 * lane + j] = g * db * sign
    return out.reshape(O, nb * 256)[:, :I]


def dequant_f64(qt: QTensor) -> np.ndarray:
    if 7 <= qt.fmt <= 10:   # MLX formats: q * s + b exactly, as the kernels compute it
        from colibri_mlx.formats.mlx_quant import decode_mlx

        return decode_mlx(qt, exact=True)
    from colibri_mlx.formats.gguf_quant import is_gguf_fmt

    if is_gguf_fmt(qt.fmt):
        return dequant_gguf_f64(qt)
    packed = np.asarray(qt.packed)
    if qt.fmt == 6:
        return decode_e8_f64(packed, qt.O, qt.I)
    return decode(qt.fmt, packed, np.asarray(qt.scales), qt.O, qt.I, qt.gs).astype(np.float64)


def oracle(x: mx.array, qt: QTensor) -> tuple[np.ndarray, np.ndarray]:
    """(y64, sum|x w|) in float64 from the x values actually given (after their rounding)."""
    x64 = np.asarray(x.astype(mx.float32)).astype(np.float64)
    w64 = dequant_f64(qt)
    return x64 @ w64.T, np.abs(x64) @ np.abs(w64).T


def assert_close(y: mx.array, x: mx.array, qt: QTensor, label: str = "") -> float:
    """Check every output against the float64 oracle; returns the worst relative error."""
    y64, mag = oracle(x, qt)
    got = np.asarray(y.astype(mx.float32)).astype(np.float64)
    assert got.shape == y64.shape, f"{label}: shape {got.shape} != {y64.shape}"
    assert np.all(np.isfinite(got)), f"{label}: non-finite output (unwritten or poisoned?)"
    rel = np.abs(got - y64) / (mag + 1e-30)
    worst = float(rel.max())
    assert worst <= REL_TOL[y.dtype], (
        f"{label}: |Δ|/Σ|xw| = {worst:.3g} > {REL_TOL[y.dtype]:.3g} at {np.unravel_index(rel.argmax(), rel.shape)}")
    return worst


# ---------------------------------------------------------------------------------------
# GGUF block formats (fmt 11-28)

def random_gguf_qtensor(name: str, O: int, I: int, seed: int = 0) -> QTensor:
    """A GGUF QTensor of random blocks: random bytes (every code, sub-scale and sign pattern occurs),
    the fp16 block scales set to finite values of either sign in [0.002, 0.05]."""
    from colibri_mlx.formats.gguf_quant import GGUF_TYPES, row_nbytes
    from helpers_gguf import FP16_FIELDS, set_half, set_iq1m_scale

    t = GGUF_TYPES[name]
    rng = np.random.default_rng(seed)
    rb = row_nbytes(t, I)
    packed = rng.integers(0, 256, size=(O, rb), dtype=np.uint8)
    blocks = packed.reshape(O, -1, t.type_size)

    def random_scales():
        return rng.uniform(0.002, 0.05, size=blocks.shape[:2]) * rng.choice([-1, 1], size=blocks.shape[:2])

    for off in FP16_FIELDS[name]:
        set_half(blocks, off, random_scales())
    if name == "IQ1_M":
        set_iq1m_scale(blocks, random_scales())
    return QTensor(packed, np.zeros(0, np.float32), t.fmt, O, I, t.block_size, name=f"test.{name.lower()}")


def dequant_gguf_f64(qt: QTensor) -> np.ndarray:
    """gguf-py's dequantization (bit-exact to ggml's) of a GGUF QTensor, float64 ``[O, I]``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from colibri_mlx.formats.gguf_quant import GGUF_FMTS

    qtype = GGMLQuantizationType[GGUF_FMTS[qt.fmt].name]
    packed = np.asarray(qt.packed).reshape(qt.O, -1)
    return dequantize(packed, qtype).astype(np.float64).reshape(qt.O, qt.I)

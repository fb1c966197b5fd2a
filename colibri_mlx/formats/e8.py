"""fmt 6 "e8-iq3-lattice": IQ3_XXS-style super-blocks over Walsh–Hadamard-rotated rows.

Layout, decoding, rotation and encoder search follow upstream ``c/quant.h`` and
``c/tools/iq3_pack.py`` (layout: docs/format.md#fmt-6-e8-iq3-lattice). Stored weights are the
rotated rows ``W @ Q``; inputs go through :func:`rotate` before the matmul. The encoder
reproduces ``iq3_pack.encode`` byte for byte, including its float32 arithmetic (see
:func:`_nearest_grid` for how near-ties are settled).

Encoding and rotation run in a small C core (``_e8_encode.c``, compiled on first use into
``$COLIBRI_CACHE_DIR`` or ``~/.cache/colibri_mlx`` and loaded with ctypes; ~0.6 CPU-s per
2048 x 6144 matrix on 2 cores) when a C compiler is available; the numpy code here is the
reference and the fallback (same bytes, ~20x slower; a one-time notice on stderr says so).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .codecs import FormatError

QK = 256            # weights per super-block
SUB = 32            # weights per sub-block (one u32 of signs + 4-bit scale code)
BLOCK_BYTES = 98    # 64 grid indices + 8 u32 sign/scale words + fp16 d
TAG = 6.0           # the `.qs` value the converter writes; only its 4-byte size matters
MAX_ROT_BLOCK = 32768
_N_CODES = 16

# GGML iq3xxs_grid (= gguf's IQ3_XXS grid) as little-endian u32 words: byte 0 is element 0.
_GRID_WORDS = """
    0x04040404 0x04040414 0x04040424 0x04040c0c 0x04040c1c 0x04040c3e 0x04041404 0x04041414
    0x04041c0c 0x04042414 0x04043e1c 0x04043e2c 0x040c040c 0x040c041c 0x040c0c04 0x040c0c14
    0x040c140c 0x040c142c 0x040c1c04 0x040c1c14 0x040c240c 0x040c2c24 0x040c3e04 0x04140404
    0x04140414 0x04140424 0x04140c0c 0x04141404 0x04141414 0x04141c0c 0x04141c1c 0x04141c3e
    0x04142c0c 0x04142c3e 0x04143e2c 0x041c040c 0x041c043e 0x041c0c04 0x041c0c14 0x041c142c
    0x041c3e04 0x04240c1c 0x04241c3e 0x04242424 0x04242c3e 0x04243e1c 0x04243e2c 0x042c040c
    0x042c043e 0x042c1c14 0x042c2c14 0x04341c2c 0x04343424 0x043e0c04 0x043e0c24 0x043e0c34
    0x043e241c 0x043e340c 0x0c04040c 0x0c04041c 0x0c040c04 0x0c040c14 0x0c04140c 0x0c04141c
    0x0c041c04 0x0c041c14 0x0c041c24 0x0c04243e 0x0c042c04 0x0c0c0404 0x0c0c0414 0x0c0c0c0c
    0x0c0c1404 0x0c0c1414 0x0c14040c 0x0c14041c 0x0c140c04 0x0c140c14 0x0c14140c 0x0c141c04
    0x0c143e14 0x0c1c0404 0x0c1c0414 0x0c1c1404 0x0c1c1c0c 0x0c1c2434 0x0c1c3434 0x0c24040c
    0x0c24042c 0x0c242c04 0x0c2c1404 0x0c2c1424 0x0c2c2434 0x0c2c3e0c 0x0c34042c 0x0c3e1414
    0x0c3e2404 0x14040404 0x14040414 0x14040c0c 0x14040c1c 0x14041404 0x14041414 0x14041434
    0x14041c0c 0x14042414 0x140c040c 0x140c041c 0x140c042c 0x140c0c04 0x140c0c14 0x140c140c
    0x140c1c04 0x140c341c 0x140c343e 0x140c3e04 0x14140404 0x14140414 0x14140c0c 0x14140c3e
    0x14141404 0x14141414 0x14141c3e 0x14142404 0x14142c2c 0x141c040c 0x141c0c04 0x141c0c24
    0x141c3e04 0x141c3e24 0x14241c2c 0x14242c1c 0x142c041c 0x142c143e 0x142c240c 0x142c3e24
    0x143e040c 0x143e041c 0x143e0c34 0x143e242c 0x1c04040c 0x1c040c04 0x1c040c14 0x1c04140c
    0x1c04141c 0x1c042c04 0x1c04342c 0x1c043e14 0x1c0c0404 0x1c0c0414 0x1c0c1404 0x1c0c1c0c
    0x1c0c2424 0x1c0c2434 0x1c14040c 0x1c14041c 0x1c140c04 0x1c14142c 0x1c142c14 0x1c143e14
    0x1c1c0c0c 0x1c1c1c1c 0x1c241c04 0x1c24243e 0x1c243e14 0x1c2c0404 0x1c2c0434 0x1c2c1414
    0x1c2c2c2c 0x1c340c24 0x1c341c34 0x1c34341c 0x1c3e1c1c 0x1c3e3404 0x24040424 0x24040c3e
    0x24041c2c 0x24041c3e 0x24042c1c 0x24042c3e 0x240c3e24 0x24141404 0x24141c3e 0x24142404
    0x24143404 0x24143434 0x241c043e 0x241c242c 0x24240424 0x24242c0c 0x24243424 0x242c142c
    0x242c241c 0x242c3e04 0x243e042c 0x243e0c04 0x243e0c14 0x243e1c04 0x2c040c14 0x2c04240c
    0x2c043e04 0x2c0c0404 0x2c0c0434 0x2c0c1434 0x2c0c2c2c 0x2c140c24 0x2c141c14 0x2c143e14
    0x2c1c0414 0x2c1c2c1c 0x2c240c04 0x2c24141c 0x2c24143e 0x2c243e14 0x2c2c0414 0x2c2c1c0c
    0x2c342c04 0x2c3e1424 0x2c3e2414 0x34041424 0x34042424 0x34042434 0x34043424 0x340c140c
    0x340c340c 0x34140c3e 0x34143424 0x341c1c04 0x341c1c34 0x34242424 0x342c042c 0x342c2c14
    0x34341c1c 0x343e041c 0x343e140c 0x3e04041c 0x3e04042c 0x3e04043e 0x3e040c04 0x3e041c14
    0x3e042c14 0x3e0c1434 0x3e0c2404 0x3e140c14 0x3e14242c 0x3e142c14 0x3e1c0404 0x3e1c0c2c
    0x3e1c1c1c 0x3e1c3404 0x3e24140c 0x3e24240c 0x3e2c0404 0x3e2c0414 0x3e2c1424 0x3e341c04"""
GRID = np.array([int(w, 16) for w in _GRID_WORDS.split()], dtype="<u4").view(np.uint8).reshape(256, 4)
GRID.setflags(write=False)
# Doubled magnitudes {4..62} halved: the values iq3_pack multiplies by db.
_GRID_HALF = GRID.astype(np.float32) * np.float32(0.5)
_GRID_NORM2 = (_GRID_HALF * _GRID_HALF).sum(1)

_THREADS = max(1, min(8, os.cpu_count() or 1))


def _parallel(fn, n, chunk):
    """Run ``fn(lo, hi)`` over ``range(0, n, chunk)`` on a few threads (numpy drops the GIL)."""
    spans = [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]
    if _THREADS == 1 or len(spans) == 1:
        for lo, hi in spans:
            fn(lo, hi)
        return
    with ThreadPoolExecutor(_THREADS) as pool:
        for _ in pool.map(lambda s: fn(*s), spans):
            pass


# ---- rotation (docs/format.md#rotation) ---------------------------------------------------

@functools.lru_cache(maxsize=None)
def sign_bits(n: int) -> np.ndarray:
    """[n] bool, True = negate: xorshift64* seeded ``417 + n``, LSB-first (``e8_signs``)."""
    mask = (1 << 64) - 1
    state = 417 + n
    stream = bytearray()
    for _ in range((n + 7) // 8):
        state ^= state >> 12
        state ^= (state << 25) & mask
        state ^= state >> 27
        stream.append(((state * 2685821657736338717) & mask) >> 56)
    bits = np.unpackbits(np.frombuffer(bytes(stream), np.uint8), bitorder="little")[:n]
    bits = bits.astype(bool)
    bits.setflags(write=False)
    return bits


@functools.lru_cache(maxsize=None)
def _sign_factors(n: int) -> np.ndarray:
    return np.where(sign_bits(n), np.float32(-1.0), np.float32(1.0))


def block_tiling(n: int) -> list[int]:
    """Power-of-two blocks covering ``n``: lowest set bit of the remainder, capped at 32768."""
    if n < 0:
        raise ValueError(f"rotation length must be >= 0, got {n}")
    out, rem = [], n
    while rem:
        b = rem & -rem
        while b > MAX_ROT_BLOCK:
            b >>= 1
        out.append(b)
        rem -= b
    return out


def _fwht_rows(x: np.ndarray) -> np.ndarray:
    """Unnormalized Sylvester FWHT of each row, butterflies at stride 1, 2, 4, ... (float32)."""
    rows, b = x.shape
    src, dst = x, np.empty_like(x)
    h = 1
    while h < b:
        s = src.reshape(rows, b // (2 * h), 2, h)
        t = dst.reshape(rows, b // (2 * h), 2, h)
        np.add(s[:, :, 0], s[:, :, 1], out=t[:, :, 0])
        np.subtract(s[:, :, 0], s[:, :, 1], out=t[:, :, 1])
        src, dst = t.reshape(rows, b), src
        h <<= 1
    return src


def rotate_rows(w: np.ndarray, backend: str | None = None) -> np.ndarray:
    """Rotate float32 rows along the last axis: per block sign flip, FWHT, divide by sqrt(b).

    Bit-identical to upstream ``iq3_pack.rotate_rows`` (same butterfly order and rounding).
    Used for weights (``W -> W @ Q``) and equally valid for activations (``x -> Q^T x``).
    ``backend`` is as in :func:`encode_rotated_e8`; both give the same bits.
    """
    w = np.asarray(w, dtype=np.float32)
    dim = w.shape[-1]
    rows = np.ascontiguousarray(w.reshape(-1, dim))
    out = np.empty_like(rows)
    tiling = block_tiling(dim)
    lib = _compiled(backend)

    if lib is not None:
        tiles = np.array(tiling, dtype=np.int64)
        signs = np.concatenate([_sign_factors(b) for b in tiling] or [np.ones(0, np.float32)])
        divisors = np.array([np.sqrt(b, dtype=np.float32) for b in tiling], dtype=np.float32)

        def work(lo, hi):
            lib.e8_rotate(_ptr(rows[lo:hi]), _ptr(out[lo:hi]), hi - lo, dim, _ptr(tiles),
                          len(tiles), _ptr(signs), _ptr(divisors))
    else:
        def work(lo, hi):
            off = 0
            for b in tiling:
                blk = rows[lo:hi, off:off + b] * _sign_factors(b)
                out[lo:hi, off:off + b] = _fwht_rows(blk) / np.sqrt(b, dtype=np.float32)
                off += b

    # ~1 MiB of rows per task keeps every butterfly pass in cache.
    _parallel(work, len(rows), max(1, (1 << 18) // max(dim, 1)))
    return out.reshape(w.shape)


def rotate(x):
    """MLX version of :func:`rotate_rows` along the last axis; computes in float32.

    Uses ``mx.hadamard_transform`` (scale 1, then divide by sqrt(b) like upstream), which on
    the CPU backend is bit-identical to the stride-1,2,4,... butterflies.
    """
    import mlx.core as mx

    x = x.astype(mx.float32)
    dim = x.shape[-1]
    parts, off = [], 0
    for b in block_tiling(dim):
        blk = x[..., off:off + b] * mx.array(_sign_factors(b))
        if b > 1:
            blk = mx.hadamard_transform(blk, scale=1.0)
        parts.append(blk / mx.array(np.sqrt(b, dtype=np.float32)))
        off += b
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


# ---- decoding (docs/format.md#fmt-6-e8-iq3-lattice) ---------------------------------------

def _check_packed(packed: np.ndarray, O: int, I: int) -> np.ndarray:
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise FormatError(f"fmt 6 packed weights must be uint8, got {packed.dtype}")
    nsb = -(-I // QK)
    want = BLOCK_BYTES * O * nsb
    if packed.size != want:
        raise FormatError(f"fmt 6 [{O}, {I}] needs {want} bytes (98 per 256 inputs per row), "
                         f"got {packed.size}")
    return packed.reshape(O * nsb, BLOCK_BYTES)


def decode_e8(packed: np.ndarray, O: int, I: int) -> np.ndarray:
    """Packed fmt 6 bytes -> float32 ``[O, I]`` in the rotated basis (the stored ``W @ Q``).

    A partial last super-block (``I % 256 != 0``) is decoded like the kernel does: the block is
    stored whole and its tail weights are dropped.
    """
    blocks = _check_packed(packed, O, I)
    n = len(blocks)
    mag = _GRID_HALF[blocks[:, :64]].reshape(n, 8, SUB)
    words = np.ascontiguousarray(blocks[:, 64:96]).view("<u4").astype(np.uint32)    # [n, 8]
    d = np.ascontiguousarray(blocks[:, 96:98]).view("<f2").astype(np.float32)        # [n, 1]
    code = (words >> 28).astype(np.float32)
    db = d * (np.float32(0.5) + code) * np.float32(0.5)                              # exact
    lanes = (words[:, :, None] >> (7 * np.arange(4, dtype=np.uint32))) & 0x7F         # [n,8,4]
    lanes = lanes.astype(np.uint8)
    parity = np.unpackbits(lanes[..., None], axis=-1).sum(-1, dtype=np.uint8) & 1
    sign8 = lanes | (parity << 7)
    neg = np.unpackbits(sign8[..., None], axis=-1, bitorder="little").reshape(n, 8, SUB)
    w = mag * db[:, :, None]
    np.negative(w, out=w, where=neg.astype(bool))
    nsb = -(-I // QK)
    return w.reshape(O, nsb * QK)[:, :I]


# ---- encoding (docs/formats-e8.md) --------------------------------------------------------

def encode_e8(w_unrotated: np.ndarray, backend: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Unrotated ``W[O, I]`` -> (packed uint8 of ``98*O*I/256`` bytes, scales ``[6.0]``).

    Rotates rows first, as upstream's converter (``quant_e8``) does.
    """
    w = _check_encode_input(w_unrotated)
    return encode_rotated_e8(rotate_rows(w, backend), backend)


def encode_rotated_e8(w_rot: np.ndarray,
                      backend: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Already-rotated ``[O, I]`` -> (packed, scales); the ``iq3_pack.encode`` step alone.

    ``backend``: ``"c"`` (the compiled core, error if it cannot be built), ``"numpy"`` (the
    reference implementation), or None: ``$COLIBRI_E8_ENCODER`` if set, else the compiled
    core when it builds, otherwise numpy with a one-time notice on stderr. Same bytes either way.
    """
    w = _check_encode_input(w_rot)
    blocks = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, QK)
    out = np.empty((len(blocks), BLOCK_BYTES), dtype=np.uint8)
    lib = _compiled(backend)

    def work(lo, hi):
        out[lo:hi] = _encode_blocks(blocks[lo:hi], lib)

    _parallel(work, len(blocks), 1024)
    return out.reshape(-1), np.array([TAG], dtype=np.float32)


def _check_encode_input(w) -> np.ndarray:
    w = np.asarray(w)
    if w.ndim != 2:
        raise FormatError(f"fmt 6 encodes a 2-D weight [O, I], got shape {w.shape}")
    if w.shape[1] % QK:
        raise FormatError(f"fmt 6 needs I % {QK} == 0 (as upstream's converter), got I={w.shape[1]}")
    if not np.issubdtype(w.dtype, np.floating):
        raise FormatError(f"fmt 6 encodes float weights, got {w.dtype}")
    w = w.astype(np.float32, copy=False)
    if not np.isfinite(w).all():
        bad = np.argwhere(~np.isfinite(w))[0]
        raise FormatError(f"fmt 6 encodes finite weights, got {w[tuple(bad)]} at {tuple(bad)}")
    return w


def _encode_blocks(x: np.ndarray, lib=None) -> np.ndarray:
    """[N, 256] float32 rotated weights -> [N, 98] super-blocks (search in ``lib`` if given)."""
    n = len(x)
    neg = (x < 0).reshape(n, QK // 8, 8)          # -0.0 counts as positive
    mag = np.abs(x)
    _fix_parity(neg, mag.reshape(n, QK // 8, 8))
    d = np.sqrt((mag * mag).mean(-1, keepdims=True)) / 20.0 + 1e-12      # float32, as upstream
    with np.errstate(over="ignore"):
        d16 = d.astype(np.float16)
    if not np.isfinite(d16).all():
        raise FormatError(f"fmt 6 super-block scale overflows fp16: RMS {float(d.max()) * 20:.3g} "
                         f"> ~1.3e6 in a 256-weight block")
    d = d16.astype(np.float32)                    # search with the value that is stored
    m, d_sub = mag.reshape(n * 8, SUB), np.repeat(d, 8, axis=0)
    codes, idx = (_search if lib is None else functools.partial(_search_compiled, lib))(m, d_sub)

    out = np.empty((n, BLOCK_BYTES), dtype=np.uint8)
    out[:, :64] = idx.reshape(n, 64)
    seven = np.packbits(neg.reshape(n, 8, 4, 8)[..., :7], axis=-1, bitorder="little")
    seven = seven[..., 0].astype(np.uint32)                                   # [n, 8, 4]
    words = (seven << (7 * np.arange(4, dtype=np.uint32))).sum(-1, dtype=np.uint32)
    words |= codes.reshape(n, 8).astype(np.uint32) << 28
    out[:, 64:96] = words.astype("<u4").view(np.uint8)
    out[:, 96:98] = d16.astype("<f2").view(np.uint8)
    return out


def _fix_parity(neg8: np.ndarray, mag8: np.ndarray) -> None:
    """Make every 8-group's negative count even by flipping its smallest magnitude (in place)."""
    odd = (neg8.sum(-1) & 1).astype(bool)
    first_min = mag8.argmin(-1)
    neg8 ^= odd[..., None] & (np.arange(8) == first_min[..., None])


def _search(m: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block [S, 32] magnitudes and [S, 1] super-scale: (best code [S], indices [S, 8]).

    Same answer as trying all 16 codes (``iq3_pack``: lowest code of minimal float32 error),
    but codes whose error lower bound already exceeds a tried code's error are skipped.
    """
    s = len(m)
    bound = _code_error_bounds(m, d)                                  # [S, 16]
    first = bound.argmin(1)
    err_first, idx_first = _code_error(m, d, first)
    err = np.full((s, _N_CODES), np.inf, dtype=np.float32)
    err[np.arange(s), first] = err_first
    # 2^-12 of slack covers float32 rounding in both the bound and the measured error.
    rest_sub, rest_code = np.nonzero(bound * np.float32(1 - 2.0 ** -12) <= err_first[:, None])
    keep = rest_code != first[rest_sub]
    rest_sub, rest_code = rest_sub[keep], rest_code[keep]
    err_rest, idx_rest = _code_error(m[rest_sub], d[rest_sub], rest_code)
    err[rest_sub, rest_code] = err_rest
    code = err.argmin(1)                                              # first minimum
    idx = idx_first.copy()
    moved = np.nonzero(code[rest_sub] == rest_code)[0]
    idx[rest_sub[moved]] = idx_rest[moved]
    return code.astype(np.uint8), idx


def _search_compiled(lib, m: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_search` in the compiled core (same answers; ``d`` finite)."""
    m = np.ascontiguousarray(m)
    d = np.ascontiguousarray(d[:, 0])
    codes = np.empty(len(m), dtype=np.uint8)
    idx = np.empty((len(m), 8), dtype=np.uint8)
    lib.e8_search(_ptr(m), _ptr(d), len(m), _ptr(codes), _ptr(idx))
    return codes, idx


def _code_error(m: np.ndarray, d: np.ndarray, code: np.ndarray):
    """float32 squared error and grid indices of [P, 32] magnitudes at per-row ``code``."""
    db = d * (np.float32(0.5) + code.astype(np.float32)[:, None]) * np.float32(0.5)
    q = (m / np.maximum(db, 1e-20)).reshape(-1, 4)
    idx = _nearest_grid(q).reshape(len(m), 8)
    rec = _GRID_HALF[idx].reshape(len(m), SUB) * db
    return ((rec - m) ** 2).sum(-1), idx


# Lower bound of a sub-block's error per code: each weight's distance to the nearest of the 8
# scalar levels (the grid only allows 256 of the 8^4 level combinations). Tabulated over bins
# of r = m / d, taking the minimum over each bin.
_LEVELS = np.unique(_GRID_HALF).astype(np.float64)                 # 2, 6, ..., 26, 31
_R_BIN = 0.25
_R_BINS = 512


@functools.lru_cache(maxsize=None)
def _bound_table() -> np.ndarray:
    lo = np.arange(_R_BINS + 1) * _R_BIN * (1 - 1e-6)             # widened: r carries rounding
    hi = np.append(np.arange(1, _R_BINS + 1) * _R_BIN * (1 + 1e-6), np.inf)
    out = np.empty((_R_BINS + 1, _N_CODES))
    for c in range(_N_CODES):
        lv = _LEVELS * (0.5 + c) * 0.5
        inside = ((lv >= lo[:, None]) & (lv <= hi[:, None])).any(1)
        at_lo = ((lo[:, None] - lv) ** 2).min(1)
        at_hi = np.where(np.isinf(hi), np.inf, ((np.minimum(hi, 1e30)[:, None] - lv) ** 2).min(1))
        out[:, c] = np.where(inside, 0.0, np.minimum(at_lo, at_hi))
    return out.astype(np.float32)


def _code_error_bounds(m: np.ndarray, d: np.ndarray) -> np.ndarray:
    dd = np.where(d > 0, d, np.float32(1))
    r = m / dd
    bins = np.minimum(r * np.float32(1 / _R_BIN), np.float32(_R_BINS)).astype(np.int32)
    per_weight = _bound_table()[bins]                                 # [S, 32, 16]
    bound = per_weight.sum(1) * (dd * dd)
    return np.where(d > 0, bound, np.float32(0))


def _nearest_grid(q: np.ndarray) -> np.ndarray:
    """[N, 4] float32 -> [N] uint8: argmin of ``|g|^2 - 2 q.g`` in float32, first on ties.

    That is ``iq3_pack._nearest`` (``q @ g.T`` on OpenBLAS rounds as a fused multiply-add
    chain). Most queries are settled exactly without it: a few candidates per cell of q-space
    are scored, and when the best one wins by more than any float32 rounding could move the
    scores (and beats every other grid point's distance bound for the cell), it is the answer.
    The rest (near-ties, out-of-range q) take upstream's brute-force formula.
    """
    cand, cand_grid, far = _cell_tables()
    cell = np.minimum(q * np.float32(0.5), np.float32(_CELL_BINS - 1)).astype(np.int32)
    cell = cell @ _CELL_STRIDES
    cands = cand[cell]                                                # [N, K]
    diff = cand_grid[cell]                                            # [N, K, 4]
    np.subtract(diff, q[:, None, :], out=diff)
    dist = np.einsum("nkj,nkj->nk", diff, diff)
    two = np.partition(dist, 1, axis=1)
    best = cands[np.arange(len(q)), dist.argmin(1)]
    # 2^-20 * (...) bounds upstream's score rounding (FMA dot + subtraction) for both
    # contenders plus this function's own float32 distance rounding.
    margin = np.float32(2.0 ** -20) * (two[:, 0] + two[:, 1] + 64 * q.sum(1) + 1024)
    gap = np.minimum(two[:, 1], far[cell]) - two[:, 0]
    unsure = np.nonzero(~(gap > margin))[0]
    if len(unsure):
        qs = q[unsure]
        best[unsure] = np.argmin(_GRID_NORM2 - 2.0 * (qs @ _GRID_HALF.T), axis=1)
    return best.astype(np.uint8)


_CELL_BINS = 17                       # q per coordinate in [0,2), [2,4), ..., [30,32), [32, inf)
_CELL_CANDS = 4
_CELL_STRIDES = np.array([1, _CELL_BINS, _CELL_BINS ** 2, _CELL_BINS ** 3], dtype=np.int32)


@functools.lru_cache(maxsize=None)
def _cell_tables():
    """Per q-space cell: the K grid points nearest to the cell box, and a lower bound on the
    squared distance from any point of the box to every other grid point."""
    lo = np.arange(_CELL_BINS, dtype=np.float64) * 2
    hi = np.append(lo[1:], np.inf)
    lv = _GRID_HALF.astype(np.float64)                                 # [256, 4]
    gap = np.maximum(np.maximum(lo[:, None, None] - lv, lv - hi[:, None, None]), 0) ** 2
    total = np.zeros((_CELL_BINS,) * 4 + (256,))
    for j in range(4):                                # coordinate j varies with stride 17**j
        shape = [1, 1, 1, 1, 256]
        shape[3 - j] = _CELL_BINS
        total = total + gap[:, :, j].reshape(shape)
    total = total.reshape(-1, 256)
    order = np.argsort(total, axis=1, kind="stable")
    cand = order[:, :_CELL_CANDS].astype(np.uint8)
    far = np.take_along_axis(total, order[:, _CELL_CANDS:_CELL_CANDS + 1], 1)[:, 0]
    return cand, _GRID_HALF[cand], far.astype(np.float32)


# ---- compiled core (_e8_encode.c) ---------------------------------------------------------

ENCODER_ENV = "COLIBRI_E8_ENCODER"        # "c" or "numpy"; unset: "c" when it builds
_C_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_e8_encode.c")
# -ffp-contract=off keeps every a*b+c as two roundings (the bytes depend on it).
_C_COMMON = ["-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]
_C_TUNINGS = (["-O3", "-march=native"], ["-O3"])

_lib_lock = threading.Lock()
_lib_state: tuple | None = None           # (CDLL, None) or (None, why it is unavailable)
_noticed = False


def _compiled(backend: str | None):
    """The loaded C core for ``backend`` (see :func:`encode_rotated_e8`), or None for numpy."""
    global _noticed
    choice = backend or os.environ.get(ENCODER_ENV) or "auto"
    if choice not in ("auto", "c", "numpy"):
        raise ValueError(f"fmt 6 encoder backend must be 'c' or 'numpy' (backend= or "
                         f"${ENCODER_ENV}), got {choice!r}")
    if choice == "numpy":
        return None
    lib, why = _load_compiled()
    if lib is None:
        if choice == "c":
            raise RuntimeError(f"fmt 6 C encoder unavailable: {why}")
        if not _noticed:
            _noticed = True
            print(f"colibri_mlx: fast fmt 6 encoder unavailable ({why}); using the numpy "
                  f"encoder (same bytes, ~10x slower). Set {ENCODER_ENV}=numpy to silence.",
                  file=sys.stderr)
    return lib


def _load_compiled():
    global _lib_state
    with _lib_lock:
        if _lib_state is None:
            try:
                _lib_state = (_build_and_load(), None)
            except (OSError, subprocess.SubprocessError) as e:
                _lib_state = (None, str(e))
        return _lib_state


def _cache_dir() -> str:
    root = os.environ.get("COLIBRI_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "colibri_mlx")
    os.makedirs(root, mode=0o700, exist_ok=True)
    return root


def _cpu_tag() -> str:
    """-march=native builds are only valid on this CPU: key the cache on its feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + platform.processor() + flags


def _private(st: os.stat_result) -> bool:
    """Owned by this user and writable by nobody else (so nobody else can swap what we load)."""
    getuid = getattr(os, "getuid", None)
    return (getuid is None or st.st_uid == getuid()) and not st.st_mode & 0o022


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _trusted(so: str, record: str, key: str) -> bool:
    """Whether the cached library ``so`` is the one we built for ``key``: a regular file we own
    that nobody else can write, whose sha256 is the one ``record`` (written with it) holds."""
    import json
    import stat

    try:
        st = os.lstat(so)
        rst = os.lstat(record)
        if not (stat.S_ISREG(st.st_mode) and stat.S_ISREG(rst.st_mode) and _private(st) and _private(rst)):
            return False
        with open(record) as f:
            want = json.load(f)
        return want.get("key") == key and want.get("sha256") == _file_sha256(so)
    except (OSError, ValueError, AttributeError):
        return False


def _build_and_load() -> ctypes.CDLL:
    """Compile ``_e8_encode.c`` once per source/compiler/CPU into the cache dir and load it.

    The cache is keyed by the sha256 of the source, the compiler and its flags, and the CPU; a
    library found there is loaded only if a record written when we built it has its sha256 and
    both are ours and writable by nobody else (else it is built again). A cache directory that
    others can write is not used: the library is built into a private temporary directory."""
    import json

    cc = os.environ.get("CC") or shutil.which("cc")
    if not cc:
        raise OSError("no C compiler: `cc` is not on PATH (set CC)")
    with open(_C_SOURCE, "rb") as f:
        source = f.read()
    cache, errors = _cache_dir(), []
    if not _private(os.stat(cache)):
        import atexit

        cache = tempfile.mkdtemp(prefix="colibri-e8-")
        atexit.register(shutil.rmtree, cache, True)
    for tuning in _C_TUNINGS:
        flags = tuning + _C_COMMON
        key = hashlib.sha256(source + repr((cc, flags, _cpu_tag())).encode()).hexdigest()
        so = os.path.join(cache, f"e8_encode-{key[:16]}.so")
        record = so + ".sha256"
        if not _trusted(so, record, key):
            fd, tmp = tempfile.mkstemp(prefix="e8_encode-", suffix=".so.tmp", dir=cache)
            os.close(fd)
            run = subprocess.run([cc, *flags, "-o", tmp, _C_SOURCE, "-lm"],
                                 capture_output=True, text=True)
            if run.returncode:
                os.unlink(tmp)
                errors.append(f"`{cc} {' '.join(flags)}` failed: {run.stderr.strip()[-400:]}")
                continue
            os.chmod(tmp, 0o700)
            fd, rtmp = tempfile.mkstemp(prefix="e8_encode-", suffix=".sha256.tmp", dir=cache)
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, "sha256": _file_sha256(tmp)}, f)
            os.replace(tmp, so)
            os.replace(rtmp, record)
        lib = _bind(ctypes.CDLL(so))
        _fill_cells(lib, so[:-len(".so")] + ".cells")
        return lib
    raise OSError("; ".join(errors))


def _fill_cells(lib: ctypes.CDLL, path: str) -> None:
    """Load the core's nearest-grid cell table from ``path`` (table + sha256), or build all of
    it (~1 CPU-s, once per cache) and save it there; unbuilt cells would be built lazily."""
    n = lib.e8_cell_table_bytes()
    table = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(lib.e8_cell_table()))
    slot = 16                                   # CELL_MAX + 1 bytes per cell in _e8_encode.c
    try:
        # Only a table we wrote, that nobody else can write (the core indexes with its bytes).
        saved = np.fromfile(path, dtype=np.uint8) if _private(os.lstat(path)) and os.path.isfile(path) \
            else np.empty(0, np.uint8)
    except OSError:
        saved = np.empty(0, np.uint8)
    if len(saved) == n + 32 and hashlib.sha256(saved[:n]).digest() == saved[n:].tobytes():
        table[:] = saved[:n]
        return
    n_cells = n // slot
    _parallel(lib.e8_build_cells, n_cells, -(-n_cells // 16))
    fd, tmp = tempfile.mkstemp(prefix="e8_cells-", suffix=".tmp", dir=os.path.dirname(path))
    with os.fdopen(fd, "wb") as f:
        f.write(table.tobytes() + hashlib.sha256(table).digest())
    os.replace(tmp, path)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.e8_init.argtypes, lib.e8_init.restype = [p], ctypes.c_int
    lib.e8_search.argtypes, lib.e8_search.restype = [p, p, i64, p, p], None
    lib.e8_rotate.argtypes, lib.e8_rotate.restype = [p, p, i64, i64, p, i64, p, p], None
    lib.e8_nearest.argtypes, lib.e8_nearest.restype = [p, i64, p], None
    lib.e8_code_bounds.argtypes, lib.e8_code_bounds.restype = [p, p, i64, p], None
    lib.e8_cell_table_bytes.argtypes, lib.e8_cell_table_bytes.restype = [], i64
    lib.e8_cell_table.argtypes, lib.e8_cell_table.restype = [], p
    lib.e8_build_cells.argtypes, lib.e8_build_cells.restype = [i64, i64], None
    lib.e8_clear_cells.argtypes, lib.e8_clear_cells.restype = [], None
    grid = np.ascontiguousarray(GRID)
    if lib.e8_init(_ptr(grid)) != 0:
        raise OSError("e8_init failed")
    return lib


def _ptr(a: np.ndarray) -> int:
    assert a.flags.c_contiguous, "compiled e8 core needs C-contiguous arrays"
    return a.ctypes.data

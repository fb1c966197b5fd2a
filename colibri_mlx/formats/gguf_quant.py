"""llama.cpp's GGUF tensor types as QTensor fmt 11-28.

One table row per ggml type (docs/format.md#gguf-formats). A GGUF weight ``W[O, I]`` stores each
row as ``I / block_size`` consecutive blocks of ``type_size`` bytes, exactly as ggml lays them out;
a QTensor of a GGUF fmt keeps those bytes untouched: ``packed`` is uint8 ``[O, I / block_size *
type_size]``, ``scales`` is an empty float32 array (every scale lives inside the blocks), ``gs`` is
the block size. Blocks are not aligned beyond 2 bytes (Q8_0 is 34 bytes), so kernels read them
byte- or half-wise.

F32, F16 and BF16 tensors are plain float weights, not QTensors.

Decoding: one decoder class per type (:data:`DECODERS`), written from llama.cpp's ggml-quants.c
``dequantize_row_*`` with the same float32 operations in the same order, so the result is bit-equal
to ggml's and to ``gguf.quants.dequantize``. The decoders are written once against
:class:`ArrayOps`: :data:`NUMPY` here (:func:`dequantize_gguf`), MLX ops in kernels/gguf_formats.py
(the reference path). The IQ types' grids are ggml's tables (formats/gguf_grids.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .codecs import FormatError
from .gguf_grids import iq1s_grid, iq2s_grid, iq2xs_grid, iq2xxs_grid, iq3s_grid, iq3xxs_grid


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


def is_gguf_fmt(fmt: int) -> bool:
    return fmt in GGUF_FMTS


def row_nbytes(gtype: GgufType, I: int) -> int:
    """Bytes of one row of ``I`` weights; ``I`` must be a whole number of blocks."""
    if I % gtype.block_size:
        raise ValueError(f"{gtype.name}: a row of {I} weights is not a whole number of "
                         f"{gtype.block_size}-weight blocks")
    return I // gtype.block_size * gtype.type_size


def gguf_type(gtype_or_fmt) -> GgufType:
    """A :class:`GgufType` from itself, its QTensor fmt, its ggml name or its ``GGMLQuantizationType``."""
    if isinstance(gtype_or_fmt, GgufType):
        return gtype_or_fmt
    name = getattr(gtype_or_fmt, "name", None)
    if isinstance(gtype_or_fmt, str) or name is not None:
        key = (gtype_or_fmt if isinstance(gtype_or_fmt, str) else name).upper()
        if key in GGUF_TYPES:
            return GGUF_TYPES[key]
    elif isinstance(gtype_or_fmt, (int, np.integer)) and int(gtype_or_fmt) in GGUF_FMTS:
        return GGUF_FMTS[int(gtype_or_fmt)]
    raise ValueError(f"not a GGUF quantized type or fmt: {gtype_or_fmt!r} (known: {', '.join(GGUF_TYPES)})")


# ---------------------------------------------------------------------------------------
# Tables (ggml-common.h). The sign tables: ksigns_iq2xs[i] is i with bit 7 set to make an even
# number of set bits (8 signs from 7 stored bits), kmask_iq2xs[j] selects weight j's sign.

kmask_iq2xs = np.array([1 << j for j in range(8)], np.uint8)
ksigns_iq2xs = np.array([i | ((bin(i).count("1") & 1) << 7) for i in range(128)], np.uint8)
kvalues_iq4nl = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
IQ1S_DELTA = np.float32(0.125)   # IQ1S_DELTA and IQ1M_DELTA

# float32 views the decoders gather from, and the shift vectors they unpack with
_KVALUES_F32 = kvalues_iq4nl.astype(np.float32)
_GRIDS_F32 = {n: g.astype(np.float32) for n, g in (("iq2xxs", iq2xxs_grid), ("iq2xs", iq2xs_grid),
                                                    ("iq2s", iq2s_grid), ("iq3xxs", iq3xxs_grid),
                                                    ("iq3s", iq3s_grid), ("iq1s", iq1s_grid))}
_SH_NIBBLES = np.array([0, 4], np.uint8)
_SH_CRUMBS = np.array([0, 2, 4, 6], np.uint8)
_SH_BITS8 = np.arange(8, dtype=np.uint8)
_SH_BITS32 = np.arange(32, dtype=np.uint32)
_SH_SEVENS = np.array([0, 7, 14, 21], np.uint32)
_SH_TRIPLES = np.array([0, 3, 6, 9], np.uint16)
_SH_IQ4XS_HIGH = np.arange(0, 16, 2, dtype=np.uint16)
_SIGNS_F32 = np.array([1.0, -1.0], np.float32)


class ArrayOps:
    """The array library a decoder runs on: dtypes, ``where``, ``concatenate`` and ``const`` (a
    module-level numpy table or shift vector as an array of this library)."""

    def __init__(self, module, const):
        for name in ("uint8", "uint16", "uint32", "int32", "float16", "float32", "where", "concatenate"):
            setattr(self, name, getattr(module, name))
        self.const = const


NUMPY = ArrayOps(np, lambda a: a)


def _le16(xp, b):
    """Little-endian uint16 words of bytes ``[..., 2k]`` -> ``[..., k]``."""
    b = b.reshape(*b.shape[:-1], -1, 2).astype(xp.uint16)
    return b[..., 0] | (b[..., 1] << 8)


def _le32(xp, b):
    """Little-endian uint32 words of bytes ``[..., 4k]`` -> ``[..., k]``."""
    b = b.reshape(*b.shape[:-1], -1, 4).astype(xp.uint32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _f16(xp, b):
    """float32 of the float16 held in bytes ``[n, 2]`` -> ``[n, 1]``."""
    return _le16(xp, b).view(xp.float16).astype(xp.float32)


def _int8(xp, b):
    """int32 of bytes read as int8."""
    return ((b.astype(xp.int32) + 128) & 255) - 128


def _unpack(xp, b, shifts, mask, shape):
    """``(b[..., None, :] >> shifts[:, None]) & mask`` reshaped: bit fields of ``b`` in field-major order."""
    s = xp.const(shifts)
    return ((b.reshape(*b.shape[:-1], 1, b.shape[-1]) >> s.reshape(-1, 1)) & mask).reshape(shape)


def _bits_of(xp, b, shape):
    """The 8 bits of each byte of ``b``, LSB first, as ``shape``."""
    return ((b[..., None] >> xp.const(_SH_BITS8)) & 1).reshape(shape)


def _signs(xp, sign_bytes, shape):
    """+1 / -1 float32 from sign bytes (bit j set: weight j negative)."""
    return xp.const(_SIGNS_F32)[_bits_of(xp, sign_bytes, shape).astype(xp.int32)]


DECODERS: dict = {}


class GgufDecoder:
    """One GGUF type: :meth:`dequantize_blocks` maps blocks uint8 ``[n, type_size]`` to float32
    ``[n, block_size]`` with ggml's arithmetic (ggml-quants.c ``dequantize_row_*``)."""

    gtype: GgufType

    def __init_subclass__(cls, name: str):
        cls.gtype = GGUF_TYPES[name]
        DECODERS[name] = cls

    @classmethod
    def dequantize_blocks(cls, b, xp: ArrayOps = NUMPY):
        raise NotImplementedError


class Q8_0(GgufDecoder, name="Q8_0"):
    # d f16 | qs int8[32]
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        return _int8(xp, b[:, 2:]).astype(xp.float32) * _f16(xp, b[:, :2])


def _nibbles_32(xp, qs):
    """The 32 codes of a 16-byte run: low nibbles are weights 0-15, high nibbles 16-31."""
    return xp.concatenate([qs & 15, qs >> 4], axis=1)


def _fifth_bit(xp, qh_bytes):
    """Bit j of the little-endian 32-bit ``qh`` (weight j's 5th bit), shifted to bit 4."""
    return ((_le32(xp, qh_bytes) >> xp.const(_SH_BITS32)) & 1).astype(xp.uint8) << 4


class Q4_0(GgufDecoder, name="Q4_0"):
    # d f16 | qs[16]: q - 8
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        q = _nibbles_32(xp, b[:, 2:18]).astype(xp.int32) - 8
        return _f16(xp, b[:, :2]) * q.astype(xp.float32)


class Q5_0(GgufDecoder, name="Q5_0"):
    # d f16 | qh u32 | qs[16]: (q | h << 4) - 16
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        q = (_nibbles_32(xp, b[:, 6:22]) | _fifth_bit(xp, b[:, 2:6])).astype(xp.int32) - 16
        return _f16(xp, b[:, :2]) * q.astype(xp.float32)


class Q5_1(GgufDecoder, name="Q5_1"):
    # d f16 | m f16 | qh u32 | qs[16]: d * (q | h << 4) + m
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        q = (_nibbles_32(xp, b[:, 8:24]) | _fifth_bit(xp, b[:, 4:8])).astype(xp.float32)
        return _f16(xp, b[:, :2]) * q + _f16(xp, b[:, 2:4])


def _crumbs_256(xp, qs):
    """The 256 2-bit codes of a 64-byte run: per 32-byte half, bit pairs 0-1 of the 32 bytes, then 2-3 ..."""
    return _unpack(xp, qs.reshape(-1, 2, 32), _SH_CRUMBS, 3, (qs.shape[0], 256))


class Q2_K(GgufDecoder, name="Q2_K"):
    # scales[16] (low nibble scale, high nibble min) | qs[64] | d f16 | dmin f16
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        n, sc = b.shape[0], b[:, :16]
        dl = (_f16(xp, b[:, 80:82]) * (sc & 15).astype(xp.float32)).reshape(n, 16, 1)
        ml = (_f16(xp, b[:, 82:84]) * (sc >> 4).astype(xp.float32)).reshape(n, 16, 1)
        q = _crumbs_256(xp, b[:, 16:80]).astype(xp.float32).reshape(n, 16, 16)
        return (dl * q - ml).reshape(n, 256)


class Q3_K(GgufDecoder, name="Q3_K"):
    # hmask[32] | qs[64] | scales[12] (16 6-bit values) | d f16: d * (s - 32) * (q - (h ? 0 : 4))
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        n, sc = b.shape[0], b[:, 96:108]
        low = _unpack(xp, sc[:, :8], _SH_NIBBLES, 15, (n, 16))
        high = _unpack(xp, sc[:, 8:12], _SH_CRUMBS, 3, (n, 16))
        s = (low | (high << 4)).astype(xp.int32) - 32
        dl = (_f16(xp, b[:, 108:110]) * s.astype(xp.float32)).reshape(n, 16, 1)
        h = _unpack(xp, b[:, :32], _SH_BITS8, 1, (n, 256)).astype(xp.int32)
        q = _crumbs_256(xp, b[:, 32:96]).astype(xp.int32) - ((1 - h) << 2)
        return (dl * q.astype(xp.float32).reshape(n, 16, 16)).reshape(n, 256)


def _k_scale_min(xp, s):
    """The 8 6-bit scales and mins packed in 12 bytes (ggml's get_scale_min_k4)."""
    a, m, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = xp.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    mn = xp.concatenate([m & 63, (c >> 4) | ((m >> 6) << 4)], axis=1)
    return sc, mn


def _k_affine(xp, b, q):
    """``d * sc * q - dmin * m`` per 32 weights of a Q4_K / Q5_K block (d, dmin, scales[12] first)."""
    n = b.shape[0]
    sc, mn = _k_scale_min(xp, b[:, 4:16])
    d = (_f16(xp, b[:, 0:2]) * sc.astype(xp.float32)).reshape(n, 8, 1)
    dm = (_f16(xp, b[:, 2:4]) * mn.astype(xp.float32)).reshape(n, 8, 1)
    return (d * q.astype(xp.float32) - dm).reshape(n, 256)


def _k_nibbles(xp, qs):
    """Q4_K / Q5_K codes of 128 bytes: per 32-byte run, the low nibbles (32 weights) then the high."""
    return _unpack(xp, qs.reshape(-1, 4, 32), _SH_NIBBLES, 15, (qs.shape[0], 8, 32))


class Q4_K(GgufDecoder, name="Q4_K"):
    # d f16 | dmin f16 | scales[12] | qs[128]
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        return _k_affine(xp, b, _k_nibbles(xp, b[:, 16:144]))


class Q5_K(GgufDecoder, name="Q5_K"):
    # d f16 | dmin f16 | scales[12] | qh[32] (bit i: 5th bit of sub-block i) | qs[128]
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        h = _unpack(xp, b[:, 16:48], _SH_BITS8, 1, (b.shape[0], 8, 32))
        return _k_affine(xp, b, _k_nibbles(xp, b[:, 48:176]) | (h << 4))


class Q6_K(GgufDecoder, name="Q6_K"):
    # ql[128] | qh[64] | scales int8[16] | d f16: d * s * ((ql | qh << 4) - 32)
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        n = b.shape[0]
        low = _unpack(xp, b[:, :128].reshape(n, 2, 64), _SH_NIBBLES, 15, (n, 256))
        high = _unpack(xp, b[:, 128:192].reshape(n, 2, 32), _SH_CRUMBS, 3, (n, 256))
        q = (low | (high << 4)).astype(xp.int32) - 32
        d = (_f16(xp, b[:, 208:210]) * _int8(xp, b[:, 192:208]).astype(xp.float32)).reshape(n, 16, 1)
        return (d * q.astype(xp.float32).reshape(n, 16, 16)).reshape(n, 256)


class IQ4_NL(GgufDecoder, name="IQ4_NL"):
    # d f16 | qs[16]: d * kvalues_iq4nl[q]
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        q = _nibbles_32(xp, b[:, 2:18]).astype(xp.int32)
        return _f16(xp, b[:, :2]) * xp.const(_KVALUES_F32)[q]


class IQ4_XS(GgufDecoder, name="IQ4_XS"):
    # d f16 | scales_h u16 | scales_l[4] | qs[128]: d * (s - 32) * kvalues_iq4nl[q] per 32 weights
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        n = b.shape[0]
        low = _unpack(xp, b[:, 4:8].reshape(n, 4, 1), _SH_NIBBLES, 15, (n, 8))
        high = (_le16(xp, b[:, 2:4]) >> xp.const(_SH_IQ4XS_HIGH)) & 3
        s = (low.astype(xp.int32) | (high.astype(xp.int32) << 4)) - 32
        dl = (_f16(xp, b[:, :2]) * s.astype(xp.float32)).reshape(n, 8, 1)
        q = _unpack(xp, b[:, 8:136].reshape(n, 8, 16), _SH_NIBBLES, 15, (n, 8, 32)).astype(xp.int32)
        return (dl * xp.const(_KVALUES_F32)[q]).reshape(n, 256)


def _half_scales(xp, d, sc):
    """``d * (0.5 + s) * 0.25`` of the two 4-bit scales per byte of ``sc [n, 8]`` -> ``[n, 8, 2]``."""
    s = _unpack(xp, sc.reshape(-1, 8, 1), _SH_NIBBLES, 15, (sc.shape[0], 8, 2)).astype(xp.float32)
    return d.reshape(-1, 1, 1) * (0.5 + s) * 0.25


def _grid(xp, name, idx):
    return xp.const(_GRIDS_F32[name])[idx.astype(xp.int32)]


class IQ2_XXS(GgufDecoder, name="IQ2_XXS"):
    # d f16 | per 32 weights two u32: 4 grid indices (bytes); 4 x 7 sign bits + a 4-bit scale
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        n = b.shape[0]
        q = b[:, 2:66].reshape(n, 8, 8)
        aux = _le32(xp, q[:, :, 4:8]).reshape(n, 8)
        db = _f16(xp, b[:, :2]) * (0.5 + (aux >> 28).astype(xp.float32)) * 0.25
        sign_bytes = xp.const(ksigns_iq2xs)[((aux[..., None] >> xp.const(_SH_SEVENS)) & 127).astype(xp.int32)]
        grid = _grid(xp, "iq2xxs", q[:, :, :4])
        return (db.reshape(n, 8, 1, 1) * grid * _signs(xp, sign_bytes, (n, 8, 4, 8))).reshape(n, 256)


class IQ2_XS(GgufDecoder, name="IQ2_XS"):
    # d f16 | qs u16[32] (9-bit grid index, 7 sign bits) | scales[8] (4 bits per 16 weights)
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        n = b.shape[0]
        qs = _le16(xp, b[:, 2:66]).reshape(n, 8, 4)
        db = _half_scales(xp, _f16(xp, b[:, :2]), b[:, 66:74])
        sign_bytes = xp.const(ksigns_iq2xs)[(qs >> 9).astype(xp.int32)]
        grid = _grid(xp, "iq2xs", qs & 511).reshape(n, 8, 2, 2, 8)
        signs = _signs(xp, sign_bytes, (n, 8, 2, 2, 8))
        return (db.reshape(n, 8, 2, 1, 1) * grid * signs).reshape(n, 256)


class IQ2_S(GgufDecoder, name="IQ2_S"):
    # d f16 | qs[32] (grid index low bytes) | signs[32] | qh[8] (2 high index bits each) | scales[8]
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        n = b.shape[0]
        high = _unpack(xp, b[:, 66:74].reshape(n, 8, 1), _SH_CRUMBS, 3, (n, 8, 4)).astype(xp.uint16)
        idx = b[:, 2:34].reshape(n, 8, 4).astype(xp.uint16) | (high << 8)
        db = _half_scales(xp, _f16(xp, b[:, :2]), b[:, 74:82])
        grid = _grid(xp, "iq2s", idx).reshape(n, 8, 2, 2, 8)
        signs = _signs(xp, b[:, 34:66], (n, 8, 2, 2, 8))
        return (db.reshape(n, 8, 2, 1, 1) * grid * signs).reshape(n, 256)


class IQ3_XXS(GgufDecoder, name="IQ3_XXS"):
    # d f16 | qs[64] (grid indices, 4 weights each) | per 32 weights a u32: 4 x 7 sign bits + scale
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        n = b.shape[0]
        aux = _le32(xp, b[:, 66:98])
        db = _f16(xp, b[:, :2]) * (0.5 + (aux >> 28).astype(xp.float32)) * 0.5
        sign_bytes = xp.const(ksigns_iq2xs)[((aux[..., None] >> xp.const(_SH_SEVENS)) & 127).astype(xp.int32)]
        grid = _grid(xp, "iq3xxs", b[:, 2:66].reshape(n, 8, 8)).reshape(n, 8, 4, 8)
        return (db.reshape(n, 8, 1, 1) * grid * _signs(xp, sign_bytes, (n, 8, 4, 8))).reshape(n, 256)


class IQ3_S(GgufDecoder, name="IQ3_S"):
    # d f16 | qs[64] | qh[8] (9th index bits) | signs[32] | scales[4]: d * (1 + 2s) per 32 weights
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        n = b.shape[0]
        high = _bits_of(xp, b[:, 66:74], (n, 8, 8)).astype(xp.uint16)
        idx = b[:, 2:66].reshape(n, 8, 8).astype(xp.uint16) | (high << 8)
        s = _unpack(xp, b[:, 106:110].reshape(n, 4, 1), _SH_NIBBLES, 15, (n, 8))
        db = _f16(xp, b[:, :2]) * (1 + 2 * s.astype(xp.int32)).astype(xp.float32)
        grid = _grid(xp, "iq3s", idx).reshape(n, 8, 4, 8)
        return (db.reshape(n, 8, 1, 1) * grid * _signs(xp, b[:, 74:106], (n, 8, 4, 8))).reshape(n, 256)


def _iq1_values(xp, dl, idx, delta_neg, n):
    """``dl * (grid + delta)`` of 32 groups of 8 weights; ``dl`` broadcast ``[n, k, 1, 1]``."""
    grid = _grid(xp, "iq1s", idx).reshape(n, dl.shape[1], -1, 8)
    delta = xp.where(delta_neg, -IQ1S_DELTA, IQ1S_DELTA).astype(xp.float32).reshape(n, dl.shape[1], -1, 1)
    return (dl * (grid + delta)).reshape(n, 256)


class IQ1_S(GgufDecoder, name="IQ1_S"):
    # d f16 | qs[32] (grid index low bytes) | qh u16[8]: 4 x 3 high index bits, 3-bit scale, delta sign
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        n = b.shape[0]
        qh = _le16(xp, b[:, 34:50])
        dl = _f16(xp, b[:, :2]) * (2 * ((qh >> 12) & 7).astype(xp.int32) + 1).astype(xp.float32)
        high = (qh[..., None] >> xp.const(_SH_TRIPLES)) & 7
        idx = b[:, 2:34].reshape(n, 8, 4).astype(xp.uint16) | (high << 8)
        return _iq1_values(xp, dl.reshape(n, 8, 1, 1), idx, (qh & 0x8000) != 0, n)


class IQ1_M(GgufDecoder, name="IQ1_M"):
    # qs[32] | qh[16] (per 8 weights: 3 high index bits, delta sign) | scales u16[4]: 3-bit scales
    # per 16 weights, the f16 block scale in their top nibbles
    @classmethod
    def dequantize_blocks(cls, b, xp=NUMPY):
        n = b.shape[0]
        sc = _le16(xp, b[:, 48:56])
        d16 = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
        d = d16.view(xp.float16).astype(xp.float32).reshape(n, 1)
        s = ((sc[..., None] >> xp.const(_SH_TRIPLES)) & 7).reshape(n, 16)
        dl = d * (2 * s.astype(xp.int32) + 1).astype(xp.float32)
        nib = _unpack(xp, b[:, 32:48].reshape(n, 16, 1), _SH_NIBBLES, 15, (n, 32))
        idx = b[:, :32].astype(xp.uint16) | ((nib & 7).astype(xp.uint16) << 8)
        return _iq1_values(xp, dl.reshape(n, 16, 1, 1), idx, (nib & 8) != 0, n)


# Blocks decoded per step: bounds the decoders' temporaries (a few float32 [n, 256]) to ~100 MB.
DECODE_CHUNK_BLOCKS = 1 << 15


def dequantize_gguf(gtype_or_fmt, raw) -> np.ndarray:
    """float32 ``[..., I]`` of GGUF rows ``raw`` uint8 ``[..., row_bytes]`` of one type (a
    :class:`GgufType`, its fmt, its name), bit-equal to ggml's ``dequantize_row_*``."""
    t = gguf_type(gtype_or_fmt)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim < 1 or raw.shape[-1] % t.type_size:
        raise ValueError(f"{t.name}: rows of uint8 whole {t.type_size}-byte blocks expected, got "
                         f"{raw.dtype} {raw.shape}")
    blocks = np.ascontiguousarray(raw).reshape(-1, t.type_size)
    dec = DECODERS[t.name]
    out = np.empty((blocks.shape[0], t.block_size), np.float32)
    for b0 in range(0, blocks.shape[0], DECODE_CHUNK_BLOCKS):
        out[b0:b0 + DECODE_CHUNK_BLOCKS] = dec.dequantize_blocks(blocks[b0:b0 + DECODE_CHUNK_BLOCKS])
    return out.reshape(*raw.shape[:-1], raw.shape[-1] // t.type_size * t.block_size)


def qtensor_from_gguf(name: str, ggml_type, raw, shape):
    """The QTensor of GGUF tensor ``name``: ``ggml_type`` its type (id, name or
    ``GGMLQuantizationType``), ``raw`` its bytes (any shape), ``shape`` its weight shape in numpy
    order (row length last: GGUF's ``ne`` reversed; leading dims are stacked into ``O``)."""
    from .qtensor import QTensor

    if isinstance(ggml_type, (int, np.integer)) and not isinstance(ggml_type, bool):
        t = GGUF_BY_GGML_TYPE.get(int(getattr(ggml_type, "value", ggml_type)))
    else:
        t = GGUF_TYPES.get(str(getattr(ggml_type, "name", ggml_type)).upper())
    if t is None:
        raise FormatError(f"{name}: ggml type {ggml_type!r} is not a GGUF quantized type colibri reads "
                          f"(known: {', '.join(GGUF_TYPES)})")
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2 or min(shape) < 1:
        raise FormatError(f"{name}: {t.name} weight of shape {shape}: a matrix (or a stack of them) expected")
    I, O = shape[-1], math.prod(shape[:-1])
    if I % t.block_size:
        raise FormatError(f"{name}: {t.name} rows of {I} weights are not whole {t.block_size}-weight blocks")
    rb = row_nbytes(t, I)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 and raw.dtype.itemsize:
        raw = raw.reshape(-1).view(np.uint8)
    if raw.size != O * rb:
        raise FormatError(f"{name}: {t.name} {shape} needs {O * rb} bytes ({O} rows of {rb}), got {raw.size}")
    return QTensor(raw.reshape(O, rb), np.empty(0, np.float32), t.fmt, O, I, t.block_size, name)

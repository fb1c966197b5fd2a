"""fmt 0–6: one table of byte-count facts and one numpy codec class per fmt (docs/format.md#formats).

Encoders reproduce upstream's converter ``c/tools/convert_fp8_to_int4.py`` (@20b6143,
docs/format.md#formats) bit for bit, padding bytes included: the converter receives float32 weights
(torch ``.to(float32).numpy()``) and computes in float32 — ``s = max(amax / qmax, 1e-8)``,
``v = clip(rint(w / s), lo, qmax)`` (``np.rint`` rounds half to even). Every codec works on all
rows / groups at once; nothing loops over rows or blocks.

Padding, as the *Python* converter writes it (the C packers differ; padding is never read):

* fmt 2/4, odd I: the unused high nibble of a row's last byte is 0.
* fmt 3, I % 4 != 0: the converter ORs codes into a zeroed byte only for real elements, so the
  unused 2-bit slots are 0 (they would read as code 0, i.e. value -2).
* fmt 5, partial last group: code 4 (low plane bits 00, high-plane bit 1), i.e. value 0.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import numpy as np

FMT_NAMES = {
    0: "f32",
    1: "int8-row",
    2: "int4-row",
    3: "int2-row",
    4: "int4-grouped",
    5: "int3-g64",
    6: "e8-iq3-lattice",
}
FMT_BY_NAME = {name: fmt for fmt, name in FMT_NAMES.items()}

# Upstream's detect_group_size probes these in this order (c/colibri.c); the order decides
# which gs a shared scale count is read as (docs/format.md#detection).
GS_CANDIDATES = (16, 32, 48, 64, 96, 128, 192, 256)
DEFAULT_GS = 64  # converter default --group-size

SCALE_FLOOR = np.float32(1e-8)
I3_GROUP, I3_GROUP_BYTES = 64, 24
E8_BLOCK, E8_BLOCK_BYTES = 256, 98
# The converter quantizes in blocks of COLI_QUANT_ROWS=8192 rows to cap the float32
# temporaries (embed/lm_head are ~150k rows); we do the same.
ROWS_PER_CHUNK = 8192


class FormatError(ValueError):
    """Bytes, shapes or arguments that do not describe a valid fmt 0–6 tensor."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pad_last(a: np.ndarray, n: int, value) -> np.ndarray:
    """Pad the last axis of ``a`` to length ``n`` with ``value``."""
    extra = n - a.shape[-1]
    if extra == 0:
        return a
    return np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)], constant_values=value)


def _absmax_quantize(w: np.ndarray, qmax: int, lo: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric absmax over the last axis, exactly as the converter: float32 throughout.

    Returns (integer values in [lo, qmax] as int32, scales float32 with the last axis kept).
    """
    amax = np.abs(w).max(axis=-1, keepdims=True)
    s = np.maximum(amax / np.float32(qmax), SCALE_FLOOR)
    v = np.clip(np.rint(w / s), lo, qmax).astype(np.int32)
    return v, s


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes [..., n] LSB-first, 8/bits per byte -> uint8 [..., n*bits/8]."""
    per_byte = 8 // bits
    grouped = codes.astype(np.uint8).reshape(*codes.shape[:-1], -1, per_byte)
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    return np.bitwise_or.reduce(grouped << shifts, axis=-1).astype(np.uint8)


def _unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`_pack_codes`: uint8 [..., nb] -> codes uint8 [..., nb*8/bits]."""
    per_byte = 8 // bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    codes = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)


class Codec:
    """One fmt: its byte-count facts and its vectorized encoder/decoder.

    Subclasses register themselves (``class Int8Row(Codec, fmt=1)``) and implement
    ``weight_nbytes``, ``scale_count``, ``quantize`` and ``dequantize``. The public
    ``encode``/``decode`` below own all validation; codecs see checked, shaped arrays.
    """

    fmt: ClassVar[int]
    name: ClassVar[str]
    grouped: ClassVar[bool] = False  # True when gs is a free per-tensor parameter (fmt 4)

    def __init_subclass__(cls, fmt: Optional[int] = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if fmt is None:  # an intermediate base shared by several fmts
            return
        cls.fmt = fmt
        cls.name = FMT_NAMES[fmt]
        CODECS[fmt] = cls()

    def weight_nbytes(self, O: int, I: int, gs: Optional[int]) -> int:
        raise NotImplementedError

    def scale_count(self, O: int, I: int, gs: Optional[int]) -> int:
        raise NotImplementedError

    def scale_nbytes(self, O: int, I: int, gs: Optional[int]) -> int:
        return 4 * self.scale_count(O, I, gs)

    def quantize(self, w: np.ndarray, gs: Optional[int]) -> tuple[np.ndarray, np.ndarray]:
        """float32 [O, I] -> (uint8 [O, rowbytes] or flat, float32 scales any shape)."""
        raise NotImplementedError

    def dequantize(self, packed: np.ndarray, scales: np.ndarray, O: int, I: int,
                   gs: Optional[int]) -> np.ndarray:
        """uint8 [O, rowbytes], float32 [scale_count] -> float32 [O, I]."""
        raise NotImplementedError


CODECS: dict[int, Codec] = {}


class F32(Codec, fmt=0):
    def weight_nbytes(self, O, I, gs):
        return 4 * O * I

    def scale_count(self, O, I, gs):
        return 0

    def quantize(self, w, gs):
        return np.ascontiguousarray(w, dtype="<f4").view(np.uint8), np.zeros(0, np.float32)

    def dequantize(self, packed, scales, O, I, gs):
        return np.ascontiguousarray(packed).view("<f4").reshape(O, I).astype(np.float32)


class _PerRow(Codec):
    """Shared by the per-row formats: one float32 scale per output row."""

    qmax: ClassVar[int]
    lo: ClassVar[int]

    def scale_count(self, O, I, gs):
        return O

    def dequantize(self, packed, scales, O, I, gs):
        values = self.values(packed, I).astype(np.float32)
        return values * scales.reshape(O, 1)


class Int8Row(_PerRow, fmt=1):
    qmax, lo = 127, -128

    def weight_nbytes(self, O, I, gs):
        return O * I

    def quantize(self, w, gs):
        v, s = _absmax_quantize(w, self.qmax, self.lo)
        return v.astype(np.int8).view(np.uint8), s

    def values(self, packed, I):
        return packed.view(np.int8)


class Int4Row(_PerRow, fmt=2):
    """Nibble ``v + 8``; even element in the low nibble (docs/format.md#formats)."""

    qmax, lo = 7, -8

    def weight_nbytes(self, O, I, gs):
        return O * _ceil_div(I, 2)

    def quantize(self, w, gs):
        v, s = _absmax_quantize(w, self.qmax, self.lo)
        return pack_int4(v), s

    def values(self, packed, I):
        return _unpack_codes(packed, 4)[:, :I].astype(np.int8) - np.int8(8)


class Int2Row(_PerRow, fmt=3):
    """2-bit ``v + 2``, element 0 in the least-significant pair (docs/format.md#formats)."""

    qmax, lo = 1, -2

    def weight_nbytes(self, O, I, gs):
        return O * _ceil_div(I, 4)

    def quantize(self, w, gs):
        v, s = _absmax_quantize(w, self.qmax, self.lo)
        codes = _pad_last(v + 2, 4 * _ceil_div(w.shape[1], 4), 0)  # converter leaves 00
        return _pack_codes(codes, 2), s

    def values(self, packed, I):
        return _unpack_codes(packed, 2)[:, :I].astype(np.int8) - np.int8(2)


def pack_int4(v: np.ndarray) -> np.ndarray:
    """int values [O, I] in [-8, 7] -> uint8 [O, ceil(I/2)]; odd I pads the high nibble with 0."""
    codes = _pad_last(v + 8, 2 * _ceil_div(v.shape[1], 2), 0)
    return _pack_codes(codes, 4)


class Int4Grouped(Codec, fmt=4):
    """fmt 2's bytes with one scale per ``gs`` inputs, scales row-major [O, ceil(I/gs)]."""

    grouped = True
    qmax, lo = 7, -8

    def weight_nbytes(self, O, I, gs):
        return O * _ceil_div(I, 2)

    def scale_count(self, O, I, gs):
        return O * _ceil_div(I, gs)

    def quantize(self, w, gs):
        O, I = w.shape
        ng = _ceil_div(I, gs)
        # The converter zero-pads each row to ng*gs before taking group amax (quant_int4_grouped).
        groups = _pad_last(w, ng * gs, 0).reshape(O, ng, gs)
        v, s = _absmax_quantize(groups, self.qmax, self.lo)
        return pack_int4(v.reshape(O, ng * gs)[:, :I]), s

    def dequantize(self, packed, scales, O, I, gs):
        ng = _ceil_div(I, gs)
        values = _unpack_codes(packed, 4)[:, :I].astype(np.float32) - np.float32(8)
        grouped = _pad_last(values, ng * gs, 0).reshape(O, ng, gs)
        return (grouped * scales.reshape(O, ng, 1)).reshape(O, ng * gs)[:, :I]


class Int3G64(Codec, fmt=5):
    """24-byte groups of 64: 16-byte low-2-bit plane + 8-byte high-bit plane (docs/format.md#fmt-5-int3-g64)."""

    qmax, lo = 3, -4

    def weight_nbytes(self, O, I, gs):
        return O * I3_GROUP_BYTES * _ceil_div(I, I3_GROUP)

    def scale_count(self, O, I, gs):
        return O * _ceil_div(I, I3_GROUP)

    def quantize(self, w, gs):
        O, I = w.shape
        ng = _ceil_div(I, I3_GROUP)
        groups = _pad_last(w, ng * I3_GROUP, 0).reshape(O, ng, I3_GROUP)
        v, s = _absmax_quantize(groups, self.qmax, self.lo)
        codes = (v + 4).reshape(O, ng * I3_GROUP)
        codes[:, I:] = 4  # converter: "pad packs as 0 after -4"
        codes = codes.reshape(O, ng, I3_GROUP)
        low = _pack_codes(codes & 3, 2)
        high = _pack_codes(codes >> 2, 1)
        return np.concatenate([low, high], axis=-1), s

    def dequantize(self, packed, scales, O, I, gs):
        ng = _ceil_div(I, I3_GROUP)
        blocks = packed.reshape(O, ng, I3_GROUP_BYTES)
        codes = _unpack_codes(blocks[..., :16], 2) | (_unpack_codes(blocks[..., 16:], 1) << 2)
        values = codes.astype(np.float32) - np.float32(4)
        return (values * scales.reshape(O, ng, 1)).reshape(O, ng * I3_GROUP)[:, :I]


class E8Lattice(Codec, fmt=6):
    """256-weight super-blocks of 98 bytes; the codec lives in :mod:`colibri_mlx.formats.e8`.

    ``quantize`` takes the *unrotated* weight (the converter's ``quant_e8`` rotates first);
    ``dequantize`` returns the stored *rotated* matrix ``W @ Q``.
    """

    def weight_nbytes(self, O, I, gs):
        return O * E8_BLOCK_BYTES * _ceil_div(I, E8_BLOCK)

    def scale_count(self, O, I, gs):
        return 1

    def quantize(self, w, gs):
        return _e8_module().encode_e8(w)

    def dequantize(self, packed, scales, O, I, gs):
        return _e8_module().decode_e8(packed.reshape(-1), O, I)


def _e8_module():
    """The fmt 6 codec, imported when first needed (a separate, heavier module)."""
    try:
        from . import e8
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.e8":
            raise
        raise FormatError("fmt 6 (e8-iq3-lattice) needs colibri_mlx.formats.e8, which is not installed") from None
    return e8

# ---------------------------------------------------------------------------------------
# Public surface: every byte-count question and every encode/decode goes through here.


def codec(fmt: int) -> Codec:
    try:
        return CODECS[int(fmt)]
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"unknown fmt {fmt!r}; colibri_mlx reads fmt 0-6 ({FMT_NAMES})") from None


def _check_shape(O, I) -> tuple[int, int]:
    if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1
               for n in (O, I)):
        raise FormatError(f"shape [O={O!r}, I={I!r}] must be two positive integers")
    return int(O), int(I)


def _check_gs(fmt: int, gs, *, required: bool) -> Optional[int]:
    """Normalize ``gs``: a positive int for fmt 4, None (or 64 for fmt 5) otherwise."""
    if fmt == 4:
        if gs is None:
            if required:
                raise FormatError("fmt 4 (int4-grouped) needs a group size gs")
            return None
        if isinstance(gs, bool) or not isinstance(gs, (int, np.integer)) or gs < 1:
            raise FormatError(f"fmt 4 group size must be a positive integer, got {gs!r}")
        return int(gs)
    if gs is None or (fmt == 5 and gs == I3_GROUP):
        return None
    raise FormatError(f"fmt {fmt} ({FMT_NAMES[fmt]}) takes no group size, got gs={gs!r}")


def weight_nbytes(fmt: int, O: int, I: int, gs: Optional[int] = None) -> int:
    """Bytes of the packed weight tensor ``<name>`` (docs/format.md#detection; gs is not needed)."""
    c = codec(fmt)
    O, I = _check_shape(O, I)
    return c.weight_nbytes(O, I, _check_gs(c.fmt, gs, required=False))


def scale_nbytes(fmt: int, O: int, I: int, gs: Optional[int] = None) -> int:
    """Bytes of the float32 ``<name>.qs`` tensor (0 for fmt 0, which has none)."""
    c = codec(fmt)
    O, I = _check_shape(O, I)
    return c.scale_nbytes(O, I, _check_gs(c.fmt, gs, required=True))


def encode(fmt: int, w, gs: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``w[O, I]`` as upstream's converter does -> (packed uint8 1-D, scales float32 1-D).

    ``w`` is cast to float32 first (the converter only ever sees float32). fmt 4 defaults to
    the converter's gs=64. fmt 6 takes the *unrotated* weight and stores ``W @ Q``.
    """
    c = codec(fmt)
    gs = DEFAULT_GS if (c.fmt == 4 and gs is None) else gs
    gs = _check_gs(c.fmt, gs, required=c.grouped)
    w = np.asarray(w)
    if w.ndim != 2 or 0 in w.shape:
        raise FormatError(f"encode fmt {c.fmt}: expected a non-empty 2-D weight [O, I], got shape {w.shape}")
    if not (np.issubdtype(w.dtype, np.floating) or np.issubdtype(w.dtype, np.integer)):
        raise FormatError(f"encode fmt {c.fmt}: expected a real-valued weight, got dtype {w.dtype}")
    w = np.ascontiguousarray(w, dtype=np.float32)
    if c.fmt != 0 and not np.isfinite(w).all():
        raise FormatError(f"encode fmt {c.fmt}: weight has non-finite values; absmax scales would be NaN")
    O, I = w.shape
    if c.fmt in (0, 6) or O <= ROWS_PER_CHUNK:
        packed, scales = c.quantize(w, gs)
    else:  # rows are independent, so chunking is bit-identical; it caps the temporaries
        parts = [c.quantize(w[r:r + ROWS_PER_CHUNK], gs) for r in range(0, O, ROWS_PER_CHUNK)]
        packed = np.concatenate([p.reshape(-1) for p, _ in parts])
        scales = np.concatenate([s.reshape(-1) for _, s in parts])
    packed = np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1)
    scales = np.ascontiguousarray(scales, dtype=np.float32).reshape(-1)
    _check_lengths(c, packed.size, scales.size, O, I, gs, "encoder output")
    return packed, scales


def decode(fmt: int, packed, scales, O: int, I: int, gs: Optional[int] = None) -> np.ndarray:
    """Dequantize container bytes -> float32 ``[O, I]`` (the rotated ``W @ Q`` for fmt 6)."""
    c = codec(fmt)
    O, I = _check_shape(O, I)
    gs = _check_gs(c.fmt, gs, required=c.grouped)
    packed, scales = np.asarray(packed), np.asarray(scales)
    if packed.dtype == np.int8:  # the engine also accepts I8 weight tensors
        packed = packed.view(np.uint8)
    if packed.dtype != np.uint8 or packed.ndim != 1:
        raise FormatError(f"decode fmt {c.fmt}: packed weights must be 1-D uint8, got {packed.dtype} {packed.shape}")
    if scales.dtype != np.float32 or scales.ndim != 1:
        raise FormatError(f"decode fmt {c.fmt}: scales must be 1-D float32, got {scales.dtype} {scales.shape}")
    _check_lengths(c, packed.size, scales.size, O, I, gs, "decode input")
    rows = np.ascontiguousarray(packed).reshape(O, -1)
    out = c.dequantize(rows, scales, O, I, gs)
    return np.ascontiguousarray(out, dtype=np.float32)


def _check_lengths(c: Codec, n_packed: int, n_scales: int, O: int, I: int, gs, what: str) -> None:
    want_w, want_s = c.weight_nbytes(O, I, gs), c.scale_count(O, I, gs)
    gs_text = f", gs={gs}" if gs else ""
    if n_packed != want_w or n_scales != want_s:
        raise FormatError(
            f"{what}: fmt {c.fmt} ({c.name}) [{O}, {I}{gs_text}] needs {want_w} weight bytes and "
            f"{want_s} float32 scales; got {n_packed} bytes and {n_scales} scales")

"""MLX's quantization formats (``mx.quantize`` modes, what mlx-lm checkpoints store) as QTensor fmt 7-10.

One table row per mode (docs/format.md#mlx-quantization-formats). Every mode packs codes LSB-first
into little-endian uint32 words, ``I * bits / 32`` words per row; a row is one continuous bit
stream, so 3-, 5- and 6-bit codes straddle word boundaries. Groups of ``group_size`` consecutive
inputs of a row share a scale:

* fmt 7 ``affine``: ``w = q * scale + bias``, q unsigned; scales and biases float32/float16/
  bfloat16 ``[O, I / gs]`` (the checkpoint's dtype, kept as stored).
* fmt 8 ``mxfp4``: E2M1 codes times an E8M0 scale ``2**(e - 127)`` (uint8), gs 32.
* fmt 9 ``nvfp4``: E2M1 codes times an E4M3 scale (uint8), gs 16.
* fmt 10 ``mxfp8``: E4M3 codes times an E8M0 scale (uint8), gs 32.

bfloat16 scales/biases are held as their raw uint16 bits in numpy (numpy has no bfloat16) and as
``mx.bfloat16`` in MLX; :func:`float_bits_as_f32` widens either exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .codecs import FormatError
from .qtensor import QTensor


@dataclass(frozen=True)
class MlxMode:
    fmt: int
    mode: str
    bits: tuple[int, ...]       # allowed code widths
    group_sizes: tuple[int, ...]
    has_biases: bool
    scale_kind: str             # "float" (checkpoint dtype), "e8m0" or "e4m3"
    code_kind: str              # "uint" (affine), "e2m1" or "e4m3"


MLX_MODES = {
    "affine": MlxMode(7, "affine", (2, 3, 4, 5, 6, 8), (32, 64, 128), True, "float", "uint"),
    "mxfp4": MlxMode(8, "mxfp4", (4,), (32,), False, "e8m0", "e2m1"),
    "nvfp4": MlxMode(9, "nvfp4", (4,), (16,), False, "e4m3", "e2m1"),
    "mxfp8": MlxMode(10, "mxfp8", (8,), (32,), False, "e8m0", "e4m3"),
}
MLX_FMTS = {m.fmt: m for m in MLX_MODES.values()}
MLX_FMT_NAMES = {m.fmt: f"mlx-{m.mode}" for m in MLX_MODES.values()}

# E2M1: sign | 2 exponent bits (bias 1) | 1 mantissa bit.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def _e4m3_table() -> np.ndarray:
    """E4M3 (OCP "fn": bias 7, no infinities, 0x7F/0xFF NaN) for all 256 codes."""
    c = np.arange(256, dtype=np.int32)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, c & 7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1.0 + m / 8.0) * 2.0 ** (e - 7.0))
    out = (sign * mag).astype(np.float32)
    out[(c & 0x7F) == 0x7F] = np.nan
    return out


def _e8m0_table() -> np.ndarray:
    """E8M0 scales: ``2**(e - 127)`` as MLX reads them: the float32 with exponent bits ``e``, so
    0xFF is +inf (the OCP spec's NaN; MLX never writes it) and 0 is the subnormal 2**-127."""
    e = np.arange(256, dtype=np.uint32)
    out = (e << np.uint32(23)).view(np.float32).copy()
    out[0] = np.float32(2.0 ** -127)
    return out


E4M3_VALUES = _e4m3_table()
E8M0_VALUES = _e8m0_table()
CODE_TABLES = {"e2m1": E2M1_VALUES, "e4m3": E4M3_VALUES}
SCALE_TABLES = {"e8m0": E8M0_VALUES, "e4m3": E4M3_VALUES}

# Rows decoded per chunk by the numpy reference: the bit unpacking holds 8 bytes per code bit.
_ROWS_PER_CHUNK = 1024


def mlx_mode(mode: str) -> MlxMode:
    try:
        return MLX_MODES[mode]
    except KeyError:
        raise FormatError(f"unknown MLX quantization mode {mode!r}; expected one of {sorted(MLX_MODES)}") from None


def check_params(mode: str, bits: int, group_size: int, name: str = "") -> MlxMode:
    m = mlx_mode(mode)
    where = f"{name}: " if name else ""
    if bits not in m.bits:
        raise FormatError(f"{where}MLX mode {mode!r} takes bits in {m.bits}, got {bits!r}")
    if group_size not in m.group_sizes:
        raise FormatError(f"{where}MLX mode {mode!r} takes group_size in {m.group_sizes}, got {group_size!r}")
    return m


def _to_numpy(a):
    """numpy view of an ``mx.array`` or array-like; bfloat16 becomes its raw uint16 bits."""
    try:
        import mlx.core as mx
    except ImportError:  # pragma: no cover - MLX is a dependency
        mx = None
    if mx is not None and isinstance(a, mx.array):
        if a.dtype == mx.bfloat16:
            return np.asarray(a.view(mx.uint16))
        return np.asarray(a)
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a   # ml_dtypes.bfloat16


def float_bits_as_f32(a, bf16_bits: bool) -> np.ndarray:
    """float32 copy of float32/float16 scales, or of bfloat16 stored as uint16 bits (exact)."""
    a = _to_numpy(a)
    if bf16_bits or a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    if a.dtype not in (np.float32, np.float16):
        raise FormatError(f"affine scales/biases must be float32, float16 or bfloat16, got {a.dtype}")
    return a.astype(np.float32)


def _round_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), returned as float32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def _round_to(kind: str, a: np.ndarray) -> np.ndarray:
    if kind == "float16":
        return a.astype(np.float16).astype(np.float32)
    if kind == "bfloat16":
        return _round_bf16(a)
    return a


def _float_kind(a) -> str:
    if _is_bf16(a):
        return "bfloat16"
    return str(_to_numpy(a).dtype)


def _is_bf16(a) -> bool:
    try:
        import mlx.core as mx
        if isinstance(a, mx.array):
            return a.dtype == mx.bfloat16
    except ImportError:  # pragma: no cover
        pass
    return np.asarray(a).dtype.name in ("uint16", "bfloat16")


def qtensor_from_mlx(weight, scales, biases=None, *, mode: str = "affine", bits: int = 4,
                     group_size: int = 64, name: str = "") -> QTensor:
    """A QTensor over one MLX-quantized matrix exactly as stored: ``weight`` uint32 ``[O, I*bits/32]``,
    ``scales`` ``[O, I/group_size]`` (float for affine, uint8 E8M0/E4M3 for the fp modes), ``biases``
    like scales for affine and None otherwise. numpy arrays or ``mx.array``; nothing is copied or cast
    (bfloat16 stays bfloat16; numpy bfloat16 may be ``ml_dtypes.bfloat16`` or its raw uint16 bits). Shapes and dtypes are checked against mode/bits/group_size."""
    m = check_params(mode, bits, group_size, name)
    label = name or "<unnamed>"
    w_dtype = str(getattr(weight, "dtype", np.asarray(weight).dtype)).replace("mlx.core.", "")
    if w_dtype != "uint32":
        raise FormatError(f"{label}: MLX-quantized weight must be uint32, got {w_dtype}")
    shape = tuple(int(n) for n in weight.shape)
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise FormatError(f"{label}: MLX-quantized weight must be 2-D [O, I*bits/32], got shape {shape}")
    O, words = shape
    if (words * 32) % bits:
        raise FormatError(f"{label}: {words} uint32 words per row do not hold a whole number of {bits}-bit codes")
    I = words * 32 // bits
    if I % group_size:
        raise FormatError(f"{label}: input width {I} (from {words} words of {bits}-bit codes) is not a "
                          f"multiple of group_size {group_size}")
    want = (O, I // group_size)
    s_dtype = str(scales.dtype).replace("mlx.core.", "")
    if tuple(int(n) for n in scales.shape) != want:
        raise FormatError(f"{label}: scales must be {list(want)} for weight {list(shape)} "
                          f"({mode}, bits={bits}, group_size={group_size}), got {list(scales.shape)}")
    if m.has_biases:
        if s_dtype not in ("float32", "float16", "bfloat16", "uint16"):
            raise FormatError(f"{label}: affine scales must be float32, float16 or bfloat16 "
                              f"(numpy: uint16 bfloat16 bits), got {s_dtype}")
        if biases is None:
            raise FormatError(f"{label}: affine quantization needs biases")
        b_dtype = str(biases.dtype).replace("mlx.core.", "")
        if tuple(int(n) for n in biases.shape) != want or b_dtype != s_dtype:
            raise FormatError(f"{label}: biases must be {s_dtype} {list(want)} like the scales, "
                              f"got {b_dtype} {list(biases.shape)}")
    else:
        if s_dtype != "uint8":
            raise FormatError(f"{label}: {mode} scales must be uint8 ({m.scale_kind}), got {s_dtype}")
        if biases is not None:
            raise FormatError(f"{label}: {mode} has no biases, got an array")
    return QTensor(weight, scales, m.fmt, O, I, group_size, name, bits=bits, biases=biases)


def _unpack_codes(words: np.ndarray, bits: int, I: int) -> np.ndarray:
    """uint32 ``[R, I*bits/32]`` -> codes uint32 ``[R, I]``: each row one LSB-first bit stream."""
    R = words.shape[0]
    if bits in (2, 4, 8):   # codes never straddle a word: shifts and masks
        per = 32 // bits
        shifts = (np.arange(per, dtype=np.uint32) * bits)
        return ((words[..., None] >> shifts) & np.uint32((1 << bits) - 1)).reshape(R, I)
    raw = np.ascontiguousarray(words.astype("<u4")).view(np.uint8)
    bitplane = np.unpackbits(raw, axis=-1, bitorder="little").reshape(R, I, bits)
    weights = (np.uint32(1) << np.arange(bits, dtype=np.uint32))
    return (bitplane.astype(np.uint32) * weights).sum(axis=-1, dtype=np.uint32)


def decode_mlx(qt: QTensor, *, exact: bool = False) -> np.ndarray:
    """``[O, I]`` of an MLX-format QTensor: float32 bit-equal to ``mx.dequantize(..., dtype=float32)``
    (affine with float16/bfloat16 scales rounds ``q * s`` and ``+ b`` to that dtype, as MLX does), or
    with ``exact`` the float64 ``q * s + b`` / ``code * scale`` without roundings (what the GPU
    kernels compute in float32, the oracle of their tests)."""
    m = MLX_FMTS[qt.fmt]
    words = _to_numpy(qt.packed).reshape(qt.O, -1)
    gs, ng = qt.gs, qt.I // qt.gs
    ft = np.float64 if exact else np.float32
    if m.has_biases:
        kind = "float32" if exact else _float_kind(qt.scales)
        bf16 = _is_bf16(qt.scales)
        scales = float_bits_as_f32(qt.scales, bf16).reshape(qt.O, ng, 1).astype(ft)
        biases = float_bits_as_f32(qt.biases, bf16).reshape(qt.O, ng, 1).astype(ft)
    else:
        scales = SCALE_TABLES[m.scale_kind][_to_numpy(qt.scales).reshape(qt.O, ng)][..., None].astype(ft)
    out = np.empty((qt.O, qt.I), ft)
    for r0 in range(0, qt.O, _ROWS_PER_CHUNK):
        r1 = min(qt.O, r0 + _ROWS_PER_CHUNK)
        codes = _unpack_codes(words[r0:r1], qt.bits, qt.I).reshape(r1 - r0, ng, gs)
        if m.has_biases:
            # MLX computes in the scales' dtype: the product is rounded to it, then the sum
            # (q * s is exact in float32: at most 8 + 11 significant bits).
            v = _round_to(kind, _round_to(kind, codes.astype(ft) * scales[r0:r1]) + biases[r0:r1])
        else:
            with np.errstate(invalid="ignore", over="ignore"):   # 0 x inf scale is NaN, as in MLX
                v = CODE_TABLES[m.code_kind][codes].astype(ft) * scales[r0:r1]
        out[r0:r1] = v.reshape(r1 - r0, qt.I)
    return out


def describe(qt: QTensor) -> str:
    m = MLX_FMTS[qt.fmt]
    return f"{m.mode} {qt.bits}-bit g{qt.gs}" if m.mode == "affine" else f"{m.mode} g{qt.gs}"

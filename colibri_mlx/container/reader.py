"""Container: a directory of safetensors shards read lazily as QTensors and numpy arrays.

Opening validates every shard header up front (safetensors_reader) and the `.qs` pairing;
tensor bytes are only touched when asked for, as read-only views into one memory map per
shard (pages load on first access; nothing reads a whole shard).
"""

from __future__ import annotations

import json
import mmap
import os
from functools import cached_property
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from ..formats import FMT_BY_NAME, FMT_NAMES, FormatError, QTensor, resolve_format, scale_nbytes, weight_nbytes
from .files import check_file, read_json_object
from .safetensors_reader import DTYPES, UNSHAPED_DTYPES, ContainerError, ShardHeader, TensorInfo, read_shard_header
from .shapes import expected_shapes
from .writer import STAMP_KEY

UPSTREAM_STAMP_KEY = "colibri.fmt"  # optional upstream stamp {name: fmt name} (docs/format.md#format-stamps)
SCALE_DTYPES = frozenset(("F32", "BF16", "F16"))  # upstream's st_read_f32 widens these
QUANT_DTYPES = UNSHAPED_DTYPES  # U8, I8
MAX_SHARDS = 512  # upstream ST_MAX_SHARDS
Stamp = Union[tuple, str]  # what resolve_format accepts


class Container:
    """A colibri container directory (docs/format.md).

    * ``tensor(name, shape=None)``: a QTensor for ``<name>`` (U8/I8) + ``<name>.qs``; otherwise
      the stored numpy array as a read-only memory-mapped view in its stored dtype. BF16 comes
      back as its uint16 bit patterns and F8_E4M3 / F8_E8M0 as uint8 bit patterns (numpy has no
      such dtypes): use ``array(name)`` for float32 values. A U8/I8 tensor without ``.qs`` that
      config.json does not describe as a 2-D weight comes back as its stored bytes.
    * ``array(name, dtype=np.float32)``: values converted (bf16/f16/fp8 widened exactly,
      quantized tensors dequantized; fmt 6 in its stored rotated basis ``W @ Q``).
    * ``[O, I]`` comes from ``shape=`` or from ``expected_shapes(config)`` (config.json).
    """

    def __init__(self, path: str | os.PathLike, config: Optional[dict] = None):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise ContainerError(f"{self.path}: not a container directory")
        # Hidden names are not shards: macOS writes "._out-00000.safetensors" AppleDouble files
        # beside every file on exFAT/FAT drives (upstream would try to parse them and fail).
        self.shards: list[str] = sorted(
            os.path.join(self.path, f) for f in os.listdir(self.path)
            if f.endswith(".safetensors") and not f.startswith("."))
        if not self.shards:
            raise ContainerError(f"{self.path}: no *.safetensors shards in the directory")
        if len(self.shards) > MAX_SHARDS:
            raise ContainerError(f"{self.path}: {len(self.shards)} shards; upstream reads at most {MAX_SHARDS}")
        for shard in self.shards:  # regular files, symlinks only within the directory or a hub blob store
            check_file(shard, self.path, "a safetensors shard")
        self.config: dict = config if config is not None else _read_config(self.path)
        self._headers: dict[str, ShardHeader] = {p: read_shard_header(p) for p in self.shards}
        self._index: dict[str, TensorInfo] = _build_index(self._headers.values())
        _check_scale_pairing(self._index)
        self._stamps: dict[str, Stamp] = _read_stamps(self._headers.values(), self._index)
        self._maps: dict[str, mmap.mmap] = {}

    # -- index ---------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every stored tensor name (``.qs`` companions included), sorted."""
        return sorted(self._index)

    def weight_names(self) -> list[str]:
        """Stored names without the ``.qs`` companions: one per logical tensor."""
        return sorted(n for n in self._index if not self.is_scale(n))

    def is_scale(self, name: str) -> bool:
        return name.endswith(".qs") and name[:-3] in self._index

    def is_quantized(self, name: str) -> bool:
        return name + ".qs" in self._index

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._index)

    def info(self, name: str) -> TensorInfo:
        """Header facts of one stored tensor: dtype, shape, nbytes, file offset, shard path."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r} in the container") from None

    def metadata(self, shard: str) -> dict[str, str]:
        return dict(self._headers[shard].metadata)

    def shard_tensors(self, shard: str) -> list[str]:
        """The tensor names one shard's header holds."""
        return sorted(self._headers[shard].tensors)

    def stamp(self, name: str) -> Optional[Stamp]:
        """``(fmt, gs)`` recorded by our writer, upstream's fmt name, or None (unstamped)."""
        return self._stamps.get(name)

    @cached_property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """``expected_shapes(self.config)``; empty without config.json."""
        if not self.config:
            return {}
        try:
            return expected_shapes(self.config)
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # inf / NaN as a count: OverflowError
            raise ContainerError(f"{self.path}/config.json: cannot derive tensor shapes: {e}") from None

    # -- tensors -------------------------------------------------------------------------------
    def tensor(self, name: str, shape: Optional[Sequence[int]] = None):
        """QTensor for a quantized weight, else the stored array (memory-mapped, stored dtype)."""
        info = self.info(name)
        if self.is_quantized(name):
            O, I = self._matrix_shape(info, shape)
            res = self._resolve(info, O, I)
            return QTensor(self.raw(name), self._scales(name), res.fmt, O, I, res.gs, name)
        if info.dtype in QUANT_DTYPES:
            self._check_unscaled_bytes(info, shape)
        else:
            self._check_float_shape(info, shape)
        return self._view(info)

    def array(self, name: str, dtype=np.float32, shape: Optional[Sequence[int]] = None) -> np.ndarray:
        """Values as ``dtype`` (float32 by default): dequantized or widened; a new array."""
        t = self.tensor(name, shape)
        if isinstance(t, QTensor):
            return t.dequantize().astype(dtype, copy=False)
        return to_float32(t, self.info(name).dtype).astype(dtype, copy=False)

    def resolve(self, name: str, shape: Optional[Sequence[int]] = None):
        """``resolve_format`` result for a quantized tensor (fmt, gs, ambiguous, readings)."""
        info = self.info(name)
        if not self.is_quantized(name):
            raise ContainerError(f"{info.path}: tensor {name!r}: not quantized (no {name}.qs)")
        O, I = self._matrix_shape(info, shape)
        return self._resolve(info, O, I)

    def raw(self, name: str) -> np.ndarray:
        """Exactly the stored bytes of one tensor, as a read-only uint8 view."""
        info = self.info(name)
        return np.frombuffer(self._map(info.path), np.uint8, info.nbytes, info.offset)

    def read_bytes(self, name: str) -> bytes:
        """The stored bytes of one tensor with a single ``pread`` (no memory map)."""
        info = self.info(name)
        try:
            with open(info.path, "rb") as f:
                data = os.pread(f.fileno(), info.nbytes, info.offset)
        except OSError as e:
            raise ContainerError(f"{info.path}: tensor {name!r}: cannot read: {e}") from None
        if len(data) != info.nbytes:
            raise ContainerError(f"{info.path}: tensor {name!r}: read {len(data)} of {info.nbytes} bytes "
                                 f"(file changed since it was opened?)")
        return data

    def close(self) -> None:
        """Drop the memory maps (each is unmapped once no returned view references it)."""
        self._maps.clear()

    def __enter__(self) -> "Container":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _map(self, path: str) -> mmap.mmap:
        m = self._maps.get(path)
        if m is None:
            try:
                with open(path, "rb") as f:
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:  # ValueError: mmap of a file emptied since
                raise ContainerError(f"{path}: cannot map shard: {e}") from None
            size = len(m)
            if size != self._headers[path].file_size:
                m.close()
                raise ContainerError(f"{path}: file is now {size} bytes, was {self._headers[path].file_size} "
                                     f"when its header was checked")
            self._maps[path] = m
        return m

    def _view(self, info: TensorInfo) -> np.ndarray:
        storage = DTYPES[info.dtype].storage
        count = info.nbytes // storage.itemsize
        flat = np.frombuffer(self._map(info.path), storage, count, info.offset)
        if info.dtype in QUANT_DTYPES and info.numel != count:
            return flat  # upstream ignores the shape of U8/I8 tensors (docs/format.md#header-rules)
        return flat.reshape(info.shape)

    def _scales(self, name: str) -> np.ndarray:
        qs = self.info(name + ".qs")
        return to_float32(self._view(qs), qs.dtype).reshape(-1)

    def _matrix_shape(self, info: TensorInfo, shape) -> tuple[int, int]:
        if shape is None:
            shape = self.shapes.get(info.name)
        if shape is None:
            why = "config.json implies no such weight" if self.config else "the container has no config.json"
            raise ContainerError(f"{info.path}: tensor {info.name!r}: no [O, I] known for this quantized weight "
                                 f"({why}); pass shape=(O, I)")
        if len(shape) != 2 or not all(int(d) > 0 for d in shape):
            raise ContainerError(f"{info.path}: tensor {info.name!r}: shape must be (O, I) with O, I > 0, got {shape}")
        return int(shape[0]), int(shape[1])

    def _resolve(self, info: TensorInfo, O: int, I: int):
        qs = self.info(info.name + ".qs")
        nb, ns = info.nbytes, qs.numel * 4  # scales count as widened float32, as upstream reads them
        stamp = self._stamps.get(info.name)
        try:
            return resolve_format(O, I, nb, ns, stamp)
        except FormatError as e:
            where = "" if qs.path == info.path else f" (scales in {qs.path})"
            raise ContainerError(f"{info.path}: tensor {info.name!r}{where} [O={O}, I={I}]: weight {nb} B + scales "
                                 f"{ns} B match no format ({e}); expected one of {_expected_counts(O, I)}") from None

    def _check_unscaled_bytes(self, info: TensorInfo, shape) -> None:
        shape = shape if shape is not None else self.shapes.get(info.name)
        if shape is not None and len(shape) == 2:
            O, I = int(shape[0]), int(shape[1])
            raise ContainerError(f"{info.path}: tensor {info.name!r}: {info.dtype} weight of {info.nbytes} B for "
                                 f"[{O}, {I}] has no {info.name}.qs scales; a quantized weight needs one of "
                                 f"{_expected_counts(O, I)}")

    def _check_float_shape(self, info: TensorInfo, shape) -> None:
        want = shape if shape is not None else self.shapes.get(info.name)
        if want is not None and tuple(int(d) for d in want) != info.shape:
            raise ContainerError(f"{info.path}: tensor {info.name!r}: stored shape {list(info.shape)}, "
                                 f"expected {list(want)}")


def _read_config(path: str) -> dict:
    cfg = os.path.join(path, "config.json")
    if not os.path.lexists(cfg):
        return {}
    return read_json_object(cfg, path, "config.json")


def _build_index(headers) -> dict[str, TensorInfo]:
    index: dict[str, TensorInfo] = {}
    for h in headers:
        for name, info in h.tensors.items():
            if name in index:
                raise ContainerError(f"tensor {name!r} appears in two shards: {index[name].path} and {h.path}")
            index[name] = info
    return index


def _check_scale_pairing(index: dict[str, TensorInfo]) -> None:
    for name, qs in index.items():
        if not name.endswith(".qs"):
            continue
        weight = index.get(name[:-3])
        if weight is None:
            raise ContainerError(f"{qs.path}: tensor {name!r}: scales without a weight (no {name[:-3]!r} "
                                 f"in any shard)")
        if weight.dtype not in QUANT_DTYPES:
            raise ContainerError(f"{weight.path}: tensor {weight.name!r}: has {name!r} scales but is "
                                 f"{weight.dtype}; expected U8 or I8 packed bytes")
        if qs.dtype not in SCALE_DTYPES:
            raise ContainerError(f"{qs.path}: tensor {name!r}: scales are {qs.dtype}; expected F32, BF16 or F16")


def _read_stamps(headers, index: dict[str, TensorInfo]) -> dict[str, Stamp]:
    stamps: dict[str, Stamp] = {}
    for h in headers:
        for name, stamp in _shard_stamps(h).items():
            if name not in h.tensors or name + ".qs" not in index:
                raise ContainerError(f"{h.path}: tensor {name!r}: format stamp for a tensor that is not a "
                                     f"quantized weight in this shard")
            stamps[name] = stamp
    return stamps


def _shard_stamps(h: ShardHeader) -> dict[str, Stamp]:
    ours = _json_object(h, STAMP_KEY)
    upstream = _json_object(h, UPSTREAM_STAMP_KEY)
    stamps: dict[str, Stamp] = {}
    for name, rec in ours.items():
        if not (isinstance(rec, dict) and rec.get("fmt") in FMT_NAMES and
                (rec.get("gs") is None or (isinstance(rec["gs"], int) and rec["gs"] > 0))):
            raise ContainerError(f"{h.path}: tensor {name!r}: bad {STAMP_KEY} record {rec!r}; expected "
                                 f'{{"fmt": 0..6, "gs": int or null}}')
        stamps[name] = (rec["fmt"], rec.get("gs"))
    for name, fmt_name in upstream.items():
        if name not in h.tensors:
            continue  # upstream ignores stamps of absent tensors too
        fmt = FMT_BY_NAME.get(fmt_name) if isinstance(fmt_name, str) else None
        if fmt is None:
            raise ContainerError(f"{h.path}: tensor {name!r}: {UPSTREAM_STAMP_KEY} names {fmt_name!r}; "
                                 f"expected one of {sorted(FMT_BY_NAME)}")
        if name in stamps and stamps[name][0] != fmt:
            raise ContainerError(f"{h.path}: tensor {name!r}: {STAMP_KEY} says fmt {stamps[name][0]} but "
                                 f"{UPSTREAM_STAMP_KEY} says {fmt_name!r}")
        stamps.setdefault(name, fmt_name)  # a bare name: resolve_format finds fmt 4's gs
    return stamps


def _json_object(h: ShardHeader, key: str) -> dict:
    text = h.metadata.get(key)
    if text is None:
        return {}
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ContainerError(f"{h.path}: __metadata__[{key!r}] is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ContainerError(f"{h.path}: __metadata__[{key!r}] must be a JSON object")
    return obj


def _expected_counts(O: int, I: int) -> str:
    """Human-readable (weight bytes, scale bytes) per fmt 1–6 for an [O, I] weight."""
    parts = []
    for fmt in range(1, 7):
        gs = 64 if fmt == 4 else None
        label = f"fmt {fmt} ({FMT_NAMES[fmt]}{', gs 64' if gs else ''})"
        try:
            parts.append(f"{label}: {weight_nbytes(fmt, O, I, gs)} + {scale_nbytes(fmt, O, I, gs)} B")
        except FormatError:
            continue
    return "; ".join(parts)


# -- dtype widening (numpy has no bf16 / fp8) --------------------------------------------------
def _e4m3fn_table() -> np.ndarray:
    """All 256 OCP FP8 E4M3-FN values: bias 7, no infinities, 0x7F/0xFF NaN."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    value = np.where((b & 0x7F) == 0x7F, np.nan, value)
    return (sign * value).astype(np.float32)


def _e8m0_table() -> np.ndarray:
    """UE8M0 scale bytes: 2^(e-127), 0xFF NaN."""
    e = np.arange(256, dtype=np.float64)
    return np.where(e == 255, np.nan, 2.0 ** (e - 127)).astype(np.float32)


E4M3FN = _e4m3fn_table()
E8M0 = _e8m0_table()
_FP8_TABLES = {"F8_E4M3": E4M3FN, "F8_E8M0": E8M0}


def to_float32(stored: np.ndarray, dtype: str) -> np.ndarray:
    """Exact float32 values of an array in its stored safetensors dtype (bit patterns for bf16/fp8)."""
    if dtype == "BF16":
        return (stored.astype(np.uint32) << 16).view(np.float32)
    if dtype in _FP8_TABLES:
        return _FP8_TABLES[dtype][stored]
    return stored.astype(np.float32)

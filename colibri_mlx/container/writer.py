"""Write one container shard: upstream-compatible safetensors, atomically, streamed.

Byte layout equals `safetensors.numpy.save_file` (checked against safetensors 0.8.0 in
tests/test_container.py): compact JSON header with `__metadata__` first, space-padded so that
8 + header length is a multiple of 8; tensors ordered by safetensors' dtype rank (descending)
then name, no padding between them. That order puts every F32 `.qs` before the U8 weights and
keeps the three projections of one expert adjacent (docs/format.md#tensor-order).

Quantized tensors are stamped in ``__metadata__["colibri_mlx.formats"]`` as a JSON string
``{name: {"fmt": f, "gs": g}}`` so that the reader never has to guess an ambiguous byte count.
Upstream's own ``colibri.fmt`` stamp is deliberately not written: upstream verifies it against
its first-match byte rule for resident tensors, and a tensor that rule reads differently (e.g.
fmt 4 with gs >= I, which upstream reads as fmt 2) would make upstream refuse the shard.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import numpy as np

from ..formats import FormatError, QTensor, scale_nbytes, weight_nbytes
from .safetensors_reader import DTYPES, METADATA_KEY, ContainerError

STAMP_KEY = "colibri_mlx.formats"

# safetensors' `Dtype` enum order; save_file sorts tensors by it, descending (wider first).
_DTYPE_RANK = {name: rank for rank, name in enumerate((
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16",
    "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"))}

_NUMPY_DTYPES = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("uint8"): "U8",
                 np.dtype("int8"): "I8", np.dtype("int64"): "I64", np.dtype("uint64"): "U64"}


@dataclass(frozen=True)
class RawTensor:
    """Bytes of a dtype numpy cannot name (BF16, F8_E4M3, F8_E8M0) given as their bit patterns."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray  # any dtype; its raw bytes are written as-is (little-endian)


TensorLike = Union[np.ndarray, QTensor, RawTensor]


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray  # C-contiguous, little-endian


def write_shard(path: Union[str, os.PathLike], tensors: Mapping[str, TensorLike],
                metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write ``tensors`` to ``path`` as one safetensors shard, atomically.

    A QTensor ``W`` becomes ``W`` (U8, 1-D packed bytes) + ``W.qs`` (F32, 1-D scales) and its
    fmt/gs is stamped in the metadata. Data goes to ``<path>.tmp-<pid>``, is fsynced, then
    renamed over ``path``.
    """
    path = os.fspath(path)
    entries, stamps = _expand(tensors, path)
    meta = _metadata(metadata, stamps, path)
    entries.sort(key=lambda e: (-_DTYPE_RANK[e.dtype], e.name))
    header = _header_bytes(entries, meta)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for e in entries:
                f.write(memoryview(e.data.reshape(-1).view(np.uint8)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _expand(tensors: Mapping[str, TensorLike], path: str) -> tuple[list[_Entry], dict[str, dict]]:
    entries: list[_Entry] = []
    stamps: dict[str, dict] = {}
    for name, t in tensors.items():
        if not isinstance(name, str) or name == METADATA_KEY:
            raise ContainerError(f"{path}: tensor {name!r}: invalid tensor name")
        if isinstance(t, QTensor):
            packed = _little(np.asarray(t.packed).reshape(-1), np.uint8, name, path)
            scales = _little(np.asarray(t.scales).reshape(-1), np.float32, name + ".qs", path)
            gs = _check_qtensor(name, t, packed, scales, path)
            entries.append(_Entry(name, "U8", (packed.size,), packed))
            entries.append(_Entry(name + ".qs", "F32", (scales.size,), scales))
            stamps[name] = {"fmt": int(t.fmt), "gs": gs}
        elif isinstance(t, RawTensor):
            entries.append(_raw_entry(name, t, path))
        elif isinstance(t, np.ndarray):
            dtype = _NUMPY_DTYPES.get(t.dtype.newbyteorder("=") if t.dtype.byteorder == ">" else t.dtype)
            if dtype is None:
                raise ContainerError(f"{path}: tensor {name!r}: numpy dtype {t.dtype} is not storable; expected "
                                     f"one of {sorted(str(d) for d in _NUMPY_DTYPES)} or a RawTensor")
            entries.append(_Entry(name, dtype, tuple(int(d) for d in t.shape), _little(t, t.dtype, name, path)))
        else:
            raise ContainerError(f"{path}: tensor {name!r}: expected numpy array, QTensor or RawTensor, "
                                 f"got {type(t).__name__}")
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ContainerError(f"{path}: tensor names {dup} given twice (a QTensor also writes <name>.qs)")
    return entries, stamps


def _check_qtensor(name: str, t: QTensor, packed: np.ndarray, scales: np.ndarray, path: str) -> Optional[int]:
    """Refuse a QTensor whose bytes do not match its fmt/O/I/gs; returns the gs to stamp."""
    gs = int(t.gs) if t.fmt == 4 and t.gs is not None else None  # only fmt 4 has a free gs
    try:
        want = weight_nbytes(t.fmt, t.O, t.I, gs), scale_nbytes(t.fmt, t.O, t.I, gs)
    except FormatError as e:
        raise ContainerError(f"{path}: tensor {name!r}: invalid QTensor fmt {t.fmt} [{t.O}, {t.I}] gs {t.gs}: {e}") from None
    if t.fmt == 0 or (packed.nbytes, scales.nbytes) != want:
        raise ContainerError(f"{path}: tensor {name!r}: fmt {t.fmt} [{t.O}, {t.I}] gs {gs} needs {want[0]} weight + "
                             f"{want[1]} scale bytes, QTensor has {packed.nbytes} + {scales.nbytes}"
                             + ("; store fmt 0 as a float32 array" if t.fmt == 0 else ""))
    return gs


def _little(a: np.ndarray, dtype, name: str, path: str) -> np.ndarray:
    dtype = np.dtype(dtype).newbyteorder("<")
    if a.dtype.newbyteorder("<") != dtype:
        raise ContainerError(f"{path}: tensor {name!r}: expected dtype {dtype.name}, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=dtype)


def _raw_entry(name: str, t: RawTensor, path: str) -> _Entry:
    if t.dtype not in DTYPES or DTYPES[t.dtype].name != t.dtype:
        raise ContainerError(f"{path}: tensor {name!r}: RawTensor dtype {t.dtype!r} unknown; expected one of "
                             f"{sorted({d.name for d in DTYPES.values()})}")
    data = np.ascontiguousarray(t.data)
    shape = tuple(int(d) for d in t.shape)
    expected = int(np.prod(shape, dtype=np.int64)) * DTYPES[t.dtype].itemsize
    if data.nbytes != expected:
        raise ContainerError(f"{path}: tensor {name!r}: {t.dtype} shape {list(shape)} needs {expected} bytes, "
                             f"data has {data.nbytes}")
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    return _Entry(name, t.dtype, shape, data)


def _metadata(metadata: Optional[Mapping[str, str]], stamps: dict, path: str) -> Optional[dict[str, str]]:
    meta = dict(metadata or {})
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ContainerError(f"{path}: metadata must map str to str, got {k!r}: {type(v).__name__}")
    if stamps:
        if STAMP_KEY in meta:
            raise ContainerError(f"{path}: metadata key {STAMP_KEY!r} is reserved for the writer's format stamp")
        meta[STAMP_KEY] = json.dumps(stamps, separators=(",", ":"), sort_keys=True)
    if metadata is None and not stamps:
        return None
    return dict(sorted(meta.items()))


def _header_bytes(entries: list[_Entry], metadata: Optional[dict[str, str]]) -> bytes:
    header: dict = {}
    if metadata is not None:
        header[METADATA_KEY] = metadata
    offset = 0
    for e in entries:
        nbytes = e.data.nbytes
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return raw + b" " * (-(8 + len(raw)) % 8)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not every platform lets a directory be opened; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

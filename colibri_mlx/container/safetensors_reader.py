"""Strict safetensors header parser: every entry is validated before any tensor byte is touched.

Rules: the safetensors format plus the hardening of upstream colibri's `st_init_multi`
(docs/format.md#header-rules). Like upstream (and unlike the Rust parser) gaps between tensors and trailing
bytes are allowed; overlaps are not. Every failure is a :class:`ContainerError` naming the file, the tensor and
what was expected; nothing here may crash, hang or allocate more than the header itself on
garbage input (tests/test_container_fuzz.py).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import BinaryIO, Optional

import numpy as np

MAX_HEADER_BYTES = 512 << 20  # upstream colibri's cap (st.h); the Rust parser's is 100 MB
INT64_MAX = (1 << 63) - 1
METADATA_KEY = "__metadata__"
TENSOR_KEYS = frozenset(("dtype", "shape", "data_offsets"))


class ContainerError(ValueError):
    """A container file or tensor is malformed or inconsistent (message names file + tensor)."""


@dataclass(frozen=True)
class DType:
    name: str  # canonical safetensors spelling
    itemsize: int
    storage: np.dtype  # numpy dtype the raw bytes are viewed as (bit patterns for bf16/fp8)


# Accepted dtypes (docs/format.md#shards-and-tensors), keyed by every spelling upstream accepts.
_CANONICAL = {
    "F32": DType("F32", 4, np.dtype("<f4")),
    "F16": DType("F16", 2, np.dtype("<f2")),
    "BF16": DType("BF16", 2, np.dtype("<u2")),
    "U8": DType("U8", 1, np.dtype("u1")),
    "I8": DType("I8", 1, np.dtype("i1")),
    "F8_E4M3": DType("F8_E4M3", 1, np.dtype("u1")),
    "F8_E8M0": DType("F8_E8M0", 1, np.dtype("u1")),
    "I64": DType("I64", 8, np.dtype("<i8")),
    "U64": DType("U64", 8, np.dtype("<u8")),
    "U32": DType("U32", 4, np.dtype("<u4")),  # MLX-packed quantized weights (mlx-lm checkpoints)
}
DTYPES: dict[str, DType] = {
    **_CANONICAL,
    "F8_E4M3FN": _CANONICAL["F8_E4M3"],
    "float8_e4m3fn": _CANONICAL["F8_E4M3"],
    "F8_E8M0FNU": _CANONICAL["F8_E8M0"],
}
# Byte counts of these are not tied to their shape (upstream skips the numel check, docs/format.md#header-rules).
UNSHAPED_DTYPES = frozenset(("U8", "I8"))


@dataclass(frozen=True)
class TensorInfo:
    """One header entry. ``offset`` is absolute in the file (header already skipped)."""

    name: str
    dtype: str  # canonical
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    path: str

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize


@dataclass
class ShardHeader:
    path: str
    file_size: int
    data_start: int  # 8 + header length
    metadata: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)


def read_shard_header(path: str | os.PathLike) -> ShardHeader:
    """Open ``path`` and parse and validate its header (reads only the header bytes)."""
    from .files import open_regular  # a FIFO or device must not block or stream endless bytes

    path = os.fspath(path)
    try:
        with open_regular(path, "a safetensors shard") as f:
            size = os.fstat(f.fileno()).st_size
            return parse_shard(f, size, path)
    except OSError as e:
        raise ContainerError(f"{path}: cannot read shard: {e.strerror or e}") from e


def parse_shard(f: BinaryIO, file_size: int, path: str) -> ShardHeader:
    """Validate the header of the seekable file ``f`` of ``file_size`` bytes."""
    if file_size < 8:
        raise ContainerError(f"{path}: file is {file_size} bytes; a safetensors shard needs at least 8 "
                             f"(the u64 header length)")
    f.seek(0)
    (header_len,) = struct.unpack("<Q", _read_exact(f, 8, path))
    if header_len > file_size - 8:
        raise ContainerError(f"{path}: header length {header_len} runs past the end of the file "
                             f"(expected <= file size - 8 = {file_size - 8})")
    if header_len > MAX_HEADER_BYTES:
        raise ContainerError(f"{path}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
    raw = _read_exact(f, header_len, path)
    data_start = 8 + header_len
    header = _parse_json(raw, path)
    metadata = _check_metadata(header.pop(METADATA_KEY, None), path)
    data_size = file_size - data_start
    tensors = {name: _check_entry(name, entry, data_size, data_start, path) for name, entry in header.items()}
    _check_no_overlap(tensors, path)
    return ShardHeader(path, file_size, data_start, metadata, tensors)


def _read_exact(f: BinaryIO, n: int, path: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ContainerError(f"{path}: file ended after {len(data)} of {n} header bytes")
    return data


def _reject_duplicate_keys(pairs):
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise ValueError(f"duplicate key {k!r}")
        obj[k] = v
    return obj


def _reject_constant(token):
    raise ValueError(f"non-standard JSON constant {token}")


def _parse_json(raw: bytes, path: str) -> dict:
    try:
        text = raw.decode("utf-8")
        header = json.loads(text, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # RecursionError: deeply nested garbage; ValueError covers JSONDecodeError and huge ints.
        raise ContainerError(f"{path}: header is not valid UTF-8 JSON: {_short(e)}") from None
    if not isinstance(header, dict):
        raise ContainerError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    return header


def _check_metadata(metadata, path: str) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise ContainerError(f"{path}: {METADATA_KEY} must be an object of strings, got {type(metadata).__name__}")
    for k, v in metadata.items():
        if not isinstance(v, str):
            raise ContainerError(f"{path}: {METADATA_KEY}[{k!r}] must be a string, got {type(v).__name__}")
    return metadata


def _check_entry(name: str, entry, data_size: int, data_start: int, path: str) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ContainerError(f"{where}: entry must be an object with dtype, shape, data_offsets")
    missing = TENSOR_KEYS - entry.keys()
    if missing:
        raise ContainerError(f"{where}: missing {sorted(missing)}")
    extra = entry.keys() - TENSOR_KEYS
    if extra:
        raise ContainerError(f"{where}: unknown keys {sorted(extra)} (expected only dtype, shape, data_offsets)")
    dtype = _check_dtype(entry["dtype"], where)
    shape = _check_shape(entry["shape"], where)
    begin, end = _check_offsets(entry["data_offsets"], data_size, where)
    nbytes = end - begin
    if dtype.name not in UNSHAPED_DTYPES:
        expected = _numel(shape) * dtype.itemsize
        if expected != nbytes:
            raise ContainerError(f"{where}: {dtype.name} shape {list(shape)} needs {expected} bytes, "
                                 f"data_offsets span {nbytes}")
    return TensorInfo(name, dtype.name, shape, data_start + begin, nbytes, path)


def _check_dtype(dtype, where: str) -> DType:
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ContainerError(f"{where}: unsupported dtype {_short(dtype)}; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_shape(shape, where: str) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ContainerError(f"{where}: shape must be a list of non-negative integers, got {_short(shape)}")
    numel = 1
    for d in shape:
        numel *= d
        if numel > INT64_MAX:
            raise ContainerError(f"{where}: shape {_short(shape)} overflows int64")
    return tuple(shape)


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel


def _check_offsets(offsets, data_size: int, where: str) -> tuple[int, int]:
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(v) for v in offsets)):
        raise ContainerError(f"{where}: data_offsets must be two integers [begin, end], got {_short(offsets)}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise ContainerError(f"{where}: data_offsets [{begin}, {end}] out of range; expected "
                             f"0 <= begin <= end <= {data_size} (bytes after the header)")
    return begin, end


def _check_no_overlap(tensors: dict[str, TensorInfo], path: str) -> None:
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    for (_, prev_end, prev), (begin, _, name) in zip(spans, spans[1:]):
        if begin < prev_end:
            raise ContainerError(f"{path}: tensor {name!r} overlaps tensor {prev!r} "
                                 f"(starts at file offset {begin}, {prev!r} ends at {prev_end})")


def _short(value, limit: int = 120) -> str:
    try:
        text = repr(value) if not isinstance(value, BaseException) else str(value)
    except RecursionError:
        text = f"<deeply nested {type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."

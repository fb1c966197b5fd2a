"""Fuzz the strict safetensors header parser: garbage must give ContainerError, never a crash.

Every input either parses into a header whose entries all lie inside the file without
overlapping, or raises ContainerError; any other exception (or a hang) is a bug.
"""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri_mlx.container import ContainerError, parse_shard
from colibri_mlx.container.safetensors_reader import DTYPES

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _parse(data: bytes):
    try:
        header = parse_shard(io.BytesIO(data), len(data), "<fuzz>")
    except ContainerError as e:
        assert "<fuzz>" in str(e)
        return None
    for t in header.tensors.values():
        assert DTYPES[t.dtype].name == t.dtype
        assert all(type(d) is int and d >= 0 for d in t.shape)
        if t.dtype not in ("U8", "I8"):
            assert t.numel * t.itemsize == t.nbytes
    spans = sorted((t.offset, t.offset + t.nbytes) for t in header.tensors.values() if t.nbytes)
    assert all(header.data_start <= a <= b <= len(data) for a, b in spans)
    assert all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:]))
    return header


def _valid_shard(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    tensors = {
        "w": rng.integers(0, 256, int(rng.integers(0, 40)), dtype=np.uint8),
        "w.qs": rng.standard_normal(int(rng.integers(0, 5))).astype(np.float32),
        "b": rng.standard_normal((2, int(rng.integers(0, 4)))).astype(np.float16),
        "i": rng.integers(0, 9, 3, dtype=np.int64),
    }
    return safetensors.numpy.save(tensors, {"k": "v"})


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes(data):
    _parse(data)


@FUZZ
@given(st.binary(max_size=200), st.integers(0, (1 << 64) - 1))
def test_random_header_length(body, n):
    _parse(struct.pack("<Q", n) + body)


@FUZZ
@given(st.integers(0, 1000), st.data())
def test_mutated_valid_shard(seed, data):
    raw = bytearray(_valid_shard(seed))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    _parse(bytes(raw))


@FUZZ
@given(st.integers(0, 1000), st.data())
def test_truncated_valid_shard(seed, data):
    raw = _valid_shard(seed)
    assert _parse(raw) is not None
    cut = data.draw(st.integers(0, len(raw) - 1))
    header = _parse(raw[:cut])
    if header is not None:  # only possible when the cut removed nothing but trailing zero-size data
        assert all(t.offset + t.nbytes <= cut for t in header.tensors.values())


_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=False),
                         st.text(max_size=8))
_json = st.recursive(_json_scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                     max_leaves=12)
_entry = st.fixed_dictionaries({
    "dtype": st.one_of(st.sampled_from(["F32", "F16", "BF16", "U8", "I8", "I64", "U64", "F8_E4M3", "F64", "X"]),
                       _json),
    "shape": st.one_of(st.lists(st.integers(-2, 1 << 40), max_size=3), _json),
    "data_offsets": st.one_of(st.lists(st.integers(-4, 96), min_size=2, max_size=2), _json),
})


@FUZZ
@given(st.dictionaries(st.text(max_size=6), st.one_of(_entry, _json), max_size=5),
       st.binary(max_size=96))
def test_structured_headers(header, body):
    raw = json.dumps(header).encode()
    _parse(struct.pack("<Q", len(raw)) + raw + body)


@st.composite
def _plausible_shard(draw):
    """Mostly-valid headers (in-range offsets, byte-consistent shapes) so overlaps and edge
    offsets are common, with the occasional off-by-one."""
    body = draw(st.binary(min_size=0, max_size=64))
    header = {}
    for i in range(draw(st.integers(0, 5))):
        a = draw(st.integers(0, len(body) + 1))
        b = draw(st.integers(a - 1, len(body) + 1))
        dtype = draw(st.sampled_from(["U8", "I8", "F32", "F16"]))
        size = DTYPES[dtype].itemsize
        n = max(b - a, 0) // size + draw(st.sampled_from([0, 0, 0, 1, -1]))
        shape = draw(st.sampled_from([[n], [1, n], [n, 1], [-n]]))
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [a, b]}
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


@FUZZ
@given(_plausible_shard())
def test_plausible_headers(data):
    _parse(data)

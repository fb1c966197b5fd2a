""".coli_usage: how often each routed expert was selected, in upstream colibri's text format.

docs/format.md#usage-history (upstream ``c/route_trace.h``, ``rt_read_ex`` / ``usage_save``): one record per
line, three whitespace-separated integers ``<layer> <expert> <count>``, sparse (non-zero counts
only), plus two header records with a negative layer field::

    -1 <n_layers> <n_experts>      dimensions: rows 0..n_layers inclusive (row n_layers = MTP)
    -2 1 <engine_id>               format version 1; FNV-1a 32 of the engine name

Headerless legacy files are accepted (dimensions from the largest indices seen). Inkling's
binary ``IKU1`` layout is not read (no model of that family runs here): it is refused by name.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Optional

import numpy as np

USAGE_FILE = ".coli_usage"
FORMAT_VERSION = 1
DIMS_RECORD = -1
VERSION_RECORD = -2
BINARY_MAGIC = b"IKU1"


class UsageError(ValueError):
    """A .coli_usage file is malformed (the message names the file and line)."""


def engine_id(name: str) -> int:
    """FNV-1a 32-bit hash of the engine name (upstream's ``engine_id`` field)."""
    h = 0x811C9DC5
    for b in name.encode("utf-8"):
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


@dataclass
class UsageHistory:
    """Selection counts ``counts[layer, expert]`` (int64), rows ``0..n_layers`` (row n_layers = MTP).

    ``engine`` is the engine id the file was stamped with (None for a legacy headerless file).
    """

    counts: np.ndarray
    engine: Optional[int] = None

    @classmethod
    def empty(cls, n_layers: int, n_experts: int, engine: Optional[int] = None) -> "UsageHistory":
        return cls(np.zeros((n_layers + 1, n_experts), np.int64), engine)

    @property
    def n_layers(self) -> int:
        return self.counts.shape[0] - 1

    @property
    def n_experts(self) -> int:
        return self.counts.shape[1]

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def record(self, layer: int, expert_ids: np.ndarray) -> None:
        """Count one selection per entry of ``expert_ids`` (negative ids = dropped slots, skipped)."""
        ids = np.asarray(expert_ids).reshape(-1)
        ids = ids[ids >= 0]
        np.add.at(self.counts[layer], ids, 1)

    def hottest(self) -> list[tuple[int, int]]:
        """``(layer, expert)`` with a non-zero count, most selected first (ties: lower layer, expert)."""
        layers, experts = np.nonzero(self.counts)
        order = np.lexsort((experts, layers, -self.counts[layers, experts]))
        return [(int(layers[i]), int(experts[i])) for i in order]


MAX_USAGE_BYTES = 256 << 20
MAX_USAGE_LAYERS = 4096      # config_schema's bounds: a file past them is not a usage history
MAX_USAGE_EXPERTS = 16384


def read_usage(path: str | os.PathLike) -> UsageHistory:
    """Parse a .coli_usage file (headered or legacy); raises UsageError naming file and line."""
    from ..container.files import read_bytes

    path = os.fspath(path)
    try:
        data = read_bytes(path, None, "a .coli_usage file", limit=MAX_USAGE_BYTES)  # a FIFO must not block
    except ValueError as e:
        raise UsageError(str(e)) from None
    if data.startswith(BINARY_MAGIC):
        raise UsageError(f"{path}: binary IKU1 usage layout (upstream's inkling engine) is not supported")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a text .coli_usage file") from None
    records = _parse_records(path, text)
    dims, engine = None, None
    entries = []
    for lineno, (a, b, c) in records:
        if a == DIMS_RECORD:
            if b < 0 or c <= 0 or b > MAX_USAGE_LAYERS or c > MAX_USAGE_EXPERTS:
                raise UsageError(f"{path}:{lineno}: bad dimensions record '-1 {b} {c}'")
            dims = (b, c)
        elif a == VERSION_RECORD:
            if b != FORMAT_VERSION:
                raise UsageError(f"{path}:{lineno}: format version {b}, this reader knows {FORMAT_VERSION}")
            if not 0 <= c <= 0xFFFFFFFF:
                raise UsageError(f"{path}:{lineno}: engine id {c} is not a 32-bit unsigned value")
            engine = c
        elif a < 0:
            raise UsageError(f"{path}:{lineno}: unknown header record {a}")
        elif b < 0 or c < 0:
            raise UsageError(f"{path}:{lineno}: negative expert or count in '{a} {b} {c}'")
        elif a > MAX_USAGE_LAYERS or b >= MAX_USAGE_EXPERTS:
            raise UsageError(f"{path}:{lineno}: layer {a}, expert {b}: more layers or experts than any model has")
        else:
            entries.append((lineno, a, b, c))
    if dims is None:  # legacy headerless file
        n_layers = max((a for _, a, _, _ in entries), default=0)
        n_experts = max((b for _, _, b, _ in entries), default=0) + 1
    else:
        n_layers, n_experts = dims
    history = UsageHistory.empty(n_layers, n_experts, engine)
    for lineno, a, b, c in entries:
        if a > n_layers or b >= n_experts:
            raise UsageError(f"{path}:{lineno}: layer {a}, expert {b} outside the declared "
                             f"{n_layers + 1} rows x {n_experts} experts")
        history.counts[a, b] += c
    return history


def _parse_records(path: str, text: str) -> list[tuple[int, tuple[int, int, int]]]:
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 3:
            raise UsageError(f"{path}:{lineno}: expected '<layer> <expert> <count>', got {line.strip()!r}")
        try:
            records.append((lineno, tuple(int(v) for v in fields)))
        except ValueError:
            raise UsageError(f"{path}:{lineno}: expected three integers, got {line.strip()!r}") from None
    return records


def write_usage(path: str | os.PathLike, history: UsageHistory, engine_name: str) -> None:
    """Write ``history`` with both headers, atomically (temporary file + rename)."""
    path = os.fspath(path)
    lines = [f"{DIMS_RECORD} {history.n_layers} {history.n_experts}",
             f"{VERSION_RECORD} {FORMAT_VERSION} {engine_id(engine_name)}"]
    layers, experts = np.nonzero(history.counts)
    lines += [f"{a} {b} {history.counts[a, b]}" for a, b in zip(layers.tolist(), experts.tolist())]
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".coli_usage.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise

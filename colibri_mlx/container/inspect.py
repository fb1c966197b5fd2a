"""`colibri inspect`: what a container holds, tensor by tensor, and whether every tensor resolves.

For each logical tensor (a weight with its ``.qs``, or a plain tensor): fmt, gs, [O, I], stored
bytes, model part (``tensor_class``); totals per fmt and per part; routed-expert count and bytes;
ambiguous byte counts (several fmt/gs readings fit) are flagged with the reading chosen and the
one upstream's engine would take; anything that cannot be read gets a verdict and makes
``report.ok`` false (the CLI then exits 1).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Optional

from ..formats import FMT_NAMES, FormatError, detect_format
from .reader import Container
from .safetensors_reader import ContainerError
from .shapes import TENSOR_CLASSES, expert_key, tensor_class

PROGRESS_MIN_TENSORS = 2000  # below this a progress bar is noise


@dataclass
class TensorRow:
    name: str
    cls: str
    dtype: str
    fmt: str  # FMT_NAMES name for quantized tensors, the lower-cased dtype for plain ones
    fmt_id: Optional[int]  # 0-6; None for plain tensors other than f32 and for unresolved ones
    gs: Optional[int]
    O: Optional[int]
    I: Optional[int]
    nbytes: int  # stored bytes, scales included
    ambiguous: bool = False
    readings: list = field(default_factory=list)
    note: str = ""
    error: Optional[str] = None


@dataclass
class Report:
    path: str
    rows: list[TensorRow]
    by_fmt: dict[str, dict[str, int]]
    by_class: dict[str, dict[str, int]]
    total_nbytes: int
    routed_experts: int
    expert_nbytes: list[int]  # distinct per-expert byte counts (one value when uniform)

    @property
    def ambiguous(self) -> list[TensorRow]:
        return [r for r in self.rows if r.ambiguous]

    @property
    def unresolved(self) -> list[TensorRow]:
        return [r for r in self.rows if r.error]

    @property
    def ok(self) -> bool:
        return not self.unresolved


def inspect_container(path: str, progress: bool = True) -> Report:
    container = Container(path)
    names = container.weight_names()
    n_layers = container.config.get("num_hidden_layers")
    rows = [_row(container, name, n_layers) for name in _progress(names, progress)]
    return _summarize(container.path, rows)


def _progress(names: list[str], enabled: bool):
    if not enabled or len(names) < PROGRESS_MIN_TENSORS:
        return names
    from tqdm import tqdm

    return tqdm(names, desc="inspect", unit="tensor", file=sys.stderr, leave=False)


def _row(c: Container, name: str, n_layers: Optional[int]) -> TensorRow:
    info = c.info(name)
    cls = tensor_class(name, n_layers)
    if c.is_quantized(name):
        return _quantized_row(c, name, cls)
    row = TensorRow(name, cls, info.dtype, info.dtype.lower(), 0 if info.dtype == "F32" else None, None,
                    *_matrix_dims(info.shape), info.nbytes)
    try:
        c.tensor(name)  # checks a U8 weight without scales and the shape against config.json
    except ContainerError as e:
        row.fmt, row.fmt_id, row.error = "?", None, str(e)
    return row


def _quantized_row(c: Container, name: str, cls: str) -> TensorRow:
    info, qs = c.info(name), c.info(name + ".qs")
    nbytes = info.nbytes + qs.nbytes
    O, I = c.shapes.get(name, (None, None))
    row = TensorRow(name, cls, info.dtype, "?", None, None, O, I, nbytes)
    try:
        res = c.resolve(name)
    except ContainerError as e:
        row.error = str(e)
        return row
    row.fmt, row.fmt_id, row.gs = FMT_NAMES[res.fmt], res.fmt, res.gs
    row.readings = [list(r) for r in res.readings]
    row.ambiguous = res.ambiguous
    if res.ambiguous:
        row.note = _ambiguity_note(res, O, I, info.nbytes, qs.numel * 4)
    return row


def _ambiguity_note(res, O: int, I: int, nb: int, ns: int) -> str:
    readings = ", ".join(_reading_text(f, g) for f, g in res.readings)
    try:
        upstream = _reading_text(*detect_format(O, I, nb, ns))
    except FormatError:
        upstream = "refuses it"
    return f"ambiguous: bytes fit {readings}; read as {_reading_text(res.fmt, res.gs)}; upstream reads {upstream}"


def _reading_text(fmt: int, gs: Optional[int]) -> str:
    return f"{FMT_NAMES[fmt]}" + (f" gs {gs}" if gs else "")


def _matrix_dims(shape: tuple[int, ...]) -> tuple[Optional[int], Optional[int]]:
    if len(shape) == 2:
        return shape[0], shape[1]
    if len(shape) == 1:
        return shape[0], None
    return None, None


def _summarize(path: str, rows: list[TensorRow]) -> Report:
    by_fmt: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "nbytes": 0})
    by_class: dict[str, dict[str, int]] = {k: {"count": 0, "nbytes": 0} for k in TENSOR_CLASSES}
    experts: dict[tuple[int, int], int] = defaultdict(int)
    for r in rows:
        for bucket in (by_fmt[r.fmt], by_class[r.cls]):
            bucket["count"] += 1
            bucket["nbytes"] += r.nbytes
        key = expert_key(r.name)
        if key and r.cls == "routed_experts":
            experts[key[:2]] += r.nbytes
    by_class = {k: v for k, v in by_class.items() if v["count"]}
    total = sum(r.nbytes for r in rows)
    return Report(path, rows, dict(sorted(by_fmt.items())), by_class, total, len(experts),
                  sorted(set(experts.values())))


# -- output ------------------------------------------------------------------------------------
def report_json(report: Report) -> dict:
    tensors = []
    for r in report.rows:
        d = asdict(r)
        d["class"] = d.pop("cls")
        tensors.append(d)
    return {
        "path": report.path,
        "ok": report.ok,
        "tensors": tensors,
        "totals": {"nbytes": report.total_nbytes, "by_fmt": report.by_fmt, "by_class": report.by_class},
        "routed_experts": {"count": report.routed_experts, "nbytes_per_expert": report.expert_nbytes},
        "ambiguous": [r.name for r in report.ambiguous],
        "unresolved": [{"name": r.name, "verdict": r.error} for r in report.unresolved],
    }


def format_table(report: Report) -> str:
    lines = [f"container {report.path}", ""]
    header = ("tensor", "fmt", "gs", "O x I", "bytes", "")
    body = [(r.name, r.fmt, str(r.gs or ""), _dims_text(r), f"{r.nbytes:,}", _flag(r)) for r in report.rows]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(5)]
    for row in [header, *body]:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].rjust(widths[2]),
                 row[3].rjust(widths[3]), row[4].rjust(widths[4]), row[5]]
        lines.append("  ".join(cells).rstrip())
    lines += ["", "totals by fmt:"]
    lines += [f"  {k:<16} {v['count']:>8} tensors  {_human(v['nbytes']):>10}" for k, v in report.by_fmt.items()]
    lines += ["totals by part:"]
    lines += [f"  {k:<16} {v['count']:>8} tensors  {_human(v['nbytes']):>10}" for k, v in report.by_class.items()]
    lines.append(f"  {'all':<16} {len(report.rows):>8} tensors  {_human(report.total_nbytes):>10}")
    lines.append(_experts_text(report))
    lines += _verdict_lines(report)
    return "\n".join(lines)


def _dims_text(r: TensorRow) -> str:
    if r.O is None:
        return "?"
    return f"{r.O}" if r.I is None else f"{r.O} x {r.I}"


def _flag(r: TensorRow) -> str:
    if r.error:
        return "UNRESOLVED"
    return "AMBIGUOUS" if r.ambiguous else ""


def _experts_text(report: Report) -> str:
    if not report.routed_experts:
        return "routed experts: none"
    sizes = report.expert_nbytes
    each = _human(sizes[0]) if len(sizes) == 1 else f"{_human(sizes[0])} .. {_human(sizes[-1])}"
    return f"routed experts: {report.routed_experts}, {each} each (weights + scales)"


def _verdict_lines(report: Report) -> list[str]:
    lines = [""]
    for r in report.ambiguous:
        lines.append(f"AMBIGUOUS {r.name}: {r.note}")
    for r in report.unresolved:
        lines.append(f"UNRESOLVED {r.name}: {r.error}")
    if report.ok:
        lines.append(f"verdict: all {len(report.rows)} tensors resolve"
                     + (f" ({len(report.ambiguous)} ambiguous, read with the converter's defaults)"
                        if report.ambiguous else ""))
    else:
        lines.append(f"verdict: {len(report.unresolved)} of {len(report.rows)} tensors cannot be read")
    return lines


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"

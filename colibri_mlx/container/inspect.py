"""`colibri inspect`: what a container holds, tensor by tensor, and whether every tensor resolves.

For each logical tensor (a weight with its ``.qs``, or a plain tensor): fmt, gs, [O, I], stored
bytes, model part (``tensor_class``); totals per fmt and per part; routed-expert count and bytes;
ambiguous byte counts (several fmt/gs readings fit) are flagged with the reading chosen and the
one upstream's engine would take; anything that cannot be read gets a verdict and makes
``report.ok`` false (the CLI then exits 1, with one ``Error:`` line). A plain tensor the model
takes is checked as the loader checks it: its length (norms, biases), its dtype (no bytes or
integers without ``.qs``) and, for the small ones, NaN / inf; quantized scales are not read.

Weights config.json implies but the container lacks (a dropped expert, layers lost to a wrong
``convert --n-layers``) also fail the verdict, by the loader's rules (``models.deepseek_v3``):
the 2-D weights of ``expected_shapes`` plus the norms and biases the model takes. Parts the
loader does without are listed as absent, not missing: an MTP layer none of whose tensors is
stored (written only by ``convert --mtp``), the DSA indexer when no indexer tensor is stored
(written only by ``convert --indexer``; the model then runs dense attention), a stored MTP
layer's own embedding/head copies, and the MTP layer's indexer.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np

from ..formats import FMT_NAMES, FormatError, detect_format
from .reader import Container
from .safetensors_reader import ContainerError
from .shapes import TENSOR_CLASSES, expected_shapes, expert_key, tensor_class

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
class MissingWeights:
    """Weights config.json implies that the container does not store."""

    required: list[str] = field(default_factory=list)  # the loader refuses the container without them
    optional: dict[str, list[str]] = field(default_factory=dict)  # OPTIONAL_PARTS key -> names
    skipped: Optional[str] = None  # why the check could not run (no usable config.json)
    per_layer: dict[int, int] = field(default_factory=dict)  # layer -> weights it needs (optional absent ones not)

    @property
    def optional_names(self) -> list[str]:
        return [n for names in self.optional.values() for n in names]


@dataclass
class Report:
    path: str
    rows: list[TensorRow]
    by_fmt: dict[str, dict[str, int]]
    by_class: dict[str, dict[str, int]]
    total_nbytes: int
    routed_experts: int
    expert_nbytes: list[int]  # distinct per-expert byte counts (one value when uniform)
    missing: MissingWeights = field(default_factory=MissingWeights)
    source_format: str = ""  # what wrote the directory, when not a colibri container (e.g. mlx-lm)

    @property
    def ambiguous(self) -> list[TensorRow]:
        return [r for r in self.rows if r.ambiguous]

    @property
    def unresolved(self) -> list[TensorRow]:
        return [r for r in self.rows if r.error]

    @property
    def ok(self) -> bool:
        return not self.unresolved and not self.missing.required


def inspect_container(path: str, progress: bool = True) -> Report:
    container = Container(path)
    from ..models.mlx_lm_checkpoint import inspect_checkpoint, is_mlx_lm_checkpoint

    if is_mlx_lm_checkpoint(container.config or {}, container.names()):
        return inspect_checkpoint(container)
    names = container.weight_names()
    n_layers = container.config.get("num_hidden_layers")
    lengths = expected_vector_lengths(container.shapes)
    rows = [_row(container, name, n_layers, lengths) for name in _progress(names, progress)]
    report = _summarize(container.path, rows)
    report.missing = find_missing(container.config, set(names))
    return report


# -- weights config.json implies that are not stored -------------------------------------------
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
INDEXER_PART = ".self_attn.indexer."
ROUTER_BIAS = ".mlp.gate.e_score_correction_bias"
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # the loader takes these if stored

# key -> why the loader does without it (formatted with the MTP layer numbers)
OPTIONAL_PARTS = {
    "mtp": "MTP layer {mtp}, written only by `colibri convert --mtp`; without it generation drafts "
           "with `--draft ngram` or none",
    "indexer": "DSA indexer, written only by `colibri convert --indexer`; without it the model runs "
               "dense attention, the same as sparse up to index_topk tokens of context",
    "mtp_copy": "the MTP layer's own embedding/head copies; the loader takes them when stored",
    "mtp_indexer": "the MTP layer's DSA indexer; neither --mtp nor --indexer writes it, and the "
                   "MTP layer is built without it",
}


def find_missing(config: dict, present: set[str]) -> MissingWeights:
    """Compare the stored weight names with what config.json implies (see the module docstring)."""
    if not config:
        return MissingWeights(skipped="the container has no config.json")
    try:
        shapes = expected_shapes(config)
    except (KeyError, ValueError) as e:
        return MissingWeights(skipped=f"config.json: cannot derive tensor names: {e}")
    n_layers = int(config["num_hidden_layers"])
    expected = set(shapes) | expected_vectors(shapes, bool(config.get("attention_bias")))
    stored_mtp = {layer for layer in map(_layer_of, present) if layer is not None and layer >= n_layers}
    indexer_stored = any(INDEXER_PART in name for name in present)
    result = MissingWeights()
    needed = set(expected)
    for name in sorted(expected - present, key=_name_order):
        part = _optional_part(name, n_layers, stored_mtp, indexer_stored, present)
        if part is None:
            result.required.append(name)
        else:
            result.optional.setdefault(part, []).append(name)
            needed.discard(name)
    result.per_layer = _count_per_layer(needed)
    return result


def expected_vectors(shapes: dict, attention_bias: bool) -> set[str]:
    """The 1-D norms and biases the model takes (``WeightTable.take`` / ``maybe`` in
    ``models.deepseek_v3``), derived from the 2-D weights of the same layer."""
    names = {"model.norm.weight"}
    for p in {f"model.layers.{m.group(1)}." for m in map(_LAYER_NAME.match, shapes) if m}:
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                  p + "self_attn.kv_a_layernorm.weight"}
        attn = p + "self_attn."
        if attn + "q_a_proj.weight" in shapes:
            names.add(attn + "q_a_layernorm.weight")
        if attention_bias:
            names |= {attn + "kv_a_proj_with_mqa.bias", attn + "o_proj.bias"}
            if attn + "q_a_proj.weight" in shapes:
                names.add(attn + "q_a_proj.bias")
        if attn + "indexer.wk.weight" in shapes:
            names |= {attn + "indexer.k_norm.weight", attn + "indexer.k_norm.bias"}
        if p + "mlp.gate.weight" in shapes:
            names.add(p + ROUTER_BIAS[1:])
        if p + "eh_proj.weight" in shapes:
            names |= {p + "enorm.weight", p + "hnorm.weight", p + "shared_head.norm.weight"}
    return names


def expected_vector_lengths(shapes: dict) -> dict[str, int]:
    """name -> length of each 1-D norm and bias the model takes (:func:`expected_vectors`), from
    the 2-D weight it goes with: a bias is as long as its weight's rows, a norm as the vector it
    normalizes."""
    if "model.embed_tokens.weight" not in shapes:
        return {}
    D = shapes["model.embed_tokens.weight"][1]
    lengths = {}
    for name in expected_vectors(shapes, attention_bias=True):
        p, _, leaf = name.rpartition(".")
        if leaf == "bias" and p + ".weight" in shapes:
            lengths[name] = shapes[p + ".weight"][0]
        elif name.endswith("self_attn.q_a_layernorm.weight"):
            lengths[name] = shapes[name.replace("q_a_layernorm", "q_a_proj")][0]
        elif name.endswith("self_attn.kv_a_layernorm.weight"):
            kv_b = name.replace("kv_a_layernorm", "kv_b_proj")
            if kv_b in shapes:
                lengths[name] = shapes[kv_b][1]
        elif name.endswith(ROUTER_BIAS):
            lengths[name] = shapes[name.replace("e_score_correction_bias", "weight")][0]
        elif ".indexer.k_norm." in name:
            wk = name.rsplit(".k_norm.", 1)[0] + ".wk.weight"
            if wk in shapes:
                lengths[name] = shapes[wk][0]
        else:  # input / post-attention / final / MTP norms
            lengths[name] = D
    return lengths


# What the loader takes as values (models.loading.VALUE_DTYPES): a plain tensor of another dtype
# (bytes or integers without .qs scales) would be read as garbage.
VALUE_DTYPES = ("F32", "BF16", "F16", "F8_E4M3")
FINITE_CHECK_MAX = 1 << 22  # as models.loading: norms, biases, routers are scanned for NaN / inf


def _plain_problem(c: Container, name: str, lengths: dict[str, int]) -> Optional[str]:
    """Why the loader would refuse a plain (unquantized) tensor it takes, or None."""
    info = c.info(name)
    where = f"{info.path}: tensor {name!r}"
    want = lengths.get(name)
    if want is not None and info.shape != (want,):
        return f"{where}: stored shape {list(info.shape)}, expected [{want}]"
    if want is None and name not in c.shapes:
        return None  # not a tensor the model takes by this table (missing-weight check covers names)
    if info.dtype not in VALUE_DTYPES:
        return (f"{where}: stored as {info.dtype}; the model takes it as values: expected F32, BF16 or F16 "
                "(or a 2-D F8_E4M3 weight with its _scale_inv, or a 2-D U8 weight with its .qs scales)")
    if info.dtype == "F8_E4M3" and name + "_scale_inv" not in c:
        return f"{where}: an FP8 weight without its {name}_scale_inv (its 128x128 block scales)"
    if info.dtype != "F8_E4M3" and info.numel <= FINITE_CHECK_MAX and not np.isfinite(c.array(name)).all():
        return f"{where}: holds NaN or infinite values (a damaged shard?)"
    return None


def _optional_part(name: str, n_layers: int, stored_mtp: set[int], indexer_stored: bool,
                   present: set[str]) -> Optional[str]:
    layer = _layer_of(name)
    is_mtp = layer is not None and layer >= n_layers
    if is_mtp and layer not in stored_mtp:
        return "mtp"  # the loader recognises an MTP layer by its tensors; a partial one is refused
    if INDEXER_PART in name and not indexer_stored:
        return "indexer"  # the loader's dense-attention fallback needs no indexer tensor at all
    if is_mtp and name.split(".", 3)[3] in MTP_COPIES:
        return "mtp_copy"
    if is_mtp and INDEXER_PART in name and not any(n.startswith(name.split(INDEXER_PART)[0] + INDEXER_PART)
                                                   for n in present):
        return "mtp_indexer"  # a partly stored one is still required
    return None


def _layer_of(name: str) -> Optional[int]:
    m = _LAYER_NAME.match(name)
    return int(m.group(1)) if m else None


def _name_order(name: str):
    """Layers and experts in numeric order (layer 10 after layer 9)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _count_per_layer(names) -> dict[int, int]:
    counts: dict[int, int] = defaultdict(int)
    for layer in map(_layer_of, names):
        if layer is not None:
            counts[layer] += 1
    return dict(counts)


def group_missing(names: list[str], per_layer: dict[int, int]) -> list[str]:
    """Compact lines: top-level names as they are; per layer its routed experts by projection and
    its other weights; runs of layers missing every weight as one line."""
    by_layer: dict[int, list[str]] = defaultdict(list)
    lines = []
    for name in names:
        layer = _layer_of(name)
        if layer is None:
            lines.append(name)
        else:
            by_layer[layer].append(name)
    whole: list[int] = []
    for layer in sorted(by_layer):
        if len(by_layer[layer]) == per_layer.get(layer):
            whole.append(layer)
            continue
        lines += _whole_layers_text(whole, by_layer)
        whole = []
        lines.append(f"layer {layer}: {_layer_text(by_layer[layer])}")
    return lines + _whole_layers_text(whole, by_layer)


def _whole_layers_text(layers: list[int], by_layer: dict[int, list[str]]) -> list[str]:
    lines, start = [], 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or layers[i] != layers[i - 1] + 1:
            run = layers[start:i]
            count = sum(len(by_layer[k]) for k in run)
            span = f"layer {run[0]}" if len(run) == 1 else f"layers {run[0]}-{run[-1]}"
            lines.append(f"{span}: every weight ({count:,} tensors)")
            start = i
    return lines


def _layer_text(names: list[str], shown: int = 6) -> str:
    experts: dict[int, list[str]] = defaultdict(list)
    others = []
    for name in names:
        key = expert_key(name)
        if key:
            experts[key[1]].append(key[2])
        else:
            others.append(name.split(".", 3)[3])
    by_projections: dict[str, list[int]] = defaultdict(list)
    for expert, projections in sorted(experts.items()):
        by_projections["/".join(p for p in ("gate", "up", "down") if p in projections)].append(expert)
    parts = [f"expert{'s' if len(ids) > 1 else ''} {_ranges(ids)} ({proj})" for proj, ids in by_projections.items()]
    if others:
        more = f" and {len(others) - shown} more" if len(others) > shown else ""
        parts.append(", ".join(others[:shown]) + more)
    return "; ".join(parts)


def _ranges(ids: list[int]) -> str:
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            run = ids[start:i]
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
            start = i
    return ", ".join(out)


def optional_note(part: str, names: list[str]) -> str:
    mtp = _ranges(sorted({_layer_of(n) for n in names if _layer_of(n) is not None}))
    return OPTIONAL_PARTS[part].format(mtp=mtp)


def _progress(names: list[str], enabled: bool):
    if not enabled or len(names) < PROGRESS_MIN_TENSORS:
        return names
    from tqdm import tqdm

    return tqdm(names, desc="inspect", unit="tensor", file=sys.stderr, leave=False)


def _row(c: Container, name: str, n_layers: Optional[int], lengths: Optional[dict] = None) -> TensorRow:
    info = c.info(name)
    cls = tensor_class(name, n_layers)
    if c.is_quantized(name):
        return _quantized_row(c, name, cls)
    row = TensorRow(name, cls, info.dtype, info.dtype.lower(), 0 if info.dtype == "F32" else None, None,
                    *_matrix_dims(info.shape), info.nbytes)
    try:
        c.tensor(name)  # checks a U8 weight without scales and the shape against config.json
        problem = _plain_problem(c, name, lengths or {})
    except ContainerError as e:
        problem = str(e)
    if problem:
        row.fmt, row.fmt_id, row.error = "?", None, problem
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
        "source_format": report.source_format or None,
        "ok": report.ok,
        "tensors": tensors,
        "totals": {"nbytes": report.total_nbytes, "by_fmt": report.by_fmt, "by_class": report.by_class},
        "routed_experts": {"count": report.routed_experts, "nbytes_per_expert": report.expert_nbytes},
        "ambiguous": [r.name for r in report.ambiguous],
        "unresolved": [{"name": r.name, "verdict": r.error} for r in report.unresolved],
        "missing": report.missing.required,
        "missing_optional": report.missing.optional_names,
        "optional_absent": [{"part": part, "count": len(names), "note": optional_note(part, names)}
                            for part, names in report.missing.optional.items()],
        "missing_check_skipped": report.missing.skipped,
    }


def format_table(report: Report) -> str:
    lines = [f"container {report.path}"] + ([f"format: {report.source_format}"] if report.source_format else []) + [""]
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


MAX_MISSING_LINES = 24  # --json lists every name


def _verdict_lines(report: Report) -> list[str]:
    lines = [""]
    for r in report.ambiguous:
        lines.append(f"AMBIGUOUS {r.name}: {r.note}")
    for r in report.unresolved:
        lines.append(f"UNRESOLVED {r.name}: {r.error}")
    lines += _missing_lines(report.missing)
    if report.ok:
        lines.append(f"verdict: all {len(report.rows)} tensors resolve"
                     + (f" ({len(report.ambiguous)} ambiguous, read with the converter's defaults)"
                        if report.ambiguous else "")
                     + ("" if report.missing.skipped else "; every weight config.json requires is present"))
        return lines
    verdicts = []
    if report.unresolved:
        verdicts.append(f"{len(report.unresolved)} of {len(report.rows)} tensors cannot be read")
    if report.missing.required:
        verdicts.append(f"{len(report.missing.required):,} weights config.json requires are missing, "
                        "colibri_mlx.load refuses this container")
    lines.append("verdict: " + "; ".join(verdicts))
    return lines


def verdict_error(report: Report) -> str:
    """The failed verdict in one line for the command's ``Error:`` (the first problem in full)."""
    parts = []
    if report.missing.required:
        names = report.missing.required
        parts.append(f"{len(names):,} weight{'s' if len(names) > 1 else ''} config.json requires "
                     f"{'are' if len(names) > 1 else 'is'} missing ({names[0]}{', ...' if len(names) > 1 else ''}), "
                     "colibri_mlx.load refuses this container")
    if report.unresolved:
        parts.append(f"{len(report.unresolved)} of {len(report.rows)} tensors cannot be read; the first: "
                     f"{report.unresolved[0].error}")
    return f"{report.path}: " + "; ".join(parts)


def _missing_lines(missing: MissingWeights) -> list[str]:
    if missing.skipped:
        return [f"missing-weight check skipped: {missing.skipped}"]
    lines = []
    if missing.required:
        grouped = group_missing(missing.required, missing.per_layer)
        lines.append(f"MISSING {len(missing.required):,} weights config.json implies:")
        lines += [f"  {line}" for line in grouped[:MAX_MISSING_LINES]]
        if len(grouped) > MAX_MISSING_LINES:
            lines.append(f"  ... and {len(grouped) - MAX_MISSING_LINES} more lines (--json lists every name)")
    for part, names in missing.optional.items():
        lines.append(f"absent (optional: {optional_note(part, names)}): {len(names):,} tensors")
    return lines


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"

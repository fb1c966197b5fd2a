"""Shard-by-shard conversion: classify, dequantize, encode, write; resumable.

One source shard -> at most one output shard (`out-NNNNN.safetensors`, upstream's naming).
Tensors are encoded in a process pool (`--jobs`) but collected and written in name order, so
the output is byte-identical to a serial run. Progress is recorded in upstream's manifest
`.out-progress.json` after each shard is written atomically: a run killed at any point
resumes where it stopped and produces the same bytes; a resume with different parameters is
refused.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Callable, Iterator, Optional

import numpy as np

from .classify import SHARD_PREFIX, BitPlan, ConvertError, classify, layer_index
from .sources import FP8_BLOCK, SafetensorsShard, WeightSource

# Copied next to the shards: the engine needs config.json, chat needs the tokenizer.
METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "tokenizer.model", "tiktoken.model", "chat_template.jinja")
METADATA_PATTERNS = ("tokenization_*.py", "configuration_*.py")


def _quant_rows() -> int:
    """Rows quantized per block: every format is per row, so blocking is bit-identical and only
    caps the float32 temporaries (upstream's COLI_QUANT_ROWS). FP8 blocks are 128 rows."""
    rows = int(os.environ.get("COLI_QUANT_ROWS", "8192"))
    if rows <= 0 or rows % FP8_BLOCK:
        raise ConvertError(f"COLI_QUANT_ROWS must be a positive multiple of {FP8_BLOCK}, got {rows}")
    return rows


QUANT_ROWS = _quant_rows()

# The names the three passes write (SHARD_PREFIX + 5 digits); any other shard in the output
# directory would be read as part of the container.
PASS_SHARD_NAME = re.compile(r"out-(?:mtp-|idx-)?\d{5}\.safetensors")


@dataclass(frozen=True)
class TensorTask:
    """One source tensor to convert; fmt None means keep float32."""

    shard_path: str
    name: str
    kind: str
    fmt: Optional[int]
    gs: Optional[int]
    nbytes: int  # source bytes, for progress


@dataclass
class TensorResult:
    name: str
    kind: str
    fmt: int  # 0 = stored float32
    gs: Optional[int]
    value: object  # np.ndarray (float32) or QTensor
    src_bytes: int
    out_bytes: int
    n_weights: int
    sq_err: float  # sum of squared reconstruction errors (float64), 0 for float32
    sq_ref: float  # sum of squared weights


# ------------------------------------------------------------------ one tensor


def convert_tensor(shard: SafetensorsShard, task: TensorTask, stats: bool = True) -> TensorResult:
    """Dequantize one weight and encode it (row block by row block)."""
    source = WeightSource(shard, task.name)
    if task.fmt is None or source.ndim != 2:
        w = np.ascontiguousarray(source.read(), dtype=np.float32)
        return TensorResult(task.name, task.kind, 0, None, w, task.nbytes, w.nbytes, w.size, 0.0, 0.0)
    from ..formats import FormatError, QTensor, encode

    O, I = source.shape
    if task.fmt == 6 and I % 256:
        raise ConvertError(f"{shard.path}: tensor {task.name!r}: e8 (fmt 6) needs an input dim that is a "
                           f"multiple of 256, got [{O}, {I}]")
    packed, scales = [], []
    sq_err = sq_ref = 0.0
    for r0 in range(0, O, QUANT_ROWS):
        w = source.rows(r0, min(O, r0 + QUANT_ROWS))
        try:
            p, s = encode(task.fmt, w, task.gs)
        except FormatError as e:
            raise ConvertError(f"{shard.path}: tensor {task.name!r} rows {r0}..: {e}") from None
        if stats:
            e2, r2 = _squared_error(task.fmt, task.gs, w, p, s)
            sq_err, sq_ref = sq_err + e2, sq_ref + r2
        packed.append(p)
        scales.append(s)
    packed = np.concatenate(packed)
    # fmt 6's .qs is a one-float tag, the same for every block; keep one.
    scales = scales[0] if task.fmt == 6 else np.concatenate(scales)
    qt = QTensor(packed, scales, task.fmt, O, I, task.gs, task.name)
    return TensorResult(task.name, task.kind, task.fmt, task.gs, qt, task.nbytes,
                        packed.nbytes + scales.nbytes, O * I, sq_err, sq_ref)


def _squared_error(fmt: int, gs, w: np.ndarray, packed, scales) -> tuple[float, float]:
    from ..formats import decode

    rows, cols = w.shape
    approx = decode(fmt, packed, scales, rows, cols, gs)
    if fmt == 6:  # decode gives W @ Q; the rotation is orthogonal, so compare in that basis
        from ..formats.e8 import rotate_rows

        w = rotate_rows(w)
    # float32 BLAS dot products: a summary statistic needs 3 digits, not float64 (2x slower).
    diff = np.subtract(approx, w, out=approx).reshape(-1)
    ref = np.ascontiguousarray(w, dtype=np.float32).reshape(-1)
    return float(np.dot(diff, diff)), float(np.dot(ref, ref))


def _convert_in_worker(task: TensorTask, stats: bool) -> TensorResult:
    # Open per task and close: a cached map would keep a deleted --repo shard's disk space.
    with SafetensorsShard(task.shard_path) as shard:
        return convert_tensor(shard, task, stats)


# ------------------------------------------------------------------ one shard


def shard_tasks(shard: SafetensorsShard, plan: BitPlan, mode: str,
                expected_shapes: Optional[dict] = None) -> list[TensorTask]:
    """The tensors of this pass in `shard`, each checked against config.json's `expected_shapes`
    (name -> (O, I); None = no config.json). Names the table does not know are converted
    unchecked, as upstream converts them."""
    tasks = []
    for name in shard.names():
        kind = classify(name, plan.n_layers, mode)
        if kind in ("skip", "consumed"):
            continue
        _refuse_fused_experts(shard, name)
        if expected_shapes is not None and name in expected_shapes:
            _check_shape(shard, name, expected_shapes[name])
        fmt, gs = (None, None) if kind == "f32" else plan.format_for(kind, name)
        nbytes = _source_nbytes(shard, name)
        tasks.append(TensorTask(shard.path, name, kind, fmt, gs, nbytes))
    return tasks


def _refuse_fused_experts(shard: SafetensorsShard, name: str):
    # transformers v5 fuses experts into [E, 2*inter, D] / [E, D, inter] tensors; upstream would
    # store them float32 under names the engine never reads.
    info = shard.info(name)
    if ".mlp.experts." in name and len(info.shape) >= 3:
        raise ConvertError(f"{shard.path}: tensor {name!r} is a fused {len(info.shape)}-D expert tensor "
                           f"{info.dtype}{list(info.shape)}; the converter expects per-expert 2-D tensors "
                           "'model.layers.<i>.mlp.experts.<e>.{gate,up,down}_proj.weight' (the Hugging Face "
                           "release layout). Convert the original release checkpoint instead.")


def _check_shape(shard: SafetensorsShard, name: str, want: tuple):
    shape = tuple(WeightSource(shard, name).shape)  # NVFP4 packs two inputs a byte: the logical [O, I]
    if shape != tuple(want):
        raise ConvertError(f"{shard.path}: tensor {name!r} has shape {list(shape)} but config.json implies "
                           f"{list(want)}; the checkpoint and its config.json disagree (wrong config.json, "
                           "or a shard of another model?)")


def _source_nbytes(shard: SafetensorsShard, name: str) -> int:
    siblings = (name, name + "_scale_inv", name + "_scale", name + "_scale_2")
    return sum(shard.info(n).nbytes for n in siblings if n in shard)


_BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


class TensorRunner:
    """Runs tensor tasks serially or in a spawn pool; results always come back in task order."""

    def __init__(self, jobs: int = 1, stats: bool = True):
        self.jobs, self.stats = max(1, int(jobs)), stats
        self._pool: Optional[ProcessPoolExecutor] = None

    def __enter__(self):
        if self.jobs > 1:
            # One BLAS thread per worker: N workers x N OpenBLAS threads oversubscribe the cores
            # (the fmt 6 encoder's matmuls ran 3x slower with --jobs 2 on 2 cores). Spawned
            # children copy os.environ, so it is set for the pool's lifetime.
            self._saved_env = {k: os.environ.get(k) for k in _BLAS_THREAD_VARS}
            os.environ.update({k: "1" for k in _BLAS_THREAD_VARS})
            # spawn, not fork: the parent may hold BLAS/MLX threads (upstream does the same).
            self._pool = ProcessPoolExecutor(self.jobs, mp_context=get_context("spawn"))
        return self

    def __exit__(self, *exc):
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            for k, v in self._saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def run(self, shard: SafetensorsShard, tasks: list[TensorTask]) -> Iterator[TensorResult]:
        if self._pool is None:
            for task in tasks:
                yield convert_tensor(shard, task, self.stats)
            return
        futures = [self._pool.submit(_convert_in_worker, t, self.stats) for t in tasks]
        for fut in futures:
            yield fut.result()


# ------------------------------------------------------------------ progress manifest


class ProgressManifest:
    """Upstream's `.{prefix}progress.json`: {"shards": {source: emitted-or-""}, "params": {...}}.

    We add "colibri_mlx": {"stats": {source: [summary rows]}} so that a resumed run's final
    summary still covers every shard; upstream ignores and preserves unknown keys.
    """

    def __init__(self, outdir: str, prefix: str, params: dict):
        self.path = os.path.join(outdir, f".{prefix}progress.json")
        self.params = json.loads(json.dumps(params))  # compare as JSON would store it
        self.data = {"shards": {}, "params": self.params, "colibri_mlx": {"stats": {}}}
        if os.path.exists(self.path):
            self._load()

    def _load(self):
        try:
            with open(self.path) as f:
                prev = json.load(f)
        except (OSError, ValueError) as e:
            raise ConvertError(f"{self.path}: unreadable progress manifest ({e}); delete it and the "
                               "out-*.safetensors shards to start over") from None
        if not isinstance(prev, dict):
            raise ConvertError(f"{self.path}: damaged progress manifest (not a JSON object); delete it and the "
                               "out-*.safetensors shards to start over")
        if prev.get("params") != self.params:
            raise ConvertError(
                f"{self.path} records a conversion with {prev.get('params')};\n"
                f"this run uses {self.params}.\nRefusing to mix conversions in one output directory: "
                "rerun with the recorded options, use a fresh --outdir, or delete the manifest and "
                "the shards to redo.")
        shards, ours = prev.get("shards", {}), prev.get("colibri_mlx", {})
        if not isinstance(shards, dict) or not isinstance(ours, dict):
            raise ConvertError(f"{self.path}: damaged progress manifest ('shards' is not an object); delete it and "
                               "the out-*.safetensors shards to start over")
        self.data["shards"] = dict(shards)
        self.data["colibri_mlx"]["stats"] = dict(ours.get("stats", {}))
        self.data["colibri_mlx"]["sizes"] = dict(ours.get("sizes", {}))

    def done(self, source: str, outdir: str, log: Callable[[str], None] = lambda m: None) -> Optional[str]:
        """The emitted name ("" = nothing to emit) if `source` is finished and its output is
        intact: the file exists, has the size recorded when it was written, and a valid header
        (a shard truncated or overwritten since is converted again)."""
        emitted = self.data["shards"].get(source)
        if emitted is None or not emitted:
            return emitted
        path = os.path.join(outdir, emitted)
        if not os.path.exists(path):
            return None
        size, want = os.path.getsize(path), self.data["colibri_mlx"].get("sizes", {}).get(source)
        problem = None
        if want is not None and size != want:
            problem = f"is {size} bytes, {want} when it was written"
        else:
            from ..container import ContainerError, read_shard_header

            try:
                read_shard_header(path)
            except ContainerError as e:
                problem = f"is damaged ({e})"
        if problem:
            log(f"[resume] {emitted} {problem}: converting {source} again")
            return None
        return emitted

    def record(self, source: str, emitted: str, stats_rows: list, size: Optional[int] = None):
        self.data["shards"][source] = emitted
        self.data["colibri_mlx"]["stats"][source] = stats_rows
        if size is not None:
            self.data["colibri_mlx"].setdefault("sizes", {})[source] = size
        self.save()

    def save(self):
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise ConvertError(f"{self.path}: cannot write the progress manifest: {_os_reason(e)}") from None

    def all_stats(self) -> list:
        return [row for rows in self.data["colibri_mlx"]["stats"].values() for row in rows]


# ------------------------------------------------------------------ summary


class Summary:
    """Per (kind, fmt, gs): tensors, bytes in/out, relative RMS reconstruction error."""

    def __init__(self):
        self.rows: dict[tuple, list] = {}

    def add(self, r: TensorResult):
        self.add_row([r.kind, r.fmt, r.gs, 1, r.src_bytes, r.out_bytes, r.n_weights, r.sq_err, r.sq_ref])

    def add_row(self, row):
        kind, fmt, gs, *vals = row
        acc = self.rows.setdefault((kind, fmt, gs), [0] * len(vals))
        for i, v in enumerate(vals):
            acc[i] += v

    def rows_for_manifest(self) -> list:
        return [[*key, *vals] for key, vals in sorted(self.rows.items(), key=_row_key)]

    def table(self) -> str:
        from ..formats import FMT_NAMES

        lines = [f"{'class':<6} {'fmt':<20} {'tensors':>8} {'source MB':>11} {'output MB':>11} "
                 f"{'bits/w':>7} {'rel RMS err':>12}"]
        totals = [0, 0, 0]
        for (kind, fmt, gs), (n, src, out, nw, e2, r2) in sorted(self.rows.items(), key=_row_key):
            label = f"{fmt} {FMT_NAMES[fmt]}" + (f" gs{gs}" if gs else "")
            err = f"{np.sqrt(e2 / r2):.3e}" if fmt and r2 > 0 else "-"
            lines.append(f"{kind:<6} {label:<20} {n:>8} {src / 1e6:>11.2f} {out / 1e6:>11.2f} "
                         f"{8 * out / max(nw, 1):>7.3f} {err:>12}")
            totals = [totals[0] + n, totals[1] + src, totals[2] + out]
        lines.append(f"{'total':<27} {totals[0]:>8} {totals[1] / 1e6:>11.2f} {totals[2] / 1e6:>11.2f}")
        return "\n".join(lines)


def _row_key(item):
    (kind, fmt, gs), _ = item
    return (kind, fmt, gs or 0)


# ------------------------------------------------------------------ the conversion


@dataclass
class Conversion:
    """Everything one converter run needs. `sources` yields (source name, local path) pairs
    and may fetch lazily (--repo); `name_by_index` selects upstream's --repo naming."""

    outdir: str
    plan: BitPlan
    mode: str = "main"
    jobs: int = 1
    stats: bool = True
    progress: bool = True
    name_by_index: bool = False
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True))
    expected_shapes: Optional[dict] = None  # config.json's name -> (O, I); None = unchecked

    @property
    def prefix(self) -> str:
        return SHARD_PREFIX[self.mode]

    def check_outdir(self):
        """Refuse an output directory this run cannot use, reading only: called before anything
        is created or written there (run() checks again under the lock)."""
        if not os.path.exists(self.outdir):
            return
        if not os.path.isdir(self.outdir):
            raise ConvertError(f"--outdir {self.outdir}: exists and is not a directory")
        self._refuse_foreign_shards()
        ProgressManifest(self.outdir, self.prefix, self.plan.params())  # refuses another conversion's record

    def check_sources(self, paths: list[str]) -> int:
        """Every local shard's headers against the plan and config.json, before the first is
        encoded: a mismatch in the last shard is refused in seconds, not after hours. Returns
        how many tensors this pass converts."""
        n = 0
        for path in paths:
            with SafetensorsShard(path) as shard:
                n += len(shard_tasks(shard, self.plan, self.mode, self.expected_shapes))
        return n

    def run(self, sources: list[str], sizes: Optional[dict] = None,
            fetch: Callable[[str], str] = lambda s: s, release: Callable[[str], None] = lambda p: None,
            before_shard: Callable[[], None] = lambda: None) -> Summary:
        """Convert each source shard not yet done. `fetch(source)` gives a local path,
        `release(path)` is called once its output is recorded (--repo deletes it); `sizes`
        (source -> bytes) sizes the progress bar when the shards are not local."""
        os.makedirs(self.outdir, exist_ok=True)
        self._refuse_foreign_shards()
        self._remove_stale_temporaries()
        manifest = ProgressManifest(self.outdir, self.prefix, self.plan.params())
        todo = [(i, s) for i, s in enumerate(sources)
                if manifest.done(os.path.basename(s), self.outdir, self.log) is None]
        if len(todo) < len(sources):
            self.log(f"[resume] {len(sources) - len(todo)} of {len(sources)} shard(s) already done in {self.outdir}")
        sizes = sizes or {s: os.path.getsize(s) for _, s in todo}
        with TensorRunner(self.jobs, self.stats) as runner, self._bar(sum(sizes[s] for _, s in todo)) as bar:
            for index, source in todo:
                before_shard()
                key = os.path.basename(source)
                number = index if self.name_by_index else self._count_emitted(manifest, sources, index)
                name = f"{self.prefix}{number:05d}.safetensors"
                path = fetch(source)
                rows, done_bytes = self._convert_shard(path, key, name, runner, bar)
                bar.update(max(0, sizes[source] - done_bytes))  # headers, scales, skipped tensors
                size = os.path.getsize(os.path.join(self.outdir, name)) if rows is not None else None
                manifest.record(key, name if rows is not None else "", rows or [], size)
                release(path)
        self._refuse_unrecorded_shards(manifest)
        summary = Summary()
        for row in manifest.all_stats():
            summary.add_row(row)
        return summary

    def _count_emitted(self, manifest, sources, index) -> int:
        """Upstream's --indir naming: out-N counts emitted shards before this one."""
        return sum(1 for s in sources[:index] if manifest.data["shards"].get(os.path.basename(s)))

    def _convert_shard(self, path: str, key: str, out_name: str, runner, bar) -> tuple[Optional[list], int]:
        from ..container import write_shard

        shard_summary = Summary()
        out, done_bytes = {}, 0
        with SafetensorsShard(path) as shard:
            tasks = shard_tasks(shard, self.plan, self.mode, self.expected_shapes)
            for result in runner.run(shard, tasks):
                out[result.name] = result.value
                shard_summary.add(result)
                bar.update(result.src_bytes)
                done_bytes += result.src_bytes
                bar.set_postfix_str(f"{key}: {len(out)}/{len(tasks)} tensors", refresh=False)
        if not out:  # no tensor of this pass in the shard: no file (upstream's --indir rule)
            return None, done_bytes
        meta = {"colibri_mlx.convert": json.dumps({"source": key, **self.plan.params()}, sort_keys=True)}
        out_path = os.path.join(self.outdir, out_name)
        try:
            write_shard(out_path, out, meta)  # atomic: a temporary name, renamed once complete
        except OSError as e:
            raise ConvertError(f"{out_path}: cannot write the shard: {_os_reason(e)}; nothing was left half-"
                               "written, rerun the same command to resume once there is room") from None
        return shard_summary.rows_for_manifest(), done_bytes

    def _bar(self, total: int):
        from tqdm import tqdm

        return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                    desc="convert", disable=not self.progress, file=sys.stderr, dynamic_ncols=True)

    def _refuse_foreign_shards(self):
        foreign = sorted(n for n in os.listdir(self.outdir)
                         if n.endswith(".safetensors") and not PASS_SHARD_NAME.fullmatch(n))
        if foreign:
            raise ConvertError(f"{self.outdir} holds {', '.join(foreign)}, which the converter does not write; a "
                               "container reads every *.safetensors in its directory, so they would be read as part "
                               "of it. Move them out or use a fresh --outdir.")

    def _refuse_unrecorded_shards(self, manifest: "ProgressManifest"):
        # Checked after the run: an unrecorded shard of this pass can also be one a killed run
        # renamed into place just before recording it, which this run has rewritten and recorded.
        recorded = set(manifest.data["shards"].values())
        pattern = re.compile(re.escape(self.prefix) + r"\d{5}\.safetensors")
        stale = sorted(n for n in os.listdir(self.outdir) if pattern.fullmatch(n) and n not in recorded)
        if stale:
            raise ConvertError(f"{self.outdir}: {', '.join(stale)} were not written by this conversion (left by an "
                               f"earlier one?) and would be read as part of the container; delete them.")

    def _remove_stale_temporaries(self):
        # write_shard writes <name>.tmp-<pid>; a killed run leaves one behind.
        for tmp in glob.glob(os.path.join(self.outdir, f"{self.prefix}*.safetensors.tmp-*")):
            os.unlink(tmp)


# ------------------------------------------------------------------ directory helpers


def list_shards(indir: str) -> list[str]:
    """The checkpoint's shards: regular files (a FIFO would block), symlinks only into the
    directory or a Hugging Face cache blob store (a hub snapshot)."""
    from ..container import ContainerError
    from ..container.files import check_file

    shards = sorted(p for p in glob.glob(os.path.join(indir, "*.safetensors"))
                    if not os.path.basename(p).startswith("."))
    if not shards:
        raise ConvertError(f"--indir {indir}: no *.safetensors shards found")
    for path in shards:
        try:
            check_file(path, indir, "a checkpoint shard")
        except ContainerError as e:
            raise ConvertError(str(e)) from None
    return shards


def _os_reason(e: OSError) -> str:
    from ..errors import os_reason

    return os_reason(e)


def shards_for_mode(shard_names: list[str], weight_map: Optional[dict], mode: str, n_layers: int) -> list[str]:
    """--mtp / --indexer only need the shards holding their tensors (upstream #383). Every shard
    the index names for a tensor of this pass must be there (the main pass: any tensor below
    layer ``n_layers``): converting without it would write a container missing those tensors."""
    if weight_map is None:
        return shard_names
    present = {os.path.basename(s) for s in shard_names}
    needed = weight_map.values() if mode != "main" else \
        [v for k, v in weight_map.items() if layer_index(k) < n_layers]
    absent = sorted({v for v in needed if v not in present})
    if absent:
        raise ConvertError(f"model.safetensors.index.json: its weight_map names {', '.join(absent[:3])}"
                           f"{' ...' if len(absent) > 3 else ''}, which {'is' if len(absent) == 1 else 'are'} not "
                           "among the checkpoint's shards (an index of another download, or an incomplete one?)")
    if mode == "main":
        return shard_names
    if mode == "mtp":
        want = {v for k, v in weight_map.items() if layer_index(k) == n_layers}
    else:
        want = {v for k, v in weight_map.items() if "indexer" in k and 0 <= layer_index(k) < n_layers}
    return [s for s in shard_names if os.path.basename(s) in want]


def _metadata_names(indir: str) -> list[str]:
    names = [n for n in METADATA_FILES if os.path.lexists(os.path.join(indir, n))]
    for pattern in METADATA_PATTERNS:
        names += sorted(os.path.basename(p) for p in glob.glob(os.path.join(indir, pattern)))
    return names


def check_metadata(indir: str) -> None:
    """The config/tokenizer files copy_metadata will copy, checked before any shard is converted:
    regular files inside the checkpoint (or a Hugging Face cache blob), as the loader reads them;
    a broken symlink, a FIFO or a link to an unrelated file would fail the copy after hours, or
    be copied and fail at load."""
    from ..container import ContainerError
    from ..container.files import check_file

    for n in _metadata_names(indir):
        try:
            check_file(os.path.join(indir, n), indir, n)
        except ContainerError as e:
            raise ConvertError(str(e)) from None


def copy_metadata(indir: str, outdir: str) -> tuple[list[str], list[str]]:
    """Copy config/tokenizer files (atomically); returns (copied, missing required)."""
    names = [n for n in METADATA_FILES if os.path.exists(os.path.join(indir, n))]
    for pattern in METADATA_PATTERNS:
        names += sorted(os.path.basename(p) for p in glob.glob(os.path.join(indir, pattern)))
    for n in names:
        tmp = os.path.join(outdir, f".{n}.tmp")
        try:
            shutil.copyfile(os.path.join(indir, n), tmp)
            os.replace(tmp, os.path.join(outdir, n))
        except OSError as e:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise ConvertError(f"{os.path.join(outdir, n)}: cannot copy {n}: {_os_reason(e)}") from None
    missing = [n for n in ("config.json", "tokenizer.json") if n not in names]
    return names, missing


def read_json(path: str) -> Optional[dict]:
    if not os.path.lexists(path):
        return None
    from ..container.files import read_text

    try:
        text = read_text(path, None, os.path.basename(path))
        data = json.loads(text)
    except ValueError as e:  # ContainerError (not a regular file, not UTF-8) or JSONDecodeError
        raise ConvertError(f"{path}: not valid JSON ({e})" if isinstance(e, json.JSONDecodeError) else str(e)) \
            from None
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_weight_map(path: str) -> Optional[dict]:
    """The `weight_map` of a model.safetensors.index.json (None if the file or key is absent)."""
    weight_map = (read_json(path) or {}).get("weight_map")
    if weight_map is not None and not isinstance(weight_map, dict):
        raise ConvertError(f"{path}: 'weight_map' must be a JSON object, got {type(weight_map).__name__}")
    for name, shard in (weight_map or {}).items():
        # A shard is a file beside the index: a path would read (or convert nothing from) elsewhere.
        if (not isinstance(shard, str) or not shard.endswith(".safetensors") or os.path.basename(shard) != shard
                or shard.startswith(".") or "\\" in shard):
            raise ConvertError(f"{path}: weight_map[{name!r}] is {json.dumps(shard)}; expected the file name of a "
                               "shard in the same directory (no path)")
    return weight_map


class OutdirLock:
    """Two converters on one output directory would corrupt each other (upstream's .convert.lock).
    Taking it creates the output directory: nothing touches it before the plan is validated."""

    def __init__(self, outdir: str):
        self.outdir = outdir
        self.path = os.path.join(outdir, ".convert.lock")
        self._fh = None

    def __enter__(self):
        import fcntl

        try:
            os.makedirs(self.outdir, exist_ok=True)
        except OSError as e:
            raise ConvertError(f"--outdir {self.outdir}: cannot create it: {_os_reason(e)}") from None
        while True:
            try:
                self._fh = open(self.path, "w")
            except OSError as e:
                raise ConvertError(f"{self.path}: cannot create the lock file: {_os_reason(e)}") from None
            try:
                fcntl.flock(self._fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._fh.close()
                raise ConvertError(f"{self.path}: another converter is using this output directory") from None
            # The file is removed on exit: a lock taken on a file that was removed (or replaced)
            # between our open and our flock guards nothing; take the one now at the path.
            try:
                same = os.path.samestat(os.fstat(self._fh.fileno()), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                return self
            self._fh.close()

    def __exit__(self, *exc):
        try:
            os.unlink(self.path)  # still holding the lock: nobody can hold this inode's lock now
        except OSError:
            pass
        self._fh.close()


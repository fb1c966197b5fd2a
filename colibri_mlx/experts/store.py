"""ExpertStore: routed experts read from the container on demand into a budgeted cache.

Everything but the routed experts is resident; an expert's bytes are read when a layer selects
it. The cache holds at most ``budget_bytes`` of experts in two parts:

* a pinned set, the hottest experts of the usage history (``.coli_usage``, docs/format.md#usage-history) that
  fit the pin budget, never evicted;
* an LRU for the rest of the budget. While the LRU is smaller than one token's unpinned
  working set (where a plain LRU evicts everything before its reuse: 0% hits), it admits an
  expert only if it was selected at least as often (usage history + this run, halved every
  ``10 x n_experts`` selections) as the LRU expert it would evict; otherwise the expert is used
  once and dropped.

Reads (``os.preadv``, GIL released) run on a small priority pool (:mod:`.prefetch`): when a
layer's selection is known, its missing experts are queued (``DEMAND``) in up to
``max_inflight`` read slots, then the previous token's selection of the next MoE layer as
guesses (``PREFETCH``); each lookup that frees a slot gives it to the next demand read, else
the next guess, so guesses overlap the current layer's tail even when K >= ``max_inflight``.
Reads that finished but were not asked for yet live outside the cache and are bounded by
``max_inflight`` experts. Each reader thread reads into its own reusable staging buffer and
makes the one copy into MLX arrays (``mx.array`` always copies).

Memory bound: resident weights + ``budget_bytes`` + (``max_inflight`` + 1) experts (reads in
flight, the expert being multiplied) + one staging buffer (one expert) per reader thread + MLX's
allocator slack.

Each expert is read in as few ``preadv`` calls as the layout allows: the tensors of one expert
are sorted by file offset and adjacent ones coalesced (docs/format.md#tensor-order: our writer and
upstream's converter put an expert's three weights next to each other, and its three ``.qs``
next to each other), so a container expert costs two reads, weights and scales.
"""

from __future__ import annotations

import os
import re
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..container import Container, ContainerError, to_float32
from ..errors import ColibriNote
from ..container.safetensors_reader import DTYPES
from ..formats.qtensor import QTensor
from .prefetch import BACKGROUND, DEMAND, PREFETCH, ReadPool
from .usage import USAGE_FILE, UsageError, UsageHistory, engine_id, read_usage, write_usage

PROJECTIONS = ("gate", "up", "down")
FLOAT_DTYPES = ("F32", "F16", "BF16")
GB = 1e9
_LAYER_PREFIX = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.$")


class ExpertStoreError(ContainerError):
    """An expert cannot be read (file truncated or changed since it was opened, bad layout)."""


# ------------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class Read:
    """One contiguous byte range of a shard."""

    path: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Part:
    """One stored tensor inside the buffer of ``reads[read]``."""

    name: str
    dtype: str
    read: int
    start: int
    nbytes: int


@dataclass(frozen=True)
class ProjectionLayout:
    name: str
    O: int
    I: int
    weight: Part
    scales: Optional[Part]  # None for a float (unquantized) expert
    fmt: Optional[int] = None
    gs: Optional[int] = None
    bits: Optional[int] = None       # MLX formats fmt 7-10 (mlx-lm checkpoints): code width
    biases: Optional[Part] = None    # fmt 7: per-group biases


@dataclass(frozen=True)
class ExpertLayout:
    layer: int
    expert: int
    reads: tuple[Read, ...]
    projections: tuple[ProjectionLayout, ...]  # gate, up, down

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reads)


def expert_tensor_names(layer: int, expert: int) -> list[str]:
    return [f"model.layers.{layer}.mlp.experts.{expert}.{p}_proj.weight" for p in PROJECTIONS]


def plan_expert(container: Container, layer: int, expert: int, shapes: dict) -> ExpertLayout:
    """Where one expert's bytes lie, with adjacent tensors of one shard merged into one read."""
    infos, projections = [], []
    for proj, name in zip(PROJECTIONS, expert_tensor_names(layer, expert)):
        weight = container.info(name)
        O, I = shapes[proj]
        if container.is_quantized(name):
            res = container.resolve(name, (O, I))
            scales = container.info(name + ".qs")
            infos += [weight, scales]
            projections.append((proj, O, I, weight, scales, res.fmt, res.gs))
        elif weight.dtype in FLOAT_DTYPES:
            if weight.shape != (O, I):
                raise ExpertStoreError(f"{weight.path}: tensor {name!r}: stored shape {list(weight.shape)}, "
                                       f"expected [{O}, {I}]")
            infos.append(weight)
            projections.append((proj, O, I, weight, None, None, None))
        else:
            raise ExpertStoreError(f"{weight.path}: tensor {name!r}: {weight.dtype} expert weights cannot be "
                                   f"streamed; expected a quantized (U8 + .qs) or F32/F16/BF16 tensor")
    reads, where = _coalesce(infos)
    parts = {n: Part(n, dt, r, s, nb) for n, (dt, r, s, nb) in where.items()}
    layouts = tuple(ProjectionLayout(p, O, I, parts[w.name], parts[s.name] if s is not None else None, fmt, gs)
                    for p, O, I, w, s, fmt, gs in projections)
    return ExpertLayout(layer, expert, tuple(reads), layouts)


@dataclass(frozen=True)
class ByteRange:
    """One tensor's bytes in a file, as :func:`_coalesce` takes them: an expert's row of a stacked
    tensor (mlx-lm ``switch_mlp``, GGUF ``*_exps``), named by the tensor it stands for."""

    name: str
    dtype: str
    path: str
    offset: int
    nbytes: int


def _coalesce(infos) -> tuple[list[Read], dict]:
    reads: list[Read] = []
    where = {}
    for info in sorted(infos, key=lambda t: (t.path, t.offset)):
        last = reads[-1] if reads else None
        if last is not None and last.path == info.path and last.offset + last.nbytes == info.offset:
            reads[-1] = Read(last.path, last.offset, last.nbytes + info.nbytes)
            where[info.name] = (info.dtype, len(reads) - 1, last.nbytes, info.nbytes)
        else:
            reads.append(Read(info.path, info.offset, info.nbytes))
            where[info.name] = (info.dtype, len(reads) - 1, 0, info.nbytes)
    return reads, where


# ------------------------------------------------------------------------------------- stats


@dataclass
class StoreStats:
    lookups: int = 0
    hits_pinned: int = 0
    hits_lru: int = 0
    hits_prefetch: int = 0  # not resident, but a guessed read had already started
    prefetches: int = 0  # guessed reads submitted
    misses: int = 0
    bypassed: int = 0  # read, used, not admitted to the LRU (colder than the expert it would evict)
    reads: int = 0  # experts read from disk (demand + prefetch + pin warm-up)
    bytes_read: int = 0
    bytes_wasted: int = 0  # prefetched and dropped unused
    read_s: float = 0.0  # summed over reader threads
    read_io_s: float = 0.0  # of which in preadv
    read_copy_s: float = 0.0  # of which copying into MLX arrays
    disk_wait_s: float = 0.0  # time the model thread was blocked on expert bytes
    tokens: int = 0  # positions seen by the first MoE layer

    def as_dict(self) -> dict:
        d = dict(vars(self))
        n = max(self.lookups, 1)
        d["hit_rate"] = (self.hits_pinned + self.hits_lru) / n
        d["hit_rate_pinned"] = self.hits_pinned / n
        d["hit_rate_lru"] = self.hits_lru / n
        d["prefetch_rate"] = self.hits_prefetch / n
        d["prefetch_accuracy"] = self.hits_prefetch / self.prefetches if self.prefetches else 0.0
        t = max(self.tokens, 1)
        d["bytes_read_per_token"] = self.bytes_read / t
        d["disk_wait_per_token_s"] = self.disk_wait_s / t
        d["read_mb_s"] = self.bytes_read / 1e6 / self.read_s if self.read_s > 0 else 0.0
        return d


@dataclass
class _Loaded:
    weights: tuple  # (gate, up, down): QTensor with mx arrays, or float mx.array [O, I]
    nbytes: int


@dataclass
class _InFlight:
    future: object
    kind: int  # DEMAND / PREFETCH
    nbytes: int


# ------------------------------------------------------------------------------------- store


class ExpertStore:
    """Routed experts of one container behind a byte budget (see the module docstring).

    ``layer_view(layer)`` is what a MoE layer holds instead of its expert list:
    ``view[e] -> (gate, up, down)``, ``view.prepare(ids)`` when the router has chosen.
    """

    drop_read_pages = False  # class default: readers built without __init__ (tests) see it too

    def __init__(self, container: Container, budget_bytes: int, *, pin: Optional[str] = None,
                 pin_bytes: Optional[int] = None, usage_path: Optional[str] = None, engine_name: Optional[str] = None,
                 record_usage: bool = True, workers: int = 4, max_inflight: Optional[int] = None,
                 prefetch: bool = True, preload_pinned: bool = True, drop_read_pages: bool = False,
                 admission: bool = True, held: Optional[dict] = None):
        if budget_bytes < 0:
            raise ValueError(f"expert budget must be >= 0 bytes, got {budget_bytes}")
        cfg = container.config
        self.container = container
        self.n_layers = int(cfg["num_hidden_layers"])
        self.n_experts = int(cfg["n_routed_experts"])
        self.engine_name = engine_name or str(cfg.get("model_type", "deepseek_v3"))
        self.budget_bytes = int(budget_bytes)
        self.prefetch_enabled = prefetch
        self.drop_read_pages = drop_read_pages
        self.max_inflight = max_inflight if max_inflight is not None else 2 * workers
        # {layer: expert ids} this process streams (a rank's share under distributed parallel);
        # None: every routed expert. Routing of other experts is still recorded in the history.
        self.held = held
        self.stats = StoreStats()
        self.resident_weight_bytes = 0  # set by the loader
        self.layouts = self._plan_all()
        self.moe_layers = sorted({layer for layer, _ in self.layouts})
        self.total_expert_bytes = sum(l.nbytes for l in self.layouts.values())
        self._fds = self._open_shards()
        self._lock = threading.Lock()
        self._lru: OrderedDict = OrderedDict()
        self._lru_bytes = 0
        self._pinned: dict = {}
        self._inflight: dict = {}
        self._plan: list = []  # this layer's missing experts not yet submitted
        self._guesses: list = []  # the next layer's likely experts not yet submitted
        self._prev_sets: dict[int, list] = {}
        self._pool = ReadPool(workers)
        self._staging = threading.local()
        self.usage_path = usage_path or getattr(container, "usage_path", None) or os.path.join(container.path,
                                                                                               USAGE_FILE)
        self.record_usage = record_usage
        self.usage = self._load_history()
        self.admission = admission
        # Admission frequencies: the usage history plus this run's selections, halved every
        # ``_freq_window`` selections so that a once-hot expert does not block newcomers forever.
        self._freq = self.usage.counts.astype(np.float64)
        self._freq_window = 10 * len(self.layouts)
        self._freq_seen = 0
        self._set_bytes: dict[int, int] = {}  # per MoE layer: bytes of its last unpinned selection
        self.working_set_bytes = 0  # their sum: what one token asks of the LRU
        self.pinned_keys = self._choose_pins(pin, pin_bytes)
        self.pinned_reserved = sum(self.layouts[k].nbytes for k in self.pinned_keys)
        self.lru_capacity = self.budget_bytes - self.pinned_reserved
        if preload_pinned and self.pinned_keys:
            self._warm_pins()

    # -- setup -----------------------------------------------------------------------------------
    def _plan_all(self) -> dict:
        cfg = self.container.config
        D, inter = int(cfg["hidden_size"]), int(cfg["moe_intermediate_size"])
        shapes = {"gate": (inter, D), "up": (inter, D), "down": (D, inter)}
        layouts = {}
        for layer in range(self.n_layers + 1 + int(cfg.get("num_nextn_predict_layers") or 0)):
            first, plan = expert_tensor_names(layer, 0)[0], plan_expert
            if hasattr(self.container, "plan_expert"):   # a GGUF model: its own stacked layout
                if not self.container.has_experts(layer):
                    continue
                plan = self.container.plan_expert
            elif first not in self.container:
                from ..models.mlx_lm_checkpoint import plan_stacked_expert, stacked_tensor_name

                if stacked_tensor_name(layer, "gate") not in self.container:
                    continue
                plan = plan_stacked_expert   # mlx-lm's switch_mlp: expert e is row e of [E, O, ...]
            if self.held is not None and layer not in self.held:
                continue
            for e in range(self.n_experts) if self.held is None else self.held[layer]:
                layouts[(layer, e)] = plan(self.container, layer, e, shapes)
        if not layouts:
            raise ExpertStoreError(f"{self.container.path}: no routed experts to stream "
                                   f"(no model.layers.*.mlp.experts.0.gate_proj.weight)")
        return layouts

    def _open_shards(self) -> dict[str, int]:
        fds = {}
        for layout in self.layouts.values():
            for r in layout.reads:
                if r.path not in fds:
                    fds[r.path] = os.open(r.path, os.O_RDONLY)
                    # Kept open: a shard deleted mid-run stays readable through its descriptor.
                size = os.fstat(fds[r.path]).st_size
                if r.offset + r.nbytes > size:
                    raise ExpertStoreError(f"{r.path}: expert {layout.layer}.{layout.expert} ends at byte "
                                           f"{r.offset + r.nbytes} but the file has {size}")
        return fds

    def _load_history(self) -> UsageHistory:
        fresh = UsageHistory.empty(self.n_layers, self.n_experts, engine_id(self.engine_name))
        if not os.path.exists(self.usage_path):
            return fresh
        try:
            history = read_usage(self.usage_path)
        except (UsageError, OSError) as e:
            warnings.warn(f"ignoring expert usage history: {e}", ColibriNote, stacklevel=3)
            return fresh
        if history.engine is not None and history.engine != engine_id(self.engine_name):
            warnings.warn(f"{self.usage_path}: usage history of another engine (id {history.engine}, this is "
                          f"{self.engine_name!r} = {engine_id(self.engine_name)}); starting a new one", ColibriNote,
                          stacklevel=3)
            return fresh
        if history.counts.shape != fresh.counts.shape:
            if history.engine is None and history.n_layers <= self.n_layers and history.n_experts <= self.n_experts:
                fresh.counts[: history.counts.shape[0], : history.n_experts] = history.counts  # legacy file
                return fresh
            warnings.warn(f"{self.usage_path}: usage history is {history.n_layers} layers x {history.n_experts} "
                          f"experts, the model {self.n_layers} x {self.n_experts}; starting a new one", ColibriNote,
                          stacklevel=3)
            return fresh
        history.engine = fresh.engine
        return history

    def _choose_pins(self, pin: Optional[str], pin_bytes: Optional[int]) -> frozenset:
        if pin is None:
            return frozenset()
        history = self.usage if pin == "auto" else read_usage(pin)
        budget = self.budget_bytes // 2 if pin_bytes is None else min(int(pin_bytes), self.budget_bytes)
        chosen, used = [], 0
        for key in history.hottest():
            layout = self.layouts.get(key)
            if layout is None:
                continue
            if used + layout.nbytes <= budget:
                chosen.append(key)
                used += layout.nbytes
        return frozenset(chosen)

    def _warm_pins(self) -> None:
        futures = [(k, self._pool.submit(lambda k=k: self._read(k), BACKGROUND)) for k in sorted(self.pinned_keys)]
        for key, fut in futures:
            self._pinned[key] = fut.result()

    # -- reading ---------------------------------------------------------------------------------
    def _read(self, key) -> _Loaded:
        layout = self.layouts[key]
        t0 = time.perf_counter()
        staging = self._staging_buffer(layout.nbytes)
        buffers, at = [], 0
        for r in layout.reads:
            buffers.append(self._pread(layout, r, staging[at: at + r.nbytes]))
            at += r.nbytes
        t1 = time.perf_counter()
        loaded = _Loaded(tuple(_projection(p, buffers, layout) for p in layout.projections), layout.nbytes)
        t2 = time.perf_counter()
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += layout.nbytes
            self.stats.read_s += t2 - t0
            self.stats.read_io_s += t1 - t0
            self.stats.read_copy_s += t2 - t1
        return loaded

    def _staging_buffer(self, nbytes: int) -> np.ndarray:
        """This thread's reusable read buffer: disk -> staging (warm pages) -> one copy into MLX.

        A fresh buffer per read would be page-faulted in on every read once the allocator
        stops recycling (a growing cache frees nothing); one buffer per reader thread is not.
        """
        local = self._staging
        buf = getattr(local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = local.buf = np.empty(nbytes, np.uint8)
        return buf[:nbytes]

    def _pread(self, layout: ExpertLayout, r: Read, out: Optional[np.ndarray] = None) -> np.ndarray:
        buf = np.empty(r.nbytes, np.uint8) if out is None else out
        view = memoryview(buf)
        fd = self._fds[r.path]
        got = 0
        while got < r.nbytes:
            n = os.preadv(fd, [view[got:]], r.offset + got)
            if n == 0:
                size = os.fstat(fd).st_size
                raise ExpertStoreError(
                    f"{r.path}: expert {layout.layer}.{layout.expert}: read {got} of {r.nbytes} bytes at offset "
                    f"{r.offset}; the file is now {size} bytes (truncated or replaced since it was opened?)")
            got += n
        if self.drop_read_pages:
            # The cache above is the budget: keep the kernel's page cache from holding a second copy.
            os.posix_fadvise(fd, r.offset, r.nbytes, os.POSIX_FADV_DONTNEED)
        return buf

    # -- the model's side ------------------------------------------------------------------------
    def layer_view(self, layer: int) -> "LayerExperts":
        return LayerExperts(self, layer)

    def view_for_prefix(self, prefix: str) -> "LayerExperts":
        """The view for ``model.layers.<i>.mlp.experts.`` (the name prefix a MoE layer knows)."""
        m = _LAYER_PREFIX.match(prefix)
        if m is None or int(m.group(1)) not in self.moe_layers:
            raise ExpertStoreError(f"{self.container.path}: no routed experts under {prefix!r}")
        return self.layer_view(int(m.group(1)))

    def tensor_names(self, layer: int) -> list[str]:
        names = []
        for e in range(self.n_experts):
            if (layer, e) not in self.layouts:
                continue   # another rank's expert
            for p in self.layouts[(layer, e)].projections:
                names += [p.weight.name] + ([p.scales.name] if p.scales is not None else [])
        return names

    def prepare(self, layer: int, ids: np.ndarray) -> None:
        """The router of ``layer`` chose ``ids [N, K]`` (negative = dropped by top-p)."""
        if self.record_usage:
            self.usage.record(layer, ids)
        self._count(layer, ids)
        if layer == self.moe_layers[0]:
            self.stats.tokens += int(ids.shape[0]) if ids.ndim > 1 else 1
        keys = [(layer, int(e)) for e in np.unique(ids) if e >= 0 and (layer, int(e)) in self.layouts]
        self._prev_sets[layer] = keys
        unpinned = sum(self.layouts[k].nbytes for k in keys if k not in self.pinned_keys)
        self.working_set_bytes += unpinned - self._set_bytes.get(layer, 0)
        self._set_bytes[layer] = unpinned
        self._drop_stale_prefetches(layer, set(keys))
        with self._lock:
            self._plan = [k for k in keys if not self._resident(k) and k not in self._inflight]
            # Guesses queue behind this layer's demand reads and take slots as those are consumed.
            self._guesses = self._next_layer_guesses(layer) if self.prefetch_enabled else []
            self._pump()

    def _count(self, layer: int, ids: np.ndarray) -> None:
        chosen = np.asarray(ids).reshape(-1)
        chosen = chosen[chosen >= 0]
        np.add.at(self._freq[layer], chosen, 1)
        self._freq_seen += chosen.size
        if self._freq_seen >= self._freq_window:
            self._freq *= 0.5
            self._freq_seen = 0

    def _next_layer_guesses(self, layer: int) -> list:
        """The previous token's set of the next MoE layer (wrapping from the last to the first)."""
        i = self.moe_layers.index(layer)
        nxt = self.moe_layers[(i + 1) % len(self.moe_layers)]
        return [k for k in self._prev_sets.get(nxt, ()) if not self._resident(k)]

    def get(self, layer: int, expert: int) -> tuple:
        key = (layer, expert)
        if key not in self.layouts:
            raise KeyError(f"no routed expert {expert} in layer {layer}")
        with self._lock:
            self.stats.lookups += 1
            if key in self._pinned:
                self.stats.hits_pinned += 1
                return self._pinned[key].weights
            if key in self._lru:
                self._lru.move_to_end(key)
                self.stats.hits_lru += 1
                return self._lru[key].weights
            pending = self._inflight.pop(key, None)
            if pending is None:  # not submitted yet: read it here, and not a second time later
                self._plan = [k for k in self._plan if k != key]
                self._guesses = [k for k in self._guesses if k != key]
            if pending is not None and pending.kind == PREFETCH:
                self.stats.hits_prefetch += 1
            else:
                self.stats.misses += 1
            self._pump()  # the slot just freed goes to the next demand read or guess
        t0 = time.perf_counter()
        loaded = pending.future.result() if pending is not None else self._read(key)
        self.stats.disk_wait_s += time.perf_counter() - t0
        with self._lock:
            self._insert(key, loaded)
        return loaded.weights

    def _resident(self, key) -> bool:
        return key in self._pinned or key in self._lru

    def _insert(self, key, loaded: _Loaded) -> None:
        if key in self.pinned_keys:
            self._pinned[key] = loaded
            return
        if loaded.nbytes > self.lru_capacity:
            return  # larger than the whole LRU: used once, not kept
        if self._admitting() and self._lru and self._lru_bytes + loaded.nbytes > self.lru_capacity:
            victim = next(iter(self._lru))
            if self._freq[key] < self._freq[victim]:
                self.stats.bypassed += 1  # colder than what it would evict: used once, not kept
                return
        while self._lru_bytes + loaded.nbytes > self.lru_capacity:
            _, old = self._lru.popitem(last=False)
            self._lru_bytes -= old.nbytes
        self._lru[key] = loaded
        self._lru_bytes += loaded.nbytes

    def _admitting(self) -> bool:
        """Admission only while the LRU is smaller than one token's unpinned working set: then
        plain LRU evicts every expert before its reuse (a loop longer than the cache), while
        above it recency wins (an expert chosen now is often chosen again next token)."""
        return self.admission and self.lru_capacity < self.working_set_bytes

    def _pump(self) -> None:
        """Fill free read slots (lock held): this layer's demand reads first, then guesses."""
        while len(self._inflight) < self.max_inflight and (self._plan or self._guesses):
            kind, key = (DEMAND, self._plan.pop(0)) if self._plan else (PREFETCH, self._guesses.pop(0))
            if key in self._inflight or self._resident(key):
                continue
            fut = self._pool.submit(lambda k=key: self._read(k), kind)
            self._inflight[key] = _InFlight(fut, kind, self.layouts[key].nbytes)
            if kind == PREFETCH:
                self.stats.prefetches += 1

    def _drop_stale_prefetches(self, layer: int, wanted: set) -> None:
        with self._lock:
            stale = [k for k, f in self._inflight.items() if k[0] == layer and k not in wanted]
            for key in stale:
                pending = self._inflight.pop(key)
                if not pending.future.cancel():
                    self.stats.bytes_wasted += pending.nbytes

    # -- reporting and lifetime ------------------------------------------------------------------
    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return self._lru_bytes + sum(l.nbytes for l in self._pinned.values())

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(l.nbytes for l in self._pinned.values())

    def report(self) -> dict:
        """Counters plus memory: budget, cached experts, pinned, resident weights, process RSS."""
        d = self.stats.as_dict()
        d.update(budget_bytes=self.budget_bytes, cached_bytes=self.cached_bytes, pinned_bytes=self.pinned_bytes,
                 pinned_experts=len(self.pinned_keys), total_expert_bytes=self.total_expert_bytes,
                 resident_weight_bytes=self.resident_weight_bytes, **process_memory())
        return d

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = StoreStats()

    def save_usage(self) -> None:
        """Rewrite ``.coli_usage`` (upstream rewrites it after every turn)."""
        if self.record_usage:
            try:
                write_usage(self.usage_path, self.usage, self.engine_name)
            except OSError as e:  # a read-only model directory must not end the session
                warnings.warn(f"cannot write the expert usage history: {e}", ColibriNote, stacklevel=2)

    def close(self) -> None:
        self._pool.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        with self._lock:
            self._lru.clear()
            self._pinned.clear()
            self._inflight.clear()
            self._lru_bytes = 0


class LayerExperts(Sequence):
    """The routed experts of one MoE layer as the MoE block sees them: ``view[e] -> (gate, up, down)``.

    ``eval_each`` asks the block to evaluate after each expert, so that at most one expert
    beyond the cache is referenced by the lazy graph at a time.
    """

    eval_each = True

    def __init__(self, store: ExpertStore, layer: int):
        self.store, self.layer = store, layer

    def __len__(self) -> int:
        return self.store.n_experts

    def __getitem__(self, e):
        if not isinstance(e, (int, np.integer)) or not 0 <= e < self.store.n_experts:
            raise IndexError(f"expert index {e!r} out of range 0..{self.store.n_experts - 1}")
        return self.store.get(self.layer, int(e))

    def prepare(self, ids: np.ndarray) -> None:
        self.store.prepare(self.layer, ids)


def _projection(p: ProjectionLayout, buffers: list[np.ndarray], layout: Optional[ExpertLayout] = None):
    """One projection's arrays from the read buffers: exactly one copy (``mx.array`` copies).
    Quantized scales are checked to be finite, as the resident loader checks them at load: a
    damaged expert is an error naming its shard and tensor, not NaN logits."""
    if p.bits is not None:
        from ..models.mlx_lm_checkpoint import stacked_projection

        return stacked_projection(p, buffers)
    if p.fmt is not None and p.scales is None:   # GGUF: the scales live inside the blocks
        from ..models.gguf_checkpoint import streamed_projection

        return streamed_projection(p, buffers)
    raw = buffers[p.weight.read][p.weight.start: p.weight.start + p.weight.nbytes]
    if p.scales is None:
        return mx.array(_as_float32(raw, p.weight.dtype).reshape(p.O, p.I))
    s = p.scales
    scales = _as_float32(buffers[s.read][s.start: s.start + s.nbytes], s.dtype)
    if p.fmt != 6 and not np.isfinite(scales).all():  # fmt 6's .qs is a tag
        where = layout.reads[s.read].path if layout is not None else "an expert shard"
        raise ExpertStoreError(f"{where}: tensor {s.name!r} holds NaN or infinite scales (a damaged shard?)")
    return QTensor(mx.array(raw), mx.array(scales), p.fmt, p.O, p.I, p.gs, p.weight.name, streamed=True)


def _as_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of stored bytes; F32 is a view (no copy before ``mx.array``'s own)."""
    stored = np.require(raw.view(DTYPES[dtype].storage), requirements="A")  # copies only if misaligned
    return stored if dtype == "F32" else to_float32(stored, dtype)


def process_memory() -> dict:
    """``rss_bytes`` / ``peak_rss_bytes`` from /proc/self/status (VmRSS / VmHWM); empty elsewhere."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss_bytes"] = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    out["peak_rss_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def format_stats(report: dict) -> str:
    """One line for the generation stats: hit split, disk bytes and wait per token, memory."""
    line = (f"expert hit rate {100 * report['hit_rate']:.1f}% (pin {100 * report['hit_rate_pinned']:.1f}% + "
            f"lru {100 * report['hit_rate_lru']:.1f}%; prefetched {100 * report['prefetch_rate']:.1f}% of lookups, "
            f"{100 * report['prefetch_accuracy']:.0f}% of guesses used) | "
            f"disk {report['bytes_read_per_token'] / 1e6:.1f} MB/token, wait "
            f"{1e3 * report['disk_wait_per_token_s']:.1f} ms/token | "
            f"resident {report['resident_weight_bytes'] / GB:.2f} GB + experts {report['cached_bytes'] / GB:.2f}"
            f"/{report['budget_bytes'] / GB:.2f} GB")
    if "rss_bytes" in report:
        line += f" | RSS {report['rss_bytes'] / GB:.2f} GB"
    return line


def resident_bytes(model) -> int:
    """Bytes of every weight the model holds outside the expert store (each array counted once)."""
    total, seen = 0, set()
    stack = [model]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (ExpertStore, LayerExperts)):
            continue
        seen.add(id(obj))
        if isinstance(obj, QTensor):
            total += obj.nbytes
        elif isinstance(obj, (mx.array, np.ndarray)):
            total += int(obj.nbytes)
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.extend(vars(obj).values())
    return total

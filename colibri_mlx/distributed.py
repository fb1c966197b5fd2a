"""One model across several processes or machines with ``mx.distributed`` (docs/distributed.md).

Launched under ``mlx.launch`` (a hostfile, or ``-n N`` on one host), every rank loads its share
of the model and ``mx.distributed.init()`` picks the backend (ring, MPI, JACCL, NCCL). A world
of size 1 is the single process, unchanged.

* **Expert parallel** (the default): each rank holds a disjoint share of every MoE layer's routed
  experts (:func:`plan_experts`, balanced by bytes or by the ``.coli_usage`` history); attention,
  dense layers, shared experts, embeddings and the head are replicated, or attention heads and
  the head's vocabulary split (``shard_attention``, :mod:`.tensor_parallel`). A MoE layer
  computes the rank's selected local experts and adds the partial sums with one ``all_sum``.
  ``ram_gb`` streams each rank's own experts from disk (:func:`rank_expert_store`).
* **Pipeline parallel**: contiguous layer ranges per rank (:func:`plan_layers`, balanced by
  bytes); the hidden state goes rank 0 → 1 → … → N-1 → 0 with ``send``/``recv``.

Rank 0 owns the tokenizer, sampling, output and the HTTP port: it drives an ordinary model
(:class:`DistributedModel`) and every forward call is mirrored on the other ranks, which run
:func:`follow` (the token ids of each step are broadcast with the call). Each rank reads only the
tensors it holds (:class:`RankLoad` counts the stored bytes read).

A rank that dies makes the collective on rank 0 fail (:class:`DistributedError`); a rank that
stops answering is reported after ``COLIBRI_DIST_TIMEOUT`` seconds (default
:data:`DEFAULT_TIMEOUT_S`) and rank 0 exits instead of hanging.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

PARALLEL_MODES = ("expert", "pipeline")
DEFAULT_TIMEOUT_S = 120.0
TIMEOUT_ENV = "COLIBRI_DIST_TIMEOUT"
TIMEOUT_EXIT_CODE = 75

_EXPERT = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts\.)(\d+)\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

# Command header rank 0 broadcasts before each mirrored call: op, batch, length, cache id,
# has left padding, a cache id to drop (0 = none), the cache's offset (checked: the ranks' caches
# stay in step).
OP_STOP, OP_FORWARD, OP_STATS = 0, 1, 2
HEADER = 7
STAT_FIELDS = ("resident_bytes", "read_bytes", "experts_held", "layers_held", "comm_s", "comm_calls", "tokens",
               "streamed_bytes", "expert_cache_bytes")


class DistributedError(RuntimeError):
    """A collective failed: a rank died or stopped answering."""


def launched() -> bool:
    """Whether this process was started by ``mlx.launch`` (or with its environment)."""
    return any(k in os.environ for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "MLX_JACCL_COORDINATOR"))


def init_group():
    """The world group when launched under ``mlx.launch``, else None (one process, unchanged)."""
    if not launched():
        return None
    group = mx.distributed.init(strict=True)
    return group if group.size() > 1 else None


def timeout_s() -> float:
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        t = float(value)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={value!r}: expected a number of seconds") from None
    if not t > 0:
        raise ValueError(f"{TIMEOUT_ENV}={value!r}: expected a positive number of seconds")
    return t


def write_local_hostfile(path, world: int) -> str:
    """A ring-backend hostfile of ``world`` ranks on 127.0.0.1 (free ports), what
    ``mlx.launch -n N --backend ring`` writes: run each rank with MLX_RANK and MLX_HOSTFILE=path."""
    import json
    import socket

    socks = [socket.socket() for _ in range(world)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
    with open(path, "w") as f:
        json.dump([[f"127.0.0.1:{p}"] for p in ports], f)
    return os.fspath(path)


# ----------------------------------------------------------------------------------- plans


def plan_experts(sizes: np.ndarray, world: int) -> list[list[int]]:
    """Disjoint expert shares of one layer, ``world`` lists of expert ids (ascending).

    ``sizes[e]`` is what expert e costs (stored bytes, or selections from a usage history):
    longest-processing-time assignment, each expert to the rank with the least so far, so shares
    differ by at most one expert's cost. Every rank gets at least one expert."""
    E = len(sizes)
    if E < world:
        raise ValueError(f"expert parallel needs at least one routed expert per rank: {E} experts, {world} ranks")
    load = [0.0] * world
    count = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for e in sorted(range(E), key=lambda e: (-float(sizes[e]), e)):
        # Ties (equal cost) go to the rank with fewer experts, then the lowest rank.
        r = min(range(world), key=lambda r: (load[r], count[r], r))
        shares[r].append(e)
        load[r] += float(sizes[e])
        count[r] += 1
    return [sorted(s) for s in shares]


def plan_layers(sizes: list[int], world: int, shared_after: set[int] = frozenset()) -> list[range]:
    """Contiguous layer ranges, one per rank, balanced by bytes (every rank at least one layer).

    A range never starts at a layer in ``shared_after`` (a DSA layer reusing the previous layer's
    selection: the selection stays on its rank)."""
    n = len(sizes)
    allowed = [i for i in range(1, n) if i not in shared_after]
    if n < world or len(allowed) < world - 1:
        raise ValueError(f"pipeline parallel needs at least one layer per rank: {n} layers "
                         f"({len(allowed) + 1} possible stage starts), {world} ranks")
    total = float(sum(sizes))
    prefix = np.cumsum([0] + list(sizes))
    starts = [0]
    for k in range(1, world):
        target = total * k / world
        lo = starts[-1] + 1
        hi_limit = n - (world - k)  # leave one layer per later rank
        candidates = [i for i in allowed if lo <= i <= hi_limit]
        if not candidates:
            raise ValueError(f"pipeline parallel: no stage start for rank {k} of {world} among layers {allowed}")
        starts.append(min(candidates, key=lambda i: (abs(prefix[i] - target), i)))
    starts.append(n)
    return [range(starts[r], starts[r + 1]) for r in range(world)]


# ---------------------------------------------------------------------------------- loading


def tensor_bytes(container, name: str) -> int:
    """Stored bytes a fetch of ``name`` reads: the tensor, its ``.qs`` scales, its FP8 block scales."""
    total = container.info(name).nbytes
    for companion in (name + ".qs", name + "_scale_inv"):
        if companion in container:
            total += container.info(companion).nbytes
    return total


def _expert_key(name: str):
    m = _EXPERT.match(name)
    return None if m is None else (m.group(1), int(m.group(3)))


def _layer_of(name: str):
    m = _LAYER.match(name)
    return None if m is None else int(m.group(1))


@dataclass
class RankLoad:
    """What one rank holds and read. ``read_bytes`` counts the stored bytes of every tensor fetched."""

    rank: int
    world: int
    mode: str
    experts: dict = field(default_factory=dict)    # "model.layers.i.mlp.experts." -> [expert ids]
    layers: range = range(0)
    read_bytes: int = 0
    sharded_bytes: int = 0      # stored bytes of the part split between ranks (all ranks together)
    replicated_bytes: int = 0   # stored bytes every rank reads


def plan_rank(container, args, rank: int, world: int, mode: str, usage=None,
              stored_bytes=None) -> tuple[RankLoad, set]:
    """This rank's load plan and the weight names it holds. ``stored_bytes``: the model tensor
    names of an mlx-lm checkpoint (``MlxLmWeights.names``, one per expert) -> the stored bytes a
    fetch of each reads; None: the container's own tensor names (:func:`tensor_bytes`)."""
    if mode not in PARALLEL_MODES:
        raise ValueError(f"--parallel {mode!r}: expected one of {', '.join(PARALLEL_MODES)}")
    from .models.loading import SCALE_INV_SUFFIX

    if stored_bytes is None:
        names = [n for n in container.weight_names() if not n.endswith(SCALE_INV_SUFFIX)]
    else:
        names = sorted(stored_bytes)
    n_layers = args.num_hidden_layers
    # MTP layers (index >= num_hidden_layers) are not used by the forward pass: no rank loads them.
    names = [n for n in names if (_layer_of(n) is None or _layer_of(n) < n_layers)]
    load = RankLoad(rank, world, mode)
    size = {n: tensor_bytes(container, n) if stored_bytes is None else stored_bytes[n] for n in names}
    if mode == "expert":
        by_layer: dict[str, dict[int, int]] = {}
        for n in names:
            key = _expert_key(n)
            if key is not None:
                by_layer.setdefault(key[0], {}).setdefault(key[1], 0)
                by_layer[key[0]][key[1]] += size[n]
        for prefix, per_expert in by_layer.items():
            ids = sorted(per_expert)
            cost = np.array([per_expert[e] for e in ids], dtype=np.float64)
            layer = int(prefix.split(".")[2])
            if usage is not None and layer < usage.n_layers and usage.counts[layer].sum() > 0:
                # Selections per expert balance the compute; +1 keeps never-selected experts spread.
                cost = usage.counts[layer][ids].astype(np.float64) + 1.0
            load.experts[prefix] = [ids[i] for i in plan_experts(cost, world)[rank]]
        held_experts = {(p, e) for p, es in load.experts.items() for e in es}
        held = set()
        for n in names:
            key = _expert_key(n)
            if key is None:
                held.add(n)
                load.replicated_bytes += size[n]
            else:
                load.sharded_bytes += size[n]
                if key in held_experts:
                    held.add(n)
        load.layers = range(n_layers)
    else:
        per_layer = [0] * n_layers
        for n in names:
            i = _layer_of(n)
            if i is not None:
                per_layer[i] += size[n]
        shared = {i for i in range(n_layers) if args.indexer_kind(i) == "shared"}
        load.layers = plan_layers(per_layer, world, shared)[rank]
        held = set()
        for n in names:
            i = _layer_of(n)
            if i is None:
                held.add(n)   # embeddings, final norm, head: replicated
                load.replicated_bytes += size[n]
            else:
                load.sharded_bytes += size[n]
                if i in load.layers:
                    held.add(n)
    return load, held


def load_rank_model(path: str, group, mode: str = "expert", dtype=None, expert_top_p: float | None = None,
                    usage_path: str | None = None, ram_gb: float | None = None, pin: str | None = None,
                    pin_gb: float | None = None, shard_attention: bool = False):
    """This rank's share of the model in directory ``path`` (a colibri container or any checkpoint
    ``load()`` accepts): only the tensors it holds are read. ``ram_gb`` streams this rank's routed
    experts (and only those) through an ``experts.ExpertStore`` with that budget per rank.
    ``shard_attention``: this rank's attention heads and vocabulary rows (:mod:`.tensor_parallel`)."""
    from .experts.usage import read_usage
    from .models.deepseek_v3 import Model, ModelArgs, resolve_dtype
    from .models.loading import _fetch, check_finite_scales
    from .models.modeldir import open_model_dir
    from .models.weights import WeightTable

    dtype = resolve_dtype(dtype)
    opened = open_model_dir(path)
    container, args = opened.container, ModelArgs.from_config(opened.config)
    from .models.mlx_lm_checkpoint import MlxLmWeights, is_mlx_lm_checkpoint

    # Checkpoints whose tensors are not the model's (stacked experts, split kv_b): the model's
    # names over them (expert e is row e of a stacked tensor), and the stored bytes of each.
    mapped = None
    if hasattr(container, "weight_table"):   # a GGUF model (models/gguf_checkpoint.py)
        from .models.gguf_checkpoint import GgufWeights

        kind, mapped = "a GGUF model", GgufWeights(container)
    elif is_mlx_lm_checkpoint(opened.config, container.names()):
        kind, mapped = "an mlx-lm checkpoint", MlxLmWeights(container, opened.config)
    if mapped is not None:
        if shard_attention:
            raise ValueError(f"{container.path}: --shard-attention is not available for {kind} (its attention "
                             "weights are not split by rows); use --parallel expert or pipeline alone")
        sizes = {n: mapped.stored_bytes(n) for n in mapped.names}
    usage_file = usage_path or getattr(container, "usage_path", None) or os.path.join(container.path, ".coli_usage")
    usage = read_usage(usage_file) if os.path.exists(usage_file) and mode == "expert" else None
    load, held = plan_rank(container, args, group.rank(), group.size(), mode, usage,
                           None if mapped is None else sizes)

    def fetch(name, shape):
        if mapped is not None:
            load.read_bytes += sizes[name]
            return mapped.fetch(name, shape)
        load.read_bytes += tensor_bytes(container, name)
        return _fetch(container, name, shape)

    model_args = args
    if shard_attention:
        from . import tensor_parallel

        if mode != "expert":
            raise ValueError("--shard-attention needs --parallel expert (pipeline stages hold whole layers)")
        tied = "lm_head.weight" not in held
        model_args = tensor_parallel.sharded_args(args, group.size())

        def fetch_rows(name, shape, r0, r1):
            value, nbytes = _fetch_rows(container, name, shape, r0, r1)
            load.read_bytes += nbytes
            return value

        table = WeightTable(held, tensor_parallel.shard_fetch(fetch, args, group.rank(), group.size(), tied,
                                                              fetch_rows), container.path)
        if not tied:
            tensor_parallel.head_shape_hook(table, args, group.rank(), group.size())
    else:
        table = WeightTable(held, fetch, container.path)
    if mode == "expert":
        table.experts_held = lambda prefix: load.experts[prefix]
    else:
        table.layers_held = load.layers
    store = None
    if ram_gb is not None:
        store = rank_expert_store(container, args, load, ram_gb, pin, pin_gb, usage_file)
        table.expert_store = store
    elif pin is not None or pin_gb is not None:
        raise ValueError("pin / pin_gb need ram_gb (expert streaming)")
    model = Model(model_args, table, dtype)
    model.expert_store = store
    if store is not None:
        from .experts import resident_bytes

        weakref.finalize(model, store.close)
        store.resident_weight_bytes = resident_bytes(model)
    if expert_top_p is not None:
        from .experts import set_expert_top_p

        set_expert_top_p(model, expert_top_p)
    return model, load


def _fetch_rows(container, name: str, shape: tuple, r0: int, r1: int):
    """Rows ``r0:r1`` of a stored weight and the stored bytes read for them: a quantized tensor's
    rows and its whole ``.qs``, a float tensor's rows. FP8 weights (block scales span 128 rows)
    are read whole and cut."""
    from . import tensor_parallel
    from .models.loading import _fetch, check_finite_scales

    info = container.info(name)
    if container.is_quantized(name):
        whole = container.tensor(name, shape)                  # memory-mapped: nothing read yet
        part = check_finite_scales(container, name, tensor_parallel.row_slice(whole, r0, r1))
        return part, int(part.packed.nbytes) + container.info(name + ".qs").nbytes
    if info.dtype not in ("F32", "BF16", "F16"):
        # FP8 (its block scales span 128 rows) and stored types _fetch refuses: whole, then cut.
        return tensor_parallel.row_slice(_fetch(container, name, shape), r0, r1), tensor_bytes(container, name)
    from .container import to_float32

    rows = container.tensor(name, shape)[r0:r1]
    values = to_float32(np.asarray(rows), info.dtype)
    if not np.isfinite(values).all():
        raise ValueError(f"{info.path}: tensor {name!r} holds NaN or infinite values (a damaged shard?)")
    return mx.array(np.ascontiguousarray(values, dtype=np.float32)), int(rows.nbytes)


def rank_expert_store(container, args, load: RankLoad, ram_gb: float, pin, pin_gb, usage_file: str):
    """The expert store of one rank: only the experts it holds, ``ram_gb`` GB of cache on this rank.
    None when the rank holds no routed expert (a pipeline stage of dense layers).

    The usage history is written by rank 0 alone, under expert parallel only: every rank routes
    every token through every layer (the router is replicated), so rank 0's history is the whole
    model's and one writer keeps the file whole. Under pipeline parallel no rank sees every layer's
    routing: the history is read (``--pin auto``) but not rewritten."""
    from .experts import ExpertStore

    if load.mode == "expert":
        held = {int(prefix.split(".")[2]): ids for prefix, ids in load.experts.items()}
    else:
        held = {i: range(args.n_routed_experts) for i in load.layers if args.is_moe_layer(i)}
    if not held:
        return None
    pin_bytes = None if pin_gb is None else int(pin_gb * 1e9)
    return ExpertStore(container, int(ram_gb * 1e9), pin=pin, pin_bytes=pin_bytes, usage_path=usage_file,
                       record_usage=load.rank == 0 and load.mode == "expert", held=held)


# ---------------------------------------------------------------------------- communication


class Comm:
    """Collectives of one group, timed, with a deadline: a peer that stops answering ends this
    process with a message after :func:`timeout_s` seconds instead of a hang."""

    def __init__(self, group, timeout: float | None = None):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.timeout = timeout_s() if timeout is None else timeout
        self.seconds = 0.0
        self.calls = 0

    def run(self, what: str, out, deadline: bool = True):
        """Evaluate the collective ``out`` (its inputs are evaluated first, outside the timing)."""
        timer = None
        if deadline:
            timer = threading.Timer(self.timeout, self._expired, args=(what,))
            timer.daemon = True
            timer.start()
        t0 = time.perf_counter()
        try:
            mx.eval(out)
        except RuntimeError as e:
            raise DistributedError(f"rank {self.rank}/{self.size}: {what} failed: {e} (a rank died or "
                                   "lost its connection)") from e
        finally:
            if timer is not None:
                timer.cancel()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def _expired(self, what):
        sys.stderr.write(f"colibri: rank {self.rank}/{self.size}: {what} got no answer from the other ranks in "
                         f"{self.timeout:g} s ({TIMEOUT_ENV}); a rank died or hangs. Exiting.\n")
        sys.stderr.flush()
        os._exit(TIMEOUT_EXIT_CODE)

    def all_sum(self, x, what="all_sum", deadline=True):
        mx.eval(x)
        return self.run(what, mx.distributed.all_sum(x, group=self.group), deadline)

    def send(self, x, dst, what="send"):
        mx.eval(x)
        return self.run(what, mx.distributed.send(x, dst, group=self.group))

    def recv_like(self, like, src, what="recv"):
        return self.run(what, mx.distributed.recv_like(like, src, group=self.group))


class ExpertParallel:
    """The MoE hook (``MoE.parallel``): this rank's selected local experts, one ``all_sum`` of
    the partial sums, then the (replicated) shared expert and the residual."""

    def __init__(self, comm: Comm, n_experts: int):
        self.comm = comm
        self.n_experts = n_experts

    def attach(self, moe) -> None:
        """``moe`` runs through this hook, with its global -> local expert index."""
        table = np.full(self.n_experts, -1, np.int32)
        table[moe.expert_ids] = np.arange(len(moe.expert_ids), dtype=np.int32)
        moe.local_index = mx.array(table)
        moe.parallel = self

    def __call__(self, moe, x, residual=None):
        from .kernels.dispatch import record_call
        from .models.deepseek_v3 import routed_experts

        record_call("moe_parallel", "all_sum")
        flat = x.reshape(-1, x.shape[-1])
        ids, weights = moe.router(flat)                     # global ids [N, K]
        local = moe.local_index[ids]
        held = local >= 0
        if getattr(moe.experts, "prepare", None) is not None:
            # Streamed (ExpertStore, global ids): the store sees the whole routing (its usage
            # history is the model's) and reads this rank's experts; other ranks' slots are dropped.
            moe.experts.prepare(np.array(ids))
            y = routed_experts(flat, _Prepared(moe.experts), mx.where(held, ids.astype(mx.int32), -1), weights)
        else:
            # Slots of other ranks' experts run local expert 0 with weight 0: exactly nothing added.
            y = routed_experts(flat, moe.experts, mx.where(held, local, 0), mx.where(held, weights, 0))
        y = self.comm.all_sum(y, "expert all_sum")
        if moe.shared is not None:
            y = y + moe.shared.forward(flat)
        y = y.reshape(x.shape)
        return y if residual is None else residual + y


class _Prepared:
    """A streamed layer's experts whose routing the store already has (``prepare`` is a no-op)."""

    eval_each = True

    def __init__(self, view):
        self.view = view

    def __len__(self):
        return len(self.view)

    def __getitem__(self, e):
        return self.view[e]

    def prepare(self, ids):
        pass


def pipeline_forward(model, comm: Comm, tokens: mx.array, cache, left_padding=None):
    """One forward call of this rank's pipeline stage; logits on rank 0, None elsewhere."""
    shape = (*tokens.shape, model.args.hidden_size)
    x = None if comm.rank == 0 else comm.recv_like(mx.zeros(shape, model.dtype), comm.rank - 1, "pipeline recv")
    x = model.hidden_states(tokens, cache, left_padding, x=x)
    comm.send(x, (comm.rank + 1) % comm.size, "pipeline send")
    if comm.rank != 0:
        return None
    x = comm.recv_like(mx.zeros(shape, model.dtype), comm.size - 1, "pipeline recv")
    return model.head(x)


# ------------------------------------------------------------------------------------ driving


class DistributedModel:
    """Rank 0's model: called like :class:`deepseek_v3.Model`; every call is mirrored on the
    other ranks (:func:`follow`). Other attributes are the local model's."""

    def __init__(self, model, comm: Comm, load: RankLoad):
        self._model, self._comm, self._load = model, comm, load
        self._cache_ids = weakref.WeakKeyDictionary()
        self._next_cache_id = 1
        self._dropped: list[int] = []
        self._tokens = 0
        self._closed = False

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _cache_id(self, cache) -> int:
        if cache not in self._cache_ids:
            cid = self._next_cache_id
            self._next_cache_id += 1
            self._cache_ids[cache] = cid
            weakref.finalize(cache, self._dropped.append, cid)
        return self._cache_ids[cache]

    def _command(self, op: int, B: int = 0, L: int = 0, cid: int = 0, padded: int = 0, offset: int = 0):
        drop = self._dropped.pop() if self._dropped else 0
        self._comm.all_sum(mx.array([op, B, L, cid, padded, drop, offset], dtype=mx.int32), "command broadcast")

    def __call__(self, tokens, cache=None, left_padding=None):
        tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
        if cache is None:
            cache = self.make_cache()
        B, L = tokens.shape
        padded = left_padding is not None and cache.offset == 0
        self._command(OP_FORWARD, B, L, self._cache_id(cache), int(padded), cache.offset)
        self._comm.all_sum(tokens.astype(mx.int32), "token broadcast")
        if padded:
            self._comm.all_sum(mx.array(left_padding, dtype=mx.int32).reshape(B), "padding broadcast")
        self._tokens += B   # per forward step: a generated token, or a prompt (counted once)
        return _forward(self._model, self._comm, self._load.mode, tokens, cache, left_padding)

    def stats(self) -> list[dict]:
        """Per-rank statistics (``STAT_FIELDS``), gathered from every rank."""
        self._command(OP_STATS)
        return _gather_stats(self._model, self._comm, self._load, self._tokens)

    def close(self) -> None:
        """Tell the other ranks to exit (they return from :func:`follow`)."""
        if not self._closed:
            self._closed = True
            self._command(OP_STOP)


def _forward(model, comm, mode, tokens, cache, left_padding):
    if mode == "pipeline":
        return pipeline_forward(model, comm, tokens, cache, left_padding)
    return model(tokens, cache=cache, left_padding=left_padding)


def _rank_stats(model, comm, load, tokens) -> list[float]:
    from .experts import resident_bytes

    held = sum(len(layer.mlp.expert_ids) for layer in model.layers if hasattr(layer.mlp, "expert_ids"))
    store = model.expert_store
    streamed, cached = (0, 0) if store is None else (store.stats.bytes_read, store.cached_bytes)
    return [resident_bytes(model), load.read_bytes, held, len(model.layers), comm.seconds, comm.calls, tokens,
            streamed, cached]


def _gather_stats(model, comm, load, tokens) -> list[dict]:
    # float64 on the CPU stream: bytes stay exact up to 2**53.
    row = np.zeros((comm.size, len(STAT_FIELDS)), np.float64)
    row[comm.rank] = _rank_stats(model, comm, load, tokens)
    table = np.array(comm.run("statistics", mx.distributed.all_sum(mx.array(row), group=comm.group, stream=mx.cpu)))
    return [dict(zip(STAT_FIELDS, map(float, r)), rank=i) for i, r in enumerate(table)]


def follow(model, comm: Comm, load: RankLoad) -> None:
    """Rank ≥ 1: mirror rank 0's calls until it stops. Waiting for the next call has no deadline
    (rank 0 may wait for a user); a call in progress has."""
    caches: dict[int, object] = {}
    tokens_seen = 0
    while True:
        header = comm.all_sum(mx.zeros((HEADER,), mx.int32), "command wait", deadline=False)
        op, B, L, cid, padded, drop, offset = (int(v) for v in header.tolist())
        caches.pop(drop, None)
        if op == OP_STOP:
            return
        if op == OP_STATS:
            _gather_stats(model, comm, load, tokens_seen)
            continue
        if op != OP_FORWARD:
            raise DistributedError(f"rank {comm.rank}: unknown command {op} from rank 0")
        tokens = comm.all_sum(mx.zeros((B, L), mx.int32), "token broadcast")
        left_padding = comm.all_sum(mx.zeros((B,), mx.int32), "padding broadcast") if padded else None
        cache = caches.get(cid)
        if cache is None:
            cache = caches[cid] = model.make_cache()
        if cache.offset != offset:
            raise DistributedError(f"rank {comm.rank}: its cache holds {cache.offset} positions, rank 0's {offset}: "
                                   "the ranks are out of step")
        tokens_seen += B
        _forward(model, comm, load.mode, tokens, cache, left_padding)
        # The logits are rank 0's; the cache writes are this rank's.
        mx.eval([b for layer_cache in cache.layers for b in layer_cache.buffers.values()])


def setup(path: str, mode: str = "expert", dtype=None, expert_top_p: float | None = None, ram_gb=None,
          pin=None, pin_gb=None, shard_attention: bool = False):
    """Under ``mlx.launch``: ``(model, load)`` where rank 0 gets a :class:`DistributedModel` and
    every other rank serves rank 0 until it stops and then exits the process. Not launched, or a
    world of one: None (load the model as usual). ``ram_gb``/``pin``/``pin_gb``: expert
    streaming of each rank's own experts, the budget per rank (:func:`rank_expert_store`).
    ``shard_attention``: attention heads and the head split between the ranks (:mod:`.tensor_parallel`)."""
    group = init_group()
    if group is None:
        return None
    comm = Comm(group)
    model, load = load_rank_model(path, group, mode, dtype, expert_top_p, ram_gb=ram_gb, pin=pin, pin_gb=pin_gb,
                                  shard_attention=shard_attention)
    if mode == "expert":
        hook = ExpertParallel(comm, model.args.n_routed_experts)
        for layer in model.layers:
            if hasattr(layer.mlp, "expert_ids"):
                hook.attach(layer.mlp)
    if shard_attention:
        from . import tensor_parallel

        tensor_parallel.install(model, comm, model.args)
    if comm.rank != 0:
        try:
            follow(model, comm, load)
        except DistributedError as e:
            sys.stderr.write(f"colibri: {e}\n")
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        os._exit(0)
    dist = DistributedModel(model, comm, load)
    import atexit

    atexit.register(_close_quietly, dist)
    return dist, load


def _close_quietly(dist) -> None:
    try:
        dist.close()
    except DistributedError:
        pass


def format_stats(stats: list[dict]) -> str:
    lines = []
    for s in stats:
        per_token = s["comm_s"] / s["tokens"] * 1e3 if s["tokens"] else 0.0
        lines.append(f"rank {s['rank']}: resident {s['resident_bytes'] / 1e6:.1f} MB, read "
                     f"{s['read_bytes'] / 1e6:.1f} MB, {int(s['experts_held'])} experts, {int(s['layers_held'])} "
                     f"layers, communication {per_token:.3f} ms/token ({int(s['comm_calls'])} collectives)")
        if s["streamed_bytes"]:
            lines[-1] += (f", experts streamed {s['streamed_bytes'] / 1e6:.1f} MB (cache "
                          f"{s['expert_cache_bytes'] / 1e6:.1f} MB)")
    return "\n".join(lines)


def load_for_cli(opened, parallel: str | None, options: dict, shard_attention: bool = False):
    """The CLI's model under ``mlx.launch`` (rank 0's :class:`DistributedModel`; other ranks serve
    and exit here), or None for one process. The per-rank statistics go to stderr at exit."""
    if not launched():
        if shard_attention:
            sys.stderr.write("colibri: note: --shard-attention needs mlx.launch (docs/distributed.md); running as "
                             "one process\n")
        if parallel is not None:
            sys.stderr.write(f"colibri: note: --parallel {parallel} needs mlx.launch (docs/distributed.md); "
                             "running as one process\n")
        return None
    unsupported = sorted(k for k in options if k not in ("dtype", "expert_top_p", "ram_gb", "pin", "pin_gb"))
    if unsupported:
        raise ValueError(f"--parallel: {', '.join('--' + k.replace('_', '-') for k in unsupported)} "
                         "not available with several ranks")
    made = setup(opened.path, parallel or "expert", options.get("dtype"), options.get("expert_top_p"),
                 options.get("ram_gb"), options.get("pin"), options.get("pin_gb"), shard_attention)
    if made is None:
        return None
    dist, _ = made
    import atexit

    atexit.register(_print_stats, dist)   # registered after close: runs before it
    return dist


def _print_stats(dist) -> None:
    try:
        sys.stderr.write(format_stats(dist.stats()) + "\n")
    except DistributedError as e:
        sys.stderr.write(f"colibri: per-rank statistics unavailable: {e}\n")

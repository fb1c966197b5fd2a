"""Expert streaming benchmark: ExpertStore on a DeepSeek-V3-sized synthetic container.

Builds a container of ``--layers`` MoE layers x ``--experts`` routed experts of hidden 7168 x
moe-intermediate 2048 in fmt 4 (gs 64; ~24.8 MB per expert with scales), and a skewed router
trace (Zipf popularity per layer, plus temporal persistence: each of the previous token's
experts is kept with probability ``--persist``). A warm-up trace from the same distribution is
written as the ``.coli_usage`` history that ``pin="auto"`` reads.

For each budget (fraction of all expert bytes) it reports: hit rate (pinned / LRU / prefetched)
against an offline-optimal Belady cache of the same capacity on the same trace; disk MB/s
achieved vs the raw sequential read speed of the same file; disk wait per token vs the time the
missed bytes take at raw speed; tokens/s. Compute is simulated (``--compute-ms`` per expert and
``--attn-ms`` per layer, as sleeps that release the GIL like a GPU would): the reference CPU
kernels need seconds per layer at this size, which would hide every I/O effect.

The page cache is dropped before each measurement (``echo 3 > /proc/sys/vm/drop_caches``, needs
root; otherwise the file must be larger than RAM) and the store runs with ``drop_read_pages``
(``posix_fadvise(DONTNEED)`` after each read) so that a re-read comes from the disk, not from
the kernel's cache. The container is deleted at the end unless ``--keep``.

    python scripts/bench/bench_streaming.py --dir /work/bench_stream --tokens 24
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import shutil
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from colibri_mlx.container import Container, write_shard  # noqa: E402
from colibri_mlx.experts import ExpertStore, UsageHistory, write_usage  # noqa: E402
from colibri_mlx.formats import QTensor, scale_nbytes, weight_nbytes  # noqa: E402

D, INTER, FMT, GS = 7168, 2048, 4, 64
ENGINE = "deepseek_v3"


def build(path: str, layers: int, experts: int) -> None:
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)
    shapes = {"gate": (INTER, D), "up": (INTER, D), "down": (D, INTER)}
    # Random bytes are expensive to draw: one pool, each tensor a different window of it.
    pool = rng.integers(0, 256, weight_nbytes(FMT, INTER, D, GS) + 4096, dtype=np.uint8)
    scale_pool = rng.random(scale_nbytes(FMT, INTER, D, GS) // 4 + 1024).astype(np.float32) * 0.01
    for layer in range(layers):
        tensors = {}
        for e in range(experts):
            for proj, (O, I) in shapes.items():
                nb, ns = weight_nbytes(FMT, O, I, GS), scale_nbytes(FMT, O, I, GS) // 4
                k = (layer * 131 + e * 7 + len(proj)) % 4096
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"
                tensors[name] = QTensor(pool[k:k + nb], scale_pool[k % 1024: k % 1024 + ns], FMT, O, I, GS, name)
        write_shard(os.path.join(path, f"out-{layer:05d}.safetensors"), tensors)
        print(f"  wrote layer {layer}", file=sys.stderr, flush=True)
    config = dict(model_type=ENGINE, num_hidden_layers=layers, n_routed_experts=experts, hidden_size=D,
                  moe_intermediate_size=INTER, first_k_dense_replace=0)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def router_trace(tokens: int, layers: int, experts: int, k: int, zipf_s: float, persist: float,
                 seed: int) -> np.ndarray:
    """``[tokens, layers, k]`` expert ids: Zipf popularity (a fixed permutation per layer) with
    each previous-token expert kept with probability ``persist``."""
    rng = np.random.default_rng(seed)
    perms = [np.random.default_rng(100 + l).permutation(experts) for l in range(layers)]
    p = 1.0 / np.arange(1, experts + 1) ** zipf_s
    p /= p.sum()
    out = np.zeros((tokens, layers, k), np.int64)
    prev = [None] * layers
    for t in range(tokens):
        for l in range(layers):
            keep = [] if prev[l] is None else [e for e in prev[l] if rng.random() < persist]
            q = p.copy()
            q[keep] = 0
            q /= q.sum()
            ranks = sorted(keep + [int(c) for c in rng.choice(experts, k - len(keep), replace=False, p=q)])
            prev[l] = ranks
            out[t, l] = perms[l][ranks]
    return out


def belady_hit_rate(accesses: list, capacity: int) -> float:
    """Offline optimal (Belady/MIN with bypass) hit rate for equal-sized items."""
    nxt, last = [0] * len(accesses), {}
    for i in range(len(accesses) - 1, -1, -1):
        nxt[i] = last.get(accesses[i], 1 << 60)
        last[accesses[i]] = i
    cache, heap, hits = {}, [], 0
    for i, key in enumerate(accesses):
        if key in cache:
            hits += 1
        elif capacity == 0:
            continue
        elif len(cache) >= capacity:
            while True:
                neg, victim = heapq.heappop(heap)
                if cache.get(victim) == -neg:
                    break
            if nxt[i] > -neg:  # the newcomer is needed later than everything cached: bypass
                heapq.heappush(heap, (neg, victim))
                continue
            del cache[victim]
        cache[key] = nxt[i]
        heapq.heappush(heap, (-nxt[i], key))
    return hits / len(accesses)


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_read_speed(path: str, nbytes: int) -> float:
    """Sequential MB/s reading ``nbytes`` of the shards in 16 MiB preads, page cache dropped."""
    drop_page_cache()
    shards = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    done, t0 = 0, time.perf_counter()
    for shard in shards:
        fd = os.open(shard, os.O_RDONLY)
        off = 0
        while done < nbytes:
            n = os.preadv(fd, [view], off)
            if n == 0:
                break
            off += n
            done += n
        os.close(fd)
        if done >= nbytes:
            break
    return done / 1e6 / (time.perf_counter() - t0)


def raw_random_read_speed(path: str, nbytes: int, chunk: int, threads: int) -> float:
    """MB/s of ``threads`` threads reading ``chunk``-byte ranges at random chunk-aligned offsets
    (the store's access pattern without the store), page cache dropped."""
    drop_page_cache()
    shards = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    fds = [os.open(s, os.O_RDONLY) for s in shards]
    rng = np.random.default_rng(7)
    jobs = [(fds[i], int(o) * chunk) for i, o in zip(rng.integers(0, len(fds), nbytes // chunk),
                                                      rng.integers(0, os.fstat(fds[0]).st_size // chunk - 1,
                                                                   nbytes // chunk))]

    def work(part):
        buf = memoryview(bytearray(chunk))
        for fd, off in part:
            os.preadv(fd, [buf], off)

    t0 = time.perf_counter()
    pool = [threading.Thread(target=work, args=(jobs[i::threads],)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    dt = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    return len(jobs) * chunk / 1e6 / dt


def run_budget(path: str, trace: np.ndarray, frac: float, pin: str | None, args) -> dict:
    drop_page_cache()
    container = Container(path)
    probe_bytes = None
    t_load = time.perf_counter()
    store = ExpertStore(container, 0, record_usage=False)
    total = store.total_expert_bytes
    probe_bytes = max(l.nbytes for l in store.layouts.values())
    store.close()
    budget = int(frac * total)
    store = ExpertStore(container, budget, pin=pin, record_usage=False, workers=args.workers,
                        drop_read_pages=True, prefetch=not args.no_prefetch, admission=not args.no_admission)
    load_s = time.perf_counter() - t_load
    store.reset_stats()
    compute = args.compute_ms / 1e3
    t0 = time.perf_counter()
    for t in range(trace.shape[0]):
        for layer in range(trace.shape[1]):
            time.sleep(args.attn_ms / 1e3)  # attention + router of this layer
            ids = trace[t, layer][None]
            store.prepare(layer, ids)
            for e in np.unique(ids):
                store.get(layer, int(e))
                time.sleep(compute)
    wall = time.perf_counter() - t0
    r = store.report()
    store.close()
    accesses = [(l, int(e)) for t in range(trace.shape[0]) for l in range(trace.shape[1])
                for e in np.unique(trace[t, l])]
    capacity = budget // probe_bytes
    missed = (r["misses"] + r["hits_prefetch"]) * probe_bytes
    return dict(frac=frac, pin=pin or "none", budget_gb=budget / 1e9, capacity=capacity, load_s=load_s,
                hit=r["hit_rate"], bypassed=r["bypassed"], pin_hit=r["hit_rate_pinned"], lru_hit=r["hit_rate_lru"],
                prefetched=r["prefetch_rate"], belady=belady_hit_rate(accesses, capacity),
                prefetches=r["prefetches"], prefetch_accuracy=r["prefetch_accuracy"],
                read_io_s=r["read_io_s"], read_copy_s=r["read_copy_s"], disk_wait_s=r["disk_wait_s"],
                mb_read=r["bytes_read"] / 1e6, missed_mb=missed / 1e6, wasted_mb=r["bytes_wasted"] / 1e6,
                disk_mb_s=r["bytes_read"] / 1e6 / wall, per_thread_mb_s=r["read_mb_s"],
                wait_per_token_s=r["disk_wait_s"] / trace.shape[0], tokens_per_s=trace.shape[0] / wall,
                wall_s=wall, rss_gb=r.get("peak_rss_bytes", 0) / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/work/bench_stream")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--warmup-tokens", type=int, default=300)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--persist", type=float, default=0.5)
    ap.add_argument("--budgets", default="0.10,0.25,0.50,1.00")
    ap.add_argument("--pins", default="none,auto", help="comma list of 'none' and/or 'auto'")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--compute-ms", type=float, default=1.0, help="simulated compute per expert")
    ap.add_argument("--attn-ms", type=float, default=1.0, help="simulated attention+router per layer")
    ap.add_argument("--raw-gb", type=float, default=4.0, help="bytes read for the raw sequential speed")
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--no-admission", action="store_true", help="plain LRU (no frequency admission)")
    ap.add_argument("--keep", action="store_true", help="keep the container afterwards")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    free = shutil.disk_usage(os.path.dirname(os.path.abspath(args.dir)) or ".").free
    per_expert = 3 * (weight_nbytes(FMT, INTER, D, GS) + scale_nbytes(FMT, INTER, D, GS))
    need = args.layers * args.experts * per_expert
    if not os.path.exists(os.path.join(args.dir, "config.json")):
        if need > 0.8 * free:
            sys.exit(f"container needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free: lower --layers/--experts")
        print(f"building {need / 1e9:.1f} GB container in {args.dir}", file=sys.stderr)
        build(args.dir, args.layers, args.experts)
    try:
        warm = router_trace(args.warmup_tokens, args.layers, args.experts, args.k, args.zipf, args.persist, 1)
        history = UsageHistory.empty(args.layers, args.experts)
        for l in range(args.layers):
            history.record(l, warm[:, l])
        write_usage(os.path.join(args.dir, ".coli_usage"), history, ENGINE)
        trace = router_trace(args.tokens, args.layers, args.experts, args.k, args.zipf, args.persist, 2)
        dropped = drop_page_cache()
        raw = raw_read_speed(args.dir, int(args.raw_gb * 1e9))
        print(f"raw sequential read: {raw:.0f} MB/s (page cache dropped: {dropped})", file=sys.stderr)
        per_expert_read = 3 * weight_nbytes(FMT, INTER, D, GS)
        raw_par = raw_random_read_speed(args.dir, int(args.raw_gb * 1e9), per_expert_read, args.workers)
        print(f"raw random {per_expert_read / 1e6:.1f} MB reads, {args.workers} threads: {raw_par:.0f} MB/s",
              file=sys.stderr)
        results = []
        for pin in args.pins.split(","):
            for frac in (float(b) for b in args.budgets.split(",")):
                r = run_budget(args.dir, trace, frac, None if pin == "none" else pin, args)
                r["raw_mb_s"] = raw
                r["raw_parallel_mb_s"] = raw_par
                r["wait_vs_missed_at_raw_parallel"] = (r["wait_per_token_s"] * args.tokens
                                                       / max(r["missed_mb"] / raw_par, 1e-9))
                r["wait_vs_missed_at_raw"] = r["wait_per_token_s"] * args.tokens / max(r["missed_mb"] / raw, 1e-9)
                results.append(r)
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}),
                      flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(args=vars(args), raw_mb_s=raw, raw_parallel_mb_s=raw_par, page_cache_dropped=dropped,
                               results=results), f,
                          indent=1)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()

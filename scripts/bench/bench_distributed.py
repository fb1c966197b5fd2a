#!/usr/bin/env python3
"""Distributed decode on local ranks against one process, and the latency of one ``all_sum``.

    python3 scripts/bench/bench_distributed.py [--model DIR] [--ranks 2] [--tokens 48] [--json OUT]

Method. Every run is a separate process group on 127.0.0.1 over MLX's ring backend (the
environment ``mlx.launch -n N --backend ring`` sets: MLX_RANK, MLX_HOSTFILE). Decode: a 13-token
prompt, then ``--tokens`` greedy steps; the figure is the median of the per-step wall time on rank
0 after 4 warm-up steps, for one process, for expert parallel and for pipeline parallel; the ratio
is distributed ms/token over one-process ms/token. ``all_sum``: 20 warm-up then 200 timed calls
of a float32 vector of the hidden width (one decode row: what a MoE layer sums) and of 8 rows,
each call evaluated on its own; median and 90th percentile in microseconds. Ranks share the
machine's cores, so the CPU ratio bounds the communication cost, not the speed-up of machines.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
WARMUP_STEPS = 4


def decode_worker(model_dir, mode, tokens, out):
    from colibri_mlx import distributed
    from colibri_mlx.models.loading import load_model

    made = distributed.setup(model_dir, mode)
    model = load_model(model_dir) if made is None else made[0]
    cache = model.make_cache()
    logits = model(mx.array([PROMPT]), cache=cache)
    steps = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        tok = int(mx.argmax(logits[0, -1]).item())
        logits = model(mx.array([[tok]]), cache=cache)
        mx.eval(logits)
        steps.append(time.perf_counter() - t0)
    result = {"ms_per_token": statistics.median(steps[WARMUP_STEPS:]) * 1e3}
    if made is not None:
        result["stats"] = model.stats()
        model.close()
    Path(out).write_text(json.dumps(result))


def allsum_worker(width, out):
    group = mx.distributed.init(strict=True)
    result = {}
    for rows in (1, 8):
        x = mx.ones((rows, width), mx.float32)
        mx.eval(x)
        times = []
        for i in range(220):
            t0 = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=group))
            if i >= 20:
                times.append(time.perf_counter() - t0)
        times.sort()
        result[f"{rows}x{width}"] = {"median_us": statistics.median(times) * 1e6,
                                     "p90_us": times[int(0.9 * len(times))] * 1e6}
    if group.rank() == 0:
        Path(out).write_text(json.dumps(result))


# The ms/token model of docs/distributed.md. Per-layer compute: H200, bench_moe_mla.py (docs/performance.md,
# first of the three 2026-12-02 runs), µs a layer at a 4096 cache.
H200_US = {"mla": 186.0, "moe_block": 142.7, "routed": 95.1}
# The same layers' bandwidth floors on the H200 (bytes / 4.3 TB/s, docs/performance.md), µs: an M3 Ultra
# (819 GB/s) reads them 4300/819 times slower; at half its bandwidth (our H200 routed experts reach 48 %).
H200_FLOOR_US = {"mla": 26.0, "moe_block": 52.0, "routed": 46.0}
M3_ULTRA_EFFICIENCY = 0.5
M3_ULTRA_US = {k: v * 4300 / 819 / M3_ULTRA_EFFICIENCY for k, v in H200_FLOOR_US.items()}
# Latency of one all_sum / send of a decode row (7168 bf16 = 14 KB), µs: ring over TCP/Thunderbolt and
# JACCL (RDMA over Thunderbolt 5) as published (docs/distributed.md cites them).
LINK_US = {"ring TCP": 300.0, "JACCL RDMA": 50.0}
MODELS = {"DeepSeek-V3": dict(layers=61, moe=58, experts=256, k=8),
          "Kimi-K2": dict(layers=61, moe=60, experts=384, k=8)}


@functools.lru_cache(maxsize=None)
def expected_max_local(experts, k, ranks, samples=20000, seed=0):
    """Mean over tokens of the most selected experts one rank holds (uniform routing, experts dealt
    round-robin): the rank every MoE layer waits for."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((samples, experts)), axis=1)[:, :k]
    return float(np.mean([np.bincount(row % ranks, minlength=ranks).max() for row in ids]))


def estimate(model, ranks, mode, link_us, c=H200_US):
    """ms/token of one decode row: compute on the slowest rank plus the collectives on the critical path."""
    m = MODELS[model]
    attention = m["layers"] * c["mla"]
    dense = (m["layers"] - m["moe"]) * c["moe_block"]        # dense MLP taken as a MoE block (upper bound)
    replicated = m["moe"] * (c["moe_block"] - c["routed"])   # router + shared expert
    routed = m["moe"] * c["routed"]
    broadcast = 2 * link_us if ranks > 1 else 0.0           # rank 0's command and token
    if mode == "expert" and ranks > 1:
        share = expected_max_local(m["experts"], m["k"], ranks) / m["k"]
        compute = attention + dense + replicated + routed * share
        comm = m["moe"] * link_us
    else:
        compute = attention + dense + replicated + routed
        comm = ranks * link_us if ranks > 1 else 0.0            # the hidden state visits every rank and returns
    return (compute + comm + broadcast) / 1e3


def print_estimates():
    print("ms/token, one decode row (docs/distributed.md); compute: H200 measured per layer / M3 Ultra at half "
          "its bandwidth")
    for model in MODELS:
        for scale_name, scale in (("H200 compute", H200_US), ("M3 Ultra compute", M3_ULTRA_US)):
            one = estimate(model, 1, "expert", 0.0, scale)
            cells = [f"1: {one:6.1f}"]
            for link, us in LINK_US.items():
                for mode in ("expert", "pipeline"):
                    row = ", ".join(f"{n}: {estimate(model, n, mode, us, scale):6.1f}" for n in (2, 4, 8))
                    cells.append(f"{mode} over {link} [{row}]")
            print(f"  {model:12s} {scale_name:17s} " + "\n" + "\n".join("      " + c for c in cells))


def _run_ranks(ranks, argv, tmp):
    from colibri_mlx.distributed import write_local_hostfile

    hostfile = write_local_hostfile(Path(tmp) / f"hosts{time.monotonic_ns()}.json", ranks)
    procs = []
    for r in range(ranks):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        if ranks > 1:
            env.update(MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile))
        else:
            env.pop("MLX_RANK", None)
            env.pop("MLX_HOSTFILE", None)
        procs.append(subprocess.Popen([sys.executable, __file__, *argv], env=env))
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"a rank failed: {argv}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "colibri_mlx" / "demo"))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--estimate", action="store_true", help="Print the ms/token model of docs/distributed.md.")
    a = ap.parse_args()
    if a.estimate:
        print_estimates()
        return
    if a.worker:
        if a.worker[0] == "decode":
            decode_worker(a.model, a.worker[1], a.tokens, a.worker[2])
        else:
            allsum_worker(int(a.worker[1]), a.worker[2])
        return
    width = json.loads((Path(a.model) / "config.json").read_text())["hidden_size"]
    report = {"model": a.model, "ranks": a.ranks, "tokens": a.tokens, "backend": "ring (127.0.0.1)"}
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("one_process", 1, "expert"), ("expert", a.ranks, "expert"), ("pipeline", a.ranks, "pipeline")]
        for name, ranks, mode in runs:
            out = Path(tmp) / f"{name}.json"
            _run_ranks(ranks, ["--model", a.model, "--tokens", str(a.tokens), "--worker", "decode", mode, str(out)],
                       tmp)
            report[name] = json.loads(out.read_text())
        out = Path(tmp) / "allsum.json"
        _run_ranks(a.ranks, ["--worker", "allsum", str(width), str(out)], tmp)
        report["all_sum"] = json.loads(out.read_text())
    one = report["one_process"]["ms_per_token"]
    print(f"{a.model}: {a.tokens} greedy tokens, {a.ranks} local ranks on the ring backend")
    print(f"  one process       {one:8.2f} ms/token")
    for name in ("expert", "pipeline"):
        r = report[name]
        r["ratio"] = r["ms_per_token"] / one
        comm = [s["comm_s"] / s["tokens"] * 1e3 for s in r["stats"]]
        print(f"  {name:8s} parallel {r['ms_per_token']:8.2f} ms/token  ratio {r['ratio']:.2f}x  "
              f"communication per rank {', '.join(f'{c:.2f}' for c in comm)} ms/token")
    for shape, t in report["all_sum"].items():
        print(f"  all_sum float32 [{shape}]: median {t['median_us']:.0f} us, p90 {t['p90_us']:.0f} us")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

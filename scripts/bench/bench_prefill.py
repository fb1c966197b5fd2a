#!/usr/bin/env python3
"""Prefill time of a short prompt (a server's time to first token) on the end-to-end bench's
model: the decode kernels on groups of 8 rows (``qgemv.PREFILL_KERNEL_ROWS``) against the
dequantize-and-matmul route, and mlx-lm's prefill of the same prompt in the same process.

    PYTHONPATH=/root/site:/tmp/site:$PWD python3 scripts/bench/bench_prefill.py [--tokens 9 16 32 64]
    PYTHONPATH=$PWD python3 scripts/bench/bench_prefill.py --tiny      # CPU smoke run

Method: for each prompt length P, --pairs pairs of prefills from an empty cache (the model's
forward over P tokens, logits of the last position evaluated, ``mx.synchronize()``), the two
routes of a pair in alternating order (AB, BA, ...); ``PREFILL_KERNEL_ROWS`` is set to P (row
groups) or 8 (dequantize) for the whole forward. Pairs whose sum took over 1.15x the best pair's
are dropped; the figure is the median of the rest. One unrecorded pair first (JIT, allocator).
mlx-lm (0.32.2, affine 4-bit g64, the same shapes, random weights) is timed after ours is freed:
median of --pairs prefills. On the CPU both routes are the reference path: a smoke run only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e as E  # noqa: E402
from colibri_mlx import kernels  # noqa: E402
from colibri_mlx.kernels import qgemv  # noqa: E402

OUTLIER = 1.15


@contextlib.contextmanager
def kernel_rows(n: int):
    saved = qgemv.PREFILL_KERNEL_ROWS
    qgemv.PREFILL_KERNEL_ROWS = n
    try:
        yield
    finally:
        qgemv.PREFILL_KERNEL_ROWS = saved


def prefill_seconds(forward, prompt) -> float:
    t0 = time.perf_counter()
    mx.eval(forward(prompt)[:, -1])
    mx.synchronize()
    return time.perf_counter() - t0


def ours_forward(model):
    return lambda prompt: model(prompt, model.make_cache())


def paired(forward, prompt, rows: int, pairs: int) -> tuple[float, float, int]:
    """Median seconds of the row-group and dequantize routes over the pairs kept."""
    def one(route):
        with kernel_rows(rows if route == "groups" else qgemv.MAX_ROWS):
            return prefill_seconds(forward, prompt)

    one("groups"), one("dequant")                    # unrecorded
    kept = []
    for i in range(pairs):
        order = ("groups", "dequant") if i % 2 == 0 else ("dequant", "groups")
        t = {r: one(r) for r in order}
        kept.append((t["groups"], t["dequant"]))
    best = min(a + b for a, b in kept)
    kept = [p for p in kept if p[0] + p[1] <= OUTLIER * best]
    return statistics.median(p[0] for p in kept), statistics.median(p[1] for p in kept), len(kept)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    E.add_model_args(ap)
    ap.add_argument("--tokens", type=int, nargs="+", default=[9, 16, 24, 32, 48, 64])
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--no-mlxlm", action="store_true", help="ours only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = E.model_config(args)
    rng = np.random.default_rng(0)
    prompts = {P: mx.array(rng.integers(0, args.vocab, (1, P)).astype(np.int32)) for P in args.tokens}
    res = {"backend": kernels.backend(), "layers": args.layers, "experts": args.experts,
           "kernel_rows_default": qgemv.PREFILL_KERNEL_ROWS, "rows": []}
    model = E.our_model(cfg)
    forward = ours_forward(model)
    print(f"{'P':>4s} {'groups ms':>10s} {'dequant ms':>11s} {'dequant/groups':>15s} {'pairs':>6s}", flush=True)
    for P in args.tokens:
        kernels.reset_counters()
        g, d, n = paired(forward, prompts[P], P, args.pairs)
        row = {"tokens": P, "groups_ms": g * 1e3, "dequant_ms": d * 1e3, "pairs_kept": n,
               "fallbacks": kernels.counters()["fallbacks"]}
        res["rows"].append(row)
        print(f"{P:4d} {g * 1e3:10.2f} {d * 1e3:11.2f} {d / g:15.2f} {n:3d}/{args.pairs}", flush=True)
    del model, forward
    kernels.moe.clear_banks()
    mx.clear_cache()
    if not args.no_mlxlm:
        from mlx_lm.models.cache import make_prompt_cache

        lm = E.lm_model(cfg)
        lm_forward = lambda prompt: lm(prompt, cache=make_prompt_cache(lm))   # noqa: E731
        for row in res["rows"]:
            prompt = prompts[row["tokens"]]
            prefill_seconds(lm_forward, prompt)
            row["mlxlm_ms"] = statistics.median(prefill_seconds(lm_forward, prompt) for _ in range(args.pairs)) * 1e3
            print(f"{row['tokens']:4d} mlx-lm {row['mlxlm_ms']:.2f} ms (ours with row groups: "
                  f"{row['mlxlm_ms'] / row['groups_ms']:.2f}x)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

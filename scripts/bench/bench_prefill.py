#!/usr/bin/env python3
"""Prefill time of a prompt (a server's time to first token) on the end-to-end bench's model,
each of kernels.qmatmul's prefill routes forced for the whole forward, and mlx-lm's prefill of
the same prompt in the same process:

* ``mlx-qmm``: ``mx.quantized_matmul`` on the stored bytes (kernels/mlx_qmm.py), the routed
  experts by ``mx.gather_qmm`` over the layer's stacked bytes (moe.moe_gather_qmm);
* ``qmm-grouped``: ``mx.quantized_matmul`` as ``mlx-qmm``, the routed experts grouped by token
  (each expert's rows through qmatmul: its GEMV kernel up to 8 rows, then mx.quantized_matmul);
* ``dequant``: dequantized tiles + matmul, the routed experts grouped by token (each expert's
  rows through qmatmul: its GEMV kernel up to 8 rows).

    PYTHONPATH=/root/site:/tmp/site:$PWD python3 scripts/bench/bench_prefill.py [--tokens 9 16 32 64]
    PYTHONPATH=$PWD python3 scripts/bench/bench_prefill.py --tiny      # CPU smoke run

Method: for each prompt length P, --rounds rounds of prefills from an empty cache (the model's
forward over P tokens, logits of the last position evaluated, ``mx.synchronize()``), one per
route, the order rotated each round (ABC, BCA, CAB, ...). Rounds whose sum took over 1.15x the
best round's are dropped; the figure is the median of the rest. One unrecorded round first (JIT,
allocator). Before the timing, each route's logits at the
last position are compared with the dequantize route's (max |delta| / max |logit|).
mlx-lm (0.32.2, affine 4-bit g64, the same shapes, random weights) is timed after ours is freed:
median of --rounds prefills. On the CPU every route is the reference path: a smoke run only.
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
from colibri_mlx.kernels import mlx_qmm, moe, qgemv  # noqa: E402

OUTLIER = 1.15
ROUTES = ("mlx-qmm", "qmm-grouped", "dequant")


@contextlib.contextmanager
def route(name: str):
    """kernels.qmatmul / moe_block take prefill route ``name`` for P rows inside the block."""
    decline, gather = mlx_qmm.decline_reason, moe.gather_reason
    if name == "dequant":
        mlx_qmm.decline_reason = lambda qt, dtype: "forced off (bench_prefill --routes)"
    if name in ("dequant", "qmm-grouped"):
        moe.gather_reason = lambda bank, dtype: "forced off (bench_prefill --routes)"
    try:
        yield
    finally:
        mlx_qmm.decline_reason, moe.gather_reason = decline, gather


def prefill_seconds(forward, prompt) -> float:
    t0 = time.perf_counter()
    mx.eval(forward(prompt)[:, -1])
    mx.synchronize()
    return time.perf_counter() - t0


def ours_forward(model):
    return lambda prompt: model(prompt, model.make_cache())


def route_agreement(model, prompt, routes: list) -> dict:
    """Each route's last-position logits against the dequantize route's: max |delta| / max |logit|."""
    out = {}
    for name in routes:
        with route(name):
            out[name] = model(prompt, model.make_cache())[0, -1].astype(mx.float32)
    base = out.get("dequant")
    if base is None:
        return {}
    scale = float(mx.abs(base).max())
    return {name: float(mx.abs(v - base).max()) / scale for name, v in out.items() if name != "dequant"}


def rotated_rounds(forward, prompt, routes: list, rounds: int) -> tuple[dict, int]:
    """Median seconds a route over the rounds kept, and how many were kept."""
    def one(name):
        with route(name):
            return prefill_seconds(forward, prompt)

    for name in routes:                                   # unrecorded
        one(name)
    kept = []
    for i in range(rounds):
        order = routes[i % len(routes):] + routes[:i % len(routes)]
        kept.append({name: one(name) for name in order})
    best = min(sum(r.values()) for r in kept)
    kept = [r for r in kept if sum(r.values()) <= OUTLIER * best]
    return {name: statistics.median(r[name] for r in kept) for name in routes}, len(kept)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    E.add_model_args(ap)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64, 128, 512])
    ap.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-mlxlm", action="store_true", help="ours only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = E.model_config(args)
    rng = np.random.default_rng(0)
    prompts = {P: mx.array(rng.integers(0, args.vocab, (1, P)).astype(np.int32)) for P in args.tokens}
    res = {"backend": kernels.backend(), "layers": args.layers, "experts": args.experts,
           "rows": []}
    model = E.our_model(cfg)
    forward = ours_forward(model)
    print(f"{'P':>5s} " + " ".join(f"{r + ' ms':>12s}" for r in ROUTES) + "  rounds", flush=True)
    for P in args.tokens:
        routes = list(args.routes)
        kernels.reset_counters()
        agree = route_agreement(model, prompts[P], routes)
        times, n = rotated_rounds(forward, prompts[P], routes, args.rounds)
        row = {"tokens": P, **{f"{r}_ms": t * 1e3 for r, t in times.items()}, "rounds_kept": n,
               "vs_dequant": agree, "fallbacks": kernels.counters()["fallbacks"],
               "calls": kernels.counters()["calls"]}
        res["rows"].append(row)
        cells = " ".join(f"{times[r] * 1e3:12.2f}" if r in times else f"{'-':>12s}" for r in ROUTES)
        print(f"{P:5d} {cells}  {n:2d}/{args.rounds}; logits vs dequant (max |delta| / max |logit|): "
              + ", ".join(f"{k} {v:.1e}" for k, v in agree.items()), flush=True)
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
            row["mlxlm_ms"] = statistics.median(prefill_seconds(lm_forward, prompt) for _ in range(args.rounds)) * 1e3
            ours = min(v for k, v in row.items() if k.endswith("_ms") and k != "mlxlm_ms")
            print(f"{row['tokens']:5d} mlx-lm {row['mlxlm_ms']:.2f} ms; mlx-lm / our fastest route "
                  f"{row['mlxlm_ms'] / ours:.2f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

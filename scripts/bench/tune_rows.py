#!/usr/bin/env python3
"""Kernel-only times of a verify step's multi-row launches (S rows of x) against one row, and
other launch settings at S rows: what to pick as the S > 1 defaults.

    PYTHONPATH=/root/site:/tmp/site:$PWD python3 scripts/bench/tune_rows.py --rows 4 --json /tmp/tune_rows.json

Launches, at the bench model's shapes (fmt 4 g64, bf16 x): qgemv's head (129280 x 7168, float
logits), 18432 x 7168, 7168 x 2048 and 2112 x 7168 (the stacked q_a / kv_a), and moe_gate_up /
moe_down (8 routed experts a row of --experts, 7168 <-> 2048; each row its own random experts,
as a verify step's rows of the random bench model route). Each at S = 1 (default settings), at
S = --rows (default), then at S = --rows for each setting of --qgemv (ROWS:NW:UNROLL:NIB:PF[:PB])
and --down / --gate-up (bench_moe_parts' syntax).

Method: profile_kernels.py's: CUPTI kernel records (PyTorch's profiler) of --iters rounds, each
launch of a chain of 8 instances (own weights: nothing an L2 hit) evaluated alone; the median
duration a launch. "x1 row" is the time over the same launch's S = 1 default time; "bytes" the
weight bytes it must read (moe: the distinct experts' projections).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from colibri_mlx import kernels  # noqa: E402
from colibri_mlx.kernels import dispatch, qgemv  # noqa: E402
import bench_moe_parts as M  # noqa: E402
import profile_kernels as P  # noqa: E402

QGEMV_SHAPES = ((129280, 7168, mx.float32), (18432, 7168, None), (7168, 2048, None), (2112, 7168, None))
QGEMV_SETTINGS = ["6:-:-:-:-", "2:-:-:-:-", "-:2:-:-:-", "-:-:2:-:0", "-:-:1:-:0", "8:1:1:-:1"]
MOE_D, MOE_INTER = 7168, 2048
DOWN_SETTINGS = ["-:-:1:-", "2:-:-:-", "8:-:-:-", "-:2:-:-", "-:8:-:-", "-:-:1:-:-:-:1024"]
GATE_UP_SETTINGS = ["-:-:-:-:1", "-:-:1:-:0", "1:-:-:-:-", "4:-:-:-:-", "-:2:-:-:-"]


def qgemv_launches(impl, S_list, settings):
    from bench_qgemv import random_qtensors
    from colibri_mlx.formats import scale_nbytes, weight_nbytes

    out, keep = [], []
    for O, I, out_dtype in QGEMV_SHAPES:
        ws = random_qtensors(4, O, I, 64, P.CHAIN)
        nbytes = weight_nbytes(4, O, I, 64) + scale_nbytes(4, O, I, 64)
        for S in S_list:
            xs = [mx.random.normal((S, I)).astype(mx.bfloat16) for _ in ws]
            mx.eval(xs)
            keep.append(xs)
            base = f"qgemv {O}x{I}"
            out.append((base, S, "-", nbytes,
                        [qgemv.launch_spec(x, w, impl, out_dtype=out_dtype) for x, w in zip(xs, ws)]))
            for cfg in settings if S > 1 else ():
                rows, nw, unroll, nib, pf, pb = M.parse(cfg, 6)
                try:
                    specs = [qgemv.launch_spec(x, w, impl, rows=rows, simdgroups=nw, unroll=unroll, nib=nib,
                                               prefetch=pf, persistent=pb, out_dtype=out_dtype)
                             for x, w in zip(xs, ws)]
                except ValueError as e:
                    print(f"{base} S={S} {cfg}: {e}")
                    continue
                out.append((base, S, cfg, nbytes, specs))
        keep.append(ws)
    return out, keep


def moe_launches(impl, S_list, experts, k, gate_up_settings, down_settings):
    layers = [M.make_layer(experts, MOE_D, MOE_INTER, 256) for _ in range(P.CHAIN)]
    out, keep = [], [layers]
    g = layers[0].group
    for S in S_list:
        ids, gw, xs, distinct = M.token_inputs(S, layers, experts, k, mx.bfloat16)
        hs = [dispatch.launch(impl, s)[0] for s in M.gate_up_setting("-", xs, layers, ids, k, impl)]
        mx.eval(hs)
        keep.append((ids, gw, xs, hs))
        for cfg in ["-"] + (gate_up_settings if S > 1 else []):
            out.append(("moe_gate_up", S, cfg, distinct * 2 * M.proj_bytes(g.gate_up),
                        M.gate_up_setting(cfg, xs, layers, ids, k, impl)))
        for cfg in ["-"] + (down_settings if S > 1 else []):
            out.append(("moe_down", S, cfg, distinct * M.proj_bytes(g.down),
                        M.down_setting(cfg, hs, layers, ids, gw, S, k, impl, mx.bfloat16)))
    return out, keep


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[4], help="S of the multi-row launches (2..8)")
    ap.add_argument("--experts", type=int, default=64, help="routed experts a layer (the bank; 8 instances)")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--qgemv", nargs="*", default=QGEMV_SETTINGS, help="ROWS:NW:UNROLL:NIB:PF[:PB] at S rows")
    ap.add_argument("--down", nargs="*", default=DOWN_SETTINGS, help="moe_down ROWS:NW:UNROLL:NIB[:PF[:MINB[:PB]]]")
    ap.add_argument("--gate-up", nargs="*", default=GATE_UP_SETTINGS,
                    help="moe_gate_up ROWS:NW:UNROLL:NIB:PF[:MINB[:PB]]")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    impl = kernels.backend()
    if impl != dispatch.CUDA:
        print(f"tune_rows: needs the CUDA backend (CUPTI; this is {impl}); nothing to time")
        return 0
    S_list = (1, *args.rows)
    launches, keep = qgemv_launches(impl, S_list, args.qgemv)
    more, keep_moe = moe_launches(impl, S_list, args.experts, args.k, args.gate_up, args.down)
    launches += more
    keep.append(keep_moe)          # the inputs stay alive while the specs run
    flat = [(f"{name} S={S} {cfg}", nbytes, specs) for name, S, cfg, nbytes, specs in launches]
    recs = P.cupti_times(impl, flat, args.iters)
    per_round = P.CHAIN * len(flat)
    if len(recs) != per_round * args.iters:
        print(f"expected {per_round * args.iters} kernel records, got {len(recs)}: not attributable")
        return 1
    one_row, rows = {}, []
    print(f"{'launch':<22} {'S':>2} {'setting':<18} {'us':>8} {'x1 row':>7} {'MB':>8} {'TB/s':>6}  template")
    for j, (name, S, cfg, nbytes, specs) in enumerate(launches):
        durs = [recs[r * per_round + j * P.CHAIN + c][0] for r in range(args.iters) for c in range(P.CHAIN)]
        us = statistics.median(durs)
        if S == 1 and cfg == "-":
            one_row[name] = us
        ratio = us / one_row[name] if name in one_row else float("nan")
        detail = (M.template_of(specs[0], "ROWS", "NW", "UNROLL", "NIB", "PF", "PERS", "MINB")
                  + f" grid={specs[0].grid[0]}")
        print(f"{name:<22} {S:>2} {cfg:<18} {us:>8.1f} {ratio:>7.2f} {nbytes / 1e6:>8.1f} "
              f"{nbytes / us / 1e6:>6.2f}  {detail}", flush=True)
        rows.append(dict(launch=name, S=S, setting=cfg, us=us, vs_one_row=ratio, bytes=nbytes, template=detail))
    best = {}
    for r in rows:
        key = f"{r['launch']} S={r['S']}"
        if r["S"] > 1 and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    print("\nfastest at each S:")
    for name, r in best.items():
        print(f"  {name:<27} {r['setting']:<18} {r['us']:8.1f} us  x{r['vs_one_row']:.2f} of one row  {r['template']}")
    if args.json:
        args.json.write_text(json.dumps(dict(rows=rows, best=best), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

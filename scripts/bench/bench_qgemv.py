#!/usr/bin/env python3
"""Time the qgemv CUDA twin against mx.quantized_matmul (affine 4-bit, g64) on the same shapes.

    PYTHONPATH=/root/site:$PWD python3 scripts/bench/bench_qgemv.py [--json out.json]

Method: S = --rows rows of bf16 x (default 1); each timed evaluation runs N independent GEMVs that
cycle through enough weight copies to exceed the 60 MB L2 several times, so weights come from
HBM; the graph is built before the clock starts and the clock stops after mx.synchronize();
median of REPS evaluations, divided by N. Bytes = packed weights + scales + x (what must be
read); efficiency = bytes / time / 4.3 TB/s (the H200's measured copy bandwidth).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from colibri_mlx.formats import QTensor, scale_nbytes, weight_nbytes  # noqa: E402
from colibri_mlx.kernels import dispatch, qgemv  # noqa: E402

PEAK = 4.3e12
L2_BYTES = 60e6
SHAPES = [(7168, 2048), (2048, 7168), (18432, 7168)]
REPS = 15
GEMVS_PER_EVAL = 64


def n_copies(nbytes: int) -> int:
    return max(2, int(-(-6 * L2_BYTES // nbytes)))


def random_qtensors(fmt, O, I, gs, n):
    out = []
    for k in range(n):
        nb = weight_nbytes(fmt, O, I, gs)
        packed = mx.random.randint(0, 256, (nb,), dtype=mx.int32).astype(mx.uint8)
        ns = scale_nbytes(fmt, O, I, gs) // 4
        scales = mx.random.uniform(0.005, 0.02, (ns,))
        out.append(QTensor(packed, scales, fmt, O, I, gs, f"bench{k}"))
    mx.eval([(q.packed, q.scales) for q in out])
    return out


SUBMIT: dict = {}


def time_evals(make_outputs, label=None) -> float:
    """Median seconds per GEMV; ``make_outputs()`` builds GEMVS_PER_EVAL lazy outputs.
    With ``label``, also records the CPU time until ``mx.async_eval`` returns (MLX has encoded
    every launch and submitted the CUDA graph): when that is close to the total, the figure is
    MLX's per-launch CPU cost, not the kernel."""
    mx.eval(make_outputs())  # warm-up: JIT compile, allocations
    mx.synchronize()
    times, submits = [], []
    for _ in range(REPS):
        outs = make_outputs()
        mx.synchronize()
        t0 = time.perf_counter()
        mx.async_eval(outs)
        t1 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        times.append(time.perf_counter() - t0)
        submits.append(t1 - t0)
    if label:
        SUBMIT[label] = statistics.median(submits) / GEMVS_PER_EVAL
    return statistics.median(times) / GEMVS_PER_EVAL


def bench_ours(fmt, O, I, x, gs=None, label=None, **tuning):
    qts = random_qtensors(fmt, O, I, gs, n_copies(weight_nbytes(fmt, O, I, gs)))
    nbytes = weight_nbytes(fmt, O, I, gs) + scale_nbytes(fmt, O, I, gs) + x.nbytes

    def outs():
        return [qgemv.qgemv(x, qts[k % len(qts)], dispatch.CUDA, **tuning) for k in range(GEMVS_PER_EVAL)]

    t = time_evals(outs, label)
    del qts
    return t, nbytes


def bench_mlx_qmm(O, I, x):
    n = n_copies(O * I // 2)
    ws = []
    for _ in range(n):
        w = mx.random.normal((O, I)).astype(mx.bfloat16)
        ws.append(mx.quantize(w, group_size=64, bits=4))
        mx.eval(ws[-1])
    nbytes = sum(a.nbytes for a in ws[0]) + x.nbytes

    def outs():
        return [mx.quantized_matmul(x, *ws[k % n], transpose=True, group_size=64, bits=4)
                for k in range(GEMVS_PER_EVAL)]

    return time_evals(outs, f"qmm {O}x{I}"), nbytes


def bench_kernel_only(fmt, O, I, x, gs, stack=16):
    """The kernel without MLX's per-launch cost: one launch over ``stack`` weights' rows stacked
    ([stack*O, I], the same bytes per row), timed per launch; returns the time per GEMV's share."""
    qts = random_qtensors(fmt, stack * O, I, gs, max(2, n_copies(stack * weight_nbytes(fmt, O, I, gs))))
    nbytes = weight_nbytes(fmt, O, I, gs) + scale_nbytes(fmt, O, I, gs) + x.nbytes
    n = len(qts)

    def outs():
        return [qgemv.qgemv(x, qts[k % n], dispatch.CUDA) for k in range(GEMVS_PER_EVAL // stack)]

    # time_evals divides one evaluation by GEMVS_PER_EVAL: here GEMVS_PER_EVAL // stack launches
    # of `stack` GEMVs each, i.e. GEMVS_PER_EVAL GEMVs' worth: already the per-GEMV share.
    return time_evals(outs), nbytes


# The default launch (qgemv.launch_spec) first, then variants around it: N = fmt 2/4 decode
# (1 fp16-subnormal codes + one -8 sum x per segment, 0 magic-number codes + a bias op per
# nibble pair), PF = register double buffer (next step's loads before this step's math),
# R = rows per threadgroup, NW = SIMD groups per threadgroup (split-K), U = unroll.
# PREVIOUS: the best launch of the first GPU run (R4 NW1 U2, magic decode, no prefetch) on
# today's kernel (which also hoists the fmt 4 scale loads and skips per-8 x bounds tests).
PREVIOUS = {"rows": 4, "simdgroups": 1, "unroll": 2, "nib": 0, "prefetch": 0}
TUNINGS = [{}, PREVIOUS, {"rows": 4, "simdgroups": 1, "unroll": 2, "nib": 1, "prefetch": 0},
           {"prefetch": 1, "unroll": 1, "nib": 0}, {"prefetch": 1, "unroll": 2},
           {"rows": 8, "simdgroups": 1, "unroll": 1, "prefetch": 1},
           {"rows": 8, "unroll": 1, "prefetch": 1}, {"rows": 2, "unroll": 2, "prefetch": 1},
           {"simdgroups": 2}, {"simdgroups": 4}]
# Small shapes are launch-overhead bound: fewer variants.
SMALL_TUNINGS = [{}, PREVIOUS, {"rows": 8, "unroll": 1, "prefetch": 1}, {"simdgroups": 2},
                 {"simdgroups": 4}]


def launch_label(fmt, O, I, gs, x, tuning) -> str:
    """R<rows> NW<SIMD groups per threadgroup> U<unroll> of the launch these settings give."""
    qt = QTensor(mx.zeros((weight_nbytes(fmt, O, I, gs),), mx.uint8),
                 mx.zeros((scale_nbytes(fmt, O, I, gs) // 4,)), fmt, O, I, gs, "label")
    t = dict(qgemv.launch_spec(x, qt, dispatch.CUDA, **tuning).template)
    label = f"R{t['ROWS']} NW{t['NW']} U{t['UNROLL']} N{t['NIB']} PF{t['PF']}"
    return label + (" (default)" if not tuning else " (previous)" if tuning == PREVIOUS else "")


def row(label, O, I, t, nbytes, t_base=None):
    bw = nbytes / t
    r = {"kernel": label, "shape": f"{O}x{I}", "us": t * 1e6, "GB/s": bw / 1e9, "pct_peak": 100 * bw / PEAK}
    if t_base:
        r["x_vs_qmm"] = t_base / t
    print("  " + format_row(r), flush=True)  # as it comes: a run cut short still reports
    return r


def format_row(r) -> str:
    return (f"{r['kernel']:48s} {r['shape']:>11s} {r['us']:8.2f} {r['GB/s']:7.0f} {r['pct_peak']:8.1f} "
            f"{r.get('x_vs_qmm', 1.0):6.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--shapes", nargs="*", default=[f"{O}x{I}" for O, I in SHAPES],
                    help="OxI shapes to time (default: all of SHAPES)")
    ap.add_argument("--fmts", nargs="*", type=int, default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--rows", type=int, default=1, help="rows of x (a batch's decode rows)")
    ap.add_argument("--no-variants", action="store_true", help="only the default launch of each fmt")
    args = ap.parse_args()
    if dispatch.gpu_backend() != dispatch.CUDA:
        print("bench_qgemv: needs MLX's CUDA backend")
        return 2
    mx.random.seed(0)
    rows = []
    for O, I in (tuple(int(v) for v in s.split("x")) for s in args.shapes):
        x = mx.random.normal((args.rows, I)).astype(mx.bfloat16)
        t_qmm, b_qmm = bench_mlx_qmm(O, I, x)
        rows.append(row("mx.quantized_matmul 4b g64", O, I, t_qmm, b_qmm))
        tunings = [{}] if args.no_variants else TUNINGS if O * I >= 2**26 else SMALL_TUNINGS
        for fmt, gs in ((f, 64 if f == 4 else None) for f in (2, 4) if f in args.fmts):
            for tuning in tunings:
                label = f"fmt {fmt} {O}x{I}" if not tuning else None
                t, b = bench_ours(fmt, O, I, x, gs, label=label, **tuning)
                rows.append(row(f"qgemv fmt {fmt} {launch_label(fmt, O, I, gs, x, tuning)}", O, I, t, b, t_qmm))
            if O * I < 2**26 and not args.no_variants:
                t, b = bench_kernel_only(fmt, O, I, x, gs)
                rows.append(row(f"qgemv fmt {fmt} kernel only (16 stacked)", O, I, t, b, t_qmm))
        for fmt in (f for f in (1, 3, 5, 6) if f in args.fmts):
            t, b = bench_ours(fmt, O, I, x)
            rows.append(row(f"qgemv fmt {fmt} {launch_label(fmt, O, I, None, x, {})}", O, I, t, b, t_qmm))
        print(f"done {O}x{I}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\n{'kernel':48s} {'shape':>11s} {'us':>8s} {'GB/s':>7s} {'%4.3TB/s':>8s} {'x qmm':>6s}")
    for r in rows:
        print(format_row(r))
    print("\nCPU time per GEMV until mx.async_eval returned (all launches encoded and submitted) vs the total:")
    for label, t in SUBMIT.items():
        print(f"  {label:24s} submit {t * 1e6:6.2f} us")
    print("kernel only: one launch over 16 weights' rows stacked, time per GEMV's share (no per-launch cost)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

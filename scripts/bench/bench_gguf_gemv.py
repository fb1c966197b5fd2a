#!/usr/bin/env python3
"""Time qgemv's GGUF decode variants (CUDA twin) against mx.quantized_matmul 4-bit in the same run.

    PYTHONPATH=/root/site:$PWD python3 scripts/bench/bench_gguf_gemv.py --json gguf_gemv.json
    PYTHONPATH=$PWD python3 scripts/bench/bench_gguf_gemv.py --tiny    # CPU smoke run (kernels.qmatmul)

Shape 18432x7168 (DeepSeek-V3's gate/up at hidden 7168), one row of bf16 x, GGUF Q4_K, Q6_K,
IQ4_XS, IQ2_XXS and Q8_0 (random blocks with finite fp16 scales: tests/kernel_oracle.py), each at
its default launch and launch variants (TUNINGS, VARIANT_COUNT); the baseline is mx.quantized_matmul affine 4-bit,
group 64, bfloat16 scales and biases.

Method (strata's): paired, alternating A/B timing. A pair is one evaluation of ours and one of
the baseline, in alternating order (AB, BA, ...); an evaluation runs GEMVS_PER_EVAL independent
GEMVs cycling through enough weight copies to exceed the 60 MB L2 several times (weights come from
HBM), the graph built before the clock starts, the clock stopped after mx.synchronize(). Pairs
whose A + B took over 1.15x the best pair's are dropped; the figure is the median of the rest, per
GEMV. Bytes = the packed weights (+ scales and biases for the baseline) + x; GB/s as a percentage
of 4.3 TB/s (the H200's measured copy bandwidth). Each launch's output is first checked against
the float64 product with formats/gguf_quant.py's decode (|delta| / sum|x w|; bf16 output, so up to
~2^-8). After the timings, every GGUF type not timed is checked the same way at 512x2048
with three rows of x (--no-check-all skips it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from colibri_mlx.formats import QTensor  # noqa: E402
from colibri_mlx.formats.gguf_quant import GGUF_TYPES, dequantize_gguf  # noqa: E402
from colibri_mlx import kernels  # noqa: E402
from colibri_mlx.kernels import dispatch, qgemv  # noqa: E402
from kernel_oracle import random_gguf_qtensor  # noqa: E402

PEAK = 4.3e12
L2_BYTES = 60e6
O, I = 18432, 7168
TYPES = ["Q4_K", "IQ4_XS", "Q6_K", "IQ2_XXS", "Q8_0"]
PAIRS = 21
GEMVS_PER_EVAL = 32
OUTLIER = 1.15
TINY = False
# The default launch first, then (for VARIANT_TYPES) variants: PF = the next step's loads issued
# before this step's arithmetic (CUDA's default for fmt 2/4), rows per threadgroup, unroll, SIMD
# groups a threadgroup (split-K), "persistent": "auto" = fmt 4's one-row launch on CUDA (a grid
# of dispatch.balanced_blocks over qgemv.CUDA_PERSISTENT_ROWS_BLOCKS, the shape compiled in), nib
# = Q4_K's codes (1: fp16 subnormals, CUDA's default; 0: magic-number codes). The first
# VARIANT_COUNT[type] entries are timed for a type (the default alone for the others).
TUNINGS = [{}, {"prefetch": 1, "unroll": 1},
           {"prefetch": 1, "unroll": 1, "rows": 6, "persistent": "auto", "shape_in": True},
           {"rows": 8, "unroll": 1}, {"rows": 2, "unroll": 2}, {"prefetch": 1, "unroll": 2},
           {"rows": 6, "unroll": 2}, {"simdgroups": 2},
           {"nib": 0}, {"nib": 0, "prefetch": 1, "unroll": 1, "rows": 6, "persistent": "auto", "shape_in": True}]
VARIANT_COUNT = {"Q4_K": 10, "IQ4_XS": 8, "Q6_K": 4, "IQ2_XXS": 4}
VARIANT_TYPES = tuple(VARIANT_COUNT)


def n_copies(nbytes: int) -> int:
    """Weight copies an evaluation cycles through: six L2s' worth (two with --tiny)."""
    return 2 if TINY else max(2, int(-(-6 * L2_BYTES // nbytes)))


def gguf_copies(name: str) -> tuple:
    """Distinct device buffers holding one set of random blocks (distinct addresses are what
    defeats the L2; equal contents do not matter)."""
    host = random_gguf_qtensor(name, O, I, seed=0)
    n = n_copies(host.packed.nbytes)
    out = [QTensor(mx.array(host.packed.reshape(-1)), mx.zeros((0,), mx.float32), host.fmt, O, I, host.gs,
                   f"bench.{name}.{k}") for k in range(n)]
    mx.eval([q.packed for q in out])
    return out, host


def qmm_copies() -> list:
    """The baseline's weights: affine 4-bit g64 with bfloat16 scales and biases, as many copies."""
    n = n_copies(O * I // 2)
    out = []
    for _ in range(n):
        w = (mx.random.normal((O, I)) * 0.02).astype(mx.bfloat16)
        out.append(tuple(mx.quantize(w, group_size=64, bits=4)))
        mx.eval(out[-1])
    return out


def resolve(tuning: dict) -> dict:
    """``tuning`` with persistent "auto" as fmt 4's persistent grid size for this shape and rows."""
    if tuning.get("persistent") != "auto":
        return tuning
    n_blocks = -(-O // tuning.get("rows", qgemv.CUDA_PERSISTENT_ROWS))
    return {**tuning, "persistent": dispatch.balanced_blocks(n_blocks, qgemv.CUDA_PERSISTENT_ROWS_BLOCKS)}


def gemv(x, qt, **tuning):
    """Ours: the CUDA kernel (with ``tuning``); without a CUDA GPU (--tiny) the backend's qmatmul."""
    if dispatch.gpu_backend() == dispatch.CUDA:
        return qgemv.qgemv(x, qt, dispatch.CUDA, **resolve(tuning))
    return kernels.qmatmul(x, qt)


def one_eval(make_outputs) -> float:
    outs = make_outputs()
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - t0) / GEMVS_PER_EVAL


def paired(make_a, make_b) -> dict:
    """Median seconds per GEMV of A and B over the kept pairs (alternating order; a pair is
    dropped when its A + B is over OUTLIER x the best pair's)."""
    for make in (make_a, make_b):
        mx.eval(make())   # warm-up: compile, allocate
    mx.synchronize()
    pairs = []
    for k in range(PAIRS):
        if k % 2 == 0:
            ta = one_eval(make_a)
            tb = one_eval(make_b)
        else:
            tb = one_eval(make_b)
            ta = one_eval(make_a)
        pairs.append((ta, tb))
    best = min(a + b for a, b in pairs)
    kept = [(a, b) for a, b in pairs if a + b <= OUTLIER * best]
    return {"a": statistics.median(p[0] for p in kept), "b": statistics.median(p[1] for p in kept),
            "kept": len(kept), "pairs": len(pairs)}


def check(name: str, host, x, tuning=None) -> float:
    """Worst |delta| / sum|x w| of the launch with ``tuning`` over the first rows against the float64 product
    with formats/gguf_quant.py's decode (bit-equal to ggml's and gguf-py's)."""
    rows = min(256, O)
    part = QTensor(host.packed[:rows], host.scales, host.fmt, rows, I, host.gs, f"check.{name}")
    w64 = dequantize_gguf(host.fmt, part.packed).astype(np.float64)
    tuning = resolve(tuning or {})
    if tuning.get("persistent"):   # 256 rows fill no persistent grid: 7 threadgroups looping, unevenly
        tuning = {**tuning, "persistent": 7}
    y = gemv(x, part.to_mlx(), **tuning)
    x64 = np.asarray(x.astype(mx.float32)).astype(np.float64)
    got = np.asarray(y.astype(mx.float32)).astype(np.float64)
    return float((np.abs(got - x64 @ w64.T) / (np.abs(x64) @ np.abs(w64).T)).max())


def check_small(name: str) -> float:
    """check() of one type at 512x2048 with three rows of bf16 x (one launch to compile a type)."""
    qt = random_gguf_qtensor(name, 512, 2048, seed=3)
    w64 = dequantize_gguf(qt.fmt, qt.packed).astype(np.float64)
    x = mx.random.normal((3, 2048)).astype(mx.bfloat16)
    got = np.asarray(gemv(x, qt.to_mlx()).astype(mx.float32)).astype(np.float64)
    x64 = np.asarray(x.astype(mx.float32)).astype(np.float64)
    return float((np.abs(got - x64 @ w64.T) / (np.abs(x64) @ np.abs(w64).T)).max())


def write_json(path, rows) -> None:
    if path:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows, indent=1))
        tmp.replace(path)


def launch_label(qt, x, tuning) -> str:
    spec = qgemv.launch_spec(x, qt, dispatch.CUDA, **resolve(tuning))
    t = dict(spec.template)
    pers = f" P{spec.grid[0] // spec.threadgroup[0]}" if t["PERS"] else ""
    return (f"R{t['ROWS']} NW{t['NW']} U{t['UNROLL']} PF{t['PF']} N{t['NIB']}{pers}"
            + (" (default)" if not tuning else ""))


def row(kernel, t, nbytes, t_base=None, **extra) -> dict:
    bw = nbytes / t
    r = {"kernel": kernel, "shape": f"{O}x{I}", "us": t * 1e6, "GB/s": bw / 1e9, "pct_peak": 100 * bw / PEAK,
         **extra}
    if t_base:
        r["x_vs_qmm"] = t_base / t
    print("  " + format_row(r), flush=True)   # as it comes: a run cut short still reports
    return r


def format_row(r) -> str:
    return (f"{r['kernel']:44s} {r['us']:8.2f} {r['GB/s']:7.0f} {r['pct_peak']:8.1f} {r.get('x_vs_qmm', 1.0):6.2f}"
            f" {r.get('kept', ''):>5} {'' if r.get('check') is None else format(r['check'], '.2g'):>8}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--types", nargs="*", default=TYPES)
    ap.add_argument("--no-variants", action="store_true", help="time only the default launch")
    ap.add_argument("--tiny", action="store_true", help="256x1024, few pairs (CPU smoke run)")
    ap.add_argument("--no-check-all", action="store_true", help="skip checking the types not timed")
    args = ap.parse_args()
    global O, I, PAIRS, GEMVS_PER_EVAL, TINY
    if args.tiny:
        O, I, PAIRS, GEMVS_PER_EVAL, TINY = 256, 1024, 3, 2, True
    elif dispatch.gpu_backend() != dispatch.CUDA:
        print("bench_gguf_gemv: needs MLX's CUDA backend (or --tiny)")
        return 2
    variants = not args.no_variants and dispatch.gpu_backend() == dispatch.CUDA
    mx.random.seed(0)
    x = mx.random.normal((1, I)).astype(mx.bfloat16)
    qmm = qmm_copies()
    qmm_bytes = sum(a.nbytes for a in qmm[0]) + x.nbytes

    def theirs():
        return [mx.quantized_matmul(x, *qmm[k % len(qmm)], transpose=True, group_size=64, bits=4)
                for k in range(GEMVS_PER_EVAL)]

    rows = []
    t_start = time.perf_counter()
    print(f"{'kernel':44s} {'us':>8s} {'GB/s':>7s} {'%4.3TB/s':>8s} {'x qmm':>6s} {'kept':>5s} {'check':>8s}", flush=True)
    for name in args.types:
        qts, host = gguf_copies(name)
        nbytes = host.packed.nbytes + x.nbytes
        if not variants and not args.no_variants:   # --tiny: the CUDA launches the H200 run times, built
            print(f"  {name} variants on CUDA: " + "; ".join(launch_label(qts[0], x, t)
                                                           for t in TUNINGS[:VARIANT_COUNT.get(name, 1)]))
        for tuning in TUNINGS[:VARIANT_COUNT.get(name, 1) if variants else 1]:
            def ours(tuning=tuning):
                return [gemv(x, qts[k % len(qts)], **tuning) for k in range(GEMVS_PER_EVAL)]

            label = f"{name} {launch_label(qts[0], x, tuning)}"
            try:
                err = check(name, host, x, tuning)
                res = paired(ours, theirs)
            except Exception as e:   # a variant that fails to build or run: reported, the others still timed
                print(f"  {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows.append({"kernel": label, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            if not tuning:
                rows.append(row("mx.quantized_matmul 4b g64", res["b"], qmm_bytes, kept=f"{res['kept']}/{res['pairs']}",
                                paired_with=name))
            rows.append(row(label, res["a"], nbytes, res["b"], kept=f"{res['kept']}/{res['pairs']}",
                            check=err, type=name, tuning=resolve(tuning),
                            elapsed_s=round(time.perf_counter() - t_start, 1)))
        del qts
    write_json(args.json, rows)
    print(f"\n{'kernel':44s} {'us':>8s} {'GB/s':>7s} {'%4.3TB/s':>8s} {'x qmm':>6s} {'kept':>5s} {'check':>8s}")
    for r in rows:
        print(format_row(r) if "error" not in r else f"{r['kernel']:44s} {r['error']}")
    if not args.no_check_all:   # after the timings: a run cut short by its time limit keeps them
        print("\nevery other GGUF type, default launch, 512x2048 S=3, worst |delta|/sum|xw| vs float64:")
        for name in (n for n in GGUF_TYPES if n not in args.types):
            err = check_small(name)
            rows.append({"kernel": f"{name} check", "check_S3": err})
            print(f"  {name:8s} {err:.2g}", flush=True)
        write_json(args.json, rows)
    print(f"\n{O}x{I}, S=1 bf16 x; paired A/B vs mx.quantized_matmul (pairs over {OUTLIER}x the best dropped); "
          "check = worst |delta|/sum|xw| of each launch vs float64 (bf16 output: <= ~4e-3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

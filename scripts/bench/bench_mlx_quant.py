#!/usr/bin/env python3
"""Time our GEMV on MLX-format weights (qgemv's MLX decode variants) against mx.quantized_matmul
on the same arrays: affine 4-bit g64, affine 3-bit g64, mxfp4 (and with --all every format), and
our container fmt 4 g64 on the same shape in the same run.

    PYTHONPATH=$PWD python3 scripts/bench/bench_mlx_quant.py [--json out.json] [--tiny] [--all] [--variants]

Method: S = 1, bf16 x, W ``[O, I]`` (default 18432 x 7168) from ``mx.quantize`` of random bf16
weights. Each timed evaluation runs GEMVS_PER_EVAL independent GEMVs cycling through enough
weight copies to exceed the 60 MB L2 several times (weights come from HBM); the graph is built
before the clock starts and stops after ``mx.synchronize()``; median of REPS evaluations divided
by GEMVS_PER_EVAL. Bytes = packed weights + scales + biases + x; GB/s = bytes / time. "submit" is
the CPU time until ``mx.async_eval`` returns (MLX has encoded every launch): close to the total,
the figure is MLX's per-launch cost, not the kernel.

The fmt 4 g64 rows (random bytes and scales, the layout bench_qgemv.py times) take the same two
routes as the MLX formats' kernel rows: ``kernels.qmatmul`` (the model's route) and
``qgemv.qgemv`` with the default launch (the kernel alone), so a gap between an MLX format and
fmt 4 is a kernel gap, not a harness one.

``--variants`` (GPU only) also times each MLX format through ``qgemv.qgemv`` with every launch of
VARIANTS (rows per block, persistent grid, register prefetch, 4-bit nibble decode), each first
checked against float64 like the default.

"ours" is ``kernels.qmatmul`` (the qgemv kernel on a GPU: its dispatch counter is checked, so a
declined call cannot pass for a kernel); on the CPU backend it is the pure-MLX reference
(dequantize + matmul, uncached), so CPU figures are ratios of two CPU paths only. Every case first
measures both against float64 (the exact decode times x): max |delta| / max |y| is printed (MLX's
CPU quantized_matmul accumulates bf16 inputs in bf16: a few percent on the CPU).
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

from colibri_mlx import kernels  # noqa: E402
from colibri_mlx.formats import QTensor, qtensor_from_mlx, scale_nbytes, weight_nbytes  # noqa: E402
from colibri_mlx.formats.mlx_quant import decode_mlx  # noqa: E402
from colibri_mlx.kernels import dispatch, qgemv, reference  # noqa: E402

L2_BYTES = 60e6
REPS = 15
GEMVS_PER_EVAL = 64
CASES = [("affine", 4, 64), ("affine", 3, 64), ("mxfp4", 4, 32)]
ALL_CASES = CASES + [("affine", 2, 64), ("affine", 5, 64), ("affine", 6, 64), ("affine", 8, 64),
                     ("affine", 4, 32), ("affine", 4, 128), ("nvfp4", 4, 16), ("mxfp8", 8, 32)]
# Launch candidates around the default ({}: qgemv.launch_spec's choice; on CUDA the MLX formats of
# at most 4 bits take fmt 4's settings: register prefetch, persistent grid of six-row blocks, shape
# compiled in). rows / persistent / prefetch / unroll / nib / simdgroups as qgemv.launch_spec.
VARIANTS = [
    ("default", {}),
    ("R4 persistent", {"rows": 4}),
    ("R6 one block a row block", {"rows": 6, "simdgroups": 1, "persistent": 0, "shape_in": False}),
    ("R4 one block a row block", {"rows": 4, "persistent": 0, "shape_in": False}),
    ("R4 no prefetch U2", {"rows": 4, "prefetch": 0, "unroll": 2}),
    ("R8 prefetch U1", {"rows": 8, "unroll": 1, "prefetch": 1}),
    ("default, nibbles by shifts", {"nib": 0}),
]


def make_weights(mode, bits, gs, O, I, n):
    """``n`` independent quantized copies (mx.quantize of random bf16 weights)."""
    out = []
    for k in range(n):
        w = (mx.random.normal((O, I), key=mx.random.key(k)) * 0.02).astype(mx.bfloat16)
        parts = mx.quantize(w, group_size=gs, bits=bits, mode=mode)
        q, s, b = parts[0], parts[1], (parts[2] if len(parts) > 2 else None)
        mx.eval(q, s, *(() if b is None else (b,)))
        out.append((q, s, b, qtensor_from_mlx(q, s, b, mode=mode, bits=bits, group_size=gs, name=f"bench{k}")))
    return out


def time_evals(make_outputs) -> tuple[float, float]:
    """(median seconds a GEMV, median CPU seconds a GEMV until mx.async_eval returns)."""
    mx.eval(make_outputs())
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
    return statistics.median(times) / GEMVS_PER_EVAL, statistics.median(submits) / GEMVS_PER_EVAL


def n_copies(nbytes: int, gpu: bool) -> int:
    """Weight copies that exceed the L2 several times (one on the CPU)."""
    return max(2, int(-(-6 * L2_BYTES // nbytes))) if gpu else 1


def check_kernel_ran(label: str, run) -> None:
    """``run()`` once with fresh counters: the qgemv kernel ran and nothing fell back."""
    dispatch.reset_counters()
    mx.eval(run())
    calls = dispatch.counters()
    if calls["fallbacks"] or f"qgemv/{dispatch.backend()}" not in calls["calls"]:
        raise SystemExit(f"{label}: the kernel did not run: {calls}")


def ours(x, qt, gpu: bool):
    return kernels.qmatmul(x, qt) if gpu else reference.qmatmul(x, qt)


def bench_case(mode, bits, gs, O, I, gpu: bool, variants_on: bool = False) -> dict:
    one = make_weights(mode, bits, gs, O, I, 1)[0]
    nbytes = sum(a.nbytes for a in one[:3] if a is not None)
    copies = make_weights(mode, bits, gs, O, I, n_copies(nbytes, gpu)) if gpu else [one]
    x = (mx.random.normal((1, I), key=mx.random.key(99))).astype(mx.bfloat16)
    mx.eval(x)

    def theirs(c):
        q, s, b, _ = c
        return mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs, bits=bits, mode=mode)

    # Both against float64 (the exact decode times x): max |delta| / max |y|.
    y64 = np.asarray(x.astype(mx.float32)).astype(np.float64) @ decode_mlx(one[3], exact=True).T
    err = {name: float(np.abs(np.asarray(y.astype(mx.float32)) - y64).max() / np.abs(y64).max())
           for name, y in (("ours", ours(x, one[3], gpu)), ("mlx", theirs(one)))}
    if gpu:
        check_kernel_ran(f"{mode} {bits}-bit g{gs}", lambda: ours(x, copies[0][3], gpu))
    n = len(copies)
    t_ours, sub_ours = time_evals(lambda: [ours(x, copies[k % n][3], gpu) for k in range(GEMVS_PER_EVAL)])
    t_mlx, sub_mlx = time_evals(lambda: [theirs(copies[k % n]) for k in range(GEMVS_PER_EVAL)])
    moved = nbytes + x.nbytes
    variants = []
    if variants_on and gpu:
        for label, tuning in VARIANTS:
            if "nib" in tuning and (mode, bits) != ("affine", 4):
                continue   # NIB picks the decode of affine 4-bit only
            def run(qt, tuning=tuning):
                return qgemv.qgemv(x, qt, dispatch.backend(), **tuning)

            y = np.asarray(run(one[3]).astype(mx.float32)).astype(np.float64)
            v_err = float(np.abs(y - y64).max() / np.abs(y64).max())
            t, sub = time_evals(lambda: [run(copies[k % n][3]) for k in range(GEMVS_PER_EVAL)])
            variants.append({"variant": label, "tuning": tuning, "us": t * 1e6, "submit_us": sub * 1e6,
                             "GBps": moved / t / 1e9, "rel_err": v_err})
    return {"mode": mode, "bits": bits, "group_size": gs, "O": O, "I": I, "bytes": moved,
            "ours_us": t_ours * 1e6, "mlx_us": t_mlx * 1e6, "ours_GBps": moved / t_ours / 1e9,
            "mlx_GBps": moved / t_mlx / 1e9, "speedup": t_mlx / t_ours, "ours_rel_err": err["ours"], "mlx_rel_err": err["mlx"],
            "ours_submit_us": sub_ours * 1e6, "mlx_submit_us": sub_mlx * 1e6,
            "ours_path": "qgemv kernel" if gpu else "reference (dequantize + matmul)", "variants": variants}


def random_fmt4(O, I, gs, n):
    """``n`` container fmt 4 QTensors of random bytes and scales (bench_qgemv.py's weights)."""
    out = []
    for k in range(n):
        packed = mx.random.randint(0, 256, (weight_nbytes(4, O, I, gs),), dtype=mx.int32,
                                   key=mx.random.key(1000 + k)).astype(mx.uint8)
        scales = mx.random.uniform(0.005, 0.02, (scale_nbytes(4, O, I, gs) // 4,), key=mx.random.key(2000 + k))
        out.append(QTensor(packed, scales, 4, O, I, gs, f"bench_fmt4_{k}"))
    mx.eval([(q.packed, q.scales) for q in out])
    return out


def bench_fmt4(O, I, gs, gpu: bool) -> dict:
    """Our container fmt 4 g``gs`` on the same shape: through kernels.qmatmul and qgemv.qgemv."""
    nbytes = weight_nbytes(4, O, I, gs) + scale_nbytes(4, O, I, gs)
    qts = random_fmt4(O, I, gs, n_copies(nbytes, gpu))
    x = (mx.random.normal((1, I), key=mx.random.key(99))).astype(mx.bfloat16)
    mx.eval(x)
    if gpu:
        check_kernel_ran(f"fmt 4 g{gs}", lambda: ours(x, qts[0], gpu))
    n = len(qts)
    t_route, sub_route = time_evals(lambda: [ours(x, qts[k % n], gpu) for k in range(GEMVS_PER_EVAL)])
    row = {"mode": "fmt4", "bits": 4, "group_size": gs, "O": O, "I": I, "bytes": nbytes + x.nbytes,
           "ours_us": t_route * 1e6, "ours_submit_us": sub_route * 1e6, "ours_GBps": (nbytes + x.nbytes) / t_route / 1e9,
           "ours_path": "qgemv kernel" if gpu else "reference (dequantize + matmul)"}
    if gpu:
        t, sub = time_evals(lambda: [qgemv.qgemv(x, qts[k % n], dispatch.backend()) for k in range(GEMVS_PER_EVAL)])
        row.update(direct_us=t * 1e6, direct_submit_us=sub * 1e6)
    return row


def main() -> int:
    global REPS, GEMVS_PER_EVAL
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--tiny", action="store_true", help="a small shape and few repetitions (CPU smoke run)")
    ap.add_argument("--all", action="store_true", help="every bits / group size / fp mode")
    ap.add_argument("--shape", default="18432x7168", help="O x I (default 18432x7168)")
    ap.add_argument("--variants", action="store_true", help="also time every launch of VARIANTS (GPU only)")
    args = ap.parse_args()
    gpu = dispatch.backend() != dispatch.REFERENCE
    O, I = (512, 1024) if args.tiny else map(int, args.shape.lower().split("x"))
    if args.tiny:
        REPS, GEMVS_PER_EVAL = 3, 4
    rows = []
    print(f"backend {dispatch.backend()}  W {O}x{I}  S=1 bf16 x  ({'GPU kernel' if gpu else 'CPU: ratios only'})")
    print(f"{'format':<16}{'ours us':>10}{'mlx us':>10}{'ours GB/s':>11}{'mlx GB/s':>10}{'speedup':>9}{'ours err':>10}{'mlx err':>10}")
    if args.variants and not gpu:
        print("--variants: GPU only (the CPU runs the reference), skipped")
    f4 = bench_fmt4(O, I, 64, gpu)
    rows.append(f4)
    direct = f"  qgemv.qgemv {f4['direct_us']:.1f} us (submit {f4['direct_submit_us']:.1f})" if gpu else ""
    print(f"{'fmt 4 g64':<16}{f4['ours_us']:>10.1f}{'':>10}{f4['ours_GBps']:>11.1f}   (our container format;"
          f" submit {f4['ours_submit_us']:.1f} us){direct}")
    for mode, bits, gs in (ALL_CASES if args.all else CASES):
        r = bench_case(mode, bits, gs, O, I, gpu, args.variants)
        rows.append(r)
        name = f"{mode} {bits}b g{gs}" if mode == "affine" else f"{mode} g{gs}"
        print(f"{name:<16}{r['ours_us']:>10.1f}{r['mlx_us']:>10.1f}{r['ours_GBps']:>11.1f}{r['mlx_GBps']:>10.1f}"
              f"{r['speedup']:>8.2f}x{r['ours_rel_err']:>10.1e}{r['mlx_rel_err']:>10.1e}"
              f"  (submit {r['ours_submit_us']:.1f} / {r['mlx_submit_us']:.1f} us)")
        for v in r["variants"]:
            print(f"    {v['variant']:<28}{v['us']:>8.1f} us {v['GBps']:>8.1f} GB/s  err {v['rel_err']:.1e}"
                  f"  submit {v['submit_us']:.1f} us  x{f4['direct_us'] / v['us']:.2f} of fmt 4")
    if args.json:
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(json.dumps({"backend": dispatch.backend(), "rows": rows}, indent=1))
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

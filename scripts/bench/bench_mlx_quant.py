#!/usr/bin/env python3
"""Time our GEMV on MLX-format weights (qgemv's MLX decode variants) against mx.quantized_matmul
on the same arrays: affine 4-bit g64, affine 3-bit g64, mxfp4 (and with --all every format).

    PYTHONPATH=$PWD python3 scripts/bench/bench_mlx_quant.py [--json out.json] [--tiny] [--all]

Method: S = 1, bf16 x, W ``[O, I]`` (default 18432 x 7168) from ``mx.quantize`` of random bf16
weights. Each timed evaluation runs GEMVS_PER_EVAL independent GEMVs cycling through enough
weight copies to exceed the 60 MB L2 several times (weights come from HBM); the graph is built
before the clock starts and stops after ``mx.synchronize()``; median of REPS evaluations divided
by GEMVS_PER_EVAL. Bytes = packed weights + scales + biases + x; GB/s = bytes / time.

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
from colibri_mlx.formats import qtensor_from_mlx  # noqa: E402
from colibri_mlx.formats.mlx_quant import decode_mlx  # noqa: E402
from colibri_mlx.kernels import dispatch, reference  # noqa: E402

L2_BYTES = 60e6
REPS = 15
GEMVS_PER_EVAL = 64
CASES = [("affine", 4, 64), ("affine", 3, 64), ("mxfp4", 4, 32)]
ALL_CASES = CASES + [("affine", 2, 64), ("affine", 5, 64), ("affine", 6, 64), ("affine", 8, 64),
                     ("affine", 4, 32), ("affine", 4, 128), ("nvfp4", 4, 16), ("mxfp8", 8, 32)]


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


def time_evals(make_outputs) -> float:
    mx.eval(make_outputs())
    mx.synchronize()
    times = []
    for _ in range(REPS):
        outs = make_outputs()
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / GEMVS_PER_EVAL


def ours(x, qt, gpu: bool):
    return kernels.qmatmul(x, qt) if gpu else reference.qmatmul(x, qt)


def bench_case(mode, bits, gs, O, I, gpu: bool) -> dict:
    one = make_weights(mode, bits, gs, O, I, 1)[0]
    nbytes = sum(a.nbytes for a in one[:3] if a is not None)
    copies = make_weights(mode, bits, gs, O, I, max(2, int(-(-6 * L2_BYTES // nbytes)))) if gpu else [one]
    x = (mx.random.normal((1, I), key=mx.random.key(99))).astype(mx.bfloat16)
    mx.eval(x)

    def theirs(c):
        q, s, b, _ = c
        return mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs, bits=bits, mode=mode)

    # Both against float64 (the exact decode times x): max |delta| / max |y|.
    y64 = np.asarray(x.astype(mx.float32)).astype(np.float64) @ decode_mlx(one[3], exact=True).T
    err = {name: float(np.abs(np.asarray(y.astype(mx.float32)) - y64).max() / np.abs(y64).max())
           for name, y in (("ours", ours(x, one[3], gpu)), ("mlx", theirs(one)))}
    dispatch.reset_counters()
    mx.eval(ours(x, copies[0][3], gpu))
    calls = dispatch.counters()
    if gpu and (calls["fallbacks"] or f"qgemv/{dispatch.backend()}" not in calls["calls"]):
        raise SystemExit(f"{mode} {bits}-bit g{gs}: the kernel did not run: {calls}")
    n = len(copies)
    t_ours = time_evals(lambda: [ours(x, copies[k % n][3], gpu) for k in range(GEMVS_PER_EVAL)])
    t_mlx = time_evals(lambda: [theirs(copies[k % n]) for k in range(GEMVS_PER_EVAL)])
    moved = nbytes + x.nbytes
    return {"mode": mode, "bits": bits, "group_size": gs, "O": O, "I": I, "bytes": moved,
            "ours_us": t_ours * 1e6, "mlx_us": t_mlx * 1e6, "ours_GBps": moved / t_ours / 1e9,
            "mlx_GBps": moved / t_mlx / 1e9, "speedup": t_mlx / t_ours, "ours_rel_err": err["ours"], "mlx_rel_err": err["mlx"],
            "ours_path": "qgemv kernel" if gpu else "reference (dequantize + matmul)"}


def main() -> int:
    global REPS, GEMVS_PER_EVAL
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--tiny", action="store_true", help="a small shape and few repetitions (CPU smoke run)")
    ap.add_argument("--all", action="store_true", help="every bits / group size / fp mode")
    ap.add_argument("--shape", default="18432x7168", help="O x I (default 18432x7168)")
    args = ap.parse_args()
    gpu = dispatch.backend() != dispatch.REFERENCE
    O, I = (512, 1024) if args.tiny else map(int, args.shape.lower().split("x"))
    if args.tiny:
        REPS, GEMVS_PER_EVAL = 3, 4
    rows = []
    print(f"backend {dispatch.backend()}  W {O}x{I}  S=1 bf16 x  ({'GPU kernel' if gpu else 'CPU: ratios only'})")
    print(f"{'format':<16}{'ours us':>10}{'mlx us':>10}{'ours GB/s':>11}{'mlx GB/s':>10}{'speedup':>9}{'ours err':>10}{'mlx err':>10}")
    for mode, bits, gs in (ALL_CASES if args.all else CASES):
        r = bench_case(mode, bits, gs, O, I, gpu)
        rows.append(r)
        name = f"{mode} {bits}b g{gs}" if mode == "affine" else f"{mode} g{gs}"
        print(f"{name:<16}{r['ours_us']:>10.1f}{r['mlx_us']:>10.1f}{r['ours_GBps']:>11.1f}{r['mlx_GBps']:>10.1f}"
              f"{r['speedup']:>8.2f}x{r['ours_rel_err']:>10.1e}{r['mlx_rel_err']:>10.1e}")
    if args.json:
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(json.dumps({"backend": dispatch.backend(), "rows": rows}, indent=1))
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Run every CUDA twin on the GPU against the pure-MLX reference and a float64 numpy oracle.

    PYTHONPATH=/root/site:$PWD python3 scripts/device/check_kernels_gpu.py [--quick] [--jobs 8]

Prints PASS/FAIL per kernel, fmt, shape, S and dtype, then a summary; exits 1 on any failure.
Outputs are NaN-poisoned (init_value) before every launch, so an unwritten element fails.
Tolerance |Δ| / Σ|x_i w_i| as in tests/kernel_oracle.py (float32 accumulation, plus the
rounding of a float16/bfloat16 output).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from colibri_mlx.kernels import dispatch, qgemv, reference  # noqa: E402
from kernel_oracle import REL_TOL, dequant_f64, random_qtensor, random_x  # noqa: E402

SMALL = [(5, 37), (3, 256), (6, 300), (2, 4100), (33, 1000)]
SMALL_CASES = [(1, mx.float32), (8, mx.bfloat16), (3, mx.float16), (2, mx.bfloat16), (5, mx.float32)]
LARGE = [(7168, 2048), (2048, 7168), (18432, 7168)]
GS = (16, 32, 48, 64, 96, 128, 192, 256)


def run_kernel(x, qt, **kw):
    spec = qgemv.launch_spec(x, qt, dispatch.CUDA, **kw)
    spec.init_value = float("nan")
    return dispatch.launch(dispatch.CUDA, spec)[0]


def check_epilogue(fmt, O, I, S, dtype, gs=None, seed=0, **launch):
    """RES 1 (residual add in the write) is bit for bit ``res + y``; OT float32 is the unrounded
    sum, whose rounding to x's dtype is the plain launch's output."""
    label = f"qgemv RES / OT fmt {fmt} {O}x{I} S={S} {str(dtype).split('.')[-1]}" + _knobs(launch)
    qt = random_qtensor(fmt, O, I, gs=gs, seed=seed).to_mlx()
    x = random_x(S, I, dtype=dtype, seed=seed + 1)
    res = (random_x(S, O, seed=seed + 2) * 10).astype(dtype)
    y = run_kernel(x, qt, **launch)
    y_res = run_kernel(x, qt, residual=res, **launch)
    y32 = run_kernel(x, qt, out_dtype=mx.float32, **launch)
    mx.eval(y, y_res, y32)
    f32 = lambda a: np.asarray(a.astype(mx.float32))  # noqa: E731
    ok_res = np.array_equal(f32(y_res), f32(res + y))
    ok_ot = y32.dtype == mx.float32 and np.array_equal(f32(y), f32(y32.astype(dtype)))
    ok = ok_res and ok_ot
    print(f"{'PASS' if ok else 'FAIL'} {label}: RES == res + y {ok_res}, OT rounds to y {ok_ot}", flush=True)
    return ok


def _knobs(launch: dict) -> str:
    return "".join(f" {k}={v}" for k, v in launch.items())


def check(fmt, O, I, S, dtype, gs=None, seed=0, oracle_f64=True, epilogue=False, **launch):
    """``launch``: qgemv.launch_spec's tuning arguments (e.g. persistent=7: 7 blocks looping
    over every row block)."""
    if epilogue:
        return check_epilogue(fmt, O, I, S, dtype, gs, seed, **launch)
    label = f"qgemv fmt {fmt} {O}x{I} S={S} {str(dtype).split('.')[-1]}" + (f" gs={gs}" if gs else "") + _knobs(launch)
    qt = random_qtensor(fmt, O, I, gs=gs, seed=seed).to_mlx()
    x = random_x(S, I, dtype=dtype, seed=seed + 1)
    y = run_kernel(x, qt, **launch)
    y_ref = reference.qmatmul(x, qt)
    mx.eval(y, y_ref)
    x64 = np.asarray(x.astype(mx.float32)).astype(np.float64)
    # Small shapes: an independent float64 decoder. Large: the reference's float32 weights
    # (each exact to 2^-24) in float64 - the independent decoder would take minutes there.
    w64 = dequant_f64(qt) if oracle_f64 else np.asarray(reference.dequantize(qt)).astype(np.float64)
    y64 = x64 @ w64.T
    mag = np.abs(x64) @ np.abs(w64).T + 1e-30
    got = np.asarray(y.astype(mx.float32)).astype(np.float64)
    ref = np.asarray(y_ref.astype(mx.float32)).astype(np.float64)
    finite = bool(np.isfinite(got).all())
    rel = float((np.abs(got - y64) / mag).max()) if finite else float("inf")
    rel_ref = float((np.abs(got - ref) / mag).max()) if finite else float("inf")
    tol = REL_TOL[dtype]
    ok = finite and rel <= tol and rel_ref <= 2 * tol
    print(f"{'PASS' if ok else 'FAIL'} {label}: |Δ|/Σ|xw| vs f64 {rel:.2e}, vs reference {rel_ref:.2e} (tol {tol:.1e})"
          + ("" if finite else " NON-FINITE (unwritten output?)"), flush=True)
    return ok


def cases(quick: bool) -> list[dict]:
    """Every check, as keyword arguments of :func:`check`."""
    out = []
    for fmt in (1, 2, 3, 4, 5, 6):
        # One S and dtype per shape: every kernel specialization is a JIT compile on the GPU
        # machine, so the sample covers S = 1..8 and the three dtypes without the full product.
        for i, (O, I) in enumerate(SMALL):
            S, dtype = SMALL_CASES[i]
            out.append(dict(fmt=fmt, O=O, I=I, S=S, dtype=dtype, gs=64 if fmt == 4 else None, seed=fmt * 100 + i))
    for gs in GS:
        for I in (520, 2 * gs + 1, 7168):
            out.append(dict(fmt=4, O=9, I=I, S=3, dtype=mx.bfloat16, gs=gs, seed=gs + I))
    for fmt, S, dtype in ((2, 1, mx.bfloat16), (4, 1, mx.bfloat16), (6, 1, mx.bfloat16), (4, 3, mx.float16)):
        out.append(dict(fmt=fmt, O=300, I=2048, S=S, dtype=dtype, gs=64 if fmt == 4 else None, seed=7 + fmt,
                        epilogue=True))
    # Persistent grids (PERS 1): a few blocks each looping over many row blocks, the last one
    # partial: one SIMD group with PF 1 (CUDA's default launch there), PF 0, and NW 2 with its
    # barrier between row blocks; 6 rows a block with the shape compiled in (CUDA's default past
    # one wave), and the shape compiled into a one-block-a-row-block launch.
    for fmt, O, I, S, dtype, knobs in ((4, 301, 2048, 1, mx.bfloat16, dict(simdgroups=1, persistent=7)),
                                       (2, 33, 1000, 1, mx.float32, dict(simdgroups=1, persistent=5)),
                                       (4, 301, 2048, 3, mx.float16, dict(persistent=7)),
                                       (6, 37, 512, 1, mx.bfloat16, dict(persistent=4)),
                                       (4, 301, 2048, 1, mx.bfloat16, dict(simdgroups=1, rows=6, persistent=9, shape_in=True)),
                                       (2, 301, 2048, 1, mx.bfloat16, dict(shape_in=True))):
        out.append(dict(fmt=fmt, O=O, I=I, S=S, dtype=dtype, gs=64 if fmt == 4 else None, seed=O + S, **knobs))
    out.append(dict(fmt=4, O=300, I=2048, S=1, dtype=mx.bfloat16, gs=64, seed=11, epilogue=True, simdgroups=1,
                    persistent=7))
    if not quick:
        for fmt in (1, 2, 3, 4, 5, 6):
            for O, I in LARGE:
                for S in ((1, 8) if fmt in (4, 6) else (1,)):
                    out.append(dict(fmt=fmt, O=O, I=I, S=S, dtype=mx.bfloat16, gs=64 if fmt == 4 else None,
                                    seed=fmt + O, oracle_f64=False))
    return out


def run_shards(argv: list[str], jobs: int) -> int:
    """Run ``jobs`` copies of this script on disjoint shards of the cases at once: each
    specialization is a single-threaded NVRTC compile, so the JIT, not the GPU, sets the time."""
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--shard", f"{k}/{jobs}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k in range(jobs)]
    n_pass = n_fail = 0
    worst = 0
    for proc in procs:
        out, _ = proc.communicate()
        lines = out.splitlines()
        print("\n".join(line for line in lines if not line.startswith("check_kernels_gpu:")), flush=True)
        n_pass += sum(line.startswith("PASS") for line in lines)
        n_fail += sum(line.startswith("FAIL") for line in lines)
        if proc.returncode not in (0, 1):   # a shard that crashed: its cases did not all run
            print(f"check_kernels_gpu: shard exited with {proc.returncode}:\n" + "\n".join(lines[-5:]))
            worst = 1
    print(f"check_kernels_gpu: {n_pass}/{n_pass + n_fail} PASS, {n_fail} FAIL ({jobs} shards)")
    return 1 if n_fail or worst else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the large shapes")
    ap.add_argument("--jobs", type=int, default=1, help="processes checking disjoint shards at once")
    ap.add_argument("--shard", default="0/1", help="k/n: run every n-th case from the k-th (used by --jobs)")
    args = ap.parse_args()
    if dispatch.gpu_backend() != dispatch.CUDA:
        print("check_kernels_gpu: MLX has no CUDA backend here (mx.cuda.is_available() is False)")
        return 2
    if args.jobs > 1:
        return run_shards(["--quick"] if args.quick else [], args.jobs)
    k, n = (int(v) for v in args.shard.split("/"))
    t0 = time.time()
    results = [check(**case) for case in cases(args.quick)[k::n]]
    n_fail = results.count(False)
    print(f"check_kernels_gpu: {len(results) - n_fail}/{len(results)} PASS, {n_fail} FAIL "
          f"({time.time() - t0:.0f} s)")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())

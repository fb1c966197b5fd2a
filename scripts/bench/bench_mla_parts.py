#!/usr/bin/env python3
"""Where mla_decode's time goes: each of its three launches timed alone, per attention variant,
heads per threadgroup and tile, at DeepSeek-V3 shapes (128 heads, latent 512, rope 64, kv_b fmt 4
g64, bf16 queries and cache on GPUs).

    PYTHONPATH=/root/site:/tmp/site:$PWD python3 scripts/bench/bench_mla_parts.py [--cache 4096 32768]

Method: a chain of 8 independent instances (each its own cache, so nothing is an L2
hit across instances) in one evaluation, median of --iters after a warm-up, time / 8. Launch
inputs are evaluated beforehand, so a launch timed alone is that kernel plus its launch cost.
The floor column is the bytes the launch must read / 4.3 TB/s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from colibri_mlx import kernels  # noqa: E402
from colibri_mlx.formats.qtensor import QTensor  # noqa: E402
from colibri_mlx.kernels import dispatch, mla  # noqa: E402
from bench_timing import median_times  # noqa: E402

H, NOPE, ROPE, V, R = 128, 128, 64, 128, 512
COPY_BW = 4.3e12
CHAIN = 8


def timeit(fn, iters):
    """Seconds per instance of the chain."""
    return median_times(fn, iters)[0] / CHAIN


def instance(T, act):
    kv_b = QTensor(mx.random.randint(0, 256, (H * (NOPE + V) * R // 2,)).astype(mx.uint8),
                   mx.random.uniform(0.002, 0.02, (H * (NOPE + V) * R // 64,)), 4, H * (NOPE + V), R, 64, "kv_b")
    q_nope = mx.random.normal((1, H, 1, NOPE)).astype(act)
    q_rope = mx.random.normal((1, H, 1, ROPE)).astype(act)
    latent = mx.random.normal((1, T, R)).astype(act)
    k_rope = mx.random.normal((1, T, ROPE)).astype(act)
    mx.eval(kv_b.packed, kv_b.scales, q_nope, q_rope, latent, k_rope)
    return q_nope, q_rope, latent, k_rope, kv_b


def specs_of(inst, impl, **kw):
    q_nope, q_rope, latent, k_rope, kv_b = inst
    run = mla.launch_specs(q_nope, q_rope, latent, k_rope, kv_b, NOPE ** -0.5, None, NOPE, V,
                           backend=impl, **kw)
    captured = []

    def capture(spec):
        captured.append(spec)
        return dispatch.launch(impl, spec)

    mx.eval(run(capture))
    return run, captured


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--configs", nargs="+", default=["simt", "mma:16", "mma:32", "mma:16:128", "mma:16:256",
                                                     "mma:16:1024", "mma:32:256"],
                    help="variant[:heads[:tile]]")
    args = ap.parse_args()
    impl = kernels.backend()
    act = mx.bfloat16 if impl != dispatch.REFERENCE else mx.float32
    if impl == dispatch.REFERENCE:
        print("no GPU backend: the launches run through the reference path only; nothing to time")
        return
    print(f"backend {impl}, {mx.default_device()}, activations {act}")
    print(f"{'cache':>6} {'config':<12} {'tiles':>5} {'qabs':>8} {'attn':>8} {'out':>8} {'sum':>8} "
          f"{'whole':>8} {'attn floor':>10}")
    for T in args.cache:
        insts = [instance(T, act) for _ in range(CHAIN)]
        cache_bytes = T * (R + ROPE) * act.size
        for cfg in args.configs:
            parts = cfg.split(":")
            kw = dict(variant=parts[0])
            if len(parts) > 1:
                kw["heads"] = int(parts[1])
            if len(parts) > 2:
                kw["tile"] = int(parts[2])
            try:
                runs = [specs_of(i, impl, **kw) for i in insts]
            except Exception as e:  # a configuration that does not build (e.g. too many registers)
                print(f"{T:>6} {cfg:<12} failed: {type(e).__name__}: {e}")
                continue
            per_launch = []
            for k in range(3):
                specs = [c[k] for _, c in runs]
                per_launch.append(timeit(lambda: [dispatch.launch(impl, s)[0] for s in specs], args.iters))
            whole = timeit(lambda: [r(lambda s: dispatch.launch(impl, s)) for r, _ in runs], args.iters)
            nt = runs[0][1][1].output_shapes[0][2]
            us = [t * 1e6 for t in per_launch]
            print(f"{T:>6} {cfg:<12} {nt:>5} {us[0]:>8.1f} {us[1]:>8.1f} {us[2]:>8.1f} {sum(us):>8.1f} "
                  f"{whole * 1e6:>8.1f} {cache_bytes / COPY_BW * 1e6:>10.1f}", flush=True)
        del insts


if __name__ == "__main__":
    main()

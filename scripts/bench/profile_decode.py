#!/usr/bin/env python3
"""Where the host time of one decode step goes (the bench_e2e model, ours only).

    python3 scripts/bench/profile_decode.py [--layers 4] [--experts 256] [--steps 16] [--tiny]

Per step, median over ``--steps`` synchronized steps: the Python graph building (``model(...)``
returning), the evaluation (``mx.eval`` + synchronize: MLX's per-primitive host work and the GPU
running it), the primitives in the step's graph, and a chained figure: ``--chain`` steps built
back to back (the same token, the cache advancing) and evaluated once, whose per-step time is
bounded below by the larger of the host work and the GPU work. Then cProfile's top functions of
the build. Each for compiled blocks on and off (kernels.compiled).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e as E  # noqa: E402
import bench_moe_mla as B  # noqa: E402
from colibri_mlx import kernels  # noqa: E402


def primitives(out) -> tuple[int, int]:
    """(all primitives, those that are not views) in the graph of ``out``."""
    import re
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, out)
        names = re.findall(r'label ="([^"]+)", shape=rectangle', f.read())
    views = [n for n in names if n.split("(")[0].strip() in B.VIEW_PRIMITIVES]
    return len(names), len(names) - len(views)


def profile(model, steps, chain, label):
    cache = model.make_cache()
    prompt = mx.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])
    mx.eval(model(prompt, cache))
    token = mx.array([[7]])
    for _ in range(4):                                    # warm-up, traces
        mx.eval(model(token, cache))
    builds, evals = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(token, cache)
        t1 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        builds.append(t1 - t0)
        evals.append(time.perf_counter() - t1)
    n_all, n_launch = primitives(model(token, cache))
    mx.synchronize()
    t0 = time.perf_counter()
    outs = [model(token, cache) for _ in range(chain)]
    t_build = time.perf_counter() - t0
    mx.eval(outs)
    mx.synchronize()
    t_chain = time.perf_counter() - t0
    med = statistics.median
    print(f"{label:22s} build {med(builds) * 1e3:6.3f} ms  eval {med(evals) * 1e3:6.3f} ms  "
          f"primitives {n_all} ({n_launch} not views)  chained x{chain}: {t_chain / chain * 1e3:6.3f} ms/step "
          f"(build {t_build / chain * 1e3:6.3f})", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        model(token, cache)
    prof.disable()
    mx.eval(model(token, cache))
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    print("\n".join(s.getvalue().splitlines()[4:24]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    E.add_model_args(ap)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--chain", type=int, default=8)
    args = ap.parse_args()
    model = E.our_model(E.model_config(args))
    print(f"backend {kernels.backend()}; tiny op cost is in bench_moe_mla.py --only launch", flush=True)
    profile(model, args.steps, args.chain, "compiled blocks")
    with E.plain_graphs():
        profile(model, args.steps, args.chain, "COLIBRI_COMPILE=0")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Where the per-call host time of a compiled chain goes on a GPU host (the ``build`` column of
bench_moe_mla.py: 16 µs a layer of the routed-experts chain on the H200, 128 µs a call for 16
launches, where a compiled call of a similar graph of plain ops takes ~15 µs on a CPU host).

    PYTHONPATH=/root/site:/tmp/site:$PWD python3 scripts/probe_build.py [--experts 16] [--calls 200]
    python3 scripts/probe_build.py --inputs     # any machine: a compiled call's cost by input count

Times, each the median of --calls calls (the outputs evaluated and synchronized outside the timed
part): the routed chain through CompiledBlock, the same trace called directly (mx.compile's
function: no CompiledBlock Python), a compiled graph of 16 plain ops over the same 24 inputs, and
the backend queries CompiledBlock makes per call; then cProfile of the CompiledBlock calls. No
kernel is timed: this is host time only.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_moe_mla as B  # noqa: E402
from bench_timing import median_times  # noqa: E402
from colibri_mlx import kernels  # noqa: E402
from colibri_mlx.kernels import compiled, dispatch  # noqa: E402


def call_time(fn, calls: int) -> float:
    """Median µs of fn() alone; its outputs are evaluated after each timed call."""
    return median_times(fn, calls)[1] * 1e6


def plain_chain(*arrays):
    n = len(arrays) // 3
    return tuple((x.astype(mx.float32) * w.sum()) + i.sum() for x, i, w in
                 zip(arrays[:n], arrays[n:2 * n], arrays[2 * n:]))


def inputs_cost(calls: int) -> None:
    """A compiled call's cost by its number of inputs, the graph fixed (one op on the first and
    the last input): what passing a decode step's per-layer arrays costs (any backend)."""
    for n in (2, 8, 32, 64, 128):
        args = [mx.ones((4,)) for _ in range(n)]
        mx.eval(args)
        fn = mx.compile(lambda *a: a[0] * 2 + a[-1])
        print(f"{call_time(lambda: fn(*args), calls):9.1f} us  compiled call of {n} inputs")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke run of the script")
    ap.add_argument("--inputs", action="store_true", help="only the compiled call's cost by its number of inputs")
    args = ap.parse_args()
    if args.inputs:
        inputs_cost(args.calls)
        return
    if args.tiny:
        B.shrink()
    from colibri_mlx.models.deepseek_v3 import MoE, ModelArgs

    E, n = args.experts, B.CHAIN
    margs = ModelArgs.from_config(B.config(experts=E))
    ours = [MoE(margs, B.table(B.moe_weights("mlp.", E)), "mlp.") for _ in range(n)]
    rng = np.random.default_rng(0)
    ids = [mx.array(rng.choice(E, (1, 8), replace=False).astype(np.int32)) for _ in range(n)]
    gw = [mx.array(rng.uniform(0.1, 1, (1, 8)).astype(np.float32)) for _ in range(n)]
    xs = [mx.random.normal((1, B.D)).astype(B.ACT) for _ in range(n)]
    for m in ours:
        kernels.moe_block(xs[0], m.bank, ids[0], gw[0])
    arrays = [*xs, *ids, *gw]
    mx.eval(arrays)
    static = kernels.moe.host_reason(xs[0], ours[0].bank, 8)
    print(f"backend {kernels.backend()}, static {static!r}")

    chain = compiled.CompiledBlock(functools.partial(B._routed_chain, [m.bank for m in ours]), "probe_routed_chain")
    results = {"CompiledBlock call (routed chain, 16 launches)": call_time(lambda: chain(*arrays, static=static),
                                                                         args.calls)}
    raw = next((f for f in chain._modes.values() if f is not None), None)
    if raw is not None:    # None where the chain cannot be compiled (the CPU reference reads ids)
        results["the same trace called directly"] = call_time(lambda: raw(*arrays), args.calls)
    plain = mx.compile(plain_chain)
    results["compiled 8 x (astype, sum, mul, sum, add) over the same inputs"] = call_time(lambda: plain(*arrays),
                                                                                        args.calls)
    results["dispatch.backend()"] = call_time(dispatch.backend, args.calls)
    results["mx.metal.is_available()"] = call_time(mx.metal.is_available, args.calls)
    cuda = getattr(mx, "cuda", None)
    if cuda is not None:
        results["mx.cuda.is_available()"] = call_time(cuda.is_available, args.calls)
    rows = [x[None] for x in xs]
    mx.eval(rows)
    moe_chain = compiled.CompiledBlock(functools.partial(B._moe_chain, ours), "probe_moe_chain")
    block_static = ours[0].host_reason(rows[0])
    results["CompiledBlock call (MoE block chain)"] = call_time(lambda: moe_chain(*rows, static=block_static),
                                                                args.calls)
    for k, v in results.items():
        print(f"{v:9.1f} us  {k}")

    prof = cProfile.Profile()
    for _ in range(args.calls):
        prof.enable()
        out = chain(*arrays, static=static)
        prof.disable()
        mx.eval(out)
        mx.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()

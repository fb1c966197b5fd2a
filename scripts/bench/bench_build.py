#!/usr/bin/env python3
"""Python graph-building cost of one decode step on the GPU path, measured on any machine.

    python3 scripts/bench/bench_build.py [--steps 300] [--tiny] [--layers 4 --experts 16 --vocab 4096]

End-to-end decode on the H200 is host-bound (bench_e2e.py: the pipelined loop, which overlaps
building step n+1 with the GPU running step n, is barely faster than the synchronized one), so
the Python that builds each step's graph is paid per token. This script builds decode steps of
the bench_e2e model shape (4 layers: 1 dense + 3 MoE, DeepSeek-V3 widths; 16 experts and a 4096
vocabulary to fit any machine: the build cost does not depend on either) with the GPU path
selected and every custom-kernel launch stubbed (a preallocated output of the right shape), and
prints the median build time per step and per block kind. MLX's own op construction is included;
the custom-kernel calls themselves (MLX builds and hashes the kernel source) are not, and
``mx.fast`` ops on the CPU build their fallback graphs, so figures are for comparing versions
of our code on one machine, not absolute GPU-host costs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e as E  # noqa: E402
from colibri_mlx.kernels import dispatch  # noqa: E402


def stub_launch(keep_inputs: bool = False):
    """A ``dispatch.launch`` stand-in: each launch returns cached outputs of its shapes (no kernel
    runs). ``keep_inputs``: the outputs come through one ``mx.depends`` node on the launch's
    inputs, so a graph keeps a node a launch and everything upstream (to count nodes)."""
    outputs = {}

    def launch(backend, spec):
        result = []
        for shape, dtype in zip(spec.output_shapes, spec.output_dtypes):
            key = (tuple(shape), dtype)
            if key not in outputs:
                outputs[key] = mx.zeros(shape, dtype)
                mx.eval(outputs[key])
            result.append(outputs[key])
        if keep_inputs:
            return mx.depends(result, [a for a in spec.inputs if isinstance(a, mx.array)])
        return result

    return launch


def stub_launches():
    """Route every custom-kernel launch to a cached output of its shape, and report a GPU backend.
    The outputs depend on the launch's inputs (keep_inputs): a compiled layer step returns them,
    and mx.compile refuses outputs that are not computed from its inputs."""
    dispatch.launch = stub_launch(keep_inputs=True)
    dispatch.backend = lambda: dispatch.CUDA
    dispatch.gpu_backend = lambda: dispatch.CUDA


class Timed:
    """Wraps a block's ``__call__`` and adds its wall time to ``totals[name]``."""

    def __init__(self, block, name, totals):
        self.block, self.name, self.totals = block, name, totals

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.block(*args, **kwargs)
        self.totals[self.name] = self.totals.get(self.name, 0.0) + time.perf_counter() - t0
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    E.add_model_args(ap)
    ap.set_defaults(experts=16, vocab=4096)
    args = ap.parse_args()
    stub_launches()
    cfg = E.model_config(args)
    model = E.our_model(cfg)
    cache = model.make_cache()
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache))
    token = mx.array([[5]])

    def step():
        out = model(token, cache)
        cache.offset -= 1          # every step at the same position: the same shapes
        return out

    for _ in range(20):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(f"decode step build (launches stubbed): {statistics.median(times) * 1e6:.1f} us median of {args.steps}")
    totals = {}
    for layer in model.layers:       # the pieces of DecoderLayer.decode (the ones it ran are printed)
        layer._compiled_in = Timed(layer._compiled_in, "layer in (norm, projections, rope)", totals)
        layer.self_attn.cached = Timed(layer.self_attn.cached, "cache writes", totals)
        layer.self_attn.attend = Timed(layer.self_attn.attend, "attention core (mla_decode)", totals)
        layer._compiled_out = Timed(layer._compiled_out, "layer out (o_proj, MLP / MoE)", totals)
        layer._compiled_step = Timed(layer._compiled_step, "whole layer (one compiled graph)", totals)
    for _ in range(args.steps):
        step()
    layers = cfg["num_hidden_layers"]
    for name, total in totals.items():
        print(f"  {name:36s} {total / args.steps / layers * 1e6:7.1f} us per layer (mean)")


if __name__ == "__main__":
    main()

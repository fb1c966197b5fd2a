"""The timing loop the per-layer benchmarks share (method: ../shared/docs/PERF.md)."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx


def median_times(fn, iters: int, warmup: int = 3) -> tuple[float, float]:
    """``(seconds per evaluation, seconds spent in fn)``, medians over ``iters`` after ``warmup``.

    ``fn`` builds the graph and returns what to evaluate; its own time is Python graph building,
    during which the GPU waits, so it is part of the first figure and reported on its own."""
    for _ in range(warmup):
        mx.eval(fn())
    mx.synchronize()
    totals, builds = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = fn()
        builds.append(time.perf_counter() - t0)
        mx.eval(out)
        mx.synchronize()
        totals.append(time.perf_counter() - t0)
    return statistics.median(totals), statistics.median(builds)

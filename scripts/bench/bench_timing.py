"""The timing loop the per-layer benchmarks share."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

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


STEP, BUILD = "timed_evaluation", "graph_building"


def union_us(intervals) -> float:
    """Length of the union of ``[(start, end)]`` intervals."""
    total, end = 0.0, -1e30
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def analyze(ranges, kerns, builds=()):
    """``(rows, {kernel: (us a range, launches a range)}, the last range's sequence)`` from ranges
    ``[(start, end)]`` and kernel records ``[(start, end, name)]`` (us, one clock); a kernel
    belongs to the range in which it starts. ``builds``: the graph-building sub-ranges, one a
    range (optional)."""
    ranges = sorted(ranges)
    rows, by_name, count, sequence = [], defaultdict(float), defaultdict(float), []
    for s, e in ranges:
        mine = sorted((a, b, n) for a, b, n in kerns if s <= a < e)
        if not mine:
            continue
        first, last = min(a for a, _, _ in mine), max(b for _, b, _ in mine)
        busy = union_us([(a, b) for a, b, _ in mine])
        row = {"wall": e - s, "lead": first - s, "busy": busy, "gaps": (last - first) - busy,
               "tail": max(0.0, e - last), "kernels": len(mine)}
        built = [b1 - b0 for b0, b1 in builds if s <= b0 < e]
        if built:
            row["build"] = built[0]
        rows.append(row)
        for a, b, n in mine:
            by_name[n] += (b - a) / len(ranges)
            count[n] += 1 / len(ranges)
        sequence = [(a - first, b - a, n) for a, b, n in mine]     # the last range's, in start order
    return rows, {n: (us, count[n]) for n, us in by_name.items()}, sequence


def timeline(fn, iters: int, warmup: int = 3):
    """Where a timed evaluation's wall time goes on a CUDA GPU (PyTorch's profiler reads CUPTI:
    MLX's kernels, ours and its own, on the host's clock). Per evaluation, medians over ``iters``:
    wall; build (``fn``: Python and compiled calls building the graph); lead (from the start to
    the first kernel: building plus what MLX encodes before its first commit); busy (the union
    of kernel intervals); gaps (the rest of the first-to-last-kernel span); tail (after the last
    kernel: synchronize); kernels (launches). Returns ``(medians, by_name, sequence)`` as
    ``analyze``, or ``None`` where no kernel was recorded (no CUPTI)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(warmup):
        mx.eval(fn())
    mx.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            with record_function(STEP):
                with record_function(BUILD):
                    out = fn()
                mx.eval(out)
                mx.synchronize()
    ranges, builds, kerns = [], [], []
    for ev in prof.events():
        t0, t1 = ev.time_range.start, ev.time_range.end
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.name in (STEP, BUILD):
            (ranges if ev.name == STEP else builds).append((t0, t1))
        elif ev.device_type == torch.autograd.DeviceType.CUDA and t1 > t0 and ev.name not in (STEP, BUILD):
            kerns.append((t0, t1, ev.name))
    rows, by_name, sequence = analyze(ranges, kerns, builds)
    if not rows:
        return None
    return {k: statistics.median(r.get(k, float("nan")) for r in rows) for k in rows[0]}, by_name, sequence

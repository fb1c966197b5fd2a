#!/usr/bin/env python3
"""Where a synchronized decode step's time goes on the GPU: the bench_e2e model, ours and mlx-lm.

    PYTHONPATH=/root/site:/tmp/site:$PWD python3 scripts/bench/profile_step.py [--steps 8]

Each step (built, evaluated, synchronized, as bench_e2e.py times it) runs inside a
``torch.profiler.record_function`` range; CUPTI records every kernel MLX launches (ours and
MLX's own), on the same clock. Per step, medians over --steps:

* wall: the step's range on the host;
* host lead: from the step's start to its first kernel's start (Python building the graph and
  MLX encoding what it submits first; with CUDA graphs the GPU starts only at a commit);
* GPU busy: the union of the step's kernel intervals; gaps: the rest of the span from the first
  kernel's start to the last one's end (launch latency between dependent nodes, host work the
  GPU waits for);
* tail: from the last kernel's end to the step's end (synchronize, reading the token);
* kernels: launches a step, and the kernel names that take the most GPU time.

Needs a CUDA device and PyTorch (its profiler reads CUPTI; MLX's kernels appear under their
CUDA names, ``custom_kernel_*`` for ours).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e as E  # noqa: E402
from bench_timing import analyze  # noqa: E402
from colibri_mlx import kernels  # noqa: E402

STEP = "decode_step"


def run_steps(step, prompt, steps):
    import torch

    tok = mx.argmax(step(prompt)[:, -1], axis=-1)
    mx.eval(tok)
    for _ in range(3):                       # warm: traces, JIT, allocator
        tok = mx.argmax(step(tok[:, None])[:, -1], axis=-1)
        mx.eval(tok)
    mx.synchronize()
    for _ in range(steps):
        with torch.profiler.record_function(STEP):
            tok = mx.argmax(step(tok[:, None])[:, -1], axis=-1)
            mx.eval(tok)
            mx.synchronize()


def step_profile(step, prompt, steps):
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_steps(step, prompt, steps)
    ranges, kerns = [], []
    for ev in prof.events():
        t0, t1 = ev.time_range.start, ev.time_range.end
        if ev.name == STEP and ev.device_type == torch.autograd.DeviceType.CPU:
            ranges.append((t0, t1))
        elif ev.device_type == torch.autograd.DeviceType.CUDA and t1 > t0 and ev.name != STEP:
            kerns.append((t0, t1, ev.name))
    return analyze(ranges, kerns)


def short(name: str) -> str:
    return name.replace("mlx::core::cu::", "")[:70]


def print_sequence(label, sequence):
    """One step's kernels in start order: which MLX ops sit between ours (what to fold next)."""
    print(f"\n{label}: the last step's kernels (start us after the first kernel, duration us)")
    for start, dur, name in sequence:
        print(f"  {start:8.1f} {dur:7.1f}  {short(name)}")


def report(label, rows, by_name, top):
    if not rows:
        print(f"{label:<22} no kernel records in the step ranges (CUPTI not available?)")
        return {}, []
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"{label:<22} {med['wall']:8.0f} {med['lead']:9.0f} {med['busy']:8.0f} {med['gaps']:7.0f} "
          f"{med['tail']:6.0f} {med['kernels']:8.0f}", flush=True)
    return med, sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    E.add_model_args(ap)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=12, help="kernel names listed per model")
    ap.add_argument("--no-mlxlm", action="store_true")
    ap.add_argument("--model", default=None,
                    help="profile ours on this model directory (a container, an mlx-lm checkpoint such as the one "
                         "bench_mlx_lm_checkpoint.py --dir D --reuse leaves in D) instead of building the bench model")
    ap.add_argument("--sequence", action="store_true", help="also list one step's kernels in start order")
    ap.add_argument("--rows", type=int, default=1,
                    help="also profile our forward step of this many rows at the same context, rolled back "
                         "each time (a speculative verify step: 1 + drafts)")
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences decoded together (a batch of B prompts, one token each a step: the serving "
                         "engine's step at B streams)")
    args = ap.parse_args()
    if args.batch > 1 and args.rows > 1:
        ap.error("--batch and --rows: one at a time")
    if kernels.backend() != "cuda":
        print(f"profile_step: needs the CUDA backend (this is {kernels.backend()}); nothing to profile")
        return 0
    import torch

    torch.cuda.init()
    cfg = E.model_config(args)
    prompt = mx.array(np.random.default_rng(0).integers(0, args.vocab, (args.batch, 16)).astype(np.int32))
    header = (f"{'model':<22} {'wall':>8} {'host lead':>9} {'GPU busy':>8} {'gaps':>7} {'tail':>6} {'kernels':>8}")
    print(f"per synchronized decode step of {args.batch} sequence(s), us (median of {args.steps}):")
    print(header)
    tops = []
    if args.model:
        from colibri_mlx.models.loading import load_model

        ours = load_model(args.model)
        prompt = mx.array(np.random.default_rng(0).integers(0, ours.args.vocab_size, (args.batch, 16))
                          .astype(np.int32))
        kernels.reset_counters()
    else:
        ours = E.our_model(cfg)
    cache = ours.make_cache()
    rows, by_name, sequence = step_profile(lambda t: ours(t, cache), prompt, args.steps)
    tops.append(("ours",) + report("ours", rows, by_name, args.top))
    sequences = [("ours", sequence)]
    if args.rows > 1:
        many = mx.array([[5 + i for i in range(args.rows)]], dtype=mx.int32)
        start = cache.offset

        def rows_step(_):
            cache.offset = start
            return ours(many, cache)

        label = f"ours, {args.rows} rows"
        rows, by_name, sequence = step_profile(rows_step, prompt, args.steps)
        tops.append((label,) + report(label, rows, by_name, args.top))
        sequences.append((label, sequence))
    if args.model:
        print(f"ours on {args.model}: {kernels.format_counters()}")
    del ours, cache
    kernels.moe.clear_banks()          # the expert banks and compiled traces hold GPU memory
    kernels.compiled.clear()
    mx.clear_cache()
    if not args.no_mlxlm:
        from mlx_lm.models.cache import make_prompt_cache

        lm = E.lm_model(cfg)
        lm_cache = make_prompt_cache(lm)
        rows, by_name, sequence = step_profile(lambda t: lm(t, cache=lm_cache), prompt, args.steps)
        tops.append(("mlx-lm 0.32.2",) + report("mlx-lm 0.32.2", rows, by_name, args.top))
        sequences.append(("mlx-lm 0.32.2", sequence))
    for label, med, top in tops:
        if not top:
            continue
        print(f"\n{label}: GPU time a step by kernel: us, launches, us a launch")
        for name, (us, n) in top:
            print(f"  {us:8.1f} {n:5.1f} {us / n:7.2f}  {short(name)}")
    if args.sequence:
        for label, sequence in sequences:
            print_sequence(label, sequence)
    print("\nwall = host lead + (GPU busy + gaps) + tail; the lead is the host's share before the GPU starts")
    return 0


if __name__ == "__main__":
    sys.exit(main())

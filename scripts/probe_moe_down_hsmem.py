#!/usr/bin/env python3
"""Probe: moe_down with h staged once a block in shared memory (CUDA only, one token).

    PYTHONPATH=/root/site:/tmp/site:$PWD python3 scripts/probe_moe_down_hsmem.py

Why: moe_down (8 experts of 2048 -> 7168, fmt 4) runs at ~44 % of 4.3 TB/s while qgemv's large
shape runs at ~70 %. Nsight Compute (fifth session) found its L1/TEX pipe busier than DRAM, from
h: every row block reads all of h (8 x 2048 float32 = 64 KB) for its 4 rows (32 KB of weights),
so a launch moves ~117 MB of h through L1 against 63 MB of weights from HBM. Here the moe_down
kernel text is used as it is, except that each block first copies h into dynamic shared memory
(one 64 KB read a block from L2) and its work items read h from there; the arithmetic and its
order are unchanged, so the output must equal moe_down's bit for bit.

Prints each setting ROWS:NW:BLOCKS_PER_SM (rows a block, warps a block, blocks an SM of the
persistent grid): max |y - y_moe_down|, and the kernel-alone time (CUPTI, median of --iters
rounds x --chain instances with their own weights), against moe_down's default launch. A
probe: not used by the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from colibri_mlx import kernels  # noqa: E402
from colibri_mlx.kernels import dispatch, moe  # noqa: E402
from colibri_mlx.kernels.kernel_text import launch_text  # noqa: E402

COPY_BW = 4.3e12
STAGE = """
  // Probe: h (every slot's row, hs floats each) into dynamic shared memory, once a block.
  extern __shared__ float hsm[];
  for (int i = tid; i < n_slots * hs; i += 32 * NW) {
    hsm[i] = h[i];
  }
  __syncthreads();
  const float* hh = hsm;
"""
ANCHOR = "  const int n_items = n_distinct[0] * n_units;\n"


def staged_body(body: str) -> str:
    if ANCHOR not in body or body.count("          h, wd8,") != 2:
        raise SystemExit("probe: moe_down's body changed; update the probe's text edits")
    return body.replace(ANCHOR, ANCHOR + STAGE).replace("          h, wd8,", "          hh, wd8,")


def launcher(spec: dispatch.LaunchSpec, smem: int):
    header, source = launch_text(spec.header, spec.source, spec.name)
    k = mx.fast.cuda_kernel(name=spec.name, input_names=list(spec.input_names),
                            output_names=list(spec.output_names), source=source, header=header,
                            shared_memory=smem)

    def run():
        return k(inputs=spec.inputs, output_shapes=spec.output_shapes, output_dtypes=spec.output_dtypes,
                 grid=spec.grid, threadgroup=spec.threadgroup, template=spec.template)[0]
    return run


def cupti(groups, iters):
    """{label: [kernel durations in us]} of ``groups`` = [(label, [callables])], each callable
    evaluated alone, every round."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()

    def one_round():
        for _, fns in groups:
            for f in fns:
                mx.eval(f())
        mx.synchronize()

    one_round()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            one_round()
    recs = sorted((ev.time_range.start, getattr(ev, "device_time", 0) or ev.cuda_time)
                  for ev in prof.events() if "custom_kernel_" in ev.name)
    per_round = sum(len(f) for _, f in groups)
    if len(recs) != per_round * iters:
        raise SystemExit(f"expected {per_round * iters} kernel records, got {len(recs)}")
    out, j = {}, 0
    for label, fns in groups:
        out[label] = [recs[r * per_round + j + c][1] for r in range(iters) for c in range(len(fns))]
        j += len(fns)
    return out


def main():
    import bench_moe_parts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="4:4:3,4:8:3,8:8:3,4:8:2,8:16:1,4:16:1")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--chain", type=int, default=8)
    args = ap.parse_args()
    impl = kernels.backend()
    if impl != dispatch.CUDA:
        print("probe_moe_down_hsmem: CUDA only")
        return 0
    K = 8
    layers = [bench_moe_parts.make_layer(args.experts, 7168, 2048, 256) for _ in range(args.chain)]
    rng = np.random.default_rng(0)
    ids = [mx.array(rng.choice(args.experts, K, replace=False)[None].astype(np.int32)) for _ in layers]
    gw = [mx.array(rng.uniform(0.1, 1, (1, K)).astype(np.float32)) for _ in layers]
    xs = [mx.random.normal((1, 7168)).astype(mx.bfloat16) for _ in layers]
    mx.eval(ids, gw, xs)
    hs = [dispatch.launch(impl, moe.gate_up_spec(x, L.group, i, K, impl))[0] for x, L, i in zip(xs, layers, ids)]
    mx.eval(hs)
    g = layers[0].group
    nbytes = K * bench_moe_parts.proj_bytes(g.down)
    base = [moe.down_spec(h, L.group, i, w, 1, K, impl, out_dtype=mx.bfloat16)
            for h, L, i, w in zip(hs, layers, ids, gw)]
    groups = [("moe_down (default)", [first_output(s) for s in base])]
    h_bytes = hs[0].size * 4
    for cfg in args.settings.split(","):
        rows, nw, per_sm = map(int, cfg.split(":"))
        specs = []
        for h, L, i, w in zip(hs, layers, ids, gw):
            n_blocks = -(-7168 // rows)
            blocks = dispatch.balanced_blocks(n_blocks, dispatch.CUDA_SMS * per_sm)
            s = moe.down_spec(h, L.group, i, w, 1, K, impl, rows=rows, simdgroups=nw, out_dtype=mx.bfloat16,
                              min_blocks=0, persistent=blocks)
            specs.append(dataclasses.replace(s, source=staged_body(s.source)))
        groups.append((f"h in smem {cfg}", [launcher(s, h_bytes) for s in specs]))
    ref = np.array(dispatch.launch(impl, base[0])[0].astype(mx.float32))
    diffs = {}
    for label, fns in groups:
        y = fns[0]()
        diffs[label] = float(np.max(np.abs(np.array(y.astype(mx.float32)) - ref)))
    times = cupti(groups, args.iters)
    print(f"{'launch':<24} {'max |dy|':>10} {'median us':>10} {'min us':>8} {'%bw':>6}")
    for label, _ in groups:
        med = statistics.median(times[label])
        print(f"{label:<24} {diffs[label]:>10.3g} {med:>10.1f} {min(times[label]):>8.1f} "
              f"{nbytes / (med * 1e-6) / COPY_BW * 100:>6.1f}", flush=True)
    return 0


def first_output(spec):
    def run():
        return dispatch.launch(dispatch.CUDA, spec)[0]
    return run


if __name__ == "__main__":
    sys.exit(main())

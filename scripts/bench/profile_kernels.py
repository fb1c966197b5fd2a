#!/usr/bin/env python3
"""Kernel-only times of the decode launches (no MLX evaluation or Python cost in them), at
DeepSeek-V3 shapes: moe_gate_up / moe_down (8 of --experts routed experts, fmt 4 g64, S=1),
the three mla_decode launches (128 heads, kv_b fmt 4 g64, bf16 cache of --cache rows) and qgemv
(fmt 4 g64, 7168x2048 and 2048x7168) for comparison.

    PYTHONPATH=/root/site:/tmp/site:$PWD python3 scripts/bench/profile_kernels.py --cupti
    ncu --clock-control none --nvtx --nvtx-include "profiled/" --set full \\
        python3 scripts/bench/profile_kernels.py --once

Method: --cupti records every GPU kernel of --iters rounds with PyTorch's profiler (CUPTI
activity records: the kernel's start and end on the GPU, whatever library launched it) and
prints each kernel's median duration, its bytes and the fraction of 4.3 TB/s they make. Each
round launches every kernel once per instance of a chain of 8 independent instances (own
weights and caches, so nothing is an L2 hit across instances), each evaluated alone (a graph of
independent launches may overlap them on the GPU). --gate-up / --down / --qgemv add launch
settings.
--once launches each kernel once to warm up (JIT), then once more inside the NVTX range
"profiled", the launches Nsight Compute is told to profile.
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

from colibri_mlx import kernels  # noqa: E402
from colibri_mlx.kernels import dispatch, mla, moe, qgemv  # noqa: E402
from colibri_mlx.kernels.rows import rows_spec  # noqa: E402
import bench_mla_parts  # noqa: E402
import bench_moe_parts  # noqa: E402

COPY_BW = 4.3e12
CHAIN = 8


def moe_launches(impl, experts, k, act, gate_up_cfgs=(), down_cfgs=()):
    """[(label, bytes, [spec per instance])] for moe_gate_up and moe_down at S=1, then each
    other launch setting asked for."""
    layers = [bench_moe_parts.make_layer(experts, 7168, 2048, 256) for _ in range(CHAIN)]
    rng = np.random.default_rng(0)
    ids = [mx.array(rng.choice(experts, k, replace=False)[None].astype(np.int32)) for _ in layers]
    gw = [mx.array(rng.uniform(0.1, 1, (1, k)).astype(np.float32)) for _ in layers]
    xs = [mx.random.normal((1, 7168)).astype(act) for _ in layers]
    mx.eval(ids, gw, xs)
    gu = [moe.gate_up_spec(x, L.group, i, k, impl) for x, L, i in zip(xs, layers, ids)]
    hs = [dispatch.launch(impl, s)[0] for s in gu]
    mx.eval(hs)
    down = [moe.down_spec(h, L.group, i, w, 1, k, impl, out_dtype=act) for h, L, i, w in zip(hs, layers, ids, gw)]
    g = layers[0].group
    out = [("moe_gate_up", k * 2 * bench_moe_parts.proj_bytes(g.gate_up), gu),
           ("moe_down", k * bench_moe_parts.proj_bytes(g.down), down)]
    out += [(f"moe_gate_up {cfg}", out[0][1], bench_moe_parts.gate_up_setting(cfg, xs, layers, ids, k, impl))
            for cfg in gate_up_cfgs]
    out += [(f"moe_down {cfg}", out[1][1], bench_moe_parts.down_setting(cfg, hs, layers, ids, gw, 1, k, impl, act))
            for cfg in down_cfgs]
    return out, layers


def mla_launches(impl, T, act, attn_settings=(), qabs_parts=(), out_warps=(), qb_settings=()):
    """mla_decode's three launches at cache T, and the attention again at each setting asked
    for: ``[VARIANT:]HEADS[:MINB]``, the variant (mla.VARIANTS, default mma), the heads a block
    (mla.MMA_HEAD_CHOICES) and CUDA launch bounds (blocks an SM, dispatch.with_min_blocks); an
    empty field is the default."""
    insts = [bench_mla_parts.instance(T, act) for _ in range(CHAIN)]
    runs = [bench_mla_parts.specs_of(i, impl) for i in insts]
    R, ROPE, H = bench_mla_parts.R, bench_mla_parts.ROPE, bench_mla_parts.H
    kvb_bytes = H * (bench_mla_parts.NOPE + bench_mla_parts.V) * (R // 2 + R // 64 * 4)
    names = ("mla_qabs", "mla_attn", "mla_out")
    nbytes = (kvb_bytes // 2, T * (R + ROPE) * act.size, kvb_bytes // 2)
    out = [(f"{n} T={T}", b, [c[j] for _, c in runs]) for j, (n, b) in enumerate(zip(names, nbytes))]
    for cfg in attn_settings:
        fields = cfg.split(":")
        variant = fields.pop(0) if fields[0] in mla.VARIANTS else "mma"
        heads, minb = [int(f or 0) or None for f in (fields + ["", ""])[:2]]
        try:
            specs = [bench_mla_parts.specs_of(i, impl, variant=variant, heads=heads)[1][1]
                     for i in insts]
        except (RuntimeError, ValueError) as e:     # e.g. a block too large to launch
            print(f"mla_attn T={T} {cfg}: failed: {str(e)[:160]}", flush=True)
            continue
        out.append((f"mla_attn T={T} {cfg}", nbytes[1], [dispatch.with_min_blocks(s, minb or 0) for s in specs]))
    # q_b's GEMV (H x (nope + rope) rows of q_lora 1536, fmt 4 g64) then mla_qabs, against
    # mla_qb_qabs doing both in one launch (the model's decode step: mla.mla_decode's q_proj)
    from bench_qgemv import random_qtensors

    QL = 1536
    q_bs = random_qtensors(4, H * (bench_mla_parts.NOPE + ROPE), QL, 64, CHAIN)
    q_lats = [mx.random.normal((1, 1, QL)).astype(act) for _ in q_bs]
    mx.eval(q_lats)
    qb_bytes = q_bs[0].O * (QL // 2 + QL // 64 * 4)
    out.append(("qgemv q_b " + f"{q_bs[0].O}x{QL}", qb_bytes,
                [qgemv.launch_spec(ql.reshape(1, QL), qb, impl) for ql, qb in zip(q_lats, q_bs)]))

    def first_launch(inst, ql, qb, setting=None):
        _, _, latent, k_rope, kv_b = inst
        return mla.planned_launches(mla.launch_specs(None, None, latent, k_rope, kv_b, bench_mla_parts.NOPE ** -0.5,
                                                     None, bench_mla_parts.NOPE, bench_mla_parts.V, backend=impl,
                                                     q_proj=(ql, qb), qb=setting))[0]

    for setting in (None, *qb_settings):    # mla.qb_setting: SIMD groups:rows
        out.append((f"mla_qb_qabs T={T}" + (f" {setting}" if setting else ""), qb_bytes + nbytes[0],
                    [first_launch(i, ql, qb, setting) for i, ql, qb in zip(insts, q_lats, q_bs)]))
    insts = [insts, q_bs, q_lats]
    # mla_qabs with other threadgroups a head (mla.QABS_PARTS), mla_out with other SIMD groups
    # (mla.OUT_WARPS): launch j of the three, made with launch_specs(**{arg: value})
    for j, arg, label, values in ((0, "qabs_parts", "parts", qabs_parts), (2, "out_warps", "warps", out_warps)):
        for value in values:
            out.append((f"{names[j]} T={T} {label} {value}", nbytes[j],
                        [bench_mla_parts.specs_of(i, impl, **{arg: value})[1][j] for i in insts[0]]))
    return out, insts


def rows_launches(impl, act):
    """mla_rows at DeepSeek-V3's widths (q_a 1536, latent 512, rope 64), one decode row at
    position 40000, with the position made on the host (as the model makes it each step) and
    made by a GPU op: if reading a host-made array is what costs, the two differ."""
    QL, R, ROPE = 1536, bench_mla_parts.R, bench_mla_parts.ROPE
    ys = [mx.random.normal((1, QL + R + ROPE)).astype(act) for _ in range(CHAIN)]
    qn, kn = mx.random.uniform(0.5, 1.5, (QL,)).astype(act), mx.random.uniform(0.5, 1.5, (R,)).astype(act)
    inv = mx.array((1.0 / (10000.0 ** (np.arange(0, ROPE, 2) / ROPE))).astype(np.float32))
    host_pos = mx.array(40000, dtype=mx.int32)
    gpu_pos = mx.array(39999, dtype=mx.int32) + 1
    mx.eval(ys, qn, kn, inv, host_pos, gpu_pos)
    nbytes = (QL + R + ROPE) * act.size * 2
    return [(f"mla_rows ({where} position)", nbytes,
             [rows_spec(y, QL, qn, kn, 1e-6, inv, pos, impl) for y in ys])
            for where, pos in (("host", host_pos), ("gpu", gpu_pos))], [ys, qn, kn, inv]


def qgemv_launches(impl, act, settings=(), shape_in=False):
    """One GEMV alone at the model's small shapes (fmt 4 g64), and issue 4's large shape in fmt 4
    and fmt 2 (the kernel's own time: bench_qgemv.py's figures include MLX's host work), the
    large shape also at each ROWS:NW:UNROLL:NIB:PF[:PB[:MINB[:SHAPE]]] setting asked for ("-":
    qgemv.py's choice; PB: blocks of a persistent grid, 0 = one block a row block; MINB: CUDA
    launch bounds, blocks an SM; SHAPE 1: the shape compiled in)."""
    from bench_moe_parts import parse
    from bench_qgemv import random_qtensors
    from colibri_mlx.formats import scale_nbytes, weight_nbytes

    out = []
    keep = []
    for fmt, O, I in ((4, 7168, 2048), (4, 2048, 7168), (4, 18432, 7168), (2, 18432, 7168)):
        gs = 64 if fmt == 4 else None
        ws = random_qtensors(fmt, O, I, gs, CHAIN)
        xs = [mx.random.normal((1, I)).astype(act) for _ in ws]
        mx.eval(xs)
        label = f"qgemv {O}x{I}" + ("" if fmt == 4 else f" fmt {fmt}")
        nbytes = weight_nbytes(fmt, O, I, gs) + scale_nbytes(fmt, O, I, gs) + I * act.size
        out.append((label, nbytes, [qgemv.launch_spec(x, w, impl) for x, w in zip(xs, ws)]))
        if shape_in and O != 18432:   # (the large shape's default compiles it in already)
            out.append((f"{label} shape compiled in", nbytes,
                        [qgemv.launch_spec(x, w, impl, shape_in=True) for x, w in zip(xs, ws)]))
        for cfg in settings if O == 18432 else ():
            rows, nw, unroll, nib, pf, pb, minb, shin = parse(cfg, 8)
            out.append((f"{label} {cfg}", nbytes,
                        [dispatch.with_min_blocks(qgemv.launch_spec(x, w, impl, rows=rows, simdgroups=nw, unroll=unroll,
                                                                    nib=nib, prefetch=pf, persistent=pb,
                                                                    shape_in=None if shin is None else bool(shin)), minb)
                         for x, w in zip(xs, ws)]))
        keep.append((ws, xs))
    return out, keep


# A pure read of a buffer (uint4 loads, 4 in flight a thread, grid-stride), one XOR word
# written a thread: what a kernel that only streams bytes gets out of HBM at a given size.
READ_SOURCE = """
  const size_t n = size_t(params[0]);
  const uint4* p = reinterpret_cast<const uint4*>(buf);
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t acc = 0u;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = p[i];
    const uint4 b = p[i + stride];
    const uint4 c = p[i + 2 * stride];
    const uint4 d = p[i + 3 * stride];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = p[i];
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  out[size_t(blockIdx.x) * blockDim.x + threadIdx.x] = acc;
"""
SMS = 132        # H200


def read_spec(buf, blocks, threads=256):
    n16 = buf.size // 4
    return dispatch.LaunchSpec(
        name="read_ceiling", input_names=("buf", "params"), output_names=("out",), source=READ_SOURCE, header="",
        inputs=[buf, dispatch.int_params(n16)], output_shapes=[(blocks * threads,)], output_dtypes=[mx.uint32],
        grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1))


def ceiling_launches(impl, act):
    """What bounds qgemv at the large shape: a pure read of its bytes (74 MB; and of the small
    shapes' 8.3 MB) by a persistent grid (8 blocks of 256 an SM) and by one block a 4 KB slice;
    qgemv itself at 4x the rows (297 MB: its start and tail amortized), with one block a row
    block and by default; qgemv with its shape read from params (the default compiles it in)."""
    from bench_qgemv import random_qtensors
    from colibri_mlx.formats import scale_nbytes, weight_nbytes

    out, keep = [], []
    nbytes = weight_nbytes(4, 18432, 7168, 64) + scale_nbytes(4, 18432, 7168, 64)
    bufs = [mx.random.randint(0, 2**31 - 1, (nbytes // 4,), dtype=mx.int32).view(mx.uint32) for _ in range(CHAIN)]
    mx.eval(bufs)
    n16 = bufs[0].size // 4
    out.append(("read 74 MB persistent", nbytes, [read_spec(b, SMS * 8) for b in bufs]))
    out.append(("read 74 MB one-shot", nbytes, [read_spec(b, -(-n16 // 1024)) for b in bufs]))
    keep.append(bufs)
    small = weight_nbytes(4, 7168, 2048, 64) + scale_nbytes(4, 7168, 2048, 64)
    sbufs = [mx.random.randint(0, 2**31 - 1, (small // 4,), dtype=mx.int32).view(mx.uint32) for _ in range(CHAIN)]
    mx.eval(sbufs)
    out.append(("read 8.3 MB persistent", small, [read_spec(b, SMS * 8) for b in sbufs]))
    out.append(("read 8.3 MB one-shot", small, [read_spec(b, -(-(sbufs[0].size // 4) // 1024)) for b in sbufs]))
    keep.append(sbufs)
    for O in (18432, 4 * 18432):
        ws = random_qtensors(4, O, 7168, 64, CHAIN)
        xs = [mx.random.normal((1, 7168)).astype(act) for _ in ws]
        mx.eval(xs)
        qb = weight_nbytes(4, O, 7168, 64) + scale_nbytes(4, O, 7168, 64) + 7168 * act.size
        specs = [qgemv.launch_spec(x, w, impl) for x, w in zip(xs, ws)]
        if O == 18432:   # the default compiles the shape in
            out.append((f"qgemv {O}x7168 shape from params", qb,
                        [qgemv.launch_spec(x, w, impl, shape_in=False) for x, w in zip(xs, ws)]))
        else:
            out.append((f"qgemv {O}x7168 one block a row block", qb,
                        [qgemv.launch_spec(x, w, impl, persistent=0) for x, w in zip(xs, ws)]))
            out.append((f"qgemv {O}x7168", qb, specs))
        keep.append((ws, xs))
    # The model's other GEMVs past one wave of row blocks: q_b (2.9 waves), lm_head (15.3).
    for O, I in ((24576, 1536), (129280, 7168)):
        ws = random_qtensors(4, O, I, 64, CHAIN)
        xs = [mx.random.normal((1, I)).astype(act) for _ in ws]
        mx.eval(xs)
        qb = weight_nbytes(4, O, I, 64) + scale_nbytes(4, O, I, 64) + I * act.size
        for name, kw in (("one block a row block", dict(rows=4, persistent=0)), ("default", {})):
            out.append((f"qgemv {O}x{I} {name}", qb, [qgemv.launch_spec(x, w, impl, **kw) for x, w in zip(xs, ws)]))
        keep.append((ws, xs))
    return out, keep


def run_round(impl, launches):
    """Every launch evaluated alone, one after another: a graph of independent launches may run
    them concurrently on the GPU, which stretches each one's start-to-end time."""
    for _, _, specs in launches:
        for s in specs:
            mx.eval(dispatch.launch(impl, s)[0])
    mx.synchronize()


def cupti_times(impl, launches, iters):
    """Durations (us) of the custom kernels of --iters rounds, in launch order, from PyTorch's
    profiler (CUPTI kernel records)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    run_round(impl, launches)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run_round(impl, launches)
    recs = []
    for ev in prof.events():
        dt = getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0)
        if "custom_kernel_" in ev.name and dt:
            recs.append((ev.time_range.start, dt, ev.name))
    return [(dt, name) for _, dt, name in sorted(recs)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cupti", action="store_true", help="time the kernels with PyTorch's profiler")
    ap.add_argument("--once", action="store_true", help="warm-up launches, then one of each (for ncu)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--cache", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=[""], help="substrings: keep the launches whose label has one")
    ap.add_argument("--gate-up", default="", help="more moe_gate_up settings ROWS:NW:UNROLL:NIB:PF[:MINB[:PB]] (MINB: CUDA launch bounds, blocks an SM; "
                    "PB: blocks a slot of a persistent grid), comma-separated")
    ap.add_argument("--down", default="", help="more moe_down settings ROWS:NW:UNROLL:NIB[:-[:MINB[:PB[:SHAPE]]]] (PF is '-': moe_down has "
                    "no prefetch loop; PB: blocks of a persistent grid; SHAPE 1: the shape compiled in), comma-separated")
    ap.add_argument("--qgemv", default="", help="more qgemv 18432x7168 settings ROWS:NW:UNROLL:NIB:PF[:PB[:MINB[:SHAPE]]] (PB: blocks of a "
                    "persistent grid, 0: one a row block; MINB: CUDA launch bounds, blocks an SM; SHAPE 1: the shape "
                    "compiled in), comma-separated")
    ap.add_argument("--attn", default="", help="more attention settings [VARIANT:]HEADS[:MINB] (VARIANT: mma, "
                    "wide or simt, default mma; HEADS empty: the default; MINB: CUDA launch bounds, blocks an SM), "
                    "comma-separated, e.g. wide,mma:16")
    ap.add_argument("--out-warps", default="", help="mla_out also with these SIMD groups (4, 8, 16), comma-separated")
    ap.add_argument("--qabs-parts", default="", help="mla_qabs also at these threadgroups a head, comma-separated")
    ap.add_argument("--qb", default="", help="mla_qb_qabs also at these SIMD groups:rows settings (mla.qb_setting), comma-separated")
    ap.add_argument("--shape-in", action="store_true", help="also the small qgemv shapes with the shape compiled into "
                    "the kernel (CUDA; the large shape's default has it)")
    ap.add_argument("--ceiling", action="store_true", help="also a pure read of qgemv's large-shape bytes, qgemv at "
                    "4x its rows and with its shape read from params (what bounds the large shape)")
    args = ap.parse_args()
    impl = kernels.backend()
    if impl == dispatch.REFERENCE:
        print("no GPU backend: nothing to profile")
        return 0
    act = mx.bfloat16
    global CHAIN
    if args.once:
        CHAIN = 1                # one instance of each: ncu profiles one launch
    launches, keep = moe_launches(impl, args.experts, args.k, act, [c for c in args.gate_up.split(",") if c],
                                  [c for c in args.down.split(",") if c])
    for T in args.cache:
        more, k2 = mla_launches(impl, T, act, [c for c in args.attn.split(",") if c],
                                [int(c) for c in args.qabs_parts.split(",") if c],
                                [int(c) for c in args.out_warps.split(",") if c],
                                [c for c in args.qb.split(",") if c])
        launches += more
        keep.append(k2)
    more, k3 = qgemv_launches(impl, act, [c for c in args.qgemv.split(",") if c], args.shape_in)
    launches += more
    more, k4 = rows_launches(impl, act)
    launches += more
    keep += [k3, k4]
    if args.ceiling:
        more, k5 = ceiling_launches(impl, act)
        launches += more
        keep.append(k5)
    launches = [ln for ln in launches if any(o in ln[0] for o in args.only)]
    for label, _, specs in launches:
        print(f"{label}: {specs[0].name} grid {specs[0].grid} tg {specs[0].threadgroup} "
              f"{' '.join(f'{k}={v}' for k, v in specs[0].template if k != 'T')}")
    if args.once:
        import torch

        first = [(label, b, specs[:1]) for label, b, specs in launches]
        run_round(impl, first)
        torch.cuda.nvtx.range_push("profiled")
        run_round(impl, first)
        torch.cuda.nvtx.range_pop()
        print(f"--once: {len(first)} launches inside the NVTX range 'profiled'")
        return 0
    if args.cupti:
        recs = cupti_times(impl, launches, args.iters)
        per_round = CHAIN * len(launches)
        if len(recs) != per_round * args.iters:
            print(f"expected {per_round * args.iters} kernel records, got {len(recs)}: not attributable")
            return 1
        print(f"{'launch':<22} {'median us':>10} {'min us':>8} {'MB':>8} {'%bw':>6}  kernel")
        for j, (label, nbytes, _) in enumerate(launches):
            mine = [recs[r * per_round + j * CHAIN + c] for r in range(args.iters) for c in range(CHAIN)]
            durs = [d for d, _ in mine]
            med = statistics.median(durs)
            print(f"{label:<22} {med:>10.1f} {min(durs):>8.1f} {nbytes / 1e6:>8.2f} "
                  f"{nbytes / (med * 1e-6) / COPY_BW * 100:>6.1f}  {mine[0][1][:60]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

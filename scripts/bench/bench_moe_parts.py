#!/usr/bin/env python3
"""Where a MoE layer's decode time goes: router_scores, router_topk, moe_gate_up and moe_down
each timed alone, per launch setting, and the whole router_topk / moe_block calls, at
DeepSeek-V3 shapes (hidden 7168, moe_inter 2048, 256 router experts, n_group 8, topk_group 4,
top 8, sigmoid + bias; routed experts fmt 4 g64, 8 of --experts per token, bf16 x).

    PYTHONPATH=/root/site:/tmp/site:$PWD python3 scripts/bench/bench_moe_parts.py [--tokens 1 4]

Method: a chain of 8 independent instances (each its own bank and router weight, so
nothing is an L2 hit across instances) in one evaluation, median of --iters after a warm-up,
time / 8. Launch inputs (h for moe_down, scores for router_topk) are evaluated beforehand, so a
launch timed alone is that kernel plus its launch cost. "read" is what the launch must read
(weights and scales of the distinct experts, the router weight); "%bw" is read / time against
4.3 TB/s. "build" is the Python graph-building share of the whole calls (the GPU waits on it).

Settings are ROWS:NW:UNROLL:NIB ("-" keeps the default moe.py picks), moe_gate_up's also :PF
(1: the next step's loads in flight during this step's decode, UNROLL 1 unless given);
router_scores takes ROWS:NW.
"gather_qmm" times the whole layer as mlx-lm's SwitchGLU over the same bytes
(moe.moe_gather_qmm: mx.gather_qmm, rows sorted by expert). A setting that does not build or launch prints its error and the sweep goes on. The
last lines name the fastest setting of each launch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from colibri_mlx import kernels  # noqa: E402
from colibri_mlx.formats.qtensor import QTensor  # noqa: E402
from colibri_mlx.kernels import dispatch, moe, router  # noqa: E402
from bench_timing import median_times  # noqa: E402

COPY_BW = 4.3e12
CHAIN = 8
GS = 64
CFG = router.RouterConfig(top_k=8, n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)

GATE_UP_CONFIGS = ["-:-:-:-:-", "-:-:-:-:0", "-:-:-:-:1", "-:-:1:-:0", "-:-:2:-:1", "1:-:-:-:-", "4:-:-:-:-",
                   "-:2:-:-:-", "-:4:-:-:-", "1:2:-:-:-", "-:2:-:-:0", "-:-:-:0:-", "4:2:-:-:-", "1:-:-:-:0"]
DOWN_CONFIGS = ["-:-:-:-", "2:-:-:-", "8:-:-:-", "-:1:-:-", "-:2:-:-", "-:8:-:-", "-:-:1:-", "-:-:4:-",
                "2:8:-:-", "8:2:-:-", "-:8:1:-", "-:-:-:0"]
SCORES_CONFIGS = ["-:-", "1:-", "4:-", "1:4", "1:16", "2:4", "2:16", "4:16", "8:8"]


def timeit(fn, iters):
    """Per instance of the chain: (evaluation, Python build) seconds."""
    total, build = median_times(fn, iters)
    return total / CHAIN, build / CHAIN


def rand_q4(O, I, name):
    return QTensor(mx.random.randint(0, 256, (O * I // 2,)).astype(mx.uint8),
                   mx.random.uniform(0.002, 0.02, (O * I // GS,)), 4, O, I, GS, name)


@dataclasses.dataclass
class Layer:
    experts: list            # what moe_block gets (its bank is built once, below)
    group: moe.ExpertGroup
    rw: mx.array             # router weight [E_router, D] float32
    bias: mx.array


def make_layer(E, D, inter, E_router) -> Layer:
    experts = [tuple(rand_q4(O, I, f"e{e}.{p}") for p, (O, I) in
                     (("gate", (inter, D)), ("up", (inter, D)), ("down", (D, inter)))) for e in range(E)]
    bank = moe.resident_bank(experts)
    if len(bank.groups) != 1 or bank.declined:
        raise SystemExit(f"expected one fmt 4 group, got {len(bank.groups)} groups, declined {bank.declined}")
    rw = mx.random.normal((E_router, D)) * 0.02
    bias = mx.random.uniform(-0.01, 0.01, (E_router,))
    mx.eval(rw, bias)
    return Layer(experts, bank.groups[0], rw, bias)


def parse(cfg: str, n: int) -> list:
    parts = (cfg.split(":") + ["-"] * n)[:n]
    return [None if p in ("-", "") else int(p) for p in parts]


def with_template(spec: dispatch.LaunchSpec, **over) -> dispatch.LaunchSpec:
    """The spec with some template values replaced (UNROLL, NIB: moe.py picks them itself).
    A copy: the static part's template list is shared by every later launch."""
    over = {k: v for k, v in over.items() if v is not None}
    if not over:
        return spec
    return dataclasses.replace(spec, template=[(k, over.get(k, v)) for k, v in spec.template])


def cuda_only(value, impl, what="MINB (launch bounds)"):
    if value and impl != dispatch.CUDA:
        raise ValueError(f"{what} is a CUDA setting, not {impl}'s")


def template_of(spec, *names) -> str:
    t = dict(spec.template)
    return " ".join(f"{n}={t[n]}" for n in names if n in t)


def gate_up_setting(cfg, xs, layers, ids, K, impl) -> list:
    """moe_gate_up's launch per instance at setting ROWS:NW:UNROLL:NIB:PF[:MINB[:PB]] ("-":
    moe.py's; MINB: CUDA launch bounds, blocks an SM, dispatch.with_min_blocks; PB: blocks a slot
    of a persistent grid)."""
    rows, nw, unroll, nib, pf, minb, pb, shape = parse(cfg, 8)
    if shape:
        raise ValueError("SHAPE: moe_gate_up reads its shape from params (moe_down alone compiles it in)")
    cuda_only(minb, impl)
    return [dispatch.with_min_blocks(with_template(moe.gate_up_spec(x, L.group, i, K, impl, rows=rows, simdgroups=nw,
                                                                    prefetch=pf, persistent=pb),
                                                   UNROLL=unroll, NIB=nib), minb)
            for x, L, i in zip(xs, layers, ids)]


def down_setting(cfg, hs, layers, ids, gw, S, K, impl, out_dtype) -> list:
    """moe_down's launch per instance at setting ROWS:NW:UNROLL:NIB[:PF[:MINB[:PB[:SHAPE]]]] ("-":
    moe.py's; PF: none, moe_down has no prefetch loop; MINB 0: no launch bounds; PB: blocks of a
    persistent grid, 0: one a row block; SHAPE 1: the projection's shape compiled in, CUDA)."""
    rows, nw, unroll, nib, pf, minb, pb, shape = parse(cfg, 8)
    if pf:
        raise ValueError("PF: moe_down has no prefetch loop")
    cuda_only(minb, impl)
    cuda_only(shape, impl, "SHAPE (the shape compiled in)")
    return [with_template(moe.down_spec(h, L.group, i, w, S, K, impl, rows=rows, simdgroups=nw, out_dtype=out_dtype,
                                        min_blocks=minb, persistent=pb,
                                        shape_in=None if shape is None else bool(shape)), UNROLL=unroll, NIB=nib)
            for h, L, i, w in zip(hs, layers, ids, gw)]


def proj_bytes(p: moe.Projection) -> int:
    """Weight and scale bytes of one expert's projection (all its rows)."""
    return p.O * (p.rb + 4 * p.ng)


def row(part, S, cfg, detail, us, nbytes):
    pct = nbytes / (us * 1e-6) / COPY_BW * 100 if us > 0 else float("nan")
    print(f"{part:<13} {S:>2} {cfg:<10} {detail:<33} {us:>9.1f} {nbytes / 1e6:>9.2f} {pct:>6.1f}", flush=True)


def sweep(part, S, configs, build, nbytes, iters, impl, best):
    """Time each setting's launches alone (one per instance of the chain)."""
    for cfg in configs:
        try:
            specs = build(cfg)
            mx.eval([dispatch.launch(impl, s)[0] for s in specs[:1]])
            us = timeit(lambda: [dispatch.launch(impl, s)[0] for s in specs], iters)[0] * 1e6
        except Exception as e:   # too many registers, threadgroup too large, ...
            print(f"{part:<13} {S:>2} {cfg:<10} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        detail = template_of(specs[0], "ROWS", "NW", "UNROLL", "NIB", "PF", "MINB") + f" tg={specs[0].threadgroup[0]}"
        row(part, S, cfg, detail, us, nbytes)
        if (part, S) not in best or us < best[(part, S)][1]:
            best[(part, S)] = (cfg, us, detail)


def token_inputs(S, layers, E, K, act):
    """Per instance: S tokens' own K random experts of E, gate weights and x; and the distinct
    experts of the first instance."""
    rng = np.random.default_rng(S)
    D = layers[0].group.gate_up.I
    ids = [mx.array(np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int32))
           for _ in layers]
    gw = [mx.array(rng.uniform(0.1, 1, (S, K)).astype(np.float32)) for _ in layers]
    xs = [mx.random.normal((S, D)).astype(act) for _ in layers]
    mx.eval(ids, gw, xs)
    return ids, gw, xs, len(np.unique(np.array(ids[0])))


def bench_tokens(S, layers, args, impl, best):
    E, K = args.experts, args.k
    D = layers[0].group.gate_up.I
    ids, gw, xs, distinct = token_inputs(S, layers, E, K, args.act)
    g0 = layers[0].group
    gu_bytes = distinct * proj_bytes(g0.gate_up) * 2
    d_bytes = distinct * proj_bytes(g0.down)
    out_dtype = args.act           # one group: moe_down writes x's dtype (moe.moe_block)

    def gate_up_specs(cfg):
        return gate_up_setting(cfg, xs, layers, ids, K, impl)

    # h for moe_down: gate_up's default launch, evaluated now (not part of the down timing).
    hs = [dispatch.launch(impl, s)[0] for s in gate_up_specs("-")]
    mx.eval(hs)

    def down_specs(cfg):
        return down_setting(cfg, hs, layers, ids, gw, S, K, impl, out_dtype)

    sweep("moe_gate_up", S, args.gate_up, gate_up_specs, gu_bytes, args.iters, impl, best)
    sweep("moe_down", S, args.down, down_specs, d_bytes, args.iters, impl, best)
    whole, build = timeit(lambda: [kernels.moe_block(x, L.experts, i, w) for x, L, i, w in zip(xs, layers, ids, gw)],
                          args.iters)
    row("moe_block", S, "default", f"{distinct} experts, build {build * 1e6:.1f} us", whole * 1e6, gu_bytes + d_bytes)
    if moe.gather_reason(moe.resident_bank(layers[0].experts), args.act) is None:
        whole, build = timeit(lambda: [moe.moe_gather_qmm(x, L.group, i, w) for x, L, i, w in zip(xs, layers, ids, gw)],
                              args.iters)
        row("gather_qmm", S, "mlx", f"build {build * 1e6:.1f} us", whole * 1e6, gu_bytes + d_bytes)

    if S > router.MAX_TOKENS:
        return
    E_r = layers[0].rw.shape[0]
    scores = [mx.sigmoid(x.astype(mx.float32) @ L.rw.T) for x, L in zip(xs, layers)]
    mx.eval(scores)

    def scores_specs(cfg):
        rows, nw = parse(cfg, 2)
        kw = {k: v for k, v in (("rows", rows), ("simdgroups", nw)) if v is not None}
        return [router.scores_spec(x, L.rw, impl, **kw) for x, L in zip(xs, layers)]

    sweep("router_scores", S, args.scores, scores_specs, E_r * D * 4, args.iters, impl, best)
    sweep("router_topk", S, ["-"], lambda cfg: [router.topk_spec(sc, L.bias, CFG, None, impl)
                                                 for sc, L in zip(scores, layers)],
          S * E_r * 4 + E_r * 4, args.iters, impl, best)
    whole, build = timeit(lambda: [router.router_topk(x, L.rw, L.bias, CFG) for x, L in zip(xs, layers)],
                          args.iters)
    row("router", S, "default", f"build {build * 1e6:.1f} us", whole * 1e6, E_r * D * 4)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--experts", type=int, default=64, help="routed experts per layer (the bank)")
    ap.add_argument("--k", type=int, default=8, help="experts per token")
    ap.add_argument("--router-experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--gate-up", nargs="+", default=GATE_UP_CONFIGS, help="ROWS:NW:UNROLL:NIB:PF")
    ap.add_argument("--down", nargs="+", default=DOWN_CONFIGS, help="ROWS:NW:UNROLL:NIB")
    ap.add_argument("--scores", nargs="+", default=SCORES_CONFIGS, help="ROWS:NW")
    args = ap.parse_args(argv)
    impl = kernels.backend()
    if impl == dispatch.REFERENCE:
        print("no GPU backend: moe_block and router_topk run their reference paths; nothing to time")
        return 0
    args.act = mx.bfloat16
    print(f"backend {impl}, {mx.default_device()}, x {args.act}, {args.experts} experts/layer, top {args.k}, "
          f"D {args.hidden}, inter {args.inter}, fmt 4 g{GS}, router E {args.router_experts}")
    layers = [make_layer(args.experts, args.hidden, args.inter, args.router_experts) for _ in range(CHAIN)]
    print(f"{'launch':<13} {'S':>2} {'setting':<10} {'template':<33} {'us':>9} {'read MB':>9} {'%bw':>6}")
    best: dict = {}
    for S in args.tokens:
        bench_tokens(S, layers, args, impl, best)
    print("fastest setting per launch:")
    for (part, S), (cfg, us, detail) in best.items():
        print(f"  {part:<13} S={S}: {cfg:<10} {detail}  {us:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())

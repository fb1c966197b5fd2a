#!/usr/bin/env python3
"""Per-layer decode cost of our MoE and MLA blocks against mlx-lm 0.32.2, same process, same
shapes (DeepSeek-V3: hidden 7168, moe_inter 2048, 128 heads, q_lora 1536, kv_lora 512), 4-bit
group 64 weights (ours: container fmt 4 g64; mlx-lm: affine 4-bit g64, bf16).

    PYTHONPATH=/root/site:/tmp/site:$PWD python3 scripts/bench/bench_moe_mla.py [--experts 64] [--iters 20]

Method: a chain of 8 independent layers in one evaluation, median of --iters after a
warm-up; time / 8 is the marginal cost of one layer. Weights are random bytes on the GPU. Each
layer holds --experts routed experts (the routed bytes read per token do not depend on E; E=256
does not fit 8 layers x 2 implementations in memory with the bank copy). Prints a table last
and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from colibri_mlx import kernels  # noqa: E402
from colibri_mlx.kernels import compiled  # noqa: E402
from colibri_mlx.formats.qtensor import QTensor  # noqa: E402
from bench_timing import median_times, timeline  # noqa: E402

D, INTER, H, Q_LORA, KV_LORA, NOPE, ROPE, V = 7168, 2048, 128, 1536, 512, 128, 64, 128
COPY_BW = 4.3e12
# Activation dtype of our model: bf16 on GPUs (load(dtype="auto")), float32 on the CPU backend.
ACT = mx.bfloat16 if kernels.backend() != "reference" else mx.float32
CHAIN = 8


def rand_q4(O, I, name="w", gs=64) -> QTensor:
    packed = mx.random.randint(0, 256, (O * I // 2,)).astype(mx.uint8)
    scales = mx.random.uniform(0.002, 0.02, (O * I // gs,))
    return QTensor(packed, scales, 4, O, I, gs, name)


def config(n_layers=1, experts=256, first_dense=0, vocab=129280):
    return dict(model_type="deepseek_v3", vocab_size=vocab, hidden_size=D, intermediate_size=18432,
                moe_intermediate_size=INTER, num_hidden_layers=n_layers, num_attention_heads=H,
                num_key_value_heads=H, n_routed_experts=experts, num_experts_per_tok=8, n_shared_experts=1,
                kv_lora_rank=KV_LORA, q_lora_rank=Q_LORA, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE,
                v_head_dim=V, routed_scaling_factor=2.5, n_group=8, topk_group=4, norm_topk_prob=True,
                first_k_dense_replace=first_dense, max_position_embeddings=65536, rope_theta=10000.0,
                rms_norm_eps=1e-6, topk_method="noaux_tc", scoring_func="sigmoid")


def moe_weights(prefix, experts):
    w = {prefix + "gate.weight": mx.random.normal((experts, D)) * 0.02,
         prefix + "gate.e_score_correction_bias": mx.zeros((experts,))}
    for e in range(experts):
        for p, (O, I) in (("gate", (INTER, D)), ("up", (INTER, D)), ("down", (D, INTER))):
            w[f"{prefix}experts.{e}.{p}_proj.weight"] = rand_q4(O, I, f"{prefix}experts.{e}.{p}")
    for p, (O, I) in (("gate", (INTER, D)), ("up", (INTER, D)), ("down", (D, INTER))):
        w[f"{prefix}shared_experts.{p}_proj.weight"] = rand_q4(O, I)
    return w


def dense_mlp_weights(prefix, inter=18432):
    return {f"{prefix}{p}_proj.weight": rand_q4(O, I) for p, (O, I) in
            (("gate", (inter, D)), ("up", (inter, D)), ("down", (D, inter)))}


def attention_weights(prefix):
    return {prefix + "q_a_proj.weight": rand_q4(Q_LORA, D), prefix + "q_a_layernorm.weight": mx.ones((Q_LORA,), ACT),
            prefix + "q_b_proj.weight": rand_q4(H * (NOPE + ROPE), Q_LORA),
            prefix + "kv_a_proj_with_mqa.weight": rand_q4(KV_LORA + ROPE, D),
            prefix + "kv_a_layernorm.weight": mx.ones((KV_LORA,), ACT),
            prefix + "kv_b_proj.weight": rand_q4(H * (NOPE + V), KV_LORA),
            prefix + "o_proj.weight": rand_q4(D, H * V)}


def as_activation_dtype(module):
    """Float parameters (norm weights) in the activation dtype, as Model's loader casts them."""
    for name, value in vars(module).items():
        if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
            setattr(module, name, value.astype(ACT))
    return module


def table(weights):
    from colibri_mlx.models.loading import table_from_dict

    mx.eval([t.packed for t in weights.values() if isinstance(t, QTensor)] +
            [t.scales for t in weights.values() if isinstance(t, QTensor)] +
            [t for t in weights.values() if isinstance(t, mx.array)])
    return table_from_dict(weights)


def timeit(fn, iters, label=None):
    total, BUILD[label or fn.__qualname__] = median_times(fn, iters)
    if label:
        count_nodes(fn, label)
        if TIMELINE_ON:
            TIMELINE[label] = timeline(fn, iters)
    return total


BUILD: dict = {}
NODES: dict = {}
TIMELINE: dict = {}
TIMELINE_ON = False

# Primitives that only make views on MLX's GPU backends (no kernel launch).
VIEW_PRIMITIVES = {"Broadcast", "Reshape", "Squeeze", "ExpandDims", "Slice", "Transpose", "AsStrided",
                   "StopGradient", "Depends"}


def count_nodes(fn, label):
    """Primitives in one layer's graph (all, and those that launch a kernel), from mx.export_to_dot."""
    import re
    import tempfile

    outs = fn()
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *(outs if isinstance(outs, (list, tuple)) else [outs]))
        names = re.findall(r'label ="([^"]+)", shape=rectangle', f.read())
    launching = [n for n in names if n.split("(")[0].strip() not in VIEW_PRIMITIVES]
    NODES[label] = (len(names) / CHAIN, len(launching) / CHAIN)


def mlxlm_quantize(module):
    """mlx-lm's affine 4-bit g64 in bf16, one layer (Linear, SwitchLinear, Embedding) at a time:
    a whole model's float32 initial weights at once do not fit an 80 GB card (a 256-expert
    SwitchLinear alone is 15 GB)."""
    import mlx.nn as nn

    module.set_dtype(mx.bfloat16)
    for path in [p for p, m in module.named_modules() if hasattr(m, "to_quantized")]:
        nn.quantize(module, group_size=64, bits=4, class_predicate=lambda p, m, path=path: p == path)
        done = dict(module.named_modules())[path]
        assert not hasattr(done, "to_quantized"), f"mlx-lm quantize: {path} was not quantized"
        mx.eval(done.parameters())
    mx.eval(module.parameters())
    return module


# ------------------------------------------------------------------------------- MoE


def _routed(x, ids, weights, bank):
    return kernels.moe_block(x, bank, ids, weights)


# The chain as one compiled graph (one compiled call for every layer), against one compiled call a
# layer in the "_compiled" rows.
def _routed_chain(banks, *arrays):
    n = len(banks)
    return tuple(_routed(x, i, w, b) for b, x, i, w in zip(banks, arrays[:n], arrays[n:2 * n], arrays[2 * n:]))


def _moe_chain(blocks, *xs):
    return tuple(m.forward(x) for m, x in zip(blocks, xs))


def _mla_chain(layers, slot, *arrays):
    n = len(layers)
    steps = [a.step(x, slot, kv, p) for a, x, kv, p in zip(layers, arrays[:n], arrays[n:2 * n], arrays[2 * n:])]
    return (*[y for y, _ in steps], *[kv for _, kv in steps])


def bench_moe(args, results):
    from colibri_mlx.models.deepseek_v3 import MoE, ModelArgs
    from mlx_lm.models import deepseek_v3 as lm
    from mlx_lm.models.switch_layers import SwitchGLU

    E = args.experts
    margs = ModelArgs.from_config(config(experts=E))
    ours = [MoE(margs, table(moe_weights("mlp.", E)), "mlp.") for _ in range(CHAIN)]
    rng = np.random.default_rng(0)
    ids = [mx.array(rng.choice(E, (1, 8), replace=False).astype(np.int32)) for _ in range(CHAIN)]
    gw = [mx.array(rng.uniform(0.1, 1, (1, 8)).astype(np.float32)) for _ in range(CHAIN)]
    xs = [mx.random.normal((1, D)).astype(ACT) for _ in range(CHAIN)]  # as the model runs
    for m in ours:   # stack the banks before timing
        kernels.moe_block(xs[0], m.bank, ids[0], gw[0])  # the bank the block itself uses
    mx.eval([x for x in xs])

    t_ours_routed = timeit(lambda: [kernels.moe_block(xs[i], ours[i].bank, ids[i], gw[i]) for i in range(CHAIN)],
                           args.iters, "ours moe_routed") / CHAIN
    # The same launches as one compiled graph per layer, as the model's decode step runs them on
    # a GPU (kernels.compiled: no Python graph building per call after the trace).
    routed = [compiled.CompiledBlock(functools.partial(_routed, bank=m.bank), f"bench_routed{i}")
              for i, m in enumerate(ours)]
    static = kernels.moe.host_reason(xs[0], ours[0].bank, 8)     # the CPU reference reads ids
    t_ours_routed_c = timeit(lambda: [routed[i](xs[i], ids[i], gw[i], static=static) for i in range(CHAIN)],
                             args.iters, "ours moe_routed_compiled") / CHAIN
    routed_chain = compiled.CompiledBlock(functools.partial(_routed_chain, [m.bank for m in ours]), "bench_routed_chain")
    t_ours_routed_chain = timeit(lambda: routed_chain(*xs, *ids, *gw, static=static), args.iters,
                                 "ours moe_routed_chain") / CHAIN
    # The block takes [B, L, D] rows; made once, as for the routed rows (a view made inside the
    # timed call would be a graph node and Python work of the harness, not of the block).
    rows = [x[None] for x in xs]
    mx.eval(rows)
    t_ours_block = timeit(lambda: [ours[i](rows[i]) for i in range(CHAIN)], args.iters, "ours moe_block") / CHAIN
    moe_chain = compiled.CompiledBlock(functools.partial(_moe_chain, ours), "bench_moe_chain")
    block_static = ours[0].host_reason(rows[0])
    t_ours_block_chain = timeit(lambda: moe_chain(*rows, static=block_static), args.iters, "ours moe_block_chain") / CHAIN

    lm_args = lm.ModelArgs(**{k: v for k, v in config(experts=E).items() if k in lm.ModelArgs.__dataclass_fields__})
    switch = [mlxlm_quantize(SwitchGLU(D, INTER, E)) for _ in range(CHAIN)]
    xb = [x.astype(mx.bfloat16) for x in xs]

    def lm_routed():
        return [(switch[i](xb[i], ids[i]) * gw[i][..., None]).sum(-2) for i in range(CHAIN)]

    t_lm_routed = timeit(lm_routed, args.iters, "mlx-lm moe_routed") / CHAIN
    del switch
    lm_moe = [mlxlm_quantize(lm.DeepseekV3MoE(lm_args)) for _ in range(CHAIN)]
    xb_rows = [x[None] for x in xb]     # made once, as ours
    mx.eval(xb_rows)
    t_lm_block = timeit(lambda: [lm_moe[i](xb_rows[i]) for i in range(CHAIN)], args.iters, "mlx-lm moe_block") / CHAIN
    del lm_moe

    routed_bytes = 8 * 3 * (INTER * D // 2 + INTER * D // 64 * 4)
    block_bytes = routed_bytes + 3 * (INTER * D // 2 + INTER * D // 64 * 4) + E * D * 4
    results["moe_routed"] = dict(ours_us=t_ours_routed * 1e6, mlxlm_us=t_lm_routed * 1e6, bytes=routed_bytes,
                                 floor_us=routed_bytes / COPY_BW * 1e6)
    results["moe_routed_compiled"] = dict(ours_us=t_ours_routed_c * 1e6, mlxlm_us=t_lm_routed * 1e6,
                                          bytes=routed_bytes, floor_us=routed_bytes / COPY_BW * 1e6)
    results["moe_routed_chain"] = dict(ours_us=t_ours_routed_chain * 1e6, mlxlm_us=t_lm_routed * 1e6,
                                       bytes=routed_bytes, floor_us=routed_bytes / COPY_BW * 1e6)
    results["moe_block"] = dict(ours_us=t_ours_block * 1e6, mlxlm_us=t_lm_block * 1e6, bytes=block_bytes,
                                floor_us=block_bytes / COPY_BW * 1e6)
    results["moe_block_chain"] = dict(ours_us=t_ours_block_chain * 1e6, mlxlm_us=t_lm_block * 1e6, bytes=block_bytes,
                                      floor_us=block_bytes / COPY_BW * 1e6)
    del ours
    kernels.moe.clear_banks()


# ------------------------------------------------------------------------------- MLA


def bench_mla(args, results):
    from colibri_mlx.models.cache import LayerCache
    from colibri_mlx.models.deepseek_v3 import Attention, ModelArgs
    from colibri_mlx.models.rope import make_rope
    from mlx_lm.models import deepseek_v3 as lm
    from mlx_lm.models.cache import KVCache

    margs = ModelArgs.from_config(config())
    rope = make_rope(margs.rope, ROPE, margs.max_position_embeddings, True)
    ours = [as_activation_dtype(Attention(margs, table(attention_weights("a.")), "a.", 0)) for _ in range(CHAIN)]
    lm_args = lm.ModelArgs(**{k: v for k, v in config().items() if k in lm.ModelArgs.__dataclass_fields__})
    theirs = [mlxlm_quantize(lm.DeepseekV3Attention(lm_args)) for _ in range(CHAIN)]
    xb = [mx.random.normal((1, 1, D)).astype(mx.bfloat16) for _ in range(CHAIN)]
    # Ours runs bf16 activations and a bf16 latent cache on GPUs, like mlx-lm (float32 on the CPU
    # backend, where the reference path computes in float32: the --tiny smoke run).
    act = ACT
    xs = [x.astype(act) for x in xb]
    for T in args.cache:
        caches = []
        for _ in range(CHAIN):
            c = LayerCache()
            c.append("kv", mx.random.normal((1, T, KV_LORA + ROPE)).astype(act), 0)   # latent | rope key
            caches.append(c)
        cos, sin = rope.cos_sin(mx.array([[T]]))
        # No mask: a decode row of an unpadded sequence sees every key (what Model passes, and
        # mlx-lm's mask=None below).
        mx.eval([c.buffers for c in caches], cos, sin)
        pos = mx.array(T, dtype=mx.int32)   # what Model passes for one decode row (mx.fast.rope)
        t_ours = timeit(lambda: [ours[i](xs[i], cos, sin, None, caches[i], T, rope_offset=pos)[0] for i in range(CHAIN)],
                        args.iters, f"ours mla T{T}") / CHAIN
        # The same block as the model's decode step runs it on a GPU: one compiled graph a layer
        # over the cache's fixed-capacity buffers (Attention.decode_step; plain on the CPU).
        t_ours_c = timeit(lambda: [ours[i].decode_step(xs[i], caches[i], T, pos) for i in range(CHAIN)],
                          args.iters, f"ours mla T{T}_compiled") / CHAIN
        # The 8 layers as one compiled graph (the step params made once for all layers alike,
        # Attention.step_inputs).
        chain = compiled.CompiledBlock(functools.partial(_mla_chain, ours), f"bench_mla_chain_T{T}")

        def ours_chain():
            made = {}
            inputs = [ours[i].step_inputs(xs[i], caches[i], T, made) for i in range(CHAIN)]
            outs = chain(pos, *xs, *[kv for kv, _ in inputs], *[p for _, p in inputs])
            for c, kv in zip(caches, outs[CHAIN:]):
                c.buffers["kv"] = kv
            return list(outs[:CHAIN])

        t_ours_chain = timeit(ours_chain, args.iters, f"ours mla T{T}_chain") / CHAIN
        lm_caches = []
        for _ in range(CHAIN):
            c = KVCache()
            c.update_and_fetch(mx.random.normal((1, 1, T, KV_LORA)).astype(mx.bfloat16),
                               mx.random.normal((1, 1, T, ROPE)).astype(mx.bfloat16))
            lm_caches.append(c)
        mx.eval([c.state for c in lm_caches])

        def lm_step():
            for c in lm_caches:
                c.offset = T
            return [theirs[i](xb[i], mask=None, cache=lm_caches[i]) for i in range(CHAIN)]

        t_lm = timeit(lm_step, args.iters, f"mlx-lm mla T{T}") / CHAIN
        wbytes = sum(q.nbytes for q in (ours[0].q_a_proj, ours[0].q_b_proj, ours[0].kv_a_proj,
                                        ours[0].kv_b_proj, ours[0].o_proj))
        cache_bytes_ours = (T + 1) * (KV_LORA + ROPE) * act.size
        for key, t in ((f"mla_T{T}", t_ours), (f"mla_T{T}_compiled", t_ours_c), (f"mla_T{T}_chain", t_ours_chain)):
            results[key] = dict(ours_us=t * 1e6, mlxlm_us=t_lm * 1e6, weight_bytes=wbytes, cache_bytes=cache_bytes_ours,
                                floor_us=(wbytes + cache_bytes_ours) / COPY_BW * 1e6)
        del caches, lm_caches
    # Fixed cost: the same block at a 16-token cache is launches + weights, no attention work.
    results["mla_launch_note"] = "see mla_T16 (ours) minus its weight floor for the fixed per-launch share"


def bench_launch_cost(args, results):
    """Per-op cost of MLX dispatch: a chain of dependent tiny ops in one evaluation."""
    x = mx.zeros((8,))
    n = 200

    def chain():
        y = x
        for _ in range(n):
            y = y + 1
        return [y]

    results["tiny_op_us"] = timeit(chain, args.iters) / n * 1e6
    results.update(bench_commit_cost(args.iters))


def bench_commit_cost(iters: int, n: int = 64) -> dict:
    """What a launch costs when MLX commits after it. MLX's GPU backends commit (CUDA: launch the
    recorded graph; Metal: the command buffer) once the inputs recorded since the last commit pass
    MLX_MAX_MB_PER_BUFFER (CUDA sm_90: 1000 MB; Metal: 40-50 MB), and a resident weight counts
    in full every time it is an input: an MoE bank (8 layers of 64 experts here: 1.06 GB for
    gate_up) makes every launch reading it a commit. Two chains of n dependent 8-element
    gathers, from an 8-element table and from one of 1.2 GB (n commits): the difference a
    launch is the commit's host cost plus the GPU's wait for it."""
    small = mx.arange(8, dtype=mx.int32)
    big = mx.zeros((300 * 2**20,), dtype=mx.int32)   # 1.2 GB: past CUDA's and Metal's limits
    mx.eval(small, big)

    def gathers(table):
        def chain():
            y = mx.zeros((8,), dtype=mx.int32)
            for _ in range(n):
                y = mx.take(table, y)
            return [y]
        return chain

    out = {"gather_us": timeit(gathers(small), iters) / n * 1e6,
           "gather_commit_us": timeit(gathers(big), iters) / n * 1e6}
    del big
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cache", type=int, nargs="+", default=[16, 4096, 32768])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=["moe", "mla", "launch"], nargs="*", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke run of the script")
    ap.add_argument("--timeline", action="store_true",
                    help="also profile each row's evaluations (CUDA, PyTorch's profiler): host lead, GPU busy, gaps")
    args = ap.parse_args()
    global TIMELINE_ON
    TIMELINE_ON = args.timeline and kernels.backend() == "cuda"
    if args.tiny:
        shrink()
    results = {"backend": kernels.backend(), "experts_per_layer": args.experts}
    parts = args.only or ["launch", "moe", "mla"]
    for part in parts:
        t0 = time.perf_counter()
        {"moe": bench_moe, "mla": bench_mla, "launch": bench_launch_cost}[part](args, results)
        print(f"[{part}: {time.perf_counter() - t0:.0f} s]", flush=True)
    results["graph_build_s"] = dict(BUILD)
    results["counters"] = kernels.counters()
    print_table(results)
    if TIMELINE_ON:
        print_timelines(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"tiny op {results.get('tiny_op_us', float('nan')):.2f} us; gather {results.get('gather_us', float('nan')):.2f} us, "
          f"committed after each {results.get('gather_commit_us', float('nan')):.2f} us; {format_line()}")


def _labels(key: str) -> tuple[str, str]:
    """BUILD/NODES labels of a result row: 'moe_routed' -> 'ours moe_routed', 'mla_T16' -> 'ours mla T16'."""
    name = key.replace("_T", " T")
    return f"ours {name}", f"mlx-lm {name}"


def print_table(results):
    """Per layer: total (the method: graph building + evaluation), the Python graph-building part, the
    primitives that launch kernels, and launches x the tiny-op cost as the launch-overhead estimate."""
    tiny = results.get("tiny_op_us", float("nan"))
    print(f"{'per layer (chain of 8)':22s} {'ours us':>8s} {'build':>6s} {'nodes':>6s} {'launch':>7s} {'ovh us':>7s} "
          f"{'mlx-lm':>7s} {'build':>6s} {'launch':>7s} {'ratio':>6s} {'floor':>6s} {'BW frac':>7s}")
    for k, r in results.items():
        if not (isinstance(r, dict) and "ours_us" in r):
            continue
        lo, ll = _labels(k)
        bo, bl = BUILD.get(lo, float("nan")) * 1e6 / CHAIN, BUILD.get(ll, float("nan")) * 1e6 / CHAIN
        (ao, no), nl = NODES.get(lo, (float("nan"),) * 2), NODES.get(ll, (float("nan"),) * 2)[1]
        r.update(ours_build_us=bo, mlxlm_build_us=bl, ours_nodes=ao, ours_launches=no, mlxlm_launches=nl,
                 ours_launch_overhead_us=no * tiny)
        print(f"{k:22s} {r['ours_us']:8.1f} {bo:6.0f} {ao:6.1f} {no:7.1f} {no * tiny:7.0f} {r['mlxlm_us']:7.1f} {bl:6.0f} "
              f"{nl:7.1f} {r['mlxlm_us'] / r['ours_us']:6.2f} {r['floor_us']:6.1f} {r['floor_us'] / r['ours_us']:7.2f}")
    print("build = Python graph building per layer (inside 'us'); nodes = graph nodes per layer (views included: a "
          "compiled call recreates each); launch = primitives that launch a kernel per layer;"
          " ovh = launch x tiny-op cost (estimate of the launch-overhead share); ratio = mlx-lm / ours")


def print_timelines(results):
    """Per layer (an evaluation / CHAIN), medians under the profiler: where the wall time goes."""
    print(f"\nper layer under the profiler, us: wall = lead + busy + gaps + tail; lead = build + what MLX "
          f"encodes before its first commit")
    print(f"{'row':30s} {'wall':>7s} {'build':>6s} {'lead':>7s} {'busy':>7s} {'gaps':>6s} {'tail':>6s} {'kernels':>7s}")
    for label, got in TIMELINE.items():
        if got is None:
            print(f"{label:30s} no kernel records (CUPTI not available?)")
            continue
        med, by_name, _ = got
        results.setdefault("timeline", {})[label] = {k: v / CHAIN for k, v in med.items()}
        print(f"{label:30s} " + " ".join(f"{med.get(k, float('nan')) / CHAIN:{w}.1f}" for k, w in
                                          (("wall", 7), ("build", 6), ("lead", 7), ("busy", 7), ("gaps", 6), ("tail", 6),
                                           ("kernels", 7))))
        top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:8]
        print("    " + "; ".join(f"{n.replace('mlx::core::cu::', '')[:40]} {us / CHAIN:.1f}" for n, (us, _) in top))


def shrink():
    global D, INTER, H, Q_LORA, KV_LORA, NOPE, ROPE, V, CHAIN
    D, INTER, H, Q_LORA, KV_LORA, NOPE, ROPE, V, CHAIN = 256, 128, 4, 64, 64, 64, 32, 64, 2


def format_line():
    return kernels.format_counters()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""End-to-end decode of a random DeepSeek-V3-shaped model (4 layers: 1 dense + 3 MoE, 256
experts top-8, group-limited routing), ours (container fmt 4 g64 weights, kernels on) against
mlx-lm 0.32.2 (affine 4-bit g64, bf16), same process.

    PYTHONPATH=/root/site:/tmp/site:$PWD python3 scripts/bench/bench_e2e.py [--layers 4] [--steps 32]

ms/token = median over --steps greedy decode steps after a 16-token prompt (each step evaluated
and synchronized), after one unrecorded pass of as many steps for each model (warm-up). Floor = bytes a token must read (every resident weight used + 8 experts per
MoE layer + the latent cache) / 4.3 TB/s. Embeddings are bf16 tables (a row lookup, not read).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_moe_mla as B  # noqa: E402
from colibri_mlx import kernels  # noqa: E402
from colibri_mlx.formats.qtensor import QTensor  # noqa: E402


def our_model(cfg):
    from colibri_mlx.models.deepseek_v3 import Model, ModelArgs

    w = {"model.embed_tokens.weight": (mx.random.normal((cfg["vocab_size"], B.D)) * 0.02).astype(mx.bfloat16),
         "model.norm.weight": mx.ones((B.D,)), "lm_head.weight": B.rand_q4(cfg["vocab_size"], B.D)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = mx.ones((B.D,))
        w[p + "post_attention_layernorm.weight"] = mx.ones((B.D,))
        w.update(B.attention_weights(p + "self_attn."))
        if i < cfg["first_k_dense_replace"]:
            w.update(B.dense_mlp_weights(p + "mlp.", cfg["intermediate_size"]))
        else:
            w.update(B.moe_weights(p + "mlp.", cfg["n_routed_experts"]))
    return Model(ModelArgs.from_config(cfg), B.table(w))


def lm_model(cfg):
    from mlx_lm.models import deepseek_v3 as lm

    args = lm.ModelArgs(**{k: v for k, v in cfg.items() if k in lm.ModelArgs.__dataclass_fields__})
    return B.mlxlm_quantize(lm.Model(args))


def decode_times(step, prompt, steps):
    logits = step(prompt)
    mx.eval(logits)
    times = []
    tok = mx.argmax(logits[:, -1], axis=-1)
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = step(tok[:, None])
        tok = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(tok)
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:] if len(times) > 6 else times)


def decode_times_pipelined(step, prompt, steps):
    """Like mlx-lm's generate loop: step n+1's graph is built (and queued with async_eval) while step
    n runs, so Python graph building overlaps the GPU. Seconds between successive tokens, median."""
    tok = mx.argmax(step(prompt)[:, -1], axis=-1)
    mx.eval(tok)
    nxt = mx.argmax(step(tok[:, None])[:, -1], axis=-1)
    mx.async_eval(nxt)
    times, t_prev = [], time.perf_counter()
    for _ in range(steps):
        tok, nxt = nxt, mx.argmax(step(nxt[:, None])[:, -1], axis=-1)
        mx.async_eval(nxt)
        tok.item()          # wait for the token the user would see now
        t = time.perf_counter()
        times.append(t - t_prev)
        t_prev = t
    mx.eval(nxt)
    return statistics.median(times[3:] if len(times) > 6 else times)


def token_bytes(model, cfg, T):
    total = 0
    for layer in model.layers:
        a = layer.self_attn
        total += sum(q.nbytes for q in (a.q_a_proj, a.q_b_proj, a.kv_a_proj, a.kv_b_proj, a.o_proj))
        mlp = layer.mlp
        if hasattr(mlp, "router"):
            gate, up, down = mlp.experts[0]
            total += 8 * (gate.nbytes + up.nbytes + down.nbytes) + mlp.router.weight.nbytes
            total += sum(q.nbytes for q in (mlp.shared.gate, mlp.shared.up, mlp.shared.down))
        else:
            total += sum(q.nbytes for q in (mlp.gate, mlp.up, mlp.down))
        total += T * (B.KV_LORA + B.ROPE) * B.ACT.size
    return total + model.lm_head.nbytes


@contextlib.contextmanager
def env_set(name: str, value: str):
    """``name=value`` in the environment for a block of the run."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


@contextlib.contextmanager
def plain_graphs():
    """COLIBRI_COMPILE=0 for a block of the run (kernels.compiled: no traces kept or made)."""
    try:
        with env_set(kernels.compiled.ENV_VAR, "0"):
            yield
    finally:
        kernels.compiled.clear()


@contextlib.contextmanager
def earlier_step_ops():
    """The decode step's small ops unfused, for an A/B in one run (what the fused ops save):
    the cache row written by ``mx.slice_update`` at the slot (two launches, not one scatter);
    q_a's and the latent's norms and the rope key as three ops and a concat (not mla_rows), the
    norms on their strided slices (which MLX's rms_norm copies first); the residual adds as ops
    of their own (not in o_proj's / the MLP's last kernel); q's rope as an op of its own (not in
    mla_qabs); q_b's GEMV a launch of its own (not in mla_qb_qabs); bf16 logits cast to float32
    (not written as float32)."""
    from colibri_mlx.models import deepseek_v3 as model_file

    def rows(y, q_rows, qa_norm, kv_norm, eps, rope, offset, cache=None):   # the row comes back: the caller writes it
        R, lead = kv_norm.shape[0], y.shape[:-1]
        y = y.reshape(-1, y.shape[-1])
        k = rope.apply_fast(y[:, None, q_rows + R:], offset)[:, 0]
        return (mx.fast.rms_norm(y[:, :q_rows], qa_norm, eps).reshape(*lead, -1),
                mx.concatenate([mx.fast.rms_norm(y[:, q_rows:q_rows + R], kv_norm, eps), k], axis=-1).reshape(*lead, -1))

    qmatmul, mla_decode = kernels.qmatmul, kernels.mla_decode

    def separate_qmatmul(x, w, residual=None, out_dtype=None):
        y = qmatmul(x, w)
        y = y if residual is None else residual + y
        return y if out_dtype is None else y.astype(out_dtype)

    def routed_experts(x, experts, ids, weights, residual=None):
        y = kernels.moe_block(x, experts, ids, weights)
        return y if residual is None else residual + y

    def attention(q_nope, q_rope, *args, rope=None, rope_offset=None, q_proj=None, **kw):
        if q_proj is not None:        # q_b's GEMV as a launch of its own (not in mla_qb_qabs)
            _, _, kv_b, _, _, nope, v = args
            q_nope, q_rope = kernels.mla.project_queries(*q_proj, kernels.mla.heads_of(kv_b, nope, v), nope)
        if rope is not None:
            q_rope = rope.apply_fast(q_rope, rope_offset)
        return mla_decode(q_nope, q_rope, *args, **kw)

    names = ("write_row", "rms_norm", "routed_experts")
    saved = [getattr(model_file, n) for n in names] + [kernels.mla_rows]
    model_file.write_row = lambda buf, row, slot: mx.slice_update(buf, row, slot.reshape(1), axes=(1,))
    model_file.rms_norm = lambda x, w, eps: mx.fast.rms_norm(x, w, eps)
    model_file.routed_experts = routed_experts
    kernels.mla_rows, kernels.mla_decode, kernels.qmatmul = rows, attention, separate_qmatmul
    kernels.compiled.clear()
    try:
        yield
    finally:
        for n, f in zip(names, saved):
            setattr(model_file, n, f)
        kernels.mla_rows, kernels.mla_decode, kernels.qmatmul = saved[-1], mla_decode, qmatmul
        kernels.compiled.clear()


def add_model_args(ap):
    """The model options this script and profile_decode.py share."""
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke run of the script")


def model_config(args) -> dict:
    """The 1 dense + N MoE layer config of ``add_model_args``' options (``--tiny`` shrinks it)."""
    if args.tiny:
        B.shrink()
    cfg = B.config(n_layers=args.layers, experts=args.experts, first_dense=1, vocab=args.vocab)
    if args.tiny:
        cfg["intermediate_size"] = 256
    return cfg


def main():
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="skip the COLIBRI_COMPILE=0 and reference rows")
    args = ap.parse_args()
    cfg = model_config(args)
    prompt = mx.array(np.random.default_rng(0).integers(0, args.vocab, (1, 16)).astype(np.int32))
    res = {"backend": kernels.backend(), "layers": args.layers, "experts": args.experts}

    t0 = time.perf_counter()
    ours = our_model(cfg)
    # A first pass unrecorded, for each model alike: the first timed row of a fresh process ran
    # 10-15 % slower than the same row repeated at the end (H200, 2026-12-01: 2.36 / 2.04 ms),
    # which is warm-up (MLX's CUDA graph cache, allocator), not the model.
    cache = ours.make_cache()
    decode_times(lambda t: ours(t, cache), prompt, args.steps)
    cache = ours.make_cache()
    res["ours_ms"] = decode_times(lambda t: ours(t, cache), prompt, args.steps) * 1e3
    print(f"ours (kernels on): {res['ours_ms']:.2f} ms/token", flush=True)
    cache = ours.make_cache()
    res["ours_pipelined_ms"] = decode_times_pipelined(lambda t: ours(t, cache), prompt, args.steps) * 1e3
    with earlier_step_ops():                          # 37 launches a step more (4 layers)
        cache = ours.make_cache()
        res["ours_earlier_ops_ms"] = decode_times(lambda t: ours(t, cache), prompt, args.steps) * 1e3
        cache = ours.make_cache()
        res["ours_earlier_ops_pipelined_ms"] = decode_times_pipelined(lambda t: ours(t, cache), prompt,
                                                                      args.steps) * 1e3
    if not args.quick:
        with plain_graphs():              # the same kernels, every block built op by op each step
            cache = ours.make_cache()
            res["ours_uncompiled_ms"] = decode_times(lambda t: ours(t, cache), prompt, args.steps) * 1e3
        with kernels.force_reference():   # the pure-MLX reference path, same weights
            cache = ours.make_cache()
            res["ours_reference_ms"] = decode_times(lambda t: ours(t, cache), prompt, min(args.steps, 8)) * 1e3
    # the first row again, last: how far the rows drift between the start and end of the run
    cache = ours.make_cache()
    res["ours_again_ms"] = decode_times(lambda t: ours(t, cache), prompt, args.steps) * 1e3
    cache = ours.make_cache()
    res["ours_again_pipelined_ms"] = decode_times_pipelined(lambda t: ours(t, cache), prompt, args.steps) * 1e3
    res["bytes_per_token"] = token_bytes(ours, cfg, 16 + args.steps)
    res["floor_ms"] = res["bytes_per_token"] / B.COPY_BW * 1e3
    res["counters"] = kernels.counters()
    del ours, cache
    kernels.moe.clear_banks()
    mx.clear_cache()                      # ours' buffers back to the device before mlx-lm's model is made
    print(f"[ours: {time.perf_counter() - t0:.0f} s]", flush=True)

    from mlx_lm.models.cache import make_prompt_cache

    lm = lm_model(cfg)
    lm_cache = make_prompt_cache(lm)
    decode_times(lambda t: lm(t, cache=lm_cache), prompt, args.steps)
    lm_cache = make_prompt_cache(lm)
    print(f"ours floor {res['floor_ms']:.2f} ms; reference path {res.get('ours_reference_ms', float('nan')):.2f} "
          "ms/token", flush=True)
    res["mlxlm_ms"] = decode_times(lambda t: lm(t, cache=lm_cache), prompt, args.steps) * 1e3
    lm_cache = make_prompt_cache(lm)
    res["mlxlm_pipelined_ms"] = decode_times_pipelined(lambda t: lm(t, cache=lm_cache), prompt, args.steps) * 1e3
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    L = args.layers
    print(f"{'model':36s} {'ms/token':>9s} {'per layer':>9s} {'pipelined':>9s}")
    print(f"{'ours (kernels on)':36s} {res['ours_ms']:9.2f} {res['ours_ms'] / L:9.3f} {res['ours_pipelined_ms']:9.2f}")
    print(f"{'ours (earlier step ops: slice_update)':36s} {res['ours_earlier_ops_ms']:9.2f} "
          f"{res['ours_earlier_ops_ms'] / L:9.3f} {res['ours_earlier_ops_pipelined_ms']:9.2f}")
    if not args.quick:
        print(f"{'ours (COLIBRI_COMPILE=0)':36s} {res['ours_uncompiled_ms']:9.2f} {res['ours_uncompiled_ms'] / L:9.3f}")
        print(f"{'ours (COLIBRI_KERNELS=reference)':36s} {res['ours_reference_ms']:9.2f}")
    print(f"{'ours (kernels on, again: drift)':36s} {res['ours_again_ms']:9.2f} {res['ours_again_ms'] / L:9.3f} "
          f"{res['ours_again_pipelined_ms']:9.2f}")
    print(f"{'mlx-lm 0.32.2':36s} {res['mlxlm_ms']:9.2f} {res['mlxlm_ms'] / L:9.3f} {res['mlxlm_pipelined_ms']:9.2f}")
    print("ms/token: each step evaluated and synchronized before the next is built (PERF.md); pipelined: the next "
          "step is built while the GPU runs the current one (mlx-lm's generate loop); per layer includes the "
          "embedding/lm_head share")
    print(f"floor {res['floor_ms']:.2f} ms ({res['bytes_per_token'] / 1e6:.0f} MB/token at 4.3 TB/s); "
          f"ours at {res['floor_ms'] / res['ours_ms']:.0%} of the floor; mlx-lm/ours = {res['mlxlm_ms'] / res['ours_ms']:.2f}")


if __name__ == "__main__":
    main()

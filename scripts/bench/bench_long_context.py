#!/usr/bin/env python3
"""Decode at a long context: the cache row written in place (mla_rows_into) against the scatter
that wrote it before, on bench_e2e's model (4 layers, DeepSeek-V3-shaped), and mlx-lm 0.32.2
on the same model in the same process.

    PYTHONPATH=/root/site:/tmp/site:$PWD python3 scripts/bench/bench_long_context.py [--context 4096 32768]

Why: MLX keeps a submitted step's inputs alive until it has run and donates a buffer to an op only
when nothing else holds it, so with the scatter the next step's write can take the cache's buffer
in place only once this step has finished. A pipelined loop (the next step built and submitted
while this one runs, as `colibri generate` and mlx-lm's generate do) then copies every layer's
whole cache every step; mla_rows_into writes the row into the buffer itself (docs/kernels.md).

Method: the cache is filled to --context positions with random rows (no prefill: its
content does not change the time), then ms/token = median over --steps greedy decode steps, each
evaluated and synchronized, and the same pipelined (bench_e2e.decode_times_pipelined). Each
variant runs once unrecorded first. "buffer moved": whether any layer's buffer changed address
over a pipelined run (a copy; the cache does not grow during it; mlx-lm's KVCache writes its
rows with a slice update, which is in the same position as our scatter).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e as E  # noqa: E402
from colibri_mlx import kernels  # noqa: E402
from colibri_mlx.models.deepseek_v3 import CACHE_STREAM  # noqa: E402


@contextlib.contextmanager
def scatter_row_write():
    """The row written by the step's scatter (``write_row``), as before mla_rows_into: mla_rows
    hands the row back instead of writing it into the cache buffer."""
    rows = kernels.mla_rows

    def rows_without_cache(y, q_rows, qa_norm, kv_norm, eps, rope, offset, cache=None):
        return rows(y, q_rows, qa_norm, kv_norm, eps, rope, offset)

    kernels.mla_rows = rows_without_cache
    kernels.compiled.clear()
    try:
        yield
    finally:
        kernels.mla_rows = rows
        kernels.compiled.clear()


def cache_at(model, context: int, room: int):
    """Ours: a cache holding ``context`` positions of random rows, with room for ``room`` more."""
    from colibri_mlx.models.cache import capacity_for

    cache = model.make_cache()
    cache.set_left_padding(None, 1)
    width = model.layers[0].self_attn.kv_lora_rank + model.layers[0].self_attn.rope_dim
    rng = np.random.default_rng(0)
    rows = capacity_for(context + room)
    for layer_cache in cache.layers:
        layer_cache.buffers[CACHE_STREAM] = mx.array(rng.standard_normal((1, rows, width), np.float32)).astype(E.B.ACT)
    mx.eval([c.buffers for c in cache.layers])
    cache.advance(context)
    return cache


def lm_cache_at(model, context: int, room: int):
    """mlx-lm's: each layer's KVCache (keys: the latent [1, 1, T, R], values: the rope key) holding
    ``context`` positions of random rows, in buffers of its 256-row steps with room for more."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    rng = np.random.default_rng(0)
    rows = -(-(context + room) // 256) * 256
    for c in cache:
        c.keys = mx.array(rng.standard_normal((1, 1, rows, E.B.KV_LORA), np.float32)).astype(mx.bfloat16)
        c.values = mx.array(rng.standard_normal((1, 1, rows, E.B.ROPE), np.float32)).astype(mx.bfloat16)
        c.offset = context
    mx.eval([(c.keys, c.values) for c in cache])
    return cache


def address(a: mx.array) -> int:
    return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).__array_interface__["data"][0]


def ours_buffers(cache):
    return [c.buffers[CACHE_STREAM] for c in cache.layers]


def lm_buffers(cache):
    return [c.keys for c in cache] + [c.values for c in cache]


def run(step, make_cache, buffers, context: int, steps: int) -> dict:
    """Synchronized and pipelined ms/token of ``step(tokens, cache)`` from ``make_cache(context,
    room)``, and whether a buffer moved (was copied) over the pipelined run."""
    first = mx.array([[1]], dtype=mx.int32)    # one decode row: the first call is a decode step too
    out = {}
    for label, pipelined in (("sync", False), ("pipelined", True)):
        timer = E.decode_times_pipelined if pipelined else E.decode_times
        cache = make_cache(context, 2 * steps + 8)
        timer(lambda t: step(t, cache), first, steps)                      # unrecorded
        cache = make_cache(context, 2 * steps + 8)
        mx.synchronize()
        before = [address(b) for b in buffers(cache)]
        out[label] = timer(lambda t: step(t, cache), first, steps) * 1e3
        mx.synchronize()
        if pipelined:
            out["moved"] = [address(b) for b in buffers(cache)] != before
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    E.add_model_args(ap)
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--no-mlxlm", action="store_true")
    args = ap.parse_args()
    cfg = E.model_config(args)
    t0 = time.perf_counter()
    model = E.our_model(cfg)
    ours = lambda t, cache: model(t, cache)                                   # noqa: E731
    results = {}
    for context in args.context:
        results[context, "in place"] = run(ours, functools.partial(cache_at, model), ours_buffers, context, args.steps)
        with scatter_row_write():
            results[context, "scatter"] = run(ours, functools.partial(cache_at, model), ours_buffers, context,
                                              args.steps)
        print(f"[ours, context {context}: {time.perf_counter() - t0:.0f} s]", flush=True)
    del model
    kernels.moe.clear_banks()
    kernels.compiled.clear()
    if not args.no_mlxlm:
        lm = E.lm_model(cfg)
        theirs = lambda t, cache: lm(t, cache=cache)                          # noqa: E731
        for context in args.context:
            results[context, "mlx-lm"] = run(theirs, functools.partial(lm_cache_at, lm), lm_buffers, context,
                                             args.steps)
            print(f"[mlx-lm, context {context}: {time.perf_counter() - t0:.0f} s]", flush=True)
    print(f"{'context':>8s} {'model / row write':>20s} {'sync ms':>8s} {'pipelined ms':>13s} {'buffer moved':>13s}")
    for (context, label), r in sorted(results.items(), key=lambda kv: kv[0][0]):
        name = label if label == "mlx-lm" else f"ours, {label}"
        print(f"{context:8d} {name:>20s} {r['sync']:8.2f} {r['pipelined']:13.2f} {str(r['moved']):>13s}")
    print(f"backend {kernels.backend()}; fallbacks {kernels.counters()['fallbacks'] or 0}; a layer's cache at "
          f"{max(args.context)} positions: {max(args.context) * (E.B.KV_LORA + E.B.ROPE) * 2 / 1e6:.1f} MB in bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Decode at a long context: the cache row written in place (mla_rows_into) against the scatter
that wrote it before, on bench_e2e's model (4 layers, DeepSeek-V3-shaped, ours only).

    PYTHONPATH=/root/site:/tmp/site:$PWD python3 scripts/bench_long_context.py [--context 4096 32768]

Why: MLX keeps a submitted step's inputs alive until it has run and donates a buffer to an op only
when nothing else holds it, so with the scatter the next step's write can take the cache's buffer
in place only once this step has finished. A pipelined loop (the next step built and submitted
while this one runs, as `colibri generate` and mlx-lm's generate do) then copies every layer's
whole cache every step; mla_rows_into writes the row into the buffer itself (docs/kernels.md).

Method (PERF.md): the cache is filled to --context positions with random rows (no prefill: its
content does not change the time), then ms/token = median over --steps greedy decode steps, each
evaluated and synchronized, and the same pipelined (bench_e2e.decode_times_pipelined). Each
variant runs once unrecorded first. "buffer moved": whether any layer's buffer changed address
over a pipelined run (a copy; the cache does not grow during it).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

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
    """A cache holding ``context`` positions of random rows, with room for ``room`` more."""
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


def addresses(cache):
    return [np.asarray(c.buffers[CACHE_STREAM].view(mx.uint16) if c.buffers[CACHE_STREAM].dtype == mx.bfloat16 else c.buffers[CACHE_STREAM])
            .__array_interface__["data"][0] for c in cache.layers]


def run(model, context: int, steps: int) -> dict:
    first = mx.array([[1]], dtype=mx.int32)    # one decode row: the first call is a decode step too
    out = {}
    for label, pipelined in (("sync", False), ("pipelined", True)):
        timer = E.decode_times_pipelined if pipelined else E.decode_times
        cache = cache_at(model, context, 2 * steps + 8)
        timer(lambda t: model(t, cache), first, steps)                      # unrecorded
        cache = cache_at(model, context, 2 * steps + 8)
        mx.synchronize()
        before = addresses(cache)
        out[label] = timer(lambda t: model(t, cache), first, steps) * 1e3
        mx.synchronize()
        if pipelined:
            out["moved"] = addresses(cache) != before
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    E.add_model_args(ap)
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    cfg = E.model_config(args)
    t0 = time.perf_counter()
    model = E.our_model(cfg)
    rows = []
    for context in args.context:
        in_place = run(model, context, args.steps)
        with scatter_row_write():
            scatter = run(model, context, args.steps)
        rows.append((context, in_place, scatter))
        print(f"[context {context}: {time.perf_counter() - t0:.0f} s]", flush=True)
    width = model.layers[0].self_attn.kv_lora_rank + model.layers[0].self_attn.rope_dim
    print(f"{'context':>8s} {'write':>9s} {'sync ms':>8s} {'pipelined ms':>13s} {'buffer moved':>13s} "
          f"{'cache MB a layer':>17s}")
    for context, in_place, scatter in rows:
        mb = context * width * E.B.ACT.size / 1e6
        for label, r in (("in place", in_place), ("scatter", scatter)):
            print(f"{context:8d} {label:>9s} {r['sync']:8.2f} {r['pipelined']:13.2f} {str(r['moved']):>13s} {mb:17.1f}")
    print(f"backend {kernels.backend()}; counters: fallbacks {kernels.counters()['fallbacks'] or 0}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

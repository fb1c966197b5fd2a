#!/usr/bin/env python3
"""Serving throughput and latency: aggregate decode tok/s and time to first token at 1, 4, 8,
16 and 32 concurrent streams, colibri's BatchEngine against mlx-lm's BatchGenerator (0.32.2),
same model shape, same process.

    PYTHONPATH=$PWD python3 scripts/bench/bench_serve.py --out serve.json     # H200: the e2e model
    PYTHONPATH=$PWD python3 scripts/bench/bench_serve.py --tiny               # CPU smoke run
    PYTHONPATH=$PWD python3 scripts/bench/bench_serve.py --demo               # CPU: the demo model

Model: the random DeepSeek-V3-shaped model of bench_e2e.py (4 layers: 1 dense + 3 MoE, 256
experts top-8; ours container fmt 4 g64, mlx-lm affine 4-bit g64, bf16), or with ``--demo``
the bundled demo model (ours only: mlx-lm cannot read its container).

Method, per engine and concurrency c: c requests with distinct random prompts of ``--prompt``
tokens are submitted at once, each asking for ``--tokens`` tokens (no stop tokens). A first
unrecorded round at every concurrency, the same but for the prompts, warms kernels, compiled
graphs (one per batch size) and allocators. Per request the time of each token is recorded on
arrival (ours: by a thread per request reading its events, as a server's connections would).
  ttft: median over the c requests of (first token - submit);
  decode tok/s: tokens that arrive while all c streams decode (from the last first token to
    the first last token) / that window: the batch's steady aggregate;
  total tok/s: every token / (last token - submit), prefill included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def summarize(submit: float, times: list[list[float]]) -> dict:
    """The figures of one round from each stream's token arrival times (module docstring)."""
    firsts = [t[0] for t in times]
    lasts = [t[-1] for t in times]
    start, end = max(firsts), min(lasts)
    in_window = sum(1 for t in times for x in t if start < x <= end)
    if end - start > 0 and in_window >= len(times):
        decode = in_window / (end - start)
    else:   # a stream finished before the last one started: the whole run's tokens after the first
        decode = sum(len(t) - 1 for t in times) / max(max(lasts) - min(firsts), 1e-9)
    return {"streams": len(times), "tokens": sum(len(t) for t in times),
            "ttft_ms": statistics.median(f - submit for f in firsts) * 1e3,
            "ttft_max_ms": (max(firsts) - submit) * 1e3,
            "decode_tok_s": decode,
            "total_tok_s": sum(len(t) for t in times) / (max(lasts) - submit)}


ROUND_TIMEOUT = 120      # seconds a round may take before the engine is reported stuck


def run_ours(engine, prompts: list, n_tokens: int) -> dict:
    from colibri_mlx.generate import SamplingParams

    times = [[] for _ in prompts]
    errors = []
    submit = time.perf_counter()
    # submitted together, as mlx-lm's insert does: the batch sizes the engine goes through (one
    # compiled graph each) are then the same in the warm-up and the measured round
    handles = engine.submit_all([dict(prompt_ids=p, params=SamplingParams(), max_tokens=n_tokens) for p in prompts])

    def consume(i, h):
        try:
            for _ in h:
                times[i].append(time.perf_counter())
        except Exception as e:  # noqa: BLE001 (reported by the round)
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(i, h), daemon=True) for i, h in enumerate(handles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(ROUND_TIMEOUT - (time.perf_counter() - submit), 0))
    if errors:
        raise RuntimeError(f"a request failed: {errors[0]!r}") from errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"{len(prompts)} streams not done after {ROUND_TIMEOUT} s")
    return summarize(submit, times)


def run_mlx_lm(model, prompts: list, n_tokens: int, concurrency: int) -> dict:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=n_tokens, completion_batch_size=concurrency, prefill_batch_size=8)
    times: dict[int, list] = {}
    submit = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[n_tokens] * len(prompts))
    done = set()
    while len(done) < len(uids):
        for r in gen.next_generated():
            times.setdefault(r.uid, []).append(time.perf_counter())
            if r.finish_reason is not None:
                done.add(r.uid)
    gen.close()
    return summarize(submit, [times[u] for u in uids])


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [[int(v) for v in rng.integers(0, vocab, length)] for _ in range(n)]


def table(rows: list, name: str) -> str:
    one = rows[0]["decode_tok_s"]
    lines = [f"{name}", f"{'streams':>7s} {'decode tok/s':>12s} {'x 1 stream':>10s} {'total tok/s':>11s} "
                        f"{'ttft ms':>8s} {'ttft max':>8s}"]
    for r in rows:
        lines.append(f"{r['streams']:7d} {r['decode_tok_s']:12.1f} {r['decode_tok_s'] / one:10.2f} "
                     f"{r['total_tok_s']:11.1f} {r['ttft_ms']:8.1f} {r['ttft_max_ms']:8.1f}")
    return "\n".join(lines)


def main():
    import bench_e2e

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench_e2e.add_model_args(ap)
    ap.add_argument("--demo", action="store_true", help="the bundled demo model (ours only)")
    ap.add_argument("--streams", default="1,4,8,16,32")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--no-mlx-lm", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    from colibri_mlx import kernels
    from colibri_mlx.batch_engine import BatchEngine

    res = {"backend": kernels.backend(), "tokens": args.tokens, "prompt": args.prompt, "streams": streams}
    t0 = time.perf_counter()
    if args.demo:
        import colibri_mlx

        ours, _ = colibri_mlx.load()
        cfg = None
        vocab = ours.args.vocab_size
        res["model"] = "demo"
    else:
        cfg = bench_e2e.model_config(args)
        ours = bench_e2e.our_model(cfg)
        vocab = cfg["vocab_size"]
        res["model"] = {k: cfg[k] for k in ("num_hidden_layers", "n_routed_experts", "hidden_size", "vocab_size")}
    engine = BatchEngine(ours, None, decode_concurrency=max(streams), stop_ids=(), prompt_cache_entries=0)
    res["ours"] = []
    try:
        for c in streams:            # warm-up round: every row count's kernels built once
            run_ours(engine, make_prompts(c, args.prompt, vocab, seed=100 + c), args.tokens)
        for c in streams:
            r = run_ours(engine, make_prompts(c, args.prompt, vocab, seed=c), args.tokens)
            res["ours"].append(r)
            print(f"ours {c:3d} streams: {r['decode_tok_s']:8.1f} tok/s decode, ttft {r['ttft_ms']:.1f} ms",
                  flush=True)
    except Exception as e:  # noqa: BLE001 (mlx-lm's rows still run)
        res["ours_error"] = repr(e)
        print(f"ours FAILED: {e!r}", flush=True)
    engine.shutdown(timeout=10)
    res["ours_engine_stats"] = dict(engine.stats)
    res["counters"] = kernels.dispatch.counters()
    pooled = {k: v for k, v in res["counters"]["calls"].items() if k.startswith(("batch_decode", "compiled"))}
    print(f"ours engine: {res['ours_engine_stats']}; {pooled}; fallbacks: {res['counters']['fallbacks'] or 'none'}",
          flush=True)
    print(f"[ours: {time.perf_counter() - t0:.0f} s]", flush=True)
    if args.out:                  # ours kept even if mlx-lm's rows fail
        Path(args.out).write_text(json.dumps(res, indent=1))
    del ours, engine
    kernels.moe.clear_banks()
    mx.clear_cache()

    if not args.demo and not args.no_mlx_lm:
        t0 = time.perf_counter()
        lm = bench_e2e.lm_model(cfg)
        for c in streams:
            run_mlx_lm(lm, make_prompts(c, args.prompt, vocab, seed=100 + c), args.tokens, c)
        res["mlx_lm"] = []
        for c in streams:
            r = run_mlx_lm(lm, make_prompts(c, args.prompt, vocab, seed=c), args.tokens, c)
            res["mlx_lm"].append(r)
            print(f"mlx-lm {c:3d} streams: {r['decode_tok_s']:8.1f} tok/s decode, ttft {r['ttft_ms']:.1f} ms",
                  flush=True)
        print(f"[mlx-lm: {time.perf_counter() - t0:.0f} s]", flush=True)

    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    print()
    if res["ours"]:
        print(table(res["ours"], f"colibri BatchEngine ({res['backend']}, {args.prompt}-token prompts, "
                                 f"{args.tokens} tokens each)"))
    if "mlx_lm" in res:
        print(table(res["mlx_lm"], "mlx-lm BatchGenerator"))
        print("ours / mlx-lm decode: " + ", ".join(
            f"{o['streams']}: {o['decode_tok_s'] / m['decode_tok_s']:.2f}" for o, m in zip(res["ours"], res["mlx_lm"])))
    if res["ours"]:
        one = {r["streams"]: r["decode_tok_s"] for r in res["ours"]}
        if 1 in one and 8 in one:
            print(f"ours 8 streams / 1 stream: {one[8] / one[1]:.2f} (target >= 4)")


if __name__ == "__main__":
    main()

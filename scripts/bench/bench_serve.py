#!/usr/bin/env python3
"""Serving throughput and latency: aggregate decode tok/s and time to first token at 1, 4, 8,
16 and 32 concurrent streams, colibri's BatchEngine against mlx-lm's BatchGenerator (0.32.2),
same model shape, same process; with ``--http`` also through ``colibri serve``'s HTTP server
and the official ``openai`` client (what users see).

    PYTHONPATH=$PWD python3 scripts/bench/bench_serve.py --http --out serve.json   # H200: the e2e model
    PYTHONPATH=$PWD python3 scripts/bench/bench_serve.py --tiny --http             # CPU smoke run
    PYTHONPATH=$PWD python3 scripts/bench/bench_serve.py --demo --http             # CPU: the demo model
    PYTHONPATH=$PWD python3 scripts/bench/bench_serve.py --demo --drafts none,mtp,ngram --streams 1,2,4

Model: the random DeepSeek-V3-shaped model of bench_e2e.py (4 layers: 1 dense + 3 MoE, 256
experts top-8; ours container fmt 4 g64, mlx-lm affine 4-bit g64, bf16), or with ``--demo``
the bundled demo model (ours only: mlx-lm cannot read its container); its prompts are windows
of a text (bench_speculative.py's summarisation prompt, each request's window starting one
token later), random token ids otherwise.

``--drafts none,mtp,ngram``: the rounds of ours once per draft kind (the engine's default
draft for every request, BatchEngine's speculation inside the batch; ``mtp`` needs a model
with an MTP layer: the demo), each with its own warm-up, and each kind's decode tok/s against
the first kind's at every concurrency, with the drafts' acceptance.

Method, per engine and concurrency c: c requests with distinct random prompts of ``--prompt``
tokens are submitted at once, each asking for ``--tokens`` tokens (no stop tokens). A first
unrecorded round at every concurrency, the same but for the prompts, warms kernels, compiled
graphs (one per batch size) and allocators. Per request the time of each token is recorded on
arrival (ours: by a thread per request reading its events, as a server's connections would).
  ttft: median over the c requests of (first token - submit);
  decode tok/s: tokens that arrive while all c streams decode (from the last first token to
    the first last token) / that window: the batch's steady aggregate;
  total tok/s: every token / (last token - submit), prefill included.
With 1 in ``--streams``, the 1-stream prompt also runs through ``generate_tokens`` alone without
drafts (the loop of ``colibri generate``, pipelined the same way), in the main thread and in a
worker thread, after an unrecorded run of each: the engine's cost at one stream against the loop
it batches.

``--http``: the same rounds through a ModelServer (the engine of ``colibri serve``, its HTTP
layer and worker threads) in this process, and c streaming ``/v1/completions`` requests (prompts
as token ids) from c threads of a separate client process (spawned: its Python does not share
the server's interpreter lock), each token's time taken when its SSE chunk is parsed by the
``openai`` client. The server's tokenizer writes a token id as text ("123 "), so that every
token is one chunk of its own; the model's stop tokens are off as in the direct rounds.
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


def run_generate(model, prompt: list, n_tokens: int, in_thread: bool) -> dict:
    """One request through ``generate_tokens`` (what ``colibri generate`` runs), in this thread or
    a worker thread, timed as ``run_ours`` times a stream: the engine's 1-stream row against the
    loop it batches."""
    from colibri_mlx.generate import SamplingParams, generate_tokens

    times = []
    submit = time.perf_counter()

    def consume():
        for _ in generate_tokens(model, prompt, max_tokens=n_tokens, params=SamplingParams(), stop_ids=(),
                                 draft="none"):
            times.append(time.perf_counter())

    if in_thread:
        t = threading.Thread(target=consume, daemon=True)
        t.start()
        t.join(ROUND_TIMEOUT)
    else:
        consume()
    return summarize(submit, [times])


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


class IdTokenizer:
    """The server's tokenizer interface over bare ids: a token's text is its id and a space."""

    chat_template = None
    eos_token_ids = ()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def decode(self, ids) -> str:
        return "".join(f"{int(i)} " for i in ids)

    def detokenizer(self):
        return IdDetokenizer()


class IdDetokenizer:
    def add(self, token: int) -> str:
        return f"{int(token)} "

    def flush(self) -> str:
        return ""


def http_round(url: str, prompts: list, n_tokens: int) -> dict:
    """One round of streaming requests at once through the openai client (in the client process)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=ROUND_TIMEOUT)
    times, errors = [[] for _ in prompts], []
    start = threading.Barrier(len(prompts) + 1)

    def one(i):
        try:
            start.wait()
            for chunk in client.completions.create(model="bench", prompt=prompts[i], max_tokens=n_tokens,
                                                   stream=True):
                if chunk.choices and chunk.choices[0].text:
                    times[i].append(time.perf_counter())
        except Exception as e:  # noqa: BLE001 (reported by the round)
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    start.wait()
    submit = time.perf_counter()
    for t in threads:
        t.join(max(ROUND_TIMEOUT - (time.perf_counter() - submit), 0))
    if errors:
        raise RuntimeError(f"a request failed: {errors[0]}")
    if any(t.is_alive() for t in threads) or any(len(t) != n_tokens for t in times):
        raise TimeoutError(f"{len(prompts)} streams not done after {ROUND_TIMEOUT} s: "
                           f"{[len(t) for t in times]} tokens")
    return summarize(submit, times)


def run_http(model, vocab: int, streams: list, args, text=None) -> list:
    """The rounds of ``--http`` (module docstring): warm-up, then one measured round a concurrency."""
    import multiprocessing

    from colibri_mlx.batch_engine import BatchEngine
    from colibri_mlx.serve import ModelServer

    engine = BatchEngine(model, None, decode_concurrency=max(streams), stop_ids=(), prompt_cache_entries=0)
    server = ModelServer(("127.0.0.1", 0), model, IdTokenizer(vocab), "bench", log=None, engine=engine,
                         max_connections=max(64, 2 * max(streams)))
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    rows = []
    try:
        with multiprocessing.get_context("spawn").Pool(1) as clients:
            for c in streams:
                clients.apply(http_round, (server.url, make_prompts(c, args.prompt, vocab, 100 + c, text), args.tokens))
            for c in streams:
                r = clients.apply(http_round, (server.url, make_prompts(c, args.prompt, vocab, c, text), args.tokens))
                rows.append(r)
                print(f"http {c:3d} streams: {r['decode_tok_s']:8.1f} tok/s decode, ttft {r['ttft_ms']:.1f} ms",
                      flush=True)
    finally:
        server.shutdown()
        server.server_close()      # drains and closes the engine
        serving.join(10)
    return rows


def make_prompts(n: int, length: int, vocab: int, seed: int, text: list | None = None) -> list:
    """``n`` prompts of ``length`` tokens: random ids, or windows of ``text`` (token ids)."""
    if text is not None:
        start = seed % max(len(text) - length - n, 1)
        return [text[start + i: start + i + length] for i in range(n)]
    rng = np.random.default_rng(seed)
    return [[int(v) for v in rng.integers(0, vocab, length)] for _ in range(n)]


def ours_rounds(ours, streams: list, args, vocab: int, text, draft: str) -> tuple[list, dict]:
    """Warm-up and measured rounds of one BatchEngine (``draft``: every request's default)."""
    from colibri_mlx.batch_engine import BatchEngine

    engine = BatchEngine(ours, None, decode_concurrency=max(streams), stop_ids=(), prompt_cache_entries=0,
                         draft=draft)
    rows = []
    try:
        for c in streams:            # warm-up round: every row count's kernels built once
            run_ours(engine, make_prompts(c, args.prompt, vocab, 100 + c, text), args.tokens)
        before = dict(engine.stats)
        for c in streams:
            r = run_ours(engine, make_prompts(c, args.prompt, vocab, c, text), args.tokens)
            rows.append(r)
            print(f"ours {draft:5s} {c:3d} streams: {r['decode_tok_s']:8.1f} tok/s decode, ttft {r['ttft_ms']:.1f} ms",
                  flush=True)
    finally:
        engine.shutdown(timeout=10)
    stats = {k: v - before.get(k, 0) for k, v in engine.stats.items()} if rows else dict(engine.stats)
    return rows, stats


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
    ap.add_argument("--drafts", default="none", help="draft kinds of ours' rounds, compared with the first")
    ap.add_argument("--http", action="store_true", help="also through the HTTP server and the openai client")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    drafts = args.drafts.split(",")
    from colibri_mlx import kernels

    res = {"backend": kernels.backend(), "tokens": args.tokens, "prompt": args.prompt, "streams": streams}
    t0 = time.perf_counter()
    if args.demo:
        import colibri_mlx

        from bench_speculative import SUMMARY_PROMPT

        ours, tokenizer = colibri_mlx.load()
        cfg = None
        vocab = ours.args.vocab_size
        text = tokenizer.encode(SUMMARY_PROMPT * 4)
        res["model"] = "demo"
    else:
        cfg = bench_e2e.model_config(args)
        ours = bench_e2e.our_model(cfg)
        vocab = cfg["vocab_size"]
        text = None
        res["model"] = {k: cfg[k] for k in ("num_hidden_layers", "n_routed_experts", "hidden_size", "vocab_size")}
    res["ours"], res["drafts"] = [], {}
    for draft in drafts:
        try:
            rows, stats = ours_rounds(ours, streams, args, vocab, text, draft)
        except Exception as e:  # noqa: BLE001 (mlx-lm's rows still run)
            res["ours_error"] = repr(e)
            print(f"ours FAILED: {e!r}", flush=True)
            break
        res["drafts"][draft] = {"rows": rows, "engine_stats": stats}
        if draft == drafts[0]:
            res["ours"], res["ours_engine_stats"] = rows, stats
    if 1 in streams and res["ours"]:
        prompt = make_prompts(1, args.prompt, vocab, 1, text)[0]
        res["generate"] = {}
        for where, in_thread in (("main thread", False), ("worker thread", True)):
            run_generate(ours, prompt, args.tokens, in_thread)
            r = res["generate"][where] = run_generate(ours, prompt, args.tokens, in_thread)
            print(f"generate_tokens ({where}): {r['decode_tok_s']:8.1f} tok/s decode, ttft {r['ttft_ms']:.1f} ms",
                  flush=True)
    res["counters"] = kernels.dispatch.counters()
    pooled = {k: v for k, v in res["counters"]["calls"].items() if k.startswith(("batch_decode", "compiled"))}
    print(f"ours engine: {res.get('ours_engine_stats')}; {pooled}; fallbacks: {res['counters']['fallbacks'] or 'none'}",
          flush=True)
    print(f"[ours: {time.perf_counter() - t0:.0f} s]", flush=True)
    if args.http:
        t0 = time.perf_counter()
        try:
            res["http"] = run_http(ours, vocab, streams, args, text)
        except Exception as e:  # noqa: BLE001 (the other rows still run)
            res["http_error"] = repr(e)
            print(f"http FAILED: {e!r}", flush=True)
        print(f"[http: {time.perf_counter() - t0:.0f} s]", flush=True)
    if args.out:                  # ours kept even if mlx-lm's rows fail
        Path(args.out).write_text(json.dumps(res, indent=1))
    del ours
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
    if res.get("http"):
        print(table(res["http"], "colibri serve over HTTP (openai client, streaming)"))
    if "mlx_lm" in res:
        print(table(res["mlx_lm"], "mlx-lm BatchGenerator"))
        print("ours / mlx-lm decode: " + ", ".join(
            f"{o['streams']}: {o['decode_tok_s'] / m['decode_tok_s']:.2f}" for o, m in zip(res["ours"], res["mlx_lm"])))
    for draft in drafts[1:]:
        if draft not in res["drafts"]:
            continue
        got, st = res["drafts"][draft]["rows"], res["drafts"][draft]["engine_stats"]
        accepted = st["draft_accepted"] / max(st["draft_proposed"], 1)
        print(table(got, f"colibri BatchEngine, --draft {draft} ({100 * accepted:.0f}% of "
                         f"{st['draft_proposed']} drafts kept, {st['verify_steps']} verify steps)"))
        print(f"{draft} / {drafts[0]} decode: " + ", ".join(
            f"{o['streams']}: {o['decode_tok_s'] / b['decode_tok_s']:.2f}" for o, b in zip(got, res["ours"])))
    if res["ours"]:
        one = {r["streams"]: r["decode_tok_s"] for r in res["ours"]}
        if 1 in one and 8 in one:
            print(f"ours 8 streams / 1 stream: {one[8] / one[1]:.2f} (target >= 4)")
        for where, r in res.get("generate", {}).items():
            print(f"ours 1 stream / generate_tokens ({where}): {one[1] / r['decode_tok_s']:.2f}")


if __name__ == "__main__":
    main()

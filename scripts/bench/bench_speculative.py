#!/usr/bin/env python3
"""Speculative decoding: what a verify step costs, and what drafting gains end to end.

    PYTHONPATH=$PWD python3 scripts/bench/bench_speculative.py [--out spec.json] [--tiny] [--parts verify]

``COLIBRI_COMPILE`` (kernels/compiled.py) picks compiled decode blocks: ``auto`` on GPUs, ``1``
also on the CPU (every layer whose routing stays off the host: dense layers there), ``0`` never.

1. verify step: on the 4-layer DeepSeek-V3-shaped model of bench_e2e.py (random weights, fmt 4
   g64, kernels on), the median time of one forward step of 1 + K rows (K = 3: what a verify
   step of 3 drafts feeds) against a 1-row decode step, both after a 16-token prompt, each
   step evaluated and synchronized and its rows rolled back (the context stays 16 + rows);
   and the dispatch counters of one step of each (kernel calls per path, compiled replays
   included, and fallbacks).
2. decode tok/s of a model (the bundled demo model unless --model): greedy generation of
   --gen-tokens tokens with --draft none; mtp (when the model has an MTP layer) with the
   adaptive draft length (up to --num-draft) and with one draft; and ngram. Each after a warm-up run of the same length, the median of
   --repeats timed runs (generate_tokens' own timing); acceptance rate, drafts and tokens per
   verify step. Two prompts: an opening text, and a summarisation-style prompt (a passage,
   then a request to repeat its gist: where ngram finds its drafts).
3. greedy identity: every timed run of 2. gives the same tokens as --draft none (kernels on).
   A mismatch is printed and the script exits 1.

Prints a summary; --out writes every number as JSON. On the CPU the ratios are what counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from colibri_mlx import kernels  # noqa: E402

OPENING = "In the beginning God created the heaven and the earth."
PASSAGE = ("And it came to pass, when men began to multiply on the face of the earth, and daughters were born "
           "unto them, that the sons of God saw the daughters of men that they were fair; and they took them "
           "wives of all which they chose. And the LORD said, My spirit shall not always strive with man, for "
           "that he also is flesh: yet his days shall be an hundred and twenty years.")
SUMMARY_PROMPT = f"{PASSAGE}\n\nTell it again in short: {PASSAGE[:60]}"


def step_counts(model, cache, rows: mx.array) -> dict:
    """The dispatch counters of one forward step of ``rows`` (rolled back): calls per
    path/implementation, compiled replays included, and fallbacks."""
    start = cache.offset
    kernels.reset_counters()
    mx.eval(model(rows, cache))
    cache.offset = start
    counts = kernels.counters()
    return {"calls": counts["calls"], "fallbacks": counts["fallbacks"]}


def step_time(model, cache, rows: mx.array, steps: int) -> float:
    """Median seconds of a forward step of ``rows`` at a fixed context (rolled back each time)."""
    start = cache.offset
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(rows, cache)
        mx.eval(logits)
        mx.synchronize()
        times.append(time.perf_counter() - t0)
        cache.offset = start
    return statistics.median(times[2:] if len(times) > 4 else times)


def bench_verify(args, res):
    import bench_e2e as E

    cfg = E.model_config(argparse.Namespace(layers=args.layers, experts=args.experts, vocab=args.vocab,
                                            tiny=args.tiny))
    model = E.our_model(cfg)
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(0, cfg["vocab_size"], (1, 16)).astype(np.int32))
    cache = model.make_cache()
    mx.eval(model(prompt, cache))
    one = mx.array([[5]])
    many = mx.array([[5] + list(range(6, 6 + args.num_draft))])
    step_time(model, cache, one, 4)            # warm-up: traces, kernel compiles
    step_time(model, cache, many, 4)
    t1 = step_time(model, cache, one, args.steps)
    tk = step_time(model, cache, many, args.steps)
    counts_one, counts_many = step_counts(model, cache, one), step_counts(model, cache, many)
    res["verify"] = {"layers": args.layers, "rows": 1 + args.num_draft, "one_row_ms": t1 * 1e3,
                     "verify_ms": tk * 1e3, "ratio": tk / t1, "one_row_counts": counts_one,
                     "verify_counts": counts_many}
    print(f"verify step of 1+{args.num_draft} rows: {tk * 1e3:.2f} ms, 1-row step {t1 * 1e3:.2f} ms: "
          f"{tk / t1:.2f}x (target <= 1.3x on GPU)", flush=True)
    for name, counts in (("1-row step", counts_one), (f"1+{args.num_draft} verify step", counts_many)):
        calls = ", ".join(f"{k} {n}" for k, n in counts["calls"].items())
        print(f"  {name} calls: {calls}; fallbacks: {counts['fallbacks'] or 'none'}", flush=True)
    del model, cache
    kernels.moe.clear_banks()
    mx.clear_cache()


def generation(model, ids, n, draft, num_draft):
    from colibri_mlx.generate import generate_tokens

    tokens, stats = [], {}
    for t, stats in generate_tokens(model, ids, n, draft=draft, num_draft=num_draft):
        tokens.append(t)
    return tokens, stats


def decode_runs(num_draft: int) -> list:
    """(label, draft, num_draft) of each decode run."""
    return [("none", "none", num_draft), ("mtp", "mtp", num_draft), ("mtp-k1", "mtp", 1), ("ngram", "ngram", num_draft)]


def bench_decode(args, res):
    import colibri_mlx
    from colibri_mlx.models import DEMO_MODEL_DIR

    path = args.model or DEMO_MODEL_DIR
    model, tokenizer = colibri_mlx.load(path)
    has_mtp = bool(model.mtp_layers)
    out, mismatches, reference = {}, [], {}
    for prompt_name, text in (("opening", OPENING), ("summary", SUMMARY_PROMPT)):
        for label, draft, num_draft in decode_runs(args.num_draft):
            key = f"{prompt_name}/{label}"
            if draft == "mtp" and not has_mtp:
                out[key] = {"skipped": f"{path} has no MTP layer"}
                continue
            ids = tokenizer.encode(text)
            n = min(args.gen_tokens, model.max_length - len(ids))
            # Warm-up over the whole length: every row count a verify step can take and every
            # cache capacity the run grows through is traced and compiled before the timed runs.
            generation(model, ids, n, draft, num_draft)
            timed = [generation(model, ids, n, draft, num_draft) for _ in range(args.repeats)]
            rates = sorted(st["generation_tokens"] / max(st["generation_time"], 1e-9) for _, st in timed)
            tokens, stats = timed[0]
            row = {"tokens": len(tokens), "tok_s": statistics.median(rates), "tok_s_runs": rates,
                   "num_draft": num_draft}
            if draft != "none":
                steps = max(stats["draft_steps"], 1)
                row.update(acceptance=stats["draft_accepted"] / max(stats["draft_proposed"], 1),
                           tokens_per_step=(stats["draft_accepted"] + stats["draft_steps"]) / steps,
                           drafts_per_step=stats["draft_proposed"] / steps)
                want = reference[prompt_name]
                same = all(t == want for t, _ in timed)
                row["identical_to_none"] = same
                if not same:
                    first = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b),
                                 min(len(tokens), len(want)))
                    mismatches.append(f"{key}: first differs at token {first}")
            else:
                reference[prompt_name] = tokens
            out[key] = row
            print(f"  {key:18s} {row['tok_s']:8.1f} tok/s (runs {', '.join(f'{r:.1f}' for r in rates)})",
                  flush=True)
    for prompt_name in ("opening", "summary"):
        base = out[f"{prompt_name}/none"]["tok_s"]
        for label, *_ in decode_runs(args.num_draft)[1:]:
            row = out[f"{prompt_name}/{label}"]
            if "tok_s" in row:
                row["speedup"] = row["tok_s"] / base
    res["decode"] = {"model": path, "num_draft": args.num_draft, "runs": out}
    res["greedy_identity"] = {"ok": not mismatches, "mismatches": mismatches}
    print(f"decode, {path} (greedy, {args.gen_tokens} tokens, num_draft {args.num_draft}):")
    for key, row in out.items():
        if "skipped" in row:
            print(f"  {key:16s} skipped: {row['skipped']}")
            continue
        extra = (f"  {row['speedup']:.2f}x none, {100 * row['acceptance']:.0f}% accepted, "
                 f"{row['drafts_per_step']:.2f} drafts/step, {row['tokens_per_step']:.2f} tokens/step, "
                 f"identical: {row['identical_to_none']}" if "speedup" in row else "")
        print(f"  {key:18s} {row['tok_s']:8.1f} tok/s{extra}")
    print("greedy identity with drafts:", "ok" if not mismatches else "; ".join(mismatches), flush=True)
    return not mismatches


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes for the verify-step model (a CPU run)")
    ap.add_argument("--steps", type=int, default=24, help="timed steps per verify-step row")
    ap.add_argument("--num-draft", type=int, default=3)
    ap.add_argument("--model", default=None, help="model for the decode runs (default: the bundled demo)")
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per decode run (median tok/s)")
    ap.add_argument("--parts", default="verify,decode", help="which of verify, decode to run (comma-separated)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"verify", "decode"}:
        ap.error(f"--parts: expected verify and/or decode, got {args.parts!r}")
    res = {"backend": kernels.backend(), "compile": kernels.compiled.policy()}
    if "verify" in parts:
        bench_verify(args, res)
    ok = bench_decode(args, res) if "decode" in parts else True
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

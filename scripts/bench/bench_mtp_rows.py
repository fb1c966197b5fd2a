#!/usr/bin/env python3
"""The MTP drafting of a continuous batch: n requests' drafts through one MTP layer step a draft
(speculative.propose_rows / observe_rows: the layer over a row of each request, each on its own
cache) against each request's own MTPDraft (n steps a draft), on the bundled demo model.

    PYTHONPATH=$PWD python3 scripts/bench/bench_mtp_rows.py                  # CPU: ratios
    PYTHONPATH=$PWD python3 scripts/bench/bench_mtp_rows.py --requests 2 4 --drafts 3 1

Method: n drafters with their own caches, made from distinct prompts of the demo model. A round
is what a verify step of the batch engine does for them: ``observe`` of 1 + k rows each (the
rows a step keeps when every draft is accepted), then ``propose`` of k greedy drafts each,
evaluated. The pooled and the one-by-one rounds alternate (A/B pairs, the first pair dropped),
each drafter's caches rewound so that every round drafts from the same state; the figure is the
median time of a round and the ratio one-by-one / pooled within the run. Both give the same
drafts (checked on every pair).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import colibri_mlx  # noqa: E402
from colibri_mlx.models.deepseek_v3 import rms_norm  # noqa: E402
from colibri_mlx.speculative import MTPDraft, observe_rows, propose_rows  # noqa: E402


def drafters(model, n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p = [int(v) for v in rng.integers(4, model.args.vocab_size, 48)]
        cache = model.make_cache()
        x = model.hidden_states(mx.array([p]), cache)
        d = MTPDraft(model, cache)
        d.observe(rms_norm(x, model.norm, model.args.rms_norm_eps), p[1:] + [5])
        mx.eval(d.logits, d.x)
        out.append(d)
    return out


def greedy(logits, drafts):
    return mx.argmax(logits), None


def round_trip(ds: list, k: int, hidden: list, tokens: list, pooled: bool) -> tuple[float, list]:
    """One verify step's drafting for the drafters ``ds``; their caches rewound after."""
    starts = [d.cache.offset for d in ds]
    t0 = time.perf_counter()
    if pooled:
        observe_rows(ds, hidden, tokens)
        got = propose_rows(ds, [k] * len(ds), [greedy] * len(ds))
    else:
        for d, h, t in zip(ds, hidden, tokens):
            d.observe(h[None], t)
        got = [d.propose(k, greedy) for d in ds]
    drafts = [[int(t) for t in g] for g, _ in got]          # the host read of a verify step
    dt = time.perf_counter() - t0
    for d, s in zip(ds, starts):
        d.cache.offset = s
    return dt, drafts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--drafts", type=int, nargs="+", default=[3, 1], help="k of each row of --requests")
    ap.add_argument("--pairs", type=int, default=15)
    args = ap.parse_args()
    model, _ = colibri_mlx.load()
    D = model.args.hidden_size
    print(f"backend {mx.default_device()}, demo model, {args.pairs} A/B pairs", flush=True)
    print(f"{'requests':>8s} {'k':>2s} {'one by one ms':>14s} {'pooled ms':>10s} {'ratio':>6s}")
    for n, k in zip(args.requests, args.drafts):
        ds = drafters(model, n, seed=n)
        rng = np.random.default_rng(n)
        hidden = [mx.array(rng.standard_normal((1 + k, D)).astype(np.float32)).astype(model.dtype) for _ in ds]
        tokens = [[int(v) for v in rng.integers(4, model.args.vocab_size, 1 + k)] for _ in ds]
        alone, pooled = [], []
        for pair in range(args.pairs + 1):
            ta, da = round_trip(ds, k, hidden, tokens, pooled=False)
            tb, db = round_trip(ds, k, hidden, tokens, pooled=True)
            if da != db:
                raise SystemExit(f"{n} requests, k={k}: pooled drafts {db} differ from one by one {da}")
            if pair:
                alone.append(ta)
                pooled.append(tb)
        a, b = statistics.median(alone) * 1e3, statistics.median(pooled) * 1e3
        print(f"{n:8d} {k:2d} {a:14.2f} {b:10.2f} {a / b:5.2f}x", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Host time of one prompt-lookup draft (``--draft ngram``) as the context grows: the lookup
index the decoders keep (speculative.NgramIndex) against a scan of the whole context for the
latest earlier match (the lookup's definition, what the index must return).

    PYTHONPATH=$PWD python3 scripts/bench/bench_ngram.py [--contexts 512,4096,32768]

Contexts: random token ids (vocabulary 100k: no earlier match, the scan reads the whole context
three times) and text (the demo tokenizer's ids of bench_speculative.py's passage, repeated with
a counter: matches are near, as in a summary of its prompt). Each
figure is the median over 5 rounds of the mean of a round's lookups (k = 3); both methods must
give the same drafts. A host-side cost: it is the same on every backend.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def scan(seq: list, k: int, max_n: int = 3) -> list:
    for n in range(min(max_n, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        for i in range(len(seq) - n - 1, -1, -1):
            if seq[i:i + n] == tail:
                return seq[i + n:i + n + k]
    return []


def timed(fn, lookups: int) -> float:
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(lookups):
            fn()
        rounds.append((time.perf_counter() - t) / lookups)
    return statistics.median(rounds)


def contexts(length: int) -> dict:
    import colibri_mlx
    from bench_speculative import PASSAGE

    rng = np.random.default_rng(0)
    _, tok = colibri_mlx.load()
    text, i = [], 0
    while len(text) < length:
        text += tok.encode(f"{PASSAGE} ({i})")
        i += 1
    return {"random": [int(t) for t in rng.integers(0, 100_000, length)], "text": text[:length]}


def main():
    from colibri_mlx.speculative import NgramIndex

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="512,4096,32768")
    args = ap.parse_args()
    print(f"{'context':>8} {'tokens':>7} {'scan µs':>10} {'index µs':>9} {'scan/index':>10}")
    for length in (int(c) for c in args.contexts.split(",")):
        for name, seq in contexts(length).items():
            index = NgramIndex(seq)
            if index.drafts(3) != scan(seq, 3):
                sys.exit(f"{name} {length}: the index's drafts differ from the scan's")
            lookups = max(3, 20_000 // length)
            s = timed(lambda: scan(seq, 3), lookups) * 1e6
            x = timed(lambda: index.drafts(3), 200) * 1e6
            print(f"{name:>8} {length:7d} {s:10.1f} {x:9.1f} {s / x:9.0f}x", flush=True)


if __name__ == "__main__":
    main()

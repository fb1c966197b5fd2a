"""One rank of a distributed run (tests/test_distributed.py, scripts/bench/bench_distributed.py).

``python tests/dist_worker.py MODEL_DIR MODE OUT_JSON [N_TOKENS]`` under ``mlx.launch`` (or its
environment: MLX_RANK, MLX_HOSTFILE). Rank 0 writes the greedy tokens, the logits of the prompt
and of every generated token, and the per-rank statistics to OUT_JSON. Without the launch
environment it runs one process (the reference).
"""

import json
import os
import sys
import time

import mlx.core as mx
import numpy as np

from colibri_mlx import distributed
from colibri_mlx.models.loading import load_model

PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


def greedy(model, n_tokens):
    cache = model.make_cache()
    logits = model(mx.array([PROMPT]), cache=cache)
    rows = [np.array(logits[0].astype(mx.float32))]
    tokens = []
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        tok = int(mx.argmax(logits[0, -1]).item())
        tokens.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
        rows.append(np.array(logits[0].astype(mx.float32)))
    return tokens, np.concatenate(rows), time.perf_counter() - t0


def main():
    path, mode, out = sys.argv[1:4]
    n_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 32
    t0 = time.perf_counter()
    # DIST_WORKER_RAM_GB: stream each rank's experts with that budget per rank.
    ram_gb = float(os.environ["DIST_WORKER_RAM_GB"]) if os.environ.get("DIST_WORKER_RAM_GB") else None
    # DIST_WORKER_SHARD_ATTENTION=1: attention heads and the head sharded (tensor parallel).
    shard = os.environ.get("DIST_WORKER_SHARD_ATTENTION") == "1"
    # Ranks >= 1 serve rank 0 and exit inside setup.
    made = distributed.setup(path, mode, ram_gb=ram_gb, shard_attention=shard)
    if made is None:
        model, stats = load_model(path), None
    else:
        model, _ = made
    load_s = time.perf_counter() - t0
    if os.environ.get("DIST_WORKER_PAUSE"):
        # Loaded on every rank: the test now kills or stops a rank, then lets rank 0 go on.
        print("loaded", flush=True)
        sys.stdin.readline()
    tokens, logits, decode_s = greedy(model, n_tokens)
    usage_total = None
    if made is not None:
        stats = model.stats()
        store = model.expert_store
        if store is not None and store.record_usage:
            usage_total = int(store.usage.counts.sum())   # selections recorded for .coli_usage
        model.close()
    with open(out, "w") as f:
        json.dump({"tokens": tokens, "logits": logits.tolist(), "stats": stats, "usage_total": usage_total,
                   "load_s": load_s, "decode_s": decode_s}, f)


if __name__ == "__main__":
    main()

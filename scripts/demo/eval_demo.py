#!/usr/bin/env python3
"""Evaluate the demo checkpoint with transformers on CPU: held-out perplexity and samples.

    python scripts/demo/eval_demo.py --model .demo-data/hf --data .demo-data

Perplexity is the token-mean cross entropy over non-overlapping ``--seq``-token
windows of heldout.npy (the last 2% of the KJV, 2 Peter 3 to Revelation 22),
exactly as train_demo.py measures it, computed with the weights in ``--dtype``.

``--colibri DIR`` instead measures a colibri container (or checkpoint) through
colibri_mlx on MLX, e.g. the quantized demo container::

    python scripts/demo/eval_demo.py --colibri /tmp/demo_e8 --data .demo-data
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

PROMPTS = [
    "In the beginning",
    "And the LORD said unto Moses,",
    "Blessed are the",
    "And it came to pass, when the king",
    "The LORD is my shepherd;",
]


@torch.no_grad()
def heldout_loss(model, ids: np.ndarray, seq: int, batch: int = 16) -> tuple[float, int]:
    n = (ids.size - 1) // seq
    tokens = torch.from_numpy(ids.astype(np.int64))
    x, y = tokens[: n * seq].view(n, seq), tokens[1 : n * seq + 1].view(n, seq)
    total = 0.0
    for i in range(0, n, batch):
        logits = model(input_ids=x[i : i + batch]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), y[i : i + batch].flatten(), reduction="sum").item()
    return total / (n * seq), n * seq


def colibri_heldout_loss(path: Path, ids: np.ndarray, seq: int, batch: int = 8) -> tuple[float, int]:
    """The same windows through colibri_mlx's model (float32 logits on MLX)."""
    import mlx.core as mx

    from colibri_mlx.models import load_model

    model = load_model(str(path))
    n = (ids.size - 1) // seq
    x = ids[: n * seq].astype(np.int32).reshape(n, seq)
    y = ids[1 : n * seq + 1].astype(np.int64).reshape(n, seq)
    total = 0.0
    for i in range(0, n, batch):
        logits = model(mx.array(x[i : i + batch]))
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        logp = np.array(logp, dtype=np.float64)
        total -= np.take_along_axis(logp, y[i : i + batch, :, None], axis=-1).sum()
    return total / (n * seq), n * seq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path(".demo-data/hf"))
    ap.add_argument("--data", type=Path, default=Path(".demo-data"))
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-samples", action="store_true")
    ap.add_argument("--colibri", type=Path, help="measure this container through colibri_mlx instead")
    args = ap.parse_args()

    if args.colibri is not None:
        loss, n = colibri_heldout_loss(args.colibri, np.load(args.data / "heldout.npy"), args.seq)
        print(json.dumps({"model": str(args.colibri), "engine": "colibri_mlx", "seq": args.seq,
                          "heldout_tokens": n, "heldout_loss": round(loss, 4),
                          "heldout_ppl": round(math.exp(loss), 2)}, indent=2))
        return

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    loss, n = heldout_loss(model, np.load(args.data / "heldout.npy"), args.seq)
    result = {"model": str(args.model), "dtype": args.dtype, "seq": args.seq, "heldout_tokens": n,
              "heldout_loss": round(loss, 4), "heldout_ppl": round(math.exp(loss), 2), "samples": []}
    if not args.no_samples:
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids  # starts with <|bos|>
            greedy = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            sampled = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=True,
                                     temperature=0.8, top_k=40)
            result["samples"].append({
                "prompt": prompt,
                "greedy": tok.decode(greedy[0], skip_special_tokens=True),
                "sampled_t0.8_k40": tok.decode(sampled[0], skip_special_tokens=True),
            })
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Measure the demo model's MTP head: acceptance rate and expected tokens per verify step.

The container's main model and its ``out-mtp-*`` head are dequantized into float32 torch
modules (scripts/demo/train_mtp.py; the main model matches colibri_mlx's logits to ~2e-5).

* **Acceptance** on held-out text (heldout.npy, non-overlapping ``--seq`` windows): the head at
  position t (the main model's h_t, token t+1) against the main model's greedy token at t+1,
  i.e. the next-next token. Top-1 equality is what greedy verification accepts.
* **Speculative decoding, greedy, k = 1..3 drafts**: from ``--prompts`` held-out prompts of
  ``--prompt-len`` tokens, the main model's greedy continuation of ``--new-tokens`` tokens is
  the reference (speculation is lossless, so it is also the output). Each step drafts k tokens
  with the head applied recurrently (draft i+1 takes the head's own output at the previous
  position and draft i; the head's context holds its first-draft rows of every accepted
  position, as its cache does), accepts the longest prefix equal to the reference, plus the
  main model's own next token. Reported: draft acceptance (accepted / drafted) and tokens per
  verify step.

    python scripts/demo/eval_mtp.py --model colibri_mlx/demo --data .demo-data
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_mtp import DEMO_DIR, MTPHead, load_main_model, load_state, mtp_loss  # noqa: E402


def load_head(main, path: Path) -> MTPHead:
    """The stored MTP layer (``model.layers.<n>.*``, dequantized) as an :class:`MTPHead`."""
    from colibri_mlx.container import Container

    head = MTPHead(main)
    p = f"model.layers.{head.layer_idx}."
    ours = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "shared_head_norm.weight": "shared_head.norm.weight"}
    ours.update({"layer." + k: k for k in head.layer.state_dict()})
    state = head.state_dict()
    with Container(str(path)) as c:
        stored = load_state(c, {p + name: state[key] for key, name in ours.items()})
    head.load_state_dict({key: stored[p + name] for key, name in ours.items()})
    return head.eval()


@torch.no_grad()
def heldout_acceptance(head, main, ids: np.ndarray, seq: int) -> dict:
    n = (ids.size - 1) // seq
    windows = torch.from_numpy(ids[: n * seq].astype(np.int64)).view(n, seq)
    parts = [mtp_loss(head, main, windows[i : i + 4]) for i in range(0, n, 4)]
    weights = [len(windows[i : i + 4]) for i in range(0, n, 4)]
    soft, hard, agree = (float(np.average([float(p[k]) for p in parts], weights=weights)) for k in range(3))
    return {"windows": n, "positions": n * (seq - 2), "top1_acceptance": round(agree, 4),
            "ce_vs_main": round(soft, 4), "ce_vs_text_t+2": round(hard, 4)}


@torch.no_grad()
def speculate(head, main, prompt: torch.Tensor, new_tokens: int, k: int) -> tuple[int, int, int]:
    """Greedy speculative decoding against the reference continuation: (steps, drafted, accepted)."""
    P = prompt.numel()
    total = P + new_tokens + k + 1
    seq = main.generate(prompt[None], max_new_tokens=total - P, min_new_tokens=total - P, do_sample=False)[0]
    h = main.model(input_ids=seq[None]).last_hidden_state[0]  # causal: h[p] sees seq[:p+1] only
    n, steps, drafted, accepted = P, 0, 0, 0  # seq[:n] verified; seq[n] is the main model's next token
    while n < P + new_tokens:
        rows_h, rows_ids = list(h[:n]), list(seq[1 : n + 1])
        drafts = []
        for _ in range(k):
            x, logits = head(torch.stack(rows_h)[None], torch.stack(rows_ids)[None],
                             torch.arange(len(rows_ids))[None])
            drafts.append(int(logits[0, -1].argmax()))
            rows_h.append(x[0, -1])
            rows_ids.append(torch.tensor(drafts[-1]))
        a = 0
        while a < k and drafts[a] == int(seq[n + 1 + a]):
            a += 1
        steps, drafted, accepted, n = steps + 1, drafted + k, accepted + a, n + a + 1
    return steps, drafted, accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEMO_DIR)
    ap.add_argument("--data", type=Path, default=Path(".demo-data"))
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    main_model = load_main_model(args.model)
    head = load_head(main_model, args.model)
    ids = np.load(args.data / "heldout.npy")
    result = {"model": str(args.model), "heldout": heldout_acceptance(head, main_model, ids, args.seq),
              "greedy_speculation": []}
    # Prompts: evenly spaced held-out spans (the test books are never trained on).
    starts = np.linspace(0, ids.size - args.prompt_len - 1, args.prompts).astype(int)
    prompts = [torch.from_numpy(ids[s : s + args.prompt_len].astype(np.int64)) for s in starts]
    for k in (1, 2, 3):
        steps = drafted = accepted = 0
        for prompt in prompts:
            s, d, a = speculate(head, main_model, prompt, args.new_tokens, k)
            steps, drafted, accepted = steps + s, drafted + d, accepted + a
        result["greedy_speculation"].append({
            "k": k, "prompts": len(prompts), "new_tokens": args.new_tokens, "verify_steps": steps,
            "draft_acceptance": round(accepted / drafted, 4), "tokens_per_step": round((steps + accepted) / steps, 3)})
        print(json.dumps(result["greedy_speculation"][-1]), flush=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

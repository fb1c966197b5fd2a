#!/usr/bin/env python3
"""Train the demo model's multi-token-prediction (MTP) head on top of the frozen bundled model.

The main model is the bundled container itself (colibri_mlx/demo), dequantized into a
``transformers.DeepseekV3ForCausalLM`` in float32, so the head learns from exactly the hidden
states the engine computes (fmt 6 experts un-rotated, fmt 4/1 tensors dequantized). Nothing of
the main model is trained or rewritten.

The head follows vLLM's ``deepseek_mtp`` (docs/demo-model.md):

    h = main model's last hidden state after the final RMSNorm, at position t
    e = embed(token t+1)                      (zeroed at position 0)
    x = eh_proj(concat(enorm(e), hnorm(h)))   (eh_proj: [D, 2D], no bias)
    x = decoder layer (MLA + MoE, layer index num_hidden_layers, same positions)
    logits = lm_head(shared_head.norm(x))     (the main model's lm_head, shared)

and predicts token t+2. Its decoder layer starts as a copy of the main model's last layer,
``shared_head.norm`` as the final norm. The loss is the cross entropy against the main model's
own next-token distribution at position t+1 (what greedy verification accepts), on random
256-token windows of the training chapters (scripts/demo/prepare_demo_corpus.py). Routers'
correction biases stay as copied. CPU only, deterministic (seed, one thread pool, fixed steps).

    python scripts/demo/train_mtp.py --data .demo-data --out /tmp/mtp     # -> /tmp/mtp/hf
    colibri convert --indir /tmp/mtp/hf --outdir colibri_mlx/demo --mtp  # -> out-mtp-00000

The saved checkpoint holds only ``model.layers.<n>.*`` (bf16, router bias float32, released
per-expert naming) and a config.json with ``num_nextn_predict_layers: 1``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

DEMO_DIR = Path(__file__).resolve().parents[2] / "colibri_mlx" / "demo"


# ------------------------------------------------------------------ the frozen main model


def _unrotate(w_rot: np.ndarray) -> np.ndarray:
    """fmt 6 stores W @ Q (Q orthogonal): W = (W @ Q) @ Q^T, with Q = rotate_rows(I)."""
    from colibri_mlx.formats.e8 import rotate_rows

    q = rotate_rows(np.eye(w_rot.shape[1], dtype=np.float32))
    return (w_rot.astype(np.float64) @ q.astype(np.float64).T).astype(np.float32)


def container_matrix(container, name: str, shape) -> np.ndarray:
    """float32 values of one stored tensor, dequantized and un-rotated."""
    from colibri_mlx.formats.qtensor import QTensor

    t = container.tensor(name, shape)
    if isinstance(t, QTensor):
        w = t.dequantize()
        return _unrotate(w) if t.fmt == 6 else w
    return container.array(name, shape=shape)


def load_state(container, model_state: dict) -> dict:
    """HF state dict (fused in-memory expert layout) from a container's released-naming tensors."""
    out = {}
    for key, ref in model_state.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            base, (E, two_i, D) = key[: -len("gate_up_proj")], ref.shape
            out[key] = torch.from_numpy(np.stack([np.concatenate(
                [container_matrix(container, f"{base}{e}.{p}.weight", (two_i // 2, D)) for p in ("gate_proj", "up_proj")])
                for e in range(E)]))
        elif key.endswith("mlp.experts.down_proj"):
            base, (E, D, I) = key[: -len("down_proj")], ref.shape
            out[key] = torch.from_numpy(np.stack([container_matrix(container, f"{base}{e}.down_proj.weight", (D, I))
                                                  for e in range(E)]))
        else:
            out[key] = torch.from_numpy(container_matrix(container, key, tuple(ref.shape)))
    return out


def load_main_model(path: Path):
    """The container as a frozen float32 ``DeepseekV3ForCausalLM`` (sdpa attention, causal)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from colibri_mlx.container import Container

    cfg = json.loads((path / "config.json").read_text())
    config = DeepseekV3Config(**cfg)
    config._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(config).float().eval()
    with Container(str(path)) as c:
        model.load_state_dict(load_state(c, model.state_dict()))
    model.requires_grad_(False)
    return model


# ------------------------------------------------------------------ the MTP head


class MTPHead(torch.nn.Module):
    """vLLM deepseek_mtp: enorm/hnorm, eh_proj, one decoder layer, shared_head.norm; lm_head shared."""

    def __init__(self, main):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        config = main.config
        D, n = config.hidden_size, config.num_hidden_layers
        self.layer_idx = n
        self.enorm = DeepseekV3RMSNorm(D, config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(D, config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * D, D, bias=False)
        self.layer = DeepseekV3DecoderLayer(config, n)
        self.shared_head_norm = DeepseekV3RMSNorm(D, config.rms_norm_eps)
        # Start from the main model's last layer and final norm; eh_proj passes h through
        # (its hnorm half is the identity) plus a small random embedding half.
        self.layer.load_state_dict(main.model.layers[n - 1].state_dict())
        self.shared_head_norm.load_state_dict(main.model.norm.state_dict())
        with torch.no_grad():
            self.eh_proj.weight.normal_(0.0, 0.02)
            self.eh_proj.weight[:, D:] = torch.eye(D)
        self.layer.mlp.gate.e_score_correction_bias.requires_grad_(False)
        self._main = [main]  # not a submodule: frozen, not saved

    def forward(self, h: torch.Tensor, next_ids: torch.Tensor, position_ids: torch.Tensor):
        """h [B, L, D], next_ids [B, L] -> (x [B, L, D], logits [B, L, V]).

        When drafting recurrently, the rows past the first draft take the head's own output x
        at the previous position in place of h (vLLM's convention)."""
        main = self._main[0]
        e = main.model.embed_tokens(next_ids)
        e = torch.where((position_ids == 0)[..., None], torch.zeros_like(e), e)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))
        cos_sin = main.model.rotary_emb(x, position_ids)
        x = self.layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=cos_sin)
        if isinstance(x, tuple):
            x = x[0]
        return x, main.lm_head(self.shared_head_norm(x))

    def released_state(self) -> dict[str, torch.Tensor]:
        """``model.layers.<n>.*`` tensors in the released per-expert naming (bf16; router bias f32)."""
        p = f"model.layers.{self.layer_idx}."
        out = {p + "enorm.weight": self.enorm.weight, p + "hnorm.weight": self.hnorm.weight,
               p + "eh_proj.weight": self.eh_proj.weight, p + "shared_head.norm.weight": self.shared_head_norm.weight}
        for k, v in self.layer.state_dict().items():
            if k == "mlp.experts.gate_up_proj":
                inter = v.shape[1] // 2
                for e in range(v.shape[0]):
                    out[f"{p}mlp.experts.{e}.gate_proj.weight"] = v[e, :inter]
                    out[f"{p}mlp.experts.{e}.up_proj.weight"] = v[e, inter:]
            elif k == "mlp.experts.down_proj":
                for e in range(v.shape[0]):
                    out[f"{p}mlp.experts.{e}.down_proj.weight"] = v[e]
            else:
                out[p + k] = v
        return {k: (v.detach().float() if k.endswith("e_score_correction_bias") else v.detach().to(torch.bfloat16))
                .contiguous().clone() for k, v in out.items()}


# ------------------------------------------------------------------ training


def head_batch(main, windows: torch.Tensor):
    """Frozen main-model pass over [B, W] windows: post-norm h [B, W, D] and its next-token
    distribution log-probabilities [B, W, V]."""
    with torch.no_grad():
        h = main.model(input_ids=windows).last_hidden_state
        return h, F.log_softmax(main.lm_head(h), dim=-1)


def mtp_loss(head, main, windows: torch.Tensor):
    """Soft cross entropy of the head at t (inputs h_t, token t+1) against the main model's
    distribution at t+1; also the hard cross entropy against token t+2 and top-1 agreement."""
    B, W = windows.shape
    h, logp_main = head_batch(main, windows)
    pos = torch.arange(W - 2)[None].expand(B, -1)
    _, logits = head(h[:, : W - 2], windows[:, 1 : W - 1], pos)
    logp = F.log_softmax(logits.float(), dim=-1)
    target = logp_main[:, 1 : W - 1]
    soft = -(target.exp() * logp).sum(-1).mean()
    hard = F.nll_loss(logp.flatten(0, 1), windows[:, 2:].flatten())
    agree = (logp.argmax(-1) == target.argmax(-1)).float().mean()
    return soft, hard, agree


def lr_at(step: int, steps: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEMO_DIR, help="the frozen main model (a container)")
    ap.add_argument("--data", type=Path, default=Path(".demo-data"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--eval-windows", type=int, default=16, help="held-out windows for the final report")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    main_model = load_main_model(args.model)
    head = MTPHead(main_model)
    params = [p for p in head.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    train = torch.from_numpy(np.load(args.data / "train.npy").astype(np.int64))
    heldout = torch.from_numpy(np.load(args.data / "heldout.npy").astype(np.int64))
    gen = torch.Generator().manual_seed(args.seed)
    span = torch.arange(args.seq)

    args.out.mkdir(parents=True, exist_ok=True)
    log_f = open(args.out / "train_log.txt", "w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_f.write(msg + "\n")

    log(json.dumps({k: str(v) for k, v in vars(args).items()}))
    log(f"trainable parameters {sum(p.numel() for p in params)}")

    def evaluate(n_windows: int) -> dict:
        n = min(n_windows, (heldout.numel() - 1) // args.seq)
        windows = heldout[: n * args.seq].view(n, args.seq)
        with torch.no_grad():
            parts = [mtp_loss(head, main_model, windows[i : i + 4]) for i in range(0, n, 4)]
        soft, hard, agree = (float(np.mean([float(p[k]) for p in parts])) for k in range(3))
        return {"soft_ce": round(soft, 4), "ce_token_t+2": round(hard, 4), "top1_agreement": round(agree, 4)}

    log("before " + json.dumps(evaluate(args.eval_windows)))
    t0 = time.time()
    head.train()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        start = torch.randint(0, train.numel() - args.seq, (args.batch,), generator=gen)
        soft, hard, agree = mtp_loss(head, main_model, train[start[:, None] + span])
        opt.zero_grad(set_to_none=True)
        soft.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            log(f"step {step} soft_ce {soft.item():.4f} ce_t+2 {hard.item():.4f} agree {agree.item():.3f} "
                f"gnorm {gnorm.item():.2f} t {time.time() - t0:.0f}s")
    head.eval()
    report = {"steps": args.steps, "seconds": round(time.time() - t0, 1),
              "tokens_seen": args.steps * args.batch * (args.seq - 2), "heldout": evaluate(args.eval_windows)}
    log("report " + json.dumps(report))

    from safetensors.torch import save_file

    hf = args.out / "hf"
    hf.mkdir(exist_ok=True)
    tensors = head.released_state()
    name = "model-00001-of-00001.safetensors"
    save_file(tensors, str(hf / (name + ".tmp")), metadata={"format": "pt"})
    os.replace(hf / (name + ".tmp"), hf / name)
    config = json.loads((args.model / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (hf / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: name for k in sorted(tensors)}}, indent=1) + "\n")
    log(f"saved {hf} ({len(tensors)} tensors)")
    log_f.close()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Train the bundled demo model: a small DeepSeek-V3 (MLA + group-routed MoE) on the KJV.

Input is what scripts/demo/prepare_demo_corpus.py wrote (uint16 token ids in
``--data``). The model is ``transformers.DeepseekV3ForCausalLM`` with the
config in ``demo_config()``; the result is saved with ``save_pretrained`` in
bf16 (the router's ``e_score_correction_bias`` stays float32).

Training: AdamW, bf16 autocast, warmup + cosine decay whose progress is
max(step / max_steps, elapsed / time_budget), so a slower machine still ends
its schedule; residual dropout through hooks (the HF module has none);
DeepSeek-V3's auxiliary-loss-free balancing (the correction bias of each
router moves by ``--bias-rate`` towards equal expert load every step). A
validation slice of the training chapters picks the best evaluated state; the
held-out test slice (heldout.npy) is only reported.

Runs on CUDA (the H200, through the device tool) or, for a smoke test, on CPU::

    python scripts/demo/train_demo.py --data .demo-data --out /tmp/run --max-steps 20 --tiny
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def demo_config(vocab_size: int, bos_id: int, eos_id: int, tiny: bool = False) -> dict:
    """The demo architecture. Every matrix input width is a multiple of 64 (fmt 4/5 groups)
    and the routed experts' inputs (hidden 512, moe_intermediate 256) are multiples of 256,
    as the fmt-6 E8 codec requires."""
    cfg = dict(
        vocab_size=vocab_size, hidden_size=512, intermediate_size=1024,
        moe_intermediate_size=256, num_hidden_layers=4, first_k_dense_replace=1,
        num_attention_heads=8, num_key_value_heads=8,
        q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5,
        hidden_act="silu", max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_interleave=True,
        tie_word_embeddings=False, attention_bias=False, initializer_range=0.02,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=None,
    )
    if tiny:  # CPU smoke test: same structure, small widths
        cfg.update(hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
                   num_hidden_layers=3, q_lora_rank=64, kv_lora_rank=64, num_attention_heads=4,
                   num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2)
    return cfg


def grouped_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Routed experts as two grouped GEMMs over expert-sorted tokens, in bf16.

    Replaces the per-expert Python loop of the HF module for training speed; the
    weights stay float32 masters and are cast per call. Same maths as
    DeepseekV3Experts.forward."""
    n_tok, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=self.num_experts), 0, dtype=torch.int32)
    x = hidden_states[order // top_k].to(torch.bfloat16)
    gate_up = _grouped_mm(x, self.gate_up_proj.to(torch.bfloat16).transpose(1, 2), offs)
    gate, up = gate_up.chunk(2, dim=-1)
    y = _grouped_mm(self.act_fn(gate) * up, self.down_proj.to(torch.bfloat16).transpose(1, 2), offs)
    y = y.float() * top_k_weights.reshape(-1)[order, None].float()
    out = torch.empty_like(y).index_copy(0, order, y)
    return out.view(n_tok, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _grouped_mm(x, w, offs):
    if x.is_cuda:
        return torch._grouped_mm(x, w, offs=offs)
    # CPU smoke path: one GEMM per expert.
    outs, start = [], 0
    for e, end in enumerate(offs.tolist()):
        outs.append(x[start:end] @ w[e])
        start = end
    return torch.cat(outs)


def add_residual_dropout(model, p: float) -> None:
    """Dropout on every residual branch (attention and MLP outputs) and on the embeddings."""
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, module.training),) + tuple(output[1:])
        return F.dropout(output, p, module.training)

    model.model.embed_tokens.register_forward_hook(hook)
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


class LoadBalancer:
    """DeepSeek-V3 auxiliary-loss-free balancing: count each router's expert picks in the
    step and nudge its e_score_correction_bias towards the mean load."""

    def __init__(self, model, rate: float):
        self.rate = rate
        self.routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        self.counts = {id(r): None for r in self.routers}
        for r in self.routers:
            r.register_forward_hook(self._count)

    def _count(self, router, args, output):
        if router.training:
            c = torch.bincount(output[2].reshape(-1), minlength=router.num_experts).float()
            prev = self.counts[id(router)]
            self.counts[id(router)] = c if prev is None else prev + c

    @torch.no_grad()
    def step(self) -> float:
        """Update the biases; return the worst max/mean load ratio of the step."""
        worst = 0.0
        for r in self.routers:
            c = self.counts[id(r)]
            if c is None:
                continue
            r.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
            worst = max(worst, (c.max() / c.mean()).item())
            self.counts[id(r)] = None
        return worst


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    span = torch.arange(seq + 1, device=data.device)
    while True:
        start = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen, device="cpu")
        window = data[start.to(data.device)[:, None] + span]
        yield window[:, :-1], window[:, 1:]


@torch.no_grad()
def mean_loss(model, data: torch.Tensor, seq: int, device, batch: int = 64) -> float:
    """Token-mean cross entropy over non-overlapping windows (context restarts at each)."""
    model.eval()
    n = (data.numel() - 1) // seq
    x = data[: n * seq].view(n, seq)
    y = data[1 : n * seq + 1].view(n, seq)
    total = 0.0
    for i in range(0, n, batch):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x[i : i + batch].to(device)).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), y[i : i + batch].to(device).flatten(),
                                 reduction="sum").item()
    model.train()
    return total / (n * seq)


def lr_at(progress: float, base: float, warmup: float, floor: float) -> float:
    if progress < warmup:
        return base * progress / warmup
    t = min(1.0, (progress - warmup) / (1.0 - warmup))
    return base * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t)))


def split_validation(train: np.ndarray, eos_id: int, every: int):
    """Take every `every`-th document (they end in eos) out of the training ids for validation."""
    ends = np.flatnonzero(train == eos_id) + 1
    starts = np.concatenate([[0], ends[:-1]])
    docs = [train[s:e] for s, e in zip(starts, ends)]
    val = [d for i, d in enumerate(docs) if i % every == every // 2]
    keep = [d for i, d in enumerate(docs) if i % every != every // 2]
    return np.concatenate(keep), np.concatenate(val)


# Keys of the released DeepSeek-V3 config.json that other readers (mlx-lm, colibri) look
# for and that transformers 5 does not write. The MTP head is trained afterwards on the frozen
# model (train_mtp.py), which sets num_nextn_predict_layers to 1.
CONFIG_EXTRAS = {
    "num_nextn_predict_layers": 0, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "rope_theta": 10000.0, "rope_scaling": None,
}


def patch_config(path: Path) -> None:
    cfg = json.loads(path.read_text())
    cfg.update(CONFIG_EXTRAS)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path(".demo-data"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1.2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=float, default=0.05, help="fraction of the schedule")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--max-steps", type=int, default=800)
    ap.add_argument("--time-budget", type=float, default=240.0, help="seconds of training")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--val-every-doc", type=int, default=64)
    ap.add_argument("--shard", default="16MB", help="max shard size (device tool: 8 files back)")
    ap.add_argument("--tiny", action="store_true", help="small widths for a CPU smoke test")
    args = ap.parse_args()

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    import transformers

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    corpus = json.loads((args.data / "corpus.json").read_text())
    train_np, val_np = split_validation(np.load(args.data / "train.npy"), corpus["eos_id"], args.val_every_doc)
    test_np = np.load(args.data / "heldout.npy")
    to_t = lambda a: torch.from_numpy(a.astype(np.int64))
    train, val, test = to_t(train_np).to(device), to_t(val_np), to_t(test_np)

    cfg = DeepseekV3Config(**demo_config(corpus["vocab_size"], corpus["bos_id"], corpus["eos_id"], args.tiny))
    model = DeepseekV3ForCausalLM(cfg).to(device)
    model.config.use_cache = False
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            experts = layer.mlp.experts
            experts.forward = grouped_experts_forward.__get__(experts)
    if args.dropout > 0:
        add_residual_dropout(model, args.dropout)
    balancer = LoadBalancer(model, args.bias_rate)
    n_params = sum(p.numel() for p in model.parameters())

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")

    args.out.mkdir(parents=True, exist_ok=True)
    log_f = open(args.out / "train_log.txt", "w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_f.write(msg + "\n")
        log_f.flush()

    log(f"torch {torch.__version__} transformers {transformers.__version__} device {device} "
        f"params {n_params} train_tokens {train.numel()} val_tokens {val.numel()} test_tokens {test.numel()}")
    log(json.dumps({k: v for k, v in vars(args).items()}, default=str))

    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train, args.batch, args.seq, gen)
    model.train()
    best = (float("inf"), -1, None)
    t0 = time.time()
    step, ema = 0, None
    while True:
        progress = max(step / args.max_steps, (time.time() - t0) / args.time_budget)
        if progress >= 1.0:
            break
        lr = lr_at(progress, args.lr, args.warmup, args.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = next(data)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imbalance = balancer.step()
        step += 1
        li = loss.item() if step % 10 == 0 or step < 10 else None
        if li is not None:
            ema = li if ema is None else 0.9 * ema + 0.1 * li
        if step % 50 == 0 or step <= 3:
            log(f"step {step} loss {loss.item():.4f} ema {ema:.4f} lr {lr:.2e} gnorm {gnorm.item():.2f} "
                f"maxload/mean {imbalance:.2f} t {time.time() - t0:.1f}s")
        if step % args.eval_every == 0:
            v = mean_loss(model, val, args.seq, device)
            log(f"eval step {step} val_loss {v:.4f} val_ppl {math.exp(v):.2f}")
            if v < best[0]:
                best = (v, step, {k: t.detach().clone() for k, t in model.state_dict().items()})

    elapsed = time.time() - t0
    v = mean_loss(model, val, args.seq, device)
    log(f"end step {step} val_loss {v:.4f} ({elapsed:.1f}s, {step / elapsed:.2f} steps/s, "
        f"{step * args.batch * args.seq / elapsed:.0f} tok/s)")
    if best[2] is not None and best[0] < v:
        log(f"restoring best validation state from step {best[1]} (val_loss {best[0]:.4f})")
        model.load_state_dict(best[2])
    else:
        best = (v, step, None)
    train_probe = train[: test.numel()].cpu()
    report = {
        "params": n_params, "steps": step, "selected_step": best[1], "seconds": round(elapsed, 1),
        "tokens_seen": step * args.batch * args.seq,
        "train_loss": mean_loss(model, train_probe, args.seq, device),
        "val_loss": mean_loss(model, val, args.seq, device),
        "heldout_loss": mean_loss(model, test, args.seq, device),
        "biases": [r.e_score_correction_bias.abs().max().item() for r in balancer.routers],
    }
    report["heldout_ppl"] = math.exp(report["heldout_loss"])
    log("report " + json.dumps(report))

    out_model = copy.deepcopy(model).to(torch.bfloat16)
    for r_src, layer in zip(balancer.routers, [l for l in out_model.model.layers if hasattr(l.mlp, "gate")]):
        layer.mlp.gate.e_score_correction_bias = r_src.e_score_correction_bias.detach().float().clone()
    out_model.config.use_cache = True
    out_model.save_pretrained(args.out / "hf", safe_serialization=True, max_shard_size=args.shard)
    patch_config(args.out / "hf" / "config.json")
    log("saved " + " ".join(sorted(os.listdir(args.out / "hf"))))
    log_f.close()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Decode speed on mlx-lm checkpoints: ours (colibri_mlx.load, kernels on) against mlx-lm 0.32.2 on
the same files, same process; the model of bench_e2e.py (1 dense + 3 MoE layers, 256 experts top-8)
written by mlx-lm's own quantization and ``save_model`` as affine 4-bit g64, affine 3-bit g64 and
mxfp4 checkpoints.

    PYTHONPATH=$PWD python3 scripts/bench/bench_mlx_lm_checkpoint.py [--formats affine4g64,affine3g64,mxfp4]
        [--steps 32] [--greedy 64] [--out result.json] [--tiny] [--dir DIR [--reuse]]

Per format: ms/token as bench_e2e.py (median of --steps greedy decode steps after a 16-token prompt,
each step evaluated and synchronized; one unrecorded pass first); then --greedy greedy tokens with
the kernels on against the pure-MLX reference (``kernels.force_reference``) on the same loaded
weights: identical or not, and the kernels' dispatch counters (a declined kernel shows as a
fallback). mlx-lm's model is loaded from the same directory (``mlx_lm.utils.load_model``) after
ours is released. ``--tiny``: tiny shapes, a CPU smoke run (CPU figures are ratios of CPU paths).

Token 0 is also computed with the 16-token prompt fed one token at a time from an empty cache
(every call a decode step, the first at offset 0), kernels and reference in lockstep: each step's
largest logit difference, the first step past 5e-2 of the largest logit, and each side's last
step against its own prefill (which side leaves the prompt's logits). Per format the seconds of
each phase are printed (write, our load, our timing, checks, mlx-lm's load and timing). Last, ours
on the same model as a colibri fmt 4 g64 container (bench_e2e.py's), timed the same way
(``--no-container`` skips it): each checkpoint's time against the container's.
``--dir DIR --reuse``: a checkpoint already in DIR/<format> with the same config.json is used as
it is and kept (a second run skips the write).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

import bench_e2e as E  # noqa: E402
from colibri_mlx import kernels  # noqa: E402
from colibri_mlx.kernels import dispatch  # noqa: E402

FORMATS = {"affine4g64": ("affine", 4, 64), "affine3g64": ("affine", 3, 64), "mxfp4": ("mxfp4", 4, 32),
           "affine8g64": ("affine", 8, 64), "affine2g64": ("affine", 2, 64), "nvfp4": ("nvfp4", 4, 16),
           "mxfp8": ("mxfp8", 8, 32)}


def write_checkpoint(cfg: dict, mode: str, bits: int, gs: int, path: Path) -> None:
    """A random mlx-lm deepseek_v3 model, quantized by mlx-lm one module at a time (bf16 scales), saved
    as mlx-lm saves it (weights + config.json with its quantization dict)."""
    import mlx.nn as nn
    from mlx_lm.models import deepseek_v3 as lm
    from mlx_lm.utils import save_config, save_model

    args = lm.ModelArgs(**{k: v for k, v in cfg.items() if k in lm.ModelArgs.__dataclass_fields__})
    model = lm.Model(args)
    model.set_dtype(mx.bfloat16)
    for p in [p for p, m in model.named_modules() if hasattr(m, "to_quantized")]:
        nn.quantize(model, group_size=gs, bits=bits, mode=mode, class_predicate=lambda q, m, p=p: q == p)
        mx.eval(dict(model.named_modules())[p].parameters())
    save_model(path, model, donate_model=True)
    config = dict(cfg, model_type="deepseek_v3", quantization={"group_size": gs, "bits": bits, "mode": mode})
    config["quantization_config"] = config["quantization"]
    save_config(config, path / "config.json")


def greedy(model, prompt, n, logits_out=None):
    """``n`` greedy tokens after ``prompt``; ``logits_out``: a list that gets each step's float32
    logits (numpy) appended."""
    cache, x, out = model.make_cache(), prompt, []
    for _ in range(n):
        logits = model(x, cache)[:, -1]
        tok = mx.argmax(logits, axis=-1)
        out.append(int(tok.item()))
        if logits_out is not None:
            logits_out.append(np.array(logits[0].astype(mx.float32)))
        x = tok[:, None]
    return out


def bf16_ulp(v: float) -> float:
    """The spacing of bfloat16 values at magnitude ``v`` (8 significant bits)."""
    return float(2.0 ** (np.floor(np.log2(abs(v))) - 7)) if v else 0.0


def first_difference_report(tokens, reference, mine_logits, ref_logits):
    """At the first token where the kernels' greedy run leaves the reference's (same context up
    to there): both runs' top-2 margins, each run's preference between the two tokens, the largest
    logit difference, and the bfloat16 rounding step of the largest logit. A reference margin below
    that step is a near-tie that bfloat16 activations can flip; a margin well above it, with the
    kernels' logits far from the reference's, points at a defect."""
    i = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    if i is None:
        return None
    mine, ref = mine_logits[i], ref_logits[i]
    a, b = reference[i], tokens[i]
    ms, rs = np.sort(mine), np.sort(ref)
    ulp = bf16_ulp(float(np.abs(ref).max()))
    return {"index": i, "reference_token": a, "kernel_token": b,
            "ref_top2_margin": float(rs[-1] - rs[-2]), "kernel_top2_margin": float(ms[-1] - ms[-2]),
            "ref_prefers_by": float(ref[a] - ref[b]), "kernel_prefers_by": float(mine[b] - mine[a]),
            "max_abs_logit_diff": float(np.abs(mine - ref).max()),
            "rel_logit_diff": float(np.abs(mine - ref).max() / np.abs(ref).max()),
            "bf16_ulp_of_max_logit": ulp, "near_tie": bool(rs[-1] - rs[-2] <= ulp),
            "path": "prefill" if i == 0 else "decode step"}


def first_logits(model, prompt, stepwise: bool) -> np.ndarray:
    """float32 logits of the token after ``prompt``: one prefill call, or (``stepwise``) the prompt
    fed one token at a time, so that only the decode (S = 1) paths run."""
    cache = model.make_cache()
    if not stepwise:
        return np.array(model(prompt, cache)[0, -1].astype(mx.float32))
    for i in range(prompt.shape[1]):
        out = model(prompt[:, i:i + 1], cache)
    return np.array(out[0, -1].astype(mx.float32))


STEP_REL = 5e-2   # a decode step's logits past this of the largest logit: not bfloat16 rounding


def stepwise_lockstep(model, prompt) -> list:
    """The prompt fed one token at a time from an empty cache, kernels on and the reference in
    lockstep (a cache each): per step the largest logit difference over the largest reference
    logit."""
    mine, ref, out = model.make_cache(), model.make_cache(), []
    for i in range(prompt.shape[1]):
        a = np.array(model(prompt[:, i:i + 1], mine)[0, -1].astype(mx.float32))
        with kernels.force_reference():
            b = np.array(model(prompt[:, i:i + 1], ref)[0, -1].astype(mx.float32))
        out.append(float(np.abs(a - b).max() / np.abs(b).max()))
    return out


def token0_report(model, prompt) -> dict:
    """Token 0 kernels-on vs reference, through prefill and through decode steps: the largest logit
    difference over the largest |logit| and the reference's top-2 margin (a flip needs a difference
    of about the margin). Prefill (S > qgemv's rows) runs no kernel of ours: on a GPU it dequantizes
    to x's dtype for the matmul, the reference in float32, so a prefill flip is that dtype's rounding."""
    out, logits = {}, {}
    for name, stepwise in (("prefill", False), ("stepwise", True)):
        mine = first_logits(model, prompt, stepwise)
        with kernels.force_reference():
            ref = first_logits(model, prompt, stepwise)
        logits[name] = (mine, ref)
        top2 = np.sort(ref)[-2:]
        out[name] = {"rel": float(np.abs(mine - ref).max() / np.abs(ref).max()),
                     "max_abs_diff": float(np.abs(mine - ref).max()), "ref_top2_margin": float(top2[1] - top2[0]),
                     "same_argmax": bool(mine.argmax() == ref.argmax())}

    def rel(a, b):
        return float(np.abs(a - b).max() / np.abs(b).max())

    steps = stepwise_lockstep(model, prompt)
    out["steps"] = {"rel": steps, "first_over": next((i for i, v in enumerate(steps) if v > STEP_REL), None),
                    "kernels_stepwise_vs_prefill": rel(logits["stepwise"][0], logits["prefill"][0]),
                    "reference_stepwise_vs_prefill": rel(logits["stepwise"][1], logits["prefill"][1])}
    return out


def run_format(name: str, cfg: dict, prompt, args, root: Path) -> dict:
    from colibri_mlx.models.loading import load_model

    mode, bits, gs = FORMATS[name]
    path = root / name
    seconds, t0 = {}, time.perf_counter()

    def phase(label):
        nonlocal t0
        t = time.perf_counter()
        seconds[label] = round(t - t0, 2)
        t0 = t

    reused = args.reuse and same_checkpoint(path, cfg, mode, bits, gs)
    if not reused:
        shutil.rmtree(path, ignore_errors=True)
        write_checkpoint(cfg, mode, bits, gs, path)
    phase("write")
    res = {"format": name, "mode": mode, "bits": bits, "group_size": gs, "reused": reused, "seconds": seconds}
    ours = load_model(str(path))
    phase("load_ours")
    dispatch.reset_counters()
    cache = ours.make_cache()
    E.decode_times(lambda t: ours(t, cache), prompt, args.steps)
    cache = ours.make_cache()
    res["ours_ms"] = E.decode_times(lambda t: ours(t, cache), prompt, args.steps) * 1e3
    phase("time_ours")
    mine_logits, ref_logits = [], []
    tokens = greedy(ours, prompt, args.greedy, mine_logits)
    res["counters"] = kernels.counters()
    res["declines"] = sum(res["counters"]["fallbacks"].values())
    with kernels.force_reference():
        reference = greedy(ours, prompt, args.greedy, ref_logits)
    res["greedy_identical"] = tokens == reference
    res["greedy_first_difference"] = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    res["first_difference"] = first_difference_report(tokens, reference, mine_logits, ref_logits)
    del mine_logits, ref_logits
    res["token0"] = token0_report(ours, prompt)
    del ours, cache
    kernels.moe.clear_banks()
    mx.clear_cache()
    phase("checks")

    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as lm_load

    lm, _ = lm_load(path)
    phase("load_mlxlm")
    lm_cache = make_prompt_cache(lm)
    E.decode_times(lambda t: lm(t, cache=lm_cache), prompt, args.steps)
    lm_cache = make_prompt_cache(lm)
    res["mlxlm_ms"] = E.decode_times(lambda t: lm(t, cache=lm_cache), prompt, args.steps) * 1e3
    res["speedup"] = res["mlxlm_ms"] / res["ours_ms"]
    del lm, lm_cache
    mx.clear_cache()
    phase("time_mlxlm")
    if not args.reuse:
        shutil.rmtree(path)
    print(f"{name:12s} ours {res['ours_ms']:7.2f} ms/token  mlx-lm {res['mlxlm_ms']:7.2f}  x{res['speedup']:.2f}  "
          f"{args.greedy} greedy tokens kernels vs reference: {'identical' if res['greedy_identical'] else 'DIFFER at ' + str(res['greedy_first_difference'])}"
          f"  kernel declines {res['declines']}",
          flush=True)
    d = res["first_difference"]
    if d is not None:
        print(f"{'':12s} first difference at token {d['index']} ({d['path']}): reference top-2 margin "
              f"{d['ref_top2_margin']:.3g}, kernels' {d['kernel_top2_margin']:.3g}; max |logit diff| "
              f"{d['max_abs_logit_diff']:.3g} (rel {d['rel_logit_diff']:.2e}); bf16 step at the largest logit "
              f"{d['bf16_ulp_of_max_logit']:.3g}: {'near-tie' if d['near_tie'] else 'NOT a near-tie'}", flush=True)
    for how in ("prefill", "stepwise"):
        t = res["token0"][how]
        print(f"{'':12s} token 0 {how:8s} kernels vs reference: max |diff| {t['max_abs_diff']:.3g} "
              f"(rel {t['rel']:.2e}), reference top-2 margin {t['ref_top2_margin']:.3g}, same argmax {t['same_argmax']}",
              flush=True)
    st = res["token0"]["steps"]
    print(f"{'':12s} decode steps from an empty cache, kernels vs reference in lockstep: first step past "
          f"{STEP_REL:g} {st['first_over']}; per step {' '.join(f'{v:.2g}' for v in st['rel'])}; last step vs "
          f"own prefill: kernels {st['kernels_stepwise_vs_prefill']:.2e}, reference "
          f"{st['reference_stepwise_vs_prefill']:.2e}", flush=True)
    print(f"{'':12s} seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items())
          + (" (checkpoint reused)" if reused else ""), flush=True)
    return res


def container_ms(cfg: dict, prompt, steps: int) -> float:
    """Ours on bench_e2e.py's model as a colibri fmt 4 g64 container, timed as run_format times a
    checkpoint: the margin on containers, in the same run."""
    mx.random.seed(0)
    model = E.our_model(cfg)
    cache = model.make_cache()
    E.decode_times(lambda t: model(t, cache), prompt, steps)
    cache = model.make_cache()
    ms = E.decode_times(lambda t: model(t, cache), prompt, steps) * 1e3
    del model, cache
    kernels.moe.clear_banks()
    mx.clear_cache()
    return ms


def checkpoint_bytes(cfg: dict, name: str) -> int:
    """About the bytes of ``name``'s checkpoint of the ``cfg`` model (every matrix quantized, the
    norms and router left out): weights times bits a weight, scales and biases included."""
    mode, bits, gs = FORMATS[name]
    per_weight = bits + (32 / gs if mode == "affine" else 8 / gs)   # bf16 scale + bias, or one scale byte
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    attention = D * (q_lora + kv_lora + rope) + q_lora * H * (nope + rope) + kv_lora * H * (nope + v) + H * v * D
    dense = 3 * D * cfg["intermediate_size"]
    moe = (cfg["n_routed_experts"] + cfg["n_shared_experts"]) * 3 * D * cfg["moe_intermediate_size"]
    first = cfg["first_k_dense_replace"]
    layers = cfg["num_hidden_layers"]
    weights = layers * attention + first * dense + (layers - first) * moe + 2 * cfg["vocab_size"] * D
    return int(weights * per_weight / 8)


def default_root(cfg: dict, formats) -> str | None:
    """/dev/shm when it holds the largest checkpoint with room to spare (a checkpoint of the
    full-width model is 15-20 GB, written once and read twice: memory, not the disk), else None
    (the system's temporary directory)."""
    shm = "/dev/shm"
    if not os.path.isdir(shm):
        return None
    st = os.statvfs(shm)
    need = max(checkpoint_bytes(cfg, f) for f in formats)
    return shm if st.f_bavail * st.f_frsize > 1.25 * need + (4 << 30) else None


def same_checkpoint(path: Path, cfg: dict, mode: str, bits: int, gs: int) -> bool:
    """Whether ``path`` holds a complete checkpoint written by :func:`write_checkpoint` with these
    settings (its config.json, written last, equal to what it would write)."""
    try:
        have = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    want = dict(cfg, model_type="deepseek_v3", quantization={"group_size": gs, "bits": bits, "mode": mode})
    return all(have.get(k) == v for k, v in want.items())


def main():
    ap = argparse.ArgumentParser()
    E.add_model_args(ap)
    ap.add_argument("--formats", default="affine4g64,affine3g64,mxfp4")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--greedy", type=int, default=64)
    ap.add_argument("--out", "--json", dest="out", default=None, help="write the rows as JSON here")
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory "
                    "in /dev/shm when it has room, else the system's)")
    ap.add_argument("--no-container", action="store_true",
                    help="skip the row of ours on the same model as a colibri fmt 4 g64 container")
    ap.add_argument("--reuse", action="store_true",
                    help="with --dir: use a checkpoint already there with the same config, and keep them all")
    args = ap.parse_args()
    if args.reuse and not args.dir:
        ap.error("--reuse needs --dir")
    cfg = E.model_config(args)
    prompt = mx.array(np.random.default_rng(0).integers(0, args.vocab, (1, 16)).astype(np.int32))
    out = {"backend": kernels.backend(), "layers": args.layers, "experts": args.experts, "rows": []}
    unknown = [f for f in args.formats.split(",") if f not in FORMATS]
    if unknown:
        ap.error(f"--formats: unknown {unknown}; known: {','.join(FORMATS)}")
    formats = args.formats.split(",")
    where = args.dir or default_root(cfg, formats)
    print(f"checkpoints in {where or tempfile.gettempdir()} (largest about "
          f"{max(checkpoint_bytes(cfg, f) for f in formats) / 1e9:.1f} GB)", flush=True)
    with contextlib.ExitStack() as stack:
        root = Path(args.dir) if args.reuse else Path(stack.enter_context(tempfile.TemporaryDirectory(dir=where)))
        for name in formats:
            mx.random.seed(0)
            out["rows"].append(run_format(name, cfg, prompt, args, root))
    if not args.no_container:
        out["container_ms"] = container_ms(cfg, prompt, args.steps)
        print(f"container    ours {out['container_ms']:7.2f} ms/token (the same model as a colibri fmt 4 g64 container)",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\n{'format':12s} {'ours ms':>8s} {'mlx-lm ms':>9s} {'mlx-lm/ours':>11s}  greedy kernels = reference  declines")
    for r in out["rows"]:
        print(f"{r['format']:12s} {r['ours_ms']:8.2f} {r['mlxlm_ms']:9.2f} {r['speedup']:11.2f}  {str(r['greedy_identical']):25s}  {r['declines']}")
    if "container_ms" in out:
        print(f"{'container':12s} {out['container_ms']:8.2f}  (ours on a fmt 4 g64 container of the same model; "
              + ", ".join(f"{r['format']} / container {r['ours_ms'] / out['container_ms']:.2f}x" for r in out["rows"]) + ")")
    print(f"backend {out['backend']}; ms/token: median of --steps synchronized decode steps (bench_e2e.py)")


if __name__ == "__main__":
    main()

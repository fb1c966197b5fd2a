#!/usr/bin/env python3
"""Run upstream colibri's converter and ours on the same tiny checkpoints; compare tensor bytes.

Upstream's `c/tools/convert_fp8_to_int4.py` (with `iq3_pack.py` + `iq3xxs_grid.json` next to it
for `--xbits e8`) is run as a subprocess from an upstream checkout that is NOT part of this
repository; ours is `colibri convert`. Both read the same source checkpoint (BF16, and FP8 e4m3
with float32 128x128 `weight_scale_inv`) and each option set must give the same output shard
names, the same tensor names, dtypes and shapes, and the same bytes for every tensor (packed U8
weights, `.qs` scales, float32 norms/routers). File bytes are not compared: our shards carry a
`__metadata__` fmt/gs stamp that upstream's do not.

The checkpoints are built to hit the edges: input dims that are odd, not a multiple of 4, of
64 or of 128 (partial nibble bytes, int2 bytes, int3/int4 groups, FP8 blocks), rows of zeros,
rows whose quantized values are exact .5 ties (np.rint rounds to even), an indexer, an MTP
layer and a source shard holding nothing but MTP tensors (it must produce no output shard).

    python scripts/convert/crosscheck_upstream_converter.py --upstream /path/to/convert_fp8_to_int4.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

import numpy as np

# option set name -> converter options (identical for both converters)
OPTION_SETS = {
    "default (int4 g64, int8 io)": [],
    "--group-size 0 (int4 per-row)": ["--group-size", "0"],
    "--group-size 128": ["--group-size", "128"],
    "--group-size 32 --io-bits 4": ["--group-size", "32", "--io-bits", "4"],
    "--ebits 8": ["--ebits", "8"],
    "--up-bits 3": ["--up-bits", "3"],
    "--ebits 3 (int3-g64 spine)": ["--ebits", "3"],
    "--ebits 2 --group-size 0 (int2)": ["--ebits", "2", "--group-size", "0"],
    "mixed per-kind bits": ["--ebits", "4", "--xbits", "8", "--shared-bits", "8", "--o-bits", "2",
                            "--kvb-bits", "3", "--attn-bits", "8", "--dmlp-bits", "4", "--group-size", "0",
                            "--down-bits", "2"],
    "--io-bits 3 --xbits 3 --group-size 0": ["--io-bits", "3", "--xbits", "3", "--group-size", "0"],
    "--group-size 48": ["--group-size", "48"],
    "--mtp (MTP head pass)": ["--mtp"],
    "--indexer (DSA indexer pass)": ["--indexer"],
    "--xbits e8": ["--xbits", "e8"],
}
E8_SETS = {"--xbits e8"}

# Tiny DeepSeek-V3/GLM-shaped checkpoint: 2 main layers (0 dense, 1 MoE) + MTP layer 2.
HIDDEN, VOCAB, MOE_INTER, N_EXPERTS, N_LAYERS = 256, 300, 256, 4, 2
# The tensors are shaped for the converters' edges (odd widths), not as a model the engine runs,
# so config.json names a model type the engine does not validate: both converters then take
# every shape as stored, as upstream does for any checkpoint.
CONFIG_MODEL_TYPE = "crosscheck_tiny"
TIE_ROW_INT4 = [7.0, 2.5, -3.5, 0.5, -0.5, 1.5, -6.5, 4.5]   # s = 1 per row and per g64 group
TIE_ROW_INT8 = [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -6.5, 4.5]  # s = 1 for int8 per-row
TIE_ROW_INT2 = [1.0, 0.5, -0.5, -1.5, 0.5, -1.0, 0.5, -0.5]   # s = 1 for int2 per-row


def _shapes() -> list[dict[str, tuple]]:
    """Per source shard: name -> shape. The last shard holds only MTP-layer tensors."""
    def attn(i):
        p = f"model.layers.{i}."
        return {p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                p + "self_attn.q_a_proj.weight": (96, HIDDEN), p + "self_attn.q_a_layernorm.weight": (96,),
                p + "self_attn.q_b_proj.weight": (150, 96), p + "self_attn.kv_a_proj_with_mqa.weight": (72, HIDDEN),
                p + "self_attn.kv_a_layernorm.weight": (56,), p + "self_attn.kv_b_proj.weight": (160, 56),
                p + "self_attn.o_proj.weight": (HIDDEN, 131)}
    dense = {f"model.layers.0.mlp.{n}.weight": s for n, s in
             (("gate_proj", (300, HIDDEN)), ("up_proj", (300, HIDDEN)), ("down_proj", (HIDDEN, 301)))}
    def moe(i):
        p = f"model.layers.{i}."
        out = {p + "mlp.gate.weight": (N_EXPERTS, HIDDEN), p + "mlp.gate.e_score_correction_bias": (N_EXPERTS,),
               p + "mlp.shared_experts.gate_proj.weight": (96, HIDDEN),
               p + "mlp.shared_experts.up_proj.weight": (96, HIDDEN),
               p + "mlp.shared_experts.down_proj.weight": (HIDDEN, 96),
               p + "self_attn.indexer.wq_b.weight": (64, 96), p + "self_attn.indexer.k_norm.weight": (64,)}
        for e in range(N_EXPERTS):
            out.update({f"{p}mlp.experts.{e}.{proj}.weight": shape for proj, shape in (
                ("gate_proj", (MOE_INTER, HIDDEN)), ("up_proj", (MOE_INTER, HIDDEN)), ("down_proj", (HIDDEN, MOE_INTER)))})
        return out
    # A whole DeepSeek-V3 MTP layer: attention, MoE (with an indexer, which --mtp skips), the
    # eh_proj/enorm/hnorm input, shared_head and the layer's own embedding copy.
    p = f"model.layers.{N_LAYERS}."
    mtp = {**attn(N_LAYERS), **moe(N_LAYERS), p + "eh_proj.weight": (HIDDEN, 2 * HIDDEN), p + "enorm.weight": (HIDDEN,),
           p + "hnorm.weight": (HIDDEN,), p + "shared_head.norm.weight": (HIDDEN,),
           p + "shared_head.head.weight": (VOCAB, HIDDEN), p + "embed_tokens.weight": (VOCAB, HIDDEN)}
    return [{"model.embed_tokens.weight": (VOCAB, HIDDEN), **attn(0), **dense},
            {**attn(1), **moe(1), "model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)},
            mtp]


def _values(name: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    if len(shape) == 1:
        base = 1.0 if name.endswith("norm.weight") else 0.0
        return (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    w = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    w[rng.random(shape) < 0.01] *= 20.0  # outliers: group and row scales differ
    if shape[0] >= 4 and shape[1] >= 8:
        w[0] = 0.0
        for row, ties in ((1, TIE_ROW_INT4), (2, TIE_ROW_INT8), (3, TIE_ROW_INT2)):
            w[row] = 0.0
            w[row, :8] = ties
    return w


FP8_SKIP = ("embed_tokens", "lm_head", "mlp.gate.weight", "norm")


def build_checkpoint(path: str, fp8: bool, seed: int = 0) -> str:
    """Write a tiny checkpoint: BF16 everywhere (plus F32 router bias), or FP8 e4m3 projections
    with float32 128x128 `weight_scale_inv` blocks (the DeepSeek-V3/GLM FP8 layout)."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards = _shapes()
    weight_map = {}
    for k, shapes in enumerate(shards):
        out = {}
        for name, shape in shapes.items():
            w = torch.from_numpy(_values(name, shape, rng))
            if name.endswith("e_score_correction_bias"):
                out[name] = w
            elif fp8 and w.ndim == 2 and not any(s in name for s in FP8_SKIP):
                out[name], out[name + "_scale_inv"] = _to_fp8(w)
            else:
                out[name] = w.to(torch.bfloat16)
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(out, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in out})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": CONFIG_MODEL_TYPE,
              "num_hidden_layers": N_LAYERS, "num_nextn_predict_layers": 1, "hidden_size": HIDDEN,
              "vocab_size": VOCAB}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def _to_fp8(w, block: int = 128):
    import torch

    O, I = w.shape
    bo, bi = -(-O // block), -(-I // block)
    padded = torch.zeros(bo * block, bi * block)
    padded[:O, :I] = w
    amax = padded.reshape(bo, block, bi, block).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = (amax / 448.0).float().contiguous()
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:O, :I]
    return (w / full).to(torch.float8_e4m3fn), scale


# ------------------------------------------------------------------ running the converters


def run_upstream(converter: str, indir: str, outdir: str, options: list[str]) -> None:
    # upstream defaults --n-layers to GLM-5's 78; ours reads config.json. Pass it to both.
    cmd = [sys.executable, converter, "--indir", indir, "--outdir", outdir, "--n-layers", str(N_LAYERS), *options]
    _run(cmd, "upstream converter")


def run_ours(indir: str, outdir: str, options: list[str]) -> None:
    cmd = [sys.executable, "-m", "colibri_mlx", "convert", "--indir", indir, "--outdir", outdir,
           "--n-layers", str(N_LAYERS), "--no-progress", "--no-stats", *options]
    _run(cmd, "colibri convert")


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}"
                           f"\n{proc.stderr[-3000:]}")


# ------------------------------------------------------------------ comparing containers


def read_tensors(outdir: str) -> dict[str, dict[str, tuple[str, tuple, bytes]]]:
    """shard file name -> tensor name -> (dtype, shape, raw bytes)."""
    from safetensors import safe_open

    out = {}
    for fname in sorted(os.listdir(outdir)):
        if not fname.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(outdir, fname), framework="numpy") as f:
            out[fname] = {}
            for name in f.keys():
                a = f.get_tensor(name)
                out[fname][name] = (str(a.dtype), tuple(a.shape), np.ascontiguousarray(a).tobytes())
    return out


@dataclass
class Comparison:
    identical: bool
    n_tensors: int
    first_difference: Optional[str] = None


def compare(upstream_dir: str, ours_dir: str) -> Comparison:
    up, ours = read_tensors(upstream_dir), read_tensors(ours_dir)
    n = sum(len(t) for t in up.values())
    if sorted(up) != sorted(ours):
        return Comparison(False, n, f"shard files differ: upstream {sorted(up)} vs ours {sorted(ours)}")
    for fname in sorted(up):
        a, b = up[fname], ours[fname]
        if sorted(a) != sorted(b):
            only_up, only_ours = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            return Comparison(False, n, f"{fname}: names only upstream {only_up[:5]}, only ours {only_ours[:5]}")
        for name in sorted(a):
            if a[name] != b[name]:
                return Comparison(False, n, f"{fname}: {name}: {_describe(a[name], b[name])}")
    return Comparison(True, n)


def _describe(a, b) -> str:
    (da, sa, ba), (db, sb, bb) = a, b
    if (da, sa) != (db, sb):
        return f"upstream {da}{list(sa)} vs ours {db}{list(sb)}"
    x, y = np.frombuffer(ba, np.uint8), np.frombuffer(bb, np.uint8)
    diff = np.flatnonzero(x != y)
    return f"{len(diff)} of {len(x)} bytes differ, first at byte {diff[0]} ({x[diff[0]]} vs {y[diff[0]]})"


def crosscheck(converter: str, option_sets: dict, sources=("bf16", "fp8"), workdir: Optional[str] = None):
    """Yield (source, option set name, Comparison) for every pair."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for source in sources:
            indir = build_checkpoint(os.path.join(tmp, f"src-{source}"), fp8=(source == "fp8"))
            for k, (label, options) in enumerate(option_sets.items()):
                up_dir, our_dir = (os.path.join(tmp, f"{who}-{source}-{k}") for who in ("up", "ours"))
                run_upstream(converter, indir, up_dir, options)
                run_ours(indir, our_dir, options)
                yield source, label, compare(up_dir, our_dir)


def find_upstream_converter(path: str) -> str:
    """Accept the converter file itself, its tools/ directory or an upstream checkout root."""
    for candidate in (path, os.path.join(path, "convert_fp8_to_int4.py"),
                      os.path.join(path, "c", "tools", "convert_fp8_to_int4.py")):
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise SystemExit(f"{path}: no upstream convert_fp8_to_int4.py there (give the file, c/tools/ or the checkout)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="upstream convert_fp8_to_int4.py, its directory or checkout")
    ap.add_argument("--only", action="append", help="run only option sets whose name contains this")
    ap.add_argument("--no-e8", action="store_true", help="skip --xbits e8 (needs upstream's iq3_pack.py)")
    ap.add_argument("--sources", default="bf16,fp8")
    a = ap.parse_args()
    converter = find_upstream_converter(a.upstream)
    sets = {k: v for k, v in OPTION_SETS.items()
            if not (a.no_e8 and k in E8_SETS) and (not a.only or any(s in k for s in a.only))}
    failures = 0
    print(f"{'source':6}  {'option set':36}  {'tensors':>7}  result")
    for source, label, c in crosscheck(converter, sets, tuple(a.sources.split(","))):
        failures += not c.identical
        result = "identical" if c.identical else f"DIFFERENT: {c.first_difference}"
        print(f"{source:6}  {label:36}  {c.n_tensors:7d}  {result}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

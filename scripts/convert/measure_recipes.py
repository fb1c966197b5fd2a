#!/usr/bin/env python3
"""Size and reconstruction error of each `colibri convert --recipe`, for docs/convert.md.

Size: exact container bytes for a full model, from the byte-count table over every 2-D weight
its config implies (default: DeepSeek-V3/R1's published config.json values), plus float32
norms/router. Error: relative RMS error ||decode(encode(W)) - W|| / ||W|| of each class on a
random matrix of that class's real shape (Student-t, 5 degrees of freedom: heavier tails than a
Gaussian, like trained weights), measured on a row sample (every format is per row, so the
error of a row sample estimates the whole matrix; fmt 6 is slow in numpy).

    python scripts/convert/measure_recipes.py [--config config.json] [--rows 256] [--e8-rows 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from colibri_mlx.container import expected_shapes  # noqa: E402
from colibri_mlx.convert.classify import classify  # noqa: E402
from colibri_mlx.convert.recipes import RECIPES, resolve_plan  # noqa: E402
from colibri_mlx.formats import decode, encode, scale_nbytes, weight_nbytes  # noqa: E402

DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json (the fields the shapes need)
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "tie_word_embeddings": False,
}
CLASS_ORDER = ("io", "x", "sh", "o", "kvb", "attn", "dmlp", "q")


def model_bytes(shapes: dict, plan) -> dict[str, int]:
    """Container bytes per class for every quantized 2-D weight."""
    out: dict[str, int] = {}
    for name, (O, I) in shapes.items():
        kind = classify(name, plan.n_layers)
        if kind in ("skip", "consumed"):
            continue
        if kind == "f32":
            out["f32"] = out.get("f32", 0) + 4 * O * I
            continue
        fmt, gs = plan.format_for(kind, name)
        out[kind] = out.get(kind, 0) + weight_nbytes(fmt, O, I, gs) + scale_nbytes(fmt, O, I, gs)
    return out


def class_examples(shapes: dict, n_layers: int) -> dict[str, tuple[str, tuple]]:
    """One representative tensor per class (the routed-expert ones per projection)."""
    examples = {}
    for name, shape in shapes.items():
        kind = classify(name, n_layers)
        key = f"x.{name.split('.')[-2]}" if kind == "x" else kind
        if kind not in ("skip", "consumed", "f32") and key not in examples:
            examples[key] = (name, shape)
    return examples


def rel_rms(fmt, gs, w) -> float:
    packed, scales = encode(fmt, w, gs)
    approx = decode(fmt, packed, scales, *w.shape, gs)
    if fmt == 6:
        from colibri_mlx.formats.e8 import rotate_rows

        w = rotate_rows(w)
    return float(np.linalg.norm(approx - w) / np.linalg.norm(w))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="config.json of the model to size (default: DeepSeek-V3)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--e8-rows", type=int, default=32)
    ap.add_argument("--recipes", default=",".join(r for r in RECIPES if r != "wq-v0"))
    a = ap.parse_args()
    config = json.load(open(a.config)) if a.config else DEEPSEEK_V3
    shapes = expected_shapes(config)
    n_layers = config["num_hidden_layers"]
    examples = class_examples(shapes, n_layers)
    rng = np.random.default_rng(0)
    samples = {}  # key -> matrix sample of the real input width
    for key, (name, (O, I)) in examples.items():
        samples[key] = (0.02 * rng.standard_t(5, size=(min(O, a.rows), I))).astype(np.float32)
    bf16_gb = sum(2 * O * I for O, I in shapes.values()) / 1e9
    print(f"model: {config.get('model_type')} ({len(shapes)} 2-D weights, {bf16_gb:.1f} GB in BF16)\n")
    print("| recipe | size GB | bits/weight | " + " | ".join(f"{k}" for k in sorted(samples)) + " |")
    print("|---" * (3 + len(samples)) + "|")
    n_weights = sum(O * I for O, I in shapes.values())
    for recipe in a.recipes.split(","):
        plan = resolve_plan({}, recipe, "main", n_layers)
        total = sum(model_bytes(shapes, plan).values())
        errs = []
        for key in sorted(samples):
            name, _ = examples[key]
            fmt, gs = plan.format_for(key.split(".")[0], name)
            w = samples[key][: a.e8_rows] if fmt == 6 else samples[key]
            errs.append(f"{rel_rms(fmt, gs, w):.4f} (f{fmt})")
        print(f"| {recipe} | {total / 1e9:.1f} | {8 * total / n_weights:.2f} | " + " | ".join(errs) + " |",
              flush=True)


if __name__ == "__main__":
    main()

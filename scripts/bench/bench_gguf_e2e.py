#!/usr/bin/env python3
"""End-to-end decode of the end-to-end bench's DeepSeek-V3-shaped model (scripts/bench/bench_e2e.py:
4 layers, 1 dense + 3 MoE, 256 experts top-8, full widths) as GGUF files against the same model as
our container fmt 4 g64, in the same process.

    PYTHONPATH=/root/site:/tmp/site:$PWD MLX_ENABLE_TF32=0 python3 scripts/bench/bench_gguf_e2e.py \
        --json gguf_e2e.json [--tiny]

Files (written with gguf's GGUFWriter into a temporary directory, each to a temporary name and
renamed; deleted once loaded), metadata as llama.cpp writes ``deepseek2`` (kv_b whole, as
``attn_kv_b``; no tokenizer: the model is driven by token ids), types per tensor:

- ``q4_k_m``: llama.cpp's Q4_K_M recipe (llama-quant.cpp): Q4_K (``token_embd`` included), Q6_K
  for ``output`` and, in the layers its ``use_more_bits`` picks (2 and 3 of 4), for ``attn_kv_b``
  and every ``ffn_down`` (``_exps``, ``_shexp``). (llama.cpp's converter stores kv_b split:
  ``attn_k_b`` in Q5_0, its 128-wide rows falling back from Q4_K, and ``attn_v_b`` in Q4_K; the
  loader joins a split kv_b into float32, so kv_b is written whole here.)
- ``iq2_xxs``: a dynamic IQ2_XXS mix: routed experts IQ2_XXS; the latent projections
  (``attn_q_a``, ``attn_kv_a_mqa``, ``attn_kv_b``) Q8_0; ``attn_q_b``, ``attn_output``, the dense
  FFN and the shared expert Q4_K; ``output`` Q6_K (the shared expert then runs as an MLP of its
  own, not as moe_block's extra slot: counted as moe_shared/mlp).

Weights are random blocks (every code, grid index and sign valid) with fp16 scales set for an RMS
of 0.02 (tests/helpers_gguf.py) and of random sign per block (zero-mean rows); each tensor's rows
repeat a pool of 256 random rows of its own (distinct addresses, not contents, are what the timing
reads; tensors sharing rows, gate and up alike, would give every token the same experts). Routers
are random float32, the ``exp_probs_b`` biases zero, norms one; every model's logits are checked
finite, and the distinct experts each MoE layer selects over one run are printed.

Method (strata's): paired, alternating A/B timing. A pair is one run of each model (a fresh cache,
the 16-token prompt, then ``--steps`` greedy decode steps, each evaluated and synchronized:
bench_e2e.decode_times' median step), in alternating order; pairs whose A + B is over 1.15x the
best pair's are dropped; the figure is the median of the rest. Bytes per token = the weights a token
touches (attention, the dense FFN, router, shared expert and 8 routed experts per MoE layer, the
head) + the latent cache (bench_e2e.token_bytes); the ratio per byte read is
(GGUF ms / GGUF bytes) / (fmt 4 ms / fmt 4 bytes); target <= 1.15. Dispatch counters are taken
per model over one unpaired run (a declined kernel shows as a fallback). ``--tiny``: widths of 256
(the K- and IQ-quants' block), for a CPU run: ratios only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e as E  # noqa: E402
import bench_moe_mla as B  # noqa: E402
from colibri_mlx import kernels  # noqa: E402

OUTLIER = 1.15
TARGET = 1.15
WEIGHT_RMS = 0.02
POOL_ROWS = 256
PROMPT = 16
# llama.cpp's general.file_type (LLAMA_FTYPE_MOSTLY_*)
FILE_TYPES = {"q4_k_m": 15, "iq2_xxs": 19}
MIXES = tuple(FILE_TYPES)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's use_more_bits: the layers a K_M mix gives more bits."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_type(mix: str, name: str, n_layers: int) -> str:
    """The ggml type of matrix ``name`` in ``mix`` (module docstring)."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name == "output.weight":
        return "Q6_K"
    if mix == "q4_k_m":
        more = layer >= 0 and use_more_bits(layer, n_layers)
        if more and ("attn_kv_b" in name or "ffn_down" in name):
            return "Q6_K"
        return "Q4_K"
    if "_exps" in name:
        return "IQ2_XXS"
    if "attn_q_a" in name or "attn_kv_a_mqa" in name or "attn_kv_b" in name:
        return "Q8_0"
    return "Q4_K"


def model_tensors(cfg: dict) -> list:
    """``[(gguf name, numpy shape, kind)]`` of the config's model, kind "matrix", "router" or
    "ones"/"zeros" (float32 vectors)."""
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora, E_, inter = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    out = [("token_embd.weight", (cfg["vocab_size"], D), "matrix"), ("output_norm.weight", (D,), "ones"),
           ("output.weight", (cfg["vocab_size"], D), "matrix")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (D,), "ones"), (p + "ffn_norm.weight", (D,), "ones"),
                (p + "attn_q_a.weight", (q_lora, D), "matrix"), (p + "attn_q_a_norm.weight", (q_lora,), "ones"),
                (p + "attn_q_b.weight", (H * (nope + rope), q_lora), "matrix"),
                (p + "attn_kv_a_mqa.weight", (kv_lora + rope, D), "matrix"),
                (p + "attn_kv_a_norm.weight", (kv_lora,), "ones"),
                (p + "attn_kv_b.weight", (H * (nope + v), kv_lora), "matrix"),
                (p + "attn_output.weight", (D, H * v), "matrix")]
        if i < cfg["first_k_dense_replace"]:
            I = cfg["intermediate_size"]
            out += [(p + "ffn_gate.weight", (I, D), "matrix"), (p + "ffn_up.weight", (I, D), "matrix"),
                    (p + "ffn_down.weight", (D, I), "matrix")]
        else:
            out += [(p + "ffn_gate_inp.weight", (E_, D), "router"), (p + "exp_probs_b.bias", (E_,), "zeros"),
                    (p + "ffn_gate_exps.weight", (E_, inter, D), "matrix"),
                    (p + "ffn_up_exps.weight", (E_, inter, D), "matrix"),
                    (p + "ffn_down_exps.weight", (E_, D, inter), "matrix")]
            S = inter * cfg["n_shared_experts"]
            out += [(p + "ffn_gate_shexp.weight", (S, D), "matrix"), (p + "ffn_up_shexp.weight", (S, D), "matrix"),
                    (p + "ffn_down_shexp.weight", (D, S), "matrix")]
    return out


def add_metadata(w, cfg: dict, mix: str) -> None:
    """deepseek2 metadata as llama.cpp's converter writes it for a file with kv_b whole."""
    arch = "deepseek2"
    w.add_name(f"bench {mix}")
    w.add_uint32(f"{arch}.block_count", cfg["num_hidden_layers"])
    w.add_uint32(f"{arch}.context_length", cfg["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", cfg["hidden_size"])
    w.add_uint32(f"{arch}.feed_forward_length", cfg["intermediate_size"])
    w.add_uint32(f"{arch}.attention.head_count", cfg["num_attention_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_uint32(f"{arch}.expert_count", cfg["n_routed_experts"])
    w.add_uint32(f"{arch}.expert_used_count", cfg["num_experts_per_tok"])
    w.add_uint32(f"{arch}.expert_group_count", cfg["n_group"])
    w.add_uint32(f"{arch}.expert_group_used_count", cfg["topk_group"])
    w.add_uint32(f"{arch}.expert_gating_func", 2)     # sigmoid
    w.add_uint32(f"{arch}.attention.key_length", cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_uint32(f"{arch}.attention.value_length", cfg["v_head_dim"])
    w.add_uint32(f"{arch}.leading_dense_block_count", cfg["first_k_dense_replace"])
    w.add_uint32(f"{arch}.vocab_size", cfg["vocab_size"])
    w.add_uint32(f"{arch}.attention.q_lora_rank", cfg["q_lora_rank"])
    w.add_uint32(f"{arch}.attention.kv_lora_rank", cfg["kv_lora_rank"])
    w.add_uint32(f"{arch}.expert_feed_forward_length", cfg["moe_intermediate_size"])
    w.add_uint32(f"{arch}.expert_shared_count", cfg["n_shared_experts"])
    w.add_float32(f"{arch}.expert_weights_scale", cfg["routed_scaling_factor"])
    w.add_bool(f"{arch}.expert_weights_norm", cfg["norm_topk_prob"])
    w.add_uint32(f"{arch}.rope.dimension_count", cfg["qk_rope_head_dim"])
    w.add_quantization_version(2)
    w.add_file_type(FILE_TYPES[mix])


def signed_blocks(name: str, raw: np.ndarray, rng) -> np.ndarray:
    """``raw`` with each block's fp16 scale fields negated together at random: the block's
    weights negated. Random codes of the K-quants with a min (Q4_K: d * sc * q - dmin * m, q in
    0..15) have a mean of one sign per block; left so, every row of a matrix shares a component
    and every token routes to the same experts."""
    from colibri_mlx.formats.gguf_quant import GGUF_TYPES
    from helpers_gguf import FP16_FIELDS

    blocks = raw.reshape(raw.shape[0], -1, GGUF_TYPES[name].type_size)
    flip = rng.integers(0, 2, blocks.shape[:2], dtype=np.uint8) * np.uint8(0x80)
    for off in FP16_FIELDS[name]:
        blocks[..., off + 1] ^= flip          # the sign bit: the high byte's top bit (little endian)
    return raw


def write_gguf(path: str, cfg: dict, mix: str, seed: int = 0) -> dict:
    """The config's model as a ``mix`` GGUF file at ``path`` (temporary name, then renamed);
    returns ``{ggml type: bytes}``."""
    import gguf
    from colibri_mlx.formats.gguf_quant import GGUF_TYPES, row_nbytes
    from helpers_gguf import random_gguf_raw

    tensors = model_tensors(cfg)
    n_layers = cfg["num_hidden_layers"]
    rng = np.random.default_rng(seed)

    def data(name, shape, kind):
        if kind == "ones":
            return np.ones(shape, np.float32)
        if kind == "zeros":
            return np.zeros(shape, np.float32)
        if kind == "router":
            return (rng.standard_normal(shape) * 0.02).astype(np.float32)
        t = tensor_type(mix, name, n_layers)
        rows, I = int(np.prod(shape[:-1])), shape[-1]
        pool = signed_blocks(t, random_gguf_raw(t, min(POOL_ROWS, rows), I, seed=int(rng.integers(1 << 31)),
                                                rms=WEIGHT_RMS), rng)
        return np.resize(pool, (rows, pool.shape[1])).reshape(*shape[:-1], -1)

    tmp = path + ".tmp"
    w = gguf.GGUFWriter(tmp, "deepseek2")
    add_metadata(w, cfg, mix)
    by_type: dict = {}
    for name, shape, kind in tensors:
        if kind == "matrix":
            t = tensor_type(mix, name, n_layers)
            nbytes = int(np.prod(shape[:-1])) * row_nbytes(GGUF_TYPES[t], shape[-1])
            byte_shape = (*shape[:-1], nbytes // int(np.prod(shape[:-1])))
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=gguf.GGMLQuantizationType[t])
        else:
            t, nbytes = "F32", int(np.prod(shape)) * 4
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        by_type[t] = by_type.get(t, 0) + nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in tensors:      # one tensor in memory at a time
        w.write_tensor_data(data(name, shape, kind))
    w.close()
    os.replace(tmp, path)
    return by_type


def tiny_shapes():
    """bench_moe_mla's widths at 256 (the K- and IQ-quants' block): a CPU run."""
    B.D, B.INTER, B.H, B.Q_LORA, B.KV_LORA, B.NOPE, B.ROPE, B.V = 256, 256, 4, 256, 256, 64, 32, 64


def run_once(model, prompt, steps) -> float:
    cache = model.make_cache()
    return E.decode_times(lambda t: model(t, cache), prompt, steps)


def paired(a, b, prompt, steps, pairs) -> dict:
    """Median seconds per decode step of models ``a`` and ``b`` over the kept pairs (module
    docstring)."""
    times = []
    for k in range(pairs):
        if k % 2 == 0:
            ta = run_once(a, prompt, steps)
            tb = run_once(b, prompt, steps)
        else:
            tb = run_once(b, prompt, steps)
            ta = run_once(a, prompt, steps)
        times.append((ta, tb))
    best = min(x + y for x, y in times)
    kept = [(x, y) for x, y in times if x + y <= OUTLIER * best]
    return {"a_s": statistics.median(p[0] for p in kept), "b_s": statistics.median(p[1] for p in kept),
            "kept": len(kept), "pairs": pairs}


def check_finite(model, prompt, label):
    logits = model(prompt, model.make_cache())
    mx.eval(logits)
    if not bool(mx.all(mx.isfinite(logits)).item()):
        raise SystemExit(f"{label}: the logits hold NaN or Inf")


def counted_run(model, prompt, steps) -> dict:
    kernels.reset_counters()
    run_once(model, prompt, steps)
    return kernels.counters()


def routing_spread(model, prompt, steps) -> list:
    """Distinct routed experts each MoE layer selected over one run (prompt and ``steps``
    steps; the routers wrapped, so this run is not compiled and not timed)."""
    seen: dict = {}
    wrapped = []
    for i, layer in enumerate(model.layers):
        mlp = layer.mlp
        if not hasattr(mlp, "router"):
            continue

        def recording(flat, slot, router=mlp.router, i=i):
            ids, weights = router(flat, slot)
            seen.setdefault(i, []).append(ids)
            return ids, weights

        wrapped.append((mlp, mlp.router))
        mlp.router = recording
    try:
        run_once(model, prompt, steps)
    finally:
        for mlp, router in wrapped:
            mlp.router = router
    n_experts = model.args.n_routed_experts
    return [len({int(e) for ids in seen[i] for e in np.array(ids).reshape(-1) if e < n_experts})
            for i in sorted(seen)]


def load_gguf(path):
    from colibri_mlx.models.loading import build_model
    from colibri_mlx.models.modeldir import open_model_dir

    return build_model(open_model_dir(path))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    E.add_model_args(ap)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--mix", choices=MIXES, action="append", help="the GGUF mixes to run (default: all)")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--dir", help="where the GGUF files are written (default: the system's temporary directory; "
                    "the q4_k_m file of the full model is about 22 GB)")
    args = ap.parse_args()
    try:
        import gguf  # noqa: F401  (the writer here, the reader in the loader)
    except ImportError:
        raise SystemExit("bench_gguf_e2e: needs the gguf package (pure Python: pip install gguf, or its gguf/ "
                         "folder on PYTHONPATH)") from None
    t_start = time.perf_counter()
    if args.tiny:
        tiny_shapes()
    tiny, args.tiny = args.tiny, False          # bench_e2e's --tiny widths are not 256-multiples
    cfg = E.model_config(args)
    if tiny:
        cfg["intermediate_size"] = 256
    mx.random.seed(0)
    prompt = mx.array(np.random.default_rng(0).integers(0, cfg["vocab_size"], (1, PROMPT)).astype(np.int32))
    T = PROMPT + args.steps
    res = {"backend": kernels.backend(), "tiny": tiny, "layers": args.layers, "experts": args.experts,
           "steps": args.steps, "pairs": args.pairs, "method": "paired alternating A/B, pairs over 1.15x the "
           "best dropped, median of the rest", "mixes": {}}

    fmt4 = E.our_model(cfg)
    check_finite(fmt4, prompt, "fmt 4")
    run_once(fmt4, prompt, args.steps)               # warm-up, unrecorded
    fmt4_bytes = E.token_bytes(fmt4, cfg, T)
    res["fmt4"] = {"bytes_per_token": fmt4_bytes, "counters": counted_run(fmt4, prompt, args.steps)}
    print(f"[fmt 4 model: {time.perf_counter() - t_start:.0f} s]", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench_gguf_e2e", dir=args.dir) as tmp:
        for mix in args.mix or MIXES:
            t0 = time.perf_counter()
            path = os.path.join(tmp, f"bench-{mix}.gguf")
            by_type = write_gguf(path, cfg, mix)
            t_write = time.perf_counter() - t0
            model = load_gguf(path)
            os.remove(path)
            t_load = time.perf_counter() - t0 - t_write
            check_finite(model, prompt, mix)
            run_once(model, prompt, args.steps)      # warm-up, unrecorded
            counters = counted_run(model, prompt, args.steps)
            spread = routing_spread(model, prompt, args.steps)
            t = paired(model, fmt4, prompt, args.steps, args.pairs)
            nbytes = E.token_bytes(model, cfg, T)
            per_byte = (t["a_s"] / nbytes) / (t["b_s"] / fmt4_bytes)
            row = {"ms": t["a_s"] * 1e3, "fmt4_ms": t["b_s"] * 1e3, "kept": t["kept"], "pairs": t["pairs"],
                   "bytes_per_token": nbytes, "fmt4_bytes_per_token": fmt4_bytes, "ms_ratio": t["a_s"] / t["b_s"],
                   "per_byte_ratio": per_byte, "within_target": per_byte <= TARGET, "file_bytes_by_type": by_type,
                   "write_s": t_write, "load_s": t_load, "counters": counters,
                   "experts_selected_per_moe_layer": spread}
            res["mixes"][mix] = row
            fb = sum(counters["fallbacks"].values())
            print(f"{mix}: {row['ms']:.2f} ms/token ({nbytes / 1e6:.0f} MB/token) against fmt 4 {row['fmt4_ms']:.2f} "
                  f"ms/token ({fmt4_bytes / 1e6:.0f} MB/token), {t['kept']}/{t['pairs']} pairs; ms ratio "
                  f"{row['ms_ratio']:.3f}, per byte read {per_byte:.3f} (target <= {TARGET}); file written "
                  f"{t_write:.0f} s, loaded {t_load:.0f} s; fallbacks {fb}", flush=True)
            print(f"  {mix} kernels: " + ", ".join(f"{k} {n}" for k, n in counters["calls"].items()) +
                  ("; fallbacks: " + "; ".join(f"{r} x{n}" for r, n in counters["fallbacks"].items()) if fb else ""),
                  flush=True)
            print(f"  {mix} routing: distinct experts selected per MoE layer over one run {spread} of "
                  f"{cfg['n_routed_experts']} ({PROMPT} prompt tokens + {args.steps} steps, top-"
                  f"{cfg['num_experts_per_tok']})", flush=True)
            del model
            kernels.moe.clear_banks()
            mx.clear_cache()
    res["fmt4_ms_note"] = "per mix, in that mix's pairs"
    res["total_s"] = time.perf_counter() - t_start
    c = res["fmt4"]["counters"]
    print("  fmt 4 kernels: " + ", ".join(f"{k} {n}" for k, n in c["calls"].items()) +
          f"; fallbacks {sum(c['fallbacks'].values())}")
    print(f"total {res['total_s']:.0f} s" + ("; --tiny: CPU shapes, ratios only" if tiny else ""))
    if args.json:
        tmp_json = args.json + ".tmp"
        Path(tmp_json).write_text(json.dumps(res, indent=1))
        os.replace(tmp_json, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""scripts/bench/bench_gguf_e2e.py's GGUF files: llama.cpp's Q4_K_M type choices for a 4-layer
deepseek2 model (read off llama-quant.cpp by hand), and a written file read back by the loader's
reader with the random weights' magnitudes as promised."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

pytest.importorskip("gguf")
import bench_gguf_e2e as G  # noqa: E402


def test_q4_k_m_types_follow_llama_cpp_for_four_layers():
    # llama-quant.cpp's use_more_bits(i, 4): i < 4/8 = 0 (never), i >= 7*4/8 = 3, or (i - 0) % 3 == 2.
    assert [G.use_more_bits(i, 4) for i in range(4)] == [False, False, True, True]
    t = lambda n: G.tensor_type("q4_k_m", n, 4)   # noqa: E731
    assert [t(f"blk.{i}.ffn_down_exps.weight") for i in (1, 2, 3)] == ["Q4_K", "Q6_K", "Q6_K"]
    assert [t(f"blk.{i}.attn_kv_b.weight") for i in range(4)] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert t("blk.0.ffn_down.weight") == "Q4_K" and t("blk.2.ffn_down_shexp.weight") == "Q6_K"
    assert t("blk.3.ffn_gate_exps.weight") == "Q4_K" and t("blk.1.attn_q_b.weight") == "Q4_K"
    assert t("output.weight") == "Q6_K" and t("token_embd.weight") == "Q4_K"
    i = lambda n: G.tensor_type("iq2_xxs", n, 4)   # noqa: E731
    assert {i(f"blk.1.ffn_{p}_exps.weight") for p in ("gate", "up", "down")} == {"IQ2_XXS"}
    assert i("blk.1.ffn_down_shexp.weight") == "Q4_K" and i("blk.1.attn_kv_b.weight") == "Q8_0"


def test_written_file_loads_with_its_types_and_magnitudes(tmp_path):
    from colibri_mlx.formats.gguf_quant import dequantize_gguf
    from colibri_mlx.models.gguf_checkpoint import GgufModel, model_args

    import bench_moe_mla as B

    saved = (B.D, B.INTER, B.H, B.Q_LORA, B.KV_LORA, B.NOPE, B.ROPE, B.V)
    G.tiny_shapes()
    try:
        cfg = B.config(n_layers=4, experts=16, first_dense=1, vocab=512)
    finally:
        B.D, B.INTER, B.H, B.Q_LORA, B.KV_LORA, B.NOPE, B.ROPE, B.V = saved
    cfg["intermediate_size"] = 256
    path = tmp_path / "m.gguf"
    G.write_gguf(str(path), cfg, "q4_k_m")
    assert not (tmp_path / "m.gguf.tmp").exists()
    model = GgufModel(str(path))
    args = model_args(model)
    assert (args.n_routed_experts, args.num_hidden_layers, args.first_k_dense_replace) == (16, 4, 1)
    assert (args.hidden_size, args.kv_lora_rank, args.qk_nope_head_dim, args.v_head_dim) == (256, 256, 64, 64)
    assert model.info("blk.2.ffn_down_exps.weight").dtype == "Q6_K"
    assert model.info("blk.1.ffn_down_exps.weight").dtype == "Q4_K"
    assert model.info("blk.1.ffn_gate_exps.weight").shape == (16, 256, 256)
    assert model.info("blk.1.ffn_gate_inp.weight").dtype == "F32"
    for name in ("blk.1.ffn_gate_exps.weight", "blk.2.ffn_down_exps.weight", "output.weight"):
        w = dequantize_gguf(model.info(name).dtype, model.raw(name).reshape(-1, model.raw(name).shape[-1]))
        rms = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
        assert np.isfinite(w).all() and 0.01 < rms < 0.04, (name, rms)


def test_routing_spreads_and_bytes_per_token_follow_the_file(tmp_path):
    """The written model routes its tokens over many experts (zero-mean random rows), and the bytes
    per token the bench divides by are the file's own tensors a token reads."""
    import argparse

    import bench_e2e as E
    import bench_moe_mla as B
    import mlx.core as mx

    from colibri_mlx.models.gguf_checkpoint import GgufModel

    saved = (B.D, B.INTER, B.H, B.Q_LORA, B.KV_LORA, B.NOPE, B.ROPE, B.V)
    G.tiny_shapes()
    try:
        cfg = E.model_config(argparse.Namespace(tiny=False, layers=4, experts=64, vocab=512))
        cfg["intermediate_size"] = 256
        path = str(tmp_path / "m.gguf")
        G.write_gguf(path, cfg, "q4_k_m")
        model = G.load_gguf(path)
        prompt = mx.array(np.random.default_rng(0).integers(0, 512, (1, G.PROMPT)).astype(np.int32))
        spread = G.routing_spread(model, prompt, 4)
        T = G.PROMPT + 4
        got = E.token_bytes(model, cfg, T)
    finally:
        B.D, B.INTER, B.H, B.Q_LORA, B.KV_LORA, B.NOPE, B.ROPE, B.V = saved
    # 20 tokens x top-8 of 64: a model routing every token alike selects 8 experts a layer
    assert len(spread) == 3 and min(spread) >= 24, spread
    f = GgufModel(path)
    want = f.info("output.weight").nbytes
    for i in range(4):
        for name, info in f.tensors.items():
            if not name.startswith(f"blk.{i}.") or info.dtype == "F32" and "ffn_gate_inp" not in name:
                continue
            want += info.nbytes * 8 // 64 if "_exps" in name else info.nbytes
        want += T * (256 + 32) * 4      # the float32 latent cache rows: kv_lora + rope
    assert got == want

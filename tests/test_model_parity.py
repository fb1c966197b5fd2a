"""colibri_mlx.models against transformers 5.23 (float32) on tiny random checkpoints.

Tolerance: 1e-4 x the largest |logit| (logits are O(1) here). Measured differences are ~1e-6
(float32 summation order: fused vs split score halves, expert accumulation order), so the bar
catches any semantic error — each covered feature is shown to move logits by > 0.1 when it is
switched off (test_features_matter), i.e. three orders of magnitude above the bar.
"""

from __future__ import annotations

import json
import os
import shutil

import mlx.core as mx
import numpy as np
import pytest

from helpers_models import (CONFIGS, build_config_model, build_hf_model, random_tokens, save_checkpoint,
                            state_dict_numpy, torch_logits)

from colibri_mlx.models import load_model

RTOL_OF_SCALE = 1e-4
# Legacy rope style on one config, kimi_k2 model_type on another: both readers and the alias.
SAVE_OPTIONS = {"v3_plainq_groups_yarn": dict(rope_style="legacy"), "v3_lora_g1": dict(model_type="kimi_k2")}


def assert_logits_close(got, ref, what=""):
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, what
    assert np.isfinite(got).all(), what
    err, scale = np.abs(got - ref).max(), np.abs(ref).max()
    assert scale > 0.5, f"{what}: degenerate logits (scale {scale})"
    assert err <= RTOL_OF_SCALE * scale, f"{what}: max |diff| {err:.3g} > {RTOL_OF_SCALE} x {scale:.3g}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, checkpoint dir, our model)."""
    out = {}
    for name in CONFIGS:
        hf = build_config_model(name)
        path = save_checkpoint(hf, str(tmp_path_factory.mktemp(name)), **SAVE_OPTIONS.get(name, {}))
        out[name] = (hf, path, load_model(path, dtype="float32"))
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("length", [3, 6, 20])
def test_prefill_logits_match_transformers(checkpoints, name, length):
    # 3 tokens: absorbed attention; 6/20: prefill path; DSA (index_topk 8) inactive at 3/6, active at 20.
    hf, _, model = checkpoints[name]
    tokens = random_tokens(length, seed=length)
    assert_logits_close(model(mx.array(tokens)), torch_logits(hf, tokens), f"{name} L={length}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decode_matches_full_recompute(checkpoints, name):
    hf, _, model = checkpoints[name]
    tokens = random_tokens(16, seed=7)
    full = np.array(model(mx.array(tokens)))
    assert_logits_close(full, torch_logits(hf, tokens), name)
    cache = model.make_cache()
    steps = [np.array(model(mx.array(tokens[:, :5]), cache))]
    for i in range(5, 16):  # crosses index_topk = 8 while decoding
        steps.append(np.array(model(mx.array(tokens[:, i:i + 1]), cache)))
    assert cache.offset == 16
    assert_logits_close(np.concatenate(steps, axis=1), full, f"{name} cached")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(checkpoints, name):
    import torch

    from colibri_mlx.generate import generate_tokens

    hf, _, model = checkpoints[name]
    prompt = random_tokens(5, seed=11)
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=32, min_new_tokens=32,
                          do_sample=False, pad_token_id=0)[0, 5:].tolist()
    ours = [t for t, _ in generate_tokens(model, prompt[0].tolist(), 32)]
    assert ours == ref


@pytest.mark.parametrize("name", ["v3_lora_g1", "glm_shared_yarn"])
def test_batch_with_left_padding_matches_single_runs(checkpoints, name):
    _, _, model = checkpoints[name]
    a, b = random_tokens(14, seed=1)[0], random_tokens(9, seed=2)[0]
    pad = len(a) - len(b)
    batch = np.stack([a, np.concatenate([np.full(pad, 5, np.int32), b])])
    cache = model.make_cache()
    batched = [np.array(model(mx.array(batch), cache, left_padding=[0, pad]))]
    next_tokens = random_tokens(4, seed=3, batch=2)
    for i in range(4):
        batched.append(np.array(model(mx.array(next_tokens[:, i:i + 1]), cache)))
    batched = np.concatenate(batched, axis=1)
    for row, seq, skip in ((0, a, 0), (1, b, pad)):
        alone = np.array(model(mx.array(np.concatenate([seq, next_tokens[row]])[None])))
        assert_logits_close(batched[row:row + 1, skip:], alone, f"{name} row {row}")


def test_features_matter(checkpoints):
    """Each feature changes the logits far beyond the tolerance, so the parity tests can fail."""
    tokens = mx.array(random_tokens(20, seed=20))

    def change(name, mutate):
        hf, path, _ = checkpoints[name]
        model = load_model(path, dtype="float32")
        ref = np.array(model(tokens))
        mutate(model)
        return np.abs(np.array(model(tokens)) - ref).max()

    def no_groups(m):
        m.args.n_group = 1

    def no_mscale(m):
        for layer in m.layers:
            layer.self_attn.scale = m.args.qk_head_dim**-0.5

    def no_dsa(m):
        for layer in m.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.topk = 10**6

    def no_bias(m):
        for layer in m.layers:
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.bias = mx.zeros_like(layer.mlp.router.bias)

    assert change("v3_plainq_groups_yarn", no_groups) > 0.1
    assert change("v3_plainq_groups_yarn", no_mscale) > 0.1
    assert change("v32_groups", no_dsa) > 0.1
    assert change("glm_shared_yarn", no_dsa) > 0.1
    assert change("v3_lora_g1", no_bias) > 0.1


def test_configs_cover_the_variants(checkpoints):
    args = {name: m.args for name, (_, _, m) in checkpoints.items()}
    assert {a.n_group > 1 for a in args.values()} == {True, False}
    assert {a.q_lora_rank is None for a in args.values()} == {True, False}
    assert {a.rope["rope_type"] for a in args.values()} == {"default", "yarn"}
    glm = args["glm_shared_yarn"]
    assert glm.indexer_types == ["full", "shared", "full", "shared"]
    assert args["v3_lora_g1"].model_type == "kimi_k2"
    layer_kinds = [layer.self_attn.indexer is not None for layer in checkpoints["glm_shared_yarn"][2].layers]
    assert layer_kinds == [True, False, True, False]


def test_fp8_checkpoint_matches_dequantized_transformers(tmp_path):
    hf = build_hf_model("deepseek_v3", seed=5, n_routed_experts=8)
    path = save_checkpoint(hf, str(tmp_path / "fp8"), fp8=True)  # hf now holds the dequantized weights
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        assert "model.layers.0.self_attn.kv_b_proj.weight_scale_inv" in f.keys()
    tokens = random_tokens(12, seed=4)
    assert_logits_close(load_model(path, dtype="float32")(mx.array(tokens)), torch_logits(hf, tokens), "fp8")


# ------------------------------------------------------------------------------- bad input


@pytest.fixture
def copy_of(checkpoints, tmp_path):
    def make(name="v3_lora_g1"):
        dst = tmp_path / "copy"
        shutil.copytree(checkpoints[name][1], dst)
        return dst

    return make


def _edit_config(path, **changes):
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(changes)
    cfg_file.write_text(json.dumps(cfg))


def _rewrite_tensors(path, edit):
    from safetensors.numpy import load_file, save_file

    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))


def test_unknown_model_type(copy_of):
    path = copy_of()
    _edit_config(path, model_type="llama")
    with pytest.raises(ValueError, match="unknown model_type 'llama'"):
        load_model(path)


def test_missing_tensor(copy_of):
    path = copy_of()
    _rewrite_tensors(path, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"):
        load_model(path)


def test_shape_disagrees_with_config(copy_of):
    path = copy_of()
    _edit_config(path, kv_lora_rank=40)
    with pytest.raises(ValueError, match=r"kv_a_proj_with_mqa.weight.*\[48, 64\].*\[56, 64\]"):
        load_model(path)


def test_checkpoint_for_another_config(copy_of):
    path = copy_of()
    _edit_config(path, num_hidden_layers=2)  # the checkpoint has 3 layers
    with pytest.raises(ValueError, match=r"model.layers.2.*another config"):
        load_model(path)


def test_mtp_layer_is_loaded_and_kept(copy_of, checkpoints):
    path = copy_of()
    rng = np.random.default_rng(0)

    def add_mtp(t):
        for name in [n for n in t if n.startswith("model.layers.2.")]:
            t[name.replace("layers.2.", "layers.3.")] = t[name] + 0.5
        for name, shape in (("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
                            ("shared_head.norm.weight", (64,))):
            t["model.layers.3." + name] = rng.standard_normal(shape).astype(np.float32)

    _rewrite_tensors(path, add_mtp)
    model = load_model(path, dtype="float32")
    assert len(model.mtp_layers) == 1 and model.mtp_layers[0].eh_proj.shape == (64, 128)
    tokens = mx.array(random_tokens(6, seed=1))
    np.testing.assert_array_equal(np.array(model(tokens)), np.array(checkpoints["v3_lora_g1"][2](tokens)))


def test_prompt_longer_than_context(checkpoints):
    _, _, model = checkpoints["v3_lora_g1"]
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=512"):
        model(mx.zeros((1, 513), dtype=mx.int32))


def test_state_dict_helper_round_trip(checkpoints):
    # The numpy state dict (used by the container tests) holds per-expert names.
    hf, _, _ = checkpoints["v3_lora_g1"]
    names = state_dict_numpy(hf)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names


# ---------------------------------------------------------------------- quantized containers


@pytest.mark.parametrize("name", ["v3_lora_g1", "glm_shared_yarn"])
def test_quantized_container_matches_dequantized_transformers(checkpoints, tmp_path, name):
    """Every fmt 1-6 in one container; the oracle is transformers with our dequantized weights."""
    from helpers_models import load_effective_weights, write_container

    arch, overrides = CONFIGS[name]
    hf, path, _ = checkpoints[name]
    effective = write_container(state_dict_numpy(hf), path, str(tmp_path / "container"))
    model = load_model(tmp_path / "container", dtype="float32")
    fmts = {getattr(model.layers[2].mlp.experts[e][0], "fmt", None) for e in range(8)}
    assert fmts == {1, 2, 3, 4, 5}
    oracle = build_hf_model(arch, **overrides)
    load_effective_weights(oracle, effective)
    tokens = random_tokens(20, seed=8)
    got = np.array(model(mx.array(tokens)))
    assert_logits_close(got, torch_logits(oracle, tokens), f"{name} container")
    assert np.abs(got - torch_logits(hf, tokens)).max() > 1e-3  # quantization did change the model
    cache = model.make_cache()  # absorbed decode with a quantized kv_b
    steps = [np.array(model(mx.array(tokens[:, :17]), cache))]
    steps += [np.array(model(mx.array(tokens[:, i:i + 1]), cache)) for i in range(17, 20)]
    assert_logits_close(np.concatenate(steps, axis=1), got, f"{name} container cached")


@pytest.mark.slow
def test_e8_container_matches_dequantized_transformers(tmp_path):
    """fmt 6 routed experts (needs I % 256 == 0: hidden and expert width 256)."""
    from helpers_models import load_effective_weights, write_container

    overrides = dict(hidden_size=256, moe_intermediate_size=256, num_hidden_layers=2, n_routed_experts=4,
                     num_experts_per_tok=2)
    hf = build_hf_model("deepseek_v3", seed=6, **overrides)
    path = save_checkpoint(hf, str(tmp_path / "hf"))
    e8_experts = lambda name, shape: (6, None) if ".experts." in name else None
    effective = write_container(state_dict_numpy(hf), path, str(tmp_path / "container"), e8_experts)
    model = load_model(tmp_path / "container", dtype="float32")
    assert {model.layers[1].mlp.experts[e][2].fmt for e in range(4)} == {6}
    oracle = build_hf_model("deepseek_v3", seed=6, **overrides)
    load_effective_weights(oracle, effective)
    tokens = random_tokens(10, seed=8)
    assert_logits_close(model(mx.array(tokens)), torch_logits(oracle, tokens), "e8 container")


def test_top_k_mask_breaks_ties_by_position():
    from colibri_mlx.models.deepseek_v3 import top_k_mask

    scores = mx.array([[0.0, 2.0, 1.0, 1.0, 1.0, -mx.inf, 1.0]])
    assert np.array(top_k_mask(scores, 3)).tolist() == [[False, True, True, True, False, False, False]]
    assert np.array(top_k_mask(scores, 1)).tolist() == [[False, True, False, False, False, False, False]]


def _copy_without(src, dst, fragment: str):
    """A copy of checkpoint ``src`` without the tensors whose names contain ``fragment``."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(str(shard))
        save_file({k: v for k, v in tensors.items() if fragment not in k}, str(shard))
    return dst


def test_dsa_container_without_indexer_runs_dense_attention(checkpoints, tmp_path):
    # Upstream's converter writes the DSA indexer only in a separate --indexer pass, so most GLM-5
    # containers lack it; such a directory loads with dense attention and says so.
    hf, path, sparse = checkpoints["glm_shared_yarn"]
    dst = _copy_without(path, tmp_path / "no_indexer", ".indexer.")
    with pytest.warns(UserWarning, match="no DSA indexer weights, attention is dense"):
        dense = load_model(str(dst), dtype="float32")
    assert dense.dense_attention_reason and sparse.dense_attention_reason is None
    assert all(layer.self_attn.indexer is None for layer in dense.layers)
    short = random_tokens(6, seed=6)  # within index_topk=8: dense is DSA
    assert_logits_close(dense(mx.array(short)), torch_logits(hf, short), "dense within index_topk")
    long = random_tokens(20, seed=20)  # beyond it the sparse model differs
    assert np.abs(np.asarray(dense(mx.array(long))) - torch_logits(hf, long)).max() > 1e-3


def test_partial_indexer_is_still_refused(checkpoints, tmp_path):
    _, path, _ = checkpoints["glm_shared_yarn"]
    dst = _copy_without(path, tmp_path / "partial_indexer", "layers.0.self_attn.indexer.wk")
    with pytest.raises(ValueError, match="missing tensor .*layers.0.self_attn.indexer.wk"):
        load_model(str(dst))


def test_loader_and_container_agree_on_supported_model_types():
    # container.shapes (inspect, converter) and the model keep their own tables; they must agree.
    from colibri_mlx.container import shapes
    from colibri_mlx.models.deepseek_v3 import DSA_FAMILIES, MODEL_TYPES

    assert set(MODEL_TYPES) == shapes.MODEL_TYPES
    assert {t for t, family in MODEL_TYPES.items() if family in DSA_FAMILIES} == shapes.DSA_MODEL_TYPES

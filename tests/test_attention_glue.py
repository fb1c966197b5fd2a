"""The attention block's glue around the kernels: the stacked x projections (q_a or q_proj with
kv_a_proj_with_mqa in one weight) give exactly the logits of separate projections, prefill and
cached decode, float checkpoints and quantized containers (reference path: bit-exact)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from helpers_models import CONFIGS, build_config_model, random_tokens, save_checkpoint

from colibri_mlx import kernels
from colibri_mlx.models import load_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name in CONFIGS:
        out[name] = save_checkpoint(build_config_model(name), str(tmp_path_factory.mktemp(name)))
    return out


@pytest.fixture(scope="module")
def container(checkpoints, tmp_path_factory):
    from helpers_models import state_dict_numpy, write_container

    path = checkpoints["glm_shared_yarn"]
    out = str(tmp_path_factory.mktemp("container"))
    write_container(state_dict_numpy(build_config_model("glm_shared_yarn")), path, out)
    return out


GPU = mx.default_device().type == mx.gpu


def assert_same_logits(a, b):
    """Bit-exact on the CPU (the reference path computes every output row on its own); on a GPU
    the prefill matmuls may tile a stacked weight differently: float32 rounding only."""
    if not GPU:
        np.testing.assert_array_equal(a, b)
    else:
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


def prefill_then_decode(model, tokens, n_prefill):
    cache = model.make_cache()
    steps = [np.array(model(mx.array(tokens[:, :n_prefill]), cache))]
    steps += [np.array(model(mx.array(tokens[:, i:i + 1]), cache)) for i in range(n_prefill, tokens.shape[1])]
    return np.concatenate(steps, axis=1)


def load_pair(path, monkeypatch):
    fused = load_model(path, dtype="float32")
    with monkeypatch.context() as m:
        m.setattr(kernels, "concat_rows", lambda weights: None)
        separate = load_model(path, dtype="float32")
    return fused, separate


@pytest.mark.parametrize("name", list(CONFIGS))
def test_stacked_x_projections_equal_separate_ones(checkpoints, name, monkeypatch):
    fused, separate = load_pair(checkpoints[name], monkeypatch)
    assert all(layer.self_attn.x_proj is not None for layer in fused.layers)
    assert all(layer.self_attn.x_proj is None for layer in separate.layers)
    tokens = random_tokens(12, seed=3)
    assert_same_logits(prefill_then_decode(fused, tokens, 9), prefill_then_decode(separate, tokens, 9))


def test_stacked_quantized_x_projections_equal_separate_ones(container, monkeypatch):
    fused, separate = load_pair(container, monkeypatch)
    attn = fused.layers[0].self_attn
    assert isinstance(attn.x_proj, kernels.QTensor) and attn.x_proj.fmt == attn.kv_a_proj.fmt
    # one copy of the weights: the parts are views of the stacked bytes, same size as before
    assert attn.q_a_proj.nbytes + attn.kv_a_proj.nbytes == attn.x_proj.nbytes
    tokens = random_tokens(20, seed=8)
    assert_same_logits(prefill_then_decode(fused, tokens, 17), prefill_then_decode(separate, tokens, 17))


def qgemv_calls_per_decode_step(model, tokens):
    cache = model.make_cache()
    model(mx.array(tokens[:, :-1]), cache)
    kernels.reset_counters()
    mx.eval(model(mx.array(tokens[:, -1:]), cache))
    return sum(n for k, n in kernels.counters()["calls"].items() if k.startswith("qgemv/"))


def test_unstackable_x_projections_stay_separate(checkpoints, tmp_path):
    """kv_a_proj_with_mqa in another fmt than q_a_proj: two weights kept as stored, one more
    qmatmul per layer than the stacked container, and one more again on a GPU: the stacked
    rows' fast path leaves q_b's projection to mla_decode's first launch (mla_qb_qabs)."""
    from helpers_models import default_container_formats, state_dict_numpy, write_container

    def kv_a_per_row(name, shape):
        return (2, None) if "kv_a_proj_with_mqa" in name else default_container_formats(name, shape)

    state = state_dict_numpy(build_config_model("v3_lora_g1"))
    write_container(state, checkpoints["v3_lora_g1"], str(tmp_path / "mixed"), kv_a_per_row)
    write_container(state, checkpoints["v3_lora_g1"], str(tmp_path / "same"))
    mixed, same = load_model(tmp_path / "mixed", dtype="float32"), load_model(tmp_path / "same", dtype="float32")
    for layer in mixed.layers:
        attn = layer.self_attn
        assert attn.x_proj is None and (attn.q_a_proj.fmt, attn.kv_a_proj.fmt) == (4, 2)
    assert all(layer.self_attn.x_proj is not None for layer in same.layers)
    tokens = random_tokens(6, seed=2)
    n_layers = len(mixed.layers)
    folded = n_layers if kernels.backend() != kernels.REFERENCE else 0
    assert qgemv_calls_per_decode_step(mixed, tokens) == qgemv_calls_per_decode_step(same, tokens) + n_layers + folded


# ---------------------------------------------------------------------------------------
# RoPE: one mx.fast.rope op per decode step for q and for k


YARN_AF1 = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)       # DeepSeek-V3: factor 1
YARN_AF = dict(YARN_AF1, mscale=0.9, mscale_all_dim=1.0)                          # attention factor != 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.skipif(not GPU, reason="no GPU"))])
@pytest.mark.parametrize("params", [dict(rope_type="default", rope_theta=10000.0), YARN_AF1, YARN_AF],
                         ids=["default", "yarn", "yarn_mscale"])
@pytest.mark.parametrize("position", [0, 7, 4095, 100_000, 163_839])
def test_fast_rope_matches_cos_sin_rotation(params, position, device):
    """On the CPU mx.fast.rope runs MLX's op-by-op fallback; on a GPU its kernel computes cos/sin
    itself (MLX's Metal kernel with metal::fast::cos): the GPU case shows whether that stays
    within float rounding of the cos/sin path at large positions."""
    with mx.stream(mx.cpu if device == "cpu" else mx.gpu):
        _check_fast_rope(params, position)


def _check_fast_rope(params, position):
    from colibri_mlx.models.rope import apply_rope, make_rope

    rope = make_rope(params, 64, 163_840, interleaved=False)
    cos, sin = rope.cos_sin(mx.array([[position]], dtype=mx.int32))
    rng = np.random.default_rng(position)
    for shape in ((1, 8, 1, 64), (1, 1, 64)):      # queries [B, H, 1, dim], the key [B, 1, dim]
        x = mx.array(rng.standard_normal(shape).astype(np.float32))
        want = apply_rope(x if len(shape) == 4 else x[:, None], cos, sin, interleaved=False)
        want = np.asarray(want if len(shape) == 4 else want[:, 0], dtype=np.float64)
        got = np.asarray(rope.apply_fast(x, mx.array(position, dtype=mx.int32)), dtype=np.float64)
        # Both sides turn by the same float32 angle fl(position * inv_freq) where 1/fast_freqs
        # gives inv_freq back; elsewhere the angle moves by one ulp of inv_freq times position.
        # On top: float32 rounding of a*c - b*s (a few 2^-24 of max|x|).
        inv = np.asarray(rope.inv_freq, np.float64)
        inexact = (1.0 / np.asarray(rope.fast_freqs, np.float64)).astype(np.float32) != inv
        angle_err = position * (inv[inexact].max() if inexact.any() else 0.0) * 2.0**-23
        tol = np.abs(np.asarray(x)).max() * (8 * 2.0**-24 + 2 * angle_err)
        assert np.abs(got - want).max() <= tol, (params["rope_type"], position, shape)
        # and it is a rotation: a wrong position (one step off) is far outside the tolerance
        off = np.asarray(rope.apply_fast(x, mx.array(position + 1, dtype=mx.int32)), dtype=np.float64)
        assert np.abs(off - want).max() > 100 * tol


def test_fast_rope_freqs_round_trip():
    from colibri_mlx.models.rope import make_rope

    rope = make_rope(YARN_AF1, 64, 163_840)
    inv, freqs = np.asarray(rope.inv_freq), np.asarray(rope.fast_freqs)
    exact = (1.0 / freqs.astype(np.float64)).astype(np.float32) == inv
    assert exact.mean() >= 0.9
    assert np.all(np.abs((1.0 / freqs.astype(np.float64)) / inv - 1) <= 2.0**-23)   # one ulp at most


def count_cos_sin_rotations(monkeypatch):
    """The shapes of the cos/sin rotations the model makes (``apply_rope``). A decode row at an
    offset is rotated elsewhere: by mx.fast.rope on the reference path, in mla_rows / mla_qabs
    on the GPU; counting what leaves cos/sin holds on every backend."""
    from colibri_mlx.models import deepseek_v3

    calls = []
    real = deepseek_v3.apply_rope
    monkeypatch.setattr(deepseek_v3, "apply_rope", lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k))
    return calls


def test_decode_rotates_with_fast_rope_only_for_one_row_of_one_sequence(checkpoints, monkeypatch):
    model = load_model(checkpoints["v3_lora_g1"], dtype="float32")
    calls = count_cos_sin_rotations(monkeypatch)
    tokens = random_tokens(8, seed=4, batch=2)
    n = len(model.layers)
    H, r = model.args.num_attention_heads, model.args.qk_rope_head_dim
    cache = model.make_cache()
    model(mx.array(tokens[:1, :7]), cache)                  # prefill: cos/sin for q and k
    assert sorted(calls[:2]) == [(1, 1, 7, r), (1, H, 7, r)] and len(calls) == 2 * n
    model(mx.array(tokens[:1, 7:]), cache)                  # decode, one sequence: at an offset
    assert len(calls) == 2 * n
    cache = model.make_cache()
    model(mx.array(tokens[:, :7]), cache)
    del calls[:]
    model(mx.array(tokens[:, 7:]), cache)                   # a batch of two: cos/sin
    assert sorted(calls[:2]) == [(2, 1, 1, r), (2, H, 1, r)] and len(calls) == 2 * n


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fast_rope_decode_equals_cos_sin_decode(checkpoints, name, monkeypatch):
    """The whole model: decode rotating at an offset (mx.fast.rope, or the GPU kernels) against
    decode with the cos/sin rotation."""
    from colibri_mlx.models import deepseek_v3

    model = load_model(checkpoints[name], dtype="float32")
    tokens = random_tokens(12, seed=5)
    monkeypatch.setenv("COLIBRI_COMPILE", "0")   # counts Python calls: no replayed graphs
    calls = count_cos_sin_rotations(monkeypatch)
    fast = prefill_then_decode(model, tokens, 6)
    n_fast = len(calls)
    real = deepseek_v3.Model._positions_and_mask
    # cos/sin and no offset (padded=True: the general path, whose mask lets every key through)
    monkeypatch.setattr(deepseek_v3.Model, "_positions_and_mask",
                        lambda self, pad, start, L, padded=True: real(self, pad, start, L, True)[:3] + (None,))
    slow = prefill_then_decode(model, tokens, 6)
    # q and k of every layer and decode step left cos/sin (an indexer's rotation stays)
    assert len(calls) - 2 * n_fast == 2 * len(model.layers) * 6
    # float32 rounding through a few layers: measured ~1e-7 of the logit scale
    assert np.abs(fast - slow).max() <= 1e-5 * np.abs(slow).max()

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
    np.testing.assert_array_equal(prefill_then_decode(fused, tokens, 9), prefill_then_decode(separate, tokens, 9))


def test_stacked_quantized_x_projections_equal_separate_ones(container, monkeypatch):
    fused, separate = load_pair(container, monkeypatch)
    attn = fused.layers[0].self_attn
    assert isinstance(attn.x_proj, kernels.QTensor) and attn.x_proj.fmt == attn.kv_a_proj.fmt
    # one copy of the weights: the parts are views of the stacked bytes, same size as before
    assert attn.q_a_proj.nbytes + attn.kv_a_proj.nbytes == attn.x_proj.nbytes
    tokens = random_tokens(20, seed=8)
    np.testing.assert_array_equal(prefill_then_decode(fused, tokens, 17), prefill_then_decode(separate, tokens, 17))


def qgemv_calls_per_decode_step(model, tokens):
    cache = model.make_cache()
    model(mx.array(tokens[:, :-1]), cache)
    kernels.reset_counters()
    mx.eval(model(mx.array(tokens[:, -1:]), cache))
    return kernels.counters()["calls"]["qgemv/reference"]


def test_unstackable_x_projections_stay_separate(checkpoints, tmp_path):
    """kv_a_proj_with_mqa in another fmt than q_a_proj: two weights kept as stored, one more
    qmatmul per layer than the stacked container."""
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
    assert qgemv_calls_per_decode_step(mixed, tokens) == qgemv_calls_per_decode_step(same, tokens) + n_layers

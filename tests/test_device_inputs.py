"""kernels.device_inputs: per-step int arrays made by MLX ops on CUDA hold the host values.

The CUDA branch is plain MLX ops (arange, where, a broadcast copy), so it runs on the CPU here;
what it is for (device memory instead of host-written managed pages) shows only in a GPU
profile (scripts/bench/profile_step.py)."""

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx.kernels import device_inputs, mla

BACKENDS = ("cuda", "metal")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index", [0, 6, 16])
def test_int32s_varying_holds_the_values(backend, index):
    rng = np.random.default_rng(index)
    for _ in range(3):
        values = tuple(int(v) for v in rng.integers(-5, 1 << 20, 17))
        got = device_inputs.int32s_varying(values, index, backend)
        assert got.dtype == mx.int32 and got.shape == (17,)
        assert tuple(np.array(got).tolist()) == values


def test_int32s_varying_host_array_cached_off_cuda():
    values = (3, 1, 4, 1, 5, 9, 2, 6)
    assert device_inputs.int32s_varying(values, 6, "metal") is device_inputs.int32s_varying(values, 6, "metal")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("start, n", [(0, 1), (7, 2), (4095, 8)])
def test_int32_range(backend, start, n):
    got = device_inputs.int32_range(start, n, backend)
    assert got.dtype == mx.int32
    np.testing.assert_array_equal(np.array(got), np.arange(start, start + n, dtype=np.int32))


@pytest.mark.parametrize("dtype, shape", [(mx.uint32, (1, 1)), (mx.int32, (1,)), (mx.int32, (1, 2)),
                                          (mx.int64, (1, 1)), (mx.uint32, ())])
def test_device_index_widens_small_ids(dtype, shape):
    ids = mx.array(np.arange(7, 7 + int(np.prod(shape))).reshape(shape), dtype=dtype)
    got = device_inputs.device_index(ids, "cuda")
    assert got is not ids                       # a GPU copy, viewed back
    assert got.shape == ids.shape and got.dtype == ids.dtype
    np.testing.assert_array_equal(np.array(got), np.array(ids))
    table = mx.array(np.random.default_rng(1).standard_normal((32, 5)).astype(np.float32))
    np.testing.assert_array_equal(np.array(table[got]), np.array(table)[np.array(ids)])


def test_device_index_leaves_wide_ids_and_other_backends():
    wide = mx.array([[1, 2, 3]], dtype=mx.int32)      # 12 bytes: not in the small-size pool
    assert device_inputs.device_index(wide, "cuda") is wide
    small = mx.array([[4]], dtype=mx.uint32)
    assert device_inputs.device_index(small, "metal") is small
    assert device_inputs.device_index([[4]], "cuda") == [[4]]


@pytest.mark.parametrize("rows, length", [(1, 9), (4, 12)])
def test_step_params_on_device_equal_host(rows, length, monkeypatch):
    """step_params' CUDA array (made by ops) equals the host-built one for the same launches."""
    model_kv = mx.zeros((1, 16, 48))
    kv_b = mx.zeros((2 * 32, 32))
    kw = dict(joint=True, rows=rows, causal=rows > 1, backend="cuda")
    made = mla.step_params(kv_b, model_kv, 2, 16, 16, 16, mx.float32, length, **kw)
    monkeypatch.setattr(device_inputs, "on_device", lambda backend: False)
    host = mla.step_params(kv_b, model_kv, 2, 16, 16, 16, mx.float32, length, **kw)
    assert made is not host and made.dtype == host.dtype == mx.int32
    np.testing.assert_array_equal(np.array(made), np.array(host))
    assert np.array(made)[mla.PARAM_LENGTH] == length and np.array(made)[9] == rows


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [0, 1, 40000])
def test_int32_scalar(backend, value):
    got = device_inputs.int32_scalar(value, backend)
    assert got.shape == () and got.dtype == mx.int32 and got.item() == value


def test_model_steps_with_device_made_inputs(tmp_path, monkeypatch):
    """A tiny model's decode row and verify rows (compiled per layer) after a prompt give the same
    hidden states with the positions, step params and token index made by ops as from host data."""
    from colibri_mlx.kernels import compiled
    from colibri_mlx.models.loading import load_model

    from helpers_tiny import CONFIG, write_tiny_container

    config = dict(CONFIG, first_k_dense_replace=2, num_nextn_predict_layers=1, max_position_embeddings=64)
    model = load_model(write_tiny_container(tmp_path, config, seed=5), dtype="float32")
    monkeypatch.setenv(compiled.ENV_VAR, "1")
    prompt = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5]], dtype=mx.int32)

    def steps():
        compiled.clear()
        cache = model.make_cache()
        model.hidden_states(prompt, cache)
        out = []
        for tokens in ([[7]], [[2, 7, 1, 8]], [[4]], [[3, 5]]):
            h = model.hidden_states(mx.array(tokens, dtype=mx.uint32 if len(tokens[0]) == 1 else mx.int32), cache)
            out.append(np.array(h))
        return out

    want = steps()
    monkeypatch.setattr(device_inputs, "on_device", lambda backend: True)
    for g, w in zip(steps(), want):
        np.testing.assert_array_equal(g, w)

"""GGUF types (fmt 11-28) on the reference path: the pure-MLX decode bit-exact against the numpy
decoders (themselves bit-exact against gguf, tests/test_gguf_quant.py) for every type; the row
operations; qmatmul; and a tiny model holding GGUF weights against the same model holding their
float32 decodes."""

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx import kernels
from colibri_mlx.formats import QTensor
from colibri_mlx.formats.gguf_quant import GGUF_TYPES, dequantize_gguf, qtensor_from_gguf
from colibri_mlx.kernels import dispatch, gguf_formats
from helpers_gguf import assert_bits_equal, fixtures, random_gguf_qtensor, random_gguf_raw


@pytest.fixture(autouse=True)
def cpu():
    """Bit-equality to numpy is a property of MLX's CPU float32 arithmetic (a GPU may contract
    ``a * b - c`` into one rounding)."""
    with mx.stream(mx.cpu):
        yield


@pytest.fixture
def reference():
    with kernels.force_reference():
        yield


@pytest.mark.parametrize("name", list(GGUF_TYPES))
def test_mlx_decode_bit_exact_every_type(name):
    t, data = GGUF_TYPES[name], fixtures()
    rng = np.random.default_rng(t.fmt)
    raws = [data[k] for k in (name, f"{name}_imatrix") if k in data]
    raws.append(rng.integers(0, 256, (5, 2 * t.type_size), dtype=np.uint8))   # NaN / Inf scales too
    raws.append(random_gguf_raw(name, 3, 512, seed=t.fmt))
    for raw in raws:
        qt = qtensor_from_gguf("w", name, raw, (raw.shape[0], raw.shape[1] // t.type_size * t.block_size))
        with np.errstate(all="ignore"):
            ref = dequantize_gguf(name, raw)
        assert_bits_equal(np.asarray(gguf_formats.dequantize_rows(qt, 0, qt.O)), ref)
        assert_bits_equal(np.asarray(gguf_formats.dequantize_rows(qt.to_mlx(), 1, qt.O - 1)), ref[1:-1])


def test_reference_dequantize_routes_gguf():
    from colibri_mlx.kernels import reference

    qt = random_gguf_qtensor("Q5_K", 6, 512, seed=1)
    assert_bits_equal(np.asarray(reference.dequantize_rows(qt, 2, 5)), qt.dequantize()[2:5])


@pytest.mark.parametrize("held", ["numpy", "mlx"])
def test_row_operations_move_whole_rows(held):
    a = random_gguf_qtensor("IQ4_XS", 6, 256, seed=2, tensor="a")
    b = random_gguf_qtensor("IQ4_XS", 3, 256, seed=3, tensor="b")
    wa, wb = a.dequantize(), b.dequantize()
    if held == "mlx":
        a, b = a.to_mlx(), b.to_mlx()
    both = kernels.concat_rows([a, b])
    assert (both.fmt, both.O, both.I, both.name) == (a.fmt, 9, 256, "a+b")
    assert_bits_equal(np.asarray(gguf_formats.dequantize_rows(both, 0, 9)), np.concatenate([wa, wb]))
    part = kernels.rows_of(a, 1, 5)
    assert part.O == 4 and type(part.packed) is type(a.packed)
    assert_bits_equal(np.asarray(gguf_formats.dequantize_rows(part, 1, 3)), wa[2:4])
    order = [3, 0, 5, 1, 4, 2]
    moved = kernels.take_rows(a, order)
    assert_bits_equal(moved.dequantize(), wa[order])
    ids = mx.array([[5, 0], [5, 2]])
    assert_bits_equal(np.asarray(gguf_formats.embedding_rows(a, ids)), wa[np.array(ids)])
    # not row-stackable: another type, another width, a float weight
    assert kernels.concat_rows([a, random_gguf_qtensor("Q4_K", 3, 256)]) is None
    assert kernels.concat_rows([a, random_gguf_qtensor("IQ4_XS", 3, 512)]) is None
    assert kernels.concat_rows([a, mx.zeros((3, 256))]) is None


def test_decline_reason():
    from kernel_oracle import random_mlx_qtensor, random_qtensor

    assert gguf_formats.decline_reason(random_qtensor(4, 8, 64, gs=32)) is None
    assert gguf_formats.decline_reason(random_mlx_qtensor("affine", 4, 32, 8, 64)) is None
    qt = random_gguf_qtensor("Q6_K", 4, 256)
    assert gguf_formats.decline_reason(qt) is None
    short = QTensor(qt.packed[:3], qt.scales, qt.fmt, 4, 256, 256, "blk.0.ffn_down.weight")
    assert "Q6_K blk.0.ffn_down.weight: 630 bytes for 4 rows of 210" in gguf_formats.decline_reason(short)
    assert kernels.mlx_formats.decline_reason(qt) is None and not kernels.mlx_formats.is_mlx(qt)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "IQ2_XXS", "IQ1_M"])
@pytest.mark.parametrize("S", [1, 9])
def test_reference_qmatmul(reference, name, S):
    qt = random_gguf_qtensor(name, 24, 512, seed=S)
    x = np.random.default_rng(S).standard_normal((S, 512)).astype(np.float32)
    w = qt.dequantize().astype(np.float64)
    y = np.asarray(kernels.qmatmul(mx.array(x), qt))
    terms = np.abs(x.astype(np.float64)) @ np.abs(w).T
    assert (np.abs(y - x.astype(np.float64) @ w.T) / terms).max() < 1e-6


def _tiny_weights(config, seed=0):
    """Float weights of every tensor of ``config`` and, for each 2-D one but the router, a GGUF type
    (cycling through all of them: each type whose block size divides the row length)."""
    from helpers_tiny import tensor_shapes

    rng = np.random.default_rng(seed)
    names = list(GGUF_TYPES)
    floats, types, k = {}, {}, 0
    for name, shape in sorted(tensor_shapes(config).items()):
        if name.endswith(("norm.weight", "layernorm.weight")):
            floats[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif len(shape) == 1:
            floats[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif "mlp.gate.weight" in name:
            floats[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        else:
            fits = [n for n in names if shape[1] % GGUF_TYPES[n].block_size == 0]
            types[name] = fits[k % len(fits)]
            k += 1
    return floats, types


def test_model_with_gguf_weights_runs_on_reference_path(reference):
    from helpers_tiny import CONFIG, tensor_shapes

    from colibri_mlx.models.deepseek_v3 import Model, ModelArgs
    from colibri_mlx.models.loading import table_from_dict

    config = dict(CONFIG, hidden_size=256, moe_intermediate_size=256, intermediate_size=256, q_lora_rank=64)
    floats, types = _tiny_weights(config)
    shapes = tensor_shapes(config)
    assert set(GGUF_TYPES) <= set(types.values())
    gguf_w, float_w = {}, {}
    for i, (name, gtype) in enumerate(sorted(types.items())):
        shape = shapes[name]
        qt = random_gguf_qtensor(gtype, *shape, seed=i, rms=1.0 / np.sqrt(shape[1]), tensor=name)
        gguf_w[name], float_w[name] = qt, mx.array(qt.dequantize())
    for name, w in floats.items():
        gguf_w[name] = float_w[name] = mx.array(w)
    args = ModelArgs.from_config(config)
    tokens = mx.array([[3, 17, 250, 42, 9, 100]])
    dispatch.reset_counters()
    got = np.asarray(Model(args, table_from_dict(gguf_w), mx.float32)(tokens))
    counts = dispatch.counters()
    assert counts["fallbacks"] == {} and counts["calls"].get("qgemv/reference", 0) > 0, counts
    want = np.asarray(Model(args, table_from_dict(float_w), mx.float32)(tokens))
    assert np.isfinite(want).all() and want.std() > 0.1
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()

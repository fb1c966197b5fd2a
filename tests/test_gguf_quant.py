"""GGUF types (fmt 11-28): our decoders bit-exact against ``gguf.quants.dequantize`` on data
quantized by llama.cpp's own quantizer (tests/data/gguf_quants.npz, scripts/gguf/make_quant_fixtures.py)
and on random blocks; the IQ tables against gguf's; QTensor construction and its errors."""

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from colibri_mlx.formats import FormatError
from colibri_mlx.formats import gguf_quant as gq
from colibri_mlx.formats.gguf_quant import GGUF_TYPES, dequantize_gguf, qtensor_from_gguf
from helpers_gguf import assert_bits_equal, fixture_keys, fixtures, random_gguf_raw


def random_rows(t, rows=6, blocks=3, seed=0):
    return np.random.default_rng(seed + t.fmt).integers(0, 256, (rows, blocks * t.type_size), dtype=np.uint8)


def test_fixtures_cover_every_type():
    keys = set(fixture_keys())
    for name in GGUF_TYPES:
        assert name in keys or f"{name}_imatrix" in keys, name
    assert len(keys) >= len(GGUF_TYPES)


@pytest.mark.parametrize("key", fixture_keys())
def test_decode_bit_exact_on_llama_cpp_quants(key):
    data = fixtures()
    name = key.removesuffix("_imatrix")
    raw, x = data[key], data["x"]
    ref = gguf_dequantize(raw, gguf.GGMLQuantizationType[name])
    mine = dequantize_gguf(name, raw)
    assert_bits_equal(mine, ref)
    # the fixture is a quantization of x (not, say, another type's bytes): correlated per row
    # (IQ3_S cannot represent the all-zero block of row 3: it has no zero level)
    for r in range(x.shape[0]):
        assert np.corrcoef(mine[r], x[r])[0, 1] > 0.4, (key, r)


@pytest.mark.parametrize("name", list(GGUF_TYPES))
def test_decode_bit_exact_on_random_blocks(name):
    t = GGUF_TYPES[name]
    raw = random_rows(t)
    with np.errstate(all="ignore"):   # random float16 scales include NaN and Inf patterns
        ref = gguf_dequantize(raw, gguf.GGMLQuantizationType[name])
        mine = dequantize_gguf(t.fmt, raw)
    assert np.isfinite(ref).mean() > 0.8
    assert_bits_equal(mine, ref)


@pytest.mark.parametrize("name", list(GGUF_TYPES))
def test_decode_bit_exact_on_random_blocks_with_finite_scales(name):
    raw = random_gguf_raw(name, 4, 512, seed=GGUF_TYPES[name].fmt)
    ref = gguf_dequantize(raw, gguf.GGMLQuantizationType[name])
    assert np.isfinite(ref).all() and 0.02 < np.sqrt(np.mean(ref.astype(np.float64) ** 2)) < 0.1
    assert_bits_equal(dequantize_gguf(name, raw), ref)


def test_decode_in_chunks_matches_one_pass(monkeypatch):
    t = GGUF_TYPES["Q4_K"]
    raw = random_rows(t, rows=5, blocks=2, seed=7)
    whole = dequantize_gguf(t, raw)
    monkeypatch.setattr(gq, "DECODE_CHUNK_BLOCKS", 3)
    assert_bits_equal(dequantize_gguf(t, raw), whole)


def test_tables_match_gguf():
    from gguf import quants

    assert np.array_equal(gq.ksigns_iq2xs, np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8))
    assert np.array_equal(gq.kvalues_iq4nl, np.array(quants.IQ4_NL.kvalues, np.int8))
    for table, cls in [(gq.iq2xxs_grid, quants.IQ2_XXS), (gq.iq2xs_grid, quants.IQ2_XS), (gq.iq2s_grid, quants.IQ2_S),
                       (gq.iq3xxs_grid, quants.IQ3_XXS), (gq.iq3s_grid, quants.IQ3_S), (gq.iq1s_grid, quants.IQ1_S)]:
        cls.init_grid()
        assert table.shape == cls.grid_shape
        assert np.array_equal(table.astype(np.float32), cls.grid.reshape(cls.grid_shape)), cls.__name__


def test_type_table_matches_gguf():
    for name, t in GGUF_TYPES.items():
        qt = gguf.GGMLQuantizationType[name]
        assert t.ggml_type == int(qt)
        assert (t.block_size, t.type_size) == gguf.GGML_QUANT_SIZES[qt]
    assert sorted(gq.DECODERS) == sorted(GGUF_TYPES)


def test_qtensor_from_gguf_and_dequantize():
    data = fixtures()
    raw = data["Q6_K"]
    qt = qtensor_from_gguf("blk.0.ffn_up.weight", gguf.GGMLQuantizationType.Q6_K, raw.reshape(-1), (2, 4, 512))
    assert (qt.fmt, qt.O, qt.I, qt.gs) == (GGUF_TYPES["Q6_K"].fmt, 8, 512, 256)
    assert qt.packed.shape == (8, 420) and qt.scales.size == 0
    assert_bits_equal(qt.dequantize(), gguf_dequantize(raw, gguf.GGMLQuantizationType.Q6_K))
    by_name = qtensor_from_gguf("w", "iq2_xxs", data["IQ2_XXS_imatrix"], (8, 512))
    by_id = qtensor_from_gguf("w", 16, data["IQ2_XXS_imatrix"], (8, 512))
    assert by_name.fmt == by_id.fmt == GGUF_TYPES["IQ2_XXS"].fmt
    mlx_qt = qt.to_mlx()
    assert_bits_equal(mlx_qt.dequantize(), qt.dequantize())


@pytest.mark.parametrize("args,match", [
    ((0, np.zeros((2, 2048), np.uint8), (2, 512)), "blk.3.attn_q.weight: ggml type 0 is not"),
    (("TQ1_0", np.zeros(8, np.uint8), (2, 512)), "blk.3.attn_q.weight: ggml type 'TQ1_0' is not"),
    (("Q4_K", np.zeros((2, 144), np.uint8), (2, 200)), "blk.3.attn_q.weight: Q4_K rows of 200 weights"),
    (("Q4_K", np.zeros((2, 143), np.uint8), (2, 256)), r"blk.3.attn_q.weight: Q4_K \(2, 256\) needs 288 bytes"),
    (("Q8_0", np.zeros(34, np.uint8), (32,)), "blk.3.attn_q.weight: Q8_0 weight of shape"),
])
def test_qtensor_from_gguf_errors_name_the_tensor(args, match):
    with pytest.raises(FormatError, match=match):
        qtensor_from_gguf("blk.3.attn_q.weight", *args)


def test_dequantize_gguf_rejects_bad_rows():
    with pytest.raises(ValueError, match="Q4_0: rows of uint8 whole 18-byte blocks"):
        dequantize_gguf("Q4_0", np.zeros((2, 20), np.uint8))
    with pytest.raises(ValueError, match="not a GGUF quantized type"):
        dequantize_gguf(99, np.zeros((2, 18), np.uint8))

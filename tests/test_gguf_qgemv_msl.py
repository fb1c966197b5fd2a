"""qgemv on llama.cpp's GGUF block formats in the MSL simulator: the exact launch MLX would get
(``qgemv.launch_spec``), outputs poisoned first, compared with gguf-py's dequantization (bit-exact
to ggml's) widened to float64, within |delta| <= 1e-4 sum|x w| (kernel_oracle). Blocks are random
bytes with finite fp16 block scales, so every code, sub-scale and sign pattern is decoded.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx.formats.gguf_quant import GGUF_TYPES, qtensor_from_gguf
from colibri_mlx.kernels import dispatch, gguf_decode, qgemv
from colibri_mlx.kernels.reference import e8_grid_words
from helpers_gguf import fixture_keys, fixtures
from kernel_oracle import assert_close, dequant_gguf_f64 as gguf_decode_f64, random_gguf_qtensor, random_x

pytest.importorskip("gguf", reason="gguf-py is the dequantization oracle")

KERNEL_TYPES = [name for name, t in GGUF_TYPES.items() if t.fmt in gguf_decode.KERNEL_FMTS]
# The types of DeepSeek-V3 / Kimi-K2 mixes' hot tensors: fast tests and every setting swept; the
# others' sweeps are slow tests.
HOT_TYPES = ["Q4_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "Q8_0"]


def test_lookup_tables_are_ggmls():
    """The kernels' lookup input holds gguf-py's copies of ggml's tables (a transcription independent
    of the package's), and the fmt 6 grid at word 0 is iq3xxs_grid."""
    from gguf.quants import IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL

    words = gguf_decode.lookup_words()
    for cls, name, nbytes, dtype in [(IQ2_XXS, "iq2xxs_grid", 8, np.uint8), (IQ2_XS, "iq2xs_grid", 8, np.uint8),
                                     (IQ2_S, "iq2s_grid", 8, np.uint8), (IQ3_XXS, "iq3xxs_grid", 4, np.uint8),
                                     (IQ3_S, "iq3s_grid", 4, np.uint8), (IQ1_S, "iq1s_grid", 8, np.int8)]:
        cls.init_grid()
        off, n = gguf_decode.LOOKUP_LAYOUT[name]
        ours = words[off:off + n].view(dtype).reshape(-1, nbytes)
        np.testing.assert_array_equal(ours, np.asarray(cls.grid).reshape(-1, nbytes).astype(dtype), name)
    np.testing.assert_array_equal(words[:256], e8_grid_words())
    off, _ = gguf_decode.LOOKUP_LAYOUT["kvalues_iq4nl"]
    np.testing.assert_array_equal(words[off:off + 16].view(np.float32), np.array(IQ4_NL.kvalues, np.float32))


@pytest.mark.parametrize("header,prefix", [("gguf_decode.h", "QD_GG_"), ("cuda/gguf_decode.cuh", "GG_")])
def test_lookup_offsets_agree_with_the_kernels(header, prefix):
    """The table offsets the kernels index with are the ones lookup_words lays out."""
    import re

    text = (dispatch.KERNEL_DIR / header).read_text()
    found = {m.group(1): int(m.group(2)) for m in re.finditer(prefix + r"(\w+) = (\d+);", text)}
    names = {"IQ2XXS": "iq2xxs_grid", "IQ4NL": "kvalues_iq4nl", "IQ3S": "iq3s_grid", "IQ2XS": "iq2xs_grid",
             "IQ2S": "iq2s_grid", "IQ1S": "iq1s_grid"}
    assert found == {k: gguf_decode.LOOKUP_LAYOUT[v][0] for k, v in names.items()}
    spans = sorted(gguf_decode.LOOKUP_LAYOUT.values())
    assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:])) and sum(n for _, n in spans) == gguf_decode.LOOKUP_WORDS


def test_decline_reasons_name_the_type():
    qt = random_gguf_qtensor("Q4_K", 2, 256)
    assert qgemv.decline_reason_for(qt, 1, mx.float32) is None
    short = _shell(GGUF_TYPES["Q8_0"], I=48)
    assert "Q8_0 with I=48" in qgemv.decline_reason_for(short, 1, mx.float32)
    truncated = random_gguf_qtensor("Q6_K", 3, 256)
    truncated = type(truncated)(truncated.packed.reshape(-1)[:-2], truncated.scales, truncated.fmt, 3, 256, 256, "t")
    assert "Q6_K" in qgemv.decline_reason_for(truncated, 1, mx.float32)
    assert set(gguf_decode.KERNEL_FMTS) == {t.fmt for t in GGUF_TYPES.values()}


def _shell(t, I=None):
    """A one-row GGUF QTensor of zero bytes (no block content needed to decline)."""
    from colibri_mlx.formats import QTensor

    I = I or t.block_size
    return QTensor(np.zeros(t.type_size * -(-I // t.block_size), np.uint8), np.zeros(0, np.float32), t.fmt, 1, I,
                   t.block_size)


simulator = pytest.importorskip("msl.simulator")
if simulator.unavailable_reason():
    pytest.skip(f"MSL simulator: {simulator.unavailable_reason()}", allow_module_level=True)

from test_qgemv_msl import simulate  # noqa: E402


def run_case(name, O, I, S, dtype=mx.float32, seed=0, backend=dispatch.METAL, **tuning):
    qt = random_gguf_qtensor(name, O, I, seed=seed)
    x = random_x(S, I, dtype=dtype, seed=seed + 1)
    y = simulate(qgemv.launch_spec(x, qt, backend, **tuning) if backend == dispatch.METAL
                 else qgemv.launch_spec(x, qt, **tuning))
    assert y.dtype == dtype and y.shape == (S, O)
    return assert_close(y, x, qt, f"{name} {O}x{I} S={S} {dtype}")


# Three blocks a row (odd: 2-byte-aligned blocks of Q6_K / Q8_0 / IQ2_XXS at odd offsets) and
# several rows of x, so one launch covers every unit position of a block.
@pytest.mark.parametrize("name", [n if n in HOT_TYPES else pytest.param(n, marks=pytest.mark.slow) for n in KERNEL_TYPES])
def test_every_kernel_type(name):
    run_case(name, 5, 768, 3)


# Blocks written by llama.cpp's own quantizer (tests/data/gguf_quants.npz: per type, and per type
# with an importance matrix, 8 rows of 512 weights of very different magnitudes, heavy tails, an
# all-zero 32-block) rather than random bytes: the codes and scales an encoder actually emits.
@pytest.mark.parametrize("key", fixture_keys())
def test_llama_cpp_quantized_blocks(key):
    raw = _quant_fixtures()[key]
    name = key.removesuffix("_imatrix")
    qt = qtensor_from_gguf(key, name, raw, (raw.shape[0], _quant_fixtures()["x"].shape[1]))
    assert qt.fmt == GGUF_TYPES[name].fmt and qgemv.decline_reason_for(qt, 3, mx.float32) is None
    x = random_x(3, qt.I, seed=sum(map(ord, key)))
    y = simulate(qgemv.launch_spec(x, qt, dispatch.METAL))
    assert y.dtype == mx.float32 and y.shape == (3, qt.O)
    assert_close(y, x, qt, f"llama.cpp {key}")


_FIXTURES = {}


def _quant_fixtures() -> dict:
    if not _FIXTURES:
        _FIXTURES.update(fixtures())
    return _FIXTURES


@pytest.mark.slow
@pytest.mark.parametrize("S", [1, 2, 5, 8])
@pytest.mark.parametrize("name", HOT_TYPES)
def test_hot_types_every_S(name, S):
    run_case(name, 6, 256 * 9, S, seed=S)


@pytest.mark.slow
@pytest.mark.parametrize("name", KERNEL_TYPES)
def test_every_type_eight_rows_of_x(name):
    run_case(name, 3, 256 * 5, 8, seed=11)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("name", HOT_TYPES)
def test_low_precision_x(name, dtype):
    pytest.importorskip("ml_dtypes")
    run_case(name, 4, 512, 2, dtype=dtype)


# The launch variants bench_gguf_gemv.py times (and split-K over 4 SIMD groups).
@pytest.mark.slow
@pytest.mark.parametrize("tuning", [dict(simdgroups=4, rows=2, unroll=1), dict(prefetch=1, unroll=1),
                                    dict(rows=8, unroll=1), dict(simdgroups=2), dict(nib=1, prefetch=1, unroll=1, rows=2, persistent=2)],
                         ids=str)
@pytest.mark.parametrize("name", ["Q4_K", "IQ4_XS"])
def test_launch_variants(name, tuning):
    run_case(name, 9, 256 * 20, 1, **tuning)


# NIB 1 (CUDA's default): Q4_K's codes as fp16 subnormals (qd_gg_q4k_nib8), every unit position of
# a block, both sub-blocks of a pair, rows of x with and without sum x reuse.
@pytest.mark.parametrize("S", [1, 3])
def test_q4k_subnormal_codes(S):
    run_case("Q4_K", 5, 768, S, seed=7 + S, nib=1)


@pytest.mark.parametrize("good,bad", [("const uint sh = k0 < 32 ? 0u : 4u;", "const uint sh = 0u;"),
                                      ("const uint b = (w >> (sh + 8u)) & 0x000F000Fu;",
                                       "const uint b = (w >> sh) & 0x000F000Fu;")],
                         ids=["high sub-block reads the low nibbles", "bytes 1 and 3 read as 0 and 2"])
def test_q4k_subnormal_defect_is_caught(good, bad):
    qt = random_gguf_qtensor("Q4_K", 3, 512, seed=5)
    x = random_x(2, 512, seed=6)
    spec = qgemv.launch_spec(x, qt, nib=1)
    assert spec.header.count(good) == 1, f"{good!r} not found once"
    spec.header = spec.header.replace(good, bad)
    with pytest.raises((AssertionError, simulator.SimulatorError)) as caught:
        assert_close(simulate(spec), x, qt, bad)
    assert "failed to compile" not in str(caught.value)


# Planted decoder defects, each in the branch of the type it names: each must fail the comparison.
DEFECTS = {
    "Q8_0 codes read unsigned": ("Q8_0", "(8 * ((k0 + k) & 3))) & 0xFFu) ^ 0x80u, 8388736.0f);",
                                "(8 * ((k0 + k) & 3))) & 0xFFu), 8388608.0f);"),
    "Q4_K min added": ("Q4_K", "-(qd_gg_half(r[8] >> 16) * float((sm >> 8) & 0xFFu))",
                      "(qd_gg_half(r[8] >> 16) * float((sm >> 8) & 0xFFu))"),
    "Q4_K upper scales take b's top bits": ("Q4_K", "((cj & 0xFu) | ((aj >> 6) << 4))",
                                           "((cj & 0xFu) | ((bj >> 6) << 4))"),
    "Q4_K second sub-block reads low nibbles": ("Q4_K", "const int nsh = 4 * (k0 >> 5);", "const int nsh = 0;"),
    "Q4_K one x of eight left out of sum x": ("Q4_K", "if (qd_gg_has_bias(FMT)) {\nsx[s] += ((xf[0] + xf[1]) + (xf[2] + xf[3]))",
                                             "if (qd_gg_has_bias(FMT)) {\nsx[s] += ((xf[0] + xf[1]) + (xf[2]))"),
    "Q6_K high bits of the wrong quarter": ("Q6_K", ">> (2 * q)) & 0x03030303u) << 4)",
                                           ">> (2 * (q & 1))) & 0x03030303u) << 4)"),
    "Q6_K one scale for 32 weights": ("Q6_K", "r[8] << (24 - 8 * g)", "r[8] << 24"),
    "Q6_K code offset 31": ("Q6_K", "(FMT == 19 ? 8388640.0f : 8388608.0f)",
                           "(FMT == 19 ? 8388639.0f : 8388608.0f)"),
    "IQ4_XS scale high bits of the wrong sub-block": ("IQ4_XS", "(16 + 2 * ib)", "(16 + ib)"),
    "IQ4_XS weights 16-31 from the low nibbles": ("IQ4_XS", "const int nsh = 4 * (k0 >> 4);", "const int nsh = 0;"),
    "IQ2_XXS scale halved": ("IQ2_XXS", "(0.5f + float(r[1] >> 28)) * 0.25f", "(0.5f + float(r[1] >> 28)) * 0.125f"),
    "IQ2_XXS second grid word ignored": ("IQ2_XXS", "lut[QD_GG_IQ2XXS + 2 * i + 1],",
                                        "lut[QD_GG_IQ2XXS + 2 * i],"),
    "IQ2_XXS sign parity dropped": ("IQ2_XXS", "((qd_gg_popcount(seven) << 7) & 0x80u)", "0u"),
    "Q5_K high bit of the next sub-block": ("Q5_K", "(((qd_gg_u32(blk + 16 + 4 * k) >> ib) & 0x01010101u) << 4)",
                                           "(((qd_gg_u32(blk + 16 + 4 * k) >> (ib ^ 1)) & 0x01010101u) << 4)"),
    "Q3_K hmask bit transposed": ("Q3_K", "(4 * n + j)) & 0x01010101u", "(4 * j + n)) & 0x01010101u"),
    "Q3_K scale high bits of the wrong quarter": ("Q3_K", "2 * (i >> 2));", "2 * (i & 3));"),
    "Q2_K min added": ("Q2_K", "-(qd_gg_half(r[9] >> 16) * float(sc >> 4))", "(qd_gg_half(r[9] >> 16) * float(sc >> 4))"),
    "Q5_1 m dropped": ("Q5_1", "qd_gg_pair(qd_gg_half(r[5]), qd_gg_half(r[5] >> 16))", "qd_gg_pair(qd_gg_half(r[5]), 0.0f)"),
    "Q4_0 code offset 7": ("Q4_0", "qd_gg_code(n, 8388616.0f)", "qd_gg_code(n, 8388615.0f)"),
    "IQ3_S second index takes the first's high bit": ("IQ3_S", "(((r[3] >> (2 * l + 1)) & 1u) << 8)", "(((r[3] >> (2 * l)) & 1u) << 8)"),
    "IQ2_S high index bits of the wrong pair": ("IQ2_S", "(((r[2] >> (2 * l)) & 3u) << 8)", "(((r[2] >> l) & 3u) << 8)"),
    "IQ1_S delta sign ignored": ("IQ1_S", "(r[1] & 0x8000u) ? -0.125f : 0.125f", "0.125f"),
    "IQ1_M d nibble misplaced": ("IQ1_M", "((sc2 >> 4) & 0xF00u)", "((sc2 >> 8) & 0xF00u)"),
    "IQ3_XXS scale halved": ("IQ3_XXS", "(0.5f + float(r[2] >> 28)) * 0.5f", "(0.5f + float(r[2] >> 28)) * 0.25f"),
    "IQ2_XS 8-bit grid index": ("IQ2_XS", "const uint i = h & 511u;", "const uint i = h & 255u;"),
    "IQ4_NL d doubled": ("IQ4_NL", "return qd_gg_pair(qd_gg_half(r[4]), 0.0f);",
                                          "return qd_gg_pair(qd_gg_half(r[4]) * 2.0f, 0.0f);"),
}


# One planted defect a hot type in the fast tests, the rest slow.
FAST_DEFECTS = {"Q4_K min added", "Q6_K high bits of the wrong quarter", "IQ4_XS scale high bits of the wrong sub-block",
                "IQ2_XXS sign parity dropped", "Q8_0 codes read unsigned"}


@pytest.mark.parametrize("defect", [d if d in FAST_DEFECTS else pytest.param(d, marks=pytest.mark.slow)
                                    for d in sorted(DEFECTS)])
def test_planted_defect_is_caught(defect):
    name, good, bad = DEFECTS[defect]
    qt = random_gguf_qtensor(name, 3, 512, seed=5)
    x = random_x(2, 512, seed=6)
    spec = qgemv.launch_spec(x, qt)
    assert spec.header.count(good) == 1, f"defect '{defect}' no longer plants: {good!r} not found once"
    spec.header = spec.header.replace(good, bad)
    with pytest.raises((AssertionError, simulator.SimulatorError)) as caught:
        assert_close(simulate(spec), x, qt, defect)
    assert "failed to compile" not in str(caught.value)


# ---------------------------------------------------------------------------------------
# moe_block: stacked expert rows of GGUF types (gate/up one type, down another, as llama.cpp's
# mixes store *_exps), through moe_gate_up and moe_down.

@pytest.fixture
def metal(monkeypatch):
    from colibri_mlx.kernels import moe
    from moe_mla_oracle import route_launches_to_simulator

    yield route_launches_to_simulator(monkeypatch, simulator)
    moe.clear_banks()


def gguf_experts(pairs, D, inter, seed=0):
    return [(random_gguf_qtensor(gu, inter, D, seed=seed + 10 * e), random_gguf_qtensor(gu, inter, D, seed=seed + 10 * e + 1),
             random_gguf_qtensor(d, D, inter, seed=seed + 10 * e + 2)) for e, (gu, d) in enumerate(pairs)]


# Slow: every kernel type as gate/up (paired with the next type's down, rotating), so each
# decoder runs in moe_gate_up and in moe_down.
ROTATED_PAIRS = list(zip(KERNEL_TYPES, KERNEL_TYPES[1:] + KERNEL_TYPES[:1]))
MOE_PAIRS = [("IQ2_XXS", "IQ4_XS"), ("Q4_K", "Q6_K"), ("Q8_0", "Q4_K")]


@pytest.mark.parametrize("gate_up,down", [MOE_PAIRS[0]] + [pytest.param(*p, marks=pytest.mark.slow) for p in
                                          MOE_PAIRS[1:] + [p for p in ROTATED_PAIRS if p not in MOE_PAIRS]])
def test_moe_gguf_experts(metal, gate_up, down):
    from colibri_mlx import kernels
    from test_moe_mla_msl import run_moe

    experts = gguf_experts([(gate_up, down)] * 4, D=512, inter=256, seed=3)
    run_moe(experts, N=2, K=2, seed=1)
    assert "moe_gate_up" in metal and "moe_down" in metal
    c = kernels.counters()
    assert c["calls"].get("moe_block/metal") == 1 and not c["fallbacks"], c


# ---------------------------------------------------------------------------------------
# mla_decode: kv_b (mla_qabs' W_UK columns, mla_out's W_UV rows) and q_b (mla_qb_qabs) of GGUF types.

def _gguf_weights(monkeypatch, name):
    """test_moe_mla_msl's cases with their quantized weights made GGUF ``name`` blocks, scaled to
    an RMS of 0.01 (:func:`_rms_scaled`)."""
    import test_moe_mla_msl as t

    monkeypatch.setattr(t, "random_qtensor",
                        lambda fmt, O, I, gs=None, seed=0: _rms_scaled(random_gguf_qtensor(name, O, I, seed), name))
    return t


def _rms_scaled(qt, name, rms=0.01):
    """``qt`` (random blocks) with every fp16 scale field (d and dmin; IQ1_M's nibble-split scale)
    multiplied by one factor, so the weight's RMS is about ``rms``; blocks keep their own scales
    and signs. mla_oracle's budget grows with |W_UK| |W_UV| (a score error times the spread of
    the latent rows) against an output of |W_UV|: at the random blocks' RMS (~1) it exceeds most
    decode errors (15 of DEFECTS' 17 types' first defect passed kv_b), at 0.01 16 are caught
    (Q5_1's dropped m, a constant offset, still passes kv_b; q_b's tighter check catches all)."""
    from helpers_gguf import FP16_FIELDS, set_half, set_iq1m_scale

    t = GGUF_TYPES[name]
    factor = rms / float(np.sqrt(np.mean(gguf_decode_f64(qt) ** 2)))
    blocks = np.array(qt.packed, np.uint8).reshape(qt.O, -1, t.type_size)
    for off in FP16_FIELDS[name]:
        set_half(blocks, off, blocks[..., off:off + 2].copy().view("<f2")[..., 0].astype(np.float64) * factor)
    if name == "IQ1_M":
        nib = blocks[..., 48:56].copy().view("<u2") >> 12
        bits = (nib[..., 0] | (nib[..., 1] << 4) | (nib[..., 2] << 8) | (nib[..., 3] << 12)).astype(np.uint16)
        set_iq1m_scale(blocks, bits.view(np.float16).astype(np.float64) * factor)
    return type(qt)(blocks.reshape(qt.O, -1), qt.scales, qt.fmt, qt.O, qt.I, qt.gs, qt.name)


def test_moe_gguf_q4k_subnormal_codes(metal, monkeypatch):
    """moe_block's gate_up and down (x in xp_index's layout) with Q4_K at NIB 1 (CUDA's default)."""
    from test_moe_mla_msl import run_moe

    monkeypatch.setitem(qgemv.DEFAULT_NIB, dispatch.METAL, 1)
    simulated, nibs = dispatch.launch, []

    def launch(backend, spec):
        nibs.append(dict(spec.template).get("NIB"))
        return simulated(backend, spec)

    monkeypatch.setattr(dispatch, "launch", launch)
    run_moe(gguf_experts([("Q4_K", "Q4_K")] * 2, D=256, inter=256, seed=4), N=2, K=2, seed=2)
    assert "moe_gate_up" in metal and "moe_down" in metal
    assert nibs and set(nibs) == {1}, nibs


# kv_b: Q6_K fast, the hot types first, then every other kernel type, slow.
KV_B_TYPES = ["Q6_K", "Q8_0", "IQ4_XS", "IQ2_XXS", "Q4_K"]


@pytest.mark.parametrize("name", [KV_B_TYPES[0]] + [pytest.param(n, marks=pytest.mark.slow) for n in
                                  KV_B_TYPES[1:] + [n for n in KERNEL_TYPES if n not in KV_B_TYPES]])
def test_mla_gguf_kv_b(metal, monkeypatch, name):
    _gguf_weights(monkeypatch, name).run_mla(metal, fmt=4, R=256, seed=2, tile=16, variant="mma")


def test_mla_gguf_kv_b_defect_is_caught(metal, monkeypatch):
    """The kv_b cases can fail: a Q6_K decoder defect planted in every mla_decode launch."""
    t = _gguf_weights(monkeypatch, "Q6_K")
    _, good, bad = DEFECTS["Q6_K high bits of the wrong quarter"]
    simulated, planted = t.simulate, []

    def plant(spec, *args):
        if good in spec.header:
            planted.append(spec.name)
            spec.header = spec.header.replace(good, bad)
        return simulated(spec, *args)

    monkeypatch.setattr(t, "simulate", plant)
    with pytest.raises(AssertionError, match="over budget"):
        t.run_mla(metal, fmt=4, R=256, seed=2, tile=16, variant="mma")
    assert {"mla_qabs", "mla_out"} <= set(planted), planted


# q_b (and kv_b) of every kernel type, the q_latent dtypes rotating over the types.
Q_B_CASES = [("Q4_K", mx.bfloat16), ("IQ2_XXS", mx.float32), ("Q8_0", mx.float16)]
Q_B_CASES += [(n, [mx.float32, mx.bfloat16, mx.float16][i % 3])
              for i, n in enumerate(n for n in KERNEL_TYPES if n not in dict(Q_B_CASES))]


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype", Q_B_CASES, ids=[f"{n}-{str(d).split('.')[-1]}" for n, d in Q_B_CASES])
def test_mla_gguf_q_b(metal, monkeypatch, name, dtype):
    """mla_qb_qabs with q_b (and kv_b) GGUF blocks, raw output against float64."""
    t = _gguf_weights(monkeypatch, name)
    args, q_b, q_latent = t.qb_case(qfmt=4, dtype=dtype, R=256, q_lora=512, seed=4)
    spec, n = t.qb_qabs_launch(args, q_b, q_latent)
    assert spec.name == "mla_qb_qabs" and n == 3
    (got,) = t.simulate(spec, simulator)
    t.assert_qb_qabs_close(np.asarray(got)[0], args, q_b, q_latent)


def test_qmatmul_counts_the_gguf_kernel_and_matches_the_reference(metal):
    """kernels.qmatmul on a GGUF weight, decode rows: the qgemv kernel runs (counted as a Metal call,
    no fallback) and agrees with the pure-MLX reference (kernels/gguf_formats.py) and float64; prefill
    rows take the dequantize-and-multiply path, counted as such."""
    from colibri_mlx import kernels
    from colibri_mlx.kernels import reference

    qt = random_gguf_qtensor("Q4_K", 5, 768, seed=9)
    x = random_x(2, 768, seed=10)
    y = kernels.qmatmul(x, qt)
    assert metal == ["qgemv"]
    c = kernels.counters()
    assert c["calls"].get("qgemv/metal") == 1 and not c["fallbacks"], c
    assert_close(y, x, qt, "qmatmul Q4_K")
    ref = reference.qmatmul(x, qt)
    got, want = np.asarray(y), np.asarray(ref)
    assert np.all(np.abs(got - want) <= 1e-4 * (np.abs(np.asarray(x)) @ np.abs(qt.dequantize()).T))
    kernels.qmatmul(random_x(9, 768, seed=11), qt)
    assert metal == ["qgemv"] and kernels.counters()["calls"].get("qmm/dequant-matmul") == 1


def test_other_formats_launch_without_the_gguf_decoders():
    """Launches of the other formats carry gguf_decode's stubs, not its decoders (MLX builds and
    hashes the whole kernel text on every call); a GGUF FMT given the stubs does not compile."""
    from kernel_oracle import random_qtensor

    for backend in (dispatch.METAL, dispatch.CUDA):
        plain = qgemv.launch_spec(random_x(1, 512), random_qtensor(4, 8, 512, gs=64), backend)
        gguf = qgemv.launch_spec(random_x(1, 512), random_gguf_qtensor("Q4_K", 8, 512), backend)
        assert "scale_min_k4" not in plain.header and "scale_min_k4" in gguf.header
        assert len(gguf.header) > len(plain.header) + 8000
    qt = random_gguf_qtensor("Q4_K", 3, 256)
    spec = qgemv.launch_spec(random_x(1, 256), qt)
    spec.header = qgemv.kernel_header(dispatch.METAL, False)
    with pytest.raises(simulator.SimulatorError, match="GGUF FMT without gguf_decode"):
        simulate(spec)


# ---------------------------------------------------------------------------------------
# A llama.cpp-written model on the kernels: tiny deepseek2 files (tests/data/gguf, Q4_K_M-like and
# IQ2_XXS-experts mixes of real llama.cpp quantization), decode steps with every hot path in the
# simulator against the same steps on the reference path.

@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-q4_k_m", "tiny-iq2_xxs"])
def test_llama_cpp_file_decodes_on_the_kernels(metal, name):
    import os

    import colibri_mlx
    from colibri_mlx import kernels

    path = os.path.join(os.path.dirname(__file__), "data", "gguf", name + ".gguf")
    model, _ = colibri_mlx.load(path, dtype="float32")
    prompt, steps = mx.array([[3, 17, 29, 41]]), [[7], [11]]

    def run():
        cache = model.make_cache()
        out = [np.array(model(prompt, cache=cache))[0, -1]]
        out += [np.array(model(mx.array([s]), cache=cache))[0, -1] for s in steps]
        return np.stack(out).astype(np.float64)

    with kernels.force_reference():
        want = run()
    kernels.reset_counters()
    got = run()
    c = kernels.counters()
    assert c["calls"].get("qgemv/metal") and c["calls"].get("moe_block/metal") and not c["fallbacks"], c
    assert "mla_qabs" in metal or "mla_qb_qabs" in metal, sorted(set(metal))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert len({q.fmt for q in _model_qtensors(model)} & set(gguf_decode.KERNEL_FMTS)) >= 3   # a mix of GGUF types
    assert err <= 1e-4, err


def _model_qtensors(model):
    """The QTensors a model holds (attributes, lists and dicts a few levels down)."""
    from colibri_mlx.formats import QTensor

    out = []

    def walk(o, depth=0):
        if isinstance(o, QTensor):
            out.append(o)
        elif depth < 6 and isinstance(o, (list, tuple)):
            for v in o:
                walk(v, depth + 1)
        elif depth < 6 and isinstance(o, dict):
            for v in o.values():
                walk(v, depth + 1)
        elif depth < 6 and hasattr(o, "__dict__"):
            for v in vars(o).values():
                walk(v, depth + 1)
    walk(model)
    return out

"""qgemv on llama.cpp's GGUF block formats in the MSL simulator: the exact launch MLX would get
(``qgemv.launch_spec``), outputs poisoned first, compared with gguf-py's dequantization (bit-exact
to ggml's) widened to float64, within |delta| <= 1e-4 sum|x w| (kernel_oracle). Blocks are random
bytes with finite fp16 block scales, so every code, sub-scale and sign pattern is decoded.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx.formats.gguf_quant import GGUF_TYPES
from colibri_mlx.kernels import dispatch, gguf_decode, qgemv
from colibri_mlx.kernels.reference import e8_grid_words
from kernel_oracle import assert_close, random_gguf_qtensor, random_x

pytest.importorskip("gguf", reason="gguf-py is the dequantization oracle")

KERNEL_TYPES = [name for name, t in GGUF_TYPES.items() if t.fmt in gguf_decode.KERNEL_FMTS]


def test_lookup_tables_are_ggmls():
    """The packaged tables equal gguf-py's copies of ggml's (an independent transcription), and the
    fmt 6 grid at word 0 of the lookup input is iq3xxs_grid."""
    from gguf.quants import IQ2_XXS, IQ2_XS, IQ2_S, IQ3_S, IQ3_XXS, IQ4_NL, IQ1_S

    for cls, name, nbytes in [(IQ2_XXS, "iq2xxs_grid", 8), (IQ2_XS, "iq2xs_grid", 8), (IQ2_S, "iq2s_grid", 8),
                              (IQ3_XXS, "iq3xxs_grid", 4), (IQ3_S, "iq3s_grid", 4)]:
        cls.init_grid()
        ours = gguf_decode.table(name).view(np.uint8).reshape(-1, nbytes)
        np.testing.assert_array_equal(ours, np.asarray(cls.grid).reshape(-1, nbytes).astype(np.uint8), name)
    IQ1_S.init_grid()
    iq1 = gguf_decode.table("iq1s_grid").view(np.int8).reshape(-1, 8)
    np.testing.assert_array_equal(iq1, np.asarray(IQ1_S.grid).reshape(-1, 8).astype(np.int8))
    np.testing.assert_array_equal(gguf_decode.table("kvalues_iq4nl"), np.array(IQ4_NL.kvalues, np.int8))
    words = gguf_decode.lookup_words()
    np.testing.assert_array_equal(words[:256], e8_grid_words())
    np.testing.assert_array_equal(words[gguf_decode.IQ4NL_OFFSET:gguf_decode.IQ4NL_OFFSET + 16].view(np.float32),
                                  np.array(IQ4_NL.kvalues, np.float32))


def test_decline_reasons_name_the_type():
    qt = random_gguf_qtensor("Q4_K", 2, 256)
    assert qgemv.decline_reason_for(qt, 1, mx.float32) is None
    assert "IQ1_M" in qgemv.decline_reason_for(_shell(GGUF_TYPES["IQ1_M"]), 1, mx.float32)
    short = _shell(GGUF_TYPES["Q8_0"], I=48)
    assert "I=48" in qgemv.decline_reason_for(short, 1, mx.float32)


def test_every_gguf_type_has_a_kernel_or_a_reason():
    for name, t in GGUF_TYPES.items():
        why = gguf_decode.decline_reason(_shell(t))
        assert (why is None) == (t.fmt in gguf_decode.KERNEL_FMTS), (name, why)


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
@pytest.mark.parametrize("name", KERNEL_TYPES)
def test_every_kernel_type(name):
    run_case(name, 5, 768, 3)


@pytest.mark.slow
@pytest.mark.parametrize("S", [1, 2, 5, 8])
@pytest.mark.parametrize("name", KERNEL_TYPES)
def test_every_type_and_S(name, S):
    run_case(name, 6, 256 * 9, S, seed=S)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("name", KERNEL_TYPES)
def test_low_precision_x(name, dtype):
    pytest.importorskip("ml_dtypes")
    run_case(name, 4, 512, 2, dtype=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Q4_K", "IQ4_XS"])
def test_split_k_launch(name):
    run_case(name, 3, 256 * 20, 1, simdgroups=4, rows=2, unroll=1)


# Planted decoder defects, each in the branch of the type it names: each must fail the comparison.
DEFECTS = {
    "Q8_0 codes read unsigned": ("Q8_0", "(b ^ 0x80u)) - 8388736.0f) * d", "b) - 8388608.0f) * d"),
    "Q4_K min added": ("Q4_K", "d1, -m1)", "d1, m1)"),
    "Q4_K upper scales take b's top bits": ("Q4_K", "((c & 0xFu) | ((a >> 6) << 4))", "((c & 0xFu) | ((b >> 6) << 4))"),
    "Q4_K second sub-block reads low nibbles": ("Q4_K", "+ 4 * e)) & 0xFu", ")) & 0xFu"),
    "Q6_K high bits of the wrong quarter": ("Q6_K", "const int hsh = 2 * q;", "const int hsh = 2 * (q & 1);"),
    "Q6_K one scale for 32 weights": ("Q6_K", "const int sh = 8 * (k0 >> 4);", "const int sh = 0;"),
    "Q6_K code offset 31": ("Q6_K", "- 8388640.0f) * dl", "- 8388639.0f) * dl"),
    "IQ4_XS scale high bits of the wrong sub-block": ("IQ4_XS", "(16 + 2 * ib)", "(16 + ib)"),
    "IQ4_XS weights 16-31 from the low nibbles": ("IQ4_XS", "const int nsh = 4 * (k0 >> 4);", "const int nsh = 0;"),
    "IQ2_XXS scale halved": ("IQ2_XXS", "(0.5f + float(r[1] >> 28)) * 0.25f", "(0.5f + float(r[1] >> 28)) * 0.125f"),
    "IQ2_XXS second grid word ignored": ("IQ2_XXS", "(k < 4 ? g0 : g1)", "(k < 4 ? g0 : g0)"),
    "IQ2_XXS sign parity dropped": ("IQ2_XXS", "((popcount(seven) << 7) & 0x80u)", "0u"),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
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


@pytest.mark.parametrize("gate_up,down", [("Q4_K", "Q6_K"), ("IQ2_XXS", "IQ4_XS"), ("Q8_0", "Q4_K")])
def test_moe_gguf_experts(metal, gate_up, down):
    from colibri_mlx import kernels
    from test_moe_mla_msl import run_moe

    experts = gguf_experts([(gate_up, down)] * 4, D=512, inter=256, seed=3)
    run_moe(experts, N=2, K=2, seed=1)
    assert "moe_gate_up" in metal and "moe_down" in metal
    c = kernels.counters()
    assert c["calls"].get("moe_block/metal") == 1 and not c["fallbacks"], c

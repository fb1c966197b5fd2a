"""MLX quantization formats (fmt 7-10): decode bit-exact against ``mx.dequantize``; constructor checks."""

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx.formats import FormatError, QTensor, qtensor_from_mlx
from colibri_mlx.formats.mlx_quant import E4M3_VALUES, E8M0_VALUES, MLX_MODES, decode_mlx

AFFINE = [(b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
FP_MODES = [("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)]
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _weights(O, I, dtype, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((O, I)).astype(np.float32) * 0.05
    w[0, :7] = [0.0, 1.5, -2.25, 1e-4, -3e-5, 0.3, -0.7]   # a few values far from the group's spread
    return mx.array(w).astype(dtype)


def _quantized(mode, bits, gs, dtype=mx.float32, O=6, I=256, seed=0):
    w = _weights(O, I, dtype, seed)
    parts = mx.quantize(w, group_size=gs, bits=bits, mode=mode)
    q, s = parts[0], parts[1]
    b = parts[2] if len(parts) > 2 else None
    return q, s, b


def _assert_bits_equal(mine, ref):
    mine, ref = np.asarray(mine, np.float32), np.asarray(ref, np.float32)
    assert mine.shape == ref.shape
    same = (mine.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(mine) & np.isnan(ref))
    assert same.all(), f"{(~same).sum()} of {same.size} values differ, first at {np.argwhere(~same)[0]}"


@pytest.mark.parametrize("bits,gs", AFFINE)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_affine_decode_bit_exact(bits, gs, dtype):
    q, s, b = _quantized("affine", bits, gs, DTYPES[dtype], seed=bits * 1000 + gs)
    qt = qtensor_from_mlx(q, s, b, mode="affine", bits=bits, group_size=gs, name="w")
    assert (qt.fmt, qt.O, qt.I, qt.gs, qt.bits) == (7, 6, 256, gs, bits)
    ref = mx.dequantize(q, s, b, group_size=gs, bits=bits, mode="affine", dtype=mx.float32)
    _assert_bits_equal(decode_mlx(qt), ref)
    _assert_bits_equal(qt.dequantize(), ref)            # QTensor's own path
    # numpy-held scales (bfloat16 as raw uint16 bits, as a safetensors reader hands them over)
    as_np = (lambda a: np.asarray(a.view(mx.uint16))) if dtype == "bfloat16" else np.asarray
    qn = QTensor(np.asarray(q), as_np(s), 7, 6, 256, gs, "w", bits=bits, biases=as_np(b))
    _assert_bits_equal(decode_mlx(qn), ref)


@pytest.mark.parametrize("mode,bits,gs", FP_MODES)
def test_fp_decode_bit_exact(mode, bits, gs):
    q, s, b = _quantized(mode, bits, gs, seed=7)
    assert b is None
    qt = qtensor_from_mlx(q, s, None, mode=mode, bits=bits, group_size=gs)
    assert qt.fmt == MLX_MODES[mode].fmt and qt.biases is None
    ref = mx.dequantize(q, s, group_size=gs, bits=bits, mode=mode, dtype=mx.float32)
    _assert_bits_equal(decode_mlx(qt), ref)


@pytest.mark.parametrize("mode,bits,gs", FP_MODES)
def test_fp_decode_every_code_and_scale(mode, bits, gs):
    """Every code value under every scale byte, against MLX's own dequantize (covers the tables)."""
    per = 32 // bits
    n_codes = 1 << bits
    O = 256   # one row per scale byte
    I = -(-max(gs, n_codes) // gs) * gs
    codes = np.tile(np.arange(I, dtype=np.uint32) % n_codes, (O, 1))
    shifts = np.arange(per, dtype=np.uint32) * bits
    words = np.bitwise_or.reduce(codes.reshape(O, -1, per) << shifts, axis=-1).astype(np.uint32)
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], I // gs, axis=1)
    if mode == "nvfp4":   # E4M3 scales are positive in MLX; sign bit and NaN codes are not produced
        scales = scales & np.uint8(0x7E)
    qt = qtensor_from_mlx(mx.array(words), mx.array(scales), mode=mode, bits=bits, group_size=gs)
    ref = mx.dequantize(mx.array(words), mx.array(scales), group_size=gs, bits=bits, mode=mode, dtype=mx.float32)
    _assert_bits_equal(decode_mlx(qt), ref)


def test_tables_spot_values():
    assert E8M0_VALUES[127] == 1.0 and E8M0_VALUES[130] == 8.0 and E8M0_VALUES[0] == 2.0 ** -127
    assert E4M3_VALUES[0x38] == 1.0 and E4M3_VALUES[0x7E] == 448.0 and E4M3_VALUES[0x01] == 2.0 ** -9
    assert np.isnan(E4M3_VALUES[0x7F]) and E4M3_VALUES[0xB8] == -1.0


def test_constructor_rejects_bad_input():
    q, s, b = _quantized("affine", 4, 64)
    with pytest.raises(FormatError, match="bits"):
        qtensor_from_mlx(q, s, b, mode="affine", bits=7, group_size=64, name="w")
    with pytest.raises(FormatError, match="group_size"):
        qtensor_from_mlx(q, s, b, mode="affine", bits=4, group_size=16, name="w")
    with pytest.raises(FormatError, match="model.x: scales must be"):
        qtensor_from_mlx(q, s[:, :2], b, mode="affine", bits=4, group_size=64, name="model.x")
    with pytest.raises(FormatError, match="needs biases"):
        qtensor_from_mlx(q, s, None, mode="affine", bits=4, group_size=64, name="w")
    with pytest.raises(FormatError, match="uint32"):
        qtensor_from_mlx(q.view(mx.int32), s, b, mode="affine", bits=4, group_size=64, name="w")
    with pytest.raises(FormatError, match="mode"):
        qtensor_from_mlx(q, s, b, mode="int4", bits=4, group_size=64)
    qf, sf, _ = _quantized("mxfp4", 4, 32)
    with pytest.raises(FormatError, match="uint8"):
        qtensor_from_mlx(qf, sf.astype(mx.float32), mode="mxfp4", bits=4, group_size=32, name="w")
    with pytest.raises(FormatError, match="no biases"):
        qtensor_from_mlx(qf, sf, sf, mode="mxfp4", bits=4, group_size=32, name="w")


def test_qtensor_accessors_keep_stored_arrays():
    q, s, b = _quantized("affine", 3, 32, mx.bfloat16)
    qt = qtensor_from_mlx(q, s, b, mode="affine", bits=3, group_size=32)
    assert qt.scales.dtype == mx.bfloat16 and qt.to_mlx() is qt
    assert qt.nbytes == q.nbytes + s.nbytes + b.nbytes
    qn = QTensor(np.asarray(q), np.asarray(s.astype(mx.float32)), 7, 6, 256, 32, bits=3,
                 biases=np.asarray(b.astype(mx.float32)))
    qm = qn.to_mlx()
    assert isinstance(qm.biases, mx.array) and qm.bits == 3 and qm.fmt == 7


# ---------------------------------------------------------------------------------------
# Pure-MLX reference and qmatmul through the dispatcher

from colibri_mlx import kernels  # noqa: E402
from colibri_mlx.kernels import dispatch, mla, reference  # noqa: E402

REPRESENTATIVE = [("affine", 4, 64, "bfloat16"), ("affine", 3, 32, "float16"), ("affine", 5, 128, "float32"),
                  ("affine", 6, 64, "bfloat16"), ("affine", 2, 128, "float16"), ("affine", 8, 32, "bfloat16"),
                  ("mxfp4", 4, 32, "float32"), ("nvfp4", 4, 16, "float32"), ("mxfp8", 8, 32, "float32")]


def _qt(mode, bits, gs, dtype, O=40, I=256, seed=3):
    q, s, b = _quantized(mode, bits, gs, DTYPES[dtype], O=O, I=I, seed=seed)
    return qtensor_from_mlx(q, s, b, mode=mode, bits=bits, group_size=gs, name=f"w.{mode}{bits}")


@pytest.mark.parametrize("bits,gs", AFFINE)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_reference_dequantize_bit_exact_affine(bits, gs, dtype):
    qt = _qt("affine", bits, gs, dtype, O=9, seed=bits + gs)
    # The matmuls' decode widens the scales and biases first (as mx.quantized_matmul does) ...
    ref = mx.dequantize(qt.packed, qt.scales.astype(mx.float32), qt.biases.astype(mx.float32), group_size=gs,
                        bits=bits, dtype=mx.float32)
    _assert_bits_equal(reference.dequantize(qt), ref)
    _assert_bits_equal(reference.dequantize_rows(qt, 3, 7), np.asarray(ref)[3:7])
    # ... embedding lookups round in the stored dtype, as mx.dequantize does.
    from colibri_mlx.kernels import mlx_formats
    stored = mx.dequantize(qt.packed, qt.scales, qt.biases, group_size=gs, bits=bits, dtype=mx.float32)
    _assert_bits_equal(mlx_formats.embedding_rows(qt, mx.array([[4, 1]])), np.asarray(stored)[[4, 1]][None])
    if dtype == "bfloat16":
        assert not np.array_equal(np.asarray(ref), np.asarray(stored))


@pytest.mark.parametrize("mode,bits,gs", FP_MODES)
def test_reference_dequantize_bit_exact_fp(mode, bits, gs):
    qt = _qt(mode, bits, gs, "bfloat16", O=9)
    ref = mx.dequantize(qt.packed, qt.scales, group_size=gs, bits=bits, mode=mode, dtype=mx.float32)
    _assert_bits_equal(reference.dequantize(qt), ref)


def _gemv_oracle(x: np.ndarray, qt):
    """float64 x @ W.T from the numpy decode without roundings (``q * s + b`` as the matmuls
    compute it), and sum |x_i w_i| per output (the error scale)."""
    w = decode_mlx(qt, exact=True)
    x = x.astype(np.float64)
    return x @ w.T, np.abs(x) @ np.abs(w).T


@pytest.mark.parametrize("mode,bits,gs,dtype", REPRESENTATIVE)
def test_qmatmul_reference_vs_float64(mode, bits, gs, dtype):
    qt = _qt(mode, bits, gs, dtype)
    rng = np.random.default_rng(11)
    for S in (1, 3, 12):     # GEMV rows and a prefill
        x = rng.standard_normal((S, qt.I)).astype(np.float32)
        dispatch.reset_counters()
        with kernels.force_reference():
            y = np.asarray(kernels.qmatmul(mx.array(x), qt))
        want, terms = _gemv_oracle(x, qt)
        assert np.all(np.abs(y - want) <= 1e-5 * terms + 1e-30), np.max(np.abs(y - want) / terms)
        path = "qgemv/reference" if S <= 8 else "qmm/dequant-matmul"
        assert dispatch.counters()["calls"] == {path: 1}


# ---------------------------------------------------------------------------------------
# The GPU kernels in the MSL simulator (skipped without clang)

simulator_reason = None
try:
    from msl import simulator as _sim
    simulator_reason = _sim.unavailable_reason()
except ImportError as exc:   # pragma: no cover
    simulator_reason = str(exc)
needs_simulator = pytest.mark.skipif(bool(simulator_reason), reason=f"MSL simulator: {simulator_reason}")

# Every kernel FMT code family: each affine bits with each scale dtype somewhere, every fp mode.
SIM_CASES = [("affine", 4, 64, "bfloat16", 1), ("affine", 3, 32, "float16", 2), ("affine", 5, 128, "bfloat16", 1),
             ("affine", 6, 64, "float32", 3), ("affine", 2, 32, "bfloat16", 1), ("affine", 8, 128, "float16", 1),
             ("mxfp4", 4, 32, "bfloat16", 2), ("nvfp4", 4, 16, "bfloat16", 1), ("mxfp8", 8, 32, "bfloat16", 1)]
SIM_FULL = [("affine", b, g, d, 1) for b, g in AFFINE for d in ("bfloat16", "float16", "float32")]


def _run_qgemv_sim(mode, bits, gs, dtype, S, O=7, I=384, x_dtype=mx.float32, nib=None):
    from kernel_oracle import assert_close, random_x
    from test_qgemv_msl import simulate

    from colibri_mlx.kernels import qgemv

    qt = _qt(mode, bits, gs, dtype, O=O, I=I, seed=bits * 7 + gs)
    x = random_x(S, I, dtype=x_dtype, seed=5)
    assert qgemv.decline_reason(x, qt) is None
    y = simulate(qgemv.launch_spec(x, qt, nib=nib))
    assert y.shape == (S, O)
    assert_close(y, x, qt, f"qgemv {mode} {bits}-bit g{gs} {dtype} S={S}")


@needs_simulator
@pytest.mark.parametrize("mode,bits,gs,dtype,S", SIM_CASES)
def test_qgemv_msl(mode, bits, gs, dtype, S):
    _run_qgemv_sim(mode, bits, gs, dtype, S)


@needs_simulator
@pytest.mark.parametrize("dtype,S", [("bfloat16", 1), ("float16", 3), ("float32", 2)])
def test_qgemv_msl_affine4_nibble_codes(dtype, S):
    """Affine 4-bit with NIB 1 (CUDA's default; Metal's is 0): the codes as fp16 subnormals, as
    for fmt 4, and s·Σqx + b·Σx a segment."""
    _run_qgemv_sim("affine", 4, 64, dtype, S, nib=1)


@needs_simulator
@pytest.mark.parametrize("mode,gs", [("mxfp4", 32), ("nvfp4", 16)])
def test_qgemv_msl_scale_rows_padded(mode, gs):
    """I / gs not a multiple of 4: each row's scale bytes are padded to whole words."""
    _run_qgemv_sim(mode, 4, gs, "bfloat16", 2, O=5, I=416)


@needs_simulator
@pytest.mark.slow
@pytest.mark.parametrize("mode,bits,gs,dtype,S", SIM_FULL)
def test_qgemv_msl_full_grid(mode, bits, gs, dtype, S):
    _run_qgemv_sim(mode, bits, gs, dtype, S, x_dtype=mx.bfloat16)


@pytest.mark.device
@pytest.mark.skipif(dispatch.gpu_backend() is None, reason="needs a GPU backend (CUDA or Metal)")
@pytest.mark.parametrize("case", range(9))
def test_qgemv_kernel_on_device(case):
    """The backend's own kernel (Metal or the CUDA twin) through qmatmul, against float64."""
    from kernel_oracle import MLX_KERNEL_CASES, assert_close, random_mlx_qtensor, random_x

    mode, bits, gs, sdt = MLX_KERNEL_CASES[case]
    qt = random_mlx_qtensor(mode, bits, gs, 1000, 4096, sdt, seed=case)
    for S, dtype in ((1, mx.bfloat16), (4, mx.float16), (8, mx.float32)):
        x = random_x(S, 4096, dtype=dtype, seed=S)
        dispatch.reset_counters()
        y = kernels.qmatmul(x, qt)
        mx.eval(y)
        c = dispatch.counters()
        assert c["calls"] == {f"qgemv/{dispatch.backend()}": 1} and not c["fallbacks"], c
        assert_close(y, x, qt, f"{mode} {bits}-bit g{gs} {sdt} S={S}")


# ---------------------------------------------------------------------------------------
# moe_block in the MSL simulator: stacked MLX-format experts through both kernels

MOE_CASES = [(("affine", 4, 64, mx.bfloat16), ("affine", 4, 64, mx.bfloat16)),
             (("affine", 3, 32, mx.float16), ("affine", 6, 64, mx.float16)),    # a mixed recipe's down
             (("affine", 8, 128, mx.float32), ("affine", 2, 32, mx.float32)),
             (("mxfp4", 4, 32, mx.bfloat16), ("mxfp4", 4, 32, mx.bfloat16)),
             (("nvfp4", 4, 16, mx.bfloat16), ("mxfp8", 8, 32, mx.bfloat16))]


def _moe_case(gu, down, D, inter, E, N, K, seed):
    """E experts (gate and up in format ``gu``, down in ``down``), a routing of N tokens to K
    distinct experts each with gate weights, and x [N, D]."""
    from kernel_oracle import random_mlx_qtensor

    experts = [(random_mlx_qtensor(*gu[:3], inter, D, gu[3], seed=10 * e),
                random_mlx_qtensor(*gu[:3], inter, D, gu[3], seed=10 * e + 1),
                random_mlx_qtensor(*down[:3], D, inter, down[3], seed=10 * e + 2)) for e in range(E)]
    rng = np.random.default_rng(seed)
    ids = mx.array(np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32))
    w = mx.array(rng.uniform(0.1, 1.0, (N, K)).astype(np.float32))
    x = mx.array(rng.standard_normal((N, D)).astype(np.float32))
    return experts, ids, w, x


@pytest.fixture
def metal_sim(monkeypatch):
    from moe_mla_oracle import route_launches_to_simulator

    from colibri_mlx.kernels import moe

    yield route_launches_to_simulator(monkeypatch, _sim)
    moe.clear_banks()


@needs_simulator
@pytest.mark.parametrize("gu,down", MOE_CASES)
def test_moe_block_msl(metal_sim, gu, down):
    from moe_mla_oracle import assert_moe_close

    experts, ids, w, x = _moe_case(gu, down, D=128, inter=64, E=4, N=2, K=2, seed=4)
    dispatch.reset_counters()
    y = kernels.moe_block(x, experts, ids, w)
    c = dispatch.counters()
    assert c["calls"].get("moe_block/metal") == 1 and not c["fallbacks"], c
    assert "moe_gate_up" in metal_sim and "moe_down" in metal_sim
    assert_moe_close(y, x, experts, ids, w, f"moe {gu[:3]} / {down[:3]}")


@needs_simulator
@pytest.mark.parametrize("mode,bits,gs", [("mxfp4", 4, 32), ("nvfp4", 4, 16)])
def test_moe_block_msl_fp_scale_rows_padded(metal_sim, mode, bits, gs):
    """fp-mode scale rows whose bytes are not whole words (D = 160: 5 or 10 scale bytes, inter
    = 96: 3 or 6): each expert's rows are padded to words, and moe_down's per-expert scale
    offsets are counted in those words."""
    from moe_mla_oracle import assert_moe_close

    fmt = (mode, bits, gs, mx.bfloat16)
    experts, ids, w, x = _moe_case(fmt, fmt, D=160, inter=96, E=5, N=2, K=3, seed=7)
    dispatch.reset_counters()
    y = kernels.moe_block(x, experts, ids, w)
    c = dispatch.counters()
    assert c["calls"].get("moe_block/metal") == 1 and not c["fallbacks"], c
    assert_moe_close(y, x, experts, ids, w, f"moe {mode} D=160 inter=96")


# ---------------------------------------------------------------------------------------
# mla_decode in the MSL simulator: MLX-format kv_b (mla_qabs' W_UK columns, mla_out's W_UV rows)
# and q_b (mla_qb_qabs). The oracle and its budget are test_mla_decode.py's
# (moe_mla_oracle.mla_oracle: REL = 1e-4 of each stage's sum of |terms|, carried through the
# softmax), on kv_b decoded exactly (q * s + b in float64): the kernels decode a weight with one
# float32 fma, which the per-stage budget covers.

MLA_CASES = [("affine", 4, 64, mx.bfloat16), ("affine", 3, 32, mx.float16), ("affine", 8, 128, mx.float32),
             ("mxfp4", 4, 32, mx.bfloat16)]
MLA_MORE = [("affine", b, g, d) for b, g in ((2, 32), (5, 64), (6, 128), (4, 32), (4, 128), (3, 64), (8, 64))
            for d in (mx.bfloat16, mx.float16, mx.float32)] + [("nvfp4", 4, 16, mx.bfloat16), ("mxfp8", 8, 32, mx.bfloat16)]


def _mla_args(kv_fmt, B=1, H=4, L=1, T=37, nope=32, v=32, R=128, rope=16, seed=0):
    from kernel_oracle import random_mlx_qtensor

    rng = np.random.default_rng(seed)
    arr = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))   # noqa: E731
    kv_b = random_mlx_qtensor(*kv_fmt[:3], H * (nope + v), R, kv_fmt[3], seed=seed + 1)
    return (arr(B, H, L, nope), arr(B, H, L, rope), arr(B, T, R), arr(B, T, rope), kv_b, 0.125, None, nope, v)


def _run_mla_msl(metal_sim, kv_fmt, variant, **kw):
    from moe_mla_oracle import assert_mla_close

    args = _mla_args(kv_fmt, **kw)
    dispatch.reset_counters()
    out = kernels.mla_decode(*args, variant=variant)
    c = dispatch.counters()
    assert c["calls"].get("mla_decode/metal") == 1 and not c["fallbacks"], c
    assert metal_sim[0] == "mla_qabs" and metal_sim[-1] == "mla_out", metal_sim
    assert_mla_close(out, *args, label=f"kv_b {kv_fmt[:3]} {kv_fmt[3]} {variant}")


@needs_simulator
@pytest.mark.parametrize("kv_fmt", MLA_CASES)
@pytest.mark.parametrize("variant", ["mma", "simt"])
def test_mla_decode_msl_mlx_kv_b(metal_sim, kv_fmt, variant):
    _run_mla_msl(metal_sim, kv_fmt, variant, seed=len(metal_sim))


@needs_simulator
@pytest.mark.slow
@pytest.mark.parametrize("kv_fmt", MLA_MORE)
def test_mla_decode_msl_mlx_kv_b_more(metal_sim, kv_fmt):
    _run_mla_msl(metal_sim, kv_fmt, "mma", B=2, L=2, T=21)


@needs_simulator
@pytest.mark.parametrize("q_fmt,kv_fmt", [(("affine", 4, 64, mx.bfloat16), ("affine", 4, 64, mx.bfloat16)),
                                          (("mxfp4", 4, 32, mx.bfloat16), ("affine", 3, 32, mx.float16))])
def test_mla_decode_msl_mlx_q_b_folded(metal_sim, q_fmt, kv_fmt):
    """mla_decode given (q_latent, q_b) in MLX formats: mla_qb_qabs projects the queries, and the
    output is the oracle's on the reference projection's queries (float32 q: the same queries to
    the oracle's budget, plus REL of |out| for the two float32 sums' different orders)."""
    from kernel_oracle import random_mlx_qtensor
    from moe_mla_oracle import assert_mla_close

    H, nope, v, rope, q_lora = 4, 32, 32, 16, 192
    _, _, latent, k_rope, kv_b, scale, _, _, _ = _mla_args(kv_fmt, H=H, nope=nope, v=v, rope=rope, seed=3)
    q_b = random_mlx_qtensor(*q_fmt[:3], H * (nope + rope), q_lora, q_fmt[3], seed=9)
    q_latent = mx.array(np.random.default_rng(13).standard_normal((1, 1, q_lora)).astype(np.float32))
    dispatch.reset_counters()
    out = kernels.mla_decode(None, None, latent, k_rope, kv_b, scale, None, nope, v, q_proj=(q_latent, q_b))
    c = dispatch.counters()
    assert metal_sim[0] == "mla_qb_qabs" and not c["fallbacks"], (metal_sim, c)
    with kernels.force_reference():
        q_nope, q_rope = mla.project_queries(q_latent, q_b, H, nope)
    assert_mla_close(out, q_nope, q_rope, latent, k_rope, kv_b, scale, None, nope, v, extra_rel=1e-4)


@needs_simulator
def test_mla_decode_declines_unreadable_mlx_kv_b_visibly(metal_sim):
    """An MLX-format kv_b whose rows are not whole 32-weight units (nvfp4, R = 48): the decline is
    counted with its reason and the reference computes what it computes for kv_b as float32."""
    args = list(_mla_args(("nvfp4", 4, 16, mx.bfloat16), H=2, R=48, seed=2))
    dispatch.reset_counters()
    y = kernels.mla_decode(*args)
    c = dispatch.counters()
    assert any("nvfp4" in r and "I=48" in r for r in c["fallbacks"]), c
    assert not metal_sim
    args[4] = mx.array(decode_mlx(args[4]))
    with kernels.force_reference():
        want = kernels.mla_decode(*args)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode,bits,gs,dtype", [("affine", 3, 32, "bfloat16"), ("mxfp4", 4, 32, "float32")])
def test_row_operations_move_whole_rows(mode, bits, gs, dtype):
    """take_rows / concat_rows / rows_of keep every row's codes, scales and biases together."""
    a, b = _qt(mode, bits, gs, dtype, O=6, seed=1), _qt(mode, bits, gs, dtype, O=4, seed=2)
    wa, wb = decode_mlx(a), decode_mlx(b)
    order = [3, 0, 5, 1, 4, 2]
    _assert_bits_equal(decode_mlx(kernels.take_rows(a, order)), wa[order])
    fused = kernels.concat_rows([a, b])
    assert fused is not None and fused.O == 10
    _assert_bits_equal(decode_mlx(fused), np.concatenate([wa, wb]))
    _assert_bits_equal(decode_mlx(kernels.rows_of(fused, 6, 10)), wb)
    other = _qt("affine", 4, 64, "bfloat16", O=4)
    assert kernels.concat_rows([a, other]) is None   # another bit width or mode: no shared layout


def test_numpy_bfloat16_scales_as_ml_dtypes_or_bits():
    """A safetensors reader hands bfloat16 over as ml_dtypes.bfloat16 or raw uint16 bits: both
    construct, decode bit-exactly and reach the reference path."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, s, b = _quantized("affine", 5, 32, mx.bfloat16, O=6, I=256, seed=4)
    ref = mx.dequantize(q, s, b, group_size=32, bits=5, dtype=mx.float32)
    widened = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=5, dtype=mx.float32)
    bits = lambda a: np.asarray(a.view(mx.uint16))   # noqa: E731
    for conv in (bits, lambda a: bits(a).view(ml_dtypes.bfloat16)):
        qt = qtensor_from_mlx(np.asarray(q), conv(s), conv(b), mode="affine", bits=5, group_size=32, name="w")
        _assert_bits_equal(decode_mlx(qt), ref)
        _assert_bits_equal(reference.dequantize(qt), widened)
        from colibri_mlx.kernels import mlx_formats
        assert mlx_formats.kernel_fmt(qt) == 75
        qm = qt.to_mlx()
        assert isinstance(qm.scales, mx.array) and isinstance(qm.biases, mx.array)
        _assert_bits_equal(reference.dequantize(qm), widened)


@pytest.mark.device
@pytest.mark.skipif(dispatch.gpu_backend() is None, reason="needs a GPU backend (CUDA or Metal)")
@pytest.mark.parametrize("gu,down", MOE_CASES)
def test_moe_block_kernels_on_device(gu, down):
    """The backend's moe_gate_up / moe_down on MLX-format experts, against float64."""
    from moe_mla_oracle import assert_moe_close

    from colibri_mlx.kernels import moe

    experts, ids, w, x = _moe_case(gu, down, D=1024, inter=512, E=8, N=3, K=4, seed=6)
    dispatch.reset_counters()
    y = kernels.moe_block(x, experts, ids, w)
    mx.eval(y)
    c = dispatch.counters()
    moe.clear_banks()
    assert c["calls"].get(f"moe_block/{dispatch.backend()}") == 1 and not c["fallbacks"], c
    assert_moe_close(y, x, experts, ids, w, f"moe {gu[:3]} / {down[:3]}")


@pytest.mark.parametrize("mode,bits,gs,dtype", [("affine", 6, 64, "bfloat16"), ("mxfp8", 8, 32, "float32")])
def test_embedding_rows_of_an_mlx_table(mode, bits, gs, dtype):
    from colibri_mlx.models.deepseek_v3 import embedding_rows

    table = _qt(mode, bits, gs, dtype, O=50, I=128, seed=9)
    ids = mx.array([[3, 49, 3], [0, 17, 8]], dtype=mx.int32)
    got = embedding_rows(table, ids)
    assert got.shape == (2, 3, 128) and got.dtype == mx.float32
    _assert_bits_equal(np.asarray(got).reshape(6, 128), decode_mlx(table)[np.asarray(ids).reshape(-1)])


def _e8m0_zero_case(mode, bits):
    """An mxfp4 / mxfp8 weight whose rows 0 and 1 have every scale byte 0 (2**-127 in MLX, not
    zero: their outputs are ~1e-34) and row 2 every third, with x [2, I]."""
    O, I, gs = 5, 256, 32
    q, s, _ = _quantized(mode, bits, gs, mx.float32, O=O, I=I, seed=4)
    s = np.array(s)
    s[:2] = 0
    s[2, ::3] = 0
    qt = qtensor_from_mlx(q, mx.array(s), mode=mode, bits=bits, group_size=gs, name=f"w.{mode}")
    ref = mx.dequantize(q, mx.array(s), group_size=gs, bits=bits, mode=mode, dtype=mx.float32)
    assert np.all(np.abs(np.asarray(ref)[:2]) < 1e-30) and np.any(np.asarray(ref)[:2] != 0)
    return qt, ref, np.random.default_rng(6).standard_normal((2, I)).astype(np.float32)


def _assert_e8m0_zero_gemv(y, x, qt):
    """Relative to each output's own Σ|x w| with no absolute floor: a kernel reading the byte as
    0.0 is off by 100% on rows 0 and 1."""
    want, terms = _gemv_oracle(x, qt)
    y = np.asarray(y.astype(mx.float32)).astype(np.float64)
    assert np.all(terms > 0)
    assert np.all(np.abs(y - want) <= 1e-6 * terms), np.max(np.abs(y - want) / terms)


@needs_simulator
@pytest.mark.parametrize("mode,bits", [("mxfp4", 4), ("mxfp8", 8)])
def test_e8m0_scale_byte_zero_decodes_as_mlx(mode, bits):
    """Scale byte 0 is 2**-127 in MLX: the reference decode, the numpy decode and qgemv's Metal
    kernel agree with mx.dequantize."""
    from test_qgemv_msl import simulate

    from colibri_mlx.kernels import qgemv

    qt, ref, x = _e8m0_zero_case(mode, bits)
    _assert_bits_equal(reference.dequantize(qt), ref)
    _assert_bits_equal(decode_mlx(qt), ref)
    _assert_e8m0_zero_gemv(simulate(qgemv.launch_spec(mx.array(x), qt)), x, qt)


@pytest.mark.device
@pytest.mark.skipif(dispatch.gpu_backend() is None, reason="needs a GPU backend (CUDA or Metal)")
@pytest.mark.parametrize("mode,bits", [("mxfp4", 4), ("mxfp8", 8)])
def test_e8m0_scale_byte_zero_on_device(mode, bits):
    """The backend's qgemv (Metal or the CUDA twin) on scale byte 0, as the simulator test."""
    qt, _, x = _e8m0_zero_case(mode, bits)
    dispatch.reset_counters()
    y = kernels.qmatmul(mx.array(x), qt)
    mx.eval(y)
    assert dispatch.counters()["calls"] == {f"qgemv/{dispatch.backend()}": 1}
    _assert_e8m0_zero_gemv(y, x, qt)


@pytest.mark.device
@pytest.mark.skipif(dispatch.gpu_backend() is None, reason="needs a GPU backend (CUDA or Metal)")
@pytest.mark.parametrize("kv_fmt", MLA_CASES + [("nvfp4", 4, 16, mx.bfloat16), ("mxfp8", 8, 32, mx.bfloat16)])
def test_mla_decode_mlx_kv_b_on_device(kv_fmt):
    """The backend's mla_decode (Metal or the CUDA twin, its default variant) on an MLX-format
    kv_b and q_b at DeepSeek-V3's head widths, against the float64 oracle with the budget of the
    variant that ran (test_mla_decode.py: the CUDA matrix variants' TF32 model)."""
    from kernel_oracle import random_mlx_qtensor
    from moe_mla_oracle import assert_mla_close
    from test_mla_decode import assert_attention_close

    H, nope, v, R, rope, T = 16, 128, 128, 512, 64, 300
    args = _mla_args(kv_fmt, B=1, H=H, L=1, T=T, nope=nope, v=v, R=R, rope=rope, seed=7)
    args = (*args[:2], args[2].astype(mx.bfloat16), args[3].astype(mx.bfloat16), *args[4:])
    dispatch.reset_counters()
    out = kernels.mla_decode(*args)
    mx.eval(out)
    c = dispatch.counters()
    assert c["calls"].get(f"mla_decode/{dispatch.backend()}") == 1 and not c["fallbacks"], c
    variant = mla.choose_variant(R, rope, backend=dispatch.backend(), dtype=args[0].dtype, cache_dtype=args[2].dtype)
    assert_attention_close(out, *args, variant=variant, label=str(kv_fmt[:3]))
    # q_b in the same format, folded into the first launch (float32 queries: the simt variant)
    q_b = random_mlx_qtensor(*kv_fmt[:3], H * (nope + rope), 1536, kv_fmt[3], seed=8)
    q_latent = mx.array(np.random.default_rng(9).standard_normal((1, 1, 1536)).astype(np.float32))
    dispatch.reset_counters()
    out = kernels.mla_decode(None, None, args[2], args[3], args[4], args[5], None, nope, v, q_proj=(q_latent, q_b))
    mx.eval(out)
    c = dispatch.counters()
    assert c["calls"].get(f"mla_qb_qabs/{dispatch.backend()}") == 1 and not c["fallbacks"], c
    with kernels.force_reference():
        q_nope, q_rope = mla.project_queries(q_latent, q_b, H, nope)
    assert_mla_close(out, q_nope, q_rope, args[2], args[3], args[4], args[5], None, nope, v, extra_rel=1e-4)

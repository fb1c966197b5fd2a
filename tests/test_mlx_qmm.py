"""kernels.mlx_qmm: prefill rows through mx.quantized_matmul on the stored bytes (MLX's formats
as they are; fmt 4 read as MLX affine), against the float64 decode of the same weights."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx import kernels
from colibri_mlx.kernels import mlx_qmm, qgemv
from kernel_oracle import MLX_KERNEL_CASES, assert_close, random_gguf_qtensor, random_mlx_qtensor, random_qtensor, random_x

# float32 x: MLX's CPU quantized_matmul accumulates float32 products, so any layout slip (nibble
# order, zero point, group, row scale) is far above the 1e-4 |delta| / sum|x w| bound.
CONTAINER_CASES = [(4, 32, 256), (4, 64, 384), (4, 128, 512)]


@pytest.mark.parametrize("fmt,gs,I", CONTAINER_CASES, ids=[f"fmt{f}-gs{g}-I{i}" for f, g, i in CONTAINER_CASES])
def test_container_formats_read_as_mlx_affine(fmt, gs, I):
    qt = random_qtensor(fmt, 24, I, gs=gs, seed=fmt + I)
    assert mlx_qmm.decline_reason(qt, mx.float32) is None
    x = random_x(40, I, seed=3)
    assert_close(mlx_qmm.qmatmul(x, qt), x, qt, f"fmt {fmt} as affine")


@pytest.mark.parametrize("mode,bits,gs,sdtype", MLX_KERNEL_CASES, ids=[f"{m}{b}g{g}" for m, b, g, _ in MLX_KERNEL_CASES])
def test_mlx_formats_as_stored(mode, bits, gs, sdtype):
    qt = random_mlx_qtensor(mode, bits, gs, 24, 256, scale_dtype=sdtype, seed=bits + gs)
    assert mlx_qmm.decline_reason(qt, mx.float32) is None
    x = random_x(40, 256, seed=4)
    assert_close(mlx_qmm.qmatmul(x, qt), x, qt, f"{mode} {bits}-bit g{gs}")


def test_formats_without_an_mlx_layout_are_declined():
    cases = {
        "fmt 1 has no MLX layout": random_qtensor(1, 8, 256),
        "fmt 2 has no MLX layout": random_qtensor(2, 8, 256),
        "fmt 5 has no MLX layout": random_qtensor(5, 8, 256),
        "fmt 6 has no MLX layout": random_qtensor(6, 8, 256),
        "fmt 17 has no MLX layout": random_gguf_qtensor("Q4_K", 8, 256),
        "group size 16 is not one of MLX's (128, 64, 32)": random_qtensor(4, 8, 256, gs=16),
        "row of 96 weights ends in a partial group of 64": random_qtensor(4, 8, 96, gs=64),
    }
    for want, qt in cases.items():
        assert mlx_qmm.decline_reason(qt, mx.bfloat16) == want
    assert mlx_qmm.decline_reason(random_qtensor(4, 8, 256, gs=64), mx.int32) == "x dtype mlx.core.int32"


def test_gpu_prefill_route_is_counted(monkeypatch):
    """On a GPU backend, more than qgemv.MAX_ROWS bfloat16 rows take mx.quantized_matmul
    for a format it reads (counted as qmm/mlx-quantized-matmul) and dequantize-and-multiply for
    one it does not; the residual is added."""
    monkeypatch.setattr(kernels, "backend", lambda: kernels.CUDA)
    kernels.reset_counters()
    S = qgemv.MAX_ROWS + 8
    qt = random_qtensor(4, 24, 256, gs=64, seed=5)
    x = random_x(S, 256, mx.bfloat16, seed=6)
    res = random_x(S, 24, mx.bfloat16, seed=7)
    y = kernels.qmatmul(x, qt, residual=res)
    assert kernels.counters()["calls"] == {"qmm/mlx-quantized-matmul": 1}
    assert np.array_equal(np.array(y.astype(mx.float32)), np.array((res + mlx_qmm.qmatmul(x, qt)).astype(mx.float32)))
    kernels.qmatmul(x, random_qtensor(5, 24, 256, seed=8))
    assert kernels.counters()["calls"] == {"qmm/mlx-quantized-matmul": 1, "qmm/dequant-matmul": 1}
    kernels.reset_counters()


def test_cuda_decode_rows_from_qmm_min_rows(monkeypatch):
    """On CUDA, kernels.QMM_MIN_ROWS (8) bfloat16 decode rows of a format MLX reads take
    mx.quantized_matmul (its result, residual added, float32 logits cast from it); one row fewer
    stays on qgemv, as does a format MLX does not read at 8 rows."""
    monkeypatch.setattr(kernels, "backend", lambda: kernels.CUDA)
    S = kernels.QMM_MIN_ROWS[kernels.CUDA]
    assert S <= qgemv.MAX_ROWS
    qt = random_qtensor(4, 24, 256, gs=64, seed=11)
    x = random_x(S, 256, mx.bfloat16, seed=12)
    res = random_x(S, 24, mx.bfloat16, seed=13)
    kernels.reset_counters()
    y = kernels.qmatmul(x, qt, residual=res)
    logits = kernels.qmatmul(x.reshape(2, S // 2, 256), qt, out_dtype=mx.float32)
    assert kernels.counters()["calls"] == {"qmm/mlx-quantized-matmul": 2}
    want = mlx_qmm.qmatmul(x, qt)
    assert np.array_equal(np.array(y.astype(mx.float32)), np.array((res + want).astype(mx.float32)))
    assert logits.dtype == mx.float32 and logits.shape == (2, S // 2, 24)
    assert np.array_equal(np.array(logits).reshape(S, 24), np.array(want.astype(mx.float32)))
    assert not kernels._mlx_qmm_takes(x[: S - 1], qt, S - 1, kernels.CUDA)
    assert not kernels._mlx_qmm_takes(x, random_qtensor(2, 24, 256, seed=14), S, kernels.CUDA)
    assert not kernels._mlx_qmm_takes(x, qt, S, kernels.METAL)
    kernels.reset_counters()


@pytest.mark.parametrize("fmt,gs,I", CONTAINER_CASES, ids=[f"fmt{f}-gs{g}-I{i}" for f, g, i in CONTAINER_CASES])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.device
@pytest.mark.skipif(kernels.dispatch.gpu_backend() is None, reason="needs a GPU backend (CUDA or Metal)")
def test_prefill_route_on_the_gpu(fmt, gs, I, dtype):
    """The GPU's quantized matmul on 64 rows: float32 accumulation, the scale rounded to x's dtype
    (2^-9 relatively for bfloat16) and the output rounded once: within the qgemv tolerance."""
    qt = random_qtensor(fmt, 96, I, gs=gs, seed=fmt + I).to_mlx()
    x = random_x(64, I, dtype, seed=9)
    kernels.reset_counters()
    y = kernels.qmatmul(x, qt)
    assert kernels.counters()["calls"] == {"qmm/mlx-quantized-matmul": 1}
    assert_close(y, x, qt, f"fmt {fmt} {dtype} prefill")


# ---------------------------------------------------------------------------------------
# moe_block's long prefill: mx.gather_qmm over the resident bank


def bank_experts(fmt, gs, E=7, D=256, inter=128, seed=0):
    return [tuple(random_qtensor(fmt, O, I, gs=gs, seed=seed + 3 * e + k).to_mlx()
                  for k, (O, I) in enumerate(((inter, D), (inter, D), (D, inter))))
            for e in range(E)]


@pytest.mark.parametrize("fmt,gs", [(4, 32), (4, 128)])
def test_moe_gather_qmm_matches_float64(fmt, gs):
    """Every (token, slot) row through mx.gather_qmm of the stacked gate+up and down, sorted by
    expert and back, weighted in float32: against the float64 MoE. Slots dropped by top-p (-1)
    and an id past the experts weigh nothing; one expert chosen by every token."""
    from colibri_mlx.kernels import moe
    from moe_mla_oracle import assert_moe_close

    experts = bank_experts(fmt, gs, seed=gs)
    N, K = 40, 3
    rng = np.random.default_rng(fmt)
    ids = np.stack([rng.choice(len(experts), K, replace=False) for _ in range(N)]).astype(np.int32)
    ids[:, 0] = 5
    ids[3, 2], ids[7, 1] = -1, len(experts) + 2
    w = mx.array(rng.uniform(0.1, 1.0, (N, K)).astype(np.float32))
    x = random_x(N, 256, seed=fmt + 10)
    bank = moe.build_bank(experts)
    assert moe.gather_reason(bank, mx.bfloat16) is None
    y = moe.moe_gather_qmm(x, bank.groups[0], mx.array(ids), w)
    assert y.shape == (N, 256) and y.dtype == mx.float32
    assert_moe_close(y, x, experts, mx.array(ids), w, f"gather_qmm fmt {fmt}")


def test_moe_gather_qmm_declines():
    from colibri_mlx.kernels import moe

    assert moe.gather_reason(moe.build_bank(bank_experts(4, 64)), mx.float32) == "x dtype mlx.core.float32"
    assert moe.gather_reason(moe.build_bank(bank_experts(4, 16)), mx.bfloat16) == \
        "group size 16 is not one of MLX's (128, 64, 32)"
    assert moe.gather_reason(moe.build_bank(bank_experts(5, None)), mx.bfloat16) == "fmt 5 has no MLX layout"
    assert moe.gather_reason(moe.build_bank(bank_experts(2, None)), mx.bfloat16) == "fmt 2 has no MLX layout"
    mixed = bank_experts(4, 64)[:3] + bank_experts(2, None)[3:]
    assert moe.gather_reason(moe.build_bank(mixed), mx.bfloat16) == "2 expert groups"


def test_moe_long_prefill_route_is_counted(monkeypatch):
    """On a GPU backend more than qgemv.MAX_ROWS tokens of a resident fmt 4 layer take
    mx.gather_qmm (moe_block/gather-qmm); the residual is the separate add."""
    from colibri_mlx.kernels import dispatch, moe

    monkeypatch.setattr(dispatch, "backend", lambda: dispatch.CUDA)
    experts = bank_experts(4, 64, seed=3)
    N = qgemv.MAX_ROWS + 4
    rng = np.random.default_rng(3)
    ids = mx.array(np.stack([rng.choice(len(experts), 2, replace=False) for _ in range(N)]).astype(np.int32))
    w = mx.array(rng.uniform(0.1, 1.0, (N, 2)).astype(np.float32))
    x = random_x(N, 256, mx.bfloat16, seed=4)
    res = random_x(N, 256, mx.bfloat16, seed=5)
    kernels.reset_counters()
    y = kernels.moe_block(x, experts, ids, w, residual=res)
    assert kernels.counters()["calls"] == {"moe_block/gather-qmm": 1}
    monkeypatch.setattr(moe, "GATHER_MAX_TOKENS", N - 1)      # longer prefill: grouped by expert
    monkeypatch.setattr(moe, "reference_moe_block", lambda *a, **k: mx.zeros((N, 256), mx.bfloat16))
    kernels.moe_block(x, experts, ids, w)
    assert kernels.counters()["calls"]["moe_block/grouped-prefill"] == 1
    want = res + moe.moe_gather_qmm(x, moe.resident_bank(experts).groups[0], ids, w)
    assert np.array_equal(np.array(y.astype(mx.float32)), np.array(want.astype(mx.float32)))
    moe.clear_banks()
    kernels.reset_counters()


@pytest.mark.parametrize("mode,bits,gs,sdtype", MLX_KERNEL_CASES, ids=[f"{m}{b}g{g}" for m, b, g, _ in MLX_KERNEL_CASES])
def test_moe_gather_qmm_mlx_formats(mode, bits, gs, sdtype):
    """An mlx-lm checkpoint's experts: the bank's kernel inputs (scale and bias words, padded fp
    scale bytes) read back for mx.gather_qmm, against the float64 MoE."""
    from colibri_mlx.kernels import moe
    from moe_mla_oracle import assert_moe_close

    experts = [tuple(random_mlx_qtensor(mode, bits, gs, O, I, scale_dtype=sdtype, seed=7 * e + k)
                     for k, (O, I) in enumerate(((128, 256), (128, 256), (256, 128)))) for e in range(5)]
    N, K = 36, 2
    rng = np.random.default_rng(bits)
    ids = mx.array(np.stack([rng.choice(5, K, replace=False) for _ in range(N)]).astype(np.int32))
    w = mx.array(rng.uniform(0.1, 1.0, (N, K)).astype(np.float32))
    x = random_x(N, 256, seed=bits)
    bank = moe.build_bank(experts)
    assert moe.gather_reason(bank, mx.bfloat16) is None
    assert_moe_close(moe.moe_gather_qmm(x, bank.groups[0], ids, w), x, experts, ids, w, f"gather {mode}{bits}")

"""The GPU backend's MLX-format decode at DeepSeek-V3's shapes, and decode steps from an empty
cache, on the device (CUDA or Metal; skipped elsewhere).

* qgemv and moe_block on every affine bits x group size at the end-to-end bench's shapes
  (18432x7168 takes CUDA's persistent six-row grid with the shape compiled in; the 4-bit units
  16-byte loads), against ``q * s + b`` with the codes from ``mx.dequantize`` with unit scales
  and zero biases (exact small integers): qgemv's every row in float32 on the device and 640 of
  them in float64 on the host, moe_block in float64.
* A prompt fed one token at a time from an empty cache (every call a decode step, the first at
  offset 0), kernels on against the reference in lockstep (each its own cache), on a tiny and a
  DeepSeek-V3-wide mlx-lm affine 4-bit g64 checkpoint and on a fmt 4 container: every step's
  logits and every cache row written agree to bfloat16 rounding, and so does the last step's when
  no earlier step's logits were evaluated (the cache rows are written in place by mla_rows_into).

    python -m pytest -q -n 0 -m device tests/test_mlx_lm_device.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import mlx.core as mx

from colibri_mlx import kernels
from colibri_mlx.kernels import compiled, dispatch, moe

sys.path.insert(0, os.path.dirname(__file__))
BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(dispatch.gpu_backend() is None, reason="needs a GPU backend (CUDA or Metal)")]

AFFINE = [(b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
D, INTER, MOE_INTER, Q_LORA, KV_ROWS, H_NOPE_ROPE, H_V = 7168, 18432, 2048, 1536, 576, 128 * 192, 128 * 128
# (O, I) of the bench model's decode GEMVs besides 18432x7168 and 7168x2048 (every format there)
OTHER_SHAPES = [(2048, D), (Q_LORA + KV_ROWS, D), (H_NOPE_ROPE, Q_LORA), (D, H_V), (D, INTER)]
MOE_AFFINE = [(b, 64) for b in (2, 3, 4, 5, 6, 8)] + [(3, 32), (3, 128), (4, 32), (4, 128)]


# ---------------------------------------------------------------------------------------
# float64 oracle of mx.quantize's affine codes

_parts: dict = {}


def random_affine(O: int, I: int, bits: int, gs: int, seed: int):
    """A QTensor (fmt 7) of ``mx.quantize`` of random bfloat16 weights, made on the device."""
    from colibri_mlx.formats import qtensor_from_mlx

    w = (mx.random.normal((O, I), key=mx.random.key(seed)) * 0.05).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    mx.eval(wq, s, b)
    qt = qtensor_from_mlx(wq, s, b, mode="affine", bits=bits, group_size=gs, name=f"test.affine{bits}g{gs}")
    _parts[id(qt)] = (wq, s, b, bits, gs)
    return qt


def _codes(qt) -> mx.array:
    """The codes q of an affine tensor as float32 ``[O, I]``: ``mx.dequantize`` with scale 1 and
    bias 0 (small integers, exact)."""
    wq, s, _, bits, gs = _parts[id(qt)]
    one = mx.ones(s.shape, mx.float32)
    return mx.dequantize(wq, one, mx.zeros_like(one), group_size=gs, bits=bits, dtype=mx.float32)


def affine_f64(qt) -> np.ndarray:
    """``q * s + b`` in float64."""
    _, s, b, _, gs = _parts[id(qt)]
    q64 = np.asarray(_codes(qt)).astype(np.float64).reshape(s.shape[0], -1, gs)
    s64 = np.asarray(s.astype(mx.float32)).astype(np.float64)[..., None]
    b64 = np.asarray(b.astype(mx.float32)).astype(np.float64)[..., None]
    return (q64 * s64 + b64).reshape(s.shape[0], -1)


@pytest.fixture
def f64_oracle(monkeypatch):
    """kernel_oracle / moe_mla_oracle decoding the test's affine tensors through affine_f64."""
    import kernel_oracle
    import moe_mla_oracle

    monkeypatch.setattr(kernel_oracle, "dequant_f64", affine_f64)
    monkeypatch.setattr(moe_mla_oracle, "weight_f64", affine_f64)
    yield
    _parts.clear()
    moe.clear_banks()


SAMPLED_ROWS = 512


def _qgemv_case(O, I, bits, gs, S=1):
    """Every row against ``q * s + b`` and the products in float32 on the device (an error of
    ~1e-6 of Σ|x w|, far inside the bf16 tolerance), and the first and last 64 rows and 512 more
    at random against float64 on the host (kernel_oracle.assert_close). Both bound |Δ| by
    REL_TOL · Σ|x w|."""
    from kernel_oracle import REL_TOL, assert_close, random_x

    from colibri_mlx.formats import qtensor_from_mlx

    qt = random_affine(O, I, bits, gs, seed=O + bits * 7 + gs)
    x = random_x(S, I, dtype=mx.bfloat16, seed=bits + gs)
    dispatch.reset_counters()
    y = kernels.qmatmul(x, qt)
    mx.eval(y)
    c = dispatch.counters()
    assert c["calls"] == {f"qgemv/{dispatch.backend()}": 1} and not c["fallbacks"], c
    label = f"qgemv affine {bits}-bit g{gs} {O}x{I} S={S}"
    wq, s, b, _, _ = _parts[id(qt)]
    w32 = (_codes(qt).reshape(O, -1, gs) * s.astype(mx.float32)[..., None]
           + b.astype(mx.float32)[..., None]).reshape(O, I)
    x32 = x.astype(mx.float32)
    want = np.asarray(x32 @ w32.T)
    mag = np.asarray(mx.abs(x32) @ mx.abs(w32).T)
    got = np.asarray(y.astype(mx.float32))
    assert np.isfinite(got).all(), f"{label}: non-finite output"
    rel = np.abs(got - want) / (mag + 1e-30)
    assert rel.max() <= REL_TOL[mx.bfloat16], (
        f"{label}: |Δ|/Σ|xw| = {rel.max():.3g} at {np.unravel_index(rel.argmax(), rel.shape)} (float32 oracle)")
    rng = np.random.default_rng(O)
    rows = np.unique(np.concatenate([np.arange(64), np.arange(O - 64, O), rng.integers(0, O, SAMPLED_ROWS)]))
    idx = mx.array(rows.astype(np.int32))
    sub = qtensor_from_mlx(wq[idx], s[idx], b[idx], mode="affine", bits=bits, group_size=gs, name=label)
    _parts[id(sub)] = (wq[idx], s[idx], b[idx], bits, gs)
    assert_close(y[:, idx], x, sub, label + " (float64, sampled rows)")


@pytest.mark.parametrize("O,I", [(INTER, D), (D, MOE_INTER)])
@pytest.mark.parametrize("bits,gs", AFFINE)
def test_qgemv_affine_at_bench_shapes(f64_oracle, O, I, bits, gs):
    _qgemv_case(O, I, bits, gs)


@pytest.mark.parametrize("O,I", OTHER_SHAPES)
@pytest.mark.parametrize("bits", (2, 3, 4, 5, 6, 8))
def test_qgemv_affine_g64_at_bench_shapes(f64_oracle, O, I, bits):
    _qgemv_case(O, I, bits, 64)


def test_qgemv_affine_few_rows_at_bench_shape(f64_oracle):
    for S in (2, 4, 8):
        _qgemv_case(INTER, D, 4, 64, S=S)


@pytest.mark.parametrize("bits,gs", MOE_AFFINE)
def test_moe_block_affine_at_bench_shapes(f64_oracle, bits, gs):
    """One token, 4 of 8 experts (gate/up 2048x7168, down 7168x2048), as a decode step."""
    from moe_mla_oracle import assert_moe_close

    E, K = 8, 4
    experts = [tuple(random_affine(O, I, bits, gs, seed=100 * e + j)
                     for j, (O, I) in enumerate(((MOE_INTER, D), (MOE_INTER, D), (D, MOE_INTER)))) for e in range(E)]
    rng = np.random.default_rng(bits * 1000 + gs)
    ids = mx.array(rng.choice(E, K, replace=False).astype(np.int32)[None])
    w = mx.array(rng.uniform(0.1, 1.0, (1, K)).astype(np.float32))
    x = mx.array(rng.standard_normal((1, D)).astype(np.float32)).astype(mx.bfloat16)
    dispatch.reset_counters()
    y = kernels.moe_block(x, experts, ids, w)
    mx.eval(y)
    c = dispatch.counters()
    assert c["calls"].get(f"moe_block/{dispatch.backend()}") == 1 and not c["fallbacks"], c
    assert_moe_close(y, x, experts, ids, w, f"moe_block affine {bits}-bit g{gs}", extra_rel=2.0 ** -8)


# ---------------------------------------------------------------------------------------
# decode steps from an empty cache

# bfloat16 activations: kernels and reference differ by bfloat16 roundings (the bench measured
# 1e-2 of the largest logit after a prefill); a wrong cache row or attention gives O(1).
STEP_REL = 5e-2
TINY = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
            q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
            n_routed_experts=16, n_group=4, topk_group=2, vocab_size=512)
WIDE = dict(hidden_size=D, intermediate_size=INTER, moe_intermediate_size=MOE_INTER, num_attention_heads=16,
            q_lora_rank=Q_LORA, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            n_routed_experts=16, n_group=4, topk_group=2, vocab_size=4096)


def _config(dims: dict) -> dict:
    return dict(dims, model_type="deepseek_v3", num_hidden_layers=2, num_key_value_heads=dims["num_attention_heads"],
                num_experts_per_tok=8, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                first_k_dense_replace=1, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                topk_method="noaux_tc", scoring_func="sigmoid")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """mlx-lm affine 4-bit g64 checkpoints written by mlx-lm's own quantization and save_model."""
    pytest.importorskip("mlx_lm")
    sys.path.insert(0, str(BENCH))
    from bench_mlx_lm_checkpoint import write_checkpoint

    out = {}
    for name, dims in (("tiny", TINY), ("wide", WIDE)):
        mx.random.seed(0)
        path = tmp_path_factory.mktemp("mlx_lm_device") / name
        write_checkpoint(_config(dims), "affine", 4, 64, path)
        out[name] = str(path)
    return out


def _container_model(monkeypatch):
    """bench_e2e.py's fmt 4 g64 container model at TINY's widths."""
    sys.path.insert(0, str(BENCH))
    import bench_e2e
    import bench_moe_mla as B

    for k, v in dict(D=TINY["hidden_size"], INTER=TINY["moe_intermediate_size"], H=TINY["num_attention_heads"],
                     Q_LORA=TINY["q_lora_rank"], KV_LORA=TINY["kv_lora_rank"], NOPE=TINY["qk_nope_head_dim"],
                     ROPE=TINY["qk_rope_head_dim"], V=TINY["v_head_dim"]).items():
        monkeypatch.setattr(B, k, v)
    mx.random.seed(0)
    cfg = B.config(n_layers=2, experts=TINY["n_routed_experts"], first_dense=1, vocab=TINY["vocab_size"])
    cfg.update(intermediate_size=TINY["intermediate_size"], n_group=4, topk_group=2)
    return bench_e2e.our_model(cfg)


def stepwise_lockstep(model, prompt) -> dict:
    """The prompt fed one token at a time from an empty cache, kernels on and the reference in
    lockstep (two caches): each step's logits difference over the largest reference logit, and
    per layer the cache rows' largest difference over the largest reference value. ``dropped``:
    the kernels fed the prompt again, no step's logits evaluated but the last (the cache rows
    must still be written: the rows are written in place, which only a graph edge orders)."""
    from colibri_mlx.models.deepseek_v3 import CACHE_STREAM

    mine, ref = model.make_cache(), model.make_cache()
    steps = []
    for i in range(prompt.shape[1]):
        tok = prompt[:, i:i + 1]
        a = model(tok, mine)[0, -1].astype(mx.float32)
        with kernels.force_reference():
            b = model(tok, ref)[0, -1].astype(mx.float32)
        a, b = np.array(a), np.array(b)
        assert np.isfinite(a).all(), f"step {i}: non-finite logits with kernels on"
        steps.append(float(np.abs(a - b).max() / np.abs(b).max()))
    unevaluated = model.make_cache()
    for i in range(prompt.shape[1]):
        out = model(prompt[:, i:i + 1], unevaluated)
    last = np.array(out[0, -1].astype(mx.float32))
    dropped = float(np.abs(last - b).max() / np.abs(b).max())
    n = prompt.shape[1]
    rows = []
    for lm, lr in zip(mine.layers, ref.layers):
        x = np.array(lm.buffers[CACHE_STREAM][:, :n].astype(mx.float32))
        y = np.array(lr.buffers[CACHE_STREAM][:, :n].astype(mx.float32))
        per_row = np.abs(x - y).max(axis=(0, 2)) / np.abs(y).max()
        rows.append(per_row)
    return {"steps": steps, "rows": rows, "dropped": dropped}


def _check_stepwise(model, label):
    prompt = mx.array(np.random.default_rng(0).integers(0, 512, (1, 16)).astype(np.int32))
    r = stepwise_lockstep(model, prompt)
    bad_steps = [(i, round(v, 4)) for i, v in enumerate(r["steps"]) if v > STEP_REL]
    bad_rows = [(layer, int(np.argmax(v > STEP_REL)), round(float(v.max()), 4))
                for layer, v in enumerate(r["rows"]) if v.max() > STEP_REL]
    assert not bad_steps and not bad_rows and r["dropped"] <= STEP_REL, (
        f"{label}: decode steps from an empty cache, kernels vs reference: steps (index, rel) over "
        f"{STEP_REL}: {bad_steps}; cache rows (layer, first bad slot, worst rel): {bad_rows}; "
        f"the last step with the earlier steps' logits never evaluated: rel {r['dropped']:.3g}; "
        f"every step's rel: {[round(v, 4) for v in r['steps']]}; counters {kernels.format_counters()}")


def _force_attention_variant(monkeypatch, variant: str):
    """mla_decode's attention variant for every launch (``default``: the backend's choice)."""
    from colibri_mlx.kernels import mla

    if variant == "default":
        return
    choose = mla.choose_variant
    monkeypatch.setattr(mla, "choose_variant", lambda R, rope, v=None, *a, **k: choose(R, rope, v or variant, *a, **k))


@pytest.mark.parametrize("variant", ["default", "mma", "simt"])
@pytest.mark.parametrize("compile_mode", ["auto", "0"])
@pytest.mark.parametrize("which", ["tiny", "wide"])
def test_stepwise_from_empty_cache_mlx_lm(checkpoints, monkeypatch, which, compile_mode, variant):
    """``variant``: mla_decode's attention variant forced (CUDA's default over a bf16 cache is
    ``wide``), which tells an attention defect from the rest."""
    from colibri_mlx.models.loading import load_model

    monkeypatch.setenv("COLIBRI_COMPILE", compile_mode)
    _force_attention_variant(monkeypatch, variant)
    compiled.clear()
    model = load_model(checkpoints[which])
    _check_stepwise(model, f"mlx-lm affine4 g64 {which}, COLIBRI_COMPILE={compile_mode}, attention {variant}")
    moe.clear_banks()
    compiled.clear()


@pytest.mark.parametrize("compile_mode", ["auto", "0"])
def test_stepwise_from_empty_cache_container(monkeypatch, compile_mode):
    monkeypatch.setenv("COLIBRI_COMPILE", compile_mode)
    compiled.clear()
    _check_stepwise(_container_model(monkeypatch), f"fmt 4 container tiny, COLIBRI_COMPILE={compile_mode}")
    moe.clear_banks()


# ---------------------------------------------------------------------------------------
# 64 greedy tokens, kernels on against the reference, on the same checkpoint

@pytest.mark.parametrize("fmt", ["affine4g64", "affine3g64", "mxfp4"])
def test_greedy_64_tokens_kernels_equal_reference(tmp_path, fmt):
    """A tiny mlx-lm checkpoint (mlx-lm's own quantization) decoded with float32 activations: the
    kernels and the reference then differ by float32 roundings (~1e-6 of a logit), far below the
    top-2 margins of 64 greedy steps, so any flip is a kernel defect, not a near-tie of bfloat16
    roundings (the bench model's bf16 run reports those with their margins)."""
    pytest.importorskip("mlx_lm")
    sys.path.insert(0, str(BENCH))
    from bench_mlx_lm_checkpoint import FORMATS, write_checkpoint
    from colibri_mlx.generate import generate_tokens
    from colibri_mlx.models.loading import load_model

    mode, bits, gs = FORMATS[fmt]
    mx.random.seed(0)
    write_checkpoint(_config(TINY), mode, bits, gs, tmp_path)
    model = load_model(str(tmp_path), dtype="float32")
    prompt = [3, 17, 5, 9, 11, 200, 41, 7]
    kernels.reset_counters()
    got = [t for t, _ in generate_tokens(model, prompt, 64)]
    c = kernels.counters()
    with kernels.force_reference():
        want = [t for t, _ in generate_tokens(model, prompt, 64)]
    assert got == want, f"{fmt}: first difference at token {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
    b = dispatch.backend()
    assert c["calls"].get(f"moe_block/{b}", 0) > 0 and c["calls"].get(f"mla_decode/{b}", 0) > 0, c
    assert c["calls"].get(f"qgemv/{b}", 0) > 0 and not c["fallbacks"], c

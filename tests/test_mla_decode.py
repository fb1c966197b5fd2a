"""kernels.mla_decode on this machine's backend (CPU: the reference; CUDA on the H200: the CUDA
twins) against the float64 oracle: every kv_b fmt, cache lengths around tile and 4096
boundaries, masks, DSA position lists, bf16 caches; DeepSeek-V3 head shapes (128 heads,
R 512, nope 128, v 128, rope 64) and a 40000-long cache on a GPU backend only.

The CUDA twin's matrix variants (mma, wide: the defaults over 16-bit caches) round q', P (and
float32 caches) to TF32 for the tensor cores: they are checked against a model of what they
round (moe_mla_oracle.mla_oracle_tf32, a budget ~1/600 of the worst-case REL_TF32 one at
DeepSeek-V3's widths; tests/test_mla_oracle_tf32.py checks it against a numpy emulation).
Metal's simdgroup matrices and the simt variant compute in float32 (REL).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx import kernels
from kernel_oracle import random_qtensor
from colibri_mlx.kernels import dispatch, mla
from moe_mla_oracle import REL, REL_TF32, assert_mla_close, assert_mla_close_tf32

GPU = kernels.backend() != kernels.REFERENCE
gpu_only = pytest.mark.skipif(not GPU, reason="DeepSeek-V3 head shapes: GPU backend only")


def inputs(B=1, H=2, L=1, T=37, nope=16, v=16, R=64, rope=16, fmt=4, gs=32, cache=mx.float32, seed=0,
           masked=False, n_sel=None):
    rng = np.random.default_rng(seed)
    f = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    kv_b = (random_qtensor(fmt, H * (nope + v), R, gs=gs, seed=seed).to_mlx() if fmt not in (0, "bf16")
            else mx.array(rng.standard_normal((H * (nope + v), R)).astype(np.float32) * 0.1))
    if fmt == "bf16":   # a float kv_b held in bfloat16 (kernel FMT 60 on a GPU)
        kv_b = kv_b.astype(mx.bfloat16)
    mask = mx.array(rng.random((B, 1, L, T)) < 0.8) if masked else None
    sel = None
    if n_sel:
        sel = mx.array(np.stack([np.stack([rng.choice(T, n_sel, replace=False) for _ in range(L)])
                                 for _ in range(B)]).astype(np.int32))
    args = (f(B, H, L, nope), f(B, H, L, rope), f(B, T, R).astype(cache), f(B, T, rope).astype(cache),
            kv_b, 1.0 / np.sqrt(nope + rope), mask, nope, v)
    return args, sel


def attention_budget(variant: str) -> float:
    """The attention stages' relative error per term for the variant that ran: the CUDA matrix
    variants round q' and P to TF32, everything else is float32."""
    return REL_TF32 if kernels.backend() == "cuda" and variant in mla.MATRIX_VARIANTS else REL


def assert_attention_close(out, *args, variant: str, selected=None, label=""):
    """``out`` against the float64 oracle with the budget of the variant that ran: the TF32
    model for the CUDA matrix variants on q' | q_rope as given (mla_qabs copies q_rope), REL
    elsewhere."""
    if kernels.backend() == "cuda" and variant in mla.MATRIX_VARIANTS:
        return assert_mla_close_tf32(out, *args, selected=selected, label=label)
    return assert_mla_close(out, *args, selected=selected, label=label, rel_attn=attention_budget(variant))


def check(joint=False, variant=None, **kw):
    """``joint``: the cache as one buffer ``[B, T, R + rope]`` (the model's layout), k_rope None;
    ``variant``: the attention kernel asked for (default: mla.choose_variant's)."""
    args, sel = inputs(**kw)
    kernels.reset_counters()
    q_nope, q_rope, latent, k_rope, *rest = args
    run_args = (q_nope, q_rope, mx.concatenate([latent, k_rope], axis=-1), None, *rest) if joint else args
    out = kernels.mla_decode(*run_args, selected=sel, variant=variant)
    mx.eval(out)
    c = kernels.counters()
    assert not c["fallbacks"], c
    assert out.dtype == args[0].dtype
    R, rope = args[2].shape[-1], args[3].shape[-1]
    variant = mla.choose_variant(R, rope, variant, backend=kernels.backend(), dtype=args[0].dtype,
                                 cache_dtype=args[2].dtype)
    assert c["calls"].get(f"mla_attn/{variant}/{kernels.backend()}", 0) == int(GPU), c
    return assert_attention_close(out, *args, variant=variant, selected=sel, label=str(kw))


@pytest.mark.parametrize("fmt", [0, 1, 2, 3, 4, 5, "bf16"])
def test_each_kv_b_fmt(fmt):
    check(fmt=fmt, seed=7 if fmt == "bf16" else fmt)


@pytest.mark.parametrize("T", [1, 4095, 4096, 4097])
def test_cache_lengths(T):
    check(T=T, seed=T, masked=T > 1)


def test_batch_of_query_rows_bf16_cache_and_dsa_positions():
    check(B=2, L=3, T=300, cache=mx.bfloat16, masked=True, seed=1)
    check(B=1, L=2, T=500, n_sel=64, seed=2)


@gpu_only
@pytest.mark.parametrize("T", [1, 4095, 4096, 4097, 40000])
def test_deepseek_heads(T):
    check(H=128, nope=128, v=128, R=512, rope=64, gs=64, T=T, cache=mx.bfloat16, seed=T)


@pytest.mark.parametrize("deepseek", [False, pytest.param(True, marks=gpu_only)])
def test_joint_cache(deepseek):
    """The model's cache: one buffer, each row the latent then the rope key (mla_attn reads both
    parts from it), at a batch with a bf16 cache and masks and at a DSA list."""
    dims = dict(H=128, nope=128, v=128, R=512, rope=64, gs=64) if deepseek else {}
    check(joint=True, B=2, L=1, T=4097 if deepseek else 300, cache=mx.bfloat16, masked=True, seed=21, **dims)
    check(joint=True, T=40000 if deepseek else 500, n_sel=2048 if deepseek else 64, seed=22, **dims)


@gpu_only
def test_deepseek_heads_dsa_2048_of_40000():
    check(H=128, nope=128, v=128, R=512, rope=64, gs=64, T=40000, n_sel=2048, cache=mx.bfloat16, seed=7)


@pytest.mark.parametrize("variant", ["mma", "simt"])
def test_both_variants_at_every_edge(variant):
    """Float32 queries pick simt on CUDA by default (TF32 is not float32-exact): both variants are
    forced here so each is checked on the GPU, at the edge cache lengths, DSA lists and batches."""
    for T in (1, 4095, 4097):
        check(T=T, seed=T, masked=T > 1, variant=variant)
    check(B=2, L=3, T=300, cache=mx.bfloat16, masked=True, seed=1, variant=variant)
    check(B=1, L=2, T=500, n_sel=64, seed=2, variant=variant)
    if GPU:
        check(H=128, nope=128, v=128, R=512, rope=64, gs=64, T=40000, cache=mx.bfloat16, seed=3, variant=variant)
        check(H=128, nope=128, v=128, R=512, rope=64, gs=64, T=40000, n_sel=2048, cache=mx.bfloat16, seed=7,
              variant=variant)


@pytest.mark.parametrize("cache", [mx.bfloat16, mx.float16])
def test_wide_variant_at_every_edge(cache):
    """mla_attn_wide (CUDA, 16-bit caches; elsewhere the reference): chunk edges (31 / 33
    positions), tile and 4096 edges, masks, DSA lists, batches, the joint cache."""
    for T in (1, 31, 33, 4095, 4097):
        check(variant="wide", T=T, seed=T, masked=T > 1, cache=cache)
    check(variant="wide", B=2, L=3, T=300, cache=cache, masked=True, seed=1)
    check(variant="wide", B=1, L=2, T=500, n_sel=64, seed=2, cache=cache)
    check(variant="wide", joint=True, T=500, n_sel=64, seed=22, cache=cache)
    if GPU:
        ds = dict(H=128, nope=128, v=128, R=512, rope=64, gs=64, cache=cache)
        for T in (4096, 40000):
            check(variant="wide", T=T, seed=T, **ds)
        check(variant="wide", T=40000, n_sel=2048, seed=7, **ds)
        check(variant="wide", joint=True, B=2, L=1, T=4097, masked=True, seed=21, **ds)


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_wide_declines_are_counted(backend):
    """Over a float32 cache mla_attn_mma runs instead of mla_attn_wide, counted; where wide runs,
    its tiles are whole chunks of the backend's and on CUDA it asks for its dynamic shared
    memory."""
    args32, _ = inputs(cache=mx.float32, R=64, rope=16)
    args16, _ = inputs(cache=mx.bfloat16, R=64, rope=16, T=300)
    kernels.reset_counters()
    run = mla.launch_specs(*args32, backend=backend, variant="wide")
    assert run.variant == "mma"
    (reason,) = kernels.counters()["fallbacks"]
    assert reason.startswith("mla_attn_wide: ") and "float32 cache" in reason and reason.endswith("-> mla_attn_mma")
    kernels.reset_counters()
    run = mla.launch_specs(*args16, backend=backend, variant="wide")
    assert run.variant == "wide" and not kernels.counters()["fallbacks"]
    attn = mla.planned_launches(run)[1]
    chunk = mla.WIDE_CHUNK[backend]
    assert attn.name == "mla_attn_wide" and ("CK", chunk) in attn.template
    TT = int(attn.inputs[5][7])
    assert TT % chunk == 0 and attn.output_shapes[0][2] == -(-300 // TT)
    if backend == "metal":
        assert attn.shared_memory == 0       # Metal kernels declare their threadgroup memory
        # DeepSeek-V3's rows: 16 and 32 heads a threadgroup fit Metal's 32 KiB, 64 do not
        assert mla.wide_threadgroup_bytes(16, 4, 576) == 16 * 584 * 2 + (4 * 16 * 16 + 16 * 16 + 128 + 256) * 4
        assert mla.wide_threadgroup_bytes(32, 8, 576) <= mla.METAL_THREADGROUP_BYTES < mla.wide_threadgroup_bytes(64, 16, 576)
        with pytest.raises(ValueError, match="threadgroup memory"):
            mla.launch_specs(*inputs(cache=mx.bfloat16, R=512, rope=64, H=64)[0], backend=backend, variant="wide",
                             heads=64)
        return
    assert ("HT", mla.WIDE_HEADS) in attn.template and attn.threadgroup[0] == mla.WIDE_HEADS * 8
    assert attn.shared_memory == mla.wide_shared_bytes(mla.WIDE_HEADS, mla.WIDE_HEADS // 4, 64 + 16)
    assert mla.wide_shared_bytes(32, 8, 512 + 64) == 2 * 32 * 584 * 2 + (4 * 32 * 40 + 32 * 40 + 32) * 4


@pytest.mark.parametrize("shape", ["small", pytest.param("deepseek", marks=gpu_only)])
@pytest.mark.parametrize("variant", ["mma", "simt", "wide"])
def test_fixed_capacity_buffer_with_step_params(shape, variant):
    """The compiled decode step's launch (mla.step_params): the whole buffer in, tiles following
    its rows, only ``length`` rows attended; the rows past it are NaN, so any read of them that
    reaches the arithmetic shows. On the CPU: the reference's length mask."""
    dims = dict(H=128, nope=128, v=128, R=512, rope=64, gs=64) if shape == "deepseek" else {}
    capacity = 4352 if shape == "deepseek" else 300
    args, _ = inputs(T=capacity, cache=mx.bfloat16, seed=11, **dims)
    q_nope, q_rope, latent, k_rope, kv_b, scale, _, nope, v = args
    for length in (1, capacity // 3, capacity):
        poison = (mx.arange(capacity) >= length)[None, :, None]
        latent_buf = mx.where(poison, mx.nan, latent).astype(latent.dtype)
        k_rope_buf = mx.where(poison, mx.nan, k_rope).astype(k_rope.dtype)
        params = mla.step_params(kv_b, latent_buf, q_nope.shape[1], nope, q_rope.shape[-1], v, q_nope.dtype, length,
                                 variant=variant)
        out = kernels.mla_decode(q_nope, q_rope, latent_buf, k_rope_buf, kv_b, scale, None, nope, v, params=params,
                                 variant=variant)
        # and over one joint buffer, as the model's decode step runs it
        joint = mx.concatenate([latent_buf, k_rope_buf], axis=-1)
        params = mla.step_params(kv_b, joint, q_nope.shape[1], nope, q_rope.shape[-1], v, q_nope.dtype, length,
                                 joint=True, variant=variant)
        out_joint = kernels.mla_decode(q_nope, q_rope, joint, None, kv_b, scale, None, nope, v, params=params,
                                       variant=variant)
        for o, how in ((out, "two buffers"), (out_joint, "joint buffer")):
            assert_attention_close(o, q_nope, q_rope, latent[:, :length], k_rope[:, :length], kv_b, scale, None, nope,
                                   v, variant=variant, label=f"{shape} {how} length {length} of {capacity}")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("position", [0, 7, 40000])
def test_mla_rows(dtype, position):
    """kernels.mla_rows (the CUDA twin on the H200, the reference here) at DeepSeek-V3's widths
    against the float64 oracle; MLX's CPU rope rounds its angles its own way (2 ulps)."""
    from moe_mla_oracle import assert_rows_close, rope_of, rows_case

    y, qa_norm, kv_norm = rows_case(1536, 512, 64, dtype, seed=position)
    rope = rope_of(64)
    kernels.reset_counters()
    got = kernels.mla_rows(y, 1536, qa_norm, kv_norm, 1e-6, rope, mx.array(position, dtype=mx.int32))
    c = kernels.counters()
    assert not c["fallbacks"] and c["calls"] == {f"mla_rows/{kernels.backend()}": 1}, c
    assert [a.dtype for a in got] == [dtype] * 2
    assert_rows_close(got, y, 1536, qa_norm, kv_norm, 1e-6, rope, [position], label=f"{dtype} @{position}",
                      angle_ulps=0 if GPU else 2)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("slot, capacity", [(0, 16), (4095, 4096), (40000, 40192)])
def test_mla_rows_into(dtype, slot, capacity):
    """kernels.mla_rows writing the row into the cache buffer (mla_rows_into: the CUDA twin on
    the H200) at DeepSeek-V3's widths: q_a and the row equal mla_rows' bit for bit, every other
    row keeps its bytes; the reference path returns the row instead."""
    from moe_mla_oracle import check_rows_into

    counters = check_rows_into((1536, 512, 64), dtype, slot, capacity, kernel_path=GPU)
    assert not counters["fallbacks"], counters


@pytest.mark.parametrize("position", [3, 40000])
def test_q_rope_rotated_in_qabs_equals_the_separate_rope(position):
    """mla_decode(rope=, rope_offset=) rotates q_rope in mla_qabs (ROPEQ 1): on the GPU the same
    angle, cos / sin and rounding as mx.fast.rope's kernel, so bit for bit the output of the
    separate rope (the CPU reference runs that rope itself)."""
    from moe_mla_oracle import rope_of

    kw = dict(H=128, nope=128, v=128, R=512, rope=64, gs=64, T=300, cache=mx.bfloat16) if GPU else {}
    args, _ = inputs(seed=position % 97, **kw)
    args = (args[0].astype(mx.bfloat16), args[1].astype(mx.bfloat16), *args[2:])
    q_nope, q_rope, *rest = args
    rope = rope_of(q_rope.shape[-1])
    # bit equality needs mx.fast.rope's angle: its 1 / frequency must give back each inverse
    # frequency (else it rotates up to one ulp off in the angle, ~2e-3 rad at 40000, and ROPEQ is the exact one)
    inv = np.asarray(rope.inv_freq)
    assert np.array_equal((1.0 / np.asarray(rope.fast_freqs).astype(np.float64)).astype(np.float32), inv)
    pos = mx.array(position, dtype=mx.int32)
    kernels.reset_counters()
    fused = kernels.mla_decode(q_nope, q_rope, *rest, rope=rope, rope_offset=pos)
    assert not kernels.counters()["fallbacks"]
    separate = kernels.mla_decode(q_nope, rope.apply_fast(q_rope, pos), *rest)
    assert np.array_equal(np.array(fused.astype(mx.float32)), np.array(separate.astype(mx.float32)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_q_proj_folded_equals_the_q_b_gemv_first(dtype):
    """mla_decode(q_proj=(q_latent, q_b)): the queries projected inside the first launch
    (mla_qb_qabs on a GPU; q_b's GEMV first on the CPU reference) against the float64 oracle
    on the reference projection's queries. float32: the same queries to REL; bf16: a query may
    round to the neighbouring bf16 value (the two sums differ in their last float32 bits), so
    half an ulp of bf16 more. DeepSeek-V3's shapes (q_lora 1536, 128 heads) on a GPU."""
    kw = dict(H=128, nope=128, v=128, R=512, rope=64, gs=64, T=4096, cache=mx.bfloat16) if GPU else {}
    args, _ = inputs(seed=11, **kw)
    _, q_rope, latent, k_rope, kv_b, scale, _, nope, v = args
    H, rope = args[0].shape[1], q_rope.shape[-1]
    q_lora = 1536 if GPU else 96
    q_b = random_qtensor(4, H * (nope + rope), q_lora, gs=64, seed=12).to_mlx()
    q_latent = mx.array(np.random.default_rng(13).standard_normal((1, 1, q_lora)).astype(np.float32)).astype(dtype)
    kernels.reset_counters()
    out = kernels.mla_decode(None, None, latent, k_rope, kv_b, scale, None, nope, v, q_proj=(q_latent, q_b))
    mx.eval(out)
    c = kernels.counters()
    assert not c["fallbacks"], c
    assert c["calls"].get(f"mla_qb_qabs/{kernels.backend()}", 0) == int(GPU), c
    with kernels.force_reference():
        q_nope, q_rope = mla.project_queries(q_latent, q_b, H, nope)
    variant = mla.choose_variant(latent.shape[-1], rope, backend=kernels.backend(), dtype=dtype,
                                 cache_dtype=latent.dtype)
    assert_mla_close(out, q_nope, q_rope, latent, k_rope, kv_b, scale, None, nope, v,
                     rel_attn=attention_budget(variant), extra_rel=0.0 if dtype == mx.float32 else 2.0**-8)


# Defects planted in mla_attn_wide's CUDA body, each of which the oracle must catch.
WIDE_DEFECTS = {
    "no rescale of the accumulator": ("acc[t16][ct][i] *= al[i];", "acc[t16][ct][i] *= 1.0f;"),
    "scores from the wrong position tile": ("colibri_mla::pair_tf32(kr[nt], kf, chunk);",
                                            "colibri_mla::pair_tf32(kr[nt ^ 1], kf, chunk);"),
    "the last chunk never staged": ("if (ci + 1 < nch) {", "if (ci + 2 < nch) {"),
    "a k-part's partial scores dropped": ("for (int g = 1; g < KP; ++g) {", "for (int g = 2; g < KP; ++g) {"),
}


def wide_body() -> str:
    return mla.read_kernel_sections("mla_decode", "cuda")[1]["mla_attn_wide"]


@pytest.mark.parametrize("defect", sorted(WIDE_DEFECTS))
def test_wide_defects_still_plant(defect):
    """Each planted defect's text occurs once in the CUDA body (else the GPU test below would
    plant nothing)."""
    good, _ = WIDE_DEFECTS[defect]
    assert wide_body().count(good) == 1, f"defect '{defect}' no longer plants"


@pytest.mark.skipif(kernels.backend() != "cuda", reason="the CUDA body (Metal's: tests/test_moe_mla_msl.py)")
@pytest.mark.parametrize("defect", sorted(WIDE_DEFECTS))
def test_wide_planted_defect_is_caught(monkeypatch, defect):
    """The planted kernel's output differs from the clean kernel's and is outside the TF32
    model's budget (mla_oracle_tf32), which the clean kernel's is inside. (REL_TF32's worst-case
    budget, a median 45x the output at these shapes, let all four through on the H200.)"""
    from moe_mla_oracle import _f64, mla_oracle_tf32

    good, bad = WIDE_DEFECTS[defect]
    real, planted = dispatch.launch, []

    def launch(backend, spec):
        if spec.name == "mla_attn_wide":
            # MLX caches a compiled kernel by its name and template (in the process and in its
            # on-disk cache), not its source: the marker names the planted kernel apart.
            marker = ("PLANTED", 1 + sorted(WIDE_DEFECTS).index(defect))
            source = spec.source.replace(good, bad)
            assert source != spec.source, f"defect '{defect}' planted nothing"
            spec = dataclasses.replace(spec, source=source, template=list(spec.template) + [marker])
            planted.append(spec.name)
        return real(backend, spec)

    args, sel = inputs(H=32, nope=128, v=128, R=512, rope=64, gs=64, T=300, cache=mx.bfloat16, masked=True, seed=5)
    want, bound = mla_oracle_tf32(*args, selected=sel)

    def error(out):  # of the oracle's budget
        return float((np.abs(_f64(out) - want) / bound).max())

    clean = kernels.mla_decode(*args, selected=sel, variant="wide")
    mx.eval(clean)
    assert error(clean) <= 1.0
    monkeypatch.setattr(dispatch, "launch", launch)
    got = kernels.mla_decode(*args, selected=sel, variant="wide")
    mx.eval(got)
    assert planted == ["mla_attn_wide"], planted
    assert not np.array_equal(np.array(got), np.array(clean)), "the clean kernel's output bit for bit: the planted source never ran"
    assert error(got) > 1.0, (defect, error(got), error(clean))


@pytest.mark.parametrize("variant, cache", [(None, mx.bfloat16), ("simt", mx.float32), ("mma", mx.bfloat16)])
@pytest.mark.parametrize("L", [2, 8])
def test_causal_rows_of_one_sequence(variant, cache, L):
    """A verify step's rows: causal from the params alone (no mask input), the output [1, L,
    H*v], against the oracle with the explicit mask; DeepSeek-V3's latent widths, a joint cache
    (the model's layout) over a fixed-capacity buffer of which the first P rows are attended."""
    capacity, P = 320, 301
    args, _ = inputs(H=16, L=L, T=capacity, nope=32, v=32, R=512, rope=64, cache=cache, seed=90 + L)
    q_nope, q_rope, latent, k_rope, kv_b, scale, _, nope, v = args
    joint = mx.concatenate([latent, k_rope], axis=-1)
    params = mla.step_params(kv_b, joint, 16, nope, 64, v, q_nope.dtype, P, joint=True, variant=variant,
                             rows=L, causal=True)
    kernels.reset_counters()
    out = kernels.mla_decode(q_nope, q_rope, joint, None, kv_b, scale, None, nope, v, variant=variant,
                             params=params, causal=True)
    mx.eval(out)
    assert out.shape == (1, L, 16 * v) and not kernels.counters()["fallbacks"], kernels.counters()
    mask = mx.array((np.arange(capacity)[None] <= (P - L + np.arange(L))[:, None])[None, None])
    got = out.reshape(1, L, 16, v).transpose(0, 2, 1, 3)
    ran = mla.choose_variant(512, 64, variant, backend=kernels.backend(), dtype=q_nope.dtype, cache_dtype=cache)
    assert_attention_close(got, *args[:6], mask, nope, v, variant=ran, label=f"L={L}")

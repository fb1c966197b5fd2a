"""kernels.moe_block on whatever backend this machine has (CPU: the grouped reference; CUDA on
the H200: the CUDA twins) against the float64 oracle, plus the model wired through it: greedy
tokens with kernels on equal the reference path's. The Metal sources are covered by
test_moe_mla_msl.py. Large DeepSeek-V3 shapes run only on a GPU backend.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx import kernels
from colibri_mlx.kernels import moe
from kernel_oracle import random_qtensor
from moe_mla_oracle import assert_moe_close

GPU = kernels.backend() != kernels.REFERENCE
gpu_only = pytest.mark.skipif(not GPU, reason="DeepSeek-V3 shapes: GPU backend only")


def make_experts(fmts, D, inter, gs=64, seed=0):
    out = []
    for e, f in enumerate(fmts):
        fgu, fd = f if isinstance(f, tuple) else (f, f)
        out.append(tuple(random_qtensor(fm, O, I, gs=gs, seed=seed + 3 * e + j).to_mlx()
                         for j, (fm, O, I) in enumerate(((fgu, inter, D), (fgu, inter, D), (fd, D, inter)))))
    return out


def run(experts, ids, dtype=mx.float32, seed=0):
    ids = np.asarray(ids, np.int32)
    D = experts[0][0].I
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((ids.shape[0], D)).astype(np.float32)).astype(dtype)
    w = mx.array(rng.uniform(0.1, 1.0, ids.shape).astype(np.float32))
    kernels.reset_counters()
    y = kernels.moe_block(x, experts, mx.array(ids), w)
    mx.eval(y)
    c = kernels.counters()
    assert not c["fallbacks"], c
    extra = {mx.float32: 0.0, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}[dtype]
    return assert_moe_close(y, x, experts, ids, w, f"moe {ids.shape}", extra_rel=extra)


@pytest.mark.parametrize("fmt", [1, 2, 3, 4, 5, 6])
def test_each_fmt(fmt):
    experts = make_experts([fmt] * 6, D=512, inter=96, gs=32, seed=fmt)
    run(experts, [[0, 3, 5], [3, 1, 2]], seed=fmt)


def test_mixed_fmts_ragged_repeated_dropped():
    experts = make_experts([4, 6, 2, 6, 5, (4, 5), 1, 3], D=768, inter=128, gs=64, seed=1)
    run(experts, [[1, 3, 0, -1], [3, 7, 4, 2], [5, 1, 6, 6], [3, -1, -1, -1]], seed=1)


def test_one_expert_for_every_token_bf16():
    experts = make_experts([4] * 4, D=256, inter=64, seed=2)
    run(experts, [[2, 0]] * 8, dtype=mx.bfloat16, seed=2)


@pytest.mark.parametrize("cap", [30_000, 12_000])
def test_bank_of_uint32_words(monkeypatch, cap):
    """Stacked buffers past moe.MAX_BANK_BYTES hold uint32 words (one group, the kernels read
    bytes through the same pointer); far past it, several groups of words."""
    experts = make_experts([4] * 5, D=256, inter=64, gs=32, seed=6)
    monkeypatch.setattr(moe, "MAX_BANK_BYTES", cap)
    moe.clear_banks()
    groups = moe.build_bank(experts).groups
    assert len(groups) == (1 if cap == 30_000 else 3)     # 5 or 2 experts of 20 KB (with scales) a group
    assert {g.gate_up.packed.dtype for g in groups} == {mx.uint32}
    run(experts, [[0, 4, 2], [3, 1, 2]], dtype=mx.bfloat16, seed=6)
    moe.clear_banks()


@gpu_only
@pytest.mark.parametrize("S", [1, 4, 8])
def test_deepseek_shape_fmt4(S):
    experts = make_experts([4] * 10, D=7168, inter=2048, gs=64, seed=3)
    rng = np.random.default_rng(S)
    run(experts, np.stack([rng.choice(10, 8, replace=False) for _ in range(S)]), dtype=mx.bfloat16, seed=S)


@gpu_only
@pytest.mark.parametrize("fmts", [[4] * 10, [2, 4, 5, 1, 3, 4, 2, 4, 4, 2]])
def test_deepseek_shape_down_with_the_shape_from_params(monkeypatch, fmts):
    """moe_down reading its projection's shape from params (CUDA, shape_in=False; the default
    compiles it in): a layer of one format (one group) and of several (a launch per group, each
    its own shape)."""
    down_spec = moe.down_spec
    monkeypatch.setattr(moe, "down_spec", lambda *args, **kw: down_spec(*args, **{**kw, "shape_in": False}))
    experts = make_experts(fmts, D=7168, inter=2048, gs=64, seed=5)
    run(experts, [[0, 3, 5, 7, 1, 9, 2, 8]], dtype=mx.bfloat16, seed=5)


@gpu_only
def test_deepseek_shape_rows_are_each_token_alone():
    """8 tokens of a batch (one of them repeated) as one grid of one-token launches:
    within the float64 bound, and each token's row bit for bit its own one-token launch."""
    experts = make_experts([4] * 24, D=7168, inter=2048, gs=64, seed=7)
    rng = np.random.default_rng(7)
    ids = np.stack([rng.choice(24, 8, replace=False) for _ in range(8)]).astype(np.int32)
    ids[5] = ids[2]
    run(experts, ids, dtype=mx.bfloat16, seed=7)
    x = mx.array(rng.standard_normal((8, 7168)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array(rng.uniform(0.1, 1.0, ids.shape).astype(np.float32))
    grid = kernels.moe_block(x, experts, mx.array(ids), w)
    for n in range(8):
        one = kernels.moe_block(x[n:n + 1], experts, mx.array(ids[n:n + 1]), w[n:n + 1])
        assert np.array_equal(np.array(grid[n].astype(mx.float32)), np.array(one[0].astype(mx.float32))), n


@gpu_only
def test_deepseek_shape_mixed_fmt6_and_fmt4():
    experts = make_experts([6, 4, 6, 5, 4, 6, 2, 4, 6], D=7168, inter=2048, gs=64, seed=4)
    run(experts, [[0, 1, 2, 3, 4, 5, 6, 8], [8, 2, 1, 0, 7, 6, 5, 4]], dtype=mx.bfloat16, seed=4)


# ------------------------------------------------------------------------- the model


@pytest.mark.slow
def test_greedy_tokens_kernels_equal_reference(tmp_path):
    """64 greedy tokens from a tiny quantized container (fmt 1-6 incl. fmt 6 experts), kernels
    on vs COLIBRI_KERNELS=reference in one process (on CPU both are the reference)."""
    from helpers_models import build_hf_model, state_dict_numpy, write_container, save_checkpoint
    from colibri_mlx.generate import generate_tokens
    from colibri_mlx.models.loading import load_model

    hf = build_hf_model("deepseek_v3", seed=0, hidden_size=256, moe_intermediate_size=256)  # fmt 6 experts need I % 256 == 0
    path = save_checkpoint(hf, str(tmp_path / "hf"))
    write_container(state_dict_numpy(hf), path, str(tmp_path / "c"))
    model = load_model(tmp_path / "c", dtype="float32")
    prompt = [3, 17, 5, 9, 11]
    kernels.reset_counters()
    got = [t for t, _ in generate_tokens(model, prompt, 64)]
    calls = kernels.counters()["calls"]
    with kernels.force_reference():
        want = [t for t, _ in generate_tokens(model, prompt, 64)]
    assert got == want
    if GPU:
        assert calls.get(f"moe_block/{kernels.backend()}", 0) > 0 and calls.get(f"mla_decode/{kernels.backend()}", 0) > 0, calls

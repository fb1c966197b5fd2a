"""The shared expert as an always-selected slot of moe_block (models/deepseek_v3.MoE).

When the shared expert has the routed experts' shape and format it is appended to the layer's
expert bank as expert E and every token gets one more slot (E, 1.0): routed + shared are the
same two launches. These tests compare that path with the separate-MLP path (the computation
transformers does) on the reference backend and with the Metal kernels in the MSL simulator,
and check that other shapes/formats and streamed layers keep the MLP, visibly counted.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx import kernels
from colibri_mlx.kernels import dispatch, moe
from colibri_mlx.models.deepseek_v3 import MoE, ModelArgs
from colibri_mlx.models.loading import table_from_dict
from kernel_oracle import random_qtensor
from moe_mla_oracle import assert_moe_close, route_launches_to_simulator, simulator_or_skip

D, INTER, E, K = 64, 32, 16, 4


def make_args(**over):
    cfg = dict(model_type="deepseek_v3", vocab_size=32, hidden_size=D, intermediate_size=64,
               moe_intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=2,
               n_routed_experts=E, num_experts_per_tok=K, kv_lora_rank=16, qk_rope_head_dim=8,
               qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1, routed_scaling_factor=2.5,
               n_group=4, topk_group=2, norm_topk_prob=True)
    cfg.update(over)
    return ModelArgs.from_config(cfg)


def make_moe(args, fmt=4, shared_fmt=None, seed=0):
    rng = np.random.default_rng(seed)
    w = {"mlp.gate.weight": mx.array(rng.standard_normal((E, D)).astype(np.float32) * 0.3),
         "mlp.gate.e_score_correction_bias": mx.array(rng.uniform(-0.1, 0.1, E).astype(np.float32))}
    shapes = (("gate", (INTER, D)), ("up", (INTER, D)), ("down", (D, INTER)))
    for e in range(E):
        for i, (p, (O, I)) in enumerate(shapes):
            w[f"mlp.experts.{e}.{p}_proj.weight"] = random_qtensor(fmt, O, I, gs=32, seed=seed + 10 * e + i)
    si = INTER * args.n_shared_experts
    for i, (p, (O, I)) in enumerate((("gate", (si, D)), ("up", (si, D)), ("down", (D, si)))):
        w[f"mlp.shared_experts.{p}_proj.weight"] = random_qtensor(shared_fmt or fmt, O, I, gs=32, seed=seed + 999 + i)
    return MoE(args, table_from_dict(w), "mlp.")


def as_mlp_path(layer):
    """The same layer with the shared expert as a separate MLP (the pre-slot computation)."""
    layer.bank, layer.shared_slot = layer.experts, None
    return layer


def x_of(S, dtype=mx.float32, seed=3):
    return mx.array(np.random.default_rng(seed).standard_normal((1, S, D)).astype(np.float32)).astype(dtype)


def close(a, b, rel):
    a, b = np.asarray(a.astype(mx.float32)), np.asarray(b.astype(mx.float32))
    scale = np.abs(b).max()
    assert np.isfinite(a).all() and np.abs(a - b).max() <= rel * scale, (np.abs(a - b).max(), scale)


def test_shared_slot_chosen_for_deepseek_shape():
    layer = make_moe(make_args())
    assert layer.shared_slot == E and len(layer.bank) == E + 1 and layer.shared_mlp_reason is None
    assert layer.bank[E] == (layer.shared.gate, layer.shared.up, layer.shared.down)
    ids, w = layer.router(x_of(2), layer.shared_slot)
    assert ids.shape == (1, 2, K + 1) and (np.asarray(ids)[..., K] == E).all()
    assert (np.asarray(w)[..., K] == 1.0).all()


@pytest.mark.parametrize("forced", [True, False], ids=["reference", "native"])
@pytest.mark.parametrize("S", [1, 3, 9])
def test_shared_slot_equals_mlp_path(S, forced):
    # The reference path, and the machine's own backend (CUDA kernels on the GPU machine; the
    # reference again on a CPU one); S = 9 is the grouped prefill path. Only float32 rounding
    # differs (routed + shared summed in float32 once instead of twice; on the GPU the shared
    # expert's dot products run in moe_block's kernels instead of qgemv's).
    x = x_of(S)
    layer = make_moe(make_args())
    with dispatch.force_reference(forced or dispatch.reference_forced()):
        y_slot = layer(x)
        dispatch.reset_counters()
        y_mlp = as_mlp_path(layer)(x)
    assert dispatch.counters()["calls"].get("moe_shared/mlp") == 1
    close(y_slot, y_mlp, 1e-5 if forced else 1e-4)


@pytest.mark.parametrize("over, shared_fmt, why", [
    (dict(n_shared_experts=2), None, "n_shared_experts > 1"),
    ({}, 2, "(fmt, gs)"),
])
def test_other_shape_or_fmt_keeps_mlp(over, shared_fmt, why):
    layer = make_moe(make_args(**over), shared_fmt=shared_fmt)
    assert layer.shared_slot is None and layer.bank is layer.experts and why in layer.shared_mlp_reason
    dispatch.reset_counters()
    layer(x_of(1))
    assert dispatch.counters()["calls"].get("moe_shared/mlp") == 1


def test_streamed_layer_keeps_mlp():
    class View(list):
        def prepare(self, ids):
            pass

    assert "streamed" in moe.shared_slot_reason(View([(1, 2, 3)]), (1, 2, 3))


# ---------------------------------------------------------------------------------------
# Metal kernels in the MSL simulator


@pytest.fixture
def metal(monkeypatch):
    yield route_launches_to_simulator(monkeypatch, simulator_or_skip())
    moe.clear_banks()


@pytest.mark.parametrize("S", [1, 8])
def test_shared_slot_in_simulator(metal, S):
    # S = 8, K = 4 + 1: every routed expert and the shared one; S * (K + 1) slots.
    layer = make_moe(make_args())
    x = x_of(S)
    ids, w = layer.router(x, layer.shared_slot)
    mx.eval(ids, w)
    metal.clear()
    y = layer(x)
    # Router (2 launches) + routed and shared experts (2 launches), no qgemv for the shared MLP.
    assert metal == ["router_scores", "router_topk", "moe_gate_up", "moe_down"], metal
    assert not kernels.counters()["fallbacks"]
    # The kernel output against the float64 oracle over routed + shared slots.
    assert_moe_close(y[0], x[0], layer.bank, np.asarray(ids)[0], w[0], f"shared slot S={S}")
    with dispatch.force_reference():
        y_ref_mlp = as_mlp_path(layer)(x)
    close(y, y_ref_mlp, 1e-4)


def test_deepseek_slot_count_fits_the_kernel():
    # 8 tokens x (8 routed + 1 shared) slots must not fall back to the reference.
    x = mx.zeros((8, 16))
    assert moe.decline_reason(x, 9) is None


# ---------------------------------------------------------------------------------------
# Cached launch parts (resident layers)


def test_resident_launch_parts_are_cached_per_shape(monkeypatch):
    specs = []

    def launch(backend, spec):
        specs.append(spec)
        return [mx.zeros(s, d) for s, d in zip(spec.output_shapes, spec.output_dtypes)]

    monkeypatch.setattr(dispatch, "launch", launch)
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: dispatch.CUDA)
    layer = make_moe(make_args())
    for S in (1, 1, 3):
        layer(x_of(S))
    by_call = [specs[i:i + 4] for i in range(0, 12, 4)]
    assert [s.name for s in by_call[0]] == ["router_scores", "router_topk", "moe_gate_up", "moe_down"]
    for a, b in zip(*by_call[:2]):          # same S: the same header/params/template objects
        params = a.input_names.index("params")
        assert a.header is b.header and a.template is b.template and a.inputs[params] is b.inputs[params]
    for a, c in zip(by_call[0], by_call[2]):  # another S: its own launch geometry
        assert a.header is c.header and a.template is not c.template
    # the experts' launches of 3 tokens: one-token launches over grid.y = the tokens' slots
    # (gate_up) or the tokens (down), each token's K + 1 slots (the shared expert's included)
    gu1, gu3, d3 = by_call[0][2], by_call[2][2], by_call[2][3]
    assert gu1.grid[1] == 1 * (K + 1) and gu3.grid[1] == 3 * (K + 1) and d3.grid[1] == 3
    assert np.asarray(gu3.inputs[gu3.input_names.index("params")]).tolist()[5:7] == [K + 1, K + 1]


def test_one_layer_several_token_counts_in_simulator(metal):
    # The cached launch parts of one resident layer serve S = 1, 3, 1 correctly.
    layer = make_moe(make_args(), seed=5)
    for S in (1, 3, 1):
        x = x_of(S, seed=S)
        y = layer(x)
        ids, w = (np.asarray(a) for a in kernels.router.router_reference(
            x[0], layer.router.weight, layer.router.bias, layer.router.config, layer.shared_slot))
        assert_moe_close(y[0], x[0], layer.bank, ids, mx.array(w), f"S={S}")

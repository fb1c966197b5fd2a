"""moe_gate_up_routed: the router's selection made inside moe_gate_up (kernels.moe.routed_block).

Metal in the MSL simulator (every launch as on a Mac; outputs poisoned, both schedules), the
CUDA twin on a GPU. The selection must be router_topk's bit for bit (ids in selection order and
weights: the same float operations), h the plain moe_gate_up's for those ids, and the block's
output the two-launch path's exactly and the float64 oracle's within moe_mla_oracle's bound.
The inputs are ties-free by more than the score error (test_router.inputs), so the oracle's
expert sets are exact; a tie case checks the lower-index rule; planted defects must fail.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx.kernels import dispatch, moe, router
from colibri_mlx.kernels.router import RouterConfig, Routing
from kernel_oracle import random_qtensor
from moe_mla_oracle import assert_moe_close, route_launches_to_simulator, simulate, simulator_or_skip
from test_router import check, inputs

CASES = {  # name: (E, D, inter, cfg)
    "groups": (64, 64, 32, RouterConfig(6, 8, 3, True, 2.5)),
    "deepseek_groups": (256, 64, 16, RouterConfig(8, 8, 4, True, 2.5)),
    "flat_unnormalized": (20, 96, 24, RouterConfig(3, 1, 1, False, 1.5)),
}


def bank(E, D, inter, fmt=4, shared=True, seed=0):
    """E routed experts (+ the shared one as expert E) of one fmt."""
    return [(random_qtensor(fmt, inter, D, gs=32, seed=seed + 3 * e),
             random_qtensor(fmt, inter, D, gs=32, seed=seed + 3 * e + 1),
             random_qtensor(fmt, D, inter, gs=32, seed=seed + 3 * e + 2)) for e in range(E + shared)]


def run_case(case, S, shared=True, dtype=mx.float32, fmt=4, seed=3, launched=None):
    """Fused and two-launch paths on one input; returns what the checks need."""
    E, D, inter, cfg = CASES[case]
    x, w, bias = inputs(E, D, S, dtype=dtype, seed=seed, cfg=cfg)
    experts = bank(E, D, inter, fmt, shared)
    shared_id = E if shared else None
    rt = Routing(x, w, bias, cfg, shared_id)
    impl = dispatch.backend()
    # moe_gate_up_routed's own outputs against router_topk's launches and the plain moe_gate_up
    group = moe.resident_bank(experts).groups[0]
    h, ids, weights = dispatch.launch(impl, moe.gate_up_spec(x, group, None, rt.slots, impl,
                                                             route=rt.kernel_inputs(impl)))
    ids_k, weights_k = rt.select()
    h_k = dispatch.launch(impl, moe.gate_up_spec(x, group, ids_k, rt.slots, impl))[0]
    mx.eval(h, ids, weights, ids_k, weights_k, h_k)
    if launched is not None:
        launched.clear()
    dispatch.reset_counters()
    y = moe.routed_block(x, experts, rt)
    c = dispatch.counters()
    fused = list(launched or ())
    y_two = moe.moe_block(x, experts, ids_k, weights_k)
    if launched is not None:
        launched[:] = fused
    return dict(x=x, w=w, bias=bias, cfg=cfg, E=E, experts=experts, shared_id=shared_id, h=h, ids=ids,
                weights=weights, ids_k=ids_k, weights_k=weights_k, h_k=h_k, y=y, y_two=y_two, counters=c)


def assert_routed(r, label):
    # The selection: router_topk's, bit for bit, and the oracle's sets and weights.
    assert np.array_equal(np.asarray(r["ids"]), np.asarray(r["ids_k"])), (label, r["ids"], r["ids_k"])
    assert np.array_equal(np.asarray(r["weights"]).view(np.uint32), np.asarray(r["weights_k"]).view(np.uint32)), label
    check(r["ids"], r["weights"], r["x"], r["w"], r["bias"], r["cfg"], r["shared_id"], label)
    # h: the plain launch's for those ids; the block: the two-launch path's, and the oracle's.
    assert np.array_equal(np.asarray(r["h"]), np.asarray(r["h_k"])), label
    assert np.array_equal(np.asarray(r["y"].astype(mx.float32)), np.asarray(r["y_two"].astype(mx.float32))), label
    extra = {mx.float32: 0.0, mx.bfloat16: 2.0**-8}[r["x"].dtype]
    assert_moe_close(r["y"], r["x"], r["experts"], r["ids"], r["weights"], label, extra_rel=extra)


@pytest.fixture(autouse=True)
def routed_on(monkeypatch):
    monkeypatch.setenv("COLIBRI_MOE_ROUTE", "1")       # opt-in (kernels/moe.py, _routed_reason)


@pytest.fixture
def metal(monkeypatch):
    yield route_launches_to_simulator(monkeypatch, simulator_or_skip())
    moe.clear_banks()


@pytest.mark.parametrize("case, S, shared", [("groups", 1, True), ("groups", 3, False),
                                             ("deepseek_groups", 1, True), ("deepseek_groups", 2, True),
                                             ("flat_unnormalized", 5, True)])
def test_routed_selection_is_router_topk(metal, case, S, shared):
    r = run_case(case, S, shared, launched=metal)
    assert metal == ["router_scores", "moe_gate_up_routed", "moe_down"], metal
    assert r["counters"]["calls"] == {"router/metal-in-gate-up": 1, "moe_block/metal": 1}, r["counters"]
    assert not r["counters"]["fallbacks"]
    assert_routed(r, f"{case} S={S}")


def test_routed_rotated_experts(metal):
    # fmt 6 experts: x is rotated for moe_gate_up_routed, the scores read it unrotated.
    r = run_case("groups", 2, fmt=6, launched=metal)
    assert metal == ["router_scores", "moe_hadamard", "moe_gate_up_routed", "moe_hadamard", "moe_down"], metal
    assert_routed(r, "fmt 6")


def test_routed_tie_rule_lower_index_wins(metal):
    # Equal scores (zero weight rows): router_topk's rule, the lower expert and group ids.
    E, D = 16, 32
    cfg = RouterConfig(4, 4, 2, False, 1.0)
    rt = Routing(mx.ones((1, D)), mx.zeros((E, D)), mx.zeros((E,)), cfg, None)
    group = moe.resident_bank(bank(E, D, 16, shared=False)).groups[0]
    _, ids, weights = dispatch.launch(dispatch.METAL, moe.gate_up_spec(mx.ones((1, D)), group, None, 4, dispatch.METAL,
                                                                       route=rt.kernel_inputs(dispatch.METAL)))
    assert np.asarray(ids)[0].tolist() == [0, 1, 2, 3]
    assert np.allclose(np.asarray(weights), 0.5)


def test_routed_is_opt_in(metal, monkeypatch):
    monkeypatch.delenv("COLIBRI_MOE_ROUTE")
    r = run_case("flat_unnormalized", 1, launched=metal)
    assert metal == ["router_scores", "router_topk", "moe_gate_up", "moe_down"], metal
    assert not r["counters"]["fallbacks"]
    assert np.array_equal(np.asarray(r["y"]), np.asarray(r["y_two"]))


def test_routed_declines_are_counted(metal):
    # Experts of two formats: one moe_gate_up_routed cannot select for two groups.
    E, D, inter, cfg = CASES["flat_unnormalized"]
    x, w, bias = inputs(E, D, 2, cfg=cfg)
    experts = bank(E, D, inter, shared=False)
    experts[1] = tuple(random_qtensor(2, *moe._shape(p), gs=32, seed=90 + i) for i, p in enumerate(experts[1]))
    y = moe.routed_block(x, experts, Routing(x, w, bias, cfg))
    mx.eval(y)
    c = dispatch.counters()
    assert any(k.startswith("moe_route: experts of several formats") for k in c["fallbacks"]), c
    assert "router_topk" in metal and "moe_gate_up_routed" not in metal


# Each defect must fail the checks (selection, h or y).
ROUTED_DEFECTS = {
    "taken expert not marked": ("        c[i] = ROUTER_TAKEN;\n", "        c[i] = c[i];\n"),
    "group limit dropped": ("          c[j] = ROUTER_NONE;\n        }\n      }\n      simdgroup_barrier",
                            "          c[j] = c[j];\n        }\n      }\n      simdgroup_barrier"),
    "weights not normalized": ("    wt = wt / (sum + 1e-20f);\n  }\n  return wt * scale;",
                               "    wt = wt / (sum + 1.0f);\n  }\n  return wt * scale;"),
    "slot of the wrong token": ("      sl[s * KO + lane] =", "      sl[lane] ="),
}


@pytest.mark.parametrize("defect", sorted(ROUTED_DEFECTS))
def test_routed_planted_defect_is_caught(metal, monkeypatch, defect):
    simulator = simulator_or_skip()
    good, bad = ROUTED_DEFECTS[defect]

    def planted(spec, sim):
        if spec.name == "moe_gate_up_routed":
            assert spec.header.count(good) == 1, f"defect '{defect}' no longer plants"
            spec.header = spec.header.replace(good, bad)
        return simulate(spec, sim)

    monkeypatch.setattr(dispatch, "launch", lambda b, spec: planted(spec, simulator))
    with pytest.raises((AssertionError, simulator.SimulatorError)) as caught:
        assert_routed(run_case("groups", 2), defect)
    assert "failed to compile" not in str(caught.value)


# ---------------------------------------------------------------------------------------
# The machine's own GPU backend (the CUDA twin on the H200); skipped on CPU-only machines


GPU = dispatch.gpu_backend() is not None


@pytest.mark.skipif(not GPU, reason="moe_gate_up_routed: GPU backend only")
@pytest.mark.parametrize("case, S, shared, dtype", [("groups", 1, True, mx.bfloat16), ("groups", 3, False, mx.float32),
                                                    ("deepseek_groups", 1, True, mx.bfloat16),
                                                    ("deepseek_groups", 8, True, mx.bfloat16),
                                                    ("flat_unnormalized", 5, True, mx.float32)])
def test_gpu_routed_selection_is_router_topk(case, S, shared, dtype):
    moe.clear_banks()
    r = run_case(case, S, shared, dtype)
    gpu = dispatch.gpu_backend()
    assert r["counters"]["calls"] == {f"router/{gpu}-in-gate-up": 1, f"moe_block/{gpu}": 1}, r["counters"]
    assert_routed(r, f"gpu {case} S={S}")

"""router_topk (kernels/router.py, metal_kernels/router.metal) against a float64 numpy oracle.

The Metal launches run in the MSL simulator (outputs poisoned, every element must be written,
forward and reverse schedules must agree); the pure-MLX reference runs on the CPU. Inputs are
ties-free: the oracle's margin between the last selected and the first rejected choice (and
between the last kept and first dropped group) is checked to exceed the score error budget, so
an exact set comparison of the selected ids is justified.

Tolerance: a score is sigmoid(z) with z a float32 dot product of D terms; |dz| <= 1e-4 *
sum|x_i w_i| (kernel_oracle.py) and |sigmoid'| <= 1/4, plus 1e-6 for exp's rounding. A
weight s_k / sum(s) moves by at most (ds_k + w_k * sum ds) / sum(s), times the scale.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx.kernels import dispatch, router
from colibri_mlx.kernels.router import RouterConfig
from moe_mla_oracle import route_launches_to_simulator, simulator_or_skip

REL = 1e-4

CASES = {  # name: (E, D, cfg)
    "deepseek": (256, 512, RouterConfig(8, 8, 4, True, 2.5)),
    "kimi": (384, 256, RouterConfig(8, 1, 1, True, 2.827)),
    "small_groups": (16, 96, RouterConfig(4, 4, 2, True, 1.0)),
    "small_flat_unnormalized": (20, 70, RouterConfig(3, 1, 1, False, 1.5)),
    # < 8 scores a row: MLX binds one row's scores in the constant address space
    "few_experts": (4, 40, RouterConfig(2, 2, 1, True, 2.5)),
}


def oracle(x, w, bias, cfg, shared_id=None):
    """(ids sets per token, {id: weight} per token, weight bound per token, selection margin)."""
    x64, w64, b64 = (np.asarray(a.astype(mx.float32)).astype(np.float64) for a in (x, w, bias))
    z = x64 @ w64.T
    s = 1 / (1 + np.exp(-z))
    ds = 0.25 * REL * (np.abs(x64) @ np.abs(w64).T) + 1e-6
    choice = s + b64
    S, E = s.shape
    margins = []
    ids, weights, bounds = [], [], []
    for t in range(S):
        c = choice[t].copy()
        if cfg.n_group > 1:
            g = np.sort(c.reshape(cfg.n_group, -1), axis=-1)[:, -2:].sum(-1)
            order = np.argsort(-g, kind="stable")
            # A group score sums two scores: each errs by <= ds, hence the halved margin.
            margins.append((g[order[cfg.topk_group - 1]] - g[order[cfg.topk_group]]) / 2)
            drop = np.repeat(~np.isin(np.arange(cfg.n_group), order[:cfg.topk_group]), E // cfg.n_group)
            c[drop] = -np.inf
        order = np.argsort(-c, kind="stable")
        margins.append(c[order[cfg.top_k - 1]] - c[order[cfg.top_k]])
        sel = order[:cfg.top_k]
        sw, dsw = s[t, sel], ds[t, sel]
        if cfg.norm_topk_prob:
            wt = sw / (sw.sum() + 1e-20)
            bnd = (dsw + wt * dsw.sum()) / sw.sum()
        else:
            wt, bnd = sw, dsw
        wt, bnd = wt * cfg.routed_scaling_factor, bnd * cfg.routed_scaling_factor + 1e-6
        pairs = dict(zip(sel.tolist(), wt))
        bmap = dict(zip(sel.tolist(), bnd))
        if shared_id is not None:
            pairs[shared_id], bmap[shared_id] = 1.0, 0.0
        ids.append(set(pairs))
        weights.append(pairs)
        bounds.append(bmap)
    return ids, weights, bounds, min(margins), ds.max()


def inputs(E, D, S, dtype=mx.float32, seed=0, bias_scale=0.05, cfg=None):
    """Random router inputs; with ``cfg`` the first seed (from ``seed`` on) whose selection is
    ties-free by more than the error budget (so the id sets must match exactly)."""
    for attempt in range(100):
        rng = np.random.default_rng(seed + 1000 * attempt)
        x = mx.array(rng.standard_normal((S, D)).astype(np.float32)).astype(dtype)
        w = mx.array((rng.standard_normal((E, D)) / np.sqrt(D)).astype(np.float32))
        bias = mx.array(rng.uniform(-bias_scale, bias_scale, E).astype(np.float32))
        if cfg is None:
            return x, w, bias
        *_, margin, ds = oracle(x, w, bias, cfg)
        if margin > 2 * ds:
            return x, w, bias
    raise AssertionError("no ties-free inputs found")


def check(ids, weights, x, w, bias, cfg, shared_id=None, label=""):
    want_ids, want_w, bounds, margin, ds = oracle(x, w, bias, cfg, shared_id)
    assert margin > 2 * ds, f"{label}: inputs too close to a tie (margin {margin:.3g}) for an exact check"
    ids, weights = np.asarray(ids), np.asarray(weights)
    KO = cfg.top_k + (shared_id is not None)
    assert ids.shape == weights.shape == (len(want_ids), KO), (ids.shape, weights.shape)
    for t in range(len(want_ids)):
        assert set(ids[t].tolist()) == want_ids[t], f"{label} token {t}: {sorted(ids[t])} != {sorted(want_ids[t])}"
        for e, wt in zip(ids[t].tolist(), weights[t]):
            assert abs(wt - want_w[t][e]) <= bounds[t][e], (label, t, e, wt, want_w[t][e], bounds[t][e])
    if shared_id is not None:
        assert (ids[:, -1] == shared_id).all() and (weights[:, -1] == 1.0).all()


@pytest.fixture
def metal(monkeypatch):
    return route_launches_to_simulator(monkeypatch, simulator_or_skip())


# ---------------------------------------------------------------------------------------
# Reference (CPU)


@pytest.mark.parametrize("path", ["reference", "gpu"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("S", [1, 5, 12])
def test_router_matches_oracle(case, S, path):
    """The reference everywhere; on a GPU machine also the backend's kernels (the CUDA twin on
    the H200), against the same float64 oracle."""
    if path == "gpu" and dispatch.gpu_backend() is None:
        pytest.skip("no GPU backend")
    E, D, cfg = CASES[case]
    x, w, bias = inputs(E, D, S, seed=S, cfg=cfg)
    with dispatch.force_reference(path == "reference"):
        assert dispatch.backend() == (dispatch.REFERENCE if path == "reference" else dispatch.gpu_backend())
        ids, weights = router.router_topk(x, w, bias, cfg, shared_id=E)
    check(ids, weights, x, w, bias, cfg, shared_id=E, label=f"{path} {case} S={S}")


# ---------------------------------------------------------------------------------------
# Metal kernels in the simulator


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("S, dtype, shared", [(1, mx.bfloat16, True), (3, mx.float32, False),
                                              (8, mx.float16, True)])
def test_kernel_matches_oracle(metal, case, S, dtype, shared):
    E, D, cfg = CASES[case]
    x, w, bias = inputs(E, D, S, dtype=dtype, seed=10 + S, cfg=cfg)
    shared_id = E if shared else None
    ids, weights = router.router_topk(x, w, bias, cfg, shared_id)
    assert metal == ["router_scores", "router_topk"]
    assert ids.dtype == mx.int32 and weights.dtype == mx.float32
    check(ids, weights, x, w, bias, cfg, shared_id, label=f"metal {case} S={S}")
    # Reference and kernel agree on the selection (as sets) and on the weights.
    with dispatch.force_reference():
        rid, rw = router.router_topk(x, w, bias, cfg, shared_id)
    check(rid, rw, x, w, bias, cfg, shared_id, label=f"reference {case} S={S}")
    c = dispatch.counters()
    assert c["calls"] == {"router/metal": 1, "router/reference": 1} and not c["fallbacks"], c
    assert len(metal) == 2


def test_env_forces_reference(metal, monkeypatch):
    E, D, cfg = CASES["small_groups"]
    x, w, bias = inputs(E, D, 2, cfg=cfg)
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    ids, weights = router.router_topk(x, w, bias, cfg, shared_id=E)
    assert metal == [] and dispatch.counters()["calls"] == {"router/reference": 1}
    check(ids, weights, x, w, bias, cfg, E, "COLIBRI_KERNELS=reference")


def test_kernel_model_shape_leading_dims(metal):
    # [B, L, D] input as the model passes it; DeepSeek-V3's D = 7168 (float4 path, 7 units/thread).
    E, cfg = 256, RouterConfig(8, 8, 4, True, 2.5)
    x, w, bias = inputs(E, 7168, 2, dtype=mx.bfloat16, seed=4, cfg=cfg)
    ids, weights = router.router_topk(x[None], w, bias, cfg, shared_id=E)
    assert ids.shape == (1, 2, 9)
    check(ids[0], weights[0], x, w, bias, cfg, E, "deepseek D=7168")


def test_scores_kernel_odd_D(metal):
    # D % 4 != 0: the scalar tail path only (V4 = 0); scores checked directly.
    E, D, S = 10, 37, 3
    x, w, _ = inputs(E, D, S, seed=2)
    spec = router.scores_spec(x, w)
    assert dict(spec.template)["V4"] == 0
    (scores,) = dispatch.launch(dispatch.METAL, spec)
    x64, w64 = np.asarray(x).astype(np.float64), np.asarray(w).astype(np.float64)
    want = 1 / (1 + np.exp(-(x64 @ w64.T)))
    bound = 0.25 * REL * (np.abs(x64) @ np.abs(w64).T) + 1e-6
    assert (np.abs(np.asarray(scores) - want) <= bound).all()


def test_bias_and_groups_change_the_selection(metal):
    # The inputs make the bias and the group limit matter: dropping either changes the
    # oracle's selection, so the kernel's match above is not vacuous.
    E, D, S = 256, 128, 4
    cfg = RouterConfig(8, 8, 4, True, 2.5)
    x, w, bias = inputs(E, D, S, seed=7, bias_scale=0.3, cfg=cfg)
    ids, weights = router.router_topk(x, w, bias, cfg)
    check(ids, weights, x, w, bias, cfg, label="strong bias")
    no_bias, _, _, _, _ = oracle(x, w, mx.zeros_like(bias), cfg)
    no_groups, _, _, _, _ = oracle(x, w, bias, RouterConfig(8, 1, 1, True, 2.5))
    got = [set(r) for r in np.asarray(ids).tolist()]
    assert got != no_bias and got != no_groups


def test_tie_rule_lower_index_wins(metal):
    # Exactly equal scores (zero weight rows): the documented rule picks the lower expert ids
    # and, among equal groups, the lower group.
    E, D = 16, 8
    cfg = RouterConfig(4, 4, 2, False, 1.0)
    x = mx.ones((1, D))
    w = mx.zeros((E, D))
    bias = mx.zeros((E,))
    ids, weights = router.router_topk(x, w, bias, cfg)
    assert sorted(np.asarray(ids)[0].tolist()) == [0, 1, 2, 3]
    assert np.allclose(np.asarray(weights), 0.5)


def test_declines_are_counted(metal):
    E, D = 64, 16
    x, w, bias = inputs(E, D, 2)
    cfg = RouterConfig(4, 32, 2, True, 1.0)     # groups of 2 experts: accepted
    router.router_topk(x, w, bias, cfg)
    cfg = RouterConfig(4, 64, 2, True, 1.0)     # groups of 1 expert: declined
    ids, _ = router.router_topk(x, w, bias, cfg)
    c = dispatch.counters()
    assert any("n_group=64" in r for r in c["fallbacks"]), c
    assert c["calls"].get("router/metal") == 1 and c["calls"].get("router/reference") == 1


# ---------------------------------------------------------------------------------------
# The machine's own GPU backend (the CUDA twin on the H200); skipped on CPU-only machines


GPU = dispatch.gpu_backend() is not None


@pytest.mark.skipif(not GPU, reason="router kernels: GPU backend only")
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("S, dtype", [(1, mx.bfloat16), (4, mx.float32), (8, mx.bfloat16)])
def test_gpu_kernel_matches_oracle(case, S, dtype):
    E, D, cfg = CASES[case]
    x, w, bias = inputs(E, D, S, dtype=dtype, seed=20 + S, cfg=cfg)
    dispatch.reset_counters()
    ids, weights = router.router_topk(x, w, bias, cfg, shared_id=E)
    mx.eval(ids, weights)
    c = dispatch.counters()
    assert c["calls"] == {f"router/{dispatch.gpu_backend()}": 1} and not c["fallbacks"], c
    check(ids, weights, x, w, bias, cfg, E, f"gpu {case} S={S}")


@pytest.mark.skipif(not GPU, reason="router kernels: GPU backend only")
def test_gpu_kernel_deepseek_shape():
    E, cfg = 256, RouterConfig(8, 8, 4, True, 2.5)
    for S in range(1, 9):
        x, w, bias = inputs(E, 7168, S, dtype=mx.bfloat16, seed=S, cfg=cfg)
        ids, weights = router.router_topk(x, w, bias, cfg, shared_id=E)
        check(ids, weights, x, w, bias, cfg, E, f"gpu deepseek S={S}")

"""moe_block and mla_decode Metal kernels in the MSL simulator.

The whole hot path runs as in production (``kernels.moe_block`` / ``kernels.mla_decode`` with
the Metal backend selected), but every launch goes to the simulator instead of MLX: the exact
sources, templates, grids and inputs MLX would get. Outputs are poisoned by the simulator and
any unwritten element fails; results are compared with float64 oracles (moe_mla_oracle.py).
Then planted defects must fail.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx import kernels
from colibri_mlx.kernels import dispatch, moe
from kernel_oracle import random_qtensor
from moe_mla_oracle import assert_moe_close, hadamard_f64, route_launches_to_simulator, simulate

simulator = pytest.importorskip("msl.simulator")
if simulator.unavailable_reason():
    pytest.skip(f"MSL simulator: {simulator.unavailable_reason()}", allow_module_level=True)


@pytest.fixture
def metal(monkeypatch):
    """Route every kernel launch of the hot paths to the simulator, as if on a Mac."""
    yield route_launches_to_simulator(monkeypatch, simulator)
    moe.clear_banks()


def make_experts(fmts, D, inter, gs=32, seed=0):
    """One (gate, up, down) per entry of ``fmts``; an entry is a fmt or (fmt_gate_up, fmt_down)."""
    experts = []
    for e, f in enumerate(fmts):
        fgu, fd = f if isinstance(f, tuple) else (f, f)
        s = seed + 10 * e
        experts.append((random_qtensor(fgu, inter, D, gs=gs, seed=s),
                        random_qtensor(fgu, inter, D, gs=gs, seed=s + 1),
                        random_qtensor(fd, D, inter, gs=gs, seed=s + 2)))
    return experts


def routing(N, K, E, seed=0, repeat=None):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32)
    if repeat is not None:
        ids[:, 0] = repeat           # one expert chosen by every token
    w = rng.uniform(0.1, 1.0, (N, K)).astype(np.float32)
    return mx.array(ids), mx.array(w)


def x_of(N, D, dtype=mx.float32, seed=1):
    return mx.array(np.random.default_rng(seed).standard_normal((N, D)).astype(np.float32)).astype(dtype)


def launch_args(monkeypatch, name, **kw):
    """moe_block's launches of ``name`` (moe.gate_up_spec / moe.down_spec) built with ``kw``."""
    real = getattr(moe, name)
    monkeypatch.setattr(moe, name, lambda *args, **given: real(*args, **{**given, **kw}))


def run_moe(experts, N, K, dtype=mx.float32, seed=0, repeat=None, ids=None):
    D = moe._shape(experts[0][0])[1]
    x = x_of(N, D, dtype, seed + 1)
    if ids is None:
        ids, w = routing(N, K, len(experts), seed, repeat)
    else:
        ids, w = mx.array(np.asarray(ids, np.int32)), mx.array(np.random.default_rng(seed).uniform(0.1, 1, np.shape(ids)).astype(np.float32))
    y = kernels.moe_block(x, experts, ids, w)
    assert y.dtype == dtype and y.shape == (N, D)
    extra = {mx.float32: 0.0, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}[dtype]
    return assert_moe_close(y, x, experts, ids, w, f"moe N={N} K={K}", extra_rel=extra)


# ---------------------------------------------------------------------------------------
# moe_block


@pytest.mark.parametrize("fmt", [1, 2, 3, 4, 5, 6])
def test_moe_every_fmt(metal, fmt):
    experts = make_experts([fmt] * 5, D=96 if fmt != 6 else 300, inter=40, gs=32, seed=fmt)
    run_moe(experts, N=2, K=3, seed=fmt)
    assert "moe_gate_up" in metal and "moe_down" in metal
    assert ("moe_hadamard" in metal) == (fmt == 6)
    c = kernels.counters()
    assert c["calls"].get("moe_block/metal") == 1 and not c["fallbacks"], c


def test_moe_mixed_formats_one_layer(metal):
    # Experts of different fmt/gs in one layer: one gate_up + down pair per group, fmt 6
    # rotation of the input once for the layer.
    fmts = [4, 6, 2, 6, 5, 4, (4, 5), 1]
    experts = make_experts(fmts, D=256, inter=64, gs=64, seed=3)
    ids = [[1, 3, 0, 6], [3, 7, 4, 2], [5, 1, 6, 0]]
    run_moe(experts, N=3, K=4, ids=ids)
    assert metal.count("moe_hadamard") == 1 + 1   # x once, fmt 6 group's h once
    assert metal.count("moe_gate_up") == 6          # groups: 4, 6, 2, 5, (4,5), 1


def test_moe_one_expert_repeated_for_every_token(metal):
    experts = make_experts([4] * 9, D=64, inter=48, gs=16, seed=5)
    run_moe(experts, N=8, K=2, repeat=4, seed=5)


def test_moe_ragged_and_dropped_slots(metal):
    # Slots dropped by router top-p (-1) and an expert listed twice for one token.
    experts = make_experts([2] * 6, D=80, inter=33, seed=7)
    run_moe(experts, N=3, K=3, ids=[[0, -1, -1], [5, 5, 1], [2, 0, -1]])


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_moe_low_precision_x(metal, dtype):
    if dtype == mx.bfloat16:
        pytest.importorskip("ml_dtypes", reason="the simulator takes bfloat16 inputs as ml_dtypes arrays")
    experts = make_experts([4] * 4, D=128, inter=32, gs=64, seed=9)
    run_moe(experts, N=1, K=2, dtype=dtype, seed=9)


def test_moe_float_experts(metal):
    rng = np.random.default_rng(11)
    experts = [tuple(mx.array(rng.standard_normal(s).astype(np.float32) * 0.1) for s in ((24, 50), (24, 50), (50, 24)))
               for _ in range(4)]
    run_moe(experts, N=2, K=2, seed=11)


@pytest.mark.parametrize("nw,rows_gu,rows_d", [(1, 1, 1), (2, 2, 3), (4, 1, 4), (2, 4, 8)])
@pytest.mark.parametrize("fmt", [1, 4, 5, 6])
def test_moe_launch_variants(metal, monkeypatch, fmt, nw, rows_gu, rows_d):
    # Split-K across SIMD groups (partial sums through threadgroup memory), row blocks with
    # clamped rows past O, and down items that cross experts inside one unroll step.
    monkeypatch.setattr(moe, "_simdgroups", lambda row_blocks, units: nw)
    monkeypatch.setattr(moe, "GATE_UP_ROWS", rows_gu)
    monkeypatch.setattr(moe.qgemv, "default_rows", lambda S: rows_d)
    experts = make_experts([fmt] * 6, D=300 if fmt == 6 else 136, inter=72, gs=48, seed=30 + fmt)
    run_moe(experts, N=2, K=3, ids=[[0, 2, 5], [5, 1, 2]], seed=30 + fmt)


@pytest.mark.parametrize("fmt", [2, 4])
def test_moe_nib_decode(metal, monkeypatch, fmt):
    # The fmt 2/4 decode CUDA launches by default (qgemv.DEFAULT_NIB: fp16-subnormal codes, one
    # -8 * sum(x) per segment over only the tokens routed to the expert), here on Metal.
    monkeypatch.setattr(moe.qgemv, "DEFAULT_NIB", {dispatch.METAL: 1, dispatch.CUDA: 1})
    experts = make_experts([fmt] * 5, D=96, inter=40, gs=32, seed=40 + fmt)
    run_moe(experts, N=2, K=3, seed=40 + fmt)
    run_moe(experts, N=3, K=2, dtype=mx.bfloat16, seed=41)
    monkeypatch.setattr(moe, "_simdgroups", lambda row_blocks, units: 2)
    monkeypatch.setattr(moe.qgemv, "default_rows", lambda S: 3)
    experts = make_experts([fmt] * 6, D=136, inter=72, gs=48, seed=50 + fmt)
    run_moe(experts, N=2, K=3, ids=[[0, 2, 5], [5, 1, 2]], seed=50 + fmt)


@pytest.mark.parametrize("fmt", [1, 4, 5, 6])
def test_moe_gate_up_prefetch(metal, monkeypatch, fmt):
    # gate_up's PF 1 loop (prefetch=1; CUDA's default for one token), here on Metal: rows of 65
    # or more units give lane 0 three steps and the others two (odd and even step counts, a step
    # past the row's end), with and without split-K.
    launch_args(monkeypatch, "gate_up_spec", prefetch=1)
    monkeypatch.setattr(moe, "_simdgroups", lambda row_blocks, units: 1)
    experts = make_experts([fmt] * 4, D=2080 if fmt != 6 else 2304, inter=24, gs=32, seed=60 + fmt)
    run_moe(experts, N=2, K=2, ids=[[0, 3], [3, 1]], seed=60 + fmt)
    monkeypatch.setattr(moe, "_simdgroups", lambda row_blocks, units: 2)
    run_moe(experts, N=2, K=2, ids=[[2, 3], [1, 1]], seed=61 + fmt)


@pytest.mark.parametrize("fmt", [2, 4, 6])
def test_moe_down_persistent_grid(metal, monkeypatch, fmt):
    # PERS 1 (persistent=3): 3 threadgroups loop over the 16 row blocks of D = 64 on one slot
    # table each (NW 2: the barrier between row blocks reusing the partials).
    launch_args(monkeypatch, "down_spec", persistent=3)
    experts = make_experts([fmt] * 4, D=64, inter=768 if fmt != 6 else 1024, gs=32, seed=90 + fmt)
    for nw, ids in ((1, [[0, 3], [3, 1]]), (2, [[2, 3], [1, 1]])):
        monkeypatch.setattr(moe, "_simdgroups", lambda row_blocks, units, nw=nw: nw)
        run_moe(experts, N=2, K=2, ids=ids, seed=90 + fmt + nw)
    group = moe.resident_bank(experts).groups[0]
    spec = moe.down_spec(mx.zeros((4, moe.h_width(group))), group, mx.array([[0, 1], [2, 3]], dtype=mx.int32),
                         mx.ones((2, 2)), 2, 2)
    assert dict(spec.template)["PERS"] == 1 and spec.grid[0] == 3 * spec.threadgroup[0]


@pytest.mark.parametrize("fmt", [2, 4, 6])
def test_moe_gate_up_persistent_grid(metal, monkeypatch, fmt):
    # PERS 1 (persistent=3): 3 threadgroups a slot loop over the 12 / 16 row blocks of inter =
    # 24 / 32 (ROWS 2), unused slots' zero rows included (ids -1).
    launch_args(monkeypatch, "gate_up_spec", persistent=3)
    experts = make_experts([fmt] * 4, D=2080 if fmt != 6 else 2304, inter=24 if fmt != 6 else 32, gs=32,
                           seed=100 + fmt)
    for nw, ids in ((1, [[0, 3], [3, 1]]), (2, [[2, -1], [1, 1]])):
        monkeypatch.setattr(moe, "_simdgroups", lambda row_blocks, units, nw=nw: nw)
        run_moe(experts, N=2, K=2, ids=ids, seed=100 + fmt + nw)
    group = moe.resident_bank(experts).groups[0]
    spec = moe.gate_up_spec(x_of(2, 2080 if fmt != 6 else 2304), group, mx.array([[0, 1], [2, 3]], dtype=mx.int32), 2)
    assert dict(spec.template)["PERS"] == 1 and spec.grid[0] == 3 * spec.threadgroup[0]


def test_cuda_persistent_grid_defaults():
    """CUDA, one token, fmt 4: moe_gate_up shares the resident one-warp blocks among the slots,
    moe_down runs as many blocks as its launch bounds keep resident, both balanced (every block
    as many row blocks), several tokens sharing them; Metal keeps one threadgroup a row block;
    persistent=0 turns them off."""
    experts = make_experts([4] * 8, D=4096, inter=1024, gs=64, seed=5)
    group = moe.resident_bank(experts).groups[0]
    ids = mx.array([list(range(8))], dtype=mx.int32)

    def gate_up(backend, N=1, **kw):
        spec = moe.gate_up_spec(x_of(N, 4096, mx.bfloat16), group, mx.zeros((N, 8), mx.int32) + ids[:, :1], 8,
                                backend, **kw)
        return dict(spec.template)["PERS"], spec.grid[0] // spec.threadgroup[0]

    def down(backend, N=1, **kw):
        spec = moe.down_spec(mx.zeros((N * 8, moe.h_width(group))), group, mx.zeros((N, 8), mx.int32) + ids[:, :1],
                             mx.ones((N, 8)), N, 8, backend, **kw)
        return dict(spec.template)["PERS"], spec.grid[0] // spec.threadgroup[0], dict(spec.template).get("MINB")

    # gate_up: 512 row blocks a slot, 2112 // 8 = 264 resident a slot -> two rounds of 256.
    assert gate_up(dispatch.CUDA) == (1, 256)
    assert gate_up(dispatch.METAL) == (0, 512)
    # two tokens, one grid of one-token launches: 16 slots share them, 2112 // 16 = 132 a slot ->
    # four rounds of 128; down's 924 shared by the tokens, 462 each -> three rounds of 342
    assert gate_up(dispatch.CUDA, N=2) == (1, 128)
    assert down(dispatch.CUDA, N=2) == (1, 342, 7)
    # down: 1024 row blocks, launch bounds of 7 blocks an SM (924 resident) -> two rounds of 512.
    assert down(dispatch.CUDA) == (1, 512, 7)
    assert down(dispatch.METAL)[:2] == (0, 1024)
    assert down(dispatch.CUDA, persistent=0)[:2] == (0, 1024) and gate_up(dispatch.CUDA, persistent=0) == (0, 512)


@pytest.mark.parametrize("mode,bits,gs,bounded", [("affine", 4, 64, True), ("affine", 3, 64, True),
                                                 ("mxfp4", 4, 32, True), ("affine", 6, 64, False)])
def test_cuda_down_defaults_mlx_formats(mode, bits, gs, bounded):
    """CUDA, one token: moe_down of the MLX formats qgemv.cuda_tuned takes (at most 4 bits) gets fmt
    4's launch bounds and persistent grid (same row blocks, same rounds as fmt 4 above); wider
    codes keep one block a row block, unbounded."""
    from kernel_oracle import random_mlx_qtensor

    experts = [tuple(random_mlx_qtensor(mode, bits, gs, O, I, seed=e + 10 * k)
                     for k, (O, I) in enumerate(((1024, 4096), (1024, 4096), (4096, 1024)))) for e in range(8)]
    group = moe.resident_bank(experts).groups[0]
    ids = mx.array([list(range(8))], dtype=mx.int32)
    spec = moe.down_spec(mx.zeros((8, moe.h_width(group))), group, ids, mx.ones((1, 8)), 1, 8, dispatch.CUDA)
    t = dict(spec.template)
    got = (t["PERS"], spec.grid[0] // spec.threadgroup[0], t.get("MINB"))
    assert got == ((1, 512, 7) if bounded else (0, 1024, None)), got


def test_cuda_down_shape_compiled_in():
    """moe_down's CUDA template carries the projection's shape (KO, KRB, KNG, KNU) by default,
    zeros (read from params) with shape_in=False; Metal has no such template.
    tests/test_moe_block.py runs both on a GPU."""
    experts = make_experts([4] * 4, D=512, inter=128, gs=64, seed=8)
    group = moe.resident_bank(experts).groups[0]
    ids = mx.array([[0, 2]], dtype=mx.int32)

    def shape(backend, **kw):
        spec = moe.down_spec(mx.zeros((2, moe.h_width(group))), group, ids, mx.ones((1, 2)), 1, 2, backend, **kw)
        t = dict(spec.template)
        return tuple(t.get(k) for k in ("KO", "KRB", "KNG", "KNU"))

    p = group.down
    assert (p.O, p.rb, p.ng, p.n_units) == (512, 64, 2, 4)
    assert shape(dispatch.CUDA) == (512, 64, 2, 4)
    assert shape(dispatch.CUDA, shape_in=False) == (0, 0, 0, 0)
    assert shape(dispatch.CUDA, shape_in=True) == (512, 64, 2, 4)
    assert shape(dispatch.METAL) == (None,) * 4


# The persistent loops (PERS 1): (kernel, text, planted replacement, its count in the kernel).
PERSISTENT_DEFECTS = [
    ("moe_down", "blk += blk_step", "blk += n_blocks", 1),                               # one row block each
    ("moe_down", "    if (PERS) {\n      threadgroup_barrier", "    if (false) {\n      threadgroup_barrier", 1),
    ("moe_gate_up", "blk += blk_step", "blk += 2 * blk_step", 2),                        # every other row block
    # (moe_gate_up's barrier between row blocks is not planted: as for qgemv's, neither of the
    # simulator's schedules lets a SIMD group write the partials before the first one read them.)
]
PERSISTENT_SPEC = {"moe_down": "down_spec", "moe_gate_up": "gate_up_spec"}


@pytest.mark.parametrize("kernel,good,bad,count", PERSISTENT_DEFECTS)
def test_moe_persistent_planted_defect_is_caught(metal, monkeypatch, kernel, good, bad, count):
    real = simulate

    def planted(spec, sim):
        if spec.name == kernel:
            spec.source = spec.source.replace(good, bad)
        return real(spec, sim)

    assert moe.read_kernel_sections("moe_block", dispatch.METAL)[1][kernel].count(good) == count, \
        f"defect {bad!r} no longer plants"
    monkeypatch.setattr(dispatch, "launch", lambda b, spec: planted(spec, simulator))
    launch_args(monkeypatch, PERSISTENT_SPEC[kernel], persistent=3)
    monkeypatch.setattr(moe, "_simdgroups", lambda row_blocks, units: 2)
    experts = make_experts([4] * 4, D=64, inter=768, gs=32, seed=95)
    with pytest.raises((AssertionError, simulator.SimulatorError)) as caught:
        run_moe(experts, N=2, K=2, ids=[[2, 3], [1, 1]], seed=95)
    assert "failed to compile" not in str(caught.value)


def test_moe_prefill_groups_tokens(metal):
    experts = make_experts([4] * 5, D=64, inter=32, gs=32, seed=13)
    run_moe(experts, N=12, K=2, seed=13)
    assert "moe_gate_up" not in metal
    assert kernels.counters()["calls"].get("moe_block/grouped-prefill") == 1


@pytest.mark.parametrize("n", [256, 300, 2048 + 512 + 8])
def test_hadamard_matches_float64(n):
    x = x_of(3, n, seed=n)
    (y,) = simulate(moe.hadamard_spec(x), simulator)
    want = np.asarray(x).astype(np.float64) @ hadamard_f64(n)
    err = np.abs(np.asarray(y) - want).max() / np.abs(want).max()
    assert err < 1e-6, err


# ---------------------------------------------------------------------------------------
# Planted defects


# Scale defects of fmt 4 need fmt 4 experts alone: next to the fmt 6 experts of the default
# mix their error stays inside the (fmt 6 dominated) budget.
FMT4_ONLY = [4, 4, 4, 4, 4]
MOE_DEFECTS = {
    "leader writes only its own slot": ("if (sl[b] == e) {\n            h[size_t(slot0 + b) * hs + hi] = hv;",
                                        "if (b == a) {\n            h[size_t(slot0 + b) * hs + hi] = hv;"),
    # h in qd_xp_index's layout (padded rows of 4-float chunks ordered chunk-major)
    # (fmt 4 only: fmt 6 rotates h in row order, and its large outputs would widen the budget)
    "h padding past O left unwritten": ("for (int pad = (row == O - 1 ? O : hs); pad < hs; ++pad) {",
                                        "for (int pad = hs; pad < hs; ++pad) {", FMT4_ONLY),
    "down reads h rows at the unpadded stride": ("const int xoff = eslot[je] * hs;", "const int xoff = eslot[je] * I;",
                                                 FMT4_ONLY),
    "h second chunk of 8 read from the next unit": ("const device float* p1 = p0 + 4 * nu;",
                                                    "const device float* p1 = p0 + 4;", FMT4_ONLY),
    "up row read from gate": ("rows[ROWS + r] = rows[r] + O;", "rows[ROWS + r] = rows[r];"),
    "gate weight ignored": ("acc[r][0] += d[r][0] * (sc * wt);", "acc[r][0] += d[r][0] * sc;"),
    "repeated expert's gate weights not added": ("wsum += swt[c];", "wsum = swt[c];"),
    "down skips the last distinct expert": ("const int n_items = n_distinct[0] * n_units;",
                                            "const int n_items = (n_distinct[0] - 1) * n_units;"),
    "down split-K partial sums overwritten": ("v += red[k * ROWS + r];", "v = red[k * ROWS + r];"),
    "gate_up split-K up partial dropped": ("uv += red[k * R2 + ROWS + r];", "uv = red[k * R2 + ROWS + r];"),
    "gate_up reduction barrier missing": ("    threadgroup_barrier(mem_flags::mem_threadgroup);\n    // Thread r writes h",
                                          "    // Thread r writes h"),
    "down expert table barrier missing": ("  threadgroup_barrier(mem_flags::mem_threadgroup);\n  const int n_items",
                                          "  const int n_items"),
    "gate_up hoisted scale of the wrong row": ("qd_seg_scale<FMT, GS>(sgu, rows[r], ng, u, g, raw[j][r]) : 1.0f;",
                                               "qd_seg_scale<FMT, GS>(sgu, rows[0], ng, u, g, raw[j][r]) : 1.0f;", FMT4_ONLY),
    "down hoisted scale of the wrong row": ("qd_seg_scale<FMT, GS>(s0, rd[r]", "qd_seg_scale<FMT, GS>(s0, rd[0]",
                                            FMT4_ONLY),
    "down expert table: weights of the first expert": ("ewo[j] = ulong(sl[b])", "ewo[j] = ulong(sl[0])"),
    "down expert table: scales of the first expert": ("eso[j] = ulong(sl[b])", "eso[j] = ulong(sl[0])", FMT4_ONLY),
    "hadamard missing barrier": ("buf[i + hs] = u - v;\n    }\n    threadgroup_barrier(mem_flags::mem_threadgroup);",
                                 "buf[i + hs] = u - v;\n    }"),
}


# gate_up's PF 1 loop (prefetch=1): each defect must fail the oracle.
MOE_PF_DEFECTS = {
    "prefetch: second buffer's step skipped": ("I, n_units, base + STEP, raw_b, scl_b, acc);",
                                               "I, n_units, base + 2 * STEP, raw_b, scl_b, acc);"),
    "prefetch: loop stops after the first buffer": ("if (base + STEP >= n_units) {", "if (base + STEP >= 0) {"),
    "prefetch: next step loaded into the live buffer": ("base + 2 * STEP,\n                                                       raw_a, scl_a);",
                                                        "base + 2 * STEP,\n                                                       raw_b, scl_b);"),
}


@pytest.mark.parametrize("defect", sorted(MOE_PF_DEFECTS))
def test_moe_prefetch_planted_defect_is_caught(metal, monkeypatch, defect):
    good, bad = MOE_PF_DEFECTS[defect]
    real = simulate

    def planted(spec, sim):
        if good in spec.source:
            spec.source = spec.source.replace(good, bad)
        return real(spec, sim)

    assert "".join(moe.read_kernel_sections("moe_block", dispatch.METAL)[1].values()).count(good) == 1, \
        f"defect '{defect}' no longer plants"
    monkeypatch.setattr(dispatch, "launch", lambda b, spec: planted(spec, simulator))
    launch_args(monkeypatch, "gate_up_spec", prefetch=1)
    monkeypatch.setattr(moe, "_simdgroups", lambda row_blocks, units: 1)
    # rows where lane 0 runs 3 steps with one SIMD group
    experts = make_experts([4] * 4, D=2080, inter=24, gs=32, seed=70)
    with pytest.raises((AssertionError, simulator.SimulatorError)) as caught:
        run_moe(experts, N=2, K=2, ids=[[0, 3], [3, 1]], seed=70)
    assert "failed to compile" not in str(caught.value)


@pytest.mark.parametrize("defect", sorted(MOE_DEFECTS))
def test_moe_planted_defect_is_caught(metal, monkeypatch, defect):
    good, bad, *fmts = MOE_DEFECTS[defect]
    real = simulate

    def planted(spec, sim):
        text = spec.header + spec.source
        if good in text:
            spec.source = spec.source.replace(good, bad)
            spec.header = spec.header.replace(good, bad)
        return real(spec, sim)

    files = dispatch.decode_header(dispatch.METAL) + "".join(
        moe.read_kernel_sections(n, dispatch.METAL)[0] + "".join(moe.read_kernel_sections(n, dispatch.METAL)[1].values())
        for n in ("moe_block", "hadamard"))
    assert files.count(good) == 1, f"defect '{defect}' no longer plants"
    monkeypatch.setattr(dispatch, "launch", lambda b, spec: planted(spec, simulator))
    monkeypatch.setattr(moe, "_simdgroups", lambda row_blocks, units: 2)   # split-K defects need NW > 1
    experts = make_experts(fmts[0] if fmts else [6, 6, 4, 4, 6], D=300, inter=40, gs=32, seed=21)
    with pytest.raises((AssertionError, simulator.SimulatorError)) as caught:
        run_moe(experts, N=3, K=3, ids=[[0, 2, 1], [4, 4, 3], [0, 1, 2]], seed=21)
    assert "failed to compile" not in str(caught.value)


# ---------------------------------------------------------------------------------------
# mla_decode

from colibri_mlx.kernels import mla  # noqa: E402
from colibri_mlx.kernels.rows import rows_spec  # noqa: E402
from moe_mla_oracle import REL, assert_mla_close, assert_rows_close, rope_of, rotated_f64, rows_case, weight_f64  # noqa: E402


def mla_inputs(B=1, H=4, L=1, T=37, nope=16, v=8, R=64, rope=8, fmt=4, cache_dtype=mx.float32, seed=0,
               masked=False, n_sel=None, spikes=None):
    """``spikes``: ``(positions, factor)``, cache rows scaled by ``factor`` (scores far above
    those of earlier positions: heads whose running max jumps mid-tile)."""
    rng = np.random.default_rng(seed)
    f = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    kv_b = (random_qtensor(fmt, H * (nope + v), R, gs=32, seed=seed) if fmt not in (0, moe.BF16_ROWS_FMT)
            else mx.array(rng.standard_normal((H * (nope + v), R)).astype(np.float32) * 0.1))
    if fmt == moe.BF16_ROWS_FMT:   # a float kv_b held in bfloat16: read as stored
        kv_b = kv_b.astype(mx.bfloat16)
    mask = None
    if masked:
        mask = mx.array(rng.random((B, 1, L, T)) < 0.7)
    sel = None
    if n_sel:
        sel = mx.array(np.stack([np.stack([rng.choice(T, n_sel, replace=False) for _ in range(L)]) for _ in range(B)]).astype(np.int32))
    q_nope, q_rope, latent, k_rope = f(B, H, L, nope), f(B, H, L, rope), f(B, T, R), f(B, T, rope)
    if spikes is not None:
        gain = np.ones((1, T, 1), np.float32)
        gain[0, list(spikes[0])] = spikes[1]
        latent, k_rope = latent * mx.array(gain), k_rope * mx.array(gain)
    return (q_nope, q_rope, latent.astype(cache_dtype), k_rope.astype(cache_dtype), kv_b, 0.3, mask, nope, v), sel


def joint_args(args):
    """mla_inputs' arguments with the cache as one joint buffer (each row the latent, then the
    rope key: the model's cache) and no separate k_rope."""
    q_nope, q_rope, latent, k_rope, *rest = args
    return (q_nope, q_rope, mx.concatenate([latent, k_rope], axis=-1), None, *rest)


def run_mla(metal, tile=None, variant="mma", heads=None, joint=False, qabs_parts=None, out_warps=None, **kw):
    args, sel = mla_inputs(**kw)
    run = mla.launch_specs(*(joint_args(args) if joint else args), selected=sel, tile=tile, variant=variant,
                           heads=heads, qabs_parts=qabs_parts, out_warps=out_warps)
    assert run.variant == variant
    out = run(lambda spec: simulate(spec, simulator))
    return assert_mla_close(out, *args, selected=sel, label=str(kw))


def launched(run):
    """A launch_specs ``run`` through dispatch.launch (the ``metal`` fixture's simulator)."""
    return run(lambda spec: dispatch.launch(dispatch.METAL, spec))


# The variants these float32-cache tests run (wide stages 16-bit caches: its own tests below).
F32_VARIANTS = ("mma", "simt")
VARIANTS = pytest.mark.parametrize("variant", F32_VARIANTS)


@VARIANTS
def test_mla_one_layer_across_decode_steps(metal, variant):
    """A layer's launch statics are kept per kv_b: the same weight at growing cache lengths (as
    decode steps call it) and then with a mask must each launch with their own tile counts and
    flags, not a previous step's."""
    args, _ = mla_inputs(T=150, seed=31)
    q_nope, q_rope, latent, k_rope, kv_b, scale, _, nope, v = args
    for T, masked in ((40, False), (150, False), (97, True)):
        mask = mx.array(np.random.default_rng(T).random((1, 1, 1, T)) < 0.7) if masked else None
        step = (q_nope, q_rope, latent[:, :T], k_rope[:, :T], kv_b, scale, mask, nope, v)
        out = mla.launch_specs(*step, variant=variant, tile=16)(lambda spec: simulate(spec, simulator))
        assert_mla_close(out, *step, label=f"T={T} masked={masked}")


@VARIANTS
@pytest.mark.parametrize("kw", [dict(B=2, L=2, T=45, n_sel=20, cache_dtype=mx.bfloat16, seed=51),
                                dict(B=2, L=1, T=90, masked=True, seed=52),
                                dict(H=40, rope=16, T=70, heads=32, seed=53)])
def test_mla_joint_cache(metal, variant, kw):
    # One buffer [B, T, R + rope] (the model's cache: one row written a decode step) read as
    # the latent and the rope key: batches (rows of another sequence), DSA lists, masks,
    # bf16, padding heads and rope k-steps in both k-parts of the mma kernel.
    kw = dict(kw)
    run_mla(metal, variant=variant, joint=True, tile=16, heads=kw.pop("heads", None), **kw)


@VARIANTS
@pytest.mark.parametrize("length", [1, 40, 150])
def test_mla_fixed_capacity_buffer_with_step_params(metal, variant, length):
    """A compiled decode step's launch (kernels.mla.step_params): the whole 150-row buffer goes
    in, tiles follow its rows (tile 16: up to 9 tiles with no position), only the first
    ``length`` rows are attended. Rows past it hold NaN: any read of them that reached the
    arithmetic would show (attending one row more fails this test)."""
    args, _ = mla_inputs(T=150, seed=40 + length)
    q_nope, q_rope, latent, k_rope, kv_b, scale, _, nope, v = args
    poison = (mx.arange(150) >= length)[None, :, None]
    latent_buf, k_rope_buf = mx.where(poison, mx.nan, latent), mx.where(poison, mx.nan, k_rope)
    params = mla.step_params(kv_b, latent_buf, q_nope.shape[1], nope, q_rope.shape[-1], v, q_nope.dtype, length,
                             variant=variant, tile=16)
    assert np.asarray(params).tolist()[5:9] == [150, length, 16, 10]    # T, P, TT, NT
    out = launched(mla.launch_specs(q_nope, q_rope, latent_buf, k_rope_buf, kv_b, scale, None, nope, v,
                                    params=params, variant=variant, tile=16))
    assert metal[-3:] == ["mla_qabs", {"mma": "mla_attn_mma", "simt": "mla_attn"}[variant], "mla_out"]
    assert_mla_close(out, q_nope, q_rope, latent[:, :length], k_rope[:, :length], kv_b, scale, None, nope, v,
                     label=f"length {length} of 150")
    # the same over one joint buffer, as the model's decode step runs it
    joint = mx.concatenate([latent_buf, k_rope_buf], axis=-1)
    params = mla.step_params(kv_b, joint, q_nope.shape[1], nope, q_rope.shape[-1], v, q_nope.dtype, length,
                             joint=True, variant=variant, tile=16)
    out = launched(mla.launch_specs(q_nope, q_rope, joint, None, kv_b, scale, None, nope, v, params=params,
                                    variant=variant, tile=16))
    assert_mla_close(out, q_nope, q_rope, latent[:, :length], k_rope[:, :length], kv_b, scale, None, nope, v,
                     label=f"joint, length {length} of 150")


@VARIANTS
@pytest.mark.parametrize("fmt", [0, 1, 2, 3, 4, 5, moe.BF16_ROWS_FMT])
def test_mla_every_kv_b_fmt(metal, fmt, variant):
    if fmt == moe.BF16_ROWS_FMT:
        assert mla.kv_b_projection(mla_inputs(fmt=fmt)[0][4]).fmt == moe.BF16_ROWS_FMT
    run_mla(metal, fmt=fmt, seed=fmt, tile=16, variant=variant)


@VARIANTS
@pytest.mark.parametrize("T", [1, 31, 32, 33, 100])
def test_mla_cache_lengths_across_tiles(metal, T, variant):
    run_mla(metal, T=T, tile=32, seed=T, masked=T > 1, variant=variant)


@VARIANTS
def test_mla_batch_queries_mask_and_rope_wider_than_a_simd_group(metal, variant):
    run_mla(metal, B=2, L=3, H=2, T=45, R=96, rope=40, v=16, tile=8, masked=True, seed=3, variant=variant)


@pytest.mark.parametrize("H,tile", [(20, 16), (3, 12), (8, 24)])
def test_mla_head_groups_and_chunks(metal, H, tile):
    # 20 heads: 5 blocks of 4 -> two threadgroups of 4 SIMD groups, three of them idle in the
    # second (they still stage chunks and wait); 3 heads: one head per SIMD group; tiles that
    # are not a multiple of the 8-position chunk (a chunk crosses the tile end).
    run_mla(metal, H=H, T=61, tile=tile, masked=True, seed=40 + H, variant="simt")


@pytest.mark.parametrize("heads,H,R,rope,tile", [
    (16, 20, 64, 8, 16), (16, 3, 96, 40, 12), (32, 40, 72, 16, 24), (32, 16, 40, 24, None),
    (64, 70, 64, 8, 20), (64, 8, 96, 16, 8)])
def test_mla_mma_head_blocks_column_tiles_and_chunks(metal, heads, H, R, rope, tile):
    # heads per threadgroup 16 / 32 / 64 (4 / 8 / 16 SIMD groups: 1 / 2 / 4 16-head tiles x 4
    # k-parts). Head blocks with padding heads (q' = 0, never written): 20 of 2 x 16, 3 of 16,
    # 40 of 2 x 32, 70 of 2 x 64, 8 of 64. R 96 / 72 / 40: 12 / 9 / 5 column tiles over the
    # SIMD groups (some past R); rope 40 / 24: k-steps over the latent / rope boundary in
    # different SIMD groups. Tiles 12 / 20 / 24 cross a chunk; None: the default tile.
    run_mla(metal, H=H, R=R, rope=rope, T=61, tile=tile, masked=True, seed=40 + H, variant="mma", heads=heads)


@pytest.mark.parametrize("fmt,R,nope,v", [(4, 512, 40, 24), (0, 520, 21, 9), (5, 128, 19, 8), (2, 96, 16, 8),
                                          (moe.BF16_ROWS_FMT, 520, 21, 9)])
def test_mla_kv_b_rows_split_over_lanes(metal, fmt, R, nope, v):
    # mla_qabs / mla_out take LW lanes a kv_b row (32 / LW rows side by side), RU rows a lane per
    # step: 16 units (DeepSeek's R 512 fmt 4: two rows a SIMD group, 64 a step of 40 rows),
    # 65 (fmt 0: 32 lanes, 3 units a lane, 2 rows a step), 2, 6 units: steps past nope and v.
    assert mla.unit_lanes(16) == (16, 1, 8) and mla.unit_lanes(65) == (32, 3, 2)
    run_mla(metal, fmt=fmt, R=R, nope=nope, v=v, T=20, tile=8, seed=fmt + R, variant="simt")


@pytest.mark.parametrize("fmt,R,parts", [(4, 512, 4), (4, 512, 3), (4, 512, 1), (0, 136, 5), (5, 128, 2)])
def test_mla_qabs_column_parts(metal, fmt, R, parts):
    # mla_qabs splits a head's kv_b units over `parts` threadgroups (uneven where they do not
    # divide: 16 units in 3 parts of 6, 6, 4; fmt 0's 17 units in 5 of 4, the last 1); q_rope and
    # the padding heads (mma pads 12 heads to 16) belong to part 0.
    assert mla.qabs_parts(16, 3) == (6, 3) and mla.qabs_parts(17, 5) == (4, 5) and mla.qabs_parts(2, 4) == (1, 2)
    run_mla(metal, fmt=fmt, R=R, H=12, nope=24, v=8, T=20, tile=8, seed=fmt + R + parts, qabs_parts=parts)


@pytest.mark.parametrize("warps,T,tile", [(4, 300, 4), (8, 300, 4), (16, 1100, 2), (16, 20, 8)])
def test_mla_out_simdgroups(metal, warps, T, tile):
    # mla_out with 8 / 16 SIMD groups: batches of 2 x warps tiles (16 / 32), the tile weights in
    # whole passes of 256 / 512; 300 / 4 = 75 tiles (partial batches), 1100 / 2 capped at
    # MAX_TILES (367 tiles of 3), 3 tiles (one partial batch).
    run_mla(metal, fmt=4, R=128, H=4, nope=16, v=40, T=T, tile=tile, seed=warps + T, variant="simt",
            out_warps=warps)
    with pytest.raises(ValueError, match="SIMD groups"):
        mla.out_simdgroups(32)


def test_mla_qabs_parts_planted_defect_is_caught(metal, monkeypatch):
    # Each part must read and write its own units: a part that reads part 0's units (u0 dropped
    # from the unit index) writes part 0's sums into its columns.
    good, bad = "const int u = u0 + ul + LW * j;", "const int u = ul + LW * j;"
    assert _launched_text("mma").count(good) == 3, "defect no longer plants"

    def planted(spec):
        spec.source = spec.source.replace(good, bad)
        spec.header = spec.header.replace(good, bad)
        return simulate(spec, simulator)

    args, sel = mla_inputs(fmt=4, R=128, H=4, nope=16, v=8, T=12, seed=77)
    run = mla.launch_specs(*args, tile=8, qabs_parts=2)
    assert_mla_close(run(lambda spec: simulate(spec, simulator)), *args, label="clean")
    with pytest.raises((AssertionError, simulator.SimulatorError)) as caught:
        assert_mla_close(run(planted), *args)
    assert "failed to compile" not in str(caught.value)


@VARIANTS
def test_mla_tiles_capped_for_the_merge(metal, variant):
    # mla_out keeps one weight per tile in threadgroup memory (MAX_TILES of them): a forced
    # 1-position tile over 1100 positions becomes 3 positions, 367 tiles (3 a thread of the
    # weight pass, the last pass partial).
    args, _ = mla_inputs(T=1100, masked=True, seed=8)
    shapes = []

    def launch(spec):
        shapes.append(spec.output_shapes)
        return simulate(spec, simulator)

    out = mla.launch_specs(*args, tile=1, variant=variant)(launch)
    assert mla.MAX_TILES == 512 and shapes[1][1] == (1, 4, 367, 2)
    assert_mla_close(out, *args)


def test_mla_mma_heads_choice():
    assert mla.mma_heads(dispatch.METAL) == 32 and mla.mma_heads(dispatch.CUDA) == 32
    assert mla.mma_heads(dispatch.CUDA, 16) == 16 and mla.mma_heads(dispatch.METAL, 64) == 64
    with pytest.raises(ValueError, match="do not launch on CUDA"):    # 512 threads of ~230 registers
        mla.mma_heads(dispatch.CUDA, 64)
    with pytest.raises(ValueError, match="not one of"):
        mla.mma_heads(dispatch.METAL, 48)


def test_mla_mma_templates():
    # The latent width reaches the kernel as template RL (whole-tile guards fold on it); mma
    # tiles are whole chunks of 8 positions.
    assert mla.mma_tile(40000, 4) == 632 and mla.mma_tile(100, 4) == 128
    args, _ = mla_inputs(T=40, cache_dtype=mx.bfloat16, seed=3)
    specs = []

    def capture(spec):       # records the launch; zeros stand in for its outputs (no GPU here)
        specs.append(spec)
        return [mx.zeros(shape, dtype) for shape, dtype in zip(spec.output_shapes, spec.output_dtypes)]

    mla.launch_specs(*args, backend=dispatch.CUDA, variant="mma")(capture)
    t = dict(specs[1].template)
    assert t["RL"] == args[2].shape[-1] and t["NSG"] == t["HT"] // 4 and t["RW"] == t["RL"] + args[1].shape[-1]


@pytest.mark.parametrize("R,rope", [(120, 8), (64, 32)])
def test_mla_mma_whole_and_partial_tiles(metal, R, rope):
    # mla_attn_mma drops its per-step tests where the k-steps (k-parts x steps x 8 = R + rope)
    # or the column tiles (SIMD groups x tiles x 8 = R) come out whole: 120 + 8 columns are 16
    # whole k-steps but 2 column tiles a SIMD group cover 128 of 120; 64 + 32 the reverse of
    # the usual 64 + 8 (whole column tiles, 9 k-steps over 12 slots).
    run_mla(metal, fmt=0, R=R, rope=rope, T=45, tile=16, seed=R + rope)


@VARIANTS
def test_mla_selected_positions(metal, variant):
    run_mla(metal, B=1, L=2, T=90, n_sel=20, tile=8, seed=4, variant=variant)


@VARIANTS
def test_mla_bf16_cache(metal, variant):
    pytest.importorskip("ml_dtypes", reason="the simulator takes bfloat16 inputs as ml_dtypes arrays")
    run_mla(metal, T=40, cache_dtype=mx.bfloat16, seed=5, tile=16, variant=variant)


def test_mla_mma_needs_multiples_of_8():
    assert mla.choose_variant(64, 8) == "mma"
    assert mla.choose_variant(60, 8) == "simt" and mla.choose_variant(64, 12) == "simt"
    assert mla.choose_variant(64, 8, "simt") == "simt"
    # CUDA's mma is TF32: a float32 model keeps the exact scalar kernel, bf16/f16 get mma, or
    # wide over a 16-bit cache (Metal's wide is opt-in, not yet measured on an Apple GPU)
    assert mla.choose_variant(64, 8, backend="cuda", dtype=mx.float32) == "simt"
    assert mla.choose_variant(64, 8, backend="cuda", dtype=mx.bfloat16) == "mma"
    assert mla.choose_variant(64, 8, backend="cuda", dtype=mx.bfloat16, cache_dtype=mx.float32) == "mma"
    for cache in (mx.bfloat16, mx.float16):
        assert mla.choose_variant(64, 8, backend="cuda", dtype=mx.bfloat16, cache_dtype=cache) == "wide"
        assert mla.choose_variant(64, 8, backend="metal", dtype=mx.bfloat16, cache_dtype=cache) == "mma"
        assert mla.choose_variant(60, 8, backend="cuda", dtype=mx.bfloat16, cache_dtype=cache) == "simt"
    assert mla.choose_variant(64, 8, backend="metal", dtype=mx.float32) == "mma"
    with pytest.raises(ValueError, match="not one of"):
        mla.choose_variant(64, 8, "tensor")


@pytest.mark.parametrize("variant,want", [(None, ["mla_qabs", "mla_attn_mma", "mla_out"]),
                                          ("simt", ["mla_qabs", "mla_attn", "mla_out"])])
def test_mla_dispatch_counts(metal, variant, want):
    args, _ = mla_inputs(T=20)
    out = kernels.mla_decode(*args, variant=variant)
    assert metal == want
    calls = kernels.counters()["calls"]
    assert calls.get("mla_decode/metal") == 1 and calls.get(f"mla_attn/{variant or 'mma'}/metal") == 1, calls
    assert_mla_close(out, *args)


MLA_DEFECTS = {   # simt: mla_attn (and the shared mla_qabs / mla_out)
    "online softmax without rescale": ("acc[i][j] *= al;", ""),
    "tile merge ignores the tile weights": ("s[j] += wt[t0 + k] * pv[j][k];", "s[j] += pv[j][k];"),
    "tile weights read without a barrier": ("    den_s[sg] = dloc;\n  }\n  threadgroup_barrier(mem_flags::mem_threadgroup);",
                                            "    den_s[sg] = dloc;\n  }"),
    "qabs rows of a SIMD group not folded": ("acc[k] += simd_shuffle_xor(acc[k], ushort(s));", ""),
    "W_UV row summed over half its lanes": ("for (int m = LW / 2; m >= 1; m >>= 1) {", "for (int m = LW / 4; m >= 1; m >>= 1) {"),
    "rope part dropped": ("d[i * C + c] += qr[i][j] * kv;", "d[i * C + c] += 0.0f;"),
    "qabs reduction barrier missing": ("  threadgroup_barrier(mem_flags::mem_threadgroup);\n  const int c1 = min(R, (u0 + UPP) * WPU);",
                                       "  const int c1 = min(R, (u0 + UPP) * WPU);"),
    "chunk staged without a barrier": ("    threadgroup_barrier(mem_flags::mem_threadgroup);\n    if (active) {", "    if (active) {"),
    "reduce-scatter keeps the wrong half": ("const float keep = upper ? v[k + w] : v[k];", "const float keep = upper ? v[k] : v[k + w];"),
    "chunk sum misses half the head's lanes": ("psum += simd_shuffle_xor(psum, ushort(4));", ""),
    "mask ignored in the chunk": ("keep = (has_mask == 2 ? t <= P - L + q % L : !has_mask || mask[size_t(q) * T + t] != 0) "
                                  "? 1 : 0;", "keep = 1;"),
    "positions past the tile end scored": ("      int keep = -1;", "      int keep = 1;"),
}

MMA_DEFECTS = {   # mma: mla_attn_mma (and the shared mla_qabs / mla_out)
    "scores: chunk loaded untransposed": ("simdgroup_load(kt, lat_s + k0, RWS, ulong2(0, 0), true);",
                                          "simdgroup_load(kt, lat_s + k0, RWS, ulong2(0, 0), false);"),
    "scores: q' rows with the wrong stride": ("simdgroup_load(qt[i][r], qa0 + size_t(row0) * RW + k0, RW);",
                                              "simdgroup_load(qt[i][r], qa0 + size_t(row0) * RW + k0, RW - 8);"),
    "q_rope not copied beside q'": ("      qa_rope[c] = float(qr[c]);", "      qa_rope[c] = 0.0f;"),
    "scores: every SIMD group on head tile 0": ("const int ht = sg % HTL;", "const int ht = 0;"),
    "scores: a k-part's partial dropped": ("for (int g = 0; g < KP; ++g) {\n        dot += sc_s",
                                           "for (int g = 1; g < KP; ++g) {\n        dot += sc_s"),
    "scores: partials read without a barrier": (
        "      simdgroup_store(s[r], sc_s + (kp * HT + ht * 16 + r * 8) * C, C);\n    }\n    threadgroup_barrier(mem_flags::mem_threadgroup);",
        "      simdgroup_store(s[r], sc_s + (kp * HT + ht * 16 + r * 8) * C, C);\n    }"),
    "chunk staged without a barrier": ("    if (c0 < p0) {\n      continue;\n    }\n    threadgroup_barrier(mem_flags::mem_threadgroup);",
                                       "    if (c0 < p0) {\n      continue;\n    }"),
    "chunk stored before the previous one is consumed": (
        "      threadgroup_barrier(mem_flags::mem_threadgroup);   // the previous chunk is consumed\n      for (int j = 0; j < NLU",
        "      for (int j = 0; j < NLU"),
    "next chunk's positions from the current chunk": ("const int t = mla_position(sel, has_sel, q, P, cn + unit_c[j]);",
                                                      "const int t = mla_position(sel, has_sel, q, P, c0 + unit_c[j]);"),
    "rope units read from the latent": (": krope + size_t(b) * T * cache.ks + cache.rope0 + (col - R);",
                                        ": latent + size_t(b) * T * cache.ks + cache.rope0 + (col - R);"),
    "rope units with the latent's row stride": ("unit_stride[j] = col < R ? cache.ls : cache.ks;",
                                                "unit_stride[j] = cache.ls;"),
    "weights read without a barrier": ("      diag_s[hs * 8 + cs] = cs == hs % 8 ? alpha : 0.0f;\n    }\n    threadgroup_barrier(mem_flags::mem_threadgroup);",
                                       "      diag_s[hs * 8 + cs] = cs == hs % 8 ? alpha : 0.0f;\n    }"),
    "weights against the chunk's max, not the reference": ("const float pw = keep >= 0 ? exp(sv - m_new) : 0.0f;",
                                                           "const float pw = keep >= 0 ? exp(sv - cmax) : 0.0f;"),
    "combine without rescale": ("            simdgroup_multiply(acc[rt][ct], dt[rt], acc[rt][ct]);\n", ""),
    "rescale decided by one head of the tile": ("simd_any(diag_s[rt * 64 + (lane % 8) * 9] != 1.0f)",
                                                "simd_any(diag_s[rt * 64] != 1.0f)"),
    "alpha off the diagonal": ("cs == hs % 8 ? alpha : 0.0f;", "cs == 0 ? alpha : 0.0f;"),
    "P loaded transposed": ("simdgroup_load(pt[rt], p_s + rt * 8 * C, C);", "simdgroup_load(pt[rt], p_s + rt * 8 * C, C, ulong2(0, 0), true);"),
    "combine: column tile of the wrong SIMD group": ("simdgroup_load(lt, lat_s + col0, RWS);",
                                                     "simdgroup_load(lt, lat_s + (col0 + 8) % R, RWS);"),
    "head's max over half its positions": ("      cmax = max(cmax, simd_shuffle_xor(cmax, ushort(4)));\n      const float m_new",
                                           "      const float m_new"),
    "mask ignored in the chunk": ("        keep = (has_mask == 2 ? t <= P - L + q % L : !has_mask || mask[size_t(q) * T + t] "
                                  "!= 0) ? 1 : 0;\n      }\n      const float sv",
                                  "        keep = 1;\n      }\n      const float sv"),
    "write-out tile read before all lanes stored it": (
        "        simdgroup_store(acc[rt][ct], o_s + sg * 64, 8);\n        simdgroup_barrier(mem_flags::mem_threadgroup);",
        "        simdgroup_store(acc[rt][ct], o_s + sg * 64, 8);"),
    "padding heads written": ("          if (h < H) {\n            pacc", "          if (h < H + 16) {\n            pacc"),
    "padding heads of q' left unwritten": ("    qrow[c] = 0.0f;\n  }\n  return true;", "  }\n  return true;"),
}


def _launched_text(variant: str) -> str:
    header, bodies = mla.read_kernel_sections("mla_decode", dispatch.METAL)
    attn = {"mma": "mla_attn_mma", "simt": "mla_attn", "wide": "mla_attn_wide"}[variant]
    return header + "".join(bodies[k] for k in ("mla_qabs", attn, "mla_out"))


@pytest.mark.parametrize("variant,defect", [("simt", d) for d in sorted(MLA_DEFECTS)]
                         + [("mma", d) for d in sorted(MMA_DEFECTS)])
def test_mla_planted_defect_is_caught(metal, variant, defect):
    good, bad = (MLA_DEFECTS if variant == "simt" else MMA_DEFECTS)[defect]
    assert _launched_text(variant).count(good) == 1, f"defect '{defect}' no longer plants"

    def planted(spec):
        spec.source = spec.source.replace(good, bad)
        spec.header = spec.header.replace(good, bad)
        return simulate(spec, simulator)

    # simt: two SIMD groups share each chunk; mma: 32 heads a block (two 16-head tiles x four
    # k-parts), two head blocks, the second with 24 padding heads, rope k-steps (rope 16) in
    # k-parts 0 and 1 (k-steps 8 and 9 of 10).
    # Rows scaled up mid-tile make the running max jump in many heads (the rescale paths run).
    H, rope = (8, 8) if variant == "simt" else (40, 16)
    spikes = None if variant == "simt" else ([p for p in range(70) if p % 20 in (9, 13, 18)], 6.0)
    args, _ = mla_inputs(H=H, rope=rope, T=70, masked=True, seed=6, spikes=spikes)
    with pytest.raises((AssertionError, simulator.SimulatorError)) as caught:
        out = mla.launch_specs(*args, tile=12 if variant == "simt" else 20, variant=variant, heads=32)(planted)
        assert_mla_close(out, *args)
    assert "failed to compile" not in str(caught.value)


JOINT_DEFECTS = {   # both variants, over a joint cache buffer
    "joint: rope key read from the row's start": ("joint ? R + rope : rope, joint ? R : 0}", "joint ? R + rope : rope, 0}"),
    "joint: latent rows at the latent's width": ("MlaCacheRows{joint ? R + rope : R,", "MlaCacheRows{R,"),
    "joint: rope rows at the rope key's width": ("joint ? R + rope : R, joint ? R + rope : rope,",
                                                 "joint ? R + rope : R, rope,"),
}


@pytest.mark.parametrize("variant,defect", [(v, d) for v in F32_VARIANTS for d in sorted(JOINT_DEFECTS)])
def test_mla_joint_cache_planted_defect_is_caught(metal, variant, defect):
    good, bad = JOINT_DEFECTS[defect]
    assert _launched_text(variant).count(good) == 1, f"defect '{defect}' no longer plants"

    def planted(spec):
        spec.source = spec.source.replace(good, bad)
        spec.header = spec.header.replace(good, bad)
        return simulate(spec, simulator)

    args, _ = mla_inputs(B=2, T=40, seed=8)
    with pytest.raises((AssertionError, simulator.SimulatorError)) as caught:
        out = mla.launch_specs(*joint_args(args), tile=16, variant=variant)(planted)
        assert_mla_close(out, *args)
    assert "failed to compile" not in str(caught.value)


# mla_attn_wide on Metal: chunks of 16 positions staged as 16-bit values (tile 32: two chunks a
# tile; 17 and 61 positions: a partial last chunk), both 16-bit dtypes, masks, DSA lists,
# batches of rows, padding heads with rope k-steps in two k-parts (H 40, rope 16, 32 heads a
# block), the joint cache; spikes make the running max jump mid-tile (the rescale runs).
WIDE_CASES = {
    "one position": dict(T=1, seed=61),
    "partial chunk, masked": dict(T=17, masked=True, seed=62),
    "spikes": dict(T=61, masked=True, seed=63, spikes=([9, 13, 30, 47], 6.0)),
    "batch, DSA list": dict(B=2, L=2, T=45, n_sel=20, seed=64),
    "padding heads, 32 a block": dict(H=40, rope=16, T=70, heads=32, seed=65, spikes=([29, 50], 6.0)),
    "joint cache": dict(B=2, T=40, joint=True, masked=True, seed=66),
}


@pytest.mark.parametrize("cache", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("case", sorted(WIDE_CASES))
def test_mla_wide(metal, case, cache):
    if cache == mx.bfloat16:
        pytest.importorskip("ml_dtypes", reason="the simulator takes bfloat16 inputs as ml_dtypes arrays")
    kw = dict(WIDE_CASES[case])
    run_mla(metal, variant="wide", tile=32, cache_dtype=cache, heads=kw.pop("heads", None),
            joint=kw.pop("joint", False), **kw)       # (run_mla checks that wide ran)


def test_mla_wide_fixed_capacity_buffer_with_step_params(metal):
    """The compiled decode step's launch over a 16-bit buffer: only ``length`` rows attended,
    the rows past it NaN (a chunk that staged and used one would show)."""
    args, _ = mla_inputs(T=96, seed=67, cache_dtype=mx.float16)
    q_nope, q_rope, latent, k_rope, kv_b, scale, _, nope, v = args
    for length in (5, 40):
        poison = (mx.arange(96) >= length)[None, :, None]
        joint = mx.where(poison, mx.nan, mx.concatenate([latent, k_rope], axis=-1)).astype(mx.float16)
        params = mla.step_params(kv_b, joint, q_nope.shape[1], nope, q_rope.shape[-1], v, q_nope.dtype, length,
                                 backend=dispatch.METAL, joint=True, variant="wide")
        out = kernels.mla_decode(q_nope, q_rope, joint, None, kv_b, scale, None, nope, v, params=params,
                                 variant="wide")
        assert metal[-2:] == ["mla_attn_wide", "mla_out"]
        assert_mla_close(out, q_nope, q_rope, latent[:, :length], k_rope[:, :length], kv_b, scale, None, nope, v,
                         label=f"length {length} of 96")


WIDE_DEFECTS = {
    "no rescale": ("simdgroup_multiply(acc[rt][ct], dt[rt], acc[rt][ct]);", ""),
    "chunk not transposed for the scores": ("RWS, true, lane);", "RWS, false, lane);"),
    "a k-part's partial scores dropped": ("for (int g = 0; g < KP; ++g) {\n          dot +=",
                                          "for (int g = 1; g < KP; ++g) {\n          dot +="),
    "the staged rows one SIMD group off": ("(sg * RPW + k) * RWS + col", "((sg + 1) % NSG * RPW + k) * RWS + col"),
    "the mask ignored": ("keep = has_mask == 2 ? t <= P - L + q % L : mask[size_t(q) * T + t] != 0;",
                         "keep = has_mask == 2 ? t <= P - L + q % L : mask[size_t(q) * T + t] != 2;"),
}


@pytest.mark.parametrize("defect", sorted(WIDE_DEFECTS))
def test_mla_wide_planted_defect_is_caught(metal, defect):
    good, bad = WIDE_DEFECTS[defect]
    assert _launched_text("wide").count(good) == 1, f"defect '{defect}' no longer plants"

    def planted(spec):
        spec.source = spec.source.replace(good, bad)
        return simulate(spec, simulator)

    args, _ = mla_inputs(H=40, rope=16, T=61, masked=True, seed=68, cache_dtype=mx.float16,
                         spikes=([9, 13, 30, 47], 6.0))
    with pytest.raises((AssertionError, simulator.SimulatorError)) as caught:
        out = mla.launch_specs(*args, tile=32, variant="wide", heads=32)(planted)
        assert_mla_close(out, *args)
    assert "failed to compile" not in str(caught.value)


def test_moe_bank_split_into_groups_below_32_bit_shapes(metal, monkeypatch):
    # Stacked buffers are capped (MLX shapes are 32-bit): past MAX_BANK_BYTES they hold uint32
    # words, 4x as many bytes; a layer above that becomes several groups of the same format,
    # each with its own lut, and the result is unchanged.
    experts = make_experts([4] * 5, D=64, inter=32, gs=32, seed=17)
    monkeypatch.setattr(moe, "MAX_BANK_BYTES", 1300)   # 1280 B a projection: 4 * 1300 B = two experts a group
    run_moe(experts, N=2, K=3, ids=[[0, 2, 4], [1, 2, 3]], seed=17)
    assert metal.count("moe_gate_up") == 3
    assert {g.gate_up.packed.dtype for g in moe.build_bank(experts).groups} == {mx.uint32}


def test_moe_bank_of_uint32_words_is_one_group(metal, monkeypatch):
    # 5 experts' 12800 B of gate+up past a 5000 B cap: one group of uint32 words, one launch each.
    experts = make_experts([4] * 5, D=64, inter=32, gs=32, seed=18)
    monkeypatch.setattr(moe, "MAX_BANK_BYTES", 5000)
    bank = moe.build_bank(experts)
    assert len(bank.groups) == 1
    assert bank.groups[0].gate_up.packed.dtype == mx.uint32 and bank.groups[0].down.packed.dtype == mx.uint32
    run_moe(experts, N=2, K=3, ids=[[0, 2, 4], [1, 2, 3]], seed=18)
    assert metal.count("moe_gate_up") == 1 and metal.count("moe_down") == 1


def test_moe_bank_bytes_not_whole_words_split_instead(metal, monkeypatch):
    # int8 rows of 33 bytes x 31 rows: 1023 B a projection, not whole uint32 words, so a layer
    # past the cap is split into uint8 groups as before.
    experts = make_experts([1] * 4, D=33, inter=31, seed=19)
    monkeypatch.setattr(moe, "MAX_BANK_BYTES", 2 * 2 * max(w.nbytes for w in experts[0]) + 10)   # two experts a group
    bank = moe.build_bank(experts)
    assert [g.gate_up.packed.dtype for g in bank.groups] == [mx.uint8, mx.uint8]
    run_moe(experts, N=2, K=3, ids=[[0, 1, 3], [2, 1, 0]], seed=19)
    assert metal.count("moe_gate_up") == 2


def test_repeated_launches_pass_the_same_source_objects():
    """Every decode step must hand MLX the cached kernel text: dispatch finds kernels by the
    identity of these strings, and a fresh copy per call would re-read the file and add an entry
    to its identity table on every step."""
    args, sel = mla_inputs()
    names = []

    def capture(spec):
        names.append((spec.name, spec.source, spec.header))
        return [mx.zeros(shape, dtype) for shape, dtype in zip(spec.output_shapes, spec.output_dtypes)]

    for variant in ("simt", "mma"):
        names.clear()
        for _ in range(2):
            mla.launch_specs(*args, selected=sel, backend=dispatch.METAL, variant=variant)(capture)
        first, second = names[:3], names[3:]
        assert [n for n, *_ in first] == [n for n, *_ in second]
        assert all(a[1] is b[1] and a[2] is b[2] for a, b in zip(first, second)), variant


# ---------------------------------------------------------------------------------------
# mla_rows: a decode row's q_a / latent norms and rope key, one launch


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("shape", [(48, 160, 16), (1536, 512, 64), (8, 8, 2)])
@pytest.mark.parametrize("position", [0, 7, 40000])
def test_mla_rows_matches_float64(metal, dtype, shape, position):
    QL, R, rope_w = shape
    y, qa_norm, kv_norm = rows_case(QL, R, rope_w, dtype, seed=QL + position)
    rope = rope_of(rope_w)
    got = kernels.mla_rows(y, QL, qa_norm, kv_norm, 1e-6, rope, mx.array(position, dtype=mx.int32))
    assert metal == ["mla_rows"]
    assert_rows_close(got, y, QL, qa_norm, kv_norm, 1e-6, rope, [position], label=f"{shape} {dtype} @{position}")
    # and the reference path (MLX ops) against the same oracle; MLX's CPU rope rounds its angles
    # another way (one ulp of a 40000 rad angle moves the key by ~4e-3 of its size)
    with dispatch.force_reference():
        want = kernels.mla_rows(y, QL, qa_norm, kv_norm, 1e-6, rope, mx.array(position, dtype=mx.int32))
    assert_rows_close(want, y, QL, qa_norm, kv_norm, 1e-6, rope, [position], label="reference", angle_ulps=2)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("slot", [0, 5, 9])
def test_mla_rows_into_writes_the_cache_row_in_place(metal, dtype, slot):
    from moe_mla_oracle import check_rows_into

    counters = check_rows_into((48, 160, 16), dtype, slot, 10, kernel_path=True)
    assert metal == ["mla_rows", "mla_rows_into"] and not counters["fallbacks"], (metal, counters)


def test_mla_rows_into_declines_visibly(metal):
    """A cache buffer of another dtype or row width: the row comes back for the caller to write."""
    y, qa_norm, kv_norm = rows_case(dtype=mx.float32)
    pos = mx.array(3, dtype=mx.int32)
    for cache in (mx.zeros((1, 8, 176), mx.float16), mx.zeros((1, 8, 170), mx.float32)):
        _, kv = kernels.mla_rows(y, 48, qa_norm, kv_norm, 1e-6, rope_of(16), pos, cache)
        assert kv is not None and kv.shape == (1, 176)
    fallbacks = kernels.counters()["fallbacks"]
    assert metal == ["mla_rows", "mla_rows"] and sum(fallbacks.values()) == 2, fallbacks
    assert all(k.startswith("mla_rows_into") and "expected [1, capacity, 176]" in k for k in fallbacks), fallbacks


def test_mla_rows_declines_visibly(metal):
    y, qa_norm, kv_norm = rows_case(dtype=mx.float32)
    pos = mx.array(3, dtype=mx.int32)
    kernels.mla_rows(y, 48, qa_norm, kv_norm, 1e-6, rope_of(16, factor=1.1), pos)
    kernels.mla_rows(y, 48, qa_norm.astype(mx.float16), kv_norm, 1e-6, rope_of(16), pos)
    fallbacks = kernels.counters()["fallbacks"]
    assert metal == [] and sum(fallbacks.values()) == 2, fallbacks
    assert any("attention factor 1.1" in k for k in fallbacks) and any("norm weights" in k for k in fallbacks)


def test_mla_rows_decode_step_in_the_model(metal, tmp_path):
    """A decode row of a tiny DeepSeek-V3 takes the fused launch in every layer (through the
    simulator, as on a Mac) and gives the reference path's logits."""
    from helpers_models import build_hf_model, save_checkpoint, state_dict_numpy, write_container
    from colibri_mlx.models.loading import load_model

    hf = build_hf_model("deepseek_v3", seed=2, first_k_dense_replace=3)
    path = save_checkpoint(hf, str(tmp_path / "hf"))
    write_container(state_dict_numpy(hf), path, str(tmp_path / "c"))
    model = load_model(tmp_path / "c", dtype="float32")
    prompt, token = mx.array([[5, 9, 17]]), mx.array([[4]])
    with dispatch.force_reference():
        cache = model.make_cache()
        model(prompt, cache)
        want = np.array(model(token, cache))
    cache = model.make_cache()
    model(prompt, cache)
    metal.clear()
    got = np.array(model(token, cache))
    assert metal.count("mla_rows") == len(model.layers), metal
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


ROWS_DEFECTS = {  # name: (text in mla_rows' body or mla_norm_rope_row, replacement)
    "rows read at the wrong stride": ("y + size_t(q) * params[3],", "y + size_t(q) * (params[3] - 1),"),
    "q_a normalized by the latent's sum": ("rsqrt(sq / float(QL)", "rsqrt(sl / float(QL)"),
    "eps dropped": (" + eps_l);", ");"),
    "sums read before every SIMD group wrote": (
        "    sums[NSG + sg] = sl;\n  }\n  threadgroup_barrier(mem_flags::mem_threadgroup);", "    sums[NSG + sg] = sl;\n  }"),
    "rotation the wrong way": ("x1 * cs - x2 * sn", "x1 * cs + x2 * sn"),
    "one position for every row": ("float(pos[q])", "float(pos[0])"),
}


@pytest.mark.parametrize("defect", sorted(ROWS_DEFECTS))
def test_mla_rows_planted_defect_is_caught(defect):
    good, bad = ROWS_DEFECTS[defect]
    # two rows at different positions; eps 0.5 (so a dropped eps shows); the large shape has
    # every SIMD group write a partial sum
    y, qa_norm, kv_norm = rows_case(1536, 512, 64, mx.float32, BL=2, seed=9)
    rope = rope_of(64)
    positions = mx.array([3, 901], dtype=mx.int32)
    spec = rows_spec(y, 1536, qa_norm, kv_norm, 0.5, rope.inv_freq, positions, dispatch.METAL)
    helper = spec.header[spec.header.index("inline void mla_norm_rope_row("):]
    helper = helper[:helper.index("\n}\n")]
    assert spec.source.count(good) + helper.count(good) == 1, f"defect '{defect}' no longer plants"
    assert_rows_close(simulate(spec, simulator), y, 1536, qa_norm, kv_norm, 0.5, rope, [3, 901], label="clean")
    spec.source = spec.source.replace(good, bad)
    spec.header = spec.header.replace(helper, helper.replace(good, bad))
    with pytest.raises((AssertionError, simulator.SimulatorError)) as caught:
        assert_rows_close(simulate(spec, simulator), y, 1536, qa_norm, kv_norm, 0.5, rope, [3, 901], label=defect)
    assert "failed to compile" not in str(caught.value)


# ---------------------------------------------------------------------------------------
# moe_down RES: the decoder layer's residual add in the down projection's write


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("fmts", [[4] * 5, [6] * 5, [4, 6, 2, 6, 5]], ids=["fmt4", "fmt6", "mixed"])
def test_moe_residual_is_the_separate_add(metal, monkeypatch, dtype, fmts):
    """moe_block(..., residual) is bit for bit ``residual + moe_block(...)``: in moe_down's write
    for a layer of one expert group (RES 1), a separate add for several groups."""
    D = 300 if 6 in fmts else 96
    experts = make_experts(fmts, D=D, inter=40, gs=32, seed=11)
    ids, w = routing(3, 3, len(experts), seed=4)
    x = x_of(3, D, dtype, seed=2)
    res = (x_of(3, D, seed=3) * 10).astype(dtype)
    plain = kernels.moe_block(x, experts, ids, w)
    specs = []
    monkeypatch.setattr(dispatch, "launch", lambda b, spec: specs.append(spec) or simulate(spec, simulator))
    got = kernels.moe_block(x, experts, ids, w, residual=res)
    assert np.array_equal(np.array(got.astype(mx.float32)), np.array((res + plain).astype(mx.float32)))
    res_flags = [dict(s.template)["RES"] for s in specs if s.name == "moe_down"]
    assert res_flags == ([1] if len(set(fmts)) == 1 else [0] * len(res_flags)), res_flags


@pytest.mark.parametrize("fmts", [[4] * 6, [6] * 6, [2, 4, 2, 4, 5, 1]], ids=["fmt4", "fmt6", "mixed"])
def test_moe_per_token_grid_is_each_token_alone(metal, monkeypatch, fmts):
    """S tokens as one grid of one-token launches (grid.y picks the token) give, bit for bit,
    each token's own one-token moe_block, with and without the residual (the write's row offset),
    over ragged, dropped, repeated and shared slots; and they are within the float64 bound."""
    D = 300 if 6 in fmts else 96
    experts = make_experts(fmts, D=D, inter=40, gs=32, seed=21)
    ids = mx.array(np.array([[0, 3, 5], [5, 5, 1], [2, -1, 4], [0, 3, 5]], np.int32))
    w = mx.array(np.random.default_rng(5).uniform(0.1, 1, (4, 3)).astype(np.float32))
    x, res = x_of(4, D, seed=6), x_of(4, D, seed=7) * 10
    specs = []
    monkeypatch.setattr(dispatch, "launch", lambda b, spec: specs.append(spec) or simulate(spec, simulator))
    grid = kernels.moe_block(x, experts, ids, w)
    grid_res = kernels.moe_block(x, experts, ids, w, residual=res)
    assert {s.grid[1] for s in specs if s.name == "moe_gate_up"} == {4 * 3}
    assert {s.grid[1] for s in specs if s.name == "moe_down"} == {4}
    assert_moe_close(grid, x, experts, ids, w, "per-token grid")
    for n in range(4):
        one = kernels.moe_block(x[n:n + 1], experts, ids[n:n + 1], w[n:n + 1])
        one_res = kernels.moe_block(x[n:n + 1], experts, ids[n:n + 1], w[n:n + 1], residual=res[n:n + 1])
        assert np.array_equal(np.array(grid[n]), np.array(one[0])), n
        assert np.array_equal(np.array(grid_res[n]), np.array(one_res[0])), n


def test_moe_per_token_planted_defects_are_caught(metal, monkeypatch):
    """Each token's offsets matter: a per-token grid reading token 0's x row, slots, gate
    weights or h rows, or writing every token's h / y into token 0's place, fails the oracle."""
    experts = make_experts([4] * 6, D=96, inter=40, gs=32, seed=22)
    ids, w = routing(3, 3, 6, seed=8)
    x = x_of(3, 96, seed=9)
    run_moe(experts, N=3, K=3, ids=np.array(ids), seed=8)
    defects = [("moe_gate_up", "const int xoff = tok * I;", "const int xoff = 0;"),
               ("moe_gate_up", "moe_slot_table(ids + slot0,", "moe_slot_table(ids,"),
               ("moe_gate_up", "h[size_t(slot0 + b) * hs + hi] = hv;", "h[size_t(b) * hs + hi] = hv;"),
               ("moe_down", "moe_slot_table(ids + slot0,", "moe_slot_table(ids,"),
               ("moe_down", "swt[b] = weights[slot0 + b];", "swt[b] = weights[b];"),
               ("moe_down", "ht = h + size_t(slot0) * hs;", "ht = h;"),
               ("moe_down", "const size_t at = size_t(tok) * O + row0 + r;", "const size_t at = row0 + r;")]
    for name, good, bad in defects:
        def planted(spec):
            if spec.name == name:
                assert spec.source.count(good) == 1, f"the defect {bad!r} no longer plants"
                spec.source = spec.source.replace(good, bad)
            return simulate(spec, simulator)

        monkeypatch.setattr(dispatch, "launch", lambda b, spec: planted(spec))
        with pytest.raises((AssertionError, simulator.SimulatorError)):   # wrong values or rows never written
            run_moe(experts, N=3, K=3, ids=np.array(ids), seed=8)


def test_moe_residual_planted_defect_is_caught(metal, monkeypatch):
    good, bad = "float(res[at])", "float(res[row0 + r])"
    experts = make_experts([4] * 5, D=96, inter=40, gs=32, seed=12)
    ids, w = routing(3, 3, 5, seed=6)
    x, res = x_of(3, 96, seed=2), x_of(3, 96, seed=3) * 10
    want = np.array(res + kernels.moe_block(x, experts, ids, w))

    def planted(spec):
        if spec.name == "moe_down":
            assert spec.source.count(good) == 1, "the defect no longer plants"
            spec.source = spec.source.replace(good, bad)
        return simulate(spec, simulator)

    monkeypatch.setattr(dispatch, "launch", lambda b, spec: planted(spec))
    assert not np.array_equal(np.array(kernels.moe_block(x, experts, ids, w, residual=res)), want)


# ---------------------------------------------------------------------------------------
# mla_qabs ROPEQ: q_rope rotated in mla_decode's first launch (one rope launch fewer a layer)


def host_rotated(q_rope, inv_freq, position):
    """q_rope [B, H, 1, rope] rotated by the float64 oracle, rounded to q's dtype."""
    out, _ = rotated_f64(np.asarray(q_rope.astype(mx.float32)).astype(np.float64), inv_freq, position)
    return mx.array(out.astype(np.float32)).astype(q_rope.dtype)


@VARIANTS
@pytest.mark.parametrize("position", [5, 40000])
def test_mla_q_rope_rotated_in_qabs(metal, variant, position):
    args, _ = mla_inputs(H=8, T=70, rope=16, seed=8)
    q_nope, q_rope, latent, k_rope, kv_b, scale, _, nope, v = args
    rope = rope_of(16)
    kernels.reset_counters()
    out = mla.mla_decode(q_nope, q_rope, latent, k_rope, kv_b, scale, None, nope, v, variant=variant,
                         rope=rope, rope_offset=mx.array(position, dtype=mx.int32))
    assert metal[0] == "mla_qabs" and not kernels.counters()["fallbacks"]
    assert_mla_close(out, q_nope, host_rotated(q_rope, rope.inv_freq, position), latent, k_rope, kv_b, scale,
                     None, nope, v, label=f"position {position}")


def test_mla_q_rope_declines_visibly(metal):
    args, _ = mla_inputs(H=4, T=30, rope=8, seed=9)
    rope = rope_of(8, factor=1.25)
    kernels.reset_counters()
    out = mla.mla_decode(*args, rope=rope, rope_offset=mx.array(3, dtype=mx.int32))
    fallbacks = kernels.counters()["fallbacks"]
    assert any("attention factor 1.25" in k for k in fallbacks), fallbacks
    q_nope, q_rope, latent, k_rope, kv_b, scale, _, nope, v = args
    rotated = rope.apply_fast(q_rope, mx.array(3, dtype=mx.int32))
    assert_mla_close(out, q_nope, rotated, latent, k_rope, kv_b, scale, None, nope, v)


@pytest.mark.parametrize("defect", ["rotated the wrong way", "unrotated", "position of row 0"])
def test_mla_q_rope_planted_defect_is_caught(metal, monkeypatch, defect):
    good, bad = {"rotated the wrong way": ("float(static_cast<TQ>(x1 * cs - x2 * sn))",
                                           "float(static_cast<TQ>(x1 * cs + x2 * sn))"),
                 "unrotated": ("  if (ROPEQ) {\n    const int half = width / 2;", "  if (false) {\n    const int half = width / 2;"),
                 "position of row 0": ("ROPEQ ? float(qpos[q]) : 0.0f", "ROPEQ ? float(qpos[0]) : 0.0f")}[defect]
    assert _launched_text("mma").count(good) == 1, f"defect '{defect}' no longer plants"

    def planted(spec):
        spec.source = spec.source.replace(good, bad)
        spec.header = spec.header.replace(good, bad)
        return simulate(spec, simulator)

    monkeypatch.setattr(dispatch, "launch", lambda b, spec: planted(spec))
    args, _ = mla_inputs(H=8, T=40, rope=16, seed=10, B=2)
    q_nope, q_rope, latent, k_rope, kv_b, scale, _, nope, v = args
    rope = rope_of(16)
    positions = mx.array([4, 77], dtype=mx.int32)
    run = mla.launch_specs(q_nope, q_rope, latent, k_rope, kv_b, scale, None, nope, v,
                           q_rotation=(rope.inv_freq, positions), backend=dispatch.METAL)
    rotated = mx.concatenate([host_rotated(q_rope[b:b + 1], rope.inv_freq, int(positions[b])) for b in range(2)])
    assert_mla_close(run(lambda spec: simulate(spec, simulator)), q_nope, rotated, latent, k_rope, kv_b, scale,
                     None, nope, v, label="clean")
    with pytest.raises((AssertionError, simulator.SimulatorError)) as caught:
        assert_mla_close(run(planted), q_nope, rotated, latent, k_rope, kv_b, scale, None, nope, v)
    assert "failed to compile" not in str(caught.value)


# ---------------------------------------------------------------------------------------
# mla_qb_qabs: the q_b projection folded into mla_qabs (one decode row)

EPS = {mx.float32: 2.0**-24, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}   # half an ulp, relative


def qb_case(H=4, nope=16, v=8, R=64, rope=8, q_lora=96, qfmt=4, dtype=mx.float32, seed=0):
    args, _ = mla_inputs(H=H, T=20, nope=nope, v=v, R=R, rope=rope, seed=seed)
    q_b = random_qtensor(qfmt, H * (nope + rope), q_lora, gs=32, seed=seed + 50)
    rng = np.random.default_rng(seed + 7)
    q_latent = mx.array(rng.standard_normal((1, 1, q_lora)).astype(np.float32)).astype(dtype)
    return args, q_b, q_latent


def qb_qabs_launch(args, q_b, q_latent, rotation=None, setting=None):
    """The first launch mla_decode makes for (q_latent, q_b), and the launches' count."""
    _, _, latent, k_rope, kv_b, scale, _, nope, v = args
    specs = mla.planned_launches(mla.launch_specs(None, None, latent, k_rope, kv_b, scale, None, nope, v,
                                                  q_proj=(q_latent, q_b), q_rotation=rotation, qb=setting))
    return specs[0], len(specs)


def qb_qabs_oracle(args, q_b, q_latent, rotation=None):
    """(q' | q_rope rows [H, R + rope] in float64, error bound): q = q_b . q_latent rounded to
    q's dtype (the GEMV's write), q' = W_UK^h^T q_nope, q_rope rotated at the position."""
    *_, kv_b, _, _, nope, v = args
    eps = EPS[q_latent.dtype]
    x = np.asarray(q_latent.astype(mx.float32)).astype(np.float64).reshape(-1)
    wq = weight_f64(q_b)
    H = wq.shape[0] // (nope + args[1].shape[-1])
    q64, dq = wq @ x, REL * (np.abs(wq) @ np.abs(x))
    dq = dq + eps * (np.abs(q64) + dq)                        # the float32 dot, then its rounding
    qn, dqn = q64[: H * nope].reshape(H, nope), dq[: H * nope].reshape(H, nope)
    qr, dqr = q64[H * nope:].reshape(H, -1), dq[H * nope:].reshape(H, -1)
    w = weight_f64(kv_b).reshape(H, nope + v, -1)[:, :nope]   # W_UK [H, nope, R]
    qa = np.einsum("hn,hnr->hr", qn, w)
    dqa = np.einsum("hn,hnr->hr", dqn + REL * np.abs(qn), np.abs(w))
    if rotation is not None:
        qr, _ = rotated_f64(qr, np.asarray(rotation[0]), int(rotation[1][0]))
        half = qr.shape[-1] // 2
        spread = np.concatenate([dqr[:, :half] + dqr[:, half:]] * 2, axis=-1)
        dqr = spread + (eps + REL) * np.abs(qr) + REL * np.concatenate([np.abs(qr[:, :half]) + np.abs(qr[:, half:])] * 2, -1)
    return np.concatenate([qa, qr], axis=-1), np.concatenate([dqa, dqr], axis=-1)


@pytest.mark.parametrize("qfmt,dtype", [(4, mx.float32), (1, mx.float32), (2, mx.bfloat16), (3, mx.float16),
                                        (5, mx.float32), (4, mx.bfloat16)])
@pytest.mark.parametrize("rotate", [False, True])
def test_mla_qb_qabs_matches_float64(metal, qfmt, dtype, rotate):
    """mla_qb_qabs' raw output (q' | q_rope a head, before any softmax) against float64: the
    head's q_b rows in the model's [H x nope | H x rope] order, each rounded as the GEMV writes
    it; padding heads (the mma variant's Hp) zero."""
    args, q_b, q_latent = qb_case(qfmt=qfmt, dtype=dtype, seed=qfmt)
    rotation = (rope_of(8).inv_freq, mx.array([41], dtype=mx.int32)) if rotate else None
    spec, n = qb_qabs_launch(args, q_b, q_latent, rotation)
    assert spec.name == "mla_qb_qabs" and n == 3
    (got,) = simulate(spec, simulator)
    got = np.asarray(got)[0]
    assert_qb_qabs_close(got, args, q_b, q_latent, rotation)


def assert_qb_qabs_close(got, args, q_b, q_latent, rotation=None):
    """Within the float64 bound, q_rope (written as its rounded q values) representable in q's
    dtype, padding heads zero."""
    want, bound = qb_qabs_oracle(args, q_b, q_latent, rotation)
    H, R = want.shape[0], args[2].shape[-1]
    err = np.abs(got[:H] - want)
    assert np.all(err <= bound), f"worst excess {np.max(err - bound)} at {np.unravel_index(np.argmax(err - bound), err.shape)}"
    rope = got[:H, R:]
    assert np.array_equal(np.asarray(mx.array(rope).astype(q_latent.dtype).astype(mx.float32)), rope), \
        "q_rope not rounded to q's dtype"
    assert np.all(got[H:] == 0.0), "padding heads not zero"


@pytest.mark.parametrize("setting", ["16:4", "16:2", "4:8", "8:3"])
def test_mla_qb_qabs_settings(metal, setting):
    """Other SIMD groups a head and q_b rows a pass (mla.qb_setting): 24 rows of a head over
    16 x 4 (CUDA's default), 16 x 2, 4 x 8 and 8 x 3 (passes that end mid-head)."""
    args, q_b, q_latent = qb_case(qfmt=4, dtype=mx.bfloat16, seed=9, q_lora=1088)
    spec, _ = qb_qabs_launch(args, q_b, q_latent, setting=setting)
    assert spec.threadgroup[0] == 32 * int(setting.split(":")[0])
    (got,) = simulate(spec, simulator)
    assert_qb_qabs_close(np.asarray(got)[0], args, q_b, q_latent)
    with pytest.raises(ValueError, match="SIMD groups"):
        mla.qb_setting("3:4")
    assert mla.qb_setting(backend=dispatch.CUDA) == (16, 4) and mla.qb_setting(backend=dispatch.METAL) == (8, 8)


@pytest.mark.parametrize("variant", F32_VARIANTS)
def test_mla_decode_with_q_proj_equals_projected_queries(metal, variant):
    """mla_decode given (q_latent, q_b): one launch fewer (no q_b GEMV), and the attention output
    as mla_decode's on the GEMV's queries (float32: the same q to the oracle's bound)."""
    args, q_b, q_latent = qb_case(H=8, R=64, seed=3)
    _, _, latent, k_rope, kv_b, scale, _, nope, v = args
    kernels.reset_counters()
    out = mla.mla_decode(None, None, latent, k_rope, kv_b, scale, None, nope, v, variant=variant,
                         q_proj=(q_latent, q_b))
    assert metal[0] == "mla_qb_qabs" and not kernels.counters()["fallbacks"], (metal, kernels.counters())
    with kernels.force_reference():
        q_nope, q_rope = mla.project_queries(q_latent, q_b, 8, nope)
    assert_mla_close(out, q_nope, q_rope, latent, k_rope, kv_b, scale, None, nope, v, extra_rel=1e-4)


def test_mla_qb_qabs_declines_visibly(metal):
    """q_b in fmt 6 (its input is rotated first) or more query rows than a verify step's: q_b's
    GEMV and mla_qabs run, counted under the reason."""
    args, q_b6, q_latent = qb_case(qfmt=6, q_lora=256, seed=4)
    _, _, latent, k_rope, kv_b, scale, _, nope, v = args
    kernels.reset_counters()
    mla.mla_decode(None, None, latent, k_rope, kv_b, scale, None, nope, v, q_proj=(q_latent, q_b6))
    assert any("q_b fmt 6" in k for k in kernels.counters()["fallbacks"]), kernels.counters()
    args, q_b, _ = qb_case(seed=5)
    nine = mx.zeros((1, 9, 96), mx.float32)
    assert "9 query rows" in mla.qb_decline_reason(nine, q_b, 4, 16)


MLA_QB_DEFECTS = {
    "rope rows of head 0": ("rows[r] = n < nope ? h * nope + n : H * nope + h * rope + (n - nope);",
                            "rows[r] = n < nope ? h * nope + n : H * nope + (n - nope);"),
    "no rounding to q's dtype": ("qsh[r0 + r] = float(static_cast<TQ>(t * qd_row_scale<FMT>(sqb, rows[r])));",
                                 "qsh[r0 + r] = t * qd_row_scale<FMT>(sqb, rows[r]);"),
    "barrier before q' missing": ("qsh, sg, lane);\n  threadgroup_barrier(mem_flags::mem_threadgroup);",
                                  "qsh, sg, lane);"),
    "last lane unit skipped": ("const int u = lane + 32 * j;\n      if (u < n_units) {\n        for (int r = 0; r < QR; ++r) {",
                               "const int u = lane + 32 * j;\n      if (u + 1 < n_units) {\n        for (int r = 0; r < QR; ++r) {"),
}


@pytest.mark.parametrize("defect", sorted(MLA_QB_DEFECTS))
def test_mla_qb_qabs_planted_defect_is_caught(metal, defect):
    good, bad = MLA_QB_DEFECTS[defect]
    dtype = mx.bfloat16 if "rounding" in defect else mx.float32
    args, q_b, q_latent = qb_case(qfmt=4, dtype=dtype, seed=6, q_lora=1088)   # 34 units: lanes 0-1 take two
    spec, _ = qb_qabs_launch(args, q_b, q_latent)
    assert (spec.header + spec.source).count(good) == 1, f"defect '{defect}' no longer plants"
    (got,) = simulate(spec, simulator)
    assert_qb_qabs_close(np.asarray(got)[0], args, q_b, q_latent)
    spec.source, spec.header = spec.source.replace(good, bad), spec.header.replace(good, bad)
    with pytest.raises((AssertionError, simulator.SimulatorError)) as caught:
        (got,) = simulate(spec, simulator)
        assert_qb_qabs_close(np.asarray(got)[0], args, q_b, q_latent)
    assert "failed to compile" not in str(caught.value)


# ---------------------------------------------------------------------------------------
# Causal rows of one sequence (a speculative verify step): params' has_mask 2, no mask input


def causal_mask_np(L: int, T: int) -> mx.array:
    """The oracle's mask: row l of the last L of T positions sees t <= T - L + l."""
    return mx.array(np.arange(T)[None, :] <= (T - L + np.arange(L))[:, None])[None, None]


@pytest.mark.parametrize("variant, cache_dtype", [("mma", mx.float32), ("simt", mx.float32),
                                                  ("wide", mx.bfloat16)])
@pytest.mark.parametrize("L", [2, 8])
def test_mla_causal_rows_equal_the_masked_oracle(metal, variant, cache_dtype, L):
    """L query rows of one sequence, causal from params alone (the kernel reads no mask), q_rope
    rotated in mla_qabs at each row's position: the float64 oracle with the explicit mask."""
    args, _ = mla_inputs(H=8, L=L, T=45, rope=16, seed=70 + L, cache_dtype=cache_dtype)
    q_nope, q_rope, latent, k_rope, kv_b, scale, _, nope, v = args
    T = latent.shape[1]
    rope = rope_of(16)
    positions = mx.arange(T - L, T, dtype=mx.int32)
    kernels.reset_counters()
    out = mla.mla_decode(q_nope, q_rope, latent, k_rope, kv_b, scale, None, nope, v, variant=variant,
                         rope=rope, rope_offset=positions, causal=True)
    assert out.shape == (1, L, 8 * v)
    assert not kernels.counters()["fallbacks"] and metal[0] == "mla_qabs", (metal, kernels.counters())
    rotated = mx.concatenate([host_rotated(q_rope[:, :, l:l + 1], rope.inv_freq, T - L + l) for l in range(L)],
                             axis=2)
    got = out.reshape(1, L, 8, v).transpose(0, 2, 1, 3)
    assert_mla_close(got, q_nope, rotated, latent, k_rope, kv_b, scale, causal_mask_np(L, T), nope, v,
                     label=f"{variant} L={L}")


@pytest.mark.parametrize("L", [1, 4])
def test_mla_causal_rows_with_q_proj(metal, L):
    """The verify step's queries: mla_qb_qabs projects every row of q_latent [1, L, q_lora]."""
    args, q_b, _ = qb_case(H=8, R=64, seed=12)
    _, _, latent, k_rope, kv_b, scale, _, nope, v = args
    T = latent.shape[1]
    q_latent = mx.array(np.random.default_rng(3).standard_normal((1, L, 96)).astype(np.float32))
    kernels.reset_counters()
    out = mla.mla_decode(None, None, latent, k_rope, kv_b, scale, None, nope, v, q_proj=(q_latent, q_b),
                         causal=True)
    assert metal[0] == "mla_qb_qabs" and not kernels.counters()["fallbacks"], (metal, kernels.counters())
    with kernels.force_reference():
        q_nope, q_rope = mla.project_queries(q_latent, q_b, 8, nope, L)
    got = out.reshape(1, L, 8, v).transpose(0, 2, 1, 3)
    assert_mla_close(got, q_nope, q_rope, latent, k_rope, kv_b, scale, causal_mask_np(L, T), nope, v,
                     extra_rel=1e-4)


@pytest.mark.parametrize("variant", ["mma", "simt", "wide"])
def test_mla_causal_planted_defect_is_caught(metal, monkeypatch, variant):
    """A row that sees one position too many (its own draft's successor) is caught."""
    good = "t <= P - L + q % L"
    bad = "t <= P - L + q % L + 1"
    header, bodies = mla.read_kernel_sections("mla_decode", dispatch.METAL)
    attn = {"mma": "mla_attn_mma", "simt": "mla_attn", "wide": "mla_attn_wide"}[variant]
    assert (header + bodies[attn]).count(good) == 1, "defect no longer plants"

    def planted(spec):
        spec.source = spec.source.replace(good, bad)
        return simulate(spec, simulator)

    cache_dtype = mx.bfloat16 if variant == "wide" else mx.float32
    args, _ = mla_inputs(H=8, L=3, T=30, rope=16, seed=80, cache_dtype=cache_dtype)
    q_nope, q_rope, latent, k_rope, kv_b, scale, _, nope, v = args
    run = mla.launch_specs(q_nope, q_rope, latent, k_rope, kv_b, scale, None, nope, v, backend=dispatch.METAL,
                           variant=variant, causal=True)
    mask = causal_mask_np(3, 30)
    clean = run(lambda spec: simulate(spec, simulator)).reshape(1, 3, 8, v).transpose(0, 2, 1, 3)
    assert_mla_close(clean, q_nope, q_rope, latent, k_rope, kv_b, scale, mask, nope, v, label="clean")
    with pytest.raises((AssertionError, simulator.SimulatorError)) as caught:
        out = run(planted).reshape(1, 3, 8, v).transpose(0, 2, 1, 3)
        assert_mla_close(out, q_nope, q_rope, latent, k_rope, kv_b, scale, mask, nope, v)
    assert "failed to compile" not in str(caught.value)

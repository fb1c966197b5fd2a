"""The qgemv Metal kernel in the MSL simulator: the exact source and launch MLX would get
(``qgemv.launch_spec``), outputs poisoned first (the simulator NaN-fills them and fails on any
element left unwritten), compared with the float64 oracle; then planted defects that must fail.

Split-K launches (several SIMD groups per threadgroup) reduce through threadgroup memory; the
simulator runs every launch in two thread orders and requires bit-identical outputs, and a
planted missing barrier must fail.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx.formats import GS_CANDIDATES
from colibri_mlx.kernels import qgemv
from colibri_mlx.kernels.kernel_text import launch_text
from kernel_oracle import assert_close, random_qtensor, random_x

simulator = pytest.importorskip("msl.simulator")
if simulator.unavailable_reason():
    pytest.skip(f"MSL simulator: {simulator.unavailable_reason()}", allow_module_level=True)

_NP = {mx.float32: np.float32, mx.float16: np.float16, mx.uint8: np.uint8,
       mx.int32: np.int32, mx.uint32: np.uint32}


def _np_dtype(d):
    return simulator.BFLOAT16 if d == mx.bfloat16 else _NP[d]


def _np_input(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        import ml_dtypes

        return np.asarray(a.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.asarray(a)


def _bf16_bits_to_f32(a: np.ndarray) -> np.ndarray:
    return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def simulate(spec, source=None) -> mx.array:
    """Run a LaunchSpec through the simulator; returns y as an mx.array of the spec's dtype."""
    out_dtype = spec.output_dtypes[0]
    header, source = launch_text(spec.header, source or spec.source, spec.name)   # the text MLX would be given
    (y,) = simulator.run_metal_kernel(
        spec.name, spec.input_names, spec.output_names, source, header,
        inputs=[_np_input(a) for a in spec.inputs], output_shapes=spec.output_shapes,
        output_dtypes=[_np_dtype(out_dtype)], grid=spec.grid, threadgroup=spec.threadgroup,
        template=[(n, _np_dtype(v) if isinstance(v, mx.Dtype) else v) for n, v in spec.template],
        init_value=spec.init_value)
    if out_dtype == mx.bfloat16:
        return mx.array(_bf16_bits_to_f32(np.asarray(y))).astype(mx.bfloat16)
    return mx.array(np.asarray(y))


def run_case(fmt, O, I, S, gs=None, dtype=mx.float32, seed=0, nib=None):
    if dtype == mx.bfloat16:
        pytest.importorskip("ml_dtypes", reason="the simulator takes bfloat16 inputs as ml_dtypes arrays")
    qt = random_qtensor(fmt, O, I, gs=gs, seed=seed)
    x = random_x(S, I, dtype=dtype, seed=seed + 1)
    y = simulate(qgemv.launch_spec(x, qt, nib=nib))
    assert y.dtype == dtype and y.shape == (S, O)
    return assert_close(y, x, qt, f"fmt {fmt} {O}x{I} S={S} gs={gs} {dtype} nib={nib}")


# The fmt 2/4 decode variants (template NIB): 0 magic-number codes, 1 fp16-subnormal codes with
# one -8 * sum(x) per segment. Both are launched by some backend's default (qgemv.DEFAULT_NIB).
NIBS = [0, 1]


# Odd I (odd nibble count: byte-load path), aligned I, partial fmt 5 groups / fmt 6 blocks,
# and a row long enough that each lane takes several UNROLL rounds.
SHAPES = [(5, 37), (3, 256), (6, 300), (2, 4100)]


@pytest.mark.parametrize("fmt", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("O,I", SHAPES)
def test_every_fmt_and_shape(fmt, O, I):
    run_case(fmt, O, I, S=1 + (O * I) % 8, gs=32, seed=fmt + I)


@pytest.mark.parametrize("fmt", [2, 4])
@pytest.mark.parametrize("O,I", SHAPES + [(3, 64), (4, 96)])
def test_nib_decode_every_shape(fmt, O, I):
    # (3, 64) / (4, 96): rows of whole units only (every unit takes the unguarded x path).
    for nib in NIBS:
        run_case(fmt, O, I, S=1 + (O * I + nib) % 8, gs=32, seed=fmt + I + nib, nib=nib)


@pytest.mark.parametrize("nib", NIBS)
@pytest.mark.parametrize("S", range(1, 9))
def test_every_S(S, nib):
    run_case(4 if S % 2 else 2, 7, 200, S=S, gs=64, seed=S, nib=nib)


@pytest.mark.parametrize("nib", NIBS)
@pytest.mark.parametrize("gs", GS_CANDIDATES)
def test_fmt4_every_group_size(gs, nib):
    run_case(4, 4, 520, S=2, gs=gs, seed=gs, nib=nib)      # 520 = partial last group for most gs
    run_case(4, 3, 2 * gs + 1, S=1, gs=gs, seed=gs + 1, nib=nib)  # odd I: unaligned rows


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("fmt,nib", [(4, 0), (4, 1), (2, 1), (6, None)])
def test_low_precision_x(fmt, nib, dtype):
    run_case(fmt, 5, 300, S=3, gs=48, dtype=dtype, seed=fmt, nib=nib)  # 600-byte rows of x: scalar loads
    run_case(fmt, 5, 512, S=2, gs=32, dtype=dtype, seed=fmt, nib=nib)  # 16-byte aligned: vector loads


# Rows per threadgroup (O not a multiple: clamped rows), split-K SIMD groups, unroll depth, and
# rows a multiple of 8 but not 16 bytes (VEC=1: the last unit's second half lies past the row).
# PF 1: prefetching launches (odd and even step counts per lane, a step past the row's end).
LAUNCHES = [dict(rows=1, simdgroups=1, unroll=1), dict(rows=2, simdgroups=2, unroll=3),
            dict(rows=4, simdgroups=4, unroll=2), dict(rows=8, simdgroups=1, unroll=1),
            dict(rows=3, simdgroups=2, unroll=1), dict(rows=4, simdgroups=1, unroll=1, prefetch=1),
            dict(rows=2, simdgroups=2, unroll=2, prefetch=1),
            # PERS 1: 2 / 3 threadgroups looping over the 4 / 7 row blocks (NW 2: the barrier
            # between row blocks that reuse the partials' memory).
            dict(rows=2, simdgroups=1, unroll=1, prefetch=1, persistent=2),
            dict(rows=1, simdgroups=2, unroll=1, persistent=3)]


@pytest.mark.parametrize("launch", LAUNCHES,
                         ids=lambda d: "R{rows}NW{simdgroups}U{unroll}".format(**d) + f"PF{d.get('prefetch', 0)}"
                         + (f"P{d['persistent']}" if "persistent" in d else ""))
@pytest.mark.parametrize("fmt,I", [(1, 264), (2, 272), (3, 352), (4, 2080), (5, 300), (6, 520)])
def test_launch_variants(fmt, I, launch):
    S = 32 // launch["rows"] if launch["rows"] > 4 else 3
    qt = random_qtensor(fmt, 7, I, gs=48, seed=fmt + I)
    x = random_x(min(S, 4), I, seed=fmt)
    for nib in (NIBS if fmt in (2, 4) else [None]):
        y = simulate(qgemv.launch_spec(x, qt, nib=nib, **launch))
        assert_close(y, x, qt, f"fmt {fmt} 7x{I} {launch} nib={nib}")


@pytest.mark.parametrize("fmt", [2, 4, 6])
def test_persistent_grid_gives_the_same_bits(fmt):
    """A row block's sums do not depend on which threadgroup computes it, or after which."""
    qt = random_qtensor(fmt, 37, 520, gs=64, seed=fmt)
    x = random_x(1, 520, seed=fmt + 1)
    one_each = qgemv.launch_spec(x, qt, rows=4, simdgroups=1, prefetch=1, persistent=0)
    looping = qgemv.launch_spec(x, qt, rows=4, simdgroups=1, prefetch=1, persistent=3)
    assert dict(looping.template)["PERS"] == 1 and looping.grid[0] == 3 * 32
    assert dict(one_each.template)["PERS"] == 0 and one_each.grid[0] == 10 * 32
    np.testing.assert_array_equal(np.asarray(simulate(looping)), np.asarray(simulate(one_each)))


def test_cuda_persistent_grid_default():
    """CUDA's default: a persistent grid for one row of x, fmt 2/4, one SIMD group, past one and
    up to three waves of row blocks, with CUDA_PERSISTENT_ROWS rows a block and every block
    as many row blocks; Metal keeps one threadgroup a row block."""
    from colibri_mlx.kernels import dispatch

    def grid(fmt, O, I, S=1, backend=dispatch.CUDA):
        spec = qgemv.launch_spec(mx.zeros((S, I), mx.bfloat16), random_qtensor(fmt, O, I, gs=64, seed=1), backend)
        t = dict(spec.template)
        return t["PERS"], t["ROWS"], spec.grid[0] // spec.threadgroup[0]

    rows = qgemv.CUDA_PERSISTENT_ROWS
    assert grid(4, 18432, 4096) == (1, rows, 1536)     # 3072 row blocks, two rounds of 1536
    # The wide default compiles the shape in (CUDA's template only), other launches read params.
    qt = random_qtensor(4, 18432, 4096, gs=64, seed=1)
    x = mx.zeros((1, 4096), mx.bfloat16)
    t = dict(qgemv.launch_spec(x, qt, dispatch.CUDA).template)
    assert [t[k] for k in ("KO", "KI", "KRB", "KNG", "KNU")] == [*qgemv.shape_values(qt)] == [18432, 4096, 2048, 64, 128]
    t = dict(qgemv.launch_spec(x, qt, dispatch.CUDA, shape_in=False).template)
    assert t["KO"] == 0 and t["ROWS"] == rows
    assert dict(qgemv.launch_spec(x, qt, dispatch.CUDA, rows=4).template)["KO"] == 0
    assert "KO" not in dict(qgemv.launch_spec(x, qt, dispatch.METAL).template)
    assert grid(2, 18432, 4096) == (1, rows, 1536)
    assert grid(4, 24576, 4096) == (1, rows, 1366)     # 4096 row blocks, three rounds (the last one short)
    assert grid(4, 24576, 1536) == (1, 4, 2048)        # short rows keep 4 a block: 6144 in 3 rounds
    assert grid(4, 18432, 256, backend=dispatch.METAL) == (0, 4, 18432 // 4)
    assert grid(4, 18432, 256, S=2) == (0, 4, 18432 // 4)
    assert grid(6, 18432, 256) == (0, 4, 18432 // 4)
    assert grid(4, 4 * qgemv.CUDA_PERSISTENT_BLOCKS, 256) == (0, 4, qgemv.CUDA_PERSISTENT_BLOCKS)   # one wave
    waves = qgemv.CUDA_PERSISTENT_MAX_WAVES
    assert grid(4, 4 * waves * qgemv.CUDA_PERSISTENT_BLOCKS + 4, 256)[0] == 0                       # past the limit
    # Rows asked for keep their row blocks: the grid is balanced over them.
    spec = qgemv.launch_spec(mx.zeros((1, 256), mx.bfloat16), random_qtensor(4, 18432, 256, gs=64, seed=1),
                             dispatch.CUDA, rows=4)
    assert dict(spec.template)["ROWS"] == 4 and spec.grid[0] // spec.threadgroup[0] == 1536   # 4608 in 3 rounds


def test_balanced_blocks():
    from colibri_mlx.kernels import dispatch

    assert dispatch.balanced_blocks(4608, 2112) == 1536
    assert dispatch.balanced_blocks(1792, 924) == 896
    assert dispatch.balanced_blocks(1024, 264) == 256
    assert dispatch.balanced_blocks(100, 2112) == 100
    for n, cap in ((4097, 2112), (7, 3), (1, 1)):
        b = dispatch.balanced_blocks(n, cap)
        rounds = -(-n // cap)
        assert b <= cap and -(-n // b) == rounds


def test_tiny_inputs_are_padded_into_device_space():
    # O * rb < 8 bytes and S * I < 8 elements: the launch pads inputs to 8 elements.
    run_case(2, 1, 3, S=1, seed=3)


# ---------------------------------------------------------------------------------------
# Planted defects: each must make the comparison fail.

# (fmt, good, bad[, launch tuning]); the default launch for 4x300 is one SIMD group per
# threadgroup, so the split-K defects ask for several.
SPLIT_K = {"simdgroups": 4, "rows": 2}
PERSISTENT = {"simdgroups": 2, "rows": 1, "persistent": 2}
NIB0 = {"nib": 0}
# Rows of 2080 weights: 65 fmt 4 units, so each lane runs 2-3 prefetch steps.
PREFETCH = {"prefetch": 1, "rows": 2, "simdgroups": 1, "unroll": 1, "I": 2080}
NIB1 = {"nib": 1}
DEFECTS = {
    "swapped nibbles": (2, "q[0] = n04.x; q[1] = n15.x;", "q[0] = n15.x; q[1] = n04.x;", NIB0),
    "high nibble offset off by one": (4, "half2(half(-72.0f))", "half2(half(-71.0f))", NIB0),
    "nib: swapped nibbles": (2, "q[0] = f04.x; q[1] = f15.x;", "q[0] = f15.x; q[1] = f04.x;", NIB1),
    "nib: odd weights not divided by 16": (4, "fma(hi[r][s], 1048576.0f,", "fma(hi[r][s], 16777216.0f,", NIB1),
    "nib: code bias off by one": (4, "float bi = -8.0f;", "float bi = -7.0f;", NIB1),
    "nib: one x of eight left out of sum x": (2, "((xf[4] + xf[5]) + (xf[6] + xf[7]))", "((xf[4] + xf[5]) + xf[6])", NIB1),
    "unguarded x path for a partial unit": (4, "if (XV && FULL_UNITS && qd_wpu(FMT) * (u + 1) <= I) {", "if (XV && FULL_UNITS && qd_wpu(FMT) * u < I) {", NIB1),
    "hoisted scale of the wrong row": (4, "? qd_seg_scale<FMT, GS>(scales, rows[r], ng, u, g, raw[j][r])", "? qd_seg_scale<FMT, GS>(scales, rows[0], ng, u, g, raw[j][r])", NIB1),
    "group index off by one": (4, "(32 * u + qd_seg(FMT, GS) * g) / GS", "(32 * u + qd_seg(FMT, GS) * g + 16) / GS"),
    "fmt 6 parity sign dropped": (6, "((popcount(seven) & 1u) << 7)", "0u"),
    "fmt 5 high plane offset": (5, "r[4 + (i >> 5)]", "r[3 + (i >> 5)]"),
    "last unit of a row skipped": (1, "} else if (u < n_units) {\nqg_unit", "} else if (u + 1 < n_units) {\nqg_unit"),
    "int8 read unsigned": (1, "& 0xFFu) ^ 0x80u, 8388736.0f)", "& 0xFFu), 8388608.0f)"),
    "vector x loads out of order": (4, "const uint v[8] = {w[0].x, w[0].y,", "const uint v[8] = {w[0].y, w[0].x,"),
    "rows of a threadgroup shifted": (3, "rows[r] = min(row0 + r, O - 1);", "rows[r] = min(row0 + r + 1, O - 1);"),
    "split-K partial sums overwritten": (2, "v += red[(k * ROWS + r) * S + s];", "v = red[(k * ROWS + r) * S + s];", SPLIT_K),
    "split-K barrier missing": (4, "threadgroup_barrier(mem_flags::mem_threadgroup);\n}\nif (tid < ROWS * S)",
                                "}\nif (tid < ROWS * S)", SPLIT_K),
    # (The barrier between a persistent grid's row blocks is not planted here: in both of the
    # simulator's schedules SIMD group 1 yields at its SIMD sums before it writes the partials
    # SIMD group 0 still reads, so that race stays hidden; moe_down's is caught.)
    "persistent grid: row blocks skipped": (4, "blk += blk_step", "blk += 2 * blk_step", PERSISTENT),
    "prefetch: second buffer's step skipped": (2, "base + STEP, raw_b, sc_b, acc);", "base + 2 * STEP, raw_b, sc_b, acc);", PREFETCH),
    "prefetch: loop stops after the first buffer": (4, "if (base + STEP >= n_units) {", "if (base + STEP >= 0) {", PREFETCH),
    "prefetch: next step loaded into the live buffer": (4, "base + 2 * STEP, raw_a, sc_a);", "base + 2 * STEP, raw_b, sc_b);", PREFETCH),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_planted_defect_is_caught(defect):
    fmt, good, bad, *tuning = DEFECTS[defect]
    tuning = dict(tuning[0]) if tuning else {}
    I = tuning.pop("I", 300)
    qt = random_qtensor(fmt, 4, I, gs=16, seed=7)
    x = random_x(2, I, seed=8)
    spec = qgemv.launch_spec(x, qt, **tuning)
    text = spec.header + spec.source
    assert text.count(good) == 1, f"defect '{defect}' no longer plants: {good!r} not found once"
    if good in spec.source:
        spec.source = spec.source.replace(good, bad)
    else:
        spec.header = spec.header.replace(good, bad)
    # Caught = a wrong result or a fault the simulator traps (an out-of-bounds read, a result
    # that depends on the thread schedule); a compile error would prove nothing about the test.
    with pytest.raises((AssertionError, simulator.SimulatorError)) as caught:
        y = simulate(spec)
        assert_close(y, x, qt, defect)
    assert "failed to compile" not in str(caught.value)


def test_stacked_rows_give_the_separate_launches_bits():
    """kernels.concat_rows (q_a + kv_a in one launch): each output row is computed on its own,
    so the stacked launch equals the two separate ones bit for bit (same SIMD groups per row)."""
    from colibri_mlx import kernels

    a, b = random_qtensor(4, 24, 512, gs=32, seed=1), random_qtensor(4, 9, 512, gs=32, seed=2)
    fused = kernels.concat_rows([a, b])
    x = random_x(1, 512, seed=3)
    y = np.asarray(simulate(qgemv.launch_spec(x, fused, simdgroups=2)))
    np.testing.assert_array_equal(y[:, :24], np.asarray(simulate(qgemv.launch_spec(x, a, simdgroups=2))))
    np.testing.assert_array_equal(y[:, 24:], np.asarray(simulate(qgemv.launch_spec(x, b, simdgroups=2))))
    assert_close(mx.array(y), x, fused, "stacked")


# ---------------------------------------------------------------------------------------
# The launch CUDA gets by default (qgemv.DEFAULT_NIB, default_prefetch for dispatch.CUDA), run
# through the Metal source: the twin is the same algorithm, so this proves the GPU defaults on
# odd I, partial groups, every gs and S = 1..8 before the one GPU run.


@pytest.fixture
def cuda_defaults(monkeypatch):
    from colibri_mlx.kernels import dispatch

    real = qgemv.default_prefetch
    monkeypatch.setattr(qgemv, "DEFAULT_NIB", {k: qgemv.DEFAULT_NIB[dispatch.CUDA] for k in qgemv.DEFAULT_NIB})
    monkeypatch.setattr(qgemv, "default_prefetch", lambda fmt, S, backend: real(fmt, S, dispatch.CUDA))


@pytest.mark.parametrize("S", range(1, 9))
@pytest.mark.parametrize("fmt", [2, 4])
def test_cuda_default_launch_every_S(cuda_defaults, fmt, S):
    for O, I in SHAPES + [(9, 2080)]:
        run_case(fmt, O, I, S=S, gs=48, seed=S + I, dtype=mx.bfloat16 if S % 3 == 0 else mx.float32)


@pytest.mark.parametrize("gs", GS_CANDIDATES)
def test_cuda_default_launch_every_group_size(cuda_defaults, gs):
    run_case(4, 4, 520, S=1, gs=gs, seed=gs)
    run_case(4, 3, 2 * gs + 1, S=2, gs=gs, seed=gs + 1)
    run_case(4, 5, 40 * gs + 8, S=4, gs=gs, seed=gs + 2, dtype=mx.bfloat16)  # several PF steps


RESIDUAL_DEFECTS = {
    "residual of row 0 of x for every row": ("float(res[s * O + row])", "float(res[row])"),
    "residual not added": ("y[s * O + row] = RES ?", "y[s * O + row] = false ?"),
}


@pytest.mark.parametrize("fmt", [1, 2, 4, 5, 6])
@pytest.mark.parametrize("S", [1, 3, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_residual_is_added_as_a_separate_add_would(fmt, S, dtype):
    """RES 1 (the decoder layer's residual add in qgemv's write): bit for bit the kernel's own
    product rounded to x's dtype, then ``residual + y`` as MLX adds two arrays of that dtype."""
    if dtype == mx.bfloat16:
        pytest.importorskip("ml_dtypes", reason="the simulator takes bfloat16 inputs as ml_dtypes arrays")
    qt = random_qtensor(fmt, 37, 300, gs=32 if fmt == 4 else None, seed=fmt)
    x = random_x(S, 300, dtype=dtype, seed=2)
    res = (random_x(S, 37, seed=3) * 10).astype(dtype)
    plain = simulate(qgemv.launch_spec(x, qt))
    assert_close(plain, x, qt, f"fmt {fmt} S={S} {dtype}")
    spec = qgemv.launch_spec(x, qt, residual=res)
    assert dict(spec.template)["RES"] == 1 and spec.inputs[-1] is not spec.inputs[0]
    want = np.array((res + plain).astype(mx.float32))
    assert np.array_equal(np.array(simulate(spec).astype(mx.float32)), want)
    for defect, (good, bad) in RESIDUAL_DEFECTS.items():
        assert spec.source.count(good) == 1, f"defect '{defect}' no longer plants"
        got = np.array(simulate(spec, spec.source.replace(good, bad)).astype(mx.float32))
        assert not np.array_equal(got, want) or (defect.startswith("residual of row 0") and S == 1), defect


@pytest.mark.parametrize("fmt", [2, 4, 6])
@pytest.mark.parametrize("S", [1, 5])
def test_float32_output_is_the_unrounded_sum(fmt, S):
    """OT float32 (the model's logits): the same float32 sum the bf16 launch rounds, unrounded,
    within the float64 oracle's float32 budget."""
    pytest.importorskip("ml_dtypes", reason="the simulator takes bfloat16 inputs as ml_dtypes arrays")
    qt = random_qtensor(fmt, 37, 300, gs=32 if fmt == 4 else None, seed=fmt + 1)
    x = random_x(S, 300, dtype=mx.bfloat16, seed=4)
    wide = qgemv.launch_spec(x, qt, out_dtype=mx.float32)
    assert wide.output_dtypes == [mx.float32] and dict(wide.template)["OT"] == mx.float32
    y32 = simulate(wide)
    assert y32.dtype == mx.float32
    assert_close(y32, x.astype(mx.float32), qt, f"fmt {fmt} S={S} float32 out")
    yb = simulate(qgemv.launch_spec(x, qt))
    assert np.array_equal(np.array(yb.astype(mx.float32)), np.array(y32.astype(mx.bfloat16).astype(mx.float32)))
    with pytest.raises(ValueError, match="residual"):
        qgemv.launch_spec(x, qt, out_dtype=mx.float32, residual=random_x(S, 37, dtype=mx.bfloat16))

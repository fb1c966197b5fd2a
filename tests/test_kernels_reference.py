"""The pure-MLX reference (oracle and CPU path) against a float64 numpy dequantizer, and the
qmatmul front door: routing, counters, forcing the reference, visible fallbacks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx import kernels
from colibri_mlx.formats import GS_CANDIDATES
from colibri_mlx.kernels import dispatch, kernel_text, qgemv, reference
from kernel_oracle import assert_close, dequant_f64, random_qtensor, random_x

# Odd I (odd nibble count, unaligned rows), partial fmt 5 groups and fmt 6 super-blocks.
SHAPES = [(5, 37), (3, 256), (7, 300), (4, 64), (6, 129)]


@pytest.mark.parametrize("fmt", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("O,I", SHAPES)
def test_reference_dequantize_matches_float64(fmt, O, I):
    qt = random_qtensor(fmt, O, I, gs=32, seed=O * I + fmt)
    got = np.asarray(reference.dequantize(qt)).astype(np.float64)
    want = dequant_f64(qt)
    # Each weight is one float32 product (code * scale): exact to 2^-24 relative.
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)


@pytest.mark.parametrize("fmt", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("S", [1, 2, 3, 5, 8])
def test_reference_qmatmul_every_fmt_and_S(fmt, S):
    for O, I in SHAPES:
        qt = random_qtensor(fmt, O, I, gs=16, seed=S + fmt)
        x = random_x(S, I, seed=S * 7 + I)
        assert_close(reference.qmatmul(x, qt), x, qt, f"fmt {fmt} S={S} {O}x{I}")


@pytest.mark.parametrize("gs", GS_CANDIDATES)
def test_reference_fmt4_every_group_size(gs):
    # I = 200 leaves a partial last group for every gs except 16... and 200 % 48 != 0 too.
    for I in (200, 3 * gs, 513):
        qt = random_qtensor(4, 9, I, gs=gs, seed=gs + I)
        x = random_x(4, I, seed=gs)
        assert_close(reference.qmatmul(x, qt), x, qt, f"fmt 4 gs={gs} I={I}")


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_reference_low_precision_x(dtype):
    qt = random_qtensor(4, 8, 96, gs=32, seed=3)
    x = random_x(3, 96, dtype=dtype)
    y = reference.qmatmul(x, qt)
    assert y.dtype == dtype
    assert_close(y, x, qt, str(dtype))


def test_reference_row_tiles_match_untiled(monkeypatch):
    qt = random_qtensor(5, 37, 130, seed=11)
    x = random_x(2, 130)
    whole = np.asarray(reference.qmatmul(x, qt))
    monkeypatch.setattr(reference, "TILE_WEIGHTS", 130 * 5)  # 5 rows per tile, last one partial
    tiled = np.asarray(reference.qmatmul(x, qt))
    np.testing.assert_array_equal(tiled, whole)


def test_reference_realistic_size_fmt4():
    qt = random_qtensor(4, 2048, 7168, gs=64, seed=5)
    x = random_x(1, 7168, seed=6)
    assert_close(reference.qmatmul(x, qt), x, qt, "2048x7168 fmt 4")


# ---------------------------------------------------------------------------------------
# qmatmul front door


@pytest.fixture(autouse=True)
def _clean_counters():
    kernels.reset_counters()
    yield
    kernels.reset_counters()


def test_qmatmul_float_weight_and_batch_dims():
    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((6, 10)).astype(np.float32))
    x = mx.array(rng.standard_normal((2, 3, 10)).astype(np.float32))
    y = kernels.qmatmul(x, w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(w).T, rtol=1e-5, atol=1e-5)
    assert kernels.counters()["calls"] == {"dense/matmul": 1}


def test_qmatmul_qtensor_decode_and_prefill_paths_on_cpu():
    qt = random_qtensor(2, 12, 70, seed=2)
    x = random_x(11, 70)
    y_decode = kernels.qmatmul(x[:3].reshape(1, 3, 70), qt)
    assert y_decode.shape == (1, 3, 12)
    assert_close(y_decode.reshape(3, 12), x[:3], qt, "decode")
    assert_close(kernels.qmatmul(x, qt), x, qt, "prefill S=11")
    calls = kernels.counters()["calls"]
    # On the CPU backend the reference is the path, not a fallback.
    assert calls == {"qgemv/reference": 1, "qmm/dequant-matmul": 1}
    assert kernels.counters()["fallbacks"] == {}
    assert "fallback 0" in kernels.format_counters()


def test_qmatmul_rejects_wrong_width():
    qt = random_qtensor(1, 4, 16)
    with pytest.raises(ValueError, match="16"):
        kernels.qmatmul(random_x(1, 15), qt)


def test_force_reference_flag_env_and_context(monkeypatch):
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert kernels.backend() == "cuda"
    with kernels.force_reference():
        assert kernels.backend() == "reference"
    assert kernels.backend() == "cuda"
    kernels.force_reference(True)
    try:
        assert kernels.backend() == "reference"
    finally:
        kernels.force_reference(False)
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert kernels.backend() == "reference"


def test_gpu_kernel_runs_and_declines_are_counted(monkeypatch):
    """With a (faked) CUDA backend the kernel path is taken; a decline is a counted fallback."""
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    launched = []

    def fake_kernel(x, qt, impl, residual=None, out_dtype=None):
        launched.append((qt.fmt, impl))
        return reference.qmatmul(x, qt)

    monkeypatch.setattr(qgemv, "qgemv", fake_kernel)
    good = random_qtensor(4, 8, 64, gs=32)
    kernels.qmatmul(random_x(2, 64), good)
    odd_gs = random_qtensor(4, 8, 64, gs=32)
    odd_gs = type(odd_gs)(odd_gs.packed, np.ones(8 * 8, np.float32), 4, 8, 64, 8, "blk.0.odd")
    x = random_x(1, 64)
    y = kernels.qmatmul(x, odd_gs)
    assert_close(y, x, odd_gs, "declined call still correct")
    c = kernels.counters()
    assert launched == [(4, "cuda")]
    assert c["calls"] == {"qgemv/cuda": 1, "qgemv/reference": 1}
    assert c["fallbacks"] == {"qgemv: fmt 4 with gs=8 (needs a multiple of 16) -> reference": 1}
    line = kernels.format_counters()
    assert "fallback 1" in line and "gs=8" in line


def test_decline_reasons():
    qt = random_qtensor(2, 4, 32)
    assert qgemv.decline_reason(random_x(8, 32), qt) is None
    assert "S=9" in qgemv.decline_reason(random_x(9, 32), qt)
    assert "dtype" in qgemv.decline_reason(random_x(1, 32).astype(mx.int32), qt)


# ---------------------------------------------------------------------------------------
# concat_rows: projections of the same input stacked into one weight (one launch)


def assert_same_rows(got, want):
    """Bit-exact where every output row is computed on its own (the reference, the qgemv kernel);
    a GPU matmul (prefill, fmt 0) may tile a different row count differently: float32 rounding."""
    got, want = np.asarray(got), np.asarray(want)
    if mx.default_device().type == mx.cpu:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("fmt", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("S", [1, 3, 12])     # qgemv-sized and prefill-sized x
def test_concat_rows_equals_separate_projections_bit_exact(fmt, S):
    a, b = random_qtensor(fmt, 7, 200, gs=32, seed=fmt), random_qtensor(fmt, 5, 200, gs=32, seed=fmt + 9)
    fused = kernels.concat_rows([a, b])
    assert (fused.fmt, fused.O, fused.I, fused.gs) == (fmt, 12, 200, a.gs)
    # the bytes are exactly the two tensors' rows, in order
    np.testing.assert_array_equal(np.asarray(reference.dequantize(fused)),
                                  np.concatenate([np.asarray(reference.dequantize(a)),
                                                  np.asarray(reference.dequantize(b))]))
    x = random_x(S, 200, seed=S)
    y = np.asarray(kernels.qmatmul(x, fused))
    assert_same_rows(y[:, :7], kernels.qmatmul(x, a))
    assert_same_rows(y[:, 7:], kernels.qmatmul(x, b))
    assert_close(kernels.qmatmul(x, fused), x, fused, f"fused fmt {fmt}")
    # the parts read back as views equal the originals
    for part, orig in ((kernels.rows_of(fused, 0, 7), a), (kernels.rows_of(fused, 7, 12), b)):
        np.testing.assert_array_equal(np.asarray(part.packed), np.asarray(orig.packed))
        np.testing.assert_array_equal(np.asarray(part.scales), np.asarray(orig.scales))


def test_concat_rows_float_weights():
    a, b = mx.random.normal((6, 40)), mx.random.normal((3, 40))
    fused = kernels.concat_rows([a, b])
    np.testing.assert_array_equal(np.asarray(fused), np.concatenate([np.asarray(a), np.asarray(b)]))
    np.testing.assert_array_equal(np.asarray(kernels.rows_of(fused, 6, 9)), np.asarray(b))


def test_concat_rows_refuses_what_is_not_row_stackable():
    q4 = random_qtensor(4, 4, 64, gs=32)
    cases = [
        [q4, random_qtensor(2, 4, 64)],                         # different fmt
        [q4, random_qtensor(4, 4, 64, gs=16)],                  # different group size
        [q4, random_qtensor(4, 4, 96, gs=32)],                  # different input width
        [q4, mx.zeros((4, 64))],                                # quantized and float
        [random_qtensor(6, 2, 256), random_qtensor(6, 2, 256)],  # fmt 6 (rotated basis): not fused
        [mx.zeros((2, 8)), mx.zeros((2, 8), mx.float16)],       # float dtypes differ
    ]
    for ws in cases:
        assert kernels.concat_rows(ws) is None


@pytest.mark.parametrize("fmt", [0, 1, 4, 5, 6])
def test_take_rows_moves_whole_rows(fmt):
    qt = random_qtensor(fmt, 6, 256, gs=32, seed=fmt) if fmt else None
    w = qt if qt is not None else mx.random.normal((6, 256))
    order = [3, 0, 5, 1, 4, 2]
    moved = kernels.take_rows(w, order)
    dense = np.asarray(reference.dequantize(w) if qt is not None else w)
    got = np.asarray(reference.dequantize(moved) if qt is not None else moved)
    np.testing.assert_array_equal(got, dense[order])
    x = random_x(2, 256, seed=4)
    assert_same_rows(kernels.qmatmul(x, moved), np.asarray(kernels.qmatmul(x, w))[:, order])
    with pytest.raises(ValueError, match="permutation"):
        kernels.take_rows(w, [0, 0, 1, 2, 3, 4])


# ---------------------------------------------------------------------------------------
# What MLX is handed per launch: compact source text, kernel objects found by identity


def test_compact_source_drops_only_what_compilers_ignore():
    text = "\n".join([
        "// a comment line",
        "   int a = 1;   // trailing comment",
        "",
        "#define TWO(x) \\",
        "  // inside a macro: kept, the macro's end must not move",
        "  (x + x)",
        "",
        "const char* s = \"http://not-a-comment\"; // kept with its string",
        "    return a;",
    ])
    assert dispatch.compact_source(text) == "\n".join([
        "int a = 1;",
        "#define TWO(x) \\",
        "// inside a macro: kept, the macro's end must not move",
        "(x + x)",
        "const char* s = \"http://not-a-comment\"; // kept with its string",
        "return a;",
    ]) + "\n"


@pytest.mark.parametrize("backend", [dispatch.METAL, dispatch.CUDA])
def test_kernel_text_handed_to_mlx_is_compact(backend):
    raw = (dispatch.KERNEL_DIR / (f"qgemv.metal" if backend == dispatch.METAL else "cuda/qgemv.cu")).read_text()
    raw_decode = ((dispatch.KERNEL_DIR / dispatch.GGUF_DECODE_HEADER[backend]).read_text()
                  + (dispatch.KERNEL_DIR / dispatch.DECODE_HEADER[backend]).read_text())
    spec = qgemv.launch_spec(random_x(1, 64), random_qtensor(4, 4, 64, gs=32), backend)
    sent = len(spec.source) + len(spec.header)
    assert sent < 0.75 * (len(raw) + len(raw_decode))
    assert "//" not in spec.source and "\n\n" not in spec.header


PRUNE_HEADER = """#include <metal_stdlib>
#define TWICE(x) \\
((x) + (x))
namespace lib {
constexpr int unused_const() {
return 1;
}
template <int N, int XP = 0>
inline float leaf(float a) {
if (XP) { return a; }
return a * N;
}
inline float leaf(int a) {
return float(a);
}
inline float middle(float a) {
return leaf<2>(a) + TABLE[0];
}
constant float TABLE[2] = {
1.0f, 2.0f,
};
struct Pair {
float a;
float b;
};
inline float dead(Pair p) {
return p.a;
}
namespace alias = lib;
inline float operator_user(float a) { return a; }
}
"""


def test_prune_header_keeps_what_the_body_reaches():
    body = "float y = lib::middle(x);\nPair p;\n"
    pruned = kernel_text.prune_header(PRUNE_HEADER, body)
    kept = {name for text, name in kernel_text.split_items(pruned) if name}
    # middle, what it calls (both leaf overloads: the cut is by name) and the constant it reads;
    # the struct the body names; the includes and namespace braces always
    assert kept == {"middle", "leaf", "TABLE", "Pair"}
    assert pruned.startswith("#include <metal_stdlib>\n#define TWICE(x) \\\n((x) + (x))\nnamespace lib {\n")
    assert pruned.endswith("}\n")
    assert "dead" not in pruned and "unused_const" not in pruned and "alias" not in pruned
    names = [name for _, name in kernel_text.split_items(PRUNE_HEADER)]
    assert names == [None, None, None, None, "unused_const", "leaf", "leaf", "middle", "TABLE", "Pair", "dead", "alias",
                     "operator_user", None]


def test_prune_header_refuses_unbalanced_text():
    with pytest.raises(ValueError, match="unbalanced"):
        kernel_text.prune_header("inline int f() {\nreturn 1;\n", "f();")
    with pytest.raises(ValueError, match="unbalanced"):
        kernel_text.prune_header("}\n}\n", "")
    with pytest.raises(ValueError, match="kernel moe_down: .*unbalanced"):
        kernel_text.launch_text("namespace a {\ninline int f() {\nreturn 1;\n}\n", "f();", "moe_down")


@pytest.mark.parametrize("backend", [dispatch.METAL, dispatch.CUDA])
def test_launch_text_is_cut_per_body(backend):
    from colibri_mlx.kernels import moe

    header = moe.kernel_header("mla_decode", backend)     # qdecode + mla_decode's helpers
    bodies = moe.read_kernel_sections("mla_decode", backend)[1]
    qabs_h, qabs_b = kernel_text.launch_text(header, bodies["mla_qabs"])
    attn_h, _ = kernel_text.launch_text(header, bodies["mla_attn_mma"])
    assert qabs_b == dispatch.compact_source(bodies["mla_qabs"])
    # q' decodes kv_b; the attention reads only the cache: qdecode's decoders are cut from it
    decode = "qd_decode8" if backend == dispatch.METAL else "decode8("
    assert decode in qabs_h and decode not in attn_h
    assert len(attn_h) < 0.5 * len(dispatch.compact_source(header))


def test_launch_statics_are_built_once_per_weight_and_shape():
    qt = random_qtensor(4, 8, 128, gs=32)
    a = qgemv.launch_spec(random_x(1, 128), qt, dispatch.CUDA)
    b = qgemv.launch_spec(random_x(1, 128, seed=5), qt, dispatch.CUDA)
    assert a.header is b.header and a.source is b.source and a.template is b.template
    assert all(u is v for u, v in zip(a.inputs[1:5], b.inputs[1:5])) and a.inputs[0] is not b.inputs[0]
    assert a.inputs[5] is a.inputs[0]        # no residual: RES 0 and x in its place, never read
    c = qgemv.launch_spec(random_x(3, 128), qt, dispatch.CUDA)
    assert dict(c.template)["S"] == 3 and c.output_shapes == [(3, 8)]
    other = random_qtensor(4, 8, 128, gs=32, seed=9)
    d = qgemv.launch_spec(random_x(1, 128), other, dispatch.CUDA)
    assert d.inputs[1] is not a.inputs[1]


def test_kernel_objects_found_by_identity_then_by_content(monkeypatch):
    made = []
    monkeypatch.setattr(mx.fast, "metal_kernel", lambda **kw: made.append(kw) or object())
    monkeypatch.setattr(dispatch, "_kernels", {})
    monkeypatch.setattr(dispatch, "_kernels_by_id", {})
    spec = qgemv.launch_spec(random_x(1, 64), random_qtensor(2, 4, 64), dispatch.METAL)
    k = dispatch._kernel_object(dispatch.METAL, spec)
    assert dispatch._kernel_object(dispatch.METAL, spec) is k
    # equal text in new string objects: same kernel, found by content
    spec.source, spec.header = "".join(list(spec.source)), "".join(list(spec.header))
    assert dispatch._kernel_object(dispatch.METAL, spec) is k
    spec.source = spec.source + "\n"          # other text: another kernel
    assert dispatch._kernel_object(dispatch.METAL, spec) is not k
    assert len(made) == 2


@pytest.mark.parametrize("setting, empty", [("1", True), ("0", False), (None, False)])
def test_empty_kernels_knob_returns_at_the_first_line(monkeypatch, setting, empty):
    # COLIBRI_EMPTY_KERNELS=1 (scripts/device/steps.sh host_floor): the body MLX gets starts with a
    # return and is otherwise the launch's own text; unset or 0, the text is untouched.
    made = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or object())
    monkeypatch.setattr(dispatch, "_kernels", {})
    monkeypatch.setattr(dispatch, "_kernels_by_id", {})
    if setting is None:
        monkeypatch.delenv(dispatch.EMPTY_KERNELS_VAR, raising=False)
    else:
        monkeypatch.setenv(dispatch.EMPTY_KERNELS_VAR, setting)
    dispatch.empty_kernels.cache_clear()
    try:
        if empty:
            with pytest.warns(RuntimeWarning, match="garbage"):
                assert dispatch.empty_kernels()
        spec = qgemv.launch_spec(random_x(1, 64), random_qtensor(2, 4, 64), dispatch.CUDA)
        dispatch._kernel_object(dispatch.CUDA, spec)
    finally:
        dispatch.empty_kernels.cache_clear()
    header, body = dispatch.launch_text(spec.header, spec.source, spec.name)
    (kw,) = made
    assert kw["header"] == header
    assert kw["source"] == (dispatch.EMPTY_BODY_LINE + body if empty else body)


@pytest.mark.parametrize("fmt", [1, 2, 3, 4, 5])
def test_dequantize_take_is_the_host_row_decode(fmt):
    """Rows gathered by id on the device (an embedding lookup of a lazily computed token) are
    the numpy decoder's rows bit for bit, repeated ids and the last row included."""
    from colibri_mlx.formats import decode, scale_nbytes, weight_nbytes

    qt = random_qtensor(fmt, 37, 192, gs=32, seed=fmt)
    ids = np.array([[36, 0, 5, 5], [17, 2, 36, 1]], np.int32)
    got = np.array(reference.dequantize_take(qt, mx.array(ids)))
    rb, spr = weight_nbytes(fmt, 1, 192, qt.gs), scale_nbytes(fmt, 1, 192, qt.gs) // 4
    flat = ids.reshape(-1)
    want = decode(fmt, np.asarray(qt.packed).reshape(37, rb)[flat].reshape(-1),
                  np.asarray(qt.scales).reshape(37, spr)[flat].reshape(-1), flat.size, 192, qt.gs)
    assert got.shape == (2, 4, 192)
    assert np.array_equal(got.reshape(-1, 192), want) and np.abs(want).max() > 0
    with pytest.raises(ValueError, match="fmt 6"):
        reference.dequantize_take(random_qtensor(6, 4, 256, seed=1), mx.array([0]))

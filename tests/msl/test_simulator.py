"""The MSL simulator: correct kernels give the float64 reference; planted defects are caught."""

import re

import numpy as np
import pytest

from tests.msl.simulator import SimulatorError, as_bfloat16, generate_source, run_metal_kernel, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"MSL simulator: {unavailable_reason()}")

RNG = np.random.default_rng(20260521)

# Block sum: simd_sum per SIMD group, partials through threadgroup memory, second simd_sum.
REDUCE_SRC = """
  uint lid = thread_index_in_threadgroup;
  threadgroup float partial[32];
  uint gid = thread_position_in_grid.x;
  float v = x[gid] * scale;
  float s = simd_sum(v);
  if (thread_index_in_simdgroup == 0) partial[simdgroup_index_in_threadgroup] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simdgroup_index_in_threadgroup == 0) {
    float p = lid < simdgroups_per_threadgroup ? partial[lid] : 0.0f;
    p = simd_sum(p);
    if (lid == 0) out[threadgroup_position_in_grid.x] = p;
  }
"""


def _block_sums(x, scale, tg):
    x64 = x.astype(np.float64) * scale
    return np.array([x64[i:i + tg].sum() for i in range(0, x.size, tg)])


@pytest.mark.parametrize("n", [1024, 1000])  # 1000: the last threadgroup is partial (232 threads)
def test_reduction_simd_sum_threadgroup_memory(n):
    x = RNG.standard_normal(n).astype(np.float32)
    (out,) = run_metal_kernel("reduce", ["x", "scale"], ["out"], REDUCE_SRC, inputs=[x, 1.5],
                              output_shapes=[(-(-n // 256),)], output_dtypes=[np.float32],
                              grid=(n, 1, 1), threadgroup=(256, 1, 1))
    # float32 sums of <= 256 terms of size ~1.5: error well below 1e-4
    np.testing.assert_allclose(out, _block_sums(x, 1.5, 256), rtol=0, atol=1e-4)


SHUFFLE_TREE_SRC = """
  uint gid = thread_position_in_grid.x;
  uint lane = thread_index_in_simdgroup;
  int v = x[gid];
  for (ushort d = 16; d > 0; d /= 2) v += simd_shuffle_down(v, d);
  if (lane == 0) out[gid / 32] = v;
  int up = simd_shuffle_up(x[gid], 1);
  int bx = simd_shuffle_xor(x[gid], 1);
  int bc = simd_broadcast(x[gid], 5);
  int pre = simd_prefix_exclusive_sum(x[gid]);
  int mx = simd_max(x[gid]);
  ((device int4*)neighbours)[gid] = int4(up, bx, bc, pre + 1000 * mx);
"""


def test_simd_shuffles_and_prefix():
    x = RNG.integers(-50, 50, size=128).astype(np.int32)
    out, nb = run_metal_kernel(
        "shuffles", ["x"], ["out", "neighbours"], SHUFFLE_TREE_SRC, inputs=[x],
        output_shapes=[(4,), (128, 4)], output_dtypes=[np.int32, np.int32],
        grid=(128, 1, 1), threadgroup=(64, 1, 1))
    g = x.reshape(4, 32)
    np.testing.assert_array_equal(out, g.sum(1))
    lane = np.arange(32)
    up = np.where(lane >= 1, g[:, np.maximum(lane - 1, 0)], g)  # lane 0 keeps its own value
    np.testing.assert_array_equal(nb[:, 0].reshape(4, 32), up)
    np.testing.assert_array_equal(nb[:, 1].reshape(4, 32), g[:, lane ^ 1])
    np.testing.assert_array_equal(nb[:, 2].reshape(4, 32), np.repeat(g[:, 5:6], 32, axis=1))
    excl = np.cumsum(g, axis=1) - g
    np.testing.assert_array_equal(nb[:, 3].reshape(4, 32), excl + 1000 * g.max(1, keepdims=True))


CONSTANT_SRC = """
  uint i = thread_position_in_grid.x;
  float acc = 0.0f;
  for (int k = 0; k < 4; k++) acc += coef[k] * float(k + 1);
  y[i] = x[i] * scale + acc + float(x_shape[0]) + float(x_ndim) + float(x_strides[0]);
"""


def test_constant_space_scalar_small_array_and_shape_params():
    x = RNG.standard_normal(40).astype(np.float32)
    coef = np.array([0.5, -1.0, 2.0, 0.25], dtype=np.float32)  # < 8 elements: constant space
    (y,), src = run_metal_kernel("consts", ["x", "scale", "coef"], ["y"], CONSTANT_SRC,
                                 inputs=[x, np.float32(3.0), coef], output_shapes=[(40,)],
                                 output_dtypes=[np.float32], grid=(40, 1, 1), threadgroup=(32, 1, 1),
                                 return_source=True)
    assert "const constant float& scale [[buffer(4)]]" in src
    assert "const constant float* coef [[buffer(5)]]" in src
    assert "const device float* x [[buffer(0)]]" in src
    want = x.astype(np.float64) * 3.0 + (0.5 - 2.0 + 6.0 + 1.0) + 40 + 1 + 1
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-5)


def test_signature_matches_mlx():
    """Golden text of MLX 0.32's write_signature for a templated kernel."""
    x = np.zeros(16, np.float32)
    src = "uint i = thread_position_in_grid.x; out[i] = T(x[i] * n) + T(N);"
    metal, _, _ = generate_source("k", ["x", "n"], ["out"], src, "// hdr\n", [x, np.asarray(2, np.int32)],
                                  [np.float16], template=[("T", np.float16), ("N", 3), ("B", True)])
    assert metal == (
        "// hdr\ntemplate <typename T, int N, bool B>\n"
        "[[kernel]] void custom_kernel_k__float16_t_3_1_float_int32_ts_float16_t(\n"
        "  const device float* x [[buffer(0)]],\n"
        "  const constant int32_t& n [[buffer(1)]],\n"
        "  device float16_t* out [[buffer(2)]],\n"
        "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n"
        + src + "\n}\n\n"
        'template [[host_name("custom_kernel_k__float16_t_3_1_float_int32_ts_float16_t")]] [[kernel]] '
        "decltype(custom_kernel_k__float16_t_3_1_float_int32_ts_float16_t<float16_t, 3, 1>) "
        "custom_kernel_k__float16_t_3_1_float_int32_ts_float16_t<float16_t, 3, 1>;\n")


def test_template_half_and_vector_constructors():
    src = """
      uint i = thread_position_in_grid.x;
      uchar4 b = ((const device uchar4*)w)[i];
      float4 lo = float4(b & 0xF) - 8.0f;
      half4 h = half4(lo) * half(0.5f);
      float2 p = float2(lo.x, lo.y);
      out[i] = T(dot(float4(h), float4(1.0f)) + p.y * N);
    """
    w = RNG.integers(0, 256, size=(24, 4)).astype(np.uint8)
    (out,) = run_metal_kernel("tmpl", ["w"], ["out"], src, inputs=[w], output_shapes=[(24,)],
                              output_dtypes=[np.float16], grid=(24, 1, 1), threadgroup=(8, 1, 1),
                              template=[("T", np.float16), ("N", 3)])
    lo = (w & 0xF).astype(np.float64) - 8
    want = (lo * 0.5).sum(1) + lo[:, 1] * 3  # small integers/halves: exact in half
    np.testing.assert_array_equal(out.astype(np.float64), want)


def test_half_conversions_are_exact_both_ways():
    """Every half bit pattern widened to float, and floats around every rounding boundary
    narrowed to half, bit for bit as numpy (IEEE round-to-nearest-even). On x86-64 these
    conversions are library calls whose calling convention changed in LLVM 15: a runtime that
    defines them for the wrong one reads a stale register, which this catches."""
    src = """
      uint i = thread_position_in_grid.x;
      wide[i] = float(h[i]);
      narrow[i] = half(f[i]);
    """
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = np.sort(h[np.isfinite(h)].astype(np.float32))
    ties = finite[:-1].astype(np.float64) / 2 + finite[1:].astype(np.float64) / 2  # exact in float32
    extra = [65519.99, 65520.0, 1e6, -1e6, 2.0**-25, 2.0**-24 * 0.75, np.inf, -np.inf]
    f = np.concatenate([finite, np.nextafter(finite, np.float32(np.inf)), np.nextafter(finite, np.float32(-np.inf)),
                        ties, extra]).astype(np.float32)
    n = -(-f.size // 256) * 256
    f, h = np.resize(f, n), np.resize(h, n)
    wide, narrow = run_metal_kernel("halfconv", ["h", "f"], ["wide", "narrow"], src, inputs=[h, f],
                                    output_shapes=[(n,), (n,)], output_dtypes=[np.float32, np.float16],
                                    grid=(n, 1, 1), threadgroup=(256, 1, 1))
    want_wide = h.astype(np.float32)
    nan = np.isnan(want_wide)
    np.testing.assert_array_equal(wide[~nan].view(np.uint32), want_wide[~nan].view(np.uint32))
    assert np.isnan(wide[nan]).all()
    with np.errstate(over="ignore"):  # 1e6 and 65520 round to infinity, as they should
        want_narrow = f.astype(np.float16)
    np.testing.assert_array_equal(narrow.view(np.uint16), want_narrow.view(np.uint16))


def test_bfloat16_input_and_output():
    src = """
      uint i = thread_position_in_grid.x;
      float v = float(x[i]) * 2.0f;
      out[i] = bfloat16_t(v);
    """
    x = np.array([1.0, -2.5, 3.140625, 1e-3] * 4, np.float32)
    xb = (x.view(np.uint32) >> 16).astype(np.uint16)  # exact bfloat16 values
    xin = as_bfloat16(xb)
    (out,) = run_metal_kernel("bf", ["x"], ["out"], src, inputs=[xin], output_shapes=[(16,)],
                              output_dtypes=["bfloat16"], grid=(16, 1, 1), threadgroup=(16, 1, 1))
    assert out.dtype == np.uint16  # bfloat16 outputs come back as bit patterns
    got = (out.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got, (xb.astype(np.uint32) << 16).view(np.float32) * 2)


def test_atomic_outputs_histogram():
    src = """
      uint i = thread_position_in_grid.x;
      atomic_fetch_add_explicit(&hist[x[i]], 1u, memory_order_relaxed);
    """
    x = RNG.integers(0, 10, size=300).astype(np.uint32)
    (hist,) = run_metal_kernel("hist", ["x"], ["hist"], src, inputs=[x], output_shapes=[(10,)],
                               output_dtypes=[np.uint32], grid=(300, 1, 1), threadgroup=(128, 1, 1),
                               init_value=0, atomic_outputs=True)
    np.testing.assert_array_equal(hist, np.bincount(x, minlength=10))


def test_non_uniform_grid_positions():
    src = """
      uint3 p = thread_position_in_grid;
      uint idx = p.y * threads_per_grid.x + p.x;
      ((device uint4*)out)[idx] = uint4(p.x, p.y, threads_per_threadgroup.x, threadgroups_per_grid.x);
    """
    (out,) = run_metal_kernel("pos", [], ["out"], src, inputs=[], output_shapes=[(3, 10, 4)],
                              output_dtypes=[np.uint32], grid=(10, 3, 1), threadgroup=(4, 2, 1))
    xs, ys = np.meshgrid(np.arange(10), np.arange(3))
    np.testing.assert_array_equal(out[..., 0], xs)
    np.testing.assert_array_equal(out[..., 1], ys)
    np.testing.assert_array_equal(out[..., 2], np.where(xs >= 8, 2, 4))  # last threadgroup is partial
    assert (out[..., 3] == 3).all()


# ---- the simulator must catch defects ---------------------------------------------------------

def test_constant_pointer_to_device_helper_is_a_compile_error():
    header = ("#include <metal_stdlib>\nusing namespace metal;\n"
              "inline float first(const device float* p) { return p[0]; }\n")
    src = "out[thread_position_in_grid.x] = first(coef);"
    coef = np.ones(4, np.float32)  # < 8 elements: MLX puts it in the constant address space
    with pytest.raises(SimulatorError, match=r"(?s)failed to compile.*'constant'.*'device'"):
        run_metal_kernel("as_mismatch", ["coef"], ["out"], src, header, inputs=[coef],
                         output_shapes=[(4,)], output_dtypes=[np.float32], grid=(4, 1, 1),
                         threadgroup=(4, 1, 1))
    # the same helper with a >= 8 element input (device space) compiles and runs
    (out,) = run_metal_kernel("as_mismatch", ["coef"], ["out"], src, header,
                              inputs=[np.full(8, 2.5, np.float32)], output_shapes=[(4,)],
                              output_dtypes=[np.float32], grid=(4, 1, 1), threadgroup=(4, 1, 1))
    assert (out == 2.5).all()


# Each thread publishes x[i] and reads its neighbour's value: needs a barrier in between.
NEIGHBOUR_SRC = """
  uint lid = thread_index_in_threadgroup;
  uint n = threads_per_threadgroup.x;
  threadgroup float buf[256];
  buf[lid] = x[thread_position_in_grid.x];
  {BARRIER}
  out[thread_position_in_grid.x] = buf[(lid + 1) % n] + buf[(lid + n - 1) % n];
"""


def _neighbour_ref(x, tg):
    g = x.astype(np.float64).reshape(-1, tg)
    return (np.roll(g, -1, axis=1) + np.roll(g, 1, axis=1)).reshape(-1)


def test_missing_barrier_is_caught():
    x = RNG.standard_normal(512).astype(np.float32)
    kwargs = dict(inputs=[x], output_shapes=[(512,)], output_dtypes=[np.float32], grid=(512, 1, 1),
                  threadgroup=(256, 1, 1))
    good = NEIGHBOUR_SRC.replace("{BARRIER}", "threadgroup_barrier(mem_flags::mem_threadgroup);")
    (out,) = run_metal_kernel("nb", ["x"], ["out"], good, **kwargs)
    np.testing.assert_allclose(out, _neighbour_ref(x, 256), rtol=1e-6)
    bad = NEIGHBOUR_SRC.replace("{BARRIER}", "")
    # one schedule alone: a wrong result (reads of not-yet-written threadgroup memory)
    for order in ("forward", "reverse"):
        (out,) = run_metal_kernel("nb", ["x"], ["out"], bad, schedules=(order,), **kwargs)
        assert not np.allclose(out, _neighbour_ref(x, 256), equal_nan=False)
    # default: both schedules, and the disagreement is reported as a race
    with pytest.raises(SimulatorError, match="depends on the thread schedule"):
        run_metal_kernel("nb", ["x"], ["out"], bad, **kwargs)


def test_unwritten_output_element_is_reported():
    src = "uint i = thread_position_in_grid.x; if (i != 5) y[i] = float(x[i]);"
    x = np.arange(1, 17, dtype=np.int32)
    kwargs = dict(inputs=[x], output_shapes=[(16,)], output_dtypes=[np.float32], grid=(16, 1, 1),
                  threadgroup=(16, 1, 1))
    with pytest.raises(SimulatorError, match="output y element 5 never written"):
        run_metal_kernel("unwritten", ["x"], ["y"], src, **kwargs)
    (y,) = run_metal_kernel("unwritten", ["x"], ["y"], src, allow_unwritten=True, **kwargs)
    assert np.isnan(y[5]) and (y[np.arange(16) != 5] == x[np.arange(16) != 5]).all()
    # uint8 output: 0xAB is a legitimate byte; only an element poisoned in both runs counts
    src8 = "uint i = thread_position_in_grid.x; y[i] = uchar(0xAB);"
    (y8,) = run_metal_kernel("u8", ["x"], ["y"], src8, inputs=[x], output_shapes=[(16,)],
                             output_dtypes=[np.uint8], grid=(16, 1, 1), threadgroup=(16, 1, 1))
    assert (y8 == 0xAB).all()


@pytest.mark.parametrize("n", [16, 13])  # 16 floats end on the guard page; 13 end in canary bytes
def test_out_of_bounds_write_is_detected(n):
    src = "uint i = thread_position_in_grid.x; y[i + 1] = x[i];"
    x = RNG.standard_normal(n).astype(np.float32)
    with pytest.raises(SimulatorError, match="out-of-bounds (access to|write to) buffer 'y'"):
        run_metal_kernel("oob", ["x"], ["y"], src, inputs=[x], output_shapes=[(n,)],
                         output_dtypes=[np.float32], grid=(n, 1, 1), threadgroup=(32, 1, 1),
                         allow_unwritten=True)


def test_out_of_bounds_read_is_detected():
    src = "uint i = thread_position_in_grid.x; y[i] = x[i + 16];"  # reads x[16..31] of 16
    x = RNG.standard_normal(16).astype(np.float32)
    with pytest.raises(SimulatorError, match=r"out-of-bounds access to buffer 'x' \(64 bytes\): 0 bytes past"):
        run_metal_kernel("oobr", ["x"], ["y"], src, inputs=[x], output_shapes=[(16,)],
                         output_dtypes=[np.float32], grid=(16, 1, 1), threadgroup=(16, 1, 1))


def test_divergent_barrier_is_reported_not_hung():
    src = """
      uint lid = thread_index_in_threadgroup;
      threadgroup float buf[64];
      if (lid >= 40) return;
      buf[lid] = x[lid];
      threadgroup_barrier(mem_flags::mem_threadgroup);
      y[lid] = buf[63 - lid];
    """
    x = RNG.standard_normal(64).astype(np.float32)
    with pytest.raises(SimulatorError, match="divergent threadgroup_barrier: 40 of 64 threads"):
        run_metal_kernel("div", ["x"], ["y"], src, inputs=[x], output_shapes=[(64,)],
                         output_dtypes=[np.float32], grid=(64, 1, 1), threadgroup=(64, 1, 1))


def test_simd_divergence_is_reported():
    src = """
      uint lane = thread_index_in_simdgroup;
      float v = x[lane];
      if (lane < 16) v = simd_sum(v); else v = simd_max(v);
      y[lane] = v;
    """
    x = RNG.standard_normal(32).astype(np.float32)
    with pytest.raises(SimulatorError, match=r"SIMD divergence in simdgroup 0: lane \d+ waits at simd_"):
        run_metal_kernel("sdiv", ["x"], ["y"], src, inputs=[x], output_shapes=[(32,)],
                         output_dtypes=[np.float32], grid=(32, 1, 1), threadgroup=(32, 1, 1))


def test_shuffle_from_missing_lane_is_poison():
    """A shuffle-down tree in a partial SIMD group reads lanes that do not exist: NaN, not 0."""
    src = """
      float v = x[thread_position_in_grid.x];
      for (ushort d = 16; d > 0; d /= 2) v += simd_shuffle_down(v, d);
      if (thread_index_in_simdgroup == 0) y[0] = v;
    """
    x = RNG.standard_normal(20).astype(np.float32)
    (y,) = run_metal_kernel("partial", ["x"], ["y"], src, inputs=[x], output_shapes=[(1,)],
                            output_dtypes=[np.float32], grid=(20, 1, 1), threadgroup=(32, 1, 1),
                            allow_unwritten=True)
    assert np.isnan(y[0])
    src_sum = "float v = simd_sum(x[thread_position_in_grid.x]); if (thread_index_in_simdgroup == 0) y[0] = v;"
    (y,) = run_metal_kernel("partial2", ["x"], ["y"], src_sum, inputs=[x], output_shapes=[(1,)],
                            output_dtypes=[np.float32], grid=(20, 1, 1), threadgroup=(32, 1, 1))
    np.testing.assert_allclose(y[0], x.astype(np.float64).sum(), rtol=1e-5)


def test_infinite_loop_times_out():
    src = "uint i = 0; while (x[0] > 0.0f) { ((volatile device float*)y)[0] = float(i++); }"
    with pytest.raises(SimulatorError, match="did not finish"):
        run_metal_kernel("spin", ["x"], ["y"], src, inputs=[np.ones(8, np.float32)], output_shapes=[(1,)],
                         output_dtypes=[np.float32], grid=(1, 1, 1), threadgroup=(1, 1, 1), timeout=1.0)


def test_int4_gemv_2048_is_fast():
    """A 2048x2048 int4 GEMV with 256-thread threadgroups simulates well within seconds."""
    import time
    src = """
      uint row = threadgroup_position_in_grid.x * 8 + simdgroup_index_in_threadgroup;
      uint lane = thread_index_in_simdgroup;
      const device uchar* wrow = w + row * (I / 2);
      float acc = 0.0f;
      for (uint k = lane * 4; k < I / 2; k += 32 * 4) {
        uchar4 b = *(const device uchar4*)(wrow + k);
        float4 lo = float4(b & 0xF) - 8.0f;
        float4 hi = float4(b >> 4) - 8.0f;
        uint c = 2 * k;
        acc += lo.x * x[c] + hi.x * x[c + 1] + lo.y * x[c + 2] + hi.y * x[c + 3]
             + lo.z * x[c + 4] + hi.z * x[c + 5] + lo.w * x[c + 6] + hi.w * x[c + 7];
      }
      acc = simd_sum(acc);
      if (lane == 0) y[row] = acc * scales[row];
    """
    O = I = 2048
    q = RNG.integers(0, 16, size=(O, I)).astype(np.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    scales = RNG.uniform(0.01, 0.1, O).astype(np.float32)
    x = RNG.standard_normal(I).astype(np.float32)
    kwargs = dict(inputs=[packed, scales, x], output_shapes=[(O,)], output_dtypes=[np.float32],
                  grid=(256 * (O // 8), 1, 1), threadgroup=(256, 1, 1), template=[("I", I)])
    run_metal_kernel("gemv_speed", ["w", "scales", "x"], ["y"], src, **kwargs)  # compile
    t0 = time.perf_counter()
    (y,) = run_metal_kernel("gemv_speed", ["w", "scales", "x"], ["y"], src, **kwargs)
    elapsed = time.perf_counter() - t0
    ref = ((q.astype(np.float64) - 8) @ x.astype(np.float64)) * scales
    # 2048 float32 products of size <= 8*4: accumulated error < 1e-3 relative to max |ref|
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-3 * np.abs(ref).max())
    assert elapsed < 5.0, f"simulating the GEMV took {elapsed:.1f} s"
    # the swapped-nibble defect changes the result
    bad = src.replace("float4 lo = float4(b & 0xF)", "float4 lo = float4(b >> 4)").replace(
        "float4 hi = float4(b >> 4)", "float4 hi = float4(b & 0xF)")
    (yb,) = run_metal_kernel("gemv_speed", ["w", "scales", "x"], ["y"], bad, **kwargs)
    assert not np.allclose(yb, ref, rtol=0, atol=1e-3 * np.abs(ref).max())


def test_clang_message_names_the_kernel_line():
    with pytest.raises(SimulatorError, match=r"kernel\.metal:\d+:\d+: error: use of undeclared identifier 'zz'"):
        run_metal_kernel("bad", ["x"], ["y"], "y[0] = zz;", inputs=[np.ones(8, np.float32)],
                         output_shapes=[(1,)], output_dtypes=[np.float32], grid=(1, 1, 1),
                         threadgroup=(1, 1, 1))


def test_mlx_arrays_and_dtypes_are_accepted():
    mx = pytest.importorskip("mlx.core")
    src = "uint i = thread_position_in_grid.x; y[i] = bfloat16_t(float(x[i]) + 1.0f);"
    x = mx.array([1.0, 2.0, -3.0, 0.5, 8.0, 16.0, 0.25, -1.0], dtype=mx.bfloat16)
    (y,) = run_metal_kernel("mxin", ["x"], ["y"], src, inputs=[x], output_shapes=[(8,)],
                            output_dtypes=[mx.bfloat16], grid=(8, 1, 1), threadgroup=(8, 1, 1))
    got = (y.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got, np.array(x.astype(mx.float32)) + 1.0)


def test_stack_overflow_is_reported():
    src = """
      thread float big[100000];  // 400 KB of thread-private memory: more than a simulated stack
      for (int k = 0; k < 100000; k++) big[k] = x[k % 8] * float(k);
      y[0] = big[int(x[0]) + 99990];
    """
    with pytest.raises(SimulatorError, match="stack overflow"):
        run_metal_kernel("stack", ["x"], ["y"], src, inputs=[np.ones(8, np.float32)], output_shapes=[(1,)],
                         output_dtypes=[np.float32], grid=(2, 1, 1), threadgroup=(2, 1, 1))


def test_barriers_at_different_calls_are_reported():
    src = """
      uint lid = thread_index_in_threadgroup;
      threadgroup float buf[64];
      buf[lid] = x[lid];
      if (lid < 32) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
      } else {
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
      y[lid] = buf[63 - lid];
    """
    x = RNG.standard_normal(64).astype(np.float32)
    with pytest.raises(SimulatorError, match="different threadgroup_barrier calls"):
        run_metal_kernel("div2", ["x"], ["y"], src, inputs=[x], output_shapes=[(64,)],
                         output_dtypes=[np.float32], grid=(64, 1, 1), threadgroup=(64, 1, 1))


# ---- SIMD-group matrices ---------------------------------------------------------------------

# Two SIMD groups, each on its own 8x8 problem: A from device memory (row stride 11, origin
# (2, 1)), B loaded transposed from threadgroup memory, C from device; D = A B + C, E = A B,
# F = (2 I) A (diagonal constructor), G = filled(0.5) + A B; stored to device with a stride.
MATRIX_SRC = """
  const uint sg = simdgroup_index_in_threadgroup;
  const uint lane = thread_index_in_simdgroup;
  threadgroup float bt[2 * 64];
  for (uint k = lane; k < 64; k += 32) {
    bt[sg * 64 + k] = b[sg * 64 + k];          // b holds B^T row by row
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 A, B, C, D, E, F, G;
  simdgroup_load(A, a + sg * 9 * 11, 11, ulong2(2, 1));
  simdgroup_load(B, bt + sg * 64, 8, ulong2(0, 0), true);
  simdgroup_load(C, c + sg * 64);
  simdgroup_multiply_accumulate(D, A, B, C);
  simdgroup_multiply(E, A, B);
  simdgroup_multiply(F, simdgroup_float8x8(2.0f), A);
  G = make_filled_simdgroup_matrix<float, 8, 8>(0.5f);
  simdgroup_multiply_accumulate(G, A, B, G);
  simdgroup_store(D, out + sg * 4 * 80, 10);
  simdgroup_store(E, out + sg * 4 * 80 + 80, 10);
  simdgroup_store(F, out + sg * 4 * 80 + 160, 10);
  simdgroup_store(G, out + sg * 4 * 80 + 240, 10, ulong2(0, 0), true);
"""


def _matrix_case():
    a = RNG.standard_normal((2, 9, 11)).astype(np.float32)
    b = RNG.standard_normal((2, 8, 8)).astype(np.float32)      # B^T per SIMD group
    c = RNG.standard_normal((2, 8, 8)).astype(np.float32)
    return a, b, c


def test_simdgroup_matrix_ops_match_numpy():
    a, b, c = _matrix_case()
    (out,) = run_metal_kernel("mat", ["a", "b", "c"], ["out"], MATRIX_SRC, inputs=[a, b, c],
                              output_shapes=[(2, 4, 8, 10)], output_dtypes=[np.float32],
                              grid=(64, 1, 1), threadgroup=(64, 1, 1), init_value=-7.0)
    for g in range(2):
        A = a[g, 1:9, 2:10].astype(np.float64)
        B = b[g].T.astype(np.float64)
        AB = A @ B
        # float32 fma chains of 8 terms of size ~1: error below 1e-5
        np.testing.assert_allclose(out[g, 0, :, :8], AB + c[g], rtol=0, atol=1e-5)
        np.testing.assert_allclose(out[g, 1, :, :8], AB, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(out[g, 2, :, :8], (2 * A).astype(np.float32))
        np.testing.assert_allclose(out[g, 3, :, :8], (AB + 0.5).T, rtol=0, atol=1e-5)  # stored transposed
        assert (out[g, :, :, 8:] == -7.0).all()      # the stride's gap columns are untouched


def test_simdgroup_matrix_half():
    src = """
      simdgroup_half8x8 A, B, D;
      simdgroup_load(A, a);
      simdgroup_load(B, a, 8, ulong2(0, 0), true);
      simdgroup_multiply(D, A, B);
      simdgroup_store(D, out);
    """
    a = RNG.integers(-3, 4, size=(8, 8)).astype(np.float16)   # small integers: exact in half
    (out,) = run_metal_kernel("math", ["a"], ["out"], src, inputs=[a], output_shapes=[(8, 8)],
                              output_dtypes=[np.float16], grid=(32, 1, 1), threadgroup=(32, 1, 1))
    A = a.astype(np.float64)
    np.testing.assert_array_equal(out.astype(np.float64), A @ A.T)


def test_simdgroup_matrix_thread_element_layout():
    # Each lane holds 2 elements in Apple's layout (MLX steel mma.h get_coord): a store from
    # the matrix loaded from x, read back by one lane per element after simdgroup_barrier.
    src = """
      const uint lane = thread_index_in_simdgroup;
      threadgroup float t[64];
      simdgroup_float8x8 M;
      simdgroup_load(M, x);
      simdgroup_store(M, t);
      simdgroup_barrier(mem_flags::mem_threadgroup);
      out[lane] = t[lane];
      out[lane + 32] = t[lane + 32];
    """
    x = np.arange(64, dtype=np.float32)
    (out,) = run_metal_kernel("lay", ["x"], ["out"], src, inputs=[x], output_shapes=[(64,)],
                              output_dtypes=[np.float32], grid=(32, 1, 1), threadgroup=(32, 1, 1))
    np.testing.assert_array_equal(out, x)
    # without the simdgroup_barrier a lane reads elements other lanes have not stored yet
    bad = src.replace("simdgroup_barrier(mem_flags::mem_threadgroup);", "")
    with pytest.raises(SimulatorError, match="depends on the thread schedule"):
        run_metal_kernel("lay", ["x"], ["out"], bad, inputs=[x], output_shapes=[(64,)],
                         output_dtypes=[np.float32], grid=(32, 1, 1), threadgroup=(32, 1, 1))


def test_simdgroup_matrix_with_inactive_lanes_is_an_error():
    src = """
      if (thread_index_in_simdgroup < 16) {
        simdgroup_float8x8 M;
        simdgroup_load(M, x);
        simdgroup_store(M, out);
      }
    """
    x = np.arange(64, dtype=np.float32)
    with pytest.raises(SimulatorError, match="simdgroup_load with inactive lanes"):
        run_metal_kernel("inact", ["x"], ["out"], src, inputs=[x], output_shapes=[(64,)],
                         output_dtypes=[np.float32], grid=(32, 1, 1), threadgroup=(32, 1, 1))


@pytest.mark.parametrize("body,why", [
    ("simdgroup_matrix<float, 8, 4> M;", "8x8 matrices only"),
    ("simdgroup_matrix<int, 8, 8> M;", "element type must be float, half or bfloat"),
    ("float t[64]; simdgroup_float8x8 M; simdgroup_load(M, t); simdgroup_store(M, out);", "no matching function"),
    ("simdgroup_float8x8 M; simdgroup_load(M, h); simdgroup_store(M, out);", "no matching function"),
    ("simdgroup_float8x8 M; simdgroup_load(M, c); simdgroup_store(M, out);", "no matching function"),
])
def test_simdgroup_matrix_misuse_fails_to_compile(body, why):
    # Metal: 8x8 only; float/half/bfloat; loads from threadgroup or device memory of the
    # matrix's element type (a thread array, a half buffer, a constant buffer do not match).
    h = np.zeros(64, np.float16)
    c = np.zeros(4, np.float32)      # < 8 elements: the constant address space
    with pytest.raises(SimulatorError, match=f"(?s)failed to compile.*{why}"):
        run_metal_kernel("misuse", ["h", "c"], ["out"], body, inputs=[h, c], output_shapes=[(64,)],
                         output_dtypes=[np.float32], grid=(32, 1, 1), threadgroup=(32, 1, 1))


def test_missing_barrier_before_a_simd_op_is_caught():
    # SIMD groups run one at a time up to the next threadgroup barrier: a SIMD op right after
    # the write phase does not hide a missing barrier (SIMD group 0 reads SIMD group 1's slots
    # before they are written in the forward schedule, and the other way round in reverse).
    src = """
      uint lid = thread_index_in_threadgroup;
      threadgroup float buf[64];
      buf[lid] = x[lid];
      {BARRIER}
      const float n = simd_sum(1.0f);
      out[lid] = simd_sum(buf[(lid + 32) % 64]) / n;
    """
    x = RNG.standard_normal(64).astype(np.float32)
    kw = dict(inputs=[x], output_shapes=[(64,)], output_dtypes=[np.float32], grid=(64, 1, 1),
              threadgroup=(64, 1, 1))
    good = src.replace("{BARRIER}", "threadgroup_barrier(mem_flags::mem_threadgroup);")
    (out,) = run_metal_kernel("bsimd", ["x"], ["out"], good, **kw)
    np.testing.assert_allclose(out, np.repeat([x[32:].sum(), x[:32].sum()], 32) / 32, rtol=1e-5)
    with pytest.raises(SimulatorError, match="depends on the thread schedule"):
        run_metal_kernel("bsimd", ["x"], ["out"], src.replace("{BARRIER}", ""), **kw)


def test_simdgroup_matrix_thread_elements_follow_the_load_layout():
    """thread_elements() is the lane's own pair of a simdgroup_matrix, in the layout the loads
    and stores use (MLX steel's: row (l / 4 & 4) + (l / 2 % 4), columns (l / 4 & 2) * 2 + (l % 2)
    * 2 and + 1): a matrix loaded then read lane by lane, and one built lane by lane then stored,
    both give x back."""
    src = """
      ushort lane = thread_index_in_simdgroup;
      simdgroup_float8x8 m;
      simdgroup_load(m, x, 8);
      const int qid = lane / 4;
      const int r = (qid & 4) + (lane / 2) % 4;
      const int c = (qid & 2) * 2 + (lane % 2) * 2;
      read[r * 8 + c] = m.thread_elements()[0];
      read[r * 8 + c + 1] = m.thread_elements()[1];
      simdgroup_float8x8 w;
      w.thread_elements()[0] = x[r * 8 + c];
      w.thread_elements()[1] = x[r * 8 + c + 1];
      simdgroup_store(w, built, 8);
    """
    x = RNG.standard_normal(64).astype(np.float32)
    read, built = run_metal_kernel("te", ["x"], ["read", "built"], src, inputs=[x], output_shapes=[(64,), (64,)],
                                   output_dtypes=["float32", "float32"], grid=(32, 1, 1), threadgroup=(32, 1, 1))
    np.testing.assert_array_equal(read, x)
    np.testing.assert_array_equal(built, x)


@pytest.mark.parametrize("spawned", [True, False])
def test_both_launch_paths_run_and_catch_faults(monkeypatch, spawned):
    """Launches run in a spawned msl_runner on memfd buffers (Linux) or in a forked child on
    anonymous shared memory (elsewhere): each gives the block sums, reports a read past a
    buffer's guard page with the buffer's name, and stops a spinning kernel."""
    import tests.msl.simulator as sim

    if spawned and not sim._MEMFD:
        pytest.skip("no memfd on this platform: launches fork")
    if not spawned and sim.sanitizers():
        pytest.skip("the sanitizer build runs launches in the spawned runner only")
    monkeypatch.setattr(sim, "_MEMFD", spawned)
    x = RNG.standard_normal(256).astype(np.float32)
    (out,) = run_metal_kernel("reduce", ["x", "scale"], ["out"], REDUCE_SRC, inputs=[x, np.float32(0.5)],
                              output_shapes=[(2,)], output_dtypes=[np.float32], grid=(256, 1, 1),
                              threadgroup=(128, 1, 1))
    np.testing.assert_allclose(out, _block_sums(x, 0.5, 128), rtol=1e-5)
    src = "uint i = thread_position_in_grid.x; y[i] = x[i + 16];"
    with pytest.raises(SimulatorError, match=r"out-of-bounds access to buffer 'x' \(64 bytes\): 0 bytes past"):
        run_metal_kernel("oobr", ["x"], ["y"], src, inputs=[x[:16]], output_shapes=[(16,)],
                         output_dtypes=[np.float32], grid=(16, 1, 1), threadgroup=(16, 1, 1))
    spin = "uint i = 0; while (x[0] > 0.0f) { ((volatile device float*)y)[0] = float(i++); }"
    with pytest.raises(SimulatorError, match="did not finish"):
        run_metal_kernel("spin", ["x"], ["y"], spin, inputs=[np.ones(8, np.float32)], output_shapes=[(1,)],
                         output_dtypes=[np.float32], grid=(1, 1, 1), threadgroup=(1, 1, 1), timeout=1.0)


# The sanitizer build (COLIBRI_MSL_SANITIZE): undefined behaviour that the plain build runs
# through silently is a report, and the report fails the launch.
SANITIZER_DEFECTS = {
    # A shift by the type's width: undefined in C++ and in Metal; x86 masks the count, so the
    # plain build returns a value.
    "undefined-shift": ("undefined", "shift exponent", """
      uint i = thread_position_in_grid.x;
      uint sh = uint(x[i]) + 31u;  // 32 for x = 1
      y[i] = float(1u << sh);
    """),
    # Reading one past a threadgroup array: the plain build reads the next static.
    "threadgroup-array-bounds": ("undefined", "out of bounds", """
      uint i = thread_position_in_grid.x;
      threadgroup float buf[32];
      buf[i] = x[i];
      threadgroup_barrier(mem_flags::mem_threadgroup);
      y[i] = buf[i + uint(x[0])];  // index 32 for the last thread
    """),
    # Writing one past a thread-private array: the plain build overwrites the frame.
    "thread-array-overflow": ("address", "stack-buffer-overflow", """
      uint i = thread_position_in_grid.x;
      float acc[4];
      for (int k = 0; k < 4; k++) acc[k] = x[i] * float(k);
      volatile int n = 4 + int(x[0]);  // 5: one past the end, unknown to the compiler
      for (int k = 0; k < n; k++) acc[k] += 1.0f;
      y[i] = acc[0] + acc[3];
    """),
}


@pytest.mark.parametrize("defect", sorted(SANITIZER_DEFECTS))
def test_sanitizer_build_reports_undefined_behaviour(monkeypatch, defect):
    import tests.msl.simulator as sim

    if not sim._MEMFD:
        pytest.skip("the sanitizer build needs the spawned runner (memfds)")
    sanitizer, message, src = SANITIZER_DEFECTS[defect]
    x = np.ones(32, np.float32)
    run = lambda: run_metal_kernel("ub", ["x"], ["y"], src, inputs=[x], output_shapes=[(32,)],  # noqa: E731
                                   output_dtypes=[np.float32], grid=(32, 1, 1), threadgroup=(32, 1, 1))
    monkeypatch.delenv(sim.SANITIZE_ENV, raising=False)
    run()  # the plain build does not notice
    monkeypatch.setenv(sim.SANITIZE_ENV, sanitizer)
    with pytest.raises(SimulatorError, match=f"sanitizer report: .*{message}"):
        run()

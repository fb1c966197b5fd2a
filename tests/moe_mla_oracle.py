"""float64 numpy oracles for moe_block and mla_decode, and the MSL simulator runner for their
LaunchSpecs (shared by tests/test_moe_mla_msl.py and scripts/check_moe_mla_gpu.py).

Tolerances (same argument as kernel_oracle.py): each float32 dot product of n terms errs by at
most ~n * 2^-24 * sum|terms| (far less in practice), so every stage is checked against
1e-4 * (the same computation on absolute values). The bound is carried through the stages:
an error in g or u moves h = silu(g) * u by at most |silu'(g)| * dg * |u| + |silu(g)| * du with
|silu'| <= 1.1; an error in h moves y by at most |W_down| @ dh. Softmax weights are in [0, 1]
and the combine is a convex combination, so the attention stages are bounded by the magnitudes
of the values they average.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from colibri_mlx.formats import QTensor
from kernel_oracle import dequant_f64

REL = 1e-4


def weight_f64(w) -> np.ndarray:
    if isinstance(w, QTensor):
        return dequant_f64(w)
    return np.asarray(w.astype(mx.float32)).astype(np.float64)


def hadamard_f64(n: int) -> np.ndarray:
    """Q of FORMAT.md §3.6 for rows of length n (block diagonal D*H/sqrt(b)), float64."""
    from colibri_mlx.formats.e8 import block_tiling, sign_bits

    Q = np.zeros((n, n))
    off = 0
    for b in block_tiling(n):
        H = np.ones((1, 1))
        while H.shape[0] < b:
            H = np.block([[H, H], [H, -H]])
        D = np.where(sign_bits(b), -1.0, 1.0)
        Q[off:off + b, off:off + b] = D[:, None] * H / np.sqrt(b)
        off += b
    return Q


def _f64(a) -> np.ndarray:
    return np.asarray(mx.array(a).astype(mx.float32)).astype(np.float64)


def moe_oracle(x, experts, ids, weights) -> tuple[np.ndarray, np.ndarray]:
    """(y64 [N, D], error budget [N, D]) for moe_block."""
    x64, ids, w64 = _f64(x), np.asarray(ids), _f64(weights)
    N, K = ids.shape
    y = np.zeros((N, x64.shape[1]))
    bound = np.zeros_like(y)
    dense = {}
    for n in range(N):
        for k in range(K):
            e = int(ids[n, k])
            if e < 0 or e >= len(experts):
                continue
            if e not in dense:
                dense[e] = [weight_f64(p) for p in experts[e]]
            gate, up, down = dense[e]
            xe = x64[n]
            if isinstance(experts[e][0], QTensor) and experts[e][0].fmt == 6:
                xe = hadamard_f64(xe.size).T @ xe
            g, u = gate @ xe, up @ xe
            dg, du = REL * (np.abs(gate) @ np.abs(xe)), REL * (np.abs(up) @ np.abs(xe))
            sig = 1.0 / (1.0 + np.exp(-g))
            h = g * sig * u
            dh = 1.1 * dg * np.abs(u) + np.abs(g * sig) * du
            if isinstance(experts[e][2], QTensor) and experts[e][2].fmt == 6:
                Q = hadamard_f64(h.size)
                h, dh = Q.T @ h, np.abs(Q.T) @ dh
            y[n] += w64[n, k] * (down @ h)
            bound[n] += abs(w64[n, k]) * (REL * (np.abs(down) @ np.abs(h)) + np.abs(down) @ dh)
    return y, bound


def assert_moe_close(y, x, experts, ids, weights, label="", extra_rel=0.0):
    y64, bound = moe_oracle(x, experts, ids, weights)
    got = _f64(y)
    assert got.shape == y64.shape, f"{label}: shape {got.shape} != {y64.shape}"
    assert np.isfinite(got).all(), f"{label}: non-finite output"
    allowed = bound + extra_rel * np.abs(y64) + 1e-30
    ratio = np.abs(got - y64) / allowed
    assert ratio.max() <= 1.0, (f"{label}: error {np.abs(got - y64).max():.3g} exceeds its budget "
                                f"(worst ratio {ratio.max():.3g} at {np.unravel_index(ratio.argmax(), ratio.shape)})")
    return float(ratio.max())


# ---------------------------------------------------------------------------------------
# MSL simulator


def simulate(spec, simulator):
    """Run a LaunchSpec in the MSL simulator; returns the outputs as mx arrays."""
    def np_dtype(d):
        if d == mx.bfloat16:
            return simulator.BFLOAT16
        return {mx.float32: np.float32, mx.float16: np.float16, mx.uint8: np.uint8,
                mx.int32: np.int32, mx.uint32: np.uint32}[d]

    def np_input(a):
        if isinstance(a, mx.array) and a.dtype == mx.bfloat16:
            import ml_dtypes

            return np.asarray(a.view(mx.uint16)).view(ml_dtypes.bfloat16)
        return np.asarray(a)

    from colibri_mlx.kernels.kernel_text import launch_text

    header, source = launch_text(spec.header, spec.source, spec.name)   # the text MLX would be given
    outs = simulator.run_metal_kernel(
        spec.name, spec.input_names, spec.output_names, source, header,
        inputs=[np_input(a) for a in spec.inputs], output_shapes=spec.output_shapes,
        output_dtypes=[np_dtype(d) for d in spec.output_dtypes], grid=spec.grid,
        threadgroup=spec.threadgroup,
        template=[(n, np_dtype(v) if isinstance(v, mx.Dtype) else v) for n, v in spec.template],
        init_value=spec.init_value, written_inputs=spec.written_inputs)
    # Inputs written in place (mla_rows_into's cache) go back into the MLX arrays' own memory
    # (an evaluated array's numpy view writes through on the CPU), as the GPU would leave them.
    n_out = len(spec.output_names)
    for name, data in zip(spec.written_inputs, outs[n_out:]):
        a = spec.inputs[list(spec.input_names).index(name)]
        mx.eval(a)
        view = np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
        view[...] = np.asarray(data).view(view.dtype).reshape(view.shape)
    outs = outs[:n_out]
    res = []
    for o, d in zip(outs, spec.output_dtypes):
        o = np.asarray(o)
        if d == mx.bfloat16:
            res.append(mx.array((o.view(np.uint16).astype(np.uint32) << 16).view(np.float32)).astype(mx.bfloat16))
        else:
            res.append(mx.array(o))
    return res


# The attention stages' relative error per term when their operands are rounded to TF32 (the
# CUDA twin's mma variant): cvt.rna keeps 10 mantissa bits, |tf32(x) - x| <= 2^-11 |x|, so a
# product of two rounded operands errs by <= 2^-10 (1 + 2^-12) of its size (bf16 / f16 caches
# are exact in TF32: only q' or P is rounded, 2^-11), on top of the float32 accumulation (REL).
REL_TF32 = REL + 2.0**-10 * (1 + 2.0**-12)


def mla_oracle(q_nope, q_rope, latent, k_rope, kv_b, scale, mask, nope, v, selected=None, rel_attn=REL):
    """(out64 [B, H, L, v], error budget) of absorbed MLA in float64.

    Budget: the context is a convex combination of latent rows, so a score error ds moves it by
    at most 2 * ds * max|latent| (softmax is 1-Lipschitz from scores to weights in l1, times
    the row spread). ds <= rel_attn * (|q'|.|latent| + |q_rope|.|k_rope|) * scale plus the q'
    error REL * (|W_UK|^T |q_nope|) . |latent|; the combine errs by rel_attn * max|latent| (a
    weight rounded by a relative 2^-11 moves the convex combination by that much of the
    spread); out adds REL * |W_UV| @ |ctx| + |W_UV| @ dctx. ``rel_attn``: REL for float32
    arithmetic, REL_TF32 for TF32 tensor-core operands.
    """
    qn, qr, lat, kr = (_f64(a) for a in (q_nope, q_rope, latent, k_rope))
    B, H, L, _ = qn.shape
    T, R = lat.shape[1:]
    w = weight_f64(kv_b).reshape(H, nope + v, R)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q_abs = qn @ w_uk[None]                                   # [B, H, L, R]
    dq = REL * (np.abs(qn) @ np.abs(w_uk)[None])

    def over_t(a, c):  # [B, H, L, X] x [B, T, X] -> [B, H, L, T] through BLAS
        return a @ c[:, None].transpose(0, 1, 3, 2)

    s = (over_t(q_abs, lat) + over_t(qr, kr)) * scale
    ds = (rel_attn * (over_t(np.abs(q_abs), np.abs(lat)) + over_t(np.abs(qr), np.abs(kr)))
          + over_t(dq, np.abs(lat))) * abs(scale)
    allowed = np.ones((B, 1, L, T), bool) if mask is None else np.asarray(mask).reshape(B, 1, L, T)
    exists = np.ones((B, 1, L, T), bool)
    if selected is not None:
        exists = np.zeros((B, 1, L, T), bool)
        sel = np.asarray(selected)
        for b in range(B):
            for l in range(L):
                exists[b, 0, l, sel[b, l]] = True
    s = np.where(allowed, s, -1e30)
    s = np.where(exists, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ctx = p @ lat[:, None]
    spread = np.abs(lat).max(1)[:, None, None, :]          # [B, 1, 1, R]
    dctx = 2 * np.where(exists, ds, 0).max(-1, keepdims=True) * spread + rel_attn * spread
    w_uv_t = w_uv.transpose(0, 2, 1)[None]                   # [1, H, R, v]
    out = ctx @ w_uv_t
    bound = REL * (np.abs(ctx) @ np.abs(w_uv_t)) + np.broadcast_to(dctx, ctx.shape) @ np.abs(w_uv_t)
    return out, bound


def assert_mla_close(out, *args, label="", extra_rel=0.0, **kw):
    want, bound = mla_oracle(*args, **kw)
    got = _f64(out)
    assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{label}: non-finite output"
    ratio = np.abs(got - want) / (bound + extra_rel * np.abs(want) + 1e-30)
    assert ratio.max() <= 1.0, f"{label}: error {np.abs(got - want).max():.3g} over budget (ratio {ratio.max():.3g})"
    return float(ratio.max())


def simulator_or_skip():
    """The MSL simulator module, or a pytest skip where it cannot run (no clang)."""
    import pytest

    simulator = pytest.importorskip("msl.simulator")
    if not simulator.clang_available():
        pytest.skip("clang not available for the MSL simulator")
    return simulator


def route_launches_to_simulator(monkeypatch, simulator) -> list:
    """Send every hot-path kernel launch to the MSL simulator, as on a Mac (the GPU backend is
    Metal; force_reference / COLIBRI_KERNELS=reference still win). Returns the launched kernels'
    names, in order; expert banks are rebuilt for the Metal path."""
    from colibri_mlx.kernels import dispatch, moe

    launched = []

    def launch(backend, spec):
        assert backend == dispatch.METAL
        launched.append(spec.name)
        return simulate(spec, simulator)

    monkeypatch.setattr(dispatch, "launch", launch)
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: dispatch.METAL)
    # The simulator evaluates a launch's inputs on the host, which no mx.compile trace may do.
    monkeypatch.setenv("COLIBRI_COMPILE", "0")
    moe.clear_banks()
    dispatch.reset_counters()
    return launched


# mla_rows (a decode row's q_a / latent norms and rope key)


def rope_of(rope: int, factor: float = 1.0):
    from colibri_mlx.models.rope import RoPE

    # as make_rope's default: the reciprocal of float32 frequencies, so that each inverse
    # frequency is exactly 1 / a float32 (mx.fast.rope takes frequencies and divides on the GPU)
    freqs = (10000.0 ** (np.arange(0, rope, 2) / rope)).astype(np.float32)
    return RoPE(mx.array((1.0 / freqs.astype(np.float64)).astype(np.float32)), factor, False)


def rows_case(QL=48, R=160, rope=16, dtype=mx.float32, BL=1, seed=0):
    rng = np.random.default_rng(seed)
    y = mx.array((rng.standard_normal((BL, QL + R + rope)) * 3).astype(np.float32)).astype(dtype)
    qa_norm = mx.array(rng.uniform(0.5, 1.5, QL).astype(np.float32)).astype(dtype)
    kv_norm = mx.array(rng.uniform(0.5, 1.5, R).astype(np.float32)).astype(dtype)
    return y, qa_norm, kv_norm


def check_rows_into(shape, dtype, slot: int, capacity: int, kernel_path: bool):
    """kernels.mla_rows given the cache buffer: on the kernel path (``kernel_path``) the row goes
    into the buffer at ``slot`` in place (mla_rows_into) and ``kv`` comes back None: q_a and the
    written row equal mla_rows' own outputs bit for bit, every other row keeps its bytes. The
    reference path ignores the buffer and returns the row. Returns the launch counters."""
    from colibri_mlx import kernels
    from colibri_mlx.kernels import dispatch

    QL, R, rope_w = shape
    y, qa_norm, kv_norm = rows_case(QL, R, rope_w, dtype, seed=slot)
    rope = rope_of(rope_w)
    pos = mx.array(slot, dtype=mx.int32)
    want_qa, want_kv = kernels.mla_rows(y, QL, qa_norm, kv_norm, 1e-6, rope, pos)
    rng = np.random.default_rng(slot + 1)
    cache = mx.array(rng.standard_normal((1, capacity, R + rope_w)).astype(np.float32)).astype(dtype)
    mx.eval(want_qa, want_kv, cache)
    before = np.array(cache.view(mx.uint16) if dtype == mx.bfloat16 else cache)
    dispatch.reset_counters()
    got_qa, got_kv = kernels.mla_rows(y, QL, qa_norm, kv_norm, 1e-6, rope, pos, cache)
    counters = dispatch.counters()
    mx.eval(got_qa)
    bits = (lambda a: np.array(a.view(mx.uint16))) if dtype == mx.bfloat16 else np.array
    if not kernel_path:
        assert got_kv is not None and np.array_equal(bits(got_kv), bits(want_kv))
        assert np.array_equal(bits(got_qa), bits(want_qa))
        return counters
    assert got_kv is None
    after = bits(cache)
    assert np.array_equal(bits(got_qa), bits(want_qa)), "q_a differs from mla_rows'"
    assert np.array_equal(after[0, slot], bits(want_kv).reshape(-1)), f"row {slot} differs from mla_rows' kv"
    others = np.arange(capacity) != slot
    assert np.array_equal(after[:, others], before[:, others]), "rows other than the slot changed"
    return counters


def check_rows_qb_qabs(H, nope, v, R, rope_w, QL, dtype, slot: int, capacity: int, seed: int = 0) -> dict:
    """The attention's first launch taking the decode row too (mla_rows_qb_qabs: kernels.mla_rows'
    ``defer``) against the two launches it replaces (mla_rows_into, then mla_qb_qabs), bit for
    bit: the attention's output and the whole cache buffer (the row at the slot and nothing else;
    a slot past the capacity writes nothing). The two-launch path has its own oracles (mla_rows'
    and mla_qb_qabs' float64 tests). Returns the fused run's counters."""
    from colibri_mlx import kernels
    from colibri_mlx.kernels import dispatch, mla
    from kernel_oracle import random_qtensor

    y, qa_norm, kv_norm = rows_case(QL, R, rope_w, dtype, seed=seed)
    y = y.reshape(1, 1, -1)                       # one decode row in the model's [B, L, W]
    rope = rope_of(rope_w)
    kv_b = random_qtensor(4, H * (nope + v), R, gs=32, seed=seed + 1)
    q_b = random_qtensor(4, H * (nope + rope_w), QL, gs=32, seed=seed + 2)
    start = np.random.default_rng(seed + 3).standard_normal((1, capacity, R + rope_w)).astype(np.float32)
    pos = mx.array(slot, dtype=mx.int32)
    params = mla.step_params(kv_b, mx.zeros((1, capacity, R + rope_w), dtype), H, nope, rope_w, v, dtype,
                             min(slot + 1, capacity), joint=True)
    bits = (lambda a: np.array(a.view(mx.uint16))) if dtype == mx.bfloat16 else np.array

    def run(defer: bool):
        cache = mx.array(start).astype(dtype)     # a buffer of its own each run
        mx.eval(cache)
        dispatch.reset_counters()
        q_latent, kv = kernels.mla_rows(y, QL, qa_norm, kv_norm, 1e-6, rope, pos, cache, defer=defer)
        assert kv is None
        out = kernels.mla_decode(None, None, cache, None, kv_b, (nope + rope_w) ** -0.5, None, nope, v,
                                 params=params, rope=rope, rope_offset=pos, q_proj=(q_latent, q_b))
        mx.eval(out)
        return bits(out), bits(cache), dispatch.counters()

    want_out, want_cache, _ = run(False)
    got_out, got_cache, counters = run(True)
    before = bits(mx.array(start).astype(dtype))
    others = np.arange(capacity) != slot
    assert np.array_equal(got_cache[:, others], before[:, others]), "rows other than the slot changed"
    assert np.array_equal(got_cache, want_cache), "the cache row differs from mla_rows_into's"
    assert np.array_equal(got_out, want_out), "the attention's output differs from the two launches'"
    return counters


def rotated_f64(x: np.ndarray, inv_freq, position) -> tuple[np.ndarray, np.ndarray]:
    """``(x rotated half-split, the angles)``: float64 ``x [..., rope]`` at float32 angles
    (position * inv_freq rounded as the GPU ropes compute it), cos / sin in float64.
    ``position``: a scalar, or one per row of a 2-D ``x``."""
    pos = np.asarray(position, np.float32)
    theta = (pos[..., None] * np.asarray(inv_freq, np.float32)).astype(np.float64)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = np.cos(theta), np.sin(theta)
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1), theta


def rows_oracle(y, QL, qa_norm, kv_norm, eps, inv_freq, positions, angle_ulps=0):
    """float64 norms; the rotation at float32 angles (position * inv_freq rounded as MLX's GPU
    ropes compute it), cos / sin in float64. Bounds per element: magnitude-relative, two
    roundings to the output dtype (norms: x * r, then * w) or one (rope), plus float32 slack;
    ``angle_ulps``: angles computed another way (MLX's CPU rope) may differ by that many float32
    ulps of the angle."""
    x = np.asarray(y.astype(mx.float32)).astype(np.float64)
    wq, wk = (np.asarray(w.astype(mx.float32)).astype(np.float64) for w in (qa_norm, kv_norm))
    R = wk.shape[0]
    u = 2.0 ** -8 if y.dtype == mx.bfloat16 else 2.0 ** -11 if y.dtype == mx.float16 else 2.0 ** -22
    out, bound = [], []
    for part, w in ((x[:, :QL], wq), (x[:, QL:QL + R], wk)):
        r = 1 / np.sqrt((part ** 2).mean(-1, keepdims=True) + eps)
        want = w * part * r
        out.append(want)
        bound.append(3 * u * np.abs(want) + 1e-30)
    k = x[:, QL + R:]
    half = k.shape[1] // 2
    k_rot, theta = rotated_f64(k, inv_freq, positions)
    out.append(k_rot)
    mag = (np.abs(k[:, :half]) + np.abs(k[:, half:])) * (2 * u + 4e-7 + angle_ulps * 2.0 ** -23 * np.abs(theta))
    bound.append(np.concatenate([mag, mag], axis=1))
    return out, bound


def assert_rows_close(got, y, QL, qa_norm, kv_norm, eps, rope, positions, label="", angle_ulps=0):
    want, bound = rows_oracle(y, QL, qa_norm, kv_norm, eps, rope.inv_freq, positions, angle_ulps)
    q_a, kv = got                              # kv: the cache row, the latent then the rope key
    R = kv_norm.shape[0]
    assert kv.shape == (y.shape[0], y.shape[1] - QL), f"{label}: kv row {kv.shape}"
    for name, g, w, b in zip(("q_a", "latent", "rope key"), (q_a, kv[:, :R], kv[:, R:]), want, bound):
        g = np.asarray(g.astype(mx.float32)).astype(np.float64).reshape(w.shape)
        ratio = np.abs(g - w) / b
        assert ratio.max() <= 1.0, f"{label} {name}: error {np.abs(g - w).max():.3g}, ratio {ratio.max():.3g}"

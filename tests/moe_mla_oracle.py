"""float64 numpy oracles for moe_block and mla_decode, and the MSL simulator runner for their
LaunchSpecs (shared by the simulator tests of the MoE and MLA kernels).

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
    """Q of docs/format.md#rotation for rows of length n (block diagonal D*H/sqrt(b)), float64."""
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
            sig = np.exp(-np.logaddexp(0.0, -g))     # 1 / (1 + e^-g) without overflow for g << 0
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


def _mla_operands(q_nope, q_rope, latent, k_rope, kv_b, nope, v):
    """float64 (q_nope, q_rope, latent, k_rope, W_UK [H, nope, R], W_UV [H, v, R])."""
    qn, qr, lat, kr = (_f64(a) for a in (q_nope, q_rope, latent, k_rope))
    H, R = qn.shape[1], lat.shape[2]
    w = weight_f64(kv_b).reshape(H, nope + v, R)
    return qn, qr, lat, kr, w[:, :nope], w[:, nope:]


def _over_t(a, c):
    """[B, H, L, X] x [B, T, X] -> [B, H, L, T] through BLAS."""
    return a @ c[:, None].transpose(0, 1, 3, 2)


def _mla_softmax(s, mask, selected):
    """(p, allowed, exists) for scores s [B, H, L, T]: masked positions score -1e30 (as the
    kernels: they keep a weight where a whole row is masked), positions off a DSA list
    (``selected`` [B, L, P]) do not exist (-inf). allowed / exists: [B, 1, L, T]."""
    B, _, L, T = s.shape
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
    return p, allowed, exists


def mla_oracle(q_nope, q_rope, latent, k_rope, kv_b, scale, mask, nope, v, selected=None, rel_attn=REL):
    """(out64 [B, H, L, v], error budget) of absorbed MLA in float64.

    Budget: the context is a convex combination of latent rows, so a score error ds moves it by
    at most 2 * ds * max|latent| (softmax is 1-Lipschitz from scores to weights in l1, times
    the row spread). ds <= rel_attn * (|q'|.|latent| + |q_rope|.|k_rope|) * scale plus the q'
    error REL * (|W_UK|^T |q_nope|) . |latent|; the combine errs by rel_attn * max|latent| (a
    weight rounded by a relative 2^-11 moves the convex combination by that much of the
    spread); out adds REL * |W_UV| @ |ctx| + |W_UV| @ dctx. ``rel_attn``: REL for float32
    arithmetic, REL_TF32 for TF32 tensor-core operands (mla_oracle_tf32: a tighter budget).
    """
    qn, qr, lat, kr, w_uk, w_uv = _mla_operands(q_nope, q_rope, latent, k_rope, kv_b, nope, v)
    q_abs = qn @ w_uk[None]                                   # [B, H, L, R]
    dq = REL * (np.abs(qn) @ np.abs(w_uk)[None])
    s = (_over_t(q_abs, lat) + _over_t(qr, kr)) * scale
    ds = (rel_attn * (_over_t(np.abs(q_abs), np.abs(lat)) + _over_t(np.abs(qr), np.abs(kr)))
          + _over_t(dq, np.abs(lat))) * abs(scale)
    p, _, exists = _mla_softmax(s, mask, selected)
    ctx = p @ lat[:, None]
    spread = np.abs(lat).max(1)[:, None, None, :]          # [B, 1, 1, R]
    dctx = 2 * np.where(exists, ds, 0).max(-1, keepdims=True) * spread + rel_attn * spread
    w_uv_t = w_uv.transpose(0, 2, 1)[None]                   # [1, H, R, v]
    out = ctx @ w_uv_t
    bound = REL * (np.abs(ctx) @ np.abs(w_uv_t)) + np.broadcast_to(dctx, ctx.shape) @ np.abs(w_uv_t)
    return out, bound


def _assert_within(out, want, bound, label, extra_rel, budget_name):
    """``out`` within ``bound`` (+ extra_rel of |want|) of ``want``; returns the worst ratio."""
    got = _f64(out)
    assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{label}: non-finite output"
    ratio = np.abs(got - want) / (bound + extra_rel * np.abs(want) + 1e-30)
    assert ratio.max() <= 1.0, (f"{label}: error {np.abs(got - want).max():.3g} over {budget_name} "
                                f"(ratio {ratio.max():.3g} at {np.unravel_index(ratio.argmax(), ratio.shape)})")
    return float(ratio.max())


def assert_mla_close(out, *args, label="", extra_rel=0.0, **kw):
    """``out`` against mla_oracle's budget; returns the worst ratio error / budget."""
    return _assert_within(out, *mla_oracle(*args, **kw), label, extra_rel, "budget")


# ---------------------------------------------------------------------------------------
# mla_decode's CUDA tensor-core attention (mla_attn_mma / mla_attn_wide): a budget of what they
# round, instead of REL_TF32's worst case

U32 = 2.0**-24      # float32 unit roundoff (round to nearest: CUDA's float add / mul / fma)
P_TF32 = 2.0**-11   # cvt.rna to TF32, relative: half of 2^-10, the spacing of 10 stored bits


def tf32_rna(x) -> np.ndarray:
    """x rounded to float32, then to TF32 as cvt.rna.tf32.f32 (mla_decode.cu's tf32_bits): 10
    stored mantissa bits, to nearest, ties away from zero; a float32 with the low 13 bits zero.
    On the sign-magnitude bit pattern, adding half of the dropped range (0x1000) and clearing
    it rounds the magnitude half away; a carry into the exponent is the next binade (or inf).
    Non-finite values pass through."""
    x = np.asarray(x, np.float32)
    r = ((x.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isfinite(x), r, x)


def _f32_toward(x: np.ndarray, direction: float) -> np.ndarray:
    """The float32 nearest x on the side of ``direction`` (-inf: at most x, inf: at least x)."""
    y = x.astype(np.float32)
    off = (y < x) if direction > 0 else (y > x)
    return np.where(off, np.nextafter(y, np.float32(direction)), y).astype(np.float32)


def tf32_known(x64: np.ndarray, dx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(t, e): what the kernel holds for a value computed in float32 as any float32 within dx
    of x64, then rounded to TF32: t = tf32(fl32(x64)) (float64), and e >= |tf32(y) - t| over
    every such y. TF32 rounding is monotone, so tf32(y) lies between the TF32 values of the
    outermost float32 values of [x64 - dx, x64 + dx]; e = 0 where both are t (the kernel's value
    is known exactly), one or more TF32 spacings where the interval straddles a rounding
    boundary (the "straddle allowance")."""
    t = tf32_rna(x64).astype(np.float64)
    lo = tf32_rna(_f32_toward(x64 - dx, -np.inf)).astype(np.float64)
    hi = tf32_rna(_f32_toward(x64 + dx, np.inf)).astype(np.float64)
    return t, np.maximum(hi - t, t - lo)


def tc_dot_rel(n) -> np.ndarray:
    """Relative error (of sum|terms|) of a dot product of n exact products (TF32 x TF32 or TF32
    x 16-bit values: at most 22 significant bits, exact in float32) summed by chains of
    mma.m16n8k8 steps, then a few float32 adds (the k-parts' partial scores, two
    accumulators, the scale; or the rescales and the tiles' merge: counted by the callers).
    A step adds 8 products to its accumulator in one multi-operand adder that aligns the 9
    addends to the largest exponent and may truncate (the PTX ISA leaves the rounding of
    .f32 accumulation unspecified; measured tensor cores truncate): each addend then loses
    less than 2^-23 of the largest and the normalised result less than 2^-23 of itself, so a
    step errs by at most 10 * 2^-23 * (|c| + sum|its products|) <= 10 * 2^-23 * sum|the chain's
    terms|, and a chain of n / 8 steps by 1.25 * n * 2^-23 = 2.5 * n * U32 of sum|terms|: the
    recursive-summation bound with the unit roundoff doubled for truncation and a quarter more
    for the alignment. Whatever the chains' split (k-parts, head tiles), n bounds them all."""
    return 2.5 * (np.asarray(n, np.float64) + 8) * U32


def mla_scores_tf32(q_nope, q_rope, latent, k_rope, kv_b, scale, nope, v, q_rel=None):
    """The tensor-core kernels' scores as mla_oracle_tf32 models them (its docstring says why):
    (s [B, H, L, T] from the TF32 values the kernels hold, ds: the bound on |kernel's float32
    score - s| (accumulation and straddles, before masking), the latent as the kernels see it
    (a float32 cache rounded to TF32), W_UV [H, v, R]), all float64."""
    qn, qr, lat, kr, w_uk, w_uv = _mla_operands(q_nope, q_rope, latent, k_rope, kv_b, nope, v)
    if mx.array(latent).dtype == mx.float32:
        lat = tf32_rna(lat).astype(np.float64)
    if mx.array(k_rope).dtype == mx.float32:
        kr = tf32_rna(kr).astype(np.float64)
    q_err = (nope + 4) * U32 if q_rel is None else q_rel
    t, e_q = tf32_known(qn @ w_uk[None], q_err * (np.abs(qn) @ np.abs(w_uk)[None]))
    r = tf32_rna(qr).astype(np.float64)
    s = (_over_t(t, lat) + _over_t(r, kr)) * scale
    mag = _over_t(np.abs(t), np.abs(lat)) + _over_t(np.abs(r), np.abs(kr))
    ds = (tc_dot_rel(lat.shape[2] + kr.shape[2]) * mag + _over_t(e_q, np.abs(lat))) * abs(scale)
    return s, ds, lat, w_uv


def mla_oracle_tf32(q_nope, q_rope, latent, k_rope, kv_b, scale, mask, nope, v, selected=None,
                    q_rel=None, heavy=4096):
    """(out64 [B, H, L, v], error budget) for mla_decode's CUDA tensor-core attention
    (mla_attn_mma, mla_attn_wide) after mla_qabs, finishing in mla_out: a model of
    what those kernels round, not REL_TF32's worst case. Same arguments as mla_oracle.

    What is known exactly. The kernels multiply TF32 operands: q' | q_rope loaded with
    cvt.rna, a float32 cache rounded to TF32 when staged (for the scores and the combine
    alike; bf16 / f16 values are TF32 values), so the oracle rounds the cache as they do and
    computes with it. q_rope arrives as the given float32 values (mla_qabs copies them), so
    tf32(q_rope) is known. q' = W_UK^T q_nope comes from mla_qabs in float32, within
    dq = (nope + 4) U32 |q_nope| @ |W_UK| of the float64 q' (nope - 1 adds in any order, up
    to three roundings forming each term: the recursive-summation bound; ``q_rel`` replaces
    (nope + 4) U32, e.g. REL); its TF32 value t = tf32(fl32(q'64)) is known except where
    [q' - dq, q' + dq] straddles a TF32 rounding boundary: there the kernel may hold a
    neighbour, e_q (tf32_known) apart. The oracle's scores and everything after use t.

    Score error, per position i (a logit error D_i):
      |scale| * (tc_dot_rel(R + rope) * (|t|.|lat_i| + |tf32 q_rope|.|k_rope_i|)
      + e_q . |lat_i|)                       accumulation (tensor cores), straddles
      + 2^-23 (8 + n / 4 + 5 (max s - min s + 2 max D))
           expf's error (fast-math __expf: 2 + 1.17 |x| ulps) on P, on each chunk's rescale
           alpha (it scales the accumulator and l alike: a logit shift of the earlier chunks,
           one per chunk, n / 8 at most) and on mla_out's tile weights, and the rounding of
           s - m; x, the jumps of the running max and the tile maxima are within the scores'
           range. Masked positions score -1e30 exactly: no error.
    Softmax of scores off by |delta_i| <= D_i: w'_i = p_i e^delta_i / Z with
    |ln Z| <= Dbar = ln sum p_j e^D_j, so |w'_i - p_i| <= p_i (e^(D_i + Dbar) - 1) exactly (no
    linearisation), and, as sum (w'_i - p_i) = 0, the output moves by
    |sum_i (w'_i - p_i) (V_i - out)| <= sum_i p_i (e^(D_i + Dbar) - 1) |V_i - out|, with
    V_i = W_UV lat_i the position's value (absorbed MLA is attention with these values). In
    V space a score error moves the output along (V_i - out); |W_UV| @ (a latent-space bound)
    would add R terms of random sign at their worst (~sqrt(R) x looser).
    The combine: ctx = (sum_i w''_i (1 + rho_i) lat_i + e_num) / (1 + lambda), w'' <= G p with
    G = e^(max D + Dbar):
      rho_i: tf32(P_i), |rho_i| <= 2^-11, one factor per position and head, the same for
           every latent column, so in V space: 2^-11 G sum_i p_i |V_i| (l sums the unrounded
           weights: only the numerator sees it).
      e_num: the P . latent mma chains over a tile's positions (tc_dot_rel(n)) and the float32
           rescale per chunk and mla_out's merge (n / 4 + 8 roundings): per latent column,
           of sum_i w''_i (1 + rho_i) |lat_i|, through |W_UV|.
      lambda: l, a float32 sum of positive terms (in-chunk and shuffle adds, l * alpha + psum
           per chunk, the tiles' merge): (n / 2 + 16) U32 relative; it scales ctx, so
           lambda |out|.
    out = W_UV ctx in float32 (mla_out): (R + 4) U32 |W_UV| @ |ctx_kernel| (R - 1 adds, up to
    three roundings a term and the row scale), |ctx_kernel| bounded from the terms above.
    n: the row's positions (the cache length or the DSA list). The latent-space bound
    (|V_i - out| <= |W_UV| @ (|lat_i| + |ctx|), several times looser over diffuse weights)
    covers positions beyond the ``heavy`` of most weight in a batch row (V for every position of
    a 40000-long cache and 128 heads would be 670 GFLOP).
    """
    s, ds, lat, w_uv = mla_scores_tf32(q_nope, q_rope, latent, k_rope, kv_b, scale, nope, v, q_rel)
    B, H, L, T = s.shape
    R = lat.shape[2]
    p, allowed, exists = _mla_softmax(s, mask, selected)
    live = allowed & exists                                   # [B, 1, L, T]
    n = exists.sum(-1, keepdims=True).astype(np.float64)      # [B, 1, L, 1]
    s_max = np.where(live, s, -np.inf).max(-1, keepdims=True)
    s_min = np.where(live, s, np.inf).min(-1, keepdims=True)
    s_range = np.where(np.isfinite(s_max), s_max - s_min, 0.0)
    d_max = np.where(live, ds, 0).max(-1, keepdims=True)
    exp_err = 2.0**-23 * (8 + n / 4 + 5 * (s_range + 2 * d_max))
    D = np.where(live, ds + exp_err, 0.0)
    d_bar = np.log((p * np.exp(D)).sum(-1, keepdims=True))
    grow = np.expm1(D + d_bar)                                # |w'_i / p_i - 1|
    G = np.exp(D.max(-1, keepdims=True) + d_bar)

    ctx = p @ lat[:, None]                                    # [B, H, L, R]
    w_uv_t = w_uv.transpose(0, 2, 1)[None]                   # [1, H, R, v]
    out = ctx @ w_uv_t
    # V space over each batch row's `heavy` positions of most weight, latent space beyond
    shift = np.zeros_like(out)                                # sum_i p_i grow_i |V_i - out|
    mass = np.zeros_like(out)                                 # sum_i p_i |V_i|
    rest = np.ones((B, 1, 1, T), bool)
    for b in range(B):
        heaviest = np.argsort(-p[b].max(axis=(0, 1)), kind="stable")[:heavy]
        rest[b, 0, 0, heaviest] = False
        for k0 in range(0, len(heaviest), 512):                # V [H, 512, v] a block: ~70 MB at 128 heads
            idx = heaviest[k0:k0 + 512]
            V = lat[b, idx][None] @ w_uv_t[0]
            for l in range(L):
                pk = p[b][:, l][:, idx, None].transpose(0, 2, 1)  # [H, 1, K]
                shift[b, :, l] += ((pk * grow[b][:, l][:, idx, None].transpose(0, 2, 1))
                                   @ np.abs(V - out[b, :, l, None, :]))[:, 0]
                mass[b, :, l] += (pk @ np.abs(V))[:, 0]
    p_rest, pg_rest = p * rest, p * grow * rest
    abs_uv = np.abs(w_uv_t)
    shift += ((pg_rest @ np.abs(lat)[:, None]) + pg_rest.sum(-1, keepdims=True) * np.abs(ctx)) @ abs_uv
    mass += (p_rest @ np.abs(lat)[:, None]) @ abs_uv

    p_lat = p @ np.abs(lat)[:, None]                          # sum_i p_i |lat_i|, [B, H, L, R]
    rel_num = tc_dot_rel(n) + (n / 4 + 8) * U32
    lam = (n / 2 + 16) * U32
    attn = (shift + P_TF32 * G * mass + (rel_num * (1 + P_TF32) * G * p_lat) @ abs_uv + lam * np.abs(out)) / (1 - lam)
    ctx_grow = G * (1 + P_TF32) * (1 + rel_num) / (1 - lam) - 1  # |ctx_kernel - ctx| <= ctx_grow (p_lat + |ctx|)
    ctx_kernel = np.abs(ctx) + ctx_grow * (p_lat + np.abs(ctx))
    bound = attn + (R + 4) * U32 * (ctx_kernel @ abs_uv)
    return out, bound


def assert_mla_close_tf32(out, *args, label="", extra_rel=0.0, **kw):
    """assert_mla_close against mla_oracle_tf32's budget; returns the worst ratio error / budget."""
    return _assert_within(out, *mla_oracle_tf32(*args, **kw), label, extra_rel, "the TF32 model's budget")


def simulator_or_skip():
    """The MSL simulator module, or a pytest skip where it cannot run (no clang)."""
    import pytest

    simulator = pytest.importorskip("msl.simulator")
    if simulator.unavailable_reason():
        pytest.skip(f"MSL simulator: {simulator.unavailable_reason()}")
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

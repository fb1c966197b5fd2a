"""fmt 6 (E8/IQ3 lattice + Walsh–Hadamard rotation) against independent oracles (docs/format.md#fmt-6-e8-iq3-lattice)."""

import numpy as np
import pytest

from colibri_mlx.formats import e8

gguf_quants = pytest.importorskip("gguf.quants")


def _rng(seed=0):
    return np.random.default_rng(seed)


# ---- tables -----------------------------------------------------------------------------------

def test_grid_equals_gguf_iq3xxs_grid():
    gguf_quants.IQ3_XXS.init_grid()
    ref = np.asarray(gguf_quants.IQ3_XXS.grid, dtype=np.float32).reshape(256, 4)
    assert e8.GRID.dtype == np.uint8 and e8.GRID.shape == (256, 4)
    np.testing.assert_array_equal(e8.GRID.astype(np.float32), ref)
    assert set(np.unique(e8.GRID)) == {4, 12, 20, 28, 36, 44, 52, 62}


@pytest.mark.parametrize("n, first8", [
    (256, "de658f1678eea03b"), (512, "153331ea11c078fc"), (1024, "3bc2ac6aeab15146"),
    (2048, "a038f927cb70352e"), (4096, "0b178fd2ccf13027"),
])
def test_sign_stream_vectors(n, first8):
    bits = e8.sign_bits(n)
    assert bits.shape == (n,)
    got = np.packbits(bits[:64].astype(np.uint8), bitorder="little").tobytes().hex()
    assert got == first8


@pytest.mark.parametrize("n, tiling", [
    (6144, [2048, 4096]), (1536, [512, 1024]), (2048, [2048]), (7168, [1024, 2048, 4096]),
    (65536, [32768, 32768]), (7, [1, 2, 4]),
])
def test_block_tiling(n, tiling):
    assert e8.block_tiling(n) == tiling


# ---- rotation -----------------------------------------------------------------------------

def _rotate_f64(x):
    """Dense float64 oracle: x @ Q per block, Q = D H / sqrt(b) with H the Sylvester matrix."""
    out, off = np.empty_like(x, dtype=np.float64), 0
    for b in e8.block_tiling(x.shape[-1]):
        h = np.ones((1, 1))
        while len(h) < b:
            h = np.block([[h, h], [h, -h]])
        q = np.where(e8.sign_bits(b), -1.0, 1.0)[:, None] * h / np.sqrt(b)
        out[..., off:off + b] = x[..., off:off + b].astype(np.float64) @ q
        off += b
    return out


@pytest.mark.parametrize("dim", [256, 1536, 6144, 7])
def test_rotate_rows_matches_dense_float64(dim):
    x = _rng(1).standard_normal((3, dim)).astype(np.float32)
    got = e8.rotate_rows(x)
    ref = _rotate_f64(x)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_rotation_preserves_products():
    """(W Q)(Q^T x) = W x: rotating both sides keeps every dot product (dim 6144)."""
    rng = _rng(2)
    w = rng.standard_normal((16, 6144)).astype(np.float32)
    x = rng.standard_normal((4, 6144)).astype(np.float32)
    y_ref = w.astype(np.float64) @ x.astype(np.float64).T
    y_rot = e8.rotate_rows(w).astype(np.float64) @ e8.rotate_rows(x).astype(np.float64).T
    rel = np.abs(y_rot - y_ref).max() / np.abs(y_ref).max()
    assert rel < 1e-5
    assert not np.allclose(e8.rotate_rows(w), w)      # it really rotated


def test_rotate_rows_matches_butterfly_transcription():
    """Bit-exact vs the in-place butterfly written as in docs/format.md#rotation (upstream's rounding)."""
    x = _rng(3).standard_normal((5, 1536)).astype(np.float32)
    ref, off = x.copy(), 0
    for b in e8.block_tiling(1536):
        blk = ref[:, off:off + b] * np.where(e8.sign_bits(b), -1, 1).astype(np.float32)
        h = 1
        while h < b:
            v = blk.reshape(5, b // (2 * h), 2, h)
            a, c = v[:, :, 0].copy(), v[:, :, 1].copy()
            v[:, :, 0], v[:, :, 1] = a + c, a - c
            h *= 2
        ref[:, off:off + b] = blk / np.sqrt(b, dtype=np.float32)
        off += b
    np.testing.assert_array_equal(e8.rotate_rows(x), ref)


@pytest.mark.parametrize("shape", [(2, 3, 6144), (5, 1536), (4, 7)])
def test_mlx_rotate_equals_numpy(shape):
    mx = pytest.importorskip("mlx.core")
    x = _rng(4).standard_normal(shape).astype(np.float32)
    got = np.array(e8.rotate(mx.array(x)))
    assert got.shape == shape
    np.testing.assert_array_equal(got, e8.rotate_rows(x))
    got_bf16 = np.array(e8.rotate(mx.array(x).astype(mx.bfloat16)))
    x_bf16 = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(got_bf16, e8.rotate_rows(x_bf16))


# ---- decoding -----------------------------------------------------------------------------

def _random_blocks(n, rng):
    """Random but valid super-blocks: any index/sign/code bytes, finite positive normal d."""
    blocks = rng.integers(0, 256, size=(n, e8.BLOCK_BYTES), dtype=np.uint8)
    d = rng.uniform(1e-3, 2.0, size=n).astype(np.float16)
    blocks[:, 96:98] = d.view(np.uint8).reshape(n, 2)
    return blocks


def _decode_f64(blocks):
    """Per-weight float64 decoder written from docs/format.md#fmt-6-e8-iq3-lattice, one weight at a time."""
    out = np.empty((len(blocks), 256))
    for n, blk in enumerate(blocks):
        d = float(np.frombuffer(blk[96:98].tobytes(), "<f2")[0])
        for ib in range(8):
            word = int.from_bytes(blk[64 + 4 * ib:68 + 4 * ib].tobytes(), "little")
            db = d * (0.5 + (word >> 28)) * 0.5
            for lane in range(4):
                seven = (word >> (7 * lane)) & 0x7F
                s8 = seven | ((bin(seven).count("1") & 1) << 7)
                for j in range(8):
                    g = int(e8.GRID[blk[8 * ib + 2 * lane + j // 4], j % 4])
                    mag = g * 0.5 * db
                    out[n, 32 * ib + 8 * lane + j] = -mag if (s8 >> j) & 1 else mag
    return out


def test_decode_matches_float64_per_weight_decoder():
    blocks = _random_blocks(6, _rng(5))
    got = e8.decode_e8(blocks.reshape(-1), 2, 768)
    ref = _decode_f64(blocks).reshape(2, 768)
    # d * (0.5+code) * 0.5 * g/2 has <= 11+5+5 significant bits: float32 holds it exactly.
    np.testing.assert_array_equal(got, ref.astype(np.float32))
    assert np.all(np.abs(got) > 0)


def test_decode_matches_gguf_iq3_xxs():
    """Colibri blocks = GGML IQ3_XXS with fields reordered and d doubled (docs/format.md#fmt-6-e8-iq3-lattice)."""
    gguf_quants.IQ3_XXS.init_grid()
    blocks = _random_blocks(64, _rng(6))
    d = np.frombuffer(blocks[:, 96:98].tobytes(), "<f2")
    ggml = np.concatenate([(d / 2).astype("<f2").view(np.uint8).reshape(-1, 2), blocks[:, :96]], 1)
    ref = gguf_quants.IQ3_XXS.dequantize_blocks(ggml).reshape(4, 4096)
    np.testing.assert_array_equal(e8.decode_e8(blocks.reshape(-1), 4, 4096), ref)


def test_decode_partial_last_block_and_bad_sizes():
    blocks = _random_blocks(4, _rng(7))
    full = e8.decode_e8(blocks.reshape(-1), 2, 512)
    np.testing.assert_array_equal(e8.decode_e8(blocks.reshape(-1), 2, 300), full[:, :300])
    with pytest.raises(ValueError, match="needs 392 bytes"):
        e8.decode_e8(blocks.reshape(-1)[:-1], 2, 512)


# ---- encoding -----------------------------------------------------------------------------

def _dot_fma_chain(q, g):
    """float32 q.g for every grid row, rounded like iq3_pack's ``q @ g.T`` on OpenBLAS sgemm:
    one fused multiply-add per term, k = 0..3 (q*g is exact in float64, so each step is one
    float32 rounding)."""
    acc = np.zeros(len(g), np.float32)
    for k in range(4):
        acc = (np.float64(q[k]) * g[:, k].astype(np.float64) + acc).astype(np.float32)
    return acc


def _encode_reference(w_rot):
    """Straightforward per-super-block encoder after upstream's iq3_pack.encode (float32 like it)."""
    g = e8.GRID.astype(np.float32) * np.float32(0.5)
    g2 = (g * g).sum(1)
    out = []
    for x in np.asarray(w_rot, np.float32).reshape(-1, 256):
        neg = [bool(v < 0) for v in x]
        mag = np.abs(x)
        for grp in range(32):
            if sum(neg[8 * grp:8 * grp + 8]) % 2:
                j = 8 * grp + int(np.argmin(mag[8 * grp:8 * grp + 8]))
                neg[j] = not neg[j]
        d = np.sqrt((mag * mag).mean(keepdims=True)) / 20.0 + 1e-12
        d16 = d.astype(np.float16)
        d = d16.astype(np.float32)
        blk = bytearray(98)
        for ib in range(8):
            m = mag[32 * ib:32 * ib + 32]
            best = None
            for code in range(16):
                db = d * (0.5 + code) * 0.5
                idx = []
                for grp in range(8):
                    q = m[4 * grp:4 * grp + 4] / np.maximum(db, 1e-20)
                    idx.append(int(np.argmin(g2 - 2.0 * _dot_fma_chain(q, g))))
                err = ((g[idx].reshape(1, 32) * db - m[None]) ** 2).sum(-1)[0]
                if best is None or err < best[0]:
                    best = (err, code, idx)
            _, code, idx = best
            blk[8 * ib:8 * ib + 8] = bytes(idx)
            word = code << 28
            for lane in range(4):
                for j in range(7):
                    word |= int(neg[32 * ib + 8 * lane + j]) << (7 * lane + j)
            blk[64 + 4 * ib:68 + 4 * ib] = word.to_bytes(4, "little")
        blk[96:98] = d16.astype("<f2").tobytes()
        out.append(bytes(blk))
    return np.frombuffer(b"".join(out), np.uint8)


def _edge_case_rows():
    rng = _rng(8)
    rows = rng.standard_normal((6, 512)).astype(np.float32)
    rows[0, :256] = 0.0                                   # all-zero super-block
    rows[1, :256] = -0.0                                  # negative zeros count as positive
    rows[2, :8] = [-5, 2, 3, 4, 5, 6, 7, 8]               # one negative: parity flips the min
    rows[2, 8:16] = [-3, 1, 1, 2, 5, 6, 7, 8]             # tied minima: the first one flips
    rows[3, :256] = np.repeat(np.float32(0.37), 256)      # constant block: exact score ties
    rows[4, :256] = rng.choice([-2.0, -1.0, 1.0, 2.0], 256).astype(np.float32)  # few levels
    rows[5, :256] *= 1e-4                                 # subnormal fp16 d
    return rows


@pytest.mark.parametrize("rows", [
    pytest.param(lambda: _rng(9).standard_normal((4, 512)).astype(np.float32), id="gaussian"),
    pytest.param(lambda: (_rng(10).standard_t(3, (2, 768)) * 0.02).astype(np.float32), id="heavy-tail"),
    pytest.param(_edge_case_rows, id="edge-cases"),
])
@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_encode_bit_exact_vs_reference(rows, backend):
    w = rows()
    packed, scales = e8.encode_rotated_e8(w, backend=backend)
    assert packed.dtype == np.uint8 and packed.shape == (98 * w.size // 256,)
    np.testing.assert_array_equal(scales, np.array([6.0], np.float32))
    np.testing.assert_array_equal(packed, _encode_reference(w))


def test_encode_parity_and_signs_in_stored_block():
    w = _edge_case_rows()
    dec = e8.decode_e8(e8.encode_rotated_e8(w)[0], *w.shape)
    assert np.all(dec[2, :2] < 0) and np.all(dec[2, 2:8] > 0)      # odd lane: the minimum flips...
    assert np.all(dec[2, 8:10] < 0) and np.all(dec[2, 10:16] > 0)   # ...the first of tied minima
    neg = (dec.reshape(-1, 8) < 0).sum(-1)
    assert np.all(neg % 2 == 0)
    # All-zero block: d = 1e-12 rounds to fp16 0, so it decodes to +0.0 (no sign bits set).
    assert not np.signbit(dec[:2, :256]).any() and not dec[:2, :256].any()


def test_encode_e8_rotates_first():
    w = _rng(11).standard_normal((3, 512)).astype(np.float32)
    np.testing.assert_array_equal(e8.encode_e8(w)[0], e8.encode_rotated_e8(e8.rotate_rows(w))[0])


def test_encode_decode_encode_is_stable():
    w = _rng(12).standard_normal((8, 1024)).astype(np.float32)
    packed = e8.encode_rotated_e8(w)[0]
    dec = e8.decode_e8(packed, 8, 1024)
    dec2 = e8.decode_e8(e8.encode_rotated_e8(dec)[0], 8, 1024)
    # Re-encoding a decoded matrix lands on (almost) the same points; d may move by an fp16 ulp.
    rel = np.sqrt(((dec2 - dec) ** 2).mean() / (dec ** 2).mean())
    assert rel < 0.05


def test_reconstruction_error_like_iq3_xxs():
    w = _rng(13).standard_normal((32, 2048)).astype(np.float32)
    packed, _ = e8.encode_e8(w)
    rec = e8.decode_e8(packed, 32, 2048)
    w_rot = e8.rotate_rows(w)
    rel = np.sqrt(((rec - w_rot) ** 2).mean() / (w_rot ** 2).mean())
    assert 0.05 < rel < 0.25          # ~3 bits/weight; IQ3_XXS-grade, not lossless


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError, match="I % 256"):
        e8.encode_e8(np.ones((2, 300), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        e8.encode_rotated_e8(np.ones(512, np.float32))


# ---- compiled core (_e8_encode.c) vs numpy and the reference ------------------------------------

@pytest.fixture(scope="module")
def lib():
    lib, why = e8._load_compiled()
    if lib is None:
        pytest.skip(f"C encoder unavailable: {why}")
    return lib


def _fma32(a, b, c):
    """Exactly rounded float32 fma(a, b, c), vectorized: a*b is exact in float64; the float64
    sum is made round-to-odd (correct under a second rounding to 24 bits) before the cast."""
    a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bp = s - c
    err = (p - bp) + (c - (s - bp))                      # TwoSum: s + err == p + c exactly
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.copysign(np.inf, err)), s)
    return s.astype(np.float32)


def _nearest_upstream(q):
    """[N, 4] -> [N]: first argmin of |g|^2 - 2 q.g, the dot an exact FMA chain (OpenBLAS)."""
    g = e8.GRID.astype(np.float32) * np.float32(0.5)
    g2 = (g * g).sum(1)
    q = np.asarray(q, np.float32)
    acc = np.zeros((len(q), 256), np.float32)
    for k in range(4):
        acc = _fma32(q[:, k:k + 1], g[None, :, k], acc)
    return np.argmin(g2 - np.float32(2) * acc, axis=1).astype(np.uint8)


def test_fma32_helper_is_exact():
    rng = _rng(20)
    a, b, c = (rng.standard_normal(20000) * 10.0 ** rng.integers(-12, 12, 20000) for _ in range(3))
    # a*b exactly halfway between two floats, c tiny: only a single rounding gets these right
    a[:3], b[:3], c[:3] = 1 + 2.0 ** -23, 1.5, [2.0 ** -80, -(2.0 ** -80), 0.0]
    a, b, c = (v.astype(np.float32) for v in (a, b, c))
    one_ulp, two_ulp = 1.5 + 2.0 ** -23, 1.5 + 2.0 ** -22
    np.testing.assert_array_equal(_fma32(a[:3], b[:3], c[:3]), [two_ulp, one_ulp, two_ulp])
    from fractions import Fraction
    for i in [0, 1, 2, *range(3, 20000, 97)]:
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        below = np.float32(float(exact))                 # float64 of exact, then float32
        cands = [np.nextafter(below, np.float32(-np.inf)), below,
                 np.nextafter(below, np.float32(np.inf))]
        best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact),   # ties: even
                                         int(np.float32(v).view(np.int32)) & 1))
        assert _fma32(a[i:i + 1], b[i:i + 1], c[i:i + 1])[0] == best


def _adversarial_queries(rng):
    """q's on and around the float ties of the grid search and the C core's cell edges."""
    g = e8.GRID.astype(np.float64) * 0.5
    parts = [rng.uniform(0, 70, (4000, 4)), rng.uniform(0, 4, (1000, 4)),
             rng.integers(0, 66, (4000, 4)).astype(np.float64),             # many exact ties
             rng.integers(0, 130, (4000, 4)) * 0.5,
             np.exp(rng.uniform(0, 14, (1000, 4)))]                       # far beyond the cells
    i, j = rng.integers(0, 256, (2, 12000))
    near = np.abs(g[i] - g[j]).sum(1) <= 12
    mid = (g[i[near]] + g[j[near]]) / 2                                    # equidistant points
    v = rng.standard_normal(mid.shape)
    axis = g[i[near]] - g[j[near]]
    v -= axis * ((v * axis).sum(1) / np.maximum((axis * axis).sum(1), 1))[:, None]
    parts += [mid, np.abs(mid + v * rng.uniform(0, 3, (len(v), 1)))]       # on the bisector
    edges = np.array([0, 2, 4, 16, 30, 32, 36, 60, 62, 64, 68], np.float32)
    e = rng.choice(edges, (4000, 4))
    parts.append(e)
    q = np.concatenate([p.astype(np.float32) for p in parts])
    ulps = rng.integers(-2, 3, q.shape).astype(np.float32)
    wiggled = q + ulps * np.spacing(np.maximum(q, np.float32(1)))           # a few ulps off
    return np.concatenate([q, wiggled, np.zeros((1, 4), np.float32)]).astype(np.float32)


def test_compiled_nearest_equals_upstream_argmin(lib):
    q = np.ascontiguousarray(_adversarial_queries(_rng(21)))
    got = np.full(len(q), 7, np.uint8)
    lib.e8_nearest(e8._ptr(q), len(q), e8._ptr(got))
    ref = _nearest_upstream(q)
    bad = np.nonzero(got != ref)[0]
    assert len(bad) == 0, f"{len(bad)} of {len(q)} differ, e.g. q={q[bad[:3]]}"
    assert len(np.unique(ref)) > 200                     # the queries reach most of the grid
    np.testing.assert_array_equal(e8._nearest_grid(q), ref)   # and the numpy path agrees


def _d_of(x):
    mag = np.abs(x)
    d = np.sqrt((mag * mag).mean(-1, keepdims=True)) / 20.0 + 1e-12
    return d.astype(np.float16).astype(np.float32)


def _tie_blocks(rng, n):
    """Super-blocks whose sub-blocks sit on exact ties of the grid search for some code: each
    group of 4 is the midpoint of two neighbouring grid points at that code's db (the block's
    own fp16 d, iterated to a fixed point), or a grid point itself."""
    g = e8.GRID.astype(np.float32) * np.float32(0.5)
    x = rng.standard_normal((n, 256)).astype(np.float32)
    for _ in range(6):
        d = _d_of(x)
        code = rng.integers(0, 16, (n, 8, 1))
        db = (d[:, :, None] * (np.float32(0.5) + code.astype(np.float32)) * np.float32(0.5))
        i, j = rng.integers(0, 256, (2, n, 8, 8))
        both = rng.random((n, 8, 8)) < 0.7
        pts = np.where(both[..., None], (g[i] + g[j]) * np.float32(0.5), g[i])   # [n, 8, 8, 4]
        mags = pts.reshape(n, 8, 32) * db
        x = (mags * rng.choice([-1, 1], mags.shape)).reshape(n, 256).astype(np.float32)
    return x


def _adversarial_matrix(rng):
    rows = [rng.standard_normal((8, 256)), rng.standard_t(1, (8, 256)) * 1e-3,
            rng.standard_t(3, (8, 256)), _tie_blocks(rng, 24),
            np.repeat(rng.standard_normal((8, 1)), 256, 1),                 # constant blocks
            rng.choice([-3.0, -1.0, 0.0, 1.0, 3.0], (8, 256)),              # few levels
            rng.standard_normal((8, 256)) * 1e-6,                          # subnormal fp16 d
            rng.standard_normal((4, 256)) * 1e-11,                         # d rounds to 0
            rng.standard_normal((4, 256)) * 1e5]
    spiky = rng.standard_normal((8, 256)) * 1e-3
    spiky[np.arange(8), rng.integers(0, 256, 8)] = 50.0                     # q far beyond the cells
    rows.append(spiky)
    dec = e8.decode_e8(e8.encode_rotated_e8(rng.standard_normal((8, 256)).astype(np.float32),
                                            backend="numpy")[0], 8, 256)
    rows.append(dec)                                                        # on the grid already
    w = np.concatenate([np.asarray(r, np.float32).reshape(-1, 256) for r in rows])
    return w[rng.permutation(len(w))]


def _sub_blocks(w):
    """[N, 256] -> magnitudes [8N, 32] and each sub-block's stored d [8N] (as the encoder)."""
    return np.abs(w).reshape(-1, 32), np.repeat(_d_of(w)[:, 0], 8)


def test_compiled_code_bounds_are_lower_bounds(lib):
    """The pruning is exact only if no code's bound exceeds its float32 error."""
    rng = _rng(46)
    exact = e8.decode_e8(e8.encode_rotated_e8(rng.standard_normal((32, 256)).astype(np.float32),
                                              backend="numpy")[0], 32, 256)
    w = np.concatenate([_adversarial_matrix(rng), exact]).astype(np.float32)
    m, d = _sub_blocks(w)
    keep = d > 0
    m, d = np.ascontiguousarray(m[keep]), np.ascontiguousarray(d[keep])
    bounds = np.full((len(m), 16), np.nan)
    lib.e8_code_bounds(e8._ptr(m), e8._ptr(d), len(m), e8._ptr(bounds))
    errs = np.stack([e8._code_error(m, d[:, None], np.full(len(m), c))[0] for c in range(16)], 1)
    assert np.all(bounds <= errs)
    assert np.all(bounds >= 0) and np.quantile(bounds / np.maximum(errs, 1e-30), 0.9) > 0.4


def _code_tie_blocks(rng):
    """Sub-blocks that several codes reproduce exactly (error 0): m = 2.5 d (codes 0 and 2)
    or 7.5 d (codes 1, 2 and 7); the rest of the block is random. Iterated so that d is the
    block's own fp16 scale."""
    x = rng.standard_normal((8, 256)).astype(np.float32)
    k = np.where(np.arange(8) % 2, 7.5, 2.5).astype(np.float32)[:, None]
    for _ in range(8):
        x[:, :32] = k * _d_of(x) * rng.choice([-1, 1], (8, 32))
    assert np.all(np.abs(x[:, :32]) == k * _d_of(x))
    return x


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_code_ties_keep_the_lowest_code(backend):
    w = _code_tie_blocks(_rng(47))
    packed = e8.encode_rotated_e8(w, backend=backend)[0]
    np.testing.assert_array_equal(packed, _encode_reference(w))
    word0 = packed.reshape(8, 98)[:, 64:68].copy().view("<u4")[:, 0]
    np.testing.assert_array_equal(word0 >> 28, np.where(np.arange(8) % 2, 1, 0))


@pytest.mark.parametrize("seed", range(4))
def test_compiled_encoder_equals_numpy(lib, seed):
    rng = _rng(30 + seed)
    w = np.concatenate([_adversarial_matrix(rng).reshape(-1, 512),
                        rng.standard_normal((64, 512)).astype(np.float32) * 0.02])
    np.testing.assert_array_equal(e8.encode_rotated_e8(w, backend="c")[0],
                                  e8.encode_rotated_e8(w, backend="numpy")[0])


def test_compiled_encoder_equals_reference_on_ties(lib):
    rng = _rng(40)
    w = np.concatenate([_tie_blocks(rng, 6), _adversarial_matrix(rng)[:6]])
    np.testing.assert_array_equal(e8.encode_rotated_e8(w, backend="c")[0], _encode_reference(w))


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_encode_rejects_non_finite_and_fp16_overflow(backend):
    w = _rng(41).standard_normal((2, 512)).astype(np.float32)
    for bad, match in [(np.inf, "finite weights"), (np.nan, "finite weights"),
                       (3e7, "overflows fp16")]:
        v = w.copy()
        v[1, 300:300 + (256 if bad == 3e7 else 1)] = bad
        with pytest.raises(ValueError, match=match):
            e8.encode_rotated_e8(v, backend=backend)
    w[1, 256:] = 1e6                                   # RMS 1e6: d = 5e4 still fits fp16
    e8.encode_rotated_e8(w, backend=backend)


def test_compiled_cells_built_concurrently_equal_numpy(lib, monkeypatch):
    """The cell table is filled lazily by whichever thread needs a cell first."""
    monkeypatch.setattr(e8, "_THREADS", 4)
    w = (_rng(42).standard_t(4, (96, 1024)) * 0.02).astype(np.float32)
    lib.e8_clear_cells()
    packed = e8.encode_rotated_e8(w, backend="c")[0]
    table = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * lib.e8_cell_table_bytes())
                                  .from_address(lib.e8_cell_table()))
    assert 0 < np.count_nonzero(table.reshape(-1, 16)[:, 0]) < len(table) // 16
    np.testing.assert_array_equal(packed, e8.encode_rotated_e8(w, backend="numpy")[0])


@pytest.mark.parametrize("dim", [256, 1536, 6144, 7, 65536])
def test_compiled_rotation_equals_numpy(lib, dim):
    x = _rng(43).standard_normal((3 if dim < 65536 else 1, dim)).astype(np.float32)
    got = e8.rotate_rows(x, backend="c")
    np.testing.assert_array_equal(got, e8.rotate_rows(x, backend="numpy"))
    assert not np.array_equal(got, x)


def test_compiled_whole_matrix_equals_numpy(lib):
    w = _rng(44).standard_normal((64, 2048)).astype(np.float32) * 0.02
    np.testing.assert_array_equal(e8.encode_e8(w, backend="c")[0],
                                  e8.encode_e8(w, backend="numpy")[0])


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    monkeypatch.setattr(e8, "_lib_state", None)
    monkeypatch.setattr(e8, "_noticed", False)
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(e8.ENCODER_ENV, raising=False)
    return tmp_path


def test_no_compiler_falls_back_with_one_notice(fresh_loader, monkeypatch, capsys):
    monkeypatch.setenv("CC", str(fresh_loader / "no-such-cc"))
    w = _rng(45).standard_normal((2, 512)).astype(np.float32)
    packed = e8.encode_e8(w)[0]
    e8.encode_e8(w)
    err = capsys.readouterr().err
    assert err.count("fast fmt 6 encoder unavailable") == 1 and "no-such-cc" in err
    np.testing.assert_array_equal(packed, _encode_reference(e8.rotate_rows(w, backend="numpy")))
    with pytest.raises(RuntimeError, match="C encoder unavailable"):
        e8.encode_e8(w, backend="c")
    monkeypatch.setenv(e8.ENCODER_ENV, "numpy")                # explicit choice: no notice
    monkeypatch.setattr(e8, "_noticed", False)
    e8.encode_e8(w)
    assert capsys.readouterr().err == ""


def test_compile_failure_is_reported(fresh_loader, monkeypatch):
    fake_cc = fresh_loader / "cc"
    fake_cc.write_text("#!/bin/sh\necho 'cc: error: something broke' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    monkeypatch.setenv("CC", str(fake_cc))
    lib, why = e8._load_compiled()
    assert lib is None and "something broke" in why


def test_compiled_library_is_cached(fresh_loader, lib):
    first, _ = e8._load_compiled()
    built = sorted(p.name for p in fresh_loader.iterdir())
    assert first is not None and any(n.endswith(".so") for n in built)
    e8._lib_state = None
    again, _ = e8._load_compiled()
    assert sorted(p.name for p in fresh_loader.iterdir()) == built   # nothing rebuilt


def test_backend_choice_is_checked():
    with pytest.raises(ValueError, match="backend must be"):
        e8.encode_e8(np.ones((1, 256), np.float32), backend="fortran")

"""fmt 0–6 codecs against oracles written here from docs/format.md#formats, element by element.

* ``dumb_encode`` follows the converter's formulas with float32 scalars, one element at a time,
  and packs bits by the layout text (nibble order, planes, padding) — the bit-exact oracle.
* ``dumb_decode`` reads each element's bits one at a time and multiplies in float64.
The codecs under test are vectorized and share no code with either.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import colibri_mlx.formats as F
from colibri_mlx.formats import FormatError, QTensor

f32 = np.float32
QRANGE = {1: (-128, 127), 2: (-8, 7), 3: (-2, 1), 4: (-8, 7), 5: (-4, 3)}
ROW_BYTES = {
    1: lambda I: I,
    2: lambda I: (I + 1) // 2,
    3: lambda I: (I + 3) // 4,
    4: lambda I: (I + 1) // 2,
    5: lambda I: 24 * ((I + 63) // 64),
}


def group_of(fmt, I, gs):
    return {4: gs, 5: 64}.get(fmt, I)


def dumb_encode(fmt, w, gs=None):
    O, I = w.shape
    lo, qmax = QRANGE[fmt]
    G = group_of(fmt, I, gs)
    rb = ROW_BYTES[fmt](I)
    out = np.zeros(O * rb, np.uint8)
    scales = []
    values = np.zeros((O, I), np.int64)
    for o in range(O):
        for g0 in range(0, I, G):
            amax = f32(0)
            for i in range(g0, min(g0 + G, I)):
                amax = max(amax, abs(f32(w[o, i])))
            s = max(f32(amax / f32(qmax)), f32(1e-8))
            scales.append(s)
            for i in range(g0, min(g0 + G, I)):
                values[o, i] = int(min(max(np.rint(f32(w[o, i]) / s), lo), qmax))
    for o in range(O):
        base = o * rb
        if fmt == 5:
            for g in range((I + 63) // 64):
                for k in range(64):
                    i = 64 * g + k
                    u = values[o, i] + 4 if i < I else 4  # the converter's padding code
                    gb = base + 24 * g
                    out[gb + (k >> 2)] |= (u & 3) << (2 * (k & 3))
                    out[gb + 16 + (k >> 3)] |= ((u >> 2) & 1) << (k & 7)
            continue
        for i in range(I):
            v = values[o, i]
            if fmt == 1:
                out[base + i] = v & 0xFF
            elif fmt in (2, 4):
                out[base + (i >> 1)] |= (v + 8) << (4 * (i & 1))
            else:
                out[base + (i >> 2)] |= (v + 2) << (2 * (i & 3))
    return out, np.array(scales, np.float32)


def dumb_decode(fmt, packed, scales, O, I, gs=None):
    rb = ROW_BYTES[fmt](I)
    G = group_of(fmt, I, gs)
    ng = (I + G - 1) // G
    out = np.zeros((O, I), np.float64)
    for o in range(O):
        for i in range(I):
            base = o * rb
            if fmt == 1:
                b = int(packed[base + i])
                v = b - 256 if b >= 128 else b
            elif fmt in (2, 4):
                v = ((int(packed[base + (i >> 1)]) >> (4 * (i & 1))) & 15) - 8
            elif fmt == 3:
                v = ((int(packed[base + (i >> 2)]) >> (2 * (i & 3))) & 3) - 2
            else:
                g, k = divmod(i, 64)
                gb = base + 24 * g
                low = (int(packed[gb + (k >> 2)]) >> (2 * (k & 3))) & 3
                high = (int(packed[gb + 16 + (k >> 3)]) >> (k & 7)) & 1
                v = (low | (high << 2)) - 4
            s = float(scales[o * ng + i // G])
            out[o, i] = v * s
    return out


def assert_close_relative(got, ref):
    """float32 result of one rounded product: |got - ref| <= 2^-23 |ref| element-wise."""
    assert got.dtype == np.float32 and got.shape == ref.shape
    err = np.abs(got.astype(np.float64) - ref)
    assert np.all(err <= 2.0 ** -23 * np.abs(ref)), float(np.max(err / np.maximum(np.abs(ref), 1e-300)))


CASES = [(1, None), (2, None), (3, None), (5, None)] + [(4, g) for g in F.GS_CANDIDATES]
SHAPES = [(1, 1), (2, 3), (3, 7), (2, 64), (3, 65), (2, 130), (1, 257), (4, 100)]


def weights(rng, O, I, kind):
    """Non-trivial test weights: random scales per row, exact .5 ties, zeros, tiny rows."""
    w = rng.standard_normal((O, I)) * 10.0 ** rng.uniform(-3, 2, size=(O, 1))
    if kind == "ties":
        w = np.round(rng.uniform(-8, 8, size=(O, I)) * 2) / 2  # many w/s = k + 0.5
    elif kind == "sparse":
        w[:, ::3] = 0
        w[0] = 0  # an all-zero row exercises the 1e-8 scale floor
    elif kind == "tiny":
        w *= 1e-12
    return w.astype(np.float32)


# ---------------------------------------------------------------------------------------
# encode is bit-exact with the converter's formulas


@pytest.mark.parametrize("fmt,gs", CASES)
@pytest.mark.parametrize("kind", ["normal", "ties", "sparse", "tiny"])
def test_encode_matches_elementwise_converter_formulas(fmt, gs, kind):
    rng = np.random.default_rng(zlib.crc32(f"{fmt}/{gs}/{kind}".encode()))
    for O, I in SHAPES:
        w = weights(rng, O, I, kind)
        packed, scales = F.encode(fmt, w, gs)
        ref_packed, ref_scales = dumb_encode(fmt, w, gs)
        assert packed.dtype == np.uint8 and packed.ndim == 1
        assert scales.dtype == np.float32 and scales.ndim == 1
        np.testing.assert_array_equal(packed, ref_packed, err_msg=f"fmt {fmt} gs {gs} [{O},{I}]")
        np.testing.assert_array_equal(scales.view(np.uint32), ref_scales.view(np.uint32))
        assert packed.size == F.weight_nbytes(fmt, O, I, gs)
        assert scales.nbytes == F.scale_nbytes(fmt, O, I, gs)


def test_round_half_even_and_clamps():
    # int4 row: amax 7 -> s = 1, so w/s is w itself: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2, -0.5 -> 0
    w = np.array([[7.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -7.0]], np.float32)
    packed, scales = F.encode(2, w)
    assert scales.tolist() == [1.0]
    np.testing.assert_array_equal(F.decode(2, packed, scales, 1, 8), [[7, 2, 4, -2, 0, 0, 2, -7]])
    # int2 is ternary: s = amax, so -2 is unreachable
    p2, s2 = F.encode(3, np.array([[-1.0, -0.5, 0.49, 1.0]], np.float32))
    np.testing.assert_array_equal(F.decode(3, p2, s2, 1, 4), [[-1, -0.0, 0, 1]])


def test_scale_floor_for_zero_and_tiny_rows():
    w = np.array([[0.0, 0.0, 0.0], [1e-12, -3e-12, 0.0]], np.float32)
    for fmt, gs in CASES:
        _, scales = F.encode(fmt, w, gs)
        assert np.all(scales == f32(1e-8)), (fmt, gs, scales)
    packed, _ = F.encode(2, w)
    assert packed.tolist() == [0x88, 0x08, 0x88, 0x08]  # codes 8 (=0); odd-I pad nibble 0


def test_padding_bytes_as_the_python_converter_writes_them():
    w = np.full((1, 5), -1.0, np.float32)  # every code is the most negative reachable value
    p4, _ = F.encode(2, w)  # code -7+8 = 1: 0x11 0x11 then high nibble 0
    assert p4.tolist() == [0x11, 0x11, 0x01]
    p2, _ = F.encode(3, w)  # code -1+2 = 1 in 2-bit slots; the 3 pad slots stay 00
    assert p2.tolist() == [0b01010101, 0b00000001]
    p3, _ = F.encode(5, w)  # code -3+4 = 1 (low 01, high 0); pad code 4 (low 00, high 1)
    low, high = p3[:16], p3[16:]
    assert low.tolist() == [0b01010101, 0b00000001] + [0] * 14
    assert high.tolist() == [0b11100000] + [0xFF] * 7


def test_fmt0_is_the_float32_bytes():
    w = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    packed, scales = F.encode(0, w)
    assert packed.tobytes() == w.astype("<f4").tobytes() and scales.size == 0
    out = F.decode(0, packed, scales, 3, 5)
    np.testing.assert_array_equal(out, w)
    assert F.weight_nbytes(0, 3, 5) == 60 and F.scale_nbytes(0, 3, 5) == 0


def test_float64_input_is_cast_to_float32_first():
    w64 = np.random.default_rng(1).standard_normal((2, 33))
    for fmt, gs in CASES:
        a = F.encode(fmt, w64, gs)
        b = F.encode(fmt, w64.astype(np.float32), gs)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------
# decode against the per-element float64 reader


@pytest.mark.parametrize("fmt,gs", CASES)
def test_decode_matches_elementwise_reader_on_random_bytes(fmt, gs):
    rng = np.random.default_rng(fmt * 1000 + (gs or 0))
    for O, I in SHAPES:
        packed = rng.integers(0, 256, F.weight_nbytes(fmt, O, I, gs), dtype=np.uint8)
        scales = (rng.standard_normal(F.scale_nbytes(fmt, O, I, gs) // 4)
                  * 10.0 ** rng.uniform(-6, 3)).astype(np.float32)
        got = F.decode(fmt, packed, scales, O, I, gs)
        assert_close_relative(got, dumb_decode(fmt, packed, scales, O, I, gs))


@pytest.mark.parametrize("gs", [1, 3, 7, 33])
def test_fmt4_odd_group_size_with_odd_I(gs):
    # ceil(I/gs)*gs == I < 2*ceil(I/2): the decoder's nibbles outnumber the padded groups.
    rng = np.random.default_rng(gs)
    for O, I in [(2, gs), (3, 3 * gs), (2, 2 * gs + 1)]:
        w = weights(rng, O, I, "normal")
        packed, scales = F.encode(4, w, gs)
        ref_packed, ref_scales = dumb_encode(4, w, gs)
        np.testing.assert_array_equal(packed, ref_packed)
        np.testing.assert_array_equal(scales.view(np.uint32), ref_scales.view(np.uint32))
        assert_close_relative(F.decode(4, packed, scales, O, I, gs), dumb_decode(4, packed, scales, O, I, gs))


@pytest.mark.parametrize("fmt,gs", CASES)
def test_edge_bytes_decode_to_the_ends_of_the_range(fmt, gs):
    O, I = 2, 70
    nb, ns = F.weight_nbytes(fmt, O, I, gs), F.scale_nbytes(fmt, O, I, gs) // 4
    scales = np.linspace(0.5, 2.0, ns).astype(np.float32)
    lo, hi = QRANGE[fmt]
    if fmt == 1:
        lo_byte, hi_byte = 0x80, 0x7F
    else:
        lo_byte, hi_byte = 0x00, 0xFF
    for byte, value in ((lo_byte, lo), (hi_byte, hi)):
        got = F.decode(fmt, np.full(nb, byte, np.uint8), scales, O, I, gs)
        ref = dumb_decode(fmt, np.full(nb, byte, np.uint8), scales, O, I, gs)
        assert_close_relative(got, ref)
        G = group_of(fmt, I, gs)
        ng = -(-I // G)
        per_elem = scales.reshape(O, ng).repeat(G, axis=1)[:, :I]
        np.testing.assert_array_equal(got, value * per_elem)


def test_int4_nibble_order_even_element_low():
    packed = np.array([0x3C], np.uint8)  # low nibble 0xC -> +4 (element 0), high 0x3 -> -5
    out = F.decode(2, packed, np.array([1.0], np.float32), 1, 2)
    np.testing.assert_array_equal(out, [[4.0, -5.0]])


# ---------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("fmt,gs", CASES)
def test_round_trip_is_bit_exact_on_awkward_shapes(fmt, gs):
    rng = np.random.default_rng(7)
    for O, I in SHAPES + [(3, 127), (2, 191), (1, 300)]:
        for kind in ("normal", "ties", "sparse", "tiny"):
            w = weights(rng, O, I, kind)
            packed, scales = F.encode(fmt, w, gs)
            again = F.encode(fmt, F.decode(fmt, packed, scales, O, I, gs), gs)
            np.testing.assert_array_equal(again[0], packed)
            np.testing.assert_array_equal(again[1].view(np.uint32), scales.view(np.uint32))


@st.composite
def weight_and_format(draw):
    fmt, gs = draw(st.sampled_from(CASES + [(0, None)]))
    O = draw(st.integers(1, 4))
    I = draw(st.integers(1, 300))
    exponent = draw(st.integers(-20, 20))
    elements = st.floats(-1.0, 1.0, width=32, allow_subnormal=True)
    w = draw(hnp.arrays(np.float32, (O, I), elements=elements)) * f32(2.0 ** exponent)
    return fmt, gs, w


@settings(max_examples=150, deadline=None)
@given(weight_and_format())
def test_property_encode_decode_encode_is_identical(case):
    fmt, gs, w = case
    O, I = w.shape
    packed, scales = F.encode(fmt, w, gs)
    decoded = F.decode(fmt, packed, scales, O, I, gs)
    again = F.encode(fmt, decoded, gs)
    assert again[0].tobytes() == packed.tobytes()
    assert again[1].tobytes() == scales.tobytes()
    if fmt:  # quantization error is at most half a step of the row/group scale
        G = group_of(fmt, I, gs)
        step = np.repeat(scales.reshape(O, -1), G, axis=1)[:, :I].astype(np.float64)
        err = np.abs(decoded.astype(np.float64) - w)
        # plus float32 rounding of w/s and of v*s, relative to |w|
        assert np.all(err <= 0.5 * step + 2.0 ** -20 * np.abs(w)), fmt


# ---------------------------------------------------------------------------------------
# byte counts and validation


@pytest.mark.parametrize("O,I", [(1, 1), (3, 100), (7, 256), (5, 6145)])
def test_byte_count_table(O, I):
    c = lambda a, b: -(-a // b)  # noqa: E731
    assert F.weight_nbytes(0, O, I) == 4 * O * I and F.scale_nbytes(0, O, I) == 0
    assert F.weight_nbytes(1, O, I) == O * I and F.scale_nbytes(1, O, I) == 4 * O
    assert F.weight_nbytes(2, O, I) == O * c(I, 2) and F.scale_nbytes(2, O, I) == 4 * O
    assert F.weight_nbytes(3, O, I) == O * c(I, 4) and F.scale_nbytes(3, O, I) == 4 * O
    for gs in F.GS_CANDIDATES:
        assert F.weight_nbytes(4, O, I, gs) == O * c(I, 2)
        assert F.scale_nbytes(4, O, I, gs) == 4 * O * c(I, gs)
    assert F.weight_nbytes(5, O, I) == 24 * O * c(I, 64) and F.scale_nbytes(5, O, I) == 4 * O * c(I, 64)
    assert F.weight_nbytes(6, O, I) == 98 * O * c(I, 256) and F.scale_nbytes(6, O, I) == 4


def test_fmt_table_names():
    assert F.FMT_NAMES == {0: "f32", 1: "int8-row", 2: "int4-row", 3: "int2-row",
                           4: "int4-grouped", 5: "int3-g64", 6: "e8-iq3-lattice"}
    assert F.GS_CANDIDATES == (16, 32, 48, 64, 96, 128, 192, 256)


def test_decode_rejects_wrong_lengths_and_dtypes_with_clear_messages():
    packed, scales = F.encode(4, np.ones((3, 100), np.float32), 64)
    with pytest.raises(FormatError, match=r"fmt 4 \(int4-grouped\) \[3, 100, gs=64\] needs 150 weight bytes"):
        F.decode(4, packed[:-1], scales, 3, 100, 64)
    with pytest.raises(FormatError, match="6 float32 scales; got 150 bytes and 5"):
        F.decode(4, packed, scales[:-1], 3, 100, 64)
    with pytest.raises(FormatError, match="needs a group size"):
        F.decode(4, packed, scales, 3, 100)
    with pytest.raises(FormatError, match="1-D float32"):
        F.decode(4, packed, scales.astype(np.float64), 3, 100, 64)
    with pytest.raises(FormatError, match="1-D uint8"):
        F.decode(4, packed.reshape(3, -1), scales, 3, 100, 64)
    with pytest.raises(FormatError, match="takes no group size"):
        F.decode(2, packed, scales[:3], 3, 100, 64)
    with pytest.raises(FormatError, match="unknown fmt 7"):
        F.decode(7, packed, scales, 3, 100)
    with pytest.raises(FormatError, match="positive integers"):
        F.weight_nbytes(1, 0, 5)


def test_encode_rejects_bad_weights():
    with pytest.raises(FormatError, match="non-finite"):
        F.encode(2, np.array([[1.0, np.nan]], np.float32))
    with pytest.raises(FormatError, match="2-D"):
        F.encode(1, np.ones(5, np.float32))
    with pytest.raises(FormatError, match="positive integer"):
        F.encode(4, np.ones((2, 4), np.float32), gs=0)


def test_int8_weights_are_accepted_as_bytes():
    packed, scales = F.encode(1, np.array([[-3.0, 1.0, 2.0]], np.float32))
    np.testing.assert_array_equal(F.decode(1, packed.view(np.int8), scales, 1, 3),
                                  F.decode(1, packed, scales, 1, 3))


def test_qtensor_dequantize_uses_the_codecs():
    w = np.random.default_rng(3).standard_normal((4, 96)).astype(np.float32)
    packed, scales = F.encode(4, w, 32)
    qt = QTensor(packed, scales, 4, 4, 96, 32, "t")
    np.testing.assert_array_equal(qt.dequantize(), F.decode(4, packed, scales, 4, 96, 32))


def test_fmt6_delegates_to_the_e8_codec():
    e8 = pytest.importorskip("colibri_mlx.formats.e8")
    w = np.random.default_rng(4).standard_normal((2, 512)).astype(np.float32)
    packed, scales = F.encode(6, w)
    assert packed.size == 2 * 2 * 98 and scales.tolist() == [6.0]
    np.testing.assert_array_equal(F.decode(6, packed, scales, 2, 512), e8.decode_e8(packed, 2, 512))
    with pytest.raises(FormatError, match="needs 392 weight bytes"):
        F.decode(6, packed[:-98], scales, 2, 512)


@pytest.mark.parametrize("fmt,gs", CASES)
def test_row_chunked_encode_is_bit_identical(fmt, gs, monkeypatch):
    from colibri_mlx.formats import codecs

    w = weights(np.random.default_rng(11), 10, 77, "normal")
    whole = F.encode(fmt, w, gs)
    monkeypatch.setattr(codecs, "ROWS_PER_CHUNK", 3)
    chunked = F.encode(fmt, w, gs)
    assert all(np.array_equal(a, b) for a, b in zip(whole, chunked))


def test_fmt6_routes_through_the_e8_module_and_checks_its_output(monkeypatch):
    """A stand-in e8 module: encode/decode must delegate, pass shapes, and validate lengths."""
    import sys
    import types

    import colibri_mlx.formats as formats_pkg

    calls = []
    stub = types.ModuleType("colibri_mlx.formats.e8")

    def encode_e8(w):
        calls.append(("encode", w.shape, w.dtype))
        return np.arange(98 * w.shape[0] * -(-w.shape[1] // 256), dtype=np.uint8), np.array([6.0], np.float32)

    def decode_e8(packed, O, I):
        calls.append(("decode", packed.shape, O, I))
        return np.full((O, I), 0.25, np.float32)

    stub.encode_e8, stub.decode_e8 = encode_e8, decode_e8
    monkeypatch.setitem(sys.modules, "colibri_mlx.formats.e8", stub)
    monkeypatch.setattr(formats_pkg, "e8", stub, raising=False)
    w = np.random.default_rng(5).standard_normal((3, 300))
    packed, scales = F.encode(6, w)
    assert packed.size == 3 * 2 * 98 and scales.tolist() == [6.0]
    out = F.decode(6, packed, scales, 3, 300)
    assert out.shape == (3, 300) and np.all(out == 0.25)
    assert calls == [("encode", (3, 300), np.float32), ("decode", (588,), 3, 300)]
    with pytest.raises(FormatError, match="needs 588 weight bytes and 1 float32 scales; got 588 bytes and 2"):
        F.decode(6, packed, np.array([6.0, 6.0], np.float32), 3, 300)
    stub.encode_e8 = lambda w: (np.zeros(5, np.uint8), np.array([6.0], np.float32))
    with pytest.raises(FormatError, match="encoder output"):
        F.encode(6, w)

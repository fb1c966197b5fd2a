"""Format detection: upstream's exact first-match rule (misreadings included) and ours.

The misreadings are listed here by hand from qt_resolve_fmt / detect_group_size
(c/colibri.c, docs/format.md#detection), not recomputed: a change in detect_format that reads any
written (fmt, gs) differently from upstream fails the sweep.
"""

from __future__ import annotations

import numpy as np
import pytest

import colibri_mlx.formats as F
from colibri_mlx.formats import FormatError

WRITTEN = [(1, None), (2, None), (3, None), (5, None), (6, None)] + [(4, g) for g in F.GS_CANDIDATES]

# (written, I values, upstream's reading) for every O.
UPSTREAM_MISREADS = [
    # detect_group_size takes the first candidate with the same number of groups
    ((4, 48), range(49, 65), (4, 32)),
    ((4, 64), [*range(65, 97), *range(129, 145)], (4, 48)),
    ((4, 96), range(97, 129), (4, 64)),
    ((4, 128), [*range(129, 193), *range(257, 289)], (4, 96)),
    ((4, 192), range(193, 257), (4, 128)),
    ((4, 256), [*range(257, 385), *range(513, 577)], (4, 192)),
    # int3-g64's 24 bytes per group equal a row layout; row formats are checked first
    ((5, None), [24], (1, None)),
    ((5, None), [47, 48], (2, None)),
    ((5, None), [95, 96, 143, 144], (4, 48)),
    # one- and two-element rows
    ((2, None), [1], (1, None)),
    ((3, None), [1], (1, None)),
    ((3, None), [2], (2, None)),
]
# Only at O = 1, where a per-row .qs is 4 bytes, the size of fmt 6's tag:
# int4 rows of ceil(I/2) == 98 * ceil(I/256) bytes read as e8.
UPSTREAM_MISREADS_O1 = [((2, None), [195, 196, 391, 392, 587, 588], (6, None))]
REFUSED = "refused"
UPSTREAM_REFUSALS = [
    # the I=98 fmt 6 guard: 98*O bytes + 4 is also fp8 (O <= 128) / int8 (O = 1)
    ((6, None), lambda O: O <= 128, [98]),
    ((1, None), lambda O: O == 1, [98]),
    # int8 at O=1 with 4 fp8 blocks: a 4-byte .qs is also 4 ue8m0 block scales
    ((1, None), lambda O: O == 1, range(385, 513)),
]


def upstream_reading(written, O, I):
    """What upstream reads for a tensor written as ``written``, from the tables above."""
    fmt, gs = written
    if fmt == 4 and -(-I // gs) == 1:
        written = (2, None)  # one group per row: exactly fmt 2's bytes
    for w, o_pred, Is in UPSTREAM_REFUSALS:
        if w == written and o_pred(O) and I in Is:
            return REFUSED
    table = UPSTREAM_MISREADS + (UPSTREAM_MISREADS_O1 if O == 1 else [])
    for w, Is, reading in table:
        if w == written and I in Is:
            return reading
    return written


def counts(fmt, gs, O, I):
    return F.weight_nbytes(fmt, O, I, gs), F.scale_nbytes(fmt, O, I, gs)


@pytest.mark.parametrize("O", [1, 3])
def test_detect_format_reproduces_upstream_over_a_sweep(O):
    mismatches = []
    for fmt, gs in WRITTEN:
        for I in range(1, 601):
            nb, ns = counts(fmt, gs, O, I)
            want = upstream_reading((fmt, gs), O, I)
            try:
                got = F.detect_format(O, I, nb, ns)
            except FormatError:
                got = REFUSED
            if got != want:
                mismatches.append(((fmt, gs), I, got, want))
    assert not mismatches, mismatches[:20]


def test_brief_misread_examples():
    assert F.detect_format(10, 80, *counts(4, 64, 10, 80)) == (4, 48)
    assert F.detect_format(10, 140, *counts(4, 64, 10, 140)) == (4, 48)
    assert F.detect_format(10, 145, *counts(4, 64, 10, 145)) == (4, 64)
    assert F.detect_format(10, 160, *counts(4, 128, 10, 160)) == (4, 96)
    assert F.detect_format(10, 280, *counts(4, 128, 10, 280)) == (4, 96)
    assert F.detect_format(10, 289, *counts(4, 128, 10, 289)) == (4, 128)
    assert F.detect_format(4, 6144, *counts(4, 64, 4, 6144)) == (4, 64)
    assert F.detect_format(4, 7168, *counts(4, 128, 4, 7168)) == (4, 128)


@pytest.mark.parametrize("O", [1, 3])
def test_resolve_format_with_a_stamp_is_always_the_written_format(O):
    for fmt, gs in WRITTEN:
        for I in range(1, 601, 7):
            nb, ns = counts(fmt, gs, O, I)
            r = F.resolve_format(O, I, nb, ns, stamp=(F.FMT_NAMES[fmt], gs))
            assert (r.fmt, r.gs, r.ambiguous) == (fmt, gs, False), (fmt, gs, I, r)


@pytest.mark.parametrize("O", [1, 3])
def test_written_reading_is_always_possible_and_unambiguous_resolutions_are_right(O):
    for fmt, gs in WRITTEN:
        for I in range(1, 601):
            nb, ns = counts(fmt, gs, O, I)
            written = (2, None) if fmt == 4 and -(-I // gs) == 1 else (fmt, gs)
            readings = F.possible_formats(O, I, nb, ns)
            assert written in readings, (fmt, gs, I, readings)
            r = F.resolve_format(O, I, nb, ns)
            assert r.readings == readings and r.ambiguous == (len(readings) > 1)
            if not r.ambiguous:
                assert (r.fmt, r.gs) == written


def test_resolve_format_recovers_the_converters_group_sizes_where_upstream_misreads():
    for O in (1, 5):
        for gs, Is in ((64, [*range(65, 97), *range(129, 145)]),
                       (128, [*range(129, 193), *range(257, 289)])):
            for I in Is:
                r = F.resolve_format(O, I, *counts(4, gs, O, I))
                assert (r.fmt, r.gs, r.ambiguous) == (4, gs, True), (gs, I, r)
                assert F.detect_format(O, I, *counts(4, gs, O, I)) != (4, gs)


def test_tie_I48_int4_row_and_int3_g64_have_the_same_bytes():
    O, I = 4, 48
    assert counts(2, None, O, I) == counts(5, None, O, I) == (96, 16)
    assert F.detect_format(O, I, 96, 16) == (2, None)
    assert F.possible_formats(O, I, 96, 16) == [(2, None), (5, None)]
    r = F.resolve_format(O, I, 96, 16)
    assert (r.fmt, r.gs, r.ambiguous) == (2, None, True)
    r = F.resolve_format(O, I, 96, 16, stamp="int3-g64")
    assert (r.fmt, r.gs, r.ambiguous) == (5, None, False)


def test_tie_I98_fmt6_collision_guard():
    # O <= 128: e8's 98*O bytes + 4-byte tag is also a one-block fp8 tensor: upstream refuses
    with pytest.raises(FormatError, match=r"e8-iq3-lattice \(fmt 6\).*fp8-e4m3-b128"):
        F.detect_format(3, 98, 3 * 98, 4)
    # ... and at O = 1 also int8-row
    with pytest.raises(FormatError, match="int8-row"):
        F.detect_format(1, 98, 98, 4)
    # O = 129..384: fp8 would need 2 or 3 scales, so only e8 fits
    assert F.detect_format(200, 98, 200 * 98, 4) == (6, None)
    # O = 385..512: four fp8 blocks, and 4 bytes is also four 1-byte ue8m0 scales
    with pytest.raises(FormatError, match="four ue8m0"):
        F.detect_format(400, 98, 400 * 98, 4)
    assert F.detect_format(513, 98, 513 * 98, 4) == (6, None)
    # ours: fmt 0-6 readings only; at O = 3 e8 is the only one
    r = F.resolve_format(3, 98, 3 * 98, 4)
    assert (r.fmt, r.ambiguous) == (6, False)
    # at O = 1 int8 wins: the converter never writes fmt 6 with I % 256 != 0
    r = F.resolve_format(1, 98, 98, 4)
    assert (r.fmt, r.ambiguous, r.readings) == (1, True, [(6, None), (1, None)])
    assert F.resolve_format(1, 98, 98, 4, stamp="e8-iq3-lattice").fmt == 6


def test_tie_gs_at_least_I_reads_as_fmt2_and_decodes_identically():
    O, I = 3, 50
    w = np.random.default_rng(0).standard_normal((O, I)).astype(np.float32)
    packed, scales = F.encode(4, w, 64)
    nb, ns = packed.nbytes, scales.nbytes
    assert F.detect_format(O, I, nb, ns) == (2, None)
    assert F.possible_formats(O, I, nb, ns) == [(2, None)]
    r = F.resolve_format(O, I, nb, ns)
    assert (r.fmt, r.gs, r.ambiguous) == (2, None, False)
    r = F.resolve_format(O, I, nb, ns, stamp=("int4-grouped", 64))
    assert (r.fmt, r.gs, r.ambiguous) == (4, 64, False)
    np.testing.assert_array_equal(F.decode(2, packed, scales, O, I),
                                  F.decode(4, packed, scales, O, I, 64))
    np.testing.assert_array_equal(F.encode(2, w)[0], packed)


def test_bare_int4_grouped_stamp_picks_a_gs():
    O, I = 2, 80  # gs 48 and gs 64 both give 2 groups
    r = F.resolve_format(O, I, *counts(4, 64, O, I), stamp="int4-grouped")
    assert (r.fmt, r.gs, r.ambiguous) == (4, 64, True)
    r = F.resolve_format(O, I, *counts(4, 16, O, I), stamp="int4-grouped")
    assert (r.fmt, r.gs, r.ambiguous) == (4, 16, False)
    r = F.resolve_format(O, 40, *counts(2, None, O, 40), stamp="int4-grouped")  # gs 48..256 >= I
    assert (r.fmt, r.gs, r.ambiguous) == (4, 64, False)


def test_disagreeing_stamp_names_both():
    nb, ns = counts(4, 64, 8, 512)
    with pytest.raises(FormatError, match=r"stamp \('int4-grouped', 128\) disagrees.*\(4, 64\)"):
        F.resolve_format(8, 512, nb, ns, stamp=("int4-grouped", 128))
    with pytest.raises(FormatError, match=r"stamp 'int8-row' disagrees.*\[\(4, 64\)\]"):
        F.resolve_format(8, 512, nb, ns, stamp="int8-row")
    with pytest.raises(FormatError, match="does not read"):
        F.resolve_format(8, 512, nb, ns, stamp="fp8-e4m3-b128")


def test_stamp_forms():
    nb, ns = counts(5, None, 2, 200)
    for stamp in ("int3-g64", 5, (5, None), ("int3-g64", 64)):
        r = F.resolve_format(2, 200, nb, ns, stamp=stamp)
        assert (r.fmt, r.gs, r.ambiguous) == (5, None, False)


def test_unresolvable_byte_counts_give_a_clear_error():
    with pytest.raises(FormatError, match=r"\[O=3, I=100\] with weight 12345 bytes, scales 12 bytes"
                                          r".*expected weight \+ scale bytes: .*fmt 1 \(int8-row\): 300 \+ 12"):
        F.detect_format(3, 100, 12345, 12)
    # weight bytes of int4, scale count of nothing
    with pytest.raises(FormatError, match=r"fmt 2 \(int4-row\) but its scale array must be 12 bytes"):
        F.detect_format(3, 100, 150, 13)
    with pytest.raises(FormatError, match="no fmt 0-6 layout"):
        F.resolve_format(3, 100, 12345, 12)


def test_fp8_passthrough_is_named_not_misread():
    O, I = 300, 1000  # 3 x 8 blocks of 128
    with pytest.raises(FormatError, match="fp8-e4m3-b128"):
        F.detect_format(O, I, O * I, 4 * 3 * 8)
    with pytest.raises(FormatError, match="ue8m0"):
        F.detect_format(O, I, O * I, 3 * 8)
    # int8 whose per-row count equals the block count: upstream's "inversion" reads int8
    assert F.detect_format(1, 100, 100, 4) == (1, None)


def test_fmt0_without_qs():
    assert F.detect_format(3, 5, 60, 0) == (0, None)
    r = F.resolve_format(3, 5, 60, 0)
    assert (r.fmt, r.ambiguous) == (0, False)


def test_real_model_shapes_resolve_cleanly():
    # GLM-5.2 / DeepSeek-V3 shapes in the converter's default container
    for O, I in ((6144, 6144), (2048, 6144), (6144, 2048), (576, 6144), (32768, 512),
                 (7168, 18432), (154880, 6144)):
        for fmt, gs in ((4, 64), (1, None), (5, None)) + (((6, None),) if I % 256 == 0 else ()):
            nb, ns = counts(fmt, gs, O, I)
            assert F.detect_format(O, I, nb, ns) == (fmt, gs)
            r = F.resolve_format(O, I, nb, ns)
            assert (r.fmt, r.gs, r.ambiguous) == (fmt, gs, False)

"""Which fmt a tensor is, from its shape and two byte counts (the container stores neither).

Two rules live here:

* :func:`detect_format` is upstream's ``qt_resolve_fmt`` + ``detect_group_size``
  (c/colibri.c, docs/format.md#detection) reproduced exactly, misreadings included: the first gs
  candidate whose scale count fits wins, so gs=64 with I in 65–96 reads as gs=48, gs=128 with
  I in 129–192 as gs=96, int3-g64 with I in {47, 48, 95, 96, 143, 144} as int4, and so on.
  Use it to know what upstream's engine would load.
* :func:`resolve_format` is ours: it lists every reading the byte counts allow
  (:func:`possible_formats`), trusts a stamp written by our writer when it agrees with the
  bytes, and otherwise prefers the converter's own defaults, reporting ``ambiguous``.

Readings never include a fmt 4 gs that covers the whole row (``ceil(I/gs) == 1``): such a
tensor has exactly one scale per row and decodes identically to fmt 2, which is how upstream
reads it too; so ``(2, None)`` stands for all of them and is not counted as ambiguous.
Only fmts 0–6 are readings (colibri_mlx decodes nothing else); fmt 0 is the reading for a
tensor without ``.qs`` (``scale_nbytes == 0``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from . import codecs as _codecs
from .codecs import FMT_BY_NAME, FMT_NAMES, GS_CANDIDATES, FormatError, _ceil_div, _check_shape, codec

# The public functions take byte counts named weight_nbytes / scale_nbytes (the shared
# interface), so the byte-count formulas are reached under other names here.
_weight_nbytes, _scale_nbytes = _codecs.weight_nbytes, _codecs.scale_nbytes

Reading = tuple[int, Optional[int]]
Stamp = Union[str, int, tuple]

FP8_BLOCK = 128  # fmt 8 (fp8-e4m3-b128) block edge; upstream-only, see _upstream_fmt8_checks


@dataclass(frozen=True)
class Resolution:
    fmt: int
    gs: Optional[int]
    ambiguous: bool
    readings: list = field(default_factory=list)  # every (fmt, gs) consistent with the bytes


def _bytes_text(O, I, nb, ns) -> str:
    return f"[O={O}, I={I}] with weight {nb} bytes, scales {ns} bytes"


def _expected_text(O, I) -> str:
    lines = []
    for fmt in FMT_NAMES:
        if fmt == 4:
            continue
        lines.append(f"fmt {fmt} ({FMT_NAMES[fmt]}): {_weight_nbytes(fmt, O, I)} + "
                     f"{_scale_nbytes(fmt, O, I)}")
    gs_text = ", ".join(f"gs={g}: {_scale_nbytes(4, O, I, g)}" for g in GS_CANDIDATES if g <= I)
    lines.append(f"fmt 4 (int4-grouped): {_weight_nbytes(4, O, I)} + scales ({gs_text or 'no gs <= I'})")
    return "expected weight + scale bytes: " + "; ".join(lines)


# ---------------------------------------------------------------------------------------
# Upstream's rule.


def _detect_group_size(O: int, I: int, ns: int) -> Optional[int]:
    """``detect_group_size``: first candidate (skipping those > I) whose scale count fits."""
    if ns <= 4 * O:
        return None
    for gs in GS_CANDIDATES:
        if gs > I:
            break
        if ns == 4 * O * _ceil_div(I, gs):
            return gs
    return None


def detect_format(O: int, I: int, weight_nbytes: int, scale_nbytes: int) -> Reading:
    """upstream ``qt_resolve_fmt`` for an unstamped tensor -> (fmt, gs); gs is None unless fmt 4.

    ``scale_nbytes == 0`` means "no ``.qs`` companion": upstream reads that tensor as plain
    float; here it must be float32 ``[O, I]`` (fmt 0). Where upstream refuses to load (unknown
    byte counts, the I=98 fmt 6 collision guard, fp8 ue8m0 shapes) or resolves to fp8-e4m3-b128
    (fmt 8, which colibri_mlx does not decode), this raises :class:`FormatError`.
    """
    O, I = _check_shape(O, I)
    nb, ns = int(weight_nbytes), int(scale_nbytes)
    where = _bytes_text(O, I, nb, ns)
    if ns == 0 and nb == 4 * O * I:
        return 0, None

    # fmt 6 first: its .qs is a single-float tag, every other fmt has >= O scales.
    if ns == 4 and nb == O * 98 * _ceil_div(I, 256):
        _upstream_fmt6_collision_guard(O, I, nb, where)
        return 6, None

    # Row formats before int3-g64 (e.g. [O, 48]: int4-row and int3-g64 both have 24 bytes/row).
    if nb == O * I:
        fmt = 1
    elif nb == O * _ceil_div(I, 2):
        fmt = 2
    elif nb == O * _ceil_div(I, 4):
        fmt = 3
    elif nb == O * 24 * _ceil_div(I, 64):
        fmt = 5
    else:
        raise FormatError(f"{where}: weight bytes match no int8/int4/int2/int3-g64/e8 layout "
                          f"(upstream refuses); {_expected_text(O, I)}")
    gs = None
    if fmt == 2:
        gs = _detect_group_size(O, I, ns)
        fmt = 4 if gs else 2
    if fmt == 1:
        _upstream_fmt8_checks(O, I, ns, where)

    want = _scale_nbytes(fmt, O, I, gs)
    if ns != want:
        raise FormatError(f"{where}: weight bytes say fmt {fmt} ({FMT_NAMES[fmt]}) but its scale "
                          f"array must be {want} bytes (upstream refuses); {_expected_text(O, I)}")
    return fmt, gs


def _upstream_fmt6_collision_guard(O: int, I: int, nb: int, where: str) -> None:
    """upstream's "SECOND DESIGN LANDMINE": at I=98 the e8 byte count is also O*I (fp8 / int8)."""
    if nb != O * I:
        return
    blocks = _ceil_div(O, FP8_BLOCK) * _ceil_div(I, FP8_BLOCK)
    others = []
    if blocks == 1:
        others.append("fp8-e4m3-b128 with one f32 block scale (fmt 8)")
    if blocks == 4:
        others.append("fp8-e4m3-b128 with four ue8m0 block scales (fmt 8)")
    if O == 1:
        others.append("int8-row (fmt 1)")
    if others:
        raise FormatError(f"{where}: matches e8-iq3-lattice (fmt 6) and also "
                          f"{' and '.join(others)}; upstream refuses this unstamped collision")


def _upstream_fmt8_checks(O: int, I: int, ns: int, where: str) -> None:
    """int8-row vs fp8-e4m3-b128 (same weight bytes): upstream decides by the scale geometry."""
    blocks = _ceil_div(O, FP8_BLOCK) * _ceil_div(I, FP8_BLOCK)
    is_row, is_blk, is_ue8m0 = ns == 4 * O, ns == 4 * blocks, ns == blocks
    if is_row and is_blk:
        return  # upstream's "INVERSION": an unstamped tie resolves to int8-row
    if is_ue8m0:
        raise FormatError(f"{where}: scale bytes match fp8-e4m3-b128 ue8m0 block scales "
                          f"({blocks} blocks x 1 byte); upstream refuses (recognized, not implemented)")
    if is_blk:
        raise FormatError(f"{where}: this is fp8-e4m3-b128 (upstream fmt 8: raw e4m3 bytes + "
                          f"{blocks} f32 block scales); colibri_mlx does not decode fmt 8")


# ---------------------------------------------------------------------------------------
# Our rule.


def _reading_order(I: int) -> list[Reading]:
    """Every reading in upstream's order of checks (fmt 0, with no .qs, last)."""
    grouped = [(4, gs) for gs in GS_CANDIDATES if _ceil_div(I, gs) > 1]
    return [(6, None), (1, None), (2, None), *grouped, (3, None), (5, None), (0, None)]


def _fits(reading: Reading, O: int, I: int, nb: int, ns: int) -> bool:
    fmt, gs = reading
    return _weight_nbytes(fmt, O, I, gs) == nb and _scale_nbytes(fmt, O, I, gs) == ns


def possible_formats(O: int, I: int, weight_nbytes: int, scale_nbytes: int) -> list[Reading]:
    """Every (fmt, gs) whose byte counts are exactly these, in upstream's order of checks."""
    O, I = _check_shape(O, I)
    nb, ns = int(weight_nbytes), int(scale_nbytes)
    return [r for r in _reading_order(I) if _fits(r, O, I, nb, ns)]


def _preference(reading: Reading, I: int, order: list[Reading]) -> tuple:
    """Lower sorts first: the converter's defaults, then upstream's order.

    gs=64 is the converter's default and gs=128 the other size it and upstream's tests use;
    fmt 6 at I % 256 != 0 sorts last because the converter refuses to write it (quant_e8).
    """
    fmt, gs = reading
    if reading == (4, 64):
        return (0, 0)
    if reading == (4, 128):
        return (1, 0)
    if fmt == 6 and I % 256:
        return (3, 0)
    return (2, order.index(reading))


def _parse_stamp(stamp: Stamp) -> tuple[int, Optional[int], bool]:
    """-> (fmt, gs, gs_given). Accepts a fmt name, a fmt int, or (fmt name|int, gs)."""
    gs, gs_given = None, False
    if isinstance(stamp, tuple):
        if len(stamp) != 2:
            raise FormatError(f"stamp {stamp!r}: expected (fmt, gs)")
        stamp, gs = stamp
        gs_given = True
    if isinstance(stamp, str):
        if stamp not in FMT_BY_NAME:
            raise FormatError(f"stamp names format {stamp!r}, which colibri_mlx does not read "
                              f"(known: {sorted(FMT_BY_NAME)})")
        fmt = FMT_BY_NAME[stamp]
    else:
        fmt = codec(stamp).fmt
    if fmt != 4:
        gs_given = True  # only fmt 4 has a gs to find
        gs = None if (gs is None or (fmt == 5 and gs == 64)) else gs
    return fmt, gs, gs_given


def resolve_format(O: int, I: int, weight_nbytes: int, scale_nbytes: int,
                   stamp: Optional[Stamp] = None) -> Resolution:
    """Our reading of a tensor: the stamp if it fits the bytes, else the preferred reading.

    ``stamp`` is what our writer recorded: a fmt name (``"int4-grouped"``), a fmt int, or
    ``(fmt, gs)``. A stamp that disagrees with the byte counts is a :class:`FormatError`
    naming both. ``ambiguous`` is True when the pick was made among several readings
    (never when a complete stamp decided).
    """
    O, I = _check_shape(O, I)
    nb, ns = int(weight_nbytes), int(scale_nbytes)
    readings = possible_formats(O, I, nb, ns)
    where = _bytes_text(O, I, nb, ns)
    if stamp is not None:
        return _resolve_stamped(stamp, O, I, nb, ns, readings, where)
    if not readings:
        raise FormatError(f"{where}: no fmt 0-6 layout has these byte counts; {_expected_text(O, I)}")
    order = _reading_order(I)
    fmt, gs = min(readings, key=lambda r: _preference(r, I, order))
    return Resolution(fmt, gs, len(readings) > 1, readings)


def _resolve_stamped(stamp, O, I, nb, ns, readings, where) -> Resolution:
    fmt, gs, gs_given = _parse_stamp(stamp)
    if gs_given:
        candidates = [(fmt, gs)]
    else:  # a bare "int4-grouped": any candidate gs, whole-row groups included
        candidates = [(4, g) for g in GS_CANDIDATES]
    try:
        fitting = [r for r in candidates if _fits(r, O, I, nb, ns)]
    except FormatError as exc:
        raise FormatError(f"{where}: stamp {stamp!r} is not a valid format: {exc}") from None
    if not fitting:
        raise FormatError(f"{where}: stamp {stamp!r} disagrees with the byte counts, which fit "
                          f"{readings or 'no fmt 0-6 layout'}")
    order = _reading_order(I) + [(4, g) for g in GS_CANDIDATES]
    pick = min(fitting, key=lambda r: _preference(r, I, order))
    distinct_groupings = {min(g, I) for _, g in fitting} if not gs_given else {0}
    return Resolution(pick[0], pick[1], len(distinct_groupings) > 1, readings)

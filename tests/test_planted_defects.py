"""The simulator tests bite: a defect planted into a copy of a Metal source makes them fail.

Four kinds of defect, each planted at its first site in code (comments skipped) of every Metal
source that has one, and at a named site for the loop bound:

- a SIMD reduction (simd_sum / simd_max / simd_min) that returns its input;
- a `threadgroup_barrier` removed;
- a `simd_shuffle_xor` that reads its own lane (mask 0);
- an off-by-one in a loop bound over the reduction dimension (K): the last element dropped.

For each copy, the kernel tests that use the source (``-m msl``, the most direct first, ``-x``)
run in a subprocess whose kernels come from the copy (``COLIBRI_MSL_KERNEL_DIR``, read by
conftest.py). They must fail, and not by a compile error: a plant that does not compile
proves nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_mlx.kernels import dispatch

ROOT = Path(__file__).resolve().parents[1]
KERNEL_ENV = "COLIBRI_MSL_KERNEL_DIR"

# The simulator tests that run each source's kernels, the most direct first.
QGEMV = ["tests/test_qgemv_msl.py"]
MOE = ["tests/test_moe_mla_msl.py::test_moe_every_fmt", "tests/test_moe_mla_msl.py",
       "tests/test_moe_shared_slot.py"]
MLA = ["tests/test_moe_mla_msl.py::test_mla_one_layer_across_decode_steps", "tests/test_moe_mla_msl.py",
       "tests/test_compiled.py"]
ROUTER = ["tests/test_router.py", "tests/test_moe_shared_slot.py", "tests/test_moe_mla_msl.py"]
TESTS = {
    "qgemv.metal": QGEMV,
    "qdecode.h": QGEMV + MOE + MLA,
    "moe_block.metal": MOE,
    "hadamard.metal": ["tests/test_moe_mla_msl.py::test_hadamard_matches_float64"] + MOE,
    "mla_decode.metal": MLA,
    "router.metal": ROUTER,
}

# The loop over K of each source, as (code, planted): the last element of K is dropped.
K_LOOPS = {
    "qgemv.metal": ("for (int base = tid; base < n_units; base += STEP) {",
                    "for (int base = tid; base < n_units - 1; base += STEP) {"),
    "moe_block.metal": ("for (int base = tid; base < n_units; base += STEP) {",
                        "for (int base = tid; base < n_units - 1; base += STEP) {"),
    "hadamard.metal": ("for (int i = tid; i < b; i += TG) {", "for (int i = tid; i < b - 1; i += TG) {"),
    # mla_qabs_columns: rows n of the head's nope rows (the q' columns' reduction)
    "mla_decode.metal": ("xq[i] = n < nope ? float(qh[n])", "xq[i] = n < nope - 1 ? float(qh[n])"),
    "router.metal": ("for (int u = tid; u < n4; u += 32 * NW) {", "for (int u = tid; u < n4 - 1; u += 32 * NW) {"),
}

_REDUCTION = re.compile(r"\bsimd_(?:sum|max|min)\(")
_BARRIER = re.compile(r"\bthreadgroup_barrier\(mem_flags::\w+\);")
_XOR = re.compile(r"\bsimd_shuffle_xor\(")


def _code_spans(text: str):
    """(start, end) of each line's code part: `//` comments left out."""
    pos = 0
    for line in text.splitlines(keepends=True):
        code = line.split("//", 1)[0] if '"' not in line else line
        yield pos, pos + len(code)
        pos += len(line)


def _first_in_code(pattern: re.Pattern, text: str):
    for start, end in _code_spans(text):
        m = pattern.search(text, start, end)
        if m:
            return m
    return None


def _closing_paren(text: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError("unbalanced parentheses")


def _top_level_comma(text: str, start: int, end: int) -> int:
    depth = 0
    for i in range(start, end):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if text[i] == "," and depth == 0:
            return i
    raise ValueError("no second argument")


def plant_reduction(text: str) -> str | None:
    """simd_sum(v) -> (v)."""
    m = _first_in_code(_REDUCTION, text)
    return None if m is None else text[:m.start()] + text[m.end() - 1:]


def plant_barrier(text: str) -> str | None:
    m = _first_in_code(_BARRIER, text)
    return None if m is None else text[:m.start()] + text[m.end():]


def plant_xor_own_lane(text: str) -> str | None:
    """simd_shuffle_xor(v, mask) -> simd_shuffle_xor(v, ushort(0))."""
    m = _first_in_code(_XOR, text)
    if m is None:
        return None
    close = _closing_paren(text, m.end() - 1)
    comma = _top_level_comma(text, m.end(), close)
    return text[:comma] + ", ushort(0)" + text[close:]


def plant_k_loop(name: str, text: str) -> str | None:
    if name not in K_LOOPS:
        return None
    code, planted = K_LOOPS[name]
    assert text.count(code) >= 1, f"{name}: the K loop {code!r} is gone; name the new one in K_LOOPS"
    return text.replace(code, planted, 1)


PLANTERS = {
    "reduction returns its input": lambda name, text: plant_reduction(text),
    "barrier removed": lambda name, text: plant_barrier(text),
    "xor shuffle reads its own lane": lambda name, text: plant_xor_own_lane(text),
    "K loop off by one": plant_k_loop,
}


def _plants() -> list:
    cases = []
    for name in sorted(TESTS):
        text = (dispatch.KERNEL_DIR / name).read_text()
        for kind, planter in PLANTERS.items():
            if planter(name, text) is not None:
                cases.append(pytest.param(name, kind, id=f"{name}-{kind.replace(' ', '_')}"))
    return cases


def test_every_source_and_kind_is_planted_somewhere():
    """The table covers every Metal source, names test files that exist, and each defect kind
    has sources to go in."""
    sources = {p.name for p in dispatch.KERNEL_DIR.glob("*.metal")} | {"qdecode.h"}
    assert sources == set(TESTS)
    for targets in TESTS.values():
        for target in targets:
            assert (ROOT / target.split("::")[0]).is_file(), target
    kinds = {p.values[1] for p in _plants()}
    assert kinds == set(PLANTERS)


def test_planters_change_exactly_the_site():
    src = ("// simd_sum(x) in a comment\nfloat a = simd_sum(v + w);\nfloat b = simd_sum(u);\n"
           "threadgroup_barrier(mem_flags::mem_threadgroup);\nx = simd_shuffle_xor(f(a, b), ushort(1 << k));\n")
    assert plant_reduction(src) == src.replace("a = simd_sum(v + w)", "a = (v + w)")
    assert plant_barrier(src) == src.replace("threadgroup_barrier(mem_flags::mem_threadgroup);", "")
    assert plant_xor_own_lane(src) == src.replace("ushort(1 << k))", "ushort(0))")
    assert plant_reduction("float a = x;\n") is None


@pytest.mark.slow
@pytest.mark.parametrize("name, kind", _plants())
def test_simulator_tests_fail_on_a_planted_defect(tmp_path, name, kind):
    from tests.msl import simulator

    if simulator.unavailable_reason():
        pytest.skip(f"MSL simulator: {simulator.unavailable_reason()}")
    copy = tmp_path / "metal_kernels"
    shutil.copytree(dispatch.KERNEL_DIR, copy)
    planted = PLANTERS[kind](name, (copy / name).read_text())
    (copy / name).write_text(planted)
    env = {**os.environ, KERNEL_ENV: str(copy), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-m", "msl", "-p", "no:cacheprovider",
           "--no-header", "-o", "addopts=", *TESTS[name]]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    out = res.stdout + res.stderr
    assert "failed to compile" not in out, f"the plant does not compile:\n{out[-3000:]}"
    assert res.returncode == 1, (f"{name} with '{kind}': the simulator tests did not fail "
                                 f"(exit {res.returncode}):\n{out[-3000:]}")

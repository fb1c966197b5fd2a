"""Every CUDA twin compiles with NVRTC, MLX's own CUDA compiler, as MLX would compile it.

The text is what dispatch hands ``mx.fast.cuda_kernel`` (pruned header, template constants) in
the wrapper MLX writes around it (scripts/kernels/compile_cuda_twins.py), compiled for sm_90a with MLX's
NVRTC options, for the launches of every kernel family at its default settings (each fmt, S = 1
and 8, bf16 / f16 / float32, the MLA variants and the router): here the fewest launches that
compile every template setting once (:func:`covering`), every combination on the device (the
``cuda_twins`` step of scripts/device/steps.sh). ptxas must spill nothing (a spill
in a hot loop is a silent slowdown of a kernel tuned for its registers). No GPU needed: the pip
wheels nvidia-cuda-nvrtc, -runtime and -cccl carry the compiler and headers; without them the
tests are skipped. The Metal sources are checked by the MSL simulator instead (tests/msl/).
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "kernels"))

import compile_cuda_twins as cct  # noqa: E402

NVRTC = cct.NVRTC.find()
pytestmark = pytest.mark.skipif(NVRTC is None, reason="libnvrtc not installed (pip wheels nvidia-cuda-nvrtc, "
                                                      "nvidia-cuda-runtime, nvidia-cuda-cccl)")


def _first_labels(specs) -> dict:
    """``{translation unit's text: the first label with it}``: launch settings that end in the
    same template (a fifth of the families' launches) are one compile."""
    first = {}
    for label, spec in specs:
        first.setdefault(cct.wrap(spec, "kernel"), label)
    return first


def _compile_all(specs, tmp_path):
    """``{label: (ok, log)}``, NVRTC's compiles side by side (they run outside the GIL), each
    distinct text once (under its first label)."""
    first = _first_labels(specs)
    todo = [(label, spec) for label, spec in specs if label in set(first.values())]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        done = dict(zip([label for label, _ in todo],
                        pool.map(lambda ls: cct.compile_one(ls[0], ls[1], tmp_path, True, NVRTC), todo)))
    return {label: done[first[cct.wrap(spec, "kernel")]] for label, spec in specs}


def covering(specs) -> list:
    """The fewest launches (greedy) that together hold every (kernel, template setting) pair of
    ``specs``: each branch a template value selects is compiled at least once, in ~60 compiles
    instead of the default matrix's ~170 (CPU minutes in CI). Every combination is compiled by
    ``scripts/kernels/compile_cuda_twins.py`` (the device step ``cuda_twins``)."""
    def settings(spec):
        return {(spec.name, key, str(value)) for key, value in spec.template}

    wanted = set().union(*(settings(spec) for _, spec in specs))
    chosen, seen = [], set()
    while seen != wanted:
        label, spec = max(specs, key=lambda ls: len(settings(ls[1]) - seen))
        chosen.append((label, spec))
        seen |= settings(spec)
    return chosen


def test_covering_holds_every_setting_once_chosen():
    specs = list(cct.FAMILIES["qgemv"](False))
    chosen = covering(specs)
    assert len(chosen) < len(specs)
    every = {(s.name, k, str(v)) for _, s in specs for k, v in s.template}
    assert every == {(s.name, k, str(v)) for _, s in chosen for k, v in s.template}


@pytest.mark.parametrize("family,kernels", [("moe", ("moe_gate_up", "moe_down")),
                                             ("mla", ("mla_qb_qabs", "mla_qabs", "mla_out"))])
def test_covering_compiles_every_gguf_decoder(family, kernels):
    """The default set compiles every GGUF decoder (kernels/gguf_decode.py KERNEL_FMTS) in moe_block
    and in mla_decode at least once (moe: each type as gate/up or as down; mla: as kv_b or q_b)."""
    from colibri_mlx.kernels.gguf_decode import KERNEL_FMTS

    chosen = covering(list(cct.FAMILIES[family](False)))
    fmts = {v for _, spec in chosen if spec.name in kernels for k, v in spec.template if k in ("FMT", "FMTB")}
    assert set(KERNEL_FMTS) <= fmts, sorted(set(KERNEL_FMTS) - fmts)


@pytest.mark.parametrize("family", sorted(cct.FAMILIES))
def test_cuda_twins_compile_without_spills(family, tmp_path):
    specs = covering(list(cct.FAMILIES[family](False)))
    assert specs
    results = _compile_all(specs, tmp_path)
    failed = {label: log[-2000:] for label, (ok, log) in results.items() if not ok}
    assert not failed, failed
    reports = {label: cct.ptxas_report(log) for label, (_, log) in results.items()}
    assert all(r["regs"] for r in reports.values()), reports          # ptxas did report
    # a launch compiled for more blocks an SM (MINB, dispatch.with_min_blocks) may spill a little
    bounded = {label for label, spec in specs if any(k == "MINB" for k, _ in spec.template)}
    spilled = {label: r for label, r in reports.items() if r["spill"] > (64 if label in bounded else 0)}
    assert not spilled, spilled
    assert all((tmp_path / f"{cct.object_name(label)}.cubin").stat().st_size > 0
               for label in _first_labels(specs).values())


def test_a_broken_twin_fails_with_nvrtc_error(tmp_path):
    """The check can fail: a body that assigns a pointer to a float is refused, with the line."""
    import dataclasses

    label, spec = next(iter(cct.FAMILIES["router"](False)))
    broken = dataclasses.replace(spec, source=spec.source + "\n  float planted_defect = scores;\n")
    (ok, log), = _compile_all([(label, broken)], tmp_path).values()
    assert not ok and "error" in log and "planted_defect" in log


def test_nvrtc_runs_with_mlx_options(tmp_path):
    """MLX compiles with --device-as-default-execution-space: an unqualified helper is device code
    (nvcc would reject this call from a kernel)."""
    source = ("int twice(int v) { return 2 * v; }\n"
              "__global__ void k(int* out) { out[0] = twice(out[0]); }\n")
    ok, log, cubin = NVRTC.compile(source, "k")
    assert ok, log
    assert cubin[:4] == b"\x7fELF"


def test_launch_bounds_reach_ptxas(tmp_path):
    """dispatch.with_min_blocks: the bound travels in the header MLX puts before its own kernel
    signature, and ptxas honours it (moe_down, one token, 4 warps: 64 registers unbounded; 10
    blocks of 128 threads an SM leave at most 51)."""
    import dataclasses

    from colibri_mlx.kernels import dispatch

    spec = dict(cct.FAMILIES["moe"](False))["down_fmt4_S1_nwNone"]
    spec = dataclasses.replace(spec, threadgroup=(128, 1, 1),
                               template=[(k, 4 if k == "NW" else v) for k, v in spec.template])
    bounded = dispatch.with_min_blocks(spec, 10)
    assert dispatch.with_min_blocks(spec, 0) is spec and ("MINB", 10) in bounded.template
    # moe_down's default for one token on CUDA at 4 warps (moe.CUDA_DOWN_MIN_BLOCKS): the same text
    default = dict(cct.FAMILIES["moe"](False))["down_fmt4_S1_nw4"]
    assert ("MINB", 7) in default.template and default.header.startswith(bounded.header.split("\n")[0])
    results = _compile_all([("unbounded", spec), ("bounded", bounded)], tmp_path)
    regs = {label: cct.ptxas_report(log)["regs"] for label, (ok, log) in results.items() if ok}
    assert set(regs) == {"unbounded", "bounded"}, results
    assert regs["bounded"] <= 65536 // (10 * 128) < regs["unbounded"], regs

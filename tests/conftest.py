import os

# MLX runs float32 matmuls at TF32 precision on CUDA tensor cores (and on M5 NAX) unless this is
# 0 (mlx#3860); our parity tests compare float32 logits at 1e-4, so pin full precision, as MLX's
# own test harness does. Must be set before the first MLX operation.
os.environ["MLX_ENABLE_TF32"] = "0"

from pathlib import Path

import pytest

# Kernels from another directory: a copy with a planted defect (tests/test_planted_defects.py).
if os.environ.get("COLIBRI_MSL_KERNEL_DIR"):
    from colibri_mlx.kernels import dispatch

    dispatch.KERNEL_DIR = Path(os.environ["COLIBRI_MSL_KERNEL_DIR"])

# Tests that run Metal kernels in the MSL simulator (tests/msl/): whole modules, and any test that
# takes the `metal` fixture (every hot-path launch routed to the simulator). `-m msl` selects them,
# which is how .ci/run repeats them under a second clang.
MSL_MODULES = {"test_simulator.py", "test_qgemv_msl.py", "test_moe_mla_msl.py"}


def _simulator():
    from tests.msl import simulator

    return simulator


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in MSL_MODULES or "metal" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.msl)


def pytest_report_header(config):
    sim = _simulator()
    reason = sim.unavailable_reason()
    return f"MSL simulator: {sim.compiler().describe() if reason is None else 'unavailable: ' + reason}"


def _msl_outcomes(terminalreporter) -> dict:
    counts: dict = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        for rep in terminalreporter.stats.get(outcome, []):
            if "msl" in getattr(rep, "keywords", {}) or any(m in rep.nodeid for m in MSL_MODULES):
                counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    sim = _simulator()
    reason = sim.unavailable_reason()
    if reason is not None:
        terminalreporter.write_line(
            f"MSL simulator: NOT RUN ({reason}); no Metal kernel was checked"
            + ("; failing, since CI must check them" if os.environ.get("CI") else ""),
            red=True, bold=True)
        return
    counts = _msl_outcomes(terminalreporter)
    if counts:
        text = ", ".join(f"{n} {k}" for k, n in counts.items())
        terminalreporter.write_line(f"MSL simulator: {sim.compiler().describe()}: {text}")


def pytest_sessionfinish(session, exitstatus):
    # A CI run whose simulator could not run would be green with no Metal kernel checked.
    if os.environ.get("CI") and _simulator().unavailable_reason() is not None and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

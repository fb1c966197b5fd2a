"""A wheel built from the repository is complete: installed into a fresh virtual environment
and run from outside the checkout, it finds its Metal and CUDA kernel sources and the demo
model, and generates; the sdist carries what a build needs."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, **kw):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert res.returncode == 0, f"{cmd} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # The test environment's setuptools builds it (no download), as `pip install .` would.
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
         cwd=ROOT)
    (whl,) = out.glob("colibri_mlx-*.whl")
    return whl


def test_wheel_holds_the_kernel_sources_and_the_demo_model(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for src in sorted(ROOT.glob("metal_kernels/**/*")):
        if src.is_file():
            assert f"colibri_mlx/{src.relative_to(ROOT).as_posix()}" in names, f"{src.name} is not in the wheel"
    assert {"colibri_mlx/demo/config.json", "colibri_mlx/demo/tokenizer.json",
            "colibri_mlx/demo/out-mtp-00000.safetensors", "colibri_mlx/formats/_e8_encode.c"} <= names


def test_wheel_generates_from_a_fresh_venv_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    # The dependencies come from the test environment (no download): its site-packages on the
    # path, but not its editable colibri_mlx, whose finder only a site directory's .pth starts.
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)])
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COLIBRI_MSL_KERNEL_DIR")}
    probe = _run([str(py), "-c", "import colibri_mlx, colibri_mlx.kernels.dispatch as d; "
                  "print(colibri_mlx.__file__); print(d.KERNEL_DIR)"], cwd=outside, env=env).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in probe), probe
    assert (Path(probe[1]) / "qgemv.metal").is_file() and (Path(probe[1]) / "cuda" / "qgemv.cu").is_file()
    res = _run([str(venv / "bin" / "colibri"), "generate", "-p", "And God said", "--max-tokens", "8"],
               cwd=outside, env=env)
    assert res.stdout.strip(), res.stderr
    assert "tok/s" in res.stderr or "tokens" in res.stderr, res.stderr


def test_sdist_holds_what_a_build_needs(tmp_path):
    _run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=ROOT)
    (sdist,) = tmp_path.glob("colibri_mlx-*.tar.gz")
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    assert {"setup.py", "pyproject.toml", "README.md", "metal_kernels/qgemv.metal", "metal_kernels/cuda/qgemv.cu",
            "metal_kernels/qdecode.h", "colibri_mlx/demo/config.json"} <= names

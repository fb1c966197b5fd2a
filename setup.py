"""The Metal and CUDA kernel sources live in metal_kernels/ at the repository root, beside the
package; a built wheel carries them inside the package, as colibri_mlx/metal_kernels/, where
colibri_mlx.kernels.dispatch looks first. Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

KERNELS = Path(__file__).resolve().parent / "metal_kernels"


class build_py_with_kernels(build_py):
    def run(self):
        super().run()
        if not KERNELS.is_dir():
            raise FileNotFoundError(f"{KERNELS}: the kernel sources are missing from the source tree")
        target = Path(self.build_lib) / "colibri_mlx" / "metal_kernels"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(KERNELS, target, ignore=shutil.ignore_patterns("*~", "__pycache__"))


setup(cmdclass={"build_py": build_py_with_kernels})

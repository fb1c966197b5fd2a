"""Quantize test data with llama.cpp's own quantizer: tests/data/gguf_quants.npz.

Calls ggml's ``ggml_quantize_chunk`` through ctypes on the ggml library inside an installed
``llama-cpp-python`` (``pip install llama-cpp-python==0.3.36``; the tests never build it, they read
the file this writes). One float input ``x [8, 512]`` (rows of very different magnitudes, heavy
tails) is quantized to every GGUF type of colibri_mlx.formats.gguf_quant.GGUF_TYPES; the types
ggml refuses to quantize without an importance matrix (``ggml_quantize_requires_imatrix``) get
``imatrix``, the mean of squared random activations with a few hot channels, as llama-imatrix
computes it. Every type is also quantized with that matrix (``<TYPE>_imatrix``), the path
llama-quantize takes for every type when given one.

    python scripts/gguf/make_quant_fixtures.py [--out tests/data/gguf_quants.npz]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from colibri_mlx.formats.gguf_quant import GGUF_TYPES, row_nbytes  # noqa: E402

ROWS, COLS = 8, 512


def ggml_library() -> ctypes.CDLL:
    import llama_cpp

    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    found = sorted(glob.glob(os.path.join(lib_dir, "libggml-base.so*")) + glob.glob(os.path.join(lib_dir, "libggml-base.dylib")))
    if not found:
        raise SystemExit(f"no libggml-base in {lib_dir}")
    lib = ctypes.CDLL(found[0])
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    return lib


def test_input(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    scale = np.array([1e-3, 0.02, 0.1, 0.5, 1.0, 3.0, 30.0, 1.0], np.float32)[:, None]
    x = rng.standard_t(df=4, size=(ROWS, COLS)).astype(np.float32) * scale
    x[7, ::37] *= 20.0                       # outliers in one row
    x[3, 256:288] = 0.0                      # an all-zero 32-block
    acts = rng.standard_normal((256, COLS)).astype(np.float32)
    acts[:, rng.choice(COLS, 8, replace=False)] *= 10.0
    imatrix = (acts ** 2).mean(axis=0).astype(np.float32)
    return x, imatrix


def quantize(lib, ggml_type: int, x: np.ndarray, imatrix: np.ndarray | None, nbytes_row: int) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros((x.shape[0], nbytes_row), np.uint8)
    im = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
    n = lib.ggml_quantize_chunk(ggml_type, x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1],
                                None if im is None else im.ctypes.data)
    if n != out.nbytes:
        raise SystemExit(f"ggml type {ggml_type}: ggml wrote {n} bytes, expected {out.nbytes}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "gguf_quants.npz"))
    args = ap.parse_args()
    lib = ggml_library()
    x, imatrix = test_input(np.random.default_rng(36))
    arrays = {"x": x, "imatrix": imatrix}
    for name, t in GGUF_TYPES.items():
        nb = row_nbytes(t, COLS)
        if not lib.ggml_quantize_requires_imatrix(t.ggml_type):
            arrays[name] = quantize(lib, t.ggml_type, x, None, nb)
        arrays[f"{name}_imatrix"] = quantize(lib, t.ggml_type, x, imatrix, nb)
    tmp = args.out + ".tmp.npz"
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {len(arrays) - 2} quantized arrays, {os.path.getsize(args.out)} bytes")


if __name__ == "__main__":
    main()

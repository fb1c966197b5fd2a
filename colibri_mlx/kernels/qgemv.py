"""qgemv: ``y = x @ W.T`` for S <= 8 rows of x against a colibri-quantized W (fmt 1-6).

``launch_spec(x, qt, backend)`` builds the exact launch (source, inputs, grid, template) that
:func:`qgemv` hands to ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` and that the MSL
simulator runs in tests. ``decline_reason`` says, before any launch, why a kernel would not
take a call; the caller then counts a fallback and runs the reference.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from . import dispatch
from .reference import e8_grid_words, row_bytes, scales_per_row

NAME = "qgemv"
MAX_ROWS = 8                    # S above this is prefill: dequantized tiles + matmul
SIMD = 32
SIMDGROUPS_PER_THREADGROUP = 4  # 128 threads: 4 output rows per threadgroup
DEFAULT_UNROLL = 4
KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
UNIT_WEIGHTS = {1: 8, 2: 16, 3: 32, 4: 16, 5: 64, 6: 32}
PARAMS_LEN = 8                  # >= 8 elements: MLX passes it as a device pointer

INPUT_NAMES = ("x", "w", "scales", "e8grid", "params")
OUTPUT_NAMES = ("y",)


def decline_reason(x: mx.array, qt) -> Optional[str]:
    """Why the GPU kernel will not run this call, or None if it will."""
    S = x.shape[0]
    if qt.fmt not in UNIT_WEIGHTS:
        return f"fmt {qt.fmt} has no qgemv kernel"
    if not 1 <= S <= MAX_ROWS:
        return f"S={S} outside 1..{MAX_ROWS}"
    if x.dtype not in KERNEL_DTYPES:
        return f"x dtype {x.dtype} not float32/float16/bfloat16"
    if qt.fmt == 4 and (not qt.gs or qt.gs % 16):
        return f"fmt 4 with gs={qt.gs} (needs a multiple of 16)"
    if SIMD * qt.O >= 2**31 or S * max(qt.I, qt.O) >= 2**31:
        return f"shape {qt.O}x{qt.I} too large for 32-bit indexing"
    return None


def _at_least_8(a: mx.array) -> mx.array:
    """Pad a tiny input to 8 elements so MLX gives it device (not constant) address space."""
    a = a.reshape(-1)
    if a.size >= PARAMS_LEN:
        return a
    return mx.concatenate([a, mx.zeros((PARAMS_LEN - a.size,), a.dtype)])


_grid_mx: dict = {}


def _e8grid() -> mx.array:
    g = _grid_mx.get("g")
    if g is None:
        g = _grid_mx["g"] = mx.array(e8_grid_words())
    return g


def _as_mx(a, dtype) -> mx.array:
    """QTensor arrays may still be numpy (memory-mapped); ``QTensor.to_mlx()`` avoids the copy."""
    if not isinstance(a, mx.array):
        a = mx.array(np.ascontiguousarray(np.asarray(a)))
    return a if a.dtype == dtype else a.view(dtype) if a.dtype.size == dtype.size else a.astype(dtype)


def params(qt) -> mx.array:
    rb = row_bytes(qt.fmt, qt.I)
    per_row = scales_per_row(qt.fmt, qt.I, qt.gs) if qt.fmt in (4, 5) else (
        -(-qt.I // 256) if qt.fmt == 6 else 1)
    n_units = -(-qt.I // UNIT_WEIGHTS[qt.fmt])
    return mx.array([qt.O, qt.I, rb, per_row, n_units, 0, 0, 0], dtype=mx.int32)


def default_unroll(fmt: int, S: int) -> int:
    """Units of loads each lane issues before computing. Fewer for the wide units (fmt 5: 64
    decoded weights, fmt 6: 32 plus grid lookups) with many rows of x, where UNROLL 4 makes the
    CUDA twin spill registers (nvcc -Xptxas -v, sm_90: fmt 5 S=8 U4 spills, U1 does not)."""
    if fmt == 5:
        return 1 if S > 4 else 2
    if fmt == 6 and S > 4:
        return 2
    return DEFAULT_UNROLL


def launch_spec(x: mx.array, qt, backend: str = dispatch.METAL,
                unroll: Optional[int] = None,
                simdgroups: int = SIMDGROUPS_PER_THREADGROUP) -> dispatch.LaunchSpec:
    """The launch for ``x[S, I] @ W.T`` (S <= 8); identical arguments for MLX and the simulator."""
    S = x.shape[0]
    unroll = unroll or default_unroll(qt.fmt, S)
    rb = row_bytes(qt.fmt, qt.I)
    header, body = dispatch.read_kernel_source(NAME, backend)
    packed = _as_mx(qt.packed, mx.uint8)
    scales = _as_mx(qt.scales, mx.float32)
    vec = int(qt.fmt in (1, 2, 3, 4) and rb % 8 == 0)
    x_vec = int((qt.I * x.dtype.size) % 16 == 0)
    template = [("T", x.dtype), ("FMT", int(qt.fmt)), ("S", int(S)),
                ("GS", int(qt.gs) if qt.fmt == 4 else 16), ("VEC", vec), ("XV", x_vec),
                ("UNROLL", int(unroll))]
    return dispatch.LaunchSpec(
        name=NAME,
        input_names=INPUT_NAMES,
        output_names=OUTPUT_NAMES,
        source=body,
        header=header,
        inputs=[_at_least_8(x), _at_least_8(packed), _at_least_8(scales), _e8grid(), params(qt)],
        output_shapes=[(S, qt.O)],
        output_dtypes=[x.dtype],
        grid=(SIMD * qt.O, 1, 1),
        threadgroup=(SIMD * simdgroups, 1, 1),
        template=template,
    )


def qgemv(x: mx.array, qt, backend: str, **tuning) -> mx.array:
    """Run the ``backend`` kernel on ``x[S, I]``; the caller checked :func:`decline_reason`."""
    spec = launch_spec(x, qt, backend, **tuning)
    return dispatch.launch(backend, spec)[0]

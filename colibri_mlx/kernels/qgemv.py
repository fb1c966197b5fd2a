"""qgemv: ``y = x @ W.T`` for S <= 8 rows of x against a quantized W (colibri fmt 1-6, MLX fmt 7-10,
GGUF fmt 11-28: kernels/gguf_decode.py).

``launch_spec(x, qt, backend)`` builds the exact launch (source, inputs, grid, template) that
:func:`qgemv` hands to ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` and that the MSL
simulator runs in tests. ``decline_reason`` says, before any launch, why a kernel would not
take a call; the caller then counts a fallback and runs the reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from . import dispatch, gguf_decode, gguf_formats, mlx_formats
from .reference import row_bytes, scales_per_row

NAME = "qgemv"
MAX_ROWS = 8                    # S above this is prefill: dequantized tiles + matmul
SIMD = 32
KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
UNIT_WEIGHTS = {1: 16, 2: 32, 3: 64, 4: 32, 5: 64, 6: 32, **{f: mlx_formats.UNIT for f in (7, 8, 9, 10)},
                **gguf_decode.KERNEL_FMTS}
PARAMS_LEN = 8                  # >= 8 elements: MLX passes it as a device pointer
MAX_SIMDGROUPS = 4              # split-K: SIMD groups sharing one threadgroup's rows
# Enough SIMD groups for 132 SMs x ~32 resident warps (H200); below this the launch splits
# each row across more SIMD groups of a threadgroup.
TARGET_SIMDGROUPS = 4096

# fmt 2/4 decode (template NIB): 1 = nibble codes as exact fp16 subnormals, one -8 * sum(x) per
# segment (fewer instructions per weight: the CUDA default); 0 = magic-number codes with a bias
# op per nibble pair. Metal keeps 0 until fp16 subnormal conversion is confirmed on Apple GPUs
# (the MSL simulator runs on the CPU, where it is exact).
DEFAULT_NIB = {dispatch.METAL: 0, dispatch.CUDA: 1}



def cuda_tuned(fmt: int) -> bool:
    """Whether a kernel FMT code (kernels/mlx_formats.py: fmt 0-6 their own) takes the CUDA
    settings measured on fmt 2/4 (PF 1, the persistent grid of six-row blocks): fmt 2/4 and the
    MLX formats of at most 4 bits, whose units are 32 weights of at most 16 bytes plus at most
    two scale words, register buffers no larger than fmt 4's (compile_cuda_twins.py --ptxas). Not
    the GGUF types (their launch variants: scripts/bench/bench_gguf_gemv.py)."""
    return fmt in (2, 4) or (mlx_formats.is_mlx_kernel_fmt(fmt) and mlx_formats.kernel_bits(fmt) <= 4)


def default_prefetch(fmt: int, S: int, backend: str) -> int:
    """Template PF: 1 = the next step's weight loads are issued before this step's arithmetic
    (a second register buffer, UNROLL 1 by default: bytes stay in flight while a warp decodes);
    0 = load UNROLL units, then compute. CUDA, :func:`cuda_tuned` formats (decode-heavy), few
    rows of x. ``fmt``: the kernel FMT code."""
    return int(backend == dispatch.CUDA and cuda_tuned(fmt) and S <= 4)

# PERS 1 (CUDA's default for one row of x, fmt 2 / 4, one SIMD group a threadgroup): a fixed
# grid of blocks that loop over the row blocks instead of one block each (no block launched
# per row block). Sized for what an H100 / H200 keeps resident (132 SMs x 16 one-warp blocks of
# <= 128 registers) and balanced (dispatch.balanced_blocks: every block as many row blocks); a
# GPU of another size still computes every row. Only up to a few waves of row blocks: at
# 73728x7168 (8.7 waves) the looping grid was slower than one block a row block (88.9 against
# 84.7 us). H200, kernel alone: docs/performance.md.
CUDA_PERSISTENT_BLOCKS = dispatch.CUDA_SMS * 16
CUDA_PERSISTENT_MAX_WAVES = 3
# Rows a block of the persistent grid (6 instead of 4: more bytes in flight a warp). H200,
# 18432x7168, kernel alone: ROWS 6 over 1536 blocks 25.3 us (fmt 2: 23.7) against ROWS 4 over
# 2112 26.1 (24.2); ROWS 3, 8, 12 were slower (28.9, 35.4, 33.1), ROWS 9 equal. Its blocks use
# 166 registers a thread (fmt 4; compile_cuda_twins.py --ptxas): 12 resident an SM. Only for
# long rows: at 24576x1536 (48 units a row) ROWS 6 took 13.3 us against ROWS 4's 12.5. The
# launch also compiles the shape in (template KO..KNU): no params load ahead of the first weight
# load, constant loop bounds (18432x7168 fmt 4: 24.5 us against 25.5).
CUDA_PERSISTENT_ROWS = 6
CUDA_PERSISTENT_ROWS_BLOCKS = dispatch.CUDA_SMS * 12
CUDA_PERSISTENT_ROWS_MIN_UNITS = 128


def default_persistent(fmt: int, S: int, backend: str, simdgroups: int, prefetch: int, n_blocks: int) -> int:
    """Threadgroups of a persistent launch over ``n_blocks`` row blocks (0: one per row block)."""
    if (backend == dispatch.CUDA and cuda_tuned(fmt) and S == 1 and simdgroups == 1 and prefetch
            and CUDA_PERSISTENT_BLOCKS < n_blocks <= CUDA_PERSISTENT_MAX_WAVES * CUDA_PERSISTENT_BLOCKS):
        return dispatch.balanced_blocks(n_blocks, CUDA_PERSISTENT_BLOCKS)
    return 0


INPUT_NAMES = ("x", "w", "scales", "e8grid", "params", "res")
OUTPUT_NAMES = ("y",)


def decline_reason(x: mx.array, qt) -> Optional[str]:
    """Why the GPU kernel will not run this call, or None if it will."""
    return decline_reason_for(qt, x.shape[0], x.dtype)


def decline_reason_for(qt, S: int, dtype) -> Optional[str]:
    """:func:`decline_reason` from the row count and dtype, remembered per weight (hot path)."""
    cache = _per_weight(qt, "_qgemv_decline")
    key = (S, dtype)
    if key not in cache:
        cache[key] = _decline(qt, S, dtype)
    return cache[key]


def _decline(qt, S: int, dtype) -> Optional[str]:
    why = gguf_formats.decline_reason(qt)
    if why:
        return why
    if qt.fmt not in UNIT_WEIGHTS:
        return f"fmt {qt.fmt} has no qgemv kernel"
    if not 1 <= S <= MAX_ROWS:
        return f"S={S} outside 1..{MAX_ROWS}"
    if dtype not in KERNEL_DTYPES:
        return f"x dtype {dtype} not float32/float16/bfloat16"
    if qt.fmt == 4 and (not qt.gs or qt.gs % 16):
        return f"fmt 4 with gs={qt.gs} (needs a multiple of 16)"
    why = mlx_formats.decline_reason(qt)
    if why:
        return why
    if SIMD * MAX_SIMDGROUPS * qt.O >= 2**31 or S * max(qt.I, qt.O) >= 2**31:
        return f"shape {qt.O}x{qt.I} too large for 32-bit indexing"
    return None


def _per_weight(qt, name: str) -> dict:
    """A dict kept on the QTensor itself, so what is cached for a weight lives and dies with it
    (QTensor is a frozen dataclass: its __dict__ is written directly)."""
    cache = vars(qt).get(name)
    if cache is None:
        cache = vars(qt)[name] = {}
    return cache


def at_least_8(a: mx.array) -> mx.array:
    """Pad a tiny input to 8 elements so MLX gives it device (not constant) address space.
    Inputs of 8 or more elements go through untouched: no reshape node per call."""
    if a.size >= PARAMS_LEN:
        return a
    a = a.reshape(-1)
    return mx.concatenate([a, mx.zeros((PARAMS_LEN - a.size,), a.dtype)])


_grid_mx: dict = {}
_params_mx: dict = {}


def e8grid() -> mx.array:
    """The lookup tables as a kernel input (the fmt 6 grid words at word 0, then the GGUF IQ tables:
    gguf_decode.lookup_words), one device array for every kernel that decodes fmt 6 or GGUF."""
    g = _grid_mx.get("g")
    if g is None:
        g = _grid_mx["g"] = mx.array(gguf_decode.lookup_words())
    return g


def _as_mx(a, dtype) -> mx.array:
    """QTensor arrays may still be numpy (memory-mapped); ``QTensor.to_mlx()`` avoids the copy."""
    if not isinstance(a, mx.array):
        a = mx.array(np.ascontiguousarray(np.asarray(a)))
    return a if a.dtype == dtype else a.view(dtype) if a.dtype.size == dtype.size else a.astype(dtype)


def shape_values(qt) -> tuple:
    """O, I, row bytes, scales or super-blocks per row, units per row: the kernel's params
    (or, CUDA's persistent default, its template KO, KI, KRB, KNG, KNU)."""
    if mlx_formats.is_mlx(qt):
        return qt.O, qt.I, mlx_formats.row_bytes(qt), mlx_formats.scale_words_per_row(qt), qt.I // mlx_formats.UNIT
    if gguf_formats.is_gguf(qt):
        return qt.O, qt.I, gguf_formats.row_bytes(qt), 0, qt.I // UNIT_WEIGHTS[qt.fmt]
    per_row = scales_per_row(qt.fmt, qt.I, qt.gs) if qt.fmt in (4, 5) else (-(-qt.I // 256) if qt.fmt == 6 else 1)
    return qt.O, qt.I, row_bytes(qt.fmt, qt.I), per_row, -(-qt.I // UNIT_WEIGHTS[qt.fmt])


def params(qt) -> mx.array:
    """:func:`shape_values` as the kernel's params array; cached per shape."""
    key = (mlx_formats.kernel_fmt(qt), qt.O, qt.I, qt.gs if qt.fmt == 4 or mlx_formats.is_mlx(qt) else None)
    p = _params_mx.get(key)
    if p is None:
        p = _params_mx[key] = mx.array([*shape_values(qt), 0, 0, 0], dtype=mx.int32)
    return p


def default_rows(S: int) -> int:
    """Output rows per threadgroup, sharing each widened x value; fewer with many rows of x
    so ROWS * S accumulators (and ROWS * S <= 32 final writers) stay in bounds."""
    return 4 if S <= 4 else 2


def default_unroll(fmt: int, S: int) -> int:
    """Units each thread loads (for all ROWS rows) before computing. One for the wide units
    (fmt 5: 64 weights from 24 bytes, fmt 6: grid lookups) and for many rows of x, where more
    makes the CUDA twin spill registers (nvcc -Xptxas -v, sm_90a)."""
    if fmt in (5, 6) or S > 4:
        return 1
    return 2


def default_simdgroups(O: int, rows: int, n_units: int) -> int:
    """SIMD groups per threadgroup (split-K): more when ceil(O / rows) threadgroups of one SIMD
    group would leave the GPU underfilled, while every thread keeps >= 1 unit of a row."""
    nw = 1
    groups = -(-O // rows)
    while nw < MAX_SIMDGROUPS and groups * nw < TARGET_SIMDGROUPS and n_units >= SIMD * 2 * nw:
        nw *= 2
    return nw


@functools.lru_cache(maxsize=None)
def kernel_header(backend: str, gguf: bool = False) -> str:
    """The shared decoders (``gguf``: with the GGUF ones) and qgemv's helpers: one string object per
    backend, so launches pass the same object every time (dispatch finds its kernel by identity)."""
    return dispatch.decode_header(backend, gguf) + dispatch.read_kernel_source(NAME, backend)[0]


@dataclass(frozen=True)
class _Static:
    """Everything of a launch but x, for one (weight, S, x dtype, backend, tuning)."""

    weight_inputs: tuple        # packed, scales, e8grid, params
    output_dtypes: list
    grid: tuple
    threadgroup: tuple
    template: list
    template_res: list          # the same with RES 1
    source: str
    header: str


def _static(qt, S: int, dtype, backend: str, unroll, rows, simdgroups, nib, prefetch, out_dtype,
            persistent=None, shape_in=None) -> _Static:
    """Built on the first call and kept on the weight (:func:`_per_weight`)."""
    key = (S, dtype, backend, unroll, rows, simdgroups, nib, prefetch, out_dtype, persistent, shape_in)
    cache = _per_weight(qt, "_qgemv_static")
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = _build_static(qt, S, dtype, backend, unroll, rows, simdgroups, nib, prefetch, out_dtype,
                                         persistent, shape_in)
    return hit


def _build_static(qt, S, dtype, backend, unroll, rows, simdgroups, nib, prefetch, out_dtype, persistent,
                  shape_in) -> _Static:
    rows_asked = rows
    rows = rows or default_rows(S)
    if rows * S > SIMD:
        raise ValueError(f"qgemv: rows={rows} x S={S} exceeds {SIMD} final writers")
    kfmt = mlx_formats.kernel_fmt(qt)
    prefetch = default_prefetch(kfmt, S, backend) if prefetch is None else int(prefetch)
    unroll = unroll or (1 if prefetch else default_unroll(qt.fmt, S))
    shape = shape_values(qt)
    _, _, rb, _, n_units = shape
    simdgroups = simdgroups or default_simdgroups(qt.O, rows, n_units)
    n_blocks = -(-qt.O // rows)
    wide = False
    if persistent is None:
        persistent = default_persistent(kfmt, S, backend, simdgroups, prefetch, n_blocks)
        wide = bool(persistent) and rows_asked is None and n_units >= CUDA_PERSISTENT_ROWS_MIN_UNITS
        if wide:
            rows = CUDA_PERSISTENT_ROWS
            n_blocks = -(-qt.O // rows)
            persistent = dispatch.balanced_blocks(n_blocks, CUDA_PERSISTENT_ROWS_BLOCKS)
    shape_in = wide if shape_in is None else bool(shape_in)
    if shape_in and backend != dispatch.CUDA:
        raise ValueError(f"qgemv: the shape is compiled in on CUDA only, not {backend}")
    blocks, pers = dispatch.persistent_grid(n_blocks, persistent)
    if mlx_formats.is_mlx(qt):
        packed, scales = mlx_formats.kernel_weights(qt), mlx_formats.kernel_scales(qt)
    else:
        packed, scales = _as_mx(qt.packed, mx.uint8), _as_mx(qt.scales, mx.float32)
    vec = (2 if rb % 16 == 0 else 1 if rb % 8 == 0 else 0) if qt.fmt in (1, 2, 3, 4) else 0
    x_vec = int((qt.I * dtype.size) % 16 == 0)
    template = [("T", dtype), ("FMT", mlx_formats.kernel_fmt(qt)), ("S", int(S)),
                ("GS", int(qt.gs) if qt.fmt == 4 or mlx_formats.is_mlx(qt) else 16), ("VEC", vec), ("XV", x_vec),
                ("UNROLL", int(unroll)), ("ROWS", int(rows)), ("NW", int(simdgroups)),
                ("NIB", int(DEFAULT_NIB[backend] if nib is None else nib)),
                ("PF", prefetch), ("PERS", pers)]
    if backend == dispatch.CUDA:   # the shape compiled in (0: read from params)
        template += list(zip(("KO", "KI", "KRB", "KNG", "KNU"), shape if shape_in else (0,) * 5))
    template += [("OT", out_dtype), ("RES", 0)]
    weight_inputs = (at_least_8(packed), at_least_8(scales), e8grid(), params(qt))
    mx.eval(*weight_inputs)   # views and pads made once, not re-recorded in every step's graph
    return _Static(weight_inputs=weight_inputs, output_dtypes=[out_dtype],
                   grid=(SIMD * simdgroups * blocks, 1, 1), threadgroup=(SIMD * simdgroups, 1, 1),
                   template=template, template_res=template[:-1] + [("RES", 1)],
                   source=dispatch.read_kernel_source(NAME, backend)[1],
                   header=kernel_header(backend, gguf_formats.is_gguf(qt)))


def launch_spec(x: mx.array, qt, backend: str = dispatch.METAL,
                unroll: Optional[int] = None, rows: Optional[int] = None,
                simdgroups: Optional[int] = None, nib: Optional[int] = None,
                prefetch: Optional[int] = None, residual: Optional[mx.array] = None,
                out_dtype=None, persistent: Optional[int] = None,
                shape_in: Optional[bool] = None) -> dispatch.LaunchSpec:
    """The launch for ``x[S, I] @ W.T`` (S <= 8; or ``x [..., I]`` holding S rows, y then
    ``[..., O]``) in ``out_dtype`` (default x's; float32 for
    logits: no rounding to x's dtype and no cast launch), plus ``residual [S, O]`` (x's dtype,
    output in x's dtype) when given; identical arguments for MLX and the simulator.
    ``persistent``: threadgroups that loop over the row blocks (0: one a row block; None: the
    backend's default, :func:`default_persistent`). ``shape_in``: the shape compiled into the CUDA
    kernel (None: with the wide persistent default)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if residual is not None and out_dtype != x.dtype:
        raise ValueError(f"qgemv: a residual add writes x's dtype ({x.dtype}), not {out_dtype}")
    st = _static(qt, x.size // x.shape[-1], x.dtype, backend, unroll, rows, simdgroups, nib, prefetch, out_dtype,
                 persistent, shape_in)
    xs = at_least_8(x)
    # x [..., I] of any rank: the kernel reads S flat rows and y takes x's leading shape.
    out_shapes = [(*x.shape[:-1], qt.O)]
    return dispatch.LaunchSpec(
        name=NAME, input_names=INPUT_NAMES, output_names=OUTPUT_NAMES, source=st.source, header=st.header,
        inputs=[xs, *st.weight_inputs, xs if residual is None else at_least_8(residual)],
        output_shapes=out_shapes, output_dtypes=st.output_dtypes, grid=st.grid, threadgroup=st.threadgroup,
        template=st.template if residual is None else st.template_res)


def qgemv(x: mx.array, qt, backend: str, residual: Optional[mx.array] = None, out_dtype=None,
          **tuning) -> mx.array:
    """Run the ``backend`` kernel on ``x[S, I]`` (+ ``residual``, in ``out_dtype``); the caller
    checked :func:`decline_reason`."""
    return dispatch.launch(backend, launch_spec(x, qt, backend, residual=residual, out_dtype=out_dtype,
                                                **tuning))[0]

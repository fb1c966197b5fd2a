"""Small per-step int arrays written by the GPU on CUDA, not by the host.

MLX's CUDA allocator keeps an array made from host data (``mx.array(values)``) in managed
memory written by the CPU, and every array of at most 8 bytes (a step's token, a position) in
one managed small-size pool. In a decode step's CUPTI profile (scripts/bench/profile_step.py)
the first kernel to read such an array after the host wrote it takes ~100 us where the same
launch in the next layer takes ~10: mla_qb_qabs reading the step's attention params,
mla_rows_into reading a verify step's row positions, and MLX's embedding gather reading the
step's token (the pool page the host had just written the position into). Made by an MLX op
(arange, where, a copy), the array is written by the GPU: the params and positions into device
memory, the position into the pool without the host touching it, and a token copied out of the
pool before the gather reads it once per output value. Metal (unified memory) and the CPU keep
the host arrays: there the op would only add a launch.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from . import dispatch

# Device copies of an index array are made at least this many bytes: MLX's CUDA allocator puts
# arrays of 8 bytes or fewer in its managed small-size pool.
SMALL_POOL_BYTES = 8


def on_device(backend: str) -> bool:
    """Whether per-step arrays are made by GPU ops (CUDA) rather than from host data."""
    return backend == dispatch.CUDA


@functools.lru_cache(maxsize=256)
def host_int32s(*values: int) -> mx.array:
    """int32 ``values`` from host data, made once per distinct tuple: the layers of a step (same
    cache length) share one array."""
    return mx.array(values, dtype=mx.int32)


@functools.lru_cache(maxsize=64)
def _index_mask(n: int, index: int) -> mx.array:
    return mx.array(np.arange(n) == index)


def int32_range(start: int, n: int, backend: str) -> mx.array:
    """int32 ``[start, start + n)``: mx.arange on CUDA (written by the GPU), else from host data."""
    if on_device(backend):
        return mx.arange(start, start + n, dtype=mx.int32)
    return mx.array(np.arange(start, start + n, dtype=np.int32))


def int32_scalar(value: int, backend: str) -> mx.array:
    """A 0-d int32 (a decode row's position): a device arange on CUDA, so that the host writes
    nothing into MLX's small-size pool during a step (the other arrays there, the step's token
    among them, then stay where the GPU reads them); else from host data."""
    if on_device(backend):
        return mx.arange(value, value + 1, dtype=mx.int32).reshape(())
    return mx.array(value, dtype=mx.int32)


def int32s_varying(values: tuple, index: int, backend: str) -> mx.array:
    """int32 ``values`` whose entry ``index`` changes from step to step (a params array holding
    the cache length). CUDA: the other entries as one cached array (read from device memory once
    the GPU has migrated it) and the varying one from a device arange, joined by a where on the
    GPU. Elsewhere: the host array, cached per distinct tuple."""
    if not on_device(backend):
        return host_int32s(*values)
    n = len(values)
    base = host_int32s(*(v if i != index else 0 for i, v in enumerate(values)))
    varying = mx.arange(values[index] - index, values[index] - index + n, dtype=mx.int32)  # [index] = value
    return mx.where(_index_mask(n, index), varying, base)


def device_index(ids, backend: str):
    """``ids`` for a gather, in device memory on CUDA: an mx.array of at most 8 bytes (a decode
    step's token) is copied by the GPU into a wider buffer and viewed back at its shape, so the
    gather reads it from device memory instead of MLX's host-written small-size pool. Other
    inputs (and other backends) pass through."""
    if not on_device(backend) or not isinstance(ids, mx.array) or ids.nbytes > SMALL_POOL_BYTES or ids.size == 0:
        return ids
    flat = ids.reshape(-1)
    copies = SMALL_POOL_BYTES // flat.nbytes + 1
    wide = mx.contiguous(mx.broadcast_to(flat[None], (copies, flat.size))).reshape(-1)
    return wide[:flat.size].reshape(ids.shape)

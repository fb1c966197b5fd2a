"""Backend choice, kernel construction and call/fallback counters for every hot path.

Each hot path has three implementations: ``reference`` (pure
``mx`` ops, the oracle and the fallback), ``metal`` (``metal_kernels/<name>.metal`` through
``mx.fast.metal_kernel``) and ``cuda`` (``metal_kernels/cuda/<name>.cu`` through
``mx.fast.cuda_kernel``). This module decides which one runs and counts what ran.

A GPU kernel that declines a shape or format calls :func:`record_fallback` with the reason;
the stats line shows it. On the CPU backend the reference *is* the path, not a fallback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx

from .kernel_text import compact_source, launch_text

METAL = "metal"
CUDA = "cuda"
REFERENCE = "reference"

ENV_VAR = "COLIBRI_KERNELS"

# The kernel sources: inside the package in an installed wheel (setup.py copies them there),
# else metal_kernels/ at the repository root, beside the package (a source checkout).
_PACKAGE = Path(__file__).resolve().parents[1]
KERNEL_DIR = (_PACKAGE / "metal_kernels" if (_PACKAGE / "metal_kernels").is_dir()
              else _PACKAGE.parent / "metal_kernels")
BODY_MARKER = "// ==== kernel body ===="

_lock = threading.Lock()
_calls: Counter = Counter()
_fallbacks: Counter = Counter()
_force_reference = False


# ---------------------------------------------------------------------------------------
# Backend choice


def gpu_backend() -> Optional[str]:
    """``"metal"`` or ``"cuda"`` when MLX has that GPU backend, else None (CPU build)."""
    if mx.metal.is_available():
        return METAL
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return CUDA
    return None


# os.environ.get encodes the name and decodes the value on every call (~1.5 us); knobs are read
# several times per decode step, so read the mapping's encoded dict directly where it has one
# (posix). It is the dict os.environ's setters update, so changes are seen at once.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEYS: dict = {}


def getenv(name: str, default: Optional[str] = None) -> Optional[str]:
    """``os.environ.get(name, default)`` at the cost of a dict lookup."""
    if _ENV_DATA is None:
        return os.environ.get(name, default)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)
    value = _ENV_DATA.get(key)
    return default if value is None else os.environ.decodevalue(value)


def reference_forced() -> bool:
    return _force_reference or (getenv(ENV_VAR) or "").strip().lower() == REFERENCE


def backend() -> str:
    """The implementation hot paths use now: metal, cuda or reference."""
    if reference_forced():
        return REFERENCE
    return gpu_backend() or REFERENCE


class _ForceReference(contextlib.AbstractContextManager):
    """``force_reference(True)`` sets the flag; ``with force_reference():`` sets it for a block."""

    def __init__(self, on: bool):
        global _force_reference
        self._previous = _force_reference
        _force_reference = bool(on)

    def __exit__(self, *exc):
        global _force_reference
        _force_reference = self._previous
        return False


def force_reference(on: bool = True) -> _ForceReference:
    return _ForceReference(on)


# ---------------------------------------------------------------------------------------
# Counters


def record_call(path: str, impl: str, n: int = 1) -> None:
    with _lock:
        _calls[(path, impl)] += n


def record_fallback(path: str, reason: str, instead: str = REFERENCE) -> None:
    """A GPU kernel declined: count it and the call that replaces it (the reference, or
    ``instead``: another kernel)."""
    with _lock:
        _fallbacks[f"{path}: {reason} -> {instead}"] += 1
        _calls[(path, instead)] += 1


def snapshot() -> tuple[Counter, Counter]:
    """The counters now (for :func:`since`)."""
    with _lock:
        return Counter(_calls), Counter(_fallbacks)


def since(before: tuple[Counter, Counter]) -> tuple[tuple, tuple]:
    """What was counted after ``before`` (a :func:`snapshot`), as ``(key, n)`` pairs."""
    with _lock:
        return tuple((_calls - before[0]).items()), tuple((_fallbacks - before[1]).items())


def replay(delta: tuple[tuple, tuple]) -> None:
    """Count ``delta`` (from :func:`since`) again: a compiled graph replaying what it recorded."""
    calls, fallbacks = delta
    with _lock:
        for key, n in calls:
            _calls[key] += n
        for key, n in fallbacks:
            _fallbacks[key] += n


def counters() -> dict[str, Any]:
    """``{"backend": ..., "calls": {"qgemv/cuda": n, ...}, "fallbacks": {reason: n}}``."""
    with _lock:
        return {
            "backend": backend(),
            "calls": {f"{p}/{i}": n for (p, i), n in sorted(_calls.items())},
            "fallbacks": dict(sorted(_fallbacks.items())),
        }


def reset_counters() -> None:
    with _lock:
        _calls.clear()
        _fallbacks.clear()


def format_counters() -> str:
    """One line for the ``colibri generate`` stats: calls per path/impl and fallbacks."""
    c = counters()
    calls = ", ".join(f"{k} {n}" for k, n in c["calls"].items()) or "none"
    nfb = sum(c["fallbacks"].values())
    line = f"kernels[{c['backend']}]: {calls}; fallback {nfb}"
    if nfb:
        line += " (" + "; ".join(f"{r} x{n}" for r, n in c["fallbacks"].items()) + ")"
    return line


# ---------------------------------------------------------------------------------------
# Kernel sources and objects


@functools.lru_cache(maxsize=None)
def read_kernel_source(name: str, backend_name: str) -> tuple[str, str]:
    """``(header, body)`` of ``metal_kernels/<name>.metal`` or ``metal_kernels/cuda/<name>.cu``.

    MLX writes the kernel signature itself and takes only the body; helpers must go in the
    header. One file holds both, split at ``BODY_MARKER``.
    """
    path = KERNEL_DIR / (f"{name}.metal" if backend_name == METAL else f"cuda/{name}.cu")
    text = path.read_text()
    if BODY_MARKER not in text:
        raise RuntimeError(f"{path}: missing the line {BODY_MARKER!r} that separates header and body")
    header, body = text.split(BODY_MARKER, 1)
    return compact_source(header), compact_source(body)


DECODE_HEADER = {METAL: "qdecode.h", CUDA: "cuda/qdecode.cuh"}
# llama.cpp's GGUF block decoders, in front of DECODE_HEADER (whose functions call them); the
# launches of the other formats get their unit sizes and GGUF_STUB_HEADER's stubs instead.
GGUF_DECODE_HEADER = {METAL: "gguf_decode.h", CUDA: "cuda/gguf_decode.cuh"}
GGUF_STUB_HEADER = {METAL: "gguf_stub.h", CUDA: "cuda/gguf_stub.cuh"}
GGUF_DECODERS_MARKER = "// ==== GGUF decoders ====\n"


@functools.lru_cache(maxsize=None)
def decode_header(backend_name: str, gguf: bool = False) -> str:
    """The shared unit loads and decoders (``metal_kernels/gguf_decode.h`` + ``qdecode.h``, or their
    ``metal_kernels/cuda/`` twins); every kernel reading quantized weights prepends it. ``gguf``
    False (no GGUF weight in the launch): gguf_decode's decoders are replaced by their stubs, so
    the text MLX builds and hashes on every call stays what the other formats need."""
    gg = (KERNEL_DIR / GGUF_DECODE_HEADER[backend_name]).read_text()
    if not gguf:
        head, _ = gg.split(GGUF_DECODERS_MARKER, 1)
        gg = head + (KERNEL_DIR / GGUF_STUB_HEADER[backend_name]).read_text()
    return compact_source(gg + (KERNEL_DIR / DECODE_HEADER[backend_name]).read_text())


@functools.lru_cache(maxsize=None)
def int_params(*values: int) -> mx.array:
    """An int32[8] input (device address space) for values that repeat from call to call,
    built once per distinct tuple: a per-call array is a host-to-device copy per launch."""
    return mx.array(list(values) + [0] * (8 - len(values)), dtype=mx.int32)


def reshaped(a: mx.array, *shape: int) -> mx.array:
    """``a`` in ``shape``, with no graph node when it already has it (MLX records even a no-op
    reshape as a primitive, which a compiled step recreates on every call)."""
    return a if a.shape == shape else a.reshape(shape)


@functools.lru_cache(maxsize=None)
def float_params(*values: float) -> mx.array:
    """The float32[8] counterpart of :func:`int_params`."""
    return mx.array(list(values) + [0.0] * (8 - len(values)), dtype=mx.float32)


@dataclass
class LaunchSpec:
    """Everything one custom-kernel launch needs, identical for MLX and the MSL simulator."""

    name: str
    input_names: Sequence[str]
    output_names: Sequence[str]
    source: str
    header: str
    inputs: list
    output_shapes: list
    output_dtypes: list
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    template: list = field(default_factory=list)
    init_value: Optional[float] = None
    # Inputs the kernel also writes, in place (mla_rows_into's cache): MLX does not know, so
    # the caller orders every reader after the launch through its outputs; the MSL simulator
    # copies them back.
    written_inputs: Sequence[str] = ()
    # Dynamic shared memory in bytes (CUDA's extern __shared__, fixed when the kernel object is
    # made; MLX raises the kernel's limit above 48 KB itself). Metal kernels declare theirs.
    shared_memory: int = 0


# Streaming multiprocessors of the GPU the CUDA launch defaults were measured on (H100 / H200).
# Persistent grids are sized from it; on a GPU of another size they still cover every row block.
CUDA_SMS = 132


def balanced_blocks(n_blocks: int, capacity: int) -> int:
    """Threadgroups of a persistent grid over ``n_blocks`` row blocks when at most ``capacity``
    are resident: as many rounds as ``capacity`` needs, every threadgroup the same number of row
    blocks (H200: 4608 row blocks over 2112 resident one-warp blocks leave 384 running a third
    round alone; 1536 blocks run three rounds each)."""
    rounds = -(-n_blocks // max(1, capacity))
    return -(-n_blocks // rounds)


def persistent_grid(n_blocks: int, persistent: Optional[int]) -> tuple[int, int]:
    """``(threadgroups, PERS)`` of a launch over ``n_blocks`` row blocks: ``persistent``
    threadgroups looping over them (template PERS 1) when that is fewer, else one a row block."""
    blocks = min(int(persistent), n_blocks) if persistent else n_blocks
    return blocks, int(blocks < n_blocks)


@functools.lru_cache(maxsize=None)
def bounded_header(header: str, threads: int, min_blocks: int) -> str:
    """``header`` with CUDA launch bounds for the program's kernel (see :func:`with_min_blocks`).
    Cached: one string object per header and bound (kernel objects are found by identity)."""
    # MLX writes the kernel's signature itself, so launch bounds come through the one
    # __global__ of the program (each custom kernel is its own NVRTC program): ptxas then keeps
    # the registers under what min_blocks blocks of `threads` an SM need.
    return ("#undef __global__\n"
            f"#define __global__ __location__(global) __launch_bounds__({threads}, {min_blocks})\n" + header)


def with_min_blocks(spec: LaunchSpec, min_blocks: Optional[int]) -> LaunchSpec:
    """A CUDA launch whose kernel is compiled for ``min_blocks`` resident blocks an SM
    (``__launch_bounds__``); the template gains MINB, so MLX names (and caches) it apart from
    the unbounded kernel. 0 / None: the spec itself."""
    if not min_blocks:
        return spec
    threads = spec.threadgroup[0] * spec.threadgroup[1] * spec.threadgroup[2]
    return dataclasses.replace(spec, header=bounded_header(spec.header, threads, int(min_blocks)),
                               template=list(spec.template) + [("MINB", int(min_blocks))])


_kernels: dict = {}
_kernels_by_id: dict = {}


EMPTY_KERNELS_VAR = "COLIBRI_EMPTY_KERNELS"
EMPTY_BODY_LINE = "return;  // COLIBRI_EMPTY_KERNELS=1\n"


@functools.lru_cache(maxsize=None)
def empty_kernels() -> bool:
    """COLIBRI_EMPTY_KERNELS=1, read once a process: every kernel returns at its first line.

    For measuring host cost only (`bash scripts/device/steps.sh host_floor`): the launches,
    their text (hashed by MLX on every evaluation), arguments and graph stay as they are, so a
    timed call costs everything but the GPU's work. Outputs are garbage, hence the warning."""
    on = getenv(EMPTY_KERNELS_VAR, "0") == "1"
    if on:
        import warnings

        warnings.warn(f"{EMPTY_KERNELS_VAR}=1: every GPU kernel returns at once and its outputs "
                      "are garbage (host-cost measurement only)", RuntimeWarning, stacklevel=2)
    return on


def _kernel_object(backend_name: str, spec: LaunchSpec):
    """The MLX kernel object for a spec, made once per distinct source.

    Hot paths pass the same (cached) source and header string objects on every call: those are
    found by object identity, without hashing or comparing ~10 KB of text per launch. Any other
    string finds its kernel by content."""
    fast_key = (backend_name, spec.name, id(spec.source), id(spec.header), spec.input_names, spec.output_names,
                spec.shared_memory)
    hit = _kernels_by_id.get(fast_key)
    if hit is not None and hit[1] is spec.source and hit[2] is spec.header:
        return hit[0]
    key = (backend_name, spec.name, spec.source, spec.header,
           tuple(spec.input_names), tuple(spec.output_names), spec.shared_memory)
    k = _kernels.get(key)
    if k is None:
        make = mx.fast.metal_kernel if backend_name == METAL else mx.fast.cuda_kernel
        header, source = launch_text(spec.header, spec.source, spec.name)
        if empty_kernels():
            source = EMPTY_BODY_LINE + source
        # Created lazily: cuda_kernel raises at creation on builds without CUDA.
        extra = {"shared_memory": spec.shared_memory} if spec.shared_memory and backend_name != METAL else {}
        k = make(name=spec.name, input_names=list(spec.input_names),
                 output_names=list(spec.output_names), source=source, header=header, **extra)
        _kernels[key] = k
    # Holding the strings keeps their ids from being reused by other text.
    _kernels_by_id[fast_key] = (k, spec.source, spec.header)
    return k


def launch(backend_name: str, spec: LaunchSpec) -> list:
    kernel = _kernel_object(backend_name, spec)
    kwargs = dict(inputs=spec.inputs, output_shapes=spec.output_shapes,
                  output_dtypes=spec.output_dtypes, grid=spec.grid,
                  threadgroup=spec.threadgroup, template=spec.template)
    if spec.init_value is not None:
        kwargs["init_value"] = spec.init_value
    return kernel(**kwargs)

"""Decode blocks whose graph does not change from step to step, run as ``mx.compile`` graphs.

Decode on a GPU is host-bound (docs/performance.md): per token the host builds every op of the
step in Python (dispatch, launch specs, ~10 KB kernel sources handed to MLX per custom-kernel
call) before the GPU gets any work. A decoder layer over the cache's fixed-capacity buffers
(the slot and attended length as inputs), and the blocks whose shapes never depend on the cache
length — attention's projections and RoPE, the dense MLP, the whole MoE block (router +
experts), the head — are the same graph from step to step, so :class:`CompiledBlock` traces
each once per shape and then replays it: MLX recreates the recorded ops in C++ and none of our
Python runs.

What a trace fixes, and how it stays right:

* Shapes and dtypes: each distinct set of input shapes/dtypes gets its own trace (mx.compile).
* The dispatch mode: traces are kept per backend: forcing the reference is a different graph.
  :func:`clear` drops every trace (after changing what the launches read, e.g. a function the
  traces call).
* Counters (:mod:`.dispatch`): the calls and fallbacks a trace recorded are added again on every
  replay, so the stats line counts what ran.
* Host work: a block may only be compiled when its graph needs no values from the GPU (no
  ``np.array(ids)``); the caller says so per call (``static=``), and a block that cannot be
  compiled runs plainly and is counted (``compiled/<name>/declined: <reason>``).
* First use: the first call in a mode runs plainly (it builds and evaluates the kernels' cached
  weights, views and statics, which must not happen inside a trace); the trace is made on the
  second.

``COLIBRI_COMPILE``: ``auto`` (default: compile on GPU backends), ``1`` (also on the CPU
reference path, for tests) or ``0`` (never).
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import mlx.core as mx

from . import dispatch

ENV_VAR = "COLIBRI_COMPILE"
MODES = ("auto", "0", "1")

_blocks: "weakref.WeakSet[CompiledBlock]" = weakref.WeakSet()


def policy() -> str:
    mode = (dispatch.getenv(ENV_VAR) or "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={mode!r}: expected one of {MODES}")
    return mode


def enabled(backend: str) -> bool:
    mode = policy()
    return mode == "1" or (mode == "auto" and backend in (dispatch.METAL, dispatch.CUDA))


def _reference_on_gpu(backend: str) -> Optional[str]:
    # COLIBRI_COMPILE=1 with the reference forced on a GPU device: replays of such traces were
    # seen to differ from the plain graphs on the H200 (tests/test_compiled.py::
    # test_trace_not_kept_across_dispatch_modes failed 2 of 4 runs, from the first replayed step;
    # cause not found), so that debugging mode runs plainly, counted.
    if backend == dispatch.REFERENCE and dispatch.gpu_backend() is not None:
        return "reference path on a GPU device"
    return None


def clear() -> None:
    """Drop every block's traces (the next call in each mode runs plainly, then retraces)."""
    for block in list(_blocks):
        block.clear()


def _signature(args) -> tuple:
    """What mx.compile tells traces apart by: the inputs' shapes and dtypes."""
    return (*[a.shape for a in args], *[a.dtype for a in args])


class CompiledBlock:
    """``fn(*arrays)`` (arrays in, an array or a tuple of arrays out) compiled per dispatch mode.

    ``block(*args, static=None)`` runs the compiled graph when compiling is enabled and
    ``static`` is None; a string ``static`` is the reason the graph depends on values and the
    call runs plainly (counted).

    A replay must count what its trace counted. The trace runs our Python, so it records its
    counters itself (:meth:`_trace`); a replay adds them again. Which trace MLX replays depends
    on the inputs' shapes and dtypes, but reading them (two nanobind properties an input) was
    most of the 50 µs this wrapper added to a 24-input call on the H200's host, against 39 µs
    for MLX's whole compiled call (cProfile of a compiled chain), so they are read only while a mode's
    traces counted different things. Not thread-safe (a call's trace is
    reported through the block): callers serialize decoding, as `colibri serve` does."""

    def __init__(self, fn: Callable, name: str):
        self.fn = fn
        self.name = name
        self._modes: dict = {}      # mode -> mx.compile'd fn, or None while warming up
        self._deltas: dict = {}     # (mode, signature) -> counters a trace recorded
        self._counted: dict = {}    # mode -> the counters of all its traces when they agree, else None
        self._traced = None         # (signature, counters) of the trace the current call made
        _blocks.add(self)

    def clear(self) -> None:
        self._modes.clear()
        self._deltas.clear()
        self._counted.clear()

    def _trace(self, *args):
        """``fn`` as mx.compile traces it: runs only when MLX (re)traces."""
        before = dispatch.snapshot()
        out = self.fn(*args)
        self._traced = (_signature(args), dispatch.since(before))
        return out

    def __call__(self, *args, static: Optional[str] = None):
        backend = dispatch.backend()
        if not enabled(backend):
            return self.fn(*args)
        static = static or _reference_on_gpu(backend)
        if static is not None:
            dispatch.record_call(f"compiled/{self.name}", f"declined: {static}")
            return self.fn(*args)
        mode = backend
        if mode not in self._modes:
            self._modes[mode] = None
            return self.fn(*args)                      # warm-up: caches filled outside a trace
        compiled = self._modes[mode]
        if compiled is None:
            compiled = self._modes[mode] = mx.compile(self._trace)
        self._traced = None
        out = compiled(*args)
        if self._traced is not None:                   # this call traced: it counted itself
            signature, delta = self._traced
            self._traced = None
            self._deltas[(mode, signature)] = delta
            known = self._counted.get(mode, delta)
            self._counted[mode] = delta if known == delta else None
            return out
        delta = self._counted[mode]
        if delta is None:
            delta = self._deltas[(mode, _signature(args))]
        dispatch.replay(delta)
        return out


def kept_block(owner, attr: str, fn: Callable, name: str) -> "CompiledBlock":
    """The CompiledBlock of ``fn`` kept on ``owner`` (a weight) as ``attr``, made on first use.
    ``owner.__dict__`` is written directly: QTensor is a frozen dataclass."""
    block = vars(owner).get(attr)
    if block is None:
        block = vars(owner)[attr] = CompiledBlock(fn, name)
    return block

"""moe_block: a layer's routed experts, ``sum_k w[n, k] * down_e(silu(gate_e x_n) * up_e x_n)``.

Decode (N <= 8 tokens) runs two kernels per group of experts that share a format
(metal_kernels/moe_block.metal): ``moe_gate_up`` (gate and up rows read in one pass, SwiGLU
applied, one row of h per slot) and ``moe_down`` (each distinct expert's down rows read once
and applied to every token that chose it, weighted and summed in registers). fmt 6 groups
rotate the layer input once and their SwiGLU outputs once (``hadamard``).

The experts of a group are stacked in one byte buffer and one scale buffer (an
:class:`ExpertBank`, built once per resident layer, or per call from the selected experts of
a streamed layer), and ``lut[e]`` maps a layer expert id to its place in the group, so the
routing ids never leave the GPU on the resident path. Prefill (8 < N <= GATHER_MAX_TOKENS) of
a resident layer of MLX's formats or fmt 4 runs ``mx.gather_qmm`` over the stacked bytes
(fmt 4 read as MLX affine: :func:`moe_gather_qmm`); any other (longer, a streamed layer's,
other formats) groups tokens by expert and reads each selected expert once through ``qmatmul``.

``launch specs`` (``gate_up_spec``, ``down_spec``, ``hadamard_spec``) are the exact launches
MLX gets; the MSL simulator tests run the same objects.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..formats.gguf_quant import GGUF_FMTS, is_gguf_fmt, row_nbytes
from ..formats.qtensor import QTensor
from . import dispatch, gguf_formats, mlx_formats, mlx_qmm, qgemv, reference
from .qgemv import at_least_8, e8grid
from .reference import row_bytes, scales_per_row

MAX_TOKENS = 8          # tokens a decode launch takes (more: prefill, gather_qmm or by expert)
# Prefill of more tokens than this groups them by expert instead of mx.gather_qmm (moe_gather_qmm).
# H200, the 4-layer bench model (docs/performance.md, "Prefill"): the forward on
# mx.quantized_matmul + gather_qmm took 75 ms at 128 tokens and 268 at 512, dequantized and
# grouped by expert 157 and 150; linear between, they cross near 280 tokens.
GATHER_MAX_TOKENS = 256
MAX_SLOTS = 96          # N * K: 8 tokens x (8 routed + 1 shared) fit; threadgroup tables are sized by it
SIMD = 32
MAX_SIMDGROUPS = qgemv.MAX_SIMDGROUPS
TARGET_SIMDGROUPS = qgemv.TARGET_SIMDGROUPS
# qdecode.h's FMT 60: a float weight held in bfloat16, read as stored (mla_decode's kv_b), 16 a unit
BF16_ROWS_FMT = 60
UNIT_WEIGHTS = {0: 8, BF16_ROWS_FMT: 16, **qgemv.UNIT_WEIGHTS}   # qdecode.h units; fmt 0: 8 float32 weights
HADAMARD_TG = 256
HADAMARD_MAX_BLOCK = 4096  # 16 KB of threadgroup memory (Metal allows 32 KB)
KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
PARAMS_LEN = 8
E8_FMT = 6
MAX_BANK_BYTES = 2**31 - 1

_SECTION = re.compile(r"^// ==== kernel body(?:: (\w+))? ====\s*$", re.M)


@functools.lru_cache(maxsize=None)
def read_kernel_sections(name: str, backend_name: str) -> tuple[str, dict]:
    """``(header, {kernel: body})`` of a kernel file holding one or more named bodies."""
    path = dispatch.KERNEL_DIR / (f"{name}.metal" if backend_name == dispatch.METAL else f"cuda/{name}.cu")
    text = path.read_text()
    marks = list(_SECTION.finditer(text))
    if not marks:
        raise RuntimeError(f"{path}: no '// ==== kernel body ====' line")
    bodies = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        bodies[m.group(1) or name] = text[m.end():end]
    return text[:marks[0].start()], bodies


@functools.lru_cache(maxsize=None)
def kernel_header(name: str, backend_name: str, gguf: bool = False) -> str:
    """A kernel file's header with the shared fmt 0-6 decoders (qdecode) in front. Cached: one
    string object per kernel, so the kernel-object lookup (dispatch._kernel_object) hashes and
    compares it by identity instead of re-hashing ~12 KB per call."""
    return dispatch.decode_header(backend_name, gguf) + read_kernel_sections(name, backend_name)[0]


def _as_input(a: mx.array, dtype) -> mx.array:
    return at_least_8(a if a.dtype == dtype else a.astype(dtype))


def _as_mx(a, dtype) -> mx.array:
    if not isinstance(a, mx.array):
        a = mx.array(np.ascontiguousarray(np.asarray(a)))
    if a.dtype == dtype:
        return a
    return a.view(dtype) if a.dtype.size == dtype.size and dtype == mx.uint8 else a.astype(dtype)


# ---------------------------------------------------------------------------------------
# Expert banks


def weight_format(w) -> tuple[int, Optional[int]]:
    """(fmt, gs) of one projection as the kernels see it; float arrays are fmt 0, the MLX
    formats their kernel FMT code (kernels/mlx_formats.py: bits and scale dtype in it) and group size."""
    if isinstance(w, QTensor):
        if mlx_formats.is_mlx(w):
            return mlx_formats.kernel_fmt(w), int(w.gs)
        return int(w.fmt), (int(w.gs) if w.fmt == 4 else None)
    return 0, None


def _shape(w) -> tuple[int, int]:
    return (w.O, w.I) if isinstance(w, QTensor) else tuple(w.shape)


def _bytes_and_scales(w) -> tuple[mx.array, mx.array]:
    if isinstance(w, QTensor) and mlx_formats.is_mlx(w):
        return mlx_formats.kernel_weights(w), mlx_formats.kernel_scales(w)
    if isinstance(w, QTensor):
        return _as_mx(w.packed, mx.uint8).reshape(-1), _as_mx(w.scales, mx.float32).reshape(-1)
    return w.astype(mx.float32).reshape(-1).view(mx.uint8), mx.zeros((1,), mx.float32)


@dataclass
class Projection:
    """One stacked projection kind of a group: bytes [E_g][rows][rb], scales [E_g][rows * ng]."""

    fmt: int
    gs: Optional[int]
    O: int
    I: int
    packed: mx.array
    scales: mx.array

    @property
    def mlx(self) -> bool:
        return mlx_formats.is_mlx_kernel_fmt(self.fmt)

    @property
    def rb(self) -> int:
        if self.mlx:
            return mlx_formats.kernel_row_bytes(self.fmt, self.I)
        if is_gguf_fmt(self.fmt):
            return row_nbytes(GGUF_FMTS[self.fmt], self.I)
        if self.fmt == BF16_ROWS_FMT:
            return 2 * self.I
        return row_bytes(self.fmt, self.I)

    @property
    def ng(self) -> int:
        """Scales (MLX formats: 32-bit scale words) per row as the kernel indexes them (0: none)."""
        if self.mlx:
            return mlx_formats.kernel_scale_words(self.fmt, self.I, self.gs)
        return scales_per_row(self.fmt, self.I, self.gs) if self.fmt in (1, 2, 3, 4, 5) else 0

    @property
    def vec(self) -> int:
        """qdecode's 16-byte unit loads: 2 rows a multiple of 16 bytes, 1 of 8, 0 byte loads."""
        if self.fmt not in (1, 2, 3, 4):
            return 0
        return 2 if self.rb % 16 == 0 else 1 if self.rb % 8 == 0 else 0

    @property
    def unit(self) -> int:
        return mlx_formats.UNIT if self.mlx else UNIT_WEIGHTS[self.fmt]

    @property
    def n_units(self) -> int:
        return -(-self.I // self.unit)


@dataclass
class ExpertGroup:
    """Experts of one layer that share gate/up (fmt, gs) and down (fmt, gs)."""

    experts: list                 # layer expert ids, in stacking order
    gate_up: Projection           # per expert: gate rows then up rows (2 * inter rows)
    down: Projection              # D rows
    lut: mx.array                 # int32 [>= E]: group index of each layer expert, or -1
    n_layer_experts: int          # E: ids outside 0..E-1 are treated as dropped
    # The parts of this group's launches that do not change between calls, per (kernel, S, K,
    # x dtype, backend, tuning): built on the first call of a resident layer, then reused.
    statics: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def rotated(self) -> bool:
        return self.gate_up.fmt == E8_FMT

    @property
    def gguf(self) -> bool:
        """A GGUF projection in the group: its launches carry the GGUF decoders."""
        return is_gguf_fmt(self.gate_up.fmt) or is_gguf_fmt(self.down.fmt)


@dataclass
class ExpertBank:
    n_experts: int
    groups: list = field(default_factory=list)
    declined: dict = field(default_factory=dict)   # expert id -> reason (reference path)

    @property
    def nbytes(self) -> int:
        return sum(g.gate_up.packed.nbytes + g.down.packed.nbytes for g in self.groups)


def _decline_expert(gate, up, down) -> Optional[str]:
    fg, fu = weight_format(gate), weight_format(up)
    if fg != fu:
        return f"gate fmt {fg} != up fmt {fu}"
    fmt, gs = fg
    for w in (gate, down):
        why = isinstance(w, QTensor) and (mlx_formats.decline_reason(w) or gguf_formats.decline_reason(w))
        if why:
            return why
    if fmt == 4 and (not gs or gs % 16):
        return f"fmt 4 gs={gs} (needs a multiple of 16)"
    if weight_format(down)[0] == 4 and (weight_format(down)[1] or 1) % 16:
        return f"down fmt 4 gs={weight_format(down)[1]}"
    if (fmt == E8_FMT) != (weight_format(down)[0] == E8_FMT):
        return "fmt 6 on some projections only (the converter writes all three or none)"
    if fmt == E8_FMT and max(_max_block(_shape(gate)[1]), _max_block(_shape(down)[1])) > HADAMARD_MAX_BLOCK:
        return f"rotation block above {HADAMARD_MAX_BLOCK}"
    return None


def _nbytes(w) -> int:
    return w.nbytes if isinstance(w, QTensor) else 4 * w.size


def _packed_nbytes(w) -> int:
    """Bytes of the weight stream alone (what the bank stacks; scales are a float32 buffer)."""
    return w.packed.nbytes if isinstance(w, QTensor) else 4 * w.size


def _stacked(parts: list) -> mx.array:
    """The parts' bytes in one buffer: uint8, or uint32 words when longer than MAX_BANK_BYTES
    (build_bank only groups parts that are whole words then)."""
    if sum(p.size for p in parts) <= MAX_BANK_BYTES:
        return mx.concatenate(parts)
    return mx.concatenate([p.view(mx.uint32) for p in parts])


def _max_block(n: int) -> int:
    from ..formats.e8 import block_tiling

    return max(block_tiling(n))


def build_bank(experts: Sequence, ids: Optional[Sequence[int]] = None) -> ExpertBank:
    """Stack ``experts[e] = (gate, up, down)`` for e in ``ids`` (default: all) by format."""
    E = len(experts)
    ids = range(E) if ids is None else ids
    bank = ExpertBank(E)
    members: dict = {}
    for e in ids:
        gate, up, down = experts[int(e)]
        reason = _decline_expert(gate, up, down)
        if reason is not None:
            bank.declined[int(e)] = reason
            continue
        key = (weight_format(gate), weight_format(down), _shape(gate), _shape(down))
        members.setdefault(key, []).append((int(e), gate, up, down))
    for key, group in list(members.items()):
        # MLX shapes are 32-bit: a stacked uint8 buffer holds at most MAX_BANK_BYTES. Past that
        # the bytes are stacked as uint32 words (the kernels read them through a byte pointer
        # all the same), so 4x as many fit one group: the 256 routed + 1 shared DeepSeek-V3
        # experts (3.8 GB of gate+up in fmt 4) are one group, two launches a layer. Larger
        # layers, or bytes that are not whole words, become several groups of one format.
        per_expert = max(_nbytes(w) for w in group[0][1:])
        words = all(_packed_nbytes(w) % 4 == 0 for _, *triple in group for w in triple)
        per_chunk = max(1, MAX_BANK_BYTES * (4 if words else 1) // (2 * per_expert))
        if len(group) > per_chunk:
            del members[key]
            for c in range(0, len(group), per_chunk):
                members[key + (c,)] = group[c:c + per_chunk]
    for ((fmt, gs), (fmt_d, gs_d), (O, I), (Od, Id), *_), group in members.items():
        gu_bytes, gu_scales, d_bytes, d_scales = [], [], [], []
        for _, gate, up, down in group:
            for w, b, s in ((gate, gu_bytes, gu_scales), (up, gu_bytes, gu_scales), (down, d_bytes, d_scales)):
                wb, ws = _bytes_and_scales(w)
                b.append(wb)
                s.append(ws)
        lut = np.full(E, -1, np.int32)
        lut[[e for e, *_ in group]] = np.arange(len(group), dtype=np.int32)
        bank.groups.append(ExpertGroup(
            experts=[e for e, *_ in group],
            gate_up=Projection(fmt, gs, O, I, _stacked(gu_bytes), at_least_8(mx.concatenate(gu_scales))),
            down=Projection(fmt_d, gs_d, Od, Id, _stacked(d_bytes), at_least_8(mx.concatenate(d_scales))),
            lut=at_least_8(mx.array(lut)), n_layer_experts=E))
    return bank


def shared_slot_reason(experts: Sequence, shared: tuple) -> Optional[str]:
    """None when the shared expert ``(gate, up, down)`` can run as routed expert ``E`` of a
    resident layer (an always-selected slot of weight 1: the same two launches as the routed
    experts, in the same stacked group), else why it stays a separate MLP."""
    if getattr(experts, "prepare", None) is not None:
        return "streamed layer (the shared expert stays resident, outside the per-call bank)"
    if not len(experts):
        return "no routed experts"
    routed = experts[0]
    if tuple(_shape(w) for w in shared) != tuple(_shape(w) for w in routed):
        return (f"shape {[_shape(w) for w in shared]} differs from the routed experts' "
                f"{[_shape(w) for w in routed]} (n_shared_experts > 1 widens its intermediate)")
    if tuple(weight_format(w) for w in shared) != tuple(weight_format(w) for w in routed):
        return (f"(fmt, gs) {[weight_format(w) for w in shared]} differs from the routed experts' "
                f"{[weight_format(w) for w in routed]}")
    return None


_banks: dict = {}


def resident_bank(experts: Sequence) -> ExpertBank:
    """The bank of a resident expert list, built on first use and kept with the list."""
    hit = _banks.get(id(experts))
    if hit is not None and hit[0] is experts:
        return hit[1]
    bank = build_bank(experts)
    mx.eval([g.gate_up.packed for g in bank.groups] + [g.down.packed for g in bank.groups])
    _banks[id(experts)] = (experts, bank)
    return bank


def clear_banks() -> None:
    _banks.clear()


# ---------------------------------------------------------------------------------------
# Launches


def _params(p: Projection, K: int, n_slots: int, E: int) -> mx.array:
    return mx.array([p.I, p.O, p.rb, p.ng, p.n_units, K, n_slots, E], dtype=mx.int32)


# moe_down's CUDA launch bounds for one token, by (fmt, warps a block): fmt 4 with 4 warps
# compiled for 7 blocks an SM (72 registers, 32 bytes spilled, instead of 90 and 5 blocks). H200,
# profile_kernels.py (8 experts of 2048 -> 7168, kernel alone): 39.0 us against 41.1 unbounded;
# 6 blocks (80 registers) took 43.3. Other formats are not measured: unbounded. Only the
# registers change, not the numbers.
CUDA_DOWN_MIN_BLOCKS = {(4, 4): 7}


def cuda_down_min_blocks(fmt: int, nw: int) -> int:
    """:data:`CUDA_DOWN_MIN_BLOCKS` for a kernel FMT code: the MLX formats qgemv.cuda_tuned takes
    share fmt 4's bound (and with it the persistent grid). Under it their moe_down compiles to
    64-72 registers without spills at DeepSeek-V3's 2048 -> 7168 (affine 3/4-bit, mxfp4;
    compile_cuda_twins.py --ptxas), against one block a row block unbounded before."""
    if mlx_formats.is_mlx_kernel_fmt(fmt) and qgemv.cuda_tuned(fmt):
        fmt = 4
    return CUDA_DOWN_MIN_BLOCKS.get((fmt, nw), 0)


def _simdgroups(row_blocks: int, units: int) -> int:
    """Split-K SIMD groups per threadgroup: qgemv's rule (fill ~4096 SIMD groups while every
    thread keeps >= 1 unit), with the distinct experts' row blocks as the threadgroups."""
    nw = 1
    while nw < MAX_SIMDGROUPS and row_blocks * nw < TARGET_SIMDGROUPS and units >= SIMD * 2 * nw:
        nw *= 2
    return nw


def _template(p: Projection, rows: int, nw: int, x_dtype, backend: str, prefetch: int = 0,
              unroll: Optional[int] = None) -> list:
    """The template values both kernels share (each launch computes one token: grid.y picks it)."""
    x_vec = int((p.I * x_dtype.size) % 16 == 0)
    unroll = unroll or (1 if prefetch else qgemv.default_unroll(max(p.fmt, 1), 1))
    return [("T", x_dtype), ("FMT", p.fmt), ("GS", int(p.gs) if p.fmt == 4 or p.mlx else 16),
            ("VEC", p.vec), ("XV", x_vec), ("UNROLL", unroll),
            ("ROWS", int(rows)), ("NW", int(nw)), ("NIB", qgemv.DEFAULT_NIB[backend])]


def h_unit(group: "ExpertGroup") -> int:
    """moe_gate_up's HP: h rows are written padded to whole down units, in qdecode's
    ``xp_index`` layout (moe_down's lanes read it coalesced), unless the down projection is fmt
    6, whose input is rotated in row order first (0: row order)."""
    return 0 if group.down.fmt == E8_FMT else group.down.unit


def h_width(group: "ExpertGroup") -> int:
    """Floats per slot row of h (moe_gate_up's output)."""
    hp = h_unit(group)
    return group.down.n_units * hp if hp else group.gate_up.O


def default_gate_up_persistent(fmt: int, n_slots: int, simdgroups: int, prefetch: int,
                               n_blocks: int, backend: str) -> int:
    """moe_gate_up's blocks a slot (0: one a row block). CUDA, fmt 2/4 (and the MLX formats
    qgemv.cuda_tuned takes; ``fmt`` the kernel FMT code), one-warp blocks with PF 1 (<= 128
    registers: qgemv's 16 an SM): the resident blocks shared by the ``n_slots`` slots of the
    grid, balanced. H200, kernel alone, one token, 8 experts of 7168 -> 2 x 2048 fmt 4: 256
    blocks a slot 51.2 us, 264 51.7, 512 52.1, 128 71.8, one a row block (1024) 52.6."""
    if backend == dispatch.CUDA and qgemv.cuda_tuned(fmt) and simdgroups == 1 and prefetch:
        return dispatch.balanced_blocks(n_blocks, qgemv.CUDA_PERSISTENT_BLOCKS // max(1, n_slots))
    return 0


# Gate/up row pairs per threadgroup: 2 * ROWS rows share each x load, the accumulators of
# qgemv's ROWS = 4.
GATE_UP_ROWS = 2


@dataclass(frozen=True)
class _Static:
    """A launch without its per-call inputs (dispatch.LaunchSpec's other fields)."""

    name: str
    input_names: tuple
    output_names: tuple
    source: str
    header: str
    output_shapes: list
    output_dtypes: list
    grid: tuple
    threadgroup: tuple
    template: list
    params: mx.array

    def spec(self, inputs: list, output_shapes: Optional[list] = None) -> dispatch.LaunchSpec:
        return dispatch.LaunchSpec(self.name, self.input_names, self.output_names, self.source, self.header,
                                   inputs, output_shapes or self.output_shapes, self.output_dtypes, self.grid,
                                   self.threadgroup, self.template)


# A kernel computes one token; S tokens run as S one-token launches in one grid (grid.y: every
# token's slots for moe_gate_up, the token for moe_down), each token's experts read for it
# alone. An expert two tokens share is read twice, yet the one-token launch's occupancy wins
# over threadgroups that loop over the tokens: H200, DeepSeek-V3 shapes
# (scripts/bench/bench_moe_parts.py), moe_gate_up 318.8 -> 216.6 us at 4 tokens and 926.2 -> 385.6
# at 8, moe_down 290.5 -> 149.0 and 699.5 -> 216.5 (docs/kernels.md).
def _gate_up_static(group: ExpertGroup, S: int, K: int, x_dtype, backend: str, rows, simdgroups,
                    prefetch=None, persistent=None) -> _Static:
    # PF 1 is qgemv's loop (next step's loads in flight during this step's decode, UNROLL 1).
    # On by default on CUDA: on the H200 (scripts/bench/profile_kernels.py, kernel time
    # alone, 8 experts of 7168x2048 fmt 4) PF 1 took 54.1 us against PF 0's 58.1. (A chain of 8
    # independent launches in one graph, which the GPU overlaps, had ranked PF 0 first.)
    pf = int(backend == dispatch.CUDA) if prefetch is None else int(prefetch)
    # PERS 1: each slot's blocks (grid.y = slot) loop over its row blocks on one slot table
    # (default: :func:`default_gate_up_persistent`).
    key = ("gate_up", S, K, x_dtype, backend, rows, simdgroups, pf, persistent)
    hit = group.statics.get(key)
    if hit is not None:
        return hit
    n_slots = S * K
    p = group.gate_up
    rows = rows or GATE_UP_ROWS
    busy = min(K, len(group.experts))                # distinct experts at most (a token's)
    n_blocks = -(-p.O // rows)
    nw = simdgroups or _simdgroups(n_blocks * busy, p.n_units)
    if persistent is None:
        persistent = default_gate_up_persistent(p.fmt, n_slots, nw, pf, n_blocks, backend)
    blocks, pers = dispatch.persistent_grid(n_blocks, persistent)
    header = kernel_header("moe_block", backend, group.gguf)
    _, bodies = read_kernel_sections("moe_block", backend)
    st = group.statics[key] = _Static(
        name="moe_gate_up", input_names=("x", "wgu", "sgu", "e8grid", "ids", "lut", "params"),
        output_names=("h",), source=bodies["moe_gate_up"], header=header,
        output_shapes=[(n_slots, h_width(group))], output_dtypes=[mx.float32],
        grid=(SIMD * nw * blocks, n_slots, 1), threadgroup=(SIMD * nw, 1, 1),
        template=_template(p, rows, nw, x_dtype, backend, pf)
        + [("PF", pf), ("HP", h_unit(group)), ("PERS", pers)],
        params=_params(p, K, K, group.n_layer_experts))
    return st


def _down_static(group: ExpertGroup, S: int, K: int, backend: str, rows, simdgroups, out_dtype,
                 res: int = 0, min_blocks=None, persistent=None, shape_in=None) -> _Static:
    # CUDA: the projection's shape compiled in (template KO, KRB, KNG, KNU; qgemv's large-shape
    # default does so): a work item's expert and unit without a runtime division, constant
    # row offsets. H200, kernel alone, 8 experts of 2048 -> 7168 fmt 4: 28.8 us against 31.1.
    shape_in = (True if shape_in is None else bool(shape_in)) and backend == dispatch.CUDA
    key = ("down", S, K, backend, rows, simdgroups, out_dtype, res, min_blocks, persistent, shape_in)
    hit = group.statics.get(key)
    if hit is not None:
        return hit
    p = group.down
    rows = rows or qgemv.default_rows(1)
    busy = min(K, len(group.experts))
    nw = simdgroups or _simdgroups(-(-p.O // rows), p.n_units * busy)
    # One unit per load batch on CUDA: fewer registers, more blocks resident
    # (H200, profile_kernels.py, 8 experts of 2048 -> 7168 fmt 4: 41.2 us against 46.9 with 2).
    unroll = 1 if backend == dispatch.CUDA else None
    if min_blocks is None:
        min_blocks = cuda_down_min_blocks(p.fmt, nw) if backend == dispatch.CUDA else 0
    # PERS 1: blocks loop over the row blocks, each building the slot table once, not once a row
    # block. CUDA's default where launch bounds say how many blocks an SM keeps: that many a
    # round, balanced (dispatch.balanced_blocks). H200, kernel alone, 8 experts of 2048 -> 7168
    # fmt 4: 896 blocks 35.3 us, 924 35.5, 448 42.8, one a row block (1792) 38.0.
    n_blocks = -(-p.O // rows)
    if persistent is None:       # per token: the resident blocks shared by the S tokens
        persistent = (dispatch.balanced_blocks(n_blocks, max(1, dispatch.CUDA_SMS * min_blocks // S))
                      if backend == dispatch.CUDA and min_blocks else 0)
    blocks, pers = dispatch.persistent_grid(n_blocks, persistent)
    header = kernel_header("moe_block", backend, group.gguf)
    _, bodies = read_kernel_sections("moe_block", backend)
    st = group.statics[key] = _Static(
        name="moe_down", input_names=("h", "wd", "sd", "e8grid", "ids", "lut", "weights", "params", "res"),
        output_names=("y",), source=bodies["moe_down"],
        header=dispatch.bounded_header(header, SIMD * nw, min_blocks) if min_blocks else header,
        output_shapes=[(S, p.O)], output_dtypes=[out_dtype],
        grid=(SIMD * nw * blocks, S, 1), threadgroup=(SIMD * nw, 1, 1),
        template=_template(p, rows, nw, mx.float32, backend, unroll=unroll)
        + [("OT", out_dtype), ("XP", int(h_unit(group) > 0)), ("RES", res), ("PERS", pers)]
        + (list(zip(("KO", "KRB", "KNG", "KNU"), (p.O, p.rb, p.ng, p.n_units) if shape_in else (0,) * 4))
           if backend == dispatch.CUDA else [])
        + ([("MINB", min_blocks)] if min_blocks else []),
        params=_params(p, K, K, group.n_layer_experts))
    return st


def gate_up_spec(x: mx.array, group: ExpertGroup, ids: mx.array, K: int,
                 backend: str = dispatch.METAL, rows: Optional[int] = None,
                 simdgroups: Optional[int] = None, prefetch: Optional[int] = None,
                 persistent: Optional[int] = None) -> dispatch.LaunchSpec:
    """``h[N * K, h_width]`` (float32) for the slots routed to this group (other slots get 0),
    in ``h_unit``'s layout. ``persistent``: threadgroups a slot that loop over its row blocks
    (0: one a row block; None: :func:`default_gate_up_persistent`). ``prefetch``: the PF 1 loop
    (None: on CUDA). N > 1 tokens run as N one-token launches in one grid."""
    S = x.shape[0]
    st = _gate_up_static(group, S, K, x.dtype, backend, rows, simdgroups, prefetch, persistent)
    p = group.gate_up
    return st.spec([at_least_8(x), p.packed, p.scales, e8grid(), _as_input(ids, mx.int32), group.lut, st.params])


def down_spec(h: mx.array, group: ExpertGroup, ids: mx.array, weights: mx.array, S: int, K: int,
              backend: str = dispatch.METAL, rows: Optional[int] = None,
              simdgroups: Optional[int] = None, out_dtype=mx.float32, residual: Optional[mx.array] = None,
              min_blocks: Optional[int] = None, persistent: Optional[int] = None,
              shape_in: Optional[bool] = None) -> dispatch.LaunchSpec:
    """``y[N, D]`` (``out_dtype``, float32 accumulation): this group's weighted down projections
    summed per token, added to ``residual`` (``[N, D]`` of ``out_dtype``) when given (RES 1; else
    h stands in for it, unread). ``min_blocks``: CUDA launch bounds (blocks an SM; None: the
    default, :func:`cuda_down_min_blocks`; 0: none). ``persistent``: threadgroups that loop over
    the row blocks (0: one a row block; None: on CUDA under launch bounds, the resident blocks
    shared by the tokens, balanced). ``shape_in``: CUDA, the projection's shape compiled in
    (None: yes). S > 1 tokens run as S one-token launches in one grid (grid.y = token)."""
    st = _down_static(group, S, K, backend, rows, simdgroups, out_dtype, int(residual is not None), min_blocks,
                      persistent, shape_in)
    p = group.down
    hs = at_least_8(h)
    # With a residual of another rank ([..., D] holding the S rows), y takes its shape: the
    # kernel reads and writes flat rows, so no reshape nodes around it.
    shapes = None if residual is None or residual.ndim == 2 else [residual.shape]
    return st.spec([hs, p.packed, p.scales, e8grid(), _as_input(ids, mx.int32), group.lut,
                    _as_input(weights, mx.float32), st.params, hs if residual is None else residual], shapes)


@functools.lru_cache(maxsize=None)
def _rotation_tables(n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(blocks int32 [3 * nb] padded, sign bytes uint8, largest block) for rows of length n."""
    from ..formats.e8 import block_tiling, sign_bits

    blocks, signs, off, soff = [], [], 0, 0
    for b in block_tiling(n):
        blocks += [off, b, soff]
        sb = np.packbits(sign_bits(b).astype(np.uint8), bitorder="little")
        signs.append(sb)
        off += b
        soff += sb.size
    blk = np.array(blocks + [0] * max(0, PARAMS_LEN - len(blocks)), np.int32)
    sg = np.concatenate(signs)
    sg = np.concatenate([sg, np.zeros(max(0, PARAMS_LEN - sg.size), np.uint8)])
    return blk, sg, max(block_tiling(n))


@functools.lru_cache(maxsize=None)
def _rotation_inputs(n: int) -> tuple:
    """(blocks, signs, params) as device arrays, built once per row length."""
    blocks, signs, _ = _rotation_tables(n)
    return (mx.array(blocks), mx.array(signs),
            mx.array([n, len(_tiling(n)), 0, 0, 0, 0, 0, 0], dtype=mx.int32))


def hadamard_spec(x: mx.array, backend: str = dispatch.METAL) -> dispatch.LaunchSpec:
    """fmt 6 rotation of the rows of ``x [N, n]`` (float32 out), docs/format.md#rotation."""
    N, n = x.shape
    blocks, signs, maxb = _rotation_tables(n)
    header, bodies = read_kernel_sections("hadamard", backend)
    n_blocks = len(_tiling(n))
    return dispatch.LaunchSpec(
        name="moe_hadamard", input_names=("x", "blocks", "signs", "params"), output_names=("y",),
        source=bodies["hadamard"], header=header,
        inputs=[at_least_8(x), *_rotation_inputs(n)],
        output_shapes=[(N, n)], output_dtypes=[mx.float32],
        grid=(HADAMARD_TG * n_blocks, N, 1), threadgroup=(HADAMARD_TG, 1, 1),
        template=[("T", x.dtype), ("TG", HADAMARD_TG), ("MAXB", max(maxb, 2))])


def _tiling(n: int) -> list:
    from ..formats.e8 import block_tiling

    return block_tiling(n)


def rotate(x: mx.array, impl: str) -> mx.array:
    """fmt 6 input rotation of ``x [N, n]`` on the GPU (float32 out)."""
    if _rotation_tables(x.shape[-1])[2] > HADAMARD_MAX_BLOCK:
        from ..formats.e8 import rotate as rotate_mlx

        dispatch.record_fallback("hadamard", f"rotation block above {HADAMARD_MAX_BLOCK}")
        return rotate_mlx(x)
    dispatch.record_call("hadamard", impl)
    return dispatch.launch(impl, hadamard_spec(x, impl))[0]


# ---------------------------------------------------------------------------------------
# The hot path


def decline_reason(x: mx.array, K: int) -> Optional[str]:
    N = x.shape[0]
    if N * K > MAX_SLOTS:
        return f"N*K={N * K} slots above {MAX_SLOTS}"
    if x.dtype not in KERNEL_DTYPES:
        return f"x dtype {x.dtype} not float32/float16/bfloat16"
    return None


def host_reason(x: mx.array, experts: Sequence, K: int) -> Optional[str]:
    """None when :func:`moe_block`'s graph for ``x [N, D]`` needs no values from the GPU (the
    ids stay there: resident kernels), else why it reads them on the host (then the block
    cannot be an ``mx.compile`` graph, kernels.compiled)."""
    if dispatch.backend() == dispatch.REFERENCE:
        return "reference path groups tokens by expert on the host"
    if x.shape[0] > MAX_TOKENS:
        return "prefill: more tokens than a decode launch takes"
    if getattr(experts, "prepare", None) is not None:
        return "experts streamed from disk"
    reason = decline_reason(x, K)
    if reason is not None:
        return reason
    if resident_bank(experts).declined:
        return "some experts run on the reference path"
    return None


def moe_block(x: mx.array, experts: Sequence, ids: mx.array, weights: mx.array,
              residual: Optional[mx.array] = None) -> mx.array:
    """``[N, D]``: ``sum_k weights[n, k] * down_e(silu(gate_e x_n) * up_e x_n)``, e = ids[n, k],
    added to ``residual`` (``[N, D]`` or any shape of N rows, which the result then takes; x's
    dtype) when given: in moe_down's write when a layer is one expert group, as a separate add
    otherwise (the same numbers).

    ``experts[e] = (gate, up, down)`` (float ``mx.array [O, I]`` or QTensor, any fmt, per
    expert); ids < 0 are slots dropped by router top-p. A streamed layer (``experts.prepare``)
    is told the ids first and its selected experts are stacked per call.
    """
    y, added = _moe_block(x, experts, ids, weights, residual)
    return y if residual is None or added else residual + dispatch.reshaped(y, *residual.shape)


def _moe_block(x, experts, ids, weights, residual) -> tuple[mx.array, bool]:
    """moe_block's sum and whether ``residual`` is already in it."""
    N, K = ids.shape
    impl = dispatch.backend()
    streamed = getattr(experts, "prepare", None) is not None
    if impl == dispatch.REFERENCE or N > MAX_TOKENS:
        if impl != dispatch.REFERENCE and not streamed and N <= GATHER_MAX_TOKENS:
            bank = resident_bank(experts)
            if gather_reason(bank, x.dtype) is None:
                dispatch.record_call("moe_block", "gather-qmm")
                return moe_gather_qmm(x, bank.groups[0], ids, weights), False
        dispatch.record_call("moe_block", dispatch.REFERENCE if impl == dispatch.REFERENCE else "grouped-prefill")
        return reference_moe_block(x, experts, ids, weights), False
    reason = decline_reason(x, K)
    if reason is not None:
        dispatch.record_fallback("moe_block", reason)
        return reference_moe_block(x, experts, ids, weights), False
    if streamed:
        ids_np = np.array(ids)
        experts.prepare(ids_np)
        bank = build_bank(experts, sorted(int(e) for e in np.unique(ids_np) if 0 <= e < len(experts)))
    else:
        bank = resident_bank(experts)
    dispatch.record_call("moe_block", impl)
    ids_in, w_in = _as_input(ids, mx.int32), _as_input(weights, mx.float32)   # once for every group
    # One group (a layer of one format, the usual case): moe_down writes x's dtype itself, and
    # adds the residual.
    one = len(bank.groups) == 1 and not bank.declined
    out_dtype = x.dtype if one else mx.float32
    y = None
    x_rot = None
    for g in bank.groups:
        xin = x
        if g.rotated:
            if x_rot is None:
                x_rot = rotate(x, impl)      # once per layer call for every fmt 6 group
            xin = x_rot
        h = dispatch.launch(impl, gate_up_spec(xin, g, ids_in, K, impl))[0]
        if g.down.fmt == E8_FMT:
            h = rotate(h, impl)
        part = dispatch.launch(impl, down_spec(h, g, ids_in, w_in, N, K, impl, out_dtype=out_dtype,
                                               residual=residual if one else None))[0]
        if one:
            return part, residual is not None
        y = part if y is None else y + part
    if bank.declined:
        y_ref = _declined_part(x, experts, ids, weights, bank)
        if y_ref is not None:
            y = y_ref if y is None else y + y_ref
    if y is None:
        y = mx.zeros(x.shape, mx.float32)
    return (y if y.dtype == x.dtype else y.astype(x.dtype)), False


def gather_reason(bank: ExpertBank, dtype) -> Optional[str]:
    """Why a long prefill of a resident layer cannot run as ``mx.gather_qmm`` over its bank's
    stacked bytes (moe_gather_qmm), or None."""
    if dtype not in (mx.float16, mx.bfloat16):
        return f"x dtype {dtype}"
    if bank.declined:
        return "some experts run on the reference path"
    if len(bank.groups) != 1:
        return f"{len(bank.groups)} expert groups"
    for p in (bank.groups[0].gate_up, bank.groups[0].down):
        why = mlx_qmm.stacked_reason(p.fmt, p.gs, p.I)
        if why is not None:
            return why
    return None


def moe_gather_qmm(x: mx.array, group: ExpertGroup, ids: mx.array, weights: mx.array) -> mx.array:
    """``[N, D]`` in x's dtype: a long prefill as mlx-lm's SwitchGLU computes it, over the
    group's stacked bytes (MLX's formats, or fmt 4 read as MLX affine: kernels/mlx_qmm.py).
    The N * K (token, slot) rows are sorted by expert, so each selected expert's weights are
    read once for all its rows: ``mx.gather_qmm`` of gate+up (one matrix of 2 * inter rows an expert), SwiGLU,
    ``mx.gather_qmm`` of down, then the rows unsorted and summed with the routing weights in
    float32. Dropped slots (ids < 0, from router top-p) weigh 0."""
    N, K = ids.shape
    E = len(group.experts)
    gu, dn = group.gate_up, group.down
    slot = group.lut[mx.clip(ids, 0, group.n_layer_experts - 1)]
    valid = (ids >= 0) & (ids < group.n_layer_experts) & (slot >= 0)
    slot = mx.where(valid, slot, 0).reshape(-1)
    w = mx.where(valid, weights.astype(mx.float32), 0.0)
    order = mx.argsort(slot)
    idx = slot[order]
    rows = x[order // K][:, None, :]                                   # [N*K, 1, D]
    wq, s, b, gs, bits, mode = mlx_qmm.stacked_arrays(gu.fmt, gu.gs, (E,), 2 * gu.O, gu.I, gu.packed, gu.scales,
                                                      x.dtype)
    h = mx.gather_qmm(rows, wq, s, b, rhs_indices=idx, transpose=True, group_size=gs, bits=bits, mode=mode,
                      sorted_indices=True)
    a = silu(h[..., :gu.O]) * h[..., gu.O:]
    wq, s, b, gs, bits, mode = mlx_qmm.stacked_arrays(dn.fmt, dn.gs, (E,), dn.O, dn.I, dn.packed, dn.scales, x.dtype)
    y = mx.gather_qmm(a, wq, s, b, rhs_indices=idx, transpose=True, group_size=gs, bits=bits, mode=mode,
                      sorted_indices=True)
    y = y[mx.argsort(order)].reshape(N, K, dn.O)
    return (y.astype(mx.float32) * w[..., None]).sum(axis=1).astype(x.dtype)


def _declined_part(x, experts, ids, weights, bank):
    ids_np = np.array(ids)
    hit = [e for e in np.unique(ids_np) if int(e) in bank.declined]
    for e in hit:
        dispatch.record_fallback("moe_block", f"expert {int(e)}: {bank.declined[int(e)]}")
    if not hit:
        return None
    keep = np.isin(ids_np, hit)
    return reference_moe_block(x, experts, mx.array(np.where(keep, ids_np, -1).astype(np.int32)),
                               weights, out_dtype=mx.float32)


# ---------------------------------------------------------------------------------------
# Reference (pure MLX)


def silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def _rotated_for(x: mx.array, w) -> mx.array:
    # fmt 6 stores W @ Q, so its input must be rotated by Q first (docs/format.md#rotation).
    if isinstance(w, QTensor) and w.fmt == E8_FMT:
        from ..formats.e8 import rotate as rotate_mlx

        return rotate_mlx(x)
    return x


def expert_mlp(x: mx.array, gate, up, down) -> mx.array:
    from . import qmatmul

    h = silu(qmatmul(_rotated_for(x, gate), gate)) * qmatmul(_rotated_for(x, up), up)
    return qmatmul(_rotated_for(h, down), down)


def reference_moe_block(x: mx.array, experts, ids: mx.array, weights: mx.array, out_dtype=None) -> mx.array:
    """Each selected expert once, with every token routed to it (transformers' loop)."""
    ids_np = np.array(ids)
    prepare = getattr(experts, "prepare", None)  # a streamed expert store starts its reads here
    if prepare is not None:
        prepare(ids_np)
    eval_each = getattr(experts, "eval_each", False)
    out = mx.zeros(x.shape, dtype=mx.float32)
    for e in np.unique(ids_np):
        if e < 0 or e >= len(experts):
            continue  # slot dropped by router top-p
        token_idx, slot = np.nonzero(ids_np == e)
        tok = mx.array(token_idx.astype(np.int32))
        y = expert_mlp(x[tok], *experts[int(e)])
        w = weights[tok, mx.array(slot.astype(np.int32))][:, None]
        out = out.at[tok].add(y.astype(mx.float32) * w.astype(mx.float32))
        if eval_each:
            mx.eval(out)
    return out.astype(out_dtype or x.dtype)

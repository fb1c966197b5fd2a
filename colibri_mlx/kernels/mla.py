"""mla_decode: folded (absorbed) MLA for a few query rows over the latent cache.

``out[b, h, l] = W_UV^h · softmax_t((q'·latent_t + q_rope·k_rope_t) · scale) latent_t`` with
``q' = W_UK^hᵀ q_nope``; ``kv_b`` (``[H*(nope+v), R]``, fmt 1-5 or MLX-format (fmt 7-10) QTensor, or float) is read
directly. Three launches (metal_kernels/mla_decode.metal): ``mla_qabs``, the attention
(split-K online softmax over cache tiles, any cache length) and ``mla_out`` (merge of the
tiles + W_UV). ``selected`` (DSA) restricts each query row to a list of cache positions.

The attention has three variants with the same partials (``variant=``):

* ``mma`` (``mla_attn_mma``, Metal's default): scores and the latent combine by matrix
  instructions (Metal simdgroup_matrix 8x8, CUDA mma.sync m16n8k8 TF32), the next chunk's loads
  in flight while the current one is multiplied, q' held in registers;
* ``wide`` (``mla_attn_wide``, CUDA's default over a 16-bit cache): mma's algorithm on chunks
  staged as the cache's own 16-bit values, the next chunk in flight while this one is
  multiplied: 32 positions double-buffered by cp.async on CUDA, 16 on Metal (one buffer in its
  32 KiB of threadgroup memory; opt-in there, not yet measured on an Apple GPU). Over a float32
  cache it is ``mma``, counted as a decline of ``mla_attn_wide`` when asked for;
* ``simt`` (``mla_attn``, scalar FMAs): CUDA's default for float32 queries (see
  :func:`choose_variant`), and where R or rope is not a multiple of 8 (counted as
  ``mla_attn/simt``).

:func:`launch_specs`' ``tile`` sets the positions per tile (raised where it would make more
than ``MAX_TILES`` tiles), its ``heads`` (16 / 32 / 64; CUDA 16 / 32) the heads per threadgroup
of ``mma`` and ``wide``.

The ``*_spec`` functions build the exact launches; the MSL simulator tests run them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from ..formats.gguf_quant import is_gguf_fmt
from ..formats.mlx_quant import describe
from ..formats.qtensor import QTensor
from . import device_inputs, dispatch, gguf_formats, mlx_formats
from .moe import BF16_ROWS_FMT, Projection, kernel_header, read_kernel_sections, weight_format
from .qgemv import DEFAULT_NIB, at_least_8, e8grid

MAX_QUERY_ROWS = 8        # query rows a sequence (a verify step of speculative decoding: 1 + 7 drafts)
SIMD = 32
NSG = 4                   # SIMD groups per threadgroup
TARGET_TILES = 64         # split-K: enough (tile, head block) SIMD groups to fill the GPU
MIN_TILE = 32
CACHE_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
MASKED = -1e30            # the reference's finite fill for masked scores
CAUSAL = 2                # params' has_mask for causal rows of one sequence (no mask input)
KV_B_FMTS = (0, 1, 2, 3, 4, 5)
CHUNK = 8                 # positions per softmax chunk (mla_chunk() in the kernel)
# mla_attn_wide's chunk (CK): on CUDA one ldmatrix x4 of staged rows, double-buffered by
# cp.async (75 KB of dynamic shared memory at 576 values a row); on Metal one buffer of 16 rows
# (19 KB of its 32 KiB of threadgroup memory).
WIDE_CHUNK = {dispatch.CUDA: 32, dispatch.METAL: 16}
VARIANTS = ("mma", "simt", "wide")
MATRIX_VARIANTS = ("mma", "wide")   # q' rows padded to whole head blocks, mma tiles
# Heads per threadgroup of mla_attn_mma (HT; SIMD groups HT / 4: one softmax thread per (head,
# position)). More heads: fewer re-reads and re-stagings of each chunk (once per head block) and
# more SIMD groups; bounded by threadgroup memory on Metal (32 KiB: HT 32 takes 27 KiB) and on
# CUDA by registers (ptxas, sm_90a: ~225-250 a thread with q' held in registers, so HT 16 = 2
# blocks of 4 warps an SM, HT 32 = 1 block of 8 warps; HT 64 would not launch). Measured on the
# H200 (scripts/bench/bench_mla_parts.py, bf16, 128 heads): HT 32 with 128-512-position tiles is the
# fastest at caches 4096 and 32768 (attention 98 / 408 us vs HT 16 117 / 542 us).
MMA_HEADS = {dispatch.METAL: 32, dispatch.CUDA: 32}
MMA_HEAD_CHOICES = (16, 32, 64)
# mla_attn_wide's heads a block: 16 (4 warps, 86 KB of shared memory) lets two blocks share an
# SM, whose barriers and softmax steps then overlap; H200, kernel alone at caches 4096 / 32768:
# HT 16 21.8 / 93.4 us, HT 32 24.6 / 106.8.
WIDE_HEADS = 16
# mla_attn_wide's k-parts a 16-head tile: the warps that split the scores' k values (and the
# combine's latent columns), 128 threads of ~212 registers, two blocks an SM. 8 k-parts (256
# threads compiled for two blocks an SM) were slower on the H200: kernel alone 24.1 / 112.6 us at
# caches 4096 / 32768 against 4's 22.0 / 93.7.
WIDE_KPARTS = 4
# mla_attn_mma on CUDA holds ~210-230 registers a thread (q' fragments and the accumulators):
# a block of more than 256 threads (HT 64: 512) is refused at launch (H200: "too many
# resources requested for launch", or nothing written inside a CUDA graph).
CUDA_MAX_THREADS_AT_FULL_REGS = 256
MMA_MIN_TILE = 128
# (head block, tile) threadgroups per query row to aim for. Each block pays a fixed start (q'
# fragments into registers) and end (a partial of R floats per head to write and merge), so
# long tiles win once the GPU has a block per SM or two: on the H200 256 blocks (tiles of 512
# at a 32768 cache with HT 32) beat 384 and 1024.
MMA_TARGET_BLOCKS = 256
# mla_out keeps one weight per tile in threadgroup memory (NTMAX floats): longer caches get
# longer tiles instead of more. A multiple of 32 * NSG (whole passes of the weight loop).
MAX_TILES = 512
# mla_qabs' column parts: threadgroups a head, each computing q' over an equal share of kv_b's
# units (latent columns) from every nope row; part 0 also writes q_rope. One threadgroup a head
# was 128 on DeepSeek-V3, 0.19 waves of the H200, two dependent load steps each (kernel alone
# 8.3 us for 4.7 MB); 4 parts make 512 threadgroups of one load step. Both twins.
QABS_PARTS = 4
# mla_out's SIMD groups a threadgroup (one threadgroup a head). Its context sum loads TU = 2 x
# warps tiles of partials a batch (CPT x TU = 32 loads in flight a thread at any width), so
# more warps take the merge in fewer dependent batches. H200, kernel alone at a 4096 cache:
# 4 warps 16.6 us, 8 15.1, 16 15.5.
OUT_WARPS = 8
# mla_qb_qabs (decode rows: the q_b projection folded into mla_qabs, one threadgroup a head and row):
# its (SIMD groups, q_b rows a SIMD group pass), every unit of a pass loaded before any math;
# DeepSeek-V3's 192 rows a head are three passes of 16 x 4 or of 8 x 8. H200, kernel alone:
# 16 x 4 16.0 us, 16 x 2 17.4, 8 x 4 17.6, 8 x 8 18.0, 4 x 8 21.4, against
# q_b's GEMV 12.4 + mla_qabs 6.8. Metal keeps 8 x 8: 16 SIMD groups' partial sums (32 KB)
# would fill its threadgroup memory. q_b in fmt 1-5 or an MLX format (fmt 6 rotates its input first, a float
# q_b has no units).
QB_SETTINGS = {dispatch.METAL: (8, 8), dispatch.CUDA: (16, 4)}
# With a GGUF q_b or kv_b (more words a unit) CUDA's 512 threads, bounded to 128 registers, spill
# (ptxas, sm_90a: Q4_K 368 bytes, Q6_K 84); 8 SIMD groups of 4 rows do not.
QB_SETTINGS_GGUF_CUDA = (8, 4)
QB_FMTS = (1, 2, 3, 4, 5)
# kv_b units in flight per lane in mla_qabs / mla_out's W_UV rows (RU rows x NU units a lane,
# all loaded before any decoding): they are latency-bound, the bytes per row are few.
UNITS_IN_FLIGHT = 8


def _ceil_div(a, b):
    return -(-a // b)


def kv_b_projection(kv_b) -> Projection:
    """kv_b (or q_b) as the kernels read it (bytes + scales), cached on first use."""
    key = id(kv_b)
    hit = _kvb.get(key)
    if hit is not None and hit[0] is kv_b:
        return hit[1]
    fmt, gs = weight_format(kv_b)
    if isinstance(kv_b, QTensor) and mlx_formats.is_mlx(kv_b):
        proj = Projection(fmt, gs, kv_b.O, kv_b.I, mlx_formats.kernel_weights(kv_b), mlx_formats.kernel_scales(kv_b))
    elif isinstance(kv_b, QTensor):
        O, I = kv_b.O, kv_b.I
        packed = kv_b.packed if isinstance(kv_b.packed, mx.array) else mx.array(np.ascontiguousarray(kv_b.packed))
        scales = kv_b.scales if isinstance(kv_b.scales, mx.array) else mx.array(np.ascontiguousarray(kv_b.scales, np.float32))
        proj = Projection(fmt, gs, O, I, packed.reshape(-1).view(mx.uint8) if packed.dtype != mx.uint8 else packed.reshape(-1),
                          at_least_8(scales.astype(mx.float32)))
    elif kv_b.dtype == mx.bfloat16 and kv_b.shape[1] % 2 == 0:
        # read as stored (FMT 60): half the bytes of float32 rows, the same values
        O, I = kv_b.shape
        proj = Projection(BF16_ROWS_FMT, None, O, I, kv_b.reshape(-1).view(mx.uint8), mx.zeros((8,), mx.float32))
    else:
        O, I = kv_b.shape
        proj = Projection(0, None, O, I, kv_b.astype(mx.float32).reshape(-1).view(mx.uint8), mx.zeros((8,), mx.float32))
    mx.eval(proj.packed, proj.scales)   # made once: no view / cast nodes in the graphs that use it
    _kvb[key] = (kv_b, proj)
    return proj


_kvb: dict = {}


@functools.lru_cache(maxsize=None)
def _no_mask() -> mx.array:
    """The mask input when there is none (never read): made once, not a fill launch per call
    (evaluated here: a lazy zeros would put its Full / Broadcast nodes into a traced graph)."""
    m = mx.zeros((8,), mx.uint8)
    mx.eval(m)
    return m


def decline_reason(q_nope, latent, kv_b) -> Optional[str]:
    return decline_reason_shapes(q_nope.shape[2], latent, kv_b)


def weight_decline_reason(name: str, w, fmts: tuple, fmts_text: str) -> Optional[str]:
    """Why a kernel that decodes ``w`` (``name``: kv_b or q_b) in place declines it, or None: an
    MLX or GGUF layout the decoders lack, a colibri fmt outside ``fmts``, an fmt 4 group size that
    is not a multiple of 16."""
    if isinstance(w, QTensor):
        why = mlx_formats.decline_reason(w)
        if why:
            return f"{name} {describe(w)}: {why}"
        why = gguf_formats.decline_reason(w)
        if why:
            return f"{name}: {why}"
    fmt, gs = weight_format(w)
    if fmt not in fmts and not mlx_formats.is_mlx(w) and not gguf_formats.is_gguf(w):
        return f"{name} fmt {fmt} ({fmts_text})"
    if fmt == 4 and (not gs or gs % 16):
        return f"{name} fmt 4 gs={gs} (needs a multiple of 16)"
    return None


def decline_reason_shapes(L: int, latent, kv_b) -> Optional[str]:
    """decline_reason for ``L`` query rows a sequence."""
    why = weight_decline_reason("kv_b", kv_b, KV_B_FMTS, "fmt 0-5, the MLX formats and the GGUF types only")
    if why:
        return why
    if L > MAX_QUERY_ROWS:
        return f"{L} query rows (absorbed path takes <= {MAX_QUERY_ROWS})"
    if latent.dtype not in CACHE_DTYPES:
        return f"cache dtype {latent.dtype}"
    return None


def heads_of(kv_b, nope: int, v: int) -> int:
    """Attention heads of a layer from its kv_b (``H * (nope + v)`` rows)."""
    return (kv_b.O if isinstance(kv_b, QTensor) else kv_b.shape[0]) // (nope + v)


def qb_decline_reason(q_latent: mx.array, q_b, H: int, nope: int) -> Optional[str]:
    """Why mla_qb_qabs does not take q_b's projection (the q_b GEMV and mla_qabs run instead)."""
    if not isinstance(q_b, QTensor):
        return "q_b is a float weight"
    why = weight_decline_reason("q_b", q_b, QB_FMTS,
                                "fmt 1-5, the MLX formats and the GGUF types: fmt 6 rotates its input first")
    if why:
        return why
    rows = q_latent.size // q_latent.shape[-1]
    if rows > MAX_QUERY_ROWS:
        return f"{rows} query rows (up to {MAX_QUERY_ROWS})"
    if q_latent.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        return f"q_latent dtype {q_latent.dtype}"
    if q_b.I != q_latent.shape[-1] or q_b.O % H or q_b.O // H <= nope:
        return f"q_b is {q_b.O}x{q_b.I} for {H} heads of {nope} nope columns and a q_latent of {q_latent.shape[-1]}"
    return None


def project_queries(q_latent: mx.array, q_b, H: int, nope: int, L: int = 1) -> tuple[mx.array, mx.array]:
    """``(q_nope [B, H, L, nope], q_rope [B, H, L, rope])`` of ``L`` query rows a sequence: q_b's
    GEMV, its rows in the model's order ``[H x nope | H x rope]`` (what mla_qb_qabs computes
    itself)."""
    from . import qmatmul

    width = q_latent.shape[-1]
    BL = q_latent.size // width
    q = qmatmul(q_latent.reshape(BL, width), q_b)
    rope = q.shape[-1] // H - nope
    if L == 1:
        return q[:, : H * nope].reshape(BL, H, 1, nope), q[:, H * nope:].reshape(BL, H, 1, rope)
    B = BL // L
    return (q[:, : H * nope].reshape(B, L, H, nope).transpose(0, 2, 1, 3),
            q[:, H * nope:].reshape(B, L, H, rope).transpose(0, 2, 1, 3))


def _heads_per_block(H: int) -> int:
    return next(hb for hb in (4, 2, 1) if H % hb == 0)


def unit_lanes(n_units: int) -> tuple:
    """(LW, NU, RU) of mla_qabs / mla_out: LW lanes per kv_b row (the smallest power of two
    holding the row's units, so 32 / LW rows share a SIMD group instead of idling lanes), NU
    units a lane, RU rows a lane per step."""
    lw = min(SIMD, 1 << max(0, n_units - 1).bit_length())
    nu = _ceil_div(n_units, lw)
    return lw, nu, max(1, UNITS_IN_FLIGHT // nu)


def qabs_parts(n_units: int, parts: int) -> tuple:
    """(units a part, parts) of mla_qabs: ``parts`` shares of n_units, as even as whole units
    allow (fewer where n_units is small)."""
    upp = _ceil_div(n_units, max(1, min(parts, n_units)))
    return upp, _ceil_div(n_units, upp)


def _template(p: Projection, **extra) -> list:
    return [(k, v) for k, v in extra.items()] + [
        ("FMT", p.fmt), ("GS", _gs(p)), ("VEC", p.vec)]


def _gs(p: Projection) -> int:
    """The GS template value: fmt 4's and the MLX formats' group size (16 where unused)."""
    return int(p.gs) if p.fmt == 4 or p.mlx else 16


def default_tile(P: int) -> int:
    """Positions per tile: about TARGET_TILES tiles, at least MIN_TILE, a multiple of CHUNK."""
    tt = max(MIN_TILE, _ceil_div(P, TARGET_TILES))
    return _ceil_div(tt, CHUNK) * CHUNK


def mma_tile(P: int, head_blocks: int) -> int:
    """mla_attn_mma's positions per tile: about MMA_TARGET_BLOCKS threadgroups, at least
    MMA_MIN_TILE positions (a tile pays one partial of R floats per head), a multiple of CHUNK."""
    tt = max(MMA_MIN_TILE, _ceil_div(P * head_blocks, MMA_TARGET_BLOCKS))
    return _ceil_div(tt, CHUNK) * CHUNK


def mma_heads(backend: str, heads: Optional[int] = None, variant: Optional[str] = None) -> int:
    """HT of mla_attn_mma / mla_attn_wide: ``heads``, or the default."""
    ht = heads or (WIDE_HEADS if variant == "wide" else MMA_HEADS.get(backend, 32))
    if ht not in MMA_HEAD_CHOICES:
        raise ValueError(f"mla_decode: {ht} heads per threadgroup is not one of {MMA_HEAD_CHOICES}")
    if backend == dispatch.CUDA and ht * 8 > CUDA_MAX_THREADS_AT_FULL_REGS:
        raise ValueError(f"mla_decode: {ht} heads per threadgroup do not launch on CUDA: "
                         f"{ht * 8} threads of ~230 registers exceed an SM's 65536 (16 or 32 do)")
    return ht


def wide_decline_reason(backend: str, cache_dtype) -> Optional[str]:
    """Why ``mla_attn_wide`` cannot run here (None: it can)."""
    if backend not in WIDE_CHUNK:
        return f"{backend}: no mla_attn_wide"
    if cache_dtype is None or cache_dtype not in (mx.bfloat16, mx.float16):
        return f"a {cache_dtype} cache (mla_attn_wide stages 16-bit values)"
    return None


def choose_variant(R: int, rope: int, variant: Optional[str] = None, backend: str = dispatch.METAL,
                   dtype=None, cache_dtype=None) -> str:
    """``variant``, else ``mma`` on Metal; on CUDA ``wide`` over a
    16-bit cache (H200, kernel alone: 21.8 / 93.4 us against mma's 30.7 / 158.2 at 4096 /
    32768 positions) and ``simt`` for float32 queries: the matrix variants round q' and P to TF32
    (2^-11), below the bfloat16 rounding of a bf16 model's own activations but not within
    float32 parity (1e-4 of scale). Metal's simdgroup_matrix<float> is float32 throughout.
    Metal's ``wide`` is opt-in (not yet measured on an Apple GPU). ``wide`` where it cannot run
    (:func:`wide_decline_reason`) is ``mma``; ``simt`` where the matrix variants cannot run."""
    default = "mma"
    if backend == dispatch.CUDA:
        default = "simt" if dtype == mx.float32 else ("mma" if wide_decline_reason(backend, cache_dtype) else "wide")
    want = variant or default
    if want not in VARIANTS:
        raise ValueError(f"mla_decode: variant {want!r} is not one of {VARIANTS}")
    if want == "wide" and wide_decline_reason(backend, cache_dtype) is not None:
        want = "mma"
    if want in MATRIX_VARIANTS and (R % 8 or rope % 8):
        return "simt"                             # 8x8 matrix tiles of the latent / rope columns
    return want


PARAM_LENGTH = 6          # params' index of P, the positions attended (the cache length)


def _param_values(H, nope, v, R, rope, T, P, TT, NT, L, p: Projection, has_mask, has_sel, Hp, joint) -> tuple:
    return (H, nope, v, R, rope, T, P, TT, NT, L, p.rb, p.ng, p.n_units, has_mask, has_sel, Hp, int(joint))


def _params(H, nope, v, R, rope, T, P, TT, NT, L, p: Projection, has_mask, has_sel, Hp, joint) -> mx.array:
    return _int32s(*_param_values(H, nope, v, R, rope, T, P, TT, NT, L, p, has_mask, has_sel, Hp, joint))


_int32s = device_inputs.host_int32s


@dataclass
class _Static:
    """What a layer's three launches keep from step to step (everything but the cache length)."""

    p: Projection
    header: str
    bodies: dict
    Hp: int
    HT: int
    qabs: dict            # LaunchSpec fields of mla_qabs but inputs and template
    qabs_templates: list  # mla_qabs' template with ROPEQ 0 / 1
    attn_name: str
    attn_threads: int     # threads a threadgroup
    attn_blocks: int      # threadgroups along x
    attn_template: list
    out_template: list
    out_threads: int      # threads of mla_out's threadgroup
    attn_shared: int = 0  # dynamic shared memory of the attention launch (CUDA, wide)


def out_simdgroups(warps: Optional[int] = None) -> int:
    """mla_out's SIMD groups: ``warps`` or OUT_WARPS (4, 8 or 16: its tile weights take whole
    passes of MAX_TILES)."""
    w = warps or OUT_WARPS
    if w not in (4, 8, 16):
        raise ValueError(f"mla_out: {w} SIMD groups (4, 8 or 16)")
    return w


def _static(kv_b, B, L, H, nope, v, R, rope, q_dtype, cache_dtype, backend, variant, HT,
            qabs_parts_asked: Optional[int] = None, out_warps_asked: Optional[int] = None) -> _Static:
    mma = variant in MATRIX_VARIANTS
    qabs_parts_asked = qabs_parts_asked or QABS_PARTS
    out_nsg = out_simdgroups(out_warps_asked)
    key = (id(kv_b), B, L, H, nope, v, R, rope, q_dtype, cache_dtype, backend, variant, HT, qabs_parts_asked,
           out_nsg)
    hit = _statics.get(key)
    if hit is not None and hit[0] is kv_b:
        return hit[1]
    p = kv_b_projection(kv_b)
    if (p.O, p.I) != (H * (nope + v), R):
        raise ValueError(f"mla_decode: kv_b is {p.O}x{p.I}, expected {H * (nope + v)}x{R}")
    Hp = _ceil_div(H, HT) * HT if mma else H     # q' rows, padded for mma
    BL = B * L
    header = kernel_header("mla_decode", backend, gguf_formats.is_gguf(kv_b) if isinstance(kv_b, QTensor) else False)
    bodies = read_kernel_sections("mla_decode", backend)[1]
    n_units = p.n_units
    LW, NU, RU = unit_lanes(n_units)
    UPP, parts = qabs_parts(n_units, qabs_parts_asked)
    LWq, NUq, RUq = unit_lanes(UPP)
    tg = (SIMD * NSG, 1, 1)
    qabs = dict(name="mla_qabs", input_names=("qn", "qrope", "w", "scales", "e8grid", "params", "qpos", "invf"),
                output_names=("qabs",), source=bodies["mla_qabs"], header=header,
                output_shapes=[(BL, Hp, R + rope)], output_dtypes=[mx.float32],
                grid=(SIMD * NSG * parts, Hp, BL), threadgroup=tg)
    qabs_templates = [_template(p, NSG=NSG, LW=LWq, NU=NUq, RU=RUq, UPP=UPP, TQ=q_dtype, ROPEQ=rot) for rot in (0, 1)]
    attn_shared = 0
    if mma:   # SIMD groups = HT/16 head tiles x 4 k-parts (both variants); NCT column tiles of 8 per SIMD group
        attn_name, attn_sg, attn_blocks = f"mla_attn_{variant}", HT // 16 * WIDE_KPARTS, Hp // HT
        attn_template = [("TC", cache_dtype), ("NSG", attn_sg), ("HT", HT),
                         ("NCT", _ceil_div(R, 8 * attn_sg)), ("RW", R + rope), ("RL", R)]
        if variant == "wide":
            attn_template.append(("CK", WIDE_CHUNK[backend]))
            if backend == dispatch.CUDA:
                attn_shared = wide_shared_bytes(HT, attn_sg, R + rope)
            elif wide_threadgroup_bytes(HT, attn_sg, R + rope) > METAL_THREADGROUP_BYTES:
                raise ValueError(f"mla_decode: mla_attn_wide with {HT} heads per threadgroup "
                                 f"needs {wide_threadgroup_bytes(HT, attn_sg, R + rope)} bytes of threadgroup "
                                 f"memory at {R + rope} values a row, Metal has {METAL_THREADGROUP_BYTES}")
    else:
        HB = _heads_per_block(H)
        attn_sg = min(NSG, _ceil_div(H, HB))      # SIMD groups sharing each staged chunk
        attn_name, attn_blocks = "mla_attn", _ceil_div(H, HB * attn_sg)
        attn_template = [("TC", cache_dtype), ("NSG", attn_sg), ("HB", HB), ("CJ", _ceil_div(R, SIMD)),
                         ("RJ", max(1, _ceil_div(rope, SIMD)))]
    out_template = _template(p, T=q_dtype, NSG=out_nsg, RMAX=_ceil_div(R, 64) * 64, LW=LW, NU=NU, RU=RU,
                             NTMAX=MAX_TILES, TU=2 * out_nsg)
    st = _Static(p, header, bodies, Hp, HT, qabs, qabs_templates, attn_name, SIMD * attn_sg, attn_blocks,
                 attn_template, out_template, SIMD * out_nsg, attn_shared)
    _statics[key] = (kv_b, st)
    return st


_statics: dict = {}


def wide_shared_bytes(HT: int, nsg: int, RW: int) -> int:
    """mla_attn_wide's dynamic shared memory on CUDA: two chunks of 16-bit rows (RW + 8 values),
    the k-parts' partial scores, the weights P (rows of CK + 8 floats) and alpha per head."""
    kp = nsg // (HT // 16)
    ck = WIDE_CHUNK[dispatch.CUDA]
    rows = ck + 8
    return 2 * ck * (RW + 8) * 2 + (kp * HT * rows + HT * rows + HT) * 4


METAL_THREADGROUP_BYTES = 32768


def wide_threadgroup_bytes(HT: int, nsg: int, RW: int) -> int:
    """mla_attn_wide's threadgroup memory on Metal: one chunk of 16-bit rows (RW + 8 values),
    the k-parts' partial scores, the weights P, diag(alpha) and a write-out tile a SIMD group."""
    kp = nsg // (HT // 16)
    ck = WIDE_CHUNK[dispatch.METAL]
    return ck * (RW + 8) * 2 + (kp * HT * ck + HT * ck + HT * 8 + nsg * 64) * 4


def _tiles(P: int, variant: str, head_blocks: int, tile: Optional[int], backend: str) -> tuple[int, int]:
    """(TT positions a tile, NT tiles) for P positions (``tile``: asked for, else the default)."""
    TT = tile or (mma_tile(P, head_blocks) if variant in MATRIX_VARIANTS else default_tile(P))
    if variant == "wide" and not tile:
        TT = _ceil_div(TT, WIDE_CHUNK[backend]) * WIDE_CHUNK[backend]   # whole chunks
    TT = max(TT, _ceil_div(P, MAX_TILES))        # mla_out's tile weights: NT <= MAX_TILES
    return TT, max(1, _ceil_div(P, TT))


def step_params(kv_b, latent, H: int, nope: int, rope: int, v: int, q_dtype, length: int,
                backend: Optional[str] = None, joint: bool = False, variant: Optional[str] = None,
                tile: Optional[int] = None, rows: int = 1, causal: bool = False) -> mx.array:
    """The params input of a decode step (one query row a sequence) over a fixed-capacity cache
    (``latent`` its whole buffer, ``[B, capacity, R]``, or with ``joint`` the whole joint buffer
    ``[B, capacity, R + rope]``; positions ``0..length-1`` attended, no mask, no list): the
    launches' shapes follow the capacity, so a compiled graph (kernels.compiled) keeps them while
    ``length`` grows and only this array changes per step. Made on the host, once per distinct
    value (layers of one format share it). ``variant`` / ``tile``: for launches made with them
    (:func:`launch_specs`; default: its defaults). ``rows`` query rows of one sequence with
    ``causal``: row i attends to the first ``length - rows + i + 1`` positions, no mask input
    (a verify step of speculative decoding: :func:`mla_decode`'s ``causal``)."""
    backend = backend or dispatch.backend()
    if backend == dispatch.REFERENCE:
        backend = dispatch.METAL                  # the reference reads only P (index 6)
    B, T, R = latent.shape
    R -= rope if joint else 0
    L = rows
    variant = choose_variant(R, rope, variant, backend, q_dtype, latent.dtype)
    st = _static(kv_b, B, L, H, nope, v, R, rope, q_dtype, latent.dtype, backend, variant,
                 mma_heads(backend, None, variant))
    TT, NT = _tiles(T, variant, st.Hp // st.HT, tile, backend)
    # The length (index 6) changes every step: on CUDA the array is made on the GPU
    # (device_inputs: a host-made one stalls its first reader on a page fault).
    return device_inputs.int32s_varying(
        _param_values(H, nope, v, R, rope, T, length, TT, NT, L, st.p, CAUSAL if causal else 0, 0, st.Hp, joint),
        PARAM_LENGTH, backend)


def params_signature(kv_b) -> tuple:
    """What :func:`step_params` reads of kv_b (format and shape): layers whose signatures and
    attention shapes are equal get one params array for a step, which a caller can make once."""
    p = kv_b_projection(kv_b)
    return (p.fmt, p.gs, p.O, p.I)


def launch_specs(q_nope, q_rope, latent, k_rope, kv_b, scale, mask, nope, v, selected=None,
                 backend: str = dispatch.METAL, tile: Optional[int] = None, variant: Optional[str] = None,
                 heads: Optional[int] = None, params: Optional[mx.array] = None,
                 q_rotation: Optional[tuple] = None, qabs_parts: Optional[int] = None,
                 out_warps: Optional[int] = None, q_proj: Optional[tuple] = None, qb: Optional[str] = None,
                 causal: bool = False):
    """The three launches; returns a function running them with a given ``launch``
    (``run.variant``: the attention variant chosen). ``k_rope`` None: ``latent`` is the joint
    cache ``[B, T, R + rope]`` (each row the latent, then the rope key). ``params``: from
    :func:`step_params` (a fixed-capacity cache: tiles follow the buffer's rows, the length is
    in the array; made with the same ``joint``).
    ``q_rotation``: ``(inv_freq float32 [rope / 2], positions int32 [B * L])``: q_rope arrives
    unrotated and mla_qabs rotates it (half-split, as mx.fast.rope). ``qabs_parts``: mla_qabs'
    threadgroups a head (default QABS_PARTS); ``out_warps``:
    mla_out's SIMD groups (:func:`out_simdgroups`). ``q_proj``: ``(q_latent, q_b)`` of one decode
    row instead of q_nope / q_rope (None): mla_qb_qabs projects them itself (first launch);
    ``qb``: its setting (:func:`qb_setting`). ``causal`` (no ``mask``): the query rows are the
    consecutive positions of one sequence (with ``q_proj``: every row of q_latent), row l
    attending to the first ``P - L + l + 1`` positions; the output is then ``[B, L, H * v]``."""
    if q_proj is None:
        B, H, L, _ = q_nope.shape
        rope, q_dtype = q_rope.shape[-1], q_nope.dtype
    else:
        q_latent, q_b = q_proj
        rows = q_latent.size // q_latent.shape[-1]
        B, L, q_dtype = (1, rows, q_latent.dtype) if causal else (rows, 1, q_latent.dtype)
        H = heads_of(kv_b, nope, v)
        rope = q_b.O // H - nope
    joint = k_rope is None
    T, R = latent.shape[1], latent.shape[2] - (rope if joint else 0)
    BL = B * L
    asked = variant
    variant = choose_variant(R, rope, variant, backend, q_dtype, latent.dtype)
    if asked == "wide" and variant != "wide":
        dispatch.record_fallback("mla_attn_wide", wide_decline_reason(backend, latent.dtype) or f"R {R}, rope {rope}",
                                 instead=f"mla_attn_{variant}")
    st = _static(kv_b, B, L, H, nope, v, R, rope, q_dtype, latent.dtype, backend, variant,
                 mma_heads(backend, heads, variant), qabs_parts, out_warps)
    p, Hp, HT = st.p, st.Hp, st.HT
    P = T if selected is None else selected.shape[-1]
    TT, NT = _tiles(P, variant, Hp // HT, tile, backend)
    if causal and (mask is not None or selected is not None or B != 1):
        raise ValueError("mla_decode: causal rows are one sequence's, without a mask or a position list")
    has_mask, has_sel = CAUSAL if causal else int(mask is not None), int(selected is not None)
    if params is None:
        params = _params(H, nope, v, R, rope, T, P, TT, NT, L, p, has_mask, has_sel, Hp, joint)
    elif has_sel:
        # step_params' arrays describe a whole buffer (causal rows attend by position), not a list.
        raise ValueError("mla_decode: step params are for a cache without a position list")
    fparams = dispatch.float_params(float(scale))
    # Read in the activations' dtype: mla_qabs widens them and writes q' and q_rope as one float
    # row per head (padding heads zero), so no cast or pad launch runs per layer.
    # One query row a sequence: [B, H, 1, d] is already [B * L, H, d] in memory order (the
    # kernel reads a flat pointer), so no transpose / reshape nodes (MLX copies an input that
    # is not row-contiguous, as the reshape would).
    if q_proj is not None:
        qn = qr = None
    elif L == 1:
        qn, qr = q_nope, q_rope
    else:
        qn = q_nope.transpose(0, 2, 1, 3).reshape(BL, H, nope)
        qr = q_rope.transpose(0, 2, 1, 3).reshape(BL, H, rope)
    if mask is not None:
        mask_u8 = mx.broadcast_to(mask, (B, 1, L, T)).reshape(BL, T).astype(mx.uint8)
    else:
        mask_u8 = _no_mask()
    sel = selected.reshape(BL, P).astype(mx.int32) if selected is not None else dispatch.int_params()
    # without a rotation, qpos / invf are stand-ins (params, fparams), never read
    qpos, invf = (params, fparams) if q_rotation is None else (q_rotation[1], q_rotation[0])
    if q_proj is None:
        qabs_spec = dispatch.LaunchSpec(inputs=[at_least_8(qn), at_least_8(qr), p.packed, p.scales, e8grid(), params,
                                                qpos, invf],
                                        template=st.qabs_templates[int(q_rotation is not None)], **st.qabs)
    else:
        qabs_spec = _qb_qabs_spec(st, q_latent, q_b, nope, rope, backend, params, qpos, invf, q_rotation is not None, qb)

    def attn_spec(qabs):
        return dispatch.LaunchSpec(
            name=st.attn_name, input_names=("qabs", "latent", "krope", "mask", "sel", "params", "fparams"),
            output_names=("pacc", "pml"), source=st.bodies[st.attn_name], header=st.header,
            inputs=[qabs, latent, latent if joint else k_rope, mask_u8, sel, params, fparams],
            output_shapes=[(BL, H, NT, R), (BL, H, NT, 2)], output_dtypes=[mx.float32, mx.float32],
            grid=(st.attn_threads * st.attn_blocks, NT, BL), threadgroup=(st.attn_threads, 1, 1),
            template=st.attn_template, shared_memory=st.attn_shared)

    def out_spec(pacc, pml):
        return dispatch.LaunchSpec(
            name="mla_out", input_names=("pacc", "pml", "w", "scales", "e8grid", "params"), output_names=("out",),
            source=st.bodies["mla_out"], header=st.header,
            inputs=[pacc, pml, p.packed, p.scales, e8grid(), params],
            output_shapes=[(B, L, H * v) if causal else (B, H, L, v) if L == 1 else (BL, H, v)],
            output_dtypes=[q_dtype],
            grid=(st.out_threads, H, BL), threadgroup=(st.out_threads, 1, 1), template=st.out_template)

    def run(launch):
        (qabs,) = launch(qabs_spec)
        pacc, pml = launch(attn_spec(qabs))
        (out,) = launch(out_spec(pacc, pml))
        # [B * L, H, v] rows; with L == 1 that is [B, H, 1, v] already (written so: no views)
        return out if L == 1 or causal else out.reshape(B, L, H, v).transpose(0, 2, 1, 3)

    run.variant = variant
    return run


def planned_launches(run) -> list:
    """The LaunchSpecs a :func:`launch_specs` ``run`` makes, without running them (each output a
    zeros array of its shape): for compiling, simulating or timing the launches one by one."""
    specs = []
    run(lambda spec: specs.append(spec) or [mx.zeros(sh, d) for sh, d in zip(spec.output_shapes, spec.output_dtypes)])
    return specs


def qb_setting(setting: Optional[str] = None, backend: str = dispatch.METAL) -> tuple[int, int]:
    """mla_qb_qabs' (SIMD groups, q_b rows a SIMD group pass): ``setting`` as "NSG:QR", else the
    backend's QB_SETTINGS."""
    if not setting:
        return QB_SETTINGS.get(backend, QB_SETTINGS[dispatch.METAL])
    try:
        nsg, qr = (int(f) for f in setting.split(":"))
    except ValueError:
        raise ValueError(f"mla_qb_qabs setting {setting!r}: expected SIMD groups:rows, e.g. 16:4") from None
    if nsg not in (4, 8, 16, 32) or not 1 <= qr <= 32:
        raise ValueError(f"mla_qb_qabs setting {setting!r}: SIMD groups 4, 8, 16 or 32; rows 1-32")
    return nsg, qr


def _qb_qabs_spec(st: _Static, q_latent, q_b, nope: int, rope: int, backend: str, params, qpos, invf,
                  rotate: bool, setting: Optional[str] = None) -> dispatch.LaunchSpec:
    """mla_qb_qabs: mla_qabs (one threadgroup a head, all kv_b units) with this head's q_b rows
    computed first from the q_latent row."""
    pb = kv_b_projection(q_b)
    gguf = is_gguf_fmt(pb.fmt) or is_gguf_fmt(st.p.fmt)
    nsg, qr = QB_SETTINGS_GGUF_CUDA if gguf and backend == dispatch.CUDA and not setting else qb_setting(setting, backend)
    key = (id(q_b), id(st), q_latent.dtype, backend, rotate, nsg, qr)
    hit = _qb_statics.get(key)
    if hit is None or hit[0] is not q_b:
        n_units = st.p.n_units
        LW, NU, RU = unit_lanes(n_units)
        whole = pb.I % pb.unit == 0
        x_vec = (2 if whole else 1) if pb.I * q_latent.dtype.size % 16 == 0 else 0
        template = _template(st.p, NSG=nsg, LW=LW, NU=NU, RU=RU, UPP=n_units, TQ=q_latent.dtype,
                             ROPEQ=int(rotate), QMAX=nope + rope, QR=qr, NUB=_ceil_div(pb.n_units, SIMD),
                             FMTB=pb.fmt, GSB=_gs(pb), VECB=pb.vec, XVB=x_vec,
                             NIB=DEFAULT_NIB[backend])
        header = kernel_header("mla_decode", backend, True) if gguf else st.header
        if backend == dispatch.CUDA and SIMD * nsg > CUDA_MAX_THREADS_AT_FULL_REGS:
            # 512+ threads must fit an SM's 64 K registers (unbounded it takes up to ~170 a thread)
            header = dispatch.bounded_header(header, SIMD * nsg, 1)
            template.append(("MINB", 1))
        fields = dict(name="mla_qb_qabs",
                      input_names=("qa", "wqb", "sqb", "w", "scales", "e8grid", "params", "qbp", "qpos", "invf"),
                      output_names=("qabs",), source=st.bodies["mla_qb_qabs"], header=header,
                      output_shapes=st.qabs["output_shapes"], output_dtypes=[mx.float32],
                      grid=(SIMD * nsg, st.Hp, st.qabs["grid"][2]), threadgroup=(SIMD * nsg, 1, 1),
                      template=template)
        qbp = _int32s(pb.I, pb.O, pb.rb, pb.ng, pb.n_units, 0, 0, 0)
        hit = _qb_statics[key] = (q_b, fields, qbp)
    _, fields, qbp = hit
    return dispatch.LaunchSpec(inputs=[at_least_8(q_latent), pb.packed, pb.scales, st.p.packed, st.p.scales, e8grid(),
                                       params, qbp, qpos, invf], **fields)


_qb_statics: dict = {}


def mla_decode(q_nope, q_rope, latent, k_rope, kv_b, scale, mask, qk_nope_head_dim, v_head_dim,
               selected: Optional[mx.array] = None, variant: Optional[str] = None,
               params: Optional[mx.array] = None, rope=None, rope_offset: Optional[mx.array] = None,
               q_proj: Optional[tuple] = None, causal: bool = False) -> mx.array:
    """``[B, H, L, v]`` absorbed attention (shapes as in models/mla_reference.py); ``selected``
    ``[B, L, P]`` int32 restricts each query row to those cache positions (DSA); ``variant``
    the attention kernel (``mma`` / ``simt`` / ``wide``, default :func:`choose_variant`'s);
    ``k_rope`` None: ``latent`` is the joint cache ``[B, T, R + rope]`` (each row the latent,
    then the rope key: one buffer, one row written a decode step). ``params``
    (:func:`step_params`, made with the same layout): the cache is a fixed-capacity buffer of
    which the first ``params[6]`` rows are attended. ``rope`` (models/rope.RoPE) and
    ``rope_offset`` (int32 array, the position of a single query row): ``q_rope`` arrives
    unrotated; mla_qabs rotates it (the separate mx.fast.rope launch's numbers).
    ``q_proj``: ``(q_latent, q_b)`` of decode rows, q_nope / q_rope None: the queries are
    q_b's projection of q_latent, rows ``[H x nope | H x rope]`` (:func:`project_queries`),
    which the first launch (mla_qb_qabs) computes itself; where it declines (counted) or on the
    reference path, q_b's GEMV runs first.

    ``causal``: the L query rows (with ``q_proj``: every row of ``q_latent [1, L, q_lora]``) are
    consecutive positions of one sequence, row l attending to the first ``P - L + l + 1``
    positions (P: ``params[6]``, made by :func:`step_params` with ``causal``, else the cache
    length), no ``mask``; ``rope_offset`` then holds each row's position (int32 ``[L]``). The
    output is ``[1, L, H * v]`` (the rows in order: o_proj's input as it is)."""
    impl = dispatch.backend()
    L_rows = 1
    if q_proj is not None:
        q_latent, q_b = q_proj
        H = heads_of(kv_b, qk_nope_head_dim, v_head_dim)
        L_rows = q_latent.size // q_latent.shape[-1] if causal else 1
        why = None if impl == dispatch.REFERENCE else qb_decline_reason(q_latent, q_b, H, qk_nope_head_dim)
        if why is None and impl != dispatch.REFERENCE:
            why = decline_reason_shapes(L_rows, latent, kv_b)
        if impl == dispatch.REFERENCE or why is not None:
            if why is not None:
                dispatch.record_fallback("mla_qb_qabs", why)
            q_nope, q_rope = project_queries(q_latent, q_b, H, qk_nope_head_dim, L_rows)
            q_proj = None
    if q_proj is None:
        reason = None if impl == dispatch.REFERENCE else decline_reason(q_nope, latent, kv_b)
        rope_width, q_rows = q_rope.shape[-1], q_rope.shape[0] * q_rope.shape[2]
        L_rows = q_rope.shape[2]
    else:
        reason = None
        rope_width, q_rows = q_b.O // H - qk_nope_head_dim, q_latent.size // q_latent.shape[-1]
    q_rotation = None
    if rope is not None:
        kernels_run = impl != dispatch.REFERENCE and reason is None
        why = rotation_decline_reason(q_rows, rope_width, rope, rope_offset) if kernels_run else None
        if kernels_run and why is None:
            q_rotation = (rope.inv_freq, dispatch.reshaped(rope_offset, q_rows))
        else:
            if why is not None:
                dispatch.record_fallback("mla_qabs rope", why)
            if q_proj is not None:            # the fused launch cannot rotate: project first
                dispatch.record_fallback("mla_qb_qabs", f"q_rope rotated apart: {why}")
                q_nope, q_rope = project_queries(q_latent, q_b, H, qk_nope_head_dim, L_rows)
                q_proj = None
            # causal rows of one sequence: mx.fast.rope rotates row l at the first row's position + l;
            # decode rows of several sequences (batch_decode) keep an offset each
            if causal and rope_offset is not None and rope_offset.ndim > 0:
                rope_offset = rope_offset.reshape(-1)[0]
            q_rope = rope.apply_fast(q_rope, rope_offset)
    if impl == dispatch.REFERENCE or reason is not None:
        if reason is None:
            dispatch.record_call("mla_decode", dispatch.REFERENCE)
        else:
            dispatch.record_fallback("mla_decode", reason)
        if k_rope is None:
            R = latent.shape[-1] - q_rope.shape[-1]
            latent, k_rope = latent[..., :R], latent[..., R:]
        length = None if params is None else params[PARAM_LENGTH]
        if params is not None:               # rows past the length do not exist yet: not
            rows = mx.arange(latent.shape[1]) < length               # attended, not summed
            latent = mx.where(rows[None, :, None], latent, 0).astype(latent.dtype)
            k_rope = mx.where(rows[None, :, None], k_rope, 0).astype(k_rope.dtype)
            mask = rows[None, None, None] if mask is None else mask & rows[None, None, None]
        if causal:
            causal_rows = causal_mask(L_rows, latent.shape[1], length)
            mask = causal_rows if mask is None else mask & causal_rows
        out = reference_mla_decode(q_nope, q_rope, latent, k_rope, kv_b, scale, mask,
                                   qk_nope_head_dim, v_head_dim, selected)
        if causal:
            B, H, L, v = out.shape
            return out.transpose(0, 2, 1, 3).reshape(B, L, H * v)
        return out
    dispatch.record_call("mla_decode", impl)
    if q_proj is not None:
        dispatch.record_call("mla_qb_qabs", impl)
    run = launch_specs(q_nope, q_rope, latent, k_rope, kv_b, scale, mask, qk_nope_head_dim, v_head_dim,
                       selected, backend=impl, variant=variant, params=params, q_rotation=q_rotation,
                       q_proj=q_proj, causal=causal)
    dispatch.record_call(f"mla_attn/{run.variant}", impl)
    return run(lambda spec: dispatch.launch(impl, spec))


def rotation_decline_reason(q_rows: int, width: int, rope, positions: Optional[mx.array] = None) -> Optional[str]:
    """Why mla_qabs does not rotate q_rope (``q_rows`` query rows of ``width``, at ``positions``:
    one a row) itself (a separate mx.fast.rope runs, counted)."""
    n = 1 if positions is None else positions.size
    if n != q_rows:
        return f"{q_rows} query rows at {n} position(s): one position a row"
    if width % 2:
        return f"rope width {width}"
    if rope.attention_factor != 1.0:
        return f"rope attention factor {rope.attention_factor} (mx.fast.rope's product by it rounds once more)"
    return None


# ---------------------------------------------------------------------------------------
# Reference (pure MLX)


def causal_mask(L: int, T: int, length=None) -> mx.array:
    """Bool ``[1, 1, L, T]``: query row l of L (the last L of ``length`` positions, default T)
    sees positions ``t <= length - L + l``; ``length`` may be an array (in a compiled graph)."""
    limit = (T if length is None else length) - L + mx.arange(L, dtype=mx.int32)
    return (mx.arange(T, dtype=mx.int32)[None] <= limit[:, None])[None, None]


def reference_mla_decode(q_nope, q_rope, latent, k_rope, kv_b, scale, mask, nope, v, selected=None):
    from . import reference

    H = q_nope.shape[1]
    w = (reference.dequantize(kv_b) if isinstance(kv_b, QTensor) else kv_b.astype(mx.float32)).reshape(H, nope + v, -1)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    f32 = mx.float32
    q_abs = q_nope.astype(f32) @ w_uk
    scores = (q_abs @ latent.astype(f32)[:, None].swapaxes(-1, -2)
              + q_rope.astype(f32) @ k_rope.astype(f32)[:, None].swapaxes(-1, -2)) * scale
    if selected is not None:
        B, L, P = selected.shape
        chosen = mx.zeros((B, L, latent.shape[1]), mx.bool_)
        chosen = mx.put_along_axis(chosen, selected.astype(mx.int32), mx.array(True), axis=-1)[:, None]
        mask = chosen if mask is None else (mask & chosen)
        # positions outside the list do not exist for the row (the kernel never visits them)
        scores = mx.where(chosen, scores, -mx.inf)
    if mask is not None:
        scores = mx.where(mask, scores, mx.where(mx.isinf(scores), scores, MASKED))
    context = mx.softmax(scores, axis=-1, precise=True) @ latent.astype(f32)[:, None]
    return (context @ w_uv.swapaxes(-1, -2)).astype(q_nope.dtype)

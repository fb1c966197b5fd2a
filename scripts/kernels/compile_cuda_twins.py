#!/usr/bin/env python3
"""Compile the CUDA twins here, inside the wrapper MLX's cuda_kernel generates, with MLX's own
compiler (NVRTC, from the pip wheels nvidia-cuda-nvrtc / -runtime / -cccl) or nvcc.

    .venv/bin/python scripts/kernels/compile_cuda_twins.py [--all] [--ptxas] [--keep DIR] [--compiler nvcc]

No GPU needed: this catches syntax and type errors (and, with --ptxas, register use and
spills per specialization) before a GPU run; tests/test_cuda_twins_compile.py runs it in CI.
The wrapper is written as mlx/backend/cuda/custom_kernel.cpp (MLX 0.32) writes it: MLX's
default header, our header, ``namespace mlx::core::cu { __global__ void
custom_kernel_<name>(const T* in..., T* out...) { constexpr int ...; using T = ...; <body> } }``.
MLX's device headers are not shipped in the wheel, so ``mlx/backend/cuda/device/utils.cuh`` is
a stub with the CUDA headers it pulls in. NVRTC gets the options MLX's JIT gives it
(``--device-as-default-execution-space``, sm_90a); nvcc has no such switch, so helpers must say
``__device__`` (ours do). Launches come from the kernels' own launch_spec functions, so the
template values are exactly those the GPU would get.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from colibri_mlx.kernels import dispatch, qgemv  # noqa: E402
from colibri_mlx.kernels.kernel_text import launch_text  # noqa: E402
from kernel_oracle import MLX_KERNEL_CASES, random_gguf_qtensor, random_mlx_qtensor, random_qtensor, random_x  # noqa: E402

ARCH = "sm_90a"
CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
              mx.uint8: "uint8_t", mx.int32: "int32_t", mx.uint32: "uint32_t",
              mx.uint16: "uint16_t", mx.int8: "int8_t"}

DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

#define inf cuda::std::numeric_limits<float>::infinity()

"""

UTILS_STUB = """#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/limits>
#include <cstdint>
#define WARP_SIZE 32
"""


def wrap(spec: dispatch.LaunchSpec, kernel_name: str) -> str:
    """The translation unit MLX's build_kernel() writes for this launch (of the text dispatch
    hands MLX: compacted, the header pruned to what the body uses)."""
    header, source = launch_text(spec.header, spec.source, spec.name)
    params = [f"    const {CUDA_TYPES[a.dtype]}* {n}" for n, a in zip(spec.input_names, spec.inputs)]
    params += [f"    {CUDA_TYPES[d]}* {n}" for n, d in zip(spec.output_names, spec.output_dtypes)]
    consts = []
    for name, value in spec.template:
        if isinstance(value, mx.Dtype):
            consts.append(f"  using {name} = {CUDA_TYPES[value]};")
        elif isinstance(value, bool):
            consts.append(f"  constexpr bool {name} = {str(value).lower()};")
        else:
            consts.append(f"  constexpr int {name} = {int(value)};")
    return (DEFAULT_HEADER + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void {kernel_name}(\n" + ",\n".join(params) + ") {\n"
            + "\n".join(consts) + "\n\n" + source + "\n}\n\n} // namespace mlx::core::cu\n")


def mlx_cases(full: bool) -> list:
    """MLX-format weights to compile: every kernel FMT family with ``full``; else each scale
    dtype's affine decode (the bit widths differ only in a constant) and every fp mode."""
    if full:
        return MLX_KERNEL_CASES
    return [c for c in MLX_KERNEL_CASES if c[0] != "affine" or c[1] in (4, 3, 6)]


# The GGUF types of DeepSeek-V3 / Kimi-K2 mixes' hot tensors: every launch setting; the others at
# one setting each (their decoders share the helpers and the unit plumbing) unless ``full``.
GGUF_HOT_TYPES = ("Q4_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "Q8_0")


def gguf_kernel_types() -> list:
    """Names of the GGUF types the kernels decode (kernels/gguf_decode.py KERNEL_FMTS)."""
    from colibri_mlx.formats.gguf_quant import GGUF_FMTS
    from colibri_mlx.kernels.gguf_decode import KERNEL_FMTS

    return [GGUF_FMTS[f].name for f in KERNEL_FMTS]


def paired(names: list, pad: str) -> list:
    """``names`` two by two in order (an odd last one with ``pad``): each compiled once."""
    return list(zip(names[::2], (names + [pad])[1::2]))


def qgemv_specs(full: bool):
    """Launches covering every fmt, x dtype, S and load path the GPU check and bench use."""
    shapes = [(64, 4096), (7, 300)] if full else [(64, 4096)]
    for fmt, (O, I) in itertools.product((1, 2, 3, 4, 5, 6), shapes):
        for S, dtype in ((1, mx.bfloat16), (8, mx.bfloat16), (3, mx.float16), (5, mx.float32)):
            for gs in ((64, 48) if fmt == 4 else (None,)):
                qt = random_qtensor(fmt, O, I, gs=gs, seed=1)
                x = random_x(S, I, dtype=dtype)
                yield f"fmt{fmt}_{O}x{I}_S{S}_{dtype}_gs{gs}", qgemv.launch_spec(x, qt, dispatch.CUDA)
            if S == 1:   # the residual add in the write (RES 1: o_proj, the dense MLP's down)
                res = random_x(S, O, dtype=dtype)
                yield f"fmt{fmt}_{O}x{I}_S1_{dtype}_res", qgemv.launch_spec(x, qt, dispatch.CUDA, residual=res)
                # float32 logits from bf16 x (OT float32: lm_head)
                yield f"fmt{fmt}_{O}x{I}_S1_{dtype}_f32out", qgemv.launch_spec(x, qt, dispatch.CUDA,
                                                                              out_dtype=mx.float32)
                if fmt in (2, 4):   # a persistent grid (PERS 1: CUDA's default past one wave of row blocks)
                    yield f"fmt{fmt}_{O}x{I}_S1_{dtype}_pers", qgemv.launch_spec(x, qt, dispatch.CUDA, persistent=3)
                    yield (f"fmt{fmt}_{O}x{I}_S1_{dtype}_pers_rows{qgemv.CUDA_PERSISTENT_ROWS}",
                           qgemv.launch_spec(x, qt, dispatch.CUDA, rows=qgemv.CUDA_PERSISTENT_ROWS, persistent=3,
                                             shape_in=True))
                    yield f"fmt{fmt}_{O}x{I}_S1_{dtype}_shape", qgemv.launch_spec(x, qt, dispatch.CUDA, shape_in=True)
    for mode, bits, gs, sdt in mlx_cases(full):   # the MLX formats' kernel FMT families
        qt = random_mlx_qtensor(mode, bits, gs, 64, 4096, sdt, seed=1)
        for S, dtype in ((1, mx.bfloat16), (8, mx.bfloat16)):
            x = random_x(S, 4096, dtype=dtype)
            yield f"mlx_{mode}{bits}g{gs}_{str(sdt).split('.')[-1]}_S{S}", qgemv.launch_spec(x, qt, dispatch.CUDA)
            if S == 1 and bits <= 4:   # the persistent grid of six-row blocks, shape compiled in (qgemv.cuda_tuned)
                yield (f"mlx_{mode}{bits}g{gs}_{str(sdt).split('.')[-1]}_S1_pers_rows{qgemv.CUDA_PERSISTENT_ROWS}",
                       qgemv.launch_spec(x, qt, dispatch.CUDA, rows=qgemv.CUDA_PERSISTENT_ROWS, persistent=3,
                                         shape_in=True))
    for name in gguf_kernel_types():   # llama.cpp's GGUF block formats: every decoder once
        qt = random_gguf_qtensor(name, 64, 4096, seed=1)
        hot = full or name in GGUF_HOT_TYPES
        for S, dtype in ((1, mx.bfloat16), (8, mx.bfloat16), (3, mx.float32)) if hot else ((1, mx.bfloat16),):
            x = random_x(S, 4096, dtype=dtype)
            yield f"gguf_{name}_S{S}_{dtype}", qgemv.launch_spec(x, qt, dispatch.CUDA)
        if hot:   # bench_gguf_gemv.py's variants: the prefetch loop, fmt 4's persistent one-row launch
            x = random_x(1, 4096, dtype=mx.bfloat16)
            yield f"gguf_{name}_S1_pf1", qgemv.launch_spec(x, qt, dispatch.CUDA, prefetch=1, unroll=1)
            yield (f"gguf_{name}_S1_pers_rows{qgemv.CUDA_PERSISTENT_ROWS}",
                   qgemv.launch_spec(x, qt, dispatch.CUDA, prefetch=1, unroll=1, rows=qgemv.CUDA_PERSISTENT_ROWS,
                                     persistent=3, shape_in=True))
            if name == "Q4_K":   # magic-number codes (NIB 0) against the fp16-subnormal default
                yield f"gguf_{name}_S1_nib0", qgemv.launch_spec(x, qt, dispatch.CUDA, nib=0)
    if full:
        qt = random_qtensor(4, 7, 2048, gs=64, seed=1)
        for rows, nw, unroll in ((1, 1, 1), (2, 2, 3), (8, 1, 2), (4, 4, 4)):
            x = random_x(32 // max(rows, 4), 2048, dtype=mx.bfloat16)
            yield (f"fmt4_R{rows}_NW{nw}_U{unroll}",
                   qgemv.launch_spec(x, qt, dispatch.CUDA, rows=rows, simdgroups=nw, unroll=unroll))


def mla_specs(full: bool):
    """mla_qabs / mla_attn_mma / mla_out for every kv_b fmt, f32 and bf16 caches, with and
    without a DSA index list (the launches mla.launch_specs builds), the simt variant's
    mla_attn, and mla_rows in each activation dtype."""
    from colibri_mlx.kernels import mla
    from colibri_mlx.kernels.rows import rows_spec

    rng = np.random.default_rng(0)
    H, nope, v, R, rope, T = 8, 128, 128, 512, 64, 300
    # fmt 60: a float kv_b held in bfloat16 (mlx-lm's joined split kv_b on a GPU)
    for fmt in (0, 1, 2, 3, 4, 5, 60):
        for cache, sel in ((mx.bfloat16, False), (mx.float32, True)):
            kv_b = (random_qtensor(fmt, H * (nope + v), R, gs=64, seed=fmt) if fmt not in (0, 60)
                    else mx.zeros((H * (nope + v), R), mx.float32 if fmt == 0 else mx.bfloat16))
            f = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
            mask = mx.array(rng.random((1, 1, 2, T)) < 0.9)
            selected = mx.array(rng.integers(0, T, (1, 2, 64)).astype(np.int32)) if sel else None
            args = (f(1, H, 2, nope), f(1, H, 2, rope), f(1, T, R).astype(cache),
                    f(1, T, rope).astype(cache), kv_b, 0.1, mask, nope, v, selected)
            for variant in mla.VARIANTS:
                for spec in mla.planned_launches(mla.launch_specs(*args, backend=dispatch.CUDA, variant=variant)):
                    if variant == "mma" or spec.name == {"simt": "mla_attn", "wide": "mla_attn_wide"}[variant]:
                        yield f"{spec.name}_fmt{fmt}_{cache}_sel{int(sel)}", spec
    # mla_attn_mma at a latent width whose column tiles and k-steps are not whole (R 136: the
    # per-step tests stay in)
    width = 136
    kv_b = random_qtensor(4, H * (nope + v), width, gs=8, seed=4)
    z = lambda *s: mx.zeros(s, mx.bfloat16)  # noqa: E731
    specs = mla.planned_launches(mla.launch_specs(z(1, H, 1, nope), z(1, H, 1, rope), z(1, T, width), z(1, T, rope),
                                                  kv_b, 0.1, None, nope, v, backend=dispatch.CUDA, variant="mma"))
    yield "mla_attn_mma_R136", specs[1]
    # mla_attn_wide on a float16 cache (its other pair conversion)
    specs = mla.planned_launches(mla.launch_specs(z(1, H, 1, nope), z(1, H, 1, rope),
                                                  mx.zeros((1, T, R + rope), mx.float16), None,
                                                  random_qtensor(4, H * (nope + v), R, gs=64, seed=4), 0.1, None,
                                                  nope, v, backend=dispatch.CUDA, variant="wide"))
    yield "mla_attn_wide_f16_joint", specs[1]
    # mla_qabs rotating q_rope itself (ROPEQ 1), one decode row
    q = mx.zeros((1, H, 1, nope), mx.bfloat16)
    qr = mx.zeros((1, H, 1, rope), mx.bfloat16)
    kv_b = random_qtensor(4, H * (nope + v), R, gs=64, seed=4)
    run = mla.launch_specs(q, qr, mx.zeros((1, T, R), mx.bfloat16), mx.zeros((1, T, rope), mx.bfloat16), kv_b, 0.1,
                           None, nope, v, backend=dispatch.CUDA,
                           q_rotation=(mx.ones((rope // 2,), mx.float32), mx.array([7], dtype=mx.int32)))
    yield "mla_qabs_fmt4_ropeq", mla.planned_launches(run)[0]
    # mla_qb_qabs: q_b's projection folded in (one decode row), q_b in each fmt 1-5 and dtype
    # rotating q_rope (ROPEQ 1), then at other settings than CUDA's default (mla.qb_setting), ROPEQ 0
    joint = mx.zeros((1, T, R + rope), mx.bfloat16)
    for qfmt, dtype, setting in ((4, mx.bfloat16, None), (1, mx.float16, None), (2, mx.float32, None),
                                 (3, mx.bfloat16, None), (5, mx.bfloat16, None), (4, mx.bfloat16, "8:8"),
                                 (4, mx.bfloat16, "16:2")):
        q_b = random_qtensor(qfmt, H * (nope + rope), 1536, gs=64, seed=qfmt)
        run = mla.launch_specs(None, None, joint, None, kv_b, 0.1, None, nope, v, backend=dispatch.CUDA,
                               q_proj=(mx.zeros((1, 1, 1536), dtype), q_b), qb=setting,
                               q_rotation=None if setting else (mx.ones((rope // 2,), mx.float32),
                                                                mx.array([7], dtype=mx.int32)))
        label = f"qb{qfmt}_{dtype}" if setting is None else setting.replace(":", "x")
        yield f"mla_qb_qabs_{label}", mla.planned_launches(run)[0]
    # MLX-format and GGUF kv_b (mla_qabs, mla_out) and q_b (mla_qb_qabs): each kernel FMT family of
    # mlx_cases, the GGUF types (Q4_K, the most registers, in all three; unless ``full`` the other
    # types two a launch in mla_qb_qabs alone, one as kv_b (FMT), one as q_b (FMTB): every decoder
    # compiled in mla_decode once, in 9 more compiles rather than 3 a type)
    weights = [(f"mlx_{mode}{bits}g{gs}_{str(sdt).split('.')[-1]}",
                random_mlx_qtensor(mode, bits, gs, H * (nope + v), R, sdt, seed=bits),
                random_mlx_qtensor(mode, bits, gs, H * (nope + rope), 1536, sdt, seed=bits + 1), True)
               for mode, bits, gs, sdt in mlx_cases(full)]
    gguf = gguf_kernel_types()
    rest = [name for name in gguf if name != "Q4_K"]
    pairs = ([(name, name) for name in gguf] if full
             else [("Q4_K", "Q4_K")] + paired(rest, "Q4_K"))
    weights += [(f"gguf_{kv}" if kv == qb else f"gguf_{kv}_qb_{qb}", random_gguf_qtensor(kv, H * (nope + v), R, seed=2),
                 random_gguf_qtensor(qb, H * (nope + rope), 1536, seed=3), kv == qb)
                for kv, qb in pairs]
    for label, kv_b, q_b, every in weights:
        run = mla.launch_specs(None, None, joint, None, kv_b, 0.1, None, nope, v, backend=dispatch.CUDA,
                               q_proj=(mx.zeros((1, 1, 1536), mx.bfloat16), q_b))
        specs = mla.planned_launches(run)
        yield f"mla_qb_qabs_{label}", specs[0]
        if not every:
            continue
        yield f"mla_out_{label}", specs[-1]
        run = mla.launch_specs(z(1, H, 1, nope), z(1, H, 1, rope), z(1, T, R), z(1, T, rope), kv_b, 0.1, None,
                               nope, v, backend=dispatch.CUDA)
        yield f"mla_qabs_{label}", mla.planned_launches(run)[0]
    # an mlx-lm checkpoint's attention on a GPU: the joined kv_b in bfloat16 (fmt 60), q_b affine 4-bit
    run = mla.launch_specs(None, None, joint, None, mx.zeros((H * (nope + v), R), mx.bfloat16), 0.1, None, nope, v,
                           backend=dispatch.CUDA,
                           q_proj=(mx.zeros((1, 1, 1536), mx.bfloat16),
                                   random_mlx_qtensor("affine", 4, 64, H * (nope + rope), 1536, mx.bfloat16, seed=4)))
    specs = mla.planned_launches(run)
    yield "mla_qb_qabs_kvb_bf16_rows", specs[0]
    yield "mla_out_kvb_bf16_rows", specs[-1]
    for dtype in (mx.bfloat16, mx.float16, mx.float32):   # mla_rows: DeepSeek-V3's q_a / latent / rope
        y = mx.zeros((1, 1536 + R + rope), dtype)
        yield (f"mla_rows_{dtype}", rows_spec(y, 1536, mx.ones((1536,), dtype), mx.ones((R,), dtype), 1e-6,
                                                  mx.ones((rope // 2,), mx.float32), mx.array(5, dtype=mx.int32),
                                                  dispatch.CUDA))
        yield (f"mla_rows_into_{dtype}", rows_spec(y, 1536, mx.ones((1536,), dtype), mx.ones((R,), dtype), 1e-6,
                                                       mx.ones((rope // 2,), mx.float32), mx.array(5, dtype=mx.int32),
                                                       dispatch.CUDA, cache=mx.zeros((1, 16, R + rope), dtype)))


def moe_specs(full: bool):
    """moe_gate_up / moe_down / hadamard for every fmt at S = 1 (bf16 x) and S = 8 (f32 x),
    the launches MLX gets by default (moe.gate_up_spec / down_spec); the opt-in tuning variants
    (other warps, gate_up's PF 1 loop) for fmt 4
    and 6 (the most used and the most different decoder), for every fmt with ``full``."""
    from colibri_mlx.kernels import moe

    fmts = (0, 1, 2, 3, 4, 5, 6)
    for fmt in fmts:
        opt_in = full or fmt in (4, 6)
        D, inter = (512, 256) if fmt != 6 else (512, 256)
        experts = []
        for e in range(4):
            if fmt == 0:
                experts.append(tuple(mx.zeros(s, mx.float32) for s in ((inter, D), (inter, D), (D, inter))))
            else:
                experts.append((random_qtensor(fmt, inter, D, gs=64, seed=e), random_qtensor(fmt, inter, D, gs=64, seed=e + 10),
                                random_qtensor(fmt, D, inter, gs=64, seed=e + 20)))
        (group,) = moe.build_bank(experts).groups
        for S, dtype in ((1, mx.bfloat16), (8, mx.float32)) + (((3, mx.float16),) if full else ()):
            K = 2
            x = random_x(S, D, dtype=dtype)
            ids = mx.zeros((S, K), mx.int32)
            w = mx.ones((S, K), mx.float32)
            h = mx.zeros((S * K, inter), mx.float32)
            for nw in ((None, 2, 4) if full else (None, 2) if opt_in else (None,)):
                yield f"gate_up_fmt{fmt}_S{S}_{dtype}_nw{nw}", moe.gate_up_spec(x, group, ids, K, dispatch.CUDA, simdgroups=nw)
                yield f"down_fmt{fmt}_S{S}_nw{nw}", moe.down_spec(h, group, ids, w, S, K, dispatch.CUDA, simdgroups=nw)
            yield f"down_fmt{fmt}_S{S}_out{dtype}", moe.down_spec(h, group, ids, w, S, K, dispatch.CUDA, out_dtype=dtype)
            # 4 warps a block (DeepSeek-V3's 8 experts): one token's launch bounds (moe.CUDA_DOWN_MIN_BLOCKS)
            yield f"down_fmt{fmt}_S{S}_nw4", moe.down_spec(h, group, ids, w, S, K, dispatch.CUDA, simdgroups=4,
                                                          out_dtype=dtype)
            yield f"down_fmt{fmt}_S{S}_out{dtype}_res", moe.down_spec(h, group, ids, w, S, K, dispatch.CUDA,
                                                                     out_dtype=dtype, residual=random_x(S, D, dtype=dtype))
            # gate_up's PF 1 loop (prefetch=1: CUDA's default for one token)
            if opt_in:
                yield (f"gate_up_fmt{fmt}_S{S}_{dtype}_pf1",
                       moe.gate_up_spec(x, group, ids, K, dispatch.CUDA, prefetch=1))
            if S == 1 and fmt in (2, 4, 6):   # persistent grids (CUDA default for one token)
                yield f"down_fmt{fmt}_S1_pers", moe.down_spec(h, group, ids, w, S, K, dispatch.CUDA, simdgroups=4,
                                                             out_dtype=dtype, persistent=3)
                yield f"gate_up_fmt{fmt}_S1_pers", moe.gate_up_spec(x, group, ids, K, dispatch.CUDA, persistent=3)
                # the shape compiled in (shape_in=True, the default)
                yield f"down_fmt{fmt}_S1_shape", moe.down_spec(h, group, ids, w, S, K, dispatch.CUDA, simdgroups=4,
                                                              out_dtype=dtype, persistent=3, shape_in=True)
        if fmt == 4:   # a bank of uint32 words (layers past 2^31 bytes): the same bodies, a byte pointer
            saved, moe.MAX_BANK_BYTES = moe.MAX_BANK_BYTES, 1024
            try:
                words = moe.build_bank(experts).groups[0]
            finally:
                moe.MAX_BANK_BYTES = saved
            assert words.gate_up.packed.dtype == mx.uint32
            yield "gate_up_fmt4_words", moe.gate_up_spec(x, words, ids, K, dispatch.CUDA)
            yield "down_fmt4_words", moe.down_spec(h, words, ids, w, S, K, dispatch.CUDA)
    # The MLX formats' kernel FMT families, and GGUF decoders as gate/up and as down (every one
    # in both with ``full``, rotating; else the hot pairs Q4_K / Q6_K and IQ2_XXS / IQ4_XS, and
    # every other type once, paired in order: each decoder compiled in moe_block once): (gate/up
    # label, down label, 4 experts of 512 -> 256 -> 512, whether gate/up's persistent grid is a
    # default: qgemv.cuda_tuned).
    D, inter = 512, 256
    banks = [(f"mlx_{mode}{bits}g{gs}_{str(sdt).split('.')[-1]}",) * 2
             + ([tuple(random_mlx_qtensor(mode, bits, gs, O, I, sdt, seed=e + 10 * k)
                       for k, (O, I) in enumerate(((inter, D), (inter, D), (D, inter)))) for e in range(4)],
                bits <= 4)
             for mode, bits, gs, sdt in mlx_cases(full)]
    gguf = gguf_kernel_types()
    if full:
        pairs = list(zip(gguf, gguf[1:] + gguf[:1]))
    else:
        pairs = [("Q4_K", "Q6_K"), ("IQ2_XXS", "IQ4_XS")]
        rest = [name for name in gguf if name not in {n for p in pairs for n in p}]
        pairs += paired(rest, rest[0])
    banks += [(f"gguf_{gu}", f"gguf_{dn}",
               [(random_gguf_qtensor(gu, inter, D, seed=e), random_gguf_qtensor(gu, inter, D, seed=e + 10),
                 random_gguf_qtensor(dn, D, inter, seed=e + 20)) for e in range(4)], False)
              for gu, dn in pairs]
    for gu_label, dn_label, experts, pers in banks:
        (group,) = moe.build_bank(experts).groups
        for S, dtype in ((1, mx.bfloat16), (8, mx.float32)):
            K = 2
            x, ids, w = random_x(S, D, dtype=dtype), mx.zeros((S, K), mx.int32), mx.ones((S, K), mx.float32)
            h = mx.zeros((S * K, inter), mx.float32)
            yield f"gate_up_{gu_label}_S{S}", moe.gate_up_spec(x, group, ids, K, dispatch.CUDA)
            if S == 1 and pers:   # the shared resident blocks (qgemv.cuda_tuned formats)
                yield f"gate_up_{gu_label}_S1_pers", moe.gate_up_spec(x, group, ids, K, dispatch.CUDA, persistent=3)
            yield f"down_{dn_label}_S{S}", moe.down_spec(h, group, ids, w, S, K, dispatch.CUDA, out_dtype=dtype)
            if S == 1 and pers:   # 4 warps: fmt 4's launch bounds and persistent grid (moe.cuda_down_min_blocks)
                yield f"down_{dn_label}_S1_nw4", moe.down_spec(h, group, ids, w, S, K, dispatch.CUDA, simdgroups=4,
                                                              out_dtype=dtype)
    for n, dtype in ((7168, mx.bfloat16), (2048, mx.float32)):
        yield f"hadamard_{n}_{dtype}", moe.hadamard_spec(random_x(2, n, dtype=dtype), dispatch.CUDA)


def router_specs(full: bool):
    """router_scores / router_topk (kernels/router.py) for the DeepSeek-V3 and Kimi-K2 shapes,
    every x dtype, S = 1 and 8, with and without the shared slot."""
    from colibri_mlx.kernels import router

    cases = [(256, 7168, router.RouterConfig(8, 8, 4, True, 2.5)),
             (384, 7168, router.RouterConfig(8, 1, 1, True, 2.827))]
    if full:
        cases.append((20, 70, router.RouterConfig(3, 1, 1, False, 1.0)))
    for E, D, cfg in cases:
        w = mx.zeros((E, D), mx.float32)
        bias = mx.zeros((E,), mx.float32)
        for S, dtype in ((1, mx.bfloat16), (8, mx.float32), (3, mx.float16)):
            yield f"scores_E{E}_D{D}_S{S}_{dtype}", router.scores_spec(random_x(S, D, dtype=dtype), w, dispatch.CUDA)
        for shared in (None, E):
            yield (f"topk_E{E}_g{cfg.n_group}_shared{shared}",
                   router.topk_spec(mx.zeros((8, E), mx.float32), bias, cfg, shared, dispatch.CUDA))


def cuobjdump() -> str | None:
    """cuobjdump from PATH or the pip wheel nvidia-cuda-cuobjdump (no GPU needed)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia.cu13  # type: ignore  # the wheel's namespace package
        for base in nvidia.cu13.__path__:
            cand = Path(base) / "bin" / "cuobjdump"
            if cand.exists():
                return str(cand)
    except ImportError:
        pass
    return None


def sass_counts(sass: str) -> dict:
    """Opcode histogram of a SASS listing (the mnemonic without modifiers)."""
    counts: dict = {}
    for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def sass_loops(sass: str, min_len: int = 40) -> list:
    """(start, end, opcode histogram) of each backward-branch loop body of >= min_len
    instructions: the hot loops whose instruction mix per weight byte we budget."""
    ins = [(int(a, 16), op, line) for a, op, line in re.findall(
        r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?[A-Z][A-Z0-9_.]*)([^;]*);", sass)]
    loops = []
    for addr, op, rest in ins:
        m = re.search(r"BRA\b", op) and re.search(r"`?\(?\.L_x_\d+\)?|0x([0-9a-f]+)", rest)
        tgt = re.search(r"0x([0-9a-f]+)", rest) if m else None
        if tgt and int(tgt.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(tgt.group(1), 16) <= a <= addr]
            if len(body) >= min_len:
                hist: dict = {}
                for o in body:
                    k = o.split()[-1].split(".")[0]
                    hist[k] = hist.get(k, 0) + 1
                loops.append((int(tgt.group(1), 16), addr, hist))
    return loops


def sass_hot_path(sass: str, start: int, end: int) -> dict:
    """Opcode histogram of one trip through the loop [start, end] on its hot path: unconditional
    branches are followed, a conditional forward branch is taken only when the code it skips
    reads x element by element (LDG.E.U16 / U8: the bounds-tested tail of a row) and does no
    FFMA (so it is only that tail's x load, not a whole unit), otherwise it
    falls through (the "u < n_units" and "unit inside the row" tests hold in the bulk)."""
    ins = [(int(a, 16), op, rest) for a, op, rest in re.findall(
        r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?[A-Z][A-Z0-9_.]*)([^;]*);", sass)]
    index = {a: i for i, (a, _, _) in enumerate(ins)}
    hist: dict = {}
    i = index[start]
    steps = 0
    while i < len(ins) and steps < 100000:
        addr, op, rest = ins[i]
        steps += 1
        name = op.split()[-1]
        key = name.split(".")[0]
        hist[key] = hist.get(key, 0) + 1
        if addr == end:
            break
        if key == "BRA":
            tgt = int(re.search(r"0x([0-9a-f]+)", rest).group(1), 16)
            if tgt > addr and tgt in index:
                skipped = [o for a, o, _ in ins[i + 1:index[tgt]]]
                taken = not op.startswith("@") or (
                    any(re.search(r"LDG\.E\.(U16|U8)", o) for o in skipped)
                    and not any(o.split()[-1].startswith("FFMA") for o in skipped))
                if taken:
                    i = index[tgt]
                    continue
        i += 1
    return hist


class NVRTC:
    """MLX's own CUDA compiler, libnvrtc, through ctypes, with the options MLX's JIT passes
    (mlx/backend/cuda/jit_module.cpp: ``--device-as-default-execution-space``,
    ``--gpu-architecture=sm_90a`` on an H100/H200, include paths of the CUDA headers) and our
    stub of MLX's device header as an in-memory header. Found in the pip wheels
    ``nvidia-cuda-nvrtc`` (+ ``-runtime``, ``-cccl`` for cuda_fp16.h and cuda/std) or a CUDA
    toolkit; no GPU needed."""

    STUB_NAME = b"mlx/backend/cuda/device/utils.cuh"

    def __init__(self, lib_dir: Path, include_dirs: list):
        # libnvrtc dlopens its builtins library by name: load it first, globally.
        builtins = sorted(lib_dir.glob("libnvrtc-builtins.so.*"))
        ctypes.CDLL(str(builtins[0]), mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(str(sorted(lib_dir.glob("libnvrtc.so.*"))[0]))
        self.include_dirs = include_dirs
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = f"{major.value}.{minor.value}"

    @classmethod
    def find(cls) -> "NVRTC | None":
        roots = []
        try:
            import nvidia

            roots += [Path(p) / sub for p in nvidia.__path__ for sub in ("cu13", "cuda_nvrtc", "cu12")]
        except ImportError:
            pass
        cuda_home = Path(shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc").resolve().parents[1]
        roots += [cuda_home, Path("/usr/local/cuda")]
        for root in roots:
            found = [d for d in (root / "lib", root / "lib64")
                     if any(d.glob("libnvrtc.so.*")) and any(d.glob("libnvrtc-builtins.so.*"))]
            include = root / "include"
            if found and (include / "cuda_fp16.h").exists():   # headers of the same release
                return cls(found[0], [include] + ([include / "cccl"] if (include / "cccl").is_dir() else []))
        return None

    def compile(self, source: str, name: str, ptxas: bool = False) -> tuple[bool, str, bytes]:
        """``(ok, log, cubin)``; with ``ptxas`` the log has ptxas's register and spill report."""
        lib = self.lib
        prog = ctypes.c_void_p()
        stub = UTILS_STUB.replace("#include <cstdint>", "#include <cuda/std/cstdint>")
        headers = (ctypes.c_char_p * 1)(stub.encode())
        names = (ctypes.c_char_p * 1)(self.STUB_NAME)
        if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 1, headers, names):
            return False, "nvrtcCreateProgram failed", b""
        try:
            opts = [b"--device-as-default-execution-space", f"--gpu-architecture={ARCH}".encode()]
            opts += [f"--include-path={d}".encode() for d in self.include_dirs]
            if ptxas:
                opts.append(b"--ptxas-options=-v")
            rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            cubin = b""
            if rc == 0:
                lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
                buf = ctypes.create_string_buffer(size.value)
                lib.nvrtcGetCUBIN(prog, buf)
                cubin = buf.raw
            return rc == 0, log.value.decode(errors="replace"), cubin
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def object_name(label: str) -> str:
    return "custom_kernel_" + re.sub(r"\W", "_", label)


def compile_one(label: str, spec, work: Path, ptxas: bool, nvrtc: "NVRTC | None" = None) -> tuple[bool, str]:
    """Compile one launch's translation unit (kept as ``work/<name>.cu``) with NVRTC when given
    (the object is ``<name>.cubin``), else nvcc (``<name>.o``; ``work`` from :func:`prepare_workdir`)."""
    name = object_name(label)
    src = work / f"{name}.cu"
    src.write_text(wrap(spec, name))
    if nvrtc is not None:
        ok, log, cubin = nvrtc.compile(src.read_text(), name, ptxas)
        if ok:
            src.with_suffix(".cubin").write_bytes(cubin)
        return ok, log
    cmd = ["nvcc", f"-arch={ARCH}", "-std=c++17", "-I", str(work / "include"), "-c", str(src),
           "-o", str(src.with_suffix(".o"))]
    if ptxas:
        cmd += ["-Xptxas", "-v"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    return res.returncode == 0, res.stderr


def ptxas_report(log: str) -> dict:
    """Registers, spill-store bytes and stack frame bytes from ptxas -v output (last function)."""
    out = {}
    for key, pattern in (("regs", r"Used (\d+) registers"), ("spill", r"(\d+) bytes spill stores"),
                         ("stack", r"(\d+) bytes stack frame")):
        found = re.findall(pattern, log)
        out[key] = int(found[-1]) if found else None
    return out


def prepare_workdir(work: Path) -> Path:
    """``work`` with the stub of MLX's device header the wrapper includes (nvcc reads it there)."""
    (work / "include/mlx/backend/cuda/device").mkdir(parents=True, exist_ok=True)
    (work / "include/mlx/backend/cuda/device/utils.cuh").write_text(UTILS_STUB)
    return work


FAMILIES = {"qgemv": qgemv_specs, "moe": moe_specs, "mla": mla_specs, "router": router_specs}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="also odd shapes and tuning variants")
    ap.add_argument("--ptxas", action="store_true", help="report registers and spills")
    ap.add_argument("--keep", type=Path, help="keep the generated sources here")
    ap.add_argument("--only", nargs="*", default=tuple(FAMILIES),
                    help="kernel families to compile (qgemv moe mla router)")
    ap.add_argument("--sass", action="store_true",
                    help="write <label>.sass next to each object (cuobjdump -sass) and print "
                         "its opcode histogram; implies --keep into a temp dir if none given")
    ap.add_argument("--match", default="", help="only labels containing this substring")
    ap.add_argument("--compiler", choices=("auto", "nvrtc", "nvcc"), default="auto",
                    help="nvrtc (what MLX compiles with; default when found) or nvcc")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles at once")
    args = ap.parse_args()
    nvrtc = NVRTC.find() if args.compiler in ("auto", "nvrtc") else None
    if nvrtc is None and args.compiler == "nvrtc":
        print("compile_cuda_twins: libnvrtc not found (pip install nvidia-cuda-nvrtc nvidia-cuda-runtime "
              "nvidia-cuda-cccl)")
        return 2
    if nvrtc is None and shutil.which("nvcc") is None:
        print("compile_cuda_twins: neither libnvrtc nor nvcc found")
        return 2
    print(f"compile_cuda_twins: {'NVRTC ' + nvrtc.version if nvrtc else 'nvcc'}, {ARCH}", flush=True)
    work = prepare_workdir(Path(args.keep or tempfile.mkdtemp(prefix="cuda_twins_")))
    specs = [(f"{fam} {label}", spec) for fam in args.only for label, spec in FAMILIES[fam](args.all)
             if args.match in f"{fam} {label}"]
    dump = cuobjdump() if args.sass else None
    if args.sass and dump is None:
        print("compile_cuda_twins: --sass needs cuobjdump (pip install nvidia-cuda-cuobjdump)")
        return 2
    n_fail = 0
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:     # NVRTC and nvcc run outside the GIL
        results = pool.map(lambda ls: compile_one(ls[0], ls[1], work, args.ptxas, nvrtc), specs)
        for (label, _), (ok, err) in zip(specs, results):
            n_fail += not ok
            info = ""
            if args.ptxas:
                r = ptxas_report(err)
                info = f" regs {r['regs']} spill-stores {r['spill']} stack {r['stack']}"
            print(f"{'OK  ' if ok else 'FAIL'} {label}{info}", flush=True)
            if ok and dump:
                print_sass(dump, work / (object_name(label) + (".cubin" if nvrtc else ".o")))
            if not ok:
                print(err)
    print(f"compile_cuda_twins: {n_fail} failed (sources in {work})")
    if not args.keep and not n_fail and not args.sass:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if n_fail else 0


def print_sass(dump: str, obj: Path) -> None:
    sass = subprocess.run([dump, "-sass", str(obj)], capture_output=True, text=True).stdout
    obj.with_suffix(".sass").write_text(sass)
    hist = sorted(sass_counts(sass).items(), key=lambda kv: -kv[1])
    print("     SASS " + " ".join(f"{k}:{v}" for k, v in hist[:24]) + f"  -> {obj.with_suffix('.sass')}")
    for start, end, _ in sass_loops(sass):
        h = sass_hot_path(sass, start, end)
        top = " ".join(f"{k}:{v}" for k, v in sorted(h.items(), key=lambda kv: -kv[1])[:16])
        print(f"     loop {start:#x}-{end:#x} hot path: {sum(h.values())} instr  {top}")


if __name__ == "__main__":
    sys.exit(main())

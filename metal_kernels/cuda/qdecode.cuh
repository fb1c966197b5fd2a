// qdecode.cuh: CUDA twin of metal_kernels/qdecode.h (same names without the qd_ prefix, in
// namespace colibri_qd; same algorithm): the fmt 0-6 and MLX-format unit loads, exact decoders and segment
// dot products shared by qgemv, moe_block and mla_decode. The Python side prepends this file
// to each kernel's own header (dispatch.decode_header). MLX compiles with NVRTC and
// --device-as-default-execution-space; helpers still say __device__ so nvcc accepts them
// (scripts/kernels/compile_cuda_twins.py).

namespace colibri_qd {

// MLX formats: affine 70 + bits / 80 + bits / 90 + bits (bfloat16 / float16 / float32 scales),
// 8 mxfp4, 9 nvfp4, 10 mxfp8 (qdecode.h). GGUF block formats (fmt 11-28): gguf_decode.cuh, in
// front of this file.
__device__ constexpr bool mlx(int fmt) {
  return (fmt >= 8 && fmt <= 10) || fmt >= 70;
}
__device__ constexpr bool affine(int fmt) {
  return fmt >= 70;
}
__device__ constexpr int mlx_bits(int fmt) {
  return fmt >= 70 ? fmt % 10 : (fmt == 10 ? 8 : 4);
}

// FMT 60: bfloat16 rows (qdecode.h QD_BF16_ROWS).
__device__ constexpr int BF16_ROWS = 60;

__device__ constexpr int wpu(int fmt) {
  return gguf(fmt) ? gg_wpu(fmt) : fmt == 0 ? 8 : ((fmt == 1 || fmt == BF16_ROWS) ? 16 : (fmt == 3 ? 64 : (fmt == 5 ? 64 : 32)));
}

__device__ constexpr int words(int fmt) {
  return gguf(fmt) ? gg_words(fmt) : (fmt == 0 || fmt == BF16_ROWS) ? 8 : (mlx(fmt) ? mlx_bits(fmt) + (fmt >= 90 ? 2 : 1) : 6);
}

__device__ constexpr int seg(int fmt, int gs) {
  return gguf(fmt) ? gg_seg(fmt) : ((fmt == 4 && gs % 32 != 0) || fmt == 9) ? 16 : wpu(fmt);
}

// VEC 2 (rows a multiple of 16 bytes) reads a unit with one 16-byte load when the buffer
// itself is 16-byte aligned (W16, checked once per launch: a row slice may be 8-aligned only).
template <int FMT, int VEC, bool W16>
__device__ __forceinline__ void load(const uint8_t* wrow, int rb, int u, uint32_t* r) {
  if (FMT == 0 || FMT == BF16_ROWS) {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(wrow) + 8 * u;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      r[k] = (32 * u + 4 * k < rb) ? p[k] : 0u;
    }
  } else if (FMT == 5) {
    const uint2* p = reinterpret_cast<const uint2*>(wrow + 24 * u);
    const uint2 a = p[0];
    const uint2 b = p[1];
    const uint2 c = p[2];
    r[0] = a.x; r[1] = a.y; r[2] = b.x; r[3] = b.y; r[4] = c.x; r[5] = c.y;
  } else if (FMT == 6) {
    const int blk = 98 * (u >> 3);
    const int ib = u & 7;
    const unsigned short* qs = reinterpret_cast<const unsigned short*>(wrow + blk + 8 * ib);
    const unsigned short* sw = reinterpret_cast<const unsigned short*>(wrow + blk + 64 + 4 * ib);
    const unsigned short* dd = reinterpret_cast<const unsigned short*>(wrow + blk + 96);
    r[0] = uint32_t(qs[0]) | (uint32_t(qs[1]) << 16);
    r[1] = uint32_t(qs[2]) | (uint32_t(qs[3]) << 16);
    r[2] = uint32_t(sw[0]) | (uint32_t(sw[1]) << 16);
    r[3] = uint32_t(dd[0]);
  } else if (gguf(FMT)) {
    // Q4_K rows are a multiple of 144 = 9 x 16 bytes: a 16-byte aligned buffer keeps them aligned.
    gg_load<FMT, W16 && FMT == 17>(wrow, u, r);
  } else if (mlx(FMT)) {
    constexpr int B = mlx_bits(FMT);
    if ((B == 4 || B == 8) && W16 && (rb & 15) == 0) {
      // 4- and 8-bit units are 16 / 32 bytes: whole 16-byte loads when rows keep the alignment.
      const uint4* p = reinterpret_cast<const uint4*>(wrow) + (B / 4) * u;
#pragma unroll
      for (int m = 0; m < B / 4; ++m) {
        const uint4 v = p[m];
        r[4 * m] = v.x; r[4 * m + 1] = v.y; r[4 * m + 2] = v.z; r[4 * m + 3] = v.w;
      }
    } else {
      const uint32_t* p = reinterpret_cast<const uint32_t*>(wrow) + B * u;
#pragma unroll
      for (int k = 0; k < B; ++k) {
        r[k] = p[k];
      }
    }
  } else if (VEC == 2 && W16) {
    const uint4 v = *reinterpret_cast<const uint4*>(wrow + 16 * u);
    r[0] = v.x; r[1] = v.y; r[2] = v.z; r[3] = v.w;
  } else if (VEC) {
    const uint2* p = reinterpret_cast<const uint2*>(wrow + 16 * u);
    const uint2 a = p[0];
    const uint2 b = (VEC == 2 || 16 * u + 8 < rb) ? p[1] : make_uint2(0u, 0u);
    r[0] = a.x; r[1] = a.y; r[2] = b.x; r[3] = b.y;
  } else {
    const int off = 16 * u;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      uint32_t v = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (off + 4 * m + k < rb) {
          v |= uint32_t(wrow[off + 4 * m + k]) << (8 * k);
        }
      }
      r[m] = v;
    }
  }
}

template <int FMT, int GS>
__device__ __forceinline__ void load_aux(const float* scales, int row, int ng, int u, uint32_t* r) {
  constexpr int B = mlx_bits(FMT);
  if (affine(FMT)) {
    const uint32_t* sw = reinterpret_cast<const uint32_t*>(scales) + row * ng;
    if (FMT >= 90) {
      const int gi = 2 * ((32 * u) / GS);
      r[B] = sw[gi];
      r[words(FMT) - 1] = sw[gi + 1];
    } else {
      r[B] = sw[(32 * u) / GS];
    }
  } else if (FMT == 8 || FMT == 10) {
    r[B] = uint32_t(reinterpret_cast<const uint8_t*>(scales)[4 * row * ng + u]);
  } else if (FMT == 9) {
    const uint8_t* sb = reinterpret_cast<const uint8_t*>(scales) + 4 * row * ng + 2 * u;
    r[B] = uint32_t(sb[0]) | (uint32_t(sb[1]) << 8);
  }
}

// Bits of a half as float (exact).
__device__ __forceinline__ float half_bits(uint32_t h) {
  return __half2float(__ushort_as_half((unsigned short)h));
}

__device__ __forceinline__ float e4m3(uint32_t c) {
  return half_bits(((c & 0x80u) << 8) | ((c & 0x7Fu) << 7)) * 256.0f;
}

// E8M0 byte e as MLX reads it (e = 0: 2^-127) times 2^P; e = 0 as the normal float 2^(P - 127)
// (qdecode.h qd_e8m0_times).
template <int P>
__device__ __forceinline__ float e8m0_times(uint32_t e) {
  return e == 0u ? __uint_as_float(uint32_t(P) << 23) : __uint_as_float(e << 23) * float(1u << P);
}

template <int FMT, int GS>
__device__ __forceinline__ float seg_scale(const float* scales, int row, int ng, int u, int g,
                                           const uint32_t* r) {
  if (FMT == 8) {
    return e8m0_times<14>(r[4] & 0xFFu);
  } else if (FMT == 9) {
    return e4m3((r[4] >> (8 * g)) & 0xFFu) * 16384.0f;
  } else if (FMT == 10) {
    return e8m0_times<8>(r[8] & 0xFFu);
  } else if (FMT == 4) {
    return scales[row * ng + min((32 * u + seg(FMT, GS) * g) / GS, ng - 1)];
  } else if (FMT == 5) {
    return scales[row * ng + u];
  } else if (FMT == 6) {
    const float d = __half2float(__ushort_as_half((unsigned short)r[3]));
    return d * (0.5f + float(r[2] >> 28)) * 0.25f;
  }
  return 1.0f;
}

// fmt 4/5 read their segment scales from memory: the kernels load them in the same phase as
// the weights (so the latency overlaps); fmt 6 decodes its scale from the unit's own bytes.
__device__ constexpr bool scales_in_memory(int fmt) {
  return fmt == 4 || fmt == 5;
}

template <int FMT>
__device__ __forceinline__ float row_scale(const float* scales, int row) {
  return (FMT >= 1 && FMT <= 3) ? scales[row] : 1.0f;
}

// 2^23 + c built in the mantissa, minus (2^23 + offset): c - offset exactly, at full FMA rate.
__device__ __forceinline__ float code(uint32_t c, float magic_plus_offset) {
  return __uint_as_float(0x4B000000u | c) - magic_plus_offset;
}

__device__ __forceinline__ __half2 as_half2(uint32_t v) {
  __half2 h;
  memcpy(&h, &v, 4);
  return h;
}

// (b & MASK) | MAGIC as one LOP3: written in C, nvcc emits an AND and an OR (a SASS LOP3 takes
// one immediate), a quarter more instructions in the fmt 2/4 inner loop.
template <uint32_t MASK, uint32_t MAGIC>
__device__ __forceinline__ uint32_t and_or(uint32_t b) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(b), "n"(MASK), "n"(MAGIC));
  return r;
}

// Nibbles n at bits 0 and 16 of b (lo) or 4 and 20 (hi), as the floats n - 8 (exact: half
// 1024 + n minus 1032; half 1024 + 16n times 1/16 minus 72).
__device__ __forceinline__ float2 nib_lo(uint32_t b) {
  return __half22float2(__hsub2(as_half2(and_or<0x000F000Fu, 0x64006400u>(b)),
                                __float2half2_rn(1032.0f)));
}
__device__ __forceinline__ float2 nib_hi(uint32_t b) {
  return __half22float2(__hfma2(as_half2(and_or<0x00F000F0u, 0x64006400u>(b)),
                                __float2half2_rn(0.0625f), __float2half2_rn(-72.0f)));
}

// An affine unit's scale and bias (one group: units never straddle groups) from its scale
// words: bfloat16 / float16 halves of one word, or two float32 words.
template <int FMT>
__device__ __forceinline__ void affine_scale_bias(const uint32_t* r, float& sc, float& bi) {
  constexpr int B = mlx_bits(FMT);
  const uint32_t sb = r[B];
  sc = FMT >= 90 ? __uint_as_float(sb) : (FMT >= 80 ? half_bits(sb & 0xFFFFu) : __uint_as_float(sb << 16));
  bi = FMT >= 90 ? __uint_as_float(r[words(FMT) - 1])
                 : (FMT >= 80 ? half_bits(sb >> 16) : __uint_as_float(sb & 0xFFFF0000u));
}

// The 8 unsigned codes k0 .. k0 + 7 of an affine unit as exact floats, from one 64-bit window of
// the bit stream (8 * bits bits starting at bit 8 * bits * (k0 / 8): shift + 8 * bits <= 64).
template <int FMT>
__device__ __forceinline__ void affine_codes8(const uint32_t* r, int k0, float* q) {
  constexpr int B = mlx_bits(FMT);
  const int off = k0 * B;
  const unsigned long long v =
      ((unsigned long long)r[off >> 5] | ((unsigned long long)r[(off >> 5) + 1] << 32)) >> (off & 31);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    q[k] = code(uint32_t(v >> (B * k)) & ((1u << B) - 1u), 8388608.0f);
  }
}

template <int FMT>
__device__ __forceinline__ void decode8(const uint32_t* r, int k0, const uint32_t* e8grid, float* q) {
  if (gguf(FMT)) {
    gg_decode8<FMT>(r, k0, e8grid, q);
  } else if (FMT == 0) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      q[k] = __uint_as_float(r[k0 + k]);
    }
  } else if (FMT == BF16_ROWS) {
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
      const uint32_t w = r[(k0 + k) >> 1];
      q[k] = __uint_as_float(w << 16);
      q[k + 1] = __uint_as_float(w & 0xFFFF0000u);
    }
  } else if (FMT == 1) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      q[k] = code(((r[(k0 + k) >> 2] >> (8 * (k & 3))) & 0xFFu) ^ 0x80u, 8388736.0f);
    }
  } else if (FMT == 2 || FMT == 4) {
    const uint32_t b = r[k0 >> 3];
    const float2 n04 = nib_lo(b);
    const float2 n15 = nib_hi(b);
    const float2 n26 = nib_lo(b >> 8);
    const float2 n37 = nib_hi(b >> 8);
    q[0] = n04.x; q[1] = n15.x; q[2] = n26.x; q[3] = n37.x;
    q[4] = n04.y; q[5] = n15.y; q[6] = n26.y; q[7] = n37.y;
  } else if (FMT == 3) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      q[k] = code((r[(k0 + k) >> 4] >> (2 * ((k0 + k) & 15))) & 3u, 8388610.0f);
    }
  } else if (FMT == 5) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int i = k0 + k;
      const uint32_t lo = (r[i >> 4] >> (2 * (i & 15))) & 3u;
      const uint32_t hi = (r[4 + (i >> 5)] >> (i & 31)) & 1u;
      q[k] = code(lo | (hi << 2), 8388612.0f);
    }
  } else if (affine(FMT)) {
    float sc, bi;
    affine_scale_bias<FMT>(r, sc, bi);
    affine_codes8<FMT>(r, k0, q);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      q[k] = fmaf(q[k], sc, bi);
    }
  } else if (FMT == 8 || FMT == 9) {
    // E2M1 nibbles k and k + 4 of a word lie 16 bits apart: each pair becomes one half2 (the
    // value * 2^-14: sign to bit 15, the 3 magnitude bits to bits 9-11) and one conversion.
    const uint32_t b = r[k0 >> 3];
    const float2 v04 = __half22float2(as_half2(((b & 0x00080008u) << 12) | ((b & 0x00070007u) << 9)));
    const float2 v15 = __half22float2(as_half2(((b & 0x00800080u) << 8) | ((b & 0x00700070u) << 5)));
    const float2 v26 = __half22float2(as_half2(((b & 0x08000800u) << 4) | ((b & 0x07000700u) << 1)));
    const float2 v37 = __half22float2(as_half2((b & 0x80008000u) | ((b & 0x70007000u) >> 3)));
    q[0] = v04.x; q[1] = v15.x; q[2] = v26.x; q[3] = v37.x;
    q[4] = v04.y; q[5] = v15.y; q[6] = v26.y; q[7] = v37.y;
  } else if (FMT == 10) {
    // E4M3 bytes 0/2 and 1/3 of a word as half2 pairs (the value * 2^-8).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t b = r[(k0 >> 2) + h];
      const float2 v02 = __half22float2(as_half2(((b & 0x00800080u) << 8) | ((b & 0x007F007Fu) << 7)));
      const float2 v13 = __half22float2(as_half2((b & 0x80008000u) | ((b & 0x7F007F00u) >> 1)));
      q[4 * h] = v02.x; q[4 * h + 1] = v13.x; q[4 * h + 2] = v02.y; q[4 * h + 3] = v13.y;
    }
  } else if (FMT == 6) {
    const int l = k0 >> 3;
    const uint32_t seven = (r[2] >> (7 * l)) & 0x7Fu;
    const uint32_t s8 = seven | ((uint32_t(__popc(seven)) & 1u) << 7);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int b = 2 * l + h;
      const uint32_t g = e8grid[(r[b >> 2] >> (8 * (b & 3))) & 0xFFu];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float mag = code((g >> (8 * j)) & 0xFFu, 8388608.0f);
        q[4 * h + j] = __uint_as_float(__float_as_uint(mag) ^ (((s8 >> (4 * h + j)) & 1u) << 31));
      }
    }
  }
}

// Eight consecutive values as raw 16-byte words (one uint4 for 2-byte types, two for float),
// widened to float separately: a caller that wants the loads in flight across other work
// (mla_attn_mma's next chunk) keeps the words and widens them later.
__device__ __forceinline__ void load8_raw(const float* p, uint4* w) {
  w[0] = *reinterpret_cast<const uint4*>(p);
  w[1] = *reinterpret_cast<const uint4*>(p + 4);
}
__device__ __forceinline__ void load8_raw(const __half* p, uint4* w) {
  w[0] = *reinterpret_cast<const uint4*>(p);
}
__device__ __forceinline__ void load8_raw(const __nv_bfloat16* p, uint4* w) {
  w[0] = *reinterpret_cast<const uint4*>(p);
}

// The words of load8_raw as float; the pointer argument only selects the type.
__device__ __forceinline__ void widen8(const uint4* w, float* o, const float*) {
  const uint32_t v[8] = {w[0].x, w[0].y, w[0].z, w[0].w, w[1].x, w[1].y, w[1].z, w[1].w};
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    o[k] = __uint_as_float(v[k]);
  }
}
__device__ __forceinline__ void widen8(const uint4* w, float* o, const __half*) {
  const uint32_t v[4] = {w[0].x, w[0].y, w[0].z, w[0].w};
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const float2 f = __half22float2(as_half2(v[m]));
    o[2 * m] = f.x;
    o[2 * m + 1] = f.y;
  }
}
__device__ __forceinline__ void widen8(const uint4* w, float* o, const __nv_bfloat16*) {
  const uint32_t v[4] = {w[0].x, w[0].y, w[0].z, w[0].w};
#pragma unroll
  for (int m = 0; m < 4; ++m) {       // bfloat16 is the top half of a float32: a shift or a mask
    o[2 * m] = __uint_as_float(v[m] << 16);
    o[2 * m + 1] = __uint_as_float(v[m] & 0xFFFF0000u);
  }
}

// Eight consecutive x values as float from one or two 16-byte loads.
template <typename T>
__device__ __forceinline__ void load_x8(const T* p, float* o) {
  uint4 w[2];
  load8_raw(p, w);
  widen8(w, o, p);
}

// x[i .. i + 7] of one row of x as float, zero past I. XV 1: the row starts 16-byte aligned;
// XV 2: also i + 8 <= I is known (the caller checked its whole unit), no per-8 test.
template <int XV, typename T>
__device__ __forceinline__ void x8(const T* xs, int I, int i, float* o) {
  if (XV == 2 || (XV && i + 8 <= I)) {
    load_x8(xs + i, o);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      o[k] = (i + k < I) ? static_cast<float>(xs[i + k]) : 0.0f;
    }
  }
}

// The layout moe_gate_up writes h in for moe_down (XP 1): a row of I floats padded to whole
// units of WPU, stored in 4-value (16-byte) chunks ordered (chunk within the unit, unit), so
// the lanes of a warp, which read consecutive units, read consecutive 16 bytes (row order
// makes each lane's 16 bytes a separate cache line: 8x the L1 wavefronts per value).
template <int WPU>
__device__ __forceinline__ int xp_index(int I, int i) {
  const int nu = (I + WPU - 1) / WPU;
  const int u = i / WPU;
  const int r = i - WPU * u;
  return ((r >> 2) * nu + u) * 4 + (r & 3);
}

// x[i .. i + 7] (i = WPU * u + k0, k0 a multiple of 8) of one row of x as float, zero past I.
// XP 0: the row in order (x8); XP 1: xp_index's layout, x float.
template <int XV, int XP, int WPU, typename T>
__device__ __forceinline__ void xs8(const T* xs, int I, int u, int k0, float* o) {
  const int i = WPU * u + k0;
  if (XP) {
    const int nu = (I + WPU - 1) / WPU;
    const float* p0 = reinterpret_cast<const float*>(xs) + ((k0 >> 2) * nu + u) * 4;
    const float* p1 = p0 + 4 * nu;
    if (XV == 2 || (XV && i + 8 <= I)) {
      const float4 a = *reinterpret_cast<const float4*>(p0);
      const float4 b = *reinterpret_cast<const float4*>(p1);
      o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
      o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        o[k] = (i + k < I) ? p0[k] : 0.0f;
        o[4 + k] = (i + 4 + k < I) ? p1[k] : 0.0f;
      }
    }
  } else {
    x8<XV, T>(xs, I, i, o);
  }
}

// fmt 2/4 codes n (= value + 8) of the 8 nibbles of b as exact fp16 subnormals: b AND 0x000F000F
// is the half2 (n0, n4) * 2^-24, AND 0x00F000F0 is (16 n1, 16 n5) * 2^-24 (bit patterns below
// 2^11 are linear in the value), one exact conversion each to float. No magic OR, no bias op:
// q[k] = n_k 2^-24 (k even), 16 n_k 2^-24 (k odd); seg_dots_sum_x applies 2^24, 1/16 and -8.
__device__ __forceinline__ void nib8_sub(uint32_t b, float* q) {
  const uint32_t b8 = b >> 8;
  const float2 f04 = __half22float2(as_half2(b & 0x000F000Fu));
  const float2 f15 = __half22float2(as_half2(b & 0x00F000F0u));
  const float2 f26 = __half22float2(as_half2(b8 & 0x000F000Fu));
  const float2 f37 = __half22float2(as_half2(b8 & 0x00F000F0u));
  q[0] = f04.x; q[1] = f15.x; q[2] = f26.x; q[3] = f37.x;
  q[4] = f04.y; q[5] = f15.y; q[6] = f26.y; q[7] = f37.y;
}

// seg_dots over exact unscaled codes q and sum x, once per segment for all ROWS rows, then
// d = s (sum q x) + b (sum x) a row:
// * fmt 2/4 (NIB 1): sum (n - 8) x, s = 1, b = -8, nibble codes n from nib8_sub;
// * the MLX affine formats: sum (q s + b) x over a segment (one unit, inside one group), s and b
//   the group's; with NIB 1 4-bit codes from nib8_sub (MLX packs nibbles LSB-first as fmt 4), else
//   from affine_codes8: two FFMAs a segment for scale and bias instead of one a weight.
// nib8_sub's codes are n 2^-24 (even k) and 16 n 2^-24 (odd k): two FFMA chains, lo / hi, scaled
// by 2^24 and 2^20 at the end. Each product is one rounding; the b sum x step adds an error of a
// few 2^-24 of |b| sum |x| (the kernel tests bound |delta| by 1e-4 sum |x w|).
template <int FMT, int GS, int S, int ROWS, int XV, int W, typename T, int NIB, int XP = 0>
__device__ __forceinline__ void seg_dots_sum_x(const uint32_t (*raw)[W], const T* x,
                                               const int* xoff, uint32_t xmask, int I, int u,
                                               int g, float (*d)[S]) {
  constexpr int WPU = wpu(FMT);
  constexpr int SEG = seg(FMT, GS);
  constexpr bool NIBBLES = !affine(FMT) || (NIB && mlx_bits(FMT) == 4);
  float lo[ROWS][S];
  float hi[ROWS][S];
  float sx[S];
#pragma unroll
  for (int s = 0; s < S; ++s) {
    sx[s] = 0.0f;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      lo[r][s] = 0.0f;
      hi[r][s] = 0.0f;
    }
  }
#pragma unroll
  for (int c = 0; c < SEG; c += 8) {
    const int k0 = SEG * g + c;
    float q[ROWS][8];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (NIBBLES) {
        nib8_sub(raw[r][k0 >> 3], q[r]);
      } else {
        affine_codes8<FMT>(raw[r], k0, q[r]);
      }
    }
#pragma unroll
    for (int s = 0; s < S; ++s) {
      if ((xmask >> s) & 1u) {
        float xf[8];
        xs8<XV, XP, WPU, T>(x + xoff[s], I, u, k0, xf);
        sx[s] += ((xf[0] + xf[1]) + (xf[2] + xf[3])) + ((xf[4] + xf[5]) + (xf[6] + xf[7]));
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
#pragma unroll
          for (int k = 0; k < 8; k += 2) {
            lo[r][s] += q[r][k] * xf[k];
            hi[r][s] += q[r][k + 1] * xf[k + 1];
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float sc = 1.0f;
    float bi = -8.0f;
    if (affine(FMT)) {
      affine_scale_bias<FMT>(raw[r], sc, bi);
    }
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const float qx = NIBBLES ? fmaf(hi[r][s], 1048576.0f, lo[r][s] * 16777216.0f) : lo[r][s] + hi[r][s];
      d[r][s] = fmaf(bi, sx[s], qx * sc);
    }
  }
}

// d[r][s] = sum over segment g of unit u of row r of code * x[xoff[s] + i] (unscaled), for the
// rows of x whose bit is set in xmask (the others stay 0). NIB 1: fmt 2/4 via seg_dots_sum_x
// (fp16 subnormal codes, one bias per segment); NIB 0: decode8's magic-number codes. XP 1: x
// rows in xp_index's layout (float).
template <int FMT, int GS, int S, int ROWS, int XV, int W, typename T, int NIB = 0, int XP = 0>
__device__ __forceinline__ void seg_dots(const uint32_t (*raw)[W], const T* x, const int* xoff,
                                         uint32_t xmask, int I, int u, int g,
                                         const uint32_t* e8grid, float (*d)[S]) {
  constexpr int WPU = wpu(FMT);
  constexpr int SEG = seg(FMT, GS);
  if ((NIB && (FMT == 2 || FMT == 4)) || affine(FMT)) {
    seg_dots_sum_x<FMT, GS, S, ROWS, XV, W, T, NIB, XP>(raw, x, xoff, xmask, I, u, g, d);
    return;
  }
  if (gguf(FMT)) {
    seg_dots_gguf<FMT, S, ROWS, XV, W, T, XP, NIB>(raw, x, xoff, xmask, I, u, g, e8grid, d);
    return;
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      d[r][s] = 0.0f;
    }
  }
#pragma unroll
  for (int c = 0; c < SEG; c += 8) {
    const int k0 = SEG * g + c;
    float q[ROWS][8];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      decode8<FMT>(raw[r], k0, e8grid, q[r]);
    }
#pragma unroll
    for (int s = 0; s < S; ++s) {
      if ((xmask >> s) & 1u) {
        float xf[8];
        xs8<XV, XP, WPU, T>(x + xoff[s], I, u, k0, xf);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            d[r][s] += q[r][k] * xf[k];
          }
        }
      }
    }
  }
}

// Split-K epilogue: each warp sums its lanes' acc[r][s]; lane 0 stores the warp's partials at
// red[(warp * ROWS + r) * S + s] for the caller to add after a barrier.
template <int ROWS, int S>
__device__ __forceinline__ void warp_partials(float (*acc)[S], float* red, int warp, int lane) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        acc[r][s] += __shfl_xor_sync(0xffffffffu, acc[r][s], off);
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
      for (int s = 0; s < S; ++s) {
        red[(warp * ROWS + r) * S + s] = acc[r][s];
      }
    }
  }
}

}  // namespace colibri_qd


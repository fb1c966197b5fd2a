// gguf_decode.cuh: CUDA twin of metal_kernels/gguf_decode.h (same names without the qd_ prefix,
// in namespace colibri_qd; same unit layouts, algorithm and comments there): unit loads and exact
// decoders of llama.cpp's GGUF block formats (fmt 11-28). dispatch.decode_header puts this file in
// front of qdecode.cuh, whose wpu / words / seg / load / decode8 / seg_dots hand the GGUF fmts to
// the functions here.

namespace colibri_qd {

// Word offsets in the lookup-table input (gguf_decode.h; kernels/gguf_decode.py LOOKUP_LAYOUT).
__device__ constexpr int GG_IQ2XXS = 256;
__device__ constexpr int GG_IQ4NL = 768;
__device__ constexpr int GG_IQ3S = 784;
__device__ constexpr int GG_IQ2XS = 1296;
__device__ constexpr int GG_IQ2S = 2320;
__device__ constexpr int GG_IQ1S = 4368;

__device__ constexpr bool gguf(int fmt) {
  return fmt >= 11 && fmt <= 28;
}

__device__ constexpr int gg_wpu(int fmt) {
  return fmt == 17 ? 64 : 32;
}

__device__ constexpr int gg_words(int fmt) {
  return (fmt == 15 || fmt == 16 || fmt == 17 || fmt == 18) ? 10
         : (fmt == 11 || fmt == 19) ? 9
         : (fmt == 13 || fmt == 14) ? 6
         : (fmt == 12 || fmt == 20 || fmt == 21) ? 5
         : (fmt == 22 || fmt == 23) ? 4
         : fmt == 27 ? 2 : 3;
}

__device__ constexpr int gg_seg(int fmt) {
  return (fmt == 15 || fmt == 16 || fmt == 19 || fmt == 25 || fmt == 26 || fmt == 28) ? 16 : 32;
}

__device__ constexpr bool gg_has_bias(int fmt) {
  return fmt == 14 || fmt == 15 || fmt == 17 || fmt == 18;
}

// The decoders: dispatch.decode_header keeps the text above and replaces what follows this line
// with gguf_stub.cuh for launches of the other formats.
// ==== GGUF decoders ====

// qdecode.cuh's x loads (defined there, after this file).
template <int XV, int XP, int WPU, typename T>
__device__ __forceinline__ void xs8(const T* xs, int I, int u, int k0, float* o);


__device__ __forceinline__ uint32_t gg_u8(const uint8_t* p) {
  return uint32_t(p[0]);
}
__device__ __forceinline__ uint32_t gg_u16(const uint8_t* p) {
  return uint32_t(*reinterpret_cast<const unsigned short*>(p));
}
__device__ __forceinline__ uint32_t gg_u32(const uint8_t* p) {
  const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
  return uint32_t(h[0]) | (uint32_t(h[1]) << 16);
}
__device__ __forceinline__ float gg_half(uint32_t h) {
  return __half2float(__ushort_as_half((unsigned short)(h & 0xFFFFu)));
}
__device__ __forceinline__ float gg_f(uint32_t v) {
  return __uint_as_float(v);
}
__device__ __forceinline__ uint32_t gg_bits(float v) {
  return __float_as_uint(v);
}
__device__ __forceinline__ float2 gg_pair(float a, float b) {
  return make_float2(a, b);
}
__device__ __forceinline__ uint32_t gg_popcount(uint32_t v) {
  return uint32_t(__popc(v));
}
__device__ __forceinline__ uint2 gg_load8(const uint8_t* p) {
  return *reinterpret_cast<const uint2*>(p);
}

// ggml's get_scale_min_k4 for sub-block j of a Q4_K / Q5_K block, from the scale words a (bytes
// 0-3), b (4-7), c (8-11): scale | min << 8.
__device__ __forceinline__ uint32_t gg_scale_min_k4(int j, uint32_t a, uint32_t b, uint32_t c) {
  const int sh = 8 * (j & 3);
  const uint32_t aj = (a >> sh) & 0xFFu;
  const uint32_t bj = (b >> sh) & 0xFFu;
  const uint32_t cj = (c >> sh) & 0xFFu;
  const uint32_t sc = j < 4 ? (aj & 63u) : ((cj & 0xFu) | ((aj >> 6) << 4));
  const uint32_t mn = j < 4 ? (bj & 63u) : ((cj >> 4) | ((bj >> 6) << 4));
  return sc | (mn << 8);
}

// Q3_K's 6-bit scale i (0-15) from its 12 packed bytes (words s0, s1, s2).
__device__ __forceinline__ uint32_t gg_q3k_scale(int i, uint32_t s0, uint32_t s1, uint32_t s2) {
  const uint32_t lo = (((i & 7) >> 2) ? s1 : s0) >> (8 * (i & 3) + 4 * (i >> 3));
  const uint32_t hi = s2 >> (8 * (i & 3) + 2 * (i >> 2));
  return (lo & 0xFu) | ((hi & 3u) << 4);
}

// A16: the row starts 16-byte aligned (qdecode.cuh load's W16; Q4_K rows are a multiple of 144 =
// 9 x 16 bytes): Q4_K's header and its 32 bytes of qs as three 16-byte loads instead of six 8-byte.
template <int FMT, bool A16 = false>
__device__ __forceinline__ void gg_load(const uint8_t* wrow, int u, uint32_t* r) {
  const int ib = u & 7;
  if (FMT == 11) {
    const uint8_t* blk = wrow + 34 * u;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      r[k] = gg_u32(blk + 2 + 4 * k);
    }
    r[8] = gg_u16(blk);
  } else if (FMT == 12 || FMT == 20) {
    const uint8_t* blk = wrow + 18 * u;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      r[k] = gg_u32(blk + 2 + 4 * k);
    }
    r[4] = gg_u16(blk);
  } else if (FMT == 13) {
    const uint8_t* blk = wrow + 22 * u;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      r[k] = gg_u32(blk + 6 + 4 * k);
    }
    r[4] = gg_u32(blk + 2);
    r[5] = gg_u16(blk);
  } else if (FMT == 14) {
    const uint8_t* blk = wrow + 24 * u;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      r[k] = gg_u32(blk + 8 + 4 * k);
    }
    r[4] = gg_u32(blk + 4);
    r[5] = gg_u32(blk);
  } else if (FMT == 15) {
    // scales[16], qs[64], d, dmin; unit (n, j): qs[32n ..] >> 2j, scales 8n + 2j, + 1.
    const uint8_t* blk = wrow + 84 * (u >> 3);
    const int n = ib >> 2;
    const int j = ib & 3;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      r[k] = (gg_u32(blk + 16 + 32 * n + 4 * k) >> (2 * j)) & 0x03030303u;
    }
    r[8] = gg_u16(blk + 8 * n + 2 * j);
    r[9] = gg_u32(blk + 80);
  } else if (FMT == 16) {
    // hmask[32], qs[64], scales[12], d; unit (n, j): qs[32n ..] >> 2j, hmask bit 4n + j.
    const uint8_t* blk = wrow + 110 * (u >> 3);
    const int n = ib >> 2;
    const int j = ib & 3;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      r[k] = ((gg_u32(blk + 32 + 32 * n + 4 * k) >> (2 * j)) & 0x03030303u)
             | (((gg_u32(blk + 4 * k) >> (4 * n + j)) & 0x01010101u) << 2);
    }
    const uint32_t s0 = gg_u32(blk + 96);
    const uint32_t s1 = gg_u32(blk + 100);
    const uint32_t s2 = gg_u32(blk + 104);
    r[8] = gg_q3k_scale(2 * ib, s0, s1, s2) | (gg_q3k_scale(2 * ib + 1, s0, s1, s2) << 8);
    r[9] = gg_u16(blk + 108);
  } else if (FMT == 17) {
    // d, dmin, scales[12], qs[128]: sub-blocks 2p (low nibbles) and 2p + 1 of qs[32p ..].
    const uint8_t* blk = wrow + 144 * (u >> 2);
    const int p = u & 3;
    uint2 h0;
    uint2 h1;
    if (A16) {
      const uint4* b16 = reinterpret_cast<const uint4*>(blk);
      const uint4 h = b16[0];
      const uint4 v0 = b16[1 + 2 * p];
      const uint4 v1 = b16[2 + 2 * p];
      h0 = make_uint2(h.x, h.y);
      h1 = make_uint2(h.z, h.w);
      r[0] = v0.x; r[1] = v0.y; r[2] = v0.z; r[3] = v0.w;
      r[4] = v1.x; r[5] = v1.y; r[6] = v1.z; r[7] = v1.w;
    } else {
      h0 = gg_load8(blk);
      h1 = gg_load8(blk + 8);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint2 v = gg_load8(blk + 16 + 32 * p + 8 * k);
        r[2 * k] = v.x;
        r[2 * k + 1] = v.y;
      }
    }
    r[8] = h0.x;
    r[9] = gg_scale_min_k4(2 * p, h0.y, h1.x, h1.y) | (gg_scale_min_k4(2 * p + 1, h0.y, h1.x, h1.y) << 16);
  } else if (FMT == 18) {
    // d, dmin, scales[12], qh[32], qs[128]: sub-block j, nibble j % 2 of qs[32 (j / 2) ..], qh bit j.
    const uint8_t* blk = wrow + 176 * (u >> 3);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      r[k] = ((gg_u32(blk + 48 + 32 * (ib >> 1) + 4 * k) >> (4 * (ib & 1))) & 0x0F0F0F0Fu)
             | (((gg_u32(blk + 16 + 4 * k) >> ib) & 0x01010101u) << 4);
    }
    r[8] = gg_u32(blk);
    r[9] = gg_scale_min_k4(ib, gg_u32(blk + 4), gg_u32(blk + 8), gg_u32(blk + 12));
  } else if (FMT == 19) {
    // ql[128], qh[64], scales[16] int8, d; unit (n, q): ql[64n + 32 (q & 1) ..] nibble q / 2,
    // qh[32n ..] bits 2q, 2q + 1; scales 8n + 2q, + 1.
    const uint8_t* blk = wrow + 210 * (u >> 3);
    const int n = ib >> 2;
    const int q = ib & 3;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      r[k] = ((gg_u32(blk + 64 * n + 32 * (q & 1) + 4 * k) >> (4 * (q >> 1))) & 0x0F0F0F0Fu)
             | (((gg_u32(blk + 128 + 32 * n + 4 * k) >> (2 * q)) & 0x03030303u) << 4);
    }
    r[8] = gg_u16(blk + 192 + 8 * n + 2 * q) | (gg_u16(blk + 208) << 16);
  } else if (FMT == 21) {
    // d, scales_h, scales_l[4], qs[128]: sub-block ib's 16 bytes, its 6-bit scale.
    const uint8_t* blk = wrow + 136 * (u >> 3);
    const uint2 h = gg_load8(blk);
    const uint2 a = gg_load8(blk + 8 + 16 * ib);
    const uint2 b = gg_load8(blk + 16 + 16 * ib);
    r[0] = a.x; r[1] = a.y; r[2] = b.x; r[3] = b.y;
    const uint32_t ls = ((h.y >> (4 * ib)) & 0xFu) | (((h.x >> (16 + 2 * ib)) & 3u) << 4);
    r[4] = (h.x & 0xFFFFu) | (ls << 16);
  } else if (FMT == 22) {
    // d, qs[64] grid indices, 8 x 4 sign and scale bytes.
    const uint8_t* blk = wrow + 98 * (u >> 3);
    r[0] = gg_u32(blk + 2 + 8 * ib);
    r[1] = gg_u32(blk + 6 + 8 * ib);
    r[2] = gg_u32(blk + 66 + 4 * ib);
    r[3] = gg_u16(blk);
  } else if (FMT == 23) {
    // d, qs[64], qh[8], signs[32], scales[4].
    const uint8_t* blk = wrow + 110 * (u >> 3);
    r[0] = gg_u32(blk + 2 + 8 * ib);
    r[1] = gg_u32(blk + 6 + 8 * ib);
    r[2] = gg_u32(blk + 74 + 4 * ib);
    r[3] = gg_u8(blk + 66 + ib) | (((gg_u8(blk + 106 + (ib >> 1)) >> (4 * (ib & 1))) & 0xFu) << 8)
           | (gg_u16(blk) << 16);
  } else if (FMT == 24) {
    // d, qs[32] halves: per sub-block 4 grid indices, then 4 x 7 sign bits and the 4-bit scale.
    const uint8_t* blk = wrow + 66 * (u >> 3);
    r[0] = gg_u32(blk + 2 + 8 * ib);
    r[1] = gg_u32(blk + 6 + 8 * ib);
    r[2] = gg_u16(blk);
  } else if (FMT == 25) {
    // d, qs[32] halves (9-bit grid index | 7 sign bits << 9), scales[8].
    const uint8_t* blk = wrow + 74 * (u >> 3);
    r[0] = gg_u32(blk + 2 + 8 * ib);
    r[1] = gg_u32(blk + 6 + 8 * ib);
    r[2] = gg_u8(blk + 66 + ib) | (gg_u16(blk) << 16);
  } else if (FMT == 26) {
    // d, qs[32] grid index bytes, signs[32], qh[8], scales[8].
    const uint8_t* blk = wrow + 82 * (u >> 3);
    r[0] = gg_u32(blk + 2 + 4 * ib);
    r[1] = gg_u32(blk + 34 + 4 * ib);
    r[2] = gg_u8(blk + 66 + ib) | (gg_u8(blk + 74 + ib) << 8) | (gg_u16(blk) << 16);
  } else if (FMT == 27) {
    // d, qs[32], qh[8] halves.
    const uint8_t* blk = wrow + 50 * (u >> 3);
    r[0] = gg_u32(blk + 2 + 4 * ib);
    r[1] = gg_u16(blk + 34 + 2 * ib) | (gg_u16(blk) << 16);
  } else if (FMT == 28) {
    // qs[32], qh[16], scales[8]: d is the top nibbles of the 4 scale halves.
    const uint8_t* blk = wrow + 56 * (u >> 3);
    const uint32_t sc0 = gg_u16(blk + 48);
    const uint32_t sc1 = gg_u16(blk + 50);
    const uint32_t sc2 = gg_u16(blk + 52);
    const uint32_t sc3 = gg_u16(blk + 54);
    const uint32_t scb = ((ib >> 1) == 0 ? sc0 : (ib >> 1) == 1 ? sc1 : (ib >> 1) == 2 ? sc2 : sc3) >> (6 * (ib & 1));
    r[0] = gg_u32(blk + 4 * ib);
    r[1] = gg_u16(blk + 32 + 2 * ib) | ((scb & 0x3Fu) << 16);
    r[2] = (sc0 >> 12) | ((sc1 >> 8) & 0xF0u) | ((sc2 >> 4) & 0xF00u) | (sc3 & 0xF000u);
  }
}

// (scale, bias) of segment g of a unit: weight = code * scale + bias, as ggml computes them.
template <int FMT>
__device__ __forceinline__ float2 gg_seg_affine(const uint32_t* r, int g) {
  if (FMT == 11) {
    return gg_pair(gg_half(r[8]), 0.0f);
  } else if (FMT == 12 || FMT == 20) {
    return gg_pair(gg_half(r[4]), 0.0f);
  } else if (FMT == 13) {
    return gg_pair(gg_half(r[5]), 0.0f);
  } else if (FMT == 14) {
    return gg_pair(gg_half(r[5]), gg_half(r[5] >> 16));
  } else if (FMT == 15) {
    const uint32_t sc = (r[8] >> (8 * g)) & 0xFFu;
    return gg_pair(gg_half(r[9]) * float(sc & 0xFu), -(gg_half(r[9] >> 16) * float(sc >> 4)));
  } else if (FMT == 16) {
    return gg_pair(gg_half(r[9]) * float(int((r[8] >> (8 * g)) & 0xFFu) - 32), 0.0f);
  } else if (FMT == 17) {
    const uint32_t sm = r[9] >> (16 * g);
    return gg_pair(gg_half(r[8]) * float(sm & 0xFFu), -(gg_half(r[8] >> 16) * float((sm >> 8) & 0xFFu)));
  } else if (FMT == 18) {
    return gg_pair(gg_half(r[8]) * float(r[9] & 0xFFu), -(gg_half(r[8] >> 16) * float(r[9] >> 8)));
  } else if (FMT == 19) {
    return gg_pair(gg_half(r[8] >> 16) * float(int(r[8] << (24 - 8 * g)) >> 24), 0.0f);
  } else if (FMT == 21) {
    return gg_pair(gg_half(r[4]) * float(int(r[4] >> 16) - 32), 0.0f);
  } else if (FMT == 22) {
    return gg_pair(gg_half(r[3]) * (0.5f + float(r[2] >> 28)) * 0.5f, 0.0f);
  } else if (FMT == 23) {
    return gg_pair(gg_half(r[3] >> 16) * float(1u + 2u * ((r[3] >> 8) & 0xFu)), 0.0f);
  } else if (FMT == 24) {
    return gg_pair(gg_half(r[2]) * (0.5f + float(r[1] >> 28)) * 0.25f, 0.0f);
  } else if (FMT == 25) {
    return gg_pair(gg_half(r[2] >> 16) * (0.5f + float((r[2] >> (4 * g)) & 0xFu)) * 0.25f, 0.0f);
  } else if (FMT == 26) {
    return gg_pair(gg_half(r[2] >> 16) * (0.5f + float((r[2] >> (8 + 4 * g)) & 0xFu)) * 0.25f, 0.0f);
  } else if (FMT == 27) {
    return gg_pair(gg_half(r[1] >> 16) * float(2u * ((r[1] >> 12) & 7u) + 1u), 0.0f);
  } else if (FMT == 28) {
    return gg_pair(gg_half(r[2]) * float(2u * ((r[1] >> (16 + 3 * g)) & 7u) + 1u), 0.0f);
  }
  return gg_pair(1.0f, 0.0f);
}

// The code c (< 2^23) minus `offset` as a float: c in the mantissa of 2^23, one subtract.
__device__ __forceinline__ float gg_code(uint32_t c, float magic_plus_offset) {
  return gg_f(0x4B000000u | c) - magic_plus_offset;
}

// Eight grid bytes (g0: bytes 0-3, g1: 4-7) as magnitudes, negated where sign bit k of s8 is set.
__device__ __forceinline__ void gg_signed8(uint32_t g0, uint32_t g1, uint32_t s8, float* q) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float m = gg_code(((k < 4 ? g0 : g1) >> (8 * (k & 3))) & 0xFFu, 8388608.0f);
    q[k] = gg_f(gg_bits(m) ^ (((s8 >> k) & 1u) << 31));
  }
}

// 7 sign bits and the 8th that makes the count of negatives even (ggml's ksigns_iq2xs).
__device__ __forceinline__ uint32_t gg_ksigns(uint32_t seven) {
  return seven | ((gg_popcount(seven) << 7) & 0x80u);
}

// Eight int8 grid values (IQ1: -1, 0, 1) plus delta.
__device__ __forceinline__ void gg_iq1_8(uint32_t g0, uint32_t g1, float delta, float* q) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    q[k] = gg_code((((k < 4 ? g0 : g1) >> (8 * (k & 3))) & 0xFFu) ^ 0x80u, 8388736.0f) + delta;
  }
}

// The codes of weights k0 .. k0 + 7 of a unit (k0 a multiple of 8) as floats, before their
// segment's scale and bias.
template <int FMT>
__device__ __forceinline__ void gg_codes8(const uint32_t* r, int k0, const uint32_t* lut, float* q) {
  const int l = k0 >> 3;
  if (FMT == 11) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      q[k] = gg_code(((r[(k0 + k) >> 2] >> (8 * ((k0 + k) & 3))) & 0xFFu) ^ 0x80u, 8388736.0f);
    }
  } else if (FMT == 12 || FMT == 13 || FMT == 14 || FMT == 20 || FMT == 21) {
    // Weights 0-15 the low nibbles of the 16 bytes, 16-31 the high ones; Q5 a high bit each.
    const int l0 = k0 & 15;
    const int nsh = 4 * (k0 >> 4);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t n = (r[(l0 + k) >> 2] >> (8 * ((l0 + k) & 3) + nsh)) & 0xFu;
      if (FMT == 12) {
        q[k] = gg_code(n, 8388616.0f);
      } else if (FMT == 13 || FMT == 14) {
        const uint32_t c = n | (((r[4] >> (k0 + k)) & 1u) << 4);
        q[k] = gg_code(c, FMT == 13 ? 8388624.0f : 8388608.0f);
      } else {
        q[k] = gg_f(lut[GG_IQ4NL + n]);
      }
    }
  } else if (FMT == 15 || FMT == 16 || FMT == 18 || FMT == 19) {
    // One code a byte: Q2_K 0..3, Q3_K 0..7 (value - 4), Q5_K 0..31, Q6_K 0..63 (value - 32).
    const float off = FMT == 16 ? 8388612.0f : (FMT == 19 ? 8388640.0f : 8388608.0f);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      q[k] = gg_code((r[(k0 + k) >> 2] >> (8 * ((k0 + k) & 3))) & 0xFFu, off);
    }
  } else if (FMT == 17) {
    const int l0 = k0 & 31;
    const int nsh = 4 * (k0 >> 5);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      q[k] = gg_code((r[(l0 + k) >> 2] >> (8 * ((l0 + k) & 3) + nsh)) & 0xFu, 8388608.0f);
    }
  } else if (FMT == 22) {
    // Two 4-value iq3xxs_grid entries, signs from a 7-bit field.
    const uint32_t i0 = (r[l >> 1] >> (16 * (l & 1))) & 0xFFu;
    const uint32_t i1 = (r[l >> 1] >> (16 * (l & 1) + 8)) & 0xFFu;
    gg_signed8(lut[i0], lut[i1], gg_ksigns((r[2] >> (7 * l)) & 0x7Fu), q);
  } else if (FMT == 23) {
    // Two 4-value iq3s_grid entries (8-bit index + a high bit from qh), 8 stored sign bits.
    const uint32_t i0 = ((r[l >> 1] >> (16 * (l & 1))) & 0xFFu) | (((r[3] >> (2 * l)) & 1u) << 8);
    const uint32_t i1 = ((r[l >> 1] >> (16 * (l & 1) + 8)) & 0xFFu) | (((r[3] >> (2 * l + 1)) & 1u) << 8);
    gg_signed8(lut[GG_IQ3S + i0], lut[GG_IQ3S + i1], (r[2] >> (8 * l)) & 0xFFu, q);
  } else if (FMT == 24) {
    const uint32_t i = (r[0] >> (8 * l)) & 0xFFu;
    gg_signed8(lut[GG_IQ2XXS + 2 * i], lut[GG_IQ2XXS + 2 * i + 1],
                  gg_ksigns((r[1] >> (7 * l)) & 0x7Fu), q);
  } else if (FMT == 25) {
    const uint32_t h = (r[l >> 1] >> (16 * (l & 1))) & 0xFFFFu;
    const uint32_t i = h & 511u;
    gg_signed8(lut[GG_IQ2XS + 2 * i], lut[GG_IQ2XS + 2 * i + 1], gg_ksigns(h >> 9), q);
  } else if (FMT == 26) {
    const uint32_t i = ((r[0] >> (8 * l)) & 0xFFu) | (((r[2] >> (2 * l)) & 3u) << 8);
    gg_signed8(lut[GG_IQ2S + 2 * i], lut[GG_IQ2S + 2 * i + 1], (r[1] >> (8 * l)) & 0xFFu, q);
  } else if (FMT == 27) {
    const uint32_t i = ((r[0] >> (8 * l)) & 0xFFu) | (((r[1] >> (3 * l)) & 7u) << 8);
    gg_iq1_8(lut[GG_IQ1S + 2 * i], lut[GG_IQ1S + 2 * i + 1], (r[1] & 0x8000u) ? -0.125f : 0.125f, q);
  } else if (FMT == 28) {
    const uint32_t qh = (r[1] >> (8 * (l >> 1))) & 0xFFu;
    const uint32_t i = ((r[0] >> (8 * l)) & 0xFFu) | (((l & 1) ? (qh << 4) : (qh << 8)) & 0x700u);
    const bool neg = ((l & 1) ? (qh & 0x80u) : (qh & 0x08u)) != 0u;
    gg_iq1_8(lut[GG_IQ1S + 2 * i], lut[GG_IQ1S + 2 * i + 1], neg ? -0.125f : 0.125f, q);
  }
}

// Weights k0 .. k0 + 7 of a unit, decoded: code * scale + bias (one rounding; ggml rounds Q4_K's
// product and difference separately, within the kernels' tolerance).
template <int FMT>
__device__ __forceinline__ void gg_decode8(const uint32_t* r, int k0, const uint32_t* lut, float* q) {
  gg_codes8<FMT>(r, k0, lut, q);
  const float2 a = gg_seg_affine<FMT>(r, k0 / gg_seg(FMT));
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    q[k] = fmaf(q[k], a.x, a.y);
  }
}

// gguf_decode.h qd_gg_q4k_nib8: Q4_K's codes as exact fp16 subnormals (each sub-block from its own
// shifts: nothing shared between the segments stays live).
__device__ __forceinline__ void gg_q4k_nib8(const uint32_t* r, int k0, float* q) {
  const uint32_t sh = k0 < 32 ? 0u : 4u;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t w = r[((k0 & 31) >> 2) + h];
    const uint32_t a = (w >> sh) & 0x000F000Fu;
    const uint32_t b = (w >> (sh + 8u)) & 0x000F000Fu;
    __half2 ha;
    __half2 hb;
    memcpy(&ha, &a, 4);
    memcpy(&hb, &b, 4);
    const float2 f02 = __half22float2(ha);
    const float2 f13 = __half22float2(hb);
    q[4 * h] = f02.x; q[4 * h + 1] = f13.x; q[4 * h + 2] = f02.y; q[4 * h + 3] = f13.y;
  }
}

// seg_dots for the GGUF fmts (gguf_decode.h qd_seg_dots_gguf): sum code * x over the segment, then the
// segment's scale once and its bias times sum x.
template <int FMT, int S, int ROWS, int XV, int W, typename T, int XP = 0, int NIB = 0>
__device__ __forceinline__ void seg_dots_gguf(const uint32_t (*raw)[W], const T* x, const int* xoff,
                                              uint32_t xmask, int I, int u, int g, const uint32_t* lut,
                                              float (*d)[S]) {
  constexpr int WPU = gg_wpu(FMT);
  constexpr int SEG = gg_seg(FMT);
  constexpr bool SUBN = NIB && FMT == 17;
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
      if (SUBN) {
        gg_q4k_nib8(raw[r], k0, q[r]);
      } else {
        gg_codes8<FMT>(raw[r], k0, lut, q[r]);
      }
    }
#pragma unroll
    for (int s = 0; s < S; ++s) {
      if ((xmask >> s) & 1u) {
        float xf[8];
        xs8<XV, XP, WPU, T>(x + xoff[s], I, u, k0, xf);
        if (gg_has_bias(FMT)) {
          sx[s] += ((xf[0] + xf[1]) + (xf[2] + xf[3])) + ((xf[4] + xf[5]) + (xf[6] + xf[7]));
        }
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
    const float2 a = gg_seg_affine<FMT>(raw[r], g);
    const float sc = SUBN ? a.x * 16777216.0f : a.x;
#pragma unroll
    for (int s = 0; s < S; ++s) {
      d[r][s] = gg_has_bias(FMT) ? fmaf(a.y, sx[s], (lo[r][s] + hi[r][s]) * sc) : (lo[r][s] + hi[r][s]) * sc;
    }
  }
}

}  // namespace colibri_qd

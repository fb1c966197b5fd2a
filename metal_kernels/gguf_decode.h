// gguf_decode.h: unit loads and exact decoders of llama.cpp's GGUF block formats (QTensor fmt
// 11-28, colibri_mlx/formats/gguf_quant.py; layouts from ggml-common.h, decoding as ggml's
// dequantize_row_*), for every kernel that reads quantized weights through qdecode.h (qgemv,
// moe_block, mla_decode). dispatch.decode_header puts this file in front of qdecode.h, whose
// qd_wpu / qd_words / qd_seg / qd_load / qd_decode8 / qd_seg_dots hand the GGUF fmts to the
// functions here. The CUDA twin is metal_kernels/cuda/gguf_decode.cuh, same names without qd_.
//
// A GGUF row is I / block_size ggml blocks, stored exactly as ggml writes them; blocks are only
// promised 2-byte alignment (Q8_0: 34 bytes) and are read in halves, except Q4_K (144 bytes) and
// IQ4_XS (136), 8-byte aligned, read in 8-byte words. A unit is a run of 32 consecutive weights of
// one block (Q4_K: 64, sub-blocks 2p and 2p + 1 of a 256-weight block, p = u % 4; they share their
// code bytes). Whatever the unit's position in its block needs (which nibble, which high bits,
// which packed scale) is resolved at load, so a unit's words hold:
// * Q8_0 (11): r[0..7] the int8 codes, r[8] d;
// * Q4_0 (12), IQ4_NL (20): r[0..3] 16 code bytes (weights 0-15 the low nibbles), r[4] d;
// * Q5_0 (13), Q5_1 (14): r[0..3] as Q4_0, r[4] the 32 high bits, r[5] d (| m << 16);
// * Q2_K (15), Q3_K (16), Q5_K (18), Q6_K (19): r[0..7] the codes one a byte (low bits, high bits
//   merged at load), r[8] the unit's scales (Q2_K: two 4-bit scale | 4-bit min bytes; Q3_K two
//   6-bit scales; Q5_K scale | min << 8; Q6_K two int8 scales), r[9] d (| dmin << 16) (Q6_K: d in
//   r[8]'s high half);
// * Q4_K (17): r[0..7] 32 code bytes (sub-block 2p the low nibbles), r[8] d | dmin << 16, r[9]
//   scale, min, scale, min bytes;
// * IQ4_XS (21): r[0..3] as Q4_0, r[4] d | 6-bit scale << 16;
// * IQ2_XXS (24), IQ2_XS (25), IQ2_S (26), IQ3_XXS (22), IQ3_S (23), IQ1_S (27), IQ1_M (28): the
//   sub-block's grid indices, sign bits, high index bits and scale bits as stored, and d.
// A weight is code * scale + bias, one (scale, bias) a segment (16 weights for the types with
// 16-weight scales, else 32); bias is Q4_K / Q5_K / Q2_K's -dmin * min and Q5_1's m. qd_decode8
// applies them per weight (qd_seg_scale is 1); qd_seg_dots sums code * x over a segment and
// applies them once (qd_seg_dots_gguf, below).
//
// The lookup-table input (the kernels' e8grid; kernels/gguf_decode.py lookup_words) holds ggml's
// tables at the word offsets QD_GG_*: iq3xxs_grid (= the fmt 6 grid) at 0, then kvalues_iq4nl as
// float32, iq3s_grid, and the 8-byte grids iq2xxs / iq2xs / iq2s / iq1s (two words an entry).

constant constexpr int QD_GG_IQ2XXS = 256;
constant constexpr int QD_GG_IQ4NL = 768;
constant constexpr int QD_GG_IQ3S = 784;
constant constexpr int QD_GG_IQ2XS = 1296;
constant constexpr int QD_GG_IQ2S = 2320;
constant constexpr int QD_GG_IQ1S = 4368;

constexpr bool qd_gguf(int fmt) {
  return fmt >= 11 && fmt <= 28;
}

constexpr int qd_gg_wpu(int fmt) {
  return fmt == 17 ? 64 : 32;
}

constexpr int qd_gg_words(int fmt) {
  return (fmt == 15 || fmt == 16 || fmt == 17 || fmt == 18) ? 10
         : (fmt == 11 || fmt == 19) ? 9
         : (fmt == 13 || fmt == 14) ? 6
         : (fmt == 12 || fmt == 20 || fmt == 21) ? 5
         : (fmt == 22 || fmt == 23) ? 4
         : fmt == 27 ? 2 : 3;
}

// Weights sharing one (scale, bias).
constexpr int qd_gg_seg(int fmt) {
  return (fmt == 15 || fmt == 16 || fmt == 19 || fmt == 25 || fmt == 26 || fmt == 28) ? 16 : 32;
}

constexpr bool qd_gg_has_bias(int fmt) {
  return fmt == 14 || fmt == 15 || fmt == 17 || fmt == 18;
}

// The decoders: dispatch.decode_header keeps the text above and replaces what follows this line
// with gguf_stub.h for launches of the other formats.
// ==== GGUF decoders ====

// qdecode.h's x loads (defined there, after this file).
template <int XV, int XP, int WPU, typename T>
inline void qd_xs8(const device T* xs, int I, int u, int k0, thread float* o);


inline uint qd_gg_u8(const device uint8_t* p) {
  return uint(p[0]);
}
inline uint qd_gg_u16(const device uint8_t* p) {
  return uint(*(const device ushort*)p);
}
inline uint qd_gg_u32(const device uint8_t* p) {
  const device ushort* h = (const device ushort*)p;
  return uint(h[0]) | (uint(h[1]) << 16);
}
inline float qd_gg_half(uint h) {
  return float(as_type<half>(ushort(h & 0xFFFFu)));
}
inline float qd_gg_f(uint v) {
  return as_type<float>(v);
}
inline uint qd_gg_bits(float v) {
  return as_type<uint>(v);
}
inline float2 qd_gg_pair(float a, float b) {
  return float2(a, b);
}
inline uint qd_gg_popcount(uint v) {
  return popcount(v);
}
inline uint2 qd_gg_load8(const device uint8_t* p) {
  return *(const device uint2*)p;
}

// ggml's get_scale_min_k4 for sub-block j of a Q4_K / Q5_K block, from the scale words a (bytes
// 0-3), b (4-7), c (8-11): scale | min << 8.
inline uint qd_gg_scale_min_k4(int j, uint a, uint b, uint c) {
  const int sh = 8 * (j & 3);
  const uint aj = (a >> sh) & 0xFFu;
  const uint bj = (b >> sh) & 0xFFu;
  const uint cj = (c >> sh) & 0xFFu;
  const uint sc = j < 4 ? (aj & 63u) : ((cj & 0xFu) | ((aj >> 6) << 4));
  const uint mn = j < 4 ? (bj & 63u) : ((cj >> 4) | ((bj >> 6) << 4));
  return sc | (mn << 8);
}

// Q3_K's 6-bit scale i (0-15) from its 12 packed bytes (words s0, s1, s2).
inline uint qd_gg_q3k_scale(int i, uint s0, uint s1, uint s2) {
  const uint lo = (((i & 7) >> 2) ? s1 : s0) >> (8 * (i & 3) + 4 * (i >> 3));
  const uint hi = s2 >> (8 * (i & 3) + 2 * (i >> 2));
  return (lo & 0xFu) | ((hi & 3u) << 4);
}

template <int FMT>
inline void qd_gg_load(const device uint8_t* wrow, int u, thread uint* r) {
  const int ib = u & 7;
  if (FMT == 11) {
    const device uint8_t* blk = wrow + 34 * u;
    for (int k = 0; k < 8; ++k) {
      r[k] = qd_gg_u32(blk + 2 + 4 * k);
    }
    r[8] = qd_gg_u16(blk);
  } else if (FMT == 12 || FMT == 20) {
    const device uint8_t* blk = wrow + 18 * u;
    for (int k = 0; k < 4; ++k) {
      r[k] = qd_gg_u32(blk + 2 + 4 * k);
    }
    r[4] = qd_gg_u16(blk);
  } else if (FMT == 13) {
    const device uint8_t* blk = wrow + 22 * u;
    for (int k = 0; k < 4; ++k) {
      r[k] = qd_gg_u32(blk + 6 + 4 * k);
    }
    r[4] = qd_gg_u32(blk + 2);
    r[5] = qd_gg_u16(blk);
  } else if (FMT == 14) {
    const device uint8_t* blk = wrow + 24 * u;
    for (int k = 0; k < 4; ++k) {
      r[k] = qd_gg_u32(blk + 8 + 4 * k);
    }
    r[4] = qd_gg_u32(blk + 4);
    r[5] = qd_gg_u32(blk);
  } else if (FMT == 15) {
    // scales[16], qs[64], d, dmin; unit (n, j): qs[32n ..] >> 2j, scales 8n + 2j, + 1.
    const device uint8_t* blk = wrow + 84 * (u >> 3);
    const int n = ib >> 2;
    const int j = ib & 3;
    for (int k = 0; k < 8; ++k) {
      r[k] = (qd_gg_u32(blk + 16 + 32 * n + 4 * k) >> (2 * j)) & 0x03030303u;
    }
    r[8] = qd_gg_u16(blk + 8 * n + 2 * j);
    r[9] = qd_gg_u32(blk + 80);
  } else if (FMT == 16) {
    // hmask[32], qs[64], scales[12], d; unit (n, j): qs[32n ..] >> 2j, hmask bit 4n + j.
    const device uint8_t* blk = wrow + 110 * (u >> 3);
    const int n = ib >> 2;
    const int j = ib & 3;
    for (int k = 0; k < 8; ++k) {
      r[k] = ((qd_gg_u32(blk + 32 + 32 * n + 4 * k) >> (2 * j)) & 0x03030303u)
             | (((qd_gg_u32(blk + 4 * k) >> (4 * n + j)) & 0x01010101u) << 2);
    }
    const uint s0 = qd_gg_u32(blk + 96);
    const uint s1 = qd_gg_u32(blk + 100);
    const uint s2 = qd_gg_u32(blk + 104);
    r[8] = qd_gg_q3k_scale(2 * ib, s0, s1, s2) | (qd_gg_q3k_scale(2 * ib + 1, s0, s1, s2) << 8);
    r[9] = qd_gg_u16(blk + 108);
  } else if (FMT == 17) {
    // d, dmin, scales[12], qs[128]: sub-blocks 2p (low nibbles) and 2p + 1 of qs[32p ..].
    const device uint8_t* blk = wrow + 144 * (u >> 2);
    const int p = u & 3;
    const uint2 h0 = qd_gg_load8(blk);
    const uint2 h1 = qd_gg_load8(blk + 8);
    for (int k = 0; k < 4; ++k) {
      const uint2 v = qd_gg_load8(blk + 16 + 32 * p + 8 * k);
      r[2 * k] = v.x;
      r[2 * k + 1] = v.y;
    }
    r[8] = h0.x;
    r[9] = qd_gg_scale_min_k4(2 * p, h0.y, h1.x, h1.y) | (qd_gg_scale_min_k4(2 * p + 1, h0.y, h1.x, h1.y) << 16);
  } else if (FMT == 18) {
    // d, dmin, scales[12], qh[32], qs[128]: sub-block j, nibble j % 2 of qs[32 (j / 2) ..], qh bit j.
    const device uint8_t* blk = wrow + 176 * (u >> 3);
    for (int k = 0; k < 8; ++k) {
      r[k] = ((qd_gg_u32(blk + 48 + 32 * (ib >> 1) + 4 * k) >> (4 * (ib & 1))) & 0x0F0F0F0Fu)
             | (((qd_gg_u32(blk + 16 + 4 * k) >> ib) & 0x01010101u) << 4);
    }
    r[8] = qd_gg_u32(blk);
    r[9] = qd_gg_scale_min_k4(ib, qd_gg_u32(blk + 4), qd_gg_u32(blk + 8), qd_gg_u32(blk + 12));
  } else if (FMT == 19) {
    // ql[128], qh[64], scales[16] int8, d; unit (n, q): ql[64n + 32 (q & 1) ..] nibble q / 2,
    // qh[32n ..] bits 2q, 2q + 1; scales 8n + 2q, + 1.
    const device uint8_t* blk = wrow + 210 * (u >> 3);
    const int n = ib >> 2;
    const int q = ib & 3;
    for (int k = 0; k < 8; ++k) {
      r[k] = ((qd_gg_u32(blk + 64 * n + 32 * (q & 1) + 4 * k) >> (4 * (q >> 1))) & 0x0F0F0F0Fu)
             | (((qd_gg_u32(blk + 128 + 32 * n + 4 * k) >> (2 * q)) & 0x03030303u) << 4);
    }
    r[8] = qd_gg_u16(blk + 192 + 8 * n + 2 * q) | (qd_gg_u16(blk + 208) << 16);
  } else if (FMT == 21) {
    // d, scales_h, scales_l[4], qs[128]: sub-block ib's 16 bytes, its 6-bit scale.
    const device uint8_t* blk = wrow + 136 * (u >> 3);
    const uint2 h = qd_gg_load8(blk);
    const uint2 a = qd_gg_load8(blk + 8 + 16 * ib);
    const uint2 b = qd_gg_load8(blk + 16 + 16 * ib);
    r[0] = a.x; r[1] = a.y; r[2] = b.x; r[3] = b.y;
    const uint ls = ((h.y >> (4 * ib)) & 0xFu) | (((h.x >> (16 + 2 * ib)) & 3u) << 4);
    r[4] = (h.x & 0xFFFFu) | (ls << 16);
  } else if (FMT == 22) {
    // d, qs[64] grid indices, 8 x 4 sign and scale bytes.
    const device uint8_t* blk = wrow + 98 * (u >> 3);
    r[0] = qd_gg_u32(blk + 2 + 8 * ib);
    r[1] = qd_gg_u32(blk + 6 + 8 * ib);
    r[2] = qd_gg_u32(blk + 66 + 4 * ib);
    r[3] = qd_gg_u16(blk);
  } else if (FMT == 23) {
    // d, qs[64], qh[8], signs[32], scales[4].
    const device uint8_t* blk = wrow + 110 * (u >> 3);
    r[0] = qd_gg_u32(blk + 2 + 8 * ib);
    r[1] = qd_gg_u32(blk + 6 + 8 * ib);
    r[2] = qd_gg_u32(blk + 74 + 4 * ib);
    r[3] = qd_gg_u8(blk + 66 + ib) | (((qd_gg_u8(blk + 106 + (ib >> 1)) >> (4 * (ib & 1))) & 0xFu) << 8)
           | (qd_gg_u16(blk) << 16);
  } else if (FMT == 24) {
    // d, qs[32] halves: per sub-block 4 grid indices, then 4 x 7 sign bits and the 4-bit scale.
    const device uint8_t* blk = wrow + 66 * (u >> 3);
    r[0] = qd_gg_u32(blk + 2 + 8 * ib);
    r[1] = qd_gg_u32(blk + 6 + 8 * ib);
    r[2] = qd_gg_u16(blk);
  } else if (FMT == 25) {
    // d, qs[32] halves (9-bit grid index | 7 sign bits << 9), scales[8].
    const device uint8_t* blk = wrow + 74 * (u >> 3);
    r[0] = qd_gg_u32(blk + 2 + 8 * ib);
    r[1] = qd_gg_u32(blk + 6 + 8 * ib);
    r[2] = qd_gg_u8(blk + 66 + ib) | (qd_gg_u16(blk) << 16);
  } else if (FMT == 26) {
    // d, qs[32] grid index bytes, signs[32], qh[8], scales[8].
    const device uint8_t* blk = wrow + 82 * (u >> 3);
    r[0] = qd_gg_u32(blk + 2 + 4 * ib);
    r[1] = qd_gg_u32(blk + 34 + 4 * ib);
    r[2] = qd_gg_u8(blk + 66 + ib) | (qd_gg_u8(blk + 74 + ib) << 8) | (qd_gg_u16(blk) << 16);
  } else if (FMT == 27) {
    // d, qs[32], qh[8] halves.
    const device uint8_t* blk = wrow + 50 * (u >> 3);
    r[0] = qd_gg_u32(blk + 2 + 4 * ib);
    r[1] = qd_gg_u16(blk + 34 + 2 * ib) | (qd_gg_u16(blk) << 16);
  } else if (FMT == 28) {
    // qs[32], qh[16], scales[8]: d is the top nibbles of the 4 scale halves.
    const device uint8_t* blk = wrow + 56 * (u >> 3);
    const uint sc0 = qd_gg_u16(blk + 48);
    const uint sc1 = qd_gg_u16(blk + 50);
    const uint sc2 = qd_gg_u16(blk + 52);
    const uint sc3 = qd_gg_u16(blk + 54);
    const uint scb = ((ib >> 1) == 0 ? sc0 : (ib >> 1) == 1 ? sc1 : (ib >> 1) == 2 ? sc2 : sc3) >> (6 * (ib & 1));
    r[0] = qd_gg_u32(blk + 4 * ib);
    r[1] = qd_gg_u16(blk + 32 + 2 * ib) | ((scb & 0x3Fu) << 16);
    r[2] = (sc0 >> 12) | ((sc1 >> 8) & 0xF0u) | ((sc2 >> 4) & 0xF00u) | (sc3 & 0xF000u);
  }
}

// (scale, bias) of segment g of a unit: weight = code * scale + bias, as ggml computes them.
template <int FMT>
inline float2 qd_gg_seg_affine(thread const uint* r, int g) {
  if (FMT == 11) {
    return qd_gg_pair(qd_gg_half(r[8]), 0.0f);
  } else if (FMT == 12 || FMT == 20) {
    return qd_gg_pair(qd_gg_half(r[4]), 0.0f);
  } else if (FMT == 13) {
    return qd_gg_pair(qd_gg_half(r[5]), 0.0f);
  } else if (FMT == 14) {
    return qd_gg_pair(qd_gg_half(r[5]), qd_gg_half(r[5] >> 16));
  } else if (FMT == 15) {
    const uint sc = (r[8] >> (8 * g)) & 0xFFu;
    return qd_gg_pair(qd_gg_half(r[9]) * float(sc & 0xFu), -(qd_gg_half(r[9] >> 16) * float(sc >> 4)));
  } else if (FMT == 16) {
    return qd_gg_pair(qd_gg_half(r[9]) * float(int((r[8] >> (8 * g)) & 0xFFu) - 32), 0.0f);
  } else if (FMT == 17) {
    const uint sm = r[9] >> (16 * g);
    return qd_gg_pair(qd_gg_half(r[8]) * float(sm & 0xFFu), -(qd_gg_half(r[8] >> 16) * float((sm >> 8) & 0xFFu)));
  } else if (FMT == 18) {
    return qd_gg_pair(qd_gg_half(r[8]) * float(r[9] & 0xFFu), -(qd_gg_half(r[8] >> 16) * float(r[9] >> 8)));
  } else if (FMT == 19) {
    return qd_gg_pair(qd_gg_half(r[8] >> 16) * float(int(r[8] << (24 - 8 * g)) >> 24), 0.0f);
  } else if (FMT == 21) {
    return qd_gg_pair(qd_gg_half(r[4]) * float(int(r[4] >> 16) - 32), 0.0f);
  } else if (FMT == 22) {
    return qd_gg_pair(qd_gg_half(r[3]) * (0.5f + float(r[2] >> 28)) * 0.5f, 0.0f);
  } else if (FMT == 23) {
    return qd_gg_pair(qd_gg_half(r[3] >> 16) * float(1u + 2u * ((r[3] >> 8) & 0xFu)), 0.0f);
  } else if (FMT == 24) {
    return qd_gg_pair(qd_gg_half(r[2]) * (0.5f + float(r[1] >> 28)) * 0.25f, 0.0f);
  } else if (FMT == 25) {
    return qd_gg_pair(qd_gg_half(r[2] >> 16) * (0.5f + float((r[2] >> (4 * g)) & 0xFu)) * 0.25f, 0.0f);
  } else if (FMT == 26) {
    return qd_gg_pair(qd_gg_half(r[2] >> 16) * (0.5f + float((r[2] >> (8 + 4 * g)) & 0xFu)) * 0.25f, 0.0f);
  } else if (FMT == 27) {
    return qd_gg_pair(qd_gg_half(r[1] >> 16) * float(2u * ((r[1] >> 12) & 7u) + 1u), 0.0f);
  } else if (FMT == 28) {
    return qd_gg_pair(qd_gg_half(r[2]) * float(2u * ((r[1] >> (16 + 3 * g)) & 7u) + 1u), 0.0f);
  }
  return qd_gg_pair(1.0f, 0.0f);
}

// The code c (< 2^23) minus `offset` as a float: c in the mantissa of 2^23, one subtract.
inline float qd_gg_code(uint c, float magic_plus_offset) {
  return qd_gg_f(0x4B000000u | c) - magic_plus_offset;
}

// Eight grid bytes (g0: bytes 0-3, g1: 4-7) as magnitudes, negated where sign bit k of s8 is set.
inline void qd_gg_signed8(uint g0, uint g1, uint s8, thread float* q) {
  for (int k = 0; k < 8; ++k) {
    const float m = qd_gg_code(((k < 4 ? g0 : g1) >> (8 * (k & 3))) & 0xFFu, 8388608.0f);
    q[k] = qd_gg_f(qd_gg_bits(m) ^ (((s8 >> k) & 1u) << 31));
  }
}

// 7 sign bits and the 8th that makes the count of negatives even (ggml's ksigns_iq2xs).
inline uint qd_gg_ksigns(uint seven) {
  return seven | ((qd_gg_popcount(seven) << 7) & 0x80u);
}

// Eight int8 grid values (IQ1: -1, 0, 1) plus delta.
inline void qd_gg_iq1_8(uint g0, uint g1, float delta, thread float* q) {
  for (int k = 0; k < 8; ++k) {
    q[k] = qd_gg_code((((k < 4 ? g0 : g1) >> (8 * (k & 3))) & 0xFFu) ^ 0x80u, 8388736.0f) + delta;
  }
}

// The codes of weights k0 .. k0 + 7 of a unit (k0 a multiple of 8) as floats, before their
// segment's scale and bias.
template <int FMT>
inline void qd_gg_codes8(thread const uint* r, int k0, const device uint* lut, thread float* q) {
  const int l = k0 >> 3;
  if (FMT == 11) {
    for (int k = 0; k < 8; ++k) {
      q[k] = qd_gg_code(((r[(k0 + k) >> 2] >> (8 * ((k0 + k) & 3))) & 0xFFu) ^ 0x80u, 8388736.0f);
    }
  } else if (FMT == 12 || FMT == 13 || FMT == 14 || FMT == 20 || FMT == 21) {
    // Weights 0-15 the low nibbles of the 16 bytes, 16-31 the high ones; Q5 a high bit each.
    const int l0 = k0 & 15;
    const int nsh = 4 * (k0 >> 4);
    for (int k = 0; k < 8; ++k) {
      const uint n = (r[(l0 + k) >> 2] >> (8 * ((l0 + k) & 3) + nsh)) & 0xFu;
      if (FMT == 12) {
        q[k] = qd_gg_code(n, 8388616.0f);
      } else if (FMT == 13 || FMT == 14) {
        const uint c = n | (((r[4] >> (k0 + k)) & 1u) << 4);
        q[k] = qd_gg_code(c, FMT == 13 ? 8388624.0f : 8388608.0f);
      } else {
        q[k] = qd_gg_f(lut[QD_GG_IQ4NL + n]);
      }
    }
  } else if (FMT == 15 || FMT == 16 || FMT == 18 || FMT == 19) {
    // One code a byte: Q2_K 0..3, Q3_K 0..7 (value - 4), Q5_K 0..31, Q6_K 0..63 (value - 32).
    const float off = FMT == 16 ? 8388612.0f : (FMT == 19 ? 8388640.0f : 8388608.0f);
    for (int k = 0; k < 8; ++k) {
      q[k] = qd_gg_code((r[(k0 + k) >> 2] >> (8 * ((k0 + k) & 3))) & 0xFFu, off);
    }
  } else if (FMT == 17) {
    const int l0 = k0 & 31;
    const int nsh = 4 * (k0 >> 5);
    for (int k = 0; k < 8; ++k) {
      q[k] = qd_gg_code((r[(l0 + k) >> 2] >> (8 * ((l0 + k) & 3) + nsh)) & 0xFu, 8388608.0f);
    }
  } else if (FMT == 22) {
    // Two 4-value iq3xxs_grid entries, signs from a 7-bit field.
    const uint i0 = (r[l >> 1] >> (16 * (l & 1))) & 0xFFu;
    const uint i1 = (r[l >> 1] >> (16 * (l & 1) + 8)) & 0xFFu;
    qd_gg_signed8(lut[i0], lut[i1], qd_gg_ksigns((r[2] >> (7 * l)) & 0x7Fu), q);
  } else if (FMT == 23) {
    // Two 4-value iq3s_grid entries (8-bit index + a high bit from qh), 8 stored sign bits.
    const uint i0 = ((r[l >> 1] >> (16 * (l & 1))) & 0xFFu) | (((r[3] >> (2 * l)) & 1u) << 8);
    const uint i1 = ((r[l >> 1] >> (16 * (l & 1) + 8)) & 0xFFu) | (((r[3] >> (2 * l + 1)) & 1u) << 8);
    qd_gg_signed8(lut[QD_GG_IQ3S + i0], lut[QD_GG_IQ3S + i1], (r[2] >> (8 * l)) & 0xFFu, q);
  } else if (FMT == 24) {
    const uint i = (r[0] >> (8 * l)) & 0xFFu;
    qd_gg_signed8(lut[QD_GG_IQ2XXS + 2 * i], lut[QD_GG_IQ2XXS + 2 * i + 1],
                  qd_gg_ksigns((r[1] >> (7 * l)) & 0x7Fu), q);
  } else if (FMT == 25) {
    const uint h = (r[l >> 1] >> (16 * (l & 1))) & 0xFFFFu;
    const uint i = h & 511u;
    qd_gg_signed8(lut[QD_GG_IQ2XS + 2 * i], lut[QD_GG_IQ2XS + 2 * i + 1], qd_gg_ksigns(h >> 9), q);
  } else if (FMT == 26) {
    const uint i = ((r[0] >> (8 * l)) & 0xFFu) | (((r[2] >> (2 * l)) & 3u) << 8);
    qd_gg_signed8(lut[QD_GG_IQ2S + 2 * i], lut[QD_GG_IQ2S + 2 * i + 1], (r[1] >> (8 * l)) & 0xFFu, q);
  } else if (FMT == 27) {
    const uint i = ((r[0] >> (8 * l)) & 0xFFu) | (((r[1] >> (3 * l)) & 7u) << 8);
    qd_gg_iq1_8(lut[QD_GG_IQ1S + 2 * i], lut[QD_GG_IQ1S + 2 * i + 1], (r[1] & 0x8000u) ? -0.125f : 0.125f, q);
  } else if (FMT == 28) {
    const uint qh = (r[1] >> (8 * (l >> 1))) & 0xFFu;
    const uint i = ((r[0] >> (8 * l)) & 0xFFu) | (((l & 1) ? (qh << 4) : (qh << 8)) & 0x700u);
    const bool neg = ((l & 1) ? (qh & 0x80u) : (qh & 0x08u)) != 0u;
    qd_gg_iq1_8(lut[QD_GG_IQ1S + 2 * i], lut[QD_GG_IQ1S + 2 * i + 1], neg ? -0.125f : 0.125f, q);
  }
}

// Weights k0 .. k0 + 7 of a unit, decoded: code * scale + bias (one rounding; ggml rounds Q4_K's
// product and difference separately, within the kernels' tolerance).
template <int FMT>
inline void qd_gg_decode8(thread const uint* r, int k0, const device uint* lut, thread float* q) {
  qd_gg_codes8<FMT>(r, k0, lut, q);
  const float2 a = qd_gg_seg_affine<FMT>(r, k0 / qd_gg_seg(FMT));
  for (int k = 0; k < 8; ++k) {
    q[k] = fma(q[k], a.x, a.y);
  }
}

// Q4_K's codes of weights k0 .. k0 + 7 of a unit as exact fp16 subnormals (qdecode.h
// qd_nib8_sub's trick for fmt 4): a qs word shifted by sh AND 0x000F000F is the half2 (n of byte
// 0, n of byte 2) * 2^-24, shifted by sh + 8 the same for bytes 1 and 3; sh 4 for weights 32-63
// (the high nibbles). Each sub-block's codes from their own shifts: no value shared between the
// two segments stays live (CUDA qgemv S = 1: 167 registers a thread, not 204). No magic OR and
// subtract a weight; qd_seg_dots_gguf scales by 2^24.
inline void qd_gg_q4k_nib8(thread const uint* r, int k0, thread float* q) {
  const uint sh = k0 < 32 ? 0u : 4u;
  for (int h = 0; h < 2; ++h) {
    const uint w = r[((k0 & 31) >> 2) + h];
    const float2 f02 = float2(as_type<half2>((w >> sh) & 0x000F000Fu));
    const uint b = (w >> (sh + 8u)) & 0x000F000Fu;
    const float2 f13 = float2(as_type<half2>(b));
    q[4 * h] = f02.x; q[4 * h + 1] = f13.x; q[4 * h + 2] = f02.y; q[4 * h + 3] = f13.y;
  }
}

// qd_seg_dots for the GGUF fmts: sum code * x over the segment (two FMA chains), then the
// segment's scale once, and its bias (Q4_K's -dmin * min) times sum x, instead of a scale and a
// bias per weight. NIB 1 (CUDA's default, as for fmt 2/4): Q4_K's codes from qd_gg_q4k_nib8.
template <int FMT, int S, int ROWS, int XV, int W, typename T, int XP = 0, int NIB = 0>
inline void qd_seg_dots_gguf(thread const uint (*raw)[W], const device T* x, thread const int* xoff,
                             uint xmask, int I, int u, int g, const device uint* lut, thread float (*d)[S]) {
  constexpr int WPU = qd_gg_wpu(FMT);
  constexpr int SEG = qd_gg_seg(FMT);
  constexpr bool SUBN = NIB && FMT == 17;
  float lo[ROWS][S];
  float hi[ROWS][S];
  float sx[S];
  for (int s = 0; s < S; ++s) {
    sx[s] = 0.0f;
    for (int r = 0; r < ROWS; ++r) {
      lo[r][s] = 0.0f;
      hi[r][s] = 0.0f;
    }
  }
  for (int c = 0; c < SEG; c += 8) {
    const int k0 = SEG * g + c;
    float q[ROWS][8];
    for (int r = 0; r < ROWS; ++r) {
      if (SUBN) {
        qd_gg_q4k_nib8(raw[r], k0, q[r]);
      } else {
        qd_gg_codes8<FMT>(raw[r], k0, lut, q[r]);
      }
    }
    for (int s = 0; s < S; ++s) {
      if ((xmask >> s) & 1u) {
        float xf[8];
        qd_xs8<XV, XP, WPU, T>(x + xoff[s], I, u, k0, xf);
        if (qd_gg_has_bias(FMT)) {
          sx[s] += ((xf[0] + xf[1]) + (xf[2] + xf[3])) + ((xf[4] + xf[5]) + (xf[6] + xf[7]));
        }
        for (int r = 0; r < ROWS; ++r) {
          for (int k = 0; k < 8; k += 2) {
            lo[r][s] += q[r][k] * xf[k];
            hi[r][s] += q[r][k + 1] * xf[k + 1];
          }
        }
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    const float2 a = qd_gg_seg_affine<FMT>(raw[r], g);
    const float sc = SUBN ? a.x * 16777216.0f : a.x;
    for (int s = 0; s < S; ++s) {
      d[r][s] = qd_gg_has_bias(FMT) ? fma(a.y, sx[s], (lo[r][s] + hi[r][s]) * sc) : (lo[r][s] + hi[r][s]) * sc;
    }
  }
}

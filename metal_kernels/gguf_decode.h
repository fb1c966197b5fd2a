// gguf_decode.h: unit loads and exact decoders of llama.cpp's GGUF block formats (QTensor fmt
// 11-28, colibri_mlx/formats/gguf_quant.py), for every kernel that reads quantized weights
// through qdecode.h (qgemv, moe_block, mla_decode). dispatch.decode_header puts this file in front
// of qdecode.h, whose qd_wpu / qd_words / qd_load / qd_decode8 hand the GGUF fmts to the
// functions here. The CUDA twin is metal_kernels/cuda/gguf_decode.cuh, same names without qd_.
//
// A GGUF row is I / block_size ggml blocks, stored exactly as ggml writes them; a block is only
// promised 2-byte alignment (Q8_0: 34 bytes), except where its size keeps it 8-byte aligned
// (Q4_K 144, IQ4_XS 136 bytes). A unit is a run of consecutive weights of one block:
// * Q8_0 (fmt 11): one 32-weight block: r[0..7] the int8 codes, r[8] the fp16 d;
// * Q4_K (17): 64 weights, sub-blocks 2p and 2p + 1 of a 256-weight block (p = u % 4): r[0..7] the
//   32 code bytes (sub-block 2p in the low nibbles), r[8] d | dmin << 16, r[9] their 6-bit scales
//   and mins (scale, min, scale, min bytes) resolved from the packed 12 bytes at load;
// * Q6_K (19): 32 weights, quarter q of half n of a block (c = u % 8 = 4n + q): r[0..7] the
//   6-bit codes one a byte (low 4 bits from ql, high 2 from qh, merged at load), r[8] the two
//   int8 16-weight scales | d << 16;
// * IQ4_XS (21): one 32-weight sub-block: r[0..3] 16 code bytes (weights 0-15 the low nibbles),
//   r[4] d | (6-bit scale) << 16;
// * IQ2_XXS (24): one 32-weight sub-block: r[0] 4 grid indices, r[1] 4 x 7 sign bits and the
//   4-bit scale, r[2] d.
// qd_decode8 gives each weight fully decoded (scales and mins applied): their segment scale is 1.
//
// The lookup-table input (the kernels' e8grid, kernels/gguf_decode.py lookup_words) holds the
// fmt 6 / IQ3_XXS grid at word 0, iq2xxs_grid at QD_GG_IQ2XXS (two words an entry: magnitudes
// 8, 25, 43 one a byte), kvalues_iq4nl as float32 at QD_GG_IQ4NL.

constant constexpr int QD_GG_IQ2XXS = 256;
constant constexpr int QD_GG_IQ4NL = 768;

constexpr bool qd_gguf(int fmt) {
  return fmt >= 11 && fmt <= 28;
}

// The GGUF fmts with a kernel decoder (kernels/gguf_decode.py KERNEL_FMTS).
constexpr int qd_gg_wpu(int fmt) {
  return fmt == 17 ? 64 : 32;
}

constexpr int qd_gg_words(int fmt) {
  return fmt == 11 ? 9 : (fmt == 17 ? 10 : (fmt == 19 ? 9 : (fmt == 21 ? 5 : 3)));
}

// Two little-endian bytes at p (2-byte aligned) / four bytes as two halves.
inline uint qd_gg_u16(const device uint8_t* p) {
  return uint(*(const device ushort*)p);
}
inline uint qd_gg_u32(const device uint8_t* p) {
  const device ushort* h = (const device ushort*)p;
  return uint(h[0]) | (uint(h[1]) << 16);
}

// fp16 bits (low half of h) as float.
inline float qd_gg_half(uint h) {
  return float(as_type<half>(ushort(h & 0xFFFFu)));
}

template <int FMT>
inline void qd_gg_load(const device uint8_t* wrow, int u, thread uint* r) {
  if (FMT == 11) {
    const device uint8_t* blk = wrow + 34 * u;
    for (int k = 0; k < 8; ++k) {
      r[k] = qd_gg_u32(blk + 2 + 4 * k);
    }
    r[8] = qd_gg_u16(blk);
  } else if (FMT == 17) {
    const device uint8_t* blk = wrow + 144 * (u >> 2);
    const int p = u & 3;
    const device uint2* h = (const device uint2*)blk;
    const device uint2* qs = (const device uint2*)(blk + 16 + 32 * p);
    const uint2 h0 = h[0];
    const uint2 h1 = h[1];
    for (int k = 0; k < 4; ++k) {
      const uint2 v = qs[k];
      r[2 * k] = v.x;
      r[2 * k + 1] = v.y;
    }
    // ggml's get_scale_min_k4 for sub-blocks j = 2p, 2p + 1: bytes t = j % 4 of scales[0..3]
    // (a), scales[4..7] (b), scales[8..11] (c); j < 4 takes the low 6 bits of a and b, j >= 4 the
    // nibbles of c with the top 2 bits of a and b.
    uint sm = 0;
    for (int e = 0; e < 2; ++e) {
      const int j = 2 * p + e;
      const int sh = 8 * (j & 3);
      const uint a = (h0.y >> sh) & 0xFFu;
      const uint b = (h1.x >> sh) & 0xFFu;
      const uint c = (h1.y >> sh) & 0xFFu;
      const uint sc = j < 4 ? (a & 63u) : ((c & 0xFu) | ((a >> 6) << 4));
      const uint mn = j < 4 ? (b & 63u) : ((c >> 4) | ((b >> 6) << 4));
      sm |= (sc | (mn << 8)) << (16 * e);
    }
    r[8] = h0.x;
    r[9] = sm;
  } else if (FMT == 19) {
    const device uint8_t* blk = wrow + 210 * (u >> 3);
    const int c = u & 7;
    const int n = c >> 2;
    const int q = c & 3;
    const device uint8_t* ql = blk + 64 * n + 32 * (q & 1);
    const device uint8_t* qh = blk + 128 + 32 * n;
    const int lsh = 4 * (q >> 1);
    const int hsh = 2 * q;
    for (int k = 0; k < 8; ++k) {
      r[k] = ((qd_gg_u32(ql + 4 * k) >> lsh) & 0x0F0F0F0Fu) | (((qd_gg_u32(qh + 4 * k) >> hsh) & 0x03030303u) << 4);
    }
    r[8] = qd_gg_u16(blk + 192 + 8 * n + 2 * q) | (qd_gg_u16(blk + 208) << 16);
  } else if (FMT == 21) {
    const device uint8_t* blk = wrow + 136 * (u >> 3);
    const int ib = u & 7;
    const uint2 h = *(const device uint2*)blk;
    const device uint2* qs = (const device uint2*)(blk + 8 + 16 * ib);
    const uint2 a = qs[0];
    const uint2 b = qs[1];
    r[0] = a.x; r[1] = a.y; r[2] = b.x; r[3] = b.y;
    const uint ls = ((h.y >> (4 * ib)) & 0xFu) | (((h.x >> (16 + 2 * ib)) & 3u) << 4);
    r[4] = (h.x & 0xFFFFu) | (ls << 16);
  } else if (FMT == 24) {
    const device uint8_t* blk = wrow + 66 * (u >> 3);
    const device uint8_t* qs = blk + 2 + 8 * (u & 7);
    r[0] = qd_gg_u32(qs);
    r[1] = qd_gg_u32(qs + 4);
    r[2] = qd_gg_u16(blk);
  }
}

// Weights k0 .. k0 + 7 of a unit (k0 a multiple of 8), decoded as ggml's dequantize_row_* does in
// float32. Integer codes go through the mantissa of 2^23 (no int->float conversion).
template <int FMT>
inline void qd_gg_decode8(thread const uint* r, int k0, const device uint* lut, thread float* q) {
  if (FMT == 11) {
    const float d = qd_gg_half(r[8]);
    for (int k = 0; k < 8; ++k) {
      const uint b = (r[(k0 + k) >> 2] >> (8 * ((k0 + k) & 3))) & 0xFFu;
      q[k] = (as_type<float>(0x4B000000u | (b ^ 0x80u)) - 8388736.0f) * d;
    }
  } else if (FMT == 17) {
    const int e = k0 >> 5;
    const uint sm = r[9] >> (16 * e);
    const float d1 = qd_gg_half(r[8]) * float(sm & 0xFFu);
    const float m1 = qd_gg_half(r[8] >> 16) * float((sm >> 8) & 0xFFu);
    const int l0 = k0 & 31;
    for (int k = 0; k < 8; ++k) {
      const uint b = (r[(l0 + k) >> 2] >> (8 * ((l0 + k) & 3) + 4 * e)) & 0xFu;
      q[k] = fma(as_type<float>(0x4B000000u | b) - 8388608.0f, d1, -m1);
    }
  } else if (FMT == 19) {
    const int sh = 8 * (k0 >> 4);
    const float sc = float(int(r[8] << (24 - sh)) >> 24);
    const float dl = qd_gg_half(r[8] >> 16) * sc;
    for (int k = 0; k < 8; ++k) {
      const uint b = (r[(k0 + k) >> 2] >> (8 * ((k0 + k) & 3))) & 0xFFu;
      q[k] = (as_type<float>(0x4B000000u | b) - 8388640.0f) * dl;
    }
  } else if (FMT == 21) {
    const float dl = qd_gg_half(r[4]) * float(int(r[4] >> 16) - 32);
    const int l0 = k0 & 15;
    const int nsh = 4 * (k0 >> 4);
    for (int k = 0; k < 8; ++k) {
      const uint n = (r[(l0 + k) >> 2] >> (8 * ((l0 + k) & 3) + nsh)) & 0xFu;
      q[k] = dl * as_type<float>(lut[QD_GG_IQ4NL + n]);
    }
  } else if (FMT == 24) {
    const int l = k0 >> 3;
    const float db = qd_gg_half(r[2]) * (0.5f + float(r[1] >> 28)) * 0.25f;
    const uint idx = (r[0] >> (8 * l)) & 0xFFu;
    const uint g0 = lut[QD_GG_IQ2XXS + 2 * idx];
    const uint g1 = lut[QD_GG_IQ2XXS + 2 * idx + 1];
    const uint seven = (r[1] >> (7 * l)) & 0x7Fu;
    const uint s8 = seven | ((popcount(seven) << 7) & 0x80u);   // the 8th sign: an even count of -
    for (int k = 0; k < 8; ++k) {
      const uint m = ((k < 4 ? g0 : g1) >> (8 * (k & 3))) & 0xFFu;
      const float w = db * (as_type<float>(0x4B000000u | m) - 8388608.0f);
      q[k] = as_type<float>(as_type<uint>(w) ^ (((s8 >> k) & 1u) << 31));
    }
  }
}

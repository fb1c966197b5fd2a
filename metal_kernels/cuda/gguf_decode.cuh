// gguf_decode.cuh: CUDA twin of metal_kernels/gguf_decode.h (same names without the qd_ prefix,
// in namespace colibri_qd; same algorithm and unit layouts): unit loads and exact decoders of
// llama.cpp's GGUF block formats (fmt 11-28). dispatch.decode_header puts this file in front of
// qdecode.cuh, whose wpu / words / load / decode8 hand the GGUF fmts to the functions here.

namespace colibri_qd {

// Word offsets in the lookup-table input (gguf_decode.h; kernels/gguf_decode.py lookup_words).
__device__ constexpr int GG_IQ2XXS = 256;
__device__ constexpr int GG_IQ4NL = 768;

__device__ constexpr bool gguf(int fmt) {
  return fmt >= 11 && fmt <= 28;
}

__device__ constexpr int gg_wpu(int fmt) {
  return fmt == 17 ? 64 : 32;
}

__device__ constexpr int gg_words(int fmt) {
  return fmt == 11 ? 9 : (fmt == 17 ? 10 : (fmt == 19 ? 9 : (fmt == 21 ? 5 : 3)));
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

template <int FMT>
__device__ __forceinline__ void gg_load(const uint8_t* wrow, int u, uint32_t* r) {
  if (FMT == 11) {
    const uint8_t* blk = wrow + 34 * u;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      r[k] = gg_u32(blk + 2 + 4 * k);
    }
    r[8] = gg_u16(blk);
  } else if (FMT == 17) {
    const uint8_t* blk = wrow + 144 * (u >> 2);
    const int p = u & 3;
    const uint2* h = reinterpret_cast<const uint2*>(blk);
    const uint2* qs = reinterpret_cast<const uint2*>(blk + 16 + 32 * p);
    const uint2 h0 = h[0];
    const uint2 h1 = h[1];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint2 v = qs[k];
      r[2 * k] = v.x;
      r[2 * k + 1] = v.y;
    }
    uint32_t sm = 0;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int j = 2 * p + e;
      const int sh = 8 * (j & 3);
      const uint32_t a = (h0.y >> sh) & 0xFFu;
      const uint32_t b = (h1.x >> sh) & 0xFFu;
      const uint32_t c = (h1.y >> sh) & 0xFFu;
      const uint32_t sc = j < 4 ? (a & 63u) : ((c & 0xFu) | ((a >> 6) << 4));
      const uint32_t mn = j < 4 ? (b & 63u) : ((c >> 4) | ((b >> 6) << 4));
      sm |= (sc | (mn << 8)) << (16 * e);
    }
    r[8] = h0.x;
    r[9] = sm;
  } else if (FMT == 19) {
    const uint8_t* blk = wrow + 210 * (u >> 3);
    const int c = u & 7;
    const int n = c >> 2;
    const int q = c & 3;
    const uint8_t* ql = blk + 64 * n + 32 * (q & 1);
    const uint8_t* qh = blk + 128 + 32 * n;
    const int lsh = 4 * (q >> 1);
    const int hsh = 2 * q;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      r[k] = ((gg_u32(ql + 4 * k) >> lsh) & 0x0F0F0F0Fu) | (((gg_u32(qh + 4 * k) >> hsh) & 0x03030303u) << 4);
    }
    r[8] = gg_u16(blk + 192 + 8 * n + 2 * q) | (gg_u16(blk + 208) << 16);
  } else if (FMT == 21) {
    const uint8_t* blk = wrow + 136 * (u >> 3);
    const int ib = u & 7;
    const uint2 h = *reinterpret_cast<const uint2*>(blk);
    const uint2* qs = reinterpret_cast<const uint2*>(blk + 8 + 16 * ib);
    const uint2 a = qs[0];
    const uint2 b = qs[1];
    r[0] = a.x; r[1] = a.y; r[2] = b.x; r[3] = b.y;
    const uint32_t ls = ((h.y >> (4 * ib)) & 0xFu) | (((h.x >> (16 + 2 * ib)) & 3u) << 4);
    r[4] = (h.x & 0xFFFFu) | (ls << 16);
  } else if (FMT == 24) {
    const uint8_t* blk = wrow + 66 * (u >> 3);
    const uint8_t* qs = blk + 2 + 8 * (u & 7);
    r[0] = gg_u32(qs);
    r[1] = gg_u32(qs + 4);
    r[2] = gg_u16(blk);
  }
}

template <int FMT>
__device__ __forceinline__ void gg_decode8(const uint32_t* r, int k0, const uint32_t* lut, float* q) {
  if (FMT == 11) {
    const float d = gg_half(r[8]);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t b = (r[(k0 + k) >> 2] >> (8 * ((k0 + k) & 3))) & 0xFFu;
      q[k] = (__uint_as_float(0x4B000000u | (b ^ 0x80u)) - 8388736.0f) * d;
    }
  } else if (FMT == 17) {
    const int e = k0 >> 5;
    const uint32_t sm = r[9] >> (16 * e);
    const float d1 = gg_half(r[8]) * float(sm & 0xFFu);
    const float m1 = gg_half(r[8] >> 16) * float((sm >> 8) & 0xFFu);
    const int l0 = k0 & 31;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t b = (r[(l0 + k) >> 2] >> (8 * ((l0 + k) & 3) + 4 * e)) & 0xFu;
      q[k] = fmaf(__uint_as_float(0x4B000000u | b) - 8388608.0f, d1, -m1);
    }
  } else if (FMT == 19) {
    const int sh = 8 * (k0 >> 4);
    const float sc = float(int(r[8] << (24 - sh)) >> 24);
    const float dl = gg_half(r[8] >> 16) * sc;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t b = (r[(k0 + k) >> 2] >> (8 * ((k0 + k) & 3))) & 0xFFu;
      q[k] = (__uint_as_float(0x4B000000u | b) - 8388640.0f) * dl;
    }
  } else if (FMT == 21) {
    const float dl = gg_half(r[4]) * float(int(r[4] >> 16) - 32);
    const int l0 = k0 & 15;
    const int nsh = 4 * (k0 >> 4);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t n = (r[(l0 + k) >> 2] >> (8 * ((l0 + k) & 3) + nsh)) & 0xFu;
      q[k] = dl * __uint_as_float(lut[GG_IQ4NL + n]);
    }
  } else if (FMT == 24) {
    const int l = k0 >> 3;
    const float db = gg_half(r[2]) * (0.5f + float(r[1] >> 28)) * 0.25f;
    const uint32_t idx = (r[0] >> (8 * l)) & 0xFFu;
    const uint32_t g0 = lut[GG_IQ2XXS + 2 * idx];
    const uint32_t g1 = lut[GG_IQ2XXS + 2 * idx + 1];
    const uint32_t seven = (r[1] >> (7 * l)) & 0x7Fu;
    const uint32_t s8 = seven | ((uint32_t(__popc(seven)) << 7) & 0x80u);   // the 8th sign: an even count of -
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t m = ((k < 4 ? g0 : g1) >> (8 * (k & 3))) & 0xFFu;
      const float w = db * (__uint_as_float(0x4B000000u | m) - 8388608.0f);
      q[k] = __uint_as_float(__float_as_uint(w) ^ (((s8 >> k) & 1u) << 31));
    }
  }
}

}  // namespace colibri_qd

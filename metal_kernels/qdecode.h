// qdecode.h: the fmt 0-6 and MLX-format unit loads, exact decoders and segment dot products shared by every
// kernel that reads colibri-quantized weights (qgemv, moe_block, mla_decode). The Python side
// prepends this file to each kernel's own header (dispatch.decode_header). The CUDA twin is
// metal_kernels/cuda/qdecode.cuh, same names and algorithm.
//
// A row is cut into "units": 16 bytes = 16/32/64/32 weights for fmt 1/2/3/4, one 24-byte
// group of 64 weights for fmt 5, one 32-weight sub-block for fmt 6, 8 float32 weights (32
// bytes) for fmt 0. A unit's raw words fill r[0 .. qd_words(FMT) - 1].
//
// Codes are built exactly without int->float conversions (a quarter of the FMA rate):
// * fmt 2/4 decode two nibbles per instruction: a nibble pair (n, n') at bits 0 and 16 OR-ed
//   into 0x6400 (half 1024) is the half2 (1024 + n, 1024 + n'); one half2 subtract of 1032
//   gives (n - 8, n' - 8) exactly (the high nibble of a byte: mask 0x00F0, half 1024 + 16n,
//   one half2 FMA by 1/16 then -72);
// * fmt 1/3/5/6 build codes in the mantissa of 2^23 and subtract.
// Products and sums are float32. Scales: fmt 4/5/6 per segment (qd_seg_scale), fmt 1-3 one
// per row applied by the caller after its reduction (qd_row_scale).
//
// llama.cpp's GGUF block formats (fmt 11-28) are gguf_decode.h, which the Python side puts in
// front of this file; the functions below hand them to its qd_gg_* loads and decoders.

// MLX's quantization formats (colibri_mlx/kernels/mlx_formats.py) take FMT codes of their own:
// affine 70 + bits / 80 + bits / 90 + bits (bfloat16 / float16 / float32 scales and biases),
// 8 mxfp4, 9 nvfp4, 10 mxfp8. A unit is 32 weights: `bits` words of the row's LSB-first bit
// stream (3/5/6-bit codes straddle words), then the unit's scale words (qd_load_aux): affine one
// word holding the 16-bit scale (low half) and bias (high half), or the float32 scale and bias;
// the fp modes the unit's scale byte(s).
constexpr bool qd_mlx(int fmt) {
  return (fmt >= 8 && fmt <= 10) || fmt >= 70;
}
constexpr bool qd_affine(int fmt) {
  return fmt >= 70;
}
constexpr int qd_mlx_bits(int fmt) {
  return fmt >= 70 ? fmt % 10 : (fmt == 10 ? 8 : 4);
}

// FMT 60: bfloat16 rows (a float weight held in bfloat16, read as stored: half the bytes of fmt 0's
// float32), a unit is 16 weights in 8 words, weight j in the low (even j) or high half of word j / 2.
constexpr int QD_BF16_ROWS = 60;

constexpr int qd_wpu(int fmt) {
  return qd_gguf(fmt) ? qd_gg_wpu(fmt) : fmt == 0 ? 8 : ((fmt == 1 || fmt == QD_BF16_ROWS) ? 16 : (fmt == 3 ? 64 : (fmt == 5 ? 64 : 32)));
}

// Raw 32-bit words of one unit.
constexpr int qd_words(int fmt) {
  return qd_gguf(fmt) ? qd_gg_words(fmt) : (fmt == 0 || fmt == QD_BF16_ROWS) ? 8 : (qd_mlx(fmt) ? qd_mlx_bits(fmt) + (fmt >= 90 ? 2 : 1) : 6);
}

// Weights per scale segment: fmt 4 with a group size that is not a multiple of 32 changes
// scale in the middle of a 32-weight unit, nvfp4 (groups of 16) likewise; every other case has
// one scale per unit.
constexpr int qd_seg(int fmt, int gs) {
  return qd_gguf(fmt) ? qd_gg_seg(fmt) : ((fmt == 4 && gs % 32 != 0) || fmt == 9) ? 16 : qd_wpu(fmt);
}

// Raw bytes of unit u of one row (rb bytes) into r[0 .. qd_words(FMT) - 1], little-endian.
// VEC 2: rows a multiple of 16 bytes, 1: of 8 bytes (8-byte loads); 0: byte loads that stop
// at the row end (fmt 1-4). A packed buffer is only promised 8-byte alignment.
template <int FMT, int VEC>
inline void qd_load(const device uint8_t* wrow, int rb, int u, thread uint* r) {
  if (FMT == 0 || FMT == QD_BF16_ROWS) {
    // float32 / bfloat16 rows (8 words a unit either way): 4-byte aligned; weights past the row
    // read as 0.
    const device uint* p = (const device uint*)(wrow) + 8 * u;
    for (int k = 0; k < 8; ++k) {
      r[k] = (32 * u + 4 * k < rb) ? p[k] : 0u;
    }
  } else if (FMT == 5) {
    // 24-byte groups: every row and group start is 8-byte aligned.
    const device uint2* p = (const device uint2*)(wrow + 24 * u);
    const uint2 a = p[0];
    const uint2 b = p[1];
    const uint2 c = p[2];
    r[0] = a.x; r[1] = a.y; r[2] = b.x; r[3] = b.y; r[4] = c.x; r[5] = c.y;
  } else if (FMT == 6) {
    // 98-byte super-blocks are only 2-byte aligned.
    const int blk = 98 * (u >> 3);
    const int ib = u & 7;
    const device ushort* qs = (const device ushort*)(wrow + blk + 8 * ib);
    const device ushort* sw = (const device ushort*)(wrow + blk + 64 + 4 * ib);
    const device ushort* dd = (const device ushort*)(wrow + blk + 96);
    r[0] = uint(qs[0]) | (uint(qs[1]) << 16);
    r[1] = uint(qs[2]) | (uint(qs[3]) << 16);
    r[2] = uint(sw[0]) | (uint(sw[1]) << 16);
    r[3] = uint(dd[0]);
  } else if (qd_gguf(FMT)) {
    qd_gg_load<FMT>(wrow, u, r);
  } else if (qd_mlx(FMT)) {
    // `bits` whole words: rows and units start 4-byte aligned.
    const device uint* p = (const device uint*)(wrow) + qd_mlx_bits(FMT) * u;
    for (int k = 0; k < qd_mlx_bits(FMT); ++k) {
      r[k] = p[k];
    }
  } else if (VEC) {
    // Two 8-byte loads. With rows a multiple of 8 but not 16 bytes, the second half of a
    // row's last unit lies past the row.
    const device uint2* p = (const device uint2*)(wrow + 16 * u);
    const uint2 a = p[0];
    const uint2 b = (VEC == 2 || 16 * u + 8 < rb) ? p[1] : uint2(0u, 0u);
    r[0] = a.x; r[1] = a.y; r[2] = b.x; r[3] = b.y;
  } else {
    // Row length not a multiple of 8: byte loads, none past the end of the row.
    const int off = 16 * u;
    for (int m = 0; m < 4; ++m) {
      uint v = 0;
      for (int k = 0; k < 4; ++k) {
        if (off + 4 * m + k < rb) {
          v |= uint(wrow[off + 4 * m + k]) << (8 * k);
        }
      }
      r[m] = v;
    }
  }
}

// The unit's scale words of the MLX formats into r after its code words (a no-op for fmt 0-6).
// scales: ng 32-bit words a row (kernels/mlx_formats.py kernel_scales): affine one word per group
// of GS weights (two for FMT 90+), the fp modes the row's scale bytes padded to whole words.
template <int FMT, int GS>
inline void qd_load_aux(const device float* scales, int row, int ng, int u, thread uint* r) {
  constexpr int B = qd_mlx_bits(FMT);
  if (qd_affine(FMT)) {
    const device uint* sw = (const device uint*)scales + row * ng;
    if (FMT >= 90) {
      const int gi = 2 * ((32 * u) / GS);
      r[B] = sw[gi];
      r[qd_words(FMT) - 1] = sw[gi + 1];
    } else {
      r[B] = sw[(32 * u) / GS];
    }
  } else if (FMT == 8 || FMT == 10) {
    r[B] = uint(((const device uint8_t*)scales)[4 * row * ng + u]);
  } else if (FMT == 9) {
    const device uint8_t* sb = (const device uint8_t*)scales + 4 * row * ng + 2 * u;
    r[B] = uint(sb[0]) | (uint(sb[1]) << 8);
  }
}

// E4M3 code c (bias 7) as float: its bits placed in a half (bias 15) are the value * 2^-8
// exactly, subnormals included.
inline float qd_e4m3(uint c) {
  return float(as_type<half>(ushort(((c & 0x80u) << 8) | ((c & 0x7Fu) << 7)))) * 256.0f;
}

// E8M0 byte e as MLX reads it (the float32 with exponent bits e; e = 0 the subnormal 2^-127)
// times 2^P: e = 0 gives 2^(P - 127) directly (the float with exponent bits P), a normal float,
// so a GPU that flushes subnormals still decodes it as MLX does.
template <int P>
inline float qd_e8m0_times(uint e) {
  return e == 0u ? as_type<float>(uint(P) << 23) : as_type<float>(e << 23) * float(1u << P);
}

// Scale of segment g of unit u of row `row`: fmt 4 its group's, fmt 5 its group's, fmt 6
// d * (0.5 + code) / 4 (the grid holds doubled magnitudes); 1 for fmt 0-3 and MLX affine (qd_seg_dots
// applies its scale and bias). The MLX fp modes: E8M0 (2^(e-127): the float32 with exponent
// bits e) or E4M3, times 2^14 for E2M1 codes and 2^8 for E4M3 codes (qd_decode8 builds codes
// as halves scaled down by those powers). A fmt 4 half-unit past the row end (its x are zero)
// clamps to the row's last group.
template <int FMT, int GS>
inline float qd_seg_scale(const device float* scales, int row, int ng, int u, int g,
                          thread const uint* r) {
  if (FMT == 8) {
    return qd_e8m0_times<14>(r[4] & 0xFFu);
  } else if (FMT == 9) {
    return qd_e4m3((r[4] >> (8 * g)) & 0xFFu) * 16384.0f;
  } else if (FMT == 10) {
    return qd_e8m0_times<8>(r[8] & 0xFFu);
  } else if (FMT == 4) {
    return scales[row * ng + min((32 * u + qd_seg(FMT, GS) * g) / GS, ng - 1)];
  } else if (FMT == 5) {
    return scales[row * ng + u];
  } else if (FMT == 6) {
    const float d = float(as_type<half>(ushort(r[3])));
    return d * (0.5f + float(r[2] >> 28)) * 0.25f;
  }
  return 1.0f;
}

// fmt 4/5 read their segment scales from memory: the kernels load them in the same phase as
// the weights (so the latency overlaps); fmt 6 decodes its scale from the unit's own bytes.
constexpr bool qd_scales_in_memory(int fmt) {
  return fmt == 4 || fmt == 5;
}

// fmt 1-3: the row's one scale, applied after the row's reduction; 1 otherwise.
template <int FMT>
inline float qd_row_scale(const device float* scales, int row) {
  return (FMT >= 1 && FMT <= 3) ? scales[row] : 1.0f;
}

// A code c < 2^23 OR-ed into the mantissa of 2^23 is the float 2^23 + c exactly; one FADD of
// -(2^23 + offset) then gives c - offset exactly.
inline float qd_code(uint c, float magic_plus_offset) {
  return as_type<float>(0x4B000000u | c) - magic_plus_offset;
}

// Nibbles n at bits 0 and 16 of b (lo) or 4 and 20 (hi), as the floats n - 8.
inline float2 qd_nib_lo(uint b) {
  return float2(as_type<half2>((b & 0x000F000Fu) | 0x64006400u) - half2(half(1032.0f)));
}
inline float2 qd_nib_hi(uint b) {
  return float2(fma(as_type<half2>((b & 0x00F000F0u) | 0x64006400u), half2(half(0.0625f)), half2(half(-72.0f))));
}

// Codes (fmt 0: the weights, fmt 6: signed grid magnitudes) of weights k0 .. k0 + 7 of a
// unit, in weight order. k0 is a multiple of 8.
// An affine unit's scale and bias (one group: units never straddle groups) from its scale
// words: bfloat16 / float16 halves of one word, or two float32 words.
template <int FMT>
inline void qd_affine_scale_bias(thread const uint* r, thread float& sc, thread float& bi) {
  constexpr int B = qd_mlx_bits(FMT);
  const uint sb = r[B];
  sc = FMT >= 90 ? as_type<float>(sb) : (FMT >= 80 ? float(as_type<half2>(sb).x) : as_type<float>(sb << 16));
  bi = FMT >= 90 ? as_type<float>(r[qd_words(FMT) - 1])
                 : (FMT >= 80 ? float(as_type<half2>(sb).y) : as_type<float>(sb & 0xFFFF0000u));
}

// The 8 unsigned codes k0 .. k0 + 7 of an affine unit as exact floats, from one 64-bit window of
// the bit stream (8 * bits bits starting at bit 8 * bits * (k0 / 8): shift + 8 * bits <= 64).
template <int FMT>
inline void qd_affine_codes8(thread const uint* r, int k0, thread float* q) {
  constexpr int B = qd_mlx_bits(FMT);
  const int off = k0 * B;
  const ulong v = (ulong(r[off >> 5]) | (ulong(r[(off >> 5) + 1]) << 32)) >> (off & 31);
  for (int k = 0; k < 8; ++k) {
    q[k] = qd_code(uint(v >> (B * k)) & ((1u << B) - 1u), 8388608.0f);
  }
}

template <int FMT>
inline void qd_decode8(thread const uint* r, int k0, const device uint* e8grid, thread float* q) {
  if (qd_gguf(FMT)) {
    qd_gg_decode8<FMT>(r, k0, e8grid, q);
  } else if (FMT == 0) {
    for (int k = 0; k < 8; ++k) {
      q[k] = as_type<float>(r[k0 + k]);
    }
  } else if (FMT == QD_BF16_ROWS) {
    // bfloat16 bits as the high half of a float32 (exact); k0 is even.
    for (int k = 0; k < 8; k += 2) {
      const uint w = r[(k0 + k) >> 1];
      q[k] = as_type<float>(w << 16);
      q[k + 1] = as_type<float>(w & 0xFFFF0000u);
    }
  } else if (FMT == 1) {
    // Two's complement byte b: (b ^ 0x80) - 128.
    for (int k = 0; k < 8; ++k) {
      q[k] = qd_code(((r[(k0 + k) >> 2] >> (8 * (k & 3))) & 0xFFu) ^ 0x80u, 8388736.0f);
    }
  } else if (FMT == 2 || FMT == 4) {
    // Weight k in nibble k of the word (even weight in the low nibble), stored code = value + 8.
    const uint b = r[k0 >> 3];
    const float2 n04 = qd_nib_lo(b);
    const float2 n15 = qd_nib_hi(b);
    const float2 n26 = qd_nib_lo(b >> 8);
    const float2 n37 = qd_nib_hi(b >> 8);
    q[0] = n04.x; q[1] = n15.x; q[2] = n26.x; q[3] = n37.x;
    q[4] = n04.y; q[5] = n15.y; q[6] = n26.y; q[7] = n37.y;
  } else if (FMT == 3) {
    for (int k = 0; k < 8; ++k) {
      q[k] = qd_code((r[(k0 + k) >> 4] >> (2 * ((k0 + k) & 15))) & 3u, 8388610.0f);
    }
  } else if (FMT == 5) {
    // Bytes 0..15: low 2 bits of each code; bytes 16..23: bit 2.
    for (int k = 0; k < 8; ++k) {
      const int i = k0 + k;
      const uint lo = (r[i >> 4] >> (2 * (i & 15))) & 3u;
      const uint hi = (r[4 + (i >> 5)] >> (i & 31)) & 1u;
      q[k] = qd_code(lo | (hi << 2), 8388612.0f);
    }
  } else if (qd_affine(FMT)) {
    // w = q * scale + bias.
    float sc, bi;
    qd_affine_scale_bias<FMT>(r, sc, bi);
    qd_affine_codes8<FMT>(r, k0, q);
    for (int k = 0; k < 8; ++k) {
      q[k] = fma(q[k], sc, bi);
    }
  } else if (FMT == 8 || FMT == 9) {
    // E2M1 nibble c (weight k in nibble k): its bits in a half are the value * 2^-14 (sign to
    // bit 15, the 3 magnitude bits to bits 9-11). Nibbles k and k + 4 lie 16 bits apart: each
    // pair becomes one half2 and one conversion.
    const uint b = r[k0 >> 3];
    const float2 v04 = float2(as_type<half2>(((b & 0x00080008u) << 12) | ((b & 0x00070007u) << 9)));
    const float2 v15 = float2(as_type<half2>(((b & 0x00800080u) << 8) | ((b & 0x00700070u) << 5)));
    const float2 v26 = float2(as_type<half2>(((b & 0x08000800u) << 4) | ((b & 0x07000700u) << 1)));
    const float2 v37 = float2(as_type<half2>((b & 0x80008000u) | ((b & 0x70007000u) >> 3)));
    q[0] = v04.x; q[1] = v15.x; q[2] = v26.x; q[3] = v37.x;
    q[4] = v04.y; q[5] = v15.y; q[6] = v26.y; q[7] = v37.y;
  } else if (FMT == 10) {
    // E4M3 byte c: its bits in a half are the value * 2^-8; bytes 0/2 and 1/3 of a word as
    // half2 pairs.
    for (int h = 0; h < 2; ++h) {
      const uint b = r[(k0 >> 2) + h];
      const float2 v02 = float2(as_type<half2>(((b & 0x00800080u) << 8) | ((b & 0x007F007Fu) << 7)));
      const float2 v13 = float2(as_type<half2>((b & 0x80008000u) | ((b & 0x7F007F00u) >> 1)));
      q[4 * h] = v02.x; q[4 * h + 1] = v13.x; q[4 * h + 2] = v02.y; q[4 * h + 3] = v13.y;
    }
  } else if (FMT == 6) {
    // 8 weights = one 7-bit sign field; the 8th sign makes the count of negatives even.
    const int l = k0 >> 3;
    const uint seven = (r[2] >> (7 * l)) & 0x7Fu;
    const uint s8 = seven | ((popcount(seven) & 1u) << 7);
    for (int h = 0; h < 2; ++h) {
      const int b = 2 * l + h;
      const uint g = e8grid[(r[b >> 2] >> (8 * (b & 3))) & 0xFFu];
      for (int j = 0; j < 4; ++j) {
        const float mag = qd_code((g >> (8 * j)) & 0xFFu, 8388608.0f);
        q[4 * h + j] = as_type<float>(as_type<uint>(mag) ^ (((s8 >> (4 * h + j)) & 1u) << 31));
      }
    }
  }
}

// Eight consecutive values as raw 16-byte words (one uint4 for 2-byte types, two for float),
// widened to float separately: a caller that wants the loads in flight across other work
// (mla_attn_mma's next chunk) keeps the words and widens them later.
inline void qd_load8_raw(const device float* p, thread uint4* w) {
  w[0] = *((const device uint4*)p);
  w[1] = *((const device uint4*)(p + 4));
}
inline void qd_load8_raw(const device half* p, thread uint4* w) {
  w[0] = *((const device uint4*)p);
}
inline void qd_load8_raw(const device bfloat16_t* p, thread uint4* w) {
  w[0] = *((const device uint4*)p);
}

// The words of qd_load8_raw as float; the pointer argument only selects the type.
inline void qd_widen8(const thread uint4* w, thread float* o, const device float*) {
  const uint v[8] = {w[0].x, w[0].y, w[0].z, w[0].w, w[1].x, w[1].y, w[1].z, w[1].w};
  for (int k = 0; k < 8; ++k) {
    o[k] = as_type<float>(v[k]);
  }
}
inline void qd_widen8(const thread uint4* w, thread float* o, const device half*) {
  const uint v[4] = {w[0].x, w[0].y, w[0].z, w[0].w};
  for (int m = 0; m < 4; ++m) {
    const float2 f = float2(as_type<half2>(v[m]));
    o[2 * m] = f.x;
    o[2 * m + 1] = f.y;
  }
}
inline void qd_widen8(const thread uint4* w, thread float* o, const device bfloat16_t*) {
  const uint v[4] = {w[0].x, w[0].y, w[0].z, w[0].w};
  for (int m = 0; m < 4; ++m) {       // bfloat16 is the top half of a float32: a shift or a mask
    o[2 * m] = as_type<float>(v[m] << 16);
    o[2 * m + 1] = as_type<float>(v[m] & 0xFFFF0000u);
  }
}

// Eight consecutive x values as float from one or two 16-byte loads.
template <typename T>
inline void qd_load_x8(const device T* p, thread float* o) {
  uint4 w[2];
  qd_load8_raw(p, w);
  qd_widen8(w, o, p);
}

// x[i .. i + 7] of one row of x as float, zero past I (so padding codes contribute nothing).
// XV 1: the row starts 16-byte aligned (vector loads); XV 2: also i + 8 <= I is known (the
// caller checked its whole unit), no per-8 test.
template <int XV, typename T>
inline void qd_x8(const device T* xs, int I, int i, thread float* o) {
  if (XV == 2 || (XV && i + 8 <= I)) {
    qd_load_x8(xs + i, o);
  } else {
    for (int k = 0; k < 8; ++k) {
      o[k] = (i + k < I) ? float(xs[i + k]) : 0.0f;
    }
  }
}

// The layout moe_gate_up writes h in for moe_down (XP 1): a row of I floats padded to whole
// units of WPU, stored in 4-value (16-byte) chunks ordered (chunk within the unit, unit), so
// the lanes of a SIMD group, which read consecutive units, read consecutive 16 bytes (row
// order makes each lane's 16 bytes a separate cache line: 8x the L1 traffic per value).
template <int WPU>
inline int qd_xp_index(int I, int i) {
  const int nu = (I + WPU - 1) / WPU;
  const int u = i / WPU;
  const int r = i - WPU * u;
  return ((r >> 2) * nu + u) * 4 + (r & 3);
}

// x[i .. i + 7] (i = WPU * u + k0, k0 a multiple of 8) of one row of x as float, zero past I.
// XP 0: the row in order (qd_x8); XP 1: qd_xp_index's layout, x float.
template <int XV, int XP, int WPU, typename T>
inline void qd_xs8(const device T* xs, int I, int u, int k0, thread float* o) {
  const int i = WPU * u + k0;
  if (XP) {
    const int nu = (I + WPU - 1) / WPU;
    const device float* p0 = reinterpret_cast<const device float*>(xs) + ((k0 >> 2) * nu + u) * 4;
    const device float* p1 = p0 + 4 * nu;
    if (XV == 2 || (XV && i + 8 <= I)) {
      const float4 a = *reinterpret_cast<const device float4*>(p0);
      const float4 b = *reinterpret_cast<const device float4*>(p1);
      o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
      o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
    } else {
      for (int k = 0; k < 4; ++k) {
        o[k] = (i + k < I) ? p0[k] : 0.0f;
        o[4 + k] = (i + 4 + k < I) ? p1[k] : 0.0f;
      }
    }
  } else {
    qd_x8<XV, T>(xs, I, i, o);
  }
}

// fmt 2/4 codes n (= value + 8) of the 8 nibbles of b as exact fp16 subnormals: b AND 0x000F000F
// is the half2 (n0, n4) * 2^-24, AND 0x00F000F0 is (16 n1, 16 n5) * 2^-24 (bit patterns below
// 2^11 are linear in the value), one exact conversion each to float. No magic OR, no bias op:
// q[k] = n_k 2^-24 (k even), 16 n_k 2^-24 (k odd); qd_seg_dots_sum_x applies 2^24, 1/16 and -8.
inline void qd_nib8_sub(uint b, thread float* q) {
  const uint b8 = b >> 8;
  const float2 f04 = float2(as_type<half2>(b & 0x000F000Fu));
  const float2 f15 = float2(as_type<half2>(b & 0x00F000F0u));
  const float2 f26 = float2(as_type<half2>(b8 & 0x000F000Fu));
  const float2 f37 = float2(as_type<half2>(b8 & 0x00F000F0u));
  q[0] = f04.x; q[1] = f15.x; q[2] = f26.x; q[3] = f37.x;
  q[4] = f04.y; q[5] = f15.y; q[6] = f26.y; q[7] = f37.y;
}

// qd_seg_dots over exact unscaled codes q and sum x, once per segment for all ROWS rows, then
// d = s (sum q x) + b (sum x) a row:
// * fmt 2/4 (NIB 1): sum (n - 8) x, s = 1, b = -8, nibble codes n from qd_nib8_sub;
// * the MLX affine formats: sum (q s + b) x over a segment (one unit, inside one group), s and b
//   the group's; with NIB 1 4-bit codes from qd_nib8_sub (MLX packs nibbles LSB-first as fmt 4),
//   else from qd_affine_codes8: two FMAs a segment for scale and bias instead of one a weight.
// qd_nib8_sub's codes are n 2^-24 (even k) and 16 n 2^-24 (odd k): two FMA chains, lo / hi,
// scaled by 2^24 and 2^20 at the end. Each product is one rounding; the b sum x step adds an
// error of a few 2^-24 of |b| sum |x| (the kernel tests bound |delta| by 1e-4 sum |x w|).
template <int FMT, int GS, int S, int ROWS, int XV, int W, typename T, int NIB, int XP = 0>
inline void qd_seg_dots_sum_x(thread const uint (*raw)[W], const device T* x, thread const int* xoff,
                              uint xmask, int I, int u, int g, thread float (*d)[S]) {
  constexpr int WPU = qd_wpu(FMT);
  constexpr int SEG = qd_seg(FMT, GS);
  constexpr bool NIBBLES = !qd_affine(FMT) || (NIB && qd_mlx_bits(FMT) == 4);
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
      if (NIBBLES) {
        qd_nib8_sub(raw[r][k0 >> 3], q[r]);
      } else {
        qd_affine_codes8<FMT>(raw[r], k0, q[r]);
      }
    }
    for (int s = 0; s < S; ++s) {
      if ((xmask >> s) & 1u) {
        float xf[8];
        qd_xs8<XV, XP, WPU, T>(x + xoff[s], I, u, k0, xf);
        sx[s] += ((xf[0] + xf[1]) + (xf[2] + xf[3])) + ((xf[4] + xf[5]) + (xf[6] + xf[7]));
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
    float sc = 1.0f;
    float bi = -8.0f;
    if (qd_affine(FMT)) {
      qd_affine_scale_bias<FMT>(raw[r], sc, bi);
    }
    for (int s = 0; s < S; ++s) {
      const float qx = NIBBLES ? fma(hi[r][s], 1048576.0f, lo[r][s] * 16777216.0f) : lo[r][s] + hi[r][s];
      d[r][s] = fma(bi, sx[s], qx * sc);
    }
  }
}

// d[r][s] = sum over segment g of unit u of row r of code * x[xoff[s] + i] (unscaled), for the
// rows of x whose bit is set in `xmask` (the others stay 0). The x values of each 8 weights
// are widened once for all ROWS rows; each decoded weight is applied to every row of x.
// NIB 1: fmt 2/4 via qd_seg_dots_sum_x (fp16 subnormal codes, one bias per segment); NIB 0:
// qd_decode8's magic-number codes. XP 1: x rows in qd_xp_index's layout (float).
template <int FMT, int GS, int S, int ROWS, int XV, int W, typename T, int NIB = 0, int XP = 0>
inline void qd_seg_dots(thread const uint (*raw)[W], const device T* x, thread const int* xoff,
                        uint xmask, int I, int u, int g, const device uint* e8grid,
                        thread float (*d)[S]) {
  constexpr int WPU = qd_wpu(FMT);
  constexpr int SEG = qd_seg(FMT, GS);
  if ((NIB && (FMT == 2 || FMT == 4)) || qd_affine(FMT)) {
    qd_seg_dots_sum_x<FMT, GS, S, ROWS, XV, W, T, NIB, XP>(raw, x, xoff, xmask, I, u, g, d);
    return;
  }
  if (qd_gguf(FMT)) {
    qd_seg_dots_gguf<FMT, S, ROWS, XV, W, T, XP, NIB>(raw, x, xoff, xmask, I, u, g, e8grid, d);
    return;
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int s = 0; s < S; ++s) {
      d[r][s] = 0.0f;
    }
  }
  for (int c = 0; c < SEG; c += 8) {
    const int k0 = SEG * g + c;
    float q[ROWS][8];
    for (int r = 0; r < ROWS; ++r) {
      qd_decode8<FMT>(raw[r], k0, e8grid, q[r]);
    }
    for (int s = 0; s < S; ++s) {
      if ((xmask >> s) & 1u) {
        float xf[8];
        qd_xs8<XV, XP, WPU, T>(x + xoff[s], I, u, k0, xf);
        for (int r = 0; r < ROWS; ++r) {
          for (int k = 0; k < 8; ++k) {
            d[r][s] += q[r][k] * xf[k];
          }
        }
      }
    }
  }
}

// Split-K epilogue: each SIMD group sums its lanes' acc[r][s]; lane 0 stores the group's
// partials at red[(warp * ROWS + r) * S + s] for the caller to add after a barrier.
template <int ROWS, int S>
inline void qd_simd_partials(thread float (*acc)[S], threadgroup float* red, int warp, int lane) {
  for (int r = 0; r < ROWS; ++r) {
    for (int s = 0; s < S; ++s) {
      acc[r][s] = simd_sum(acc[r][s]);
    }
  }
  if (lane == 0) {
    for (int r = 0; r < ROWS; ++r) {
      for (int s = 0; s < S; ++s) {
        red[(warp * ROWS + r) * S + s] = acc[r][s];
      }
    }
  }
}

// qgemv: y[s, o] = sum_i x[s, i] * W[o, i] for S <= 8 rows of x, W in colibri fmt 1..6.
//
// Launch (colibri_mlx/kernels/qgemv.py): one SIMD group (32 lanes) per output row,
// grid = (32 * O, 1, 1). A row is cut into "units" (8 bytes = 8/16/32 weights for fmt 1/2,4/3;
// one 24-byte group of 64 weights for fmt 5; one 32-weight sub-block for fmt 6). Lane l takes
// units l, l + 32, l + 64, ... so a SIMD group reads each step as one contiguous span, and
// every weight byte is read once per call: the lane holding it applies it to all S rows of x.
// Each lane issues UNROLL units of loads before any arithmetic to keep bytes in flight.
// Accumulation is float32; simd_sum reduces the 32 lanes.
//
// Template: T (x/y dtype), FMT, S, GS (fmt 4 group size, multiple of 16 so a 16-weight unit
// lies in one group), VEC (rows are 8-byte aligned: uint2 loads; else byte loads that stop at
// the row end), XV (rows of x are 16-byte aligned: x read 8 values per load), UNROLL.
// params (int32[8], >= 8 elements so MLX puts it in device space):
// O, I, row bytes, scales (fmt 4/5) or super-blocks (fmt 6) per row, units per row, 0, 0, 0.
// The caller pads every input to >= 8 elements for the same reason, so helpers can take
// `const device` pointers.
//
// The CUDA twin metal_kernels/cuda/qgemv.cu implements the same algorithm line for line.

constexpr int qg_wpu(int fmt) {
  return fmt == 1 ? 8 : (fmt == 3 ? 32 : (fmt == 5 ? 64 : (fmt == 6 ? 32 : 16)));
}

// Raw bytes of unit u of one row into r[0..5] (little-endian words).
template <int FMT, int VEC>
inline void qg_load(const device uint8_t* wrow, int rb, int u, thread uint* r) {
  if (FMT == 5) {
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
  } else if (VEC) {
    const uint2 v = *((const device uint2*)(wrow + 8 * u));
    r[0] = v.x;
    r[1] = v.y;
  } else {
    // Row length not a multiple of 8: byte loads, none past the end of the row.
    const int off = 8 * u;
    uint lo = 0;
    uint hi = 0;
    for (int k = 0; k < 4; ++k) {
      if (off + k < rb) {
        lo |= uint(wrow[off + k]) << (8 * k);
      }
      if (off + 4 + k < rb) {
        hi |= uint(wrow[off + 4 + k]) << (8 * k);
      }
    }
    r[0] = lo;
    r[1] = hi;
  }
}

// Scale of unit u: fmt 4 its group's, fmt 5 its group's, fmt 6 d * (0.5 + code) / 4
// (the grid holds doubled magnitudes); fmt 1-3 apply the row scale after the reduction.
template <int FMT, int GS>
inline float qg_unit_scale(const device float* scales, int row, int ng, int u, thread const uint* r) {
  if (FMT == 4) {
    return scales[row * ng + (u * 16) / GS];
  } else if (FMT == 5) {
    return scales[row * ng + u];
  } else if (FMT == 6) {
    const float d = float(as_type<half>(ushort(r[3])));
    return d * (0.5f + float(r[2] >> 28)) * 0.25f;
  }
  return 1.0f;
}

// Integer codes (fmt 6: signed grid magnitudes) of one unit, in weight order.
// A code c < 2^23 OR-ed into the mantissa of 2^23 is the float 2^23 + c exactly; one FADD of
// -(2^23 + offset) then gives c - offset exactly. This replaces int->float conversions, which
// run at a quarter of the FMA rate and made the kernel issue-bound.
inline float qg_code(uint c, float magic_plus_offset) {
  return as_type<float>(0x4B000000u | c) - magic_plus_offset;
}

template <int FMT>
inline void qg_decode(thread const uint* r, const device uint* e8grid, thread float* q) {
  if (FMT == 1) {
    // Two's complement byte b: (b ^ 0x80) - 128.
    for (int k = 0; k < 8; ++k) {
      q[k] = qg_code(((r[k >> 2] >> (8 * (k & 3))) & 0xFFu) ^ 0x80u, 8388736.0f);
    }
  } else if (FMT == 2 || FMT == 4) {
    // Even weight in the low nibble, stored code = value + 8.
    for (int k = 0; k < 16; ++k) {
      q[k] = qg_code((r[k >> 3] >> (4 * (k & 7))) & 15u, 8388616.0f);
    }
  } else if (FMT == 3) {
    for (int k = 0; k < 32; ++k) {
      q[k] = qg_code((r[k >> 4] >> (2 * (k & 15))) & 3u, 8388610.0f);
    }
  } else if (FMT == 5) {
    // Bytes 0..15: low 2 bits of each code; bytes 16..23: bit 2.
    for (int k = 0; k < 64; ++k) {
      const uint lo = (r[k >> 4] >> (2 * (k & 15))) & 3u;
      const uint hi = (r[4 + (k >> 5)] >> (k & 31)) & 1u;
      q[k] = qg_code(lo | (hi << 2), 8388612.0f);
    }
  } else if (FMT == 6) {
    for (int l = 0; l < 4; ++l) {
      // 7 stored sign bits; the 8th makes the count of negatives even.
      const uint seven = (r[2] >> (7 * l)) & 0x7Fu;
      const uint s8 = seven | ((popcount(seven) & 1u) << 7);
      for (int h = 0; h < 2; ++h) {
        const int b = 2 * l + h;
        const uint g = e8grid[(r[b >> 2] >> (8 * (b & 3))) & 0xFFu];
        for (int j = 0; j < 4; ++j) {
          const float mag = qg_code((g >> (8 * j)) & 0xFFu, 8388608.0f);
          q[8 * l + 4 * h + j] = as_type<float>(as_type<uint>(mag) ^ (((s8 >> (4 * h + j)) & 1u) << 31));
        }
      }
    }
  }
}

// Eight consecutive x values as float from one or two 16-byte loads (XV: rows of x are
// 16-byte aligned, i.e. I * sizeof(T) % 16 == 0; MLX buffers are aligned).
inline void qg_load_x8(const device float* p, thread float* o) {
  const float4 a = *((const device float4*)p);
  const float4 b = *((const device float4*)(p + 4));
  o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
  o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}

inline void qg_load_x8(const device half* p, thread float* o) {
  const uint4 v = *((const device uint4*)p);
  const uint w[4] = {v.x, v.y, v.z, v.w};
  for (int m = 0; m < 4; ++m) {
    const float2 f = float2(as_type<half2>(w[m]));
    o[2 * m] = f.x;
    o[2 * m + 1] = f.y;
  }
}

inline void qg_load_x8(const device bfloat16_t* p, thread float* o) {
  // bfloat16 is the top half of a float32: widening is a shift or a mask.
  const uint4 v = *((const device uint4*)p);
  const uint w[4] = {v.x, v.y, v.z, v.w};
  for (int m = 0; m < 4; ++m) {
    o[2 * m] = as_type<float>(w[m] << 16);
    o[2 * m + 1] = as_type<float>(w[m] & 0xFFFF0000u);
  }
}

// acc[s] += unit_scale * sum_k q[k] * x[s, i0 + k]; the last unit of a row may be partial.
template <int S, int WPU, int XV, typename T>
inline void qg_dot(thread const float* q, const device T* x, int I, int i0, float us,
                   thread float* acc) {
  if (XV && i0 + WPU <= I) {
    for (int s = 0; s < S; ++s) {
      const device T* xs = x + s * I + i0;
      float d = 0.0f;
      for (int m = 0; m < WPU; m += 8) {
        float xf[8];
        qg_load_x8(xs + m, xf);
        for (int k = 0; k < 8; ++k) {
          d += q[m + k] * xf[k];
        }
      }
      acc[s] += d * us;
    }
  } else {
    for (int s = 0; s < S; ++s) {
      const device T* xs = x + s * I + i0;
      float d = 0.0f;
      for (int k = 0; k < WPU; ++k) {
        if (i0 + k < I) {
          d += q[k] * float(xs[k]);
        }
      }
      acc[s] += d * us;
    }
  }
}

// ==== kernel body ====
  constexpr int WPU = qg_wpu(FMT);
  const int O = params[0];
  const int I = params[1];
  const int rb = params[2];
  const int ng = params[3];
  const int n_units = params[4];
  const int row = int(thread_position_in_grid.x / 32);
  const int lane = int(thread_position_in_grid.x % 32);
  if (row >= O) {
    return;
  }
  const device uint8_t* wrow = w + size_t(row) * size_t(rb);

  float acc[S];
  for (int s = 0; s < S; ++s) {
    acc[s] = 0.0f;
  }
  for (int base = 0; base < n_units; base += 32 * UNROLL) {
    uint raw[UNROLL][6];
    float us[UNROLL];
    for (int j = 0; j < UNROLL; ++j) {
      const int u = base + 32 * j + lane;
      if (u < n_units) {
        qg_load<FMT, VEC>(wrow, rb, u, raw[j]);
        us[j] = qg_unit_scale<FMT, GS>(scales, row, ng, u, raw[j]);
      }
    }
    for (int j = 0; j < UNROLL; ++j) {
      const int u = base + 32 * j + lane;
      if (u < n_units) {
        float q[WPU];
        qg_decode<FMT>(raw[j], e8grid, q);
        qg_dot<S, WPU, XV, T>(q, x, I, u * WPU, us[j], acc);
      }
    }
  }
  for (int s = 0; s < S; ++s) {
    acc[s] = simd_sum(acc[s]);
  }
  if (lane == 0) {
    const float row_scale = (FMT <= 3) ? scales[row] : 1.0f;
    for (int s = 0; s < S; ++s) {
      y[s * O + row] = static_cast<T>(acc[s] * row_scale);
    }
  }

// qgemv, CUDA twin of metal_kernels/qgemv.metal (same algorithm, same launch, same params).
//
// One warp (32 lanes) per output row, grid = (32 * O, 1, 1) threads; lane l takes units
// l, l + 32, ... of the row (see the .metal file for the unit of each fmt), issues UNROLL
// units of loads before any arithmetic, applies each weight to all S rows of x, accumulates
// in float32 and reduces with __shfl_xor_sync. CUDA launches whole blocks, so warps past the
// last row exist and return at once (a whole warp at a time: blockDim.x is a multiple of 32).
//
// Template values arrive as `constexpr int` / `using T = ...` lines at the top of the body
// (MLX_PLATFORM.md B2), so helpers take them as explicit template arguments.

namespace colibri_qgemv {

__device__ constexpr int wpu(int fmt) {
  return fmt == 1 ? 8 : (fmt == 3 ? 32 : (fmt == 5 ? 64 : (fmt == 6 ? 32 : 16)));
}

template <int FMT, int VEC>
__device__ __forceinline__ void load_unit(const uint8_t* wrow, int rb, int u, uint32_t* r) {
  if (FMT == 5) {
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
  } else if (VEC) {
    const uint2 v = *reinterpret_cast<const uint2*>(wrow + 8 * u);
    r[0] = v.x;
    r[1] = v.y;
  } else {
    const int off = 8 * u;
    uint32_t lo = 0;
    uint32_t hi = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (off + k < rb) {
        lo |= uint32_t(wrow[off + k]) << (8 * k);
      }
      if (off + 4 + k < rb) {
        hi |= uint32_t(wrow[off + 4 + k]) << (8 * k);
      }
    }
    r[0] = lo;
    r[1] = hi;
  }
}

template <int FMT, int GS>
__device__ __forceinline__ float unit_scale(const float* scales, int row, int ng, int u,
                                            const uint32_t* r) {
  if (FMT == 4) {
    return scales[row * ng + (u * 16) / GS];
  } else if (FMT == 5) {
    return scales[row * ng + u];
  } else if (FMT == 6) {
    const float d = __half2float(__ushort_as_half((unsigned short)r[3]));
    return d * (0.5f + float(r[2] >> 28)) * 0.25f;
  }
  return 1.0f;
}

// 2^23 + c built in the mantissa, minus (2^23 + offset): c - offset exactly, at full FMA rate
// (int->float conversion runs at a quarter of it and made the kernel issue-bound).
__device__ __forceinline__ float code(uint32_t c, float magic_plus_offset) {
  return __uint_as_float(0x4B000000u | c) - magic_plus_offset;
}

template <int FMT>
__device__ __forceinline__ void decode_unit(const uint32_t* r, const uint32_t* e8grid, float* q) {
  if (FMT == 1) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      q[k] = code(((r[k >> 2] >> (8 * (k & 3))) & 0xFFu) ^ 0x80u, 8388736.0f);
    }
  } else if (FMT == 2 || FMT == 4) {
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      q[k] = code((r[k >> 3] >> (4 * (k & 7))) & 15u, 8388616.0f);
    }
  } else if (FMT == 3) {
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      q[k] = code((r[k >> 4] >> (2 * (k & 15))) & 3u, 8388610.0f);
    }
  } else if (FMT == 5) {
#pragma unroll
    for (int k = 0; k < 64; ++k) {
      const uint32_t lo = (r[k >> 4] >> (2 * (k & 15))) & 3u;
      const uint32_t hi = (r[4 + (k >> 5)] >> (k & 31)) & 1u;
      q[k] = code(lo | (hi << 2), 8388612.0f);
    }
  } else if (FMT == 6) {
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const uint32_t seven = (r[2] >> (7 * l)) & 0x7Fu;
      const uint32_t s8 = seven | ((uint32_t(__popc(seven)) & 1u) << 7);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int b = 2 * l + h;
        const uint32_t g = e8grid[(r[b >> 2] >> (8 * (b & 3))) & 0xFFu];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float mag = code((g >> (8 * j)) & 0xFFu, 8388608.0f);
          q[8 * l + 4 * h + j] = __uint_as_float(__float_as_uint(mag) ^ (((s8 >> (4 * h + j)) & 1u) << 31));
        }
      }
    }
  }
}

__device__ __forceinline__ void load_x8(const float* p, float* o) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
  o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}

__device__ __forceinline__ void load_x8(const __half* p, float* o) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    __half2 h;
    memcpy(&h, &w[m], 4);
    const float2 f = __half22float2(h);
    o[2 * m] = f.x;
    o[2 * m + 1] = f.y;
  }
}

__device__ __forceinline__ void load_x8(const __nv_bfloat16* p, float* o) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    o[2 * m] = __uint_as_float(w[m] << 16);
    o[2 * m + 1] = __uint_as_float(w[m] & 0xFFFF0000u);
  }
}

template <int S, int WPU, int XV, typename T>
__device__ __forceinline__ void dot_unit(const float* q, const T* x, int I, int i0, float us,
                                         float* acc) {
  if (XV && i0 + WPU <= I) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const T* xs = x + s * I + i0;
      float d = 0.0f;
#pragma unroll
      for (int m = 0; m < WPU; m += 8) {
        float xf[8];
        load_x8(xs + m, xf);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          d += q[m + k] * xf[k];
        }
      }
      acc[s] += d * us;
    }
  } else {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const T* xs = x + s * I + i0;
      float d = 0.0f;
#pragma unroll
      for (int k = 0; k < WPU; ++k) {
        if (i0 + k < I) {
          d += q[k] * static_cast<float>(xs[k]);
        }
      }
      acc[s] += d * us;
    }
  }
}

}  // namespace colibri_qgemv

// ==== kernel body ====
  constexpr int WPU = colibri_qgemv::wpu(FMT);
  const int O = params[0];
  const int I = params[1];
  const int rb = params[2];
  const int ng = params[3];
  const int n_units = params[4];
  const long gid = long(blockIdx.x) * long(blockDim.x) + long(threadIdx.x);
  const int row = int(gid >> 5);
  const int lane = int(threadIdx.x & 31);
  if (row >= O) {
    return;
  }
  const uint8_t* wrow = w + size_t(row) * size_t(rb);
  // A row slice of a larger array can start anywhere; vector loads of x need 16 bytes.
  const bool x_aligned = (reinterpret_cast<uintptr_t>(x) & 15) == 0;

  float acc[S];
#pragma unroll
  for (int s = 0; s < S; ++s) {
    acc[s] = 0.0f;
  }
  for (int base = 0; base < n_units; base += 32 * UNROLL) {
    uint32_t raw[UNROLL][6];
    float us[UNROLL];
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      const int u = base + 32 * j + lane;
      if (u < n_units) {
        colibri_qgemv::load_unit<FMT, VEC>(wrow, rb, u, raw[j]);
        us[j] = colibri_qgemv::unit_scale<FMT, GS>(scales, row, ng, u, raw[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      const int u = base + 32 * j + lane;
      if (u < n_units) {
        float q[WPU];
        colibri_qgemv::decode_unit<FMT>(raw[j], e8grid, q);
        if (x_aligned) {
          colibri_qgemv::dot_unit<S, WPU, XV, T>(q, x, I, u * WPU, us[j], acc);
        } else {
          colibri_qgemv::dot_unit<S, WPU, 0, T>(q, x, I, u * WPU, us[j], acc);
        }
      }
    }
  }
#pragma unroll
  for (int s = 0; s < S; ++s) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      acc[s] += __shfl_xor_sync(0xffffffffu, acc[s], off);
    }
  }
  if (lane == 0) {
    const float row_scale = (FMT <= 3) ? scales[row] : 1.0f;
#pragma unroll
    for (int s = 0; s < S; ++s) {
      y[s * O + row] = static_cast<T>(acc[s] * row_scale);
    }
  }

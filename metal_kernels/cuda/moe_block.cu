// moe_block, CUDA twin of metal_kernels/moe_block.metal (same algorithm, launches, params):
// moe_gate_up (leader slot computes gate and up rows of its expert for every token routed to
// it, writes silu(g) * u to all of that expert's slots) and moe_down (each distinct expert's
// down row read once, applied to every token that chose it, weighted, summed in registers).
// One warp per output row; grid.y = slot for moe_gate_up. colibri_units:: is qgemv.cu's first
// version of the fmt 1-6 unit decoders (commit 37602f4); the wrappers add fmt 0 and fold the
// fmt 1-3 row scale into the unit scale. Template values arrive as constexpr lines.

namespace colibri_units {

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

template <int FMT>
__device__ __forceinline__ void decode_unit(const uint32_t* r, const uint32_t* e8grid, float* q) {
  if (FMT == 1) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      q[k] = float(int(r[k >> 2] << (24 - 8 * (k & 3))) >> 24);
    }
  } else if (FMT == 2 || FMT == 4) {
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      q[k] = float((r[k >> 3] >> (4 * (k & 7))) & 15u) - 8.0f;
    }
  } else if (FMT == 3) {
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      q[k] = float((r[k >> 4] >> (2 * (k & 15))) & 3u) - 2.0f;
    }
  } else if (FMT == 5) {
#pragma unroll
    for (int k = 0; k < 64; ++k) {
      const uint32_t lo = (r[k >> 4] >> (2 * (k & 15))) & 3u;
      const uint32_t hi = (r[4 + (k >> 5)] >> (k & 31)) & 1u;
      q[k] = float(lo | (hi << 2)) - 4.0f;
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
          const float mag = float((g >> (8 * j)) & 0xFFu);
          q[8 * l + 4 * h + j] = ((s8 >> (4 * h + j)) & 1u) ? -mag : mag;
        }
      }
    }
  }
}

}  // namespace colibri_units

namespace colibri_moe {

__device__ constexpr int wpu(int fmt) {
  return fmt == 0 ? 4 : colibri_units::wpu(fmt);
}

template <int FMT, int VEC>
__device__ __forceinline__ void load(const uint8_t* wrow, int rb, int I, int u, uint32_t* r) {
  if (FMT == 0) {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(wrow) + 4 * u;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      r[k] = (4 * u + k < I) ? p[k] : 0u;
    }
  } else {
    colibri_units::load_unit<FMT, VEC>(wrow, rb, u, r);
  }
}

template <int FMT, int GS>
__device__ __forceinline__ float unit_scale(const float* scales, int row, int ng, int u, const uint32_t* r) {
  if (FMT == 0) {
    return 1.0f;
  } else if (FMT <= 3) {
    return scales[row];
  }
  return colibri_units::unit_scale<FMT, GS>(scales, row, ng, u, r);
}

template <int FMT>
__device__ __forceinline__ void decode(const uint32_t* r, const uint32_t* e8grid, float* q) {
  if (FMT == 0) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      q[k] = __uint_as_float(r[k]);
    }
  } else {
    colibri_units::decode_unit<FMT>(r, e8grid, q);
  }
}

__device__ __forceinline__ int local(const int32_t* ids, const int32_t* lut, int a, int E) {
  const int id = ids[a];
  return (id >= 0 && id < E) ? lut[id] : -1;
}

__device__ __forceinline__ bool leader(const int32_t* ids, const int32_t* lut, int a, int E, int e) {
  for (int b = 0; b < a; ++b) {
    if (local(ids, lut, b, E) == e) {
      return false;
    }
  }
  return true;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, off);
  }
  return v;
}

}  // namespace colibri_moe

// ==== kernel body: moe_gate_up ====
  constexpr int WPU = colibri_moe::wpu(FMT);
  const int I = params[0];
  const int O = params[1];
  const int rb = params[2];
  const int ng = params[3];
  const int n_units = params[4];
  const int K = params[5];
  const int n_slots = params[6];
  const int E = params[7];
  const long gid = long(blockIdx.x) * long(blockDim.x) + long(threadIdx.x);
  const int row = int(gid >> 5);
  const int lane = int(threadIdx.x & 31);
  const int a = int(blockIdx.y);
  if (row >= O || a >= n_slots) {
    return;
  }
  const int e = colibri_moe::local(ids, lut, a, E);
  if (e < 0) {
    if (lane == 0) {
      h[size_t(a) * O + row] = 0.0f;
    }
    return;
  }
  if (!colibri_moe::leader(ids, lut, a, E, e)) {
    return;
  }
  uint32_t tokens = 0;
  for (int b = a; b < n_slots; ++b) {
    if (colibri_moe::local(ids, lut, b, E) == e) {
      tokens |= 1u << (b / K);
    }
  }
  const uint8_t* grow = wgu + (size_t(e) * 2 * O + row) * size_t(rb);
  const uint8_t* urow = grow + size_t(O) * size_t(rb);
  const float* se = sgu + size_t(e) * 2 * O * ng;

  float ag[S];
  float au[S];
#pragma unroll
  for (int s = 0; s < S; ++s) {
    ag[s] = 0.0f;
    au[s] = 0.0f;
  }
  for (int base = 0; base < n_units; base += 32 * UNROLL) {
    uint32_t rg[UNROLL][6];
    uint32_t ru[UNROLL][6];
    float sg[UNROLL];
    float su[UNROLL];
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      const int u = base + 32 * j + lane;
      if (u < n_units) {
        colibri_moe::load<FMT, VEC>(grow, rb, I, u, rg[j]);
        colibri_moe::load<FMT, VEC>(urow, rb, I, u, ru[j]);
        sg[j] = colibri_moe::unit_scale<FMT, GS>(se, row, ng, u, rg[j]);
        su[j] = colibri_moe::unit_scale<FMT, GS>(se, O + row, ng, u, ru[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      const int u = base + 32 * j + lane;
      if (u < n_units) {
        float qg[WPU];
        float qu[WPU];
        colibri_moe::decode<FMT>(rg[j], e8grid, qg);
        colibri_moe::decode<FMT>(ru[j], e8grid, qu);
        const int i0 = u * WPU;
#pragma unroll
        for (int s = 0; s < S; ++s) {
          if (tokens & (1u << s)) {
            const T* xs = x + size_t(s) * I + i0;
            float dg = 0.0f;
            float du = 0.0f;
#pragma unroll
            for (int k = 0; k < WPU; ++k) {
              const float xv = (i0 + k < I) ? static_cast<float>(xs[k]) : 0.0f;
              dg += qg[k] * xv;
              du += qu[k] * xv;
            }
            ag[s] += dg * sg[j];
            au[s] += du * su[j];
          }
        }
      }
    }
  }
#pragma unroll
  for (int s = 0; s < S; ++s) {
    ag[s] = colibri_moe::warp_sum(ag[s]);
    au[s] = colibri_moe::warp_sum(au[s]);
  }
  if (lane == 0) {
    for (int b = a; b < n_slots; ++b) {
      if (colibri_moe::local(ids, lut, b, E) == e) {
        const int s = b / K;
        float g = 0.0f;
        float up = 0.0f;
#pragma unroll
        for (int t = 0; t < S; ++t) {
          if (t == s) {
            g = ag[t];
            up = au[t];
          }
        }
        h[size_t(b) * O + row] = g / (1.0f + expf(-g)) * up;
      }
    }
  }
// ==== kernel body: moe_down ====
  constexpr int WPU = colibri_moe::wpu(FMT);
  const int I = params[0];
  const int O = params[1];
  const int rb = params[2];
  const int ng = params[3];
  const int n_units = params[4];
  const int K = params[5];
  const int n_slots = params[6];
  const int E = params[7];
  const long gid = long(blockIdx.x) * long(blockDim.x) + long(threadIdx.x);
  const int row = int(gid >> 5);
  const int lane = int(threadIdx.x & 31);
  if (row >= O) {
    return;
  }
  float acc[S];
#pragma unroll
  for (int s = 0; s < S; ++s) {
    acc[s] = 0.0f;
  }
  for (int a = 0; a < n_slots; ++a) {
    const int e = colibri_moe::local(ids, lut, a, E);
    if (e < 0 || !colibri_moe::leader(ids, lut, a, E, e)) {
      continue;
    }
    int slot[S];
    float wt[S];
    uint32_t tokens = 0;
#pragma unroll
    for (int s = 0; s < S; ++s) {
      slot[s] = 0;
      wt[s] = 0.0f;
    }
    for (int b = a; b < n_slots; ++b) {
      if (colibri_moe::local(ids, lut, b, E) == e) {
        const int sb = b / K;
        tokens |= 1u << sb;
#pragma unroll
        for (int s = 0; s < S; ++s) {
          if (s == sb) {
            slot[s] = b;
            wt[s] += weights[b];
          }
        }
      }
    }
    const uint8_t* wrow = wd + (size_t(e) * O + row) * size_t(rb);
    const float* se = sd + size_t(e) * O * ng;
    for (int base = 0; base < n_units; base += 32 * UNROLL) {
      uint32_t raw[UNROLL][6];
      float us[UNROLL];
#pragma unroll
      for (int j = 0; j < UNROLL; ++j) {
        const int u = base + 32 * j + lane;
        if (u < n_units) {
          colibri_moe::load<FMT, VEC>(wrow, rb, I, u, raw[j]);
          us[j] = colibri_moe::unit_scale<FMT, GS>(se, row, ng, u, raw[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < UNROLL; ++j) {
        const int u = base + 32 * j + lane;
        if (u < n_units) {
          float q[WPU];
          colibri_moe::decode<FMT>(raw[j], e8grid, q);
          const int i0 = u * WPU;
#pragma unroll
          for (int s = 0; s < S; ++s) {
            if (tokens & (1u << s)) {
              const float* hs = h + size_t(slot[s]) * I + i0;
              float d = 0.0f;
#pragma unroll
              for (int k = 0; k < WPU; ++k) {
                d += (i0 + k < I) ? q[k] * hs[k] : 0.0f;
              }
              acc[s] += d * us[j] * wt[s];
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int s = 0; s < S; ++s) {
    acc[s] = colibri_moe::warp_sum(acc[s]);
  }
  if (lane == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      y[size_t(s) * O + row] = acc[s];
    }
  }

// moe_block, CUDA twin of metal_kernels/moe_block.metal (same algorithm, launches, params):
// moe_gate_up (leader slot computes gate and up rows of its expert for every token routed to
// it, writes silu(g) * u to all of that expert's slots) and moe_down (each distinct expert's
// down row read once, applied to every token that chose it, weighted, summed in registers).
// One warp per output row; grid.y = slot for moe_gate_up. Appended to qgemv.cu's header
// (colibri_qgemv::load_unit / unit_scale / decode_unit); the wrappers add fmt 0 and fold the
// fmt 1-3 row scale into the unit scale. Template values arrive as constexpr lines.

namespace colibri_moe {

__device__ constexpr int wpu(int fmt) {
  return fmt == 0 ? 4 : colibri_qgemv::wpu(fmt);
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
    colibri_qgemv::load_unit<FMT, VEC>(wrow, rb, u, r);
  }
}

template <int FMT, int GS>
__device__ __forceinline__ float unit_scale(const float* scales, int row, int ng, int u, const uint32_t* r) {
  if (FMT == 0) {
    return 1.0f;
  } else if (FMT <= 3) {
    return scales[row];
  }
  return colibri_qgemv::unit_scale<FMT, GS>(scales, row, ng, u, r);
}

template <int FMT>
__device__ __forceinline__ void decode(const uint32_t* r, const uint32_t* e8grid, float* q) {
  if (FMT == 0) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      q[k] = __uint_as_float(r[k]);
    }
  } else {
    colibri_qgemv::decode_unit<FMT>(r, e8grid, q);
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

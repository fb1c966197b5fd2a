// moe_block: the routed experts of one MoE layer for S <= 8 tokens, two launches per
// group of experts that share one fmt/gs (colibri_mlx/kernels/moe.py):
//
//   moe_gate_up  h[a, r] = silu(gate_e x_s)[r] * (up_e x_s)[r]   for every slot a = s * K + k
//   moe_down     y[s, o] = sum_k w[s, k] * (down_e h[s * K + k])[o]
//
// The experts of a group are stacked into one byte buffer ([E_g][rows][row bytes]) and one
// scale buffer; `lut[e]` maps a layer expert id to its index in the group or -1, so a kernel
// indexes expert e by offset (metal_kernel cannot take a pointer table) and the routing ids
// stay on the GPU (no host sync).
//
// Each weight byte is read once per call: in moe_gate_up the slot that sees an expert first
// (its "leader") computes that expert's rows for every token routed to it and writes all of
// that expert's slots; other slots return at once. moe_down visits each distinct expert once
// per output row and applies the row to every token that selected it. gate and up rows are
// read in the same pass so x is read once. One SIMD group per output row; lanes take units
// (see qgemv.metal) l, l + 32, ...; float32 accumulation; simd_sum reduces the lanes.
//
// The cu_* unit decoders (fmt 1-6) are qgemv.metal's first version (commit 37602f4), kept
// here so these kernels do not follow qgemv's tuning; the cm_* wrappers add fmt 0 (float32
// rows, 4 weights a unit) and fold the fmt 1-3 row scale into the unit scale (several experts
// share one accumulator). mla_decode.metal appends its header to this one.
// The CUDA twin metal_kernels/cuda/moe_block.cu implements the same algorithm line for line.
//
// params (int32[8]): I, O (rows per projection), row bytes, scales per row, units per row,
// K (slots per token), n_slots (S * K), E (layer expert count, the size of lut).

// ---- fmt 1-6 units (see above)

constexpr int cu_wpu(int fmt) {
  return fmt == 1 ? 8 : (fmt == 3 ? 32 : (fmt == 5 ? 64 : (fmt == 6 ? 32 : 16)));
}

// Raw bytes of unit u of one row into r[0..5] (little-endian words).
template <int FMT, int VEC>
inline void cu_load(const device uint8_t* wrow, int rb, int u, thread uint* r) {
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
inline float cu_unit_scale(const device float* scales, int row, int ng, int u, thread const uint* r) {
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
template <int FMT>
inline void cu_decode(thread const uint* r, const device uint* e8grid, thread float* q) {
  if (FMT == 1) {
    for (int k = 0; k < 8; ++k) {
      q[k] = float(int(r[k >> 2] << (24 - 8 * (k & 3))) >> 24);
    }
  } else if (FMT == 2 || FMT == 4) {
    // Even weight in the low nibble, stored code = value + 8.
    for (int k = 0; k < 16; ++k) {
      q[k] = float((r[k >> 3] >> (4 * (k & 7))) & 15u) - 8.0f;
    }
  } else if (FMT == 3) {
    for (int k = 0; k < 32; ++k) {
      q[k] = float((r[k >> 4] >> (2 * (k & 15))) & 3u) - 2.0f;
    }
  } else if (FMT == 5) {
    // Bytes 0..15: low 2 bits of each code; bytes 16..23: bit 2.
    for (int k = 0; k < 64; ++k) {
      const uint lo = (r[k >> 4] >> (2 * (k & 15))) & 3u;
      const uint hi = (r[4 + (k >> 5)] >> (k & 31)) & 1u;
      q[k] = float(lo | (hi << 2)) - 4.0f;
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
          const float mag = float((g >> (8 * j)) & 0xFFu);
          q[8 * l + 4 * h + j] = ((s8 >> (4 * h + j)) & 1u) ? -mag : mag;
        }
      }
    }
  }
}

// ---- moe_block

constexpr int cm_wpu(int fmt) {
  return fmt == 0 ? 4 : cu_wpu(fmt);
}

template <int FMT, int VEC>
inline void cm_load(const device uint8_t* wrow, int rb, int I, int u, thread uint* r) {
  if (FMT == 0) {
    const device uint* p = (const device uint*)(wrow) + 4 * u;
    for (int k = 0; k < 4; ++k) {
      r[k] = (4 * u + k < I) ? p[k] : 0u;
    }
  } else {
    cu_load<FMT, VEC>(wrow, rb, u, r);
  }
}

template <int FMT, int GS>
inline float cm_unit_scale(const device float* scales, int row, int ng, int u, thread const uint* r) {
  if (FMT == 0) {
    return 1.0f;
  } else if (FMT <= 3) {
    return scales[row];
  }
  return cu_unit_scale<FMT, GS>(scales, row, ng, u, r);
}

template <int FMT>
inline void cm_decode(thread const uint* r, const device uint* e8grid, thread float* q) {
  if (FMT == 0) {
    for (int k = 0; k < 4; ++k) {
      q[k] = as_type<float>(r[k]);
    }
  } else {
    cu_decode<FMT>(r, e8grid, q);
  }
}

// Group-local expert of slot a, or -1 (id out of range, dropped by router top-p, other group).
inline int moe_local(const device int* ids, const device int* lut, int a, int E) {
  const int id = ids[a];
  return (id >= 0 && id < E) ? lut[id] : -1;
}

// True if no earlier slot routes to the same group-local expert.
inline bool moe_leader(const device int* ids, const device int* lut, int a, int E, int e) {
  for (int b = 0; b < a; ++b) {
    if (moe_local(ids, lut, b, E) == e) {
      return false;
    }
  }
  return true;
}

// ==== kernel body: moe_gate_up ====
  constexpr int WPU = cm_wpu(FMT);
  const int I = params[0];
  const int O = params[1];
  const int rb = params[2];
  const int ng = params[3];
  const int n_units = params[4];
  const int K = params[5];
  const int n_slots = params[6];
  const int E = params[7];
  const int row = int(thread_position_in_grid.x / 32);
  const int lane = int(thread_position_in_grid.x % 32);
  const int a = int(thread_position_in_grid.y);
  if (row >= O || a >= n_slots) {
    return;
  }
  const int e = moe_local(ids, lut, a, E);
  if (e < 0) {
    if (lane == 0) {
      h[size_t(a) * O + row] = 0.0f;
    }
    return;
  }
  if (!moe_leader(ids, lut, a, E, e)) {
    return;
  }
  uint tokens = 0;
  for (int b = a; b < n_slots; ++b) {
    if (moe_local(ids, lut, b, E) == e) {
      tokens |= 1u << (b / K);
    }
  }
  const device uint8_t* grow = wgu + (size_t(e) * 2 * O + row) * size_t(rb);
  const device uint8_t* urow = grow + size_t(O) * size_t(rb);
  const device float* se = sgu + size_t(e) * 2 * O * ng;

  float ag[S];
  float au[S];
  for (int s = 0; s < S; ++s) {
    ag[s] = 0.0f;
    au[s] = 0.0f;
  }
  for (int base = 0; base < n_units; base += 32 * UNROLL) {
    uint rg[UNROLL][6];
    uint ru[UNROLL][6];
    float sg[UNROLL];
    float su[UNROLL];
    for (int j = 0; j < UNROLL; ++j) {
      const int u = base + 32 * j + lane;
      if (u < n_units) {
        cm_load<FMT, VEC>(grow, rb, I, u, rg[j]);
        cm_load<FMT, VEC>(urow, rb, I, u, ru[j]);
        sg[j] = cm_unit_scale<FMT, GS>(se, row, ng, u, rg[j]);
        su[j] = cm_unit_scale<FMT, GS>(se, O + row, ng, u, ru[j]);
      }
    }
    for (int j = 0; j < UNROLL; ++j) {
      const int u = base + 32 * j + lane;
      if (u < n_units) {
        float qg[WPU];
        float qu[WPU];
        cm_decode<FMT>(rg[j], e8grid, qg);
        cm_decode<FMT>(ru[j], e8grid, qu);
        const int i0 = u * WPU;
        for (int s = 0; s < S; ++s) {
          if (tokens & (1u << s)) {
            const device T* xs = x + size_t(s) * I + i0;
            float dg = 0.0f;
            float du = 0.0f;
            for (int k = 0; k < WPU; ++k) {
              const float xv = (i0 + k < I) ? float(xs[k]) : 0.0f;
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
  for (int s = 0; s < S; ++s) {
    ag[s] = simd_sum(ag[s]);
    au[s] = simd_sum(au[s]);
  }
  if (lane == 0) {
    for (int b = a; b < n_slots; ++b) {
      if (moe_local(ids, lut, b, E) == e) {
        const int s = b / K;
        const float g = ag[s];
        h[size_t(b) * O + row] = g / (1.0f + exp(-g)) * au[s];
      }
    }
  }
// ==== kernel body: moe_down ====
  constexpr int WPU = cm_wpu(FMT);
  const int I = params[0];
  const int O = params[1];
  const int rb = params[2];
  const int ng = params[3];
  const int n_units = params[4];
  const int K = params[5];
  const int n_slots = params[6];
  const int E = params[7];
  const int row = int(thread_position_in_grid.x / 32);
  const int lane = int(thread_position_in_grid.x % 32);
  if (row >= O) {
    return;
  }
  float acc[S];
  for (int s = 0; s < S; ++s) {
    acc[s] = 0.0f;
  }
  for (int a = 0; a < n_slots; ++a) {
    const int e = moe_local(ids, lut, a, E);
    if (e < 0 || !moe_leader(ids, lut, a, E, e)) {
      continue;
    }
    // Per token: the slot whose h to use and the summed gate weight (an expert listed twice
    // for one token has the same h in both slots).
    int slot[S];
    float wt[S];
    uint tokens = 0;
    for (int s = 0; s < S; ++s) {
      slot[s] = 0;
      wt[s] = 0.0f;
    }
    for (int b = a; b < n_slots; ++b) {
      if (moe_local(ids, lut, b, E) == e) {
        const int s = b / K;
        tokens |= 1u << s;
        slot[s] = b;
        wt[s] += weights[b];
      }
    }
    const device uint8_t* wrow = wd + (size_t(e) * O + row) * size_t(rb);
    const device float* se = sd + size_t(e) * O * ng;
    for (int base = 0; base < n_units; base += 32 * UNROLL) {
      uint raw[UNROLL][6];
      float us[UNROLL];
      for (int j = 0; j < UNROLL; ++j) {
        const int u = base + 32 * j + lane;
        if (u < n_units) {
          cm_load<FMT, VEC>(wrow, rb, I, u, raw[j]);
          us[j] = cm_unit_scale<FMT, GS>(se, row, ng, u, raw[j]);
        }
      }
      for (int j = 0; j < UNROLL; ++j) {
        const int u = base + 32 * j + lane;
        if (u < n_units) {
          float q[WPU];
          cm_decode<FMT>(raw[j], e8grid, q);
          const int i0 = u * WPU;
            for (int s = 0; s < S; ++s) {
            if (tokens & (1u << s)) {
              const device float* hs = h + size_t(slot[s]) * I + i0;
              float d = 0.0f;
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
  for (int s = 0; s < S; ++s) {
    acc[s] = simd_sum(acc[s]);
  }
  if (lane == 0) {
    for (int s = 0; s < S; ++s) {
      y[size_t(s) * O + row] = acc[s];
    }
  }

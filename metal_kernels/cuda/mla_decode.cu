// mla_decode, CUDA twin of metal_kernels/mla_decode.metal (same three launches, same params,
// same algorithm; see the .metal file): mla_qabs (q' = W_UK^T q_nope), mla_attn (one block per
// head group x cache tile x query row; C = 8 positions staged in shared memory as float, HB
// heads per warp, reduce-scatter of the 32 partial scores, online softmax rescaled once per
// chunk), mla_out (merge of the tiles, then W_UV). kv_b decoding is qdecode.cuh's (prepended).
// Template values arrive as constexpr lines; MLX launches grid / block of 32 * NSG threads.
// Generated from the .metal file by a mechanical port (Metal -> CUDA spellings); keep the two
// in step.

namespace colibri_mla {

__device__ __forceinline__ float neg_inf() {
  return -__int_as_float(0x7f800000);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, off);
  }
  return v;
}

// Positions per softmax chunk; HB x MLA_CHUNK = 32 partial scores per SIMD group.
__device__ constexpr int mla_chunk() {
  return 8;
}

// Lane l ends with the sum over the SIMD group of v[l] (v[32] per lane): halving exchanges,
// 16 + 8 + 4 + 2 + 1 shuffles. After the exchange at distance w, lane bit w says which half
// of the indices the lane keeps.
__device__ __forceinline__ float mla_reduce_scatter(float* v, int lane) {
#pragma unroll
  for (int w = 16; w >= 1; w >>= 1) {
    const bool upper = (lane & w) != 0;
#pragma unroll
    for (int k = 0; k < w; ++k) {
      const float keep = upper ? v[k + w] : v[k];
      const float send = upper ? v[k] : v[k + w];
      v[k] = keep + __shfl_xor_sync(0xffffffffu, send, w);
    }
  }
  return v[0];
}

}  // namespace colibri_mla

// ==== kernel body: mla_qabs ====
  constexpr int WPU = colibri_qd::wpu(FMT);
  constexpr int SEG = colibri_qd::seg(FMT, GS);
  __shared__ float red[NSG * NU * WPU * 32];
  const int H = params[0];
  const int nope = params[1];
  const int v = params[2];
  const int R = params[3];
  const int rb = params[10];
  const int ng = params[11];
  const int n_units = params[12];
  const int h = int(blockIdx.y);
  const int q = int(blockIdx.z);
  const int sg = int(threadIdx.x >> 5);
  const int lane = int(threadIdx.x & 31);
  const int tid = int(threadIdx.x);
  float acc[NU * WPU];
  #pragma unroll
  for (int k = 0; k < NU * WPU; ++k) {
    acc[k] = 0.0f;
  }
  for (int n = sg; n < nope; n += NSG) {
    const int row = h * (nope + v) + n;
    const float xq = qn[(size_t(q) * H + h) * nope + n] * colibri_qd::row_scale<FMT>(scales, row);
    const uint8_t* wrow = w + size_t(row) * size_t(rb);
    #pragma unroll
    for (int j = 0; j < NU; ++j) {
      const int u = lane + 32 * j;
      if (u < n_units) {
        uint32_t r[colibri_qd::words(FMT)];
        colibri_qd::load<FMT, VEC, false>(wrow, rb, u, r);
        for (int g = 0; g < WPU / SEG; ++g) {
          const float us = colibri_qd::seg_scale<FMT, GS>(scales, row, ng, u, g, r) * xq;
          #pragma unroll
          for (int c = 0; c < SEG; c += 8) {
            float wq[8];
            colibri_qd::decode8<FMT>(r, SEG * g + c, e8grid, wq);
            #pragma unroll
            for (int k = 0; k < 8; ++k) {
              acc[j * WPU + SEG * g + c + k] += us * wq[k];
            }
          }
        }
      }
    }
  }
  #pragma unroll
  for (int j = 0; j < NU; ++j) {
    const int u = lane + 32 * j;
    if (u < n_units) {
      #pragma unroll
      for (int k = 0; k < WPU; ++k) {
        red[sg * NU * WPU * 32 + u * WPU + k] = acc[j * WPU + k];
      }
    }
  }
  __syncthreads();
  for (int c = tid; c < R; c += NSG * 32) {
    float s = 0.0f;
    #pragma unroll
    for (int g = 0; g < NSG; ++g) {
      s += red[g * NU * WPU * 32 + c];
    }
    qabs[(size_t(q) * H + h) * R + c] = s;
  }
// ==== kernel body: mla_attn ====
  constexpr int C = colibri_mla::mla_chunk();
  constexpr int RW = (CJ + RJ) * 32;           // a staged position: latent columns, then rope
  __shared__ float lat_s[C * RW];
  __shared__ int keep_s[C];                   // 1 keep, 0 masked (-1e30), -1 past the tile
  const int H = params[0];
  const int R = params[3];
  const int rope = params[4];
  const int T = params[5];
  const int P = params[6];
  const int TT = params[7];
  const int L = params[9];
  const int has_mask = params[13];
  const int has_sel = params[14];
  const float scale = fparams[0];
  const int tid = int(threadIdx.x);
  const int lane = int(threadIdx.x & 31);
  const int sg = int(threadIdx.x >> 5);
  const int tile = int(blockIdx.y);
  const int q = int(blockIdx.z);
  const int h0 = (int(blockIdx.x) * NSG + sg) * HB;
  const bool active = h0 < H;                  // idle SIMD groups still stage and wait
  const int b = q / L;
  const int p0 = tile * TT;
  const int p1 = min(P, p0 + TT);
  float qa[HB][CJ];
  float qr[HB][RJ];
  float acc[HB][CJ];
  float m[HB];
  float l[HB];
  #pragma unroll
  for (int i = 0; i < HB; ++i) {
    const int hh = min(h0 + i, H - 1);
    const float* qa_h = qabs + (size_t(q) * H + hh) * R;
    const float* qr_h = qrope + (size_t(q) * H + hh) * rope;
    #pragma unroll
    for (int j = 0; j < CJ; ++j) {
      const int c = lane + 32 * j;
      qa[i][j] = c < R ? qa_h[c] : 0.0f;
      acc[i][j] = 0.0f;
    }
    #pragma unroll
    for (int j = 0; j < RJ; ++j) {
      const int c = lane + 32 * j;
      qr[i][j] = c < rope ? qr_h[c] : 0.0f;
    }
    m[i] = colibri_mla::neg_inf();
    l[i] = 0.0f;
  }
  for (int c0 = p0; c0 < p1; c0 += C) {
    __syncthreads();   // the previous chunk is consumed
    for (int k = tid; k < C * RW; k += NSG * 32) {
      const int c = k / RW;
      const int col = k - c * RW;
      float val = 0.0f;
      if (c0 + c < p1) {
        const int t = has_sel ? sel[size_t(q) * P + c0 + c] : c0 + c;
        if (col < R) {
          val = static_cast<float>(latent[(size_t(b) * T + t) * R + col]);
        } else if (col >= CJ * 32 && col - CJ * 32 < rope) {
          val = static_cast<float>(krope[(size_t(b) * T + t) * rope + col - CJ * 32]);
        }
      }
      lat_s[k] = val;
    }
    if (tid < C) {
      int keep = -1;
      if (c0 + tid < p1) {
        const int t = has_sel ? sel[size_t(q) * P + c0 + tid] : c0 + tid;
        keep = (!has_mask || mask[size_t(q) * T + t] != 0) ? 1 : 0;
      }
      keep_s[tid] = keep;
    }
    __syncthreads();
    if (active) {
      // d[i * C + c]: this lane's share of head i's score at position c (heads >= HB: 0).
      float d[32];
      #pragma unroll
      for (int k = 0; k < 32; ++k) {
        d[k] = 0.0f;
      }
      #pragma unroll
      for (int c = 0; c < C; ++c) {
        const float* row = lat_s + c * RW;
        #pragma unroll
        for (int j = 0; j < CJ; ++j) {
          const float lv = row[lane + 32 * j];
          #pragma unroll
          for (int i = 0; i < HB; ++i) {
            d[i * C + c] += qa[i][j] * lv;
          }
        }
        #pragma unroll
        for (int j = 0; j < RJ; ++j) {
          const float kv = row[CJ * 32 + lane + 32 * j];
          #pragma unroll
          for (int i = 0; i < HB; ++i) {
            d[i * C + c] += qr[i][j] * kv;
          }
        }
      }
      // Lane i * C + c: score of head i at position c; the softmax of a head spans 8 lanes.
      const float dot = colibri_mla::mla_reduce_scatter(d, lane);
      const int keep = keep_s[lane % C];
      const float s = keep > 0 ? dot * scale : (keep == 0 ? -1e30f : colibri_mla::neg_inf());
      float cmax = max(s, __shfl_xor_sync(0xffffffffu, s, 1));
      cmax = max(cmax, __shfl_xor_sync(0xffffffffu, cmax, 2));
      cmax = max(cmax, __shfl_xor_sync(0xffffffffu, cmax, 4));
      float m_old = m[0];
      #pragma unroll
      for (int i = 1; i < HB; ++i) {
        m_old = (lane / C == i) ? m[i] : m_old;
      }
      const float m_new = max(m_old, cmax);
      const float alpha = expf(m_old - m_new);
      const float pw = keep >= 0 ? expf(s - m_new) : 0.0f;
      float psum = pw + __shfl_xor_sync(0xffffffffu, pw, 1);
      psum += __shfl_xor_sync(0xffffffffu, psum, 2);
      psum += __shfl_xor_sync(0xffffffffu, psum, 4);
      #pragma unroll
      for (int i = 0; i < HB; ++i) {
        const float al = __shfl_sync(0xffffffffu, alpha, i * C);
        m[i] = __shfl_sync(0xffffffffu, m_new, i * C);
        l[i] = l[i] * al + __shfl_sync(0xffffffffu, psum, i * C);
        #pragma unroll
        for (int j = 0; j < CJ; ++j) {
          acc[i][j] *= al;
        }
      }
      #pragma unroll
      for (int c = 0; c < C; ++c) {
        float pc[HB];
        #pragma unroll
        for (int i = 0; i < HB; ++i) {
          pc[i] = __shfl_sync(0xffffffffu, pw, i * C + c);
        }
        const float* row = lat_s + c * RW;
        #pragma unroll
        for (int j = 0; j < CJ; ++j) {
          const float lv = row[lane + 32 * j];
          #pragma unroll
          for (int i = 0; i < HB; ++i) {
            acc[i][j] += pc[i] * lv;
          }
        }
      }
    }
  }
  if (active) {
    #pragma unroll
    for (int i = 0; i < HB; ++i) {
      const size_t part = (size_t(q) * H + h0 + i) * size_t(params[8]) + tile;
      #pragma unroll
      for (int j = 0; j < CJ; ++j) {
        const int c = lane + 32 * j;
        if (c < R) {
          pacc[part * R + c] = acc[i][j];
        }
      }
      if (lane == 0) {
        pml[2 * part] = m[i];
        pml[2 * part + 1] = l[i];
      }
    }
  }
// ==== kernel body: mla_out ====
  constexpr int WPU = colibri_qd::wpu(FMT);
  __shared__ float ctx[RMAX];
  const int H = params[0];
  const int nope = params[1];
  const int v = params[2];
  const int R = params[3];
  const int NT = params[8];
  const int rb = params[10];
  const int ng = params[11];
  const int n_units = params[12];
  const int h = int(blockIdx.y);
  const int q = int(blockIdx.z);
  const int sg = int(threadIdx.x >> 5);
  const int lane = int(threadIdx.x & 31);
  const int tid = int(threadIdx.x);
  const size_t part0 = (size_t(q) * H + h) * NT;
  float mx_ = colibri_mla::neg_inf();
  for (int t = 0; t < NT; ++t) {
    mx_ = max(mx_, pml[2 * (part0 + t)]);
  }
  float den = 0.0f;
  for (int t = 0; t < NT; ++t) {
    den += expf(pml[2 * (part0 + t)] - mx_) * pml[2 * (part0 + t) + 1];
  }
  for (int c = tid; c < RMAX; c += NSG * 32) {
    float s = 0.0f;
    for (int t = 0; t < NT && c < R; ++t) {
      s += expf(pml[2 * (part0 + t)] - mx_) * pacc[(part0 + t) * R + c];
    }
    ctx[c] = s / den;                          // 0 past R: the last unit's padding weights
  }
  __syncthreads();
  for (int vi = sg; vi < v; vi += NSG) {
    const int row = h * (nope + v) + nope + vi;
    const uint8_t* wrow = w + size_t(row) * size_t(rb);
    float a = 0.0f;
    for (int u = lane; u < n_units; u += 32) {
      uint32_t r[colibri_qd::words(FMT)];
      colibri_qd::load<FMT, VEC, false>(wrow, rb, u, r);
      #pragma unroll
      for (int g = 0; g < WPU / colibri_qd::seg(FMT, GS); ++g) {
        float d = 0.0f;
        #pragma unroll
        for (int c = 0; c < colibri_qd::seg(FMT, GS); c += 8) {
          const int k0 = colibri_qd::seg(FMT, GS) * g + c;
          float wq[8];
          colibri_qd::decode8<FMT>(r, k0, e8grid, wq);
          #pragma unroll
          for (int k = 0; k < 8; ++k) {
            d += wq[k] * ctx[u * WPU + k0 + k];
          }
        }
        a += d * colibri_qd::seg_scale<FMT, GS>(scales, row, ng, u, g, r);
      }
    }
    a = colibri_mla::warp_sum(a);
    if (lane == 0) {
      out[(size_t(q) * H + h) * v + vi] = static_cast<T>(a * colibri_qd::row_scale<FMT>(scales, row));
    }
  }

// mla_decode, CUDA twin of metal_kernels/mla_decode.metal (same three launches, same params):
// mla_qabs (q' = W_UK^T q_nope, warps split rows, lanes own column units, shared-memory
// reduction), mla_attn (split-K online softmax: one warp per cache tile x head block x query
// row, partial (acc, m, l) per tile and head), mla_out (merge of the tiles into the
// normalized context in shared memory, then W_UV, one warp per output row).
// Appended to the qgemv.cu + moe_block.cu headers (colibri_moe:: unit helpers, warp_sum).

namespace colibri_mla {
__device__ __forceinline__ float neg_inf() {
  return -__int_as_float(0x7f800000);
}
}  // namespace colibri_mla

// ==== kernel body: mla_qabs ====
  constexpr int WPU = colibri_moe::wpu(FMT);
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
    const float xq = qn[(size_t(q) * H + h) * nope + n];
    const uint8_t* wrow = w + size_t(row) * size_t(rb);
#pragma unroll
    for (int j = 0; j < NU; ++j) {
      const int u = lane + 32 * j;
      if (u < n_units) {
        uint32_t r[6];
        colibri_moe::load<FMT, VEC>(wrow, rb, R, u, r);
        const float us = colibri_moe::unit_scale<FMT, GS>(scales, row, ng, u, r) * xq;
        float wq[WPU];
        colibri_moe::decode<FMT>(r, e8grid, wq);
#pragma unroll
        for (int k = 0; k < WPU; ++k) {
          acc[j * WPU + k] += us * wq[k];
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
    for (int g = 0; g < NSG; ++g) {
      s += red[g * NU * WPU * 32 + c];
    }
    qabs[(size_t(q) * H + h) * R + c] = s;
  }
// ==== kernel body: mla_attn ====
  const int H = params[0];
  const int R = params[3];
  const int rope = params[4];
  const int T = params[5];
  const int P = params[6];
  const int TT = params[7];
  const int NT = params[8];
  const int L = params[9];
  const int has_mask = params[13];
  const int has_sel = params[14];
  const float scale = fparams[0];
  const int lane = int(threadIdx.x & 31);
  const int tile = int(blockIdx.x) * NSG + int(threadIdx.x >> 5);
  const int h0 = int(blockIdx.y) * HB;
  const int q = int(blockIdx.z);
  if (tile >= NT) {
    return;
  }
  const int b = q / L;
  float qa[HB][CJ];
  float qr[HB][RJ];
  float acc[HB][CJ];
  float m[HB];
  float l[HB];
#pragma unroll
  for (int i = 0; i < HB; ++i) {
    const float* qa_h = qabs + (size_t(q) * H + h0 + i) * R;
    const float* qr_h = qrope + (size_t(q) * H + h0 + i) * rope;
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
  const int p1 = min(P, (tile + 1) * TT);
  for (int p = tile * TT; p < p1; ++p) {
    const int t = has_sel ? sel[size_t(q) * P + p] : p;
    const TC* lat = latent + (size_t(b) * T + t) * R;
    const TC* kr = krope + (size_t(b) * T + t) * rope;
    float lv[CJ];
    float kv[RJ];
#pragma unroll
    for (int j = 0; j < CJ; ++j) {
      const int c = lane + 32 * j;
      lv[j] = c < R ? static_cast<float>(lat[c]) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < RJ; ++j) {
      const int c = lane + 32 * j;
      kv[j] = c < rope ? static_cast<float>(kr[c]) : 0.0f;
    }
    const bool keep = !has_mask || mask[size_t(q) * T + t] != 0;
#pragma unroll
    for (int i = 0; i < HB; ++i) {
      float d = 0.0f;
#pragma unroll
      for (int j = 0; j < CJ; ++j) {
        d += qa[i][j] * lv[j];
      }
#pragma unroll
      for (int j = 0; j < RJ; ++j) {
        d += qr[i][j] * kv[j];
      }
      d = colibri_moe::warp_sum(d);
      const float s = keep ? d * scale : -1e30f;
      const float m_new = fmaxf(m[i], s);
      const float alpha = expf(m[i] - m_new);
      const float pw = expf(s - m_new);
      l[i] = l[i] * alpha + pw;
#pragma unroll
      for (int j = 0; j < CJ; ++j) {
        acc[i][j] = acc[i][j] * alpha + pw * lv[j];
      }
      m[i] = m_new;
    }
  }
#pragma unroll
  for (int i = 0; i < HB; ++i) {
    const size_t part = (size_t(q) * H + h0 + i) * NT + tile;
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
// ==== kernel body: mla_out ====
  constexpr int WPU = colibri_moe::wpu(FMT);
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
    mx_ = fmaxf(mx_, pml[2 * (part0 + t)]);
  }
  float den = 0.0f;
  for (int t = 0; t < NT; ++t) {
    den += expf(pml[2 * (part0 + t)] - mx_) * pml[2 * (part0 + t) + 1];
  }
  for (int c = tid; c < R; c += NSG * 32) {
    float s = 0.0f;
    for (int t = 0; t < NT; ++t) {
      s += expf(pml[2 * (part0 + t)] - mx_) * pacc[(part0 + t) * R + c];
    }
    ctx[c] = s / den;
  }
  __syncthreads();
  for (int vi = sg; vi < v; vi += NSG) {
    const int row = h * (nope + v) + nope + vi;
    const uint8_t* wrow = w + size_t(row) * size_t(rb);
    float a = 0.0f;
    for (int u = lane; u < n_units; u += 32) {
      uint32_t r[6];
      colibri_moe::load<FMT, VEC>(wrow, rb, R, u, r);
      const float us = colibri_moe::unit_scale<FMT, GS>(scales, row, ng, u, r);
      float wq[WPU];
      colibri_moe::decode<FMT>(r, e8grid, wq);
      float d = 0.0f;
#pragma unroll
      for (int k = 0; k < WPU; ++k) {
        d += (u * WPU + k < R) ? wq[k] * ctx[u * WPU + k] : 0.0f;
      }
      a += d * us;
    }
    a = colibri_moe::warp_sum(a);
    if (lane == 0) {
      out[(size_t(q) * H + h) * v + vi] = static_cast<T>(a);
    }
  }

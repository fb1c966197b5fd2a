// router, CUDA twin of metal_kernels/router.metal (same algorithm, launches, params):
// router_scores: sigmoid(x_s . W_e) for ROWS float32 weight rows per block of NW warps
// (split-K over float4 units, partial sums through warp shuffles and shared memory);
// router_topk: one block per token, group-limited top-k by K rounds of a block argmax (larger
// value wins, equal values go to the lower index), weights normalized (+1e-20) and scaled,
// slot K = (shared id, 1.0) when params[5] >= 0. Template values arrive as constexpr lines.

namespace colibri_router {

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off >= 1; off /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, off);
  }
  return v;
}

// A finite "minus infinity" (fast math may assume no infinities): masked groups and taken
// experts; real choices are sigmoid scores + bias, far above it.
#define ROUTER_NONE (-3.0e38f)

// Argmax step: (v, i) takes (ov, oi) when it is larger, or equal with a lower index.
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}

// A group's score: the sum of its top-2 choices c[g * gsz ...].
__device__ __forceinline__ float group_score(const float* c, int g, int gsz) {
  float b1 = ROUTER_NONE;
  float b2 = ROUTER_NONE;
  for (int j = g * gsz; j < g * gsz + gsz; ++j) {
    const float v = c[j];
    if (v > b1) {
      b2 = b1;
      b1 = v;
    } else if (v > b2) {
      b2 = v;
    }
  }
  return b2 + b1;
}

// Selected slot k's weight: its unbiased score, divided by the K selected scores' sum (in
// selection order, + 1e-20) when norm, times scale.
__device__ __forceinline__ float slot_weight(const float* scores, const int* sel, int K, int k, int norm,
                                             float scale) {
  float sum = 0.0f;
  for (int j = 0; j < K; ++j) {
    sum += scores[sel[j]];
  }
  float wt = scores[sel[k]];
  if (norm != 0) {
    wt = wt / (sum + 1e-20f);
  }
  return wt * scale;
}

}  // namespace colibri_router

// ==== kernel body: router_scores ====
  const int D = params[0];
  const int E = params[1];
  const int tid = int(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int e0 = int(blockIdx.x) * ROWS;
  __shared__ float red[NW * ROWS * S];
  int rows[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    rows[r] = min(e0 + r, E - 1);              // rows past E re-read E - 1, never written
  }
  float acc[ROWS][S];
  for (int r = 0; r < ROWS; ++r) {
    for (int s = 0; s < S; ++s) {
      acc[r][s] = 0.0f;
    }
  }
  const int n4 = V4 ? D / 4 : 0;
  // A weight that is a slice of a larger buffer may start only 4-byte aligned: one 16-byte
  // load when the address allows it, else four scalar loads (the Metal kernel's).
  const bool w16 = (reinterpret_cast<uintptr_t>(w) & 15) == 0;
  for (int u = tid; u < n4; u += 32 * NW) {
    float4 wv[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      const float* p = w + size_t(rows[r]) * size_t(D) + 4 * u;
      wv[r] = w16 ? *reinterpret_cast<const float4*>(p) : make_float4(p[0], p[1], p[2], p[3]);
    }
    for (int s = 0; s < S; ++s) {
      const int o = s * D + 4 * u;
      const float4 xv = make_float4(static_cast<float>(x[o]), static_cast<float>(x[o + 1]),
                                    static_cast<float>(x[o + 2]), static_cast<float>(x[o + 3]));
      for (int r = 0; r < ROWS; ++r) {
        acc[r][s] += wv[r].x * xv.x + wv[r].y * xv.y + wv[r].z * xv.z + wv[r].w * xv.w;
      }
    }
  }
  for (int i = 4 * n4 + tid; i < D; i += 32 * NW) {
    for (int r = 0; r < ROWS; ++r) {
      const float wi = w[size_t(rows[r]) * size_t(D) + i];
      for (int s = 0; s < S; ++s) {
        acc[r][s] += wi * static_cast<float>(x[s * D + i]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int s = 0; s < S; ++s) {
      acc[r][s] = colibri_router::warp_sum(acc[r][s]);
    }
  }
  if (lane == 0) {
    for (int r = 0; r < ROWS; ++r) {
      for (int s = 0; s < S; ++s) {
        red[(warp * ROWS + r) * S + s] = acc[r][s];
      }
    }
  }
  __syncthreads();
  // Thread r * S + s writes scores[s, e0 + r].
  if (tid < ROWS * S) {
    const int r = tid / S;
    const int s = tid % S;
    float z = 0.0f;
    for (int k = 0; k < NW; ++k) {
      z += red[(k * ROWS + r) * S + s];
    }
    if (e0 + r < E) {
      scores[s * E + e0 + r] = 1.0f / (1.0f + expf(-z));
    }
  }
// ==== kernel body: router_topk ====
  const int E = params[0];
  const int K = params[1];
  const int G = params[2];
  const int TKG = params[3];
  const int norm = params[4];
  const int shared = params[5];
  const int KO = K + (shared >= 0 ? 1 : 0);
  const int tid = int(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int s = int(blockIdx.y);
  __shared__ float ch[TG];                     // biased choice per expert
  __shared__ float gsc[32];                    // group scores
  __shared__ int gkeep[32];
  __shared__ float wv[32];                     // per-warp argmax
  __shared__ int wi[32];
  __shared__ int sel[32];                      // selected experts in order
  const float score = tid < E ? scores[s * E + tid] : 0.0f;
  float c = tid < E ? score + bias[tid] : ROUTER_NONE;
  if (G > 1) {
    ch[tid] = c;
    __syncthreads();
    const int gsz = E / G;
    if (tid < G) {
      gsc[tid] = colibri_router::group_score(ch, tid, gsz);
    }
    __syncthreads();
    if (tid < G) {
      int rank = 0;
      for (int g = 0; g < G; ++g) {
        rank += (gsc[g] > gsc[tid] || (gsc[g] == gsc[tid] && g < tid)) ? 1 : 0;
      }
      gkeep[tid] = rank < TKG ? 1 : 0;
    }
    __syncthreads();
    if (tid < E && gkeep[tid / gsz] == 0) {
      c = ROUTER_NONE;
    }
  }
  bool taken = tid >= E;
  for (int k = 0; k < K; ++k) {
    float v = taken ? ROUTER_NONE : c;
    int i = taken ? 1 << 30 : tid;
    for (int off = 16; off >= 1; off /= 2) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, off);
      const int oi = __shfl_xor_sync(0xffffffffu, i, off);
      colibri_router::better(v, i, ov, oi);
    }
    if (lane == 0) {
      wv[warp] = v;
      wi[warp] = i;
    }
    __syncthreads();
    if (warp == 0) {
      v = lane < TG / 32 ? wv[lane] : ROUTER_NONE;
      i = lane < TG / 32 ? wi[lane] : 1 << 30;
      for (int off = 16; off >= 1; off /= 2) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, off);
        const int oi = __shfl_xor_sync(0xffffffffu, i, off);
        colibri_router::better(v, i, ov, oi);
      }
      if (lane == 0) {
        sel[k] = i;
      }
    }
    __syncthreads();
    taken = taken || tid == sel[k];
  }
  if (tid < KO) {
    float wt = 1.0f;
    int id = shared;
    if (tid < K) {
      id = sel[tid];
      wt = colibri_router::slot_weight(scores + s * E, sel, K, tid, norm, fparams[0]);
    }
    ids[s * KO + tid] = id;
    weights[s * KO + tid] = wt;
  }

// router: noaux_tc routing of S <= 8 tokens in two launches (colibri_mlx/kernels/router.py):
//
//   router_scores  scores[s, e] = sigmoid(x_s . W_e)            (float32 weight [E, D])
//   router_topk    ids[s, k], weights[s, k] (+ the shared slot)  (one threadgroup per token)
//
// router_scores: the 7 MB float32 weight of DeepSeek-V3 (256 x 7168) is read once, spread
// over E / ROWS threadgroups (128 for ROWS = 2) of NW SIMD groups: thread t takes float4
// units t, t + 32 * NW, ... of ROWS weight rows against every token (split-K), partial sums
// meet through simd_sum and threadgroup memory. x is widened to float per load.
//
// router_topk (transformers' DeepseekV3TopkRouter): choice = score + bias (bias steers the
// selection only); with n_group > 1 a group's score is the sum of its top-2 choices and only
// the topk_group best groups stay; then K rounds of a threadgroup argmax pick the experts.
// Ties: the larger value wins, equal values go to the lower expert (group) index. Weights are
// the unbiased scores, divided by (their sum + 1e-20) when norm_topk_prob, times
// routed_scaling_factor. ids come out in selection order (descending choice). With a shared
// slot (params[5] >= 0) slot K is (shared id, 1.0).
// The CUDA twin metal_kernels/cuda/router.cu implements the same algorithm line for line.
//
// router_scores params (int32[8]): D, E. Template: T (x dtype), S, ROWS, NW, V4 (D % 4 == 0).
// router_topk params (int32[8]): E, K, n_group, topk_group, norm_topk_prob, shared id or -1;
// fparams (float32[8]): routed_scaling_factor. Template: TG (threads, >= E, multiple of 32).

// A finite "minus infinity" (fast math may assume no infinities): masked groups and taken
// experts; real choices are sigmoid scores + bias, far above it.
#define ROUTER_NONE (-3.0e38f)

// Argmax step: (v, i) takes (ov, oi) when it is larger, or equal with a lower index.
inline void router_better(thread float& v, thread int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}

// A group's score: the sum of its top-2 choices c[g * gsz ...].
inline float router_group_score(const threadgroup float* c, int g, int gsz) {
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
// selection order, + 1e-20) when norm, times scale. A template over the scores' pointer: MLX
// binds an input of fewer than 8 elements (one row of < 8 experts) in the constant address space.
template <typename ScoresPtr>
inline float router_slot_weight(ScoresPtr scores, const threadgroup int* sel, int K, int k, int norm, float scale) {
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

// ==== kernel body: router_scores ====
  const int D = params[0];
  const int E = params[1];
  const int tid = int(thread_position_in_threadgroup.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int e0 = int(threadgroup_position_in_grid.x) * ROWS;
  threadgroup float red[NW * ROWS * S];
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
  for (int u = tid; u < n4; u += 32 * NW) {
    float4 wv[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      // Four scalar loads: a weight that is a slice of a larger buffer may start only 4-byte
      // aligned (the CUDA twin checks the address and uses one 16-byte load when it can).
      const device float* p = w + size_t(rows[r]) * size_t(D) + 4 * u;
      wv[r] = float4(p[0], p[1], p[2], p[3]);
    }
    for (int s = 0; s < S; ++s) {
      const int o = s * D + 4 * u;
      const float4 xv = float4(float(x[o]), float(x[o + 1]), float(x[o + 2]), float(x[o + 3]));
      for (int r = 0; r < ROWS; ++r) {
        acc[r][s] += dot(wv[r], xv);
      }
    }
  }
  for (int i = 4 * n4 + tid; i < D; i += 32 * NW) {
    for (int r = 0; r < ROWS; ++r) {
      const float wi = w[size_t(rows[r]) * size_t(D) + i];
      for (int s = 0; s < S; ++s) {
        acc[r][s] += wi * float(x[s * D + i]);
      }
    }
  }
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
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Thread r * S + s writes scores[s, e0 + r].
  if (tid < ROWS * S) {
    const int r = tid / S;
    const int s = tid % S;
    float z = 0.0f;
    for (int k = 0; k < NW; ++k) {
      z += red[(k * ROWS + r) * S + s];
    }
    if (e0 + r < E) {
      scores[s * E + e0 + r] = 1.0f / (1.0f + exp(-z));
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
  const int tid = int(thread_position_in_threadgroup.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int s = int(threadgroup_position_in_grid.y);
  threadgroup float ch[TG];                    // biased choice per expert
  threadgroup float gsc[32];                   // group scores
  threadgroup int gkeep[32];
  threadgroup float wv[32];                    // per-SIMD-group argmax
  threadgroup int wi[32];
  threadgroup int sel[32];                     // selected experts in order
  const float score = tid < E ? scores[s * E + tid] : 0.0f;
  float c = tid < E ? score + bias[tid] : ROUTER_NONE;
  if (G > 1) {
    ch[tid] = c;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int gsz = E / G;
    if (tid < G) {
      gsc[tid] = router_group_score(ch, tid, gsz);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < G) {
      int rank = 0;
      for (int g = 0; g < G; ++g) {
        rank += (gsc[g] > gsc[tid] || (gsc[g] == gsc[tid] && g < tid)) ? 1 : 0;
      }
      gkeep[tid] = rank < TKG ? 1 : 0;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < E && gkeep[tid / gsz] == 0) {
      c = ROUTER_NONE;
    }
  }
  bool taken = tid >= E;
  for (int k = 0; k < K; ++k) {
    float v = taken ? ROUTER_NONE : c;
    int i = taken ? 1 << 30 : tid;
    for (int off = 16; off >= 1; off /= 2) {
      const float ov = simd_shuffle_xor(v, ushort(off));
      const int oi = simd_shuffle_xor(i, ushort(off));
      router_better(v, i, ov, oi);
    }
    if (lane == 0) {
      wv[warp] = v;
      wi[warp] = i;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (warp == 0) {
      v = lane < TG / 32 ? wv[lane] : ROUTER_NONE;
      i = lane < TG / 32 ? wi[lane] : 1 << 30;
      for (int off = 16; off >= 1; off /= 2) {
        const float ov = simd_shuffle_xor(v, ushort(off));
        const int oi = simd_shuffle_xor(i, ushort(off));
        router_better(v, i, ov, oi);
      }
      if (lane == 0) {
        sel[k] = i;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    taken = taken || tid == sel[k];
  }
  if (tid < KO) {
    float wt = 1.0f;
    int id = shared;
    if (tid < K) {
      id = sel[tid];
      wt = router_slot_weight(scores + s * E, sel, K, tid, norm, fparams[0]);
    }
    ids[s * KO + tid] = id;
    weights[s * KO + tid] = wt;
  }

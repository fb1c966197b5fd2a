// qgemv, CUDA twin of metal_kernels/qgemv.metal (same algorithm, same launch, same params).
//
// One block of NW warps per ROWS consecutive output rows, grid = (32 * NW * ceil(O / ROWS))
// threads. Thread t of the block takes units t, t + 32 * NW, ... of each of its rows (see the
// .metal file for the unit of each fmt): the NW warps split the row (split-K), the x values of
// a unit are widened once for all ROWS rows, each decoded weight is applied to all S rows of x.
// UNROLL units x ROWS rows of loads (and fmt 4/5 scales) are issued before any arithmetic; a
// unit wholly inside x's row reads x without bounds tests; PF 1 issues the next step's loads
// before this step's arithmetic. fmt 2/4 decode nibble
// pairs as half2 (exact), products and sums are float32; __shfl_xor_sync reduces a warp,
// shared memory the NW warps. Rows past O (the last block) re-read row O - 1 and are not
// written; MLX launches exactly ceil(O / ROWS) blocks of 32 * NW threads.
//
// Template values arrive as `constexpr int` / `using T = ...` lines at the top of the body
// (MLX_PLATFORM.md B2), so helpers take them as explicit template arguments.

namespace colibri_qgemv {

namespace qd = colibri_qd;

// acc[r][s] += sum over unit u of row r of w * x[s]. sc: the unit's segment scales when
// they live in memory (loaded with the weights), else decoded here. XV 2: the unit lies
// wholly inside x's row (aligned): x is read without per-8 bounds tests.
template <int FMT, int GS, int S, int ROWS, int XV, int W, int NIB, typename T>
__device__ __forceinline__ void unit(const uint32_t (*raw)[W], const T* x,
                                     const float (*sc)[qd::wpu(FMT) / qd::seg(FMT, GS)],
                                     const uint32_t* e8grid, int I, int u, float (*acc)[S]) {
  constexpr int NSEG = qd::wpu(FMT) / qd::seg(FMT, GS);
  int xoff[S];
#pragma unroll
  for (int s = 0; s < S; ++s) {
    xoff[s] = s * I;
  }
#pragma unroll
  for (int g = 0; g < NSEG; ++g) {
    float d[ROWS][S];
    qd::seg_dots<FMT, GS, S, ROWS, XV, W, T, NIB>(raw, x, xoff, 0xFFFFFFFFu, I, u, g, e8grid, d);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float f = qd::scales_in_memory(FMT) ? sc[r][g]
                                                : qd::seg_scale<FMT, GS>(nullptr, 0, 0, u, g, raw[r]);
#pragma unroll
      for (int s = 0; s < S; ++s) {
        acc[r][s] += d[r][s] * f;
      }
    }
  }
}

// The weights and (fmt 4/5) scales of units base, base + 32 * NW, ... (UNROLL of them) of
// the ROWS rows; units past the row are not read (and not computed).
template <int FMT, int GS, int ROWS, int NW, int UNROLL, int VEC, bool W16>
__device__ __forceinline__ void load_units(const uint8_t* w, const float* scales, const int* rows,
                                           int rb, int ng, int n_units, int base,
                                           uint32_t (*raw)[ROWS][qd::words(FMT)],
                                           float (*sc)[ROWS][qd::wpu(FMT) / qd::seg(FMT, GS)]) {
  constexpr int NSEG = qd::wpu(FMT) / qd::seg(FMT, GS);
#pragma unroll
  for (int j = 0; j < UNROLL; ++j) {
    const int u = base + 32 * NW * j;
    if (u < n_units) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        qd::load<FMT, VEC, W16>(w + size_t(rows[r]) * size_t(rb), rb, u, raw[j][r]);
        qd::load_aux<FMT, GS>(scales, rows[r], ng, u, raw[j][r]);
#pragma unroll
        for (int g = 0; g < NSEG; ++g) {
          sc[j][r][g] = qd::scales_in_memory(FMT)
                            ? qd::seg_scale<FMT, GS>(scales, rows[r], ng, u, g, raw[j][r])
                            : 1.0f;
        }
      }
    }
  }
}

template <int FMT, int GS, int S, int ROWS, int NW, int UNROLL, int XV, int NIB, typename T>
__device__ __forceinline__ void compute_units(const T* x, const uint32_t* e8grid, int I,
                                              int n_units, int base,
                                              const uint32_t (*raw)[ROWS][qd::words(FMT)],
                                              const float (*sc)[ROWS][qd::wpu(FMT) / qd::seg(FMT, GS)],
                                              float (*acc)[S]) {
  // The unguarded copy of the unit body only for S <= 4: with 8 rows of x the second copy
  // costs registers (fmt 3 S = 8 spilled) for a small share of its instructions.
  constexpr bool FULL_UNITS = S <= 4;
#pragma unroll
  for (int j = 0; j < UNROLL; ++j) {
    const int u = base + 32 * NW * j;
    if (XV && FULL_UNITS && qd::wpu(FMT) * (u + 1) <= I) {
      unit<FMT, GS, S, ROWS, 2, qd::words(FMT), NIB, T>(raw[j], x, sc[j], e8grid, I, u, acc);
    } else if (u < n_units) {
      unit<FMT, GS, S, ROWS, XV, qd::words(FMT), NIB, T>(raw[j], x, sc[j], e8grid, I, u, acc);
    }
  }
}

// PF 0: load UNROLL units x ROWS rows, then compute them. PF 1: two register buffers, the
// next step's loads are issued before this step's arithmetic (bytes stay in flight while the
// warp computes, at the cost of a second buffer of registers).
template <int FMT, int GS, int S, int ROWS, int NW, int UNROLL, int VEC, bool W16, int XV,
          int NIB, int PF, typename T>
__device__ __forceinline__ void rows_partial(const T* x, const uint8_t* w, const float* scales,
                                             const uint32_t* e8grid, const int* rows, int rb,
                                             int ng, int I, int n_units, int tid,
                                             float (*acc)[S]) {
  constexpr int W = qd::words(FMT);
  constexpr int NSEG = qd::wpu(FMT) / qd::seg(FMT, GS);
  constexpr int STEP = 32 * NW * UNROLL;
  uint32_t raw_a[UNROLL][ROWS][W];
  float sc_a[UNROLL][ROWS][NSEG];
  if (PF) {
    uint32_t raw_b[UNROLL][ROWS][W];
    float sc_b[UNROLL][ROWS][NSEG];
    load_units<FMT, GS, ROWS, NW, UNROLL, VEC, W16>(w, scales, rows, rb, ng, n_units, tid, raw_a, sc_a);
    for (int base = tid; base < n_units; base += 2 * STEP) {
      load_units<FMT, GS, ROWS, NW, UNROLL, VEC, W16>(w, scales, rows, rb, ng, n_units, base + STEP,
                                                      raw_b, sc_b);
      compute_units<FMT, GS, S, ROWS, NW, UNROLL, XV, NIB, T>(x, e8grid, I, n_units, base, raw_a,
                                                              sc_a, acc);
      if (base + STEP >= n_units) {
        break;
      }
      load_units<FMT, GS, ROWS, NW, UNROLL, VEC, W16>(w, scales, rows, rb, ng, n_units,
                                                      base + 2 * STEP, raw_a, sc_a);
      compute_units<FMT, GS, S, ROWS, NW, UNROLL, XV, NIB, T>(x, e8grid, I, n_units, base + STEP,
                                                              raw_b, sc_b, acc);
    }
  } else {
    for (int base = tid; base < n_units; base += STEP) {
      load_units<FMT, GS, ROWS, NW, UNROLL, VEC, W16>(w, scales, rows, rb, ng, n_units, base, raw_a,
                                                      sc_a);
      compute_units<FMT, GS, S, ROWS, NW, UNROLL, XV, NIB, T>(x, e8grid, I, n_units, base, raw_a,
                                                              sc_a, acc);
    }
  }
}

}  // namespace colibri_qgemv

// ==== kernel body ====
  // KO..KNU > 0: the shape compiled in (the persistent default: no params load ahead of the
  // first weight load, constant loop bounds); 0: read from params.
  const int O = KO > 0 ? KO : params[0];
  const int I = KI > 0 ? KI : params[1];
  const int rb = KRB > 0 ? KRB : params[2];
  const int ng = KNG > 0 ? KNG : params[3];
  const int n_units = KNU > 0 ? KNU : params[4];
  const int tid = int(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int n_blocks = (O + ROWS - 1) / ROWS;
  __shared__ float red[NW * ROWS * S];
  // A row slice of a larger array can start anywhere 8-aligned; vector loads of x need 16 bytes.
  const bool w16 = (reinterpret_cast<uintptr_t>(w) & 15) == 0;
  const bool x16 = (reinterpret_cast<uintptr_t>(x) & 15) == 0;
  // PERS 1: fewer blocks than row blocks; each loops over row blocks b, b + blocks, ...
  const int blk_step = PERS ? int(gridDim.x) : n_blocks;
  for (int blk = int(blockIdx.x); blk < n_blocks; blk += blk_step) {
    const int row0 = blk * ROWS;
    int rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      rows[r] = min(row0 + r, O - 1);
    }
    float acc[ROWS][S];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
      for (int s = 0; s < S; ++s) {
        acc[r][s] = 0.0f;
      }
    }
    if (w16 && x16) {
      colibri_qgemv::rows_partial<FMT, GS, S, ROWS, NW, UNROLL, VEC, true, XV, NIB, PF, T>(
          x, w, scales, e8grid, rows, rb, ng, I, n_units, tid, acc);
    } else {
      colibri_qgemv::rows_partial<FMT, GS, S, ROWS, NW, UNROLL, VEC, false, 0, NIB, PF, T>(
          x, w, scales, e8grid, rows, rb, ng, I, n_units, tid, acc);
    }
    colibri_qd::warp_partials<ROWS, S>(acc, red, warp, lane);
    if (NW > 1) {
      __syncthreads();
    }
    // Thread r * S + s of the first warp writes y[s, row0 + r].
    if (tid < ROWS * S) {
      const int r = tid / S;
      const int s = tid % S;
      float v = 0.0f;
      if (NW > 1) {
#pragma unroll
        for (int k = 0; k < NW; ++k) {
          v += red[(k * ROWS + r) * S + s];
        }
      } else {
#pragma unroll
        for (int rr = 0; rr < ROWS; ++rr) {
#pragma unroll
          for (int ss = 0; ss < S; ++ss) {
            v = (rr == r && ss == s) ? acc[rr][ss] : v;
          }
        }
      }
      const int row = row0 + r;
      if (row < O) {
        const float row_scale = colibri_qd::row_scale<FMT>(scales, row);
        // RES 1: y = res + y, rounded as the separate add would round it (to T, then the sum).
        const OT yv = static_cast<OT>(v * row_scale);
        y[s * O + row] = RES ? static_cast<OT>(static_cast<float>(res[s * O + row]) + static_cast<float>(yv)) : yv;
      }
    }
    if (PERS && NW > 1) {
      __syncthreads();                          // red is written again next block
    }
  }

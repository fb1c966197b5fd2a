// qgemv: y[s, o] = sum_i x[s, i] * W[o, i] for S <= 8 rows of x, W in colibri fmt 1..6 or an
// MLX format (qdecode.h: 32-weight units, GS the MLX group size).
//
// Launch (colibri_mlx/kernels/qgemv.py): one threadgroup of NW SIMD groups per ROWS
// consecutive output rows, grid = (32 * NW * ceil(O / ROWS), 1, 1). A row is cut into
// "units" (16 bytes = 16/32/64/32 weights for fmt 1/2/3/4; one 24-byte group of 64 weights
// for fmt 5; one 32-weight sub-block for fmt 6). Thread t of the threadgroup takes units
// t, t + 32 * NW, ... of every one of its ROWS rows: the NW SIMD groups split the row
// (split-K, so a small O still fills the GPU), each step of a SIMD group reads one contiguous
// span per row, and every weight byte is read once per call. The x values of a unit are
// loaded and widened once and applied to all ROWS rows (x costs 1/ROWS of what it did with
// one row per SIMD group), each decoded weight to all S rows of x. Each thread issues the
// loads of UNROLL units x ROWS rows (and the fmt 4/5 scales) before any arithmetic to keep
// bytes in flight; a unit wholly inside x's row reads x without bounds tests.
// Accumulation is float32; simd_sum reduces a SIMD group, threadgroup memory the NW groups.
//
// The unit loads and exact decoders (fmt 2/4: two nibbles per half2 instruction) are
// metal_kernels/qdecode.h, prepended to this header by colibri_mlx/kernels/qgemv.py.
//
// Template: T (x/y dtype), FMT, S, GS (fmt 4 group size, a multiple of 16: a scale covers
// whole 16-weight halves of a unit), VEC (2: rows a multiple of 16 bytes, 1: of 8 bytes,
// vector loads; 0: byte loads that stop at the row end), XV (rows of x are 16-byte aligned:
// x read 8 values per load), UNROLL, ROWS, NW, NIB (fmt 2/4 decode: 1 = fp16-subnormal codes
// with one -8 sum x per segment, qd_seg_dots_sum_x; 0 = magic-number codes, qd_decode8), PF
// (1: the next step's loads are issued before this step's arithmetic, two register buffers),
// RES (1: y = res + x W^T, the residual add of a decoder layer done by the writing thread;
// 0: res is not read, the caller passes x again), OT (y's dtype: T, or float32 for logits).
// params (int32[8], >= 8 elements so MLX puts it in device space):
// O, I, row bytes, scales (fmt 4/5) or super-blocks (fmt 6) per row, units per row, 0, 0, 0.
// The caller pads every input to >= 8 elements for the same reason, so helpers can take
// `const device` pointers.
//
// The CUDA twin metal_kernels/cuda/qgemv.cu implements the same algorithm line for line.

// acc[r][s] += sum over unit u of row r of w * x[s]: x widened once for all ROWS rows,
// each decoded weight applied to all S rows of x, one scale multiply per segment. sc: the
// unit's segment scales when they live in memory (loaded with the weights), else decoded
// here. XV 2: the unit lies wholly inside x's row (aligned): x is read without bounds tests.
template <int FMT, int GS, int S, int ROWS, int XV, int W, int NIB, typename T>
inline void qg_unit(thread const uint (*raw)[W], const device T* x,
                    thread const float (*sc)[qd_wpu(FMT) / qd_seg(FMT, GS)],
                    const device uint* e8grid, int I, int u, thread float (*acc)[S]) {
  constexpr int NSEG = qd_wpu(FMT) / qd_seg(FMT, GS);
  int xoff[S];
  for (int s = 0; s < S; ++s) {
    xoff[s] = s * I;
  }
  for (int g = 0; g < NSEG; ++g) {
    float d[ROWS][S];
    qd_seg_dots<FMT, GS, S, ROWS, XV, W, T, NIB>(raw, x, xoff, 0xFFFFFFFFu, I, u, g, e8grid, d);
    for (int r = 0; r < ROWS; ++r) {
      const float f = qd_scales_in_memory(FMT)
                          ? sc[r][g]
                          : qd_seg_scale<FMT, GS>((const device float*)nullptr, 0, 0, u, g, raw[r]);
      for (int s = 0; s < S; ++s) {
        acc[r][s] += d[r][s] * f;
      }
    }
  }
}

// The weights and (fmt 4/5) scales of units base, base + 32 * NW, ... (UNROLL of them) of
// the ROWS rows; units past the row are not read (and not computed).
template <int FMT, int GS, int ROWS, int NW, int UNROLL, int VEC>
inline void qg_load_units(const device uint8_t* w, const device float* scales,
                          thread const int* rows, int rb, int ng, int n_units, int base,
                          thread uint (*raw)[ROWS][qd_words(FMT)],
                          thread float (*sc)[ROWS][qd_wpu(FMT) / qd_seg(FMT, GS)]) {
  constexpr int NSEG = qd_wpu(FMT) / qd_seg(FMT, GS);
  for (int j = 0; j < UNROLL; ++j) {
    const int u = base + 32 * NW * j;
    if (u < n_units) {
      for (int r = 0; r < ROWS; ++r) {
        qd_load<FMT, VEC>(w + size_t(rows[r]) * size_t(rb), rb, u, raw[j][r]);
        qd_load_aux<FMT, GS>(scales, rows[r], ng, u, raw[j][r]);
        for (int g = 0; g < NSEG; ++g) {
          sc[j][r][g] = qd_scales_in_memory(FMT)
                            ? qd_seg_scale<FMT, GS>(scales, rows[r], ng, u, g, raw[j][r])
                            : 1.0f;
        }
      }
    }
  }
}

template <int FMT, int GS, int S, int ROWS, int NW, int UNROLL, int XV, int NIB, typename T>
inline void qg_compute_units(const device T* x, const device uint* e8grid, int I, int n_units,
                             int base, thread const uint (*raw)[ROWS][qd_words(FMT)],
                             thread const float (*sc)[ROWS][qd_wpu(FMT) / qd_seg(FMT, GS)],
                             thread float (*acc)[S]) {
  // The unguarded copy of the unit body only for S <= 4: with 8 rows of x the second copy
  // costs registers (CUDA fmt 3 S = 8 spilled) for a small share of its instructions.
  constexpr bool FULL_UNITS = S <= 4;
  for (int j = 0; j < UNROLL; ++j) {
    const int u = base + 32 * NW * j;
    if (XV && FULL_UNITS && qd_wpu(FMT) * (u + 1) <= I) {
      qg_unit<FMT, GS, S, ROWS, 2, qd_words(FMT), NIB, T>(raw[j], x, sc[j], e8grid, I, u, acc);
    } else if (u < n_units) {
      qg_unit<FMT, GS, S, ROWS, XV, qd_words(FMT), NIB, T>(raw[j], x, sc[j], e8grid, I, u, acc);
    }
  }
}

// ==== kernel body ====
  const int O = params[0];
  const int I = params[1];
  const int rb = params[2];
  const int ng = params[3];
  const int n_units = params[4];
  const int tid = int(thread_position_in_threadgroup.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  threadgroup float red[NW * ROWS * S];
  // PERS 1: fewer threadgroups than row blocks; each loops over row blocks tg, tg + groups, ...
  const int n_blocks = (O + ROWS - 1) / ROWS;
  const int blk_step = PERS ? int(threadgroups_per_grid.x) : n_blocks;
  for (int blk = int(threadgroup_position_in_grid.x); blk < n_blocks; blk += blk_step) {
    const int row0 = blk * ROWS;
    // Rows past O (the last threadgroup) re-read row O - 1 and are not written.
    int rows[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      rows[r] = min(row0 + r, O - 1);
    }
    float acc[ROWS][S];
    for (int r = 0; r < ROWS; ++r) {
      for (int s = 0; s < S; ++s) {
        acc[r][s] = 0.0f;
      }
    }
    // PF 0: load UNROLL units x ROWS rows (weights and fmt 4/5 scales), then compute them.
    // PF 1: two register buffers, the next step's loads issued before this step's arithmetic.
    constexpr int W = qd_words(FMT);
    constexpr int NSEG = qd_wpu(FMT) / qd_seg(FMT, GS);
    constexpr int STEP = 32 * NW * UNROLL;
    uint raw_a[UNROLL][ROWS][W];
    float sc_a[UNROLL][ROWS][NSEG];
    if (PF) {
      uint raw_b[UNROLL][ROWS][W];
      float sc_b[UNROLL][ROWS][NSEG];
      qg_load_units<FMT, GS, ROWS, NW, UNROLL, VEC>(w, scales, rows, rb, ng, n_units, tid, raw_a, sc_a);
      for (int base = tid; base < n_units; base += 2 * STEP) {
        qg_load_units<FMT, GS, ROWS, NW, UNROLL, VEC>(w, scales, rows, rb, ng, n_units, base + STEP,
                                                      raw_b, sc_b);
        qg_compute_units<FMT, GS, S, ROWS, NW, UNROLL, XV, NIB, T>(x, e8grid, I, n_units, base, raw_a,
                                                                   sc_a, acc);
        if (base + STEP >= n_units) {
          break;
        }
        qg_load_units<FMT, GS, ROWS, NW, UNROLL, VEC>(w, scales, rows, rb, ng, n_units,
                                                      base + 2 * STEP, raw_a, sc_a);
        qg_compute_units<FMT, GS, S, ROWS, NW, UNROLL, XV, NIB, T>(x, e8grid, I, n_units,
                                                                   base + STEP, raw_b, sc_b, acc);
      }
    } else {
      for (int base = tid; base < n_units; base += STEP) {
        qg_load_units<FMT, GS, ROWS, NW, UNROLL, VEC>(w, scales, rows, rb, ng, n_units, base, raw_a,
                                                      sc_a);
        qg_compute_units<FMT, GS, S, ROWS, NW, UNROLL, XV, NIB, T>(x, e8grid, I, n_units, base, raw_a,
                                                                   sc_a, acc);
      }
    }
    qd_simd_partials<ROWS, S>(acc, red, warp, lane);
    if (NW > 1) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    // Thread r * S + s of the first SIMD group writes y[s, row0 + r].
    if (tid < ROWS * S) {
      const int r = tid / S;
      const int s = tid % S;
      float v = 0.0f;
      if (NW > 1) {
        for (int k = 0; k < NW; ++k) {
          v += red[(k * ROWS + r) * S + s];
        }
      } else {
        for (int rr = 0; rr < ROWS; ++rr) {
          for (int ss = 0; ss < S; ++ss) {
            v = (rr == r && ss == s) ? acc[rr][ss] : v;
          }
        }
      }
      const int row = row0 + r;
      if (row < O) {
        const float row_scale = qd_row_scale<FMT>(scales, row);
        // RES 1: y = res + y, rounded as the separate add would round it (to T, then the sum).
        const OT yv = static_cast<OT>(v * row_scale);
        y[s * O + row] = RES ? static_cast<OT>(float(res[s * O + row]) + float(yv)) : yv;
      }
    }
    if (PERS && NW > 1) {
      threadgroup_barrier(mem_flags::mem_threadgroup);   // red is written again next block
    }
  }

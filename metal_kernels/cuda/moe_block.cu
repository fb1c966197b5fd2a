// moe_block, CUDA twin of metal_kernels/moe_block.metal (same algorithm, launches, params):
// qgemv's structure on stacked expert banks, one token a launch (grid.y picks it: moe_gate_up
// its slot, moe_down the token). moe_gate_up: the token's leader slot of an expert computes
// ROWS gate rows + the same ROWS up rows (2 * ROWS rows share each x load), NW warps split the
// row (split-K, partials meet in shared memory), silu(g) * u is written to all of the token's
// slots of that expert. moe_down: one block per ROWS output rows; the work items (distinct
// expert, unit) are split across all threads, each weighted by the expert's summed gate
// weight; the sum over experts is one fixed reduction (no atomics, deterministic). Decoding is
// qdecode.cuh's (prepended to this header); fmt 4/5 scales are loaded with the weights; NIB
// picks the fmt 2/4 decode (qgemv's).
// h: moe_gate_up's HP > 0 writes it in xp_index's layout, moe_down's XP 1 reads it so (the
// Metal header says why). Template values arrive as constexpr lines; MLX launches grid / block
// of 32 * NW threads.

namespace colibri_moe {

namespace qd = colibri_qd;

__device__ constexpr int max_slots() {
  return 96;
}

__device__ __forceinline__ int local(const int32_t* ids, const int32_t* lut, int a, int E) {
  const int id = ids[a];
  return (id >= 0 && id < E) ? lut[id] : -1;
}

// sl[a] = group-local expert of every slot, once per block.
__device__ __forceinline__ void slot_table(const int32_t* ids, const int32_t* lut, int n_slots,
                                           int E, int tid, int nthreads, int* sl) {
  for (int b = tid; b < n_slots; b += nthreads) {
    sl[b] = local(ids, lut, b, E);
  }
  __syncthreads();
}

// The weights and (fmt 4/5) scales of units base, base + 32 * NW, ... (UNROLL of them) of the
// R2 rows; units past the row are not read.
template <int FMT, int GS, int R2, int NW, int UNROLL, int VEC, bool W16>
__device__ __forceinline__ void gate_up_load(const uint8_t* wgu, const float* sgu, const int* rows,
                                             int rb, int ng, int n_units, int base,
                                             uint32_t (*raw)[R2][qd::words(FMT)],
                                             float (*scl)[R2][qd::wpu(FMT) / qd::seg(FMT, GS)]) {
  constexpr int NSEG = qd::wpu(FMT) / qd::seg(FMT, GS);
#pragma unroll
  for (int j = 0; j < UNROLL; ++j) {
    const int u = base + 32 * NW * j;
    if (u < n_units) {
#pragma unroll
      for (int r = 0; r < R2; ++r) {
        qd::load<FMT, VEC, W16>(wgu + size_t(rows[r]) * size_t(rb), rb, u, raw[j][r]);
        qd::load_aux<FMT, GS>(sgu, rows[r], ng, u, raw[j][r]);
#pragma unroll
        for (int g = 0; g < NSEG; ++g) {
          scl[j][r][g] = qd::scales_in_memory(FMT) ? qd::seg_scale<FMT, GS>(sgu, rows[r], ng, u, g, raw[j][r]) : 1.0f;
        }
      }
    }
  }
}

// acc[r] += unit u of the rows (loaded as raw / scl) against the token's x row (x + xoff).
// acc[r][0]: qdecode's seg_dots / warp_partials take rows x rows of x, here one.
template <int FMT, int GS, int R2, int XV, int NIB, typename T>
__device__ __forceinline__ void gate_up_unit(const T* x, const float* sgu, const uint32_t* e8grid, const int* rows,
                                             int xoff, int ng, int I, int u,
                                             const uint32_t (*raw)[qd::words(FMT)],
                                             const float (*scl)[qd::wpu(FMT) / qd::seg(FMT, GS)],
                                             float (*acc)[1]) {
  constexpr int W = qd::words(FMT);
  constexpr int NSEG = qd::wpu(FMT) / qd::seg(FMT, GS);
#pragma unroll
  for (int g = 0; g < NSEG; ++g) {
    float d[R2][1];
    qd::seg_dots<FMT, GS, 1, R2, XV, W, T, NIB>(raw, x, &xoff, 1u, I, u, g, e8grid, d);
#pragma unroll
    for (int r = 0; r < R2; ++r) {
      const float sc = qd::scales_in_memory(FMT) ? scl[r][g] : qd::seg_scale<FMT, GS>(sgu, rows[r], ng, u, g, raw[r]);
      acc[r][0] += d[r][0] * sc;
    }
  }
}

// acc[r] += the loaded units (base, base + 32 * NW, ...) against the token's x row.
// A unit wholly inside x's row (aligned) reads x without per-8 bounds tests (XV 2), as
// qgemv's units do.
template <int FMT, int GS, int R2, int NW, int UNROLL, int XV, int NIB, typename T>
__device__ __forceinline__ void gate_up_compute(const T* x, const float* sgu, const uint32_t* e8grid,
                                                const int* rows, int xoff,
                                                int ng, int I, int n_units, int base,
                                                const uint32_t (*raw)[R2][qd::words(FMT)],
                                                const float (*scl)[R2][qd::wpu(FMT) / qd::seg(FMT, GS)],
                                                float (*acc)[1]) {
#pragma unroll
  for (int j = 0; j < UNROLL; ++j) {
    const int u = base + 32 * NW * j;
    if (XV && qd::wpu(FMT) * (u + 1) <= I) {
      gate_up_unit<FMT, GS, R2, 2, NIB, T>(x, sgu, e8grid, rows, xoff, ng, I, u, raw[j], scl[j], acc);
    } else if (u < n_units) {
      gate_up_unit<FMT, GS, R2, XV, NIB, T>(x, sgu, e8grid, rows, xoff, ng, I, u, raw[j], scl[j], acc);
    }
  }
}

// acc[r] += the rows' units tid, tid + 32 * NW, ... against the token's x row. PF 0:
// load UNROLL units x R2 rows, then compute them; PF 1 (qgemv's): two register buffers, the
// next step's loads issued before this step's arithmetic, so a warp keeps bytes in flight
// while it decodes (one load latency per block instead of one per step).
template <int FMT, int GS, int R2, int NW, int UNROLL, int VEC, bool W16, int XV, int NIB,
          int PF, typename T>
__device__ __forceinline__ void gate_up_partial(const T* x, const uint8_t* wgu, const float* sgu,
                                                const uint32_t* e8grid, const int* rows,
                                                int xoff, int rb, int ng,
                                                int I, int n_units, int tid, float (*acc)[1]) {
  constexpr int W = qd::words(FMT);
  constexpr int NSEG = qd::wpu(FMT) / qd::seg(FMT, GS);
  constexpr int STEP = 32 * NW * UNROLL;
  uint32_t raw_a[UNROLL][R2][W];
  float scl_a[UNROLL][R2][NSEG];               // fmt 4/5 scales, loaded with the weights
  if (PF) {
    uint32_t raw_b[UNROLL][R2][W];
    float scl_b[UNROLL][R2][NSEG];
    gate_up_load<FMT, GS, R2, NW, UNROLL, VEC, W16>(wgu, sgu, rows, rb, ng, n_units, tid, raw_a, scl_a);
    for (int base = tid; base < n_units; base += 2 * STEP) {
      gate_up_load<FMT, GS, R2, NW, UNROLL, VEC, W16>(wgu, sgu, rows, rb, ng, n_units, base + STEP,
                                                      raw_b, scl_b);
      gate_up_compute<FMT, GS, R2, NW, UNROLL, XV, NIB, T>(x, sgu, e8grid, rows, xoff, ng, I,
                                                           n_units, base, raw_a, scl_a, acc);
      if (base + STEP >= n_units) {
        break;
      }
      gate_up_load<FMT, GS, R2, NW, UNROLL, VEC, W16>(wgu, sgu, rows, rb, ng, n_units,
                                                      base + 2 * STEP, raw_a, scl_a);
      gate_up_compute<FMT, GS, R2, NW, UNROLL, XV, NIB, T>(x, sgu, e8grid, rows, xoff, ng, I,
                                                           n_units, base + STEP, raw_b, scl_b, acc);
    }
  } else {
    for (int base = tid; base < n_units; base += STEP) {
      gate_up_load<FMT, GS, R2, NW, UNROLL, VEC, W16>(wgu, sgu, rows, rb, ng, n_units, base, raw_a, scl_a);
      gate_up_compute<FMT, GS, R2, NW, UNROLL, XV, NIB, T>(x, sgu, e8grid, rows, xoff, ng, I,
                                                           n_units, base, raw_a, scl_a, acc);
    }
  }
}

// moe_down's work item i = (distinct expert i / n_units, unit i % n_units). Where an item's
// bytes are: ewo / eso[je], the offsets of the distinct expert's first down row and of its
// scales (a table built once a block), plus the row block's offsets, the same for every item: woff (row0 * rb), soff
// (row0 * ng) and the rows' deltas rd[r] (r, or O - 1 - row0 for rows past O in the last
// block). So an item costs one shared load and adds, not two dependent shared loads and 64-bit
// products a row. The weights and (fmt 4/5) scales of items base, base + 32 * NW, ...
// (UNROLL of them) of the ROWS rows; items past n_items are not read.
template <int FMT, int GS, int ROWS, int NW, int UNROLL, int VEC, bool W16>
__device__ __forceinline__ void down_load(const uint8_t* wd, const float* sd, const size_t* ewo,
                                          const size_t* eso, const int* rd,
                                          size_t woff, size_t soff, int rb, int ng, int n_units, int n_items,
                                          int base, uint32_t (*raw)[ROWS][qd::words(FMT)],
                                          float (*scl)[ROWS][qd::wpu(FMT) / qd::seg(FMT, GS)]) {
  constexpr int NSEG = qd::wpu(FMT) / qd::seg(FMT, GS);
#pragma unroll
  for (int j = 0; j < UNROLL; ++j) {
    const int item = base + 32 * NW * j;
    if (item < n_items) {
      const int je = item / n_units;
      const int u = item - je * n_units;
      const uint8_t* w0 = wd + (ewo[je] + woff);
      const float* s0 = sd + (eso[je] + soff);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        qd::load<FMT, VEC, W16>(w0 + rd[r] * rb, rb, u, raw[j][r]);
        qd::load_aux<FMT, GS>(s0, rd[r], ng, u, raw[j][r]);
#pragma unroll
        for (int g = 0; g < NSEG; ++g) {
          scl[j][r][g] = qd::scales_in_memory(FMT) ? qd::seg_scale<FMT, GS>(s0, rd[r], ng, u, g, raw[j][r]) : 1.0f;
        }
      }
    }
  }
}

// acc[r] += the loaded items (base, base + 32 * NW, ...): each expert's h row (eslot), weighted
// by its summed gate weight (ewt). acc[r][0]: qdecode's helpers take rows x rows of h, here one.
// XP 1: h rows are padded with zeros to whole units (moe_gate_up writes every element), so x
// is read without bounds tests (XV 2) over the padded width hs.
template <int FMT, int GS, int ROWS, int NW, int UNROLL, int XV, int NIB, int XP>
__device__ __forceinline__ void down_compute(const float* h, const float* sd, const uint32_t* e8grid, const size_t* eso,
                                             const int* eslot, const float* ewt, const int* rd, int row0,
                                             size_t soff, int ng, int I, int hs, int n_units, int n_items,
                                             int base, const uint32_t (*raw)[ROWS][qd::words(FMT)],
                                             const float (*scl)[ROWS][qd::wpu(FMT) / qd::seg(FMT, GS)],
                                             float (*acc)[1]) {
  constexpr int W = qd::words(FMT);
  constexpr int NSEG = qd::wpu(FMT) / qd::seg(FMT, GS);
  constexpr int XVD = (XP && XV) ? 2 : XV;
#pragma unroll
  for (int j = 0; j < UNROLL; ++j) {
    const int item = base + 32 * NW * j;
    if (item < n_items) {
      const int je = item / n_units;
      const int u = item - je * n_units;
      const float* se = sd + eso[je];
      const int xoff = eslot[je] * hs;
      const float wt = ewt[je];
      float rs[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        rs[r] = qd::row_scale<FMT>(se, row0 + rd[r]);
      }
#pragma unroll
      for (int g = 0; g < NSEG; ++g) {
        float d[ROWS][1];
        qd::seg_dots<FMT, GS, 1, ROWS, XVD, W, float, NIB, XP>(raw[j], h, &xoff, 1u, XP ? hs : I, u, g, e8grid, d);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          const float sc = (qd::scales_in_memory(FMT) ? scl[j][r][g] : qd::seg_scale<FMT, GS>(se + soff, rd[r], ng, u, g, raw[j][r])) * rs[r];
          acc[r][0] += d[r][0] * (sc * wt);
        }
      }
    }
  }
}

// acc[r] += work items tid, tid + 32 * NW, ...: load UNROLL items x ROWS rows, then compute them.
template <int FMT, int GS, int ROWS, int NW, int UNROLL, int VEC, bool W16, int XV, int NIB, int XP>
__device__ __forceinline__ void down_partial(const float* h, const uint8_t* wd, const float* sd,
                                             const uint32_t* e8grid, const size_t* ewo, const size_t* eso,
                                             const int* eslot, const float* ewt,
                                             const int* rd, int row0, int rb, int ng, int I, int hs,
                                             int n_units, int n_items, int tid, float (*acc)[1]) {
  constexpr int W = qd::words(FMT);
  constexpr int NSEG = qd::wpu(FMT) / qd::seg(FMT, GS);
  const size_t woff = size_t(row0) * size_t(rb);
  const size_t soff = size_t(row0) * size_t(ng);
  uint32_t raw[UNROLL][ROWS][W];
  float scl[UNROLL][ROWS][NSEG];               // fmt 4/5 scales, loaded with the weights
  for (int base = tid; base < n_items; base += 32 * NW * UNROLL) {
    down_load<FMT, GS, ROWS, NW, UNROLL, VEC, W16>(wd, sd, ewo, eso, rd, woff, soff, rb, ng, n_units, n_items, base,
                                                   raw, scl);
    down_compute<FMT, GS, ROWS, NW, UNROLL, XV, NIB, XP>(h, sd, e8grid, eso, eslot, ewt, rd, row0, soff, ng, I,
                                                         hs, n_units, n_items, base, raw, scl, acc);
  }
}

}  // namespace colibri_moe

// ==== kernel body: moe_gate_up ====
  // The stacked bank is uint8, or uint32 words past 2^31 bytes (moe.py: MLX shapes are 32-bit).
  const uint8_t* wgu8 = reinterpret_cast<const uint8_t*>(wgu);
  constexpr int R2 = 2 * ROWS;
  const int I = params[0];
  const int O = params[1];
  const int rb = params[2];
  const int ng = params[3];
  const int n_units = params[4];
  const int K = params[5];
  const int n_slots = params[6];
  const int E = params[7];
  const int tid = int(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  // grid.y is a slot of any of the batch's tokens: the block computes that slot's token (its K
  // slots, its x row, its h rows).
  const int tok = int(blockIdx.y) / K;
  const int slot0 = tok * K;                   // the token's first slot in ids and h
  const int a = int(blockIdx.y) - slot0;
  const int xoff = tok * I;                    // the token's x row
  __shared__ int sl[colibri_moe::max_slots()];
  __shared__ float red[NW * R2];
  colibri_moe::slot_table(ids + slot0, lut, n_slots, E, tid, 32 * NW, sl);
  const int e = sl[a];
  // h rows: O values in order, or (HP > 0, moe_down's fmt has HP weights a unit) padded to
  // whole units in xp_index's layout, which moe_down's lanes read coalesced.
  constexpr int HPU = HP > 0 ? HP : 1;
  const int hs = HP > 0 ? (O + HPU - 1) / HPU * HPU : O;
  // PERS 1: fewer blocks than row blocks; each loops over row blocks b, b + blocks, ... of its
  // slot on the slot table above, built once a block.
  const int n_blocks = (O + ROWS - 1) / ROWS;
  const int blk_step = PERS ? int(gridDim.x) : n_blocks;
  if (e < 0) {
    for (int blk = int(blockIdx.x); blk < n_blocks; blk += blk_step) {
      const int row0 = blk * ROWS;
      if (tid < ROWS && row0 + tid < O) {
        // The writer of row O - 1 also zeroes the padding past O (every element of h is written).
        for (int row = row0 + tid; row < (row0 + tid == O - 1 ? hs : row0 + tid + 1); ++row) {
          h[size_t(slot0 + a) * hs + (HP > 0 ? colibri_qd::xp_index<HPU>(O, row) : row)] = 0.0f;
        }
      }
    }
    return;
  }
  for (int b = 0; b < a; ++b) {
    if (sl[b] == e) {
      return;
    }
  }
  const bool w16 = (reinterpret_cast<uintptr_t>(wgu8) & 15) == 0;
  const bool x16 = (reinterpret_cast<uintptr_t>(x) & 15) == 0;
  for (int blk = int(blockIdx.x); blk < n_blocks; blk += blk_step) {
    const int row0 = blk * ROWS;
    int rows[R2];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      rows[r] = 2 * O * e + min(row0 + r, O - 1);
      rows[ROWS + r] = rows[r] + O;
    }
    float acc[R2][1];
#pragma unroll
    for (int r = 0; r < R2; ++r) {
      acc[r][0] = 0.0f;
    }
    if (w16 && x16) {
      colibri_moe::gate_up_partial<FMT, GS, R2, NW, UNROLL, VEC, true, XV, NIB, PF, T>(
          x, wgu8, sgu, e8grid, rows, xoff, rb, ng, I, n_units, tid, acc);
    } else {
      colibri_moe::gate_up_partial<FMT, GS, R2, NW, UNROLL, VEC, false, 0, NIB, PF, T>(
          x, wgu8, sgu, e8grid, rows, xoff, rb, ng, I, n_units, tid, acc);
    }
    colibri_qd::warp_partials<R2, 1>(acc, red, warp, lane);
    __syncthreads();
    // Thread r writes h row row0 + r into every slot of the token routed to e.
    if (tid < ROWS) {
      const int r = tid;
      const int row = row0 + r;
      if (row < O) {
        float gv = 0.0f;
        float uv = 0.0f;
#pragma unroll
        for (int k = 0; k < NW; ++k) {
          gv += red[k * R2 + r];
          uv += red[k * R2 + ROWS + r];
        }
        gv *= colibri_qd::row_scale<FMT>(sgu, 2 * O * e + row);
        uv *= colibri_qd::row_scale<FMT>(sgu, 2 * O * e + O + row);
        const float hv = gv / (1.0f + expf(-gv)) * uv;
        const int hi = HP > 0 ? colibri_qd::xp_index<HPU>(O, row) : row;
        for (int b = a; b < n_slots; ++b) {
          if (sl[b] == e) {
            h[size_t(slot0 + b) * hs + hi] = hv;
            for (int pad = (row == O - 1 ? O : hs); pad < hs; ++pad) {
              h[size_t(slot0 + b) * hs + colibri_qd::xp_index<HPU>(O, pad)] = 0.0f;
            }
          }
        }
      }
    }
    if (PERS) {
      __syncthreads();                          // red is written again next row block
    }
  }
// ==== kernel body: moe_down ====
  const uint8_t* wd8 = reinterpret_cast<const uint8_t*>(wd);   // uint8 or uint32 words
  // KO, KRB, KNG, KNU > 0: the projection's shape compiled in (moe.py, down_spec's shape_in): the
  // work item's expert and unit by shifts and constant products instead of a division.
  const int I = params[0];
  const int O = KO > 0 ? KO : params[1];
  const int rb = KRB > 0 ? KRB : params[2];
  const int ng = KNG > 0 ? KNG : params[3];
  const int n_units = KNU > 0 ? KNU : params[4];
  const int K = params[5];
  const int n_slots = params[6];
  const int E = params[7];
  const int tid = int(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int hs = XP ? n_units * colibri_qd::wpu(FMT) : I;   // h row stride (moe_gate_up's HP layout)
  __shared__ int sl[colibri_moe::max_slots()];
  __shared__ int lead[colibri_moe::max_slots()];
  __shared__ int eslot[colibri_moe::max_slots()];        // distinct experts in slot order: leader slot (h row)
  __shared__ float ewt[colibri_moe::max_slots()];        // ... and the gate weight summed over its slots
  __shared__ float swt[colibri_moe::max_slots()];        // gate weight of every slot
  __shared__ int n_distinct[1];
  __shared__ size_t ewo[colibri_moe::max_slots()];   // distinct expert: its first down row (bytes)
  __shared__ size_t eso[colibri_moe::max_slots()];   // ... and its first scale (floats)
  __shared__ float red[NW * ROWS];
  // grid.y is a token of the batch: the block computes it (its K slots and h rows, its y row).
  const int tok = int(blockIdx.y);
  const int slot0 = tok * K;
  const float* ht = h + size_t(slot0) * hs;   // the token's h rows
  // The gate weights are read with the ids (the slot table's barrier covers both): they do not
  // wait for the lut, so the table costs two dependent global loads, not three.
  for (int b = tid; b < n_slots; b += 32 * NW) {
    swt[b] = weights[slot0 + b];
  }
  colibri_moe::slot_table(ids + slot0, lut, n_slots, E, tid, 32 * NW, sl);
  for (int b = tid; b < n_slots; b += 32 * NW) {
    int first = sl[b] >= 0 ? 1 : 0;
    for (int c = 0; c < b; ++c) {
      first = (sl[c] == sl[b]) ? 0 : first;
    }
    lead[b] = first;
  }
  __syncthreads();
  for (int b = tid; b < n_slots; b += 32 * NW) {
    if (lead[b]) {
      int j = 0;
      for (int c = 0; c < b; ++c) {
        j += lead[c];
      }
      ewo[j] = size_t(sl[b]) * size_t(O) * size_t(rb);
      eso[j] = size_t(sl[b]) * size_t(O) * size_t(ng);
      // An expert listed twice for the token has the same h in both slots: the leader's, the
      // weights added.
      float wsum = 0.0f;
      for (int c = b; c < n_slots; ++c) {
        if (sl[c] == sl[b]) {
          wsum += swt[c];
        }
      }
      eslot[j] = b;
      ewt[j] = wsum;
    }
  }
  if (tid == 0) {
    int n = 0;
    for (int b = 0; b < n_slots; ++b) {
      n += lead[b];
    }
    n_distinct[0] = n;
  }
  __syncthreads();
  const int n_items = n_distinct[0] * n_units;
  // PERS 1: fewer blocks than row blocks; each loops over row blocks b, b + blocks, ... on the
  // slot table above, built once a block.
  const int n_blocks = (O + ROWS - 1) / ROWS;
  const int blk_step = PERS ? int(gridDim.x) : n_blocks;
  const bool w16 = (reinterpret_cast<uintptr_t>(wd8) & 15) == 0;
  const bool x16 = (reinterpret_cast<uintptr_t>(ht) & 15) == 0;
  for (int blk = int(blockIdx.x); blk < n_blocks; blk += blk_step) {
    const int row0 = blk * ROWS;
    int rd[ROWS];                               // row r of the block: row0 + rd[r]
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      rd[r] = min(r, O - 1 - row0);
    }
    float acc[ROWS][1];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      acc[r][0] = 0.0f;
    }
    if (w16 && x16) {
      colibri_moe::down_partial<FMT, GS, ROWS, NW, UNROLL, VEC, true, XV, NIB, XP>(
          ht, wd8, sd, e8grid, ewo, eso, eslot, ewt, rd, row0, rb, ng, I, hs, n_units, n_items, tid, acc);
    } else {
      colibri_moe::down_partial<FMT, GS, ROWS, NW, UNROLL, VEC, false, 0, NIB, XP>(
          ht, wd8, sd, e8grid, ewo, eso, eslot, ewt, rd, row0, rb, ng, I, hs, n_units, n_items, tid, acc);
    }
    colibri_qd::warp_partials<ROWS, 1>(acc, red, warp, lane);
    __syncthreads();
    // Thread r writes y[tok, row0 + r] (0 when no expert of this group serves the token).
    if (tid < ROWS) {
      const int r = tid;
      float v = 0.0f;
#pragma unroll
      for (int k = 0; k < NW; ++k) {
        v += red[k * ROWS + r];
      }
      if (row0 + r < O) {
        // RES 1: y = res + y (the decoder layer's residual add), rounded as that add would be.
        const OT yv = static_cast<OT>(v);
        const size_t at = size_t(tok) * O + row0 + r;
        y[at] = RES ? static_cast<OT>(static_cast<float>(res[at]) + static_cast<float>(yv)) : yv;
      }
    }
    if (PERS) {
      __syncthreads();                          // red is written again next row block
    }
  }

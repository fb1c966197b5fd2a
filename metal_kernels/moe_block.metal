// moe_block: the routed experts of one MoE layer for up to 8 tokens, two launches per
// group of experts that share one fmt/gs (colibri_mlx/kernels/moe.py):
//
//   moe_gate_up  h[a, r] = silu(gate_e x_s)[r] * (up_e x_s)[r]   for every slot a = s * K + k
//   moe_down     y[s, o] = sum_k w[s, k] * (down_e h[s * K + k])[o]
//
// Each launch computes one token; several tokens are that many one-token launches in one grid,
// grid.y picking the token (moe_gate_up: its slot s * K + k, moe_down: s). A token's
// threadgroups read its x row, K ids, gate weights and h rows, and write its h / y rows.
//
// The experts of a group are stacked into one byte buffer ([E_g][rows][row bytes]) and one
// scale buffer; `lut[e]` maps a layer expert id to its index in the group or -1, so a kernel
// indexes expert e by offset (metal_kernel cannot take a pointer table) and the routing ids
// stay on the GPU (no host sync).
//
// Both kernels have qgemv's structure (metal_kernels/qgemv.metal, docs/kernels.md): a
// threadgroup of NW SIMD groups owns ROWS consecutive output rows, thread t takes units
// t, t + 32 * NW, ... (split-K across the SIMD groups, partial sums meet in threadgroup
// memory), UNROLL units x rows of loads (and fmt 4/5 scales) are issued before any arithmetic, x is widened once
// per 8 weights for all rows, decoding is qdecode.h's (prepended to this header).
//
// moe_gate_up: grid.y = slot. The slot of the token that sees an expert first (its "leader")
// computes ROWS gate rows and the same ROWS up rows of that expert (2 * ROWS rows share each x
// load) and writes them to all of the token's slots of that expert; other slots' groups return
// at once, so the token reads every weight byte once. Slots routed elsewhere get h = 0.
// moe_down: one threadgroup per ROWS output rows visits the token's distinct experts in slot
// order: the work items (expert, unit) are split across all threads (split-K over experts
// and units together, so a 2048-wide down row still gives every thread loads in flight), each
// item weighted by the expert's gate weight (summed over the slots listing it). The weighted
// sum over experts happens in registers and one fixed reduction: no atomics, deterministic.
// The CUDA twin metal_kernels/cuda/moe_block.cu implements the same algorithm line for line.
//
// params (int32[8]): I, O (rows per projection), row bytes, scales per row, units per row,
// K (slots per token), n_slots (a launch's slots: K), E (layer expert count, the size of lut).
// h's layout: moe_gate_up's HP > 0 (moe_down's weights per unit) writes each slot's row padded
// to whole down units in qd_xp_index's order and moe_down reads it so (XP 1): a SIMD group's
// lanes take consecutive units and then read consecutive 16 bytes of h, where row order made
// every lane's read a separate cache line. HP 0 / XP 0: row order (fmt 6 down rotates h first).
// Template: FMT, GS, VEC, XV (rows of x / h 16-byte aligned), UNROLL, ROWS, NW, T (x dtype),
// NIB (fmt 2/4 decode, qgemv's: 1 fp16-subnormal codes + one -8 sum x per segment, 0 magic);
// moe_down also OT, the dtype of y (x's when the layer is one group: no cast launch after it);
// HP (moe_gate_up) and XP (moe_down): h's layout, above.

// Slots (N * K) per call; moe.py MAX_SLOTS.
constexpr int moe_max_slots() {
  return 96;
}

// Group-local expert of slot a, or -1 (id out of range, dropped by router top-p, other group).
inline int moe_local(const device int* ids, const device int* lut, int a, int E) {
  const int id = ids[a];
  return (id >= 0 && id < E) ? lut[id] : -1;
}

// sl[a] = group-local expert of every slot, computed once per threadgroup.
inline void moe_slot_table(const device int* ids, const device int* lut, int n_slots, int E,
                           int tid, int nthreads, threadgroup int* sl) {
  for (int b = tid; b < n_slots; b += nthreads) {
    sl[b] = moe_local(ids, lut, b, E);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// The weights and (fmt 4/5) scales of units base, base + 32 * NW, ... (UNROLL of them) of the
// R2 gate/up rows; units past the row are not read.
template <int FMT, int GS, int R2, int NW, int UNROLL, int VEC>
inline void moe_gate_up_load(const device uint8_t* wgu, const device float* sgu,
                             thread const int* rows, int rb, int ng, int n_units, int base,
                             thread uint (*raw)[R2][qd_words(FMT)],
                             thread float (*scl)[R2][qd_wpu(FMT) / qd_seg(FMT, GS)]) {
  constexpr int NSEG = qd_wpu(FMT) / qd_seg(FMT, GS);
  for (int j = 0; j < UNROLL; ++j) {
    const int u = base + 32 * NW * j;
    if (u < n_units) {
      for (int r = 0; r < R2; ++r) {
        qd_load<FMT, VEC>(wgu + size_t(rows[r]) * size_t(rb), rb, u, raw[j][r]);
        qd_load_aux<FMT, GS>(sgu, rows[r], ng, u, raw[j][r]);
        for (int g = 0; g < NSEG; ++g) {
          scl[j][r][g] = qd_scales_in_memory(FMT) ? qd_seg_scale<FMT, GS>(sgu, rows[r], ng, u, g, raw[j][r]) : 1.0f;
        }
      }
    }
  }
}

// acc[r] += unit u of the rows (loaded as raw / scl) against the token's x row (x + xoff).
// acc[r][0]: qdecode's qd_seg_dots / qd_simd_partials take rows x rows of x, here one.
template <int FMT, int GS, int R2, int XV, int NIB, typename T>
inline void moe_gate_up_unit(const device T* x, const device float* sgu, const device uint* e8grid,
                             thread const int* rows, int xoff, int ng, int I, int u,
                             thread const uint (*raw)[qd_words(FMT)],
                             thread const float (*scl)[qd_wpu(FMT) / qd_seg(FMT, GS)],
                             thread float (*acc)[1]) {
  constexpr int W = qd_words(FMT);
  constexpr int NSEG = qd_wpu(FMT) / qd_seg(FMT, GS);
  for (int g = 0; g < NSEG; ++g) {
    float d[R2][1];
    qd_seg_dots<FMT, GS, 1, R2, XV, W, T, NIB>(raw, x, &xoff, 1u, I, u, g, e8grid, d);
    for (int r = 0; r < R2; ++r) {
      const float sc = qd_scales_in_memory(FMT) ? scl[r][g] : qd_seg_scale<FMT, GS>(sgu, rows[r], ng, u, g, raw[r]);
      acc[r][0] += d[r][0] * sc;
    }
  }
}

// acc[r] += the loaded units (base, base + 32 * NW, ...) against the token's x row.
// A unit wholly inside x's row (aligned) reads x without per-8 bounds tests (XV 2), as
// qgemv's units do.
template <int FMT, int GS, int R2, int NW, int UNROLL, int XV, int NIB, typename T>
inline void moe_gate_up_compute(const device T* x, const device float* sgu,
                                const device uint* e8grid, thread const int* rows,
                                int xoff, int ng, int I, int n_units,
                                int base, thread const uint (*raw)[R2][qd_words(FMT)],
                                thread const float (*scl)[R2][qd_wpu(FMT) / qd_seg(FMT, GS)],
                                thread float (*acc)[1]) {
  for (int j = 0; j < UNROLL; ++j) {
    const int u = base + 32 * NW * j;
    if (XV && qd_wpu(FMT) * (u + 1) <= I) {
      moe_gate_up_unit<FMT, GS, R2, 2, NIB, T>(x, sgu, e8grid, rows, xoff, ng, I, u, raw[j], scl[j], acc);
    } else if (u < n_units) {
      moe_gate_up_unit<FMT, GS, R2, XV, NIB, T>(x, sgu, e8grid, rows, xoff, ng, I, u, raw[j], scl[j], acc);
    }
  }
}

// moe_down's work item i = (distinct expert i / n_units, unit i % n_units). Where an item's
// bytes are: ewo / eso[je], the offsets of the distinct expert's first down row and of its
// scales (a table built once a threadgroup), plus the row block's offsets, the same for every
// item: woff (row0 * rb), soff (row0 * ng) and the rows' deltas rd[r] (r, or O - 1 - row0 for
// rows past O in the last block). So an item costs one threadgroup load and adds, not two
// dependent threadgroup loads and 64-bit products a row. The weights and (fmt 4/5) scales of
// items base, base + 32 * NW, ... (UNROLL of them) of the ROWS rows; items past n_items are
// not read.
template <int FMT, int GS, int ROWS, int NW, int UNROLL, int VEC>
inline void moe_down_load(const device uint8_t* wd8, const device float* sd, threadgroup const ulong* ewo,
                          threadgroup const ulong* eso, thread const int* rd, size_t woff, size_t soff, int rb,
                          int ng, int n_units, int n_items, int base, thread uint (*raw)[ROWS][qd_words(FMT)],
                          thread float (*scl)[ROWS][qd_wpu(FMT) / qd_seg(FMT, GS)]) {
  constexpr int NSEG = qd_wpu(FMT) / qd_seg(FMT, GS);
  for (int j = 0; j < UNROLL; ++j) {
    const int item = base + 32 * NW * j;
    if (item < n_items) {
      const int je = item / n_units;
      const int u = item - je * n_units;
      const device uint8_t* w0 = wd8 + (size_t(ewo[je]) + woff);
      const device float* s0 = sd + (size_t(eso[je]) + soff);
      for (int r = 0; r < ROWS; ++r) {
        qd_load<FMT, VEC>(w0 + rd[r] * rb, rb, u, raw[j][r]);
        qd_load_aux<FMT, GS>(s0, rd[r], ng, u, raw[j][r]);
        for (int g = 0; g < NSEG; ++g) {
          scl[j][r][g] = qd_scales_in_memory(FMT) ? qd_seg_scale<FMT, GS>(s0, rd[r], ng, u, g, raw[j][r]) : 1.0f;
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
inline void moe_down_compute(const device float* h, const device float* sd, const device uint* e8grid,
                             threadgroup const ulong* eso, threadgroup const int* eslot,
                             threadgroup const float* ewt, thread const int* rd, int row0, size_t soff, int ng,
                             int I, int hs, int n_units, int n_items, int base,
                             thread const uint (*raw)[ROWS][qd_words(FMT)],
                             thread const float (*scl)[ROWS][qd_wpu(FMT) / qd_seg(FMT, GS)],
                             thread float (*acc)[1]) {
  constexpr int W = qd_words(FMT);
  constexpr int NSEG = qd_wpu(FMT) / qd_seg(FMT, GS);
  constexpr int XVD = (XP && XV) ? 2 : XV;
  for (int j = 0; j < UNROLL; ++j) {
    const int item = base + 32 * NW * j;
    if (item < n_items) {
      const int je = item / n_units;
      const int u = item - je * n_units;
      const device float* se = sd + size_t(eso[je]);
      const int xoff = eslot[je] * hs;
      const float wt = ewt[je];
      float rs[ROWS];
      for (int r = 0; r < ROWS; ++r) {
        rs[r] = qd_row_scale<FMT>(se, row0 + rd[r]);
      }
      for (int g = 0; g < NSEG; ++g) {
        float d[ROWS][1];
        qd_seg_dots<FMT, GS, 1, ROWS, XVD, W, float, NIB, XP>(raw[j], h, &xoff, 1u, XP ? hs : I, u, g, e8grid, d);
        for (int r = 0; r < ROWS; ++r) {
          const float sc = (qd_scales_in_memory(FMT) ? scl[j][r][g] : qd_seg_scale<FMT, GS>(se + soff, rd[r], ng, u, g, raw[j][r])) * rs[r];
          acc[r][0] += d[r][0] * (sc * wt);
        }
      }
    }
  }
}

// ==== kernel body: moe_gate_up ====
  // The stacked bank is uint8, or uint32 words past 2^31 bytes (moe.py: MLX shapes are 32-bit).
  const device uint8_t* wgu8 = reinterpret_cast<const device uint8_t*>(wgu);
  constexpr int W = qd_words(FMT);
  constexpr int NSEG = qd_wpu(FMT) / qd_seg(FMT, GS);
  constexpr int R2 = 2 * ROWS;                 // gate rows then up rows
  const int I = params[0];
  const int O = params[1];
  const int rb = params[2];
  const int ng = params[3];
  const int n_units = params[4];
  const int K = params[5];
  const int n_slots = params[6];
  const int E = params[7];
  const int tid = int(thread_position_in_threadgroup.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  // grid.y is a slot of any of the batch's tokens: the block computes that slot's token (its K
  // slots, its x row, its h rows).
  const int tok = int(threadgroup_position_in_grid.y) / K;
  const int slot0 = tok * K;                   // the token's first slot in ids and h
  const int a = int(threadgroup_position_in_grid.y) - slot0;
  const int xoff = tok * I;                    // the token's x row
  threadgroup int sl[moe_max_slots()];
  threadgroup float red[NW * R2];
  moe_slot_table(ids + slot0, lut, n_slots, E, tid, 32 * NW, sl);
  const int e = sl[a];
  // h rows: O values in order, or (HP > 0, moe_down's fmt has HP weights a unit) padded to
  // whole units in qd_xp_index's layout, which moe_down's lanes read coalesced.
  constexpr int HPU = HP > 0 ? HP : 1;
  const int hs = HP > 0 ? (O + HPU - 1) / HPU * HPU : O;
  // PERS 1: fewer blocks than row blocks; each loops over row blocks b, b + blocks, ... of its
  // slot on the slot table above, built once a block.
  const int n_blocks = (O + ROWS - 1) / ROWS;
  const int blk_step = PERS ? int(threadgroups_per_grid.x) : n_blocks;
  if (e < 0) {
    for (int blk = int(threadgroup_position_in_grid.x); blk < n_blocks; blk += blk_step) {
      const int row0 = blk * ROWS;
      if (tid < ROWS && row0 + tid < O) {
        // The writer of row O - 1 also zeroes the padding past O (every element of h is written).
        for (int row = row0 + tid; row < (row0 + tid == O - 1 ? hs : row0 + tid + 1); ++row) {
          h[size_t(slot0 + a) * hs + (HP > 0 ? qd_xp_index<HPU>(O, row) : row)] = 0.0f;
        }
      }
    }
    return;
  }
  for (int b = 0; b < a; ++b) {
    if (sl[b] == e) {
      return;                                  // not the leader: the leader writes this slot
    }
  }
  for (int blk = int(threadgroup_position_in_grid.x); blk < n_blocks; blk += blk_step) {
    const int row0 = blk * ROWS;
    // Bank rows: expert e holds its O gate rows then its O up rows. Rows past O re-read O - 1.
    int rows[R2];
    for (int r = 0; r < ROWS; ++r) {
      rows[r] = 2 * O * e + min(row0 + r, O - 1);
      rows[ROWS + r] = rows[r] + O;
    }
    float acc[R2][1];
    for (int r = 0; r < R2; ++r) {
      acc[r][0] = 0.0f;
    }
    // PF 0: load UNROLL units x R2 rows, then compute them. PF 1 (qgemv's): two register
    // buffers, the next step's loads issued before this step's arithmetic, so a SIMD group keeps
    // bytes in flight while it decodes (one load latency per threadgroup, not one per step).
    constexpr int STEP = 32 * NW * UNROLL;
    uint raw_a[UNROLL][R2][W];
    float scl_a[UNROLL][R2][NSEG];                 // fmt 4/5 scales, loaded with the weights
    if (PF) {
      uint raw_b[UNROLL][R2][W];
      float scl_b[UNROLL][R2][NSEG];
      moe_gate_up_load<FMT, GS, R2, NW, UNROLL, VEC>(wgu8, sgu, rows, rb, ng, n_units, tid, raw_a, scl_a);
      for (int base = tid; base < n_units; base += 2 * STEP) {
        moe_gate_up_load<FMT, GS, R2, NW, UNROLL, VEC>(wgu8, sgu, rows, rb, ng, n_units, base + STEP,
                                                       raw_b, scl_b);
        moe_gate_up_compute<FMT, GS, R2, NW, UNROLL, XV, NIB, T>(x, sgu, e8grid, rows, xoff, ng,
                                                                 I, n_units, base, raw_a, scl_a, acc);
        if (base + STEP >= n_units) {
          break;
        }
        moe_gate_up_load<FMT, GS, R2, NW, UNROLL, VEC>(wgu8, sgu, rows, rb, ng, n_units, base + 2 * STEP,
                                                       raw_a, scl_a);
        moe_gate_up_compute<FMT, GS, R2, NW, UNROLL, XV, NIB, T>(x, sgu, e8grid, rows, xoff, ng,
                                                                 I, n_units, base + STEP, raw_b, scl_b, acc);
      }
    } else {
      for (int base = tid; base < n_units; base += STEP) {
        moe_gate_up_load<FMT, GS, R2, NW, UNROLL, VEC>(wgu8, sgu, rows, rb, ng, n_units, base, raw_a, scl_a);
        moe_gate_up_compute<FMT, GS, R2, NW, UNROLL, XV, NIB, T>(x, sgu, e8grid, rows, xoff, ng,
                                                                 I, n_units, base, raw_a, scl_a, acc);
      }
    }
    qd_simd_partials<R2, 1>(acc, red, warp, lane);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Thread r writes h row row0 + r into every slot of the token routed to e.
    if (tid < ROWS) {
      const int r = tid;
      const int row = row0 + r;
      if (row < O) {
        float gv = 0.0f;
        float uv = 0.0f;
        for (int k = 0; k < NW; ++k) {
          gv += red[k * R2 + r];
          uv += red[k * R2 + ROWS + r];
        }
        gv *= qd_row_scale<FMT>(sgu, rows[r]);
        uv *= qd_row_scale<FMT>(sgu, rows[ROWS + r]);
        const float hv = gv / (1.0f + exp(-gv)) * uv;
        const int hi = HP > 0 ? qd_xp_index<HPU>(O, row) : row;
        for (int b = a; b < n_slots; ++b) {
          if (sl[b] == e) {
            h[size_t(slot0 + b) * hs + hi] = hv;
            for (int pad = (row == O - 1 ? O : hs); pad < hs; ++pad) {
              h[size_t(slot0 + b) * hs + qd_xp_index<HPU>(O, pad)] = 0.0f;
            }
          }
        }
      }
    }
    if (PERS) {
      threadgroup_barrier(mem_flags::mem_threadgroup);                          // red is written again next row block
    }
  }
// ==== kernel body: moe_down ====
  const device uint8_t* wd8 = reinterpret_cast<const device uint8_t*>(wd);   // uint8 or uint32 words
  constexpr int W = qd_words(FMT);
  constexpr int NSEG = qd_wpu(FMT) / qd_seg(FMT, GS);
  const int I = params[0];
  const int O = params[1];
  const int rb = params[2];
  const int ng = params[3];
  const int n_units = params[4];
  const int K = params[5];
  const int n_slots = params[6];
  const int E = params[7];
  const int tid = int(thread_position_in_threadgroup.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int hs = XP ? n_units * qd_wpu(FMT) : I;   // h row stride (moe_gate_up's HP layout)
  threadgroup int sl[moe_max_slots()];
  threadgroup int lead[moe_max_slots()];         // 1: first slot of its expert
  threadgroup int eslot[moe_max_slots()];        // distinct experts in slot order: leader slot (h row)
  threadgroup float ewt[moe_max_slots()];        // ... and the gate weight summed over its slots
  threadgroup float swt[moe_max_slots()];        // gate weight of every slot
  threadgroup int n_distinct[1];
  threadgroup ulong ewo[moe_max_slots()];        // distinct expert: its first down row (bytes)
  threadgroup ulong eso[moe_max_slots()];        // ... and its first scale (floats)
  threadgroup float red[NW * ROWS];
  // grid.y is a token of the batch: the block computes it (its K slots and h rows, its y row).
  const int tok = int(threadgroup_position_in_grid.y);
  const int slot0 = tok * K;
  const device float* ht = h + size_t(slot0) * hs;   // the token's h rows
  // The gate weights are read with the ids (the slot table's barrier covers both): they do not
  // wait for the lut, so the table costs two dependent global loads, not three.
  for (int b = tid; b < n_slots; b += 32 * NW) {
    swt[b] = weights[slot0 + b];
  }
  moe_slot_table(ids + slot0, lut, n_slots, E, tid, 32 * NW, sl);
  for (int b = tid; b < n_slots; b += 32 * NW) {
    int first = sl[b] >= 0 ? 1 : 0;
    for (int c = 0; c < b; ++c) {
      first = (sl[c] == sl[b]) ? 0 : first;
    }
    lead[b] = first;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int b = tid; b < n_slots; b += 32 * NW) {
    if (lead[b]) {
      int j = 0;
      for (int c = 0; c < b; ++c) {
        j += lead[c];
      }
      ewo[j] = ulong(sl[b]) * ulong(O) * ulong(rb);
      eso[j] = ulong(sl[b]) * ulong(O) * ulong(ng);
      // An expert listed twice for the token has the same h in both slots (moe_gate_up's leader
      // writes them all): the leader's h row, the weights added.
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
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int n_items = n_distinct[0] * n_units;
  // PERS 1: fewer blocks than row blocks; each loops over row blocks b, b + blocks, ... on the
  // slot table above, built once a block.
  const int n_blocks = (O + ROWS - 1) / ROWS;
  const int blk_step = PERS ? int(threadgroups_per_grid.x) : n_blocks;
  for (int blk = int(threadgroup_position_in_grid.x); blk < n_blocks; blk += blk_step) {
    const int row0 = blk * ROWS;
    int rd[ROWS];                                // row r of the block: row0 + rd[r]
    for (int r = 0; r < ROWS; ++r) {
      rd[r] = min(r, O - 1 - row0);
    }
    const size_t woff = size_t(row0) * size_t(rb);
    const size_t soff = size_t(row0) * size_t(ng);
    float acc[ROWS][1];
    for (int r = 0; r < ROWS; ++r) {
      acc[r][0] = 0.0f;
    }
    // Load UNROLL items x ROWS rows, then compute them.
    uint raw[UNROLL][ROWS][W];
    float scl[UNROLL][ROWS][NSEG];                 // fmt 4/5 scales, loaded with the weights
    for (int base = tid; base < n_items; base += 32 * NW * UNROLL) {
      moe_down_load<FMT, GS, ROWS, NW, UNROLL, VEC>(wd8, sd, ewo, eso, rd, woff, soff, rb, ng, n_units, n_items, base,
                                                    raw, scl);
      moe_down_compute<FMT, GS, ROWS, NW, UNROLL, XV, NIB, XP>(ht, sd, e8grid, eso, eslot, ewt, rd, row0, soff, ng, I,
                                                               hs, n_units, n_items, base, raw, scl, acc);
    }
    qd_simd_partials<ROWS, 1>(acc, red, warp, lane);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Thread r writes y[tok, row0 + r] (0 when no expert of this group serves the token).
    if (tid < ROWS) {
      const int r = tid;
      float v = 0.0f;
      for (int k = 0; k < NW; ++k) {
        v += red[k * ROWS + r];
      }
      if (row0 + r < O) {
        // RES 1: y = res + y (the decoder layer's residual add), rounded as that add would be.
        const OT yv = static_cast<OT>(v);
        const size_t at = size_t(tok) * O + row0 + r;
        y[at] = RES ? static_cast<OT>(float(res[at]) + float(yv)) : yv;
      }
    }
    if (PERS) {
      threadgroup_barrier(mem_flags::mem_threadgroup);                          // red is written again next row block
    }
  }

// mla_decode: folded (absorbed) multi-head latent attention for a few query rows over the
// latent cache, three launches (colibri_mlx/kernels/mla.py):
//
//   mla_qabs  q'[q, h, :] = W_UK^h^T q_nope[q, h]      one threadgroup per (head, query row);
//             SIMD groups split the nope rows of W_UK^h, LW lanes a row own its units of the R
//             columns (32 / LW rows side by side when a row has <= 16 units), RU rows a lane
//             per step with all their loads issued first (latency, not bytes, bounds it), so
//             every kv_b byte of W_UK is read once per query row; threadgroup reduction.
//   mla_attn  split-K flash decoding: one threadgroup per (head group, tile of cache positions,
//             query row), head group fastest in the grid so the head groups of one tile run
//             together and share the tile through L2. NSG SIMD groups x HB heads share each
//             latent row: the threadgroup stages C = 8 positions (latent + rope columns, cache
//             dtype widened to float once) in threadgroup memory, every SIMD group computes its
//             HB x 8 partial scores (lanes own columns, conflict-free), one reduce-scatter
//             (31 shuffles) leaves lane i * 8 + c with the score of head i, position c, and the
//             online softmax runs once per chunk: one max / sum over 8 lanes, one rescale of the
//             accumulator per chunk (not per position), then acc += p * latent for the 8
//             positions. One partial (acc[R], m, l) per tile and head.
//   mla_out   one threadgroup per (head, query row): the tile weights exp(m_t - max) once
//             into threadgroup memory (threads split the tiles), the normalized latent context
//             sum_t w_t pacc[t] with 8 tiles of loads in flight, then out = W_UV^h context (rows
//             and lanes as mla_qabs, RU rows a step, loads first).
//
// Cache length has no cap: tiles are as many as needed up to NTMAX (mla.MAX_TILES, the merge's
// weights in threadgroup memory), longer tiles beyond. With an
// index list (DSA) the tiles run over the listed positions instead of 0..T-1. kv_b decoding
// is qdecode.h's (prepended to this header). Math is float32 for any cache dtype.
// The CUDA twin metal_kernels/cuda/mla_decode.cu implements the same algorithm.
//
// params (int32[16]): H, nope, v, R, rope, T, P (positions per query row), TT (positions per
// tile), NT (tiles), L (query rows per batch), rb, ng, n_units, has_mask, has_sel, 0.
//   mla_attn_mma  the same split-K flash decoding with matrix instructions (the default;
//             mla_attn above stays selectable as variant "simt"): one threadgroup per (block of
//             HT heads, tile, query row), NSG = HT / 4 SIMD groups (HT 16, 32 or 64). Per chunk
//             of C = 8 positions staged as float in threadgroup memory: scores S[HT x 8] =
//             Q'[HT x (R + rope)] . chunk^T by 8x8 simdgroup matrices; SIMD group sg takes
//             16-head tile sg % (HT / 16) and the k-steps of k-part sg / (HT / 16) (4 k-parts),
//             partial scores summed through threadgroup memory; one thread per (head, position)
//             runs the online softmax (8 lanes a head) and writes P[HT x 8] and diag(alpha);
//             then each SIMD group updates its column range (NCT tiles of 8 columns) of the
//             accumulator O[HT x R] for all heads: O = diag(alpha) O + P . chunk. Partials
//             (pacc, pml) as mla_attn's, merged by mla_out. Needs R and rope multiples of 8;
//             q' comes padded to Hp = a multiple of HT heads (mla_qabs writes zeros there).
//             Latency: the next chunk's cache rows are loaded as raw 16-byte words before the
//             current chunk is multiplied and widened only when stored (qd_load8_raw /
//             qd_widen8), each SIMD group's q' tiles are loaded once per tile, and the
//             rescale by diag(alpha) is skipped while every alpha of a row tile is 1.
//             The CUDA twin is the same with mma.sync m16n8k8 TF32 fragments (a 16-head tile
//             is one m16 fragment instead of two 8x8 matrices).
//
// params (int32[16]): H, nope, v, R, rope, T, P (positions per query row), TT (positions per
// tile), NT (tiles), L (query rows per batch), rb, ng, n_units, has_mask, has_sel, Hp (heads
// of qabs / qrope: H, or H padded to 16 for mla_attn_mma).
// has_mask: 0 none, 1 the mask input [B * L, T], 2 causal rows of one sequence (no mask input:
// query row l of L sees positions t <= P - L + l, a verify step of speculative decoding).
// fparams (float32[8]): scale, 0...

// Positions per softmax chunk; HB x MLA_CHUNK = 32 partial scores per SIMD group.
constexpr int mla_chunk() {
  return 8;
}

// Lane l ends with the sum over the SIMD group of v[l] (v[32] per lane): halving exchanges,
// 16 + 8 + 4 + 2 + 1 shuffles. After the exchange at distance w, lane bit w says which half
// of the indices the lane keeps.
inline float mla_reduce_scatter(thread float* v, int lane) {
  for (int w = 16; w >= 1; w >>= 1) {
    const bool upper = (lane & w) != 0;
    for (int k = 0; k < w; ++k) {
      const float keep = upper ? v[k + w] : v[k];
      const float send = upper ? v[k] : v[k + w];
      v[k] = keep + simd_shuffle_xor(send, ushort(w));
    }
  }
  return v[0];
}

// ---- shared index arithmetic (the CUDA twin has the same functions) ----

// Floats of padding after each staged position (R + rope floats): for the CUDA twin's
// fragment reads of the chunk (row stride 8 mod 32 banks; see there).
constexpr int mla_stage_pad() {
  return 8;
}

// Cache position of entry `pos` of query row q's list: the DSA list or the identity.
inline int mla_position(const device int32_t* sel, int has_sel, int q, int P, int pos) {
  return has_sel ? sel[size_t(q) * P + pos] : pos;
}

// Partial (tile) `tile` of head h of query row q in pacc [BL, H, NT, R] / pml [BL, H, NT, 2].
// Where the cache's rows keep the latent and the rope key: one joint buffer (params[16] = 1:
// each row the latent, then the rope key; the model's cache, one row written a decode step) or
// two, [B, T, R] and [B, T, rope]. ls / ks: the latent's / the rope key's row strides; rope0:
// the rope key's first column in its row.
struct MlaCacheRows {
  int ls;
  int ks;
  int rope0;
};
inline MlaCacheRows mla_cache_rows(int joint, int R, int rope) {
  return MlaCacheRows{joint ? R + rope : R, joint ? R + rope : rope, joint ? R : 0};
}

inline size_t mla_part(int q, int H, int h, int NT, int tile) {
  return (size_t(q) * H + h) * size_t(NT) + tile;
}

// One decode row of mla_rows: q_a and the latent normalized, the rope key rotated at `position`.
// Each is computed as MLX computes it, so the step keeps MLX's numbers: mx.fast.rms_norm is
// T(w * T(x * rsqrt(mean(x^2) + eps))), mx.fast.rope (half-split, freqs) theta = position *
// inv_freq with metal::fast::cos / sin. The q_a part goes to qa_row, the cache row (latent, then
// rope key) to kv_row (if write_kv): mla_rows' output, or (mla_rows_into) the cache's own buffer
// at the row's slot.
// (Inputs of fewer than 8 values arrive in the constant address space, so the input pointers'
// types are the caller's.)
template <typename T, int NSG, typename RowP, typename QNormP, typename KNormP, typename InvFP>
inline void mla_norm_rope_row(RowP row, QNormP qnorm, KNormP knorm, InvFP invf, float position, int QL, int R, int rope,
                              float eps_q, float eps_l, device T* qa_row, device T* kv_row,
                              bool write_kv, threadgroup float* sums, int tid, int sg, int lane) {
  float sq = 0.0f;                             // sums of squares: q_a part, latent part
  float sl = 0.0f;
  for (int c = tid; c < QL; c += NSG * 32) {
    const float x = float(row[c]);
    sq += x * x;
  }
  for (int c = tid; c < R; c += NSG * 32) {
    const float x = float(row[QL + c]);
    sl += x * x;
  }
  sq = simd_sum(sq);
  sl = simd_sum(sl);
  if (lane == 0) {
    sums[sg] = sq;
    sums[NSG + sg] = sl;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  sq = 0.0f;
  sl = 0.0f;
  for (int g = 0; g < NSG; ++g) {
    sq += sums[g];
    sl += sums[NSG + g];
  }
  const float iq = metal::precise::rsqrt(sq / float(QL) + eps_q);
  const float il = metal::precise::rsqrt(sl / float(R) + eps_l);
  for (int c = tid; c < QL; c += NSG * 32) {
    qa_row[c] = static_cast<T>(float(qnorm[c]) * float(static_cast<T>(float(row[c]) * iq)));
  }
  for (int c = tid; c < (write_kv ? R : 0); c += NSG * 32) {
    kv_row[c] = static_cast<T>(float(knorm[c]) * float(static_cast<T>(float(row[QL + c]) * il)));
  }
  const int half = rope / 2;
  for (int j = tid; j < (write_kv ? half : 0); j += NSG * 32) {
    const float theta = position * invf[j];
    const float cs = metal::fast::cos(theta);
    const float sn = metal::fast::sin(theta);
    const float x1 = float(row[QL + R + j]);
    const float x2 = float(row[QL + R + j + half]);
    kv_row[R + j] = static_cast<T>(x1 * cs - x2 * sn);
    kv_row[R + j + half] = static_cast<T>(x1 * sn + x2 * cs);
  }
}

// ---- mla_qabs / mla_qb_qabs: q' = W_UK^h^T q_nope over a part's kv_b units, and q_rope ----

// q' of head h over kv_b units u0 .. u0 + UPP - 1 (the latent columns they hold) into qrow
// [0, R), from the head's nope values qh[0 .. nope) (the q_b GEMV's q_nope, or mla_qb_qabs'
// rows in threadgroup memory). RU rows a lane per step, all their loads (units, scales, q)
// issued before any math: one row at a time is a chain of dependent global-load latencies,
// the bytes themselves are few. red: NSG * NU * LW * WPU floats of threadgroup memory.
template <int FMT, int GS, int VEC, int NSG, int LW, int NU, int RU, int UPP, typename QP>
inline void mla_qabs_columns(QP qh, const device uint8_t* w, const device float* scales, const device uint* e8grid,
                             int h, int nope, int v, int R, int rb, int ng, int n_units, int u0,
                             threadgroup float* red, device float* qrow, int tid, int sg, int lane) {
  constexpr int WPU = qd_wpu(FMT);
  constexpr int SEG = qd_seg(FMT, GS);
  constexpr int NSEG = WPU / SEG;
  constexpr int RPS = 32 / LW;                 // rows side by side in a SIMD group
  const int sub = lane / LW;                   // which of the RPS rows; lanes ul own units
  const int ul = lane % LW;
  float acc[NU * WPU];
  for (int k = 0; k < NU * WPU; ++k) {
    acc[k] = 0.0f;
  }
  for (int n0 = 0; n0 < nope; n0 += NSG * RPS * RU) {
    uint raw[RU][NU][qd_words(FMT)];
    float scl[RU][NU][NSEG];                   // fmt 4/5 segment scales
    float xq[RU];
    for (int i = 0; i < RU; ++i) {
      const int n = n0 + (i * NSG + sg) * RPS + sub;
      const int row = h * (nope + v) + min(n, nope - 1);
      xq[i] = n < nope ? float(qh[n]) * qd_row_scale<FMT>(scales, row) : 0.0f;
      for (int j = 0; j < NU; ++j) {
        const int u = u0 + ul + LW * j;
        if (n < nope && ul + LW * j < UPP && u < n_units) {
          qd_load<FMT, VEC>(w + size_t(row) * size_t(rb), rb, u, raw[i][j]);
          qd_load_aux<FMT, GS>(scales, row, ng, u, raw[i][j]);
          for (int g = 0; g < NSEG; ++g) {
            scl[i][j][g] = qd_scales_in_memory(FMT) ? qd_seg_scale<FMT, GS>(scales, row, ng, u, g, raw[i][j]) : 1.0f;
          }
        }
      }
    }
    for (int i = 0; i < RU; ++i) {
      const int n = n0 + (i * NSG + sg) * RPS + sub;
      const int row = h * (nope + v) + min(n, nope - 1);
      for (int j = 0; j < NU; ++j) {
        const int u = u0 + ul + LW * j;
        if (n < nope && ul + LW * j < UPP && u < n_units) {
          for (int g = 0; g < NSEG; ++g) {
            const float sc = qd_scales_in_memory(FMT) ? scl[i][j][g] : qd_seg_scale<FMT, GS>(scales, row, ng, u, g, raw[i][j]);
            const float us = sc * xq[i];
            for (int c = 0; c < SEG; c += 8) {
              float wq[8];
              qd_decode8<FMT>(raw[i][j], SEG * g + c, e8grid, wq);
              for (int k = 0; k < 8; ++k) {
                acc[j * WPU + SEG * g + c + k] += us * wq[k];
              }
            }
          }
        }
      }
    }
  }
  // Lanes ul, ul + LW, ... hold the same columns (of different rows): fold them into lane ul.
  for (int s = 16; s >= LW; s >>= 1) {
    for (int k = 0; k < NU * WPU; ++k) {
      acc[k] += simd_shuffle_xor(acc[k], ushort(s));
    }
  }
  for (int j = 0; j < NU; ++j) {
    const int u = u0 + ul + LW * j;
    if (sub == 0 && ul + LW * j < UPP && u < n_units) {
      for (int k = 0; k < WPU; ++k) {
        red[(sg * NU * LW + u - u0) * WPU + k] = acc[j * WPU + k];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int c1 = min(R, (u0 + UPP) * WPU);     // this part's columns: u0 * WPU .. c1 - 1
  for (int c = u0 * WPU + tid; c < c1; c += NSG * 32) {
    float s = 0.0f;
    for (int g = 0; g < NSG; ++g) {
      s += red[g * NU * LW * WPU + c - u0 * WPU];
    }
    qrow[c] = s;
  }
}

// q_rope (width values qr[0 .. width)) as float beside q' (no cast launch). ROPEQ 1: rotated
// here (half-split, at position, inv_freq invf) and rounded to q's dtype as mx.fast.rope would
// round it, so the numbers are those of the separate rope launch this replaces.
template <int ROPEQ, typename TQ, int NSG, typename RP, typename InvFP>
inline void mla_qabs_rope(RP qr, device float* qa_rope, int width, float position, InvFP invf, int tid) {
  if (ROPEQ) {
    const int half = width / 2;
    for (int j = tid; j < half; j += NSG * 32) {
      const float theta = position * invf[j];
      const float cs = metal::fast::cos(theta);
      const float sn = metal::fast::sin(theta);
      const float x1 = float(qr[j]);
      const float x2 = float(qr[j + half]);
      qa_rope[j] = float(static_cast<TQ>(x1 * cs - x2 * sn));
      qa_rope[j + half] = float(static_cast<TQ>(x1 * sn + x2 * cs));
    }
  } else {
    for (int c = tid; c < width; c += NSG * 32) {
      qa_rope[c] = float(qr[c]);
    }
  }
}

// mla_attn_mma's padding heads (h >= H): q' and q_rope zero, written by `writer` threadgroups.
// True for a padding head (the threadgroup has nothing else to do).
template <int NSG>
inline bool mla_padding_head(device float* qrow, int h, int H, int QW, bool writer, int tid) {
  if (h < H) {
    return false;
  }
  for (int c = tid; writer && c < QW; c += NSG * 32) {
    qrow[c] = 0.0f;
  }
  return true;
}

// mla_qb_qabs' first phase: head h's q_b rows (its nope rows h * nope + n, then its rope rows
// H * nope + h * rope + j: the model's [all nope | all rope] row order) against the q_a row x,
// each rounded to TQ as the q_b GEMV writes it, into qsh[0 .. nope + rope). QR rows a SIMD group
// pass, lanes over the units (NUB a lane, every load issued before any math); fmt 1-3 row
// scales after the lane sum, fmt 4/5 segment scales loaded with the weights (qgemv's rules).
template <int FMT, int GS, int VEC, int XV, int NIB, int NSG, int QR, int NUB, typename TQ>
inline void mla_qb_head_rows(const device TQ* x, const device uint8_t* wqb, const device float* sqb,
                             const device uint* e8grid, int h, int H, int nope, int rope, int I, int rb, int ng,
                             int n_units, threadgroup float* qsh, int sg, int lane) {
  constexpr int W = qd_words(FMT);
  constexpr int NSEG = qd_wpu(FMT) / qd_seg(FMT, GS);
  const int nq = nope + rope;
  const int xoff[1] = {0};
  for (int r0 = sg * QR; r0 < nq; r0 += NSG * QR) {
    int rows[QR];
    for (int r = 0; r < QR; ++r) {
      const int n = min(r0 + r, nq - 1);
      rows[r] = n < nope ? h * nope + n : H * nope + h * rope + (n - nope);
    }
    uint raw[NUB][QR][W];
    float scl[NUB][QR][NSEG];
    for (int j = 0; j < NUB; ++j) {
      const int u = lane + 32 * j;
      if (u < n_units) {
        for (int r = 0; r < QR; ++r) {
          qd_load<FMT, VEC>(wqb + size_t(rows[r]) * size_t(rb), rb, u, raw[j][r]);
          qd_load_aux<FMT, GS>(sqb, rows[r], ng, u, raw[j][r]);
          for (int g = 0; g < NSEG; ++g) {
            scl[j][r][g] = qd_scales_in_memory(FMT) ? qd_seg_scale<FMT, GS>(sqb, rows[r], ng, u, g, raw[j][r]) : 1.0f;
          }
        }
      }
    }
    float acc[QR][1];
    for (int r = 0; r < QR; ++r) {
      acc[r][0] = 0.0f;
    }
    for (int j = 0; j < NUB; ++j) {
      const int u = lane + 32 * j;
      if (u < n_units) {
        for (int g = 0; g < NSEG; ++g) {
          float d[QR][1];
          qd_seg_dots<FMT, GS, 1, QR, XV, W, TQ, NIB>(raw[j], x, xoff, 1u, I, u, g, e8grid, d);
          for (int r = 0; r < QR; ++r) {
            const float sc = qd_scales_in_memory(FMT) ? scl[j][r][g] : qd_seg_scale<FMT, GS>(sqb, rows[r], ng, u, g, raw[j][r]);
            acc[r][0] += d[r][0] * sc;
          }
        }
      }
    }
    for (int r = 0; r < QR; ++r) {
      const float t = simd_sum(acc[r][0]);
      if (lane == r && r0 + r < nq) {
        qsh[r0 + r] = float(static_cast<TQ>(t * qd_row_scale<FMT>(sqb, rows[r])));
      }
    }
  }
}

// Q' of head tile ht over k-part kp (k-steps kp, kp + KP, ...) as 8x8 matrices (two 8-head
// halves a k-step), held for a whole tile (read once, not per chunk). qa0: the threadgroup's
// first q' | q_rope row (RW floats a head).
template <int NK, int KP, int RW, bool K_WHOLE>
inline void mla_load_qprime(thread simdgroup_float8x8 (*qt)[2], const device float* qa0, int ht, int kp) {
  for (int i = 0; i < NK; ++i) {
    const int k0 = (kp + i * KP) * 8;
    for (int r = 0; r < 2; ++r) {
      const int row0 = ht * 16 + r * 8;
      if (K_WHOLE || k0 < RW) {
        simdgroup_load(qt[i][r], qa0 + size_t(row0) * RW + k0, RW);
      } else {
        qt[i][r] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      }
    }
  }
}

// A tile's partial combine into pacc: SIMD group sg's 8x8 tiles acc[rt][ct] (8-head row tiles,
// column tiles sg * NCT + ct) of head block hb, through its 64 floats of o_s; rows past H
// (padding heads) are not written.
template <int HTL, int NCT, int R, bool COLS_WHOLE>
inline void mla_write_partial_rows(thread simdgroup_float8x8 (*acc)[NCT], threadgroup float* o_s, device float* pacc,
                                   int q, int H, int HT, int hb, int NT, int tile, int sg, int lane) {
  for (int rt = 0; rt < 2 * HTL; ++rt) {
    for (int ct = 0; ct < NCT; ++ct) {
      const int col0 = (sg * NCT + ct) * 8;
      if (COLS_WHOLE || col0 < R) {
        simdgroup_store(acc[rt][ct], o_s + sg * 64, 8);
        simdgroup_barrier(mem_flags::mem_threadgroup);
        for (int e = lane; e < 64; e += 32) {
          const int h = hb * HT + rt * 8 + e / 8;
          if (h < H) {
            pacc[mla_part(q, H, h, NT, tile) * R + col0 + e % 8] = o_s[sg * 64 + e];
          }
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);
      }
    }
  }
}

// ---- mla_attn_wide: chunks staged as the cache's own 16-bit values ----
// The 8x8 float matrix of 16-bit values at m (row stride `stride`; transposed: m holds it by
// columns), built lane by lane (thread_elements: row r, columns c and c + 1 of the simdgroup
// matrix layout), so a 16-bit chunk feeds float products without a float copy of it. bf16 / f16
// values are exact in float.
template <typename TC>
inline simdgroup_float8x8 mla_frag16(const threadgroup TC* m, int stride, bool transpose, int lane) {
  const int qid = lane / 4;
  const int r = (qid & 4) + (lane / 2) % 4;
  const int c = (qid & 2) * 2 + (lane % 2) * 2;
  simdgroup_float8x8 f;
  f.thread_elements()[0] = float(transpose ? m[c * stride + r] : m[r * stride + c]);
  f.thread_elements()[1] = float(transpose ? m[(c + 1) * stride + r] : m[r * stride + c + 1]);
  return f;
}

// ==== kernel body: mla_qabs ====
  constexpr int WPU = qd_wpu(FMT);
  threadgroup float red[NSG * NU * LW * WPU];
  const int H = params[0];
  const int nope = params[1];
  const int R = params[3];
  const int h = int(threadgroup_position_in_grid.y);
  const int q = int(threadgroup_position_in_grid.z);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);
  const int tid = int(thread_index_in_threadgroup);
  const int Hp = params[15];
  const int QW = R + params[4];                // a q row: q' (R), then q_rope (rope)
  // Column part cp of the head: kv_b units u0 .. u0 + UPP - 1 (the columns they hold); part 0
  // also writes q_rope. Parts x heads threadgroups instead of one a head (see mla.py).
  const int cp = int(threadgroup_position_in_grid.x);
  device float* qrow = qabs + (size_t(q) * Hp + h) * QW;
  if (mla_padding_head<NSG>(qrow, h, H, QW, cp == 0, tid)) {
    return;
  }
  mla_qabs_columns<FMT, GS, VEC, NSG, LW, NU, RU, UPP>(qn + (size_t(q) * H + h) * nope, w, scales, e8grid, h, nope,
                                                       params[2], R, params[10], params[11], params[12], cp * UPP,
                                                       red, qrow, tid, sg, lane);
  if (cp == 0) {
    mla_qabs_rope<ROPEQ, TQ, NSG>(qrope + (size_t(q) * H + h) * (QW - R), qrow + R, QW - R,
                                  ROPEQ ? float(qpos[q]) : 0.0f, invf, tid);
  }
// ==== kernel body: mla_qb_qabs ====
  // mla_qabs with the q_b projection folded in (decode rows, mla.py): this head's q_nope and
  // q_rope rows of q_b against the q_a row first (mla_qb_head_rows, into threadgroup memory),
  // then q' over all of kv_b's units (one threadgroup a head) and q_rope, as mla_qabs. One
  // launch and q's round trip through memory fewer than q_b's GEMV followed by mla_qabs.
  constexpr int WPU = qd_wpu(FMT);
  threadgroup float red[NSG * NU * LW * WPU];
  threadgroup float qsh[QMAX];                 // this head's q_nope, then q_rope (rounded to TQ)
  const int H = params[0];
  const int nope = params[1];
  const int R = params[3];
  const int rope = params[4];
  const int h = int(threadgroup_position_in_grid.y);
  const int q = int(threadgroup_position_in_grid.z);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);
  const int tid = int(thread_index_in_threadgroup);
  const int Hp = params[15];
  const int QW = R + rope;
  device float* qrow = qabs + (size_t(q) * Hp + h) * QW;
  if (mla_padding_head<NSG>(qrow, h, H, QW, true, tid)) {
    return;
  }
  const int Ib = qbp[0];
  mla_qb_head_rows<FMTB, GSB, VECB, XVB, NIB, NSG, QR, NUB, TQ>(qa + size_t(q) * Ib,
                                                               reinterpret_cast<const device uint8_t*>(wqb), sqb,
                                                               e8grid, h, H, nope, rope, Ib, qbp[2], qbp[3], qbp[4],
                                                               qsh, sg, lane);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  mla_qabs_columns<FMT, GS, VEC, NSG, LW, NU, RU, UPP>(static_cast<threadgroup const float*>(qsh), w, scales, e8grid,
                                                       h, nope, params[2], R, params[10], params[11], params[12], 0,
                                                       red, qrow, tid, sg, lane);
  mla_qabs_rope<ROPEQ, TQ, NSG>(static_cast<threadgroup const float*>(qsh + nope), qrow + R, rope,
                                ROPEQ ? float(qpos[q]) : 0.0f, invf, tid);
// ==== kernel body: mla_attn ====
  constexpr int C = mla_chunk();
  constexpr int RW = (CJ + RJ) * 32;           // a staged position: latent columns, then rope
  threadgroup float lat_s[C * RW];
  threadgroup int keep_s[C];                   // 1 keep, 0 masked (-1e30), -1 past the tile
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
  const MlaCacheRows cache = mla_cache_rows(params[16], R, rope);
  const int tid = int(thread_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int tile = int(threadgroup_position_in_grid.y);
  const int q = int(threadgroup_position_in_grid.z);
  const int h0 = (int(threadgroup_position_in_grid.x) * NSG + sg) * HB;
  const bool active = h0 < H;                  // idle SIMD groups still stage and wait
  const int b = q / L;
  const int p0 = tile * TT;
  const int p1 = min(P, p0 + TT);
  float qa[HB][CJ];
  float qr[HB][RJ];
  float acc[HB][CJ];
  float m[HB];
  float l[HB];
  for (int i = 0; i < HB; ++i) {
    const int hh = min(h0 + i, H - 1);
    const device float* qa_h = qabs + (size_t(q) * H + hh) * (R + rope);
    const device float* qr_h = qa_h + R;
    for (int j = 0; j < CJ; ++j) {
      const int c = lane + 32 * j;
      qa[i][j] = c < R ? qa_h[c] : 0.0f;
      acc[i][j] = 0.0f;
    }
    for (int j = 0; j < RJ; ++j) {
      const int c = lane + 32 * j;
      qr[i][j] = c < rope ? qr_h[c] : 0.0f;
    }
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }
  for (int c0 = p0; c0 < p1; c0 += C) {
    threadgroup_barrier(mem_flags::mem_threadgroup);   // the previous chunk is consumed
    for (int k = tid; k < C * RW; k += NSG * 32) {
      const int c = k / RW;
      const int col = k - c * RW;
      float val = 0.0f;
      if (c0 + c < p1) {
        const int t = has_sel ? sel[size_t(q) * P + c0 + c] : c0 + c;
        if (col < R) {
          val = float(latent[(size_t(b) * T + t) * cache.ls + col]);
        } else if (col >= CJ * 32 && col - CJ * 32 < rope) {
          val = float(krope[(size_t(b) * T + t) * cache.ks + cache.rope0 + col - CJ * 32]);
        }
      }
      lat_s[k] = val;
    }
    if (tid < C) {
      int keep = -1;
      if (c0 + tid < p1) {
        const int t = has_sel ? sel[size_t(q) * P + c0 + tid] : c0 + tid;
        keep = (has_mask == 2 ? t <= P - L + q % L : !has_mask || mask[size_t(q) * T + t] != 0) ? 1 : 0;
      }
      keep_s[tid] = keep;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (active) {
      // d[i * C + c]: this lane's share of head i's score at position c (heads >= HB: 0).
      float d[32];
      for (int k = 0; k < 32; ++k) {
        d[k] = 0.0f;
      }
      for (int c = 0; c < C; ++c) {
        const threadgroup float* row = lat_s + c * RW;
        for (int j = 0; j < CJ; ++j) {
          const float lv = row[lane + 32 * j];
          for (int i = 0; i < HB; ++i) {
            d[i * C + c] += qa[i][j] * lv;
          }
        }
        for (int j = 0; j < RJ; ++j) {
          const float kv = row[CJ * 32 + lane + 32 * j];
          for (int i = 0; i < HB; ++i) {
            d[i * C + c] += qr[i][j] * kv;
          }
        }
      }
      // Lane i * C + c: score of head i at position c; the softmax of a head spans 8 lanes.
      const float dot = mla_reduce_scatter(d, lane);
      const int keep = keep_s[lane % C];
      const float s = keep > 0 ? dot * scale : (keep == 0 ? -1e30f : -INFINITY);
      float cmax = max(s, simd_shuffle_xor(s, ushort(1)));
      cmax = max(cmax, simd_shuffle_xor(cmax, ushort(2)));
      cmax = max(cmax, simd_shuffle_xor(cmax, ushort(4)));
      float m_old = m[0];
      for (int i = 1; i < HB; ++i) {
        m_old = (lane / C == i) ? m[i] : m_old;
      }
      const float m_new = max(m_old, cmax);
      const float alpha = exp(m_old - m_new);
      const float pw = keep >= 0 ? exp(s - m_new) : 0.0f;
      float psum = pw + simd_shuffle_xor(pw, ushort(1));
      psum += simd_shuffle_xor(psum, ushort(2));
      psum += simd_shuffle_xor(psum, ushort(4));
      for (int i = 0; i < HB; ++i) {
        const float al = simd_shuffle(alpha, ushort(i * C));
        m[i] = simd_shuffle(m_new, ushort(i * C));
        l[i] = l[i] * al + simd_shuffle(psum, ushort(i * C));
        for (int j = 0; j < CJ; ++j) {
          acc[i][j] *= al;
        }
      }
      for (int c = 0; c < C; ++c) {
        float pc[HB];
        for (int i = 0; i < HB; ++i) {
          pc[i] = simd_shuffle(pw, ushort(i * C + c));
        }
        const threadgroup float* row = lat_s + c * RW;
        for (int j = 0; j < CJ; ++j) {
          const float lv = row[lane + 32 * j];
          for (int i = 0; i < HB; ++i) {
            acc[i][j] += pc[i] * lv;
          }
        }
      }
    }
  }
  if (active) {
    for (int i = 0; i < HB; ++i) {
      const size_t part = (size_t(q) * H + h0 + i) * size_t(params[8]) + tile;
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
// ==== kernel body: mla_attn_mma ====
  constexpr int C = mla_chunk();               // positions per chunk: the 8 of an 8x8 matrix
  constexpr int RWS = RW + mla_stage_pad();    // staged position: R latent + rope columns, pad
  constexpr int HTL = HT / 16;                 // 16-head tiles (CUDA: one m16 fragment each)
  constexpr int KP = NSG / HTL;                // scores: SIMD groups (k-parts) per head tile
  constexpr int UPP = RW / 8;                  // 8-value units per staged position
  constexpr int NLU = (C * UPP + NSG * 32 - 1) / (NSG * 32);  // staged units per thread
  constexpr int NK = (UPP + KP - 1) / KP;      // scores: k-steps per k-part
  static_assert(HT * C == NSG * 32, "one softmax thread per (head, position) of a chunk");
  static_assert(HT % 16 == 0 && NSG % HTL == 0, "SIMD groups = head tiles x k-parts");
  static_assert(RW % 8 == 0, "8x8 matrix tiles");
  // Whole tiles (DeepSeek-V3: 576 columns = 4 k-parts x 18 k-steps x 8, 512 latent columns =
  // 8 SIMD groups x 8 column tiles x 8) need no per-step column test.
  constexpr bool K_WHOLE = NK * KP == UPP;
  constexpr bool COLS_WHOLE = NSG * NCT * 8 == RL;
  threadgroup float lat_s[C * RWS];
  threadgroup float sc_s[KP * HT * C];          // partial scores of each k-part
  threadgroup float p_s[HT * C];                // the chunk's softmax weights P[head][position]
  threadgroup float diag_s[HT * 8];             // diag(alpha) per 8-head row tile
  threadgroup float o_s[NSG * 64];              // write-out of one tile per SIMD group
  const int H = params[0];
  constexpr int R = RL;                        // latent width (params[3]), compiled in
  const int rope = params[4];
  const int T = params[5];
  const int P = params[6];
  const int TT = params[7];
  const int NT = params[8];
  const int L = params[9];
  const int has_mask = params[13];
  const int has_sel = params[14];
  const int Hp = params[15];
  const float scale = fparams[0];
  const MlaCacheRows cache = mla_cache_rows(params[16], R, rope);
  const int tid = int(thread_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int hb = int(threadgroup_position_in_grid.x);
  const int tile = int(threadgroup_position_in_grid.y);
  const int q = int(threadgroup_position_in_grid.z);
  const int b = q / L;
  const int p0 = tile * TT;
  const int p1 = min(P, p0 + TT);
  const int ht = sg % HTL;                     // scores: this SIMD group's head tile
  const int kp = sg / HTL;                     // and k-part (k-steps kp, kp + KP, ...)
  const int hs = tid / C;                      // softmax thread: head hs of the block,
  const int cs = tid % C;                      // position cs of the chunk
  const device float* qa0 = qabs + (size_t(q) * Hp + hb * HT) * RW;   // q' | q_rope rows
  float m = -INFINITY;                         // running max / sum of head hs (8 lanes agree)
  float l = 0.0f;
  simdgroup_float8x8 acc[2 * HTL][NCT];        // O[rt * 8.., (sg * NCT + ct) * 8..]
  for (int rt = 0; rt < 2 * HTL; ++rt) {
    for (int ct = 0; ct < NCT; ++ct) {
      acc[rt][ct] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }
  // The chunk's units in flight: raw cache words, or zero past the tile (weight 0, no NaN).
  uint4 raw[NLU][2];
  // This thread's staged units, the same every chunk: position c of the chunk (>= C: no unit),
  // where the unit's row of the cache starts (latent or rope columns) and its row stride, and
  // where it is staged.
  int unit_c[NLU];
  int unit_stride[NLU];
  int unit_dst[NLU];
  const device TC* unit_src[NLU];
  for (int j = 0; j < NLU; ++j) {
    const int u = tid + j * NSG * 32;
    const int c = u / UPP;
    const int col = (u - c * UPP) * 8;
    unit_c[j] = c;
    unit_stride[j] = col < R ? cache.ls : cache.ks;
    unit_src[j] = col < R ? latent + size_t(b) * T * cache.ls + col : krope + size_t(b) * T * cache.ks + cache.rope0 + (col - R);
    unit_dst[j] = c * RWS + (u - c * UPP) * 8;
  }
  simdgroup_float8x8 qt[NK][2];                // Q': (head, k), two 8-head halves
  mla_load_qprime<NK, KP, RW, K_WHOLE>(qt, qa0, ht, kp);
  for (int c0 = p0 - C; c0 < p1; c0 += C) {
    // Iteration c0 multiplies chunk c0 while chunk c0 + C is in flight (c0 = p0 - C: only loads).
    if (c0 >= p0) {
      threadgroup_barrier(mem_flags::mem_threadgroup);   // the previous chunk is consumed
      for (int j = 0; j < NLU; ++j) {
        if ((j + 1) * NSG * 32 <= C * UPP || unit_c[j] < C) {
          float f[8];
          qd_widen8(raw[j], f, latent);
          for (int k = 0; k < 8; ++k) {
            lat_s[unit_dst[j] + k] = f[k];
          }
        }
      }
    }
    const int cn = c0 + C;                     // the chunk to load next
    for (int j = 0; j < NLU && cn < p1; ++j) {
      raw[j][0] = raw[j][1] = uint4(0u);
      if (cn + unit_c[j] < p1 && unit_c[j] < C) {
        const int t = mla_position(sel, has_sel, q, P, cn + unit_c[j]);
        qd_load8_raw(unit_src[j] + size_t(t) * unit_stride[j], raw[j]);
      }
    }
    if (c0 < p0) {
      continue;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // S[16 heads of tile ht] over this k-part = Q' . chunk^T (latent k-steps, then rope)
    simdgroup_float8x8 s[2];
    for (int r = 0; r < 2; ++r) {
      s[r] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    for (int i = 0; i < NK; ++i) {
      const int k0 = (kp + i * KP) * 8;
      if (K_WHOLE || k0 < RW) {
        simdgroup_float8x8 kt;
        simdgroup_load(kt, lat_s + k0, RWS, ulong2(0, 0), true);     // [k][position]
        for (int r = 0; r < 2; ++r) {
          simdgroup_multiply_accumulate(s[r], qt[i][r], kt, s[r]);
        }
      }
    }
    for (int r = 0; r < 2; ++r) {
      simdgroup_store(s[r], sc_s + (kp * HT + ht * 16 + r * 8) * C, C);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    {
      float dot = 0.0f;
      for (int g = 0; g < KP; ++g) {
        dot += sc_s[(g * HT + hs) * C + cs];
      }
      int keep = -1;                           // 1 keep, 0 masked (-1e30), -1 past the tile
      if (c0 + cs < p1) {
        const int t = mla_position(sel, has_sel, q, P, c0 + cs);
        keep = (has_mask == 2 ? t <= P - L + q % L : !has_mask || mask[size_t(q) * T + t] != 0) ? 1 : 0;
      }
      const float sv = keep > 0 ? dot * scale : (keep == 0 ? -1e30f : -INFINITY);
      float cmax = max(sv, simd_shuffle_xor(sv, ushort(1)));
      cmax = max(cmax, simd_shuffle_xor(cmax, ushort(2)));
      cmax = max(cmax, simd_shuffle_xor(cmax, ushort(4)));
      const float m_new = max(m, cmax);
      const float alpha = exp(m - m_new);
      const float pw = keep >= 0 ? exp(sv - m_new) : 0.0f;
      float psum = pw + simd_shuffle_xor(pw, ushort(1));
      psum += simd_shuffle_xor(psum, ushort(2));
      psum += simd_shuffle_xor(psum, ushort(4));
      m = m_new;
      l = l * alpha + psum;
      p_s[hs * C + cs] = pw;
      diag_s[hs * 8 + cs] = cs == hs % 8 ? alpha : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // O = diag(alpha) O + P . chunk on this SIMD group's column tiles, all heads: each column
    // tile of the chunk is loaded once for every row tile.
    simdgroup_float8x8 pt[2 * HTL];
    simdgroup_float8x8 dt[2 * HTL];
    bool rescale[2 * HTL];
    for (int rt = 0; rt < 2 * HTL; ++rt) {
      simdgroup_load(pt[rt], p_s + rt * 8 * C, C);
      simdgroup_load(dt[rt], diag_s + rt * 64, 8);
      // Once the running max settles, alpha is exactly 1 for every head: skip the rescale.
      rescale[rt] = simd_any(diag_s[rt * 64 + (lane % 8) * 9] != 1.0f);
    }
    for (int ct = 0; ct < NCT; ++ct) {
      const int col0 = (sg * NCT + ct) * 8;
      if (COLS_WHOLE || col0 < R) {
        simdgroup_float8x8 lt;
        simdgroup_load(lt, lat_s + col0, RWS);             // [position][column]
        for (int rt = 0; rt < 2 * HTL; ++rt) {
          if (rescale[rt]) {
            simdgroup_multiply(acc[rt][ct], dt[rt], acc[rt][ct]);
          }
          simdgroup_multiply_accumulate(acc[rt][ct], pt[rt], lt, acc[rt][ct]);
        }
      }
    }
  }
  mla_write_partial_rows<HTL, NCT, R, COLS_WHOLE>(acc, o_s, pacc, q, H, HT, hb, NT, tile, sg, lane);
  if (cs == 0 && hb * HT + hs < H) {
    const size_t part = mla_part(q, H, hb * HT + hs, NT, tile);
    pml[2 * part] = m;
    pml[2 * part + 1] = l;
  }
// ==== kernel body: mla_attn_wide ====
  // mla_attn_mma's algorithm (head tiles x k-parts for the scores, column tiles for the
  // combine, q' held as matrices, an online-softmax step a chunk) on chunks of CK positions
  // staged as the cache's own 16-bit values: the next chunk's rows are loaded as raw 16-byte
  // words while this one is multiplied, stored without conversion, and the float fragments
  // are built lane by lane (mla_frag16). The CUDA twin's chunk is 32 positions, double-buffered
  // by cp.async; Metal's 32 KiB of threadgroup memory holds one chunk of 16 (19 KB).
  constexpr int RWS = RW + 8;                  // staged row: R + rope 16-bit values, pad
  constexpr int HTL = HT / 16;                 // 16-head tiles (CUDA: one m16 fragment each)
  constexpr int KP = NSG / HTL;                // scores: SIMD groups (k-parts) per head tile
  constexpr int UPP = RW / 8;                  // 16-byte units (8 values) per staged position
  constexpr int RPW = CK / NSG;                // staged rows per SIMD group
  constexpr int NUL = (UPP + 31) / 32;         // a row's units per lane
  constexpr int NK = (UPP + KP - 1) / KP;      // scores: k-steps per k-part
  constexpr int NPT = CK / 8;                  // 8-position tiles (scores) = k-steps (combine)
  constexpr int PPT = HT * CK / (NSG * 32);    // softmax: positions per thread
  static_assert(sizeof(TC) == 2, "a 16-bit cache (bf16 / f16)");
  static_assert(HT * 8 == NSG * 32, "8 softmax threads per head");
  static_assert(CK % 8 == 0 && CK % NSG == 0, "whole position tiles, whole rows a SIMD group");
  static_assert(HT % 16 == 0 && NSG % HTL == 0, "SIMD groups = head tiles x k-parts");
  static_assert(RW % 8 == 0, "8x8 matrix tiles");
  constexpr bool K_WHOLE = NK * KP == UPP;
  constexpr bool COLS_WHOLE = NSG * NCT * 8 == RL;
  threadgroup TC lat_s[CK * RWS];
  threadgroup float sc_s[KP * HT * CK];        // partial scores of each k-part
  threadgroup float p_s[HT * CK];              // the chunk's softmax weights P[head][position]
  threadgroup float diag_s[HT * 8];            // diag(alpha) per 8-head row tile
  threadgroup float o_s[NSG * 64];             // write-out of one tile per SIMD group
  const int H = params[0];
  constexpr int R = RL;                        // latent width (params[3]), compiled in
  const int rope = params[4];
  const int T = params[5];
  const int P = params[6];
  const int TT = params[7];
  const int NT = params[8];
  const int L = params[9];
  const int has_mask = params[13];
  const int has_sel = params[14];
  const int Hp = params[15];
  const float scale = fparams[0];
  const MlaCacheRows cache = mla_cache_rows(params[16], R, rope);
  const int tid = int(thread_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int hb = int(threadgroup_position_in_grid.x);
  const int tile = int(threadgroup_position_in_grid.y);
  const int q = int(threadgroup_position_in_grid.z);
  const int b = q / L;
  const int p0 = tile * TT;
  const int p1 = min(P, p0 + TT);
  const int ht = sg % HTL;                     // scores: this SIMD group's head tile
  const int kp = sg / HTL;                     // and k-part (k-steps kp, kp + KP, ...)
  const int hs = tid / 8;                      // softmax thread: head hs of the block,
  const int cj = tid % 8;                      // its 8th, positions cs .. cs + PPT - 1
  const int cs = cj * PPT;
  const device float* qa0 = qabs + (size_t(q) * Hp + hb * HT) * RW;   // q' | q_rope rows
  const device TC* lat0 = latent + size_t(b) * T * cache.ls;
  const device TC* rope0 = krope + size_t(b) * T * cache.ks + cache.rope0;
  float m = -INFINITY;                         // running max / sum of head hs (8 lanes agree)
  float l = 0.0f;
  simdgroup_float8x8 acc[2 * HTL][NCT];        // O[rt * 8.., (sg * NCT + ct) * 8..]
  for (int rt = 0; rt < 2 * HTL; ++rt) {
    for (int ct = 0; ct < NCT; ++ct) {
      acc[rt][ct] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }
  // The next chunk's units in flight: SIMD group sg's rows sg * RPW .., a row's units over the
  // lanes; zero past the tile (weight 0, no NaN).
  uint4 raw[RPW][NUL];
  simdgroup_float8x8 qt[NK][2];                // Q': (head, k), two 8-head halves
  mla_load_qprime<NK, KP, RW, K_WHOLE>(qt, qa0, ht, kp);
  for (int c0 = p0 - CK; c0 < p1; c0 += CK) {
    // Iteration c0 multiplies chunk c0 while chunk c0 + CK is in flight (c0 = p0 - CK: only loads).
    if (c0 >= p0) {
      threadgroup_barrier(mem_flags::mem_threadgroup);   // the previous chunk is consumed
      for (int k = 0; k < RPW; ++k) {
        for (int i = 0; i < NUL; ++i) {
          const int col = (lane + 32 * i) * 8;
          if ((i + 1) * 32 <= UPP || col < RW) {
            *((threadgroup uint4*)(lat_s + (sg * RPW + k) * RWS + col)) = raw[k][i];
          }
        }
      }
    }
    const int cn = c0 + CK;                    // the chunk to load next
    if (cn < p1) {
      for (int k = 0; k < RPW; ++k) {
        const int c = sg * RPW + k;
        const bool in = cn + c < p1;
        const int t = in ? mla_position(sel, has_sel, q, P, cn + c) : 0;
        for (int i = 0; i < NUL; ++i) {
          const int col = (lane + 32 * i) * 8;
          raw[k][i] = uint4(0u);
          if (in && ((i + 1) * 32 <= UPP || col < RW)) {
            qd_load8_raw(col < R ? lat0 + size_t(t) * cache.ls + col : rope0 + size_t(t) * cache.ks + (col - R), &raw[k][i]);
          }
        }
      }
    }
    if (c0 < p0) {
      continue;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // S[16 heads of tile ht][CK positions] over this k-part = Q' . chunk^T
    simdgroup_float8x8 s[2][NPT];
    for (int r = 0; r < 2; ++r) {
      for (int pt = 0; pt < NPT; ++pt) {
        s[r][pt] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      }
    }
    for (int i = 0; i < NK; ++i) {
      const int k0 = (kp + i * KP) * 8;
      if (K_WHOLE || k0 < RW) {
        for (int pt = 0; pt < NPT; ++pt) {
          const simdgroup_float8x8 kt = mla_frag16(lat_s + pt * 8 * RWS + k0, RWS, true, lane);   // [k][position]
          for (int r = 0; r < 2; ++r) {
            simdgroup_multiply_accumulate(s[r][pt], qt[i][r], kt, s[r][pt]);
          }
        }
      }
    }
    for (int r = 0; r < 2; ++r) {
      for (int pt = 0; pt < NPT; ++pt) {
        simdgroup_store(s[r][pt], sc_s + (kp * HT + ht * 16 + r * 8) * CK + pt * 8, CK);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    {
      float sv[PPT];
      bool live[PPT];                          // inside the tile (masked positions count)
      float cmax = -INFINITY;
      for (int k = 0; k < PPT; ++k) {
        float dot = 0.0f;
        for (int g = 0; g < KP; ++g) {
          dot += sc_s[(g * HT + hs) * CK + cs + k];
        }
        live[k] = c0 + cs + k < p1;
        bool keep = live[k];
        if (live[k] && has_mask) {
          const int t = mla_position(sel, has_sel, q, P, c0 + cs + k);
          keep = has_mask == 2 ? t <= P - L + q % L : mask[size_t(q) * T + t] != 0;
        }
        sv[k] = keep ? dot * scale : (live[k] ? -1e30f : -INFINITY);
        cmax = max(cmax, sv[k]);
      }
      cmax = max(cmax, simd_shuffle_xor(cmax, ushort(1)));
      cmax = max(cmax, simd_shuffle_xor(cmax, ushort(2)));
      cmax = max(cmax, simd_shuffle_xor(cmax, ushort(4)));
      const float m_new = max(m, cmax);
      const float alpha = exp(m - m_new);
      float psum = 0.0f;
      for (int k = 0; k < PPT; ++k) {
        const float pw = live[k] ? exp(sv[k] - m_new) : 0.0f;
        p_s[hs * CK + cs + k] = pw;
        psum += pw;
      }
      psum += simd_shuffle_xor(psum, ushort(1));
      psum += simd_shuffle_xor(psum, ushort(2));
      psum += simd_shuffle_xor(psum, ushort(4));
      m = m_new;
      l = l * alpha + psum;
      diag_s[hs * 8 + cj] = cj == hs % 8 ? alpha : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // O = diag(alpha) O + P . chunk on this SIMD group's column tiles, all heads: each 8x8 tile
    // of the chunk is built once for every row tile.
    simdgroup_float8x8 pt[2 * HTL][NPT];
    simdgroup_float8x8 dt[2 * HTL];
    bool rescale[2 * HTL];
    for (int rt = 0; rt < 2 * HTL; ++rt) {
      for (int kk = 0; kk < NPT; ++kk) {
        simdgroup_load(pt[rt][kk], p_s + rt * 8 * CK + kk * 8, CK);
      }
      simdgroup_load(dt[rt], diag_s + rt * 64, 8);
      // Once the running max settles, alpha is exactly 1 for every head: skip the rescale.
      rescale[rt] = simd_any(diag_s[rt * 64 + (lane % 8) * 9] != 1.0f);
    }
    for (int ct = 0; ct < NCT; ++ct) {
      const int col0 = (sg * NCT + ct) * 8;
      if (COLS_WHOLE || col0 < R) {
        for (int rt = 0; rt < 2 * HTL; ++rt) {
          if (rescale[rt]) {
            simdgroup_multiply(acc[rt][ct], dt[rt], acc[rt][ct]);
          }
        }
        for (int kk = 0; kk < NPT; ++kk) {
          const simdgroup_float8x8 vt = mla_frag16(lat_s + kk * 8 * RWS + col0, RWS, false, lane);  // [position][column]
          for (int rt = 0; rt < 2 * HTL; ++rt) {
            simdgroup_multiply_accumulate(acc[rt][ct], pt[rt][kk], vt, acc[rt][ct]);
          }
        }
      }
    }
  }
  mla_write_partial_rows<HTL, NCT, R, COLS_WHOLE>(acc, o_s, pacc, q, H, HT, hb, NT, tile, sg, lane);
  if (cj == 0 && hb * HT + hs < H) {
    const size_t part = mla_part(q, H, hb * HT + hs, NT, tile);
    pml[2 * part] = m;
    pml[2 * part + 1] = l;
  }
// ==== kernel body: mla_out ====
  constexpr int WPU = qd_wpu(FMT);
  constexpr int SEG = qd_seg(FMT, GS);
  constexpr int NSEG = WPU / SEG;
  constexpr int RPS = 32 / LW;                 // W_UV rows side by side in a SIMD group
  constexpr int TPT = NTMAX / (NSG * 32);      // tiles per thread in the weight pass
  constexpr int CPT = (RMAX + NSG * 32 - 1) / (NSG * 32);   // context columns per thread
  // TU (template): tiles per batch of context loads, CPT x TU loads in flight a thread
  static_assert(NTMAX % (NSG * 32) == 0 && NTMAX % TU == 0, "whole weight passes and batches");
  threadgroup float ctx[RMAX];
  threadgroup float wt[NTMAX];                 // exp(m_t - max) of tile t; 0 past NT
  threadgroup float mx_s[NSG];
  threadgroup float den_s[NSG];
  const int H = params[0];
  const int nope = params[1];
  const int v = params[2];
  const int R = params[3];
  const int NT = params[8];
  const int rb = params[10];
  const int ng = params[11];
  const int n_units = params[12];
  const int h = int(threadgroup_position_in_grid.y);
  const int q = int(threadgroup_position_in_grid.z);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);
  const int tid = int(thread_index_in_threadgroup);
  const int sub = lane / LW;                   // which of the RPS rows; lanes ul own units
  const int ul = lane % LW;
  const size_t part0 = (size_t(q) * H + h) * NT;
  // Tile weights once per threadgroup (NT <= NTMAX, mla.py caps it): threads split the tiles,
  // every (m, l) load issued at once, max and denominator reduced across the threadgroup.
  float mt[TPT];
  float lt[TPT];
  for (int k = 0; k < TPT; ++k) {
    const int t = tid + k * NSG * 32;
    mt[k] = t < NT ? pml[2 * (part0 + t)] : -INFINITY;
    lt[k] = t < NT ? pml[2 * (part0 + t) + 1] : 0.0f;
  }
  float mloc = mt[0];
  for (int k = 1; k < TPT; ++k) {
    mloc = max(mloc, mt[k]);
  }
  mloc = simd_max(mloc);
  if (lane == 0) {
    mx_s[sg] = mloc;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float mx_ = mx_s[0];
  for (int g = 1; g < NSG; ++g) {
    mx_ = max(mx_, mx_s[g]);
  }
  float dloc = 0.0f;
  for (int k = 0; k < TPT; ++k) {
    const int t = tid + k * NSG * 32;
    const float e = t < NT ? exp(mt[k] - mx_) : 0.0f;
    wt[t] = e;
    dloc += e * lt[k];
  }
  dloc = simd_sum(dloc);
  if (lane == 0) {
    den_s[sg] = dloc;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float den = 0.0f;
  for (int g = 0; g < NSG; ++g) {
    den += den_s[g];
  }
  // ctx[c] = sum_t w_t pacc[t][c] / den: CPT columns x TU tiles of loads in flight per batch.
  float s[CPT];
  for (int j = 0; j < CPT; ++j) {
    s[j] = 0.0f;
  }
  for (int t0 = 0; t0 < NT; t0 += TU) {
    float pv[CPT][TU];
    for (int j = 0; j < CPT; ++j) {
      const int c = tid + j * NSG * 32;
      for (int k = 0; k < TU; ++k) {
        pv[j][k] = (c < R && t0 + k < NT) ? pacc[(part0 + t0 + k) * R + c] : 0.0f;
      }
    }
    for (int j = 0; j < CPT; ++j) {
      for (int k = 0; k < TU; ++k) {
        s[j] += wt[t0 + k] * pv[j][k];
      }
    }
  }
  for (int j = 0; j < CPT; ++j) {
    const int c = tid + j * NSG * 32;
    if (c < RMAX) {
      ctx[c] = s[j] / den;                     // 0 past R: the last unit's padding weights
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // W_UV rows RU a lane per step, all loads (units, scales) before the dot products.
  for (int v0 = 0; v0 < v; v0 += NSG * RPS * RU) {
    uint raw[RU][NU][qd_words(FMT)];
    float scl[RU][NU][NSEG];                   // fmt 4/5 segment scales
    float rs[RU];                              // fmt 1-3 row scales
    for (int i = 0; i < RU; ++i) {
      const int vi = v0 + (i * NSG + sg) * RPS + sub;
      const int row = h * (nope + v) + nope + min(vi, v - 1);
      rs[i] = qd_row_scale<FMT>(scales, row);
      for (int j = 0; j < NU; ++j) {
        const int u = ul + LW * j;
        if (vi < v && u < n_units) {
          qd_load<FMT, VEC>(w + size_t(row) * size_t(rb), rb, u, raw[i][j]);
          qd_load_aux<FMT, GS>(scales, row, ng, u, raw[i][j]);
          for (int g = 0; g < NSEG; ++g) {
            scl[i][j][g] = qd_scales_in_memory(FMT) ? qd_seg_scale<FMT, GS>(scales, row, ng, u, g, raw[i][j]) : 1.0f;
          }
        }
      }
    }
    float a[RU];
    for (int i = 0; i < RU; ++i) {
      const int vi = v0 + (i * NSG + sg) * RPS + sub;
      const int row = h * (nope + v) + nope + min(vi, v - 1);
      a[i] = 0.0f;
      for (int j = 0; j < NU; ++j) {
        const int u = ul + LW * j;
        if (vi < v && u < n_units) {
          for (int g = 0; g < NSEG; ++g) {
            float d = 0.0f;
            for (int c = 0; c < SEG; c += 8) {
              const int k0 = SEG * g + c;
              float wq[8];
              qd_decode8<FMT>(raw[i][j], k0, e8grid, wq);
              for (int k = 0; k < 8; ++k) {
                d += wq[k] * ctx[u * WPU + k0 + k];
              }
            }
            a[i] += d * (qd_scales_in_memory(FMT) ? scl[i][j][g] : qd_seg_scale<FMT, GS>(scales, row, ng, u, g, raw[i][j]));
          }
        }
      }
    }
    // Sum over the LW lanes of each row (lane groups of LW are xor-closed).
    for (int m = LW / 2; m >= 1; m >>= 1) {
      for (int i = 0; i < RU; ++i) {
        a[i] += simd_shuffle_xor(a[i], ushort(m));
      }
    }
    for (int i = 0; i < RU; ++i) {
      const int vi = v0 + (i * NSG + sg) * RPS + sub;
      if (ul == 0 && vi < v) {
        out[(size_t(q) * H + h) * v + vi] = static_cast<T>(a[i] * rs[i]);
      }
    }
  }
// ==== kernel body: mla_rows ====
  // The small ops between the stacked x projection and the cache write, for the decode rows of
  // one sequence, as one launch: one threadgroup per row q of y = [q_a (QL) | latent (R) | rope
  // key (rope)] normalizes q_a (q_a_norm, for q_b) and the latent (kv_a_norm) and rotates the
  // rope key at the row's position (mla_norm_rope_row).
  threadgroup float sums[2 * NSG];
  const int QL = params[0];
  const int R = params[1];
  const int rope = params[2];
  const int q = int(threadgroup_position_in_grid.z);
  mla_norm_rope_row<T, NSG>(y + size_t(q) * params[3], qnorm, knorm, invf, float(pos[q]), QL, R, rope,
                            fparams[0], fparams[1], qa + size_t(q) * QL, kv + size_t(q) * (R + rope), true,
                            sums, int(thread_index_in_threadgroup), int(simdgroup_index_in_threadgroup),
                            int(thread_index_in_simdgroup));
// ==== kernel body: mla_rows_into ====
  // mla_rows with the cache row written into the cache's buffer [1, capacity, R + rope] at the
  // row's slot (its position: one sequence, no padding), the input `cache`, in place. Why: MLX
  // keeps every input of a submitted kernel alive until the kernel has run, and donates a
  // buffer to an op only when nothing else holds it, so a scatter of the next step's row could
  // not take the buffer this step's attention reads while this step runs (a pipelined decode
  // loop builds step n + 1 then) and would copy the whole cache, a layer at a time, every step.
  // Writing the row past everything this step's readers read, and ordering the step's own
  // readers after this launch through its q_a output, needs no donation. A slot past the
  // capacity (params[4]) writes nothing.
  threadgroup float sums[2 * NSG];
  const int QL = params[0];
  const int R = params[1];
  const int rope = params[2];
  const int q = int(threadgroup_position_in_grid.z);
  const int slot = pos[q];
  const bool inside = slot >= 0 && slot < params[4];
  device T* kv_row = const_cast<device T*>(cache) + size_t(inside ? slot : 0) * (R + rope);
  mla_norm_rope_row<T, NSG>(y + size_t(q) * params[3], qnorm, knorm, invf, float(slot), QL, R, rope,
                            fparams[0], fparams[1], qa + size_t(q) * QL, kv_row, inside, sums,
                            int(thread_index_in_threadgroup), int(simdgroup_index_in_threadgroup),
                            int(thread_index_in_simdgroup));

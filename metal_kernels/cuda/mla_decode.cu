// mla_decode, CUDA twin of metal_kernels/mla_decode.metal (same three launches, same params,
// same algorithm; see the .metal file): mla_qabs (q' = W_UK^T q_nope), mla_attn (one block per
// head group x cache tile x query row; C = 8 positions staged in shared memory as float, HB
// heads per warp, reduce-scatter of the 32 partial scores, online softmax rescaled once per
// chunk), mla_out (merge of the tiles, then W_UV; qabs and out read kv_b RU rows at a time, all
// loads first). kv_b decoding is qdecode.cuh's (prepended).
// Template values arrive as constexpr lines; MLX launches grid / block of 32 * NSG threads.
// Generated from the .metal file by a mechanical port (Metal -> CUDA spellings); keep the two
// in step.
// mla_attn_mma (the default variant) is the .metal kernel of that name with one
// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 per Metal pair of 8x8 simdgroup products
// (a 16-head tile is one m16 fragment instead of two 8-row matrices); a float32 chunk is
// rounded to TF32 when staged (bf16 / f16 values are TF32 values already), q' when its
// fragments are loaded (once per tile, held in registers) and P when read (cvt.rna: relative
// error <= 2^-11). The rescale of the accumulator by alpha is per fragment row (Metal: a product
// with diag(alpha)), skipped while every alpha of the warp's rows is 1. The next chunk's 16-byte
// loads are issued before the current chunk is multiplied (as in the .metal kernel). Fragment
// layouts: PTX ISA, "Matrix fragments for mma.m16n8k8" (.tf32), in the frag_* helpers below.
// mla_attn_wide (CUDA's default over a 16-bit cache) stages the chunk as the cache's own 16-bit
// values. Its Metal twin does the same on chunks of 16 in one buffer, the next chunk's words in
// registers (Metal has no cp.async and 32 KiB of threadgroup memory); here 32 positions are
// double-buffered by cp.async (75 KB of dynamic shared memory) and read by ldmatrix.

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

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
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

// ---- shared index arithmetic (the same functions as in mla_decode.metal) ----

// Floats of padding after each staged position (R + rope floats), so the row stride is 8 mod
// 32 banks: the combine's fragment reads of the chunk (rows t = lane % 4, columns g = lane / 4)
// hit 32 distinct banks, and so do the scores' 64-bit reads (rows g, columns 2t and 2t + 1, a
// half-warp at a time); unpadded, 8 lanes a bank.
__device__ constexpr int mla_stage_pad() {
  return 8;
}

// Cache position of entry `pos` of query row q's list: the DSA list or the identity.
__device__ __forceinline__ int mla_position(const int32_t* sel, int has_sel, int q, int P, int pos) {
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
__device__ __forceinline__ MlaCacheRows mla_cache_rows(int joint, int R, int rope) {
  return MlaCacheRows{joint ? R + rope : R, joint ? R + rope : rope, joint ? R : 0};
}

__device__ __forceinline__ size_t mla_part(int q, int H, int h, int NT, int tile) {
  return (size_t(q) * H + h) * size_t(NT) + tile;
}

// ---- mma.m16n8k8 .tf32 fragments (PTX ISA), g = lane / 4, t = lane % 4 ----
// A (16 x 8, row-major): a[i] holds (row g + 8 * (i & 1), column t + 4 * (i >> 1)).
__device__ __forceinline__ int frag_a_row(int lane, int i) {
  return (lane >> 2) + 8 * (i & 1);
}
__device__ __forceinline__ int frag_a_col(int lane, int i) {
  return (lane & 3) + 4 * (i >> 1);
}
// B (8 x 8, "col"): b[i] holds (k = t + 4 * i, n = g).
__device__ __forceinline__ int frag_b_k(int lane, int i) {
  return (lane & 3) + 4 * i;
}
__device__ __forceinline__ int frag_b_n(int lane) {
  return lane >> 2;
}
// C / D (16 x 8, f32): c[i] holds (row g + 8 * (i >> 1), column 2 * t + (i & 1)).
__device__ __forceinline__ int frag_c_row(int lane, int i) {
  return (lane >> 2) + 8 * (i >> 1);
}
__device__ __forceinline__ int frag_c_col(int lane, int i) {
  return 2 * (lane & 3) + (i & 1);
}
// A dot product is the same over any order of its k terms: where both operands of an mma come
// from memory laid out along k, the k8 step's slot t + 4 * j may hold column 2 * t + j of the
// step, so a thread's two B values (slots t and t + 4) are adjacent: one 64-bit shared load.
__device__ __forceinline__ int frag_k_paired(int slot) {
  return 2 * (slot & 3) + (slot >> 2);
}

// x rounded to TF32 (round to nearest, ties away: cvt.rna), as the mma operand register.
__device__ __forceinline__ uint32_t tf32_bits(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float tf32_round(float x) {
  return __uint_as_float(tf32_bits(x));
}

// d[4] += A[16 x 8] . B[8 x 8] (fragments as above), float accumulation.
__device__ __forceinline__ void mma_tf32(float* d, const uint32_t* a, const uint32_t* b) {
  asm(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Q' of head tile ht over k-part kp (k8 steps kp, kp + KP, ...) as TF32 A fragments, the k slots
// paired as the chunk's B fragments (frag_k_paired); held in registers for a whole tile (read
// once, not per chunk). qa0: the block's first q' | q_rope row (RW floats a head).
template <int NK, int KP, int RW, bool K_WHOLE>
__device__ __forceinline__ void load_qprime(uint32_t (*qf)[4], const float* qa0, int ht, int kp, int lane) {
#pragma unroll
  for (int i = 0; i < NK; ++i) {
    const int k0 = (kp + i * KP) * 8;
    const float* qk = qa0 + size_t(ht * 16) * RW + k0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      qf[i][e] = (K_WHOLE || k0 < RW) ? tf32_bits(qk[size_t(frag_a_row(lane, e)) * RW + frag_k_paired(frag_a_col(lane, e))]) : 0u;
    }
  }
}

// A tile's partial combine into pacc: the C fragments acc[t16][ct] of warp sg (head tiles t16,
// column tiles sg * NCT + ct) of head block hb; rows past H (padding heads) are not written.
template <int HTL, int NCT, int R, bool COLS_WHOLE>
__device__ __forceinline__ void write_partial_rows(const float (*acc)[NCT][4], float* pacc, int q, int H, int HT, int hb,
                                                   int NT, int tile, int sg, int lane) {
#pragma unroll
  for (int t16 = 0; t16 < HTL; ++t16) {
#pragma unroll
    for (int ct = 0; ct < NCT; ++ct) {
      const int col0 = (sg * NCT + ct) * 8;
      if (COLS_WHOLE || col0 < R) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int h = hb * HT + t16 * 16 + frag_c_row(lane, i);
          if (h < H) {
            pacc[mla_part(q, H, h, NT, tile) * R + col0 + frag_c_col(lane, i)] = acc[t16][ct][i];
          }
        }
      }
    }
  }
}

// ---- mla_attn_wide: 16-bit cache chunks staged raw by cp.async, fragments by ldmatrix ----
// 16 bytes global -> shared without registers; src_bytes 0 writes 16 zero bytes (past the tile).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
// Four 8x8 matrices of 16-bit values; lanes 8m .. 8m + 7 give the 16-byte row addresses of
// matrix m. r[m] holds lane (g, t)'s pair of matrix m: row g, columns 2t and 2t + 1 (low half
// first); transposed: rows 2t and 2t + 1 of column g.
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* row) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* row) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}
// A pair of 16-bit cache values (low half first) as two TF32 operands, exactly (bf16 and f16
// values have at most TF32's 10 mantissa bits); the pointer argument only selects the type.
__device__ __forceinline__ void pair_tf32(uint32_t w, uint32_t* b, const __nv_bfloat16*) {
  b[0] = w << 16;
  b[1] = w & 0xFFFF0000u;
}
__device__ __forceinline__ void pair_tf32(uint32_t w, uint32_t* b, const __half*) {
  const float2 f = __half22float2(colibri_qd::as_half2(w));
  b[0] = __float_as_uint(f.x);
  b[1] = __float_as_uint(f.y);
}

// One decode row of mla_rows: q_a and the latent normalized, the rope key rotated at `position`
// (as MLX's rms_norm / rope compute them; CUDA's rope uses cos / sin). The q_a part goes to
// qa_row, the cache row (latent, then rope key) to kv_row (if write_kv): mla_rows' output, or
// (mla_rows_into) the cache's own buffer at the row's slot.
template <typename T, int NSG>
__device__ __forceinline__ void norm_rope_row(const T* row, const T* qnorm, const T* knorm, const float* invf,
                                              float position, int QL, int R, int rope, float eps_q,
                                              float eps_l, T* qa_row, T* kv_row, bool write_kv, float* sums) {
  const int tid = int(threadIdx.x);
  const int sg = int(threadIdx.x >> 5);
  const int lane = int(threadIdx.x & 31);
  float sq = 0.0f;                             // sums of squares: q_a part, latent part
  float sl = 0.0f;
  for (int c = tid; c < QL; c += NSG * 32) {
    const float x = static_cast<float>(row[c]);
    sq += x * x;
  }
  for (int c = tid; c < R; c += NSG * 32) {
    const float x = static_cast<float>(row[QL + c]);
    sl += x * x;
  }
  sq = warp_sum(sq);
  sl = warp_sum(sl);
  if (lane == 0) {
    sums[sg] = sq;
    sums[NSG + sg] = sl;
  }
  __syncthreads();
  sq = 0.0f;
  sl = 0.0f;
  for (int g = 0; g < NSG; ++g) {
    sq += sums[g];
    sl += sums[NSG + g];
  }
  const float iq = rsqrtf(sq / float(QL) + eps_q);
  const float il = rsqrtf(sl / float(R) + eps_l);
  for (int c = tid; c < QL; c += NSG * 32) {
    qa_row[c] = static_cast<T>(static_cast<float>(qnorm[c]) *
                               static_cast<float>(static_cast<T>(static_cast<float>(row[c]) * iq)));
  }
  for (int c = tid; c < (write_kv ? R : 0); c += NSG * 32) {
    kv_row[c] = static_cast<T>(static_cast<float>(knorm[c]) *
                               static_cast<float>(static_cast<T>(static_cast<float>(row[QL + c]) * il)));
  }
  const int half = rope / 2;
  for (int j = tid; j < (write_kv ? half : 0); j += NSG * 32) {
    const float theta = position * invf[j];
    const float cs = cosf(theta);
    const float sn = sinf(theta);
    const float x1 = static_cast<float>(row[QL + R + j]);
    const float x2 = static_cast<float>(row[QL + R + j + half]);
    kv_row[R + j] = static_cast<T>(x1 * cs - x2 * sn);
    kv_row[R + j + half] = static_cast<T>(x1 * sn + x2 * cs);
  }
}

// ---- mla_qabs / mla_qb_qabs: q' = W_UK^h^T q_nope over a part's kv_b units, and q_rope ----

// q' of head h over kv_b units u0 .. u0 + UPP - 1 (the latent columns they hold) into qrow
// [0, R), from the head's nope values qh[0 .. nope) (the q_b GEMV's q_nope, or mla_qb_qabs'
// rows in shared memory). RU rows a lane per step, all their loads (units, scales, q) issued
// before any math: one row at a time is a chain of dependent global-load latencies, the bytes
// themselves are few. red: NSG * NU * LW * WPU floats of shared memory.
template <int FMT, int GS, int VEC, int NSG, int LW, int NU, int RU, int UPP, typename QP>
__device__ __forceinline__ void qabs_columns(QP qh, const uint8_t* w, const float* scales, const uint32_t* e8grid,
                                             int h, int nope, int v, int R, int rb, int ng, int n_units, int u0,
                                             float* red, float* qrow) {
  constexpr int WPU = colibri_qd::wpu(FMT);
  constexpr int SEG = colibri_qd::seg(FMT, GS);
  constexpr int NSEG = WPU / SEG;
  constexpr int RPS = 32 / LW;                 // rows side by side in a warp
  const int sg = int(threadIdx.x >> 5);
  const int lane = int(threadIdx.x & 31);
  const int tid = int(threadIdx.x);
  const int sub = lane / LW;                   // which of the RPS rows; lanes ul own units
  const int ul = lane % LW;
  float acc[NU * WPU];
  #pragma unroll
  for (int k = 0; k < NU * WPU; ++k) {
    acc[k] = 0.0f;
  }
  for (int n0 = 0; n0 < nope; n0 += NSG * RPS * RU) {
    uint32_t raw[RU][NU][colibri_qd::words(FMT)];
    float scl[RU][NU][NSEG];                   // fmt 4/5 segment scales
    float xq[RU];
    #pragma unroll
    for (int i = 0; i < RU; ++i) {
      const int n = n0 + (i * NSG + sg) * RPS + sub;
      const int row = h * (nope + v) + min(n, nope - 1);
      xq[i] = n < nope ? static_cast<float>(qh[n]) * colibri_qd::row_scale<FMT>(scales, row) : 0.0f;
      #pragma unroll
      for (int j = 0; j < NU; ++j) {
        const int u = u0 + ul + LW * j;
        if (n < nope && ul + LW * j < UPP && u < n_units) {
          colibri_qd::load<FMT, VEC, false>(w + size_t(row) * size_t(rb), rb, u, raw[i][j]);
          colibri_qd::load_aux<FMT, GS>(scales, row, ng, u, raw[i][j]);
          #pragma unroll
          for (int g = 0; g < NSEG; ++g) {
            scl[i][j][g] = colibri_qd::scales_in_memory(FMT) ? colibri_qd::seg_scale<FMT, GS>(scales, row, ng, u, g, raw[i][j]) : 1.0f;
          }
        }
      }
    }
    #pragma unroll
    for (int i = 0; i < RU; ++i) {
      const int n = n0 + (i * NSG + sg) * RPS + sub;
      const int row = h * (nope + v) + min(n, nope - 1);
      #pragma unroll
      for (int j = 0; j < NU; ++j) {
        const int u = u0 + ul + LW * j;
        if (n < nope && ul + LW * j < UPP && u < n_units) {
          #pragma unroll
          for (int g = 0; g < NSEG; ++g) {
            const float sc = colibri_qd::scales_in_memory(FMT) ? scl[i][j][g] : colibri_qd::seg_scale<FMT, GS>(scales, row, ng, u, g, raw[i][j]);
            const float us = sc * xq[i];
            #pragma unroll
            for (int c = 0; c < SEG; c += 8) {
              float wq[8];
              colibri_qd::decode8<FMT>(raw[i][j], SEG * g + c, e8grid, wq);
              #pragma unroll
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
  #pragma unroll
  for (int s = 16; s >= LW; s >>= 1) {
    #pragma unroll
    for (int k = 0; k < NU * WPU; ++k) {
      acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], s);
    }
  }
  #pragma unroll
  for (int j = 0; j < NU; ++j) {
    const int u = u0 + ul + LW * j;
    if (sub == 0 && ul + LW * j < UPP && u < n_units) {
      #pragma unroll
      for (int k = 0; k < WPU; ++k) {
        red[(sg * NU * LW + u - u0) * WPU + k] = acc[j * WPU + k];
      }
    }
  }
  __syncthreads();
  const int c1 = min(R, (u0 + UPP) * WPU);     // this part's columns: u0 * WPU .. c1 - 1
  for (int c = u0 * WPU + tid; c < c1; c += NSG * 32) {
    float s = 0.0f;
    #pragma unroll
    for (int g = 0; g < NSG; ++g) {
      s += red[g * NU * LW * WPU + c - u0 * WPU];
    }
    qrow[c] = s;
  }
}

// q_rope (width values qr[0 .. width)) as float beside q'; ROPEQ 1: rotated here (half-split,
// at position, inv_freq invf) and rounded to q's dtype TQ (see the .metal file).
template <int ROPEQ, typename TQ, int NSG, typename RP>
__device__ __forceinline__ void qabs_rope(RP qr, float* qa_rope, int width, float position, const float* invf) {
  const int tid = int(threadIdx.x);
  if (ROPEQ) {
    const int half = width / 2;
    for (int j = tid; j < half; j += NSG * 32) {
      const float theta = position * invf[j];
      const float cs = cosf(theta);
      const float sn = sinf(theta);
      const float x1 = static_cast<float>(qr[j]);
      const float x2 = static_cast<float>(qr[j + half]);
      qa_rope[j] = static_cast<float>(static_cast<TQ>(x1 * cs - x2 * sn));
      qa_rope[j + half] = static_cast<float>(static_cast<TQ>(x1 * sn + x2 * cs));
    }
  } else {
    for (int c = tid; c < width; c += NSG * 32) {
      qa_rope[c] = static_cast<float>(qr[c]);
    }
  }
}

// mla_attn_mma's padding heads (h >= H): q' and q_rope zero, written by `writer` blocks. True
// for a padding head (the block has nothing else to do).
template <int NSG>
__device__ __forceinline__ bool padding_head(float* qrow, int h, int H, int QW, bool writer) {
  if (h < H) {
    return false;
  }
  for (int c = int(threadIdx.x); writer && c < QW; c += NSG * 32) {
    qrow[c] = 0.0f;
  }
  return true;
}

// mla_qb_qabs' first phase: head h's q_b rows (its nope rows h * nope + n, then its rope rows
// H * nope + h * rope + j: the model's [all nope | all rope] row order) against the q_a row x,
// each rounded to TQ as the q_b GEMV writes it, into qsh[0 .. nope + rope). QR rows a warp
// pass, lanes over the units (NUB a lane, every load issued before any math); fmt 1-3 row
// scales after the lane sum, fmt 4/5 segment scales loaded with the weights (qgemv's rules).
template <int FMT, int GS, int VEC, bool W16, int XV, int NIB, int NSG, int QR, int NUB, typename TQ>
__device__ __forceinline__ void qb_head_rows(const TQ* x, const uint8_t* wqb, const float* sqb,
                                             const uint32_t* e8grid, int h, int H, int nope, int rope, int I,
                                             int rb, int ng, int n_units, float* qsh) {
  constexpr int W = colibri_qd::words(FMT);
  constexpr int NSEG = colibri_qd::wpu(FMT) / colibri_qd::seg(FMT, GS);
  const int sg = int(threadIdx.x >> 5);
  const int lane = int(threadIdx.x & 31);
  const int nq = nope + rope;
  const int xoff[1] = {0};
  for (int r0 = sg * QR; r0 < nq; r0 += NSG * QR) {
    int rows[QR];
    #pragma unroll
    for (int r = 0; r < QR; ++r) {
      const int n = min(r0 + r, nq - 1);
      rows[r] = n < nope ? h * nope + n : H * nope + h * rope + (n - nope);
    }
    uint32_t raw[NUB][QR][W];
    float scl[NUB][QR][NSEG];
    #pragma unroll
    for (int j = 0; j < NUB; ++j) {
      const int u = lane + 32 * j;
      if (u < n_units) {
        #pragma unroll
        for (int r = 0; r < QR; ++r) {
          colibri_qd::load<FMT, VEC, W16>(wqb + size_t(rows[r]) * size_t(rb), rb, u, raw[j][r]);
          colibri_qd::load_aux<FMT, GS>(sqb, rows[r], ng, u, raw[j][r]);
          #pragma unroll
          for (int g = 0; g < NSEG; ++g) {
            scl[j][r][g] = colibri_qd::scales_in_memory(FMT) ? colibri_qd::seg_scale<FMT, GS>(sqb, rows[r], ng, u, g, raw[j][r]) : 1.0f;
          }
        }
      }
    }
    float acc[QR][1];
    #pragma unroll
    for (int r = 0; r < QR; ++r) {
      acc[r][0] = 0.0f;
    }
    #pragma unroll
    for (int j = 0; j < NUB; ++j) {
      const int u = lane + 32 * j;
      if (u < n_units) {
        #pragma unroll
        for (int g = 0; g < NSEG; ++g) {
          float d[QR][1];
          colibri_qd::seg_dots<FMT, GS, 1, QR, XV, W, TQ, NIB>(raw[j], x, xoff, 1u, I, u, g, e8grid, d);
          #pragma unroll
          for (int r = 0; r < QR; ++r) {
            const float sc = colibri_qd::scales_in_memory(FMT) ? scl[j][r][g] : colibri_qd::seg_scale<FMT, GS>(sqb, rows[r], ng, u, g, raw[j][r]);
            acc[r][0] += d[r][0] * sc;
          }
        }
      }
    }
    #pragma unroll
    for (int r = 0; r < QR; ++r) {
      const float t = warp_sum(acc[r][0]);
      if (lane == r && r0 + r < nq) {
        qsh[r0 + r] = static_cast<float>(static_cast<TQ>(t * colibri_qd::row_scale<FMT>(sqb, rows[r])));
      }
    }
  }
}

}  // namespace colibri_mla


// ==== kernel body: mla_qabs ====
  constexpr int WPU = colibri_qd::wpu(FMT);
  __shared__ float red[NSG * NU * LW * WPU];
  const int H = params[0];
  const int nope = params[1];
  const int h = int(blockIdx.y);
  const int q = int(blockIdx.z);
  const int Hp = params[15];
  const int R = params[3];
  const int QW = R + params[4];                // a q row: q' (R), then q_rope (rope)
  // Column part cp of the head: kv_b units u0 .. u0 + UPP - 1 (the columns they hold); part 0
  // also writes q_rope. Parts x heads threadgroups instead of one a head (see mla.py).
  const int cp = int(blockIdx.x);
  float* qrow = qabs + (size_t(q) * Hp + h) * QW;
  if (colibri_mla::padding_head<NSG>(qrow, h, H, QW, cp == 0)) {
    return;
  }
  colibri_mla::qabs_columns<FMT, GS, VEC, NSG, LW, NU, RU, UPP>(qn + (size_t(q) * H + h) * nope, w, scales, e8grid, h,
                                                               nope, params[2], R, params[10], params[11],
                                                               params[12], cp * UPP, red, qrow);
  if (cp == 0) {
    colibri_mla::qabs_rope<ROPEQ, TQ, NSG>(qrope + (size_t(q) * H + h) * (QW - R), qrow + R, QW - R,
                                           ROPEQ ? static_cast<float>(qpos[q]) : 0.0f, invf);
  }
// ==== kernel body: mla_qb_qabs ====
  // mla_qabs with the q_b projection folded in (decode rows, mla.py): this head's q_nope and
  // q_rope rows of q_b against the q_a row first (qb_head_rows, into shared memory), then q'
  // over all of kv_b's units (one threadgroup a head) and q_rope, as mla_qabs. One launch and
  // q's round trip through memory fewer than q_b's GEMV followed by mla_qabs.
  constexpr int WPU = colibri_qd::wpu(FMT);
  __shared__ float red[NSG * NU * LW * WPU];
  __shared__ float qsh[QMAX];                  // this head's q_nope, then q_rope (rounded to TQ)
  const int H = params[0];
  const int nope = params[1];
  const int h = int(blockIdx.y);
  const int q = int(blockIdx.z);
  const int Hp = params[15];
  const int R = params[3];
  const int rope = params[4];
  const int QW = R + rope;
  float* qrow = qabs + (size_t(q) * Hp + h) * QW;
  if (colibri_mla::padding_head<NSG>(qrow, h, H, QW, true)) {
    return;
  }
  const int Ib = qbp[0];
  const TQ* xq = qa + size_t(q) * Ib;
  const uint8_t* wqb8 = reinterpret_cast<const uint8_t*>(wqb);
  if ((reinterpret_cast<uintptr_t>(wqb8) & 15) == 0 && (reinterpret_cast<uintptr_t>(xq) & 15) == 0) {
    colibri_mla::qb_head_rows<FMTB, GSB, VECB, true, XVB, NIB, NSG, QR, NUB, TQ>(
        xq, wqb8, sqb, e8grid, h, H, nope, rope, Ib, qbp[2], qbp[3], qbp[4], qsh);
  } else {
    colibri_mla::qb_head_rows<FMTB, GSB, VECB, false, 0, NIB, NSG, QR, NUB, TQ>(
        xq, wqb8, sqb, e8grid, h, H, nope, rope, Ib, qbp[2], qbp[3], qbp[4], qsh);
  }
  __syncthreads();
  colibri_mla::qabs_columns<FMT, GS, VEC, NSG, LW, NU, RU, UPP>(static_cast<const float*>(qsh), w, scales, e8grid,
                                                               h, nope, params[2], R, params[10], params[11],
                                                               params[12], 0, red, qrow);
  colibri_mla::qabs_rope<ROPEQ, TQ, NSG>(static_cast<const float*>(qsh + nope), qrow + R, rope,
                                         ROPEQ ? static_cast<float>(qpos[q]) : 0.0f, invf);
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
  const colibri_mla::MlaCacheRows cache = colibri_mla::mla_cache_rows(params[16], R, rope);
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
    const float* qa_h = qabs + (size_t(q) * H + hh) * (R + rope);
    const float* qr_h = qa_h + R;
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
          val = static_cast<float>(latent[(size_t(b) * T + t) * cache.ls + col]);
        } else if (col >= CJ * 32 && col - CJ * 32 < rope) {
          val = static_cast<float>(krope[(size_t(b) * T + t) * cache.ks + cache.rope0 + col - CJ * 32]);
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
// ==== kernel body: mla_attn_mma ====
  constexpr int C = colibri_mla::mla_chunk();  // positions per chunk: the mma's N (scores), K (combine)
  constexpr int RWS = RW + colibri_mla::mla_stage_pad();  // staged position: R + rope columns, pad
  constexpr int HTL = HT / 16;                 // 16-head tiles: one m16 fragment each
  constexpr int KP = NSG / HTL;                // scores: warps (k-parts) per head tile
  constexpr int UPP = RW / 8;                  // 8-value units per staged position
  constexpr int NLU = (C * UPP + NSG * 32 - 1) / (NSG * 32);  // staged units per thread
  constexpr int NK = (UPP + KP - 1) / KP;      // scores: k-steps per k-part
  static_assert(C == 8, "the chunk is one n8 / k8 fragment");
  static_assert(HT * C == NSG * 32, "one softmax thread per (head, position) of a chunk");
  static_assert(HT % 16 == 0 && NSG % HTL == 0, "warps = head tiles x k-parts");
  static_assert(RW % 8 == 0, "k8 steps over the latent and rope columns");
  // Whole tiles (DeepSeek-V3: 576 columns = 4 k-parts x 18 k-steps x 8, 512 latent columns =
  // 8 warps x 8 column tiles x 8) need no per-step column test: straight-line mma sequences.
  constexpr bool K_WHOLE = NK * KP == UPP;
  constexpr bool COLS_WHOLE = NSG * NCT * 8 == RL;
  static_assert(NSG * NCT * 8 >= RL, "column tiles cover the latent width");
  __shared__ __align__(16) float lat_s[C * RWS];   // TF32-rounded
  __shared__ __align__(8) float sc_s[KP * HT * C];   // partial scores of each k-part
  __shared__ float p_s[HT * C];                // the chunk's softmax weights P[head][position]
  __shared__ float alpha_s[HT];                // the chunk's rescale per head
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
  const colibri_mla::MlaCacheRows cache = colibri_mla::mla_cache_rows(params[16], R, rope);
  const int tid = int(threadIdx.x);
  const int lane = int(threadIdx.x & 31);
  const int sg = int(threadIdx.x >> 5);
  const int hb = int(blockIdx.x);
  const int tile = int(blockIdx.y);
  const int q = int(blockIdx.z);
  const int b = q / L;
  const int p0 = tile * TT;
  const int p1 = min(P, p0 + TT);
  const int ht = sg % HTL;                     // scores: this warp's head tile
  const int kp = sg / HTL;                     // and k-part (k-steps kp, kp + KP, ...)
  const int hs = tid / C;                      // softmax thread: head hs of the block,
  const int cs = tid % C;                      // position cs of the chunk
  const float* qa0 = qabs + (size_t(q) * Hp + hb * HT) * RW;   // q' | q_rope rows
  float m = colibri_mla::neg_inf();            // running max / sum of head hs (8 lanes agree)
  float l = 0.0f;
  float acc[HTL][NCT][4];                      // O[ht * 16.., (sg * NCT + ct) * 8..], C fragments
  #pragma unroll
  for (int t16 = 0; t16 < HTL; ++t16) {
    #pragma unroll
    for (int ct = 0; ct < NCT; ++ct) {
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[t16][ct][i] = 0.0f;
      }
    }
  }
  // The chunk's units in flight: raw cache words, or zero past the tile (weight 0, no NaN).
  uint4 raw[NLU][2];
  // This thread's staged units, the same every chunk: position c of the chunk, where the unit's
  // row of the cache starts (latent or rope columns) and its row stride, and where it is staged.
  int unit_c[NLU];
  int unit_stride[NLU];
  int unit_dst[NLU];
  const TC* unit_src[NLU];
  #pragma unroll
  for (int j = 0; j < NLU; ++j) {
    const int u = tid + j * NSG * 32;
    const int c = u / UPP;
    const int col = (u - c * UPP) * 8;
    unit_c[j] = u < C * UPP ? c : C;             // C: no unit (past the chunk's units)
    unit_stride[j] = col < R ? cache.ls : cache.ks;
    unit_src[j] = col < R ? latent + size_t(b) * T * cache.ls + col : krope + size_t(b) * T * cache.ks + cache.rope0 + (col - R);
    unit_dst[j] = c * RWS + (u - c * UPP) * 8;
  }
  uint32_t qf[NK][4];                          // A = Q': (head, k), TF32, k slots paired
  colibri_mla::load_qprime<NK, KP, RW, K_WHOLE>(qf, qa0, ht, kp, lane);
  for (int c0 = p0 - C; c0 < p1; c0 += C) {
    // Iteration c0 multiplies chunk c0 while chunk c0 + C is in flight (c0 = p0 - C: only loads).
    float* const chunk = lat_s;
    if (c0 >= p0) {
      __syncthreads();   // the previous chunk is consumed
      #pragma unroll
      for (int j = 0; j < NLU; ++j) {
        if ((j + 1) * NSG * 32 <= C * UPP || unit_c[j] < C) {
          float f[8];
          colibri_qd::widen8(raw[j], f, latent);
          if (sizeof(TC) == 4) {               // bf16 / f16 values are TF32 values already
            #pragma unroll
            for (int k = 0; k < 8; ++k) {
              f[k] = colibri_mla::tf32_round(f[k]);
            }
          }
          float4* dst = reinterpret_cast<float4*>(chunk + unit_dst[j]);
          dst[0] = make_float4(f[0], f[1], f[2], f[3]);
          dst[1] = make_float4(f[4], f[5], f[6], f[7]);
        }
      }
    }
    const int cn = c0 + C;                     // the chunk to load next
    if (cn < p1) {
      #pragma unroll
      for (int j = 0; j < NLU; ++j) {
        raw[j][0] = raw[j][1] = make_uint4(0u, 0u, 0u, 0u);
        if (cn + unit_c[j] < p1 && unit_c[j] < C) {
          const int t = colibri_mla::mla_position(sel, has_sel, q, P, cn + unit_c[j]);
          colibri_qd::load8_raw(unit_src[j] + size_t(t) * unit_stride[j], raw[j]);
        }
      }
    }
    if (c0 < p0) {
      continue;
    }
    __syncthreads();
    // S[16 heads of tile ht] over this k-part = Q' . chunk^T (latent k-steps, then rope)
    // Two accumulators (even / odd k-steps): two dependent mma chains of NK / 2 instead of one of NK.
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    // B = chunk^T (k, n = position): slots t and t + 4 are columns 2t, 2t + 1 (frag_k_paired)
    const float* kb = chunk + colibri_mla::frag_b_n(lane) * RWS + kp * 8 + colibri_mla::frag_k_paired(colibri_mla::frag_b_k(lane, 0));
    #pragma unroll
    for (int i = 0; i < NK; ++i) {
      const int k0 = (kp + i * KP) * 8;
      if (K_WHOLE || k0 < RW) {
        const float2 kv = *reinterpret_cast<const float2*>(kb + i * KP * 8);
        const uint32_t kf[2] = {__float_as_uint(kv.x), __float_as_uint(kv.y)};
        colibri_mla::mma_tf32(s[i & 1], qf[i], kf);
      }
    }
    #pragma unroll
    for (int i = 0; i < 4; i += 2) {           // columns 2t, 2t + 1 of rows g and g + 8
      *reinterpret_cast<float2*>(sc_s + (kp * HT + ht * 16 + colibri_mla::frag_c_row(lane, i)) * C + colibri_mla::frag_c_col(lane, i)) =
          make_float2(s[0][i] + s[1][i], s[0][i + 1] + s[1][i + 1]);
    }
    __syncthreads();
    {
      float dot = 0.0f;
      #pragma unroll
      for (int g = 0; g < KP; ++g) {
        dot += sc_s[(g * HT + hs) * C + cs];
      }
      int keep = -1;                           // 1 keep, 0 masked (-1e30), -1 past the tile
      if (c0 + cs < p1) {
        const int t = colibri_mla::mla_position(sel, has_sel, q, P, c0 + cs);
        keep = (has_mask == 2 ? t <= P - L + q % L : !has_mask || mask[size_t(q) * T + t] != 0) ? 1 : 0;
      }
      const float sv = keep > 0 ? dot * scale : (keep == 0 ? -1e30f : colibri_mla::neg_inf());
      float cmax = max(sv, __shfl_xor_sync(0xffffffffu, sv, 1));
      cmax = max(cmax, __shfl_xor_sync(0xffffffffu, cmax, 2));
      cmax = max(cmax, __shfl_xor_sync(0xffffffffu, cmax, 4));
      const float m_new = max(m, cmax);
      const float alpha = expf(m - m_new);
      const float pw = keep >= 0 ? expf(sv - m_new) : 0.0f;
      float psum = pw + __shfl_xor_sync(0xffffffffu, pw, 1);
      psum += __shfl_xor_sync(0xffffffffu, psum, 2);
      psum += __shfl_xor_sync(0xffffffffu, psum, 4);
      m = m_new;
      l = l * alpha + psum;
      p_s[hs * C + cs] = pw;
      if (cs == 0) {
        alpha_s[hs] = alpha;
      }
    }
    __syncthreads();
    // O = diag(alpha) O + P . chunk on this warp's column tiles, all heads: each column tile of
    // the chunk is loaded once for every head tile.
    uint32_t pf[HTL][4];                       // A = P: (head, position)
    float al[HTL][4];                          // alpha of each C fragment element's row
    bool rescale[HTL];
    #pragma unroll
    for (int t16 = 0; t16 < HTL; ++t16) {
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        pf[t16][i] = colibri_mla::tf32_bits(p_s[(t16 * 16 + colibri_mla::frag_a_row(lane, i)) * C + colibri_mla::frag_a_col(lane, i)]);
        al[t16][i] = alpha_s[t16 * 16 + colibri_mla::frag_c_row(lane, i)];
      }
      // Once the running max settles, alpha is exactly 1 for every head: skip the rescale.
      rescale[t16] = __any_sync(0xffffffffu, al[t16][0] != 1.0f || al[t16][1] != 1.0f || al[t16][2] != 1.0f || al[t16][3] != 1.0f);
    }
    #pragma unroll
    for (int ct = 0; ct < NCT; ++ct) {
      const int col0 = (sg * NCT + ct) * 8;
      if (COLS_WHOLE || col0 < R) {
        uint32_t lf[2];                        // B = chunk: (k = position, n = column)
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
          lf[i] = __float_as_uint(chunk[colibri_mla::frag_b_k(lane, i) * RWS + col0 + colibri_mla::frag_b_n(lane)]);
        }
        #pragma unroll
        for (int t16 = 0; t16 < HTL; ++t16) {
          if (rescale[t16]) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
              acc[t16][ct][i] *= al[t16][i];
            }
          }
          colibri_mla::mma_tf32(acc[t16][ct], pf[t16], lf);
        }
      }
    }
  }
  colibri_mla::write_partial_rows<HTL, NCT, R, COLS_WHOLE>(acc, pacc, q, H, HT, hb, NT, tile, sg, lane);
  if (cs == 0 && hb * HT + hs < H) {
    const size_t part = colibri_mla::mla_part(q, H, hb * HT + hs, NT, tile);
    pml[2 * part] = m;
    pml[2 * part + 1] = l;
  }
// ==== kernel body: mla_attn_wide ====
  // mla_attn_mma's algorithm (head tiles x k-parts for the scores, column tiles for the combine,
  // TF32 q' and P, online softmax a chunk) on chunks of CK positions of a 16-bit cache staged
  // raw: cp.async copies the next chunk into the other of two buffers (no registers, no
  // conversion) while this one is multiplied, and ldmatrix reads the fragments (bf16 / f16
  // values are TF32 values: two shifts or two conversions a pair). Chunks of 32 make a barrier
  // and a softmax step a quarter as frequent as mla_attn_mma's 8 per position.
  constexpr int RWS = RW + 8;                  // staged row: R + rope 16-bit values, 16 bytes pad
  constexpr int PS = CK + 8;                   // score / weight row stride (floats): 8 mod 32 banks
  constexpr int HTL = HT / 16;                 // 16-head tiles: one m16 fragment each
  constexpr int KP = NSG / HTL;                // scores: warps (k-parts) per head tile
  constexpr int UPP = RW / 8;                  // 16-byte units (8 values) per staged position
  constexpr int RPW = CK / NSG;                // staged rows per warp
  constexpr int NK = (UPP + KP - 1) / KP;      // scores: k-steps per k-part
  constexpr int NPT = CK / 8;                  // n8 position tiles (scores) = k8 steps (combine)
  constexpr int PPT = HT * CK / (NSG * 32);    // softmax: positions per thread
  static_assert(sizeof(TC) == 2, "a 16-bit cache (bf16 / f16)");
  static_assert(CK == 32, "a chunk is 32 positions: one ldmatrix x4 of rows, 4 k8 steps");
  static_assert(CK % NSG == 0, "whole rows a warp");
  static_assert(PPT == 4 && HT * 8 == NSG * 32, "8 softmax threads per head, 4 positions each");
  static_assert(HT % 16 == 0 && NSG % HTL == 0, "warps = head tiles x k-parts");
  static_assert(RW % 8 == 0 && (RWS * 2) % 16 == 0 && ((RWS * 2 / 16) & 1) == 1,
                "16-byte rows at an odd 16-byte stride: ldmatrix conflict-free");
  constexpr bool K_WHOLE = NK * KP == UPP;
  constexpr bool COLS_WHOLE = NSG * NCT * 8 == RL;
  static_assert(NSG * NCT * 8 >= RL, "column tiles cover the latent width");
  // Dynamic shared memory (MLX sets the attribute above 48 KB): two chunk buffers, the k-parts'
  // partial scores, the chunk's weights P and its rescale per head.
  extern __shared__ __align__(16) unsigned char mla_wide_smem[];
  TC* const chunks = reinterpret_cast<TC*>(mla_wide_smem);
  float* const sc_s = reinterpret_cast<float*>(mla_wide_smem + 2 * CK * RWS * sizeof(TC));
  float* const p_s = sc_s + KP * HT * PS;
  float* const alpha_s = p_s + HT * PS;
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
  const colibri_mla::MlaCacheRows cache = colibri_mla::mla_cache_rows(params[16], R, rope);
  const int tid = int(threadIdx.x);
  const int lane = int(threadIdx.x & 31);
  const int sg = int(threadIdx.x >> 5);
  const int hb = int(blockIdx.x);
  const int tile = int(blockIdx.y);
  const int q = int(blockIdx.z);
  const int b = q / L;
  const int p0 = tile * TT;
  const int p1 = min(P, p0 + TT);
  const int nch = p1 > p0 ? (p1 - p0 + CK - 1) / CK : 0;
  const int ht = sg % HTL;                     // scores: this warp's head tile
  const int kp = sg / HTL;                     // and k-part (k-steps kp, kp + KP, ...)
  const int hs = tid / 8;                      // softmax thread: head hs of the block,
  const int cs = (tid % 8) * PPT;              // positions cs .. cs + 3 of the chunk
  const float* qa0 = qabs + (size_t(q) * Hp + hb * HT) * RW;   // q' | q_rope rows
  const TC* lat0 = latent + size_t(b) * T * cache.ls;
  const TC* rope0 = krope + size_t(b) * T * cache.ks + cache.rope0;
  float m = colibri_mla::neg_inf();            // running max / sum of head hs (8 lanes agree)
  float l = 0.0f;
  float acc[HTL][NCT][4];                      // O[ht * 16.., (sg * NCT + ct) * 8..], C fragments
  #pragma unroll
  for (int t16 = 0; t16 < HTL; ++t16) {
    #pragma unroll
    for (int ct = 0; ct < NCT; ++ct) {
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[t16][ct][i] = 0.0f;
      }
    }
  }
  // Chunk ci into buffer ci & 1: warp sg stages rows sg * RPW .. (a row's 16-byte units over the
  // lanes: one contiguous read a step), so a thread keeps no per-unit addresses across chunks.
  // Positions past the tile are zero rows (weight 0, no NaN).
  auto stage = [&](int ci) {
    TC* const dst = chunks + (ci & 1) * CK * RWS;
    const int c0 = p0 + ci * CK;
    #pragma unroll
    for (int k = 0; k < RPW; ++k) {
      const int c = sg * RPW + k;
      const bool in = c0 + c < p1;
      const int t = in ? colibri_mla::mla_position(sel, has_sel, q, P, c0 + c) : 0;
      const TC* const lrow = lat0 + size_t(t) * cache.ls;
      const TC* const rrow = rope0 + size_t(t) * cache.ks;
      #pragma unroll
      for (int i = 0; i < (UPP + 31) / 32; ++i) {
        const int col = (lane + 32 * i) * 8;
        if ((i + 1) * 32 <= UPP || col < RW) {
          colibri_mla::cp_async16(dst + c * RWS + col, col < R ? lrow + col : rrow + (col - R), in ? 16 : 0);
        }
      }
    }
    colibri_mla::cp_async_commit();
  };
  uint32_t qf[NK][4];                          // A = Q': (head, k), TF32, k slots paired
  colibri_mla::load_qprime<NK, KP, RW, K_WHOLE>(qf, qa0, ht, kp, lane);
  if (nch > 0) {
    stage(0);
  }
  for (int ci = 0; ci < nch; ++ci) {
    colibri_mla::cp_async_wait_all();
    __syncthreads();                           // chunk ci landed; chunk ci - 1 is consumed
    if (ci + 1 < nch) {
      stage(ci + 1);                           // in flight while chunk ci is multiplied
    }
    const TC* const chunk = chunks + (ci & 1) * CK * RWS;
    const int c0 = p0 + ci * CK;
    // S[16 heads of tile ht][32 positions] over this k-part = Q' . chunk^T. ldmatrix row r of
    // matrix m is position 8m + r = lane: r[nt] is the (k8 step, n8 tile nt) B fragment, its
    // pair of columns 2t, 2t + 1 the paired slots t, t + 4.
    float s[NPT][4];
    #pragma unroll
    for (int nt = 0; nt < NPT; ++nt) {
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[nt][i] = 0.0f;
      }
    }
    const TC* const krow = chunk + lane * RWS + kp * 8;
    #pragma unroll
    for (int i = 0; i < NK; ++i) {
      if (K_WHOLE || (kp + i * KP) * 8 < RW) {
        uint32_t kr[4];
        colibri_mla::ldmatrix_x4(kr, krow + i * KP * 8);
        #pragma unroll
        for (int nt = 0; nt < NPT; ++nt) {
          uint32_t kf[2];
          colibri_mla::pair_tf32(kr[nt], kf, chunk);
          colibri_mla::mma_tf32(s[nt], qf[i], kf);
        }
      }
    }
    #pragma unroll
    for (int nt = 0; nt < NPT; ++nt) {
      #pragma unroll
      for (int i = 0; i < 4; i += 2) {         // columns 2t, 2t + 1 of rows g and g + 8
        *reinterpret_cast<float2*>(sc_s + (kp * HT + ht * 16 + colibri_mla::frag_c_row(lane, i)) * PS + nt * 8 + colibri_mla::frag_c_col(lane, i)) =
            make_float2(s[nt][i], s[nt][i + 1]);
      }
    }
    __syncthreads();
    {
      float4 dot = *reinterpret_cast<const float4*>(sc_s + hs * PS + cs);
      #pragma unroll
      for (int g = 1; g < KP; ++g) {
        const float4 d = *reinterpret_cast<const float4*>(sc_s + (g * HT + hs) * PS + cs);
        dot.x += d.x;
        dot.y += d.y;
        dot.z += d.z;
        dot.w += d.w;
      }
      const float dots[PPT] = {dot.x, dot.y, dot.z, dot.w};
      float sv[PPT];
      bool live[PPT];                          // inside the tile (masked positions count)
      float cmax = colibri_mla::neg_inf();
      #pragma unroll
      for (int k = 0; k < PPT; ++k) {
        live[k] = c0 + cs + k < p1;
        bool keep = live[k];
        if (live[k] && has_mask) {
          const int t = colibri_mla::mla_position(sel, has_sel, q, P, c0 + cs + k);
          keep = has_mask == 2 ? t <= P - L + q % L : mask[size_t(q) * T + t] != 0;
        }
        sv[k] = keep ? dots[k] * scale : (live[k] ? -1e30f : colibri_mla::neg_inf());
        cmax = max(cmax, sv[k]);
      }
      cmax = max(cmax, __shfl_xor_sync(0xffffffffu, cmax, 1));
      cmax = max(cmax, __shfl_xor_sync(0xffffffffu, cmax, 2));
      cmax = max(cmax, __shfl_xor_sync(0xffffffffu, cmax, 4));
      const float m_new = max(m, cmax);
      const float alpha = expf(m - m_new);
      float pw[PPT];
      float psum = 0.0f;
      #pragma unroll
      for (int k = 0; k < PPT; ++k) {
        pw[k] = live[k] ? expf(sv[k] - m_new) : 0.0f;
        psum += pw[k];
      }
      psum += __shfl_xor_sync(0xffffffffu, psum, 1);
      psum += __shfl_xor_sync(0xffffffffu, psum, 2);
      psum += __shfl_xor_sync(0xffffffffu, psum, 4);
      m = m_new;
      l = l * alpha + psum;
      *reinterpret_cast<float4*>(p_s + hs * PS + cs) = make_float4(pw[0], pw[1], pw[2], pw[3]);
      if (cs == 0) {
        alpha_s[hs] = alpha;
      }
    }
    __syncthreads();
    // O = diag(alpha) O + P . chunk on this warp's column tiles, all heads, a k8 step (8
    // positions) at a time: A = P (head, position), k slots paired: a[0], a[2] = P[g][8kk + 2t],
    // P[g][8kk + 2t + 1] (one float2); B from ldmatrix x4 trans over 4 column tiles (lanes 8m ..
    // 8m + 7: positions 8kk .. 8kk + 7 of column tile m), so one step's fragments are live.
    #pragma unroll
    for (int t16 = 0; t16 < HTL; ++t16) {
      float al[4];                             // alpha of each C fragment element's row
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        al[i] = alpha_s[t16 * 16 + colibri_mla::frag_c_row(lane, i)];
      }
      // Once the running max settles, alpha is exactly 1 for every head: skip the rescale.
      if (__any_sync(0xffffffffu, al[0] != 1.0f || al[1] != 1.0f || al[2] != 1.0f || al[3] != 1.0f)) {
        #pragma unroll
        for (int ct = 0; ct < NCT; ++ct) {
          #pragma unroll
          for (int i = 0; i < 4; ++i) {
            acc[t16][ct][i] *= al[i];
          }
        }
      }
    }
    #pragma unroll
    for (int kk = 0; kk < NPT; ++kk) {
      uint32_t pf[HTL][4];
      #pragma unroll
      for (int t16 = 0; t16 < HTL; ++t16) {
        #pragma unroll
        for (int r = 0; r < 2; ++r) {          // rows g, g + 8
          const float2 pv = *reinterpret_cast<const float2*>(p_s + (t16 * 16 + colibri_mla::frag_a_row(lane, r)) * PS + kk * 8 + 2 * (lane & 3));
          pf[t16][r] = colibri_mla::tf32_bits(pv.x);
          pf[t16][r + 2] = colibri_mla::tf32_bits(pv.y);
        }
      }
      const TC* const vrow = chunk + (kk * 8 + (lane & 7)) * RWS + (sg * NCT + (lane >> 3)) * 8;
      #pragma unroll
      for (int c4 = 0; c4 < NCT; c4 += 4) {
        uint32_t vr[4];                        // B = chunk (k = position, n = column): tiles c4 + m
        colibri_mla::ldmatrix_x4_trans(vr, vrow + c4 * 8);
        #pragma unroll
        for (int m4 = 0; m4 < 4; ++m4) {
          const int ct = c4 + m4;
          if (ct < NCT && (COLS_WHOLE || (sg * NCT + ct) * 8 < R)) {
            uint32_t vf[2];
            colibri_mla::pair_tf32(vr[m4], vf, chunk);
            #pragma unroll
            for (int t16 = 0; t16 < HTL; ++t16) {
              colibri_mla::mma_tf32(acc[t16][ct], pf[t16], vf);
            }
          }
        }
      }
    }
  }
  colibri_mla::write_partial_rows<HTL, NCT, R, COLS_WHOLE>(acc, pacc, q, H, HT, hb, NT, tile, sg, lane);
  if (cs == 0 && hb * HT + hs < H) {
    const size_t part = colibri_mla::mla_part(q, H, hb * HT + hs, NT, tile);
    pml[2 * part] = m;
    pml[2 * part + 1] = l;
  }
// ==== kernel body: mla_out ====
  constexpr int WPU = colibri_qd::wpu(FMT);
  constexpr int SEG = colibri_qd::seg(FMT, GS);
  constexpr int NSEG = WPU / SEG;
  constexpr int RPS = 32 / LW;                 // W_UV rows side by side in a warp
  constexpr int TPT = NTMAX / (NSG * 32);      // tiles per thread in the weight pass
  constexpr int CPT = (RMAX + NSG * 32 - 1) / (NSG * 32);   // context columns per thread
  // TU (template): tiles per batch of context loads, CPT x TU loads in flight a thread
  static_assert(NTMAX % (NSG * 32) == 0 && NTMAX % TU == 0, "whole weight passes and batches");
  __shared__ float ctx[RMAX];
  __shared__ float wt[NTMAX];                  // exp(m_t - max) of tile t; 0 past NT
  __shared__ float mx_s[NSG];
  __shared__ float den_s[NSG];
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
  const int sub = lane / LW;                   // which of the RPS rows; lanes ul own units
  const int ul = lane % LW;
  const size_t part0 = (size_t(q) * H + h) * NT;
  // Tile weights once per block (NT <= NTMAX, mla.py caps it): threads split the tiles, every
  // (m, l) load issued at once, max and denominator reduced across the block.
  float mt[TPT];
  float lt[TPT];
  #pragma unroll
  for (int k = 0; k < TPT; ++k) {
    const int t = tid + k * NSG * 32;
    mt[k] = t < NT ? pml[2 * (part0 + t)] : colibri_mla::neg_inf();
    lt[k] = t < NT ? pml[2 * (part0 + t) + 1] : 0.0f;
  }
  float mloc = mt[0];
  #pragma unroll
  for (int k = 1; k < TPT; ++k) {
    mloc = max(mloc, mt[k]);
  }
  mloc = colibri_mla::warp_max(mloc);
  if (lane == 0) {
    mx_s[sg] = mloc;
  }
  __syncthreads();
  float mx_ = mx_s[0];
  #pragma unroll
  for (int g = 1; g < NSG; ++g) {
    mx_ = max(mx_, mx_s[g]);
  }
  float dloc = 0.0f;
  #pragma unroll
  for (int k = 0; k < TPT; ++k) {
    const int t = tid + k * NSG * 32;
    const float e = t < NT ? expf(mt[k] - mx_) : 0.0f;
    wt[t] = e;
    dloc += e * lt[k];
  }
  dloc = colibri_mla::warp_sum(dloc);
  if (lane == 0) {
    den_s[sg] = dloc;
  }
  __syncthreads();
  float den = 0.0f;
  #pragma unroll
  for (int g = 0; g < NSG; ++g) {
    den += den_s[g];
  }
  // ctx[c] = sum_t w_t pacc[t][c] / den: CPT columns x TU tiles of loads in flight per batch.
  float s[CPT];
  #pragma unroll
  for (int j = 0; j < CPT; ++j) {
    s[j] = 0.0f;
  }
  for (int t0 = 0; t0 < NT; t0 += TU) {
    float pv[CPT][TU];
    #pragma unroll
    for (int j = 0; j < CPT; ++j) {
      const int c = tid + j * NSG * 32;
      #pragma unroll
      for (int k = 0; k < TU; ++k) {
        pv[j][k] = (c < R && t0 + k < NT) ? pacc[(part0 + t0 + k) * R + c] : 0.0f;
      }
    }
    #pragma unroll
    for (int j = 0; j < CPT; ++j) {
      #pragma unroll
      for (int k = 0; k < TU; ++k) {
        s[j] += wt[t0 + k] * pv[j][k];
      }
    }
  }
  #pragma unroll
  for (int j = 0; j < CPT; ++j) {
    const int c = tid + j * NSG * 32;
    if (c < RMAX) {
      ctx[c] = s[j] / den;                     // 0 past R: the last unit's padding weights
    }
  }
  __syncthreads();
  // W_UV rows RU a lane per step, all loads (units, scales) before the dot products.
  for (int v0 = 0; v0 < v; v0 += NSG * RPS * RU) {
    uint32_t raw[RU][NU][colibri_qd::words(FMT)];
    float scl[RU][NU][NSEG];                   // fmt 4/5 segment scales
    float rs[RU];                              // fmt 1-3 row scales
    #pragma unroll
    for (int i = 0; i < RU; ++i) {
      const int vi = v0 + (i * NSG + sg) * RPS + sub;
      const int row = h * (nope + v) + nope + min(vi, v - 1);
      rs[i] = colibri_qd::row_scale<FMT>(scales, row);
      #pragma unroll
      for (int j = 0; j < NU; ++j) {
        const int u = ul + LW * j;
        if (vi < v && u < n_units) {
          colibri_qd::load<FMT, VEC, false>(w + size_t(row) * size_t(rb), rb, u, raw[i][j]);
          colibri_qd::load_aux<FMT, GS>(scales, row, ng, u, raw[i][j]);
          #pragma unroll
          for (int g = 0; g < NSEG; ++g) {
            scl[i][j][g] = colibri_qd::scales_in_memory(FMT) ? colibri_qd::seg_scale<FMT, GS>(scales, row, ng, u, g, raw[i][j]) : 1.0f;
          }
        }
      }
    }
    float a[RU];
    #pragma unroll
    for (int i = 0; i < RU; ++i) {
      const int vi = v0 + (i * NSG + sg) * RPS + sub;
      const int row = h * (nope + v) + nope + min(vi, v - 1);
      a[i] = 0.0f;
      #pragma unroll
      for (int j = 0; j < NU; ++j) {
        const int u = ul + LW * j;
        if (vi < v && u < n_units) {
          #pragma unroll
          for (int g = 0; g < NSEG; ++g) {
            float d = 0.0f;
            #pragma unroll
            for (int c = 0; c < SEG; c += 8) {
              const int k0 = SEG * g + c;
              float wq[8];
              colibri_qd::decode8<FMT>(raw[i][j], k0, e8grid, wq);
              #pragma unroll
              for (int k = 0; k < 8; ++k) {
                d += wq[k] * ctx[u * WPU + k0 + k];
              }
            }
            a[i] += d * (colibri_qd::scales_in_memory(FMT) ? scl[i][j][g] : colibri_qd::seg_scale<FMT, GS>(scales, row, ng, u, g, raw[i][j]));
          }
        }
      }
    }
    // Sum over the LW lanes of each row (lane groups of LW are xor-closed).
    #pragma unroll
    for (int m = LW / 2; m >= 1; m >>= 1) {
      #pragma unroll
      for (int i = 0; i < RU; ++i) {
        a[i] += __shfl_xor_sync(0xffffffffu, a[i], m);
      }
    }
    #pragma unroll
    for (int i = 0; i < RU; ++i) {
      const int vi = v0 + (i * NSG + sg) * RPS + sub;
      if (ul == 0 && vi < v) {
        out[(size_t(q) * H + h) * v + vi] = static_cast<T>(a[i] * rs[i]);
      }
    }
  }
// ==== kernel body: mla_rows ====
  // The .metal kernel of that name: one block per decode row q of y (colibri_mla::norm_rope_row).
  __shared__ float sums[2 * NSG];
  const int QL = params[0];
  const int R = params[1];
  const int rope = params[2];
  const int q = int(blockIdx.z);
  colibri_mla::norm_rope_row<T, NSG>(y + size_t(q) * params[3], qnorm, knorm, invf, static_cast<float>(pos[q]),
                                     QL, R, rope, fparams[0], fparams[1], qa + size_t(q) * QL,
                                     kv + size_t(q) * (R + rope), true, sums);
// ==== kernel body: mla_rows_into ====
  // mla_rows with the cache row written into the cache's buffer [1, capacity, R + rope] at the
  // row's slot (its position: one sequence, no padding), the input `cache`, in place: MLX keeps a
  // step's inputs alive until its kernels finish, so the next step could not donate the buffer
  // to a scatter while this one runs and would copy the whole cache (the .metal kernel says
  // more). A slot past the capacity (params[4]) writes nothing.
  __shared__ float sums[2 * NSG];
  const int QL = params[0];
  const int R = params[1];
  const int rope = params[2];
  const int q = int(blockIdx.z);
  const int slot = pos[q];
  const bool inside = slot >= 0 && slot < params[4];
  colibri_mla::norm_rope_row<T, NSG>(y + size_t(q) * params[3], qnorm, knorm, invf, static_cast<float>(slot), QL, R,
                                     rope, fparams[0], fparams[1], qa + size_t(q) * QL,
                                     const_cast<T*>(cache) + size_t(inside ? slot : 0) * (R + rope), inside, sums);

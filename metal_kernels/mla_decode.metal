// mla_decode: folded (absorbed) multi-head latent attention for a few query rows over the
// latent cache, three launches (colibri_mlx/kernels/mla.py):
//
//   mla_qabs  q'[q, h, :] = W_UK^h^T q_nope[q, h]      one threadgroup per (head, query row);
//             simdgroups split the nope rows of W_UK^h, lanes own units of the R columns, so
//             every kv_b byte of W_UK is read once per query row; threadgroup reduction.
//   mla_attn  split-K flash decoding: one SIMD group per (tile of cache positions, block of
//             HB heads, query row). Per position the lanes hold R/32 latent columns (+ rope
//             columns); the row is read once for HB heads; score = (q'.latent + q_rope.k_rope)
//             * scale (masked: -1e30, like the reference); online softmax (running max m, sum
//             l, unnormalized combine acc) -> one partial (acc[R], m, l) per tile and head.
//   mla_out   one threadgroup per (head, query row): merges the tiles' partials into the
//             normalized latent context in threadgroup memory, then out = W_UV^h context
//             (simdgroups take rows, lanes units, simd_sum).
//
// Cache length has no cap: tiles are as many as needed, the merge loops over them. With an
// index list (DSA) the tiles run over the listed positions instead of 0..T-1.
// Header: appended to qgemv.metal's and moe_block.metal's headers (cm_* unit helpers: fmt 0-5).
// The CUDA twin metal_kernels/cuda/mla_decode.cu implements the same algorithm.
//
// params (int32[16]): H, nope, v, R, rope, T, P (positions per query row), TT (positions per
// tile), NT (tiles), L (query rows per batch), rb, ng, n_units, has_mask, has_sel, 0.
// fparams (float32[8]): scale, 0...

// ==== kernel body: mla_qabs ====
  constexpr int WPU = cm_wpu(FMT);
  threadgroup float red[NSG * NU * WPU * 32];
  const int H = params[0];
  const int nope = params[1];
  const int v = params[2];
  const int R = params[3];
  const int rb = params[10];
  const int ng = params[11];
  const int n_units = params[12];
  const int h = int(threadgroup_position_in_grid.y);
  const int q = int(threadgroup_position_in_grid.z);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);
  const int tid = int(thread_index_in_threadgroup);
  float acc[NU * WPU];
  for (int k = 0; k < NU * WPU; ++k) {
    acc[k] = 0.0f;
  }
  for (int n = sg; n < nope; n += NSG) {
    const int row = h * (nope + v) + n;
    const float xq = qn[(size_t(q) * H + h) * nope + n];
    const device uint8_t* wrow = w + size_t(row) * size_t(rb);
    for (int j = 0; j < NU; ++j) {
      const int u = lane + 32 * j;
      if (u < n_units) {
        uint r[6];
        cm_load<FMT, VEC>(wrow, rb, R, u, r);
        const float us = cm_unit_scale<FMT, GS>(scales, row, ng, u, r) * xq;
        float wq[WPU];
        cm_decode<FMT>(r, e8grid, wq);
        for (int k = 0; k < WPU; ++k) {
          acc[j * WPU + k] += us * wq[k];
        }
      }
    }
  }
  for (int j = 0; j < NU; ++j) {
    const int u = lane + 32 * j;
    if (u < n_units) {
      for (int k = 0; k < WPU; ++k) {
        red[sg * NU * WPU * 32 + u * WPU + k] = acc[j * WPU + k];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
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
  const int lane = int(thread_index_in_simdgroup);
  const int tile = int(threadgroup_position_in_grid.x) * NSG + int(simdgroup_index_in_threadgroup);
  const int h0 = int(threadgroup_position_in_grid.y) * HB;
  const int q = int(threadgroup_position_in_grid.z);
  if (tile >= NT) {
    return;
  }
  const int b = q / L;
  float qa[HB][CJ];
  float qr[HB][RJ];
  float acc[HB][CJ];
  float m[HB];
  float l[HB];
  for (int i = 0; i < HB; ++i) {
    const device float* qa_h = qabs + (size_t(q) * H + h0 + i) * R;
    const device float* qr_h = qrope + (size_t(q) * H + h0 + i) * rope;
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
  const int p1 = min(P, (tile + 1) * TT);
  for (int p = tile * TT; p < p1; ++p) {
    const int t = has_sel ? sel[size_t(q) * P + p] : p;
    const device TC* lat = latent + (size_t(b) * T + t) * R;
    const device TC* kr = krope + (size_t(b) * T + t) * rope;
    float lv[CJ];
    float kv[RJ];
    for (int j = 0; j < CJ; ++j) {
      const int c = lane + 32 * j;
      lv[j] = c < R ? float(lat[c]) : 0.0f;
    }
    for (int j = 0; j < RJ; ++j) {
      const int c = lane + 32 * j;
      kv[j] = c < rope ? float(kr[c]) : 0.0f;
    }
    const bool keep = !has_mask || mask[size_t(q) * T + t] != 0;
    for (int i = 0; i < HB; ++i) {
      float d = 0.0f;
      for (int j = 0; j < CJ; ++j) {
        d += qa[i][j] * lv[j];
      }
      for (int j = 0; j < RJ; ++j) {
        d += qr[i][j] * kv[j];
      }
      d = simd_sum(d);
      const float s = keep ? d * scale : -1e30f;
      const float m_new = max(m[i], s);
      const float alpha = exp(m[i] - m_new);
      const float pw = exp(s - m_new);
      l[i] = l[i] * alpha + pw;
      for (int j = 0; j < CJ; ++j) {
        acc[i][j] = acc[i][j] * alpha + pw * lv[j];
      }
      m[i] = m_new;
    }
  }
  for (int i = 0; i < HB; ++i) {
    const size_t part = (size_t(q) * H + h0 + i) * NT + tile;
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
  constexpr int WPU = cm_wpu(FMT);
  threadgroup float ctx[RMAX];
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
  const size_t part0 = (size_t(q) * H + h) * NT;
  float mx_ = -INFINITY;
  for (int t = 0; t < NT; ++t) {
    mx_ = max(mx_, pml[2 * (part0 + t)]);
  }
  float den = 0.0f;
  for (int t = 0; t < NT; ++t) {
    den += exp(pml[2 * (part0 + t)] - mx_) * pml[2 * (part0 + t) + 1];
  }
  for (int c = tid; c < R; c += NSG * 32) {
    float s = 0.0f;
    for (int t = 0; t < NT; ++t) {
      s += exp(pml[2 * (part0 + t)] - mx_) * pacc[(part0 + t) * R + c];
    }
    ctx[c] = s / den;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int vi = sg; vi < v; vi += NSG) {
    const int row = h * (nope + v) + nope + vi;
    const device uint8_t* wrow = w + size_t(row) * size_t(rb);
    float a = 0.0f;
    for (int u = lane; u < n_units; u += 32) {
      uint r[6];
      cm_load<FMT, VEC>(wrow, rb, R, u, r);
      const float us = cm_unit_scale<FMT, GS>(scales, row, ng, u, r);
      float wq[WPU];
      cm_decode<FMT>(r, e8grid, wq);
      float d = 0.0f;
      for (int k = 0; k < WPU; ++k) {
        d += (u * WPU + k < R) ? wq[k] * ctx[u * WPU + k] : 0.0f;
      }
      a += d * us;
    }
    a = simd_sum(a);
    if (lane == 0) {
      out[(size_t(q) * H + h) * v + vi] = static_cast<T>(a);
    }
  }

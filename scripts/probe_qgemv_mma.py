#!/usr/bin/env python3
"""Probe: qgemv on the tensor cores (CUDA only, fmt 2, one row of bf16 x), against the qgemv
kernel, at issue 4's large shape (18432x7168).

    PYTHONPATH=/root/site:/tmp/site:$PWD python3 scripts/probe_qgemv_mma.py

Why: the fmt 2 / 4 GEMV kernels spend ~3.3 SASS instructions a weight (nibble to fp16 to float
conversion, one FFMA a weight; compile_cuda_twins.py --sass), and their time follows their
instructions more than their bytes (fmt 4 reads 11 % more bytes than fmt 2 in 5 % more time).
Here each k16 step of ``mma.sync.m16n8k16`` (bf16 in, float32 accumulation) takes 16 rows x 16
weights: a nibble pair becomes a bf16x2 of codes 128 + n by one AND-OR (exact), one bf16x2 FMA
makes them n - 8 (exact), and the products and sums are the tensor core's (float32). x is
staged once a block in shared memory, each 8 values in the order the nibble pairs come out of a
word ((0, 4), (1, 5), (2, 6), (3, 7)); a dot product is the same over any order of its terms,
so a k16 step's 16 weights are, for lane quad t, weights 32 t + 8 q + {0..7} of a 128-weight
chunk (one 16-byte load a row a chunk). Only column 0 of the 8-column product is x; the lanes
of other columns load the same x, so every column holds the same dot product.

Prints, for each launch setting MT:U:WPB (16-row tiles a warp, 128-weight chunks a load batch
(two batches in flight), warps a block): the largest |y - y_qgemv| / sum |w x| over all rows of
one instance, against a float64 reference too, and the kernel-alone time (CUPTI, as
profile_kernels.py --cupti). A probe: not used by the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from colibri_mlx import kernels  # noqa: E402
from colibri_mlx.kernels import dispatch, qgemv  # noqa: E402
from colibri_mlx.kernels.reference import dequantize_rows  # noqa: E402

MMA_SOURCE = """
  // KO rows of KI fmt 2 weights (row bytes KI / 2), x bf16 [KI], y [KO]. Warp w of block b owns
  // rows 16 MT (b WPB + w) .. + 16 MT. Lane (g, t) = (lane / 4, lane % 4) holds rows g and g + 8
  // of each 16-row tile (the mma A fragment), columns 32 t .. 32 t + 31 of each 128-weight chunk.
  constexpr int NCH = KI / 128;
  __shared__ uint4 xs[KI / 8];
  const int lane = int(threadIdx.x) & 31;
  const int warp = int(threadIdx.x) >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int row0 = (int(blockIdx.x) * WPB + warp) * 16 * MT;
  const uint8_t* wb = reinterpret_cast<const uint8_t*>(w);
  const uint4* wrow[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    wrow[m][0] = reinterpret_cast<const uint4*>(wb + size_t(min(row0 + 16 * m + g, KO - 1)) * (KI / 2)) + t;
    wrow[m][1] = reinterpret_cast<const uint4*>(wb + size_t(min(row0 + 16 * m + g + 8, KO - 1)) * (KI / 2)) + t;
  }
  uint4 ra[U][MT][2];
  uint4 rb[U][MT][2];
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      ra[u][m][0] = wrow[m][0][4 * u];
      ra[u][m][1] = wrow[m][1][4 * u];
    }
  }
  // x, each 8 values as the pairs (0, 4), (1, 5), (2, 6), (3, 7).
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  for (int i = int(threadIdx.x); i < KI / 8; i += 32 * WPB) {
    const uint4 v = xv[i];
    xs[i] = make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                       __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
  }
  __syncthreads();
  float acc[MT][2][4];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        acc[m][h][k] = 0.0f;
      }
    }
  }
  auto pair = [](uint32_t word, int sh) -> uint32_t {
    uint32_t p;
    asm("lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;" : "=r"(p) : "r"(word >> sh));
    uint32_t r;   // (128 + n) * 1 - 136 = n - 8, exact in bf16
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(p), "r"(0x3F803F80u), "r"(0xC308C308u));
    return r;
  };
  auto compute = [&](const uint4 (*raw)[MT][2], int c0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint4 xq = xs[16 * (c0 + u) + 4 * t + q];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          const uint32_t wg = q == 0 ? raw[u][m][0].x : q == 1 ? raw[u][m][0].y : q == 2 ? raw[u][m][0].z : raw[u][m][0].w;
          const uint32_t w8 = q == 0 ? raw[u][m][1].x : q == 1 ? raw[u][m][1].y : q == 2 ? raw[u][m][1].z : raw[u][m][1].w;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t a0 = pair(wg, 8 * h), a2 = pair(wg, 8 * h + 4);
            const uint32_t a1 = pair(w8, 8 * h), a3 = pair(w8, 8 * h + 4);
            const uint32_t b0 = h ? xq.z : xq.x, b1 = h ? xq.w : xq.y;
            asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                : "+f"(acc[m][h][0]), "+f"(acc[m][h][1]), "+f"(acc[m][h][2]), "+f"(acc[m][h][3])
                : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
          }
        }
      }
    }
  };
  for (int c = 0; c < NCH; c += 2 * U) {
    if (c + U < NCH) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          rb[u][m][0] = wrow[m][0][4 * (c + U + u)];
          rb[u][m][1] = wrow[m][1][4 * (c + U + u)];
        }
      }
    }
    compute(ra, c);
    if (c + U >= NCH) {
      break;
    }
    if (c + 2 * U < NCH) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          ra[u][m][0] = wrow[m][0][4 * (c + 2 * U + u)];
          ra[u][m][1] = wrow[m][1][4 * (c + 2 * U + u)];
        }
      }
    }
    compute(rb, c + U);
  }
  // Column 0 (lanes t = 0): c0 is row g, c2 row g + 8.
  if (t == 0) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const int r = row0 + 16 * m + g;
      if (r < KO) {
        y[r] = static_cast<OT>((acc[m][0][0] + acc[m][1][0]) * scales[r]);
      }
      if (r + 8 < KO) {
        y[r + 8] = static_cast<OT>((acc[m][0][2] + acc[m][1][2]) * scales[r + 8]);
      }
    }
  }
"""

# The same fmt 2 GEMV as qgemv (its unit decode and accumulation, ROWS rows a warp, unit lane +
# 32 k of each row), but the weights come through a shared-memory ring filled by cp.async: each
# lane's 16 bytes of each row go global -> shared without registers, STAGES steps in flight a
# warp, one flat stream of (row block, step) a warp so the pipeline runs on across its row
# blocks. The register double buffer (PF 1) holds one step in flight; this holds STAGES - 1.
RING_SOURCE = """
  constexpr int NSTEP = (KNU + 31) / 32;
  constexpr int NSEG = colibri_qd::wpu(FMT) / colibri_qd::seg(FMT, GS);
  __shared__ uint4 ring[WPB][STAGES][ROWS][32];
  const int lane = int(threadIdx.x) & 31;
  const int warp = int(threadIdx.x) >> 5;
  const int gw = int(blockIdx.x) * WPB + warp;
  const int total = int(gridDim.x) * WPB;
  constexpr int NRB = (KO + ROWS - 1) / ROWS;
  const int mine = gw < NRB ? (NRB - gw + total - 1) / total : 0;
  const int n_seq = mine * NSTEP;
  const uint8_t* wb = reinterpret_cast<const uint8_t*>(w);
  auto issue = [&](int s) {
    if (s < n_seq) {
      const int rbk = gw + (s / NSTEP) * total;
      const int u = (s % NSTEP) * 32 + lane;
      if (u < KNU) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          const int row = min(rbk * ROWS + r, KO - 1);
          const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(&ring[warp][s % STAGES][r][lane]));
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(wb + size_t(row) * KRB + 16 * size_t(u)));
        }
      }
    }
    asm volatile("cp.async.commit_group;");
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    issue(s);
  }
  float acc[ROWS][1];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    acc[r][0] = 0.0f;
  }
  float sc[ROWS][NSEG];
  for (int s = 0; s < n_seq; ++s) {
    issue(s + STAGES - 1);
    asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1));
    const int step = s % NSTEP;
    const int u = step * 32 + lane;
    if (u < KNU) {
      uint32_t raw[ROWS][colibri_qd::words(FMT)];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const uint4 v = ring[warp][s % STAGES][r][lane];
        raw[r][0] = v.x; raw[r][1] = v.y; raw[r][2] = v.z; raw[r][3] = v.w;
      }
      colibri_qgemv::unit<FMT, GS, 1, ROWS, 2, colibri_qd::words(FMT), NIB, T>(raw, x, sc, e8grid, KI, u, acc);
    }
    if (step == NSTEP - 1) {
      const int row0 = (gw + (s / NSTEP) * total) * ROWS;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float v = acc[r][0];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          v += __shfl_xor_sync(0xffffffffu, v, off);
        }
        if (lane == r && row0 + r < KO) {
          y[row0 + r] = static_cast<OT>(v * scales[row0 + r]);
        }
        acc[r][0] = 0.0f;
      }
    }
  }
  asm volatile("cp.async.wait_group 0;");
"""


def ring_spec(x, qt, rows, stages, warps, wpb):
    """qgemv fmt 2 S = 1 through the cp.async ring (RING_SOURCE) on ``warps`` warps in all."""
    from colibri_mlx.kernels.qgemv import e8grid, kernel_header, shape_values

    O, I, rb, _, n_units = shape_values(qt)
    if qt.fmt != 2 or I % 32:
        raise ValueError("probe: the ring takes fmt 2 with whole units")
    return dispatch.LaunchSpec(
        name="qgemv_ring_probe", input_names=("x", "w", "scales", "e8grid"), output_names=("y",),
        source=RING_SOURCE, header=kernel_header(dispatch.CUDA), inputs=[x.reshape(-1), qt.packed, qt.scales, e8grid()],
        output_shapes=[(1, O)], output_dtypes=[x.dtype], grid=(32 * warps, 1, 1), threadgroup=(32 * wpb, 1, 1),
        template=[("T", x.dtype), ("FMT", 2), ("GS", 16), ("NIB", 1), ("KO", O), ("KI", I), ("KRB", rb),
                  ("KNU", n_units), ("ROWS", rows), ("STAGES", stages), ("WPB", wpb), ("OT", x.dtype)])


def mma_spec(x, qt, mt, u, wpb):
    O, I = qt.O, qt.I
    if I % (128 * 2 * u) or O % (16 * mt * wpb):
        raise ValueError(f"probe: {O}x{I} not whole chunks / tiles for MT {mt} U {u} WPB {wpb}")
    return dispatch.LaunchSpec(
        name="qgemv_mma_probe", input_names=("x", "w", "scales"), output_names=("y",), source=MMA_SOURCE,
        header="", inputs=[x.reshape(-1), qt.packed, qt.scales], output_shapes=[(1, O)],
        output_dtypes=[x.dtype], grid=(32 * wpb * (O // (16 * mt * wpb)), 1, 1), threadgroup=(32 * wpb, 1, 1),
        template=[("KO", O), ("KI", I), ("MT", mt), ("U", u), ("WPB", wpb), ("OT", x.dtype)])


def main():
    from bench_qgemv import random_qtensors
    from profile_kernels import COPY_BW, cupti_times
    from colibri_mlx.formats import scale_nbytes, weight_nbytes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="18432x7168")
    ap.add_argument("--settings", default="1:2:1,1:4:1,2:2:1,2:4:1,1:2:2,1:4:4,2:2:4")
    ap.add_argument("--ring", default="6:4:1536:1,4:6:2304:1,6:6:1536:1,2:8:3072:2,4:4:2304:2",
                    help="cp.async ring settings ROWS:STAGES:WARPS:WPB")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--chain", type=int, default=8)
    args = ap.parse_args()
    impl = kernels.backend()
    if impl != dispatch.CUDA:
        print("probe_qgemv_mma: CUDA only (mma.sync)")
        return 0
    O, I = map(int, args.shape.split("x"))
    ws = random_qtensors(2, O, I, None, args.chain)
    xs = [mx.random.normal((1, I)).astype(mx.bfloat16) for _ in ws]
    mx.eval(xs)
    nbytes = weight_nbytes(2, O, I, None) + scale_nbytes(2, O, I, None) + I * 2
    launches = [("qgemv fmt 2 (default)", [qgemv.launch_spec(x, w, impl) for x, w in zip(xs, ws)])]
    for cfg in args.settings.split(","):
        mt, u, wpb = map(int, cfg.split(":"))
        try:
            launches.append((f"mma {cfg}", [mma_spec(x, w, mt, u, wpb) for x, w in zip(xs, ws)]))
        except ValueError as e:
            print(e)
    for cfg in [c for c in args.ring.split(",") if c]:
        rows, stages, warps, wpb = map(int, cfg.split(":"))
        launches.append((f"ring {cfg}", [ring_spec(x, w, rows, stages, warps, wpb) for x, w in zip(xs, ws)]))
    # Correctness of instance 0: against the qgemv kernel and a float64 reference, relative to
    # sum |w x| of each row (issue 4's tolerance is 1e-4).
    w64 = np.array(dequantize_rows(ws[0], 0, O).astype(mx.float32), dtype=np.float64)
    x64 = np.array(xs[0].astype(mx.float32), dtype=np.float64)[0]
    ref = w64 @ x64
    mag = np.abs(w64) @ np.abs(x64)
    y_q = np.array(dispatch.launch(impl, launches[0][1][0])[0].astype(mx.float32))[0]
    print(f"{'launch':<24} {'err/sum|wx| f64':>16} {'vs qgemv':>10} {'median us':>10} {'min us':>8} {'%bw':>6}")
    ok = {}
    for label, specs in launches:
        # Output poisoned with NaN (MLX fills it before the kernel): an unwritten row shows.
        spec = dataclasses.replace(specs[0], init_value=float("nan"))
        y = np.array(dispatch.launch(impl, spec)[0].astype(mx.float32))[0]
        bad = int(np.sum(~np.isfinite(y)))
        e64 = float(np.max(np.abs(y - ref) / mag))
        eq = float(np.max(np.abs(y - y_q) / mag))
        ok[label] = (e64, eq, bad)
    recs = cupti_times(impl, [(lab, 0, specs) for lab, specs in launches], args.iters)
    per_round = args.chain * len(launches)
    if len(recs) != per_round * args.iters:
        print(f"expected {per_round * args.iters} kernel records, got {len(recs)}")
        return 1
    for j, (label, _) in enumerate(launches):
        durs = [recs[r * per_round + j * args.chain + c][0] for r in range(args.iters) for c in range(args.chain)]
        med = statistics.median(durs)
        e64, eq, bad = ok[label]
        print(f"{label:<24} {e64:>16.2e} {eq:>10.2e} {med:>10.1f} {min(durs):>8.1f} "
              f"{nbytes / (med * 1e-6) / COPY_BW * 100:>6.1f}" + (f"  {bad} rows not finite" if bad else ""),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

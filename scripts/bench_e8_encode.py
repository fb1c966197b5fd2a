"""Time fmt 6 encoding (rotation + lattice search) of one 2048 x 6144 expert matrix.

    .venv/bin/python scripts/bench_e8_encode.py [--rows 2048] [--cols 6144] [--repeats 3]
"""

import argparse
import statistics
import time

import numpy as np

from colibri_mlx.formats import e8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=6144)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    w = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32) * 0.02
    e8.encode_e8(w[:8])                       # build the lazy lookup tables outside the timing
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        packed, _ = e8.encode_e8(w)
        times.append(time.perf_counter() - t0)
    rec = e8.decode_e8(packed, args.rows, args.cols)
    w_rot = e8.rotate_rows(w)
    rel = float(np.sqrt(((rec - w_rot) ** 2).mean() / (w_rot ** 2).mean()))
    print(f"encode_e8 {args.rows}x{args.cols}: median {statistics.median(times):.3f} s "
          f"over {args.repeats} runs (min {min(times):.3f} s, {e8._THREADS} threads); "
          f"relative RMS error {rel:.4f}")


if __name__ == "__main__":
    main()

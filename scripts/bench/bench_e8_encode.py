"""Time fmt 6 encoding (rotation + lattice search) of one 2048 x 6144 expert matrix.

    .venv/bin/python scripts/bench/bench_e8_encode.py [--rows 2048] [--cols 6144] [--repeats 5]
                                                [--numpy-repeats 1]

Reports the compiled core ("c", first call in the process and the median of the rest) and the
numpy reference path, wall and CPU seconds (CPU time shows how much of a slow wall time is
other load on a shared machine), and checks that both give the same bytes.
"""

import argparse
import statistics
import time

import numpy as np

from colibri_mlx.formats import e8


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=6144)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of the C path")
    ap.add_argument("--numpy-repeats", type=int, default=1, help="timed runs of the numpy path "
                    "(0 skips it)")
    args = ap.parse_args()

    w = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32) * 0.02
    lib, why = e8._load_compiled()              # compile (or load from the cache) untimed
    if lib is None:
        print(f"C path unavailable: {why}")
    else:
        (packed_c, _), wall, cpu = _timed(lambda: e8.encode_e8(w, backend="c"))
        print(f"c      first call in this process: {wall:.3f} s wall, {cpu:.3f} s CPU")
        runs = [_timed(lambda: e8.encode_e8(w, backend="c"))[1:] for _ in range(args.repeats)]
        walls, cpus = zip(*runs)
        print(f"c      encode_e8 {args.rows}x{args.cols}: median {statistics.median(walls):.3f} s "
              f"wall (min {min(walls):.3f}), {statistics.median(cpus):.3f} s CPU, "
              f"{e8._THREADS} threads, {args.repeats} runs")

    if args.numpy_repeats:
        e8.encode_e8(w[:8], backend="numpy")    # build the numpy lookup tables untimed
        runs = [_timed(lambda: e8.encode_e8(w, backend="numpy")) for _ in range(args.numpy_repeats)]
        packed_np = runs[-1][0][0]
        walls = [r[1] for r in runs]
        print(f"numpy  encode_e8 {args.rows}x{args.cols}: median {statistics.median(walls):.3f} s "
              f"wall, {statistics.median(r[2] for r in runs):.3f} s CPU, "
              f"{args.numpy_repeats} runs")
        if lib is not None:
            same = np.array_equal(packed_c, packed_np)
            print(f"c and numpy bytes identical: {same}")
            if not same:
                raise SystemExit(1)

    packed = packed_c if lib is not None else packed_np
    rec = e8.decode_e8(packed, args.rows, args.cols)
    w_rot = e8.rotate_rows(w)
    rel = float(np.sqrt(((rec - w_rot) ** 2).mean() / (w_rot ** 2).mean()))
    print(f"relative RMS error {rel:.4f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Converter throughput per class: source MB/s, --jobs 1 vs --jobs N, wall clock and per CPU-second.

Each case writes a one-shard checkpoint of routed-expert matrices of DeepSeek-V3's shape
([2048, 7168] gate/up, [7168, 2048] down) in the given input dtype and times a full
`convert()` of it (dequantize, encode, error statistics, write). fmt 6 uses fewer rows: the
numpy E8 encoder is ~1000x slower than the integer formats.

    python scripts/bench/bench_convert.py [--jobs 2] [--experts 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from colibri_mlx.convert import convert  # noqa: E402

CASES = [  # label, input dtype, options, rows per matrix (None = full)
    ("int4 g64 <- BF16", "bf16", {}, None),
    ("int4 g64 <- FP8", "fp8", {}, None),
    ("int4 g64 <- NVFP4", "nvfp4", {}, None),
    ("int8 row <- BF16", "bf16", {"xbits": 8}, None),
    ("int3 g64 <- BF16", "bf16", {"xbits": 3}, None),
    ("int4 row <- BF16", "bf16", {"group_size": 0}, None),
    ("e8 (fmt 6) <- BF16", "bf16", {"xbits": "e8"}, 128),
]


def write_checkpoint(path: str, dtype: str, experts: int, rows) -> tuple[int, int]:
    import torch
    from safetensors.torch import save_file

    rng = np.random.default_rng(0)
    tensors, n_weights = {}, 0
    for e in range(experts):
        for proj, (O, I) in (("gate_proj", (2048, 7168)), ("up_proj", (2048, 7168)), ("down_proj", (7168, 2048))):
            O = rows or O
            name = f"model.layers.3.mlp.experts.{e}.{proj}.weight"
            w = torch.from_numpy((0.02 * rng.standard_normal((O, I))).astype(np.float32))
            n_weights += O * I
            if dtype == "bf16":
                tensors[name] = w.to(torch.bfloat16)
            elif dtype == "fp8":
                scale = torch.full((-(-O // 128), -(-I // 128)), 0.1 / 448, dtype=torch.float32)
                tensors[name] = (w / scale[0, 0]).to(torch.float8_e4m3fn)
                tensors[name + "_scale_inv"] = scale
            else:
                tensors[name] = torch.from_numpy(rng.integers(0, 256, (O, I // 2), dtype=np.uint8))
                tensors[name + "_scale"] = torch.full((O, I // 16), 1.0).to(torch.float8_e4m3fn)
                tensors[name + "_scale_2"] = torch.tensor(1e-3, dtype=torch.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return os.path.getsize(os.path.join(path, "model.safetensors")), n_weights


def _cpu_seconds() -> float:
    """User + system time of this process and its finished children (pool workers)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma-separated case labels' first word filter")
    a = ap.parse_args()
    print(f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; DeepSeek-V3 expert matrices;\n"
          "cells: source MB/s wall clock (MB per CPU-second, parent + workers)\n")
    print(f"| case | source MB | M weights | jobs 1 | jobs {a.jobs} |\n|---|---|---|---|---|")
    for label, dtype, options, rows in CASES:
        if a.only and not any(label.startswith(x) for x in a.only.split(",")):
            continue
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "in")
            os.makedirs(src)
            size, n_weights = write_checkpoint(src, dtype, a.experts, rows)
            cells = []
            for jobs in (1, a.jobs):
                out = os.path.join(d, f"out{jobs}")
                t, cpu = time.perf_counter(), _cpu_seconds()
                convert(out, indir=src, n_layers=61, jobs=jobs, progress=False, log=lambda m: None, **options)
                dt, dcpu = time.perf_counter() - t, _cpu_seconds() - cpu
                cells.append(f"{size / 1e6 / dt:.1f} ({size / 1e6 / dcpu:.1f})")
            print(f"| {label} | {size / 1e6:.0f} | {n_weights / 1e6:.1f} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()

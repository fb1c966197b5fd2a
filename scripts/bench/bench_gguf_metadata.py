"""Time of opening a GGUF file with a DeepSeek-V3-sized vocabulary: ``gguf.GGUFReader`` against the
loader's reader (``models.gguf_checkpoint.reader_class``), on the CPU.

    PYTHONPATH=$PWD python scripts/bench/bench_gguf_metadata.py [--tokens 129280] [--pairs 3]

Method: one synthetic file (``tokens`` tokens, as many merges and token types, one tensor) in a
temporary directory; ``pairs`` alternating A/B opens (page cache warm after the first), each timed
whole; the median of each and their ratio are printed, and written as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np


def write_file(path: str, n: int) -> None:
    import gguf

    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_token_list([f"tok{i}" for i in range(n)])
    w.add_token_merges([f"a{i} b{i}" for i in range(n)])
    w.add_token_types([1] * n)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    import gguf

    from colibri_mlx.models.gguf_checkpoint import reader_class

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=129280)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    readers = {"gguf.GGUFReader": gguf.GGUFReader, "colibri reader": reader_class()}
    times = {k: [] for k in readers}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "vocab.gguf")
        write_file(path, args.tokens)
        for _ in range(args.pairs):
            for name, cls in readers.items():
                t = time.perf_counter()
                cls(path)
                times[name].append(time.perf_counter() - t)
    result = {k: statistics.median(v) for k, v in times.items()}
    result["ratio"] = result["gguf.GGUFReader"] / result["colibri reader"]
    result["tokens"] = args.tokens
    for k, v in result.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

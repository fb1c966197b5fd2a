"""Write colibri_mlx/formats/gguf_grids.py from llama.cpp's ggml-common.h.

The IQ types' lattice grids (iq2xxs_grid, iq2xs_grid, iq2s_grid, iq3xxs_grid, iq3s_grid,
iq1s_grid) are tables of 32- or 64-bit words whose bytes are the weights of one grid point, each
byte one of 3 or 8 levels. The module stores every point as its level indices (2 or 3 bits a
weight, weight j at bits ``bits * j``) in a hex string and the levels beside it; it expands them
to the byte tables ggml reads at import.

    python scripts/gguf/write_iq_grids.py path/to/ggml/src/ggml-common.h
"""

from __future__ import annotations

import argparse
import os
import re
import textwrap

GRIDS = {   # name: (word bytes, levels in ggml's byte encoding, dtype of the expanded table)
    "iq2xxs_grid": (8, (0x08, 0x19, 0x2B), "uint8"),
    "iq2xs_grid": (8, (0x08, 0x19, 0x2B), "uint8"),
    "iq2s_grid": (8, (0x08, 0x19, 0x2B), "uint8"),
    "iq3xxs_grid": (4, (0x04, 0x0C, 0x14, 0x1C, 0x24, 0x2C, 0x34, 0x3E), "uint8"),
    "iq3s_grid": (4, (0x01, 0x03, 0x05, 0x07, 0x09, 0x0B, 0x0D, 0x0F), "uint8"),
    "iq1s_grid": (8, (0xFF, 0x00, 0x01), "int8"),
}


def read_table(header: str, name: str) -> list[int]:
    m = re.search(r"GGML_TABLE_BEGIN\(\w+, " + name + r", \w+\)(.*?)GGML_TABLE_END\(\)", header, re.S)
    if m is None:
        raise SystemExit(f"{name} not found")
    return [int(v, 0) for v in re.findall(r"0x[0-9a-fA-F]+|\d+", m.group(1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("header", help="llama.cpp's ggml/src/ggml-common.h")
    header = open(ap.parse_args().header).read()
    out = [
        '"""The IQ types\' grids, from llama.cpp\'s ggml-common.h (written by scripts/gguf/write_iq_grids.py).',
        "",
        "Each grid is a ``[points, weights]`` byte table as ggml reads it (point ``i``'s weight ``j`` is",
        "byte ``j`` of ggml's little-endian word ``grid[i]``). Stored as level indices: a point is",
        "``digits`` hex digits, weight ``j`` at bits ``bits * j``; ``levels`` are the byte values.",
        '"""',
        "",
        "import numpy as np",
        "",
        "",
        "def _expand(hex_points: str, weights: int, levels: tuple, dtype: str) -> np.ndarray:",
        "    bits = 2 if len(levels) <= 4 else 3",
        "    digits = -(-bits * weights // 4)",
        "    hex_points = \"\".join(hex_points.split())",
        "    words = np.array([int(hex_points[k:k + digits], 16) for k in range(0, len(hex_points), digits)], np.uint32)",
        "    idx = (words[:, None] >> (bits * np.arange(weights, dtype=np.uint32))) & ((1 << bits) - 1)",
        "    return np.array(levels, np.uint8)[idx].view(dtype)",
        "",
    ]
    for name, (nbytes, levels, dtype) in GRIDS.items():
        words = read_table(header, name)
        bits = 2 if len(levels) <= 4 else 3
        digits = -(-bits * nbytes // 4)
        points = []
        for w in words:
            code = 0
            for j in range(nbytes):
                code |= levels.index((w >> (8 * j)) & 0xFF) << (bits * j)
            points.append(f"{code:0{digits}x}")
        body = textwrap.fill("".join(points), 96)
        lv = "(" + ", ".join(f"0x{v:02x}" for v in levels) + ")"
        out += ["", f"{name} = _expand(\"\"\"", body, f"\"\"\", {nbytes}, {lv}, \"{dtype}\")   # [{len(words)}, {nbytes}]"]
    path = os.path.join(os.path.dirname(__file__), "..", "..", "colibri_mlx", "formats", "gguf_grids.py")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(out) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Why the tiny GLM-5 file's logits differ from llama.cpp's past index_topk positions: ties at
the indexer's top-k threshold, broken differently.

    PYTHONPATH=$PWD python3 scripts/gguf/glm_topk_ties.py      # needs a C++ compiler (c++/g++)

The float64 oracle (tests/gguf_oracle.py) runs tests/data/gguf/tiny-glm-bf16.gguf on the prompt
of tests/data/gguf/prompt.json twice: with its own top-k (ties to the lowest positions, as ours
and upstream colibri), and with llama.cpp's (ggml's CPU top_k: ``std::partial_sort`` of the
indices by score, compiled here from the same lines). Per position past index_topk it prints
the largest |logit - llama.cpp's logit| of each, and each layer's top-k margin in the second run
(the k-th best score minus the next, over the row's largest score; 0 is a tie).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
DATA = os.path.join(ROOT, "tests", "data", "gguf")

# ggml-cpu's ggml_compute_forward_top_k_f32: the indices of a row, partially sorted by score
TOP_K_CPP = r"""
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>
struct cmp_top_k { const float * data; bool operator()(int32_t a, int32_t b) const { return data[a] > data[b]; } };
int main() {
    int rows, n, k;
    if (scanf("%d %d %d", &rows, &n, &k) != 3) return 1;
    std::vector<float> d(n);
    std::vector<int32_t> tmp(n);
    for (int r = 0; r < rows; r++) {
        for (int j = 0; j < n; j++) { if (scanf("%f", &d[j]) != 1) return 1; tmp[j] = j; }
        std::partial_sort(tmp.begin(), tmp.begin() + k, tmp.end(), cmp_top_k{d.data()});
        for (int j = 0; j < k; j++) printf("%d ", tmp[j]);
        printf("\n");
    }
}
"""


def build_top_k(workdir: str) -> str:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        sys.exit("glm_topk_ties.py needs a C++ compiler (apt-get install g++)")
    src, exe = os.path.join(workdir, "top_k.cpp"), os.path.join(workdir, "top_k")
    with open(src, "w") as f:
        f.write(TOP_K_CPP)
    subprocess.run([cxx, "-O2", "-o", exe, src], check=True)
    return exe


def llama_top_k(exe: str, index: np.ndarray, k: int) -> np.ndarray:
    rows = index.astype(np.float32)
    text = f"{rows.shape[0]} {rows.shape[1]} {k}\n" + "\n".join(
        " ".join("-inf" if not np.isfinite(v) else repr(float(v)) for v in row) for row in rows)
    out = subprocess.run([exe], input=text, capture_output=True, text=True, check=True).stdout.split("\n")
    return np.array([[int(v) for v in line.split()] for line in out[: rows.shape[0]]])


def main():
    from gguf_oracle import GgufOracle

    path = os.path.join(DATA, "tiny-glm-bf16.gguf")
    with open(os.path.join(DATA, "prompt.json")) as f:
        ids = json.load(f)["ids"]
    llama = np.load(os.path.join(DATA, "tiny-glm-bf16.llama_logits.npy")).astype(np.float64)
    oracle = GgufOracle(path)
    k = oracle.index_topk
    margins: dict = {}                      # (layer, position) -> top-k margin, of the last run
    top_k_exe = {"path": None}              # None: the oracle's own choice
    scores = oracle.index_scores

    def index_scores(x, q_latent, i):
        index = scores(x, q_latent, i)
        best = -np.sort(-index, axis=-1)
        for t in range(k, index.shape[0]):
            margins[(i, t)] = (best[t, k - 1] - best[t, k]) / np.abs(best[t, : t + 1]).max()
        return index

    def top_k(index, n):
        if top_k_exe["path"] is None:
            return GgufOracle.top_k(index, n)
        return llama_top_k(top_k_exe["path"], index, n)

    oracle.index_scores, oracle.top_k = index_scores, top_k
    ours = oracle.logits(ids)[0]
    with tempfile.TemporaryDirectory() as tmp:
        top_k_exe["path"] = build_top_k(tmp)
        theirs = oracle.logits(ids)[0]
    before = np.abs(ours[:k] - llama[:k]).max()
    print(f"positions 0..{k - 1} (every causal key chosen): max |oracle - llama.cpp| {before:.3f}")
    layers = sorted({layer for layer, _ in margins})
    print(f"{'position':>8} {'oracle, ties low':>17} {'oracle, ties as llama.cpp':>26}  top-k margin per layer")
    for t in range(k, len(ids)):
        m = "  ".join(f"{margins[(layer, t)]:.4f}" for layer in layers)
        print(f"{t:8d} {np.abs(ours[t] - llama[t]).max():17.3f} {np.abs(theirs[t] - llama[t]).max():26.3f}  {m}")


if __name__ == "__main__":
    main()

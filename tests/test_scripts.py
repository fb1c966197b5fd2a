"""The GPU benchmark and profiling scripts still run: each one's CPU smoke mode (tiny shapes or
no GPU) end to end in a subprocess, as a device call would start it. The numbers are not
checked (CPU timings of tiny shapes mean nothing); the rows each script promises are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri_mlx.kernels import dispatch

ROOT = Path(__file__).resolve().parents[1]


def run_script(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args[0]} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_bench_e2e_rows():
    out = run_script("scripts/bench/bench_e2e.py", "--tiny", "--steps", "2", "--quick", "--experts", "16", "--vocab", "4096")
    for row in ("ours (kernels on)", "ours (earlier step ops: slice_update)", "ours (kernels on, again: drift)",
                "mlx-lm 0.32.2", "mlx-lm/ours ="):
        assert row in out, out


def test_bench_serve_rows():
    out = run_script("scripts/bench/bench_serve.py", "--tiny", "--streams", "1,2", "--tokens", "3", "--prompt", "4",
                     "--experts", "16", "--vocab", "4096", "--http", "--drafts", "none,ngram")
    for row in ("colibri BatchEngine", "colibri serve over HTTP", "mlx-lm BatchGenerator", "ours / mlx-lm decode: 1: ",
                "--draft ngram (", "ngram / none decode: 1: ", "ours 1 stream / generate_tokens (worker thread): "):
        assert row in out, out


def test_bench_moe_rows():
    out = run_script("scripts/bench/bench_moe_mla.py", "--tiny", "--only", "moe", "--iters", "1")
    for row in ("moe_routed ", "moe_routed_compiled", "moe_block"):
        assert row in out, out


def test_bench_mla_rows():
    out = run_script("scripts/bench/bench_moe_mla.py", "--tiny", "--only", "mla", "--iters", "1", "--cache", "16")
    for row in ("mla_T16 ", "mla_T16_compiled"):
        assert row in out, out


def test_bench_long_context_rows():
    out = run_script("scripts/bench/bench_long_context.py", "--tiny", "--context", "40", "--steps", "2", "--experts", "16",
                     "--vocab", "4096")
    for row in ("      40       ours, in place", "      40        ours, scatter", "      40               mlx-lm",
                "buffer moved"):
        assert row in out, out


def test_bench_build_reports_the_step_graph():
    out = run_script("scripts/bench/bench_build.py", "--tiny", "--steps", "5")
    assert "decode step build (launches stubbed)" in out and "whole layer (one compiled graph)" in out, out


@pytest.mark.skipif(dispatch.gpu_backend() is not None,
                    reason="on a GPU the script profiles for real (scripts/device/steps.sh kernel_times)")
def test_profile_kernels_without_gpu():
    out = run_script("scripts/bench/profile_kernels.py", "--cupti", "--down=8:-:-:-")
    assert "no GPU backend" in out, out


def test_profile_step_without_gpu():
    out = run_script("scripts/bench/profile_step.py", "--tiny", "--steps", "2")
    assert "needs the CUDA backend" in out, out


def test_profile_step_accounts_a_step(capsys):
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import profile_step

    # two steps of 100 us; in the second, kernels at 20-50 and 40-60 overlap, then 80-90
    ranges = [(100.0, 200.0), (0.0, 100.0)]
    kerns = [(10.0, 30.0, "a"), (40.0, 50.0, "b"),
             (120.0, 150.0, "a"), (140.0, 160.0, "c"), (180.0, 190.0, "b"), (250.0, 260.0, "outside")]
    rows, by_name, sequence = profile_step.analyze(ranges, kerns)
    assert rows[0] == {"wall": 100.0, "lead": 10.0, "busy": 30.0, "gaps": 10.0, "tail": 50.0, "kernels": 2}
    assert rows[1] == {"wall": 100.0, "lead": 20.0, "busy": 50.0, "gaps": 20.0, "tail": 10.0, "kernels": 3}
    assert by_name == {"a": (25.0, 1.0), "b": (10.0, 1.0), "c": (10.0, 0.5)}
    assert sequence == [(0.0, 30.0, "a"), (20.0, 20.0, "c"), (60.0, 10.0, "b")]
    # and the tables print (the lines a GPU run ends with)
    top = profile_step.report("ours", rows, by_name, 3)[1]
    assert [name for name, _ in top] == ["a", "b", "c"]
    profile_step.print_sequence("ours", [(0.0, 30.0, "mlx::core::cu::custom_kernel_qgemv")])
    assert "  custom_kernel_qgemv" in capsys.readouterr().out


def test_bench_mlx_quant_rows():
    out = run_script("scripts/bench/bench_mlx_quant.py", "--tiny")
    for name in ("fmt 4 g64", "affine 4b g64", "affine 3b g64", "mxfp4 g32"):
        assert name in out, out


def test_bench_mlx_lm_checkpoint_rows():
    out = run_script("scripts/bench/bench_mlx_lm_checkpoint.py", "--tiny", "--formats", "affine3g64", "--steps", "2",
                     "--greedy", "4", "--experts", "16", "--vocab", "512")
    assert "affine3g64" in out and "4 greedy tokens kernels vs reference: identical" in out, out
    assert "token 0 prefill  kernels vs reference" in out and "token 0 stepwise kernels vs reference" in out, out
    assert "affine3g64 / container" in out, out


def test_bench_gguf_metadata_rows():
    out = run_script("scripts/bench/bench_gguf_metadata.py", "--tokens", "2000", "--pairs", "1")
    for name in ("gguf.GGUFReader:", "colibri reader:", "ratio:", "tokens: 2000"):
        assert name in out, out


def test_bench_mlx_lm_checkpoint_first_difference_report():
    """The greedy comparison's report at the first differing token: margins from the logits of
    that step, and a near-tie only when the reference's top-2 margin is within a bfloat16 step of
    its largest logit (2^-7 relative at 8 significant bits)."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    from bench_mlx_lm_checkpoint import bf16_ulp, first_difference_report

    assert bf16_ulp(12.0) == 2.0 ** -4 and bf16_ulp(-1.0) == 2.0 ** -7
    ref = [np.array([10.0, 9.0, 0.0]), np.array([10.0, 9.99, 0.0])]
    mine = [np.array([10.0, 9.0, 0.0]), np.array([9.98, 10.0, 0.5])]
    assert first_difference_report([0, 1], [0, 1], mine, ref) is None
    d = first_difference_report([0, 1], [0, 0], mine, ref)
    assert d["index"] == 1 and (d["reference_token"], d["kernel_token"]) == (0, 1)
    assert abs(d["ref_top2_margin"] - 0.01) < 1e-9 and abs(d["kernel_top2_margin"] - 0.02) < 1e-9
    assert abs(d["max_abs_logit_diff"] - 0.5) < 1e-9 and d["near_tie"] and d["path"] == "decode step"
    far = [ref[0], np.array([10.0, 8.0, 0.0])]
    assert not first_difference_report([0, 1], [0, 0], mine, far)["near_tie"]


def test_bench_gguf_e2e_rows(tmp_path):
    out_json = tmp_path / "gguf_e2e.json"
    out = run_script("scripts/bench/bench_gguf_e2e.py", "--tiny", "--experts", "16", "--vocab", "1024", "--steps", "2",
                     "--pairs", "1", "--json", str(out_json))
    import json

    res = json.loads(out_json.read_text())
    for mix in ("q4_k_m", "iq2_xxs"):
        row = res["mixes"][mix]
        assert f"{mix}: " in out and "per byte read" in out, out
        assert row["counters"]["fallbacks"] == {}, row["counters"]
        assert {"qgemv/reference", "moe_block/reference", "mla_decode/reference"} <= set(row["counters"]["calls"])
        assert 0 < row["bytes_per_token"] and row["per_byte_ratio"] > 0
    assert {"Q4_K", "Q6_K", "F32"} == set(res["mixes"]["q4_k_m"]["file_bytes_by_type"])
    assert {"IQ2_XXS", "Q4_K", "Q6_K", "Q8_0", "F32"} == set(res["mixes"]["iq2_xxs"]["file_bytes_by_type"])


def test_bench_gguf_gemv_rows():
    out = run_script("scripts/bench/bench_gguf_gemv.py", "--tiny", "--types", "Q4_K", "IQ2_XXS")
    for row in ("mx.quantized_matmul 4b g64", "Q4_K R4", "IQ2_XXS R4", "paired A/B", "  IQ1_M "):
        assert row in out, out


def test_bench_mtp_rows_rows():
    out = run_script("scripts/bench/bench_mtp_rows.py", "--requests", "2", "--drafts", "2", "--pairs", "1")
    assert "one by one ms" in out and "       2  2 " in out, out


def test_bench_ngram_rows():
    out = run_script("scripts/bench/bench_ngram.py", "--contexts", "256")
    assert "random     256" in out and "text     256" in out, out


def test_glm_topk_ties_rows():
    import shutil

    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        pytest.skip("no C++ compiler")
    out = run_script("scripts/gguf/glm_topk_ties.py")
    assert "ties as llama.cpp" in out and "     26 " in out, out

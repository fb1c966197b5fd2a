"""`colibri bench` on the bundled demo model with tiny sizes."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

import colibri_mlx
from colibri_mlx.bench import random_prompt, report_json, run_bench
from colibri_mlx.cli import main

TINY = ("--prompt-tokens", "8", "--gen-tokens", "4", "--repeat", "1")


def run(*args):
    return CliRunner().invoke(main, ["bench", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def demo_model():
    return colibri_mlx.load(None)[0]


def test_table(demo_model):
    result = run(*TINY)
    assert result.exit_code == 0, result.output
    assert "bundled demo model" in result.stderr
    out = result.stdout
    for label in ("pp8 x1", "tg4 x1"):
        row = re.search(rf"^{label}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
        assert row, out
        median, lo, hi = map(float, row.groups())
        assert 0 < lo == median == hi  # one run
    assert re.search(r"^peak memory: [\d.]+ GB \(MLX\), [\d.]+ GB \(process\)$", out, re.M)
    assert re.search(r"^kernels\[\w+\]: .*qgemv/\w+ \d+.*; fallback \d+", out, re.M)


def test_json_with_batch_and_streamed_experts():
    result = run(*TINY, "--batch", "2", "--ram-gb", "0.004", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["prompt_tokens"], report["gen_tokens"], report["batch"], report["repeat"]) == (8, 4, 2, 1)
    (r,) = report["runs"]
    assert report["prompt_tps"]["median"] == pytest.approx(2 * 8 / r["prompt_s"])
    assert report["generation_tps"]["median"] == pytest.approx(2 * 4 / r["generation_s"])
    assert report["peak_memory_bytes"] == r["peak_memory_bytes"] > 0
    assert sum(report["kernels"]["calls"].values()) > 0
    stats = report["expert_stats"]
    assert stats["budget_bytes"] == 4_000_000 and stats["lookups"] > 0


def test_counters_cover_measured_runs_only(demo_model):
    once = run_bench(demo_model, prompt_tokens=4, gen_tokens=2, repeat=1)
    twice = run_bench(demo_model, prompt_tokens=4, gen_tokens=2, repeat=2)
    assert once.kernels["calls"] and len(twice.runs) == 2
    assert twice.kernels["calls"] == {k: 2 * n for k, n in once.kernels["calls"].items()}
    assert report_json(twice)["generation_tps"]["min"] <= report_json(twice)["generation_tps"]["max"]


def test_random_prompt_is_seeded_and_in_vocabulary():
    a, b, c = random_prompt(4096, 2, 64, seed=1), random_prompt(4096, 2, 64, seed=1), random_prompt(4096, 2, 64)
    assert a.shape == (2, 64) and a.tolist() == b.tolist() != c.tolist()
    assert 0 <= a.min().item() and a.max().item() < 4096 and len(set(a.reshape(-1).tolist())) > 100


def test_context_limit_is_refused():
    result = CliRunner().invoke(main, ["bench", "--prompt-tokens", "1000", "--gen-tokens", "100"])
    assert result.exit_code == 1
    assert "1100 exceeds the model's context limit of 1024 tokens" in result.output

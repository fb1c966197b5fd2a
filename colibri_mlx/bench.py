"""``colibri bench``: prompt and generation throughput on random token ids, like
``mlx_lm.benchmark`` and llama-bench.

A run feeds a ``[batch, prompt_tokens]`` block of random ids (seeded) through the model in one
prefill, then ``gen_tokens`` greedy decode steps of one token per sequence. Each decode step is
one forward pass, so generation tok/s = batch * gen_tokens / decode time. There is no stop at
end-of-sequence: every run does the same work. One warm-up run (same prompt shape, at most
``WARMUP_GEN_TOKENS`` decode steps) builds the kernels before ``repeat`` measured runs; kernel
counters and expert-store statistics cover the measured runs only. The expert usage history
(``.coli_usage``) is never written: random prompts would skew it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import numpy as np

from .generate import peak_rss_bytes

WARMUP_GEN_TOKENS = 8


@dataclass(frozen=True)
class RunTiming:
    prompt_s: float
    generation_s: float
    peak_memory_bytes: int


@dataclass
class BenchReport:
    model: str
    prompt_tokens: int
    gen_tokens: int
    batch: int
    runs: list[RunTiming]
    kernels: dict
    expert_stats: Optional[dict] = None
    process_peak_rss_bytes: int = 0
    device: str = field(default_factory=lambda: mx.default_device().type.name)

    def prompt_tps(self) -> list[float]:
        return [self.batch * self.prompt_tokens / max(r.prompt_s, 1e-9) for r in self.runs]

    def generation_tps(self) -> list[float]:
        return [self.batch * self.gen_tokens / max(r.generation_s, 1e-9) for r in self.runs]

    @property
    def peak_memory_bytes(self) -> int:
        return max(r.peak_memory_bytes for r in self.runs)


def random_prompt(vocab_size: int, batch: int, prompt_tokens: int, seed: int = 0) -> mx.array:
    ids = np.random.default_rng(int(seed) % (1 << 64)).integers(0, vocab_size, size=(batch, prompt_tokens), dtype=np.int64)
    return mx.array(ids.astype(np.int32))


def time_run(model, prompt: mx.array, gen_tokens: int) -> RunTiming:
    """One prefill of ``prompt [B, P]`` and ``gen_tokens`` greedy decode steps, timed apart."""
    cache = model.make_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    logits = model(prompt, cache)[:, -1]
    mx.eval(logits)
    t1 = time.perf_counter()
    for _ in range(gen_tokens):
        tokens = mx.argmax(logits, axis=-1)
        logits = model(tokens[:, None], cache)[:, -1]
        mx.eval(logits)
    t2 = time.perf_counter()
    return RunTiming(t1 - t0, t2 - t1, int(mx.get_peak_memory()))


def run_bench(model, prompt_tokens: int = 128, gen_tokens: int = 64, repeat: int = 3, batch: int = 1,
              seed: int = 0, model_name: str = "") -> BenchReport:
    from . import kernels

    for name, value in (("prompt_tokens", prompt_tokens), ("gen_tokens", gen_tokens), ("repeat", repeat),
                        ("batch", batch)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if prompt_tokens + gen_tokens > model.max_length:
        raise ValueError(f"prompt_tokens + gen_tokens = {prompt_tokens + gen_tokens} exceeds the model's context "
                         f"limit of {model.max_length} tokens")
    prompt = random_prompt(model.args.vocab_size, batch, prompt_tokens, seed)
    time_run(model, prompt, min(gen_tokens, WARMUP_GEN_TOKENS))
    store = getattr(model, "expert_store", None)
    kernels.reset_counters()
    if store is not None:
        store.reset_stats()
    runs = [time_run(model, prompt, gen_tokens) for _ in range(repeat)]
    return BenchReport(
        model=model_name, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, batch=batch, runs=runs,
        kernels=kernels.counters(), expert_stats=store.report() if store is not None else None,
        process_peak_rss_bytes=peak_rss_bytes())


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def report_json(report: BenchReport) -> dict:
    return {
        "model": report.model, "device": report.device, "prompt_tokens": report.prompt_tokens,
        "gen_tokens": report.gen_tokens, "batch": report.batch, "repeat": len(report.runs),
        "prompt_tps": _spread(report.prompt_tps()), "generation_tps": _spread(report.generation_tps()),
        "runs": [{"prompt_s": r.prompt_s, "generation_s": r.generation_s, "peak_memory_bytes": r.peak_memory_bytes}
                 for r in report.runs],
        "peak_memory_bytes": report.peak_memory_bytes, "process_peak_rss_bytes": report.process_peak_rss_bytes,
        "kernels": report.kernels, "expert_stats": report.expert_stats,
    }


def format_table(report: BenchReport) -> str:
    from .kernels import format_counters

    rows = [("test", "tok/s median", "min", "max")]
    for label, tps in ((f"pp{report.prompt_tokens}", report.prompt_tps()),
                       (f"tg{report.gen_tokens}", report.generation_tps())):
        s = _spread(tps)
        rows.append((f"{label} x{report.batch}", f"{s['median']:.2f}", f"{s['min']:.2f}", f"{s['max']:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"model: {report.model} | device: {report.device} | batch {report.batch}, {len(report.runs)} runs"]
    lines += ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
              for row in rows]
    lines.append(f"peak memory: {report.peak_memory_bytes / 1e9:.2f} GB (MLX), "
                 f"{report.process_peak_rss_bytes / 1e9:.2f} GB (process)")
    lines.append(format_counters())
    if report.expert_stats is not None:
        from .experts import format_stats

        lines.append(format_stats(report.expert_stats))
    return "\n".join(lines)

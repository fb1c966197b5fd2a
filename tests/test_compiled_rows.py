"""A few rows of one sequence (a speculative verify step) as one compiled graph a layer
(DecoderLayer._step, Attention.step of L rows): the logits and the cache equal the plain
op-by-op path's, the graph really runs (counted), and greedy speculation with compiled blocks
gives the tokens of greedy decoding without it.

On the CPU backend ``COLIBRI_COMPILE=1`` compiles the reference path; MoE layers decline there
(the reference groups tokens on the host: counted), so an all-dense model is where the CPU runs
every layer's rows compiled.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx import kernels
from colibri_mlx.kernels import compiled
from colibri_mlx.models.loading import load_model

from helpers_tiny import CONFIG, write_tiny_container

GPU = kernels.dispatch.gpu_backend() is not None
DENSE = dict(CONFIG, first_k_dense_replace=2, num_nextn_predict_layers=1, max_position_embeddings=64)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {name: load_model(write_tiny_container(tmp_path_factory.mktemp(name), config, seed=5), dtype="float32")
            for name, config in (("dense", DENSE), ("moe", dict(CONFIG, num_nextn_predict_layers=1)))}


def _verify_rows(model, monkeypatch, mode, blocks):
    """Logits of each block of rows fed after the prompt (one cache), and the cache's rows."""
    monkeypatch.setenv(compiled.ENV_VAR, mode)
    compiled.clear()
    kernels.reset_counters()
    cache = model.make_cache()
    mx.eval(model(mx.array([PROMPT]), cache))
    out = []
    for block in blocks:
        out.append(np.array(model(mx.array([block]), cache)[0]))
    kv = [np.array(c.buffers["kv"][:, : cache.offset]) for c in cache.layers]
    return out, kv, kernels.counters()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_compiled_rows_equal_plain(models, monkeypatch, kind):
    model = models[kind]
    # 2..8 rows (past mla_decode's 4 query rows the absorbed kernel declines: the reference
    # runs inside the graph), twice the same length (a replayed trace), one row between.
    blocks = [[7, 8], [9, 10, 11, 12], [13], [14, 15, 16, 17, 18, 19, 20, 21], [22, 23, 24, 25], [26, 27, 28]]
    want, want_kv, _ = _verify_rows(model, monkeypatch, "0", blocks)
    got, got_kv, counts = _verify_rows(model, monkeypatch, "1", blocks)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * np.abs(w).max())
        assert (g.argmax(-1) == w.argmax(-1)).all()
    for g, w in zip(got_kv, want_kv):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * np.abs(w).max())
    declined = [k for k in counts["calls"] if k.startswith("compiled/layer_rows_step")]
    traced = [layer._compiled_rows_step._deltas for layer in model.layers]
    if kind == "dense" or GPU:   # every layer traced (the first block of each length warms up plainly)
        assert all(traced) and not declined, (traced, counts)
    else:                 # on the CPU the MoE layer declines, counted; the dense one is compiled
        assert traced[0] and not traced[1] and declined, (traced, counts)


def test_rows_step_params_and_mask():
    """The verify step's params say L rows, a mask, and the attended length."""
    from colibri_mlx.kernels import mla

    model_kv = mx.zeros((1, 16, 48))
    kv_b = mx.zeros((2 * 32, 32))
    one = np.array(mla.step_params(kv_b, model_kv, 2, 16, 16, 16, mx.float32, 9, joint=True))
    four = np.array(mla.step_params(kv_b, model_kv, 2, 16, 16, 16, mx.float32, 12, joint=True, rows=4, causal=True))
    assert (one[5], one[6], one[9], one[13]) == (16, 9, 1, 0)
    assert (four[5], four[6], four[9], four[13]) == (16, 12, 4, mla.CAUSAL)


@pytest.mark.parametrize("draft", ["mtp", "ngram"])
def test_greedy_speculation_with_compiled_blocks(models, monkeypatch, draft):
    from colibri_mlx.generate import SamplingParams, generate_tokens

    model = models["dense"]
    monkeypatch.setenv(compiled.ENV_VAR, "1")
    compiled.clear()
    prompt = [5, 9, 5, 9, 5, 9, 5]

    def tokens(**kw):
        return [t for t, _ in generate_tokens(model, prompt, 16, SamplingParams(), **kw)]

    want = tokens(draft="none")
    kernels.reset_counters()
    got = tokens(draft=draft, num_draft=3)
    assert got == want
    assert all(layer._compiled_rows_step._deltas for layer in model.layers)


def _rows_step(model, start, L, index=0):
    """``L`` rows through layer ``index``'s DecoderLayer._step (what the compiled graph
    traces), plain: the output and the written cache buffer."""
    from colibri_mlx.models.cache import LayerCache

    layer = model.layers[index]
    attn = layer.self_attn
    rng = np.random.default_rng(2)
    x = mx.array(rng.standard_normal((1, L, model.args.hidden_size)).astype(np.float32))
    cache = LayerCache()
    width = attn.kv_lora_rank + attn.rope_dim
    cache.append("kv", mx.array(rng.standard_normal((1, start, width)).astype(np.float32)), 0)
    kv, params = attn.step_inputs(x, cache, start, {})
    return layer._step(x, mx.arange(start, start + L, dtype=mx.int32), kv, params)


@pytest.mark.msl
@pytest.mark.parametrize("kind, L", [("dense", 2), ("dense", 4), ("moe", 4)])
def test_rows_step_kernel_path_equals_reference(models, monkeypatch, kind, L):
    """The verify step's graph with every launch in the MSL simulator, as on a Mac: multi-row
    qgemv and mla_decode reading the causal mask over the fixed buffer (step_params' masked),
    the MoE block's rows with the residual added in its last launch."""
    from moe_mla_oracle import route_launches_to_simulator, simulator_or_skip

    simulator = simulator_or_skip()
    model = models[kind]
    index = 1 if kind == "moe" else 0
    want, want_kv = _rows_step(model, 7, L, index)
    launched = route_launches_to_simulator(monkeypatch, simulator)
    got, got_kv = _rows_step(model, 7, L, index)
    assert "qgemv" in launched and any(name.startswith("mla_attn") for name in launched), launched
    if kind == "moe":
        assert {"moe_gate_up", "moe_down"} <= set(launched), launched
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=1e-4 * np.abs(np.array(want)).max())
    np.testing.assert_allclose(np.array(got_kv), np.array(want_kv), rtol=0, atol=1e-5 * np.abs(np.array(want_kv)).max())


def _step_graph(model, monkeypatch, index, L):
    """Kernel launches (by name) and the other graph ops (by primitive) of layer ``index``'s
    compiled-step function (``_step``) for ``L`` rows, built
    as on a GPU with every launch a recorded stand-in (an evaluated output that depends on the
    launch's inputs, so the graph before it stays connected)."""
    import re
    from collections import Counter

    from colibri_mlx.kernels import dispatch, moe
    from colibri_mlx.models.cache import LayerCache

    launched = []

    def launch(backend, spec):
        launched.append(spec.name)
        outs = [mx.zeros(shape, dtype) for shape, dtype in zip(spec.output_shapes, spec.output_dtypes)]
        mx.eval(outs)
        return mx.depends(outs, [a for a in spec.inputs if isinstance(a, mx.array)])

    monkeypatch.setattr(dispatch, "launch", launch)
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: dispatch.METAL)
    monkeypatch.setenv(compiled.ENV_VAR, "0")
    moe.clear_banks()
    layer = model.layers[index]
    attn = layer.self_attn
    start = 7
    cache = LayerCache()
    cache.append("kv", mx.ones((1, start, attn.kv_lora_rank + attn.rope_dim)), 0)
    x = mx.ones((1, L, model.args.hidden_size))
    kv, params = attn.step_inputs(x, cache, start, {})
    slots = mx.array(start, dtype=mx.int32) if L == 1 else mx.arange(start, start + L, dtype=mx.int32)
    mx.eval(x, kv, params, slots)
    out = layer._step(x, slots, kv, params)
    dot = Path(tempfile.mkdtemp()) / "step.dot"
    mx.export_to_dot(str(dot), *out)
    ops = Counter(re.findall(r'label ="([^"]+)", shape=rectangle', dot.read_text()))
    ops.pop("Depends", None)
    moe.clear_banks()
    return Counter(launched), sum(ops.values())


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_rows_step_launches_what_the_one_row_step_launches(models, monkeypatch, kind):
    """A verify step of L = 2..8 rows launches the 1-row decode step's kernels, as many of each,
    every launch taking all L rows (nothing per row, no q_b GEMV apart, no reference attention
    past 4 rows), and builds no more other graph ops than the 1-row step."""
    model = models[kind]
    index = 1 if kind == "moe" else 0
    one, one_ops = _step_graph(model, monkeypatch, index, 1)
    assert {"qgemv", "mla_rows_into", "mla_qb_qabs", "mla_out"} <= set(one), one
    for L in range(2, 9):
        rows, rows_ops = _step_graph(model, monkeypatch, index, L)
        assert rows == one, (L, rows, one)
        assert rows_ops <= one_ops, (L, rows_ops, one_ops)

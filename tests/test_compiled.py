"""kernels.compiled: decode blocks as mx.compile graphs give the numbers and counters of the
plain graphs, decline visibly where the graph reads values on the host, and never keep a trace
across a change of dispatch mode.

On the CPU backend ``COLIBRI_COMPILE=1`` compiles the reference path (dense layers: attention rows
and MLP); MoE layers decline there (the reference groups tokens on the host). On a GPU the
default compiles every block, MoE kernels included.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx import kernels
from colibri_mlx.kernels import compiled

GPU = kernels.dispatch.gpu_backend() is not None


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    """Tiny quantized containers: all-dense layers, the default MoE mix (every fmt: several expert
    groups a layer), and a MoE of one expert format (one group, the shared expert in its slot)."""
    from helpers_models import build_hf_model, save_checkpoint, state_dict_numpy, write_container

    from helpers_models import default_container_formats

    def one_format(name, shape):   # every expert and the shared one fmt 4 g32: one expert group
        choice = default_container_formats(name, shape)
        return (4, 32) if choice is not None and ("experts" in name) else choice

    out = {}
    for name, overrides, formats in (("dense", dict(first_k_dense_replace=3), default_container_formats),
                                     ("moe", dict(), default_container_formats),
                                     ("moe_one_group", dict(), one_format)):
        root = tmp_path_factory.mktemp(name)
        hf = build_hf_model("deepseek_v3", seed=3, **overrides)
        path = save_checkpoint(hf, str(root / "hf"))
        write_container(state_dict_numpy(hf), path, str(root / "c"), formats)
        out[name] = root / "c"
    return out


def _decode(model, prompt, steps):
    """Logits of the prompt's last row and of ``steps`` greedy decode rows, and the tokens."""
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache)[0, -1]
    rows, tokens = [np.array(logits)], []
    for _ in range(steps):
        token = int(mx.argmax(logits).item())
        tokens.append(token)
        logits = model(mx.array([[token]]), cache)[0, -1]
        rows.append(np.array(logits))
    return np.stack(rows), tokens


def _run(model, monkeypatch, mode, steps=12):
    monkeypatch.setenv(compiled.ENV_VAR, mode)
    compiled.clear()
    kernels.reset_counters()
    logits, tokens = _decode(model, [5, 9, 17, 3], steps)
    return logits, tokens, kernels.counters()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_compiled_decode_equals_plain(containers, monkeypatch, kind):
    from colibri_mlx.models.loading import load_model

    model = load_model(containers[kind], dtype="float32")
    want, want_tokens, want_counts = _run(model, monkeypatch, "0")
    got, got_tokens, got_counts = _run(model, monkeypatch, "1")
    assert got_tokens == want_tokens
    # Same ops; fusion may reassociate nothing but can round elementwise chains differently.
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    # The traced blocks replayed their counts: every step counted as the plain run did.
    calls = dict(got_counts["calls"])
    declined = {k: v for k, v in calls.items() if k.startswith("compiled/")}
    for k in declined:
        del calls[k]
    assert calls == want_counts["calls"]
    assert got_counts["fallbacks"] == want_counts["fallbacks"]
    layers = model.layers
    moe_layers = [layer for layer in layers if hasattr(layer.mlp, "router")]
    if kind == "dense" or GPU:
        # Every layer is one compiled graph over the fixed-capacity cache, traced and replayed.
        assert all(layer._compiled_step._deltas for layer in layers)
        assert not declined
    else:
        # CPU MoE layers: the reference groups tokens on the host, so the MoE layers compile what
        # is before and after the attention core, and their MLP block runs plainly, counted.
        assert moe_layers
        for layer in layers:
            assert bool(layer._compiled_step._deltas) == (layer not in moe_layers)
            assert bool(layer._compiled_in._deltas) == (layer in moe_layers)
            assert not layer._compiled_out._deltas
        reason = "declined: reference path groups tokens by expert on the host"
        assert declined == {f"compiled/layer_out/{reason}": len(moe_layers) * 12,   # decode rows
                            f"compiled/moe/{reason}": len(moe_layers)}, declined   # the 4-row prompt


def test_compiled_decode_across_cache_growth(containers, monkeypatch):
    """Past a GROW_STEP boundary the cache buffers grow and the step graphs are retraced for
    the new capacity; the rows written before stay, the numbers equal the plain path's."""
    from colibri_mlx.models import cache as cache_mod
    from colibri_mlx.models.loading import load_model

    monkeypatch.setattr(cache_mod, "GROW_STEP", 8)
    model = load_model(containers["dense"], dtype="float32")
    want, want_tokens, _ = _run(model, monkeypatch, "0", steps=20)
    got, got_tokens, _ = _run(model, monkeypatch, "1", steps=20)
    assert got_tokens == want_tokens
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert len(model.layers[0]._compiled_step._deltas) == 3       # capacities 8, 16, 24


def test_trace_not_kept_across_dispatch_modes(containers, monkeypatch):
    """A trace made in one dispatch mode is not replayed in another: forcing the reference (on a
    GPU: other kernels) runs plainly there (kernels.compiled._reference_on_gpu, counted; on the
    CPU the backend is the reference anyway), and the numbers are the plain path's."""
    from colibri_mlx.models.loading import load_model

    model = load_model(containers["dense"], dtype="float32")
    monkeypatch.setenv(compiled.ENV_VAR, "1")
    compiled.clear()
    _decode(model, [5, 9, 17, 3], 4)                      # warm-up, trace, replays
    block = model.layers[0]._compiled_step
    assert len(block._modes) == 1
    with kernels.force_reference():
        kernels.reset_counters()
        got, _ = _decode(model, [5, 9, 17, 3], 4)
        calls = kernels.counters()["calls"]
    assert len(block._modes) == 1
    assert all(compiled_fn is not None for compiled_fn in block._modes.values())
    if GPU:
        assert calls.get("compiled/layer_step/declined: reference path on a GPU device"), calls
    monkeypatch.setenv(compiled.ENV_VAR, "0")
    with kernels.force_reference():
        want, _ = _decode(model, [5, 9, 17, 3], 4)
    np.testing.assert_allclose(got, want, rtol=0, atol=(1e-5 if not GPU else 1e-3) * np.abs(want).max())
    assert set(k.split("/")[1] for k in calls if k.startswith(("qgemv", "mla_decode"))) == {"reference"}


def test_traces_are_kept_per_backend(monkeypatch):
    """The backend is the mode: a trace made for one backend is not replayed for another."""
    monkeypatch.setenv(compiled.ENV_VAR, "1")
    monkeypatch.setattr(kernels.dispatch, "gpu_backend", lambda: None)     # no reference-on-GPU decline
    block = compiled.CompiledBlock(lambda x: x * 2, "toy_modes")
    x = mx.ones((4,))
    for n, backend in enumerate((kernels.REFERENCE, kernels.METAL), start=1):
        monkeypatch.setattr(kernels.dispatch, "backend", lambda backend=backend: backend)
        block(x)
        block(x)                                            # warm-up, trace
        assert list(block._modes) == [kernels.REFERENCE, kernels.METAL][:n]
        assert all(fn is not None for fn in block._modes.values())


def test_block_declines_with_reason_and_counts(monkeypatch):
    monkeypatch.setenv(compiled.ENV_VAR, "1")
    w = mx.random.normal((16, 16))
    mx.eval(w)
    block = compiled.CompiledBlock(lambda x: (x @ w) * 2, "toy")
    x = mx.random.normal((1, 16))
    kernels.reset_counters()
    for _ in range(3):
        y = block(x, static="values on the host")
    assert kernels.counters()["calls"] == {"compiled/toy/declined: values on the host": 3}
    assert not block._deltas
    np.testing.assert_allclose(np.array(y), np.array((x @ w) * 2), rtol=1e-6)
    for _ in range(3):
        block(x)
    assert len(block._deltas) == 1                          # warm-up, trace, replay


def test_replays_count_what_their_trace_counted(monkeypatch):
    """Every call counts what the plain call would, through warm-up, traces and replays, also
    when a block's traces count different things (by shape here); while its traces agree a
    replay does not read the inputs' shapes (host time on a GPU: compiled.CompiledBlock)."""
    monkeypatch.setenv(compiled.ENV_VAR, "1")

    def fn(x):
        kernels.dispatch.record_call("toy_shapes", f"n{x.shape[0]}")
        return x * 2

    signatures = []
    real_signature = compiled._signature
    monkeypatch.setattr(compiled, "_signature", lambda args: signatures.append(1) or real_signature(args))
    block = compiled.CompiledBlock(fn, "toy_shapes")
    small, large = mx.ones((2,)), mx.ones((3,))
    kernels.reset_counters()
    for _ in range(4):                                      # warm-up, trace, replays
        y = block(small)
    assert len(signatures) == 1                             # the trace's own, none a replay
    np.testing.assert_array_equal(np.array(y), [2.0, 2.0])
    for x in (large, large, small, large, small):           # a second trace counting otherwise
        block(x)
    assert kernels.counters()["calls"] == {"toy_shapes/n2": 6, "toy_shapes/n3": 3}
    assert len(block._deltas) == 2 and block._counted == {next(iter(block._modes)): None}


def test_clear_drops_every_blocks_traces(monkeypatch):
    """compiled.clear() reaches every live block: the benchmarks swap functions the traces call
    and clear, and a kept trace would replay the old graph."""
    monkeypatch.setenv(compiled.ENV_VAR, "1")
    block = compiled.CompiledBlock(lambda x: x + 1, "toy_clear")
    x = mx.ones((3,))
    block(x)
    block(x)                                                # warm-up, trace
    assert block._modes and block._deltas
    compiled.clear()
    assert not block._modes and not block._deltas and not block._counted


def test_policy_values(monkeypatch):
    monkeypatch.setenv(compiled.ENV_VAR, "auto")
    assert compiled.enabled(kernels.CUDA) and compiled.enabled(kernels.METAL)
    assert not compiled.enabled(kernels.REFERENCE)
    monkeypatch.setenv(compiled.ENV_VAR, "0")
    assert not compiled.enabled(kernels.CUDA)
    monkeypatch.setenv(compiled.ENV_VAR, "yes")
    with pytest.raises(ValueError, match="COLIBRI_COMPILE"):
        compiled.enabled(kernels.CUDA)


def test_attention_block_step_equals_plain(containers, monkeypatch):
    """Attention called alone (as scripts/bench/bench_moe_mla.py times it): decode rows without a mask
    run as one compiled graph over the cache buffers, equal to the plain block."""
    from colibri_mlx.models.cache import LayerCache
    from colibri_mlx.models.loading import load_model

    model = load_model(containers["dense"], dtype="float32")
    attn = model.layers[1].self_attn
    rng = np.random.default_rng(0)
    xs = [mx.array(rng.standard_normal((1, 1, model.args.hidden_size)).astype(np.float32)) for _ in range(6)]

    def run(mode):
        monkeypatch.setenv(compiled.ENV_VAR, mode)
        compiled.clear()
        cache = LayerCache()
        width = attn.kv_lora_rank + attn.rope_dim
        cache.append("kv", mx.array(rng.standard_normal((1, 5, width)).astype(np.float32)), 0)
        outs = [attn(x, None, None, None, cache, 5 + i, rope_offset=mx.array(5 + i, dtype=mx.int32))[0]
                for i, x in enumerate(xs)]
        return np.stack([np.array(o) for o in outs]), np.array(cache.read("kv", 11))

    state = rng.bit_generator.state
    want, want_cache = run("0")
    rng.bit_generator.state = state
    got, got_cache = run("1")
    assert attn._compiled_step._deltas
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got_cache, want_cache)


def test_cache_capacity_steps():
    """Buffers grow by GROW_STEP rows up to 2048, then by an eighth of the power of two below
    the length: at most 1/8 of a long cache unused, ~8 retraces of a compiled step per doubling."""
    from colibri_mlx.models.cache import GROW_STEP, capacity_for

    ends = np.arange(1, 70000)
    caps = np.array([capacity_for(int(e)) for e in ends])
    assert (caps >= ends).all() and (caps % GROW_STEP == 0).all()
    assert (caps - ends < np.maximum(GROW_STEP, ends / 8)).all()
    assert capacity_for(2048) == 2048 and capacity_for(2049) == 2304 and capacity_for(4097) == 4608
    assert len(set(caps[ends <= 32768])) == 40


@pytest.mark.parametrize("kind, mode", [("moe", "0"), ("dense", "1")])
def test_layer_commits_give_the_same_decode(containers, monkeypatch, kind, mode):
    """A decode row on a GPU hands each layer (its output and cache buffers) to the device as soon
    as it is built (deepseek_v3.commits_layers, here forced on the CPU): the same logits and tokens
    as the step built whole, plain or compiled, and the submissions happen (one per layer but the
    last, per decode step; none while the prompt runs)."""
    from colibri_mlx.models import deepseek_v3
    from colibri_mlx.models.loading import load_model

    model = load_model(containers[kind], dtype="float32")
    submitted = []
    real = deepseek_v3.mx.async_eval

    def counting(*arrays):
        submitted.append(len(arrays))
        return real(*arrays)

    monkeypatch.setattr(deepseek_v3.mx, "async_eval", counting)
    monkeypatch.setattr(deepseek_v3, "commits_layers", lambda L: False)
    want, want_tokens, _ = _run(model, monkeypatch, mode, steps=6)
    assert not submitted
    monkeypatch.setattr(deepseek_v3, "commits_layers", lambda L: L == 1)
    got, got_tokens, _ = _run(model, monkeypatch, mode, steps=6)
    assert got_tokens == want_tokens
    np.testing.assert_array_equal(got, want)
    assert len(submitted) == 6 * (len(model.layers) - 1), submitted
    # Each submission carries the layer's hidden state and its cache buffer.
    assert all(k >= 2 for k in submitted), submitted


def test_layer_commits_on_gpu_backends_only(monkeypatch):
    """Decode rows (one, or a verify step's up to 8) on a GPU backend commit layer by layer;
    prefill rows and the CPU do not."""
    from colibri_mlx.models import deepseek_v3

    monkeypatch.setattr(kernels.dispatch, "gpu_backend", lambda: None)
    assert not deepseek_v3.commits_layers(1)
    monkeypatch.setattr(kernels.dispatch, "gpu_backend", lambda: kernels.CUDA)
    assert deepseek_v3.commits_layers(1) and deepseek_v3.commits_layers(4) and not deepseek_v3.commits_layers(9)


# Non-launching primitives (views, reshapes) of one attention decode step on the GPU path.
STEP_VIEW_NODES = 6


def _primitive_names(*arrays) -> list[str]:
    import re
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        return re.findall(r'label ="([A-Za-z]+)', f.read())


def test_decode_step_writes_the_cache_in_place(containers, monkeypatch):
    """A compiled decode step never copies its cache. The kernel path (GPUs) writes the row
    (the latent, then the rope key) into the buffer from mla_rows_into itself, so the buffer
    stays put even when the next step is built and submitted before this one has run (the
    pipelined loop of `colibri generate`), where MLX, which keeps a running step's inputs alive,
    could not donate it to a scatter. The reference path scatters it, one scatter a layer (a
    slice_update at an array offset is two GPU launches), and MLX donates the buffer once the
    previous step has finished."""
    from colibri_mlx.models.loading import load_model

    monkeypatch.setenv(compiled.ENV_VAR, "1")
    compiled.clear()
    model = load_model(containers["dense"], dtype="float32")
    kernel_path = kernels.backend() != kernels.REFERENCE
    cache = model.make_cache()
    mx.eval(model(mx.array([[5, 9, 17]]), cache))
    mx.synchronize()

    def buffers():
        return [b for c in cache.layers for b in c.buffers.values()]

    def addresses():
        return [np.asarray(b).__array_interface__["data"][0] for b in buffers()]

    for token in (3, 8, 1):
        before = addresses()
        logits = model(mx.array([[token]]), cache)
        names = _primitive_names(logits, *buffers())
        assert names.count("ScatterAxis") == (0 if kernel_path else len(model.layers)), names
        assert "DynamicSliceUpdate" not in names and "SliceUpdate" not in names
        mx.eval(logits)
        mx.synchronize()        # MLX releases a finished step's inputs on another thread
        assert addresses() == before
    if kernel_path:
        # pipelined: the next step submitted while this one may still run
        before = addresses()
        logits = model(mx.array([[2]]), cache)
        mx.async_eval(logits)
        following = model(mx.array([[6]]), cache)
        mx.eval(logits, following)
        assert addresses() == before
        # and a buffer held elsewhere is written too: the cache owns its buffers
        held = buffers()
        mx.eval(model(mx.array([[4]]), cache))
        assert addresses() == before and len(held) == len(model.layers)
        return
    # The check sees copies: a buffer still held elsewhere cannot be donated, and moves.
    held = buffers()
    before = addresses()
    mx.eval(model(mx.array([[4]]), cache))
    assert addresses() != before
    del held


def test_cache_buffers_depend_on_the_in_place_row_write(containers, monkeypatch):
    """On the kernel path mla_rows_into writes a decode step's cache row into the buffer in
    place, which MLX does not see. Every layer's buffer handed to the next step must depend on
    that launch, or a step whose outputs are never evaluated (a prompt fed one token at a time,
    each step's logits dropped, as bench_mlx_lm_checkpoint.py's stepwise token 0) loses its
    rows, and the next step's attention reads zeros in their place. Launches stubbed (each output an ``mx.depends`` on the
    launch's inputs), the whole step one graph: each buffer's graph reaches the row's
    ``mla_rows_into`` launch, whose inputs include the slot."""
    from colibri_mlx.kernels import dispatch
    from colibri_mlx.models import deepseek_v3
    from colibri_mlx.models.deepseek_v3 import CACHE_STREAM
    from colibri_mlx.models.loading import load_model

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
    from bench_build import stub_launch

    stub = stub_launch(keep_inputs=True)
    launched = []

    def launch(backend, spec):
        launched.append(spec.name)
        return stub(backend, spec)

    model = load_model(containers["moe"], dtype="float32")
    monkeypatch.setattr(dispatch, "launch", launch)
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: dispatch.CUDA)
    monkeypatch.setattr(dispatch, "backend", lambda: dispatch.CUDA)
    monkeypatch.setattr(deepseek_v3, "commits_layers", lambda L: False)
    monkeypatch.setenv(compiled.ENV_VAR, "1")
    compiled.clear()
    cache = model.make_cache()
    for token in (5, 9, 3):        # from an empty cache; nothing evaluated between the steps
        model(mx.array([[token]]), cache)
    assert launched.count("mla_rows_into") >= 3, launched
    for i, layer_cache in enumerate(cache.layers):
        names = _primitive_names(layer_cache.buffers[CACHE_STREAM])
        # without the edge the buffer's graph is the zeros it was made from (Broadcast, Full)
        assert names.count("Depends") >= 3, (i, names)
    compiled.clear()


def _attention_step(model, start, whole_layer=False):
    """One decode row through the second layer's ``Attention.step`` (what the compiled step
    traces; ``whole_layer``: ``DecoderLayer._step``, the MLP or MoE block too), plain: the
    output (with the residual adds) and the written cache buffer."""
    from colibri_mlx.models.cache import LayerCache

    layer = model.layers[1]
    attn = layer.self_attn
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((1, 1, model.args.hidden_size)).astype(np.float32))
    cache = LayerCache()
    width = attn.kv_lora_rank + attn.rope_dim
    cache.append("kv", mx.array(rng.standard_normal((1, start, width)).astype(np.float32)), 0)
    kv, params = attn.step_inputs(x, cache, start, {})
    slot = mx.array(start, dtype=mx.int32)
    mx.eval(x, kv, params, slot, [v for v in vars(attn).values() if isinstance(v, mx.array)])
    if whole_layer:
        return layer._step(x, slot, kv, params)
    return attn.step(x, slot, kv, params, residual=x)


@pytest.mark.parametrize("kind, whole_layer", [("dense", False), ("dense", True), ("moe", True),
                                               ("moe_one_group", True)])
@pytest.mark.msl
def test_attention_step_kernel_path_equals_reference(containers, monkeypatch, kind, whole_layer):
    """The decode step's glue around the kernels (views, the row write, the residual adds; the
    MLP / MoE block), run with every launch in the MSL simulator as on a Mac, equals the
    reference path: what changes the graph between kernels is checked here, not first on a GPU."""
    from colibri_mlx.models.loading import load_model
    from moe_mla_oracle import route_launches_to_simulator, simulator_or_skip

    simulator = simulator_or_skip()

    model = load_model(containers[kind], dtype="float32")
    want, want_kv = _attention_step(model, 7, whole_layer)
    launched = route_launches_to_simulator(monkeypatch, simulator)
    got, got_kv = _attention_step(model, 7, whole_layer)
    # The row is written into the cache buffer by mla_rows_into (no scatter, kv in place), q_b's
    # projection runs inside the attention's first launch (mla_qb_qabs): no q_b GEMV.
    assert launched[:4] == ["qgemv", "mla_rows_into", "mla_qb_qabs", "mla_attn_mma"], launched
    assert "mla_rows" not in launched and "mla_qabs" not in launched, launched
    if kind.startswith("moe"):
        assert {"moe_gate_up", "moe_down"} <= set(launched), launched
    if kind == "moe_one_group":       # moe_down wrote the block's output with the residual added
        assert launched.count("moe_down") == 1 and model.layers[1].mlp.shared_slot is not None, launched
    assert got.shape == want.shape and got_kv.shape == want_kv.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=1e-4 * np.abs(np.array(want)).max())
    np.testing.assert_allclose(np.array(got_kv), np.array(want_kv), rtol=0,
                               atol=1e-5 * np.abs(np.array(want_kv)).max())


def test_attention_step_graph_nodes(containers, monkeypatch):
    """The GPU path's decode step of an attention block: each primitive is a node MLX recreates
    on every compiled call and schedules on every evaluation (~1-2 us of host time each on the
    H200's host), so the views between the kernels are counted and bounded. Launches stubbed
    (one ``mx.depends`` node each, no kernel runs): 6 launching primitives (the x projection,
    mla_rows_into with the row write, the three attention launches, the first with q_b's
    projection folded in, o_proj with the residual), and one more ``mx.depends``: the cache
    buffer handed to the next step depends on mla_rows_into's write (deepseek_v3.written_in_place)."""
    from colibri_mlx.kernels import dispatch
    from colibri_mlx.models.loading import load_model

    model = load_model(containers["dense"], dtype="float32")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
    from bench_build import stub_launch

    monkeypatch.setattr(dispatch, "launch", stub_launch(keep_inputs=True))
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: dispatch.CUDA)
    y, kv = _attention_step(model, 7)
    names = _primitive_names(y, kv)
    launching = [n for n in names if n in ("Depends", "ScatterAxis")]
    others = [n for n in names if n not in ("Depends", "ScatterAxis")]
    assert len(launching) == 7 and "ScatterAxis" not in names, names
    assert len(others) <= STEP_VIEW_NODES, f"{len(others)} others: {' '.join(others)}"

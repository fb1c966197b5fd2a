"""Continuous batching (colibri_mlx.batch_engine), the batched decode step
(models.batch_decode) and the prompt cache, on the bundled demo model.

The oracle is the one-request path, ``generate_tokens`` (its own prefill and decode step, no
speculation): every request of a batch must give its tokens, token for token, whatever else
runs beside it, and the batched step's logits must equal each sequence's own step's."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

import colibri_mlx
from colibri_mlx import kernels
from colibri_mlx.batch_engine import BatchEngine
from colibri_mlx.generate import SamplingParams, generate_tokens
from colibri_mlx.models.batch_decode import DecodeBatch, decode_rows
from colibri_mlx.models.cache import LatentCache
from colibri_mlx.models.deepseek_v3 import rms_norm
from colibri_mlx.prompt_cache import PromptCache, copy_prefix
from colibri_mlx.speculative import MTPDraft, observe_rows, propose_rows


@pytest.fixture(scope="module")
def demo():
    # float32 activations on every backend: on a GPU the kernels' row counts differ between a
    # batch and a lone sequence, and bfloat16 rounding would hide a real difference in the logits
    model, tokenizer = colibri_mlx.load(dtype="float32")
    return model, tokenizer


def prompts(*lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(v) for v in rng.integers(4, 4000, n)] for n in lengths]


def alone(model, prompt, n, params=SamplingParams(), seed=None):
    return [t for t, _ in generate_tokens(model, prompt, n, params, seed, stop_ids=(), draft="none")]


def tokens(handle):
    events = list(handle)
    assert events[-1].finish_reason is not None and all(e.finish_reason is None for e in events[:-1])
    return [e.token for e in events]


def test_decode_rows_equal_each_sequence_alone(demo):
    """Nine sequences of ragged lengths (two row groups, 5 + 4): the batched step's logits equal
    each sequence's own decode step's, and every cache advances by one."""
    model, _ = demo
    ps = prompts(3, 11, 5, 8, 2, 13, 6, 4, 9)
    caches, own = [], []
    for p in ps:
        c = model.make_cache()
        mx.eval(model(mx.array([p]), c))
        caches.append(c)
        o = copy_prefix(c, c.offset)
        own.append(model(mx.array([[p[-1]]]), o)[0, -1])
    before = kernels.dispatch.counters()["calls"].get("batch_decode/rows", 0)
    batched = decode_rows(model, [p[-1] for p in ps], caches)
    got, want = np.array(batched), np.array(mx.stack(own))
    assert got.shape == (9, model.args.vocab_size)
    # float32 on the CPU: the same sums in a different grouping of rows; logits are O(10)
    assert np.max(np.abs(got - want)) < 1e-3 * np.max(np.abs(want))
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert [c.offset for c in caches] == [len(p) + 1 for p in ps]
    assert kernels.dispatch.counters()["calls"]["batch_decode/rows"] == before + 1


def test_pooled_batch_joins_and_leaves(demo):
    """The pooled layout (every sequence's rows in one buffer a layer, one masked attention
    launch a step) against one cache per sequence stepped alone, while sequences join, leave
    (the last slot moving into the freed one, stale rows left behind) and the batch falls back
    to a lone sequence: logits each step, and the rows a leaving sequence takes with it."""
    model, _ = demo
    ps = prompts(3, 11, 5, 8, 2, 13, 6, 4, 9, 7, seed=6)

    def prefilled(p):
        c = model.make_cache()
        mx.eval(model(mx.array([p[:-1]]), c))
        return c

    batch, own, slots = DecodeBatch(model), {}, []        # slots: [prompt index, next token]
    assert batch.pooled

    def join(*ks):
        for k in ks:
            batch.add(prefilled(ps[k]))
            own[k] = prefilled(ps[k])
            slots.append([k, ps[k][-1]])

    def leave(i):
        k = slots[i][0]
        taken = batch.remove(i)
        last = slots.pop()
        if i < len(slots):
            slots[i] = last
        n = own[k].offset
        assert taken.offset == n
        for mine, theirs in zip(taken.layers, own[k].layers):
            assert np.array_equal(np.array(mine.read("kv", n)), np.array(theirs.read("kv", n)))

    def step():
        got = np.array(batch.step([t for _, t in slots]))
        for row, s in zip(got, slots):
            want = np.array(model(mx.array([[s[1]]]), own[s[0]])[0, -1])
            assert np.max(np.abs(row - want)) <= 1e-4 * np.max(np.abs(want))
            s[1] = int(want.argmax())

    pooled = kernels.dispatch.counters()["calls"].get("batch_decode/pooled", 0)
    join(0)
    step()
    assert batch.single is not None                      # alone: the model's own step
    join(1, 2)
    step()
    join(3, 4, 5, 6, 7, 8, 9)                            # ten rows: two row groups
    step()
    leave(2)
    leave(0)
    step()
    for _ in range(6):
        leave(0)
    step()
    leave(1)
    assert len(batch) == 1 and batch.single is not None
    step()
    assert kernels.dispatch.counters()["calls"]["batch_decode/pooled"] == pooled + 4


def test_batch_greedy_equals_each_request_alone(demo):
    """Requests join at different times, leave at different max_tokens, prefill in chunks of 3
    interleaved with the running decode; each gives exactly its tokens alone."""
    model, tok = demo
    ps = prompts(7, 4, 10, 5, 8)
    lengths = [6, 3, 5, 2, 4]
    engine = BatchEngine(model, tok, decode_concurrency=4, prompt_concurrency=2, prefill_step_size=3, stop_ids=())
    try:
        first = [engine.submit(p, max_tokens=n) for p, n in zip(ps[:2], lengths[:2])]
        it = iter(first[0])
        head = [next(it).token, next(it).token]           # the batch is running: the others join it
        later = engine.submit_all([dict(prompt_ids=p, max_tokens=n) for p, n in zip(ps[2:], lengths[2:])])
        got = [head + [e.token for e in it]] + [tokens(h) for h in first[1:] + later]
        assert engine.stats["prefill_chunks"] > len(ps)    # some prompt took several chunks
        assert engine.stats["decode_rows"] > max(lengths)  # and rows ran together
        assert engine.stats["steps_ahead"] > 0             # queued before the last step's tokens were read
    finally:
        engine.shutdown()
    want = [alone(model, p, n) for p, n in zip(ps, lengths)]
    assert got == want


def test_seeded_sampling_independent_of_batch(demo):
    model, tok = demo
    ps = prompts(6, 9, 5, seed=1)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    want = alone(model, ps[0], 5, params, seed=1234)
    engine = BatchEngine(model, tok, stop_ids=())
    try:
        solo = tokens(engine.submit(ps[0], params, 5, seed=1234))
        company = [engine.submit(ps[1], SamplingParams(temperature=0.7), 5, seed=9),
                   engine.submit(ps[0], params, 5, seed=1234),
                   engine.submit(ps[2], SamplingParams(), 4)]
        in_batch = tokens(company[1])
        other = tokens(company[0])
    finally:
        engine.shutdown()
    assert solo == want and in_batch == want
    assert other != want or ps[1] == ps[0]


def test_cancel_ends_request_and_leaves_others(demo):
    model, tok = demo
    ps = prompts(5, 6, seed=2)
    engine = BatchEngine(model, tok, stop_ids=())
    try:
        long = engine.submit(ps[0], max_tokens=200)
        other = engine.submit(ps[1], max_tokens=4)
        it = iter(long)
        next(it)
        long.cancel()
        rest = list(it)
        assert all(e.finish_reason is None for e in rest)   # cancelled: it ends without one
        assert len(rest) < 100
        assert tokens(other) == alone(model, ps[1], 4)
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            engine.submit([model.args.vocab_size], max_tokens=1)
        with pytest.raises(ValueError, match="max_tokens"):
            engine.submit(ps[0], max_tokens=0)
        with pytest.raises(ValueError, match="empty prompt"):     # one bad request: none is queued
            engine.submit_all([dict(prompt_ids=ps[0], max_tokens=1), dict(prompt_ids=[], max_tokens=1)])
        assert not engine._inbox
    finally:
        engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit(ps[0], max_tokens=1)


def test_faults_reach_their_requests_and_the_engine_goes_on(demo, monkeypatch):
    model, tok = demo
    p, q = prompts(5, 7, seed=9)
    engine = BatchEngine(model, tok, stop_ids=())
    faults = {"admit": 1, "step": 1}
    real_admit, real_step = engine._admit, DecodeBatch.step

    def admit():
        if faults["admit"]:
            faults["admit"] -= 1
            raise RuntimeError("admission fault")
        real_admit()

    def step(self, tokens):
        if faults["step"]:
            faults["step"] -= 1
            raise RuntimeError("decode fault")
        return real_step(self, tokens)

    engine._admit = admit
    monkeypatch.setattr(DecodeBatch, "step", step)
    try:
        with pytest.raises(RuntimeError, match="admission fault"):
            list(engine.submit(p, max_tokens=3))
        with pytest.raises(RuntimeError, match="decode fault"):   # its first token came from the prefill
            list(engine.submit(p, max_tokens=3))
        assert tokens(engine.submit(q, max_tokens=3)) == alone(model, q, 3)
    finally:
        engine.shutdown()


def test_shutdown_cancels_running_requests(demo):
    model, tok = demo
    engine = BatchEngine(model, tok, stop_ids=())
    h = engine.submit(prompts(4, seed=3)[0], max_tokens=500)
    next(iter(h))
    engine.shutdown(cancel=True, timeout=30)
    assert not engine._thread.is_alive()
    assert all(e.finish_reason is None for e in h) and not engine.busy


def test_prompt_cache_hit_equals_miss(demo):
    """A second turn resends the first turn's prompt and reply: it starts from the cache (all
    of the history but what differs) and gives the tokens a cold run gives."""
    model, tok = demo
    p, = prompts(9, seed=4)
    engine = BatchEngine(model, tok, stop_ids=())
    try:
        h1 = engine.submit(p, max_tokens=4)
        reply = tokens(h1)
        assert h1.cached_tokens == 0
        turn2 = p + reply + [17, 23]
        h2 = engine.submit(turn2, max_tokens=4)
        got = tokens(h2)
        assert h2.cached_tokens == len(p) + len(reply) - 1   # the cache held all but the last reply token
        h3 = engine.submit(p, max_tokens=4)                  # the same prompt again: all but one token reused
        again = tokens(h3)
        assert h3.cached_tokens == len(p) - 1
    finally:
        engine.shutdown()
    assert got == alone(model, turn2, 4)
    assert again == reply


def test_logprobs_are_log_softmax_of_the_logits(demo):
    model, tok = demo
    p, = prompts(6, seed=5)
    engine = BatchEngine(model, tok, stop_ids=())
    try:
        ev = next(iter(engine.submit(p, max_tokens=1, logprobs=3)))
        ev0 = next(iter(engine.submit(p, max_tokens=1, logprobs=0)))
        run = list(engine.submit(p, max_tokens=4, logprobs=2))     # later steps queued ahead
    finally:
        engine.shutdown()
    logits = np.array(model(mx.array([p]))[0, -1]).astype(np.float64)
    logp = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
    top = np.argsort(-logp)[:3]
    assert ev.token == int(top[0]) and abs(ev.logprob - logp[top[0]]) < 1e-4
    assert [t for t, _ in ev.top_logprobs] == [int(t) for t in top]
    assert np.allclose([v for _, v in ev.top_logprobs], logp[top], atol=1e-4)
    assert ev0.top_logprobs is None and abs(ev0.logprob - ev.logprob) < 1e-6
    assert [e.token for e in run] == alone(model, p, 4)
    for e in run:   # greedy: the chosen token is the best alternative, with the same logprob
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0] == (e.token, e.logprob)
        assert e.top_logprobs[1][1] <= e.logprob


def test_penalties_bias_and_logprobs_equal_generate_tokens(demo):
    """Requests with a repetition penalty, OpenAI's penalties, logit_bias, seeded sampling and
    logprobs, batched together: each gives generate_tokens' tokens alone and its logprobs (the
    float32 log-softmax of the adjusted logits) to float32 rounding."""
    model, tok = demo
    ps = prompts(7, 5, 9, 6, seed=11)
    first = alone(model, ps[2], 1)[0]
    asks = [(SamplingParams(repetition_penalty=1.3), None), (SamplingParams(presence_penalty=1.5,
                                                                             frequency_penalty=0.75), None),
            (SamplingParams(logit_bias=((first, -100.0),)), None),
            (SamplingParams(temperature=0.9, top_k=40, frequency_penalty=1.0), 77)]
    n = 8
    want = []
    for p, (params, seed) in zip(ps, asks):
        steps = list(generate_tokens(model, p, n, params, seed, stop_ids=(), draft="none", logprobs=True))
        want.append(([t for t, _ in steps], [float(s["logprobs"][t]) for t, s in steps]))
    assert want[2][0][0] != first                                 # the premise: the bias changes the text
    engine = BatchEngine(model, tok, stop_ids=())
    try:
        handles = engine.submit_all([dict(prompt_ids=p, params=params, max_tokens=n, seed=seed, logprobs=0)
                                     for p, (params, seed) in zip(ps, asks)])
        got = [list(h) for h in handles]
        assert engine.stats["decode_rows"] > engine.stats["steps"]   # rows ran together
    finally:
        engine.close()
    for events, (tokens_alone, lps) in zip(got, want):
        assert [e.token for e in events] == tokens_alone
        assert np.allclose([e.logprob for e in events], lps, atol=1e-4)


def fake_cache(n_tokens, width=8, layers=2, value=1.0):
    c = LatentCache(layers)
    c.set_left_padding(None, 1)
    for layer in c.layers:
        layer.append("kv", mx.full((1, n_tokens, width), value), 0)
    c.advance(n_tokens)
    return c


def test_prompt_cache_longest_prefix_and_copy():
    pc = PromptCache()
    short, long = fake_cache(3, value=1.0), fake_cache(6, value=2.0)
    pc.insert([1, 2, 3], short)
    pc.insert([1, 2, 9, 9, 9, 9], long)
    cache, n = pc.fetch([1, 2, 9, 9, 5])
    assert n == 4 and cache.offset == 4
    assert float(cache.layers[0].read("kv", 4).sum()) == 2.0 * 4 * 8
    cache.layers[0].buffers["kv"][:, 0] = 0                   # the copy owns its buffers
    assert float(long.layers[0].read("kv", 6).sum()) == 2.0 * 6 * 8
    cache, n = pc.fetch([1, 2, 3])                              # one token is left to prefill
    assert n == 2
    assert pc.fetch([7, 7]) == (None, 0)
    assert (pc.hits, pc.misses) == (2, 1)


def test_prompt_cache_byte_bound_evicts_least_recently_used():
    one = fake_cache(4).nbytes
    pc = PromptCache(max_bytes=2 * one + 1)
    pc.insert([1, 1, 1, 1], fake_cache(4))
    pc.insert([2, 2, 2, 2], fake_cache(4))
    pc.fetch([1, 1, 1, 1, 5])                                   # [1,...] is now the most recent
    pc.insert([3, 3, 3, 3], fake_cache(4))
    assert pc.keys() == [(1, 1, 1, 1), (3, 3, 3, 3)] and pc.nbytes == 2 * one and pc.evictions == 1
    assert not pc.insert([4] * 12, fake_cache(12, width=24))              # larger than the whole bound
    assert pc.insert([3, 3, 3, 3, 8], fake_cache(5))            # replaces its own prefix entry
    assert (3, 3, 3, 3) not in pc.keys() and pc.nbytes <= 2 * one
    pc0 = PromptCache(max_entries=0)
    assert not pc0.insert([1], fake_cache(1)) and len(pc0) == 0


def test_stop_token_ends_request_and_its_cache_is_reused(demo):
    """A request ending at a stop token while the next step was already queued with it: the
    stop token is its last event, the row fed ahead is taken back (the prompt cache gets
    exactly the prompt and the reply but the stop token), and a follow-up reuses it."""
    model, tok = demo
    p, q = prompts(8, 6, seed=7)
    ref = alone(model, p, 8)
    k = next(i for i in range(2, 8) if ref[i] not in ref[:i])
    engine = BatchEngine(model, tok, stop_ids=[ref[k]])
    try:
        h, other = engine.submit(p, max_tokens=8), engine.submit(q, max_tokens=8)
        events = list(h)
        list(other)
        assert [e.token for e in events] == ref[: k + 1] and events[-1].finish_reason == "stop"
        follow = p + ref[:k] + [31]
        h2 = engine.submit(follow, max_tokens=3)
        got = tokens(h2)
        assert h2.cached_tokens == len(p) + k            # the prompt and the reply before the stop token
        assert engine.stats["steps_ahead"] > 0
    finally:
        engine.shutdown()
    assert got == [t for t, _ in generate_tokens(model, follow, 3, stop_ids=[ref[k]], draft="none")]


@pytest.fixture
def metal(monkeypatch):
    """Every hot-path launch goes to the MSL simulator, as on a Mac (tests/msl)."""
    simulator = pytest.importorskip("msl.simulator")
    if simulator.unavailable_reason():
        pytest.skip(f"MSL simulator: {simulator.unavailable_reason()}")
    from moe_mla_oracle import route_launches_to_simulator

    yield route_launches_to_simulator(monkeypatch, simulator)
    kernels.moe.clear_banks()


def test_pooled_step_metal_kernels(metal, tmp_path):
    """A pooled step of three ragged sequences with the Metal kernels (in the simulator): one
    masked attention launch a layer over the three caches, rows of 3 through the GEMV and MoE
    kernels; logits equal each sequence's reference step."""
    from helpers_models import build_hf_model, save_checkpoint, state_dict_numpy, write_container
    from colibri_mlx.models.loading import load_model

    hf = build_hf_model("deepseek_v3", seed=2, first_k_dense_replace=1)
    path = save_checkpoint(hf, str(tmp_path / "hf"))
    write_container(state_dict_numpy(hf), path, str(tmp_path / "c"))
    model = load_model(tmp_path / "c", dtype="float32")
    ps = prompts(3, 6, 4, seed=8)
    ps = [[t % model.args.vocab_size for t in p] for p in ps]
    batch, want, own = DecodeBatch(model), [], []
    with kernels.dispatch.force_reference():
        for p in ps:
            c = model.make_cache()
            mx.eval(model(mx.array([p[:-1]]), c))
            own.append(copy_prefix(c, c.offset))
            want.append(np.array(model(mx.array([[p[-1]]]), own[-1])[0, -1]))
            batch.add(c)
    metal.clear()
    got = np.array(batch.step([p[-1] for p in ps]))
    attention = [name for name in metal if name.startswith("mla_attn")]
    assert len(attention) == len(model.layers), metal
    assert not kernels.dispatch.counters()["fallbacks"].get("mla_decode")
    for row, w in zip(got, want):
        assert np.abs(row - w).max() <= 1e-4 * np.abs(w).max()
    # a second step, over the rows the first one wrote
    nxt = [int(w.argmax()) for w in want]
    got = np.array(batch.step(nxt))
    with kernels.dispatch.force_reference():
        want = [np.array(model(mx.array([[t]]), c)[0, -1]) for t, c in zip(nxt, own)]
    for row, w in zip(got, want):
        assert np.abs(row - w).max() <= 1e-4 * np.abs(w).max()


def test_pooled_verify_step_metal_kernels(metal, tmp_path):
    """A pooled verify step (2, 4 and 1 rows of three sequences: rows of one sequence at
    consecutive positions, each attending to its slot's rows) with the Metal kernels in the
    simulator: the rows' logits equal each sequence's rows through the reference model."""
    from helpers_models import build_hf_model, save_checkpoint, state_dict_numpy, write_container
    from colibri_mlx.models.loading import load_model

    hf = build_hf_model("deepseek_v3", seed=3, first_k_dense_replace=1)
    path = save_checkpoint(hf, str(tmp_path / "hf"))
    write_container(state_dict_numpy(hf), path, str(tmp_path / "c"))
    model = load_model(tmp_path / "c", dtype="float32")
    V = model.args.vocab_size
    ps = [[t % V for t in p] for p in prompts(3, 6, 4, seed=12)]
    rows = [[5, 9], [1, 2, 3, 4], [8]]
    batch, want = DecodeBatch(model), []
    with kernels.dispatch.force_reference():
        for p, r in zip(ps, rows):
            c = model.make_cache()
            mx.eval(model(mx.array([p]), c))
            batch.add(copy_prefix(c, c.offset))
            want.append(np.array(model(mx.array([r]), c)[0]))
    metal.clear()
    _, logits = batch.verify(mx.array(sum(rows, []), dtype=mx.int32), [len(r) for r in rows])
    got = np.array(logits)
    assert len([name for name in metal if name.startswith("mla_attn")]) == len(model.layers), metal
    assert not kernels.dispatch.counters()["fallbacks"].get("mla_decode")
    want = np.concatenate(want)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_dsa_decode_rows_equal_each_sequence_alone(tmp_path):
    """decode_rows of a DSA model, contexts past index_topk (the indexer selects 8 of 9-13 keys):
    the rows' logits equal each sequence's own decode step, every cache (latent rows and indexer
    keys) advanced by one."""
    from helpers_models import build_config_model, save_checkpoint
    from colibri_mlx.models import load_model

    model = load_model(save_checkpoint(build_config_model("v32_groups"), str(tmp_path / "v32")), dtype="float32")
    ps = [[t % 250 for t in p] for p in prompts(9, 12, 10, seed=25)]
    caches, own = [], []
    for p in ps:
        c = model.make_cache()
        mx.eval(model(mx.array([p]), c))
        caches.append(c)
        own.append(np.array(model(mx.array([[p[-1]]]), copy_prefix(c, c.offset))[0, -1]))
    got = np.array(decode_rows(model, [p[-1] for p in ps], caches))
    for row, want in zip(got, own):
        assert np.abs(row - want).max() <= 1e-4 * np.abs(want).max()
    assert [c.offset for c in caches] == [len(p) + 1 for p in ps]
    for c, p in zip(caches, ps):
        assert c.layers[0].read("index_key", c.offset).shape[1] == len(p) + 1
    # a verify step of 3, 1 and 2 rows (causal over each sequence's rows, selection per row)
    rows = [[5, 6, 7], [8], [9, 10]]
    batch = DecodeBatch(model)
    own = []
    for c, r in zip(caches, rows):
        own.append(np.array(model(mx.array([r]), copy_prefix(c, c.offset))[0]))
        batch.add(c)
    before = kernels.dispatch.counters()["calls"].get("batch_decode/rows verify", 0)
    _, logits = batch.verify(mx.array(sum(rows, []), dtype=mx.int32), [len(r) for r in rows])
    want = np.concatenate(own)
    assert np.abs(np.array(logits) - want).max() <= 1e-4 * np.abs(want).max()
    assert kernels.dispatch.counters()["calls"]["batch_decode/rows verify"] == before + 1


def test_dsa_model_keeps_a_cache_per_sequence(tmp_path):
    """A DSA model (an indexer selects over each cache) cannot pool: the batch keeps one cache
    per sequence, runs the projections and the MoE over the rows together and each sequence's
    indexer and attention over its own cache; the engine's output equals each request alone,
    past index_topk tokens of context (where the selection starts to matter)."""
    from helpers_models import build_config_model, save_checkpoint
    from colibri_mlx.models import load_model

    model = load_model(save_checkpoint(build_config_model("v32_groups"), str(tmp_path / "v32")), dtype="float32")
    assert model.args.dsa and not DecodeBatch(model).pooled
    ps = [[t % 250 for t in p] for p in prompts(6, 10, seed=10)]      # index_topk = 8
    rows = kernels.dispatch.counters()["calls"].get("batch_decode/rows", 0)
    engine = BatchEngine(model, None, stop_ids=())
    try:
        got = [tokens(h) for h in engine.submit_all([dict(prompt_ids=p, max_tokens=5) for p in ps])]
    finally:
        engine.shutdown()
    assert got == [alone(model, p, 5) for p in ps]
    assert kernels.dispatch.counters()["calls"].get("batch_decode/rows", 0) > rows


# ----------------------------------------------------------------------------- speculation


def test_verify_step_equals_each_sequence_alone_and_rewinds(demo):
    """A pooled verify step of ragged row counts (1, 4 and 2 rows of three sequences, some rows
    rejected drafts): each sequence's logits equal its own rows through the model, and after a
    rewind to the kept rows the next step equals a cache that never saw the rejected ones."""
    model, _ = demo
    ps = prompts(5, 9, 3, seed=21)
    rows = [[7], [11, 12, 13, 14], [21, 22]]
    kept = [1, 2, 2]
    batch, own = DecodeBatch(model), []
    for p in ps:
        c = model.make_cache()
        mx.eval(model(mx.array([p]), c))
        batch.add(copy_prefix(c, c.offset))
        own.append(c)
    before = kernels.dispatch.counters()["calls"].get("batch_decode/pooled verify", 0)
    h, logits = batch.verify(mx.array(sum(rows, []), dtype=mx.int32), [len(r) for r in rows])
    assert kernels.dispatch.counters()["calls"]["batch_decode/pooled verify"] == before + 1
    assert h.shape == (7, model.args.hidden_size) and logits.shape == (7, model.args.vocab_size)
    a = 0
    for i, (r, c) in enumerate(zip(rows, own)):
        want = np.array(model(mx.array([r]), copy_prefix(c, c.offset))[0])
        got = np.array(logits[a: a + len(r)])
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
        assert batch.length(i) == len(ps[i]) + len(r)
        batch.rewind(i, len(ps[i]) + kept[i])
        mx.eval(model(mx.array([r[: kept[i]]]), c))          # the kept rows only
        a += len(r)
    nxt = [3, 4, 5]
    got = np.array(batch.step(nxt))
    for row, t, c in zip(got, nxt, own):
        want = np.array(model(mx.array([[t]]), c)[0, -1])
        assert np.abs(row - want).max() <= 1e-4 * np.abs(want).max()
    with pytest.raises(ValueError, match="rewind: 99 rows"):
        batch.rewind(0, 99)


def test_speculating_requests_equal_each_request_alone(demo):
    """MTP and n-gram drafts of several widths, greedy with and without a repetition penalty,
    beside plain requests; requests join while others run and prefill in chunks. Each request
    gives exactly its tokens alone; drafts were both kept and rejected."""
    model, tok = demo
    text = tok.encode("And God said, Let there be light: and there was light. And God saw the light, that it was")
    ps = [text, text[:11], prompts(7, seed=22)[0], text[4:], text[:6]]
    asks = [dict(draft="mtp", num_draft=3), dict(draft="ngram", num_draft=2), dict(),
            dict(draft="mtp", num_draft=1, params=SamplingParams(repetition_penalty=1.4)),
            dict(draft="ngram", num_draft=7)]
    lengths = [20, 14, 9, 16, 12]
    engine = BatchEngine(model, tok, prefill_step_size=5, stop_ids=())
    try:
        first = engine.submit(ps[0], max_tokens=lengths[0], **asks[0])
        it = iter(first)
        head = [next(it).token, next(it).token]
        later = engine.submit_all([dict(prompt_ids=p, max_tokens=n, **a)
                                   for p, n, a in zip(ps[1:], lengths[1:], asks[1:])])
        got = [head + [e.token for e in it]] + [tokens(h) for h in later]
        stats = dict(engine.stats)
        per_request = [h.stats for h in [first] + later]
    finally:
        engine.shutdown()
    want = [alone(model, p, n, a.get("params", SamplingParams())) for p, n, a in zip(ps, lengths, asks)]
    assert got == want
    assert 0 < stats["draft_accepted"] < stats["draft_proposed"], stats
    assert stats["verify_steps"] > 0
    assert "draft_steps" not in per_request[2] and per_request[0]["draft_steps"] > 0


def test_mtp_requests_draft_together_as_each_alone(demo):
    """Two and three MTP requests running together draft through one MTP layer step a draft
    (propose_rows, observe_rows) and each gives its tokens alone."""
    model, tok = demo
    text = tok.encode("In the beginning God created the heaven and the earth. And the earth was without form")
    ps = [text, text[3:], text[:9]]
    lengths = [18, 15, 12]
    before = kernels.dispatch.counters()["calls"].get("batch_decode/mtp rows", 0)
    engine = BatchEngine(model, tok, stop_ids=(), draft="mtp")
    try:
        got = [tokens(h) for h in engine.submit_all([dict(prompt_ids=p, max_tokens=n) for p, n in zip(ps, lengths)])]
        stats = dict(engine.stats)
    finally:
        engine.shutdown()
    assert got == [alone(model, p, n) for p, n in zip(ps, lengths)]
    assert stats["draft_accepted"] > 0
    assert kernels.dispatch.counters()["calls"].get("batch_decode/mtp rows", 0) > before


def test_mtp_drafts_of_several_requests_equal_each_alone(demo):
    """propose_rows / observe_rows (the MTP layer over the rows of several requests, each on
    its own cache) against each request's own MTPDraft: the same greedy drafts of ragged
    lengths, the same logits and hidden rows after observing ragged rows, and the caches left
    so that the next drafts agree too."""
    model, _ = demo
    D = model.args.hidden_size
    ps = prompts(6, 11, 8, seed=31)

    def drafter(p):
        cache = model.make_cache()
        x = model.hidden_states(mx.array([p]), cache)
        d = MTPDraft(model, cache)
        d.observe(rms_norm(x, model.norm, model.args.rms_norm_eps), p[1:] + [5])
        return d

    def greedy(logits, drafts):
        return mx.argmax(logits), None

    def ints(proposed):
        return [[int(t) for t in drafts] for drafts, _ in proposed]

    alone, together = [drafter(p) for p in ps], [drafter(p) for p in ps]
    ks = [3, 1, 2]
    want = ints([d.propose(k, greedy) for d, k in zip(alone, ks)])
    before = kernels.dispatch.counters()["calls"].get("batch_decode/mtp rows", 0)
    assert ints(propose_rows(together, ks, [greedy] * 3)) == want
    assert kernels.dispatch.counters()["calls"]["batch_decode/mtp rows"] == before + 1   # rows 2 then 1 (alone)
    assert [d.cache.offset for d in together] == [d.cache.offset for d in alone]

    rng = np.random.default_rng(32)
    # 6 rows in one step of the layer; then 4 + 3 rows in one and 5 alone (8 rows a step at most)
    for widths in ((2, 1, 3), (4, 3, 5)):
        hidden = [mx.array(rng.standard_normal((m, D)).astype(np.float32)) for m in widths]
        tokens = [[int(t) for t in rng.integers(4, 4000, m)] for m in widths]
        for d, h, t in zip(alone, hidden, tokens):
            d.observe(h[None], t)
        observe_rows(together, hidden, tokens)
        for a, b in zip(alone, together):
            for x, y in ((a.logits, b.logits), (a.x, b.x)):
                assert x.shape == y.shape
                assert np.abs(np.array(x) - np.array(y)).max() <= 1e-5 * np.abs(np.array(x)).max()
    assert ints(propose_rows(together, [3, 3, 3], [greedy] * 3)) == \
        ints([d.propose(3, greedy) for d in alone])


def test_seeded_speculative_sampling_independent_of_batch(demo):
    """A seeded sampling request that speculates draws its own drafts and acceptances whatever
    runs beside it: its tokens alone in the engine, in a full batch, and from generate_tokens
    with the same draft and seed are the same."""
    model, tok = demo
    p, q, s = prompts(8, 5, 6, seed=23)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    want = [t for t, _ in generate_tokens(model, p, 12, params, 99, stop_ids=(), draft="mtp", num_draft=2)]
    engine = BatchEngine(model, tok, stop_ids=())
    try:
        solo = tokens(engine.submit(p, params, 12, seed=99, draft="mtp", num_draft=2))
        company = engine.submit_all([dict(prompt_ids=q, max_tokens=12, draft="ngram"),
                                     dict(prompt_ids=p, params=params, max_tokens=12, seed=99, draft="mtp",
                                          num_draft=2),
                                     dict(prompt_ids=s, params=SamplingParams(temperature=1.0), max_tokens=10),
                                     dict(prompt_ids=q, params=params, max_tokens=7, seed=5, draft="mtp")])
        in_batch = [tokens(h) for h in company][1]
    finally:
        engine.shutdown()
    assert solo == want and in_batch == want


def test_speculative_stop_inside_drafts_leaves_its_cache(demo):
    """A stop id among the kept drafts ends the request there; its cache (rewound to the tokens
    before the stop) serves the next turn, which gives a cold run's tokens."""
    model, tok = demo
    text = tok.encode("In the beginning God created the heaven and the earth. And the earth was")
    ref = alone(model, text, 12)
    k = 7
    engine = BatchEngine(model, tok, stop_ids=[ref[k]], draft="mtp", num_draft=4)
    try:
        h = engine.submit(text, max_tokens=12)
        got = tokens(h)
        follow = text + got + [17]
        h2 = engine.submit(follow, max_tokens=3, draft="none")
        again = tokens(h2)
        assert h2.cached_tokens == len(text) + len(got) - 1
        assert engine.stats["draft_accepted"] > 0
    finally:
        engine.shutdown()
    assert got == ref[: ref.index(ref[k]) + 1]
    assert again == [t for t, _ in generate_tokens(model, follow, 3, stop_ids=[ref[k]], draft="none")]


def test_speculation_refusals(demo):
    model, tok = demo
    engine = BatchEngine(model, tok, draft="ngram")
    try:
        with pytest.raises(ValueError, match="need draft='none'"):
            engine.submit([5, 6], max_tokens=2, logprobs=0, draft="mtp")
        with pytest.raises(ValueError, match="num_draft must be an integer in 1..7"):
            engine.submit([5, 6], max_tokens=2, num_draft=8)
        with pytest.raises(ValueError, match="draft must be one of"):
            engine.submit([5, 6], max_tokens=2, draft="medusa")
        ev = list(engine.submit([5, 6], max_tokens=2, logprobs=0))      # the engine's default yields to plain
        assert ev[0].logprob is not None
    finally:
        engine.shutdown()


def test_dsa_model_speculates_with_a_cache_per_sequence(tmp_path):
    """A DSA model's separate caches take verify steps too (each sequence's rows through the
    model's own pass, its indexer keys rolled back with the latent rows), past index_topk."""
    from helpers_models import build_config_model, save_checkpoint
    from colibri_mlx.models import load_model

    model = load_model(save_checkpoint(build_config_model("v32_groups"), str(tmp_path / "v32")), dtype="float32")
    ps = [[t % 250 for t in p] for p in prompts(6, 10, seed=10)]
    ps[0] = ps[0] + ps[0] + ps[0]                                       # repeats: n-gram drafts are kept
    engine = BatchEngine(model, None, stop_ids=(), draft="ngram", num_draft=3)
    try:
        got = [tokens(h) for h in engine.submit_all([dict(prompt_ids=p, max_tokens=12) for p in ps])]
        assert engine.stats["verify_steps"] > 0 and engine.stats["draft_proposed"] > 0
    finally:
        engine.shutdown()
    assert got == [alone(model, p, 12) for p in ps]


def test_prompt_cache_keeps_the_mtp_rows(demo, monkeypatch):
    """A request that drafted with the MTP layer leaves that layer's rows with its cache: the next
    turn starts from both (the layer's rows of the shared history are not zeros) and gives the
    tokens of a cold run."""
    model, tok = demo
    text = tok.encode("And God called the light Day, and the darkness he called Night. And the evening")
    engine = BatchEngine(model, tok, stop_ids=(), draft="mtp")
    fetched = []
    real = engine.prompt_cache.fetch

    def fetch(tokens):
        cache, n = real(tokens)
        mtp = getattr(cache, "mtp_cache", None)
        # what the request starts from (the engine goes on to extend these caches)
        fetched.append((n, None if mtp is None else (mtp.offset, np.array(mtp.layers[0].read("kv", mtp.offset)))))
        return cache, n

    monkeypatch.setattr(engine.prompt_cache, "fetch", fetch)
    try:
        reply = tokens(engine.submit(text, max_tokens=8))
        follow = text + reply + [17]
        h = engine.submit(follow, max_tokens=6)
        got = tokens(h)
    finally:
        engine.shutdown()
    n, (mtp_rows, rows) = fetched[-1]
    assert n == h.cached_tokens == len(text) + len(reply) - 1
    assert mtp_rows == n and rows.shape[1] == n
    assert np.abs(rows).sum(axis=-1).min() > 0                  # every shared position has its row
    assert got == alone(model, follow, 6)


def test_speculating_requests_cancel_and_faults(demo, monkeypatch):
    """A verify step that fails reaches the requests in it and the engine goes on; a speculating
    request cancelled mid-run ends without a finish_reason while the others keep their tokens."""
    model, tok = demo
    p, q = prompts(6, 8, seed=24)
    engine = BatchEngine(model, tok, stop_ids=(), draft="ngram")
    faults = {"verify": 1}
    real = DecodeBatch.verify

    def verify(self, ids, counts):
        if faults["verify"]:
            faults["verify"] -= 1
            raise RuntimeError("verify fault")
        return real(self, ids, counts)

    monkeypatch.setattr(DecodeBatch, "verify", verify)
    try:
        with pytest.raises(RuntimeError, match="verify fault"):
            list(engine.submit(p, max_tokens=5))
        long = engine.submit(p, max_tokens=300, draft="mtp")
        other = engine.submit(q, max_tokens=6, draft="mtp", num_draft=2)
        it = iter(long)
        next(it)
        next(it)
        long.cancel()
        rest = list(it)
        assert all(e.finish_reason is None for e in rest) and len(rest) < 100
        assert tokens(other) == alone(model, q, 6)
        assert engine.stats["verify_steps"] > 0
    finally:
        engine.shutdown()


# A model thread's MLX work, then the engines' last call, then the process exits at once.
EXIT_AFTER_MODEL_THREAD = """
import threading
import threading

import mlx.core as mx
from colibri_mlx.serve_engine import end_model_thread

def model_thread():
    step = mx.compile(lambda a: (a @ a).sum())
    a = mx.random.normal((256, 256))
    for _ in range(5):
        mx.eval(step(a))
    end_model_thread()

t = threading.Thread(target=model_thread, daemon=True)
t.start()
t.join()
"""


def test_process_exits_cleanly_right_after_a_model_thread():
    """``end_model_thread`` tears down MLX's state of the thread before the thread exits: left
    to the thread's exit, that teardown can run beside the interpreter's when the process exits
    right after the engine closes, and MLX aborts ("terminate called without an active
    exception", about 7 % of such processes on the CPU backend). 40 processes, each exits 0."""
    import subprocess
    import sys

    failed = []
    for _ in range(5):
        procs = [subprocess.Popen([sys.executable, "-c", EXIT_AFTER_MODEL_THREAD], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(8)]
        for p in procs:
            _, err = p.communicate(timeout=120)
            if p.returncode != 0:
                failed.append((p.returncode, err[-300:]))
    assert not failed, failed


@pytest.mark.parametrize("engine", ["BatchEngine", "SerialEngine"])
def test_model_thread_ends_with_end_model_thread(demo, monkeypatch, engine):
    """Each engine's model thread makes end_model_thread its last call, on that thread."""
    from colibri_mlx import batch_engine, serve_engine

    ended = []

    def spy():
        ended.append(threading.current_thread().name)
        real()

    real = serve_engine.end_model_thread
    monkeypatch.setattr(batch_engine, "end_model_thread", spy)
    monkeypatch.setattr(serve_engine, "end_model_thread", spy)
    model, tok = demo
    if engine == "BatchEngine":
        e = BatchEngine(model, tok, stop_ids=())
        assert len(tokens(e.submit([5, 6, 7], max_tokens=3))) == 3
        e.shutdown()
        assert ended == ["colibri-batch-engine"]
    else:
        e = serve_engine.SerialEngine(model, tok)
        assert len([ev.token for ev in e.submit([5, 6, 7], SamplingParams(), 3, draft="none")]) == 3
        e.close()
        assert ended == ["colibri-generate"]

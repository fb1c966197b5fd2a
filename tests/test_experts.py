"""ExpertStore pieces on their own: .coli_usage format, read layout, cache policy, read pool.

Oracles: upstream's file format written out by hand (docs/format.md#usage-history), FNV-1a 32 reference
values, the container's own tensor views (bytes and scales), and a dictionary-based LRU model
of the cache replayed on the same access sequence.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict

import numpy as np
import pytest

from colibri_mlx.container import Container, write_shard
from colibri_mlx.experts import (ExpertStore, ReadPool, UsageError, UsageHistory, engine_id, plan_expert, read_usage,
                                 write_usage)
from colibri_mlx.experts.prefetch import DEMAND, PREFETCH
from colibri_mlx.formats import QTensor, encode

from test_streaming_model import build_container


# ----------------------------------------------------------------------------------- usage


def test_engine_id_is_fnv1a_32():
    # Reference values of the FNV-1a 32 test suite.
    assert engine_id("") == 0x811C9DC5
    assert engine_id("a") == 0xE40C292C
    assert engine_id("foobar") == 0xBF9CF968
    assert engine_id("glm_moe_dsa") == _fnv1a_bytes(b"glm_moe_dsa")


def _fnv1a_bytes(data: bytes) -> int:
    h = 2166136261
    for b in data:
        h = (h ^ b) * 16777619 % 2**32
    return h


def test_usage_written_in_upstream_format(tmp_path):
    h = UsageHistory.empty(n_layers=3, n_experts=5)
    h.record(1, np.array([[4, 0, -1], [4, 2, 0]]))  # -1: slot dropped by top-p, not counted
    h.record(3, np.array([1]))  # row n_layers = MTP
    path = tmp_path / ".coli_usage"
    write_usage(path, h, "glm_moe_dsa")
    assert path.read_text() == f"-1 3 5\n-2 1 {engine_id('glm_moe_dsa')}\n1 0 2\n1 2 1\n1 4 2\n3 1 1\n"
    back = read_usage(path)
    np.testing.assert_array_equal(back.counts, h.counts)
    assert back.engine == engine_id("glm_moe_dsa")
    assert not [f for f in os.listdir(tmp_path) if f != ".coli_usage"]  # no temporary left behind


def test_usage_legacy_headerless_and_hottest(tmp_path):
    path = tmp_path / "u"
    path.write_text("0 3 7\n2 1 9\n\n0 0 7\n2 1 1\n")  # repeated records add up
    h = read_usage(path)
    assert h.engine is None and h.counts.shape == (3, 4)
    assert h.counts[2, 1] == 10
    assert h.hottest() == [(2, 1), (0, 0), (0, 3)]  # count desc, ties by layer then expert
    assert h.total == 24


@pytest.mark.parametrize("text, message", [
    ("-1 2 4\n3 0 1\n", "outside the declared"),
    ("-1 2 4\n0 5 1\n", "outside the declared"),
    ("0 1\n", "expected '<layer> <expert> <count>'"),
    ("0 x 1\n", "three integers"),
    ("0 1 -3\n", "negative"),
    ("-2 2 5\n", "format version 2"),
    ("-7 1 1\n", "unknown header record"),
])
def test_usage_malformed_is_refused_with_file_and_line(tmp_path, text, message):
    path = tmp_path / "u"
    path.write_text(text)
    with pytest.raises(UsageError, match=message) as e:
        read_usage(path)
    assert str(path) in str(e.value)


def test_usage_binary_iku1_refused_by_name(tmp_path):
    path = tmp_path / "u"
    path.write_bytes(b"IKU1" + bytes(16))
    with pytest.raises(UsageError, match="IKU1"):
        read_usage(path)


# ---------------------------------------------------------------------------------- layout


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("experts") / "m")
    build_container(path)
    return path


def test_expert_is_two_coalesced_reads_matching_the_container(small):
    c = Container(small)
    shapes = {"gate": (32, 64), "up": (32, 64), "down": (64, 32)}
    store = ExpertStore(c, 0, record_usage=False)
    # All read first, compared after: every read goes through the same staging buffer, so an
    # expert aliasing it instead of owning a copy would show the last expert's bytes.
    loaded = {key: store._read(key).weights for key in store.layouts}
    for key, layout in store.layouts.items():
        assert len(layout.reads) == 2  # scales block + weights block (writer order, docs/format.md#tensor-order)
        for proj, qt in zip(("gate", "up", "down"), loaded[key]):
            name = f"model.layers.{key[0]}.mlp.experts.{key[1]}.{proj}_proj.weight"
            want = c.tensor(name, shapes[proj])
            assert (qt.fmt, qt.gs, qt.O, qt.I) == (want.fmt, want.gs, want.O, want.I)
            np.testing.assert_array_equal(np.array(qt.packed), want.packed)
            np.testing.assert_array_equal(np.array(qt.scales), want.scales)
    assert store.stats.bytes_read == store.total_expert_bytes
    store.close()


def test_split_expert_falls_back_to_per_tensor_reads(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {}
    for proj, (O, I) in (("gate", (32, 64)), ("up", (32, 64)), ("down", (64, 32))):
        w = rng.standard_normal((O, I)).astype(np.float32)
        packed, scales = encode(4, w, 32)
        tensors[f"model.layers.0.mlp.experts.0.{proj}_proj.weight"] = QTensor(packed, scales, 4, O, I, 32)
    names = sorted(tensors)  # down, gate | up: the expert straddles two shards
    # An unrelated tensor sorting between down and gate breaks the weights run in shard a.
    interloper = {"model.layers.0.mlp.experts.0.extra": np.arange(7, dtype=np.uint8)}
    write_shard(tmp_path / "a.safetensors", {**{n: tensors[n] for n in names[:2]}, **interloper})
    write_shard(tmp_path / "b.safetensors", {n: tensors[n] for n in names[2:]})
    c = Container(str(tmp_path), config={})
    layout = plan_expert(c, 0, 0, {"gate": (32, 64), "up": (32, 64), "down": (64, 32)})
    nb = {n: c.info(n).nbytes for n in c.names()}
    down, gate, up = names
    # a: [down.qs gate.qs down][extra][gate] -> 2 reads; b: [up.qs up] -> 1 read.
    assert sorted((os.path.basename(r.path), r.nbytes) for r in layout.reads) == sorted([
        ("a.safetensors", nb[down + ".qs"] + nb[gate + ".qs"] + nb[down]), ("a.safetensors", nb[gate]),
        ("b.safetensors", nb[up + ".qs"] + nb[up])])
    store_weights = ExpertStore.__new__(ExpertStore)  # only the reader is needed
    store_weights._fds = {r.path: os.open(r.path, os.O_RDONLY) for r in layout.reads}
    from colibri_mlx.experts.store import _projection

    buffers = [store_weights._pread(layout, r) for r in layout.reads]
    for p in layout.projections:
        qt = _projection(p, buffers)
        np.testing.assert_array_equal(np.array(qt.packed), c.tensor(p.weight.name, (p.O, p.I)).packed)
        np.testing.assert_array_equal(np.array(qt.scales), c.tensor(p.weight.name, (p.O, p.I)).scales)
    for fd in store_weights._fds.values():
        os.close(fd)
    assert sum(r.nbytes for r in layout.reads) == sum(t.nbytes for t in tensors.values())


# ----------------------------------------------------------------------------------- cache


def _lru_model(accesses, sizes, capacity):
    """Plain LRU over (layer, expert) keys with byte sizes: returns hit flags."""
    cache, used, hits = OrderedDict(), 0, []
    for key in accesses:
        if key in cache:
            cache.move_to_end(key)
            hits.append(True)
            continue
        hits.append(False)
        if sizes[key] > capacity:
            continue
        while used + sizes[key] > capacity:
            _, s = cache.popitem(last=False)
            used -= s
        cache[key] = sizes[key]
        used += sizes[key]
    return hits


def test_lru_matches_model_and_never_exceeds_budget(small):
    c = Container(small)
    probe = ExpertStore(c, 0, record_usage=False)
    sizes = {k: l.nbytes for k, l in probe.layouts.items()}
    probe.close()
    rng = np.random.default_rng(0)
    keys = list(sizes)
    accesses = [keys[i] for i in rng.zipf(1.3, 400) % len(keys)]
    for capacity in (0, 3 * max(sizes.values()), sum(sizes.values()) // 3):
        store = ExpertStore(c, capacity, record_usage=False, prefetch=False, admission=False)
        hits = []
        for key in accesses:
            before = store.stats.hits_lru
            store.get(*key)
            hits.append(store.stats.hits_lru > before)
            assert store.cached_bytes <= capacity
        assert hits == _lru_model(accesses, sizes, capacity)
        store.close()


def _admission_lru_model(rounds, capacity, freq, window):
    """LRU of equal-sized items that admits a newcomer only if it was selected at least as often
    (history + this run, halved once ``window`` selections are reached) as the LRU victim. Each round counts
    its selections first (the router), then looks them up in order."""
    cache, hits, seen = OrderedDict(), [], 0
    for chosen in rounds:
        for key in chosen:
            freq[key] = freq.get(key, 0) + 1
        seen += len(chosen)
        if seen >= window:  # aged after the round that reaches the window
            freq = {k: v / 2 for k, v in freq.items()}
            seen = 0
        for key in chosen:
            if key in cache:
                cache.move_to_end(key)
                hits.append(True)
                continue
            hits.append(False)
            if len(cache) == capacity:
                if freq[key] < freq.get(next(iter(cache)), 0):
                    continue
                cache.popitem(last=False)
            cache[key] = True
    return hits


def test_admission_keeps_hot_experts_when_the_cache_is_smaller_than_a_token(small, tmp_path):
    c = Container(small)
    probe = ExpertStore(c, 0, record_usage=False)
    one = probe.layouts[(1, 0)].nbytes
    hot_a, hot_b, cold = [e for e in range(12) if probe.layouts[(1, e)].nbytes == one][:3]  # fmt cycles by id
    probe.close()
    usage = tmp_path / "u"
    h = UsageHistory.empty(4, 12, engine_id("deepseek_v3"))
    h.counts[1, [hot_a, hot_b]] = [9, 7]  # hot in the history
    write_usage(usage, h, "deepseek_v3")
    chosen = [(1, hot_a), (1, hot_b), (1, cold)]  # one token's set: one expert more than the cache
    capacity, rounds = 2, 60
    results = {}
    for admission in (True, False):
        store = ExpertStore(c, capacity * one, usage_path=str(usage), record_usage=False, prefetch=False,
                            admission=admission)
        store._freq_window = 37
        hits = []
        for _ in range(rounds):
            store.prepare(1, np.array([[hot_a, hot_b, cold]]))
            for key in chosen:
                before = store.stats.hits_lru
                store.get(*key)
                hits.append(store.stats.hits_lru > before)
                assert store.cached_bytes <= capacity * one
        results[admission] = sum(hits)
        if admission:
            freq = {(1, e): float(n) for e, n in enumerate(h.counts[1]) if n}
            assert hits == _admission_lru_model([chosen] * rounds, capacity, freq, 37)
            assert store.stats.bypassed > 0
        store.close()
    # The loop evicts the hot pair every round under plain LRU; admission keeps it while its lead lasts.
    assert results[False] == 0 and results[True] > rounds  # of 120 hot lookups (aging lets the loop in now and then)
    # A cache that holds the whole token is a plain LRU, admission or not.
    store = ExpertStore(c, 3 * one, usage_path=str(usage), record_usage=False, prefetch=False)
    for _ in range(3):
        store.prepare(1, np.array([[hot_a, hot_b, cold]]))
        for key in chosen:
            store.get(*key)
    assert store.stats.hits_lru == 6 and store.stats.bypassed == 0
    store.close()


def test_pinned_experts_stay_and_count_against_the_budget(small, tmp_path):
    c = Container(small)
    usage = tmp_path / "u"
    h = UsageHistory.empty(4, 12, engine_id("deepseek_v3"))
    h.counts[1, 3], h.counts[2, 7], h.counts[3, 0] = 50, 40, 30
    write_usage(usage, h, "deepseek_v3")
    probe = ExpertStore(c, 0, record_usage=False)
    size = {k: l.nbytes for k, l in probe.layouts.items()}
    probe.close()
    pin_bytes = size[(1, 3)] + size[(2, 7)]
    budget = pin_bytes + max(size.values())
    store = ExpertStore(c, budget, pin="auto", pin_bytes=pin_bytes, usage_path=str(usage), record_usage=False)
    assert store.pinned_keys == {(1, 3), (2, 7)}
    assert store.lru_capacity == budget - pin_bytes
    for key in list(size) * 2:
        store.get(*key)
        assert store.cached_bytes <= budget
    assert set(store._pinned) == {(1, 3), (2, 7)}
    assert store.stats.hits_pinned == 4
    store.close()


def test_usage_of_another_engine_is_not_used_and_says_so(small, tmp_path):
    usage = tmp_path / "u"
    h = UsageHistory.empty(4, 12)
    h.counts[1, 1] = 9
    write_usage(usage, h, "glm_moe_dsa")
    with pytest.warns(UserWarning, match="another engine"):
        store = ExpertStore(Container(small), 10**6, pin="auto", usage_path=str(usage))
    assert not store.pinned_keys and store.usage.total == 0
    store.close()


def test_prefetch_reads_previous_token_set_of_next_layer(small):
    store = ExpertStore(Container(small), 0, record_usage=False)
    ids = {1: np.array([[0, 4, 5]]), 2: np.array([[1, 2, 3]]), 3: np.array([[6, 7, 8]])}
    for layer in (1, 2, 3):  # token 1: every read is a demand miss
        store.prepare(layer, ids[layer])
        for e in ids[layer][0]:
            store.get(layer, int(e))
    assert store.stats.misses == 9 and store.stats.hits_prefetch == 0
    for layer in (1, 2, 3):  # token 2, same choices: layers 2 and 3 were guessed one layer early
        store.prepare(layer, ids[layer])
        for e in ids[layer][0]:
            store.get(layer, int(e))
    assert store.stats.hits_prefetch == 9  # layer 1 was guessed after layer 3 of token 1 (wrap-around)
    assert store.stats.tokens == 2
    store.close()


def test_guesses_still_issued_when_the_layer_fills_every_read_slot(small):
    # K (3) > max_inflight (2): the layer's own reads take every slot at prepare time; guesses
    # must take the slots freed as those reads are consumed, never ahead of a demand read.
    store = ExpertStore(Container(small), 0, record_usage=False, max_inflight=2, workers=1)
    ids = {1: np.array([[0, 4, 5]]), 2: np.array([[1, 2, 3]]), 3: np.array([[6, 7, 8]])}
    submitted = []
    submit = store._pool.submit
    store._pool.submit = lambda fn, kind: submitted[-1].append(kind) or submit(fn, kind)
    for token in range(3):
        for layer in (1, 2, 3):
            submitted.append([])
            store.prepare(layer, ids[layer])
            assert len(store._inflight) <= 2
            for e in ids[layer][0]:
                store.get(layer, int(e))
    # Each layer submits its remaining demand read before any guess, and guesses the next layer
    # (wrapping to layer 1) in the two slots freed by its last two lookups: from the last layer of
    # token 1 on, 2 guesses per layer (14), all used except the 2 issued for a 4th token (12).
    assert all(kinds == sorted(kinds) for kinds in submitted)
    assert submitted[2] == [DEMAND, DEMAND, DEMAND, PREFETCH, PREFETCH]
    assert (store.stats.prefetches, store.stats.hits_prefetch) == (14, 12)
    assert store.stats.misses + store.stats.hits_prefetch == 27 and store.stats.bytes_wasted == 0
    store.close()


# ------------------------------------------------------------------------------------- pool


def test_read_pool_runs_demand_before_queued_prefetch():
    pool = ReadPool(1)
    gate = threading.Event()
    order = []
    blocker = pool.submit(gate.wait, DEMAND)
    futures = [pool.submit(lambda i=i: order.append(("p", i)), PREFETCH) for i in range(3)]
    futures += [pool.submit(lambda i=i: order.append(("d", i)), DEMAND) for i in range(2)]
    cancelled = futures[1].cancel()
    gate.set()
    for f in futures:
        if not f.cancelled():
            f.result(timeout=5)
    assert blocker.result(timeout=5)
    assert cancelled and order == [("d", 0), ("d", 1), ("p", 0), ("p", 2)]
    pool.close()


def test_read_pool_passes_exceptions_to_the_waiter():
    pool = ReadPool(2)
    fut = pool.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        fut.result(timeout=5)
    pool.close()

"""The CPU backend's dequantized-weight cache (kernels.reference.DequantCache): bit-identical
results, a byte budget, entries that die with their QTensor, streamed experts never cached."""

from __future__ import annotations

import dataclasses
import gc

import mlx.core as mx
import pytest

from kernel_oracle import random_qtensor, random_x

from colibri_mlx.kernels import reference
from colibri_mlx.kernels.reference import DequantCache


@pytest.mark.parametrize("fmt", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("shape", [(33, 1000), (2048, 8200)])  # the second is tiled by qmatmul (> 2^24)
def test_cached_qmatmul_is_bit_identical(fmt, shape):
    qt = random_qtensor(fmt, *shape, gs=64 if fmt == 4 else None, seed=fmt).to_mlx()
    for S in (1, 12):
        x = random_x(S, shape[1], dtype=mx.float32, seed=S)
        want = reference.qmatmul(x, qt)
        assert mx.array_equal(reference.cached_qmatmul(x, qt), want)
        assert mx.array_equal(reference.cached_qmatmul(x, qt), want)  # the hit, too


def test_budget_evicts_least_recently_used():
    a, b, c = (random_qtensor(4, 64, 256, gs=64, seed=s).to_mlx() for s in range(3))
    cache = DequantCache(budget_bytes=2 * 4 * 64 * 256)   # room for two
    wa = cache.get(a)
    cache.get(b)
    assert cache.get(a) is wa and cache.hits == 1       # a is now the most recent
    cache.get(c)                                         # evicts b
    assert cache.used == 2 * 4 * 64 * 256
    assert cache.get(a) is wa and cache.get(b) is not None and cache.misses == 4
    assert DequantCache(budget_bytes=100).get(a) is None   # larger than the whole budget


def test_a_weight_evicted_and_cached_again_keeps_one_finalizer():
    a, b = (random_qtensor(4, 64, 256, gs=64, seed=s).to_mlx() for s in range(2))
    cache = DequantCache(budget_bytes=4 * 64 * 256)   # room for one: a and b evict each other
    for _ in range(5):
        cache.get(a)
        cache.get(b)
    assert cache.misses == 10 and cache._watched == {id(a), id(b)}
    assert sum(f.alive for f in weakref_finalizers_of(a)) == 1


def weakref_finalizers_of(obj):
    import weakref

    return [f for f in weakref.finalize._registry if f.peek() and f.peek()[0] is obj]


def test_entry_dies_with_its_qtensor():
    cache = DequantCache(budget_bytes=1 << 30)
    qt = random_qtensor(2, 16, 64, seed=1).to_mlx()
    cache.get(qt)
    assert cache.used > 0
    del qt
    gc.collect()
    assert cache.used == 0 and not cache._entries and not cache._watched


def test_streamed_experts_are_not_cached():
    qt = dataclasses.replace(random_qtensor(4, 16, 64, gs=64, seed=2).to_mlx(), streamed=True)
    cache = DequantCache(budget_bytes=1 << 30)
    assert cache.get(qt) is None and cache.used == 0
    assert qt.to_mlx().streamed

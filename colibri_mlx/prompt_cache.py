"""Prompt cache: latent caches of earlier requests, found by the longest shared token prefix.

A finished request leaves its cache (its prompt and every generated token but the last) under
those tokens. A new request starts from the entry sharing the longest prefix with its prompt:
a copy of that entry cut to the shared prefix, so only the rest of the prompt is prefilled
(a multi-turn chat prefills only the new turn). At least one prompt token is always left to
prefill (its logits give the first token). Entries are kept in least-recently-used order and
bounded in bytes of cache buffers (``max_bytes``) and in number (``max_entries``), as mlx-lm's
server bounds its cache.

A hit gives the same tokens as a miss: the rows a request reuses are the rows it would have
computed (a decode row and a prefill row of the same token differ only by float rounding).
An entry keeps its MTP layer's rows too (a request that drafted with ``mtp``), so a later turn
drafts from the history it shares; the layer's row at the last shared position was made with
the token that followed it then (speculation verifies drafts, so such a row costs acceptance
only).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import mlx.core as mx

from .models.cache import LatentCache, capacity_for


def copy_prefix(cache: LatentCache, length: int) -> LatentCache:
    """A new cache holding the first ``length`` rows of ``cache`` in buffers of its own (the
    decode kernels write rows into their buffer in place, so entries never share one), and of
    its MTP layer's cache (``mtp_cache``, speculative.MTPDraft) the rows it has of those."""
    if not 0 < length <= cache.offset:
        raise ValueError(f"copy_prefix: {length} rows asked of a cache holding {cache.offset}")
    out = LatentCache(len(cache.layers), cache.max_length)
    out.set_left_padding(None, 1)
    capacity = capacity_for(length)
    for src, dst in zip(cache.layers, out.layers):
        for stream, buf in src.buffers.items():
            grown = mx.zeros((buf.shape[0], capacity, buf.shape[2]), dtype=buf.dtype)
            grown[:, :length] = buf[:, :length]
            dst.buffers[stream] = grown
        dst.length = length
    out.offset = length
    mx.eval([b for layer in out.layers for b in layer.buffers.values()])
    mtp = getattr(cache, "mtp_cache", None)
    if mtp is not None and mtp.offset > 0:
        out.mtp_cache = copy_prefix(mtp, min(length, mtp.offset))
    return out


def cache_bytes(cache: LatentCache) -> int:
    """Bytes of ``cache``'s buffers as allocated (rows beyond the offset included), its MTP
    layer's cache included."""
    mtp = getattr(cache, "mtp_cache", None)
    return cache.nbytes + (0 if mtp is None else mtp.nbytes)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PromptCache:
    """LRU of ``tokens -> LatentCache`` bounded by ``max_bytes`` (None: unbounded) and ``max_entries``."""

    def __init__(self, max_bytes: Optional[int] = None, max_entries: int = 10):
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"prompt cache bytes must be >= 0, got {max_bytes}")
        if max_entries < 0:
            raise ValueError(f"prompt cache entries must be >= 0, got {max_entries}")
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: OrderedDict[tuple, tuple[LatentCache, int]] = OrderedDict()   # oldest first
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[tuple]:
        """Token tuples held, least recently used first."""
        return list(self._entries)

    def insert(self, tokens: Sequence[int], cache: LatentCache) -> bool:
        """Keep ``cache`` (which holds exactly ``tokens``; the caller gives it up) and evict the
        least recently used entries beyond the bounds. An entry that alone exceeds the bound and
        an entry that is a prefix of another one held are not kept. Returns whether it was kept."""
        key = tuple(int(t) for t in tokens)
        if cache.offset != len(key) or not key:
            raise ValueError(f"prompt cache: a cache of {cache.offset} rows for {len(key)} tokens")
        size = cache_bytes(cache)
        if self.max_entries == 0 or (self.max_bytes is not None and size > self.max_bytes):
            return False
        for other in list(self._entries):
            if len(other) >= len(key) and other[: len(key)] == key:
                self._entries.move_to_end(other)
                return False             # an entry as long or longer already serves every prefix of this one
            if len(other) < len(key) and key[: len(other)] == other:
                self._drop(other)        # this one serves every prefix the shorter entry did
        self._entries[key] = (cache, size)
        self.nbytes += size
        while len(self._entries) > self.max_entries or (self.max_bytes is not None and self.nbytes > self.max_bytes):
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        return True

    def fetch(self, tokens: Sequence[int]) -> tuple[Optional[LatentCache], int]:
        """``(cache, n)``: a copy of the entry sharing the longest prefix with ``tokens``, holding
        its first ``n`` tokens (``n < len(tokens)``), or ``(None, 0)``."""
        best, best_n = None, 0
        for key in self._entries:
            n = min(common_prefix(key, tokens), len(tokens) - 1)
            if n > best_n:
                best, best_n = key, n
        if best is None:
            self.misses += 1
            return None, 0
        self.hits += 1
        self._entries.move_to_end(best)
        return copy_prefix(self._entries[best][0], best_n), best_n

    def _drop(self, key: tuple) -> None:
        _, size = self._entries.pop(key)
        self.nbytes -= size

"""Latent KV cache for multi-head latent attention.

Per layer and token the cache keeps what MLA needs to rebuild keys and values: the normalized
latent (``kv_lora_rank`` floats, 512 for DeepSeek-V3/GLM-5) and the roped shared key
(``qk_rope_head_dim``, 64), side by side in one row of the ``kv`` stream, plus, on DSA "full"
layers, the indexer key (``index_head_dim``) in ``index_key``.

Buffers hold the model's activation dtype (bfloat16 on GPUs: half the bytes read per decode
step of a float32 cache); each stream keeps the dtype of its first rows.

A batch of sequences shares one time axis. Sequences of different prompt lengths are
left-padded: ``left_padding[b]`` leading slots of sequence ``b`` hold padding, are never attended
to, and do not count as positions (a sequence's first real token has position 0).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

GROW_STEP = 256


def capacity_for(end: int) -> int:
    """Rows a buffer holding ``end`` rows gets: a multiple of GROW_STEP, and of an eighth of the
    power of two below ``end`` beyond that (at most 1/8 unused), so a compiled decode step,
    retraced per capacity, is traced ~8 times per doubling of the context, not every GROW_STEP."""
    step = max(GROW_STEP, (1 << (end.bit_length() - 1)) // 8)
    return -(-end // step) * step


class LayerCache:
    """Growable ``[B, T, width]`` buffers, one per stream (latent and rope key, indexer key)."""

    def __init__(self):
        self.buffers: dict[str, mx.array] = {}
        self.length = 0

    def append(self, stream: str, rows: mx.array, start: int) -> mx.array:
        """Write ``rows [B, L, W]`` at ``start`` and return ``[B, start+L, W]`` for this stream."""
        B, L, W = rows.shape
        end = start + L
        buf = self.reserve(stream, B, W, rows.dtype, end)
        buf[:, start:end] = rows
        return buf[:, :end]

    def reserve(self, stream: str, batch: int, width: int, dtype: mx.Dtype, end: int) -> mx.array:
        """The whole buffer of ``stream``, grown (GROW_STEP rows at a time) to hold ``end`` rows:
        what a compiled decode step writes into and reads, a shape that changes only when grown."""
        buf = self.buffers.get(stream)
        if buf is not None and buf.dtype != dtype:
            raise ValueError(f"cache stream {stream!r} holds {buf.dtype}, got rows of {dtype}")
        if buf is None or buf.shape[1] < end:
            grown = mx.zeros((batch, capacity_for(end), width), dtype=dtype)
            if buf is not None:
                grown[:, : buf.shape[1]] = buf
            self.buffers[stream] = buf = grown
        return buf

    def read(self, stream: str, end: int) -> mx.array:
        return self.buffers[stream][:, :end]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())


class LatentCache:
    """The whole model's cache: one :class:`LayerCache` per decoder layer, a shared offset."""

    def __init__(self, num_layers: int, max_length: int | None = None):
        self.layers = [LayerCache() for _ in range(num_layers)]
        self.offset = 0  # slots filled (padding included)
        self.left_padding: mx.array | None = None  # int32 [B]; None = no padding
        self.padded = False  # some sequence has left padding (decode rows then need a mask)
        self.max_length = max_length

    def __getitem__(self, i: int) -> LayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def batch_size(self) -> int | None:
        return None if self.left_padding is None else self.left_padding.shape[0]

    def set_left_padding(self, left_padding, batch_size: int) -> None:
        if self.offset != 0:
            raise ValueError("left_padding can only be given on the first call with an empty cache")
        pad = mx.zeros((batch_size,), dtype=mx.int32) if left_padding is None else mx.array(left_padding, dtype=mx.int32)
        if pad.shape != (batch_size,):
            raise ValueError(f"left_padding has shape {pad.shape}, expected ({batch_size},)")
        self.left_padding = pad
        self.padded = left_padding is not None and bool(np.any(np.asarray(left_padding) != 0))

    def advance(self, n: int) -> None:
        self.offset += n

    def reset(self) -> None:
        self.__init__(len(self.layers), self.max_length)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

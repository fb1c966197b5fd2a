"""The multi-token-prediction (MTP) layer's forward pass: the draft model of speculative decoding.

DeepSeek-V3/R1 and GLM-5 ship one MTP layer (``num_nextn_predict_layers: 1``, tensors
``model.layers.{num_hidden_layers}.*``, loaded as :class:`deepseek_v3.MTPLayer`). We follow vLLM's
``deepseek_mtp`` (the implementation serving these checkpoints with MTP in production, and the
one the bundled demo model's MTP head is trained with). At position ``t``:

    h = the main model's last hidden state at t, after the final RMSNorm
    e = embed(token at t + 1), zeroed at position 0
    x = eh_proj(concat(enorm(e), hnorm(h)))
    x = decoder_layer(x)                      (its own MLA cache, at the same positions)
    logits(token at t + 2) = lm_head(shared_head.norm(x))

The embedding and head are the layer's own copies when the checkpoint has them
(``embed_tokens``, ``shared_head.head``), the main model's otherwise. Drafting further steps
feeds the layer its own output ``x`` as ``h`` (vLLM's recurrent MTP drafting).
"""

from __future__ import annotations

import mlx.core as mx

from .. import kernels
from .cache import LatentCache
from .deepseek_v3 import MTPLayer, embedding_rows, rms_norm


class MTPHead:
    """``head(hidden, next_tokens, cache) -> (logits, x)`` for rows at ``cache.offset``.

    ``hidden [1, L, D]`` are the main model's normed hidden states (or the head's own output
    ``x`` when drafting recurrently), ``next_tokens [1, L]`` the tokens one position later.
    """

    def __init__(self, model, layer: MTPLayer):
        self.model, self.layer = model, layer
        self.eps = model.args.rms_norm_eps
        self.embed_tokens = layer.embed_tokens if layer.embed_tokens is not None else model.embed_tokens
        self.lm_head = layer.head if layer.head is not None else model.lm_head

    def make_cache(self) -> LatentCache:
        return LatentCache(1, self.model.max_length)

    def __call__(self, hidden: mx.array, next_tokens: mx.array, cache: LatentCache):
        B, L = next_tokens.shape
        if cache.offset == 0:
            cache.set_left_padding(None, B)
        start = cache.offset
        dtype = self.model.dtype
        e = embedding_rows(self.embed_tokens, next_tokens).astype(dtype)
        if start == 0:
            e = mx.concatenate([mx.zeros_like(e[:, :1]), e[:, 1:]], axis=1)   # position 0: no embedding
        layer = self.layer
        x = mx.concatenate([rms_norm(e, layer.enorm, self.eps), rms_norm(hidden.astype(dtype), layer.hnorm, self.eps)],
                           axis=-1)
        x = kernels.qmatmul(x, layer.eh_proj)
        cos, sin, mask, rope_offset = self.model._positions_and_mask(cache.left_padding, start, L, cache.padded)
        x, _ = layer.layer(x, cos, sin, mask, cache.layers[0], start, None, rope_offset)
        cache.advance(L)
        logits = kernels.qmatmul(rms_norm(x, layer.head_norm, self.eps), self.lm_head, out_dtype=mx.float32)
        return logits, x


def mtp_head(model) -> MTPHead | None:
    """The model's first MTP layer as a draft head, or None when the model has none."""
    layers = getattr(model, "mtp_layers", None)
    return MTPHead(model, layers[0]) if layers else None

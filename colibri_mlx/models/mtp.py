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
import numpy as np

from .. import kernels
from .cache import LatentCache
from .deepseek_v3 import CACHE_STREAM, DECODE_ROWS, MTPLayer, embedding_rows, stream_norm


class MTPHead:
    """``head(hidden, next_tokens, cache) -> (logits, x)`` for rows at ``cache.offset``.

    ``hidden [1, L, D]`` are the main model's normed hidden states (or the head's own output
    ``x`` when drafting recurrently), ``next_tokens [1, L]`` the tokens one position later.
    ``last_only``: the logits of the last row only (what drafting reads).

    Up to DECODE_ROWS rows of one sequence after its first position run as one compiled graph
    (kernels.compiled: :meth:`_step`, the layer's step of its rows between the
    embedding, eh_proj and the head) when the layer's graph reads no values on the host; a
    drafted token (a lazy argmax) then goes from one draft to the next without a host read.
    """

    def __init__(self, model, layer: MTPLayer):
        self.model, self.layer = model, layer
        self.eps = model.args.rms_norm_eps
        self.embed_tokens = layer.embed_tokens if layer.embed_tokens is not None else model.embed_tokens
        self.lm_head = layer.head if layer.head is not None else model.lm_head
        self._compiled = kernels.compiled.CompiledBlock(self._step, "mtp_step")

    def make_cache(self) -> LatentCache:
        return LatentCache(1, self.model.max_length)

    def _inputs(self, hidden, next_tokens, first: bool = False, compiled_block: bool = False):
        """``x`` of the decoder layer: eh_proj of the normed embedding and hidden state (``first``:
        rows from position 0, which has no embedding)."""
        layer, dtype = self.layer, self.model.dtype
        e = embedding_rows(self.embed_tokens, next_tokens, compiled_block=compiled_block).astype(dtype)
        if first:
            e = mx.concatenate([mx.zeros_like(e[:, :1]), e[:, 1:]], axis=1)
        x = mx.concatenate([stream_norm(e, layer.enorm, self.eps),
                            stream_norm(hidden.astype(dtype), layer.hnorm, self.eps)], axis=-1)
        return kernels.qmatmul(x, layer.eh_proj)

    def _logits(self, x):
        """float32 logits of the rows ``x``."""
        return kernels.qmatmul(stream_norm(x, self.layer.head_norm, self.eps), self.lm_head, out_dtype=mx.float32)

    def _step(self, hidden, next_tokens, slots, kv, params):
        """The compiled graph: ``(logits of the last row, x, kv)`` of rows at ``slots``."""
        x, kv = self.layer.layer._step(self._inputs(hidden, next_tokens), slots, kv, params)
        return self._logits(x if x.shape[1] == 1 else x[:, -1:]), x, kv

    def step_reason(self, hidden, L: int, cache: LatentCache):
        """Why these rows do not run as the compiled :meth:`_step`, or None."""
        if hidden.shape[0] != 1 or not 1 <= L <= DECODE_ROWS:
            return f"{hidden.shape[0]} sequence(s) of {L} rows"
        if cache.offset == 0 or cache.padded:
            return "first position or padded cache"
        if self.model.args.dsa:
            return "DSA selection"
        return self.layer.layer.rows_reason(hidden, cache.layers[0], None)

    def __call__(self, hidden: mx.array, next_tokens: mx.array, cache: LatentCache, last_only: bool = False):
        B, L = next_tokens.shape
        if cache.offset == 0:
            cache.set_left_padding(None, B)
        start = cache.offset
        backend = kernels.backend()
        if last_only and kernels.compiled.enabled(backend):
            reason = self.step_reason(hidden, L, cache)
            if reason is None:
                attn = self.layer.layer.self_attn
                layer_cache = cache.layers[0]
                kv, params = attn.step_inputs(hidden, layer_cache, start)
                slots = kernels.device_inputs.int32_scalar(start, backend) if L == 1 else \
                    kernels.device_inputs.int32_range(start, L, backend)
                logits, x, layer_cache.buffers[CACHE_STREAM] = self._compiled(hidden, next_tokens, slots, kv, params)
                cache.advance(L)
                return logits, x
            kernels.dispatch.record_call("compiled/mtp_step", f"declined: {reason}")
        x = self._inputs(hidden, next_tokens, first=start == 0, compiled_block=True)
        cos, sin, mask, rope_offset = self.model._positions_and_mask(cache.left_padding, start, L, cache.padded)
        x, _ = self.layer.layer(x, cos, sin, mask, cache.layers[0], start, None, rope_offset)
        cache.advance(L)
        return self._logits(x[:, -1:] if last_only else x), x

    def rows(self, hidden: mx.array, next_tokens: mx.array, caches: list, counts: list):
        """``counts[b]`` rows of sequence ``b``, each sequence on its own cache (the drafting of a
        continuous batch): ``hidden [R, D]`` and ``next_tokens [R]`` (sequence 0's rows first;
        several sequences: at most DECODE_ROWS rows, every cache past its first position). Returns float32 logits of
        each sequence's last row ``[n, vocab]`` and ``x [R, D]``; advances every cache by its
        count. eh_proj, the decoder layer's projections and MoE, and the head run over all the
        rows at once (batch_decode.rows_layer); a lone sequence takes :meth:`__call__`."""
        R, D = hidden.shape
        if len(caches) == 1:
            logits, x = self(hidden.reshape(1, R, D), next_tokens.reshape(1, R), caches[0], last_only=True)
            return logits[:, -1], x.reshape(R, D)
        from .batch_decode import row_positions, rows_layer

        kernels.dispatch.record_call("batch_decode", "mtp rows")
        starts, offsets, cos, sin = row_positions(self.model, caches, counts)
        x = self._inputs(hidden.reshape(R, 1, D), next_tokens.reshape(R, 1))
        x = rows_layer(self.layer.layer, x, [c.layers[0] for c in caches], starts, counts, offsets, cos, sin)
        for c, m in zip(caches, counts):
            c.advance(m)
        last = mx.array([int(s) - 1 for s in np.cumsum(counts)], dtype=mx.int32)
        return self._logits(x[last])[:, -1], x.reshape(R, D)


def mtp_head(model) -> MTPHead | None:
    """The model's first MTP layer as a draft head (one a layer: its compiled graphs are kept
    from one generation to the next), or None when the model has none."""
    layers = getattr(model, "mtp_layers", None)
    if not layers:
        return None
    head = getattr(layers[0], "draft_head", None)
    if head is None or head.model is not model:
        head = layers[0].draft_head = MTPHead(model, layers[0])
    return head

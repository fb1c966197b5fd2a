"""DeepSeek-V3/R1, Kimi-K2, DeepSeek-V3.2 and GLM-5.x (``glm_moe_dsa``) in MLX.

Numerics follow transformers 5.23 (``models/deepseek_v3``, ``deepseek_v32``, ``glm_moe_dsa``),
the parity oracle of tests/test_model_parity.py. Reads top to bottom: config, norms, attention
(MLA + DSA lightning indexer), dense MLP, router, MoE, decoder layer, model, ``sanitize``.

Weights are float ``mx.array`` (from Hugging Face checkpoints) or QTensor (from containers).

Activation dtype (``Model(..., dtype=)``, :func:`resolve_dtype`): float32 on the CPU backend,
bfloat16 on GPUs by default. Activations, float weights and the latent cache are held in it; the
kernels accumulate in float32. Selection and normalization stay in float32 whatever the dtype:
router and indexer scores, top-k, softmax (the attention core computes in float32), RoPE
rotation; logits are returned as float32. With float32 every cast is a no-op.

Every projection goes through ``kernels.qmatmul``; routed experts through :func:`routed_experts`
and absorbed decode attention through :func:`latent_attention` — the three hot paths.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import mlx.core as mx
import numpy as np

from .. import kernels
from ..formats.qtensor import QTensor
from . import mla_reference, moe_reference
from .cache import LatentCache
from .projections import kv_a_rows, query_rows
from .rope import apply_rope, make_rope, rope_parameters, softmax_scale
from .weights import ACTIVATION_DTYPES, FLOAT_DTYPES, WeightTable, resolve_dtype  # noqa: F401 (loading's names)

# model_type -> family handled here; aliases map onto it (Kimi-K2 is DeepSeek-V3 with other sizes).
MODEL_TYPES = {"deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3", "deepseek_v32": "deepseek_v32",
               "glm_moe_dsa": "glm_moe_dsa"}
DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")

# Rows per call up to which the MLP / MoE blocks are decode graphs (the qgemv / moe kernel paths).
DECODE_ROWS = 8
# Query blocks up to this many tokens use the absorbed (latent-space) attention.
ABSORBED_MAX_TOKENS = 4
# The q/kv latent norms use a fixed epsilon in every reference implementation.
LATENT_NORM_EPS = 1e-6
INDEXER_NORM_EPS = 1e-6
# The cache stream of MLA layers: each row the normalized latent, then the roped key (one
# buffer: a decode step writes one row, and mla_decode reads both from it).
CACHE_STREAM = "kv"

# ----------------------------------------------------------------------------------- config


@dataclass
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    first_k_dense_replace: int = 0
    mlp_layer_types: list | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope: dict = field(default_factory=dict)
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    index_topk: int = 2048
    index_n_heads: int = 64
    index_head_dim: int = 128
    indexer_types: list | None = None
    eos_token_id: list = field(default_factory=list)

    REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank",
                "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")

    def __post_init__(self):
        self.family = MODEL_TYPES[self.model_type]
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.mlp_layer_types is None:
            n_dense = min(self.first_k_dense_replace, self.num_hidden_layers)
            self.mlp_layer_types = ["dense"] * n_dense + ["sparse"] * (self.num_hidden_layers - n_dense)
        if self.n_routed_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"config.json: n_group={self.n_group}, topk_group={self.topk_group} do not fit "
                             f"n_routed_experts={self.n_routed_experts}")
        self.dsa = self.family in DSA_FAMILIES
        if self.dsa and self.q_lora_rank is None:
            raise ValueError(f"config.json: {self.model_type} needs q_lora_rank (its indexer reads the q latent)")
        # DeepSeek-V3.2 ropes its indexer half-split; GLM-5 interleaved (transformers' GlmMoeDsaIndexer).
        self.indexer_rope_interleave = self.family == "glm_moe_dsa"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ModelArgs":
        from .config_schema import validate_config

        validate_config(config)  # every key's type, range and cross-field rule, named (ConfigError)
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config.json: unknown model_type {model_type!r}; supported: {sorted(MODEL_TYPES)}")
        missing = [k for k in cls.REQUIRED if config.get(k) is None]
        if missing:
            raise ValueError(f"config.json: missing required field(s) {missing} for model_type {model_type!r}")
        _check_supported(config)
        names = set(cls.__dataclass_fields__) - {"rope", "eos_token_id", "indexer_types"}
        kwargs = {k: config[k] for k in names if config.get(k) is not None}
        eos = config.get("eos_token_id")
        kwargs["eos_token_id"] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        kwargs["rope"] = rope_parameters(config)
        if MODEL_TYPES[model_type] in DSA_FAMILIES:
            kwargs["indexer_types"] = _indexer_types(config, MODEL_TYPES[model_type])
        return cls(**kwargs)

    def without_indexer(self) -> None:
        """Run DSA models with dense attention (for containers converted without ``--indexer``)."""
        self.dsa = False

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.num_hidden_layers or self.mlp_layer_types[i] == "sparse"

    def indexer_kind(self, i: int) -> str | None:
        """"full" (own indexer), "shared" (reuse the last full layer's selection) or None (no DSA)."""
        if not self.dsa:
            return None
        return self.indexer_types[i] if i < self.num_hidden_layers else "full"


def _check_supported(config: Mapping[str, Any]) -> None:
    checks = [("scoring_func", ("sigmoid",)), ("topk_method", ("noaux_tc",)), ("hidden_act", ("silu",))]
    for key, allowed in checks:
        if config.get(key) is not None and config[key] not in allowed:
            raise ValueError(f"config.json: {key}={config[key]!r} is not supported (expected one of {allowed})")


def _indexer_types(config: Mapping[str, Any], family: str) -> list:
    n = config["num_hidden_layers"]
    if family == "deepseek_v32":
        return ["full"] * n
    types = config.get("indexer_types")
    if types is None and config.get("index_topk_pattern") is not None:
        pattern = config["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    if types is None:
        freq = max(config.get("index_topk_freq", 1), 1)
        offset = config.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(types) != n or any(t not in ("full", "shared") for t in types) or types[0] != "full":
        raise ValueError(f"config.json: indexer_types must be {n} entries of 'full'/'shared' starting with "
                         f"'full', got {types}")
    return list(types)


def _dense_attention_fallback(args: ModelArgs, weights: WeightTable) -> str | None:
    """A DSA model whose directory holds no indexer weights at all runs dense attention, as
    upstream colibri does: its converter writes the indexer only in a separate ``--indexer`` pass
    (a re-download of the whole checkpoint), so most GLM-5 containers lack it. Dense attention
    equals DSA up to ``index_topk`` tokens of context and differs beyond, so say so once."""
    if not args.dsa or any(".self_attn.indexer." in name for name in weights.names):
        return None
    args.without_indexer()
    reason = (f"{weights.source}: no DSA indexer weights, attention is dense: identical to the sparse "
              f"model up to index_topk={args.index_topk} tokens of context, different beyond; to add them, "
              f"run `colibri convert --indir <the original checkpoint> --outdir {weights.source} --indexer`")
    from ..errors import ColibriNote

    warnings.warn(reason, ColibriNote, stacklevel=3)  # one "colibri: note:" line, no source location
    return reason


def linear(x: mx.array, w, bias: mx.array | None = None, residual: mx.array | None = None) -> mx.array:
    """``x W^T (+ bias)``, added to ``residual`` when given (in the GEMV's write, without a bias)."""
    if bias is None:
        return kernels.qmatmul(x, w, residual)
    y = kernels.qmatmul(x, w) + bias
    return y if residual is None else residual + y


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return kernels.reference.rms_norm(x, weight, eps)


def stream_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """RMSNorm of residual-stream rows: whole rows (never a slice of a wider array), so
    ``mx.fast.rms_norm`` takes them as they are, where :func:`rms_norm` views a single row as
    1-D and back (two graph nodes a norm in a compiled decode step)."""
    return mx.fast.rms_norm(x, weight, eps)


def write_row(buffer: mx.array, row: mx.array, slot: mx.array) -> mx.array:
    """``buffer [1, T, W]`` with ``row [1, L, W]`` at times ``slot`` (an int32 array of L): a scatter
    along the time axis is one kernel on GPUs, where a slice_update at an offset held in an array
    is two (the offset is computed on the device, then the copy). MLX donates the buffer."""
    return mx.put_along_axis(buffer, slot.reshape(1, -1, 1), row, axis=1)


def embedding_rows(table, ids: mx.array, compiled_block: bool = True) -> mx.array:
    """Rows ``ids`` of an embedding table (float or row-quantized QTensor; decoded as float32).
    ``compiled_block`` False: inside a caller's compiled graph (kernels.gather_rows)."""
    ids = kernels.device_inputs.device_index(ids, kernels.backend())   # CUDA: a token in device memory
    if not isinstance(table, QTensor):
        return table[ids]
    from ..formats import decode, scale_nbytes, weight_nbytes
    from ..formats.gguf_quant import is_gguf_fmt

    if is_gguf_fmt(table.fmt):   # a GGUF table (token_embd.weight)
        from ..kernels.gguf_formats import embedding_rows as gguf_embedding_rows

        return gguf_embedding_rows(table, ids)
    if table.fmt >= 7:   # an MLX-format table (mlx-lm's QuantizedEmbedding)
        from ..kernels.mlx_formats import embedding_rows as mlx_embedding_rows

        return mlx_embedding_rows(table, ids)
    if table.fmt == 6:
        raise ValueError(f"{table.name}: an fmt 6 (rotated) embedding table cannot be looked up by row")
    if isinstance(ids, mx.array) and table.fmt in kernels.reference.GATHER_FMTS:
        # On the device: a speculative draft's token is looked up without a host round trip.
        return kernels.gather_rows(table, ids, compiled_block)
    row_bytes = weight_nbytes(table.fmt, 1, table.I, table.gs)
    row_scales = scale_nbytes(table.fmt, 1, table.I, table.gs) // 4
    flat = np.array(ids).reshape(-1)
    packed = np.asarray(table.packed).reshape(table.O, row_bytes)[flat].reshape(-1)
    scales = np.asarray(table.scales).reshape(table.O, row_scales)[flat].reshape(-1)
    rows = decode(table.fmt, packed, scales, flat.size, table.I, table.gs)
    return mx.array(rows).reshape(*ids.shape, table.I)


# -------------------------------------------------------------------------------- attention


class Indexer:
    """DSA lightning indexer: scores past tokens per query and keeps the top ``index_topk``."""

    def __init__(self, args: ModelArgs, w: WeightTable, prefix: str):
        nh, hd = args.index_n_heads, args.index_head_dim
        self.n_heads, self.head_dim, self.topk = nh, hd, args.index_topk
        self.rope_dim = args.qk_rope_head_dim
        self.interleaved = args.indexer_rope_interleave
        self.wq_b = w.take(prefix + "wq_b.weight", (nh * hd, args.q_lora_rank))
        self.wk = w.take(prefix + "wk.weight", (hd, args.hidden_size))
        self.k_norm_weight = w.take(prefix + "k_norm.weight", (hd,))
        self.k_norm_bias = w.take(prefix + "k_norm.bias", (hd,))
        # Scoring weights stay float32 (like the router): the top-k selection should not
        # depend on half-precision rounding.
        self.weights_proj = w.take(prefix + "weights_proj.weight", (nh, args.hidden_size), dtype=mx.float32)

    def _rope(self, x, cos, sin):
        r = self.rope_dim
        return mx.concatenate([apply_rope(x[..., :r], cos, sin, self.interleaved), x[..., r:]], axis=-1)

    def select(self, x, q_latent, cos, sin, mask, layer_cache, start):
        """Bool ``[B, 1, L, T]`` of selected keys, or None while every query sees ≤ topk keys."""
        B, L, _ = x.shape
        q = linear(q_latent, self.wq_b).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = self._rope(q, cos, sin)
        k = mx.fast.layer_norm(linear(x, self.wk), self.k_norm_weight, self.k_norm_bias, INDEXER_NORM_EPS)
        k = self._rope(k[:, None], cos, sin)[:, 0]
        keys = layer_cache.append("index_key", k, start) if layer_cache is not None else k
        T = keys.shape[1]
        if T <= self.topk:
            return None
        f32 = mx.float32
        scores = mx.maximum((q.astype(f32) @ keys.astype(f32)[:, None].swapaxes(-1, -2)) * self.head_dim**-0.5,
                            0)  # [B, nh, L, T]
        head_weights = linear(x.astype(f32), self.weights_proj) * self.n_heads**-0.5  # [B, L, nh]
        index_scores = (head_weights[:, :, None, :] @ scores.transpose(0, 2, 1, 3))[:, :, 0]  # [B, L, T]
        if mask is not None:
            index_scores = mx.where(mask[:, 0], index_scores, -mx.inf)
        return top_k_mask(index_scores, self.topk)[:, None]


def top_k_mask(scores: mx.array, k: int) -> mx.array:
    """Bool mask of the ``k`` largest entries along the last axis; ties at the threshold go to the
    lowest positions (upstream colibri's rule; torch.topk leaves them unspecified)."""
    threshold = mx.sort(scores, axis=-1)[..., -k][..., None]
    above = scores > threshold
    at = scores == threshold
    room = k - above.sum(axis=-1, keepdims=True)
    return above | (at & (mx.cumsum(at.astype(mx.int32), axis=-1) <= room))


class Attention:
    def __init__(self, args: ModelArgs, w: WeightTable, prefix: str, layer_idx: int):
        D, H = args.hidden_size, args.num_attention_heads
        self.args, self.n_heads = args, H
        self.nope, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.scale = softmax_scale(args.rope, args.qk_head_dim)
        bias = args.attention_bias
        # The query projection that reads x: q_a (low-rank queries) or q_proj.
        if args.q_lora_rank is None:
            q_x = w.take(prefix + "q_proj.weight", (H * args.qk_head_dim, D))
            q_x_bias = None
        else:
            q_x = w.take(prefix + "q_a_proj.weight", (args.q_lora_rank, D))
            q_x_bias = w.take(prefix + "q_a_proj.bias", (args.q_lora_rank,)) if bias else None
            self.q_a_norm = w.take(prefix + "q_a_layernorm.weight", (args.q_lora_rank,))
            self.q_b_proj = w.take(prefix + "q_b_proj.weight", (H * args.qk_head_dim, args.q_lora_rank))
        kv_a_out = args.kv_lora_rank + args.qk_rope_head_dim
        kv_a = w.take(prefix + "kv_a_proj_with_mqa.weight", (kv_a_out, D))
        kv_a_bias = w.take(prefix + "kv_a_proj_with_mqa.bias", (kv_a_out,)) if bias else None
        # Rows reordered once for the kernels (models/projections.py): q comes out as every
        # head's nope part then every head's rope part, the rope dims de-interleaved.
        q_order = query_rows(H, args.qk_head_dim, self.nope, self.rope_dim, args.rope_interleave)
        if args.q_lora_rank is None:
            q_x = kernels.take_rows(q_x, q_order)
        else:
            self.q_b_proj = kernels.take_rows(self.q_b_proj, q_order)
        kv_order = kv_a_rows(self.kv_lora_rank, self.rope_dim, args.rope_interleave)
        kv_a = kernels.take_rows(kv_a, kv_order)
        kv_a_bias = None if kv_a_bias is None else kv_a_bias[mx.array(kv_order)]
        self.rope = make_rope(args.rope, self.rope_dim, args.max_position_embeddings, interleaved=False)
        self._load_x_projections(q_x, q_x_bias, kv_a, kv_a_bias)
        self.kv_a_norm = w.take(prefix + "kv_a_layernorm.weight", (args.kv_lora_rank,))
        self.kv_b_proj = w.take(prefix + "kv_b_proj.weight", (H * (self.nope + self.v_dim), args.kv_lora_rank))
        self.o_proj = w.take(prefix + "o_proj.weight", (D, H * self.v_dim))
        self.o_bias = w.take(prefix + "o_proj.bias", (D,)) if bias else None
        self.indexer_kind = args.indexer_kind(layer_idx)
        # The MTP layer's indexer is optional: upstream's --mtp and --indexer passes both skip it.
        has_indexer = self.indexer_kind == "full" and (layer_idx < args.num_hidden_layers
                                                       or w.has_prefix(prefix + "indexer."))
        self.indexer = Indexer(args, w, prefix + "indexer.") if has_indexer else None
        self._params_signature = None      # step_inputs: what this layer's params depend on
        self._compiled_rows = kernels.compiled.CompiledBlock(self._decode_rows, "attention_rows")
        self._compiled_step = kernels.compiled.CompiledBlock(self.step, "attention_step")
        self._compiled_rows_step = kernels.compiled.CompiledBlock(self.step, "attention_rows_step")

    def _load_x_projections(self, q_x, q_x_bias, kv_a, kv_a_bias):
        """The query projection reading x and kv_a_proj_with_mqa read the same x: when their
        formats agree their rows are stacked into one weight (one qgemv launch per step; the
        parts are not kept), else they stay two."""
        self.q_x_rows = q_x.shape[0]
        fused = kernels.concat_rows([q_x, kv_a])
        if fused is None:
            self.x_proj, self.x_proj_bias = None, None
            self.q_x, self.q_x_bias, self.kv_a, self.kv_a_bias = q_x, q_x_bias, kv_a, kv_a_bias
            return
        self.x_proj = fused
        self.x_proj_bias = None if q_x_bias is None else mx.concatenate([q_x_bias, kv_a_bias])

    # Parts of the stacked projection (views), for statistics and scripts that read them by name.
    @property
    def q_a_proj(self):
        return self._x_part(0) if self.args.q_lora_rank is not None else None

    @property
    def q_proj(self):
        return self._x_part(0) if self.args.q_lora_rank is None else None

    @property
    def kv_a_proj(self):
        return self._x_part(1)

    def _x_part(self, i):
        if self.x_proj is None:
            return (self.q_x, self.kv_a)[i]
        rows = (0, self.q_x_rows, self.x_proj.shape[0])
        return kernels.rows_of(self.x_proj, rows[i], rows[i + 1])

    def project_x(self, x, B, L):
        """x ``[B*L, D]`` -> q or q_a output ``[B*L, *]``, latent (before its norm) and rope key
        ``[B, L, *]``: one launch when the weights are stacked, then slices (views)."""
        if self.x_proj is None:
            q_x, kv = linear(x, self.q_x, self.q_x_bias), linear(x, self.kv_a, self.kv_a_bias)
            kv, start = kv.reshape(B, L, -1), 0
        else:
            y = linear(x, self.x_proj, self.x_proj_bias)
            q_x, kv, start = y[:, : self.q_x_rows], y.reshape(B, L, -1), self.q_x_rows
        end = start + self.kv_lora_rank
        return q_x, kv[..., start:end], kv[..., end:]

    def queries(self, q_x):
        """``(q, q_latent)`` from the query part of :meth:`project_x`."""
        if self.args.q_lora_rank is None:
            return q_x, None
        q_latent = rms_norm(q_x, self.q_a_norm, LATENT_NORM_EPS)
        return linear(q_latent, self.q_b_proj), q_latent

    def _heads(self, part, B, L, width):
        """``[B*L, H*width]`` -> ``[B, H, L, width]`` (a view when L == 1)."""
        if L == 1:
            return part.reshape(B, self.n_heads, 1, width)
        return part.reshape(B, L, self.n_heads, width).transpose(0, 2, 1, 3)

    def rows(self, x, cos=None, sin=None, rope_offset=None, rotate_q=True, cache=None, fold_q=False):
        """Everything before the cache: ``(q_nope [B,H,L,nope], q_rope [B,H,L,rope], kv
        [B,L,R+rope] (the cache rows: the normed latent, then the roped key), q_latent
        [B*L,q_lora] (one decode row: [1,1,q_lora]) or None)``.

        ``rope_offset`` (int32 scalar array: the position of the first query row of a single
        sequence, the rows following it; or int32 ``[L]``, each row's position, consecutive)
        rotates with ``mx.fast.rope``, one op; without it cos/sin are used. Rows of one sequence
        with a position each take the decode rows' fast path (mla_rows) as one row does.
        ``rotate_q=False`` (with ``rope_offset``): q_rope is left for mla_decode to rotate.
        ``cache`` (the joint cache's buffer, with ``rope_offset`` the row's slot): the kernel
        path writes the row into it in place (kernels.mla_rows) and ``kv`` is None.
        ``fold_q`` (one decode row of one sequence): q_b's projection is left to the attention
        core (kernels.mla_decode's ``q_proj``, folded into its first launch): q_nope and q_rope
        are None and q_latent is returned."""
        B, L, D = x.shape
        H = self.n_heads
        fast = rope_offset is not None
        if fast and rope_offset.size == L and self.folds_queries(B):
            # Decode rows of one sequence (one, or a verify step's, each with its position in
            # rope_offset): both norms and the rope key from the stacked projection in one op.
            # Rows stay [1, 1, width] throughout (the kernels take any leading shape): every
            # reshape would be a graph node of the compiled step.
            y = linear(x, self.x_proj, self.x_proj_bias)
            q_latent, kv = kernels.mla_rows(y, self.q_x_rows, self.q_a_norm, self.kv_a_norm, LATENT_NORM_EPS,
                                            self.rope, rope_offset, cache)
            if fold_q:
                return None, None, kv, q_latent
            q = linear(q_latent, self.q_b_proj)
        else:
            q_x, latent, k_rope = self.project_x(x.reshape(B * L, D), B, L)   # 2-D x: no reshapes in qmatmul
            q, q_latent = self.queries(q_x)
            if fast and rope_offset.size > 1 and B == 1:   # one sequence's rows: mx.fast.rope takes the first
                rope_offset = rope_offset.reshape(-1)[0]    # (B sequences of one row keep a position each)
            if fast:
                k_rope = self.rope.apply_fast(k_rope, rope_offset)
            else:
                k_rope = apply_rope(k_rope[:, None], cos, sin, interleaved=False)[:, 0]
            kv = mx.concatenate([rms_norm(latent, self.kv_a_norm, LATENT_NORM_EPS), k_rope], axis=-1)
        q_nope = self._heads(q[..., : H * self.nope], B, L, self.nope)
        q_rope = self._heads(q[..., H * self.nope:], B, L, self.rope_dim)
        if fast:
            q_rope = self.rope.apply_fast(q_rope, rope_offset) if rotate_q else q_rope
        else:
            q_rope = apply_rope(q_rope, cos, sin, interleaved=False)
        return q_nope, q_rope, kv, q_latent

    def folds_queries(self, B: int) -> bool:
        """Whether one decode row (of ``B`` sequences) takes the rows' fast path (one sequence,
        the stacked x projection: mla_rows), which leaves q_b's projection to the attention core
        (kernels.mla_decode's ``q_proj``: folded into its first launch on a GPU)."""
        return B == 1 and self.x_proj is not None and self.args.q_lora_rank is not None

    def _decode_rows(self, x, rope_offset, cache=None):
        """:meth:`rows` of one decode row as arrays only (what kernels.compiled traces): ``(q_nope,
        q_rope, kv[, q_latent])``, q_rope unrotated (:meth:`attend` with ``q_offset`` rotates it
        in mla_decode's first launch), or ``(q_latent, kv)`` where :meth:`folds_queries`;
        :meth:`decode_queries` reads either."""
        fold = self.folds_queries(x.shape[0])
        q_nope, q_rope, kv, q_latent = self.rows(x, rope_offset=rope_offset, rotate_q=False, cache=cache, fold_q=fold)
        if fold:
            return q_latent, kv
        return (q_nope, q_rope, kv) if q_latent is None or self.indexer is None else (q_nope, q_rope, kv, q_latent)

    def decode_queries(self, rows, B: int) -> tuple:
        """:meth:`_decode_rows`' arrays as ``(q_nope, q_rope, kv, q_latent, q_proj)``: queries left
        to the core have q_nope / q_rope None and ``q_proj = (q_latent, q_b)``."""
        if self.folds_queries(B):
            q_latent, kv = rows
            return None, None, kv, q_latent, (q_latent, self.q_b_proj)
        q_nope, q_rope, kv, *q_latent = rows
        return q_nope, q_rope, kv, (q_latent[0] if q_latent else None), None

    def __call__(self, x, cos, sin, mask, layer_cache, start, shared_selection=None, rope_offset=None):
        """Returns the attention output and this layer's DSA selection (for the next shared layers)."""
        B, L, D = x.shape
        if self.steps_compiled(x, mask, layer_cache, shared_selection, rope_offset):
            return self.decode_step(x, layer_cache, start, rope_offset), None
        q_offset = None
        if rope_offset is not None and L == 1:
            # The same graph every decode step: compiled on GPUs (kernels.compiled).
            q_nope, q_rope, kv, q_latent, q_proj = self.decode_queries(self._compiled_rows(x, rope_offset), B)
            q_offset = rope_offset
        else:
            q_nope, q_rope, kv, q_latent = self.rows(x, cos, sin)
            q_proj = None
        kv = self.cached(kv, layer_cache, start)
        selection = shared_selection
        if self.indexer is not None:
            selection = self.indexer.select(x, q_latent.reshape(B, L, -1), cos, sin, mask, layer_cache, start)
        if selection is not None:
            mask = selection if mask is None else mask & selection
        attn = self.attend(q_nope, q_rope, kv, mask, q_offset=q_offset, q_proj=q_proj)
        return self.output(attn).reshape(B, L, D), selection

    def steps_compiled(self, x, mask, layer_cache, shared_selection, rope_offset) -> bool:
        """Whether these rows run as :meth:`decode_step`: one decode row of unpadded sequences
        (no mask), no DSA selection, a cache, and compiled blocks enabled (kernels.compiled)."""
        return self.indexer is None and layer_cache is not None and self.rows_compiled(x, mask, shared_selection,
                                                                                         rope_offset)

    @staticmethod
    def rows_compiled(x, mask, shared_selection, rope_offset) -> bool:
        """The part of :meth:`steps_compiled` that is the same for every layer of a step."""
        return (rope_offset is not None and x.shape[1] == 1 and mask is None and shared_selection is None
                and kernels.compiled.enabled(kernels.backend()))

    def decode_step(self, x, layer_cache, start, slot, compiled=None):
        """One decode row of one sequence (no padding: its position is its cache slot ``start``,
        ``slot`` the same as an int32 array) as one compiled graph (``compiled``: a caller's
        graph around :meth:`step`, default this block's) over the cache's fixed-capacity
        buffers: shapes change only when they grow; slot and attended length are inputs."""
        step = compiled or (self._compiled_step if x.shape[1] == 1 else self._compiled_rows_step)
        y, layer_cache.buffers[CACHE_STREAM] = step(x, slot, *self.step_inputs(x, layer_cache, start))
        return y

    def step_inputs(self, x, layer_cache, start, made: dict | None = None):
        """``(kv, params)`` of :meth:`step` for the row at ``start``: the cache's buffer, grown
        to hold it, and the attended length as kernels.mla.step_params.
        ``made``: the params arrays other layers made this step, by what they depend on (layers
        alike share one)."""
        B, L = x.shape[:2]
        end = start + L
        kv = layer_cache.reserve(CACHE_STREAM, B, self.kv_lora_rank + self.rope_dim, x.dtype, end)
        if self._params_signature is None:
            self._params_signature = (kernels.mla.params_signature(self.kv_b_proj), self.n_heads, self.nope,
                                      self.rope_dim, self.v_dim)
        key = (self._params_signature, kv.shape, kv.dtype, x.dtype, end, L)
        params = made.get(key) if made is not None else None
        if params is None:
            params = kernels.mla.step_params(self.kv_b_proj, kv, self.n_heads, self.nope, self.rope_dim,
                                             self.v_dim, x.dtype, end, joint=True, rows=L, causal=L > 1)
            if made is not None:
                made[key] = params
        return kv, params

    def step(self, x, slot, kv, params, residual=None):
        """``(output, kv)`` of the decode rows of one sequence ``x [1, L, D]``: their cache rows
        (latent, rope key) written at ``slot`` of the whole buffer (one row: its slot; L rows, a
        verify step of speculative decoding: int32 ``[L]``, consecutive slots), attention over
        its first ``params[6]`` rows (kernels.mla.step_params; L rows causal, row i attending to
        the first ``slot[0] + i + 1``); the output added to ``residual`` (x's shape) when given.
        Any L runs the same launches, each taking all L rows: the stacked x projection, mla_rows
        writing the cache rows, mla_decode's q_b-folded queries and attention, o_proj."""
        L = x.shape[1]
        if L == 1:
            slot = kernels.dispatch.reshaped(slot, 1)   # as each kernel reads it: one view (or none)
        # The kernel path writes the rows into kv itself (kv_rows None): a scatter could take the
        # buffer in place only when no earlier step's kernels still hold it (MLX keeps a
        # step's inputs alive until it has run), so a pipelined loop would copy the cache.
        q_nope, q_rope, kv_rows, q_latent, q_proj = self.decode_queries(self._decode_rows(x, slot, kv), x.shape[0])
        if kv_rows is not None:
            kv = write_row(kv, kv_rows if kv_rows.dtype == kv.dtype else kv_rows.astype(kv.dtype), slot)
        else:
            kv = written_in_place(kv, q_latent)
        # The core's rows in x's leading shape: o_proj (and its residual add) then write x's
        # shape itself, with no reshape nodes around the kernel.
        attn = self.attend(q_nope, q_rope, kv, None, params, q_offset=slot, rows=x.shape[:-1], q_proj=q_proj,
                           causal=L > 1)
        return self.output(attn, residual), kv

    def cached(self, kv, layer_cache, start):
        """This step's cache rows (latent, rope key) written to the cache; the whole cache so far."""
        if layer_cache is None:
            return kv
        return layer_cache.append(CACHE_STREAM, kv, start)

    def attend(self, q_nope, q_rope, kv, mask, step_params=None, q_offset=None, rows=None, q_proj=None,
               causal=False):
        """The attention core over the cache ``kv [B, T, R + rope]`` (each row the latent, then
        the rope key): ``[B*L, H*v_dim]``, rows in (b, l) order (one query row a sequence and
        ``rows``: ``[*rows, H*v_dim]``). ``step_params`` (kernels.mla.step_params): kv is the
        cache's whole fixed-capacity buffer, of which the array says how many rows are attended.
        ``q_offset``: q_rope is unrotated (:meth:`_decode_rows`), to be rotated at this position.
        ``q_proj``: ``(q_latent, q_b)`` of one decode row instead of q_nope / q_rope (None).
        ``causal``: the rows of one sequence at ``q_offset`` (positions ``[L]``), causal over the
        buffer (:meth:`step` of L rows); the output is then ``[1, L, H*v_dim]``."""
        B, H, L, _ = q_nope.shape if q_proj is None else (1, self.n_heads, 1, None)
        rope = None if q_offset is None else self.rope
        out = latent_attention(q_nope, q_rope, kv, self.kv_b_proj, self.scale, mask,
                               self.nope, self.v_dim, step_params, rope, q_offset, q_proj, causal)
        if causal:
            return out
        if L == 1:
            return out.reshape(*(rows or (B,)), H * self.v_dim)
        return out.transpose(0, 2, 1, 3).reshape(B * L, H * self.v_dim)

    def output(self, attn, residual=None):
        """o_proj of the attention core's ``[B*L, H*v]`` rows (+ ``residual [B*L, D]``: the
        decoder layer's residual add, done by the projection's kernel)."""
        return linear(attn, self.o_proj, self.o_bias, residual)


def written_in_place(buffer, written_by):
    """``buffer`` (the cache's, which kernels.mla_rows wrote its rows into in place) as an array
    whose evaluation runs that write: ``written_by`` is the launch's output (q_latent). The
    buffer goes on to the next step; without this edge nothing there depends on the write, so a
    step whose outputs are never evaluated (a prompt fed one token at a time, each step's logits
    dropped) would lose its rows, and a later step could read the buffer before they land."""
    return mx.depends(buffer, written_by)


def latent_attention(q_nope, q_rope, kv, kv_b, scale, mask, nope, v_dim, step_params=None,
                     rope=None, rope_offset=None, q_proj=None, causal=False):
    """Absorbed decode for short query blocks, key/value expansion for prefill (mla_reference),
    over the joint cache ``kv [B, T, R + rope]``. ``rope``/``rope_offset``: q_rope arrives
    unrotated (one decode row; mla_decode rotates it). ``q_proj``: ``(q_latent, q_b)`` of one
    decode row, q_nope / q_rope None (mla_decode projects them)."""
    if q_proj is not None or step_params is not None or q_nope.shape[2] <= ABSORBED_MAX_TOKENS:
        return kernels.mla_decode(q_nope, q_rope, kv, None, kv_b, scale, mask, nope, v_dim,
                                  params=step_params, rope=rope, rope_offset=rope_offset, q_proj=q_proj,
                                  causal=causal)
    if rope is not None:
        q_rope = rope.apply_fast(q_rope, rope_offset)
    R = kv.shape[-1] - q_rope.shape[-1]
    return mla_reference.mla_prefill(q_nope, q_rope, kv[..., :R], kv[..., R:], kv_b, scale, mask, nope, v_dim)


# ------------------------------------------------------------------------------ feed-forward


class MLP:
    """SwiGLU: ``down(silu(gate x) * up x)`` (dense layers and shared experts)."""

    def __init__(self, w: WeightTable, prefix: str, hidden: int, inter: int):
        self.gate = w.take(prefix + "gate_proj.weight", (inter, hidden))
        self.up = w.take(prefix + "up_proj.weight", (inter, hidden))
        self.down = w.take(prefix + "down_proj.weight", (hidden, inter))
        self._compiled = kernels.compiled.CompiledBlock(self.forward, "mlp")

    def forward(self, x, residual=None):
        return linear(moe_reference.silu(linear(x, self.gate)) * linear(x, self.up), self.down, residual=residual)

    def host_reason(self, x):
        return None                       # no values leave the GPU: always a compilable graph

    def __call__(self, x):
        # Decode rows (the qgemv path): the same graph every step, compiled on GPUs.
        return self._compiled(x) if x.size <= DECODE_ROWS * x.shape[-1] else self.forward(x)


class Router:
    """noaux_tc routing exactly as transformers' ``DeepseekV3TopkRouter`` (kernels.router: the
    fused ``router_topk`` launches on GPUs for decode, the pure-MLX reference otherwise)."""

    def __init__(self, args: ModelArgs, w: WeightTable, prefix: str):
        E = args.n_routed_experts
        f32 = mx.float32
        self.args = args
        self.weight = _as_float32(w.take(prefix + "weight", (E, args.hidden_size), dtype=f32), prefix + "weight")
        # noaux_tc routing selects with this bias; routing without it would silently differ.
        self.bias = _as_float32(w.take(prefix + "e_score_correction_bias", (E,), dtype=f32), prefix + "bias")
        self._config = (None, None)
        self.top_p = None  # router top-p over the selected experts (experts.router_topp); changes results

    @property
    def config(self):
        """kernels.router.RouterConfig of the current args (rebuilt only when they change)."""
        a = self.args
        key = (a.num_experts_per_tok, a.n_group, a.topk_group, bool(a.norm_topk_prob),
               float(a.routed_scaling_factor))
        if self._config[0] != key:
            self._config = (key, kernels.router.RouterConfig(*key))
        return self._config[1]

    def __call__(self, x: mx.array, shared_id: int | None = None) -> tuple[mx.array, mx.array]:
        """``(ids [..., K], weights [..., K])``; with ``shared_id`` one more slot ``(shared_id, 1.0)``."""
        if self.top_p is None:
            return kernels.router.router_topk(x, self.weight, self.bias, self.config, shared_id)
        from ..experts.router_topp import expert_top_p

        r = kernels.router
        kernels.dispatch.record_call("router", "top-p")
        ids, weights = r.reference_select(r.reference_scores(x, self.weight), self.bias, self.config)
        ids, weights = expert_top_p(ids, weights, self.top_p, self.config.norm_topk_prob,
                                    self.config.routed_scaling_factor)
        return r.with_shared_slot(ids, weights, shared_id)


def _as_float32(value, name):
    if isinstance(value, QTensor):
        raise ValueError(f"{name}: the router must be stored as a float tensor, found a quantized one")
    return value.astype(mx.float32)


def routed_experts(x: mx.array, experts, ids: mx.array, weights: mx.array, residual=None) -> mx.array:
    """The routed-expert hot path: ``kernels.moe_block`` (fused kernels on GPUs, the grouped
    reference on the CPU backend and for prefill), plus ``residual`` when given."""
    return kernels.moe_block(x, experts, ids, weights, residual)


class MoE:
    def __init__(self, args: ModelArgs, w: WeightTable, prefix: str):
        D, inter = args.hidden_size, args.moe_intermediate_size
        self.router = Router(args, w, prefix + "gate.")
        store = getattr(w, "expert_store", None)  # experts streamed from disk (experts.ExpertStore)
        held = getattr(w, "experts_held", None)   # this rank's share under expert parallel (distributed)
        self.expert_ids = list(range(args.n_routed_experts)) if held is None else held(prefix + "experts.")
        self.parallel = None                      # distributed.ExpertParallel: local experts + all_sum
        if store is not None:
            self.experts = store.view_for_prefix(prefix + "experts.")
            w.used.update(store.tensor_names(self.experts.layer))
        else:
            self.experts = [
                tuple(w.take(f"{prefix}experts.{e}.{p}_proj.weight", s)
                      for p, s in (("gate", (inter, D)), ("up", (inter, D)), ("down", (D, inter))))
                for e in self.expert_ids
            ]
        self.shared = None
        # What kernels.moe_block reads: the routed experts, plus the shared expert as expert E
        # when it has their shape and format (DeepSeek-V3: n_shared_experts = 1). Every token
        # then gets an extra slot (E, 1.0) and routed + shared are the same two launches.
        self.bank = self.experts
        self.shared_slot: int | None = None
        self.shared_mlp_reason: str | None = None
        if args.n_shared_experts:
            self.shared = MLP(w, prefix + "shared_experts.", D, inter * args.n_shared_experts)
            triple = (self.shared.gate, self.shared.up, self.shared.down)
            self.shared_mlp_reason = kernels.moe.shared_slot_reason(self.experts, triple)
            if self.shared_mlp_reason is None:
                self.bank = list(self.experts) + [triple]
                self.shared_slot = len(self.experts)

        self._compiled = kernels.compiled.CompiledBlock(self.forward, "moe")

    def forward(self, x, residual=None):
        if self.parallel is not None:
            return self.parallel(self, x, residual)
        flat = x.reshape(-1, x.shape[-1])
        if self.shared is not None and self.shared_slot is None:
            y = self.routed(flat).reshape(x.shape)
            kernels.dispatch.record_call("moe_shared", "mlp")   # shape/fmt/streaming: shared_mlp_reason
            y = y + self.shared.forward(x)
            return y if residual is None else residual + y
        if residual is not None and residual.shape == x.shape:
            return self.routed(flat, residual)                   # written in x's shape
        res = None if residual is None else residual.reshape(flat.shape)
        return self.routed(flat, res).reshape(x.shape)

    def routed(self, flat, residual=None):
        """The routed experts (and the shared slot) of ``flat [N, D]``."""
        ids, weights = self.router(flat, self.shared_slot)     # [N, K(+1)]
        return routed_experts(flat, self.bank, ids, weights, residual)

    def __call__(self, x):
        if x.size > DECODE_ROWS * x.shape[-1]:
            return self.forward(x)
        # Decode rows: compiled on GPUs when the graph keeps the routing on the GPU.
        return self._compiled(x, static=self.host_reason(x))

    def host_reason(self, x):
        """None when :meth:`forward` of these decode rows reads no values on the host."""
        n = x.size // x.shape[-1]
        if not isinstance(self.router, Router):
            return "router replaced by a Python function (its side effects would be traced once)"
        if self.router.top_p is not None:
            return "router top-p selects on the host"
        if self.parallel is not None:
            return "expert parallel: the partial sums cross processes (all_sum)"
        K = self.router.args.num_experts_per_tok + (self.shared_slot is not None)
        return kernels.moe.host_reason(x.reshape(n, x.shape[-1]), self.bank, K)


# ---------------------------------------------------------------------------------- layers


class DecoderLayer:
    def __init__(self, args: ModelArgs, w: WeightTable, layer_idx: int):
        p = f"model.layers.{layer_idx}."
        D = args.hidden_size
        self.eps = args.rms_norm_eps
        self.input_norm = w.take(p + "input_layernorm.weight", (D,))
        self.post_attention_norm = w.take(p + "post_attention_layernorm.weight", (D,))
        self.self_attn = Attention(args, w, p + "self_attn.", layer_idx)
        if args.is_moe_layer(layer_idx):
            self.mlp = MoE(args, w, p + "mlp.")
        else:
            self.mlp = MLP(w, p + "mlp.", D, args.intermediate_size)

        self._compiled_in = kernels.compiled.CompiledBlock(self._decode_in, "layer_in")
        self._compiled_out = kernels.compiled.CompiledBlock(self._decode_out, "layer_out")
        self._compiled_step = kernels.compiled.CompiledBlock(self._step, "layer_step")
        self._compiled_rows_step = kernels.compiled.CompiledBlock(self._step, "layer_rows_step")

    def __call__(self, x, cos, sin, mask, layer_cache, start, shared_selection=None, rope_offset=None):
        if rope_offset is not None and x.shape[1] > 1:
            reason = self.rows_reason(x, layer_cache, shared_selection)
            if reason is None:
                return self.self_attn.decode_step(x, layer_cache, start, rope_offset, self._compiled_rows_step), None
            kernels.dispatch.record_call("compiled/layer_rows_step", f"declined: {reason}")
        if rope_offset is not None and x.shape[1] == 1 and self.self_attn.indexer is None and shared_selection is None:
            return self.decode(x, mask, layer_cache, start, rope_offset), None
        h, selection = self.self_attn(rms_norm(x, self.input_norm, self.eps), cos, sin, mask, layer_cache, start,
                                      shared_selection, rope_offset)
        x = x + h
        return x + self.mlp(rms_norm(x, self.post_attention_norm, self.eps)), selection

    def decode(self, x, mask, layer_cache, start, rope_offset):
        """One decode row of one sequence (no padding: its position is its cache slot).

        When blocks are compiled (kernels.compiled) and the MLP keeps its values on the GPU, the
        whole layer is one compiled graph over the cache's fixed-capacity buffers: its shapes
        change only when they grow, the slot and the attended length are inputs. Otherwise
        everything before the cache and everything after the attention core are compiled
        blocks and the cache writes and attention over the grown cache are built per step."""
        reason = self.mlp.host_reason(x)
        if reason is None and self.self_attn.steps_compiled(x, mask, layer_cache, None, rope_offset):
            return self.self_attn.decode_step(x, layer_cache, start, rope_offset, self._compiled_step)
        q_nope, q_rope, kv, _, q_proj = self.self_attn.decode_queries(self._compiled_in(x, rope_offset), x.shape[0])
        kv = self.self_attn.cached(kv, layer_cache, start)
        attn = self.self_attn.attend(q_nope, q_rope, kv, mask, q_offset=rope_offset, q_proj=q_proj)
        return self._compiled_out(x, attn, static=reason)

    def rows_reason(self, x, layer_cache, shared_selection):
        """Why the rows of one sequence (:meth:`Model._positions_and_mask` gives them a
        ``rope_offset``) do not run as one compiled graph (:meth:`Attention.step`), or None."""
        if layer_cache is None:
            return "no cache"
        if self.self_attn.indexer is not None or shared_selection is not None:
            return "DSA selection"
        return self.mlp.host_reason(x)

    def _step(self, x, slot, kv, params):
        x, kv = self.self_attn.step(stream_norm(x, self.input_norm, self.eps), slot, kv, params, residual=x)
        return self._feed_forward(x), kv

    def _decode_in(self, x, rope_offset):
        return self.self_attn._decode_rows(stream_norm(x, self.input_norm, self.eps), rope_offset)

    def _decode_out(self, x, attn):
        return self._feed_forward(self.self_attn.output(attn, x.reshape(-1, x.shape[-1])).reshape(x.shape))

    def _feed_forward(self, x):
        """``x + mlp(norm(x))`` of decode rows, the add in the MLP's last kernel where it has one."""
        return self.mlp.forward(stream_norm(x, self.post_attention_norm, self.eps), residual=x)


class MTPLayer:
    """Multi-token-prediction head (layer index ≥ num_hidden_layers): the draft model of
    speculative decoding (its forward pass: models/mtp.py)."""

    def __init__(self, args: ModelArgs, w: WeightTable, layer_idx: int):
        p = f"model.layers.{layer_idx}."
        D, V = args.hidden_size, args.vocab_size
        self.layer = DecoderLayer(args, w, layer_idx)
        self.eh_proj = w.take(p + "eh_proj.weight", (D, 2 * D))
        self.enorm = w.take(p + "enorm.weight", (D,))
        self.hnorm = w.take(p + "hnorm.weight", (D,))
        self.head_norm = w.take(p + "shared_head.norm.weight", (D,))
        self.head = w.maybe(p + "shared_head.head.weight", (V, D))
        self.embed_tokens = w.maybe(p + "embed_tokens.weight", (V, D))


def commits_layers(L: int) -> bool:
    """Whether a forward pass of ``L`` rows hands each decode layer to the device as soon as it is
    built (``mx.async_eval`` of its output and cache buffers), so the GPU runs layer i while
    Python builds layer i + 1: decode rows (one, or a verify step's up to DECODE_ROWS) on a GPU
    backend. For one row on the H200 that was faster than one compiled graph for the whole step
    (every layer and the head) in two independent runs: 1.36 against 1.64 ms/token, and 1.65
    against 1.85. On the CPU the step is built whole and evaluated by the caller."""
    return L <= DECODE_ROWS and kernels.dispatch.gpu_backend() is not None


class Model:
    """``model(tokens [B, L], cache=None, left_padding=None) -> logits [B, L, vocab]`` (float32).

    ``dtype``: activation dtype (:func:`resolve_dtype`; None = float32 on CPU, bfloat16 on GPU).
    """

    def __init__(self, args: ModelArgs, weights: WeightTable, dtype=None):
        D, V = args.hidden_size, args.vocab_size
        self.args = args
        self.dtype = resolve_dtype(dtype)
        weights.dtype = self.dtype
        self.embed_tokens = weights.take("model.embed_tokens.weight", (V, D))
        self.dense_attention_reason = _dense_attention_fallback(args, weights)
        # Pipeline parallel (distributed) holds a contiguous range of layers per rank.
        self.layer_ids = getattr(weights, "layers_held", range(args.num_hidden_layers))
        self.layers = [DecoderLayer(args, weights, i) for i in self.layer_ids]
        self.norm = weights.take("model.norm.weight", (D,))
        if "lm_head.weight" in weights or not args.tie_word_embeddings:
            self.lm_head = weights.take("lm_head.weight", (V, D))
        else:
            self.lm_head = self.embed_tokens
        self.mtp_layers = [MTPLayer(args, weights, i) for i in self._mtp_indices(weights)]
        weights.check_all_used()
        self.rope = make_rope(args.rope, args.qk_rope_head_dim, args.max_position_embeddings, args.rope_interleave)
        self.max_length = args.max_position_embeddings
        self._compiled_head = kernels.compiled.CompiledBlock(self.head, "head")

    def _mtp_indices(self, weights):
        n = self.args.num_hidden_layers
        # An MTP layer is recognised by its eh_proj; other tensors past the last layer are refused.
        return [i for i in range(n, n + max(self.args.num_nextn_predict_layers, 1))
                if f"model.layers.{i}.eh_proj.weight" in weights]

    def make_cache(self) -> LatentCache:
        return LatentCache(len(self.layers), self.max_length)

    def __call__(self, tokens: mx.array, cache: LatentCache | None = None, left_padding=None) -> mx.array:
        x = self.hidden_states(tokens, cache, left_padding)
        # Decode rows (one, or a verify step's): the head's graph compiled per row count.
        return self._compiled_head(x) if x.shape[1] <= DECODE_ROWS else self.head(x)

    def hidden_states(self, tokens: mx.array, cache: LatentCache | None = None, left_padding=None,
                      x: mx.array | None = None) -> mx.array:
        """The last decoder layer's output ``[B, L, D]`` (before the final norm); advances ``cache``.
        ``x``: the first layer's input in place of the tokens' embeddings (a pipeline stage's
        received hidden state, distributed.pipeline_forward)."""
        tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
        B, L = tokens.shape
        if cache is None:
            cache = self.make_cache()
        if cache.offset == 0:
            cache.set_left_padding(left_padding, B)
        elif left_padding is not None:
            raise ValueError("left_padding can only be given on the first call with an empty cache")
        elif cache.batch_size != B:
            raise ValueError(f"cache holds {cache.batch_size} sequences, tokens have {B}")
        start = cache.offset
        if start + L > self.max_length:
            raise ValueError(f"context of {start + L} tokens exceeds max_position_embeddings={self.max_length}")
        cos, sin, mask, rope_offset = self._positions_and_mask(cache.left_padding, start, L, cache.padded)
        if x is None:
            x = embedding_rows(self.embed_tokens, tokens).astype(self.dtype)
        commit = commits_layers(L)
        selection = None
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache.layers)):
            x, selection = layer(x, cos, sin, mask, layer_cache, start, selection, rope_offset)
            if commit and i + 1 < len(self.layers):
                # The GPU starts on this layer while the next one is built (commits_layers).
                mx.async_eval(x, *layer_cache.buffers.values())
        cache.advance(L)
        return x

    def head(self, x):
        """float32 logits: the GEMV writes them as float32 (no rounding to bf16, no cast launch)."""
        return kernels.qmatmul(rms_norm(x, self.norm, self.args.rms_norm_eps), self.lm_head, out_dtype=mx.float32)

    def _positions_and_mask(self, left_padding: mx.array, start: int, L: int, padded: bool = True):
        if L == 1 and not padded and left_padding.shape[0] == 1 and not self.args.dsa:
            # One decode row of one sequence (DecoderLayer.decode): its position is its slot;
            # no mask, and no cos/sin (mx.fast.rope takes the offset).
            return None, None, None, kernels.device_inputs.int32_scalar(start, kernels.backend())
        if 1 < L <= DECODE_ROWS and start > 0 and not padded and left_padding.shape[0] == 1 \
                and not self.args.dsa and kernels.compiled.enabled(kernels.backend()):
            # A few rows of one sequence after its prompt (a verify step): compiled per layer at
            # these slots (DecoderLayer.rows_reason); cos/sin and the mask for layers that decline.
            rows_offset = kernels.device_inputs.int32_range(start, L, kernels.backend())
        else:
            rows_offset = None
        slots = mx.arange(start, start + L)
        pad = left_padding[:, None]
        positions = mx.maximum(slots[None, :] - pad, 0)  # [B, L]
        cos, sin = self.rope.cos_sin(positions)
        if L == 1 and not padded:
            mask = None  # one row per sequence, no padding: it sees every key (mask ops and reads saved)
        else:
            # causal (row l sees positions up to start + l) and past each sequence's left padding
            mask = kernels.mla.causal_mask(L, start + L) & (mx.arange(start + L)[None] >= pad)[:, None, None]
        # One decode row of one sequence: attention rotates with mx.fast.rope at this position
        # (a scalar offset: every MLX backend takes it; batches keep cos/sin).
        rope_offset = positions.reshape(()) if positions.size == 1 else rows_offset
        return cos, sin, mask, rope_offset  # mask [B, 1, L, T] or None


# --------------------------------------------------------------------------------- sanitize


_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def sanitize(weights: dict) -> dict:
    """Map Hugging Face checkpoint tensors onto the names :class:`Model` takes.

    Drops rotary caches, splits transformers' fused in-memory expert layout
    (``experts.gate_up_proj [E, 2I, D]``, ``experts.down_proj [E, D, I]``) into per-expert
    ``experts.{e}.{gate,up,down}_proj.weight``. FP8 dequantization happens in loading.
    """
    out = {}
    for name, value in weights.items():
        if WeightTable.IGNORED.search(name):
            continue
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            out[name] = value
            continue
        base, kind = m.groups()
        for e in range(value.shape[0]):
            if kind == "down_proj":
                out[f"{base}.{e}.down_proj.weight"] = value[e]
            else:
                inter = value.shape[1] // 2
                out[f"{base}.{e}.gate_proj.weight"] = value[e, :inter]
                out[f"{base}.{e}.up_proj.weight"] = value[e, inter:]
    return out

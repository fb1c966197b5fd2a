"""Tensor names and [O, I] shapes implied by a config.json (docs/format.md#shapes), and name classes.

The container stores quantized weights as flat byte streams, so [O, I] has to come from the
config: this is upstream's `model_init` table, extended to the DeepSeek-V3 family
(`deepseek_v3`, `kimi_k2`, `deepseek_v32`, `glm_moe_dsa`): `q_proj` when `q_lora_rank` is null,
`moe_layer_freq` / `mlp_layer_types`, several MTP layers, and DSA indexers.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

Shape = tuple[int, int]

# The model_types whose tensors this table describes (models.MODEL_TYPES loads the same set).
MODEL_TYPES = frozenset(("deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa"))
DSA_MODEL_TYPES = frozenset(("deepseek_v32", "glm_moe_dsa"))
# Hugging Face defaults of the indexer fields (transformers' DeepseekV32Config / GlmMoeDsaConfig).
DSA_DEFAULT_HEADS = {"deepseek_v32": 64, "glm_moe_dsa": 32}
DSA_DEFAULT_HEAD_DIM = 128

MAX_LAYERS, MAX_EXPERTS = 4096, 16384  # as models.config_schema
TENSOR_CLASSES = ("attention", "dense_mlp", "shared_experts", "routed_experts", "embeddings_head",
                  "norms_router", "indexer", "mtp", "other")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def expected_shapes(config: Mapping) -> dict[str, Shape]:
    """Every 2-D weight the config implies, ``name -> (O, I)`` (O rows = outputs)."""
    c = _Dims(config)
    shapes: dict[str, Shape] = {"model.embed_tokens.weight": (c.vocab, c.D)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (c.vocab, c.D)
    for i in range(c.layers):
        shapes.update(_layer_shapes(c, i))
    for i in range(c.layers, c.layers + c.mtp_layers):
        p = f"model.layers.{i}."
        shapes.update(_layer_shapes(c, i))
        shapes[p + "eh_proj.weight"] = (c.D, 2 * c.D)
        # DeepSeek-V3 checkpoints give each MTP layer its own embedding and head copies.
        shapes[p + "embed_tokens.weight"] = (c.vocab, c.D)
        shapes[p + "shared_head.head.weight"] = (c.vocab, c.D)
    return shapes


class _Dims:
    def __init__(self, config: Mapping):
        def need(key):
            if config.get(key) is None:
                raise KeyError(f"config.json has no {key!r}, needed for tensor shapes")
            return int(config[key])

        self.config = config
        self.model_type = config.get("model_type", "deepseek_v3")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"unknown model_type {self.model_type!r}; tensor shapes are known for "
                             f"{sorted(MODEL_TYPES)}")
        self.D = need("hidden_size")
        self.vocab = need("vocab_size")
        self.layers = need("num_hidden_layers")
        self.H = need("num_attention_heads")
        self.q_lora = None if config.get("q_lora_rank") is None else int(config["q_lora_rank"])
        self.kv_lora = need("kv_lora_rank")
        self.qk_nope = need("qk_nope_head_dim")
        self.qk_rope = need("qk_rope_head_dim")
        self.v_head = need("v_head_dim")
        self.inter = int(config.get("intermediate_size") or 0)
        self.moe_inter = int(config.get("moe_intermediate_size") or 0)
        self.experts = int(config.get("n_routed_experts") or 0)
        self.shared = int(config.get("n_shared_experts") or 0)
        self.first_dense = int(config.get("first_k_dense_replace") or 0)
        self.moe_freq = int(config.get("moe_layer_freq") or 1)
        self.mtp_layers = int(config.get("num_nextn_predict_layers") or 0)
        self.dsa = self.model_type in DSA_MODEL_TYPES
        # The table has layers x experts entries: an absurd count would loop for hours.
        for key, value, most in (("num_hidden_layers", self.layers, MAX_LAYERS),
                                 ("n_routed_experts", self.experts, MAX_EXPERTS),
                                 ("num_nextn_predict_layers", self.mtp_layers, 64)):
            if not 0 <= value <= most:
                raise ValueError(f"config.json: {key}={value} is out of range (0..{most})")
        self.index_heads = int(config.get("index_n_heads") or DSA_DEFAULT_HEADS.get(self.model_type, 0))
        self.index_dim = int(config.get("index_head_dim") or DSA_DEFAULT_HEAD_DIM)

    def is_moe(self, i: int) -> bool:
        types = self.config.get("mlp_layer_types")
        if types and i < len(types):
            return types[i] == "sparse"
        return self.experts > 0 and i >= self.first_dense and i % self.moe_freq == 0

    def has_indexer(self, i: int) -> bool:
        """DeepSeek-V3.2 indexes every layer; GLM-5.x only its "full" layers."""
        if not self.dsa:
            return False
        types = self.config.get("indexer_types")
        if types and i < len(types):
            return types[i] == "full"
        pattern = self.config.get("index_topk_pattern")
        if pattern and i < len(pattern):
            return pattern[i] in ("F", "full")
        freq = max(int(self.config.get("index_topk_freq") or 1), 1)
        offset = int(self.config.get("index_skip_topk_offset", 2))
        return max(i - offset + 1, 0) % freq == 0


def _layer_shapes(c: _Dims, i: int) -> dict[str, Shape]:
    p = f"model.layers.{i}."
    qk_head = c.qk_nope + c.qk_rope
    s: dict[str, Shape] = {}
    if c.q_lora is None:
        s[p + "self_attn.q_proj.weight"] = (c.H * qk_head, c.D)
    else:
        s[p + "self_attn.q_a_proj.weight"] = (c.q_lora, c.D)
        s[p + "self_attn.q_b_proj.weight"] = (c.H * qk_head, c.q_lora)
    s[p + "self_attn.kv_a_proj_with_mqa.weight"] = (c.kv_lora + c.qk_rope, c.D)
    s[p + "self_attn.kv_b_proj.weight"] = (c.H * (c.qk_nope + c.v_head), c.kv_lora)
    s[p + "self_attn.o_proj.weight"] = (c.D, c.H * c.v_head)
    if c.has_indexer(i):
        q_in = c.q_lora if c.q_lora is not None else c.D
        s[p + "self_attn.indexer.wq_b.weight"] = (c.index_heads * c.index_dim, q_in)
        s[p + "self_attn.indexer.wk.weight"] = (c.index_dim, c.D)
        s[p + "self_attn.indexer.weights_proj.weight"] = (c.index_heads, c.D)
    if c.is_moe(i) or i >= c.layers:
        s.update(_moe_shapes(c, p))
    else:
        s.update(_swiglu(p + "mlp.", c.inter, c.D))
    return s


def _moe_shapes(c: _Dims, p: str) -> dict[str, Shape]:
    s: dict[str, Shape] = {p + "mlp.gate.weight": (c.experts, c.D)}
    if c.shared:
        s.update(_swiglu(p + "mlp.shared_experts.", c.moe_inter * c.shared, c.D))
    for e in range(c.experts):
        s.update(_swiglu(f"{p}mlp.experts.{e}.", c.moe_inter, c.D))
    return s


def _swiglu(prefix: str, inter: int, D: int) -> dict[str, Shape]:
    return {prefix + "gate_proj.weight": (inter, D), prefix + "up_proj.weight": (inter, D),
            prefix + "down_proj.weight": (D, inter)}


def expert_key(name: str) -> Optional[tuple[int, int, str]]:
    """``(layer, expert, projection)`` of a routed-expert weight name, else None."""
    m = _EXPERT.match(name[:-3] if name.endswith(".qs") else name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def tensor_class(name: str, num_hidden_layers: Optional[int] = None) -> str:
    """Which part of the model a stored tensor (or its ``.qs``) belongs to; one of TENSOR_CLASSES."""
    if name.endswith(".qs"):
        name = name[:-3]
    m = _LAYER.match(name)
    if m and num_hidden_layers is not None and int(m.group(1)) >= num_hidden_layers:
        return "mtp"
    if ".self_attn.indexer." in name or ".indexers_proj" in name:
        return "indexer"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if ".mlp.gate." in name or "norm" in module or name.endswith(".bias"):
        return "norms_router"
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "dense_mlp"
    if "embed_tokens" in name or name.startswith("lm_head") or "shared_head.head" in name:
        return "embeddings_head"
    if m and any(k in name for k in (".eh_proj.", ".enorm.", ".hnorm.", ".shared_head.")):
        return "mtp"
    return "other"

"""A tiny container written with numpy alone (no torch, no transformers): milliseconds to build,
a fraction of a second to load. For tests of what a user can get wrong around a model
directory (tests/test_model_errors.py, tests/test_first_hour.py).

Two shards: ``out-00000.safetensors`` (everything but the routed experts) and
``out-00001.safetensors`` (the routed experts), quantized as a converter would (fmt 4 / 1),
norms and routers float32; plus config.json, generation_config.json and the byte-level
tokenizer of helpers_models (with a chat template).
"""

from __future__ import annotations

import json
import os

import numpy as np

from helpers_models import VOCAB_SIZE, write_tokenizer

CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=VOCAB_SIZE, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=1,
    num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_group=2,
    topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=64, rms_norm_eps=1e-6,
    rope_theta=10000.0, rope_scaling=None, scoring_func="sigmoid", topk_method="noaux_tc", hidden_act="silu",
    tie_word_embeddings=False, attention_bias=False, bos_token_id=256, eos_token_id=257,
    num_nextn_predict_layers=0,
)
GLM = dict(CONFIG, architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", index_topk=8, index_n_heads=4,
           index_head_dim=32, index_topk_freq=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def tensor_shapes(config: dict) -> dict[str, tuple]:
    """Every tensor the engine reads for ``config``: the 2-D table plus norms and biases."""
    from colibri_mlx.container import expected_shapes

    shapes = dict(expected_shapes(config))
    D, n = config["hidden_size"], config["num_hidden_layers"]
    dsa = config["model_type"] in ("deepseek_v32", "glm_moe_dsa")
    mtp = config.get("num_nextn_predict_layers") or 0
    for i in range(n + mtp):
        p = f"model.layers.{i}."
        if i >= n:  # an MTP layer: its norms besides the decoder layer's
            for name in ("enorm", "hnorm", "shared_head.norm"):
                shapes[p + name + ".weight"] = (D,)
        shapes[p + "input_layernorm.weight"] = (D,)
        shapes[p + "post_attention_layernorm.weight"] = (D,)
        shapes[p + "self_attn.q_a_layernorm.weight"] = (config["q_lora_rank"],)
        shapes[p + "self_attn.kv_a_layernorm.weight"] = (config["kv_lora_rank"],)
        if i >= config["first_k_dense_replace"]:
            shapes[p + "mlp.gate.e_score_correction_bias"] = (config["n_routed_experts"],)
        if dsa:
            shapes[p + "self_attn.indexer.k_norm.weight"] = (config["index_head_dim"],)
            shapes[p + "self_attn.indexer.k_norm.bias"] = (config["index_head_dim"],)
    shapes["model.norm.weight"] = (D,)
    return shapes


def _format(name: str, shape: tuple):
    if len(shape) != 2 or "mlp.gate.weight" in name or "indexer" in name or "embed_tokens" in name:
        return None
    if "lm_head" in name:
        return (1, None)
    return (4, 16)


def write_tiny_container(path, config: dict = CONFIG, seed: int = 0, indexer: bool = True,
                         mtp_shard: bool = False) -> str:
    """Write the container to ``path`` (created); returns it. ``indexer=False`` leaves a DSA
    model's indexer weights out, as the converter's main pass does; ``mtp_shard=True`` puts the
    MTP layer's tensors in ``out-mtp-00000.safetensors``, as the converter's --mtp pass does."""
    from colibri_mlx.container import write_shard
    from colibri_mlx.formats import QTensor, encode

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards: list[dict] = [{}, {}, {}]
    mtp_prefix = f"model.layers.{config['num_hidden_layers']}."
    for name, shape in sorted(tensor_shapes(config).items()):
        if not indexer and ".indexer." in name:
            continue
        if name.endswith(("norm.weight", "layernorm.weight")):
            w = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif len(shape) == 1:
            w = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            w = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        choice = _format(name, shape)
        if choice is not None:
            packed, scales = encode(choice[0], w, choice[1])
            w = QTensor(packed, scales, choice[0], shape[0], shape[1], choice[1], name)
        shards[2 if mtp_shard and name.startswith(mtp_prefix) else 1 if ".mlp.experts." in name else 0][name] = w
    for i, tensors in enumerate(shards[:2]):
        write_shard(os.path.join(path, f"out-{i:05d}.safetensors"), tensors)
    if shards[2]:
        write_shard(os.path.join(path, "out-mtp-00000.safetensors"), shards[2])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 256, "eos_token_id": 257}, f)
    write_tokenizer(path)
    return path

"""Tiny random DeepSeek-V3-family checkpoints built with transformers (the parity oracle).

Shared by the model, generate, CLI, converter and kernel tests:

* ``build_hf_model(arch, seed, **overrides)``: a float32 transformers model of a tiny config
  (hidden 64, 3-4 layers, 8-16 experts) with weights drawn at O(1) scale, so that routing,
  attention and logits are far from degenerate (the library's default init of std 0.02 gives
  near-uniform routing and logits ~1e-3).
* ``save_checkpoint(model, path, rope_style=..., model_type=..., fp8=...)``: a Hugging Face
  checkpoint directory (safetensors + config.json + tokenizer files), optionally FP8 e4m3 with
  128x128 ``weight_scale_inv`` blocks, optionally with the older ``rope_theta``/``rope_scaling``
  config style.
* ``write_tokenizer(path)``: a byte-level BPE tokenizer (256 byte tokens + specials) with a
  simple chat template.

Configs (``CONFIGS``) cover: n_group 1 and > 1, q LoRA on and off, YaRN on and off (with an
attention factor != 1 so both YaRN scalings matter), DSA full and shared indexer layers.
DSA configs use 8 indexer heads: with fewer, ReLU makes many index scores exactly 0 and ties at
the top-k boundary make the selection implementation-defined.
"""

from __future__ import annotations

import json
import os

import numpy as np

TOKENIZER_SPECIALS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|pad|>", "<|r1|>", "<|r2|>"]
VOCAB_SIZE = 256 + len(TOKENIZER_SPECIALS)
EOS_ID = 257
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

BASE = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
    num_experts_per_tok=3, n_shared_experts=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
    qk_nope_head_dim=16, v_head_dim=24, n_group=1, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=2.5, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=256,
    eos_token_id=None, pad_token_id=261, tie_word_embeddings=False,
)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
            mscale=1.0, mscale_all_dim=0.8, beta_fast=32, beta_slow=1)
DSA = dict(index_topk=8, index_n_heads=8, index_head_dim=32)

# name -> (transformers architecture, overrides)
CONFIGS = {
    "v3_lora_g1": ("deepseek_v3", dict()),
    "v3_plainq_groups_yarn": ("deepseek_v3", dict(q_lora_rank=None, n_routed_experts=16, n_group=4, topk_group=2,
                                                   rope_parameters=YARN)),
    "v32_groups": ("deepseek_v32", dict(DSA, n_routed_experts=16, n_group=4, topk_group=2)),
    "glm_shared_yarn": ("glm_moe_dsa", dict(DSA, num_hidden_layers=4, index_topk_freq=2, index_skip_topk_offset=1,
                                            rope_parameters=dict(YARN, mscale_all_dim=1.0, mscale=0.9))),
}


def _classes(arch):
    import transformers as tf

    return {
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
        "deepseek_v32": (tf.DeepseekV32Config, tf.DeepseekV32ForCausalLM),
        "glm_moe_dsa": (tf.GlmMoeDsaConfig, tf.GlmMoeDsaForCausalLM),
    }[arch]


def build_hf_model(arch: str, seed: int = 0, **overrides):
    """A float32, eval-mode transformers model of a tiny config with O(1)-scale random weights."""
    import torch

    config_cls, model_cls = _classes(arch)
    kwargs = dict(BASE, **overrides)
    rope = kwargs.pop("rope_parameters", None)
    config = config_cls(**kwargs, rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    _randomize(model, seed)
    return model


def build_config_model(name: str, seed: int = 0):
    arch, overrides = CONFIGS[name]
    return build_hf_model(arch, seed, **overrides)


def _randomize(model, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or name.endswith("k_norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def state_dict_numpy(model) -> dict[str, np.ndarray]:
    """Checkpoint tensors (per-expert names, as save_pretrained writes them) as float32 numpy."""
    import tempfile

    from safetensors.numpy import load_file

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        out = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                out.update(load_file(os.path.join(d, f)))
    return out


def save_checkpoint(model, path, rope_style: str = "parameters", model_type: str | None = None,
                    fp8: bool = False, tokenizer: bool = True) -> str:
    """Write a Hugging Face checkpoint directory for ``model``; returns ``path``.

    ``rope_style="legacy"`` rewrites config.json to the hub DeepSeek-V3 style (``rope_theta`` +
    ``rope_scaling``). ``fp8=True`` stores every 2-D projection (not embeddings, norms, router)
    as F8_E4M3 with a float32 ``weight_scale_inv`` per 128x128 block and loads the *dequantized*
    values back into ``model`` so that it stays the oracle of what the checkpoint holds.
    """
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    if fp8:
        _convert_to_fp8(model, path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        config = json.load(f)
    if rope_style == "legacy":
        params = dict(config.pop("rope_parameters"))
        config["rope_theta"] = params.pop("rope_theta")
        if params.get("rope_type", "default") != "default":
            params["type"] = params.pop("rope_type")
            config["rope_scaling"] = params
        else:
            config["rope_scaling"] = None
    if model_type is not None:
        config["model_type"] = model_type
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=2)
    if tokenizer:
        write_tokenizer(path)
    return path


FP8_SKIP = ("embed_tokens", "lm_head", "mlp.gate.weight", "norm", "weights_proj")


def _convert_to_fp8(model, path: str, block: int = 128) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    dequantized = {}
    for f in files:
        tensors = load_file(os.path.join(path, f))
        out = {}
        for name, w in tensors.items():
            if w.ndim != 2 or any(s in name for s in FP8_SKIP):
                out[name] = w
                continue
            O, I = w.shape
            bo, bi = -(-O // block), -(-I // block)
            padded = torch.zeros(bo * block, bi * block)
            padded[:O, :I] = w
            amax = padded.reshape(bo, block, bi, block).abs().amax(dim=(1, 3)).clamp(min=1e-12)
            scale = (amax / 448.0).float()  # e4m3 max
            full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:O, :I]
            q = (w / full).to(torch.float8_e4m3fn)
            out[name] = q
            out[name + "_scale_inv"] = scale.contiguous()
            dequantized[name] = q.float() * full
        save_file(out, os.path.join(path, f), metadata={"format": "pt"})
    model.load_state_dict({**model.state_dict(), **_unfuse_names(model, dequantized)}, strict=True)


def _unfuse_names(model, dequantized: dict) -> dict:
    """Map per-expert checkpoint names back onto the model's fused expert parameters."""
    import re

    import torch

    state = model.state_dict()
    out = {k: v for k, v in dequantized.items() if k in state}
    fused: dict = {}
    for name, w in dequantized.items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m:
            fused.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = w
    for base, parts in fused.items():
        n = 1 + max(e for e, _ in parts)
        out[base + ".gate_up_proj"] = torch.stack([torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in range(n)])
        out[base + ".down_proj"] = torch.stack([parts[(e, "down")] for e in range(n)])
    return out


def write_tokenizer(path) -> None:
    """Byte-level BPE (no merges) over 256 byte tokens plus specials, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(TOKENIZER_SPECIALS)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
              "pad_token": "<|pad|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 512}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _byte_of(char: str) -> int:
    # GPT-2's byte <-> unicode table: printable bytes map to themselves, the rest to 256+.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table[char]


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def random_tokens(n: int, seed: int = 0, batch: int = 1, high: int = 256) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, size=(batch, n)).astype(np.int32)


# ---------------------------------------------------------------------------- containers


def default_container_formats(name: str, shape: tuple):
    """A mix of every fmt over a tiny model: (fmt, gs) for a 2-D weight, None to keep it float32."""
    if len(shape) != 2 or "mlp.gate.weight" in name or "norm" in name:
        return None
    if "embed_tokens" in name or "lm_head" in name:
        return (1, None)
    if ".experts." in name:
        expert = int(name.split(".experts.")[1].split(".")[0])
        choice = [(4, 16), (2, None), (3, None), (5, None), (6, None), (4, 32), (1, None), (4, 64)][expert % 8]
        return choice if choice[0] != 6 or shape[1] % 256 == 0 else (4, 16)  # fmt 6 needs I % 256 == 0
    if "shared_experts" in name:
        return (5, None)
    if "kv_b_proj" in name:
        return (4, 32)
    if "self_attn" in name:
        return (4, 16)
    return (2, None)


def effective_weight(fmt: int, packed, scales, O: int, I: int, gs=None) -> np.ndarray:
    """The dense ``W`` a quantized tensor applies: ``y = W x``. For fmt 6 the stored ``S = W Q``
    is applied to the rotated input, so ``W = S M^T`` with ``M`` the rotation of the identity."""
    from colibri_mlx.formats import decode

    w = decode(fmt, packed, scales, O, I, gs)
    if fmt == 6:
        from colibri_mlx.formats.e8 import rotate_rows

        w = w @ rotate_rows(np.eye(I, dtype=np.float32)).T
    return w.astype(np.float32)


def write_container(state: dict, src_dir: str, out_dir: str, formats=default_container_formats) -> dict:
    """Quantize ``state`` (name -> float32 numpy) into a container at ``out_dir`` (config and
    tokenizer files copied from ``src_dir``); return name -> the effective float32 weights."""
    import shutil

    from colibri_mlx.container import write_shard
    from colibri_mlx.formats import QTensor, encode

    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(src_dir):
        if f.endswith(".json"):
            shutil.copy(os.path.join(src_dir, f), out_dir)
    tensors, effective = {}, {}
    for name, w in state.items():
        choice = formats(name, w.shape)
        if choice is None:
            tensors[name] = np.ascontiguousarray(w, dtype=np.float32)
            effective[name] = tensors[name]
            continue
        fmt, gs = choice
        O, I = w.shape
        packed, scales = encode(fmt, w, gs)
        tensors[name] = QTensor(packed, scales, fmt, O, I, gs, name)
        effective[name] = effective_weight(fmt, packed, scales, O, I, gs)
    write_shard(os.path.join(out_dir, "out-00000.safetensors"), tensors)
    return effective


def load_effective_weights(model, effective: dict) -> None:
    """Put checkpoint-named float weights into a transformers model (fusing per-expert names)."""
    import torch

    tensors = {k: torch.from_numpy(np.array(v)) for k, v in effective.items()}
    state = model.state_dict()
    mapped = {k: v for k, v in tensors.items() if k in state}
    mapped.update(_unfuse_names(model, {k: v for k, v in tensors.items() if k not in state}))
    missing = set(state) - set(mapped) - {k for k in state if "rotary" in k}
    assert not missing, f"weights not replaced: {sorted(missing)[:5]}"
    model.load_state_dict({**state, **mapped}, strict=True)

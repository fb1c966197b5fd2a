"""GGUF files (llama.cpp's format) as weights for :class:`deepseek_v3.Model`.

A model is one ``.gguf`` file, or a set of split files ``<name>-0000N-of-0000M.gguf`` (given as
their directory or as any one of them: metadata lives in the first, tensors in all), read with the
``gguf`` package's memory-mapped ``GGUFReader``. llama.cpp's ``deepseek2`` (DeepSeek-V3/R1,
Kimi-K2) and ``glm-dsa`` (GLM-5: the DSA indexer, NextN layers) architectures are supported; their
metadata is mapped onto the Hugging Face config.json keys :class:`ModelArgs` reads
(:func:`config_from_metadata`), their tensors onto the Hugging Face names the model takes
(:data:`LAYER_TENSORS`).

GGUF lists a tensor's dimensions innermost first (``ne0`` is the row length); shapes here are
numpy's, row length last. A quantized tensor stays a QTensor of its GGUF fmt
(:func:`formats.gguf_quant.qtensor_from_gguf`: the blocks untouched); F32, F16 and BF16 tensors
are float weights. Routed experts are stacked ``ffn_{gate,up,down}_exps [E, O, I]``; expert ``e``
is row ``e`` of each, one contiguous byte range (what expert streaming reads).

``kv_b`` is stored either whole (``attn_kv_b [H*(nope+v), kv_lora]``) or, as llama.cpp's converter
writes it for absorbed MLA, split per head: ``attn_k_b [H, kv_lora, nope]`` (the key part,
transposed) and ``attn_v_b [H, v, kv_lora]``. The split halves are decoded to float32 and joined
back into the ``kv_b_proj`` the model takes.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from ..errors import ConfigError
from ..formats.gguf_quant import GGUF_TYPES, dequantize_gguf, qtensor_from_gguf
from ..formats.mlx_quant import float_bits_as_f32
from .weights import WeightTable

SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# general.architecture -> (model_type, Hugging Face architecture, default expert_gating_func)
ARCHITECTURES = {
    "deepseek2": ("deepseek_v3", "DeepseekV3ForCausalLM", 1),   # llama.cpp: softmax (DeepSeek-V2) when absent
    "glm-dsa": ("glm_moe_dsa", "GlmMoeDsaForCausalLM", 2),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# llama.cpp's GLM-5 files before 5.2 (context < 1M) have full indexers in every layer when
# attention.indexer.types is absent (its glm-dsa loader).
GLM_5_2_CONTEXT = 1048576
# llama.cpp's expert_gating_func values (llama-hparams.h: LLAMA_EXPERT_GATING_FUNC_TYPE_*).
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}
# llama.cpp writes yarn_log_multiplier = 0.1 * mscale_all_dim for deepseek2 (its converter).
YARN_LOG_MUL_PER_MSCALE = 0.1
FLOAT_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<gguf> -> model.layers.N.<hf>
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    # the DSA lightning indexer (GLM-5)
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
    "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
    # a multi-token-prediction (NextN) layer, appended after the decoder layers
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
    "nextn.embed_tokens.weight": "embed_tokens.weight",
}
EXPERT_TENSORS = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up", "ffn_down_exps.weight": "down"}
SPLIT_KV_B = ("attn_k_b.weight", "attn_v_b.weight")
LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


class GgufError(ValueError):
    """A GGUF file that cannot be read as a model (names the file and the key or tensor)."""


# ------------------------------------------------------------------------------------ files


def is_gguf_path(path) -> bool:
    """``path`` is a ``.gguf`` file, or a directory of them without a config.json."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path.endswith(".gguf")
    if os.path.isdir(path) and not os.path.lexists(os.path.join(path, "config.json")):
        return any(n.endswith(".gguf") for n in os.listdir(path))
    return False


def gguf_files(path) -> list[str]:
    """The files of the GGUF model at ``path`` (module docstring), the first (metadata) first."""
    path = os.fspath(path)
    if os.path.isdir(path):
        found = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".gguf"))
        splits = {SPLIT_NAME.match(os.path.basename(f)).group("stem") for f in found
                  if SPLIT_NAME.match(os.path.basename(f))}
        if len(found) == 1:
            return found
        if len(splits) == 1 and all(SPLIT_NAME.match(os.path.basename(f)) for f in found):
            path = found[0]
        else:
            raise GgufError(f"{path}: holds {len(found)} .gguf files that are not the parts of one split model "
                            f"({', '.join(os.path.basename(f) for f in found[:4])}); give the file to load")
    m = SPLIT_NAME.match(os.path.basename(path))
    if m is None:
        return [path]
    count = int(m.group("count"))
    folder = os.path.dirname(path)
    files = [os.path.join(folder, f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise GgufError(f"{path}: part {os.path.basename(missing[0])} of the {count}-part split model is missing")
    return files


_reader_class = None


def reader_class():
    """``gguf.GGUFReader`` reading through a plain ndarray view of its memory map: slicing an
    ``np.memmap`` builds a memmap object per slice, and the reader slices twice per string of the
    vocabulary and merges arrays (the same fields and tensors; opening a 130k-token vocabulary:
    scripts/bench/bench_gguf_metadata.py)."""
    global _reader_class
    if _reader_class is None:
        import gguf

        itemsizes: dict = {}

        class Reader(gguf.GGUFReader):
            def _get(self, offset, dtype, count=1, override_order=None):
                plain = self.__dict__.get("_plain")
                if plain is None:
                    plain = self._plain = self.data.view(np.ndarray)
                count = int(count)
                size = itemsizes.get(dtype)
                if size is None:
                    size = itemsizes[dtype] = np.dtype(dtype).itemsize
                if offset + size * count > plain.size:
                    raise EOFError(f"it needs {offset + size * count} bytes, the file has {plain.size}")
                arr = plain[offset:offset + size * count].view(dtype)[:count]
                order = self.byte_order if override_order is None else override_order
                return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

        _reader_class = Reader
    return _reader_class


@dataclass(frozen=True)
class GgufTensorInfo:
    name: str
    dtype: str          # ggml type name: F32, BF16, Q4_K, ...
    shape: tuple        # numpy order (row length last)
    path: str
    offset: int         # absolute byte offset in ``path``
    nbytes: int
    data: object        # the reader's memory-mapped view


_opened: dict = {}


class GgufModel:
    """The tensors and metadata of one GGUF model (one file or its split parts), the container
    the loader, the expert store and ``inspect`` read it through."""

    def __init__(self, path):
        self.files = gguf_files(path)
        self.path = self.files[0]
        self.usage_path = self.path + ".coli_usage"
        self.fields: dict = {}
        self.tensors: dict[str, GgufTensorInfo] = {}
        for i, file in enumerate(self.files):
            with open(file, "rb") as f:
                magic = f.read(4)
            if magic != b"GGUF":
                raise GgufError(f"{file}: not a GGUF file (it starts with {magic!r}, a GGUF file with b'GGUF')")
            try:
                reader = reader_class()(file, "r")
            except EOFError as e:
                raise GgufError(f"{file}: truncated: {e} (an incomplete download?)") from None
            except Exception as e:   # the reader's struct / numpy errors on a damaged header
                detail = " ".join(str(e).split())[:160]
                raise GgufError(f"{file}: not a readable GGUF file ({type(e).__name__}: {detail}); a truncated "
                                "download?") from None
            if i == 0:
                self.fields = {k: f for k, f in reader.fields.items()}
            for t in reader.tensors:   # the reader checked that every tensor's bytes are in the file
                dtype = t.tensor_type.name
                if t.name in self.tensors:
                    raise GgufError(f"{file}: tensor {t.name!r} is also in {self.tensors[t.name].path}")
                shape = tuple(int(d) for d in reversed(list(t.shape)))
                self.tensors[t.name] = GgufTensorInfo(t.name, dtype, shape, file, int(t.data_offset),
                                                      int(t.n_bytes), t.data)
        self.arch = self.value("general.architecture")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise GgufError(f"{self.path}: general.architecture is {self.arch!r}; colibri reads "
                            f"{', '.join(SUPPORTED_ARCHITECTURES)} (DeepSeek-V3/R1, Kimi-K2; GLM-5)")
        self.config = config_from_metadata(self)

    @classmethod
    def open(cls, path) -> "GgufModel":
        """``GgufModel(path)``, parsed once per process while its files are unchanged: the gguf
        reader takes seconds over the metadata of a large vocabulary, and the loader, the
        tokenizer and ``inspect`` each open the model."""
        files = gguf_files(path)
        key = tuple((os.path.realpath(f), os.stat(f).st_mtime_ns, os.stat(f).st_size) for f in files)
        model = _opened.get(key)
        if model is None:
            model = cls(files[0])
            _opened.clear()   # one model at a time: the memory maps of another are released
            _opened[key] = model
        return model

    # -- metadata
    def value(self, key: str, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def arch_value(self, key: str, default=None, required: bool = False):
        value = self.value(f"{self.arch}.{key}", default)
        if value is None and required:
            raise GgufError(f"{self.path}: metadata key {self.arch}.{key!r} is missing")
        return value

    # -- tensors (the Container interface the expert store uses)
    def names(self):
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> GgufTensorInfo:
        if name not in self.tensors:
            raise GgufError(f"{self.path}: missing tensor {name!r}")
        return self.tensors[name]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, uint8 ``[..., row bytes]`` (a memory-mapped view)."""
        info = self.info(name)
        data = np.asarray(info.data)
        return data.reshape(-1).view(np.uint8).reshape(*info.shape[:-1], -1)

    def values(self, name: str) -> np.ndarray:
        """float32 values of the tensor (any type), numpy order."""
        info = self.info(name)
        if info.dtype in FLOAT_NP:
            return float_values(self.raw(name), info.dtype).reshape(info.shape)
        if info.dtype not in GGUF_TYPES:
            raise GgufError(f"{info.path}: tensor {name!r} has ggml type {info.dtype}, which colibri does not read "
                            f"(known: F32, F16, BF16, {', '.join(GGUF_TYPES)})")
        return dequantize_gguf(info.dtype, self.raw(name))

    def has_experts(self, layer: int) -> bool:
        return f"blk.{layer}.ffn_gate_exps.weight" in self.tensors

    def weight_table(self) -> WeightTable:
        weights = GgufWeights(self)
        return WeightTable(weights.names, weights.fetch, self.path)

    @staticmethod
    def plan_expert(container, layer: int, expert: int, shapes: dict):
        return plan_gguf_expert(container, layer, expert, shapes)


def float_values(raw: np.ndarray, dtype: str) -> np.ndarray:
    stored = np.require(raw, requirements="C").reshape(-1).view(FLOAT_NP[dtype])
    return float_bits_as_f32(stored, dtype == "BF16")


# ----------------------------------------------------------------------------------- config


def _f32(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def config_from_metadata(model: GgufModel) -> dict:
    """The Hugging Face config.json of a GGUF model, from its metadata."""
    a = model.arch_value
    model_type, hf_arch, default_gating = ARCHITECTURES[model.arch]
    n_mtp = a("nextn_predict_layers", 0) or 0
    n_layers = a("block_count", required=True) - n_mtp   # NextN layers come after the decoder layers
    rope_dim = a("rope.dimension_count", required=True)
    key_mla, value_mla = a("attention.key_length_mla"), a("attention.value_length_mla")
    # Files written before llama.cpp's absorbed MLA give the per-head dims as key/value_length.
    key_len = key_mla if key_mla is not None else a("attention.key_length", required=True)
    value_len = value_mla if value_mla is not None else a("attention.value_length", required=True)
    gating = a("expert_gating_func", default_gating) or default_gating
    if GATING_FUNCS.get(gating) != "sigmoid":
        what = "softmax routing: DeepSeek-V2" if gating == 1 else "unknown"
        raise GgufError(f"{model.path}: {model.arch}.expert_gating_func is {gating} ({what}); colibri runs sigmoid "
                        "routing (DeepSeek-V3/R1, Kimi-K2, GLM-5)" + ("" if model.value(
                            f"{model.arch}.expert_gating_func") is not None else " (the key is absent: llama.cpp "
                            "reads softmax)"))
    vocab = a("vocab_size")
    if vocab is None:
        tokens = model.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else model.info("token_embd.weight").shape[0]
    config = {
        "architectures": [hf_arch], "model_type": model_type,
        "vocab_size": vocab, "hidden_size": a("embedding_length", required=True),
        "intermediate_size": a("feed_forward_length", required=True),
        "moe_intermediate_size": a("expert_feed_forward_length", required=True),
        "num_hidden_layers": n_layers, "num_attention_heads": a("attention.head_count", required=True),
        "num_key_value_heads": a("attention.head_count", required=True),
        "n_routed_experts": a("expert_count", required=True), "num_experts_per_tok": a("expert_used_count",
                                                                                        required=True),
        "n_shared_experts": a("expert_shared_count", 0), "n_group": a("expert_group_count", 1) or 1,
        "topk_group": a("expert_group_used_count", 1) or 1,
        "routed_scaling_factor": _f32(a("expert_weights_scale", 1.0) or 1.0),
        "norm_topk_prob": bool(a("expert_weights_norm", False)), "scoring_func": GATING_FUNCS[gating],
        "topk_method": "noaux_tc",   # DeepSeek-V3's: the exp_probs_b bias chooses, the scores weight
        "kv_lora_rank": a("attention.kv_lora_rank", required=True), "q_lora_rank": a("attention.q_lora_rank"),
        "qk_rope_head_dim": rope_dim, "qk_nope_head_dim": key_len - rope_dim, "v_head_dim": value_len,
        "first_k_dense_replace": a("leading_dense_block_count", 0),
        "rms_norm_eps": _f32(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": a("context_length", 4096), "rope_theta": _f32(a("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(model), "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": "output.weight" not in model, "num_nextn_predict_layers": n_mtp,
    }
    if model_type == "glm_moe_dsa":
        config.update(index_n_heads=a("attention.indexer.head_count", required=True),
                      index_head_dim=a("attention.indexer.key_length", required=True),
                      index_topk=a("attention.indexer.top_k", required=True))
        types = a("attention.indexer.types")
        if types is None and config["max_position_embeddings"] >= GLM_5_2_CONTEXT:
            raise GgufError(f"{model.path}: {model.arch}.attention.indexer.types is missing (a GLM-5.2 file "
                            "names its full and shared indexer layers)")
        config["indexer_types"] = ["full" if t else "shared" for t in (types or [True] * n_layers)][:n_layers]
    for key, field in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if model.value(field) is not None:
            config[key] = int(model.value(field))
    return config


def _rope_scaling(model: GgufModel) -> Optional[dict]:
    a = model.arch_value
    kind = a("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise GgufError(f"{model.path}: {model.arch}.rope.scaling.type is {kind!r}; colibri reads none or yarn")
    scaling = {"type": "yarn", "factor": _f32(a("rope.scaling.factor", required=True)),
               "original_max_position_embeddings": a("rope.scaling.original_context_length", required=True),
               "beta_fast": _f32(a("rope.scaling.yarn_beta_fast", 32.0)),
               "beta_slow": _f32(a("rope.scaling.yarn_beta_slow", 1.0))}
    log_mul = a("rope.scaling.yarn_log_multiplier")
    if log_mul:
        # llama.cpp takes mscale == mscale_all_dim (their ratio scales cos/sin: 1 then)
        m = _f32(float(np.float32(log_mul)) / YARN_LOG_MUL_PER_MSCALE)
        scaling.update(mscale=m, mscale_all_dim=m)
    return scaling


def model_args(model: GgufModel):
    from .deepseek_v3 import ModelArgs

    try:
        return ModelArgs.from_config(model.config)
    except (ValueError, ConfigError) as e:
        detail = str(e).removeprefix("config.json: ")
        raise GgufError(f"{model.path}: its metadata does not describe a model colibri runs: {detail}") from None


# ----------------------------------------------------------------------------------- weights


def hf_name(gguf_name: str) -> Optional[str]:
    """The model tensor name of a GGUF tensor (None: experts and split kv_b, mapped apart)."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    m = LAYER_NAME.match(gguf_name)
    if m and m.group(2) in LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{LAYER_TENSORS[m.group(2)]}"
    return None


class GgufWeights:
    """Model tensor names (Hugging Face layout) -> tensors of a GGUF model."""

    def __init__(self, model: GgufModel):
        self.model = model
        self.n_experts = int(model.config["n_routed_experts"])
        self.names: dict[str, tuple] = {}
        for name in model.tensors:
            m = LAYER_NAME.match(name)
            if m and m.group(2) in EXPERT_TENSORS:
                proj = EXPERT_TENSORS[m.group(2)]
                for e in range(self.n_experts):
                    self.names[f"model.layers.{m.group(1)}.mlp.experts.{e}.{proj}_proj.weight"] = ("expert", name, e)
            elif m and m.group(2) in SPLIT_KV_B:
                self.names[f"model.layers.{m.group(1)}.self_attn.kv_b_proj.weight"] = ("kv_b", int(m.group(1)))
            elif hf_name(name) is not None:
                self.names[hf_name(name)] = ("plain", name)
            else:
                self.names[name] = ("plain", name)   # unknown: check_all_used names it

    def fetch(self, name: str, shape: tuple):
        kind, *rest = self.names[name]
        if kind == "expert":
            stored, e = rest
            return self._matrix(stored, shape, e)
        if kind == "kv_b":
            return self._kv_b(rest[0], shape)
        return self._matrix(rest[0], shape)

    def stored_bytes(self, name: str) -> int:
        """Stored bytes a fetch of model tensor ``name`` reads: one row of a stacked expert tensor,
        both halves of a split ``kv_b_proj``."""
        kind, *rest = self.names[name]
        if kind == "expert":
            return self.model.info(rest[0]).nbytes // self.n_experts
        if kind == "kv_b":
            return sum(self.model.info(f"blk.{rest[0]}.{n}").nbytes for n in SPLIT_KV_B)
        return self.model.info(rest[0]).nbytes

    def _matrix(self, stored: str, shape: tuple, expert: Optional[int] = None):
        info = self.model.info(stored)
        label = stored if expert is None else f"{stored}[{expert}]"
        want = tuple(shape) if expert is None else (self.n_experts,) + tuple(shape)
        if info.shape != want:
            raise GgufError(f"{info.path}: tensor {stored!r} has shape {list(info.shape)} (numpy order), the metadata "
                            f"implies {list(want)}")
        raw = self.model.raw(stored)
        if expert is not None:
            raw = raw[expert]
        if info.dtype in FLOAT_NP:
            values = float_values(raw, info.dtype).reshape(shape)
            if not np.isfinite(values).all():
                raise GgufError(f"{info.path}: tensor {label!r} holds NaN or infinite values (a damaged file?)")
            return mx.array(values)
        if info.dtype not in GGUF_TYPES or len(shape) != 2:
            raise GgufError(f"{info.path}: tensor {label!r} has ggml type {info.dtype}; colibri reads F32, F16, "
                            f"BF16 and {', '.join(GGUF_TYPES)} (quantized types for matrices only)")
        # to_mlx's mx.array copies out of the memory map (once): resident weights are really resident
        return qtensor_from_gguf(label, info.dtype, raw, shape).to_mlx()

    def _kv_b(self, layer: int, shape: tuple):
        """``kv_b_proj`` joined from ``attn_k_b`` and ``attn_v_b`` (module docstring), float32."""
        k_name, v_name = (f"blk.{layer}.{n}" for n in SPLIT_KV_B)
        for n in (k_name, v_name):
            if n not in self.model:
                raise GgufError(f"{self.model.path}: missing tensor {n!r} (kv_b is stored split as attn_k_b and "
                                "attn_v_b)")
        wk, wv = self.model.values(k_name), self.model.values(v_name)   # [H, kv_lora, nope], [H, v, kv_lora]
        kinfo, vinfo = self.model.info(k_name), self.model.info(v_name)
        if len(kinfo.shape) != 3 or len(vinfo.shape) != 3:
            raise GgufError(f"{kinfo.path}: {k_name!r} {list(kinfo.shape)} and {v_name!r} {list(vinfo.shape)}: "
                            "[heads, rows, row length] expected")
        wk, wv = wk.reshape(kinfo.shape), wv.reshape(vinfo.shape)
        if wk.shape[0] != wv.shape[0] or wk.shape[1] != wv.shape[2]:
            raise GgufError(f"{kinfo.path}: {k_name!r} {list(wk.shape)} and {v_name!r} {list(wv.shape)} do not split "
                            "one kv_b")
        joined = np.concatenate([wk.transpose(0, 2, 1), wv], axis=1).reshape(-1, wk.shape[1])
        return mx.array(np.ascontiguousarray(joined, dtype=np.float32))


def open_gguf(path) -> "GgufModelDir":
    """The checked GGUF model at ``path`` (every header and the metadata), as ``open_model_dir``
    gives a model directory."""
    model = GgufModel.open(path)
    model_args(model)
    check_tensors(model)
    return GgufModelDir(model.path, model.config, model)


def check_tensors(model: GgufModel) -> None:
    """Every tensor the metadata implies is in the file (the first missing one named, by its
    GGUF name), and every tensor is of a ggml type colibri reads, before any weight is read."""
    for name, info in model.tensors.items():
        if info.dtype not in FLOAT_NP and info.dtype not in GGUF_TYPES:
            raise GgufError(f"{info.path}: tensor {name!r} has ggml type {info.dtype}, which colibri does not read "
                            f"(it reads F32, F16, BF16, {', '.join(GGUF_TYPES)})")
    c = model.config
    need = ["token_embd.weight", "output_norm.weight"]
    for i in range(c["num_hidden_layers"]):   # NextN layers are checked by the model as it loads them
        p = f"blk.{i}."
        need += [p + n for n in ("attn_norm.weight", "ffn_norm.weight", "attn_kv_a_mqa.weight",
                                 "attn_kv_a_norm.weight", "attn_output.weight")]
        need += [p + n for n in (("attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight")
                                 if c["q_lora_rank"] else ("attn_q.weight",))]
        if p + "attn_kv_b.weight" not in model:
            need += [p + n for n in SPLIT_KV_B]
        if i < c["first_k_dense_replace"]:
            need += [p + f"ffn_{n}.weight" for n in ("gate", "up", "down")]
        else:
            need += [p + "ffn_gate_inp.weight"] + [p + n for n in EXPERT_TENSORS]
            need += [p + f"ffn_{n}_shexp.weight" for n in ("gate", "up", "down") if c["n_shared_experts"]]
            need += [p + "exp_probs_b.bias"]
    for name in need:
        if name not in model:
            raise GgufError(f"{model.path}: missing tensor {name!r} (the metadata describes "
                            f"{c['num_hidden_layers']} layers, the first {c['first_k_dense_replace']} dense)")


@dataclass
class GgufModelDir:
    """:class:`modeldir.ModelDir` of a GGUF model: its metadata stand for config.json."""

    path: str
    config: dict
    container: GgufModel

    @property
    def config_path(self) -> str:
        return f"{self.path} (GGUF metadata)"


# ------------------------------------------------------------------------- expert streaming


def plan_gguf_expert(model: GgufModel, layer: int, expert: int, shapes: dict):
    """Where expert ``expert`` of layer ``layer`` lies: its row of each stacked tensor, one
    contiguous range each (adjacent ones merged into one read)."""
    from ..experts.store import (PROJECTIONS, ByteRange, ExpertLayout, ExpertStoreError, Part, ProjectionLayout,
                                 _coalesce)
    from ..formats.gguf_quant import row_nbytes

    ranges, projections = [], []
    for proj in PROJECTIONS:
        O, I = shapes[proj]
        stored = f"blk.{layer}.ffn_{proj}_exps.weight"
        info = model.info(stored)
        n_experts = info.shape[0]
        if len(info.shape) != 3 or info.shape[1:] != (O, I) or not 0 <= expert < n_experts:
            raise ExpertStoreError(f"{info.path}: tensor {stored!r} has shape {list(info.shape)}, expected "
                                   f"[{model.config['n_routed_experts']}, {O}, {I}]")
        if info.dtype in FLOAT_NP:
            per, fmt, gs = O * I * np.dtype(FLOAT_NP[info.dtype]).itemsize, None, None
        elif info.dtype in GGUF_TYPES:
            t = GGUF_TYPES[info.dtype]
            per, fmt, gs = O * row_nbytes(t, I), t.fmt, t.block_size
        else:
            raise ExpertStoreError(f"{info.path}: tensor {stored!r}: {info.dtype} experts cannot be streamed")
        label = f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"
        ranges.append(ByteRange(label, info.dtype, info.path, info.offset + expert * per, per))
        projections.append((proj, O, I, fmt, gs, label))
    reads, where = _coalesce(ranges)
    layouts = tuple(ProjectionLayout(proj, O, I, Part(label, *where[label]), None, fmt, gs)
                    for proj, O, I, fmt, gs, label in projections)
    return ExpertLayout(layer, expert, tuple(reads), layouts)


def streamed_projection(p, buffers):
    """A streamed quantized GGUF expert projection (:func:`plan_gguf_expert`) as a QTensor."""
    raw = buffers[p.weight.read][p.weight.start: p.weight.start + p.weight.nbytes]
    qt = qtensor_from_gguf(p.weight.name, p.weight.dtype, raw, (p.O, p.I))
    return dataclasses.replace(qt, packed=mx.array(qt.packed), scales=mx.array(qt.scales), streamed=True)


# ------------------------------------------------------------------------------------ inspect


def inspect_gguf(path) -> dict:
    """``colibri inspect`` of a GGUF model: every tensor with its ggml type, numpy shape, bytes
    and the model tensor it maps to, the metadata's ModelArgs, the tokenizer's summary."""
    model = GgufModel.open(path)
    args = model_args(model)
    rows = []
    for name, info in model.tensors.items():
        m = LAYER_NAME.match(name)
        if m and m.group(2) in EXPERT_TENSORS:
            maps = f"model.layers.{m.group(1)}.mlp.experts.*.{EXPERT_TENSORS[m.group(2)]}_proj.weight"
        elif m and m.group(2) in SPLIT_KV_B:
            maps = f"model.layers.{m.group(1)}.self_attn.kv_b_proj.weight ({m.group(2).split('.')[0]} half)"
        else:
            maps = hf_name(name) or "?"
        rows.append({"name": name, "type": info.dtype, "shape": list(info.shape), "nbytes": info.nbytes,
                     "file": os.path.basename(info.path), "maps_to": maps})
    types: dict = {}
    for r in rows:
        types[r["type"]] = types.get(r["type"], 0) + r["nbytes"]
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    return {"path": model.path, "files": model.files, "architecture": model.arch, "tensors": rows,
            "bytes_by_type": types, "total_bytes": sum(types.values()), "model_args": fields,
            "unmapped": [r["name"] for r in rows if r["maps_to"] == "?"]}


def format_inspect(report: dict) -> str:
    width = max(len(r["name"]) for r in report["tensors"])
    lines = [f"{report['path']}: GGUF, architecture {report['architecture']}, {len(report['files'])} file(s), "
             f"{len(report['tensors'])} tensors", ""]
    lines.append(f"{'tensor':<{width}}  {'type':<8} {'shape':<18} {'bytes':>11}  maps to")
    for r in report["tensors"]:
        shape = "x".join(str(s) for s in r["shape"])
        lines.append(f"{r['name']:<{width}}  {r['type']:<8} {shape:<18} {r['nbytes']:>11}  {r['maps_to']}")
    lines.append("")
    lines.append("bytes by type: " + ", ".join(f"{t} {n}" for t, n in sorted(report["bytes_by_type"].items())))
    lines.append(f"total: {report['total_bytes']} bytes")
    lines.append("")
    lines.append("ModelArgs: " + ", ".join(f"{k}={v}" for k, v in report["model_args"].items()
                                           if k not in ("mlp_layer_types",)))
    if report["unmapped"]:
        lines.append(f"unmapped tensors (not read by the model): {', '.join(report['unmapped'])}")
    return "\n".join(lines)

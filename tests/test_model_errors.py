"""Every mistake in a model directory is one `Error:` line naming the file and the key.

Corrupted copies of a tiny container (tests/helpers_tiny.py), one per case and several per
class: config.json content, tokenizer files and chat template, shards and tensors, the
directory itself. Each runs `colibri generate` in-process and must exit non-zero, end with a
line `Error: ...` that names the offending file or key, show no traceback, and finish within
TIME_BOUND seconds. Cases that would hang a broken loader (a FIFO, a device) run in a
subprocess with a timeout. The inverse: unusual but valid directories still load.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from helpers_tiny import CONFIG, GLM, write_tiny_container

from colibri_mlx.cli import main

TIME_BOUND = 10.0  # seconds; a case takes ~0.1 s
REPO = Path(__file__).resolve().parents[1]
DELETE = object()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return Path(write_tiny_container(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def pristine_glm(tmp_path_factory):
    return Path(write_tiny_container(tmp_path_factory.mktemp("glm") / "model", GLM))


@pytest.fixture
def model(pristine, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(pristine, d)
    return d


def run(*args, input=None):
    t0 = time.monotonic()
    result = CliRunner().invoke(main, [str(a) for a in args], input=input)
    result.elapsed = time.monotonic() - t0
    return result


def assert_one_line_error(result, *needles):
    """Non-zero exit, no traceback, the last line `Error: ...` naming every needle, in time."""
    out = result.output
    assert result.exit_code != 0, out
    assert isinstance(result.exception, SystemExit), f"{result.exception!r}\n{out}"
    assert "Traceback" not in out
    last = out.rstrip("\n").splitlines()[-1]
    assert last.startswith("Error: "), out
    for needle in needles:
        assert needle in last, f"{needle!r} not in {last!r}"
    assert result.elapsed < TIME_BOUND
    return last


# ------------------------------------------------------------------------------ mutations


def edit_config(**changes):
    def mutate(d: Path):
        cfg = json.loads((d / "config.json").read_text())
        for k, v in changes.items():
            if v is DELETE:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (d / "config.json").write_text(json.dumps(cfg))
    return mutate


def write(name: str, data):
    def mutate(d: Path):
        p = d / name
        if p.is_symlink() or p.exists():
            p.unlink()
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return mutate


def remove(*names):
    def mutate(d: Path):
        for n in names:
            (d / n).unlink()
    return mutate


def symlink(name: str, target):
    """``name`` -> ``target`` (a callable of the model dir, for targets made per case)."""
    def mutate(d: Path):
        p = d / name
        if p.exists() or p.is_symlink():
            p.unlink()
        os.symlink(target(d) if callable(target) else target, p)
    return mutate


def outside_file(content: bytes):
    def make(d: Path):
        other = d.parent / "elsewhere.bin"
        other.write_bytes(content)
        return other
    return make


def edit_tokenizer_config(**changes):
    def mutate(d: Path):
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        for k, v in changes.items():
            if v is DELETE:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return mutate


def read_shard(path: Path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_shard_raw(path: Path, header: dict, data: bytes):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_header(shard: str, edit):
    """Rewrite a shard's header with ``edit(header)`` (tensor bytes kept as they are)."""
    def mutate(d: Path):
        header, data = read_shard(d / shard)
        edit(header)
        write_shard_raw(d / shard, header, data)
    return mutate


def drop_tensor(shard: str, name: str):
    def edit(header):
        header.pop(name)
        stamps = header.get("__metadata__", {}).get("colibri_mlx.formats")
        if stamps:
            table = json.loads(stamps)
            table.pop(name, None)
            header["__metadata__"]["colibri_mlx.formats"] = json.dumps(table)
    return edit_header(shard, edit)


def reshape_tensor(shard: str, name: str, shape: list):
    def edit(header):
        header[name]["shape"] = shape
    return edit_header(shard, edit)


def truncate(shard: str, keep):
    def mutate(d: Path):
        p = d / shard
        raw = p.read_bytes()
        p.write_bytes(raw[:keep(len(raw))])
    return mutate


def copy_tensor_to_other_shard(mutate_name: str):
    """The same tensor in both shards."""
    def mutate(d: Path):
        h0, data0 = read_shard(d / "out-00000.safetensors")
        h1, data1 = read_shard(d / "out-00001.safetensors")
        entry = dict(h0[mutate_name])
        begin, end = entry["data_offsets"]
        entry["data_offsets"] = [len(data1), len(data1) + end - begin]
        h1[mutate_name] = entry
        write_shard_raw(d / "out-00001.safetensors", h1, data1 + data0[begin:end])
    return mutate


def poison(shard: str, name: str):
    """Overwrite a float32 tensor's first values with NaN, in place."""
    def mutate(d: Path):
        header, _ = read_shard(d / shard)
        raw = bytearray((d / shard).read_bytes())
        start = 8 + struct.unpack("<Q", raw[:8])[0] + header[name]["data_offsets"][0]
        raw[start:start + 8] = struct.pack("<2f", float("nan"), float("inf"))
        (d / shard).write_bytes(bytes(raw))
    return mutate


def word_level_tokenizer(d: Path):
    """A valid tokenizer.json that cannot encode most text (no unknown token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0}))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (d / "tokenizer.json").unlink()
    tok.save(str(d / "tokenizer.json"))
    edit_tokenizer_config(bos_token=DELETE, eos_token=DELETE)(d)  # not tokens of this one


def both(*mutations):
    def mutate(d: Path):
        for m in mutations:
            m(d)
    return mutate


def replace_in_config(old: str, new: str):
    """Edit config.json's text (for what json.dumps cannot write: a key given twice)."""
    def mutate(d: Path):
        text = (d / "config.json").read_text()
        assert old in text, old
        (d / "config.json").write_text(text.replace(old, new))
    return mutate


def retype(shard: str, name: str, dtype: str, itemsize: int):
    """Store ``name`` as ``dtype`` with the same shape (new bytes appended: a pattern, no NaN)."""
    def edit(d: Path):
        header, data = read_shard(d / shard)
        entry = header[name]
        n = itemsize * int(np.prod(entry["shape"]))
        entry["dtype"], entry["data_offsets"] = dtype, [len(data), len(data) + n]
        write_shard_raw(d / shard, header, data + bytes(i % 61 for i in range(n)))
    return edit


def template(text: str):
    return edit_tokenizer_config(chat_template=text)


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
S0, S1 = "out-00000.safetensors", "out-00001.safetensors"

# id -> (mutation, what the error line must name)
CASES = {
    # --- config.json: the file
    "config-empty": (write("config.json", ""), ["config.json", "empty"]),
    "config-truncated": (lambda d: (d / "config.json").write_text((d / "config.json").read_text()[:40]),
                         ["config.json", "not valid JSON"]),
    "config-not-utf8": (write("config.json", b'{"model_type": "deepseek_v3\xff"}'), ["config.json", "UTF-8"]),
    "config-list": (write("config.json", "[1, 2]"), ["config.json", "JSON object", "list"]),
    "config-null": (write("config.json", "null"), ["config.json", "JSON object"]),
    "config-string": (write("config.json", '"deepseek_v3"'), ["config.json", "JSON object"]),
    "config-directory": (lambda d: ((d / "config.json").unlink(), (d / "config.json").mkdir()),
                         ["config.json", "directory"]),
    "config-symlink-outside": (symlink("config.json", outside_file(json.dumps(CONFIG).encode())),
                               ["config.json", "outside the model directory"]),
    "config-dangling-symlink": (symlink("config.json", "nowhere.json"), ["config.json", "broken symlink"]),
    # --- config.json: model_type and required keys
    "model-type-missing": (edit_config(model_type=DELETE), ["config.json", "model_type"]),
    "model-type-llama": (edit_config(model_type="llama"), ["config.json", "model_type", "llama", "deepseek_v3"]),
    "model-type-int": (edit_config(model_type=3), ["config.json", "model_type"]),
    "hidden-size-missing": (edit_config(hidden_size=DELETE), ["config.json", "hidden_size"]),
    "hidden-size-null": (edit_config(hidden_size=None), ["config.json", "hidden_size"]),
    # --- config.json: wrong types
    "hidden-size-string": (edit_config(hidden_size="64"), ["config.json", "hidden_size", "string"]),
    "hidden-size-float": (edit_config(hidden_size=64.5), ["config.json", "hidden_size", "integer"]),
    "vocab-size-bool": (edit_config(vocab_size=True), ["config.json", "vocab_size"]),
    "rms-norm-eps-string": (edit_config(rms_norm_eps="1e-6"), ["config.json", "rms_norm_eps"]),
    "rms-norm-eps-nan": (lambda d: (d / "config.json").write_text(
        (d / "config.json").read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN')),
        ["config.json", "rms_norm_eps"]),
    "q-lora-rank-string": (edit_config(q_lora_rank="48"), ["config.json", "q_lora_rank"]),
    "norm-topk-prob-string": (edit_config(norm_topk_prob="yes"), ["config.json", "norm_topk_prob"]),
    "eos-string": (edit_config(eos_token_id="</s>"), ["config.json", "eos_token_id"]),
    "mlp-layer-types-string": (edit_config(mlp_layer_types="dense"), ["config.json", "mlp_layer_types"]),
    # --- config.json: zero, negative, out of range
    "n-group-zero": (edit_config(n_group=0), ["config.json", "n_group"]),
    "topk-group-zero": (edit_config(topk_group=0), ["config.json", "topk_group"]),
    "hidden-size-negative": (edit_config(hidden_size=-64), ["config.json", "hidden_size"]),
    "layers-zero": (edit_config(num_hidden_layers=0), ["config.json", "num_hidden_layers"]),
    "layers-huge": (edit_config(num_hidden_layers=10**9), ["config.json", "num_hidden_layers"]),
    "experts-per-tok-zero": (edit_config(num_experts_per_tok=0), ["config.json", "num_experts_per_tok"]),
    "experts-zero": (edit_config(n_routed_experts=0), ["config.json", "n_routed_experts"]),
    "heads-zero": (edit_config(num_attention_heads=0), ["config.json", "num_attention_heads"]),
    "kv-lora-zero": (edit_config(kv_lora_rank=0), ["config.json", "kv_lora_rank"]),
    "rms-norm-eps-negative": (edit_config(rms_norm_eps=-1), ["config.json", "rms_norm_eps"]),
    "rms-norm-eps-zero": (edit_config(rms_norm_eps=0), ["config.json", "rms_norm_eps"]),
    "max-positions-zero": (edit_config(max_position_embeddings=0), ["config.json", "max_position_embeddings"]),
    "rope-theta-negative": (edit_config(rope_theta=-1.0), ["config.json", "rope_theta"]),
    "scaling-factor-zero": (edit_config(routed_scaling_factor=0), ["config.json", "routed_scaling_factor"]),
    "shared-experts-negative": (edit_config(n_shared_experts=-1), ["config.json", "n_shared_experts"]),
    "mtp-layers-negative": (edit_config(num_nextn_predict_layers=-1), ["config.json", "num_nextn_predict_layers"]),
    "scoring-softmax": (edit_config(scoring_func="softmax"), ["config.json", "scoring_func"]),
    "hidden-act-gelu": (edit_config(hidden_act="gelu"), ["config.json", "hidden_act"]),
    # --- config.json: cross-field rules
    "topk-more-than-experts": (edit_config(num_experts_per_tok=5), ["config.json", "num_experts_per_tok",
                                                                   "n_routed_experts"]),
    "group-does-not-divide": (edit_config(n_group=3), ["config.json", "n_group", "n_routed_experts"]),
    "topk-group-over-groups": (edit_config(topk_group=3), ["config.json", "topk_group", "n_group"]),
    "topk-beyond-kept-groups": (edit_config(num_experts_per_tok=3), ["config.json", "num_experts_per_tok",
                                                                    "topk_group"]),
    "dense-layers-over-count": (edit_config(first_k_dense_replace=3), ["config.json", "first_k_dense_replace"]),
    "mlp-layer-types-short": (edit_config(mlp_layer_types=["dense"]), ["config.json", "mlp_layer_types"]),
    "mlp-layer-types-bad": (edit_config(mlp_layer_types=["dense", "moe"]), ["config.json", "mlp_layer_types"]),
    "rope-dim-odd": (edit_config(qk_rope_head_dim=15), ["config.json", "qk_rope_head_dim"]),
    "rope-scaling-list": (edit_config(rope_scaling=[1, 2]), ["config.json", "rope_scaling"]),
    "rope-scaling-linear": (edit_config(rope_scaling={"type": "linear", "factor": 2.0}),
                            ["config.json", "rope_scaling.type", "linear"]),
    "yarn-no-original": (edit_config(rope_scaling={k: v for k, v in YARN.items()
                                                   if k != "original_max_position_embeddings"}),
                         ["config.json", "rope_scaling.original_max_position_embeddings"]),
    "yarn-factor-zero": (edit_config(rope_scaling=dict(YARN, factor=0)), ["config.json", "rope_scaling.factor"]),
    "yarn-mscale-string": (edit_config(rope_scaling=dict(YARN, mscale="1")), ["config.json", "rope_scaling.mscale"]),
    "rope-parameters-theta": (edit_config(rope_parameters={"rope_type": "default", "rope_theta": 0}),
                              ["config.json", "rope_parameters.rope_theta"]),
    # --- config.json against the shards
    "layers-more-than-shards": (edit_config(num_hidden_layers=3), ["config.json", "num_hidden_layers"]),
    "layers-fewer-than-shards": (edit_config(num_hidden_layers=1, first_k_dense_replace=1),
                                 ["config.json", "num_hidden_layers"]),
    "experts-more-than-shards": (edit_config(n_routed_experts=8), ["config.json", "n_routed_experts"]),
    "q-lora-rank-null": (edit_config(q_lora_rank=None), ["config.json", "q_lora_rank"]),
    "attention-bias-true": (edit_config(attention_bias=True), ["config.json", "attention_bias"]),
    "first-dense-zero": (edit_config(first_k_dense_replace=0), ["config.json", "first_k_dense_replace", "layer 0"]),
    "mlp-layer-types-swapped": (edit_config(mlp_layer_types=["sparse", "dense"]), ["config.json", "mlp_layer_types"]),
    "shared-experts-zero": (edit_config(n_shared_experts=0), ["config.json", "n_shared_experts"]),
    "scaling-factor-huge": (edit_config(routed_scaling_factor=1e12), ["config.json", "routed_scaling_factor"]),
    "indexer-types-on-v3": (edit_config(indexer_types=5, num_hidden_layers=3), ["config.json", "num_hidden_layers"]),
    "hidden-size-other": (edit_config(hidden_size=128), ["embed_tokens", "[264, 64]", "[264, 128]"]),
    "moe-inter-other": (edit_config(moe_intermediate_size=64), ["experts.0", "out-00001.safetensors"]),
    "vocab-smaller-than-tokenizer": (edit_config(vocab_size=200), ["config.json", "bos_token_id", "vocab_size=200"]),
    "vocab-smaller-than-tokenizer-ids": (edit_config(vocab_size=258),
                                         ["tokenizer.json", "token id 263", "vocab_size=258"]),
    # --- tokenizer files
    "tokenizer-missing": (remove("tokenizer.json"), ["tokenizer.json"]),
    "tokenizer-empty": (write("tokenizer.json", ""), ["tokenizer.json", "empty"]),
    "tokenizer-garbage": (write("tokenizer.json", bytes(range(256)) * 4), ["tokenizer.json"]),
    "tokenizer-truncated": (lambda d: (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text()[:500]),
                            ["tokenizer.json", "not a valid tokenizer.json"]),
    "tokenizer-empty-object": (write("tokenizer.json", "{}"), ["tokenizer.json", "not a valid tokenizer.json"]),
    "tokenizer-list": (write("tokenizer.json", "[]"), ["tokenizer.json"]),
    "tokenizer-symlink-to-config": (symlink("tokenizer.json", "config.json"), ["tokenizer.json"]),
    "tokenizer-symlink-outside": (symlink("tokenizer.json", outside_file(b'{"version": "1.0"}')),
                                  ["tokenizer.json", "outside the model directory"]),
    "tokenizer-symlink-etc": (symlink("tokenizer.json", "/etc/hostname"), ["tokenizer.json", "outside"]),
    "tokenizer-dangling": (symlink("tokenizer.json", "gone.json"), ["tokenizer.json", "broken symlink"]),
    "tokenizer-directory": (lambda d: ((d / "tokenizer.json").unlink(), (d / "tokenizer.json").mkdir()),
                            ["tokenizer.json", "directory"]),
    "tokenizer-config-invalid": (write("tokenizer_config.json", '{"chat_template": '),
                                 ["tokenizer_config.json", "not valid JSON"]),
    "tokenizer-config-list": (write("tokenizer_config.json", "[]"), ["tokenizer_config.json", "JSON object"]),
    "tokenizer-config-not-utf8": (write("tokenizer_config.json", b'{"eos_token": "\xfe"}'),
                                  ["tokenizer_config.json", "UTF-8"]),
    "template-syntax-error": (edit_tokenizer_config(chat_template="{% for m in messages %}{{ m['content'] }}"),
                              ["tokenizer_config.json", "syntax error"]),
    "template-undefined": (edit_tokenizer_config(chat_template="{{ messages[0].content.nope.deeper }}"),
                           ["tokenizer_config.json", "undefined"]),
    "template-sandbox": (edit_tokenizer_config(chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"),
                         ["tokenizer_config.json", "sandbox"]),
    "template-raises": (edit_tokenizer_config(chat_template="{{ raise_exception('System role not supported') }}"),
                        ["tokenizer_config.json", "System role not supported"]),
    "template-type-error": (edit_tokenizer_config(chat_template="{{ messages + 1 }}"),
                            ["tokenizer_config.json", "chat template"]),
    "template-not-a-string": (edit_tokenizer_config(chat_template=5), ["tokenizer_config.json", "chat_template"]),
    "template-list-of-junk": (edit_tokenizer_config(chat_template=[1, 2]), ["tokenizer_config.json",
                                                                          "chat_template"]),
    "template-file-syntax": (both(edit_tokenizer_config(chat_template=DELETE),
                                  write("chat_template.jinja", "{% if %}")), ["chat_template.jinja", "syntax"]),
    "eos-token-number": (edit_tokenizer_config(eos_token=5), ["tokenizer_config.json", "eos_token"]),
    "generation-config-invalid": (write("generation_config.json", "{"), ["generation_config.json"]),
    "generation-config-eos-string": (write("generation_config.json", '{"eos_token_id": "x"}'),
                                     ["generation_config.json", "eos_token_id"]),
    # --- shards
    "no-shards": (remove(S0, S1), ["no *.safetensors"]),
    "shard-empty": (write(S1, b""), [S1, "0 bytes"]),
    "shard-garbage": (write(S1, os.urandom(4096)), [S1]),
    "shard-header-past-end": (lambda d: (d / S0).write_bytes(struct.pack("<Q", 1 << 40) + (d / S0).read_bytes()[8:]),
                              [S0, "header length"]),
    "shard-header-not-json": (write(S1, struct.pack("<Q", 16) + b"{not json at all" + b"\0" * 64),
                              [S1, "JSON"]),
    "shard-truncated": (truncate(S1, lambda n: n - 1000), [S1]),
    "shard-only-header": (truncate(S0, lambda n: 300), [S0]),
    "shard-directory": (lambda d: (d / "out-00002.safetensors").mkdir(), ["out-00002.safetensors", "directory"]),
    "shard-symlink-outside": (symlink("out-00002.safetensors", outside_file(b"\0" * 64)),
                              ["out-00002.safetensors", "outside the model directory"]),
    "shard-symlink-dev-zero": (symlink("out-00002.safetensors", "/dev/zero"), ["out-00002.safetensors"]),
    "shard-dangling": (symlink(S1, "missing-blob"), [S1, "broken symlink"]),
    "tensor-missing": (drop_tensor(S0, "model.norm.weight"), ["model.norm.weight"]),
    "expert-missing": (drop_tensor(S1, "model.layers.1.mlp.experts.3.down_proj.weight"),
                       ["model.layers.1.mlp.experts.3.down_proj.weight"]),
    "router-missing": (drop_tensor(S0, "model.layers.1.mlp.gate.weight"), ["model.layers.1.mlp.gate.weight"]),
    "float-shape-wrong": (reshape_tensor(S0, "model.norm.weight", [8, 8]), ["model.norm.weight", "[8, 8]", "64"]),
    "embed-shape-wrong": (reshape_tensor(S0, "model.embed_tokens.weight", [64, 264]),
                          ["model.embed_tokens.weight", "[64, 264]", "[264, 64]"]),
    "scales-without-weight": (drop_tensor(S0, "lm_head.weight"), ["lm_head.weight"]),
    "tensor-in-two-shards": (copy_tensor_to_other_shard("model.norm.weight"), ["model.norm.weight", S0, S1]),
    "bad-format-stamp": (edit_header(S0, lambda h: h["__metadata__"].__setitem__("colibri_mlx.formats", "{bad")),
                         [S0, "colibri_mlx.formats"]),
    "nan-in-a-norm": (poison(S0, "model.layers.0.input_layernorm.weight"),
                      [S0, "model.layers.0.input_layernorm.weight", "NaN"]),
    "nan-in-router-bias": (poison(S0, "model.layers.1.mlp.gate.e_score_correction_bias"),
                           ["e_score_correction_bias", "NaN"]),
    "nan-in-scales": (poison(S1, "model.layers.1.mlp.experts.2.up_proj.weight.qs"),
                      [S1, "model.layers.1.mlp.experts.2.up_proj.weight.qs", "NaN"]),
    "tokenizer-cannot-encode": (word_level_tokenizer, ["tokenizer.json", "cannot encode"]),
    "unknown-dtype": (edit_header(S0, lambda h: h["model.norm.weight"].__setitem__("dtype", "F64")),
                      [S0, "model.norm.weight", "dtype"]),
    "offsets-out-of-range": (edit_header(S0, lambda h: h["model.norm.weight"].__setitem__(
        "data_offsets", [0, 10**9])), [S0, "model.norm.weight"]),
    # --- the directory
    "not-a-model-directory": (remove("config.json"), ["not a model directory", "config.json"]),
    # --- config.json: more (red-team pass)
    "config-key-twice": (replace_in_config('"hidden_size": 64,', '"hidden_size": 64, "hidden_size": 128,'),
                         ["config.json", "'hidden_size' is given twice", "64", "128"]),
    "architectures-other-model": (edit_config(architectures=["LlamaForCausalLM"]),
                                  ["config.json", "architectures", "LlamaForCausalLM", "deepseek_v3"]),
    "architectures-string": (edit_config(architectures="DeepseekV3ForCausalLM"), ["config.json", "architectures"]),
    "model-type-of-another-family": (edit_config(model_type="glm_moe_dsa"),
                                     ["config.json", "architectures", "glm_moe_dsa"]),
    "bos-negative": (edit_config(bos_token_id=-1), ["config.json", "bos_token_id"]),
    "eos-past-vocab": (edit_config(eos_token_id=[257, 99999]), ["config.json", "eos_token_id", "vocab_size=264"]),
    "moe-layer-freq-2": (edit_config(moe_layer_freq=2), ["config.json", "moe_layer_freq"]),
    "rope-type-twice-differently": (edit_config(rope_scaling=dict(YARN, rope_type="default")),
                                    ["config.json", "rope_scaling.rope_type", "'yarn'"]),
    # --- shards: more
    "shard-without-tensors": (lambda d: write_shard_raw(d / S1, {"__metadata__": {"format": "pt"}}, b""),
                              [S1, "holds no tensors"]),
    "norm-stored-as-bytes": (retype(S0, "model.norm.weight", "U8", 1), [S0, "model.norm.weight", "U8"]),
    "norm-stored-as-int64": (retype(S0, "model.layers.0.input_layernorm.weight", "I64", 8),
                             [S0, "input_layernorm.weight", "I64"]),
    "norm-stored-as-scale-dtype": (retype(S0, "model.norm.weight", "F8_E8M0", 1), [S0, "F8_E8M0"]),
    "fp8-router-without-block-scales": (retype(S0, "model.layers.1.mlp.gate.weight", "F8_E4M3", 1),
                                        [S0, "model.layers.1.mlp.gate.weight", "_scale_inv"]),
    # --- tokenizer files: more
    "eos-token-not-in-vocab": (edit_tokenizer_config(eos_token="<|end|>"),
                               ["tokenizer_config.json", "eos_token", "<|end|>", "tokenizer.json"]),
    "bos-token-not-in-vocab": (edit_tokenizer_config(bos_token={"content": "<s>"}),
                               ["tokenizer_config.json", "bos_token", "<s>"]),
    "generation-config-eos-past-vocab": (write("generation_config.json", '{"eos_token_id": 99999}'),
                                         ["generation_config.json", "eos_token_id 99999", "vocab_size=264"]),
    "template-empty-list": (template([]), ["tokenizer_config.json", "chat_template", "empty list"]),
    "template-renders-nothing": (template("{% if false %}{{ messages }}{% endif %}"),
                                 ["tokenizer_config.json", "rendered no text"]),
    "template-format-width": (template("{{ '%0999999999d' % 1 }}"), ["tokenizer_config.json", "width"]),
    "template-center-width": (template("{{ 'x' | center(2000000000) }}"), ["tokenizer_config.json", "width"]),
    "template-ljust-width": (template("{{ 'x'.ljust(2000000000) }}"), ["tokenizer_config.json", "width"]),
    "template-json-indent": (template("{{ messages | tojson(indent=1000000000) }}"),
                             ["tokenizer_config.json", "JSON text"]),
    "template-string-doubling": (template("{% set ns = namespace(s='x') %}{% for i in range(60) %}"
                                          "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"),
                                 ["tokenizer_config.json", "characters"]),
    "template-nested-loops": (template("{% set x = [1] * 2000 %}{% for a in x %}{% for b in x %}{% for c in x %}"
                                       "{% endfor %}{% endfor %}{% endfor %}"),
                              ["tokenizer_config.json", "loop iterations"]),
    "template-huge-power": (template("{{ ((9 ** 1000) ** 1000) ** 1000 }}"), ["tokenizer_config.json", "too large"]),
    "template-inflates-the-prompt": (template("{{ messages[0]['content'] * 5000 }}"),
                                     ["tokenizer_config.json", "context limit of 64"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_corrupted_model_is_one_error_line(model, case):
    mutate, needles = CASES[case]
    mutate(model)
    result = run("generate", "-m", model, "-p", "hello", "--max-tokens", "2")
    assert_one_line_error(result, *needles)


GLM_CASES = {
    "indexer-types-short": (edit_config(indexer_types=["full"]), ["config.json", "indexer_types"]),
    "indexer-types-start-shared": (edit_config(indexer_types=["shared", "full"]), ["config.json", "indexer_types"]),
    "indexer-pattern-bad": (edit_config(index_topk_pattern="FX"), ["config.json", "index_topk_pattern"]),
    "index-head-dim-small": (edit_config(index_head_dim=8), ["config.json", "index_head_dim"]),
    "index-topk-zero": (edit_config(index_topk=0), ["config.json", "index_topk"]),
    "index-freq-zero": (edit_config(index_topk_freq=0), ["config.json", "index_topk_freq"]),
    "dsa-without-q-lora": (edit_config(q_lora_rank=None), ["config.json", "q_lora_rank"]),
}


@pytest.mark.parametrize("case", sorted(GLM_CASES))
def test_corrupted_glm_config_is_one_error_line(pristine_glm, tmp_path, case):
    d = tmp_path / "glm"
    shutil.copytree(pristine_glm, d)
    mutate, needles = GLM_CASES[case]
    mutate(d)
    assert_one_line_error(run("generate", "-m", d, "-p", "hello", "--max-tokens", "2"), *needles)


@pytest.mark.parametrize("target, needles", [
    ("a-file", ["a-file", "is a file"]),
    ("missing", ["missing", "does not exist"]),
    ("empty", ["empty", "not a model directory"]),
    ("hub-repo", ["hub-repo", "snapshots"]),
    ("parent", ["did you mean", "model"]),
])
def test_wrong_model_path(pristine, tmp_path, target, needles):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "hub-repo" / "snapshots" / "abc123").mkdir(parents=True)
    shutil.copytree(pristine, tmp_path / "parent" / "model")
    (tmp_path / "parent" / "tokenizer.json").write_text("{}")  # not a model, though it has a tokenizer
    assert_one_line_error(run("generate", "-m", tmp_path / target, "-p", "x"), *needles)


@pytest.mark.parametrize("command", [["generate", "-p", "hi"], ["chat"], ["bench", "--repeat", "1"], ["serve"]])
def test_every_command_reports_a_bad_model_in_one_line(model, command):
    edit_config(n_group=0)(model)
    assert_one_line_error(run(command[0], "-m", model, *command[1:]), "config.json", "n_group")


def test_inspect_reports_a_bad_shard_in_one_line(model):
    truncate(S1, lambda n: n - 1000)(model)
    assert_one_line_error(run("inspect", model), S1)


@pytest.mark.parametrize("case", ["rms-norm-eps-nan", "architectures-other-model", "nan-in-a-norm",
                                  "norm-stored-as-bytes", "embed-shape-wrong", "expert-missing", "tokenizer-garbage",
                                  "template-raises", "eos-token-not-in-vocab", "vocab-smaller-than-tokenizer-ids"])
def test_inspect_refuses_what_generate_refuses(model, case):
    """inspect checks config.json and the tokenizer files as generate does, and ends a failed
    verdict with one Error: line (the table still goes to stdout)."""
    mutate, needles = CASES[case]
    mutate(model)
    assert_one_line_error(run("inspect", model), *needles)


def test_a_damaged_streamed_expert_is_one_error_line(model):
    """--ram-gb reads experts while generating: their scales are checked as the resident load checks
    them, and chat ends on the error (a damaged shard is not a bad line to skip)."""
    poison(S1, "model.layers.1.mlp.experts.0.up_proj.weight.qs")(model)
    needles = [S1, "experts.0.up_proj.weight.qs", "NaN"]
    for all_experts in (run("generate", "-m", model, "-p", "hi", "--max-tokens", "4", "--ram-gb", "0.00001"),
                        run("chat", "-m", model, "--max-tokens", "3", "--ram-gb", "0.00001", input="hi\nho\n/exit\n")):
        assert_one_line_error(all_experts, *needles)


def test_an_absurd_memory_budget_is_a_flag_error(model):
    result = run("generate", "-m", model, "-p", "hi", "--ram-gb", "1e300")
    assert result.exit_code == 2 and "--ram-gb" in assert_one_line_error(result)


# ------------------------------------------------------ cases that would hang a broken loader

_SUBPROCESS_CASES = {
    "shard-fifo": ("out-00002.safetensors", "FIFO"),
    "config-fifo": ("config.json", "FIFO"),
    "tokenizer-fifo": ("tokenizer.json", "FIFO"),
    "template-file-fifo": ("chat_template.jinja", "FIFO"),
}


@pytest.mark.parametrize("case", sorted(_SUBPROCESS_CASES))
def test_fifo_in_the_model_directory_does_not_hang(model, case):
    name, needle = _SUBPROCESS_CASES[case]
    if name == "chat_template.jinja":
        edit_tokenizer_config(chat_template=DELETE)(model)
    p = model / name
    if p.exists():
        p.unlink()
    os.mkfifo(p)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "colibri_mlx", "generate", "-m", str(model), "-p", "hi",
                           "--max-tokens", "2"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith("Error: ") and name in last and needle in last, proc.stderr
    assert time.monotonic() - t0 < 30


def test_device_or_socket_named_as_a_shard(model):
    import socket
    import stat

    try:
        os.mknod(model / "out-00002.safetensors", 0o644 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero
    except (PermissionError, OSError):
        pytest.skip("mknod needs root")
    assert_one_line_error(run("generate", "-m", model, "-p", "hi"), "out-00002.safetensors", "character device")
    (model / "out-00002.safetensors").unlink()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(model / "x.safetensors"))
        assert_one_line_error(run("generate", "-m", model, "-p", "hi"), "x.safetensors", "socket")


# ------------------------------------------------------------------- valid, if unusual

def _hub_snapshot(pristine: Path, root: Path) -> Path:
    """The model as the Hugging Face cache stores it: snapshot files are symlinks into blobs/."""
    import hashlib

    repo = root / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(pristine.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    return snapshot


def test_hugging_face_cache_snapshot_loads(pristine, tmp_path):
    snapshot = _hub_snapshot(pristine, tmp_path / "hub")
    assert all((snapshot / f.name).is_symlink() for f in pristine.iterdir())
    result = run("generate", "-m", snapshot, "-p", "hello", "--max-tokens", "3")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()
    # the repository's root is not the model: the error says where the snapshots are
    assert_one_line_error(run("generate", "-m", tmp_path / "hub" / "models--org--tiny", "-p", "x"),
                          "snapshots/0123abcd")


def test_unusual_but_valid_directory_loads(pristine, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(pristine, d)
    # unrelated files and directories, hidden AppleDouble files, a FIFO nobody reads
    (d / "README.md").write_text("# tiny\n")
    (d / "notes").mkdir()
    (d / "notes" / "config.json").write_text("[]")
    (d / "._out-00000.safetensors").write_bytes(b"\0\5\x16\7 AppleDouble")
    (d / ".cache").mkdir()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    os.mkfifo(d / "a-fifo")
    # a shard moved into a subdirectory and linked back (a link inside the directory)
    (d / "shards").mkdir()
    shutil.move(d / S1, d / "shards" / S1)
    os.symlink(os.path.join("shards", S1), d / S1)
    # config.json with a BOM, unknown keys, nulls for optional keys and 0/1 flags
    cfg = dict(CONFIG, torch_dtype="bfloat16", quantization_config={"quant_method": "fp8"}, n_shared_experts=1,
               q_lora_rank=48, rope_scaling=None, mlp_layer_types=None, norm_topk_prob=1, attention_bias=0,
               initializer_range=0.02, some_future_key=[1, 2, 3])
    (d / "config.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(cfg).encode())
    result = run("generate", "-m", d, "-p", "hello", "--max-tokens", "3")
    assert result.exit_code == 0, result.output
    # reached through a symlink to the whole directory
    os.symlink(d, tmp_path / "linked")
    assert run("generate", "-m", tmp_path / "linked", "-p", "hello", "--max-tokens", "3").exit_code == 0


def test_unusual_but_valid_files_load(pristine, tmp_path):
    """Non-ASCII strings in config.json, a key given twice with the same value, a Kimi config,
    special tokens as AddedToken objects, a named list of chat templates, BF16 vectors."""
    d = tmp_path / "model"
    shutil.copytree(pristine, d)
    cfg = dict(CONFIG, model_type="kimi_k2", name_or_path="Ünïcode/模型 🚀", description="modèle – ‘quotes’")
    (d / "config.json").write_text(json.dumps(cfg, ensure_ascii=False)[:-1] + ', "hidden_size": 64}', "utf-8")
    edit_tokenizer_config(eos_token={"__type": "AddedToken", "content": "<|eos|>", "special": True},
                          chat_template=[{"name": "tool_use", "template": "{{ tools }}"},
                                         {"name": "default", "template": "{{ messages[0]['content'] }}"}])(d)
    retype(S0, "model.layers.1.mlp.gate.e_score_correction_bias", "BF16", 2)(d)
    result = run("generate", "-m", d, "-p", "hello", "--max-tokens", "3")
    assert result.exit_code == 0, result.output
    assert run("inspect", d).exit_code == 0


def test_yarn_and_dsa_configs_still_load(pristine, pristine_glm, tmp_path):
    d = tmp_path / "yarn"
    shutil.copytree(pristine, d)
    edit_config(rope_scaling=YARN, mlp_layer_types=["dense", "sparse"])(d)
    assert run("generate", "-m", d, "-p", "hi", "--max-tokens", "2").exit_code == 0
    g = tmp_path / "glm"
    shutil.copytree(pristine_glm, g)
    edit_config(indexer_types=["full", "full"], index_topk_freq=None)(g)
    result = run("generate", "-m", g, "-p", "hi", "--max-tokens", "2")
    assert result.exit_code == 0, result.output


# --- template bombs: the result's size is predicted before it is built ---------------------------
# (unbounded, each builds gigabytes or runs for minutes before a size check after the call).
# The render budget is cut to 100k characters so that, unfixed, each would still finish here; the
# peak allocation (tracemalloc) and the message naming the operation tell the check ran first.

TEMPLATE_BOMBS = {
    "replace-filter": ("{% set x = 'a' * 1000 %}{{ x|replace('a', 'b' * 50000)|replace('b', 'cc') }}",
                       "a replace"),
    "replace-method": ("{% set x = 'a' * 1000 %}{{ x.replace('a', 'b' * 50000).replace('b', 'cc') }}",
                       "a replace"),
    "join-filter": ("{{ range(2000)|join('x' * 50000) }}", "a join"),
    "join-method": ("{{ ('x' * 50000).join(range(2000)|map('string')) }}", "a join"),
    "join-of-big-items": ("{{ ([range(5)|list] * 90000)|join }}", "a join"),
    "indent-filter": ("{{ ('a\\n' * 2000)|indent(50000) }}", "an indent"),
    "expandtabs-method": ("{{ ('\\t' * 2000).expandtabs(50000) }}", "an expandtabs"),
    "translate-method": ("{{ ('a' * 2000).translate({97: 'b' * 50000}) }}", "a translate"),
    "sum-of-lists": ("{{ ([[1] * 50000] * 40)|sum(start=[]) }}", "a sum"),
    "list-of-a-big-range": ("{{ range(90000)|list|length }}", "range elements"),
    "str-format-repeating-an-argument": ("{% set big = 'x' * 50000 %}{{ ('{0}' * 1000).format(big) }}",
                                         "a format"),
    "format-map-repeating-a-value": ("{% set big = 'x' * 50000 %}{{ ('{a}' * 1000).format_map({'a': big}) }}",
                                     "a format"),
    "percent-repeating-an-argument": ("{% set big = 'x' * 50000 %}{{ ('%s' * 1000) % ((big,) * 1000) }}",
                                      "a format"),
    "percent-repeating-a-mapping-value": ("{% set big = 'x' * 50000 %}{{ ('%(a)s' * 1000) % {'a': big} }}",
                                          "a format"),
    "percent-widths-repeated": ("{{ ('%99999s' * 1000) % (('a',) * 1000) }}", "a format"),
    "format-filter-repeating-an-argument": (
        "{% set big = 'x' * 50000 %}{{ ('%s' * 1000)|format(*([big] * 1000)) }}", "a format"),
    "wordwrap-long-wrapstring": ("{{ ('a ' * 2000)|wordwrap(1, wrapstring='x' * 50000) }}", "a wordwrap"),
}


def template_tokenizer(template):
    """A one-word tokenizer with ``template`` as its chat template (the template is what runs)."""
    from colibri_mlx.tokenizer import Tokenizer
    from tokenizers import Tokenizer as HFTokenizer, models

    return Tokenizer(HFTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), {}, template)


def render_with_small_budget(monkeypatch, text, content="hi"):
    from colibri_mlx import tokenizer as tk

    monkeypatch.setattr(tk, "RENDER_BUDGET", 100_000)
    return template_tokenizer(text).apply_chat_template([{"role": "user", "content": content}])


@pytest.mark.parametrize("case", sorted(TEMPLATE_BOMBS))
def test_template_bomb_is_refused_before_it_is_built(monkeypatch, case):
    import tracemalloc

    from colibri_mlx.tokenizer import TokenizerError

    text, needle = TEMPLATE_BOMBS[case]
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(TokenizerError, match="unsafe operation refused by the sandbox") as e:
            render_with_small_budget(monkeypatch, text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 2
    assert peak < 20 << 20, f"{peak >> 20} MiB allocated before the refusal"
    assert needle in str(e.value)


@pytest.mark.parametrize("loop", ["{% set y = x|upper %}", "{% if 'q' in x %}{% endif %}", "{% set y = x.split('b') %}"],
                         ids=["upper", "in", "split"])
def test_a_loop_scanning_a_long_string_is_cut_by_the_render_deadline(monkeypatch, loop):
    """Operations that build nothing new but scan a long string, looped (1 ms an iteration over
    a 1M-character string: minutes at the loop budget): the render stops at its deadline."""
    from colibri_mlx import tokenizer as tk

    monkeypatch.setattr(tk, "RENDER_SECONDS", 0.5)
    text = "{% set x = messages[0]['content'] %}{% for i in range(N) %}" + loop + "{% endfor %}ok"
    tok = template_tokenizer(text.replace("N", "900000"))
    t0 = time.perf_counter()
    with pytest.raises(tk.TokenizerError, match="runs for more than 0.5 s"):
        tok.apply_chat_template([{"role": "user", "content": "a" * 1_000_000}])
    assert time.perf_counter() - t0 < 3
    tok.chat_template = text.replace("N", "1000")                    # a short loop renders
    assert tok.apply_chat_template([{"role": "user", "content": "a" * 1000}]) == "ok"


def test_pprint_of_a_big_list_is_refused_before_it_runs():
    """pprint (1 µs an element, more when nested): its elements are charged as loop iterations."""
    from colibri_mlx.tokenizer import TokenizerError

    tok = template_tokenizer(None)
    for text, needle in [("{{ range(4000000)|list|pprint }}", "loop iterations"),
                         ("{{ range(9000000)|list|pprint }}", "range elements"),  # the list is charged
                         ("{{ ([range(1000)|list] * 2000)|pprint }}", "loop iterations")]:
        tok.chat_template = text
        t0 = time.perf_counter()
        with pytest.raises(TokenizerError, match=needle):
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
        assert time.perf_counter() - t0 < 2, text


def test_budgeted_filters_render_as_jinja2_does(monkeypatch):
    """replace, join, indent, sum, list, pprint, expandtabs, translate, str.format, format_map, %,
    format and wordwrap as templates use them: the same text as jinja2's own sandbox renders."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    text = ("{% set ns = namespace(n=0) %}{% for m in messages %}"
            "{{ m.role|replace('user', 'User') }}: {{ m.content.replace('\\n', ' ').strip() }}\n"
            "{{ m.content|indent(2, first=True) }}|{{ m.content|indent('> ', blank=True) }}\n"
            "{{ m.tags|join(', ') }}/{{ '; '.join(m.tags) }}/{{ m['items']|join('|', attribute='name') }}\n"
            "{{ m['items']|sum(attribute='n') }} {{ [1, 2.5]|sum(start=1) }} {{ [[1], [2, 3]]|sum(start=[0]) }}"
            " {{ [(1,), (2,)]|sum(start=()) }} {{ m.tags|list }} {{ m['items']|pprint }}\n"
            "{{ ('a\\tb').expandtabs(4) }}{{ 'ab'.translate({97: 'xy'}) }}\n"
            "{{ '{0}: {1!r} {n:>5} {2:.2f}'.format(m.role, m.content, 3.14159, n=loop.index) }}"
            "{{ '{role}'.format_map(m) }}"
            "{{ '%s|%5d|%-4s|%.1f%%' % (m.role, 7, 'a', 2.25) }} {{ '%(role)s' % m }} {{ '%r' % (m.tags,) }}"
            " {{ '%s, %s!'|format(m.role, 'hi') }} {{ '%(a)s'|format(a=m.role) }}\n"
            "{{ m.content|wordwrap(5) }}|{{ m.content|wordwrap(4, wrapstring='<br>') }}\n"
            "{% endfor %}")
    messages = [{"role": "user", "content": "line one\nline two\n\nline four", "tags": ["a", "b"],
                 "items": [{"name": "x", "n": 1}, {"name": "y", "n": 2}]},
                {"role": "assistant", "content": "ok", "tags": [], "items": []}]
    tok = template_tokenizer(text)
    ref = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(text)
    assert tok.apply_chat_template(messages) == ref.render(messages=messages, add_generation_prompt=True,
                                                           bos_token="", eos_token="")

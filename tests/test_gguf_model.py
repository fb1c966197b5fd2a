"""GGUF models (models/gguf_checkpoint.py, gguf_tokenizer.py) on tiny deepseek2 files written by
llama.cpp's converter and quantizer (tests/data/gguf, scripts/gguf/make_tiny_models.py).

Oracles:
- tight: a float64 numpy forward on the file's own weights as ``gguf.quants`` dequantizes them,
  read by GGUF name (tests/gguf_oracle.py): our float32 logits within 1e-5 of its largest logit;
- loose: llama.cpp's own logits (llama-cpp-python, CPU, F32 KV cache) saved beside each file.
  For F32/BF16 files ours must be within twice llama.cpp's own distance from the float64 logits
  (llama.cpp rounds activations to BF16 for BF16 weights: ~1e-2). For quantized files llama.cpp
  also quantizes activations (Q8_K), and tiny random MoE models have near-tied routers: argmax
  flips are reported with the router margin; a flip is a failure only where llama.cpp's own error
  cannot explain it (the float64 top-2 logit gap larger than twice llama.cpp's largest error).
- the tokenizer: the ids the original tokenizer.json gave for the prompt (prompt.json).
"""

from __future__ import annotations

import json
import os
import shutil

import mlx.core as mx
import numpy as np
import pytest

from gguf_oracle import GgufOracle

DATA = os.path.join(os.path.dirname(__file__), "data", "gguf")
FIXTURES = ("tiny-f32", "tiny-bf16", "tiny-q4_k_m", "tiny-iq2_xxs", "tiny-glm-bf16")
FLOAT_FIXTURES = ("tiny-f32", "tiny-bf16")
TIGHT = 1e-5


def fixture(name: str) -> str:
    return os.path.join(DATA, name + ".gguf")


def prompt_ids() -> list[int]:
    with open(os.path.join(DATA, "prompt.json")) as f:
        return json.load(f)["ids"]


def our_logits(path, **options) -> np.ndarray:
    import colibri_mlx

    model, _ = colibri_mlx.load(path, dtype="float32", **options)
    return np.array(model(mx.array([prompt_ids()])))[0].astype(np.float64)


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


_oracle_cache: dict = {}


def oracle(path):
    if path not in _oracle_cache:
        _oracle_cache[path] = GgufOracle(path).logits(prompt_ids())
    return _oracle_cache[path]


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_match_float64_oracle(name):
    want, _ = oracle(fixture(name))
    got = our_logits(fixture(name))
    assert rel(got, want) <= TIGHT, f"{name}: {rel(got, want):.3g} relative to the float64 forward"


@pytest.mark.parametrize("name", FLOAT_FIXTURES)
def test_float_files_within_twice_llama_cpp_error(name):
    want, _ = oracle(fixture(name))
    llama = np.load(os.path.join(DATA, name + ".llama_logits.npy")).astype(np.float64)
    llama_err = rel(llama, want)
    ours = our_logits(fixture(name))
    # floor: the tight tolerance (llama.cpp's own error on an F32 file is below it)
    assert rel(ours, llama) <= max(2 * llama_err, TIGHT), (name, rel(ours, llama), llama_err)


def test_glm5_against_llama_cpp():
    """GLM-5 (glm-dsa): where every causal key is chosen (the first index_topk positions) the DSA
    layer is dense attention and ours is within twice llama.cpp's error; past them keys tie at
    the top-k threshold (2 indexer heads: many keys score exactly 0 after the ReLU), which ours
    breaks toward the lowest positions and llama.cpp's top_k in std::partial_sort's heap order
    (docs/gguf.md): the differences are printed."""
    import colibri_mlx

    name = "tiny-glm-bf16"
    want, _ = oracle(fixture(name))
    llama = np.load(os.path.join(DATA, name + ".llama_logits.npy")).astype(np.float64)
    model, _ = colibri_mlx.load(fixture(name))
    k = model.args.index_topk
    assert model.args.dsa and model.args.num_nextn_predict_layers == 1 and len(want) > k
    ours = our_logits(fixture(name))
    assert rel(ours[:k], llama[:k]) <= max(2 * rel(llama[:k], want[:k]), TIGHT)
    print(f"{name}: max |ours - llama.cpp| past position {k}: {np.abs(ours - llama)[k:].max(-1).round(3)}")


@pytest.mark.parametrize("name", ("tiny-q4_k_m", "tiny-iq2_xxs"))
def test_quantized_files_against_llama_cpp(name):
    want, margins = oracle(fixture(name))
    llama = np.load(os.path.join(DATA, name + ".llama_logits.npy")).astype(np.float64)
    ours = our_logits(fixture(name))
    llama_abs_err = float(np.abs(llama - want).max())
    top2 = np.sort(want, axis=-1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    flips = np.nonzero(ours.argmax(-1) != llama.argmax(-1))[0]
    for t in flips:
        print(f"{name}: position {t}: argmax ours {ours[t].argmax()} / llama.cpp {llama[t].argmax()}, float64 "
              f"top-2 logit gap {gap[t]:.3g}, router margin {margins[t]:.3g}, llama.cpp max |error| "
              f"{llama_abs_err:.3g}")
    unexplained = [int(t) for t in flips if gap[t] > 2 * llama_abs_err]
    assert not unexplained, f"{name}: argmax flips llama.cpp's error does not explain at positions {unexplained}"
    assert (ours.argmax(-1) == want.argmax(-1)).all()


# ------------------------------------------------------------------------------ rewritten files


def rewrite(src: str, dst: str, transform=None, split_max_tensors: int = 0, arch: str | None = None,
            fields: dict | None = None) -> None:
    """Write the F32 GGUF ``src`` again (to ``dst``) with gguf's writer: ``transform(tensors)``
    edits the ``{name: float32 array}`` dict; ``split_max_tensors`` splits the file; ``fields``
    replaces metadata values."""
    import gguf

    reader = gguf.GGUFReader(src)
    tensors = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    if transform is not None:
        tensors = transform(tensors)
    writer = gguf.GGUFWriter(dst, arch or reader.fields["general.architecture"].contents(),
                             split_max_tensors=split_max_tensors)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = (fields or {}).get(key, field.contents())
        if arch is not None and key.startswith("deepseek2."):
            key = arch + key[len("deepseek2"):]
        writer.add_key_value(key, value, vtype, sub)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def join_kv_b(tensors: dict) -> dict:
    """attn_k_b / attn_v_b back into the whole attn_kv_b [H*(nope+v), kv_lora] llama.cpp's
    converter split (k_b is kv_b's key rows per head, transposed)."""
    out = {}
    for name, data in tensors.items():
        if name.endswith("attn_k_b.weight"):
            k_b, v_b = data, tensors[name.replace("attn_k_b", "attn_v_b")]
            out[name.replace("attn_k_b", "attn_kv_b")] = np.concatenate(
                [k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])
        elif not name.endswith("attn_v_b.weight"):
            out[name] = data
    return out


def test_whole_and_split_kv_b_give_the_same_model(tmp_path):
    whole = str(tmp_path / "whole.gguf")
    rewrite(fixture("tiny-f32"), whole, join_kv_b)
    import gguf

    names = {t.name for t in gguf.GGUFReader(whole).tensors}
    assert "blk.0.attn_kv_b.weight" in names and "blk.0.attn_k_b.weight" not in names
    want, _ = GgufOracle(whole).logits(prompt_ids())   # the oracle's own attn_kv_b path
    split_want, _ = oracle(fixture("tiny-f32"))
    assert rel(want, split_want) < 1e-12   # the join is the converter's split undone
    got = our_logits(whole)
    assert rel(got, want) <= TIGHT
    assert np.array_equal(got, our_logits(fixture("tiny-f32")))


def test_split_files(tmp_path):
    folder = tmp_path / "split"
    folder.mkdir()
    rewrite(fixture("tiny-f32"), str(folder / "tiny.gguf"), split_max_tensors=12)
    parts = sorted(os.listdir(folder))
    assert parts == ["tiny-00001-of-00003.gguf", "tiny-00002-of-00003.gguf", "tiny-00003-of-00003.gguf"]
    single = our_logits(fixture("tiny-f32"))
    assert np.array_equal(our_logits(str(folder / parts[1])), single)   # any part names the set
    assert np.array_equal(our_logits(str(folder)), single)              # so does its directory
    os.remove(folder / parts[2])
    from colibri_mlx.models.gguf_checkpoint import GgufError

    with pytest.raises(GgufError, match="part tiny-00003-of-00003.gguf of the 3-part split model is missing"):
        our_logits(str(folder / parts[0]))


@pytest.mark.parametrize("name", ("tiny-bf16", "tiny-iq2_xxs"))
def test_streamed_experts_match_resident(tmp_path, name):
    path = str(tmp_path / "m.gguf")
    shutil.copy(fixture(name), path)
    resident = our_logits(path)
    streamed = our_logits(path, ram_gb=0.0001, record_usage=False)
    assert np.array_equal(streamed, resident)


# ------------------------------------------------------------------------------------ tokenizer


def test_tokenizer_from_metadata():
    from colibri_mlx.tokenizer import load_tokenizer

    with open(os.path.join(DATA, "prompt.json")) as f:
        prompt = json.load(f)
    tok = load_tokenizer(fixture("tiny-q4_k_m"))
    assert tok.encode(prompt["text"]) == prompt["ids"]   # the original tokenizer.json's ids, BOS first
    assert tok.decode(prompt["ids"][1:]) == prompt["text"]
    assert tok.eos_token_ids == {1} and tok.bos_token == "<｜begin▁of▁sentence｜>"
    assert tok.encode("x<｜end▁of▁sentence｜>", add_special_tokens=False)[-1] == 1   # control token whole
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<｜begin▁of▁sentence｜><user>hi<assistant>"


@pytest.mark.parametrize("name", ("tiny-f32", "tiny-glm-bf16"))
def test_tokenizer_splits_as_llama_cpp(name):
    """llama.cpp's own tokenization of a probe text (digits, CJK, punctuation runs, whitespace,
    a control token), saved by the fixture script: DeepSeek-V3's and GLM-5's pre-tokenizers."""
    from colibri_mlx.tokenizer import load_tokenizer

    with open(os.path.join(DATA, "prompt.json")) as f:
        prompt = json.load(f)
    tok = load_tokenizer(fixture(name))
    assert tok.encode(prompt["probe"], add_special_tokens=False) == prompt["probe_llama_ids"][name]


def test_kimi_k2_pre_tokenizer_splits():
    from tokenizers import Regex, pre_tokenizers

    from colibri_mlx.gguf_tokenizer import PRE_TOKENIZERS

    split = pre_tokenizers.Split(Regex(PRE_TOKENIZERS["kimi-k2"][0]), behavior="isolated")
    pieces = [p for p, _ in split.pre_tokenize_str("Hello World's 12345 我想在apple工作")]
    assert pieces == ["Hello", " World's", " ", "123", "45", " ", "我想在", "apple", "工作"]


# --------------------------------------------------------------------------------------- inspect


def test_inspect_lists_ggml_types_and_model_args():
    from click.testing import CliRunner

    from colibri_mlx.cli import main

    result = CliRunner().invoke(main, ["inspect", fixture("tiny-iq2_xxs")])
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if ln.startswith("blk.0.ffn_gate_exps.weight"))
    assert line.split()[1:4] == ["IQ2_XXS", "4x256x256", str(4 * 256 * 66)]
    assert "model.layers.0.mlp.experts.*.gate_proj.weight" in line
    assert "n_routed_experts=4" in result.output and "kv_lora_rank=256" in result.output
    result = CliRunner().invoke(main, ["inspect", "--json", fixture("tiny-f32")])
    report = json.loads(result.output)
    assert report["model_args"]["first_k_dense_replace"] == 1 and report["model_args"]["tie_word_embeddings"]
    assert report["model_args"]["rope"]["rope_type"] == "yarn" and report["model_args"]["rope"]["factor"] == 4.0
    assert {r["name"]: r["type"] for r in report["tensors"]}["blk.0.attn_k_b.weight"] == "F32"
    assert report["tokenizer"]["chat_template"] and report["tokenizer"]["eos_token_ids"] == [1]


def test_cli_generate_runs_a_gguf_file():
    from click.testing import CliRunner

    from colibri_mlx.cli import main

    result = CliRunner().invoke(main, ["generate", "-m", fixture("tiny-q4_k_m"), "-p", "the fox", "--max-tokens",
                                       "3", "--no-chat-template"])
    assert result.exit_code == 0, result.output
    assert "generation: 3 tokens" in result.output


# ---------------------------------------------------------------------------------------- errors


def test_truncated_file(tmp_path):
    from colibri_mlx.models.gguf_checkpoint import GgufError

    src = fixture("tiny-bf16")
    for keep in (os.path.getsize(src) - 100, 1000):   # cut in the tensor data, in the header
        path = tmp_path / f"cut{keep}.gguf"
        with open(src, "rb") as f:
            path.write_bytes(f.read(keep))
        with pytest.raises(GgufError, match=f"{path}: truncated: it needs [0-9]+ bytes, the file has {keep}"):
            our_logits(str(path))


def test_not_a_gguf_file(tmp_path):
    from colibri_mlx.cli import main
    from click.testing import CliRunner

    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip, not a GGUF file")
    for args in (["generate", "-m", str(path), "-p", "x"], ["inspect", str(path)]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code != 0 and f"{path}: not a GGUF file (it starts with b'PK" in result.output
        assert "Traceback" not in result.output
    result = CliRunner().invoke(main, ["generate", "-m", str(tmp_path / "gone.gguf"), "-p", "x"])
    assert result.exit_code != 0 and f"{tmp_path / 'gone.gguf'}: no such GGUF file" in result.output
    renamed = tmp_path / "model.bin"
    shutil.copy(fixture("tiny-bf16"), renamed)
    result = CliRunner().invoke(main, ["generate", "-m", str(renamed), "-p", "x"])
    assert result.exit_code != 0 and f"{renamed}: a GGUF file, but its name does not end in .gguf" in result.output


def test_unread_ggml_type_is_refused_before_loading(tmp_path, monkeypatch):
    import gguf
    from colibri_mlx.models.gguf_checkpoint import GgufError

    add_tensor = gguf.GGUFWriter.add_tensor

    def add_q4_1(self, name, data, *args, **kwargs):   # Q4_1: a ggml type colibri does not read
        if name != "blk.1.ffn_up_exps.weight":
            return add_tensor(self, name, data, *args, **kwargs)
        q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_1)
        return add_tensor(self, name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_q4_1)
    path = str(tmp_path / "q4_1.gguf")
    rewrite(fixture("tiny-f32"), path)
    for options in ({}, {"ram_gb": 1e-5, "record_usage": False}):   # resident, streamed experts
        with pytest.raises(GgufError, match=f"{path}: tensor 'blk.1.ffn_up_exps.weight' has ggml type Q4_1, which "
                                            "colibri does not read"):
            our_logits(path, **options)


def test_unknown_architecture(tmp_path):
    from colibri_mlx.models.gguf_checkpoint import GgufError

    path = str(tmp_path / "llama.gguf")
    rewrite(fixture("tiny-f32"), path, arch="llama")
    with pytest.raises(GgufError, match="general.architecture is 'llama'; colibri reads deepseek2"):
        our_logits(path)


@pytest.mark.parametrize("key, value, message", [
    ("deepseek2.expert_gating_func", 1, "expert_gating_func is 1 .softmax routing: DeepSeek-V2.; colibri runs sigmoid"),
    ("tokenizer.ggml.pre", "qwen2", "tokenizer.ggml.pre is 'qwen2'; colibri knows"),
    ("tokenizer.ggml.model", "llama", "tokenizer.ggml.model is 'llama'"),
])
def test_unsupported_metadata_named(tmp_path, key, value, message):
    import colibri_mlx

    path = str(tmp_path / "m.gguf")
    rewrite(fixture("tiny-f32"), path, fields={key: value})
    with pytest.raises(ValueError, match=message) as e:
        colibri_mlx.load(path)
    assert path in str(e.value)


def test_missing_tensor_named(tmp_path):
    from colibri_mlx.models.gguf_checkpoint import GgufError

    path = str(tmp_path / "missing.gguf")
    rewrite(fixture("tiny-f32"), path, lambda t: {k: v for k, v in t.items() if k != "blk.1.ffn_up_exps.weight"})
    with pytest.raises(GgufError, match="missing tensor 'blk.1.ffn_up_exps.weight'"):
        our_logits(path)


def test_reader_reads_what_gguf_reads():
    """The loader's reader (a plain-array view of the memory map) against ``gguf.GGUFReader``."""
    import gguf

    from colibri_mlx.models.gguf_checkpoint import reader_class

    for name in ("tiny-glm-bf16", "tiny-iq2_xxs"):
        ours, theirs = reader_class()(fixture(name)), gguf.GGUFReader(fixture(name))
        assert list(ours.fields) == list(theirs.fields)
        for key, field in theirs.fields.items():
            assert ours.fields[key].contents() == field.contents(), key
            assert ours.fields[key].types == field.types, key
        assert [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in ours.tensors] == \
            [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in theirs.tensors]
        for a, b in zip(ours.tensors, theirs.tensors):
            assert np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name

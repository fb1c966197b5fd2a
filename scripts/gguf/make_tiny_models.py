"""Tiny deepseek2 GGUF models, made by llama.cpp itself, for tests/test_gguf_model.py.

    PYTHONPATH=$PWD python scripts/gguf/make_tiny_models.py [--llama-cpp DIR] [--llama-imatrix PATH]
        [--out tests/data/gguf]

1. A tiny random DeepSeek-V3 Hugging Face checkpoint (numpy weights, safetensors), a byte-level
   BPE tokenizer with DeepSeek-V3's pre-tokenizer, and a chat template.
2. llama.cpp's converter (``convert_hf_to_gguf.py`` of the vendored llama.cpp in the
   llama-cpp-python sdist, run with that tree's own gguf-py) writes it as F32 and BF16 GGUF.
   The converter recognises a BPE pre-tokenizer by hashing the tokens of a probe text; a tiny
   tokenizer matches no known hash, so its ``get_vocab_base_pre`` is mapped to "deepseek-v3"
   (the pre-tokenizer the tokenizer does use): the one line this script changes.
3. ``llama_cpp.llama_model_quantize`` quantizes the F32 file to Q4_K_M and IQ2_XXS (llama.cpp's
   own mixes; IQ2_XXS's: IQ2_XXS on the attention and expert matrices, IQ4_NL on rows of 32 and
   64, Q5_K output, Q2_K embeddings). IQ2_XXS needs an importance matrix: llama.cpp's imatrix
   tool (``llama-imatrix``, built from the same vendored tree; CPU, one thread) runs the F32
   file over ``CALIBRATION`` (twelve English sentences: 12 chunks of 64 tokens) and writes a
   GGUF imatrix: ``<tensor>.in_sum2``, the sums of squared activations per input column (a row
   per expert for the stacked expert tensors), and ``<tensor>.counts``, the tokens each row
   saw. It is read as ``llama-quantize --imatrix`` reads it (in_sum2 / counts row by row; 1 for
   an expert no token reached) and given to the quantizer with llama-quantize's
   ``quantize.imatrix.*`` metadata: the file is what ``llama-quantize --imatrix`` writes, byte
   for byte. The imatrix is kept beside the fixtures as ``tiny-iq2_xxs.imatrix.gguf``. Q4_K_M
   is quantized without one.
4. llama.cpp's logits on a fixed prompt (every position, CPU, F32 KV cache) are saved beside each
   file as ``<name>.llama_logits.npy`` with the prompt in ``prompt.json``, and llama.cpp's own
   tokenization of a probe text (the tokenizer's oracle).

Three shapes, small enough that every file together stays near 2 MB (1.93 MiB with the imatrix): ``float`` (hidden 32, a
leading dense layer and a MoE layer, tied embeddings: no ``output`` tensor), ``quant`` (one MoE
layer; hidden, intermediate, q_lora and kv_lora 256: llama.cpp writes K- and IQ-quants only for
rows that are a multiple of 256) and ``glm`` (GLM-5, ``glm-dsa``: ``float`` with the DSA indexer
and a NextN layer; BF16 only; its pre-tokenizer mapped to "glm4").
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

DEFAULT_LLAMA_CPP = "/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp"
# llama.cpp's imatrix tool built from that tree:
#   cmake -S DIR -B /work/llama/build -DLLAMA_CURL=OFF && cmake --build /work/llama/build --target llama-imatrix
DEFAULT_LLAMA_IMATRIX = "/work/llama/build/bin/llama-imatrix"
PROMPT = "The quick brown fox jumps over the lazy dog. 123 + 456"
# Text llama.cpp's own tokenizer splits (digits, CJK, punctuation runs, spaces, newlines): its ids
# are saved for the tokenizer built from the GGUF metadata to match.
PROBE = ("Hello World's 12345 3.14 我想在apple工作1314151天～ ------======= \n\n  \t 'RE you sure? "
         "<｜end▁of▁sentence｜> ok!!")

COMMON = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_hidden_layers=2, first_k_dense_replace=1,
    num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=256,
    rms_norm_eps=1e-6, rope_theta=10000.0, scoring_func="sigmoid", topk_method="noaux_tc", hidden_act="silu",
    tie_word_embeddings=False, attention_bias=False, num_nextn_predict_layers=0, torch_dtype="float32",
)
SHAPES = {
    "float": dict(COMMON, tie_word_embeddings=True, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                  q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                  rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "quant": dict(COMMON, num_hidden_layers=1, first_k_dense_replace=0, hidden_size=256, intermediate_size=256, moe_intermediate_size=256, q_lora_rank=256,
                  kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, rope_scaling=None),
}
# GLM-5: the DSA indexer choosing index_topk keys (fewer than the prompt's tokens, so it matters;
# llama.cpp rotates indexer heads with a Hadamard matrix of 64 or more), a NextN layer.
SHAPES["glm"] = dict(SHAPES["float"], architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa",
                     rope_scaling=None, index_topk=16, index_n_heads=2, index_head_dim=64,
                     num_nextn_predict_layers=1)
GLM_SPECIALS = ["<|endoftext|>", "[gMASK]", "<|user|>", "<|observation|>"]   # what llama.cpp's GLM vocab looks up
# llama_ftype values (llama.h)
FTYPES = {"Q4_K_M": 15, "IQ2_XXS": 19}
NEEDS_IMATRIX = ("IQ2_XXS",)   # its mix has tensors llama.cpp refuses to quantize without one
SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
# DeepSeek-V3's pre-tokenizer (its tokenizer.json; llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM).
DEEPSEEK_V3_SPLITS = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
]
TRAINING_TEXT = ("the quick brown fox jumps over the lazy dog and the dog sleeps while the fox runs away. "
                 "numbers 123 456 789 and words like model, weight, expert, router, latent attention.") * 4
# The importance matrix's calibration text: it tokenizes to 769 tokens (BOS first), IMATRIX_CHUNKS
# chunks of IMATRIX_CTX tokens for llama-imatrix.
CALIBRATION = "\n".join([
    "The quick brown fox jumps over the lazy dog, and the dog sleeps while the fox runs away.",
    "A model reads a prompt one token at a time; each layer mixes what it has read so far.",
    "The router sends every token to two experts out of four, and a shared expert sees them all.",
    "Latent attention keeps a small compressed cache: keys and values are rebuilt from it.",
    "Numbers such as 123, 456 and 7890 are split into groups of at most three digits.",
    "On Monday the weather was cold and grey; by Friday the sun had come back to the hills.",
    "She asked whether the train would leave at 9:15 or at 10:30, and nobody knew the answer.",
    "Weights are stored in blocks of 256 values, each with its own scale and a few bits per weight.",
    "The experts learn different things: one likes punctuation, another likes words, a third digits.",
    "When the river rose, the farmers moved their sheep to the high field above the old mill.",
    "Please write a short story about a robot who learns to bake bread in a small village.",
    "the fox runs, the dog sleeps, the model weighs every expert and the router picks two.",
])
IMATRIX_CTX, IMATRIX_CHUNKS = 64, 12


def hf_shapes(config: dict) -> dict[str, tuple]:
    """Every tensor of a DeepSeek-V3 Hugging Face checkpoint of ``config``."""
    D, V = config["hidden_size"], config["vocab_size"]
    H, nope, rope, v = (config[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                            "v_head_dim"))
    kv_lora, q_lora, E = config["kv_lora_rank"], config["q_lora_rank"], config["n_routed_experts"]
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, D)
    n_mtp = config["num_nextn_predict_layers"]
    for i in range(config["num_hidden_layers"] + n_mtp):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if i >= config["num_hidden_layers"]:
            shapes.update({p + "enorm.weight": (D,), p + "hnorm.weight": (D,), p + "eh_proj.weight": (D, 2 * D),
                           p + "shared_head.norm.weight": (D,)})
        if config["model_type"] == "glm_moe_dsa":
            nh, hd = config["index_n_heads"], config["index_head_dim"]
            shapes.update({a + "indexer.wq_b.weight": (nh * hd, q_lora), a + "indexer.wk.weight": (hd, D),
                           a + "indexer.k_norm.weight": (hd,), a + "indexer.k_norm.bias": (hd,),
                           a + "indexer.weights_proj.weight": (nh, D)})
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       a + "kv_a_proj_with_mqa.weight": (kv_lora + rope, D), a + "kv_a_layernorm.weight": (kv_lora,),
                       a + "kv_b_proj.weight": (H * (nope + v), kv_lora), a + "o_proj.weight": (D, H * v)})
        if q_lora:
            shapes.update({a + "q_a_proj.weight": (q_lora, D), a + "q_a_layernorm.weight": (q_lora,),
                           a + "q_b_proj.weight": (H * (nope + rope), q_lora)})
        else:
            shapes[a + "q_proj.weight"] = (H * (nope + rope), D)
        mlps = {}
        if i < config["first_k_dense_replace"]:
            mlps[p + "mlp."] = config["intermediate_size"]
        else:
            inter = config["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (E, D)
            shapes[p + "mlp.gate.e_score_correction_bias"] = (E,)
            mlps[p + "mlp.shared_experts."] = inter * config["n_shared_experts"]
            for e in range(E):
                mlps[p + f"mlp.experts.{e}."] = inter
        for m, inter in mlps.items():
            shapes.update({m + "gate_proj.weight": (inter, D), m + "up_proj.weight": (inter, D),
                           m + "down_proj.weight": (D, inter)})
    return shapes


def write_tokenizer(path: str, extra_specials=()) -> int:
    """A byte-level BPE trained on a few sentences (deterministic), DeepSeek-V3's pre-tokenizer;
    returns its vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in DEEPSEEK_V3_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TRAINING_TEXT], trainer)
    tok.add_special_tokens(list(extra_specials))
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
                   "add_bos_token": True, "chat_template": CHAT_TEMPLATE, "model_max_length": 256}, f, indent=1)
    return tok.get_vocab_size()


def write_checkpoint(path: str, shape: str, seed: int) -> dict:
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    vocab = write_tokenizer(path, GLM_SPECIALS if shape == "glm" else ())
    config = dict(SHAPES[shape], vocab_size=vocab, bos_token_id=0, eos_token_id=1)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shp in sorted(hf_shapes(config).items()):
        if name.endswith("norm.weight"):
            w = 1 + 0.1 * rng.standard_normal(shp)
        elif len(shp) == 1:
            w = 0.1 * rng.standard_normal(shp)
        else:
            w = rng.standard_normal(shp) / np.sqrt(shp[-1])
        tensors[name] = w.astype(np.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1}, f)
    return config


CONVERT = """
import sys
sys.path.insert(0, {root!r})
sys.argv = ["convert_hf_to_gguf.py"] + {args!r}
import convert_hf_to_gguf as convert
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
convert.main()
"""


def convert(llama_cpp: str, hf_dir: str, out: str, outtype: str, pre: str = "deepseek-v3") -> None:
    env = dict(os.environ, PYTHONPATH=os.path.join(llama_cpp, "gguf-py"))
    code = CONVERT.format(root=llama_cpp, args=[hf_dir, "--outfile", out, "--outtype", outtype], pre=pre)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, stdout=subprocess.DEVNULL)


def compute_imatrix(llama_imatrix: str, model: str, workdir: str) -> str:
    """llama.cpp's imatrix tool on ``model`` over ``CALIBRATION`` (IMATRIX_CHUNKS chunks of
    IMATRIX_CTX tokens, one sequence a batch, CPU, one thread); returns the GGUF imatrix file it
    wrote. It runs in ``workdir`` so the dataset it records is the text's bare file name."""
    with open(os.path.join(workdir, "calibration.txt"), "w") as f:
        f.write(CALIBRATION)
    out = os.path.join(workdir, "imatrix.gguf")
    cmd = [llama_imatrix, "-m", model, "-f", "calibration.txt", "-o", out, "-c", str(IMATRIX_CTX),
           "-b", str(IMATRIX_CTX), "--chunks", str(IMATRIX_CHUNKS), "-ngl", "0", "-t", "1", "--no-ppl",
           "--output-format", "gguf"]
    run = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
    if run.returncode != 0 or not os.path.exists(out):
        raise SystemExit(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stdout}{run.stderr}")
    chunks = read_imatrix(out)[1]["chunks"]
    if chunks != IMATRIX_CHUNKS:
        raise SystemExit(f"llama-imatrix used {chunks} chunks of the calibration text, not {IMATRIX_CHUNKS}")
    return out


def read_imatrix(path: str) -> tuple[dict[str, np.ndarray], dict]:
    """An imatrix GGUF as ``llama-quantize --imatrix`` reads it (tools/quantize/quantize.cpp's
    load_imatrix): for each tensor, ``<name>.in_sum2`` (ne0 x n_mat floats, n_mat the experts of a
    stacked tensor, else 1) divided row by row by ``<name>.counts`` (n_mat floats, rounded to
    integers), in float32; a row no token reached weighs every column 1. Returns ``{name: the
    flat float32 values}`` and the metadata llama-quantize records."""
    import gguf

    reader = gguf.GGUFReader(path)
    sums, counts = {}, {}
    for t in reader.tensors:
        if t.name.endswith(".in_sum2"):
            sums[t.name[:-len(".in_sum2")]] = np.asarray(t.data, np.float32).reshape(-1)
        elif t.name.endswith(".counts"):
            # stored as floats, read back with std::lround (the counts are whole numbers)
            counts[t.name[:-len(".counts")]] = np.floor(np.asarray(t.data, np.float64).reshape(-1) + 0.5)
    assert sums.keys() == counts.keys(), "in_sum2 and counts tensors do not pair up"
    values = {}
    for name in sorted(sums):
        c = counts[name].astype(np.float32)
        rows = sums[name].reshape(len(c), -1)
        v = np.ones_like(rows)
        v[c > 0] = rows[c > 0] / c[c > 0, None]   # float32, as load_imatrix divides
        values[name] = v.reshape(-1)
    field = reader.fields
    meta = {"dataset": field["imatrix.datasets"].contents()[0],
            "chunks": int(field["imatrix.chunk_count"].contents())}
    return values, meta


def kv_overrides(llama_cpp, items: list[tuple[str, object]]):
    """A ``llama_model_kv_override`` array (string or integer values) ending in an empty key."""
    array = (llama_cpp.llama_model_kv_override * (len(items) + 1))()
    for kv, (key, value) in zip(array, items):
        kv.key = key.encode()
        if isinstance(value, str):
            kv.tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR
            kv.value.val_str = value.encode()[:127]
        else:
            kv.tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT
            kv.value.val_i64 = value
    return array


def quantize(src: str, out: str, ftype: str, imatrix: str | None = None) -> None:
    """llama.cpp's quantizer; with ``imatrix`` (a GGUF imatrix file, kept as ``<out>.imatrix.gguf``)
    it is given as llama-quantize gives it: the values and the ``quantize.imatrix.*`` metadata."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = 1
    if imatrix is not None:   # the arrays stay referenced (locals) until llama_model_quantize returns
        values, meta = read_imatrix(imatrix)
        entries = [llama_cpp.llama_model_imatrix_data(name.encode(), data.ctypes.data_as(
            ctypes.POINTER(ctypes.c_float)), data.size) for name, data in values.items()]
        entries.append(llama_cpp.llama_model_imatrix_data(None, None, 0))
        array = (llama_cpp.llama_model_imatrix_data * len(entries))(*entries)
        params.imatrix = ctypes.cast(array, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        kvs = kv_overrides(llama_cpp, [
            ("quantize.imatrix.file", os.path.basename(out)[:-len(".gguf")] + ".imatrix.gguf"),
            ("quantize.imatrix.dataset", meta["dataset"]),
            ("quantize.imatrix.entries_count", len(values)),
            ("quantize.imatrix.chunks_count", meta["chunks"])])
        params.kv_overrides = ctypes.cast(kvs, ctypes.POINTER(llama_cpp.llama_model_kv_override))
    rc = llama_cpp.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {src} -> {ftype} failed ({rc})")
    if imatrix is not None:
        shutil.copyfile(imatrix, out[:-len(".gguf")] + ".imatrix.gguf")


def llama_logits(path: str, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits at every prompt position (CPU, F32 KV cache)."""
    import llama_cpp

    llm = llama_cpp.Llama(path, n_ctx=64, n_batch=64, n_threads=1, logits_all=True, verbose=False,
                          type_k=0, type_v=0, n_gpu_layers=0)
    llm.eval(ids)
    out = np.array(llm.scores[:len(ids)], dtype=np.float32)
    llm.close()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", default=DEFAULT_LLAMA_CPP, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    parser.add_argument("--llama-imatrix", default=DEFAULT_LLAMA_IMATRIX,
                        help="llama.cpp's imatrix tool (llama-imatrix), built from that tree")
    parser.add_argument("--out", default="tests/data/gguf")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        made = []
        for shape, seed in (("float", 1), ("quant", 2), ("glm", 3)):
            hf = os.path.join(tmp, shape)
            write_checkpoint(hf, shape, seed)
            if shape == "glm":
                out = os.path.join(args.out, "tiny-glm-bf16.gguf")
                convert(args.llama_cpp, hf, out, "bf16", pre="glm4")
                made.append(out)
            elif shape == "float":
                for outtype in ("f32", "bf16"):
                    out = os.path.join(args.out, f"tiny-{outtype}.gguf")
                    convert(args.llama_cpp, hf, out, outtype)
                    made.append(out)
            else:
                f32 = os.path.join(tmp, "quant-f32.gguf")
                convert(args.llama_cpp, hf, f32, "f32")
                imatrix = compute_imatrix(args.llama_imatrix, f32, tmp)
                for ftype in FTYPES:
                    out = os.path.join(args.out, f"tiny-{ftype.lower()}.gguf")
                    quantize(f32, out, ftype, imatrix if ftype in NEEDS_IMATRIX else None)
                    made.append(out)
        from tokenizers import Tokenizer

        ids = [0] + Tokenizer.from_file(os.path.join(tmp, "float", "tokenizer.json")).encode(PROMPT).ids
        import llama_cpp

        probe_ids = {}
        for out in (made[0], made[-1]):   # the DeepSeek-V3 and the GLM-5 pre-tokenizers
            llm = llama_cpp.Llama(out, n_ctx=64, vocab_only=True, verbose=False)
            probe_ids[os.path.basename(out)[:-len(".gguf")]] = llm.tokenize(PROBE.encode(), add_bos=False,
                                                                            special=True)
        with open(os.path.join(args.out, "prompt.json"), "w") as f:
            json.dump({"text": PROMPT, "ids": ids, "probe": PROBE, "probe_llama_ids": probe_ids}, f,
                      ensure_ascii=False)
        for out in made:
            np.save(out[:-len(".gguf")] + ".llama_logits.npy", llama_logits(out, ids))
            print(f"{out}: {os.path.getsize(out)} bytes")


if __name__ == "__main__":
    main()

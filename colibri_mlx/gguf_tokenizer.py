"""The tokenizer of a GGUF model, built from its ``tokenizer.ggml.*`` metadata with ``tokenizers``.

llama.cpp's BPE vocabulary (``tokenizer.ggml.model = "gpt2"``) is byte-level BPE: ``tokens``
(GPT-2's byte-to-unicode alphabet), ``merges`` ("a b" pairs, by rank), ``token_type`` (1 normal,
3 control, 4 user-defined: the last two are added tokens, matched before the pre-tokenizer),
``bos_token_id`` / ``eos_token_id`` / ``eot_token_id``, ``add_bos_token``, and
``tokenizer.chat_template``. ``tokenizer.ggml.pre`` names the pre-tokenizer: the regex splits
llama.cpp applies for it (src/llama-vocab.cpp), then GPT-2's byte mapping.
"""

from __future__ import annotations

from .tokenizer import Tokenizer, TokenizerError, _compile_template

# tokenizer.ggml.pre -> llama.cpp's regex splits, applied in order (each isolates its matches).
PRE_TOKENIZERS = {
    "deepseek-v3": [
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
    "llama3": [
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
    # Kimi-K2's tiktoken pattern (its tokenization_kimi.py; llama.cpp hand-codes the same splits)
    "kimi-k2": ["|".join([
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])],
    "gpt2": [r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"],
}
PRE_TOKENIZERS["default"] = PRE_TOKENIZERS["gpt2"]
PRE_TOKENIZERS["glm4"] = PRE_TOKENIZERS["glm5"] = PRE_TOKENIZERS["llama3"]
# llama.cpp takes a word found whole in the vocabulary as one token (no merges), and adds no
# BOS, for these (its CHATGLM4 pre-tokenizer).
WHOLE_WORDS_NO_BOS = ("glm4", "glm5")
CONTROL, USER_DEFINED = 3, 4


def gguf_tokenizer(path) -> Tokenizer:
    """The :class:`tokenizer.Tokenizer` of the GGUF model at ``path`` (module docstring)."""
    from .models.gguf_checkpoint import GgufModel

    return tokenizer_from_metadata(GgufModel.open(path))


def tokenizer_from_metadata(model) -> Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    source = f"{model.path} (tokenizer.ggml.*)"
    kind = model.value("tokenizer.ggml.model")
    if kind is None:
        raise TokenizerError(f"{model.path}: no tokenizer in the GGUF metadata (tokenizer.ggml.model is missing)")
    if kind != "gpt2":
        raise TokenizerError(f"{model.path}: tokenizer.ggml.model is {kind!r}; colibri builds the byte-level BPE "
                             "('gpt2') tokenizer of DeepSeek-V3 and Kimi-K2 GGUF files")
    pre = model.value("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"{model.path}: tokenizer.ggml.pre is {pre!r}; colibri knows "
                             f"{', '.join(sorted(PRE_TOKENIZERS))}")
    tokens = model.value("tokenizer.ggml.tokens")
    merges = model.value("tokenizer.ggml.merges")
    if not tokens or merges is None:
        missing = "tokenizer.ggml.tokens" if not tokens else "tokenizer.ggml.merges"
        raise TokenizerError(f"{model.path}: {missing} is missing from the GGUF metadata")
    types = model.value("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise TokenizerError(f"{model.path}: tokenizer.ggml.token_type has {len(types)} entries for "
                             f"{len(tokens)} tokens")
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise TokenizerError(f"{model.path}: tokenizer.ggml.merges entry {m!r} is not two tokens")
        pairs.append((left, right))
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in WHOLE_WORDS_NO_BOS))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
             for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)]
    backend.add_tokens(added)
    config = {}
    bos, eos = model.value("tokenizer.ggml.bos_token_id"), model.value("tokenizer.ggml.eos_token_id")
    for key, i in (("bos_token", bos), ("eos_token", eos)):
        if i is not None:
            if not 0 <= int(i) < len(tokens):
                raise TokenizerError(f"{model.path}: tokenizer.ggml.{key}_id {i} is outside the {len(tokens)} tokens")
            config[key] = tokens[int(i)]
    if bos is not None and model.value("tokenizer.ggml.add_bos_token", False) and pre not in WHOLE_WORDS_NO_BOS:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{config['bos_token']} $A", pair=f"{config['bos_token']} $A $B",
            special_tokens=[(config["bos_token"], int(bos))])
    extra_eos = [int(i) for i in (eos, model.value("tokenizer.ggml.eot_token_id")) if i is not None]
    template = model.value("tokenizer.chat_template")
    template_source = f"{model.path} (tokenizer.chat_template)"
    if template:
        _compile_template(template, template_source)
    return Tokenizer(backend, config, template or None, extra_eos, template_source, source,
                     {i: source for i in extra_eos})

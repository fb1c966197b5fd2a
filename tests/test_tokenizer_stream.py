"""The streaming detokenizer's deltas concatenate to the full decode, for the byte-level
(windowed) decoder and for a SentencePiece-style Metaspace decoder (whole-reply decode)."""

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

import colibri_mlx
from colibri_mlx.tokenizer import Tokenizer

TEXT = "And God said, Let there be light:\nand there was light. \u00e9\u4e2d\U0001F600\n\n end\n"


def metaspace_tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "\u2581": 1, "\n": 2}
    for word in ("And", "God", "said,", "and", "there", "was", "light", "end"):
        vocab["\u2581" + word] = len(vocab)
        vocab[word] = len(vocab)
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return Tokenizer(backend, {}, None)


@pytest.fixture(scope="module")
def demo_tokenizer():
    return colibri_mlx.load()[1]


def stream(tok, ids):
    d = tok.detokenizer()
    return "".join(d.add(t) for t in ids) + d.flush(), d


def test_byte_level_windows_match_the_full_decode(demo_tokenizer):
    tok = demo_tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    out, d = stream(tok, ids)
    assert d.windowed and out == TEXT
    rng = random.Random(0)
    for _ in range(100):  # arbitrary ids: split UTF-8 sequences, stray newlines
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        assert stream(tok, ids)[0] == tok.decode(ids)


def test_metaspace_decoder_is_not_windowed():
    tok = metaspace_tokenizer()
    ids = [tok.backend.token_to_id(t) for t in ("\u2581And", "\n", "\u2581and", "\u2581there")]
    out, d = stream(tok, ids)
    assert not d.windowed and out == tok.decode(ids) == "And\n and there"

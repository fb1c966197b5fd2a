#!/usr/bin/env python3
"""Build the demo model's corpus and tokenizer from the King James Bible.

Source: Debian's ``bible-kjv-text`` (public domain text; read through the
``bible`` program of ``bible-kjv``). ``apt-get install -y bible-kjv``.

Each chapter becomes one document of plain prose: the verse references are
dropped and every verse is one line (so a newline, which the chat template puts
after each message, means "the next verse follows"). The last ``--heldout``
fraction of the text (whole chapters, end of the book) is held out for
perplexity.

Outputs in ``--out`` (default ``.demo-data/``):
  kjv_train.txt / kjv_heldout.txt  one verse per line, chapters separated by a blank line
  tokenizer/                       tokenizer.json, tokenizer_config.json
  train.npy / heldout.npy          uint16 token ids, every chapter as
                                   ``<|bos|> text <|eos|>``
  corpus.json                      counts and the source description
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# Chat templates are rendered and then encoded without special tokens, so the bos is explicit.
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
# "Ge1:1 In the beginning ..."; book abbreviations may start with a digit ("1Co").
VERSE_LINE = re.compile(r"^(?P<book>\d?[A-Za-z]+)(?P<chapter>\d+):(?P<verse>\d+) (?P<text>.*)$")
BIBLE_DATA = Path("/usr/lib/bible.data")


def read_kjv_verses() -> list[tuple[str, int, str]]:
    """Return (book, chapter, text) for every verse, Genesis 1:1 to Revelation 22:21."""
    if not BIBLE_DATA.exists():
        raise SystemExit(f"{BIBLE_DATA} not found: apt-get install -y bible-kjv bible-kjv-text")
    # -f turns pretty-printing off: one "Ref text" line per verse.
    raw = subprocess.run(
        ["bible", "-f", "Gen1:1-Rev22:21"], stdin=subprocess.DEVNULL,
        capture_output=True, text=True, check=True,
    ).stdout
    verses = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        m = VERSE_LINE.match(line)
        if m is None:
            raise SystemExit(f"bible output line {n} is not 'Ref text': {line[:80]!r}")
        verses.append((m["book"], int(m["chapter"]), m["text"].strip()))
    if len(verses) != 31102:
        raise SystemExit(f"expected the 31102 verses of the KJV, got {len(verses)}")
    return verses


def chapters_as_prose(verses: list[tuple[str, int, str]]) -> list[str]:
    chapters: list[list[str]] = []
    key = None
    for book, chapter, text in verses:
        if (book, chapter) != key:
            chapters.append([])
            key = (book, chapter)
        chapters[-1].append(text)
    return ["\n".join(re.sub(r"\s+", " ", v).strip() for v in c) for c in chapters]


def split_heldout(chapters: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """The last chapters holding at least `fraction` of the characters are held out."""
    total = sum(len(c) for c in chapters)
    held, cut = 0, len(chapters)
    while held < fraction * total:
        cut -= 1
        held += len(chapters[cut])
    return chapters[:cut], chapters[cut:]


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Encoding with special tokens prepends <|bos|>, as every training document starts with it.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": 1024, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok


def encode_documents(tok, docs: list[str]) -> np.ndarray:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += [bos, *enc.ids, eos]
    if tok.get_vocab_size() > 65535:
        raise SystemExit("vocabulary does not fit uint16")
    return np.asarray(ids, dtype=np.uint16)


def save_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(".demo-data"))
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--heldout", type=float, default=0.02)
    args = ap.parse_args()

    chapters = chapters_as_prose(read_kjv_verses())
    train, heldout = split_heldout(chapters, args.heldout)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kjv_train.txt").write_text("\n\n".join(train) + "\n")
    (args.out / "kjv_heldout.txt").write_text("\n\n".join(heldout) + "\n")

    tok = train_tokenizer(train, args.vocab_size, args.out / "tokenizer")
    train_ids, heldout_ids = encode_documents(tok, train), encode_documents(tok, heldout)
    save_npy(args.out / "train.npy", train_ids)
    save_npy(args.out / "heldout.npy", heldout_ids)
    summary = {
        "source": "Debian package bible-kjv-text (King James Version, 1611; public domain), "
                  "read with `bible -f Gen1:1-Rev22:21`",
        "chapters": len(chapters), "train_chapters": len(train), "heldout_chapters": len(heldout),
        "heldout_first_chapter": heldout[0][:60],
        "train_chars": sum(map(len, train)), "heldout_chars": sum(map(len, heldout)),
        "vocab_size": tok.get_vocab_size(),
        "train_tokens": int(train_ids.size), "heldout_tokens": int(heldout_ids.size),
        "bos_id": tok.token_to_id(BOS), "eos_id": tok.token_to_id(EOS), "pad_id": tok.token_to_id(PAD),
    }
    (args.out / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

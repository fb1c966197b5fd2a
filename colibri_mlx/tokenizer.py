"""The model directory's tokenizer: ``tokenizer.json`` (tokenizers) + ``tokenizer_config.json``
(special tokens, chat template), rendered like transformers' ``apply_chat_template``.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Iterable


class TokenizerError(ValueError):
    pass


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class Tokenizer:
    def __init__(self, backend, config: dict, chat_template: str | None, extra_eos: Iterable[int] = ()):
        self.backend = backend
        self.config = config
        self.chat_template = chat_template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        eos = set(int(i) for i in extra_eos)
        if self.eos_token is not None and backend.token_to_id(self.eos_token) is not None:
            eos.add(backend.token_to_id(self.eos_token))
        self.eos_token_ids = eos

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError("the tokenizer has no chat template (use a plain prompt / --no-chat-template)")
        return _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "", **{k: v for k, v in self.config.items() if k.endswith("_token")
                                              and k not in ("bos_token", "eos_token") and isinstance(v, str)})

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template writes the special tokens itself (transformers tokenizes it without them).
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def detokenizer(self) -> "StreamingDetokenizer":
        return StreamingDetokenizer(self)


class StreamingDetokenizer:
    """Text deltas for a growing token list; holds back a trailing incomplete UTF-8 sequence.

    With a byte-level decoder (this model family's tokenizers) only the tokens since the last
    newline are decoded: bytes after a newline decode the same on their own, and re-decoding the
    whole reply per token would make a long reply quadratic. Other decoders (SentencePiece's
    Metaspace drops the leading space of a decode's first token) re-decode the whole reply.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.line: list[int] = []
        self.emitted = 0  # characters of the current window's text already returned
        self.windowed = type(getattr(tokenizer.backend, "decoder", None)).__name__ == "ByteLevel"

    def add(self, token: int) -> str:
        self.line.append(int(token))
        text = self.tokenizer.decode(self.line)
        if text.endswith("\ufffd"):
            return ""
        delta = text[self.emitted:]
        if self.windowed and text.endswith("\n"):
            self.line, self.emitted = [], 0
        else:
            self.emitted = len(text)
        return delta

    def flush(self) -> str:
        text = self.tokenizer.decode(self.line)
        delta, self.emitted = text[self.emitted:], len(text)
        return delta


def _compile_template(source: str):
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a dependency
        raise TokenizerError("rendering the chat template needs jinja2 (pip install jinja2)") from e

    def raise_exception(message):
        raise TokenizerError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                   ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _chat_template(path: str, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        by_name = {t.get("name"): t.get("template") for t in template}
        template = by_name.get("default") or next(iter(by_name.values()), None)
    jinja_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    return template


def _eos_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def load_tokenizer(path) -> Tokenizer:
    path = os.fspath(path)
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise TokenizerError(f"{path}: no tokenizer.json in the model directory (copy the tokenizer files "
                             "from the original checkpoint)")
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_file(tokenizer_file)
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    extra_eos = _eos_ids(_read_json(os.path.join(path, "config.json")).get("eos_token_id"))
    extra_eos += _eos_ids(_read_json(os.path.join(path, "generation_config.json")).get("eos_token_id"))
    return Tokenizer(backend, config, _chat_template(path, config), extra_eos)

"""The model directory's tokenizer: ``tokenizer.json`` (tokenizers) + ``tokenizer_config.json``
(special tokens, chat template), rendered like transformers' ``apply_chat_template``.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from datetime import datetime
from typing import Iterable


class TokenizerError(ValueError):
    pass


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: str, root: str | None = None) -> dict:
    """The JSON object in ``path`` ({} when there is no such file); errors name the file."""
    if not os.path.lexists(path):
        return {}
    from .container.files import read_json_object

    return read_json_object(path, root, os.path.basename(path), error=TokenizerError)


class Tokenizer:
    """Text <-> token ids with the model directory's ``tokenizer.json``, and its chat template.

    ``chat_template`` is None when the directory has none (``tokenizer_config.json``'s
    ``chat_template`` or ``chat_template.jinja``); ``chat_template_source`` names the file it came
    from, for error messages.
    """

    def __init__(self, backend, config: dict, chat_template: str | None, extra_eos: Iterable[int] = (),
                 chat_template_source: str = "the chat template", source: str = "tokenizer.json"):
        self.backend = backend
        self.source = source
        self.config = config
        self.chat_template = chat_template
        self.chat_template_source = chat_template_source
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
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as e:  # the Rust side's errors (a WordLevel model without its unknown token, ...)
            raise TokenizerError(f"{self.source}: cannot encode the text: {' '.join(str(e).split())[:200]}") \
                from None

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        try:
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except Exception as e:
            raise TokenizerError(f"{self.source}: cannot decode token ids: {' '.join(str(e).split())[:200]}") \
                from None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the chat template, as transformers renders it."""
        if not self.chat_template:
            raise TokenizerError("the tokenizer has no chat template (use a plain prompt / --no-chat-template)")
        template = _compile_template(self.chat_template, self.chat_template_source)
        extra = {k: v for k, v in self.config.items() if k.endswith("_token") and k not in ("bos_token", "eos_token")
                 and isinstance(v, str)}
        _render_state.left = RENDER_BUDGET
        try:
            text = template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except TokenizerError:
            raise
        except RecursionError:
            raise TokenizerError(f"{self.chat_template_source}: the chat template recurses without end") from None
        except Exception as e:  # jinja2's UndefinedError, SecurityError, TypeError from a filter, ...
            raise TokenizerError(f"{self.chat_template_source}: the chat template failed to render: "
                                 f"{_template_error(e)}") from None
        if not isinstance(text, str):
            raise TokenizerError(f"{self.chat_template_source}: the chat template rendered no text")
        return text

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


RENDER_BUDGET = 10_000_000  # range elements and repeated characters one render may make
_render_state = threading.local()


def _spend(n: int) -> None:
    from jinja2.exceptions import SecurityError

    left = getattr(_render_state, "left", RENDER_BUDGET) - max(int(n), 0)
    _render_state.left = left
    if left < 0:
        raise SecurityError(f"the template builds more than {RENDER_BUDGET} range elements or characters "
                            "in one render (a runaway loop?)")


def _template_error(e: BaseException) -> str:
    """jinja2's error in one line: its type for the user (``undefined variable``), the message."""
    name = type(e).__name__
    words = {"UndefinedError": "undefined variable", "SecurityError": "unsafe operation refused by the sandbox",
             "TemplateSyntaxError": "syntax error"}.get(name, name)
    line = getattr(e, "lineno", None)
    where = f" at line {line}" if line else ""
    return f"{words}{where}: {e}"


def _compile_template(source: str, origin: str = "the chat template"):
    """The compiled template (cached per source); a syntax error names ``origin``, the file."""
    try:
        return _compile_cached(source, origin)
    except TokenizerError:
        raise
    except RecursionError:
        raise TokenizerError(f"{origin}: the chat template is nested too deeply to compile") from None
    except Exception as e:  # TemplateSyntaxError, TemplateAssertionError, ...
        raise TokenizerError(f"{origin}: the chat template does not compile: {_template_error(e)}") from None


@functools.lru_cache(maxsize=8)
def _compile_cached(source: str, origin: str):
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a dependency
        raise TokenizerError("rendering the chat template needs jinja2 (pip install jinja2)") from e

    from jinja2.exceptions import SecurityError

    def raise_exception(message):
        raise TokenizerError(f"{origin}: the chat template raised an error: {message}")

    class Environment(ImmutableSandboxedEnvironment):
        """The sandbox, with a budget on what one render can build: nested ``range`` loops and
        ``'x' * n`` would otherwise run for hours or fill the memory (no hang on a bad template)."""

        intercepted_binops = frozenset(("*", "**"))

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
                raise SecurityError(f"exponent {right} is too large")
            if operator == "*":
                size = (len(left) * right if isinstance(left, (str, list, tuple)) and isinstance(right, int) else
                        len(right) * left if isinstance(right, (str, list, tuple)) and isinstance(left, int) else 0)
                _spend(size)
            return super().call_binop(context, operator, left, right)

    def budgeted_range(*args):
        r = range(*args)
        _spend(len(r))
        return r

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["range"] = budgeted_range
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                   ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _chat_template(path: str, config: dict) -> tuple[str | None, str]:
    """``(template or None, the file it comes from)``."""
    config_file = os.path.join(path, "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in template):
            raise TokenizerError(f"{config_file}: chat_template: expected a string or a list of "
                                 '{"name": ..., "template": "..."} objects')
        by_name = {t.get("name"): t["template"] for t in template}
        template = by_name.get("default") or next(iter(by_name.values()), None)
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{config_file}: chat_template: expected a string, got {type(template).__name__}")
    if template is not None:
        return template, config_file
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.lexists(jinja_file):
        from .container.files import read_text

        try:
            return read_text(jinja_file, path, "chat_template.jinja"), jinja_file
        except ValueError as e:
            raise TokenizerError(str(e)) from None
    return None, config_file


def _eos_ids(value, source: str) -> list[int]:
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids):
        raise TokenizerError(f"{source}: eos_token_id: expected a token id (an integer >= 0) or a list of them, "
                             f"got {json.dumps(value)[:60]}")
    return list(ids)


def _check_special_tokens(config: dict, source: str) -> None:
    for key in ("bos_token", "eos_token"):
        value = config.get(key)
        if value is None or isinstance(value, str):
            continue
        if isinstance(value, dict) and isinstance(value.get("content"), str):
            continue
        raise TokenizerError(f"{source}: {key}: expected a string or an object with a string \"content\", got "
                             f"{json.dumps(value)[:60]}")


def _backend(tokenizer_file: str, root: str):
    """The ``tokenizers`` object of tokenizer.json; a corrupt file is a TokenizerError naming it."""
    from tokenizers import Tokenizer as Backend

    from .container.files import MAX_TOKENIZER_BYTES, read_text

    try:
        text = read_text(tokenizer_file, root, "tokenizer.json", limit=MAX_TOKENIZER_BYTES)
    except ValueError as e:
        raise TokenizerError(str(e)) from None
    try:
        return Backend.from_str(text)
    except Exception as e:  # the Rust parser's errors are plain Exceptions
        detail = " ".join(str(e).split())[:200]
        empty = "the file is empty" if not text.strip() else detail
        raise TokenizerError(f"{tokenizer_file}: not a valid tokenizer.json ({empty}); copy tokenizer.json "
                             "from the original checkpoint") from None


def load_tokenizer(path) -> Tokenizer:
    """The tokenizer of a model directory: ``tokenizer.json``, ``tokenizer_config.json`` (special
    tokens, chat template) or ``chat_template.jinja``, and the end-of-sequence ids of
    ``config.json`` / ``generation_config.json``. Every file is checked as the model's shards are
    (a regular file inside the directory); a corrupt one is a TokenizerError naming it. The
    chat template is compiled here, so that a syntax error shows before the model loads."""
    path = os.fspath(path)
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.lexists(tokenizer_file):
        raise TokenizerError(f"{path}: no tokenizer.json in the model directory (copy the tokenizer files "
                             "from the original checkpoint)")
    backend = _backend(tokenizer_file, path)
    config_file = os.path.join(path, "tokenizer_config.json")
    config = _read_json(config_file, path)
    _check_special_tokens(config, config_file)
    extra_eos = []
    for name in ("config.json", "generation_config.json"):
        source = os.path.join(path, name)
        extra_eos += _eos_ids(_read_json(source, path).get("eos_token_id"), source)
    template, template_source = _chat_template(path, config)
    if template:
        _compile_template(template, template_source)
    return Tokenizer(backend, config, template, extra_eos, template_source, tokenizer_file)

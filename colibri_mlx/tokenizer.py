"""The model directory's tokenizer: ``tokenizer.json`` (tokenizers) + ``tokenizer_config.json``
(special tokens, chat template), rendered like transformers' ``apply_chat_template``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import time
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
                 chat_template_source: str = "the chat template", source: str = "tokenizer.json",
                 eos_sources: dict | None = None):
        self.backend = backend
        self.eos_sources = dict(eos_sources or {})  # end-of-sequence id -> the file that names it
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

    def check_vocab(self, vocab_size: int, config_file: str = "config.json") -> None:
        """TokenizerError unless every token id of tokenizer.json and every end-of-sequence id is
        below the model's ``vocab_size`` (an id past it has no embedding and no logit)."""
        top = max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1)
        if top >= vocab_size:
            raise TokenizerError(f"{self.source}: has token id {top}, outside the model's vocabulary (vocab_size="
                                 f"{vocab_size} in {config_file}): the tokenizer does not belong to this model")
        for i in sorted(self.eos_token_ids):
            if i >= vocab_size:
                raise TokenizerError(f"{self.eos_sources.get(i, self.source)}: eos_token_id {i} is outside the model's "
                                     f"vocabulary (vocab_size={vocab_size} in {config_file})")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as e:  # the Rust side's errors (a WordLevel model without its unknown token, ...)
            raise TokenizerError(f"{self.source}: cannot encode the text: {' '.join(str(e).split())[:200]}") \
                from None

    def encode_bounded(self, text: str, limit: int, add_special_tokens: bool = True) -> tuple[list[int], bool]:
        """``(ids, complete)``: ``encode(text)``, or, for a text far longer than ``limit`` tokens can
        hold, the ids of a prefix that already encodes to more than ``limit`` (``complete`` False):
        a 10 MB prompt for a 4096-token context is refused in milliseconds, not encoded for a minute."""
        prefix_chars = 64 * (limit + 64)
        if len(text) > 2 * prefix_chars:
            ids = self.encode(text[:prefix_chars], add_special_tokens)
            if len(ids) > limit + 16:  # the margin: the cut may split the prefix's last word differently
                return ids, False
        return self.encode(text, add_special_tokens), True

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        try:
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except Exception as e:
            raise TokenizerError(f"{self.source}: cannot decode token ids: {' '.join(str(e).split())[:200]}") \
                from None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The conversation rendered by the chat template, as transformers renders it (``tools``:
        OpenAI's function list, passed to the template as ``tools`` when given)."""
        if not self.chat_template:
            raise TokenizerError("the tokenizer has no chat template (use a plain prompt / --no-chat-template)")
        template = _compile_template(self.chat_template, self.chat_template_source)
        extra = {k: v for k, v in self.config.items() if k.endswith("_token") and k not in ("bos_token", "eos_token")
                 and isinstance(v, str)}
        if tools is not None:
            extra["tools"] = tools
        _render_state.left, _render_state.iterations = RENDER_BUDGET, RENDER_ITERATIONS
        _render_state.max_chars = RENDER_BUDGET + 2 * _content_chars(messages)
        _render_state.deadline = time.monotonic() + RENDER_SECONDS
        try:
            parts, size = [], 0
            for part in template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                          bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra):
                parts.append(part)
                size += len(part)
                _check_size(size, "text")
                _iterate(1)  # an output chunk costs as much as a loop iteration
            text = "".join(parts)
        except TokenizerError:
            raise
        except RecursionError:
            raise TokenizerError(f"{self.chat_template_source}: the chat template recurses without end") from None
        except Exception as e:  # jinja2's UndefinedError, SecurityError, TypeError from a filter, ...
            raise TokenizerError(f"{self.chat_template_source}: the chat template failed to render: "
                                 f"{_template_error(e)}") from None
        if not isinstance(text, str) or (not text and any(_content_chars([m]) for m in messages)):
            raise TokenizerError(f"{self.chat_template_source}: the chat template rendered no text for a "
                                 "conversation with text (it drops the messages)")
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


# What one render may cost: range elements and repeated characters (a runaway range or 'x' * n);
# loop iterations and output chunks (a runaway loop: about a second of jinja2 at this count); and
# the longest string it may build: RENDER_BUDGET characters plus twice the conversation's text
# (padding to a width of 10**9, a string doubled in a loop, the output).
RENDER_BUDGET = 10_000_000
RENDER_ITERATIONS = 1_000_000
# What one render may last: a loop of operations that build nothing but each scan a long string
# (``x|upper``, ``'a' in x`` over a string of the longest size) costs time the budgets above do
# not see; every loop iteration and output chunk checks the clock (a render takes milliseconds).
RENDER_SECONDS = 10.0
_render_state = threading.local()


def _iterate(n: int) -> None:
    from jinja2.exceptions import SecurityError

    left = getattr(_render_state, "iterations", RENDER_ITERATIONS) - n
    _render_state.iterations = left
    if left < 0:
        raise SecurityError(f"the template runs more than {RENDER_ITERATIONS} loop iterations in one render "
                            "(a runaway loop?)")
    _check_deadline()


def _check_deadline() -> None:
    from jinja2.exceptions import SecurityError

    if time.monotonic() > getattr(_render_state, "deadline", float("inf")):
        raise SecurityError(f"the template runs for more than {RENDER_SECONDS:g} s in one render (a runaway loop?)")


def _spend(n: int) -> None:
    from jinja2.exceptions import SecurityError

    left = getattr(_render_state, "left", RENDER_BUDGET) - max(int(n), 0)
    _render_state.left = left
    if left < 0:
        raise SecurityError(f"the template builds more than {RENDER_BUDGET} range elements or characters "
                            "in one render (a runaway loop?)")


def _max_chars() -> int:
    return getattr(_render_state, "max_chars", RENDER_BUDGET)


def _check_size(n: int, what: str = "string") -> None:
    """Refuse a string (or list) of ``n`` items over :func:`_max_chars`, before or after it is built."""
    from jinja2.exceptions import SecurityError

    if n > _max_chars():
        raise SecurityError(f"the template builds a {what} of more than {_max_chars()} characters in one "
                            "render (a runaway loop or width?)")


def _grow(s: str, growth: int, op: str) -> None:
    """``op`` makes ``s`` ``growth`` characters longer: refused over the cap, charged to the budget."""
    _check_size(len(s) + growth, f"string ({op})")
    _spend(growth)


def _check_value(value):
    if isinstance(value, (str, list, tuple)):
        _check_size(len(value))
    return value


def _check_widths(args, kwargs) -> None:
    """Widths and counts given to a padding filter or str method: refuse one past the cap before
    Python allocates it (``'x'|center(10**9)``, ``'x'.ljust(10**9)``, ``batch(10**9, 'x')``)."""
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool):
            _check_size(abs(v), "width")


def _check_format(fmt) -> None:
    """The widths and precisions of a %- or {}-format string (``'%0999999999d' % 1``)."""
    import re

    if not isinstance(fmt, str):
        return
    specs = [m.group(1) for m in re.finditer(r"%[-#0 +]*(\d*(?:\.\d+)?)[a-zA-Z%]", fmt)]
    specs += [m.group(1) for m in re.finditer(r"\{[^{}:]*:([^{}]*)\}", fmt)]
    for spec in specs:
        for digits in re.findall(r"\d+", spec):
            _check_size(int(digits), "width")


# A format string repeats its arguments: ``('{0}' * 1000).format(big)``, ``('%s' * 1000) % ((big,) * 1000)``,
# ``'%99999s' * 1000``. Its result's size is bounded before it is built: for each replacement field
# or conversion specifier, the longest argument's text (repr's up to 10 characters a character) plus
# the field's width and precision (and 330 digits of a float), plus the format string itself.
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?([-#0 +]*(\*|\d*)(?:\.(\*|\d*))?)[hlL]?([a-zA-Z%])")


def _text_len(v, conversion: str = "s") -> int:
    """``len(str(v))`` (``repr``/``ascii`` bounded by 10 characters a character), a container's
    lower bound (its strings' lengths, an item a character) checked against the cap first."""
    if not isinstance(v, str):
        stack, low = [v], 0
        while stack:
            x = stack.pop()
            if isinstance(x, str):
                low += len(x)
            elif isinstance(x, (list, tuple, set, frozenset, dict)):
                _iterate(len(x))
                low += len(x)
                stack.extend(x.items() if isinstance(x, dict) else x)
            _check_size(low, "string (a format)")
        try:
            v = str(v)
        except Exception:  # noqa: BLE001 (formatting it fails the same way, if a field takes it)
            return 0
    return len(v) * 10 + 2 if conversion in ("r", "a") else len(v)


def _spec_size(spec: str) -> int:
    return sum(int(d) for d in re.findall(r"\d+", spec))


def _check_formatted(fmt: str, fields: list, values, widths=()) -> None:
    """``fields``: (conversion, format spec, nested fields) of each field; ``values``: what a field
    may take (each one's text measured once); ``widths``: integers a nested or ``*`` width may take."""
    if not fields:
        return
    longest = {}
    for conv, _, _ in fields:
        if conv not in longest:
            longest[conv] = max((_text_len(v, conv) for v in values), default=0)
    wide = 0
    if any(nested for _, _, nested in fields):
        wide = max((abs(w) for w in widths if isinstance(w, int) and not isinstance(w, bool)), default=0)
        _check_size(wide, "width")
    total = len(fmt) + sum(longest[conv] + _spec_size(spec) + 330 + nested * wide
                           for conv, spec, nested in fields)
    _check_size(total, "string (a format)")
    _spend(total - len(fmt))


def _guard_str_format(fmt, args, kwargs) -> None:
    """``fmt.format(*args, **kwargs)``: each replacement field may take any argument."""
    import string

    if not isinstance(fmt, str):
        return
    fields = []
    for _, name, spec, conv in string.Formatter().parse(fmt):
        if name is not None:
            fields.append((conv or "s", spec or "", (spec or "").count("{")))
    values = list(args) + list(kwargs.values())
    _check_formatted(fmt, fields, values, values)


def _guard_percent(fmt, values) -> None:
    """``fmt % values``: each conversion specifier may take the tuple's items, the mapping's values
    or the value itself."""
    if not isinstance(fmt, str):
        return
    fields = [(m.group(4), m.group(1), m.group(1).count("*")) for m in _PERCENT_SPEC.finditer(fmt)
              if m.group(4) != "%"]
    items = list(values) if isinstance(values, tuple) else [values]
    if isinstance(values, dict):
        items += list(values.values())
    _check_formatted(fmt, fields, items, items)


def _guard_wordwrap(s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    """A wrapstring between each of at most ``len(s)`` lines."""
    if isinstance(s, str) and isinstance(wrapstring, str):
        growth = len(s) * len(wrapstring)
        _grow(s, growth, "a wordwrap")


# Filters whose integer arguments are widths or counts of what they build.
_WIDTH_FILTERS = frozenset(("center", "indent", "batch", "slice", "wordwrap", "truncate"))
# str methods whose integer arguments are widths (str.format's are values: not these).
_WIDTH_METHODS = frozenset(("center", "ljust", "rjust", "zfill", "expandtabs"))


def _content_chars(messages) -> int:
    total = 0
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict)
                         and isinstance(p.get("text"), str))
    return total


def _budgeted_iter(iterable):
    """What a ``{% for %}`` loops over, with its iterations charged to the render budget."""
    try:
        n = len(iterable)
    except TypeError:
        return _charged(iterable)
    _iterate(n)
    return _timed(iterable)


def _charged(iterable):
    for item in iterable:
        _iterate(1)
        yield item


def _timed(iterable):
    """The items of a loop charged before it started, each checking the render's deadline."""
    for item in iterable:
        _check_deadline()
        yield item


def _budgeted_concat(*parts) -> str:
    """``a ~ b``: its result checked against the size cap (a string doubled in a loop)."""
    _check_size(sum(len(p) if isinstance(p, str) else 0 for p in parts))
    text = "".join(map(str, parts))
    _check_size(len(text))
    return text


# Filters and str methods whose result can be far larger than their value and arguments (a long
# replacement for each of many matches, a long separator between many items, a wide indent of many
# lines, a sum of lists): the result's size is predicted from the arguments and refused before it is
# built, and what it adds is charged to the render budget (a loop of them); the items of a join or a
# sum are charged as loop iterations; pprint and list charge what they walk.
def _items(value) -> list:
    """The items of an iterable, charged as loop iterations (before, where it has a length)."""
    try:
        _iterate(len(value))
    except TypeError:
        return [item for item in _charged(value)]
    return list(value)


def _guard_replace(s, old, new, count=-1):
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        n = s.count(old)
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            n = min(n, count)
        growth = n * (len(new) - len(old))
        _grow(s, growth, "a replace")


def _joined_items(sep, value) -> list:
    """The items of ``sep.join(value)``, taken one by one (each a loop iteration) while its size,
    ``len(sep) * (n - 1)`` plus the items' text, is checked; what the separators add is charged."""
    sep = sep if isinstance(sep, str) else str(sep)
    items, total = [], -len(sep)
    for item in _charged(value):
        items.append(item)
        total += len(sep) + (len(item) if isinstance(item, str) else len(str(item)))
        _check_size(total, "string (a join)")
    _spend(len(sep) * max(len(items) - 1, 0))
    return items


def _line_breaks(s: str) -> int:
    """An upper bound on the line breaks ``str.splitlines`` finds (no list of the lines built)."""
    return sum(s.count(c) for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")


def _guard_indent(s, width=4, first=False, blank=False):
    if not isinstance(s, str):
        return
    pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    growth = max(pad, 0) * (_line_breaks(s) + 2)
    _grow(s, growth, "an indent")


def _guard_expandtabs(s, tabsize=8):
    if isinstance(s, str) and isinstance(tabsize, int):
        growth = max(tabsize, 0) * s.count("\t")
        _grow(s, growth, "an expandtabs")


def _guard_pprint(value) -> None:
    """``pprint`` reprs each container once per level above it (and wraps long strings word by
    word): its nodes, weighted by depth, are charged as loop iterations before it runs."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            _iterate(len(v) // 4 * depth)
            _spend(len(v))
        elif isinstance(v, (list, tuple, set, frozenset, dict)):
            _iterate(len(v) * depth)
            _spend(len(v))
            stack.extend((x, depth + 1) for x in (v.items() if isinstance(v, dict) else v))


_NUMBERS = (int, float)


def _budgeted_list(call, env, value):
    try:
        _spend(len(value))
    except TypeError:
        out = call(value)
        _spend(len(out))
        return out
    return call(value)


def _budgeted_join(call, env, value, d="", attribute=None):
    if attribute is not None:
        from jinja2.filters import make_attrgetter

        value = map(make_attrgetter(env, attribute), value)
    return call(_joined_items(d, value), d)


def _budgeted_sum(call, env, iterable, attribute=None, start=0):
    """``sum``: of numbers as jinja2 sums them; of lists or tuples (each ``+`` a copy of all so
    far: quadratic) its size checked first and built in one pass; of anything else the copies
    charged to the budget."""
    items = _items(iterable)
    if attribute is not None:
        from jinja2.filters import make_attrgetter

        items = list(map(make_attrgetter(env, attribute), items))
    if isinstance(start, _NUMBERS) and all(isinstance(x, _NUMBERS) for x in items):
        return call(items, start=start)
    sized = [start] + items
    if not all(isinstance(x, (str, list, tuple)) for x in sized):
        return call(items, start=start)  # a TypeError (dicts, None...)
    total = sum(len(x) for x in sized)
    _check_size(total, "list (a sum)")
    _spend(total)
    for kind in (list, tuple):
        if all(type(x) is kind for x in sized):
            out = []
            for x in sized:
                out.extend(x)
            return kind(out)
    copies, so_far = 0, 0
    for x in sized:
        so_far += len(x)
        copies += so_far
    _spend(copies)
    return call(items, start=start)


# Checked before the filter runs (its value and arguments); run instead of the filter (given it).
_FILTER_GUARDS = {"replace": _guard_replace, "indent": _guard_indent, "pprint": _guard_pprint,
                  "wordwrap": _guard_wordwrap}
_FILTER_WRAPPERS = {"join": _budgeted_join, "sum": _budgeted_sum, "list": _budgeted_list}


def _budgeted_filter(name: str, f):
    """A jinja2 filter with its widths checked first and its result's size after (and, for those
    of ``_FILTER_GUARDS`` / ``_FILTER_WRAPPERS``, the result's size predicted before it is built)."""
    import functools

    guard, wrap = _FILTER_GUARDS.get(name), _FILTER_WRAPPERS.get(name)

    def run(first, value, args, kwargs):  # first: () or (the context, eval context or environment,)
        _check_deadline()
        if name in _WIDTH_FILTERS:
            _check_widths(args, kwargs)
        elif name == "format":
            _check_format(value)
            _guard_percent(value, kwargs or args)
        if guard is not None:
            guard(value, *args, **kwargs)
        if wrap is not None:
            env = getattr(first[0], "environment", first[0]) if first else None
            return _check_value(wrap(lambda v, *a, **k: f(*first, v, *a, **k), env, value, *args, **kwargs))
        return _check_value(f(*first, value, *args, **kwargs))

    if getattr(f, "jinja_pass_arg", None) is not None:  # context/eval-context filters: the value comes second
        @functools.wraps(f)
        def passing(first, value, *args, **kwargs):
            return run((first,), value, args, kwargs)
        return passing

    @functools.wraps(f)
    def plain(value, *args, **kwargs):
        return run((), value, args, kwargs)
    return plain


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

    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    class Budget(NodeTransformer):
        """Every ``{% for %}`` loops through ``_budgeted_iter`` and every ``~`` is ``_budgeted_concat``."""

        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = nodes.Call(nodes.Name("_colibri_iter", "load"), [node.iter], [], None, None,
                                   lineno=node.lineno)
            return node

        def visit_Concat(self, node):
            node = self.generic_visit(node)
            return nodes.Call(nodes.Name("_colibri_concat", "load"), node.nodes, [], None, None, lineno=node.lineno)

    class Environment(ImmutableSandboxedEnvironment):
        """The sandbox, with a budget on what one render can do: loops (nested ``range`` loops,
        loops over ``[1] * 100`` four deep), ``'x' * n``, ``'%09999999d' % 1``, padding filters and
        str methods (``center``, ``indent``, ``format``, ``ljust``...), a string doubled in a loop,
        the output itself: each would otherwise run for hours or fill the memory (no hang on a bad
        template)."""

        intercepted_binops = frozenset(("*", "**", "%", "+"))

        def _parse(self, source, name, filename):
            tree = Budget().visit(super()._parse(source, name, filename))
            tree.set_environment(self)
            return tree

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
                raise SecurityError(f"exponent {right} is too large")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                    left.bit_length() * abs(right) > 1 << 20:
                raise SecurityError(f"{left} ** {right} is too large a number")
            if operator == "*":
                size = (len(left) * right if isinstance(left, (str, list, tuple)) and isinstance(right, int) else
                        len(right) * left if isinstance(right, (str, list, tuple)) and isinstance(left, int) else 0)
                _spend(size)
                _check_size(size)
            if operator == "%" and isinstance(left, str):
                _check_format(left)
                _guard_percent(left, right)
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _check_size(len(left) + len(right))
            return _check_value(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
            s, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
            _check_deadline()
            if isinstance(s, str):
                given = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}  # jinja2's own
                if name in _WIDTH_METHODS:
                    _check_widths(args, given)
                if name == "replace":
                    _guard_replace(s, *args, **given)
                elif name == "expandtabs":
                    _guard_expandtabs(s, *args, **given)
                elif name == "join" and len(args) == 1 and not given:
                    args = (_joined_items(s, args[0]),)
                elif name == "translate" and len(args) == 1 and isinstance(args[0], dict):
                    longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
                    _check_size(len(s) * max(longest, 1), "string (a translate)")
            return _check_value(super().call(__context, __obj, *args, **kwargs))

        def wrap_str_format(self, value):
            fmt = super().wrap_str_format(value)
            if fmt is None:
                return None
            _check_format(value.__self__)
            is_map = getattr(value, "__name__", "") == "format_map"

            def checked(*args, **kwargs):
                if is_map and len(args) == 1 and isinstance(args[0], dict):
                    _guard_str_format(value.__self__, list(args[0].values()), {})
                elif not is_map:
                    _guard_str_format(value.__self__, args, kwargs)
                return _check_value(fmt(*args, **kwargs))
            return checked

    def budgeted_range(*args):
        r = range(*args)
        _spend(len(r))
        return r

    def tojson(x, indent=None, ensure_ascii=False):
        if isinstance(indent, int) and indent > 0:
            _check_size(indent * len(json.dumps(x, ensure_ascii=ensure_ascii)), "JSON text")
        return json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters = {name: _budgeted_filter(name, f) for name, f in env.filters.items()}
    env.globals["range"] = budgeted_range
    env.globals["lipsum"] = lambda n=5, *args, **kwargs: ""  # 10**9 paragraphs of filler: not in a chat prompt
    env.globals["_colibri_iter"] = _budgeted_iter
    env.globals["_colibri_concat"] = _budgeted_concat
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _chat_template(path: str, config: dict) -> tuple[str | None, str]:
    """``(template or None, the file it comes from)``."""
    config_file = os.path.join(path, "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        if not template or not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in template):
            raise TokenizerError(f"{config_file}: chat_template: expected a string or a list of "
                                 '{"name": ..., "template": "..."} objects' + (", got an empty list" if not template
                                                                              else ""))
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


def _check_special_tokens_known(backend, config: dict, source: str, tokenizer_file: str) -> None:
    """bos_token / eos_token must be tokens of tokenizer.json: a template would write an unknown
    one as plain text, and generation could never stop at an unknown end token."""
    for key in ("bos_token", "eos_token"):
        text = _token_text(config.get(key))
        if text and backend.token_to_id(text) is None:
            raise TokenizerError(f"{source}: {key}: {text!r} is not a token of {tokenizer_file} (the tokenizer "
                                 "files of two different models?)")


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
    from .models.gguf_checkpoint import is_gguf_path

    if is_gguf_path(path):
        from .gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(path)
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.lexists(tokenizer_file):
        raise TokenizerError(f"{path}: no tokenizer.json in the model directory (copy the tokenizer files "
                             "from the original checkpoint)")
    backend = _backend(tokenizer_file, path)
    config_file = os.path.join(path, "tokenizer_config.json")
    config = _read_json(config_file, path)
    _check_special_tokens(config, config_file)
    _check_special_tokens_known(backend, config, config_file, tokenizer_file)
    extra_eos, eos_sources = [], {}
    for name in ("config.json", "generation_config.json"):
        source = os.path.join(path, name)
        ids = _eos_ids(_read_json(source, path).get("eos_token_id"), source)
        extra_eos += ids
        for i in ids:
            eos_sources.setdefault(i, source)
    template, template_source = _chat_template(path, config)
    if template:
        _compile_template(template, template_source)
    return Tokenizer(backend, config, template, extra_eos, template_source, tokenizer_file, eos_sources)

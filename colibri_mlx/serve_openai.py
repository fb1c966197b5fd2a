"""The OpenAI side of ``colibri serve``: request bodies checked into :class:`CompletionRequest`,
engine events turned into text (stop strings, tool calls, log-probabilities), and the response
shapes. The HTTP layer is :mod:`colibri_mlx.serve`; the engine seam :mod:`colibri_mlx.serve_engine`.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Iterator, Optional

from . import __version__
from .generate import SamplingParams
from .serve_engine import MAX_TOP_LOGPROBS
from .serve_tools import HeldBackText, ToolCallFilter
from .speculative import DEFAULT_NUM_DRAFT, DRAFT_KINDS, MAX_NUM_DRAFT

MAX_JSON_DEPTH = 64
SEED_LIMIT = 1 << 64
MAX_STOP_STRINGS = 32     # OpenAI takes 4
MAX_STOP_CHARS = 1000


class RequestError(ValueError):
    """A bad request: answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = HTTPStatus.BAD_REQUEST,
                 code: Optional[str] = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(message: str, status: int, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    kind = "server_error" if status in (500, 502, 503, 504) else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class SamplingDefaults(SamplingParams):
    """Server-wide defaults (the command line); each request may override them."""

    max_tokens: int = 256
    draft: Optional[str] = None   # speculative decoding (docs/speculative.md); None: the model's default
    num_draft: int = DEFAULT_NUM_DRAFT


@dataclass
class CompletionRequest:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    logprobs: Optional[int] = None       # top alternatives per token; 0: the chosen token's only; None: off
    include_usage: bool = False          # stream_options.include_usage
    tools: Optional[list] = None         # parse tool calls from the output (chat, tool_choice != "none")
    engine_extras: dict = field(default_factory=dict)  # draft / num_draft when the request names them


# --- request parsing -----------------------------------------------------------------------

def check_json_value(body) -> None:
    """Refuse what the tokenizer and the template cannot take: a string with a lone surrogate
    (valid JSON, ``"\\ud800"``, but not UTF-8) and nesting deeper than ``MAX_JSON_DEPTH``."""
    stack = [(body, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError("the request body has a string with a lone UTF-16 surrogate "
                                   f"({value.encode('utf-8', 'backslashreplace')[:40]!r}...)") from None
        elif isinstance(value, dict):
            stack.extend((k, depth + 1) for k in value)
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, (str, dict, list)))
        elif isinstance(value, list):  # (a prompt of token ids: numbers are not pushed)
            stack.extend((v, depth + 1) for v in value if isinstance(v, (str, dict, list)))


def _field(body: dict, name: str, types, default, check=None, what=None):
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int subclass: `"max_tokens": true` must not pass as 1.
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise RequestError(f"'{name}' must be {what or ' or '.join(t.__name__ for t in types)}, "
                           f"got {json.dumps(value)}", name)
    if check is not None and not check(value):
        raise RequestError(f"'{name}' must be {what}, got {json.dumps(value)}", name)
    return value


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"'stop' must be a non-empty string or a list of them, got {json.dumps(stop)[:200]}",
                           "stop")
    # Every token is searched for every stop string (and its tail for their prefixes): a million of
    # them made each token take seconds of the GIL, slowing every other request.
    if len(stops) > MAX_STOP_STRINGS or max(map(len, stops)) > MAX_STOP_CHARS:
        raise RequestError(f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                           f"characters each, got {len(stops)} of up to {max(map(len, stops))}", "stop")
    return stops


def _logit_bias(body: dict, vocab: int) -> Optional[tuple]:
    bias = body.get("logit_bias")
    if bias is None:
        return None
    what = f"an object of token id (0..{vocab - 1}) -> number in [-100, 100]"
    if not isinstance(bias, dict):
        raise RequestError(f"'logit_bias' must be {what}", "logit_bias")
    pairs = []
    for k, v in bias.items():
        # ASCII digits, few: int() takes "٣" too, and raises past 4300 digits
        token_ok = k.isascii() and k.isdigit() and len(k) < 20 and int(k) < vocab
        if not token_ok or isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise RequestError(f"'logit_bias' must be {what}, got {json.dumps({k: v})[:200]}", "logit_bias")
        pairs.append((int(k), float(v)))
    return tuple(pairs) or None


def _logprobs(body: dict, chat: bool) -> Optional[int]:
    """The number of top alternatives per token (chat: ``top_logprobs``; completions: ``logprobs``)."""
    def count(name: str) -> Optional[int]:
        return _field(body, name, (int,), None, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                      f"an integer in 0..{MAX_TOP_LOGPROBS}")

    if not chat:
        return count("logprobs")
    on = _field(body, "logprobs", (bool,), False)
    top = count("top_logprobs")
    if top is not None and not on:
        raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


def _response_format(body: dict) -> None:
    fmt = body.get("response_format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind in ("json_object", "json_schema"):
        raise RequestError(f"response_format {kind!r} is not supported: this server has no constrained "
                           "decoding (ask for JSON in the prompt and parse the text)", "response_format")
    raise RequestError(f"'response_format' must be {{\"type\": \"text\"}}, got {json.dumps(fmt)}", "response_format")


def parse_sampling(body: dict, defaults: SamplingDefaults, vocab: int):
    """``(max_tokens, SamplingParams, seed, stop strings, stream, engine extras)`` of a request body."""
    number = (int, float)
    positive = dict(check=lambda v: v >= 1, what="an integer >= 1")
    max_tokens = _field(body, "max_tokens", (int,), None, **positive)
    if max_tokens is None:  # the chat API's newer name
        max_tokens = _field(body, "max_completion_tokens", (int,), defaults.max_tokens, **positive)
    n = _field(body, "n", (int,), 1)
    if n != 1:
        raise RequestError(f"'n' must be 1 (one choice per request), got {n}", "n")
    penalty = dict(check=lambda v: -2 <= v <= 2, what="a number in [-2, 2]")
    params = SamplingParams(
        temperature=float(_field(body, "temperature", number, defaults.temperature, lambda v: v >= 0, "a number >= 0")),
        top_p=float(_field(body, "top_p", number, defaults.top_p, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        top_k=_field(body, "top_k", (int,), defaults.top_k, lambda v: v >= 0, "an integer >= 0"),
        min_p=float(_field(body, "min_p", number, defaults.min_p, lambda v: 0 <= v <= 1, "a number in [0, 1]")),
        repetition_penalty=float(_field(body, "repetition_penalty", number, defaults.repetition_penalty,
                                        lambda v: v > 0, "a number > 0")),
        presence_penalty=float(_field(body, "presence_penalty", number, 0.0, **penalty)),
        frequency_penalty=float(_field(body, "frequency_penalty", number, 0.0, **penalty)),
        logit_bias=_logit_bias(body, vocab))
    seed = _field(body, "seed", (int,), None, lambda v: 0 <= v < SEED_LIMIT, "an integer in [0, 2**64)")
    extras = {}
    if body.get("draft") is not None:
        extras["draft"] = _field(body, "draft", (str,), None, lambda v: v in DRAFT_KINDS,
                                 "one of " + ", ".join(map(repr, DRAFT_KINDS)))
    if body.get("num_draft") is not None:
        extras["num_draft"] = _field(body, "num_draft", (int,), None, lambda v: 1 <= v <= MAX_NUM_DRAFT,
                                     f"an integer in 1..{MAX_NUM_DRAFT}")
    stream = _field(body, "stream", (bool,), False)
    return max_tokens, params, seed, _stop_strings(body), stream, extras


def _prompt_ids(tokenizer, prompt, limit: int) -> list[int]:
    if isinstance(prompt, str):
        return _bounded_ids(tokenizer, prompt, limit, True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"'prompt' has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", "prompt")
        return list(prompt)
    raise RequestError("'prompt' must be a string or a non-empty list of token ids (one prompt per request)",
                       "prompt")


def _bounded_ids(tokenizer, text: str, limit: int, add_special_tokens: bool) -> list[int]:
    """The ids of ``text``; a text that cannot fit the context is refused after a prefix is encoded."""
    ids, complete = tokenizer.encode_bounded(text, limit, add_special_tokens)
    if not complete:
        raise RequestError(f"prompt of {len(text)} characters (more than {len(ids)} tokens) exceeds the context "
                           f"limit of {limit} tokens", "messages" if not add_special_tokens else "prompt")
    return ids


def _message_text(i: int, content) -> Optional[str]:
    if content is None or isinstance(content, str):
        return content
    # The content-parts form: [{"type": "text", "text": ...}, ...]
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _tool_calls(i: int, calls) -> list[dict]:
    ok = isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", ""), (str, dict)) for c in calls)
    if not ok:
        raise RequestError(f"messages[{i}].tool_calls must be a list of {{id, type, function: {{name, arguments}}}}",
                           "messages")
    return [{"id": c.get("id"), "type": c.get("type", "function"),
             "function": {"name": c["function"]["name"], "arguments": c["function"].get("arguments", "")}}
            for c in calls]


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'", "messages")
        message = {"role": m["role"], "content": _message_text(i, m.get("content"))}
        if m.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(i, m["tool_calls"])
        elif message["content"] is None:
            raise RequestError(f"messages[{i}].content must be a string (null only with tool_calls)", "messages")
        if isinstance(m.get("tool_call_id"), str):
            message["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        out.append(message)
    return out


def _tools(body: dict) -> tuple[Optional[list], bool]:
    """``(tools for the template, parse tool calls)``."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice is not None:  # as OpenAI answers it, whatever the value
            raise RequestError("'tool_choice' is only allowed when 'tools' are specified", "tool_choice")
        return None, False
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type", "function") == "function"
                                              and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise RequestError("'tools' must be a list of {\"type\": \"function\", \"function\": {name, description, "
                           "parameters}}", "tools")
    if choice == "none":
        return None, False
    if choice not in (None, "auto"):
        raise RequestError(f"'tool_choice' {json.dumps(choice)} is not supported (no constrained decoding): "
                           "use \"auto\" or \"none\"", "tool_choice")
    return tools, True


def _render_chat(tokenizer, messages: list[dict], tools: Optional[list]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools)
    except ValueError as first:  # TokenizerError: the template itself refused the messages
        # Some templates (GLM's) iterate over tool-call arguments as a mapping; OpenAI sends JSON text.
        as_dicts = _arguments_as_dicts(messages)
        if as_dicts is not None:
            try:
                return tokenizer.apply_chat_template(as_dicts, tools=tools)
            except ValueError:
                pass
        raise RequestError(str(first), "messages") from None


def _arguments_as_dicts(messages: list[dict]) -> Optional[list[dict]]:
    changed, out = False, []
    for m in messages:
        calls = []
        for c in m.get("tool_calls") or []:
            args = c["function"]["arguments"]
            if isinstance(args, str):
                try:
                    args, changed = json.loads(args), True
                except ValueError:
                    pass
            calls.append({**c, "function": {**c["function"], "arguments": args}})
        out.append({**m, "tool_calls": calls} if "tool_calls" in m else m)
    return out if changed else None


def parse_completion(body, tokenizer, defaults: SamplingDefaults, chat: bool, limit: int) -> CompletionRequest:
    """Check a request body; ``limit`` is the model's context (prompts that cannot fit are refused
    before the whole text is tokenized)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_json_value(body)
    _response_format(body)
    max_tokens, params, seed, stop, stream, extras = parse_sampling(body, defaults, tokenizer.vocab_size)
    logprobs = _logprobs(body, chat)
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and isinstance(options.get("include_usage", False),
                                                                             bool)):
        raise RequestError("'stream_options' must be {\"include_usage\": true|false}", "stream_options")
    if options is not None and not stream:
        raise RequestError("'stream_options' is only allowed with \"stream\": true", "stream_options")
    tools = None
    if chat:
        if not tokenizer.chat_template:
            raise RequestError("the model's tokenizer has no chat template; use /v1/completions")
        messages = _messages(body)
        template_tools, parse = _tools(body)
        text = _render_chat(tokenizer, messages, template_tools)
        ids = _bounded_ids(tokenizer, text, limit, False)
        tools = template_tools if parse else None
    else:
        if "prompt" not in body:
            raise RequestError("missing field 'prompt'", "prompt")
        ids = _prompt_ids(tokenizer, body["prompt"], limit)
    if len(ids) > limit:
        raise RequestError(f"prompt of {len(ids)} tokens exceeds the context limit of {limit} tokens",
                           "messages" if chat else "prompt")
    return CompletionRequest(ids, max_tokens, params, seed, stop, stream, logprobs,
                             bool((options or {}).get("include_usage")), tools, extras)


# --- engine events to text -------------------------------------------------------------------

class StopStringFilter(HeldBackText):
    """Cuts the text at the first stop string. Holds back a tail that could still become one,
    so that streamed deltas never contain text that a later token turns into a stop."""

    def __init__(self, stops: list[str]):
        super().__init__()
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)

    def add(self, delta: str) -> tuple[str, bool]:
        """``(text safe to send, stopped)``."""
        self.text += delta
        stop = self._find(self.stops, self.longest, len(delta))
        if stop >= 0:
            self.text = self.text[:stop]
            return self._send(len(self.text)), True
        return self._send(len(self.text) - self._partial(self.stops, self.longest)), False

    def flush(self) -> str:
        return self._send(len(self.text))


@dataclass
class Piece:
    text: str
    logprobs: list  # per-token entries: (token text, logprob, [(text, logprob)] or None)


class CompletionText:
    """Turns a handle's events into :class:`Piece` s: detokenised, cut at stop strings, tool-call
    sections held back. After the iteration: ``completion_tokens``, ``finish_reason`` ("stop",
    "length", "tool_calls"; "length" too when the engine ended the request early, as at shutdown)
    and ``tool_calls``."""

    def __init__(self, tokenizer, req: CompletionRequest, handle):
        self.tokenizer, self.req, self.handle = tokenizer, req, handle
        self.completion_tokens = 0
        self.finish_reason: Optional[str] = None
        self.tool_calls: list[dict] = []
        self.token_texts: dict[int, str] = {}

    def _token_text(self, token: int) -> str:
        text = self.token_texts.get(token)
        if text is None:
            text = self.token_texts[token] = self.tokenizer.decode([token])
        return text

    def _entry(self, ev) -> tuple:
        top = None if ev.top_logprobs is None else [(self._token_text(t), lp) for t, lp in ev.top_logprobs]
        return self._token_text(ev.token), ev.logprob, top

    def pieces(self, events: Iterator) -> Iterator[Piece]:
        detok = self.tokenizer.detokenizer()
        stopper = StopStringFilter(self.req.stop)
        tools = ToolCallFilter() if self.req.tools is not None else None
        pending: list = []
        for ev in events:
            self.completion_tokens += 1
            if ev.finish_reason == "stop":  # an end-of-sequence token: its text is not returned
                text = detok.flush()
            else:
                text = detok.add(ev.token)
                if ev.finish_reason is not None:
                    text += detok.flush()
                if ev.logprob is not None:
                    pending.append(self._entry(ev))
            text, stopped = stopper.add(text)
            if tools is not None:
                text = tools.add(text)
            if text or pending:
                yield Piece(text, pending)
                pending = []
            if stopped:
                self.finish_reason = "stop"
                self.handle.cancel()
                break
            if ev.finish_reason is not None:
                self.finish_reason = ev.finish_reason
                break
        else:
            self.finish_reason = "length"  # ended by the engine (a cancel): the text is cut short
        tail = stopper.flush()
        if tools is not None:
            tail = tools.add(tail)
            rest, self.tool_calls = tools.finish(self.req.tools)
            tail += rest
            if self.tool_calls:
                self.finish_reason = "tool_calls"
        if tail:
            yield Piece(tail, [])

    def usage(self) -> dict:
        """The response's ``usage`` (after the iteration)."""
        return usage(len(self.req.prompt_ids), self.completion_tokens, getattr(self.handle, "cached_tokens", 0))


# --- responses -----------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def system_fingerprint(model_id: str) -> str:
    return "fp_colibri_" + hashlib.sha256(f"{__version__}/{model_id}".encode()).hexdigest()[:10]


def _chat_logprob(text: str, lp: float, top) -> dict:
    entry = {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}
    if top is not None:
        entry["top_logprobs"] = [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))}
                                 for t, v in top]
    else:
        entry["top_logprobs"] = []
    return entry


class Response:
    """The OpenAI response shapes of one request (completion or chat, whole or chunked)."""

    def __init__(self, chat: bool, model_id: str, logprobs: bool = False):
        self.chat, self.model_id, self.logprobs = chat, model_id, logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.fingerprint = system_fingerprint(model_id)
        self.text_offset = 0

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id,
                "system_fingerprint": self.fingerprint, "choices": choices, **extra}

    def _logprobs(self, entries: list, text_offsets: bool = True) -> Optional[dict]:
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [_chat_logprob(*e) for e in entries], "refusal": None}
        offsets = []
        for text, _, _ in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [None if e[2] is None else dict(e[2]) for e in entries], "text_offset": offsets}

    def whole(self, text: str, finish_reason: str, usage: dict, logprobs: list, tool_calls: list) -> dict:
        lp = self._logprobs(logprobs)
        if self.chat:
            message = {"role": "assistant", "content": text if text or not tool_calls else None}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": 0, "message": message, "logprobs": lp, "finish_reason": finish_reason}
            return self._envelope("chat.completion", [choice], usage=usage)
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], usage=usage)

    def chunk(self, text: Optional[str], finish_reason: Optional[str] = None, logprobs: Optional[list] = None,
              role: bool = False, tool_calls: Optional[list] = None) -> dict:
        lp = self._logprobs(logprobs or []) if logprobs else None
        if self.chat:
            if role:
                delta = {"role": "assistant", "content": ""}
            elif tool_calls:
                delta = {"tool_calls": [dict(c, index=i) for i, c in enumerate(tool_calls)]}
            else:
                delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: dict) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage)


def model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "colibri"}

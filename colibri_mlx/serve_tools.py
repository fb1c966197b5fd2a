"""Tool calls in generated text, parsed into OpenAI's ``tool_calls``.

The three output formats, as vLLM's tool parsers read them
(vllm/entrypoints/openai/tool_parsers/: deepseekv3_tool_parser.py, kimi_k2_tool_parser.py,
glm4_moe_tool_parser.py):

* DeepSeek-V3: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n
  ARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``
* Kimi-K2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>ARGS<|tool_call_end|>...<|tool_calls_section_end|>`` (the call id is
  ``functions.NAME:IDX``; the name is what lies between the last "." and the ":")
* GLM: ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>``; a value
  is kept as a string when the tool's JSON schema says the parameter is a string, else read as
  JSON (or left a string when it is not JSON).

The text before the first call is the message's ``content``. Streaming holds back text from the
start of a call section (or what could still become one) and sends the parsed calls at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Optional

DEEPSEEK_START = "<｜tool▁calls▁begin｜>"
KIMI_START = "<|tool_calls_section_begin|>"
GLM_START = "<tool_call>"
STARTS = (DEEPSEEK_START, KIMI_START, GLM_START)

_DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<args>.*?)\n```"
                            r"<｜tool▁call▁end｜>", re.DOTALL)
_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>[^<]+:\d+)\s*<\|tool_call_argument_begin\|>\s*"
                        r"(?P<args>(?:(?!<\|tool_call_begin\|>).)*?)\s*<\|tool_call_end\|>", re.DOTALL)
_GLM_CALL = re.compile(r"<tool_call>(?P<name>[^\n<]*)(?P<body>.*?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _call(name: str, arguments: str, call_id: Optional[str] = None) -> dict:
    return {"id": call_id or "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name.strip(), "arguments": arguments}}


def _string_params(tools: Optional[list], name: str) -> set[str]:
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            props = (function.get("parameters") or {}).get("properties") or {}
            return {k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"}
    return set()


def _glm_value(text: str, as_string: bool):
    if as_string:
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_tool_calls(text: str, tools: Optional[list] = None) -> tuple[Optional[str], list[dict]]:
    """``(content, tool_calls)`` of a completion's text; ``([text], [])`` when it has no call."""
    start = find_first(text, STARTS)
    if start < 0:
        return text, []
    content, section = text[:start], text[start:]
    calls = []
    if section.startswith(DEEPSEEK_START):
        calls = [_call(m["name"], m["args"]) for m in _DEEPSEEK_CALL.finditer(section)]
    elif section.startswith(KIMI_START):
        calls = [_call(m["id"].split(":")[0].split(".")[-1], m["args"], m["id"].strip())
                 for m in _KIMI_CALL.finditer(section)]
    else:
        for m in _GLM_CALL.finditer(section):
            name = m["name"].strip()
            strings = _string_params(tools, name)
            args = {k.strip(): _glm_value(v.strip(), k.strip() in strings) for k, v in _GLM_ARG.findall(m["body"])}
            calls.append(_call(name, json.dumps(args, ensure_ascii=False)))
    if not calls:  # a start marker without a well-formed call: leave the text as it is
        return text, []
    return content, calls


def find_first(text: str, markers, start: int = 0) -> int:
    """Where the first of ``markers`` in ``text[start:]`` begins; -1 when none is there."""
    found = [i for i in (text.find(s, start) for s in markers) if i >= 0]
    return min(found) if found else -1


class HeldBackText:
    """Streamed text of which a tail may be held back: ``text`` so far, ``sent`` characters out."""

    def __init__(self):
        self.text = ""
        self.sent = 0

    def _partial(self, markers, longest: int) -> int:
        """The length of the longest tail of the text that is a proper prefix of a marker."""
        firsts = {s[0] for s in markers}  # a tail can only match where a marker's first character is
        for k in range(min(longest - 1, len(self.text)), 0, -1):
            if self.text[-k] in firsts and any(s.startswith(self.text[-k:]) for s in markers):
                return k
        return 0

    def _find(self, markers, longest: int, added: int) -> int:
        """Where the first of ``markers`` begins, searched for in the last ``added`` characters and
        the ``longest - 1`` before them only (the text before that was searched as it came)."""
        return find_first(self.text, markers, max(0, len(self.text) - added - longest + 1))

    def _send(self, end: int) -> str:
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out


class ToolCallFilter(HeldBackText):
    """For streaming: passes text through until a tool-call section starts, then holds the rest
    (and any tail that could still be the start of a marker) for :func:`parse_tool_calls`."""

    LONGEST = max(len(s) for s in STARTS)

    def __init__(self):
        super().__init__()
        self.held = False

    def add(self, delta: str) -> str:
        self.text += delta
        if self.held:
            return ""
        start = self._find(STARTS, self.LONGEST, len(delta))
        if start >= 0:
            self.held = True
            return self._send(start)
        return self._send(len(self.text) - self._partial(STARTS, self.LONGEST))

    def finish(self, tools: Optional[list]) -> tuple[str, list[dict]]:
        """``(text not sent yet, tool calls)`` at the end of the completion."""
        content, calls = parse_tool_calls(self.text, tools)
        if calls:
            return content[self.sent:], calls
        return self._send(len(self.text)), []

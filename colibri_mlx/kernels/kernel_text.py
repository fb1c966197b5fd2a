"""The kernel text MLX is given: compacted, and the header cut to what the body uses.

MLX's custom kernels pay for the length of their source on every launch: the CUDA backend
builds the whole kernel text on every call of the kernel object and hashes it (``std::hash``)
on every evaluation, Metal's builds it per call too. Our kernels share
one header of decoders for every format (qdecode) plus their file's helpers, ~15-20 KB, of
which one launch uses a fraction. :func:`launch_text` keeps the helpers the body reaches
(transitively, by name) and drops the rest, then :func:`compact_source` drops comments,
blank lines and indentation.

The cut is by name, not by meaning: a top-level item (function, template, struct, constant,
alias) is kept when any identifier it defines appears in the body or in a kept item, so an
unused overload of a used name stays (harmless) and nothing used can go. Preprocessor lines,
namespace braces and items whose name cannot be read are always kept. A dropped item that was
needed would be a compile error, never a wrong answer; the MSL simulator and
``scripts/kernels/compile_cuda_twins.py`` compile this same text.
"""

from __future__ import annotations

import functools
import re

_IDENT = re.compile(r"[A-Za-z_]\w*")
_NAMESPACE = re.compile(r"\s*namespace\s+\w+\s*\{\s*$")
_TEMPLATE_PREFIX = re.compile(r"^\s*template\s*<")
_AGGREGATE = re.compile(r"^\s*(struct|class|union|enum)\b")


def compact_source(text: str) -> str:
    """Kernel source without comments, blank lines and indentation.

    Only what C, C++ and MSL ignore is dropped: blank lines, ``//`` comment lines, ``//`` tails
    of lines without a string literal, leading and trailing blanks. Lines of a ``\\``
    continuation and lines ending in one are kept whole (a removed line would change where a
    macro ends). Compiler line numbers refer to this text."""
    out, continued = [], False
    for line in text.splitlines():
        code = line.strip()
        if not continued and not code.endswith("\\"):
            if code.startswith("//"):
                continue
            if '"' not in code and "//" in code:
                code = code[: code.index("//")].rstrip()
            if not code:
                continue
        out.append(code)
        continued = code.endswith("\\")
    return "\n".join(out) + "\n"


def split_items(text: str) -> list[tuple[str, str | None]]:
    """``[(text, name)]``: the top-level items of a compacted header in order. ``name`` is the
    identifier the item defines, or None for what is always kept (preprocessor lines, namespace
    braces, items without a readable name). Raises ValueError on unbalanced braces."""
    items: list[tuple[str, str | None]] = []
    scopes = 0           # open namespace braces
    depth = 0            # braces open inside the current item
    current: list[str] = []
    macro = False        # inside a preprocessor line continued with a backslash
    for line in text.splitlines(keepends=True):
        if macro or (depth == 0 and not current and line.startswith("#")):
            items.append((line, None))
            macro = line.rstrip().endswith("\\")
            continue
        if depth == 0 and not current:
            if not line.strip():
                items.append((line, None))
                continue
            if _NAMESPACE.match(line):
                scopes += 1
                items.append((line, None))
                continue
            if line.strip() == "}" and scopes:
                scopes -= 1
                items.append((line, None))
                continue
        current.append(line)
        opened = line.count("{")
        closed = line.count("}")
        depth += opened - closed
        if depth < 0:
            raise ValueError(f"unbalanced '}}' in kernel header at: {line.strip()!r}")
        if depth > 0:
            continue
        item = "".join(current)
        head = _without_template(item)
        # A function ends at its closing brace; a struct, an initialized constant or a
        # declaration at its semicolon.
        first = re.search(r"[(={]", head or "")
        ends_at_brace = head is not None and not _AGGREGATE.match(head) and first is not None and first.group() != "="
        if not (item.rstrip().endswith(";") or (ends_at_brace and item.rstrip().endswith("}"))):
            continue
        items.append((item, _defined_name(head)))
        current = []
    if current or depth or scopes:
        raise ValueError("kernel header ends inside an item or a namespace (unbalanced braces)")
    return items


def _without_template(item: str) -> str | None:
    """The item after a leading ``template <...>`` (None if its brackets do not close)."""
    if not _TEMPLATE_PREFIX.match(item):
        return item
    level = 0
    for j in range(item.index("<"), len(item)):
        level += {"<": 1, ">": -1}.get(item[j], 0)
        if level == 0:
            return item[j + 1:]
    return None


def _defined_name(head: str | None) -> str | None:
    if head is None:
        return None
    m = _AGGREGATE.match(head)
    if m:
        after = _IDENT.findall(head[m.end():].split("{", 1)[0])
        return after[0] if after else None
    cut = re.search(r"[(\[={;]", head)
    if cut is None:
        return None
    names = _IDENT.findall(head[: cut.start()])
    if not names or "operator" in names:
        return None
    return names[-1]


def prune_header(header: str, body: str) -> str:
    """The header's items that ``body`` reaches by name, in the header's order."""
    items = split_items(header)
    wanted = set(_IDENT.findall(body))
    keep = [name is None for _, name in items]
    changed = True
    while changed:
        changed = False
        for k, (text, name) in enumerate(items):
            if not keep[k] and name in wanted:
                keep[k] = True
                wanted.update(_IDENT.findall(text))
                changed = True
    return "".join(text for (text, _), kept in zip(items, keep) if kept)


@functools.lru_cache(maxsize=256)
def launch_text(header: str, body: str, name: str = "") -> tuple[str, str]:
    """``(header, body)`` as handed to ``mx.fast.metal_kernel`` / ``cuda_kernel`` (and to the
    MSL simulator and the CUDA compile check, which test this text). ``name``: the kernel's, for
    the error a malformed header raises."""
    body = compact_source(body)
    try:
        return prune_header(compact_source(header), body), body
    except ValueError as e:
        raise ValueError(f"kernel {name or '?'}: {e}") from None

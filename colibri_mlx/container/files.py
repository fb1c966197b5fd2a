"""Which files of a model directory are read, and how: regular files only, symlinks kept inside.

A FIFO or device named ``*.safetensors`` (or ``config.json``, ``tokenizer.json``) would block
``open()`` forever or read endless bytes; a symlink to an unrelated file would be parsed as a
model file. So every file a model directory contributes is checked first:

* it must be a regular file (after following symlinks);
* a symlink must resolve inside the model directory, or into a Hugging Face cache blob store
  (``.../models--<org>--<name>/blobs/<hash>``: a hub snapshot directory is made of such links);
* it is opened non-blocking and checked again on the open descriptor (no race with a swap).
"""

from __future__ import annotations

import fcntl
import os
import stat

from .safetensors_reader import ContainerError

HF_BLOB_DIR = "blobs"
HF_REPO_PREFIXES = ("models--", "datasets--", "spaces--")
# Metadata files (config.json, tokenizer_config.json, ...) larger than this are not what they claim.
MAX_JSON_BYTES = 64 << 20
MAX_TOKENIZER_BYTES = 1 << 30


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def is_hf_blob(real_path: str) -> bool:
    """Whether ``real_path`` lies in a Hugging Face cache blob store (``models--*/blobs/``)."""
    parent = os.path.dirname(real_path)
    return (os.path.basename(parent) == HF_BLOB_DIR
            and os.path.basename(os.path.dirname(parent)).startswith(HF_REPO_PREFIXES))


def _inside(real_path: str, root: str) -> bool:
    real_root = os.path.realpath(root)
    try:
        return os.path.commonpath([real_path, real_root]) == real_root
    except ValueError:  # different drives (Windows)
        return False


def check_file(path: str, root: str | None = None, what: str = "this file") -> os.stat_result:
    """Raise ContainerError unless ``path`` is a regular file; with ``root`` (the model
    directory) a symlink must resolve inside it or into a Hugging Face cache blob store."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ContainerError(f"{path}: no such file") from None
    except OSError as e:
        raise ContainerError(f"{path}: cannot read: {e.strerror or e}") from None
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        try:
            st = os.stat(path)
        except OSError:
            raise ContainerError(f"{path}: broken symlink (to {target!r}); {what} is missing") from None
        real = os.path.realpath(path)
        if root is not None and not _inside(real, root) and not is_hf_blob(real):
            raise ContainerError(
                f"{path}: symlink to {real}, outside the model directory; {what} must be in the directory "
                "itself (symlinks are followed only inside it or into a Hugging Face cache blob store, "
                ".../models--*/blobs/): copy the file in")
    if not stat.S_ISREG(st.st_mode):
        raise ContainerError(f"{path}: is {_kind(st.st_mode)}, not a regular file; {what} must be a regular file")
    return st


def open_regular(path: str, what: str = "this file"):
    """``open(path, "rb")`` that refuses anything but a regular file without blocking on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ContainerError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ContainerError(f"{path}: is a directory, not a regular file; {what} must be a regular file") from None
    except OSError as e:
        raise ContainerError(f"{path}: cannot open: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ContainerError(f"{path}: is {_kind(st.st_mode)}, not a regular file; {what} must be a regular file")
        if hasattr(os, "O_NONBLOCK"):
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str, root: str | None = None, what: str = "this file", limit: int = MAX_JSON_BYTES) -> bytes:
    """The whole of a small model-directory file, after :func:`check_file`; refuses one over ``limit``."""
    check_file(path, root, what)
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise ContainerError(f"{path}: {size} bytes, more than the {limit >> 20} MiB {what} can be; "
                                 "is it the right file?")
        try:
            return f.read(limit + 1)
        except OSError as e:
            raise ContainerError(f"{path}: cannot read: {e.strerror or e}") from None


def read_text(path: str, root: str | None = None, what: str = "this file", limit: int = MAX_JSON_BYTES) -> str:
    """:func:`read_bytes` decoded as UTF-8 (a BOM is dropped); an error names the byte offset."""
    data = read_bytes(path, root, what, limit)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ContainerError(f"{path}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
                             f"{what} must be UTF-8 text") from None


def read_json_object(path: str, root: str | None = None, what: str = "this file",
                     limit: int = MAX_JSON_BYTES, error=ContainerError) -> dict:
    """The JSON object in ``path``; any problem is ``error`` naming the file (and line/column)."""
    import json

    try:
        text = read_text(path, root, what, limit)
    except ContainerError as e:
        raise error(str(e)) from None
    try:
        # NaN / Infinity parse: the schema names the key that holds one
        value = json.loads(text, object_pairs_hook=_refuse_conflicting_duplicates)
    except _DuplicateKey as e:
        raise error(f"{path}: key {e.key!r} is given twice, as {_short_json(e.first)} and then "
                    f"{_short_json(e.second)}; keep the one that is meant") from None
    except json.JSONDecodeError as e:
        empty = " (the file is empty)" if not text.strip() else ""
        raise error(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}{empty}") from None
    except (ValueError, RecursionError) as e:
        raise error(f"{path}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object {{...}} at the top, got {_json_type(value)}")
    return value


class _DuplicateKey(ValueError):
    def __init__(self, key, first, second):
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


def _refuse_conflicting_duplicates(pairs) -> dict:
    """A JSON object; a key given twice with different values is refused (json keeps the last one
    silently: a hand edit that appended ``"hidden_size": 128`` would win without a word). The
    same key with the same value twice is harmless and passes."""
    obj = {}
    for key, value in pairs:
        if key in obj and obj[key] != value:
            raise _DuplicateKey(key, obj[key], value)
        obj[key] = value
    return obj


def _short_json(value) -> str:
    import json

    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _json_type(value) -> str:
    if value is None:
        return "null"
    return {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__)

"""Errors a user can fix, notes, and how the command line shows both.

Every error the project raises for bad input is a ``ValueError`` subclass whose message names
the file and the key, tensor or flag at fault (``ContainerError``, ``TokenizerError``,
``ConvertError``, ``ConfigError``, ``FormatError``, ``UsageError``, ...). The command line turns
those, and ``OSError``, into one ``Error: ...`` line (:func:`describe`); anything else is a bug,
shown the same way with its type, and with its traceback when ``COLIBRI_DEBUG=1``.

A :class:`ColibriNote` is a warning meant for the user, not the programmer: it is printed as
one ``colibri: note: ...`` line, without the source location a plain warning carries. It is
still a ``UserWarning``: ``warnings.filterwarnings`` silences it or turns it into an error.
"""

from __future__ import annotations

import errno
import os
import sys
import warnings

DEBUG_ENV = "COLIBRI_DEBUG"


class ConfigError(ValueError):
    """config.json does not describe a model this engine can build (names the file and the key)."""


class ColibriNote(UserWarning):
    """A one-line note for the user (printed as ``colibri: note: ...``)."""


def debug() -> bool:
    """Whether ``COLIBRI_DEBUG`` asks for tracebacks instead of one-line errors."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def one_line(text: str) -> str:
    """``text`` with its line breaks folded into spaces (an ``Error:`` must be the last line)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def is_user_error(exc: BaseException) -> bool:
    """Bad input, a missing file, a full disk: an error to report, not a bug."""
    return isinstance(exc, (ValueError, OSError, MemoryError))


def describe(exc: BaseException) -> str:
    """One line for ``exc``: its message for bad input and I/O errors, its type too for a bug."""
    if isinstance(exc, OSError):
        return one_line(describe_os_error(exc))
    if isinstance(exc, MemoryError):
        return "out of memory" + (f": {exc}" if str(exc) else "")
    if isinstance(exc, (UnicodeDecodeError,)):
        return one_line(f"not valid UTF-8 ({exc})")
    if isinstance(exc, ValueError):
        return one_line(str(exc) or type(exc).__name__)
    return one_line(f"internal error: {type(exc).__name__}: {exc} (this is a bug in colibri_mlx; "
                    f"{DEBUG_ENV}=1 shows the traceback)")


def os_reason(exc: OSError) -> str:
    """What went wrong, in errno's words (with a hint for a full disk), without the file name."""
    what = exc.strerror or str(exc) or type(exc).__name__
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        what += " (the disk is full, or the file is over a size limit)"
    return what


def describe_os_error(exc: OSError, path: str | None = None) -> str:
    """``path: what went wrong`` for an OSError (errno's words, the file it names)."""
    where = path or exc.filename
    if where is not None and exc.filename2:
        where = f"{where} -> {exc.filename2}"
    what = os_reason(exc)
    return f"{where}: {what}" if where else what


def note(message: str, stacklevel: int = 2) -> None:
    """Emit ``message`` as a :class:`ColibriNote` (shown once per message and call site)."""
    warnings.warn(message, ColibriNote, stacklevel=stacklevel + 1)


def _install_note_format() -> None:
    """Print :class:`ColibriNote` as one ``colibri: note:`` line; other warnings as before."""
    original = warnings.showwarning
    if getattr(original, "_colibri_notes", False):
        return

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if isinstance(category, type) and issubclass(category, ColibriNote):
            stream = file if file is not None else sys.stderr
            if stream is None:
                return
            try:
                stream.write(f"colibri: note: {message}\n")
                stream.flush()
            except (OSError, ValueError):
                pass
            return
        return original(message, category, filename, lineno, file, line)

    showwarning._colibri_notes = True
    warnings.showwarning = showwarning


_install_note_format()

"""User-supplied text (request ids, paths, messages that quote them) shown safely:
in rich output, where ``[`` starts markup, on a terminal, where control
characters act, and in one-line errors, where a newline would make two."""
from __future__ import annotations

import shlex

ELLIPSIS = "…"
#: how much of a path an error line keeps (its end: the file name)
PATH_KEPT = 80


def printable(text: str) -> str:
    """``text`` with every character that is not printable (control and format
    characters, line breaks, lone surrogates) written as its Python escape, so
    that printing it can neither act on the terminal nor fail to encode."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shown(text, kept: int = PATH_KEPT) -> str:
    """``repr`` of a user string for an error line: quoted, escapes for what is
    not printable, and a long one (a path) cut to its last ``kept`` characters
    after a leading '…'."""
    text = str(text)
    if len(text) > kept:
        text = ELLIPSIS + text[-(kept - 1):]
    return repr(text)


def command_arg(text) -> str:
    """A path as a shell argument in a printed command (``kvspec replay PATH``)."""
    return shlex.quote(printable(str(text)))


def clip(text: str, limit: int) -> str:
    """``text`` on one line, at most ``limit`` characters, cut at a word boundary
    with a trailing '…' when it is longer."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    cut = text[:limit - 1]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:") + ELLIPSIS

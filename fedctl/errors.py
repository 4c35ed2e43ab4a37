"""How a command ends on an error: one line, ``Error: ...``, exit status 1."""

from __future__ import annotations

from typing import NoReturn

import click

#: The longest message a command prints; a longer one is cut (a library's report can run on).
MAX_CHARS = 400


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line. A message of several lines is joined, not cut to its
    first: some libraries' first line is only a heading (torch's "Error(s) in loading
    state_dict for Sequential:" before the sizes that differ)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if not text:
        return type(exc).__name__
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS - 1] + "…"


def fail(exc: BaseException, status: int = 1) -> NoReturn:
    """End the command with ``exc``'s message as one line, and exit ``status``."""
    error = click.ClickException(one_line(exc))
    error.exit_code = status
    raise error

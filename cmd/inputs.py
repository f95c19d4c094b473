"""Where the prompt comes from: ``--prompt``, standard input, or both."""

from __future__ import annotations

import sys
from typing import BinaryIO


class UsageProblem(ValueError):
    """Input the command cannot use; reported as a usage error (exit status 2)."""


def read_stdin_text(stream: BinaryIO) -> str:
    """All of a piped stdin as text; bytes that are not UTF-8 become U+FFFD instead of failing.

    Trailing line ends are dropped: ``echo text |`` adds one the user did not mean as part of the
    prompt, and a completion prompt that ends in a newline steers the model differently.
    """
    return stream.read().decode("utf-8", errors="replace").rstrip("\r\n")


def combine_prompt(prompt: str | None, stdin_text: str | None) -> str:
    """``--prompt`` first, then a blank line, then stdin; either alone is the prompt."""
    parts = [p for p in (prompt, stdin_text) if p]
    text = "\n\n".join(parts)
    if not text.strip():
        if prompt is None and stdin_text is None:
            raise UsageProblem("no prompt: pass --prompt TEXT or pipe text on stdin "
                               "(interactive chat is not available yet)")
        raise UsageProblem("the prompt is empty")
    return text


def gather_prompt(prompt: str | None) -> str:
    """The prompt from ``--prompt`` and, when stdin is not a terminal, all of stdin."""
    piped = sys.stdin is not None and not sys.stdin.isatty()
    return combine_prompt(prompt, read_stdin_text(sys.stdin.buffer) if piped else None)

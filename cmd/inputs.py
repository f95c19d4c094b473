"""Where the prompt comes from: ``--prompt``, ``--file``, standard input, or a mix."""

from __future__ import annotations

import sys
from typing import BinaryIO

from llama_chat.cmd.sanitize import one_line

# More than any context holds (131072 tokens are well under 1 MiB of text); the bound keeps
# `yes | llama-chat` or a huge file from filling memory before the prompt is even tokenized.
MAX_PROMPT_BYTES = 64 * 1024 * 1024


class UsageProblem(ValueError):
    """Input the command cannot use; reported as a usage error (exit status 2)."""


def read_stdin_text(stream: BinaryIO, *, what: str = "standard input") -> str:
    """All of a stream as text; bytes that are not UTF-8 become U+FFFD instead of failing.

    Trailing line ends are dropped: ``echo text |`` adds one the user did not mean as part of the
    prompt, and a completion prompt that ends in a newline steers the model differently.
    """
    data = stream.read(MAX_PROMPT_BYTES + 1)
    if len(data) > MAX_PROMPT_BYTES:
        raise UsageProblem(f"{what} holds more than {MAX_PROMPT_BYTES // 2**20} MiB of prompt")
    return data.decode("utf-8", errors="replace").rstrip("\r\n")


def read_prompt_file(name: str) -> str:
    """The prompt in file ``name`` ('-' is standard input), as ``read_stdin_text`` reads it."""
    if name == "-":
        if sys.stdin is None:
            raise UsageProblem("--file -: standard input is closed")
        return read_stdin_text(sys.stdin.buffer)
    try:
        with open(name, "rb") as f:
            return read_stdin_text(f, what=f"--file {name}")
    except OSError as e:
        raise UsageProblem(f"--file {name}: cannot read it ({e.strerror or e})") from None


def combine_prompt(prompt: str | None, stdin_text: str | None) -> str:
    """``--prompt`` first, then a blank line, then stdin (or the file); either alone is the prompt."""
    parts = [p for p in (prompt, stdin_text) if p]
    text = "\n\n".join(parts)
    if not text.strip():
        if prompt is None and stdin_text is None:
            raise UsageProblem("no prompt: pass --prompt TEXT, --file FILE or pipe text on stdin "
                               "(interactive chat is not available yet)")
        raise UsageProblem("the prompt is empty")
    return text


def gather_prompt(prompt: str | None, *, file: str | None = None, read_stdin: bool = True) -> str:
    """The prompt from ``--prompt`` and ``--file``, or else (unless told not to) a piped stdin."""
    if file is not None:
        return combine_prompt(prompt, read_prompt_file(file))
    piped = read_stdin and sys.stdin is not None and not sys.stdin.isatty()
    return combine_prompt(prompt, read_stdin_text(sys.stdin.buffer) if piped else None)


__all__ = ["MAX_PROMPT_BYTES", "UsageProblem", "combine_prompt", "gather_prompt", "one_line", "read_prompt_file",
           "read_stdin_text"]

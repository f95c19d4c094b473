"""Where the prompt comes from: ``--prompt``, ``--file``, standard input, or a mix."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, BinaryIO

from llama_chat.cmd.sanitize import one_line
from llama_chat.model.safe_input import BadInput, check_text

if TYPE_CHECKING:
    from llama_chat.cmd.options import Options

# More than any context holds (131072 tokens are well under 1 MiB of text); the bound keeps
# `yes | llama-chat` or a huge file from filling memory before the prompt is even tokenized.
MAX_PROMPT_BYTES = 64 * 1024 * 1024


class UsageProblem(ValueError):
    """Input the command cannot use; reported as a usage error (exit status 2)."""


def check_command_line_text(opts: Options) -> None:
    """``UsageProblem`` when an option's text is not text: bytes that are not UTF-8 on the command
    line (``-p $'hi \\xff'``) reach Python as lone surrogates, which no tokenizer can encode."""
    # The options whose text reaches the tokenizer.
    for flag, value in (("--prompt", opts.prompt), ("--system", opts.system), ("--stop", opts.stop),
                        ("--suffix", opts.suffix)):
        for text in (value,) if isinstance(value, str) else value or ():
            try:
                check_text(text, flag)
            except BadInput as e:
                raise UsageProblem(str(e)) from None


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


def check_fim_usage(opts: Options) -> None:
    """``--suffix`` or ``--suffix-file`` (one of them) go with a one-shot prompt: the code before
    the cursor, from ``--prompt``, ``--file`` or a pipe."""
    flag = "--suffix" if opts.suffix is not None else "--suffix-file" if opts.suffix_file is not None else None
    if flag is None:
        return
    if opts.suffix is not None and opts.suffix_file is not None:
        raise UsageProblem("--suffix and --suffix-file: give one of them")
    for other, given in (("--chat", opts.chat), ("--batch", opts.batch is not None), ("--system", opts.system)):
        if given:
            raise UsageProblem(f"{flag} fills in the middle of a one-shot prompt; it cannot be used with {other}")
    if opts.prompt is None and opts.file is None and (opts.no_stdin or sys.stdin is None or sys.stdin.isatty()):
        raise UsageProblem(f"{flag} needs a prompt, the code before the cursor: pass --prompt TEXT, --file FILE "
                           "or pipe it on stdin")


def read_suffix(opts: Options) -> str | None:
    """The text of ``--suffix``, or of the file ``--suffix-file`` names as it is (its last line end
    is code after the cursor too)."""
    if opts.suffix_file is None:
        return opts.suffix
    try:
        with open(opts.suffix_file, "rb") as f:
            data = f.read(MAX_PROMPT_BYTES + 1)
    except OSError as e:
        raise UsageProblem(f"--suffix-file {opts.suffix_file}: cannot read it ({e.strerror or e})") from None
    if len(data) > MAX_PROMPT_BYTES:
        raise UsageProblem(f"--suffix-file {opts.suffix_file} holds more than {MAX_PROMPT_BYTES // 2**20} MiB")
    return data.decode("utf-8", errors="replace")


def combine_prompt(prompt: str | None, stdin_text: str | None) -> str:
    """``--prompt`` first, then a blank line, then stdin (or the file); either alone is the prompt."""
    parts = [p for p in (prompt, stdin_text) if p]
    text = "\n\n".join(parts)
    if not text.strip():
        if prompt is None and stdin_text is None:
            raise UsageProblem("no prompt: pass --prompt TEXT, --file FILE or pipe text on stdin "
                               "(or run on a terminal, or with --chat, to chat)")
        raise UsageProblem("the prompt is empty")
    return text


def gather_prompt(prompt: str | None, *, file: str | None = None, read_stdin: bool = True) -> str:
    """The prompt from ``--prompt`` and ``--file``, or else (unless told not to) a piped stdin."""
    if file is not None:
        return combine_prompt(prompt, read_prompt_file(file))
    piped = read_stdin and sys.stdin is not None and not sys.stdin.isatty()
    return combine_prompt(prompt, read_stdin_text(sys.stdin.buffer) if piped else None)


def attach_terminal() -> None:
    """Go on reading the terminal after stdin was a pipe (``... | llama-chat --chat``).

    The terminal becomes file descriptor 0, so that ``input()`` edits lines with readline there.
    """
    try:
        fd = os.open("/dev/tty", os.O_RDWR)
    except OSError:
        raise UsageProblem("--chat with piped input needs a terminal to go on reading from (/dev/tty)") from None
    os.dup2(fd, 0)
    os.close(fd)
    sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)


def gather_first_message(prompt: str | None, *, file: str | None = None, read_stdin: bool = True) -> str | None:
    """The chat's first message, if any: ``--prompt``, ``--file`` or piped stdin, as for a prompt.

    When stdin was a pipe, the terminal takes its place so that the chat goes on there.
    """
    piped = file is None and read_stdin and sys.stdin is not None and not sys.stdin.isatty()
    if prompt is None and file is None and not piped:
        return None
    text = gather_prompt(prompt, file=file, read_stdin=read_stdin)
    if piped or file == "-":
        attach_terminal()
    return text


__all__ = ["gather_first_message", "MAX_PROMPT_BYTES", "UsageProblem", "check_command_line_text", "check_fim_usage",
           "combine_prompt", "gather_prompt", "one_line", "read_prompt_file", "read_stdin_text", "read_suffix"]

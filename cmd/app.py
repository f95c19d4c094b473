"""The ``llama-chat`` command: options in, exit status out (``cmd/main.py`` dispatches to it).

Exit statuses are listed in ``exit_status.py``. Every message that reaches stderr passes through
``sanitize.one_line``: messages quote values from model files and from the command line, and
neither may put escape codes on the user's terminal.
"""

from __future__ import annotations

from llama_chat.cmd.startup import Terminated, deferred_signals, ensure_std_fds, importing_torch

# First of all, before any module opens a file that could take over fd 1 or 2 (`llama-chat >&-`).
ensure_std_fds()
# A Ctrl+C while the command's own modules load, or while its options are built (a dataclass of
# some forty fields in options.py, a noticeable moment on a busy machine), ends the run with status
# 130 and no traceback; the guard is left at the end of this module.
_loading = deferred_signals(exit_now=True)
_loading.__enter__()
with deferred_signals(exit_now=True):
    import os
    import re
    import sys
    import traceback
    from importlib.metadata import PackageNotFoundError, version
    from typing import Annotated

    import typer
    from rich.console import Console

    from llama_chat.cmd import exit_status
    from llama_chat.cmd.batch_input import check_batch_options, read_batch
    from llama_chat.cmd.inputs import (UsageProblem, check_command_line_text, check_fim_usage, gather_first_message,
                                       gather_prompt)
    from llama_chat.cmd.options import Options
    from llama_chat.cmd.sanitize import one_line
    from llama_chat.cmd.typer_command import GroupedHelp, command, new_app
    from llama_chat.ml.controls import ControlError


def _package_version() -> str:
    try:
        return version("llama-chat")
    except PackageNotFoundError:
        return "unknown"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"llama-chat {_package_version()}")
        raise typer.Exit()


def resolve_color(mode: str) -> str:
    """``auto`` becomes ``never`` when NO_COLOR is set to anything non-empty (no-color.org)."""
    if mode == "auto" and os.environ.get("NO_COLOR"):
        return "never"
    return mode


def stderr_console(color: str) -> Console:
    # color_system=None writes no escape sequence at all: NO_COLOR users get no dim or bold either.
    return Console(stderr=True, highlight=False, color_system=None if color == "never" else "auto",
                   force_terminal=True if color == "always" else None)


def _error(err: Console, message: str) -> None:
    err.print(f"llama-chat: error: {one_line(message)}", markup=False, soft_wrap=True, highlight=False)


def _is_terminal(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (OSError, ValueError):
        return False


def wants_chat(opts: Options) -> bool:
    """``--chat``, or no prompt at all with both stdin and stdout on a terminal."""
    if opts.chat:
        return True
    return opts.prompt is None and opts.file is None and _is_terminal(sys.stdin) and _is_terminal(sys.stdout)


def check_usage(opts: Options) -> None:
    """``UsageProblem`` for options that cannot go together, found before torch is imported: a
    usage error should be instant. Each rule is the options' own (``Options.beams``,
    ``Options.constraint``); this only names the flags."""
    if sys.stdout is None:  # started with stdout closed (`>&-`)
        raise UsageProblem("standard output is closed: there is nowhere to write the answer")
    check_command_line_text(opts)
    check_fim_usage(opts)
    if opts.download and opts.model is None:
        raise UsageProblem("--download needs -m org/name (a Hugging Face id)")
    if opts.remote_model is not None or opts.api_key is not None:
        from llama_chat.inference.remote import is_remote

        if not is_remote(opts.model):
            raise UsageProblem("--remote-model and --api-key go with -m openai:URL (a model on a server)")
    if opts.draft is not None:
        from llama_chat.inference.remote import is_remote

        if is_remote(opts.model) or is_remote(opts.draft):
            raise UsageProblem("--draft takes a model loaded here, beside a model loaded here (not openai:URL)")
    try:
        opts.beams()
        opts.constraint()
    except ControlError as e:
        raise UsageProblem(as_flags(str(e))) from None
    find_models(opts)


def find_models(opts: Options) -> None:
    """A model or draft model named here that is nowhere to be found is its one line at once,
    before torch is imported (``ModelLoadError``; the loader finds it again later, a few stats)."""
    from llama_chat.inference.remote import is_remote
    from llama_chat.model.stores import resolve_model

    for name in (opts.model, opts.draft):
        if name is not None and not is_remote(name) and not opts.download:
            resolve_model(str(name), download=False, progress=False)


def as_flags(message: str) -> str:
    """``message`` with the options' field names spelled as their flags (num_beams: --num-beams).
    Only names of two words or more: ``json`` or ``format`` in a message are words."""
    return _FIELD_NAME.sub(lambda m: "--" + m.group(0).replace("_", "-"), message)


_FIELD_NAME = re.compile(r"(?<![-\w])(?:" + "|".join(sorted((n for n in Options.__dataclass_fields__ if "_" in n),
                                                            key=len, reverse=True)) + r")(?![-\w])")


def execute(opts: Options) -> int:
    color = resolve_color(opts.color)
    err = stderr_console(color)
    try:
        check_usage(opts)
        if opts.list_models:
            from llama_chat.cmd.model_list import print_model_list

            return print_model_list(sys.stdout)
        if check_batch_options(opts):
            jobs = read_batch(opts.batch)
            with importing_torch(opts.model):  # torch is imported here, and its threads start
                from llama_chat.cmd.batch import run_batch

            return run_batch(opts, jobs, color, err)
        if wants_chat(opts):
            if opts.json:
                raise UsageProblem("--json prints one answer; it cannot be used with the chat")
            first = gather_first_message(opts.prompt, file=opts.file, read_stdin=not opts.no_stdin)
            with importing_torch(opts.model):
                from llama_chat.cmd.chat import run_chat

            return run_chat(opts, first, color, err)
        text = gather_prompt(opts.prompt, file=opts.file, read_stdin=not opts.no_stdin)
        with importing_torch(opts.model):
            from llama_chat.cmd.run_command import run_command

        return run_command(opts, text, color, err)
    except KeyboardInterrupt:
        err.print("finish: cancelled", style="dim")
        return exit_status.SIGINT
    except Terminated as e:
        err.print("finish: cancelled", style="dim")
        return exit_status.for_signal(e.signum)
    except UsageProblem as e:
        _error(err, str(e))
        return exit_status.USAGE
    except Exception as e:  # noqa: BLE001 - the last line of defence: one line, or a traceback on request
        from llama_chat.inference.types import RequestError, sole_exception
        from llama_chat.model.errors import ModelLoadError

        if opts.debug:
            traceback.print_exc()
        if isinstance(e, BaseExceptionGroup):  # a task group's wrapping says nothing: the error inside does
            e = sole_exception(e)
            if isinstance(e, BaseExceptionGroup):
                e = e.exceptions[0]
        if isinstance(e, (ModelLoadError, RequestError)):
            _error(err, " ".join(str(e).split("\n")))
            return exit_status.USAGE
        from llama_chat.cmd.report import failure_line

        _error(err, failure_line(e))
        return exit_status.FAILURE


app = new_app()
app.command(name="llama-chat", cls=GroupedHelp,
            help="Generate text from a Llama-family model, or chat with it. The prompt comes from --prompt, "
                 "from --file or piped stdin, or both (prompt first, a blank line, then the rest). With no "
                 "prompt on a terminal, or with --chat, an interactive chat starts (/help lists its "
                 "commands). `llama-chat serve` serves a model over OpenAI's HTTP API (see llama-chat serve "
                 "--help).")(command(Options, execute, extra={"show_version": (
                     Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True,
                                                  help="Print the version and exit.")], False)}))


_loading.__exit__(None, None, None)

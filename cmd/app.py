"""The ``llama-chat`` command line: options in, exit status out.

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
    import inspect
    from collections.abc import Callable
    from dataclasses import fields
    from importlib.metadata import PackageNotFoundError, version
    from typing import Annotated, get_type_hints

    import typer
    from rich.console import Console

    from llama_chat.cmd import exit_status
    from llama_chat.cmd.batch_input import check_batch_options, read_batch
    from llama_chat.cmd.inputs import UsageProblem, check_command_line_text, gather_first_message, gather_prompt
    from llama_chat.cmd.options import Options
    from llama_chat.cmd.sanitize import one_line
    from llama_chat.cmd.signals import install_sync_handlers
    from llama_chat.inference.thread_signals import block_in_new_threads
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


def _command(run: Callable[[Options], int]) -> Callable[..., None]:
    """The typer command whose parameters are ``Options``' fields (plus --version): the options
    are defined once, in ``options.py``, and typer reads them from there."""
    hints = get_type_hints(Options, include_extras=True)
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
              for f in fields(Options)]
    version_hint = Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True,
                                                help="Print the version and exit.")]
    params.append(inspect.Parameter("show_version", inspect.Parameter.KEYWORD_ONLY, default=False,
                                    annotation=version_hint))

    def command(**kwargs) -> None:
        kwargs.pop("show_version", None)
        raise typer.Exit(run(Options(**kwargs)))

    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


class GroupedHelp(typer.core.TyperCommand):
    """Plain ``--help`` (no boxes, no colour) with the options in sections: each option's
    ``rich_help_panel``, the others under "Options"."""

    def format_options(self, ctx, formatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {"Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                names, text = record
                sections.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(
                    (_TYPER_PLACEHOLDER.sub(_placeholder, names), text))
        for title, rows in sections.items():
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


# typer's placeholder for an option that names none of its own (as MODEL or FILE): <int>, <str>,
# <int range>, <a|b|c>. --help shows one style instead: a capital letter or word, or the choices.
_TYPER_PLACEHOLDER = re.compile(r"<([^<>]+)>")
_PLACEHOLDERS = {"int": "N", "float": "X", "str": "TEXT"}


def _placeholder(typer_own: re.Match) -> str:
    label = typer_own.group(1)
    return _PLACEHOLDERS.get(label.split()[0], label)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]})
app.command(name="llama-chat", cls=GroupedHelp,
            help="Generate text from a Llama-family model, or chat with it. The prompt comes from --prompt, "
                 "from --file or piped stdin, or both (prompt first, a blank line, then the rest). With no "
                 "prompt on a terminal, or with --chat, an interactive chat starts (/help lists its "
                 "commands). `llama-chat serve` serves a model over OpenAI's HTTP API (see llama-chat serve "
                 "--help).")(_command(lambda opts: execute(opts)))


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


def execute(opts: Options) -> int:
    color = resolve_color(opts.color)
    err = stderr_console(color)
    try:
        # Input problems are found before torch is imported: a usage error should be instant.
        if sys.stdout is None:  # started with stdout closed (`>&-`)
            raise UsageProblem("standard output is closed: there is nowhere to write the answer")
        check_command_line_text(opts)
        if opts.list_models:
            from llama_chat.cmd.model_list import print_model_list

            return print_model_list(sys.stdout)
        if opts.download and opts.model is None:
            raise UsageProblem("--download needs -m org/name (a Hugging Face id)")
        if opts.remote_model is not None or opts.api_key is not None:
            from llama_chat.inference.remote import is_remote

            if not is_remote(opts.model):
                raise UsageProblem("--remote-model and --api-key go with -m openai:URL (a model on a server)")
        if opts.num_return > opts.num_beams:
            raise UsageProblem(f"--num-return must be at most --num-beams ({opts.num_beams}), got {opts.num_return}")
        try:
            opts.constraint()
        except ControlError as e:
            raise UsageProblem(str(e)) from None
        if check_batch_options(opts):
            jobs = read_batch(opts.batch)
            with importing_torch():  # torch is imported here, and its threads start
                from llama_chat.cmd.batch import run_batch

            return run_batch(opts, jobs, color, err)
        if wants_chat(opts):
            if opts.json:
                raise UsageProblem("--json prints one answer; it cannot be used with the chat")
            first = gather_first_message(opts.prompt, file=opts.file, read_stdin=not opts.no_stdin)
            with importing_torch():  # torch is imported here, and its threads start
                from llama_chat.cmd.chat import run_chat

            return run_chat(opts, first, color, err)
        text = gather_prompt(opts.prompt, file=opts.file, read_stdin=not opts.no_stdin)
        with importing_torch():  # torch is imported here, and its threads start
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


# typer carries its own copy of click; its exceptions all derive from this one.
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _usage_error(e: Exception, command: str = "llama-chat") -> int:
    message = "; ".join(line.strip() for line in e.format_message().splitlines() if line.strip())
    try:
        sys.stderr.write(f"llama-chat: error: {one_line(message)} (see {command} --help)\n")
    except (OSError, ValueError):
        pass
    return exit_status.USAGE


def main() -> None:
    # Set before torch is imported, which is when OpenMP reads it. Besides torch's threads this
    # process always has a busy event loop (and often a terminal or pipe reader beside it); with
    # OpenMP's default, idle helper threads spin between parallel regions and take the cores from
    # both: 0.91 of a bare loop against 0.97 when they sleep, and far worse on a busy machine
    # (docs/benchmarks.md). A user's own setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    install_sync_handlers()
    # Signals are the main thread's alone: a Ctrl+C at the chat's prompt must wake its wait.
    block_in_new_threads()
    try:
        # Not standalone: usage errors come back here as exceptions and are printed on one line.
        if sys.argv[1:2] == ["serve"]:  # the one subcommand; anything else is the command as it always was
            with deferred_signals():
                from llama_chat.cmd.serve import serve_app

            status = serve_app(args=sys.argv[2:], prog_name="llama-chat serve", standalone_mode=False)
        else:
            status = app(args=optional_batch_file(sys.argv[1:]), prog_name="llama-chat", standalone_mode=False)
        status = exit_status.OK if status is None else status
    except typer.Abort:  # Ctrl+C while the options were parsed
        status = exit_status.SIGINT
    except _ClickException as e:
        status = _usage_error(e, "llama-chat serve" if sys.argv[1:2] == ["serve"] else "llama-chat")
    except SystemExit as e:
        status = e.code
    except Terminated as e:  # SIGTERM/SIGHUP while the options were being parsed
        status = exit_status.for_signal(e.signum)
    except KeyboardInterrupt:
        status = exit_status.SIGINT
    _exit_now(status)


def optional_batch_file(args: list[str]) -> list[str]:
    """``--batch`` with no FILE (last, or followed by another option) means ``--batch -``, stdin.

    The file is optional; click options take a value or none, never maybe one, so the missing
    value is put in here."""
    out = []
    for i, arg in enumerate(args):
        out.append(arg)
        if arg == "--":
            return out + args[i + 1:]
        if arg == "--batch" and (i + 1 == len(args) or (args[i + 1].startswith("-") and args[i + 1] != "-")):
            out.append("-")
    return out


def _exit_now(code: int | str | None) -> None:
    """Flush and leave without the interpreter's teardown.

    Everything is written and nothing runs in the background by now; tearing down torch's modules
    would only add half a second or more between Ctrl+C and the shell prompt.
    """
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = exit_status.FAILURE
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass  # a closed pipe: nothing more can reach it
    os._exit(code or exit_status.OK)


_loading.__exit__(None, None, None)

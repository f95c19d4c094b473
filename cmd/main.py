"""The ``llama-chat`` executable: ``llama-chat serve ...`` serves a model (``cmd/serve.py``);
``llama-chat embed`` and ``llama-chat rerank`` run an embedding model or a reranker
(``cmd/embed_command.py``); ``llama-chat ps`` and ``llama-chat stop NAME`` ask a running server
(``cmd/ps_command.py``); anything else is the command as it always was (``cmd/app.py``). None
of them imports another; all build their typer command the same way (``cmd/typer_command.py``).

Exit statuses are listed in ``exit_status.py``; usage errors are one line on stderr.
"""

from __future__ import annotations

# A Ctrl+C is recorded from this module's first line on, while ``startup`` itself is imported
# (on a busy machine that takes long enough to be hit), and acted on as ``deferred_signals`` acts.
# ``_signal`` is built in: ``signal`` builds its enums first, a window of its own.
import _signal

_early: list[int] = []
_before = _signal.signal(_signal.SIGINT, lambda signum, frame: _early.append(signum))

import signal  # noqa: E402

from llama_chat.cmd.startup import (  # noqa: E402
    Terminated,
    deferred_signals,
    ensure_std_fds,
    exit_cancelled,
    keep_lost_signals,
    silence_stdout,
)

# First of all, before any module opens a file that could take over fd 1 or 2 (`llama-chat >&-`).
ensure_std_fds()
# Before the first window where a signal's exception can be raised, and so lost, in an import's callback.
keep_lost_signals()
# A Ctrl+C while the command's modules load ends the run with status 130 and no traceback.
with deferred_signals(exit_now=True):
    import os
    import sys

    import typer

    from llama_chat.cmd import exit_status
    from llama_chat.cmd.sanitize import one_line
    from llama_chat.cmd.signals import install_sync_handlers
    from llama_chat.inference.thread_signals import block_in_new_threads
signal.signal(signal.SIGINT, _before)
if _early:
    exit_cancelled(_early[0])

# typer carries its own copy of click; its exceptions all derive from this one.
ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


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
    serving = sys.argv[1:2] == ["serve"]
    encoding = sys.argv[1:2] in (["embed"], ["rerank"])
    asking = sys.argv[1:2] in (["ps"], ["stop"])
    name = f"llama-chat {sys.argv[1]}" if serving or encoding or asking else "llama-chat"
    try:
        with deferred_signals():
            if serving:
                from llama_chat.cmd.serve import serve_app as command

                args = sys.argv[2:]
            elif encoding:
                from llama_chat.cmd.embed_command import embed_app, rerank_app

                command = embed_app if sys.argv[1] == "embed" else rerank_app
                args = sys.argv[2:]
            elif asking:
                from llama_chat.cmd.ps_command import ps_app, stop_app

                command = ps_app if sys.argv[1] == "ps" else stop_app
                args = sys.argv[2:]
            else:
                from llama_chat.cmd.app import app as command

                args = optional_batch_file(sys.argv[1:])
            from llama_chat.cmd.typer_command import parse

        # Usage errors come back here as exceptions and are printed on one line.
        status = parse(command, args, name)()
        status = exit_status.OK if status is None else status
    except typer.Abort:  # Ctrl+C while the options were parsed
        status = exit_status.SIGINT
    except ClickException as e:
        status = usage_error(e, name)
    except SystemExit as e:
        status = e.code
    except Terminated as e:  # SIGTERM/SIGHUP while the options were being parsed
        status = exit_status.for_signal(e.signum)
    except KeyboardInterrupt:
        status = exit_status.SIGINT
    except BrokenPipeError:  # stdout's reader left before a command that does not watch for it wrote
        silence_stdout()
        status = exit_status.OUTPUT_CLOSED
    _exit_now(status)


def usage_error(e: Exception, command: str = "llama-chat") -> int:
    """A usage error from the options' parser: one line on stderr, and the usage status."""
    message = "; ".join(line.strip() for line in e.format_message().splitlines() if line.strip())
    try:
        sys.stderr.write(f"llama-chat: error: {one_line(message)} (see {command} --help)\n")
    except (OSError, ValueError):
        pass
    return exit_status.USAGE


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


if __name__ == "__main__":
    main()

"""Signals: a first SIGINT/SIGTERM/SIGHUP cancels generation, a second one exits at once.

Three phases. While the command's modules are imported, signals are recorded and acted on when
the import is done (``startup.deferred_signals``). Outside the event loop (reading input, loading
the model, printing the summary) they raise exceptions in the main thread: ``KeyboardInterrupt``
for SIGINT, as Python always does, and ``Terminated`` for SIGTERM and SIGHUP, so all unwind through
``finally`` blocks and progress bars restore the terminal. Inside the event loop a watcher task
receives them with ``anyio.open_signal_receiver`` and cancels the generation's scope instead: the
producer stops after its current step and the consumer keeps what it has committed.

SIGQUIT (Ctrl+\\) means "quit now": the terminal is restored and the process leaves at once with
status 131. SIGTSTP (Ctrl+Z) during generation shows the cursor before the process stops and
hides it again when it continues.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus

from llama_chat.cmd import exit_status
from llama_chat.cmd.startup import STOP_SIGNALS, Terminated

__all__ = ["StopRequest", "Terminated", "hard_exit", "install_sync_handlers", "watch_signals"]

# Restore what a live display may have changed (colours, hidden cursor) before a hard exit.
_TERMINAL_RESET = "\x1b[0m\x1b[?25h"


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


def _quit(signum, frame) -> None:
    hard_exit(signum, message=b"\nfinish: cancelled (quit)\n")


def install_sync_handlers() -> None:
    """SIGINT -> KeyboardInterrupt (Python's default), SIGTERM/SIGHUP -> Terminated; main thread only."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGHUP, _raise_terminated)
    signal.signal(signal.SIGQUIT, _quit)


@dataclass
class StopRequest:
    """Which signal asked generation to stop, if any (read after the task group has exited)."""

    signum: int | None = None


def _reset_terminal() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and stream.isatty():
                os.write(stream.fileno(), _TERMINAL_RESET.encode())
        except (OSError, ValueError):
            pass


def hard_exit(signum: int, message: bytes = b"\nfinish: cancelled (second signal, exiting now)\n") -> None:
    """The second signal (or SIGQUIT): reset the terminal, say so on stderr, leave without unwinding."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()  # committed text stays, even on the way out
    except (OSError, ValueError):
        pass
    _reset_terminal()
    try:
        os.write(2, message)
    except OSError:
        pass
    os._exit(exit_status.for_signal(signum))


async def watch_signals(scope: anyio.CancelScope, stop: StopRequest, *,
                        on_suspend: Callable[[], None] | None = None,
                        on_resume: Callable[[], None] | None = None,
                        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Run beside the generation (started with ``tg.start``, so it listens before it begins).

    It outlives the cancel it causes, so that a second signal during a slow last step still
    reaches it; the caller cancels this task once generation has ended. ``on_suspend`` and
    ``on_resume`` run around a Ctrl+Z (the renderer shows the cursor, then hides it again).
    """
    watched = [*STOP_SIGNALS, signal.SIGQUIT]
    if on_suspend is not None:
        watched.append(signal.SIGTSTP)
    with anyio.open_signal_receiver(*watched) as signals:
        task_status.started()
        async for signum in signals:
            if signum == signal.SIGTSTP:
                _suspend(on_suspend, on_resume)
            elif signum == signal.SIGQUIT:
                hard_exit(signum, message=b"\nfinish: cancelled (quit)\n")
            elif stop.signum is None:
                stop.signum = signum
                scope.cancel()
            else:
                hard_exit(signum)


def _suspend(on_suspend: Callable[[], None] | None, on_resume: Callable[[], None] | None) -> None:
    """Stop the process as Ctrl+Z would, with the terminal restored while it is stopped."""
    if on_suspend is not None:
        on_suspend()
    os.kill(os.getpid(), signal.SIGSTOP)  # returns when the shell's `fg` or `bg` sends SIGCONT
    if on_resume is not None:
        on_resume()

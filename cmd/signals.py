"""SIGINT and SIGTERM: a first signal cancels generation, a second one exits at once.

Two phases. Outside the event loop (reading input, loading the model, printing the summary) the
signals raise exceptions in the main thread: ``KeyboardInterrupt`` for SIGINT, as Python always
does, and ``Terminated`` for SIGTERM, so both unwind through ``finally`` blocks and progress bars
restore the terminal. Inside the event loop a watcher task receives them with
``anyio.open_signal_receiver`` and cancels the generation's scope instead: the producer stops
after its current step and the consumer keeps what it has committed.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus

from llama_chat.cmd import exit_status

# Restore what a live display may have changed (colours, hidden cursor) before a hard exit.
_TERMINAL_RESET = "\x1b[0m\x1b[?25h"


class Terminated(BaseException):
    """SIGTERM outside the event loop; a BaseException so ``except Exception`` lets it through."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def install_sync_handlers() -> None:
    """SIGINT -> KeyboardInterrupt (Python's default), SIGTERM -> Terminated; main thread only."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_terminated)


@dataclass
class StopRequest:
    """Which signal asked generation to stop, if any (read after the task group has exited)."""

    signum: int | None = None


def hard_exit(signum: int) -> None:
    """The second signal: reset the terminal, say so on stderr, and leave without unwinding."""
    try:
        sys.stdout.flush()  # committed text stays, even on the way out
        if sys.stdout.isatty():
            os.write(sys.stdout.fileno(), _TERMINAL_RESET.encode())
        os.write(sys.stderr.fileno(), b"\nfinish: cancelled (second signal, exiting now)\n")
    except (OSError, ValueError):
        pass
    os._exit(exit_status.for_signal(signum))


async def watch_signals(scope: anyio.CancelScope, stop: StopRequest, *,
                        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Run beside the generation (started with ``tg.start``, so it listens before it begins).

    It outlives the cancel it causes, so that a second signal during a slow last step still
    reaches it; the caller cancels this task once generation has ended.
    """
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            if stop.signum is None:
                stop.signum = signum
                scope.cancel()
            else:
                hard_exit(signum)

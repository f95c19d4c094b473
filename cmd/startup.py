"""The first moments of the process: signals that arrive while modules load, and missing stdio.

Imported before anything heavy (it needs only the standard library), so that a Ctrl+C at any
moment of start-up ends the process with its usual status and no traceback.

Why signals are *deferred* while modules are imported, instead of raising ``KeyboardInterrupt``
at once: an exception raised in the middle of importing an extension module can be lost (torch's
numpy initialisation clears a pending exception, and the run then carries on as if nothing had
happened) or leave a half-initialised module behind ("cannot load module more than once per
process"). A recording handler is safe anywhere; the signal is acted on when the import is done.

The import that brings torch in (``importing_torch``) also blocks the signals meanwhile and starts
torch's threads before it ends, so that those threads never take a signal meant for the main
thread (``inference/thread_signals.py``).
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from llama_chat.inference import thread_signals

# The signals that end a run. SIGHUP: the terminal went away (or someone asked us to stop).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """SIGTERM or SIGHUP outside the event loop; a BaseException so ``except Exception`` lets it through."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum


def exception_for(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def exit_cancelled(signum: int) -> None:
    """Leave now with the signal's status: nothing has been started that needs undoing."""
    try:
        os.write(2, b"finish: cancelled\n")
    except OSError:
        pass
    os._exit(128 + signum)


def keep_lost_signals() -> None:
    """A signal whose exception is raised where Python cannot raise it comes again, not lost.

    A handler's ``KeyboardInterrupt`` (or ``Terminated``) that lands in a weakref callback or a
    ``__del__`` is only printed, "Exception ignored in ...", and the run goes on as if no signal had
    come. Imports hit it: each module's lock is released in such a callback
    (``_get_module_lock.<locals>.cb``), so a Ctrl+C while a module loads outside
    ``deferred_signals`` was lost. The signal is sent to the main thread again from a thread of its
    own: raised from here, its handler would run, and raise, in this hook, where it is lost too.
    """
    previous = sys.unraisablehook

    def redeliver(unraisable) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, KeyboardInterrupt):
            signum = signal.SIGINT
        elif isinstance(exc, Terminated):
            signum = exc.signum
        else:
            previous(unraisable)
            return
        try:
            # Not ``threading.Thread``: its start() waits, and the signal would land in that wait.
            _thread.start_new_thread(_send_again, (main, signum))
        except RuntimeError:  # the interpreter is shutting down: the run has ended anyway
            pass

    main = threading.main_thread().ident
    sys.unraisablehook = redeliver


def _send_again(main: int, signum: int) -> None:
    thread_signals.block_in_this_thread()  # the process's signals are still the main thread's alone
    signal.pthread_kill(main, signum)


@contextmanager
def deferred_signals(*, exit_now: bool = False) -> Iterator[None]:
    """Record SIGINT/SIGTERM/SIGHUP in the block; act on the first one when it ends.

    ``exit_now``: leave the process at once (used while the command's own modules are imported,
    before there is anywhere to report from); otherwise raise ``KeyboardInterrupt`` or
    ``Terminated`` after the block, as the synchronous handlers would have.
    """
    received: list[int] = []

    def record(signum, frame) -> None:
        received.append(signum)

    previous = {s: signal.signal(s, record) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    if received:
        if exit_now:
            exit_cancelled(received[0])
        raise exception_for(received[0])


@contextmanager
def importing_torch(model: str | None) -> Iterator[None]:
    """``deferred_signals`` around the import of a command's modules, and of torch where the
    command runs ``model`` here (a remote model's command never imports it).

    The signals are blocked in the block too, so that the threads the import starts (OpenBLAS's)
    and the main thread's OpenMP helpers, started before it ends, inherit the block: afterwards
    only the main thread takes them. One that came meanwhile is acted on as the block ends.
    """
    from llama_chat.inference.remote import is_remote

    with deferred_signals(), thread_signals.blocked():
        yield
        if not is_remote(model):
            thread_signals.start_native_threads()  # imports torch


def ensure_std_fds() -> tuple[bool, bool, bool]:
    """Which of stdin, stdout, stderr were closed when the process started (``llama-chat >&-``).

    Each closed one is pointed at /dev/null, so that no file the loader opens later lands on fd 1
    or 2 and receives our output, and ``sys.stderr`` is made usable again. The caller decides what
    a closed stdout means (there is nowhere to put the answer).
    """
    closed = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            closed.append(False)
        except OSError:
            devnull = os.open(os.devnull, os.O_RDWR)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
            closed.append(True)
    if closed[2] or sys.stderr is None:
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    return closed[0], closed[1], closed[2]


def silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail on a closed pipe.

    Python's documented recipe for SIGPIPE-free programs: without it, the flush at exit prints
    "Exception ignored ... BrokenPipeError" to stderr.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)

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
hides it again when it continues. Before a second signal ends the process at once, the live
display erases its pending markers (``on_exit``), so the screen keeps exactly the text.

The chat turns the terminal's echo of control characters off while it runs
(``no_control_echo``): a Ctrl+C then leaves no ``^C`` among the reply's text, however many are
typed and wherever they land (readline, which reads the same setting, does not echo them
either). Every way out restores it, a hard exit included.

At the chat's prompt a signal ends readline's wait however it lands (``interruptible_prompt``).
Only the main thread takes signals (``inference/thread_signals.py``), and readline lets Python run
a handler when its ``select()`` is interrupted. A signal that lands after a key's echo is written
and before ``select()`` begins interrupts no wait: on a busy machine the echo wakes whoever typed,
and their Ctrl+C comes before the main thread gets on. Left alone, it would act at the next key.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus

from llama_chat.cmd import exit_status
from llama_chat.cmd.startup import STOP_SIGNALS, Terminated

__all__ = ["StopRequest", "Terminated", "hard_exit", "install_sync_handlers", "interruptible_prompt", "no_control_echo",
           "watch_signals"]

# Restore what a live display may have changed (colours, hidden cursor) before a hard exit.
_TERMINAL_RESET = "\x1b[0m\x1b[?25h"

# The terminal's settings before ``no_control_echo`` changed them: (fd, termios attributes).
_saved_echo: tuple[int, list] | None = None


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


@contextmanager
def no_control_echo(fd: int = 0) -> Iterator[None]:
    """While inside, the terminal on ``fd`` echoes no control character as ``^C``, ``^\\``...
    (``ECHOCTL`` off; typed text is still echoed). Nothing happens when ``fd`` is not a terminal."""
    global _saved_echo
    try:
        import termios
    except ImportError:  # not a POSIX system: nothing to change
        yield
        return
    try:
        saved = termios.tcgetattr(fd)
        quiet = list(saved)
        quiet[3] &= ~termios.ECHOCTL
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
    except (termios.error, OSError, ValueError):  # not a terminal: nothing to change
        yield
        return
    _saved_echo = (fd, saved)
    try:
        yield
    finally:
        _restore_echo()


# Sent to the main thread only to interrupt its wait at the prompt; its handler does nothing.
# Nothing else sends it to this process, and its default action is to ignore it (Go's runtime
# takes it to interrupt threads for the same reasons).
_WAKE = signal.SIGURG
# How often the main thread is woken until its wait has ended: a wake that lands just before the
# wait begins is lost as the signal was, and the next one ends it.
_WAKE_EVERY_S = 0.05


@contextmanager
def interruptible_prompt() -> Iterator[None]:
    """Around the chat's ``input()``: a signal received while it waits ends the wait.

    Python's own handler also writes each signal's number to a pipe (``signal.set_wakeup_fd``) at
    the moment it lands. A helper thread reading the pipe sends ``_WAKE`` to the main thread until
    the wait has ended: an interrupted ``select()`` is where readline lets Python run the handler
    that is still due (``KeyboardInterrupt`` for Ctrl+C). Where the handler has run already, the
    wait goes on. Only in the main thread (elsewhere nothing changes).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    ended = threading.Event()
    previous_handler = signal.signal(_WAKE, _ignore)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_wake_main_thread, args=(read_fd, ended, threading.main_thread().ident),
                     name="llama-chat prompt waker", daemon=True).start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(_WAKE, previous_handler)  # a wake still on its way is ignored now
        ended.set()
        os.close(write_fd)  # the helper reads to the end, then ends


def _ignore(signum, frame) -> None:
    pass


def _wake_main_thread(read_fd: int, ended: threading.Event, main_thread: int) -> None:
    try:
        while signums := os.read(read_fd, 64):
            if any(signum != _WAKE for signum in signums):
                while not ended.is_set():
                    signal.pthread_kill(main_thread, _WAKE)
                    ended.wait(_WAKE_EVERY_S)
    finally:
        os.close(read_fd)


def _restore_echo() -> None:
    global _saved_echo
    if _saved_echo is None:
        return
    fd, saved = _saved_echo
    _saved_echo = None
    try:
        import termios

        termios.tcsetattr(fd, termios.TCSANOW, saved)
    except (termios.error, OSError, ValueError):
        pass  # the terminal is gone


def _reset_terminal() -> None:
    _restore_echo()
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
                        on_exit: Callable[[], None] | None = None,
                        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Run beside the generation (started with ``tg.start``, so it listens before it begins).

    It outlives the cancel it causes, so that a second signal during a slow last step still
    reaches it; the caller cancels this task once generation has ended. ``on_suspend`` and
    ``on_resume`` run around a Ctrl+Z (the renderer shows the cursor, then hides it again);
    ``on_exit`` before a second signal or SIGQUIT ends the process (the renderer erases its markers).
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
                _before_exit(on_exit)
                hard_exit(signum, message=b"\nfinish: cancelled (quit)\n")
            elif stop.signum is None:
                stop.signum = signum
                scope.cancel()
            else:
                _before_exit(on_exit)
                hard_exit(signum)


def _before_exit(on_exit: Callable[[], None] | None) -> None:
    if on_exit is None:
        return
    try:
        on_exit()
    except Exception:  # noqa: BLE001 - leaving at once matters more than a tidy screen
        pass


def _suspend(on_suspend: Callable[[], None] | None, on_resume: Callable[[], None] | None) -> None:
    """Stop the process as Ctrl+Z would, with the terminal restored while it is stopped."""
    if on_suspend is not None:
        on_suspend()
    os.kill(os.getpid(), signal.SIGSTOP)  # returns when the shell's `fg` or `bg` sends SIGCONT
    if on_resume is not None:
        on_resume()

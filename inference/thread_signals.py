"""Signals sent to the process are the main thread's: every other thread blocks them.

The kernel hands a signal sent to the process (Ctrl+C's SIGINT, a SIGTERM) to any one thread that
does not block it. Python runs its handlers in the main thread whichever thread took the signal,
but a main thread waiting in a system call wakes only for a signal delivered to itself: at the
chat's prompt readline waits in ``select()``, and a Ctrl+C taken by another thread did nothing
there until the next key. So only the main thread may take them.

A new thread starts with its creator's signal mask, native threads included: torch's OpenMP
helpers, which each thread that runs a parallel op starts for itself, and OpenBLAS's, started when
numpy is imported. Hence, set up once by the command (``cmd/app.py``, ``cmd/startup.py``):

- every Python thread blocks them before its ``run()`` (``block_in_new_threads``): the step
  thread, anyio's worker threads, and those of libraries, such as the progress monitor a compile
  starts; the native threads each of them goes on to make inherit the block;
- the main thread imports torch and starts its own helpers with them blocked (``blocked``, then
  ``start_native_threads``), and takes them again after.

Importing this module needs the standard library only (``cmd/startup.py`` uses it).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# The signals the main thread acts on outside an event loop: Ctrl+C, SIGTERM and SIGHUP (see
# cmd/startup.py's STOP_SIGNALS), Ctrl+\ (cmd/signals.py), and the window's new size, which
# readline reads when its wait is interrupted. Ctrl+Z is not among them: at the prompt its
# default action stops the whole process, whichever thread takes it.
MAIN_THREAD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGWINCH})

# Elements in the start-up op: several of at::parallel_for's grains (32768 elements), so that the
# op runs on every intra-op thread and the main thread's helpers all start then.
_PARALLEL_ELEMENTS = 1 << 20


def block_in_this_thread() -> None:
    """Block ``MAIN_THREAD_SIGNALS`` in the calling thread for good (never the main thread)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, MAIN_THREAD_SIGNALS)


def _block_before_run(frame, event, arg) -> None:
    # threading installs this as the new thread's profile function just before run(); its first
    # event is that call. The thread's own profiling ends here: this was its only use.
    sys.setprofile(None)
    block_in_this_thread()


def block_in_new_threads() -> None:
    """From now on every thread started through ``threading`` (``Thread``, ``Timer``, the workers
    of executors and of anyio) blocks ``MAIN_THREAD_SIGNALS`` before its ``run()``. In the main
    thread, before any other thread starts."""
    threading.setprofile(_block_before_run)


@contextmanager
def blocked() -> Iterator[None]:
    """Block ``MAIN_THREAD_SIGNALS`` in this thread while inside, so that every thread started
    meanwhile, native or not, inherits the block. After, the mask is as before and a signal that
    came meanwhile is delivered: its Python handler runs as the block is left."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, MAIN_THREAD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start_native_threads() -> None:
    """Start the calling thread's intra-op helpers now, under ``blocked``: before this thread runs
    a parallel op of its own (loading a model does) with the signals taken."""
    import torch

    with blocked(), torch.inference_mode():
        torch.ones(_PARALLEL_ELEMENTS).sum()

"""A forward that stops between two layers when the step it belongs to is abandoned.

A cancel waits for the step that is running (``inference/step_worker.py``): nothing may write the
KV cache behind the caller's back. A decode step is short, but a prefill forward of a long prompt
on a CPU is not, and short prefill chunks, which would bound the wait, read every weight once per
chunk and prefill slower. So an eager forward looks, between two layers, at the event of the step
it runs in (set when that step is abandoned) and raises ``ForwardInterrupted``: a cancel then
waits for one layer. What the stopped forward wrote is past what its caller counts as cached.

The event is the running thread's (``running``): a forward outside a step worker never stops.
Compiled graphs never look (the check is Python, outside what they trace).
"""

from __future__ import annotations

import threading

_local = threading.local()


class ForwardInterrupted(Exception):
    """The step this forward belonged to was abandoned; its results are not wanted."""


class running:
    """``with running(abandoned):`` forwards in this thread, inside the block, stop once
    ``abandoned`` is set. A class rather than a generator: the step thread enters one per decode
    step, and a generator-based context manager cost several times as much."""

    __slots__ = ("_abandoned", "_previous")

    def __init__(self, abandoned: threading.Event) -> None:
        self._abandoned = abandoned
        self._previous: threading.Event | None = None

    def __enter__(self) -> None:
        self._previous = getattr(_local, "abandoned", None)
        _local.abandoned = self._abandoned

    def __exit__(self, *exc_info: object) -> None:
        _local.abandoned = self._previous


def check() -> None:
    """Raise ``ForwardInterrupted`` if the step running in this thread has been abandoned."""
    abandoned = getattr(_local, "abandoned", None)
    if abandoned is not None and abandoned.is_set():
        raise ForwardInterrupted()

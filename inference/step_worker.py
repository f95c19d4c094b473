"""A dedicated worker thread that runs model steps in order, each submitted as its own call.

Why not ``anyio.to_thread.run_sync`` for every step: each call then costs two thread wake-ups on
the critical path between two forwards (the event loop waking for the result, then the pool
thread waking for the next call), a share of every token on a small model (docs/benchmarks.md,
"Streaming pipeline"). Here the producer queues steps *ahead* of
the one whose result it is handling, so the thread goes from one forward straight into the next,
and the event loop learns of results without the thread waiting for it.

Results reach the event loop in batches, at most every ``report_every_s`` (and at once when the
thread has ``REPORT_AT_QUEUED`` calls or fewer queued): every wake of the event loop takes the GIL
from the forward a few times, which slows the forward. A 20 ms batch is
below what a reader can see, and a step slower than that is reported as soon as it ends.

What stays the same as ``to_thread.run_sync``: each call is one step; a cancel revokes the steps
that have not started and waits for the one that has; and when the ``async with`` block ends no
step of it is running or queued. What differs: the step that has started is told it was
abandoned, and an eager forward in it stops at its next layer (``model/interrupt.py``), so a
cancel during a long prefill chunk waits for one layer, not for the chunk.

The thread itself is parked when a block ends and serves the next block (``_StepThread``). A new
thread for every generation made each one's first forward pay for the thread's own OpenMP
helpers, allocator arena and kernel buffers, which showed in the time to first token.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel

from llama_chat.model import interrupt

THREAD_NAME = "llama-chat step worker"
_STOP = object()
# Results are reported at once when this few calls are left queued. Reporting only when none
# was left made the thread wait for the event loop every few steps wherever the queued calls take
# less time than a batch.
REPORT_AT_QUEUED = 2
# Threads kept parked between blocks; more than one only where several blocks overlap.
PARKED_MOST = 2


@dataclass(eq=False)
class StepCall:
    """One submitted call: its function and arguments, then its result or its exception."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Any = None
    error: BaseException | None = None
    revoked: bool = False
    # Set when the call is abandoned while it runs: an eager forward in it stops at its next layer
    # (model/interrupt.py).
    abandoned: threading.Event = field(default_factory=threading.Event)


def _call_soon_threadsafe() -> Callable[[Callable[[], None]], None]:
    """How a foreign thread schedules a callback on the running event loop, without waiting.

    anyio's event loop token carries the running loop's native handle: an asyncio event loop, or
    on trio a ``TrioToken``. Each has its own thread-safe, non-blocking way to schedule a call.
    """
    native = anyio.lowlevel.current_token().native_token
    if isinstance(native, asyncio.AbstractEventLoop):
        return native.call_soon_threadsafe
    return native.run_sync_soon  # trio.lowlevel.TrioToken


class _StepThread:
    """A daemon thread that runs the calls of one ``StepWorker`` block at a time, parked on its
    inbox between blocks."""

    _lock = threading.Lock()
    _parked: list[_StepThread] = []  # most recently parked last
    _serving: set[_StepThread] = set()

    def __init__(self, name: str) -> None:
        self._inbox: queue.SimpleQueue[StepWorker] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    @classmethod
    def take(cls, worker: StepWorker, name: str) -> _StepThread:
        """A parked thread, or a new one, now serving ``worker``."""
        taken = None
        with cls._lock:
            while cls._parked and taken is None:
                taken = cls._parked.pop()
                if not taken.thread.is_alive():  # in a forked child the parent's threads are gone
                    taken = None
        if taken is None:
            taken = cls(name)
        taken.thread.name = name
        with cls._lock:
            cls._serving.add(taken)
        taken._inbox.put(worker)
        return taken

    def release(self) -> bool:
        """In the thread, its worker's calls all done: park it if fewer than ``PARKED_MOST`` are
        parked (True), else let it end (False)."""
        with self._lock:
            self._serving.discard(self)
            if len(self._parked) >= PARKED_MOST:
                return False
            self._parked.append(self)
            return True

    @classmethod
    def serving(cls) -> int:
        with cls._lock:
            return len(cls._serving)

    def _serve(self) -> None:
        """Each block's calls, in order, until its ``__aexit__``; then parked for the next block,
        or ended.

        The calls run from this frame itself: each frame between the thread and a step is paid on
        every call, and a lone job's tokens come from the step's own frame (``BatchCore.step``)."""
        try:
            parked = True
            while parked:
                worker = self._inbox.get()
                notify = worker._notify
                assert notify is not None
                failed = False
                done: list[StepCall] = []
                last_report = float("-inf")
                with worker._scope():
                    while True:
                        call = worker._queue.get()
                        if call is _STOP:
                            break
                        assert isinstance(call, StepCall)
                        if not (call.revoked or failed):
                            try:
                                with interrupt.running(call.abandoned):
                                    call.result = call.fn(*call.args)
                            except BaseException as e:  # handed to the awaiting task, raised there
                                call.error = e
                                failed = True
                        elif not call.revoked:
                            call.revoked = True
                        done.append(call)
                        now = time.perf_counter()
                        # Almost nothing queued: the producer has to act before this thread can go
                        # on, so tell it now, while the last queued calls still keep the thread busy.
                        if (worker._queue.qsize() <= REPORT_AT_QUEUED
                                or now - last_report >= worker._report_every_s):
                            notify(lambda calls=done, worker=worker: worker._finish(calls))
                            done = []
                            last_report = now
                if done:
                    notify(lambda calls=done, worker=worker: worker._finish(calls))
                parked = self.release()  # before the block may end: the next one finds it parked
                notify(worker._thread_exited)
        finally:  # ended, or failed (an event loop gone under it): neither serving nor parked
            with self._lock:
                self._serving.discard(self)
                if self in self._parked:
                    self._parked.remove(self)


def threads_serving() -> int:
    """How many step threads are running or holding the calls of an open ``StepWorker`` block
    (parked threads are not counted)."""
    return _StepThread.serving()


class StepWorker:
    """``async with StepWorker() as worker: call = worker.submit(fn, ...); await worker.result(call)``.

    Calls run one at a time in submission order. A call that raises revokes every call queued
    after it: later steps build on earlier ones, so they would run on a broken state.
    """

    def __init__(self, name: str = THREAD_NAME, *, report_every_s: float = 0.0,
                 scope: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
        self._name = name
        self._report_every_s = report_every_s
        # Entered once in the thread around all of the block's calls (``torch.inference_mode``
        # for model steps): entered per step instead, it is a visible share of a short step.
        self._scope = scope or nullcontext
        # One event for all of the block's calls: revoking revokes them all, and the block ends.
        # An event per call would cost the event loop work on every token.
        self._abandoned = threading.Event()
        self._queue: queue.SimpleQueue[StepCall | object] = queue.SimpleQueue()
        self._pending: list[StepCall] = []  # submitted, not yet reported done to the event loop
        self._thread: _StepThread | None = None
        self._exited: anyio.Event | None = None
        self._notify: Callable[[Callable[[], None]], None] | None = None

    async def __aenter__(self) -> StepWorker:
        self._notify = _call_soon_threadsafe()
        self._exited = anyio.Event()
        self._thread = _StepThread.take(self, self._name)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.revoke_pending()
        self._queue.put(_STOP)
        assert self._exited is not None and self._thread is not None
        # Shielded: a cancel must not leave the thread running a step on its own.
        with anyio.CancelScope(shield=True):
            await self._exited.wait()

    def submit(self, fn: Callable[..., Any], *args: Any) -> StepCall:
        call = StepCall(fn, args, abandoned=self._abandoned)
        self._pending.append(call)
        self._queue.put(call)
        return call

    def revoke_pending(self) -> None:
        """Steps that have not started will not start; the one running stops at its forward's
        next layer, or finishes (a forward without layers left, a compiled step)."""
        for call in self._pending:
            call.revoked = True
        if self._pending:
            self._abandoned.set()

    async def result(self, call: StepCall) -> Any:
        """The call's return value, or its exception raised here; a cancel revokes what is queued.

        On a cancel the step already running is waited for (shielded), as ``to_thread.run_sync``
        does, so that the caller never races a step still writing the KV cache. A call already
        reported done returns at once, without yielding to the event loop: results come in
        batches, and a yield for each (with ``TextStream``'s for each event) costs the event loop's
        thread time on every token, which on two cores comes out of the step's. A cancel is then
        seen at the first call of the batch that has to be waited for.
        """
        if call.done.is_set():
            return self._outcome(call)
        try:
            await call.done.wait()
        except BaseException:
            self.revoke_pending()
            with anyio.CancelScope(shield=True):
                for pending in list(self._pending):
                    await pending.done.wait()
            raise
        return self._outcome(call)

    @staticmethod
    def _outcome(call: StepCall) -> Any:
        if call.error is not None:
            raise call.error
        if call.revoked:
            raise RuntimeError("a revoked step was awaited")  # a bug in the caller, never input
        return call.result

    # -- the event loop's side of the thread (``_StepThread._serve``) ----------------------------

    def _finish(self, calls: list[StepCall]) -> None:  # on the event loop
        for call in calls:
            self._pending.remove(call)
            call.done.set()

    def _thread_exited(self) -> None:  # on the event loop
        assert self._exited is not None
        self._exited.set()

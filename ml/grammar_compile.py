"""Where the constraint engine compiles: on a thread of its own with a deep stack, within a budget
of memory shared by the compiles that run at once; and how much of what it compiled is kept.

* The engine recurses on the native stack of its caller (``ml/grammar_depth.py``): a worker
  thread's default stack (8 MiB) held chains of about 900 links of the worst shape, so each
  compile runs on a thread whose stack has room for several times ``MAX_GRAMMAR_DEPTH`` links.
  Only the pages a compile touches are ever resident.
* A compile holds about 30 bytes of memory per byte of its text until it ends; many requests
  with large schemas at once (a server's clients) would add those up. So the text being compiled
  at once is bounded by ``GRAMMAR_COMPILE_BUDGET_BYTES``; a compile past it waits for others to
  end. No text is larger than the budget (``MAX_CONSTRAINT_BYTES``), so each runs in the end.
* What is compiled holds as much for as long as it is kept (a large enum's matcher, 25 bytes a
  byte of its text), so the caches of compiled constraints (``KeptCompiles``) are bounded by the
  text they hold, ``KEPT_CONSTRAINT_BYTES``, as well as by a count.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from llama_chat.ml.controls import GRAMMAR_COMPILE_BUDGET_BYTES, KEPT_CONSTRAINT_BYTES

T = TypeVar("T")

# The worst shape measured took 4 KiB of stack per link (docs/bad-inputs.md), so
# MAX_GRAMMAR_DEPTH's 2,500 links take about 10 MiB: room for six times that.
STACK_BYTES = 64 << 20

_stack_size_lock = threading.Lock()


class Budget:
    """Bytes shared by the threads that hold them: ``held(size)`` waits until ``size`` more fit in
    ``total`` (a size past the total takes all of it), and gives them back when its block ends."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.in_use = 0
        self._changed = threading.Condition()

    @contextmanager
    def held(self, size: int):
        size = max(1, min(size, self.total))
        with self._changed:
            self._changed.wait_for(lambda: self.in_use + size <= self.total)
            self.in_use += size
        try:
            yield
        finally:
            with self._changed:
                self.in_use -= size
                self._changed.notify_all()


COMPILING = Budget(GRAMMAR_COMPILE_BUDGET_BYTES)


def on_deep_stack(call: Callable[..., T], *args: Any) -> T:
    """``call(*args)`` run to its end on a new thread with a ``STACK_BYTES`` stack; its result,
    or what it raised, as if it had been called here."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, call(*args)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
            outcome.append((False, e))

    # The stack size is the process's setting for the threads started next: set it only for this one.
    with _stack_size_lock:
        before = threading.stack_size(STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(before)
    thread.join()
    done, value = outcome[0]
    if not done:
        raise value
    return value


def compiled(size: int, call: Callable[..., T], *args: Any) -> T:
    """``call(*args)``, a compile of ``size`` bytes of text: within the budget, on a deep stack."""
    with COMPILING.held(size):
        return on_deep_stack(call, *args)


class KeptCompiles(Generic[T]):
    """The latest compiles, at most ``count`` of them holding at most ``size`` bytes of text
    together (a compile larger than that alone is not kept). Safe from any thread."""

    def __init__(self, count: int, size: int = KEPT_CONSTRAINT_BYTES) -> None:
        self.count = count
        self.size = size
        self._kept: OrderedDict[Hashable, tuple[T, int]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> T | None:
        with self._lock:
            found = self._kept.get(key)
            if found is None:
                return None
            self._kept.move_to_end(key)
            return found[0]

    def put(self, key: Hashable, value: T, size: int) -> T:
        """Keep ``value`` (``size`` bytes of text) under ``key``, the oldest making room; ``value``."""
        with self._lock:
            if key in self._kept:
                self._held -= self._kept.pop(key)[1]
            if size <= self.size:
                self._kept[key] = (value, size)
                self._held += size
            while self._kept and (len(self._kept) > self.count or self._held > self.size):
                self._held -= self._kept.popitem(last=False)[1][1]
        return value

    def __len__(self) -> int:
        return len(self._kept)


__all__ = ["Budget", "COMPILING", "KeptCompiles", "STACK_BYTES", "compiled", "on_deep_stack"]

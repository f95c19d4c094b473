"""Where the constraint engine compiles: on a thread of its own with a deep stack, within a budget
of memory shared by the compiles that run at once.

* The engine recurses on the native stack of its caller (``ml/grammar_depth.py``): a worker
  thread's default stack (8 MiB) held chains of about 900 links of the worst shape, so each
  compile runs on a thread whose stack has room for several times ``MAX_GRAMMAR_DEPTH`` links.
  Only the pages a compile touches are ever resident.
* A compile holds about 30 bytes of memory per byte of its text until it ends; many requests
  with large schemas at once (a server's clients) would add those up. So the text being compiled
  at once is bounded by ``GRAMMAR_COMPILE_BUDGET_BYTES``; a compile past it waits for others to
  end. No text is larger than the budget (``MAX_CONSTRAINT_BYTES``), so each runs in the end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, TypeVar

from llama_chat.ml.controls import GRAMMAR_COMPILE_BUDGET_BYTES

T = TypeVar("T")

# The worst shape measured took 4 KiB of stack per link (docs/bad-inputs.md), so
# MAX_GRAMMAR_DEPTH's 2,500 links take about 10 MiB: room for six times that.
STACK_BYTES = 64 << 20

_stack_size_lock = threading.Lock()
_budget = threading.Condition()
_in_use = 0


@contextmanager
def compile_budget(size: int):
    """Hold ``size`` bytes of the budget (at most all of it) while the block runs."""
    global _in_use
    size = max(1, min(size, GRAMMAR_COMPILE_BUDGET_BYTES))
    with _budget:
        _budget.wait_for(lambda: _in_use + size <= GRAMMAR_COMPILE_BUDGET_BYTES)
        _in_use += size
    try:
        yield
    finally:
        with _budget:
            _in_use -= size
            _budget.notify_all()


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
    with compile_budget(size):
        return on_deep_stack(call, *args)


__all__ = ["STACK_BYTES", "compile_budget", "compiled", "on_deep_stack"]

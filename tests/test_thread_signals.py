"""Signals are the main thread's: the threads the program starts block them, and a signal that
does not interrupt the prompt's wait by itself still ends it.

The first two tests run a fresh interpreter, so that no thread started by an earlier test (and so
not under the program's start-up steps) is counted.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cli_support import cli_env
from llama_chat.inference.thread_signals import MAIN_THREAD_SIGNALS, blocked
from thread_masks import mask_of

WAIT_S = 120.0  # a fresh interpreter importing torch, on however busy a machine

needs_proc = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")

THREADS_SCRIPT = r"""
import json, threading
from concurrent.futures import ThreadPoolExecutor

import anyio

from llama_chat.inference import thread_signals
from thread_masks import blocked_signals

# The command's start-up steps (cmd/app.py, cmd/startup.py).
thread_signals.block_in_new_threads()
with thread_signals.blocked():
    import torch
thread_signals.start_native_threads()
from llama_chat.inference.step_worker import StepWorker


def parallel_op():
    return float((torch.ones(1 << 20) * 2).sum())  # starts the step thread's own OpenMP helpers


async def main():
    async with StepWorker() as worker:
        await worker.result(worker.submit(parallel_op))
    await anyio.to_thread.run_sync(parallel_op)  # one of anyio's worker threads
    ThreadPoolExecutor(max_workers=1).submit(parallel_op).result()
    running, done = threading.Event(), threading.Event()
    threading.Thread(target=lambda: (running.set(), done.wait()), daemon=True).start()
    running.wait()
    print(json.dumps({"main": threading.get_native_id(), "masks": blocked_signals()}))


anyio.run(main)
"""


@needs_proc
def test_the_threads_the_program_starts_block_the_signals_and_the_main_thread_takes_them():
    """A plain thread, an executor's, one of anyio's, the step thread, and the native threads
    they and the main thread start (OpenMP helpers, OpenBLAS's) all block the main thread's
    signals; the main thread blocks none of them."""
    proc = subprocess.run([sys.executable, "-c", THREADS_SCRIPT], capture_output=True, text=True, timeout=WAIT_S,
                          cwd=Path(__file__).parent, env=cli_env())
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    masks = {int(tid): mask for tid, mask in report["masks"].items()}
    wanted = mask_of(MAIN_THREAD_SIGNALS)
    assert masks.pop(report["main"]) & wanted == 0
    assert len(masks) >= 4  # the plain thread, the executor's, anyio's and the step thread at least
    assert {tid: hex(mask) for tid, mask in masks.items() if mask & wanted != wanted} == {}


PROMPT_SCRIPT = r"""
import os, select, signal, threading
from pathlib import Path

from llama_chat.cmd.signals import interruptible_prompt

signal.signal(signal.SIGINT, signal.default_int_handler)
main = threading.get_native_id()
read_fd, write_fd = os.pipe()

# A wait that ends on its own leaves nothing behind.
os.write(write_fd, b"x")
with interruptible_prompt():
    select.select([read_fd], [], [])
os.read(read_fd, 1)
assert signal.getsignal(signal.SIGURG) is signal.SIG_DFL
assert signal.set_wakeup_fd(-1) == -1


def take_sigint_here_once_main_waits():
    # This thread does not block SIGINT: Python's handler for it is due, and the main thread's
    # wait is not interrupted, as when a signal lands just before readline starts waiting.
    while not any(word in Path(f"/proc/self/task/{main}/wchan").read_text() for word in ("poll", "select")):
        threading.Event().wait(0.01)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)


threading.Thread(target=take_sigint_here_once_main_waits, daemon=True).start()
try:
    with interruptible_prompt():
        select.select([read_fd], [], [])  # nothing is ever written: only a signal ends it
except KeyboardInterrupt:
    print("interrupted")
"""


@needs_proc
def test_a_signal_that_does_not_interrupt_the_prompts_wait_still_ends_it():
    """Without ``interruptible_prompt`` the wait below never ends: the run would time out."""
    proc = subprocess.run([sys.executable, "-c", PROMPT_SCRIPT], capture_output=True, text=True, timeout=WAIT_S,
                          env=cli_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "interrupted\n"


def test_a_signal_that_comes_while_blocked_is_handled_as_the_block_is_left():
    taken = []
    previous = signal.signal(signal.SIGWINCH, lambda signum, frame: taken.append(signum))
    try:
        with blocked():
            signal.pthread_kill(threading.get_ident(), signal.SIGWINCH)  # to this thread: it waits here
            assert taken == []
        assert taken == [signal.SIGWINCH]
    finally:
        signal.signal(signal.SIGWINCH, previous)


LOST_SIGNAL_SCRIPT = r"""
import signal, sys, time, weakref

from llama_chat.cmd.signals import install_sync_handlers
from llama_chat.cmd.startup import Terminated, keep_lost_signals

install_sync_handlers()
if sys.argv[1] == "kept":
    keep_lost_signals()


class Lock:
    pass


def released(_):
    # As importlib's module-lock callback: the signal's handler runs, and raises, in here.
    signal.raise_signal(getattr(signal, sys.argv[2]))


lock = Lock()
ref = weakref.ref(lock, released)
try:
    del lock
    deadline = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < deadline:
        time.sleep(0.01)
    print("lost")
except KeyboardInterrupt:
    print("interrupted")
except Terminated as e:
    print("terminated", e.signum)
"""


@pytest.mark.parametrize("signame, kept", [("SIGINT", "interrupted\n"), ("SIGTERM", f"terminated {signal.SIGTERM}\n")])
def test_a_signal_whose_exception_lands_in_a_callback_is_delivered_again(signame, kept):
    """CPython prints a handler's exception raised in a weakref callback and goes on: a Ctrl+C
    that lands in an import's module-lock callback was lost, and the run went on to the end."""
    def run(mode: str, wait_s: float) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", LOST_SIGNAL_SCRIPT, mode, signame, str(wait_s)],
                              capture_output=True, text=True, timeout=WAIT_S, env=cli_env())

    delivered = run("kept", WAIT_S / 2)  # it ends as soon as the signal comes again
    assert delivered.stdout == kept and delivered.stderr == "", delivered
    if signame == "SIGINT":  # without it, lost: the script waits and then carries on
        lost = run("plain", 2.0)
        assert lost.stdout == "lost\n" and "Exception ignored" in lost.stderr, lost

"""How deep a request goes: the frames of llama-chat's own code from the command's ``main`` to
where it hands a request to the scheduler (``Scheduler.submit``, in the calling thread), and from
the step thread's loop to the CPU operator's decode step (``ml/cpu/decode.py``'s call of
``decode_step``). Library frames (typer, anyio, torch) are not counted. The first chain runs once a
request; the last call of the second is printed, a lone job's token (``BatchCore.step``'s short
path) where the job decodes alone. Their sum is the count from ``main`` to the kernel.

Runs the command in this process with the arguments given and prints each chain on stderr:

    python scripts/call_depth.py -m MODEL -p Hi -n 4 --temperature 0
    python scripts/call_depth.py serve -m MODEL --port 8080     # then send a request, then Ctrl+C

The operator runs where the CPU kernels are built and the model takes them (a float32 model of
10 M parameters or more, 16-bit, int8 or GGUF blocks); for the shipped model only the first chain
is printed.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback

import llama_chat
import llama_chat.ml.cpu.decode as cpu_decode

PACKAGE = os.path.realpath(os.path.dirname(llama_chat.__file__))
SCHEDULER = os.path.join(PACKAGE, "inference", "scheduler.py")
chains: dict[str, list[tuple[str, list[traceback.FrameSummary]]]] = {}
reported = threading.Event()


def ours(stack: traceback.StackSummary) -> list[traceback.FrameSummary]:
    """The frames in the package's files, this script's own left out."""
    here = os.path.realpath(__file__)
    return [f for f in stack if os.path.realpath(f.filename).startswith(PACKAGE) and os.path.realpath(f.filename) != here]


def record(what: str, stack: traceback.StackSummary) -> None:
    chains.setdefault(what, []).append((threading.current_thread().name, ours(stack)))


def at_submit(frame, event, arg) -> None:
    if event == "call" and frame.f_code.co_name == "submit" and os.path.realpath(frame.f_code.co_filename) == SCHEDULER:
        record("Scheduler.submit", traceback.extract_stack(frame))


def recorded_step():
    step = original_step()

    def call(*args, **kwargs):
        record("the operator's decode_step", traceback.extract_stack())
        return step(*args, **kwargs)
    return call


def report() -> None:
    if reported.is_set():
        return
    reported.set()
    sys.setprofile(None)
    for what, seen in chains.items():
        thread, frames = seen[-1]
        print(f"\n{what}: {len(seen)} calls; the last in thread {thread!r}, {len(frames)} frames of ours",
              file=sys.stderr)
        for f in frames:
            print(f"  {os.path.relpath(os.path.realpath(f.filename), PACKAGE)}:{f.lineno} {f.name}", file=sys.stderr)
    if len(chains) == 2:
        print(f"\nboth chains: {sum(len(seen[-1][1]) for seen in chains.values())} frames of ours", file=sys.stderr)
    sys.stderr.flush()


def exit_after_report(status: int) -> None:
    report()
    os_exit(status)


if __name__ == "__main__":
    original_step, cpu_decode._decode_step = cpu_decode._decode_step, recorded_step
    os_exit, os._exit = os._exit, exit_after_report  # the command leaves through os._exit
    atexit.register(report)
    sys.setprofile(at_submit)
    threading.setprofile(at_submit)
    from llama_chat.cmd.main import main

    sys.argv = ["llama-chat", *sys.argv[1:]]
    try:
        main()
    except SystemExit:
        pass
    report()

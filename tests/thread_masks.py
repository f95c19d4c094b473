"""Which threads of a process may take a signal, read from Linux's /proc."""

from __future__ import annotations

from pathlib import Path

from llama_chat.inference.thread_signals import MAIN_THREAD_SIGNALS


def blocked_signals(pid: int | str = "self") -> dict[int, int]:
    """Each live thread's id and its mask of blocked signals (bit ``n - 1`` for signal ``n``)."""
    masks = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        line = next(line for line in status.splitlines() if line.startswith("SigBlk:"))
        masks[int(task.name)] = int(line.split()[1], 16)
    return masks


def mask_of(signums) -> int:
    return sum(1 << (signum - 1) for signum in signums)


def threads_taking_signals(pid: int) -> list[int]:
    """The threads of ``pid`` other than its main thread that leave any of the signals the main
    thread takes unblocked (none, when the command works as it should)."""
    wanted = mask_of(MAIN_THREAD_SIGNALS)
    return sorted(tid for tid, mask in blocked_signals(pid).items() if tid != pid and mask & wanted != wanted)

"""Text typed while a chat's reply streams: kept out of the reply, offered as the next prompt's text.

A terminal in its usual mode echoes every key at once, so keys pressed during a reply land in the
middle of it, and an Enter among them sends them as the next message before they can be read
again. ``held_typing`` turns the echo and line editing off for the reply (signals stay on: Ctrl+C
still stops it), and afterwards takes what was typed from the terminal's input queue, edited as
the terminal would have (Backspace, Ctrl+U, Ctrl+W), for the next prompt to show, editable.
"""

from __future__ import annotations

import os
import select
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

ERASE = {0x7F, 0x08}  # Backspace, as either key sends it
KILL_LINE = 0x15  # Ctrl+U
ERASE_WORD = 0x17  # Ctrl+W
# Most bytes taken from the queue: a terminal's input queue holds a few kilobytes at most.
MOST_BYTES = 1 << 16


@dataclass
class Typed:
    """What was typed during the reply, once it has ended (empty until then)."""

    text: str = ""


def edited(data: bytes) -> str:
    """``data`` as the line a terminal would show after it: erasures applied, line ends as spaces
    (a prompt line holds no line break), other control bytes dropped, invalid UTF-8 replaced."""
    out = bytearray()
    for byte in data:
        if byte in ERASE:
            while out and (out.pop() & 0xC0) == 0x80:  # the whole character: its continuation bytes
                pass
        elif byte == KILL_LINE:
            out.clear()
        elif byte == ERASE_WORD:
            while out and out[-1] == 0x20:
                out.pop()
            while out and out[-1] != 0x20:
                out.pop()
        elif byte in (0x0A, 0x0D):
            if out and out[-1] != 0x20:
                out.append(0x20)
        elif byte >= 0x20 or byte == 0x09:
            out.append(byte)
    return out.decode("utf-8", errors="replace").strip()


@contextmanager
def held_typing(fd: int = 0) -> Iterator[Typed]:
    """Within: keys typed on the terminal ``fd`` are neither echoed nor sent as lines; after:
    ``Typed.text`` is what they spelled. Nothing changes when ``fd`` is not a terminal."""
    typed = Typed()
    try:
        import termios
    except ImportError:  # not a POSIX system
        yield typed
        return
    try:
        saved = termios.tcgetattr(fd)
    except (termios.error, OSError, ValueError):  # not a terminal: a pipe's lines are the next messages
        yield typed
        return
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ICANON)  # ISIG stays: Ctrl+C, Ctrl+Z still work
    quiet[3] |= termios.NOFLSH  # and a Ctrl+C keeps what was typed
    quiet[6] = list(saved[6])
    quiet[6][termios.VMIN], quiet[6][termios.VTIME] = 0, 0
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield typed
    finally:
        try:
            typed.text = edited(_pending(fd))
        finally:
            # TCSANOW, not TCSAFLUSH: what is still queued belongs to the next prompt.
            termios.tcsetattr(fd, termios.TCSANOW, saved)


def _pending(fd: int) -> bytes:
    """The bytes waiting in ``fd``'s input queue, without waiting for more."""
    data = bytearray()
    while len(data) < MOST_BYTES:
        try:
            ready, _, _ = select.select([fd], [], [], 0)
            if not ready:
                break
            chunk = os.read(fd, 4096)
        except (OSError, ValueError, InterruptedError):
            break
        if not chunk:
            break
        data += chunk
    return bytes(data)

"""Showing generated text as it streams: plainly to a pipe, live to a terminal.

The consumer calls ``update`` once per token with the text that token committed and the decoder's
pending state (bytes of an unfinished character, complete code points held back because an emoji
may still grow). Text arrives already displayable: control characters other than newline and tab
have been replaced (``cmd/sanitize.py``).

On a terminal the pending state is shown as dim ASCII dots after the committed text, one per
token whose bytes are still held (one per waiting byte when the caller does not count tokens; at
most ``MAX_MARKERS``), added one by one as tokens arrive and erased with
backspace-space-backspace before the next text is written. Plain ASCII markers have a width every
terminal agrees on, so erasing them never depends on how a terminal measures emoji; and only as
many are drawn as fit before the right edge, because a backspace cannot go back across a line
wrap. Committed text is written once and never redrawn, so a long answer costs O(length) in
total.
"""

from __future__ import annotations

import os
import sys
from typing import Literal, Protocol, TextIO

from rich.cells import cell_len
from rich.console import Console
from rich.style import Style

__all__ = ["LiveRenderer", "OutputClosed", "PlainRenderer", "Renderer", "make_renderer"]

MARKER = "."
MAX_MARKERS = 8
# Cells kept free at the right edge: our column estimate can fall short of the terminal's by a
# cell or two (a wide character pushed early to the next line, emoji widths terminals disagree on).
_EDGE_MARGIN = 2
_TAB = 8

_HIDE_CURSOR = "\x1b[?25l"
_SHOW_CURSOR = "\x1b[?25h"

ColorMode = Literal["auto", "always", "never"]


class OutputClosed(Exception):
    """Whoever read our output has gone away (a closed pipe); the CLI stops quietly."""


class Renderer(Protocol):
    def start(self) -> None:
        """Prepare the output (a terminal hides its cursor)."""

    def update(self, committed: str, pending_bytes: bytes, pending_text: str,
               pending_tokens: int | None = None) -> None:
        """Show ``committed`` (new text, possibly "") and the decoder's current pending state.

        ``pending_tokens`` is how many tokens the pending state holds, when the caller knows it:
        one marker per token then, else one per pending byte.
        """

    def finish(self) -> None:
        """Erase pending markers and restore the terminal. Idempotent; safe after any error."""


class PlainRenderer:
    """For a pipe or a file: committed text only, flushed as it arrives, never an escape code."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._finished = False

    def start(self) -> None:
        pass

    def update(self, committed: str, pending_bytes: bytes, pending_text: str,
               pending_tokens: int | None = None) -> None:
        if not committed:
            return
        try:
            self._stream.write(committed)
            self._stream.flush()  # the reader sees each token now, not when a buffer fills
        except BrokenPipeError as err:
            raise OutputClosed(str(err)) from err

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        try:
            self._stream.flush()
        except (BrokenPipeError, ValueError):
            pass  # closed pipe or closed file: nothing left to restore

    def __enter__(self) -> PlainRenderer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()


class LiveRenderer:
    """For a terminal: streamed text, dim markers for pending tokens, cursor hidden meanwhile.

    ``color=False`` (``NO_COLOR``, ``--color never``) writes no escape sequence at all: markers are
    undimmed and the cursor stays visible. ``finish`` also ends an unfinished line, so whatever is
    printed next (the summary on stderr, the shell prompt) starts at the left edge.
    """

    def __init__(self, console: Console, color: bool = True) -> None:
        self._console = console
        self._color = color
        self._markers = 0  # markers currently on screen, right after the committed text
        self._line_cells = 0  # cells written since the last newline, as rich measures them
        self._cursor_hidden = False
        self._finished = False
        self._dim = Style(dim=True)

    def start(self) -> None:
        if self._color:
            self._write(_HIDE_CURSOR)
            self._cursor_hidden = True

    def update(self, committed: str, pending_bytes: bytes, pending_text: str,
               pending_tokens: int | None = None) -> None:
        if pending_tokens is not None:
            waiting = pending_tokens if pending_bytes or pending_text else 0
        else:
            waiting = len(pending_bytes) + (len(pending_text.encode("utf-8")) if pending_text else 0)
        if not committed:
            # Only the markers change (a byte inside a character): add or remove dots at the end.
            self._write(self._resize_markers(min(waiting, MAX_MARKERS, self._room())))
            return
        parts = [self._erase_markers(), committed]
        self._advance(committed)
        parts.append(self._resize_markers(min(waiting, MAX_MARKERS, self._room())))
        self._write("".join(parts))

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        parts = [self._erase_markers()]
        if self._line_cells:
            parts.append("\n")
            self._line_cells = 0
        if self._cursor_hidden:
            parts.append(_SHOW_CURSOR)
            self._cursor_hidden = False
        try:
            self._write("".join(parts))
        except OutputClosed:
            pass  # the terminal is gone; there is nothing to restore

    def __enter__(self) -> LiveRenderer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()

    # --- helpers ------------------------------------------------------------------------------

    def _erase_markers(self) -> str:
        return self._resize_markers(0)

    def _resize_markers(self, n: int) -> str:
        """Output that turns the markers on screen into ``n`` markers, cursor after them."""
        shown = self._markers
        self._markers = n
        if n > shown:
            dots = MARKER * (n - shown)
            return self._dim.render(dots) if self._color else dots
        d = shown - n  # erase the last d markers: back, blank, back
        return "\b" * d + " " * d + "\b" * d

    def _advance(self, text: str) -> None:
        """Track how many cells the current line holds after writing ``text``."""
        line = text.rsplit("\n", 1)
        if len(line) == 2:
            self._line_cells = 0
        tail = line[-1]
        if "\t" not in tail:
            self._line_cells += cell_len(tail)
            return
        for i, piece in enumerate(tail.split("\t")):
            if i:
                self._line_cells += _TAB - self._column() % _TAB
            self._line_cells += cell_len(piece)

    def _column(self) -> int:
        """The cursor's column, or the width itself when the line is full and about to wrap."""
        width = max(self._console.width, 1)
        if self._line_cells and self._line_cells % width == 0:
            return width
        return self._line_cells % width

    def _room(self) -> int:
        """How many markers fit after the cursor without reaching the right edge."""
        return max(self._console.width - self._column() - _EDGE_MARGIN, 0)

    def _write(self, text: str) -> None:
        if not text:
            return
        out = self._console.file
        try:
            out.write(text)
            out.flush()
        except BrokenPipeError as err:
            raise OutputClosed(str(err)) from err


def make_renderer(
    stdout_is_tty: bool, color_mode: ColorMode | str, stream: TextIO | None = None
) -> Renderer:
    """The renderer for ``stream`` (default: ``sys.stdout`` at call time): live on a terminal,
    plain otherwise.

    Colour (dim markers, cursor hiding) is used on a terminal unless ``color_mode`` is "never", or
    it is "auto" and ``NO_COLOR`` is set to a non-empty value (https://no-color.org) or ``TERM`` is
    "dumb". "always" wins over the environment. A pipe always gets plain text.
    """
    if color_mode not in ("auto", "always", "never"):
        raise ValueError(f"color mode must be auto, always or never, got {color_mode!r}")
    if stream is None:
        stream = sys.stdout
    if not stdout_is_tty:
        return PlainRenderer(stream)
    if color_mode == "auto":
        color = not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"
    else:
        color = color_mode == "always"
    console = Console(file=stream, force_terminal=True, no_color=not color, highlight=False)
    return LiveRenderer(console, color=color)

"""Showing generated text as it streams: plainly to a pipe, live to a terminal.

The consumer calls ``update`` once per token with the text that token committed and the decoder's
pending state (bytes of an unfinished character, complete code points held back because an emoji
may still grow). Text arrives already displayable: control characters other than newline and tab
have been replaced (``cmd/sanitize.py``).

On a terminal the pending state is shown as dim ASCII dots after the committed text, one per
token whose bytes are still held (one per waiting byte when the caller does not count tokens; at
most ``MAX_MARKERS``), added one by one as tokens arrive and erased before the next text is
written. Plain ASCII markers have a width every terminal agrees on, so erasing them never depends
on how a terminal measures emoji; and only as many are drawn as fit before the right edge.
Committed text is written once and never redrawn, so a long answer costs O(length) in total.

Words are wrapped, not cut at the right edge. The renderer keeps the column the text has reached
and the unfinished word at its end; a character that would pass the edge moves that word to the
next line (blanked where it was, written again below: a word's few cells are the only text ever
redrawn), and a space that would pass it becomes the line break. A word longer than a whole line
is broken where the line ends. Widths are rich's cell widths of grapheme clusters (wide CJK, emoji
sequences). The last column is never written: a terminal whose idea of a character's width
differs from ours by a cell then still wraps where we do, and no terminal's handling of a full
line (wrap at once or at the next character) matters.

How markers are erased. With colour (the default) the cursor position right after the committed
text is saved (``ESC 7``) each time text is written, and erasing goes back to it (``ESC 8``) and
clears the rest of the line (``ESC [K``). That also removes whatever the terminal itself drew after
our output: the ``^C`` a terminal echoes for Ctrl+C (two columns, which would otherwise make
relative backspaces erase the echo instead of the markers), or keys typed while the answer streams.
Without colour (``NO_COLOR``, ``--color never``) no escape sequence is written at all, so markers are
erased with backspace-space-backspace, which cannot account for an echo.

When generation is cancelled while bytes of a character are held, the incomplete character is
dropped: the screen keeps exactly the committed text (plus any whole characters that were held
back only because an emoji might have continued), never a U+FFFD for bytes that were cut off.
"""

from __future__ import annotations

import os
import sys
from typing import Literal, Protocol, TextIO

from rich.cells import cell_len
from rich.console import Console
from rich.style import Style

__all__ = ["LiveRenderer", "OutputClosed", "PlainRenderer", "Renderer", "beam_progress_text", "make_renderer"]

MARKER = "."
MAX_MARKERS = 8
# Cells kept free at the right edge: our column estimate can fall short of the terminal's by a
# cell or two (a wide character pushed early to the next line, emoji widths terminals disagree on).
_EDGE_MARGIN = 2
_TAB = 8
# Characters before a new one that are measured with it: enough for the longest emoji sequences
# (a family, a subdivision flag), so that a sequence's width is counted once.
_TAIL = 16

_HIDE_CURSOR = "\x1b[?25l"
_SHOW_CURSOR = "\x1b[?25h"
_SAVE_CURSOR = "\x1b7"
_RESTORE_AND_CLEAR = "\x1b8\x1b[K"

ColorMode = Literal["auto", "always", "never"]


class OutputClosed(Exception):
    """Whoever read our output has gone away (a closed pipe); the CLI stops quietly."""


class Renderer(Protocol):
    def start(self) -> None:
        """Prepare the output (a terminal hides its cursor)."""

    def update(self, committed: str, pending_bytes: bytes, pending_text: str,
               pending_tokens: int | None = None, *, more: bool = False) -> None:
        """Show ``committed`` (new text, possibly "") and the decoder's current pending state.

        ``pending_tokens`` is how many tokens the pending state holds, when the caller knows it:
        one marker per token then, else one per pending byte. ``more``: further updates are
        ready to follow at once; what this one writes may wait for the last of them to be flushed.
        """

    def finish(self) -> None:
        """Erase pending markers and restore the terminal. Idempotent; safe after any error."""

    def think(self, text: str) -> None:
        """Show a piece of a thinking model's thinking (a terminal: dimmed; a pipe: nothing, its
        reader gets the answer only)."""

    def fold(self, summary: str) -> None:
        """The thinking is over: what was shown of it becomes the one line ``summary``."""


def suspend_hooks(renderer: Renderer | None):
    """``(on_suspend, on_resume)`` for Ctrl+Z when ``renderer`` draws on a terminal, else ``(None, None)``."""
    if isinstance(renderer, LiveRenderer):
        return renderer.suspend, renderer.resume
    return None, None


class PlainRenderer:
    """For a pipe or a file: committed text only, flushed as it arrives, never an escape code.

    ``finish`` ends the text with a newline when it does not end with one, as a line-oriented
    tool's output does: ``2>&1`` then puts the finish line on a line of its own, and ``$(...)``
    drops the newline again.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._finished = False
        self._unflushed = False
        self._line_open = False  # text was written since the last newline

    def start(self) -> None:
        pass

    def update(self, committed: str, pending_bytes: bytes, pending_text: str,
               pending_tokens: int | None = None, *, more: bool = False) -> None:
        try:
            if committed:
                self._stream.write(committed)
                self._unflushed = True
                self._line_open = not committed.endswith("\n")
            # The reader sees each token now, not when a buffer fills; tokens that arrived
            # together go out in one write (each flush is a system call, and wakes the reader).
            if self._unflushed and not more:
                self._stream.flush()
                self._unflushed = False
        except BrokenPipeError as err:
            raise OutputClosed(str(err)) from err

    def think(self, text: str) -> None:
        pass  # a pipe carries the answer only

    def fold(self, summary: str) -> None:
        pass

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        try:
            if self._line_open:
                self._stream.write("\n")
                self._line_open = False
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
        self._line_cells = 0  # cells written on the current line, as rich measures them
        self._word = ""  # the unfinished word at the end of the current line (no space yet after it)
        self._word_cells = 0
        self._tail = ""  # the last characters of the current line, to measure the next one in its cluster
        self._soft_break = False  # the current line began where a space was turned into a line break
        self._cursor_hidden = False
        self._finished = False
        self._saved = False  # a cursor position after the committed text is saved (colour only)
        self._dim = Style(dim=True)
        self._thought_lines: int | None = None  # line breaks written since the thinking began

    def start(self) -> None:
        if self._color:
            self._write(_HIDE_CURSOR)
            self._cursor_hidden = True

    def update(self, committed: str, pending_bytes: bytes, pending_text: str,
               pending_tokens: int | None = None, *, more: bool = False) -> None:
        if pending_tokens is not None:
            waiting = pending_tokens if pending_bytes or pending_text else 0
        else:
            waiting = len(pending_bytes) + (len(pending_text.encode("utf-8")) if pending_text else 0)
        if not committed:
            # Only the markers change (a byte inside a character): add or remove dots at the end.
            self._write(self._resize_markers(min(waiting, MAX_MARKERS, self._room())))
            return
        parts = [self._erase_markers(), self._flow(committed)]
        parts.append(self._save_point())
        parts.append(self._resize_markers(min(waiting, MAX_MARKERS, self._room())))
        self._write("".join(parts))

    def think(self, text: str) -> None:
        """The thinking, dimmed, wrapped as the answer is; its lines are counted so that ``fold``
        can take them back."""
        if self._thought_lines is None:
            self._thought_lines = 0
        if not text:
            return
        flowed = self._flow(text)
        self._thought_lines += flowed.count("\n")
        shown = self._dim.render(flowed) if self._color else flowed
        self._write(self._erase_markers() + shown + self._save_point())

    def fold(self, summary: str) -> None:
        """The thinking's lines taken back (with colour: the cursor goes up to where it began and
        clears the screen below; lines already scrolled out of sight stay in the scrollback) and
        ``summary`` written dimmed on a line of its own. Without colour nothing can be taken back:
        the summary follows the thinking."""
        lines, self._thought_lines = self._thought_lines or 0, None
        if self._color:
            up = f"\x1b[{lines}A" if lines else ""
            out = self._erase_markers(clear=True) + "\r" + up + "\x1b[J" + self._dim.render(summary) + "\n"
        else:
            out = self._erase_markers() + ("\n" if self._line_cells else "") + summary + "\n"
        self._new_line()
        self._saved = False
        self._write(out)

    def suspend(self) -> None:
        """Before the process stops (Ctrl+Z): markers erased, cursor shown."""
        parts = [self._erase_markers(clear=True)]
        if self._cursor_hidden:
            parts.append(_SHOW_CURSOR)
        try:
            self._write("".join(parts))
        except OutputClosed:
            pass

    def resume(self) -> None:
        """After ``fg``: the shell has written its lines, so a new line starts where the cursor is."""
        self._new_line()
        self._saved = False
        try:
            if self._cursor_hidden:
                self._write(_HIDE_CURSOR)
        except OutputClosed:
            pass

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        parts = [self._erase_markers(clear=True)]
        if self._line_cells:
            parts.append("\n")
            self._new_line()
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

    def _save_point(self) -> str:
        """Remember where the committed text ends (colour only), unless the line is full: there a
        terminal's cursor sits on the last character, which clearing from it would erase."""
        if not self._color:
            return ""
        self._saved = self._column() < max(self._console.width, 1)
        return _SAVE_CURSOR if self._saved else ""

    def _erase_markers(self, clear: bool = False) -> str:
        """Output that removes the markers; with ``clear`` also anything drawn after them."""
        if self._saved and (self._markers or clear):
            self._markers = 0
            return _RESTORE_AND_CLEAR
        return self._resize_markers(0)

    def _resize_markers(self, n: int) -> str:
        """Output that turns the markers on screen into ``n`` markers, cursor after them."""
        shown = self._markers
        if n > shown:
            self._markers = n
            dots = MARKER * (n - shown)
            return self._dim.render(dots) if self._color else dots
        if n < shown and self._saved:
            self._markers = n
            dots = MARKER * n
            return _RESTORE_AND_CLEAR + (self._dim.render(dots) if dots else "")
        self._markers = n
        d = shown - n  # erase the last d markers: back, blank, back
        return "\b" * d + " " * d + "\b" * d

    def _flow(self, text: str) -> str:
        """``text`` as written to the terminal: wrapped at word boundaries (see the module's
        docstring), with the column, the current word and the line's tail kept up to date."""
        limit = max(self._console.width - 1, 1)  # the last column stays empty
        out: list[str] = []
        for ch in text:
            if ch == "\n":
                out.append(ch)
                self._new_line()
                continue
            if ch in " \t":
                self._word, self._word_cells = "", 0
                if self._soft_break and self._line_cells == 0:
                    continue  # the line break already stands for this space
                cells = 1 if ch == " " else _TAB - self._line_cells % _TAB
                if self._line_cells + cells > limit:
                    out.append("\n")
                    self._new_line(soft=True)
                    continue
                out.append(ch)
                self._line_cells += cells
                self._tail = (self._tail + ch)[-_TAIL:]
                continue
            cells = cell_len(self._tail + ch) - cell_len(self._tail)
            if self._line_cells > 0 and self._line_cells + cells > limit:
                word, n = self._word, self._word_cells
                if 0 < n < self._line_cells and n + cells <= limit:
                    # The word began after a space on this line: blank it there, start the next with it.
                    out.append("\b" * n + " " * n + "\n" + word)
                    self._new_line(soft=True)
                    self._word, self._word_cells, self._line_cells, self._tail = word, n, n, word[-_TAIL:]
                else:  # no room for the word on any line: it is broken here
                    out.append("\n")
                    self._new_line(soft=True)
                    cells = cell_len(ch)
            out.append(ch)
            self._line_cells = max(self._line_cells + cells, 0)
            self._word += ch
            self._word_cells += cells
            self._tail = (self._tail + ch)[-_TAIL:]
        return "".join(out)

    def _new_line(self, *, soft: bool = False) -> None:
        self._line_cells = 0
        self._word, self._word_cells, self._tail = "", 0, ""
        self._soft_break = soft

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


def beam_progress_text(step: int, finished: int, num_beams: int, elapsed_s: float) -> str:
    """The progress line of a beam search, which is not streamed: how far it is and how many of
    its hypotheses have finished."""
    return f"beam search: {step} tokens, {finished} of {num_beams} beams finished, {elapsed_s:.1f} s"

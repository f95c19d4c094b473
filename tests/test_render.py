"""Renderers: exact text to a pipe; on a terminal, markers that vanish and a restored cursor."""

from __future__ import annotations

import io
import os
import re
import signal
from dataclasses import dataclass, field
from functools import partial

import anyio
import pytest
from rich.cells import cell_len
from rich.console import Console

from llama_chat.cmd.render import (
    MARKER,
    LiveRenderer,
    OutputClosed,
    PlainRenderer,
    make_renderer,
)
from llama_chat.inference.decoding import StreamDecoder

FAMILY = "\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466"
TEXT = (
    f"Hello {FAMILY} and 日本語, caf\u00e9 \U0001F1EB\U0001F1F7!\n"
    "Second\tline \u2764\ufe0f ok"
)

_SGR = re.compile(r"\x1b\[[0-9;]*m")
_CURSOR = re.compile(r"\x1b\[\?25[hl]")
_SAVE, _RESTORE, _CLEAR_EOL = "\x1b7", "\x1b8", "\x1b[K"


@dataclass
class Screen:
    """A tiny terminal: one or two cells per code point as rich measures it (joiners and marks
    join the character before), backspace stops at the left edge, lines wrap at ``width`` (xterm
    style: a full line wraps when the next character arrives)."""

    width: int = 10_000
    rows: list[list[str]] = field(default_factory=lambda: [[]])
    col: int = 0
    cursor_visible: bool = True
    cursor_log: list[bool] = field(default_factory=list)
    max_col_seen: int = 0
    saved: tuple[int, int] = (0, 0)

    def feed(self, out: str) -> None:
        i = 0
        while i < len(out):
            if out.startswith(_SAVE, i):
                self.saved = (len(self.rows) - 1, self.col)
                i += len(_SAVE)
                continue
            if out.startswith(_RESTORE, i):
                row, self.col = self.saved
                del self.rows[row + 1:]
                i += len(_RESTORE)
                continue
            if out.startswith(_CLEAR_EOL, i):
                del self.rows[-1][self.col:]
                i += len(_CLEAR_EOL)
                continue
            if out[i] == "\x1b":
                m = _CURSOR.match(out, i) or _SGR.match(out, i)
                assert m, f"unexpected escape sequence at {out[i:i + 10]!r}"
                if m.re is _CURSOR:
                    self.cursor_visible = m.group().endswith("h")
                    self.cursor_log.append(self.cursor_visible)
                i = m.end()
                continue
            ch = out[i]
            i += 1
            if ch == "\n":
                self.rows.append([])
                self.col = 0
            elif ch == "\b":
                self.col = max(self.col - 1, 0)
            elif ch == "\r":
                self.col = 0
            else:
                cells = cell_len(ch)
                row = self.rows[-1]
                if cells == 0:  # a combining mark or joiner: part of the character before it
                    if self.col and len(row) >= self.col:
                        row[self.col - 1] += ch
                    continue
                if self.col + cells > self.width:
                    self.rows.append([])
                    self.col = 0
                    row = self.rows[-1]
                row.extend(" " * (self.col + cells - len(row)))
                if row[self.col] == "" and self.col:  # over the right half of a wide character
                    row[self.col - 1] = " "
                if self.col + cells < len(row) and row[self.col + cells] == "":
                    row[self.col + cells] = " "  # the right half of a wide character written over
                row[self.col] = ch
                if cells == 2:
                    row[self.col + 1] = ""  # the wide character's right half
                self.col += cells
                self.max_col_seen = max(self.max_col_seen, self.col)

    def lines(self) -> list[str]:
        return ["".join(r).rstrip(" ") for r in self.rows]

    def visible(self) -> str:
        return "\n".join(self.lines()).rstrip("\n")


def visible_text(text: str) -> str:
    return "\n".join(line.rstrip(" ") for line in text.split("\n")).rstrip("\n")


def stream_through(
    renderer, text: str, screen: Screen | None = None, out: io.StringIO | None = None
):
    """Spell ``text`` byte by byte through a StreamDecoder into ``renderer``, as the CLI does.

    With ``screen`` and ``out``, returns what the screen shows after every byte.
    """
    dec = StreamDecoder()
    renderer.start()
    snapshots = []
    for b in text.encode():
        renderer.update(dec.feed(bytes([b])), dec.pending_bytes, dec.pending_text)
        if screen is not None and out is not None:
            screen.feed(out.getvalue())
            out.seek(0)
            out.truncate()
            snapshots.append(screen.visible())
    renderer.update(dec.flush(), b"", "")
    renderer.finish()
    return snapshots


# --- PlainRenderer --------------------------------------------------------------------------------


class CountingFlush(io.StringIO):
    flushes = 0

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


def test_plain_writes_exactly_the_committed_text_and_flushes():
    out = CountingFlush()
    stream_through(PlainRenderer(out), TEXT)
    assert out.getvalue() == TEXT + "\n"  # the last line ended, as a line-oriented tool's
    assert "\x1b" not in out.getvalue() and "\b" not in out.getvalue()
    assert out.flushes >= TEXT.count(" ")  # flushed per token that committed text


def test_plain_writes_tokens_that_came_together_in_one_flush():
    out = CountingFlush()
    renderer = PlainRenderer(out)
    renderer.update("one ", b"", "", more=True)
    renderer.update("two ", b"", "", more=True)
    assert out.flushes == 0
    renderer.update("", b"\xe2", "", more=False)  # the last of them commits nothing: still flushed
    assert out.flushes == 1 and out.getvalue() == "one two "
    renderer.update("", b"", "", more=False)  # nothing written since: no flush
    assert out.flushes == 1


def test_plain_ends_the_last_line_once_and_only_after_text():
    for committed, expected in (("one\ntwo", "one\ntwo\n"), ("done\n", "done\n"), ("", "")):
        out = io.StringIO()
        with PlainRenderer(out) as renderer:
            renderer.update(committed, b"", "")
        renderer.finish()
        assert out.getvalue() == expected


def test_plain_raises_output_closed_on_a_closed_pipe():
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    stream = os.fdopen(write_fd, "w", encoding="utf-8")
    renderer = PlainRenderer(stream)
    renderer.start()
    with pytest.raises(OutputClosed):
        renderer.update("hello", b"", "")
    renderer.finish()  # quiet, and again
    renderer.finish()
    try:
        stream.close()
    except BrokenPipeError:
        pass  # the unflushed "hello" still sits in the buffer


# --- LiveRenderer ---------------------------------------------------------------------------------


def live(width: int = 80, color: bool = True) -> tuple[LiveRenderer, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=width, no_color=not color)
    return LiveRenderer(console, color=color), out


@pytest.mark.parametrize("color", [True, False])
def test_live_final_screen_is_the_text(color):
    renderer, out = live(color=color)
    screen = Screen()
    snapshots = stream_through(renderer, TEXT, screen, out)
    assert screen.visible() == visible_text(TEXT)
    # Markers were shown while bytes were pending, and only then.
    assert any(s.endswith(MARKER) for s in snapshots)
    assert all(MARKER not in s for s in snapshots if not s.endswith(MARKER))


def test_live_family_emoji_appears_whole_and_markers_count_waiting_bytes():
    renderer, out = live()
    screen = Screen()
    snapshots = stream_through(renderer, f"a{FAMILY} b", screen, out)
    for snap in snapshots:
        assert "\U0001F468" not in snap or FAMILY in snap  # never a lone face on screen
    assert snapshots[1:4] == ["a.", "a..", "a..."]  # first face, 1-3 bytes in
    assert snapshots[-3] == "a" + "." * 8  # capped at MAX_MARKERS
    assert snapshots[-2] == f"a{FAMILY}"  # whole, with the space that released it


def test_live_hides_the_cursor_while_streaming_and_restores_it():
    renderer, out = live()
    screen = Screen()
    stream_through(renderer, TEXT, screen)
    screen.feed(out.getvalue())
    assert screen.cursor_log == [False, True]
    assert out.getvalue().startswith("\x1b[?25l") and out.getvalue().endswith("\x1b[?25h")


def test_live_without_color_writes_no_escape_at_all():
    renderer, out = live(color=False)
    stream_through(renderer, TEXT)
    assert "\x1b" not in out.getvalue()
    screen = Screen()
    screen.feed(out.getvalue())
    assert screen.visible() == visible_text(TEXT)


def test_live_finish_is_idempotent_and_restores_on_errors():
    renderer, out = live()
    with pytest.raises(RuntimeError):
        with renderer:
            renderer.update("partial ", b"\xf0\x9f", "")
            raise RuntimeError("generation failed")
    written = out.getvalue()
    renderer.finish()
    assert out.getvalue() == written  # the second finish writes nothing
    screen = Screen()
    screen.feed(written)
    assert screen.visible() == "partial" and screen.cursor_visible
    assert screen.col == 0  # the unfinished line was ended


def test_live_finish_without_start_or_text_writes_nothing():
    renderer, out = live()
    renderer.finish()
    assert out.getvalue() == ""


def test_live_markers_never_cross_the_right_edge():
    # ASCII text so that this screen's one-cell-per-character model is exact.
    width = 20
    text = ("word " * 30).strip() + " \U0001F600 end"
    renderer, out = live(width=width)
    screen = Screen(width=width)
    snapshots = stream_through(renderer, text, screen, out)
    assert screen.max_col_seen <= width - 1
    assert screen.lines() == ["word word word word"] * 7 + ["word word \U0001F600 end"]
    assert any(s.endswith(MARKER) for s in snapshots)


PROSE = ("The quick brown fox jumps over the lazy dog while a remarkably unhurried tortoise considers "
         "its options, supercalifragilisticexpialidocious-and-then-some, 日本語の文章も 折り返す 🐱 done.")


@pytest.mark.parametrize("color", [True, False])
@pytest.mark.parametrize("width", [12, 20, 31])
def test_live_wraps_at_spaces_and_never_splits_a_word_that_fits(color, width):
    renderer, out = live(width=width, color=color)
    screen = Screen(width=width)
    stream_through(renderer, PROSE, screen, out)
    screen.feed(out.getvalue())
    lines = screen.lines()[:-1]  # finish ended the last line
    assert screen.max_col_seen <= width - 1  # the last column is never written
    assert all(cell_len(line) <= width - 1 for line in lines)
    # Nothing lost, nothing reordered; every word that fits on a line is whole on one.
    assert "".join("".join(lines).split()) == "".join(PROSE.split())
    for word in PROSE.split():
        if cell_len(word) <= width - 1:
            assert any(word in line.split() for line in lines), (word, lines)
    assert any(cell_len(word) > width - 1 for word in PROSE.split())  # and one that is broken


def test_live_a_word_arriving_in_pieces_moves_to_the_next_line_whole():
    renderer, out = live(width=16)
    screen = Screen(width=16)
    renderer.start()
    for piece in ("one two", " three", " sup", "er", "cal", "if", "rag", " end"):
        renderer.update(piece, b"", "")
    renderer.finish()
    screen.feed(out.getvalue())
    assert screen.lines() == ["one two three", "supercalifrag", "end", ""]


def test_live_a_word_longer_than_a_line_is_broken_at_the_edge():
    renderer, out = live(width=8)
    screen = Screen(width=8)
    renderer.start()
    renderer.update("ab " + "x" * 16 + " cd", b"", "")
    renderer.finish()
    screen.feed(out.getvalue())
    assert screen.lines() == ["ab", "xxxxxxx", "xxxxxxx", "xx cd", ""]


def test_live_wide_characters_and_emoji_sequences_count_their_cells():
    renderer, out = live(width=8)
    renderer.start()
    renderer.update(f"日本 {FAMILY} 語 ok", b"", "")
    renderer.finish()
    written = _SGR.sub("", _CURSOR.sub("", out.getvalue()))
    for sequence in (_SAVE, _RESTORE, _CLEAR_EOL):
        written = written.replace(sequence, "")
    # 日本 (4 cells), a space, the family (2 cells: one cluster, not four faces) fill the 7 cells
    # before the last column: the next space is the line break.
    assert written.split("\n")[:2] == [f"日本 {FAMILY}", "語 ok"]


def test_live_text_with_newlines_and_indentation_keeps_them():
    renderer, out = live(width=40)
    screen = Screen(width=40)
    stream_through(renderer, "def f():\n    return 1\n\n  - item", screen, out)
    assert screen.lines()[:4] == ["def f():", "    return 1", "", "  - item"]


def test_live_markers_skipped_when_the_line_is_full():
    renderer, out = live(width=10)
    renderer.start()
    renderer.update("123456789", b"\xf0\x9f", "")  # 9 cells: two markers would not fit
    assert MARKER not in out.getvalue()
    renderer.update("", b"\xf0\x9f\x98", "")
    assert MARKER not in out.getvalue()
    renderer.finish()


def test_live_markers_count_wide_characters_as_two_cells():
    renderer, out = live(width=12)
    renderer.update("日本語", b"", "\U0001F1EB")  # 6 cells used; 4 waiting bytes
    assert out.getvalue().count(MARKER) == 4  # 12 - 6 - 2 cells of margin: exactly room for 4
    renderer.update("", b"\xf0\x9f", "\U0001F1EB")  # 6 waiting now, still room for 4
    assert out.getvalue().count(MARKER) == 4
    renderer.finish()


def test_live_broken_pipe_becomes_output_closed():
    class Broken(io.StringIO):
        def write(self, s: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    console = Console(file=Broken(), force_terminal=True)
    renderer = LiveRenderer(console, color=True)
    with pytest.raises(OutputClosed):
        renderer.start()
    renderer.finish()  # quiet


@pytest.mark.parametrize("color", [True, False])
def test_live_a_second_signal_erases_the_markers_before_the_process_leaves(monkeypatch, color):
    """The watcher's hard exit (a second Ctrl+C while a reply winds down) runs the renderer's
    ``suspend`` first, as ``run_one_shot`` wires it: the screen keeps the text, not the markers."""
    from llama_chat.cmd import signals as cli_signals

    renderer, out = live(color=color)
    renderer.start()
    renderer.update("caf\u00e9 ", b"\xf0\x9f\x90", "", 3)
    assert MARKER * 3 in _SGR.sub("", out.getvalue())
    shown_at_exit = []
    monkeypatch.setattr(cli_signals, "hard_exit", lambda signum, **kwargs: shown_at_exit.append(out.getvalue()))
    stop = cli_signals.StopRequest()

    async def main():
        async with anyio.create_task_group() as tg:
            generation = anyio.CancelScope()
            await tg.start(partial(cli_signals.watch_signals, on_exit=renderer.suspend), generation, stop)
            with generation:
                os.kill(os.getpid(), signal.SIGINT)
                await anyio.sleep(60)
            os.kill(os.getpid(), signal.SIGINT)  # the second: the process would leave now
            with anyio.move_on_after(60):
                while not shown_at_exit:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert shown_at_exit, "the second signal did not reach the watcher"
    screen = Screen()
    screen.feed(shown_at_exit[0])
    assert screen.visible() == "caf\u00e9" and screen.cursor_visible


# --- make_renderer --------------------------------------------------------------------------------


def test_make_renderer_pipe_is_plain_whatever_the_color_mode():
    for mode in ("auto", "always", "never"):
        assert isinstance(make_renderer(False, mode, io.StringIO()), PlainRenderer)


@pytest.mark.parametrize(
    ("mode", "env", "color"),
    [
        ("auto", {}, True),
        ("auto", {"NO_COLOR": "1"}, False),
        ("auto", {"NO_COLOR": ""}, True),  # no-color.org: only a non-empty value counts
        ("auto", {"TERM": "dumb"}, False),
        ("always", {"NO_COLOR": "1"}, True),
        ("never", {}, False),
    ],
)
def test_make_renderer_terminal_color(monkeypatch, mode, env, color):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = io.StringIO()
    renderer = make_renderer(True, mode, out)
    assert isinstance(renderer, LiveRenderer)
    stream_through(renderer, f"x {FAMILY} y")
    assert ("\x1b" in out.getvalue()) is color


def test_make_renderer_rejects_unknown_modes():
    with pytest.raises(ValueError, match="auto, always or never"):
        make_renderer(True, "sometimes", io.StringIO())

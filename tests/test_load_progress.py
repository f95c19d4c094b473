"""The loading progress bar shows only on a terminal and only for big checkpoints."""

from __future__ import annotations

import io

from rich.console import Console

from llama_chat.cmd.load_progress import load_progress, progress_callback


def _drive(console: Console, total: int, min_bytes: int) -> None:
    with load_progress("model", console=console, min_bytes=min_bytes) as on_progress:
        for done in range(0, total + 1, total // 4):
            on_progress(done, total)


def test_bar_on_a_terminal_for_a_big_checkpoint():
    out = io.StringIO()
    _drive(Console(file=out, force_terminal=True, width=80), total=1000, min_bytes=500)
    assert "loading model" in out.getvalue()


def test_nothing_for_a_small_checkpoint_or_a_pipe():
    small, pipe = io.StringIO(), io.StringIO()
    _drive(Console(file=small, force_terminal=True, width=80), total=1000, min_bytes=5000)
    _drive(Console(file=pipe, force_terminal=False, width=80), total=1000, min_bytes=500)
    assert small.getvalue() == "" and pipe.getvalue() == ""


def test_plain_callback_closes_its_bar_when_done():
    out = io.StringIO()
    on_progress = progress_callback(Console(file=out, force_terminal=True, width=80), min_bytes=10)
    for done in (0, 50, 100):
        on_progress(done, 100)
    assert "loading model" in out.getvalue()
    assert on_progress._progress is None  # stopped: nothing keeps redrawing

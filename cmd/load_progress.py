"""A progress bar for loading big checkpoints, drawn on stderr only when a person is watching.

Usage::

    with load_progress(str(path)) as on_progress:
        loaded = load_model(path, on_progress=on_progress)

or, without a with-block, ``load_model(path, on_progress=progress_callback(console))``: that bar
closes itself when the last byte is reported (the with-block also closes it when loading fails).

The bar appears only when stderr is a terminal and the checkpoint is large enough for loading to
take a noticeable time; pipes, logs and small models see nothing. It is transient: once loading is
done (or fails) it is erased, so it never mixes with the model's output.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

# Below this a load is quick enough that a bar would only flicker.
MIN_BYTES = 200 * 1024 * 1024


class _LazyBar:
    """An ``on_progress(done, total)`` callback that decides on its first call whether to draw."""

    def __init__(self, label: str, console: Console, min_bytes: int) -> None:
        self._label = label
        self._console = console
        self._min_bytes = min_bytes
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._decided = False

    def __call__(self, done: int, total: int) -> None:
        if not self._decided:
            self._decided = True
            if self._console.is_terminal and total >= self._min_bytes:
                self._progress = Progress(
                    TextColumn("loading {task.description}"), BarColumn(), DownloadColumn(),
                    TimeRemainingColumn(), console=self._console, transient=True,
                )
                self._task = self._progress.add_task(self._label, total=total)
                self._progress.start()
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=done, total=total)
            if done >= total:
                self.close()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


@contextmanager
def load_progress(label: str, *, min_bytes: int = MIN_BYTES, console: Console | None = None) -> Iterator[_LazyBar]:
    """Yield a callback for ``load_model(on_progress=...)``; the bar is removed on exit."""
    bar = _LazyBar(label, console or Console(stderr=True), min_bytes)
    try:
        yield bar
    finally:
        bar.close()


def progress_callback(console: Console | None = None, *, label: str = "model",
                      min_bytes: int = MIN_BYTES) -> _LazyBar:
    """A callback for ``load_model(on_progress=...)`` that closes its bar once loading is done."""
    return _LazyBar(label, console or Console(stderr=True), min_bytes)

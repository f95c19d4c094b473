"""One prompt, one answer: the producer, the consumer and the signal watcher in one task group.

::

    task group
    ├── watch_signals      first SIGINT/SIGTERM/SIGHUP cancels `generation`; a second exits at once
    ├── watch_reader       stdout a pipe: its reader leaving cancels `generation` (even mid-prefill)
    └── generation scope
        └── engine.stream  producer task: forward steps in a worker thread -> bounded channel
            consumer        (this function's body): bytes -> StreamDecoder -> renderer

Whatever ends the stream (a stop token, the budget, a signal, a closed stdout, an error), the
decoder is flushed and the renderer finished, so committed text stays and the terminal is restored.
A stream that was cut off (a signal, a closed stdout) drops the bytes of a character it never
finished instead of showing them as U+FFFD.
"""

from __future__ import annotations

import os
import select
import stat
from collections import deque
from dataclasses import dataclass
from functools import partial

import anyio

from llama_chat.cmd.render import OutputClosed, Renderer, suspend_hooks
from llama_chat.cmd.sanitize import displayable
from llama_chat.cmd.signals import StopRequest, watch_signals
from llama_chat.inference.decoding import StreamDecoder
from llama_chat.inference.engine import Engine
from llama_chat.inference.errors import sole_exception
from llama_chat.inference.results import Completion, Tally
from llama_chat.inference.types import Request


@dataclass(frozen=True)
class Outcome:
    completion: Completion
    signum: int | None  # the signal that stopped generation, if one did
    output_closed: bool  # stdout's reader went away


# How often a pipe on stdout is checked for a reader that has gone while nothing is written.
READER_POLL_S = 0.1


def watched_pipe(fd: int | None) -> int | None:
    """``fd`` when it is a pipe or socket whose reader can leave unnoticed, else None."""
    if fd is None or not hasattr(select, "poll"):
        return None
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return None
    return fd if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) else None


async def watch_reader(fd: int, scope: anyio.CancelScope, consumer: _Consumer) -> None:
    """Cancel ``scope`` once the reader of pipe ``fd`` has gone.

    A write would say so, but nothing is written during a long prefill; the write end of a pipe
    reports POLLERR as soon as its read end is closed, so the prefill stops at its next chunk.
    """
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR and POLLHUP are always reported
    while True:
        if any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0)):
            consumer.output_closed = True
            scope.cancel()
            return
        await anyio.sleep(READER_POLL_S)


async def run_one_shot(engine: Engine, request: Request, renderer: Renderer | None, *,
                       strip_leading_space: bool = False, output_fd: int | None = None) -> Outcome:
    """Generate ``request``, rendering as it goes (``renderer`` None: collect only, for ``--json``).

    ``strip_leading_space`` drops one space from the start of the answer: SentencePiece spells a
    reply's first word with the word-start marker, which only makes sense when continuing text.
    ``output_fd``: the file descriptor the answer goes to; when it is a pipe, a reader that leaves
    stops generation even before anything was written.
    """
    consumer = _Consumer(renderer, strip_leading_space)
    stop = StopRequest()
    tally = Tally(request.request_id, len(request.prompt_ids))
    on_suspend, on_resume = suspend_hooks(renderer)
    pipe = watched_pipe(output_fd)
    try:
        try:
            async with anyio.create_task_group() as tg:
                generation = anyio.CancelScope()
                await tg.start(partial(watch_signals, on_suspend=on_suspend, on_resume=on_resume), generation, stop)
                if pipe is not None:
                    tg.start_soon(watch_reader, pipe, generation, consumer)
                with generation:
                    consumer.start()
                    async with engine.stream(request) as events:
                        async for event in events:
                            tally.add(event)
                            consumer.feed(event.data)
                tg.cancel_scope.cancel()  # generation is over: stop listening for signals here
        except BaseExceptionGroup as group:
            error = sole_exception(group)
            if not isinstance(error, OutputClosed):
                raise error from None
            consumer.output_closed = True  # not a failure: nobody is reading any more
        # A stream that ends without a finishing event (a signal, a closed stdout) keeps Tally's
        # default reason, cancelled. Pending text is flushed whatever ended it; bytes of a
        # character cut off by a cancel are dropped.
        consumer.flush(cut_off=stop.signum is not None or consumer.output_closed)
    finally:
        consumer.finish()
    return Outcome(tally.completion(consumer.text), stop.signum, consumer.output_closed)


def _tokens_holding(lengths: deque[int], held: int) -> int:
    """How many of the last tokens (by byte length, newest last) the held suffix reaches into.

    What the decoder holds is always a suffix of the bytes fed, valid UTF-8 or raw bytes alike,
    so it is covered by the fewest recent tokens whose lengths add up to it.
    """
    count = covered = 0
    for n in reversed(lengths):
        if covered >= held:
            break
        covered += n
        count += 1
    return count


class _Consumer:
    """Token bytes -> StreamDecoder -> renderer; remembers everything it committed."""

    def __init__(self, renderer: Renderer | None, strip_leading_space: bool = False) -> None:
        self.renderer = renderer
        self._strip = strip_leading_space
        self.decoder = StreamDecoder()
        self.parts: list[str] = []
        self.pending_tokens = 0  # tokens whose bytes are (partly) held by the decoder
        self._recent: deque[int] = deque(maxlen=64)  # byte lengths of the last tokens fed
        self.output_closed = False

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def start(self) -> None:
        self._render(lambda r: r.start())

    def feed(self, data: bytes) -> None:
        if self._strip and data:
            self._strip = False
            if data.startswith(b" "):
                data = data[1:]
        text = self.decoder.feed(data)
        self.parts.append(text)
        decoder = self.decoder
        if data:
            self._recent.append(len(data))
        self.pending_tokens = _tokens_holding(self._recent, len(decoder.pending_bytes)
                                              + len(decoder.pending_text.encode("utf-8")))
        # The renderer raises OutputClosed from here when stdout's reader has gone away.
        if self.renderer is not None and not self.output_closed:
            self.renderer.update(displayable(text), decoder.pending_bytes, decoder.pending_text,
                                 self.pending_tokens)

    def flush(self, cut_off: bool = False) -> None:
        if cut_off:
            text = self.decoder.pending_text  # whole characters only
            self.decoder.flush()
        else:
            text = self.decoder.flush()
        self.parts.append(text)
        self.pending_tokens = 0
        self._render(lambda r: r.update(displayable(text), b"", "", 0))

    def finish(self) -> None:
        self._render(lambda r: r.finish())

    def _render(self, action) -> None:
        if self.renderer is None or self.output_closed:
            return
        try:
            action(self.renderer)
        except OutputClosed:
            self.output_closed = True

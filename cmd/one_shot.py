"""One prompt, one answer: the producer, the consumer and the signal watcher in one task group.

::

    task group
    ├── watch_signals      first SIGINT/SIGTERM/SIGHUP cancels `scope`; a second exits at once
    ├── watch_reader       stdout a pipe: its reader leaving cancels `scope` (even mid-prefill)
    └── scope
        └── source.stream  producer task: forward steps in a worker thread -> bounded channel
            consumer        (this function's body): Response (text made in inference/) -> renderer

Whatever ends the stream (a stop token or string, the budget, a signal, a closed stdout, an
error), held text is released and the renderer finished, so committed text stays and the
terminal is restored.
A stream that was cut off (a signal, a closed stdout) drops the bytes of a character it never
finished instead of showing them as U+FFFD.
"""

from __future__ import annotations

import os
import select
import stat
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import anyio

from llama_chat.cmd.render import OutputClosed, Renderer, suspend_hooks
from llama_chat.cmd.sanitize import displayable
from llama_chat.cmd.signals import StopRequest, watch_signals
from llama_chat.inference.text_stream import TextStream, reply_text
from llama_chat.inference.types import BeamCompletion, Completion, Request, Response, Tally, sole_exception

if TYPE_CHECKING:
    from llama_chat.cmd.generation_source import Source
    from llama_chat.inference.beam import BeamProgress


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


async def watch_reader(fd: int, scope: anyio.CancelScope, view: TextView) -> None:
    """Cancel ``scope`` once the reader of pipe ``fd`` has gone.

    A write would say so, but nothing is written during a long prefill; the write end of a pipe
    reports POLLERR as soon as its read end is closed, so the prefill stops at its next chunk.
    """
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR and POLLHUP are always reported
    while True:
        if any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0)):
            view.output_closed = True
            scope.cancel()
            return
        await anyio.sleep(READER_POLL_S)


async def run_one_shot(source: Source, request: Request, renderer: Renderer | None, *,
                       output_fd: int | None = None, hide_thinking: bool = False) -> Outcome:
    """Generate ``request``, rendering as it goes (``renderer`` None: collect only, for ``--json``).

    ``output_fd``: the file descriptor the answer goes to; when it is a pipe, a reader that leaves
    stops generation even before anything was written. The chat runs each reply through here too.
    ``hide_thinking``: a thinking model's thinking is not shown, only the line that folds it.
    """
    view = TextView(renderer, hide_thinking=hide_thinking)
    stop = StopRequest()
    on_suspend, on_resume = suspend_hooks(renderer)
    pipe = watched_pipe(output_fd)
    generation: TextStream | None = None
    try:
        try:
            async with anyio.create_task_group() as tg:
                scope = anyio.CancelScope()
                # A hard exit (a second signal) leaves the screen as a stop does: markers erased.
                await tg.start(partial(watch_signals, on_suspend=on_suspend, on_resume=on_resume,
                                       on_exit=on_suspend), scope, stop)
                if pipe is not None:
                    tg.start_soon(watch_reader, pipe, scope, view)
                with scope:
                    view.start()
                    async with source.stream(request) as generation:
                        async for response in generation:
                            view.show(response, more=generation.ready() > 0)
                tg.cancel_scope.cancel()  # generation is over: stop listening for signals here
        except BaseExceptionGroup as group:
            error = sole_exception(group)
            if not isinstance(error, OutputClosed):
                raise error from None
            view.output_closed = True  # not a failure: nobody is reading any more
        if generation is None:  # stopped before the stream began (a signal during the check)
            generation = TextStream(request, reply_text(request), Tally(request.request_id, len(request.prompt_ids)))
        # A stream that ends without a finishing event (a signal, a closed stdout) is cancelled:
        # the whole characters still held are shown, the bytes of a cut-off character dropped.
        view.show_text(generation.cut_off())
    finally:
        view.finish()
    return Outcome(generation.completion(), stop.signum, view.output_closed)


class TextView:
    """Responses -> renderer; after stdout's reader has gone, nothing more is drawn.

    A thinking model's thinking is drawn as it comes (unless ``hide_thinking``); once its answer
    starts, the thinking folds to one line saying how long it took (``thought_line``)."""

    def __init__(self, renderer: Renderer | None, *, hide_thinking: bool = False) -> None:
        self.renderer = renderer
        self.output_closed = False
        self.hide_thinking = hide_thinking
        self._thought: tuple[int, float, float] | None = None  # responses, first and last elapsed_s

    def start(self) -> None:
        self._render(lambda r: r.start())

    def show(self, response: Response, *, more: bool = False) -> None:
        if self.renderer is None or self.output_closed:
            return
        if response.thinking or response.reasoning:
            count, first, _ = self._thought or (0, response.elapsed_s, 0.0)
            self._thought = (count + 1, first, response.elapsed_s)
            if response.reasoning and not self.hide_thinking:
                self.renderer.think(displayable(response.reasoning))
            if response.thinking:
                return
        if self._thought is not None:
            count, first, last = self._thought
            self._thought = None
            self.renderer.fold(thought_line(count, last - first))
        # The renderer raises OutputClosed from here when stdout's reader has gone away.
        self.renderer.update(displayable(response.text), response.held_bytes, displayable(response.held_text),
                             response.held_tokens, more=more)

    def show_text(self, text: str) -> None:
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


def thought_line(tokens: int, seconds: float) -> str:
    """What a folded thinking says of itself."""
    return f"thought for {tokens} token{'s' if tokens != 1 else ''}, {seconds:.1f} s"


# -- beam search: not streamed ---------------------------------------------------------------------


@dataclass(frozen=True)
class BeamOutcome:
    completion: BeamCompletion
    signum: int | None  # the signal that stopped the search, if one did


async def run_beams(source: Source, request: Request,
                    on_progress: Callable[[BeamProgress], None] | None = None) -> BeamOutcome:
    """Beam search for ``request`` with the signal watcher beside it; ``on_progress`` after each step.

    A signal stops the search between two steps; the outcome then holds the best hypotheses so
    far (the unfinished ones with finish reason ``cancelled``).
    """
    stop = StopRequest()
    run = None
    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()
        await tg.start(watch_signals, scope, stop)
        with scope:
            async with source.beams(request) as run:
                async for progress in run:
                    if on_progress is not None:
                        on_progress(progress)
        tg.cancel_scope.cancel()
    if run is None:  # stopped before the search began
        return BeamOutcome(BeamCompletion(request.request_id, (), len(request.prompt_ids), 0, 0.0), stop.signum)
    return BeamOutcome(run.completion(), stop.signum)

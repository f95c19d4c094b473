"""One job of the scheduler: its state between the event loop and the step thread, and its stream.

A ``Job`` is shared by two sides with a strict split of who writes what: the event loop writes
``cancelled`` and ``received`` (plain Python values, read by the step thread at its next step),
the step thread writes everything about tokens and pages. ``JobStream`` is what a caller iterates:
the job's token events made into text responses, as ``Engine.stream`` does for one request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from llama_chat.inference.decoding import TextMaker
from llama_chat.inference.page_table import PageKey
from llama_chat.inference.types import Completion, GenerationState, Request, Response, Tally, TokenEvent
from llama_chat.ml.processors import Sampler, TokenHistory


@dataclass(eq=False)
class Job:
    request: Request
    submitted: float  # perf_counter at submission: event times are measured from here
    send: MemoryObjectSendStream[TokenEvent]
    stop_ids: frozenset[int]
    # -- written by the event loop --
    cancelled: bool = False
    received: int = 0  # events the consumer has taken
    # -- written by the step thread --
    tokens: list[int] = field(default_factory=list)  # prompt, then every sampled token
    fed: int = 0  # positions whose keys and values are in the job's pages
    pages: list[int] = field(default_factory=list)  # the block table
    keys: list[PageKey] = field(default_factory=list)  # prefix keys of its full pages so far
    claims: list[PageKey] = field(default_factory=list)  # prompt pages it will write that others wait for
    cached_tokens: int = 0  # prompt tokens found in the cache at admission
    produced: int = 0  # events made
    finished: bool = False
    uniforms: torch.Tensor | None = None
    controls: Sampler | None = None  # the logits processors, for settings beyond temperature and top-p
    history: TokenHistory | None = None  # what the processors read: the job's tokens so far
    final_state: GenerationState | None = None  # how it ended when no event said so (a cancel)
    # -- the event loop's end of the job: set once its pages are back in the pool --
    released: anyio.Event = field(default_factory=anyio.Event)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)


class JobStream:
    """``async for response in stream`` yields the job's ``Response`` items; then ``completion()``.

    Leaving early (``aclose``, or the ``async with`` block) cancels the job, and its pages are
    released at the scheduler's next step.
    """

    def __init__(self, job: Job, receive: MemoryObjectReceiveStream[TokenEvent], *, strip_leading_space: bool,
                 on_receive: Callable[[], None], on_cancel: Callable[[Job], None]) -> None:
        self.job = job
        self.request = job.request
        self.maker = TextMaker(job.request.stop, strip_leading_space=strip_leading_space)
        self.tally = Tally(job.request_id, job.prompt_len)
        self.parts: list[str] = []
        self._receive = receive
        self._on_receive = on_receive
        self._on_cancel = on_cancel
        self._done = False

    @property
    def request_id(self) -> str:
        return self.job.request_id

    @property
    def text(self) -> str:
        return "".join(self.parts)

    async def __aenter__(self) -> JobStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if not self._done:
            self.cancel()
        self._receive.close()

    def cancel(self) -> None:
        """Stop the job; what it has generated so far stays in ``completion()``."""
        self._on_cancel(self.job)

    def __aiter__(self) -> JobStream:
        return self

    async def __anext__(self) -> Response:
        if self._done:
            raise StopAsyncIteration
        try:
            event = await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._end()
            raise StopAsyncIteration from None
        self.job.received += 1
        self._on_receive()  # the job may have been waiting for room in this stream
        self.tally.add(event)
        maker = self.maker
        text = maker.feed(event.data)
        state = event.state
        if state.finished and not maker.stopped:
            text += maker.finish()
        if maker.stopped:
            state = GenerationState.STOP_STRING
            if not event.state.finished:
                self.cancel()  # the scheduler stops it at its next step
        if state.finished:
            self._done = True
            self.tally.mark(state)
            self._receive.close()
        self.parts.append(text)
        return Response(event.request_id, event.index, event.token_id, text, maker.held_bytes, maker.held_text,
                        maker.held_tokens, state, event.elapsed_s)

    def cut_off(self) -> str:
        """After the stream ended without a finishing event (a cancel, the scheduler stopped or
        failed): the whole characters still held, added to the text; the bytes of an unfinished
        character are dropped. As ``engine.Generation.cut_off``."""
        if self._done:
            return ""
        self._done = True
        if self.job.final_state is not None:
            self.tally.mark(self.job.final_state)
        text = self.maker.finish(cut_off=True)
        self.parts.append(text)
        return text

    def _end(self) -> None:
        self.cut_off()

    def completion(self) -> Completion:
        self._end()
        self.tally.cached_tokens = self.job.cached_tokens
        return self.tally.completion(self.text)

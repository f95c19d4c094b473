"""One job of the scheduler: its state between the event loop and the step thread, and its stream.

A ``Job`` is shared by two sides with a strict split of who writes what: the event loop writes
``cancelled`` and ``received`` (plain Python values, read by the step thread at its next step),
the step thread writes everything about tokens and pages. ``JobStream`` is what a caller iterates:
the job's token events made into text responses.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from llama_chat.inference.page_table import PageKey
from llama_chat.inference.speculative import Lookup, ModelDraft, Pace
from llama_chat.inference.text_stream import TextStream, reply_text
from llama_chat.inference.types import (Completion, GenerationState, Request, Response, Tally, TokenEvent,
                                        TokenLogprobs)
from llama_chat.ml.constraints import GrammarMask
from llama_chat.ml.processors import Controls, TokenHistory


class Draw(enum.Enum):
    """How a job's tokens are drawn, as far as a step's backend goes (fixed at its admission)."""

    GREEDY = "greedy"  # the best token, no processors, no logprobs: an operator or graph may pick it
    SAMPLED = "sampled"  # temperature and top-p alone, no logprobs: a graph may draw it
    OTHER = "other"  # processors or logprobs: drawn on the host, from its logits


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
    disk_tokens: int = 0  # of those, the ones read from the prompt cache on disk
    admitted: float = 0.0  # perf_counter when it got its pages
    serial: int = 0  # the order of its admission, unique within a scheduler
    produced: int = 0  # events made
    finished: bool = False
    uniforms: torch.Tensor | None = None
    controls: Controls | None = None  # the logits processors, for settings beyond temperature and top-p
    history: TokenHistory | None = None  # what the processors read: the job's tokens so far
    constraint: GrammarMask | None = None  # the request's structured output, one of its processors
    final_state: GenerationState | None = None  # how it ended when no event said so (a cancel)
    drawn_logprobs: TokenLogprobs | None = None  # of the token just drawn, when the request asks
    lookup: Lookup | None = None  # its prompt-lookup drafts (speculative.py), where the scheduler drafts
    model_draft: ModelDraft | None = None  # its place in the draft model's pool, where there is one
    drafting: Pace | None = None  # the drafter of the draft in the step running
    draw: Draw = Draw.OTHER
    # -- the event loop's end of the job: set once its pages are back in the pool --
    released: anyio.Event = field(default_factory=anyio.Event)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)


class JobStream(TextStream):
    """``async for response in stream`` yields the job's ``Response`` items; then ``completion()``.

    Leaving early (``aclose``, or the ``async with`` block) cancels the job, and its pages are
    released at the scheduler's next step. ``logprobs``: for a request that asks for them, those of
    every token taken so far but a stop token (which is never part of the text), in order.
    """

    def __init__(self, job: Job, receive: MemoryObjectReceiveStream[TokenEvent], *, strip_leading_space: bool,
                 on_receive: Callable[[], None], on_cancel: Callable[[Job], None]) -> None:
        super().__init__(job.request, reply_text(job.request, strip_leading_space=strip_leading_space),
                         Tally(job.request_id, job.prompt_len), receive)
        self.job = job
        self.logprobs: list[tuple[int, TokenLogprobs]] = []  # (token id, its logprobs)
        self._on_receive = on_receive
        self._on_cancel = on_cancel

    @property
    def request_id(self) -> str:
        return self.job.request_id

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

    def cut_off(self) -> str:
        if not self._done and self.job.final_state is not None:
            self.tally.mark(self.job.final_state)  # how it ended, when no event said so
        return super().cut_off()

    def completion(self) -> Completion:
        self.tally.cached_tokens = self.job.cached_tokens
        done = super().completion()
        if self.job.disk_tokens:
            done = replace(done, disk_tokens=self.job.disk_tokens)
        paces = [p for p in (self.job.lookup, self.job.model_draft) if p is not None]
        if not paces:
            return done
        return replace(done, speculation=(sum(p.drafted for p in paces), sum(p.accepted for p in paces)))

    def _respond(self, event: TokenEvent) -> Response:
        if event.logprobs is not None and event.token_id not in self.job.stop_ids:
            self.logprobs.append((event.token_id, event.logprobs))
        return super()._respond(event)

    def _taken(self) -> None:
        self.job.received += 1
        self._on_receive()  # the job may have been waiting for room in this stream

    def _ended(self) -> None:
        self.cut_off()

    def _stop_early(self) -> None:
        self.cancel()  # the scheduler stops it at its next step

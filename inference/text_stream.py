"""Token events made into text responses.

``jobs.JobStream`` (one job of the scheduler) reads ``TokenEvent`` items from a channel and turns
each into a ``Response`` carrying the text its token commits and what is held back. This is that
part; the job's stream keeps what is its own: how it counts what was taken, what ends it, how it
stops its producer.
"""

from __future__ import annotations

from dataclasses import replace

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from llama_chat.inference.reasoning import ReplyText
from llama_chat.inference.types import Completion, GenerationState, Request, Response, Tally, TokenEvent


def reply_text(request: Request, *, strip_leading_space: bool = False) -> ReplyText:
    """The text maker of ``request``'s reply: its stop strings, and its thinking kept apart."""
    return ReplyText(request.stop, strip_leading_space=strip_leading_space, split=request.thinking)


class TextStream:
    """``async for response in stream`` yields ``Response`` items; ``text`` is what they committed
    to the answer, ``reasoning`` to the thinking."""

    def __init__(self, request: Request, maker: ReplyText, tally: Tally,
                 receive: MemoryObjectReceiveStream[TokenEvent] | None = None) -> None:
        self.request = request
        self.maker = maker
        self.tally = tally
        self.parts: list[str] = []
        self.reasoning_parts: list[str] = []
        self._receive = receive
        self._done = False

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    def __aiter__(self) -> TextStream:
        return self

    async def __anext__(self) -> Response:
        if self._done or self._receive is None:
            raise StopAsyncIteration
        try:
            # An event already there is taken without yielding to the event loop (``receive``
            # always yields once): they arrive in batches, and a yield for each was a good part of
            # the event loop's work per token. A cancel is seen when the channel runs dry.
            event = self._receive.receive_nowait()
        except anyio.WouldBlock:
            try:
                event = await self._receive.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                self._ended()
                raise StopAsyncIteration from None
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._ended()
            raise StopAsyncIteration from None
        self._taken()
        return self._respond(event)

    def ready(self) -> int:
        """Events waiting in the channel: responses the next iterations yield without waiting."""
        if self._done or self._receive is None:
            return 0
        return self._receive.statistics().current_buffer_used

    def next_ready(self) -> Response | None:
        """The next response where its event is already waiting, else None (without waiting; the
        end of the stream is left to ``__anext__``)."""
        if self._done or self._receive is None:
            return None
        try:
            event = self._receive.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            return None
        self._taken()
        return self._respond(event)

    def completion(self) -> Completion:
        """The whole result; a stream left early keeps what was held (``cut_off``)."""
        self.cut_off()
        return replace(self.tally.completion(self.text), reasoning=self.reasoning,
                       reasoning_tokens=self.maker.reasoning_tokens)

    def cut_off(self) -> str:
        """After the stream was stopped from outside (a cancel, the producer failed): the whole
        characters still held, added to the text; the bytes of an unfinished character are dropped."""
        if self._done:
            return ""
        self._done = True
        text, reasoning = self.maker.finish(cut_off=True)
        self.parts.append(text)
        self.reasoning_parts.append(reasoning)
        return text

    # -- what each kind of stream does its own way --------------------------------------------

    def _taken(self) -> None:
        """An event was taken from the channel."""

    def _ended(self) -> None:
        """The channel ended without a finishing event."""
        self._done = True

    def _stop_early(self) -> None:
        """A stop string matched before the producer finished: tell it to stop."""

    # -- internals -------------------------------------------------------------------------------

    def _respond(self, event: TokenEvent) -> Response:
        self.tally.add(event)
        maker = self.maker
        text, reasoning = maker.feed(event.token_id, event.data)
        state = event.state
        if state.finished and not maker.stopped:
            more, more_reasoning = maker.finish()
            text += more
            reasoning += more_reasoning
        if maker.stopped:
            state = GenerationState.STOP_STRING
            if not event.state.finished:
                self._stop_early()
        if state.finished:
            self._done = True
            self.tally.mark(state)
            self._receive.close()  # a producer still running stops after its current step
        self.parts.append(text)
        if reasoning:
            self.reasoning_parts.append(reasoning)
        return Response(event.request_id, event.index, event.token_id, text, maker.held_bytes, maker.held_text,
                        maker.held_tokens, state, event.elapsed_s, reasoning, maker.thinking)

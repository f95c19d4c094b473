"""What a finished (or stopped) generation amounts to: its tokens, finish reason and timings."""

from __future__ import annotations

from dataclasses import dataclass

from llama_chat.inference.types import GenerationState, TokenEvent


@dataclass(frozen=True)
class Timings:
    ttft_s: float | None  # request start to first sampled token (tokenize not included)
    prefill_tok_s: float | None  # prompt tokens per second of time to first token
    decode_tok_s: float | None  # tokens after the first, per second between first and last

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_s": self.ttft_s, "prefill_tok_s": self.prefill_tok_s, "decode_tok_s": self.decode_tok_s}


@dataclass(frozen=True)
class Completion:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: GenerationState
    prompt_tokens: int
    timings: Timings

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class Tally:
    """Accumulates the events of one stream; a consumer feeds it every event it receives.

    A stream that ends without a finishing event was stopped from outside (a cancel, or the
    consumer went away), so its finish reason is ``CANCELLED``.
    """

    def __init__(self, request_id: str, prompt_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.token_ids: list[int] = []
        self._first_s: float | None = None
        self._last_s: float | None = None
        self._state = GenerationState.CANCELLED

    def add(self, event: TokenEvent) -> None:
        self.token_ids.append(event.token_id)
        if self._first_s is None:
            self._first_s = event.elapsed_s
        self._last_s = event.elapsed_s
        if event.state.finished:
            self._state = event.state

    @property
    def finish_reason(self) -> GenerationState:
        return self._state

    def mark(self, state: GenerationState) -> None:
        """Override the reason (an error, or a cancel that raced the last event)."""
        self._state = state

    def timings(self) -> Timings:
        first, last = self._first_s, self._last_s
        if first is None or last is None:
            return Timings(None, None, None)
        prefill = self.prompt_tokens / first if first > 0 else None
        n_decode = len(self.token_ids) - 1
        decode = n_decode / (last - first) if n_decode > 0 and last > first else None
        return Timings(first, prefill, decode)

    def completion(self, text: str) -> Completion:
        return Completion(self.request_id, text, tuple(self.token_ids), self._state, self.prompt_tokens,
                          self.timings())

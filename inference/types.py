"""What crosses the boundaries of the engine: requests in, token events out.

Everything here is a frozen dataclass of Python scalars, tuples and ``bytes``, so an event can sit
in a channel, be logged or be compared in a test without holding on to a tensor or a device.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field

from llama_chat.ml.sampling import SamplingParams


class GenerationState(str, enum.Enum):
    """Where a generation stands after a token; every state but ``IN_PROGRESS`` is a finish reason."""

    IN_PROGRESS = "in_progress"
    EOS = "eos"  # the model emitted an end-of-sequence or end-of-turn token
    MAX_TOKENS = "max_tokens"  # the request's token budget is spent
    CONTEXT_FULL = "context_full"  # the next token would not fit in max_seq_len
    STOP_STRING = "stop_string"  # a stop string matched (the sampling-controls issue sets it)
    CANCELLED = "cancelled"  # Ctrl+C, SIGTERM, or the reader went away
    ERROR = "error"  # the forward or the sampler raised

    @property
    def finished(self) -> bool:
        return self is not GenerationState.IN_PROGRESS

    def __str__(self) -> str:
        return self.value


def new_request_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class Request:
    """One generation: the prompt's token ids plus every setting that applies to it alone.

    Settings live on the request, not the engine, so a batch can mix requests with different
    budgets, temperatures and seeds.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    max_tokens: int | None = None  # None: until a stop token or the context is full
    request_id: str = field(default_factory=new_request_id)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(i) for i in self.prompt_ids))
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, as the producer sends it down the channel.

    ``data`` is the token's bytes (``b""`` for stop and other special tokens, which are never
    printed). ``state`` is ``IN_PROGRESS`` or, on the last event of a stream, the finish reason.
    ``elapsed_s`` is measured from the start of the request to the moment the token was sampled,
    so the first event's value is the time to first token.
    """

    request_id: str
    index: int  # 0 for the first generated token
    token_id: int
    data: bytes
    state: GenerationState
    elapsed_s: float

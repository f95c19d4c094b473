"""What crosses the boundaries of the generation core, in one place: requests in, token events and text
responses out, what a finished generation amounts to, why it ended, and the errors in what was asked.

Everything here is a frozen dataclass of Python scalars, tuples, ``bytes`` and ``str``, so an item
can sit in a channel, be logged or be compared in a test without holding on to a tensor or a device.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field

from llama_chat.ml.controls import MAX_TOP_LOGPROBS, BeamParams, ControlError, SamplingParams, check, check_stop
from llama_chat.ml.grammars import Constraint
from llama_chat.model.tokenizers.base import Tokenizer

# -- a thinking model's tags --------------------------------------------------------------------

START_TAG = "<think>"
END_TAG = "</think>"


@dataclass(frozen=True)
class ThinkTags:
    """How a model marks its thinking: the tags' text, their token ids where the vocabulary has
    them, and whether its chat template reads ``enable_thinking``."""

    start: str = START_TAG
    end: str = END_TAG
    start_id: int | None = None
    end_id: int | None = None
    switch: bool = False

    @property
    def tokens(self) -> bool:
        """Split on ids (both tags are tokens), not on text."""
        return self.start_id is not None and self.end_id is not None


@dataclass(frozen=True)
class ThinkSplit:
    """What a request's reply splitter needs: the tags, and whether the prompt ends inside the
    thinking (the R1 distills' and Qwen3-2507's templates open it in the generation prompt)."""

    tags: ThinkTags
    inside: bool = False


# -- states --------------------------------------------------------------------------------------


class GenerationState(str, enum.Enum):
    """Where a generation stands after a token; every state but ``IN_PROGRESS`` is a finish reason."""

    IN_PROGRESS = "in_progress"
    EOS = "eos"  # the model emitted an end-of-sequence or end-of-turn token
    MAX_TOKENS = "max_tokens"  # the request's token budget is spent
    CONTEXT_FULL = "context_full"  # the next token would not fit in max_seq_len
    STOP_STRING = "stop_string"  # one of the request's stop strings appeared in the text
    STOP_GRAMMAR = "stop_grammar"  # the request's constraint is complete: nothing but an end token could follow
    MAX_TIME = "max_time"  # the request's time budget (max_time, from its start) is spent
    CANCELLED = "cancelled"  # Ctrl+C, SIGTERM, or the reader went away
    ERROR = "error"  # the forward or the sampler raised

    @property
    def finished(self) -> bool:
        return self is not GenerationState.IN_PROGRESS

    def __str__(self) -> str:
        return self.value


# -- requests ------------------------------------------------------------------------------------



def new_request_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class Request:
    """One generation: the prompt's token ids plus every setting that applies to it alone.

    Settings live on the request, not the engine, so a batch can mix requests with different
    budgets, temperatures and seeds.

    ``stop``: strings that end the generation when they appear in its text; they are never part
    of the text. ``chat_reply``: the prompt ends where an assistant's reply begins, so the reply is
    not a continuation of the prompt's last word and the tokenizer's word-start space before its
    first word is dropped. ``reuse_cache``: keep the KV cache's entries for the longest prefix this
    prompt shares with what the cache holds, and prefill only the rest (a chat's next turn). It is
    off by default so that a benchmark repeating one prompt measures a whole prefill each time.
    ``max_time``: seconds from the request's start (prefill included, as transformers'
    ``MaxTimeCriteria``) after which no further token is generated; at least one always is.
    ``beams``: beam search settings (``num_beams`` 1: none); a beam request is not streamed.
    ``constraint``: what the reply must match (a JSON schema, a pattern, a grammar:
    ``ml/grammars.py``); it ends, ``stop_grammar``, where the constraint is complete.
    ``logprobs``: None, none reported; 0 to ``MAX_TOP_LOGPROBS``, each token event carries the
    token's log-probability and that many of the most likely alternatives (``TokenLogprobs``).
    ``speculate``: where the scheduler drafts (``speculative.py``), whether this request's steps
    may at all (the reply is the same either way; only its speed differs); ``lookup``, whether
    by prompt lookup (None: as the scheduler's ``Speculation.lookup`` says); ``draft_model``,
    whether by the scheduler's draft model where it has one (None: yes); ``draft_max``, the most
    tokens drafted in one step (None: the scheduler's). ``thinking``: a thinking model's reply, whose
    thinking is kept apart from its answer (``reasoning.py``); None: the reply is all answer.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    max_tokens: int | None = None  # None: until a stop token or the context is full
    request_id: str = field(default_factory=new_request_id)
    stop: tuple[str, ...] = ()
    chat_reply: bool = False
    reuse_cache: bool = False
    max_time: float | None = None
    beams: BeamParams = BeamParams()
    stop_ids: tuple[int, ...] = ()  # token ids that end this request, besides the tokenizer's
    constraint: Constraint | None = None
    logprobs: int | None = None
    speculate: bool = True
    lookup: bool | None = None
    draft_model: bool | None = None
    draft_max: int | None = None
    thinking: ThinkSplit | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(i) for i in self.prompt_ids))
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))
        object.__setattr__(self, "stop", check_stop(s for s in self.stop if s))
        for name in ("max_tokens", "max_time", "draft_max"):
            if getattr(self, name) is not None:
                check(name, getattr(self, name))
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {self.logprobs}")


# -- what the producer sends, and what the consumer gets ------------------------------------------


@dataclass(frozen=True)
class TokenLogprobs:
    """How likely a drawn token was: ``logprob``, its log-probability, and ``top``, the most likely
    tokens as ``(id, log-probability)`` pairs, most likely first.

    They are the raw model's, as vLLM reports by default: the log-softmax of the logits the row
    was sampled from, over the tokenizer's ids, before any logits processor, penalty, bias,
    constraint or temperature, so they say what the model thought whatever the sampling settings.
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, as the producer sends it down the channel.

    ``data`` is the token's bytes (``b""`` for stop and other special tokens, which are never
    printed). ``state`` is ``IN_PROGRESS`` or, on the last event of a stream, the finish reason.
    ``elapsed_s`` is measured from the start of the request to the moment the token was sampled,
    so the first event's value is the time to first token. ``logprobs``: only for a request that
    asks for them (``Request.logprobs``).
    """

    request_id: str
    index: int  # 0 for the first generated token
    token_id: int
    data: bytes
    state: GenerationState
    elapsed_s: float
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class Response:
    """One generated token as text, what ``Engine.stream`` yields.

    ``text`` is the text this token newly commits: final, never taken back, safe to print
    (``""`` while it is held). What is held back follows: ``held_bytes``, the start of a UTF-8
    character still waiting for its other bytes; ``held_text``, whole characters that may still
    grow into a longer emoji or may be the start of a stop string; ``held_tokens``, how many of the
    latest tokens that held state comes from (a display draws one marker per token). The last
    response of a stream has a finished ``state`` and nothing held. ``reasoning``: the thinking's
    text this token newly commits (a thinking model's: ``reasoning.py``); ``thinking``: the reply is
    inside its thinking after this token (what is held is the thinking's).
    """

    request_id: str
    index: int
    token_id: int
    text: str
    held_bytes: bytes
    held_text: str
    held_tokens: int
    state: GenerationState
    elapsed_s: float
    reasoning: str = ""
    thinking: bool = False


# -- results -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timings:
    ttft_s: float | None  # request start to first sampled token (tokenize not included)
    prefill_tok_s: float | None  # prompt tokens prefilled per second of time to first token
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
    cached_tokens: int = 0  # prompt tokens whose KV entries were kept from the request before
    disk_tokens: int = 0  # of those, the ones read from the prompt cache on disk (model/prompt_cache.py)
    # Where the request's steps drafted (prompt lookup, a draft model): (tokens drafted, tokens of them kept).
    speculation: tuple[int, int] | None = None
    reasoning: str = ""  # a thinking model's thinking, apart from ``text`` (reasoning.py)
    reasoning_tokens: int = 0  # the tokens of that thinking, its tags left out

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens that went through a forward for this request."""
        return self.prompt_tokens - self.cached_tokens


class Tally:
    """Accumulates the events of one stream; a consumer feeds it every event it receives.

    A stream that ends without a finishing event was stopped from outside (a cancel, or the
    consumer went away), so its finish reason is ``CANCELLED``.
    """

    def __init__(self, request_id: str, prompt_tokens: int, cached_tokens: int = 0) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.token_ids: list[int] = []
        self._first_s: float | None = None
        self._last_s: float | None = None
        self._state = GenerationState.CANCELLED

    def add(self, event: TokenEvent | Response) -> None:
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
        """Override the reason (a stop string, an error, or a cancel that raced the last event)."""
        self._state = state

    def timings(self) -> Timings:
        first, last = self._first_s, self._last_s
        if first is None or last is None:
            return Timings(None, None, None)
        prefilled = self.prompt_tokens - self.cached_tokens
        prefill = prefilled / first if first > 0 else None
        n_decode = len(self.token_ids) - 1
        decode = n_decode / (last - first) if n_decode > 0 and last > first else None
        return Timings(first, prefill, decode)

    def completion(self, text: str) -> Completion:
        return Completion(self.request_id, text, tuple(self.token_ids), self._state, self.prompt_tokens,
                          self.timings(), self.cached_tokens)


@dataclass(frozen=True)
class BeamText:
    """One hypothesis of a beam search: its text, ids, score and why it ended."""

    text: str
    token_ids: tuple[int, ...]
    score: float  # sum of log-probabilities / generated length ** length_penalty (transformers' sequences_scores)
    finish_reason: GenerationState

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": list(self.token_ids), "score": self.score,
                "finish_reason": self.finish_reason.value}


@dataclass(frozen=True)
class BeamCompletion:
    """What a beam search returns: the best hypotheses, best first (``num_return`` of them)."""

    request_id: str
    beams: tuple[BeamText, ...]
    prompt_tokens: int
    steps: int  # tokens generated per beam before the search ended
    elapsed_s: float

    @property
    def best(self) -> BeamText | None:
        return self.beams[0] if self.beams else None


# -- when a generation ends ----------------------------------------------------------------------

# End markers by name, for tokenizers that declare them as special tokens without listing every
# one of them among their stop ids.
STOP_TOKEN_NAMES = ("</s>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


def stop_ids_of(tokenizer: Tokenizer) -> frozenset[int]:
    """Every id that ends a generation: the tokenizer's stop ids, its eos, and the known names."""
    ids = set(tokenizer.stop_ids)
    if tokenizer.eos_id is not None:
        ids.add(tokenizer.eos_id)
    specials = tokenizer.special_tokens
    ids.update(specials[name] for name in STOP_TOKEN_NAMES if name in specials)
    return frozenset(ids)


def state_after(token_id: int, *, index: int, request: Request, stop_ids: frozenset[int],
                max_seq_len: int, elapsed_s: float | None = None, grammar_done: bool = False) -> GenerationState:
    """The state after generated token ``index`` (0-based) of ``request`` was sampled.

    The token sits at position ``len(prompt) + index``; when that is the last position of the
    context there is no room to feed it back, so the context is full. A stop token wins over the
    budget, and the budget over the context, and the context over the clock, so the reason
    shown is the most specific one. ``elapsed_s``: seconds since the request started, for
    ``max_time``. ``grammar_done``: with this token the request's constraint is complete (a stop
    token still wins: the model ended there itself). (Stop strings are matched on the text, after
    this: ``decoding.TextMaker``.)
    """
    if token_id in stop_ids or token_id in request.stop_ids:
        return GenerationState.EOS
    if grammar_done:
        return GenerationState.STOP_GRAMMAR
    if request.max_tokens is not None and index + 1 >= request.max_tokens:
        return GenerationState.MAX_TOKENS
    if len(request.prompt_ids) + index + 1 >= max_seq_len:
        return GenerationState.CONTEXT_FULL
    if request.max_time is not None and elapsed_s is not None and elapsed_s >= request.max_time:
        return GenerationState.MAX_TIME
    return GenerationState.IN_PROGRESS


# -- errors --------------------------------------------------------------------------------------
# Errors in what was asked for, as opposed to failures while doing it. The command line maps
# ``RequestError`` to exit status 2 (bad input), like a usage error.


class RequestError(ValueError):
    """A request the engine cannot run as given; the message is one line for the user."""


class DamagedScores(RequestError):
    """The model gave scores that are not numbers (NaN or infinite): nothing can be drawn from them."""

    def __init__(self) -> None:
        super().__init__("the model's scores are not numbers (NaN or infinite): its weights are damaged")


class EmptyPrompt(RequestError):
    def __init__(self) -> None:
        super().__init__("the prompt is empty")


class PromptTooLong(RequestError):
    def __init__(self, prompt_tokens: int, context: int) -> None:
        super().__init__(f"the prompt is {prompt_tokens} tokens, the context holds {context} "
                         f"(at least one must be left for the answer)")
        self.prompt_tokens = prompt_tokens
        self.context = context


def check_request(request: Request, max_seq_len: int, vocab: int) -> None:
    """Raise a ``RequestError`` for a request no engine of this context and vocabulary can run."""
    if not request.prompt_ids:
        raise EmptyPrompt()
    if len(request.prompt_ids) >= max_seq_len:
        raise PromptTooLong(len(request.prompt_ids), max_seq_len)
    for token, _ in request.sampling.logit_bias:
        if token >= vocab:
            raise RequestError(f"--logit-bias: token id {token} is outside the vocabulary (0 to {vocab - 1})")


def check_constraint(request: Request, constraints) -> None:
    """Raise a ``RequestError`` when the model's vocabulary cannot spell ``request``'s constraint.
    ``constraints``: the model's ``ml.constraints.Constraints``, which keeps what it compiles here
    for the request's processor."""
    if request.constraint is not None:
        try:
            constraints.compile(request.constraint)
        except ControlError as e:
            raise RequestError(str(e)) from None


def sole_exception(group: BaseExceptionGroup) -> BaseException:
    """The one exception inside (possibly nested) groups, or the group itself when there are more.

    Task groups always wrap what their children raise; a caller of a single stream wants the
    error itself, so it can catch it by type.
    """
    leaves: list[BaseException] = []
    pending = [group]
    while pending:
        g = pending.pop()
        for exc in g.exceptions:
            (pending if isinstance(exc, BaseExceptionGroup) else leaves).append(exc)
    return leaves[0] if len(leaves) == 1 else group


@dataclass(frozen=True)
class SchedulerStats:
    """Counters since the scheduler was made; ``pages_*`` count pages of ``page_size`` tokens."""

    jobs_submitted: int
    jobs_finished: int
    prefill_tokens: int  # prompt tokens that went through a forward
    cached_tokens: int  # prompt tokens whose keys came from the prefix cache instead
    generated_tokens: int
    steps: int
    mixed_steps: int  # steps where prompt chunks and decodes shared the forward
    page_size: int
    pages_total: int  # pages jobs can use (the cache's, less the scratch page)
    pages_free: int  # holding nothing
    pages_cached: int  # holding a prefix nobody uses now, kept until the space is needed
    pages_in_use: int  # in some job's block table
    pages_peak: int
    evictions: int
    compactions: int = 0  # jobs running alone moved onto consecutive pages (batch_core._compact)
    drafted_tokens: int = 0  # tokens drafted by prompt lookup or the draft model and verified
    accepted_tokens: int = 0  # of those, the ones kept
    kv_resident_bytes: int = 0  # the cache's pages written and not given back (page_table.py)
    kv_reserved_bytes: int = 0  # the most the cache's pages may take
    disk_tokens: int = 0  # prompt tokens whose keys were read from the prompt cache on disk
    disk_blocks_written: int = 0  # pages it wrote there
    disk_blocks_skipped: int = 0  # blocks found there but not used: truncated, damaged or foreign

    @property
    def pages_available(self) -> int:
        return self.pages_free + self.pages_cached

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

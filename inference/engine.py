"""The engine: a loaded model and tokenizer, and the producer that streams one request's tokens.

The producer is an async task that drives the blocking forward one step per worker-thread call
(``StepWorker``, a dedicated thread fed one call per step) and sends a ``TokenEvent`` into a bounded
memory object stream after each step. Because every forward is its own call, a cancel lands between
two steps: the step running stops at its next layer or finishes, the one queued behind it is
revoked, the next ``await`` raises, and no thread is left running on its own. Because the channel
is bounded, a slow consumer blocks the producer in ``send`` instead of letting tokens pile up.
Prompts are prefilled in chunks sized by time (``prefill.py``), as long as keeps each layer of a
chunk within the cancel's budget.

Two layers: ``Engine.events`` is the producer's channel of raw ``TokenEvent`` items (ids and bytes);
``Engine.stream`` is what every consumer uses, the same events made into text (``Response``: the
committed text, what is held back, the state), with stop strings applied, so the one-shot command,
the chat and ``--json`` share one path and ``cmd/`` only renders.

The engine remembers which token ids its KV cache holds (``cached_ids``). A request with
``reuse_cache`` keeps the entries of the longest prefix it shares with them and prefills only the
rest; a chat's next turn then costs its new tokens, not the whole conversation. When a stream ends,
for whatever reason, the record is trimmed to what is known to be in the cache and was delivered
to the consumer: steps computed ahead of a cancel are not counted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from llama_chat.inference.beam import BeamModel, BeamRun, beam_run
from llama_chat.inference.cache_prefix import align_to_cached
from llama_chat.inference.model_step import Decode, ModelStep, StepOptions
from llama_chat.inference.prefill import PrefillSizer
from llama_chat.inference.step_worker import StepWorker
from llama_chat.inference.text_stream import TextStream, reply_text
from llama_chat.inference.types import (Completion, EngineBusy, GenerationState, Request,
                                        Tally, TokenEvent, check_constraint, check_request, sole_exception,
                                        state_after, stop_ids_of)
from llama_chat.ml.constraints import Constraints, GrammarMask
from llama_chat.ml.cpu import kernels as cpu_kernels
from llama_chat.ml.quantize import apply_quantization
from llama_chat.ml.sampling import Draw, SamplingParams, sample
from llama_chat.model import cpu_decode
from llama_chat.model.tokenizers.base import Tokenizer
from llama_chat.model.transformer import Transformer

# A few tokens of slack absorb a renderer's short stalls; more would only hide backpressure.
DEFAULT_BUFFER_SIZE = 8
# Prompt tokens per prefill forward: the bound on how long a cancel waits during prefill. A GPU
# prefills a 1,024-token chunk of a 7B model in tens of milliseconds.
DEFAULT_PREFILL_CHUNK = 64
CUDA_PREFILL_CHUNK = 1024
# Decode steps queued in the worker ahead of the one being handled, so that it never waits for the
# event loop between two forwards; also the most steps computed that a cancel throws away.
DEFAULT_LOOKAHEAD = 8
# How often finished steps are reported to the event loop while the worker keeps computing.
DEFAULT_REPORT_EVERY_S = 0.02


@dataclass(frozen=True)
class EngineOptions:
    buffer_size: int = DEFAULT_BUFFER_SIZE
    # Prompt tokens per prefill forward; None: sized by time (inference/prefill.py), starting
    # from DEFAULT_PREFILL_CHUNK (CUDA_PREFILL_CHUNK on CUDA).
    prefill_chunk: int | None = None
    lookahead: int = DEFAULT_LOOKAHEAD
    report_every_s: float = DEFAULT_REPORT_EVERY_S
    compile: bool | None = None  # None: where it pays (see StepOptions.for_device)
    max_seq_len: int | None = None  # the KV cache's length; None: the model's context
    quantize: str = "none"  # "int8": weight-only int8 projections (ml/quantize.py), made here


class Engine:
    """Owns a model (with its KV cache) and a tokenizer; serves one request at a time."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, options: EngineOptions = EngineOptions(),
                 draw: Draw = sample, name: str = "") -> None:
        first = next(model.parameters())
        parameters = sum(p.numel() for p in model.parameters())
        quantized = apply_quantization(model, options.quantize)
        cpu_kernels.prepare(model)  # before anything is compiled: a compiled graph keeps its products
        step_options = StepOptions.for_device(first.device, parameters, options.compile,
                                              quantized=quantized, dtype=first.dtype,
                                              one_call=cpu_decode.supports(model))
        self.step = ModelStep(model, options=step_options, max_seq_len=options.max_seq_len,
                              sample_ids=getattr(tokenizer, "vocab_size", None))
        self.tokenizer = tokenizer
        self.options = options
        self.name = name
        self.stop_ids = stop_ids_of(tokenizer)
        self.constraints = Constraints(tokenizer, self.stop_ids)  # requests' structured output
        self._draw = draw  # the sampler's last stage (tests record it)
        self._busy = False
        self._cached: tuple[int, ...] = ()
        self._record_of = ""  # the request that last wrote the cache
        cuda = self.step.device.type == "cuda"
        self._prefill_sizer = PrefillSizer.for_model(model.args.n_layers, cuda=cuda,
                                                     first=CUDA_PREFILL_CHUNK if cuda else DEFAULT_PREFILL_CHUNK)

    @classmethod
    def from_loaded(cls, loaded, **kwargs) -> Engine:
        """From a ``model.loader.LoadedModel``."""
        return cls(loaded.model, loaded.tokenizer, name=loaded.name, **kwargs)

    @property
    def max_seq_len(self) -> int:
        return self.step.max_seq_len

    @property
    def device(self):
        return self.step.device

    @property
    def prefill_chunk(self) -> int:
        if self.options.prefill_chunk is not None:
            return self.options.prefill_chunk
        return self._prefill_sizer.next_size()

    def _timed_forward(self, rows: list[list[int]], starts: list[int]) -> None:
        """A prefill forward (in the worker); its time sizes the next chunk."""
        t = time.perf_counter()
        self.step.forward(rows, starts)
        self._prefill_sizer.record(len(rows[0]), time.perf_counter() - t)

    @property
    def compiles(self) -> bool:
        """Whether the decode step is compiled (the first request then waits for the compiler)."""
        return self.step.options.compile and self.step.static is not None

    def warm_up(self, sampling: SamplingParams) -> None:
        """Compile and capture the decode step for ``sampling`` now (blocking; in any thread).

        If compiling fails the engine decodes eagerly; ``compile_failure`` then says why.
        """
        # Controls beyond temperature and top-p take the eager step: nothing to compile for them.
        if sampling.plain:
            self.step.prepare_static(sampling)

    @property
    def compile_failure(self) -> str | None:
        return self.step.static_failure

    def check(self, request: Request) -> None:
        """Raise a ``RequestError`` for a request that cannot run (before any work is done)."""
        check_request(request, self.max_seq_len, self.step.sample_ids or self.step.vocab_size)
        check_constraint(request, self.constraints)

    def constraint_for(self, request: Request) -> GrammarMask | None:
        """The processor of ``request``'s constraint, if it has one (in the step thread)."""
        if request.constraint is None:
            return None
        return self.constraints.processor(request.constraint, extra_stop_ids=request.stop_ids)

    def token_bytes(self, token_id: int) -> bytes:
        # Stop tokens are never printed, whatever bytes a tokenizer gives them.
        return b"" if token_id in self.stop_ids else self.tokenizer.token_bytes(token_id)

    @property
    def cached_ids(self) -> tuple[int, ...]:
        """The token ids whose keys and values the KV cache holds at positions 0, 1, ..."""
        return self._cached

    def align_to_cache(self, ids: Sequence[int]) -> list[int]:
        """``ids``, its start replaced by cached tokens that spell the same bytes
        (``cache_prefix.align_to_cached``)."""
        return align_to_cached(ids, self._cached, self.token_bytes)

    def reusable(self, request: Request) -> int:
        """How many of ``request``'s prompt tokens the cache already holds (the common prefix).

        At least one prompt token is always fed again: its logits give the first new token.
        """
        if not request.reuse_cache:
            return 0
        prompt, cached = request.prompt_ids, self._cached
        n = 0
        for a, b in zip(prompt, cached):
            if a != b:
                break
            n += 1
        return min(n, len(prompt) - 1)

    # -- the producer ----------------------------------------------------------------------------

    async def produce(self, request: Request, send: MemoryObjectSendStream[TokenEvent]) -> None:
        """Generate ``request`` into ``send``, closing it at the end; stop quietly if the reader left.

        At the end the record of what the cache holds keeps no token beyond the events sent
        (``_events`` trims it further, to the events the consumer took).
        """
        async with send:
            self.check(request)
            if self._busy:
                raise EngineBusy("this engine is already generating")
            self._busy = True
            reused = self.reusable(request)
            # From here on the cache is written past the common prefix: forget what was there.
            self._cached = request.prompt_ids[:reused]
            self._record_of = request.request_id
            run = _DecodeRun(self, request, start=time.perf_counter(), fed=reused)
            sent = 0
            try:
                sent = await self._produce(request, send, run, reused)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the consumer closed its end: nobody is listening, so stop
            finally:
                self._busy = False
                # The worker has finished its block: run.fed and run.tokens are final.
                kept = min(run.fed, len(request.prompt_ids) + max(sent, run.sent))
                self._cached = (request.prompt_ids + tuple(run.tokens))[:kept]

    async def _produce(self, request: Request, send: MemoryObjectSendStream[TokenEvent], run: _DecodeRun,
                       reused: int) -> int:
        prompt = list(request.prompt_ids)
        async with StepWorker(report_every_s=self.options.report_every_s, scope=torch.inference_mode) as worker:
            # Prefill every chunk but the last without sampling; the last one yields the first
            # token. One chunk per call, awaited in turn; a cancel waits for one layer of it. Each
            # chunk is as long as fits in the time budget (``prefill_chunk``). Chunks start where
            # the cache's common prefix ends.
            pos = reused
            while len(prompt) - pos > (chunk := self.prefill_chunk):
                await worker.result(worker.submit(self._timed_forward, [prompt[pos:pos + chunk]], [pos]))
                pos += chunk
                run.fed = pos
            run.rows, run.pos = [prompt[pos:]], pos

            # Steps are queued ahead of the one being handled: each runs on the token the one before
            # it sampled, straight after it in the worker, while earlier events travel to the
            # consumer. A cancel revokes those not started; steps queued after the last token
            # find the run finished and return at once.
            calls = deque(worker.submit(run.step) for _ in range(1 + self.options.lookahead))
            while True:
                call = calls.popleft()
                calls.append(worker.submit(run.step))
                event: TokenEvent = await worker.result(call)
                try:
                    send.send_nowait(event)
                except anyio.WouldBlock:
                    await send.send(event)  # the buffer is full: wait for the consumer (backpressure)
                run.sent += 1
                if event.state.finished:
                    return run.sent

    # -- ways to consume it ----------------------------------------------------------------------

    @asynccontextmanager
    async def events(self, request: Request) -> AsyncIterator[MemoryObjectReceiveStream[TokenEvent]]:
        """``async with engine.events(req) as events: async for event in events: ...``: raw token
        events (ids and bytes), the layer under ``stream``.

        The producer runs in a task group around the body. An exception in the producer or the
        body comes out as itself, not wrapped in an exception group. Leaving the body early
        closes the receiving end, which stops the producer after its current step.
        """
        async with self._events(request, None) as receive:
            yield receive

    @asynccontextmanager
    async def _events(self, request: Request, delivered: Callable[[], int] | None):
        self.check(request)
        send, receive = anyio.create_memory_object_stream[TokenEvent](self.options.buffer_size)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.produce, request, send)
                with receive:
                    yield receive
        except BaseExceptionGroup as group:
            raise sole_exception(group) from None
        finally:
            # Events sent but never taken (a cancel, a stop string) were not kept by anyone.
            if delivered is not None and self._record_of == request.request_id:
                self._cached = self._cached[:len(request.prompt_ids) + delivered()]

    @asynccontextmanager
    async def stream(self, request: Request) -> AsyncIterator[EngineStream]:
        """``async with engine.stream(req) as gen: async for response in gen: ...``

        Each ``Response`` carries the text its token commits and what is held back. After the
        loop, ``gen.completion()`` is the whole result; when the loop was cut short (a cancel, an
        error), ``gen.cut_off()`` first gives the whole characters that were still held.
        """
        reused = self.reusable(request)
        generation = EngineStream(self, request, reused)
        async with self._events(request, lambda: generation.delivered) as receive:
            generation._receive = receive
            yield generation

    @asynccontextmanager
    async def beams(self, request: Request) -> AsyncIterator[BeamRun]:
        """``async with engine.beams(req) as run: async for progress in run: ...``, then
        ``run.completion()``: beam search (``beam.beam_run``) with its own cache and thread; the
        engine's cache and what it records as cached are left as they were."""
        self.check(request)
        if self._busy:
            raise EngineBusy("this engine is already generating")
        self._busy = True
        try:
            step = self.step
            source = BeamModel(step.model, step.max_seq_len, step.sample_ids or step.vocab_size, step.device,
                               step.dtype, frozenset(self.stop_ids), self.token_bytes,
                               bool(getattr(self.tokenizer, "strips_leading_space", False)),
                               lambda: self.prefill_chunk, self.constraint_for, self.options.report_every_s)
            async with beam_run(source, request) as run:
                yield run
        finally:
            self._busy = False

    async def complete(self, request: Request) -> Completion:
        """Run ``request`` to the end and return its text, tokens, finish reason and timings."""
        async with self.stream(request) as generation:
            async for _ in generation:
                pass
        return generation.completion()

    def generate(self, request: Request) -> Completion:
        """The blocking form of ``complete``, for scripts and tests."""
        return anyio.run(self.complete, request)


class EngineStream(TextStream):
    """One request's responses: token events made into text as the consumer takes them."""

    def __init__(self, engine: Engine, request: Request, cached_tokens: int) -> None:
        strip = request.chat_reply and bool(getattr(engine.tokenizer, "strips_leading_space", False))
        super().__init__(request, reply_text(request, strip_leading_space=strip),
                         Tally(request.request_id, len(request.prompt_ids), cached_tokens))
        self.delivered = 0  # events taken from the channel

    @property
    def cached_tokens(self) -> int:
        return self.tally.cached_tokens

    def _taken(self) -> None:
        self.delivered += 1



class _DecodeRun:
    """The decode loop's state, advanced one token per ``step`` call in the worker thread only."""

    def __init__(self, engine: Engine, request: Request, *, start: float, fed: int = 0) -> None:
        self.engine = engine
        self.request = request
        self.start = start
        self.rows: list[list[int]] = []
        self.pos = 0
        self.index = 0
        self.fed = fed  # positions of prompt + tokens whose keys and values are in the cache
        self.tokens: list[int] = []  # every token sampled
        self.sent = 0  # events handed to the channel (event loop side)
        self.finished = False
        self.decode: Decode | None = None
        self.constraint: GrammarMask | None = None

    def step(self) -> TokenEvent | None:
        if self.finished:
            return None
        engine = self.engine
        if self.decode is None:
            self.constraint = engine.constraint_for(self.request)
            self.decode = engine.step.decode(self.rows[0], self.pos, self.request.sampling, self.request.seed,
                                             engine._draw, prompt=self.request.prompt_ids,
                                             stop_ids=engine.stop_ids, constraint=self.constraint)
        token = self.decode.next_token()
        # Each call fed the tokens not yet fed: the prompt's tail first, then the token before.
        self.fed = len(self.request.prompt_ids) + len(self.tokens)
        self.tokens.append(token)
        elapsed = time.perf_counter() - self.start
        state = state_after(token, index=self.index, request=self.request, stop_ids=engine.stop_ids,
                            max_seq_len=engine.step.max_seq_len, elapsed_s=elapsed,
                            grammar_done=self.constraint is not None and self.constraint.stopped(0))
        event = TokenEvent(self.request.request_id, self.index, token, engine.token_bytes(token), state, elapsed)
        self.finished = state.finished
        self.index += 1
        return event


__all__ = ["DEFAULT_BUFFER_SIZE", "DEFAULT_LOOKAHEAD", "DEFAULT_PREFILL_CHUNK", "Engine", "EngineOptions", "EngineStream",
           "GenerationState"]

"""Many requests at once: continuous batching over a paged KV cache, as an async library.

::

    async with Scheduler(model, tokenizer) as scheduler:
        stream = scheduler.submit(Request(prompt_ids, sampling=..., max_tokens=64, stop=("\\n\\n",)))
        async for response in stream:          # Response items, tagged with the request's id
            print(response.text, end="")
        completion = stream.completion()       # text, token ids, finish reason, timings
        scheduler.stats                        # counters: prefill tokens, cached tokens, pages

``submit`` queues a job and returns its stream at once; any number of streams can be consumed
concurrently from other tasks. ``stream.cancel()`` (or leaving an ``async with stream`` block
early) stops that job alone; its pages are released at the next step.

One task drives the blocking forward through the step worker thread, a few steps queued ahead;
each job has a bounded channel of token events. A job whose consumer has not taken ``buffer_size`` events yet sits out the next steps
(the others go on), so a slow reader slows its own job without memory growing. Everything that
decides which job runs and which pages it uses happens in the step thread (``batch_core.py``);
the event loop only submits, flags cancels and delivers events.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import torch

from llama_chat.inference.batch_core import BatchCore, CoreSettings, StepResult
from llama_chat.inference.beam import BeamModel, BeamRun, beam_run
from llama_chat.inference.cache_prefix import align_to_cached
from llama_chat.inference.jobs import Job, JobStream
from llama_chat.inference.decode_step import LoneGraph
from llama_chat.inference.prefill import CPU_MOST_TOKENS, PrefillSizer
from llama_chat.inference.speculative import Speculation
from llama_chat.inference.step_worker import StepWorker
from llama_chat.inference.types import (Completion, GenerationState, Request, RequestError, SchedulerStats, TokenEvent,
                                        check_constraint, check_request, sole_exception, stop_ids_of)
from llama_chat.ml.constraints import Constraints, GrammarMask
from llama_chat.ml.controls import (COMPILE_MIN_PARAMETERS, DEFAULT_CACHE_BYTES_CAP, DEFAULT_CACHE_TOKENS_CAP,
                                   DEFAULT_MAX_BATCH)
from llama_chat.ml.cpu import kernels as cpu_kernels
from llama_chat.ml.quantize import apply_quantization
from llama_chat.ml.sampling import SamplingParams
from llama_chat.model import cpu_decode, key_centers
from llama_chat.model.tokenizers.base import Tokenizer
from llama_chat.model.kv_types import for_device
from llama_chat.model.prompt_cache import PromptCache, PromptCacheCounts, PromptCacheSettings
from llama_chat.model.transformer import Transformer

DEFAULT_PAGE_SIZE = 16


@dataclass(frozen=True)
class SchedulerOptions:
    """How the scheduler batches. ``None`` fields take a default that depends on the device."""

    max_batch: int = DEFAULT_MAX_BATCH  # jobs running at once
    cache_tokens: int | None = None  # size of the paged cache in tokens
    page_size: int = DEFAULT_PAGE_SIZE  # token slots per page
    # Most prompt tokens of one job per step; None: sized by time (inference/prefill.py), from
    # 64 (1024 on CUDA) on.
    prefill_chunk: int | None = None
    step_tokens: int | None = None  # most tokens per step, all jobs together
    buffer_size: int = 8  # events of one job waiting for its consumer
    lookahead: int = 8  # steps queued in the worker ahead of the one being delivered
    static_shapes: bool | None = None  # pad decode rows and tables to buckets (default: on CUDA)
    # With static shapes, decode steps through one compiled graph per batch bucket
    # (inference/bucket_step.py): the torch.compile backend and mode, ("inductor",
    # "reduce-overhead") for CUDA graphs. None: the packed forward's eager steps (the default
    # until a GPU has measured the graphs against them).
    bucket_graphs: tuple[str, str | None] | None = None
    max_seq_len: int | None = None  # each job's context; None: the model's
    report_every_s: float = 0.02
    quantize: str = "none"  # "int8": weight-only int8 projections (ml/quantize.py), made here
    cache_type: str | None = None  # the KV pages' type (model/kv_types.py); None: the model's dtype
    # Drafts by prompt lookup or a draft model, verified in one step (inference/speculative.py);
    # None: no drafts.
    speculation: Speculation | None = None
    # Compile the static step of a job running alone (inference/decode_step.py): None where it
    # pays (``compiles_lone``), as for a chat.
    compile: bool | None = False
    # Full pages also kept on disk and read back by later processes (model/prompt_cache.py); None: not.
    prompt_cache: PromptCacheSettings | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch", "page_size", "buffer_size", "lookahead"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


def compiles_lone(device: torch.device, parameters: int, compile: bool | None, *, quantized: bool,
                  dtype: torch.dtype, one_call: bool) -> bool:
    """Whether a job running alone takes a compiled step: when asked, else where it pays. On CUDA
    a model big enough to pay for the compile; on the CPU a float32 model of that size that our
    one-call operator does not read (it beats every compiled step there: docs/benchmarks.md, "CPU
    decode against llama2.c and transformers"). In bfloat16 it was no reliable gain on a CPU
    without bf16 instructions; int8 weights compile only when asked (fbgemm's product stays one
    opaque call in the graph, which gained too little for its cold compile)."""
    if compile is not None:
        return compile
    big = parameters >= COMPILE_MIN_PARAMETERS
    if device.type == "cuda":
        return big
    return device.type == "cpu" and big and dtype == torch.float32 and not quantized and not one_call


def lone_graph(model: Transformer, core: BatchCore, options: SchedulerOptions, *, quantized: bool) -> LoneGraph | None:
    """The static step of a job running alone (``decode_step.py``), where one is made: on CUDA
    for a single stream, a CUDA graph (compiled where ``compiles_lone``); elsewhere compiled where
    ``compiles_lone``. It reads the pages as they are: a type read converted keeps the other steps."""
    first = next(model.parameters())
    device, dtype = first.device, first.dtype
    if not core.cache.reads_as(dtype):
        return None
    parameters = sum(p.numel() for p in model.parameters())
    one_call = device.type == "cpu" and cpu_decode.supports(model)
    compile = compiles_lone(device, parameters, options.compile, quantized=quantized, dtype=dtype, one_call=one_call)
    cuda = device.type == "cuda"
    if not (compile or cuda and options.max_batch == 1):
        return None
    return LoneGraph(model, core.cache, max_seq_len=core.settings.max_seq_len, sample_ids=core.sample_ids,
                     compile=compile, cuda_graph=cuda, row_products=compile and not cuda)


def build_core(model: Transformer, tokenizer: Tokenizer, options: SchedulerOptions, *,
               source: str | Path | None = None) -> BatchCore:
    """A scheduler's parts, made once: the model prepared (quantized, its products packed, its
    projections fused), the core's settings, its paged cache, prompt cache, constraints,
    speculation and the lone job's static step. Everything a step does is decided here."""
    first = next(model.parameters())
    device, dtype = first.device, first.dtype
    quantized = apply_quantization(model, options.quantize)
    cpu_kernels.prepare(model)  # before anything is compiled: a compiled graph keeps its products
    draft = None if options.speculation is None else options.speculation.draft
    if draft is not None:  # its operator reads fused projections, as the target's does
        cpu_kernels.prepare(draft)
        draft.fuse_projections()
    # Fewer products per layer; before anything is compiled, so that nothing fused later can
    # change what a compiled graph reads.
    model.fuse_projections()
    if device.type == "cuda":
        # cuDNN's attention builds an execution plan for every new key length, which costs more
        # than the attention itself at every prefill chunk; flash and memory-efficient attention
        # do not.
        torch.backends.cuda.enable_cudnn_sdp(False)
    cuda = device.type == "cuda"
    max_seq_len = min(options.max_seq_len or model.args.max_seq_len, model.args.max_seq_len)
    a = model.args
    kv_type = for_device(options.cache_type, device, dtype)
    kv_type.check(a.head_dim)
    token_bytes = 2 * a.n_layers * a.n_kv_heads * kv_type.token_bytes(a.head_dim)
    cache_tokens = options.cache_tokens or max(max_seq_len, min(
        options.max_batch * max_seq_len, DEFAULT_CACHE_TOKENS_CAP, DEFAULT_CACHE_BYTES_CAP // token_bytes))
    page_size = options.page_size
    # A single stream's chunks share their step with nobody, and each forward of GGUF blocks
    # expands every weight again (prefill's tiles): from a short first chunk on, the sizer took
    # that expansion for a cost per token and kept the chunks short, so the prompt paid it
    # many times over. Its chunks start at the CPU's longest.
    prefill_chunk = options.prefill_chunk or (1024 if cuda else 64 if options.max_batch > 1 else CPU_MOST_TOKENS)
    sizer = None if options.prefill_chunk else PrefillSizer.for_model(a.n_layers, cuda=cuda, first=prefill_chunk)
    longest = prefill_chunk if sizer is None else sizer.most
    settings = CoreSettings(
        max_batch=options.max_batch,
        num_pages=-(-cache_tokens // page_size) + 1,  # + the scratch page
        page_size=page_size,
        prefill_chunk=prefill_chunk,
        step_tokens=options.step_tokens or max(longest, options.max_batch) + options.max_batch,
        buffer_size=options.buffer_size,
        static_shapes=cuda if options.static_shapes is None else options.static_shapes,
        max_seq_len=max_seq_len,
        bucket_graphs=options.bucket_graphs,
    )
    vocab = getattr(tokenizer, "vocab_size", None)
    sample_ids = vocab if vocab is not None and vocab < model.args.vocab_size else None
    core = BatchCore(model, settings, device=device, dtype=kv_type, token_bytes=tokenizer.token_bytes,
                     sample_ids=sample_ids)
    core.sizer = sizer
    if kv_type.centers_keys:  # before any key is written: q4_0 keys are kept by the model's measure
        core.cache.center_keys_by(key_centers.of_model(model, tokenizer, source=source))
        if draft is not None:
            core.draft_centers = key_centers.of_model(draft, tokenizer)
    if options.prompt_cache is not None:
        core.prompt_cache = PromptCache.for_pool(options.prompt_cache, core.cache, model, source,
                                                 dtype=dtype, quantize=options.quantize)
    core.constraints = Constraints(tokenizer, stop_ids_of(tokenizer))
    core.speculation = options.speculation
    core.lone_step = lone_graph(model, core, options, quantized=quantized)
    return core


class Scheduler:
    """Owns a model, its paged KV cache and the job queue; see the module's docstring."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, options: SchedulerOptions = SchedulerOptions(),
                 *, name: str = "", source: str | Path | None = None, core: BatchCore | None = None) -> None:
        """``core``: the parts made (``build_core``); made here from the rest when not given."""
        self.core = core if core is not None else build_core(model, tokenizer, options, source=source)
        self.model = model
        self._dtype = next(model.parameters()).dtype  # the model's: a beam search's own cache is kept in it
        self.tokenizer = tokenizer
        self.options = options
        self.name = name
        self.stop_ids = stop_ids_of(tokenizer)
        self._strip = bool(getattr(tokenizer, "strips_leading_space", False))
        self._jobs: dict[str, Job] = {}
        self._wake = anyio.Event()
        self._task_group: anyio.abc.TaskGroup | None = None
        self._closed = False

    @classmethod
    def from_loaded(cls, loaded, options: SchedulerOptions = SchedulerOptions()) -> Scheduler:
        """From a ``model.loader.LoadedModel``."""
        return cls(loaded.model, loaded.tokenizer, options, name=loaded.name, source=loaded.path)

    # -- the library API -------------------------------------------------------------------------

    async def __aenter__(self) -> Scheduler:
        # A scheduler may be entered again, in another event loop too (a chat's next turn): the
        # pages and what they hold stay; the task, the thread and the wake-up event are new.
        self._wake = anyio.Event()
        self._closed = False
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._run)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> bool | None:
        assert self._task_group is not None
        self._closed = True
        self._task_group.cancel_scope.cancel()
        try:
            return await self._task_group.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            raise sole_exception(group) from None
        finally:
            self._task_group = None

    @asynccontextmanager
    async def stream(self, request: Request) -> AsyncIterator[JobStream]:
        """One job with the scheduler running around it, for a caller with one request at a time::

            async with scheduler.stream(request) as stream:
                async for response in stream: ...

        The scheduler's pages outlive the block, so the next request finds the prefix this one
        left (a chat's next turn prefills only its new tokens).
        """
        async with self:
            async with self.submit(request) as stream:
                yield stream

    async def complete(self, request: Request) -> Completion:
        """Run ``request`` to the end, as a one-job batch, and return its whole result."""
        async with self.stream(request) as stream:
            async for _ in stream:
                pass
        return stream.completion()

    def generate(self, request: Request) -> Completion:
        """The blocking form of ``complete``, for scripts and tests."""
        return anyio.run(self.complete, request)

    @property
    def max_seq_len(self) -> int:
        return self.core.settings.max_seq_len

    @property
    def page_size(self) -> int:
        return self.core.settings.page_size

    def check(self, request: Request) -> None:
        """Raise a ``RequestError`` for a job that can never run (before it is queued)."""
        check_request(request, self.max_seq_len, self.core.sample_ids or self.model.args.vocab_size)
        check_constraint(request, self.core.constraints)
        need = self.core.reserved_len(len(request.prompt_ids), request.max_tokens)
        if self.core.pages_for(need) > self.core.pages.usable:
            raise RequestError(f"a job of {need} tokens does not fit in a cache of "
                               f"{self.core.pages.usable * self.page_size} tokens (raise --cache-tokens)")

    def submit(self, request: Request) -> JobStream:
        """Queue ``request`` and return the stream of its responses (iterate it in any task)."""
        if self._task_group is None or self._closed:
            raise RuntimeError("submit jobs inside `async with scheduler:`")
        self.check(request)
        if request.request_id in self._jobs:
            raise RequestError(f"a job with id {request.request_id!r} is already running")
        speculation = self.options.speculation
        # A draft's step: batch_core._drafts.
        extra = 0 if speculation is None else (request.draft_max or speculation.draft_max) + 1
        send, receive = anyio.create_memory_object_stream[TokenEvent](self.options.buffer_size + extra)
        stop_ids = self.stop_ids | frozenset(request.stop_ids)
        job = Job(request, time.perf_counter(), send, stop_ids)
        self._jobs[request.request_id] = job
        self.core.counters.submitted += 1
        self.core.incoming.append(job)
        self._notify()
        return JobStream(job, receive, strip_leading_space=request.chat_reply and self._strip,
                         on_receive=self._notify, on_cancel=self._cancel)

    @asynccontextmanager
    async def beams(self, request: Request) -> AsyncIterator[BeamRun]:
        """``async with scheduler.beams(req) as run: async for progress in run: ...``, then
        ``run.completion()``: beam search (``beam.beam_run``) over this scheduler's model, with a
        cache and a thread of its own; the pages and what they hold are left as they were."""
        self.check(request)
        core = self.core
        source = BeamModel(self.model, self.max_seq_len, core.sample_ids or self.model.args.vocab_size, core.device,
                           self._dtype, frozenset(self.stop_ids), self._token_bytes,
                           self._strip, self._prefill_chunk, self._constraint_for, self.options.report_every_s)
        async with beam_run(source, request) as run:
            yield run

    def _prefill_chunk(self) -> int:
        sizer = self.core.sizer
        return self.core.settings.prefill_chunk if sizer is None else sizer.next_size()

    def _constraint_for(self, request: Request) -> GrammarMask | None:
        if request.constraint is None:
            return None
        assert self.core.constraints is not None
        return self.core.constraints.processor(request.constraint, extra_stop_ids=request.stop_ids)

    def cancel(self, request_id: str) -> None:
        """Stop one job (no error if it has already finished)."""
        job = self._jobs.get(request_id)
        if job is not None:
            self._cancel(job)

    @property
    def compiles(self) -> bool:
        """Whether a job running alone takes a compiled step (made by ``warm_up``, or by the
        first such step)."""
        lone = self.core.lone_step
        return lone is not None and lone.compile and lone.failure is None

    @property
    def device(self) -> torch.device:
        return self.core.device

    def warm_up(self, sampling: SamplingParams | None = None) -> None:
        """Make the steps' backends and compile the lone sequence's step now (blocking; before
        any job runs). If compiling fails, every step stays eager; ``compile_failure`` then says
        why. (The step samples outside its graph: one graph serves every ``sampling``.)"""
        if self.core.lone_step is not None:
            self.core.lone_step.warm_up()
        self.core.prepare()

    @property
    def compile_failure(self) -> str | None:
        return None if self.core.lone_step is None else self.core.lone_step.failure

    @property
    def cached_ids(self) -> tuple[int, ...]:
        """The tokens the last job to end wrote into pages, in order: for a caller that runs one
        job at a time (a chat), what the page table may still hold of its conversation."""
        return self.core.last_written

    def align_to_cache(self, ids: list[int]) -> list[int]:
        """``ids``, its start replaced by the last job's tokens that spell the same bytes
        (``cache_prefix.align_to_cached``), so its full pages are found again."""
        return align_to_cached(ids, self.core.last_written, self._token_bytes)

    def _token_bytes(self, token_id: int) -> bytes:
        return b"" if token_id in self.stop_ids else self.tokenizer.token_bytes(token_id)

    async def wait_released(self, stream: JobStream) -> None:
        """Wait until the job's pages are back in the pool (after it finished or was cancelled)."""
        await stream.job.released.wait()

    @property
    def stats(self) -> SchedulerStats:
        c, pages = self.core.counters, self.core.pages
        disk = self.core.prompt_cache.counts if self.core.prompt_cache is not None else PromptCacheCounts()
        return SchedulerStats(c.submitted, c.finished, c.prefill_tokens, c.cached_tokens, c.generated_tokens,
                              c.steps, c.mixed_steps, self.page_size, pages.usable, len(pages.free),
                              len(pages.cached), pages.in_use, c.pages_peak, pages.evictions, c.compactions,
                              c.drafted_tokens, c.accepted_tokens,
                              pages.resident * self.core.cache.page_bytes,
                              self.core.cache.num_pages * self.core.cache.page_bytes,
                              c.disk_tokens, disk.written_blocks, disk.skipped_blocks)

    # -- the producer ----------------------------------------------------------------------------

    def _notify(self) -> None:
        self._wake.set()

    def _cancel(self, job: Job) -> None:
        if not job.cancelled and not job.released.is_set():
            job.cancelled = True
            self._notify()

    async def _run(self) -> None:
        state = GenerationState.CANCELLED  # how jobs still open end: the scheduler was closed
        try:
            async with StepWorker(report_every_s=self.options.report_every_s, scope=torch.inference_mode) as worker:
                while True:
                    wake = self._wake
                    await self._run_until_idle(worker)
                    await wake.wait()  # set by a submit, a cancel or a consumer taking an event
                    if self._wake is wake:
                        self._wake = anyio.Event()
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException:
            state = GenerationState.ERROR
            raise
        finally:
            # Closed (cancelled with the scheduler) or failed: every job still open ends here,
            # and, the step thread being gone, its pages go back to the pool from here.
            self.core.abandon(state)
            for job in list(self._jobs.values()):
                if job.final_state is None:
                    job.final_state = state
                self._finish(job)

    async def _run_until_idle(self, worker: StepWorker) -> None:
        """Steps, ``lookahead`` queued, until one finds nothing to run; then the rest are drained."""
        inflight = deque(worker.submit(self.core.step) for _ in range(self.options.lookahead))
        idle = False
        while inflight:
            result: StepResult = await worker.result(inflight.popleft())
            self._deliver(result)
            idle = idle or result.idle
            if not idle:
                inflight.append(worker.submit(self.core.step))

    def _deliver(self, result: StepResult) -> None:
        for job, event in result.events:
            try:
                # Never blocks: the step thread runs a job only while its channel has room.
                job.send.send_nowait(event)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._cancel(job)  # nobody is reading it any more
        for job in result.released:
            self._finish(job)

    def _finish(self, job: Job) -> None:
        job.send.close()
        job.released.set()
        self._jobs.pop(job.request_id, None)


__all__ = ["JobStream", "Scheduler", "SchedulerOptions", "SchedulerStats"]

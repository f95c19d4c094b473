"""Many clients on one scheduler: requests become jobs within bounds, each job is followed to its
end (or cancelled when its client goes), and what a Prometheus scraper reads is counted here.

::

    serving = Serving(scheduler, queue_limit=64, metrics=ServingMetrics())
    choices = serving.submit([request, ...])      # Overloaded, NotAccepting, RequestError
    async with choices[0] as choice:
        async for text in choice.pieces(): ...     # committed text, what is ready taken at once
        completion = choice.completion()
    serving.metrics.exposition(serving.snapshot())

Nothing here knows HTTP (``cmd/serve_app.py`` does) and nothing imports torch: the server answers
``/health`` and ``/metrics`` while the model is still loading, and the scheduler is only handed in.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from llama_chat.inference.types import Completion, Request, Response, TokenLogprobs

if TYPE_CHECKING:
    from llama_chat.inference.jobs import JobStream
    from llama_chat.inference.scheduler import Scheduler
    from llama_chat.inference.types import SchedulerStats

# What a request to the generation endpoints came to; every one is counted under one of these.
OUTCOMES = ("ok", "cancelled", "invalid", "rejected", "error")
# Histogram bounds in seconds: the first token waits for the queue and the prefill, the next ones
# for one step of every job running.
TTFT_BOUNDS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BOUNDS = (0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RETRY_AFTER_S = 1
DRAIN_POLL_S = 0.05


class Overloaded(Exception):
    """Every batch slot and queue place is taken; the client may try again later."""

    def __init__(self, capacity: int) -> None:
        super().__init__(f"the server is busy: {capacity} jobs are running or queued; try again shortly")
        self.retry_after_s = RETRY_AFTER_S


class NotAccepting(Exception):
    """The server is shutting down."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down")


class Histogram:
    """Prometheus' cumulative histogram: counts per upper bound, their sum, and ``+Inf``."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            running += n
            le = "+Inf" if bound == math.inf else repr(float(bound))
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        out += [f"{name}_sum {self.total!r}", f"{name}_count {running}"]
        return out


@dataclass(frozen=True)
class Snapshot:
    """The state the metrics read at one moment; ``stats`` is None while the model loads."""

    ready: bool
    running: int = 0  # jobs with their pages, generating
    queued: int = 0  # jobs waiting for a batch slot or for pages
    stats: SchedulerStats | None = None


@dataclass
class ServingMetrics:
    """Counters and histograms of the server's life, written in Prometheus' text format."""

    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BOUNDS))
    inter_token: Histogram = field(default_factory=lambda: Histogram(INTER_TOKEN_BOUNDS))

    def count(self, outcome: str) -> None:
        self.requests[outcome] += 1

    def exposition(self, now: Snapshot) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, values: list[str]) -> None:
            lines.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}", *values])

        metric("llama_chat_ready", "gauge", "1 once the model is loaded and the server takes requests.",
               [f"llama_chat_ready {int(now.ready)}"])
        metric("llama_chat_requests_total", "counter", "Generation requests by outcome.",
               [f'llama_chat_requests_total{{outcome="{o}"}} {n}' for o, n in self.requests.items()])
        metric("llama_chat_time_to_first_token_seconds", "histogram",
               "From a job's submission, queue included, to its first token.",
               self.ttft.lines("llama_chat_time_to_first_token_seconds"))
        metric("llama_chat_inter_token_latency_seconds", "histogram", "Between two tokens of one job.",
               self.inter_token.lines("llama_chat_inter_token_latency_seconds"))
        metric("llama_chat_jobs_running", "gauge", "Jobs generating now.", [f"llama_chat_jobs_running {now.running}"])
        metric("llama_chat_jobs_queued", "gauge", "Jobs waiting for a batch slot or for cache pages.",
               [f"llama_chat_jobs_queued {now.queued}"])
        s = now.stats
        if s is None:
            return "\n".join(lines) + "\n"
        prompt = s.prefill_tokens + s.cached_tokens
        metric("llama_chat_prompt_tokens_total", "counter", "Prompt tokens of every job, cached ones included.",
               [f"llama_chat_prompt_tokens_total {prompt}"])
        metric("llama_chat_prompt_tokens_cached_total", "counter",
               "Prompt tokens whose keys and values came from the prefix cache.",
               [f"llama_chat_prompt_tokens_cached_total {s.cached_tokens}"])
        metric("llama_chat_generated_tokens_total", "counter", "Tokens generated.",
               [f"llama_chat_generated_tokens_total {s.generated_tokens}"])
        metric("llama_chat_drafted_tokens_total", "counter",
               "Tokens drafted by prompt lookup or the draft model and verified.",
               [f"llama_chat_drafted_tokens_total {s.drafted_tokens}"])
        metric("llama_chat_accepted_tokens_total", "counter", "Drafted tokens that were kept.",
               [f"llama_chat_accepted_tokens_total {s.accepted_tokens}"])
        metric("llama_chat_prompt_cache_disk_tokens_total", "counter",
               "Prompt tokens whose keys and values were read from the prompt cache on disk (--prompt-cache).",
               [f"llama_chat_prompt_cache_disk_tokens_total {s.disk_tokens}"])
        metric("llama_chat_prompt_cache_blocks_written_total", "counter", "Pages written to the prompt cache on disk.",
               [f"llama_chat_prompt_cache_blocks_written_total {s.disk_blocks_written}"])
        metric("llama_chat_prompt_cache_blocks_skipped_total", "counter",
               "Blocks of the prompt cache on disk not used: truncated, damaged, or another model's or cache's.",
               [f"llama_chat_prompt_cache_blocks_skipped_total {s.disk_blocks_skipped}"])
        metric("llama_chat_prefix_cache_hit_ratio", "gauge", "Cached prompt tokens over all prompt tokens.",
               [f"llama_chat_prefix_cache_hit_ratio {s.cached_tokens / prompt if prompt else 0.0!r}"])
        metric("llama_chat_kv_pages_used", "gauge", "KV cache pages in some job's block table.",
               [f"llama_chat_kv_pages_used {s.pages_in_use}"])
        metric("llama_chat_kv_pages_free", "gauge",
               "KV cache pages a job can take: empty ones and those holding a prefix nobody uses now.",
               [f"llama_chat_kv_pages_free {s.pages_available}"])
        metric("llama_chat_kv_pages_cached", "gauge", "Free pages that still hold a prefix for the next job.",
               [f"llama_chat_kv_pages_cached {s.pages_cached}"])
        metric("llama_chat_kv_pages_total", "gauge", f"KV cache pages of {s.page_size} tokens.",
               [f"llama_chat_kv_pages_total {s.pages_total}"])
        return "\n".join(lines) + "\n"


class Choice:
    """One job of a request, as the server consumes it: its text in pieces, timed into the metrics.

    ``async with choice:`` cancels the job on the way out unless it has finished, and gives its
    place back to the ``Serving`` that admitted it.
    """

    def __init__(self, index: int, stream: JobStream, serving: Serving) -> None:
        self.index = index
        self.stream = stream
        self._serving = serving
        self._last_s: float | None = None
        self._closed = False
        self._logprobs_taken = 0

    async def __aenter__(self) -> Choice:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self.stream.aclose()
            self._serving._release(self)

    def cancel(self) -> None:
        self.stream.cancel()

    async def pieces(self) -> AsyncIterator[str]:
        """The answer's text each batch of responses commits (never empty); responses already
        waiting are taken together, so a client far behind gets fewer, longer pieces."""
        async for text, _ in self.parts():
            if text:
                yield text

    async def parts(self) -> AsyncIterator[tuple[str, str]]:
        """``(answer, thinking)``: the text each batch of responses commits to each (never both
        empty; a thinking model's thinking: ``inference/reasoning.py``)."""
        while (part := await self.take()) is not None:
            yield part

    async def take(self) -> tuple[str, str] | None:
        """The next of ``parts`` (waiting for it), or None at the end: ``parts`` without an async
        generator's own step for every piece, for a caller that handles one per token."""
        stream = self.stream
        while True:
            try:
                response = await stream.__anext__()
            except StopAsyncIteration:
                return None
            text, thought = self._observe(response), response.reasoning
            while not response.state.finished and (waiting := stream.next_ready()) is not None:
                response = waiting
                text += self._observe(response)
                thought += response.reasoning
            if text or thought:
                return text, thought

    def completion(self) -> Completion:
        """What the job came to; after a cancel, the text so far and finish reason ``cancelled``."""
        return self.stream.completion()

    def take_logprobs(self) -> list[tuple[int, TokenLogprobs]]:
        """The ``(token id, logprobs)`` of the tokens taken since the last call (``JobStream.logprobs``:
        none unless the request asked for them)."""
        entries = self.stream.logprobs[self._logprobs_taken:]
        self._logprobs_taken += len(entries)
        return entries

    @property
    def phase(self) -> str:
        """``queued`` (waiting for a batch slot or pages), ``running``, or ``done`` (its pages are
        back in the pool)."""
        job = self.stream.job
        if job.released.is_set():
            return "done"
        return "running" if job.serial > 0 else "queued"

    def _observe(self, response: Response) -> str:
        metrics = self._serving.metrics
        if self._last_s is None:
            metrics.ttft.observe(response.elapsed_s)
        else:
            metrics.inter_token.observe(max(0.0, response.elapsed_s - self._last_s))
        self._last_s = response.elapsed_s
        return response.text


class Serving:
    """Admits requests onto ``scheduler`` while fewer than ``max_batch + queue_limit`` jobs are
    open, and drains them at shutdown. Use it inside ``async with scheduler:``."""

    def __init__(self, scheduler: Scheduler, *, queue_limit: int, metrics: ServingMetrics) -> None:
        self.scheduler = scheduler
        self.capacity = scheduler.options.max_batch + queue_limit
        self.metrics = metrics
        self.accepting = True
        self._open: set[Choice] = set()

    def submit(self, requests: Sequence[Request]) -> list[Choice]:
        """Every request queued as a job, or none: raises ``RequestError`` (a request that cannot
        run), ``NotAccepting`` (shutting down) or ``Overloaded`` (no room now)."""
        if not self.accepting:
            raise NotAccepting()
        for request in requests:
            self.scheduler.check(request)
        if len(self._open) + len(requests) > self.capacity:
            raise Overloaded(self.capacity)
        choices = [Choice(i, self.scheduler.submit(request), self) for i, request in enumerate(requests)]
        self._open.update(choices)
        return choices

    def snapshot(self) -> Snapshot:
        phases = [choice.phase for choice in self._open]
        return Snapshot(True, phases.count("running"), phases.count("queued"), self.scheduler.stats)

    @property
    def open_jobs(self) -> int:
        return len(self._open)

    async def drain(self, grace_s: float) -> int:
        """Refuse new requests, let the open jobs finish for up to ``grace_s`` seconds, then cancel
        the rest; how many were cancelled."""
        self.accepting = False
        with anyio.move_on_after(grace_s):
            while self._open:
                await anyio.sleep(DRAIN_POLL_S)
        left = list(self._open)
        for choice in left:
            choice.cancel()
        return len(left)

    def _release(self, choice: Choice) -> None:
        self._open.discard(choice)


__all__ = ["Choice", "Histogram", "NotAccepting", "OUTCOMES", "Overloaded", "Serving", "ServingMetrics", "Snapshot"]

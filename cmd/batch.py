"""``llama-chat --batch [FILE]``: every prompt of a file or of stdin through the batching scheduler.

::

    task group
    ├── watch_signals     first Ctrl+C cancels `scope`: what has finished is written, exit 130
    ├── progress          stderr on a terminal: jobs done of the total, tokens/s of all jobs
    └── scope
        └── Scheduler     one task drives the batched forward (inference/scheduler.py)
            └── one consumer task per job: its responses -> one JSON line when it ends

Results are JSON Lines on stdout, one per input line, as jobs finish (or in input order with
``--ordered``). A line that is not a job is reported on stderr with its number and gets an
``error`` object in the output; the other jobs run, and the exit status is then 2.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

import anyio
from rich.console import Console

from llama_chat.cmd import exit_status
from llama_chat.cmd.batch_input import BadLine, JobLine
from llama_chat.cmd.inputs import UsageProblem
from llama_chat.cmd.prompt import prompt_ids
from llama_chat.cmd.run_command import load, silence_stdout, warm_up
from llama_chat.cmd.sanitize import one_line
from llama_chat.cmd.signals import StopRequest, install_sync_handlers, watch_signals
from llama_chat.inference.jobs import JobStream
from llama_chat.inference.remote import RemoteModel, RemoteSource
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions, SchedulerStats
from llama_chat.inference.types import Completion, GenerationState, Request, RequestError

if TYPE_CHECKING:
    from llama_chat.cmd.options import Options

PROGRESS_EVERY_S = 0.2


class OutputGone(Exception):
    """stdout's reader went away."""


class ResultWriter:
    """JSON Lines to ``out``: at once, or (``ordered``) each as soon as all lines before it are out."""

    def __init__(self, out: TextIO, lines: list[int], *, ordered: bool, before_write=None) -> None:
        self.out = out
        self.ordered = ordered
        self.order = lines
        self.pending: dict[int, dict] = {}
        self.next = 0  # index in ``order`` of the next line to write (ordered)
        self.written = 0
        self.added = 0
        self.before_write = before_write

    def add(self, line: int, obj: dict) -> None:
        self.added += 1
        if not self.ordered:
            self._write(obj)
            return
        self.pending[line] = obj
        while self.next < len(self.order) and self.order[self.next] in self.pending:
            self._write(self.pending.pop(self.order[self.next]))
            self.next += 1

    def flush_finished(self) -> None:
        """After an interruption: whatever has finished, in input order, gaps left out."""
        for line in self.order[self.next:]:
            if line in self.pending:
                self._write(self.pending.pop(line))

    def _write(self, obj: dict) -> None:
        if self.before_write is not None:
            self.before_write()
        try:
            self.out.write(json.dumps(obj, ensure_ascii=False) + "\n")
            self.out.flush()
        except BrokenPipeError:
            raise OutputGone() from None
        self.written += 1


class ProgressBar:
    """One line on stderr, redrawn in place: jobs done of the total and tokens/s of all jobs."""

    def __init__(self, err: Console, total: int) -> None:
        self.file = err.file
        self.total = total
        self.done = 0
        self.start = time.perf_counter()
        self.shown = False

    def clear(self) -> None:
        if self.shown:
            self.file.write("\r\x1b[K")
            self.file.flush()
            self.shown = False

    def draw(self, stats: SchedulerStats) -> None:
        width = 24
        filled = width * self.done // max(1, self.total)
        rate = stats.generated_tokens / max(1e-9, time.perf_counter() - self.start)
        self.file.write(f"\r\x1b[K[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} jobs  "
                        f"{rate:.0f} tok/s")
        self.file.flush()
        self.shown = True

    async def run(self, scheduler: Scheduler) -> None:
        try:
            while True:
                self.draw(scheduler.stats)
                await anyio.sleep(PROGRESS_EVERY_S)
        finally:
            self.clear()


def _requests(opts: Options, jobs: list[JobLine | BadLine], loaded, scheduler: Scheduler
              ) -> tuple[list[tuple[JobLine, Request]], list[BadLine]]:
    """Each good line as a ``Request`` with its own settings over the command line's."""
    good, bad = [], []
    for job in jobs:
        if isinstance(job, BadLine):
            bad.append(job)
            continue
        try:
            ids = prompt_ids(job.prompt, system=job.system if job.system is not None else opts.system,
                             tokenizer=loaded.tokenizer, chat_format=loaded.chat_format, template=opts.template)
            request = opts.request(ids, chat_reply=loaded.chat_format is not None, request_id=f"line-{job.line}",
                                   **dict(job.settings))
            scheduler.check(request)
        except (UsageProblem, RequestError, ValueError) as e:
            bad.append(BadLine(job.line, job.job_id, str(e)))
            continue
        good.append((job, request))
    return good, bad


def result_object(job: JobLine, completion: Completion, seed: int) -> dict[str, Any]:
    return {
        "id": job.job_id,
        "line": job.line,
        "text": completion.text,
        "finish_reason": completion.finish_reason.value,
        "prompt_tokens": completion.prompt_tokens,
        "cached_tokens": completion.cached_tokens,
        "completion_tokens": completion.completion_tokens,
        "token_ids": list(completion.token_ids),
        "seed": seed,
        "timings": completion.timings.as_dict(),
    }


def error_object(bad: BadLine) -> dict[str, Any]:
    return {"id": bad.job_id, "line": bad.line, "error": bad.message, "finish_reason": GenerationState.ERROR.value}


async def _run_all(scheduler: Scheduler, good: list[tuple[JobLine, Request]], writer: ResultWriter,
                   progress: ProgressBar | None, stop: StopRequest) -> bool:
    """Run every job; False when stdout's reader went away."""
    output_ok = True

    async def consume(job: JobLine, stream: JobStream, seed: int) -> None:
        nonlocal output_ok
        async for _ in stream:
            pass
        if progress is not None:
            progress.done += 1
        try:
            writer.add(job.line, result_object(job, stream.completion(), seed))
        except OutputGone:
            output_ok = False
            scope.cancel()

    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()
        await tg.start(watch_signals, scope, stop)
        with scope:
            async with scheduler:
                if progress is not None:
                    tg.start_soon(progress.run, scheduler)
                async with anyio.create_task_group() as jobs:
                    for job, request in good:
                        jobs.start_soon(consume, job, scheduler.submit(request), request.seed)
        tg.cancel_scope.cancel()  # the signal watcher and the progress bar
    return output_ok


def stats_text(stats: SchedulerStats, elapsed: float) -> str:
    """What --stats tells a user sizing a batch: tokens, speed and how full the cache was (the
    scheduler's inner counters are for its tests and docs/batching.md, not for this line)."""
    return (f"batch: {stats.jobs_finished} jobs; prompt tokens: {stats.prefill_tokens} prefilled, "
            f"{stats.cached_tokens} from cached pages; generated {stats.generated_tokens} tokens in {elapsed:.2f} s "
            f"({stats.generated_tokens / max(elapsed, 1e-9):.1f} tok/s); pages: {stats.pages_peak} peak of "
            f"{stats.pages_total} ({stats.page_size} tokens each), {stats.evictions} evicted")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def run_batch(opts: Options, jobs: list[JobLine | BadLine], color: str, err: Console) -> int:
    loaded = load(opts, err)
    if isinstance(loaded, RemoteModel):  # -m openai:URL: the server batches, --max-batch requests at a time
        scheduler = RemoteSource(loaded, max_batch=opts.max_batch)
    else:
        # A lone job's compiled step only with --compile: in a batch, jobs rarely run alone.
        scheduler = Scheduler.from_loaded(loaded, SchedulerOptions(
            max_batch=opts.max_batch, cache_tokens=opts.cache_tokens, quantize=opts.quantize,
            compile=bool(opts.compile)))
    warm_up(scheduler, opts.sampling(), err, quiet=False)
    good, bad = _requests(opts, jobs, loaded, scheduler)
    for b in sorted(bad, key=lambda b: b.line):
        err.print(f"llama-chat: line {b.line}: {one_line(b.message)}", markup=False, highlight=False, soft_wrap=True)

    progress = ProgressBar(err, len(good)) if err.is_terminal and good else None
    before = progress.clear if progress is not None and sys.stdout.isatty() else None
    writer = ResultWriter(sys.stdout, [j.line for j in jobs], ordered=opts.ordered, before_write=before)
    stop = StopRequest()
    start = time.perf_counter()
    try:
        for b in bad:
            writer.add(b.line, error_object(b))
        output_ok = anyio.run(_run_all, scheduler, good, writer, progress, stop) if good else True
        if stop.signum is not None:
            writer.flush_finished()
    except OutputGone:
        output_ok = False
    finally:
        install_sync_handlers()  # the event loop's signal receiver left SIGTERM at its default
    if not output_ok:
        silence_stdout()
        return exit_status.OUTPUT_CLOSED
    elapsed = time.perf_counter() - start
    stats = scheduler.stats
    done = writer.added - len(bad)
    summary = f"finish: {done} of {plural(len(good), 'job')}" + (f", {plural(len(bad), 'bad line')}" if bad else "")
    if stop.signum is not None:
        summary += " (cancelled)"
    err.print(summary, style="dim", markup=False, highlight=False, soft_wrap=True)
    if opts.stats:
        err.print(stats_text(stats, elapsed), style="dim", markup=False, highlight=False, soft_wrap=True)
    if stop.signum is not None:
        return exit_status.for_signal(stop.signum)
    return exit_status.USAGE if bad else exit_status.OK

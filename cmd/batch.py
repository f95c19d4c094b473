"""``llama-chat --batch [FILE]``: every prompt of a file or of stdin through the batching scheduler.

::

    task group
    ├── watch_signals     first Ctrl+C cancels `scope`: what has finished is written, exit 130
    ├── progress          stderr on a terminal: jobs done of those read, tokens/s of all jobs
    └── scope
        └── Scheduler     one task drives the batched forward (inference/scheduler.py)
            ├── feed      reads lines in a worker thread, a few at a time, and submits each job
            └── one consumer task per job: its responses -> one JSON line when it ends

Results are JSON Lines on stdout, one per input line, as jobs finish (or in input order with
``--ordered``). A line that is not a job is reported on stderr with its number and gets an
``error`` object in the output; the other jobs run, and the exit status is then 2.

The input is read as the jobs run, never all at once: at most ``window_size`` jobs are read and
not yet written, so a file of a million lines runs in the memory of a few dozen jobs, its first
results come out while the rest is still being read, and Ctrl+C is honoured at any moment (the
feed waits on the window or on the reader, and both give way to a cancel).
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

import anyio
from rich.console import Console

from llama_chat.cmd import exit_status
from llama_chat.cmd.batch_input import BadLine, BatchReader, JobLine
from llama_chat.cmd.generation_source import make_source
from llama_chat.cmd.inputs import UsageProblem
from llama_chat.cmd.prompt import prompt_ids, thinking_model
from llama_chat.cmd.report import failure_line, reasoning_fields
from llama_chat.cmd.run_command import load, silence_stdout, warm_up
from llama_chat.cmd.sanitize import one_line
from llama_chat.cmd.signals import StopRequest, install_sync_handlers, watch_signals
from llama_chat.inference.types import (Completion, GenerationState, Request, RequestError, SchedulerStats,
                                        sole_exception)
from llama_chat.model.memory_budget import gigabytes

if TYPE_CHECKING:
    from llama_chat.cmd.options import Options
    from llama_chat.inference.jobs import JobStream
    from llama_chat.inference.scheduler import Scheduler

PROGRESS_EVERY_S = 0.2
# Lines read per trip to the reader's thread: few enough that a slow pipe delivers its jobs as
# they come, enough that a file of short lines does not pay a thread hop per line.
READ_AHEAD = 32


def window_size(max_batch: int) -> int:
    """Jobs read but not yet written at most: enough to keep ``max_batch`` slots busy while
    others wait for their turn (or, ``--ordered``, for the lines before them)."""
    return max(64, 4 * max_batch)


class OutputGone(Exception):
    """stdout's reader went away."""


class OutputFailed(Exception):
    """stdout cannot be written (a full disk, an I/O error); the message says why, in a few words."""


class ResultWriter:
    """JSON Lines to ``out``: at once, or (``ordered``) each as soon as all lines before it are out.

    ``expect`` is told each line in input order as it is read; ``on_written`` is called once per
    line written (the batch's window)."""

    def __init__(self, out: TextIO, *, ordered: bool, before_write=None, on_written=None) -> None:
        self.out = out
        self.ordered = ordered
        self.order: deque[int] = deque()  # lines read and not yet written, in input order (ordered)
        self.pending: dict[int, dict] = {}
        self.written = 0
        self.added = 0
        self.before_write = before_write
        self.on_written = on_written

    def expect(self, line: int) -> None:
        if self.ordered:
            self.order.append(line)

    def add(self, line: int, obj: dict) -> None:
        self.added += 1
        if not self.ordered:
            self._write(obj)
            return
        self.pending[line] = obj
        while self.order and self.order[0] in self.pending:
            self._write(self.pending.pop(self.order.popleft()))

    def flush_finished(self) -> None:
        """After an interruption: whatever has finished, in input order, gaps left out."""
        for line in self.order:
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
        except OSError as e:
            raise OutputFailed(e.strerror or str(e)) from None
        self.written += 1
        if self.on_written is not None:
            self.on_written()


class ProgressBar:
    """One line on stderr, redrawn in place: jobs done of those read (of the total once the input
    has ended) and tokens/s of all jobs."""

    def __init__(self, err: Console) -> None:
        self.file = err.file
        self.read = 0
        self.all_read = False
        self.done = 0
        self.start = time.perf_counter()
        self.shown = False

    def clear(self) -> None:
        if self.shown:
            self.file.write("\r\x1b[K")
            self.file.flush()
            self.shown = False

    def input_ended(self, stats: SchedulerStats) -> None:
        """The total is known: said at once, not at the next tick (a short batch may end first)."""
        self.all_read = True
        self.draw(stats)

    def draw(self, stats: SchedulerStats) -> None:
        width = 24
        filled = width * self.done // max(1, self.read) if self.all_read else 0
        rate = stats.generated_tokens / max(1e-9, time.perf_counter() - self.start)
        total = f"{self.read}" if self.all_read else f"{self.read}+"
        self.file.write(f"\r\x1b[K[{'#' * filled}{'.' * (width - filled)}] {self.done}/{total} jobs  "
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


@dataclass(frozen=True)
class ReadyJob:
    """A job whose request is made and checked: what its consumer needs, without its text."""

    line: int
    job_id: Any
    request: Request


def _problem(e: Exception) -> str:
    if isinstance(e, (UsageProblem, RequestError, ValueError)):
        return str(e)
    return failure_line(e)


class JobMaker:
    """Lines of the input as checked requests, each with its own settings over the command line's."""

    def __init__(self, opts: Options, loaded, scheduler: Scheduler) -> None:
        self.opts, self.loaded, self.scheduler = opts, loaded, scheduler
        self.think = thinking_model(loaded)

    def make(self, item: JobLine | BadLine) -> ReadyJob | BadLine:
        if isinstance(item, BadLine):
            return item
        opts, loaded = self.opts, self.loaded
        try:
            line_opts = opts.with_settings(**dict(item.settings)) if item.settings else opts
            ids = prompt_ids(item.prompt, system=item.system if item.system is not None else opts.system,
                             tokenizer=loaded.tokenizer, chat_format=loaded.chat_format, template=opts.template,
                             thinking=line_opts.thinking(), think=self.think)
            request = opts.request(ids, chat_reply=loaded.chat_format is not None, request_id=f"line-{item.line}",
                                   thinker=self.think, **dict(item.settings))
            self.scheduler.check(request)
        except Exception as e:  # noqa: BLE001 - one line's problem is that line's error record
            return BadLine(item.line, item.job_id, _problem(e))
        return ReadyJob(item.line, item.job_id, request)

    def take(self, reader: BatchReader, most: int) -> list[ReadyJob | BadLine]:
        """Read and make up to ``most`` jobs (in the reader's thread: reading a pipe blocks, and
        a long prompt takes a while to tokenize)."""
        return [self.make(item) for item in reader.take(most)]


def result_object(job: ReadyJob, completion: Completion, seed: int) -> dict[str, Any]:
    return {
        "id": job.job_id,
        "line": job.line,
        "text": completion.text,
        **reasoning_fields(completion),
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


@dataclass
class BatchRun:
    """One batch's moving parts and its tallies."""

    reader: BatchReader
    maker: JobMaker
    scheduler: Scheduler
    writer: ResultWriter
    err: Console
    progress: ProgressBar | None
    stop: StopRequest
    window: anyio.Semaphore | None = None
    jobs: int = 0  # good lines submitted
    bad: int = 0
    done: int = 0
    output_gone: bool = False
    output_failed: str | None = None
    read_failed: str | None = None

    def report(self, bad: BadLine) -> None:
        if self.progress is not None:
            self.progress.clear()
        self.err.print(f"llama-chat: line {bad.line}: {one_line(bad.message)}", markup=False, highlight=False,
                       soft_wrap=True)

    def written(self) -> None:
        if self.window is not None:
            self.window.release()

    def write(self, line: int, obj: dict) -> bool:
        """Hand one result to the writer; False when stdout failed or went away (recorded)."""
        try:
            self.writer.add(line, obj)
        except OutputGone:
            self.output_gone = True
            return False
        except OutputFailed as e:
            self.output_failed = str(e)
            return False
        return True


async def _run_all(run: BatchRun) -> None:
    """Read, submit and run every job until the input ends, Ctrl+C, or stdout fails."""
    run.window = anyio.Semaphore(window_size(run.scheduler.options.max_batch))

    async def consume(job: ReadyJob, stream: JobStream) -> None:
        async for _ in stream:
            pass
        run.done += 1
        if run.progress is not None:
            run.progress.done += 1
        if not run.write(job.line, result_object(job, stream.completion(), job.request.seed)):
            scope.cancel()

    async def feed(jobs: anyio.abc.TaskGroup) -> None:
        while True:
            try:
                items = await anyio.to_thread.run_sync(run.maker.take, run.reader, READ_AHEAD,
                                                       abandon_on_cancel=True)
            except UsageProblem as e:  # the input failed while being read: what was read runs
                run.read_failed = str(e)
                return
            if not items:
                if run.progress is not None:
                    run.progress.input_ended(run.scheduler.stats)
                return
            for item in items:
                await run.window.acquire()
                run.writer.expect(item.line)
                if run.progress is not None:
                    run.progress.read += 1
                if isinstance(item, ReadyJob):
                    try:
                        stream = run.scheduler.submit(item.request)
                    except RequestError as e:
                        item = BadLine(item.line, item.job_id, str(e))
                    else:
                        run.jobs += 1
                        jobs.start_soon(consume, item, stream)
                        continue
                run.bad += 1
                run.report(item)
                if not run.write(item.line, error_object(item)):
                    scope.cancel()

    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()
        await tg.start(watch_signals, scope, run.stop)
        with scope:
            async with run.scheduler:
                if run.progress is not None:
                    tg.start_soon(run.progress.run, run.scheduler)
                async with anyio.create_task_group() as jobs:
                    await feed(jobs)
        tg.cancel_scope.cancel()  # the signal watcher and the progress bar


def stats_text(stats: SchedulerStats, elapsed: float) -> str:
    """What --stats tells a user sizing a batch: tokens, speed and how full the cache was (the
    scheduler's inner counters are for its tests and docs/batching.md, not for this line)."""
    return (f"batch: {stats.jobs_finished} jobs; prompt tokens: {stats.prefill_tokens} prefilled, "
            f"{stats.cached_tokens} from cached pages; generated {stats.generated_tokens} tokens in {elapsed:.2f} s "
            f"({stats.generated_tokens / max(elapsed, 1e-9):.1f} tok/s); pages: {stats.pages_peak} peak of "
            f"{stats.pages_total} ({stats.page_size} tokens each), {stats.evictions} evicted; KV memory: "
            f"{gigabytes(stats.kv_resident_bytes)} resident of {gigabytes(stats.kv_reserved_bytes)} reserved")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def run_batch(opts: Options, reader: BatchReader, color: str, err: Console) -> int:
    settings = opts.source_settings()
    loaded = load(settings.load, err)
    scheduler = make_source(loaded, settings)
    warm_up(scheduler, opts.sampling(), err, quiet=False)

    progress = ProgressBar(err) if err.is_terminal else None
    before = progress.clear if progress is not None and sys.stdout.isatty() else None
    stop = StopRequest()
    writer = ResultWriter(sys.stdout, ordered=opts.ordered, before_write=before)
    run = BatchRun(reader, JobMaker(opts, loaded, scheduler), scheduler, writer, err, progress, stop)
    writer.on_written = run.written  # each line written frees a place in the window
    start = time.perf_counter()
    try:
        anyio.run(_run_all, run)
        if stop.signum is not None and not (run.output_gone or run.output_failed):
            run.writer.flush_finished()
    except BaseExceptionGroup as group:
        raise sole_exception(group) from None
    except OutputGone:
        run.output_gone = True
    except OutputFailed as e:
        run.output_failed = str(e)
    finally:
        install_sync_handlers()  # the event loop's signal receiver left SIGTERM at its default
    if run.output_gone or run.output_failed:
        silence_stdout()
        if run.output_failed:
            err.print(f"llama-chat: error: cannot write the results to standard output ({one_line(run.output_failed)})",
                      markup=False, highlight=False, soft_wrap=True)
            return exit_status.FAILURE
        return exit_status.OUTPUT_CLOSED
    elapsed = time.perf_counter() - start
    summary = f"finish: {run.done} of {plural(run.jobs, 'job')}" + (
        f", {plural(run.bad, 'bad line')}" if run.bad else "")
    if stop.signum is not None:
        summary += " (cancelled)"
    if run.read_failed:
        err.print(f"llama-chat: error: {one_line(run.read_failed)}", markup=False, highlight=False, soft_wrap=True)
    err.print(summary, style="dim", markup=False, highlight=False, soft_wrap=True)
    if opts.stats:
        err.print(stats_text(scheduler.stats, elapsed), style="dim", markup=False, highlight=False, soft_wrap=True)
    if stop.signum is not None:
        return exit_status.for_signal(stop.signum)
    return exit_status.USAGE if run.bad or run.read_failed else exit_status.OK

"""The one-shot command from options to exit status: read input, load, generate, report.

Everything before and after ``anyio.run`` runs with signals raising exceptions in the main thread
(see ``signals.py``); ``app.execute`` turns those and every error into an exit status.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from llama_chat.cmd import exit_status
from llama_chat.cmd.generation_source import make_source
from llama_chat.cmd.inputs import read_suffix
from llama_chat.cmd.load_progress import load_progress
from llama_chat.cmd.memory_check import check_memory
from llama_chat.cmd.one_shot import Outcome, run_one_shot
from llama_chat.cmd.prompt import fim_prompt_ids, prompt_ids, thinking_model, with_template_file
from llama_chat.cmd.render import make_renderer
from llama_chat.cmd.report import print_summary, seed_to_report, write_json
from llama_chat.cmd.sanitize import one_line
from llama_chat.cmd.signals import install_sync_handlers
from llama_chat.cmd.startup import silence_stdout
from llama_chat.inference.remote import RemoteModel, connect, is_remote
from llama_chat.ml.user_cache import cache_problem
from llama_chat.model.stores import resolve_model

if TYPE_CHECKING:
    from llama_chat.cmd.options import Options
    from llama_chat.cmd.source_settings import LoadSettings
    from llama_chat.inference.scheduler import Scheduler
    from llama_chat.ml.sampling import SamplingParams
    from llama_chat.model.loader import LoadedModel


def load(settings: LoadSettings, err: Console) -> LoadedModel | RemoteModel:
    if is_remote(settings.model):
        # Another machine's model (inference/remote.py): nothing is loaded here, the server is asked.
        with_template_file(object(), settings.chat_template_file)  # refused: its server's template
        return connect(settings.model, model=settings.remote_model, template=settings.template,
                       api_key=settings.api_key or os.environ.get("OPENAI_API_KEY"))
    from llama_chat.model.loader import default_model_dir, load_model  # torch: a local model's command only

    if settings.model is None:
        path, name = default_model_dir(), None
    else:
        # A path, a Hugging Face id (org/name) or ollama:NAME[:TAG]; a download only with --download.
        resolved = resolve_model(str(settings.model), download=settings.download, progress=err.is_terminal)
        path, name = resolved.path, resolved.name
    # The bar (stderr on a terminal, big checkpoints only) is erased on success, error or Ctrl+C.
    with load_progress(name or Path(path).name or str(path), console=err) as on_progress:
        # --quantize int8 is applied while loading, so the float model never exists whole.
        loaded = load_model(path, device=settings.device, dtype=settings.dtype, chat_format=settings.template,
                            max_seq_len=settings.ctx_size, on_progress=on_progress, name=name,
                            quantize=settings.quantize)
    loaded = with_template_file(loaded, settings.chat_template_file)
    check_memory(settings, loaded)  # -c, --cache-tokens, --max-batch against the memory left
    prepare_cpu_kernels(loaded, settings.quantize, err, quiet=settings.quiet)
    return loaded


def prepare_cpu_kernels(loaded: LoadedModel, quantize: str, err: Console, *, quiet: bool) -> None:
    """Build (the first time) or load our CPU products for this model, saying so on a terminal.

    A build that fails is said in one line, once per machine (``ml/cpu_kernels.py`` remembers
    it), and decoding goes on with PyTorch's products.
    """
    from llama_chat.ml.cpu import kernels as cpu_kernels

    if not cpu_kernels.wanted(loaded.model, quantize) or cpu_kernels.loaded():
        return
    building = not cpu_kernels.cached()
    if building:
        with slow_notice(err, "building CPU kernels (first run only)",
                         "building the CPU kernels for this machine (first run only; a minute or more)", quiet=quiet):
            cpu_kernels.load()
    else:
        cpu_kernels.load()
    if cpu_kernels.failure() and not cpu_kernels.failed_before() and not quiet:
        # The reason quotes the compiler's name and output: shown through one_line like any outside text.
        err.print(f"llama-chat: could not build the CPU kernels ({one_line(cpu_kernels.failure())}); "
                  f"using PyTorch's products", markup=False, highlight=False, soft_wrap=True)


# A first use that takes longer than this is announced in a pipe too (a terminal shows a spinner
# from the start): a wait with nothing said looks like a hang.
SLOW_NOTICE_S = 1.0


@contextmanager
def slow_notice(err: Console, status: str, line: str, *, quiet: bool) -> Iterator[None]:
    """A spinner saying ``status`` on a terminal, with the time so far (a first build takes a
    minute or more); elsewhere one line, ``line``, if the block takes more than ``SLOW_NOTICE_S``;
    nothing when ``quiet`` (``--json``)."""
    if quiet:
        yield
        return
    if err.is_terminal:
        with Progress(SpinnerColumn("dots"), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                      transient=True) as progress:
            progress.add_task(status, total=None)
            yield
        return
    timer = threading.Timer(SLOW_NOTICE_S, lambda: err.print(f"llama-chat: {line}", markup=False, highlight=False,
                                                             soft_wrap=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def warm_up(source: Scheduler, sampling: SamplingParams, err: Console, *, quiet: bool) -> None:
    """Compile and capture the decode step before the prompt is timed, saying so on a terminal.

    A compile that fails is reported in one line and decoding goes on without it.
    """
    if source.compiles:
        with slow_notice(err, f"compiling for {source.device.type} (first run only)",
                         f"compiling the decode step for {source.device.type} (the first run takes longest)",
                         quiet=quiet):
            source.warm_up(sampling)
        problem = cache_problem("torch-compile")
        if problem and not quiet:
            err.print(f"llama-chat: compiled steps are kept for this run only ({one_line(problem)})",
                      markup=False, highlight=False, soft_wrap=True)
    else:
        source.warm_up(sampling)
    if source.compile_failure and not quiet:
        err.print(f"llama-chat: could not compile the decode step ({source.compile_failure}); "
                  f"decoding without compiling", markup=False, highlight=False)


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def run_command(opts: Options, text: str, color: str, err: Console) -> int:
    """Load, generate ``text`` (the prompt, already read and checked) and report; the exit status."""
    started = time.perf_counter()
    suffix = read_suffix(opts)  # before the load: a file that cannot be read is a usage error at once
    settings = opts.source_settings()
    loaded = load(settings.load, err)
    if suffix is not None:
        # The middle continues the prefix: framed by the model's FIM tokens, no chat template.
        fim = fim_prompt_ids(loaded, text, suffix)
        request = replace(opts.request(fim.ids, chat_reply=False), stop_ids=fim.stop_ids)
    else:
        think = thinking_model(loaded)
        ids = prompt_ids(text, system=opts.system, tokenizer=loaded.tokenizer, chat_format=loaded.chat_format,
                         template=opts.template, thinking=opts.thinking(), think=think)
        # A chat reply is not a continuation of the prompt text: no leading word-start space.
        request = opts.request(ids, chat_reply=loaded.chat_format is not None, thinker=think)
    seed = request.seed
    source = make_source(loaded, settings)
    source.check(request)  # a prompt longer than the context is bad input, found before any work
    warm_up(source, request.sampling, err, quiet=opts.json)
    load_s = time.perf_counter() - started  # --stats: the wait before the prompt's timings begin
    if request.beams.enabled:
        from llama_chat.cmd.beam_command import run_beam_command

        return run_beam_command(source, request, err, json=opts.json, stats=opts.stats, seed=seed, model=loaded.name)

    stdout_tty = sys.stdout.isatty()
    renderer = None if opts.json else make_renderer(stdout_tty, color, sys.stdout)
    try:
        outcome: Outcome = anyio.run(partial(run_one_shot, output_fd=_fileno(sys.stdout),
                                                    hide_thinking=opts.hide_thinking), source, request, renderer)
    finally:
        install_sync_handlers()  # the event loop's signal receiver left SIGTERM at its default

    if outcome.output_closed:
        silence_stdout()
        return exit_status.OUTPUT_CLOSED
    shown_seed = seed_to_report(seed, given=opts.seed, temperature=request.sampling.temperature)
    if opts.json:
        try:
            write_json(sys.stdout, outcome.completion, seed=shown_seed, model=loaded.name)
        except BrokenPipeError:
            silence_stdout()
            return exit_status.OUTPUT_CLOSED
    # A pipe's answer ends its line (PlainRenderer.finish), so the summary starts a fresh one.
    print_summary(err, outcome.completion, shown_seed, stats=opts.stats, load_s=load_s,
                  weights=loaded.weights() if opts.stats and not isinstance(loaded, RemoteModel) else None)
    if outcome.signum is not None:
        return exit_status.for_signal(outcome.signum)
    return exit_status.OK

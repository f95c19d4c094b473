"""The one-shot command with ``--num-beams`` > 1: beam search is not streamed, so a progress line
on a terminal, then the best beam's text; under ``--json`` every returned beam with its score."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import anyio
from rich.console import Console

from llama_chat.cmd import exit_status
from llama_chat.cmd.one_shot import BeamOutcome, run_beams
from llama_chat.cmd.render import beam_progress_text
from llama_chat.cmd.report import beam_finish_line, beam_json_object, beam_stats_line
from llama_chat.cmd.sanitize import displayable
from llama_chat.cmd.signals import install_sync_handlers
from llama_chat.inference.beam import BeamProgress
from llama_chat.inference.types import Request

if TYPE_CHECKING:
    from llama_chat.cmd.generation_source import Source


def search(source: Source, request: Request, err: Console, *, quiet: bool = False) -> BeamOutcome:
    """Run the search with a progress line on stderr when it is a terminal (and not ``quiet``)."""
    if quiet or not err.is_terminal:
        return anyio.run(run_beams, source, request, None)
    with err.status(beam_progress_text(0, 0, request.beams.num_beams, 0.0), spinner="dots") as status:
        def show(progress: BeamProgress) -> None:
            status.update(beam_progress_text(progress.step, progress.finished, progress.num_beams,
                                             progress.elapsed_s))

        return anyio.run(run_beams, source, request, show)


def run_beam_command(source: Source, request: Request, err: Console, *, json: bool, stats: bool, seed: int,
                     model: str) -> int:
    """Search, print and report; the exit status."""
    try:
        outcome = search(source, request, err, quiet=json)
    finally:
        install_sync_handlers()  # the event loop's signal receiver left SIGTERM at its default
    done = outcome.completion
    try:
        if json:
            import json as json_module

            sys.stdout.write(json_module.dumps(beam_json_object(done, seed=seed, model=model), ensure_ascii=False) + "\n")
        elif done.best is not None:
            text = displayable(done.best.text)
            sys.stdout.write(text + ("\n" if sys.stdout.isatty() and not text.endswith("\n") else ""))
        sys.stdout.flush()
    except BrokenPipeError:
        return exit_status.OUTPUT_CLOSED
    err.print(beam_finish_line(done, seed), highlight=False, soft_wrap=True)
    if stats:
        err.print(beam_stats_line(done), highlight=False, soft_wrap=True)
    if outcome.signum is not None:
        return exit_status.for_signal(outcome.signum)
    return exit_status.OK

"""Where a command's requests run: chosen here, once, for every command.

- A remote model (``-m openai:URL``): its server, behind ``RemoteSource``.
- A local model: the scheduler (``inference/scheduler.py``), the one generation core. A prompt
  or a chat is a one-job batch whose pages hold one whole context; ``--batch`` and ``serve`` run
  many jobs at once. The step's fast paths (the operator's pick, its rows, the compiled lone
  step) are its backends, chosen per step in ``inference/batch_step.py``.
- The one exception: one stream at a time on CUDA keeps the engine (``inference/engine.py``),
  whose decode step is replayed as a CUDA graph over its dense cache. The scheduler's steps are
  not graphed yet, and that path stays as it is until a GPU measures the two side by side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llama_chat.inference.engine import Engine, EngineOptions
from llama_chat.inference.remote import RemoteModel, RemoteSource
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
from llama_chat.inference.speculative import Speculation

if TYPE_CHECKING:
    from llama_chat.model.loader import LoadedModel

# Token slots per page for one stream: the last, partly filled page of a chat's turn is prefilled
# again by the next one, so pages are smaller than a batch's (SchedulerOptions.page_size).
SINGLE_STREAM_PAGE_SIZE = 8
# Events one stream's producer may run ahead of its reader: a small model's job alone makes
# several tokens per step call (``BatchCore._lone_steps``), and a channel of a batch's size made
# it wait for the reader every few tokens.
SINGLE_STREAM_BUFFER = 64

Source = Scheduler | Engine | RemoteSource


def single_stream(loaded: LoadedModel | RemoteModel, opts) -> Source:
    """The source of a one-shot prompt or a chat: one request at a time."""
    if isinstance(loaded, RemoteModel):
        return RemoteSource(loaded)
    quantize = getattr(opts, "quantize", "none")
    if loaded.device.type == "cuda":
        return Engine.from_loaded(loaded, options=EngineOptions(compile=opts.compile, quantize=quantize))
    return Scheduler.from_loaded(loaded, SchedulerOptions(
        max_batch=1, page_size=SINGLE_STREAM_PAGE_SIZE, buffer_size=SINGLE_STREAM_BUFFER,
        cache_tokens=loaded.model.args.max_seq_len,
        speculation=speculation(opts),
        quantize=quantize, compile=opts.compile, cache_type=cache_type(opts)))


def cache_type(opts) -> str | None:
    """The pages' type: ``--cache-type``'s, except that ``auto`` with ``--compile`` keeps the
    model's dtype, which the compiled step reads as it is (a 16-bit page would leave it out)."""
    chosen = getattr(opts, "cache_type", None)
    if chosen in (None, "auto") and getattr(opts, "compile", None):
        return None
    return chosen


def speculation(opts) -> Speculation | None:
    """Prompt-lookup drafts where ``--lookup on`` asks for them."""
    if getattr(opts, "lookup", "off") != "on":
        return None
    return Speculation(draft_max=opts.draft_max)


def many_jobs(loaded: LoadedModel | RemoteModel, opts, *, max_batch: int, cache_tokens: int | None) -> Scheduler | RemoteSource:
    """The source of ``--batch`` and ``serve``: up to ``max_batch`` jobs at once. A lone job takes
    the compiled step only with ``--compile``: in a batch, jobs rarely run alone."""
    if isinstance(loaded, RemoteModel):  # the server batches, max_batch requests at a time
        return RemoteSource(loaded, max_batch=max_batch)
    return Scheduler.from_loaded(loaded, SchedulerOptions(
        max_batch=max_batch, cache_tokens=cache_tokens, quantize=getattr(opts, "quantize", "none"),
        speculation=speculation(opts),
        compile=bool(opts.compile), cache_type=cache_type(opts)))

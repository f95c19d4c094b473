"""Where a command's requests run: chosen here, once, for every command.

- A remote model (``-m openai:URL``): its server, behind ``RemoteSource``.
- A local model: the scheduler (``inference/scheduler.py``), the one generation core. A prompt
  or a chat is a one-job batch whose pages hold one whole context; ``--batch`` and ``serve`` run
  many jobs at once. The step's fast paths (the operator's pick, its rows, the compiled lone
  step) are its backends, chosen per step in ``inference/batch_step.py``.
- The one exception: one stream at a time on CUDA keeps the engine (``inference/engine.py``),
  whose decode step is replayed as a CUDA graph over its dense cache. The scheduler's steps are
  not graphed yet, and that path stays as it is until a GPU measures the two side by side.

Speculative decoding (``inference/speculative.py``) is chosen here too: prompt lookup as
``--lookup`` says, and a draft model (``--draft``), loaded here beside the model and refused
unless it has the model's vocabulary; and the prompt cache on disk (``--prompt-cache``,
``model/prompt_cache.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from llama_chat.inference.remote import RemoteModel, RemoteSource
from llama_chat.inference.speculative import Speculation
from llama_chat.ml.controls import PROMPT_CACHE_DEFAULT_DIR

# The local sources import torch when first made: a remote model's command never imports it.
if TYPE_CHECKING:
    from llama_chat.inference.engine import Engine
    from llama_chat.inference.scheduler import Scheduler
    from llama_chat.model.loader import LoadedModel
    from llama_chat.model.prompt_cache import PromptCacheSettings
    from llama_chat.model.tokenizers.base import Tokenizer

    Source = Scheduler | Engine | RemoteSource

# Token slots per page for one stream: the last, partly filled page of a chat's turn is prefilled
# again by the next one, so pages are smaller than a batch's (SchedulerOptions.page_size).
SINGLE_STREAM_PAGE_SIZE = 8
# Events one stream's producer may run ahead of its reader: a small model's job alone makes
# several tokens per step call (``BatchCore._alone_again``), and a channel of a batch's size made
# it wait for the reader every few tokens.
SINGLE_STREAM_BUFFER = 64


def single_stream(loaded: LoadedModel | RemoteModel, opts) -> Source:
    """The source of a one-shot prompt or a chat: one request at a time (a draft model, if
    ``--draft`` names one, is loaded here)."""
    if isinstance(loaded, RemoteModel):
        return RemoteSource(loaded)
    from llama_chat.inference.engine import Engine, EngineOptions
    from llama_chat.inference.scheduler import Scheduler, SchedulerOptions

    quantize = getattr(opts, "quantize", "none")
    if loaded.device.type == "cuda":
        return Engine.from_loaded(loaded, options=EngineOptions(compile=opts.compile, quantize=quantize))
    return Scheduler.from_loaded(loaded, SchedulerOptions(
        max_batch=1, page_size=SINGLE_STREAM_PAGE_SIZE, buffer_size=SINGLE_STREAM_BUFFER,
        cache_tokens=loaded.model.args.max_seq_len,
        speculation=speculation(opts, loaded, jobs=1),
        quantize=quantize, compile=opts.compile, cache_type=cache_type(opts),
        prompt_cache=prompt_cache(opts)))


def prompt_cache(opts) -> PromptCacheSettings | None:
    """``--prompt-cache``'s folder (``auto``: the user cache's) and ``--prompt-cache-size``; its
    problems (a block skipped, a full disk) said on stderr, a line each. None: no cache."""
    chosen = getattr(opts, "prompt_cache", None)
    if chosen is None:
        return None
    from llama_chat.cmd.inputs import UsageProblem
    from llama_chat.ml.user_cache import wanted_cache_dir, writable_dir
    from llama_chat.model.prompt_cache import PromptCacheSettings

    directory = wanted_cache_dir("prompt-cache") if chosen == PROMPT_CACHE_DEFAULT_DIR else Path(chosen).expanduser()
    try:
        writable_dir(directory)
    except OSError as e:
        raise UsageProblem(f"--prompt-cache: cannot keep blocks in {directory} ({e.strerror or e})") from None
    return PromptCacheSettings(directory, opts.prompt_cache_size << 20, say=say_on_stderr)


def say_on_stderr(line: str) -> None:
    print(f"llama-chat: {line}", file=sys.stderr, flush=True)


def cache_type(opts) -> str | None:
    """The pages' type: ``--cache-type``'s, except that ``auto`` with ``--compile`` keeps the
    model's dtype, which the compiled step reads as it is (a 16-bit page would leave it out)."""
    chosen = getattr(opts, "cache_type", None)
    if chosen in (None, "auto") and getattr(opts, "compile", None):
        return None
    return chosen


def speculation(opts, loaded: LoadedModel, *, jobs: int, server: bool = False) -> Speculation | None:
    """How a scheduler of up to ``jobs`` jobs drafts: prompt lookup as ``--lookup`` says
    (``lookup_on``), and ``--draft``'s model. None where nothing drafts; a server always has one,
    for a request may ask for lookup (``openai_api.read_settings``)."""
    lookup = lookup_on(getattr(opts, "lookup", "off"), loaded.model, jobs)
    draft = load_draft(opts, loaded)
    if not lookup and draft is None and not server:
        return None
    return Speculation(draft_max=opts.draft_max, lookup=lookup, draft=draft)


def lookup_on(mode: str, model, jobs: int) -> bool:
    """``--lookup``: on, off, or auto: on, except for a single stream whose drafted steps would
    make a float32 copy of its weights that its own steps never read (16-bit weights, up to
    ``cpu_decode.PANELS_AT_MOST``); a batch's steps of several rows make it anyway."""
    if mode != "auto":
        return mode == "on"
    from llama_chat.model import cpu_decode

    return jobs > 1 or cpu_decode.rows_copy_bytes(model) == 0


def load_draft(opts, loaded: LoadedModel):
    """``--draft``'s model (a ``Transformer``), loaded as the model was (device, dtype,
    context, quantization), or None. ``ModelLoadError`` (one line, exit status 2) where it cannot
    be loaded or its vocabulary is not the model's."""
    name = getattr(opts, "draft", None)
    if name is None:
        return None
    from llama_chat.model.errors import ModelLoadError
    from llama_chat.model.loader import load_model
    from llama_chat.model.stores import resolve_model

    resolved = resolve_model(str(name), download=False, progress=False)
    draft = load_model(resolved.path, device=loaded.device, dtype=getattr(opts, "dtype", "auto"),
                       max_seq_len=getattr(opts, "ctx_size", None), chat_format="none",
                       quantize=getattr(opts, "quantize", "none"))
    difference = vocabulary_difference(loaded.tokenizer, draft.tokenizer)
    if difference is not None:
        raise ModelLoadError(f"the draft model {resolved.path} does not share the vocabulary of "
                             f"{loaded.path}: {difference}")
    return draft.model


def vocabulary_difference(model: Tokenizer, draft: Tokenizer) -> str | None:
    """What differs between two tokenizers' vocabularies (their sizes, or the first id whose bytes
    differ), or None: a draft is made of ids, and the model reads them as its own."""
    if model.vocab_size != draft.vocab_size:
        return f"{draft.vocab_size} tokens against {model.vocab_size}"
    for token in range(model.vocab_size):
        if model.token_bytes(token) != draft.token_bytes(token):
            return f"token {token} is {draft.token_bytes(token)!r} in the draft, {model.token_bytes(token)!r} in the model"
    return None


def many_jobs(loaded: LoadedModel | RemoteModel, opts, *, max_batch: int, cache_tokens: int | None) -> Scheduler | RemoteSource:
    """The source of ``--batch`` and ``serve``: up to ``max_batch`` jobs at once. A lone job takes
    the compiled step only with ``--compile``: in a batch, jobs rarely run alone."""
    if isinstance(loaded, RemoteModel):  # the server batches, max_batch requests at a time
        return RemoteSource(loaded, max_batch=max_batch)
    from llama_chat.inference.scheduler import Scheduler, SchedulerOptions

    return Scheduler.from_loaded(loaded, SchedulerOptions(
        max_batch=max_batch, cache_tokens=cache_tokens, quantize=getattr(opts, "quantize", "none"),
        speculation=speculation(opts, loaded, jobs=max_batch),
        compile=bool(opts.compile), cache_type=cache_type(opts), prompt_cache=prompt_cache(opts)))

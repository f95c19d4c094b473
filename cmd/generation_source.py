"""Where a command's requests run, and how: decided here, once, for every command, ``serve``
included (``make_source``, from the command's ``SourceSettings``).

- A remote model (``-m openai:URL``): its server, behind ``RemoteSource``.
- A local model: the scheduler (``inference/scheduler.py``), the one generation core on every
  device. A prompt or a chat is a one-job batch whose pages hold one whole context; ``--batch``
  and ``serve`` run many jobs at once. The step's fast paths (the operator's pick, its rows, the
  lone job's static step, a CUDA graph on CUDA) are its backends, fixed when it is built
  (``inference/batch_step.py``).

Decided here for the scheduler: the pages' type (``cache_type``: the device's check and the
``--cache-type auto`` rule), the pool's size (``pool_size``), the draft model (``--draft``, loaded
here once beside the model and refused unless it has the model's vocabulary), prompt lookup
(``--lookup``) and the prompt cache on disk (``--prompt-cache``, ``model/prompt_cache.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from llama_chat.cmd.source_settings import ONE_STREAM, SERVER_JOBS, SourceSettings
from llama_chat.inference.remote import RemoteModel, RemoteSource
from llama_chat.inference.speculative import Speculation
from llama_chat.ml.controls import PROMPT_CACHE_DEFAULT_DIR

# The local sources import torch when first made: a remote model's command never imports it.
if TYPE_CHECKING:
    from llama_chat.inference.source import Source
    from llama_chat.model.kv_types import KVType
    from llama_chat.model.loader import LoadedModel
    from llama_chat.model.prompt_cache import PromptCacheSettings
    from llama_chat.model.tokenizers.base import Tokenizer
    from llama_chat.model.transformer import Transformer

# Token slots per page for one stream: the last, partly filled page of a chat's turn is prefilled
# again by the next one, so pages are smaller than a batch's (SchedulerOptions.page_size).
SINGLE_STREAM_PAGE_SIZE = 8
# Events one stream's producer may run ahead of its reader: a small model's job alone makes
# several tokens per step call (``BatchCore._alone_again``), and a channel of a batch's size made
# it wait for the reader every few tokens.
SINGLE_STREAM_BUFFER = 64
# A server's paged cache's most bytes by default where the machine's free memory cannot be read.
POOL_BYTES_UNKNOWN = 4 * 2**30


def make_source(loaded: LoadedModel | RemoteModel, settings: SourceSettings) -> Source:
    """The source of a command's requests: a remote model's server, or a scheduler of one job
    (``ONE_STREAM``) or of up to ``--max-batch`` (``BATCH_JOBS``, ``SERVER_JOBS``), made from what is
    decided below. ``ModelLoadError`` (one line, exit status 2) for a cache type this device or
    model cannot keep, for a draft model that cannot be used and for a model that makes vectors,
    not text; ``UsageProblem`` for a prompt cache folder that cannot be written."""
    one = settings.jobs == ONE_STREAM
    if isinstance(loaded, RemoteModel):  # the server batches, max_batch requests at a time
        return RemoteSource(loaded) if one else RemoteSource(loaded, max_batch=settings.max_batch)
    if loaded.kind != "chat":
        from llama_chat.model.errors import ModelLoadError

        what, command = ("a reranker", "rerank") if loaded.kind == "rerank" else ("an embedding model", "embed")
        raise ModelLoadError(f"{loaded.path} is {what}, which writes no text: use `llama-chat {command}` or "
                             "`llama-chat serve`")
    from llama_chat.inference.scheduler import Scheduler, SchedulerOptions

    jobs = 1 if one else settings.max_batch
    kv_type = cache_type(settings, loaded)
    cache = prompt_cache(settings)
    draft = load_draft(settings, loaded)
    # One stream's pages and channel are its own (above); a batch's are the scheduler's defaults.
    shape = {"page_size": SINGLE_STREAM_PAGE_SIZE, "buffer_size": SINGLE_STREAM_BUFFER} if one else {}
    return Scheduler.from_loaded(loaded, SchedulerOptions(
        max_batch=jobs, cache_tokens=pool_size(settings, loaded, kv_type), cache_type=kv_type.name,
        quantize=settings.load.quantize,
        # A lone job takes the compiled step in a batch only with --compile: there, jobs rarely
        # run alone; one stream compiles where the device's default says (None).
        compile=settings.compile if one else bool(settings.compile),
        speculation=speculation(settings, loaded, draft, jobs=jobs), prompt_cache=cache, **shape))


def cache_type(settings: SourceSettings, loaded: LoadedModel) -> KVType:
    """The pages' type: ``--cache-type``'s on this device (auto: f16 on the CPU, the weights' dtype
    elsewhere), except that auto with ``--compile`` keeps the model's dtype, which the compiled
    step reads as it is (a 16-bit page would leave it out). ``ModelLoadError`` for a type this
    device or this model's heads cannot keep."""
    from llama_chat.model.errors import ModelLoadError
    from llama_chat.model.kv_types import for_device

    chosen = settings.cache_type
    if chosen == "auto" and settings.compile:
        chosen = None
    try:
        kind = for_device(chosen, loaded.device, loaded.dtype)
        kind.check(loaded.model.args.head_dim)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    return kind


def pool_size(settings: SourceSettings, loaded: LoadedModel, kv_type: KVType) -> int | None:
    """The paged cache's tokens: one stream's whole context; else ``--cache-tokens`` where given;
    a server's every batch slot within the memory free (``pool_tokens``); ``--batch``'s None, the
    scheduler's default within fixed caps (``--cache-tokens``' help says them)."""
    a = loaded.model.args
    if settings.jobs == ONE_STREAM:
        return a.max_seq_len
    if settings.cache_tokens is not None or settings.jobs != SERVER_JOBS:
        return settings.cache_tokens
    from llama_chat.model.memory_budget import available_on

    token_bytes = 2 * a.n_layers * a.n_kv_heads * kv_type.token_bytes(a.head_dim)
    return pool_tokens(token_bytes, a.max_seq_len, settings.max_batch, available_on(loaded.device))


def pool_tokens(token_bytes: int, context: int, max_batch: int, available: int | None) -> int:
    """A server's paged cache's tokens when ``--cache-tokens`` is not given: every batch slot at
    the full context, within half the memory the machine has left once the weights are loaded
    (``available``; None: unknown, and then ``POOL_BYTES_UNKNOWN``), but always one whole context.

    The pool is reserved, not touched: it takes memory only where jobs write (page_table.py), so
    this is the most it may take, not what it takes at rest.
    """
    budget = POOL_BYTES_UNKNOWN if available is None else available // 2
    return max(context, min(max_batch * context, budget // token_bytes))


def prompt_cache(settings: SourceSettings) -> PromptCacheSettings | None:
    """``--prompt-cache``'s folder (``auto``: the user cache's) and ``--prompt-cache-size``; its
    problems (a block skipped, a full disk) said on stderr, a line each. None: no cache."""
    chosen = settings.prompt_cache
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
    return PromptCacheSettings(directory, settings.prompt_cache_size << 20, say=say_on_stderr)


def say_on_stderr(line: str) -> None:
    print(f"llama-chat: {line}", file=sys.stderr, flush=True)


def speculation(settings: SourceSettings, loaded: LoadedModel, draft: Transformer | None, *,
                jobs: int) -> Speculation | None:
    """How a scheduler of up to ``jobs`` jobs drafts: prompt lookup as ``--lookup`` says
    (``lookup_on``), and the draft model, loaded already. None where nothing drafts; a server
    always has one, for a request may ask for lookup (``openai_api.read_settings``)."""
    lookup = lookup_on(settings.lookup, loaded.model, jobs)
    if not lookup and draft is None and settings.jobs != SERVER_JOBS:
        return None
    return Speculation(draft_max=settings.draft_max, lookup=lookup, draft=draft)


def lookup_on(mode: str, model, jobs: int) -> bool:
    """``--lookup``: on, off, or auto: on, except for a single stream whose drafted steps would
    make a float32 copy of its weights that its own steps never read (16-bit weights, up to
    ``cpu_decode.PANELS_AT_MOST``); a batch's steps of several rows make it anyway."""
    if mode != "auto":
        return mode == "on"
    from llama_chat.model import cpu_decode

    return jobs > 1 or cpu_decode.rows_copy_bytes(model) == 0


def load_draft(settings: SourceSettings, loaded: LoadedModel) -> Transformer | None:
    """``--draft``'s model, loaded as the model was (device, dtype, context, quantization), or
    None. ``ModelLoadError`` (one line, exit status 2) where it cannot be loaded or its
    vocabulary is not the model's."""
    if settings.draft is None:
        return None
    from llama_chat.model.errors import ModelLoadError
    from llama_chat.model.loader import load_model
    from llama_chat.model.stores import resolve_model

    how = settings.load
    resolved = resolve_model(str(settings.draft), download=False, progress=False)
    draft = load_model(resolved.path, device=loaded.device, dtype=how.dtype, max_seq_len=how.ctx_size,
                       chat_format="none", quantize=how.quantize)
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

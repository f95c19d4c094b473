"""The records a command's core is made from, each built once from the command's own options
(``Options.source_settings``, ``ServeOptions.source_settings``; a ``--models`` entry's fields over
the server's): what loads the model (``LoadSettings``, with the room its caches need,
``CacheRoom``), and how its requests run (``SourceSettings``). ``run_command.load``,
``memory_check`` and ``generation_source`` read these, never a command's options, so each knows
which fields it gets whatever the command.

Torch-free, as the options are: they are read before torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from llama_chat.ml.controls import DEFAULT_DRAFT_MAX, DEFAULT_LOOKUP, DEFAULT_MAX_BATCH, DEFAULT_PROMPT_CACHE_MIB

# How many requests a source runs at once (``SourceSettings.jobs``), which sizes its pages and pool.
ONE_STREAM = "one stream"  # a prompt or a chat: one request at a time
BATCH_JOBS = "batch"  # --batch: up to --max-batch jobs, the pool within fixed caps
SERVER_JOBS = "server"  # serve: up to --max-batch jobs, the pool within the memory free; lookup always ready


@dataclass(frozen=True)
class CacheRoom:
    """What the caches must have room for, checked once the model is loaded (``memory_check``)."""

    batch: bool = False  # --batch: its pool is checked, not -c's one context
    beams: int = 1  # --num-beams: a cache of their own beside the pages
    cache_tokens: int | None = None
    max_batch: int | None = None


@dataclass(frozen=True)
class LoadSettings:
    """What loads the model (``run_command.load``), as the command line names it."""

    model: str | None = None  # -m; None: the shipped model
    device: str = "auto"
    dtype: str = "auto"
    ctx_size: int | None = None
    quantize: str = "none"
    template: str = "auto"
    chat_template_file: str | None = None
    download: bool = False
    remote_model: str | None = None  # -m openai:URL's model and key
    api_key: str | None = None
    quiet: bool = False  # --json: nothing said on stderr while the CPU kernels build
    room: CacheRoom = CacheRoom()


@dataclass(frozen=True)
class SourceSettings:
    """How the source runs its requests (``generation_source.make_source``): what it decides
    from these, it decides there once."""

    load: LoadSettings
    jobs: str = ONE_STREAM  # ONE_STREAM, BATCH_JOBS or SERVER_JOBS
    max_batch: int = DEFAULT_MAX_BATCH
    cache_tokens: int | None = None  # --cache-tokens; None: sized by ``jobs``
    cache_type: str | None = "auto"  # None: the model's dtype (a library caller's default)
    compile: bool | None = None
    lookup: str = DEFAULT_LOOKUP
    draft: str | None = None
    draft_max: int = DEFAULT_DRAFT_MAX
    prompt_cache: str | None = None
    prompt_cache_size: int = DEFAULT_PROMPT_CACHE_MIB  # MiB


__all__ = ["BATCH_JOBS", "ONE_STREAM", "SERVER_JOBS", "CacheRoom", "LoadSettings", "SourceSettings"]

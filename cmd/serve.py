"""``llama-chat serve``: OpenAI's HTTP API on the batching scheduler.

::

    bind the socket (a port in use is an error at once)
    task group
    ├── watch_signals    first SIGINT/SIGTERM/SIGHUP: stop; a second one: leave at once
    ├── uvicorn          the routes of serve_app.py; /health says 503 until the model is in
    └── the model        loaded in a worker thread, then `async with scheduler:` until stopped
                         stopping: no new requests, running jobs get --shutdown-grace seconds,
                         what is left is cancelled, the connections close, exit status 0

Requests and the server's state are logged one line each on stderr (``--quiet``: errors only).
"""

from __future__ import annotations

import gc
import ipaddress
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from functools import partial
from pathlib import Path
from typing import Annotated, get_type_hints

import anyio
import typer
import uvicorn
from anyio.abc import TaskStatus
from rich.console import Console

from llama_chat.cmd import exit_status
from llama_chat.cmd.http_protocol import guarded_protocol
from llama_chat.cmd.models import (DEFAULT_KEEP_ALIVE, KEEP_ALIVE_HELP, MEMORY_HELP, ModelEntry, Models, Unload,
                                   check_names, default_memory_budget, directory_entries, keep_alive_seconds,
                                   memory_bytes, model_entries, split_alias)
from llama_chat.cmd.options import BATCH, Options, ranged
from llama_chat.cmd.ps_command import DEFAULT_HOST, DEFAULT_PORT
from llama_chat.cmd.responses_api import DEFAULT_STORED, DEFAULT_STORED_BYTES, ResponseStore
from llama_chat.cmd.sanitize import one_line
from llama_chat.cmd.source_settings import SERVER_JOBS, SourceSettings
from llama_chat.cmd.embeddings_api import embedding_routes
from llama_chat.cmd.fim_api import infill_routes
from llama_chat.cmd.models_api import model_routes, with_model
from llama_chat.cmd.ollama_api import ollama_routes
from llama_chat.cmd.serve_app import ServerState, build_app
from llama_chat.cmd.served import Served
from llama_chat.cmd.tokens_api import token_routes
from llama_chat.cmd.signals import hard_exit, install_sync_handlers
from llama_chat.cmd.startup import STOP_SIGNALS, Terminated
from llama_chat.cmd.typer_command import GroupedHelp, command, new_app
from llama_chat.inference.remote import is_remote
from llama_chat.inference.serving import Serving
from llama_chat.ml.controls import DEFAULT_DRAFT_MAX, DEFAULT_LOOKUP, DEFAULT_MAX_BATCH, DEFAULT_PROMPT_CACHE_MIB
from llama_chat.inference.tool_formats import FORMAT_NAMES, resolve_format
from llama_chat.inference.types import sole_exception

# The options of the model and its batching, defined once in options.py.
_OPTION = get_type_hints(Options, include_extras=True)
DEFAULT_QUEUE_LIMIT = 64
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_SHUTDOWN_GRACE_S = 5.0
DEFAULT_READ_TIMEOUT_S = 30.0
# uvicorn's own wait for the connections, beyond the grace the jobs get: room for the cancelled
# ones to send their last chunk.
CONNECTIONS_MARGIN_S = 5.0
LISTEN_BACKLOG = 2048
RESTART_PAUSE_S = 0.5  # after the scheduler failed: not a busy loop if it fails again at once
SERVER = "Server"


def _pooling(value: str | None) -> str | None:
    from llama_chat.ml.controls import POOLING_MODES  # torch-free: options are read before torch is imported

    if value is not None and value not in POOLING_MODES:
        raise typer.BadParameter(f"expected one of {', '.join(POOLING_MODES)}; got {value!r}")
    return value


def _keep_alive(value: str) -> str:
    try:
        keep_alive_seconds(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    return value


def _memory(value: str | None) -> str | None:
    if value is not None:
        try:
            memory_bytes(value)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    return value


def _tool_format(value: str) -> str:
    if value not in FORMAT_NAMES:
        raise typer.BadParameter(f"expected one of {', '.join(FORMAT_NAMES)}; got {value!r}")
    return value


@dataclass(frozen=True)
class ServeOptions:
    model: Annotated[list[str] | None, typer.Option(
        "--model", "-m", metavar="[NAME=]MODEL",
        help="Model, named as llama-chat's -m names it (--list shows what is there); NAME=MODEL: the name "
             "requests use. Repeat it to serve several, each loaded when a request names it (default: the "
             "small model shipped with the package); NAME=openai:URL[#MODEL] beside them: another server's "
             "model, its requests sent on.")] = None
    host: Annotated[str, typer.Option(
        "--host", rich_help_panel=SERVER, metavar="ADDR",
        help="Address to listen on; 0.0.0.0 (or ::) listens on every interface.")] = DEFAULT_HOST
    port: Annotated[int, typer.Option(
        "--port", min=0, max=65535, rich_help_panel=SERVER,
        help="Port to listen on; 0: any free port (the log says which).")] = DEFAULT_PORT
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="LLAMA_CHAT_API_KEY", show_envvar=True, rich_help_panel=SERVER, metavar="KEY",
        help="Require 'Authorization: Bearer KEY' on every route but /health.")] = None
    cors_origin: Annotated[list[str] | None, typer.Option(
        "--cors-origin", rich_help_panel=SERVER, metavar="ORIGIN",
        help="Let web pages from ORIGIN call the server (repeatable; '*': any). Off by default.")] = None
    queue_limit: Annotated[int, typer.Option(
        "--queue-limit", min=0, rich_help_panel=SERVER,
        help="Jobs that may wait beyond the --max-batch running ones (a request asks one per choice); "
             "past it, 429 with Retry-After.")] = DEFAULT_QUEUE_LIMIT
    models_dir: Annotated[Path | None, typer.Option(
        "--models-dir", rich_help_panel=SERVER, metavar="DIR",
        help="Serve every model in DIR (a GGUF or llama2.c file by its stem, a model folder by its name), "
             "beside the -m ones, each loaded when a request names it.")] = None
    models_file: Annotated[Path | None, typer.Option(
        "--models", rich_help_panel=SERVER, metavar="FILE",
        help="Serve the models a TOML file lists ([[model]] tables: path, alias, context, cache_type, draft, "
             "template, keep_alive, pinned; docs/serve.md), beside the -m ones.")] = None
    models_memory: Annotated[str | None, typer.Option(
        "--models-memory", callback=_memory, rich_help_panel=SERVER, metavar="SIZE",
        help=f"With several models: the most memory their weights and KV pages take together ({MEMORY_HELP}); a "
             "load past it first unloads the least recently used idle one (default: the memory free at "
             "start, less a tenth).")] = None
    models_max: Annotated[int | None, typer.Option(
        "--models-max", min=1, rich_help_panel=SERVER, metavar="N",
        help="With several -m: most models loaded at once; a load past it first unloads the least recently "
             "used idle one (default: all of them).")] = None
    keep_alive: Annotated[str, typer.Option(
        "--keep-alive", callback=_keep_alive, rich_help_panel=SERVER, metavar="DURATION",
        help=f"With several -m: how long an idle model stays loaded, as Ollama's keep_alive ({KEEP_ALIVE_HELP}); "
             "a request's keep_alive (Ollama's API) overrides it.")] = DEFAULT_KEEP_ALIVE
    max_body_bytes: Annotated[int, typer.Option(
        "--max-body-bytes", min=1, rich_help_panel=SERVER, metavar="BYTES",
        help="Largest request body; past it, 413.")] = DEFAULT_MAX_BODY_BYTES
    read_timeout: Annotated[float, typer.Option(
        "--read-timeout", min=0.001, rich_help_panel=SERVER, metavar="SECONDS",
        help="How long a request's headers, and then its body, may take to arrive; past it, 408.")
    ] = DEFAULT_READ_TIMEOUT_S
    shutdown_grace: Annotated[float, typer.Option(
        "--shutdown-grace", min=0.0, rich_help_panel=SERVER, metavar="SECONDS",
        help="On SIGTERM or Ctrl+C: how long running jobs may go on before they are cancelled.")
    ] = DEFAULT_SHUTDOWN_GRACE_S
    store_responses: Annotated[int, typer.Option(
        "--store-responses", min=0, rich_help_panel=SERVER, metavar="N",
        help="Responses API: how many responses are kept in memory for previous_response_id and "
             "GET /v1/responses/ID, the least recently used out first (0: none).")] = DEFAULT_STORED
    store_responses_bytes: Annotated[int, typer.Option(
        "--store-responses-bytes", min=0, rich_help_panel=SERVER, metavar="BYTES",
        help="Responses API: the most bytes of text the kept responses hold together.")] = DEFAULT_STORED_BYTES
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", rich_help_panel=SERVER, help="Log errors only, not every request.")] = False
    max_batch: _OPTION["max_batch"] = DEFAULT_MAX_BATCH
    cache_tokens: Annotated[int | None, ranged(
        "cache_tokens", "--cache-tokens", rich_help_panel=BATCH,
        help="Size of the paged KV cache in tokens (default: --max-batch contexts, within half the memory "
             "free once the model is loaded; at least one context). Pages take memory only where written.")] = None
    ctx_size: _OPTION["ctx_size"] = None
    device: _OPTION["device"] = "auto"
    dtype: _OPTION["dtype"] = "auto"
    compile: _OPTION["compile"] = None
    quantize: _OPTION["quantize"] = "none"
    cache_type: _OPTION["cache_type"] = "auto"
    lookup: _OPTION["lookup"] = DEFAULT_LOOKUP
    draft: _OPTION["draft"] = None
    draft_max: _OPTION["draft_max"] = DEFAULT_DRAFT_MAX
    prompt_cache: _OPTION["prompt_cache"] = None
    prompt_cache_size: _OPTION["prompt_cache_size"] = DEFAULT_PROMPT_CACHE_MIB
    template: _OPTION["template"] = "auto"
    chat_template_file: _OPTION["chat_template_file"] = None
    think: _OPTION["think"] = "auto"
    reasoning_budget: _OPTION["reasoning_budget"] = None
    reasoning_format: _OPTION["reasoning_format"] = "deepseek"
    tool_format: Annotated[str, typer.Option(
        "--tool-format", callback=_tool_format, rich_help_panel=SERVER, metavar="FORMAT",
        help="How the model writes tool calls: auto (told from its chat template), hermes (<tool_call>), "
             "llama3_json, mistral ([TOOL_CALLS]), generic (JSON described in the system message).")] = "auto"
    pooling: Annotated[str | None, typer.Option(
        "--pooling", callback=_pooling, rich_help_panel=SERVER, metavar="MODE",
        help="An embedding model's pooling: mean, cls, last or none (default: as its files say).")] = None
    debug: _OPTION["debug"] = False

    def options(self) -> Options:
        """The command's ``Options``: what loads the model, and the base of every request. (Its
        ``api_key`` is the key of a remote model's server, not this server's.)"""
        values = {f.name: getattr(self, f.name) for f in fields(self)
                  if f.name in Options.__dataclass_fields__ and f.name not in ("api_key", "model")}
        return Options(**values, model=split_alias(self.model[0])[1] if self.model else None)

    def source_settings(self) -> SourceSettings:
        """What makes the scheduler (``generation_source.make_source``): the command's options as
        every command's, for a server's many jobs (its pool sized to the memory free)."""
        return replace(self.options().source_settings(), jobs=SERVER_JOBS)

    def for_model(self, entry: ModelEntry) -> ServeOptions:
        """These options for one of several models: its source loads as ``-m`` names it, with what
        its ``--models`` file sets over the server's options."""
        s = entry.settings
        return replace(self, model=[entry.source], ctx_size=s.context if s.context is not None else self.ctx_size,
                       cache_type=s.cache_type or self.cache_type, draft=s.draft or self.draft,
                       template=s.template or self.template)

    def names(self) -> tuple[str, ...]:
        """What the one model answers to besides its own name: ``-m`` as given."""
        return (split_alias(self.model[0])[1],) if self.model else ()

    def named(self, loaded):
        """The one model as reported: under its NAME= where ``-m NAME=MODEL`` gave one."""
        alias = split_alias(self.model[0])[0] if self.model else None
        return loaded if alias is None else replace(loaded, name=alias)


serve_app = new_app()
serve_app.command(
    name="serve", cls=GroupedHelp,
    help="Serve a model over OpenAI's HTTP API (/v1/chat/completions, /v1/completions, /v1/models) and "
         "Anthropic's Messages API (/v1/messages), many requests at once on the batching scheduler; an "
         "embedding model over /v1/embeddings and Ollama's /api/embed; "
         "/health and /metrics (Prometheus) beside them.")(
        command(ServeOptions, lambda opts: run_serve(opts)))


# -- the log ---------------------------------------------------------------------------------------


class ServerLog:
    """One line per event on stderr, with the time; ``quiet`` keeps the errors only."""

    def __init__(self, *, quiet: bool) -> None:
        self.quiet = quiet

    def note(self, message: str) -> None:
        if not self.quiet:
            self._write(message)

    def error(self, message: str) -> None:
        self._write(f"error: {message}")

    @staticmethod
    def _write(message: str) -> None:
        try:
            sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} llama-chat serve: {one_line(message)}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass  # stderr went away; serving goes on


class _UvicornLog(logging.Handler):
    """uvicorn's warnings and errors as our lines (one line each, never a traceback)."""

    def __init__(self, log: ServerLog) -> None:
        super().__init__(logging.WARNING)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        (self.log.error if record.levelno >= logging.ERROR else self.log.note)(f"http: {record.getMessage()}")


# -- running ---------------------------------------------------------------------------------------


def run_serve(opts: ServeOptions) -> int:
    log = ServerLog(quiet=opts.quiet)
    several = (opts.model and len(opts.model) > 1) or opts.models_dir is not None or opts.models_file is not None
    if not several and opts.model and is_remote(split_alias(opts.model[0])[1]):
        log.error("serve runs a model in this process; -m openai:URL is another server's (beside a model of "
                  "this one's, with -m NAME=openai:URL, its requests are sent on)")
        return exit_status.USAGE
    if opts.api_key is not None and not opts.api_key.strip():
        log.error("--api-key is empty")
        return exit_status.USAGE
    entries: list[ModelEntry] = []
    if several:
        from llama_chat.cmd.models_file import read_models_file
        from llama_chat.model.errors import ModelLoadError

        try:
            entries = model_entries(opts.model or ())
            entries += read_models_file(opts.models_file) if opts.models_file is not None else []
            entries += directory_entries(opts.models_dir) if opts.models_dir is not None else []
            check_names(entries)
        except (ModelLoadError, ValueError) as e:
            log.error(one_line(str(e)))
            return exit_status.USAGE
        if not entries:
            log.error(f"--models-dir {opts.models_dir}: no model in it (GGUF or llama2.c files, model folders)")
            return exit_status.USAGE
    try:
        sock = listen(opts.host, opts.port)
    except OSError as e:
        log.error(f"cannot listen on {opts.host}:{opts.port}: {e.strerror or e}")
        return exit_status.FAILURE
    what = (f"serving {', '.join(repr(e.name) for e in entries)}, each loaded when a request names it" if entries
            else f"loading {opts.model[0] if opts.model else 'the shipped model'}")
    log.note(f"listening on {_url(sock)}; {what}")
    if opts.api_key is None and not _loopback(sock.getsockname()[0]):
        log.note("no --api-key: anyone who can reach this address can use the server")
    try:
        return anyio.run(_serve, opts, sock, log, entries)
    except KeyboardInterrupt:
        return exit_status.OK
    except Terminated:
        return exit_status.OK
    finally:
        install_sync_handlers()  # the event loop's signal receiver left SIGTERM at its default


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (bound now, so a taken port is an error at once)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return socket.create_server(address, family=family, backlog=LISTEN_BACKLOG)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.partition("%")[0]).is_loopback
    except ValueError:
        return False


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers (``_watch_signals`` has them)."""

    def capture_signals(self):
        return nullcontext()


async def _serve(opts: ServeOptions, sock: socket.socket, log: ServerLog, entries: list[ModelEntry]) -> int:
    state = ServerState(api_key=opts.api_key, max_body_bytes=opts.max_body_bytes, log=log.note,
                        read_timeout_s=opts.read_timeout,
                        responses=ResponseStore(opts.store_responses, opts.store_responses_bytes))
    app = build_app(state, cors_origins=tuple(opts.cors_origin or ()), pick=with_model,
                    routes=(embedding_routes, ollama_routes, token_routes, infill_routes, model_routes))
    config = uvicorn.Config(app, http=guarded_protocol(opts.read_timeout), lifespan="off", log_config=None,
                            access_log=False, server_header=False, ws="none",
                            timeout_graceful_shutdown=int(opts.shutdown_grace + CONNECTIONS_MARGIN_S))
    uvicorn_log = logging.getLogger("uvicorn")
    uvicorn_log.handlers[:] = [_UvicornLog(log)]
    uvicorn_log.propagate = False
    server = _Server(config)
    stop, server_done = anyio.Event(), anyio.Event()

    async def run_server() -> None:
        try:
            await server.serve(sockets=[sock])
        finally:
            server_done.set()
            stop.set()

    status = exit_status.OK
    async with anyio.create_task_group() as tg:
        await tg.start(_watch_signals, stop, log)
        tg.start_soon(run_server)
        try:
            if entries:
                await _serve_models(opts, state, entries, log, stop, server)
            elif (model := await _load(opts, log, stop)) is not None:
                status = await _serve_model(opts, state, model, log, stop, server, server_done)
        except Exception as e:  # noqa: BLE001 - loading failed: one line, and the server stops
            from llama_chat.inference.types import RequestError
            from llama_chat.model.errors import ModelLoadError

            log.error(one_line(str(e)) if isinstance(e, (ModelLoadError, RequestError))
                      else f"{type(e).__name__}: {one_line(str(e))}")
            status = exit_status.USAGE if isinstance(e, (ModelLoadError, RequestError)) else exit_status.FAILURE
        state.phase = "stopping"
        server.should_exit = True
        await server_done.wait()
        tg.cancel_scope.cancel()
    log.note("stopped")
    return status


async def _watch_signals(stop: anyio.Event, log: ServerLog, *, task_status: TaskStatus[None]) -> None:
    with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
        task_status.started()
        async for signum in signals:
            if stop.is_set():
                hard_exit(signum, message=b"llama-chat serve: second signal, exiting now\n")
            log.note(f"{signal.Signals(signum).name}: stopping (a second one exits at once)")
            stop.set()


async def _load(opts: ServeOptions, log: ServerLog, stop: anyio.Event):
    """``(loaded, scheduler)`` from a worker thread, or None when stopped first."""
    result: list = []

    async def load() -> None:
        result.append(await anyio.to_thread.run_sync(_load_model, opts, abandon_on_cancel=True))

    try:
        async with anyio.create_task_group() as tg:
            async def cancel_on_stop() -> None:
                await stop.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(cancel_on_stop)
            await load()
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise sole_exception(group) from None
    return result[0] if result else None


def _load_model(opts: ServeOptions):
    """``(loaded, scheduler)``, in a worker thread: the model loaded as every command loads it,
    its scheduler made by ``generation_source`` as every command's is, then warmed up. An
    embedding model or a reranker: no cache, no scheduler (None)."""
    from llama_chat.cmd.generation_source import make_source
    from llama_chat.cmd.run_command import load, warm_up

    settings = opts.source_settings()
    err = Console(stderr=True, highlight=False, quiet=opts.quiet)
    loaded = load(settings.load, err)
    if loaded.kind != "chat":
        return loaded, None
    scheduler = make_source(loaded, settings)
    warm_up(scheduler, opts.options().sampling(), err, quiet=opts.quiet)
    return loaded, scheduler


async def _serve_model(opts: ServeOptions, state: ServerState, model, log: ServerLog, stop: anyio.Event, server,
                       server_done: anyio.Event) -> int:
    loaded, scheduler = model
    loaded = opts.named(loaded)
    if scheduler is None:
        return await _serve_embeddings(opts, state, loaded, log, stop, server, server_done)
    # Everything made so far lives as long as the server: the collector's full passes, which hold
    # the GIL the step thread needs between two forwards, need not walk it again. (Several models
    # are loaded and dropped: their objects are left to the collector.)
    gc.collect()
    gc.freeze()
    served = _chat_served(opts, state, loaded, scheduler)
    serving = served.serving
    while True:
        try:
            async with scheduler:
                first = state.phase == "loading"
                state.ready(served)
                if first:
                    log.note(_ready_text(opts, served))
                await stop.wait()
                state.phase = "stopping"
                server.should_exit = True  # no new connections; uvicorn waits for the open ones
                if serving.open_jobs:
                    log.note(f"jobs open: {serving.open_jobs}; up to {opts.shutdown_grace:g} s to finish")
                cancelled = await serving.drain(opts.shutdown_grace)
                if cancelled:
                    log.note(f"jobs cancelled: {cancelled}")
                await server_done.wait()
            return exit_status.OK
        except Exception as e:  # noqa: BLE001 - a forward or the sampler raised: its jobs ended with an error
            state.phase = "restarting"
            log.error(f"the scheduler failed ({type(e).__name__}: {one_line(str(e))}); its jobs ended, "
                      "starting it again")
            if opts.debug:
                import traceback

                traceback.print_exc()
            if stop.is_set():
                return exit_status.FAILURE
            await anyio.sleep(RESTART_PAUSE_S)


async def _serve_embeddings(opts: ServeOptions, state: ServerState, loaded, log: ServerLog, stop: anyio.Event,
                            server, server_done: anyio.Event) -> int:
    """An embedding model's or a reranker's server: its routes answer in worker threads until stopped."""
    served, what = _encoder_served(opts, loaded)
    state.ready(served)
    log.note(f"ready: {what}")
    await stop.wait()
    state.phase = "stopping"
    server.should_exit = True
    await server_done.wait()
    return exit_status.OK


def _chat_served(opts: ServeOptions, state: ServerState, loaded, scheduler) -> Served:
    serving = Serving(scheduler, queue_limit=opts.queue_limit, metrics=state.metrics)
    names = frozenset({loaded.name, *opts.names()})
    # A chat format without a Jinja template (llama2, llama3) cannot show tools: the generic format
    # describes them in the system message.
    template = getattr(loaded.chat_format, "template", None)
    tool_format = resolve_format(opts.tool_format if template is not None else "generic", template)
    return Served(loaded, serving, opts.options(), names, int(time.time()), tool_format)


def _ready_text(opts: ServeOptions, served: Served) -> str:
    loaded, scheduler = served.loaded, served.serving.scheduler
    return (f"ready: model {loaded.name!r} ({loaded.device.type}, {str(loaded.dtype).removeprefix('torch.')}), "
            f"context {scheduler.max_seq_len} tokens, batch of {opts.max_batch}, queue of {opts.queue_limit}, "
            f"tool calls {served.tool_format.name}; {_pool_text(scheduler)}")


def _encoder_served(opts: ServeOptions, loaded, *, beside_chat: bool = False) -> tuple[Served, str]:
    """An embedding model or a reranker as served, and what the ready line says of it;
    ``beside_chat``: one of several models, whose embedding rounds yield to a chat model's decode."""
    from llama_chat.inference.embedding import Embedder, Reranker

    where = f"({loaded.device.type}, {str(loaded.dtype).removeprefix('torch.')})"
    if loaded.kind == "rerank":
        encoder = Reranker(loaded)
        what = f"reranker {loaded.name!r} {where}, {'sigmoid' if encoder.ranking.sigmoid else 'raw'} scores"
    else:
        encoder = Embedder(loaded, pooling=opts.pooling, beside_chat=beside_chat)
        pooling = encoder.pooling
        what = (f"embedding model {loaded.name!r} {where}, {encoder.width} dimensions, {pooling.mode} pooling"
                f"{', normalized' if pooling.normalize else ''}")
    names = frozenset({loaded.name, *opts.names()})
    served = Served(loaded, None, opts.options(), names, int(time.time()), embedder=encoder)
    return served, f"{what}, up to {encoder.max_tokens} tokens an input"


# -- several models ------------------------------------------------------------------------------


async def _serve_models(opts: ServeOptions, state: ServerState, entries: list[ModelEntry], log: ServerLog,
                        stop: anyio.Event, server) -> None:
    """Several models, each loaded when a request names it (``cmd/models.py``), until stopped."""
    budget = memory_bytes(opts.models_memory) if opts.models_memory is not None else default_memory_budget()
    models = Models(entries, hold=partial(_hold, opts, state, log), max_loaded=opts.models_max,
                    keep_alive_s=keep_alive_seconds(opts.keep_alive), queue_limit=opts.queue_limit,
                    log=log.note, log_error=log.error, memory_budget=budget)

    async def close_on_stop() -> None:
        await stop.wait()
        state.phase = "stopping"
        server.should_exit = True  # no new connections; uvicorn waits for the open ones

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(close_on_stop)
            await tg.start(models.run, stop, opts.shutdown_grace)
            state.serve_models(models)
            log.note(f"ready: {len(entries)} models, at most {models.max_loaded} loaded at once"
                     f"{_budget_text(budget)}, idle ones unloaded after --keep-alive {opts.keep_alive}")
    finally:
        if models.remote_client is not None:
            with anyio.CancelScope(shield=True):
                await models.remote_client.aclose()


def _budget_text(budget: int | None) -> str:
    from llama_chat.model.memory_budget import gigabytes  # torch-free

    return "" if budget is None else f" within {gigabytes(budget)} of memory"


async def _hold(opts: ServeOptions, state: ServerState, log: ServerLog, entry: ModelEntry,
                ready: Callable[[Served], None], unload: Unload) -> None:
    """One of several models: loaded in a worker thread as the one model is, served until
    ``unload`` says, its open jobs then given ``unload.grace_s``. What it held goes with this frame."""
    from llama_chat.inference.embedding import Embedder

    model_opts = opts.for_model(entry)
    loaded, scheduler = await anyio.to_thread.run_sync(_load_model, model_opts, abandon_on_cancel=True)
    loaded = replace(loaded, name=entry.name)  # reported under the name requests use
    if scheduler is None:
        served, what = _encoder_served(model_opts, loaded, beside_chat=True)
        ready(served)
        log.note(f"ready: {what}")
        await unload.event.wait()
        if isinstance(served.embedder, Embedder):  # its rounds' thread holds the model
            await anyio.to_thread.run_sync(served.embedder.close)
        return
    served = _chat_served(model_opts, state, loaded, scheduler)
    async with scheduler:
        ready(served)
        log.note(_ready_text(model_opts, served))
        await unload.event.wait()
        cancelled = await served.serving.drain(unload.grace_s)
        if cancelled:
            log.note(f"model {entry.name!r}: jobs cancelled: {cancelled}")


def _pool_text(scheduler) -> str:
    """The KV pool as the ready line says it: its tokens, their type and the most it may take."""
    from llama_chat.model.memory_budget import gigabytes

    stats, cache = scheduler.stats, scheduler.core.cache
    return (f"KV cache of {stats.pages_total * stats.page_size} tokens, {cache.type_name}, "
            f"up to {gigabytes(stats.kv_reserved_bytes)} (resident where written)")


__all__ = ["ServeOptions", "listen", "run_serve", "serve_app"]


"""Several models behind one ``llama-chat serve``: their names, loading on demand, keep-alive, and
the least recently used idle model unloaded when ``--models-max`` or the memory budget
(``--models-memory``) would be passed. A remote entry (``NAME=openai:URL``) is another server's
model: it takes no slot and no memory here, and its requests are sent on (``models_remote.py``).

::

    Models                the registry: one ``Model`` per -m, in the order given (the first answers
    │                     a request that names none)
    ├── acquire(name)     the model, loaded first where it is not: a slot is freed by unloading the
    │                     least recently used idle model, else the request waits for one
    ├── release(model)    the request is done: the model's keep-alive starts (a pinned one stays)
    ├── a holder task     per loaded model: serve.py's ``_hold`` loads it in a worker thread and
    │                     serves it until it is asked to unload; then the memory goes back
    └── the reaper        unloads the idle models whose keep-alive ran out

Every change of a model's state happens on the event loop between two awaits, so a model that
is loading or loaded is never started again: one model is never loaded twice at once.
"""

from __future__ import annotations

import gc
import math
import re
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from llama_chat.cmd.openai_api import ApiError
from llama_chat.cmd.sanitize import one_line
from llama_chat.inference.remote import RemoteSpec, is_remote
from llama_chat.inference.serving import Snapshot

if TYPE_CHECKING:
    from llama_chat.cmd.served import Served

DEFAULT_KEEP_ALIVE = "5m"  # Ollama's
# How long a request waits for a model slot (every one busy under --models-max) before a 503.
SLOT_WAIT_S = 60.0
SLOT_RETRY_AFTER_S = 5
STATUSES = ("unloaded", "loading", "loaded", "unloading", "remote")
# The memory budget by default: what the machine has free at start, less this share of it (the
# server's own growth, the page cache the model files need while they load).
MEMORY_MARGIN = 0.1
_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([kmgt]?)(i?b)?", re.IGNORECASE)
_SIZE_UNIT = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
MEMORY_HELP = 'bytes, or with a unit: "512M", "16G", "1.5GiB"'
# A model loading takes up to twice its files: the file's pages mapped and read, and the tensors
# they are copied into (both resident until the load ends and the map closes).
LOADING_FACTOR = 2
# A name given with NAME=MODEL: what a client may send as ``model`` (Ollama's name:tag included).
_ALIAS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
# Go's durations, as Ollama reads keep_alive: "5m", "1h30m", "30s", "250ms".
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
KEEP_ALIVE_HELP = 'a duration such as "5m", "30s" or "1h", or a number of seconds; 0: unload when done, -1: keep'


# -- what is served -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSettings:
    """What a ``--models`` file sets for one model over the server's options (None: the server's)."""

    context: int | None = None  # -c
    cache_type: str | None = None
    draft: str | None = None
    template: str | None = None
    keep_alive_s: float | None = None  # --keep-alive, in seconds
    pinned: bool = False  # loaded at start and never unloaded for room or idleness
    api_key: str | None = None  # a remote entry's server's key


@dataclass(frozen=True)
class ModelEntry:
    """One ``-m``: the name requests use (and /v1/models lists), and what loads it."""

    name: str
    source: str
    # Where the model's files are (``--list``'s names resolved); a remote entry's is its URL,
    # where nothing is on disk (Ollama's /api/tags then sizes it 0).
    path: Path
    settings: ModelSettings = ModelSettings()
    size: int = 0  # bytes of its files: its share of the memory budget before it is loaded

    @property
    def remote(self) -> bool:
        return is_remote(self.source)


def files_size(path: Path) -> int:
    """Bytes of a model's files (a file, or every file in its folder; links followed)."""
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
    except OSError:
        return 0


def split_alias(value: str) -> tuple[str | None, str]:
    """``NAME=MODEL`` as ``(NAME, MODEL)``; a model without a name given (or a path that holds
    "="): ``(None, value)``."""
    name, sep, source = value.partition("=")
    if sep and _ALIAS.fullmatch(name) and source and not Path(value).expanduser().exists():
        return name, source
    return None, value


def model_entries(values: Sequence[str]) -> list[ModelEntry]:
    """The ``-m`` values as entries: ``NAME=MODEL`` or a model named as ``--list`` shows it, whose
    name is then the one it loads under (a folder's or file's). ``ModelLoadError`` for a model
    that is not there."""
    return [model_entry(*split_alias(value)) for value in values]


def model_entry(alias: str | None, source: str, settings: ModelSettings = ModelSettings()) -> ModelEntry:
    """One model to serve: ``source`` as ``-m`` names it, or ``openai:URL[#NAME]``, whose name is
    ``alias``, else the remote's ``#NAME``. ``ModelLoadError`` for a model that is not there or a
    URL that is no URL (a server that does not answer is found out by its requests)."""
    from llama_chat.model.errors import ModelLoadError
    from llama_chat.model.stores import resolve_model  # the stores, not torch

    if is_remote(source):
        try:
            spec = RemoteSpec.parse(source)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        name = alias or spec.model
        if name is None:
            raise ModelLoadError(f"{source}: name the remote model, NAME={source}")
        return ModelEntry(name, source, Path(source), settings)
    found = resolve_model(source)  # a missing file is said at start, not at the first request
    return ModelEntry(alias or found.name, source, found.path, settings, files_size(found.path))


def directory_entries(folder: Path) -> list[ModelEntry]:
    """``--models-dir``: every model in ``folder``, a GGUF or llama2.c file named by its stem or a
    model folder by its name; other files are passed over. ``ModelLoadError`` where ``folder`` is
    not a directory."""
    from llama_chat.model.errors import ModelLoadError
    from llama_chat.model.loader import GGUF, LLAMA2C, detect_layout  # torch: only with --models-dir

    if not folder.is_dir():
        raise ModelLoadError(f"--models-dir {folder}: not a directory")
    entries = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue
        try:
            layout = detect_layout(path)
        except ModelLoadError:
            continue  # not a model: a README, a stray file
        if path.is_dir() or layout in (GGUF, LLAMA2C):
            entries.append(ModelEntry(path.stem if path.is_file() else path.name, str(path), path,
                                      size=files_size(path)))
    return entries


def check_names(entries: Sequence[ModelEntry]) -> None:
    """``ValueError`` for two models under one name."""
    seen: dict[str, str] = {}
    for entry in entries:
        if entry.name in seen:
            raise ValueError(f"two models are named {entry.name!r} ({seen[entry.name]} and {entry.source}): "
                             "name them with -m NAME=MODEL")
        seen[entry.name] = entry.source


def keep_alive_seconds(value: Any) -> float:
    """Ollama's ``keep_alive`` in seconds: a number of seconds or a Go duration ("5m", "1h30m");
    negative: for ever (``math.inf``). ``ValueError`` for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"keep_alive must be {KEEP_ALIVE_HELP}")
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            seconds = _duration(text)
    else:
        seconds = float(value)
    if math.isnan(seconds):
        raise ValueError(f"keep_alive must be {KEEP_ALIVE_HELP}")
    return math.inf if seconds < 0 else seconds


def _duration(text: str) -> float:
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
    total, at = 0.0, 0
    for part in _DURATION_PART.finditer(body):
        if part.start() != at:
            break
        total += float(part.group(1)) * _UNIT_S[part.group(2)]
        at = part.end()
    if not body or at != len(body):
        raise ValueError(f"keep_alive: {text!r:.60} is not {KEEP_ALIVE_HELP}")
    return sign * total


def memory_bytes(text: str) -> int:
    """A size as ``--models-memory`` takes it: bytes, or with a unit (K, M, G, T; powers of 1024;
    "B" and "iB" after it are allowed). ``ValueError`` for anything else."""
    found = _SIZE.fullmatch(text.strip())
    if found is None or (found.group(3) and not found.group(2) and found.group(3).lower() == "ib"):
        raise ValueError(f"{text!r:.60} is not a size: {MEMORY_HELP}")
    size = int(float(found.group(1)) * _SIZE_UNIT[found.group(2).lower()])
    if size <= 0:
        raise ValueError(f"{text!r:.60}: a size above 0 is needed")
    return size


def default_memory_budget() -> int | None:
    """What the machine has free now, less ``MEMORY_MARGIN``; None where that cannot be read."""
    from llama_chat.model.memory_budget import available_bytes  # torch-free

    free = available_bytes()
    return None if free is None else int(free * (1 - MEMORY_MARGIN))


def wall_time(seconds: float) -> str:
    """A time as Ollama writes it (``expires_at``); for ever: the last second of year 9999."""
    when = datetime.max.replace(tzinfo=timezone.utc) if math.isinf(seconds) else (
        datetime.fromtimestamp(seconds, timezone.utc))
    return when.isoformat(timespec="seconds").replace("+00:00", "Z")


# -- the registry -------------------------------------------------------------------------------


@dataclass
class Unload:
    """A loaded model's holder waits on ``event``; its open jobs then get ``grace_s`` seconds."""

    event: anyio.Event = field(default_factory=anyio.Event)
    grace_s: float = 0.0


@dataclass(eq=False)
class Model:
    """One served model's state. ``kind`` and ``context`` are known once it has been loaded."""

    entry: ModelEntry
    status: str = "unloaded"
    served: Served | None = None
    users: int = 0  # requests between acquire and release
    last_used: float = 0.0  # time.monotonic()
    expires: float = math.inf  # time.monotonic() at which it unloads while idle
    evict: bool = False  # /models/unload asked: out as soon as it is idle
    loads: int = 0  # how many loads were started; ``failed`` is the one that failed last
    failed: int = 0
    error: str = ""
    upstream: str | None = None  # a remote entry's name on its server, once asked (``models_remote``)
    kind: str | None = None
    context: int | None = None
    unload: Unload = field(default_factory=Unload)

    def __post_init__(self) -> None:
        if self.entry.remote:
            self.status = "remote"

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def pinned(self) -> bool:
        return self.entry.settings.pinned

    def idle(self) -> bool:
        """Loaded and nobody's: no request holds it, and its scheduler has no open job."""
        serving = self.served.serving if self.served is not None else None
        return self.status == "loaded" and self.users == 0 and (serving is None or serving.open_jobs == 0)

    def memory(self) -> int:
        """Its share of the memory budget: its files (twice while it loads), and its KV pages
        written once loaded."""
        if self.status == "loading":
            return LOADING_FACTOR * self.entry.size
        serving = self.served.serving if self.status == "loaded" and self.served is not None else None
        stats = serving.snapshot().stats if serving is not None else None
        return self.entry.size + (stats.kv_resident_bytes if stats is not None else 0)


# ``hold(entry, ready, unload)``: loads the model, calls ``ready`` with it once it serves, and
# returns once ``unload.event`` is set and its jobs are done (serve.py's ``_hold``).
Hold = Callable[[ModelEntry, Callable[["Served"], None], Unload], Awaitable[None]]


class Models:
    """The served models; ``run`` holds them, the routes ``acquire`` and ``release`` them."""

    def __init__(self, entries: Sequence[ModelEntry], *, hold: Hold, max_loaded: int | None, keep_alive_s: float,
                 queue_limit: int, log: Callable[[str], None], log_error: Callable[[str], None],
                 memory_budget: int | None = None) -> None:
        self.models = {entry.name: Model(entry) for entry in entries}
        self.default = entries[0].name
        self.hold = hold
        self.max_loaded = max_loaded or len(entries)
        self.memory_budget = memory_budget  # bytes the loaded models may take together; None: no bound
        self.remote_client: Any = None  # the HTTP client of the remote entries (``models_remote``)
        self.keep_alive_s = keep_alive_s
        self.queue_limit = queue_limit
        self.log, self.log_error = log, log_error
        self.created = int(time.time())
        self.stopping = False
        self._waiting = 0  # requests waiting for a slot
        self._changed = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None

    # -- the server's life --------------------------------------------------------------------------

    async def run(self, stop: anyio.Event, grace_s: float, *,
                  task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until ``stop``; then no new request, the open jobs get ``grace_s`` seconds, and
        every model is unloaded (one still loading is abandoned). Models load from ``started``."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._reap)
            for model in self.models.values():
                if model.pinned and not model.entry.remote and self._taken() < self.max_loaded and self._fits(model):
                    self._start(model)
            task_status.started()
            await stop.wait()
            self.stopping = True
            while True:  # a model whose load ends meanwhile is unloaded in turn
                for model in self.models.values():
                    self._unload(model, grace_s, "the server is stopping")
                if not any(m.status in ("loaded", "unloading") for m in self.models.values()):
                    break
                await self._changed.wait()
            tg.cancel_scope.cancel()

    def lookup(self, name: str | None) -> Model:
        """The model a request names (Ollama's ``:latest`` tag or not); None: the first one."""
        if name is None:
            return self.models[self.default]
        found = self.models.get(name) or self.models.get(name.removesuffix(":latest"))
        if found is None:
            listed = ", ".join(repr(n) for n in self.models)
            raise ApiError(404, f"the model {name!r:.200} does not exist; this server has {listed}", param="model",
                           code="model_not_found")
        return found

    async def acquire(self, name: str | None) -> Model:
        """The model ``name`` names, loaded and held for one request until ``release``. Raises
        ApiError: 404 (no such model), 500 (its load failed), 503 (every slot busy too long, or
        the server is stopping)."""
        model = self.lookup(name)
        deadline: float | None = None
        load = 0  # the load this request waits for
        try:
            while True:
                if self.stopping:
                    raise ApiError(503, "the server is shutting down", code="shutting_down")
                if model.status in ("loaded", "remote"):
                    model.users += 1
                    model.last_used = time.monotonic()
                    return model
                if model.status == "loading":
                    load = model.loads
                elif model.status == "unloaded":
                    if load and model.failed == load:
                        raise ApiError(500, f"the model {model.name!r} failed to load: {model.error}",
                                       code="model_load_failed")
                    if self.memory_budget is not None and LOADING_FACTOR * model.entry.size > self.memory_budget:
                        raise ApiError(507, f"the model {model.name!r} ({_gigabytes(model.entry.size)}, twice that "
                                            "while it loads) does not fit the memory budget "
                                            f"({_gigabytes(self.memory_budget)}, --models-memory)",
                                       code="model_too_large")
                    full = self._taken() >= self.max_loaded
                    if not full and self._fits(model):
                        self._start(model)
                        load = model.loads
                        continue
                    victim = self._least_recently_used_idle()
                    if victim is not None:
                        bound = (f"--models-max {self.max_loaded}" if full else
                                 f"the memory budget, {_gigabytes(self.memory_budget or 0)}")
                        self._unload(victim, 0.0, f"to make room for {model.name!r} ({bound})")
                    elif any(m.status == "unloading" for m in self.models.values()):
                        pass  # a slot is being freed: wait for it, outside the queue
                    elif deadline is None:
                        if self._waiting >= self.queue_limit:
                            raise self._busy()
                        deadline = time.monotonic() + SLOT_WAIT_S
                        self._waiting += 1
                    elif time.monotonic() >= deadline:
                        raise self._busy()
                changed = self._changed
                with anyio.move_on_after(None if deadline is None else deadline - time.monotonic()):
                    await changed.wait()
        finally:
            if deadline is not None:
                self._waiting -= 1

    def release(self, model: Model, keep_alive_s: float | None = None) -> None:
        """One request is done with ``model``: it stays loaded ``keep_alive_s`` seconds once idle
        (None: the server's --keep-alive; 0: unloaded at once; inf: kept)."""
        model.users = max(model.users - 1, 0)  # 0 already where its scheduler failed or the server stopped
        now = time.monotonic()
        model.last_used = now
        if keep_alive_s is None:
            keep_alive_s = self.keep_alive_of(model)
        model.expires = math.inf if model.pinned else now + keep_alive_s
        self._notify()

    def keep_alive_of(self, model: Model) -> float:
        """How long ``model`` stays loaded once idle: its own (``--models`` file), else --keep-alive."""
        own = model.entry.settings.keep_alive_s
        return self.keep_alive_s if own is None else own

    async def load(self, name: str | None) -> Model:
        """/models/load: the model loaded (or already), its keep-alive started."""
        model = await self.acquire(name)
        self.release(model)
        return model

    def evict(self, name: str | None) -> Model:
        """The model out as soon as it is idle (its open requests run to their end first)."""
        model = self.lookup(name)
        if model.entry.remote:
            raise ApiError(400, f"the model {model.name!r} is another server's ({model.entry.source}): it is not "
                                "loaded or unloaded here", param="model", code="remote_model")
        model.evict = model.status != "unloaded"
        self._notify()
        return model

    async def unload(self, name: str | None) -> bool:
        """/models/unload: ``evict``, and whether the model is out within ``SLOT_WAIT_S``."""
        model = self.evict(name)
        with anyio.move_on_after(SLOT_WAIT_S):
            while model.status != "unloaded":
                await self._changed.wait()
        return model.status == "unloaded"

    # -- what the routes show -----------------------------------------------------------------------

    def listing(self) -> list[dict[str, Any]]:
        """/v1/models' objects: every model, with its status, and its kind and context once known."""
        out = []
        for model in self.models.values():
            item: dict[str, Any] = {"id": model.name, "object": "model", "created": self.created,
                                    "owned_by": "llama-chat", "status": model.status}
            if model.entry.remote:
                item["url"] = model.entry.source.removeprefix("openai:").partition("#")[0]
            if model.pinned:
                item["pinned"] = True
            if model.context is not None:
                item["context_length"] = model.context
            if model.kind is not None:
                item["kind"] = model.kind
            out.append(item)
        return out

    def loaded(self) -> list[tuple[Model, float]]:
        """The loaded models with the wall time at which each unloads if left idle (inf: never)."""
        out = []
        now, wall = time.monotonic(), time.time()
        for model in self.models.values():
            if model.status == "loaded" and model.served is not None:
                left = model.expires - now if model.users == 0 else self.keep_alive_of(model)
                out.append((model, wall + max(left, 0.0)))
        return out

    def snapshot(self) -> Snapshot:
        """The jobs of every loaded model together (the KV pool's figures are each model's own)."""
        running = queued = 0
        for model in self.models.values():
            serving = model.served.serving if model.served is not None else None
            if model.status == "loaded" and serving is not None:
                now = serving.snapshot()
                running, queued = running + now.running, queued + now.queued
        return Snapshot(not self.stopping, running, queued)

    def metric_lines(self) -> str:
        """/metrics' lines of each model, labelled with its name: loaded or not, its jobs running
        and queued, and its KV pages' resident bytes (the server's own lines count them together)."""
        gauges = {"llama_chat_model_loaded": "1 while the model is loaded.",
                  "llama_chat_model_jobs_running": "The model's jobs generating now.",
                  "llama_chat_model_jobs_queued": "The model's jobs waiting for a batch slot or for cache pages.",
                  "llama_chat_model_kv_resident_bytes":
                      "Bytes of the model's KV cache pages written and not given back to the system."}
        values: dict[str, list[str]] = {name: [] for name in gauges}
        for model in self.models.values():
            serving = model.served.serving if model.status == "loaded" and model.served is not None else None
            now = serving.snapshot() if serving is not None else Snapshot(False)
            resident = now.stats.kv_resident_bytes if now.stats is not None else 0
            # Prometheus' label values escape backslashes, quotes and line breaks.
            label = '{model="%s"}' % model.name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
            for name, value in (("llama_chat_model_loaded", int(model.status == "loaded")),
                                ("llama_chat_model_jobs_running", now.running),
                                ("llama_chat_model_jobs_queued", now.queued),
                                ("llama_chat_model_kv_resident_bytes", resident)):
                values[name].append(f"{name}{label} {value}")
        lines = []
        for name, help in gauges.items():
            lines += [f"# HELP {name} {help}", f"# TYPE {name} gauge", *values[name]]
        return "\n".join(lines) + "\n"

    # -- loading and unloading ----------------------------------------------------------------------

    def _taken(self) -> int:
        return sum(m.status in ("loading", "loaded", "unloading") for m in self.models.values())

    def memory_used(self) -> int:
        """The budget's bytes the models loading, loaded or unloading take now."""
        return sum(m.memory() for m in self.models.values() if m.status in ("loading", "loaded", "unloading"))

    def _fits(self, model: Model) -> bool:
        need = LOADING_FACTOR * model.entry.size
        return self.memory_budget is None or self.memory_used() + need <= self.memory_budget

    def _least_recently_used_idle(self) -> Model | None:
        idle = [m for m in self.models.values() if m.idle() and not m.pinned]
        return min(idle, key=lambda m: m.last_used) if idle else None

    def _busy(self) -> ApiError:
        budget = "" if self.memory_budget is None else f", --models-memory {_gigabytes(self.memory_budget)}"
        return ApiError(503, f"every loaded model is busy, and no other fits beside them (--models-max "
                             f"{self.max_loaded}{budget}); try again shortly",
                        code="models_busy", headers={"Retry-After": str(SLOT_RETRY_AFTER_S)})

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _start(self, model: Model) -> None:
        assert self._tg is not None, "Models.run holds the models"
        model.status, model.evict, model.unload = "loading", False, Unload()
        model.loads += 1
        self._tg.start_soon(self._hold_one, model)
        self._notify()

    def _unload(self, model: Model, grace_s: float, why: str) -> None:
        if model.status != "loaded":
            return
        model.status = "unloading"
        model.unload.grace_s = grace_s
        model.unload.event.set()
        self.log(f"unloading model {model.name!r}: {why}")
        self._notify()

    async def _hold_one(self, model: Model) -> None:
        self.log(f"loading model {model.name!r} ({model.entry.source})")
        try:
            await self.hold(model.entry, lambda served: self._ready(model, served), model.unload)
        except Exception as e:  # noqa: BLE001 - this model's failure: its waiting requests are told, the rest go on
            from llama_chat.inference.types import RequestError
            from llama_chat.model.errors import ModelLoadError

            model.error = one_line(str(e)) if isinstance(e, (ModelLoadError, RequestError)) else (
                f"{type(e).__name__}: {one_line(str(e))}")
            if model.status == "loading":
                model.failed = model.loads
            self.log_error(f"model {model.name!r}: {model.error}")
        finally:
            was = model.status
            model.served, model.status, model.users = None, "unloaded", 0
            _give_memory_back()
            if was != "loading":
                self.log(f"unloaded model {model.name!r}")
            self._notify()

    def _ready(self, model: Model, served: Served) -> None:
        model.served, model.status = served, "loaded"
        model.kind = served.loaded.kind
        model.context = (served.embedder.max_tokens if served.embedder is not None
                         else served.serving.scheduler.max_seq_len)
        model.last_used, model.expires = time.monotonic(), math.inf
        self._notify()

    async def _reap(self) -> None:
        """Unloads each idle model whose keep-alive ran out or that /models/unload asked out."""
        while True:
            now, soonest = time.monotonic(), math.inf
            for model in self.models.values():
                if not model.idle() or (model.pinned and not model.evict):
                    continue
                if model.evict or model.expires <= now:
                    self._unload(model, 0.0, "asked to" if model.evict else "idle past its keep-alive")
                else:
                    soonest = min(soonest, model.expires)
            changed = self._changed
            with anyio.move_on_after(None if math.isinf(soonest) else soonest - now):
                await changed.wait()


def _gigabytes(n: int) -> str:
    from llama_chat.model.memory_budget import gigabytes  # torch-free

    return gigabytes(n)


def _give_memory_back() -> None:
    """Frees an unloaded model's memory now: the cycles that still hold its tensors, CUDA's cached
    blocks, and the C heap's free memory (the weights' and pools' freed blocks stay resident in
    glibc's heap until it is trimmed)."""
    from llama_chat.model.formats.common import release_heap

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    release_heap()


__all__ = ["DEFAULT_KEEP_ALIVE", "Hold", "KEEP_ALIVE_HELP", "MEMORY_HELP", "Model", "ModelEntry", "ModelSettings",
           "Models", "Unload", "check_names", "default_memory_budget", "directory_entries", "files_size",
           "keep_alive_seconds", "memory_bytes", "model_entries", "model_entry", "split_alias", "wall_time"]

"""KV pages on disk: the full pages of prompts, kept across processes (``--prompt-cache DIR``).

The paged prefix cache (``inference/page_table.py``) reuses a prompt's pages between requests of
one process; a new process starts cold, and an agent's long system prompt and tool descriptions
are prefilled again. Here each full page a job registers is also written to disk as a block: every
layer's keys and values of that page, as the pool keeps them, named by the page's prefix key (a
hash chain of all token ids up to the page's end, ``page_keys``), so that equal names mean equal
prefixes. Before a prompt is prefilled, the pages its prefix has on disk are read back, checked and
copied into the pool's pages, and only the rest is computed.

A block holds keys as one model computed them, with one cache type and one rotary embedding, in
pages of one size: the blocks live in a folder named by a fingerprint of all of that
(``fingerprint``: the model file's size and its first and last MiB, or a model's weights where it
has no file; the weights' type; the cache type and the model's key measure; the model's
arguments, rotary settings among them; the page size), and each block's header repeats the
fingerprint and its own key, with the length and a digest of what follows. A block that is
truncated, damaged, or made for another model or cache (copied in by hand, say) is skipped with
one line, and its tokens are prefilled.

Writes never hold up a step: the step thread copies the page (a later job may write over it) and
queues the copy; a writer thread writes it to a temporary file in the same folder and renames it
into place, so a reader (another process sharing the folder) sees a whole block or none. A queue
that is full drops the block. The folder is kept under ``max_bytes`` (``--prompt-cache-size``),
least recently used first out (a read touches its block). A full disk, or any other error
writing, is said once, and nothing more is written: generation goes on without the cache.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llama_chat.model.paged_kv_cache import PagedKVCache

# What a block starts with: this format, then the fingerprint, the key, the payload's length and
# its digest.
MAGIC = b"LCKVPG1\n"
HEADER = struct.Struct("<8s16s16sQ16s")
SUFFIX = ".kv"
# A model file is known by its size and the digest of this much of its start and of its end: the
# header (every tensor's name, type and place, the tokenizer) and the last tensors' values,
# without reading gigabytes at each start.
ENDS_BYTES = 1 << 20
# Blocks waiting for the writer; more are dropped (a step never waits for the disk).
QUEUE_BLOCKS = 256
# A temporary file older than this was left by a process that stopped mid-write: removed at start.
STALE_TEMP_S = 600.0
# How long the process waits at exit for queued blocks to be written.
EXIT_FLUSH_S = 10.0


@dataclass(frozen=True)
class PromptCacheSettings:
    """Where the blocks go, the most bytes they may take there (all fingerprints together), and
    where its problems are said, a line each (a block skipped, writing stopped)."""

    directory: Path
    max_bytes: int
    say: Callable[[str], None] = lambda line: None


@dataclass
class PromptCacheCounts:
    """What the cache has done in this process (``SchedulerStats``)."""

    read_blocks: int = 0
    written_blocks: int = 0
    skipped_blocks: int = 0  # found, but truncated, damaged or another model's or cache's
    dropped_blocks: int = 0  # not written: the queue was full, or writing had stopped
    evicted_blocks: int = 0


def file_digest(path: Path) -> bytes:
    """A model file or folder by its contents' sizes and ends (``ENDS_BYTES``)."""
    digest = hashlib.blake2b(digest_size=16)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            digest.update(f.read(ENDS_BYTES))
            if size > ENDS_BYTES:
                f.seek(max(ENDS_BYTES, size - ENDS_BYTES))
                digest.update(f.read(ENDS_BYTES))
    return digest.digest()


def weights_digest(model: torch.nn.Module) -> bytes:
    """A model with no file, by every parameter's and buffer's name, type, shape and values."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return tensors_digest([t for _, t in named]) + hashlib.blake2b("\0".join(n for n, _ in named).encode(),
                                                                    digest_size=16).digest()


def tensors_digest(tensors: list[torch.Tensor]) -> bytes:
    """Tensors by their types, shapes and values (a model's key measure, ``KeyCenters``)."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        digest.update(f"{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return digest.digest()


def fingerprint(model_digest: bytes, *settings: object) -> bytes:
    """What the keys a block holds depend on: the model (``file_digest`` or ``weights_digest``)
    and ``settings`` (the model's arguments with its rotary settings, the weights' type, the
    cache type and its key measure, the page size), each by its ``repr``."""
    digest = hashlib.blake2b(model_digest, digest_size=16)
    for item in settings:
        digest.update(repr(item).encode() + b"\0")
    return digest.digest()


@dataclass
class PromptCache:
    """The blocks of one fingerprint in ``settings.directory``, read on the step thread and
    written by a thread of their own; ``block_bytes`` is what a page of the pool holds."""

    settings: PromptCacheSettings
    fingerprint: bytes
    block_bytes: int
    counts: PromptCacheCounts = field(default_factory=PromptCacheCounts)

    @classmethod
    def for_pool(cls, settings: PromptCacheSettings, cache: PagedKVCache, model: torch.nn.Module,
                 source: str | Path | None, *, dtype: torch.dtype, quantize: str) -> PromptCache:
        """The cache of blocks for ``cache``'s pages, as ``model`` (loaded from ``source``, in
        ``dtype``, its projections as ``quantize`` says) writes them."""
        digest = file_digest(Path(source)) if source is not None else weights_digest(model)
        centers = cache.key_centers
        measure = b"" if centers is None else tensors_digest([*centers.shift, *centers.scale])
        owner = fingerprint(digest, getattr(model, "args", None), str(dtype), quantize, cache.type_name, measure,
                             cache.page_size, cache.page_bytes)
        return cls(settings, owner, cache.page_bytes)

    def __post_init__(self) -> None:
        self.folder = self.settings.directory / self.fingerprint.hex()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # the sizes, between the step thread's reads and the writer
        # Every block in the directory this process has seen, oldest first, and their bytes.
        self._sizes: OrderedDict[Path, int] = OrderedDict()
        self._total = 0
        self._known: set[bytes] = set()  # keys this fingerprint has a good block for, as far as seen
        self._bad: set[bytes] = set()  # keys whose block was skipped: written again, not kept
        self._stopped: str | None = None  # why writing stopped
        self._queue: queue.Queue[tuple[bytes, torch.Tensor]] = queue.Queue(QUEUE_BLOCKS)
        self._scan()
        self._writer = threading.Thread(target=self._write_all, name="prompt-cache-writer", daemon=True)
        self._writer.start()
        atexit.register(self.close, EXIT_FLUSH_S)

    def has(self, key: bytes) -> bool:
        """Whether a good block of ``key`` is known to be on disk (written or read by this process,
        or there at start); another process's may be there too (``read`` looks)."""
        return key in self._known

    # -- reading (the step thread) ---------------------------------------------------------------

    def read(self, key: bytes) -> bytes | None:
        """The payload of ``key``'s block, checked; None where there is none or it is not good
        (said in one line, and counted as skipped)."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read(HEADER.size + self.block_bytes + 1)
        except FileNotFoundError:
            self._known.discard(key)
            return None
        except OSError as e:
            return self._skipped(key, path, f"cannot be read ({e.strerror or e})")
        why = self._problem(key, data)
        if why is not None:
            return self._skipped(key, path, why)
        self._known.add(key)
        self.counts.read_blocks += 1
        try:
            os.utime(path)  # used now: the last to go
        except OSError:
            pass
        self._seen(path, len(data))
        return data[HEADER.size:]

    def _problem(self, key: bytes, data: bytes) -> str | None:
        """Why ``data`` is not a good block of ``key`` for this cache, or None."""
        if len(data) < HEADER.size:
            return "truncated"
        magic, owner, named, length, digest = HEADER.unpack_from(data)
        if magic != MAGIC:
            return "not a block of this format"
        if owner != self.fingerprint:
            return "made for another model, cache type or page size"
        if named != key:
            return "holds another prefix than its name"
        if length != self.block_bytes:
            return f"holds {length} bytes where a page holds {self.block_bytes}"
        payload = data[HEADER.size:]
        if len(payload) != length:
            return "truncated" if len(payload) < length else "longer than its header says"
        if hashlib.blake2b(payload, digest_size=16).digest() != digest:
            return "damaged (its digest differs)"
        return None

    def _skipped(self, key: bytes, path: Path, why: str) -> None:
        self._known.discard(key)
        self._bad.add(key)
        self.counts.skipped_blocks += 1
        self.settings.say(f"prompt cache: skipped {path}: {why}; its tokens are computed")
        return None

    # -- writing (queued on the step thread, written by the writer) ------------------------------

    def write(self, key: bytes, payload: torch.Tensor) -> None:
        """Queue ``payload`` (a copy of a page's bytes, ``block_bytes`` of them) as ``key``'s
        block; dropped where writing has stopped or the queue is full."""
        if self._stopped is not None or key in self._known:
            return
        self._known.add(key)  # queued: not queued again
        try:
            self._queue.put_nowait((key, payload))
        except queue.Full:
            self._known.discard(key)
            self.counts.dropped_blocks += 1

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block queued so far is written (or dropped); False on ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float | None = EXIT_FLUSH_S) -> None:
        """Write what is queued, waiting at most ``timeout`` (the writer then idles)."""
        self.flush(timeout)

    def _write_all(self) -> None:
        while True:
            key, payload = self._queue.get()
            try:
                self._write(key, payload)
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, payload: torch.Tensor) -> None:
        if self._stopped is not None:
            self.counts.dropped_blocks += 1
            return
        path = self._path(key)
        if key not in self._bad and path.exists():
            return  # another process sharing the folder wrote it first
        body = memoryview(payload.numpy())
        header = HEADER.pack(MAGIC, self.fingerprint, key, len(body),
                             hashlib.blake2b(body, digest_size=16).digest())
        temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(temp, "wb") as f:
                f.write(header)
                f.write(body)
            os.replace(temp, path)
        except OSError as e:
            self._known.discard(key)
            try:
                temp.unlink()
            except OSError:
                pass
            self._stop(e)
            return
        self._bad.discard(key)
        self.counts.written_blocks += 1
        self._seen(path, HEADER.size + len(body))
        self._evict()

    def _seen(self, path: Path, size: int) -> None:
        """``path`` (of ``size`` bytes) was used now: the last to go."""
        with self._lock:
            self._total += size - self._sizes.get(path, 0)
            self._sizes[path] = size
            self._sizes.move_to_end(path)

    def _stop(self, e: OSError) -> None:
        """Writing failed: say why once, and write nothing more."""
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        self._stopped = "full" if full else (e.strerror or str(e))
        what = "the disk is full" if full else f"cannot write there ({e.strerror or e})"
        self.settings.say(f"prompt cache: {what} ({self.folder}); no more blocks are written, generation goes on")

    def _evict(self) -> None:
        """The least recently used blocks out, until the directory holds ``max_bytes`` at most."""
        while True:
            with self._lock:
                if self._total <= self.settings.max_bytes or len(self._sizes) <= 1:
                    return
                path, size = self._sizes.popitem(last=False)
                self._total -= size
            try:
                path.unlink()
            except FileNotFoundError:
                pass  # another process took it out first
            except OSError:
                continue
            self.counts.evicted_blocks += 1
            if path.parent == self.folder:
                self._known.discard(bytes.fromhex(path.stem))

    # -- the directory ---------------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}{SUFFIX}"

    def _scan(self) -> None:
        """Every block of the directory (all fingerprints: they share ``max_bytes``), oldest
        first; temporary files a stopped process left are removed."""
        found: list[tuple[float, Path, int]] = []
        now = time.time()
        for folder in self.settings.directory.iterdir():
            if not folder.is_dir():
                continue
            for entry in os.scandir(folder):
                try:
                    info = entry.stat()
                except OSError:
                    continue
                if entry.name.endswith(".tmp"):
                    if now - info.st_mtime > STALE_TEMP_S:
                        try:
                            os.unlink(entry.path)
                        except OSError:
                            pass
                elif entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                    found.append((info.st_mtime, Path(entry.path), info.st_size))
        for _, path, size in sorted(found, key=lambda f: f[0]):
            self._sizes[path] = size
            self._total += size
            if path.parent == self.folder and len(path.stem) == 32:
                try:
                    self._known.add(bytes.fromhex(path.stem))
                except ValueError:
                    pass


__all__ = ["PromptCache", "PromptCacheCounts", "PromptCacheSettings", "file_digest", "fingerprint",
           "tensors_digest", "weights_digest"]

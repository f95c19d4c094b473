"""What a run's caches take in memory, against what the machine has left.

``--cache-tokens``, ``-c`` and ``--max-batch`` size buffers that are allocated whole before the
first token: a paged KV cache of ``--cache-tokens`` slots, a dense one of ``-c`` slots per beam,
and per-step rows (logits among them) for ``--max-batch`` jobs. Their ranges (``ml/controls.py``)
bound them absolutely; this bounds them by the machine, so that ``--cache-tokens 100000000`` is
one line naming the limit instead of a process the kernel kills minutes later.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llama_chat.model.transformer import Transformer

MEMINFO = Path("/proc/meminfo")
# cgroup v2: a container's limit and use, which /proc/meminfo does not show.
CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")
CGROUP_USED = Path("/sys/fs/cgroup/memory.current")


class TooLarge(ValueError):
    """An option whose buffers would not fit in the memory left; the message is one line."""


@dataclass(frozen=True)
class CacheSizes:
    """The options that size a run's caches, by flag; None where the default holds."""

    ctx_tokens: int | None = None  # -c: the dense cache's slots (one-shot, chat on CUDA)
    beams: int = 1  # a dense cache per beam
    cache_tokens: int | None = None  # --cache-tokens: the paged cache's slots
    max_batch: int | None = None  # --max-batch: rows of a step


def _read_small(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16).decode("ascii", errors="replace")
    except OSError:
        return None


def available_bytes() -> int | None:
    """Memory the process can still take: the kernel's estimate (``MemAvailable``), or less under
    a cgroup's limit; None where neither can be read."""
    found = []
    meminfo = _read_small(MEMINFO)
    for line in (meminfo or "").splitlines():
        if line.startswith("MemAvailable:"):
            found.append(int(line.split()[1]) * 1024)
    limit, used = _read_small(CGROUP_LIMIT), _read_small(CGROUP_USED)
    if limit and used and limit.strip().isdigit() and used.strip().isdigit():
        found.append(max(0, int(limit) - int(used)))
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            return None
    return min(found)


def available_on(device) -> int | None:
    """Memory a cache on ``device`` can still take: a CUDA device's free memory (the weights
    already on it), else the host's (``available_bytes``)."""
    if getattr(device, "type", device) == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return available_bytes()


def kv_token_bytes(model: Transformer) -> int:
    """Bytes of keys and values one token keeps in the cache, all layers together."""
    a = model.args
    return 2 * a.n_layers * a.n_kv_heads * a.head_dim * next(model.parameters()).element_size()


def row_bytes(model: Transformer) -> int:
    """Bytes one row of a batched step takes beyond the cache: its logits and activations, float32."""
    a = model.args
    return 4 * (a.vocab_size + 4 * a.dim + 2 * a.hidden_dim)


def gigabytes(n: int) -> str:
    """``n`` bytes as a size to read at a glance: 22.9 GB, 1.6 MB, 100.0 KB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def check(model: Transformer, sizes: CacheSizes, available: int | None = None) -> None:
    """``TooLarge`` naming the first option whose buffers need more than the memory available."""
    free = available_bytes() if available is None else available
    if free is None:
        return
    token = kv_token_bytes(model)
    needs = []
    if sizes.ctx_tokens:
        beams = f" for each of {sizes.beams} beams" if sizes.beams > 1 else ""
        needs.append((f"-c {sizes.ctx_tokens}", sizes.ctx_tokens * sizes.beams * token, f"its KV cache{beams}"))
    if sizes.cache_tokens:
        needs.append((f"--cache-tokens {sizes.cache_tokens}", sizes.cache_tokens * token, "its KV cache"))
    if sizes.max_batch:
        needs.append((f"--max-batch {sizes.max_batch}", sizes.max_batch * row_bytes(model), "its step's rows"))
    for flag, need, what in needs:
        if need > free:
            raise TooLarge(f"{flag}: {what} would take {gigabytes(need)}, more than the {gigabytes(free)} of "
                           "memory available")


__all__ = ["CacheSizes", "TooLarge", "available_bytes", "check", "kv_token_bytes", "row_bytes"]

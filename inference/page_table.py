"""Who owns which page of the paged KV cache, and which pages hold which token prefixes.

Pure bookkeeping, no tensors: the scheduler asks for pages, hands them back, and registers full
pages under their prefix key so that a later sequence starting with the same tokens can use them.

A page is in one of three states:

- referenced: one or more sequences hold it in their block tables (``refs > 0``);
- cached: nobody holds it, but it is full and keyed by its prefix, so it can be reused as it is
  until its space is needed (kept in least-recently-released order);
- free: nobody holds it and it holds nothing worth keeping.

``allocate`` takes free pages first, then evicts cached pages, oldest first; both count as
``available``.

A page is also resident or not: the pool's memory is reserved, and a page takes memory once
written. Free pages that were written are handed out first. When written pages that nobody holds
pass the pool's ``keep_pages`` (twice that while jobs run, the keep itself once none does), the
oldest of them, free ones first and then cached ones, are given back to the system
(``PagedKVCache.return_pages``): memory falls back after a burst of jobs.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from llama_chat.model.paged_kv_cache import SCRATCH_PAGE

PageKey = bytes


def page_keys(tokens: Sequence[int], page_size: int, *, start: int = 0,
              previous: PageKey = b"") -> list[PageKey]:
    """The key of every full page of ``tokens``: a digest of all token ids up to the page's end.

    Keys are chained (each page's digest covers the one before it), so equal keys mean equal
    prefixes, not just an equal page. ``start`` and ``previous`` continue a chain already
    computed for the first ``start`` pages. BLAKE2b's 128 bits make a collision (two different
    prefixes under one key, which would splice another sequence's keys in) not a practical risk.
    """
    keys = []
    for first in range(start * page_size, len(tokens) - page_size + 1, page_size):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(array("q", tokens[first:first + page_size]).tobytes())
        previous = digest.digest()
        keys.append(previous)
    return keys


class PagePool(Protocol):
    """Where the pages' memory is (``PagedKVCache``)."""

    @property
    def keep_pages(self) -> int: ...

    def return_pages(self, pages: list[int]) -> list[int]: ...


class PageTable:
    """Reference counts, the prefix index and the free and cached lists of one page pool."""

    def __init__(self, num_pages: int, pool: PagePool | None = None) -> None:
        self.num_pages = num_pages
        self.pool = pool
        # Pages written since the pool was made or last gave them back; the scratch page is
        # written by every padding token.
        self.written = bytearray(num_pages)
        self.written[SCRATCH_PAGE] = 1
        self.resident = 1
        self.returned = 0  # pages given back to the system so far
        self.refs = [0] * num_pages
        self.key_of: list[PageKey | None] = [None] * num_pages
        self.by_key: dict[PageKey, int] = {}
        # Pages taken last are the highest ids; the scratch page is never handed out.
        self.free = [p for p in range(num_pages - 1, -1, -1) if p != SCRATCH_PAGE]
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, keyed; oldest first
        self.evictions = 0
        # The keyed pages of the sequence released last: kept whatever the pool's keep, so that
        # an agent's next request finds the whole of its long prompt (as a llama-server slot
        # does), while what a burst of many sequences wrote still goes back.
        self.last_prefix_pages = 0

    @property
    def usable(self) -> int:
        """Pages that can ever be handed out (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def available(self) -> int:
        """Pages ``allocate`` can hand out now: free ones and cached ones it may evict."""
        return len(self.free) + len(self.cached)

    @property
    def in_use(self) -> int:
        return self.usable - self.available

    def lookup(self, keys: Sequence[PageKey]) -> list[int]:
        """The pages of the longest run of ``keys``, from the first, that the cache holds."""
        pages = []
        for key in keys:
            page = self.by_key.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: Sequence[int]) -> None:
        """Take a reference on pages found by ``lookup`` (a cached one stops being evictable)."""
        for page in pages:
            if self.refs[page] == 0:
                self.cached.pop(page, None)
            self.refs[page] += 1

    def allocate(self, count: int) -> list[int]:
        """``count`` pages for a sequence to write, each with one reference; raises if too few."""
        if count > self.available:
            raise MemoryError(f"{count} pages asked for, {self.available} available")
        pages = []
        for _ in range(count):
            if self.free:
                page = self.free.pop()
            else:
                page, _ = self.cached.popitem(last=False)  # least recently released first
                self._forget(page)
                self.evictions += 1
            self.refs[page] = 1
            self._write(page)
            pages.append(page)
        return pages

    def take_free_run(self, count: int) -> list[int] | None:
        """``count`` consecutive free pages, each with one reference, or None if there is no such
        run (cached pages are not evicted for it)."""
        free = sorted(self.free)
        for i in range(len(free) - count + 1):
            if free[i + count - 1] - free[i] == count - 1:
                run = free[i:i + count]
                taken = set(run)
                self.free = [p for p in self.free if p not in taken]
                for page in run:
                    self.refs[page] = 1
                    self._write(page)
                return run
        return None

    def move_key(self, old: int, new: int) -> None:
        """Let ``new`` (a copy of ``old``'s contents) hold ``old``'s prefix key, if it has one."""
        key = self.key_of[old]
        if key is not None:
            self.key_of[old] = None
            self.key_of[new] = key
            self.by_key[key] = new

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference on each page. Pass a block table in order: its pages are released
        last to first, so that the start of a prefix, which more sequences share, is evicted last
        (a prefix is only found page by page from its start)."""
        for page in reversed(pages):
            self.refs[page] -= 1
            if self.refs[page] > 0:
                continue
            if self.key_of[page] is not None:
                self.cached[page] = None
            else:
                self.free.append(page)
        self.last_prefix_pages = sum(self.key_of[page] is not None for page in pages)
        self._give_back()

    def register(self, page: int, key: PageKey) -> None:
        """Record that ``page`` (full, referenced) holds the prefix ``key``. A prefix already held
        by another page keeps that page: this one stays private and is freed with its sequence."""
        if key not in self.by_key and self.key_of[page] is None:
            self.by_key[key] = page
            self.key_of[page] = key

    @property
    def unheld_resident(self) -> int:
        """Written pages nobody holds: free ones not given back, and cached ones."""
        return self.resident - 1 - self.in_use

    def _write(self, page: int) -> None:
        if not self.written[page]:
            self.written[page] = 1
            self.resident += 1

    def _give_back(self) -> None:
        """Give the oldest unheld written pages back to the system, down to the pool's keep (or
        the prefix of the sequence released last, when longer), once they pass it (twice over
        while jobs hold pages, so that a long burst does not pay for it at every job's end)."""
        if self.pool is None:
            return
        keep, unheld = max(self.pool.keep_pages, self.last_prefix_pages), self.unheld_resident
        if unheld <= (keep if self.in_use == 0 else 2 * keep):
            return
        # Oldest first: free pages deepest in the list (the last ones are taken first), then
        # cached ones least recently released.
        candidates = [p for p in self.free if self.written[p]][:unheld - keep]
        evicted = list(self.cached)[:max(0, unheld - keep - len(candidates))]
        for page in evicted:
            del self.cached[page]
            self._forget(page)
            self.evictions += 1
        # Free pages given back before go along: they join the runs, whose ends, partly in a
        # system page shared with a neighbour, cannot go back alone.
        fillers = [p for p in self.free if not self.written[p]]
        returned = set(self.pool.return_pages(sorted(candidates + evicted + fillers)))
        gone = [p for p in returned if self.written[p]]
        for page in gone:
            self.written[page] = 0
        self.resident -= len(gone)
        self.returned += len(gone)
        # Pages given back go to the bottom of the free list, below every written one.
        kept = [p for p in self.free if p not in returned] + [p for p in evicted if p not in returned]
        self.free = sorted(returned, reverse=True) + kept

    def _forget(self, page: int) -> None:
        key = self.key_of[page]
        if key is not None:
            del self.by_key[key]
            self.key_of[page] = None

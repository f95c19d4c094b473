"""The paged KV pool's memory: reserved, not touched, at start; resident where written; given back
after a burst, oldest unheld pages first."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from llama_chat.inference.page_table import PageTable
from llama_chat.model.paged_kv_cache import SCRATCH_PAGE, PagedKVCache

linux = pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc/self/statm")


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE


class FakePool:
    """Gives back every page asked for but those in ``stuck``; records what it was asked."""

    def __init__(self, keep: int, stuck: frozenset[int] = frozenset()) -> None:
        self.keep_pages = keep
        self.stuck = stuck
        self.asked: list[list[int]] = []

    def return_pages(self, pages: list[int]) -> list[int]:
        self.asked.append(pages)
        return [p for p in pages if p not in self.stuck]


def test_written_pages_are_reused_first_and_the_oldest_unheld_go_back_once_none_is_held():
    pool = FakePool(keep=3)
    table = PageTable(12, pool)
    a, b, c = table.allocate(3), table.allocate(2), table.allocate(2)
    assert table.resident == 1 + 7
    table.release(a)
    assert pool.asked == [] and table.unheld_resident == 3
    again = table.allocate(3)
    assert sorted(again) == sorted(a)  # written pages first, not fresh ones
    table.release(again)
    table.release(b)
    assert pool.asked == []  # 5 unheld while a job runs: not past twice the keep
    table.release(c)  # nothing held: 7 unheld down to the keep, the oldest released first
    assert pool.asked == [sorted(again + [b[1]])]  # a block table is released last page first
    assert table.unheld_resident == 3 and table.resident == 4 and table.returned == 4
    assert sorted(p for p in range(12) if table.written[p]) == sorted([SCRATCH_PAGE, b[0], *c])
    # Given-back pages are taken after every written one.
    assert sorted(table.allocate(3)) == sorted([b[0], *c])


def test_cached_pages_go_back_after_free_ones_and_lose_their_prefix():
    pool = FakePool(keep=1)
    table = PageTable(8, pool)
    kept, spare = table.allocate(2), table.allocate(1)
    for page, key in zip(kept, (b"k1", b"k2")):
        table.register(page, key)
    table.release(spare)
    table.release(kept)  # 3 unheld, keep 1: the free page, then the oldest cached (the prefix's tail)
    assert pool.asked == [sorted([spare[0], kept[1]])]
    assert table.lookup([b"k1", b"k2"]) == [kept[0]] and list(table.cached) == [kept[0]]


def test_a_page_the_pool_could_not_give_back_stays_resident_and_free():
    pool = FakePool(keep=0, stuck=frozenset({2}))
    table = PageTable(6, pool)
    pages = table.allocate(3)
    table.release(pages)
    assert table.written[2] and not table.written[1] and table.resident == 2
    assert table.free[-1] == 2 and table.available == 5


@linux
def test_a_large_pool_takes_memory_only_where_written_and_gives_it_back():
    before = rss()
    # 2 layers x keys and values x 2 heads x 4096 pages x 16 slots x 64 floats: 128 MiB reserved.
    cache = PagedKVCache(2, 4096, 16, 2, 64)
    assert rss() - before < 8 * 2**20
    pages = list(range(1, 1025))
    for store in (*cache.keys, *cache.values):
        store[:, 1:1025] = 1.0
    written = rss() - before
    assert written > 28 * 2**20  # a quarter of the pool
    returned = cache.return_pages(pages)
    assert returned == pages  # a run of whole 4 KiB pages (each is 4 KiB a head here)
    assert rss() - before < written - 24 * 2**20
    assert all(float(store[:, 1:1025].abs().sum()) == 0.0 for store in cache.keys)


@linux
def test_a_lone_page_smaller_than_the_systems_stays_but_its_run_goes_back():
    # 16 slots x 16 floats: 1 KiB a head and page; a run of four aligned pages is one system page.
    cache = PagedKVCache(1, 64, 16, 2, 16)
    for store in (*cache.keys, *cache.values):
        store.fill_(2.0)
    assert cache.return_pages([5]) == []
    assert cache.return_pages([4, 5, 6, 7, 9]) == [4, 5, 6, 7]
    assert float(cache.keys[0][:, 4:8].abs().sum()) == 0.0
    assert float(cache.keys[0][:, 9].abs().sum()) > 0 and float(cache.keys[0][:, 3].abs().sum()) > 0


def test_a_cache_on_another_device_gives_nothing_back():
    cache = PagedKVCache(1, 8, 4, 1, 8, device="meta")
    assert cache.return_pages([1, 2, 3]) == []


def test_the_serve_pool_fills_the_batch_within_half_the_free_memory_but_holds_a_context():
    from llama_chat.cmd.serve import POOL_BYTES_UNKNOWN, pool_tokens

    assert pool_tokens(1000, 2048, 16, 10**12) == 16 * 2048  # room for every slot
    assert pool_tokens(1000, 2048, 16, 20 * 10**6) == 10**4  # half of 20 MB, at 1 KB a token
    assert pool_tokens(1000, 2048, 16, 10**5) == 2048  # never less than one context
    assert pool_tokens(1000, 2048, 16, None) == min(16 * 2048, POOL_BYTES_UNKNOWN // 1000)

"""The paged KV cache: prefix keys, page bookkeeping, and attention over pages against the model."""

from __future__ import annotations

import pytest
import torch

from builders import random_model, tiny_args
from llama_chat.inference.page_table import PageTable, page_keys
from llama_chat.model.paged_kv_cache import SCRATCH_PAGE, PagedBatch, PagedKVCache


def test_page_keys_cover_the_whole_prefix():
    a = list(range(10, 50))
    b = list(a)
    b[3] = 999  # differs in the first page only
    ka, kb = page_keys(a, 8), page_keys(b, 8)
    assert len(ka) == 5 and len(set(ka)) == 5
    assert all(x != y for x, y in zip(ka, kb))  # every later page's key changes too
    assert page_keys(a[:20], 8) == ka[:2]  # a partial last page has no key
    assert page_keys(a, 8, start=2, previous=ka[1]) == ka[2:]  # a chain continues where it stopped


def test_page_table_references_cache_and_evicts_oldest_first():
    table = PageTable(9)  # 8 usable: page 0 is scratch
    assert table.usable == table.available == 8
    a = table.allocate(3)
    assert SCRATCH_PAGE not in a and table.available == 5
    keys = [b"k1", b"k2", b"k3"]
    for page, key in zip(a, keys):
        table.register(page, key)
    b = table.lookup(keys)
    assert b == a
    table.acquire(b[:2])  # a second sequence shares the first two pages
    table.release(a)
    assert table.refs[a[0]] == 1 and table.refs[a[2]] == 0
    assert table.available == 6 and list(table.cached) == [a[2]]
    table.release(b[:2])
    # Released last to first: the start of the prefix is the most recently released.
    assert list(table.cached) == [a[2], a[1], a[0]]
    assert table.available == 8
    taken = table.allocate(6)  # five free pages, then the oldest cached one is evicted
    assert a[2] in taken and table.evictions == 1
    assert table.lookup(keys) == a[:2]  # the prefix's start is still there
    with pytest.raises(MemoryError):
        table.allocate(3)
    table.release(taken)
    assert table.available == 8


def test_a_page_already_keyed_elsewhere_stays_private():
    table = PageTable(5)
    p, q = table.allocate(2)
    table.register(p, b"same")
    table.register(q, b"same")
    assert table.lookup([b"same"]) == [p]
    table.release([q])
    assert q in table.free and not table.cached


def test_a_run_of_free_pages_is_taken_whole_or_not_at_all():
    table = PageTable(9)
    first = table.allocate(3)  # 1, 2, 3
    table.allocate(1)  # 4
    table.release(first)  # free: 1, 2, 3 and 5..8
    assert table.take_free_run(5) is None  # no five in a row: 1-3, then 5-8
    assert table.take_free_run(4) == [5, 6, 7, 8]
    assert sorted(table.free) == [1, 2, 3] and table.refs[5:9] == [1, 1, 1, 1]
    table.register(5, b"k")
    table.move_key(5, 6)
    assert table.by_key[b"k"] == 6 and table.key_of[5] is None


def test_attention_over_pages_matches_the_model_for_any_mix_of_rows():
    """Three sequences written to scattered pages, then one step that mixes two one-token rows
    with a prompt chunk: the logits equal each sequence's own full forward."""
    torch.manual_seed(0)
    model = random_model(tiny_args(300, n_heads=4, n_kv_heads=2), seed=1)
    cache = PagedKVCache.for_model(model.args, num_pages=20, page_size=4)
    seqs = [torch.randint(3, 300, (n,)).tolist() for n in (11, 6, 17)]
    pages = [[7, 2, 15], [9, 4], [3, 18, 5, 11, 1]]  # any pages, in any order
    done = [10, 5, 9]  # already in the cache: all but the last token, or a prompt's first part

    def step(parts):
        tokens, positions, slots, singles, runs = [], [], [], [], []
        for i, lo, hi in parts:
            first = len(tokens)
            for pos in range(lo, hi):
                tokens.append(seqs[i][pos])
                positions.append(pos)
                slots.append(pages[i][pos // 4] * 4 + pos % 4)
            if hi - lo == 1:
                singles.append(i)
            else:
                runs.append((first, hi - lo, torch.tensor(pages[i][:-(-hi // 4)]), lo))
        width = max((len(pages[i]) for i in singles), default=1)
        tables = torch.tensor([pages[i] + [SCRATCH_PAGE] * (width - len(pages[i])) for i in singles]) if singles else None
        batch = PagedBatch(torch.tensor(slots), torch.tensor(positions), len(singles), tables, tuple(runs))
        with torch.inference_mode():
            return model(torch.tensor([tokens]), torch.tensor([positions]), cache.view(batch))[0]

    step([(0, 0, 10), (1, 0, 5), (2, 0, 9)])  # three prompt runs
    out = step([(0, 10, 11), (1, 5, 6), (2, 9, 17)])  # two decodes and a chunk at an offset
    with torch.inference_mode():
        expect = [model(torch.tensor([s]))[0] for s in seqs]
    torch.testing.assert_close(out[0], expect[0][10], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1], expect[1][5], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[2:], expect[2][9:17], rtol=1e-4, atol=1e-4)


def test_a_lone_row_on_consecutive_pages_reads_them_as_a_slice():
    """The same decode step with the lone row's pages gathered and read as a slice of the pool:
    the same logits, and both the sequence's own full forward."""
    torch.manual_seed(0)
    model = random_model(tiny_args(300, n_heads=4, n_kv_heads=2), seed=2)
    cache = PagedKVCache.for_model(model.args, num_pages=12, page_size=4)
    seq = torch.randint(3, 300, (14,)).tolist()
    pages = [5, 6, 7, 8]
    slots = [pages[pos // 4] * 4 + pos % 4 for pos in range(14)]
    prompt = PagedBatch(torch.tensor(slots[:13]), torch.arange(13), 0, None, ((0, 13, torch.tensor(pages), 0),))
    with torch.inference_mode():
        model(torch.tensor([seq[:13]]), torch.arange(13).view(1, -1), cache.view(prompt))
        out = {}
        for first_page in (None, 5):
            batch = PagedBatch(torch.tensor(slots[13:]), torch.tensor([13]), 1, torch.tensor([pages]), (),
                               single_kv_len=14, single_first_page=first_page)
            out[first_page] = model(torch.tensor([[seq[13]]]), torch.tensor([[13]]), cache.view(batch))[0, -1]
        expect = model(torch.tensor([seq]))[0, -1]
    torch.testing.assert_close(out[5], out[None], rtol=0, atol=0)
    torch.testing.assert_close(out[5], expect, rtol=1e-4, atol=1e-4)

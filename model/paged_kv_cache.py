"""Keys and values in fixed-size pages, found through a block table per sequence.

A dense ``KVCache`` gives every sequence a row of ``max_seq_len`` slots whether it uses them or
not. Here the cache is one pool of pages of ``page_size`` token slots each; a sequence owns a list
of pages (its block table), so sequences join and leave a batch without anything being reshaped,
a finished sequence's pages go straight to the next one, and two sequences that start with the same
tokens can point at the same pages.

One forward step packs the tokens of every sequence into one row (``(1, tokens)``): the
projections and the feed-forward see a single matrix with no padding, and only attention is done
per sequence. ``PagedBatch`` says where each token's keys are written (its slot) and which pages
each sequence reads; ``PagedKVCache.view(batch)`` is what the transformer is given as its cache.

Which pages belong to whom, and which are shared, is decided above this module (in
``inference/``); here pages are only storage.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from llama_chat.ml import ops
from llama_chat.ml.kv_centers import KeyCenters
from llama_chat.model import interrupt
from llama_chat.model.kv_cache import KVCache, mapped_zeros
from llama_chat.model.kv_types import Center, KVType, of_dtype

# Page 0 is never handed to a sequence: padding tokens write their keys there and padded block
# table entries point at it, so a static-shaped step never needs a branch for "no page".
SCRATCH_PAGE = 0
# The most memory the mirrors of gathered pages may take, all layers (``PagedKVCache.mirror``);
# past it, rows' pages are gathered into one buffer shared by the layers, every layer of every step.
MIRROR_MAX_BYTES = 512 * 2**20
# Written pages that no job holds, kept resident for the next jobs (reused before any other):
# past this, the oldest are given back to the system (``PageTable``), so that memory falls back
# after a burst while a chat's next turn still finds its prefix and its pages.
KEEP_UNHELD_BYTES = 64 * 2**20


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted page ids as runs of consecutive ones, ``[(first, stop), ...]``."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][1] == page:
            runs[-1] = (runs[-1][0], page + 1)
        else:
            runs.append((page, page + 1))
    return runs


@dataclass(frozen=True)
class PagedBatch:
    """Where the packed tokens of one forward step live in the page pool (device tensors).

    The tokens of the step are ordered: first ``singles`` one-token rows (decodes, and prompts
    with one token left), then each longer run of one sequence's prompt (``runs``).

    ``slots``: ``(tokens,)`` flat slot index (``page * page_size + offset``) each token's keys go to.
    ``positions``: ``(tokens,)`` each token's position in its sequence.
    ``single_tables``: ``(singles, width)`` page ids of each one-token row's sequence.
    ``runs``: for each longer run, ``(first token index, length, table (width,), first position)``.
    ``single_kv_len``: when given (an eager step), the keys the one-token rows read are cut to
    this many positions, and a lone row then needs no mask; None keeps the tables' full width
    (a static-shaped step).
    ``single_first_page``: when given, the step has one one-token row, its ``single_kv_len`` is
    set, and its pages are consecutive from this one: its keys are read as a slice of the pool
    instead of being gathered page by page (a copy of the whole sequence's keys every layer).
    ``single_key``: when given (CPU, no static shapes), names the one-token rows and their whole
    block tables (``single_tables``, reserved pages included); a step with the same key as the
    one before reads the rows' keys from the mirror of that step's gather, updated with this
    step's keys at ``single_mirror_slots`` (row ``r``, position ``p``: ``r * width * page + p``),
    instead of gathering every page again.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    singles: int
    single_tables: torch.Tensor | None
    runs: tuple[tuple[int, int, torch.Tensor, int], ...]
    single_kv_len: int | None = None
    single_first_page: int | None = None
    single_key: tuple | None = None
    single_mirror_slots: torch.Tensor | None = None


class PagedKVCache:
    """Per layer, keys and values shaped ``(kv_heads, num_pages, page_size, row)``: a row is a
    token's ``head_dim`` values as its type keeps them (``kv_types``; ``dtype`` may name a float
    type by its torch dtype), ``head_dim`` of them for a float type.

    Pages are the second dimension so that a sequence's pages, selected in table order, are
    already its keys in position order: ``(kv_heads, width * page_size, head_dim)`` with no
    transposing copy.
    """

    def __init__(self, n_layers: int, num_pages: int, page_size: int, n_kv_heads: int, head_dim: int,
                 *, device: torch.device | str = "cpu", dtype: torch.dtype | KVType = torch.float32) -> None:
        if num_pages < 2:
            raise ValueError("a paged cache needs at least two pages (one is scratch)")
        self.kv_type = dtype if isinstance(dtype, KVType) else of_dtype(dtype)
        self.kv_type.check(head_dim)
        self.head_dim = head_dim
        dtype = self.kv_type.storage
        row = self.kv_type.row_size(head_dim)
        # Pages past ``num_pages`` that are never handed out (nor touched) make each head's run of
        # pages a whole number of system pages: every head's pages then line up with the
        # system's alike, and a run given back frees the same pages in each (``return_pages``).
        head_page = page_size * row * dtype.itemsize
        step = mmap.PAGESIZE // math.gcd(head_page, mmap.PAGESIZE) if torch.device(device).type == "cpu" else 1
        shape = (n_kv_heads, -(-num_pages // step) * step, page_size, row)  # seen as num_pages pages
        # Reserved, not touched: a page is resident once written (``kv_cache.mapped_zeros``).
        made = [mapped_zeros(shape, device=device, dtype=dtype) for _ in range(2 * n_layers)]
        self.keys = [t[:, :num_pages] for t, _ in made[0::2]]
        self.values = [t[:, :num_pages] for t, _ in made[1::2]]
        self._mappings = [m for _, m in made if m is not None]
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None
        # Per layer: the key of the rows last gathered, and their keys and values (see ``mirror``).
        self._mirrors: list[tuple[tuple, torch.Tensor, torch.Tensor] | None] = [None] * n_layers
        # The model's key measure, where the type keeps keys by it (``center_keys_by``).
        self.key_centers: KeyCenters | None = None

    @classmethod
    def for_model(cls, args, num_pages: int, page_size: int, *, device: torch.device | str = "cpu",
                  dtype: torch.dtype | KVType = torch.float32) -> PagedKVCache:
        return cls(args.n_layers, num_pages, page_size, args.n_kv_heads, args.head_dim, device=device, dtype=dtype)

    @classmethod
    def of_row(cls, cache: KVCache, row: int = 0) -> PagedKVCache:
        """Row ``row`` of a dense ``cache`` seen as a pool of one page of all its slots (views:
        nothing is copied), so that a paged step over page 0 reads and writes that row's keys."""
        pool = cls.__new__(cls)
        pool.kv_type = cache.kv_type
        pool.keys = [k[row].unsqueeze(1) for k in cache.keys]
        pool.values = [v[row].unsqueeze(1) for v in cache.values]
        pool._mappings = []
        pool.num_pages, pool.page_size = 1, cache.max_seq_len
        pool.device = cache.keys[0].device
        pool._gathered = None
        pool._mirrors = [None] * len(cache.keys)
        pool.key_centers = None
        return pool

    def center_keys_by(self, centers: KeyCenters | None) -> None:
        """Keep keys by the model's measure (``key_centers``), where the type does; before any
        key is written, for a key is read under the measure it was written under."""
        if self.kv_type.centers_keys:
            self.key_centers = centers

    def key_center(self, layer: int, positions_dims: int) -> Center | None:
        """``layer``'s key measure shaped for rows ``(kv_heads, ..., head_dim)`` with
        ``positions_dims`` dimensions between, or None."""
        if self.key_centers is None:
            return None
        shape = (self.key_centers.shift[layer].shape[0],) + (1,) * positions_dims + (-1,)
        return self.key_centers.shift[layer].view(shape), self.key_centers.scale[layer].view(shape)

    @property
    def type_name(self) -> str:
        """What a page holds, as the ready line and the stats say it."""
        return self.kv_type.name

    @property
    def page_bytes(self) -> int:
        """Bytes one page takes, keys and values of every layer."""
        t = self.keys[0]
        return 2 * len(self.keys) * t[:, 0].numel() * t.element_size()  # t[:, 0]: every head's slice of page 0

    @property
    def keep_pages(self) -> int:
        """Unheld written pages kept resident (``KEEP_UNHELD_BYTES``); the rest go back."""
        return KEEP_UNHELD_BYTES // self.page_bytes

    def return_pages(self, pages: list[int]) -> list[int]:
        """Give the memory of ``pages`` (free: nobody reads them) back to the system; the pages
        whose every byte went back, which read as zeros from then on, and take memory again
        when written. The rest stay resident.

        Memory goes back in whole pages of the system (4 KiB), and a page of the pool is one
        slice of each head's keys and values: a few kilobytes, so it goes back with its
        neighbours, in runs of consecutive pages; one alone may not. Where the cache has no
        mapping (another device), nothing goes back.
        """
        if not self._mappings or not pages:
            return []
        t = self.keys[0]
        head_bytes, page_bytes = t.stride(0) * t.element_size(), t.stride(1) * t.element_size()
        system = mmap.PAGESIZE
        returned: list[int] = []
        for first, stop in _runs(sorted(pages)):
            spans, low, high = [], first, stop  # the pages covered in every head
            for head in range(t.shape[0]):
                start = head * head_bytes + first * page_bytes
                end = head * head_bytes + stop * page_bytes
                start, end = -(-start // system) * system, end // system * system
                if end <= start:
                    low, high = stop, stop
                    break
                spans.append((start, end - start))
                low = max(low, -(-(start - head * head_bytes) // page_bytes))
                high = min(high, (end - head * head_bytes) // page_bytes)
            for mapping in self._mappings:
                for start, length in spans:
                    mapping.madvise(mmap.MADV_DONTNEED, start, length)
            returned.extend(range(low, high))
        if returned:
            self._gathered = None
            self.drop_mirrors()
        return returned

    def reads_as(self, dtype: torch.dtype) -> bool:
        """Whether its pages are attended as they are by a model computing in ``dtype``; else
        each step reads the pages it needs converted (``PagedView``)."""
        return not self.kv_type.quantized and self.kv_type.storage == dtype

    def gather_buffers(self, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two tensors of ``pages`` pages for gathered keys and values, reused while the count
        stays the same (every layer of a step, and the steps until a sequence needs a new page).

        A fresh multi-megabyte tensor per gather comes from newly mapped memory each time, and
        its page faults cost far more than the copy itself.
        """
        if self._gathered is None or self._gathered[0].shape[1] != pages:
            shape = (self.keys[0].shape[0], pages, self.page_size, self.keys[0].shape[-1])
            dtype, device = self.keys[0].dtype, self.keys[0].device
            self._gathered = (torch.empty(shape, dtype=dtype, device=device),
                              torch.empty(shape, dtype=dtype, device=device))
        return self._gathered

    def mirror(self, layer: int, key: tuple, pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pages ``pages`` of layer ``layer`` gathered, ``(kv_heads, pages, page, dim)`` each,
        kept from one step to the next while the rows' ``key`` stays the same; None when keeping
        them for every layer would pass ``MIRROR_MAX_BYTES`` (gather into the shared buffers then).

        With the same key as the step before, only this step's keys and values ``k``, ``v``
        (``(kv_heads, rows, dim)``) are written, at ``slots`` of the flattened mirror: every other
        position of those pages is as it was, for a page is written only by the row that owns it
        (a shared page is a full prefix page and never changes). Gathering every page of every
        row each step would copy all of their keys again though each row added one token.
        """
        kept = self._mirrors[layer]
        store_k, store_v = self.keys[layer], self.values[layer]
        kv_heads, _, page_size, head_dim = store_k.shape
        if kept is not None and kept[0] == key:
            _, mk, mv = kept
            mk.view(kv_heads, -1, head_dim).index_copy_(1, slots, k)
            mv.view(kv_heads, -1, head_dim).index_copy_(1, slots, v)
            return mk, mv
        per_layer = 2 * kv_heads * pages.numel() * page_size * head_dim * store_k.element_size()
        if per_layer * len(self.keys) > MIRROR_MAX_BYTES:
            self.drop_mirrors()
            return None
        if kept is not None and kept[1].shape[1] == pages.numel():
            mk, mv = kept[1], kept[2]
        else:
            shape = (kv_heads, pages.numel(), page_size, head_dim)
            mk = torch.empty(shape, dtype=store_k.dtype, device=store_k.device)
            mv = torch.empty(shape, dtype=store_k.dtype, device=store_k.device)
        torch.index_select(store_k, 1, pages, out=mk)
        torch.index_select(store_v, 1, pages, out=mv)
        self._mirrors[layer] = (key, mk, mv)
        return mk, mv

    def drop_buffers(self) -> None:
        """Free the gathered pages' buffers and the mirrors (made again when next needed)."""
        self._gathered = None
        self.drop_mirrors()

    def drop_mirrors(self) -> None:
        """Forget every mirror: a step fed rows without updating them."""
        self._mirrors = [None] * len(self._mirrors)

    def slice_views(self, start: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's keys and values of flat slots ``[start, start + length)``, as views shaped
        like a one-row dense cache, ``(1, kv_heads, length, head_dim)``: consecutive pages read as
        one sequence's cache. The length is marked dynamic for the compiler."""
        def views(store: list[torch.Tensor]) -> list[torch.Tensor]:
            out = []
            for t in store:
                kv_heads, num_pages, page_size, head_dim = t.shape
                v = t.view(kv_heads, num_pages * page_size, head_dim)[:, start:start + length].unsqueeze(0)
                torch._dynamo.mark_dynamic(v, 2)
                out.append(v)
            return out
        return views(self.keys), views(self.values)

    def page_payload(self, page: int) -> torch.Tensor:
        """A copy of what ``page`` holds, every layer's keys then values, as bytes
        (``page_bytes`` of them): a block of the prompt cache on disk (``model/prompt_cache.py``)."""
        return torch.cat([store[:, page].reshape(-1).view(torch.uint8).cpu()
                          for store in (*self.keys, *self.values)])

    def load_page(self, page: int, payload: bytes) -> None:
        """Fill ``page`` from ``payload``, bytes ``page_payload`` gave (of a pool of the same
        shapes and type)."""
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        at = 0
        for store in (*self.keys, *self.values):
            target = store[:, page]
            size = target.numel() * target.element_size()
            target.copy_(data[at:at + size].view(target.dtype).view(target.shape))
            at += size
        self.drop_mirrors()  # a mirror of this page's earlier contents would be read as its own

    def copy_pages(self, sources: list[int], targets: list[int]) -> None:
        """Every layer's keys and values of pages ``sources`` into pages ``targets`` (in pairs)."""
        src = torch.tensor(sources, dtype=torch.long, device=self.device)
        dst = torch.tensor(targets, dtype=torch.long, device=self.device)
        for store in (*self.keys, *self.values):
            store.index_copy_(1, dst, store.index_select(1, src))

    def view(self, batch: PagedBatch) -> PagedView:
        """The cache as one forward step sees it (pass it to ``Transformer.forward``)."""
        return PagedView(self, batch)


class PagedView:
    """One step's window on a ``PagedKVCache``, and the layout of its forward: writes the step's
    keys, attends each sequence. The index tensors and masks are built once here and reused by
    every layer.
    """

    row_products = False

    def __init__(self, cache: PagedKVCache, batch: PagedBatch) -> None:
        self.cache = cache
        self.batch = batch
        # What attention reads: the batch's own pages, or (a type read converted) its pages
        # gathered into a small pool of their own, numbered anew (``_read_pages``).
        self._runs = batch.runs
        self._first_page = batch.single_first_page
        self._single_key = batch.single_key
        self._read: torch.Tensor | None = None
        page_size = cache.page_size
        self._single_pages: torch.Tensor | None = None
        self._single_mask: torch.Tensor | None = None
        if batch.singles:
            tables = batch.single_tables
            assert tables is not None
            width = batch.single_kv_len or tables.shape[1] * page_size
            keys = torch.arange(width, device=cache.device)
            self._single_pages = tables.reshape(-1)
            if batch.singles > 1 or batch.single_kv_len is None:
                # (singles, 1, 1, keys): each row sees the keys up to its own position.
                self._single_mask = (keys.view(1, width) <= batch.positions[:batch.singles].view(-1, 1)).view(
                    batch.singles, 1, 1, width)
        self._run_masks: list[torch.Tensor | None] = []
        for first, length, table, start in batch.runs:
            if start == 0:
                self._run_masks.append(None)  # a fresh prompt: plain causal attention over its own keys
                continue
            width = start + length
            keys = torch.arange(width, device=cache.device)
            positions = batch.positions[first:first + length]
            self._run_masks.append((keys.view(1, width) <= positions.view(length, 1)).view(1, 1, length, width))

    def layout(self, positions: torch.Tensor) -> PagedView:
        """The view itself: its batch says where every token is (``positions`` are its own)."""
        return self

    def between_layers(self) -> None:
        interrupt.check()  # a long prompt's chunk stops soon after a cancel

    @property
    def one_run(self) -> bool:
        """Whether the step is one sequence's run of tokens (a prompt's chunk, which may go in pieces)."""
        return not self.batch.singles and len(self.batch.runs) == 1

    def piece(self, start: int, stop: int) -> PagedView:
        """The view of tokens ``[start, stop)`` of a step of one run, once those before are written."""
        batch = self.batch
        (_, _, table, position), = batch.runs
        pages = -(-(position + stop) // self.cache.page_size)
        run = ((0, stop - start, table[:pages], position + start),)
        return PagedView(self.cache, PagedBatch(batch.slots[start:stop], batch.positions[start:stop], 0, None, run))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rule: ops.AttentionRule = ops.PLAIN_ATTENTION) -> torch.Tensor:
        """Store ``k``/``v`` (``(1, kv_heads, tokens, head_dim)``) at the step's slots, then attend.

        ``q`` is ``(1, heads, tokens, head_dim)``; returns the same shape. No host sync: every
        shape comes from the batch's Python ints and the tables' sizes. A layer with its own
        ``rule`` (a window, a soft cap) attends through ``_attend_ruled``.
        """
        cache, batch = self.cache, self.batch
        store_k, store_v = cache.keys[layer], cache.values[layer]
        kv_heads, num_pages, page_size, row = store_k.shape
        flat_k = store_k.view(kv_heads, num_pages * page_size, row)
        flat_v = store_v.view(kv_heads, num_pages * page_size, row)
        if cache.reads_as(q.dtype):
            flat_k.index_copy_(1, batch.slots, k[0])
            flat_v.index_copy_(1, batch.slots, v[0])
        else:
            kind = cache.kv_type
            flat_k.index_copy_(1, batch.slots, kind.store(k[0], keys=True, center=cache.key_center(layer, 1)))
            flat_v.index_copy_(1, batch.slots, kind.store(v[0], keys=False))
            store_k, store_v = self._read_pages(layer, store_k, store_v, q.dtype)
        head_dim = q.shape[-1]
        if not rule.plain:
            return self._attend_ruled(store_k, store_v, q, rule)

        parts = []
        if batch.singles:
            n = batch.singles
            pages = self._single_pages
            first_page = self._first_page
            if first_page is not None:  # one row over consecutive pages: a view, no copy
                last_page = first_page + pages.numel()
                keys = store_k[:, first_page:last_page].reshape(kv_heads, -1, head_dim).unsqueeze(0)
                values = store_v[:, first_page:last_page].reshape(kv_heads, -1, head_dim).unsqueeze(0)
            elif self._single_mask is not None and q.device.type == "cpu" and not torch.compiler.is_compiling():
                # (Eager steps only: a graph keeps no buffer of the pool's, whose size would be a guard.)
                mirrored = None
                if self._single_key is not None:
                    mirrored = cache.mirror(layer, self._single_key, pages, batch.single_mirror_slots,
                                            k[0, :, :n], v[0, :, :n])
                if self._read is not None:
                    mirrored = (store_k.index_select(1, pages), store_v.index_select(1, pages))
                elif mirrored is None:
                    mirrored = cache.gather_buffers(pages.numel())
                    torch.index_select(store_k, 1, pages, out=mirrored[0])
                    torch.index_select(store_v, 1, pages, out=mirrored[1])
                parts.append(self._attend_rows_by_head(q[0, :, :n], *mirrored))
                keys = None
            else:
                # (kv_heads, n * width, page, dim) -> (n, kv_heads, width * page, dim)
                keys = store_k.index_select(1, pages).view(kv_heads, n, -1, head_dim).transpose(0, 1)
                values = store_v.index_select(1, pages).view(kv_heads, n, -1, head_dim).transpose(0, 1)
            if keys is not None:
                if batch.single_kv_len is not None:
                    keys, values = keys[:, :, :batch.single_kv_len], values[:, :, :batch.single_kv_len]
                queries = q[0, :, :n].transpose(0, 1).unsqueeze(2)  # (n, heads, 1, dim)
                out = ops.attention(queries, keys, values, self._single_mask)  # (n, heads, 1, dim)
                parts.append(out.squeeze(2).transpose(0, 1).unsqueeze(0))  # (1, heads, n, dim)
        for (first, length, table, start), mask in zip(self._runs, self._run_masks):
            end = start + length  # the keys this run reads: its sequence's, up to its last token
            keys = store_k.index_select(1, table).view(1, kv_heads, -1, head_dim)[:, :, :end]
            values = store_v.index_select(1, table).view(1, kv_heads, -1, head_dim)[:, :, :end]
            chunk = q[:, :, first:first + length]
            own = self._own_attention(chunk, keys, values, start, ops.PLAIN_ATTENTION)
            parts.append(own if own is not None else ops.chunk_attention(chunk, keys, values, start, mask))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def _own_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                       rule: ops.AttentionRule) -> torch.Tensor | None:
        """A prompt chunk's attention by the CPU operator (``ops.own_prompt_attention``, bfloat16
        products) where the pages hold fewer bits than the model computes in (the CPU's default
        float16 pages): a float32 cache asked for is attended in float32."""
        if self.cache.reads_as(q.dtype):
            return None
        return ops.own_prompt_attention(q, keys, values, start, rule)

    def _read_pages(self, layer: int, store_k: torch.Tensor, store_v: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages this step reads of a layer, converted to ``dtype``, as a pool of their own
        ``(kv_heads, pages read, page_size, head_dim)``; the first call renumbers the step's
        tables into it, once for every layer. Only the pages read are converted, never the pool."""
        if self._read is None:
            tables = [t for t in (self._single_pages, *(run[2] for run in self.batch.runs)) if t is not None]
            self._read = torch.unique(torch.cat(tables))  # sorted
            if self._single_pages is not None:
                self._single_pages = torch.searchsorted(self._read, self._single_pages)
            self._runs = tuple((first, length, torch.searchsorted(self._read, table), start)
                               for first, length, table, start in self.batch.runs)
            self._first_page = self._single_key = None
        kind = self.cache.kv_type
        return (kind.load(store_k.index_select(1, self._read), dtype, keys=True, center=self.cache.key_center(layer, 2)),
                kind.load(store_v.index_select(1, self._read), dtype, keys=False))

    def _attend_ruled(self, store_k: torch.Tensor, store_v: torch.Tensor, q: torch.Tensor,
                      rule: ops.AttentionRule) -> torch.Tensor:
        """``attend`` for a layer with a rule: every row's keys gathered from its pages and each
        query's visible keys worked out from its position (``ops.visible_keys``), the window's
        included. The plain layers' shortcuts (the mirror, unmasked lone rows) are not taken."""
        batch = self.batch
        kv_heads, _, _, head_dim = store_k.shape
        parts = []
        if batch.singles:
            n = batch.singles
            keys = store_k.index_select(1, self._single_pages).view(kv_heads, n, -1, head_dim).transpose(0, 1)
            values = store_v.index_select(1, self._single_pages).view(kv_heads, n, -1, head_dim).transpose(0, 1)
            width = batch.single_kv_len or keys.shape[2]
            keys, values = keys[:, :, :width], values[:, :, :width]
            seen = ops.visible_keys(batch.positions[:n].view(n, 1), torch.arange(width, device=q.device), rule.window)
            out = ops.ruled_attention(q[0, :, :n].transpose(0, 1).unsqueeze(2), keys, values, seen, rule)
            parts.append(out.squeeze(2).transpose(0, 1).unsqueeze(0))
        for first, length, table, start in self._runs:
            end = start + length
            keys = store_k.index_select(1, table).view(1, kv_heads, -1, head_dim)[:, :, :end]
            values = store_v.index_select(1, table).view(1, kv_heads, -1, head_dim)[:, :, :end]
            chunk = q[:, :, first:first + length]
            own = self._own_attention(chunk, keys, values, start, rule)
            parts.append(own if own is not None else ops.ruled_run_attention(chunk, keys, values, start, rule))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def _attend_rows_by_head(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The one-token rows' attention on the CPU, over their gathered pages, key head first.

        ``q`` is ``(heads, rows, dim)``; ``keys`` and ``values`` are the gathered pages
        ``(kv_heads, rows * width, page, dim)``. Kept in that order, each (key head, row) pair's
        keys are one contiguous matrix, so the two products read them in place: the row-first
        order asked each product to copy every gathered key and value first, which cost four
        times the attention itself at 16 rows. Two products and a float32 softmax, as in
        ``ops.attention_over_cache``, under each row's mask. Returns ``(1, heads, rows, dim)``.
        """
        heads, rows, head_dim = q.shape
        kv_heads = keys.shape[0]
        n_rep = heads // kv_heads
        width = self._single_mask.shape[-1]
        keys = keys.view(kv_heads, rows, -1, head_dim)[:, :, :width]
        values = values.view(kv_heads, rows, -1, head_dim)[:, :, :width]
        grouped = q.view(kv_heads, n_rep, rows, head_dim).transpose(1, 2)  # (kv_heads, rows, n_rep, dim)
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * (1.0 / math.sqrt(head_dim))
        scores = scores.masked_fill(~self._single_mask.view(1, rows, 1, width), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values)  # (kv_heads, rows, n_rep, dim)
        return out.transpose(1, 2).reshape(heads, rows, head_dim).unsqueeze(0)

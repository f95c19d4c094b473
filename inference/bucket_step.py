"""The decode step of many jobs through the page pool, as one compiled graph per batch bucket.

The packed paged step (``batch_step.PackedForward``) with static shapes pads a step's one-token
rows to a power of two and their block tables to a power of two of pages; its shapes still change
as the jobs' contexts grow, and it runs eagerly. Here a step of one-token rows only is padded to
the next bucket of ``BUCKETS`` and every row's table to the whole context's pages, so that its
shapes are its bucket's alone: jobs joining, leaving or moving on a position change what the
buffers hold, never a shape, and the bucket's graph runs again without a recompile (on CUDA, a
graph that CUDA graphs can replay). Tokens, positions, slots and tables live in buffers made
once per bucket and filled in place. Inside the graph, attention gathers each row's pages through
its table and masks the keys past its position (``PagedView``), and the greedy picks are made.

Padding rows read and write the scratch page at position 0, as the packed step's do. A compile
that fails (an unsupported cache type, a backend missing) is said once, and the step is then the
packed step's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llama_chat.inference.decode_step import compile_failure_text
from llama_chat.model.paged_kv_cache import SCRATCH_PAGE, PagedBatch, PagedKVCache
from llama_chat.model.transformer import Transformer

# The batch sizes a step's rows are padded to: each has its graph, compiled at its first step.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket_of(rows: int) -> int | None:
    """The smallest bucket that holds ``rows`` rows; None past the largest."""
    return next((b for b in BUCKETS if b >= rows), None)


class BucketSteps:
    """``logits(rows)``: one decode step of one-token rows ``(token, position, pages)``, through
    the bucket's compiled graph; the logits and greedy picks of the rows, or None (too many rows,
    or compiling failed)."""

    def __init__(self, model: Transformer, cache: PagedKVCache, *, max_seq_len: int, sample_ids: int | None,
                 backend: str = "inductor", mode: str | None = None) -> None:
        self.model = model
        self.cache = cache
        self.page_size = cache.page_size
        self.width = -(-max_seq_len // cache.page_size)  # every row's table: the whole context's pages
        self.sample_ids = sample_ids
        self.failure: str | None = None
        self.buckets_run: set[int] = set()  # the buckets whose graph has run
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        try:
            self._run = torch.compile(self._forward, backend=backend, mode=mode, fullgraph=True, dynamic=False)
        except Exception as exc:  # noqa: BLE001 - a backend or mode unknown here: the packed step
            self.failure = compile_failure_text(exc)
        model.rope_tables(cache.device)  # built now, or the first trace would guard on its absence

    def logits(self, rows: Sequence[tuple[int, int, Sequence[int]]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        size = bucket_of(len(rows))
        if size is None or self.failure is not None:
            return None
        tokens, positions, slots, tables = self._bucket(size)
        page = self.page_size
        # Filled on the host, then copied into the bucket's buffers: their addresses never change.
        host_tables = torch.full((size, self.width), SCRATCH_PAGE, dtype=torch.long)
        values = torch.zeros(3, size, dtype=torch.long)
        values[2].fill_(SCRATCH_PAGE * page)
        for r, (token, position, pages) in enumerate(rows):
            values[0, r], values[1, r] = token, position
            values[2, r] = pages[position // page] * page + position % page
            host_tables[r, :len(pages)] = torch.tensor(pages[:self.width], dtype=torch.long)
        tokens.copy_(values[0], non_blocking=True)
        positions.copy_(values[1], non_blocking=True)
        slots.copy_(values[2], non_blocking=True)
        tables.copy_(host_tables, non_blocking=True)
        try:
            logits, picks = self._run(tokens, positions, slots, tables)
        except Exception as exc:  # noqa: BLE001 - any compiler failure means the same: the packed step
            self.failure = compile_failure_text(exc)
            return None
        self.buckets_run.add(size)
        return logits[:len(rows)], picks[:len(rows)]

    def _bucket(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        buffers = self._buffers.get(size)
        if buffers is None:
            device = self.cache.device
            buffers = (torch.zeros(size, dtype=torch.long, device=device),
                       torch.zeros(size, dtype=torch.long, device=device),
                       torch.zeros(size, dtype=torch.long, device=device),
                       torch.zeros(size, self.width, dtype=torch.long, device=device))
            self._buffers[size] = buffers
        return buffers

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = tokens.shape[0]
        batch = PagedBatch(slots, positions, rows, tables, ())
        logits = self.model(tokens.view(1, rows), positions.view(1, rows), self.cache.view(batch),
                            logits_at=torch.arange(rows, device=tokens.device))[0]
        return logits, logits[:, :self.sample_ids].argmax(dim=-1)


__all__ = ["BUCKETS", "BucketSteps", "bucket_of"]

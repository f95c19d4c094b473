"""The decode step of many jobs through the page pool, as one compiled graph per batch bucket.

The packed paged step (``batch_step.PackedForward``) with static shapes pads a step's one-token
rows to a power of two and their block tables to a power of two of pages; its shapes still change
as the jobs' contexts grow, and it runs eagerly. Here a step of one-token rows only is padded to
the next bucket of ``BUCKETS`` and every row's table to the whole context's pages, so that its
shapes are its bucket's alone: jobs joining, leaving or moving on a position change what the
buffers hold, never a shape, and the bucket's graph runs again without a recompile (on CUDA, a
graph that CUDA graphs can replay). Tokens, positions, slots and tables live in buffers made
once per bucket and filled in place. Inside the graph, attention gathers each row's pages through
its table and masks the keys past its position (``PagedView``), and the rows are drawn: greedy
picks, and rows sampled with temperature and top-p alone drawn with their own uniforms as the host
sampler draws them (``sampling.sample_in_graph``: the same token for the same uniform). A step
with such rows runs its bucket's second graph, which draws; rows with other controls (penalties,
top-k, a grammar) are drawn on the host from their logits.

Padding rows read and write the scratch page at position 0, as the packed step's do. A compile
that fails (an unsupported cache type, a backend missing) is kept as ``failure``, and every step
is then the packed step's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llama_chat.inference.decode_step import compile_failure_text
from llama_chat.ml.sampling import SamplingMode, SamplingParams, sample_in_graph
from llama_chat.model.paged_kv_cache import SCRATCH_PAGE, PagedBatch, PagedKVCache
from llama_chat.model.transformer import Transformer

# The batch sizes a step's rows are padded to: each has its graph, compiled at its first step.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# How a row is drawn in the graph: its greedy pick (also the rows the host draws), or sampled.
_MODES = {SamplingMode.GREEDY: 0, SamplingMode.FULL: 1, SamplingMode.NUCLEUS: 2}

# One row of a step: its token, position, pages, and how the graph draws it (None: its greedy
# pick) with its uniform.
Row = tuple[int, int, Sequence[int], "SamplingParams | None", float]


def bucket_of(rows: int) -> int | None:
    """The smallest bucket that holds ``rows`` rows; None past the largest."""
    return next((b for b in BUCKETS if b >= rows), None)


class BucketSteps:
    """``logits(rows)``: one decode step of one-token rows (``Row``) through the bucket's compiled
    graph; the rows' logits and their draws, or None (too many rows, or compiling failed)."""

    def __init__(self, model: Transformer, cache: PagedKVCache, *, max_seq_len: int, sample_ids: int | None,
                 backend: str = "inductor", mode: str | None = None) -> None:
        self.model = model
        self.cache = cache
        self.page_size = cache.page_size
        self.width = -(-max_seq_len // cache.page_size)  # every row's table: the whole context's pages
        self.sample_ids = sample_ids
        self.failure: str | None = None
        self.buckets_run: set[tuple[int, bool]] = set()  # (bucket, draws sampled rows) of each graph run
        self._buffers: dict[int, tuple[torch.Tensor, ...]] = {}
        try:
            self._run = torch.compile(self._forward, backend=backend, mode=mode, fullgraph=True, dynamic=False)
        except Exception as exc:  # noqa: BLE001 - a backend or mode unknown here: the packed step
            self.failure = compile_failure_text(exc)
        model.rope_tables(cache.device)  # built now, or the first trace would guard on its absence

    def logits(self, rows: Sequence[Row]) -> tuple[torch.Tensor, torch.Tensor] | None:
        size = bucket_of(len(rows))
        if size is None or self.failure is not None:
            return None
        tokens, positions, slots, tables, modes, temperature, top_p, uniform = self._bucket(size)
        page = self.page_size
        # Filled on the host, then copied into the bucket's buffers: their addresses never change.
        host_tables = torch.full((size, self.width), SCRATCH_PAGE, dtype=torch.long)
        values = torch.zeros(4, size, dtype=torch.long)
        values[2].fill_(SCRATCH_PAGE * page)
        draws = torch.ones(2, size, dtype=torch.float32)  # temperature, top-p: 1 where unused
        uniforms = torch.zeros(size, dtype=torch.float64)
        for r, (token, position, pages, params, u) in enumerate(rows):
            values[0, r], values[1, r] = token, position
            values[2, r] = pages[position // page] * page + position % page
            host_tables[r, :len(pages)] = torch.tensor(pages[:self.width], dtype=torch.long)
            if params is not None:
                values[3, r] = _MODES[SamplingMode.of(params)]
                draws[0, r], draws[1, r], uniforms[r] = params.temperature, params.top_p, u
        sampling = bool(values[3].any())
        for buffer, value in ((tokens, values[0]), (positions, values[1]), (slots, values[2]), (modes, values[3]),
                              (tables, host_tables), (temperature, draws[0]), (top_p, draws[1]), (uniform, uniforms)):
            buffer.copy_(value, non_blocking=True)
        try:
            logits, picks = self._run(tokens, positions, slots, tables, sampling, modes, temperature, top_p, uniform)
        except Exception as exc:  # noqa: BLE001 - any compiler failure means the same: the packed step
            self.failure = compile_failure_text(exc)
            return None
        self.buckets_run.add((size, sampling))
        return logits[:len(rows)], picks[:len(rows)]

    def _bucket(self, size: int) -> tuple[torch.Tensor, ...]:
        buffers = self._buffers.get(size)
        if buffers is None:
            device = self.cache.device

            def zeros(*shape, dtype=torch.long) -> torch.Tensor:
                return torch.zeros(*shape, dtype=dtype, device=device)

            buffers = (zeros(size), zeros(size), zeros(size), zeros(size, self.width), zeros(size),
                       zeros(size, dtype=torch.float32), zeros(size, dtype=torch.float32),
                       zeros(size, dtype=torch.float64))
            self._buffers[size] = buffers
        return buffers

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                 sampling: bool, modes: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = tokens.shape[0]
        batch = PagedBatch(slots, positions, rows, tables, ())
        logits = self.model(tokens.view(1, rows), positions.view(1, rows), self.cache.view(batch),
                            logits_at=torch.arange(rows, device=tokens.device))[0]
        candidates = logits[:, :self.sample_ids]
        picks = candidates.argmax(dim=-1)
        if sampling:  # a graph of its own (``sampling`` is a constant to dynamo): greedy steps skip the sorts
            t, p = temperature.view(rows, 1), top_p.view(rows, 1)
            full = sample_in_graph(candidates, SamplingMode.FULL, t, p, uniform)
            nucleus = sample_in_graph(candidates, SamplingMode.NUCLEUS, t, p, uniform)
            picks = torch.where(modes == 0, picks, torch.where(modes == 1, full, nucleus))
        return logits, picks


__all__ = ["BUCKETS", "BucketSteps", "Row", "bucket_of"]

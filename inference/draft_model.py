"""A draft model's steps: its own page pool, each job's guesses made greedily, rolled back by counting.

A draft model (``Speculation.draft``) is any model with the target's vocabulary, usually a smaller
one of its family. A drafting job holds pages of the draft model's own pool, as many as it may
write in the target's (the same page size: its prompt and budget), taken at its first draft and
given back with its own (``BatchCore._release``); they are never shared, for the pool only serves
guesses. A draft of k tokens is k steps of the draft model's CPU operator, one row per drafting
job; the first also feeds, as rows, the job's tokens the draft model has not seen yet (the prompt
at the first draft, then the tokens the target kept beyond the last draft). Its greedy picks are
the draft; the target verifies it as any other (``batch_step.verify``), so nothing the draft model
computes decides what a job keeps.
"""

from __future__ import annotations

import torch

from llama_chat.inference.page_table import PageTable
from llama_chat.inference.speculative import ModelDraft
from llama_chat.model import cpu_decode
from llama_chat.model.key_centers import KeyCenters
from llama_chat.model.kv_types import KVType
from llama_chat.model.paged_kv_cache import SCRATCH_PAGE, PagedKVCache

# Most rows of tokens the draft model has not seen in one call of its operator: a long prompt is
# caught up in a few calls, each as long as a few decode steps (as the target's prompt chunks).
CATCH_UP_ROWS = 64


def guess_share(draft, model) -> float:
    """What a guess of ``draft`` is taken to cost, as a share of a step of ``model``, until the
    two have been timed (``speculative.DraftCosts``): a decode step reads every weight once."""
    return weight_bytes(draft) / weight_bytes(model)


def weight_bytes(model) -> int:
    """The bytes of a model's tensors, each storage once (a tied embedding is the classifier)."""
    sizes: dict[int, int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        sizes[tensor.data_ptr()] = max(sizes.get(tensor.data_ptr(), 0), tensor.numel() * tensor.element_size())
    return sum(sizes.values())


class DraftRunner:
    """The draft model over its page pool; ``make`` returns None where its CPU operator does not
    take it (drafts are then never made: no other path gives the same greedy picks as cheaply)."""

    def __init__(self, model, cache: PagedKVCache, decoder: cpu_decode.PagedDecoder, sample_ids: int | None) -> None:
        self.model = model
        self.cache = cache
        self.pages = PageTable(cache.num_pages, cache)
        self.decoder = decoder
        self.page_size = cache.page_size
        self.sample_ids = sample_ids
        self.max_seq_len = model.args.max_seq_len  # its rotary table's length

    @classmethod
    def make(cls, model, *, num_pages: int, page_size: int, kv_type: KVType | torch.dtype,
             sample_ids: int | None, centers: KeyCenters | None = None) -> DraftRunner | None:
        """In the step thread (in inference mode: the operator's check reads it). The pages keep
        the target's type where the draft model's heads allow it, else float32."""
        if isinstance(kv_type, KVType):
            try:
                kv_type.check(model.args.head_dim)
            except ValueError:
                kv_type = torch.float32
        cache = PagedKVCache.for_model(model.args, num_pages, page_size, dtype=kv_type)
        cache.center_keys_by(centers)
        decoder = cpu_decode.operator_for(model, cache)
        if decoder is None:
            return None
        return cls(model, cache, decoder, sample_ids)

    def place(self, draft: ModelDraft, positions: int) -> bool:
        """Pages for a job that may write ``positions`` positions, at its first draft; False
        while the pool has too few free (the job drafts when it has)."""
        if draft.pages:
            return True
        need = -(-positions // self.page_size)
        if need > self.pages.available:
            return False
        draft.pages = sorted(self.pages.allocate(need))
        return True

    def release(self, draft: ModelDraft) -> None:
        self.pages.release(draft.pages)
        draft.pages = []
        draft.written.clear()
        draft.agreed = 0

    def drafts(self, asks: list[tuple[ModelDraft, list[int], int]]) -> list[list[int]]:
        """For each ``(draft, tokens, k)``: ``k`` greedy tokens of the draft model after the job's
        ``tokens``, its pages first rolled back to what agrees with them and caught up."""
        guesses: list[list[int]] = [[] for _ in asks]
        for draft, tokens, _ in asks:
            draft.rollback(tokens)
        # Catch up: every token not yet written, the last one's pick being the first guess.
        while True:
            rows: list[tuple[int, list[int], int, int]] = []  # (ask, pages, position, token)
            last: list[int] = []  # the asks whose row is their job's last token, in row order
            budget = CATCH_UP_ROWS
            for i, (draft, tokens, _) in enumerate(asks):
                start = len(draft.written)
                n = min(len(tokens) - start, budget)
                if n <= 0:
                    continue
                rows += [(i, draft.pages, p, tokens[p]) for p in range(start, start + n)]
                draft.written += tokens[start:start + n]
                budget -= n
                if start + n == len(tokens):
                    last.append(len(rows) - 1)
                if budget == 0:
                    break
            if not rows:
                break
            for row, pick in zip(last, self._picks(rows, last)):
                guesses[rows[row][0]].append(pick)
        # Then one row per job still guessing, fed its last guess.
        while True:
            rows = [(i, draft.pages, len(draft.written), guesses[i][-1])
                    for i, (draft, _, k) in enumerate(asks) if len(guesses[i]) < k]
            if not rows:
                break
            for i, _, _, token in rows:
                asks[i][0].written.append(token)
            for (i, *_), pick in zip(rows, self._picks(rows, list(range(len(rows))))):
                guesses[i].append(pick)
        return guesses

    def _picks(self, rows: list[tuple[int, list[int], int, int]], sampled: list[int]) -> list[int]:
        """One operator call over ``rows``; the greedy picks of the ``sampled`` rows, in order."""
        size = self.page_size
        width = max(position // size + 1 for _, _, position, _ in rows)
        tables = [pages[:width] + [SCRATCH_PAGE] * (width - len(pages[:width])) for _, pages, _, _ in rows]
        tokens = [token for *_, token in rows]
        positions = [position for _, _, position, _ in rows]
        if len(rows) == 1:
            return [self.decoder.pick(tokens[0], positions[0], tables[0], self.sample_ids)]
        _, picks = self.decoder.with_picks(tokens, positions, tables, self.sample_ids, sampled)
        return picks[:len(sampled)].tolist()


__all__ = ["CATCH_UP_ROWS", "DraftRunner", "guess_share", "weight_bytes"]

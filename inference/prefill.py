"""Prefill chunks sized by time: as many prompt tokens per forward as fit in a time budget.

A cancel during prefill waits for one layer of the chunk that is running: the forward looks
between layers for the cancel (``model/interrupt.py``). So a chunk may take as long as one
layer's share of the budget times the layers. Each forward reads every weight once, so on a CPU a
small chunk pays that read for few tokens. A fixed token count cannot serve both a 15M model (for
which 64 tokens are a few milliseconds) and a 1B one (for which they are a long wait). The sizer
measures each chunk and makes the next one as long as fits in ``budget_s`` at the rate just seen,
so a slower machine or a busier moment gives shorter chunks at once. ``most`` bounds a chunk's
length; what a chunk holds in memory on the CPU the model bounds itself, taking a long chunk
through its layers in pieces whose activations hold a share of its weights' bytes
(``Transformer.rows_per_forward``).

Chunks never get shorter than the first one (64 tokens on the CPU). Every forward reads all the
weights, so below that a big model's chunk costs about the same time for fewer tokens, and
prefill would only get slower without the cancel getting faster. Where even the shortest chunk's
layer is over the budget, a cancel waits for one such layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Seconds one layer of a prefill forward may take: with a chunk's own spread, a cancel waits about
# 0.2 s. A forward's budget is this times the model's layers.
PREFILL_BUDGET_S = 0.12
# The longest chunk on a CPU (on CUDA: ``PrefillSizer.most``).
CPU_MOST_TOKENS = 512
# Chunk lengths are multiples of this (fewer distinct shapes for the kernels' caches).
CHUNK_STEP = 16


@dataclass
class PrefillSizer:
    """The next chunk's length from the time per token of the chunks before it.

    ``first``: the length before anything was measured, and the shortest chunk. ``most``: the
    longest.
    """

    budget_s: float = PREFILL_BUDGET_S  # for a whole forward (``for_model``: per layer)
    first: int = 64
    most: int = 4096
    seconds_per_token: float | None = field(default=None)

    @classmethod
    def for_model(cls, n_layers: int, *, cuda: bool, first: int) -> PrefillSizer:
        """A sizer for forwards of ``n_layers`` layers, each within ``PREFILL_BUDGET_S``."""
        return cls(budget_s=PREFILL_BUDGET_S * n_layers, first=first, most=4096 if cuda else CPU_MOST_TOKENS)

    def next_size(self) -> int:
        if self.seconds_per_token is None:
            return self.first
        fit = int(self.budget_s / self.seconds_per_token) // CHUNK_STEP * CHUNK_STEP
        return max(self.first, min(self.most, fit))

    def record(self, tokens: int, seconds: float) -> None:
        """One forward of ``tokens`` prompt tokens took ``seconds``."""
        if tokens < CHUNK_STEP or seconds <= 0:
            return  # too short to say much about a chunk's cost
        rate = seconds / tokens
        # The newest chunk counts most (the load on the machine changes), a slow one at once.
        if self.seconds_per_token is None or rate > self.seconds_per_token:
            self.seconds_per_token = rate
        else:
            self.seconds_per_token = 0.5 * (self.seconds_per_token + rate)

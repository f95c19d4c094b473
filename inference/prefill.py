"""Prefill chunks sized by time: as many prompt tokens per forward as fit in a time budget.

A cancel during prefill waits for the chunk that is running, so a chunk must stay short; but each
forward reads every weight once, so on a CPU a small chunk pays that read for few tokens and the
prefill runs below the speed of one whole-prompt forward. A fixed token count cannot serve both
a 15M model (64 tokens take 10 ms) and a 1B one (64 tokens take a second on two cores). The sizer
measures each chunk and makes the next one as long as fits in ``budget_s`` at the rate just seen,
so a slower machine or a busier moment gives shorter chunks at once.

Chunks never get shorter than the first one (64 tokens on the CPU). Every forward reads all the
weights, so below that a big model's chunk costs about the same time for fewer tokens: a 1.1B
model on two cores takes over a second for 16 tokens as for 64, and prefill would only get
slower without the cancel getting faster. Where even the shortest chunk is over the budget,
a cancel waits for one such chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Seconds one prefill forward may take: with a chunk's own spread, a cancel waits about 0.2 s.
PREFILL_BUDGET_S = 0.12
# Chunk lengths are multiples of this (fewer distinct shapes for the kernels' caches).
CHUNK_STEP = 16


@dataclass
class PrefillSizer:
    """The next chunk's length from the time per token of the chunks before it.

    ``first``: the length before anything was measured, and the shortest chunk. ``most``: the
    longest.
    """

    budget_s: float = PREFILL_BUDGET_S
    first: int = 64
    most: int = 4096
    seconds_per_token: float | None = field(default=None)

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

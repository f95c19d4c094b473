"""Speculative decoding by prompt lookup: drafts from the job's own tokens, verified in one step.

A job whose last tokens (an n-gram) appeared before in its prompt or its reply drafts the tokens
that followed them then; the step feeds its last token and the draft as rows of one operator call
(``batch_step.OperatorRows``), each row's logits are drawn from as if it had been decoded alone,
and the draft is kept up to the first token the draw disagrees with, plus the drawn token there.
Each position's token is drawn with that position's uniform, by the same sampler (``verify`` in
``batch_step``), so the reply is the reply without speculation, token for token, seeded sampling
included: a draft only decides how many positions one step computes.

The draft's length adapts per job: it grows while drafts are taken whole, shrinks to what was
taken, and after a draft taken not at all the job waits a few steps before drafting again, longer
each time. The scheduler drafts only while few jobs run (``Speculation.most_jobs``): a batch of
many already reads the weights once for all of its rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The n-gram lengths looked up, longest first: a longer match predicts better.
NGRAM_SIZES = (3, 2, 1)
# After a draft of which nothing was taken, steps without drafting: doubled at each such draft
# up to the last, and back to none once a draft is taken.
PAUSES = (0, 1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Speculation:
    """How the scheduler speculates (``SchedulerOptions.speculation``)."""

    draft_max: int = 8  # most tokens drafted for one job in one step
    most_jobs: int = 4  # draft only while at most this many jobs run


@dataclass
class Lookup:
    """One job's n-gram index over its tokens, and its drafting state."""

    draft_max: int
    length: int = 0  # how many of the job's tokens the index has taken
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> index after its last occurrence
    previous: dict[tuple[int, ...], int] = field(default_factory=dict)  # the occurrence before that one
    size: int = 0  # the next draft's length (0: draft_max // 2 at the first)
    pause: int = 0  # steps left without drafting
    pause_level: int = 0
    pending: int = 0  # the length of the draft in the step running
    drafted: int = 0  # counters, for the stats
    accepted: int = 0

    def draft(self, tokens: list[int], room: int) -> list[int]:
        """Up to ``room`` tokens (and the adaptive length) that followed the latest earlier
        occurrence of ``tokens``' last n-gram, longest n first; [] when there is none or the job
        is pausing."""
        self._follow(tokens)
        if self.pause:
            self.pause -= 1
            return []
        if self.size == 0:
            self.size = max(1, self.draft_max // 2)
        want = min(self.size, room)
        if want <= 0:
            return []
        end = len(tokens)
        for n in NGRAM_SIZES:
            if end <= n:
                continue
            key = tuple(tokens[end - n:])
            at = self.ends.get(key)
            if at == end:  # the n-gram's latest occurrence is the tail itself: take the one before
                at = self.previous.get(key)
            if at is not None and at < end:
                return tokens[at:at + want]
        return []

    def taken(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens was verified and ``accepted`` of them kept."""
        self.drafted += drafted
        self.accepted += accepted
        if accepted == drafted:
            self.size = min(self.draft_max, self.size + 2)
            self.pause_level = 0
        else:
            self.size = max(1, accepted + 1)
            if accepted == 0:
                self.pause_level = min(self.pause_level + 1, len(PAUSES) - 1)
                self.pause = PAUSES[self.pause_level]
            else:
                self.pause_level = 0

    def _follow(self, tokens: list[int]) -> None:
        """Index the n-grams that end at each token not indexed yet."""
        for end in range(self.length + 1, len(tokens) + 1):
            for n in NGRAM_SIZES:
                if end >= n:
                    key = tuple(tokens[end - n:end])
                    last = self.ends.get(key)
                    if last is not None:
                        self.previous[key] = last
                    self.ends[key] = end
        self.length = len(tokens)


__all__ = ["Lookup", "NGRAM_SIZES", "Speculation"]

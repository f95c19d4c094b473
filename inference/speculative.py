"""Speculative decoding: drafts from the job's own tokens (prompt lookup) or from a small model of
the same vocabulary (a draft model), verified in one step.

A job whose last tokens (an n-gram) appeared before in its prompt or its reply drafts the tokens
that followed them then (``Lookup``); with a draft model, a job that has no such draft takes the
draft model's greedy guesses instead (``ModelDraft``, run by ``inference/draft_model.py``). The
step feeds the job's last token and the draft as rows of one operator call
(``batch_step.OperatorRows``), each row's logits are drawn from as if it had been decoded alone,
and the draft is kept up to the first token the draw disagrees with, plus the drawn token there.
Each position's token is drawn with that position's uniform, by the same sampler (``verify`` in
``batch_step``), so the reply is the reply without speculation, token for token, seeded sampling
included: a draft only decides how many positions one step computes.

Either way the draft is only a guess: a draft model's probabilities are never used to accept or
reject (as rejection sampling would), for the draw at each position is the one the job would make
alone, and so the reply cannot change.

The draft's length adapts per job and per drafter (``Pace``): it grows while drafts are taken
whole, shrinks to what was taken, and after a draft taken not at all the job waits a few steps
before drafting again, longer each time. The scheduler drafts only while few jobs run (``Speculation.most_jobs``): a batch of
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

    draft_max: int = 8  # most tokens drafted for one job in one step (a request may ask fewer or more)
    most_jobs: int = 4  # draft only while at most this many jobs run
    lookup: bool = True  # prompt lookup for jobs whose request does not say (``Request.lookup``)
    # A model of the same vocabulary whose greedy tokens are the drafts where lookup has none
    # (a ``Transformer``; its pages and steps: ``inference/draft_model.py``).
    draft: object | None = None


@dataclass
class Pace:
    """How long a drafter's next draft is, for one job: it grows by two while drafts are kept
    whole, shrinks to what was kept, and after a draft of which less than ``keep_share`` was kept
    (0: nothing) the job waits ``PAUSES`` steps, longer each time."""

    draft_max: int
    keep_share: float = 0.0
    size: int = 0  # the next draft's length (0: draft_max // 2 at the first)
    pause: int = 0  # steps left without drafting
    pause_level: int = 0
    pending: int = 0  # the length of the draft in the step running
    drafted: int = 0  # counters, for the stats
    accepted: int = 0

    def want(self, room: int) -> int:
        """The next draft's length within ``room``: 0 while pausing (a step counted off)."""
        if self.pause:
            self.pause -= 1
            return 0
        if self.size == 0:
            self.size = max(1, self.draft_max // 2)
        return max(0, min(self.size, room))

    def taken(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens was verified and ``accepted`` of them kept."""
        self.drafted += drafted
        self.accepted += accepted
        if accepted == drafted:
            self.size = min(self.draft_max, self.size + 2)
            self.pause_level = 0
        else:
            self.size = max(1, accepted + 1)
            if accepted == 0 or accepted < self.keep_share * drafted:
                self.pause_level = min(self.pause_level + 1, len(PAUSES) - 1)
                self.pause = PAUSES[self.pause_level]
            else:
                self.pause_level = 0


@dataclass
class Lookup(Pace):
    """One job's n-gram index over its tokens, and its drafting pace."""

    length: int = 0  # how many of the job's tokens the index has taken
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> index after its last occurrence
    previous: dict[tuple[int, ...], int] = field(default_factory=dict)  # the occurrence before that one

    def draft(self, tokens: list[int], room: int) -> list[int]:
        """Up to ``room`` tokens (and the adaptive length) that followed the latest earlier
        occurrence of ``tokens``' last n-gram, longest n first; [] when there is none or the job
        is pausing."""
        self._follow(tokens)
        want = self.want(room)
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


@dataclass
class ModelDraft(Pace):
    """One job's place in the draft model's page pool, and its drafting pace.

    ``written`` are the tokens whose keys the draft model's pages hold, by position. Its guesses
    past what the job kept are rolled back as the job's own are, by counting: ``rollback`` cuts
    ``written`` to what agrees with the job's tokens, and the keys past it are written again."""

    # A guess costs a step of the draft model, kept or not (a lookup draft costs nothing to
    # make): drafts that did not pay for their guesses pause the job, as a refused one does
    # (the share: ``draft_model.keep_share``, from the two models' sizes).
    keep_share: float = 0.5
    pages: list[int] = field(default_factory=list)
    written: list[int] = field(default_factory=list)
    agreed: int = 0  # a prefix of ``written`` known to be the job's own tokens (which never change)

    def rollback(self, tokens: list[int]) -> None:
        """Keep of ``written`` only what ``tokens`` (the job's tokens so far) begin with."""
        n = min(self.agreed, len(self.written))
        end = min(len(self.written), len(tokens))
        while n < end and self.written[n] == tokens[n]:
            n += 1
        del self.written[n:]
        self.agreed = n


__all__ = ["Lookup", "ModelDraft", "NGRAM_SIZES", "PAUSES", "Pace", "Speculation"]

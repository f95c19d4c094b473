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
whole, shrinks to what was taken, stays within the longest draft whose last token is still
likely to pay for itself, and after a draft that did not pay the job waits a few steps before
drafting again, longer each time. What pays is measured, not assumed (``DraftCosts``): a drafted
token costs its row in the verifying step, and a draft model's guess a call of the draft model,
both timed as the steps run; a kept token saves a step. A draft model that costs as much as the
model itself (or rows that cost as much as steps) so never drafts for long. The scheduler drafts
only while few jobs run (``Speculation.most_jobs``): a batch of many already reads the weights
once for all of its rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The n-gram lengths looked up, longest first: a longer match predicts better.
NGRAM_SIZES = (3, 2, 1)
# After a draft that did not pay, steps without drafting: doubled at each such draft up to the
# last, and back to none once a draft pays.
PAUSES = (0, 1, 2, 4, 8, 16)
# What a drafted token's row adds to a step, as a share of a plain step, until steps have been
# timed (its share of the products' arithmetic: the weights are read once for all rows).
ROW_SHARE_UNTIMED = 0.15
# Where a drafted token costs a step or more (no draft can pay), a draft is still tried after
# this many steps, then after twice as many each time, up to the last: so that what drafting
# costs stays measured (a machine that grows quieter, say), at a share of the steps that shrinks.
PROBE_STEPS = (256, 65536)
# The weight of the newest of the running measures (a step's time, a guess's, the share of a
# job's drafted tokens kept): a few steps' noise averages out, a change shows within a few dozen.
NEWEST_WEIGHT = 0.1


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
class DraftCosts:
    """What drafting costs with this model on this machine, in plain decode steps (one job, one
    row): a drafted token's row verified beside the step's own (``row_share``), and a draft
    model's guess (``guess_share``). Timed from the steps that run while one job decodes alone,
    the case drafts are for: a step's seconds by its rows, and the draft model's seconds per guess.
    Until then: ``ROW_SHARE_UNTIMED``, and ``guess_share_untimed`` (the draft model's weights'
    bytes over the model's, ``draft_model.guess_share``)."""

    guess_share_untimed: float = 0.0
    step_s: dict[int, float] = field(default_factory=dict)  # a step's seconds by its rows, running
    guess_s: float | None = None  # the draft model's seconds per guess, running
    unpaid: int = 0  # drafts not made because they could not pay, since the last probe
    probe_after: int = PROBE_STEPS[0]

    def stepped(self, rows: int, seconds: float) -> None:
        """A step of one job of ``rows`` rows (its last token and its draft) took ``seconds``."""
        old = self.step_s.get(rows)
        self.step_s[rows] = seconds if old is None else old + NEWEST_WEIGHT * (seconds - old)

    def guessed(self, guesses: int, seconds: float) -> None:
        """The draft model made ``guesses`` guesses for one job in ``seconds``."""
        each = seconds / guesses
        self.guess_s = each if self.guess_s is None else self.guess_s + NEWEST_WEIGHT * (each - self.guess_s)

    def _line(self) -> tuple[float | None, float | None]:
        """A plain step's seconds and a row's: the line through the fewest and the most rows timed
        (None where not timed)."""
        if len(self.step_s) < 2:
            return self.step_s.get(1), None
        fewest, most = min(self.step_s), max(self.step_s)
        row = max(0.0, (self.step_s[most] - self.step_s[fewest]) / (most - fewest))
        plain = self.step_s[fewest] - row * (fewest - 1)
        return (plain, row) if plain > 0 else (self.step_s.get(1), None)

    @property
    def row_share(self) -> float:
        plain, row = self._line()
        return ROW_SHARE_UNTIMED if plain is None or row is None else row / plain

    @property
    def guess_share(self) -> float:
        plain, _ = self._line()
        return self.guess_share_untimed if plain is None or self.guess_s is None else self.guess_s / plain

    def per_token(self, pace: Pace) -> float:
        """What one token drafted by ``pace``'s drafter costs, in plain steps (a kept one saves one)."""
        return self.row_share + (self.guess_share if isinstance(pace, ModelDraft) else 0.0)

    def timed(self, pace: Pace) -> bool:
        """Whether what ``pace``'s drafter costs has been timed, not only estimated."""
        plain, row = self._line()
        return row is not None and (self.guess_s is not None or not isinstance(pace, ModelDraft))

    def drafts_now(self, pace: Pace) -> bool:
        """Whether ``pace``'s drafter drafts now: where its tokens were timed at a step or more
        each (no draft can pay), only as a probe, after ``PROBE_STEPS`` asks."""
        if self.per_token(pace) < 1 or not self.timed(pace):
            self.probe_after = PROBE_STEPS[0]
            return True
        self.unpaid += 1
        if self.unpaid < self.probe_after:
            return False
        self.unpaid = 0
        self.probe_after = min(2 * self.probe_after, PROBE_STEPS[1])
        return True


@dataclass
class Pace:
    """How long a drafter's next draft is, for one job: it grows by two while drafts are kept
    whole, shrinks to what was kept, and never passes ``longest_paying``; after a draft that did
    not pay for its tokens (``cost`` each, in plain steps: ``DraftCosts.per_token``) the job waits
    ``PAUSES`` steps, longer each time."""

    draft_max: int
    size: int = 0  # the next draft's length (0: draft_max // 2 at the first)
    pause: int = 0  # steps left without drafting
    pause_level: int = 0
    pending: int = 0  # the length of the draft in the step running
    drafted: int = 0  # counters, for the stats
    accepted: int = 0
    kept_run: float = 0.0  # drafted tokens kept and refused (one at most a draft), running sums
    refused_run: float = 0.0

    def want(self, room: int, cost: float) -> int:
        """The next draft's length within ``room``: 0 while pausing (a step counted off)."""
        if self.pause:
            self.pause -= 1
            return 0
        if self.size == 0:
            self.size = max(1, self.draft_max // 2)
        return max(0, min(self.size, self.longest_paying(cost), room))

    def longest_paying(self, cost: float) -> int:
        """The longest draft whose last token still pays for itself: with each token kept, as
        far as the job's drafts say, with probability p once the one before it was (the i-th
        then with p**i), the i-th pays while p**i > cost. At least 1: a draft that cannot pay is
        still tried after each pause, so that a change (a grounded passage, a quieter machine)
        is found."""
        if cost >= 1:
            return 1
        seen = self.kept_run + self.refused_run
        if seen == 0 or cost <= 0:
            return self.draft_max
        p = self.kept_run / seen
        if p <= cost:
            return 1
        if p >= 1:
            return self.draft_max
        return max(1, min(self.draft_max, int(math.log(cost) / math.log(p))))

    def taken(self, drafted: int, accepted: int, cost: float) -> None:
        """A draft of ``drafted`` tokens, ``cost`` plain steps each, was verified and ``accepted``
        of them kept (each kept one saves a step)."""
        self.drafted += drafted
        self.accepted += accepted
        keep = 1 - NEWEST_WEIGHT
        self.kept_run = keep * self.kept_run + accepted
        self.refused_run = keep * self.refused_run + (accepted < drafted)
        self.size = min(self.draft_max, self.size + 2) if accepted == drafted else max(1, accepted + 1)
        if accepted == 0 or accepted < cost * drafted:
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

    def draft(self, tokens: list[int], room: int, cost: float) -> list[int]:
        """Up to ``room`` tokens (and the adaptive length, ``cost`` a drafted token) that followed
        the latest earlier occurrence of ``tokens``' last n-gram, longest n first; [] when there is
        none or the job is pausing."""
        self._follow(tokens)
        want = self.want(room, cost)
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


__all__ = ["DraftCosts", "Lookup", "ModelDraft", "NGRAM_SIZES", "PAUSES", "PROBE_STEPS", "Pace", "ROW_SHARE_UNTIMED", "Speculation"]

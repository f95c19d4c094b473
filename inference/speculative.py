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

A lookup draft copies what followed the longest earlier match of the job's last tokens, in its
prompt or its reply, and how long it is and whether it is made at all depend on that match alone:
on its length, and on how many of the drafts from matches of that length were kept lately
(``Lookup``). Misses in new text (short matches) so never stop the drafts of a copied span (a
long match) that follows. A draft model's draft adapts per job (``Pace``): it grows while drafts
are taken whole, shrinks to what was taken, stays within the longest draft whose last token is
still likely to pay for itself, and after a draft that did not pay the job waits a few steps
before drafting again, longer each time. What pays is measured, not assumed (``DraftCosts``): a
drafted token costs its row in the verifying step, and a draft model's guess a call of the draft
model, both timed as the steps run; a kept token saves a step. A draft model that costs as much as
the model itself (or rows that cost as much as steps) so never drafts for long. The scheduler
drafts only while few jobs run (``Speculation.most_jobs``): a batch of many already reads the
weights once for all of its rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The n-gram lengths indexed, longest first: a longer match predicts better. Matches of the
# longest are followed back further, up to ``LONGEST_MATCH`` tokens.
NGRAM_SIZES = (3, 2, 1)
# A match is measured up to this many tokens: past it, a copy is as likely to go on whatever its length.
LONGEST_MATCH = 32
# The earlier occurrences of the last n-gram followed back, latest first: a common one (an
# indent, a keyword) occurs hundreds of times in a long prompt, and each costs a comparison a step.
MOST_CANDIDATES = 64
# Matches are judged by the drafts of matches of about their length: these lengths start each class.
MATCH_CLASSES = (1, 2, 3, 4, 6, 8, 12, 16, 24, LONGEST_MATCH)
# How many drafts the expected share of a match's class weighs against its evidence: a class no
# draft of the job (or of every job) has come from is judged by its length alone.
PRIOR_DRAFTS = 2.0
# A match at least this long drafts one token where its rows were timed at a step a token or
# more (nothing shorter does), and its class then pauses: a cost read on a busier moment is timed
# again, and a copy found again once the rows pay.
STRONG_MATCH = 8
# A draft model's first draft for a job, before its drafts have been kept or refused: short, for
# each guess is a call of the draft model, and a draft may grow by two a step from here.
FIRST_DRAFT = 4
# The row count whose steps are timed most (a job decoding alone, no draft): the others' times move with its.
LOAD_FOLLOWED = 1
# After a draft that did not pay, steps without drafting: doubled at each such draft up to the
# last, and back to none once a draft pays.
PAUSES = (0, 1, 2, 4, 8, 16, 32)
# What a drafted token's row adds to a step, as a share of a plain step, until steps have been
# timed (its share of the products' arithmetic: the weights are read once for all rows).
ROW_SHARE_UNTIMED = 0.15
# A draft model's guesses are timed this many times before its cost decides whether it drafts.
GUESSES_TIMED = 3
# The weight of the newest of the running measures (a step's time, a guess's, the share of a
# job's drafted tokens kept): a few steps' noise averages out, a change shows within a few dozen.
NEWEST_WEIGHT = 0.1
# A time that reads more than this many times what it was (a page fault, another process) counts
# as this many: one hiccup must not stop drafting for a thousand steps.
OUTLIER = 3.0
# Each step timed weighs what each row count's times weigh in the line by this much: a row count
# no longer drafted fades from it.
FADE = 0.99


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
    """What a drafted token costs with this model on this machine, as a share of what a kept one
    saves: a step's time over the jobs decoding in it. A drafted token adds a row to the
    verifying step, and a draft model's guess a row of the draft model's call. Timed as the
    steps run: each decoding step's seconds by its rows give a line (a step's fixed time, and each
    row's), and the draft model's calls their seconds per guess. Until timed, a row is taken at
    ``ROW_SHARE_UNTIMED`` of a one-job step and a guess at ``guess_share_untimed`` of one (the
    draft model's weights' bytes over the model's, ``draft_model.guess_share``)."""

    guess_share_untimed: float = 0.0
    step_s: dict[int, float] = field(default_factory=dict)  # a decoding step's seconds by its rows, running
    step_weight: dict[int, float] = field(default_factory=dict)  # how much each weighs in the line
    guess_s: float | None = None  # the draft model's seconds per guess, running
    fitted: tuple[float, float] | None | bool = False  # ``line()``'s, until the next step timed (False: none yet)
    guesses_timed: int = 0
    # Per drafter (``Lookup``, ``ModelDraft``): drafted tokens kept and refused, every job's, running.
    kept_by: dict[type, list[float]] = field(default_factory=dict)
    # The same for lookup's drafts by the class of their match's length (``MATCH_CLASSES``).
    kept_by_match: dict[int, list[float]] = field(default_factory=dict)

    def stepped(self, rows: int, seconds: float) -> None:
        """A step that fed ``rows`` rows of decoding jobs (their last tokens and drafts) took
        ``seconds``. A job decoding alone times its plain steps far more often than its drafts'
        steps, and the other row counts' times move with its (``LOAD_FOLLOWED``): a busier or
        quieter machine moves them alike, and a draft's cost, a share of a plain step, stays what
        the steps of both said when last timed."""
        old = self.step_s.get(rows)
        if old is None:
            line = self.line()
            old = seconds = seconds if line is None else min(seconds, OUTLIER * (line[0] + line[1] * rows))
        self.step_s[rows] = old + NEWEST_WEIGHT * (min(seconds, OUTLIER * old) - old)
        if rows == LOAD_FOLLOWED and old > 0:
            moved = self.step_s[rows] / old
            for n in self.step_s:
                if n != rows:
                    self.step_s[n] *= moved
        for n in self.step_weight:
            self.step_weight[n] *= FADE
        self.step_weight[rows] = self.step_weight.get(rows, 0.0) + 1.0
        self.fitted = False

    def guessed(self, guesses: int, seconds: float) -> None:
        """The draft model made ``guesses`` guesses (for one job or several) in ``seconds``."""
        each = seconds / guesses
        self.guesses_timed += 1
        old = self.guess_s
        self.guess_s = each if old is None else old + NEWEST_WEIGHT * (min(each, OUTLIER * old) - old)

    def line(self) -> tuple[float, float] | None:
        """A step's fixed seconds and each row's: the line that fits the row counts' times best,
        each weighing as often as it was timed lately; None until two row counts have been."""
        if self.fitted is False:
            self.fitted = self._fit()
        return self.fitted

    def _fit(self) -> tuple[float, float] | None:
        total = sum(self.step_weight.values())
        if len(self.step_s) < 2 or total <= 0:
            return None
        mean_x = sum(w * n for n, w in self.step_weight.items()) / total
        mean_y = sum(w * self.step_s[n] for n, w in self.step_weight.items()) / total
        spread = sum(w * (n - mean_x) ** 2 for n, w in self.step_weight.items())
        if spread <= 0:
            return None
        moment = sum(w * (n - mean_x) * (self.step_s[n] - mean_y) for n, w in self.step_weight.items())
        row = max(0.0, moment / spread)
        fixed = mean_y - row * mean_x
        return (fixed, row) if fixed + row > 0 else None

    def step_time(self, rows: int) -> float:
        """A step's seconds at ``rows`` rows: as timed, else along the straight line between the
        nearest row counts timed on each side, else on ``line()`` (which must be there). The
        products change how they work with their rows (on the CPU a few rows share each decoded
        weight, many take tiles of weights decoded once), so one line through every count timed
        misjudges a long draft; between two timed counts the error stays within their span, and
        the count a draft then takes is timed in its turn."""
        timed = self.step_s.get(rows)
        if timed is not None:
            return timed
        below = max((n for n in self.step_s if n < rows), default=None)
        above = min((n for n in self.step_s if n > rows), default=None)
        if below is not None and above is not None:
            a, b = self.step_s[below], self.step_s[above]
            return a + (b - a) * (rows - below) / (above - below)
        fixed, row = self.line()
        return fixed + row * rows

    def per_token(self, pace: Pace, jobs: int = 1) -> float:
        """What one token drafted by ``pace``'s drafter costs while ``jobs`` jobs decode, as a
        share of what a kept one saves (a plain step's time over its jobs)."""
        line = self.line()
        fixed, row = line or (1 - ROW_SHARE_UNTIMED, ROW_SHARE_UNTIMED)  # untimed: a one-job step is 1
        jobs = max(1, jobs)
        per_job = (self.step_s[jobs] if line is not None and jobs in self.step_s else fixed + row * jobs) / jobs
        cost = row / per_job
        if isinstance(pace, ModelDraft):
            timed = line is not None and self.guess_s is not None
            cost += (self.guess_s if timed else self.guess_share_untimed * (fixed + row)) / per_job
        return cost

    def _best(self, pace: Pace, p: float, jobs: int = 1) -> tuple[int, float]:
        """Timed: the length of ``pace``'s job's draft whose step, ``jobs`` jobs decoding, gives
        most tokens a second, and how many (the step's time as timed at its rows: a call's rows go
        through the products in groups, and one more row may cost a group's time; the tokens
        expected as ``Pace.longest_paying`` expects them)."""
        guess = self.guess_s if isinstance(pace, ModelDraft) else 0.0

        def tokens_a_second(k: int) -> float:
            kept = k if p >= 1 else p * (1 - p ** k) / (1 - p)
            return (jobs + kept) / (self.step_time(jobs + k) + k * guess)

        best = max(range(1, pace.draft_max + 1), key=tokens_a_second)
        return best, tokens_a_second(best)

    def longest(self, pace: Pace, jobs: int = 1, share: float | None = None) -> int:
        """The longest draft worth making for ``pace``'s job, ``jobs`` jobs decoding, each token
        kept with ``share`` once the one before was (default: ``share_of``): where the costs are
        timed, the length whose step gives most tokens a second (``_best``), none beside other
        jobs where that is no more than their step without it gives (their rows already share
        the weights: a row more may cost as much as a kept token saves); else the longest whose
        last token pays (``longest_paying``)."""
        cost = self.per_token(pace, jobs)
        p = self.share_of(pace) if share is None else share
        if p is None or cost >= 1 or not self.timed(pace):
            return longest_paying(p, cost, pace.draft_max)
        best, rate = self._best(pace, p, jobs)
        return best if jobs == 1 or rate > jobs / self.step_time(jobs) else 0

    def timed(self, pace: Pace) -> bool:
        """Whether what ``pace``'s drafter costs has been timed, not only estimated."""
        guesses_timed = self.guesses_timed >= GUESSES_TIMED or not isinstance(pace, ModelDraft)
        return guesses_timed and self.line() is not None

    def drafts_now(self, pace: Pace, jobs: int = 1) -> bool:
        """Whether ``pace``'s drafter drafts now, ``jobs`` jobs decoding. Not where its tokens were
        timed (or, untimed beside other jobs, estimated) at what a kept one saves or more: no draft
        can pay, whatever is kept (lookup's strong matches aside: ``STRONG_MATCH``). A draft model, for a job alone, only where its best draft gives
        more tokens a second than a plain step, with as many of its guesses kept as ``share_of``
        says (a guess costs nearly a step where the draft model is not much smaller)."""
        if not self.timed(pace):
            # Alone, a job drafts to be timed; beside others only where the estimate says it may
            # pay (a draft model's first draft late in a batch catches up a long reply).
            return jobs == 1 or self.per_token(pace, jobs) < 1
        if self.per_token(pace, jobs) >= 1:
            return isinstance(pace, Lookup)  # its match decides (``Lookup.draft``: only a strong one)
        if jobs != 1 or not isinstance(pace, ModelDraft) or 1 not in self.step_s:
            return True
        p = self.share_of(pace)
        return p is None or self._best(pace, p)[1] > 1 / self.step_s[1]

    def kept(self, pace: Pace, drafted: int, accepted: int) -> None:
        """A job kept ``accepted`` of ``drafted`` tokens of ``pace``'s drafter."""
        running(self.kept_by.setdefault(type(pace), [0.0, 0.0]), drafted, accepted)
        if isinstance(pace, Lookup):
            running(self.kept_by_match.setdefault(pace.pending_class, [0.0, 0.0]), drafted, accepted)

    def share_of(self, pace: Pace) -> float | None:
        """The share of ``pace``'s drafted tokens kept once the one before was: its job's, or,
        before the job has drafted, every job's lately with that drafter (None: nobody has)."""
        if pace.kept_share is not None:
            return pace.kept_share
        kept, refused = self.kept_by.get(type(pace), (0.0, 0.0))
        return kept / (kept + refused) if kept + refused else None


@dataclass
class Pace:
    """How long a drafter's next draft is, for one job: it grows by two while drafts are kept
    whole, shrinks to what was kept, and never passes ``DraftCosts.longest``; after a draft that did
    not pay for its tokens (``cost`` each, in plain steps: ``DraftCosts.per_token``) the job waits
    ``PAUSES`` steps, longer each time."""

    draft_max: int
    size: int = 0  # the next draft's length (0: ``FIRST_DRAFT`` at the first)
    pause: int = 0  # steps left without drafting
    pause_level: int = 0
    pending: int = 0  # the length of the draft in the step running
    pending_cost: float = 0.0  # and what each of its tokens costs (``DraftCosts.per_token``)
    drafted: int = 0  # counters, for the stats
    accepted: int = 0
    kept_run: float = 0.0  # drafted tokens kept and refused (one at most a draft), running sums
    refused_run: float = 0.0

    def want(self, room: int, longest: int) -> int:
        """The next draft's length within ``room`` and ``longest`` (``DraftCosts.longest``): 0
        while pausing (a step counted off)."""
        if self.pause:
            self.pause -= 1
            return 0
        if self.size == 0:
            self.size = min(FIRST_DRAFT, self.draft_max)
        return max(0, min(self.size, longest, room))

    @property
    def kept_share(self) -> float | None:
        """The running share of drafted tokens kept once the one before was (None: none drafted)."""
        seen = self.kept_run + self.refused_run
        return self.kept_run / seen if seen else None

    def longest_paying(self, cost: float) -> int:
        """The longest draft whose last token still pays for itself (``longest_paying``), each
        token kept as the job's drafts say."""
        return longest_paying(self.kept_share, cost, self.draft_max)

    def counted(self, drafted: int, accepted: int) -> None:
        """Count a verified draft: ``accepted`` of its ``drafted`` tokens were kept."""
        self.drafted += drafted
        self.accepted += accepted
        self.kept_run, self.refused_run = running([self.kept_run, self.refused_run], drafted, accepted)

    def taken(self, drafted: int, accepted: int, cost: float) -> None:
        """A draft of ``drafted`` tokens, ``cost`` plain steps each, was verified and ``accepted``
        of them kept (each kept one saves a step)."""
        self.counted(drafted, accepted)
        self.size = min(self.draft_max, self.size + 2) if accepted == drafted else max(1, accepted + 1)
        if accepted == 0 or accepted < cost * drafted:
            self.pause_level = min(self.pause_level + 1, len(PAUSES) - 1)
            self.pause = PAUSES[self.pause_level]
        else:
            self.pause_level = 0


@dataclass(frozen=True)
class Match:
    """The longest earlier match of a job's last tokens: its continuation starts at ``at``, and
    the ``length`` tokens before it equal the job's last ``length`` (at most ``LONGEST_MATCH``)."""

    at: int
    length: int


@dataclass
class Lookup(Pace):
    """One job's n-gram index over its tokens (prompt and reply), and what its drafts from
    matches of each length kept.

    A draft copies what followed the longest earlier match of the job's last tokens (the latest
    of the longest), and is judged by that match alone: the share of tokens kept by the job's
    drafts from matches of its length class (``MATCH_CLASSES``), drawn towards every job's share
    for the class, itself drawn towards ``expected_share`` of the length, as ``PRIOR_DRAFTS``
    drafts each. Its length is the longest that pays with that share (``DraftCosts.longest``).
    A draft that did not pay pauses its class, not the job: the next 1, 2, 4 ... 32 matches of
    that class draft nothing, while a longer (or shorter) match drafts as its own class says.
    Where rows were timed at a step a token or more, only a match of ``STRONG_MATCH`` tokens or
    more drafts, one token, and its class pauses as after any draft that did not pay.
    (``Pace``'s growing size and job-wide pauses are a draft model's; lookup does not use them.)"""

    length: int = 0  # how many of the job's tokens the index has taken
    # n-gram -> the index after each of its occurrences, in order
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    by_class: dict[int, list[float]] = field(default_factory=dict)  # drafted tokens kept and refused, running
    paused: dict[int, list[int]] = field(default_factory=dict)  # class -> [matches left to skip, pause level]
    pending_class: int = 0  # the match class of the draft in the step running

    def draft(self, tokens: list[int], room: int, costs: DraftCosts, jobs: int = 1) -> list[int]:
        """Up to ``room`` tokens that followed the longest earlier match of ``tokens``' tail, as
        many as pay for their rows by ``costs`` with ``jobs`` jobs decoding; [] where there is no
        match or its class is pausing."""
        match = self.match(tokens)
        if match is None or room <= 0:
            return []
        kind = match_class(match.length)
        pause = self.paused.get(kind)
        if pause is not None and pause[0] > 0:
            pause[0] -= 1
            return []
        cost = costs.per_token(self, jobs)
        if cost >= 1 and match.length < STRONG_MATCH:
            return []
        share = self.share(match.length, costs)
        self.pending_cost = cost
        self.pending_class = kind
        want = min(room, costs.longest(self, jobs, share))
        return copied(tokens, match.at, want)

    def match(self, tokens: list[int]) -> Match | None:
        """The longest earlier match of ``tokens``' last tokens (the latest of the longest), in
        the prompt or the reply; None where even the last token never occurred before."""
        self._follow(tokens)
        end = len(tokens)
        for n in NGRAM_SIZES:
            if end <= n:
                continue
            ends = self.ends.get(tuple(tokens[end - n:]))
            if not ends:
                continue
            # The latest occurrence is the tail itself: the candidates are the ones before it.
            candidates = ends[-MOST_CANDIDATES - 1:-1]
            if not candidates:
                continue
            if n != NGRAM_SIZES[0]:  # the longest n-gram did not occur before: the match is n long
                return Match(candidates[-1], n)
            best = Match(candidates[-1], self._reach(tokens, candidates[-1], n))
            for at in reversed(candidates[:-1]):
                if best.length >= LONGEST_MATCH:
                    break
                longer = best.length + 1
                if at >= longer and tokens[at - longer:at] == tokens[end - longer:]:
                    best = Match(at, self._reach(tokens, at, longer))
            return best
        return None

    @staticmethod
    def _reach(tokens: list[int], at: int, n: int) -> int:
        """How far back (to ``LONGEST_MATCH``) the tokens before ``at`` equal the tail, knowing ``n`` do."""
        end = len(tokens)
        while n < LONGEST_MATCH and at - n > 0 and tokens[at - n - 1] == tokens[end - n - 1]:
            n += 1
        return n

    def share(self, length: int, costs: DraftCosts) -> float:
        """The share of tokens kept, once the one before was, expected of a draft from a match of
        ``length``: the job's drafts from matches of its class, drawn towards every job's
        (``costs.kept_by_match``), drawn towards ``expected_share(length)``."""
        kind = match_class(length)
        prior = expected_share(length)
        every = costs.kept_by_match.get(kind)
        if every is not None:
            prior = drawn_towards(every, prior)
        own = self.by_class.get(kind)
        return prior if own is None else drawn_towards(own, prior)

    def taken(self, drafted: int, accepted: int, cost: float) -> None:
        """A draft of ``drafted`` tokens from a match of ``pending_class``, ``cost`` plain steps
        each, was verified and ``accepted`` of them kept: its class's share moves, and where the
        draft did not pay, the class pauses, longer each time."""
        self.counted(drafted, accepted)
        kind = self.pending_class
        running(self.by_class.setdefault(kind, [0.0, 0.0]), drafted, accepted)
        pause = self.paused.setdefault(kind, [0, 0])
        if accepted == 0 or accepted < cost * drafted:
            pause[1] = min(pause[1] + 1, len(PAUSES) - 1)
            pause[0] = PAUSES[pause[1]]
        else:
            pause[:] = [0, 0]

    def _follow(self, tokens: list[int]) -> None:
        """Index the n-grams that end at each token not indexed yet."""
        for end in range(self.length + 1, len(tokens) + 1):
            for n in NGRAM_SIZES:
                if end >= n:
                    self.ends.setdefault(tuple(tokens[end - n:end]), []).append(end)
        self.length = len(tokens)


def copied(tokens: list[int], at: int, want: int) -> list[int]:
    """``want`` tokens copied from ``at`` on, as far as ``tokens`` and the copy itself go: a match
    that overlaps the tail (a reply repeating a few tokens) goes on repeating them."""
    draft = tokens[at:at + want]
    end = len(tokens)
    while len(draft) < want and at + len(draft) >= end:
        draft.append(draft[at + len(draft) - end])
    return draft


def match_class(length: int) -> int:
    """The class of a match of ``length`` tokens: the longest of ``MATCH_CLASSES`` it reaches."""
    return max(c for c in MATCH_CLASSES if c <= length)


def expected_share(length: int) -> float:
    """The share of a draft's tokens kept once the one before was, expected of a match of
    ``length`` before any draft from one like it: a single token that occurred before says little
    of what follows it, a long copied span a lot."""
    return length / (length + 2)


def drawn_towards(counts: list[float], prior: float) -> float:
    """The share of kept tokens in running ``counts`` (kept, refused), drawn towards ``prior`` as
    ``PRIOR_DRAFTS`` drafts would draw it."""
    kept, refused = counts
    return (kept + PRIOR_DRAFTS * prior) / (kept + refused + PRIOR_DRAFTS)


def running(counts: list[float], drafted: int, accepted: int) -> list[float]:
    """Add a draft to running ``counts`` (tokens kept, drafts that ended in a refusal), older ones
    fading by ``NEWEST_WEIGHT``; returns ``counts``."""
    keep = 1 - NEWEST_WEIGHT
    counts[0] = keep * counts[0] + accepted
    counts[1] = keep * counts[1] + (accepted < drafted)
    return counts


def longest_paying(p: float | None, cost: float, most: int) -> int:
    """The longest draft, to ``most``, whose last token still pays for itself: with each token
    kept with probability ``p`` once the one before it was (the i-th then with p**i), the i-th
    pays while p**i > ``cost``. At least 1: a draft that cannot pay is still tried after each
    pause, so that a change (a grounded passage, a quieter machine) is found. (``p`` None: nothing
    drafted yet, ``most``.)"""
    if cost >= 1:
        return 1
    if p is None or cost <= 0:
        return most
    if p <= cost:
        return 1
    if p >= 1:
        return most
    return max(1, min(most, int(math.log(cost) / math.log(p))))


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


__all__ = ["DraftCosts", "GUESSES_TIMED", "LOAD_FOLLOWED", "LONGEST_MATCH", "Lookup", "MATCH_CLASSES", "Match",
           "ModelDraft", "NGRAM_SIZES", "PAUSES", "Pace", "ROW_SHARE_UNTIMED", "STRONG_MATCH", "Speculation", "copied",
           "expected_share", "longest_paying", "match_class"]

"""Hugging Face's logits processors and warpers, batched: one row per sequence.

A processor is a callable ``(history, logits) -> logits``: ``history`` is a ``TokenHistory``
(each row's token ids so far, prompt included, plus what the penalties derive from them), and
``logits`` is ``(rows, vocab)`` float. Processors may write into ``logits``; ``Controls`` hands them
its own copy. The order is transformers' (``GenerationMixin._get_logits_processor``): logit bias,
repetition penalty (then presence and frequency penalties, which transformers lacks), no-repeat
n-gram, minimum new tokens; then, when sampling, the warpers: temperature, top-k, top-p, min-p,
typical-p.

``make_controls(params, eos_ids=...)`` checks nothing more (``SamplingParams`` validated itself)
and returns a ``Controls``, which ``sampling.choose`` applies before its draw (calling it does the
same: the history, the logits and one uniform per row give one token id per row). The batching scheduler keeps one ``TokenHistory`` for its running rows, calls
``history.append`` with each step's tokens and ``history.reorder`` when rows leave or are copied.

What penalties read is kept up to date one token at a time (each row's count of every id in its
window, an index of n-grams), so a step costs the same at token 10 as at token 4,000:
transformers rebuilds both from the whole sequence at every step. The penalties then touch only
the ids in the window (a gather and a scatter of a few hundred logits), never the whole
vocabulary: on a 32,000-token vocabulary a full pass costs more than all of that.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import torch

from llama_chat.ml.controls import SamplingParams
from llama_chat.ml.sampling import apply_top_p, choose

__all__ = ["FrequencyPresencePenalty", "HistoryFollower", "LogitBias", "LogitsProcessor", "MinNewTokens", "MinP",
           "NoRepeatNGram", "Penalties", "RepetitionPenalty", "Controls", "Temperature", "TokenHistory", "TopK", "TopP",
           "TypicalP", "make_controls", "make_logits_processors", "make_warpers"]

NEG_INF = float("-inf")


class TokenHistory:
    """Each row's token ids so far (prompt, then generated), and what penalties derive from them.

    ``window`` (``repeat_last_n``): the counts cover each row's last ``window`` tokens only
    (0: all of them). Counts and n-gram indexes are built on first use and then updated by
    ``append``; ids at or above ``vocab_size`` (none a tokenizer makes) are not counted.
    """

    def __init__(self, rows: Sequence[Sequence[int]], *, vocab_size: int, device: torch.device | str = "cpu",
                 window: int = 0, prompt_lengths: Sequence[int] | None = None) -> None:
        self.tokens: list[list[int]] = [[int(t) for t in row] for row in rows]
        self.prompt_lengths = list(prompt_lengths) if prompt_lengths is not None else [len(r) for r in self.tokens]
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.window = window
        self._counts: list[_Counts] | None = None
        self._seen: tuple[torch.Tensor, torch.Tensor] | None = None
        self._ngrams: dict[int, list[dict[tuple[int, ...], set[int]]]] = {}
        self._followers: list[HistoryFollower] = []

    @property
    def rows(self) -> int:
        return len(self.tokens)

    def new_tokens(self, row: int) -> int:
        """How many tokens row ``row`` has generated."""
        return len(self.tokens[row]) - self.prompt_lengths[row]

    # -- derived state -----------------------------------------------------------------------------

    def _row_counts(self, row: Sequence[int]) -> _Counts:
        counts = _Counts()
        for t in (row[-self.window:] if self.window else row):
            if t < self.vocab_size:
                counts.add(t)
        return counts

    def seen(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every id that occurs in a row's window, as an index into the flattened ``(rows, vocab)``
        logits (``row * vocab + id``), and how often it occurs (float32)."""
        if self._seen is None:
            if self._counts is None:
                self._counts = [self._row_counts(row) for row in self.tokens]
            # From the rows' buffers, not lists: torch.tensor converts a list element by element,
            # which costs more than the penalties themselves.
            flats, counts = [], []
            for r, row_counts in enumerate(self._counts):
                ids = _from_buffer(row_counts.ids, torch.long, self.device)
                flats.append(ids + r * self.vocab_size if r else ids)
                counts.append(_from_buffer(row_counts.counts, torch.float32, self.device))
            if len(flats) == 1:
                self._seen = (flats[0], counts[0])
            else:
                self._seen = (torch.cat(flats), torch.cat(counts))
        return self._seen

    def counts(self) -> torch.Tensor:
        """``(rows, vocab)`` float32: how often each id occurs in each row's window."""
        flat, counts = self.seen()
        dense = torch.zeros(self.rows * self.vocab_size, dtype=torch.float32, device=self.device)
        return dense.index_copy_(0, flat, counts).view(self.rows, self.vocab_size)

    def banned(self, n: int) -> list[Sequence[int]]:
        """For each row, the ids that would complete an ``n``-gram the row already holds."""
        index = self._ngrams.get(n)
        if index is None:
            index = self._ngrams[n] = [_ngram_index(row, n) for row in self.tokens]
        out: list[Sequence[int]] = []
        for row, seen in zip(self.tokens, index):
            if len(row) + 1 < n:  # not even the first n-gram could be completed
                out.append(())
            else:
                out.append(tuple(seen.get(tuple(row[len(row) - n + 1:]), ())))
        return out

    # -- changes ---------------------------------------------------------------------------------

    def follow(self, follower: HistoryFollower) -> None:
        """``follower`` hears of every change below, after the history made it: state kept per row
        elsewhere (a constraint's matchers, ``ml/constraints.py``) moves with the rows."""
        self._followers.append(follower)

    def append(self, new: Sequence[int] | torch.Tensor) -> None:
        """Add one token to every row (``new[r]`` to row ``r``)."""
        new = [int(t) for t in (new.tolist() if isinstance(new, torch.Tensor) else new)]
        if len(new) != self.rows:
            raise ValueError(f"append needs one token per row ({self.rows}), got {len(new)}")
        for row, token in zip(self.tokens, new):
            row.append(token)
        self._seen = None
        if self._counts is not None:
            window = self.window
            for row, counts in zip(self.tokens, self._counts):
                if row[-1] < self.vocab_size:
                    counts.add(row[-1])
                # The token that slid out of the window no longer counts.
                if window and len(row) > window and row[-window - 1] < self.vocab_size:
                    counts.remove(row[-window - 1])
        for n, index in self._ngrams.items():
            for row, seen in zip(self.tokens, index):
                if len(row) >= n:
                    seen.setdefault(tuple(row[len(row) - n:-1]), set()).add(row[-1])
        for follower in self._followers:
            follower.append(new)

    def reorder(self, sources: Sequence[int]) -> None:
        """Row ``i`` becomes a copy of what row ``sources[i]`` was: beams that survive and fork,
        or a batch whose finished rows leave (``sources`` may repeat or omit rows)."""
        sources = [int(s) for s in sources]
        self.tokens = [list(self.tokens[s]) for s in sources]
        self.prompt_lengths = [self.prompt_lengths[s] for s in sources]
        self._seen = None
        if self._counts is not None:
            self._counts = [self._counts[s].copy() for s in sources]
        for n, index in self._ngrams.items():
            self._ngrams[n] = [{k: set(v) for k, v in index[s].items()} for s in sources]
        for follower in self._followers:
            follower.reorder(sources)

    def add_rows(self, rows: Sequence[Sequence[int]]) -> None:
        """New sequences (their prompts) join below the existing rows."""
        first = self.rows
        self.tokens.extend([int(t) for t in row] for row in rows)
        self.prompt_lengths.extend(len(row) for row in rows)
        self._seen = None
        if self._counts is not None:
            self._counts.extend(self._row_counts(row) for row in self.tokens[first:])
        for n, index in self._ngrams.items():
            index.extend(_ngram_index(row, n) for row in self.tokens[first:])
        for follower in self._followers:
            follower.add_rows(self.tokens[first:])


class _Counts:
    """One row's ids in its window with their counts, in two arrays that tensors are made from
    without a Python loop; ``where`` finds an id's slot. A removed id's slot takes the last one."""

    __slots__ = ("counts", "ids", "where")

    def __init__(self) -> None:
        self.ids = array("q")
        self.counts = array("f")
        self.where: dict[int, int] = {}

    def add(self, token: int) -> None:
        slot = self.where.get(token)
        if slot is None:
            self.where[token] = len(self.ids)
            self.ids.append(token)
            self.counts.append(1.0)
        else:
            self.counts[slot] += 1.0

    def remove(self, token: int) -> None:
        slot = self.where[token]
        if self.counts[slot] > 1.0:
            self.counts[slot] -= 1.0
            return
        last = len(self.ids) - 1
        moved = self.ids[last]
        self.ids[slot], self.counts[slot] = moved, self.counts[last]
        self.where[moved] = slot
        del self.where[token]
        self.ids.pop()
        self.counts.pop()

    def copy(self) -> _Counts:
        twin = _Counts()
        twin.ids, twin.counts, twin.where = array("q", self.ids), array("f", self.counts), dict(self.where)
        return twin


def _from_buffer(data: array, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.frombuffer(data, dtype=dtype).to(device, copy=True)  # a copy: the array goes on changing


def _ngram_index(row: Sequence[int], n: int) -> dict[tuple[int, ...], set[int]]:
    """Every (n-1)-token prefix in ``row`` with the ids that followed it."""
    seen: dict[tuple[int, ...], set[int]] = {}
    for i in range(len(row) - n + 1):
        seen.setdefault(tuple(row[i:i + n - 1]), set()).add(row[i + n - 1])
    return seen


LogitsProcessor = Callable[[TokenHistory, torch.Tensor], torch.Tensor]


class HistoryFollower(Protocol):
    """State kept per row of a ``TokenHistory`` outside it (``TokenHistory.follow``)."""

    def append(self, tokens: list[int]) -> None: ...

    def reorder(self, sources: list[int]) -> None: ...

    def add_rows(self, rows: list[list[int]]) -> None: ...


# -- processors: they read the history ---------------------------------------------------------------


@dataclass(frozen=True)
class LogitBias:
    """Adds a fixed bias to chosen ids (transformers' ``sequence_bias`` with one-token sequences;
    OpenAI's and llama.cpp's ``logit_bias``). ``-inf`` bans a token."""

    bias: tuple[tuple[int, float], ...]

    def __call__(self, history: TokenHistory, logits: torch.Tensor) -> torch.Tensor:
        return logits.add_(_dense_bias(self.bias, logits.shape[-1], logits.dtype, logits.device))


@dataclass(frozen=True)
class Penalties:
    """The penalties on ids in each row's window, in one gather and one scatter:
    transformers' ``repetition_penalty`` (CTRL paper: a logit is divided by it when positive and
    multiplied by it when negative), then OpenAI's and llama.cpp's ``frequency`` (times the id's
    count) and ``presence`` (once), subtracted."""

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0

    def __call__(self, history: TokenHistory, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape != (history.rows, history.vocab_size):
            raise ValueError(f"logits {tuple(logits.shape)} do not match the history "
                             f"({history.rows} rows, vocabulary {history.vocab_size})")
        flat, counts = history.seen()
        if not flat.numel():
            return logits
        logits = logits.contiguous()
        values = logits.view(-1).index_select(0, flat)
        if self.repetition != 1.0:
            values = torch.where(values < 0, values * self.repetition, values / self.repetition)
        if self.frequency or self.presence:
            values = values - counts.to(values.dtype) * self.frequency - self.presence
        logits.view(-1).index_copy_(0, flat, values)
        return logits


def RepetitionPenalty(penalty: float) -> Penalties:  # noqa: N802 - named as the processor it is
    """transformers' ``RepetitionPenaltyLogitsProcessor``."""
    return Penalties(repetition=penalty)


def FrequencyPresencePenalty(presence: float, frequency: float) -> Penalties:  # noqa: N802
    """OpenAI's and llama.cpp's presence and frequency penalties."""
    return Penalties(presence=presence, frequency=frequency)


@dataclass(frozen=True)
class NoRepeatNGram:
    """transformers' ``no_repeat_ngram_size``: an id that would complete an n-gram already in the
    row (prompt included) gets -inf."""

    size: int

    def __call__(self, history: TokenHistory, logits: torch.Tensor) -> torch.Tensor:
        rows: list[int] = []
        ids: list[int] = []
        for r, banned in enumerate(history.banned(self.size)):
            rows.extend([r] * len(banned))
            ids.extend(banned)
        if ids:
            logits.index_put_((torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device)),
                              torch.tensor(NEG_INF, dtype=logits.dtype, device=logits.device))
        return logits


@dataclass(frozen=True)
class MinNewTokens:
    """transformers' ``min_new_tokens``: end-of-sequence ids get -inf until a row has generated
    ``count`` tokens."""

    count: int
    eos_ids: tuple[int, ...]

    def __call__(self, history: TokenHistory, logits: torch.Tensor) -> torch.Tensor:
        short = [r for r in range(history.rows) if history.new_tokens(r) < self.count]
        eos = tuple(i for i in self.eos_ids if i < logits.shape[-1])
        if short and eos:
            ids = _index(eos, logits.device)
            if len(short) == history.rows:
                logits.index_fill_(1, ids, NEG_INF)
            else:
                rows = _index(tuple(short), logits.device)
                logits[rows.repeat_interleave(len(eos)), ids.repeat(len(short))] = NEG_INF
        return logits


# -- warpers: they reshape the distribution drawn from ------------------------------------------------


@dataclass(frozen=True)
class Temperature:
    temperature: float

    def __call__(self, history: TokenHistory | None, logits: torch.Tensor) -> torch.Tensor:
        return logits / self.temperature


# Small constant tensors made once per setting and device, not at every token.
@lru_cache(maxsize=64)
def _dense_bias(bias: tuple[tuple[int, float], ...], width: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    ids = torch.tensor([i for i, _ in bias], dtype=torch.long, device=device)
    values = torch.tensor([b for _, b in bias], dtype=dtype, device=device)
    return torch.zeros(width, dtype=dtype, device=device).index_add_(0, ids, values)


@lru_cache(maxsize=64)
def _index(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)


def _kth_largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """``(rows, 1)``: each row's k-th largest value (ties count once each)."""
    k = min(k, values.shape[-1])
    return torch.topk(values, k, dim=-1).values[:, -1:]


@dataclass(frozen=True)
class TopK:
    """Keeps the ``k`` highest logits of each row, and any tied with the k-th (as transformers)."""

    k: int
    min_keep: int = 1

    def __call__(self, history: TokenHistory | None, logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(logits < _kth_largest(logits, max(self.k, self.min_keep)), NEG_INF)


@dataclass(frozen=True)
class TopP:
    """Keeps the smallest set of most probable ids whose probabilities sum to at least ``p``."""

    p: float
    min_keep: int = 1

    def __call__(self, history: TokenHistory | None, logits: torch.Tensor) -> torch.Tensor:
        kept = apply_top_p(logits, self.p)  # the top id always survives
        if self.min_keep > 1:
            kept = torch.where(logits >= _kth_largest(logits, self.min_keep), logits, kept)
        return kept


@dataclass(frozen=True)
class MinP:
    """Keeps the ids whose probability is at least ``p`` times the row's top probability."""

    p: float
    min_keep: int = 1

    def __call__(self, history: TokenHistory | None, logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1)
        drop = probs < self.p * probs.amax(dim=-1, keepdim=True)
        if self.min_keep > 1:
            drop &= probs < _kth_largest(probs, self.min_keep)
        return logits.masked_fill(drop, NEG_INF)


@dataclass(frozen=True)
class TypicalP:
    """Locally typical sampling (Meister et al. 2022): ids ranked by how far their information
    (-log p) is from the row's entropy, closest first, are kept until their mass reaches ``mass``."""

    mass: float
    min_keep: int = 1

    def __call__(self, history: TokenHistory | None, logits: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits, dim=-1)
        probs = logp.exp()
        entropy = -(logp * probs).nansum(dim=-1, keepdim=True)
        distance = (-logp - entropy).abs()
        ordered, order = torch.sort(distance, dim=-1)
        cumulative = probs.gather(-1, order).cumsum(dim=-1)
        # The first id (in that order) at which the mass reaches ``mass`` is the last one kept.
        last = (cumulative < self.mass).sum(dim=-1, keepdim=True).clamp_(max=logits.shape[-1] - 1)
        drop = distance > ordered.gather(-1, last)
        drop &= distance > _kth_largest(-distance, self.min_keep).neg()
        return logits.masked_fill(drop, NEG_INF)


# -- factories -------------------------------------------------------------------------------------


def make_logits_processors(params: SamplingParams, *, eos_ids: Iterable[int] = (),
                           constraint: LogitsProcessor | None = None) -> tuple[LogitsProcessor, ...]:
    """The processors ``params`` switches on, in transformers' order (they apply when greedy too),
    then ``constraint`` (``ml/constraints.GrammarMask``, one request's), which has the last word on
    what may follow."""
    out: list[LogitsProcessor] = []
    if params.logit_bias:
        out.append(LogitBias(params.logit_bias))
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        # Adjacent in the order, so one pass: transformers' repetition penalty, then the others.
        out.append(Penalties(params.repetition_penalty, params.presence_penalty, params.frequency_penalty))
    if params.no_repeat_ngram_size > 0:
        out.append(NoRepeatNGram(params.no_repeat_ngram_size))
    eos = tuple(sorted(set(eos_ids)))
    if params.min_new_tokens > 0 and eos:
        out.append(MinNewTokens(params.min_new_tokens, eos))
    if constraint is not None:
        out.append(constraint)
    return tuple(out)


def make_warpers(params: SamplingParams, *, min_keep: int = 1) -> tuple[LogitsProcessor, ...]:
    """The warpers for sampling, in transformers' order; none when greedy.

    ``min_keep``: each filter keeps at least this many ids (beam sampling keeps one more than
    there are end-of-sequence ids, so a beam can always go on).
    """
    if params.greedy:
        return ()
    out: list[LogitsProcessor] = []
    if params.temperature != 1.0:
        out.append(Temperature(params.temperature))
    if params.top_k:
        out.append(TopK(params.top_k, min_keep))
    if params.top_p < 1.0:
        out.append(TopP(params.top_p, min_keep))
    if params.min_p > 0.0:
        out.append(MinP(params.min_p, min_keep))
    if params.typical_p < 1.0:
        out.append(TypicalP(params.typical_p, min_keep))
    return tuple(out)


_DRAW_ONLY = SamplingParams(temperature=1.0, top_p=1.0)


@dataclass(frozen=True)
class Controls:
    """Processors, warpers and the draw for one set of settings, over any number of rows."""

    params: SamplingParams
    processors: tuple[LogitsProcessor, ...]
    warpers: tuple[LogitsProcessor, ...]

    @property
    def needs_history(self) -> bool:
        return bool(self.processors)

    def process(self, history: TokenHistory, logits: torch.Tensor) -> torch.Tensor:
        """The logits processors on a float32 copy of ``logits``."""
        out = logits.float().clone()
        for processor in self.processors:
            out = processor(history, out)
        return out

    def prepare(self, history: TokenHistory, logits: torch.Tensor) -> tuple[torch.Tensor, SamplingParams]:
        """Logits ready for ``sampling.sample`` and the settings it should draw with.

        Temperature and top-p alone are left to ``sample`` (its candidate pools are faster than a
        full sort, and it then makes the same choices as the compiled step); with any other
        warper on, every warper runs here and ``sample`` only draws.
        """
        out = self.process(history, logits) if self.processors else logits
        if self.params.simple_warpers:
            return out, self.params
        return self.warp(history, out), _DRAW_ONLY

    def warp(self, history: TokenHistory | None, logits: torch.Tensor) -> torch.Tensor:
        """The warpers, in order. After top-k only k ids are left, so the warpers after it run on
        those k candidates instead of the whole vocabulary (typical-p sorts what it is given: a
        full sort of 32,000 logits costs more than a small model's forward). Unless the k-th
        value is tied: transformers then keeps every tied id, and so does the full path."""
        out = logits
        for i, warper in enumerate(self.warpers):
            if isinstance(warper, TopK) and i + 1 < len(self.warpers) and 4 * warper.k < out.shape[-1]:
                k = max(warper.k, warper.min_keep)
                values, ids = torch.topk(out, k, dim=-1)
                if int((out >= values[:, -1:]).sum()) == k * out.shape[0]:
                    for later in self.warpers[i + 1:]:
                        values = later(history, values)
                    return torch.full_like(out, NEG_INF).scatter_(-1, ids, values)
            out = warper(history, out)
        return out

    def __call__(self, history: TokenHistory, logits: torch.Tensor,
                 randomness: torch.Generator | torch.Tensor | None = None) -> torch.Tensor:
        """One token id per row (``sampling.choose``). ``randomness``: one float64 uniform per row
        (or a generator)."""
        return choose(logits, self.params, randomness, controls=self, history=history)


def make_controls(params: SamplingParams, *, eos_ids: Iterable[int] = (),
                  constraint: LogitsProcessor | None = None) -> Controls:
    """The ``Controls`` of ``params``; ``eos_ids`` are what ``min_new_tokens`` holds back;
    ``constraint``: a request's structured output (``make_logits_processors``)."""
    return Controls(params, make_logits_processors(params, eos_ids=eos_ids, constraint=constraint),
                   make_warpers(params))

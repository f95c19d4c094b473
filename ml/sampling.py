"""Every token drawn, in one family: the greedy pick, the seeded draw, and beams' draws.

``choose`` is the one sampler every generation path calls for a token it draws on the host (the
scheduler's rows through ``sample_rows``, speculative verification): a request's controls, then
``sample``. ``sample`` is a short pipeline: scale, filter, draw. The other controls of
``SamplingParams`` (top-k, min-p, typical-p, penalties, n-grams, logit bias) are Hugging Face's
logits processors in ``ml/processors.py`` (``Controls``); they run before ``sample``, which then
only draws. Every step works on a whole ``(batch, vocab)`` tensor at once.

The forms of the one draw, equal token for token (tests/test_draws.py):

- greedy: ``pick``, the operator's native pick where it is built (``ml/cpu/pick.h``, also inside
  its decode step), ``torch.argmax`` otherwise and in a graph;
- sampled: ``sample`` on the host, ``sample_in_graph`` in a compiled step or CUDA graph, both
  ending in ``_draw``, one float64 uniform per row (``draw_uniforms``);
- beams: ``draw_distinct``, ``_draw`` repeated with the drawn ones taken out.

The tie rule, everywhere: a greedy pick is the lowest id among the largest (a NaN counting as
largest, as torch.argmax has it); a nucleus ranks its candidates by value, equal values by id.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from llama_chat.ml.cpu import kernels as cpu_kernels
# The settings live in a module without torch, so the command line can check them instantly.
from llama_chat.ml.controls import SamplingParams


class Controls(Protocol):
    """A request's processors and warpers (``ml/processors.Controls``): the logits ready for
    ``sample``, and the settings it should draw with, given the row's token history."""

    def prepare(self, history: Any, logits: torch.Tensor) -> tuple[torch.Tensor, SamplingParams]: ...


__all__ = ["Draw", "Row", "SamplingMode", "SamplingParams", "Uniforms", "apply_top_p", "choose", "draw_distinct",
           "draw_uniforms", "finite_best", "pick", "sample", "sample_in_graph", "sample_rows"]


# Candidate pool sizes tried before sorting the whole vocabulary: a top-k of a few hundred costs a
# small part of a full sort, and a typical next-token distribution puts almost all of its mass in
# a few hundred tokens, so the first pool nearly always holds the whole nucleus.
_CANDIDATE_POOLS = (256, 4096)
# A row's first pool: its tokens whose scaled logit is within this of its largest (a probability
# at least e^-12 of the likeliest's). Where they hold less than top_p, the pools above are taken.
NEAR_LARGEST = 12.0


class _Nucleus(NamedTuple):
    """Each row's candidate tokens, most probable first, all ``(batch, k)``."""

    ids: torch.Tensor
    logits: torch.Tensor
    weights: torch.Tensor  # probabilities, zero outside the nucleus
    keep: torch.Tensor  # bool, inside the nucleus


def _nucleus(logits: torch.Tensor, top_p: float) -> _Nucleus:
    """The candidates covering each row's nucleus, likeliest first and equal ones by id.

    The nucleus is the smallest set of most-probable tokens whose probabilities sum to at least
    ``top_p``: a token is kept when the mass ranked strictly above it is below ``top_p``, so the
    top token always survives. If a pool of each row's likeliest candidates already carries
    ``top_p`` of the mass, the nucleus lies inside it and the result is exact without a full sort.
    Every pool ranks equal values by id, so a row draws the same token whichever pool held it.
    """
    vocab = logits.shape[-1]
    log_total = torch.logsumexp(logits, dim=-1, keepdim=True)  # normalises over the full vocab
    if logits.shape[0] == 1:
        # A row's values near its largest, found in one pass, are its first pool: most often a
        # few dozen, where topk's first pool ranks 256 (most of a large vocabulary's draw).
        found = cpu_kernels.near_largest(logits[0], NEAR_LARGEST, _CANDIDATE_POOLS[-1])
        if found is not None:
            nucleus = _in_pool(*_ranked(logits[:, found], found.unsqueeze(0)), log_total, top_p)
            if nucleus is not None:
                return nucleus
    for k in (k for k in _CANDIDATE_POOLS if k < vocab):
        nucleus = _in_pool(*_ranked(*torch.topk(logits, k, dim=-1)), log_total, top_p)
        if nucleus is not None:
            return nucleus
    return _sorted_nucleus(logits, log_total, top_p)


def _sorted_nucleus(logits: torch.Tensor, log_total: torch.Tensor, top_p: float | torch.Tensor) -> _Nucleus:
    """The nucleus over a full sort: no host sync and no shape that depends on the values, so a
    graph takes it as it is; stable, so equal values rank by id as in every pool."""
    values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    nucleus = _in_pool(values, ids, log_total, top_p, whole=True)
    assert nucleus is not None  # a whole row always holds its nucleus
    return nucleus


def _ranked(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool's ``values`` and ``ids`` (``(rows, k)``) likeliest first, equal values by id."""
    ids, by_id = ids.sort(dim=-1)
    values, order = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, order)


def _in_pool(values: torch.Tensor, ids: torch.Tensor, log_total: torch.Tensor, top_p: float | torch.Tensor, *,
             whole: bool = False) -> _Nucleus | None:
    """The nucleus within a ranked pool, or None where some row's pool holds less than ``top_p``
    of its mass (then the nucleus may reach past it) or keeps a value equal to the pool's least
    (``torch.topk`` may cut a run of equal values anywhere, where the rule wants the lowest ids);
    a ``whole`` row's pool is the row."""
    probs = torch.exp(values - log_total)
    cumulative = torch.cumsum(probs, dim=-1)
    keep = (cumulative - probs) < top_p
    if not whole:
        cut = (keep & (values == values[:, -1:])).any(dim=-1)
        if not bool(((cumulative[:, -1] >= top_p) & ~cut).all()):
            return None
    return _Nucleus(ids, values, probs * keep, keep)


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` with every token outside each row's nucleus set to -inf (see ``_nucleus``)."""
    if top_p >= 1.0:
        return logits
    nucleus = _nucleus(logits, top_p)
    kept = nucleus.logits.masked_fill(~nucleus.keep, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, nucleus.ids, kept)


def _draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One index per row with probability proportional to ``weights`` (non-negative, any scale).

    Inverse-CDF with one uniform in [0, 1) per row (``uniform`` is ``(batch,)`` float64).
    ``torch.multinomial`` would draw one exponential per vocabulary entry, where this is one
    cumulative sum and one search. The CDF is float64 so that a long tail of tiny probabilities is
    not lost to rounding.
    """
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    index = torch.searchsorted(cdf, uniform.to(torch.float64).view(-1, 1) * total, right=True)
    # u * total can round up to total; the last index whose weight counts is the first where the
    # CDF reaches its total, and nothing after it may be chosen.
    last = (cdf < total).sum(dim=-1, keepdim=True)
    return torch.minimum(index, last).squeeze(-1)


class Uniforms:
    """A seed's float64 uniforms in [0, 1), in order, taken a few at a time: the same numbers, on
    every device, as one ``draw_uniforms`` of them all (the host's generator makes them)."""

    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def take(self, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.rand(count, dtype=torch.float64, generator=self._generator).to(device)


def draw_uniforms(count: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``count`` float64 uniforms in [0, 1) from ``seed``, the same on every device.

    A request draws them all at its start and samples the token after position ``p`` with
    uniform ``p``, so that a step needs no generator: the eager step and a compiled or
    CUDA-graph step then make the same choices from the same seed. A beam search, which draws
    several a step, takes them from ``Uniforms`` as it goes.
    """
    return Uniforms(seed).take(count, device)


def pick(logits: torch.Tensor) -> torch.Tensor:
    """The greedy pick of each row of ``(rows, vocab)`` logits: the lowest id among its largest, a
    NaN counting as largest. The operator's native pick (``ml/cpu/pick.h``) where it is built and
    pays, ``torch.argmax`` (the same rule, and the form a graph traces) otherwise."""
    return cpu_kernels.argmax(logits)


def finite_best(logits: torch.Tensor, picks: torch.Tensor | None = None) -> torch.Tensor:
    """``(rows,)`` bool: whether each row's best score is finite. NaN wins a maximum, and so does
    +inf: a row without one holds neither, and a draw from it means something. ``picks``: the
    rows' greedy picks (``pick``'s, where NaN and +inf win too), whose scores are the best: only
    those are read, where a maximum over a batch's rows opens a parallel region every step."""
    if picks is None:
        return torch.isfinite(logits.amax(dim=-1))
    return torch.isfinite(logits.gather(-1, picks.view(-1, 1).to(logits.device, torch.long)).view(-1))


def sample(
    logits: torch.Tensor, params: SamplingParams,
    randomness: torch.Generator | torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick one token per row: ``(batch, vocab)`` float logits -> ``(batch,)`` int64 token ids.

    ``randomness`` is either the uniforms themselves (one float64 in [0, 1) per row, as the
    engine passes them, see ``draw_uniforms``) or a generator to draw them from (on the logits'
    device; None: torch's global RNG). Deterministic for a given seed and device. The greedy path
    neither normalises nor draws.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be (batch, vocab), got shape {tuple(logits.shape)}")
    if params.greedy:
        return pick(logits)
    if isinstance(randomness, torch.Tensor):
        uniform = randomness
    else:
        uniform = torch.rand(logits.shape[0], dtype=torch.float64, generator=randomness, device=logits.device)
    scaled = logits.float() / params.temperature
    # Draw among the ranked candidates only: the nucleus is usually tiny.
    return _drawn(scaled, _nucleus(scaled, params.top_p) if params.top_p < 1.0 else None, uniform)


def _drawn(scaled: torch.Tensor, nucleus: _Nucleus | None, uniform: torch.Tensor) -> torch.Tensor:
    """The end of every sampled draw: each row's token by its uniform, over the whole vocabulary
    in id order, or over its nucleus ranked likeliest first."""
    if nucleus is None:
        return _draw(torch.softmax(scaled, dim=-1), uniform)
    return nucleus.ids.gather(-1, _draw(nucleus.weights, uniform)[:, None]).squeeze(-1)


# (logits (rows, vocab), settings, randomness) -> (rows,) token ids: ``sample``'s signature, the
# draw ``choose`` ends with (tests put a recording draw there).
Draw = Callable[[torch.Tensor, SamplingParams, "torch.Generator | torch.Tensor | None"], torch.Tensor]


def choose(logits: torch.Tensor, params: SamplingParams, randomness: torch.Generator | torch.Tensor | None,
           *, controls: Controls | None = None, history: Any = None, draw: Draw = sample) -> torch.Tensor:
    """The one sampler: ``(rows, vocab)`` logits -> ``(rows,)`` token ids.

    ``controls`` (the request's processors and warpers, over each row's ``history``) prepare the
    logits and say what is left to draw with; then ``draw`` (``sample``) picks, one uniform per
    row from ``randomness``. The caller appends the picks to the history once it keeps them.
    """
    if controls is not None:
        logits, params = controls.prepare(history, logits)
    return draw(logits, params, randomness)


class SamplingMode(str, enum.Enum):
    """The shape of a sampling computation; within one mode only tensor values change."""

    GREEDY = "greedy"
    FULL = "full"  # temperature over the whole vocabulary
    NUCLEUS = "nucleus"  # temperature, then top-p

    @classmethod
    def of(cls, params: SamplingParams) -> SamplingMode:
        if params.greedy:
            return cls.GREEDY
        return cls.NUCLEUS if params.top_p < 1.0 else cls.FULL


def sample_in_graph(logits: torch.Tensor, mode: SamplingMode, temperature: torch.Tensor,
                    top_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """``sample`` without host syncs or data-dependent shapes, for a compiled step or CUDA graph.

    ``temperature`` and ``top_p`` are tensors (so new values need no new graph), ``uniform`` one
    float64 per row. The nucleus is the one ``sample`` falls back to, over a full sort, where
    ``sample`` first tries candidate pools whose size is chosen on the host; for the same uniform
    both pick the same token, and a greedy row ``pick``'s.
    """
    if mode is SamplingMode.GREEDY:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature
    nucleus = None
    if mode is SamplingMode.NUCLEUS:
        nucleus = _sorted_nucleus(scaled, torch.logsumexp(scaled, dim=-1, keepdim=True), top_p)
    return _drawn(scaled, nucleus, uniform)


def draw_distinct(scores: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``(rows, count)`` distinct ids per row of ``(rows, n)`` ``scores`` (log-weights, finite
    at the best), drawn without replacement with probabilities proportional to ``exp(scores)``:
    ``torch.multinomial``'s distribution, from ``uniforms`` (``(rows, count)`` float64) instead of
    a generator. Draw ``j`` is ``_draw`` with uniform ``j`` over the weights the earlier draws
    left. Where fewer than ``count`` ids of a row have any weight, the rest follow by score, equal
    ones by id (as a greedy top-k ranks them).
    """
    weights = torch.softmax(scores.float(), dim=-1)
    rows, count = uniforms.shape
    drawn = torch.empty(rows, count, dtype=torch.long, device=scores.device)
    enough = bool(((weights > 0).sum(dim=-1) >= count).all())
    ranking = None if enough else torch.sort(scores, dim=-1, descending=True, stable=True).indices
    taken = None if enough else torch.zeros_like(weights, dtype=torch.bool)
    for j in range(count):
        index = _draw(weights, uniforms[:, j])
        if ranking is not None and taken is not None:
            # A row with no weight left takes its best id not yet drawn.
            first_left = (~taken.gather(-1, ranking)).int().argmax(dim=-1, keepdim=True)
            index = torch.where(weights.sum(dim=-1) > 0, index, ranking.gather(-1, first_left).squeeze(-1))
            taken.scatter_(-1, index[:, None], True)
        drawn[:, j] = index
        weights.scatter_(-1, index[:, None], 0.0)
    return drawn


class _RowRequest(Protocol):
    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def logprobs(self) -> int | None: ...


class _History(Protocol):
    def append(self, rows: list[list[int]]) -> None: ...


class Row(Protocol):
    """What ``sample_rows`` reads and writes of a row's job (``inference/jobs.Job``): its request's
    settings, its tokens so far, its uniforms (``draw_uniforms``), its controls and the history
    they read, and where the drawn token's logprobs go."""

    @property
    def request(self) -> _RowRequest: ...

    @property
    def tokens(self) -> Sequence[int]: ...

    @property
    def uniforms(self) -> torch.Tensor | None: ...

    @property
    def controls(self) -> Controls | None: ...

    @property
    def history(self) -> _History | None: ...

    drawn_logprobs: Any


def sample_rows(logits: torch.Tensor, rows: Sequence[Row | None], picks: torch.Tensor | None,
                sample_ids: int | None, drawn: Sequence[bool] = (), *,
                logprobs: Callable[[torch.Tensor, int, int], Any], damaged: Callable[[], Exception]) -> list[int]:
    """One token per row of a step: ``pick`` for greedy rows, the job's own settings and seed
    otherwise (None: a padding row).

    ``picks``: the rows' greedy picks where the step made them already (the operator). Only the
    first ``sample_ids`` logits are candidates. The token after position ``p`` is drawn with the
    job's uniform ``p``, so a seeded job picks the same tokens batched or alone. A job that asks
    for logprobs (its request's ``logprobs``) gets ``logprobs(raw row, token, top)`` on
    ``drawn_logprobs``; no other row pays. Raises ``damaged()`` where a job's logits hold NaN or
    +inf (damaged weights, an overflow): no token drawn from them means anything. (A lone greedy
    row's pick, made without its logits, is not looked at: every job's first token comes through
    here.) ``drawn``: rows whose pick the step drew already, with the job's uniform (a compiled
    step's).
    """
    if picks is None:
        picks = pick(logits[:, :sample_ids])
    hopeless = ~finite_best(logits[:, :sample_ids], None if any(drawn) else picks)
    for i, row in enumerate(rows):
        if row is None or (row.controls is None and (row.request.sampling.greedy or i < len(drawn) and drawn[i])):
            continue
        last = len(row.tokens) - 1
        uniform = None if row.uniforms is None else row.uniforms[last:last + 1]
        picks[i] = choose(logits[i:i + 1, :sample_ids], row.request.sampling, uniform, controls=row.controls,
                          history=row.history)[0]
    # Marked -1, the damaged rows come back with the picks: still one transfer a step.
    chosen = picks.masked_fill(hopeless.to(picks.device), -1).tolist()
    if any(token < 0 and row is not None for row, token in zip(rows, chosen)):
        raise damaged()
    for i, (row, token) in enumerate(zip(rows, chosen)):
        if row is None:
            continue
        if row.history is not None:
            row.history.append([token])
        top = row.request.logprobs
        if top is not None:
            row.drawn_logprobs = logprobs(logits[i, :sample_ids], token, top)
    return chosen

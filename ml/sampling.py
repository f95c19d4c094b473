"""Next-token sampling for a batch of rows: temperature, nucleus (top-p), seeded draw.

``choose`` is the one sampler every generation path calls for a token it draws on the host (the
scheduler's rows, the engine's eager steps): a request's controls, then ``sample``.
``sample`` is a short pipeline: scale, filter, draw. The other controls of ``SamplingParams``
(top-k, min-p, typical-p, penalties, n-grams, logit bias) are Hugging Face's logits processors in
``ml/processors.py`` (``Controls``); they run before ``sample``, which then only draws. Every step
works on a whole ``(batch, vocab)`` tensor at once. ``sample_in_graph`` is the same draw for a
compiled step, and the one draw that is not the host's.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from llama_chat.ml.cpu import kernels as cpu_kernels
# The settings live in a module without torch, so the command line can check them instantly.
from llama_chat.ml.controls import SamplingParams


class Controls(Protocol):
    """A request's processors and warpers (``ml/processors.Controls``): the logits ready for
    ``sample``, and the settings it should draw with, given the row's token history."""

    def prepare(self, history: Any, logits: torch.Tensor) -> tuple[torch.Tensor, SamplingParams]: ...


__all__ = ["Draw", "SamplingMode", "SamplingParams", "apply_top_p", "choose", "draw_uniforms", "finite_best", "sample",
           "sample_in_graph"]


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
    values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    return _in_pool(values, ids, log_total, top_p, whole=True)


def _ranked(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool's ``values`` and ``ids`` (``(rows, k)``) likeliest first, equal values by id."""
    ids, by_id = ids.sort(dim=-1)
    values, order = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, order)


def _in_pool(values: torch.Tensor, ids: torch.Tensor, log_total: torch.Tensor, top_p: float, *,
             whole: bool = False) -> _Nucleus | None:
    """The nucleus within a ranked pool, or None where some row's pool holds less than ``top_p``
    of its mass (then the nucleus may reach past it); a ``whole`` row's pool is the row."""
    probs = torch.exp(values - log_total)
    cumulative = torch.cumsum(probs, dim=-1)
    if not whole and not bool((cumulative[:, -1] >= top_p).all()):
        return None
    keep = (cumulative - probs) < top_p
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


def draw_uniforms(count: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``count`` float64 uniforms in [0, 1) from ``seed``, the same on every device.

    A request draws them all at its start and samples the token after position ``p`` with
    uniform ``p``, so that a step needs no generator: the eager step and a compiled or
    CUDA-graph step then make the same choices from the same seed.
    """
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(count, dtype=torch.float64, generator=generator).to(device)


def finite_best(logits: torch.Tensor) -> torch.Tensor:
    """``(rows,)`` bool: whether each row's best score is finite. NaN wins a maximum, and so does
    +inf: a row without one holds neither, and a draw from it means something."""
    return torch.isfinite(logits.amax(dim=-1))


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
        return cpu_kernels.argmax(logits)
    if isinstance(randomness, torch.Tensor):
        uniform = randomness
    else:
        uniform = torch.rand(logits.shape[0], dtype=torch.float64, generator=randomness, device=logits.device)
    scaled = logits.float() / params.temperature
    if params.top_p < 1.0:
        # Draw among the sorted candidates only: the nucleus is usually tiny.
        nucleus = _nucleus(scaled, params.top_p)
        return nucleus.ids.gather(-1, _draw(nucleus.weights, uniform)[:, None]).squeeze(-1)
    return _draw(torch.softmax(scaled, dim=-1), uniform)


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
    float64 per row. The nucleus is taken over a full sort instead of ``sample``'s candidate
    pools, whose size is chosen on the host; for the same uniform both pick the same token.
    """
    if mode is SamplingMode.GREEDY:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature
    if mode is SamplingMode.FULL:
        return _draw(torch.softmax(scaled, dim=-1), uniform)
    values, ids = torch.sort(scaled, dim=-1, descending=True)
    probs = torch.exp(values - torch.logsumexp(scaled, dim=-1, keepdim=True))
    cumulative = torch.cumsum(probs, dim=-1)
    keep = (cumulative - probs) < top_p
    return ids.gather(-1, _draw(probs * keep, uniform)[:, None]).squeeze(-1)

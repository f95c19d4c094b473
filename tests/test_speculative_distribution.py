"""Sampling with drafts draws from the model's own distribution: the first tokens of many seeded
replies with prompt lookup, and with a draft model, against as many without drafts on other seeds,
by a chi-squared test of homogeneity that has the samples to see a 2-point shift.

``test_speculative.py`` and ``test_draft_model.py`` show the stronger property on the same seeds
(equal token for token). Here the seeds differ, so a verification that drew from a wrong
distribution (the draft's, or another position's) would show even where it stayed reproducible."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from builders import endless_model
from llama_chat.inference.speculative import Speculation
from llama_chat.inference.types import Request
from llama_chat.ml.sampling import SamplingParams
from test_speculative import Bytes, replies_of

pytestmark = pytest.mark.slow

VOCAB = 12
SAMPLES = 12_000  # replies a side: a 2-point shift between tokens near 0.12 is seen 9 times in 10 or more
POSITIONS = (1, 2, 3)  # the first token comes from the prompt's step; the next three are verified drafts
BINS = 3  # a position's likeliest tokens, each a bin, and one bin for the rest: 3 degrees of freedom
ALPHA = 1e-3 / len(POSITIONS)  # for each position's test, so that a run fails by chance once in a thousand
SHIFT = 0.02
PROMPT = (1,) + (3, 4, 5, 6) * 4  # a phrase four times: lookup drafts from the first token on
# Hot: the likeliest tokens near 0.12 each, so a 2-point shift is seen in fewer replies.
SAMPLING = SamplingParams(temperature=2.5, top_p=1.0)


class Letters(Bytes):
    vocab_size = VOCAB


@pytest.fixture(scope="module")
def target(cpu_kernels_loaded):
    """A random model of a small vocabulary: its early tokens spread over a few likely ones."""
    if not cpu_kernels_loaded:
        pytest.skip("drafts are verified by the CPU operator, which is not built here")
    return endless_model(VOCAB, seed=11, eos=2, max_seq_len=64)


@pytest.fixture(scope="module")
def without(target):
    return first_tokens(target, None, first_seed=0)


def first_tokens(model, speculation: Speculation | None, first_seed: int) -> list[tuple[int, ...]]:
    """The first tokens of ``SAMPLES`` replies to ``PROMPT``, one seed each from ``first_seed``."""
    requests = [Request(PROMPT, sampling=SAMPLING, max_tokens=1 + max(POSITIONS), seed=first_seed + i,
                        request_id=f"r{i}") for i in range(SAMPLES)]
    out, scheduler = replies_of(model, Letters(), requests, speculation, max_batch=128)
    if speculation is not None:
        # Only as good as its drafts: many taken and many refused at these positions.
        stats = scheduler.stats
        assert stats.accepted_tokens > SAMPLES // 4 and stats.drafted_tokens - stats.accepted_tokens > SAMPLES // 4
    return [tuple(tokens) for tokens, _ in out.values()]


def at(replies: list[tuple[int, ...]], position: int) -> list[int]:
    return [tokens[position] for tokens in replies if len(tokens) > position]


def table_of(a: list[int], b: list[int]) -> torch.Tensor:
    """``(2, BINS + 1)`` counts of two samples of tokens: ``a``'s likeliest ``BINS`` tokens each a
    bin, likeliest first, the rest one bin."""
    bin_of = {token: i for i, (token, _) in enumerate(Counter(a).most_common(BINS))}
    table = torch.zeros(2, BINS + 1, dtype=torch.float64)
    for row, sample in enumerate((a, b)):
        for token, count in Counter(sample).items():
            table[row, bin_of.get(token, BINS)] += count
    return table


def p_values(tables: torch.Tensor) -> torch.Tensor:
    """The chi-squared test of homogeneity of each ``(..., 2, bins)`` table: that its two rows
    are samples of one distribution."""
    expected = tables.sum(-1, keepdim=True) * tables.sum(-2, keepdim=True) / tables.sum((-2, -1), keepdim=True)
    statistic = ((tables - expected) ** 2 / expected).sum((-2, -1))
    return torch.special.gammaincc(torch.tensor((tables.shape[-1] - 1) / 2, dtype=torch.float64), statistic / 2)


def power(plain: list[int], others: int, trials: int = 400) -> float:
    """How often the test tells ``others`` draws from ``plain``'s distribution with ``SHIFT`` of
    its likeliest token's share moved to the next from ``len(plain)`` draws without: simulated
    pairs of samples of these sizes."""
    counts = table_of(plain, plain)[0]
    unshifted = counts / counts.sum()
    moved = unshifted.clone()
    moved[0] -= SHIFT
    moved[1] += SHIFT
    g = torch.Generator().manual_seed(0)

    def sampled(probs: torch.Tensor, n: int) -> torch.Tensor:
        draws = torch.multinomial(probs, trials * n, replacement=True, generator=g).view(trials, n)
        return torch.nn.functional.one_hot(draws, len(probs)).sum(1).double()

    tables = torch.stack((sampled(unshifted, len(plain)), sampled(moved, others)), dim=1)
    return float((p_values(tables) < ALPHA).double().mean())


def drafter(kind: str, target) -> Speculation:
    if kind == "lookup":
        return Speculation(draft_max=3, most_jobs=128)
    close = copy.deepcopy(target)  # the target with noise on every weight: it guesses often, not always
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in close.parameters():
            p.add_(0.08 * p.std() * torch.randn(p.shape, generator=g))
    return Speculation(draft_max=3, most_jobs=128, lookup=False, draft=close)


@pytest.mark.parametrize("kind, first_seed", [("lookup", SAMPLES), ("draft model", 2 * SAMPLES)])
def test_the_first_tokens_are_drawn_from_the_same_distribution_with_drafts_as_without(kind, first_seed, target,
                                                                                        without):
    drafted = first_tokens(target, drafter(kind, target), first_seed)
    for position in POSITIONS:
        plain, spec = at(without, position), at(drafted, position)
        assert len(spec) > 0.8 * SAMPLES  # few replies end before (the end token is seldom drawn)
        assert float(p_values(table_of(plain, spec))) > ALPHA, (position, Counter(plain), Counter(spec))
        # The samples are enough: the test tells a 2-point shift between the likeliest tokens.
        assert power(plain, len(spec)) >= 0.9, position

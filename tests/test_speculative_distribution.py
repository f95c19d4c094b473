"""Sampling with drafts draws from the model's own distribution: the first tokens of many seeded
replies with prompt lookup, and with a draft model, against the distribution of each of those
tokens computed exactly (the model's forward over every prefix the reply can have), by a
chi-squared test of goodness of fit that has the samples to see a 2-point shift.

``test_speculative.py`` and ``test_draft_model.py`` show the stronger property on the same seeds
(equal token for token). Here nothing is compared with a reply without drafts, so a verification
that drew from a wrong distribution (the draft's, or another position's) would show even where it
stayed reproducible, and so would a draw that was wrong with drafts and without alike."""

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
EOS = 2
SAMPLES = 6_000  # replies a side: a 2-point shift between tokens near 0.12 is seen 9 times in 10 or more
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
    return endless_model(VOCAB, seed=11, eos=EOS, max_seq_len=64)


@pytest.fixture(scope="module")
def exact(target) -> dict[int, torch.Tensor]:
    """Per position, the distribution of a reply's token there, among the replies that reach it: a
    reply holds its end token, then ends. Each prefix of tokens other than the end's is weighed by
    its probability, the product of the draws that made it."""
    weights = {(): 1.0}
    found: dict[int, torch.Tensor] = {}
    for position in range(max(POSITIONS) + 1):
        prefixes = list(weights)
        with torch.no_grad():
            logits = target(torch.tensor([PROMPT + prefix for prefix in prefixes]))[:, -1].double()
        probs = torch.softmax(logits / SAMPLING.temperature, dim=-1)
        weight = torch.tensor([weights[prefix] for prefix in prefixes], dtype=torch.float64)
        reached = (weight[:, None] * probs).sum(0)
        found[position] = reached / reached.sum()
        weights = {prefix + (token,): float(weight[i] * probs[i, token])
                   for i, prefix in enumerate(prefixes) for token in range(VOCAB) if token != EOS}
    return found


def first_tokens(model, speculation: Speculation, first_seed: int) -> list[tuple[int, ...]]:
    """The first tokens of ``SAMPLES`` replies to ``PROMPT``, one seed each from ``first_seed``."""
    requests = [Request(PROMPT, sampling=SAMPLING, max_tokens=1 + max(POSITIONS), seed=first_seed + i,
                        request_id=f"r{i}") for i in range(SAMPLES)]
    out, scheduler = replies_of(model, Letters(), requests, speculation, max_batch=128)
    # Only as good as its drafts: many taken and many refused at these positions.
    stats = scheduler.stats
    assert stats.accepted_tokens > SAMPLES // 4 and stats.drafted_tokens - stats.accepted_tokens > SAMPLES // 4
    return [tuple(tokens) for tokens, _ in out.values()]


def at(replies: list[tuple[int, ...]], position: int) -> list[int]:
    return [tokens[position] for tokens in replies if len(tokens) > position]


def binned(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``probs``' likeliest ``BINS`` tokens, likeliest first, and ``probs`` over those bins and one
    for the rest."""
    top = torch.argsort(probs, descending=True)[:BINS]
    return top, torch.cat((probs[top], (1 - probs[top].sum()).reshape(1)))


def counts_of(sample: list[int], top: torch.Tensor) -> torch.Tensor:
    bin_of = {int(token): i for i, token in enumerate(top)}
    counts = torch.zeros(BINS + 1, dtype=torch.float64)
    for token, count in Counter(sample).items():
        counts[bin_of.get(token, BINS)] += count
    return counts


def p_values(counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The chi-squared test of goodness of fit of each row of ``(..., bins)`` counts to ``probs``."""
    expected = counts.sum(-1, keepdim=True) * probs
    statistic = ((counts - expected) ** 2 / expected).sum(-1)
    return torch.special.gammaincc(torch.tensor((probs.shape[-1] - 1) / 2, dtype=torch.float64), statistic / 2)


def power(probs: torch.Tensor, n: int, trials: int = 400) -> float:
    """How often the test tells ``n`` draws from ``probs`` (binned) with ``SHIFT`` of its likeliest
    bin's share moved to the next from ``probs``: simulated samples of that size."""
    moved = probs.clone()
    moved[0] -= SHIFT
    moved[1] += SHIFT
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(moved, trials * n, replacement=True, generator=g).view(trials, n)
    counts = torch.nn.functional.one_hot(draws, len(probs)).sum(1).double()
    return float((p_values(counts, probs) < ALPHA).double().mean())


def drafter(kind: str, target) -> Speculation:
    if kind == "lookup":
        return Speculation(draft_max=3, most_jobs=128)
    close = copy.deepcopy(target)  # the target with noise on every weight: it guesses often, not always
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in close.parameters():
            p.add_(0.08 * p.std() * torch.randn(p.shape, generator=g))
    return Speculation(draft_max=3, most_jobs=128, lookup=False, draft=close)


@pytest.mark.parametrize("kind, first_seed", [("lookup", 0), ("draft model", SAMPLES)])
def test_the_first_tokens_are_drawn_from_the_models_distribution_with_drafts(kind, first_seed, target, exact):
    drafted = first_tokens(target, drafter(kind, target), first_seed)
    for position in POSITIONS:
        top, probs = binned(exact[position])
        spec = at(drafted, position)
        assert len(spec) > 0.8 * SAMPLES  # few replies end before (the end token is seldom drawn)
        counts = counts_of(spec, top)
        assert float(p_values(counts, probs)) > ALPHA, (position, counts.tolist(), (probs * len(spec)).tolist())
        # The samples are enough: the test tells a 2-point shift between the likeliest tokens.
        assert power(probs, len(spec)) >= 0.9, position

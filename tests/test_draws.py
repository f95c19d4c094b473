"""The forms of the one draw (ml/sampling.py) pick the same token: the greedy pick on the host,
through the operator's native pick and in a graph; the sampled draw on the host (through the
operator's candidates, the candidate pools or a full sort) and in a graph, from the same uniforms;
ties by the one rule, lowest id first. (The graph's form compiled: tests/test_bucket_step.py,
inside a compiled decode step.) Beams' draws without replacement follow the distribution they
stand for."""

from __future__ import annotations

import pytest
import torch

from llama_chat.ml import sampling
from llama_chat.ml.cpu import kernels as cpu_kernels
from llama_chat.ml.sampling import (SamplingMode, SamplingParams, Uniforms, draw_distinct, draw_uniforms, pick, sample,
                                    sample_in_graph)

SHAPES = [(1, 7), (1, 4099), (3, 300), (4, 32000)]
SAMPLED = [SamplingParams(temperature=0.8, top_p=1.0), SamplingParams(temperature=1.0, top_p=0.5),
           SamplingParams(temperature=0.7, top_p=0.95)]


def logits_with_ties(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Half-unit steps (many equal values, the largest often shared); row 0's largest at two
    places on purpose; a flat row, a row mostly impossible and a peaked one (its nucleus among
    the values near its largest) where there are rows enough."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.round(torch.randn(rows, vocab, generator=g) * 8) / 2
    top = logits[0].max() + 1
    logits[0, vocab // 2] = logits[0, vocab // 3] = top
    if rows > 1:
        logits[-1] = 0.25
    if rows > 2:
        logits[1, 1::2] = float("-inf")
    if rows > 3:
        logits[2, 100:130] += 12
    return logits


def lowest_of_largest(logits: torch.Tensor) -> torch.Tensor:
    """The tie rule written plainly: the first place where a row reaches its largest (its first
    NaN where it has one)."""
    nan = torch.isnan(logits)
    at_largest = torch.where(nan.any(dim=-1, keepdim=True), nan, logits == logits.amax(dim=-1, keepdim=True))
    return torch.tensor([row.tolist().index(True) for row in at_largest])


def in_graph(logits: torch.Tensor, params: SamplingParams, uniform: torch.Tensor, *, compiled=None) -> torch.Tensor:
    rows = logits.shape[0]
    temperature = torch.full((rows, 1), params.temperature or 1.0)
    top_p = torch.full((rows, 1), params.top_p)
    return (compiled or sample_in_graph)(logits, SamplingMode.of(params), temperature, top_p, uniform)


@pytest.mark.parametrize(("rows", "vocab"), SHAPES)
def test_every_greedy_form_takes_the_lowest_id_of_the_largest(rows, vocab, cpu_kernels_loaded):
    logits = logits_with_ties(rows, vocab, seed=vocab)
    want = lowest_of_largest(logits)
    assert torch.equal(pick(logits), want)
    assert torch.equal(in_graph(logits, SamplingParams(temperature=0.0), torch.zeros(rows, dtype=torch.float64)), want)
    if cpu_kernels_loaded:  # the native form itself, as the operator's step picks (ml/cpu/pick.h)
        assert torch.equal(torch.ops.llama_chat_cpu.argmax_rows.default(logits), want)
    nan = logits.clone()
    nan[0, [vocab - 1, vocab // 4]] = float("nan")
    assert int(pick(nan)[0]) == vocab // 4 == int(lowest_of_largest(nan)[0])
    assert int(nan.argmax(dim=-1)[0]) == vocab // 4


@pytest.mark.parametrize("seed", range(40))
def test_a_rows_best_read_at_its_pick_is_finite_as_its_maximum_is(seed):
    """The step's check for damaged scores reads each row's score at its greedy pick: the same
    answer as the row's maximum, with NaN, +inf and -inf anywhere, any number of times."""
    g = torch.Generator().manual_seed(seed)
    rows, vocab = 1 + seed % 9, [7, 300, 4099][seed % 3]
    logits = logits_with_ties(rows, vocab, seed)
    for value in (float("nan"), float("inf"), float("-inf")):
        hit = torch.rand(rows, vocab, generator=g) < torch.rand(rows, 1, generator=g) ** 4
        logits = torch.where(hit & (torch.rand(rows, 1, generator=g) < 0.5), value, logits)
    logits[torch.rand(rows, generator=g) < 0.2] = float("-inf")
    want = sampling.finite_best(logits)
    assert torch.equal(sampling.finite_best(logits, pick(logits)), want)
    assert torch.equal(sampling.finite_best(logits, logits.argmax(dim=-1)), want)


@pytest.mark.parametrize(("rows", "vocab"), SHAPES)
@pytest.mark.parametrize("params", SAMPLED, ids=["full", "nucleus-0.5", "nucleus-0.95"])
def test_every_sampled_form_draws_the_same_token_from_the_same_uniform(rows, vocab, params, monkeypatch):
    logits = logits_with_ties(rows, vocab, seed=vocab + 1)
    for k, base in enumerate(torch.linspace(0, 1, 9, dtype=torch.float64)[:-1]):
        uniform = (base + torch.arange(rows, dtype=torch.float64) / (7 * rows)) % 1.0
        # One row at a time, the host draw takes the operator's candidates near the largest.
        alone = torch.cat([sample(logits[r:r + 1], params, uniform[r:r + 1]) for r in range(rows)])
        assert torch.equal(sample(logits, params, uniform), alone), k
        assert torch.equal(in_graph(logits, params, uniform), alone), k
        with monkeypatch.context() as m:
            m.setattr(cpu_kernels, "loaded", lambda: False)  # the candidate pools
            assert torch.equal(torch.cat([sample(logits[r:r + 1], params, uniform[r:r + 1]) for r in range(rows)]),
                               alone), k
            m.setattr(sampling, "_CANDIDATE_POOLS", (vocab,))  # none smaller than the row: the full sort
            assert torch.equal(sample(logits, params, uniform), alone), k


def test_uniforms_taken_a_few_at_a_time_are_the_seeds_uniforms():
    stream = Uniforms(42)
    taken = torch.cat([stream.take(n) for n in (6, 6, 1, 19)])
    assert torch.equal(taken, draw_uniforms(32, 42))


def test_distinct_draws_follow_sampling_without_replacement():
    # P(i first, then j) = p_i * p_j / (1 - p_i): the ordered pairs of 40,000 draws of two.
    p = torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64)
    draws = 40_000
    drawn = draw_distinct(p.log().float().expand(draws, 4), draw_uniforms(2 * draws, 7).view(draws, 2))
    assert bool((drawn[:, 0] != drawn[:, 1]).all())
    counts = torch.bincount(drawn[:, 0] * 4 + drawn[:, 1], minlength=16).double().view(4, 4)
    expected = p[:, None] * p[None, :] / (1 - p[:, None]) * draws
    expected.fill_diagonal_(0)
    off = ~torch.eye(4, dtype=torch.bool)
    chi2 = float(((counts[off] - expected[off]) ** 2 / expected[off]).sum())
    assert chi2 < 32.91  # chi-square, 11 degrees of freedom, p = 0.0005; the seed is fixed


def test_distinct_draws_past_the_weighted_ids_follow_by_score_then_id():
    scores = torch.tensor([[float("-inf"), 0.0, -1e9, 1.0, float("-inf"), -1e9]])
    for u in (0.0, 0.5, 0.99):
        drawn = draw_distinct(scores, torch.full((1, 6), u, dtype=torch.float64))[0].tolist()
        assert sorted(drawn[:2]) == [1, 3]  # the only ids with weight, drawn first
        assert drawn[2:] == [2, 5, 0, 4]

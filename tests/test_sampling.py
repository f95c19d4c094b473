"""Token sampling: greedy, seeded draws, the nucleus, and the empirical distribution."""

from __future__ import annotations

import math

import pytest
import torch

from llama_chat.ml import sampling
from llama_chat.ml.sampling import SamplingParams, apply_top_p, sample


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(batch: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=seeded(seed)) * scale


def test_greedy_is_argmax_and_leaves_the_generator_alone():
    logits = random_logits(16, 1000, seed=0)
    gen = seeded(1)
    state = gen.get_state()
    out = sample(logits, SamplingParams(temperature=0.0, top_p=0.5), gen)
    assert out.dtype == torch.int64 and out.shape == (16,)
    assert torch.equal(out, logits.argmax(dim=-1))
    assert torch.equal(gen.get_state(), state)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(1.3, 1.0)])
def test_same_seed_same_tokens(params):
    logits = random_logits(8, 32000, seed=2, scale=1.0)
    a = sample(logits, params, seeded(123))
    b = sample(logits, params, seeded(123))
    assert a.dtype == torch.int64 and a.shape == (8,)
    assert torch.equal(a, b)
    draws = {tuple(sample(logits, params, seeded(s)).tolist()) for s in range(5)}
    assert len(draws) > 1  # the seed matters


def test_tiny_top_p_is_always_argmax():
    logits = random_logits(64, 500, seed=3)
    for seed in range(5):
        out = sample(logits, SamplingParams(temperature=1.5, top_p=1e-6), seeded(seed))
        assert torch.equal(out, logits.argmax(dim=-1))


def reference_nucleus(row: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of most-probable tokens whose probability sums to >= top_p."""
    probs = torch.softmax(row.double(), dim=-1).tolist()
    ranked = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in ranked:
        kept.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    return kept


def boundary_is_clear(row: torch.Tensor, top_p: float, margin: float = 1e-5) -> bool:
    # float32 cumulative sums may round a token across the boundary when the mass lands within
    # rounding of top_p; such rows say nothing about the rule, so they are skipped.
    probs = torch.sort(torch.softmax(row.double(), dim=-1), descending=True).values
    return bool((torch.cumsum(probs, 0) - top_p).abs().min() > margin)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.95, 0.999])
def test_top_p_keeps_exactly_the_nucleus(top_p):
    logits = random_logits(200, 40, seed=4, scale=2.0)
    checked = 0
    for row in logits:
        if not boundary_is_clear(row, top_p):
            continue
        kept = apply_top_p(row[None], top_p)[0]
        assert set(torch.nonzero(torch.isfinite(kept)).flatten().tolist()) == reference_nucleus(
            row, top_p
        )
        assert torch.equal(kept[torch.isfinite(kept)], row[torch.isfinite(kept)])  # untouched
        checked += 1
    assert checked > 180


def test_draws_stay_inside_the_nucleus():
    logits = random_logits(1, 50, seed=5).expand(20000, 50)
    nucleus = reference_nucleus(logits[0], 0.8)
    out = sample(logits, SamplingParams(temperature=1.0, top_p=0.8), seeded(6))
    assert set(out.tolist()) == nucleus  # every member drawn at 20000 draws, nothing else


def test_flat_rows_fall_back_to_a_full_sort_with_the_same_nucleus(monkeypatch):
    # Nearly uniform rows need thousands of tokens for 0.9 of the mass: more than any candidate
    # pool, so the full sort decides; forcing the sort everywhere must give the same masks.
    logits = random_logits(3, 6000, seed=10, scale=0.05)
    logits[0] = random_logits(1, 6000, seed=11, scale=8.0)[0]  # a peaked row alongside
    pooled = apply_top_p(logits, 0.9)
    monkeypatch.setattr(sampling, "_CANDIDATE_POOLS", ())
    assert torch.equal(apply_top_p(logits, 0.9), pooled)
    for row, masked in zip(logits, pooled):
        if boundary_is_clear(row, 0.9):
            kept = set(torch.nonzero(torch.isfinite(masked)).flatten().tolist())
            assert kept == reference_nucleus(row, 0.9)


def test_impossible_tokens_are_never_drawn():
    logits = torch.full((20000, 100), float("-inf"))
    logits[:, [3, 50, 99]] = torch.tensor([0.0, 1.0, -1.0])
    out = sample(logits, SamplingParams(temperature=1.0, top_p=1.0), seeded(14))
    assert set(out.tolist()) == {3, 50, 99}


def test_top_p_one_skips_the_sort(monkeypatch):
    def no_sort(*args, **kwargs):
        raise AssertionError("top_p=1.0 must not sort or rank the vocabulary")

    monkeypatch.setattr(torch, "sort", no_sort)
    monkeypatch.setattr(torch, "topk", no_sort)
    logits = random_logits(2, 128256, seed=7)
    assert sample(logits, SamplingParams(temperature=0.7, top_p=1.0), seeded(0)).shape == (2,)


def test_empirical_distribution_matches_softmax():
    vocab, draws = 8, 200_000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5]])
    out = sample(logits.expand(draws, vocab), SamplingParams(temperature=1.0, top_p=1.0), seeded(8))
    counts = torch.bincount(out, minlength=vocab).double()
    expected = torch.softmax(logits[0].double(), dim=-1) * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.32  # chi-square, 7 degrees of freedom, p = 0.001; the seed is fixed


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[1.0, 0.0]]).expand(50_000, 2)
    cold = sample(logits, SamplingParams(temperature=0.25, top_p=1.0), seeded(9)).float().mean()
    hot = sample(logits, SamplingParams(temperature=4.0, top_p=1.0), seeded(9)).float().mean()
    # P(token 1) = sigmoid(-1 / T): about 0.018 cold, 0.438 hot.
    assert abs(float(cold) - 1 / (1 + math.exp(4))) < 0.01
    assert abs(float(hot) - 1 / (1 + math.exp(0.25))) < 0.01


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -1.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_invalid_params_raise_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value)


def test_logits_must_be_batched():
    with pytest.raises(ValueError, match="batch, vocab"):
        sample(torch.zeros(10), SamplingParams(), None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rows_are_deterministic_and_stay_in_the_nucleus():
    logits = random_logits(16, 128256, seed=15).cuda()
    params = SamplingParams(temperature=0.8, top_p=0.9)
    a = sample(logits, params, torch.Generator("cuda").manual_seed(1))
    b = sample(logits, params, torch.Generator("cuda").manual_seed(1))
    assert a.device.type == "cuda" and torch.equal(a, b)
    kept = torch.isfinite(apply_top_p(logits / 0.8, 0.9))
    assert bool(kept.gather(-1, a[:, None]).all())


@pytest.fixture
def operator(cpu_kernels_loaded):
    if not cpu_kernels_loaded:
        pytest.skip("the operator is not built here")
    from llama_chat.ml.cpu import kernels

    return kernels


@pytest.mark.parametrize("size", [1, 7, 8, 9, 100, 32000, 32003])
def test_near_largest_is_every_place_within_the_margin_in_order(operator, size):
    row = random_logits(1, size, seed=size)[0]
    for margin in (0.0, 1.0, 6.0, 100.0):
        want = torch.nonzero(row >= row.max() - margin).flatten()
        assert torch.equal(operator.near_largest(row, margin, size), want)
    assert operator.near_largest(row, 100.0, size - 1) is None  # more than most: the pools' way
    for bad in (float("nan"), float("inf")):
        spoiled = row.clone()
        spoiled[size // 2] = bad
        assert operator.near_largest(spoiled, 6.0, size) is None

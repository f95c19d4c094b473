"""The logits processors and warpers (``ml/processors.py``): what each one keeps or changes, the
state the penalties keep up to date, and the same logits as transformers' own classes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_chat.ml.controls import ControlError, SamplingParams, parse_logit_bias
from llama_chat.ml.processors import (FrequencyPresencePenalty, LogitBias, MinNewTokens, MinP, NoRepeatNGram,
                                      RepetitionPenalty, Temperature, TokenHistory, TopK, TopP, TypicalP,
                                      make_controls)
from llama_chat.ml.sampling import draw_uniforms

VOCAB = 300
NEG_INF = float("-inf")


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def random_ids(rows: int, length: int, vocab: int = VOCAB, seed: int = 0, alphabet: int = 40) -> torch.Tensor:
    # A small alphabet so that ids and n-grams repeat within a row.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, alphabet, (rows, length), generator=g) * (vocab // alphabet)


def history_of(ids: torch.Tensor, **kwargs) -> TokenHistory:
    return TokenHistory(ids.tolist(), vocab_size=kwargs.pop("vocab_size", VOCAB), **kwargs)


# -- parity with transformers, processor by processor ------------------------------------------------

hf = pytest.importorskip("transformers.generation.logits_process")


def assert_same_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), "different ids were filtered"
    finite = torch.isfinite(theirs)
    assert (ours[finite] - theirs[finite]).abs().max().item() <= 1e-6


PROCESSOR_CASES = {
    "repetition_penalty": (lambda: RepetitionPenalty(1.3), lambda: hf.RepetitionPenaltyLogitsProcessor(1.3)),
    "repetition_penalty_below_1": (lambda: RepetitionPenalty(0.7), lambda: hf.RepetitionPenaltyLogitsProcessor(0.7)),
    "no_repeat_ngram_3": (lambda: NoRepeatNGram(3), lambda: hf.NoRepeatNGramLogitsProcessor(3)),
    "no_repeat_ngram_1": (lambda: NoRepeatNGram(1), lambda: hf.NoRepeatNGramLogitsProcessor(1)),
    "logit_bias": (lambda: LogitBias(((7, 2.5), (15, -1.0), (299, NEG_INF))),
                   lambda: hf.SequenceBiasLogitsProcessor({(7,): 2.5, (15,): -1.0, (299,): NEG_INF})),
    "temperature": (lambda: Temperature(0.7), lambda: hf.TemperatureLogitsWarper(0.7)),
    "top_k": (lambda: TopK(20), lambda: hf.TopKLogitsWarper(20)),
    "top_k_keep_3": (lambda: TopK(1, 3), lambda: hf.TopKLogitsWarper(1, min_tokens_to_keep=3)),
    "top_p": (lambda: TopP(0.8), lambda: hf.TopPLogitsWarper(0.8)),
    "top_p_keep_3": (lambda: TopP(0.05, 3), lambda: hf.TopPLogitsWarper(0.05, min_tokens_to_keep=3)),
    "min_p": (lambda: MinP(0.1), lambda: hf.MinPLogitsWarper(0.1)),
    "min_p_keep_3": (lambda: MinP(0.9, 3), lambda: hf.MinPLogitsWarper(0.9, min_tokens_to_keep=3)),
    "typical_p": (lambda: TypicalP(0.9), lambda: hf.TypicalLogitsWarper(0.9)),
    "typical_p_keep_3": (lambda: TypicalP(0.05, 3), lambda: hf.TypicalLogitsWarper(0.05, min_tokens_to_keep=3)),
}


@pytest.mark.parametrize("name", list(PROCESSOR_CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_processor_matches_transformers(name, seed):
    ours, theirs = (make() for make in PROCESSOR_CASES[name])
    ids = random_ids(4, 48, seed=seed)
    logits = random_logits(4, seed=seed)
    want = theirs(ids, logits.clone())
    got = ours(history_of(ids), logits.clone())
    assert_same_logits(got, want)


@pytest.mark.parametrize(("prompt_len", "length"), [(40, 44), (40, 48), (10, 48)])
def test_min_new_tokens_matches_transformers(prompt_len, length):
    ids = random_ids(3, length)
    logits = random_logits(3)
    want = hf.MinNewTokensLengthLogitsProcessor(prompt_len, 6, eos_token_id=[2, 9])(ids, logits.clone())
    history = TokenHistory(ids.tolist(), vocab_size=VOCAB, prompt_lengths=[prompt_len] * 3)
    assert_same_logits(MinNewTokens(6, (2, 9))(history, logits.clone()), want)


def test_the_whole_chain_matches_transformers_in_its_order():
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, typical_p=0.95,
                            repetition_penalty=1.3, no_repeat_ngram_size=2, logit_bias=((5, 3.0),), min_new_tokens=3)
    ids = random_ids(4, 32, seed=7)
    logits = random_logits(4, seed=7)
    chain = hf.LogitsProcessorList([
        hf.SequenceBiasLogitsProcessor({(5,): 3.0}), hf.RepetitionPenaltyLogitsProcessor(1.3),
        hf.NoRepeatNGramLogitsProcessor(2), hf.MinNewTokensLengthLogitsProcessor(30, 3, eos_token_id=[2]),
        hf.TemperatureLogitsWarper(0.9), hf.TopKLogitsWarper(50), hf.TopPLogitsWarper(0.9),
        hf.MinPLogitsWarper(0.02), hf.TypicalLogitsWarper(0.95)])
    want = chain(ids, logits.clone())
    sampler = make_controls(params, eos_ids=[2])
    history = TokenHistory(ids.tolist(), vocab_size=VOCAB, prompt_lengths=[30] * 4)
    got, draw_params = sampler.prepare(history, logits)
    assert_same_logits(got, want)
    assert draw_params.temperature == 1.0 and draw_params.top_p == 1.0  # the draw adds nothing


# -- what each one keeps ------------------------------------------------------------------------------

rows_and_vocab = st.tuples(st.integers(1, 4), st.integers(2, 200), st.integers(0, 2**31 - 1))


@settings(max_examples=60, deadline=None)
@given(rows_and_vocab, st.integers(1, 250))
def test_top_k_keeps_exactly_k(shape, k):
    rows, vocab, seed = shape
    logits = torch.randperm(rows * vocab, generator=torch.Generator().manual_seed(seed)).float().view(rows, vocab)
    kept = torch.isfinite(TopK(k)(None, logits))
    assert (kept.sum(dim=-1) == min(k, vocab)).all()
    # ... and they are the k largest: the smallest kept is above the largest dropped
    smallest_kept = logits.masked_fill(~kept, math.inf).amin(-1)
    largest_dropped = logits.masked_fill(kept, -math.inf).amax(-1)
    assert (smallest_kept > largest_dropped).all()


@settings(max_examples=60, deadline=None)
@given(rows_and_vocab, st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_set_reaching_p(shape, p):
    rows, vocab, seed = shape
    logits = random_logits(rows, vocab, seed)
    kept = torch.isfinite(TopP(p)(None, logits))
    probs = torch.softmax(logits.double(), dim=-1)
    for r in range(rows):
        order = torch.argsort(probs[r], descending=True)
        n = int(kept[r].sum())
        assert bool(kept[r][order[:n]].all()), "the kept ids are the most probable ones"
        mass = probs[r][order].cumsum(0)
        assert mass[n - 1] >= p - 1e-6, "the kept mass reaches p"
        if n > 1:
            assert mass[n - 2] < p + 1e-6, "one id fewer would not"


@settings(max_examples=60, deadline=None)
@given(rows_and_vocab, st.floats(0.0, 1.0))
def test_min_p_keeps_ids_with_at_least_p_times_the_top_probability(shape, p):
    rows, vocab, seed = shape
    logits = random_logits(rows, vocab, seed)
    kept = torch.isfinite(MinP(p)(None, logits))
    probs = torch.softmax(logits, dim=-1)
    assert torch.equal(kept, probs >= p * probs.amax(-1, keepdim=True))
    assert kept.any(dim=-1).all()


@settings(max_examples=40, deadline=None)
@given(rows_and_vocab, st.floats(0.01, 1.0))
def test_typical_p_keeps_the_ids_closest_to_the_entropy_until_the_mass_is_reached(shape, mass):
    rows, vocab, seed = shape
    logits = random_logits(rows, vocab, seed)
    kept = torch.isfinite(TypicalP(mass)(None, logits))
    logp = torch.log_softmax(logits.double(), -1)
    entropy = -(logp.exp() * logp).sum(-1, keepdim=True)
    distance = (-logp - entropy).abs()
    for r in range(rows):
        assert kept[r].any()
        # Everything kept is at least as typical as everything dropped.
        if (~kept[r]).any():
            assert distance[r][kept[r]].max() <= distance[r][~kept[r]].min() + 1e-9
        assert logp[r][kept[r]].exp().sum() >= min(mass, 1.0) - 1e-5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 29), min_size=1, max_size=40), st.integers(0, 12),
       st.floats(0.5, 2.0), st.floats(-2, 2), st.floats(-2, 2))
def test_penalties_touch_only_ids_in_the_window(tokens, window, penalty, presence, frequency):
    vocab = 30
    logits = random_logits(1, vocab, seed=len(tokens))
    history = TokenHistory([tokens], vocab_size=vocab, window=window)
    seen = set(tokens[-window:] if window else tokens)
    rep = RepetitionPenalty(penalty)(history, logits.clone())
    pen = FrequencyPresencePenalty(presence, frequency)(history, logits.clone())
    window_tokens = tokens[-window:] if window else tokens
    for i in range(vocab):
        x = logits[0, i].item()
        if i in seen:
            assert rep[0, i].item() == pytest.approx(x * penalty if x < 0 else x / penalty)
            want = x - frequency * window_tokens.count(i) - presence
            assert pen[0, i].item() == pytest.approx(want, abs=1e-5)
        else:
            assert rep[0, i].item() == x and pen[0, i].item() == x


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(0, 2**31 - 1), st.integers(1, 12))
def test_no_repeat_ngram_never_repeats_an_ngram(n, seed, alphabet):
    # A tiny alphabet makes repeats likely; greedy choice under the ban must avoid every one.
    # Once every id is banned the row is stuck, and the test stops there.
    g = torch.Generator().manual_seed(seed)
    history = TokenHistory([torch.randint(0, alphabet, (6,), generator=g).tolist()], vocab_size=alphabet)
    ban = NoRepeatNGram(n)
    for _ in range(30):
        logits = ban(history, torch.randn(1, alphabet, generator=g))
        if not torch.isfinite(logits).any():
            break
        history.append([int(logits.argmax())])
    row = history.tokens[0]
    for i in range(len(row) - n + 1):
        if i + n > 6:  # an n-gram that ends on a generated token appeared nowhere before
            assert tuple(row[i:i + n]) not in {tuple(row[j:j + n]) for j in range(i)}


def test_min_new_tokens_holds_eos_back_until_then():
    history = TokenHistory([[1, 2, 3]], vocab_size=10)
    block = MinNewTokens(2, (2, 9))
    for step in range(4):
        out = block(history, torch.zeros(1, 10))
        assert bool(torch.isinf(out[0, [2, 9]]).all()) == (step < 2)
        assert torch.isfinite(out[0, [0, 1, 3, 4, 5, 6, 7, 8]]).all()
        history.append([5])


# -- the history's kept-up state ------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=12), min_size=1, max_size=4),
       st.lists(st.integers(0, 15), max_size=20), st.integers(0, 6), st.integers(0, 2**31 - 1))
def test_history_state_kept_up_equals_state_rebuilt(rows, steps, window, seed):
    """Counts and n-gram bans updated token by token (with beam-like reorders between steps)
    equal those built from scratch for the same rows."""
    g = torch.Generator().manual_seed(seed)
    history = TokenHistory(rows, vocab_size=16, window=window)
    history.counts(), history.banned(2), history.banned(3)  # built now, then kept up
    for t in steps:
        history.append([(t + r) % 16 for r in range(history.rows)])
        history.reorder(torch.randint(0, history.rows, (history.rows,), generator=g).tolist())
    fresh = TokenHistory(history.tokens, vocab_size=16, window=window, prompt_lengths=history.prompt_lengths)
    assert torch.equal(history.counts(), fresh.counts())
    for n in (2, 3):
        assert [sorted(b) for b in history.banned(n)] == [sorted(b) for b in fresh.banned(n)]


def test_add_rows_joins_new_sequences_below():
    history = TokenHistory([[1, 2, 2]], vocab_size=8)
    history.counts()
    history.add_rows([[3, 3, 3]])
    history.append([4, 5])
    assert history.counts()[0].tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert history.counts()[1].tolist() == [0, 0, 0, 3, 0, 1, 0, 0]
    assert history.new_tokens(1) == 1


# -- the sampler ------------------------------------------------------------------------------------


def test_same_seed_same_tokens_and_greedy_takes_the_processed_argmax():
    params = SamplingParams(temperature=0.9, top_k=40, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5)
    sampler = make_controls(params)
    logits = random_logits(3, seed=4)
    ids = random_ids(3, 20, seed=4)
    a = sampler(history_of(ids), logits, draw_uniforms(3, seed=11))
    b = sampler(history_of(ids), logits, draw_uniforms(3, seed=11))
    assert torch.equal(a, b)
    greedy = make_controls(SamplingParams(temperature=0.0, repetition_penalty=1.2))
    want = RepetitionPenalty(1.2)(history_of(ids), logits.clone()).argmax(-1)
    assert torch.equal(greedy(history_of(ids), logits, draw_uniforms(3, seed=11)), want)


def test_sampled_ids_stay_inside_what_the_warpers_keep():
    params = SamplingParams(temperature=1.3, top_k=5, typical_p=0.9)
    sampler = make_controls(params)
    logits = random_logits(64, seed=9)
    allowed = torch.isfinite(TypicalP(0.9)(None, TopK(5)(None, logits / 1.3)))
    chosen = sampler(history_of(random_ids(64, 4)), logits, draw_uniforms(64, seed=3))
    assert bool(allowed.gather(-1, chosen[:, None]).all())


def test_the_processors_do_not_change_the_callers_logits():
    logits = random_logits(2)
    before = logits.clone()
    sampler = make_controls(SamplingParams(temperature=0, repetition_penalty=1.5, no_repeat_ngram_size=2,
                                          frequency_penalty=1.0, logit_bias=((3, 1.0),)))
    sampler(history_of(random_ids(2, 10)), logits, None)
    assert torch.equal(logits, before)


# -- the settings ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"top_k": -1}, "top_k must be an integer >= 0 (0: off), got -1"),
    ({"min_p": 1.5}, "min_p must be in 0 <= p <= 1 (0: off), got 1.5"),
    ({"typical_p": 0.0}, "typical_p must be in 0 < p <= 1 (1: off), got 0.0"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0 (1: off), got 0.0"),
    ({"repetition_penalty": math.inf}, "repetition_penalty must be a finite number > 0"),
    ({"repeat_last_n": -3}, "repeat_last_n must be an integer >= 0"),
    ({"presence_penalty": 3.0}, "presence_penalty must be in -2 <= x <= 2"),
    ({"frequency_penalty": math.nan}, "frequency_penalty must be in -2 <= x <= 2"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size must be an integer >= 0"),
    ({"min_new_tokens": -2}, "min_new_tokens must be an integer >= 0"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias must be"),
    ({"logit_bias": ((3, math.inf),)}, "logit_bias must be"),
])
def test_bad_settings_are_one_line_errors_naming_the_control(kwargs, message):
    with pytest.raises(ControlError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("text", "want"), [
    ("15043=-inf", (15043, NEG_INF)), ("7=2.5", (7, 2.5)), ("7+1", (7, 1.0)), ("7-1", (7, -1.0)),
    (" 12 = -0.5 ", (12, -0.5)),
])
def test_logit_bias_forms(text, want):
    assert parse_logit_bias(text) == want


@pytest.mark.parametrize("text", ["", "abc", "7", "x=1", "7=nan", "7=inf", "-3=1"])
def test_bad_logit_bias_is_one_line(text):
    with pytest.raises(ControlError) as info:
        parse_logit_bias(text)
    assert str(info.value).startswith("logit_bias ") and "\n" not in str(info.value)


@pytest.mark.parametrize("k", [5, 40])
def test_warpers_after_top_k_on_its_candidates_equal_the_full_path(k):
    params = SamplingParams(temperature=0.7, top_k=k, top_p=0.9, min_p=0.02, typical_p=0.9)
    sampler = make_controls(params)
    logits = random_logits(3, vocab=4000, seed=k)
    out = logits / 0.7
    for warper in sampler.warpers[1:]:
        out = warper(None, out)  # each warper on the whole vocabulary
    assert_same_logits(sampler.warp(None, logits), out)
    tied = torch.zeros(2, 4000)  # every id tied with the k-th: the full path, ties kept as transformers does
    assert torch.isfinite(sampler.warp(None, tied)).sum() == torch.isfinite(
        TypicalP(0.9)(None, MinP(0.02)(None, TopP(0.9)(None, TopK(k)(None, tied / 0.7))))).sum()


def test_min_new_tokens_counts_each_row_from_its_own_prompt():
    history = TokenHistory([[1, 2, 3, 4], [1, 2]], vocab_size=10, prompt_lengths=[2, 2])  # 2 and 0 new tokens
    out = MinNewTokens(1, (2, 9))(history, torch.zeros(2, 10))
    assert torch.isfinite(out[0]).all()
    assert torch.isinf(out[1, [2, 9]]).all() and torch.isfinite(out[1, [0, 1, 3]]).all()
    out = MinNewTokens(3, (2, 9))(history, torch.zeros(2, 10))
    assert torch.isinf(out[:, [2, 9]]).all()

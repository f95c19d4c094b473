"""Beam search (``inference/beam.py``) and the processors in generation, against transformers'
``generate`` on the same random weights in float32: the same tokens, the same beams and scores."""

from __future__ import annotations

import time

import anyio
import pytest
import torch

from builders import random_model, tiny_args, train_sentencepiece
from builders_formats import hf_config, hf_state
from llama_chat.inference.beam import BeamLimits, BeamSearch
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
from llama_chat.inference.types import GenerationState, Request, stop_ids_of
from llama_chat.ml.controls import BeamParams, SamplingParams
from llama_chat.model.kv_cache import KVCache
from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 96
PROMPT = (1, 17, 40, 5, 63, 22, 9, 81)


def hf_twin(model):
    """The same weights as a ``transformers.LlamaForCausalLM``."""
    config = transformers.LlamaConfig(**{k: v for k, v in hf_config(model).items() if k != "architectures"})
    hf = transformers.LlamaForCausalLM(config)
    missing, unexpected = hf.load_state_dict(hf_state(model), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing) == bool(missing) or not missing
    return hf.float().eval()


@pytest.fixture(scope="module")
def pair():
    model = random_model(tiny_args(VOCAB, max_seq_len=128), seed=5)
    hf = hf_twin(model)
    with torch.inference_mode():
        prompt = torch.tensor([PROMPT])
        assert (hf(prompt).logits - model(prompt)).abs().max() < 1e-4
    return model, hf


def eos_of(hf) -> int:
    """A token greedy decoding picks soon after the prompt: as the end token, beams do end on it."""
    out = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                      do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    return int(out[0, len(PROMPT) + 3])


def run_search(model, params: SamplingParams, beams: BeamParams, *, max_new: int, stop_ids, seed: int = 0):
    limits = BeamLimits(max_new, GenerationState.MAX_TOKENS, time.perf_counter())
    search = BeamSearch(model, PROMPT, params, beams, limits=limits, stop_ids=stop_ids, seed=seed, vocab=VOCAB,
                        device=torch.device("cpu"), dtype=torch.float32)
    while search.prefill(3):  # a few chunks, as the engine prefills
        pass
    while search.step():
        pass
    return search.result()


CASES = [(lp, es) for lp in (0.5, 1.0, 2.0) for es in (False, True, "never")]


@pytest.mark.parametrize(("length_penalty", "early_stopping"), CASES)
def test_beam_search_matches_transformers(pair, length_penalty, early_stopping):
    model, hf = pair
    eos = eos_of(hf)
    max_new = 12
    with torch.inference_mode():
        out = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                          num_beams=4, num_return_sequences=4, length_penalty=length_penalty,
                          early_stopping=early_stopping, max_new_tokens=max_new, do_sample=False,
                          eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    want = []
    for seq, score, indices in zip(out.sequences, out.sequences_scores, out.beam_indices):
        n = int((indices != -1).sum())
        want.append((seq[len(PROMPT):len(PROMPT) + n].tolist(), float(score)))

    got = run_search(model, SamplingParams(temperature=0.0), BeamParams(4, length_penalty, early_stopping, 4),
                     max_new=max_new, stop_ids={eos})
    assert [list(b.token_ids) for b in got] == [w[0] for w in want]
    for beam, (_, score) in zip(got, want):
        assert beam.score == pytest.approx(score, abs=1e-4)
    ended = {b.finish_reason for b in got}
    assert ended <= {GenerationState.EOS, GenerationState.MAX_TOKENS}
    for b in got:
        assert (b.finish_reason is GenerationState.EOS) == (b.token_ids[-1] == eos)


def test_the_parity_cases_end_on_the_end_token_too(pair):
    """The parity cases are not all cut by the budget: with length penalty 0.5 every returned
    hypothesis ends on the end token, early, so early stopping has something to decide."""
    model, hf = pair
    got = run_search(model, SamplingParams(temperature=0.0), BeamParams(4, 0.5, False, 4), max_new=12,
                     stop_ids={eos_of(hf)})
    assert all(b.finish_reason is GenerationState.EOS and len(b.token_ids) < 12 for b in got)


def test_beam_search_with_processors_matches_transformers(pair):
    model, hf = pair
    eos = eos_of(hf)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                          num_beams=3, num_return_sequences=2, max_new_tokens=10, do_sample=False,
                          repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=4,
                          eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    got = run_search(model, SamplingParams(temperature=0.0, repetition_penalty=1.3, no_repeat_ngram_size=2,
                                           min_new_tokens=4), BeamParams(3, 1.0, False, 2), max_new=10,
                     stop_ids={eos})
    for beam, seq, score, indices in zip(got, out.sequences, out.sequences_scores, out.beam_indices):
        n = int((indices != -1).sum())
        assert list(beam.token_ids) == seq[len(PROMPT):len(PROMPT) + n].tolist()
        assert beam.score == pytest.approx(float(score), abs=1e-4)
        assert len(beam.token_ids) >= 4


def test_beam_sampling_is_the_same_for_the_same_seed_and_differs_between_seeds(pair):
    model, _ = pair
    params = SamplingParams(temperature=1.5, top_k=30)
    runs = [run_search(model, params, BeamParams(3, 1.0, False, 3), max_new=10, stop_ids={2}, seed=s)
            for s in (1, 1, 2, 3)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2] or runs[0] != runs[3]


def test_kv_cache_reorder_copies_rows():
    args = tiny_args(VOCAB)
    cache = KVCache.for_model(args, 3, max_seq_len=8)
    for r in range(3):
        for k, v in zip(cache.keys, cache.values):
            k[r].fill_(r)
            v[r].fill_(10 + r)
    cache.reorder([2, 0, 0], length=5)
    assert [float(cache.keys[0][r, 0, 0, 0]) for r in range(3)] == [2.0, 0.0, 0.0]
    assert [float(cache.values[1][r, 0, 4, 0]) for r in range(3)] == [12.0, 10.0, 10.0]
    assert [float(cache.keys[0][r, 0, 6, 0]) for r in range(3)] == [0.0, 1.0, 2.0]  # past length: untouched


# -- through the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return SentencePieceTokenizer(train_sentencepiece(tmp_path_factory.mktemp("beam_spm"), vocab_size=512))


@pytest.fixture(scope="module")
def engine_pair(tokenizer):
    model = random_model(tiny_args(tokenizer.vocab_size, max_seq_len=128), seed=2)
    with torch.no_grad():
        model.output.weight[sorted(stop_ids_of(tokenizer))] = 0.0  # the end token never wins
    # The twin first: a scheduler fuses the model's projections, whose names transformers lacks.
    return model, hf_twin(model)


def test_greedy_with_repetition_penalty_and_no_repeat_ngram_matches_transformers(engine_pair, tokenizer):
    model, hf = engine_pair
    engine = Scheduler(model, tokenizer, SchedulerOptions(max_batch=1, prefill_chunk=4))
    prompt = tuple(tokenizer.encode("the cat sat on the mat and the cat", bos=True))
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, no_repeat_ngram_size=3)
    got = engine.generate(Request(prompt, sampling=params, max_tokens=40))
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           do_sample=False, max_new_tokens=40, repetition_penalty=1.3, no_repeat_ngram_size=3,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert list(got.token_ids) == want
    plain = engine.generate(Request(prompt, sampling=SamplingParams(temperature=0.0), max_tokens=40))
    assert list(plain.token_ids) != want  # the controls changed something


def test_scheduler_beams_return_scored_hypotheses_and_leave_its_pages_alone(engine_pair, tokenizer):
    """Beam search (``beam.beam_run``) with a cache and a thread of its own: the scheduler's page
    table keeps what the last job left."""
    model, _ = engine_pair
    prompt = tuple(tokenizer.encode("once upon a time", bos=True))
    request = Request(prompt, sampling=SamplingParams(temperature=0.0), max_tokens=6,
                      beams=BeamParams(num_beams=4, num_return=3))
    scheduler = Scheduler(model, tokenizer, SchedulerOptions(max_batch=1, page_size=4, cache_tokens=128))

    async def run():
        async with scheduler.stream(Request(prompt, sampling=SamplingParams(temperature=0.0), max_tokens=5)) as s:
            async for _ in s:
                pass
        before = scheduler.cached_ids, scheduler.stats.pages_cached
        steps = []
        async with scheduler.beams(request) as beams:
            async for progress in beams:
                steps.append(progress.step)
        return before, steps, beams.completion()

    before, steps, done = anyio.run(run)
    assert steps == list(range(1, 7))
    assert len(done.beams) == 3 and done.steps == 6
    assert [b.score for b in done.beams] == sorted((b.score for b in done.beams), reverse=True)
    assert all(b.finish_reason is GenerationState.MAX_TOKENS and len(b.token_ids) == 6 for b in done.beams)
    assert len({b.token_ids for b in done.beams}) == 3
    assert (scheduler.cached_ids, scheduler.stats.pages_cached) == before and before[1] > 0


def test_max_time_ends_with_its_own_reason(engine_pair, tokenizer):
    model, _ = engine_pair
    engine = Scheduler(model, tokenizer, SchedulerOptions(max_batch=1))
    prompt = tuple(tokenizer.encode("once", bos=True))
    done = engine.generate(Request(prompt, sampling=SamplingParams(temperature=0.0), max_time=1e-9))
    assert done.finish_reason is GenerationState.MAX_TIME and len(done.token_ids) == 1


def test_max_time_ends_every_beam_with_its_reason(pair):
    model, _ = pair
    limits = BeamLimits(20, GenerationState.MAX_TOKENS, time.perf_counter() - 10.0, max_time=1.0)  # already late
    search = BeamSearch(model, PROMPT, SamplingParams(temperature=0.0), BeamParams(3, 1.0, False, 3), limits=limits,
                        stop_ids=set(), seed=0, vocab=VOCAB, device=torch.device("cpu"), dtype=torch.float32)
    while search.prefill(64):
        pass
    assert search.step() is False  # one token, then the clock ends every hypothesis
    beams = search.result()
    assert len(beams) == 3 and all(b.finish_reason is GenerationState.MAX_TIME and len(b.token_ids) == 1
                                   for b in beams)


def test_a_search_cut_short_returns_its_running_beams_as_cancelled(pair):
    model, _ = pair
    limits = BeamLimits(20, GenerationState.MAX_TOKENS, time.perf_counter())
    search = BeamSearch(model, PROMPT, SamplingParams(temperature=0.0), BeamParams(4, 1.0, False, 2), limits=limits,
                        stop_ids=set(), seed=0, vocab=VOCAB, device=torch.device("cpu"), dtype=torch.float32)
    while search.prefill(64):
        pass
    for _ in range(5):
        assert search.step()
    beams = search.result()
    assert len(beams) == 2 and all(b.finish_reason is GenerationState.CANCELLED and len(b.token_ids) == 5
                                   for b in beams)
    assert beams[0].score >= beams[1].score

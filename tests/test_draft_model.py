"""Speculative decoding with a draft model (``--draft``, ``inference/draft_model.py``): the reply is
the reply without it, token for token, greedy and seeded sampling alike, whether the draft model
guesses well or not at all, with jobs ending inside a draft; its pages go back with each job; the
command refuses a draft model of another vocabulary in one line; the server takes a request's own
``lookup``, ``draft`` and ``draft_max``."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
import torch

from builders import random_model, tiny_args, train_sentencepiece, write_meta_checkpoint
from llama_chat.inference.batch_core import BatchCore
from llama_chat.inference.speculative import PAUSES, DraftCosts, Lookup, ModelDraft, Speculation
from llama_chat.inference.types import Request
from llama_chat.ml.sampling import SamplingParams
from test_speculative import GREEDY, VOCAB, quiet_layers_model, replies_of
from test_speculative import Bytes as Letters

@pytest.fixture(scope="module")
def target(cpu_kernels_loaded):
    """``quiet_layers_model``: its replies follow its last token mostly, and so a near copy of it
    guesses them often."""
    if not cpu_kernels_loaded:
        pytest.skip("drafts are verified by the CPU operator, which is not built here")
    return quiet_layers_model()


@pytest.fixture(scope="module")
def close(target):
    """The target with noise on every weight: it agrees with it often, not always."""
    model = copy.deepcopy(target)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.08 * p.std() * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def stranger(cpu_kernels_loaded):
    """Another random model of the same vocabulary, one layer, narrower: its guesses are refused."""
    if not cpu_kernels_loaded:
        pytest.skip("drafts are verified by the CPU operator, which is not built here")
    return random_model(tiny_args(VOCAB, n_layers=1, dim=32, hidden_dim=64, max_seq_len=512), seed=99)


def prompts(count: int, seed: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple([1] + torch.randint(3, VOCAB, (int(torch.randint(3, 40, (1,), generator=g)),),
                                      generator=g).tolist()) for _ in range(count)]


def requests_of(sampling: SamplingParams, count: int, seed: int = 0, **fields) -> list[Request]:
    """Budgets from 1 to 50 tokens: many end in the middle of a draft."""
    return [Request(p, sampling=sampling, max_tokens=1 + (i * 7) % 50, seed=1000 + i, request_id=f"r{i}", **fields)
            for i, p in enumerate(prompts(count, seed))]


def run(model, requests: list[Request], speculation: Speculation | None, *, max_batch: int = 1):
    """Each request's token ids and finish reason, ``max_batch`` jobs at a time; and the scheduler."""
    return replies_of(model, Letters(), requests, speculation, max_batch=max_batch)


def drafting(draft, **fields) -> Speculation:
    return Speculation(**{"draft_max": 8, "lookup": False, "draft": draft, **fields})


@pytest.mark.parametrize("kind", ["close", "stranger"])
def test_greedy_replies_are_the_same_whether_the_draft_model_guesses_well_or_not(kind, target, request):
    draft = request.getfixturevalue(kind)
    requests = requests_of(GREEDY, count=60)
    want, plain = run(target, requests, None)
    got, drafted = run(target, requests, drafting(draft))
    assert got == want
    stats = drafted.stats
    # The test is only as good as its drafts: the close one's taken often and refused often, the
    # stranger's refused nearly always (and so backing off: few drafted for so many steps).
    refused = stats.drafted_tokens - stats.accepted_tokens
    if kind == "close":
        assert stats.accepted_tokens > 300 and refused > 50, stats
        assert stats.steps < plain.stats.steps
    else:
        assert refused > 50 and stats.accepted_tokens < refused, stats
    runner = drafted.core.draft_runner
    assert runner and runner.pages.in_use == 0  # every job gave its draft pages back


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.2, presence_penalty=0.3),
], ids=["temperature", "controls"])
def test_seeded_sampling_is_the_same_token_for_token(target, close, sampling):
    """The draft model's greedy guesses are only compared with each position's own draw (no
    rejection sampling with its probabilities): the draws are those without a draft."""
    requests = requests_of(sampling, count=30, seed=3)
    want, _ = run(target, requests, None)
    got, drafted = run(target, requests, drafting(close))
    assert got == want
    assert drafted.stats.accepted_tokens > 0


def test_four_jobs_at_once_with_lookup_beside_the_draft_model_and_stop_tokens_inside_drafts(target, close):
    requests = requests_of(GREEDY, count=16, seed=5)
    # A stop token the replies reach: found inside drafts taken whole.
    stopping = [Request(r.prompt_ids, sampling=GREEDY, max_tokens=50, stop_ids=(r.prompt_ids[2],),
                        request_id=r.request_id + "s") for r in requests]
    want, _ = run(target, requests + stopping, None, max_batch=4)
    got, drafted = run(target, requests + stopping, drafting(close, lookup=True, most_jobs=4), max_batch=4)
    assert got == want and drafted.stats.accepted_tokens > 0
    assert any(reason.value == "eos" for _, reason in want.values())
    assert drafted.core.draft_runner.pages.in_use == 0


def test_a_request_may_decline_the_draft_model_or_ask_shorter_drafts(target, close, monkeypatch):
    declining = requests_of(GREEDY, count=6, draft_model=False)
    _, scheduler = run(target, declining, drafting(close))
    assert scheduler.stats.drafted_tokens == 0
    lengths = []
    made = BatchCore._model_drafts

    def recorded(core, asks):
        drafts = made(core, asks)
        lengths.extend(len(d) for _, d in drafts)
        return drafts

    monkeypatch.setattr(BatchCore, "_model_drafts", recorded)
    short = requests_of(GREEDY, count=6, draft_max=2)
    want, _ = run(target, short, None)
    got, _ = run(target, short, drafting(close))
    assert got == want and lengths and max(lengths) <= 2


def test_the_draft_pages_roll_back_to_what_the_job_kept():
    draft = ModelDraft(draft_max=8, written=[1, 2, 3, 4, 5, 6])
    draft.rollback([1, 2, 3, 9])
    assert draft.written == [1, 2, 3] and draft.agreed == 3
    draft.written += [9, 7]
    draft.rollback([1, 2, 3, 9, 7, 7])
    assert draft.written == [1, 2, 3, 9, 7]


def test_the_steps_and_the_draft_models_guesses_are_timed_as_they_run(target, close):
    requests = requests_of(GREEDY, count=8)
    want, _ = run(target, requests, None)
    got, drafted = replies_of(target, Letters(), requests, drafting(close), costs=DraftCosts())
    assert got == want
    costs = drafted.core.draft_costs
    assert costs.guess_s is not None and 1 in costs.step_s and len(costs.step_s) >= 2, costs
    assert costs.line() is not None and costs.per_token(ModelDraft(8)) > costs.per_token(Lookup(8)) >= 0


def test_a_draft_models_drafts_must_pay_for_their_guesses():
    from llama_chat.inference.draft_model import guess_share

    pace = ModelDraft(draft_max=8)
    pace.size = 4
    pace.taken(4, 2, 0.5)  # half kept, at half a step each: it goes on
    assert pace.pause == 0 and pace.size == 3
    pace.taken(3, 1, 0.5)  # a third: it pauses, as after a draft refused whole
    assert pace.pause == PAUSES[1]
    big = random_model(tiny_args(VOCAB, dim=128, hidden_dim=320))
    small = random_model(tiny_args(VOCAB, n_layers=1, dim=32, hidden_dim=64))
    assert 0 < guess_share(small, big) < 0.5 < 1 < guess_share(big, small)


def test_lookup_auto_is_on_except_where_a_single_stream_would_copy_16_bit_weights():
    from llama_chat.cmd.generation_source import lookup_on

    small = random_model(tiny_args(VOCAB), seed=1)  # float32 panels a single stream reads anyway
    half = copy.deepcopy(small).to(torch.bfloat16)
    assert lookup_on("auto", small, 1) and lookup_on("auto", half, 4)
    assert not lookup_on("auto", half, 1)
    assert lookup_on("on", half, 1) and not lookup_on("off", small, 4)


# -- the command and the server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from cli_support import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("draft"))


def test_the_command_refuses_a_draft_model_of_another_vocabulary(tiny, tmp_path):
    from cli_support import run_cli

    tokenizer = train_sentencepiece(tmp_path / "spm", vocab_size=450)
    other = write_meta_checkpoint(random_model(tiny_args(450), seed=4), tmp_path / "other", tokenizer)
    done = run_cli("-m", str(tiny.path), "--draft", str(other), "-n", "4", "-p", "hello")
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert str(other) in lines[0] and str(tiny.path) in lines[0] and "450 tokens against 512" in lines[0], lines


def test_the_command_with_a_draft_model_replies_the_same_and_counts_its_drafts(tiny):
    """The model itself as its own draft (the same vocabulary; most guesses right, not all: its
    keys are the operator's, the prompt's the model's forward, and a random model has near ties);
    bfloat16 weights, which the CPU kernels take whatever the model's size. Such a draft costs as
    much as the step it saves, and so drafts little once timed: how much is the machine's to say."""
    from cli_support import run_cli

    common = ("-m", str(tiny.path), "--dtype", "bfloat16", "-t", "0", "-n", "40", "--template", "none",
              "--lookup", "off", "-p", "the quick brown fox", "--json")
    plain = run_cli(*common)
    drafted = run_cli(*common, "--draft", str(tiny.path))
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr
    off, on = json.loads(plain.stdout), json.loads(drafted.stdout)
    assert on["token_ids"] == off["token_ids"] and "speculation" not in off
    assert 0 < on["speculation"]["accepted_tokens"] <= on["speculation"]["drafted_tokens"], on


def test_the_server_takes_a_requests_own_draft_settings(tiny):
    from serve_support import WAIT_S, start_server, stop_server

    server = start_server(tiny.path, "--draft", str(tiny.path), "--dtype", "bfloat16", "--max-batch", "2",
                          "--lookup", "off")
    try:
        def complete(**fields) -> httpx.Response:
            body = {"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0, **fields}
            return httpx.post(f"{server.url}/v1/completions", json=body, timeout=WAIT_S)

        declined = complete(draft="off", lookup="off")
        assert declined.status_code == 200 and server.metrics()["llama_chat_drafted_tokens_total"] == 0
        drafted = complete(draft_max=3)
        assert drafted.json()["choices"][0]["text"] == declined.json()["choices"][0]["text"]
        assert server.metrics()["llama_chat_accepted_tokens_total"] > 0
        for fields, param in (({"draft_max": 0}, "draft_max"), ({"lookup": "yes"}, "lookup"),
                              ({"draft": True}, "draft")):
            refused = complete(**fields)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    finally:
        assert stop_server(server) == 0, server.log()

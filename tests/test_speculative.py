"""Speculative decoding by prompt lookup (``inference/speculative.py``): the reply is the reply
without it, token for token, greedy and seeded sampling alike, whether drafts are taken whole, in
part or not at all, and where a job stops in the middle of a draft."""

from __future__ import annotations

import math
import random

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import endless_model
from llama_chat.inference.batch_core import BatchCore
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
from llama_chat.inference.speculative import (GUESSES_TIMED, LONGEST_MATCH, PAUSES, ROW_SHARE_UNTIMED, STRONG_MATCH,
                                              DraftCosts, Lookup, Match, ModelDraft, Pace, Speculation,
                                              expected_share, longest_paying, match_class)
from llama_chat.inference.types import Request
from llama_chat.ml.sampling import SamplingParams

VOCAB = 96
EOS = 2
GREEDY = SamplingParams(temperature=0.0)


class Bytes:
    """Just enough of a tokenizer for the scheduler: ids as letters."""

    vocab_size = VOCAB
    eos_id = EOS
    stop_ids = frozenset({EOS})
    special_tokens: dict[str, int] = {}
    strips_leading_space = False

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([97 + token_id % 26])


@pytest.fixture(scope="module")
def model(cpu_kernels_loaded):
    """A random model: its replies rarely repeat, so most drafts are refused, and its logits
    depend on the whole context, so a key written at a wrong place would change its draws."""
    if not cpu_kernels_loaded:
        pytest.skip("drafts are verified by the CPU operator, which is not built here")
    return endless_model(VOCAB, seed=11, eos=EOS, max_seq_len=512)


def quiet_layers_model():
    """A random model whose layers add little to each token's embedding: its next token is mostly
    a function of its last one, while the context still moves its logits (a key written at a wrong
    place would change its draws)."""
    model = endless_model(VOCAB, seed=11, eos=EOS, max_seq_len=512)
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.wo.weight.mul_(0.02)
            layer.feed_forward.w2.weight.mul_(0.02)
    return model


@pytest.fixture(scope="module")
def walker(cpu_kernels_loaded):
    """``quiet_layers_model``: its replies fall into loops that the lookup drafts well."""
    if not cpu_kernels_loaded:
        pytest.skip("drafts are verified by the CPU operator, which is not built here")
    return quiet_layers_model()


def prompts(count: int, seed: int) -> list[tuple[int, ...]]:
    """Half repeat a short phrase (drafts from the prompt itself), half are random (drafts only
    once the reply repeats, or never)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        if i % 2:
            phrase = torch.randint(3, VOCAB, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
            out.append(tuple([1] + phrase * 4))
        else:
            out.append(tuple([1] + torch.randint(3, VOCAB, (int(torch.randint(3, 24, (1,), generator=g)),),
                                                 generator=g).tolist()))
    return out


def replies(model, requests: list[Request], speculation: Speculation | None, *, max_batch: int = 1):
    """Each request's token ids and finish reason, ``max_batch`` jobs at a time; and the stats."""
    out, scheduler = replies_of(model, Bytes(), requests, speculation, max_batch=max_batch)
    return out, scheduler.stats


class PinnedCosts(DraftCosts):
    """Draft costs that stay as given, whatever the steps take: what pays is then the test's
    choice, not the machine's speed (which decides nothing a reply holds)."""

    def __init__(self, row_share: float = 0.15, guess_share: float = 0.3) -> None:
        super().__init__()
        self.pinned = (row_share, guess_share)

    def per_token(self, pace, jobs: int = 1) -> float:
        return self.pinned[0] + (self.pinned[1] if isinstance(pace, ModelDraft) else 0.0)

    def line(self) -> None:  # no step is timed: drafts as long as their pinned costs pay
        return None


def replies_of(model, tokenizer, requests: list[Request], speculation: Speculation | None, *,
               max_batch: int = 1, costs: DraftCosts | None = None) -> tuple[dict, Scheduler]:
    """Each request's token ids and finish reason, ``max_batch`` jobs at a time; and the scheduler.
    Drafts cost as ``costs`` says (default: ``PinnedCosts()``; a ``DraftCosts()``: as timed)."""
    scheduler = Scheduler(model, tokenizer, SchedulerOptions(max_batch=max_batch, page_size=8, cache_tokens=2048,
                                                             speculation=speculation, cache_type="f32"))
    scheduler.core.draft_costs = PinnedCosts() if costs is None else costs

    async def main():
        out = {}

        async def one(request):
            async with scheduler.submit(request) as stream:
                async for _ in stream:
                    pass
            done = stream.completion()
            out[request.request_id] = (done.token_ids, done.finish_reason)

        async with scheduler:
            for start in range(0, len(requests), max_batch):
                async with anyio.create_task_group() as tg:
                    for request in requests[start:start + max_batch]:
                        tg.start_soon(one, request)
        return out

    return anyio.run(main), scheduler


def requests_of(sampling: SamplingParams, count: int = 100, seed: int = 0) -> list[Request]:
    """Budgets from 1 to 60 tokens: many end in the middle of a draft."""
    return [Request(p, sampling=sampling, max_tokens=1 + (i * 7) % 60, seed=1000 + i, request_id=f"r{i}")
            for i, p in enumerate(prompts(count, seed))]


@pytest.mark.parametrize("kind", ["walker", "model"])
def test_greedy_replies_are_the_same_with_drafts_taken_whole_in_part_and_not_at_all(kind, request):
    model = request.getfixturevalue(kind)
    requests = requests_of(GREEDY)
    want, plain = replies(model, requests, None)
    got, stats = replies(model, requests, Speculation(draft_max=8))
    assert got == want
    assert plain.drafted_tokens == 0
    # The test is only as good as its drafts: many taken, many refused.
    taken = 300 if kind == "walker" else 30
    assert stats.accepted_tokens > taken and stats.drafted_tokens - stats.accepted_tokens > 100, stats
    assert stats.steps < plain.steps


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.9, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.2, presence_penalty=0.3),
], ids=["temperature", "top-p", "controls"])
def test_seeded_sampling_is_the_same_token_for_token(model, sampling):
    """Each position's token is drawn with that position's uniform from logits that do not
    depend on the draft: the draws are the draws without one, so the outputs are equal (and so
    are their distributions)."""
    requests = requests_of(sampling, count=40, seed=3)
    want, _ = replies(model, requests, None)
    got, stats = replies(model, requests, Speculation(draft_max=6))
    assert got == want
    assert stats.drafted_tokens > 0


def test_several_jobs_at_once_and_a_stop_token_inside_a_draft(walker):
    model = walker
    requests = requests_of(GREEDY, count=24, seed=5)
    # A stop token that the repeating replies reach: found inside drafts taken whole.
    stopping = [Request(r.prompt_ids, sampling=GREEDY, max_tokens=60, stop_ids=(r.prompt_ids[2],),
                        request_id=r.request_id + "s") for r in requests]
    want, _ = replies(model, requests + stopping, None, max_batch=4)
    got, stats = replies(model, requests + stopping, Speculation(draft_max=8, most_jobs=4), max_batch=4)
    assert got == want and stats.accepted_tokens > 0
    assert any(reason.value == "eos" for _, reason in want.values())


def test_a_request_may_decline_and_many_jobs_do_not_draft(model, monkeypatch):
    requests = [Request(r.prompt_ids, sampling=GREEDY, max_tokens=40, request_id=r.request_id)
                for r in requests_of(GREEDY, count=6)]
    declining = [Request(r.prompt_ids, sampling=GREEDY, max_tokens=40, speculate=False, request_id=r.request_id)
                 for r in requests]
    _, stats = replies(model, declining, Speculation())
    assert stats.drafted_tokens == 0
    seen = []
    drafts = BatchCore._drafts

    def recorded(core, decoding):
        made = drafts(core, decoding)
        seen.append((len(core.active), len(made)))
        return made

    monkeypatch.setattr(BatchCore, "_drafts", recorded)
    replies(model, requests, Speculation(most_jobs=2), max_batch=6)
    assert any(running > 2 for running, _ in seen)
    assert all(made == 0 for running, made in seen if running > 2), seen


def test_the_next_turn_finds_the_pages_a_speculating_turn_left(walker):
    model = walker
    """Pages are registered under their tokens' keys only once every slot holds a kept token:
    the next request on the same prefix (a chat's next turn) reuses them and replies the same."""
    first = Request(prompts(2, 7)[1], sampling=GREEDY, max_tokens=50, request_id="a")
    outs = {}
    for name, speculation in (("plain", None), ("drafts", Speculation(draft_max=8))):
        scheduler = Scheduler(model, Bytes(), SchedulerOptions(max_batch=1, page_size=8, cache_tokens=1024,
                                                               speculation=speculation, cache_type="f32"))
        done = scheduler.generate(first)
        second = Request(first.prompt_ids + done.token_ids + (5, 6, 7), sampling=GREEDY, max_tokens=40,
                         request_id="b")
        again = scheduler.generate(second)
        outs[name] = (done.token_ids, again.token_ids, scheduler.stats.cached_tokens)
    assert outs["drafts"] == outs["plain"] and outs["plain"][2] > 0


def match_at(tokens: list[int], at: int) -> int:
    """How many tokens before ``at`` equal ``tokens``' last ones, to LONGEST_MATCH."""
    n = 0
    while n < LONGEST_MATCH and at - n > 0 and tokens[at - n - 1] == tokens[len(tokens) - n - 1]:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 12))
def test_a_draft_copies_what_followed_the_longest_earlier_match(tokens, room):
    lookup = Lookup(draft_max=12)
    costs = PinnedCosts(row_share=0.01)
    match = lookup.match(tokens)
    lengths = [match_at(tokens, at) for at in range(len(tokens))]
    if max(lengths) == 0:
        assert match is None and lookup.draft(tokens, room, costs) == []
        return
    # The longest, and the latest of the longest.
    assert match.length == lengths[match.at] == max(lengths)
    assert all(n < match.length for n in lengths[match.at + 1:])
    draft = Lookup(draft_max=12).draft(tokens, room, costs)
    assert 1 <= len(draft) <= room
    # What followed the match, the copy going on where it runs into the tail (a repeating reply).
    whole = tokens + draft
    assert draft == [whole[match.at + i] for i in range(len(draft))]


def drafted_reply(prompt: list[int], reply: list[int], costs: DraftCosts, lookup: Lookup | None = None):
    """A greedy reply drafted by lookup as the core drafts it (``BatchCore._drafts`` and
    ``_record``): each step drafts, keeps the draft up to the first token the reply does not
    have there, and the reply's token at that place. Returns the reply's positions whose tokens
    came from drafts, the steps taken and the tokens drafted."""
    lookup = lookup or Lookup(draft_max=8)
    tokens, kept, steps, drafted = list(prompt), set(), 0, 0
    while len(tokens) < len(prompt) + len(reply):
        at = len(tokens) - len(prompt)
        draft = lookup.draft(tokens, len(reply) - at - 1, costs) if costs.drafts_now(lookup) else []
        accepted = 0
        while accepted < len(draft) and draft[accepted] == reply[at + accepted]:
            accepted += 1
        if draft:
            lookup.pending = len(draft)
            lookup.taken(len(draft), accepted, lookup.pending_cost)
            costs.kept(lookup, len(draft), accepted)
            drafted += len(draft)
        kept.update(range(at, at + accepted))
        tokens += reply[at:at + accepted + 1]
        steps += 1
    return kept, steps, drafted


def code_edit(seed: int, functions: int = 6, *, tokens: int = 8) -> tuple[list[int], list[int], set[int]]:
    """An edit as "add a docstring to each function" gives it: a prompt holding a file of
    functions, and a reply that copies each whole, a new docstring line after its first line.
    Code and docstrings are made of a few ``tokens`` (indents, keywords, punctuation), so short
    n-grams occur all over the file and the reply, and only a long match finds the right place.
    Returns the prompt, the reply and the reply's positions that copy the prompt."""
    g = random.Random(seed)

    def line(n: int) -> list[int]:
        return [g.randrange(3, 3 + tokens) for _ in range(n)]

    file = [[line(8), line(10), line(10), line(10)] for _ in range(functions)]
    prompt = [1] + line(12) + [t for f in file for part in f for t in part]
    reply: list[int] = []
    copies: set[int] = set()
    for first, *body in file:
        copies.update(range(len(reply), len(reply) + len(first)))
        reply += first + line(9)
        body = [t for part in body for t in part]
        copies.update(range(len(reply), len(reply) + len(body)))
        reply += body
    return prompt, reply, copies


@pytest.mark.parametrize("seed", range(5))
def test_a_copy_heavy_reply_is_drafted_after_early_misses(seed):
    """The docstrings' new text is drafted from short matches all over the file, and missed; the
    copied lines after each are long matches, drafted whatever the misses before them."""
    prompt, reply, copies = code_edit(seed)
    kept, steps, drafted = drafted_reply(prompt, reply, PinnedCosts())
    # A match needs a few copied tokens to be told from the short ones around, and each step
    # draws one token itself: the rest are drafted.
    assert len(kept & copies) > 0.7 * len(copies), (len(kept & copies), len(copies))
    assert steps < 0.4 * len(reply)
    # The early misses happened: the docstrings' drafts were refused.
    assert drafted - len(kept) > 10


def test_open_ended_text_drafts_little():
    """A reply of new text over a small vocabulary: its last token or two occurred before at
    nearly every step, and what followed them then is what follows now once in sixteen. The
    refused drafts' rows cost little of the steps, and less as the classes pause."""
    g = random.Random(5)
    costs = PinnedCosts()
    for job in range(4):
        prompt = [g.randrange(3, 19) for _ in range(40)]
        reply = [g.randrange(3, 19) for _ in range(400)]
        kept, steps, drafted = drafted_reply(prompt, reply, costs)
        assert drafted * costs.per_token(None) < 0.03 * steps, (job, drafted, steps)


def test_a_long_match_drafts_while_short_ones_pause():
    lookup, costs = Lookup(draft_max=8), PinnedCosts()
    line = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    prompt = [1] + line + [5, 6, 7, 8]
    # Short matches refused again and again: their class pauses, longer each time.
    for _ in range(5):
        assert lookup.match(prompt + [5]).length == 1
        lookup.pending_class = match_class(1)
        lookup.taken(1, 0, 0.15)
    assert lookup.paused[1][0] == PAUSES[5]
    assert lookup.draft(prompt + [5], 8, costs) == []  # paused
    # A copied span's match is long: drafted at once, as long as its share pays.
    tail = prompt + line[:5]
    assert lookup.match(tail) == Match(6, 5)
    share = lookup.share(5, costs)
    assert share == expected_share(5)
    draft = lookup.draft(tail, 8, costs)
    assert draft == line[5:5 + len(draft)] and len(draft) == longest_paying(share, 0.15, 8) > 3
    lookup.taken(len(draft), len(draft), 0.15)
    costs.kept(lookup, len(draft), len(draft))
    assert lookup.share(5, costs) > share  # kept whole: that class's drafts grow


def test_a_match_class_refused_draws_every_jobs_first_draft_of_it_shorter():
    costs = PinnedCosts()
    for _ in range(20):
        lookup = Lookup(draft_max=8)
        lookup.pending_class = match_class(4)
        lookup.taken(4, 0, 0.15)
        costs.kept(lookup, 4, 0)
    assert Lookup(8).share(4, costs) < 0.2 < expected_share(4) < Lookup(8).share(8, costs)
    assert Lookup(8).share(8, costs) == expected_share(8)


def test_a_draft_that_does_not_pay_for_its_rows_pauses_its_match_class():
    lookup = Lookup(draft_max=8)
    lookup.pending_class = 4
    lookup.taken(8, 2, 0.3)  # 2 kept of 8 that cost 2.4 steps
    assert lookup.paused[4] == [PAUSES[1], 1]
    lookup.taken(3, 1, 0.3)  # 1 of 3 that cost 0.9: it paid
    assert lookup.paused[4] == [0, 0]
    assert 8 not in lookup.paused


def test_where_rows_were_timed_at_a_step_a_token_only_a_strong_match_drafts_one_token():
    costs = DraftCosts()
    costs.stepped(1, 0.010)
    costs.stepped(2, 0.022)  # a row timed at 1.2 steps (a busy moment): no draft can pay by it
    lookup = Lookup(draft_max=8)
    assert costs.per_token(lookup) == pytest.approx(1.2) and costs.timed(lookup) and costs.drafts_now(lookup)
    line = list(range(10, 30))
    prompt = [1] + line + [5, 6]
    assert lookup.draft(prompt + line[:STRONG_MATCH - 1], 8, costs) == []  # not strong enough
    strong = prompt + line[:STRONG_MATCH]
    assert lookup.match(strong).length == STRONG_MATCH
    assert lookup.draft(strong, 8, costs) == [line[STRONG_MATCH]]  # one token: its step times the rows again
    lookup.taken(1, 1, lookup.pending_cost)  # kept, but it cost more than the step it saved
    kind = match_class(STRONG_MATCH)
    assert lookup.paused[kind] == [PAUSES[1], 1]
    assert lookup.draft(strong + line[STRONG_MATCH:STRONG_MATCH + 1], 8, costs) == []  # its class pauses
    # New text over a small vocabulary, its rows at 1.2 steps: long matches are rare, and drafts with them.
    g = random.Random(3)
    kept, steps, drafted = drafted_reply([g.randrange(3, 19) for _ in range(40)],
                                         [g.randrange(3, 19) for _ in range(400)], costs)
    assert drafted * (costs.per_token(lookup) - 1) < 0.03 * steps, (drafted, steps)


def test_the_timed_rows_follow_the_load_the_plain_steps_show():
    costs = DraftCosts()
    costs.stepped(1, 0.010)
    costs.stepped(2, 0.016)  # a row at 0.6 of a step
    assert costs.per_token(Lookup(8)) == pytest.approx(0.6)
    for _ in range(60):  # the machine quietens: plain steps take half as long, and no draft is timed
        costs.stepped(1, 0.005)
    assert costs.step_s[1] == pytest.approx(0.005, rel=0.01)
    # The row's time moved with them: its cost is still what both steps said when timed together,
    # not 0.006 s over 0.005 s (which would stop every draft).
    assert costs.step_s[2] == pytest.approx(0.008, rel=0.01)
    assert costs.per_token(Lookup(8)) == pytest.approx(0.6)
    costs.stepped(2, 0.0065)  # a row timed again, at 0.3 of a step
    assert 0.5 < costs.per_token(Lookup(8)) < 0.6


def test_the_longest_draft_is_the_one_whose_last_token_still_pays():
    pace = Pace(draft_max=16)
    assert pace.longest_paying(0.3) == 16  # nothing drafted yet
    for _ in range(40):  # 3 of 4 kept, then refused: p = 0.75
        pace.taken(4, 3, 0.3)
    assert pace.longest_paying(0.3) == int(math.log(0.3) / math.log(0.75)) == 4
    assert pace.longest_paying(0.5) == 2
    assert pace.longest_paying(0.8) == 1  # cannot pay: one token, after each pause
    pace.taken(4, 4, 1.1)  # kept whole, but each cost more than the step it saved
    assert pace.pause > 0


def test_draft_costs_are_shares_of_the_timed_steps():
    costs = DraftCosts(guess_share_untimed=0.4)
    lookup, model = Lookup(8), ModelDraft(8)
    assert costs.per_token(lookup) == ROW_SHARE_UNTIMED and costs.per_token(model) == pytest.approx(0.55)
    # Four jobs share a step: a row costs more of what a kept token saves one of them.
    assert costs.per_token(lookup, 4) == pytest.approx(0.15 / ((0.85 + 4 * 0.15) / 4))
    costs.stepped(5, 0.022)
    costs.stepped(9, 0.034)  # 3 ms a row, 7 ms a step's fixed time: a one-job step 10 ms, never timed alone
    assert costs.line() == pytest.approx((0.007, 0.003))
    assert costs.per_token(lookup) == pytest.approx(0.3) and costs.per_token(model) == pytest.approx(0.7)
    assert not costs.timed(model) and costs.timed(lookup)
    costs.guessed(4, 0.036)
    assert costs.per_token(model) == pytest.approx(1.2) and costs.timed(model) == (GUESSES_TIMED == 1)
    assert costs.per_token(lookup, 4) == pytest.approx(0.003 / ((0.007 + 4 * 0.003) / 4))
    costs.stepped(1, 0.012)  # timed alone too: the line fits the three, and the step saved is the one timed
    fixed, row = costs.line()
    assert 0.0027 < row < 0.003 and costs.per_token(lookup) == pytest.approx(row / 0.012)
    costs.stepped(9, 1.0)  # a hiccup weighs as three times what nine rows took
    assert costs.step_s[9] == pytest.approx(0.034 + 0.1 * (3 * 0.034 - 0.034))


def test_a_lone_jobs_draft_is_as_long_as_gives_most_tokens_a_second_by_the_timed_steps():
    costs = DraftCosts()
    for rows, ms in {1: 10, 2: 11.5, 3: 13, 4: 14.5, 5: 21, 9: 33}.items():
        costs.stepped(rows, ms / 1000)
    lookup = Lookup(8)
    for _ in range(50):
        lookup.taken(8, 7, 0.1)
    assert lookup.kept_share == pytest.approx(7 / 8)
    # Four rows go through the products together and a fifth costs a group's time: drafts of 3.
    assert costs.longest(lookup) == 3
    assert costs.longest(lookup, jobs=2) == 2  # beside another job: its two rows and two drafted fill a group
    assert costs.longest(Lookup(8)) == 8  # nothing drafted yet, by this job or any
    for _ in range(50):
        costs.kept(lookup, 8, 7)
    assert costs.longest(Lookup(8)) == 3  # a job's first draft: as long as every job's drafts say


def test_a_long_draft_is_judged_by_the_nearest_timed_steps():
    # A 1.5B model's steps on 2 cores: up to 11 rows share each decoded weight (12 ms a row), from
    # 12 on the rows take tiles of weights decoded once (a dearer start, 6 ms a row after it).
    costs = DraftCosts()
    for rows, ms in {1: 34, 2: 42.5, 4: 64, 8: 124, 12: 201, 16: 237, 33: 331}.items():
        costs.stepped(rows, ms / 1000)
    assert costs.step_time(8) == costs.step_s[8]
    assert costs.step_time(24) == pytest.approx(costs.step_s[16] + (costs.step_s[33] - costs.step_s[16]) * 8 / 17)
    fixed, row = costs.line()
    assert costs.step_time(40) == pytest.approx(fixed + row * 40)  # past the last count timed: the line
    copy = Lookup(32)
    for _ in range(50):  # a copied file: its drafts kept whole
        copy.taken(32, 32, 0.1)
    # 33 rows give 0.10 tokens a ms, 8 rows 0.065: the longest draft.
    assert costs.longest(copy) == 32
    new_text = Lookup(32)
    for _ in range(50):
        new_text.taken(8, 6, 0.1)  # three in four kept: short drafts, where a row shares the weights
    assert 1 <= costs.longest(new_text) <= 7
    # Beside three other jobs a row more costs about what a kept token saves (4 rows 64 ms, 8 124):
    # new text drafts nothing, a copied file still drafts into the tiles.
    assert costs.longest(new_text, jobs=4) == 0
    assert costs.longest(copy, jobs=4) == 29


def test_a_drafter_timed_at_a_step_a_token_stops_drafting():
    costs = DraftCosts(guess_share_untimed=2.0)
    model = ModelDraft(8)
    assert costs.drafts_now(model)  # estimated to cost two steps a token, but not timed: alone, it drafts
    assert not costs.drafts_now(model, jobs=2)  # beside another job, the estimate decides
    costs.stepped(1, 0.010)
    costs.stepped(3, 0.016)
    for _ in range(GUESSES_TIMED):
        assert costs.drafts_now(model)
        costs.guessed(2, 0.020)  # a guess as long as a step
    assert costs.per_token(model) == pytest.approx(1.3) and costs.timed(model)
    assert not costs.drafts_now(model)
    assert costs.drafts_now(Lookup(8))  # rows at 0.3 of a step: lookup pays
    assert model.longest_paying(costs.per_token(model)) == 1


def test_a_draft_model_drafts_for_a_job_alone_only_where_its_best_draft_beats_a_plain_step():
    costs = DraftCosts()
    for rows, ms in {1: 10, 2: 11.5, 3: 13, 5: 21}.items():
        costs.stepped(rows, ms / 1000)
    for _ in range(GUESSES_TIMED):
        costs.guessed(1, 0.006)  # a guess at 0.6 of a step, a row at 0.15: 0.75 a token
    pace = ModelDraft(8)
    assert costs.drafts_now(pace)  # nothing kept or refused yet, by this job or any
    for _ in range(30):
        costs.kept(pace, 2, 0)  # every job's guesses refused lately
    assert not costs.drafts_now(pace)
    for _ in range(30):
        pace.taken(4, 4, 0.75)  # but this job's are kept whole
    assert costs.drafts_now(pace)
    assert costs.drafts_now(Lookup(8))  # lookup's guesses cost nothing to make


def test_the_command_drafts_with_lookup_on_and_says_how_many_were_kept(cpu_kernels_loaded, tmp_path):
    """Through the installed command: the same reply with and without ``--lookup on``, and what
    was drafted and kept in ``--json`` and in ``--stats``. (bfloat16 weights: the CPU kernels
    take them whatever the model's size, and drafts need them.)"""
    if not cpu_kernels_loaded:
        pytest.skip("drafts are verified by the CPU operator, which is not built here")
    import json

    from cli_support import build_tiny_model, run_cli

    tiny = build_tiny_model(tmp_path)
    common = ("-m", str(tiny.path), "--dtype", "bfloat16", "-t", "0", "-n", "80", "--template", "none",
              "-p", "one two three four one two three four one two three four one two")
    off = run_cli(*common, "--json", "--lookup", "off")
    on = run_cli(*common, "--json", "--stats", "--lookup", "on")  # how many: as the steps were timed
    assert off.returncode == 0 and on.returncode == 0, on.stderr
    plain, drafted = json.loads(off.stdout), json.loads(on.stdout)
    assert drafted["token_ids"] == plain["token_ids"] and "speculation" not in plain
    assert drafted["speculation"]["drafted_tokens"] > 0, drafted
    assert f"drafts: {drafted['speculation']['accepted_tokens']} of {drafted['speculation']['drafted_tokens']} " \
           f"tokens kept" in on.stderr.decode()

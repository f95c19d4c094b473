"""The batching scheduler: batched jobs match jobs run alone, prefixes are prefilled once, a cancel
frees its pages, slow consumers hold back only their own job, and a chat turn reuses its pages."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

from builders import endless_model, single_stream
from llama_chat.inference import batch_step
from llama_chat.inference.batch_core import BatchCore
from llama_chat.inference.batch_step import Kind, StepBackends
from llama_chat.inference.jobs import Job
from llama_chat.inference.decode_step import LoneGraph
from llama_chat.inference.source import Source
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
from llama_chat.inference.types import GenerationState, PromptTooLong, Request, RequestError, stop_ids_of
from llama_chat.ml.sampling import SamplingParams
from llama_chat.model import cpu_decode, paged_kv_cache
from llama_chat.model.chat_format import Llama2ChatFormat, Message
from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer

GREEDY = SamplingParams(temperature=0.0)
WAIT_S = 120.0  # for a step held by a test to be released, on however busy a machine
EOS = 2
ALONE = SchedulerOptions(max_batch=1)  # one job at a time: the reference a batch's jobs are held to


@pytest.fixture(scope="module")
def tokenizer(sp_model_path):
    return SentencePieceTokenizer(sp_model_path)


@pytest.fixture(scope="module")
def model(tokenizer):
    return endless_model(tokenizer.vocab_size, seed=5, eos=EOS)


def random_prompt(g: torch.Generator, n: int, vocab: int) -> list[int]:
    return [1] + torch.randint(3, vocab, (n - 1,), generator=g).tolist()


async def run_jobs(scheduler: Scheduler, requests: list[Request]) -> dict[str, object]:
    """Submit every request at once and consume all streams concurrently; completions by id."""
    out = {}

    async def consume(stream):
        async for _ in stream:
            pass
        out[stream.request_id] = stream.completion()

    streams = [scheduler.submit(r) for r in requests]
    async with anyio.create_task_group() as tg:
        for stream in streams:
            tg.start_soon(consume, stream)
    return out


def batched(model, tokenizer, requests, **options):
    async def main():
        async with Scheduler(model, tokenizer, SchedulerOptions(**options)) as scheduler:
            return await run_jobs(scheduler, requests), scheduler.stats
    return anyio.run(main)


def near_tie(model, ids: list[int], position: int, margin: float = 1e-3) -> bool:
    """Whether the top two logits after ``ids[:position]`` are within ``margin`` of each other."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids[:position]]))[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1]) < margin


def test_64_mixed_jobs_batched_give_the_ids_of_each_job_alone(model, tokenizer):
    g = torch.Generator().manual_seed(11)
    requests = [Request(random_prompt(g, int(torch.randint(1, 200, (1,), generator=g)), tokenizer.vocab_size),
                        sampling=GREEDY, max_tokens=int(torch.randint(1, 48, (1,), generator=g)), request_id=f"j{i}")
                for i in range(64)]
    single = Scheduler(model, tokenizer, ALONE)
    alone = {r.request_id: single.generate(r) for r in requests}
    results, stats = batched(model, tokenizer, requests, max_batch=64, page_size=16)
    assert stats.jobs_finished == 64 and stats.pages_in_use == 0
    assert stats.mixed_steps > 0  # prompt chunks and decodes did share forwards
    differing = []
    for r in requests:
        a, b = alone[r.request_id].token_ids, results[r.request_id].token_ids
        assert results[r.request_id].finish_reason == GenerationState.MAX_TOKENS
        if a != b:
            first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            differing.append((r, first))
    # float32 sums in another order may flip a near-tie, and then only there (docs/batching.md).
    assert len(differing) <= 1
    for r, first in differing:
        ids = list(r.prompt_ids) + list(alone[r.request_id].token_ids)
        assert near_tie(model, ids, len(r.prompt_ids) + first)


def test_static_shapes_give_the_same_ids(model, tokenizer):
    g = torch.Generator().manual_seed(12)
    requests = [Request(random_prompt(g, 5 + 9 * i, tokenizer.vocab_size), sampling=GREEDY, max_tokens=3 + 2 * i,
                        request_id=f"s{i}") for i in range(7)]
    plain, _ = batched(model, tokenizer, requests, max_batch=8, page_size=8)
    padded, _ = batched(model, tokenizer, requests, max_batch=8, page_size=8, static_shapes=True)
    assert {k: v.token_ids for k, v in plain.items()} == {k: v.token_ids for k, v in padded.items()}


def test_seeded_sampling_and_stop_strings_per_job_match_each_job_alone(model, tokenizer):
    g = torch.Generator().manual_seed(13)
    requests = [
        Request(random_prompt(g, 30, tokenizer.vocab_size), sampling=SamplingParams(temperature=0.9, top_p=0.9),
                seed=7, max_tokens=20, request_id="sampled"),
        Request(random_prompt(g, 12, tokenizer.vocab_size), sampling=SamplingParams(temperature=1.0, top_k=20,
                                                                                    repetition_penalty=1.3),
                seed=3, max_tokens=20, request_id="controls"),
        Request(random_prompt(g, 40, tokenizer.vocab_size), sampling=GREEDY, max_tokens=30, request_id="greedy"),
    ]
    single = Scheduler(model, tokenizer, ALONE)
    alone = {r.request_id: single.generate(r) for r in requests}
    # A stop string: part of the greedy job's own text, so it must cut there.
    text = alone["greedy"].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    requests.append(Request(requests[2].prompt_ids, sampling=GREEDY, max_tokens=30, request_id="stopped",
                            stop=(stop,)))
    alone["stopped"] = single.generate(requests[-1])
    results, stats = batched(model, tokenizer, requests)
    for r in requests:
        assert results[r.request_id].token_ids[:len(alone[r.request_id].token_ids)] == alone[r.request_id].token_ids
        assert results[r.request_id].text == alone[r.request_id].text
    assert results["stopped"].finish_reason == GenerationState.STOP_STRING
    assert stats.pages_in_use == 0


def test_jobs_sharing_a_512_token_prefix_prefill_it_once(model, tokenizer):
    g = torch.Generator().manual_seed(14)
    prefix = random_prompt(g, 512, tokenizer.vocab_size)
    suffixes = [torch.randint(3, tokenizer.vocab_size, (n,), generator=g).tolist() for n in (9, 20, 33, 5)]
    requests = [Request(prefix + s, sampling=GREEDY, max_tokens=6, request_id=f"p{i}") for i, s in enumerate(suffixes)]
    single = Scheduler(model, tokenizer, ALONE)
    alone = {r.request_id: single.generate(r).token_ids for r in requests}
    results, stats = batched(model, tokenizer, requests, max_batch=8, page_size=16)
    assert {k: v.token_ids for k, v in results.items()} == alone
    # The first job prefills the 512 shared tokens (32 pages); the three others find them.
    assert stats.prefill_tokens == 512 + sum(len(s) for s in suffixes)
    assert stats.cached_tokens == 3 * 512
    assert sorted(c.cached_tokens for c in results.values()) == [0, 512, 512, 512]
    # Shared pages are held once: 32 for the prefix, and each job's own tail.
    own = sum(-(-(len(s) + 6) // 16) for s in suffixes)
    assert stats.pages_peak <= 32 + own


def test_released_prefix_pages_are_reused_until_their_space_is_needed(model, tokenizer):
    g = torch.Generator().manual_seed(15)
    prompt = random_prompt(g, 100, tokenizer.vocab_size)

    async def main():
        # 12 pages of 16: one job of 100 + 4 tokens takes 7 of them.
        async with Scheduler(model, tokenizer, SchedulerOptions(cache_tokens=12 * 16, page_size=16)) as s:
            first = await run_jobs(s, [Request(prompt, sampling=GREEDY, max_tokens=4, request_id="a")])
            cached_after_first = s.stats.pages_cached
            again = await run_jobs(s, [Request(prompt, sampling=GREEDY, max_tokens=4, request_id="b")])
            other = await run_jobs(s, [Request(random_prompt(g, 150, tokenizer.vocab_size), sampling=GREEDY,
                                               max_tokens=4, request_id="c")])
            return first["a"], again["b"], other["c"], cached_after_first, s.stats
    a, b, c, cached_after_first, stats = anyio.run(main)
    assert cached_after_first == 6  # 99 prompt tokens fed then 3 more: 6 full pages
    assert b.cached_tokens == 96 and b.token_ids == a.token_ids
    assert c.finish_reason == GenerationState.MAX_TOKENS
    assert stats.evictions > 0  # the third job needed the space of the cached pages


def test_cancelling_one_job_frees_its_pages_and_the_others_finish_unchanged(model, tokenizer):
    g = torch.Generator().manual_seed(16)
    keep = [Request(random_prompt(g, 20 + 10 * i, tokenizer.vocab_size), sampling=GREEDY, max_tokens=60,
                    request_id=f"k{i}") for i in range(2)]
    victim = Request(random_prompt(g, 50, tokenizer.vocab_size), sampling=GREEDY, max_tokens=400, request_id="v")
    single = Scheduler(model, tokenizer, ALONE)
    alone = {r.request_id: list(single.generate(r).token_ids) for r in keep}

    async def main():
        async with Scheduler(model, tokenizer, SchedulerOptions(page_size=16, buffer_size=2)) as s:
            streams = [s.submit(r) for r in keep]
            # Both running (each has sent a token) before the count is taken.
            firsts = [await stream.__anext__() for stream in streams]
            before = s.stats
            stream = s.submit(victim)
            taken = 0
            async for _ in stream:
                taken += 1
                if taken == 5:
                    break
            during = s.stats.pages_available
            stream.cancel()
            await s.wait_released(stream)
            after = s.stats
            rest = {}
            for st, first in zip(streams, firsts):
                ids = [first.token_id]
                async for response in st:
                    ids.append(response.token_id)
                rest[st.request_id] = ids
            return before, during, after, rest, stream.completion()
    before, during, after, rest, cancelled = anyio.run(main)
    assert during < before.pages_available
    assert after.pages_available == before.pages_available
    assert cancelled.finish_reason == GenerationState.CANCELLED and len(cancelled.token_ids) == 5
    assert rest == alone


def test_a_slow_consumer_holds_back_only_its_own_job(model, tokenizer):
    g = torch.Generator().manual_seed(17)
    slow = Request(random_prompt(g, 10, tokenizer.vocab_size), sampling=GREEDY, max_tokens=200, request_id="slow")
    fast = Request(random_prompt(g, 10, tokenizer.vocab_size), sampling=GREEDY, max_tokens=80, request_id="fast")

    async def main():
        async with Scheduler(model, tokenizer, SchedulerOptions(buffer_size=4)) as s:
            slow_stream = s.submit(slow)
            done = await run_jobs(s, [fast])
            produced_while_unread = slow_stream.job.produced
            slow_stream.cancel()
            await s.wait_released(slow_stream)
            return done["fast"], produced_while_unread
    fast_done, produced = anyio.run(main)
    assert fast_done.finish_reason == GenerationState.MAX_TOKENS
    assert produced <= 4  # its channel's size: nothing piled up for the reader that never came


def test_a_job_alone_stops_at_a_full_channel_and_goes_on_when_it_is_read(model, tokenizer):
    # A job alone takes the short path; with nobody reading it stops at its channel's size, and
    # goes on, to the same tokens as a reader that keeps up, once a slow reader takes them.
    request = Request(random_prompt(torch.Generator().manual_seed(8), 9, tokenizer.vocab_size), sampling=GREEDY,
                      max_tokens=40)

    async def main():
        async with Scheduler(model, tokenizer, SchedulerOptions(max_batch=1, buffer_size=3)) as s:
            stream = s.submit(request)
            with anyio.fail_after(WAIT_S):
                while stream.job.produced < 3:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.2)
            unread = stream.job.produced
            async for _ in stream:
                await anyio.sleep(0.002)
            return unread, stream.completion()

    unread, slowly = anyio.run(main)
    assert unread == 3
    assert slowly.token_ids == Scheduler(model, tokenizer, ALONE).generate(request).token_ids


def test_the_chat_next_turn_reuses_its_pages(model, tokenizer):
    chat = Llama2ChatFormat(tokenizer)
    dialog = [Message("user", "Once upon a time there was a little fox who lived in the forest.")]
    first_ids = chat.encode_dialog(dialog, add_generation_prompt=True)

    async def main():
        async with Scheduler(model, tokenizer, SchedulerOptions(page_size=8)) as s:
            first = (await run_jobs(s, [Request(first_ids, sampling=GREEDY, max_tokens=40, request_id="t1",
                                                chat_reply=True)]))["t1"]
            reply = first.text
            second_ids = chat.encode_dialog(dialog + [Message("assistant", reply),
                                                      Message("user", "And then what happened?")])
            second = (await run_jobs(s, [Request(second_ids, sampling=GREEDY, max_tokens=10, request_id="t2",
                                                 chat_reply=True)]))["t2"]
            return first, second_ids, second
    first, second_ids, second = anyio.run(main)
    # Written to the pages in turn one: the prompt and every reply token but the last.
    written = list(first_ids) + list(first.token_ids[:-1])
    common = next((i for i, (a, b) in enumerate(zip(written, second_ids)) if a != b), min(len(written), len(second_ids)))
    expected = min(common, len(second_ids) - 1) // 8 * 8
    assert expected >= len(first_ids) // 8 * 8 > 0
    assert second.cached_tokens == expected
    assert second.token_ids == Scheduler(model, tokenizer, ALONE).generate(
        Request(second_ids, sampling=GREEDY, max_tokens=10, chat_reply=True)).token_ids


def test_jobs_that_cannot_run_are_refused_at_submit(model, tokenizer):
    async def main():
        async with Scheduler(model, tokenizer, SchedulerOptions(cache_tokens=256, max_seq_len=512)) as s:
            with pytest.raises(PromptTooLong):
                s.submit(Request([1] * 600, sampling=GREEDY))
            with pytest.raises(RequestError, match="cache"):
                s.submit(Request([1] * 200, sampling=GREEDY, max_tokens=100))
            ok = await run_jobs(s, [Request([1] * 200, sampling=GREEDY, max_tokens=20, request_id="ok")])
            return ok["ok"]
    assert anyio.run(main).finish_reason == GenerationState.MAX_TOKENS


def test_pages_outlive_the_event_loop_and_a_stop_mid_job_frees_them(model, tokenizer):
    """A scheduler entered again in a new event loop (as a chat's turns are) still finds the
    prefix its last job left; leaving the scheduler with a job running releases that job's pages."""
    g = torch.Generator().manual_seed(18)
    prompt = random_prompt(g, 70, tokenizer.vocab_size)
    scheduler = Scheduler(model, tokenizer, SchedulerOptions(page_size=16))

    async def one(request):
        async with scheduler.stream(request) as stream:
            async for _ in stream:
                pass
        return stream.completion()

    async def abandoned(request):
        async with scheduler:
            stream = scheduler.submit(request)
            await stream.__anext__()  # running, then the scheduler is left

    first = anyio.run(one, Request(prompt, sampling=GREEDY, max_tokens=5, request_id="a"))
    anyio.run(abandoned, Request(random_prompt(g, 30, tokenizer.vocab_size), sampling=GREEDY, max_tokens=500,
                                 request_id="b"))
    assert scheduler.stats.pages_in_use == 0
    again = anyio.run(one, Request(prompt + [7, 8], sampling=GREEDY, max_tokens=5, request_id="c"))
    assert first.cached_tokens == 0 and again.cached_tokens == 64
    assert again.token_ids == Scheduler(model, tokenizer, ALONE).generate(Request(prompt + [7, 8], sampling=GREEDY,
                                                                         max_tokens=5)).token_ids


def test_a_chat_reply_runner_on_the_scheduler_reuses_the_last_turn(model, tokenizer):
    """``cmd/one_shot.run_one_shot``, which runs each chat reply, given the scheduler instead of
    one job alone: the second turn prefills only what the first did not leave in pages."""
    from llama_chat.cmd.one_shot import run_one_shot

    chat = Llama2ChatFormat(tokenizer)
    dialog = [Message("user", "The fox liked to play with the rabbit and the bird near the river.")]
    scheduler = Scheduler(model, tokenizer, SchedulerOptions(page_size=8))
    first_ids = chat.encode_dialog(dialog)
    first = anyio.run(run_one_shot, scheduler, Request(first_ids, sampling=GREEDY, max_tokens=30, chat_reply=True),
                      None).completion
    dialog += [Message("assistant", first.text), Message("user", "Hello world!")]
    second_ids = chat.encode_dialog(dialog)
    second = anyio.run(run_one_shot, scheduler, Request(second_ids, sampling=GREEDY, max_tokens=10, chat_reply=True),
                       None).completion
    written = list(first_ids) + list(first.token_ids[:-1])
    common = next((i for i, (a, b) in enumerate(zip(written, second_ids)) if a != b), len(written))
    assert second.cached_tokens == min(common, len(second_ids) - 1) // 8 * 8 >= len(first_ids) // 8 * 8 > 0
    assert scheduler.stats.pages_in_use == 0


def test_a_job_left_alone_on_scattered_pages_moves_to_consecutive_ones(model, tokenizer, monkeypatch):
    # "b" starts on "a"'s cached prefix pages, then gets new pages after those "a" holds: its
    # block table has a gap. Once "a" has finished, "b" runs alone and is moved onto a run of free
    # pages (read as one slice from then on). Its tokens are those of "b" run on its own, and the
    # prefix pages it held alone keep their key at their new place: "c" finds them there.
    # (The packed forward's move: the CPU operator reads any block table as it is.)
    monkeypatch.setattr(cpu_decode, "takes_rows", lambda model, cache: False)
    g = torch.Generator().manual_seed(21)
    prefix = random_prompt(g, 33, tokenizer.vocab_size)
    a = Request(prefix + random_prompt(g, 6, tokenizer.vocab_size)[1:], sampling=GREEDY, max_tokens=3, request_id="a")
    b = Request(prefix + random_prompt(g, 9, tokenizer.vocab_size)[1:], sampling=GREEDY, max_tokens=60,
                request_id="b")
    c = Request(prefix + random_prompt(g, 4, tokenizer.vocab_size)[1:], sampling=GREEDY, max_tokens=5, request_id="c")

    async def main():
        async with Scheduler(model, tokenizer, SchedulerOptions(cache_tokens=40 * 8, page_size=8)) as s:
            first = await run_jobs(s, [a])
            second = await run_jobs(s, [b, Request(a.prompt_ids, sampling=GREEDY, max_tokens=30, request_id="a2")])
            third = await run_jobs(s, [c])
            return first, second, third, s.stats
    first, second, third, stats = anyio.run(main)
    alone = {k: v for k, v in batched(model, tokenizer, [b, c], cache_tokens=40 * 8, page_size=8, max_batch=1)[0].items()}
    assert stats.compactions >= 1
    assert second["b"].cached_tokens == 32  # four full pages of the shared prefix
    assert second["b"].token_ids == alone["b"].token_ids
    assert second["a2"].token_ids[:3] == first["a"].token_ids
    assert third["c"].cached_tokens == 32 and third["c"].token_ids == alone["c"].token_ids
    assert stats.pages_in_use == 0


@pytest.mark.parametrize("operator", [True, False], ids=["operator", "packed forward"])
def test_rows_that_pause_and_resume_read_the_keys_they_wrote(model, tokenizer, monkeypatch, operator):
    # In the packed forward, several decoding rows read their keys from a mirror of their
    # gathered pages, kept while the same rows step together; the operator reads each row's pages
    # through its block table. A consumer that reads in bursts pauses its job (its buffer is
    # full) and lets it resume, so the rows of a step change back and forth; every job's greedy
    # tokens must still be those it gets alone.
    if not operator:
        monkeypatch.setattr(cpu_decode, "takes_rows", lambda model, cache: False)
    g = torch.Generator().manual_seed(23)
    requests = [Request(random_prompt(g, 5 + 7 * i, tokenizer.vocab_size), sampling=GREEDY,
                        max_tokens=40 + 10 * i, request_id=str(i)) for i in range(4)]

    async def main():
        async with Scheduler(model, tokenizer, SchedulerOptions(buffer_size=3, page_size=8)) as s:
            out = {}

            async def consume(stream, burst: bool):
                n = 0
                async for _ in stream:
                    n += 1
                    if burst and n % 3 == 0:
                        await anyio.sleep(0.01)
                out[stream.request_id] = stream.completion()

            async with anyio.create_task_group() as tg:
                for i, r in enumerate(requests):
                    tg.start_soon(consume, s.submit(r), i % 2 == 1)
            return out
    together = anyio.run(main)
    alone = batched(model, tokenizer, requests, page_size=8, max_batch=1)[0]
    for r in requests:
        assert together[r.request_id].token_ids == alone[r.request_id].token_ids, r.request_id


@pytest.mark.parametrize("between", ["a alone", "a alone, compiled", "the operator"])
def test_a_step_past_the_mirror_drops_it(model, tokenizer, monkeypatch, between):
    # The packed forward's one-token rows {a, b} read a mirror of their gathered pages, named by
    # the rows and their tables. A step that feeds them past the mirror (a alone, in the packed
    # forward or the compiled step, or any step of the CPU operator) must drop it: the next
    # packed step of {a, b} has the same name and would read stale slots. Every step's logits
    # must be those of steps that gather the pages each time (no mirror at all).
    if between.startswith("a alone"):
        monkeypatch.setattr(cpu_decode, "takes_rows", lambda model, cache: False)
        schedule = ["", "", "", "", "pause b", "", "", ""]
    else:
        # A prompt beside the decodes keeps the packed forward; decodes alone take the operator
        # (both rows, or "a" alone). "c", "d" and "e" are admitted with a prompt each, and sit out
        # once they have drawn a token.
        monkeypatch.setattr(batch_step, "prompts_as_rows", lambda settings, decoder: False)
        schedule = ["", "", "c", "", "d", "pause b", "e", ""]
    g = torch.Generator().manual_seed(29)
    prompts = {name: random_prompt(g, 6 + 3 * i, tokenizer.vocab_size) for i, name in enumerate("abcde")}
    choose, sample_rows = StepBackends.choose, batch_step.sample_rows

    def step_logits() -> tuple[list[torch.Tensor], list[str]]:
        logits, backends = [], []

        def kept(rows, *args):
            logits.append(rows.clone())
            return sample_rows(rows, *args)

        def spied(self, plan):
            backend = choose(self, plan)
            backends.append(type(backend).__name__)
            return backend

        monkeypatch.setattr(batch_step, "sample_rows", kept)
        monkeypatch.setattr(StepBackends, "choose", spied)
        core = Scheduler(model, tokenizer, SchedulerOptions(page_size=4, buffer_size=1)).core
        if between == "a alone, compiled":  # aot_eager: the same graph without a C++ build
            core.lone_step = LoneGraph(model, core.cache, max_seq_len=core.settings.max_seq_len,
                                       sample_ids=core.sample_ids, compile=True, cuda_graph=False,
                                       backend="aot_eager", row_products=True)
        jobs = {name: Job(Request(prompts[name], sampling=GREEDY, max_tokens=30, request_id=name), 0.0, None,
                          frozenset()) for name in "abcde"}
        core.incoming.extend((jobs["a"], jobs["b"]))
        for action in schedule:
            for job in (jobs["a"], jobs["b"]):  # their consumers keep up; those of c, d and e never read
                job.received = job.produced
            if action == "pause b":
                jobs["b"].received -= core.settings.buffer_size
            elif action:
                core.incoming.append(jobs[action])
            core.step()
        return logits, backends

    mirrored, backends = step_logits()
    assert between != "a alone, compiled" or backends.count("GraphedLone") == 1
    if between == "the operator":
        if "OperatorDecodes" not in backends:
            pytest.skip("the one-call CPU step is not loaded here")
        assert backends == ["PackedForward", "OperatorDecodes", "PackedForward", "OperatorDecodes", "PackedForward",
                            "LoneGreedy", "PackedForward", "OperatorDecodes"]
    monkeypatch.setattr(paged_kv_cache, "MIRROR_MAX_BYTES", 0)
    gathered, _ = step_logits()
    # The operator's pick and the static step take no logits.
    assert len(mirrored) == len(gathered) == len(schedule) - backends.count("LoneGreedy") - backends.count("GraphedLone")
    for got, want in zip(mirrored, gathered):
        assert torch.allclose(got, want, atol=1e-5, rtol=0)


def short_step_requests(vocab: int) -> list[Request]:
    g = torch.Generator().manual_seed(11)
    return [Request(random_prompt(g, 20, vocab), sampling=GREEDY, max_tokens=40, request_id="long"),
            Request(random_prompt(g, 9, vocab), sampling=GREEDY, max_tokens=7, request_id="short"),
            Request(random_prompt(g, 12, vocab), sampling=SamplingParams(temperature=0.8), seed=3,
                    max_tokens=10, request_id="sampled")]


def test_the_batchs_common_step_gives_the_general_steps_tokens_and_counters(model, tokenizer, monkeypatch):
    # The batch's common step, every job decoding, skips the general plan's lists (batch_step.py):
    # it must give what the general operator step (OperatorRows) gives: tokens, stops, counters.
    requests = short_step_requests(tokenizer.vocab_size)
    choose = StepBackends.choose
    took = set()

    def spied(self, plan):
        backend = choose(self, plan)
        if backend is self.table[Kind.DECODES]:
            took.update(job.request_id for job in plan.rows)
        return backend

    monkeypatch.setattr(StepBackends, "choose", spied)
    fast, fast_stats = batched(model, tokenizer, requests, max_batch=4)
    assert took == {"long", "short", "sampled"}

    def general(self, plan):
        backend = choose(self, plan)
        return self.table[Kind.ROWS] if backend is self.table[Kind.DECODES] else backend

    monkeypatch.setattr(StepBackends, "choose", general)
    planned, planned_stats = batched(model, tokenizer, requests, max_batch=4)
    assert {k: (v.token_ids, v.finish_reason) for k, v in fast.items()} == \
        {k: (v.token_ids, v.finish_reason) for k, v in planned.items()}
    assert fast_stats == planned_stats


def test_a_job_alone_takes_the_short_path_with_the_general_steps_tokens_and_counters(model, tokenizer, monkeypatch):
    # A job decoding alone (a chat's turn, a prompt of the command) goes from the step thread
    # straight to its lone backend's token, with no plan (BatchCore.step): greedy through the
    # operator's pick, sampled through its logits. Each must give what the general operator step
    # (OperatorRows, planned every token) gives: the same tokens, seeded draws, stops, counters.
    requests = short_step_requests(tokenizer.vocab_size)
    lone_kinds = (Kind.LONE_GREEDY, Kind.LONE_SAMPLED)
    choose = StepBackends.choose
    planned_lone, tokens = [], []
    for lone in (batch_step.LoneGreedy, batch_step.LoneSampled):
        monkeypatch.setattr(lone, "token", lambda self, job, token=lone.token: tokens.append(1) or token(self, job))

    def spied(self, plan):
        planned_lone.append(batch_step.kind_of(plan) in lone_kinds)
        return choose(self, plan)

    def each_alone():
        scheduler = Scheduler(model, tokenizer, ALONE)
        return {r.request_id: scheduler.generate(r) for r in requests}, scheduler.stats

    monkeypatch.setattr(StepBackends, "choose", spied)
    fast, fast_stats = each_alone()
    if not tokens:
        pytest.skip("the one-call CPU step is not loaded here")
    # Every token but each job's first (its prompt's step draws it) came from a lone backend,
    # nearly all without a plan.
    assert len(tokens) == sum(len(c.token_ids) - 1 for c in fast.values())
    assert sum(planned_lone) * 4 < len(tokens)

    def general(self, plan):
        backend = choose(self, plan)
        return self.table[Kind.ROWS] if batch_step.kind_of(plan) in lone_kinds else backend

    monkeypatch.setattr(StepBackends, "choose", general)
    monkeypatch.setattr(BatchCore, "_lone_job", lambda self: None)
    planned, planned_stats = each_alone()
    assert {k: (v.token_ids, v.finish_reason) for k, v in fast.items()} == \
        {k: (v.token_ids, v.finish_reason) for k, v in planned.items()}
    assert fast_stats == planned_stats


def test_prompt_chunks_go_to_the_one_call_step_as_rows_with_the_forwards_tokens(model, tokenizer, monkeypatch):
    # With a batch on the CPU, prompts are fed as rows of the one-call step (a token a row, beside
    # the decodes), within ONE_CALL_PROMPT_ROWS or twice the batch, and only the rows that draw a
    # token make logits. The tokens are those of prompts fed through the model's forward, but
    # where float32 sums in another order flip a near tie.
    g = torch.Generator().manual_seed(13)
    vocab = tokenizer.vocab_size
    requests = [Request(random_prompt(g, n, vocab), sampling=GREEDY, max_tokens=12, request_id=f"p{n}")
                for n in (3, 30, 75, 140)]
    steps = []
    with_picks = cpu_decode.PagedDecoder.with_picks

    def spy(self, tokens, positions, tables, below=None, sampled=None):
        steps.append((len(tokens), len(sampled) if sampled is not None else len(tokens)))
        return with_picks(self, tokens, positions, tables, below, sampled)

    monkeypatch.setattr(cpu_decode.PagedDecoder, "with_picks", spy)
    as_rows, stats = batched(model, tokenizer, requests, max_batch=4, page_size=16)
    if not steps:
        pytest.skip("the one-call CPU step is not loaded here")
    cap = max(batch_step.ONE_CALL_PROMPT_ROWS, 2 * 4)
    assert max(rows for rows, _ in steps) == cap  # prompts filled steps up to the cap
    assert any(logits < rows for rows, logits in steps)  # chunks without logits
    assert stats.prefill_tokens == sum(len(r.prompt_ids) for r in requests)
    monkeypatch.setattr(batch_step, "prompts_as_rows", lambda settings, decoder: False)
    forward, _ = batched(model, tokenizer, requests, max_batch=4, page_size=16)
    differing = [r for r in requests if as_rows[r.request_id].token_ids != forward[r.request_id].token_ids]
    assert len(differing) <= 1
    for r in differing:
        a, b = as_rows[r.request_id].token_ids, forward[r.request_id].token_ids
        first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        assert near_tie(model, list(r.prompt_ids) + list(b), len(r.prompt_ids) + first)


def test_a_failing_step_ends_every_open_job_with_an_error_not_a_cancel(model, tokenizer, monkeypatch):
    """A forward that raises is the scheduler's error: the jobs running and those still waiting for
    a slot all finish as ``error`` (a cancel is what the user asked for; this they did not)."""
    steps = {"n": 0}
    choose = StepBackends.choose

    def failing(self, plan):
        backend = choose(self, plan)
        steps["n"] += 1
        if steps["n"] < 4:
            return backend

        class Broken:
            wants_consecutive = False

            def run(self, plan):
                raise RuntimeError("the forward broke")
        return Broken()

    monkeypatch.setattr(StepBackends, "choose", failing)
    requests = [Request([1, 5, 6, 7], sampling=GREEDY, max_tokens=40, request_id=f"j{i}") for i in range(3)]
    states = {}

    async def main():
        with pytest.raises(RuntimeError, match="the forward broke"):
            async with Scheduler(model, tokenizer, SchedulerOptions(max_batch=1, page_size=16)) as scheduler:
                streams = [scheduler.submit(r) for r in requests]
                async with anyio.create_task_group() as tg:
                    for stream in streams:
                        async def consume(stream=stream):
                            async for _ in stream:
                                pass
                            states[stream.request_id] = stream.completion().finish_reason
                        tg.start_soon(consume)

    anyio.run(main)
    assert states == {f"j{i}": GenerationState.ERROR for i in range(3)}


@pytest.mark.parametrize("max_batch", [1, 4], ids=["alone", "batched"])
def test_logprobs_are_the_log_softmax_of_the_models_logits_at_each_step(model, tokenizer, max_batch):
    g = torch.Generator().manual_seed(23)
    asking = [Request(random_prompt(g, 12 + 5 * i, tokenizer.vocab_size), max_tokens=6, request_id=f"lp{i}",
                      sampling=GREEDY if i % 2 == 0 else SamplingParams(temperature=0.9, top_k=20), seed=i,
                      logprobs=3 + i)
              for i in range(3)]
    plain = Request(random_prompt(g, 9, tokenizer.vocab_size), sampling=GREEDY, max_tokens=6, request_id="plain")

    async def main():
        async with Scheduler(model, tokenizer, SchedulerOptions(max_batch=max_batch)) as scheduler:
            streams = {r.request_id: scheduler.submit(r) for r in [*asking, plain]}

            async def consume(stream):
                async for _ in stream:
                    pass
            async with anyio.create_task_group() as tg:
                for stream in streams.values():
                    tg.start_soon(consume, stream)
            return {name: (stream.completion(), stream.logprobs) for name, stream in streams.items()}

    results = anyio.run(main)
    assert results["plain"][1] == []
    for request in asking:
        completion, logprobs = results[request.request_id]
        drawn = [t for t in completion.token_ids if t != EOS]
        assert [token for token, _ in logprobs] == drawn and drawn
        ids = list(request.prompt_ids)
        for token, reported in logprobs:
            with torch.inference_mode():
                expected = torch.log_softmax(model(torch.tensor([ids]))[0, -1].float(), dim=-1)
            assert reported.logprob == pytest.approx(float(expected[token]), abs=1e-3)
            assert len(reported.top) == request.logprobs
            values, top_ids = expected.topk(request.logprobs)
            assert [v for _, v in reported.top] == pytest.approx(values.tolist(), abs=1e-3)
            for top_id, value in reported.top:
                assert value == pytest.approx(float(expected[top_id]), abs=1e-3)
            if request.sampling.greedy:
                assert reported.logprob >= reported.top[0][1] - 1e-6
            ids.append(token)


def test_a_lone_greedy_job_makes_several_tokens_a_step_call_and_yields_to_a_new_job(model, tokenizer, monkeypatch):
    # A job decoding greedily alone runs step after step inside one call of the step thread
    # (BatchCore._alone_again): the same tokens as a call a token; and a job that arrives meanwhile
    # is admitted at once, not after the budget (here far longer than the whole test).
    from llama_chat.inference import batch_core

    g = torch.Generator().manual_seed(4)
    first = Request(random_prompt(g, 10, tokenizer.vocab_size), sampling=GREEDY, max_tokens=300, request_id="a")
    second = Request(random_prompt(g, 6, tokenizer.vocab_size), sampling=GREEDY, max_tokens=4, request_id="b")
    calls = []
    step = batch_core.BatchCore.step
    monkeypatch.setattr(batch_core.BatchCore, "step", lambda self: calls.append(1) or step(self))

    async def run(budget: float):
        monkeypatch.setattr(batch_core, "LONE_STEPS_S", budget)
        calls.clear()
        scheduler = Scheduler(model, tokenizer, SchedulerOptions(max_batch=2, buffer_size=64))
        alone = await scheduler.complete(first)
        alone_calls = len(calls)
        order = []

        async def consume(stream, then=None):
            async for _ in stream:
                if then is not None:
                    then()
                    then = None
            order.append(stream.request_id)

        async with scheduler, anyio.create_task_group() as tg:
            tg.start_soon(consume, scheduler.submit(first), lambda: tg.start_soon(consume, scheduler.submit(second)))
        return alone, alone_calls, order

    one_a_call, calls_each, _ = anyio.run(run, 0.0)
    many, calls_lone, order = anyio.run(run, 3600.0)
    assert many.token_ids == one_a_call.token_ids and len(many.token_ids) == 300
    assert calls_lone * 4 < calls_each
    assert order == ["b", "a"]  # the second job finished while the first, alone before it, still ran


def test_warm_up_makes_the_steps_backends_before_the_first_job(model, tokenizer, monkeypatch):
    # The operator's record of the weights takes seconds for a model of a few GB: made in the first
    # step, it was timed as the first prompt's prefill (a 2B GGUF's prompt read 25 % slower).
    made = []
    make = StepBackends.make.__func__
    monkeypatch.setattr(StepBackends, "make", classmethod(lambda cls, *a, **k: made.append(1) or make(cls, *a, **k)))
    scheduler = Scheduler(model, tokenizer, SchedulerOptions(max_batch=1))
    assert isinstance(scheduler, Source)  # the face the commands use
    scheduler.warm_up()
    assert made == [1]
    request = Request([1, 5, 6, 7], sampling=GREEDY, max_tokens=3)
    assert len(scheduler.generate(request).token_ids) == 3
    assert made == [1]


def test_a_job_that_fills_the_context_ends_there(tokenizer):
    model = endless_model(tokenizer.vocab_size, seed=5, eos=EOS, max_seq_len=120)
    ids = (1,) + (100,) * 109
    done = Scheduler(model, tokenizer, ALONE).generate(Request(ids, sampling=GREEDY))
    assert done.finish_reason is GenerationState.CONTEXT_FULL
    assert len(ids) + done.completion_tokens == 120


def test_every_declared_end_marker_stops():
    class Llama3Like:
        stop_ids = frozenset({128009})
        eos_id = 128001
        special_tokens = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|eom_id|>": 128008,
                          "<|eot_id|>": 128009, "<|start_header_id|>": 128006}

    assert stop_ids_of(Llama3Like()) == {128001, 128008, 128009}


def held_steps(scheduler: Scheduler, hold_at: int) -> tuple[list[int], threading.Event, threading.Event]:
    """The scheduler's step calls counted, the ``hold_at``-th held while it runs until released:
    (the count, one item a call; set while held; the release)."""
    calls, holding, release = [], threading.Event(), threading.Event()
    step = scheduler.core.step

    def held(*args, **kwargs):
        calls.append(len(calls) + 1)
        if len(calls) == hold_at:
            holding.set()
            assert release.wait(WAIT_S), "never released"
        return step(*args, **kwargs)

    scheduler.core.step = held
    return calls, holding, release


def cancelled_while_held(scheduler: Scheduler, request: Request, calls: list[int], holding: threading.Event,
                         release: threading.Event) -> dict[str, int]:
    """``request`` streamed, cancelled while a step is held, then the step released: the calls
    made when the cancel landed, when the stream's scope had ended, and a while later."""
    seen: dict[str, int] = {}

    async def main():
        scope = anyio.CancelScope()

        async def consume():
            with scope:
                async with scheduler.stream(request) as stream:
                    async for _ in stream:
                        pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with anyio.fail_after(WAIT_S):
                while not holding.is_set():
                    await anyio.sleep(0.001)
            seen["at_cancel"] = len(calls)
            scope.cancel()
            for _ in range(3):  # the cancelled tasks handle it
                await anyio.sleep(0)
            release.set()
        seen["after"] = len(calls)
        await anyio.sleep(0.2)
        seen["later"] = len(calls)

    anyio.run(main)
    return seen


def test_a_cancel_stops_a_stream_within_one_step(model, tokenizer):
    scheduler = single_stream(model, tokenizer)
    calls, holding, release = held_steps(scheduler, hold_at=4)
    seen = cancelled_while_held(scheduler, Request(tokenizer.encode("Once upon a time", bos=True), sampling=GREEDY,
                                                   max_tokens=100), calls, holding, release)
    # The step running when the cancel landed finished; the steps queued behind it never started.
    assert seen == {"at_cancel": 4, "after": 4, "later": 4}, seen


def test_a_cancel_during_a_long_prompt_waits_for_one_chunk(model, tokenizer):
    scheduler = single_stream(model, tokenizer, prefill_chunk=4)
    calls, holding, release = held_steps(scheduler, hold_at=2)
    seen = cancelled_while_held(scheduler, Request((1,) + (100,) * 99, sampling=GREEDY, max_tokens=5), calls,
                                holding, release)
    # The chunk running finished; none of the 23 chunks after it started.
    assert seen == {"at_cancel": 2, "after": 2, "later": 2}, seen


def test_a_job_alone_on_the_static_step_takes_the_short_path_with_the_planned_tokens(model, tokenizer, monkeypatch):
    # The graphed lone step (decode_step.LoneGraph, uncompiled here) is a lone backend too: a job
    # alone on consecutive pages takes its token with no plan, greedy or seeded, and gets the
    # tokens the planned steps give it.
    g = torch.Generator().manual_seed(17)
    requests = [Request(random_prompt(g, 11, tokenizer.vocab_size), sampling=GREEDY, max_tokens=24, request_id="g"),
                Request(random_prompt(g, 7, tokenizer.vocab_size), sampling=SamplingParams(temperature=0.9, top_p=0.9),
                        seed=5, max_tokens=24, request_id="s")]
    tokens, planned = [], []
    token, choose = batch_step.GraphedLone.token, StepBackends.choose
    monkeypatch.setattr(batch_step.GraphedLone, "token", lambda self, job: tokens.append(1) or token(self, job))
    monkeypatch.setattr(StepBackends, "choose", lambda self, plan: planned.append(1) or choose(self, plan))

    def each_alone():
        scheduler = single_stream(model, tokenizer, static=True, backend=None)
        return {r.request_id: scheduler.generate(r).token_ids for r in requests}

    short = each_alone()
    assert len(tokens) == sum(len(ids) - 1 for ids in short.values())
    assert len(planned) * 4 < len(tokens)
    monkeypatch.setattr(BatchCore, "_lone_job", lambda self: None)
    assert each_alone() == short

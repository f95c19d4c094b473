"""The scheduler's static step for a job running alone (``decode_step.LoneGraph``), compiled on the
CPU as a CUDA graph runs it on CUDA: the eager tokens, its step queued ahead, one graph for every
window and first page, and the packed step when compiling fails."""

from __future__ import annotations

import anyio
import pytest
import torch

from builders import endless_model
from llama_chat.inference import decode_step
from llama_chat.inference.decode_step import WINDOW_STEP
from llama_chat.inference.decode_step import LoneGraph
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
from llama_chat.inference.types import Request
from llama_chat.ml.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
NUCLEUS = SamplingParams(temperature=1.0, top_p=0.9)
EOS = 2


@pytest.fixture(scope="module")
def model(sp_tokenizer):
    return endless_model(sp_tokenizer.vocab_size, seed=7, eos=EOS)


def prompt_of(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, vocab, (n - 1,), generator=g).tolist()


def one_at_a_time(scheduler: Scheduler, requests: list[Request]):
    async def one(request):
        async with scheduler.stream(request) as stream:
            async for _ in stream:
                pass
        return stream.completion()
    return [anyio.run(one, r) for r in requests]


def alone(model, sp_tokenizer, request: Request) -> list[int]:
    """The tokens of the eager steps (no compiled step), one job alone."""
    scheduler = Scheduler(model, sp_tokenizer, SchedulerOptions(max_batch=1, page_size=8, compile=False))
    return list(scheduler.generate(request).token_ids)


def lone_graph(scheduler: Scheduler, backend) -> LoneGraph:
    """A static step compiled by ``backend`` (aot_eager: the same graph without a C++ build), as
    ``Scheduler`` makes it with ``compile``."""
    core = scheduler.core
    core.lone_step = LoneGraph(scheduler.model, core.cache, max_seq_len=core.settings.max_seq_len,
                               sample_ids=core.sample_ids, compile=True, cuda_graph=False, backend=backend,
                               row_products=True)
    return core.lone_step


def test_a_lone_job_takes_the_compiled_step_and_gives_the_eager_tokens(model, sp_tokenizer):
    """Inductor, as on a user's machine: a reply past a window boundary, then the next turn of the
    same conversation on top of its pages, each token as the eager steps pick it. (One cold
    compile: sampled draws in the graph are test_decode_step.py's, and a new mode's graph below.)"""
    scheduler = Scheduler(model, sp_tokenizer, SchedulerOptions(max_batch=1, page_size=8, compile=True))
    scheduler.warm_up()
    assert scheduler.compiles, scheduler.compile_failure
    first = Request(prompt_of(40, 1, sp_tokenizer.vocab_size), sampling=GREEDY, max_tokens=WINDOW_STEP + 20)
    a, = one_at_a_time(scheduler, [first])
    # Another scheduler made for the same model meanwhile changes nothing the compiled graph reads.
    assert list(a.token_ids) == alone(model, sp_tokenizer, first)
    second_ids = list(first.prompt_ids) + list(a.token_ids) + prompt_of(6, 2, sp_tokenizer.vocab_size)[1:]
    second = Request(second_ids, sampling=GREEDY, max_tokens=30)
    b, = one_at_a_time(scheduler, [second])
    assert b.cached_tokens > WINDOW_STEP  # the first turn's pages, found in the page table
    assert list(b.token_ids) == alone(model, sp_tokenizer, second)
    # Every decode step but each job's first (which comes with its prompt) was the compiled one,
    # and each job's last one queued a step ahead that nobody took.
    assert scheduler.core.lone_step.steps >= (WINDOW_STEP + 19) + 29


def test_the_lone_step_compiles_once_across_windows_and_first_pages(model, sp_tokenizer, monkeypatch):
    dynamo = pytest.importorskip("torch._dynamo")
    from torch._dynamo.utils import counters

    dynamo.reset()
    counters.clear()
    # Every guard evaluated, so that a step which would not match its graph recompiles and shows.
    monkeypatch.setattr(decode_step, "SKIP_GUARDS", False)
    scheduler = Scheduler(model, sp_tokenizer, SchedulerOptions(max_batch=1, page_size=8))
    # Whether dynamo recompiles does not depend on the backend; aot_eager spares a C++ build.
    lone = lone_graph(scheduler, "aot_eager")
    requests = [Request(prompt_of(5, 4, sp_tokenizer.vocab_size), sampling=GREEDY, max_tokens=3 * WINDOW_STEP),
                Request(prompt_of(30, 5, sp_tokenizer.vocab_size), sampling=GREEDY, max_tokens=40)]
    done = one_at_a_time(scheduler, requests)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert lone.steps >= 3 * WINDOW_STEP - 1 + 39
    assert [list(c.token_ids) for c in done] == [alone(model, sp_tokenizer, r) for r in requests]
    # A job of another sampling mode: its own graph, not the greedy one run without its guards.
    monkeypatch.setattr(decode_step, "SKIP_GUARDS", True)
    sampled = Request(prompt_of(12, 6, sp_tokenizer.vocab_size), sampling=NUCLEUS, seed=3, max_tokens=30)
    assert list(one_at_a_time(scheduler, [sampled])[0].token_ids) == alone(model, sp_tokenizer, sampled)


def test_a_lone_step_that_fails_to_compile_leaves_the_packed_step(model, sp_tokenizer):
    def broken_compiler(graph, inputs):
        raise RuntimeError("no C++ compiler found\nmore detail")

    scheduler = Scheduler(model, sp_tokenizer, SchedulerOptions(max_batch=1, page_size=8))
    lone_graph(scheduler, broken_compiler)
    scheduler.warm_up()
    assert not scheduler.compiles
    assert "no C++ compiler found" in scheduler.compile_failure and "more detail" not in scheduler.compile_failure
    request = Request(prompt_of(20, 6, sp_tokenizer.vocab_size), sampling=GREEDY, max_tokens=30)
    done, = one_at_a_time(scheduler, [request])
    assert list(done.token_ids) == alone(model, sp_tokenizer, request)


def test_batches_take_the_packed_step_and_a_lone_job_the_compiled_one(model, sp_tokenizer):
    """Two jobs at once share the packed step; the one left alone goes on compiled."""
    scheduler = Scheduler(model, sp_tokenizer, SchedulerOptions(max_batch=4, page_size=8))
    lone = lone_graph(scheduler, "aot_eager")
    requests = [Request(prompt_of(12, 8, sp_tokenizer.vocab_size), sampling=GREEDY, max_tokens=10, request_id="short"),
                Request(prompt_of(9, 9, sp_tokenizer.vocab_size), sampling=GREEDY, max_tokens=60, request_id="long")]

    async def both():
        async with scheduler:
            streams = [scheduler.submit(r) for r in requests]
            out = {}

            async def consume(stream):
                async for _ in stream:
                    pass
                out[stream.request_id] = stream.completion()
            async with anyio.create_task_group() as tg:
                for stream in streams:
                    tg.start_soon(consume, stream)
            return out

    done = anyio.run(both)
    assert 0 < lone.steps < 60
    for r in requests:
        assert list(done[r.request_id].token_ids) == alone(model, sp_tokenizer, r)

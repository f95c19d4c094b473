"""Decode steps through one compiled graph per batch bucket (inference/bucket_step.py), on the CPU,
compiled by a backend that takes a moment (``aot_eager``: dynamo's trace, its guards and the
functionalized graph, without code generation), so that what recompiles here would on a GPU."""

from __future__ import annotations

import anyio
import pytest
import torch
from torch._dynamo.utils import counters

from builders import endless_model
from llama_chat.inference.bucket_step import BUCKETS, bucket_of
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
from llama_chat.inference.types import Request
from llama_chat.ml.sampling import SamplingParams
from test_speculative import EOS, GREEDY, VOCAB, Bytes, prompts

GRAPHS = ("aot_eager", None)


@pytest.fixture(scope="module")
def model():
    return endless_model(VOCAB, seed=5, eos=EOS, max_seq_len=384)


def scheduler_of(model, *, max_batch: int, graphs=GRAPHS) -> Scheduler:
    return Scheduler(model, Bytes(), SchedulerOptions(max_batch=max_batch, page_size=16, cache_tokens=8 * 384,
                                                      static_shapes=True, bucket_graphs=graphs, cache_type="f32"))


def replies(scheduler: Scheduler, batches: list[list[Request]]) -> dict[str, tuple[int, ...]]:
    """Each batch's requests at once, the next batch after; each job joins a step after the one
    before it (so that jobs join and leave a running batch), and ends at its own budget."""
    out = {}

    async def one(request: Request, delay: float) -> None:
        await anyio.sleep(delay)
        async with scheduler.submit(request) as stream:
            async for _ in stream:
                pass
        out[request.request_id] = stream.completion().token_ids

    async def main():
        async with scheduler:
            for batch in batches:
                async with anyio.create_task_group() as tg:
                    for i, request in enumerate(batch):
                        tg.start_soon(one, request, 0.02 * i)
    anyio.run(main)
    return out


def requests(count: int, seed: int, longest: int) -> list[Request]:
    return [Request(p, sampling=GREEDY, max_tokens=longest - longest * i // (count + 1), request_id=f"s{seed}r{i}")
            for i, p in enumerate(prompts(count, seed))]


def test_buckets_are_the_powers_of_two_to_64():
    assert [bucket_of(n) for n in (1, 2, 3, 5, 9, 17, 33, 64, 65)] == [1, 2, 4, 8, 16, 32, 64, 64, None]
    assert BUCKETS[-1] == 64


def test_each_bucket_compiles_once_over_300_positions_jobs_joining_and_leaving_and_two_batches(model):
    torch._dynamo.reset()
    counters.clear()
    scheduler = scheduler_of(model, max_batch=8)
    batches = [requests(6, seed=1, longest=300), requests(3, seed=2, longest=120)]
    got = replies(scheduler, batches)
    steps = scheduler.core.prepare().buckets.steps
    assert steps.failure is None
    buckets = {size for size, _ in steps.buckets_run}
    assert {1, 2, 4} <= buckets <= {1, 2, 4, 8} and not any(sampled for _, sampled in steps.buckets_run)
    assert counters["stats"]["unique_graphs"] == len(steps.buckets_run)  # never a recompile
    assert max(len(t) for t in got.values()) == 300
    # The same tokens as the packed forward's eager steps, which give each job's tokens alone
    # (test_scheduler.py: static shapes as the plain steps, batched jobs as each alone).
    assert got == replies(scheduler_of(model, max_batch=8, graphs=None), batches)


def test_sampled_rows_are_drawn_in_the_graph_as_the_host_draws_them(model):
    """Temperature alone, and with top-p: drawn in the bucket's sampling graph with each job's
    uniforms; a repetition penalty (a control over the history): drawn on the host. Seeded, the
    tokens are those of the eager packed steps, which draw every row on the host."""
    torch._dynamo.reset()
    counters.clear()
    settings = [SamplingParams(temperature=0.9), SamplingParams(temperature=0.7, top_p=0.8),
                SamplingParams(temperature=0.8, repetition_penalty=1.3), GREEDY]
    batch = [[Request(p, sampling=settings[i % 4], max_tokens=60 - 9 * i, seed=100 + i, request_id=f"t{i}")
              for i, p in enumerate(prompts(6, seed=4))]]
    scheduler = scheduler_of(model, max_batch=8)
    got = replies(scheduler, batch)
    steps = scheduler.core.prepare().buckets.steps
    assert steps.failure is None and any(sampled for _, sampled in steps.buckets_run)
    assert counters["stats"]["unique_graphs"] == len(steps.buckets_run)
    assert got == replies(scheduler_of(model, max_batch=8, graphs=None), batch)


def test_a_backend_that_cannot_compile_leaves_the_packed_steps(model):
    scheduler = scheduler_of(model, max_batch=4, graphs=("no-such-backend", None))
    batch = [requests(3, seed=3, longest=40)]
    got = replies(scheduler, batch)
    steps = scheduler.core.prepare().buckets.steps
    assert steps.failure and not steps.buckets_run
    assert got == replies(scheduler_of(model, max_batch=4, graphs=None), batch)

"""Prefill chunks sized by time: long enough to be fast, short enough that a cancel waits little."""

from __future__ import annotations

import time

import anyio

from builders import random_model, tiny_args
from llama_chat.inference.batch_core import BatchCore
from llama_chat.inference.prefill import CHUNK_STEP, PrefillSizer
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
from llama_chat.inference.types import Request
from llama_chat.ml.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
CANCEL_BOUND_S = 0.2
# The forwards below sleep instead of computing, so their length holds on a busy machine; what a
# busy machine may add is the wake-up of a sleeping thread and of the event loop.
SCHEDULING_SLACK_S = 0.05


class _NoTokenizer:
    vocab_size = 300
    stop_ids: frozenset[int] = frozenset()
    eos_id = None
    special_tokens: dict[str, int] = {}

    def token_bytes(self, token_id: int) -> bytes:
        return b"x"


def test_sizer_fills_the_budget_and_shrinks_at_once_when_chunks_slow_down():
    sizer = PrefillSizer(budget_s=0.1, first=64)
    assert sizer.next_size() == 64  # nothing measured yet
    sizer.record(64, 0.004)  # fast: 62.5 us a token
    assert sizer.next_size() == 1600
    sizer.record(1600, 0.4)  # the machine got four times slower: the next chunk fits at once
    assert sizer.next_size() == 400
    sizer.record(400, 0.05)  # faster again: grows back gradually
    assert 400 < sizer.next_size() < 800
    sizer.record(8, 10.0)  # too few tokens to judge by
    assert sizer.next_size() % CHUNK_STEP == 0 and sizer.next_size() > 400
    slow = PrefillSizer(budget_s=0.1, first=64)
    slow.record(64, 6.4)  # 0.1 s a token: never shorter than the first chunk
    assert slow.next_size() == 64


LAYERS = 8


def _slow_model(seconds_per_token: float):
    """A model whose every layer sleeps ``seconds_per_token / LAYERS`` per token of its input."""
    model = random_model(tiny_args(300, max_seq_len=4096, n_layers=LAYERS), seed=2)
    for layer in model.layers:
        forward = layer.forward

        def slow(h, *args, forward=forward):
            time.sleep(seconds_per_token / LAYERS * h.shape[1])
            return forward(h, *args)
        layer.forward = slow
    return model


async def _cancel_mid_prefill(run, prefilled, busy) -> float:
    """Start ``run`` in a cancel scope, cancel it once ``prefilled()`` says the prefill is well
    under way, and return the seconds until ``busy()`` says the forward has stopped."""
    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()

        async def go():
            with scope:
                await run()

        tg.start_soon(go)
        while not prefilled():
            await anyio.sleep(0.005)
        t = time.perf_counter()
        scope.cancel()
        with anyio.fail_after(60):
            while busy():
                await anyio.sleep(0.001)
        return time.perf_counter() - t


def test_the_scheduler_sizes_its_chunks_and_a_cancel_stops_the_forward_at_a_layer():
    """The chat's path: a reply on the scheduler, cancelled during a long prompt's prefill by
    leaving the scheduler, as Ctrl+C does."""
    scheduler = Scheduler(_slow_model(0.0005), _NoTokenizer(), SchedulerOptions(max_batch=1, page_size=8))
    request = Request((1,) + (100,) * 3999, sampling=GREEDY, max_tokens=1)
    left = []

    async def run():
        try:
            async with scheduler.stream(request) as stream:
                async for _ in stream:
                    pass
        finally:
            left.append(True)

    waited = anyio.run(_cancel_mid_prefill, run, lambda: scheduler.stats.prefill_tokens >= 3 * 64, lambda: not left)
    prefilled = scheduler.stats.prefill_tokens
    assert 64 < prefilled < 4000  # chunks grew past the first, and the prompt was not finished
    assert waited <= CANCEL_BOUND_S + SCHEDULING_SLACK_S, waited
    assert scheduler.stats.pages_in_use == 0


def test_a_fixed_chunk_is_kept_when_asked_for(monkeypatch):
    chunks: list[int] = []
    plan = BatchCore._plan

    def logged(self, *args):
        made = plan(self, *args)
        chunks.extend(n for _, n in made.runs)
        return made

    monkeypatch.setattr(BatchCore, "_plan", logged)
    scheduler = Scheduler(_slow_model(0.0), _NoTokenizer(), SchedulerOptions(max_batch=1, prefill_chunk=24))
    scheduler.generate(Request((1,) + (100,) * 99, sampling=GREEDY, max_tokens=1))
    assert chunks == [24, 24, 24, 24, 4]

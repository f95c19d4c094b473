"""The producer, the bounded channel and cancellation, on a tiny random model."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
import sentencepiece as spm
import torch

from builders import random_model, tiny_args, train_sentencepiece
from llama_chat.inference.engine import DEFAULT_LOOKAHEAD, Engine, EngineOptions
from llama_chat.inference.step_worker import threads_serving
from llama_chat.inference.types import EmptyPrompt, GenerationState, PromptTooLong, Request, TokenEvent, stop_ids_of
from llama_chat.ml.sampling import SamplingParams, sample
from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer

GREEDY = SamplingParams(temperature=0.0)
# anyio's pool threads, which a step must never run on (the step thread is parked, not ended).
POOL_THREAD_NAME = "AnyIO worker thread"
# How long a test waits for something that must happen: long enough for a machine whose cores are
# busy with other work. Tests wait for conditions; none asserts that anything happened in a short time.
WAIT_S = 60.0


async def wait_until(condition, timeout_s: float = WAIT_S) -> None:
    with anyio.fail_after(timeout_s):
        while not condition():
            await anyio.sleep(0.001)


def most_steps(received: int, buffer_size: int) -> int:
    """The most steps the worker can have run once the consumer has received ``received`` events.

    The producer then holds at most ``buffer_size`` more in the buffer and one more in ``send``;
    behind the step whose event waits in ``send`` it has queued 1 + lookahead steps, which the
    worker runs without waiting for anyone.
    """
    return received + buffer_size + 1 + (1 + DEFAULT_LOOKAHEAD)


async def let_cancellation_land() -> None:
    """A few event-loop turns: tasks cancelled by a ``scope.cancel()`` just made handle it."""
    for _ in range(3):
        await anyio.sleep(0)


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    # Enough pieces for every character of the sample text plus the 256 byte pieces.
    return train_sentencepiece(tmp_path_factory.mktemp("engine_spm"), vocab_size=512)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_path):
    return SentencePieceTokenizer(tokenizer_path)


@pytest.fixture(scope="module")
def model(tokenizer_path):
    vocab = spm.SentencePieceProcessor(model_file=str(tokenizer_path)).vocab_size()
    return random_model(tiny_args(vocab, max_seq_len=128), seed=1)


def prompt(tokenizer, text="Once upon a time") -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, bos=True))


class Recorder:
    """A sampler that counts calls, can hold one call until released, and never picks a stop
    token unless told to."""

    def __init__(self, stop_ids=frozenset(), hold_at=None, fail_at=None, force=None):
        self.calls = 0
        self.in_flight = 0
        self.threads: set[int] = set()
        self.stop_ids = sorted(stop_ids)
        self.hold_at = hold_at  # this call waits, once running, until `release` is set
        self.holding = threading.Event()
        self.release = threading.Event()
        self.fail_at = fail_at
        self.force = force

    def __call__(self, logits, params, generator):
        self.in_flight += 1
        try:
            self.calls += 1
            self.threads.add(threading.get_ident())
            if self.fail_at is not None and self.calls == self.fail_at:
                raise Boom(f"forward failed at step {self.calls}")
            if self.calls == self.hold_at:
                self.holding.set()
                assert self.release.wait(WAIT_S), "never released"
            if self.force is not None:
                return torch.tensor([self.force(self.calls)])
            logits = logits.clone()
            logits[:, self.stop_ids] = float("-inf")
            return sample(logits, params, generator)
        finally:
            self.in_flight -= 1


class Boom(RuntimeError):
    pass


def reference_greedy(model, ids, n, banned=()):
    """Greedy tokens from full causal forwards over the whole sequence, with no cache."""
    ids = list(ids)
    out = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids]))[0, -1]
            logits[list(banned)] = float("-inf")
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
    return out


async def collect(engine, request) -> list[TokenEvent]:
    async with engine.events(request) as events:
        return [e async for e in events]


def test_events_arrive_in_order_and_match_a_cacheless_greedy_run(model, tokenizer):
    rec = Recorder(stop_ids=tokenizer.stop_ids)
    engine = Engine(model, tokenizer, draw=rec, options=EngineOptions(prefill_chunk=3))
    req = Request(prompt(tokenizer), sampling=GREEDY, max_tokens=20)
    events = anyio.run(collect, engine, req)
    assert [e.index for e in events] == list(range(20))
    assert [e.state for e in events] == [GenerationState.IN_PROGRESS] * 19 + [GenerationState.MAX_TOKENS]
    assert all(e.request_id == req.request_id for e in events)
    assert [e.elapsed_s for e in events] == sorted(e.elapsed_s for e in events)
    assert [e.data for e in events] == [tokenizer.token_bytes(e.token_id) for e in events]
    # Chunked prefill plus cached decode must give what full recomputation gives.
    assert [e.token_id for e in events] == reference_greedy(model, req.prompt_ids, 20, tokenizer.stop_ids)
    # One forward at a time, each on the same reused worker thread: no oversubscription.
    assert len(rec.threads) == 1 and threading.get_ident() not in rec.threads


def test_generate_is_the_same_path(model, tokenizer):
    engine = Engine(model, tokenizer, draw=Recorder(stop_ids=tokenizer.stop_ids))
    req = Request(prompt(tokenizer), sampling=GREEDY, max_tokens=12)
    done = engine.generate(req)
    assert done.finish_reason is GenerationState.MAX_TOKENS
    assert list(done.token_ids) == reference_greedy(model, req.prompt_ids, 12, tokenizer.stop_ids)
    assert done.text == b"".join(tokenizer.token_bytes(t) for t in done.token_ids).decode("utf-8", "replace")
    assert done.prompt_tokens == len(req.prompt_ids) and done.completion_tokens == 12
    assert done.timings.ttft_s > 0 and done.timings.decode_tok_s > 0


def test_seeded_sampling_is_reproducible(model, tokenizer):
    engine = Engine(model, tokenizer, draw=Recorder(stop_ids=tokenizer.stop_ids))
    hot = SamplingParams(temperature=1.5, top_p=0.95)
    runs = [engine.generate(Request(prompt(tokenizer), sampling=hot, seed=s, max_tokens=16)).token_ids
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]


def test_stop_token_ends_with_eos_and_prints_nothing(model, tokenizer):
    eos = tokenizer.eos_id
    engine = Engine(model, tokenizer, draw=Recorder(force=lambda n: eos if n == 4 else 100))
    done = engine.generate(Request(prompt(tokenizer), sampling=GREEDY))
    assert done.finish_reason is GenerationState.EOS
    assert done.token_ids[-1] == eos and len(done.token_ids) == 4
    assert done.text == tokenizer.token_bytes(100).decode() * 3


def test_context_full(model, tokenizer):
    engine = Engine(model, tokenizer, draw=Recorder(force=lambda n: 100))
    ids = (1,) + (100,) * 119
    done = engine.generate(Request(ids, sampling=GREEDY))
    assert done.finish_reason is GenerationState.CONTEXT_FULL
    assert len(ids) + done.completion_tokens == engine.max_seq_len


def test_every_declared_end_marker_stops():
    class Llama3Like:
        stop_ids = frozenset({128009})
        eos_id = 128001
        special_tokens = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|eom_id|>": 128008,
                          "<|eot_id|>": 128009, "<|start_header_id|>": 128006}

    assert stop_ids_of(Llama3Like()) == {128001, 128008, 128009}


def test_bad_requests_fail_before_any_work(model, tokenizer):
    rec = Recorder()
    engine = Engine(model, tokenizer, draw=rec)
    with pytest.raises(EmptyPrompt):
        engine.generate(Request(()))
    with pytest.raises(PromptTooLong):
        engine.generate(Request((1,) * 128))
    assert rec.calls == 0


def test_bounded_channel_holds_a_slow_consumer_back(model, tokenizer):
    rec = Recorder(stop_ids=tokenizer.stop_ids)
    size, total = 2, 30
    engine = Engine(model, tokenizer, draw=rec, options=EngineOptions(buffer_size=size))
    req = Request(prompt(tokenizer), sampling=GREEDY, max_tokens=total)
    seen = []

    async def slow_consumer():
        async with engine.events(req) as events:
            async for event in events:
                seen.append(event.index)
                most = most_steps(len(seen), size)
                assert events.statistics().current_buffer_used <= size
                assert rec.calls <= most
                # Left alone, the producer fills the buffer (however long a busy machine takes)...
                await wait_until(lambda: events.statistics().current_buffer_used >= min(size, total - len(seen)))
                assert rec.calls >= len(seen) + min(size, total - len(seen))
                # ...and then waits on us instead of running on.
                assert events.statistics().current_buffer_used <= size and rec.calls <= most

    anyio.run(slow_consumer)
    assert seen == list(range(total))


def test_cancel_stops_the_producer_within_one_step(model, tokenizer):
    # The fourth step is held while it runs, so the cancel provably lands during it.
    rec = Recorder(stop_ids=tokenizer.stop_ids, hold_at=4)
    engine = Engine(model, tokenizer, draw=rec)
    req = Request(prompt(tokenizer), sampling=GREEDY, max_tokens=100)
    result = {}

    async def main():
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def consume():
                with scope:
                    async with engine.events(req) as events:
                        async for _ in events:
                            pass

            tg.start_soon(consume)
            await wait_until(rec.holding.is_set)
            result["calls_at_cancel"] = rec.calls
            scope.cancel()
            await let_cancellation_land()
            rec.release.set()
        result["in_flight"] = rec.in_flight
        result["calls_after"] = rec.calls
        await anyio.sleep(0.2)
        result["calls_later"] = rec.calls

    anyio.run(main)
    # The step running when the cancel landed finished; the steps queued behind it never started.
    assert result["calls_at_cancel"] == 4 and result["calls_after"] == 4
    assert result["in_flight"] == 0 and result["calls_later"] == result["calls_after"]
    assert not engine._busy
    # And no thread runs a step once the event loop is gone.
    assert _no_step_thread_busy()


def _no_step_thread_busy(timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pool = any(t.name == POOL_THREAD_NAME and t.is_alive() for t in threading.enumerate())
        if not pool and threads_serving() == 0:
            return True
        time.sleep(0.01)
    return False


def test_cancel_during_prefill_waits_for_one_chunk(model, tokenizer):
    chunks = []
    engine = Engine(model, tokenizer, options=EngineOptions(prefill_chunk=4))
    step_forward = engine.step.forward
    second_running, release = threading.Event(), threading.Event()

    def held_forward(rows, starts):
        chunks.append(starts[0])
        if len(chunks) == 2:  # the second chunk is held while it runs: the cancel lands during it
            second_running.set()
            assert release.wait(WAIT_S), "never released"
        return step_forward(rows, starts)

    engine.step.forward = held_forward
    req = Request((1,) + (100,) * 99, sampling=GREEDY, max_tokens=5)

    async def main():
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def run():
                with scope:
                    await collect(engine, req)

            tg.start_soon(run)
            await wait_until(second_running.is_set)
            scope.cancel()
            await let_cancellation_land()
            release.set()

    anyio.run(main)
    # The chunk running finished; none of the 23 chunks after it started.
    assert chunks == [0, 4]


def test_forward_error_reaches_the_caller_as_itself_once(model, tokenizer):
    rec = Recorder(stop_ids=tokenizer.stop_ids, fail_at=3)
    engine = Engine(model, tokenizer, draw=rec)
    req = Request(prompt(tokenizer), sampling=GREEDY, max_tokens=50)
    received = []

    async def main():
        async with engine.events(req) as events:
            async for event in events:
                received.append(event)

    with pytest.raises(Boom) as info:
        anyio.run(main)
    assert type(info.value) is Boom and "step 3" in str(info.value)
    assert len(received) == 2 and rec.calls == 3 and not engine._busy
    # The engine is usable again after a failure.
    rec.fail_at = None
    assert engine.generate(req).completion_tokens == 50


def test_consumer_leaving_early_stops_the_producer(model, tokenizer):
    rec = Recorder(stop_ids=tokenizer.stop_ids)
    engine = Engine(model, tokenizer, draw=rec, options=EngineOptions(buffer_size=1))
    req = Request(prompt(tokenizer), sampling=GREEDY, max_tokens=100)

    async def main():
        async with engine.events(req) as events:
            async for event in events:
                if event.index == 3:
                    break

    anyio.run(main)
    assert rec.calls <= most_steps(4, 1) and rec.in_flight == 0

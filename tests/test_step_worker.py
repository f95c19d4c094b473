"""The dedicated step thread: order, errors, cancellation, no step left behind, and the thread
kept for the next block."""

from __future__ import annotations

import threading

import anyio
import pytest

from llama_chat.inference.step_worker import StepWorker, threads_serving

# How long a test waits for something that must happen, on however busy a machine.
WAIT_S = 60.0


def _serving() -> bool:
    """Whether a step thread still runs or holds a call of a block (parked threads do not)."""
    return threads_serving() > 0


def test_calls_run_in_order_on_one_thread_off_the_loop():
    ran: list[tuple[int, int]] = []

    async def main():
        async with StepWorker() as worker:
            calls = [worker.submit(lambda i=i: ran.append((i, threading.get_ident())) or i) for i in range(20)]
            return [await worker.result(c) for c in calls]

    assert anyio.run(main) == list(range(20))
    assert [i for i, _ in ran] == list(range(20))
    assert len({t for _, t in ran}) == 1 and threading.get_ident() not in {t for _, t in ran}
    assert not _serving()


def test_an_error_is_raised_once_and_revokes_the_calls_queued_after_it():
    ran: list[int] = []

    def step(i):
        ran.append(i)
        if i == 2:
            raise KeyError("boom")
        return i

    async def main():
        async with StepWorker() as worker:
            calls = [worker.submit(step, i) for i in range(6)]
            assert await worker.result(calls[0]) == 0
            assert await worker.result(calls[1]) == 1
            with pytest.raises(KeyError):
                await worker.result(calls[2])
            for c in calls[3:]:
                await c.done.wait()
                assert c.revoked

    anyio.run(main)
    assert ran == [0, 1, 2]
    assert not _serving()


def test_cancel_waits_for_the_running_call_and_revokes_the_queued_ones():
    ran: list[int] = []
    finished: list[int] = []
    running, release = threading.Event(), threading.Event()

    def held(i):  # the first call is held while it runs, so the cancel provably lands during it
        ran.append(i)
        running.set()
        assert release.wait(WAIT_S), "never released"
        finished.append(i)

    async def cancel_when_running(scope):
        with anyio.fail_after(WAIT_S):
            while not running.is_set():
                await anyio.sleep(0.001)
        scope.cancel()
        for _ in range(3):  # let the cancelled task handle it (revoking the queued calls)
            await anyio.sleep(0)
        release.set()

    async def main():
        async with StepWorker() as worker:
            calls = [worker.submit(held, i) for i in range(5)]
            async with anyio.create_task_group() as tg:
                scope = anyio.CancelScope()
                tg.start_soon(cancel_when_running, scope)
                with scope:
                    await worker.result(calls[0])
            # The cancel returned only after the running call had finished.
            assert scope.cancelled_caught and finished == [0]

    anyio.run(main)
    assert ran == [0] and finished == [0]
    assert not _serving()


def test_the_next_block_runs_on_the_parked_thread():
    async def block():
        async with StepWorker() as worker:
            return await worker.result(worker.submit(threading.get_ident))

    first = anyio.run(block)
    assert not _serving()
    # Parked, not ended: the next generation's first forward finds its OpenMP helpers and its
    # allocator's memory warm.
    assert any(t.ident == first and t.is_alive() for t in threading.enumerate())
    assert anyio.run(block) == first


def test_overlapping_blocks_get_threads_of_their_own():
    async def main():
        idents = []
        async with StepWorker() as a, StepWorker() as b:
            idents.append(await a.result(a.submit(threading.get_ident)))
            idents.append(await b.result(b.submit(threading.get_ident)))
        return idents

    a, b = anyio.run(main)
    assert a != b and not _serving()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_works_on_every_anyio_backend(backend):
    if backend == "trio":
        pytest.importorskip("trio")

    async def main():
        async with StepWorker() as worker:
            return await worker.result(worker.submit(sum, (1, 2, 3)))

    assert anyio.run(main, backend=backend) == 6


def test_results_are_batched_but_never_held_when_the_worker_runs_dry():
    async def main():
        # Batches an hour apart: a result held for the next batch would never arrive in WAIT_S.
        async with StepWorker(report_every_s=3600.0) as worker:
            with anyio.fail_after(WAIT_S):
                # With nothing queued behind it, a call's result is reported at once...
                assert await worker.result(worker.submit(lambda: 1)) == 1
                assert await worker.result(worker.submit(lambda: 2)) == 2
                # ...and a run of quick calls arrives whole, in order, in one batch.
                calls = [worker.submit(lambda i=i: i) for i in range(50)]
                assert [await worker.result(c) for c in calls] == list(range(50))

    anyio.run(main)

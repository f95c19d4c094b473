"""The registry of several models (``cmd/models.py``) on its own: which model loads, which one
goes, who waits and who is refused. Its ``hold`` here loads nothing: it records the calls and
serves a record with the fields the registry reads, so each rule shows without a model's weights
(``test_models.py`` runs the real ones behind a server)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest

from llama_chat.cmd.models import ModelEntry, Models, Unload
from llama_chat.cmd.openai_api import ApiError
from llama_chat.model.errors import ModelLoadError

WAIT_S = 60.0  # a bound on waits that end as soon as the condition holds


class Holder:
    """``hold`` for the registry: each load is recorded, and waits for ``gate`` where one is set."""

    def __init__(self, fail: set[str] = frozenset()) -> None:
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.fail = set(fail)
        self.gate: anyio.Event | None = None

    async def __call__(self, entry: ModelEntry, ready, unload: Unload) -> None:
        self.loads.append(entry.name)
        if self.gate is not None:
            await self.gate.wait()
        if entry.name in self.fail:
            raise ModelLoadError(f"{entry.source}: not a model")
        serving = SimpleNamespace(open_jobs=0, scheduler=SimpleNamespace(max_seq_len=256))
        ready(SimpleNamespace(loaded=SimpleNamespace(kind="chat"), embedder=None, serving=serving))
        await unload.event.wait()
        self.unloads.append(entry.name)


def run_with(names: list[str], body, *, max_loaded: int | None = None, queue_limit: int = 8,
             keep_alive_s: float = math.inf, holder: Holder | None = None) -> None:
    holder = holder or Holder()

    async def main() -> None:
        models = Models([ModelEntry(n, f"/models/{n}", Path(f"/models/{n}")) for n in names], hold=holder,
                        max_loaded=max_loaded, keep_alive_s=keep_alive_s, queue_limit=queue_limit,
                        log=lambda line: None, log_error=lambda line: None)
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            await tg.start(models.run, stop, 0.0)
            with anyio.fail_after(WAIT_S):
                await body(models, holder)
            stop.set()

    anyio.run(main)


async def until(condition) -> None:
    while not condition():
        await anyio.sleep(0.01)


def test_requests_for_a_model_loading_wait_for_its_one_load():
    async def body(models: Models, holder: Holder) -> None:
        holder.gate = anyio.Event()
        got = []
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(lambda: _append(got, models.acquire("a")))
            await until(lambda: models.models["a"].status == "loading")
            holder.gate.set()
        assert holder.loads == ["a"] and len(got) == 3 and models.models["a"].users == 3

    run_with(["a", "b"], body)


async def _append(out: list, acquiring) -> None:
    out.append(await acquiring)


def test_past_the_bound_the_least_recently_used_idle_model_goes():
    async def body(models: Models, holder: Holder) -> None:
        for name in ("a", "b", "a"):
            models.release(await models.acquire(name))
        c = await models.acquire("c")  # b was used last before a: b goes
        assert holder.unloads == ["b"] and c.status == "loaded"
        assert {n: m.status for n, m in models.models.items()} == {"a": "loaded", "b": "unloaded", "c": "loaded"}

    run_with(["a", "b", "c"], body, max_loaded=2)


def test_a_busy_model_is_never_unloaded_and_the_queue_is_bounded():
    async def body(models: Models, holder: Holder) -> None:
        a = await models.acquire("a")  # held: its request runs
        with pytest.raises(ApiError) as caught:
            await models.acquire("b")
        assert caught.value.status == 503 and caught.value.code == "models_busy"
        assert caught.value.headers["Retry-After"]
        assert a.status == "loaded" and holder.unloads == []
        # An idle model with open jobs is busy too.
        models.release(a)
        a.served.serving.open_jobs = 1
        with pytest.raises(ApiError):
            await models.acquire("b")
        a.served.serving.open_jobs = 0

    run_with(["a", "b"], body, max_loaded=1, queue_limit=0)


def test_a_request_waits_for_a_slot_and_takes_it_when_freed():
    async def body(models: Models, holder: Holder) -> None:
        a = await models.acquire("a")
        got = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _append(got, models.acquire("b")))
            await anyio.sleep(0.05)
            assert got == [] and models._waiting == 1
            models.release(a)
        assert got[0].name == "b" and holder.unloads == ["a"] and models._waiting == 0

    run_with(["a", "b"], body, max_loaded=1, queue_limit=1)


def test_a_load_that_fails_is_a_500_and_the_next_request_tries_again():
    holder = Holder(fail={"bad"})

    async def body(models: Models, holder: Holder) -> None:
        for _ in range(2):
            with pytest.raises(ApiError) as caught:
                await models.acquire("bad")
            assert caught.value.status == 500 and "/models/bad: not a model" in caught.value.message
        assert holder.loads == ["bad", "bad"] and models.models["bad"].status == "unloaded"
        models.release(await models.acquire("good"))

    run_with(["good", "bad"], body, holder=holder)


def test_keep_alive_zero_unloads_when_idle_and_unknown_names_are_404s():
    async def body(models: Models, holder: Holder) -> None:
        models.release(await models.acquire("a"), keep_alive_s=0.0)
        await until(lambda: models.models["a"].status == "unloaded")
        models.release(await models.acquire(None))  # no name: the first model
        assert holder.loads == ["a", "a"] and models.models["a"].status == "loaded"  # kept: inf by default
        assert models.lookup("a:latest").name == "a"
        with pytest.raises(ApiError) as caught:
            models.lookup("gpt-4o-mini")
        assert caught.value.status == 404 and "'a', 'b'" in caught.value.message

    run_with(["a", "b"], body)


def test_unload_asked_waits_for_the_running_request():
    async def body(models: Models, holder: Holder) -> None:
        a = await models.acquire("a")
        done = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _append(done, models.unload("a")))
            await anyio.sleep(0.05)
            assert done == [] and a.status == "loaded"
            models.release(a)
        assert done == [True] and a.status == "unloaded"

    run_with(["a", "b"], body)

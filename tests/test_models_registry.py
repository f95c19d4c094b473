"""The registry of several models (``cmd/models.py``) in this process, without HTTP: which model
loads, which one goes, who waits and who is refused. The models are real (one tiny checkpoint
under three names, and a folder that is no model), loaded and held by serve's own ``_hold``,
which ``Holder`` wraps to record each load and unload."""

from __future__ import annotations

import math
from pathlib import Path

import anyio
import pytest

from cli_support import build_tiny_model
from llama_chat.cmd.models import ModelEntry, Models, ModelSettings, Unload, files_size
from llama_chat.cmd.openai_api import ApiError
from llama_chat.cmd.serve import ServeOptions, ServerLog, _hold
from llama_chat.cmd.serve_app import ServerState

WAIT_S = 120.0  # a bound on waits that end as soon as their condition holds: the machine is busy


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    tiny = build_tiny_model(tmp_path_factory.mktemp("registry"), max_seq_len=256).path
    broken = tmp_path_factory.mktemp("broken")
    (broken / "params.json").write_text('{"dim": ')
    return {"a": tiny, "b": tiny, "c": tiny, "bad": broken}


class Holder:
    """serve's ``_hold``, each load and unload recorded; a load waits for ``gate`` where one is set."""

    def __init__(self) -> None:
        self.opts = ServeOptions(template="llama2", max_batch=2, quiet=True)
        self.state = ServerState(api_key=None, max_body_bytes=1 << 20, log=None)
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.gate: anyio.Event | None = None

    async def __call__(self, entry: ModelEntry, ready, unload: Unload) -> None:
        self.loads.append(entry.name)
        if self.gate is not None:
            await self.gate.wait()
        await _hold(self.opts, self.state, ServerLog(quiet=True), entry, ready, unload)
        self.unloads.append(entry.name)


def run_with(folders: dict[str, Path], names: list[str], body, *, max_loaded: int | None = None,
             queue_limit: int = 8, keep_alive_s: float = math.inf, memory_budget: int | None = None,
             pinned: tuple[str, ...] = ()) -> None:
    holder = Holder()

    async def main() -> None:
        entries = [ModelEntry(n, str(folders[n]), folders[n], ModelSettings(pinned=n in pinned),
                              files_size(folders[n])) for n in names]
        models = Models(entries, hold=holder, max_loaded=max_loaded, keep_alive_s=keep_alive_s,
                        queue_limit=queue_limit, log=lambda line: None, log_error=lambda line: None,
                        memory_budget=memory_budget)
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            await tg.start(models.run, stop, 0.0)
            with anyio.fail_after(WAIT_S):
                await body(models, holder)
            stop.set()
        assert all(m.status == "unloaded" for m in models.models.values())  # stopping unloads them all

    anyio.run(main)


async def until(condition) -> None:
    while not condition():
        await anyio.sleep(0.01)


async def _append(out: list, acquiring) -> None:
    out.append(await acquiring)


def test_requests_for_a_model_loading_wait_for_its_one_load(folders):
    async def body(models: Models, holder: Holder) -> None:
        holder.gate = anyio.Event()
        got: list = []
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(_append, got, models.acquire("a"))
            await until(lambda: models.models["a"].status == "loading")
            holder.gate.set()
        assert holder.loads == ["a"] and len(got) == 3 and models.models["a"].users == 3

    run_with(folders, ["a", "b"], body)


def test_past_the_bound_the_least_recently_used_idle_model_goes(folders):
    async def body(models: Models, holder: Holder) -> None:
        for name in ("a", "b", "a"):
            models.release(await models.acquire(name))
        c = await models.acquire("c")  # b was used longer ago than a: b goes
        assert holder.unloads == ["b"] and c.status == "loaded"
        assert {n: m.status for n, m in models.models.items()} == {"a": "loaded", "b": "unloaded", "c": "loaded"}

    run_with(folders, ["a", "b", "c"], body, max_loaded=2)


def test_a_model_with_a_request_or_a_job_open_is_never_unloaded(folders):
    async def body(models: Models, holder: Holder) -> None:
        a = await models.acquire("a")  # its request runs
        with pytest.raises(ApiError) as caught:
            await models.acquire("b")
        assert caught.value.status == 503 and caught.value.code == "models_busy"
        assert int(caught.value.headers["Retry-After"]) > 0
        # Its request let go, but one of its jobs still open: busy too.
        serving = a.served.serving
        [choice] = serving.submit([a.served.opts.request([1, 5, 9], chat_reply=False, max_tokens=200)])
        models.release(a)
        with pytest.raises(ApiError):
            await models.acquire("b")
        assert a.status == "loaded" and holder.unloads == []
        await choice.aclose()  # cancelled: the model is idle, and goes for b
        b = await models.acquire("b")
        assert b.status == "loaded" and holder.unloads == ["a"]

    run_with(folders, ["a", "b"], body, max_loaded=1, queue_limit=0)


def test_a_request_waits_for_a_slot_and_takes_it_when_freed(folders):
    async def body(models: Models, holder: Holder) -> None:
        a = await models.acquire("a")
        got: list = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_append, got, models.acquire("b"))
            await until(lambda: models._waiting == 1)
            assert got == [] and a.status == "loaded"
            models.release(a)
        assert got[0].name == "b" and holder.unloads == ["a"] and models._waiting == 0

    run_with(folders, ["a", "b"], body, max_loaded=1, queue_limit=1)


def test_a_load_that_fails_is_a_500_and_the_next_request_tries_again(folders):
    async def body(models: Models, holder: Holder) -> None:
        for _ in range(2):
            with pytest.raises(ApiError) as caught:
                await models.acquire("bad")
            assert caught.value.status == 500 and "unknown model layout" in caught.value.message
        assert holder.loads == ["bad", "bad"] and models.models["bad"].status == "unloaded"
        models.release(await models.acquire("a"))

    run_with(folders, ["a", "bad"], body)


def test_keep_alive_zero_unloads_when_idle_and_unknown_names_are_404s(folders):
    async def body(models: Models, holder: Holder) -> None:
        models.release(await models.acquire("a"), keep_alive_s=0.0)
        await until(lambda: models.models["a"].status == "unloaded")
        models.release(await models.acquire(None))  # no name: the first model, kept (inf) this time
        assert holder.loads == ["a", "a"] and models.models["a"].status == "loaded"
        assert models.lookup("a:latest").name == "a"
        with pytest.raises(ApiError) as caught:
            models.lookup("gpt-4o-mini")
        assert caught.value.status == 404 and "'a', 'b'" in caught.value.message

    run_with(folders, ["a", "b"], body)


def test_an_unload_asked_waits_for_the_running_request(folders):
    async def body(models: Models, holder: Holder) -> None:
        a = await models.acquire("a")
        done: list = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_append, done, models.unload("a"))
            await until(lambda: a.evict)
            assert done == [] and a.status == "loaded"
            models.release(a)
        assert done == [True] and a.status == "unloaded" and holder.unloads == ["a"]

    run_with(folders, ["a", "b"], body)


def test_past_the_memory_budget_the_least_recently_used_idle_model_goes(folders):
    size = files_size(folders["a"])

    async def body(models: Models, holder: Holder) -> None:
        for name in ("a", "b", "a"):
            models.release(await models.acquire(name))
        assert models.memory_used() >= 2 * size
        c = await models.acquire("c")  # a third one's files pass the budget: b, used longer ago, goes
        assert holder.unloads == ["b"] and c.status == "loaded"
        assert models.memory_used() <= models.memory_budget

    # Room for one model loaded and another loading (twice its files), and the KV pages their short
    # replies write; not for a third one loading beside two.
    run_with(folders, ["a", "b", "c"], body, memory_budget=int(3.6 * size))


def test_a_model_larger_than_the_memory_budget_is_refused_without_loading(folders):
    async def body(models: Models, holder: Holder) -> None:
        with pytest.raises(ApiError) as caught:
            await models.acquire("a")
        assert caught.value.status == 507 and caught.value.code == "model_too_large"
        assert holder.loads == []

    run_with(folders, ["a", "b"], body, memory_budget=files_size(folders["a"]) // 2)


def test_a_pinned_model_loads_at_start_and_is_never_unloaded_for_room_or_idleness(folders):
    async def body(models: Models, holder: Holder) -> None:
        a = models.models["a"]
        await until(lambda: a.status == "loaded")  # nobody asked for it
        models.release(await models.acquire("a"), keep_alive_s=0.0)  # pinned: it stays
        models.release(await models.acquire("b"))  # b's load gives the reaper its turns
        c = await models.acquire("c")  # a was used longer ago than b, but it is pinned: b goes
        assert holder.unloads == ["b"] and a.status == "loaded" and c.status == "loaded"
        assert [item.get("pinned") for item in models.listing()] == [True, None, None]

    run_with(folders, ["a", "b", "c"], body, max_loaded=2, pinned=("a",))

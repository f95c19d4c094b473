"""What the commands ask of a generation source, local or remote: the one face of ``Scheduler``
(``scheduler.py``) and ``RemoteSource`` (``remote.py``), declared once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, runtime_checkable

from llama_chat.inference.types import Request, SchedulerStats


@runtime_checkable
class Source(Protocol):
    """One request at a time (``stream``), or many (``async with source:`` then ``submit``)."""

    name: str

    @property
    def compiles(self) -> bool: ...  # whether the first request waits for a compile

    @property
    def compile_failure(self) -> str | None: ...  # why compiling failed, if it did

    @property
    def max_seq_len(self) -> int: ...

    @property
    def device(self) -> Any: ...

    @property
    def stats(self) -> SchedulerStats: ...

    def warm_up(self, sampling: Any = None) -> None: ...

    def check(self, request: Request) -> None: ...

    def align_to_cache(self, ids: list[int]) -> list[int]: ...

    def stream(self, request: Request) -> AbstractAsyncContextManager[AsyncIterator[Any]]: ...

    def submit(self, request: Request) -> AsyncIterator[Any]: ...

    async def __aenter__(self) -> Source: ...

    async def __aexit__(self, *exc_info: object) -> bool | None: ...


__all__ = ["Source"]

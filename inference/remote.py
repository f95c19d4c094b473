"""A generation source on another machine: an OpenAI-compatible server (``-m openai:URL``) behind
the same stream of responses as the scheduler's, so the one-shot command, the chat
and ``--batch`` run against it unchanged.

::

    model = connect("openai:http://host:8000/v1#NAME", api_key=...)   # asks the server's /models
    source = RemoteSource(model)
    async with source.stream(request) as stream:       # one request, as Engine.stream
        async for response in stream: ...              # Response items, text already made
    async with source:                                 # many, as the scheduler:
        stream = source.submit(request)                # at most max_batch requests at once

The prompt crosses as text, since the server tokenizes and applies its own chat template. The
command builds ``Request.prompt_ids`` with a remote model's tokenizer and chat format, which are
carriers: ``TextCarrier`` spells a text as its UTF-8 bytes, one id each; ``DialogCarrier`` spells
a dialog as a marker id followed by its messages as JSON. ``RemoteSource`` reads them back: a
dialog goes to ``/chat/completions``, a text to ``/completions``. Counts of tokens come from the
server's ``usage``; the carriers' lengths count bytes, so a chat fitting its dialog into the
context by them stays on the safe side.

Each piece of text the server streams becomes one ``TokenEvent`` of its UTF-8 bytes, through the
same ``TextStream`` as local tokens: stop strings are matched here too (a server that ignores
``stop`` is still stopped), and a client that leaves closes the connection, which is how a server
(ours: ``llama-chat serve``) knows to cancel the job.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import httpx
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from llama_chat.inference.reasoning import ReplyText, ThinkSplit, ThinkTags
from llama_chat.inference.text_stream import TextStream
from llama_chat.inference.types import (Completion, EmptyPrompt, GenerationState, Request, RequestError, Tally,
                                        Timings, TokenEvent)
from llama_chat.ml.controls import DEFAULT_MAX_BATCH, SamplingParams
from llama_chat.model.chat_format import Message

PREFIX = "openai:"
DIALOG = 256  # the id that starts a dialog: after it, the messages as JSON bytes
CARRIER_VOCAB = 257
# The context when the server does not say (llama-chat serve says context_length, vLLM
# max_model_len, llama-server n_ctx in its /props): the server refuses a prompt that does not fit,
# and a dialog is then sent again without its oldest turns (``trimmed``).
UNKNOWN_CONTEXT = 1 << 20
# What servers say of a prompt longer than their context: OpenAI's and vLLM's code, llama-server's
# error type, and the words of those that say it in the message alone.
CONTEXT_EXCEEDED = ("context_length_exceeded", "exceed_context_size_error", "exceeds the available context",
                    "maximum context length", "context length", "too many tokens")
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # between two pieces of a stream: a long queue or a long prefill on the server
READ_TIMEOUT_ENV = "LLAMA_CHAT_REMOTE_READ_TIMEOUT_S"  # seconds of silence before a stream is given up
BUFFER = 8  # events waiting for the consumer; a slow one slows the reading of the connection
NO_ID = -1  # a piece of text from the server: its token ids are not known here

FINISH_REASONS = {"stop": GenerationState.EOS, "length": GenerationState.MAX_TOKENS,
                  "cancelled": GenerationState.CANCELLED, "error": GenerationState.ERROR}
# The command's controls OpenAI has no field for, sent only when set: servers that take them
# (llama-chat serve, vLLM) use them, and OpenAI's own refuses them rather than ignore them.
EXTRA_CONTROLS = ("top_k", "min_p", "typical_p", "repetition_penalty", "repeat_last_n", "no_repeat_ngram_size",
                  "min_new_tokens")
_NEUTRAL = SamplingParams()


class RemoteError(RuntimeError):
    """The server could not be reached, failed, or answered what is not OpenAI's API."""


class RemoteRequestError(RequestError):
    """The server refused a request (a 4xx): the request is at fault, as for a local model."""


def is_remote(spec: str | None) -> bool:
    return spec is not None and spec.startswith(PREFIX)


@dataclass(frozen=True)
class RemoteSpec:
    """``openai:URL[#NAME]``: the API's base URL (up to ``/v1``) and, if given, the model's name."""

    base_url: str
    model: str | None = None

    @classmethod
    def parse(cls, spec: str, model: str | None = None) -> RemoteSpec:
        url, _, name = spec.removeprefix(PREFIX).partition("#")
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")) or len(url.split("//", 1)[1]) == 0:
            raise RemoteRequestError(f"{spec}: expected openai:http://HOST:PORT/v1 (or https://), with #NAME "
                                     f"or --remote-model NAME for the model")
        return cls(url, model or name or None)


# -- the carriers --------------------------------------------------------------------------------------


class TextCarrier:
    """A remote model's tokenizer: a text's UTF-8 bytes, one id each (the server tokenizes)."""

    vocab_size = CARRIER_VOCAB
    bos_id = None
    eos_id = None
    stop_ids: frozenset[int] = frozenset()
    special_tokens: dict[str, int] = {}
    strips_leading_space = False

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else b""


class DialogCarrier:
    """A remote model's chat format: the messages themselves (the server applies its template)."""

    name = "remote"

    def encode_dialog(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                      template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        data = json.dumps([{"role": m.role, "content": m.content} for m in messages], ensure_ascii=False)
        return [DIALOG, *data.encode("utf-8")]


def prompt_of(ids: Sequence[int]) -> str | list[dict[str, str]]:
    """What carrier ids spell: a dialog's messages, or a text."""
    if ids and ids[0] == DIALOG:
        return json.loads(bytes(ids[1:]).decode("utf-8"))
    return bytes(ids).decode("utf-8", errors="replace")


# -- the model ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteModel:
    """What loading ``-m openai:URL`` gives: the fields of ``LoadedModel`` the command reads."""

    spec: RemoteSpec
    name: str
    api_key: str | None
    max_seq_len: int
    tokenizer: TextCarrier = field(default_factory=TextCarrier)
    chat_format: DialogCarrier | None = field(default_factory=DialogCarrier)
    layout: str = "remote"

    @property
    def path(self) -> str:
        return self.spec.base_url

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def connect(spec: str, *, model: str | None = None, api_key: str | None = None, template: str = "auto",
            timeout_s: float = CONNECT_TIMEOUT_S) -> RemoteModel:
    """The server's model named by ``spec`` (or ``model``), checked against its ``/models``: the
    only one there when none is named. ``template`` none: plain completion, no chat."""
    parsed = RemoteSpec.parse(spec, model)
    if template not in ("auto", "none"):
        raise RemoteRequestError(f"--template {template}: the server applies its model's own chat template "
                                 f"(auto), or none for plain completion")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{parsed.base_url}/models", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise RemoteError(f"{parsed.base_url}: cannot reach the server ({_why(e)})") from None
    if response.status_code != 200:
        raise _error_of(parsed.base_url, response.status_code, response.content)
    try:
        listed = {m["id"]: m for m in response.json()["data"]}
    except (ValueError, KeyError, TypeError):
        raise RemoteError(f"{parsed.base_url}/models: not an OpenAI model list") from None
    name = parsed.model
    if name is None:
        if len(listed) != 1:
            names = ", ".join(sorted(listed)) or "none"
            raise RemoteRequestError(f"{parsed.base_url} serves {len(listed)} models ({names}): name one with "
                                     f"#NAME or --remote-model NAME")
        name = next(iter(listed))
    elif name not in listed:
        raise RemoteRequestError(f"{parsed.base_url} has no model {name!r} (it has {', '.join(sorted(listed))})")
    info = listed.get(name) or {}
    context = info.get("context_length") or info.get("max_model_len") or _props_context(parsed.base_url, headers,
                                                                                         timeout_s)
    return RemoteModel(RemoteSpec(parsed.base_url, name), name, api_key, int(context or UNKNOWN_CONTEXT),
                       chat_format=None if template == "none" else DialogCarrier())


def _props_context(base_url: str, headers: dict[str, str], timeout_s: float) -> int | None:
    """llama-server's context, from its ``/props`` at the root (``n_ctx``, or in
    ``default_generation_settings``); None from a server without it."""
    root = base_url.removesuffix("/").removesuffix("/v1")
    try:
        response = httpx.get(f"{root}/props", headers=headers, timeout=timeout_s)
        props = response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(props, dict):
        return None
    settings = props.get("default_generation_settings")
    for value in (props.get("n_ctx"), settings.get("n_ctx") if isinstance(settings, dict) else None):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def context_exceeded(status: int, body: bytes) -> bool:
    """Whether a server's refusal says the prompt is longer than its context."""
    text = body[:4096].decode("utf-8", errors="replace").lower()
    return status in (400, 413) and any(sign in text for sign in CONTEXT_EXCEEDED)


def trimmed(ids: Sequence[int]) -> list[int] | None:
    """A dialog without its oldest turn: the first message after the system's (and the replies
    that answer it, up to the next user message); None when only the last user message is left."""
    if not ids or ids[0] != DIALOG:
        return None
    messages = prompt_of(ids)
    head = 1 if messages and messages[0].get("role") == "system" else 0
    later = [i for i in range(head + 1, len(messages)) if messages[i].get("role") == "user"]
    if not later:
        return None
    kept = messages[:head] + messages[later[0]:]
    return [DIALOG, *json.dumps(kept, ensure_ascii=False).encode("utf-8")]


def read_timeout_s() -> float:
    """The read timeout: ``READ_TIMEOUT_ENV`` when it is a number of seconds > 0, else the default."""
    try:
        value = float(os.environ.get(READ_TIMEOUT_ENV, ""))
    except ValueError:
        return READ_TIMEOUT_S
    return value if 0 < value < float("inf") else READ_TIMEOUT_S


def _why(e: Exception) -> str:
    if isinstance(e, httpx.ReadTimeout):
        return f"the server sent nothing for {read_timeout_s():g} s (the read timeout; {READ_TIMEOUT_ENV} sets it)"
    return str(e) or type(e).__name__


def _error_of(url: str, status: int, body: bytes) -> Exception:
    """The server's error object as one line: a 4xx is the request's fault, anything else the server's."""
    try:
        error = json.loads(body)["error"]
        message = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode("utf-8", errors="replace").strip() or "no message"
    text = f"{url}: {status}: {' '.join(str(message).split())}"
    return RemoteRequestError(text) if 400 <= status < 500 else RemoteError(text)


# -- requests ----------------------------------------------------------------------------------------


def request_body(model: RemoteModel, request: Request) -> tuple[str, dict[str, Any]]:
    """The route and the body that ask the server for ``request``."""
    prompt = prompt_of(request.prompt_ids)
    chat = isinstance(prompt, list)
    s = request.sampling
    body: dict[str, Any] = {"model": model.name, ("messages" if chat else "prompt"): prompt, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": s.temperature,
                            "top_p": s.top_p, "seed": request.seed}
    if request.max_tokens is not None:
        body["max_tokens"] = request.max_tokens
    if request.stop:
        body["stop"] = list(request.stop)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(s, name):
            body[name] = getattr(s, name)
    if s.logit_bias:
        body["logit_bias"] = {str(token): (-100.0 if bias == -math.inf else bias) for token, bias in s.logit_bias}
    for name in EXTRA_CONTROLS:
        if getattr(s, name) != getattr(_NEUTRAL, name):
            body[name] = getattr(s, name)
    if request.max_time is not None:
        body["max_time"] = request.max_time
    if request.constraint is not None:
        body["response_format"] = _response_format(request)
    return ("/chat/completions" if chat else "/completions"), body


def _response_format(request: Request) -> dict[str, Any]:
    kind, source = request.constraint.kind, request.constraint.source
    if kind == "json":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "reply", "schema": json.loads(source)}}
    raise RemoteRequestError(f"a remote model takes a JSON schema or JSON as structured output, not a {kind}")


@dataclass
class _Usage:
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    completion_tokens: int | None = None
    reasoning_tokens: int = 0


@dataclass(frozen=True)
class RemoteCompletion(Completion):
    """A completion whose token ids stayed on the server: its count is the server's."""

    generated: int = 0

    @property
    def completion_tokens(self) -> int:
        return self.generated


class RemoteStream(TextStream):
    """One request's responses, as ``Engine.stream`` gives them; ``completion()`` counts tokens
    as the server's ``usage`` did. An error of the server (kept in ``error``) ends the iteration by
    raising it, or, ``raises`` False (a job among many), with finish reason ``error``."""

    def __init__(self, request: Request, receive: MemoryObjectReceiveStream[TokenEvent], *, raises: bool) -> None:
        # A server that keeps a thinking model's thinking apart sends it in its own field; it comes
        # here between the tags, so the one splitter keeps it apart again (``_spelled``).
        super().__init__(request, ReplyText(request.stop, split=ThinkSplit(REMOTE_TAGS)), Tally(request.request_id, 0),
                         receive)
        self.usage = _Usage()
        self.error: Exception | None = None
        self.raises = raises
        self.request_id = request.request_id
        self._scope: anyio.CancelScope | None = None
        self._first_s: float | None = None
        self._last_s: float | None = None

    async def __anext__(self):
        try:
            return await super().__anext__()
        except StopAsyncIteration:
            if self.error is not None and self.raises:
                error, self.error = self.error, None
                raise error from None
            raise

    def cancel(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    def _respond(self, event: TokenEvent):
        if event.data:
            self._first_s = event.elapsed_s if self._first_s is None else self._first_s
            self._last_s = event.elapsed_s
        return super()._respond(event)

    def _stop_early(self) -> None:
        self.cancel()  # a stop string matched here: the server's job is ended by closing the connection

    def completion(self) -> RemoteCompletion:
        if not self._done:
            self.cut_off()
        tally, usage = self.tally, self.usage
        generated = usage.completion_tokens if usage.completion_tokens is not None else len(tally.token_ids)
        prompt = usage.prompt_tokens or 0
        first, last = self._first_s, self._last_s
        prefill = (prompt - usage.cached_tokens) / first if first else None
        spread = last - first if first is not None and last is not None else 0.0
        decode = (generated - 1) / spread if spread > 0 and generated > 1 else None
        return RemoteCompletion(self.request_id, self.text, (), tally.finish_reason, prompt,
                                Timings(first, prefill, decode), usage.cached_tokens, reasoning=self.reasoning,
                                reasoning_tokens=usage.reasoning_tokens, generated=generated)


@dataclass(frozen=True)
class RemoteOptions:
    max_batch: int  # requests open at once, as the scheduler's jobs running at once


class RemoteSource:
    """A remote model as a generation source (``inference/source.Source``): ``stream`` (one
    request) or ``async with`` + ``submit`` (many, at most ``max_batch`` at once)."""

    def __init__(self, model: RemoteModel, *, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        self.model = model
        self.name = model.name
        self.tokenizer = model.tokenizer
        self.max_batch = max_batch
        self.options = RemoteOptions(max_batch)
        self.submitted = self.finished = self.generated = self.prompt_tokens = self.cached_tokens = 0
        self._client: httpx.AsyncClient | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._limiter: anyio.CapacityLimiter | None = None

    # -- what the command asks of every source --------------------------------------------------------

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    @property
    def device(self) -> str:
        return "remote"

    compiles = False
    compile_failure = None

    def warm_up(self, sampling: SamplingParams | None = None) -> None:
        """Nothing to compile here."""

    def check(self, request: Request) -> None:
        """The request's faults that can be found here; the server finds the others (a prompt
        longer than its context) and refuses them with a ``RemoteRequestError``."""
        if not request.prompt_ids or request.prompt_ids == (DIALOG,):
            raise EmptyPrompt()
        if request.beams.enabled:
            raise RemoteRequestError("beam search needs the model in this process, not a remote one")
        request_body(self.model, request)

    def align_to_cache(self, ids: list[int]) -> list[int]:
        return ids  # the server keeps its own cache

    @property
    def stats(self):
        """The counters ``--batch --stats`` shows, in the scheduler's form (no pages here)."""
        from llama_chat.inference.types import SchedulerStats

        return SchedulerStats(jobs_submitted=self.submitted, jobs_finished=self.finished,
                              prefill_tokens=self.prompt_tokens - self.cached_tokens, cached_tokens=self.cached_tokens,
                              generated_tokens=self.generated, steps=0, mixed_steps=0, page_size=0, pages_total=0,
                              pages_free=0, pages_cached=0, pages_in_use=0, pages_peak=0, evictions=0)

    # -- one request -------------------------------------------------------------------------------------

    @asynccontextmanager
    async def stream(self, request: Request) -> AsyncIterator[RemoteStream]:
        self.check(request)
        async with self._new_client() as client, anyio.create_task_group() as tg:
            stream = self._start(tg, client, request, None, raises=True)
            try:
                yield stream
            finally:
                stream.cancel()

    # -- many requests -----------------------------------------------------------------------------------

    async def __aenter__(self) -> RemoteSource:
        self._client = self._new_client()
        await self._client.__aenter__()
        self._limiter = anyio.CapacityLimiter(self.max_batch)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        return self

    async def __aexit__(self, *exc_info) -> bool | None:
        assert self._task_group is not None and self._client is not None
        try:
            return await self._task_group.__aexit__(*exc_info)
        finally:
            await self._client.__aexit__(None, None, None)
            self._task_group = self._client = None

    def submit(self, request: Request) -> RemoteStream:
        if self._task_group is None or self._client is None:
            raise RuntimeError("submit requests inside `async with source:`")
        self.check(request)
        return self._start(self._task_group, self._client, request, self._limiter, raises=False)

    # -- internals ---------------------------------------------------------------------------------------

    def _new_client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.max_batch + 1, max_keepalive_connections=self.max_batch)
        return httpx.AsyncClient(headers=self.model.headers(), limits=limits,
                                 timeout=httpx.Timeout(read_timeout_s(), connect=CONNECT_TIMEOUT_S))

    def _start(self, tg: anyio.abc.TaskGroup, client: httpx.AsyncClient, request: Request,
               limiter: anyio.CapacityLimiter | None, *, raises: bool) -> RemoteStream:
        send, receive = anyio.create_memory_object_stream[TokenEvent](BUFFER)
        stream = RemoteStream(request, receive, raises=raises)
        stream._scope = anyio.CancelScope()
        self.submitted += 1
        tg.start_soon(self._produce, client, request, stream, send, limiter)
        return stream

    async def _produce(self, client: httpx.AsyncClient, request: Request, stream: RemoteStream,
                       send: MemoryObjectSendStream[TokenEvent], limiter: anyio.CapacityLimiter | None) -> None:
        assert stream._scope is not None
        with stream._scope, send:
            try:
                if limiter is None:
                    await self._exchange(client, request, stream, send)
                else:
                    async with limiter:
                        await self._exchange(client, request, stream, send)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the consumer went away
            except (RemoteError, RemoteRequestError, httpx.HTTPError) as e:
                stream.error = e if not isinstance(e, httpx.HTTPError) else RemoteError(
                    f"{self.model.spec.base_url}: {_why(e)}")
                if not stream.raises:
                    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                        await send.send(TokenEvent(request.request_id, 0, NO_ID, b"", GenerationState.ERROR, 0.0))
        self.finished += 1
        usage = stream.usage
        self.prompt_tokens += usage.prompt_tokens or 0
        self.cached_tokens += usage.cached_tokens
        self.generated += usage.completion_tokens or 0

    async def _exchange(self, client: httpx.AsyncClient, request: Request, stream: RemoteStream,
                        send: MemoryObjectSendStream[TokenEvent]) -> None:
        route, body = request_body(self.model, request)
        url = f"{self.model.spec.base_url}{route}"
        start = time.perf_counter()
        index = 0
        state: GenerationState | None = None
        thinking = False
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                refusal = await response.aread()
                shorter = trimmed(request.prompt_ids) if context_exceeded(response.status_code, refusal) else None
                if shorter is None:
                    raise _error_of(url, response.status_code, refusal)
                # A server that did not say its context said it now: the dialog goes again
                # without its oldest turn, until it fits or only its last question is left.
                await self._exchange(client, replace(request, prompt_ids=tuple(shorter)), stream, send)
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank lines between events, comments, other fields
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    raise RemoteError(f"{url}: not an OpenAI stream (a line is not JSON)") from None
                if "error" in chunk:
                    raise _error_of(url, 500, data.encode())
                _read_usage(chunk.get("usage"), stream.usage)
                for choice in chunk.get("choices") or ():
                    data, thinking = _spelled(choice, thinking)
                    if data:
                        await send.send(TokenEvent(request.request_id, index, NO_ID, data,
                                                   GenerationState.IN_PROGRESS, time.perf_counter() - start))
                        index += 1
                    if choice.get("finish_reason"):
                        state = FINISH_REASONS.get(choice["finish_reason"], GenerationState.EOS)
        if state is None:
            raise RemoteError(f"{url}: the stream ended without a finish reason")
        # The finishing event comes after the usage, which the server sends after the last piece.
        await send.send(TokenEvent(request.request_id, index, NO_ID, b"", state, time.perf_counter() - start))


# The thinking tags a remote reply's thinking is spelled in (``_spelled``): text, as no ids cross.
REMOTE_TAGS = ThinkTags()
# The fields in which servers send the thinking: llama-server's, DeepSeek's and LM Studio's; vLLM's,
# Ollama's and OpenRouter's.
REASONING_FIELDS = ("reasoning_content", "reasoning")


def _spelled(choice: dict, thinking: bool) -> tuple[bytes, bool]:
    """A streamed choice's piece as the bytes a local model would have written: its thinking
    after a start tag, its text after an end tag where thinking came before; and whether the reply
    is inside its thinking after it."""
    delta = choice.get("delta") or {}
    reasoning = next((delta[k] for k in REASONING_FIELDS if isinstance(delta.get(k), str) and delta[k]), "")
    text = delta.get("content") or choice.get("text") or ""
    out = b""
    if reasoning:
        out += (b"" if thinking else REMOTE_TAGS.start.encode()) + reasoning.encode("utf-8")
        thinking = True
    if text:
        out += (REMOTE_TAGS.end.encode() if thinking else b"") + text.encode("utf-8")
        thinking = False
    return out, thinking


def _read_usage(usage: Any, into: _Usage) -> None:
    if not isinstance(usage, dict):
        return
    into.prompt_tokens = usage.get("prompt_tokens", into.prompt_tokens)
    into.completion_tokens = usage.get("completion_tokens", into.completion_tokens)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        into.cached_tokens = details["cached_tokens"]
    details = usage.get("completion_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("reasoning_tokens"), int):
        into.reasoning_tokens = details["reasoning_tokens"]


__all__ = ["DialogCarrier", "RemoteCompletion", "RemoteError", "RemoteModel", "RemoteRequestError", "RemoteSource",
           "RemoteSpec", "RemoteStream", "TextCarrier", "connect", "context_exceeded", "is_remote", "prompt_of",
           "request_body", "trimmed"]

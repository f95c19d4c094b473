"""A remote entry of several models (``-m NAME=openai:URL``): its requests sent on to its server as
they came, and its answers sent back as they come.

::

    client ── POST /v1/chat/completions {"model": "big", ...} ──> this server
                                   the body as it is, "model" its name there ──> the remote server
    client <── the remote's status and its events, piece by piece, "model" the name asked for

The body crosses untouched but for its model's name, so streaming, tools, structured output and
every control a server takes go as the client sent them; the remote client of the command line
(``inference/remote.py``) carries a prompt and its controls only, which is why this sends the
request itself. A client that goes away closes the connection to the remote server, which is how
that server (ours, vLLM's, llama-server's) knows to cancel the job. A server that does not answer
is a 502 for this model's requests alone.
"""

from __future__ import annotations

import json
import os
from typing import Any

import anyio
import httpx
from starlette.requests import Request as HttpRequest
from starlette.types import Receive, Scope, Send

from llama_chat.cmd.models import Model, Models
from llama_chat.cmd.openai_api import ApiError, bad
from llama_chat.cmd.sanitize import one_line
from llama_chat.cmd.serve_app import LOG_DETAIL, LOG_OUTCOME
from llama_chat.inference.remote import CONNECT_TIMEOUT_S, RemoteSpec, read_timeout_s

# The routes a remote OpenAI-compatible server answers as this one does (under its ``/v1``).
FORWARDED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# The answer's headers that still hold once its body crosses again (httpx undoes its encoding).
KEPT_HEADERS = ("content-type", "cache-control", "retry-after", "x-request-id")
_API_KEY_ENV = "OPENAI_API_KEY"  # as ``-m openai:URL`` on the command line reads it


def client_of(models: Models) -> httpx.AsyncClient:
    """The registry's one client for its remote entries: their connections are kept between requests."""
    if models.remote_client is None:
        timeout = httpx.Timeout(read_timeout_s(), connect=CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
        models.remote_client = httpx.AsyncClient(timeout=timeout, limits=limits)
    return models.remote_client


async def forward(models: Models, model: Model, request: HttpRequest, body: dict[str, Any]) -> _Forwarded:
    """``request`` sent on to ``model``'s server; ApiError 400 for a route it does not answer,
    502 where its server does not answer."""
    path = request.url.path
    if path not in FORWARDED_PATHS:
        raise bad(f"the model {model.name!r} is another server's ({model.entry.source}): it answers "
                  f"{', '.join(FORWARDED_PATHS)}", "model", code="remote_model")
    spec = RemoteSpec.parse(model.entry.source)
    client = client_of(models)
    headers = _headers(model)
    upstream_name = spec.model or model.upstream or await _only_model(client, spec, model, headers)
    data = json.dumps({**body, "model": upstream_name}, ensure_ascii=False).encode()
    sent = client.build_request("POST", spec.base_url + path.removeprefix("/v1"), content=data,
                                headers={**headers, "content-type": "application/json"})
    try:
        answer = await client.send(sent, stream=True)
    except httpx.HTTPError as e:
        raise _unreachable(model, spec, e) from None
    if answer.status_code >= 500:  # the remote server's failure, not this one's: a bad gateway
        try:
            said = await answer.aread()
        except httpx.HTTPError:
            said = b""
        finally:
            await answer.aclose()
        raise ApiError(502, f"the model {model.name!r}: {spec.base_url} answered {answer.status_code}: "
                            f"{_message(said)}", code="remote_failed")
    return _Forwarded(answer, model.name, upstream_name)


def _message(body: bytes) -> str:
    """A server's error object's message (OpenAI's shape), else the start of what it said."""
    try:
        error = json.loads(body)["error"]
        text = error["message"] if isinstance(error, dict) else error
    except (ValueError, KeyError, TypeError):
        text = body[:200].decode("utf-8", errors="replace")
    return one_line(str(text)).strip() or "no message"


def _headers(model: Model) -> dict[str, str]:
    key = model.entry.settings.api_key or os.environ.get(_API_KEY_ENV)
    return {"authorization": f"Bearer {key}"} if key else {}


async def _only_model(client: httpx.AsyncClient, spec: RemoteSpec, model: Model, headers: dict[str, str]) -> str:
    """The name of the one model the server lists, where ``openai:URL`` named none: kept, and its
    context shown by /v1/models from then on."""
    try:
        answer = await client.get(f"{spec.base_url}/models", headers=headers)
    except httpx.HTTPError as e:
        raise _unreachable(model, spec, e) from None
    try:
        listed = answer.json()["data"] if answer.status_code == 200 else None
        names = [m["id"] for m in listed] if isinstance(listed, list) else None
    except (ValueError, KeyError, TypeError):
        names = None
    if names is None:
        raise ApiError(502, f"the model {model.name!r}: {spec.base_url}/models answered {answer.status_code}, "
                            "not OpenAI's list of models", code="remote_failed")
    if len(names) != 1:
        raise ApiError(502, f"the model {model.name!r}: {spec.base_url} serves {len(names)} models "
                            f"({', '.join(map(str, names[:8])) or 'none'}); name one, {model.name}="
                            f"{model.entry.source}#NAME", code="remote_failed")
    info = listed[0]
    context = info.get("context_length") or info.get("max_model_len")
    model.context = context if isinstance(context, int) and not isinstance(context, bool) else model.context
    model.upstream = str(names[0])
    return model.upstream


def _unreachable(model: Model, spec: RemoteSpec, e: Exception) -> ApiError:
    why = one_line(str(e)) or type(e).__name__
    return ApiError(502, f"the model {model.name!r} is served by {spec.base_url}, which does not answer ({why})",
                    code="remote_unreachable")


class _Forwarded:
    """The remote server's answer as this server's: its status and body, piece by piece, the
    model named as the client named it. A task beside them waits for the client to go away; then
    the connection to the remote server is closed, whatever is left unread."""

    def __init__(self, answer: httpx.Response, name: str, upstream_name: str) -> None:
        self.answer = answer
        self.name = name
        self.upstream_name = upstream_name
        self.events = answer.headers.get("content-type", "").startswith("text/event-stream")
        self.disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer = self.answer
        try:
            headers = [(k.encode(), answer.headers[k].encode()) for k in KEPT_HEADERS if k in answer.headers]
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, receive, tg.cancel_scope)
                if self.events:
                    await send({"type": "http.response.start", "status": answer.status_code, "headers": headers})
                    await self._events(send)
                else:
                    whole = await answer.aread()
                    await send({"type": "http.response.start", "status": answer.status_code, "headers": headers})
                    await send({"type": "http.response.body", "body": self._renamed(whole)})
                tg.cancel_scope.cancel()
        except httpx.HTTPError as e:  # the remote went away mid-answer: the client's stream ends here
            scope[LOG_OUTCOME] = "error"
            scope[LOG_DETAIL] = f"the remote server failed mid-answer: {one_line(str(e)) or type(e).__name__}"
        finally:
            with anyio.CancelScope(shield=True):
                await answer.aclose()
            if self.disconnected:
                scope[LOG_OUTCOME], scope[LOG_DETAIL] = "cancelled", "(client went away)"

    async def _events(self, send: Send) -> None:
        pending = b""
        async for piece in self.answer.aiter_bytes():
            pending += piece
            whole, _, pending = pending.rpartition(b"\n")
            if whole:
                lines = [self._renamed_event(line) for line in whole.split(b"\n")]
                await send({"type": "http.response.body", "body": b"\n".join(lines) + b"\n", "more_body": True})
        await send({"type": "http.response.body", "body": pending, "more_body": False})

    def _renamed_event(self, line: bytes) -> bytes:
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            return line
        return b"data: " + self._renamed(line[5:].strip())

    def _renamed(self, data: bytes) -> bytes:
        """A JSON object of the answer with its model named as the client named it; anything else as it is."""
        try:
            found = json.loads(data)
        except ValueError:
            return data
        if not isinstance(found, dict) or found.get("model") != self.upstream_name:
            return data
        found["model"] = self.name
        return json.dumps(found, ensure_ascii=False, separators=(",", ":")).encode()

    async def _watch(self, receive: Receive, scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        scope.cancel()


__all__ = ["FORWARDED_PATHS", "forward"]

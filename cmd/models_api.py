"""The HTTP side of several models behind one server (``models.py``): each request's model picked
from its body and held while its response runs; llama-server's ``POST /models/load`` and
``POST /models/unload``."""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from llama_chat.cmd.models import Models, keep_alive_seconds
from llama_chat.cmd.openai_api import ApiError, bad
from llama_chat.cmd.serve_app import LARGE_BODY_BYTES, PICKED, ServerState, _json_body, _parse_body, _read_body

# Ollama's routes, where a request's keep_alive says how long its model stays loaded once idle.
KEEP_ALIVE_PATHS = ("/api/chat", "/api/generate", "/api/embed")


async def with_model(state: ServerState, request: HttpRequest,
                     handler: Callable[[HttpRequest], Awaitable[Response]]) -> Response:
    """``handler``'s response on the model the body names (the first one served where it names
    none), loaded first if need be and held until the response is sent."""
    models = _several(state)
    data = await _read_body(state, request)
    request._body = data  # Starlette's own cache of the body: the route reads these bytes again
    if len(data) > LARGE_BODY_BYTES:  # parsing is CPU work: off the event loop, a few at a time
        body = await anyio.to_thread.run_sync(_parse_body, data, limiter=state.large_bodies)
    else:
        body = _parse_body(data)
    path = request.url.path
    name = body.get("model", body.get("name") if path == "/api/show" else None)
    if name is not None and not isinstance(name, str):
        raise bad("model must be the name of a model", "model")
    keep_alive = _keep_alive(body) if path in KEEP_ALIVE_PATHS else None
    if keep_alive == 0 and _nothing_to_generate(path, body):
        return _stopped(path, models.evict(name).name)
    model = await models.acquire(name)
    if model.entry.remote:
        from llama_chat.cmd.models_remote import forward

        try:
            return _Held(await forward(models, model, request, body), partial(models.release, model))
        except BaseException:
            models.release(model)
            raise
    token = PICKED.set(weakref.ref(model.served))
    try:
        response = await handler(request)
    except BaseException:
        models.release(model, keep_alive)
        raise
    finally:
        PICKED.reset(token)
    return _Held(response, partial(models.release, model, keep_alive))


def _nothing_to_generate(path: str, body: dict[str, Any]) -> bool:
    """Ollama's request that only loads a model, or with keep_alive 0 unloads it (``ollama stop``)."""
    if path == "/api/chat":
        return body.get("messages") in (None, [])
    return path == "/api/generate" and not body.get("prompt") and not body.get("suffix")


def _stopped(path: str, name: str) -> Response:
    """Ollama's answer to ``ollama stop``: the model goes once idle, and is not loaded to say so."""
    from llama_chat.cmd.ollama_api import created_at

    said = {"message": {"role": "assistant", "content": ""}} if path == "/api/chat" else {"response": ""}
    return JSONResponse({"model": name, "created_at": created_at(), **said, "done": True, "done_reason": "unload"})


def _keep_alive(body: dict[str, Any]) -> float | None:
    if body.get("keep_alive") is None:
        return None
    try:
        return keep_alive_seconds(body["keep_alive"])
    except ValueError as e:
        raise bad(str(e), "keep_alive") from None


class _Held:
    """A route's response that gives its model back once it is sent, or its client went away."""

    def __init__(self, response: Response, release: Callable[[], None]) -> None:
        self.response = response
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.release()


def _several(state: ServerState) -> Models:
    if state.models is None:
        state.require_ready()  # 503 while the one model loads
        raise bad("this server has one model, loaded for as long as it runs; start it with several -m to load "
                  "and unload models", code="one_model")
    return state.models


async def _name(state: ServerState, request: HttpRequest) -> str:
    body = await _json_body(state, request)
    name = body.get("model")
    if not isinstance(name, str):
        raise bad("model: the name of a model is needed", "model")
    return name


def model_routes(state: ServerState, endpoint: Callable) -> list[Route]:
    """/models/load and /models/unload, wrapped by the server's ``endpoint`` (the key)."""

    async def load(request: HttpRequest) -> Response:
        models = _several(state)
        model = await models.load(await _name(state, request))
        return JSONResponse({"success": True, "model": model.name, "status": model.status})

    async def unload(request: HttpRequest) -> Response:
        models = _several(state)
        model = models.lookup(await _name(state, request))
        if not await models.unload(model.name):
            raise ApiError(409, f"the model {model.name!r} still has requests running; it unloads when they end",
                           param="model", code="model_busy")
        return JSONResponse({"success": True, "model": model.name, "status": model.status})

    return [Route("/models/load", endpoint(load, picks=False), methods=["POST"]),
            Route("/models/unload", endpoint(unload, picks=False), methods=["POST"])]


__all__ = ["KEEP_ALIVE_PATHS", "model_routes", "with_model"]

"""The HTTP side of ``llama-chat serve``: OpenAI's routes and Anthropic's Messages API on Starlette,
over ``inference/serving.py``.

::

    RequestLog          one line per request on stderr, outcomes counted; no traceback ever
    └── CORS            only with --cors-origin
        └── routes      /health, /metrics, /v1/models, /v1/chat/completions, /v1/completions,
                        /v1/messages; Ollama's /api/... (``ollama_api.py``); /v1/messages/count_tokens,
                        /tokenize, /detokenize, /apply-template (``tokens_api.py``)
            └── GenerationResponse   the jobs of one request, streamed as server-sent events or
                                     sent whole; a client that goes away cancels them
                MessagesResponse     the same, as Anthropic's message and events
                OllamaResponse       the same, as Ollama's objects (``ollama_api.py``)

Every refusal is an OpenAI error object with a 4xx status (``openai_api.ApiError``), and
Anthropic's error object on /v1/messages, Ollama's on /api/.... The model
may still be loading: the routes then answer 503, and /health says so.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import math
import time
import uuid
import weakref
from functools import partial
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message as AsgiMessage, Receive, Scope, Send

from llama_chat.cmd.anthropic_api import MessageReply, error_body, matched_stop, parse_messages, sse
from llama_chat.cmd.http_protocol import BODY_WRITER, CLOSE, head_refusal
from llama_chat.cmd.openai_api import (ApiError, ChatMessage, Generation, LogprobsWriter, Reply, StreamEvents, bad,
                                       dumps, event, parse_chat, parse_completion, tool_call_deltas, usage)
from llama_chat.cmd.prompt import dialog_ids
from llama_chat.cmd.responses_api import (ResponseBuilder, ResponseStore, not_found, parse_responses,
                                          responses_usage, status_of)
from llama_chat.cmd.sanitize import one_line
from llama_chat.cmd.served import Served, refuse_generation
from llama_chat.inference.fim import FimPrompt, Infill, NoFimTokens, fill_in_the_middle
from llama_chat.inference.reasoning import Thinking, thinking_request
from llama_chat.inference.serving import NotAccepting, Overloaded, ServingMetrics, Snapshot
from llama_chat.inference.tool_calls import call_id
from llama_chat.inference.tool_formats import FORMATS, ToolFormat, prepare_dialog, tool_grammar
from llama_chat.inference.tool_stream import Delta, ToolStream
from llama_chat.inference.types import EmptyPrompt, GenerationState, PromptTooLong, Request, RequestError
from llama_chat.ml.controls import MAX_SEED, ControlError
from llama_chat.ml.grammar_compile import KeptCompiles
from llama_chat.ml.grammars import Constraint
from llama_chat.model.safe_input import BadInput, NotText, json_problem, loads
from llama_chat.model.tokenizers.base import encode_prompt

if TYPE_CHECKING:
    from llama_chat.cmd.http_protocol import BodyWriter
    from llama_chat.cmd.models import Models
    from llama_chat.inference.serving import Choice

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
                    "/api/chat", "/api/generate", "/infill")
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
JSON_HEADERS = [(b"content-type", b"application/json")]
LOADING_RETRY_AFTER_S = 2
# Where the response records what the log line and the outcome counter say of it.
LOG_DETAIL = "llama_chat.detail"
LOG_OUTCOME = "llama_chat.outcome"
CLIENT_GONE = 499  # nginx's status for a client that closed its connection before the answer
SHOWN_PATH_CHARS = 200
# A request's body takes 20 to 30 times its size in memory while it is parsed and its schema
# compiled. Large ones are prepared a few at a time, in few threads (each thread's allocations
# keep an arena of memory of their own), while small ones go on beside them.
LARGE_BODY_BYTES = 64 * 1024
LARGE_BODIES_AT_ONCE = 2


# With several models, the one a request's body names, picked (and loaded) before its route runs
# (``models_api.with_model``): ``require_ready`` gives it to the route. A weak reference: the
# contexts that callbacks and tasks copy while the route runs may outlive the request (a kept-alive
# connection's), and they must not keep an unloaded model's weights in memory. The registry holds
# the model while the request does.
PICKED: ContextVar[weakref.ref[Served] | None] = ContextVar("llama_chat_picked", default=None)


class ServerState:
    """What the routes read: the phase (loading, ready, restarting after a failure, stopping), the
    model once loaded, limits."""

    def __init__(self, *, api_key: str | None, max_body_bytes: int, log: Callable[[str], None] | None,
                 read_timeout_s: float = math.inf, responses: ResponseStore | None = None) -> None:
        self.responses = responses if responses is not None else ResponseStore()  # for previous_response_id
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s  # for a request's body, once its headers are in
        self.large_bodies = anyio.CapacityLimiter(LARGE_BODIES_AT_ONCE)
        self.log = log
        self.phase = "loading"
        self.served: Served | None = None
        self.models: Models | None = None  # several models (``models.py``); then ``served`` stays None
        self.metrics = ServingMetrics()

    def ready(self, served: Served) -> None:
        self.served = served
        self.phase = "ready"

    def serve_models(self, models: Models) -> None:
        self.models = models
        self.phase = "ready"

    def snapshot(self) -> Snapshot:
        if self.models is not None:
            return self.models.snapshot()
        if self.served is None or self.served.serving is None:
            return Snapshot(self.served is not None and self.phase == "ready")
        now = self.served.serving.snapshot()
        return Snapshot(self.phase == "ready", now.running, now.queued, now.stats)

    def require_ready(self) -> Served:
        picked = PICKED.get()
        if picked is not None and (served := picked()) is not None:
            return served
        if self.phase == "ready" and self.served is not None:
            return self.served
        if self.phase == "ready" and self.models is not None:
            raise ApiError(400, "this route names no model, and this server has several", code="model_not_found")
        if self.phase == "loading":
            raise ApiError(503, "the model is loading; try again shortly", code="model_loading",
                           headers={"Retry-After": str(LOADING_RETRY_AFTER_S)})
        if self.phase == "restarting":
            raise ApiError(503, "the scheduler is starting again after a failure; try again shortly",
                           code="restarting", headers={"Retry-After": "1"})
        raise ApiError(503, "the server is shutting down", code="shutting_down")


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def shown_path(path: str) -> str:
    """A request's path as a message or the log shows it: cut short past ``SHOWN_PATH_CHARS``."""
    return path if len(path) <= SHOWN_PATH_CHARS else f"{path[:SHOWN_PATH_CHARS]}... ({len(path)} characters)"


# -- routes ----------------------------------------------------------------------------------------


# A module's routes (``embeddings_api``, ``ollama_api``, ...), made with the server's state and its
# ``endpoint`` wrapper.
RouteMaker = Callable[["ServerState", Callable], list[Route]]
# With several models: the model a POST's body names, acquired around its route (``models_api``).
Picker = Callable[["ServerState", HttpRequest, Callable[[HttpRequest], Awaitable[Response]]], Awaitable[Response]]


def build_app(state: ServerState, *, cors_origins: tuple[str, ...] = (), routes: Sequence[RouteMaker] = (),
              pick: Picker | None = None) -> ASGIApp:
    """The server's app: its own routes, then ``routes``' (the modules that build on this one are
    passed in by ``serve.py``, which imports them all; none is imported here)."""
    def endpoint(handler: Callable[[HttpRequest], Awaitable[Response]], *, public: bool = False,
                 anthropic: bool = False, error_shape: Callable[[ApiError], dict[str, Any]] | None = None,
                 picks: bool = True):
        """``error_shape``: an API's own error object for a refusal (Ollama's), where not OpenAI's.
        ``picks``: with several models, a POST runs on the one its body names (not /models/...)."""
        async def run(request: HttpRequest) -> Response:
            try:
                if not public:
                    _authorize(state, request)
                if state.models is not None and picks and request.method == "POST" and pick is not None:
                    return await pick(state, request, handler)
                return await handler(request)
            except ApiError as e:
                request.scope[LOG_DETAIL] = e.message
                if anthropic:
                    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)
                if error_shape is not None:
                    return JSONResponse(error_shape(e), status_code=e.status, headers=e.headers)
                return error_response(e)
            except ClientDisconnect:  # gone while sending its body: nobody reads an answer
                request.scope[LOG_OUTCOME], request.scope[LOG_DETAIL] = "cancelled", "(client went away)"
                return Response(status_code=CLIENT_GONE)
        return run

    async def health(request: HttpRequest) -> Response:
        status = 200 if state.phase == "ready" else 503
        return JSONResponse({"status": "ok" if status == 200 else state.phase}, status_code=status)

    async def metrics(request: HttpRequest) -> Response:
        snapshot = state.snapshot()
        text = state.metrics.exposition(snapshot) + _kv_memory_lines(snapshot.stats)
        if state.models is not None:
            text += state.models.metric_lines()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def models(request: HttpRequest) -> Response:
        if state.models is not None:
            return JSONResponse({"object": "list", "data": state.models.listing()})
        served = state.require_ready()
        return JSONResponse({"object": "list", "data": [_model_object(served)]})

    async def model(request: HttpRequest) -> Response:
        if state.models is not None:
            name = state.models.lookup(request.path_params["name"]).name
            return JSONResponse(next(item for item in state.models.listing() if item["id"] == name))
        served = state.require_ready()
        _check_model(served, request.path_params["name"], param=None)
        return JSONResponse(_model_object(served))

    async def chat(request: HttpRequest) -> Response:
        return await _generate(state, request, parse_chat)

    async def completions(request: HttpRequest) -> Response:
        return await _generate(state, request, parse_completion)

    async def messages(request: HttpRequest) -> Response:
        return await _generate(state, request, parse_messages, MessagesResponse)

    async def responses(request: HttpRequest) -> Response:
        return await _generate(state, request, partial(parse_responses, store=state.responses),
                               partial(ResponsesResponse, store=state.responses))

    async def stored_response(request: HttpRequest) -> Response:
        response_id = request.path_params["id"]
        found = state.responses.get(response_id)
        if found is None:
            raise not_found(response_id)
        if request.method == "DELETE":
            state.responses.delete(response_id)
            return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
        return JSONResponse(found.body)

    async def http_error(request: HttpRequest, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            e = ApiError(404, f"no such route: {request.method} {shown_path(request.url.path)}", code="not_found")
        elif exc.status_code == 405:
            e = ApiError(405, f"{request.method} is not allowed on {shown_path(request.url.path)}",
                         code="method_not_allowed")
        else:
            e = ApiError(exc.status_code, str(exc.detail))
        return JSONResponse(e.body(), status_code=e.status, headers=dict(exc.headers or {}))

    routes = [
        Route("/health", endpoint(health, public=True), methods=["GET"]),
        Route("/metrics", endpoint(metrics), methods=["GET"]),
        Route("/v1/models", endpoint(models), methods=["GET"]),
        Route("/v1/models/{name:path}", endpoint(model), methods=["GET"]),
        Route("/v1/chat/completions", endpoint(chat), methods=["POST"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/messages", endpoint(messages, anthropic=True), methods=["POST"]),
        Route("/v1/responses", endpoint(responses), methods=["POST"]),
        Route("/v1/responses/{id}", endpoint(stored_response), methods=["GET", "DELETE"]),
        *(route for make in routes for route in make(state, endpoint)),
    ]
    middleware = [Middleware(RequestLog, state=state)]
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins),
                                     allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                                     allow_headers=["Authorization", "Content-Type", "X-Api-Key",
                                                    "Anthropic-Version"]))
    return Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: http_error})


def _kv_memory_lines(stats) -> str:
    """The KV pool's memory: resident where written, up to what it reserved (page_table.py)."""
    if stats is None:
        return ""
    lines = []
    for name, help, value in (
            ("llama_chat_kv_resident_bytes", "Bytes of KV cache pages written and not given back to the system.",
             stats.kv_resident_bytes),
            ("llama_chat_kv_reserved_bytes", "The most bytes the KV cache's pages may take.", stats.kv_reserved_bytes)):
        lines += [f"# HELP {name} {help}", f"# TYPE {name} gauge", f"{name} {value}"]
    return "\n".join(lines) + "\n"


def _authorize(state: ServerState, request: HttpRequest) -> None:
    """The key in ``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key`` (Anthropic's)."""
    if state.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        token = request.headers.get("x-api-key", "")
    if not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise ApiError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _model_object(served: Served) -> dict[str, Any]:
    context = served.embedder.max_tokens if served.embedder else served.serving.scheduler.max_seq_len
    return {"id": served.model_id, "object": "model", "created": served.created, "owned_by": "llama-chat",
            "context_length": context, "kind": served.loaded.kind}


def _check_model(served: Served, name: str | None, *, param: str | None = "model", any_name: bool = False) -> None:
    """A name the server does not have is refused where it asks about a model (/v1/models/NAME);
    a generation request that names another (many clients send their own default, such as
    gpt-4o-mini) is answered by the one model served, whose name the response reports."""
    if name is not None and name not in served.names and not any_name:
        raise ApiError(404, f"the model {name!r} does not exist; this server has {served.model_id!r}",
                       param=param, code="model_not_found")


async def _read_body(state: ServerState, request: HttpRequest) -> bytes:
    """The body's bytes, within the size and time limits."""
    limit = state.max_body_bytes
    too_big = ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large",
                       headers=CLOSE)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    body, size = [], 0
    with anyio.move_on_after(state.read_timeout_s) as reading:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            body.append(chunk)
    if reading.cancelled_caught:
        raise ApiError(408, f"the request body did not arrive within {state.read_timeout_s:g} s",
                       code="request_timeout", headers=CLOSE)
    return b"".join(body)


async def _json_body(state: ServerState, request: HttpRequest) -> dict[str, Any]:
    return _parse_body(await _read_body(state, request))


def _parse_body(data: bytes) -> dict[str, Any]:
    """The body as a JSON object, read by the one strict reader (``model/safe_input.loads``: bounded
    nesting and numbers, UTF-8 text without lone surrogates)."""
    try:
        value = loads(data)
    except json.JSONDecodeError as e:
        raise bad(f"the body is not valid JSON ({json_problem(e)})") from None
    except NotText as e:
        raise _not_text(e) from None
    except BadInput as e:
        raise bad(f"the body is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise bad("the body must be a JSON object")
    return value


def _not_text(e: NotText) -> ApiError:
    """A 400 that names the field holding a lone surrogate (or the object whose field name does)."""
    reason = str(e).removeprefix("a string ")
    if e.in_key:
        where = f" in {e.path}" if e.path else ""
        return bad(f"a field name{where} {reason}", e.path or None)
    return bad(f"{e.path or 'the body'} {reason}", e.path or None)


async def _generate(state: ServerState, request: HttpRequest, parse: Callable[[dict[str, Any]], Generation],
                    respond: type[GenerationResponse] | None = None) -> Response | GenerationResponse:
    served = state.require_ready()
    refuse_generation(served)
    data = await _read_body(state, request)
    # Parsing the body, checking the fields (a schema compiles) and tokenizing (a template renders)
    # are CPU work: off the event loop, which streams every other client's tokens.
    reply_id = uuid.uuid4().hex[:24]
    limiter = state.large_bodies if len(data) > LARGE_BODY_BYTES else None
    generation, requests, prompt_lens = await anyio.to_thread.run_sync(_prepare, served, data, parse, reply_id,
                                                                       limiter=limiter)
    try:
        choices = served.serving.submit(requests)
    except RequestError as e:
        raise _refused(e, generation) from None
    except Overloaded as e:
        raise ApiError(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after_s)}) from None
    except NotAccepting as e:
        raise ApiError(503, str(e), code="shutting_down") from None
    reply = Reply(generation.chat, f"{'chatcmpl' if generation.chat else 'cmpl'}-{reply_id}", served.model_id,
                  int(time.time()))
    return (respond or GenerationResponse)(generation, reply, choices, prompt_lens, served.loaded.tokenizer.token_bytes,
                                           served.tool_format)


def _refused(e: RequestError, generation: Generation) -> ApiError:
    if isinstance(e, PromptTooLong):
        return bad(str(e), generation.prompt_field, "context_length_exceeded")
    return bad(str(e), generation.prompt_field if isinstance(e, EmptyPrompt) else None)


def _prepare(served: Served, data: bytes, parse: Callable[[dict[str, Any]], Generation], reply_id: str
             ) -> tuple[Generation, list[Request], list[int]]:
    """The request's jobs from its body: ``n`` per prompt, choice ``j`` seeded ``seed + j`` when a
    seed is given. Each prompt's first job is checked here, in a worker thread, where its
    constraint is compiled against the vocabulary (kept for the others, and for the check at
    submission)."""
    generation = parse(_parse_body(data))
    _check_model(served, generation.model, any_name=True)
    # From the request's shape, before any prompt is tokenized or any job built.
    jobs = len(generation.prompts) * generation.n
    if jobs > served.serving.capacity:
        raise bad(f"this request asks for {jobs} jobs (n per prompt); the server takes at most "
                  f"{served.serving.capacity} at once", "n")
    loaded = served.loaded
    vocab = served.serving.scheduler.model.args.vocab_size
    for token, _ in generation.settings.get("logit_bias", ()):
        if token >= vocab:
            raise bad(f"logit_bias: token id {token} is outside the vocabulary (0 to {vocab - 1})", "logit_bias")
    speculation = served.serving.scheduler.options.speculation
    if generation.speculation.get("draft_model") and (speculation is None or speculation.draft is None):
        raise bad("draft: this server has no draft model (start it with --draft MODEL)", "draft")
    constraint = tool_constraint(served, generation)
    thinking = request_thinking(served, generation)
    requests, prompt_lens = [], []
    for p, prompt in enumerate(generation.prompts):
        fim = _fim_prompt(served, generation, prompt) if isinstance(prompt, Infill) else None
        ids = list(fim.ids) if fim is not None else _prompt_ids(served, generation, prompt, thinking)
        prompt_lens.append(len(ids))
        settings = dict(generation.settings)
        seed = settings.pop("seed", None)
        for j in range(generation.n):
            if seed is not None:
                settings["seed"] = (seed + j) % (MAX_SEED + 1)
            request = served.opts.request(ids, chat_reply=generation.chat and loaded.chat_format is not None,
                                          request_id=f"{reply_id}-{p * generation.n + j}", **settings)
            if generation.logprobs is not None:
                request = dataclasses.replace(request, logprobs=generation.logprobs)
            if generation.speculation:
                request = dataclasses.replace(request, **generation.speculation)
            if fim is not None:
                request = dataclasses.replace(request, stop_ids=fim.stop_ids)
            if constraint is not None:
                request = dataclasses.replace(request, constraint=constraint)
            if generation.chat and served.think is not None:
                request = _thinking_request(request, served, thinking, generation)
            if j == 0:
                try:
                    served.serving.scheduler.check(request)
                except RequestError as e:
                    raise _refused(e, generation) from None
            requests.append(request)
    return generation, requests, prompt_lens


def request_thinking(served: Served, generation: Generation) -> Thinking:
    """The thinking settings of a request: its own choices over the server's options."""
    base = served.opts.thinking()
    try:
        return dataclasses.replace(base, **generation.thinking)
    except ControlError as e:
        raise bad(str(e), e.name) from None


def _thinking_request(request: Request, served: Served, thinking: Thinking, generation: Generation) -> Request:
    tags, tokenizer = served.think
    try:
        return thinking_request(request, tags, thinking, tokenizer)
    except ControlError as e:  # the answer's grammar, with the thinking's before it, is refused
        raise bad(str(e), "response_format" if generation.tools is None else "tools") from None


def _prompt_ids(served: Served, generation: Generation, prompt, thinking: Thinking = Thinking()) -> list[int]:
    loaded = served.loaded
    if generation.chat:
        messages, extra = dialog_parts(served, generation, prompt)
        try:
            ids = dialog_ids(loaded.chat_format, messages, thinking=thinking, think=served.think, **extra)
        except ValueError as e:  # roles out of order for the format, a template that failed
            raise bad(one_line(str(e)), "messages") from None
        # A conversation's next turn finds the pages of its previous one, the reply's included,
        # when they were the last job to end (``Scheduler.align_to_cache``).
        return served.serving.scheduler.align_to_cache(ids)
    if isinstance(prompt, str):
        return encode_prompt(loaded.tokenizer, prompt)
    vocab = served.serving.scheduler.model.args.vocab_size
    if any(i >= vocab for i in prompt):
        raise bad(f"prompt: token ids must be below the vocabulary size, {vocab}", "prompt")
    return list(prompt)


def dialog_parts(served: Served, generation: Generation, messages) -> tuple[list, dict[str, Any]]:
    """What the chat template renders of a chat's messages: the messages and tools as the server's
    tool format writes them, and the request's own template variables."""
    if served.loaded.chat_format is None:
        raise bad("this model has no chat template: use /v1/completions, or start the server with "
                  "--template llama2|llama3|hf", "messages")
    messages, tools = prepare_dialog(served.tool_format, messages, generation.tools)
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    if generation.template_kwargs:
        extra["template_kwargs"] = generation.template_kwargs
    return messages, extra


def _fim_prompt(served: Served, generation: Generation, infill: Infill) -> FimPrompt:
    """A fill-in-the-middle's prompt, cut to leave room for the reply (up to half the context)."""
    context = served.serving.scheduler.max_seq_len
    reply = min(max(generation.settings.get("max_tokens") or 1, 1), context // 2)
    try:
        return fill_in_the_middle(served.loaded.tokenizer, infill, room=context - reply)
    except NoFimTokens as e:
        raise bad(str(e), "suffix" if infill.files is None else "input_suffix", "no_fim_tokens") from None


_grammars: KeptCompiles[Constraint] = KeptCompiles(8)  # a client sends the same tools with every turn


def tool_constraint(served: Served, generation: Generation) -> Constraint | None:
    """The grammar of a reply that may call the request's tools (None: no tools, or choice none)."""
    if generation.tools is None or not generation.tools.active:
        return None
    tools = generation.tools
    key = (served.tool_format, json.dumps([[t.name, t.parameters] for t in tools.tools]), tools.choice, tools.parallel)
    made = _grammars.get(key)
    if made is None:
        try:
            made = tool_grammar(served.tool_format, generation.tools, served.loaded.tokenizer.special_tokens)
        except ControlError as e:
            raise bad(f"tools: {e.reason}", "tools") from None
        made = _grammars.put(key, made, len(made.source))
    return made


# -- one request's jobs, sent back -----------------------------------------------------------------


class GenerationResponse:
    """An ASGI response that runs the request's jobs while it sends them: as server-sent events
    (``data: {chunk}`` ... ``data: [DONE]``) or as one JSON object at the end. A task beside them
    waits for the client to go away and cancels them if it does, during the prefill too."""

    ID_STYLE = "openai"  # of tool calls, where the format leaves it to the API

    def __init__(self, generation: Generation, reply: Reply, choices: list[Choice], prompt_lens: list[int],
                 token_bytes: Callable[[int], bytes], tool_format: ToolFormat = FORMATS["generic"]) -> None:
        self.generation = generation
        # Each choice's reader of tool calls, where the request offers tools the reply may call.
        calls = generation.tools is not None and generation.tools.active
        style = tool_format.id_style if tool_format.id_style != "openai" else self.ID_STYLE
        names = [tool.name for tool in generation.tools.offered()] if calls else []
        self.readers = [ToolStream(tool_format, lambda: call_id(style), names) for _ in choices] if calls else None
        self.reply = reply
        self.choices = choices
        self.prompt_lens = prompt_lens
        # One per choice where logprobs were asked for: a completion's text offsets run on.
        self.logprobs = (None if generation.logprobs is None
                         else [LogprobsWriter(reply.chat, token_bytes) for _ in choices])
        self.events = StreamEvents(reply)
        self.disconnected = False
        self._finished = False
        # Several choices stream into one response, each from its own task: one event at a time,
        # and an uncontended turn does not yield to the event loop (``fast_acquire``). A single
        # choice's task is the only sender and needs no lock.
        self._lock = anyio.Lock(fast_acquire=True) if len(choices) > 1 else None
        self._writer: BodyWriter | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The events go straight to the connection where uvicorn's writer is at hand
        # (``http_protocol.BodyWriter``); the start and the last message go through ASGI.
        self._writer = scope.get("extensions", {}).get(BODY_WRITER)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, receive, tg.cancel_scope)
                if self.generation.stream:
                    await self._stream(send)
                else:
                    await self._whole(send)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                for choice in self.choices:
                    await choice.aclose()  # cancels what has not finished
            scope[LOG_OUTCOME], scope[LOG_DETAIL] = self._summary()

    async def _watch(self, receive: Receive, scope: anyio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self._finished:
                    self.disconnected = True
                    scope.cancel()
                return

    async def _whole(self, send: Send) -> None:
        async def run(choice: Choice) -> None:
            async for _ in choice.pieces():
                pass

        async with anyio.create_task_group() as tg:
            for choice in self.choices:
                tg.start_soon(run, choice)
        completions = [choice.completion() for choice in self.choices]
        if any(c.finish_reason is GenerationState.ERROR for c in completions):
            status, body = 500, ApiError(500, "generation failed; see the server's log", code="generation_failed").body()
        else:
            logprobs = None if self.logprobs is None else [
                writer.render(choice.take_logprobs()) for writer, choice in zip(self.logprobs, self.choices)]
            messages = None
            if self.readers is not None:
                for reader, c in zip(self.readers, completions):
                    reader.feed(c.text)
                    reader.finish()
                messages = [ChatMessage(r.text(), tuple(r.tool_calls()), c.reasoning)
                            for r, c in zip(self.readers, completions)]
            status, body = 200, self.reply.whole(completions, self._usage(), logprobs, messages)
        await self._send_whole(send, status, body)

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        async with anyio.create_task_group() as tg:
            for choice in self.choices:
                tg.start_soon(self._stream_choice, choice, send)
        if any(c.completion().finish_reason is GenerationState.ERROR for c in self.choices):
            await self._send(send, event(ApiError(500, "generation failed; see the server's log",
                                                  code="generation_failed").body()))
        elif self.generation.include_usage:
            await self._send(send, event(self.reply.usage_chunk(self._usage())))
        self._finished = True
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _stream_choice(self, choice: Choice, send: Send) -> None:
        index = choice.index
        if self.reply.chat:
            await self._send(send, event(self.reply.chunk(index, "", first=True)))
        sent = 0
        reader = None if self.readers is None else self.readers[index]
        while (part := await choice.take()) is not None:
            text, thought = part
            if thought:
                await self._send(send, event(self.reply.chunk(index, "", reasoning=thought)))
            if not text:
                continue
            sent += len(text)
            if reader is not None:
                await self._send_read(send, choice, reader.feed(text))
                continue
            logprobs = self._logprobs_of(choice)
            await self._send(send, self.events.text(index, text) if logprobs is None
                             else event(self.reply.chunk(index, text, logprobs=logprobs)))
        completion = choice.completion()
        if reader is not None:
            await self._send_read(send, choice, reader.feed(completion.text[sent:]) + reader.finish())
            await self._send(send, event(self.reply.chunk(index, "", state=completion.finish_reason,
                                                          logprobs=self._logprobs_of(choice),
                                                          called=bool(reader.calls))))
            return
        # A cancel keeps the whole characters that were still held back.
        await self._send(send, event(self.reply.chunk(index, completion.text[sent:], state=completion.finish_reason,
                                                      logprobs=self._logprobs_of(choice))))

    async def _send_read(self, send: Send, choice: Choice, deltas: list) -> None:
        """A piece of a reply read for tool calls: its content, then its calls' pieces, each in a
        chunk of its own (the logprobs of its tokens on the first); nothing while all is held back."""
        text = "".join(d.content for d in deltas)
        calls = tool_call_deltas(deltas)
        if not text and not calls:
            return
        index = choice.index
        logprobs = self._logprobs_of(choice)
        if text:
            await self._send(send, event(self.reply.chunk(index, text, logprobs=logprobs)))
            logprobs = None
        if calls:
            await self._send(send, event(self.reply.chunk(index, "", logprobs=logprobs, tool_calls=calls)))

    def _deltas(self, text: str, final: bool = False) -> list[Delta]:
        """A piece of a one-choice reply read for tool calls (plain text where none were offered)."""
        reader = None if self.readers is None else self.readers[0]
        if reader is None:
            return [Delta(content=text)] if text else []
        return reader.feed(text) + (reader.finish() if final else [])

    def _logprobs_of(self, choice: Choice) -> dict[str, Any] | None:
        """The logprobs of the tokens ``choice`` took since its last chunk, where they were asked
        for and there are any (a piece's text may come from tokens an earlier chunk held back)."""
        if self.logprobs is None:
            return None
        entries = choice.take_logprobs()
        return self.logprobs[choice.index].render(entries) if entries else None

    async def _send_whole(self, send: Send, status: int, body: dict[str, Any]) -> None:
        """The whole answer as one JSON object: the request is finished, so a client leaving now
        cancels nothing."""
        self._finished = True
        await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
        await send({"type": "http.response.body", "body": dumps(body)})

    async def _send(self, send: Send, data: bytes) -> None:
        if self._writer is not None and await self._writer.write(data):
            return  # whole: another choice's event never lands inside it
        message = {"type": "http.response.body", "body": data, "more_body": True}
        if self._lock is None:
            await send(message)
        else:
            async with self._lock:
                await send(message)

    def _usage(self) -> dict[str, Any]:
        completions = [choice.completion() for choice in self.choices]
        n = self.generation.n
        # A prompt counts once however many choices it has; its cached tokens are those of its
        # first job (the others share the pages that one writes, a saving of this request's own).
        cached = sum(min(c.cached_tokens for c in completions[p * n:(p + 1) * n]) for p in range(len(self.prompt_lens)))
        return usage(sum(self.prompt_lens), cached, sum(c.completion_tokens for c in completions),
                     sum(c.reasoning_tokens for c in completions))

    def _summary(self) -> tuple[str, str]:
        completions = [choice.completion() for choice in self.choices]
        reasons = sorted({c.finish_reason.value for c in completions})
        if self.disconnected:
            outcome = "cancelled"
        elif "error" in reasons:
            outcome = "error"
        elif "cancelled" in reasons:
            outcome = "cancelled"
        else:
            outcome = "ok"
        u = self._usage()
        detail = (f"n={len(completions)} prompt={u['prompt_tokens']} cached={u['prompt_tokens_details']['cached_tokens']} "
                  f"completion={u['completion_tokens']} finish={','.join(reasons)}"
                  + (" (client went away)" if self.disconnected else ""))
        return outcome, detail


class MessagesResponse(GenerationResponse):
    """The same jobs sent back as Anthropic's Messages API: one ``message``, or its events. The
    chat's one choice is read for tool calls where tools were offered, and as plain text else."""

    ID_STYLE = "anthropic"

    def __init__(self, generation: Generation, reply: Reply, choices: list[Choice], prompt_lens: list[int],
                 token_bytes: Callable[[int], bytes], tool_format: ToolFormat = FORMATS["generic"]) -> None:
        super().__init__(generation, reply, choices, prompt_lens, token_bytes, tool_format)
        self.message = MessageReply(f"msg_{reply.id.removeprefix('chatcmpl-')}", reply.model, prompt_lens[0])
        self.token_bytes = token_bytes

    def _stop(self, completion) -> str | None:
        """The stop sequence that ended it: in the text of its tokens past the reply's text."""
        if completion.finish_reason is not GenerationState.STOP_STRING:
            return None
        whole = b"".join(self.token_bytes(t) for t in completion.token_ids).decode("utf-8", errors="replace")
        # A thinking model's tokens spell its thinking first: the answer's text is the last of it.
        end = whole.rfind(completion.text) + len(completion.text) if completion.reasoning else len(completion.text)
        return matched_stop(self.generation.settings.get("stop", ()), whole[end:])

    async def _whole(self, send: Send) -> None:
        choice = self.choices[0]
        async for _ in choice.pieces():
            pass
        completion = choice.completion()
        if completion.finish_reason is GenerationState.ERROR:
            status, body = 500, error_body(ApiError(500, "generation failed; see the server's log"))
        else:
            self._deltas(completion.text, final=True)
            reader = None if self.readers is None else self.readers[0]
            text = completion.text if reader is None else reader.text()
            calls = () if reader is None else reader.tool_calls()
            status, body = 200, self.message.whole(text, calls, completion.finish_reason, completion.completion_tokens,
                                                   self._stop(completion), completion.reasoning)
        await self._send_whole(send, status, body)

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        await self._send(send, self.message.start())
        choice, sent = self.choices[0], 0
        async for text, thought in choice.parts():
            sent += len(text)
            events = self.message.thinking(thought) + self.message.pieces(self._deltas(text))
            if events:
                await self._send(send, events)
        completion = choice.completion()
        if completion.finish_reason is GenerationState.ERROR:
            body = error_body(ApiError(500, "generation failed; see the server's log"))
            await self._send(send, sse("error", body))
        else:
            tail = self.message.pieces(self._deltas(completion.text[sent:], final=True))
            called = self.readers is not None and bool(self.readers[0].calls)
            await self._send(send, tail + self.message.end(completion.finish_reason, called,
                                                           completion.completion_tokens, self._stop(completion)))
        self._finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class ResponsesResponse(GenerationResponse):
    """The same job sent back as OpenAI's Responses API: one ``response``, or its typed events,
    kept in ``store`` for ``previous_response_id`` unless the request said ``store: false``."""

    def __init__(self, generation, reply: Reply, choices: list[Choice], prompt_lens: list[int],
                 token_bytes: Callable[[int], bytes], tool_format: ToolFormat = FORMATS["generic"], *,
                 store: ResponseStore) -> None:
        super().__init__(generation, reply, choices, prompt_lens, token_bytes, tool_format)
        self.builder = ResponseBuilder(f"resp_{reply.id.removeprefix('chatcmpl-')}", reply.model, generation)
        self.store = store

    def _responses_usage(self) -> dict[str, Any]:
        u = self._usage()
        return responses_usage(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                               u["completion_tokens"], u["completion_tokens_details"]["reasoning_tokens"])

    def _keep(self, body: dict[str, Any]) -> None:
        if self.generation.store:
            self.store.put(body, self.builder.conversation())

    async def _whole(self, send: Send) -> None:
        choice = self.choices[0]
        async for _ in choice.parts():
            pass
        completion = choice.completion()
        if completion.finish_reason is GenerationState.ERROR:
            status, body = 500, ApiError(500, "generation failed; see the server's log", code="generation_failed").body()
        else:
            self._deltas(completion.text, final=True)
            reader = None if self.readers is None else self.readers[0]
            text = completion.text if reader is None else reader.text()
            calls = () if reader is None else reader.tool_calls()
            status = 200
            body = self.builder.whole(text, calls, completion.reasoning, completion.finish_reason,
                                      self._responses_usage())
            self._keep(body)
        await self._send_whole(send, status, body)

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        builder = self.builder
        await self._send(send, builder.start())
        choice, sent = self.choices[0], 0
        async for text, thought in choice.parts():
            sent += len(text)
            events = builder.reasoning(thought) + builder.pieces(self._deltas(text))
            if events:
                await self._send(send, events)
        completion = choice.completion()
        if completion.finish_reason is GenerationState.ERROR:
            await self._send(send, builder.failed("generation failed; see the server's log"))
        else:
            tail = builder.pieces(self._deltas(completion.text[sent:], final=True))
            usage_object = self._responses_usage()
            await self._send(send, tail + builder.end(completion.finish_reason, usage_object))
            self._keep(builder.body(status_of(completion.finish_reason), usage_object))
        self._finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# -- the log line and the outcome of every request ---------------------------------------------------


class RequestLog:
    """One line per request (method, path, status, time, what the response recorded); the
    generation endpoints' outcomes counted for /metrics. An exception no route caught is logged in
    one line and answered 500 (when nothing was sent yet), never left to kill the connection with a
    traceback."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: int | None = None

        async def sending(message: AsgiMessage) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        failure = ""
        refusal = head_refusal(scope)
        try:
            if refusal is not None:
                scope[LOG_DETAIL] = refusal.message
                await error_response(refusal)(scope, receive, sending)
            else:
                await self.app(scope, receive, sending)
        except Exception as e:  # noqa: BLE001 - one line in the log, a 500 to the client, the server goes on
            failure = f" error: {type(e).__name__}: {e}"
            if status is None:
                body = ApiError(500, "internal error; see the server's log", code="internal_error").body()
                await sending({"type": "http.response.start", "status": 500, "headers": JSON_HEADERS})
                await send({"type": "http.response.body", "body": dumps(body)})
        method, path = scope.get("method", ""), shown_path(scope.get("path", ""))
        if method == "POST" and path in GENERATION_PATHS:
            self.state.metrics.count(scope.get(LOG_OUTCOME) or _outcome_of(status))
        if self.state.log is not None:
            client = scope.get("client")
            who = f"{client[0]}:{client[1]} " if client else ""
            detail = scope.get(LOG_DETAIL)
            self.state.log(one_line(f"{who}{method} {path} {status or '-'} {time.perf_counter() - start:.2f} s"
                                    + (f" {detail}" if detail else "") + failure))


def _outcome_of(status: int | None) -> str:
    if status is None or status >= 500 and status != 503:
        return "error"
    if status in (429, 503):
        return "rejected"
    if status >= 400:
        return "invalid"
    return "ok"

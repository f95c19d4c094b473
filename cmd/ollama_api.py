"""Ollama's own API as ``llama-chat serve`` speaks it: ``/api/chat`` and ``/api/generate`` read into
the same ``Generation`` the OpenAI routes make, and the model's routes (``/api/tags``,
``/api/show``, ``/api/ps``, ``/api/version``).

A body's ``options`` are the command line's controls under Ollama's names (``num_predict`` is
``max_tokens``, ``repeat_penalty`` is ``repetition_penalty`` ...), checked by the one checker every
surface uses; ``format`` is ``"json"`` or a JSON schema; ``tools`` are OpenAI's tool objects;
``think`` switches a thinking model's thinking. The reply is newline-delimited JSON objects, one
per piece, the last with ``done``, ``done_reason``, the token counts and the durations in
nanoseconds; or, with ``"stream": false``, that last one whole. Ollama's messages carry no call ids:
a tool result answers the earliest call of the assistant before it that is still unanswered (the one
its ``tool_name`` names, where it names one). Refusals are ``{"error": message}``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Send

from llama_chat.cmd.anthropic_api import tool_input
from llama_chat.cmd.batch_input import SETTING_KEYS
from llama_chat.cmd.models import ModelEntry, wall_time
from llama_chat.cmd.openai_api import (ApiError, Generation, LogprobsWriter, bad, dumps, finish_reason, format_setting,
                                       read_settings, read_tools)
from llama_chat.cmd.options import CONSTRAINT_OPTIONS
from llama_chat.cmd.serve_app import JSON_HEADERS, GenerationResponse, ServerState, _generate, _json_body
from llama_chat.cmd.served import Served
from llama_chat.inference.fim import Infill, NoFimTokens, find_fim_tokens
from llama_chat.inference.tool_calls import ToolCall, ToolError, check_results
from llama_chat.inference.tool_formats import FORMATS, ToolFormat, called_tool
from llama_chat.inference.tool_stream import Delta
from llama_chat.inference.types import GenerationState
from llama_chat.ml.controls import ControlError, check
from llama_chat.model.chat_format import CalledTool, Message

if TYPE_CHECKING:
    from llama_chat.inference.serving import Choice

# The version of Ollama's API these routes follow: clients check it before they use newer fields
# (tools, think, a schema as format).
OLLAMA_VERSION = "0.12.0"
NDJSON_HEADERS = [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-cache")]
# Ollama's options by the names of the controls they are (``batch_input.SETTING_KEYS``).
OPTION_SETTINGS = {"num_predict": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "typical_p": "typical_p", "repeat_penalty": "repetition_penalty",
                   "repeat_last_n": "repeat_last_n", "presence_penalty": "presence_penalty",
                   "frequency_penalty": "frequency_penalty", "seed": "seed", "stop": "stop"}
# The command line's other controls (logit_bias, min_new_tokens ...) under their own names, as on the
# other routes; the constraints are the body's ``format``.
OPTION_SETTINGS.update({name: name for name in SETTING_KEYS
                        if name not in OPTION_SETTINGS.values() and name not in CONSTRAINT_OPTIONS})
# Options about loading and running the model: the server's start decided them, so they are taken
# and change nothing.
RUNNER_OPTIONS = ("numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
                  "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "penalize_newline",
                  "mirostat_tau", "mirostat_eta")
# Samplers this server does not have, taken at the value that switches them off.
OFF_SAMPLERS = {"mirostat": 0, "tfs_z": 1}
# num_predict: -1 is no limit, -2 until the context is full; both are the server's own limit here.
UNLIMITED = (-1, -2)
# repeat_last_n: Ollama's -1 is the whole context, which is this server's 0.
WHOLE_CONTEXT = -1
PENALTIES_OFF = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
THINK_LEVELS = ("low", "medium", "high")  # gpt-oss' levels; here each one is thinking on
ROLES = ("system", "user", "assistant", "tool")
# Fields that change nothing here: a prompt too long is refused, and the one model stays loaded
# (with several, keep_alive is read before the route runs: ``models_api.py``).
IGNORED = ("keep_alive", "truncate", "shift")
COMMON_FIELDS = ("model", "stream", "options", "format", "think", "logprobs", "top_logprobs", *IGNORED)
CHAT_FIELDS = frozenset((*COMMON_FIELDS, "messages", "tools"))
GENERATE_FIELDS = frozenset((*COMMON_FIELDS, "prompt", "suffix", "system", "template", "raw", "images", "context"))


def error_body(e: ApiError) -> dict[str, Any]:
    return {"error": e.message}


# -- the routes -------------------------------------------------------------------------------------


def ollama_routes(state: ServerState, endpoint: Callable) -> list[Route]:
    """The routes, wrapped by the server's ``endpoint`` (the key) with Ollama's error object."""

    async def chat(request: HttpRequest) -> Response:
        started_ns = time.perf_counter_ns()
        served = state.require_ready()
        return await _generate(state, request, partial(parse_chat, served=served),
                               partial(OllamaResponse, started_ns=started_ns, api="chat"))

    async def generate(request: HttpRequest) -> Response:
        started_ns = time.perf_counter_ns()
        served = state.require_ready()
        return await _generate(state, request, partial(parse_generate, served=served),
                               partial(OllamaResponse, started_ns=started_ns, api="generate"))

    async def tags(request: HttpRequest) -> Response:
        if state.models is not None:
            return JSONResponse({"models": [_listed(m.served) if m.status == "loaded" and m.served is not None
                                            else _listed_unloaded(m.entry) for m in state.models.models.values()]})
        served = state.require_ready()
        return JSONResponse({"models": [_listed(served)]})

    async def show(request: HttpRequest) -> Response:
        served = state.require_ready()
        body = await _json_body(state, request)
        _named(served, body.get("model", body.get("name")))
        return JSONResponse(_shown(served))

    async def ps(request: HttpRequest) -> Response:
        if state.models is not None:  # the loaded ones, and when each unloads if left idle
            return JSONResponse({"models": [{**_running(model.served), "expires_at": wall_time(expires)}
                                            for model, expires in state.models.loaded()]})
        return JSONResponse({"models": [_running(state.require_ready())]})

    async def version(request: HttpRequest) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION})

    def route(path: str, handler: Callable, method: str) -> Route:
        return Route(path, endpoint(handler, error_shape=error_body), methods=[method])

    return [route("/api/chat", chat, "POST"), route("/api/generate", generate, "POST"),
            route("/api/tags", tags, "GET"), route("/api/show", show, "POST"), route("/api/ps", ps, "GET"),
            route("/api/version", version, "GET")]


# -- request bodies --------------------------------------------------------------------------------


def parse_chat(body: dict[str, Any], *, served: Served) -> Generation:
    _known(body, CHAT_FIELDS)
    if body.get("messages") in (None, []):  # Ollama's way to load a model: answered at once
        return Generation(True, (), model=_model(body), stream=_stream(body))
    try:
        messages = _messages(body.get("messages"))
        check_results(messages)
    except ToolError as e:
        raise bad(str(e), e.param) from None
    tools = read_tools({"tools": body.get("tools")})
    settings = _settings(body, served)
    if tools is not None and any(name in settings for name in CONSTRAINT_OPTIONS):
        raise bad("tools and format both constrain the reply: one at a time", "format")
    return Generation(True, (messages,), model=_model(body), stream=_stream(body), settings=settings, tools=tools,
                      logprobs=_logprobs(body), thinking=_thinking(body.get("think"), served))


def parse_generate(body: dict[str, Any], *, served: Served) -> Generation:
    """A prompt through the chat template (``system`` before it), as it is (``raw``), or as the
    prefix of a fill-in-the-middle before ``suffix``. No prompt: the model is loaded, nothing more."""
    _known(body, GENERATE_FIELDS)
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise bad("prompt must be a string", "prompt")
    if not prompt and not body.get("suffix"):
        return Generation(False, (), model=_model(body), stream=_stream(body))
    for name, what in (("images", "this model reads no images"),
                       ("context", "a previous reply's context is not kept here: send the conversation to /api/chat"),
                       ("template", "this server renders the model's own chat template")):
        if body.get(name):
            raise bad(f"{name}: {what}", name)
    suffix, system, raw = body.get("suffix"), body.get("system"), _flag(body, "raw")
    if suffix is not None and not isinstance(suffix, str):
        raise bad("suffix must be a string", "suffix")
    if system is not None and not isinstance(system, str):
        raise bad("system must be a string", "system")
    common = {"model": _model(body), "stream": _stream(body), "settings": _settings(body, served),
              "logprobs": _logprobs(body)}
    if suffix:
        return Generation(False, (Infill(prompt, suffix),), **common)
    if raw:
        return Generation(False, (prompt,), **common)
    messages = ((Message("system", system),) if system else ()) + (Message("user", prompt),)
    return Generation(True, (messages,), **common, thinking=_thinking(body.get("think"), served))


def _known(body: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unknown field: {unknown[0]}", unknown[0])


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    return model


def _flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false, got {value!r:.40}", name)
    return value


def _stream(body: dict[str, Any]) -> bool:
    return _flag(body, "stream", default=True)  # Ollama streams unless told not to


def _logprobs(body: dict[str, Any]) -> int | None:
    """None (no logprobs), or how many alternatives each token's come with (``top_logprobs``, in
    the range Chat Completions takes)."""
    if not _flag(body, "logprobs"):
        return None
    if body.get("top_logprobs") is None:
        return 0
    try:
        return check("top_logprobs", body["top_logprobs"])
    except ControlError as e:
        raise bad(str(e), "top_logprobs") from None


def _settings(body: dict[str, Any], served: Served) -> dict[str, Any]:
    """``options`` and ``format`` as the controls they are, checked."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise bad("options must be an object of option values by name", "options")
    values = {}
    for name, value in options.items():
        if value is None:  # a client's way to leave an option at its default
            continue
        if name in OPTION_SETTINGS:
            values[name] = value
        elif name == "num_ctx":
            _check_context(value, served)
        elif name in OFF_SAMPLERS:
            if value != OFF_SAMPLERS[name] or isinstance(value, bool):
                raise bad(f"{name}: this server has no such sampler; {OFF_SAMPLERS[name]} (off) is the value it takes",
                          name)
        elif name not in RUNNER_OPTIONS:
            raise bad(f"options: unknown option {name!r:.60}", name)
    if _is_int(values.get("num_predict")) and values["num_predict"] in UNLIMITED:
        del values["num_predict"]
    window_off = values.get("repeat_last_n") == 0 and _is_int(values["repeat_last_n"])
    if window_off:  # Ollama's 0 is no window at all: nothing is penalized
        del values["repeat_last_n"]
    elif values.get("repeat_last_n") == WHOLE_CONTEXT and _is_int(values["repeat_last_n"]):
        values["repeat_last_n"] = 0
    settings = read_settings(values, OPTION_SETTINGS.items())
    if window_off:
        settings.update(PENALTIES_OFF)
    settings.update(_format(body.get("format")))
    return settings


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_context(value: Any, served: Served) -> None:
    """``num_ctx`` is taken where every request's context, the server's, holds it."""
    context = _context(served)
    if not _is_int(value) or value < 1:
        raise bad(f"num_ctx must be a positive integer, got {value!r:.40}", "num_ctx")
    if value > context:
        raise bad(f"num_ctx {value} is more than this server's context of {context} tokens "
                  f"(start it with a larger --ctx-size)", "num_ctx")


def _format(value: Any) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if value == "json":
        return format_setting("json_object", None, "format", "format")
    if isinstance(value, dict):
        return format_setting("json_schema", value, "format", "format")
    raise bad(f'format must be "json" or a JSON schema object, got {value!r:.40}', "format")


def _thinking(value: Any, served: Served) -> dict[str, Any]:
    """``think``: true, false, or a level (each one on), as ``reasoning.Thinking`` fields."""
    if value is None:
        return {}
    if not isinstance(value, bool) and value not in THINK_LEVELS:
        raise bad(f"think must be true, false or one of {', '.join(THINK_LEVELS)}, got {value!r:.40}", "think")
    if value is False:
        return {"mode": "off"}
    if served.think is None:
        raise bad(f"{served.model_id!r} does not support thinking", "think")
    return {"mode": "on"}


def _messages(value: Any) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise ToolError("messages must be a non-empty list of messages", "messages")
    out: list[Message] = []
    called: list[CalledTool] = []
    unanswered: list[CalledTool] = []  # the calls of the last assistant message with no result yet
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ToolError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r:.40}", f"{where}.role")
        content = message.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ToolError(f"{where}.content must be a string", f"{where}.content")
        if message.get("images"):
            raise ToolError(f"{where}.images: this model reads no images", f"{where}.images")
        if role == "assistant":
            unanswered = list(_calls(message.get("tool_calls"), where, len(called)))
            called += unanswered
            thinking = message.get("thinking")
            if thinking is not None and not isinstance(thinking, str):
                raise ToolError(f"{where}.thinking must be a string", f"{where}.thinking")
            out.append(Message(role, content, tuple(unanswered), reasoning=thinking or None))
        elif role == "tool":
            call = _answered(message, unanswered, where)
            unanswered.remove(call)
            out.append(Message(role, content, tool_call_id=call.id))
        else:
            out.append(Message(role, content))
    return tuple(out)


def _calls(value: Any, where: str, before: int) -> tuple[CalledTool, ...]:
    """An assistant message's ``tool_calls``: ``{"function": {"name", "arguments": {...}}}``, with
    an ``id`` where the client kept one, else one of its place among the conversation's calls
    (``before`` came earlier): the same history renders the same prompt, whose pages the cache
    finds again, and nine letters and digits are an id every template takes (Mistral's demands it)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ToolError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments", {}), (dict, str)):
            raise ToolError(f'{at} must be {{"function": {{"name": ..., "arguments": {{...}}}}}}', at)
        given = call.get("id")
        calls.append(called_tool(given if isinstance(given, str) and given else f"call{before + j:05d}",
                                 function["name"], function.get("arguments", {}), f"{at}.function.arguments"))
    return tuple(calls)


def _answered(message: dict[str, Any], unanswered: list[CalledTool], where: str) -> CalledTool:
    """The call a tool message answers: the one its ``tool_call_id`` or ``tool_name`` names, or
    the earliest still unanswered."""
    call_id, name = message.get("tool_call_id"), message.get("tool_name")
    for call in unanswered:
        if (call_id is None or call.id == call_id) and (name is None or call.name == name):
            return call
    named = f" for {name!r:.60}" if name is not None else ""
    raise ToolError(f"{where} is a tool result{named}, and no call of the assistant message before it is left "
                    f"unanswered", where)


# -- what is sent back -----------------------------------------------------------------------------


def created_at() -> str:
    """Now, as Ollama writes it: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Durations:
    """A reply's counts and times as Ollama reports them, in nanoseconds."""

    total: int
    prompt_eval_count: int
    prompt_eval: int  # to the first token: the prompt's forward (and any wait for a batch slot)
    eval_count: int
    eval: int  # from the first token to the last

    def as_dict(self) -> dict[str, int]:
        return {"total_duration": self.total, "load_duration": 0,  # the model was loaded at the start
                "prompt_eval_count": self.prompt_eval_count, "prompt_eval_duration": self.prompt_eval,
                "eval_count": self.eval_count, "eval_duration": self.eval}


class OllamaResponse(GenerationResponse):
    """The one job of /api/chat (``api`` "chat": a ``message``) or /api/generate (a ``response``)
    sent back as Ollama's objects: one per piece and a last one with ``done``, or that one whole.
    A reply read for tool calls sends its calls whole, in the piece before the last. A request with
    no prompt has no job: its one object says the model is loaded (``done_reason`` load)."""

    def __init__(self, generation: Generation, reply, choices: list[Choice], prompt_lens: list[int],
                 token_bytes: Callable[[int], bytes], tool_format: ToolFormat = FORMATS["generic"], *,
                 started_ns: int, api: str) -> None:
        super().__init__(generation, reply, choices, prompt_lens, token_bytes, tool_format)
        self.started_ns = started_ns
        self.api = api
        if self.logprobs is not None:  # Ollama's entries are a chat's, {token, logprob ...}, on both routes
            self.logprobs = [LogprobsWriter(True, token_bytes) for _ in choices]

    def _read(self, text: str, final: bool = False) -> str:
        """The content of a piece of the reply (calls are taken by the reader, sent at the end)."""
        reader = None if self.readers is None else self.readers[0]
        if reader is None:
            return text
        deltas: list[Delta] = reader.feed(text) + (reader.finish() if final else [])
        return "".join(d.content for d in deltas)

    def _piece(self, text: str, thinking: str = "", calls: Sequence[ToolCall] = (), logprobs: list | None = None
               ) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.reply.model, "created_at": created_at()}
        if self.api == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [{"id": c.id, "function": {"index": i, "name": c.name,
                                                                   "arguments": tool_input(c.arguments)}}
                                         for i, c in enumerate(calls)]
            out["message"] = message
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        if logprobs:
            out["logprobs"] = logprobs
        out["done"] = False
        return out

    def _last(self, piece: dict[str, Any], state: GenerationState) -> dict[str, Any]:
        completion = self.choices[0].completion()
        timings = completion.timings
        first_ns = round((timings.ttft_s or 0.0) * 1e9)
        decoding = completion.completion_tokens - 1
        eval_ns = round(decoding / timings.decode_tok_s * 1e9) if timings.decode_tok_s else 0
        durations = Durations(time.perf_counter_ns() - self.started_ns, self.prompt_lens[0], first_ns,
                              completion.completion_tokens, eval_ns)
        return {**piece, "done": True, "done_reason": finish_reason(state), **durations.as_dict()}

    def _logprobs(self, choice: Choice) -> list | None:
        rendered = self._logprobs_of(choice)
        return None if rendered is None else rendered["content"]

    async def _loaded(self, send: Send, headers: list) -> None:
        """The answer to a request with nothing to generate: the model is loaded (and stays so)."""
        self._finished = True
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": _line({**self._piece(""), "done": True,
                                                                  "done_reason": "load"})})

    async def _whole(self, send: Send) -> None:
        if not self.choices:
            return await self._loaded(send, JSON_HEADERS)
        choice = self.choices[0]
        async for _ in choice.parts():
            pass
        completion = choice.completion()
        if completion.finish_reason is GenerationState.ERROR:
            status, body = 500, {"error": "generation failed; see the server's log"}
        else:
            text = self._read(completion.text, final=True)
            calls = () if self.readers is None else self.readers[0].tool_calls()
            status = 200
            body = self._last(self._piece(text, completion.reasoning, calls, self._logprobs(choice)),
                              completion.finish_reason)
        await self._send_whole(send, status, body)

    async def _stream(self, send: Send) -> None:
        if not self.choices:
            return await self._loaded(send, NDJSON_HEADERS)
        await send({"type": "http.response.start", "status": 200, "headers": NDJSON_HEADERS})
        choice, sent = self.choices[0], 0
        async for text, thought in choice.parts():
            sent += len(text)
            content = self._read(text)
            if content or thought:
                await self._send(send, _line(self._piece(content, thought, logprobs=self._logprobs(choice))))
        completion = choice.completion()
        if completion.finish_reason is GenerationState.ERROR:
            await self._send(send, _line({"error": "generation failed; see the server's log"}))
        else:
            # A cancel keeps the whole characters that were still held back.
            content = self._read(completion.text[sent:], final=True)
            calls = () if self.readers is None else self.readers[0].tool_calls()
            if content or calls:
                await self._send(send, _line(self._piece(content, calls=calls, logprobs=self._logprobs(choice))))
            # The logprobs of tokens that wrote nothing since (a call's closing, held text) go last.
            last = self._piece("", logprobs=self._logprobs(choice))
            await self._send(send, _line(self._last(last, completion.finish_reason)))
        self._finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _line(obj: dict[str, Any]) -> bytes:
    return dumps(obj) + b"\n"


# -- the model's routes ----------------------------------------------------------------------------


def _named(served: Served, name: Any) -> None:
    """A model asked about by name: one the server has (Ollama's ``:latest`` tag or not), else 404."""
    if not isinstance(name, str):
        raise bad("model must be the name of a model", "model")
    if name not in served.names and name.removesuffix(":latest") not in served.names:
        raise ApiError(404, f"model {name!r:.200} not found; this server has {served.model_id!r}")


def _context(served: Served) -> int:
    return served.serving.scheduler.max_seq_len if served.serving is not None else served.embedder.max_tokens


def _size(served: Served) -> int:
    return served.loaded.weights().nbytes


def _modified(path: Path) -> tuple[str, int]:
    """When the model's files last changed, as Ollama writes it, and in nanoseconds."""
    mtime_ns = path.stat().st_mtime_ns if path.exists() else 0
    when = datetime.fromtimestamp(mtime_ns / 1e9, timezone.utc).isoformat().replace("+00:00", "Z")
    return when, mtime_ns


def _details(served: Served) -> dict[str, Any]:
    # model/formats imports torch: not at start, where the server's own threads are not yet
    # blocking signals (the model's loading imports it, in its thread).
    from llama_chat.model.formats.common import parameter_count

    loaded = served.loaded
    count = parameter_count(loaded.args)
    size = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"
    level = loaded.file_type or str(loaded.dtype).removeprefix("torch.").upper().replace("FLOAT", "F")
    return {"parent_model": "", "format": loaded.layout, "family": loaded.args.family,
            "families": [loaded.args.family], "parameter_size": size, "quantization_level": level}


def _running(served: Served) -> dict[str, Any]:
    return {**_listed(served), "size_vram": _size(served) if served.loaded.device.type != "cpu" else 0,
            "context_length": _context(served)}


def _digest(path: Path, mtime_ns: int) -> str:
    # No registry names this model: its digest stands for the file it was loaded from, as it is.
    return hashlib.sha256(f"{path.resolve()}:{mtime_ns}".encode()).hexdigest()


def _listed(served: Served) -> dict[str, Any]:
    when, mtime_ns = _modified(served.loaded.path)
    return {"name": served.model_id, "model": served.model_id, "modified_at": when, "size": _size(served),
            "digest": _digest(served.loaded.path, mtime_ns), "details": _details(served)}


def _listed_unloaded(entry: ModelEntry) -> dict[str, Any]:
    """One of several models, not loaded now: what its files say (its details once it is loaded)."""
    path = entry.path
    when, mtime_ns = _modified(path)
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()] if path.exists() else []
    return {"name": entry.name, "model": entry.name, "modified_at": when, "size": sum(f.stat().st_size for f in files),
            "digest": _digest(path, mtime_ns), "details": {}}


def _capabilities(served: Served) -> list[str]:
    loaded = served.loaded
    if loaded.kind != "chat":
        return ["embedding"]
    out = ["completion"]
    if loaded.chat_format is not None:
        out.append("tools")  # every template can offer them (the generic format describes them)
    try:
        find_fim_tokens(loaded.tokenizer)
        out.append("insert")
    except NoFimTokens:
        pass
    if served.think is not None:
        out.append("thinking")
    return out


def _shown(served: Served) -> dict[str, Any]:
    from llama_chat.model.formats.common import parameter_count  # as in _details

    loaded, args = served.loaded, served.loaded.args
    arch = args.family
    info = {"general.architecture": arch, "general.parameter_count": parameter_count(args),
            f"{arch}.context_length": _context(served), f"{arch}.embedding_length": args.dim,
            f"{arch}.block_count": args.n_layers, f"{arch}.feed_forward_length": args.hidden_dim,
            f"{arch}.attention.head_count": args.n_heads,
            f"{arch}.attention.head_count_kv": args.n_kv_heads or args.n_heads,
            f"{arch}.rope.freq_base": args.rope_theta, "tokenizer.vocab_size": args.vocab_size}
    template = getattr(loaded.chat_format, "template", None) or getattr(loaded.chat_format, "name", "")
    return {"modelfile": f"FROM {loaded.path}\n", "parameters": "", "template": template,
            "details": _details(served), "model_info": info, "capabilities": _capabilities(served),
            "modified_at": _modified(loaded.path)[0]}


__all__ = ["OLLAMA_VERSION", "OllamaResponse", "error_body", "ollama_routes", "parse_chat", "parse_generate"]

"""OpenAI's HTTP API as ``llama-chat serve`` speaks it: request bodies checked into a ``Generation``,
and the objects sent back (completions, stream chunks, usage, errors).

A request's settings take the command line's names and are checked by the one checker a
``--batch`` line uses (``batch_input``, over ``ml/controls.py``), so the server refuses the values
the command line refuses, with the same reason. OpenAI's own fields map onto them
(``max_completion_tokens`` and ``max_tokens`` are ``max_tokens``); the other controls of the
command line (``top_k``, ``min_p``, ``repetition_penalty`` ...) are taken as extra fields under
their command-line names. Nothing here knows the model or HTTP: ``serve_app.py`` does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring  # json.dumps of one str with ensure_ascii=False
from typing import Any

from llama_chat.cmd.batch_input import SAMPLING_KEYS, SETTING_KEYS, setting
from llama_chat.cmd.options import CONSTRAINT_OPTIONS
from llama_chat.inference.tool_calls import (ToolCall, ToolChoice, ToolError, ToolRequest, check_results, check_tools,
                                             make_tool)
from llama_chat.inference.fim import Infill
from llama_chat.inference.tool_formats import called_tool
from llama_chat.inference.tool_stream import Delta
from llama_chat.inference.types import Completion, GenerationState, TokenLogprobs
from llama_chat.ml.controls import (REASONING_EFFORTS, REASONING_FORMATS, ControlError, SamplingParams, check)
from llama_chat.model.chat_format import Message


# OpenAI's error types by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               414: "invalid_request_error", 429: "rate_limit_error", 431: "invalid_request_error",
               500: "server_error", 502: "server_error", 503: "server_error", 507: "server_error"}

# Our finish reasons in OpenAI's words, and only its words: a job cut off by the server's shutdown
# was cut short, as one that ran out of tokens is; one that failed is answered with an error.
FINISH_REASONS = {
    GenerationState.EOS: "stop",
    GenerationState.STOP_STRING: "stop",
    GenerationState.STOP_GRAMMAR: "stop",
    GenerationState.MAX_TOKENS: "length",
    GenerationState.CONTEXT_FULL: "length",
    GenerationState.MAX_TIME: "length",
    GenerationState.CANCELLED: "length",
    GenerationState.ERROR: "stop",
}
# The states in which a reply that made calls ended because it was done with them.
CALLS_DONE = (GenerationState.EOS, GenerationState.STOP_STRING, GenerationState.STOP_GRAMMAR)

# Fields whose OpenAI name is the option's own name; the body's max_tokens is also the option's.
OPENAI_SETTINGS = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias")
# The command line's other controls, taken as extra fields under their own names.
EXTRA_SETTINGS = tuple(name for name in SETTING_KEYS if name not in (*OPENAI_SETTINGS, "max_tokens"))
# OpenAI fields that change nothing here (they are about billing, storage, or other services).
IGNORED = ("user", "metadata", "store", "service_tier", "modalities",
           "prediction", "audio", "web_search_options", "verbosity", "prompt_cache_key", "safety_identifier",
           "function_call")
# Speculative decoding for one request, under the options table's rules (``controls.SERVER_RULES``,
# ``RULES``), and the ``Request`` field each sets: prompt lookup, the server's draft model, and the
# most tokens drafted in one step. The reply is the same whatever they say; only its speed differs.
SPECULATION_FIELDS = {"lookup": "lookup", "draft": "draft_model", "draft_max": "draft_max"}
COMMON = ("model", "max_tokens", "n", "stream", "stream_options", "logprobs", *OPENAI_SETTINGS, *EXTRA_SETTINGS,
          *SPECULATION_FIELDS, *IGNORED)
# A thinking model's controls (inference/reasoning.py): OpenAI's reasoning_effort ("none" is off),
# the template's own variables (enable_thinking), and llama-server's reasoning_format and budget.
THINKING_FIELDS = ("reasoning_effort", "chat_template_kwargs", "reasoning_format", "reasoning_budget")
CHAT_FIELDS = frozenset((*COMMON, "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                         "functions", "tool_choice", "parallel_tool_calls", *THINKING_FIELDS))
COMPLETION_FIELDS = frozenset((*COMMON, "prompt", "echo", "best_of", "suffix"))
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class ApiError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# A dialog, a text, token ids, or a fill-in-the-middle's texts (a completion's ``suffix``, /infill).
Prompt = tuple[Message, ...] | str | tuple[int, ...] | Infill


@dataclass(frozen=True)
class Generation:
    """What one request asks for. ``prompts``: one dialog (chat), or one or more texts or lists
    of token ids (completions); each gets ``n`` choices. ``settings``: options by their
    command-line names, checked."""

    chat: bool
    prompts: tuple[Prompt, ...]
    model: str | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    settings: dict[str, Any] = field(default_factory=dict)
    logprobs: int | None = None  # None: none asked; else how many alternatives per token
    tools: ToolRequest | None = None  # a chat's tools, where it offers some
    speculation: dict[str, Any] = field(default_factory=dict)  # ``Request`` fields (``SPECULATION_FIELDS``)
    # A thinking model's settings this request chose (``reasoning.Thinking`` fields: mode, budget,
    # split), over the server's; and more variables for the chat template.
    thinking: dict[str, Any] = field(default_factory=dict)
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_field(self) -> str:
        return "messages" if self.chat else "prompt"


# -- request bodies --------------------------------------------------------------------------------


def parse_chat(body: dict[str, Any]) -> Generation:
    _known(body, CHAT_FIELDS)
    logprobs = None
    if _flag(body, "logprobs"):
        logprobs = _ranged(body, "top_logprobs") if _given(body, "top_logprobs") else 0
    elif _given(body, "top_logprobs"):
        raise bad("top_logprobs needs logprobs to be true", "top_logprobs")
    if _given(body, "functions") and body["functions"] != []:
        raise bad("functions are not supported by this server: send tools", "functions")
    try:
        messages = _messages(body.get("messages"))
        tools = _tools(body)
        check_results(messages)
    except ToolError as e:
        raise bad(str(e), e.param) from None
    limit = "max_completion_tokens" if _given(body, "max_completion_tokens") else "max_tokens"
    common = _common(body, limit)
    form = _response_format(body)
    constraints = [name for name in CONSTRAINT_OPTIONS if name in common["settings"]]
    if form:
        if constraints:
            raise bad(f"response_format and {', '.join(CONSTRAINT_OPTIONS)} constrain the reply: one at a time",
                      "response_format")
        common["settings"].update(form)
    if tools is not None and tools.active and (form or constraints):
        raise bad("tools and response_format (or a grammar) both constrain the reply: one at a time", "tools")
    kwargs = _template_kwargs(body)
    return Generation(True, (messages,), **common, logprobs=logprobs, tools=tools,
                      thinking=thinking_choices(body, kwargs), template_kwargs=kwargs)


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs``: more variables for the chat template, by name."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(k.isidentifier() for k in value):
        raise bad("chat_template_kwargs must be an object of template variables by name", "chat_template_kwargs")
    return dict(value)


def thinking_choices(body: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The thinking settings a chat request chose: ``reasoning_effort`` (none: off), the template's
    ``enable_thinking``, ``reasoning_format`` (none: the thinking stays in the content) and
    ``reasoning_budget``."""
    out: dict[str, Any] = {}
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                      "reasoning_effort")
        out["mode"] = "off" if effort == "none" else "on"
    enable = kwargs.get("enable_thinking")
    if enable is not None:
        if not isinstance(enable, bool):
            raise bad(f"chat_template_kwargs.enable_thinking must be true or false, got {enable!r}",
                      "chat_template_kwargs")
        out["mode"] = "on" if enable else "off"
    form = body.get("reasoning_format")
    if form is not None:
        if form not in REASONING_FORMATS:
            raise bad(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got {form!r}",
                      "reasoning_format")
        out["split"] = form != "none"
    if _given(body, "reasoning_budget"):
        try:
            out["budget"] = check("reasoning_budget", body["reasoning_budget"])
        except ControlError as e:
            raise bad(str(e), "reasoning_budget") from None
    return out


def _tools(body: dict[str, Any]) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked (``ToolError``)."""
    value = body.get("tools")
    if value is not None and not isinstance(value, list):
        raise ToolError("tools must be a list of tools", "tools")
    tools = []
    for i, item in enumerate(value or ()):
        where = f"tools[{i}]"
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(function, dict):
            raise ToolError(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}', where)
        tools.append(make_tool(function.get("name"), function.get("description"), function.get("parameters"),
                               f"{where}.function", function))
    choice = _tool_choice(body.get("tool_choice"), bool(tools))
    parallel = _flag(body, "parallel_tool_calls") if _given(body, "parallel_tool_calls") else True
    check_tools(tools, choice)
    return ToolRequest(tuple(tools), choice, parallel) if tools else None


def read_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The tools of a body in OpenAI's tool shape (Ollama's is the same), checked: a 400 names the field."""
    try:
        return _tools(body)
    except ToolError as e:
        raise bad(str(e), e.param) from None


def _tool_choice(value: Any, offered: bool) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if offered else "none")
    if isinstance(value, str):
        return ToolChoice(value)
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolError('tool_choice must be auto, none, required or {"type": "function", "function": {"name": ...}}',
                        "tool_choice")
    return ToolChoice("function", function["name"])


def parse_completion(body: dict[str, Any]) -> Generation:
    _known(body, COMPLETION_FIELDS)
    logprobs = _ranged(body, "logprobs") if _given(body, "logprobs") else None
    if body.get("echo"):
        raise bad("echo is not supported by this server", "echo")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise bad("suffix must be a string", "suffix")
    common = _common(body, "max_tokens")
    best_of = _ranged(body, "best_of") if body.get("best_of") is not None else None
    if best_of is not None and best_of != common["n"]:
        raise bad("best_of is not supported by this server (leave it out, or give n's value)", "best_of")
    prompts = _prompts(body.get("prompt"))
    # A suffix makes each prompt the prefix of a fill-in-the-middle; an empty one leaves a plain
    # completion, as llama-server and Ollama take it.
    if suffix:
        if not all(isinstance(p, str) for p in prompts):
            raise bad("suffix needs the prompt as text, not token ids", "suffix")
        prompts = tuple(Infill(p, suffix) for p in prompts)
    return Generation(False, prompts, **common, logprobs=logprobs)


def _given(body: dict[str, Any], name: str) -> bool:
    """Present and not null: OpenAI's clients send null for a field left at its default."""
    return body.get(name) is not None


def _known(body: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unrecognized request argument: {unknown[0]}", unknown[0])


def _common(body: dict[str, Any], limit_field: str) -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    n = _ranged(body, "n") if _given(body, "n") else 1
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    fields = [(limit_field, "max_tokens"), *((name, name) for name in (*OPENAI_SETTINGS, *EXTRA_SETTINGS))]
    return {"model": model, "n": n, "stream": stream, "include_usage": include_usage,
            "settings": read_settings(body, fields), "speculation": _speculation(body)}


def _speculation(body: dict[str, Any]) -> dict[str, Any]:
    """The request's speculative decoding fields, checked, as ``Request`` fields."""
    out: dict[str, Any] = {}
    for name, attribute in SPECULATION_FIELDS.items():
        if _given(body, name):
            value = _ranged(body, name)
            out[attribute] = value == "on" if isinstance(value, str) else value
    return out


def read_settings(body: dict[str, Any], fields) -> dict[str, Any]:
    """The generation settings of ``body``: each ``(field, setting)`` of ``fields`` given, checked
    by the setting's rule and named by the field in an error; then all of them together, as the
    job will use them (one may constrain another). Both APIs' bodies are read here."""
    settings = {}
    for source, name in fields:
        if not _given(body, source):
            continue
        try:
            settings[name] = setting(name, body[source])
        except ControlError as e:
            raise bad(f"{source} {e.reason}", source) from None
        except (ValueError, TypeError) as e:
            raise bad(str(e).replace(f"'{name}'", source), source) from None
    try:
        SamplingParams(**{k: v for k, v in settings.items() if k in SAMPLING_KEYS})
    except ControlError as e:
        raise bad(str(e), e.name) from None
    return settings


def _ranged(body: dict[str, Any], name: str) -> int:
    """``body[name]`` checked by its rule in the options table (``controls.SERVER_RULES``)."""
    try:
        return check(name, body[name])
    except ControlError as e:
        raise bad(str(e), name) from None


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false, got {value!r}", name)
    return value


def _messages(value: Any) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list of messages", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"{where} must be an object with a role and a content", where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", f"{where}.role")
        content = _content(message.get("content"), role, f"{where}.content")
        calls = _message_calls(message.get("tool_calls"), where) if role == "assistant" else ()
        call_id = message.get("tool_call_id") if role == "tool" else None
        if role == "tool" and (not isinstance(call_id, str) or not call_id):
            raise bad(f"{where}.tool_call_id must name the call this result answers", f"{where}.tool_call_id")
        out.append(Message(CHAT_ROLES[role], content, calls, call_id, _reasoning(message, role, where)))
    return tuple(out)


def _reasoning(message: dict[str, Any], role: str, where: str) -> str | None:
    """An assistant message's thinking, sent back as ``reasoning_content`` or ``reasoning``."""
    if role != "assistant":
        return None
    for name in ("reasoning_content", "reasoning"):
        value = message.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise bad(f"{where}.{name} must be a string", f"{where}.{name}")
            return value
    return None


def _message_calls(value: Any, where: str) -> tuple:
    """An assistant message's ``tool_calls``, with their arguments parsed for the template."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(call.get("id"), str) or not call["id"]:
            raise bad(f'{at} must be {{"id": ..., "type": "function", "function": {{"name": ..., "arguments": ...}}}}',
                      at)
        calls.append(called_tool(call["id"], function["name"], function.get("arguments", "{}"),
                                 f"{at}.function.arguments"))
    return tuple(calls)


def _content(value: Any, role: str, where: str) -> str:
    """A message's text: a string, or a list of text parts (other parts are not supported)."""
    if value is None and role == "assistant":
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}: only text parts are supported, got {kind!r}", where)
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"{where} must be a string or a list of text parts", where)


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """A completion's prompt: a string, a list of strings, a list of token ids, or a list of those."""
    def ids(items: list) -> tuple[int, ...]:
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
            raise bad("prompt: token ids must be integers >= 0", "prompt")
        return tuple(items)

    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return tuple(value)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in value):
            return (ids(value),)
        if all(isinstance(p, list) and p for p in value):
            return tuple(ids(p) for p in value)
    raise bad("prompt must be a string, a list of strings, or token ids", "prompt")


def _response_format(body: dict[str, Any]) -> dict[str, str]:
    """OpenAI's ``response_format`` as the option it stands for: ``format`` json, or ``json_schema``."""
    value = body.get("response_format")
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, dict) else None
    spec = value.get("json_schema") if isinstance(value, dict) else None
    return format_setting(kind, spec.get("schema") if isinstance(spec, dict) else None, "response_format",
                          "response_format.json_schema.schema")


def format_setting(kind: Any, schema: Any, field: str, schema_field: str) -> dict[str, str]:
    """A reply's format (``text``, ``json_object``, ``json_schema`` with its ``schema``) as the
    option it stands for: none, ``format`` json, or ``json_schema``; ``field`` names it in errors
    (Chat Completions' ``response_format``, Responses' ``text.format``)."""
    if kind == "text":
        return {}
    if kind == "json_object":
        name, text = "format", "json"
    elif kind == "json_schema":
        if not isinstance(schema, dict):
            raise bad(f"{schema_field} must be a JSON schema object", field)
        name, text = "json_schema", json.dumps(schema)
    else:
        raise bad(f"{field}.type must be text, json_object or json_schema", field)
    try:
        return {name: setting(name, text)}
    except (ControlError, ValueError) as e:
        raise bad(f"{field}: {getattr(e, 'reason', e)}", field) from None


# -- what is sent back -----------------------------------------------------------------------------


def finish_reason(state: GenerationState, called: bool = False) -> str:
    """OpenAI's finish reason; ``called``: the reply made tool calls."""
    if called and state in CALLS_DONE:
        return "tool_calls"
    return FINISH_REASONS.get(state, "stop")


# The fields a chat message's thinking is sent in: llama-server's, DeepSeek's and LM Studio's name,
# and vLLM's, Ollama's and OpenRouter's. Clients read one or the other.
REASONING_FIELDS = ("reasoning_content", "reasoning")


@dataclass(frozen=True)
class ChatMessage:
    """A chat choice's reply read for tool calls: its content (None when it is only calls), and a
    thinking model's thinking."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str = ""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            out.update(dict.fromkeys(REASONING_FIELDS, self.reasoning))
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in self.tool_calls]
        return out


def tool_call_deltas(deltas: Sequence[Delta]) -> list[dict[str, Any]]:
    """A stream's ``delta.tool_calls`` for the call pieces of ``deltas``: a call's id, type and
    name once, at its start, then its arguments in pieces (those of one call run together)."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if d.index is None:
            continue
        if d.id is not None:
            out.append({"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
        elif out and out[-1]["index"] == d.index:
            out[-1]["function"]["arguments"] += d.arguments
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out


def usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


class LogprobsWriter:
    """One choice's token logprobs (``JobStream.logprobs`` entries) in OpenAI's shape: a chat's
    ``{"content": [{token, logprob, bytes, top_logprobs}]}``, a completion's ``{tokens,
    token_logprobs, top_logprobs, text_offset}``. A token's text is its bytes decoded, an
    incomplete UTF-8 character replaced; a completion's offsets run on across a stream's chunks."""

    def __init__(self, chat: bool, token_bytes: Callable[[int], bytes]) -> None:
        self.chat = chat
        self.token_bytes = token_bytes
        self.offset = 0  # where the next token's text starts, in the choice's text

    def render(self, entries: Sequence[tuple[int, TokenLogprobs]]) -> dict[str, Any]:
        if self.chat:
            return {"content": [{**self._token(token, lp.logprob),
                                 "top_logprobs": [self._token(t, v) for t, v in lp.top]} for token, lp in entries]}
        tokens = [self._text(token) for token, _ in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for _, lp in entries],
                "top_logprobs": [{self._text(t): v for t, v in lp.top} for _, lp in entries],
                "text_offset": offsets}

    def _text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        data = self.token_bytes(token)
        return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}


@dataclass(frozen=True)
class Reply:
    """The objects of one response: a whole completion, or the chunks of a stream."""

    chat: bool
    id: str
    model: str
    created: int

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, completions: list[Completion], usage_object: dict[str, Any],
              logprobs: Sequence[dict[str, Any] | None] | None = None,
              messages: Sequence[ChatMessage] | None = None) -> dict[str, Any]:
        """``logprobs``: each choice's (``LogprobsWriter``), when they were asked for;
        ``messages``: each chat choice's reply read for tool calls, where tools were offered."""
        logprobs = logprobs or [None] * len(completions)
        if self.chat:
            messages = messages or [ChatMessage(c.text, reasoning=c.reasoning) for c in completions]
            choices = [{"index": i, "message": m.as_dict(), "logprobs": lp,
                        "finish_reason": finish_reason(c.finish_reason, bool(m.tool_calls))}
                       for i, (c, lp, m) in enumerate(zip(completions, logprobs, messages))]
            return {**self._head("chat.completion"), "choices": choices, "usage": usage_object}
        choices = [{"index": i, "text": c.text, "logprobs": lp, "finish_reason": finish_reason(c.finish_reason)}
                   for i, (c, lp) in enumerate(zip(completions, logprobs))]
        return {**self._head("text_completion"), "choices": choices, "usage": usage_object}

    def chunk(self, index: int, text: str, *, state: GenerationState | None = None,
              first: bool = False, logprobs: dict[str, Any] | None = None,
              tool_calls: list[dict[str, Any]] | None = None, called: bool = False, reasoning: str = "") -> dict[str, Any]:
        """A stream's piece of choice ``index``: ``text``, and its finish reason on its last chunk.
        A chat's first chunk names the role. ``logprobs``: those of the tokens the piece took.
        ``tool_calls``: the piece's ``delta.tool_calls``; ``called``: the choice made calls.
        ``reasoning``: a piece of a thinking model's thinking, in both fields' names."""
        reason = None if state is None else finish_reason(state, called)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if reasoning:
                delta.update(dict.fromkeys(REASONING_FIELDS, reasoning))
            if text and not first:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage_object: dict[str, Any]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": usage_object}


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def event(obj: Any) -> bytes:
    """One server-sent event carrying ``obj``."""
    return b"data: " + dumps(obj) + b"\n\n"


class StreamEvents:
    """A stream's chunks as server-sent events. Almost every chunk is a piece of text alone (no
    logprobs, no finish reason): its event is its choice's chunk encoded once with a marker where
    the text goes, so only the text is JSON-encoded each time; the bytes are those of ``event``.
    Any other chunk is encoded whole."""

    # JSON keeps it as it is (nothing to escape). A reply whose id or model name holds it has no
    # template: its chunks are encoded whole.
    MARKER = "\ue000llama-chat-text\ue000"

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self._around: dict[int, tuple[bytes, bytes] | None] = {}

    def text(self, index: int, text: str) -> bytes:
        """The event of a piece of choice ``index``'s text (not a chat's first chunk)."""
        if index not in self._around:
            self._around[index] = self._template(index)
        around = self._around[index]
        if around is None:
            return event(self.reply.chunk(index, text))
        return around[0] + encode_basestring(text).encode("utf-8") + around[1]

    def _template(self, index: int) -> tuple[bytes, bytes] | None:
        whole = event(self.reply.chunk(index, self.MARKER))
        parts = whole.split(encode_basestring(self.MARKER).encode("utf-8"))
        return (parts[0], parts[1]) if len(parts) == 2 else None


__all__ = ["ApiError", "ChatMessage", "Generation", "LogprobsWriter", "Reply",
           "StreamEvents", "bad", "dumps", "event", "finish_reason", "parse_chat", "parse_completion", "tool_call_deltas",
           "usage"]

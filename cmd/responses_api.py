"""OpenAI's Responses API as ``llama-chat serve`` speaks it (``POST /v1/responses``): request bodies
read into the same ``Generation`` the chat route makes, the response object and its typed stream
events, and the responses kept for ``previous_response_id``.

A body's ``input`` (a string, or items: messages with text parts, ``function_call``,
``function_call_output`` and ``reasoning``), ``instructions`` (the system message), ``tools``
(function tools, flat: ``{"type": "function", "name", "parameters"}``), ``tool_choice``,
``text.format`` (``json_schema``, ``json_object``), ``max_output_tokens``, ``temperature``,
``top_p`` and ``reasoning.effort`` become the chat's messages, tools, constraint and controls,
checked by the same rules as Chat Completions (``openai_api``). The reply is one ``response``
whose ``output`` holds a ``reasoning`` item (a thinking model's), a ``message`` with one
``output_text`` part, and a ``function_call`` item per call; streamed, its events in OpenAI's
order, each with a ``sequence_number``, and no ``[DONE]``. Nothing here knows the model or HTTP:
``serve_app.py`` does.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from llama_chat.cmd.openai_api import (EXTRA_SETTINGS, OPENAI_SETTINGS, ApiError, Generation, bad, dumps,
                                       format_setting, read_settings, thinking_choices, usage)
from llama_chat.inference.tool_calls import (ToolCall, ToolChoice, ToolError, ToolRequest, check_results, check_tools,
                                             make_tool)
from llama_chat.inference.tool_formats import called_tool
from llama_chat.inference.tool_stream import Delta
from llama_chat.inference.types import GenerationState
from llama_chat.model.chat_format import Message

# Fields that change nothing here: billing, tracing, and what other services keep.
IGNORED = ("metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier", "include", "truncation",
           "max_tool_calls", "stream_options", "client_metadata")
FIELDS = frozenset(("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                    "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id",
                    "reasoning", "background", *OPENAI_SETTINGS, *EXTRA_SETTINGS, *IGNORED))
# A reply's settings: Responses' own names, then the command line's other controls under theirs.
SETTINGS = (("max_output_tokens", "max_tokens"),
            *((name, name) for name in (*OPENAI_SETTINGS, *EXTRA_SETTINGS)))
# Tools that OpenAI's own servers run (and tool groups and free-form tools of its clients'): this
# server runs none of them, so they are left out of what the model is offered. Clients send them
# whether or not they are used (Codex CLI always sends web_search), so leaving them out, rather
# than refusing the request, is what lets such a client work at all.
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use", "computer_use_preview",
                "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom",
                "namespace")
INPUT_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
# The states in which a response is cut short (``incomplete``), as OpenAI says it of a token limit.
INCOMPLETE = (GenerationState.MAX_TOKENS, GenerationState.CONTEXT_FULL, GenerationState.MAX_TIME,
              GenerationState.CANCELLED)
DEFAULT_STORED = 1000
DEFAULT_STORED_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ResponsesGeneration(Generation):
    """A Responses request: the ``Generation`` it runs as, and what its response repeats and keeps.
    ``conversation``: its messages without the instructions (a later ``previous_response_id``
    carries these, as OpenAI's does, not the instructions)."""

    conversation: tuple[Message, ...] = ()
    echo: dict[str, Any] = field(default_factory=dict)  # the request's settings, as the response shows them
    store: bool = True
    previous_response_id: str | None = None


# -- what is kept -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET /v1/responses/{id} answers
    conversation: tuple[Message, ...]  # its input and its output, as the next turn's history
    size: int


class ResponseStore:
    """The responses kept for ``previous_response_id`` and GET/DELETE, in memory: at most
    ``max_count`` of them and ``max_bytes`` of their text, the least recently used out first.
    Safe from the event loop and the worker threads that parse requests."""

    def __init__(self, max_count: int = DEFAULT_STORED, max_bytes: int = DEFAULT_STORED_BYTES) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, body: dict[str, Any], conversation: tuple[Message, ...]) -> None:
        size = len(dumps(body)) + sum(len(m.content) + len(m.reasoning or "") for m in conversation)
        if self.max_count <= 0 or size > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(body["id"], None)
            self._bytes -= old.size if old else 0
            self._items[body["id"]] = StoredResponse(body, conversation, size)
            self._bytes += size
            while len(self._items) > self.max_count or self._bytes > self.max_bytes:
                _, gone = self._items.popitem(last=False)
                self._bytes -= gone.size

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            found = self._items.get(response_id)
            if found is not None:
                self._items.move_to_end(response_id)
            return found

    def delete(self, response_id: str) -> bool:
        with self._lock:
            gone = self._items.pop(response_id, None)
            self._bytes -= gone.size if gone else 0
            return gone is not None


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"no response with id {response_id!r}: it was not stored, or was deleted or evicted",
                    param=param, code="response_not_found")


# -- request bodies --------------------------------------------------------------------------------


def parse_responses(body: dict[str, Any], store: ResponseStore) -> ResponsesGeneration:
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise bad(f"unrecognized request argument: {unknown[0]}", unknown[0])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    if body.get("background"):
        raise bad("background responses are not supported by this server", "background")
    stream, keep = _flag(body, "stream", False), _flag(body, "store", True)
    history: tuple[Message, ...] = ()
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise bad("previous_response_id must be a string", "previous_response_id")
        found = store.get(previous)
        if found is None:
            raise not_found(previous, "previous_response_id")
        history = found.conversation
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions must be a string", "instructions")
    try:
        conversation = (*history, *input_messages(body.get("input")))
        check_results(conversation, "input")
        tools = _tools(body)
    except ToolError as e:
        raise bad(str(e), e.param) from None
    settings = read_settings(body, SETTINGS)
    form = _text_format(body.get("text"))
    if form and tools is not None and tools.active:
        raise bad("tools and text.format both constrain the reply: one at a time", "tools")
    settings.update(form)
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise bad("reasoning must be an object", "reasoning")
    effort = (reasoning or {}).get("effort")
    thinking = thinking_choices({"reasoning_effort": effort} if effort is not None else {}, {})
    messages = ((Message("system", instructions),) if instructions else ()) + conversation
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "metadata": body.get("metadata") or {},
            "text": body.get("text") or {"format": {"type": "text"}},
            "reasoning": {"effort": effort, "summary": None}, "truncation": body.get("truncation", "disabled"),
            "user": body.get("user")}
    return ResponsesGeneration(True, (messages,), model=model, stream=stream, include_usage=True, settings=settings,
                               tools=tools, thinking=thinking, conversation=conversation, echo=echo, store=keep,
                               previous_response_id=previous)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false, got {value!r}", name)
    return value


def input_messages(value: Any) -> list[Message]:
    """``input`` as the chat's messages: a string is one user message; items in order, a
    ``function_call`` joining the assistant message before it, a ``reasoning`` item the thinking
    of the assistant message after it (``ToolError`` naming the item)."""
    if isinstance(value, str):
        return [Message("user", value)]
    if not isinstance(value, list) or not value:
        raise ToolError("input must be a string or a non-empty list of items", "input")
    out: list[Message] = []
    thought: str | None = None
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ToolError(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise ToolError(f"{where}.role must be one of {', '.join(INPUT_ROLES)}, got {role!r}", f"{where}.role")
            text = _text(item.get("content"), f"{where}.content")
            out.append(Message(INPUT_ROLES[role], text, reasoning=thought if role == "assistant" else None))
            thought = None if role == "assistant" else thought
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str):
                raise ToolError(f"{where}: a function_call needs a call_id and a name", where)
            call = called_tool(call_id, name, arguments, f"{where}.arguments")
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and thought is None:
                out[-1] = replace(last, tool_calls=(*last.tool_calls, call))
            else:
                out.append(Message("assistant", "", (call,), reasoning=thought))
                thought = None
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ToolError(f"{where}: a function_call_output needs the call_id of its call", where)
            output = item.get("output", "")
            out.append(Message("tool", output if isinstance(output, str) else _text(output, f"{where}.output"),
                               tool_call_id=call_id))
        elif kind == "reasoning":
            thought = _reasoning_text(item, where)
        else:
            raise ToolError(f"{where}.type {kind!r} is not supported (message, function_call, function_call_output, "
                            f"reasoning)", f"{where}.type")
    return out


def _text(value: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise ToolError(f"{where}[{j}]: only text parts are supported, got {kind!r}", f"{where}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise ToolError(f"{where} must be a string or a list of text parts", where)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its ``content`` (the thinking itself) or else its ``summary``."""
    for name, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(name)
        if parts:
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise ToolError(f"{where}.{name} must be a list of {{\"type\": \"{kind}\", \"text\": ...}}",
                                f"{where}.{name}")
            return "".join(p["text"] for p in parts)
    return ""


def _tools(body: dict[str, Any]) -> ToolRequest | None:
    """``tools`` (function tools only), ``tool_choice`` and ``parallel_tool_calls``."""
    value = body.get("tools")
    if value is not None and not isinstance(value, list):
        raise ToolError("tools must be a list of tools", "tools")
    tools = []
    for i, item in enumerate(value or ()):
        where = f"tools[{i}]"
        kind = item.get("type") if isinstance(item, dict) else None
        if kind in HOSTED_TOOLS:
            continue  # not offered: nothing here runs it (a choice that names one is refused)
        if kind != "function":
            raise ToolError(f"{where}.type must be function, got {kind!r}", f"{where}.type")
        function = {k: item[k] for k in ("name", "description", "parameters") if k in item}
        tools.append(make_tool(item.get("name"), item.get("description"), item.get("parameters"), where, function))
    choice = _tool_choice(body.get("tool_choice"), bool(tools))
    parallel = _flag(body, "parallel_tool_calls", True)
    check_tools(tools, choice)
    return ToolRequest(tuple(tools), choice, parallel) if tools else None


def _tool_choice(value: Any, offered: bool) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if offered else "none")
    if isinstance(value, str):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return ToolChoice("function", value["name"])
    if isinstance(value, dict) and value.get("type") in HOSTED_TOOLS:
        raise ToolError(f"tool_choice: the built-in tool {value['type']!r} is not available on this server; only "
                        f"function tools are", "tool_choice")
    raise ToolError('tool_choice must be auto, none, required or {"type": "function", "name": ...}', "tool_choice")


def _text_format(value: Any) -> dict[str, str]:
    """``text.format`` as the option it stands for (a JSON schema, any JSON object, or none)."""
    if value is None:
        return {}
    form = value.get("format") if isinstance(value, dict) else None
    if form is None:
        return {}
    if not isinstance(form, dict):
        raise bad("text.format must be an object", "text.format")
    return format_setting(form.get("type"), form.get("schema"), "text.format", "text.format.schema")


# -- what is sent back -----------------------------------------------------------------------------


def status_of(state: GenerationState) -> str:
    if state is GenerationState.ERROR:
        return "failed"
    return "incomplete" if state in INCOMPLETE else "completed"


@dataclass
class ResponseBuilder:
    """One response's object and, streamed, its events: output items opened as their kind begins
    (reasoning, the message, each call), their pieces, and each closed when the next begins."""

    id: str
    model: str
    generation: ResponsesGeneration
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)
    sequence: int = 0
    _open: dict[str, Any] | None = None  # the item being streamed
    _text: list[str] = field(default_factory=list)  # its text (reasoning, message) or arguments so far

    # -- the object --------------------------------------------------------------------------------

    def body(self, status: str, usage_object: dict[str, Any] | None = None, error: str | None = None
             ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        failure = {"code": "server_error", "message": error} if error else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": failure, "incomplete_details": incomplete, "model": self.model, "output": list(self.output),
                "previous_response_id": self.generation.previous_response_id, "store": self.generation.store,
                **self.generation.echo, "usage": usage_object}

    def whole(self, text: str | None, calls: Sequence[ToolCall], reasoning: str, state: GenerationState,
              usage_object: dict[str, Any]) -> dict[str, Any]:
        """The response of a reply read whole."""
        if reasoning:
            self.output.append(self._reasoning_item(reasoning))
        if text or not calls:
            self.output.append(self._message_item(text or ""))
        self.output += [self._call_item(c.id, c.name, c.arguments) for c in calls]
        return self.body(status_of(state), usage_object)

    def conversation(self) -> tuple[Message, ...]:
        """The request's messages and this response's output: the next turn's history."""
        reply = Message("assistant", "")
        for item in self.output:
            if item["type"] == "reasoning":
                reply = replace(reply, reasoning=item["content"][0]["text"])
            elif item["type"] == "message":
                reply = replace(reply, content=item["content"][0]["text"])
            else:
                call = called_tool(item["call_id"], item["name"], item["arguments"], "output")
                reply = replace(reply, tool_calls=(*reply.tool_calls, call))
        return (*self.generation.conversation, reply)

    # -- the stream --------------------------------------------------------------------------------

    def start(self) -> bytes:
        head = self.body("in_progress")
        return self._event("response.created", response=head) + self._event("response.in_progress", response=head)

    def reasoning(self, text: str) -> bytes:
        if not text:
            return b""
        out = b"" if self._kind() == "reasoning" else self._begin(self._reasoning_item(""))
        self._text.append(text)
        return out + self._event("response.reasoning_text.delta", item_id=self._open["id"],
                                 output_index=len(self.output), content_index=0, delta=text)

    def pieces(self, deltas: Sequence[Delta]) -> bytes:
        """The events of some text and call pieces (``ToolStream``'s, or plain text)."""
        out = []
        for d in deltas:
            if d.content:
                if self._kind() != "message":
                    out.append(self._begin(self._message_item("")))
                self._text.append(d.content)
                out.append(self._event("response.output_text.delta", item_id=self._open["id"],
                                       output_index=len(self.output), content_index=0, delta=d.content, logprobs=[]))
            elif d.id is not None:
                out.append(self._begin(self._call_item(d.id, d.name or "", "")))
            elif d.arguments:
                self._text.append(d.arguments)
                out.append(self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                                       output_index=len(self.output), delta=d.arguments))
        return b"".join(out)

    def end(self, state: GenerationState, usage_object: dict[str, Any]) -> bytes:
        out = self._finish()
        if not self.output:  # nothing at all: one empty message, as a whole response has
            out += self._begin(self._message_item("")) + self._finish()
        status = status_of(state)
        name = {"completed": "response.completed", "incomplete": "response.incomplete"}[status]
        return out + self._event(name, response=self.body(status, usage_object))

    def failed(self, message: str) -> bytes:
        return self._finish() + self._event("response.failed", response=self.body("failed", error=message))

    # -- items ---------------------------------------------------------------------------------------

    def _reasoning_item(self, text: str) -> dict[str, Any]:
        return {"id": f"rs_{self._suffix()}", "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if text else []}

    def _message_item(self, text: str) -> dict[str, Any]:
        return {"id": f"msg_{self._suffix()}", "type": "message", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def _call_item(self, call_id: str, name: str, arguments: str) -> dict[str, Any]:
        return {"id": f"fc_{self._suffix()}", "type": "function_call", "status": "completed", "call_id": call_id,
                "name": name, "arguments": arguments}

    def _suffix(self) -> str:
        return f"{self.id.removeprefix('resp_')}_{len(self.output) + (self._open is not None)}"

    def _kind(self) -> str | None:
        return None if self._open is None else self._open["type"]

    def _begin(self, item: dict[str, Any]) -> bytes:
        out = self._finish()
        self._open, self._text = item, []
        index = len(self.output)
        shown = {**item, "status": "in_progress"} if "status" in item else dict(item)
        if item["type"] == "message":
            shown["content"] = []
        out += self._event("response.output_item.added", output_index=index, item=shown)
        if item["type"] == "message":
            out += self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        return out

    def _finish(self) -> bytes:
        """The open item closed: its done events, and the item whole in the output."""
        item = self._open
        if item is None:
            return b""
        text, index, out = "".join(self._text), len(self.output), b""
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out += self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=text)
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out += self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=text, logprobs=[])
            out += self._event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part)
        else:
            item["arguments"] = text
            out += self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=text)
        self.output.append(item)
        self._open, self._text = None, []
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def _event(self, kind: str, **data: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() \
            + b"\n\n"


def responses_usage(prompt_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int
                    ) -> dict[str, Any]:
    """Responses' usage, from the same counts as Chat Completions' (``openai_api.usage``)."""
    chat = usage(prompt_tokens, cached_tokens, output_tokens, reasoning_tokens)
    return {"input_tokens": chat["prompt_tokens"], "input_tokens_details": chat["prompt_tokens_details"],
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": chat["completion_tokens_details"], "total_tokens": chat["total_tokens"]}


__all__ = ["ResponseBuilder", "ResponseStore", "ResponsesGeneration", "input_messages", "not_found", "parse_responses",
           "responses_usage", "status_of"]

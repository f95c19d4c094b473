"""Anthropic's Messages API as ``llama-chat serve`` speaks it (``POST /v1/messages``): request bodies
read into the same ``Generation`` the OpenAI routes make, and the objects and events sent back.

A body's ``system``, ``messages`` (text, ``tool_use`` and ``tool_result`` blocks), ``tools`` and
``tool_choice`` become the chat's messages and ``ToolRequest``; ``max_tokens``, ``temperature``,
``top_p``, ``top_k`` and ``stop_sequences`` are the command line's controls, checked by the one
checker every surface uses (its other controls, ``seed`` among them, are taken under their
names). The reply is one ``message`` whose content is a text block and the calls' ``tool_use``
blocks, or, streamed, its events (``message_start``, a
``content_block_start``/``_delta``/``_stop`` run per block, ``message_delta`` with the stop reason
and usage, ``message_stop``). Refusals are Anthropic's error object. Nothing here knows the model
or HTTP: ``serve_app.py`` does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llama_chat.cmd.batch_input import SETTING_KEYS
from llama_chat.cmd.openai_api import ApiError, Generation, bad, read_settings
from llama_chat.inference.tool_calls import (ToolCall, ToolChoice, ToolError, ToolRequest, check_results, check_tools,
                                             make_tool)
from llama_chat.inference.tool_formats import called_tool
from llama_chat.inference.tool_stream import Delta
from llama_chat.inference.types import GenerationState
from llama_chat.model.chat_format import Message

# Anthropic's error types by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
# Our finish reasons in Anthropic's words (a reply that made calls: tool_use).
STOP_REASONS = {
    GenerationState.EOS: "end_turn",
    GenerationState.STOP_GRAMMAR: "end_turn",
    GenerationState.STOP_STRING: "stop_sequence",
    GenerationState.MAX_TOKENS: "max_tokens",
    GenerationState.CONTEXT_FULL: "max_tokens",
    GenerationState.MAX_TIME: "max_tokens",
    GenerationState.CANCELLED: "max_tokens",
    GenerationState.ERROR: "end_turn",
}
SETTINGS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
            "stop_sequences": "stop"}
# The command line's other controls (seed, min_p, repetition_penalty ...), as extra fields under
# their own names, as on the OpenAI routes.
SETTINGS.update({name: name for name in SETTING_KEYS if name not in SETTINGS.values()})
# Fields that change nothing here (billing, tracing, and features of other services).
IGNORED = ("metadata", "service_tier", "container", "mcp_servers", "context_management")
FIELDS = frozenset(("model", "messages", "system", "stream", "tools", "tool_choice", "thinking", *SETTINGS, *IGNORED))
# A count_tokens body: what makes the prompt, without max_tokens or the sampling controls.
COUNT_FIELDS = frozenset(("model", "messages", "system", "tools", "tool_choice", "thinking", *IGNORED))


def error_body(e: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "invalid_request_error"),
                                       "message": e.message}}


# -- request bodies --------------------------------------------------------------------------------


def parse_messages(body: dict[str, Any]) -> Generation:
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise bad(f"{unknown[0]}: Extra inputs are not permitted", unknown[0])
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise bad("max_tokens: a number of tokens is required", "max_tokens")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    model, messages, tools = _prompt(body)
    return Generation(True, (messages,), model=model, stream=bool(stream), include_usage=True,
                      settings=read_settings(body, SETTINGS.items()), tools=tools,
                      thinking=_thinking(body.get("thinking"), body["max_tokens"]))


def parse_count(body: dict[str, Any]) -> Generation:
    """A ``count_tokens`` body: the prompt a ``messages.create`` of the same fields would have."""
    unknown = sorted(set(body) - COUNT_FIELDS)
    if unknown:
        raise bad(f"{unknown[0]}: Extra inputs are not permitted", unknown[0])
    model, messages, tools = _prompt(body)
    return Generation(True, (messages,), model=model, tools=tools, thinking=_thinking(body.get("thinking"), None))


def _prompt(body: dict[str, Any]) -> tuple[str | None, tuple[Message, ...], ToolRequest | None]:
    """The model named, the dialog (``system`` first) and the tools of a body."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    try:
        messages = (*_system(body.get("system")), *_messages(body.get("messages")))
        tools = _tools(body)
        check_results(messages)
    except ToolError as e:
        raise bad(str(e), e.param) from None
    return model, messages, tools


def _thinking(value: Any, max_tokens: int | None) -> dict[str, Any]:
    """``thinking``: ``{"type": "enabled", "budget_tokens": N}`` (N below max_tokens, as Anthropic
    requires, where there is one) or ``{"type": "disabled"}``, as ``reasoning.Thinking`` fields."""
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled":
        return {"mode": "off"}
    if kind != "enabled":
        raise bad('thinking must be {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}', "thinking")
    budget = value.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise bad(f"thinking.budget_tokens must be an integer >= 1, got {budget!r}", "thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise bad(f"thinking.budget_tokens must be less than max_tokens ({budget} >= {max_tokens})",
                  "thinking.budget_tokens")
    return {"mode": "on", "budget": budget}


def _text_of(value: Any, where: str) -> str:
    """A string, or a list of text blocks, as one text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                       and isinstance(b.get("text"), str) for b in value):
        return "".join(b["text"] for b in value)
    raise ToolError(f"{where} must be a string or a list of text blocks", where)


def _system(value: Any) -> tuple[Message, ...]:
    if value is None:
        return ()
    return (Message("system", _text_of(value, "system")),)


def _messages(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise ToolError("messages: at least one message is required", "messages")
    out: list[Message] = []
    for i, message in enumerate(value):
        where = f"messages.{i}"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise ToolError(f"{where}.role must be user or assistant, got {role!r}", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            out.append(Message(role, content))
            continue
        if not isinstance(content, list):
            raise ToolError(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
        texts, calls, thoughts = [], [], []
        for j, block in enumerate(content):
            at = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # another service's sealed thinking: nothing a local template can show
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise ToolError(f"{at}: a tool_use block needs an id and a name", at)
                calls.append(called_tool(block["id"], block["name"], block.get("input", {}), f"{at}.input"))
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise ToolError(f"{at}: a tool_result block needs a tool_use_id", at)
                result = block.get("content", "")
                out.append(Message("tool", _text_of(result, f"{at}.content"), tool_call_id=block["tool_use_id"]))
            else:
                raise ToolError(f"{at}: {kind!r} blocks are not supported here (text, tool_use in an assistant "
                                f"message, tool_result in a user message)", at)
        if texts or calls or role == "assistant":
            out.append(Message(role, "".join(texts), tuple(calls), reasoning="".join(thoughts) if thoughts else None))
    return out


def _tools(body: dict[str, Any]) -> ToolRequest | None:
    value = body.get("tools")
    if value is not None and not isinstance(value, list):
        raise ToolError("tools must be a list of tools", "tools")
    tools = []
    for i, item in enumerate(value or ()):
        where = f"tools.{i}"
        if not isinstance(item, dict):
            raise ToolError(f"{where} must be a tool object", where)
        if item.get("type") not in (None, "custom"):
            raise ToolError(f"{where}: {item.get('type')!r} tools are Anthropic's own and not served here", where)
        function = {"name": item.get("name"), **({"description": item["description"]} if "description" in item else {}),
                    "parameters": item.get("input_schema")}
        tools.append(make_tool(item.get("name"), item.get("description"), item.get("input_schema"), where,
                               function))
    choice, parallel = _tool_choice(body.get("tool_choice"), bool(tools))
    check_tools(tools, choice)
    return ToolRequest(tuple(tools), choice, parallel) if tools else None


def _tool_choice(value: Any, offered: bool) -> tuple[ToolChoice, bool]:
    """Anthropic's ``auto``, ``any`` (OpenAI's required), ``tool`` (a named one) and ``none``,
    with ``disable_parallel_tool_use``."""
    if value is None:
        return ToolChoice("auto" if offered else "none"), True
    kind = value.get("type") if isinstance(value, dict) else None
    modes = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
    if kind not in modes:
        raise ToolError('tool_choice.type must be one of auto, any, tool, none', "tool_choice")
    if kind == "tool" and not isinstance(value.get("name"), str):
        raise ToolError("tool_choice: a tool choice names its tool", "tool_choice")
    return ToolChoice(modes[kind], value.get("name")), not value.get("disable_parallel_tool_use", False)


# -- what is sent back -----------------------------------------------------------------------------


def stop_reason(state: GenerationState, called: bool) -> str:
    if called and state in (GenerationState.EOS, GenerationState.STOP_GRAMMAR, GenerationState.STOP_STRING):
        return "tool_use"
    return STOP_REASONS.get(state, "end_turn")


def matched_stop(stops: Sequence[str], rest: str) -> str | None:
    """Which stop sequence ended the reply: the first to appear in what came after its text."""
    found = [(rest.find(s), s) for s in stops if s in rest]
    return min(found)[1] if found else None


def tool_input(arguments: str) -> Any:
    """A call's ``input`` object: its arguments parsed (a call cut short has none whole: empty)."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return {}


@dataclass
class MessageReply:
    """One reply's objects: the whole message, or its stream's events (``events``: the text and
    call pieces of a ``ToolStream``, or plain text, turned into content blocks as they come)."""

    id: str
    model: str
    input_tokens: int
    block: int = -1  # the index of the block open in the stream, -1 none
    kind: str | None = None  # its type: thinking, text or tool_use
    events: list[bytes] = field(default_factory=list)
    thought: list[str] = field(default_factory=list)  # the thinking streamed, for its block's signature

    def whole(self, text: str | None, calls: Sequence[ToolCall], state: GenerationState, output_tokens: int,
              stop: str | None, reasoning: str = "") -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": signature(reasoning)})
        content += [{"type": "text", "text": text}] if text else []
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)} for c in calls]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content or [{"type": "text", "text": ""}],
                "stop_reason": stop_reason(state, bool(calls)), "stop_sequence": stop,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens}}

    def start(self) -> bytes:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return sse("message_start", {"type": "message_start", "message": message})

    def thinking(self, text: str) -> bytes:
        """The events of a piece of thinking: its block opened before the first."""
        if not text:
            return b""
        out = b"" if self.kind == "thinking" else self._open({"type": "thinking", "thinking": "", "signature": ""})
        self.thought.append(text)
        return out + self._delta({"type": "thinking_delta", "thinking": text})

    def pieces(self, deltas: Sequence[Delta]) -> bytes:
        """The events of some text and call pieces: a block opened where its kind begins."""
        out = []
        for d in deltas:
            if d.content:
                if self.kind != "text":
                    out.append(self._open({"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": d.content}))
            elif d.id is not None:
                out.append(self._open({"type": "tool_use", "id": d.id, "name": d.name, "input": {}}))
            elif d.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": d.arguments}))
        return b"".join(out)

    def end(self, state: GenerationState, called: bool, output_tokens: int, stop: str | None) -> bytes:
        closing = self._close() if self.kind is not None else b""
        if self.block < 0:  # nothing at all: one empty text block, as the whole message has
            closing = self._open({"type": "text", "text": ""}) + self._close()
        delta = {"type": "message_delta", "delta": {"stop_reason": stop_reason(state, called), "stop_sequence": stop},
                 "usage": {"output_tokens": output_tokens}}
        return closing + sse("message_delta", delta) + sse("message_stop", {"type": "message_stop"})

    def _open(self, block: dict[str, Any]) -> bytes:
        closing = self._close() if self.kind is not None else b""
        self.block += 1
        self.kind = block["type"]
        return closing + sse("content_block_start", {"type": "content_block_start", "index": self.block,
                                                     "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.block, "delta": delta})

    def _close(self) -> bytes:
        sign = b""
        if self.kind == "thinking":  # Anthropic's stream signs a thinking block just before it closes
            sign = self._delta({"type": "signature_delta", "signature": signature("".join(self.thought))})
        self.kind = None
        return sign + sse("content_block_stop", {"type": "content_block_stop", "index": self.block})


def signature(thinking: str) -> str:
    """A thinking block's ``signature``: Anthropic's seals the thinking for its own servers; this
    server checks nothing it is sent back, so its signature is the thinking's SHA-256, a value
    that clients which keep blocks whole carry along unchanged."""
    return hashlib.sha256(thinking.encode("utf-8")).hexdigest()


def sse(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with Anthropic's ``event:`` line."""
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


__all__ = ["MessageReply", "error_body", "matched_stop", "parse_count", "parse_messages", "sse", "stop_reason",
           "tool_input"]

"""Tool calls as a request asks for them, whichever API it came in by: the tools, the choice, and
the calls a reply makes. The OpenAI and Anthropic surfaces (``cmd/openai_api.py``,
``cmd/anthropic_api.py``) read their bodies into these; ``tool_formats.py`` turns them into a
model's prompt and grammar, and ``tool_stream.py`` reads the calls back out of its text.

What every surface refuses, with one reason each (``ToolError``): a name outside
``^[a-zA-Z0-9_-]{1,64}$``, two tools of one name, a schema the constraint engine cannot take
(named with the part it fails on), a choice naming a tool that is not there, and a tool result
that answers no call.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llama_chat.ml.controls import ControlError
from llama_chat.ml.grammars import Constraint
from llama_chat.model.chat_format import Message

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICES = ("auto", "none", "required", "function")
# A tool without parameters takes none: an empty object, so its call can always end.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
ID_ALPHABET = string.ascii_letters + string.digits
KEPT_SCHEMA_CHARS = 16 * 1024  # schemas up to this long have their check kept (``_kept_problem``)


class ToolError(ValueError):
    """A request's tools, choice or messages that cannot be served: one line, and the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    """One function a reply may call: its name, description and ``parameters`` (a JSON schema,
    an empty object's where it has none); ``function``: the function as the client wrote it
    (OpenAI's shape), which is what the template shows the model."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    function: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's tool object: what chat templates are written for."""
        return {"type": "function", "function": self.function}


@dataclass(frozen=True)
class ToolChoice:
    """``auto`` (text or calls, as the model likes), ``none`` (text only), ``required`` (at least
    one call), ``function`` (one call of the tool ``name``)."""

    mode: str = "auto"
    name: str | None = None


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools, its choice, and whether one reply may make several calls."""

    tools: tuple[Tool, ...]
    choice: ToolChoice = ToolChoice()
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether calls are to be read from the reply (``none`` leaves it plain text)."""
        return bool(self.tools) and self.choice.mode != "none"

    def offered(self) -> tuple[Tool, ...]:
        """The tools a call may name: all of them, or the one a named choice asks for."""
        if self.choice.mode == "function":
            return tuple(t for t in self.tools if t.name == self.choice.name)
        return self.tools


@dataclass(frozen=True)
class ToolCall:
    """One call a reply made: ``arguments`` is the model's JSON text, exactly as it wrote it."""

    id: str
    name: str
    arguments: str


def make_tool(name: Any, description: Any, parameters: Any, where: str, function: dict[str, Any] | None = None) -> Tool:
    """A checked ``Tool``; ``where`` names it in a refusal (``tools[2].function``); ``function``:
    the client's own object (else one is made of the rest)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolError(f"{where}.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}", f"{where}.name")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.description must be a string", f"{where}.description")
    if function is None:
        function = {"name": name, **({"description": description} if description is not None else {}),
                    **({"parameters": parameters} if parameters is not None else {})}
    if parameters is None:
        parameters = NO_PARAMETERS
    if not isinstance(parameters, dict):
        raise ToolError(f"{where}.parameters must be a JSON schema object", f"{where}.parameters")
    tool = Tool(name, description, parameters, function)
    check_schema(tool, where)
    return tool


def check_schema(tool: Tool, where: str) -> None:
    """Refuse a schema the constraint engine cannot take, naming the tool and the engine's reason
    (which says the part of the schema)."""
    try:
        text = json.dumps(tool.parameters, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        raise ToolError(f"tool {tool.name!r}: its parameters schema is not JSON", f"{where}.parameters") from None
    reason = _kept_problem(text) if len(text) <= KEPT_SCHEMA_CHARS else _schema_problem(text)
    if reason is not None:
        raise ToolError(f"tool {tool.name!r}: its parameters schema {reason}", f"{where}.parameters")


def _schema_problem(text: str) -> str | None:
    """What the engine says of a schema, None when it takes it."""
    try:
        Constraint.json_schema(text)
    except ControlError as e:
        return e.reason
    return None


# A client sends the same tools with every turn of a conversation: the answers for schemas of a
# usual size are kept.
_kept_problem = functools.lru_cache(maxsize=256)(_schema_problem)


def check_tools(tools: Sequence[Tool], choice: ToolChoice, param: str = "tools") -> None:
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ToolError(f"two tools are named {tool.name!r}", param)
        seen.add(tool.name)
    if choice.mode not in CHOICES:
        raise ToolError(f"tool_choice must be one of auto, none, required or a function, got {choice.mode!r}",
                        "tool_choice")
    if choice.mode in ("required", "function") and not tools:
        raise ToolError(f"tool_choice {choice.mode!r} needs tools", "tool_choice")
    if choice.mode == "function" and choice.name not in seen:
        raise ToolError(f"tool_choice names the tool {choice.name!r}, which is not in tools", "tool_choice")


def check_results(messages: Sequence[Message], param: str = "messages") -> None:
    """Every tool message answers a call an earlier assistant message made."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        called.update(call.id for call in message.tool_calls)
        if message.role == "tool" and message.tool_call_id not in called:
            raise ToolError(f"{param}[{i}] is a tool result for {message.tool_call_id!r}, which no earlier "
                            f"assistant message called", f"{param}[{i}]")


def arguments_value(text: str, where: str) -> Any:
    """A call's arguments as a template reads them: the JSON text a client sent back, parsed."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ToolError(f"{where} must be JSON text ({e.msg})", where) from None


def call_id(style: str = "openai") -> str:
    """A new call's id: ``call_`` and 24 hex digits, Anthropic's ``toolu_`` form, or the 9
    letters and digits Mistral's template demands of every id."""
    if style == "mistral":
        return "".join(secrets.choice(ID_ALPHABET) for _ in range(9))
    if style == "anthropic":
        return f"toolu_{secrets.token_hex(12)}"
    return f"call_{secrets.token_hex(12)}"


__all__ = ["CHOICES", "NAME", "Tool", "ToolCall", "ToolChoice", "ToolError", "ToolRequest", "arguments_value",
           "call_id", "check_results", "check_schema", "check_tools", "make_tool"]

"""The tool-call formats models are trained on: how a call is written, how one is told from the
chat template's text, and the grammar that holds a reply to it.

Every format writes a call as ``{"name": "NAME", "arguments": ARGS}`` (Llama's key is
``parameters``) with Python's ``json.dumps`` spacing, which is what the templates write back with
``tojson``; around the calls:

=============  ====================================================  =====================================
format         a reply with calls                                    chosen when the template has
=============  ====================================================  =====================================
hermes         any text, then ``<tool_call>\\nCALL\\n</tool_call>``     ``<tool_call>`` (Qwen 2.5/3, QwQ,
               per call, one line apart                              Hermes 2/3, DeepSeek-R1 Qwen distills)
llama3_json    ``<|python_tag|>``? ``CALL``, one call, ended by      ``<|python_tag|>``, or ``"parameters"``
               ``<|eot_id|>`` or ``<|eom_id|>``                       with ``{"name"`` (Llama 3.1, 3.2, 3.3)
mistral        ``[TOOL_CALLS][CALL, CALL]`` (the ids, 9 letters and   ``[TOOL_CALLS]`` (Mistral, Nemo,
               digits, are the server's)                              Small, Devstral)
generic        ``{"tool_calls": [CALL, ...]}`` or                      anything else: the tools are described
               ``{"response": "TEXT"}``                               in the system message
=============  ====================================================  =====================================

The grammar (llguidance's Lark, with each tool's ``parameters`` inlined as ``%json``) is lazy for
``auto``: the text runs free until the call's trigger (``<tool_call>``, the ``<|python_tag|>`` or
``[TOOL_CALLS]`` token, or a reply's first ``{`` or ``[``), and from there it holds the call to a
listed name and that tool's schema. For ``required`` and a named function it holds the reply from
its first token. The trigger tokens spell no text, so a reply that does not start a call may not
start with the character a call starts with: text and calls are always told apart the same way
(``tool_stream.py``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from llama_chat.inference.tool_calls import Tool, ToolRequest, arguments_value
from llama_chat.ml.controls import ControlError
from llama_chat.ml.grammars import SCHEMA_VALUE_KEYS, Constraint, bounded_schema
from llama_chat.model.chat_format import CalledTool, Message

FORMAT_NAMES = ("auto", "hermes", "llama3_json", "mistral", "generic")
# Keys of a schema whose value maps names to subschemas.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# The spacing of every call, as json.dumps writes it: no room for endless whitespace.
CALL_JSON = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes its calls: the text before the first call (``start``), around each
    call (``open``, ``close``), between calls (``sep``) and after the last (``end``); the key of
    the arguments; whether text may come before the calls; the special token that starts them
    (control tokens spell no text: the grammar names it by id); how call ids look."""

    name: str
    start: str = ""
    open: str = ""
    close: str = ""
    sep: str = ""
    end: str = ""
    args_key: str = "arguments"
    text_before: bool = False
    token: str | None = None
    parallel: bool = True
    id_style: str = "openai"

    def head(self, name: str) -> str:
        """A call's text up to its arguments."""
        return f'{{"name": "{name}", "{self.args_key}": '


FORMATS = {
    "hermes": ToolFormat("hermes", open="<tool_call>\n", close="\n</tool_call>", sep="\n", text_before=True),
    "llama3_json": ToolFormat("llama3_json", args_key="parameters", token="<|python_tag|>", parallel=False),
    "mistral": ToolFormat("mistral", start="[", sep=", ", end="]", token="[TOOL_CALLS]", id_style="mistral"),
    "generic": ToolFormat("generic", start='{"tool_calls": [', sep=", ", end="]}"),
}
GENERIC_TEXT = '{"response": '  # the generic format's reply that is text: a JSON string, then "}"
HERMES_TRIGGER = "<tool_call>"
# The forms Qwen-style models slip into under ``auto`` (hermes), read as calls where a listed tool is
# named: a call in a fenced block (```json, or ``` alone, then the call, then ```), a call alone
# and bare as the whole reply, and the tags around a list of calls.
SLIPPED_FORMS = ("fenced", "bare", "listed")
FENCE_OPENS = ("```json\n", "```\n")
FENCE_PATTERN = "```(json)?\\n"
FENCE_CLOSE = "\n```"


def detect_format(template: str | None) -> str:
    """The format of a chat template's text, as llama.cpp tells them: its markers."""
    if template is None:
        return "generic"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ('"parameters"' in template and '{"name"' in template):
        return "llama3_json"
    return "generic"


def resolve_format(name: str, template: str | None) -> ToolFormat:
    """``--tool-format``'s value: a format by name, or ``auto`` (from the template)."""
    if name not in FORMAT_NAMES:
        raise ValueError(f"unknown tool format {name!r}; expected one of {', '.join(FORMAT_NAMES)}")
    return FORMATS[detect_format(template) if name == "auto" else name]


def call_schema(tool: Tool, *, bounded: bool = True) -> dict[str, Any]:
    """The schema a call's arguments are held to: the tool's own, where an object with listed
    properties takes no others unless it says so (llama.cpp's reading: a small model would
    otherwise invent keys without end), integers bounded in length, and json.dumps' spacing."""
    schema = bounded_schema(tool.parameters) if bounded else tool.parameters
    return {**_closed(schema), "x-guidance": CALL_JSON}


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in SCHEMA_VALUE_KEYS:
            out[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):  # names to subschemas (a property may be "type")
            out[key] = {name: _closed(sub) for name, sub in value.items()}
        else:
            out[key] = _closed(value)
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


# -- the grammar -----------------------------------------------------------------------------------


def _q(text: str) -> str:
    """A Lark string literal; nothing for the empty string."""
    return json.dumps(text) if text else ""


def _seq(*items: str) -> str:
    return " ".join(item for item in items if item)


def tool_grammar(fmt: ToolFormat, request: ToolRequest, specials: Mapping[str, int]) -> Constraint:
    """The constraint of a reply under ``request``; ``specials``: the tokenizer's special tokens
    (the trigger token, where the vocabulary has it). ``ControlError`` where the engine refuses.
    Tools whose bounded integers are more than the engine takes at one place keep its own
    integers, as a schema does (``ml/grammars.py``)."""
    try:
        return _tool_grammar(fmt, request, specials, bounded=True)
    except ControlError:
        return _tool_grammar(fmt, request, specials, bounded=False)


def _tool_grammar(fmt: ToolFormat, request: ToolRequest, specials: Mapping[str, int], *, bounded: bool
                  ) -> Constraint:
    tools = request.offered()
    parallel = request.parallel and fmt.parallel and request.choice.mode != "function"
    rules = [f"call: {' | '.join(f'call{i}' for i in range(len(tools)))}"]
    for i, tool in enumerate(tools):
        rules.append(f'call{i}: {_q(fmt.head(tool.name))} args{i} "}}"')
        rules.append(f"args{i}: %json {json.dumps(call_schema(tool, bounded=bounded))}")
    more = f"({_seq(_q(fmt.sep + fmt.open), 'call', _q(fmt.close))})*" if parallel else ""
    # Named by id: a control token spells no text (ml/constraints.py keeps the masks to the named).
    token = f"<[{specials[fmt.token]}]>" if fmt.token and fmt.token in specials else ""
    free = request.choice.mode == "auto"
    if fmt.name == "hermes" and free:
        # The lazy rules end at the first trigger; the text alone may never hold one. Besides the
        # tags, the forms small models slip into wake the grammar too (``SLIPPED_FORMS``): a call
        # in a fenced JSON block, or alone and bare, named by a listed tool's head; a list of
        # calls inside the tags.
        trigger = HERMES_TRIGGER
        names = "|".join(re.escape(tool.name) for tool in tools)
        head = f'\\{{"name": "({names})"'
        # A bare call is none of the other lexemes' start: one lexeme at a time reads the reply,
        # and one that may still go on (the text before a tag) would outlive the call's end.
        bare = f"~/{head}(?s:.*)/"
        rules += [f"before[lazy]: /(?s:.*){trigger}/ & {bare}",
                  f"TEXT: /(?s:.*)/ & ~/(?s:.*)({trigger}|{FENCE_PATTERN}{head})(?s:.*)/ & {bare}"]
        listed = _seq('"["', "call", "(\", \" call)*" if parallel else "", '"]"')
        tagged = f"({_seq('call', _q(fmt.close), more)} | {_seq(listed, _q(fmt.close))})"
        alternatives = ["TEXT", _seq("before", _q(fmt.open.removeprefix(trigger)), tagged), "call"]
        for i, tool in enumerate(tools):
            rules.append(f'fence{i}[lazy]: /(?s:.*){FENCE_PATTERN}\\{{"name": "{re.escape(tool.name)}"/ & {bare}')
            alternatives.append(_seq(f"fence{i}", _q(f', "{fmt.args_key}": '), f"args{i}", '"}"', _q(FENCE_CLOSE)))
        start = " | ".join(alternatives)
    else:
        calls = _seq(_q(fmt.start), _q(fmt.open), "call", _q(fmt.close), more, _q(fmt.end))
        if token and fmt.name == "llama3_json":
            token += "?"  # Llama 3.1 writes a custom tool's call bare, 3.2 at times after the tag
        start = _seq(token, calls)
        if free and fmt.name == "generic":
            rules += [f'text: {_q(GENERIC_TEXT)} string "}}"', 'string: %json {"type": "string"}']
            start += " | text"
        elif free:
            first = (fmt.start or "{").replace("[", "\\[")
            rules.append(f"TEXT: /([^{first}](?s:.*))?/")
            start = f"TEXT | {start}"
    return Constraint.of_grammar("%llguidance {}\nstart: " + start + "\n" + "\n".join(rules) + "\n")


# -- the dialog ------------------------------------------------------------------------------------


GENERIC_INSTRUCTIONS = (
    "You can call these tools (JSON schemas of their parameters):\n{tools}\n\n"
    'To call tools, reply with only {{"tool_calls": [{{"name": "TOOL", "arguments": {{...}}}}]}}. '
    'To answer in text, reply with only {{"response": "TEXT"}}.')


def prepare_dialog(fmt: ToolFormat, messages: Sequence[Message], request: ToolRequest | None
                   ) -> tuple[list[Message], list[dict] | None]:
    """The messages and tools a template renders. A format of the template's own gets both as they
    are; the generic one has the tools described in the system message, and calls and results
    written as the JSON it asks the model for, so that any template can show them."""
    offered = [t.as_openai() for t in request.tools] if request is not None and request.active else None
    if fmt.name != "generic":
        return list(messages), offered
    out = []
    for m in messages:
        if m.tool_calls:
            calls = [{"name": c.name, "arguments": c.arguments} for c in m.tool_calls]
            out.append(Message("assistant", json.dumps({"tool_calls": calls}, ensure_ascii=False)))
        elif m.role == "tool":
            out.append(Message("user", json.dumps({"tool_response": {"id": m.tool_call_id, "content": m.content}},
                                                  ensure_ascii=False)))
        else:
            out.append(m)
    if offered:
        described = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in offered)
        note = GENERIC_INSTRUCTIONS.format(tools=described)
        if out and out[0].role == "system":
            out[0] = replace(out[0], content=f"{out[0].content}\n\n{note}")
        else:
            out.insert(0, Message("system", note))
    return out, None


def called_tool(id: str, name: str, arguments: Any, where: str) -> CalledTool:
    """An assistant message's call as a template reads it (arguments parsed)."""
    return CalledTool(id, name, arguments_value(arguments, where))


__all__ = ["FORMATS", "FORMAT_NAMES", "ToolFormat", "call_schema", "called_tool", "detect_format", "prepare_dialog",
           "resolve_format", "tool_grammar"]

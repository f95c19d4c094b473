"""What a reply must match: a JSON schema, any JSON object, a regular expression or a grammar.

A ``Constraint`` is the request's side of structured output: what the user asked for, checked and
compiled to the constraint engine's grammar when it is made, without torch and without a
tokenizer, so that a bad schema, pattern or grammar is a usage error before the model loads. The
processor that enforces it, one matcher per row against the model's vocabulary, is
``ml/constraints.py``.

The kinds, and what their text means:

* ``json_schema``: a JSON Schema (an object, as JSON text); the reply is one JSON value that
  validates against it. Properties come in the schema's order; between tokens of the JSON there
  may be one space, or a line break and up to 20 spaces or tabs of indentation (llama.cpp's rule
  for its JSON grammars): room to pretty-print, but no endless whitespace;
* ``json``: any JSON object (``--format json``, Ollama's ``format: "json"``), the same rules;
* ``regex``: the whole reply matches the pattern (Rust's ``regex`` syntax, close to Python's;
  ``\\d``, ``\\w`` and ``\\s`` are ASCII classes, ``[0-9]`` and so on);
* ``grammar``: a context-free grammar, in Lark's syntax as llguidance reads it, or in llama.cpp's
  GBNF (``root ::= ...``), which llguidance converts to Lark itself. Both are taken so that the
  grammars users already have for llama.cpp work unchanged.

Errors are ``ControlError`` with a one-line reason, named after the kind (``json_schema``,
``regex``, ``grammar``), as every other control of the command line. A text longer than
``MAX_CONSTRAINT_BYTES``, or whose references chain deeper than ``MAX_GRAMMAR_DEPTH``
(``ml/grammar_depth.py``), is refused before the engine sees it; the engine itself compiles on a
deep stack within a memory budget (``ml/grammar_compile.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from llama_chat.ml.controls import MAX_CONSTRAINT_BYTES, MAX_GRAMMAR_DEPTH, ControlError
from llama_chat.ml.grammar_compile import compiled
from llama_chat.ml.grammar_depth import grammar_depth, schema_depth

# What a constraint may be; ``json`` is --format json.
CONSTRAINT_KINDS = ("json_schema", "json", "regex", "grammar")
# The choices of --format and of the chat's /set format (none: no constraint).
FORMATS = ("json", "none")

ANY_JSON_OBJECT = '{"type":"object"}'
# Between JSON tokens: nothing, one space, or a line break and some indentation (llama.cpp's
# ``space`` rule). llguidance's default allows any run of whitespace, which a small model can fill
# until its token budget is spent.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})"
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}
# An integer without bounds has at most this many digits (llama.cpp's bound): the engine's own
# rule lets a model write digits until its token budget is spent, and the JSON never closes.
MAX_INTEGER_DIGITS = 16
_INTEGER_BOUND = 10**MAX_INTEGER_DIGITS - 1
SCHEMA_VALUE_KEYS = ("enum", "const", "default", "examples")  # keys whose values are data, not subschemas
_POSITION = re.compile(r"^at (\d+)\((\d+)\): ")


@dataclass(frozen=True)
class Constraint:
    """A reply's constraint: ``kind`` (one of ``CONSTRAINT_KINDS``) and its ``source`` text.

    Checked and compiled on creation (``ControlError`` when the engine refuses it); ``grammar`` is
    then llguidance's form of it. Two constraints with the same kind and source are equal, so a
    compiled matcher can be kept per constraint. A JSON schema's source is kept as compact JSON.
    """

    kind: str
    source: str = ""
    # A grammar that holds a thinking model's reply (``thinking_grammar``): ``source`` is the
    # thinking's Lark, and this the constraint of the answer after it, which it names ``@answer``.
    answer: Constraint | None = None
    grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.answer is not None:
            object.__setattr__(self, "grammar", _compile_with_answer(self.source, self.answer))
            return
        if self.kind not in CONSTRAINT_KINDS:
            raise ControlError("constraint", f"must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}")
        if self.kind == "json_schema":
            object.__setattr__(self, "source", _schema_text(self.source))
        elif self.kind == "json":
            object.__setattr__(self, "source", ANY_JSON_OBJECT)
        elif not isinstance(self.source, str) or not self.source.strip():
            raise ControlError(self.kind, "must not be empty")
        check_size(self.kind, self.source)
        object.__setattr__(self, "grammar", _compile(self.kind, self.source))

    @classmethod
    def json_schema(cls, schema: Any) -> Constraint:
        """From a schema as a dict or as JSON text."""
        return cls("json_schema", schema if isinstance(schema, str) else _dump(schema))

    @classmethod
    def any_json(cls) -> Constraint:
        return cls("json")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def of_grammar(cls, text: str) -> Constraint:
        return cls("grammar", text)

    def sources(self) -> tuple[str, ...]:
        """The texts the constraint was made of: its own, then its answer's."""
        return (self.source, *(self.answer.sources() if self.answer is not None else ()))

    def describe(self) -> str:
        """One line for a settings listing: ``format json``, ``json_schema {...}``, ``regex ...``."""
        if self.answer is not None:
            return self.answer.describe()
        if self.kind == "json":
            return "format json"
        return f"{self.kind} {' '.join(self.source.split())}"


def format_constraint(value: str) -> Constraint | None:
    """``--format``'s value: ``json`` is any JSON object, ``none`` no constraint."""
    word = value.strip().lower()
    if word not in FORMATS:
        raise ControlError("format", f"must be one of {', '.join(FORMATS)}, got {value!r}")
    return Constraint.any_json() if word == "json" else None


def _dump(schema: Any) -> str:
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ControlError("json_schema", f"is not JSON ({e})") from None
    except RecursionError:
        raise ControlError("json_schema", "is nested too deeply") from None


def check_size(kind: str, text: str) -> None:
    """``ControlError`` for a schema or grammar text longer than ``MAX_CONSTRAINT_BYTES``."""
    if len(text) > MAX_CONSTRAINT_BYTES // 4 and len(text.encode("utf-8", "surrogatepass")) > MAX_CONSTRAINT_BYTES:
        raise ControlError(kind, f"is longer than {MAX_CONSTRAINT_BYTES} bytes")


def _check_depth(kind: str, depth: int, what: str) -> None:
    if depth > MAX_GRAMMAR_DEPTH:
        raise ControlError(kind, f"is nested too deeply (a chain of {depth} {what}, each leading to the next; "
                                 f"at most {MAX_GRAMMAR_DEPTH})")


def _schema_text(source: Any) -> str:
    if not isinstance(source, str):
        raise ControlError("json_schema", f"must be JSON text, got {type(source).__name__}")
    check_size("json_schema", source)
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as e:
        raise ControlError("json_schema", f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise ControlError("json_schema", "is nested too deeply") from None
    if not isinstance(schema, (dict, bool)):
        raise ControlError("json_schema", f"must be a JSON object, got {type(schema).__name__}")
    _check_depth("json_schema", schema_depth(schema), "subschemas and $refs")
    return _dump(schema)


def bounded_schema(schema: Any) -> Any:
    """``schema`` with every integer that lacks a bound given one (``MAX_INTEGER_DIGITS``), so that
    a reply held to it can always end; the rest as it is."""
    if isinstance(schema, list):
        return [bounded_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in SCHEMA_VALUE_KEYS else bounded_schema(v)) for k, v in schema.items()}
    kind = schema.get("type")
    if kind == "integer" or isinstance(kind, list) and "integer" in kind:
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            out["minimum"] = -_INTEGER_BOUND
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            out["maximum"] = _INTEGER_BOUND
    return out


# A thinking model's reply held to a budget or a constraint (inference/reasoning.py): the thinking
# runs free within its budget (llguidance's ``max_tokens`` ends the rule there), then the end tag
# and the blank line the families write after it, then the answer. The tags are Lark items: a
# token by id (``<[151668]>``), or a string literal where the tags are plain text.
ANY_TEXT = "/(?s:.*)/"


def thinking_grammar(answer: Constraint | None, *, open_tag: str, close_tag: str, budget: int | None,
                     tags_are_tokens: bool, optional: bool = False) -> Constraint:
    """The constraint of a reply that thinks first: ``open_tag`` (empty where the prompt opened the
    thinking), thinking of at most ``budget`` tokens (None: any), ``close_tag``, a blank line, then
    ``answer`` (None: any text). ``optional``: the thinking may be left out (a model that thinks
    when it likes; the answer's constraint never starts with a tag, so either way is known from
    the first token). ``ControlError`` where the engine refuses it."""
    limit = f"[max_tokens={budget}]" if budget is not None else ""
    if tags_are_tokens:
        # The end token, named by id, is never read as text (ml/constraints.py), so the thinking is any text.
        think = [f"think{limit}: {ANY_TEXT}"]
        body = _seq_items(open_tag, "think", close_tag)
    elif budget is None:
        # A lazy rule ends at the first end tag the model writes.
        think = [f"think[lazy]: /(?s:.*){_lark_escape(json.loads(close_tag))}/"]
        body = _seq_items(open_tag, "think")
    else:
        # Either the model ends it, or the budget does and the tag is written for it.
        think = [f"think[lazy, max_tokens={budget}]: /(?s:.*){_lark_escape(json.loads(close_tag))}/"]
        body = _seq_items(open_tag, "think", f"{close_tag}?")
    rest = "@answer" if answer is not None else ANY_TEXT
    thinking = _seq_items(body, '"\\n\\n"')
    lark = ("%llguidance {}\nstart: " + (f"({thinking})? {rest}" if optional else f"{thinking} {rest}") + "\n"
            + "\n".join(think) + "\n")
    if answer is None:
        return Constraint("grammar", lark)
    return Constraint("grammar", lark, answer=answer)


def _lark_escape(text: str) -> str:
    """``text`` matched literally inside a Lark ``/.../`` pattern."""
    return re.escape(text).replace("/", "\\/")


def _seq_items(*items: str) -> str:
    return " ".join(item for item in items if item)


def _compile_with_answer(source: str, answer: Constraint) -> str:
    """llguidance's top-level grammar: ``source``'s Lark first, then ``answer``'s grammars, the first
    of them named ``answer``."""
    llg = _llguidance()
    # The engine's form of a grammar is a top-level grammar (JSON), or for Lark the Lark text itself.
    try:
        inner = json.loads(answer.grammar)["grammars"]
    except (ValueError, TypeError, KeyError):
        inner = [{"lark_grammar": answer.grammar}]
    inner[0] = {**inner[0], "name": "answer"}
    grammar = json.dumps({"grammars": [{"lark_grammar": source}, *inner]})
    try:
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError, RecursionError) as e:
        raise ControlError(answer.kind, _not_valid(one_line(str(e), answer.kind))) from None
    if failed:
        raise ControlError(answer.kind, _not_valid(one_line(messages[0], answer.kind)))
    return grammar


def _llguidance():
    try:
        import llguidance
    except ImportError:  # a broken install: the dependency is declared
        raise ControlError("constraint", "needs the llguidance package (pip install llguidance)") from None
    return llguidance


def _compile(kind: str, source: str) -> str:
    """llguidance's grammar for ``source``, checked; ``ControlError`` with the engine's reason."""
    if kind == "grammar":
        _check_depth(kind, grammar_depth(source), "rules")
    return compiled(len(source), _compile_here, kind, source)


def _compile_here(kind: str, source: str) -> str:
    llg = _llguidance()
    try:
        if kind == "json_schema":
            grammar = _schema_grammar(llg, source)
        elif kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(source, defaults=_JSON_OPTIONS)
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_lark(f"start: /{llg.regex_to_lark(source, 'dws')}/")
        else:
            grammar = llg.grammar_from("grammar", source)
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError, RecursionError) as e:
        raise ControlError(kind, _not_valid(one_line(str(e), kind))) from None
    if failed:
        raise ControlError(kind, _not_valid(one_line(messages[0], kind)))
    return grammar


def _schema_grammar(llg, source: str) -> str:
    """The engine's grammar of a schema with its integers bounded (``bounded_schema``); where that
    is more than the engine takes at one place (a thousand integer alternatives in a chain), the
    schema as it is."""
    grammar = llg.LLMatcher.grammar_from_json_schema(_dump(bounded_schema(json.loads(source))), defaults=_JSON_OPTIONS)
    if llg.LLMatcher.validate_grammar_with_warnings(grammar)[0]:
        return llg.LLMatcher.grammar_from_json_schema(source, defaults=_JSON_OPTIONS)
    return grammar


def _not_valid(reason: str) -> str:
    """The engine's reason, said once: "invalid regex ..." needs no "is not valid" before it."""
    return reason if reason.lower().startswith("invalid") else f"is not valid: {reason}"


def one_line(message: str, kind: str) -> str:
    """llguidance's message on one line: without the source lines it echoes (indented, under a
    caret) and, for a pattern, without the position in the grammar it wraps the pattern in."""
    kept = [line.strip() for line in message.splitlines() if line.strip() and not line[0].isspace()]
    text = " ".join(kept) if kept else " ".join(message.split())
    found = _POSITION.match(text)
    if found:
        where = "" if kind == "regex" else f"line {found.group(1)}, column {found.group(2)}: "
        text = where + text[found.end():]
    return text.replace(" (in regex): regex parse error: error: ", ": ").replace("regex parse error: error: ",
                                                                                "a pattern: ")


__all__ = ["ANY_JSON_OBJECT", "CONSTRAINT_KINDS", "Constraint", "FORMATS", "JSON_WHITESPACE", "MAX_INTEGER_DIGITS",
           "SCHEMA_VALUE_KEYS", "bounded_schema", "check_size",
           "format_constraint", "one_line", "thinking_grammar"]

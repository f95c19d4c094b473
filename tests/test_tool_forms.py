"""Tool calls in the forms small Qwen-style models slip into under ``tool_choice: auto``: a call in a
fenced JSON block, a bare call, the tags around a list of calls. The lazy grammar wakes on them (so
their arguments are held to the schema) and the reader makes them calls, in whatever pieces the
text comes; text that merely mentions a tool, or a fenced object that names no listed tool, stays
text."""

from __future__ import annotations

import json
import random

import pytest

from llama_chat.inference.tool_calls import ToolChoice, ToolRequest, call_id, make_tool
from llama_chat.inference.tool_formats import FORMATS, tool_grammar
from llama_chat.inference.tool_stream import ToolStream
from llama_chat.ml.constraints import Compiled, Vocabulary
from llama_chat.model.tokenizers.loading import load_tokenizer
from tool_builders import write_tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = (make_tool("get_weather", None, WEATHER, "t"), make_tool("ping", None, None, "t"))
NAMES = [t.name for t in TOOLS]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
PING = '{"name": "ping", "arguments": {}}'

SLIPPED = {
    "fenced json": (f"Let me check.\n```json\n{CALL}\n```", "Let me check.", [CALL]),
    "fenced": (f"```\n{PING}\n```", None, [PING]),
    "bare": (CALL, None, [CALL]),
    "listed": (f"<tool_call>\n[{CALL}, {PING}]\n</tool_call>", None, [CALL, PING]),
    "tagged": (f"Sure.\n<tool_call>\n{CALL}\n</tool_call>", "Sure.", [CALL]),
}
TEXT = {
    "a mention": "You could call get_weather with {\"city\": \"Paris\"}.",
    "fenced other JSON": '```json\n{"name": "Alice", "age": 3}\n```',
    "code": "```python\nprint('hi')\n```",
}


@pytest.fixture(scope="module")
def grammar(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hermes")
    write_tokenizer(folder, "hermes")
    tok = load_tokenizer(folder)
    constraint = tool_grammar(FORMATS["hermes"], ToolRequest(TOOLS, ToolChoice("auto")), tok.special_tokens)
    return tok, Compiled(constraint, Vocabulary.of(tok, tok.stop_ids))


def accepted(grammar, text: str) -> bool:
    """The grammar takes the reply's tokens, one by one, and may end there."""
    tok, compiled = grammar
    matcher = compiled.matcher()
    for token in tok.encode(text):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


def read(text: str, seed: int) -> tuple[str | None, list[str], str]:
    """The reply read in random pieces: its content, its calls' arguments, the streamed content."""
    rng, reader, at, streamed = random.Random(seed), ToolStream(FORMATS["hermes"], call_id, NAMES), 0, []
    arguments: dict[int, str] = {}
    pieces = []
    while at < len(text):
        size = rng.randint(1, 5)
        pieces.append(text[at:at + size])
        at += size
    for deltas in [*(reader.feed(piece) for piece in pieces), reader.finish()]:
        for d in deltas:
            streamed.append(d.content)
            if d.index is not None:
                arguments[d.index] = arguments.get(d.index, "") + d.arguments
    calls = reader.tool_calls()
    assert [c.arguments for c in calls] == [arguments[i] for i in range(len(calls))]
    return reader.text(), [json.dumps({"name": c.name, "arguments": json.loads(c.arguments)}) for c in calls], \
        "".join(streamed)


@pytest.mark.parametrize("form", list(SLIPPED))
def test_a_slipped_call_is_a_call_and_the_grammar_takes_it(grammar, form):
    text, content, calls = SLIPPED[form]
    assert accepted(grammar, text), form
    for seed in range(25):
        got_content, got_calls, streamed = read(text, seed)
        assert got_calls == calls and got_content == content
        assert "get_weather" not in streamed and "```" not in streamed


@pytest.mark.parametrize("kind", list(TEXT))
def test_text_that_only_mentions_a_tool_stays_text(grammar, kind):
    text = TEXT[kind]
    assert accepted(grammar, text)
    for seed in range(10):
        assert read(text, seed) == (text, [], text)


def test_a_fenced_call_of_an_unlisted_tool_or_with_bad_arguments_is_refused(grammar):
    assert not accepted(grammar, '```json\n{"name": "get_weather", "arguments": {"town": 1}}\n```')
    assert not accepted(grammar, '{"name": "get_weather", "arguments": {"days": "x"}}')

"""Tool calls on ``/v1/chat/completions``: each format with its real chat template (tests/data), a
tiny random model held to the calls' schemas by the grammar, driven by OpenAI's own client.

One server per format, one at a time (a module-scoped fixture with a parameter per format). The
model is random, so every call it makes comes from the grammar alone: that is what is checked.
"""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
import torch

from llama_chat.cmd.openai_api import FINISH_REASONS, finish_reason
from llama_chat.inference.tool_calls import NO_PARAMETERS, ToolChoice, ToolRequest, call_id, make_tool
from llama_chat.inference.tool_formats import FORMATS, detect_format, tool_grammar
from llama_chat.inference.tool_stream import ToolStream
from llama_chat.inference.types import GenerationState
from llama_chat.ml.constraints import Compiled, Vocabulary
from llama_chat.ml.grammars import MAX_INTEGER_DIGITS, Constraint
from llama_chat.model.chat_format import HFTemplateChatFormat, Message
from llama_chat.model.tokenizers.loading import load_tokenizer
from serve_support import start_server, stop_server
from tool_builders import FAMILIES, build_tool_model, hf_tokenizer, template_text

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days"]}
ALARM = {"type": "object", "properties": {"at": {"type": "integer"}, "loud": {"type": "boolean"}},
         "required": ["at", "loud"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "description": "Set an alarm", "parameters": ALARM}},
    {"type": "function", "function": {"name": "ping", "description": "Check that the service is up"}},
]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM, "ping": NO_PARAMETERS}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
CALL_STARTS = {"hermes": "<tool_call>", "llama3_json": "{", "mistral": "[", "generic": '{"tool_calls"'}


# -- without a server ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
def test_each_real_template_is_told_by_its_markers(family):
    assert detect_format(template_text(family)) == family
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "generic"
    assert detect_format(None) == "generic"


def test_the_generic_format_shows_tools_calls_and_results_to_any_template():
    """Any template can render the generic format's dialog: system, user and assistant text only."""
    from llama_chat.inference.tool_formats import prepare_dialog, resolve_format

    tools = tuple(make_tool(t["function"]["name"], None, t["function"].get("parameters"), "t", t["function"])
                  for t in TOOLS)
    messages, offered = prepare_dialog(FORMATS["generic"], _round_trip_messages("c1", {"city": "Paris"}),
                                       ToolRequest(tools))
    assert offered is None and [m.role for m in messages] == ["system", "user", "assistant", "user"]
    assert all(t["function"]["name"] in messages[0].content for t in TOOLS)
    assert json.loads(messages[2].content) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert json.loads(messages[3].content)["tool_response"]["id"] == "c1"
    assert not any(m.tool_calls or m.tool_call_id for m in messages)
    native, offered = prepare_dialog(FORMATS["hermes"], messages, ToolRequest(tools, ToolChoice("none")))
    assert native == messages and offered is None  # choice none: no tools offered to the template
    assert resolve_format("mistral", template_text("hermes")).name == "mistral"  # --tool-format wins
    assert resolve_format("auto", template_text("hermes")).name == "hermes"
    with pytest.raises(ValueError, match="unknown tool format"):
        resolve_format("xml", None)


def test_finish_reasons_on_the_wire_are_openai_values_only():
    openai_values = {"stop", "length", "tool_calls", "content_filter", "function_call"}
    assert {finish_reason(state) for state in GenerationState if state.finished} <= openai_values
    assert set(FINISH_REASONS.values()) <= openai_values
    assert finish_reason(GenerationState.STOP_GRAMMAR, True) == "tool_calls"
    assert finish_reason(GenerationState.MAX_TOKENS, True) == "length"


def test_an_integer_without_bounds_ends_within_16_digits(tmp_path):
    """The engine's own integer rule lets digits run to the token budget; ours stops at 16."""
    model_dir = tmp_path / "m"
    from tool_builders import write_tokenizer
    write_tokenizer(model_dir, "hermes")
    tok = load_tokenizer(model_dir)
    compiled = Compiled(Constraint.json_schema({"type": "integer"}), Vocabulary.of(tok, tok.stop_ids))
    digit = next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == b"7")
    matcher = compiled.matcher()
    taken = 0
    while matcher.consume_token(digit):
        taken += 1
        assert taken <= MAX_INTEGER_DIGITS
    assert taken == MAX_INTEGER_DIGITS


def test_a_named_control_token_beside_text_lets_no_other_one_through(tmp_path):
    """The engine's own mask lets every control token (and the end tokens) through where a named
    one is an alternative to text; the mask keeps only the named one, and the end tokens where
    the grammar accepts."""
    from tool_builders import write_tokenizer
    write_tokenizer(tmp_path, "llama3_json")
    tok = load_tokenizer(tmp_path)
    tag = tok.special_tokens["<|python_tag|>"]
    silent = {i for i in range(tok.vocab_size) if not tok.token_bytes(i) or tok.token_bytes(i)[:1] == b"\xff"}
    for grammar, accepting in ((f'start: <[{tag}]> "x" | "y"', False), (f'start: <[{tag}]>? "x" | ""', True)):
        compiled = Compiled(Constraint.of_grammar(grammar), Vocabulary.of(tok, tok.stop_ids))
        bits = (compiled.first_mask.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = set(bits.flatten()[:tok.vocab_size].nonzero().flatten().tolist())
        assert allowed & silent == {tag} | (set(tok.stop_ids) if accepting else set()), grammar


def _random_reply(compiled: Compiled, tok, rng: random.Random, budget: int = 300, opener: frozenset[int] = frozenset()
                  ) -> tuple[str, bool]:
    """A reply of tokens drawn at random among those the grammar allows, and whether it ended
    within ``budget``; the first token among ``opener`` where the grammar allows some (a call's
    start, which random text seldom takes)."""
    matcher = compiled.matcher()
    mask = torch.zeros(compiled.words, dtype=torch.int32)
    stops = set(compiled.vocabulary.stop_ids)
    out = []
    for _ in range(budget):
        compiled.fill_mask(matcher, mask)
        bits = (mask.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten()[:compiled.vocabulary.size].nonzero().flatten().tolist()
        opening = [t for t in allowed if not out and t in opener]
        token = rng.choice(opening or allowed)
        if token in stops:
            break
        assert matcher.consume_token(token), tok.token_bytes(token)
        out.append(token)
        if matcher.is_stopped():
            break
    else:
        return b"".join(tok.token_bytes(t) for t in out).decode("utf-8", "replace"), False
    return b"".join(tok.token_bytes(t) for t in out).decode("utf-8", "replace"), True


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("mode", ["auto", "required"])
def test_any_reply_the_grammar_allows_reads_the_same_in_any_pieces(tmp_path, family, mode):
    """Replies drawn at random within each format's grammar: read whole or in random pieces, the
    content and every call's arguments are the same, the arguments fit their tool's schema, and
    no call markup is content."""
    from tool_builders import write_tokenizer
    write_tokenizer(tmp_path, family)
    tok = load_tokenizer(tmp_path)
    fmt = FORMATS[family]
    tools = tuple(make_tool(t["function"]["name"], None, t["function"].get("parameters"), "t") for t in TOOLS)
    grammar = tool_grammar(fmt, ToolRequest(tools, ToolChoice(mode)), tok.special_tokens)
    compiled = Compiled(grammar, Vocabulary.of(tok, tok.stop_ids))
    start = {"hermes": b"<tool_call>", "llama3_json": b"{", "mistral": b"[", "generic": b"{"}[family]
    openers = frozenset(i for i in range(tok.vocab_size) if tok.token_bytes(i).startswith(start)) | {
        tok.special_tokens[name] for name in ("[TOOL_CALLS]", "<|python_tag|>") if name in tok.special_tokens}
    calls_seen = 0
    for seed in range(40):
        rng = random.Random(seed)
        text, ended = _random_reply(compiled, tok, rng, opener=openers if seed % 2 else frozenset())
        whole = ToolStream(fmt, call_id, [t.name for t in tools])
        whole.feed(text)
        whole.finish()
        pieces = ToolStream(fmt, call_id, [t.name for t in tools])
        deltas, at = [], 0
        while at < len(text):
            size = rng.randint(1, 6)
            deltas += pieces.feed(text[at:at + size])
            at += size
        deltas += pieces.finish()
        arguments: dict[int, str] = {}
        for d in deltas:
            if d.index is not None:
                arguments[d.index] = arguments.get(d.index, "") + d.arguments
        calls = whole.tool_calls()
        assert [c.arguments for c in calls] == [arguments[i] for i in range(len(calls))], text
        assert "".join(d.content for d in deltas) == (whole.text() or "") and pieces.text() == whole.text()
        for call in calls if ended else calls[:-1]:  # a reply cut short: its last call too
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        if mode == "required":
            assert calls and whole.text() is None, text
        if calls and family != "hermes":
            assert whole.text() is None
        calls_seen += len(calls)
    assert calls_seen


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
def test_templates_render_tools_and_results_as_transformers_does(tmp_path, family):
    model_dir = tmp_path / family
    from tool_builders import write_tokenizer
    write_tokenizer(model_dir, family)
    tok = load_tokenizer(model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    ours = HFTemplateChatFormat(config["chat_template"], tok, bos_token=config["bos_token"],
                                eos_token=config["eos_token"])
    messages = _round_trip_messages("abcDEF123", {"city": "Paris", "days": 3})
    reference = hf_tokenizer(model_dir).apply_chat_template([m.as_dict() for m in messages], tools=TOOLS,
                                                             tokenize=False, add_generation_prompt=True)
    assert ours.render(messages, tools=TOOLS) == reference
    assert "get_weather" in reference and "sunny" in reference


def _round_trip_messages(id: str, arguments) -> list[Message]:
    from llama_chat.model.chat_format import CalledTool

    return [Message("user", ASK[0]["content"]),
            Message("assistant", "", (CalledTool(id, "get_weather", arguments),)),
            Message("tool", '{"forecast": "sunny", "high": 24}', tool_call_id=id)]


# -- a server per format -----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    family = request.param
    model_dir = build_tool_model(tmp_path_factory.mktemp(family), family)
    server = start_server(model_dir, "--template", "hf", "--max-batch", "16", "--queue-limit", "64")
    yield family, server, model_dir
    assert stop_server(server) == 0, server.log()


def _check_calls(calls, where) -> None:
    assert calls, where
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(chunks) -> dict[int, dict]:
    """Each choice of a stream put together: content, calls (id and name from their first piece
    only, arguments concatenated), finish reason."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            got = out.setdefault(choice.index, {"content": "", "calls": {}, "finish": None})
            got["content"] += choice.delta.content or ""
            for piece in choice.delta.tool_calls or ():
                call = got["calls"].get(piece.index)
                if call is None:
                    assert piece.id and piece.type == "function" and piece.function.name, piece
                    got["calls"][piece.index] = {"id": piece.id, "name": piece.function.name,
                                                 "arguments": piece.function.arguments or ""}
                else:
                    assert piece.id is None and piece.function.name is None, piece
                    call["arguments"] += piece.function.arguments or ""
            if choice.finish_reason:
                got["finish"] = choice.finish_reason
    return out


@pytest.mark.slow
def test_required_gives_calls_that_fit_their_schema_60_of_60_whole_and_streamed(served):
    family, server, model_dir = served
    client = server.client()
    ids = set()
    # One call a reply: a random model that prefers the way on to another call over the way out
    # would make calls until its budget ends (parallel calls: the next test). 30 whole replies,
    # then 30 streamed, in each format (80 replies a format drawn within its grammar are checked
    # against the schemas without a server: test_any_reply_the_grammar_allows_reads_the_same...).
    for seed in (11,):
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=ASK, tools=TOOLS, tool_choice="required",
                                               n=30, max_tokens=200, seed=seed, parallel_tool_calls=False)
        assert reply.model == model_dir.name  # any name is answered by the one model served, which it names
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
            _check_calls(choice.message.tool_calls, choice)
            ids.update(c.id for c in choice.message.tool_calls)
            if family == "mistral":
                assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)
    assert len(ids) >= 30  # every call its own id
    for seed in (13,):
        chunks = client.chat.completions.create(model="gpt-4o-mini", messages=ASK, tools=TOOLS, n=30, seed=seed,
                                                tool_choice="required", max_tokens=200, stream=True,
                                                parallel_tool_calls=False)
        choices = _streamed(chunks)
        assert len(choices) == 30
        for got in choices.values():
            assert got["finish"] == "tool_calls" and got["content"] == "", got
            assert got["calls"]
            for call in got["calls"].values():
                jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_streamed_arguments_are_the_whole_replys_byte_for_byte(served):
    family, server, _ = served
    client = server.client()
    for seed in range(4):
        kwargs = dict(model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=400, seed=seed)
        whole = client.chat.completions.create(**kwargs).choices[0]
        streamed = _streamed(client.chat.completions.create(**kwargs, stream=True))[0]
        assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == \
               [(c["name"], c["arguments"]) for c in streamed["calls"].values()]
        assert streamed["finish"] == whole.finish_reason == "tool_calls"


def test_auto_replies_are_text_or_calls_and_no_markup_is_content(served):
    family, server, _ = served
    chunks = server.client().chat.completions.create(model="m", messages=ASK, tools=TOOLS, n=16, seed=5,
                                                     max_tokens=60, stream=True)
    for got in _streamed(chunks).values():
        # Free text may hold anything but the start of a call.
        assert "<tool_call>" not in got["content"] and not got["content"].startswith(CALL_STARTS[family]), got
        if got["calls"]:
            assert got["finish"] in ("tool_calls", "length")
            for call in got["calls"].values():
                if got["finish"] == "tool_calls":
                    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        else:
            assert got["finish"] in ("stop", "length")


def test_parallel_calls_and_a_named_function(served):
    family, server, _ = served
    client = server.client()
    # Hot, so that the random model takes the way on to a second call as often as the way out.
    reply = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", n=16,
                                           seed=3, max_tokens=400, temperature=3.0)
    counts = [len(c.message.tool_calls) for c in reply.choices if c.finish_reason == "tool_calls"]
    for choice in reply.choices:
        if choice.finish_reason == "tool_calls":
            _check_calls(choice.message.tool_calls, choice)
    if FORMATS[family].parallel:
        assert max(counts) >= 2, counts
        assert len({c.id for ch in reply.choices for c in ch.message.tool_calls or ()}) == sum(
            len(ch.message.tool_calls or ()) for ch in reply.choices)
    else:
        assert set(counts) == {1}
    single = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", n=8,
                                            seed=3, max_tokens=300, parallel_tool_calls=False)
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)
    named = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, n=8, seed=4, max_tokens=100,
                                           tool_choice={"type": "function", "function": {"name": "set_alarm"}})
    for choice in named.choices:
        assert [c.function.name for c in choice.message.tool_calls] == ["set_alarm"]
        _check_calls(choice.message.tool_calls, choice)


def test_logprobs_beside_tools(served):
    family, server, _ = served
    client = server.client()
    whole = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=100, seed=2, logprobs=True, top_logprobs=2)
    choice = whole.choices[0]
    assert choice.logprobs.content
    assert whole.usage.completion_tokens - 1 <= len(choice.logprobs.content) <= whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                                 max_tokens=100, seed=2, logprobs=True, stream=True,
                                                 stream_options={"include_usage": True}))
    taken = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in taken] == [t.token for t in choice.logprobs.content]


def test_a_round_trip_renders_as_transformers_does(served):
    """A call, its result, then the answer: the second prompt is the template's rendering of the
    whole exchange, token for token the one transformers makes."""
    family, server, model_dir = served
    if family == "generic":
        pytest.skip("the generic format's template is not a real one")
    client = server.client()
    first = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=100, seed=1,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny", "high": 24}'}]
    answer = client.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, seed=1)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content is not None
    messages = _round_trip_messages(call.id, json.loads(call.function.arguments))
    reference = hf_tokenizer(model_dir).apply_chat_template([m.as_dict() for m in messages], tokenize=True,
                                                             add_generation_prompt=True)
    ids = reference["input_ids"] if isinstance(reference, dict) or hasattr(reference, "keys") else reference
    # tool_choice none: the tools are not offered to the model, so the reference renders none either.
    assert answer.usage.prompt_tokens == len(ids)
    again = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=8, seed=1)
    with_tools = hf_tokenizer(model_dir).apply_chat_template([m.as_dict() for m in messages], tools=TOOLS,
                                                              tokenize=True, add_generation_prompt=True)
    with_tools = with_tools["input_ids"] if hasattr(with_tools, "keys") else with_tools
    assert again.usage.prompt_tokens == len(with_tools)


def test_bad_tools_are_refused_with_one_clear_reason(served):
    family, server, _ = served
    if family != "hermes":
        pytest.skip("the same checks for every format: one server is enough")
    client = server.client()

    def refused(**kwargs) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", max_tokens=4, **{"messages": ASK, **kwargs})
        assert info.value.status_code == 400 and "\n" not in info.value.message
        return info.value

    bad_schema = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"key": {"$ref": "#/$defs/missing"}}}}}]
    e = refused(tools=bad_schema)
    assert "lookup" in e.message and "missing" in e.message and e.param == "tools[0].function.parameters"
    e = refused(tools=[{"type": "function", "function": {"name": "no spaces allowed"}}])
    assert "^[a-zA-Z0-9_-]{1,64}$" in e.message
    refused(tools=[{"type": "function", "function": {"name": "x" * 65}}])
    e = refused(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "launch"}})
    assert "launch" in e.message and e.param == "tool_choice"
    e = refused(messages=[*ASK, {"role": "tool", "tool_call_id": "call_nobody", "content": "42"}])
    assert "call_nobody" in e.message
    refused(tool_choice="required")
    refused(tools=TOOLS, tool_choice="sometimes")
    refused(tools=[*TOOLS, TOOLS[0]])
    refused(tools=TOOLS, response_format={"type": "json_object"})
    refused(messages=[*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ping", "arguments": "{not json"}}]}])


def test_an_unbounded_integer_in_response_format_ends(served):
    family, server, _ = served
    if family != "hermes":
        pytest.skip("not about tools: one server is enough")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    reply = server.client().chat.completions.create(
        model="m", messages=ASK, n=8, seed=9, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content)
        assert len(str(abs(value["n"]))) <= MAX_INTEGER_DIGITS

"""Thinking models behind ``llama-chat serve``, with the real ``openai`` and ``anthropic`` clients: the
thinking apart from the answer (both fields' names, whole and streamed), off as the template does
it, budgets, constraints after the thinking, history, tags that are plain text, and a remote model
(``-m openai:``) whose server thinks.

The models are random, with Qwen3's template (tags are added tokens) and an R1 distill's (the
prompt opens the thinking), its tags added tokens or plain text. A random model never ends its
thinking by itself, so the servers run with a budget, which forces the end tag."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from cli_support import run_cli
from serve_support import WAIT_S, start_server, stop_server
from tool_builders import build_tool_model, hf_tokenizer

BUDGET = 6
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    model_dir = build_tool_model(tmp_path_factory.mktemp("qwen3"), "qwen3")
    server = start_server(model_dir, "--template", "hf", "--reasoning-budget", str(BUDGET))
    yield server, model_dir
    assert stop_server(server) == 0, server.log()


@pytest.fixture(scope="module")
def r1(tmp_path_factory):
    model_dir = build_tool_model(tmp_path_factory.mktemp("r1"), "r1")
    server = start_server(model_dir, "--template", "hf", "--reasoning-budget", str(BUDGET))
    yield server, model_dir
    assert stop_server(server) == 0, server.log()


@pytest.fixture(scope="module")
def r1_text(tmp_path_factory):
    model_dir = build_tool_model(tmp_path_factory.mktemp("r1_text"), "r1_text")
    server = start_server(model_dir, "--template", "hf", "--reasoning-budget", str(BUDGET))
    yield server, model_dir
    assert stop_server(server) == 0, server.log()


def chat(server, **extra):
    return server.client().chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=24,
                                                   **extra)


def streamed(server, **extra) -> dict:
    """A streamed chat put together: each field's pieces joined, and the pieces themselves."""
    out = {"reasoning_content": [], "reasoning": [], "content": []}
    for chunk in server.client().chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=24,
                                                          stream=True, **extra):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            for name in out:
                if delta.get(name):
                    out[name].append(delta[name])
    return out


def hf_prompt_ids(model_dir, messages, **variables) -> list[int]:
    """The prompt's ids as transformers renders the template and tokenizes its text."""
    tokenizer = hf_tokenizer(model_dir)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **variables)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def raw_split(text: str, *, opened: bool) -> tuple[str, str]:
    """The reply with its tags left in (``reasoning_format`` none), split by hand: (thinking, answer)."""
    if not opened:
        assert text.startswith("<think>"), text
        text = text[len("<think>"):]
    thought, tag, answer = text.partition("</think>")
    assert tag, text
    return thought.strip(), answer.lstrip()


@pytest.mark.parametrize("family", ["qwen3", "r1", "r1_text"])
def test_the_thinking_is_the_text_between_the_tags_and_the_content_the_rest(family, request):
    server, _ = request.getfixturevalue(family)
    raw = chat(server, extra_body={"reasoning_format": "none"}).choices[0].message
    assert not (raw.model_extra or {}).get("reasoning_content")
    thought, answer = raw_split(raw.content, opened=family != "qwen3")  # the R1 template opens it
    reply = chat(server)
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == thought
    assert message.content == answer and "<think>" not in message.content and "</think>" not in message.content
    if family != "r1_text":  # the tags are tokens: exactly the budget's tokens of thinking
        assert reply.usage.completion_tokens_details.reasoning_tokens == BUDGET
    pieces = streamed(server)
    assert "".join(pieces["reasoning_content"]) == "".join(pieces["reasoning"]) == thought
    assert "".join(pieces["content"]) == answer
    assert not any("<" in p and ">" in p for p in pieces["content"] + pieces["reasoning"] if "think" in p)


def test_a_tag_spelled_in_pieces_never_reaches_either_field(r1_text):
    server, _ = r1_text
    raw = streamed(server, extra_body={"reasoning_format": "none"})["content"]
    # The end tag is plain text here: its characters came in pieces of their own.
    at = "".join(raw).index("</think>")
    ends, cut = 0, False
    for piece in raw:
        if ends < at + len("</think>") and ends + len(piece) > at and (ends > at or ends + len(piece) < at + 8):
            cut = True
        ends += len(piece)
    assert cut, raw
    pieces = streamed(server)
    assert all("think>" not in p and "</" not in p for p in pieces["content"] + pieces["reasoning_content"])


@pytest.mark.parametrize("how", [{"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}])
def test_thinking_off_renders_the_prompt_as_transformers_does_and_returns_no_thinking(qwen3, how):
    server, model_dir = qwen3
    ids = hf_prompt_ids(model_dir, MESSAGES, enable_thinking=False)
    off = chat(server, extra_body=how)
    assert off.usage.prompt_tokens == len(ids)
    assert off.choices[0].message.model_extra.get("reasoning_content") is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    same = server.client().completions.create(model="m", prompt=ids, temperature=0, max_tokens=24)
    assert off.choices[0].message.content == same.choices[0].text.lstrip()


def test_a_schema_holds_the_answer_after_the_thinking(qwen3):
    server, _ = qwen3
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}}, "required": ["answer"],
              "additionalProperties": False}
    reply = server.client().chat.completions.create(
        model="m", messages=MESSAGES, temperature=0.7, seed=3, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    message = reply.choices[0].message
    jsonschema.validate(json.loads(message.content), schema)
    assert message.model_extra["reasoning_content"]
    assert reply.usage.completion_tokens_details.reasoning_tokens == BUDGET


def test_a_required_tool_call_follows_the_thinking(qwen3):
    server, _ = qwen3
    reply = server.client().chat.completions.create(model="m", messages=MESSAGES, temperature=0.7, seed=5,
                                                    max_tokens=80, tools=TOOLS, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), WEATHER)
    assert choice.message.model_extra["reasoning_content"]


def test_earlier_thinking_sent_back_renders_as_the_template_does(qwen3):
    server, model_dir = qwen3
    history = [*MESSAGES, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Let me think."},
               {"role": "user", "content": "And tomorrow?"}]
    ids = hf_prompt_ids(model_dir, history)
    reply = server.client().chat.completions.create(model="m", messages=history, temperature=0, max_tokens=4)
    assert reply.usage.prompt_tokens == len(ids)
    inline = [*MESSAGES, {"role": "assistant", "content": "<think>\nLet me think.\n</think>\n\nSunny."},
              {"role": "user", "content": "And tomorrow?"}]
    again = server.client().chat.completions.create(model="m", messages=inline, temperature=0, max_tokens=4)
    assert again.usage.prompt_tokens == len(ids)


def test_anthropic_gets_a_thinking_block_before_the_text_whole_and_streamed(qwen3):
    import anthropic  # on use, as serve_support.Server.anthropic_client

    server, _ = qwen3
    client = server.anthropic_client()
    ask = dict(model="m", max_tokens=30, extra_body={"temperature": 0}, messages=MESSAGES,
               thinking={"type": "enabled", "budget_tokens": 4})
    message = client.messages.create(**ask)
    kinds = [block.type for block in message.content]
    assert kinds[0] == "thinking" and kinds[1:] in (["text"], []), kinds
    thinking = message.content[0]
    assert isinstance(thinking, anthropic.types.ThinkingBlock) and thinking.thinking and thinking.signature
    with client.messages.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == kinds
    assert final.content[0].thinking == thinking.thinking
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and "signature_delta" in deltas
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == thinking.thinking
    off = client.messages.create(**{**ask, "thinking": {"type": "disabled"}})
    assert all(block.type != "thinking" for block in off.content)


@pytest.mark.parametrize("extra, words", [
    ({"reasoning_budget": -1}, "reasoning_budget must be an integer in 0 <= n"),
    ({"reasoning_budget": "8"}, "reasoning_budget must be an integer"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort must be one of none, minimal"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "enable_thinking must be true or false"),
    ({"chat_template_kwargs": {"messages": []}}, "messages is set by the server"),
    ({"reasoning_format": "raw"}, "reasoning_format must be one of deepseek, none"),
])
def test_bad_thinking_controls_are_refused_in_one_line(qwen3, extra, words):
    server, _ = qwen3
    with pytest.raises(openai.BadRequestError) as refused:
        chat(server, extra_body=extra)
    assert words in refused.value.body["message"]


def test_anthropic_refuses_a_budget_at_or_above_max_tokens(qwen3):
    import anthropic  # on use, as serve_support.Server.anthropic_client

    server, _ = qwen3
    client = server.anthropic_client()
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="m", max_tokens=16, messages=MESSAGES,
                               thinking={"type": "enabled", "budget_tokens": 16})
    assert "budget_tokens must be less than max_tokens" in str(refused.value)


def test_a_remote_thinking_model_thinks_as_a_local_one(qwen3):
    server, _ = qwen3
    local = chat(server).choices[0].message
    done = run_cli("-m", f"openai:{server.url}/v1", "-p", MESSAGES[0]["content"], "-t", "0", "-n", "24", "--json",
                   timeout=WAIT_S * 2)
    assert done.returncode == 0, done.stderr.decode()
    record = json.loads(done.stdout)
    assert record["reasoning"] == local.model_extra["reasoning_content"]
    assert record["text"] == local.content

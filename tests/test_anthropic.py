"""Anthropic's Messages API (``POST /v1/messages``) on ``llama-chat serve``, driven by Anthropic's own
client: text and tool_use/tool_result blocks, ``system``, the sampling controls and stop sequences,
the stream's events, the error shape, and both ways of sending the key. One server, a tiny model
with Qwen 2.5's template (its tool calls: the Hermes format)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import httpx
import jsonschema
import pytest

from serve_support import WAIT_S, start_server, stop_server
from tool_builders import build_tool_model

if TYPE_CHECKING:
    import anthropic

KEY = "anthropic-test-key"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "days"]}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
EVENT_ORDER = ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
               "message_stop")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tool_model(tmp_path_factory.mktemp("anthropic"), "hermes")
    s = start_server(model_dir, "--template", "hf", "--max-batch", "4", LLAMA_CHAT_API_KEY=KEY)
    yield s
    assert stop_server(s) == 0, s.log()


def sdk():
    """Anthropic's client library, imported by the worker that runs these tests only (it takes
    seconds to import, and every worker imports every test module)."""
    import anthropic

    return anthropic


def client(server, key: str = KEY) -> anthropic.Anthropic:
    return sdk().Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=WAIT_S)


def events_of(server, **body) -> list[tuple[str, dict]]:
    """A stream's events as they are on the wire: ``event: NAME`` and ``data: {...}`` each."""
    response = httpx.post(f"{server.url}/v1/messages", json={**body, "stream": True}, headers={"x-api-key": KEY},
                          timeout=WAIT_S)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in response.text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == name.removeprefix("event: ")
        out.append((payload["type"], payload))
    return out


def test_text_whole_and_streamed_say_the_same(server):
    body = dict(model="any-model-name", max_tokens=12, system="Be brief.", messages=ASK,
                extra_body={"temperature": 0})
    whole = client(server).messages.create(**body)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "anthropic0"
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    assert [b.type for b in whole.content] == ["text"]
    with client(server).messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.usage.input_tokens == whole.usage.input_tokens and final.stop_reason == "max_tokens"

    events = events_of(server, model="m", max_tokens=12, system="Be brief.", messages=ASK, temperature=0)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]] == list(EVENT_ORDER)
    assert events[0][1]["message"]["usage"]["input_tokens"] == whole.usage.input_tokens
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens" and events[-2][1]["usage"]["output_tokens"] == 12


def test_stop_sequences_and_the_sampling_controls(server):
    body = dict(model="m", max_tokens=24, messages=ASK, extra_body={"temperature": 0, "top_k": 40, "top_p": 0.9})
    text = client(server).messages.create(**body).content[0].text
    stop = text[6:8]
    cut = client(server).messages.create(**body, stop_sequences=["\u2603 never", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_tool_use_blocks_fit_the_schema_whole_and_streamed(server):
    c = client(server)
    for seed in range(6):
        body = dict(model="m", max_tokens=200, messages=ASK, tools=TOOLS, tool_choice={"type": "any"},
                    extra_body={"seed": seed})
        whole = c.messages.create(**body)
        assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["tool_use"]
        jsonschema.validate(whole.content[0].input, WEATHER)
        assert whole.content[0].id.startswith("toolu_") and whole.content[0].name == "get_weather"
        events = events_of(server, **{k: v for k, v in body.items() if k != "extra_body"}, seed=seed)
        starts = [e for name, e in events if name == "content_block_start"]
        assert [s["content_block"]["type"] for s in starts] == ["tool_use"]
        partial = "".join(e["delta"]["partial_json"] for name, e in events if name == "content_block_delta")
        assert json.loads(partial) == whole.content[0].input
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_a_round_trip_with_tool_result_blocks(server):
    c = client(server)
    first = c.messages.create(model="m", max_tokens=200, messages=ASK, tools=TOOLS,
                              tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"seed": 1})
    use = first.content[0]
    history = [*ASK, {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": "sunny, 24 C"}]},
                                            {"type": "text", "text": "So?"}]}]
    # Seeded, both: a random model's unseeded reply may end within its 8 tokens.
    answer = c.messages.create(model="m", max_tokens=8, messages=history, tools=TOOLS, tool_choice={"type": "none"},
                               extra_body={"seed": 3})
    assert answer.content[0].type == "text" and answer.stop_reason == "max_tokens"
    # With the tools offered again, the prompt is the first one and the call and result after it.
    again = c.messages.create(model="m", max_tokens=8, messages=history, tools=TOOLS)
    assert again.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_keys_and_errors_in_anthropics_shape(server):
    response = httpx.post(f"{server.url}/v1/messages", json={"model": "m", "max_tokens": 2, "messages": ASK},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT_S)
    assert response.status_code == 200 and response.json()["type"] == "message"
    with pytest.raises(sdk().AuthenticationError) as info:
        client(server, "wrong").messages.create(model="m", max_tokens=2, messages=ASK)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "authentication_error"

    def refused(**body) -> str:
        with pytest.raises(sdk().BadRequestError) as info:
            client(server).messages.create(**{"model": "m", "max_tokens": 4, "messages": ASK, **body})
        error = info.value.body
        assert set(error) == {"type", "error"} and error["error"]["type"] == "invalid_request_error"
        assert "\n" not in error["error"]["message"]
        return error["error"]["message"]

    assert "lookup" in refused(tools=[{"name": "lookup", "input_schema": {
        "type": "object", "properties": {"k": {"$ref": "#/$defs/nowhere"}}}}])
    assert "^[a-zA-Z0-9_-]{1,64}$" in refused(tools=[{"name": "two words", "input_schema": {"type": "object"}}])
    assert "toolu_nobody" in refused(messages=[*ASK, {"role": "assistant", "content": "ok"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nobody", "content": "42"}]}])
    assert "launch" in refused(tools=TOOLS, tool_choice={"type": "tool", "name": "launch"})
    assert "image" in refused(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    response = httpx.post(f"{server.url}/v1/messages", json={"model": "m", "messages": ASK},
                          headers={"x-api-key": KEY}, timeout=WAIT_S)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in response.json()["error"]["message"]

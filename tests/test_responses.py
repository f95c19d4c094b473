"""OpenAI's Responses API on ``llama-chat serve``, with the real ``openai`` client: output text and
items, the typed stream in order, a JSON schema, a tool round trip through ``function_call_output``,
``previous_response_id`` with retrieve and delete, the same answers as Chat Completions and
Messages, and bad input refused in OpenAI's shape (a tiny random Qwen3-style model that thinks
within a budget, and calls tools in Qwen's format)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from serve_support import WAIT_S, start_server, stop_server
from tool_builders import build_tool_model

QUESTION = "What is the weather in Paris?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather", "parameters": WEATHER}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tool_model(tmp_path_factory.mktemp("qwen3"), "qwen3")
    served = start_server(model_dir, "--template", "hf", "--reasoning-budget", "4", "--store-responses", "3")
    yield served
    assert stop_server(served) == 0, served.log()


def create(server, **kwargs):
    ask = {"model": "m", "input": QUESTION, "temperature": 0, "max_output_tokens": 24, **kwargs}
    return server.client().responses.create(**ask)


def test_output_text_and_items_and_usage(server):
    done = create(server)
    assert done.object == "response" and done.id.startswith("resp_")
    assert [item.type for item in done.output] == ["reasoning", "message"]
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text == done.output[1].content[0].text
    assert done.output[0].content[0].text  # the thinking, apart
    assert done.usage.output_tokens == 24 and done.usage.output_tokens_details.reasoning_tokens == 4
    short = create(server, max_output_tokens=200, extra_body={"logit_bias": {}})
    assert short.status in ("completed", "incomplete")


def test_the_stream_is_openais_typed_events_in_order_and_joins_to_the_response(server):
    whole = create(server)
    events = list(create(server, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    message = types.index("response.content_part.added")
    assert types[message - 1] == "response.output_item.added"
    assert types[types.index("response.output_text.done"):][:3] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    assert thought == final.output[0].content[0].text == whole.output[0].content[0].text


def test_a_json_schema_format_validates(server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}},
              "required": ["answer"], "additionalProperties": False}
    done = create(server, temperature=0.7, extra_body={"seed": 2}, max_output_tokens=80,
                  text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(done.output_text), schema)


def test_a_tool_round_trip_through_function_call_output(server):
    first = create(server, tools=[TOOL], tool_choice="required", temperature=0.7, extra_body={"seed": 4},
                   max_output_tokens=80)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    streamed = list(create(server, tools=[TOOL], tool_choice="required", temperature=0.7, extra_body={"seed": 4},
                           max_output_tokens=80, stream=True))
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert arguments == calls[0].arguments
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}
    # The whole conversation sent again, items and all ...
    again = create(server, input=[{"role": "user", "content": QUESTION}, *[i.model_dump() for i in first.output],
                                  result], tools=[TOOL])
    # ... or continued from the stored response.
    continued = create(server, previous_response_id=first.id, input=[result], tools=[TOOL])
    assert again.output_text == continued.output_text
    assert again.usage.input_tokens == continued.usage.input_tokens > first.usage.input_tokens


def test_previous_response_id_retrieve_delete_and_eviction(server):
    client = server.client()
    first = create(server)
    second = create(server, previous_response_id=first.id, input="And tomorrow?")
    assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.input_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        create(server, previous_response_id=first.id, input="again")
    assert gone.value.body["param"] == "previous_response_id"
    kept = [create(server).id for _ in range(4)]  # --store-responses 3: the oldest is evicted
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept[0])
    assert client.responses.retrieve(kept[-1]).id == kept[-1]
    unstored = create(server, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_same_answer_on_every_route(server):
    chat = server.client().chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}],
                                                   temperature=0, max_tokens=24)
    response = create(server)
    messages = server.anthropic_client().messages.create(
        model="m", max_tokens=24, messages=[{"role": "user", "content": QUESTION}], extra_body={"temperature": 0})
    assert response.output_text == chat.choices[0].message.content == messages.content[-1].text
    assert response.usage.input_tokens == chat.usage.prompt_tokens == messages.usage.input_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == messages.usage.output_tokens


@pytest.mark.parametrize("body, words", [
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input[0].type 'image_generation_call' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "only text parts are supported, got 'input_image'"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role must be one of user"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
     "a tool result for 'call_x', which no earlier assistant message called"),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
     "tool_choice: the built-in tool 'web_search' is not available"),
    ({"tools": [{"type": "calculator"}]}, "tools[0].type must be function, got 'calculator'"),
    ({"text": {"format": {"type": "json_schema", "schema": "no"}}}, "text.format.schema must be a JSON schema"),
    ({"max_output_tokens": 0}, "max_output_tokens must be at least 1"),
    ({"input": 7}, "input must be a string or a non-empty list of items"),
    ({"background": True}, "background responses are not supported"),
    ({"frobnicate": 1}, "unrecognized request argument: frobnicate"),
])
def test_bad_input_is_a_400_in_openais_shape(server, body, words):
    response = httpx.post(f"{server.url}/v1/responses", json={"model": "m", "input": "hi", **body}, timeout=WAIT_S)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert create(server, max_output_tokens=2).status == "incomplete"  # nothing else disturbed


def test_every_route_renders_the_same_tools_the_same_way(server):
    ask = [{"role": "user", "content": QUESTION}]
    chat = server.client().chat.completions.create(
        model="m", messages=ask, max_tokens=1, tools=[{"type": "function", "function": {
            "name": "get_weather", "description": "The weather", "parameters": WEATHER}}])
    response = create(server, max_output_tokens=1, tools=[TOOL])
    messages = server.anthropic_client().messages.create(
        model="m", max_tokens=1, messages=ask,
        tools=[{"name": "get_weather", "description": "The weather", "input_schema": WEATHER}])
    assert chat.usage.prompt_tokens == response.usage.input_tokens == messages.usage.input_tokens

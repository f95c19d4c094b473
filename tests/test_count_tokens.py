"""Counting and templating on ``llama-chat serve``: Anthropic's ``messages.count_tokens`` (the real
``anthropic`` client) against the prompt tokens ``messages.create`` reports for the same request,
tools and thinking included; llama-server's ``/tokenize`` (with pieces) and ``/detokenize`` round
trip; ``/apply-template`` against transformers' rendering of the same template.

One server: a random model with Qwen3's template (tools, and enable_thinking) under a reasoning budget."""

from __future__ import annotations

import httpx
import pytest

from serve_support import WAIT_S, start_server, stop_server
from tool_builders import build_tool_model, hf_tokenizer

BUDGET = 6
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city", "days"]}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                  "parameters": WEATHER}}]
ROUND_TRIP = [*ASK, {"role": "assistant", "content": [
    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 2}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = build_tool_model(tmp_path_factory.mktemp("count_tokens"), "qwen3")
    server = start_server(model_dir, "--template", "hf", "--reasoning-budget", str(BUDGET))
    yield server, model_dir
    assert stop_server(server) == 0, server.log()


def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=WAIT_S)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=WAIT_S)


REQUESTS = {
    "plain": {"messages": ASK},
    "system": {"messages": ASK, "system": "You are terse."},
    "tools": {"messages": ASK, "tools": TOOLS},
    "tools not offered": {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "none"}},
    "round trip": {"messages": ROUND_TRIP, "tools": TOOLS},
    "thinking off": {"messages": ASK, "thinking": {"type": "disabled"}},
    "thinking on": {"messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 4}},
}


def test_count_tokens_is_what_create_reports(served):
    server, _ = served
    client = anthropic_client(server)
    counts = {}
    for name, body in REQUESTS.items():
        counted = client.messages.count_tokens(model="m", **body).input_tokens
        created = client.messages.create(model="m", max_tokens=8, **body)
        assert counted == created.usage.input_tokens, name
        counts[name] = counted
    # Each part of the request is in the count: the system message, the tools as the template
    # writes them (not when tool_choice is none), the call and its result, thinking switched off.
    assert counts["system"] > counts["plain"] and counts["tools"] > counts["plain"]
    assert counts["tools not offered"] == counts["plain"] and counts["round trip"] > counts["tools"]
    assert counts["thinking off"] > counts["thinking on"] == counts["plain"]


def test_count_tokens_refuses_in_anthropics_shape(served):
    import anthropic

    server, _ = served
    client = anthropic_client(server)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model="m", messages=ASK, extra_body={"max_tokens": 5})
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model="m", messages=[*ASK, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nobody", "content": "42"}]}])
    assert "toolu_nobody" in e.value.body["error"]["message"]


def test_tokenize_with_pieces_and_detokenize_round_trip(served):
    server, model_dir = served
    text = "Héllo, wörld! 👋 naïve <|im_start|>user\n{\"a\": [1, 2]}"
    tokens = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    ids = [t["id"] for t in tokens]
    # The tokenizer transformers reads from the same files, special names read as their tokens.
    assert ids == hf_tokenizer(model_dir)(text, add_special_tokens=False)["input_ids"]
    pieces = b"".join(t["piece"].encode() if isinstance(t["piece"], str) else bytes(t["piece"]) for t in tokens)
    assert pieces == text.encode()
    assert any(t["piece"] == "<|im_start|>" for t in tokens)
    assert post(server, "/tokenize", {"content": text}).json()["tokens"] == ids
    assert post(server, "/detokenize", {"tokens": ids}).json()["content"] == text
    # Special names as plain text: spelled in pieces of their own, no special token.
    as_text = post(server, "/tokenize", {"content": "<|im_start|>", "parse_special": False}).json()["tokens"]
    assert len(as_text) > 1 and post(server, "/detokenize", {"tokens": as_text}).json()["content"] == "<|im_start|>"


def test_apply_template_is_the_chat_routes_prompt(served):
    import openai

    server, model_dir = served
    reference = hf_tokenizer(model_dir)
    messages = [{"role": "system", "content": "You are terse."}, *ASK]
    for extra, variables in (({}, {}), ({"reasoning_effort": "none"}, {"enable_thinking": False}),
                             ({"tools": OPENAI_TOOLS}, {"tools": OPENAI_TOOLS})):
        prompt = post(server, "/apply-template", {"messages": messages, **extra}).json()["prompt"]
        assert prompt == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                       **variables)
        ids = post(server, "/tokenize", {"content": prompt}).json()["tokens"]
        chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)
        reply = chat.chat.completions.create(model="m", messages=messages, max_tokens=2, temperature=0, **extra)
        assert reply.usage.prompt_tokens == len(ids)


def test_bad_inputs_are_400s(served):
    server, _ = served
    for path, body, field in (("/tokenize", {"content": 5}, "content"),
                              ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
                              ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/apply-template", {"messages": []}, "messages"),
                              ("/apply-template", {"messages": ASK, "temperature": "hot"}, "temperature")):
        response = post(server, path, body)
        assert response.status_code == 400, (path, response.text)
        assert field in response.json()["error"]["message"], response.text
    assert httpx.get(f"{server.url}/health", timeout=WAIT_S).status_code == 200

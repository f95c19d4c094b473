"""Ollama's own API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``) on ``llama-chat serve``, driven by the ``ollama`` package's client: whole and
streamed replies that say the same, a thinking model's thinking apart from its answer, tools and
their round trip, ``format`` as a schema, the same reply as Chat Completions, the options checked
into Ollama's error shape, the key, and /metrics.

One server: a random model with Qwen3's template (its tags are added tokens; its tool calls the
Hermes format) under a reasoning budget, since a random model never ends its thinking by itself."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from serve_support import WAIT_S, start_server, stop_server
from tool_builders import build_tool_model

KEY = "ollama-test-key"
BUDGET = 6
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "num_predict": 16}
# Enums and required fields only: the client's tool model keeps no other schema keywords.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}}]
ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("ollama") / "qwen3"  # the name the server lists
    model_dir.mkdir()
    build_tool_model(model_dir, "qwen3")
    s = start_server(model_dir, "--template", "hf", "--reasoning-budget", str(BUDGET), LLAMA_CHAT_API_KEY=KEY)
    yield s
    assert stop_server(s) == 0, s.log()


def client(server, key: str = KEY):
    import ollama

    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=WAIT_S)


def joined(parts) -> dict:
    """A streamed reply put together: each field's pieces joined, the calls, and the last part."""
    out = {"content": "", "thinking": "", "tool_calls": [], "last": None, "pieces": 0}
    for part in parts:
        assert out["last"] is None, "a part after the one marked done"
        message = part.message
        out["content"] += message.content or ""
        out["thinking"] += message.thinking or ""
        out["tool_calls"] += message.tool_calls or []
        out["pieces"] += 1
        if part.done:
            out["last"] = part
    assert out["last"] is not None, "no part marked done"
    return out


def test_the_model_routes(server):
    c = client(server)
    [listed] = c.list().models
    assert listed.model == "qwen3" and listed.size > 0 and len(listed.digest) == 64
    assert listed.details.format == "hf" and listed.details.parameter_size.endswith("M")
    shown = c.show("qwen3:latest")
    assert set(shown.capabilities) == {"completion", "tools", "thinking"}
    assert shown.modelinfo["llama.context_length"] == 4096 and shown.modelinfo["general.architecture"] == "llama"
    assert "enable_thinking" in shown.template  # the model's own chat template
    [running] = c.ps().models
    assert running.model == "qwen3" and running.context_length == 4096 and running.size_vram == 0
    version = httpx.get(f"{server.url}/api/version", headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT_S)
    assert version.status_code == 200 and version.json()["version"].count(".") == 2


def test_chat_whole_and_streamed_say_the_same(server):
    c = client(server)
    whole = c.chat(model="qwen3", messages=ASK, stream=False, options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert whole.prompt_eval_count > 0 and 0 < whole.eval_count <= GREEDY["num_predict"]
    assert whole.total_duration >= whole.prompt_eval_duration >= 0 and whole.eval_duration >= 0
    streamed = joined(c.chat(model="qwen3", messages=ASK, stream=True, options=GREEDY))
    last = streamed["last"]
    assert streamed["content"] == whole.message.content and streamed["thinking"] == whole.message.thinking
    assert (last.done_reason, last.eval_count, last.prompt_eval_count) == \
           (whole.done_reason, whole.eval_count, whole.prompt_eval_count)
    assert streamed["pieces"] > 2


def test_a_request_with_no_prompt_loads_the_model(server):
    c = client(server)
    loaded = c.generate(model="qwen3")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    [streamed] = list(c.chat(model="qwen3", messages=[], stream=True))
    assert streamed.done and streamed.done_reason == "load" and streamed.message.content == ""


def test_logprobs_whole_and_streamed(server):
    c = client(server)
    asked = dict(model="qwen3", messages=ASK, think=False, logprobs=True, top_logprobs=2, options=GREEDY)
    whole = c.chat(**asked, stream=False)
    assert len(whole.logprobs) == whole.eval_count - (whole.done_reason == "stop")  # the end token has none
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
               for entry in whole.logprobs)
    streamed = [entry for part in c.chat(**asked, stream=True) for entry in part.logprobs or ()]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.logprobs]
    raw = c.generate(model="qwen3", prompt="Once upon a time", raw=True, logprobs=True, stream=False, options=GREEDY)
    assert len(raw.logprobs) == raw.eval_count - (raw.done_reason == "stop")
    assert all(entry.logprob <= 0 for entry in raw.logprobs)


def test_thinking_apart_from_the_answer_and_off(server):
    c = client(server)
    on = c.chat(model="qwen3", messages=ASK, think=True, stream=False, options=GREEDY)
    assert on.message.thinking and "<think>" not in on.message.content and "</think>" not in on.message.content
    off = c.chat(model="qwen3", messages=ASK, think=False, stream=False, options=GREEDY)
    assert not off.message.thinking
    # Off is the template's own way: an empty think block in the prompt.
    assert off.prompt_eval_count > on.prompt_eval_count
    level = c.chat(model="qwen3", messages=ASK, think="low", stream=False, options=GREEDY)
    assert level.message.thinking == on.message.thinking
    generated = c.generate(model="qwen3", prompt=ASK[0]["content"], think=True, stream=False, options=GREEDY)
    assert generated.thinking and generated.response == on.message.content


def test_the_same_reply_as_chat_completions_and_messages(server):
    import anthropic
    import openai

    openai_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=WAIT_S)
    completion = openai_client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=16)
    ollama_reply = client(server).chat(model="qwen3", messages=ASK, stream=False, options=GREEDY)
    message = completion.choices[0].message
    assert ollama_reply.message.content == message.content
    assert ollama_reply.message.thinking == message.model_dump()["reasoning_content"]
    assert (ollama_reply.prompt_eval_count, ollama_reply.eval_count) == \
           (completion.usage.prompt_tokens, completion.usage.completion_tokens)
    anthropic_client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=WAIT_S)
    reply = anthropic_client.messages.create(model="m", messages=ASK, max_tokens=16, extra_body={"temperature": 0})
    blocks = {block.type: block for block in reply.content}
    assert blocks["text"].text == ollama_reply.message.content
    assert blocks["thinking"].thinking == ollama_reply.message.thinking
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == \
           (ollama_reply.prompt_eval_count, ollama_reply.eval_count)


def test_tool_calls_and_their_round_trip(server):
    c = client(server)
    [opener] = httpx.post(f"{server.url}/tokenize", json={"content": "<tool_call>"},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT_S).json()["tokens"]
    # A random model rarely opens a call by itself: the opening is favoured, the rest is its own.
    options = {"temperature": 1.0, "seed": 3, "num_predict": 120, "logit_bias": {str(opener): 100}}
    whole = c.chat(model="qwen3", messages=ASK, tools=TOOLS, think=False, stream=False, options=options)
    calls = whole.message.tool_calls
    assert calls and whole.done_reason == "stop", whole
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(dict(call.function.arguments), WEATHER)
    streamed = joined(c.chat(model="qwen3", messages=ASK, tools=TOOLS, think=False, stream=True, options=options))
    assert [(t.function.name, dict(t.function.arguments)) for t in streamed["tool_calls"]] == \
           [(t.function.name, dict(t.function.arguments)) for t in calls]
    assert streamed["content"] == whole.message.content
    # The results go back with the tool's name, Ollama's only link between a call and its result.
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [t.model_dump() for t in calls]},
               *({"role": "tool", "tool_name": "get_weather", "content": "sunny, 21 degrees"} for _ in calls)]
    answer = c.chat(model="qwen3", messages=history, tools=TOOLS, think=False, stream=False, options=GREEDY)
    assert answer.prompt_eval_count > whole.prompt_eval_count and answer.eval_count > 0
    import ollama

    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="qwen3", messages=[*ASK, {"role": "tool", "tool_name": "get_weather", "content": "sunny"}])
    assert e.value.status_code == 400 and "no call" in e.value.error


@pytest.mark.parametrize("stream", [False, True])
def test_format_as_a_schema(server, stream):
    c = client(server)
    reply = c.chat(model="qwen3", messages=ASK, format=ANSWER, stream=stream,
                   options={"temperature": 0.8, "seed": 7, "num_predict": 200})
    content = joined(reply)["content"] if stream else reply.message.content
    jsonschema.validate(json.loads(content), ANSWER)
    generated = c.generate(model="qwen3", prompt="Weather?", format="json", stream=False, think=False,
                           options={"temperature": 0.8, "seed": 7, "num_predict": 200})
    assert isinstance(json.loads(generated.response), dict)


def test_generate_streamed_raw_and_with_a_system_message(server):
    c = client(server)
    whole = c.generate(model="qwen3", prompt="Once upon a time", system="Be brief.", stream=False, options=GREEDY)
    parts = list(c.generate(model="qwen3", prompt="Once upon a time", system="Be brief.", stream=True,
                            options=GREEDY))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.response for p in parts) == whole.response
    assert "".join(p.thinking or "" for p in parts) == whole.thinking
    raw = c.generate(model="qwen3", prompt="Once upon a time", raw=True, stream=False, options=GREEDY)
    # The prompt as it is: a few tokens, where the template's turn markers add several.
    assert raw.prompt_eval_count < whole.prompt_eval_count and not raw.thinking


def test_bad_requests_are_400s_in_ollamas_shape(server):
    import ollama

    c = client(server)

    def refused(**kwargs) -> str:
        call = kwargs.pop("call", "chat")
        body = {"model": "qwen3", **({"messages": ASK} if call == "chat" else {"prompt": "hi"}), **kwargs}
        with pytest.raises(ollama.ResponseError) as e:
            getattr(c, call)(**body)
        assert e.value.status_code == 400, e.value
        return e.value.error

    assert "temperature" in refused(options={"temperature": "hot"})
    assert "top_p" in refused(options={"top_p": 2})
    assert "num_predict" in refused(options={"num_predict": 0})
    assert "num_ctx" in refused(options={"num_ctx": 10 ** 6})
    assert "mirostat" in refused(options={"mirostat": 2})
    assert "num_gpux" in refused(options={"num_gpux": 1})
    assert "seed" in refused(options={"seed": -5})
    assert "stop" in refused(options={"stop": 7})
    # Values the client's own models refuse to send, sent as they are.
    for field, value in (("format", "yaml"), ("think", "very"), ("options", [1])):
        response = httpx.post(f"{server.url}/api/chat", json={"model": "qwen3", "messages": ASK, field: value},
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT_S)
        assert response.status_code == 400 and field in response.json()["error"], response.text
    assert "fill-in-the-middle" in refused(call="generate", suffix="return x")
    assert "images" in refused(call="generate", images=[b"\x89PNG"])
    assert "one at a time" in refused(tools=TOOLS, format="json")
    # Taken and harmless: a context that fits, runner options, and keep_alive.
    fine = c.chat(model="qwen3", messages=ASK, stream=False, keep_alive="5m",
                  options={**GREEDY, "num_ctx": 2048, "num_thread": 2, "mirostat": 0, "num_predict": -1,
                           "repeat_last_n": -1})
    assert fine.done
    response = httpx.post(f"{server.url}/api/chat", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"},
                          timeout=WAIT_S)
    assert response.status_code == 400 and set(response.json()) == {"error"}


def test_the_key_and_the_metrics(server):
    import ollama

    with pytest.raises(ollama.ResponseError) as e:
        client(server, key="wrong").chat(model="qwen3", messages=ASK, stream=False, options=GREEDY)
    assert e.value.status_code == 401 and "API key" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client(server, key="wrong").list()
    assert e.value.status_code == 401
    before = server.metrics(KEY)
    client(server).chat(model="qwen3", messages=ASK, stream=False, options=GREEDY)
    with pytest.raises(ollama.ResponseError):
        client(server).generate(model="qwen3", prompt="hi", options={"top_k": -1})
    after = server.metrics(KEY)
    for outcome in ("ok", "invalid"):
        name = f'llama_chat_requests_total{{outcome="{outcome}"}}'
        assert after[name] == before[name] + 1

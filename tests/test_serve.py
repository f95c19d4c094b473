"""``llama-chat serve``: the installed command on a free port, driven by OpenAI's own client.

Two servers of a tiny model that never ends on its own: an open one, and a guarded one (an API
key, one job at a time and a queue of one, a short shutdown grace) that the last test stops with
SIGTERM. Every wait is for a condition, with a generous bound: the machine is busy.
"""

from __future__ import annotations

import json
import re
import signal
import socket

import httpx
import openai
import pytest

from cli_support import build_tiny_model, run_cli
from llama_chat.cmd.openai_api import Reply, StreamEvents, event
from serve_support import WAIT_S, start_server, stop_server, wait_for

CONTEXT = 4096
GUARD_KEY = "test-key-1"
LONG_USER_MESSAGE = " ".join(f"the fox number {i} jumped over the lazy dog" for i in range(12))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("serve"), max_seq_len=CONTEXT)


@pytest.fixture(scope="module")
def server(tiny):
    s = start_server(tiny.path, "--max-body-bytes", "65536", "--max-batch", "4")
    yield s
    assert stop_server(s) == 0, s.log()


@pytest.fixture(scope="module")
def guarded(tiny):
    s = start_server(tiny.path, "--max-batch", "1", "--queue-limit", "1", "--shutdown-grace", "1",
                     "--cors-origin", "https://app.example", LLAMA_CHAT_API_KEY=GUARD_KEY)
    yield s
    if s.proc.poll() is None:
        stop_server(s)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- a stream's events, without a server ------------------------------------------------------------


@pytest.mark.parametrize("chat_reply", [False, True])
@pytest.mark.parametrize("model", ["tiny", 'a "quoted" model \\ é', f"odd {StreamEvents.MARKER} name"])
def test_a_text_events_bytes_are_its_chunks_encoded_whole(chat_reply, model):
    """The template a piece of text is written into gives the bytes of its chunk encoded whole,
    whatever the text and the names around it (a name that holds the marker: encoded whole)."""
    reply = Reply(chat_reply, "cmpl-0123abcd", model, 1_700_000_000)
    events = StreamEvents(reply)
    texts = ["Once", " upon", 'a "quote" \\ back', "line\nbreak\ttab\x00\x1f", "é 猫 👨‍👩‍👧 \u2028\u2029", "\ud7ff"]
    for index in (0, 3, 0):
        for text in texts:
            assert events.text(index, text) == event(reply.chunk(index, text))


# -- the open server ---------------------------------------------------------------------------------


def test_health_says_503_while_the_model_loads_then_200(server):
    assert server.health[0] == 503 and server.health[-1] == 200, server.health
    assert "ready: model 'tiny'" in server.log()
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat_and_completions_whole_and_streamed_say_the_same(server):
    client = server.client()
    whole = client.chat.completions.create(model="tiny", messages=chat("Tell me about the fox"), max_tokens=12,
                                           temperature=0)
    assert whole.object == "chat.completion" and len(whole.choices) == 1
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12

    chunks = list(client.chat.completions.create(model="tiny", messages=chat("Tell me about the fox"),
                                                 max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12

    done = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=9, temperature=0)
    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 9
    streamed = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=9,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


def sse_chunks(response: httpx.Response) -> list[dict]:
    """A stream's body as it is on the wire: ``data: {chunk}`` events, each ended by a blank line,
    then ``data: [DONE]`` last; the chunks, each with one id and OpenAI's keys."""
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], events[-3:]
    assert all(e.startswith("data: {") and "\n" not in e for e in events[:-2]), events
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert len({c["id"] for c in chunks}) == 1
    for c in chunks:
        assert set(c) == {"id", "object", "created", "model", "choices", *(["usage"] if "usage" in c else [])}, c
    return chunks


def test_streams_on_the_wire_are_openai_chunks_with_every_token_once(server):
    """The raw events of streamed completions and chats, one choice and several: each choice's text
    (greedy) is the whole response's, its finish reason comes once, on its last chunk."""
    url = server.url
    prompt = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    whole = httpx.post(f"{url}/v1/completions", json=prompt, timeout=WAIT_S).json()["choices"][0]["text"]
    body = {**prompt, "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_chunks(httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT_S))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    pieces = [c["choices"][0] for c in chunks[:-1]]
    assert all(set(p) == {"index", "text", "logprobs", "finish_reason"} and p["index"] == 0 for p in pieces)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(p["text"] for p in pieces) == whole
    assert [p["finish_reason"] for p in pieces] == [None] * (len(pieces) - 1) + ["length"]

    messages = {"model": "tiny", "messages": chat("Tell me about the fox"), "max_tokens": 12, "temperature": 0}
    said = httpx.post(f"{url}/v1/chat/completions", json=messages, timeout=WAIT_S).json()
    said = said["choices"][0]["message"]["content"]
    chunks = sse_chunks(httpx.post(f"{url}/v1/chat/completions", json={**messages, "n": 2, "stream": True},
                                   timeout=WAIT_S))
    assert all(c["object"] == "chat.completion.chunk" and len(c["choices"]) == 1 for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all(set(m["delta"]) == {"content"} for m in mine[1:-1])
        assert "".join(m["delta"].get("content", "") for m in mine) == said
        assert [m["finish_reason"] for m in mine] == [None] * (len(mine) - 1) + ["length"]


def read_response(sock: socket.socket, buffered: bytes = b"") -> tuple[str, dict[str, str], bytes, bytes]:
    """One response read off ``sock``: its status line, headers, body (chunked coding undone, each
    chunk's size line checked; else up to the close) and the bytes after it."""
    data = buffered
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or pytest.fail(f"closed within the head: {data!r}")
    head, _, data = data.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    if headers.get("transfer-encoding") != "chunked":
        while piece := sock.recv(65536):
            data += piece
        return status, headers, data, b""
    body = b""
    while True:
        while b"\r\n" not in data:
            data += sock.recv(65536) or pytest.fail(f"closed within a chunk's size: {data!r}")
        size_line, _, data = data.partition(b"\r\n")
        assert re.fullmatch(rb"[0-9a-f]+", size_line), size_line
        size = int(size_line, 16)
        while len(data) < size + 2:
            data += sock.recv(65536) or pytest.fail("closed within a chunk")
        assert data[size:size + 2] == b"\r\n"
        if size == 0:
            return status, headers, body, data[2:]
        body, data = body + data[:size], data[size + 2:]


def test_a_stream_is_the_same_events_over_http_1_1_and_1_0(server):
    """Streamed events go straight to the connection (``http_protocol.BodyWriter``): chunked to an
    HTTP/1.1 client, whose kept connection then carries the next request; as they are to HTTP/1.0,
    whose connection the server closes. Both bodies are the events of the same greedy text."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                       "stream": True}).encode()

    def request(version: str) -> bytes:
        return (f"POST /v1/completions HTTP/{version}\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    def text_of(events: bytes) -> str:
        assert events.endswith(b"data: [DONE]\n\n"), events[-200:]
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in events.split(b"\n\n")[:-2]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        return "".join(c["choices"][0]["text"] for c in chunks)

    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(request("1.1"))
        status, headers, first, rest = read_response(sock)
        assert status.startswith("HTTP/1.1 200") and headers["content-type"].startswith("text/event-stream")
        sock.sendall(request("1.1"))  # the same connection, kept
        status, _, second, rest = read_response(sock, rest)
        assert status.startswith("HTTP/1.1 200") and rest == b""
    assert text_of(first) == text_of(second) != ""
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(request("1.0"))
        status, headers, old, _ = read_response(sock)
    assert status.startswith("HTTP/1.1 200") and "transfer-encoding" not in headers
    assert text_of(old) == text_of(first)


def test_n_choices_run_together_each_with_its_own_seed(server):
    client = server.client()
    reply = client.completions.create(model="tiny", prompt="The fox", max_tokens=10, n=3, seed=5, temperature=1.0)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 30
    assert len({c.text for c in reply.choices}) > 1  # seeds 5, 6 and 7
    # Choice 1 of seed 5 is choice 0 of seed 6.
    alone = client.completions.create(model="tiny", prompt="The fox", max_tokens=10, seed=6, temperature=1.0)
    assert alone.choices[0].text == reply.choices[1].text

    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="tiny", messages=chat("Hello there"), max_tokens=8, n=2,
                                                stream=True, seed=1):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"} and set(texts) == {0, 1}


def test_the_same_seed_gives_the_same_text_and_another_seed_another(server):
    client = server.client()

    def sample(seed: int) -> str:
        return client.chat.completions.create(model="tiny", messages=chat("Sing me a song"), max_tokens=20,
                                              temperature=1.0, seed=seed).choices[0].message.content

    first = sample(11)
    assert sample(11) == first
    assert sample(12) != first


def test_greedy_completions_equal_the_command_on_the_same_model(server, tiny):
    prompt = "Once upon a time the fox"
    served = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    proc = run_cli("-m", str(tiny.path), "--template", "none", "--json", "-t", "0", "-n", "24", "-p", prompt,
                   timeout=WAIT_S)
    assert proc.returncode == 0, proc.stderr.decode()
    local = json.loads(proc.stdout)
    assert local["completion_tokens"] == served.usage.completion_tokens == 24
    assert served.choices[0].text and local["text"] == served.choices[0].text


def test_a_stop_string_ends_the_text_before_it(server):
    client = server.client()
    full = client.completions.create(model="tiny", prompt="A story:", max_tokens=40, temperature=0).choices[0].text
    words = re.findall(r"\w{3,}", full[5:])
    assert words, full
    stop = words[0]
    reply = client.completions.create(model="tiny", prompt="A story:", max_tokens=40, temperature=0, stop=[stop, "@@"])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == full[:full.index(stop)]


def test_a_conversations_next_turn_prefills_only_what_is_new(server):
    client = server.client()
    first = client.chat.completions.create(model="tiny", messages=chat(LONG_USER_MESSAGE), max_tokens=6,
                                           temperature=0)
    assert first.usage.prompt_tokens > 32
    messages = [*chat(LONG_USER_MESSAGE), {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens
    assert server.metrics()["llama_chat_prompt_tokens_cached_total"] >= cached
    assert server.metrics()["llama_chat_prefix_cache_hit_ratio"] > 0


def test_response_format_holds_the_reply_to_a_schema(server):
    schema = {"type": "object", "properties": {"done": {"type": "boolean"}}, "required": ["done"],
              "additionalProperties": False}
    reply = server.client().chat.completions.create(
        model="tiny", messages=chat("Are you done?"), max_tokens=40, temperature=1.0, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert json.loads(reply.choices[0].message.content) in ({"done": True}, {"done": False})
    assert reply.choices[0].finish_reason == "stop"
    # The command line's own structured output, as extra fields.
    digits = server.client().completions.create(model="tiny", prompt="A number:", max_tokens=10, seed=3,
                                                extra_body={"regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", digits.choices[0].text) and digits.choices[0].finish_reason == "stop"


def check_top(chosen: float, top: list[float], k: int) -> None:
    """A greedy token's logprob against its alternatives: at most 0, at least each of them, and
    they are sorted, most likely first."""
    assert chosen <= 0 and len(top) == k and all(v <= 0 for v in top)
    assert top == sorted(top, reverse=True)
    assert all(chosen >= v - 1e-5 for v in top)


def test_logprobs_of_chat_and_completions_whole_and_streamed(server):
    client = server.client()
    request = {"model": "tiny", "messages": chat("Tell me about the fox"), "max_tokens": 10, "temperature": 0,
               "logprobs": True, "top_logprobs": 3}
    whole = client.chat.completions.create(**request)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens - (whole.choices[0].finish_reason == "stop") > 0
    for entry in content:
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
        check_top(entry.logprob, [t.logprob for t in entry.top_logprobs], 3)
        assert all(bytes(t.bytes).decode("utf-8", errors="replace") == t.token for t in entry.top_logprobs)
    assert "".join(e.token for e in content).strip() == whole.choices[0].message.content.strip()

    chunks = list(client.chat.completions.create(**request, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    plain = client.chat.completions.create(**{**request, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None

    done = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=9, temperature=0,
                                     logprobs=2)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 9
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(9)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2  # two alternatives, unless both spell the same text
        assert chosen <= 0 and all(chosen >= v - 1e-5 for v in top.values())
    pieces = [c.choices[0].logprobs for c in client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=9, temperature=0, logprobs=2, stream=True)
        if c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == lp.tokens
    assert [o for p in pieces for o in p.text_offset] == lp.text_offset
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, logprobs=6)
    assert info.value.status_code == 400 and info.value.param == "logprobs"


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"seed": -3}, "seed"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"nope": 1}}, "logit_bias"),
    ({"logit_bias": {"100000": -100}}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "not a schema"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"regex": "a+"}}, "response_format"),
    ({"extra_body": {"regex": "("}}, "regex"),
    ({"extra_body": {"top_k": -1}}, "top_k"),
    ({"extra_body": {"min_p": "high"}}, "min_p"),
    ({"extra_body": {"colour": "red"}}, "colour"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x " * 5000}]}, "messages"),
])
def test_a_bad_request_gets_400_naming_its_field(server, kwargs, param):
    request = {"model": "tiny", "messages": chat("hi"), "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(**request)
    assert info.value.status_code == 400 and info.value.param == param, info.value.body
    assert info.value.type == "invalid_request_error" and info.value.message
    if "x " in json.dumps(kwargs):
        assert info.value.code == "context_length_exceeded"


def test_other_refusals_are_openai_errors_too(server):
    # A client's own default model name is answered by the one model served, which it names.
    assert server.client().chat.completions.create(model="gpt-4o", messages=chat("hi"), max_tokens=4).model == "tiny"
    with pytest.raises(openai.NotFoundError) as info:
        server.client().models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found"

    def error_of(response: httpx.Response) -> dict:
        assert set(response.json()) == {"error"}, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        return response.json()["error"]

    url = server.url
    assert httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=WAIT_S).status_code == 400
    assert httpx.post(f"{url}/v1/completions", json=["a list"], timeout=WAIT_S).status_code == 400
    response = httpx.get(f"{url}/v1/nothing", timeout=WAIT_S)
    assert response.status_code == 404 and error_of(response)["type"] == "not_found_error"
    response = httpx.get(f"{url}/v1/chat/completions", timeout=WAIT_S)
    assert response.status_code == 405 and error_of(response)
    big = {"model": "tiny", "prompt": "y" * 70000}
    response = httpx.post(f"{url}/v1/completions", json=big, timeout=WAIT_S)
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"
    # The server took all of that without a traceback, and goes on.
    assert "Traceback" not in server.log()
    assert server.client().completions.create(model="tiny", prompt="Still", max_tokens=2).usage.completion_tokens == 2
    counts = server.metrics()
    assert counts['llama_chat_requests_total{outcome="invalid"}'] >= 4
    assert counts["llama_chat_time_to_first_token_seconds_count"] > 0
    assert counts["llama_chat_inter_token_latency_seconds_count"] > 0


def test_a_client_that_goes_away_mid_stream_frees_its_pages(server):
    before = server.metrics()['llama_chat_requests_total{outcome="cancelled"}']
    body = {"model": "tiny", "prompt": "An endless story", "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=WAIT_S) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        data = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in data)
        assert server.metrics()["llama_chat_jobs_running"] == 1
    # The connection is closed: the job is cancelled and its pages go back to the pool.
    wait_for(lambda: server.metrics()["llama_chat_kv_pages_used"] == 0
             and server.metrics()["llama_chat_jobs_running"] == 0, "the job's pages to be freed")
    wait_for(lambda: server.metrics()['llama_chat_requests_total{outcome="cancelled"}'] == before + 1,
             "the request to be counted as cancelled")
    assert "(client went away)" in server.log()


# -- the guarded server: a key, one job at a time, a queue of one ------------------------------------


def test_an_api_key_is_required_except_for_health(guarded):
    with pytest.raises(openai.AuthenticationError):
        guarded.client().models.list()
    with pytest.raises(openai.AuthenticationError):
        guarded.client("wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert httpx.get(f"{guarded.url}/metrics", timeout=WAIT_S).status_code == 401
    assert httpx.get(f"{guarded.url}/health", timeout=WAIT_S).status_code == 200
    reply = guarded.client(GUARD_KEY).completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert reply.usage.completion_tokens == 2


def test_cors_lets_the_named_origin_in_only(guarded, server):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    response = httpx.options(f"{guarded.url}/v1/chat/completions", headers=preflight, timeout=WAIT_S)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(f"{guarded.url}/v1/chat/completions",
                          headers={**preflight, "Origin": "https://elsewhere.example"}, timeout=WAIT_S)
    assert "access-control-allow-origin" not in other.headers
    # Without --cors-origin, no origin is let in.
    plain = httpx.get(f"{server.url}/health", headers={"Origin": "https://app.example"}, timeout=WAIT_S)
    assert "access-control-allow-origin" not in plain.headers


def test_past_the_queue_limit_a_request_gets_429_with_retry_after(guarded):
    client = guarded.client(GUARD_KEY)
    long = {"model": "tiny", "prompt": "Tell me everything", "max_tokens": CONTEXT - 50, "stream": True}
    running = client.completions.create(**long)
    queued = client.completions.create(**long)
    try:
        wait_for(lambda: guarded.metrics(GUARD_KEY)["llama_chat_jobs_running"] == 1
                 and guarded.metrics(GUARD_KEY)["llama_chat_jobs_queued"] == 1, "one job running and one queued")
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="tiny", prompt="me too", max_tokens=2)
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.code == "queue_full"
    finally:
        running.close()
        queued.close()
    wait_for(lambda: guarded.metrics(GUARD_KEY)["llama_chat_kv_pages_used"] == 0, "the jobs' pages to be freed")
    assert guarded.metrics(GUARD_KEY)['llama_chat_requests_total{outcome="rejected"}'] >= 1


def test_sigterm_lets_the_running_job_end_then_exits_0(guarded):
    client = guarded.client(GUARD_KEY)
    stream = client.completions.create(model="tiny", prompt="A very long tale", max_tokens=CONTEXT - 50, stream=True)
    chunks = iter(stream)
    next(chunks)
    guarded.proc.send_signal(signal.SIGTERM)
    rest = list(chunks)  # the stream ends properly: cancelled after the grace, or finished
    assert rest and rest[-1].choices[0].finish_reason in ("cancelled", "length")
    assert guarded.proc.wait(timeout=WAIT_S) == 0, guarded.log()
    log = guarded.log()
    assert "SIGTERM: stopping" in log and "stopped" in log and "Traceback" not in log

"""``-m openai:URL``: a remote model behind the same stream of responses, against our own server.

One ``llama-chat serve`` of a tiny model that never ends on its own; what the remote source gives
is compared with what OpenAI's client gets from the same server.
"""

from __future__ import annotations

import json
import socket
import threading
from contextlib import contextmanager

import anyio
import pexpect
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from cli_support import build_tiny_model, cli_env, run_cli, spawn_cli
from llama_chat.inference.remote import (DialogCarrier, RemoteError, RemoteRequestError, RemoteSource, TextCarrier,
                                         connect)
from llama_chat.inference.types import GenerationState, Request
from llama_chat.ml.controls import SamplingParams
from llama_chat.model.chat_format import Message
from serve_support import WAIT_S, start_server, stop_server, wait_for

GREEDY = SamplingParams(temperature=0.0)
KEY = "remote-test-key"
CONTEXT = 16384
# A reply that a test interrupts: so long (seconds of generating) that the server is still making
# it when the interruption lands, however late a busy machine lets the client act.
LONG_REPLY = CONTEXT - 512
TOO_LONG = "x " * CONTEXT  # a prompt longer than the context


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = build_tiny_model(tmp_path_factory.mktemp("remote"), max_seq_len=CONTEXT)
    s = start_server(tiny.path, "--max-batch", "4", "--api-key", KEY, "-c", str(CONTEXT))
    yield s
    assert stop_server(s) == 0, s.log()


def spec(server) -> str:
    return f"openai:{server.url}/v1"


def text_request(text: str, **kwargs) -> Request:
    return Request(TextCarrier().encode(text), **{"sampling": GREEDY, "max_tokens": 10, **kwargs})


def dialog_request(text: str, **kwargs) -> Request:
    ids = DialogCarrier().encode_dialog([Message("user", text)])
    return Request(ids, **{"sampling": GREEDY, "max_tokens": 10, "chat_reply": True, **kwargs})


async def run(source: RemoteSource, request: Request):
    async with source.stream(request) as stream:
        responses = [response async for response in stream]
    return responses, stream.completion()


def test_connect_finds_the_model_and_names_what_is_wrong(server):
    model = connect(spec(server), api_key=KEY)
    assert model.name == "tiny" and model.max_seq_len == CONTEXT
    assert connect(spec(server) + "#tiny", api_key=KEY).name == "tiny"
    assert connect(spec(server), model="tiny", api_key=KEY).name == "tiny"
    with pytest.raises(RemoteRequestError, match="has no model 'nope'"):
        connect(spec(server) + "#nope", api_key=KEY)
    with pytest.raises(RemoteRequestError, match="401"):
        connect(spec(server), api_key="wrong")
    with pytest.raises(RemoteRequestError, match="expected openai:http"):
        connect("openai:ftp://somewhere")
    with pytest.raises(RemoteError, match="cannot reach the server"):
        connect("openai:http://127.0.0.1:9/v1")


def test_a_remote_stream_says_what_the_server_says(server):
    source = RemoteSource(connect(spec(server), api_key=KEY))
    client = server.client(KEY)

    responses, done = anyio.run(run, source, text_request("Once upon a time"))
    expected = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0)
    assert done.text == expected.choices[0].text == "".join(r.text for r in responses)
    assert done.finish_reason == GenerationState.MAX_TOKENS and responses[-1].state == GenerationState.MAX_TOKENS
    assert done.completion_tokens == 10 and done.prompt_tokens == expected.usage.prompt_tokens
    assert done.timings.ttft_s is not None

    _, chat = anyio.run(run, source, dialog_request("Tell me about the fox"))
    expected = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell me about the fox"}],
                                              max_tokens=10, temperature=0)
    assert chat.text == expected.choices[0].message.content and chat.completion_tokens == 10

    # Sampling settings and stop strings cross too.
    request = text_request("Once upon a time", sampling=SamplingParams(temperature=0.9, top_k=20), seed=4,
                           max_tokens=12)
    _, sampled = anyio.run(run, source, request)
    same = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0.9,
                                     seed=4, extra_body={"top_k": 20})
    assert sampled.text == same.choices[0].text


def test_leaving_a_stream_early_cancels_the_job_on_the_server(server):
    source = RemoteSource(connect(spec(server), api_key=KEY))
    cancelled = server.metrics(KEY)['llama_chat_requests_total{outcome="cancelled"}']

    async def take_three():
        async with source.stream(text_request("An endless story", max_tokens=LONG_REPLY)) as stream:
            taken = 0
            async for _ in stream:
                taken += 1
                if taken == 3:
                    break
        return stream.completion()

    done = anyio.run(take_three)
    assert done.finish_reason == GenerationState.CANCELLED
    wait_for(lambda: server.metrics(KEY)['llama_chat_requests_total{outcome="cancelled"}'] == cancelled + 1,
             "the server to cancel the job")
    wait_for(lambda: server.metrics(KEY)["llama_chat_kv_pages_used"] == 0, "the job's pages to be freed")


def test_many_requests_at_once_and_a_refused_one_fails_alone(server):
    source = RemoteSource(connect(spec(server), api_key=KEY), max_batch=2)
    results: dict[int, object] = {}

    async def consume(i, stream):
        async for _ in stream:
            pass
        results[i] = stream.error or stream.completion()

    async def main():
        async with source:
            async with anyio.create_task_group() as tg:
                for i, prompt in enumerate(["The fox", "The dog", TOO_LONG, "The cat"]):
                    tg.start_soon(consume, i, source.submit(text_request(prompt, max_tokens=6)))

    anyio.run(main)
    assert isinstance(results[2], RemoteRequestError) and "400" in str(results[2])
    assert all(results[i].completion_tokens == 6 for i in (0, 1, 3))
    assert source.stats.generated_tokens == 18 and source.stats.jobs_finished == 4


@pytest.mark.slow
def test_the_command_runs_against_a_remote_model(server):
    client = server.client(KEY)
    proc = run_cli("-m", spec(server), "-p", "Tell me about the fox", "-t", "0", "-n", "8", "--json",
                   timeout=WAIT_S, OPENAI_API_KEY=KEY)
    assert proc.returncode == 0, proc.stderr.decode()
    out = json.loads(proc.stdout)
    expected = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell me about the fox"}],
                                              max_tokens=8, temperature=0)
    assert out["text"] == expected.choices[0].message.content
    assert out["completion_tokens"] == 8 and out["finish_reason"] == "max_tokens" and out["model"] == "tiny"

    plain = run_cli("-m", spec(server), "--remote-model", "tiny", "--api-key", KEY, "--template", "none",
                    "-p", "Once upon a time", "-t", "0", "-n", "8", timeout=WAIT_S)
    assert plain.returncode == 0, plain.stderr.decode()
    expected = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert plain.stdout.decode().rstrip("\n") == expected.choices[0].text

    too_long = run_cli("-m", spec(server), "-p", TOO_LONG, "-n", "4", timeout=WAIT_S, OPENAI_API_KEY=KEY)
    err = too_long.stderr.decode()
    assert too_long.returncode == 2 and "the prompt is" in err and "Traceback" not in err, err
    unknown = run_cli("-m", spec(server) + "#nope", "-p", "hi", timeout=WAIT_S, OPENAI_API_KEY=KEY)
    assert unknown.returncode == 2 and "has no model 'nope'" in unknown.stderr.decode()
    keyless = run_cli("-m", spec(server), "-p", "hi", timeout=WAIT_S, OPENAI_API_KEY="")
    assert keyless.returncode == 2 and ": 401: " in keyless.stderr.decode(), keyless.stderr.decode()


def test_a_batch_runs_against_a_remote_model(server, tmp_path):
    src = tmp_path / "jobs.jsonl"
    src.write_text("\n".join(json.dumps(job) for job in [
        {"prompt": "Tell me about the fox", "max_tokens": 6, "id": "fox"},
        {"prompt": TOO_LONG, "max_tokens": 6, "id": "long"},
        {"prompt": "Tell me about the dog", "max_tokens": 5, "id": "dog", "top_k": 30},
    ]) + "\n")
    proc = run_cli("-m", spec(server), "--batch", str(src), "-t", "0", "--max-batch", "2", timeout=WAIT_S,
                   OPENAI_API_KEY=KEY)
    assert proc.returncode == 0, proc.stderr.decode()
    out = {o["id"]: o for o in map(json.loads, proc.stdout.decode().splitlines())}
    expected = server.client(KEY).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me about the fox"}], max_tokens=6, temperature=0)
    assert out["fox"]["text"] == expected.choices[0].message.content and out["fox"]["completion_tokens"] == 6
    assert out["dog"]["finish_reason"] == "max_tokens" and out["dog"]["completion_tokens"] == 5
    assert out["long"]["finish_reason"] == "error"


def chat_of_two_turns(server, tmp_path) -> pexpect.spawn:
    """The chat against the server on a pty, after two short greedy turns, at its prompt."""
    child = spawn_cli(["-m", spec(server), "-t", "0", "-n", "6", "--no-history"],
                      env=cli_env(XDG_STATE_HOME=str(tmp_path), OPENAI_API_KEY=KEY), timeout=WAIT_S,
                      encoding="utf-8", dimensions=(40, 160))
    child.expect_exact("chatting with tiny")
    child.expect_exact(">>> ")
    for message in ("Tell me about the fox", "And the dog?"):
        child.sendline(message)
        child.expect_exact(">>> ")
    return child


def save_and_leave(child: pexpect.spawn, tmp_path) -> list[dict]:
    """``/save``, then Ctrl+D (status 0); the saved messages."""
    child.sendline("/save " + str(tmp_path / "chat.json"))
    child.expect_exact(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    return json.loads((tmp_path / "chat.json").read_text())["messages"]


def test_the_chat_runs_against_a_remote_model(server, tmp_path):
    messages = save_and_leave(chat_of_two_turns(server, tmp_path), tmp_path)
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
    # Each reply is the server's own for the dialog so far.
    for turn in (1, 3):
        dialog = [{"role": m["role"], "content": m["content"]} for m in messages[:turn]]
        expected = server.client(KEY).chat.completions.create(model="tiny", messages=dialog, max_tokens=6,
                                                           temperature=0)
        assert messages[turn]["content"] == expected.choices[0].message.content


def test_ctrl_c_mid_reply_cancels_the_remote_job_and_the_chat_goes_on(server, tmp_path):
    child = chat_of_two_turns(server, tmp_path)
    cancelled = server.metrics(KEY)['llama_chat_requests_total{outcome="cancelled"}']
    child.sendline(f"/set max_tokens {LONG_REPLY}")
    child.expect_exact(">>> ")
    child.sendline("Tell me a long story")
    child.expect_exact("story\r\n")  # the echo of the message
    child.expect("(?s)(\x1b7.*?){5}")  # five pieces of the reply drawn
    child.sendintr()
    child.expect_exact("interrupted")
    child.expect_exact(">>> ")
    wait_for(lambda: server.metrics(KEY)['llama_chat_requests_total{outcome="cancelled"}'] == cancelled + 1,
             "the server to cancel the interrupted reply's job")
    child.sendline("/set max_tokens 6")
    child.expect_exact(">>> ")
    child.sendline("And the cat?")
    child.expect_exact(">>> ")
    messages = save_and_leave(child, tmp_path)
    assert [m["role"] for m in messages] == ["user", "assistant"] * 4
    assert messages[5]["interrupted"] is True and messages[5]["content"]
    assert messages[7]["content"] and not messages[7].get("interrupted")
    assert not any(m.get("interrupted") for m in messages[:5])


# -- servers that fail -----------------------------------------------------------------------------

STALL_S = 3600  # far past the read timeout the command is given below


def failing_app(kind: str) -> Starlette:
    """An OpenAI server that lists one model, then answers a generation with a 500 or with one
    chunk of a stream and then silence."""

    async def models(request: HttpRequest):
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model", "context_length": 512}]})

    async def generate(request: HttpRequest):
        if kind == "500":
            return JSONResponse({"error": {"message": "the model fell over", "type": "server_error"}}, status_code=500)

        async def events():
            chunk = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "Once", "delta": {"content": "Once"}, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            await anyio.sleep(STALL_S)

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", generate, methods=["POST"]),
                             Route("/v1/completions", generate, methods=["POST"])])


@contextmanager
def serving(app: Starlette):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, "the test server to start")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


def assert_one_line_and_fails(proc, *expected: str) -> None:
    err = proc.stderr.decode()
    assert proc.returncode != 0, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "Error" not in err, err  # said in words, not by a class name
    for text in expected:
        assert text in err, err


def test_a_server_that_is_down_is_one_line_and_a_failure():
    url = closed_port_url()
    assert_one_line_and_fails(run_cli("-m", f"openai:{url}", "-p", "hi", timeout=WAIT_S), "127.0.0.1")


def test_a_server_that_answers_500_is_one_line_and_a_failure():
    with serving(failing_app("500")) as url:
        proc = run_cli("-m", f"openai:{url}", "-p", "hi", timeout=WAIT_S)
    assert_one_line_and_fails(proc, "the model fell over")


def test_a_server_that_stalls_mid_stream_is_one_line_and_a_failure():
    with serving(failing_app("stall")) as url:
        proc = run_cli("-m", f"openai:{url}", "-p", "hi", timeout=WAIT_S, LLAMA_CHAT_REMOTE_READ_TIMEOUT_S="2")
    assert_one_line_and_fails(proc, "the server sent nothing for 2 s")



def test_a_failure_is_one_line_a_servers_in_its_own_words_others_by_their_kind():
    """The rule the command, its batch records and the chat share (``report.failure_line``)."""
    from llama_chat.cmd.report import failure_line

    assert failure_line(RemoteError("the server answered 500: the model fell over\nmore")) == (
        "the server answered 500: the model fell over")
    assert failure_line(ZeroDivisionError("division by zero")) == "ZeroDivisionError: division by zero"
    assert failure_line(KeyError()) == "KeyError"

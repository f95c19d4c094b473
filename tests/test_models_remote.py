"""Several models behind one ``llama-chat serve``, one of them another server's: two tiny GGUF
models of this process and ``far=openai:URL``, a second ``serve`` of the first GGUF alone. The
second server is also the one-model server whose greedy text the others are held to; ``b`` is held
to a third, started for that test alone.

The main server reads its models from a ``--models`` file (its settings applied per model: ``b``'s
context and keep-alive), beside a remote entry whose URL answers nothing. ``llama-chat ps`` and
``stop`` run against it. The models file's refusals are read in this process, one of them also
through the command line.
"""

from __future__ import annotations

import concurrent.futures
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from builders import random_model, tiny_args, train_sentencepiece
from builders_formats import hf_config, hf_state
from builders_gguf import write_gguf
from cli_support import STOP_IDS, run_cli
from llama_chat.cmd.models_file import ModelsFileError, read_models_file
from llama_chat.model.errors import ModelLoadError
from serve_support import WAIT_S, start_server, stop_server, wait_for

CONTEXT = 1024
B_CONTEXT = 512  # b's own, from the models file
ASK = [{"role": "user", "content": "Tell me about the fox"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def tiny_gguf(path: Path, spm: Path, *, seed: int) -> Path:
    """A random Llama in a GGUF file that never ends on its own (its stop token's row is zero)."""
    model = random_model(tiny_args(512, max_seq_len=CONTEXT), seed=seed)
    with torch.no_grad():
        model.output.weight[list(STOP_IDS)] = 0.0
    return write_gguf(path, hf_state(model), hf_config(model), sp_model=spm)


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    spm = train_sentencepiece(root / "spm", vocab_size=512)
    return {"a": tiny_gguf(root / "a.gguf", spm, seed=3), "b": tiny_gguf(root / "b.gguf", spm, seed=11)}


@pytest.fixture(scope="module")
def far(files):
    """The second server: ``a`` alone."""
    s = start_server(files["a"], "--max-batch", "4")
    yield s
    assert stop_server(s) == 0, s.log()


@pytest.fixture(scope="module")
def trio(files, far, tmp_path_factory):
    listed = tmp_path_factory.mktemp("listed") / "models.toml"
    listed.write_text(f'[[model]]\nalias = "b"\npath = "{files["b"].name}"\ncontext = {B_CONTEXT}\n'
                      f'keep_alive = "10m"\n\n[[model]]\nalias = "far"\npath = "openai:{far.url}/v1"\n\n'
                      f'[[model]]\nalias = "dead"\npath = "openai:{closed_port_url()}#x"\n')
    (listed.parent / files["b"].name).symlink_to(files["b"])  # a path relative to the file's folder
    # start_server's -m comes first: "a", by its file's stem.
    s = start_server(files["a"], "--models", str(listed), "--max-batch", "4")
    yield s
    assert stop_server(s) == 0, s.log()


def statuses(server) -> dict[str, str]:
    return {m["id"]: m["status"] for m in httpx.get(f"{server.url}/v1/models", timeout=WAIT_S).json()["data"]}


def stream(server, model: str, max_tokens: int = 12) -> str:
    chunks = server.client().chat.completions.create(model=model, messages=ASK, max_tokens=max_tokens,
                                                     temperature=0, stream=True)
    text, finish = [], None
    for chunk in chunks:
        assert chunk.model == model, (chunk.model, model)
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"
    return "".join(text)


def test_alternating_concurrent_streams_are_each_answered_by_their_model(trio, far, files):
    alone = stream(far, "a")  # the one-model server's greedy text
    b_alone = start_server(files["b"], "--ctx-size", str(B_CONTEXT))
    try:
        b_text = stream(b_alone, "b")  # b's, on a server of its own with its own context
    finally:
        assert stop_server(b_alone) == 0, b_alone.log()
    assert statuses(trio)["far"] == "remote"
    names = ["a", "b", "far"] * 3
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        texts = list(pool.map(lambda name: stream(trio, name), names))
    by_name: dict[str, set[str]] = {}
    for name, text in zip(names, texts):
        by_name.setdefault(name, set()).add(text)
    assert by_name["a"] == by_name["far"] == {alone}, by_name
    assert by_name["b"] == {b_text} != {alone}  # another random model: another greedy text
    listed = {m["id"]: m for m in httpx.get(f"{trio.url}/v1/models", timeout=WAIT_S).json()["data"]}
    assert listed["b"]["context_length"] == B_CONTEXT and listed["a"]["context_length"] == CONTEXT
    assert listed["far"]["url"] == f"{far.url}/v1" and listed["far"]["context_length"] == CONTEXT


def test_a_remote_model_takes_tools_and_whole_answers(trio):
    answer = trio.client().chat.completions.create(model="far", messages=ASK, tools=[WEATHER], tool_choice="required",
                                                   max_tokens=64, temperature=0)
    assert answer.model == "far"
    call = answer.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in call.function.arguments
    text = trio.client().completions.create(model="far", prompt="Once upon", max_tokens=4, temperature=0)
    assert text.model == "far" and text.choices[0].finish_reason == "length"


def test_the_remote_stream_is_cancelled_there_when_the_client_goes_away(trio, far):
    cancelled = far.metrics()['llama_chat_requests_total{outcome="cancelled"}']
    chunks = trio.client().chat.completions.create(model="far", messages=ASK, max_tokens=CONTEXT - 64, stream=True)
    taken = iter(chunks)
    for _ in range(3):
        next(taken)
    chunks.close()
    wait_for(lambda: far.metrics()['llama_chat_requests_total{outcome="cancelled"}'] == cancelled + 1,
             "the remote server to cancel the job")
    wait_for(lambda: far.metrics()["llama_chat_kv_pages_used"] == 0, "the remote job's pages to be freed")


def test_a_remote_that_does_not_answer_is_a_502_and_the_rest_go_on(trio):
    with pytest.raises(openai.APIStatusError) as caught:
        trio.client().chat.completions.create(model="dead", messages=ASK, max_tokens=4)
    assert caught.value.status_code == 502 and caught.value.body["code"] == "remote_unreachable"
    assert "'dead'" in caught.value.body["message"]
    assert stream(trio, "b", 4) and stream(trio, "far", 4)
    with pytest.raises(openai.BadRequestError) as caught:  # the remote server's refusal, as it said it
        trio.client().chat.completions.create(model="far", messages=ASK, max_tokens=4, temperature=-1)
    assert caught.value.body["param"] == "temperature"
    ollama = httpx.post(f"{trio.url}/api/chat", json={"model": "far", "messages": ASK}, timeout=WAIT_S)
    assert ollama.status_code == 400 and "another server's" in ollama.json()["error"]


def test_an_unknown_name_is_a_404_naming_the_served_models(trio):
    with pytest.raises(openai.NotFoundError) as caught:
        trio.client().chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=4)
    message = caught.value.body["message"]
    assert all(f"'{name}'" in message for name in ("a", "b", "far", "dead")), message


def test_ps_lists_the_loaded_models_and_stop_unloads_one(trio):
    stream(trio, "b", 2)
    listed = run_cli("ps", "--url", trio.url)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.decode().splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "CONTEXT", "UNTIL"]
    row = next(line.split() for line in lines if line.startswith("b "))
    assert str(B_CONTEXT) in row and "9 minutes from now" in " ".join(row)  # b's own keep_alive, 10m, not 5m
    stopped = run_cli("stop", "b", "--url", trio.url)
    assert stopped.returncode == 0 and not stopped.stdout, stopped.stderr
    assert statuses(trio)["b"] == "unloaded"
    down = run_cli("ps", "--url", closed_port_url())
    assert down.returncode == 1 and b"cannot reach the server" in down.stderr and len(down.stderr.splitlines()) == 1


# -- the models file's refusals -------------------------------------------------------------------


@pytest.mark.parametrize("text,said", [
    ('[[model]]\npath = "{a}"\ncontxt = 4096\n', "model 1: unknown key 'contxt'"),
    ('[[model]]\nalias = "x"\npath = "{a}"\n\n[[model]]\nalias = "x"\npath = "{b}"\n', "two models are named 'x'"),
    ('[[model]]\npath = "/nonexistent/m.gguf"\n', "model 1: /nonexistent/m.gguf: no such file"),
    ('[[model]]\npath = "{a}"\nkeep_alive = "soon"\n', "model 1: keep_alive: 'soon' is not a duration"),
    ('[[model]]\npath = "{a}"\ncache_type = "q3"\n', "model 1: cache_type: expected one of"),
    ('[[model]]\npath = "{a}"\ncontext = "big"\n', "model 1: context: expected a number"),
    ('[[model]]\npath = "openai:ftp://x"\nalias = "r"\n', "model 1: openai:ftp://x: expected openai:http"),
    ('[[model]]\npath = "{a}"\napi_key = "k"\n', "api_key is a remote model's"),
    ('[[model]]\nalias = "r"\npath = "openai:http://x/v1"\npinned = true\n', "model 1: pinned is a local model's"),
    ('models = 1\n', "unknown key 'models'"),
    ('[[model]\n', "not TOML"),
    ('', "no [[model]] table"),
])
def test_a_models_file_problem_is_one_line_naming_the_file(files, tmp_path, text, said):
    listed = tmp_path / "models.toml"
    listed.write_text(text.format(a=files["a"], b=files["b"]))
    with pytest.raises((ModelsFileError, ModelLoadError)) as caught:
        read_models_file(listed)
    message = str(caught.value)
    assert said in message and str(listed) in message and "\n" not in message, message


def test_a_models_file_problem_stops_serve_at_start(files, tmp_path):
    listed = tmp_path / "models.toml"
    listed.write_text(f'[[model]]\npath = "{files["a"]}"\npinned = "yes"\n')
    refused = run_cli("serve", "--models", str(listed), "--port", "0")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.decode().count("\n") == 1 and "pinned: expected true or false" in refused.stderr.decode()


def test_while_one_model_loads_the_streams_of_another_go_on(trio):
    httpx.post(f"{trio.url}/models/unload", json={"model": "b"}, timeout=WAIT_S).raise_for_status()
    arrivals: list[float] = []
    loading: list[float] = []
    chunks = trio.client().chat.completions.create(model="a", messages=ASK, max_tokens=CONTEXT - 64, stream=True)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for chunk in chunks:
            arrivals.append(time.monotonic())
            if len(arrivals) == 4:
                loaded = pool.submit(lambda: (time.monotonic(), httpx.post(
                    f"{trio.url}/models/load", json={"model": "b"}, timeout=WAIT_S), time.monotonic()))
            if len(arrivals) > 4 and loaded.done():
                started, answer, ended = loaded.result()
                assert answer.status_code == 200, answer.text
                loading = [started, ended]
                break
    chunks.close()
    during = [t for t in arrivals if loading[0] < t < loading[1]]
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:]) if later > loading[0]]
    assert len(during) >= 2, (len(arrivals), loading)  # the stream went on while b loaded
    assert max(gaps) < loading[1] - loading[0], (max(gaps), loading)

"""Hostile input, third round: the server under hostile requests, schemas and grammars deep enough
to overflow a native stack, the chat's input, a hanging compiler and a model whose scores are not
numbers.

The server cases share one ``llama-chat serve`` process of a tiny model (two jobs at once, a queue
of four, a read timeout of a few seconds), driven over real sockets; after each, the server is
alive and answers the others. The command-line cases run the installed command as their own
process (``test_hostile_inputs_2.run``: under an address-space limit, one line on stderr).
docs/bad-inputs.md lists the same cases with their answers.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
from pathlib import Path

import httpx
import pexpect
import pytest

from cli_support import build_tiny_model, cli_env, spawn_cli
from serve_support import WAIT_S, start_server, stop_server, wait_for
from test_hostile_inputs_2 import _gguf_bytes, one_error, run

CONTEXT = 1024
READ_TIMEOUT_S = 3  # the server's --read-timeout: the slow clients' cases wait this long
CAPACITY = 2 + 4  # --max-batch and --queue-limit
MEMORY_RULE = 1.2e9  # the server's peak resident memory, whatever it is sent
DEEP = 3000  # links in the chains that crashed the process
DAMAGED = "the model's scores are not numbers (NaN or infinite): its weights are damaged"


def deep_grammar(links: int) -> str:
    """A Lark grammar of ``links`` rules, each an alternative of a string and the next rule."""
    return "start: r0\n" + "\n".join(f'r{i}: "x{i}" | r{i + 1}' for i in range(links)) + f'\nr{links}: "end"\n'


def deep_schema(links: int) -> dict:
    """A JSON schema whose definitions chain ``links`` anyOf/$ref links."""
    defs = {f"d{i}": {"anyOf": [{"type": "integer"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(links)}
    defs[f"d{links}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("hostile3"), max_seq_len=CONTEXT)


@pytest.fixture(scope="module")
def server(tiny):
    s = start_server(tiny.path, "--max-batch", "2", "--queue-limit", "4", "--read-timeout", str(READ_TIMEOUT_S))
    yield s
    assert stop_server(s) == 0, s.log()


def post(server, path: str, body: dict | bytes) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=data, headers={"content-type": "application/json"},
                      timeout=WAIT_S)


def refused(response: httpx.Response, status: int = 400) -> dict:
    """The error object of a refusal with ``status``."""
    assert response.status_code == status, response.text
    return response.json()["error"]


def exchange(server, data: bytes, *, close_after_send: bool = False) -> bytes:
    """``data`` sent on a fresh connection (from a thread: the server may answer before it has
    read it all), then everything the server sends until it closes the connection."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        def send() -> None:
            try:
                sock.sendall(data)
            except OSError:
                pass  # refused before it was all sent
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        if close_after_send:
            sender.join(WAIT_S)
            return b""
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass  # the server closed with our bytes unread: what it sent first was read
        return received


def http_error(raw: bytes) -> tuple[int, dict]:
    """The status and error object of a raw response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    assert b"content-type: application/json" in head.lower(), raw[:300]
    return status, json.loads(body)["error"]


def outcomes(server) -> dict[str, float]:
    return {k.split('"')[1]: v for k, v in server.metrics().items() if k.startswith("llama_chat_requests_total")}


def peak_rss(server) -> int:
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


def alive(server) -> None:
    assert server.proc.poll() is None, server.log()
    assert httpx.get(f"{server.url}/health", timeout=WAIT_S).status_code == 200


# -- the server ----------------------------------------------------------------------------------------


def test_a_deep_grammar_or_schema_is_a_400_and_the_server_lives(server):
    error = refused(post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2, "grammar": deep_grammar(DEEP)}))
    assert error["param"] == "grammar"
    assert error["message"] == f"grammar is nested too deeply (a chain of {DEEP + 2} rules, each leading to the " \
                               "next; at most 2500)"
    error = refused(post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2, "json_schema": deep_schema(DEEP)}))
    assert error["param"] == "json_schema" and "nested too deeply" in error["message"], error
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    form = {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema(DEEP)}}
    error = refused(post(server, "/v1/chat/completions", {**chat, "response_format": form}))
    assert error["param"] == "response_format" and "nested too deeply" in error["message"], error
    # A thousand links, as before: compiled and answered.
    form["json_schema"]["schema"] = deep_schema(1000)
    answered = post(server, "/v1/chat/completions", {**chat, "response_format": form})
    assert answered.status_code == 200, answered.text
    alive(server)


def test_capacity_is_checked_from_the_requests_shape_before_any_prompt_is_read(server):
    error = refused(post(server, "/v1/completions", {"prompt": ["a"] * 30000, "n": 128, "max_tokens": 1}))
    assert error["param"] == "n"
    assert error["message"] == f"this request asks for 3840000 jobs (n per prompt); the server takes at most " \
                               f"{CAPACITY} at once"
    # The second prompt is longer than the context: its refusal would name it, had it been tokenized.
    error = refused(post(server, "/v1/completions", {"prompt": ["a", "x " * CONTEXT], "n": 4, "max_tokens": 1}))
    assert error["param"] == "n" and "asks for 8 jobs" in error["message"], error
    alive(server)
    assert peak_rss(server) < MEMORY_RULE


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800 x"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": ["a", "b \\udbff"]}', "prompt[1]"),
    ("/v1/completions", b'{"prompt": "a", "mo\\ud800del": "x"}', None),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(server, path, body, param):
    before = outcomes(server)
    error = refused(post(server, path, body))
    assert error["param"] == param
    assert error["message"].startswith(f"{param} holds a lone surrogate" if param else
                                       "a field name holds a lone surrogate"), error
    after = outcomes(server)
    assert after["invalid"] == before["invalid"] + 1 and after["error"] == before["error"]


@pytest.mark.parametrize("body, param, message", [
    ({"best_of": True}, "best_of", "best_of must be an integer in 1 <= best_of <= 128, got True"),
    ({"stop": ["s"] * 65}, "stop", "stop holds 65 strings, more than the limit of 64"),
    ({"stop": ["s" * 3000] * 3}, "stop", "stop strings hold 9000 characters together, more than the limit of 8192"),
])
def test_stop_strings_and_best_of_are_bounded(server, body, param, message):
    error = refused(post(server, "/v1/completions", {"prompt": "a", "max_tokens": 1, **body}))
    assert (error["param"], error["message"]) == (param, message)


def test_http_level_rejects_are_json_errors(server):
    status, error = http_error(exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20)
                                        + b"\r\n\r\n"))
    assert status == 431 and error["code"] == "headers_too_large", error
    status, error = http_error(exchange(server, b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert status == 414 and error["code"] == "uri_too_long", error
    status, error = http_error(exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc"
                                        b"\r\n\r\n{}"))
    assert status == 400 and error["message"] == "the request is not valid HTTP (bad Content-Length)", error
    assert "a" * 1000 not in server.log()  # a long path is cut short in the log
    alive(server)


def test_slow_and_silent_clients_are_timed_out_while_others_are_served(server):
    slow_headers = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    slow_body = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro"
    results: dict[str, list[bytes]] = {"headers": [], "body": [], "silent": []}

    def client(kind: str, data: bytes) -> None:
        results[kind].append(exchange(server, data))

    threads = [threading.Thread(target=client, args=("headers", slow_headers)) for _ in range(8)]
    threads += [threading.Thread(target=client, args=("body", slow_body)),
                threading.Thread(target=client, args=("silent", b""))]
    for t in threads:
        t.start()
    served = post(server, "/v1/completions", {"prompt": "Once", "max_tokens": 2})
    for t in threads:
        t.join(WAIT_S)
    assert served.status_code == 200, served.text
    assert len(results["headers"]) == 8
    for raw in results["headers"]:
        status, error = http_error(raw)
        assert status == 408 and error["message"] == f"the request's headers did not arrive within {READ_TIMEOUT_S} s"
    status, error = http_error(results["body"][0])
    assert status == 408 and error["message"] == f"the request body did not arrive within {READ_TIMEOUT_S} s"
    assert results["silent"] == [b""]  # closed without a word: it said nothing either


def test_a_client_gone_while_sending_its_body_is_a_cancel_not_an_error(server):
    before = outcomes(server)
    exchange(server, b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"prompt": "a"',
             close_after_send=True)
    wait_for(lambda: outcomes(server)["cancelled"] == before["cancelled"] + 1, "the cancel to be counted")
    assert outcomes(server)["error"] == before["error"]
    assert " 499 " in server.log() and "(client went away)" in server.log()


@pytest.mark.slow
def test_huge_enums_at_once_keep_the_server_within_its_memory_and_answering(server):
    """The probe's case, 24 schemas of 100,000 strings (1.4 MB) at once, refused for their size;
    beside them, schemas just under the size limit, compiled within the budget and answered."""
    huge = {"enum": [f"item{j:06d}" for j in range(100_000)]}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    def body(schema: dict) -> bytes:
        return json.dumps({**chat, "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "e", "schema": schema}}}).encode()

    bodies = [body(huge)] * 24 + [body({"enum": [f"v{i}n{j:06d}" for j in range(70_000)]}) for i in range(4)]
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda b=b: answers.append(post(server, "/v1/chat/completions", b)))
               for b in bodies]
    for t in threads:
        t.start()
    health = []
    while any(t.is_alive() for t in threads):
        health.append(httpx.get(f"{server.url}/health", timeout=WAIT_S).status_code)
    for t in threads:
        t.join(WAIT_S)
    statuses = sorted(a.status_code for a in answers)
    assert statuses.count(400) == 24 and len(statuses) == 28, [(a.status_code, a.text[:300]) for a in answers]
    assert all(s in (200, 429) for s in statuses[:4]), [a.text for a in answers]
    assert set(health) == {200}
    assert peak_rss(server) < MEMORY_RULE


# -- the command line --------------------------------------------------------------------------------


def test_a_deep_grammar_or_schema_on_the_command_line_is_one_line(tmp_path):
    grammar = tmp_path / "deep.lark"
    grammar.write_text(deep_grammar(DEEP))
    schema = tmp_path / "deep.json"
    schema.write_text(json.dumps(deep_schema(DEEP)))
    message = one_error(run("--grammar", str(grammar), "-p", "hi", "-n", "2", "--no-stdin"))
    assert message.startswith(f"Invalid value for '--grammar': is nested too deeply (a chain of {DEEP + 2} rules"), \
        message
    message = one_error(run("--json-schema", str(schema), "-p", "hi", "-n", "2", "--no-stdin"))
    assert message.startswith("Invalid value for '--json-schema': is nested too deeply"), message


def test_a_deep_batch_line_is_its_own_error_and_the_other_lines_run(tmp_path, tiny):
    lines = [{"prompt": "Once upon a time"}, {"prompt": "a", "grammar": deep_grammar(DEEP)},
             {"prompt": "b", "json_schema": deep_schema(DEEP)}, {"prompt": "The fox", "id": "fox"}]
    src = tmp_path / "jobs.jsonl"
    src.write_text("\n".join(map(json.dumps, lines)) + "\n")
    proc = run("-m", str(tiny.path), "--batch", str(src), "-t", "0", "-n", "3")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, err
    said = [line for line in err.splitlines() if line.startswith("llama-chat: line ")]
    assert [line.split()[2] for line in said] == ["2:", "3:"], err
    assert all("is nested too deeply" in line for line in said), err
    out = {o["line"]: o for o in map(json.loads, proc.stdout.decode().splitlines())}
    assert out[1]["completion_tokens"] == 3 and out[4]["id"] == "fox" and out[4]["completion_tokens"] == 3
    assert out[2]["finish_reason"] == out[3]["finish_reason"] == "error"


def test_a_chat_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(tmp_path, tiny):
    child = spawn_cli(["-m", str(tiny.path), "--template", "llama2", "-t", "0", "-n", "4"],
                      env=cli_env(XDG_STATE_HOME=str(tmp_path)), timeout=WAIT_S, dimensions=(40, 400))
    try:
        child.expect_exact(b">>> ")
        child.sendline(b"hi \xff there")
        child.expect_exact(b"the message is not valid UTF-8 (byte 0xff at character 4): not sent")
        child.expect_exact(b">>> ")
        child.sendline(b"Tell me a story")
        child.expect_exact(b"finish: ")
        child.expect_exact(b">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_a_model_whose_scores_are_not_numbers_is_one_error_not_a_reply(tmp_path, sp_model_path, sp_vocab_size):
    nan = tmp_path / "nan.gguf"
    nan.write_bytes(_gguf_bytes(tmp_path, sp_model_path, sp_vocab_size, nan_output=True))
    assert one_error(run("-m", str(nan), "-p", "hi", "-n", "3", "-t", "0", "--no-stdin")) == DAMAGED
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("one\ntwo\n")
    proc = run("-m", str(nan), "--batch", str(jobs), "-n", "3", "-t", "0.8")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.count(DAMAGED) == 1 and "Traceback" not in err, err
    assert {json.loads(line)["finish_reason"] for line in proc.stdout.decode().splitlines()} == {"error"}


# -- the compiler of the CPU kernels -----------------------------------------------------------------


def _ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_hanging_compiler_is_killed_at_the_limit_with_all_it_started(tmp_path, monkeypatch):
    """A compiler wrapper whose child holds the output pipes and never ends: at the limit the
    whole process group is killed, and the wait for the pipes ends with it."""
    from llama_chat.ml.cpu import kernels

    started = tmp_path / "child.pid"
    compiler = tmp_path / "cxx"
    compiler.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {started}\nwait\n")
    compiler.chmod(0o755)
    monkeypatch.setattr(kernels, "BUILD_TIMEOUT_S", 1)
    outcome: list[str] = []

    def build() -> None:
        try:
            kernels._compile([str(compiler)])
        except subprocess.TimeoutExpired:
            outcome.append("timed out")

    builder = threading.Thread(target=build, daemon=True)
    builder.start()
    builder.join(WAIT_S)
    assert outcome == ["timed out"]
    child = int(wait_for(lambda: started.exists() and started.read_text().strip(), "the child's pid"))
    wait_for(lambda: _ended(child), "the compiler's child to be killed")

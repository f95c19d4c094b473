"""Hostile input through the paths added since the first round: batch lines, saved conversations,
the model stores, GGUF metadata, chat templates, the command line and the output.

Each case builds its input here, in a temporary directory, and runs the installed ``llama-chat``
as its own process under an address-space limit (``MEMORY_LIMIT``: a case that fills memory fails
instead of taking the machine) and a generous time bound (a hang fails). It checks the exit
status, that stderr says the problem in exactly one line (``llama-chat: error: ...``, or one
``line N:`` line per bad batch line), that there is no traceback, and that the other jobs or
chat turns went on. docs/bad-inputs.md lists the same cases with their messages.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest
import torch

from builders import random_model, tiny_args
from builders_formats import hf_config, hf_state, write_hf_checkpoint
from builders_gguf import write_gguf
from cli_support import cli_env, llama_chat_command, popen_cli, spawn_cli
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.stores import list_models, resolve_model

MEMORY_LIMIT = 3 << 30  # address space: the shipped model runs in well under this
TIMEOUT = 240  # generous, for a busy two-core machine; only a hang reaches it
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def run(*args: str | bytes, stdin: bytes | None = None, stdout=subprocess.PIPE, **env: str) -> subprocess.CompletedProcess:
    """The command under the memory limit, to completion."""
    argv = [*llama_chat_command(), *args]
    proc = popen_cli(argv, cli_env(**env), address_space=MEMORY_LIMIT,
                     stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE, stdout=stdout,
                     stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(stdin, timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def one_error(proc: subprocess.CompletedProcess, status: int = 2) -> str:
    """The one stderr line of a run that failed with ``status``, after ``llama-chat: error: ``."""
    err = proc.stderr.decode("utf-8", errors="replace")
    assert proc.returncode == status, err
    assert "Traceback" not in err and "\x1b" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llama-chat: error: "), err
    return lines[0][len("llama-chat: error: "):]


# --- batch lines ----------------------------------------------------------------------------------


def test_each_bad_batch_line_is_one_error_record_and_the_others_run(tmp_path):
    lines = [
        b"Once upon a time",
        b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
        b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"prompt": "b", "id": ' + b"1" * 5000 + b"}",
        b'{"prompt": "c", "logit_bias": [[1e400, 1]]}',
        b'{"prompt": "\\ud800 lone"}',
        b'{"prompt": "bytes \xff\xfe"}',
        b'{"prompt": "The fox", "id": "fox"}',
    ]
    src = tmp_path / "jobs.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    proc = run("--batch", str(src), "-t", "0", "-n", "4")
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    said = {int(line.split()[2].rstrip(":")): line for line in err.splitlines() if line.startswith("llama-chat: line ")}
    assert sorted(said) == [2, 3, 4, 5, 6, 7], err
    assert "nested too deeply" in said[2]
    assert "an integer of 5000 digits" in said[3] and "an integer of 5000 digits" in said[4]
    assert "the number 1e400 is too large" in said[5]
    assert "lone surrogate (U+D800)" in said[6]
    assert "not UTF-8 (byte 0xff" in said[7]
    assert err.strip().splitlines()[-1] == "finish: 2 of 2 jobs, 6 bad lines"
    out = {o["line"]: o for o in map(json.loads, proc.stdout.decode().splitlines())}
    assert sorted(out) == list(range(1, 9))
    assert {out[n]["finish_reason"] for n in range(2, 8)} == {"error"}
    assert out[1]["completion_tokens"] == 4 and out[8]["id"] == "fox" and out[8]["completion_tokens"] == 4


def test_a_million_lines_stream_in_bounded_memory_and_stop_at_the_first_ctrl_c(tmp_path):
    src = tmp_path / "million.txt"
    src.write_bytes(b"a\n" * 1_000_000)
    proc = popen_cli([*llama_chat_command(), "--batch", str(src), "-t", "0", "-n", "1"], cli_env(),
                     address_space=MEMORY_LIMIT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE)
    try:
        got = b""
        deadline = time.monotonic() + TIMEOUT
        while got.count(b"\n") < 50:  # results come out while most of the input is still unread
            assert time.monotonic() < deadline, "no results in time"
            chunk = proc.stdout.read1(65536)
            assert chunk, proc.stderr.read().decode()
            got += chunk
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)  # one Ctrl+C is enough, at any moment
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err
    summary = err.decode().strip().splitlines()[-1]
    assert summary.startswith("finish: ") and summary.endswith("(cancelled)"), summary
    results = [json.loads(line) for line in (got + rest).decode().splitlines()]
    assert len(results) >= 50 and all(r["completion_tokens"] == 1 for r in results)


def test_results_that_cannot_be_written_are_one_line_and_exit_1(tmp_path):
    src = tmp_path / "jobs.txt"
    src.write_text("one\ntwo\n")
    with open("/dev/full", "w") as full:
        proc = run("--batch", str(src), "-t", "0", "-n", "2", stdout=full)
    assert one_error(proc, 1) == "cannot write the results to standard output (No space left on device)"


@pytest.mark.parametrize("args, expect", [
    (("--cache-tokens", "100000000"), "Invalid value for '--cache-tokens': must be an integer in 1 <= n <= 16777216"),
    (("--max-batch", "1000000000"), "Invalid value for '--max-batch': must be an integer in 1 <= n <= 4096"),
    (("-c", "1000000000"), "Invalid value for '--ctx-size' / '-c': must be 0 (the model's full context) or a "
                           "positive number up to 16777216"),
])
def test_sizes_past_any_machine_are_refused_before_loading(args, expect):
    proc = run("--batch", *args, "-t", "0", stdin=b"hello\n")
    assert one_error(proc).startswith(expect)


# --- the command line -----------------------------------------------------------------------------


@pytest.mark.parametrize("args, expect", [
    ((b"-p", b"hi \xff"), "--prompt is not valid UTF-8 (byte 0xff at character 4)"),
    ((b"-p", b"hi", b"--system", b"\xff"), "--system is not valid UTF-8 (byte 0xff at character 1)"),
    ((b"-p", b"hi", b"--stop", b"a\xfe"), "--stop is not valid UTF-8 (byte 0xfe at character 2)"),
])
def test_command_line_text_that_is_not_utf8_is_one_line(args, expect):
    assert one_error(run(*args, "-n", "2", "--no-stdin")) == expect


# --- saved conversations --------------------------------------------------------------------------


def _conversation(messages: list[dict]) -> str:
    return json.dumps({"format": "llama-chat-conversation/1", "messages": messages})


def test_load_and_save_problems_are_one_line_and_the_chat_goes_on(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"messages": ' + "[" * 10_000 + "]" * 10_000 + "}")
    lone = tmp_path / "lone.json"
    lone.write_text(_conversation([{"role": "user", "content": "a \\ud800"}, {"role": "assistant", "content": "b"}])
                    .replace("\\\\ud800", "\\ud800"))
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    long = tmp_path / "long.json"
    long.write_text(_conversation([{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"}
                                   for i in range(20_000)]))
    cases = [
        (f"/load {deep}", "not a saved conversation (nested too deeply)"),
        (f"/load {lone}", "not a saved conversation (a string holds a lone surrogate (U+D800), which is not text)"),
        ("/load /dev/zero", "not a regular file (a character device)"),
        (f"/load {fifo}", "not a regular file (a FIFO)"),
        (f"/load {tmp_path}", "not a regular file (a directory)"),
        ("/save ~nosuchuser/x.json", "no user 'nosuchuser' to expand ~nosuchuser for"),
        (f"/save {fifo}", "not a regular file (a FIFO)"),
    ]
    history = tmp_path / "state" / "llama-chat" / "history"
    history.parent.mkdir(parents=True)
    os.mkfifo(history)  # neither read nor written through: replaced by the first message's history
    child = spawn_cli(["-t", "0", "-n", "4"], cli_env(XDG_STATE_HOME=str(tmp_path / "state")),
                      address_space=MEMORY_LIMIT, timeout=TIMEOUT, encoding="utf-8", dimensions=(40, 400))
    try:
        child.expect_exact(">>> ")
        for command, message in cases:
            child.sendline(command)
            child.expect_exact(f"{command.split(' ', 1)[1]}: {message}")
            child.expect_exact(">>> ")
        child.sendline(f"/load {long}")
        child.expect_exact("loaded 20000 messages")
        child.expect_exact(">>> ")
        child.sendline("Tell me a story")  # the oldest exchanges make way, and the reply comes
        child.expect("dropped the oldest \\d+ exchanges")
        child.expect_exact(">>> ")
        saved = tmp_path / "saved.json"
        child.sendline(f"/save {saved}")
        child.expect_exact(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
    assert "Traceback" not in child.before
    messages = json.loads(saved.read_text())["messages"]
    assert messages[-2]["content"] == "Tell me a story" and messages[-1]["role"] == "assistant"
    assert messages[-1]["content"]
    assert fifo.is_fifo()  # /save did not write through it, nor replace it
    assert history.is_file() and "Tell me a story" in history.read_text()


# --- model stores ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory, sp_model_path, sp_vocab_size):
    return write_hf_checkpoint(random_model(tiny_args(sp_vocab_size), seed=2), tmp_path_factory.mktemp("hf"),
                               sp_model_path)


def _hf_repo(cache: Path, repo_id: str, model_dir: Path) -> Path:
    """``repo_id`` in a Hugging Face cache, laid out as huggingface_hub does; the repository's folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for f in model_dir.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.write_bytes(f.read_bytes())
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    return repo


def _damage(repo: Path, how: str, other: Path) -> None:
    ref = repo / "refs" / "main"
    ref.unlink()
    if how == "symlink to /dev/zero":
        ref.symlink_to("/dev/zero")
    elif how == "FIFO":
        os.mkfifo(ref)
    elif how == "parent path":
        ref.write_text("../../..")
    elif how == "another repository's snapshot":
        ref.write_text(COMMIT)
        snapshot = repo / "snapshots" / COMMIT
        for f in snapshot.iterdir():
            f.unlink()
        snapshot.rmdir()
        snapshot.symlink_to(other / "snapshots" / COMMIT)


DAMAGES = [
    ("symlink to /dev/zero", "leads outside"),
    ("FIFO", "not a regular file (a FIFO)"),
    ("parent path", "holds '../../..', not a commit hash"),
    ("another repository's snapshot", "leads outside"),
]


# The FIFO only through the command: a read of it would wait forever, and a process can be ended.
@pytest.mark.parametrize("how, expect", [d for d in DAMAGES if d[0] != "FIFO"])
def test_a_damaged_hugging_face_cache_entry_is_refused_with_its_reason(tmp_path, hf_model, monkeypatch, how, expect):
    # In this process: the command says a load error as it says any (the next test runs it).
    cache = tmp_path / "hub"
    other = _hf_repo(cache, "acme/other", hf_model)
    _damage(_hf_repo(cache, "acme/evil", hf_model), how, other)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as info:
        resolve_model("acme/evil", download=False, progress=False)
    assert str(info.value).startswith("acme/evil: ") and expect in str(info.value), info.value
    assert [m.name for m in list_models()][1:] == ["acme/other"]  # the damaged entry is left out
    assert resolve_model("acme/other", download=False, progress=False).path.is_dir()


def test_damaged_cache_entries_are_one_line_each_left_out_of_the_list_and_the_others_run(tmp_path, hf_model):
    cache = tmp_path / "hub"
    other = _hf_repo(cache, "acme/other", hf_model)
    for n, (how, _) in enumerate(DAMAGES):
        _damage(_hf_repo(cache, f"acme/evil{n}", hf_model), how, other)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    fifo = next(n for n, (how, _) in enumerate(DAMAGES) if how == "FIFO")
    message = one_error(run("-m", f"acme/evil{fifo}", "-p", "hi", "-n", "2", "--no-stdin", **env))
    assert message.startswith(f"acme/evil{fifo}: ") and DAMAGES[fifo][1] in message, message
    listed = run("--list", **env)
    assert listed.returncode == 0, listed.stderr.decode()
    names = [line.split()[0] for line in listed.stdout.decode().splitlines()[1:]]
    assert names == ["default", "acme/other"]
    good = run("-m", "acme/other", "-p", "hi", "-n", "2", "-t", "0", "--no-stdin", **env)
    assert good.returncode == 0, good.stderr.decode()


def _gguf_bytes(tmp: Path, sp_model: Path, vocab: int, *, nan_output: bool = False, tensor_name: str | None = None) -> bytes:
    model = random_model(tiny_args(vocab), seed=4)
    state = hf_state(model)
    if nan_output:
        state["lm_head.weight"] = torch.full_like(state["lm_head.weight"], float("nan"))
    path = write_gguf(tmp / "model.gguf", state, hf_config(model), sp_model=sp_model)
    data = path.read_bytes()
    if tensor_name is not None:  # rename the first tensor in place: its name is the first after the metadata
        first = b"token_embd.weight"
        at = data.index(struct.pack("<Q", len(first)) + first)
        data = data[:at] + struct.pack("<Q", len(tensor_name)) + tensor_name.encode() + data[at + 8 + len(first):]
    return data


def _with_metadata_array(data: bytes, count: int) -> bytes:
    """``data`` (a GGUF file) with one more metadata entry: an INT8 array of ``count`` elements,
    padded so that the tensors' data keeps its alignment."""
    key = b"x.huge"
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 1, count)
    pad = -(len(entry) + count) % 32
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 1, count + pad)
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    return data[:16] + struct.pack("<Q", n_kv + 1) + entry + bytes(count + pad) + data[24:]


def test_gguf_files_past_their_bounds_are_one_line(tmp_path, sp_model_path, sp_vocab_size):
    huge = tmp_path / "huge.gguf"
    huge.write_bytes(_with_metadata_array(_gguf_bytes(tmp_path, sp_model_path, sp_vocab_size), 10**8))
    message = one_error(run("-m", str(huge), "-p", "hi", "-n", "2", "--no-stdin"))
    assert message.startswith("huge.gguf: not a valid GGUF file (metadata 'x.huge' would take the metadata past "
                              "8,388,608 array elements"), message
    named = tmp_path / "named.gguf"
    named.write_bytes(_gguf_bytes(tmp_path, sp_model_path, sp_vocab_size, tensor_name="blk." + "1" * 5000 + ".attn_q.weight"))
    message = one_error(run("-m", str(named), "-p", "hi", "-n", "2", "--no-stdin"))
    assert "a tensor name of 5,018 bytes is longer than GGUF allows (63)" in message, message
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)  # never opened for a blocking read: the loader sees it is not a file
    assert one_error(run("-m", str(fifo), "-p", "hi", "-n", "2", "--no-stdin")).startswith(f"{fifo}: unknown model layout")


def test_a_model_that_gives_nan_fails_beam_search_in_one_line(tmp_path, sp_model_path, sp_vocab_size):
    nan = tmp_path / "nan.gguf"
    nan.write_bytes(_gguf_bytes(tmp_path, sp_model_path, sp_vocab_size, nan_output=True))
    message = one_error(run("-m", str(nan), "-p", "hi", "-n", "3", "--num-beams", "3", "-t", "0.8", "--no-stdin"))
    assert message == "the model's scores are not numbers (NaN or infinite): its weights are damaged"


def test_an_oversized_ollama_manifest_or_a_fifo_is_one_line(tmp_path):
    store = tmp_path / "ollama"
    manifests = store / "manifests" / "registry.ollama.ai" / "library"
    (manifests / "big").mkdir(parents=True)
    (manifests / "big" / "latest").write_text('{"layers": [' + ",".join(["{}"] * 1_000_000) + "]}")
    (manifests / "pipe").mkdir(parents=True)
    os.mkfifo(manifests / "pipe" / "latest")
    env = {"OLLAMA_MODELS": str(store)}
    assert "larger than 1 MiB, not an Ollama manifest" in one_error(run("-m", "ollama:big", "-p", "hi", "--no-stdin", **env))
    assert "not a regular file (a FIFO)" in one_error(run("-m", "ollama:pipe", "-p", "hi", "--no-stdin", **env))
    assert run("--list", **env).returncode == 0


def test_a_huge_chat_template_is_refused_before_it_is_compiled(tmp_path, sp_model_path, sp_vocab_size):
    out = write_hf_checkpoint(random_model(tiny_args(sp_vocab_size)), tmp_path / "hf", sp_model_path)
    template = "{% for m in messages %}{{ m.content }}{% endfor %}" + "x" * (5 << 20)
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    message = one_error(run("-m", str(out), "-p", "hi", "-n", "2", "--no-stdin"))
    assert message.startswith("chat template: 5,242,") and "more than the limit of 262,144" in message, message
    (out / "tokenizer_config.json").unlink()
    os.mkfifo(out / "chat_template.jinja")
    assert "not a regular file (a FIFO)" in one_error(run("-m", str(out), "-p", "hi", "-n", "2", "--no-stdin"))


def test_list_into_a_pipe_that_closes_exits_141_quietly(tmp_path):
    store = tmp_path / "ollama"
    blob_bytes = b"GGUF" + bytes(60)
    digest = hashlib.sha256(blob_bytes).hexdigest()
    (store / "blobs").mkdir(parents=True)
    (store / "blobs" / f"sha256-{digest}").write_bytes(blob_bytes)
    manifest = json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                       "digest": f"sha256:{digest}", "size": len(blob_bytes)}]})
    for i in range(1500):  # more than a pipe's buffer of lines
        path = store / "manifests" / "registry.ollama.ai" / "library" / f"model-{i:04d}" / "latest"
        path.parent.mkdir(parents=True)
        path.write_text(manifest)
    proc = popen_cli([*llama_chat_command(), "--list"], cli_env(OLLAMA_MODELS=str(store)), address_space=MEMORY_LIMIT,
                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(1) == b"M"
    proc.stdout.close()  # `| head -c 1`
    err = proc.stderr.read()
    assert proc.wait(timeout=TIMEOUT) == 141, err
    assert err == b""


def test_the_sizes_that_allocate_are_checked_against_the_memory_left(monkeypatch, tiny_meta_dir, capsys):
    from llama_chat.cmd import app as cli_app
    from llama_chat.cmd.options import Options
    from llama_chat.model import memory_budget

    monkeypatch.setattr(memory_budget, "available_bytes", lambda: 100_000)
    monkeypatch.setattr(sys, "stdin", open(os.devnull))
    status = cli_app.execute(Options(model=str(tiny_meta_dir), prompt="hi", ctx_size=200, max_tokens=2))
    err = capsys.readouterr().err
    assert status == 2, err
    args = json.loads((tiny_meta_dir / "params.json").read_text())
    per_token = 2 * args["n_layers"] * args.get("n_kv_heads", args["n_heads"]) * (args["dim"] // args["n_heads"]) * 4
    assert err.strip() == (f"llama-chat: error: -c 200: its KV cache would take {200 * per_token / 1e3:.1f} KB, "
                           "more than the 100.0 KB of memory available")
    status = cli_app.execute(Options(model=str(tiny_meta_dir), prompt="hi", ctx_size=8, max_tokens=1))
    assert status == 0, capsys.readouterr().err  # what fits runs

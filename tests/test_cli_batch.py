"""``llama-chat --batch``: the installed command with many prompts at once."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import time

import pytest

from cli_support import ANSI, build_tiny_model, cli_env, json_result, llama_chat_command, popen_cli, run_cli

WAIT_S = 120.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("cli_batch"))


def lines_of(stdout: bytes) -> list[dict]:
    return [json.loads(line) for line in stdout.decode().splitlines()]


def test_plain_and_json_lines_match_one_shot_and_a_bad_line_stops_nothing(tiny, tmp_path):
    src = tmp_path / "jobs.txt"
    src.write_text("\n".join([
        "Once upon a time",
        json.dumps({"prompt": "The fox liked to play", "max_tokens": 7, "id": "fox", "stop": ["zzz"]}),
        '{"prompt": "broken", ',
        "",
        json.dumps({"prompt": "Hello world", "temperature": 0.9, "seed": 4, "top_k": 30, "max_tokens": 9}),
        json.dumps({"prompt": "x", "max_tokens": 0}),
        json.dumps({"prompt": "y", "colour": "red"}),
    ]) + "\n")
    proc = run_cli("-m", str(tiny.path), "--batch", str(src), "-t", "0", "-n", "12", timeout=WAIT_S)
    assert proc.returncode == 2, proc.stderr.decode()  # bad input was given, and reported
    err = proc.stderr.decode()
    assert "llama-chat: line 3: not valid JSON" in err
    assert "llama-chat: line 6: max_tokens must be at least 1, got 0" in err
    assert "finish: 3 of 3 jobs, 3 bad lines" in err
    assert "llama-chat: line 7: unknown option 'colour'" in err
    assert "Traceback" not in err
    out = {o["line"]: o for o in lines_of(proc.stdout)}
    assert sorted(out) == [1, 2, 3, 5, 6, 7]
    assert {out[n]["finish_reason"] for n in (3, 6, 7)} == {"error"}
    assert out[2]["id"] == "fox" and out[1]["id"] == 1
    # Each job as the one-prompt command gives it, with the same settings.
    expect = {
        1: ("-t", "0", "-n", "12", "-p", "Once upon a time"),
        2: ("-t", "0", "-n", "7", "-p", "The fox liked to play"),
        5: ("-t", "0.9", "--seed", "4", "--top-k", "30", "-n", "9", "-p", "Hello world"),
    }
    for line, args in expect.items():
        alone = json_result(run_cli("-m", str(tiny.path), "--json", *args, timeout=WAIT_S))
        assert out[line]["token_ids"] == alone["token_ids"], line
        assert out[line]["text"] == alone["text"]
        assert out[line]["completion_tokens"] == len(alone["token_ids"])


def test_ordered_output_and_stdin(tiny):
    prompts = [f"Story number {i}: once upon a time" for i in range(6)]
    stdin = "\n".join(json.dumps({"prompt": p, "max_tokens": 20 - 3 * i}) for i, p in enumerate(prompts)).encode()
    proc = run_cli("-m", str(tiny.path), "--batch", "--ordered", "-t", "0", stdin=stdin, timeout=WAIT_S)
    assert proc.returncode == 0, proc.stderr.decode()
    out = lines_of(proc.stdout)
    assert [o["line"] for o in out] == [1, 2, 3, 4, 5, 6]
    assert [o["completion_tokens"] for o in out] == [20 - 3 * i for i in range(6)]


def test_jobs_sharing_a_long_prefix_prefill_it_once_and_stats_say_so(tiny, tmp_path):
    prefix = " ".join(f"word{i % 37} and the fox" for i in range(90)) + "\n"
    src = tmp_path / "shared.txt"
    src.write_text("\n".join(json.dumps({"prompt": prefix + q, "max_tokens": 4})
                             for q in ("What next?", "Who was there?", "Where?", "Why not?")) + "\n")
    proc = run_cli("-m", str(tiny.path), "--batch", str(src), "-t", "0", "--stats", timeout=WAIT_S)
    assert proc.returncode == 0, proc.stderr.decode()
    out = lines_of(proc.stdout)
    assert min(o["prompt_tokens"] for o in out) > 512
    cached = sorted(o["cached_tokens"] for o in out)
    # One job prefills the shared part; the other three take its full pages.
    assert cached[0] == 0 and all(c >= 512 for c in cached[1:])
    prefilled = sum(o["prompt_tokens"] - o["cached_tokens"] for o in out)
    stats = ANSI.sub(b"", proc.stderr).decode()
    m = re.search(r"prompt tokens: (\d+) prefilled, (\d+) from cached pages", stats)
    assert m, stats
    assert (int(m.group(1)), int(m.group(2))) == (prefilled, sum(cached))
    assert re.search(r"pages: \d+ peak of \d+ \(16 tokens each\)", stats)
    assert "lone jobs" not in stats and "steps" not in stats  # the scheduler's inner counters stay inside


def test_ctrl_c_writes_what_finished_and_exits_130(tiny, tmp_path):
    src = tmp_path / "mixed.txt"
    short = [json.dumps({"prompt": f"short {i}", "max_tokens": 3, "id": f"s{i}"}) for i in range(3)]
    # The tiny model never ends on its own: these run until the context is full, unless stopped.
    long = [json.dumps({"prompt": f"long {i}", "id": f"l{i}"}) for i in range(3)]
    src.write_text("\n".join(long + short) + "\n")
    proc = popen_cli([*llama_chat_command(), "-m", str(tiny.path), "--batch", str(src), "-t", "0", "--max-batch", "8"],
                     cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        got = b""
        deadline = time.monotonic() + WAIT_S
        while got.count(b"\n") < 3:
            assert time.monotonic() < deadline, "the short jobs did not finish in time"
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)
                assert chunk, proc.stderr.read().decode()
                got += chunk
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err.decode()
    out = lines_of(got + rest)
    assert sorted(o["id"] for o in out) == ["s0", "s1", "s2"]
    assert b"(cancelled)" in err and b"Traceback" not in err


def test_max_time_ends_every_job_and_one_bad_line_is_one(tiny, tmp_path):
    src = tmp_path / "timed.txt"
    src.write_text("\n".join([
        "Once upon a time",
        json.dumps({"prompt": "The fox", "id": "fox"}),
        json.dumps({"prompt": "Its own budget", "max_time": 1e-6, "max_tokens": 300, "id": "own"}),
        json.dumps({"prompt": "bad", "max_time": 0}),
    ]) + "\n")
    # The tiny model never ends on its own, so without the clock each job would run to -n.
    proc = run_cli("-m", str(tiny.path), "--batch", str(src), "-t", "0", "-n", "300", "--max-time", "0.000001",
                   timeout=WAIT_S)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert "llama-chat: line 4: max_time must be a number of seconds > 0, got 0.0" in err
    assert "finish: 3 of 3 jobs, 1 bad line" in err and "bad lines" not in err
    out = {o["id"]: o for o in lines_of(proc.stdout)}
    for job in (1, "fox", "own"):
        assert out[job]["finish_reason"] == "max_time" and out[job]["completion_tokens"] == 1, out[job]


@pytest.mark.parametrize("args, message", [
    (("--ordered", "-p", "hi"), "--ordered needs --batch"),
    (("--batch", "--json"), "leave out --json"),
    (("--batch", "/nonexistent/jobs.txt"), "cannot read it"),
    (("--batch", "--max-batch", "0"), "must be an integer in 1 <= n <= 4096"),
])
def test_bad_batch_options_are_one_line_and_exit_2(tiny, args, message):
    proc = run_cli("-m", str(tiny.path), *args, stdin=b"hello\n")
    assert proc.returncode == 2
    err = proc.stderr.decode()
    assert message in err and len(err.strip().splitlines()) == 1


def test_progress_bar_on_a_terminal(tiny, tmp_path):
    pexpect = pytest.importorskip("pexpect")
    src = tmp_path / "jobs.txt"
    src.write_text("\n".join(f"prompt {i}" for i in range(4)) + "\n")
    out = tmp_path / "out.jsonl"
    command = " ".join([*llama_chat_command(), "-m", str(tiny.path), "--batch", str(src), "-t", "0", "-n", "200",
                        ">", str(out)])
    child = pexpect.spawn("/bin/sh", ["-c", command], env=cli_env(), timeout=WAIT_S)
    child.expect(r"\d+/4 jobs +\d+ tok/s")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert len(lines_of(out.read_bytes())) == 4

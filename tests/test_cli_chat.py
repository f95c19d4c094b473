"""The chat through a pseudo-terminal (pexpect), and stop strings through the installed command."""

from __future__ import annotations

import json
import re

import pexpect
import pytest

from cli_support import build_tiny_model, cli_env, llama_chat_command, run_cli

WAIT_S = 120  # generous: a busy 2-core machine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("chat"))


def spawn(*args: str, tmp_path) -> pexpect.spawn:
    cmd = llama_chat_command()
    child = pexpect.spawn(cmd[0], [*cmd[1:], *args], env=cli_env(XDG_STATE_HOME=str(tmp_path)),
                          timeout=WAIT_S, encoding="utf-8", dimensions=(40, 160))
    child.expect_exact(">>> ")
    return child


def prefill_counts(child) -> tuple[int, int]:
    child.sendline("/stats")
    child.expect(r"prompt: (\d+) tokens \((\d+) from the cache, (\d+) prefilled\)")
    prompt, cached, prefilled = map(int, child.match.groups())
    child.expect_exact(">>> ")
    return cached, prefilled


def test_three_turns_reuse_the_cache_and_greedy_replies_repeat(tmp_path):
    child = spawn("-t", "0", "-n", "24", tmp_path=tmp_path)
    counts = []
    for message in ("Tell me a story", "Another one", "And a third"):
        child.sendline(message)
        child.expect_exact(">>> ")
        counts.append(prefill_counts(child))
    assert counts[0][0] == 0
    for cached, prefilled in counts[1:]:
        assert cached > 0 and prefilled < 30  # only the new message, not the conversation
    child.sendline("/save " + str(tmp_path / "a.json"))
    child.expect_exact(">>> ")
    child.sendline("/retry")
    child.expect_exact(">>> ")
    child.sendline("/save " + str(tmp_path / "b.json"))
    child.expect_exact(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert [m["role"] for m in a["messages"]] == ["user", "assistant"] * 3
    assert a["messages"] == b["messages"]  # temperature 0: the retried reply is the same


def test_ctrl_c_mid_reply_keeps_the_partial_reply_and_ctrl_c_at_the_prompt_leaves(tiny, tmp_path):
    child = spawn("-m", str(tiny.path), "--template", "llama2", "-t", "0", "-n", "2000", "--no-history",
                  tmp_path=tmp_path)
    child.sendline("Once upon a time")
    child.expect_exact("time\r\n")  # the echo of the message
    child.expect("(?s)(\x1b7.*?){5}")  # five pieces of the reply drawn (each ends with a saved cursor)
    child.sendintr()
    child.expect_exact("interrupted")
    child.expect_exact(">>> ")
    child.sendline("/save " + str(tmp_path / "c.json"))
    child.expect_exact(">>> ")
    child.sendintr()  # at an empty prompt: leave
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    messages = json.loads((tmp_path / "c.json").read_text())["messages"]
    assert messages[1]["role"] == "assistant" and messages[1]["interrupted"] is True
    assert messages[1]["content"]
    assert not (tmp_path / "llama-chat").exists()  # --no-history


def test_overflow_drops_the_oldest_turns_and_the_chat_goes_on(tiny, tmp_path):
    child = spawn("-m", str(tiny.path), "--template", "llama2", "-t", "0", "-n", "20", "-c", "96",
                  tmp_path=tmp_path)
    for _ in range(3):
        child.sendline("Once upon a time there was a cat")
        index = child.expect([re.escape(">>> "), "dropped the oldest"])
        if index == 1:
            break
    else:
        pytest.fail("no turn was dropped")
    child.expect_exact(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_chat_with_piped_stdin_goes_on_at_the_terminal(tmp_path):
    cmd = " ".join(llama_chat_command())
    child = pexpect.spawn("/bin/sh", ["-c", f"echo 'Tell me a story' | {cmd} --chat -t 0 -n 8"],
                          env=cli_env(XDG_STATE_HOME=str(tmp_path)), timeout=WAIT_S, encoding="utf-8")
    child.expect_exact(">>> ")  # after the reply to the piped message
    child.sendline("/stats")
    child.expect(r"prompt: \d+ tokens")
    child.expect_exact(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_a_model_without_chat_format_cannot_chat(tiny):
    proc = run_cli("-m", str(tiny.path), "--template", "none", "--chat", "--no-stdin")
    assert proc.returncode == 2
    assert b"no chat format" in proc.stderr and b"--template" in proc.stderr


def test_a_stop_string_split_across_tokens_stops_and_is_not_printed(tiny):
    args = ("-m", str(tiny.path), "-t", "0", "-n", "40", "-p", "Once upon a time")
    full = json.loads(run_cli(*args, "--json").stdout)
    text = full["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    proc = run_cli(*args, "--stop", stop)
    assert proc.returncode == 0
    assert proc.stdout.decode() == text[:text.find(stop)]
    assert b"finish: stop_string" in proc.stderr

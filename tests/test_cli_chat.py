"""The chat through a pseudo-terminal (pexpect), and stop strings through the installed command."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pexpect
import pytest
import torch

from builders import random_model, tiny_args, write_meta_checkpoint
from cli_support import build_tiny_model, cli_env, llama_chat_command, run_cli, spawn_cli
from llama_chat.cmd.generation_source import SINGLE_STREAM_PAGE_SIZE as CHAT_PAGE_SIZE
from llama_chat.model.tokenizers.tiktoken import NUM_SPECIAL_TOKENS, read_ranks
from terminal_support import Pty, held_bytes_model, save_and_leave, screen
from thread_masks import blocked_signals, threads_taking_signals
from tokenizer_builders import write_tiktoken_file

WAIT_S = 120  # generous: a busy 2-core machine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> Path:
    """A random model on a Llama-3-style (tiktoken) tokenizer, so the chat speaks the Llama 3 format.

    Only tokens of printable ASCII without spaces can win (the others' output rows are zero, and a
    constant feature lifts the rest above zero): a reply then never ends on its own, never holds
    partial characters and survives the history's stripping of whitespace byte for byte, while the
    model still samples splits the tokenizer would not make.
    """
    out = tmp_path_factory.mktemp("llama3")
    tokenizer = write_tiktoken_file(out / "tok")
    ranks = read_ranks(tokenizer)
    model = random_model(tiny_args(len(ranks) + NUM_SPECIAL_TOKENS, max_seq_len=2048), seed=5)
    allowed = [rank for token, rank in ranks.items() if all(0x21 <= c <= 0x7E for c in token)]
    with torch.no_grad():
        w = model.output.weight
        kept = w[allowed].clone()
        w.zero_()
        w[allowed] = kept
        model.tok_embeddings.weight[:, 0] += 2.0
        w[allowed, 0] = 0.3
    return write_meta_checkpoint(model, out / "model", tokenizer)


@pytest.fixture(scope="module")
def held(tmp_path_factory, sp_model_path) -> Path:
    return held_bytes_model(tmp_path_factory.mktemp("held") / "model", sp_model_path)


def spawn(*args: str, tmp_path) -> pexpect.spawn:
    child = spawn_cli([*args], env=cli_env(XDG_STATE_HOME=str(tmp_path)),
                      timeout=WAIT_S, encoding="utf-8", dimensions=(40, 160))
    child.expect_exact(">>> ")
    return child


def prefill_counts(child) -> tuple[int, int]:
    return turn_stats(child)[:2]


def turn_stats(child) -> tuple[int, int, int, int]:
    """From /stats: prompt tokens from the cache, prefilled, and the page table's kept pages
    and page size."""
    child.sendline("/stats")
    child.expect(r"(?s)prompt: (\d+) tokens \((\d+) from the cache, (\d+) prefilled\).*pages: (\d+) kept, \d+\s+"
                 r"free\s+of\s+\d+\s+\((\d+)\s+tokens\s+each\)")
    prompt, cached, prefilled, kept, page_size = map(int, child.match.groups())
    child.expect_exact(">>> ")
    return cached, prefilled, kept, page_size


def test_three_turns_reuse_the_cache_and_greedy_replies_repeat(tmp_path):
    """The chat runs on the scheduler: each turn's full pages stay in its page table, and the next
    turn's prompt finds every one of them there (its cached tokens are exactly those pages)."""
    child = spawn("-t", "0", "-n", "24", tmp_path=tmp_path)
    stats = []
    for message in ("Tell me a story", "Another one", "And a third"):
        child.sendline(message)
        child.expect_exact(">>> ")
        stats.append(turn_stats(child))
    assert stats[0][0] == 0
    for (cached, prefilled, _, page_size), (_, _, kept_before, _) in zip(stats[1:], stats):
        assert cached == kept_before * page_size > 0
        assert prefilled < 30 + page_size  # the new message and the previous turn's last page
    child.sendline("/save " + str(tmp_path / "a.json"))
    child.expect_exact(">>> ")
    child.sendline("/retry")
    child.expect_exact(">>> ")
    b = save_and_leave(child, tmp_path / "b.json")["messages"]
    a = json.loads((tmp_path / "a.json").read_text())["messages"]
    assert [m["role"] for m in a] == ["user", "assistant"] * 3
    assert a == b  # temperature 0: the retried reply is the same


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


def stop_mid_reply(child, wait_s: float = WAIT_S) -> None:
    """SIGSTOP the chat while a reply holds the keys typed (``cmd/typeahead.py``: no echo, and no
    flush on Ctrl+C, which readline's own mode at the prompt does not ask for). The
    pseudo-terminal's modes are the same seen from either end."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        os.kill(child.pid, signal.SIGSTOP)
        local = termios.tcgetattr(child.child_fd)[3]
        if local & termios.NOFLSH and not local & termios.ECHO:
            return
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.001)
    raise AssertionError("no reply held the terminal's echo off")


def test_keys_typed_during_a_reply_stay_out_of_it_and_become_the_next_prompts_text(tiny, tmp_path):
    child = spawn("-m", str(tiny.path), "--template", "llama2", "-t", "0", "-n", "2000", "--no-history",
                  tmp_path=tmp_path)
    child.sendline("Once upon a time")
    stop_mid_reply(child)  # so that the keys surely land mid-reply (the terminal takes them meanwhile)
    child.send("ZQX\x7fY\rmore")  # a typo erased, an Enter: neither may send anything yet
    child.sendintr()  # and a Ctrl+C, which must keep what was typed
    time.sleep(0.5)
    os.kill(child.pid, signal.SIGCONT)
    child.expect_exact("interrupted")
    child.expect_exact(">>> ZQY more")  # offered, editable, as the next message
    reply_screen = child.before
    child.send("\x7f" * 5 + "\r")  # edited, then sent
    child.expect_exact("finish: ")  # the second reply
    child.expect_exact(">>> ")
    child.sendline("/save " + str(tmp_path / "c.json"))
    child.expect_exact(">>> ")
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    messages = json.loads((tmp_path / "c.json").read_text())["messages"]
    assert [m["role"] for m in messages[:3]] == ["user", "assistant", "user"]
    assert messages[2]["content"] == "ZQY"
    assert "ZQ" not in messages[1]["content"] and "ZQ" not in reply_screen


def test_llama3_chat_reuses_its_cache_and_ctrl_c_keeps_the_partial_reply(llama3, tmp_path):
    child = spawn("-m", str(llama3), "-t", "0", "-n", "12", "--no-history", tmp_path=tmp_path)
    counts = []
    for message in ("Tell me a story", "Another one"):
        child.sendline(message)
        child.expect_exact(">>> ")
        counts.append(prefill_counts(child))
    (cached0, prefilled0), (cached1, prefilled1) = counts
    assert cached0 == 0 and prefilled0 > 0
    # The first prompt and the 11 tokens of its reply fed back (the model's own splits, not the
    # tokenizer's) come from the cache, but for the last page they partly fill; only that page,
    # the new message and its headers (about as long as the first prompt with this small
    # vocabulary) are prefilled.
    written = prefilled0 + 11
    assert cached1 == written // CHAT_PAGE_SIZE * CHAT_PAGE_SIZE and prefilled1 <= prefilled0 + 5 + CHAT_PAGE_SIZE
    child.sendline("/set max_tokens=100000")
    child.expect_exact(">>> ")
    child.sendline("Once upon a time")
    child.expect_exact("time\r\n")
    child.expect("(?s)(\x1b7.*?){5}")  # five pieces of the reply drawn
    child.sendintr()
    child.expect_exact("interrupted")
    child.expect_exact(">>> ")
    messages = save_and_leave(child, tmp_path / "llama3.json")["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3
    assert messages[-1]["interrupted"] is True and messages[-1]["content"]
    assert not any(m.get("interrupted") for m in messages[:-1])


def test_ctrl_c_while_emoji_bytes_are_held_leaves_the_chat_screen_clean(held, tmp_path):
    term = Pty("-m", str(held), "--template", "llama2", "-t", "0", "-c", "0", "--no-history",
               XDG_STATE_HOME=str(tmp_path))
    term.read_until(lambda: b">>> " in term.shown)
    term.type(b"hi\r")
    asked = len(term.shown)
    # "é" is committed, then the first three bytes of a cat are held while the model goes on.
    term.read_until(lambda: "é".encode() in term.shown[asked:] and term.shown[asked:].count(b".") >= 3)
    term.type(b"\x03")
    term.read_until(lambda: b"interrupted" in term.shown and term.shown.rstrip().endswith(b">>>"))
    term.type(b"/save " + str(tmp_path / "held.json").encode() + b"\r")
    term.read_until(lambda: term.shown.count(b">>> ") >= 3)
    term.type(b"\x04")
    status = term.finish()
    lines, cursor_visible = screen(term.shown)
    assert status == 0, term.shown
    reply = lines[lines.index(">>> hi") + 1]
    assert reply == "é", lines  # no pending markers, no ^C, no U+FFFD for the cut-off cat
    assert not any("\ufffd" in line for line in lines) and cursor_visible
    assert b"Traceback" not in term.shown
    messages = json.loads((tmp_path / "held.json").read_text())["messages"]
    assert messages[-1] == {"role": "assistant", "content": "é", "interrupted": True}


@pytest.mark.parametrize("presses", [2, 3])
def test_ctrl_c_pressed_again_and_again_leaves_no_markers_and_no_echo(held, tmp_path, presses):
    """However many Ctrl+C land, and wherever (the reply, its end, the prompt), the screen keeps
    the committed text only: no pending markers, no ^C."""
    term = Pty("-m", str(held), "--template", "llama2", "-t", "0", "-c", "0", "--no-history",
               XDG_STATE_HOME=str(tmp_path))
    term.read_until(lambda: b">>> " in term.shown)
    term.type(b"draft")
    term.read_until(lambda: b"draft" in term.shown)
    term.type(b"\x03")  # at the prompt, on a line with text: the text is dropped, the chat goes on
    term.read_until(lambda: term.shown.count(b">>> ") >= 2)
    term.type(b"hi\r")
    asked = len(term.shown)
    term.read_until(lambda: "é".encode() in term.shown[asked:] and term.shown[asked:].count(b".") >= 3)
    for pressed in range(1, presses + 1):
        before = len(term.shown)
        term.type(b"\x03")
        # The next press once the chat has taken this one (its notice, its exit, or at the prompt
        # the terminal's echo; a reply holds the echo off), so that the two are two signals.
        try:
            term.read_until(lambda: echoes(term.shown[asked:]) >= pressed or b"interrupted" in term.shown[before:]
                            or term.proc.poll() is not None, timeout=2)
        except AssertionError:
            pass  # taken without a sign: should the signals merge, the chat is at its prompt (below)
    # The second Ctrl+C ends the chat: in the reply at once (130), at the prompt (0), or in between
    # (130). Should the signals have merged into one, the chat is at its prompt: Ctrl+D leaves.
    term.read_until(lambda: term.proc.poll() is not None or term.shown.rstrip().endswith(b">>>"))
    if term.proc.poll() is None:
        try:
            term.type(b"\x04")
        except OSError:  # it had just left after all
            pass
    status = term.finish()
    lines, cursor_visible = screen(term.shown)
    assert status in (0, 130), term.shown
    assert lines[lines.index(">>> draft") + 1] == ">>> hi"
    assert lines[lines.index(">>> hi") + 1] == "é", lines  # no markers, no ^C
    # A press that lands after the chat has left (after its finish line, or after its last prompt
    # when it leaves from there) finds the terminal given back as it was (^C echoed again): what
    # the screen must keep clean is the chat's own part.
    last = max(i for i, line in enumerate(lines) if line.startswith((">>>", "finish:")))
    assert not any("^C" in line for line in lines[:last + 1]), lines
    assert cursor_visible and b"Traceback" not in term.shown


@contextmanager
def busy_cpus() -> Iterator[None]:
    """Every core kept busy by a process of its own while inside."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


PRESSES = 30


def test_ctrl_c_at_the_prompt_acts_every_time_on_a_busy_machine(tiny, tmp_path):
    """Each Ctrl+C at the prompt, pressed as soon as the line's echo shows, drops the line and
    gives a fresh prompt: pressed once, however busy the machine. Only the main thread takes the
    signal, and one that lands just before readline starts waiting still ends the wait."""
    with busy_cpus():
        term = Pty("-m", str(tiny.path), "--template", "llama2", "-t", "0", "-n", "8", "--no-history",
                   XDG_STATE_HOME=str(tmp_path))
        term.read_until(lambda: b">>> " in term.shown)
        term.type(b"hi\r")  # a reply first: the step thread and its OpenMP helpers are there too
        term.read_until(lambda: term.shown.count(b">>> ") >= 2)
        assert len(blocked_signals(term.proc.pid)) >= 2
        assert threads_taking_signals(term.proc.pid) == []
        for i in range(PRESSES):
            prompts = term.shown.count(b">>> ")
            draft = f"draft {i}".encode()
            term.type(draft)
            term.read_until(lambda: draft in term.shown)
            term.type(b"\x03")
            term.read_until(lambda: term.shown.count(b">>> ") > prompts)
        term.type(b"\x03")  # at an empty prompt: the chat leaves
        status = term.finish()
    lines, _ = screen(term.shown)
    assert status == 0, term.shown
    start = lines.index(">>> draft 0")
    assert lines[start:start + PRESSES] == [f">>> draft {i}" for i in range(PRESSES)]  # each line dropped, no reply
    assert b"Traceback" not in term.shown


def echoes(shown: bytes) -> int:
    """Ctrl+C the terminal has echoed: as ^C, or as the raw character when ECHOCTL is off."""
    return shown.count(b"^C") + shown.count(b"\x03")


def test_replies_and_stats_wrap_at_spaces_on_a_narrow_terminal(tmp_path):
    """On a 30-column terminal no word of the reply, of /stats or of a notice is cut in two."""
    columns = 30
    term = Pty("-t", "0", "-n", "60", "--no-history", columns=columns, XDG_STATE_HOME=str(tmp_path))
    term.read_until(lambda: b">>> " in term.shown)
    for typed in (b"Tell me a story", b"/stats", b"/save " + str(tmp_path / "w.json").encode()):
        prompts = term.shown.count(b">>> ")
        term.type(typed + b"\r")
        term.read_until(lambda: term.shown.count(b">>> ") > prompts)
    term.type(b"\x04")
    assert term.finish() == 0, term.shown
    lines, _ = screen(term.shown, columns=columns)
    start = lines.index(">>> Tell me a story") + 1
    end = lines.index("finish: max_tokens", start)
    assert all(len(line) < columns for line in lines[start:end]), lines  # the reply leaves the last column free
    reply = json.loads((tmp_path / "w.json").read_text())["messages"][1]["content"]
    assert end - start > 3  # a reply of several lines
    # Joined with spaces, the lines hold the reply's words: a word cut in two would be two words.
    assert " ".join(lines[start:end]).split() == reply.split()
    save = next(i for i, line in enumerate(lines) if line.startswith(">>> /save"))
    stats = " ".join(lines[lines.index(">>> /stats") + 1:save])
    assert re.fullmatch(r"prompt: \d+ tokens \(\d+ from the cache, \d+ prefilled\) +reply: 60 tokens, max_tokens +"
                        r"ttft: [\d.]+ s +prefill: [\d.]+ tok/s +decode: [\d.]+ tok/s +"
                        r"(?:drafts: \d+ of \d+ tokens kept +)?context: \d+/\d+ +pages: "
                        r"\d+ kept, \d+ free of \d+ \(8 tokens each\) +weights: [\w ,+.]+ \([\d.]+ [kMG]?B\)", stats), stats
    notice = " ".join(lines[:lines.index(">>> Tell me a story")])
    assert notice.split() == ("chatting with default (llama2 format, 512 tokens of context); /help for commands, "
                              "Ctrl+D to leave").split()


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
    # The piped message is shown as the user's turn, as if it had been typed, then the reply.
    child.expect_exact(">>> Tell me a story\r\n")
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
    assert proc.stdout.decode() == text[:text.find(stop)] + "\n"  # a pipe's output ends its line
    assert b"finish: stop_string" in proc.stderr


def test_the_help_says_how_to_send_a_message_that_starts_with_a_slash():
    from llama_chat.cmd.chat import HELP

    assert "//etc/hosts is sent as /etc/hosts" in " ".join(HELP.split())

"""A thinking model at the terminal and in pipes: the thinking dimmed as it streams, folded to one
line once the answer starts, hidden on request, left out of a pipe, switched off in the chat, and
kept apart when Ctrl+C stops it (tiny random Qwen3- and R1-distill-style models whose tags are
tokens)."""

from __future__ import annotations

import json
import re

import pexpect
import pytest
from tokenizers import Tokenizer

from cli_support import cli_env, run_cli, spawn_cli
from llama_chat.cmd.sanitize import displayable
from terminal_support import WAIT_S
from tool_builders import build_tool_model

DIM = "\x1b[2m"
ARGS = ("-t", "0", "-n", "24", "--reasoning-budget", "6")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def record(qwen3) -> dict:
    """The one-shot reply under ``ARGS`` as --json gives it: what the other views are checked against."""
    return as_json(qwen3)


@pytest.fixture(scope="module")
def r1(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("r1"), "r1")


def as_json(model, *args: str) -> dict:
    done = run_cli("-m", str(model), "-p", "Hello", *ARGS, *args, "--json", timeout=WAIT_S * 2)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


def on_terminal(model, *args: str) -> str:
    child = spawn_cli(["-m", str(model), "-p", "Hello", *ARGS, *args], env=cli_env(),
                      timeout=WAIT_S, encoding="utf-8", dimensions=(40, 160))
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    return child.before


def visible(text: str) -> str:
    return re.sub(r"\x1b(\[[0-9;?]*[A-Za-z]|[78])", "", text)


def test_the_thinking_streams_dimmed_then_folds_to_one_line_before_the_answer(qwen3, record):
    assert record["reasoning"] and record["reasoning_tokens"] == 6
    shown = on_terminal(qwen3)
    dimmed = shown.index(DIM)
    assert displayable(record["reasoning"])[:3] in visible(shown[dimmed:shown.index("thought for")])
    fold = shown.index("thought for")
    assert "\x1b[J" in shown[dimmed:fold]  # the thinking's lines taken back before the line is written
    assert re.search(r"thought for \d+ tokens, \d+\.\d s", visible(shown))
    assert displayable(record["text"])[:3] in visible(shown[fold:])


def test_hide_thinking_shows_only_the_line(qwen3, record):
    shown = visible(on_terminal(qwen3, "--hide-thinking"))
    assert "thought for" in shown
    assert displayable(record["reasoning"]) not in shown


def test_a_pipe_gets_the_answer_only(qwen3, record):
    done = run_cli("-m", str(qwen3), "-p", "Hello", *ARGS, timeout=WAIT_S * 2)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode() == displayable(record["text"]) + "\n"


def test_think_off_on_the_command_line_and_in_the_chat(qwen3, tmp_path):
    assert "reasoning" not in as_json(qwen3, "--think", "off")
    child = spawn_cli(["-m", str(qwen3), *ARGS, "--no-history"],
                      env=cli_env(XDG_STATE_HOME=str(tmp_path)), timeout=WAIT_S, encoding="utf-8",
                      dimensions=(40, 160))
    child.expect_exact(">>> ")
    child.sendline("Hello")
    child.expect_exact("thought for")
    child.expect_exact(">>> ")
    child.sendline("/think off")
    child.expect_exact("thinking off")
    child.expect_exact(">>> ")
    child.sendline("Hello again")
    child.expect_exact(">>> ")
    assert "thought for" not in child.before
    child.sendline("/save " + str(tmp_path / "c.json"))
    child.expect_exact(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    messages = json.loads((tmp_path / "c.json").read_text())["messages"]
    assert messages[1]["reasoning"] and "reasoning" not in messages[3]


def test_ctrl_c_during_the_thinking_keeps_it_as_thinking_not_as_content(r1, tmp_path):
    # The template opens the thinking; no budget, and the end tags banned: it thinks until stopped.
    vocab = Tokenizer.from_file(str(r1 / "tokenizer.json"))
    banned = [f"{vocab.token_to_id(t)}=-inf" for t in ("</think>", "<|im_end|>", "<|endoftext|>")]
    child = spawn_cli(["-m", str(r1), "-t", "0", "-n", "4000", "--no-history",
                       *(a for b in banned for a in ("--logit-bias", b))],
                      env=cli_env(XDG_STATE_HOME=str(tmp_path)), timeout=WAIT_S, encoding="utf-8",
                      dimensions=(40, 160))
    child.expect_exact(">>> ")
    child.sendline("Hello")
    child.expect("(?s)(\x1b\\[2m.*?){5}")  # five pieces of the thinking drawn, dimmed
    child.sendintr()
    child.expect_exact("interrupted")
    child.expect_exact(">>> ")
    child.sendline("/save " + str(tmp_path / "c.json"))
    child.expect_exact(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    messages = json.loads((tmp_path / "c.json").read_text())["messages"]
    assert messages[1]["interrupted"] is True
    assert messages[1]["reasoning"] and messages[1]["content"] == ""


def test_batch_lines_choose_their_thinking_and_records_carry_it(qwen3):
    lines = "\n".join(json.dumps(line) for line in (
        {"prompt": "Hello", "reasoning_budget": 3}, {"prompt": "Hello", "think": "off"},
        {"prompt": "Hello", "think": "maybe"}, {"prompt": "Hello", "reasoning_budget": -2})) + "\n"
    done = run_cli("-m", str(qwen3), "--batch", "-t", "0", "-n", "12", "--ordered", stdin=lines.encode(),
                   timeout=WAIT_S * 2)
    records = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert records[0]["reasoning_tokens"] == 3 and records[0]["reasoning"]
    assert "reasoning" not in records[1] and records[1]["prompt_tokens"] > records[0]["prompt_tokens"]
    assert records[2]["error"] == "'think' must be one of auto, on, off, got 'maybe'"
    assert records[3]["error"].startswith("reasoning_budget must be an integer in 0 <= n")


def test_a_template_file_replaces_the_models_own_and_a_bad_one_is_one_line(qwen3, record, tmp_path):
    opened = tmp_path / "opened.jinja"
    opened.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    opened_record = as_json(qwen3, "--chat-template-file", str(opened), "--reasoning-budget", "4")
    end = Tokenizer.from_file(str(qwen3 / "tokenizer.json")).token_to_id("</think>")
    # The prompt opened the thinking: four tokens of it, then the end tag, with no start tag before.
    assert opened_record["reasoning_tokens"] == 4 and opened_record["token_ids"][4] == end
    assert opened_record["prompt_tokens"] != record["prompt_tokens"]
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    done = run_cli("-m", str(qwen3), "-p", "Hi", "--chat-template-file", str(broken), timeout=WAIT_S * 2)
    err = done.stderr.decode()
    assert done.returncode == 2 and str(broken) in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_drafting_inside_the_thinking_keeps_the_same_reply(qwen3):
    assert as_json(qwen3, "--lookup", "on")["token_ids"] == as_json(qwen3, "--lookup", "off")["token_ids"]

"""The installed ``llama-chat`` process: input sources, plain and JSON output, exit statuses."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from cli_support import (ANSI, RUN_TIMEOUT_S, build_tiny_model, cli_env, json_result, llama_chat_command, popen_cli,
                         run_cli)
from llama_chat.cmd.sanitize import displayable
from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("cli_one_shot"))


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return SentencePieceTokenizer(tiny.tokenizer_path)


def greedy(tiny, *args: str, stdin: bytes | None = None) -> dict:
    return json_result(run_cli("-m", str(tiny.path), "-t", "0", "--json", *args, stdin=stdin))


def test_piped_stdin_is_the_prompt_and_stdout_is_only_plain_text(tiny):
    proc = run_cli("-m", str(tiny.path), "-t", "0", "-n", "24", "--color", "always",
                   stdin=(PROMPT + "\n").encode())
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout and not ANSI.search(proc.stdout) and b"\x1b" not in proc.stdout
    # The same text as the same prompt given with --prompt (the trailing newline is dropped),
    # except that control characters the model emits are shown as pictures, never written raw.
    same = greedy(tiny, "-n", "24", "-p", PROMPT)
    assert proc.stdout.decode() == displayable(same["text"]) + "\n"  # the answer ends its line
    err = ANSI.sub(b"", proc.stderr)  # --color always colours stderr, a terminal or not
    assert b"finish: max_tokens" in err
    assert b"seed: " not in err and same["seed"] is None  # greedy and unseeded: no seed matters


def test_piped_output_ends_its_line_so_the_finish_line_stands_alone(tiny):
    """`2>&1`: the answer, a newline, then the finish line, as llm and Ollama write them; --json
    is one line of JSON as before."""
    read_fd, write_fd = os.pipe()
    proc = popen_cli([*llama_chat_command(), "-m", str(tiny.path), "-t", "0", "-n", "9", "-p", PROMPT], cli_env(),
                     stdin=subprocess.DEVNULL, stdout=write_fd, stderr=write_fd)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as both:
        shown = both.read().decode()
    assert proc.wait(timeout=RUN_TIMEOUT_S) == 0
    text = greedy(tiny, "-n", "9", "-p", PROMPT)["text"]
    assert text and not text.endswith("\n")
    assert shown == displayable(text) + "\nfinish: max_tokens\n"
    as_json = run_cli("-m", str(tiny.path), "-t", "0", "-n", "9", "-p", PROMPT, "--json")
    assert as_json.stdout.count(b"\n") == 1 and as_json.stdout.endswith(b"}\n")


def test_prompt_then_blank_line_then_stdin(tiny, tokenizer):
    out = greedy(tiny, "-n", "3", "-p", "Summarise:", stdin="the fox and the rabbit\n".encode())
    assert out["prompt_tokens"] == len(tokenizer.encode("Summarise:\n\nthe fox and the rabbit", bos=True))


def test_invalid_utf8_on_stdin_is_replaced_not_fatal(tiny):
    out = greedy(tiny, "-n", "2", stdin=b"caf\xe9 au lait")
    assert out["finish_reason"] == "max_tokens"


def test_json_fields_and_greedy_parity_with_transformers(tiny, tokenizer):
    transformers = pytest.importorskip("transformers")
    from builders_formats import hf_config, hf_state

    n = 24
    out = greedy(tiny, "-n", str(n), "-p", PROMPT, "--seed", "5")
    # "speculation": what prompt lookup (--lookup auto: on for this float32 model) drafted and kept.
    assert set(out) - {"speculation"} == {"text", "token_ids", "finish_reason", "prompt_tokens",
                                          "completion_tokens", "seed", "model", "timings"}
    assert set(out["timings"]) == {"ttft_s", "prefill_tok_s", "decode_tok_s"}
    assert out["finish_reason"] == "max_tokens" and out["completion_tokens"] == n == len(out["token_ids"])
    assert out["seed"] == 5 and out["model"] == tiny.path.name
    assert out["timings"]["ttft_s"] > 0 and out["timings"]["decode_tok_s"] > 0
    prompt_ids = tokenizer.encode(PROMPT, bos=True)
    assert out["prompt_tokens"] == len(prompt_ids)
    text_bytes = b"".join(tokenizer.token_bytes(t) for t in out["token_ids"])
    assert out["text"] == text_bytes.decode("utf-8", errors="replace")

    config = transformers.LlamaConfig(**{k: v for k, v in hf_config(tiny.model).items() if k != "architectures"})
    hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(hf_state(tiny.model), strict=False)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.inference_mode():
        ids = hf.eval().generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    assert out["token_ids"] == ids[0, len(prompt_ids):].tolist()


def test_sampling_is_reproducible_with_a_seed_and_reports_a_random_one(tiny):
    args = ("-m", str(tiny.path), "-n", "12", "-p", PROMPT, "--json", "-t", "1.2")
    first = json_result(run_cli(*args))
    assert isinstance(first["seed"], int)
    again = json_result(run_cli(*args, "--seed", str(first["seed"])))
    assert again["token_ids"] == first["token_ids"] and again["seed"] == first["seed"]


def test_stats_go_to_stderr(tiny):
    proc = run_cli("-m", str(tiny.path), "-t", "0", "-n", "5", "-p", PROMPT, "--stats", "--seed", "9")
    assert proc.returncode == 0
    err = proc.stderr.decode()
    for word in ("load", "ttft", "prefill", "decode", "tok/s", "5 generated", "seed: 9", "finish: max_tokens"):
        assert word in err
    assert "ttft" not in proc.stdout.decode()


@pytest.mark.parametrize("args, seed", [(("-t", "0"), None), (("-t", "0", "--seed", "9"), "9"),
                                        (("-t", "0.8"), "drawn")])
def test_stats_name_the_seed_once_and_the_load_time(tiny, args, seed):
    """The seed is said once (on the finish line), and only when it matters: the user's, or the one
    a sampled run drew. The load time is there, so the wait before the first token is accounted for."""
    proc = run_cli("-m", str(tiny.path), "-n", "5", "-p", PROMPT, "--stats", *args)
    assert proc.returncode == 0, proc.stderr.decode()
    finish, stats = proc.stderr.decode().splitlines()
    assert stats.startswith("tokens: ") and "seed" not in stats
    load = re.search(r"load: ([\d.]+) s  ttft: ([\d.]+) s", stats)
    assert load and float(load.group(1)) > 0, stats
    if seed is None:
        assert finish == "finish: max_tokens"
    elif seed == "drawn":
        assert re.fullmatch(r"finish: max_tokens  seed: \d+", finish), finish
    else:
        assert finish == f"finish: max_tokens  seed: {seed}"


def test_system_message_through_a_chat_template(tiny, tokenizer):
    plain = greedy(tiny, "-n", "6", "-p", PROMPT, "--template", "llama2")
    with_system = greedy(tiny, "-n", "1", "-p", PROMPT, "-s", "Be brief.", "--template", "llama2")
    assert with_system["prompt_tokens"] > plain["prompt_tokens"]
    # A chat reply drops the word-start space SentencePiece puts before its first word.
    raw = b"".join(tokenizer.token_bytes(t) for t in plain["token_ids"]).decode("utf-8", errors="replace")
    assert plain["text"] == (raw[1:] if raw.startswith(" ") else raw)


@pytest.mark.parametrize("case", ["missing model", "unreadable checkpoint", "empty prompt", "blank stdin",
                                  "prompt longer than the context", "bad option", "system without template",
                                  "top-p zero"])
def test_usage_errors_exit_2_with_one_line(tiny, tmp_path, case):
    model = str(tiny.path)
    stdin = None
    if case == "missing model":
        args = ["-m", str(tmp_path / "nowhere"), "-p", PROMPT]
    elif case == "unreadable checkpoint":
        broken = tmp_path / "broken"
        broken.mkdir()
        for f in tiny.path.iterdir():
            (broken / f.name).write_bytes(f.read_bytes())
        (broken / "consolidated.00.pth").write_bytes(b"this is not a checkpoint")
        args = ["-m", str(broken), "-p", PROMPT]
    elif case == "empty prompt":
        args = ["-m", model, "-p", ""]
    elif case == "blank stdin":
        args, stdin = ["-m", model], b"  \n\n"
    elif case == "prompt longer than the context":
        args = ["-m", model, "-p", "the fox " * 1000]
    elif case == "bad option":
        args = ["-m", model, "-p", PROMPT, "--template", "nonsense"]
    elif case == "system without template":
        args = ["-m", model, "-p", PROMPT, "-s", "Be brief.", "--template", "none"]
    else:
        args = ["-m", model, "-p", PROMPT, "--top-p", "0"]
    proc = run_cli(*args, stdin=stdin)
    assert proc.returncode == 2, proc.stderr.decode()
    assert proc.stdout == b"" and b"Traceback" not in proc.stderr
    if case != "bad option":  # typer's own usage message is a few lines
        assert proc.stderr.decode().strip().count("\n") == 0, proc.stderr.decode()


def test_a_model_or_draft_that_is_nowhere_is_refused_before_torch_is_imported(tmp_path):
    for args in (["-m", str(tmp_path / "nowhere")], ["--draft", str(tmp_path / "nowhere")]):
        code = ("import sys; from llama_chat.cmd.app import app; from llama_chat.cmd.typer_command import parse\n"
                "print(parse(app, sys.argv[1:], 'llama-chat')(), 'torch' in sys.modules)")
        proc = subprocess.run([sys.executable, "-c", code, *args, "-p", "hi", "--no-stdin"], capture_output=True,
                              text=True, timeout=RUN_TIMEOUT_S, env=cli_env())
        assert proc.stdout.split() == ["2", "False"], proc.stderr
        assert "nowhere: no such file or directory" in proc.stderr


def test_no_prompt_and_stdin_a_terminal_is_a_usage_error(tiny):
    primary, secondary = os.openpty()
    try:
        proc = popen_cli([*llama_chat_command(), "-m", str(tiny.path)], cli_env(), stdin=secondary,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        os.close(primary)
        os.close(secondary)
    assert proc.returncode == 2 and b"no prompt" in err


def test_other_failures_exit_1_with_one_line_and_a_traceback_only_with_debug(tiny, tmp_path):
    # An internal failure, injected: the model's forward raises (sitecustomize runs at start-up).
    (tmp_path / "sitecustomize.py").write_text(
        "from llama_chat.model import transformer\n"
        "def _fail(self, *args, **kwargs):\n"
        "    raise RuntimeError('injected failure')\n"
        "transformer.Transformer.forward = _fail\n"
    )
    args = ("-m", str(tiny.path), "-p", PROMPT, "-n", "2")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = run_cli(*args, **env)
    assert proc.returncode == 1, proc.stderr.decode()
    assert proc.stdout == b"" or not ANSI.search(proc.stdout)
    lines = [line for line in proc.stderr.decode().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("llama-chat: error:"), lines
    debug = run_cli(*args, "--debug", **env)
    assert debug.returncode == 1 and b"Traceback" in debug.stderr


def test_version_and_help():
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith(b"llama-chat ")
    helped = run_cli("--help")
    assert helped.returncode == 0
    for option in ("--model", "--prompt", "--system", "--max-tokens", "--temperature", "--top-p", "--seed",
                   "--device", "--dtype", "--template", "--json", "--stats", "--color", "--version"):
        assert option.encode() in helped.stdout
    # One style of placeholder (-n N, --prompt TEXT, --color auto|always|never), not typer's <int>.
    for shown in (helped, run_cli("serve", "--help")):
        assert shown.returncode == 0 and re.search(rb"--[\w-]+ N ", shown.stdout)
        assert not re.search(rb"--[\w-]+ <", shown.stdout), shown.stdout.decode()

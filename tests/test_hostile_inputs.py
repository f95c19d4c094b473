"""Hostile and nonsense inputs: one line on stderr, never an escape code, exit status 2.

Every case builds a small bad model directory (or passes a bad option). Each runs through the
command's own entry (``app``, in this process: options, loading, error reporting, exit status),
and a sample of one case per kind also through the installed ``llama-chat`` process; those runs
are started together in a pool, since each spends most of its time importing torch.
docs/bad-inputs.md lists the same cases with their messages.
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from builders import random_model, tiny_args, write_meta_checkpoint
from builders_formats import write_hf_checkpoint, write_meta_shards
from cli_support import run_cli
from llama_chat.cmd import app as cli_app
from llama_chat.cmd import main as cli_main
from llama_chat.cmd.typer_command import parse

ESC = "\x1b]0;pwned\x07\x1b[2J\x1b[31m"
TIMEOUT = 120  # generous: a busy two-core machine; a case that hangs or eats memory fails here


def _edit(path: Path, **fields) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


def _hf_with_template(tmp: Path, sp: Path, vocab: int, template: str) -> Path:
    out = write_hf_checkpoint(random_model(tiny_args(vocab)), tmp, sp)
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return out


def _llama2c_v1(tmp: Path, layers: int) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    header = struct.pack("<Ii7iB", 0x616B3432, 1, 64, 160, layers, 4, 4, 400, 256, 1)
    path = tmp / "model.bin"
    path.write_bytes(header + b"\0" * (256 - len(header)) + b"\0" * 1024)
    return path


def _with_tokenizer(path: Path, sp: Path) -> Path:
    shutil.copy(sp, path.parent / "tokenizer.model")
    return path


def _tiktoken_missing_byte(tmp: Path, sp: Path, vocab: int) -> Path:
    out = write_meta_checkpoint(random_model(tiny_args(vocab)), tmp, None)
    lines = [f"{base64.b64encode(bytes([b])).decode()} {i}" for i, b in enumerate(b for b in range(256) if b != 0x41)]
    (out / "tokenizer.model").write_text("\n".join(lines) + "\n")
    return out


def _bad_shard(tmp: Path, sp: Path, vocab: int) -> Path:
    out = write_meta_shards(random_model(tiny_args(vocab)), tmp, sp)
    state = torch.load(out / "consolidated.01.pth", weights_only=True)
    state["layers.0.attention.wq.weight"] = torch.zeros(32, 48)
    torch.save(state, out / "consolidated.01.pth")
    return out


def _weight_map(tmp: Path, sp: Path, vocab: int, value) -> Path:
    out = write_hf_checkpoint(random_model(tiny_args(vocab)), tmp, sp)
    (out / "model.safetensors").rename(out / "part.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": value, "model.norm.weight": "part.safetensors"}}))
    return out


def _cases(tmp: Path, sp: Path, vocab: int) -> dict[str, tuple[list[str], str]]:
    """case id -> (arguments, a piece of the expected message)."""
    meta = lambda name: write_meta_checkpoint(random_model(tiny_args(vocab)), tmp / name, sp)  # noqa: E731
    hf = lambda name: write_hf_checkpoint(random_model(tiny_args(vocab)), tmp / name, sp)  # noqa: E731
    cases: dict[str, tuple[list[str], str]] = {}

    def add(name: str, path: Path, expect: str, *extra: str) -> None:
        cases[name] = (["-m", str(path), "-p", "hi", "-n", "2", *extra], expect)

    d = hf("escape_config")
    _edit(d / "config.json", model_type=ESC)
    add("escape codes in a config value", d, "model_type '\\x1b]0;pwned\\x07\\x1b[2J")
    add("escape codes in a weight_map file name", _weight_map(tmp / "escape_map", sp, vocab, ESC + ".bin"),
        "␛]0;pwned␇␛[2J␛[31m.bin: weights file listed in the index is missing")
    add("escape codes in a template's raise_exception",
        _hf_with_template(tmp / "escape_raise", sp, vocab, "{{ raise_exception('" + ESC + "bad') }}"),
        "chat template: ␛]0;pwned␇␛[2J␛[31mbad")
    d = meta("huge_meta")
    _edit(d / "params.json", n_layers=10**9)
    add("n_layers 10**9 in params.json", d, "n_layers 1000000000 is larger than any model's")
    d = meta("big_meta")
    _edit(d / "params.json", n_layers=10**6)
    add("n_layers 10**6 in params.json", d, "params.json: describes a model of")
    d = hf("huge_hf")
    _edit(d / "config.json", num_hidden_layers=10**6)
    add("num_hidden_layers 10**6 in config.json", d, "config.json: describes a model of")
    add("n_layers 2**31-1 in a llama2.c header", _with_tokenizer(_llama2c_v1(tmp / "huge_l2c", 2**31 - 1), sp),
        "n_layers 2147483647 is larger")
    add("n_layers 10**6 in a llama2.c header", _with_tokenizer(_llama2c_v1(tmp / "big_l2c", 10**6), sp),
        "truncated: expected")
    for name, template, expect in (
        ("template 'a'*4*10**9", "{{ 'a'*4*10**9 }}", "'*' would make a value of 4,000,000,000"),
        ("template tojson(indent=10**8)", "{{ messages|tojson(indent=10**8) }}", "tojson"),
        ("template nested range loops", "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
                                        "{% endfor %}", "steps"),
        ("template doubling a string with ~", "{% set ns = namespace(s='ab'*1000) %}{% for i in range(40) %}"
                                              "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
         "more than the limit"),
        ("template render error", "{{ 1 / 0 }}", "chat template: ZeroDivisionError"),
    ):
        add(name, _hf_with_template(tmp / name.replace(" ", "_").replace("*", "x").replace("/", "_")[:40], sp, vocab,
                                    template), expect)
    for name, field, value, expect in (
        ("rope_theta 0", "rope_theta", 0, "rope_theta must be a positive finite number"),
        ("rope_theta negative", "rope_theta", -1.0, "rope_theta must be a positive finite number"),
        ("fractional dim", "dim", 64.5, "dim must be an integer, found 64.5"),
        ("negative n_heads", "n_heads", -4, "n_heads must be positive"),
        ("norm_eps a string", "norm_eps", "small", "norm_eps must be a number"),
    ):
        d = meta(name.replace(" ", "_"))
        _edit(d / "params.json", **{field: value})
        add(name, d, expect)
    for name, raw, expect in (
        ("JSON NaN norm_eps", '"norm_eps": NaN', "NaN is not a valid JSON value"),
        ("JSON Infinity", '"rope_theta": Infinity', "Infinity is not a valid JSON value"),
        ("JSON 5000-digit integer", '"n_layers": ' + "9" * 5000, "an integer of 5000 digits"),
    ):
        d = meta(name.replace(" ", "_"))
        text = (d / "params.json").read_text()
        (d / "params.json").write_text(text[:-1] + ", " + raw + "}")
        add(name, d, expect)
    d = meta("deep_json")
    (d / "params.json").write_text("[" * 100_000 + "]" * 100_000)
    add("JSON nested 100,000 deep", d, "params.json: not valid JSON")
    d = hf("rope_string")
    _edit(d / "config.json", rope_parameters="llama3")
    add("rope_parameters a string", d, "rope_parameters must be an object")
    add("weight_map with a non-string value", _weight_map(tmp / "map_int", sp, vocab, 7),
        "weight_map must map tensor names to file names")
    add("weight_map outside the model directory", _weight_map(tmp / "map_out", sp, vocab, "../../etc/passwd.bin"),
        "not a file in the model directory")
    add("a shard with a bad shape", _bad_shard(tmp / "bad_shard", sp, vocab), "cannot be joined")
    add("tiktoken file without a single-byte token", _tiktoken_missing_byte(tmp / "tiktoken", sp, vocab),
        "no token for the single byte 0x41")
    good = meta("good")
    add("--device meta", good, "Invalid value for '--device'", "--device", "meta")
    add("-t inf", good, "must be a finite number >= 0, got inf", "-t", "inf")
    add("--seed 2**64", good, "2**64-1, got 18446744073709551616", "--seed", str(2**64))
    add("--top-p 2", good, "must be in 0 < p <= 1, got 2.0", "--top-p", "2")
    add("-c larger than the model's context", good, "a context of 100000 tokens was asked for", "-c", "100000")
    return cases


@pytest.fixture(scope="module")
def cases(tmp_path_factory, sp_model_path, sp_vocab_size):
    return _cases(tmp_path_factory.mktemp("hostile"), sp_model_path, sp_vocab_size)


# One case of each kind also runs as its own process (the rest differ only in the loader).
THROUGH_THE_COMMAND = [
    "escape codes in a template's raise_exception", "n_layers 10**9 in params.json",
    "n_layers 2**31-1 in a llama2.c header", "template 'a'*4*10**9", "JSON Infinity", "a shard with a bad shape",
    "tiktoken file without a single-byte token", "--device meta", "-t inf", "--seed 2**64",
]


@pytest.fixture(scope="module")
def command_results(cases):
    def run(args: list[str]) -> subprocess.CompletedProcess:
        return run_cli(*args, timeout=TIMEOUT)

    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(run, cases[name][0]) for name in THROUGH_THE_COMMAND}
        return {name: future.result() for name, future in futures.items()}


CASE_NAMES = [
    "escape codes in a config value", "escape codes in a weight_map file name",
    "escape codes in a template's raise_exception", "n_layers 10**9 in params.json", "n_layers 10**6 in params.json",
    "num_hidden_layers 10**6 in config.json", "n_layers 2**31-1 in a llama2.c header",
    "n_layers 10**6 in a llama2.c header", "template 'a'*4*10**9", "template tojson(indent=10**8)",
    "template nested range loops", "template doubling a string with ~", "template render error", "rope_theta 0",
    "rope_theta negative", "fractional dim", "negative n_heads", "norm_eps a string", "JSON NaN norm_eps",
    "JSON Infinity", "JSON 5000-digit integer", "JSON nested 100,000 deep", "rope_parameters a string",
    "weight_map with a non-string value", "weight_map outside the model directory", "a shard with a bad shape",
    "tiktoken file without a single-byte token", "--device meta", "-t inf", "--seed 2**64", "--top-p 2",
    "-c larger than the model's context",
]


def _check(status: int, err: str, expect: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("llama-chat: error: "), err
    assert expect in lines[0], lines[0]
    assert "\x1b" not in err and "\x07" not in err and "Traceback" not in err


@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_input_is_one_safe_line_and_exit_2(cases, case, capsys):
    args, expect = cases[case]
    capsys.readouterr()
    try:
        status = parse(cli_app.app, [*args, "--no-stdin"], "llama-chat")()
    except cli_main.ClickException as e:  # what main() does with a usage error
        status = cli_main.usage_error(e)
    out, err = capsys.readouterr()
    _check(status, err, expect)
    assert out == ""


@pytest.mark.parametrize("case", THROUGH_THE_COMMAND)
def test_bad_input_through_the_installed_command(cases, command_results, case):
    proc = command_results[case]
    _check(proc.returncode, proc.stderr.decode("utf-8", errors="replace"), cases[case][1])
    assert proc.stdout == b""


def test_every_case_is_checked(cases):
    assert sorted(cases) == sorted(CASE_NAMES)


def test_padded_vocabulary_ids_are_never_sampled(tmp_path, sp_model_path, sp_vocab_size):
    """Rows past the tokenizer's vocabulary that would always win: the run still ends well."""
    pad = 64
    model = random_model(tiny_args(sp_vocab_size + pad), seed=5)
    with torch.no_grad():
        model.output.weight[sp_vocab_size:] = model.output.weight[:pad] * 0 + 5.0  # huge logits
    out = write_meta_checkpoint(model, tmp_path / "padded", sp_model_path)
    proc = run_cli("-m", str(out), "-p", "hi", "-n", "12", "--json", "-t", "1.0", "--seed", "3", timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr.decode()
    ids = json.loads(proc.stdout)["token_ids"]
    assert ids and max(ids) < sp_vocab_size

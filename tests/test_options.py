"""Every range and choice is defined once (``ml/controls.py``, the chat formats' names) and the
command line, a ``--batch`` line and the chat's ``/set`` all check against it, with one reason."""

from __future__ import annotations

import json

import pytest
import typer

from cli_support import build_tiny_model, run_cli
from llama_chat.cmd import app as cli
from llama_chat.cmd.main import ClickException
from llama_chat.cmd.batch_input import SETTING_KEYS, BadLine, JobLine, parse_line
from llama_chat.cmd.chat_settings import SETTING_NAMES, Settings, apply_setting
from llama_chat.cmd.options import Options
from llama_chat.ml.controls import COLOR_MODES, DTYPES, QUANTIZE_MODES, RULES, ControlError, check
from llama_chat.model.chat_format import FORMAT_NAMES

# For each rule: a value just outside its range, and one just inside.
EDGES = {
    "temperature": (-0.01, 0.0),
    "top_p": (1.01, 1.0),
    "top_k": (-1, 0),
    "min_p": (1.01, 1.0),
    "typical_p": (0.0, 0.01),
    "repetition_penalty": (0.0, 0.01),
    "repeat_last_n": (-1, 0),
    "presence_penalty": (2.01, 2.0),
    "frequency_penalty": (-2.01, -2.0),
    "no_repeat_ngram_size": (-1, 0),
    "min_new_tokens": (-1, 0),
    "num_beams": (65, 64),
    "draft_max": (65, 64),
    "length_penalty": (10.01, 10.0),
    "num_return": (0, 1),
    "max_time": (0.0, 0.01),
    "max_tokens": (0, 1),
    "seed": (2**64, 2**64 - 1),
    "ctx_size": (-1, 0),
    "max_batch": (0, 1),
    "cache_tokens": (0, 1),
    "prompt_cache_size": (0, 1),
    "reasoning_budget": (-1, 0),
}

COMMAND = typer.main.get_command(cli.app)


def flag(name: str) -> str:
    return next(p for p in COMMAND.params if p.name == name).opts[0]


def command_line_error(*args: str) -> str | None:
    """What the command line says of ``args`` (parsed and checked, nothing run); None: accepted."""
    try:
        COMMAND.make_context("llama-chat", list(args))
    except ClickException as e:
        return e.format_message()
    return None


def reason(name: str, value) -> str:
    with pytest.raises(ControlError) as info:
        check(name, value)
    return info.value.reason


def test_every_rule_has_its_edges_and_its_option():
    assert sorted(EDGES) == sorted(RULES)
    option_names = {p.name for p in COMMAND.params}
    assert set(RULES) <= option_names
    # What a batch line and /set may set is the options' own names, so one rule serves all three.
    assert set(SETTING_KEYS) <= option_names and set(SETTING_NAMES) <= option_names


@pytest.mark.parametrize("name", sorted(RULES))
def test_a_value_just_outside_is_refused_everywhere_with_one_reason(name):
    outside, inside = EDGES[name]
    why = reason(name, outside)
    assert why.startswith("must be ")

    said = command_line_error(flag(name), str(outside))
    assert said is not None and said.endswith(f": {why}"), said
    assert command_line_error(flag(name), str(inside)) is None

    if name in SETTING_KEYS:
        bad = parse_line(1, json.dumps({"prompt": "hi", name: outside}))
        assert isinstance(bad, BadLine) and bad.message == f"{name} {why}"
        good = parse_line(1, json.dumps({"prompt": "hi", name: inside}))
        assert isinstance(good, JobLine) and dict(good.settings)[name] == inside

    if name in SETTING_NAMES:
        with pytest.raises(ValueError) as info:
            apply_setting(name, str(outside), Settings(Options()))
        assert str(info.value) == f"{name} {why}"
        assert apply_setting(name, str(inside), Settings(Options())).as_dict()[name] == inside


def test_the_installed_command_gives_the_same_reason():
    for name in ("temperature", "top_p", "seed", "max_tokens"):
        outside, _ = EDGES[name]
        proc = run_cli(flag(name), str(outside), "-p", "hi", "--no-stdin")
        err = proc.stderr.decode()
        assert proc.returncode == 2 and f": {reason(name, outside)} (see llama-chat --help)" in err, err


def test_help_states_each_range_as_the_error_does():
    # These say their range in words of their own (a number of seconds, the model's context ...).
    own_words = {"max_time", "ctx_size", "num_return", "max_batch", "cache_tokens"}
    for name, rule in RULES.items():
        param = next(p for p in COMMAND.params if p.name == name)
        assert (rule.allowed in param.help) != (name in own_words), name


def test_the_choices_are_the_lists_the_code_uses():
    for option, names in (("--template", FORMAT_NAMES), ("--dtype", DTYPES), ("--quantize", QUANTIZE_MODES),
                          ("--color", COLOR_MODES)):
        for name in names:
            assert command_line_error(option, name) is None, (option, name)
        said = command_line_error(option, "bogus")
        assert said.startswith(f"Invalid value for '{option}'") and all(repr(n) in said for n in names), said


def test_beams_are_deterministic_unless_a_temperature_is_given():
    assert Options().sampling().temperature == 0.8
    assert Options(num_beams=3).sampling().greedy
    assert Options(num_beams=3, temperature=0.7).sampling().temperature == 0.7
    assert Options(temperature=0.0).sampling().greedy


def test_a_request_takes_a_jobs_settings_over_the_options():
    opts = Options(temperature=0.3, max_tokens=9, stop=["x"], max_time=5.0, seed=11)
    plain = opts.request([1, 2, 3], chat_reply=False)
    assert (plain.sampling.temperature, plain.max_tokens, plain.stop, plain.max_time, plain.seed) == \
        (0.3, 9, ("x",), 5.0, 11)
    job = opts.request([1, 2], chat_reply=True, request_id="line-4", max_tokens=2, top_k=5, stop=(), seed=None)
    assert (job.max_tokens, job.sampling.top_k, job.stop, job.max_time, job.request_id, job.chat_reply) == \
        (2, 5, (), 5.0, "line-4", True)
    assert 0 <= job.seed  # drawn, and reported through the request


def test_template_none_with_a_system_message_names_the_choice(tmp_path):
    tiny = build_tiny_model(tmp_path)
    proc = run_cli("-m", str(tiny.path), "--template", "none", "-s", "be brief", "-p", "hi")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "--template none" in err and "this model has none" not in err, err

"""``--batch`` input: one job per line, plain text or a JSON object with options of its own.

Read and checked before torch is imported, so that a bad option is an instant usage error. A line
that cannot be a job is kept as a ``BadLine`` with its number: it is reported, and the other jobs
run anyway.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, fields
from typing import Any

from llama_chat.cmd.inputs import MAX_PROMPT_BYTES, UsageProblem, read_stdin_text
from llama_chat.cmd.options import CONSTRAINT_OPTIONS, Options, make_constraint
from llama_chat.ml.controls import RULES, ControlError, SamplingParams, check

SAMPLING_KEYS = tuple(f.name for f in fields(SamplingParams))
# The settings a JSON line may give its job, under the names of the options they override. A
# line's json_schema is a JSON object (or its text), its grammar the grammar's text.
SETTING_KEYS = (*SAMPLING_KEYS, "max_tokens", "seed", "max_time", "stop", *CONSTRAINT_OPTIONS)
JOB_KEYS = ("prompt", "id", "system", *SETTING_KEYS)


@dataclass(frozen=True)
class JobLine:
    """One job as the input gave it. ``job_id``: the line's ``id``, or its line number."""

    line: int
    prompt: str
    job_id: Any
    system: str | None = None
    settings: tuple[tuple[str, Any], ...] = ()  # options to override, as (name, value), checked


@dataclass(frozen=True)
class BadLine:
    line: int
    job_id: Any
    message: str


def check_batch_options(opts: Options) -> bool:
    """Whether this is a ``--batch`` run; raise ``UsageProblem`` for options that do not fit it."""
    if opts.batch is None:
        for name, flag in (("ordered", "--ordered"),):
            if getattr(opts, name):
                raise UsageProblem(f"{flag} needs --batch")
        return False
    if opts.chat:
        raise UsageProblem("--batch and --chat cannot be used together")
    if opts.json:
        raise UsageProblem("--batch writes JSON Lines already; leave out --json")
    if opts.prompt is not None or opts.file is not None:
        raise UsageProblem("--batch reads its prompts from FILE or stdin, not from --prompt or --file")
    if opts.num_beams > 1:
        raise UsageProblem("--batch does not do beam search (--num-beams)")
    return True


def read_batch(source: str) -> list[JobLine | BadLine]:
    """The jobs of ``source`` (a file name, or '-' for standard input), one per non-empty line."""
    if source == "-":
        if sys.stdin is None:
            raise UsageProblem("--batch: standard input is closed")
        if sys.stdin.isatty():
            print("llama-chat: reading prompts from the terminal, one per line; end with Ctrl+D",
                  file=sys.stderr)
        text = read_stdin_text(sys.stdin.buffer)
    else:
        try:
            with open(source, "rb") as f:
                text = read_stdin_text(f, what=f"--batch {source}")
        except OSError as e:
            raise UsageProblem(f"--batch {source}: cannot read it ({e.strerror or e})") from None
    jobs = [parse_line(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not jobs:
        raise UsageProblem("--batch: no prompts (every line is empty)")
    return jobs


def parse_line(number: int, line: str) -> JobLine | BadLine:
    stripped = line.strip()
    if not stripped.startswith("{"):
        return JobLine(number, line.rstrip("\r"), number)
    try:
        obj = json.loads(stripped)
    except json.JSONDecodeError as e:
        return BadLine(number, number, f"not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return BadLine(number, number, "not a JSON object")
    job_id = obj.get("id", number)
    try:
        return _job(number, obj, job_id)
    except (ControlError, ValueError, TypeError) as e:
        return BadLine(number, job_id, str(e))


def _job(number: int, obj: dict, job_id: Any) -> JobLine:
    unknown = sorted(set(obj) - set(JOB_KEYS))
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r}")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("'prompt' must be a non-empty string")
    if len(prompt.encode("utf-8", "replace")) > MAX_PROMPT_BYTES:
        raise ValueError("'prompt' is too long")
    if isinstance(job_id, (dict, list)) or (isinstance(job_id, float) and not math.isfinite(job_id)):
        raise ValueError("'id' must be a string, a number or null")
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError("'system' must be a string")
    # null is no setting: the command line's value holds, as for a key left out.
    settings = {name: _setting(name, obj[name]) for name in SETTING_KEYS if obj.get(name) is not None}
    # Every control together, as the job will use them (one may constrain another).
    SamplingParams(**{name: value for name, value in settings.items() if name in SAMPLING_KEYS})
    constraints = [name for name in CONSTRAINT_OPTIONS if name in settings]
    if len(constraints) > 1:
        raise ValueError(f"one of {', '.join(map(repr, CONSTRAINT_OPTIONS))} at a time, got {len(constraints)}")
    return JobLine(number, prompt, job_id, system, tuple(settings.items()))


def _setting(name: str, value: Any) -> Any:
    """A line's value for option ``name``, checked as the command line checks the option."""
    if name == "stop":
        stop = [value] if isinstance(value, str) else value
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError("'stop' must be a string or a list of strings")
        return tuple(stop)
    if name == "logit_bias":
        return _logit_bias(value)
    if name in CONSTRAINT_OPTIONS:
        return _constraint(name, value)
    return check(name, value) if name in RULES else value


def _constraint(name: str, value: Any) -> str:
    """A line's schema (an object, or JSON text), pattern, grammar text or format, checked."""
    if name == "json_schema" and isinstance(value, (dict, bool)):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise ValueError(f"'{name}' must be {'a JSON object' if name == 'json_schema' else 'a string'}")
    make_constraint(name, value)
    return value.strip().lower() if name == "format" else value


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``{"15043": -100}`` or ``[[15043, -100]]`` -> ((15043, -100.0),); "-inf" bans a token."""
    items = value.items() if isinstance(value, dict) else value
    if not isinstance(items, (list, type({}.items()))):
        raise ValueError("'logit_bias' must be an object of id: bias or a list of [id, bias]")
    out = []
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError("'logit_bias' entries must be [id, bias]")
        token, bias = item
        try:
            out.append((int(token), float(bias)))
        except (TypeError, ValueError):
            raise ValueError(f"'logit_bias' entry {list(item)!r} is not an id and a number") from None
    return tuple(out)

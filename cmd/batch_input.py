"""``--batch`` input: one job per line, plain text or a JSON object with options of its own.

Read lazily, a line at a time, while the jobs before run: a batch of a million lines holds one
line in memory, not a million. The first job is read before torch is imported, so that an empty
or unreadable source is an instant usage error. A line that cannot be a job (not JSON, nested too
deeply, an integer of thousands of digits, a lone surrogate, a bad option, longer than
``MAX_LINE_BYTES``) is a ``BadLine`` with its number: it is reported, and the other jobs run anyway.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from dataclasses import dataclass, fields
from typing import Any, BinaryIO

from llama_chat.cmd.inputs import MAX_PROMPT_BYTES, UsageProblem
from llama_chat.cmd.options import CONSTRAINT_OPTIONS, Options, make_constraint
from llama_chat.ml.controls import (REASONING_FORMATS, RULES, THINK_MODES, ControlError, SamplingParams, check,
                                    check_stop)
from llama_chat.ml.safe_files import kind_of, size_text
from llama_chat.model.safe_input import BadInput, NotText, check_text, decode_utf8, loads

SAMPLING_KEYS = tuple(f.name for f in fields(SamplingParams))
# The settings a JSON line may give its job, under the names of the options they override. A
# line's json_schema is a JSON object (or its text), its grammar the grammar's text.
SETTING_KEYS = (*SAMPLING_KEYS, "max_tokens", "seed", "max_time", "stop", *CONSTRAINT_OPTIONS)
# A thinking model's settings for one line, as the command line's --think, --reasoning-budget and
# --reasoning-format (inference/reasoning.py).
THINKING_KEYS = ("think", "reasoning_budget", "reasoning_format")
CHOICES = {"think": THINK_MODES, "reasoning_format": REASONING_FORMATS}
JOB_KEYS = ("prompt", "id", "system", *SETTING_KEYS, *THINKING_KEYS)


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
        if opts.ordered:
            raise UsageProblem("--ordered needs --batch")
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


class BatchReader:
    """The jobs of a ``--batch`` source, one line at a time: memory holds one line (at most
    ``MAX_LINE_BYTES``), however many lines there are, and nothing is read before it is wanted.

    ``take`` blocks on a pipe or a terminal, so the batch calls it in a worker thread; one caller
    at a time.
    """

    def __init__(self, stream: BinaryIO, what: str) -> None:
        self.stream = stream
        self.what = what
        self.lines = 0  # lines read so far, empty ones included
        self.eof = False
        self._ahead: list[JobLine | BadLine] = []

    def _raw_line(self) -> bytes | None:
        """The next line without its newline; ``TOO_LONG`` for one past the bound (skipped
        whole, a chunk at a time); None at the end."""
        try:
            raw = self.stream.readline(MAX_LINE_BYTES + 1)
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while True:
                    chunk = self.stream.readline(_SKIP_CHUNK)
                    if not chunk or chunk.endswith(b"\n"):
                        return TOO_LONG
        except OSError as e:
            raise UsageProblem(f"{self.what}: cannot read it ({e.strerror or e})") from None
        if not raw:
            return None
        return raw[:-1] if raw.endswith(b"\n") else raw

    def next(self) -> JobLine | BadLine | None:
        """The next job or bad line (empty lines are skipped); None at the end of the input."""
        if self._ahead:
            return self._ahead.pop()
        while not self.eof:
            raw = self._raw_line()
            if raw is None:
                self.eof = True
                break
            self.lines += 1
            if raw is TOO_LONG:
                return BadLine(self.lines, self.lines, f"longer than {size_text(MAX_LINE_BYTES)}")
            if raw.strip():
                return parse_line(self.lines, raw)
        return None

    def take(self, most: int) -> list[JobLine | BadLine]:
        """Up to ``most`` jobs or bad lines; an empty list at the end of the input."""
        out = []
        while len(out) < most:
            item = self.next()
            if item is None:
                break
            out.append(item)
        return out

    def peek(self) -> None:
        """Read up to the first job now (before torch is imported): a source with no line that is
        not empty is a usage error at once."""
        item = self.next()
        if item is None:
            raise UsageProblem("--batch: no prompts (every line is empty)")
        self._ahead.append(item)


TOO_LONG = b"\0too long"  # a sentinel, compared by identity
# One job's line: as much as any prompt (cmd/inputs.py).
MAX_LINE_BYTES = MAX_PROMPT_BYTES
_SKIP_CHUNK = 1 << 20


def read_batch(source: str) -> BatchReader:
    """The jobs of ``source`` (a file name, or '-' for standard input), one per non-empty line,
    with the first one already read (``BatchReader.peek``)."""
    if source == "-":
        if sys.stdin is None:
            raise UsageProblem("--batch: standard input is closed")
        if sys.stdin.isatty():
            print("llama-chat: reading prompts from the terminal, one per line; end with Ctrl+D",
                  file=sys.stderr)
        reader = BatchReader(sys.stdin.buffer, "standard input")
    else:
        what = f"--batch {source}"
        try:
            stream = open(source, "rb")
        except OSError as e:
            raise UsageProblem(f"{what}: cannot read it ({e.strerror or e})") from None
        mode = os.fstat(stream.fileno()).st_mode
        # A pipe is a source like any other (``--batch <(make_jobs)``); a device is not, unless it
        # is a terminal: /dev/zero would be one endless line.
        if (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)) and not stream.isatty():
            stream.close()
            raise UsageProblem(f"{what}: cannot read it (not a file, a pipe or a terminal: {kind_of(mode)})")
        reader = BatchReader(stream, what)
    reader.peek()
    return reader


def parse_line(number: int, line: str | bytes) -> JobLine | BadLine:
    """Line ``number`` of a batch as a job, or the one reason it is not one. Never raises:
    whatever the line holds, one bad line is one error record."""
    try:
        return _parse_line(number, line)
    except (ValueError, TypeError, OverflowError, RecursionError, MemoryError) as e:  # noqa: PERF203
        return BadLine(number, number, f"cannot be read ({type(e).__name__})")


def _parse_line(number: int, line: str | bytes) -> JobLine | BadLine:
    is_json = (line.lstrip().startswith(b"{") if isinstance(line, bytes) else line.lstrip().startswith("{"))
    if isinstance(line, bytes):
        if not is_json:  # plain text is a prompt like any other: bytes that are not UTF-8 become U+FFFD
            line = line.decode("utf-8", errors="replace")
        else:  # JSON text must be UTF-8 (RFC 8259)
            try:
                line = decode_utf8(line)
            except BadInput as e:
                return BadLine(number, number, str(e))
    try:
        check_text(line, "the line")
    except BadInput as e:
        return BadLine(number, number, str(e))
    if not is_json:
        return JobLine(number, line.rstrip("\r"), number)
    try:
        obj = loads(line.strip())
    except json.JSONDecodeError as e:
        return BadLine(number, number, f"not valid JSON ({e.msg} at column {e.colno})")
    except NotText as e:
        return BadLine(number, number, str(e))
    except BadInput as e:
        return BadLine(number, number, f"not valid JSON ({e})")
    if not isinstance(obj, dict):
        return BadLine(number, number, "not a JSON object")
    job_id = obj.get("id", number)
    if isinstance(job_id, (dict, list)):
        return BadLine(number, number, "'id' must be a string, a number or null")
    try:
        return _job(number, obj, job_id)
    except (ControlError, ValueError, TypeError, OverflowError) as e:
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
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError("'system' must be a string")
    # null is no setting: the command line's value holds, as for a key left out.
    settings = {name: setting(name, obj[name]) for name in (*SETTING_KEYS, *THINKING_KEYS) if obj.get(name) is not None}
    # Every control together, as the job will use them (one may constrain another).
    SamplingParams(**{name: value for name, value in settings.items() if name in SAMPLING_KEYS})
    constraints = [name for name in CONSTRAINT_OPTIONS if name in settings]
    if len(constraints) > 1:
        raise ValueError(f"one of {', '.join(map(repr, CONSTRAINT_OPTIONS))} at a time, got {len(constraints)}")
    return JobLine(number, prompt, job_id, system, tuple(settings.items()))


def setting(name: str, value: Any) -> Any:
    """A line's value for option ``name``, checked as the command line checks the option."""
    if name == "stop":
        if not isinstance(value, (str, list)):
            raise ValueError("'stop' must be a string or a list of strings")
        return check_stop([value] if isinstance(value, str) else value)
    if name == "logit_bias":
        return _logit_bias(value)
    if name in CONSTRAINT_OPTIONS:
        return _constraint(name, value)
    if name in CHOICES and value not in CHOICES[name]:
        raise ValueError(f"'{name}' must be one of {', '.join(CHOICES[name])}, got {value!r}")
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
            if isinstance(token, bool) or not isinstance(token, (int, str)) or isinstance(bias, bool):
                raise TypeError
            out.append((int(token), float(bias)))
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"'logit_bias' entry {list(item)!r:.80} is not an id and a number") from None
    return tuple(out)

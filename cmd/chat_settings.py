"""The chat's settings and its ``/set``: the options of the replies, changed one at a time.

The settings are the command line's ``Options`` with the changes ``/set`` made to them, so a reply's
request is made as the one-shot command makes its own (``Options.request``), and a value is
checked by the same rule as the option of the same name (``ml/controls.py``) with the same reason.
"""

from __future__ import annotations

import difflib
import re
import textwrap
from dataclasses import dataclass, fields
from typing import Any, Sequence

from llama_chat.cmd.options import CONSTRAINT_OPTIONS, Options, constraint_text
from llama_chat.inference.types import Request
from llama_chat.ml.controls import (BeamParams, SamplingParams, check_early_stopping, check_stop, parse,
                                    parse_logit_bias)

# What /set changes, under the options' names (Hugging Face's for the controls).
SETTING_NAMES = (*(f.name for f in fields(SamplingParams)), "seed", "max_tokens", "max_time", "stop",
                 *(f.name for f in fields(BeamParams)), *CONSTRAINT_OPTIONS)
# Other names users know for the same settings (llama.cpp's, transformers' longer ones).
SETTING_ALIASES = {"repeat_penalty": "repetition_penalty", "num_return_sequences": "num_return",
                   "max_new_tokens": "max_tokens"}
# Settings that hold a list: each /set adds one, and none clears them.
LISTS = ("stop", "logit_bias")
_DEFAULTS = {f.name: f.default for f in fields(Options)}
_NONE = ("", "none", "default")
_NAME_AND_VALUE = re.compile(r"([A-Za-z_][\w-]*)(?:(\s*=\s*|\s+)(.*))?", re.S)


def set_help(indent: int) -> str:
    """The /set lines of the chat's /help, the names from ``SETTING_NAMES``."""
    pad = " " * indent
    names = textwrap.fill(", ".join(SETTING_NAMES), width=100, initial_indent=pad, subsequent_indent=pad)
    return (f"{'  /set [NAME VALUE]':<{indent}}change a setting (also NAME=VALUE; no argument: show them all):\n"
            f"{names}\n{pad}stop and logit_bias (ID=BIAS) add one; VALUE none: the default\n"
            f"{pad}format json, json_schema FILE|JSON, regex PATTERN, grammar FILE: one at a time")


@dataclass(frozen=True)
class Settings:
    """The options of the chat's replies: the command line's, with what ``/set`` changed."""

    options: Options

    @property
    def sampling(self) -> SamplingParams:
        return self.options.sampling()

    @property
    def max_tokens(self) -> int | None:
        return self.options.max_tokens

    def request(self, prompt_ids: Sequence[int], **kwargs: Any) -> Request:
        return self.options.request(prompt_ids, **kwargs)

    def as_dict(self) -> dict:
        opts = self.options
        sampling, beams = opts.sampling(), opts.beams()
        controls = {f.name: getattr(sampling, f.name) for f in fields(SamplingParams)}
        controls["logit_bias"] = [f"{token}={bias}" for token, bias in sampling.logit_bias]
        return {**controls, "seed": opts.seed, "max_tokens": opts.max_tokens, "max_time": opts.max_time,
                "stop": list(opts.stop), **{f.name: getattr(beams, f.name) for f in fields(BeamParams)},
                **opts.constraint_texts()}


def split_setting(arg: str) -> tuple[str, str | None]:
    """``NAME VALUE`` or ``NAME=VALUE`` -> (the setting's name, the value); ``NAME`` alone -> (name, None)."""
    m = _NAME_AND_VALUE.fullmatch(arg.strip())
    if m is None:
        raise ValueError("expected NAME VALUE or NAME=VALUE")
    name = m.group(1).replace("-", "_")
    name = SETTING_ALIASES.get(name, name)
    if name not in SETTING_NAMES:
        raise ValueError(unknown_setting(name))
    return name, None if m.group(2) is None else m.group(3).strip()


def unknown_setting(name: str) -> str:
    close = difflib.get_close_matches(name, [*SETTING_NAMES, *SETTING_ALIASES], n=1)
    if close:
        return f"unknown setting {name!r}; did you mean {SETTING_ALIASES.get(close[0], close[0])}?"
    return f"unknown setting {name!r} (/set with no argument lists them)"


def apply_setting(name: str, value: str, settings: Settings) -> Settings:
    """``settings`` with setting ``name`` set to ``value`` (text), checked as the command line
    checks the option of the same name; ``ValueError`` (one line) when it is not allowed."""
    opts = settings.options
    default = value.lower() in _NONE
    if name in LISTS:
        item = parse_logit_bias(value) if name == "logit_bias" and not default else value
        parsed = () if default else (*(opts.stop if name == "stop" else opts.logit_bias), item)
        if name == "stop":
            check_stop(parsed)
    elif default:
        parsed = _DEFAULTS[name]
    elif name == "early_stopping":
        parsed = check_early_stopping(value)
    elif name in CONSTRAINT_OPTIONS:  # a schema inline or in a file, a pattern, a grammar's file
        parsed = constraint_text(name, value)
    else:
        parsed = parse(name, value)
    changes = {name: parsed}
    if name == "num_beams" and parsed < opts.num_return:
        changes["num_return"] = parsed  # fewer beams return fewer: /set num_beams 1 turns them off
    changed = opts.with_settings(**changes)  # a new constraint replaces the one before
    changed.sampling()  # every control together, as a reply will use them (one may constrain another)
    changed.beams()
    changed.constraint()
    return Settings(changed)


__all__ = ["SETTING_ALIASES", "SETTING_NAMES", "Settings", "apply_setting", "set_help", "split_setting",
           "unknown_setting"]

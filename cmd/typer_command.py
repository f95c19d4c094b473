"""An options dataclass as a typer command, and the plain sectioned ``--help`` both commands show.

``llama-chat`` (``Options``, ``cmd/options.py``) and ``llama-chat serve`` (``ServeOptions``) each
declare their options once, as the fields of a dataclass with typer annotations; ``command``
turns such a dataclass and the function that runs it into the command typer reads, and ``parse``
reads a command line into the run it asks for.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import fields
from functools import partial
from typing import Any, get_type_hints

import typer


def command(options: type, run: Callable[[Any], int], *, extra: dict[str, tuple[Any, Any]] | None = None
            ) -> Callable[..., Callable[[], int]]:
    """The typer command whose parameters are ``options``' fields: calling it builds an
    ``options`` from what was given and returns ``run`` bound to it, for ``parse``'s caller to
    call. ``extra``: parameters that are not options (name -> (annotation, default)), such as an
    eager ``--version``; dropped before the dataclass is built."""
    hints = get_type_hints(options, include_extras=True)
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
              for f in fields(options)]
    extra = extra or {}
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
               for name, (annotation, default) in extra.items()]

    def bound_run(**kwargs) -> Callable[[], int]:
        for name in extra:
            kwargs.pop(name, None)
        return partial(run, options(**kwargs))

    bound_run.__signature__ = inspect.Signature(params)
    bound_run.__annotations__ = {p.name: p.annotation for p in params}
    return bound_run


def parse(app: typer.Typer, args: list[str], prog_name: str) -> Callable[[], int | None]:
    """What ``args`` ask of ``app``: its run, bound to the options read, or what ends the command
    while they are read (``--help``, ``--version``: their status). The caller calls it, so the run
    starts from the caller's own frame, not from inside the parser's. A usage error is raised as
    click's ``ClickException``."""
    parsed = app(args=args, prog_name=prog_name, standalone_mode=False)
    return parsed if callable(parsed) else partial(_status, parsed)


def _status(status: int | None) -> int | None:
    return status


class GroupedHelp(typer.core.TyperCommand):
    """Plain ``--help`` (no boxes, no colour) with the options in sections: each option's
    ``rich_help_panel``, the others under "Options"."""

    def format_options(self, ctx, formatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {"Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                names, text = record
                sections.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(
                    (_TYPER_PLACEHOLDER.sub(_placeholder, names), text))
        for title, rows in sections.items():
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


# typer's placeholder for an option that names none of its own (as MODEL or FILE): <int>, <str>,
# <int range>, <a|b|c>. --help shows one style instead: a capital letter or word, or the choices.
_TYPER_PLACEHOLDER = re.compile(r"<([^<>]+)>")
_PLACEHOLDERS = {"int": "N", "float": "X", "str": "TEXT"}


def _placeholder(typer_own: re.Match) -> str:
    label = typer_own.group(1)
    return _PLACEHOLDERS.get(label.split()[0], label)


def new_app() -> typer.Typer:
    """A typer application as both commands make theirs: errors come back to ``main`` (no pretty
    tracebacks), ``-h`` as well as ``--help``."""
    return typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                       context_settings={"help_option_names": ["-h", "--help"]})

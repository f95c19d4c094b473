"""The ``llama-chat`` command line: options in, exit status out.

Exit statuses are listed in ``exit_status.py``.
"""

from __future__ import annotations

import enum
import os
import sys
import traceback
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import typer
from rich.console import Console

from llama_chat.cmd.inputs import UsageProblem, gather_prompt
from llama_chat.cmd import exit_status
from llama_chat.cmd.signals import Terminated, install_sync_handlers


class Template(str, enum.Enum):
    auto = "auto"
    none = "none"
    llama2 = "llama2"
    llama3 = "llama3"
    hf = "hf"


class ColorMode(str, enum.Enum):
    auto = "auto"
    always = "always"
    never = "never"


@dataclass(frozen=True)
class Options:
    model: Path | None
    prompt: str | None
    system: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    device: str
    dtype: str
    template: str
    json: bool
    stats: bool
    color: str
    debug: bool


def _package_version() -> str:
    try:
        return version("llama-chat")
    except PackageNotFoundError:
        return "unknown"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"llama-chat {_package_version()}")
        raise typer.Exit()


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]})


@app.command(help="Generate text from a Llama-family model. The prompt comes from --prompt, "
                  "from piped stdin, or both (prompt first, a blank line, then stdin).")
def llama_chat(
    model: Path | None = typer.Option(None, "--model", "-m", help="Model directory or weights file "
                                      "(default: the small model shipped with the package)."),
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="The prompt."),
    system: str | None = typer.Option(None, "--system", "-s", help="A system message (needs a chat template)."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", "-n", min=1,
                                          help="Most tokens to generate (default: until a stop token "
                                               "or the context is full)."),
    temperature: float = typer.Option(0.8, "--temperature", "-t", min=0.0, help="0 means greedy."),
    top_p: float = typer.Option(0.95, "--top-p", min=0.0, max=1.0, help="Nucleus sampling mass (0 < p <= 1)."),
    seed: int | None = typer.Option(None, "--seed", min=0, help="Sampling seed (default: random; always reported)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:1, mps ..."),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32, bfloat16 or float16."),
    template: Template = typer.Option(Template.auto, "--template", help="Chat format; auto: the model's "
                                      "if it has one, else plain completion."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object at the end instead of text."),
    stats: bool = typer.Option(False, "--stats", help="Timings, token counts and the seed on stderr."),
    color: ColorMode = typer.Option(ColorMode.auto, "--color", help="Colour on a terminal (NO_COLOR is honoured)."),
    debug: bool = typer.Option(False, "--debug", help="Show a traceback on failure."),
    show_version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                      help="Print the version and exit."),
) -> None:
    opts = Options(model=model, prompt=prompt, system=system, max_tokens=max_tokens, temperature=temperature,
                   top_p=top_p, seed=seed, device=device, dtype=dtype, template=template.value, json=json_out,
                   stats=stats, color=color.value, debug=debug)
    raise typer.Exit(execute(opts))


def resolve_color(mode: str) -> str:
    """``auto`` becomes ``never`` when NO_COLOR is set to anything non-empty (no-color.org)."""
    if mode == "auto" and os.environ.get("NO_COLOR"):
        return "never"
    return mode


def stderr_console(color: str) -> Console:
    # color_system=None writes no escape sequence at all: NO_COLOR users get no dim or bold either.
    return Console(stderr=True, highlight=False, color_system=None if color == "never" else "auto",
                   force_terminal=True if color == "always" else None)


def execute(opts: Options) -> int:
    color = resolve_color(opts.color)
    err = stderr_console(color)
    try:
        # Input problems are found before torch is imported: a usage error should be instant.
        if opts.top_p <= 0:
            raise UsageProblem("--top-p must be greater than 0")
        text = gather_prompt(opts.prompt)
        from llama_chat.cmd.run_command import run_command

        return run_command(opts, text, color, err)
    except KeyboardInterrupt:
        err.print("finish: cancelled", style="dim")
        return exit_status.SIGINT
    except Terminated:
        err.print("finish: cancelled", style="dim")
        return exit_status.SIGTERM
    except UsageProblem as e:
        err.print(f"llama-chat: error: {e}", markup=False, soft_wrap=True)
        return exit_status.USAGE
    except Exception as e:  # noqa: BLE001 - the last line of defence: one line, or a traceback on request
        from llama_chat.inference.errors import RequestError
        from llama_chat.model.errors import ModelLoadError

        if isinstance(e, (ModelLoadError, RequestError)):
            err.print(f"llama-chat: error: {e}", markup=False, soft_wrap=True)
            return exit_status.USAGE
        if opts.debug:
            traceback.print_exc()
        message = str(e).splitlines()[0] if str(e) else ""
        err.print(f"llama-chat: error: {type(e).__name__}{': ' + message if message else ''}",
                  markup=False, soft_wrap=True)
        return exit_status.FAILURE


def main() -> None:
    # Set before torch is imported, which is when OpenMP reads it. Besides torch's threads this
    # process always has a busy event loop (and often a terminal or pipe reader beside it); with
    # OpenMP's default, idle helper threads spin between parallel regions and take the cores from
    # both: 0.91 of a bare loop against 0.97 when they sleep, and far worse on a busy machine
    # (docs/benchmarks.md). A user's own setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    install_sync_handlers()
    try:
        # Standalone mode: typer reports its own usage errors (exit 2) and raises SystemExit.
        app(prog_name="llama-chat")
        status = exit_status.OK
    except SystemExit as e:
        status = e.code
    except Terminated:  # SIGTERM while the options were being parsed
        status = exit_status.SIGTERM
    except KeyboardInterrupt:
        status = exit_status.SIGINT
    _exit_now(status)


def _exit_now(code: int | str | None) -> None:
    """Flush and leave without the interpreter's teardown.

    Everything is written and nothing runs in the background by now; tearing down torch's modules
    would only add half a second or more between Ctrl+C and the shell prompt.
    """
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = exit_status.FAILURE
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed pipe: nothing more can reach it
    os._exit(code or exit_status.OK)

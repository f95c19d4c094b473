"""The ``llama-chat`` command line: options in, exit status out.

Exit statuses are listed in ``exit_status.py``. Every message that reaches stderr passes through
``sanitize.one_line``: messages quote values from model files and from the command line, and
neither may put escape codes on the user's terminal.
"""

from __future__ import annotations

from llama_chat.cmd.startup import Terminated, deferred_signals, ensure_std_fds

# First of all, before any module opens a file that could take over fd 1 or 2 (`llama-chat >&-`).
ensure_std_fds()
# A Ctrl+C while the command's own modules load, or while this module builds its options (a
# dataclass of some forty fields, a noticeable moment on a busy machine), ends the run with status
# 130 and no traceback; the guard is left at the end of this module.
_loading = deferred_signals(exit_now=True)
_loading.__enter__()
with deferred_signals(exit_now=True):
    import enum
    import math
    import os
    import re
    import sys
    import traceback
    import inspect
    from collections.abc import Callable
    from dataclasses import dataclass, fields
    from importlib.metadata import PackageNotFoundError, version
    from typing import Annotated, get_type_hints

    import typer
    from rich.console import Console

    from llama_chat.cmd import exit_status
    from llama_chat.cmd.batch_input import check_batch_options, read_batch
    from llama_chat.cmd.inputs import UsageProblem, gather_first_message, gather_prompt
    from llama_chat.cmd.sanitize import one_line
    from llama_chat.cmd.signals import install_sync_handlers
    from llama_chat.ml.controls import ControlError, check, check_early_stopping, parse_logit_bias


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


class DType(str, enum.Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Quantize(str, enum.Enum):
    none = "none"
    int8 = "int8"


MAX_SEED = 2**64 - 1
_DEVICE = re.compile(r"auto|cpu|(cuda|mps)(:\d{1,3})?")


def _package_version() -> str:
    try:
        return version("llama-chat")
    except PackageNotFoundError:
        return "unknown"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"llama-chat {_package_version()}")
        raise typer.Exit()


# Range checks are callbacks, not typer's min/max, so that --help and the error say the same thing.
def _check_temperature(value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise typer.BadParameter(f"must be a finite number >= 0, got {value}")
    return value


def _check_top_p(value: float) -> float:
    if not (0 < value <= 1):
        raise typer.BadParameter(f"must be in 0 < p <= 1, got {value}")
    return value


def _check_max_tokens(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise typer.BadParameter(f"must be at least 1, got {value}")
    return value


def _check_seed(value: int | None) -> int | None:
    if value is not None and not 0 <= value <= MAX_SEED:
        raise typer.BadParameter(f"must be in 0 <= seed <= 2**64-1, got {value}")
    return value


def _check_ctx_size(value: int | None) -> int | None:
    if value is not None and value < 0:
        raise typer.BadParameter(f"must be 0 (the model's full context) or a positive number, got {value}")
    return value


def _control(name: str) -> Callable:
    """A callback checking an option against the ranges in ``ml/controls.py`` (None passes)."""
    def callback(value):
        if value is None:
            return value
        try:
            return check(name, value)
        except ControlError as e:
            raise typer.BadParameter(e.reason) from None
    return callback


def _check_logit_bias(values: list[str] | None) -> tuple[tuple[int, float], ...]:
    try:
        return tuple(parse_logit_bias(v) for v in values or ())
    except ControlError as e:
        raise typer.BadParameter(e.reason) from None


def _check_early_stopping(value: str):
    try:
        return check_early_stopping(value)
    except ControlError as e:
        raise typer.BadParameter(e.reason) from None


# --help shows the options in these sections, in this order (``_GroupedHelp``).
SAMPLING = "Sampling (Hugging Face generate's names)"
PENALTIES = "Penalties and token rules"
STOPPING = "Stopping"
BEAMS = "Beam search"


def _check_positive(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise typer.BadParameter(f"must be at least 1, got {value}")
    return value


def _check_device(value: str) -> str:
    if not _DEVICE.fullmatch(value):
        raise typer.BadParameter(f"expected auto, cpu, cuda, cuda:N, mps; got {value!r}")
    return value


# -- the options: each one named, typed, defaulted and documented here, once -----------------------
# The dataclass is what the rest of the command reads; typer reads its fields (``_command`` below
# turns them into the command's signature), so there is no second list of options to keep in step.


@dataclass(frozen=True)
class Options:
    model: Annotated[str | None, typer.Option(
        "--model", "-m", metavar="MODEL",
        help="Model: a directory or weights file (.gguf too), a Hugging Face id org/name from the local "
             "cache, or ollama:NAME[:TAG] from Ollama's store (default: the small model shipped with the "
             "package). --list shows what is there.")] = None
    list_models: Annotated[bool, typer.Option(
        "--list", help="List the models in the Hugging Face cache and Ollama's store, and exit.")] = False
    download: Annotated[bool, typer.Option(
        "--download", help="With -m org/name: download the model from the Hugging Face hub if it is not "
                           "in the cache (with a progress bar).")] = False
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="The prompt.")] = None
    file: Annotated[str | None, typer.Option(
        "--file", "-f", help="Read the prompt from this file ('-': stdin); stdin is then not read otherwise.")] = None
    no_stdin: Annotated[bool, typer.Option(
        "--no-stdin", help="Do not read stdin, even when it is a pipe.")] = False
    chat: Annotated[bool, typer.Option(
        "--chat", help="Chat interactively (the default with no prompt on a terminal). A prompt or piped "
                       "stdin becomes the first message; the chat then goes on reading the terminal.")] = False
    system: Annotated[str | None, typer.Option(
        "--system", "-s", help="A system message (needs a chat template).")] = None
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", "--max-new-tokens", "-n", callback=_check_max_tokens, rich_help_panel=STOPPING,
        help="Most tokens to generate, at least 1 (default: until a stop token or the context is full).")] = None
    stop: Annotated[list[str] | None, typer.Option(
        "--stop", help="Stop when the text contains TEXT (repeatable); the stop string is not printed.",
        metavar="TEXT", rich_help_panel=STOPPING)] = None
    max_time: Annotated[float | None, typer.Option(
        "--max-time", callback=_control("max_time"), rich_help_panel=STOPPING, metavar="SECONDS",
        help="Stop after this many seconds from the start of the request, prefill included (finish "
             "reason max_time); at least one token is generated.")] = None
    ctx_size: Annotated[int | None, typer.Option(
        "--ctx-size", "-c", callback=_check_ctx_size,
        help="Context length in tokens, at most the model's; 0: the model's full context (default: the "
             "model's, at most 4096).")] = None
    temperature: Annotated[float, typer.Option(
        "--temperature", "-t", callback=_check_temperature, rich_help_panel=SAMPLING,
        help="Sampling temperature, >= 0; 0 means greedy.")] = 0.8
    top_p: Annotated[float, typer.Option(
        "--top-p", callback=_check_top_p, rich_help_panel=SAMPLING, help="Nucleus sampling mass, 0 < p <= 1.")] = 0.95
    top_k: Annotated[int, typer.Option(
        "--top-k", callback=_control("top_k"), rich_help_panel=SAMPLING,
        help="Sample among the K most likely tokens only, K >= 0 (0: off).")] = 0
    min_p: Annotated[float, typer.Option(
        "--min-p", callback=_control("min_p"), rich_help_panel=SAMPLING,
        help="Drop tokens less likely than P times the most likely one, 0 <= P <= 1 (0: off).")] = 0.0
    typical_p: Annotated[float, typer.Option(
        "--typical-p", callback=_control("typical_p"), rich_help_panel=SAMPLING,
        help="Locally typical sampling mass, 0 < P <= 1 (1: off).")] = 1.0
    seed: Annotated[int | None, typer.Option(
        "--seed", callback=_check_seed, rich_help_panel=SAMPLING,
        help="Sampling seed, 0 <= seed < 2**64 (default: random; always reported).")] = None
    repetition_penalty: Annotated[float, typer.Option(
        "--repetition-penalty", "--repeat-penalty", callback=_control("repetition_penalty"),
        rich_help_panel=PENALTIES,
        help="Divide the positive logits (multiply the negative ones) of tokens already seen by this, > 0 "
             "(1: off).")] = 1.0
    repeat_last_n: Annotated[int, typer.Option(
        "--repeat-last-n", callback=_control("repeat_last_n"), rich_help_panel=PENALTIES,
        help="The repetition, presence and frequency penalties look at the last N tokens, N >= 0 (0: the "
             "whole prompt and reply).")] = 0
    presence_penalty: Annotated[float, typer.Option(
        "--presence-penalty", callback=_control("presence_penalty"), rich_help_panel=PENALTIES,
        help="Subtract this from the logit of every token already seen, -2 to 2 (0: off).")] = 0.0
    frequency_penalty: Annotated[float, typer.Option(
        "--frequency-penalty", callback=_control("frequency_penalty"), rich_help_panel=PENALTIES,
        help="Subtract this times its count from the logit of every token seen, -2 to 2 (0: off).")] = 0.0
    no_repeat_ngram_size: Annotated[int, typer.Option(
        "--no-repeat-ngram-size", callback=_control("no_repeat_ngram_size"), rich_help_panel=PENALTIES,
        help="Never repeat a run of N tokens already in the prompt or reply, N >= 0 (0: off).")] = 0
    logit_bias: Annotated[list[str] | None, typer.Option(
        "--logit-bias", callback=_check_logit_bias, rich_help_panel=PENALTIES, metavar="ID=BIAS",
        help="Add BIAS to token ID's logit (repeatable); -inf bans the token.")] = None
    min_new_tokens: Annotated[int, typer.Option(
        "--min-new-tokens", callback=_control("min_new_tokens"), rich_help_panel=PENALTIES,
        help="No end-of-sequence token before this many new tokens, N >= 0.")] = 0
    num_beams: Annotated[int, typer.Option(
        "--num-beams", callback=_control("num_beams"), rich_help_panel=BEAMS,
        help="Beam search with N beams, 1 <= N <= 64 (1: off). Not streamed: a progress line, then the "
             "best beam.")] = 1
    length_penalty: Annotated[float, typer.Option(
        "--length-penalty", callback=_control("length_penalty"), rich_help_panel=BEAMS,
        help="A beam's score is its log-probability over length ** this, -10 to 10; above 0 favours "
             "longer beams.")] = 1.0
    early_stopping: Annotated[str, typer.Option(
        "--early-stopping", callback=_check_early_stopping, rich_help_panel=BEAMS, metavar="true|false|never",
        help="true: stop when num-beams beams have finished; false: when no running beam is likely to do "
             "better; never: when none can.")] = "false"
    num_return: Annotated[int, typer.Option(
        "--num-return", "--num-return-sequences", callback=_control("num_return"), rich_help_panel=BEAMS,
        help="How many of the best beams to return, at most num-beams (all of them under --json; "
             "the best one on a terminal).")] = 1
    device: Annotated[str, typer.Option(
        "--device", callback=_check_device, help="auto, cpu, cuda, cuda:N or mps.")] = "auto"
    dtype: Annotated[DType, typer.Option(
        "--dtype", help="Weights dtype; auto: float32 on cpu, bfloat16 on cuda, float16 on mps.")] = DType.auto
    compile: Annotated[bool | None, typer.Option(
        "--compile/--no-compile",
        help="Compile the decode step (default: for models of 50M parameters or more, on CUDA, and on the "
             "CPU in float32 where llama-chat's CPU kernels are not built; int8 only when asked). The first run compiles (a C++ compiler is needed on the CPU; without one the "
             "step runs uncompiled); later runs reuse the on-disk cache.")] = None
    quantize: Annotated[Quantize, typer.Option(
        "--quantize", help="Weights: none, or int8 (weight-only, one scale per output row, made at load "
                           "time; about a quarter of float32's bytes).")] = Quantize.none
    template: Annotated[Template, typer.Option(
        "--template", help="Chat format; auto: the model's if it has one, else plain completion.")] = Template.auto
    json: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object at the end instead of text (not with the chat).")] = False
    stats: Annotated[bool, typer.Option(
        "--stats", help="Timings, token counts and the seed on stderr (in the chat: after each reply).")] = False
    no_history: Annotated[bool, typer.Option(
        "--no-history", help="Chat: neither read nor write the input history file.")] = False
    color: Annotated[ColorMode, typer.Option(
        "--color", help="Colour on a terminal (NO_COLOR is honoured).")] = ColorMode.auto
    batch: Annotated[str | None, typer.Option(
        "--batch", metavar="[FILE]", rich_help_panel="Batch",
        help="Run every line of FILE (default: stdin) as its own job, many at once: plain prompts, or JSON "
             "objects with a prompt and options of their own. JSON Lines out, one per job as it finishes.")] = None
    ordered: Annotated[bool, typer.Option(
        "--ordered", rich_help_panel="Batch", help="--batch: write the results in input order.")] = False
    max_batch: Annotated[int, typer.Option(
        "--max-batch", callback=_check_positive, rich_help_panel="Batch",
        help="--batch: most jobs generating at once.")] = 16
    cache_tokens: Annotated[int | None, typer.Option(
        "--cache-tokens", callback=_check_positive, rich_help_panel="Batch",
        help="--batch: size of the paged KV cache in tokens (default: --max-batch contexts, at most 65536 and 4 GiB; "
             "at least one context).")] = None
    debug: Annotated[bool, typer.Option("--debug", help="Show a traceback on failure.")] = False

    def __post_init__(self) -> None:
        # Code below the command line sees plain strings and tuples, not typer's enums and lists.
        for name in ("dtype", "template", "color", "quantize"):
            value = getattr(self, name)
            if isinstance(value, enum.Enum):
                object.__setattr__(self, name, value.value)
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "logit_bias", tuple(tuple(b) for b in self.logit_bias or ()))

    def sampling(self):
        """The generation controls as ``SamplingParams`` (checked already, one by one)."""
        from llama_chat.ml.controls import SamplingParams

        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              typical_p=self.typical_p, repetition_penalty=self.repetition_penalty,
                              repeat_last_n=self.repeat_last_n, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty,
                              no_repeat_ngram_size=self.no_repeat_ngram_size, logit_bias=self.logit_bias,
                              min_new_tokens=self.min_new_tokens)

    def beams(self):
        from llama_chat.ml.controls import BeamParams

        return BeamParams(self.num_beams, self.length_penalty, self.early_stopping, self.num_return)


def _command(run: Callable[[Options], int]) -> Callable[..., None]:
    """The typer command whose parameters are ``Options``' fields (plus --version)."""
    hints = get_type_hints(Options, include_extras=True)
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
              for f in fields(Options)]
    version_hint = Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True,
                                                help="Print the version and exit.")]
    params.append(inspect.Parameter("show_version", inspect.Parameter.KEYWORD_ONLY, default=False,
                                    annotation=version_hint))

    def command(**kwargs) -> None:
        kwargs.pop("show_version", None)
        raise typer.Exit(run(Options(**kwargs)))

    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


class _GroupedHelp(typer.core.TyperCommand):
    """Plain ``--help`` (no boxes, no colour) with the options in sections: each option's
    ``rich_help_panel``, the others under "Options"."""

    def format_options(self, ctx, formatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {"Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        for title, rows in sections.items():
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]})
app.command(name="llama-chat", cls=_GroupedHelp,
            help="Generate text from a Llama-family model, or chat with it. The prompt comes from --prompt, "
                 "from --file or piped stdin, or both (prompt first, a blank line, then the rest). With no "
                 "prompt on a terminal, or with --chat, an interactive chat starts (/help lists its "
                 "commands).")(_command(lambda opts: execute(opts)))


def resolve_color(mode: str) -> str:
    """``auto`` becomes ``never`` when NO_COLOR is set to anything non-empty (no-color.org)."""
    if mode == "auto" and os.environ.get("NO_COLOR"):
        return "never"
    return mode


def stderr_console(color: str) -> Console:
    # color_system=None writes no escape sequence at all: NO_COLOR users get no dim or bold either.
    return Console(stderr=True, highlight=False, color_system=None if color == "never" else "auto",
                   force_terminal=True if color == "always" else None)


def _error(err: Console, message: str) -> None:
    err.print(f"llama-chat: error: {one_line(message)}", markup=False, soft_wrap=True, highlight=False)


def _is_terminal(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (OSError, ValueError):
        return False


def wants_chat(opts: Options) -> bool:
    """``--chat``, or no prompt at all with both stdin and stdout on a terminal."""
    if opts.chat:
        return True
    return opts.prompt is None and opts.file is None and _is_terminal(sys.stdin) and _is_terminal(sys.stdout)


def execute(opts: Options) -> int:
    color = resolve_color(opts.color)
    err = stderr_console(color)
    try:
        # Input problems are found before torch is imported: a usage error should be instant.
        if sys.stdout is None:  # started with stdout closed (`>&-`)
            raise UsageProblem("standard output is closed: there is nowhere to write the answer")
        if opts.list_models:
            from llama_chat.cmd.model_list import print_model_list

            return print_model_list(sys.stdout)
        if opts.download and opts.model is None:
            raise UsageProblem("--download needs -m org/name (a Hugging Face id)")
        if opts.num_return > opts.num_beams:
            raise UsageProblem(f"--num-return must be at most --num-beams ({opts.num_beams}), got {opts.num_return}")
        if check_batch_options(opts):
            jobs = read_batch(opts.batch)
            with deferred_signals():  # torch is imported here
                from llama_chat.cmd.batch import run_batch

            return run_batch(opts, jobs, color, err)
        if wants_chat(opts):
            if opts.json:
                raise UsageProblem("--json prints one answer; it cannot be used with the chat")
            first = gather_first_message(opts.prompt, file=opts.file, read_stdin=not opts.no_stdin)
            with deferred_signals():  # torch is imported here
                from llama_chat.cmd.chat import run_chat

            return run_chat(opts, first, color, err)
        text = gather_prompt(opts.prompt, file=opts.file, read_stdin=not opts.no_stdin)
        with deferred_signals():  # torch is imported here
            from llama_chat.cmd.run_command import run_command

        return run_command(opts, text, color, err)
    except KeyboardInterrupt:
        err.print("finish: cancelled", style="dim")
        return exit_status.SIGINT
    except Terminated as e:
        err.print("finish: cancelled", style="dim")
        return exit_status.for_signal(e.signum)
    except UsageProblem as e:
        _error(err, str(e))
        return exit_status.USAGE
    except Exception as e:  # noqa: BLE001 - the last line of defence: one line, or a traceback on request
        from llama_chat.inference.types import RequestError
        from llama_chat.model.errors import ModelLoadError

        if opts.debug:
            traceback.print_exc()
        if isinstance(e, (ModelLoadError, RequestError)):
            _error(err, " ".join(str(e).split("\n")))
            return exit_status.USAGE
        message = str(e).splitlines()[0] if str(e) else ""
        _error(err, f"{type(e).__name__}{': ' + message if message else ''}")
        return exit_status.FAILURE


# typer carries its own copy of click; its exceptions all derive from this one.
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _usage_error(e: Exception) -> int:
    message = "; ".join(line.strip() for line in e.format_message().splitlines() if line.strip())
    try:
        sys.stderr.write(f"llama-chat: error: {one_line(message)} (see llama-chat --help)\n")
    except (OSError, ValueError):
        pass
    return exit_status.USAGE


def main() -> None:
    # Set before torch is imported, which is when OpenMP reads it. Besides torch's threads this
    # process always has a busy event loop (and often a terminal or pipe reader beside it); with
    # OpenMP's default, idle helper threads spin between parallel regions and take the cores from
    # both: 0.91 of a bare loop against 0.97 when they sleep, and far worse on a busy machine
    # (docs/benchmarks.md). A user's own setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    install_sync_handlers()
    try:
        # Not standalone: usage errors come back here as exceptions and are printed on one line.
        status = app(args=optional_batch_file(sys.argv[1:]), prog_name="llama-chat", standalone_mode=False)
        status = exit_status.OK if status is None else status
    except typer.Abort:  # Ctrl+C while the options were parsed
        status = exit_status.SIGINT
    except _ClickException as e:
        status = _usage_error(e)
    except SystemExit as e:
        status = e.code
    except Terminated as e:  # SIGTERM/SIGHUP while the options were being parsed
        status = exit_status.for_signal(e.signum)
    except KeyboardInterrupt:
        status = exit_status.SIGINT
    _exit_now(status)


def optional_batch_file(args: list[str]) -> list[str]:
    """``--batch`` with no FILE (last, or followed by another option) means ``--batch -``, stdin.

    The file is optional; click options take a value or none, never maybe one, so the missing
    value is put in here."""
    out = []
    for i, arg in enumerate(args):
        out.append(arg)
        if arg == "--":
            return out + args[i + 1:]
        if arg == "--batch" and (i + 1 == len(args) or (args[i + 1].startswith("-") and args[i + 1] != "-")):
            out.append("-")
    return out


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
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass  # a closed pipe: nothing more can reach it
    os._exit(code or exit_status.OK)


_loading.__exit__(None, None, None)

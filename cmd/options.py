"""The command line's options: each one named, typed, defaulted and documented here, once.

``Options`` is what the rest of the command reads; ``app.py`` turns its fields into the typer
command's parameters, so there is no second list of options to keep in step. Ranges, choices and
defaults are not written here: they come from ``ml/controls.py`` (and the chat formats' names from
``model/chat_format.py``), which also checks the lines of ``--batch`` and the chat's ``/set``.
``Options.request`` makes the ``Request`` of every mode: one prompt, a chat reply, a batch job.
"""

from __future__ import annotations

import enum
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Annotated, Any

import typer

from llama_chat.cmd.source_settings import BATCH_JOBS, ONE_STREAM, CacheRoom, LoadSettings, SourceSettings
from llama_chat.inference.reasoning import Thinking, ThinkTags, thinking_request
from llama_chat.inference.types import Request, new_request_id
from llama_chat.ml.controls import (CACHE_TYPES, COLOR_MODES, COMPILE_MIN_PARAMETERS, DEFAULT_CACHE_BYTES_CAP,
                                    DEFAULT_CACHE_TOKENS_CAP, DEFAULT_CONTEXT, DEFAULT_DRAFT_MAX, DEFAULT_LOOKUP,
                                    DEFAULT_MAX_BATCH, DEFAULT_PROMPT_CACHE_MIB, PROMPT_CACHE_DEFAULT_DIR,
                                    DEFAULT_TEMPERATURE, DTYPES, KEPT_CONSTRAINTS, LOOKUP_MODES,
                                    MAX_CONSTRAINT_BYTES, QUANTIZE_MODES, REASONING_FORMATS, RULES, THINK_MODES,
                                    BeamParams, ControlError,
                                    SamplingParams, check, check_early_stopping, check_stop, parse_logit_bias,
                                    temperature_for)
from llama_chat.ml.grammar_compile import KeptCompiles
from llama_chat.ml.grammars import Constraint, format_constraint
from llama_chat.model.chat_format import FORMAT_NAMES

# A seed drawn for a run that names none (reported, so the run can be repeated).
RANDOM_SEEDS = 2**31


def _choices(name: str, values: Sequence[str]) -> type[enum.Enum]:
    """An enum of ``values`` for typer, which shows and checks an option's choices from one."""
    return enum.Enum(name, [(v, v) for v in values], type=str)


Template = _choices("Template", FORMAT_NAMES)
DType = _choices("DType", DTYPES)
Quantize = _choices("Quantize", QUANTIZE_MODES)
CacheType = _choices("CacheType", CACHE_TYPES)
Lookup = _choices("Lookup", LOOKUP_MODES)
Think = _choices("Think", THINK_MODES)
ReasoningFormat = _choices("ReasoningFormat", REASONING_FORMATS)
ColorMode = _choices("ColorMode", COLOR_MODES)

_SAMPLING = SamplingParams()
_BEAMS = BeamParams()
_DEVICE = re.compile(r"auto|cpu|(cuda|mps)(:\d{1,3})?")

# --help shows the options in these sections, in this order (``app.GroupedHelp``).
SAMPLING = "Sampling (Hugging Face generate's names)"
PENALTIES = "Penalties and token rules"
STOPPING = "Stopping"
BEAMS = "Beam search"
STRUCTURED = "Structured output (one at a time)"
THINKING = "Thinking models (Qwen3, QwQ, DeepSeek-R1 distills)"
BATCH = "Batch"
# The options that constrain a reply; a later one (a --batch line's, a /set) replaces the others.
CONSTRAINT_OPTIONS = ("json_schema", "format", "regex", "grammar")


def _control(name: str) -> Callable:
    """A callback checking an option by rule ``name`` of ``ml/controls.py`` (None passes)."""
    def callback(value):
        if value is None:
            return value
        try:
            return check(name, value)
        except ControlError as e:
            raise typer.BadParameter(e.reason) from None
    return callback


def ranged(name: str, *flags: str, help: str, **kwargs) -> Any:
    """An option checked by rule ``name``; ``{range}`` in ``help`` is the rule's own text, so that
    --help and the error say the same thing."""
    return typer.Option(*flags, callback=_control(name), help=help.format(range=RULES[name].allowed), **kwargs)


def _check_logit_bias(values: list[str] | None) -> tuple[tuple[int, float], ...]:
    try:
        return tuple(parse_logit_bias(v) for v in values or ())
    except ControlError as e:
        raise typer.BadParameter(e.reason) from None


def _check_stop(values: list[str] | None):
    try:
        return check_stop(values or ())
    except ControlError as e:
        raise typer.BadParameter(e.reason) from None


def _check_early_stopping(value: str):
    try:
        return check_early_stopping(value)
    except ControlError as e:
        raise typer.BadParameter(e.reason) from None


def _read_text(value: str, what: str) -> str:
    """``value`` itself when it is inline (JSON), else the text of the file it names."""
    if what == "json_schema" and (value.lstrip()[:1] in ("{", "[", '"') or value.strip() in ("true", "false")):
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read(MAX_CONSTRAINT_BYTES + 1)
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise ControlError(what, f"cannot read {value!r}: {reason}") from None


def constraint_text(name: str, value: str) -> str:
    """The text of constraint option ``name`` (``CONSTRAINT_OPTIONS``) given as ``value``: a
    schema inline or in a file, a pattern, a grammar's file, json or none; checked (``ControlError``
    with the reason in one line). The command line, --batch lines and the chat's /set read them
    here; a batch line's grammar is its text, not a file (``batch_input``)."""
    if name in ("json_schema", "grammar"):
        value = _read_text(value, name)
        if len(value) > MAX_CONSTRAINT_BYTES:
            raise ControlError(name, f"is longer than {MAX_CONSTRAINT_BYTES} bytes")
    elif name == "format":
        value = value.strip().lower()
    make_constraint(name, value)
    return value


def _check_constraint(name: str) -> Callable:
    def callback(value):
        if value is None:
            return value
        try:
            return constraint_text(name, value)
        except ControlError as e:
            raise typer.BadParameter(e.reason) from None
    return callback


def make_constraint(name: str, text: str) -> Constraint | None:
    """Constraint option ``name``'s ``Constraint`` from its text (made once per text while it is
    kept: ``KeptCompiles``)."""
    if name == "format":
        return format_constraint(text)
    made = _made.get((name, text))
    return made if made is not None else _made.put((name, text), Constraint(name, text), len(text))


_made: KeptCompiles[Constraint] = KeptCompiles(KEPT_CONSTRAINTS)


def _check_device(value: str) -> str:
    if not _DEVICE.fullmatch(value):
        raise typer.BadParameter(f"expected auto, cpu, cuda, cuda:N, mps; got {value!r}")
    return value


@dataclass(frozen=True)
class Options:
    model: Annotated[str | None, typer.Option(
        "--model", "-m", metavar="MODEL",
        help="Model: a directory or weights file (.gguf too), a Hugging Face id org/name from the local "
             "cache (org/name:Q4_K_M or org/name/FILE for one of its GGUF files), ollama:NAME[:TAG] from Ollama's store, or openai:URL[#NAME], a model an OpenAI-compatible "
             "server runs (default: the small model shipped with the package, also named by -m default). "
             "--list shows what is there.")] = None
    list_models: Annotated[bool, typer.Option(
        "--list", help="List the shipped model, then the models in the Hugging Face cache and Ollama's store, "
                   "and exit.")] = False
    download: Annotated[bool, typer.Option(
        "--download", help="With -m org/name: download the model from the Hugging Face hub if it is not "
                           "in the cache (with a progress bar).")] = False
    remote_model: Annotated[str | None, typer.Option(
        "--remote-model", metavar="NAME",
        help="With -m openai:URL: which of the server's models (also URL#NAME; default: its only one).")] = None
    api_key: Annotated[str | None, typer.Option(
        "--api-key", metavar="KEY",
        help="With -m openai:URL: the server's API key (default: $OPENAI_API_KEY).")] = None
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="The prompt.")] = None
    file: Annotated[str | None, typer.Option(
        "--file", "-f", metavar="FILE", help="Read the prompt from this file ('-': stdin); stdin is then not read otherwise.")] = None
    no_stdin: Annotated[bool, typer.Option(
        "--no-stdin", help="Do not read stdin, even when it is a pipe.")] = False
    suffix: Annotated[str | None, typer.Option(
        "--suffix", metavar="TEXT",
        help="Fill in the middle: the prompt is the code before the cursor and TEXT the code after it; a code "
             "model with fill-in-the-middle tokens writes what goes between.")] = None
    suffix_file: Annotated[str | None, typer.Option(
        "--suffix-file", metavar="FILE", help="--suffix, read from this file as it is.")] = None
    chat: Annotated[bool, typer.Option(
        "--chat", help="Chat interactively (the default with no prompt on a terminal). A prompt or piped "
                       "stdin becomes the first message; the chat then goes on reading the terminal.")] = False
    system: Annotated[str | None, typer.Option(
        "--system", "-s", help="A system message (needs a chat template).")] = None
    max_tokens: Annotated[int | None, ranged(
        "max_tokens", "--max-tokens", "--max-new-tokens", "-n", rich_help_panel=STOPPING,
        help="Most tokens to generate, {range} (default: until a stop token or the context is full).")] = None
    stop: Annotated[list[str] | None, typer.Option(
        "--stop", callback=_check_stop, metavar="TEXT", rich_help_panel=STOPPING,
        help="Stop when the text contains TEXT (repeatable); the stop string is not printed.")] = None
    max_time: Annotated[float | None, ranged(
        "max_time", "--max-time", rich_help_panel=STOPPING, metavar="SECONDS",
        help="Stop after this many seconds from the start of the request, prefill included (finish "
             "reason max_time); at least one token is generated.")] = None
    ctx_size: Annotated[int | None, ranged(
        "ctx_size", "--ctx-size", "-c",
        help="Context length in tokens, at most the model's; 0: the model's full context (default: the "
             f"model's, at most {DEFAULT_CONTEXT}).")] = None
    temperature: Annotated[float | None, ranged(
        "temperature", "--temperature", "-t", rich_help_panel=SAMPLING,
        help=f"Sampling temperature, {{range}}; 0 means greedy (default: {DEFAULT_TEMPERATURE}, and 0 with "
             f"--num-beams: deterministic beams).")] = None
    top_p: Annotated[float, ranged(
        "top_p", "--top-p", rich_help_panel=SAMPLING, help="Nucleus sampling mass, {range}.")] = _SAMPLING.top_p
    top_k: Annotated[int, ranged(
        "top_k", "--top-k", rich_help_panel=SAMPLING,
        help="Sample among the K most likely tokens only, {range}.")] = _SAMPLING.top_k
    min_p: Annotated[float, ranged(
        "min_p", "--min-p", rich_help_panel=SAMPLING,
        help="Drop tokens less likely than P times the most likely one, {range}.")] = _SAMPLING.min_p
    typical_p: Annotated[float, ranged(
        "typical_p", "--typical-p", rich_help_panel=SAMPLING,
        help="Locally typical sampling mass, {range}.")] = _SAMPLING.typical_p
    seed: Annotated[int | None, ranged(
        "seed", "--seed", rich_help_panel=SAMPLING,
        help="Sampling seed, {range} (default: random; reported unless the run is greedy).")] = None
    repetition_penalty: Annotated[float, ranged(
        "repetition_penalty", "--repetition-penalty", "--repeat-penalty", rich_help_panel=PENALTIES,
        help="Divide the positive logits (multiply the negative ones) of tokens already seen by this, "
             "{range}.")] = _SAMPLING.repetition_penalty
    repeat_last_n: Annotated[int, ranged(
        "repeat_last_n", "--repeat-last-n", rich_help_panel=PENALTIES,
        help="The repetition, presence and frequency penalties look at the last N tokens, "
             "{range}.")] = _SAMPLING.repeat_last_n
    presence_penalty: Annotated[float, ranged(
        "presence_penalty", "--presence-penalty", rich_help_panel=PENALTIES,
        help="Subtract this from the logit of every token already seen, {range}.")] = _SAMPLING.presence_penalty
    frequency_penalty: Annotated[float, ranged(
        "frequency_penalty", "--frequency-penalty", rich_help_panel=PENALTIES,
        help="Subtract this times its count from the logit of every token seen, {range}.")] = _SAMPLING.frequency_penalty
    no_repeat_ngram_size: Annotated[int, ranged(
        "no_repeat_ngram_size", "--no-repeat-ngram-size", rich_help_panel=PENALTIES,
        help="Never repeat a run of N tokens already in the prompt or reply, {range}.")] = _SAMPLING.no_repeat_ngram_size
    logit_bias: Annotated[list[str] | None, typer.Option(
        "--logit-bias", callback=_check_logit_bias, rich_help_panel=PENALTIES, metavar="ID=BIAS",
        help="Add BIAS to token ID's logit (repeatable); -inf bans the token.")] = None
    min_new_tokens: Annotated[int, ranged(
        "min_new_tokens", "--min-new-tokens", rich_help_panel=PENALTIES,
        help="No end-of-sequence token before this many new tokens, {range}.")] = _SAMPLING.min_new_tokens
    json_schema: Annotated[str | None, typer.Option(
        "--json-schema", callback=_check_constraint("json_schema"), metavar="FILE|JSON", rich_help_panel=STRUCTURED,
        help="The reply is one JSON value valid against this JSON Schema (a file, or the schema itself); it ends "
             "where the JSON does (finish reason stop_grammar).")] = None
    format: Annotated[str | None, typer.Option(
        "--format", callback=_check_constraint("format"), metavar="json", rich_help_panel=STRUCTURED,
        help="json: the reply is one JSON object.")] = None
    regex: Annotated[str | None, typer.Option(
        "--regex", callback=_check_constraint("regex"), metavar="PATTERN", rich_help_panel=STRUCTURED,
        help="The whole reply matches this regular expression (\\d, \\w, \\s are ASCII).")] = None
    grammar: Annotated[str | None, typer.Option(
        "--grammar", callback=_check_constraint("grammar"), metavar="FILE", rich_help_panel=STRUCTURED,
        help="The reply follows this grammar: Lark (llguidance's dialect) or llama.cpp's GBNF.")] = None
    num_beams: Annotated[int, ranged(
        "num_beams", "--num-beams", rich_help_panel=BEAMS,
        help="Beam search with N beams, {range}; deterministic unless -t is given. Not streamed: a progress "
             "line, then the best beam.")] = _BEAMS.num_beams
    length_penalty: Annotated[float, ranged(
        "length_penalty", "--length-penalty", rich_help_panel=BEAMS,
        help="A beam's score is its log-probability over length ** this, {range}; above 0 favours "
             "longer beams.")] = _BEAMS.length_penalty
    early_stopping: Annotated[str, typer.Option(
        "--early-stopping", callback=_check_early_stopping, rich_help_panel=BEAMS, metavar="true|false|never",
        help="true: stop when num-beams beams have finished; false: when no running beam is likely to do "
             "better; never: when none can.")] = str(_BEAMS.early_stopping).lower()
    num_return: Annotated[int, ranged(
        "num_return", "--num-return", "--num-return-sequences", rich_help_panel=BEAMS,
        help="How many of the best beams to return, at most num-beams (all of them under --json; "
             "the best one on a terminal).")] = _BEAMS.num_return
    device: Annotated[str, typer.Option(
        "--device", callback=_check_device, metavar="DEVICE", help="auto, cpu, cuda, cuda:N or mps.")] = "auto"
    dtype: Annotated[DType, typer.Option(
        "--dtype", help="Weights dtype; auto: float32 on cpu, bfloat16 on cuda, float16 on mps (a quantized GGUF "
                        "file's blocks kept as they are on cpu; a dtype given expands them).")] = DType("auto")
    compile: Annotated[bool | None, typer.Option(
        "--compile/--no-compile",
        help=f"Compile the decode step (default: for models of {COMPILE_MIN_PARAMETERS // 10**6}M parameters or more, on CUDA, and on the "
             "CPU in float32 where llama-chat's CPU kernels are not built; int8 only when asked). The first run compiles (a C++ compiler is needed on the CPU; without one the "
             "step runs uncompiled); later runs reuse the on-disk cache.")] = None
    quantize: Annotated[Quantize, typer.Option(
        "--quantize", help="Weights, made at load time: none; int8 (weight-only, one scale per output row, "
                           "about a quarter of float32's bytes); q8_0 or q4_0 (llama.cpp's blocks of 32 "
                           "values, about 0.27 and 0.14 of float32's bytes).")] = Quantize("none")
    cache_type: Annotated[CacheType, typer.Option(
        "--cache-type",
        help="The KV cache's keys and values: f32, f16 or bf16; q8_0 or q4_0 (llama.cpp's blocks of 32 "
             "values, about 0.53 and 0.28 of f16's bytes, read by the CPU kernels; q4_0 keys are "
             "Hadamard-rotated); auto: f16 on cpu, the weights' dtype on cuda and mps.")] = CacheType("auto")
    lookup: Annotated[Lookup, typer.Option(
        "--lookup", help="Speculative decoding by prompt lookup: a step also feeds the tokens that followed the "
                         "reply's last few tokens where they appeared before, and keeps those the model "
                         "agrees with; the reply is the same, faster where it repeats its input (on the CPU, "
                         "while few jobs run). auto: on, except for one stream of 16-bit weights, whose "
                         "drafted steps would first make a float32 copy of them.")] = Lookup(DEFAULT_LOOKUP)
    draft: Annotated[str | None, typer.Option(
        "--draft", metavar="MODEL",
        help="Speculative decoding with a draft model (named as -m is): a smaller model with the same "
             "vocabulary guesses the next tokens, where prompt lookup has none, and the model keeps those "
             "it agrees with; the reply is the same (on the CPU, while few jobs run).")] = None
    draft_max: Annotated[int, ranged(
        "draft_max", "--draft-max", help="--lookup, --draft: most tokens drafted for one job in one step, "
                                         "{range}.")] = DEFAULT_DRAFT_MAX
    prompt_cache: Annotated[str | None, typer.Option(
        "--prompt-cache", metavar="DIR",
        help="Keep the KV pages of prompts on disk in DIR, and read them back in later runs and servers "
             f"instead of computing them again (a long system prompt's first token); {PROMPT_CACHE_DEFAULT_DIR}: "
             "$XDG_CACHE_HOME/llama-chat/prompt-cache (by default under ~/.cache). Default: off.")] = None
    prompt_cache_size: Annotated[int, ranged(
        "prompt_cache_size", "--prompt-cache-size", metavar="MIB",
        help="--prompt-cache: most MiB its blocks take, {range}; the least recently used go first.")] = \
        DEFAULT_PROMPT_CACHE_MIB
    template: Annotated[Template, typer.Option(
        "--template", help="Chat format; auto: the model's if it has one, else plain completion.")] = Template("auto")
    chat_template_file: Annotated[str | None, typer.Option(
        "--chat-template-file", metavar="FILE",
        help="A Jinja chat template to use instead of the model's own (rendered in the same sandbox).")] = None
    think: Annotated[Think, typer.Option(
        "--think", rich_help_panel=THINKING,
        help="A thinking model's thinking: on, off (the template's own way, else the end tag written at once), "
             "or auto (as its template does by default).")] = Think("auto")
    reasoning_budget: Annotated[int | None, ranged(
        "reasoning_budget", "--reasoning-budget", rich_help_panel=THINKING, metavar="N",
        help="Most thinking tokens, {range}; then the end tag is forced and the answer follows "
             "(default: no limit).")] = None
    reasoning_format: Annotated[ReasoningFormat, typer.Option(
        "--reasoning-format", rich_help_panel=THINKING,
        help="deepseek: the thinking kept apart from the answer; none: left in the text, tags and all.")] = \
        ReasoningFormat("deepseek")
    hide_thinking: Annotated[bool, typer.Option(
        "--hide-thinking", rich_help_panel=THINKING,
        help="On a terminal, show only a line saying how long the model thought, not its thinking.")] = False
    json: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object at the end instead of text (not with the chat).")] = False
    stats: Annotated[bool, typer.Option(
        "--stats", help="Load time, timings and token counts on stderr (in the chat: after each reply).")] = False
    no_history: Annotated[bool, typer.Option(
        "--no-history", help="Chat: neither read nor write the input history file.")] = False
    color: Annotated[ColorMode, typer.Option(
        "--color", help="Colour on a terminal (NO_COLOR is honoured).")] = ColorMode("auto")
    batch: Annotated[str | None, typer.Option(
        "--batch", metavar="[FILE]", rich_help_panel=BATCH,
        help="Run every line of FILE (default: stdin) as its own job, many at once: plain prompts, or JSON "
             "objects with a prompt and options of their own. JSON Lines out, one per job as it finishes.")] = None
    ordered: Annotated[bool, typer.Option(
        "--ordered", rich_help_panel=BATCH, help="--batch: write the results in input order.")] = False
    max_batch: Annotated[int, ranged(
        "max_batch", "--max-batch", rich_help_panel=BATCH, help="Most jobs generating at once.")] = DEFAULT_MAX_BATCH
    cache_tokens: Annotated[int | None, ranged(
        "cache_tokens", "--cache-tokens", rich_help_panel=BATCH,
        help=f"--batch: size of the paged KV cache in tokens (default: --max-batch contexts, at most "
             f"{DEFAULT_CACHE_TOKENS_CAP} and {DEFAULT_CACHE_BYTES_CAP >> 30} GiB; "
             "at least one context).")] = None
    debug: Annotated[bool, typer.Option("--debug", help="Show a traceback on failure.")] = False

    def __post_init__(self) -> None:
        # Code below the command line sees plain strings and tuples, not typer's enums and lists.
        for name in ("dtype", "template", "color", "quantize", "cache_type", "lookup", "think", "reasoning_format"):
            value = getattr(self, name)
            if isinstance(value, enum.Enum):
                object.__setattr__(self, name, value.value)
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "logit_bias", tuple(tuple(b) for b in self.logit_bias or ()))

    def sampling(self) -> SamplingParams:
        """The generation controls as ``SamplingParams`` (the temperature's default depends on
        ``num_beams``: ``controls.temperature_for``)."""
        values = {f.name: getattr(self, f.name) for f in fields(SamplingParams)}
        values["temperature"] = temperature_for(self.temperature, self.num_beams)
        return SamplingParams(**values)

    def beams(self) -> BeamParams:
        return BeamParams(**{f.name: getattr(self, f.name) for f in fields(BeamParams)})

    def constraint_texts(self) -> dict[str, str | None]:
        """The constraint options' texts by name (``CONSTRAINT_OPTIONS``, the one list of them)."""
        return {name: getattr(self, name) for name in CONSTRAINT_OPTIONS}

    def constraint(self) -> Constraint | None:
        """What the replies must match (``ml/grammars.py``); ``ControlError`` when more than one
        of --json-schema, --format json, --regex and --grammar is given."""
        made = [make_constraint(name, text) for name, text in self.constraint_texts().items() if text is not None]
        made = [c for c in made if c is not None]  # --format none
        if len(made) > 1:
            raise ControlError("structured output", "takes one of --json-schema, --format json, --regex and "
                                                    f"--grammar, got {len(made)}")
        return made[0] if made else None

    def thinking(self) -> Thinking:
        """A thinking model's settings: ``--think``, ``--reasoning-budget``, ``--reasoning-format``."""
        return Thinking(self.think, self.reasoning_budget, self.reasoning_format != "none")

    def request(self, prompt_ids: Sequence[int], *, chat_reply: bool, reuse_cache: bool = False,
                request_id: str | None = None, thinker: tuple[ThinkTags, Any] | None = None, **overrides: Any) -> Request:
        """The ``Request`` for ``prompt_ids`` under these options, with a job's own settings
        (``overrides``, by option name: ``max_tokens``, ``seed``, ``temperature`` ...) over them.
        Without a seed, one is drawn (``Request.seed`` says which). ``thinker``: a thinking model's
        tags and tokenizer, for a chat reply (``reasoning.thinking_request``)."""
        opts = self.with_settings(**overrides) if overrides else self
        seed = opts.seed if opts.seed is not None else secrets.randbelow(RANDOM_SEEDS)
        request = Request(prompt_ids, sampling=opts.sampling(), seed=seed, max_tokens=opts.max_tokens, stop=opts.stop,
                          chat_reply=chat_reply, reuse_cache=reuse_cache, max_time=opts.max_time, beams=opts.beams(),
                          request_id=request_id or new_request_id(), constraint=opts.constraint())
        if thinker is None or not chat_reply:
            return request
        tags, tokenizer = thinker
        return thinking_request(request, tags, opts.thinking(), tokenizer)

    def load_settings(self) -> LoadSettings:
        """What loads the model, and what its caches must have room for."""
        return LoadSettings(
            model=self.model, device=self.device, dtype=self.dtype, ctx_size=self.ctx_size, quantize=self.quantize,
            template=self.template, chat_template_file=self.chat_template_file, download=self.download,
            remote_model=self.remote_model, api_key=self.api_key, quiet=self.json,
            room=CacheRoom(batch=self.batch is not None, beams=self.num_beams, cache_tokens=self.cache_tokens,
                           max_batch=self.max_batch))

    def source_settings(self) -> SourceSettings:
        """What the command's source is made from (``generation_source.make_source``): one stream
        for a prompt or a chat, many jobs with ``--batch``."""
        return SourceSettings(
            self.load_settings(), jobs=ONE_STREAM if self.batch is None else BATCH_JOBS, max_batch=self.max_batch,
            cache_tokens=self.cache_tokens, cache_type=self.cache_type, compile=self.compile, lookup=self.lookup,
            draft=self.draft, draft_max=self.draft_max, prompt_cache=self.prompt_cache,
            prompt_cache_size=self.prompt_cache_size)

    def with_settings(self, **changes: Any) -> Options:
        """These options with ``changes`` (by option name). A constraint named there replaces the
        one these options have: a --batch line's schema, a /set regex after --json-schema, and
        /set format none (or any of them none) leaves none."""
        if any(name in changes for name in CONSTRAINT_OPTIONS):
            changes = {**{name: None for name in CONSTRAINT_OPTIONS}, **changes}
        return replace(self, **changes)


__all__ = ["THINKING", "BATCH", "BEAMS", "CONSTRAINT_OPTIONS", "PENALTIES", "SAMPLING", "STOPPING", "STRUCTURED", "ColorMode",
           "CacheType", "DType", "Options", "Quantize", "Template", "constraint_text", "make_constraint"]

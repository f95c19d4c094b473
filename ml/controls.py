"""The generation controls and their allowed ranges, with every other range and choice list of the
command line, in one place and without torch.

Each control is named as in Hugging Face's ``GenerationConfig`` (``top_k``, ``min_p``,
``repetition_penalty`` ...), except where transformers has none and llama.cpp or OpenAI do
(``repeat_last_n``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``). The command line
checks its options against the same table before torch is imported, so that a bad value is an
instant usage error, and ``SamplingParams`` checks it again for callers that build one directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Union

EarlyStopping = Union[bool, str]  # True, False or "never", as in transformers


class ControlError(ValueError):
    """A control outside its range. ``str()`` is one line naming the control; ``reason`` omits the name."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name} {reason}")
        self.name = name
        self.reason = reason


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Rule:
    kind: type  # int or float: what a value is read as (an int is taken where a float is asked)
    test: Callable[[object], bool]
    allowed: str  # what the error says is allowed, e.g. "in 0 < p <= 1"


MAX_SEED = 2**64 - 1
# Bounds of the options that size buffers allocated whole: no model has a longer context than
# this (the loader refuses larger dimensions), and no CPU or GPU runs more jobs in one step. The
# memory a value needs is checked against the machine's once the model is known
# (model/memory_budget.py).
MAX_TOKENS = 2**24
MAX_BATCH = 4096
DEFAULT_TEMPERATURE = 0.8
# Tokens drafted for a job in one step (each a row of the step). By default a copied span drafts
# far enough that its rows go through the products as a prompt's do, where a row costs least.
MAX_DRAFT = 64
DEFAULT_DRAFT_MAX = 32
# The prompt cache on disk (--prompt-cache, model/prompt_cache.py): the most MiB its blocks take,
# and the name that stands for its folder under the user cache.
DEFAULT_PROMPT_CACHE_MIB = 4096
MAX_PROMPT_CACHE_MIB = 1 << 24
PROMPT_CACHE_DEFAULT_DIR = "auto"
# Defaults the command line's help states, defined here (no torch) and used where they act.
# A checkpoint's context is cut to this unless -c says otherwise (model/loader.py): a 128k-token
# context would cost its KV cache gigabytes before the first token.
DEFAULT_CONTEXT = 4096
DEFAULT_MAX_BATCH = 16  # jobs generating at once: --batch, serve, a remote server's requests
# Without --cache-tokens, a paged cache holds every batch slot at the full context, up to this
# many tokens (a TinyLlama-sized model in bfloat16 keeps 22 KB per token: 1.4 GB) and this many
# bytes (a 7B model in float16 keeps 0.5 MB per token), but always one whole context.
DEFAULT_CACHE_TOKENS_CAP = 65536
DEFAULT_CACHE_BYTES_CAP = 4 * 2**30
# Below this many parameters a compile costs more time than it ever saves (docs/benchmarks.md,
# "CPU decode against llama2.c and transformers").
COMPILE_MIN_PARAMETERS = 50_000_000

# Stop strings: every one is looked for in each job's new text after every token, so their number
# and length are work per token that one request could make large for every other client.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 8192  # all of a request's stop strings together
# Structured output (ml/grammars.py). A schema or grammar's text, and how long a chain of
# references in it may be: the constraint engine compiles a chain of rules or $refs, each leading
# to the next, by recursion on a native stack (ml/grammar_depth.py measures it). Its parser
# cannot run a chain of 1,000 rules anyway (at the first token a row outgrows its limit of 2,000
# items); a schema's chain counts each $ref and the object that holds it. Compiles hold about 30
# bytes of memory per byte of text while they run; those running at once share a budget of text.
MAX_CONSTRAINT_BYTES = 1 << 20
MAX_GRAMMAR_DEPTH = 2500
GRAMMAR_COMPILE_BUDGET_BYTES = 4 << 20
# Compiled constraints kept for reuse, each cache at most this many, holding this much text: a
# --batch run may give every line its own schema, and a constraint no longer kept is compiled
# again (a millisecond or so for a small one). What is compiled holds about 25 bytes a byte of text.
KEPT_CONSTRAINTS = 64
KEPT_CONSTRAINT_BYTES = 4 << 20

# Every ranged setting: the command line's options, the keys of a --batch line and the chat's /set
# are all checked here, by ``check`` (values) or ``parse`` (text), so they refuse the same values
# with the same reason.
RULES: dict[str, Rule] = {
    "temperature": Rule(float, lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "top_p": Rule(float, lambda v: _finite(v) and 0 < v <= 1, "in 0 < p <= 1"),
    "top_k": Rule(int, lambda v: v >= 0, "an integer >= 0 (0: off)"),
    "min_p": Rule(float, lambda v: _finite(v) and 0 <= v <= 1, "in 0 <= p <= 1 (0: off)"),
    "typical_p": Rule(float, lambda v: _finite(v) and 0 < v <= 1, "in 0 < p <= 1 (1: off)"),
    "repetition_penalty": Rule(float, lambda v: _finite(v) and v > 0, "a finite number > 0 (1: off)"),
    "repeat_last_n": Rule(int, lambda v: v >= 0, "an integer >= 0 (0: every token so far)"),
    "presence_penalty": Rule(float, lambda v: _finite(v) and -2 <= v <= 2, "in -2 <= x <= 2 (0: off)"),
    "frequency_penalty": Rule(float, lambda v: _finite(v) and -2 <= v <= 2, "in -2 <= x <= 2 (0: off)"),
    "no_repeat_ngram_size": Rule(int, lambda v: v >= 0, "an integer >= 0 (0: off)"),
    "min_new_tokens": Rule(int, lambda v: v >= 0, "an integer >= 0"),
    "num_beams": Rule(int, lambda v: 1 <= v <= 64, "an integer in 1 <= n <= 64 (1: no beam search)"),
    "length_penalty": Rule(float, lambda v: _finite(v) and -10 <= v <= 10, "in -10 <= x <= 10"),
    "num_return": Rule(int, lambda v: v >= 1, "an integer >= 1"),
    "max_time": Rule(float, lambda v: _finite(v) and v > 0, "a number of seconds > 0"),
    "max_tokens": Rule(int, lambda v: v >= 1, "at least 1"),
    "seed": Rule(int, lambda v: 0 <= v <= MAX_SEED, "in 0 <= seed <= 2**64-1"),
    "ctx_size": Rule(int, lambda v: 0 <= v <= MAX_TOKENS,
                     f"0 (the model's full context) or a positive number up to {MAX_TOKENS}"),
    "max_batch": Rule(int, lambda v: 1 <= v <= MAX_BATCH, f"an integer in 1 <= n <= {MAX_BATCH}"),
    "cache_tokens": Rule(int, lambda v: 1 <= v <= MAX_TOKENS, f"an integer in 1 <= n <= {MAX_TOKENS}"),
    "draft_max": Rule(int, lambda v: 1 <= v <= MAX_DRAFT, f"an integer in 1 <= n <= {MAX_DRAFT}"),
    "prompt_cache_size": Rule(int, lambda v: 1 <= v <= MAX_PROMPT_CACHE_MIB,
                              f"a number of MiB in 1 <= n <= {MAX_PROMPT_CACHE_MIB}"),
    "reasoning_budget": Rule(int, lambda v: 0 <= v <= MAX_TOKENS,
                             f"an integer in 0 <= n <= {MAX_TOKENS} (0: no thinking)"),
}

# The choices of the command line's options that are not ranges. The chat formats' names are
# ``model.chat_format.FORMAT_NAMES``.
DTYPES = ("auto", "float32", "bfloat16", "float16")
# int8: one scale per output row; q8_0 and q4_0: llama.cpp's blocks of 32 values (ml/packed.py).
QUANTIZE_MODES = ("none", "int8", "q8_0", "q4_0")
COLOR_MODES = ("auto", "always", "never")
# The KV cache's keys and values (model/kv_types.py), named as llama.cpp's -ctk: auto is f16 on the
# CPU (llama.cpp's default) and the model's dtype elsewhere; q8_0 and q4_0 are blocks of 32 values
# with one float16 scale, read by the CPU operator.
CACHE_TYPES = ("auto", "f32", "f16", "bf16", "q8_0", "q4_0")
# Speculative decoding by prompt lookup (inference/speculative.py): drafts from the tokens so far.
# auto: on, except for one stream whose drafted steps would make a float32 copy of 16-bit weights
# that its own steps never read (``cmd/generation_source.lookup_on``; docs/benchmarks.md).
LOOKUP_MODES = ("auto", "off", "on")
DEFAULT_LOOKUP = "auto"
# A request's own choice on the server (``"lookup"``, ``"draft"``): the server's setting otherwise.
SWITCH = ("on", "off")
# A thinking model's thinking (inference/reasoning.py): auto is as its chat template does by default.
THINK_MODES = ("auto", "on", "off")
# --reasoning-format, as llama-server names it: deepseek keeps the thinking apart from the answer,
# none leaves it in the text, tags and all.
REASONING_FORMATS = ("deepseek", "none")
# OpenAI's reasoning_effort: none turns thinking off, every other effort leaves it on.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _kind_name(kind: type) -> str:
    return "an integer" if kind is int else "a number"


# The server's ranges that are not settings (cmd/openai_api.py), OpenAI's own bounds: how many
# choices a request asks for, and how many alternatives a token's logprobs list.
MAX_CHOICES = 128
MAX_TOP_LOGPROBS = 20  # a chat's top_logprobs (vLLM's bound too)
MAX_COMPLETION_LOGPROBS = 5  # a completion's logprobs
MAX_EMBEDDING_INPUTS = 2048  # inputs (or documents) in one embedding or rerank request: OpenAI's limit
# How an embedding model pools its hidden states (model/pooling.py): mean, the average of a text's
# tokens; cls, its first token's state; last, its last token's (decoder embedders); none, every
# token's state, unpooled.
POOLING_MODES = ("mean", "cls", "last", "none")
SERVER_RULES: dict[str, Rule] = {
    # Speculative decoding for one request (inference/speculative.py): prompt lookup, the server's
    # draft model, and "draft_max" (``RULES``) the most tokens drafted in one step.
    "lookup": Rule(str, lambda v: v in SWITCH, "on or off"),
    "draft": Rule(str, lambda v: v in SWITCH, "on or off"),
    "n": Rule(int, lambda v: 1 <= v <= MAX_CHOICES, f"an integer in 1 <= n <= {MAX_CHOICES}"),
    "best_of": Rule(int, lambda v: 1 <= v <= MAX_CHOICES, f"an integer in 1 <= best_of <= {MAX_CHOICES}"),
    "top_logprobs": Rule(int, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                         f"an integer in 0 <= top_logprobs <= {MAX_TOP_LOGPROBS}"),
    "logprobs": Rule(int, lambda v: 0 <= v <= MAX_COMPLETION_LOGPROBS,
                     f"an integer in 0 <= logprobs <= {MAX_COMPLETION_LOGPROBS}"),
}


def check(name: str, value):
    """``value`` if setting ``name`` (or the server's field ``name``: ``SERVER_RULES``) allows it,
    else ``ControlError`` ("must be ..., got ...").

    An integer given for a float setting comes back as a float."""
    rule = RULES[name] if name in RULES else SERVER_RULES[name]
    if rule.kind is float and _integer(value):
        value = float(value)
    if rule.kind is str:
        if not (isinstance(value, str) and rule.test(value)):
            raise ControlError(name, f"must be {rule.allowed}, got {value!r}")
        return value
    if not (_integer(value) if rule.kind is int else isinstance(value, float)):
        # "an integer in 1 <= n <= 128" says the kind too: then the whole rule, else the kind.
        expected = rule.allowed if rule.allowed.startswith(_kind_name(rule.kind)) else _kind_name(rule.kind)
        raise ControlError(name, f"must be {expected}, got {value!r}")
    if not rule.test(value):
        raise ControlError(name, f"must be {rule.allowed}, got {value}")
    return value


def parse(name: str, text: str):
    """Setting ``name`` given as text (the chat's /set), read as its kind and checked by ``check``."""
    kind = RULES[name].kind
    try:
        value = kind(text.strip())
    except ValueError:
        raise ControlError(name, f"must be {_kind_name(kind)}, got {text.strip()!r}") from None
    return check(name, value)


def check_stop(strings) -> tuple[str, ...]:
    """A request's stop strings as a tuple, within ``MAX_STOP_STRINGS`` and ``MAX_STOP_CHARS``;
    ``ControlError`` otherwise."""
    strings = tuple(strings)
    if not all(isinstance(s, str) for s in strings):
        raise ControlError("stop", "must be a string or a list of strings")
    if len(strings) > MAX_STOP_STRINGS:
        raise ControlError("stop", f"holds {len(strings)} strings, more than the limit of {MAX_STOP_STRINGS}")
    chars = sum(map(len, strings))
    if chars > MAX_STOP_CHARS:
        raise ControlError("stop", f"strings hold {chars} characters together, more than the limit of {MAX_STOP_CHARS}")
    return strings


def temperature_for(temperature: float | None, num_beams: int) -> float:
    """The temperature given, else the default: 0 under beam search (deterministic beams, as
    transformers' ``num_beams`` without ``do_sample``), ``DEFAULT_TEMPERATURE`` otherwise."""
    if temperature is not None:
        return temperature
    return 0.0 if num_beams > 1 else DEFAULT_TEMPERATURE


def parse_logit_bias(text: str) -> tuple[int, float]:
    """``"ID=BIAS"`` (llama.cpp's ``--logit-bias`` form, also ``ID+BIAS`` / ``ID-BIAS``) -> (id, bias).

    A bias of ``-inf`` bans the token. Raises ``ControlError`` with the reason in one line.
    """
    s = text.strip()
    for sep in ("=", "+", "-"):
        head, found, tail = s.partition(sep) if sep != "-" else s.rpartition(sep)
        if found and head.strip():
            break
    else:
        raise ControlError("logit_bias", f"must be ID=BIAS (for example 15043=-inf), got {text!r}")
    try:
        token = int(head.strip())
        bias = float(tail.strip())
    except ValueError:
        raise ControlError("logit_bias", f"must be ID=BIAS (for example 15043=-inf), got {text!r}") from None
    if sep == "-":
        bias = -bias
    if token < 0:
        raise ControlError("logit_bias", f"token id must be >= 0, got {token}")
    if math.isnan(bias) or bias == math.inf:
        raise ControlError("logit_bias", f"bias must be a finite number or -inf, got {bias}")
    return token, bias


def check_early_stopping(value) -> EarlyStopping:
    """``True``, ``False`` or ``"never"`` (also as the strings true/false/yes/no/1/0)."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in ("true", "yes", "1", "on"):
        return True
    if word in ("false", "no", "0", "off"):
        return False
    if word == "never":
        return "never"
    raise ControlError("early_stopping", f"must be true, false or never, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token: Hugging Face's logits processors and warpers, and the draw.

    ``temperature == 0`` means greedy (argmax after the processors). Neutral values switch a
    control off: ``top_k=0``, ``min_p=0``, ``typical_p=1``, ``repetition_penalty=1``, penalties 0,
    ``no_repeat_ngram_size=0``, no ``logit_bias``, ``min_new_tokens=0``. ``repeat_last_n``
    limits the repetition, presence and frequency penalties to the last N tokens (0: the whole
    prompt and reply, as transformers does). ``logit_bias`` is ``((token_id, bias), ...)``.
    """

    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 0.95
    top_k: int = 0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        # Validated once here, not per token: a bad value should fail before generation starts.
        for f in fields(self):
            if f.name in RULES:
                check(f.name, getattr(self, f.name))
        bias = []
        for item in self.logit_bias:
            token, value = item if not isinstance(item, str) else parse_logit_bias(item)
            if not _integer(token) or token < 0 or math.isnan(value) or value == math.inf:
                raise ControlError("logit_bias", f"must be (token id >= 0, finite bias or -inf), got {item!r}")
            bias.append((int(token), float(value)))
        object.__setattr__(self, "logit_bias", tuple(bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_history(self) -> bool:
        """Whether a control reads the tokens so far (penalties, n-grams, the new-token count)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.no_repeat_ngram_size > 0 or self.min_new_tokens > 0)

    @property
    def simple_warpers(self) -> bool:
        """No warper but temperature and top-p (``sampling.sample`` applies those itself)."""
        return self.greedy or (self.top_k == 0 and self.min_p == 0.0 and self.typical_p == 1.0)

    @property
    def plain(self) -> bool:
        """Only temperature and top-p: what ``sampling.sample`` and the compiled step do alone."""
        return self.simple_warpers and not self.uses_history and not self.logit_bias


@dataclass(frozen=True)
class BeamParams:
    """Beam search as in transformers: ``num_beams`` hypotheses, scored by the sum of their
    log-probabilities over ``length ** length_penalty``; ``early_stopping`` True stops when
    ``num_beams`` hypotheses have finished, False when no running beam can beat them by a
    heuristic, "never" when none can in the best case; ``num_return`` best ones are returned."""

    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    num_return: int = 1

    def __post_init__(self) -> None:
        check("num_beams", self.num_beams)
        check("length_penalty", self.length_penalty)
        check("num_return", self.num_return)
        object.__setattr__(self, "early_stopping", check_early_stopping(self.early_stopping))
        if self.num_return > self.num_beams:
            raise ControlError("num_return", f"must be at most num_beams ({self.num_beams}), got {self.num_return}")

    @property
    def enabled(self) -> bool:
        return self.num_beams > 1


__all__ = ["BeamParams", "REASONING_EFFORTS", "REASONING_FORMATS", "THINK_MODES", "CACHE_TYPES", "COLOR_MODES", "ControlError", "DEFAULT_TEMPERATURE", "DEFAULT_LOOKUP", "DTYPES", "EarlyStopping",
           "GRAMMAR_COMPILE_BUDGET_BYTES", "KEPT_CONSTRAINTS", "KEPT_CONSTRAINT_BYTES", "MAX_CONSTRAINT_BYTES",
           "MAX_GRAMMAR_DEPTH", "MAX_SEED", "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "QUANTIZE_MODES", "RULES",
           "SamplingParams", "check", "check_early_stopping", "check_stop", "parse", "parse_logit_bias",
           "temperature_for"]

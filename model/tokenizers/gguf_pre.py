"""The pre-tokenizers a byte-level BPE vocabulary in a GGUF file names (``tokenizer.ggml.pre``).

llama.cpp's converter (``convert_hf_to_gguf.py``) recognises a Hugging Face tokenizer by the ids
it gives a probe text and writes a name for the way that tokenizer cuts text into pieces before
the merges; llama.cpp's vocabulary code (``src/llama-vocab.cpp``) maps each name to one or more
regular expressions. Each expression cuts every piece the one before it made: its matches and the
text between them become the pieces (the ``tokenizers`` library's ``Split`` with ``isolated``
behaviour, which is how they are run here, before GPT-2's byte-to-unicode mapping).

The expressions are llama.cpp's, as data. llama.cpp runs them with its own Unicode category
matcher or ``std::regex``; here they run in Oniguruma (the ``tokenizers`` library's engine), which
reads them as they are. Where llama.cpp rewrote a Hugging Face expression to suit ``std::regex``
and the rewrite matches differently, the Hugging Face original (which llama.cpp keeps beside it
in a comment, and which the model's tokenizer ran) is used instead; each such place says so.

Names are llama.cpp's, including a few it reads that the converter no longer writes (``llama3``,
``llama-v3``, ``glm5``, ``llada-moe``, ``jina-es``, ``jina-de``). Not here, so refused by name:
``kimi-k2`` and ``afmoe`` (llama.cpp splits those in custom code, not by an expression), and
``gemma4``, ``granite-embed-multi-311m``, ``sarvam-moe`` and ``whitespace`` (not byte-level
vocabularies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# --- the expressions, one constant per distinct set -------------------------------------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")

# Llama 3's with runs of whitespace cut into powers of two
JAIS2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
         r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")

# Llama 3's with single digits
QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")

QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Not a raw string: six of its characters are escapes, since Unicode normalization (which an
# editor may apply) would turn them into others (the Kelvin sign into K, the Ohm sign into Omega).
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ"
    "-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-"
    "ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+"
)
DEEPSEEK_LLM = (r"[\r\n]", _DEEPSEEK_LETTERS, r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}+")

DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")

_ASCII_PUNCT_WORD = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"""
DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
SPARK2_5 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
    r"\p{N}",
)


def _cased_words(tail: str) -> str:
    """Words as upper-case letters then lower-case ones, or the other way round, then ``tail``."""
    upper, lower = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
    return (rf"[^\r\n\p{{L}}\p{{N}}]?{upper}*{lower}+{tail}"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{upper}+{lower}*{tail}")


YOUTU = (
    r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
    _cased_words(_CONTRACTIONS + "?")
    + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# Translated: llama.cpp spells "upper-case letters, then lower-case ones" as ((?=[\p{L}])([^a-z]))*
# ((?=[\p{L}])([^A-Z]))+, because std::regex has no \p{Lu}; that takes every letter outside A-Z as
# lower-case and every letter outside a-z as a capital ("ÉCOLE" becomes "É" + "COLE"). Oniguruma
# has the categories, so Mistral's own expression (Tekken) and OpenAI's (GPT-4o) are used.
TEKKEN = _cased_words("") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GPT4O = (_cased_words("(?i:'s|'t|'re|'ve|'m|'ll|'d)?")
         + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TINY_AYA = (r"\d{1,3}(?=(?:\d{3})*\b)",
            _cased_words(_CONTRACTIONS + "?")
            + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's own (it gives no original): GPT-4o's with combining marks counted as letters
GRANITE_EMB_MULTI = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]")
# single digits first, then GPT-2's (StarCoder, SmolLM, Command R, ...)
STARCODER = (r"\p{N}", GPT2)
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
VIKING = (BLOOM, r"\p{N}")
CHAMELEON = (r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
             r"[\p{P}!-/:-@\[-`{-~]", GPT2)
SUPERBPE = (r"\p{N}+", r"(?=(\d{3})+(?!\d))")
# Translated: llama.cpp drops the possessive quantifiers (?+, ++) of Ling's expression for
# std::regex, which then backtracks where the original does not; Oniguruma has them.
BAILINGMOE = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]"
              r"|\s+(?!\S)|\s+")
SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
# Qwen 2's without the English contractions
UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LAGUNA = (r"[^\n]+|[\n]+", QWEN2)
EXAONE_MOE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")
MINICPM5 = (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")


# --- the names ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreTokenizer:
    """How a ``tokenizer.ggml.pre`` name cuts text and how llama.cpp treats its vocabulary."""

    splits: tuple[str, ...]  # applied in order, each to the pieces of the one before
    ignore_merges: bool = False  # a piece that is itself a token is that token (tiktoken's rule)
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token

    def spec(self) -> dict[str, Any]:
        """The ``pre_tokenizer`` of a ``tokenizers`` JSON spec: the splits, then GPT-2's byte mapping."""
        steps: list[dict[str, Any]] = [{"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated",
                                        "invert": False} for split in self.splits]
        steps.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False})
        return {"type": "Sequence", "pretokenizers": steps}


def _one(split: str | tuple[str, ...], **flags: bool) -> PreTokenizer:
    return PreTokenizer(splits=(split,) if isinstance(split, str) else split, **flags)


_LLAMA3 = _one(LLAMA3, ignore_merges=True, add_bos=True)
_GPT2 = _one(GPT2)
_STARCODER = _one(STARCODER)
_QWEN2 = _one(QWEN2)
_DEEPSEEK3 = _one(DEEPSEEK3)
_GPT4O = _one(GPT4O)
_BLOOM = _one(BLOOM)
_BAILINGMOE = _one(BAILINGMOE)

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _one(DEFAULT),
    # Llama 3's split, with whole-word lookup before the merges and a bos by default
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3, "falcon-h1": _LLAMA3,
    "pixtral": _LLAMA3, "midm-2.0": _LLAMA3, "lfm2": _LLAMA3, "jina-v5-nano": _LLAMA3,
    # Llama 3's split with the merges always run
    "dbrx": _one(LLAMA3), "smaug-bpe": _one(LLAMA3), "chatglm-bpe": _one(LLAMA3),
    "glm4": _one(LLAMA3, ignore_merges=True), "glm5": _one(LLAMA3, ignore_merges=True),
    "jais-2": _one(JAIS2),
    "minicpm5": _one(MINICPM5, ignore_merges=True),
    "deepseek-llm": _one(DEEPSEEK_LLM),
    "deepseek-coder": _one(DEEPSEEK_CODER),
    "deepseek-v3": _DEEPSEEK3, "hunyuan-dense": _DEEPSEEK3, "hy_v4": _DEEPSEEK3, "joyai-llm": _DEEPSEEK3,
    "spark2_5": _one(SPARK2_5),
    "youtu": _one(YOUTU, ignore_merges=True),
    "falcon": _one(FALCON),
    # GPT-2's split
    "gpt-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2, "jais": _GPT2, "trillion": _GPT2, "granite-docling": _GPT2,
    "phi-2": _GPT2, "gigachat": _GPT2, "a.x-4.0": _GPT2, "mellum": _GPT2, "modern-bert": _GPT2,
    "exaone4": _GPT2, "jina-es": _GPT2, "jina-de": _GPT2, "jina-v2-es": _GPT2, "jina-v2-de": _GPT2,
    "jina-v1-en": _GPT2, "jina-v2-code": _GPT2, "roberta-bpe": _GPT2,
    # single digits, then GPT-2's split
    "starcoder": _STARCODER, "refact": _STARCODER, "command-r": _STARCODER, "smollm": _STARCODER,
    "codeshell": _STARCODER, "exaone": _STARCODER, "minerva-7b": _STARCODER, "mellum2": _STARCODER,
    # Llama 3's split with single digits
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "kormo": _QWEN2, "f2llmv2": _QWEN2, "megrez": _QWEN2,
    "stablelm2": _QWEN2, "hunyuan": _QWEN2, "solar-open": _QWEN2, "grok-2": _QWEN2,
    "qwen35": _one(QWEN35),
    "poro-chat": _BLOOM, "bloom": _BLOOM, "gpt3-finnish": _BLOOM,
    "viking": _one(VIKING),
    "tekken": _one(TEKKEN, ignore_merges=True, add_bos=True),
    "chameleon": _one(CHAMELEON, add_bos=True),
    "gpt-4o": _GPT4O, "llama4": _GPT4O, "kanana2": _GPT4O, "talkie": _GPT4O, "minimax-m2": _GPT4O,
    "granite-embed-multi-97m": _one(GRANITE_EMB_MULTI, ignore_merges=True),
    "tiny_aya": _one(TINY_AYA), "cohere2moe": _one(TINY_AYA),
    "superbpe": _one(SUPERBPE),
    "bailingmoe": _BAILINGMOE, "bailingmoe2": _BAILINGMOE, "llada-moe": _BAILINGMOE,
    "seed-coder": _one(SEED_CODER),
    "ufakzeka": _one(UFAKZEKA),
    "laguna": _one(LAGUNA),
    "exaone-moe": _one(EXAONE_MOE),
}

"""Fill-in-the-middle: a code model writes what goes between the text before the cursor (the
prefix) and the text after it (the suffix).

Such a model was trained on prompts in its own order, marked by tokens of its vocabulary:
prefix-suffix-middle (``<|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>``), then it writes the middle
and ends with an end-of-text, its pad or its file separator. A model trained on repositories
(Qwen2.5-Coder) also reads other files of the project before the current one::

    <|repo_name|>myproject\\n
    <|file_sep|>a.py\\n(text of a.py)
    <|file_sep|>filename\\n
    <|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>

which is how llama-server's ``/infill`` lays it out, with its names for the project and the current
file. The tokens are those a GGUF file names (``tokenizer.ggml.fim_pre_token_id`` ...), else the
vocabulary's specials by the names the families give them (``FIM_NAMES``). Every part is
tokenized apart, with special names read as text: code that spells ``<|fim_prefix|>`` cannot
forge a marker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llama_chat.model.tokenizers.base import FIM_ROLES, Tokenizer

REQUIRED = FIM_ROLES[:3]  # fim_pre, fim_suf, fim_mid
# Each role's token by the names the families' vocabularies give it: Qwen2.5-Coder, StarCoder's
# (dashes in SantaCoder's), DeepSeek-Coder's, CodeLlama's (its pieces start with a word space).
FIM_NAMES: dict[str, tuple[str, ...]] = {
    "fim_pre": ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "<｜fim▁begin｜>", "▁<PRE>", "<PRE>"),
    "fim_suf": ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>", "<｜fim▁hole｜>", "▁<SUF>", "<SUF>"),
    "fim_mid": ("<|fim_middle|>", "<fim_middle>", "<fim-middle>", "<｜fim▁end｜>", "▁<MID>", "<MID>"),
    "fim_pad": ("<|fim_pad|>", "<fim_pad>", "<fim-pad>"),
    "fim_rep": ("<|repo_name|>", "<reponame>", "<|fim_repo|>"),
    "fim_sep": ("<|file_sep|>", "<filename>", "<file_sep>"),
}
# CodeLlama ends a middle with its own end-of-text piece, which is not its eos.
END_NAMES = ("▁<EOT>", "<EOT>")
# llama-server's names for the project and the current file, which the requests do not give, and
# for a file sent without one; the same prompt as its ``/infill`` on the same inputs.
REPO_NAME = "myproject"
CURRENT_FILE = "filename"
UNNAMED_FILE = "tmp"
# Between files, for a model without a file separator: a line of its own, not code.
SNIPPET_BREAK = "\n\n--- snippet ---\n\n"


class NoFimTokens(ValueError):
    """A model that cannot fill in the middle; the message names the tokens it lacks."""

    def __init__(self, missing: Sequence[str]) -> None:
        super().__init__(f"this model has no fill-in-the-middle tokens ({', '.join(missing)})")
        self.missing = tuple(missing)


@dataclass(frozen=True)
class FimTokens:
    """A model's fill-in-the-middle token ids; the last four may be missing (None)."""

    pre: int
    suf: int
    mid: int
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None
    eot: int | None = None  # an end of the middle that is not the tokenizer's own stop

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """What ends a middle besides the tokenizer's end of text: the pad, the next file, CodeLlama's end."""
        return tuple(i for i in (self.pad, self.sep, self.eot) if i is not None)

    @property
    def repository(self) -> bool:
        """The model reads other files of the project before the current one (``<|file_sep|>``)."""
        return self.sep is not None


@dataclass(frozen=True)
class RepoFile:
    """Another file of the project, given as context (llama-server's ``input_extra`` items)."""

    name: str
    text: str


@dataclass(frozen=True)
class Infill:
    """One fill-in-the-middle prompt's text. ``prompt``: text after the prefix where the middle
    starts (the cursor's line so far, as llama.vim sends it). ``files``: None for the plain
    prefix-suffix-middle form (a ``suffix`` on /v1/completions, Ollama's /api/generate); a tuple,
    empty or not, for the repository form where the model has it (llama-server's ``/infill``)."""

    prefix: str
    suffix: str
    prompt: str = ""
    files: tuple[RepoFile, ...] | None = None


def find_fim_tokens(tokenizer: Tokenizer) -> FimTokens:
    """The model's FIM tokens: the ids its GGUF file names (a tokenizer's ``fim_ids``) first, then
    its specials by name. ``NoFimTokens`` naming the roles that have neither."""
    named: Mapping[str, int] = getattr(tokenizer, "fim_ids", None) or {}
    specials = tokenizer.special_tokens
    found: dict[str, int | None] = {}
    for role in FIM_ROLES:
        found[role] = named.get(role)
        if found[role] is None:
            found[role] = next((specials[n] for n in FIM_NAMES[role] if n in specials), None)
    missing = [role for role in REQUIRED if found[role] is None]
    if missing:
        raise NoFimTokens(missing)
    eot = next((specials[n] for n in END_NAMES if n in specials), None)
    return FimTokens(found["fim_pre"], found["fim_suf"], found["fim_mid"], found["fim_pad"], found["fim_rep"],
                     found["fim_sep"], eot if eot not in tokenizer.stop_ids else None)


def fim_prompt(tokenizer: Tokenizer, tokens: FimTokens, infill: Infill, *, room: int | None = None) -> list[int]:
    """The prompt's ids in the model's order (see the module's text); a bos first where the
    tokenizer adds one to a prompt, after the other files as llama-server places it.

    ``room``: the most ids it may take. An editor sends the whole neighbourhood of the cursor, and
    what is nearest the cursor counts most: past ``room``, the other files go first (the oldest,
    the first ones, first), then the prefix's start, then the suffix's end."""
    def text(s: str) -> list[int]:
        return tokenizer.encode(s) if s else []

    files: list[int] = []
    if infill.files is not None:
        if tokens.rep is not None:
            files += [tokens.rep, *text(REPO_NAME + "\n")]
        for f in infill.files:
            files += [tokens.sep, *text(f.name + "\n")] if tokens.sep is not None else text(SNIPPET_BREAK)
            files += text(f.text)
        if tokens.sep is not None:
            files += [tokens.sep, *text(CURRENT_FILE + "\n")]
    bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", True) and tokenizer.bos_id is not None else []
    prefix, prompt, suffix = text(infill.prefix), text(infill.prompt), text(infill.suffix)
    if room is not None:
        over = len(files) + len(bos) + len(prefix) + len(prompt) + len(suffix) + 3 - room
        cut = min(max(over, 0), len(files))
        files, over = files[cut:], over - cut
        cut = min(max(over, 0), len(prefix))
        prefix, over = prefix[cut:], over - cut
        if over > 0:
            suffix = suffix[:max(len(suffix) - over, 0)]
    return [*files, *bos, tokens.pre, *prefix, *prompt, tokens.suf, *suffix, tokens.mid]


@dataclass(frozen=True)
class FimPrompt:
    """What a fill-in-the-middle job takes: its prompt's ids, and the ids that end it besides the
    tokenizer's (a ``Request``'s ``stop_ids``)."""

    ids: tuple[int, ...]
    stop_ids: tuple[int, ...]


def fill_in_the_middle(tokenizer: Tokenizer, infill: Infill, *, room: int | None = None) -> FimPrompt:
    """The prompt and stops of ``infill`` for this tokenizer's model (``NoFimTokens`` if it has no
    FIM tokens): what every route with a suffix calls."""
    tokens = find_fim_tokens(tokenizer)
    return FimPrompt(tuple(fim_prompt(tokenizer, tokens, infill, room=room)), tokens.stop_ids)


__all__ = ["FIM_NAMES", "FimPrompt", "FimTokens", "Infill", "NoFimTokens", "RepoFile", "fill_in_the_middle",
           "find_fim_tokens", "fim_prompt"]

"""The tokenizer interface every backend (SentencePiece, tiktoken, Hugging Face) implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

# A code model's fill-in-the-middle tokens by role, as a GGUF file names them
# (``tokenizer.ggml.{role}_token_id``): prefix, suffix, middle, pad, repository name, file separator.
# A tokenizer from such a file keeps the ids it names as ``fim_ids`` (``inference/fim.py``).
FIM_ROLES = ("fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids, plus what streaming needs: the exact bytes of any single token.

    ``token_bytes`` is what the streaming decoder consumes: ``<0xNN>`` byte pieces give that one
    byte, ``▁`` gives a space, tiktoken tokens give their byte string, control/special tokens give
    ``b""`` (they are never printed).
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every id that ends a generation (end of sequence, end of turn, end of message)."""
        ...

    @property
    def special_tokens(self) -> dict[str, int]:
        """Names of special/control tokens (``"<s>"``, ``"<|eot_id|>"``, ...) to their ids."""
        ...

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """A plain prompt's ids (no chat template) with the markers its tokenizer says a prompt gets.

    ``add_bos`` and ``add_eos`` come from the model's files (``tokenizer.ggml.add_bos_token``,
    ``add_bos_token`` in tokenizer_config.json): a GPT-2-style vocabulary that says no bos gets
    none, as transformers and llama.cpp tokenize it. A backend without the flags is a Llama's:
    bos, no eos. A chat template writes its own markers (``ChatFormat.encode_dialog``).
    """
    return tokenizer.encode(text, bos=getattr(tokenizer, "add_bos", True), eos=getattr(tokenizer, "add_eos", False))

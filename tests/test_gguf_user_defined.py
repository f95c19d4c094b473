"""User-defined pieces of a GGUF SentencePiece vocabulary are matched whole in the text.

Gemma's files list runs of two to thirty-one spaces, runs of newlines and some HTML tags as
user-defined tokens, spelled with plain spaces. llama.cpp splits the text on them before the
SentencePiece merges, longest first (Hugging Face's files list them as added tokens, matched the
same way), so indented code reads as one token per indentation. The reference here does that
split by hand and merges each stretch with a SentencePiece model that has no user-defined
pieces at all.
"""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import pytest
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_chat.model.formats.gguf import open_gguf
from llama_chat.model.tokenizers.gguf import UNKNOWN, CONTROL, BYTE, NORMAL, USER_DEFINED, load_gguf_tokenizer, \
    sentencepiece_proto

SPACE = "\u2581"
WORDS = ["re", "ret", "ur", "urn", "return", f"{SPACE}return", f"{SPACE}x", "if", f"{SPACE}if", "ta", "tab", "le"]
USER = [" " * n for n in range(2, 9)] + ["\n\n", "<table>"]
LETTERS = [SPACE, "r", "e", "t", "u", "n", "x", "i", "f", "a", "b", "l", "<", ">", "\n"]


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<bos>", "<eos>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    tokens += USER
    types += [USER_DEFINED] * len(USER)
    tokens += LETTERS + WORDS
    types += [NORMAL] * (len(LETTERS) + len(WORDS))
    scores = [0.0] * (len(tokens) - len(WORDS)) + [-float(i) for i in range(len(WORDS))]
    return tokens, scores, types


def write_file(path: Path) -> Path:
    tokens, scores, types = vocabulary()
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@functools.cache
def plain_sentencepiece() -> spm.SentencePieceProcessor:
    """The vocabulary's model with its user-defined pieces out of reach (their ids kept)."""
    tokens, scores, types = vocabulary()
    plain = [NORMAL if t == USER_DEFINED else t for t in types]
    # A user-defined piece as a normal one could still be merged into: a spelling no text holds
    # keeps its id out of the merges.
    spelled = [f"\x01{i}" if t == USER_DEFINED else p for i, (p, t) in enumerate(zip(tokens, types))]
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(sentencepiece_proto(spelled, scores, plain, ids={"unknown": 0, "bos": 1, "eos": 2},
                                                   add_dummy_prefix=False))
    return sp


def reference_ids(text: str) -> list[int]:
    """llama.cpp's order: split on the user-defined pieces (the longest first, leftmost), then
    merge each stretch between them with SentencePiece, whose model knows none of them."""
    tokens, _, _ = vocabulary()
    sp = plain_sentencepiece()
    ids: list[int] = []
    start = 0
    i = 0
    longest_first = sorted(USER, key=len, reverse=True)
    while i < len(text):
        found = next((u for u in longest_first if text.startswith(u, i)), None)
        if found is None:
            i += 1
            continue
        if start < i:
            ids += sp.encode(text[start:i])
        ids.append(tokens.index(found))
        i += len(found)
        start = i
    if start < len(text):
        ids += sp.encode(text[start:])
    return ids


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_gguf_tokenizer(open_gguf(write_file(tmp_path_factory.mktemp("vocab") / "user-defined.gguf")))


def test_an_indentation_is_one_token_and_the_word_after_it_has_no_space(tokenizer):
    tokens, _, _ = vocabulary()
    ids = tokenizer.encode("if x\n    return x")
    assert [tokens[i] for i in ids] == ["if", f"{SPACE}x", "\n", "    ", "return", f"{SPACE}x"]
    assert tokenizer.decode(ids) == "if x\n    return x"


def test_the_longest_piece_is_taken_and_the_rest_of_a_run_after_it(tokenizer):
    tokens, _, _ = vocabulary()
    assert [tokens[i] for i in tokenizer.encode("x" + " " * 11 + "x")] == ["x", " " * 8, "   ", "x"]
    assert [tokens[i] for i in tokenizer.encode("a<table>b\n\n\nx")] == ["a", "<table>", "b", "\n\n", "\n", "x"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([" ", "  ", "\n", "x", "re", "turn", "if", "<table>", "tab", "é", "\t"]),
                max_size=20).map("".join))
def test_every_text_gives_the_split_then_merged_ids_and_reads_back(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == reference_ids(text)
    assert tokenizer.decode(ids) == text

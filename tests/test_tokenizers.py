"""Tokenizer backends against their references, token bytes, special ids and file detection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenizer_builders as tb
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.tokenizers.base import Tokenizer
from llama_chat.model.tokenizers.hf import HFTokenizer
from llama_chat.model.tokenizers.llama2c import Llama2cTokenizer
from llama_chat.model.tokenizers.loading import load_tokenizer
from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer
from llama_chat.model.tokenizers.tiktoken import (
    LLAMA3_PATTERN,
    MAX_RUN_CHARS,
    TiktokenTokenizer,
    read_ranks,
    split_for_encoding,
)

TEXTS = tb.CORPUS + [
    "",
    " ",
    "a",
    "\n\n",
    "x" * 40,
    "🇫🇷🇯🇵",  # two flags: four regional indicators
    "👨‍👩‍👧‍👦",  # ZWJ family
    "👍🏽👍🏿",  # skin tones
    "1 + 1 = 2; 3.14159",
    "tab\tand\r\nCRLF",
]


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory) -> Path:
    path = tb.train_llama_sentencepiece(tmp_path_factory.mktemp("sp"))
    return path.parent


@pytest.fixture(scope="module")
def tiktoken_dir(tmp_path_factory) -> Path:
    return tb.write_tiktoken_file(tmp_path_factory.mktemp("tiktoken")).parent


@pytest.fixture(scope="module")
def bytelevel_dir(tmp_path_factory) -> Path:
    return tb.write_bytelevel_tokenizer_json(tmp_path_factory.mktemp("bytelevel")).parent


@pytest.fixture(scope="module")
def metaspace_dir(tmp_path_factory, sp_dir) -> Path:
    return tb.write_metaspace_tokenizer_json(tmp_path_factory.mktemp("metaspace"), sp_dir / "tokenizer.model").parent


@pytest.fixture(scope="module")
def llama2c_dir(tmp_path_factory, sp_dir) -> Path:
    out = tmp_path_factory.mktemp("llama2c")
    tb.write_llama2c_tokenizer(out / "tokenizer.bin", sp_dir / "tokenizer.model")
    return out


BACKEND_DIRS = ["sp_dir", "tiktoken_dir", "bytelevel_dir", "metaspace_dir", "llama2c_dir"]


@pytest.fixture(params=BACKEND_DIRS)
def any_tokenizer(request) -> Tokenizer:
    return load_tokenizer(request.getfixturevalue(request.param))


# -- SentencePiece -----------------------------------------------------------------------------


def test_sentencepiece_matches_transformers_sentencepiece_tokenizer(sp_dir):
    """transformers 5 dropped the SentencePiece-based ``LlamaTokenizer``; its slow path lives on as
    ``SentencePieceBackend``. ``legacy=True`` makes it call ``sp.encode`` on the whole text, which
    is what Meta's Llama 2 code does and what we do (``legacy=False`` only changes text right
    after a special token and needs protobuf). None of these texts contain special-token names,
    which the transformers class would split out and we keep as plain text."""
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    ref = SentencePieceBackend(vocab_file=str(sp_dir / "tokenizer.model"), legacy=True,
                               bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    ours = SentencePieceTokenizer(sp_dir / "tokenizer.model")
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        ids = ours.encode(text, bos=True, eos=True)
        assert ids[0] == ours.bos_id == 1 and ids[-1] == ours.eos_id == 2
        assert ours.decode(ids) == text


def test_sentencepiece_matches_transformers_llama_tokenizer(sp_dir, metaspace_dir):
    """``transformers.LlamaTokenizer`` itself (tokenizers-based in transformers 5, ``legacy=False``)
    on the same vocabulary in ``tokenizer.json`` form. It differs only on text that already starts
    with a space: non-legacy Metaspace then adds no ``▁`` of its own, SentencePiece always does."""
    from transformers import LlamaTokenizer

    ref = LlamaTokenizer.from_pretrained(str(metaspace_dir))
    ours = SentencePieceTokenizer(sp_dir / "tokenizer.model")
    for text in TEXTS:
        if not text.startswith(" "):
            assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
            assert ours.encode(text, bos=True) == ref.encode(text), text


def test_sentencepiece_token_bytes_rules(sp_dir):
    tok = SentencePieceTokenizer(sp_dir / "tokenizer.model")
    sp = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    assert tok.token_bytes(sp.piece_to_id("<0x0A>")) == b"\n"
    assert tok.token_bytes(sp.piece_to_id("<0xF0>")) == b"\xf0"
    assert tok.token_bytes(sp.piece_to_id("\u2581")) == b" "
    assert tok.token_bytes(sp.piece_to_id("\u2581the")) == b" the"
    assert tok.token_bytes(1) == tok.token_bytes(2) == b""
    assert tok.token_bytes(0) == " \u2047 ".encode()  # as sp.decode shows the unknown piece
    assert tok.special_tokens == {"<unk>": 0, "<s>": 1, "</s>": 2}
    assert tok.stop_ids == {2}
    assert tok.strips_leading_space
    assert tok.encode("</s>") != [2]  # typed text never becomes a control token


def test_sentencepiece_user_defined_end_of_turn_is_a_stop(tmp_path):
    path = tb.train_llama_sentencepiece(tmp_path, user_defined=("<|im_end|>", "[INST]", "<b>x"))
    tok = SentencePieceTokenizer(path)
    im_end = tok.special_tokens["<|im_end|>"]
    assert tok.stop_ids == {tok.eos_id, im_end}
    assert tok.token_bytes(im_end) == tok.token_bytes(tok.special_tokens["[INST]"]) == b""
    assert "<b>x" not in tok.special_tokens  # a user-defined piece that is text stays text
    assert tok.encode_allowing_special("a<|im_end|>") == [*tok.encode("a"), im_end]


# -- Hugging Face tokenizers -------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["bytelevel_dir", "metaspace_dir"])
def test_hf_backend_matches_pretrained_tokenizer_fast(fixture, request):
    from transformers import PreTrainedTokenizerFast

    model_dir = request.getfixturevalue(fixture)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), bos_token="<s>",
                                  eos_token="</s>")
    ours = load_tokenizer(model_dir)
    assert isinstance(ours, HFTokenizer) and ours.add_bos
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert ours.encode(text, bos=True) == ref.encode(text), text
        ids = ours.encode(text, bos=True)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_hf_metaspace_equals_sentencepiece_ids(metaspace_dir, sp_dir):
    """The HF form of a SentencePiece vocabulary encodes like SentencePiece itself (texts that do
    not start with a space: Metaspace prepends ``▁`` only when there is none)."""
    hf, sp = load_tokenizer(metaspace_dir), SentencePieceTokenizer(sp_dir / "tokenizer.model")
    for text in TEXTS:
        if not text.startswith(" "):
            assert hf.encode(text) == sp.encode(text), text
    # All but <unk>: a special added token to Hugging Face (b""), " ⁇ " to SentencePiece.
    assert [hf.token_bytes(i) for i in range(1, hf.vocab_size)] == [sp.token_bytes(i) for i in range(1, sp.vocab_size)]


def test_byte_level_table_is_gpt2s():
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from llama_chat.model.tokenizers.hf import byte_level_decoder

    assert byte_level_decoder() == {char: byte for byte, char in bytes_to_unicode().items()}
    assert set(byte_level_decoder()) == set(ByteLevel.alphabet())


def test_hf_specials_bytes_and_stops(bytelevel_dir):
    tok = load_tokenizer(bytelevel_dir)
    eot = tok.special_tokens["<|eot_id|>"]
    assert tok.bos_id == tok.special_tokens["<s>"] and tok.eos_id == tok.special_tokens["</s>"]
    assert tok.stop_ids == {tok.eos_id, eot}
    assert tok.token_bytes(eot) == tok.token_bytes(tok.bos_id) == b""
    assert eot not in tok.encode("<|eot_id|>")  # plain text stays plain
    assert tok.encode_allowing_special("hi<|eot_id|>") == [*tok.encode("hi"), eot]
    assert not tok.strips_leading_space


# -- tiktoken (Llama 3) ------------------------------------------------------------------------


def test_tiktoken_special_ids_follow_llama31(tiktoken_dir):
    tok = load_tokenizer(tiktoken_dir)
    assert isinstance(tok, TiktokenTokenizer)
    n_base = len(read_ranks(tiktoken_dir / "tokenizer.model"))
    assert n_base == 256 + 200
    specials = tok.special_tokens
    expected = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<|reserved_special_token_0|>": 2,
                "<|reserved_special_token_1|>": 3, "<|finetune_right_pad_id|>": 4, "<|step_id|>": 5,
                "<|start_header_id|>": 6, "<|end_header_id|>": 7, "<|eom_id|>": 8, "<|eot_id|>": 9,
                "<|python_tag|>": 10, "<|reserved_special_token_2|>": 11, "<|reserved_special_token_246|>": 255}
    assert {name: specials[name] - n_base for name in expected} == expected
    assert len(specials) == 256 and tok.vocab_size == n_base + 256
    assert tok.bos_id == n_base and tok.eos_id == n_base + 1
    assert tok.stop_ids == {n_base + 1, n_base + 8, n_base + 9}
    assert all(tok.token_bytes(i) == b"" for i in specials.values())


def test_tiktoken_matches_plain_tiktoken_and_round_trips(tiktoken_dir):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    path = tiktoken_dir / "tokenizer.model"
    ref = tiktoken.Encoding("ref", pat_str=LLAMA3_PATTERN, mergeable_ranks=load_tiktoken_bpe(str(path)),
                            special_tokens={})
    tok = load_tokenizer(tiktoken_dir)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text, bos=True, eos=True)) == text
    eot = tok.special_tokens["<|eot_id|>"]
    assert eot not in tok.encode("<|eot_id|>")
    assert tok.encode_allowing_special("a<|eot_id|>") == [*tok.encode("a"), eot]


def test_tiktoken_long_runs_are_cut_where_meta_cuts():
    text = "ab " + "x" * (2 * MAX_RUN_CHARS + 5) + " " * (MAX_RUN_CHARS + 1) + "end"
    pieces = list(split_for_encoding(text))
    assert "".join(pieces) == text
    run_start = 3
    assert [len(p) for p in pieces] == [run_start + MAX_RUN_CHARS, MAX_RUN_CHARS,
                                        5 + MAX_RUN_CHARS, 1 + 3]


def test_tiktoken_encodes_huge_runs(tiktoken_dir):
    tok = load_tokenizer(tiktoken_dir)
    for text in (" " * 60_000, "\U0001F600" * 30_000 + "\n" * 30_000):
        ids = tok.encode(text)
        assert tok.decode(ids) == text


# -- llama2.c ----------------------------------------------------------------------------------


def test_llama2c_encodes_like_runc_and_sentencepiece(llama2c_dir, sp_dir):
    tok = load_tokenizer(llama2c_dir)
    sp = SentencePieceTokenizer(sp_dir / "tokenizer.model")
    assert isinstance(tok, Llama2cTokenizer) and tok.vocab_size == sp.vocab_size
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == tb.runc_encode(tok._pieces, tok._scores, text), text
        if not text.startswith(" "):  # sp keeps a leading space run whole; run.c splits it off
            assert ids == sp.encode(text), text
        with_bos = tok.encode(text, bos=True, eos=True)
        assert with_bos[0] == 1 and with_bos[-1] == 2
        assert tok.decode(with_bos) == text  # run.c drops the space right after bos


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab c\n東é") + ["😀", "\u200d", "🏽"]), max_size=30))
def test_llama2c_heap_merge_equals_quadratic_rescan(llama2c_tok, text):
    assert llama2c_tok.encode(text) == tb.runc_encode(llama2c_tok._pieces, llama2c_tok._scores, text)


@pytest.fixture(scope="module")
def llama2c_tok(llama2c_dir) -> Llama2cTokenizer:
    return load_tokenizer(llama2c_dir)


# -- every backend -----------------------------------------------------------------------------


def test_token_bytes_concatenate_to_the_text(any_tokenizer):
    """The streaming contract: the bytes of an encoding are the text's UTF-8 (SentencePiece-style
    tokenizers: plus the one dummy-prefix space that ``decode`` drops)."""
    tok = any_tokenizer
    assert isinstance(tok, Tokenizer)
    for text in TEXTS:
        if not text:
            continue
        ids = tok.encode(text, bos=True, eos=True)
        joined = b"".join(tok.token_bytes(i) for i in ids)
        assert joined == _dummy_prefix(tok, text) + text.encode(), text
        if not (isinstance(tok, HFTokenizer) and text.startswith(" ")):
            assert tok.decode(ids) == text


def _dummy_prefix(tok: Tokenizer, text: str) -> bytes:
    if isinstance(tok, (SentencePieceTokenizer, Llama2cTokenizer)):
        return b" "  # always prepended
    if tok.strips_leading_space:  # Hugging Face Metaspace: prepended unless there is one already
        return b"" if text.startswith(" ") else b" "
    return b""


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=25))
def test_token_bytes_property_sentencepiece_and_tiktoken(sp_and_tiktoken, text):
    sp, tt = sp_and_tiktoken
    assert b"".join(sp.token_bytes(i) for i in sp.encode(text)) == b" " + text.encode()
    assert b"".join(tt.token_bytes(i) for i in tt.encode(text)) == text.encode()


@pytest.fixture(scope="module")
def sp_and_tiktoken(sp_dir, tiktoken_dir):
    return load_tokenizer(sp_dir), load_tokenizer(tiktoken_dir)


# -- detection and errors ----------------------------------------------------------------------


def test_detection_prefers_tokenizer_json_with_config(tmp_path, sp_dir, bytelevel_dir):
    both = tmp_path / "both"
    both.mkdir()
    for src in (sp_dir / "tokenizer.model", bytelevel_dir / "tokenizer.json", bytelevel_dir / "tokenizer_config.json"):
        (both / src.name).write_bytes(src.read_bytes())
    assert isinstance(load_tokenizer(both), HFTokenizer)
    (both / "tokenizer_config.json").unlink()
    assert isinstance(load_tokenizer(both), SentencePieceTokenizer)
    assert isinstance(load_tokenizer(tmp_path, tokenizer_file=bytelevel_dir / "tokenizer.json"), HFTokenizer)


def test_generation_config_adds_stop_ids(tmp_path, sp_dir):
    (tmp_path / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_tokenizer(tmp_path).stop_ids == {2, 7}


def test_missing_tokenizer_names_directory_and_files(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        load_tokenizer(tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message and "tokenizer.model" in message and "tokenizer.json" in message
    assert "\n" not in message


@pytest.mark.parametrize("name, content", [
    ("tokenizer.model", b"\x0a\x20\x0a\x05<unk>" + b"\xff" * 40),  # protobuf-looking, then garbage
    ("tokenizer.model", b"IQ== 0\nnot base64!! x\n"),  # tiktoken with a bad line
    ("tokenizer.model", b"hello, I am not a tokenizer"),
    ("tokenizer.bin", b"\x10\x00\x00\x00\x00\x00\x80\x3f\x05\x00"),  # truncated
    ("tokenizer.json", b"{not json"),
])
def test_corrupt_files_raise_one_line_model_load_error(tmp_path, name, content):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ModelLoadError) as err:
        load_tokenizer(tmp_path)
    assert str(tmp_path / name) in str(err.value) and "\n" not in str(err.value)

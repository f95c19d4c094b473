"""Chat formats produce the documented token sequences; chat_format_for picks them by its rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tokenizer_builders as tb
from llama_chat.model.chat_format import (
    HFTemplateChatFormat,
    Llama2ChatFormat,
    Llama3ChatFormat,
    Message,
    chat_format_for,
)
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.tokenizers.loading import load_tokenizer

SYSTEM = Message("system", "Be brief.")
USER1 = Message("user", "Hi there!")
ASSISTANT1 = Message("assistant", "Hello. How can I help?")
USER2 = Message("user", "Tell me a joke about a fox 🦊.")

# Llama 2's layout as a Jinja template, the way Hugging Face checkpoints carry it.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = none %}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{% if loop.first and system %}{% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'].strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|eot_id|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory) -> Path:
    return tb.train_llama_sentencepiece(tmp_path_factory.mktemp("sp")).parent


@pytest.fixture(scope="module")
def tiktoken_dir(tmp_path_factory) -> Path:
    return tb.write_tiktoken_file(tmp_path_factory.mktemp("tiktoken")).parent


# -- Llama 2 -----------------------------------------------------------------------------------


def test_llama2_single_turn(sp_dir):
    tok = load_tokenizer(sp_dir)
    ids = Llama2ChatFormat(tok).encode_dialog([USER1])
    assert ids == [1, *tok.encode("[INST] Hi there! [/INST]")]
    assert tok.decode(ids) == "[INST] Hi there! [/INST]"


def test_llama2_with_system_prompt(sp_dir):
    tok = load_tokenizer(sp_dir)
    ids = Llama2ChatFormat(tok).encode_dialog([SYSTEM, USER1])
    assert ids == [1, *tok.encode("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there! [/INST]")]


def test_llama2_multi_turn_puts_bos_and_eos_ids_around_each_turn(sp_dir):
    tok = load_tokenizer(sp_dir)
    ids = Llama2ChatFormat(tok).encode_dialog([SYSTEM, USER1, ASSISTANT1, USER2])
    turn1 = [1, *tok.encode("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there! [/INST] Hello. How can I help? "), 2]
    turn2 = [1, *tok.encode("[INST] Tell me a joke about a fox 🦊. [/INST]")]
    assert ids == turn1 + turn2
    assert ids.count(1) == 2 and ids.count(2) == 1  # the ids, not the spelled-out "<s>"


def test_llama2_rejects_out_of_order_roles(sp_dir):
    fmt = Llama2ChatFormat(load_tokenizer(sp_dir))
    with pytest.raises(ValueError, match="expected role 'user'"):
        fmt.encode_dialog([ASSISTANT1])


# -- Llama 3 -----------------------------------------------------------------------------------


def test_llama3_dialog_and_generation_prompt(tiktoken_dir):
    tok = load_tokenizer(tiktoken_dir)
    s = tok.special_tokens
    names = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    bot, start, end, eot = (s[n] for n in names)
    nl2 = tok.encode("\n\n")

    def header(role):
        return [start, *tok.encode(role), end, *nl2]

    fmt = Llama3ChatFormat(tok)
    ids = fmt.encode_dialog([SYSTEM, USER1])
    assert ids == [bot, *header("system"), *tok.encode("Be brief."), eot,
                   *header("user"), *tok.encode("Hi there!"), eot, *header("assistant")]
    without_prompt = fmt.encode_dialog([USER1], add_generation_prompt=False)
    assert without_prompt == [bot, *header("user"), *tok.encode("Hi there!"), eot]
    # The same ids as rendering the documented text and mapping special names to ids.
    text = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert fmt.encode_dialog([USER1]) == tok.encode_allowing_special(text)


def test_llama3_needs_header_tokens(sp_dir):
    with pytest.raises(ModelLoadError, match="start_header_id"):
        Llama3ChatFormat(load_tokenizer(sp_dir))


# -- Hugging Face templates --------------------------------------------------------------------


def _hf_reference_ids(model_dir: Path, messages, add_generation_prompt=True) -> list[int]:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(model_dir))
    out = ref.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                  tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_hf_template_llama2_style_matches_transformers(tmp_path, sp_dir):
    model_dir = tmp_path / "hf"
    tb.write_metaspace_tokenizer_json(model_dir, sp_dir / "tokenizer.model", chat_template=LLAMA2_TEMPLATE)
    tok = load_tokenizer(model_dir)
    fmt = chat_format_for(model_dir, tok)
    assert isinstance(fmt, HFTemplateChatFormat)
    dialog = [SYSTEM, USER1, ASSISTANT1, USER2]
    ids = fmt.encode_dialog(dialog)
    assert ids == _hf_reference_ids(model_dir, dialog)
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id  # the template's bos, not doubled
    assert ids.count(tok.bos_id) == 2 and ids.count(tok.eos_id) == 1


def test_hf_template_chatml_style_pins_ids_and_adds_bos(tmp_path):
    model_dir = tmp_path / "hf"
    tb.write_bytelevel_tokenizer_json(model_dir, chat_template=CHATML_TEMPLATE)
    tok = load_tokenizer(model_dir)
    fmt = chat_format_for(model_dir, tok)
    eot = tok.special_tokens["<|eot_id|>"]
    ids = fmt.encode_dialog([USER1])
    # "<|im_start|>" is not a special token of this vocabulary: it stays text.
    expected_text = [*tok.encode("<|im_start|>user\nHi there!"), eot, *tok.encode("\n<|im_start|>assistant\n")]
    assert ids == [tok.bos_id, *expected_text]  # the template has no bos; the tokenizer adds one
    assert ids[1:] == _hf_reference_ids(model_dir, [USER1])


def test_hf_template_raise_exception_becomes_value_error(tmp_path, sp_dir):
    model_dir = tmp_path / "hf"
    tb.write_metaspace_tokenizer_json(model_dir, sp_dir / "tokenizer.model", chat_template=LLAMA2_TEMPLATE)
    fmt = chat_format_for(model_dir, load_tokenizer(model_dir))
    with pytest.raises(ValueError, match="roles must alternate"):
        fmt.encode_dialog([USER1, USER2])


# -- chat_format_for ---------------------------------------------------------------------------


def _copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_auto_rule(tmp_path, sp_dir, tiktoken_dir):
    plain_sp = _copy_dir(sp_dir, tmp_path / "sp")
    assert chat_format_for(plain_sp, load_tokenizer(plain_sp)) is None  # base model: completion

    (plain_sp / "params.json").write_text(json.dumps({"dim": 64, "chat_format": "llama2"}))
    assert isinstance(chat_format_for(plain_sp, load_tokenizer(plain_sp)), Llama2ChatFormat)

    assert isinstance(chat_format_for(tiktoken_dir, load_tokenizer(tiktoken_dir)), Llama3ChatFormat)

    hinted = _copy_dir(tiktoken_dir, tmp_path / "hinted")
    (hinted / "chat_format.json").write_text(json.dumps({"chat_format": "none"}))
    assert chat_format_for(hinted, load_tokenizer(hinted)) is None


def test_explicit_names_and_errors(tmp_path, sp_dir):
    tok = load_tokenizer(sp_dir)
    assert isinstance(chat_format_for(sp_dir, tok, "llama2"), Llama2ChatFormat)
    assert chat_format_for(sp_dir, tok, "none") is None
    with pytest.raises(ValueError, match="unknown chat format"):
        chat_format_for(sp_dir, tok, "chatml")
    with pytest.raises(ModelLoadError, match="chat_template"):
        chat_format_for(sp_dir, tok, "hf")
    bad = _copy_dir(sp_dir, tmp_path / "bad")
    (bad / "params.json").write_text(json.dumps({"chat_format": "vicuna"}))
    with pytest.raises(ModelLoadError, match="params.json: chat_format"):
        chat_format_for(bad, tok)


def test_hf_template_over_sentencepiece_equals_llama2_format(tmp_path, sp_dir):
    """A SentencePiece checkpoint whose tokenizer_config.json carries Llama 2's template: rendering
    and splitting on special names gives exactly Meta's per-turn ids."""
    model_dir = _copy_dir(sp_dir, tmp_path / "sp_template")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": LLAMA2_TEMPLATE}))
    tok = load_tokenizer(model_dir)  # no tokenizer.json: still the SentencePiece backend
    fmt = chat_format_for(model_dir, tok)
    dialog = [SYSTEM, USER1, ASSISTANT1, USER2]
    assert isinstance(fmt, HFTemplateChatFormat)
    assert fmt.encode_dialog(dialog) == Llama2ChatFormat(tok).encode_dialog(dialog)

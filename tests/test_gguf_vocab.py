"""Byte-level BPE vocabularies in GGUF files under every pre-tokenizer name llama.cpp reads.

For each name a BPE model is trained here with the ``tokenizers`` library, cutting text with that
name's expressions, written as llama.cpp's converter writes a vocabulary (``gguf.GGUFWriter``:
tokens, token types, merges, special ids), read back, and compared with the trained tokenizer
itself on texts it did not see. Separately, each kind of split is checked on a probe text against
pieces worked out by hand, so that a wrong expression in the table cannot pass unnoticed.
"""

from __future__ import annotations

import json
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from builders_gguf import DEFAULT_ROPE, T, hf_config, hf_llama, hf_with_file_weights, write_gguf, write_vocab_gguf  # noqa: E402,E501
from cli_support import run_cli  # noqa: E402
from tokenizer_builders import CORPUS  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from llama_chat.model.errors import ModelLoadError  # noqa: E402
from llama_chat.model.formats.gguf import open_gguf  # noqa: E402
from llama_chat.model.tokenizers.gguf import load_gguf_tokenizer  # noqa: E402
from llama_chat.model.tokenizers.gguf_pre import PRE_TOKENIZERS, PreTokenizer  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<tool>"
CODE = [
    "def area(r):\n    return 3.14159 * r ** 2  # circle\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i);\n}\n",
    "if x >= 100 and y != 'done':\n        pass\r\n",
]
TEXTS = [
    "Hello world! I'VE got 12345 apples, don't you? We'll see; they'd say it's 3.14159.",
    "def f(x):\n    return x ** 2  # square\n\tif x >= 10 and y != 'a':\n\t\tpass\n",
    "Spaces:   three, then\ttab,\r\nCRLF, then trailing   ",
    "\n\n\n   \n",
    "日本語のテキスト、東京は大きい。北京欢迎你！한국어 문장입니다.",
    "Emoji 🤖🚀✨ family 👨‍👩‍👧‍👦 flag 🇨🇦 skin 👍🏽 keycap 1️⃣",
    "Accents: café, naïve, Ærøskøbing, ÉCOLE, e\u0301 combining, ſ long s, Kelvin \u212a.",
    "Numbers 1,000,000 and 0.5 and 2024-01-31 and ١٢٣ and ½ and 1234567890123",
    "<sentinel:12> IMGIMGABCZ and ----====.... !!!??? ``` \"quoted\" [x] {y}",
    "Привет, как дела? Γειά σου κόσμε. ÀÉÎÕÜ àéîõü",
    f"a user-defined {USER_DEFINED} token in plain text",
    "",
    " ",
    "x" * 200,
]


def _splitter(pre: PreTokenizer) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(s), behavior="isolated") for s in pre.splits])


@lru_cache(maxsize=None)
def _trained(pre: PreTokenizer) -> Tokenizer:
    """A byte-level BPE learnt on the corpus, cutting text with ``pre``'s expressions."""
    tok = Tokenizer(models.BPE(ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([_splitter(pre), pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                          use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((CORPUS + CODE) * 4, trainer=trainer)
    tok.add_tokens([AddedToken(USER_DEFINED, special=False, normalized=False)])
    return tok


def _groups() -> dict[PreTokenizer, list[str]]:
    groups: dict[PreTokenizer, list[str]] = defaultdict(list)
    for name, pre in PRE_TOKENIZERS.items():
        groups[pre].append(name)
    return groups


def _load(path: Path):
    return load_gguf_tokenizer(open_gguf(path))


@pytest.mark.parametrize("names", list(_groups().values()), ids=lambda names: "+".join(names[:3]))
def test_each_name_gives_the_ids_of_a_tokenizer_trained_with_its_split(tmp_path, names):
    pre = PRE_TOKENIZERS[names[0]]
    reference = _trained(pre)
    for name in names:
        tok = _load(write_vocab_gguf(tmp_path / f"{name}.gguf", reference, name, bos="<|im_start|>",
                                     eos="<|im_end|>"))
        for text in TEXTS + CORPUS:
            want = reference.encode(text, add_special_tokens=False).ids
            assert tok.encode(text) == want, (name, text)
            assert b"".join(tok.token_bytes(i) for i in want) == text.encode(), (name, text)
        rendered = f"<|im_start|>user\nhi {USER_DEFINED}<|im_end|>\n<|im_start|>assistant\n"
        assert tok.encode_allowing_special(rendered) == reference.encode(rendered, add_special_tokens=False).ids
        # typed by a user, the control names are text; the user-defined token is always itself
        typed = tok.encode(rendered)
        assert reference.token_to_id("<|im_start|>") not in typed
        assert reference.token_to_id(USER_DEFINED) in typed


# How each kind of split cuts one probe, worked out by hand from its expression: digits (alone,
# in threes, whole), contractions in capitals, an accented capital word, punctuation, a newline
# run and spaces before a word.
PROBE = "I'VE 12345 ÉCOLE!!\n\n  x"
SPLITS_BY_HAND = {
    "gpt-2": ["I", "'", "VE", " 12345", " ÉCOLE", "!!", "\n\n ", " x"],
    "llama-bpe": ["I", "'VE", " ", "123", "45", " ÉCOLE", "!!\n\n", " ", " x"],
    "smollm": ["I", "'", "VE", " ", "1", "2", "3", "4", "5", " ÉCOLE", "!!", "\n\n ", " x"],
    "qwen2": ["I", "'VE", " ", "1", "2", "3", "4", "5", " ÉCOLE", "!!\n\n", " ", " x"],
    "default": ["I", "'", "VE", " ", "123", "45", " ÉCOLE", "!!", "\n\n ", " x"],
    "falcon": ["I", "'", "VE", " ", "123", "45", " ÉCOLE", "!!", "\n\n ", " x"],
    # DeepSeek's punctuation class [!-/:-~] holds the ASCII letters too: words with other letters break
    "deepseek-llm": ["I", "'", "VE", " ", "12345", " É", "COLE", "!!", "\n", "\n", " ", " x"],
    "deepseek-coder": ["I", "'", "VE", " ", "1", "2", "3", "4", "5", " ÉCOLE", "!!", "\n", "\n", " ", " x"],
    "deepseek-v3": ["I", "'VE", " ", "123", "45", " ÉCOLE", "!!\n\n", " ", " x"],
    "tekken": ["I", "'VE", " ", "1", "2", "3", "4", "5", " ÉCOLE", "!!\n\n", " ", " x"],
    "gpt-4o": ["I'VE", " ", "123", "45", " ÉCOLE", "!!\n\n", " ", " x"],
    "bloom": ["I'VE", " 12345", " ÉCOLE", "!!\n\n ", " x"],
    "bailingmoe": ["I", "'VE", " ", "1", "2", "3", "4", "5", " ÉCOLE", "!!\n\n", " ", " x"],
}


@pytest.mark.parametrize("name", SPLITS_BY_HAND)
def test_a_split_cuts_the_probe_as_worked_out_by_hand(name):
    pieces = [piece for piece, _ in _splitter(PRE_TOKENIZERS[name]).pre_tokenize_str(PROBE)]
    assert pieces == SPLITS_BY_HAND[name]


def test_every_name_the_converter_writes_for_these_families_is_read():
    """The names ``convert_hf_to_gguf.py`` writes for models llama.cpp runs as ``llama`` (and
    the common ones beside them); llama.cpp's other names are in the table too."""
    for name in ("llama-bpe", "smollm", "smaug-bpe", "deepseek-llm", "deepseek-coder", "falcon3", "tekken",
                 "pixtral", "gpt-2", "starcoder", "qwen2", "command-r", "dbrx", "mpt", "falcon", "chatglm-bpe",
                 "gpt-4o", "llama4", "minerva-7b", "exaone", "refact", "megrez", "stablelm2", "olmo"):
        assert name in PRE_TOKENIZERS, name


# -- what the file says besides the tokens ----------------------------------------------------------


def test_a_plain_prompt_gets_bos_and_eos_only_where_the_file_says(tmp_path):
    """``tokenizer.ggml.add_bos_token = false`` on a GPT-2-style vocabulary: a prompt without a chat
    template (``--template none``, ``/v1/completions``) is the text's ids alone, as transformers and
    llama.cpp tokenize it; true puts bos first; ``add_eos_token`` puts eos last."""
    from llama_chat.cmd.prompt import prompt_ids

    reference = _trained(PRE_TOKENIZERS["qwen2"])
    text = "The capital of France is"
    bare = reference.encode(text, add_special_tokens=False).ids
    bos, eos = reference.token_to_id("<|im_start|>"), reference.token_to_id("<|endoftext|>")
    cases = {(False, None): bare, (True, None): [bos, *bare], (False, True): [*bare, eos]}
    for (add_bos, add_eos), expected in cases.items():
        path = write_vocab_gguf(tmp_path / f"{add_bos}{add_eos}.gguf", reference, "qwen2", bos="<|im_start|>",
                                eos="<|endoftext|>", add_bos=add_bos, add_eos=add_eos)
        tok = _load(path)
        assert prompt_ids(text, system=None, tokenizer=tok, chat_format=None, template="none") == expected


def test_special_ids_flags_and_token_types_come_from_the_file(tmp_path):
    reference = _trained(PRE_TOKENIZERS["smollm"])
    ids = {t: reference.token_to_id(t) for t in SPECIALS + [USER_DEFINED]}
    # smollm: llama.cpp adds no bos unless the file says so; eos and eot both end a generation
    path = write_vocab_gguf(tmp_path / "s.gguf", reference, "smollm", bos="<|im_start|>", eos="<|endoftext|>",
                            unk="<|endoftext|>", pad="<|endoftext|>")
    tok = _load(path)
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (ids["<|im_start|>"], ids["<|endoftext|>"], False)
    assert {ids["<|endoftext|>"], ids["<|im_end|>"]} <= tok.stop_ids
    assert tok.special_tokens == {t: ids[t] for t in SPECIALS}  # control tokens only
    assert tok.token_bytes(ids["<|im_end|>"]) == b"" and tok.token_bytes(ids[USER_DEFINED]) == USER_DEFINED.encode()
    assert tok.encode("hi", bos=True)[0] == ids["<|im_start|>"]
    # the file's flag wins over the name's default, both ways
    assert _load(write_vocab_gguf(tmp_path / "b.gguf", reference, "smollm", bos="<|im_start|>", add_bos=True)).add_bos
    assert _load(write_vocab_gguf(tmp_path / "l.gguf", reference, "llama-bpe", bos="<|im_start|>")).add_bos
    assert not _load(write_vocab_gguf(tmp_path / "n.gguf", reference, "llama-bpe", bos="<|im_start|>",
                                      add_bos=False)).add_bos
    # an end-of-turn id named in the file ends a generation
    writer_path = tmp_path / "eot.gguf"
    writer = gguf.GGUFWriter(str(writer_path), "llama")
    from builders_gguf import add_bpe_vocab

    add_bpe_vocab(writer, reference, "smollm", eos="<|endoftext|>")
    writer.add_eot_token_id(ids[USER_DEFINED])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert ids[USER_DEFINED] in _load(writer_path).stop_ids
    # padding to the embedding's rows is left out
    padded = tmp_path / "pad.gguf"
    writer = gguf.GGUFWriter(str(padded), "llama")
    add_bpe_vocab(writer, reference, "smollm", n_vocab=reference.get_vocab_size() + 9)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert _load(padded).vocab_size == reference.get_vocab_size()


def test_unknown_pre_tokenizers_are_named(tmp_path):
    reference = _trained(PRE_TOKENIZERS["gpt-2"])
    for pre in ("not-a-split", "kimi-k2", "gemma4"):
        path = write_vocab_gguf(tmp_path / "u.gguf", reference, pre)
        with pytest.raises(ModelLoadError) as info:
            _load(path)
        assert str(info.value) == (f"u.gguf: tokenizer.ggml.pre '{pre}' is not supported (not one of the "
                                   f"{len(PRE_TOKENIZERS)} byte-level splits llama.cpp names; see docs/tokenizers.md)")


# -- through the command -----------------------------------------------------------------------------

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_smollm_style_file_chats_and_a_bad_name_is_exit_2(tmp_path):
    """A SmolLM-shaped file: Llama architecture, a GPT-2-style vocabulary under ``smollm``, ChatML,
    Q4_1 weights. Its greedy answer is transformers' on the weights the gguf package reads."""
    from concurrent.futures import ThreadPoolExecutor

    from llama_chat.model.chat_format import Message
    from llama_chat.model.loader import load_model

    reference = _trained(PRE_TOKENIZERS["smollm"])
    n_vocab = reference.get_vocab_size()
    hf = hf_llama(n_vocab + 3, heads=4, kv_heads=2, tied=False, rope=DEFAULT_ROPE, seed=11)
    with torch.no_grad():  # no stop token can win: the answer runs to its length
        for t in SPECIALS:
            hf.lm_head.weight[reference.token_to_id(t)] = 0.0
    bpe = dict(tokenizer=reference, pre="smollm", bos="<|im_start|>", eos="<|im_end|>", unk="<|endoftext|>",
               pad="<|im_end|>")
    good = write_gguf(tmp_path / "smol.gguf", hf.state_dict(), hf_config(hf), qtype=T.Q4_1, bpe=bpe,
                      chat_template=CHATML)
    bad = write_gguf(tmp_path / "bad.gguf", hf.state_dict(), hf_config(hf), qtype=T.Q4_1,
                     bpe=bpe | {"pre": "\x1b[31mnope"}, chat_template=CHATML)
    # A float32 cache: the tokens are compared with transformers' float32 generate.
    commands = [["-m", str(p), "-p", "Hello there, 12 foxes!", "-n", "5", "-t", "0", "--json", "--no-stdin",
                 "--cache-type", "f32"] for p in (good, bad)]
    with ThreadPoolExecutor(2) as pool:
        ok, refused = pool.map(lambda args: run_cli(*args), commands)
    assert ok.returncode == 0, ok.stderr.decode()
    result = json.loads(ok.stdout)
    loaded = load_model(good, device="cpu")
    prompt = loaded.chat_format.encode_dialog([Message("user", "Hello there, 12 foxes!")])
    rendered = "<|im_start|>user\nHello there, 12 foxes!<|im_end|>\n<|im_start|>assistant\n"
    assert prompt == reference.encode(rendered, add_special_tokens=False).ids  # ChatML, no bos (smollm's default)
    assert result["prompt_tokens"] == len(prompt)
    same = hf_with_file_weights(hf, good)
    with torch.inference_mode():
        want = same.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=5)[0, len(prompt):].tolist()
    assert result["token_ids"] == want
    assert refused.returncode == 2
    assert refused.stderr.decode() == ("llama-chat: error: bad.gguf: tokenizer.ggml.pre '\\x1b[31mnope' is not "
                                       f"supported (not one of the {len(PRE_TOKENIZERS)} byte-level splits "
                                       "llama.cpp names; see docs/tokenizers.md)\n")

"""Build the tokenizer files the tokenizer tests run on: nothing is downloaded.

* ``train_llama_sentencepiece``: a byte-fallback BPE SentencePiece model with Llama 2's
  normalizer settings (identity normalization, whitespace kept, digits split);
* ``write_tiktoken_file``: a Llama-3-style rank file, the 256 single bytes plus BPE merges learnt
  here on a small corpus with Llama 3's split pattern;
* ``write_bytelevel_tokenizer_json`` / ``write_metaspace_tokenizer_json``: ``tokenizer.json`` +
  ``tokenizer_config.json`` in the two shapes Llama checkpoints ship;
* ``write_llama2c_tokenizer``: a llama2.c ``tokenizer.bin`` from a SentencePiece model, laid out
  as llama2.c's exporter writes it, plus ``runc_encode``, a literal transcription of run.c's
  quadratic merge loop to compare the fast encoder against.
"""

from __future__ import annotations

import base64
import json
import struct
from collections import Counter
from pathlib import Path

import regex
import sentencepiece as spm

from builders import train_sentencepiece
from llama_chat.model.tokenizers.tiktoken import LLAMA3_PATTERN

CORPUS = [
    "Once upon a time there was a little fox who lived in the forest.",
    "The fox liked to play with the rabbit and the bird near the river.",
    "Hello world! How are you today? I am fine, thank you. It's 2024 and I'll count 1234567.",
    "Café au lait, naïve façade, über, señor, déjà vu, Ærøskøbing, ça va?",
    "東京は大きな都市です。猫が好きです。北京欢迎你！",
    "Привет, как дела? Всё хорошо.",
    "The sun is warm ☀️ and the cat 🐱 sleeps.",
    "Family: 👨‍👩‍👧‍👦 and 👩‍❤️‍👨, flags 🇫🇷 🇯🇵 🏳️‍🌈, skin tones 👍🏽 🤷🏾‍♀️ 👋🏿.",
    "def main():\n    print('hi')\n\treturn 0\n",
    "  two leading spaces, trailing  ",
]

SPECIALS_SP = ("<unk>", "<s>", "</s>")


def train_llama_sentencepiece(out_dir: Path, *, vocab_size: int = 600, lines: list[str] | None = None,
                              user_defined: tuple[str, ...] = ()) -> Path:
    """A SentencePiece BPE model shaped like Llama 2's; returns the path of ``tokenizer.model``."""
    return train_sentencepiece(
        out_dir, vocab_size=vocab_size, lines=lines or CORPUS,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=list(user_defined),
    )


# -- tiktoken --------------------------------------------------------------------------------


def learn_byte_bpe(lines: list[str], n_merges: int) -> list[bytes]:
    """Tokens in rank order: the 256 single bytes, then greedy most-frequent-pair merges."""
    words = Counter(tuple(bytes([b]) for b in w.encode()) for line in lines
                    for w in regex.findall(LLAMA3_PATTERN, line))
    tokens = [bytes([b]) for b in range(256)]
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:]):
                pairs[a, b] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        tokens.append(a + b)
        merged: Counter = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return tokens


def write_tiktoken_file(out_dir: Path, *, n_merges: int = 200, lines: list[str] | None = None) -> Path:
    """A Llama-3-style ``tokenizer.model`` (``base64 rank`` lines); returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = learn_byte_bpe(lines or CORPUS, n_merges)
    path = out_dir / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


# -- Hugging Face tokenizer.json -------------------------------------------------------------


def write_bytelevel_tokenizer_json(out_dir: Path, *, vocab_size: int = 600, lines: list[str] | None = None,
                                   chat_template: str | None = None) -> Path:
    """A GPT-2-style ByteLevel BPE with ``<s>``/``</s>``/``<|eot_id|>`` and a bos post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((lines or CORPUS) * 5, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    tok.save(str(out_dir / "tokenizer.json"))
    _write_config(out_dir, bos="<s>", eos="</s>", chat_template=chat_template)
    return out_dir / "tokenizer.json"


def write_metaspace_tokenizer_json(out_dir: Path, sp_model: Path, *, chat_template: str | None = None) -> Path:
    """A byte-fallback Metaspace BPE with the SentencePiece model's vocabulary (Llama 2 in HF form).

    Merges are every split of a piece into two pieces, ordered by the merged piece's score, which
    is how a SentencePiece BPE vocabulary turns into ranked merges.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    out_dir.mkdir(parents=True, exist_ok=True)
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    merges = []
    for i in sorted(range(sp.vocab_size()), key=lambda i: -sp.get_score(i)):
        if sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i):
            continue
        piece = sp.id_to_piece(i)
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                  if piece[:k] in vocab and piece[k:] in vocab]
        merges += sorted(splits, key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS_SP])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", vocab["<s>"])])
    tok.save(str(out_dir / "tokenizer.json"))
    _write_config(out_dir, bos="<s>", eos="</s>", chat_template=chat_template, add_bos=True)
    return out_dir / "tokenizer.json"


def _write_config(out_dir: Path, *, bos: str, eos: str, chat_template: str | None, add_bos: bool | None = None):
    # bos as the object form real configs use, eos as a plain string: both spellings occur.
    bos_token = {"__type": "AddedToken", "content": bos, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
    config: dict = {"bos_token": bos_token, "eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))


# -- llama2.c --------------------------------------------------------------------------------


def write_llama2c_tokenizer(path: Path, sp_model: Path) -> Path:
    """llama2.c's ``tokenizer.bin`` for a SentencePiece model: scores kept, ``▁`` written as a space."""
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    pieces, scores = [], []
    for i in range(sp.vocab_size()):
        piece = sp.id_to_piece(i)
        if i == sp.bos_id():
            piece = "\n<s>\n"
        elif i == sp.eos_id():
            piece = "\n</s>\n"
        pieces.append(piece.replace("\u2581", " ").encode())
        scores.append(sp.get_score(i))
    out = bytearray(struct.pack("<i", max(len(p) for p in pieces)))
    for piece, score in zip(pieces, scores):
        out += struct.pack("<fi", score, len(piece)) + piece
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(out))
    return path


def runc_encode(pieces: list[bytes], scores: list[float], text: str) -> list[int]:
    """run.c's ``encode`` without bos/eos, step for step: dummy prefix, characters or byte
    fallback, then rescan for the best-scoring mergeable pair until none is left."""
    lookup: dict[bytes, int] = {}
    for i, p in enumerate(pieces):
        lookup.setdefault(p, i)
    tokens: list[int] = []
    if text:
        tokens.append(lookup[b" "])
    for ch in text:
        b = ch.encode()
        tokens.extend([lookup[b]] if b in lookup else [x + 3 for x in b])
    while True:
        best_score, best_id, best_idx = -1e10, -1, -1
        for i in range(len(tokens) - 1):
            merged = lookup.get(pieces[tokens[i]] + pieces[tokens[i + 1]])
            if merged is not None and scores[merged] > best_score:
                best_score, best_id, best_idx = scores[merged], merged, i
        if best_idx == -1:
            return tokens
        tokens[best_idx:best_idx + 2] = [best_id]

"""The default model shipped in the package: its files, its tokenizer, its corpus, its greedy output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from llama_chat.model.loader import default_model_dir, load_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from default_model import corpus, tokenizer, vocabulary  # noqa: E402

MODEL_DIR = default_model_dir()
FILES = ("params.json", "consolidated.00.pth", "tokenizer.model")
MAX_BYTES = 8 * 1024 * 1024


def corpus_emoji() -> list[str]:
    pools = [e for _, e in vocabulary.CREATURES] + [e for _, e, _ in vocabulary.CITIES]
    pools += [e for _, e in vocabulary.FOODS + vocabulary.OBJECTS + vocabulary.WEATHER + vocabulary.PLACES]
    pools += vocabulary.WAVES + vocabulary.HEARTS + vocabulary.FAMILIES
    return sorted({e for e in pools if e})


@pytest.fixture(scope="module")
def sp() -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(MODEL_DIR / "tokenizer.model"))


# -- the shipped files ---------------------------------------------------------------------------

def test_shipped_files_exist_and_fit_in_8_mb():
    sizes = {name: (MODEL_DIR / name).stat().st_size for name in FILES}
    assert all(sizes.values()), sizes
    assert sum(sizes.values()) <= MAX_BYTES, sizes


def test_weights_are_half_precision_and_params_declare_llama2_chat():
    params = json.loads((MODEL_DIR / "params.json").read_text())
    assert params["chat_format"] == "llama2"
    assert params["n_kv_heads"] < params["n_heads"]  # grouped-query attention
    state = torch.load(MODEL_DIR / "consolidated.00.pth", map_location="cpu", mmap=True, weights_only=True)
    assert {t.dtype for t in state.values()} == {torch.float16}


def test_default_model_loads_with_its_tokenizer_and_chat_format():
    loaded = load_model(MODEL_DIR, device="cpu")
    assert loaded.args.vocab_size == loaded.tokenizer.vocab_size
    assert type(loaded.chat_format).__name__ == "Llama2ChatFormat"
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([loaded.tokenizer.encode("Once upon a time", bos=True)]))
    assert torch.isfinite(logits).all()


# -- the tokenizer -------------------------------------------------------------------------------

@pytest.mark.parametrize("emoji", corpus_emoji())
def test_every_corpus_emoji_is_spelled_as_byte_tokens(sp, emoji):
    pieces = [p for p in sp.encode(emoji, out_type=str) if p != "▁"]
    assert pieces and all(p.startswith("<0x") and p.endswith(">") for p in pieces), pieces
    assert len(pieces) == len(emoji.encode("utf-8"))
    assert sp.decode(sp.encode(f"a fox {emoji} ran")) == f"a fox {emoji} ran"


def test_accented_and_non_latin_words_stay_in_the_vocabulary(sp):
    for word in ("Zoé", "crème", "piñata", "Здравей", "こんにちは", "Γειά"):
        assert not any(p.startswith("<0x") for p in sp.encode(word, out_type=str)), word


# -- the corpus generator ------------------------------------------------------------------------

def test_corpus_is_deterministic_and_seeded():
    first = list(corpus.documents(7, 200))
    assert first == list(corpus.documents(7, 200))
    assert first != list(corpus.documents(8, 200))


def test_corpus_has_chat_exchanges_and_emoji():
    docs = list(corpus.documents(0, 400))
    chats = [d for d in docs if d[0].startswith("[INST] ")]
    assert 0.2 < len(chats) / len(docs) < 0.6
    assert all(" [/INST] " in turn for d in chats for turn in d)
    with_emoji = [d for d in docs if any(tokenizer.is_emoji_char(c) for seg in d for c in seg)]
    assert len(with_emoji) / len(docs) > 0.5


def test_tokenizer_training_is_reproducible(tmp_path):
    segments = [s for d in corpus.documents(3, 300) for s in d]
    a = tokenizer.train(segments, tmp_path / "a.model", 400)
    b = tokenizer.train(segments, tmp_path / "b.model", 400)
    assert a.read_bytes() == b.read_bytes()


# -- the golden output, through the real command -------------------------------------------------

# Greedy decoding of the shipped model, pinned. It changes only when the model is retrained (then
# run `llama-chat -p "$GOLDEN_PROMPT" --temperature 0 -n $GOLDEN_TOKENS --seed 0` and paste its
# output here). The reply contains emoji, which the model can only produce as <0xNN> byte tokens:
# the path from byte tokens to whole characters is part of what this pins.
GOLDEN_PROMPT = "Tell me a story about a pirate"
GOLDEN_TOKENS = 63
GOLDEN_TEXT = ("Once upon a time there was a clever pirate named Milo \U0001F3F4\u200D\u2620\uFE0F who lived in the "
               "snowy hills. One spring morning, Milo lost her favorite toy, a ball \u26BD.")
# The pirate flag (black flag, zero-width joiner, skull and crossbones, VS16) arrives as 13 byte
# tokens in a row, the ball as 3; each token is one <0xNN> piece.
GOLDEN_BYTE_TOKENS = [
    [0xF0, 0x9F, 0x8F, 0xB4, 0xE2, 0x80, 0x8D, 0xE2, 0x98, 0xA0, 0xEF, 0xB8, 0x8F],
    [0xE2, 0x9A, 0xBD],
]


def _cli(*args: str) -> subprocess.CompletedProcess:
    from cli_support import run_cli

    run = run_cli(*args, NO_COLOR="1", COLUMNS="200")
    run = subprocess.CompletedProcess(run.args, run.returncode, run.stdout.decode(), run.stderr.decode())
    assert run.returncode == 0, run.stderr
    return run


def test_golden_greedy_output_through_the_cli(sp):
    args = ["-p", GOLDEN_PROMPT, "--temperature", "0", "-n", str(GOLDEN_TOKENS), "--seed", "0"]
    assert _cli(*args).stdout == GOLDEN_TEXT + "\n"  # a pipe's answer ends its line

    # The same run as JSON: the emoji really arrived as byte tokens, one byte each.
    ids = json.loads(_cli(*args, "--json").stdout)["token_ids"]
    pieces = [sp.id_to_piece(i) for i in ids]
    byte_runs, run = [], []
    for piece in pieces + ["."]:
        if piece.startswith("<0x"):
            run.append(int(piece[3:5], 16))
        elif run:
            byte_runs.append(run)
            run = []
    assert byte_runs == GOLDEN_BYTE_TOKENS
    assert sp.decode(ids) == GOLDEN_TEXT

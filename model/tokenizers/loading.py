"""Pick and load the tokenizer backend of a model directory.

Which files decide (first match wins):

1. ``tokenizer.json`` together with ``tokenizer_config.json``: Hugging Face ``tokenizers``;
2. ``tokenizer.model``: sniffed by content, a SentencePiece protobuf or a tiktoken rank file
   (Llama 3.x ships its tiktoken ranks under that same name);
3. ``tokenizer.json`` alone: Hugging Face ``tokenizers`` with defaults;
4. ``tokenizer.bin``: llama2.c;
5. ``vocab.txt``: BERT's WordPiece (``wordpiece.py``).

A ``tokenizer.json`` whose model is ``WordPiece`` is read by ``wordpiece.py`` too.

``generation_config.json``'s ``eos_token_id`` (an int or a list) adds stop ids, since Hugging Face
checkpoints list their end-of-turn tokens there.
"""

from __future__ import annotations

from pathlib import Path

from llama_chat.model.errors import ModelLoadError
from llama_chat.model.formats.json_files import read_json
from llama_chat.model.tokenizers.base import Tokenizer

LOOKED_FOR = ("tokenizer.json", "tokenizer.model", "tokenizer.bin", "vocab.txt")

_SNIFF_BYTES = 4096


def load_tokenizer(model_dir: Path, *, tokenizer_file: Path | None = None) -> Tokenizer:
    """The tokenizer of ``model_dir`` (or of ``tokenizer_file`` when given); ModelLoadError if none."""
    model_dir = Path(model_dir)
    extra_stops = _generation_stop_ids(model_dir)
    if tokenizer_file is not None:
        path = Path(tokenizer_file)
        if not path.is_file():
            raise ModelLoadError(f"{path}: tokenizer file not found")
        return _load_file(path, extra_stops)

    json_path = model_dir / "tokenizer.json"
    if json_path.is_file() and (model_dir / "tokenizer_config.json").is_file():
        return _load_file(json_path, extra_stops)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer.bin"):
        if (model_dir / name).is_file():
            return _load_file(model_dir / name, extra_stops)
    if (model_dir / "vocab.txt").is_file():
        from llama_chat.model.tokenizers.wordpiece import wordpiece_from_vocab_txt

        return wordpiece_from_vocab_txt(model_dir)
    raise ModelLoadError(f"{model_dir}: no tokenizer found (looked for {', '.join(LOOKED_FOR)})")


def _load_file(path: Path, extra_stops: list[int]) -> Tokenizer:
    if path.suffix == ".json":
        from llama_chat.model.tokenizers.hf import HFTokenizer
        from llama_chat.model.tokenizers.wordpiece import is_wordpiece_json, wordpiece_from_json

        spec = read_json(path)
        if is_wordpiece_json(spec):
            return wordpiece_from_json(path, spec)
        return HFTokenizer(path, extra_stop_ids=extra_stops, spec=spec)
    head = _head(path)
    if path.suffix == ".bin":
        from llama_chat.model.tokenizers.llama2c import Llama2cTokenizer

        return Llama2cTokenizer(path)
    from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer, looks_like_sentencepiece
    from llama_chat.model.tokenizers.tiktoken import TiktokenTokenizer, looks_like_tiktoken

    if looks_like_sentencepiece(head):
        return SentencePieceTokenizer(path, extra_stop_ids=extra_stops)
    if looks_like_tiktoken(head):
        return TiktokenTokenizer(path, extra_stop_ids=extra_stops)
    raise ModelLoadError(f"{path}: unrecognised tokenizer file "
                         "(expected a SentencePiece model or tiktoken ranks 'base64 rank' per line)")


def _head(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(_SNIFF_BYTES)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read tokenizer ({exc.strerror or exc})") from None


def _generation_stop_ids(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    value = read_json(path).get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelLoadError(f"{path}: eos_token_id must be an int or a list of ints, found {value!r}")
    return list(values)

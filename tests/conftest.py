from __future__ import annotations

from pathlib import Path

import pytest
import sentencepiece as spm

from builders import random_model, tiny_args, train_sentencepiece, write_meta_checkpoint


@pytest.fixture(scope="session")
def sp_model_path(tmp_path_factory) -> Path:
    """A byte-fallback SentencePiece ``tokenizer.model`` trained on a small mixed-script corpus."""
    return train_sentencepiece(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="session")
def sp_vocab_size(sp_model_path) -> int:
    return spm.SentencePieceProcessor(model_file=str(sp_model_path)).vocab_size()


@pytest.fixture(scope="session")
def tiny_meta_dir(tmp_path_factory, sp_model_path, sp_vocab_size) -> Path:
    """A random tiny Llama in Meta layout whose vocabulary is the SentencePiece model's."""
    model = random_model(tiny_args(sp_vocab_size), seed=0)
    return write_meta_checkpoint(model, tmp_path_factory.mktemp("tiny_meta"), sp_model_path)

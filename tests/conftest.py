from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import sentencepiece as spm
from hypothesis import HealthCheck, settings

from builders import random_model, tiny_args, train_sentencepiece, write_meta_checkpoint

# Hypothesis profiles, picked with HYPOTHESIS_PROFILE (default: quick).
#   quick: what every run and CI use; the decoder properties take a few seconds in all.
#   long:  10,000 examples per property, for changes to the streaming decoder or the emoji rules:
#          HYPOTHESIS_PROFILE=long python -m pytest -q tests/test_stream_decoder.py
# No deadline and no too-slow health check in either: on a busy machine a slow example is the
# machine, not the code. Tests that set their own max_examples keep it.
_BUSY_MACHINE_SAFE = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("quick", max_examples=300, **_BUSY_MACHINE_SAFE)
settings.register_profile("long", max_examples=10_000, **_BUSY_MACHINE_SAFE)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))


@pytest.fixture(scope="session")
def sp_model_path(tmp_path_factory) -> Path:
    """A byte-fallback SentencePiece ``tokenizer.model`` trained on a small mixed-script corpus."""
    return train_sentencepiece(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="session")
def sp_tokenizer(sp_model_path):
    from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer

    return SentencePieceTokenizer(sp_model_path)


@pytest.fixture(scope="session")
def sp_vocab_size(sp_model_path) -> int:
    return spm.SentencePieceProcessor(model_file=str(sp_model_path)).vocab_size()


@pytest.fixture(scope="session")
def tiny_meta_dir(tmp_path_factory, sp_model_path, sp_vocab_size) -> Path:
    """A random tiny Llama in Meta layout whose vocabulary is the SentencePiece model's."""
    model = random_model(tiny_args(sp_vocab_size), seed=0)
    return write_meta_checkpoint(model, tmp_path_factory.mktemp("tiny_meta"), sp_model_path)


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_loaded():
    """Our CPU products (``ml/cpu_kernels.py``), built or loaded once, so that every test runs the
    decode products users get; ``LLAMA_CHAT_CPU_KERNELS=0`` runs the suite on PyTorch's instead."""
    from llama_chat.ml.cpu import kernels as cpu_kernels

    # Without a compiler they stay unbuilt and the suite runs on PyTorch's products;
    # tests/test_cpu_kernels.py checks the build wherever there is one.
    return cpu_kernels.enabled() and cpu_kernels.load()


@pytest.fixture
def pytorch_products(monkeypatch):
    """PyTorch's products instead of ours, for the tests of those paths."""
    from llama_chat.ml.cpu import kernels as cpu_kernels

    monkeypatch.setitem(cpu_kernels._state, "loaded", False)


@pytest.fixture(scope="session")
def operator_variant_env(tmp_path_factory):
    """The environment of a process that builds the operator's products (``kernels.cpp`` alone)
    with instruction sets taken away, ``flags`` added to every compile (say ``-mno-avx512f``): the
    first such process builds the library into a cache of the flags' own, the next ones load it.
    Shared by the tests of each product's variants, so that each variant is built once a run."""
    made: dict[str, dict[str, str]] = {}

    def env_for(flags: str) -> dict[str, str]:
        if flags not in made:
            root = tmp_path_factory.mktemp("operator-variant")
            wrapper = root / "cxx"
            compiler = shutil.which(os.environ.get("CXX") or "c++")
            wrapper.write_text(f'#!/bin/sh\nexec "{compiler}" "$@" {flags}\n')
            wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
            made[flags] = dict(os.environ, CXX=str(wrapper), LLAMA_CHAT_KERNEL_DIR=str(root / "kernels"))
        return made[flags]

    return env_for

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Before torch is imported: the suite's own process runs tiny models too, and its workers share
# the cores with each other and with the commands under test. OpenMP helpers that spin between
# the many small parallel regions would take those cores (see cli_support.cli_env).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The package's modules and the tests compiled once and cached, even where PYTHONDONTWRITEBYTECODE
# is set: every worker, fork server and command the suite starts would compile them again (a few
# seconds of a core for each worker's collection).
sys.dont_write_bytecode = False

import pytest  # noqa: E402
import sentencepiece as spm
from hypothesis import HealthCheck, settings

from builders import OPERATOR_VARIANT_LOAD, random_model, tiny_args, train_sentencepiece, write_meta_checkpoint

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


# The files that take longest (servers per format, many processes): handed to the parallel
# workers first, so that the workers end together instead of one running a long file alone at
# the end (the workers take whole files, in the order collected: alphabetical, otherwise).
LONGEST_FIRST = ("test_tools.py", "test_kernel_cache.py", "test_hostile_inputs_2.py", "test_cli_one_shot.py",
                 "test_cli_chat.py", "test_cli_terminal.py", "test_constraints.py", "test_remote.py",
                 "test_cli_signals.py", "test_f16_weights.py", "test_speculative_distribution.py")


def pytest_xdist_auto_num_workers(config) -> int:
    """One worker more than the cores (``--numprocesses=logical`` in pyproject.toml, at most
    ``--maxprocesses``): a worker spends part of its time waiting on the command's processes and
    servers it started, and a third worker on two cores keeps both busy (docs/benchmarks.md, "The
    test suite")."""
    return (os.cpu_count() or 1) + 1


def pytest_configure(config) -> None:
    # Newer pytest-xdist releases hand out the files with the most tests first unless told not to,
    # which puts the longest files last; the order below is the one wanted.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept


@contextmanager
def shared_and_locked(tmp_path_factory, name: str) -> Iterator[Path]:
    """A directory of this run that every parallel worker sees (each worker's own temporary
    directories lie under one common parent), held by one worker at a time."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    path.mkdir(exist_ok=True)
    with open(path / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield path


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
def cpu_kernels_loaded(tmp_path_factory):
    """Our CPU products (``ml/cpu_kernels.py``), built or loaded once, so that every test runs the
    decode products users get; ``LLAMA_CHAT_CPU_KERNELS=0`` runs the suite on PyTorch's instead.
    Where they are not built yet, one parallel worker builds them while the others wait."""
    from llama_chat.ml.cpu import kernels as cpu_kernels

    # Without a compiler they stay unbuilt and the suite runs on PyTorch's products;
    # tests/test_cpu_kernels.py checks the build wherever there is one.
    if not cpu_kernels.enabled():
        return False
    with shared_and_locked(tmp_path_factory, "cpu-kernels"):
        return cpu_kernels.load()


@pytest.fixture
def pytorch_products(monkeypatch):
    """PyTorch's products instead of ours, for the tests of those paths."""
    from llama_chat.ml.cpu import kernels as cpu_kernels

    monkeypatch.setitem(cpu_kernels._state, "loaded", False)


def _variant_dir(flags: str, root: Path) -> Path:
    """Where a variant of the operator is built: beside the user's own build, in a folder of its
    flags, so that a run reuses what an earlier one built for the same sources (each build is a
    full compile); in the run's temporary folder where that cache cannot be written."""
    from llama_chat.ml.cpu import kernels as cpu_kernels

    folder = cpu_kernels.cache_dir() / "variants" / re.sub(r"\W+", "-", flags).strip("-")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return root / "kernels"
    return folder


@pytest.fixture(scope="session")
def operator_variant_env(tmp_path_factory):
    """The environment of a process that builds the operator's products (``kernels.cpp`` alone)
    with instruction sets taken away, ``flags`` added to every compile (say ``-mno-avx512f``), into
    a cache of the flags' own. Shared by the tests of each product's variants, and by parallel
    workers: the first to ask for a variant builds it while the others wait, then all load it."""
    made: dict[str, dict[str, str]] = {}

    def env_for(flags: str) -> dict[str, str]:
        if flags not in made:
            with shared_and_locked(tmp_path_factory, "operator-variant" + re.sub(r"\W+", "-", flags)) as root:
                wrapper = root / "cxx"
                env = dict(os.environ, CXX=str(wrapper), LLAMA_CHAT_KERNEL_DIR=str(_variant_dir(flags, root)))
                if not wrapper.exists():
                    compiler = shutil.which(os.environ.get("CXX") or "c++")
                    # -O1: a variant is built to check its code, not its speed, in half the compile.
                    wrapper.write_text(f'#!/bin/sh\nexec "{compiler}" "$@" {flags} -O1\n')
                    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
                    # A build that fails leaves its note for the test's own process to report.
                    subprocess.run([sys.executable, "-c", OPERATOR_VARIANT_LOAD], env=env, capture_output=True,
                                   timeout=900)
            made[flags] = env
        return made[flags]

    return env_for

"""The CPU operator's cache (``ml/cpu/kernels.py``) trusts nothing it has not checked: a library cut
short, an unrelated library under its name, a FIFO for its failure note, a directory it cannot
write, two processes building at once, a compiler that hangs or names itself with escape codes.
Each ends in a working run, on the operator or on PyTorch's products, with at most one line said.

Each case runs in a process of its own over a cache directory of its own (``LLAMA_CHAT_KERNEL_DIR``):
a process that has loaded a library keeps it, and a crash must end the child, not the suite. The
children are forked from a process that has imported torch and the package but loaded no library
(``tests/forkserver.py``), where the environment allows it. The
compiled steps' cache that cannot be written is checked in this process (a child would compile
cold).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from cli_support import build_tiny_model, cli_env, llama_chat_command, popen_cli, popen_python, run_cli, run_python
from llama_chat.cmd.run_command import warm_up
from llama_chat.inference.decode_step import COMPILE_CACHE_ENV, use_persistent_compile_cache
from llama_chat.ml import user_cache
from llama_chat.ml.cpu import kernels as cpu_kernels
from llama_chat.ml.sampling import SamplingParams
from terminal_support import Pty

TIMEOUT = 600  # a child on a busy two-core machine, compiling the decode step among them

LOAD = ("import json; from llama_chat.ml.cpu import kernels as k; ok = k.load(); "
        "print(json.dumps({'loaded': ok, 'failure': k.failure()}))")


def load_in_child(kernel_dir: Path, **env: str) -> dict:
    """``kernels.load()`` in a process of its own over ``kernel_dir``: whether it loaded, and why not."""
    base = {k: v for k, v in os.environ.items() if k not in ("CXX", "LLAMA_CHAT_KERNEL_DIR")}
    run = run_python(LOAD, env={**base, "LLAMA_CHAT_KERNEL_DIR": str(kernel_dir), **env}, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr.decode()  # no crash (a library cut short would end it with SIGBUS)
    return json.loads(run.stdout.decode().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built(cpu_kernels_loaded) -> Path:
    """The library the suite built (or found) for this machine, sealed."""
    if not cpu_kernels_loaded:
        pytest.skip(f"the kernels are not built here ({cpu_kernels.failure()})")
    return cpu_kernels.library_path()


def _copy(built: Path, tmp: Path) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    target = tmp / built.name
    shutil.copyfile(built, target)
    return target


def test_a_sealed_library_loads_without_a_build(built, tmp_path):
    _copy(built, tmp_path)
    assert load_in_child(tmp_path, CXX="/bin/false") == {"loaded": True, "failure": None}


def test_a_library_cut_short_is_built_again_not_loaded(built, tmp_path):
    target = _copy(built, tmp_path)
    os.truncate(target, target.stat().st_size // 2)
    found = load_in_child(tmp_path, CXX="/bin/false")  # the rebuild fails at once: PyTorch's products
    assert found["loaded"] is False and found["failure"].startswith("/bin/false failed"), found


def test_an_unrelated_library_under_the_name_is_never_trusted(built, tmp_path):
    import _json

    if not getattr(_json, "__file__", None):
        pytest.skip("this Python has no extension module file to stand in for an unrelated library")
    unrelated = Path(_json.__file__)
    target = tmp_path / built.name
    shutil.copyfile(unrelated, target)
    found = load_in_child(tmp_path, CXX="/bin/false")  # not sealed: built again
    assert found["loaded"] is False and found["failure"].startswith("/bin/false failed"), found
    cpu_kernels._seal(target)  # sealed as if built here: loaded, found wanting, removed
    found = load_in_child(tmp_path, CXX="/bin/false")
    assert found["loaded"] is False and "does not define the operator" in found["failure"], found
    assert not target.exists()


def test_a_fifo_for_the_failure_note_neither_blocks_nor_stays(built, tmp_path):
    marker = (tmp_path / built.name).with_suffix(".failed")
    os.mkfifo(marker)
    found = load_in_child(tmp_path, CXX="/bin/false")
    assert found["loaded"] is False and found["failure"].startswith("/bin/false failed"), found
    assert marker.is_file() and marker.read_text().startswith("/bin/false failed")


def test_a_cache_that_cannot_be_written_falls_back_in_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    found = load_in_child(blocker / "kernels")
    assert found["loaded"] is False and found["failure"].startswith(f"cannot write its cache {blocker / 'kernels'}")


@pytest.mark.parametrize("lock", ["taken", "blocked"])
def test_two_processes_starting_at_once_build_once_and_both_load_a_whole_library(built, tmp_path, lock):
    # A stand-in compiler writes the library the suite loaded (every run that loads the operator
    # tests the real build). Its compiles of each source (``-c``) write an empty object. Its link
    # writes in two steps; where the build lock cannot be taken (a folder in its place), both
    # processes build, and each link first waits until both are linking, so that the two builds
    # overlap however the machine schedules them: the rename must still give each a whole library.
    started, kernel_dir = tmp_path / "started", tmp_path / "kernels"
    started.mkdir()
    kernel_dir.mkdir()
    linkers = 1 if lock == "taken" else 2
    if lock == "blocked":
        (kernel_dir / built.name).with_suffix(".lock").mkdir()
    compiler = tmp_path / "cc"
    compiler.write_text(f"""#!/bin/sh
for arg; do [ "$previous" = -o ] && out="$arg"; [ "$arg" = -c ] && compiling=1; previous="$arg"; done
[ -n "$compiling" ] && : > "$out" && exit 0
touch "{started}/$$"
waited=0
while [ "$(ls "{started}" | wc -l)" -lt {linkers} ] && [ $waited -lt 1200 ]; do sleep 0.1; waited=$((waited + 1)); done
sleep 0.5
head -c {built.stat().st_size // 2} "{built}" > "$out" && sleep 0.2 && cat "{built}" > "$out"
""")
    compiler.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("CXX", "LLAMA_CHAT_KERNEL_DIR")}
    env = {**base, "CXX": str(compiler), "LLAMA_CHAT_KERNEL_DIR": str(kernel_dir)}
    children = [popen_python(LOAD, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for _ in range(2)]
    for child in children:
        out, err = child.communicate(timeout=TIMEOUT)
        assert child.returncode == 0, err.decode()
        assert json.loads(out.decode().strip().splitlines()[-1]) == {"loaded": True, "failure": None}
    assert len(list(started.iterdir())) == linkers  # with the lock, the second loads the first's build
    libraries = sorted(p.name for p in kernel_dir.iterdir() if p.suffix != ".lock")
    assert libraries == [built.name], libraries  # no half-written leftovers
    assert cpu_kernels._untrusted(kernel_dir / libraries[0]) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("kernel_cache"))


def _run(tiny, *args: str, **env: str) -> subprocess.CompletedProcess:
    return run_cli("-m", str(tiny.path), "-p", "hello", "-n", "4", "-t", "0", "--no-stdin", *args, timeout=TIMEOUT,
                   **env)


def test_a_compiler_named_with_escape_codes_is_shown_safely(tiny, tmp_path):
    proc = _run(tiny, "--quantize", "int8", CXX="\x1b]0;x\x07\x1b[2Jcc", LLAMA_CHAT_KERNEL_DIR=str(tmp_path))
    err = proc.stderr.decode()
    assert proc.returncode == 0 and proc.stdout.strip(), err
    assert "\x1b" not in err and "\x07" not in err
    lines = [line for line in err.splitlines() if "CPU kernels" in line]
    assert lines == ["llama-chat: could not build the CPU kernels (no C++ compiler (␛]0;x␇␛[2Jcc) on PATH); "
                     "using PyTorch's products"], err


@pytest.mark.slow
def test_a_read_only_kernel_cache_falls_back_in_one_line(tiny, tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    env = {"XDG_CACHE_HOME": str(blocker), "CXX": "/bin/false"}
    quantized = _run(tiny, "--quantize", "int8", **env)
    err = quantized.stderr.decode()
    assert quantized.returncode == 0 and quantized.stdout.strip(), err
    said = [line for line in err.splitlines() if line.startswith("llama-chat:")]
    assert said == [f"llama-chat: could not build the CPU kernels (cannot write its cache {blocker}/llama-chat/"
                    "kernels (Not a directory)); using PyTorch's products"], err
    assert "Traceback" not in err


def test_compiled_steps_without_a_writable_cache_are_kept_for_the_run_and_said_once(tmp_path, monkeypatch):
    # In this process: a child would compile its step cold, into a new directory, for tens of
    # seconds; the fallback and the line said are what is checked.
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.delenv(COMPILE_CACHE_ENV, raising=False)
    monkeypatch.setattr(user_cache, "_fallbacks", {})
    kept = Path(use_persistent_compile_cache())
    try:
        assert os.environ[COMPILE_CACHE_ENV] == str(kept) and kept.is_dir() and os.access(kept, os.W_OK)
        assert blocker not in kept.parents
        said = io.StringIO()
        source = SimpleNamespace(compiles=True, device=torch.device("cpu"), compile_failure=None,
                                 warm_up=lambda sampling: None)
        warm_up(source, SamplingParams(), Console(file=said, width=400), quiet=False)
        assert said.getvalue() == (f"llama-chat: compiled steps are kept for this run only (cannot write {blocker}/"
                                   "llama-chat/torch-compile (Not a directory))\n")
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def test_a_compiler_that_hangs_is_announced_and_ctrl_c_ends_the_wait(tiny, tmp_path):
    hang = tmp_path / "hang-cc"
    hang.write_text("#!/bin/sh\nexec sleep 600\n")
    hang.chmod(0o755)
    proc = popen_cli([*llama_chat_command(), "-m", str(tiny.path), "-p", "hello", "-n", "4", "--no-stdin",
                      "--quantize", "int8"], cli_env(CXX=str(hang), LLAMA_CHAT_KERNEL_DIR=str(tmp_path / "k")),
                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stderr.readline().decode()  # said in a pipe too, once the wait passes a second
        assert line == "llama-chat: building the CPU kernels for this machine (first run only; a minute or more)\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err


def test_on_a_terminal_the_wait_for_a_build_shows_the_time_so_far(tiny, tmp_path):
    hang = tmp_path / "hang-cc"
    hang.write_text("#!/bin/sh\nexec sleep 600\n")
    hang.chmod(0o755)
    term = Pty("-m", str(tiny.path), "-p", "hello", "-n", "4", "--quantize", "int8", CXX=str(hang),
               LLAMA_CHAT_KERNEL_DIR=str(tmp_path / "k"))
    term.read_until(lambda: re.search(rb"building CPU kernels \(first run only\).*0:00:0[1-9]", term.shown))
    term.type(b"\x03")
    assert term.finish() == 130


def test_the_compiler_takes_signals_when_started_from_a_thread_that_blocks_them():
    # Every thread but the main one blocks the process's signals; a compiler it started with that
    # mask would outlive a Ctrl+C.
    found = {}

    def build():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        run = cpu_kernels._compile(["sh", "-c", "grep SigBlk /proc/self/status"])
        found["child"] = int(run.stdout.split()[1], 16)
        found["thread"] = signal.pthread_sigmask(signal.SIG_BLOCK, ())

    worker = threading.Thread(target=build)
    worker.start()
    worker.join(60)
    assert found["child"] & (1 << (signal.SIGINT - 1) | 1 << (signal.SIGTERM - 1)) == 0
    assert {signal.SIGINT, signal.SIGTERM} <= found["thread"]  # the thread's own block is back

"""What the end-to-end tests of the ``llama-chat`` process share: a tiny model and a runner."""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import resource
import re
import select
import subprocess
import sys
import termios
import time
from dataclasses import dataclass, fields
from pathlib import Path

import pexpect
import sentencepiece as spm
import torch

from builders import random_model, tiny_args, train_sentencepiece, write_meta_checkpoint
from forkserver import FORKS_ENV, ForkServer, forked_spawn, needs_own_start

# Escape sequences: CSI and the like (colours, cursor shown or hidden, erase line), and the
# two-byte save and restore cursor (ESC 7, ESC 8).
ANSI = re.compile(rb"\x1b(?:[\[\]()#;?]*[0-9;?]*[A-Za-z]|[78])")
STOP_IDS = (2,)  # the SentencePiece builder's eos; the tiny vocabulary has no other stop token


@dataclass(frozen=True)
class TinyModel:
    path: Path
    model: object  # the Transformer the checkpoint was written from
    tokenizer_path: Path


def command_request(loaded, *args: str):
    """The ``Request`` the one-shot command makes of its arguments ``args`` for the model
    ``loaded`` (a ``LoadedModel`` of the model ``args`` name): the options parsed and checked as
    the command does, the prompt as it tokenizes it. For a test that runs many option sets in its
    own process, where each child would spend seconds importing torch before doing the same."""
    import typer

    from llama_chat.cmd import app as cli
    from llama_chat.cmd.options import Options
    from llama_chat.cmd.prompt import prompt_ids

    parsed = typer.main.get_command(cli.app).make_context("llama-chat", list(args)).params
    opts = Options(**{k: v for k, v in parsed.items() if k in {f.name for f in fields(Options)}})
    ids = prompt_ids(opts.prompt, system=opts.system, tokenizer=loaded.tokenizer, chat_format=loaded.chat_format,
                     template=opts.template)
    return opts.request(ids, chat_reply=loaded.chat_format is not None)


def build_tiny_model(out_dir: Path, *, max_seq_len: int = 1024) -> TinyModel:
    """A random Llama that never ends on its own: the stop token's output row is zero.

    Its logit is then exactly 0 while the best of the other 500-odd random logits is well above
    it, so greedy runs of hundreds of tokens never stop early and a signal lands mid-generation.
    """
    tok = train_sentencepiece(out_dir / "spm", vocab_size=512)
    vocab = spm.SentencePieceProcessor(model_file=str(tok)).vocab_size()
    model = random_model(tiny_args(vocab, max_seq_len=max_seq_len), seed=3)
    with torch.no_grad():
        model.output.weight[list(STOP_IDS)] = 0.0
    write_meta_checkpoint(model, out_dir / "tiny", tok)
    return TinyModel(out_dir / "tiny", model, tok)


def llama_chat_command() -> list[str]:
    """The command installed beside the Python running the tests, never another one on PATH
    (an older install elsewhere would be tested instead, with other dependencies)."""
    exe = Path(sys.executable).parent / "llama-chat"
    if not exe.is_file():  # not installed as a script: the same entry point through Python
        return [sys.executable, "-c", "from llama_chat.cmd.main import main; main()"]
    return [str(exe)]


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("NO_COLOR", None)
    # The size of the terminal under test is its own: COLUMNS and LINES (which parallel test
    # workers set) would override it.
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    # OpenMP helpers that spin between the many tiny parallel regions of a tiny model make it run
    # 20x slower on a busy shared machine (60 against 1400 tok/s here); sleeping helpers keep the
    # suite quick. Nothing under test depends on it, and a CI can set its own value.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.update(extra)
    return env


# A child's whole run: start-up, load, generation. Generous, because on a machine busy with other
# work a run that takes two seconds alone took over a minute (the bound only catches a hang).
RUN_TIMEOUT_S = 240


_fork_server: list[ForkServer] = []


def run_cli(*args: str, stdin: bytes | None = None, timeout: float = RUN_TIMEOUT_S, address_space: int | None = None,
            **env: str) -> subprocess.CompletedProcess:
    """Run the command to completion; stdin is /dev/null unless bytes are given; ``address_space``:
    its ``RLIMIT_AS`` in bytes. Forked from a process that imported it once (``forkserver.py``)
    where nothing the start reads differs."""
    argv, run_env = [*llama_chat_command(), *args], cli_env(**env)
    server = fork_server()
    if server is None or needs_own_start(run_env, server.env):
        return subprocess.run(argv, input=stdin, stdin=subprocess.DEVNULL if stdin is None else None,
                              capture_output=True, timeout=timeout, env=run_env,
                              preexec_fn=_limits(address_space=address_space))
    return server.run(argv, input=stdin, env=run_env, timeout=timeout, address_space=address_space)


def popen_cli(argv: list[str], env: dict[str, str], *, terminal: bool = False, address_space: int | None = None,
              **streams) -> subprocess.Popen:
    """``subprocess.Popen(argv, env=env, **streams)``, forked where ``run_cli`` would fork it.
    ``terminal``: stdin is a pseudo-terminal, made the command's controlling terminal;
    ``address_space``: the run's ``RLIMIT_AS`` in bytes."""
    server = fork_server()
    # Arguments that are not text (bytes outside UTF-8) cannot be sent: the request is JSON.
    if server is None or needs_own_start(env, server.env) or any(isinstance(arg, bytes) for arg in argv):
        return subprocess.Popen(argv, env=env, preexec_fn=_limits(terminal, address_space), **streams)
    return server.popen(argv, env=env, terminal=terminal, address_space=address_space, **streams)


def run_python(code: str, *args: str, env: dict[str, str] | None = None, timeout: float = RUN_TIMEOUT_S,
               cwd: Path | str | None = None, text: bool = False) -> subprocess.CompletedProcess:
    """``python -c code *args`` to completion in a process of its own (in ``env``, default this
    process's), its output captured (decoded where ``text``); forked where ``run_cli`` would fork,
    and then the result's ``max_rss`` says its peak resident set."""
    env = dict(os.environ) if env is None else env
    server = fork_server()
    if server is None or needs_own_start(env, server.env):
        return subprocess.run([sys.executable, "-c", code, *args], stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout, env=env, cwd=cwd, text=text)
    done = server.run(["-c", *args], input=None, env=env, timeout=timeout, cwd=None if cwd is None else str(cwd),
                      code=code)
    if text:
        done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    return done


def popen_python(code: str, *args: str, env: dict[str, str], **streams) -> subprocess.Popen:
    """``subprocess.Popen([python, "-c", code, *args], env=env, **streams)``, forked where
    ``run_cli`` would fork."""
    server = fork_server()
    if server is None or needs_own_start(env, server.env):
        return subprocess.Popen([sys.executable, "-c", code, *args], env=env, **streams)
    return server.popen(["-c", *args], env=env, code=code, **streams)


def _limits(terminal: bool = False, address_space: int | None = None):
    """What a run started as installed does before it starts: as the fork server's child does."""
    if not terminal and address_space is None:
        return None

    def limit() -> None:
        if terminal:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        if address_space is not None:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    return limit


def spawn_cli(args: list[str], env: dict[str, str], address_space: int | None = None, **spawn) -> pexpect.spawn:
    """``pexpect.spawn`` of the command with ``args``, forked where ``run_cli`` would fork it
    (``address_space``: its ``RLIMIT_AS`` in bytes)."""
    command = llama_chat_command()
    server = fork_server()
    if server is None or needs_own_start(env, server.env) or "preexec_fn" in spawn:
        spawn.setdefault("preexec_fn", _limits(address_space=address_space))
        return pexpect.spawn(command[0], [*command[1:], *args], env=env, **spawn)
    return forked_spawn(server, address_space)(command[0], [*command[1:], *args], env=env, **spawn)


def fork_server() -> ForkServer | None:
    """This worker's fork server, started on first use; None where forks are off."""
    if os.environ.get(FORKS_ENV, "1") == "0":
        return None
    if not _fork_server:
        _fork_server.append(ForkServer(cli_env()))
        atexit.register(_fork_server[0].close)
    return _fork_server[0]


def json_result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


def full_pipe() -> tuple[int, int, int]:
    """A pipe already full of filler: ``(read_fd, write_fd, filler_bytes)``.

    Given as the command's stdout, it blocks the command's first write of generated text, and
    with it the event loop, until the test reads; signals sent meanwhile wait in the event loop's
    wake-up channel, in order, and are handled when it runs again.
    """
    read_fd, write_fd = os.pipe()
    flags = fcntl.fcntl(write_fd, fcntl.F_GETFL)
    fcntl.fcntl(write_fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    filled = 0
    for size in (4096, 1):  # pages first, then the last bytes one by one
        while True:
            try:
                filled += os.write(write_fd, b"#" * size)
            except BlockingIOError:
                break
    fcntl.fcntl(write_fd, fcntl.F_SETFL, flags)
    return read_fd, write_fd, filled


def finish(proc: subprocess.Popen, read_fd: int, filled: int) -> tuple[bytes, bytes]:
    """Read stdout to its end (unblocking the command), wait for the exit; ``(text, stderr)``."""
    chunks = []
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        assert time.monotonic() < deadline, "stdout did not end in time"
        ready, _, _ = select.select([read_fd], [], [], 0.5)
        if ready:
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    os.close(read_fd)
    err = proc.stderr.read()
    proc.stderr.close()
    proc.wait(timeout=RUN_TIMEOUT_S)
    out = b"".join(chunks)
    assert out[:filled] == b"#" * filled
    return out[filled:], err

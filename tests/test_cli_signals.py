"""Stopping the ``llama-chat`` process: SIGINT, SIGTERM, a closed pipe, and a real terminal."""

from __future__ import annotations

import fcntl
import os
import select
import signal
import struct
import subprocess
import termios
import time

import anyio
import pytest

from cli_support import ANSI, build_tiny_model, cli_env, json_result, llama_chat_command, run_cli
from llama_chat.cmd import signals as cli_signals
from llama_chat.cmd.sanitize import displayable

# Long enough that a signal sent after the first bytes always lands mid-generation: the tiny model
# makes 1000 to 1500 tokens/s here (well under 100 with busy-waiting OpenMP helpers on a shared CPU).
LONG = ("-t", "0", "-n", "1000", "-p", "Once upon a time")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("cli_signals"))


@pytest.fixture(scope="module")
def greedy_text(tiny) -> str:
    return json_result(run_cli("-m", str(tiny.path), *LONG, "--json"))["text"]


def start(tiny, *args: str, **popen) -> subprocess.Popen:
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    popen.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen([*llama_chat_command(), "-m", str(tiny.path), *args], env=cli_env(), **popen)


def read_some(fd: int, timeout: float = 60) -> bytes:
    ready, _, _ = select.select([fd], [], [], timeout)
    assert ready, "no output in time"
    return os.read(fd, 65536)


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_after_first_output_stops_quickly_and_keeps_the_text(tiny, greedy_text, signum, status):
    proc = start(tiny, *LONG)
    first = read_some(proc.stdout.fileno())
    proc.send_signal(signum)
    sent = time.monotonic()
    rest, err = proc.communicate(timeout=10)
    elapsed = time.monotonic() - sent
    assert proc.returncode == status, err.decode()
    assert elapsed < 2.0
    out = (first + rest).decode()
    # Everything written is the start of the uninterrupted answer, and generation really stopped.
    assert out and displayable(greedy_text).startswith(out) and len(out) < len(displayable(greedy_text))
    assert b"finish: cancelled" in err and b"Traceback" not in err and b"Exception" not in err


def test_second_sigint_exits_at_once(tiny):
    proc = start(tiny, *LONG)
    read_some(proc.stdout.fileno())
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 130 and b"Traceback" not in err


def test_sigint_before_generation_starts(tiny):
    # Lands while torch is imported or the model loaded: same status, no traceback.
    proc = start(tiny, *LONG)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err and b"cancelled" in err


def test_closed_stdout_stops_quietly(tiny):
    proc = start(tiny, *LONG)
    head = subprocess.Popen(["head", "-c", "20"], stdin=proc.stdout, stdout=subprocess.PIPE)
    proc.stdout.close()  # only head holds the pipe now
    head_out, _ = head.communicate(timeout=60)
    err = proc.stderr.read()
    proc.wait(timeout=10)
    proc.stderr.close()
    assert len(head_out) == 20
    assert proc.returncode == 141 and err == b""


def _pty_run(tiny, *args: str, interrupt_after_output: bool = False, **env: str) -> tuple[int, bytes]:
    """Run with stdout and stderr on a 160-column pseudo-terminal; return (status, everything shown)."""
    primary, secondary = os.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen([*llama_chat_command(), "-m", str(tiny.path), *args], stdin=subprocess.DEVNULL,
                            stdout=secondary, stderr=secondary, env=cli_env(TERM="xterm-256color", **env))
    os.close(secondary)
    shown = b""
    interrupted = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([primary], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: the last writer closed the terminal
                break
            if not chunk:
                break
            shown += chunk
            if interrupt_after_output and not interrupted and ANSI.sub(b"", chunk).strip():
                proc.send_signal(signal.SIGINT)
                interrupted = True
        elif proc.poll() is not None:
            break
    os.close(primary)
    return proc.wait(timeout=10), shown


def _terminal_restored(shown: bytes) -> bool:
    hidden = shown.rfind(b"\x1b[?25l")
    return hidden < 0 or shown.rfind(b"\x1b[?25h") > hidden


def test_live_rendering_on_a_terminal_finishes_cleanly(tiny):
    n = 40
    expected = json_result(run_cli("-m", str(tiny.path), "-t", "0", "-n", str(n), "-p", "Once", "--json"))["text"]
    status, shown = _pty_run(tiny, "-t", "0", "-n", str(n), "-p", "Once")
    assert status == 0, shown.decode(errors="replace")
    assert _terminal_restored(shown) and b"Traceback" not in shown
    text = ANSI.sub(b"", shown).decode(errors="replace").replace("\r", "")
    # Markers were drawn and erased with backspaces; what remains on screen is the answer.
    screen = _apply_backspaces(text)
    assert "".join(displayable(expected).split()) in "".join(screen.split())
    assert "finish: max_tokens" in screen


def test_sigint_on_a_terminal_restores_it(tiny):
    status, shown = _pty_run(tiny, *LONG, interrupt_after_output=True)
    assert status == 130
    assert _terminal_restored(shown) and b"Traceback" not in shown and b"finish: cancelled" in ANSI.sub(b"", shown)


def _apply_backspaces(text: str) -> str:
    out: list[str] = []
    for ch in text:
        if ch == "\b":
            if out:
                out.pop()
        else:
            out.append(ch)
    return "".join(out)


def test_no_color_on_a_terminal_writes_no_escape_sequence(tiny):
    status, shown = _pty_run(tiny, "-t", "0", "-n", "20", "-p", "Once", "--stats", NO_COLOR="1")
    assert status == 0 and b"\x1b" not in shown and b"finish: max_tokens" in shown


def test_watcher_first_signal_cancels_and_a_second_exits(monkeypatch):
    exits = []
    monkeypatch.setattr(cli_signals, "hard_exit", exits.append)
    stop = cli_signals.StopRequest()
    seen = {}

    async def main():
        async with anyio.create_task_group() as tg:
            generation = anyio.CancelScope()
            await tg.start(cli_signals.watch_signals, generation, stop)
            with generation:
                os.kill(os.getpid(), signal.SIGINT)
                await anyio.sleep(10)
            seen["cancelled"] = generation.cancelled_caught
            os.kill(os.getpid(), signal.SIGTERM)  # the watcher still listens while unwinding
            with anyio.move_on_after(5):
                while not exits:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert seen["cancelled"] and stop.signum == signal.SIGINT and exits == [signal.SIGTERM]

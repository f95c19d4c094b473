"""Stopping the ``llama-chat`` process: SIGINT, SIGTERM, a closed pipe, and a real terminal."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path

import anyio
import pytest

from cli_support import (ANSI, build_tiny_model, cli_env, finish, full_pipe, json_result, llama_chat_command, popen_cli,
                         run_cli)
from forkserver import FORKS_ENV
from llama_chat.cmd import signals as cli_signals
from llama_chat.cmd.batch import READ_AHEAD
from llama_chat.cmd.sanitize import displayable
from serve_support import start_server, stop_server
from thread_masks import blocked_signals, threads_taking_signals

LONG = ("-t", "0", "-n", "1000", "-p", "Once upon a time")
# How long a test waits for something that must happen, on however busy a machine. No test here
# asserts that anything happened within a short time: where timing matters, the process is held at
# a known point (a full stdout pipe, a stdin not yet closed) until the test has done its part.
WAIT_S = 60.0


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
    env = cli_env(**popen.pop("env", {}))
    return popen_cli([*llama_chat_command(), "-m", str(tiny.path), *args], env, **popen)


def read_some(fd: int, timeout: float = WAIT_S) -> bytes:
    ready, _, _ = select.select([fd], [], [], timeout)
    assert ready, "no output in time"
    return os.read(fd, 65536)


def wait_until(condition, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.002)


# What the tests below observe of the process, from Linux's /proc.
needs_proc = pytest.mark.skipif(not Path("/proc/self/wchan").exists(), reason="needs Linux /proc")


def blocked_writing_a_pipe(proc: subprocess.Popen) -> bool:
    """Whether the main thread (which runs the event loop and writes the text) is blocked in
    write(2) on a full pipe; the kernel function is pipe_write, or anon_pipe_write since 6.x."""
    assert proc.poll() is None, "the process ended early"
    try:
        return "pipe_write" in Path(f"/proc/{proc.pid}/wchan").read_text()
    except OSError:
        return False


def signal_pending(proc: subprocess.Popen, signum: int) -> bool:
    """Whether ``signum`` is sent but not yet taken by any thread of the process.

    Two signals of one kind sent before the first is taken are one signal, so a test that means to
    send two waits for the first to be taken.
    """
    status = Path(f"/proc/{proc.pid}/status").read_text()
    pending = 0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            pending |= int(line.split()[1], 16)
    return bool(pending & (1 << (signum - 1)))


def start_blocked_on_output(tiny, *args: str, **popen) -> tuple[subprocess.Popen, int, int]:
    """Start the command on a full stdout pipe and wait until it is blocked writing its first
    text; returns ``(process, read_fd, filler_bytes)``."""
    read_fd, write_fd, filled = full_pipe()
    proc = start(tiny, *args, stdout=write_fd, **popen)
    os.close(write_fd)
    wait_until(lambda: blocked_writing_a_pipe(proc), "the command is blocked writing its first text")
    return proc, read_fd, filled


def send_and_wait_taken(proc: subprocess.Popen, signum: int) -> None:
    proc.send_signal(signum)
    wait_until(lambda: not signal_pending(proc, signum), "the process took the signal")


@needs_proc
@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_after_first_output_stops_quickly_and_keeps_the_text(tiny, greedy_text, signum, status):
    # The signal is taken while the first text is being written: provably mid-generation.
    # "Quickly" is counted in tokens, not seconds: what follows the signal is what was already on
    # its way (the channel's few buffered tokens), never the rest of the 1000-token answer.
    proc, read_fd, filled = start_blocked_on_output(tiny, *LONG)
    send_and_wait_taken(proc, signum)
    out, err = finish(proc, read_fd, filled)
    assert proc.returncode == status, err.decode()
    text, full = out.decode(), displayable(greedy_text)
    # Everything written is the start of the uninterrupted answer (its line ended, as any answer
    # to a pipe), and generation really stopped.
    assert text.endswith("\n") and full.startswith(text[:-1]) and len(text) < len(full) // 4
    assert b"finish: cancelled" in err and b"Traceback" not in err and b"Exception" not in err
    # One signal: a graceful stop, with the summary (a greedy run's names no seed; see the test below).
    assert err.strip().endswith(b"finish: cancelled") and b"second signal" not in err


@needs_proc
def test_second_sigint_exits_at_once(tiny):
    # Both signals are taken while the event loop is blocked on output, so both reach the watcher
    # while generation is still running: the first starts a graceful stop, the second exits.
    proc, read_fd, filled = start_blocked_on_output(tiny, *LONG)
    send_and_wait_taken(proc, signal.SIGINT)
    send_and_wait_taken(proc, signal.SIGINT)
    _, err = finish(proc, read_fd, filled)
    assert proc.returncode == 130, err.decode()
    # One signal ends with the summary (the test above); two exit at once, with no summary.
    assert err.strip().endswith(b"finish: cancelled (second signal, exiting now)"), err.decode()
    assert err.count(b"finish:") == 1 and b"Traceback" not in err


@needs_proc
@pytest.mark.parametrize("batch", [False, True], ids=["one-shot", "batch"])
def test_only_the_main_thread_takes_signals(tiny, batch):
    """Every other thread (the step thread, anyio's stdin reader, torch's helpers) blocks the
    signals the main thread acts on (inference/thread_signals.py). Looked at while the command is
    held writing its first text to a full pipe, with the batch reader waiting on an open stdin."""
    real_start = {FORKS_ENV: "0"}  # never forked: what its imports start is looked at too
    if batch:
        read_fd, write_fd, filled = full_pipe()
        proc = start(tiny, "--batch", "-t", "0", "-n", "40", stdin=subprocess.PIPE, stdout=write_fd, env=real_start)
        os.close(write_fd)
        # More jobs than one trip of the reader takes: it takes the rest, then waits for more.
        proc.stdin.write(b'{"prompt": "Once upon a time"}\n' * (READ_AHEAD + 2))
        proc.stdin.flush()
        wait_until(lambda: blocked_writing_a_pipe(proc), "the command is blocked writing its first result")
    else:
        proc, read_fd, filled = start_blocked_on_output(tiny, *LONG, env=real_start)
    assert len(blocked_signals(proc.pid)) >= 2  # the main thread and the step thread at least
    assert threads_taking_signals(proc.pid) == []
    send_and_wait_taken(proc, signal.SIGINT)
    if batch:
        proc.stdin.close()
    _, err = finish(proc, read_fd, filled)
    assert proc.returncode == 130, err.decode()


@needs_proc
def test_only_the_main_thread_takes_signals_in_the_server(tiny):
    """The same in ``llama-chat serve``, whose model is loaded in one of anyio's threads, after a
    request; SIGTERM then still drains and ends it with status 0. Started as the installed command
    starts, never forked: what is checked is also what its imports start."""
    server = start_server(tiny.path, **{FORKS_ENV: "0"})
    try:
        reply = server.client().completions.create(model="tiny", prompt="Once upon a time", max_tokens=8)
        assert reply.choices[0].text
        assert len(blocked_signals(server.proc.pid)) >= 2
        assert threads_taking_signals(server.proc.pid) == []
    finally:
        status = stop_server(server)
    assert status == 0 and "stopped" in server.log(), server.log()


def test_sigint_before_generation_starts(tiny):
    # The prompt comes partly from stdin, which the command reads whole before it imports torch or
    # loads the model; while the test holds stdin open, generation cannot start. The signal is sent
    # once the command has taken the first stdin byte, so it is reading input, past start-up.
    proc = start(tiny, *LONG, stdin=subprocess.PIPE)
    proc.stdin.write(b"x")
    proc.stdin.flush()
    wait_until(lambda: _unread_bytes(proc.stdin.fileno()) == 0, "the command is reading stdin")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=WAIT_S)  # closes stdin only now
    assert proc.returncode == 130, err.decode()
    # Nothing was generated: no text, and no summary of a generation (which names its seed).
    assert out == b"" and err.strip() == b"finish: cancelled", err.decode()


def _unread_bytes(fd: int) -> int:
    """Bytes written to a pipe and not yet read from it (FIONREAD works on either end)."""
    buf = bytearray(struct.pack("i", 0))
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return struct.unpack("i", buf)[0]


def test_closed_stdout_stops_quietly(tiny):
    proc = start(tiny, *LONG)
    head = subprocess.Popen(["head", "-c", "20"], stdin=proc.stdout, stdout=subprocess.PIPE)
    proc.stdout.close()  # only head holds the pipe now
    head_out, _ = head.communicate(timeout=WAIT_S)
    err = proc.stderr.read()
    proc.wait(timeout=WAIT_S)
    proc.stderr.close()
    assert len(head_out) == 20
    assert proc.returncode == 141 and err == b""


def _pty_run(tiny, *args: str, interrupt_after_output: bool = False, **env: str) -> tuple[int, bytes]:
    """Run with stdout and stderr on a 160-column pseudo-terminal; return (status, everything shown)."""
    primary, secondary = os.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = popen_cli([*llama_chat_command(), "-m", str(tiny.path), *args], cli_env(TERM="xterm-256color", **env),
                     stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary)
    os.close(secondary)
    shown = b""
    interrupted = False
    deadline = time.monotonic() + WAIT_S
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
    return proc.wait(timeout=WAIT_S), shown


def _terminal_restored(shown: bytes) -> bool:
    hidden = shown.rfind(b"\x1b[?25l")
    return hidden < 0 or shown.rfind(b"\x1b[?25h") > hidden


def test_live_rendering_on_a_terminal_finishes_cleanly(tiny):
    n = 40
    expected = json_result(run_cli("-m", str(tiny.path), "-t", "0", "-n", str(n), "-p", "Once", "--json"))["text"]
    status, shown = _pty_run(tiny, "-t", "0", "-n", str(n), "-p", "Once")
    assert status == 0, shown.decode(errors="replace")
    assert _terminal_restored(shown) and b"Traceback" not in shown
    # Markers were drawn and erased; what remains on screen is the answer.
    screen = _screen(shown)
    assert "".join(displayable(expected).split()) in "".join(screen.split())
    assert "finish: max_tokens" in screen


def test_sigint_on_a_terminal_restores_it(tiny):
    status, shown = _pty_run(tiny, *LONG, interrupt_after_output=True)
    assert status == 130
    assert _terminal_restored(shown) and b"Traceback" not in shown and b"finish: cancelled" in ANSI.sub(b"", shown)


_SCREEN_TOKENS = re.compile(r"\x1b7|\x1b8|\x1b[\[\]()#;?]*[0-9;?]*[A-Za-z]|.", re.DOTALL)


def _screen(shown: bytes) -> str:
    """What a terminal shows after ``shown``, for what the live renderer writes: text, backspaces
    (markers erased without colour), and save cursor / restore cursor + erase to the end of the
    line (markers erased with colour; they never wrap, so restoring drops all written since)."""
    out: list[str] = []
    saved = None
    for token in _SCREEN_TOKENS.findall(shown.decode(errors="replace").replace("\r", "")):
        if token == "\x1b7":
            saved = len(out)
        elif token == "\x1b8":
            if saved is not None:
                del out[saved:]
        elif token.startswith("\x1b"):
            continue  # colours, cursor shown or hidden, erase line: nothing to keep
        elif token == "\b":
            if out:
                out.pop()
        else:
            out.append(token)
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
                await anyio.sleep(WAIT_S)
            seen["cancelled"] = generation.cancelled_caught
            os.kill(os.getpid(), signal.SIGTERM)  # the watcher still listens while unwinding
            with anyio.move_on_after(WAIT_S):
                while not exits:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert seen["cancelled"] and stop.signum == signal.SIGINT and exits == [signal.SIGTERM]

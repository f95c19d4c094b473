"""The installed command against terminals, signals and odd stdio: what the user is left with.

Terminal cases run on a pseudo-terminal that is the process's controlling terminal, so Ctrl+C and
Ctrl+Z are typed (the line discipline echoes ``^C`` and sends the signal), as a user would.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cli_support import build_tiny_model, cli_env, finish, full_pipe, llama_chat_command, popen_cli, run_cli
from llama_chat.cmd.sanitize import displayable, one_line
from terminal_support import SGR, WAIT_S, Pty, held_bytes_model, screen

LONG = ("-t", "0", "-n", "1000", "-p", "Once upon a time")


@pytest.fixture(scope="module")
def held(tmp_path_factory, sp_model_path) -> Path:
    return held_bytes_model(tmp_path_factory.mktemp("held") / "model", sp_model_path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("terminal"))


def test_ctrl_c_while_bytes_are_held_leaves_exactly_the_committed_text(held):
    term = Pty("-m", str(held), "-p", "hi", "-t", "0", "-c", "0")
    term.read_until(lambda: "é".encode() in term.shown and term.shown.count(b".") >= 3)
    term.type(b"\x03")
    status = term.finish()
    lines, cursor_visible = screen(term.shown)
    assert status == 130, term.shown
    assert lines[0] == "é", lines  # no markers, no ^C, no U+FFFD for the cut-off cat
    assert lines[1].startswith("finish: cancelled") and cursor_visible
    assert b"Traceback" not in term.shown


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_ctrl_z_shows_the_cursor_and_fg_hides_it_again(held):
    term = Pty("-m", str(held), "-p", "hi", "-t", "0", "-c", "0")
    term.read_until(lambda: b"\x1b[?25l" in term.shown and "é".encode() in term.shown)
    term.type(b"\x1a")
    deadline = time.monotonic() + WAIT_S
    while _state(term.proc.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(term.proc.pid) == "T"
    term.read_until(lambda: term.shown.rfind(b"\x1b[?25h") > term.shown.rfind(b"\x1b[?25l"))
    _, visible_while_stopped = screen(term.shown)
    assert visible_while_stopped
    stopped_at = len(term.shown)
    os.kill(term.proc.pid, signal.SIGCONT)  # what the shell's `fg` sends
    term.read_until(lambda: b"\x1b[?25l" in term.shown[stopped_at:])
    term.type(b"\x03")
    status = term.finish()
    _, visible = screen(term.shown)
    assert status == 130 and visible


@pytest.mark.parametrize("signum, status", [(signal.SIGHUP, 129), (signal.SIGQUIT, 131)])
def test_sighup_and_sigquit_restore_the_cursor(held, signum, status):
    term = Pty("-m", str(held), "-p", "hi", "-t", "0", "-c", "0")
    term.read_until(lambda: b"\x1b[?25l" in term.shown and "é".encode() in term.shown)
    term.proc.send_signal(signum)
    assert term.finish() == status
    _, visible = screen(term.shown)
    assert visible and b"Traceback" not in term.shown


def test_sigint_at_any_moment_of_start_up_gives_130_and_no_traceback(tiny):
    def run(delay: float) -> tuple[float, int, bytes]:
        # Onto a full pipe the run cannot write its first text, so however fast this machine it is
        # still starting (or about to show that text) when the signal lands, never finished.
        read_fd, write_fd, filled = full_pipe()
        started = time.monotonic()
        proc = subprocess.Popen([*_real_command(), "-m", str(tiny.path), *LONG], stdin=subprocess.DEVNULL,
                                stdout=write_fd, stderr=subprocess.PIPE, env=cli_env())
        os.close(write_fd)
        time.sleep(delay)
        assert proc.poll() is None, (delay, proc.returncode, proc.stderr.read())
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic() - started
        out, err = finish(proc, read_fd, filled)
        # When the signal really went, and how much text came after it: where a failure landed.
        seen = f"signal at {sent:.2f} s, exit at {time.monotonic() - started:.2f} s, {len(out)} bytes after it"
        return delay, proc.returncode, err + seen.encode()

    # While the interpreter is still starting (its site module and .pth files: 0.1-0.2 s on a
    # quiet machine, longer on a loaded one) a Ctrl+C is Python's own business and ends in
    # "Fatal Python error: init_import_site". From the command module's first line on, it is ours:
    # every signal that lands there is checked, and the later delays always land there.
    delays = [0.3, 0.45, 0.6, 0.75, 0.9, 2.0]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, delays))
    ours = [(delay, status, err) for delay, status, err in results if b"init_import_site" not in err]
    assert [delay for delay, _, _ in ours][-1:] == [2.0], results
    for delay, status, err in ours:
        # -SIGINT: the signal came before Python had set up its own handler (the default killed it).
        assert status in (130, -signal.SIGINT), (delay, status, err)
        assert b"Traceback" not in err and b"Error" not in err, (delay, err)


def _real_command() -> list[str]:
    """The entry point itself, not a version manager's shell shim (which reports its own status
    when stderr is closed)."""
    cmd = llama_chat_command()
    real = Path(os.__file__).parents[2] / "bin" / "llama-chat"
    if cmd and cmd[0].endswith("llama-chat") and real.is_file():
        return [str(real)]
    return cmd


def _run_closing(fd: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_real_command(), *args], stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=WAIT_S, env=cli_env(), preexec_fn=lambda: os.close(fd))


def test_stdout_closed_is_one_line_and_exit_2(tiny):
    proc = _run_closing(1, "-m", str(tiny.path), "-p", "hi", "-n", "3")
    assert proc.returncode == 2
    assert proc.stderr.decode().strip() == ("llama-chat: error: standard output is closed: "
                                            "there is nowhere to write the answer")


def test_stderr_closed_still_succeeds(tiny):
    proc = _run_closing(2, "-m", str(tiny.path), "-p", "hi", "-n", "3", "-t", "0")
    assert proc.returncode == 0 and proc.stdout


def _forked(args: list[str], **streams) -> subprocess.CompletedProcess:
    """A run to its end with the given stdio (``stdout``: a pipe unless given)."""
    streams.setdefault("stdout", subprocess.PIPE)
    proc = popen_cli([*llama_chat_command(), *args], cli_env(), **streams)
    out, err = proc.communicate(timeout=WAIT_S)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def test_finish_line_starts_on_a_fresh_line_when_stdout_is_piped(tiny):
    primary, secondary = os.openpty()
    proc = _forked(["-m", str(tiny.path), "-p", "hi", "-n", "5", "-t", "0"], stdin=subprocess.DEVNULL,
                   stderr=secondary)
    os.close(secondary)
    err = b""
    while select.select([primary], [], [], 0.5)[0]:
        try:
            chunk = os.read(primary, 65536)
        except OSError:
            break
        if not chunk:
            break
        err += chunk
    os.close(primary)
    # The answer ends its own line, so the summary on the terminal needs no blank line before it.
    assert proc.returncode == 0 and proc.stdout.endswith(b"\n") and not proc.stdout.endswith(b"\n\n")
    assert SGR.sub(b"", err).startswith(b"finish: max_tokens")


def test_reader_leaving_before_any_output_stops_quietly(tiny):
    long_prompt = " ".join(["Once upon a time"] * 200)
    proc = popen_cli([*llama_chat_command(), "-m", str(tiny.path), "-t", "0", "-p", long_prompt], cli_env(),
                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before anything was written
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 141 and err == b""


def test_no_stdin_and_file_options(tiny, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon a time\n")
    base = ["-m", str(tiny.path), "-n", "3", "-t", "0", "--json"]
    # A pipe that never closes: without --no-stdin the run would wait for it for ever.
    waiting = subprocess.Popen(["sleep", "120"], stdout=subprocess.PIPE)
    try:
        proc = _forked([*base, "-p", "Once upon a time", "--no-stdin"], stdin=waiting.stdout, stderr=subprocess.PIPE)
        from_file = _forked([*base, "-f", str(prompt)], stdin=waiting.stdout, stderr=subprocess.PIPE)
    finally:
        waiting.kill()
        waiting.wait()
    from_stdin = run_cli(*base, "-f", "-", stdin=b"Once upon a time\n", timeout=WAIT_S)
    assert proc.returncode == from_file.returncode == from_stdin.returncode == 0, proc.stderr
    texts = [json.loads(p.stdout)["text"] for p in (proc, from_file, from_stdin)]
    assert texts[0] == texts[1] == texts[2]
    missing = run_cli(*base, "-f", str(tmp_path / "nope"), timeout=WAIT_S)
    assert missing.returncode == 2 and missing.stderr.decode().count("\n") == 1
    assert "cannot read it" in missing.stderr.decode()


def test_ctx_size_limits_the_context(tiny):
    proc = run_cli("-m", str(tiny.path), "-c", "8", "-p",
                   "Once upon a time there was a little fox who lived in the forest", timeout=WAIT_S)
    assert proc.returncode == 2 and b"the context holds 8" in proc.stderr


def test_usage_errors_are_one_line_with_a_hint():
    for args in (["--top-p", "0"], ["--bogus"], ["-n", "0"], ["--dtype", "float8"], ["-c", "-1"]):
        proc = run_cli(*args, timeout=WAIT_S)
        lines = proc.stderr.decode().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (args, lines)
        assert lines[0].startswith("llama-chat: error: ") and lines[0].endswith("(see llama-chat --help)")


def test_help_states_each_range_once():
    helped = run_cli("--help", timeout=WAIT_S, COLUMNS="200").stdout.decode()
    assert "0 < p <= 1" in helped and "<=x<=" not in helped and "x>=" not in helped
    for option in ("--ctx-size", "--file", "--no-stdin"):
        assert option in helped


def test_c1_controls_and_bidi_overrides_are_shown():
    assert displayable("a\x9b31mb") == "a<U+009B>31mb"
    assert displayable("\u202eevil\u202c") == "<U+202E>evil<U+202C>"
    assert displayable("x\x1b[2J\ty\n") == "x\u241b[2J\ty\n"
    assert displayable("family \U0001F468\u200d\U0001F469") == "family \U0001F468\u200d\U0001F469"
    assert one_line("two\nlines\x07") == "two\u240alines\u2407"

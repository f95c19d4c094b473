"""Runs of the command forked from a process that has imported it once.

Every run of ``llama-chat`` starts an interpreter and imports torch and the command before it
reads its first option: about two seconds of a core each, and the suite runs the command a few
hundred times. A fork server pays for those imports once per test worker. It imports them,
then waits on a Unix socket; for each run it is sent the run's argv, environment, working
directory and three file descriptors (stdin, stdout, stderr), forks, and the child runs the
command's ``main`` as the installed script would, in a process of its own: its own pid, pipes,
exit status and signals (and its peak resident set, which the server reads as it reaps it). A run
may also be a Python script (``python -c``) instead of the command. What the fork skips is the interpreter's start and the imports, so a
run is sent here only where its environment differs from the server's in nothing that start-up
reads (``needs_own_start``); tests of the start itself, of terminals, of signals during a run and
of servers start the installed command as before.

The server's side: ``python tests/forkserver.py SOCKET``. The tests' side: ``ForkServer``.
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

# LLAMA_CHAT_TEST_FORKS=0: no run is forked; in one run's environment, that run is not.
FORKS_ENV = "LLAMA_CHAT_TEST_FORKS"
# What the interpreter, OpenMP or torch read once, at start or at import: a run whose
# environment sets one of these to another value than the server's starts on its own.
# (The terminal's variables, TERM, NO_COLOR, COLUMNS and LINES, are read as the command runs.)
START_UP_PREFIXES = ("PYTHON", "LC_", "LANG", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH", "CUDA",
                     "LD_", "MALLOC_")
# Of those, read again at each use: the compile cache's folder, which the tests' own process sets
# once it compiles (inference/decode_step.py).
READ_AT_USE = {"TORCHINDUCTOR_CACHE_DIR"}
_PID = struct.Struct("!q")
_EXIT = struct.Struct("!qq")  # the exit status, and the peak resident set in KiB (``ru_maxrss``)
_MAX_REQUEST = 1 << 20


def needs_own_start(env: dict[str, str], server_env: dict[str, str]) -> bool:
    """Whether a run in ``env`` must start as the installed command starts: something start-up
    reads differs from the server's, or the run asks for it (``FORKS_ENV=0``, for a test of what
    happens while the command starts)."""
    if env.get(FORKS_ENV) == "0":
        return True
    keys = set(env) | set(server_env)
    return any(env.get(k) != server_env.get(k) for k in keys - READ_AT_USE if k.startswith(START_UP_PREFIXES))


# -- the server ----------------------------------------------------------------------------------


def serve(path: str) -> None:
    # What every run imports before its first option is read.
    import torch  # noqa: F401

    import llama_chat.cmd.app  # noqa: F401
    import llama_chat.cmd.main

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)  # the tests' end: closed when they are done
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is sys.stdin:
                if not os.read(sys.stdin.fileno(), 4096):
                    for pid in children:
                        _kill(pid)
                    return
            elif key.fileobj is listener:
                connection, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(connection, _MAX_REQUEST, 3)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    for fd in (listener.fileno(), connection.fileno(), wake_read, wake_write):
                        os.close(fd)
                    _run(json.loads(message), fds, llama_chat.cmd.main.main)
                for fd in fds:
                    os.close(fd)
                children[pid] = connection
                _send(connection, _PID.pack(pid))
            else:
                os.read(wake_read, 4096)
                while children:
                    pid, status, usage = os.wait4(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    connection = children.pop(pid, None)
                    if connection is not None:
                        with connection:
                            _send(connection, _EXIT.pack(os.waitstatus_to_exitcode(status), usage.ru_maxrss))


def _send(connection: socket.socket, message: bytes) -> None:
    """A pid or an exit to the test that asked; one that went away (a test that failed before it
    waited) does not end the server."""
    try:
        connection.sendall(message)
    except OSError:
        pass


def _run(request: dict, fds: list[int], main) -> None:
    """The child: the run's descriptors, environment and arguments, then the command's main, as
    the installed script calls it, or the request's Python script, as ``python -c`` runs it. Never
    returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if request.get("terminal"):
            os.setsid()  # a session of its own, whose controlling terminal its stdin becomes
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        if request.get("terminal"):
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        # As the interpreter sets it at start: line by line to a terminal, in blocks otherwise.
        sys.stdout.reconfigure(line_buffering=os.isatty(1))
        if request.get("address_space"):  # as a start under ``preexec_fn=setrlimit`` would have it
            resource.setrlimit(resource.RLIMIT_AS, (request["address_space"],) * 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = request["argv"]
        try:
            if request.get("code") is not None:
                exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
            else:
                main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _kill(pid: int, signum: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


# -- the tests' side -----------------------------------------------------------------------------


class ForkServer:
    """One server for this test worker, started on first use with ``env`` (the command's
    environment, as ``cli_env`` makes it) and ended with the worker."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self._folder = tempfile.TemporaryDirectory(prefix="llama-chat-forks-")
        self.path = str(Path(self._folder.name) / "socket")
        self._process = subprocess.Popen([sys.executable, __file__, self.path], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env=self.env)
        if self._process.stdout.readline().strip() != b"ready":
            raise RuntimeError("the fork server did not start")

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=60)
        self._folder.cleanup()

    def run(self, argv: list[str], *, input: bytes | None, env: dict[str, str], timeout: float,
            cwd: str | None = None, address_space: int | None = None, code: str | None = None
            ) -> subprocess.CompletedProcess:
        """``subprocess.run(argv, input=input, capture_output=True, ...)``, forked; the
        ``CompletedProcess`` also has the run's ``max_rss``."""
        proc = self.popen(argv, env=env, stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, address_space=address_space,
                          code=code)
        try:
            out, err = proc.communicate(input, timeout)
        except subprocess.TimeoutExpired as e:
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired(argv, timeout, e.output, e.stderr) from None
        done = subprocess.CompletedProcess(argv, proc.returncode, out, err)
        done.max_rss = proc.max_rss
        return done

    def popen(self, argv: list[str], *, env: dict[str, str], stdin=None, stdout=None, stderr=None,
              cwd: str | None = None, terminal: bool = False, address_space: int | None = None,
              code: str | None = None) -> ForkedProcess:
        """A forked run with ``subprocess.Popen``'s face for what the tests use of it; each of the
        three streams is ``subprocess.PIPE`` (a pipe, as the attribute of that name),
        ``subprocess.DEVNULL``, a descriptor or a file, or None (this process's own). ``terminal``:
        stdin is a terminal, which becomes the run's controlling terminal, in a session of its own.
        ``address_space``: the run's ``RLIMIT_AS``, in bytes. ``code``: a Python script the child
        runs instead of the command (``argv`` is then its ``sys.argv``)."""
        ends, theirs = {}, []
        for name, how, fd, reading in (("stdin", stdin, 0, False), ("stdout", stdout, 1, True),
                                       ("stderr", stderr, 2, True)):
            if how == subprocess.PIPE:
                read, write = os.pipe()
                ours, child = (read, write) if reading else (write, read)
                ends[name] = open(ours, "rb" if reading else "wb")
                theirs.append(child)
            elif how == subprocess.DEVNULL:
                theirs.append(os.open(os.devnull, os.O_RDWR))
            elif how is None:
                theirs.append(os.dup(fd))
            else:  # a descriptor, or a file that has one
                theirs.append(os.dup(how if isinstance(how, int) else how.fileno()))
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(self.path)
            request = json.dumps({"argv": argv, "env": env, "cwd": cwd or os.getcwd(), "terminal": terminal,
                                  "address_space": address_space, "code": code}).encode()
            socket.send_fds(connection, [request], theirs)
            pid = _PID.unpack(_receive(connection, _PID.size, time.monotonic() + 60))[0]
        except BaseException:
            connection.close()
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        return ForkedProcess(argv, pid, connection, **ends)


class ForkedProcess:
    """A forked run as ``subprocess.Popen`` shows one: its pid, its pipes, and its exit status
    (negative: the signal that ended it), which the server sends when it reaps the child, with
    ``max_rss``: the child's peak resident set in bytes, which counts the pages it was forked with
    (the server's: the interpreter, torch and the command imported, as a run started alone has)."""

    def __init__(self, args: list[str], pid: int, connection: socket.socket, stdin=None, stdout=None,
                 stderr=None) -> None:
        self.args, self.pid, self._connection = args, pid, connection
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self.max_rss: int | None = None
        self._received = b""

    def poll(self) -> int | None:
        return self._status(time.monotonic())

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 10 ** 9)
        code = self._status(deadline)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            _kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: bytes | None = None, timeout: float | None = None) -> tuple[bytes | None, bytes | None]:
        """Feed ``input``, read both pipes to their end and wait, as ``Popen.communicate``."""
        captured: dict[str, bytes] = {}

        def drain(name: str) -> None:
            with getattr(self, name) as f:
                captured[name] = b"".join(iter(lambda: f.read1(65536), b""))

        def feed() -> None:
            try:
                with self.stdin as f:
                    f.write(input or b"")
            except BrokenPipeError:
                pass

        # A pipe the test has closed is not read, as with ``Popen.communicate``.
        pipes = {"stdout": self.stdout, "stderr": self.stderr}
        readable = [name for name, pipe in pipes.items() if pipe is not None and not pipe.closed]
        threads = [threading.Thread(target=drain, args=(name,), daemon=True) for name in readable]
        threads += [threading.Thread(target=feed, daemon=True)] if self.stdin is not None else []
        for thread in threads:
            thread.start()
        self.wait(timeout)
        for thread in threads:
            thread.join()
        return captured.get("stdout"), captured.get("stderr")

    def _status(self, deadline: float) -> int | None:
        if self.returncode is not None:
            return self.returncode
        while len(self._received) < _EXIT.size:
            self._connection.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                chunk = self._connection.recv(_EXIT.size - len(self._received))
            except (socket.timeout, BlockingIOError):
                return None
            if not chunk:
                raise RuntimeError("the fork server went away")
            self._received += chunk
        self.returncode, max_rss_kib = _EXIT.unpack(self._received)
        self.max_rss = max_rss_kib * 1024
        self._connection.close()
        return self.returncode


def forked_spawn(server: ForkServer, address_space: int | None = None):
    """``pexpect.spawn`` for runs forked by ``server``: the same object, on a pseudo-terminal that
    is the run's controlling terminal (``address_space``: its ``RLIMIT_AS``)."""
    import pexpect
    import ptyprocess

    class ForkedPty(ptyprocess.PtyProcess):
        def __init__(self, forked: ForkedProcess, fd: int) -> None:
            super().__init__(forked.pid, fd)
            self.forked = forked

        def isalive(self) -> bool:
            return not self.terminated and not self._ended(self.forked.poll())

        def wait(self) -> int | None:
            self._ended(self.forked.wait())
            return self.exitstatus

        def _ended(self, code: int | None) -> bool:
            if code is None:
                return False
            self.terminated = True
            self.exitstatus, self.signalstatus = (code, None) if code >= 0 else (None, -code)
            self.status = code
            return True

    class ForkedSpawn(pexpect.spawn):
        def _spawnpty(self, args, env=None, cwd=None, dimensions=None, echo=True, **_):
            primary, secondary = os.openpty()
            rows, columns = dimensions or (24, 80)
            fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
            if not echo:
                attrs = termios.tcgetattr(secondary)
                attrs[3] &= ~termios.ECHO
                termios.tcsetattr(secondary, termios.TCSANOW, attrs)
            try:
                argv = [a.decode() if isinstance(a, bytes) else a for a in args]
                forked = server.popen(argv, env=dict(env if env is not None else os.environ), stdin=secondary,
                                      stdout=secondary, stderr=secondary, cwd=cwd, terminal=True,
                                      address_space=address_space)
            finally:
                os.close(secondary)
            return ForkedPty(forked, primary)

    return ForkedSpawn


def _receive(connection: socket.socket, size: int, deadline: float) -> bytes:
    data = b""
    while len(data) < size:
        connection.settimeout(max(0.0, deadline - time.monotonic()))
        try:
            chunk = connection.recv(size - len(data))
        except socket.timeout:
            raise TimeoutError from None
        if not chunk:
            raise RuntimeError("the fork server went away")
        data += chunk
    return data


if __name__ == "__main__":
    serve(sys.argv[1])

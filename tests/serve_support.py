"""What the tests of ``llama-chat serve`` and of remote models share: a real server process."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from cli_support import cli_env, llama_chat_command, popen_cli
from forkserver import ForkedProcess

START_S = 240.0  # the process starting, torch imported and the model loaded
WAIT_S = 120.0  # one request, or a condition to come true


@dataclass
class Server:
    proc: subprocess.Popen | ForkedProcess
    url: str
    lines: list[str]  # its stderr so far
    health: list[int] = field(default_factory=list)  # the /health statuses seen while it started
    reader: threading.Thread | None = None  # the thread that reads its stderr into ``lines``

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=WAIT_S)

    def anthropic_client(self):
        """Anthropic's own client. Imported on use: the package takes two seconds of a core to
        import, which every test worker would otherwise spend collecting."""
        import anthropic

        return anthropic.Anthropic(base_url=self.url, api_key="none", max_retries=0, timeout=WAIT_S)

    def metrics(self, api_key: str | None = None) -> dict[str, float]:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        response = httpx.get(f"{self.url}/metrics", headers=headers, timeout=WAIT_S)
        assert response.status_code == 200, response.text
        values = {}
        for line in response.text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def log(self) -> str:
        """Its stderr so far; all of it once it has ended (its last lines may still be in the pipe
        when its exit status is read)."""
        if self.reader is not None and self.proc.poll() is not None:
            self.reader.join(WAIT_S)
        return "\n".join(self.lines)


def wait_for(condition, what: str, timeout: float = WAIT_S, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)


def start_server(model_dir: Path, *args: str, **env: str) -> Server:
    proc = popen_cli([*llama_chat_command(), "serve", "-m", str(model_dir), "--port", "0", "--template", "llama2", *args],
                     cli_env(**env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines: list[str] = []

    def read() -> None:  # always drained, so the server never blocks on a full pipe
        for raw in proc.stderr:
            lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def address() -> str | None:
        assert proc.poll() is None, "\n".join(lines)
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", "\n".join(lines))
        return found and found.group(1)

    server = Server(proc, wait_for(address, "the server to listen", START_S), lines, reader=reader)

    def healthy() -> bool:
        assert proc.poll() is None, server.log()
        try:
            status = httpx.get(f"{server.url}/health", timeout=WAIT_S).status_code
        except httpx.TransportError:
            return False
        server.health.append(status)
        return status == 200

    wait_for(healthy, "the model to load", START_S)
    return server


def stop_server(server: Server) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        raise

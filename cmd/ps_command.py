"""``llama-chat ps`` and ``llama-chat stop NAME``: a running server's loaded models, and one of them
unloaded, as Ollama's commands of the same names do.

``ps`` asks the server's ``/api/ps`` and writes a table (name, size, context, until when an idle
model stays loaded); ``--json`` writes the server's list as it came. ``stop`` asks
``POST /models/unload``: the model goes once its running requests end. The server is
``--url``, else ``--host`` and ``--port`` (those ``serve`` listens on by default). A problem is
one line on stderr: a server that does not answer, a name it does not have.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Any

import typer

from llama_chat.cmd import exit_status
from llama_chat.cmd.sanitize import one_line
from llama_chat.cmd.typer_command import GroupedHelp, command, new_app

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
REQUEST_TIMEOUT_S = 30.0
# A wait for a busy model's requests to end (the server's own bound is 60 s), then the answer.
STOP_TIMEOUT_S = 90.0
SERVER = "Server"


@dataclass(frozen=True)
class ClientOptions:
    url: Annotated[str | None, typer.Option(
        "--url", rich_help_panel=SERVER, metavar="URL",
        help="The server, as http://HOST:PORT (default: --host and --port).")] = None
    host: Annotated[str, typer.Option(
        "--host", rich_help_panel=SERVER, metavar="ADDR", help="The server's address.")] = DEFAULT_HOST
    port: Annotated[int, typer.Option(
        "--port", min=1, max=65535, rich_help_panel=SERVER, help="The server's port.")] = DEFAULT_PORT
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="LLAMA_CHAT_API_KEY", show_envvar=True, rich_help_panel=SERVER, metavar="KEY",
        help="The server's --api-key.")] = None

    def base(self) -> str:
        if self.url is not None:
            return self.url.rstrip("/").removesuffix("/v1")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class PsOptions(ClientOptions):
    json_output: Annotated[bool, typer.Option("--json", help="Write the server's list as JSON.")] = False


@dataclass(frozen=True)
class StopOptions(ClientOptions):
    name: Annotated[str, typer.Argument(metavar="NAME", show_default=False, help="The model to unload.")] = ""


class Refused(Exception):
    """The server could not be asked, or refused; the message is one line."""


def _ask(opts: ClientOptions, method: str, path: str, body: dict[str, Any] | None = None,
         timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    import httpx

    url = opts.base() + path
    if not url.startswith(("http://", "https://")):
        raise Refused(f"--url {opts.url}: expected http://HOST:PORT")
    try:
        response = httpx.request(method, url, json=body, headers=opts.headers(), timeout=timeout_s)
    except httpx.HTTPError as e:
        raise Refused(f"cannot reach the server at {opts.base()} ({one_line(str(e)) or type(e).__name__}); "
                      "is llama-chat serve running there?") from None
    try:
        data = response.json()
    except ValueError:
        data = None
    if response.status_code != 200 or not isinstance(data, dict):
        error = data.get("error") if isinstance(data, dict) else None
        message = error.get("message") if isinstance(error, dict) else error
        raise Refused(f"{opts.base()}: {response.status_code}: {message or response.text[:200] or 'no message'}")
    return data


def run_ps(opts: PsOptions) -> int:
    try:
        models = _ask(opts, "GET", "/api/ps").get("models")
    except Refused as e:
        return _fail(str(e))
    if not isinstance(models, list):
        return _fail(f"{opts.base()}/api/ps: not a list of models")
    if opts.json_output:
        sys.stdout.write(json.dumps(models, ensure_ascii=False) + "\n")
        return exit_status.OK
    now = datetime.now(timezone.utc)
    rows = [("NAME", "SIZE", "CONTEXT", "UNTIL")]
    rows += [(str(m.get("name", "")), _size(m.get("size")), str(m.get("context_length", "")),
              _until(m.get("expires_at"), now)) for m in models if isinstance(m, dict)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        sys.stdout.write("    ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() + "\n")
    return exit_status.OK


def run_stop(opts: StopOptions) -> int:
    if not opts.name.strip():
        return _fail("stop: name the model to unload (llama-chat ps lists them)", exit_status.USAGE)
    try:
        _ask(opts, "POST", "/models/unload", {"model": opts.name}, timeout_s=STOP_TIMEOUT_S)
    except Refused as e:
        return _fail(str(e))
    return exit_status.OK


def _size(value: Any) -> str:
    """Bytes as Ollama's ps writes them: "1.2 GB", "640 MB" (powers of 1000)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return "-"
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}" if value < 10 * scale else f"{value // scale} {unit}"
    return f"{value} B"


def _until(value: Any, now: datetime) -> str:
    """When an idle model unloads, as Ollama's ps says it: "4 minutes from now", "Forever"."""
    if not isinstance(value, str):
        return "Forever"  # a server of one model: loaded while it runs
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return value
    if when.year >= 9999:
        return "Forever"
    left = (when - now).total_seconds()
    if left < 1:
        return "now"
    for unit, seconds in (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        if left >= seconds:
            n = math.floor(left / seconds)
            return f"{n} {unit}{'s' if n != 1 else ''} from now"
    return "now"


def _fail(message: str, status: int = exit_status.FAILURE) -> int:
    try:
        sys.stderr.write(f"llama-chat: error: {one_line(message)}\n")
    except (OSError, ValueError):
        pass
    return status


ps_app = new_app()
ps_app.command(name="ps", cls=GroupedHelp,
               help="List the models a running llama-chat serve has loaded, and until when each stays loaded.")(
    command(PsOptions, run_ps))
stop_app = new_app()
stop_app.command(name="stop", cls=GroupedHelp,
                 help="Unload a model of a running llama-chat serve (once its running requests end).")(
    command(StopOptions, run_stop))

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "ps_app", "run_ps", "run_stop", "stop_app"]

"""``llama-chat serve`` under load on loopback, against ``llama-chat --batch`` on the same jobs.

A stories15M-sized model (dim 288, 6 layers, 6 heads, vocab 32,000; random float32 weights,
seeded; ids 0-2 never win, so nothing stops early) is written once as a Hugging Face checkpoint
with a llama2.c-style ``tokenizer.bin`` (``bench_gpu.write_checkpoint``). Then, in one run:

* ``llama-chat serve --max-batch 64`` started as a real process on a free port, waited for until
  ``/health`` answers 200, and one warm-up request;
* ``--runs`` times, back to back: ``llama-chat --batch`` on ``--clients`` jobs (one short prompt
  each, greedy, ``-n --new``, ``--max-batch 64``), its aggregate tok/s read from its ``--stats``
  line (generated tokens over the batch's own time, the model's load left out); then
  ``--clients`` concurrent streaming ``/v1/completions`` requests of the same jobs (greedy; each
  on a connection of its own; one thread reads them all, every ``POLL_S``, each read timed, and
  undoes the chunked coding and parses the server-sent events itself once a response has ended:
  on the server's two cores, a client's wake-up and parse for every event is taken from the
  server). Every one must finish with
  ``length``, its streamed text must equal ``--batch``'s text for the same prompt, and its token
  count ``--new`` (a token lost or sent twice changes one or the other), and equal the text of
  the same request without ``stream`` (sent next with httpx, all at once too: its tok/s shows
  what streaming costs the server). Aggregate tok/s: all tokens over the wall time from the
  first request sent to the last response ended. Time to first token and inter-token latency
  are the client's: from sending to the first text event, and between two text events of one
  stream, each as read, up to ``POLL_S`` after it came (an event carries the text of the tokens waiting to be sent: one, or a few when a
  character spans tokens or the stream fell behind). The ratio of streaming's tok/s to
  ``--batch``'s is taken within each run and its median printed: a busy machine's speed swings
  between minutes (as in ``bench_batch.py``). The clients run on the server's machine, so the
  CPU they take (printed) is taken from it;
* the soak: ``--soak`` requests in waves of ``--clients``, a quarter of each wave disconnecting
  after a few events; the server's RSS (``VmRSS`` of ``/proc/PID/status``) after the first 200
  requests and after all of them, and the cancelled-requests counter of ``/metrics``.

Prints one JSON line per measurement and a Markdown table last; exits 1 if a check fails.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_serve.py [--quick] [--runs 3] [--clients 64] [--new 128]
        [--soak 2000] [--soak-new 32]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import re
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import anyio
import httpx
import torch

from bench_gpu import write_checkpoint

CONFIG = {"dim": 288, "hidden": 768, "n_layers": 6, "n_heads": 6, "n_kv_heads": 6, "vocab": 32000}
MAX_BATCH = 64
START_S = 300.0  # the server's process starting, torch imported, the model loaded
REQUEST_S = 600.0  # one request on a busy machine
SOAK_FIRST = 200  # the requests after which the soak's first RSS is read
DISCONNECT_AFTER = 3  # events a disconnecting client reads before it goes
READ_BYTES = 65536
POLL_S = 0.005  # between two looks at every stream's connection


@dataclass
class Stream:
    """What one client saw of one streamed request."""

    text: str = ""
    tokens: int = 0  # the usage chunk's completion_tokens
    finish_reason: str | None = None
    sent: float = 0.0
    events: list[float] = field(default_factory=list)  # when each text event arrived


def llama_chat() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "llama-chat")
    return [exe] if os.path.isfile(exe) else [sys.executable, "-c", "from llama_chat.cmd.main import main; main()"]


def child_env() -> dict[str, str]:
    return {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), "NO_COLOR": "1"}


def job_prompts(n: int, first: int = 0) -> list[str]:
    """``n`` different short prompts (words of the numbered vocabulary and plain text)."""
    return [f"Story {i}: w{300 + 7 * i} w{900 + 13 * i} once upon a time" for i in range(first, first + n)]


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]


def listed(values: list[float], spec: str = ".0f") -> str:
    return ", ".join(format(v, spec) for v in values)


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


# -- --batch ---------------------------------------------------------------------------------------


def run_batch(model: str, prompts: list[str], new: int, work: str) -> tuple[dict[str, dict], float, float]:
    """Each job's result by id, the ``--stats`` tok/s, and the command's wall tok/s (load included)."""
    path = os.path.join(work, "jobs.jsonl")
    with open(path, "w") as f:
        for i, prompt in enumerate(prompts):
            f.write(json.dumps({"id": str(i), "prompt": prompt}) + "\n")
    start = time.perf_counter()
    proc = subprocess.run([*llama_chat(), "-m", model, "--template", "none", "--batch", path, "--max-batch",
                           str(MAX_BATCH), "-t", "0", "-n", str(new), "--stats"],
                          capture_output=True, env=child_env(), timeout=3600)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"--batch failed ({proc.returncode}): {proc.stderr.decode(errors='replace')[-2000:]}")
    results = {obj["id"]: obj for obj in map(json.loads, proc.stdout.decode().splitlines())}
    found = re.search(r"generated (\d+) tokens in [\d.]+ s \(([\d.]+) tok/s\)", proc.stderr.decode())
    if not found:
        sys.exit(f"no --stats line in: {proc.stderr.decode(errors='replace')[-2000:]}")
    total = sum(r["completion_tokens"] for r in results.values())
    return results, float(found.group(2)), total / wall


# -- the server ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, work: str) -> tuple[subprocess.Popen, str]:
    return launch(lambda port: [*llama_chat(), "serve", "-m", model, "--port", str(port), "--max-batch", str(MAX_BATCH)],
                  os.path.join(work, "serve.log"))


def launch(argv_on: Callable[[int], list[str]], log_path: str, what: str = "the server",
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """A server started with ``argv_on(port)`` on a free port, its output in ``log_path``, once its
    /health says 200; its process and URL (the script exits in one line if it fails to start)."""
    port = free_port()
    log = open(log_path, "wb")
    proc = subprocess.Popen(argv_on(port), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            env=child_env() if env is None else env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited {proc.returncode}: {open(log.name, errors='replace').read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"{what} did not answer /health 200 in time")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        found = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)
    return int(found.group(1)) / 1024


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def post(url: str, path: str, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict[str, str]]:
    """An HTTP/1.1 POST of ``body`` as JSON on a connection of its own, read up to the end of the
    response's headers: its reader, writer (closing it leaves mid-response) and headers."""
    where = urlsplit(url)
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json\r\n"
                 f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
                 + data)
    status = (await reader.readline()).split(b" ", 2)
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if len(status) < 2 or status[1] != b"200":
        writer.close()
        raise RuntimeError(f"status {b' '.join(status[1:]).decode(errors='replace').strip()}")
    return reader, writer, headers


async def body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response's body as it arrives: chunked transfer coding undone, or up to its length or
    the connection's end."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while size := int((await reader.readline()).split(b";", 1)[0], 16):
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the CRLF after each chunk
        while await reader.readline() not in (b"\r\n", b"\n", b""):
            pass  # trailers
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while piece := await reader.read(65536):
            yield piece


async def sse_data(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event (its ``data:`` lines joined), as events end."""
    pending = b""
    async for piece in body_pieces(reader, headers):
        pending += piece.replace(b"\r\n", b"\n")
        *events, pending = pending.split(b"\n\n")
        for block in events:
            data = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
            if data:
                yield b"\n".join(data).decode()


def timed_events(reads: list[tuple[float, bytes]], headers: dict[str, str]) -> list[tuple[float, str]]:
    """The ``data`` of each server-sent event of a body read as ``(time, bytes)`` pieces, with the
    time of the read its last byte came in: chunked transfer coding undone, as ``sse_data`` does."""
    raw = b"".join(piece for _, piece in reads)
    read_ends, at = [], 0
    for _, piece in reads:
        at += len(piece)
        read_ends.append(at)
    payload, arrived = bytearray(), []  # arrived: (end of a piece of payload, its time)

    def took(raw_end: int) -> float:
        return reads[bisect.bisect_left(read_ends, raw_end)][0]

    if "chunked" in headers.get("transfer-encoding", "").lower():
        at = 0
        while (line_end := raw.find(b"\r\n", at)) >= 0 and (size := int(raw[at:line_end].split(b";", 1)[0], 16)):
            start = line_end + 2
            payload += raw[start:start + size]
            arrived.append((len(payload), took(start + size)))
            at = start + size + 2
    else:
        payload += raw
        arrived = [(end, when) for end, (when, _) in zip(read_ends, reads)]
    ends = [end for end, _ in arrived]
    out, at = [], 0
    text = bytes(payload)  # the server ends its events' lines with LF alone
    while (stop := text.find(b"\n\n", at)) >= 0:
        data = [line[5:].removeprefix(b" ") for line in text[at:stop].split(b"\n") if line.startswith(b"data:")]
        if data:
            out.append((arrived[bisect.bisect_left(ends, stop + 2)][1], b"\n".join(data).decode()))
        at = stop + 2
    return out


@dataclass
class Reading:
    """One streamed request's connection, as the poller reads it: every read timed."""

    sock: socket.socket
    seen: Stream
    leave_after: int | None  # events read before the client goes; None: to the end
    reads: list[tuple[float, bytes]] = field(default_factory=list)
    events: int = 0


def stream_wave(url: str, prompts: list[str], new: int, disconnecting: int = 0) -> tuple[list[Stream], float]:
    """All ``prompts`` at once as streamed completions, the first ``disconnecting`` of them going
    after ``DISCONNECT_AFTER`` events; and the wall time, from the first request sent to the last
    byte read. One thread reads every connection, ``POLL_S`` apart, and parses the responses once
    they end (``timed_events``): the clients share the server's cores, and a wake-up and a parse
    for every event took a share of them. An event's time is that of the read it ended in."""
    where = urlsplit(url)
    selector = selectors.DefaultSelector()
    start = time.perf_counter()
    readings = []
    for i, prompt in enumerate(prompts):
        body = json.dumps({"prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        seen = Stream(sent=time.perf_counter())
        sock = socket.create_connection((where.hostname, where.port), timeout=REQUEST_S)
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                     + body)
        sock.setblocking(False)
        reading = Reading(sock, seen, DISCONNECT_AFTER if i < disconnecting else None)
        selector.register(sock, selectors.EVENT_READ, reading)
        readings.append(reading)
    deadline, left = start + REQUEST_S, len(readings)
    while left:
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{left} streams still open after {REQUEST_S:.0f} s")
        for key, _ in selector.select(timeout=1.0):
            reading = key.data
            piece = reading.sock.recv(READ_BYTES)
            if piece:
                reading.reads.append((time.perf_counter(), piece))
                reading.events += piece.count(b"\n\n")  # an event's end; the chunked coding's lines end in CRLF
            if not piece or reading.leave_after is not None and reading.events >= reading.leave_after:
                selector.unregister(reading.sock)
                reading.sock.close()  # mid-stream, for a client that leaves early
                left -= 1
        time.sleep(POLL_S)
    selector.close()
    end = max((r.reads[-1][0] for r in readings if r.reads), default=time.perf_counter())
    return [read_stream(r) for r in readings], end - start


def read_stream(reading: Reading) -> Stream:
    """What a stream's client saw: its status and headers, then its events (``timed_events``)."""
    seen, reads = reading.seen, reading.reads
    raw = b"".join(piece for _, piece in reads)
    head_end = raw.find(b"\r\n\r\n")
    lines = raw[:max(head_end, 0)].decode("latin-1").split("\r\n")
    status = lines[0].split(" ", 2)
    if head_end < 0 or len(status) < 2 or status[1] != "200":
        raise RuntimeError(f"status {' '.join(status[1:]) or 'missing'}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    skip, body_reads = head_end + 4, []  # the body's pieces, each with the time of its read
    for when, piece in reads:
        body_reads.append((when, piece[skip:]))
        skip = max(0, skip - len(piece))
    for when, data in timed_events([r for r in body_reads if r[1]], headers):
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            seen.tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            if choice.get("text"):
                seen.events.append(when)
                seen.text += choice["text"]
            seen.finish_reason = choice.get("finish_reason") or seen.finish_reason
    return seen


async def whole_one(client: httpx.AsyncClient, prompt: str, new: int) -> Stream:
    """The same request without ``stream``: one response with the whole text."""
    seen = Stream(sent=time.perf_counter())
    response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": new, "temperature": 0})
    if response.status_code != 200:
        raise RuntimeError(f"status {response.status_code}: {response.text[:300]}")
    body = response.json()
    seen.text, seen.finish_reason = body["choices"][0]["text"], body["choices"][0]["finish_reason"]
    seen.tokens = body["usage"]["completion_tokens"]
    return seen


async def whole_wave(url: str, prompts: list[str], new: int) -> tuple[list[Stream], float]:
    """All ``prompts`` at once without ``stream``; and the wall time."""
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_S, limits=limits) as client:
        out: list[Stream | None] = [None] * len(prompts)

        async def one(i: int) -> None:
            with anyio.fail_after(REQUEST_S):
                out[i] = await whole_one(client, prompts[i], new)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return out, time.perf_counter() - start


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# -- the run ---------------------------------------------------------------------------------------


def check_streams(streams: list[Stream], batch: dict[str, dict], new: int) -> list[str]:
    problems = []
    for i, s in enumerate(streams):
        expected = batch[str(i)]
        if s.finish_reason != "length" or s.tokens != new:
            problems.append(f"job {i}: finish {s.finish_reason}, {s.tokens} tokens (want length, {new})")
        if s.text != expected["text"]:
            problems.append(f"job {i}: streamed text differs from --batch's ({len(s.text)} against "
                            f"{len(expected['text'])} characters)")
        if expected["completion_tokens"] != new:
            problems.append(f"job {i}: --batch generated {expected['completion_tokens']} tokens, not {new}")
    return problems


def soak(proc: subprocess.Popen, url: str, total: int, clients: int, new: int) -> dict:
    done, after_first, problems, gone, started = 0, None, 0, 0, time.perf_counter()
    cancelled_before = metric(url, 'llama_chat_requests_total{outcome="cancelled"}')
    while done < total:
        size = min(clients, total - done, SOAK_FIRST - done if done < SOAK_FIRST else clients)
        leaving = size // 4
        streams, _ = stream_wave(url, job_prompts(size, first=done), new, leaving)
        for i, s in enumerate(streams):
            if i >= leaving and (s.finish_reason != "length" or s.tokens != new):
                problems += 1
        gone += leaving
        done += size
        if after_first is None and done >= SOAK_FIRST:
            after_first = rss_mib(proc.pid)
            emit(measure="soak_rss_first", requests=done, rss_mib=round(after_first, 1))
    # A disconnected job is cancelled at the scheduler's next step: wait until none is left running.
    deadline = time.monotonic() + 120
    while metric(url, "llama_chat_jobs_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    last = rss_mib(proc.pid)
    cancelled = metric(url, 'llama_chat_requests_total{outcome="cancelled"}') - cancelled_before
    row = {"requests": done, "disconnected": gone, "cancelled_counted": cancelled, "incomplete": problems,
           "rss_first_mib": after_first or last, "rss_last_mib": last, "seconds": time.perf_counter() - started,
           "jobs_running_after": metric(url, "llama_chat_jobs_running")}
    emit(measure="soak", **{k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=None, help="concurrent streams (64; 16 with --quick)")
    parser.add_argument("--new", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--soak", type=int, default=None, help="soak requests (2000; 200 with --quick)")
    parser.add_argument("--soak-new", type=int, default=32, help="max_tokens of each soak request")
    parser.add_argument("--runs", type=int, default=None, help="pairs of --batch and serve (3; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="16 clients, one run and a soak of 200")
    args = parser.parse_args()
    clients = args.clients or (16 if args.quick else 64)
    runs = args.runs or (1 if args.quick else 3)
    total = args.soak if args.soak is not None else (200 if args.quick else 2000)
    if not 1 <= clients <= MAX_BATCH or args.new < 1 or args.soak_new <= DISCONNECT_AFTER or total < 0:
        parser.error(f"--clients must be 1 to {MAX_BATCH}, --new at least 1, --soak-new over {DISCONNECT_AFTER}")

    with tempfile.TemporaryDirectory(prefix="bench_serve_") as work:
        model = os.path.join(work, "stories15m")
        write_checkpoint(CONFIG, model, torch.device("cpu"), torch.float32)
        prompts = job_prompts(clients)

        proc, url = start_server(model, work)
        problems: list[str] = []
        bad_jobs = 0
        batch_stats, batch_wall, served, served_whole, ttft, itl, client_cores = [], [], [], [], [], [], []
        try:
            stream_wave(url, prompts[:1], 8)  # warm-up: first touch of the weights and the kernels
            for run in range(runs):  # --batch and the server back to back, so that their ratio is a fair one
                batch, stats_tok_s, wall_tok_s = run_batch(model, prompts, args.new, work)
                batch_stats.append(stats_tok_s)
                batch_wall.append(wall_tok_s)
                emit(run=run, measure="batch", jobs=clients, stats_tok_s=stats_tok_s, wall_tok_s=round(wall_tok_s, 1))
                cpu = time.process_time()
                streams, wall = stream_wave(url, prompts, args.new)
                client_cores.append((time.process_time() - cpu) / wall)
                served.append(sum(s.tokens for s in streams) / wall)
                ttft += [(s.events[0] - s.sent) * 1000 for s in streams if s.events]
                itl += [(b - a) * 1000 for s in streams for a, b in zip(s.events, s.events[1:])]
                emit(run=run, measure="serve", clients=clients, tok_s=round(served[-1], 1))
                whole, whole_wall = anyio.run(whole_wave, url, prompts, args.new)
                served_whole.append(sum(s.tokens for s in whole) / whole_wall)
                emit(run=run, measure="serve_whole", clients=clients, tok_s=round(served_whole[-1], 1))
                found = check_streams(streams, batch, args.new)
                found += [f"job {i}: the whole response's text differs from the streamed one"
                          for i, (a, b) in enumerate(zip(streams, whole)) if a.text != b.text]
                problems += found
                bad_jobs += len({p.split(":")[0] for p in found})
                for p in found[:10]:
                    print("  " + p, flush=True)
            soaked = soak(proc, url, total, clients, args.soak_new) if total else None
        finally:
            code = stop(proc)
        if code != 0:
            problems.append(f"the server exited {code} on SIGTERM")

    ratios = [a / b for a, b in zip(served, batch_stats)]
    print(json.dumps({"load_avg": os.getloadavg(), "torch": torch.__version__, "cpus": os.cpu_count()}))
    print()
    print(f"| measure (median of {runs} runs; each run's values listed) | value | target |")
    print("|---|---|---|")
    print(f"| `--batch`, {clients} jobs x {args.new} tokens (`--stats`) | {statistics.median(batch_stats):.0f} tok/s "
          f"({listed(batch_stats)}) | |")
    print(f"| `--batch`, the same, command wall time (load included) | {statistics.median(batch_wall):.0f} tok/s "
          f"({listed(batch_wall)}) | |")
    print(f"| serve, {clients} streaming clients, aggregate | {statistics.median(served):.0f} tok/s "
          f"({listed(served)}) | |")
    print(f"| serve, {clients} clients without `stream`, aggregate | {statistics.median(served_whole):.0f} tok/s "
          f"({listed(served_whole)}) | |")
    print(f"| the clients' own CPU while streaming (cores busy, on this machine's {os.cpu_count()}) | "
          f"{statistics.median(client_cores):.2f} ({listed(client_cores, '.2f')}) | |")
    print(f"| serve over `--batch --stats`, per run | {statistics.median(ratios):.2f}x "
          f"({listed(ratios, '.2f')}) | >= 0.9x |")
    print(f"| streams complete, text equal to `--batch`'s and to the whole response's | "
          f"{runs * clients - bad_jobs} of {runs * clients} | all |")
    print(f"| TTFT p50 / p99 (client) | {percentile(ttft, 50):.0f} / {percentile(ttft, 99):.0f} ms | |")
    print(f"| inter-token latency p50 / p99 (client) | {percentile(itl, 50):.1f} / {percentile(itl, 99):.1f} ms | |")
    if soaked:
        print(f"| soak: requests (disconnected mid-stream; counted cancelled) | {soaked['requests']} "
              f"({soaked['disconnected']}; {soaked['cancelled_counted']:.0f}) | |")
        print(f"| soak: others not complete; jobs running after | {soaked['incomplete']}; "
              f"{soaked['jobs_running_after']:.0f} | 0; 0 |")
        print(f"| soak: server RSS after {SOAK_FIRST} / after {soaked['requests']} | {soaked['rss_first_mib']:.0f} / "
              f"{soaked['rss_last_mib']:.0f} MiB ({soaked['rss_last_mib'] / soaked['rss_first_mib']:.3f}) | <= 1.10 |")
    if problems or (soaked and soaked["incomplete"]):
        sys.exit(1)


if __name__ == "__main__":
    main()

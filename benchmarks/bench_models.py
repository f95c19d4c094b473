"""Several models behind one ``llama-chat serve``: memory under churn, and a model's speed with
others loaded beside it against the same model served alone.

Three stories15M-sized models (dim 288, 6 layers, vocab 32,000; random float32 weights, about
98 MB of safetensors each; ``bench_gpu.write_checkpoint``), written once and copied into three
folders, so that each is a model of its own files. Then, in one run:

* churn: ``serve -m m1 -m m2 -m m3 --models-max 2 --models-memory BUDGET`` (BUDGET: 3.5 times one
  model's files: one model loaded and another loading, which takes twice its files, and room).
  Its resident memory (``VmRSS``) at start, then "idle": after one model was
  loaded, answered and unloaded (torch and the operator in, no model). ``--requests`` short
  greedy requests then alternate m1, m2, m3 one after another (with two slots, each request
  unloads the model the next one names: a load per request), while a thread reads VmRSS every
  20 ms for the peak. Then every model is unloaded (``POST /models/unload``) and VmRSS read
  again. Checks: the peak above idle within the budget; the last figure within 20 % of idle.
* speed: ``serve -m m1`` and ``serve -m m1 -m m2 -m m3`` with all three loaded (m2 and m3 idle
  beside m1), both started before the first measure. ``--pairs`` pairs of streamed completions
  of ``--new`` tokens to m1 (a prompt of 382 tokens), one on each server back to back
  (which goes first alternates): time to first token and decode tok/s (tokens after the first
  over the time from the first text event to the last), and each pair's ratio, beside over alone. The median of the ratios and
  their quartiles are printed: on a busy machine a stream's speed swings by tens of percent from
  one second to the next, and only ratios of neighbours taken many times say anything. Beside
  the wall-clock figures, the same in the server's CPU time (the sum over its threads of
  ``/proc/PID/task/*/schedstat``, read by the client when it sends, at the first text event and
  at the end): what the model's work costs, which other processes on the cores do not change.

With ``--llama-server [PATH]`` (default: the build of ``llama_cpp_peer.py`` in its cache, never
built here), the churn runs on GGUF files instead, both for llama-chat and for llama.cpp's
``llama-server`` in router mode (``--models-dir DIR --models-max 2``, each model in a child
process of its own) on the same three files: a stories15M-shaped checkpoint with a SentencePiece
tokenizer (``bench_gguf.py``'s), converted to F32 by llama.cpp's own ``convert_hf_to_gguf.py``.
The resident memory is then the process tree's (the router and its children), for both.

Prints one JSON line per measurement and Markdown tables last; exits 1 if a check fails.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_models.py [--requests 200] [--pairs 60] [--new 64]
        [--llama-server [PATH]] [--speed-only]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import anyio
import httpx
import torch

from bench_gpu import write_checkpoint
from bench_serve import CONFIG, emit, launch, llama_chat, post as post_stream, rss_mib, sse_data, stop

START_S = 300.0
REQUEST_S = 600.0
RSS_EVERY_S = 0.02
RETURN_WITHIN = 0.20  # the last RSS against the idle one
SPEED_WITHIN = 0.03  # a model's speed beside others against alone
# The memory budget, in models' files: one loaded and another loading (which takes twice its files).
BUDGET_MODELS = 3.5
PEER_CACHE = Path(os.environ.get("LLAMA_CHAT_BENCH_CACHE", Path.home() / ".cache" / "llama-chat-bench"))


def start(models: list[str], work: str, name: str, *extra: str) -> tuple[subprocess.Popen, str]:
    args = [arg for model in models for arg in ("-m", model)]
    return launch(lambda port: [*llama_chat(), "serve", *args, "--port", str(port), "--template", "none", *extra],
                  os.path.join(work, f"{name}.log"), f"{name}: the server")


def ask(url: str, model: str, new: int = 8) -> None:
    answer = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Once upon a time", "max_tokens": new,
                                                       "temperature": 0}, timeout=REQUEST_S)
    if answer.status_code != 200:
        sys.exit(f"{model}: {answer.status_code}: {answer.text[:300]}")


def post(url: str, path: str, model: str) -> None:
    answer = httpx.post(f"{url}{path}", json={"model": model}, timeout=REQUEST_S)
    if answer.status_code != 200:
        sys.exit(f"{path} {model}: {answer.status_code}: {answer.text[:300]}")


def tree_rss_mib(pid: int) -> float:
    """VmRSS of ``pid`` and of every process below it (llama-server's router runs each model in a
    child of its own)."""
    return sum(rss_of(one) for one in tree(pid))


def rss_of(pid: int) -> float:
    try:
        return rss_mib(pid)
    except (OSError, AttributeError):
        return 0.0  # gone meanwhile


def tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        one = todo.pop()
        found.append(one)
        todo += children.get(one, [])
    return found


class PeakRss:
    """The highest VmRSS of ``pid``'s process tree read every ``RSS_EVERY_S`` while it runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._done = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, tree_rss_mib(self.pid))
            time.sleep(RSS_EVERY_S)


def churn(models: list[str], work: str, requests: int, size: int) -> dict:
    budget = int(BUDGET_MODELS * size)
    server = start(models, work, "churn", "--models-max", "2", "--models-memory", str(budget), "--keep-alive", "-1")
    row = churn_on(server, [Path(m).stem for m in models], requests)
    row["loads"] = open(os.path.join(work, "churn.log"), errors="replace").read().count(": loading model ")
    row["budget_mib"] = round(budget / 2**20, 1)
    emit(measure="churn", **row)
    return row


def churn_on(server: tuple[subprocess.Popen, str], names: list[str], requests: int) -> dict:
    """The churn on a started server (stopped at the end): its tree's RSS at start, idle, at its
    peak and after the last unload."""
    proc, url = server
    try:
        at_start = tree_rss_mib(proc.pid)
        ask(url, names[0])
        unload(url, names[0])
        idle = settled_rss(proc.pid)
        began = time.perf_counter()
        with PeakRss(proc.pid) as peak:
            for i in range(requests):
                ask(url, names[i % len(names)])
        seconds = time.perf_counter() - began
        for name in names:
            unload(url, name)
        last = settled_rss(proc.pid)
    finally:
        code = stop(proc)
    return {"requests": requests, "seconds": round(seconds, 1), "rss_start_mib": round(at_start, 1),
            "rss_idle_mib": round(idle, 1), "rss_peak_mib": round(peak.peak, 1), "rss_last_mib": round(last, 1),
            "exit": code}


def unload(url: str, name: str) -> None:
    """``POST /models/unload``; llama-server's router refuses a model that is not running (400)."""
    answer = httpx.post(f"{url}/models/unload", json={"model": name}, timeout=REQUEST_S)
    if answer.status_code != 200 and "not running" not in answer.text:
        sys.exit(f"/models/unload {name}: {answer.status_code}: {answer.text[:300]}")


def settled_rss(pid: int, timeout_s: float = 60.0) -> float:
    """The tree's RSS once its children are gone (a router's model exits a moment after its
    unload is answered) and it stops falling: two readings 0.5 s apart within 1 %."""
    deadline = time.monotonic() + timeout_s
    while len(tree(pid)) > 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    before = tree_rss_mib(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = tree_rss_mib(pid)
        if now >= before * 0.99:
            return now
        before = now
    return before


# -- llama.cpp's router --------------------------------------------------------------------------


def find_llama_server(given: str) -> Path | None:
    if given != "auto":
        return Path(given) if Path(given).is_file() else None
    found = sorted(PEER_CACHE.glob("build/*/bin/llama-server"))
    return found[-1] if found else None


def gguf_models(work: str) -> list[str]:
    """Three copies of a stories15M-shaped F32 GGUF, written by llama.cpp's own converter."""
    import bench_gguf

    source = sorted(PEER_CACHE.glob("src/*/vendor/llama.cpp"))
    if not source:
        sys.exit(f"no llama.cpp source under {PEER_CACHE}/src (bench_gguf.py fetches it)")
    folder = Path(work)
    tokenizer = bench_gguf.write_tokenizer(folder / "tokenizer" / "tokenizer.model")
    shape = bench_gguf.Shape("stories15M", dim=CONFIG["dim"], n_layers=CONFIG["n_layers"], n_heads=CONFIG["n_heads"],
                             n_kv_heads=CONFIG["n_kv_heads"], hidden=CONFIG["hidden"], ctx=2048, tied=False)
    hf = bench_gguf.write_checkpoint(shape, folder / "hf", tokenizer)
    (folder / "gguf").mkdir()
    first = folder / "gguf" / "m1.gguf"
    env = {**os.environ, "PYTHONPATH": str(source[-1] / "gguf-py")}
    done = subprocess.run([sys.executable, str(source[-1] / "convert_hf_to_gguf.py"), str(hf), "--outfile", str(first),
                           "--outtype", "f32"], capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"convert_hf_to_gguf.py failed: {done.stderr[-600:]}")
    return [str(first)] + [str(shutil.copy(first, folder / "gguf" / f"m{i}.gguf")) for i in (2, 3)]


def start_router(binary: Path, folder: str, work: str) -> tuple[subprocess.Popen, str]:
    return launch(lambda port: [str(binary), "--models-dir", folder, "--models-max", "2", "--host", "127.0.0.1",
                                "--port", str(port), "-t", str(os.cpu_count() or 1), "-c", "2048"],
                  os.path.join(work, "llama-server.log"), "llama-server", env=dict(os.environ))


def router_churn(binary: Path, models: list[str], work: str, requests: int) -> dict:
    proc, url = start_router(binary, os.path.dirname(models[0]), work)
    listed = httpx.get(f"{url}/models", timeout=60).json()
    names = sorted(m["id"] for m in listed["data"])
    if len(names) != len(models):
        stop(proc)
        sys.exit(f"llama-server's router lists {names}, not the {len(models)} files")
    row = churn_on((proc, url), names, requests)
    emit(measure="router_churn", **row)
    return row


def cpu_ns(pid: int) -> int:
    """The CPU time of ``pid``'s threads, in nanoseconds (the scheduler's own count)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total


async def measured_stream(url: str, pid: int, prompt: str, new: int) -> dict[str, float]:
    """One streamed completion to the server's first model: TTFT and decode tok/s by the wall
    clock, and the same in the server's CPU time (ms to the first token, ms a token after it)."""
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    cpu0, sent = cpu_ns(pid), time.perf_counter()
    reader, writer, headers = await post_stream(url, "/v1/completions", body)
    events: list[float] = []
    cpu_first, tokens, finish = 0, 0, None
    try:
        async for data in sse_data(reader, headers):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                if choice.get("text"):
                    if not events:
                        cpu_first = cpu_ns(pid)
                    events.append(time.perf_counter())
                finish = choice.get("finish_reason") or finish
    finally:
        writer.close()
    cpu_end = cpu_ns(pid)
    if finish != "length" or len(events) < 2 or tokens < 2:
        sys.exit(f"{url}: a stream ended {finish} after {len(events)} events")
    return {"ttft_ms": (events[0] - sent) * 1000, "tok_s": (tokens - 1) / (events[-1] - events[0]),
            "cpu_ttft_ms": (cpu_first - cpu0) / 1e6, "cpu_ms_per_token": (cpu_end - cpu_first) / 1e6 / (tokens - 1)}


# A prompt of a few hundred tokens (the numbered vocabulary spells these words in pieces), so
# that the first token waits on a prefill and not only on the request's round trip, whose few
# milliseconds swing more than the 3 % the comparison asks.
PASSAGE = (" The old lighthouse stood at the edge of the cliff, and every night its keeper climbed the"
           " hundred steps to light the lamp. Ships passed far out at sea, and the sailors counted on the"
           " beam to find the harbour through fog and rain. One winter the storms came early, the road to"
           " the village washed away, and the keeper was alone with the wind for many weeks.")


def timed(server: tuple[subprocess.Popen, str], new: int, i: int) -> dict[str, float]:
    proc, url = server
    return anyio.run(measured_stream, url, proc.pid, f"Story {i}:{PASSAGE} Once upon a time", new)


def speed(models: list[str], work: str, pairs: int, new: int) -> dict:
    names = [Path(m).stem for m in models]
    alone, alone_url = start(models[:1], work, "alone")
    beside, beside_url = start(models, work, "beside", "--keep-alive", "-1")
    try:
        for name in names:
            post(beside_url, "/models/load", name)
        servers = {"alone": (alone, alone_url), "beside": (beside, beside_url)}
        for server in servers.values():
            timed(server, 16, 0)  # warm-up: the first touch of the weights and the kernels
        rows = []
        for i in range(pairs):
            order = list(servers) if i % 2 == 0 else list(servers)[::-1]
            measured = {which: timed(servers[which], new, i) for which in order}
            row = {"pair": i, **{f"{which}_{k}": v for which, m in measured.items() for k, v in m.items()}}
            emit(measure="speed", **{k: round(v, 3) for k, v in row.items()})
            rows.append(row)
        loaded = [m["id"] for m in httpx.get(f"{beside_url}/v1/models", timeout=60).json()["data"]
                  if m["status"] == "loaded"]
    finally:
        stop(alone)
        stop(beside)
    return {"rows": rows, "loaded_beside": loaded}


def quartiles(values: list[float]) -> str:
    q1, q2, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return f"{statistics.median(values):.3f} ({q1:.3f} - {q3:.3f})"


def churn_problems(churned: dict) -> list[str]:
    problems = []
    within_budget = churned["rss_peak_mib"] - churned["rss_idle_mib"] <= churned["budget_mib"]
    returned = churned["rss_last_mib"] <= (1 + RETURN_WITHIN) * churned["rss_idle_mib"]
    if not within_budget:
        problems.append("the peak RSS above idle passed the budget")
    if not returned:
        problems.append(f"the RSS after the last unload is more than {RETURN_WITHIN:.0%} above idle")
    if churned["exit"] != 0:
        problems.append(f"the churn server exited {churned['exit']}")
    return problems


def print_churn(churned: dict, size: int, binary: Path | None, router: dict | None) -> None:
    print()
    print(f"| churn: {churned['requests']} requests over 3 models, `--models-max 2` | value | target |")
    print("|---|---|---|")
    print(f"| one model's files{' (F32 GGUF)' if binary is not None else ''} | {size / 2**20:.0f} MiB | |")
    print(f"| loads (one per request: each unloads the model the next one names) | {churned['loads']} "
          f"in {churned['seconds']:.0f} s | |")
    print(f"| RSS at start / idle (a model loaded, answered, unloaded) | {churned['rss_start_mib']:.0f} / "
          f"{churned['rss_idle_mib']:.0f} MiB | |")
    print(f"| peak RSS (every {RSS_EVERY_S * 1000:.0f} ms), above idle | {churned['rss_peak_mib']:.0f} MiB, "
          f"{churned['rss_peak_mib'] - churned['rss_idle_mib']:.0f} MiB | <= the budget, "
          f"{churned['budget_mib']:.0f} MiB |")
    print(f"| RSS after the last unload, against idle | {churned['rss_last_mib']:.0f} MiB "
          f"({churned['rss_last_mib'] / churned['rss_idle_mib']:.2f}x) | <= {1 + RETURN_WITHIN:.2f}x |")
    if router is not None:
        print()
        print(f"| the same on llama-server's router ({binary}), the same files | value |")
        print("|---|---|")
        print(f"| {router['requests']} requests | {router['seconds']:.0f} s |")
        print(f"| RSS of the router and its children at start / idle | {router['rss_start_mib']:.0f} / "
              f"{router['rss_idle_mib']:.0f} MiB |")
        print(f"| peak RSS, above idle | {router['rss_peak_mib']:.0f} MiB, "
              f"{router['rss_peak_mib'] - router['rss_idle_mib']:.0f} MiB |")
        print(f"| RSS after the last unload, against idle | {router['rss_last_mib']:.0f} MiB "
              f"({router['rss_last_mib'] / router['rss_idle_mib']:.2f}x) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="churn: requests alternating between the models")
    parser.add_argument("--pairs", type=int, default=60, help="speed: pairs of streams, one on each server")
    parser.add_argument("--new", type=int, default=64, help="speed: tokens of each stream")
    parser.add_argument("--llama-server", nargs="?", const="auto", default=None, metavar="PATH",
                        help="the churn on GGUF files, beside llama-server's router on them (default PATH: "
                             "llama_cpp_peer.py's build in its cache)")
    parser.add_argument("--speed-only", action="store_true", help="the speed part alone, without the churn")
    args = parser.parse_args()
    if args.requests < 3 or args.pairs < 1 or args.new < 2:
        parser.error("--requests at least 3, --pairs at least 1, --new at least 2")

    binary = find_llama_server(args.llama_server) if args.llama_server is not None else None
    if args.llama_server is not None and binary is None:
        parser.error(f"no llama-server at {args.llama_server} (auto: under {PEER_CACHE}/build)")
    router = None
    with tempfile.TemporaryDirectory(prefix="bench_models_") as work:
        if binary is not None:
            models = gguf_models(work)
            size = os.path.getsize(models[0])
        else:
            first = os.path.join(work, "m1")
            write_checkpoint(CONFIG, first, torch.device("cpu"), torch.float32)
            models = [first] + [shutil.copytree(first, os.path.join(work, f"m{i}")) for i in (2, 3)]
            size = sum(os.path.getsize(os.path.join(first, f)) for f in os.listdir(first))
        churned = None if args.speed_only else churn(models, work, args.requests, size)
        if binary is not None and churned is not None:
            router = router_churn(binary, models, work, args.requests)
        timings = speed(models, work, args.pairs, args.new)

    problems = [] if churned is None else churn_problems(churned)
    rows = timings["rows"]

    def ratios(key: str, inverse: bool = False) -> list[float]:
        return [(r[f"alone_{key}"] / r[f"beside_{key}"]) if inverse else (r[f"beside_{key}"] / r[f"alone_{key}"])
                for r in rows]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)
    load = os.getloadavg()
    print()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}; "
          f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if churned is not None:
        print_churn(churned, size, binary, router)
    print()
    print(f"| m1 beside m2 and m3 (loaded: {', '.join(timings['loaded_beside'])}) against m1 alone, "
          f"{args.pairs} pairs of streams x {args.new} tokens | median (quartiles) | target |")
    print("|---|---|---|")
    print(f"| decode tok/s alone / beside (wall clock) | {median('alone_tok_s'):.0f} / "
          f"{median('beside_tok_s'):.0f} | |")
    print(f"| decode speed, beside over alone, per pair (wall clock) | {quartiles(ratios('tok_s'))} | "
          f"within {SPEED_WITHIN:.0%} |")
    print(f"| decode, the server's CPU ms a token, alone / beside | {median('alone_cpu_ms_per_token'):.3f} / "
          f"{median('beside_cpu_ms_per_token'):.3f} | |")
    print(f"| decode speed by CPU time, beside over alone, per pair | "
          f"{quartiles(ratios('cpu_ms_per_token', inverse=True))} | within {SPEED_WITHIN:.0%} |")
    print(f"| TTFT alone / beside (wall clock) | {median('alone_ttft_ms'):.1f} / {median('beside_ttft_ms'):.1f} ms | |")
    print(f"| TTFT, beside over alone, per pair (wall clock) | {quartiles(ratios('ttft_ms'))} | "
          f"within {SPEED_WITHIN:.0%} |")
    print(f"| TTFT in the server's CPU ms, alone / beside | {median('alone_cpu_ttft_ms'):.2f} / "
          f"{median('beside_cpu_ttft_ms'):.2f} | |")
    print(f"| TTFT by CPU time, beside over alone, per pair | {quartiles(ratios('cpu_ttft_ms'))} | "
          f"within {SPEED_WITHIN:.0%} |")
    for problem in problems:
        print(f"check failed: {problem}", file=sys.stderr)
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()

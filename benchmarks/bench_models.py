"""Several models behind one ``llama-chat serve``: memory under churn, and a model's speed with
others loaded beside it against the same model served alone.

Three stories15M-sized models (dim 288, 6 layers, vocab 32,000; random float32 weights, about
98 MB of safetensors each; ``bench_gpu.write_checkpoint``), written once and copied into three
folders, so that each is a model of its own files. Then, in one run:

* churn: ``serve -m m1 -m m2 -m m3 --models-max 2 --models-memory BUDGET`` (BUDGET: 3.5 times one
  model's files: one model loaded and another loading, which takes twice its files, and room). Its resident memory (``VmRSS``) at start, then "idle": after one model was
  loaded, answered and unloaded (torch and the operator in, no model). ``--requests`` short
  greedy requests then alternate m1, m2, m3 one after another (with two slots, each request
  unloads the model the next one names: a load per request), while a thread reads VmRSS every
  20 ms for the peak. Then every model is unloaded (``POST /models/unload``) and VmRSS read
  again. Checks: the peak above idle within the budget; the last figure within 20 % of idle.
* speed: ``serve -m m1`` and ``serve -m m1 -m m2 -m m3`` with all three loaded (m2 and m3 idle
  beside m1), both started before the first measure. ``--rounds`` rounds, each of
  ``--streams`` streamed completions of ``--new`` tokens to m1, one after another, on one server
  then the other (the order swapped every round): time to first token and decode tok/s
  (tokens after the first over the time from the first text event to the last), each round's
  median, and the ratio of the two servers' medians within the round; the median of those
  ratios is printed (a busy machine's speed swings between minutes).

Prints one JSON line per measurement and Markdown tables last; exits 1 if a check fails.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_models.py [--requests 200] [--rounds 5] [--streams 4] [--new 128]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import anyio
import httpx
import torch

from bench_gpu import write_checkpoint
from bench_serve import CONFIG, child_env, emit, free_port, listed, llama_chat, rss_mib, stop, stream_one

START_S = 300.0
REQUEST_S = 600.0
RSS_EVERY_S = 0.02
RETURN_WITHIN = 0.20  # the last RSS against the idle one
SPEED_WITHIN = 0.03  # a model's speed beside others against alone
# The memory budget, in models' files: one loaded and another loading (which takes twice its files).
BUDGET_MODELS = 3.5


def start(models: list[str], work: str, name: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(os.path.join(work, f"{name}.log"), "wb")
    args = [arg for model in models for arg in ("-m", model)]
    proc = subprocess.Popen([*llama_chat(), "serve", *args, "--port", str(port), "--template", "none", *extra],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=child_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{name}: the server exited {proc.returncode}: {open(log.name, errors='replace').read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"{name}: the server did not answer /health 200 in time")


def ask(url: str, model: str, new: int = 8) -> None:
    answer = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Once upon a time", "max_tokens": new,
                                                       "temperature": 0}, timeout=REQUEST_S)
    if answer.status_code != 200:
        sys.exit(f"{model}: {answer.status_code}: {answer.text[:300]}")


def post(url: str, path: str, model: str) -> None:
    answer = httpx.post(f"{url}{path}", json={"model": model}, timeout=REQUEST_S)
    if answer.status_code != 200:
        sys.exit(f"{path} {model}: {answer.status_code}: {answer.text[:300]}")


class PeakRss:
    """The highest VmRSS of ``pid`` read every ``RSS_EVERY_S`` while it runs."""

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
            self.peak = max(self.peak, rss_mib(self.pid))
            time.sleep(RSS_EVERY_S)


def churn(models: list[str], work: str, requests: int, size: int) -> dict:
    budget = int(BUDGET_MODELS * size)
    proc, url = start(models, work, "churn", "--models-max", "2", "--models-memory", str(budget), "--keep-alive", "-1")
    names = [os.path.basename(m) for m in models]
    try:
        at_start = rss_mib(proc.pid)
        ask(url, names[0])
        post(url, "/models/unload", names[0])
        idle = rss_mib(proc.pid)
        began = time.perf_counter()
        with PeakRss(proc.pid) as peak:
            for i in range(requests):
                ask(url, names[i % len(names)])
        seconds = time.perf_counter() - began
        for name in names:
            post(url, "/models/unload", name)
        last = rss_mib(proc.pid)
    finally:
        code = stop(proc)
    loads = open(os.path.join(work, "churn.log"), errors="replace").read().count(": loading model ")
    row = {"requests": requests, "loads": loads, "seconds": round(seconds, 1), "budget_mib": round(budget / 2**20, 1),
           "rss_start_mib": round(at_start, 1), "rss_idle_mib": round(idle, 1), "rss_peak_mib": round(peak.peak, 1),
           "rss_last_mib": round(last, 1), "exit": code}
    emit(measure="churn", **row)
    return row


def timed(url: str, new: int, streams: int) -> tuple[float, float]:
    """Median TTFT (ms) and decode tok/s of ``streams`` streamed completions one after another."""
    ttft, decode = [], []
    for i in range(streams):
        seen = anyio.run(stream_one, url, f"Story {i}: once upon a time", new)
        if seen.finish_reason != "length" or len(seen.events) < 2:
            sys.exit(f"{url}: a stream ended {seen.finish_reason} after {len(seen.events)} events")
        ttft.append((seen.events[0] - seen.sent) * 1000)
        decode.append((seen.tokens - 1) / (seen.events[-1] - seen.events[0]))
    return statistics.median(ttft), statistics.median(decode)


def speed(models: list[str], work: str, rounds: int, streams: int, new: int) -> dict:
    names = [os.path.basename(m) for m in models]
    alone, alone_url = start(models[:1], work, "alone")
    beside, beside_url = start(models, work, "beside", "--keep-alive", "-1")
    try:
        for name in names:
            post(beside_url, "/models/load", name)
        for url in (alone_url, beside_url):
            timed(url, 16, 1)  # warm-up: the first touch of the weights and the kernels
        rows = []
        for r in range(rounds):
            order = [("alone", alone_url), ("beside", beside_url)]
            measured = {which: timed(url, new, streams) for which, url in (order if r % 2 == 0 else order[::-1])}
            row = {"round": r, "alone_ttft_ms": measured["alone"][0], "beside_ttft_ms": measured["beside"][0],
                   "alone_tok_s": measured["alone"][1], "beside_tok_s": measured["beside"][1]}
            emit(measure="speed", **{k: round(v, 2) for k, v in row.items()})
            rows.append(row)
        loaded = [m["id"] for m in httpx.get(f"{beside_url}/v1/models", timeout=60).json()["data"]
                  if m["status"] == "loaded"]
    finally:
        stop(alone)
        stop(beside)
    return {"rows": rows, "loaded_beside": loaded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="churn: requests alternating between the models")
    parser.add_argument("--rounds", type=int, default=5, help="speed: rounds of both servers")
    parser.add_argument("--streams", type=int, default=4, help="speed: streams per server per round")
    parser.add_argument("--new", type=int, default=128, help="speed: tokens of each stream")
    args = parser.parse_args()
    if args.requests < 3 or args.rounds < 1 or args.streams < 1 or args.new < 2:
        parser.error("--requests at least 3, --rounds and --streams at least 1, --new at least 2")

    with tempfile.TemporaryDirectory(prefix="bench_models_") as work:
        first = os.path.join(work, "m1")
        write_checkpoint(CONFIG, first, torch.device("cpu"), torch.float32)
        models = [first] + [shutil.copytree(first, os.path.join(work, f"m{i}")) for i in (2, 3)]
        size = sum(os.path.getsize(os.path.join(first, f)) for f in os.listdir(first))
        churned = churn(models, work, args.requests, size)
        timings = speed(models, work, args.rounds, args.streams, args.new)

    problems = []
    within_budget = churned["rss_peak_mib"] - churned["rss_idle_mib"] <= churned["budget_mib"]
    returned = churned["rss_last_mib"] <= (1 + RETURN_WITHIN) * churned["rss_idle_mib"]
    if not within_budget:
        problems.append("the peak RSS above idle passed the budget")
    if not returned:
        problems.append(f"the RSS after the last unload is more than {RETURN_WITHIN:.0%} above idle")
    if churned["exit"] != 0:
        problems.append(f"the churn server exited {churned['exit']}")
    rows = timings["rows"]
    decode = [r["beside_tok_s"] / r["alone_tok_s"] for r in rows]
    ttft = [r["beside_ttft_ms"] / r["alone_ttft_ms"] for r in rows]
    load = os.getloadavg()
    print()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}; "
          f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print()
    print(f"| churn: {churned['requests']} requests over 3 models, `--models-max 2` | value | target |")
    print("|---|---|---|")
    print(f"| one model's files | {size / 2**20:.0f} MiB | |")
    print(f"| loads (one per request: each unloads the model the next one names) | {churned['loads']} "
          f"in {churned['seconds']:.0f} s | |")
    print(f"| RSS at start / idle (a model loaded, answered, unloaded) | {churned['rss_start_mib']:.0f} / "
          f"{churned['rss_idle_mib']:.0f} MiB | |")
    print(f"| peak RSS (every {RSS_EVERY_S * 1000:.0f} ms), above idle | {churned['rss_peak_mib']:.0f} MiB, "
          f"{churned['rss_peak_mib'] - churned['rss_idle_mib']:.0f} MiB | <= the budget, "
          f"{churned['budget_mib']:.0f} MiB |")
    print(f"| RSS after the last unload, against idle | {churned['rss_last_mib']:.0f} MiB "
          f"({churned['rss_last_mib'] / churned['rss_idle_mib']:.2f}x) | <= {1 + RETURN_WITHIN:.2f}x |")
    print()
    print(f"| m1 beside m2 and m3 (loaded: {', '.join(timings['loaded_beside'])}) against m1 alone, "
          f"{args.rounds} rounds of {args.streams} streams x {args.new} tokens | median (per round) | target |")
    print("|---|---|---|")
    print(f"| decode tok/s alone | {statistics.median(r['alone_tok_s'] for r in rows):.0f} "
          f"({listed([r['alone_tok_s'] for r in rows])}) | |")
    print(f"| decode tok/s beside | {statistics.median(r['beside_tok_s'] for r in rows):.0f} "
          f"({listed([r['beside_tok_s'] for r in rows])}) | |")
    print(f"| decode, beside over alone | {statistics.median(decode):.3f} "
          f"({listed(decode, '.3f')}) | within {SPEED_WITHIN:.0%} |")
    print(f"| TTFT alone / beside | {statistics.median(r['alone_ttft_ms'] for r in rows):.1f} / "
          f"{statistics.median(r['beside_ttft_ms'] for r in rows):.1f} ms | |")
    print(f"| TTFT, beside over alone | {statistics.median(ttft):.3f} ({listed(ttft, '.3f')}) | "
          f"within {SPEED_WITHIN:.0%} |")
    for problem in problems:
        print(f"check failed: {problem}", file=sys.stderr)
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()

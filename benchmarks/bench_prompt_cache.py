"""An agent's first token: a request that offers ``bench_tools.py``'s 20 tools, cold, warm in the
same process, and after a restart with the prompt cache on disk (``--prompt-cache``), through real
``llama-chat serve`` processes; ``llama-server`` beside it, cold and warm with its ``cache_prompt``;
both with the file's whole context (``-c 0``).

    python benchmarks/bench_prompt_cache.py FILE.gguf [--rounds 3] [--threads 2] [--no-llama-cpp]

The request is the chat's text on ``/v1/completions`` (a system message, the question and the 20
tools as Qwen 2.5's template renders them, so both servers read the same text). Each round,
greedy, one streamed request at a time, the time from sending to the first token
(``bench_tools.first_token_s``):

* **cold**: a new server without the cache, its first request;
* **warm**: the same server, the same request again (its pages from the pool's prefix cache);
* **restart**: a server with ``--prompt-cache DIR`` answers the request once (writing its pages),
  is stopped, and a new one on the same folder answers it again: that second server's time;
  its first token's log-probabilities must equal the cold run's.

llama.cpp's ``llama-server`` (``llama_cpp_peer.py``'s build) gets the same text on
``/completion``, one slot: cold (``cache_prompt`` false), then warm (the same prompt with
``cache_prompt`` true, after one that filled the slot), to its first streamed token. It has no
cache that outlives the process. Target: after a restart under 10 % of cold, with the first
token's log-probabilities as cold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import httpx

import llama_cpp_peer as peer_mod
from bench_kv_memory import free_port, wait_ready
from bench_serve import child_env, llama_chat, stop
from bench_speculative import CACHE, machine
from bench_tools import QUESTION, TEMPLATE, first_token_s, tools

START_S = 600.0
# The longest wait for a server's answer: a cold prefill of the request sends nothing before its
# first token, and takes minutes on a 1.5B model's shape on two cores.
REQUEST_S = 3600.0
# Both servers get the file's whole context (``-c 0``): the request is longer than llama-chat's
# default context on a long model.
FULL_CONTEXT = ("-c", "0")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def serve(model: str, work: Path, threads: int, *extra: str) -> tuple[subprocess.Popen, str]:
    """A ``llama-chat serve`` of ``model`` on a free port, once its /health says ready."""
    port = free_port()
    out = open(work / f"serve-{port}.log", "wb")
    proc = subprocess.Popen([*llama_chat(), "serve", "-m", model, "--port", str(port), "--max-batch", "1",
                             *FULL_CONTEXT, *extra],
                            stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                            env={**child_env(), "OMP_NUM_THREADS": str(threads)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited {proc.returncode}: {Path(out.name).read_text(errors='replace')[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit("the server did not answer /health 200 in time")


def agent_prompt(model: str) -> str:
    """The agent's request as text: a system message, the question and the 20 tools, rendered by
    Qwen 2.5's template as ``bench_tools.py`` renders them (Hermes' tool descriptions)."""
    from llama_chat.model.chat_format import HFTemplateChatFormat, Message
    from llama_chat.model.loader import load_model

    tokenizer = load_model(model, device="cpu").tokenizer
    chat_format = HFTemplateChatFormat(TEMPLATE.read_text(), tokenizer, bos_token="", eos_token="<|im_end|>")
    return chat_format.render([Message("system", "You are a helpful assistant with tools."),
                               Message("user", QUESTION)], tools=tools())


def request(prompt: str, *, logprobs: bool = False) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            **({"logprobs": 3} if logprobs else {})}


def first_logprobs(url: str, prompt: str) -> tuple[dict[str, float], int]:
    """The first token's top log-probabilities of a non-streamed answer, and its prompt tokens."""
    response = httpx.post(f"{url}/v1/completions", json=request(prompt, logprobs=True), timeout=REQUEST_S)
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["choices"][0]["logprobs"]["top_logprobs"][0], answer["usage"]["prompt_tokens"]


def ttft(url: str, prompt: str) -> float:
    return first_token_s(url, "/v1/completions", request(prompt), timeout=REQUEST_S)


def ours(model: str, prompt: str, work: Path, threads: int, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"cold": [], "warm": [], "restart": [], "disk_tokens": [], "difference": [],
                                     "prompt_tokens": []}
    for r in range(rounds):
        proc, url = serve(model, work, threads)
        try:
            times["cold"].append(ttft(url, prompt))
            times["warm"].append(ttft(url, prompt))
        finally:
            stop(proc)
        folder = work / f"prompt-cache-{r}"
        proc, url = serve(model, work, threads, "--prompt-cache", str(folder))
        try:
            cold_logprobs, prompt_tokens = first_logprobs(url, prompt)  # cold too: it writes the pages
        finally:
            stop(proc)  # the blocks queued are written before it exits
        proc, url = serve(model, work, threads, "--prompt-cache", str(folder))
        try:
            times["restart"].append(ttft(url, prompt))
            # Read before the next request, which reads from disk too what the pool gave back.
            metrics = httpx.get(f"{url}/metrics", timeout=60).text
            again, _ = first_logprobs(url, prompt)
        finally:
            stop(proc)
        assert sorted(again) == sorted(cold_logprobs), f"other top tokens after the restart: {again} {cold_logprobs}"
        times["prompt_tokens"].append(prompt_tokens)
        times["difference"].append(max(abs(again[t] - cold_logprobs[t]) for t in again))
        times["disk_tokens"].append(next(float(line.split()[1]) for line in metrics.splitlines()
                                         if line.startswith("llama_chat_prompt_cache_disk_tokens_total ")))
        log(f"round {r}: cold {times['cold'][-1]:.3f} s, warm {times['warm'][-1]:.3f} s, restart "
            f"{times['restart'][-1]:.3f} s ({times['disk_tokens'][-1]:.0f} tokens from disk; top-3 log-probabilities "
            f"{times['difference'][-1]:.2g} from the cold run's)")
    return times


def llama_server(server: Path, model: str, prompt: str, threads: int, rounds: int) -> dict[str, list[float]]:
    """llama-server's time to its first streamed token, cold and warm (``cache_prompt``)."""
    port = free_port()
    proc = subprocess.Popen([str(server), "-m", model, "--port", str(port), "-np", "1", *FULL_CONTEXT,
                             "-t", str(threads), "--no-webui", "--temp", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    times: dict[str, list[float]] = {"cold": [], "warm": []}

    def first(cache: bool) -> float:
        body = json.dumps({"prompt": prompt, "n_predict": 4, "temperature": 0, "cache_prompt": cache,
                           "stream": True}).encode()
        sent = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                      headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(sent, timeout=REQUEST_S) as response:
            for line in response:
                if line.startswith(b"data: "):
                    return time.perf_counter() - start
        raise AssertionError("llama-server sent no token")

    try:
        wait_ready(port, proc)
        for _ in range(rounds):
            times["cold"].append(first(False))
            first(True)  # the slot holds the prompt
            times["warm"].append(first(True))
    finally:
        stop(proc)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a GGUF file (llama.cpp reads the same)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama-cpp", action="store_true")
    args = ap.parse_args()
    prompt = agent_prompt(args.model)
    with tempfile.TemporaryDirectory() as work:
        times = ours(args.model, prompt, Path(work), args.threads, args.rounds)
    tokens = int(times["prompt_tokens"][0])
    cpp: dict[str, list[float]] = {}
    if not args.no_llama_cpp:
        server = peer_mod.ensure_llama_cpp(CACHE, log=log).bench.parent / "llama-server"
        cpp = llama_server(server, args.model, prompt, args.threads, args.rounds)
    print(f"\nAn agent's first token, {Path(args.model).name}: the 20-tool request ({tokens} prompt tokens), "
          f"medians of {args.rounds} rounds; {machine()}\n")
    print("| | llama-chat (s) | of its cold | llama-server (s) | of its cold |")
    print("|---|---|---|---|---|")
    cold, cpp_cold = statistics.median(times["cold"]), statistics.median(cpp["cold"]) if cpp else None
    for name in ("cold", "warm", "restart"):
        value = statistics.median(times[name])
        theirs = statistics.median(cpp[name]) if cpp and name in cpp else None
        print(f"| {name} | {value:.3f} | **{value / cold:.1%}** | "
              + (f"{theirs:.3f} | {theirs / cpp_cold:.1%} |" if theirs is not None else "- | - |"))
    print(f"\nAfter the restart, {statistics.median(times['disk_tokens']):.0f} prompt tokens came from disk; "
          f"the first token's top-3 log-probabilities were at most {max(times['difference']):.2g} from the cold "
          f"run's; load {os.getloadavg()[0]:.1f} at the end.")


if __name__ == "__main__":
    main()

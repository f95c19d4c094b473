"""The KV cache's memory, fidelity and speed by cache type (``--cache-type``), beside llama.cpp's
with the same ``-ctk``/``-ctv``, measured in the same run.

    python benchmarks/bench_kv_memory.py memory -m default -m FILE.gguf [--conversations 16 --tokens 2000]
    python benchmarks/bench_kv_memory.py quality FILE.gguf [FILE.gguf ...] [--ctx 512]
    python benchmarks/bench_kv_memory.py speed FILE.gguf [--depth 4096]

memory: ``llama-chat serve`` and llama.cpp's ``llama-server``, one after the other, each with 16
slots of the same context and the same cache type: the resident memory (VmRSS) at rest after
loading and one short completion, its peak while ``--conversations`` completions of about ``--tokens`` tokens each (distinct
texts, so no prefix is shared) run at once, and 30 s after they end. Against two yardsticks: the
weights + 300 MB at rest, and the weights + the tokens held times the bytes a token keeps under
load.

quality: for each cache type, the file's next-token distributions with that cache against the
same with a float32 cache, over the second half of ``--ctx`` tokens of the docs' text (the first
half as a prompt in one pass, then a token per step, as the command generates): mean KL
divergence and how often the top token is the same; q4_0 with its keys kept by the model's
measure (``model/key_centers.py``, as the command keeps them) and as they are. llama.cpp's: ``llama-perplexity
--kl-divergence`` of each ``-ctk``/``-ctv`` against its own f32 cache's base file, one chunk of
the same size. ``--dtype float32`` expands the file's blocks first: a packed product rounds its
input to int8 blocks, so on the file's own blocks a difference of one float16 step in a key can
flip a rounding and move the logits as much as the cache's whole error.

speed: one row decoding greedily at ``--depth`` positions of context (random keys and values:
the time does not depend on them), milliseconds a token, by cache type, beside ``llama-bench
-d DEPTH -n N`` with the same types (flash attention on: llama.cpp's quantized V needs it).

llama.cpp is the build of ``llama_cpp_peer.py`` (built once into the cache, llama-server with it).
Prints markdown tables with the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

import llama_cpp_peer as peer_mod
from bench_serve import stop

REPO = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "llama-chat-bench"
TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
SLOTS = 16
SETTLE_S = 30.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip().split("load average:")[-1]
    return f"{name}, {os.cpu_count()} cores, load average{load}"


def mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


# -- memory ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What the memory's yardsticks need of a model."""

    weights: int  # bytes
    token_bytes: int  # bytes a token keeps in the cache, all layers, under the cache type
    context: int
    texts: list[str]  # one prompt a conversation


def shape_of(model: str, cache_type: str, conversations: int, tokens: int) -> Shape:
    from llama_chat.model.kv_types import TYPES as KV
    from llama_chat.model.loader import load_model
    from llama_chat.model.stores import default_model_dir

    path = default_model_dir() if model == "default" else Path(model)
    loaded = load_model(path, device="cpu")
    a = loaded.args
    weights = path.stat().st_size if path.is_file() else sum(
        p.numel() * p.element_size() for p in loaded.model.parameters())
    context = min(a.max_seq_len, tokens + 32)
    words = " ".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("*.md"))).split()
    texts = []
    for i in range(conversations):
        rng = random.Random(i)
        ids = loaded.tokenizer.encode(f"Conversation {i}: " + " ".join(rng.choice(words) for _ in range(2 * tokens)))
        texts.append(loaded.tokenizer.decode(ids[:context - 48]))
    token_bytes = 2 * a.n_layers * a.n_kv_heads * KV[cache_type].token_bytes(a.head_dim)
    return Shape(weights, token_bytes, context, texts)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server was not ready in time")


def model_id(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def complete(port: int, model: str, text: str) -> int:
    """One completion; the tokens its job held (prompt and completion)."""
    body = json.dumps({"model": model, "prompt": text, "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        usage = json.load(r)["usage"]
    return usage["prompt_tokens"] + usage["completion_tokens"]


@dataclass(frozen=True)
class MemoryRun:
    idle: int
    peak: int
    after: int
    held: int  # tokens held at once, all conversations
    seconds: float


def measure_server(command: list[str], port: int, texts: list[str]) -> MemoryRun:
    log("  " + " ".join(command))
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, proc)
        model = model_id(port)
        # At rest after one short completion: llama-server runs a warm-up pass as it starts, and a
        # weight read in place from the file counts once a first pass has read it.
        complete(port, model, "Hello")
        time.sleep(3.0)
        idle = rss(proc.pid)
        held: list[int] = []
        threads = [threading.Thread(target=lambda t=t: held.append(complete(port, model, t))) for t in texts]
        start = time.monotonic()
        for t in threads:
            t.start()
        peak = idle
        while any(t.is_alive() for t in threads):
            peak = max(peak, rss(proc.pid))
            time.sleep(0.2)
        seconds = time.monotonic() - start
        if len(held) != len(texts):
            raise RuntimeError(f"{len(texts) - len(held)} completions failed")
        time.sleep(SETTLE_S)
        return MemoryRun(idle, peak, rss(proc.pid), sum(held), seconds)
    finally:
        stop(proc)


def memory(args, peer) -> None:
    server = peer.bench.parent / "llama-server"
    ours = shutil.which("llama-chat") or str(Path(sys.executable).parent / "llama-chat")
    print(f"\nKV memory under `serve`, {SLOTS} slots, cache type {args.cache_type}, "
          f"{args.conversations} conversations of up to {args.tokens} tokens at once; {machine()}\n")
    print("| model | server | idle RSS | / (weights + 300 MB) | peak RSS | tokens held | "
          "/ (weights + held x bytes) | (peak - idle) / (held x bytes) | RSS 30 s after | / idle | burst s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.model:
        shape = shape_of(model, args.cache_type, args.conversations, args.tokens)
        name = "shipped" if model == "default" else Path(model).name
        at_rest, servers = shape.weights + 300e6, [("llama-chat", [
            ours, "serve", "-m", model, "--max-batch", str(SLOTS), "-c", str(shape.context), "--cache-type",
            args.cache_type, "--quiet", "--port"])]
        if model != "default":  # llama.cpp reads GGUF files only
            servers.append(("llama-server", [
                str(server), "-m", model, "-np", str(SLOTS), "-c", str(SLOTS * shape.context), "-ctk", args.cache_type,
                "-ctv", args.cache_type, "-fa", "on", "-t", str(args.threads), "--no-webui", "--port"]))
        for who, command in servers:  # each row as soon as it is measured
            port = free_port()
            run = measure_server([*command, str(port)], port, shape.texts)
            loaded = shape.weights + run.held * shape.token_bytes
            grown = (run.peak - run.idle) / (run.held * shape.token_bytes)
            print(f"| {name} | {who} | {mb(run.idle)} | {run.idle / at_rest:.2f} | {mb(run.peak)} | {run.held} | "
                  f"{run.peak / loaded:.2f} | {grown:.2f} | {mb(run.after)} | {run.after / run.idle:.2f} | "
                  f"{run.seconds:.0f} |", flush=True)


# -- quality ---------------------------------------------------------------------------------------


def docs_text() -> str:
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("*.md")))


def text_ids(tokenizer, ctx: int) -> list[int]:
    return tokenizer.encode(docs_text())[:ctx]


def generated_log_probs(model, args_, ids: list[int], kind, centers=None) -> torch.Tensor:
    """As the server generates, over pages of ``kind`` (keys kept by ``centers`` where the type
    does): the first half of ``ids`` in one pass of the model's forward, then a token per step
    through the CPU operator; the log-probabilities of the second half's positions. Every type
    takes the same paths, so only the cache differs."""
    from llama_chat.model import cpu_decode
    from llama_chat.model.paged_kv_cache import PagedBatch, PagedKVCache

    page = 16
    ctx, first = len(ids), len(ids) // 2
    pages = -(-ctx // page)
    cache = PagedKVCache.for_model(args_, pages + 1, page, dtype=kind)
    cache.center_keys_by(centers)
    table = list(range(1, pages + 1))
    t = torch.tensor([ids])
    with torch.inference_mode():
        prompt = PagedBatch(torch.arange(page, page + first + 1), torch.arange(first + 1), 0, None,
                            ((0, first + 1, torch.tensor(table[:first // page + 1]), 0),))
        rows = [model(t[:, :first + 1], torch.arange(first + 1).unsqueeze(0), cache.view(prompt))[0, -1]]
        decoder = cpu_decode.PagedDecoder(model, cache)
        for pos in range(first + 1, ctx - 1):
            rows.append(decoder([ids[pos]], [pos], [table[:pos // page + 1]])[0])
    return torch.log_softmax(torch.stack(rows).float(), dim=-1)


def agreement(base: torch.Tensor, ours: torch.Tensor) -> tuple[float, float]:
    p = base.exp()
    kld = float((p * (base - ours)).sum(-1).mean())
    return kld, float((ours.argmax(-1) == base.argmax(-1)).float().mean())


def llama_cpp_quality(tool: Path, path: Path, text: Path, ctx: int, threads: int, work: Path) -> dict:
    base = work / f"{path.stem}.kld"
    common = ["-m", str(path), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "--chunks", "1", "-t", str(threads),
              "-fa", "on"]
    r = subprocess.run([str(tool), *common, "-ctk", "f32", "-ctv", "f32", "--kl-divergence-base", str(base)],
                       capture_output=True, text=True)
    if r.returncode:
        raise peer_mod.PeerError(f"llama-perplexity base: {(r.stdout + r.stderr)[-600:]}")
    out = {}
    for name in TYPES[1:]:
        r = subprocess.run([str(tool), *common, "-ctk", name, "-ctv", name, "--kl-divergence-base", str(base),
                            "--kl-divergence"], capture_output=True, text=True)
        text_out = r.stdout + r.stderr
        kld = re.search(r"Mean\s+KLD:\s+(-?[0-9.]+)", text_out)
        same = re.search(r"Same top p:\s+([0-9.]+)", text_out)
        out[name] = (float(kld.group(1)), float(same.group(1)) / 100) if kld and same else None
    return out


def quality(args, peer) -> None:
    from llama_chat.ml.cpu import kernels as cpu_kernels
    from llama_chat.model import key_centers
    from llama_chat.model.kv_types import TYPES as KV
    from llama_chat.model.loader import load_model

    print(f"\nKV cache types against a float32 cache: mean KL divergence and same top token, {args.ctx // 2 - 1} "
          f"generated positions of the docs' text, weights {args.dtype}; {machine()}\n")
    print("| file | type | KL llama-chat | same top | KL llama.cpp | same top |")
    print("|---|---|---|---|---|---|")
    work = Path(tempfile.mkdtemp(prefix="kvq-"))
    for file in args.files:
        path = Path(file)
        loaded = load_model(path, device="cpu", dtype=args.dtype)
        model = loaded.model.eval()
        cpu_kernels.load()  # float32 weights too: every type read by the operator
        model.fuse_projections()
        ids = text_ids(loaded.tokenizer, args.ctx)
        # llama.cpp cuts its own chunk of the same text (it asks for twice the context's tokens).
        (work / "text.txt").write_text(docs_text(), encoding="utf-8")
        theirs = llama_cpp_quality(peer.bench.parent / "llama-perplexity", path, work / "text.txt", args.ctx,
                                   args.threads, work)
        base = None if args.peer_only else generated_log_probs(model, loaded.args, ids, KV["f32"])
        # As the scheduler keeps them: measured over the module's own paragraph, not this text.
        centers = key_centers.of_model(model, loaded.tokenizer)
        # q4_0 twice: its keys kept by the model's measure, as the command keeps them, and as they are.
        rows = [(n, KV[n], centers) for n in TYPES[1:]] + [("q4_0, keys as they are", KV["q4_0"], None)]
        for label, kind, measure in rows:
            if base is None:
                kld, same = math.nan, math.nan
            else:
                kld, same = agreement(base, generated_log_probs(model, loaded.args, ids, kind, measure))
            peer_row = theirs.get(kind.name)
            peer_text = f"{peer_row[0]:.6f} | {peer_row[1]:.3f}" if peer_row else "- | -"
            print(f"| {path.name} | {label} | {kld:.6f} | {same:.3f} | {peer_text} |", flush=True)


# -- speed -----------------------------------------------------------------------------------------


def decode_ms(model, args_, kinds: dict, depth: int, steps: int, centers=None) -> dict[str, float]:
    """Milliseconds a token of one row decoding greedily through the operator at ``depth``, by
    cache type (q4_0's keys kept by ``centers``, as the command keeps them): a step of each type
    in turn, so that the machine's load falls on all alike."""
    from llama_chat.model import cpu_decode
    from llama_chat.model.paged_kv_cache import PagedKVCache

    page = 16
    pages = -(-(depth + steps) // page)
    table = list(range(1, pages + 1))
    decoders, times = {}, {}
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, kind in kinds.items():
            cache = PagedKVCache.for_model(args_, pages + 1, page, dtype=kind)
            cache.center_keys_by(centers)
            for store, keys in [(s, True) for s in cache.keys] + [(s, False) for s in cache.values]:
                store[:, 1:] = kind.store(torch.randn(store.shape[0], pages, page, args_.head_dim, generator=g),
                                          keys=keys)
            decoders[name], times[name] = cpu_decode.PagedDecoder(model, cache), []
        for pos in range(depth, depth + steps):
            for name, decoder in decoders.items():
                t0 = time.perf_counter()
                decoder.pick(1, pos, table[:pos // page + 1])
                times[name].append(time.perf_counter() - t0)
    return {name: 1000 * sorted(t)[len(t) // 2] for name, t in times.items()}


def llama_bench_ms(bench: Path, path: Path, name: str, depth: int, steps: int, threads: int) -> float | None:
    r = subprocess.run([str(bench), "-m", str(path), "-p", "0", "-n", str(steps), "-d", str(depth), "-ctk", name,
                        "-ctv", name, "-fa", "on", "-t", str(threads), "-r", "2", "-o", "json"],
                       capture_output=True, text=True)
    try:
        rows = json.loads(r.stdout)
        return 1000 / rows[0]["avg_ts"]
    except (ValueError, IndexError, KeyError):
        log(f"llama-bench {name}: {(r.stdout + r.stderr)[-400:]}")
        return None


def speed(args, peer) -> None:
    from llama_chat.ml.cpu import kernels as cpu_kernels
    from llama_chat.model.kv_types import TYPES as KV
    from llama_chat.model.loader import load_model

    from llama_chat.model import key_centers

    torch.set_num_threads(args.threads)
    print(f"\nDecode at {args.depth} positions of context, median ms a token ({args.steps} tokens), "
          f"{args.threads} threads; {machine()}\n")
    print("| file | type | llama-chat ms | / f32 | llama.cpp ms | / f16 | llama-chat / llama.cpp |")
    print("|---|---|---|---|---|---|---|")
    for file in args.files:
        path = Path(file)
        loaded = load_model(path, device="cpu", max_seq_len=args.depth + args.steps)
        model = loaded.model.eval()
        cpu_kernels.prepare(model)
        model.fuse_projections()
        ours = decode_ms(model, loaded.args, {n: KV[n] for n in TYPES}, args.depth, args.steps,
                         key_centers.of_model(model, loaded.tokenizer))
        # llama-bench takes no f32 cache: its types against its f16.
        theirs = {n: llama_bench_ms(peer.bench, path, n, args.depth, args.steps, args.threads) for n in TYPES[1:]}
        for n in TYPES:
            t = theirs.get(n)
            peer_text = (f"{t:.1f} | {t / theirs['f16']:.2f} | {ours[n] / t:.2f}" if t and theirs["f16"]
                         else "- | - | -")
            print(f"| {path.name} | {n} | {ours[n]:.1f} | {ours[n] / ours['f32']:.2f} | {peer_text} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    m = sub.add_parser("memory")
    m.add_argument("-m", "--model", action="append", required=True, help="default (the shipped model) or a GGUF file")
    m.add_argument("--cache-type", default="f16", choices=TYPES)
    m.add_argument("--conversations", type=int, default=SLOTS)
    m.add_argument("--tokens", type=int, default=2000)
    q = sub.add_parser("quality")
    q.add_argument("files", nargs="+")
    q.add_argument("--ctx", type=int, default=512)
    q.add_argument("--peer-only", action="store_true", help="llama.cpp's columns only")
    q.add_argument("--dtype", default="auto", choices=("auto", "float32"),
                   help="auto: the file's blocks as the command runs them; float32: expanded")
    s = sub.add_parser("speed")
    s.add_argument("files", nargs="+")
    s.add_argument("--depth", type=int, default=4096)
    s.add_argument("--steps", type=int, default=32)
    for p in (m, q, s):
        p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    try:
        peer = peer_mod.ensure_llama_cpp(CACHE, log=log)
    except peer_mod.PeerError as e:
        print(f"llama.cpp: {e}", file=sys.stderr)
        return 1
    {"memory": memory, "quality": quality, "speed": speed}[args.what](args, peer)
    return 0


if __name__ == "__main__":
    sys.exit(main())

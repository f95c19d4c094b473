"""Make the default model end to end: corpus -> tokenizer -> training -> package data.

    python scripts/train_default_model.py            # the shipped model (CPU, 2 threads)
    python scripts/train_default_model.py --prepare-only   # corpus and tokenizer only (and hashes)

Writes ``model/default_model/{params.json, consolidated.00.pth, tokenizer.model}``,
``docs/default-model-loss.png``, and under ``scripts/default_model_work/`` the corpus, the loss log
(``loss.csv``), a resumable training state and ``summary.json``. The same seed gives the same
corpus and tokenizer bytes. The training is seeded too (initial weights, window offsets), so the
same machine, torch build and thread count should give the same weights; that has not been checked
with a second full run (it takes about 35 minutes on two shared cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

import sentencepiece as spm
import torch

from default_model import corpus, tokenizer
from default_model.data import encode_documents, fixed_windows
from default_model.export import export
from default_model.plot import plot_loss
from default_model.train import TrainConfig, train
from llama_chat.model.args import ModelArgs
from llama_chat.model.transformer import Transformer

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "scripts" / "default_model_work"
PACKAGE_DIR = ROOT / "model" / "default_model"
LOSS_PNG = ROOT / "docs" / "default-model-loss.png"

VOCAB_SIZE = 1024
TRAIN_DOCS = 40_000
VAL_DOCS = 1_000


def model_args() -> ModelArgs:
    # Grouped-query attention (8 query heads share 2 key/value heads), tied embeddings: about 3M
    # parameters, 6 MB in float16, and fast enough to train on two CPU cores in under an hour.
    return ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=VOCAB_SIZE, hidden_dim=704,
                     max_seq_len=512, tie_embeddings=True)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare(seed: int, work: Path) -> tuple[Path, Path, Path]:
    train_jsonl, val_jsonl = corpus.write(seed, TRAIN_DOCS, VAL_DOCS, work / "corpus")
    segments = (s for doc in corpus.read(train_jsonl) for s in doc)
    tok = tokenizer.train(segments, work / "tokenizer.model", VOCAB_SIZE)
    for p in (train_jsonl, val_jsonl, tok):
        print(f"{sha256(p)}  {p.name}", flush=True)
    return train_jsonl, val_jsonl, tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--out", type=Path, default=PACKAGE_DIR)
    ap.add_argument("--loss-png", type=Path, default=LOSS_PNG)
    ap.add_argument("--prepare-only", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="ignore a saved training state")
    # The shipped model was made with the defaults: seed 0, 1400 steps, 2 threads.
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    train_jsonl, val_jsonl, tok_path = prepare(a.seed, a.work)
    if a.prepare_only:
        return
    sp = spm.SentencePieceProcessor(model_file=str(tok_path))
    stream = encode_documents(sp, corpus.read(train_jsonl))
    val_stream = encode_documents(sp, corpus.read(val_jsonl))
    cfg = TrainConfig(steps=a.steps, eval_every=a.eval_every, seed=a.seed)
    val = fixed_windows(val_stream, 32, cfg.seq_len)
    print(f"train tokens {stream.numel():,}  val tokens {val_stream.numel():,}  prep {time.perf_counter() - t0:.0f}s",
          flush=True)

    args = model_args()
    torch.manual_seed(a.seed)
    model = Transformer(args)
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(a.seed))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {args}  parameters {n_params:,}", flush=True)

    state_path = a.work / "train_state.pt"
    if a.fresh and state_path.exists():
        state_path.unlink()
    result = train(model, stream, val, cfg, a.work / "loss.csv", state_path)

    files = export(model.eval(), tok_path, a.out)
    plot_loss(a.work / "loss.csv", a.loss_png)
    summary = {
        "seed": a.seed, "threads": a.threads, "parameters": n_params, "model": args.to_params_json(),
        "train": asdict(cfg), "train_tokens_in_corpus": stream.numel(), **result,
        "total_s": time.perf_counter() - t0,
        "files": {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files},
        "corpus_sha256": {p.name: sha256(p) for p in (train_jsonl, val_jsonl)},
    }
    (a.work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2), flush=True)


if __name__ == "__main__":
    main()

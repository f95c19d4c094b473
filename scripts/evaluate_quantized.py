"""The shipped model's validation loss with float32 and with ``--quantize int8`` weights.

    python scripts/evaluate_quantized.py [--windows 32] [--decode-windows 4]

The validation windows are the training script's (32 fixed windows of 512 tokens of the
validation documents). Three figures, each a mean cross-entropy over the same targets:

* float32: whole windows through the model (one per forward), as training measured it;
* int8, prefill kernel: the same forwards with int8 weights (on x86, fbgemm's product: the
  activations rounded to 7 bits, one range per 64 rows of similar magnitude);
* int8, decode kernel: the first ``--decode-windows`` windows fed one token at a time through the
  KV cache, so every product is the one-row kernel a decode step uses: our operator
  (``ml/cpu/kernels.cpp``, activations rounded to 2^-14 of their largest) as the command loads it
  for an int8 model, or fbgemm's product (7 bits) where it does not build; the float32 loss of
  the same windows is printed beside it, through the same operator.

The perplexity rise is ``exp(int8 loss - float32 loss) - 1``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import sentencepiece as spm
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_model import corpus  # noqa: E402
from default_model.data import encode_documents, fixed_windows  # noqa: E402
from llama_chat.ml.cpu import kernels as cpu_kernels  # noqa: E402
from llama_chat.ml.quantize import quantize_model  # noqa: E402
from llama_chat.model.kv_cache import KVCache  # noqa: E402
from llama_chat.model.loader import default_model_dir, load_model  # noqa: E402
from train_default_model import VAL_DOCS  # noqa: E402

SEED = 0


def windows(count: int) -> torch.Tensor:
    sp = spm.SentencePieceProcessor(model_file=str(default_model_dir() / "tokenizer.model"))
    stream = encode_documents(sp, corpus.documents(SEED + 1_000_003, VAL_DOCS))
    return fixed_windows(stream, count, 512)


@torch.inference_mode()
def whole_loss(model, ws: torch.Tensor) -> float:
    total = 0.0
    for w in ws.split(1):  # one window per forward: 511 rows, as long as a CPU prefill chunk
        logits = model(w[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1)).item() * len(w)
    return total / len(ws)


@torch.inference_mode()
def stepwise_loss(model, ws: torch.Tensor) -> float:
    losses = []
    for w in ws:
        cache = KVCache.for_model(model.args, 1, max_seq_len=w.numel())
        for pos in range(w.numel() - 1):
            logits = model(w[pos:pos + 1].view(1, 1), torch.tensor([[pos]]), cache)
            losses.append(F.cross_entropy(logits[0], w[pos + 1:pos + 2]).item())
    return sum(losses) / len(losses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--decode-windows", type=int, default=4)
    a = ap.parse_args()
    ws = windows(a.windows)
    fp32 = load_model(default_model_dir(), device="cpu", dtype="float32").model.eval()
    int8 = load_model(default_model_dir(), device="cpu", dtype="float32").model.eval()
    int8.fuse_projections()
    quantize_model(int8)
    cpu_kernels.prepare(int8)  # as an engine does for an int8 model
    rows = [("float32", whole_loss(fp32, ws)), ("int8, prefill kernel", whole_loss(int8, ws))]
    few = ws[:a.decode_windows]
    rows += [(f"float32, {len(few)} windows token by token", stepwise_loss(fp32, few)),
             (f"int8, decode kernel, {len(few)} windows token by token", stepwise_loss(int8, few))]
    print("| weights | validation loss | perplexity | perplexity rise |\n|---|---|---|---|")
    base = {0: rows[0][1], 1: rows[0][1], 2: rows[2][1], 3: rows[2][1]}
    for i, (name, loss) in enumerate(rows):
        print(f"| {name} | {loss:.4f} | {math.exp(loss):.4f} | {math.exp(loss - base[i]) - 1:+.2%} |")


if __name__ == "__main__":
    main()

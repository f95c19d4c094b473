"""The shipped model's validation loss with float32 weights and with each ``--quantize`` mode.

    python scripts/evaluate_quantized.py [--windows 32] [--decode-windows 4] [--modes int8 q8_0 q4_0]

The validation windows are the training script's (32 fixed windows of 512 tokens of the
validation documents). Each mode's model is loaded as the command loads it
(``load_model(quantize=mode)``, then fused as an engine fuses it). Figures, each a mean
cross-entropy over the same targets:

* float32: whole windows through the model (one per forward), as training measured it;
* MODE, prefill kernel: the same forwards with the quantized weights: for int8 on x86, fbgemm's
  product (the activations rounded to 7 bits, one range per 64 rows of similar magnitude); for
  q8_0 and q4_0, the packed product (``ml/packed.py``: the activations rounded to int8 steps per
  32 values, as llama.cpp rounds them against those blocks);
* MODE, decode kernel: the first ``--decode-windows`` windows fed one token at a time through the
  KV cache, so every product is the one a decode step uses: for int8 our operator
  (``ml/cpu/kernels.cpp``, activations rounded to 2^-14 of their largest) as the command loads it,
  or fbgemm's product (7 bits) where it does not build; for q8_0 and q4_0 the packed product; the
  float32 loss of the same windows is printed beside them, through the same operator.

The perplexity rise is ``exp(mode's loss - float32 loss) - 1``.
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
from llama_chat.ml.controls import QUANTIZE_MODES  # noqa: E402
from llama_chat.ml.cpu import kernels as cpu_kernels  # noqa: E402
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
    ap.add_argument("--modes", nargs="+", choices=[m for m in QUANTIZE_MODES if m != "none"],
                    default=[m for m in QUANTIZE_MODES if m != "none"])
    a = ap.parse_args()
    ws = windows(a.windows)
    few = ws[:a.decode_windows]
    fp32 = load_model(default_model_dir(), device="cpu", dtype="float32").model.eval()
    whole, stepwise = [("float32", whole_loss(fp32, ws))], [("float32", stepwise_loss(fp32, few))]
    for mode in a.modes:
        model = load_model(default_model_dir(), device="cpu", quantize=mode).model.eval()
        model.fuse_projections()
        cpu_kernels.prepare(model)  # as an engine does for a quantized model
        whole.append((f"{mode}, prefill kernel", whole_loss(model, ws)))
        stepwise.append((f"{mode}, decode kernel", stepwise_loss(model, few)))
    print("| weights | validation loss | perplexity | perplexity rise |\n|---|---|---|---|")
    for rows, where in ((whole, f"{len(ws)} windows whole"), (stepwise, f"{len(few)} windows token by token")):
        for name, loss in rows:
            print(f"| {name}, {where} | {loss:.4f} | {math.exp(loss):.4f} | {math.exp(loss - rows[0][1]) - 1:+.2%} |")


if __name__ == "__main__":
    main()

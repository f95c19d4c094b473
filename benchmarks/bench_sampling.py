"""What drawing one row's token costs with top-p, by vocabulary size: the nucleus's candidates
found by the operator's one pass over the values near the row's largest (``ml/sampling.py``,
``NEAR_LARGEST``) against torch's ``topk`` pools alone, in turns in one run, with the tokens
checked equal.

Rows are a trained model's next-token logits where ``--model FILE`` names one (its vocabulary,
the positions of a few sentences), else made to fall off as a trained model's do: the k-th
likeliest token's logit about -1.6 ln k, plus noise (a nucleus of some twenty tokens), in a random order of ids.

    python benchmarks/bench_sampling.py [--model FILE.gguf] [--rows 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from llama_chat.ml.cpu import kernels
from llama_chat.ml.sampling import SamplingParams, sample

VOCABS = (32000, 151936, 262144)  # Llama 2's, Qwen2.5's and Gemma 3's
PARAMS = SamplingParams(temperature=0.8, top_p=0.95)  # the command's defaults


def zipf_rows(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    out = torch.empty(rows, vocab)
    for r in range(rows):
        falling = -1.6 * ranks.log() + 0.3 * torch.randn(vocab, generator=g)
        out[r, torch.randperm(vocab, generator=g)] = falling
    return out


def model_rows(path: str, rows: int) -> torch.Tensor:
    from llama_chat.model.loader import load_model

    loaded = load_model(path, device="cpu")
    text = ("Once upon a time, in a small village by the sea, there lived an old fisherman who knew every "
            "rock of the bay. Each morning he rowed out before the sun, and each evening the children ran "
            "down to the water to see what the nets had brought. def add(a, b):\n    return a + b\n")
    ids = loaded.tokenizer.encode(text * 4, bos=True)[: rows + 1]
    with torch.inference_mode():
        return loaded.model(torch.tensor([ids]))[0, 1:].float().contiguous()


def per_row_us(rows: torch.Tensor, uniforms: torch.Tensor) -> tuple[float, list[int]]:
    start = time.perf_counter()
    picks = [int(sample(rows[i:i + 1], PARAMS, uniforms[i:i + 1])) for i in range(rows.shape[0])]
    return (time.perf_counter() - start) / rows.shape[0] * 1e6, picks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model whose logits are the rows (else made-up ones)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if not kernels.load():
        print(f"the operator is not built here: {kernels.failure()}", file=sys.stderr)
        return 1
    sets = ([(Path(args.model).name, model_rows(args.model, args.rows))] if args.model
            else [(f"made-up, {v:,}", zipf_rows(args.rows, v, seed=v)) for v in VOCABS])
    print(f"\nOne row's top-p draw (t {PARAMS.temperature}, top-p {PARAMS.top_p}), µs a row, medians of "
          f"{args.rounds} rounds in turns; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}, torch threads {torch.get_num_threads()}\n")
    print("| rows | vocabulary | near the largest | topk pools | speed-up |")
    print("|---|---|---|---|---|")
    near_largest = kernels.near_largest
    for name, rows in sets:
        uniforms = torch.rand(rows.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        times: dict[str, list[float]] = {"near": [], "pools": []}
        for _ in range(args.rounds + 1):  # the first round warms up, untimed
            for way in times:
                kernels.near_largest = near_largest if way == "near" else (lambda *a: None)
                us, picks = per_row_us(rows, uniforms)
                times[way].append(us)
                if way == "near":
                    near_picks = picks
                elif picks != near_picks:
                    raise SystemExit(f"{name}: the two ways drew different tokens")
        kernels.near_largest = near_largest
        near, pools = (statistics.median(times[w][1:]) for w in ("near", "pools"))
        print(f"| {name} | {rows.shape[1]:,} | {near:.0f} | {pools:.0f} | **{pools / near:.2f}x** |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""MKL's float32 product (``F.linear``) against oneDNN's inner product, by weight shape and rows.

``ml/ops.py`` picks oneDNN for weights of at least ``ONEDNN_MIN_WEIGHT`` elements multiplied by at
most ``ONEDNN_MAX_ROWS`` rows; this prints the measurements that rule comes from, on this machine.
Each cell is ``F.linear`` time over oneDNN's (above 1: oneDNN is faster), the median of interleaved
runs (one after the other, so that a busy machine slows both alike), and ``*`` marks the cells
where the rule picks oneDNN. The shapes are the projections of the stories15M-, stories110M- and
TinyLlama-sized configs (fused q/k/v and gate/up, as the model runs them).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_products.py [--threads 2] [--rows 1,4,16,64,128,512]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from llama_chat.ml import ops

SHAPES = {
    "stories15M": [(864, 288), (288, 288), (1536, 288), (288, 768), (32000, 288)],
    "stories110M": [(2304, 768), (768, 768), (4096, 768), (768, 2048), (32000, 768)],
    "TinyLlama": [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (32000, 2048)],
}


def interleaved(first, second, calls: int, repeats: int = 7) -> tuple[float, float]:
    """Median seconds per call of each, measured in alternation."""
    first(), second()
    a, b = [], []
    for _ in range(repeats):
        for fn, out in ((first, a), (second, b)):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter() - start) / calls)
    return sorted(a)[repeats // 2], sorted(b)[repeats // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,16,64,128,512")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not ops._onednn_linear_available():
        raise SystemExit("oneDNN's inner product is not available here (an x86 build of PyTorch has it)")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"threads {args.threads}; F.linear time / oneDNN time; * = the rule picks oneDNN\n")
    print("| config | weight | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    with torch.inference_mode():
        for config, shapes in SHAPES.items():
            for n, k in shapes:
                weight = torch.randn(n, k)
                cells = []
                for r in rows:
                    x = torch.randn(r, k)
                    # About 0.1 s of each product per repeat.
                    calls = max(2, min(200, int(2e8 / (n * k * 4) / max(1.0, r / 16))))
                    mkl, onednn = interleaved(lambda: F.linear(x, weight),
                                              lambda: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], ""),
                                              calls)
                    cells.append(f"{mkl / onednn:.2f}{'*' if ops._onednn_pays(x, weight) else ''}")
                print(f"| {config} | {n} x {k} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

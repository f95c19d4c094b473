"""Our decode products (``ml/cpu/kernels.cpp``) against PyTorch's, all of a model's at once.

A decode step multiplies a few rows by every weight of the model once, and the weights do not fit
in the cache; so each measure here is one pass over all the projections of a config, as a step
makes it (fused q/k/v and gate/up, the classifier), with weights that are fresh memory, not cache:

* ours: ``torch.ops.llama_chat_cpu.matvec``;
* PyTorch's: what ``ops.linear`` / ``quantize.int8_linear`` use without ours: oneDNN's inner
  product for float32 (``F.linear`` where the weight is too small for it), ``F.linear`` for
  bfloat16, fbgemm's int8 product for int8;
* the read bound: a float32 sum over as many bytes, the machine's read speed with these threads.

The passes alternate (ours, PyTorch's, the sum), so that a busy machine slows them alike; medians
of ``--repeats``. Printed: milliseconds, GB/s, and PyTorch's time over ours (above 1: ours is
faster).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_cpu_kernels.py [--configs 15m,110m,1.1b]
        [--dtypes float32,bfloat16,int8] [--rows 1,16] [--threads 2] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the command runs (cmd/app.py)

import torch  # noqa: E402

from llama_chat.ml import ops, quantize  # noqa: E402
from llama_chat.ml.cpu import kernels as cpu_kernels  # noqa: E402

# (dim, hidden, layers, q/k/v width, vocabulary) of the configs bench_decode.py measures.
CONFIGS = {
    "15m": (288, 768, 6, 3 * 288, 32000),
    "110m": (768, 2048, 12, 3 * 768, 32000),
    "1.1b": (2048, 5632, 22, 2048 + 2 * 256, 32000),
}


def shapes(config: str) -> list[tuple[int, int]]:
    dim, hidden, layers, qkv, vocab = CONFIGS[config]
    return [(qkv, dim), (dim, dim), (2 * hidden, dim), (dim, hidden)] * layers + [(vocab, dim)]


def pytorch_product(x: torch.Tensor, weight: torch.Tensor, scales, packed) -> torch.Tensor:
    if packed is not None:
        return quantize.fbgemm_rows(x, packed)
    if weight.dtype == torch.float32 and ops._onednn_pays(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return torch.nn.functional.linear(x.to(weight.dtype), weight)


def measure(config: str, dtype: str, rows: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    weights, scales, packed = [], [], []
    for out_features, in_features in shapes(config):
        w = torch.randn(out_features, in_features, generator=g)
        if dtype == "int8":
            q = quantize.quantize_int8(w)
            weights.append(q.values)
            scales.append(q.scales)
            packed.append(quantize.pack_for_fbgemm(q) if quantize.fbgemm_available() else None)
        else:
            weights.append(w.to(getattr(torch, dtype)))
            scales.append(None)
            packed.append(None)
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=g) for w in weights}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flat = torch.randn(nbytes // 4, generator=g)

    def ours():
        for w, s in zip(weights, scales):
            cpu_kernels.matvec(inputs[w.shape[1]], w, s)

    def theirs():
        for w, s, p in zip(weights, scales, packed):
            pytorch_product(inputs[w.shape[1]], w, s, p)

    def read():
        flat.sum()

    times = {"ours": [], "pytorch": [], "read": []}
    for fn in (ours, theirs, read):
        fn()
    for _ in range(repeats):
        for name, fn in (("ours", ours), ("pytorch", theirs), ("read", read)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return dict(config=config, dtype=dtype, rows=rows, bytes=nbytes, **medians)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="15m,110m,1.1b")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not cpu_kernels.load():
        raise SystemExit(f"the CPU kernels did not build: {cpu_kernels.failure()}")
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {a.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| config | weights | rows | ours | PyTorch's | read bound | PyTorch's / ours |")
    print("|---|---|---|---|---|---|---|")
    for config in a.configs.split(","):
        for dtype in a.dtypes.split(","):
            for rows in (int(r) for r in a.rows.split(",")):
                if dtype == "int8" and rows > cpu_kernels.MAX_INT8_ROWS:
                    continue
                m = measure(config, dtype, rows, a.repeats)
                gbs = {k: m["bytes"] / m[k] / 1e9 for k in ("ours", "pytorch", "read")}
                print(f"| {config} | {dtype} | {rows} | {m['ours'] * 1e3:.2f} ms ({gbs['ours']:.1f} GB/s) | "
                      f"{m['pytorch'] * 1e3:.2f} ms ({gbs['pytorch']:.1f} GB/s) | {m['read'] * 1e3:.2f} ms "
                      f"({gbs['read']:.1f} GB/s) | {m['pytorch'] / m['ours']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

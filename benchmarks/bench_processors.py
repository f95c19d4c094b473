"""What the generation controls cost: decode tok/s with the penalties on against plain greedy, in one run.

A random float32 model of stories15M's shape (dim 288, 6 layers, 6 heads, vocabulary 32,000,
context 256) decodes ``--new`` tokens from a ``--prompt``-token random prompt through
``Scheduler.generate`` on a scheduler of one job (the step thread and channel the command uses;
the controls run on the step that draws on the host), once per setting per round. The settings run in a rotating order each
round, so a slow moment of a busy machine does not land on one of them only; the ratio to greedy
is taken per round (both measured seconds apart) and its median reported, with the median tok/s.

Settings (names as on the command line):

* ``greedy``: ``-t 0``, no controls (the baseline);
* ``penalties``: greedy with ``--repetition-penalty 1.3 --presence-penalty 0.5
  --frequency-penalty 0.5 --no-repeat-ngram-size 3`` (over the whole prompt and reply);
* ``penalties-last-64``: the same with ``--repeat-last-n 64``;
* ``all-processors``: the penalties, plus ``--logit-bias`` on 8 ids and ``--min-new-tokens 100``;
* ``nucleus``: ``-t 0.8 --top-p 0.95``;
* ``nucleus+warpers+penalties``: ``nucleus`` plus ``--top-k 40 --min-p 0.05 --typical-p 0.95``
  and the penalties.

On a busy machine whole runs seconds apart see different loads, so it also measures the cost
step by step: a decode loop that, at every position, runs the forward and the greedy pick twice,
once plain and once with the penalties (and the history's update), in alternating order, the
second forward overwriting the first's keys with the same values. The ratio of the median step
times is the processors' cost over the bare step, without the engine's own per-token work, so an
upper bound of what the engine loses. And it times the processors alone on one row of 32,000
logits with a 256-token history, per token.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_processors.py [--rounds 7] [--new 200] [--prompt 16] [--threads N] [--paired-repeats 3] [--skip-runs]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: idle OpenMP helpers sleep

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from llama_chat.inference.scheduler import Scheduler, SchedulerOptions  # noqa: E402
from llama_chat.inference.types import Request  # noqa: E402
from llama_chat.ml.controls import SamplingParams  # noqa: E402
from llama_chat.ml.processors import TokenHistory, make_controls  # noqa: E402
from llama_chat.model.args import ModelArgs  # noqa: E402
from llama_chat.model.kv_cache import KVCache  # noqa: E402
from llama_chat.model.transformer import Transformer  # noqa: E402

VOCAB = 32000
EOS = 2
PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5, no_repeat_ngram_size=3)
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "penalties": SamplingParams(temperature=0.0, **PENALTIES),
    "penalties-last-64": SamplingParams(temperature=0.0, repeat_last_n=64, **PENALTIES),
    "all-processors": SamplingParams(temperature=0.0, logit_bias=tuple((100 + 7 * i, -1.0) for i in range(8)),
                                     min_new_tokens=100, **PENALTIES),
    "nucleus": SamplingParams(temperature=0.8, top_p=0.95),
    "nucleus+warpers+penalties": SamplingParams(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05, typical_p=0.95,
                                                **PENALTIES),
}


class BenchTokenizer:
    """Just what the engine asks of a tokenizer: ids, one stop id, and some bytes per token."""

    vocab_size = VOCAB
    stop_ids = (EOS,)
    eos_id = EOS
    bos_id = 1
    special_tokens: dict[str, int] = {}
    strips_leading_space = False

    def token_bytes(self, token_id: int) -> bytes:
        return b"x"


def stories15m() -> Transformer:
    args = ModelArgs(dim=288, n_layers=6, n_heads=6, n_kv_heads=6, vocab_size=VOCAB, hidden_dim=768, max_seq_len=256)
    model = Transformer(args)
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.output.weight[EOS] = 0.0  # no run ends before --new tokens
    return model.eval()


def decode_rates(engine: Scheduler, prompt: tuple[int, ...], new: int, rounds: int) -> dict[str, list[float]]:
    names = list(SETTINGS)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up: first-call costs (allocations, the n-gram index) out of the timing
        engine.generate(Request(prompt, sampling=SETTINGS[name], max_tokens=8))
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            done = engine.generate(Request(prompt, sampling=SETTINGS[name], max_tokens=new, seed=r))
            assert done.completion_tokens == new, (name, done.completion_tokens, done.finish_reason)
            rates[name].append(done.timings.decode_tok_s)
    return rates


def paired_steps(model: Transformer, setting: str, steps: int, prompt_len: int) -> dict[str, float]:
    """Median seconds of a decode step without and with ``setting``'s processors, measured in turns."""
    sampler = make_controls(SETTINGS[setting], eos_ids=(EOS,))
    g = torch.Generator().manual_seed(3)
    prompt = [1] + torch.randint(3, VOCAB, (prompt_len - 1,), generator=g).tolist()
    history = TokenHistory([prompt], vocab_size=VOCAB, window=SETTINGS[setting].repeat_last_n)
    cache = KVCache.for_model(model.args, 1)
    plain, processed = [], []
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), torch.arange(prompt_len).unsqueeze(0), cache, last_only=True)[:, -1]
        token, position = int(sampler(history, logits).item()), prompt_len
        history.append([token])
        for i in range(steps):
            tokens, positions = torch.tensor([[token]]), torch.tensor([[position]])
            for with_processors in ((False, True) if i % 2 else (True, False)):
                start = time.perf_counter()
                step_logits = model(tokens, positions, cache, last_only=True)[:, -1]
                if with_processors:
                    step_logits, _ = sampler.prepare(history, step_logits)
                chosen = int(step_logits.argmax(-1))
                (processed if with_processors else plain).append(time.perf_counter() - start)
                if with_processors:
                    history.append([chosen])
                    token = chosen
            position += 1
    return {"plain": plain, "processors": processed}


def paired_summary(samples: dict[str, list[float]]) -> dict[str, float]:
    """Medians, and 10th percentiles: on a busy machine the fast end of the samples is the time a
    step takes when nothing else runs, so its ratio is the least disturbed one."""
    plain, processed = samples["plain"], samples["processors"]

    def p10(values: list[float]) -> float:
        return statistics.quantiles(values, n=10)[0]

    return {"steps": len(plain), "plain_ms": statistics.median(plain) * 1e3,
            "processors_ms": statistics.median(processed) * 1e3,
            "ratio": statistics.median(plain) / statistics.median(processed),
            "plain_p10_ms": p10(plain) * 1e3, "processors_p10_ms": p10(processed) * 1e3,
            "ratio_p10": p10(plain) / p10(processed)}


def processor_cost(model: Transformer, history_len: int, calls: int) -> dict[str, float]:
    """Microseconds per token: the processors alone, and one decode forward for scale."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, VOCAB, generator=g) * 3
    out = {}
    for name in ("penalties", "all-processors", "nucleus+warpers+penalties"):
        sampler = make_controls(SETTINGS[name], eos_ids=(EOS,))
        history = TokenHistory([torch.randint(3, VOCAB, (history_len,), generator=g).tolist()], vocab_size=VOCAB,
                               window=SETTINGS[name].repeat_last_n)
        sampler.prepare(history, logits)  # builds the counts and the n-gram index
        start = time.perf_counter()
        for i in range(calls):
            sampler.prepare(history, logits)
            history.append([3 + (i * 7919) % (VOCAB - 3)])
        out[name] = (time.perf_counter() - start) / calls * 1e6
    cache = KVCache.for_model(model.args, 1)
    with torch.inference_mode():
        model(torch.tensor([[1] * 128]), torch.arange(128).unsqueeze(0), cache, last_only=True)
        start = time.perf_counter()
        for i in range(calls // 10):
            model(torch.tensor([[5]]), torch.tensor([[128 + i % 100]]), cache, last_only=True)
        out["decode forward"] = (time.perf_counter() - start) / (calls // 10) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new", type=int, default=200)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: its default)")
    parser.add_argument("--paired-repeats", type=int, default=3, help="decode loops per setting, step by step")
    parser.add_argument("--skip-runs", action="store_true", help="only the step-by-step and per-token parts")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    load_before = os.getloadavg()[0]  # others' work on a shared machine shows here
    torch.manual_seed(0)
    model = stories15m()
    engine = Scheduler(model, BenchTokenizer(), SchedulerOptions(max_batch=1))
    prompt = tuple([1] + torch.randint(3, VOCAB, (args.prompt - 1,), generator=torch.Generator().manual_seed(2)).tolist())
    rates = {} if args.skip_runs else decode_rates(engine, prompt, args.new, args.rounds)
    base = rates.get("greedy", [])
    rows = []
    for name, values in rates.items():
        paired = [v / b for v, b in zip(values, base)]
        row = {"setting": name, "decode_tok_s_median": statistics.median(values), "min": min(values),
               "max": max(values), "ratio_to_greedy_median": statistics.median(paired), "rounds": len(values)}
        rows.append(row)
        print(json.dumps(row))
    paired = {}
    for name in ("penalties", "penalties-last-64", "all-processors"):
        pooled: dict[str, list[float]] = {"plain": [], "processors": []}
        for _ in range(args.paired_repeats):
            run = paired_steps(model, name, min(args.new, 256 - args.prompt - 1), args.prompt)
            pooled["plain"] += run["plain"]
            pooled["processors"] += run["processors"]
        paired[name] = paired_summary(pooled)
    for name, row in paired.items():
        print(json.dumps({"paired_steps": name, **row}))
    cost = processor_cost(model, 256, args.calls)
    print(json.dumps({"microseconds_per_token": cost}))

    print(f"\nstories15M-shaped random model, float32, eager step, {args.prompt}-token prompt, {args.new} new tokens, "
          f"{args.rounds} rounds, torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after\n")
    print("| setting | decode tok/s (median) | min | max | vs greedy (median of per-round ratios) |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['setting']} | {row['decode_tok_s_median']:.0f} | {row['min']:.0f} | {row['max']:.0f} | "
              f"{row['ratio_to_greedy_median']:.3f} |")
    print("\n| step by step, in turns | steps | plain step, median ms | with processors | speed ratio | "
          "plain, 10th percentile ms | with processors | speed ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in paired.items():
        print(f"| {name} | {row['steps']} | {row['plain_ms']:.2f} | {row['processors_ms']:.2f} | {row['ratio']:.3f} | "
              f"{row['plain_p10_ms']:.2f} | {row['processors_p10_ms']:.2f} | {row['ratio_p10']:.3f} |")
    print("\n| per token, one row of 32,000 logits, 256-token history | microseconds |")
    print("|---|---:|")
    for name, us in cost.items():
        print(f"| {name} | {us:.0f} |")


if __name__ == "__main__":
    main()

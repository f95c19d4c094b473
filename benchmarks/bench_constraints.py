"""What structured output costs: decode tok/s with and without a JSON schema, in one run.

Two random float32 models with a 32,000-token vocabulary: stories15M's shape (dim 288, 6 layers,
6 heads) and TinyLlama's (dim 2048, 22 layers, 32 heads, 4 key/value heads, hidden 5632). The
vocabulary is a Llama-2-style byte-fallback BPE (``tokenizer.json`` with Metaspace and the 256
``<0xNN>`` pieces) trained here on the Python standard library's sources, so that the constraint
engine walks a real token trie; nothing is downloaded (``--tokenizer DIR`` reuses one).

Each model decodes ``--new`` tokens greedily after a short prompt through ``Scheduler.generate`` (one job at a time)
(the one-shot command's path), once per setting per round, in a rotating order so that a slow
moment of a busy machine does not land on one setting only; the ratio to ``free`` is taken per
round and its median reported, with the median tok/s:

* ``free``: no constraint (the command's fastest greedy path: the pick inside the CPU operator);
* ``schema``: ``SCHEMA`` (records with a bounded string, numbers, an enum array and a boolean, at
  least 64 of them, so that no run completes it), as the command runs it: each step's mask
  computed in the background while the step's forward runs;
* ``schema, masks when asked``: the same with each mask computed when the step's logits arrive
  (``GrammarMask(ahead=False)``): what computing ahead buys.

The end token's output row is zero, so no run ends before ``--new`` tokens.

On a busy machine runs seconds apart see different loads, so it also measures the stories15M-sized
model step by step, as ``bench_processors.py`` does: at every position of a constrained greedy
decode, the operator's plain pick, the eager step with a processor (a logit bias: what leaving the
operator's pick costs by itself) and the constrained step run in turns, each on the token the
constrained step chose, the later ones overwriting the earlier ones' keys with the same values.
The ratios of the median step times (and of their 10th percentiles) are the constraint's cost
without the engine's own per-token work. And it times the mask alone per token.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_constraints.py [--rounds 7] [--new 200]
        [--steps 400] [--big-rounds 2] [--big-new 24] [--skip-big] [--tokenizer DIR] [--threads N]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: idle OpenMP helpers sleep

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from llama_chat.inference.scheduler import Scheduler, SchedulerOptions  # noqa: E402
from llama_chat.inference.types import GenerationState, Request, stop_ids_of  # noqa: E402
from llama_chat.ml.constraints import Constraints, GrammarMask  # noqa: E402
from llama_chat.ml.controls import SamplingParams  # noqa: E402
from llama_chat.ml.cpu import kernels as cpu_kernels  # noqa: E402
from llama_chat.ml.grammars import Constraint  # noqa: E402
from llama_chat.ml.processors import TokenHistory, make_controls  # noqa: E402
from llama_chat.ml.sampling import sample  # noqa: E402
from llama_chat.model import cpu_decode  # noqa: E402
from llama_chat.model.args import ModelArgs  # noqa: E402
from llama_chat.model.kv_cache import KVCache  # noqa: E402
from llama_chat.model.paged_kv_cache import PagedKVCache  # noqa: E402
from llama_chat.model.tokenizers.hf import HFTokenizer  # noqa: E402
from llama_chat.model.transformer import Transformer  # noqa: E402

VOCAB = 32000
SCHEMA = {
    "type": "array", "minItems": 64,
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                       "name": {"type": "string", "maxLength": 16},
                       "score": {"type": "number"},
                       "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue"]}},
                       "active": {"type": "boolean"}},
        "required": ["id", "name", "score", "tags", "active"], "additionalProperties": False},
}
GREEDY = SamplingParams(temperature=0.0)
SETTINGS = ("free", "schema", "schema, masks when asked")
PROMPT = "Write the records as JSON:"


def train_vocabulary(out: Path) -> Path:
    """A 32,000-token byte-fallback BPE in Llama 2's ``tokenizer.json`` shape; its directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    text = [p.read_text(errors="ignore") for p in sorted(stdlib.glob("*.py"))[:200]]
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    pieces = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>", *pieces],
                                  show_progress=False)
    tok.train_from_iterator(text, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    # The trainer makes the byte pieces only as special tokens; Llama 2's file has them as plain
    # vocabulary entries (their bytes are text), so they leave the special list.
    spec = json.loads((out / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in pieces]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def random_model(args: ModelArgs, eos: int) -> Transformer:
    model = Transformer(args)
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.output.weight[eos] = 0.0  # no run ends before --new tokens
    return model.eval()


def stories15m(eos: int) -> Transformer:
    return random_model(ModelArgs(dim=288, n_layers=6, n_heads=6, n_kv_heads=6, vocab_size=VOCAB, hidden_dim=768,
                                  max_seq_len=512), eos)


def tinyllama(eos: int) -> Transformer:
    return random_model(ModelArgs(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=VOCAB,
                                  hidden_dim=5632, max_seq_len=512), eos)


class _AskedConstraints(Constraints):
    """``Constraints`` whose processors compute each mask when the step's logits arrive."""

    def processor(self, constraint, *, extra_stop_ids=()) -> GrammarMask:
        return GrammarMask(self.compile(constraint), extra_stop_ids=extra_stop_ids, ahead=False)


def decode_rates(engine: Scheduler, prompt: tuple[int, ...], new: int, rounds: int) -> dict[str, list[float]]:
    schema = Constraint.json_schema(SCHEMA)
    default, asked = engine.core.constraints, _AskedConstraints(engine.tokenizer, engine.stop_ids)

    def run(name: str, tokens: int, seed: int) -> float:
        engine.core.constraints = asked if name == "schema, masks when asked" else default
        request = Request(prompt, sampling=GREEDY, max_tokens=tokens, seed=seed,
                          constraint=None if name == "free" else schema)
        done = engine.generate(request)
        assert done.finish_reason == GenerationState.MAX_TOKENS, (name, done.finish_reason, done.text[-80:])
        return done.timings.decode_tok_s

    for name in SETTINGS:  # warm-up: the vocabulary, the compiled schema, first-call allocations
        run(name, 8, 0)
    rates: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for r in range(rounds):
        order = SETTINGS[r % len(SETTINGS):] + SETTINGS[:r % len(SETTINGS)]
        for name in order:
            rates[name].append(run(name, new, r))
    engine.core.constraints = default
    return rates


def summary(rates: dict[str, list[float]]) -> list[dict]:
    base = rates["free"]
    return [{"setting": name, "decode_tok_s_median": statistics.median(values), "min": min(values),
             "max": max(values), "ratio_to_free_median": statistics.median(v / b for v, b in zip(values, base)),
             "rounds": len(values)} for name, values in rates.items()]


STEP_KINDS = ("operator's pick", "eager step with a processor", "eager step with the schema")


class _DenseStep:
    """The model over a dense cache of one row, and the operator's one-call step over it (the row
    as one page) where it reads the model: one kind of step at a time, with nothing around it."""

    def __init__(self, model: Transformer, vocab: int) -> None:
        model.fuse_projections()
        self.model = model
        self.cache = KVCache.for_model(model.args, 1)
        with torch.inference_mode():
            self.one_call = cpu_decode.operator_for(model, PagedKVCache.of_row(self.cache))
        self.sample_ids = vocab if vocab < model.args.vocab_size else None

    def forward(self, rows: list[list[int]], starts: list[int]) -> torch.Tensor:
        if self.one_call is not None and len(rows) == 1 and len(rows[0]) == 1:
            return self.one_call([rows[0][0]], [starts[0]], [[0]])
        tokens = torch.tensor(rows, dtype=torch.long)
        positions = torch.tensor(starts, dtype=torch.long).unsqueeze(1) + torch.arange(tokens.shape[1])
        return self.model(tokens, positions, self.cache, last_only=True)[:, -1, :]


def paired_steps(engine: Scheduler, prompt: list[int], steps: int) -> dict[str, list[float]]:
    """Seconds of each kind of decode step, in turns at every position of a constrained decode."""
    vocab = engine.tokenizer.vocab_size
    step = _DenseStep(engine.model, vocab)
    schema_sampler = make_controls(GREEDY, eos_ids=engine.stop_ids,
                                  constraint=engine.core.constraints.processor(Constraint.json_schema(SCHEMA)))
    bias_sampler = make_controls(SamplingParams(temperature=0.0, logit_bias=((5, -1.0),)), eos_ids=engine.stop_ids)
    schema_history = TokenHistory([prompt], vocab_size=vocab)
    bias_history = TokenHistory([prompt], vocab_size=vocab)
    times: dict[str, list[float]] = {kind: [] for kind in STEP_KINDS}

    def pick(token: int, position: int) -> None:
        if step.one_call is not None:
            step.one_call.pick(token, position, [0], step.sample_ids)
        else:
            cpu_kernels.argmax(step.forward([[token]], [position])[:, :vocab])

    def eager(sampler, history, token: int, position: int) -> int:
        logits = step.forward([[token]], [position])[:, :vocab]
        chosen = int(sample(*sampler.prepare(history, logits))[0])
        history.append([chosen])
        return chosen

    with torch.inference_mode():
        logits = step.forward([prompt], [0])[:, :vocab]
        token = int(sample(*schema_sampler.prepare(schema_history, logits))[0])
        schema_history.append([token])
        bias_history.append([token])
        position = len(prompt)
        for i in range(steps):
            kinds = STEP_KINDS[i % 3:] + STEP_KINDS[:i % 3]
            chosen = token
            for kind in kinds:
                start = time.perf_counter()
                if kind == STEP_KINDS[0]:
                    pick(token, position)
                elif kind == STEP_KINDS[1]:
                    eager(bias_sampler, bias_history, token, position)
                else:
                    chosen = eager(schema_sampler, schema_history, token, position)
                times[kind].append(time.perf_counter() - start)
            bias_history.tokens[0][-1] = chosen  # both histories follow the constrained decode
            token, position = chosen, position + 1
    return times


def paired_summary(times: dict[str, list[float]]) -> list[dict]:
    """Medians, and 10th percentiles: on a busy machine the fast end of the samples is the time a
    step takes when nothing else runs, so its ratio is the least disturbed one."""
    def p10(values: list[float]) -> float:
        return statistics.quantiles(values, n=10)[0]

    base = times[STEP_KINDS[0]]
    return [{"step": kind, "steps": len(values), "median_ms": statistics.median(values) * 1e3,
             "p10_ms": p10(values) * 1e3, "speed_ratio": statistics.median(base) / statistics.median(values),
             "speed_ratio_p10": p10(base) / p10(values)} for kind, values in times.items()]


def mask_walk(constraints: Constraints, constraint: Constraint, steps: int) -> tuple[list[float], list[float]]:
    """Seconds of the processor alone per token (its call, and its matcher's advance) along a
    greedy walk of random logits, with each mask computed when asked; the walk ends early where
    the constraint is complete."""
    logits = torch.randn(steps, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    mask = GrammarMask(constraints.compile(constraint), ahead=False)
    history = TokenHistory([[1]], vocab_size=VOCAB)
    calls, advances = [], []
    for i in range(steps):
        start = time.perf_counter()
        row = mask(history, logits[i:i + 1].clone())
        middle = time.perf_counter()
        history.append([int(row.argmax())])
        calls.append(middle - start)
        advances.append(time.perf_counter() - middle)
        if mask.stopped(0):
            break
    return calls, advances


def mask_cost(constraints: Constraints, steps: int) -> dict[str, float]:
    """Microseconds per token of the processor alone, for ``SCHEMA`` (``mask_walk``)."""
    calls, advances = mask_walk(constraints, Constraint.json_schema(SCHEMA), steps)
    return {"mask (call), median": statistics.median(calls) * 1e6, "mask (call), mean": statistics.mean(calls) * 1e6,
            "advance, median": statistics.median(advances) * 1e6}


def bench(name: str, model: Transformer, tokenizer, new: int, rounds: int) -> tuple[Scheduler, dict]:
    engine = Scheduler(model, tokenizer, SchedulerOptions(max_batch=1))
    prompt = tuple(tokenizer.encode(PROMPT, bos=True))
    start = time.perf_counter()
    engine.core.constraints.compile(Constraint.json_schema(SCHEMA))
    first = time.perf_counter() - start
    rows = summary(decode_rates(engine, prompt, new, rounds))
    for row in rows:
        print(json.dumps({"model": name, **row}), flush=True)
    return engine, {"model": name, "rows": rows, "new": new, "rounds": rounds, "vocabulary_and_compile_s": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new", type=int, default=200)
    parser.add_argument("--steps", type=int, default=400, help="positions of the step-by-step measure")
    parser.add_argument("--big-rounds", type=int, default=2, help="rounds of the TinyLlama-sized model")
    parser.add_argument("--big-new", type=int, default=24, help="tokens a run of the TinyLlama-sized model")
    parser.add_argument("--skip-big", action="store_true", help="only the stories15M-sized model")
    parser.add_argument("--tokenizer", type=Path, help="a directory with the vocabulary's tokenizer.json (made "
                                                       "there when missing)")
    parser.add_argument("--mask-steps", type=int, default=500)
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: its default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    load_before = os.getloadavg()[0]  # others' work on a shared machine shows here
    folder = args.tokenizer or Path(tempfile.mkdtemp(prefix="bench-constraints-"))
    if not (folder / "tokenizer.json").is_file():
        train_vocabulary(folder)
    tokenizer = HFTokenizer(folder / "tokenizer.json")
    assert tokenizer.vocab_size == VOCAB, tokenizer.vocab_size
    eos = tokenizer.eos_id
    small, result = bench("stories15M-sized", stories15m(eos), tokenizer, args.new, args.rounds)
    results = [result]
    paired = paired_summary(paired_steps(small, list(tokenizer.encode(PROMPT, bos=True)),
                                         min(args.steps, small.max_seq_len - 16)))
    for row in paired:
        print(json.dumps({"paired_steps": row}), flush=True)
    cost = mask_cost(Constraints(tokenizer, stop_ids_of(tokenizer)), args.mask_steps)
    print(json.dumps({"microseconds_per_token": cost}), flush=True)
    if not args.skip_big:
        results.append(bench("TinyLlama-sized", tinyllama(eos), tokenizer, args.big_new, args.big_rounds)[1])

    print(f"\nrandom float32 models, vocabulary of {VOCAB} (byte-fallback BPE), greedy, Scheduler.generate, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after\n")
    print("| model | setting | new tokens x rounds | decode tok/s (median) | min | max | vs free (median of "
          "per-round ratios) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for result in results:
        for row in result["rows"]:
            print(f"| {result['model']} | {row['setting']} | {result['new']} x {result['rounds']} | "
                  f"{row['decode_tok_s_median']:.1f} | {row['min']:.1f} | {row['max']:.1f} | "
                  f"{row['ratio_to_free_median']:.3f} |")
    print("\n| stories15M-sized, step by step, in turns | steps | median ms | speed ratio | 10th percentile ms | "
          "speed ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in paired:
        print(f"| {row['step']} | {row['steps']} | {row['median_ms']:.3f} | {row['speed_ratio']:.3f} | "
              f"{row['p10_ms']:.3f} | {row['speed_ratio_p10']:.3f} |")
    print("\n| per token, the schema's processor alone, 32,000-token vocabulary | microseconds |")
    print("|---|---:|")
    for name, us in cost.items():
        print(f"| {name} | {us:.0f} |")
    print(f"\nfirst constraint: vocabulary built and schema compiled in {results[0]['vocabulary_and_compile_s']:.2f} s")


if __name__ == "__main__":
    main()

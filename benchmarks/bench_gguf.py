"""llama-chat against llama.cpp on llama.cpp's own GGUF files, in one run.

What it does, every step cached under ``--cache`` (default ``~/.cache/llama-chat-bench``), nothing
written into the repository:

1. llama.cpp: ``pip download`` the ``llama-cpp-python`` sdist and build ``llama-bench`` and
   ``llama-quantize`` from its ``vendor/llama.cpp`` with cmake, CPU only, ``-DGGML_NATIVE=ON``,
   Release (``llama_cpp_peer.py`` has the flags); reused when built.
2. Checkpoints: for each shape, a Hugging Face checkpoint of its family (Llama, Qwen2, Gemma 2)
   with random weights (``transformers``' own init, ``initializer_range`` 0.02, seed 0) saved as
   float16 safetensors, with a byte-fallback SentencePiece ``tokenizer.model`` of the shape's
   vocabulary (trained on a small corpus, then filled up with pieces no text ever merges into).
3. Files: llama.cpp's ``convert_hf_to_gguf.py`` (from the same tree, its own ``gguf-py`` first on
   ``PYTHONPATH``) writes F16 and Q8_0; ``llama-quantize`` makes Q4_0 and Q4_K_M from the F16 file.
4. Runs, for ``--rounds`` rounds, each round every file in turn, llama.cpp then llama-chat on the
   same file, each in a fresh process (started from a small launcher and reaped with ``os.wait4``,
   for its own peak RSS), both with ``--threads`` threads (default 2: ``-t`` and ``OMP_NUM_THREADS``)
   and ``OMP_WAIT_POLICY`` as each ships: unset, so llama.cpp's OpenMP threads spin at the barrier
   after every operation, and llama-chat sets PASSIVE for itself. Spinning is llama.cpp's faster
   choice on idle cores and a collapse of its decode on busy ones, where a spinning thread holds a
   core its partner waits for; the report flags a busy machine. ``--omp-wait-policy passive``
   gives llama.cpp PASSIVE too, the steadier comparison while others share the cores;
   * llama.cpp: ``llama-bench -m FILE -t T -p 512 -n 128 -r 1 -o json`` (pp512 and tg128, after
     llama-bench's own warm-up, in one process);
   * llama-chat, as a user runs it (the command line below): one process
     prefills a 512-token prompt (BOS included) and generates 1 token, for prefill tok/s;
     another generates 128 tokens greedily after a short prompt, for decode tok/s. They are apart
     because llama-bench's tg128 decodes from an empty context: decoding after the 512-token
     prompt would charge llama-chat for attention over 512 more positions. Its peak RSS is the
     larger of the two. ``--min-new-tokens`` keeps random weights from stopping early.

   ``llama-chat -m FILE -f PROMPT_FILE --no-stdin -n N --min-new-tokens N -t 0 --template none
   -c CTX --json --lookup off`` (CTX: the shape's context length, which is also what it uses
   unasked). ``--lookup off``, the default of ``--chat-args``: llama-bench does not speculate, and
   random weights repeat themselves, so prompt lookup (on by default for packed blocks) would
   measure its drafts, not the decode step.
5. Also measured in the same run: the machine's read bandwidth (a float32 sum over 1 GiB on the
   same threads, best of 7 passes at the start of every round, the best round's kept), the
   baseline (llama-chat's peak RSS on the shipped model with the short prompt, median of one run
   per round, after untimed runs that also build llama-chat's CPU kernels if their cache is
   cold) and the load average, since both systems share the cores with whatever else runs.

Printed: one JSON line per measurement, then one Markdown table per shape (``--report FILE`` prints
the tables again from saved output). Speeds and RSS are the median of the rounds (their range in
brackets), and ratios are llama-chat over llama.cpp of those medians. "Bound" is the decode speed
the measured bandwidth allows for the file's weights as stored (every tensor read once per token,
the token embedding only when it is also the classifier), and "of bound" is a system's decode
speed over it. The memory rule for llama-chat: peak RSS <= 1.1 x file size +
KV cache (float32, CTX positions) + baseline.

    python benchmarks/bench_gguf.py --quick                           # 110m, 1 round
    python benchmarks/bench_gguf.py --shapes qwen2.5-1.5b,gemma-2-2b --types q4_k_m
    python benchmarks/bench_gguf.py --shapes 110m --rounds 3
    python benchmarks/bench_gguf.py --shapes 1.1b,110m --types q8_0,q4_0 --cache /tmp/bench
    python benchmarks/bench_gguf.py --shapes 110m > run.txt; python benchmarks/bench_gguf.py --report run.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp_peer as peer_mod
from llama_cpp_peer import LlamaCpp, Measured, PeerError, run_measured

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 32000
SEED = 0


@dataclass(frozen=True)
class Shape:
    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden: int
    ctx: int
    tied: bool
    family: str = "llama"
    vocab: int = VOCAB
    head_dim: int | None = None

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * (self.head_dim or self.dim // self.n_heads)

    @property
    def q_dim(self) -> int:
        return self.n_heads * (self.head_dim or self.dim // self.n_heads)


SHAPES = {
    "1.1b": Shape("TinyLlama-1.1B", dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, hidden=5632, ctx=2048,
                  tied=False),
    "110m": Shape("stories110M", dim=768, n_layers=12, n_heads=12, n_kv_heads=12, hidden=2048, ctx=1024,
                  tied=True),
    # The families' sizes people run (contexts cut to the race's needs).
    "qwen2.5-1.5b": Shape("Qwen2.5-1.5B", dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, hidden=8960, ctx=2048,
                          tied=True, family="qwen2", vocab=151936),
    "gemma-2-2b": Shape("Gemma-2-2B", dim=2304, n_layers=26, n_heads=8, n_kv_heads=4, hidden=9216, ctx=2048,
                        tied=True, family="gemma2", vocab=256000, head_dim=256),
}
LONGER = re.compile(r"(?P<base>.+)-ctx(?P<k>\d+)k")  # "qwen2.5-1.5b-ctx8k": the shape with an 8,192 context


def shape_of(key: str) -> Shape:
    """A shape by its key, where a ``-ctxNk`` suffix gives it a context of N x 1,024 (its own files)."""
    longer = LONGER.fullmatch(key)
    if longer and longer["base"] in SHAPES:
        return dataclasses.replace(SHAPES[longer["base"]], ctx=int(longer["k"]) * 1024)
    return SHAPES[key]


# How each type is made: by the converter from the checkpoint, or by llama-quantize from F16.
TYPES = {"f16": ("convert", "f16"), "q8_0": ("convert", "q8_0"), "q4_0": ("quantize", "Q4_0"),
         "q4_k_m": ("quantize", "Q4_K_M")}
BASELINE = "llama-chat baseline"  # the system name of --baseline's runs
MEMORY_SLACK = 1.1  # the memory rule's allowance over the file's bytes
SHORT_PROMPT = "Once upon a time"
RETRIES = 3  # a failed llama-chat run, other than a usage error, is retried: the tree may be mid-change
RETRY_WAIT_S = 60
CORPUS = [
    "Once upon a time there was a little fox who lived in the forest near a big river.",
    "Every morning the fox went to the river to drink and to watch the fish jump in the sun.",
    "One day a small bird came to the river and asked the fox if it wanted to be friends.",
    "The fox was happy, and the two friends played together until the evening came.",
    "When it rained they sat under the old tree and told each other stories about the stars.",
    "The bird could fly high above the hills and tell the fox what it saw far away.",
    "In the winter the snow was deep, and the fox made a warm bed of leaves for the bird.",
    "Spring came back with flowers of every colour, and the children from the village sang songs.",
    "A wise old owl said that kindness is the best gift, because it grows when you share it.",
    "They counted 1234 stones by the water and laughed when the number was wrong again.",
]


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


ROWS: list[dict] = []  # everything emitted, which is all the report reads


def emit(**row) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


# -- the tokenizer, the checkpoints and the files ---------------------------------------------


def write_tokenizer(path: Path, vocab: int = VOCAB) -> Path:
    """A byte-fallback BPE SentencePiece model with exactly ``vocab`` pieces, written once."""
    if path.is_file():
        return path
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    rng = random.Random(SEED)
    lines = [" ".join(rng.sample(CORPUS, 4)) for _ in range(400)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=1000,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   hard_vocab_limit=False, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   split_digits=True, num_threads=1, minloglevel=2)
    model = pb.ModelProto()
    model.ParseFromString(buf.getvalue())
    lowest = min(p.score for p in model.pieces)
    # Digits are split, so no text ever merges into these: they only give the vocabulary its size.
    for i in range(vocab - len(model.pieces)):
        piece = model.pieces.add()
        piece.piece, piece.score, piece.type = f"\u2581fill{i:05d}", lowest - 1 - i, pb.ModelProto.SentencePiece.NORMAL
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(model.SerializeToString())
    assert spm.SentencePieceProcessor(model_file=str(tmp)).vocab_size() == vocab
    tmp.replace(path)
    return path


def write_checkpoint(shape: Shape, out: Path, tokenizer: Path) -> Path:
    """``out/`` as a Hugging Face float16 checkpoint with random weights, written once."""
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers

    log(f"writing a random {shape.name}-shaped checkpoint to {out}")
    config_class, model_class, extra = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": shape.head_dim, "sliding_window": 4096,
                                                        "query_pre_attn_scalar": shape.head_dim}),
    }[shape.family]
    config = getattr(transformers, config_class)(
        vocab_size=shape.vocab, hidden_size=shape.dim, intermediate_size=shape.hidden,
        num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_heads, num_key_value_heads=shape.n_kv_heads,
        max_position_embeddings=shape.ctx, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=shape.tied,
        initializer_range=0.02, bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(SEED)
    model = getattr(transformers, model_class)(config).to(torch.float16)
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    del model
    shutil.copy(tokenizer, tmp / "tokenizer.model")
    (tmp / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                           "unk_token": "<unk>", "add_bos_token": True,
                                                           "add_eos_token": False}))
    tmp.replace(out)
    return out


def gguf_path(cache: Path, key: str, ftype: str) -> Path:
    return cache / "models" / key / f"{key}-{ftype}.gguf"


def make_file(peer: LlamaCpp, cache: Path, key: str, hf_dir: Path, ftype: str, threads: int) -> Path:
    out = gguf_path(cache, key, ftype)
    if out.is_file():
        return out
    how, name = TYPES[ftype]
    t0 = time.perf_counter()
    if how == "convert":
        peer_mod.convert(peer, hf_dir, out, name)
    else:
        peer_mod.quantize(peer, make_file(peer, cache, key, hf_dir, "f16", threads), out, name, threads)
    log(f"wrote {out.name} ({out.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f} s")
    return out


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of the file's tensors one decode step reads: all but the token embedding, which only
    counts when there is no separate classifier (a tied model reads all of it as the classifier)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    total = sum(tensors.values())
    if "output.weight" in tensors:
        total -= tensors.get("token_embd.weight", 0)
    return total


def prefill_prompt(cache: Path, tokenizer: Path, n_tokens: int) -> Path:
    """A text that the tokenizer makes ``n_tokens`` tokens of, BOS included, written once."""
    path = cache / f"prompt-{n_tokens}.txt"
    if path.is_file():
        return path
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    rng = random.Random(SEED)
    words: list[str] = []
    while True:
        candidate = words + rng.choice(CORPUS).split()
        if len(sp.encode(" ".join(candidate))) + 1 >= n_tokens:
            break
        words = candidate
    for word in " ".join(rng.choice(CORPUS) for _ in range(20)).split():
        if len(sp.encode(" ".join(words + [word]))) + 1 > n_tokens:
            continue
        words.append(word)
        if len(sp.encode(" ".join(words))) + 1 == n_tokens:
            break
    text = " ".join(words)
    if len(sp.encode(text)) + 1 != n_tokens:
        raise SystemExit(f"could not build a prompt of exactly {n_tokens} tokens")
    path.write_text(text)
    return path


# -- the runs and what they found -----------------------------------------------------------------------------------


@dataclass
class Results:
    """Every round's figures for one file, by system and measure (the emitted rows' field names)."""

    values: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    errors: list[str] = field(default_factory=list)

    def add(self, row: dict) -> None:
        if row.get("error"):
            self.errors.append(row["error"])
        for measure in ("decode_tok_s", "prefill_tok_s", "peak_rss_mb"):
            if row.get(measure) is not None:
                self.values.setdefault((row["system"], measure), []).append(row[measure])

    def median(self, system: str, measure: str) -> float | None:
        found = self.values.get((system, measure))
        return statistics.median(found) if found else None

    def spread(self, system: str, measure: str) -> str:
        """The median, and the range of the rounds when there are several: "80.5 (48.6-171.6)"."""
        found = self.values.get((system, measure))
        if not found:
            return "-"
        mid = f"{statistics.median(found):.1f}"
        return mid if len(found) == 1 else f"{mid} ({min(found):.1f}-{max(found):.1f})"


def llama_chat_command() -> list[str]:
    script = Path(sys.executable).parent / "llama-chat"
    if script.is_file():
        return [str(script)]
    found = shutil.which("llama-chat")
    if not found:
        raise SystemExit("llama-chat is not installed in this environment (pip install -e .)")
    return [found]


class RunFailed(Exception):
    """A measured run that failed for good; the message is its last line of output."""


def run_llama_chat(model: Path | None, prompt_file: Path, n_new: int, ctx: int | None, env: dict,
                   retries: int = RETRIES, extra: Sequence[str] = ()) -> tuple[dict, Measured]:
    """One llama-chat process (``extra``: more of its options). A failure is retried while its
    message changes (the tree may be mid-commit); one that repeats, or a usage error, raises
    ``RunFailed``."""
    cmd = [*llama_chat_command()] + (["-m", str(model)] if model else [])
    cmd += ["-f", str(prompt_file), "--no-stdin", "-n", str(n_new), "--min-new-tokens", str(n_new), "-t", "0",
            "--template", "none", "--json"] + (["-c", str(ctx)] if ctx else []) + list(extra)
    seen: set[str] = set()
    for attempt in range(retries + 1):
        m = run_measured(cmd, env=env)
        if m.returncode == 0:
            return json.loads(m.stdout), m
        last = (m.stderr.strip().splitlines() or [f"exit {m.returncode}"])[-1][:300]
        if m.returncode == 2 or last in seen or attempt == retries:
            raise RunFailed(last)
        seen.add(last)
        log(f"llama-chat failed on {model.name if model else 'the shipped model'} ({last}); "
            f"retrying in {RETRY_WAIT_S} s")
        time.sleep(RETRY_WAIT_S)
    raise AssertionError("unreachable")


def read_bandwidth_gbs(threads: int) -> float:
    """A float32 sum over 1 GiB on ``threads`` threads: bytes read per second, best of 7.

    The best, not the median: the bound is what the memory can give, and on a shared machine every
    disturbance only makes a pass slower.
    """
    import torch

    torch.set_num_threads(threads)
    a = torch.ones(2**28)
    a.sum()
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best / 1e9


def llama_chat_revision() -> str:
    """The commit llama-chat runs from, with "+changes" when its tree has uncommitted edits."""
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def child_env(args) -> dict[str, str]:
    """Both systems' environment: the thread count, and OpenMP's wait policy unless "default"."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    env.pop("OMP_WAIT_POLICY", None)
    if args.omp_wait_policy != "default":
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    return env


def read_through(path: Path) -> None:
    """Read the file once, so neither system's first round pays for the disk."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def measure_round(peer: LlamaCpp, files: dict[tuple[str, str], Path], prompts: dict, args, round_no: int,
                  failed: set[Path]) -> None:
    env = child_env(args)
    for (key, ftype), path in files.items():
        ctx = shape_of(key).ctx
        cpp = peer_mod.llama_bench(peer, path, threads=args.threads, prompt=args.prompt_tokens, gen=args.gen, env=env)
        emit(round=round_no, shape=key, type=ftype, system="llama.cpp", prefill_tok_s=cpp.prefill_tok_s,
             decode_tok_s=cpp.decode_tok_s, peak_rss_mb=cpp.peak_rss_bytes / 1e6, wall_s=cpp.wall_s)

        # A file that failed in an earlier round is tried again, once, without waiting.
        retries = 0 if path in failed else RETRIES
        trees = [("llama-chat", env)]
        if args.baseline:
            trees.append((BASELINE, dict(env, PYTHONPATH=os.pathsep.join(
                p for p in (str(args.baseline), env.get("PYTHONPATH", "")) if p))))
            if round_no % 2 == 0:  # each tree goes first in every other round
                trees.reverse()
        for system, tree_env in trees:
            try:
                pre, pre_m = run_llama_chat(path, prompts["long"], 1, ctx, tree_env, retries, args.chat_args)
                dec, dec_m = run_llama_chat(path, prompts["short"], args.gen, ctx, tree_env, retries, args.chat_args)
            except RunFailed as e:
                failed.add(path)
                log(f"{system} failed on {path.name}: {e}")
                emit(round=round_no, shape=key, type=ftype, system=system, error=str(e))
                continue
            if pre["prompt_tokens"] != args.prompt_tokens:
                log(f"{system} read the prefill prompt as {pre['prompt_tokens']} tokens, not {args.prompt_tokens}")
            if dec["completion_tokens"] != args.gen:
                log(f"{system} generated {dec['completion_tokens']} tokens, not {args.gen}")
            emit(round=round_no, shape=key, type=ftype, system=system, prefill_tok_s=pre["timings"]["prefill_tok_s"],
                 prompt_tokens=pre["prompt_tokens"], decode_tok_s=dec["timings"]["decode_tok_s"],
                 completion_tokens=dec["completion_tokens"],
                 peak_rss_mb=max(pre_m.peak_rss_bytes, dec_m.peak_rss_bytes) / 1e6, wall_s=pre_m.wall_s + dec_m.wall_s)


# -- the report -------------------------------------------------------------------------------


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def report(rows: list[dict], cache: Path) -> None:
    """One Markdown table per shape, from the rows a run emitted (this one's, or a saved one's)."""
    from bench_decode import cpu_name

    run = next(r for r in rows if "llama_cpp" in r)
    rounds = [r for r in rows if "read_bandwidth_gbs" in r]
    results: dict[tuple[str, str], Results] = {}
    for row in rows:
        if "system" in row:
            results.setdefault((row["shape"], row["type"]), Results()).add(row)
    bandwidth = max(r["read_bandwidth_gbs"] for r in rounds)
    baseline_mb = statistics.median(r["baseline_rss_mb"] for r in rounds)
    print(f"\n### {cpu_name()}, {run.get('threads', 2)} threads, OMP_WAIT_POLICY "
          f"{run.get('omp_wait_policy', 'default')}, read bandwidth {bandwidth:.1f} GB/s (best of the run), "
          f"llama.cpp {run['llama_cpp']} (llama-cpp-python {run['sdist']}), "
          f"llama-chat {run.get('llama_chat', '?')}\n")
    measured_rounds = len({r["round"] for r in rows if "system" in r})
    print(f"Median of {measured_rounds} round(s), the rounds' range in brackets; pp{run.get('prompt_tokens', 512)} "
          f"and tg{run.get('gen', 128)}, tok/s; ratios are llama-chat's median over llama.cpp's. Baseline "
          f"(llama-chat on the shipped model): {baseline_mb:.0f} MB peak RSS.")
    for key in dict.fromkeys(k for k, _ in results):
        shape = shape_of(key)
        kv_mb = 2 * shape.n_layers * shape.ctx * shape.kv_dim * 4 / 1e6
        print(f"\n#### {shape.name}-shaped (dim {shape.dim}, {shape.n_layers} layers, {shape.n_heads}/"
              f"{shape.n_kv_heads} heads, ffn {shape.hidden}, vocab {shape.vocab}, {'tied' if shape.tied else 'untied'}); "
              f"llama-chat KV cache {kv_mb:.0f} MB (ctx {shape.ctx}, float32)\n")
        print("| type | file MB | read/token MB | bound tok/s | decode llama.cpp | decode llama-chat | ratio "
              "| of bound cpp / chat | prefill llama.cpp | prefill llama-chat | ratio | peak RSS llama.cpp MB "
              "| peak RSS llama-chat MB | rule MB | rule holds |")
        print("|---|" + "---:|" * 14)
        failures = []
        for (k, ftype), r in results.items():
            if k != key:
                continue
            if r.errors:
                failures.append(f"- {ftype}: llama-chat failed in {len(r.errors)} round(s): {r.errors[-1]}")
            path = gguf_path(cache, k, ftype)
            size_mb, per_token = path.stat().st_size / 1e6, weight_bytes_per_token(path)
            bound = bandwidth * 1e9 / per_token
            cd, hd = r.median("llama.cpp", "decode_tok_s"), r.median("llama-chat", "decode_tok_s")
            cp, hp = r.median("llama.cpp", "prefill_tok_s"), r.median("llama-chat", "prefill_tok_s")
            crss, hrss = r.median("llama.cpp", "peak_rss_mb"), r.median("llama-chat", "peak_rss_mb")
            rule = MEMORY_SLACK * size_mb + kv_mb + baseline_mb
            holds = "-" if hrss is None else ("yes" if hrss <= rule else "**no**")
            of_bound = f"{_f(cd and cd / bound, 2)} / {_f(hd and hd / bound, 2)}"
            print(f"| {ftype} | {size_mb:.0f} | {per_token / 1e6:.0f} | {bound:.1f} "
                  f"| {r.spread('llama.cpp', 'decode_tok_s')} | {r.spread('llama-chat', 'decode_tok_s')} "
                  f"| {_ratio(hd, cd)} | {of_bound} "
                  f"| {r.spread('llama.cpp', 'prefill_tok_s')} | {r.spread('llama-chat', 'prefill_tok_s')} "
                  f"| {_ratio(hp, cp)} | {_f(crss, 0)} | {_f(hrss, 0)} | {rule:.0f} | {holds} |")
        if failures:
            print("\n" + "\n".join(failures))
        if any(BASELINE == system for r in results.values() for system, _ in r.values):
            against_baseline(key, results, run.get("baseline", "?"))
    loads = [r["load_average_1min"] for r in rows if "load_average_1min" in r]
    if run.get("omp_wait_policy", "default") == "default" and max(loads, default=0) > (os.cpu_count() or 1):
        print(f"\n**The machine was busy** (load average up to {max(loads):.1f} on {os.cpu_count()} CPUs): "
              f"llama.cpp's spinning threads slow down far more than llama-chat's; rerun when it is quiet, "
              f"or with --omp-wait-policy passive.")
    # Both systems share the cores with whatever else runs: say how busy the machine was.
    print(f"\nLoad average (1 min) at each round's start and at the end: {', '.join(f'{x:.1f}' for x in loads)}; "
          f"{os.cpu_count()} CPUs. llama.cpp build: {run['build_s']:.0f} s"
          f"{' (this run)' if run['built_now'] else ' (cached)'}. Python {platform.python_version()}.")
    print(f"\nCommand: `python benchmarks/bench_gguf.py {run.get('command', '')}`")


def against_baseline(key: str, results: dict[tuple[str, str], Results], baseline: str) -> None:
    """This tree over ``--baseline``, each a median over the rounds (the two run alternately)."""
    print(f"\nThis tree against --baseline {baseline} (run alternately in each round):\n")
    print("| type | decode this | decode baseline | this / baseline | prefill this | prefill baseline | this / baseline |")
    print("|---|" + "---:|" * 6)
    for (k, ftype), r in results.items():
        if k != key:
            continue
        cells = []
        for measure in ("decode_tok_s", "prefill_tok_s"):
            ours, theirs = r.median("llama-chat", measure), r.median(BASELINE, measure)
            cells.append(f"{r.spread('llama-chat', measure)} | {r.spread(BASELINE, measure)} | {_ratio(ours, theirs)}")
        print(f"| {ftype} | " + " | ".join(cells) + " |")


# -- the command ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1.1b,110m", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--types", default=",".join(TYPES), help=f"comma-separated, of {', '.join(TYPES)}")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "llama-chat-bench",
                   help="where llama.cpp, the checkpoints and the files are kept")
    p.add_argument("--quick", action="store_true", help="110m only, 1 round")
    p.add_argument("--threads", type=int, default=2, help="threads for both systems (default 2)")
    p.add_argument("--omp-wait-policy", choices=("default", "passive", "active"), default="default",
                   help="OMP_WAIT_POLICY for both systems; default: unset, as each ships (llama.cpp spins, "
                        "llama-chat sets passive for itself); passive when others share the cores, where "
                        "llama.cpp's spinning threads collapse")
    p.add_argument("--chat-args", default="--lookup off", metavar="ARGS",
                   help="more options for llama-chat's measured runs (default: --lookup off; '' runs it as it "
                        "ships, which on random weights that repeat themselves measures prompt lookup's drafts)")
    p.add_argument("--jobs", type=int, default=2, help="parallel jobs for llama.cpp's build (default 2)")
    p.add_argument("--baseline", type=Path, metavar="DIR",
                   help="a folder holding another tree as llama_chat (e.g. a git worktree linked there): run it "
                        "too, on PYTHONPATH, alternately with this tree, and print this tree over it")
    p.add_argument("--report", type=Path, metavar="FILE",
                   help="print the tables again from a run's saved output (its JSON lines), and run nothing")
    p.add_argument("--prompt-tokens", type=int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--gen", type=int, default=128, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.rounds = "110m", 1
    args.chat_args = shlex.split(args.chat_args)
    args.shape_keys = [s.strip().lower() for s in args.shapes.split(",") if s.strip()]
    args.type_keys = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    longer = [k for k in args.shape_keys if (m := LONGER.fullmatch(k)) and m["base"] in SHAPES]
    known_shapes = [*SHAPES, *longer]
    for name, given, known in (("shape", args.shape_keys, known_shapes), ("type", args.type_keys, TYPES)):
        bad = [g for g in given if g not in known]
        if bad or not given:
            p.error(f"unknown {name} {', '.join(bad) or '(none given)'}; expected some of {', '.join(known)}")
    if args.rounds < 1 or args.threads < 1 or args.jobs < 1:
        p.error("--rounds, --threads and --jobs must be at least 1")
    return args


def check_disk(cache: Path, shapes: list[str], types: list[str]) -> None:
    """Refuse to start when the files cannot fit: F16 is two bytes a weight, the others less."""
    need = 0
    for key in shapes:
        s = shape_of(key)
        params = s.n_layers * (2 * s.dim * s.q_dim + 2 * s.dim * s.kv_dim + 3 * s.dim * s.hidden)
        params += s.vocab * s.dim * (1 if s.tied else 2)
        if not (cache / "models" / key / "hf" / "config.json").is_file():
            need += 2 * params
        for t in dict.fromkeys(["f16", *types]):
            if not gguf_path(cache, key, t).is_file():
                need += 2 * params
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    if need > free:
        raise SystemExit(f"not enough disk under {cache}: about {need / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cache = args.cache.expanduser().resolve()
    if args.report:
        try:
            rows = [json.loads(line) for line in args.report.read_text().splitlines() if line.startswith("{")]
        except (OSError, ValueError) as e:
            print(f"bench_gguf: --report {args.report}: {e}", file=sys.stderr)
            return 2
        if not any("llama_cpp" in r for r in rows) or not any("read_bandwidth_gbs" in r for r in rows):
            print(f"bench_gguf: --report {args.report}: not the output of a run", file=sys.stderr)
            return 2
        report(rows, cache)
        return 0
    check_disk(cache, args.shape_keys, args.type_keys)
    try:
        peer = peer_mod.ensure_llama_cpp(cache, jobs=args.jobs, log=log)
    except PeerError as e:
        print(f"bench_gguf: {e}", file=sys.stderr)
        return 1
    emit(llama_cpp=peer.commit, sdist=peer.version, build_s=round(peer.build_s, 1), built_now=peer.built_now,
         cmake_flags=list(peer_mod.CMAKE_FLAGS), threads=args.threads, omp_wait_policy=args.omp_wait_policy,
         prompt_tokens=args.prompt_tokens, gen=args.gen,
         command=" ".join(sys.argv[1:] if argv is None else argv), llama_chat=llama_chat_revision(),
         baseline=str(args.baseline) if args.baseline else None)

    tokenizer = write_tokenizer(cache / "tokenizer" / "tokenizer.model")
    files: dict[tuple[str, str], Path] = {}
    try:
        for key in args.shape_keys:
            vocab = shape_of(key).vocab
            own = tokenizer if vocab == VOCAB else write_tokenizer(cache / "tokenizer" / f"tokenizer-{vocab}.model", vocab)
            hf_dir = write_checkpoint(shape_of(key), cache / "models" / key / "hf", own)
            for ftype in args.type_keys:
                files[key, ftype] = make_file(peer, cache, key, hf_dir, ftype, args.threads)
    except PeerError as e:
        print(f"bench_gguf: {e}", file=sys.stderr)
        return 1
    prompts = {"long": prefill_prompt(cache, tokenizer, args.prompt_tokens), "short": cache / "prompt-short.txt"}
    prompts["short"].write_text(SHORT_PROMPT)

    env = child_env(args)
    # Untimed: these build llama-chat's CPU kernels (the float ones and the packed ones) when their
    # cache is cold, which would otherwise land in the first timed run, compiler's memory included.
    failed: set[Path] = set()
    smallest = min(files.items(), key=lambda kv: kv[1].stat().st_size)
    log(f"untimed llama-chat runs on the shipped model and on {smallest[1].name}")
    try:
        run_llama_chat(None, prompts["short"], 8, None, env)
    except RunFailed as e:
        print(f"bench_gguf: llama-chat fails on the shipped model: {e}", file=sys.stderr)
        return 1
    try:
        run_llama_chat(smallest[1], prompts["short"], 8, shape_of(smallest[0][0]).ctx, env)
    except RunFailed as e:
        failed.add(smallest[1])
        log(f"llama-chat failed on {smallest[1].name}: {e}")
    for path in files.values():
        read_through(path)
    for round_no in range(1, args.rounds + 1):
        bandwidth = read_bandwidth_gbs(args.threads)
        try:
            _, base = run_llama_chat(None, prompts["short"], args.gen, None, env)
        except RunFailed as e:
            print(f"bench_gguf: llama-chat fails on the shipped model: {e}", file=sys.stderr)
            return 1
        emit(round=round_no, read_bandwidth_gbs=bandwidth, baseline_rss_mb=base.peak_rss_bytes / 1e6,
             load_average_1min=os.getloadavg()[0])
        measure_round(peer, files, prompts, args, round_no, failed)
    emit(load_average_1min=os.getloadavg()[0])
    report(ROWS, cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())

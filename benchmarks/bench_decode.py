"""llama-chat's CPU decode against llama2.c and Hugging Face ``generate``, on the same weights, in one run.

For each config, random float32 weights (seeded) are written once: as a Hugging Face checkpoint,
read by llama-chat's ``load_model`` and by ``transformers.LlamaForCausalLM``, with a llama2.c-style
``tokenizer.bin`` of the same vocabulary size; and, when gcc is present, as llama2.c checkpoints,
v0 for ``run.c`` (float32) and v2 for ``runq.c`` (int8 Q8_0, groups of 64, halved until they divide
dim), with q/k rows put back into Meta's interleaved RoPE order. ``run.c`` and ``runq.c`` are built
from ``../shared/peers/llama2c`` into a temporary folder. Classifier and embedding rows of ids 1 and
2 are zero, so no system stops early.

Every system runs greedy at batch 1 in a process of its own (so the peak RSS is its own), with
``OMP_NUM_THREADS=--threads`` (and ``OMP_WAIT_POLICY=PASSIVE`` and torch's threads for the Python
ones). Measured, per config and dtype (float32; bfloat16 for the Python systems; int8 for runq.c):

* decode tok/s from BOS, as llama2.c starts: median, min and max of ``--runs`` after a warm-up.
  Every system counts the tokens after the first over the time between the first and the last;
* prefill tok/s and time to first token of a 128-token prompt (llama2.c feeds a prompt one token
  at a time, at its decode speed, so it has no prefill figure);
* peak RSS of the process (``os.wait4``);
* llama-chat through what the command runs a prompt on (``generation_source.make_source``: a
  one-job batch of the scheduler, its step thread and channel), eager and with ``--compile``
  (the compiled lone step; its warm-up, with a cold compile cache, is reported apart and done
  before timing), in float32, bfloat16 and ``--quantize int8`` (on float32 weights);
* for reference, where llama-chat's step is our one-call CPU operator, the same step over
  consecutive pages in a bare loop in that process ("operator alone": the step, a greedy pick, the
  token fed back), so that what the scheduler costs around it shows as the difference;
* the machine's read bandwidth (a float32 sum over 512 MiB, median of 7); the bound is that over
  the bytes of weights read per token, and "of bound" is a system's decode speed over it;
* for the float32 configs with ``run.c``, ``--pairs`` back-to-back pairs of one llama-chat decode
  (eager, its own process, one run) and one ``run.c`` decode, alternating which goes first: the
  median of the per-pair ratios. The main rows measure each system's runs together, minutes
  apart from the peer's; on a shared machine whose speed drifts from one minute to the next, a
  ratio of two runs made seconds apart is the steadier one (``bench_batch.py`` does the same).
  Both are printed under the targets. With ``--baseline DIR`` (a folder holding another tree as
  ``llama_chat``), that tree's own copy of this script runs in each round too, and the table adds
  its ratio to run.c and this tree's over it.

It also prints whether the float32 greedy tokens agree: llama-chat (both rows) and llama2.c
``run.c`` against ``transformers``. Prints one JSON line per measurement and a Markdown table last.

    python benchmarks/bench_decode.py [--configs 15m,110m,1.1b] [--runs 3] [--new 200] [--threads 2] [--pairs 5]
    python benchmarks/bench_decode.py --configs 15m,110m --pairs-only --pairs 6 --baseline /tmp/oldpkg
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import torch

from bench_gpu import hf_generate, spread, write_tokenizer_bin

CONFIGS = {
    "15m": dict(name="stories15M", dim=288, n_layers=6, n_heads=6, n_kv_heads=6, hidden=768, vocab=32000,
                seq=256, tied=True),
    "110m": dict(name="stories110M", dim=768, n_layers=12, n_heads=12, n_kv_heads=12, hidden=2048, vocab=32000,
                 seq=1024, tied=True),
    # The TinyLlama-sized config is measured where its targets are (bfloat16 and int8 against HF
    # bfloat16), on fewer tokens and without the compiled row: on two cores its runs are long, and
    # a cold compile of its step longer still.
    "1.1b": dict(name="TinyLlama-1.1B", dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, hidden=5632, vocab=32000,
                 seq=2048, tied=False, dtypes=("bfloat16", "int8"), new=32, llama2c=False, compiled=False),
}
DTYPES = ("float32", "bfloat16", "int8")
PREFILL = 128  # tokens in the prefill prompt
BOS = 1
PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "peers", "llama2c")
RESULTS: list[dict] = []


def emit(**row) -> None:
    RESULTS.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)


def group_size(dim: int) -> int:
    gs = 64
    while dim % gs:
        gs //= 2
    return gs


def bytes_per_token(c: dict, dtype: str) -> float:
    """Weight bytes read per decoded token: every layer, the final norm and the classifier."""
    kv = c["n_kv_heads"] * (c["dim"] // c["n_heads"])
    matrices = c["n_layers"] * (2 * c["dim"] * c["dim"] + 2 * c["dim"] * kv + 3 * c["dim"] * c["hidden"])
    matrices += c["vocab"] * c["dim"]
    norms = (2 * c["n_layers"] + 1) * c["dim"]
    if dtype == "int8":  # int8 values, a float32 scale per group; norms stay float32
        return matrices * (1 + 4 / group_size(c["dim"])) + 4 * norms
    return (4 if dtype == "float32" else 2) * (matrices + norms)


def read_bandwidth_gbs(threads: int) -> float:
    """A float32 sum over 512 MiB with ``threads`` threads: bytes read per second, median of 7."""
    torch.set_num_threads(threads)
    a = torch.ones(2**27)
    a.sum()
    times = []
    for _ in range(7):
        t = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t)
    return a.numel() * 4 / statistics.median(times) / 1e9


# -- the weights -------------------------------------------------------------------------------


def write_weights(c: dict, out: str, llama2c: bool) -> None:
    """``out/hf`` (safetensors and tokenizer.bin), ``out/tokenizer.bin``, ``out/v0.bin``, ``out/v2.bin``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=c["vocab"], hidden_size=c["dim"], intermediate_size=c["hidden"],
        num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"], num_key_value_heads=c["n_kv_heads"],
        max_position_embeddings=c["seq"], rms_norm_eps=1e-5, tie_word_embeddings=c["tied"], rope_theta=10000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
        initializer_range=0.1)  # weights large enough that greedy decoding does not repeat one token
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # ids 1 and 2 never win: a random model must not stop early
        model.get_input_embeddings().weight[1:3] = 0.0
        model.get_output_embeddings().weight[1:3] = 0.0
    model.save_pretrained(os.path.join(out, "hf"), safe_serialization=True)
    write_tokenizer_bin(os.path.join(out, "hf", "tokenizer.bin"), c["vocab"])
    shutil.copy(os.path.join(out, "hf", "tokenizer.bin"), os.path.join(out, "tokenizer.bin"))
    if llama2c:
        t = llama2c_tensors(model, c)
        write_v0(os.path.join(out, "v0.bin"), c, t)
        write_v2(os.path.join(out, "v2.bin"), c, t)


def interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face's rotary order (halves) back to Meta's and llama2.c's (pairs 2i, 2i+1)."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def llama2c_tensors(model, c: dict) -> dict:
    layers = model.model.layers
    return dict(
        emb=model.get_input_embeddings().weight, norm=model.model.norm.weight, cls=model.get_output_embeddings().weight,
        rms_att=[l.input_layernorm.weight for l in layers], rms_ffn=[l.post_attention_layernorm.weight for l in layers],
        wq=[interleaved(l.self_attn.q_proj.weight, c["n_heads"]) for l in layers],
        wk=[interleaved(l.self_attn.k_proj.weight, c["n_kv_heads"]) for l in layers],
        wv=[l.self_attn.v_proj.weight for l in layers], wo=[l.self_attn.o_proj.weight for l in layers],
        w1=[l.mlp.gate_proj.weight for l in layers], w2=[l.mlp.down_proj.weight for l in layers],
        w3=[l.mlp.up_proj.weight for l in layers])


def config_ints(c: dict, vocab: int) -> tuple:
    return (c["dim"], c["hidden"], c["n_layers"], c["n_heads"], c["n_kv_heads"], vocab, c["seq"])


def raw(w: torch.Tensor) -> bytes:
    return w.detach().contiguous().numpy().tobytes()


def write_v0(path: str, c: dict, t: dict) -> None:
    """llama2.c's first format: 7 int32, then float32 weights; negative vocab means untied."""
    with open(path, "wb") as f:
        f.write(struct.pack("<7i", *config_ints(c, c["vocab"] if c["tied"] else -c["vocab"])))
        for w in [t["emb"], *t["rms_att"], *t["wq"], *t["wk"], *t["wv"], *t["wo"], *t["rms_ffn"], *t["w1"],
                  *t["w2"], *t["w3"], t["norm"]]:
            f.write(raw(w))
        f.write(bytes(2 * 4 * c["seq"] * (c["dim"] // c["n_heads"]) // 2))  # the two unused RoPE tables
        if not c["tied"]:
            f.write(raw(t["cls"]))


def write_v2(path: str, c: dict, t: dict) -> None:
    """llama2.c's int8 format for runq.c: a 256-byte header, float32 norms, then each matrix as
    int8 values and float32 scales, symmetric per group of ``group_size`` values."""
    gs = group_size(c["dim"])
    header = struct.pack("<Ii7iBi", 0x616B3432, 2, *config_ints(c, c["vocab"]), int(c["tied"]), gs)
    with open(path, "wb") as f:
        f.write(header.ljust(256, b"\0"))
        for w in [*t["rms_att"], *t["rms_ffn"], t["norm"]]:
            f.write(raw(w))
        for w in [t["emb"], *t["wq"], *t["wk"], *t["wv"], *t["wo"], *t["w1"], *t["w2"], *t["w3"]] + (
                [] if c["tied"] else [t["cls"]]):
            groups = w.detach().float().reshape(-1, gs)
            scale = groups.abs().amax(dim=1) / 127.0
            q = torch.round(groups / scale.clamp_min(1e-30)[:, None]).to(torch.int8)  # zero rows stay zero
            f.write(raw(q))
            f.write(raw(scale))


# -- running one system in its own process -----------------------------------------------------


# Run through a small launcher: a child forked from this (large) process would start with this
# process's peak RSS as its own (Linux carries the high-water mark across fork and exec).
LAUNCHER = """import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
code = os.waitstatus_to_exitcode(status)
os._exit(code if code >= 0 else 128 - code)
"""


def run_child(cmd: list[str], env: dict, timeout: float) -> tuple[int, str, str, float]:
    """Return code, stdout, stderr and the peak RSS (MiB) of that process alone."""
    with tempfile.NamedTemporaryFile("r") as rss:
        run = subprocess.run([sys.executable, "-S", "-c", LAUNCHER, rss.name, *cmd], capture_output=True,
                             stdin=subprocess.DEVNULL, env=env, timeout=timeout)
        peak = int(rss.read() or 0) / 1024
    return run.returncode, run.stdout.decode(errors="replace"), run.stderr.decode(errors="replace"), peak


def python_system(system: str, key: str, path: str, dtype: str, args, env: dict, compile: bool = False,
                  quantize: str = "none", script: str = os.path.abspath(__file__)) -> dict:
    """One worker process; ``script`` is this file, or another tree's copy of it (``--baseline``)."""
    cmd = [sys.executable, script, "--worker", system, "--path", path, "--configs", key,
           "--dtype", dtype, "--new", str(new_tokens(args, CONFIGS[key])), "--runs", str(args.runs),
           "--threads", str(args.threads), "--quantize", quantize]
    if compile:
        cmd.append("--compile")
    rc, out, err, rss = run_child(cmd, env, args.timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if rc != 0 or not lines:
        return dict(error=(err or out)[-800:], rc=rc)
    return dict(json.loads(lines[-1]), rss_mb=rss)


def new_tokens(args, c: dict) -> int:
    return min(args.new, c.get("new", args.new))


def llama2c_system(binary: str, model: str, tokenizer: str, args, env: dict) -> dict:
    """One warm-up run, then ``--runs``; ``achieved tok/s`` from stderr, the ids from the text."""
    cmd = [binary, model, "-z", tokenizer, "-n", str(args.new), "-t", "0", "-s", "0"]
    rates, rss, tokens = [], 0.0, []
    for i in range(args.runs + 1):
        rc, out, err, peak = run_child(cmd, env, args.timeout)
        found = re.search(r"achieved tok/s: ([0-9.]+)", err)
        if rc != 0 or not found:
            return dict(error=err[-800:], rc=rc)
        rss = max(rss, peak)
        if i:
            rates.append(float(found.group(1)))
        tokens = [0 if m.group(0) == "<unk>" else int(m.group(1)) for m in re.finditer(r"<unk>|w(\d+)", out)]
    return dict(decode=spread(rates), rss_mb=rss, words=tokens)


# -- the workers (run in the child processes) --------------------------------------------------


def long_prompt(c: dict, seed: int = 1) -> tuple[int, ...]:
    """A prompt of random ids; each seed's its own, so llama-chat's prefix cache holds none of it
    (a prompt seen before would be timed from the pages it left)."""
    g = torch.Generator().manual_seed(seed)
    return (BOS, *torch.randint(259, c["vocab"], (PREFILL - 1,), generator=g).tolist())


def llama_chat_worker(args, c: dict) -> dict:
    from llama_chat.cmd.generation_source import make_source
    from llama_chat.cmd.source_settings import LoadSettings, SourceSettings
    from llama_chat.inference.types import Request
    from llama_chat.ml.sampling import SamplingParams
    from llama_chat.model.loader import load_model

    greedy = SamplingParams(temperature=0.0)
    t = time.perf_counter()
    loaded = load_model(args.path, device="cpu", dtype=args.dtype, max_seq_len=c["seq"])
    load_s = time.perf_counter() - t
    # What the command runs a prompt on (a one-job batch of the scheduler, on the CPU).
    source = make_source(loaded, SourceSettings(LoadSettings(quantize=args.quantize), compile=args.compile,
                                                cache_type=None, lookup="off"))
    t = time.perf_counter()
    source.warm_up(greedy)
    source.generate(Request((BOS,), sampling=greedy, max_tokens=16))
    source.generate(Request(long_prompt(c), sampling=greedy, max_tokens=2))
    warm_s = time.perf_counter() - t
    decode, tokens = [], []
    for _ in range(args.runs):
        done = source.generate(Request((BOS,), sampling=greedy, max_tokens=args.new))
        assert len(done.token_ids) == args.new, done.finish_reason
        decode.append(done.timings.decode_tok_s)
        tokens = list(done.token_ids)
    prefill, ttft = [], []
    for run in range(args.runs):
        done = source.generate(Request(long_prompt(c, seed=2 + run), sampling=greedy, max_tokens=1))
        assert done.cached_tokens == 0, done.cached_tokens
        prefill.append(done.timings.prefill_tok_s)
        ttft.append(done.timings.ttft_s)
    return dict(decode=spread(decode), prefill=spread(prefill), ttft=spread(ttft), load_s=load_s,
                warm_up_s=warm_s, compiled=source.compiles, tokens=tokens,
                operator_alone=None if source.compiles else operator_alone(loaded.model, args))


def operator_alone(model, args) -> dict | None:
    """Decode tok/s of the operator's one-call step over consecutive pages in a bare loop on this
    thread (the step with its greedy pick, the next token fed back): what the scheduler, its step
    thread, the channel and the Python around each token cost is the difference from the row."""
    from llama_chat.model import cpu_decode
    from llama_chat.model.paged_kv_cache import PagedKVCache

    size = 16
    cache = PagedKVCache.for_model(model.args, num_pages=-(-args.new // size) + 1, page_size=size)
    pages = list(range(1, cache.num_pages))
    rates = []
    with torch.inference_mode():
        decoder = cpu_decode.operator_for(model, cache)
        if decoder is None:
            return None
        for _ in range(args.runs):
            token, times = BOS, []
            for position in range(args.new):
                token = decoder.pick(token, position, pages[:position // size + 1])
                times.append(time.perf_counter())
            rates.append((len(times) - 1) / (times[-1] - times[0]))
    return spread(rates)


def hf_worker(args, c: dict) -> dict:
    from transformers import LlamaForCausalLM

    t = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(args.path, dtype=getattr(torch, args.dtype)).eval()
    load_s = time.perf_counter() - t
    cpu = torch.device("cpu")
    ids, long_ids = torch.tensor([[BOS]]), torch.tensor([long_prompt(c)])
    t = time.perf_counter()
    hf_generate(model, ids, 16, cpu)
    hf_generate(model, long_ids, 2, cpu)
    warm_s = time.perf_counter() - t
    decode, prefill, ttft, tokens = [], [], [], []
    for _ in range(args.runs):
        out, times, _ = hf_generate(model, ids, args.new, cpu)
        decode.append((len(times) - 1) / (times[-1] - times[0]))
        tokens = out[0, 1:].tolist()
    for _ in range(args.runs):
        _, times, start = hf_generate(model, long_ids, 1, cpu)
        ttft.append(times[0] - start)
        prefill.append(PREFILL / ttft[-1])
    return dict(decode=spread(decode), prefill=spread(prefill), ttft=spread(ttft), load_s=load_s, warm_up_s=warm_s,
                tokens=tokens)


def worker(args) -> None:
    torch.set_num_threads(args.threads)
    c = CONFIGS[args.configs]
    row = llama_chat_worker(args, c) if args.worker == "llama_chat" else hf_worker(args, c)
    print(json.dumps(row), flush=True)


# -- the run -----------------------------------------------------------------------------------


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name} ({', '.join(have) or 'no AVX2'}{'' if 'avx512f' in flags else ', no AVX-512'})"


def add_operator_alone(found: dict, name: str) -> None:
    """The llama-chat row's bare loop of its one-call step, as a row of its own (no target reads it)."""
    alone = found[name].pop("operator_alone", None)
    if alone:
        found[f"{name}: operator alone"] = dict(decode=alone, rss_mb=found[name].get("rss_mb", 0.0))


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def prepare_weights(key: str, c: dict, args, bins: dict) -> str:
    """The config's checkpoints in ``--work`` (written once); their folder."""
    work = os.path.join(args.work, key)
    if not os.path.exists(os.path.join(work, "done")):
        t = time.perf_counter()
        write_weights(c, work, bool(bins) and c.get("llama2c", True))
        open(os.path.join(work, "done"), "w").close()
        emit(system="write_weights", config=key, s=time.perf_counter() - t)
    return work


def measure_config(key: str, c: dict, args, bins: dict, envs: dict) -> list[dict]:
    work = prepare_weights(key, c, args, bins)
    hf_dir, rows = os.path.join(work, "hf"), []
    for dtype in c.get("dtypes", DTYPES):
        found = {}
        if dtype != "int8":
            for name, compile in (("llama-chat", False), ("llama-chat compiled", True)):
                if compile and not c.get("compiled", True):
                    continue
                found[name] = python_system("llama_chat", key, hf_dir, dtype, args, envs["python"], compile)
                add_operator_alone(found, name)
            found["HF generate"] = python_system("hf", key, hf_dir, dtype, args, envs["python"])
        else:  # float32 weights quantized when the scheduler is made, as --quantize int8 does
            for name, compile in (("llama-chat", False), ("llama-chat compiled", True)):
                if compile and not c.get("compiled", True):
                    continue
                found[name] = python_system("llama_chat", key, hf_dir, "float32", args, envs["python"], compile,
                                            quantize="int8")
                add_operator_alone(found, name)
        peer = {"float32": ("run.c", "run", "v0.bin"), "int8": ("runq.c", "runq", "v2.bin")}.get(dtype)
        if peer and bins and c.get("llama2c", True):
            found[peer[0]] = llama2c_system(bins[peer[1]], os.path.join(work, peer[2]),
                                            os.path.join(work, "tokenizer.bin"), args, envs["c"])
        for system, r in found.items():
            row = dict(config=key, dtype=dtype, system=system, **r)
            emit(**row)
            rows.append(row)
        if dtype == "float32":
            check_tokens(key, found)
    return rows


def paired_with_run_c(key: str, args, bins: dict, envs: dict) -> dict | None:
    """llama-chat's float32 decode over run.c's in ``--pairs`` back-to-back rounds, one run each,
    rotating which goes first: the per-round ratios and their median. With ``--baseline``, the
    other tree runs in each round too (its own copy of this script, on ``PYTHONPATH``)."""
    work = os.path.join(args.work, key)
    one = argparse.Namespace(**{**vars(args), "runs": 1})
    runs = {"ours": lambda: python_system("llama_chat", key, os.path.join(work, "hf"), "float32", one, envs["python"]),
            "run.c": lambda: llama2c_system(bins["run"], os.path.join(work, "v0.bin"),
                                            os.path.join(work, "tokenizer.bin"), one, envs["c"])}
    if args.baseline:
        script = os.path.join(args.baseline, "llama_chat", "benchmarks", "bench_decode.py")
        env = dict(envs["python"], PYTHONPATH=args.baseline)
        runs["baseline"] = lambda: python_system("llama_chat", key, os.path.join(work, "hf"), "float32", one, env,
                                                 script=script)
    ratios: dict[str, list[float]] = {"ours": [], "baseline": []}
    for i in range(args.pairs):
        order = list(runs)[i % len(runs):] + list(runs)[:i % len(runs)]
        got = {who: runs[who]() for who in order}
        if not all("decode" in r for r in got.values()):
            return None
        for who in ratios:
            if who in got:
                ratios[who].append(got[who]["decode"]["median"] / got["run.c"]["decode"]["median"])
    if not ratios["ours"]:
        return None
    found = dict(config=key, ratios=ratios["ours"], median=statistics.median(ratios["ours"]),
                 min=min(ratios["ours"]), max=max(ratios["ours"]))
    if ratios["baseline"]:
        over = [a / b for a, b in zip(ratios["ours"], ratios["baseline"])]
        found.update(baseline_ratios=ratios["baseline"], baseline_median=statistics.median(ratios["baseline"]),
                     over_baseline=statistics.median(over), over_baseline_min=min(over), over_baseline_max=max(over))
    return found


def check_tokens(key: str, found: dict) -> None:
    """float32 greedy ids against transformers'; llama2.c's as far as its printed text tells."""
    ref = found.get("HF generate", {}).get("tokens")
    if not ref:
        return
    for name in ("llama-chat", "llama-chat compiled"):
        ours = found.get(name, {}).get("tokens")
        if ours:
            emit(system="fp32_greedy_vs_hf", config=key, who=name, identical=ours == ref,
                 equal_until=first_difference(ours, ref), of=len(ref))
    if "words" in found.get("run.c", {}):
        words = [t for t in ref if t == 0 or t >= 259]  # what run.c's text shows: <unk> and " wN" pieces
        got = found["run.c"]["words"]
        emit(system="fp32_greedy_vs_hf", config=key, who="run.c (word pieces)", identical=got == words,
             equal_until=first_difference(got, words), of=len(words))


def fmt_rate(s: dict | None) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})" if s else "-"


def print_table(rows: list[dict], bandwidth: float, args) -> None:
    import transformers

    print(f"\n### {cpu_name()}, {args.threads} threads, read bandwidth {bandwidth:.1f} GB/s\n")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; greedy, batch 1; decode "
          f"{args.new} tokens from BOS, median (min-max) of {args.runs}; prefill and TTFT of a {PREFILL}-token "
          "prompt; ratio: llama-chat (eager / compiled) over that row\n")
    print("| config | dtype | system | decode tok/s | prefill tok/s | TTFT | peak RSS | warm-up | of bound | "
          "llama-chat / this |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        c = CONFIGS[row["config"]]
        bound = bandwidth * 1e9 / bytes_per_token(c, row["dtype"])
        same = {r["system"]: r for r in rows if r["config"] == row["config"] and r["dtype"] == row["dtype"]}
        d = row.get("decode")
        ratio = "-"
        if d and not row["system"].startswith("llama-chat"):
            ours = [same.get(n, {}).get("decode") for n in ("llama-chat", "llama-chat compiled")]
            ratio = " / ".join(f"{o['median'] / d['median']:.2f}x" if o else "-" for o in ours)
        err = row.get("error") or row.get("missing")
        cells = [f"{c['name']}-sized", row["dtype"], row["system"]]
        if err:
            cells += ["failed" if row.get("error") else "-"] + ["-"] * 6
        else:
            ttft, prefill = row.get("ttft"), row.get("prefill")
            warm = row.get("warm_up_s")
            cells += [fmt_rate(d), f"{prefill['median']:.0f}" if prefill else "-",
                      f"{ttft['median'] * 1e3:.0f} ms" if ttft else "-", f"{row['rss_mb']:.0f} MiB",
                      f"{warm:.1f} s" if warm is not None else "-", f"{d['median'] / bound:.0%} of {bound:.0f}",
                      ratio]
        print("| " + " | ".join(cells) + " |")


def print_targets(rows: list[dict], pairs: list[dict] = ()) -> None:
    """The issue's targets as ratios of this run's medians: decode, then prefill; then the
    float32 decode against run.c as the median of back-to-back pairs."""

    def rate(key: str, dtype: str, system: str, what: str = "decode") -> float | None:
        for r in rows:
            if (r["config"], r["dtype"], r["system"]) == (key, dtype, system) and r.get(what):
                return r[what]["median"]
        return None

    checks = []
    for key in ("15m", "110m"):
        for ours in ("llama-chat", "llama-chat compiled"):
            checks += [(key, "float32", ours, "float32", "run.c", 1.0), (key, "float32", ours, "float32", "HF generate", 2.0)]
    for ours in ("llama-chat", "llama-chat compiled"):
        checks += [("110m", "int8", ours, "int8", "runq.c", 1.0), ("1.1b", "int8", ours, "bfloat16", "HF generate", 2.0)]
    checks += [("1.1b", "bfloat16", ours, "bfloat16", "HF generate", 1.3) for ours in ("llama-chat", "llama-chat compiled")]
    print("\n| target | config | llama-chat | peer | ratio | met |\n|---|---|---|---|---|---|")
    for key, dtype, ours, peer_dtype, peer, want in checks:
        a, b = rate(key, dtype, ours), rate(key, peer_dtype, peer)
        if a and b:
            print(f"| decode >= {want}x | {CONFIGS[key]['name']}-sized | {ours} {dtype} {a:.1f} | {peer} {peer_dtype} "
                  f"{b:.1f} | {a / b:.2f}x | {'yes' if a / b >= want else 'no'} |")
    for key in CONFIGS:
        for dtype in DTYPES:
            b = rate(key, dtype if dtype != "int8" else "float32", "HF generate", "prefill")
            for ours in ("llama-chat", "llama-chat compiled"):
                a = rate(key, dtype, ours, "prefill")
                if a and b:
                    print(f"| prefill >= 1x | {CONFIGS[key]['name']}-sized | {ours} {dtype} {a:.0f} | HF generate "
                          f"{dtype if dtype != 'int8' else 'float32'} {b:.0f} | {a / b:.2f}x | {'yes' if a >= b else 'no'} |")
    for p in pairs:
        print(f"| decode >= 1.0x, {len(p['ratios'])} back-to-back pairs | {CONFIGS[p['config']]['name']}-sized | "
              f"llama-chat float32 | run.c float32 | {p['median']:.2f}x (pairs {p['min']:.2f}-{p['max']:.2f}) | "
              f"{'yes' if p['median'] >= 1.0 else 'no'} |")
        if "baseline_median" in p:
            print(f"| (--baseline) | {CONFIGS[p['config']]['name']}-sized | baseline float32 | run.c float32 | "
                  f"{p['baseline_median']:.2f}x; this tree over the baseline {p['over_baseline']:.2f}x "
                  f"(rounds {p['over_baseline_min']:.2f}-{p['over_baseline_max']:.2f}) | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="15m,110m", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new", type=int, default=200, help="tokens to decode (llama2.c: -n new)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "bench-decode"))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    ap.add_argument("--keep-compile-cache", action="store_true",
                    help="reuse the user's compile cache instead of measuring a cold compile")
    ap.add_argument("--llama2c", default=PEERS, help="the folder with llama2.c's build.sh")
    ap.add_argument("--pairs", type=int, default=5,
                    help="back-to-back pairs of llama-chat and run.c float32 decode per config (0: none)")
    ap.add_argument("--pairs-only", action="store_true",
                    help="only the back-to-back pairs with run.c (a quick A/B of two trees)")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="with the pairs: a folder holding another tree as llama_chat (e.g. a git worktree linked "
                         "there), run in each round beside this tree and run.c")
    ap.add_argument("--out", default=None, help="write every row as JSON here")
    ap.add_argument("--worker", choices=("llama_chat", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quantize", default="none", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    keys = args.configs.split(",")
    for key in keys:
        if key not in CONFIGS:
            ap.error(f"unknown config {key!r}; choose from {', '.join(CONFIGS)}")
        if new_tokens(args, CONFIGS[key]) >= CONFIGS[key]["seq"]:
            ap.error(f"--new {args.new} does not fit in {key}'s context of {CONFIGS[key]['seq']}")
    os.makedirs(args.work, exist_ok=True)
    threads = str(args.threads)
    # llama2.c runs as its README runs it (OpenMP's default wait policy); the Python systems as the
    # command runs (cmd/app.py sets PASSIVE: helpers spinning after each region take the cores).
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    envs = dict(c=dict(base, OMP_NUM_THREADS=threads),
                python=dict(base, OMP_NUM_THREADS=threads, OMP_WAIT_POLICY="PASSIVE"))
    if not args.keep_compile_cache:  # a cold cache: the compiled row's warm-up is a first run's
        envs["python"]["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-", dir=args.work)
    bins = {}
    if shutil.which("gcc"):
        out = tempfile.mkdtemp(prefix="llama2c-", dir=args.work)
        build = subprocess.run(["bash", os.path.join(args.llama2c, "build.sh"), out], capture_output=True, text=True)
        if build.returncode == 0:
            bins = dict(run=os.path.join(out, "run"), runq=os.path.join(out, "runq"))
        emit(system="llama2c_build", ok=build.returncode == 0, log=build.stderr[-400:])
    bandwidth = read_bandwidth_gbs(args.threads)
    emit(system="env", cpu=cpu_name(), torch=torch.__version__, threads=args.threads, new=args.new, runs=args.runs,
         read_bandwidth_gbs=bandwidth)
    rows, pairs = [], []
    for key in keys:
        if args.pairs_only:
            prepare_weights(key, CONFIGS[key], args, bins)
        else:
            rows += measure_config(key, CONFIGS[key], args, bins, envs)
        if bins and args.pairs > 0 and CONFIGS[key].get("llama2c", True) and "float32" in CONFIGS[key].get("dtypes", DTYPES):
            found = paired_with_run_c(key, args, bins, envs)
            if found is not None:
                emit(system="paired: llama-chat / run.c", **found)
                pairs.append(found)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1)
    print_table(rows, bandwidth, args)
    print_targets(rows, pairs)


if __name__ == "__main__":
    main()

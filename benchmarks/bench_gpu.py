"""llama-chat on a GPU against Hugging Face ``generate`` and the card's bandwidth, in one run.

For each config, random bfloat16 weights are written once as a Hugging Face checkpoint (with a
llama2.c-style ``tokenizer.bin`` of the same vocabulary size, so every sampled id has bytes) and
measured, greedy, batch 1, by:

* llama-chat's scheduler of one job, loaded by ``load_model`` and driven by
  ``Scheduler.complete``: the step thread, the bounded channel and the lone job's CUDA-graph
  decode step (``inference/decode_step.py``) that the command uses;
* Hugging Face ``generate``, eager and with ``cache_implementation="static"`` (its own
  compiled fast path);
* the device's copy bandwidth, from which the bound is bandwidth / bytes of weights per token;
* the command itself in a new process (``llama-chat --json``), whose warm-up is the second
  run's compile time (the on-disk compile cache is warm by then).

Prints one JSON line per measurement and a Markdown table last.

    python benchmarks/bench_gpu.py --configs c,e [--new 256] [--runs 3] [--ctx 1024] [--parity]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

# As the command does (cmd/app.py): OpenMP helpers that spin after each parallel region would
# take the cores from the other thread's forward.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

CONFIGS = {
    "tiny": dict(name="tiny", dim=256, n_layers=2, n_heads=8, n_kv_heads=2, hidden=688, vocab=2048),
    "c": dict(name="TinyLlama-1.1B", dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, hidden=5632, vocab=32000),
    "e": dict(name="Llama-2-7B", dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, hidden=11008, vocab=32000),
}
RESULTS: list[dict] = []


def emit(**row) -> None:
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def spread(values: list[float]) -> dict:
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def bytes_per_token(c: dict) -> int:
    """Weight bytes read per decoded token in bfloat16: every layer, the final norm, the output."""
    head_dim = c["dim"] // c["n_heads"]
    kv = c["n_kv_heads"] * head_dim
    layer = 2 * c["dim"] * c["dim"] + 2 * c["dim"] * kv + 3 * c["dim"] * c["hidden"] + 2 * c["dim"]
    return 2 * (c["n_layers"] * layer + c["dim"] + c["vocab"] * c["dim"])


def copy_bandwidth_gbs(device: torch.device) -> float:
    """Device-to-device copy of 1 GiB, bytes read plus written, median of 10."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(2**29, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * 2**29 * 2 / statistics.median(times) / 1e9


def write_tokenizer_bin(path: str, vocab: int) -> None:
    """llama2.c's tokenizer layout: <unk>, <s>, </s>, 256 byte pieces, then numbered words."""
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    pieces += [f" w{i}".encode() for i in range(len(pieces), vocab)]
    out = bytearray(struct.pack("<i", max(map(len, pieces))))
    for piece in pieces:
        out += struct.pack("<fi", 0.0, len(piece)) + piece
    with open(path, "wb") as f:
        f.write(out)


def write_checkpoint(c: dict, out: str, device: torch.device, dtype: torch.dtype) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=c["vocab"], hidden_size=c["dim"], intermediate_size=c["hidden"],
        num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"], num_key_value_heads=c["n_kv_heads"],
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # ids 0-2 never win: a random model must not stop early
        model.lm_head.weight[:3] = 0.0
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer_bin(os.path.join(out, "tokenizer.bin"), c["vocab"])
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# -- llama-chat --------------------------------------------------------------------------------


def llama_chat_round(key: str, path: str, device: torch.device, dtype: str, args, prompt, long_prompt) -> dict:
    from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
    from llama_chat.inference.types import Request
    from llama_chat.ml.sampling import SamplingParams
    from llama_chat.model.loader import load_model

    greedy = SamplingParams(temperature=0.0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    loaded = load_model(path, device=device, dtype=dtype, max_seq_len=args.ctx)
    sync(device)
    load_s = time.perf_counter() - t
    engine = Scheduler.from_loaded(loaded, SchedulerOptions(max_batch=1, compile=args.compile))
    t = time.perf_counter()
    engine.warm_up(greedy)
    sync(device)
    warm_s = time.perf_counter() - t
    from torch._dynamo.utils import counters

    emit(system="llama_chat_setup", config=key, load_s=load_s, warm_up_s=warm_s, compiled=engine.compiles,
         ctx=engine.max_seq_len, prefill_chunk=engine.core.settings.prefill_chunk,
         inductor={k: v for k, v in counters["inductor"].items() if "cache" in k})

    engine.generate(Request(prompt, sampling=greedy, max_tokens=16))  # first prefill shapes, allocator
    decode, ttft, tokens = [], [], None
    for _ in range(args.runs):
        done = engine.generate(Request(prompt, sampling=greedy, max_tokens=args.new))
        decode.append(done.timings.decode_tok_s)
        ttft.append(done.timings.ttft_s)
        tokens = done.token_ids
        assert len(done.token_ids) == args.new, done.finish_reason
    prefill = []
    for run in range(args.runs):
        # Turned by one each run, so the prefix cache holds no page of it from the run before.
        done = engine.generate(Request(long_prompt[run:] + long_prompt[:run], sampling=greedy, max_tokens=1))
        assert done.cached_tokens == 0, done.cached_tokens
        prefill.append(done.timings.prefill_tok_s)
    sampled = None
    if args.sampled:  # temperature and top-p: a second graph, compiled here, outside the timings
        nucleus = SamplingParams(temperature=0.8, top_p=0.95)
        t = time.perf_counter()
        engine.warm_up(nucleus)
        emit(system="llama_chat_setup_sampled", config=key, warm_up_s=time.perf_counter() - t)
        sampled = engine.generate(Request(prompt, sampling=nucleus, seed=1, max_tokens=args.new)).timings.decode_tok_s
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    row = dict(system="llama_chat", config=key, decode_tok_s=spread(decode), ttft_16_s=spread(ttft),
               prefill_512_tok_s=spread(prefill),
               sampled_top_p_decode_tok_s=sampled, peak_gpu_gib=peak)
    emit(**row)
    row["tokens"] = tokens
    if args.parity_bf16:
        row["bf16"] = bf16_check(loaded, engine, prompt, device, args.logits_check)
    del engine, loaded
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def bf16_check(loaded, engine, prompt, device, logits: bool) -> dict:
    """The compiled step's greedy tokens against the eager step's, and one forward's logits."""
    from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
    from llama_chat.inference.types import Request
    from llama_chat.ml.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    eager = Scheduler.from_loaded(loaded, SchedulerOptions(max_batch=1, compile=False))
    eager_ids = list(eager.generate(Request(tuple(prompt), sampling=greedy, max_tokens=64)).token_ids)
    compiled_ids = list(engine.generate(Request(tuple(prompt), sampling=greedy, max_tokens=64)).token_ids)
    same = next((i for i, (a, b) in enumerate(zip(eager_ids, compiled_ids)) if a != b), 64)
    emit(system="bf16_step_vs_eager", greedy_ids_equal_until=same, of=64)
    if not logits:
        return {}
    tokens = torch.tensor([list(prompt)], device=device)
    with torch.inference_mode():
        ref = loaded.model(tokens).float()
        fast = torch.compile(loaded.model, fullgraph=True)(tokens).float()
    diff = (ref - fast).abs()
    row = dict(system="bf16_compiled_vs_eager", greedy_ids_equal_until=same, of=64,
               max_abs_logit_diff=float(diff.max()), mean_abs_logit_diff=float(diff.mean()),
               logit_std=float(ref.std()))
    emit(**row)
    del eager
    return row


def command_run(path: str, dtype: str, args, env: dict) -> None:
    """The installed command in a new process: its wall time with a warm compile cache."""
    launcher = "import sys; from llama_chat.cmd.main import main; sys.argv[0] = 'llama-chat'; main()"
    cmd = [sys.executable, "-c", launcher, "-m", path, "-p", "w300 w301 w302 w303", "-n", "64",
           "-t", "0", "--json", "--template", "none", "--dtype", dtype, "-c", str(args.ctx)]
    if args.compile is not None:
        cmd.append("--compile" if args.compile else "--no-compile")
    t = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env, timeout=900)
    wall = time.perf_counter() - t
    if run.returncode != 0:
        emit(system="command", error=run.stderr[-600:], rc=run.returncode)
        return
    out = json.loads(run.stdout)
    emit(system="command", wall_s=wall, timings=out.get("timings"), completion_tokens=out.get("completion_tokens"),
         finish_reason=out.get("finish_reason"))


def second_run_warm_up(path: str, dtype: str, args, env: dict) -> None:
    """Load and warm up in a new process: the compile time of a second run, cache counters."""
    cmd = [sys.executable, os.path.abspath(__file__), "--warm-up-only", path, "--device", args.device,
           "--ctx", str(args.ctx)]
    if args.compile is not None:
        cmd.append("--compile" if args.compile else "--no-compile")
    run = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not lines:
        emit(system="second_run", error=run.stderr[-600:], rc=run.returncode)
        return
    emit(**json.loads(lines[-1]))


def warm_up_only(path: str, args) -> None:
    from torch._dynamo.utils import counters

    from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
    from llama_chat.ml.sampling import SamplingParams
    from llama_chat.model.loader import load_model

    device = torch.device(args.device)
    t = time.perf_counter()
    loaded = load_model(path, device=device, dtype="bfloat16" if device.type == "cuda" else "float32",
                        max_seq_len=args.ctx)
    engine = Scheduler.from_loaded(loaded, SchedulerOptions(max_batch=1, compile=args.compile))
    sync(device)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    engine.warm_up(SamplingParams(temperature=0.0))
    sync(device)
    print(json.dumps(dict(system="second_run", load_s=load_s, warm_up_s=time.perf_counter() - t,
                          inductor={k: v for k, v in counters["inductor"].items() if "cache" in k},
                          aot_autograd={k: v for k, v in counters["aot_autograd"].items() if "cache" in k})))


# -- Hugging Face ------------------------------------------------------------------------------


class _StepTimes:
    """A logits processor that timestamps every step (after a sync), as gpu_round measured HF."""

    def __init__(self, device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def hf_generate(model, ids, n: int, device, **kw):
    from transformers import LogitsProcessorList

    timer = _StepTimes(device)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1,
                             logits_processor=LogitsProcessorList([timer]), pad_token_id=0, eos_token_id=2,
                             attention_mask=torch.ones_like(ids), **kw)
    return out, timer.times, start


def hf_round(key: str, path: str, device, dtype, args, prompt, long_prompt) -> list[int]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.tensor([list(prompt)], device=device)
    long_ids = torch.tensor([list(long_prompt)], device=device)
    hf_generate(model, ids, 8, device)
    decode, prefill, tokens = [], [], []
    for _ in range(args.runs):
        out, times, _ = hf_generate(model, ids, args.new, device)
        decode.append((len(times) - 1) / (times[-1] - times[0]))
        tokens = out[0, ids.shape[1]:].tolist()
        _, times, start = hf_generate(model, long_ids, 1, device)
        prefill.append(long_ids.shape[1] / (times[0] - start))
    emit(system="hf_eager", config=key, decode_tok_s=spread(decode), prefill_512_tok_s=spread(prefill))
    if not args.skip_hf_static:
        model.generation_config.cache_implementation = "static"
        t = time.perf_counter()
        for _ in range(3):
            hf_generate(model, ids, args.new, device)
        warm = time.perf_counter() - t
        decode = []
        for _ in range(args.runs):
            _, times, _ = hf_generate(model, ids, args.new, device)
            decode.append((len(times) - 1) / (times[-1] - times[0]))
        emit(system="hf_static", config=key, decode_tok_s=spread(decode), warm_up_s=warm)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return tokens


def fp32_parity(key: str, c: dict, work: str, device, args, prompt) -> None:
    """Greedy ids in float32: llama-chat's engine against HF ``generate`` on the same weights."""
    path = os.path.join(work, f"{key}_fp32")
    if not os.path.exists(path):
        write_checkpoint(c, path, device, torch.float32)
    hf_ids = hf_round_fp32(path, device, prompt)
    from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
    from llama_chat.inference.types import Request
    from llama_chat.ml.sampling import SamplingParams
    from llama_chat.model.loader import load_model

    loaded = load_model(path, device=device, dtype="float32", max_seq_len=args.ctx)
    # The same static step in a CUDA graph, uncompiled: the bf16 rows compare compiled with eager.
    engine = Scheduler.from_loaded(loaded, SchedulerOptions(max_batch=1, compile=False))
    ours = list(engine.generate(Request(prompt, sampling=SamplingParams(temperature=0.0), max_tokens=48)).token_ids)
    same = next((i for i, (a, b) in enumerate(zip(hf_ids, ours)) if a != b), len(ours))
    emit(system="fp32_parity", config=key, identical=hf_ids == ours, first_difference=same, n=len(ours))
    del engine, loaded
    if device.type == "cuda":
        torch.cuda.empty_cache()


def hf_round_fp32(path, device, prompt) -> list[int]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    ids = torch.tensor([list(prompt)], device=device)
    out, _, _ = hf_generate(model, ids, 48, device)
    del model
    return out[0, ids.shape[1]:].tolist()


# -- the run -----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="c,e")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=1024, help="llama-chat's context (KV cache) length")
    ap.add_argument("--compile", default=None, action=argparse.BooleanOptionalAction)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "bench-gpu"))
    ap.add_argument("--out", default=None, help="write every row as JSON here")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-hf-static", action="store_true")
    ap.add_argument("--skip-command", action="store_true")
    ap.add_argument("--skip-second-run", action="store_true")
    ap.add_argument("--sampled", action="store_true", help="also decode with temperature 0.8 and top-p 0.95")
    ap.add_argument("--parity", action="store_true", help="also fp32 greedy ids against HF, and bf16 checks")
    ap.add_argument("--logits-check", action="store_true",
                    help="with --parity: also compile the whole model to compare bf16 logits with eager")
    ap.add_argument("--warm-up-only", metavar="PATH", help=argparse.SUPPRESS)
    ap.add_argument("--keep-compile-cache", action="store_true",
                    help="reuse the user's compile cache instead of measuring a cold first compile")
    args = ap.parse_args()
    if args.warm_up_only:
        warm_up_only(args.warm_up_only, args)
        return
    args.parity_bf16 = args.parity
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype_name = "bfloat16" if dtype is torch.bfloat16 else "float32"
    os.makedirs(args.work, exist_ok=True)
    if not args.keep_compile_cache:  # a cold cache: the first compile below is a true first run
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-", dir=args.work)
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    emit(system="env", device=name, torch=torch.__version__, transformers=transformers.__version__,
         new_tokens=args.new, runs=args.runs, ctx=args.ctx)
    bandwidth = copy_bandwidth_gbs(device)
    emit(system="bandwidth", copy_gbs=bandwidth)
    g = torch.Generator().manual_seed(1)
    table = []
    for key in args.configs.split(","):
        c = CONFIGS[key]
        path = os.path.join(args.work, key)
        if not os.path.exists(os.path.join(path, "tokenizer.bin")):
            t = time.perf_counter()
            write_checkpoint(c, path, device, dtype)
            emit(system="write_checkpoint", config=key, s=time.perf_counter() - t)
        prompt = tuple(torch.randint(3, c["vocab"], (16,), generator=g).tolist())
        long_prompt = tuple(torch.randint(3, c["vocab"], (512,), generator=g).tolist())
        ours = llama_chat_round(key, path, device, dtype_name, args, prompt, long_prompt)
        hf = {}
        if not args.skip_hf:
            hf_tokens = hf_round(key, path, device, dtype, args, prompt, long_prompt)
            same = next((i for i, (a, b) in enumerate(zip(hf_tokens, ours["tokens"])) if a != b), len(hf_tokens))
            emit(system="bf16_greedy_vs_hf", config=key, equal_until=same, of=len(hf_tokens))
            hf = {r["system"]: r for r in RESULTS if r.get("config") == key and r["system"].startswith("hf_")}
        if not args.skip_second_run:
            second_run_warm_up(path, dtype_name, args, dict(os.environ))
        if not args.skip_command:
            command_run(path, dtype_name, args, dict(os.environ))
        bound = bandwidth * 1e9 / bytes_per_token(c)
        emit(system="bound", config=key, bytes_per_token=bytes_per_token(c), bound_tok_s=bound)
        table.append((key, c, ours, hf, bound))
        if args.parity:
            fp32_parity(key, c, args.work, device, args, prompt)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1)
    print_table(table, name)


def print_table(table, device_name: str) -> None:
    print(f"\n{device_name}, bfloat16, batch 1, greedy; decode tok/s median (min-max)\n")
    print("| config | llama-chat | HF eager | HF static | bound | llama-chat / HF static | "
          "of bound | prefill 512 (ours / HF eager) | TTFT 16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, c, ours, hf, bound in table:
        d = ours["decode_tok_s"]
        eager = hf.get("hf_eager", {}).get("decode_tok_s", {}).get("median")
        static = hf.get("hf_static", {}).get("decode_tok_s", {}).get("median")
        hf_prefill = hf.get("hf_eager", {}).get("prefill_512_tok_s", {}).get("median")
        ratio = f"{d['median'] / static:.2f}x" if static else "-"
        print(f"| {c['name']} | {d['median']:.0f} ({d['min']:.0f}-{d['max']:.0f}) | "
              f"{eager or 0:.0f} | {static or 0:.0f} | {bound:.0f} | "
              f"{ratio} | {d['median'] / bound:.0%} | {ours['prefill_512_tok_s']['median']:.0f} / "
              f"{hf_prefill or 0:.0f} | {ours['ttft_16_s']['median'] * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()

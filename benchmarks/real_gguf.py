"""The shipped model as people's GGUF files are made, run by llama-chat and by llama.cpp side by side.

The tests cannot download a real GGUF file, so this script makes one the way real files are made,
from a real trained model: the package's own (``model/default_model``, docs/default-model.md).

1. Export: the Meta checkpoint becomes a Hugging Face folder as a Llama 2 chat checkpoint
   carries it: ``config.json``, ``generation_config.json`` and ``model.safetensors`` (float16,
   written by ``transformers``' ``save_pretrained`` after loading the weights with Hugging Face's
   q/k rotary permutation), the SentencePiece ``tokenizer.model``, ``tokenizer_config.json``
   (with Llama 2's chat template, the layout the model was trained on) and
   ``special_tokens_map.json``. Checked: ``transformers`` on that folder gives the logits of
   llama-chat's float32 model, and its ``apply_chat_template`` the ids of the chat format.
2. Files, by llama.cpp's own tools (``llama_cpp_peer.py``: the ``llama-cpp-python`` sdist's
   llama.cpp, built into the cache): ``convert_hf_to_gguf.py --outtype f16|q8_0``, and
   ``llama-quantize`` from the F16 file to Q4_0 and Q4_K_M. The feed-forward rows of 704 values
   are not whole 256-value super-blocks, so llama-quantize writes some tensors of the Q4_K_M file
   in a 32-value type instead, as it does for every model of such shapes: the files are kept so.
   ``llama-completion``, ``llama-perplexity`` and ``llama-tokenize`` are built in the same build
   folder when missing (a few more objects on top of the libraries already built).
3. Checks, each printed:
   * the F16 file's tensors are the shipped float16 weights, bit for bit (the converter undoes
     the export's permutation);
   * tokenizer: ``llama-tokenize`` and the tokenizer llama-chat reads from each file give the same
     ids on the held-out text (the training script's validation documents);
   * one-shot, greedy, as a user runs it: ``llama-chat -m FILE -p PROMPT -t 0 -n N --json --stats``
     on the shipped model (float32, the reference), the exported folder and each file, with the
     chat template (from the file) and with ``--template none``; the text against the reference's,
     where it first differs, the weights as ``--stats`` reports them, and the peak RSS;
   * llama.cpp on the same file and the same prompt ids (``llama-completion --temp 0 -no-cnv``, the
     template's text given as the prompt), its text against llama-chat's;
   * perplexity on the held-out text, llama.cpp's ``llama-perplexity -c 512`` and the same
     computation by llama-chat (the file loaded as the command loads it; llama.cpp's chunks: a
     bos first, the second half of each 512-token chunk scored);
   * the chat in a pseudo-terminal, with a system message and two turns, on each file's own
     template, against the shipped model's (llama2 format) replies; ``/stats`` after it;
   * ``--list`` with the files laid out as a Hugging Face cache holds a downloaded GGUF repository.

    python benchmarks/real_gguf.py                    # everything, cached in ~/.cache/llama-chat-bench
    python benchmarks/real_gguf.py --chunks 8 -n 120  # less of it

Nothing is written into the repository. Figures seen are in docs/formats.md, "A real trained
model through llama.cpp's tools".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import llama_cpp_peer as peer_mod
from llama_cpp_peer import LlamaCpp, PeerError, run_measured

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars would fill the report
META_DIR = ROOT / "model" / "default_model"
sys.path.insert(0, str(ROOT / "scripts"))

# Meta's Llama 2 chat template as meta-llama/Llama-2-7b-chat-hf's tokenizer_config.json carries it:
# ``<s>[INST] user [/INST] answer </s>`` per turn, the layout the shipped model was trained on.
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
# How each file is made: by the converter from the folder, or by llama-quantize from the F16 file.
FILES = {"F16": ("convert", "f16"), "Q8_0": ("convert", "q8_0"), "Q4_0": ("quantize", "Q4_0"),
         "Q4_K_M": ("quantize", "Q4_K_M")}
EXTRA_TOOLS = ("llama-completion", "llama-perplexity", "llama-tokenize")
PROMPTS = [("Once upon a time", "auto"), ("Tell me a story about a dragon", "auto"), ("Once upon a time", "none")]
SYSTEM = "You are a helpful assistant. Keep your answers short."
CHAT_TURNS = ("Tell me a story about a dragon", "What sound does a cow make?")
PPL_CTX = 512
VAL_SEED = 1_000_003  # the training script's validation stream (scripts/evaluate_quantized.py)
WAIT_S = 300.0  # for anything the chat must show, on however busy a machine


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def section(title: str) -> None:
    print(f"\n## {title}\n", flush=True)


def llama_chat_bin() -> str:
    found = Path(sys.executable).parent / "llama-chat"
    return str(found) if found.is_file() else "llama-chat"


# -- llama.cpp's extra tools -------------------------------------------------------------------


def ensure_tools(peer: LlamaCpp, jobs: int) -> dict[str, Path]:
    """The extra tools, built in the peer's build folder when missing (libraries are reused)."""
    build = peer.bench.parent.parent
    tools = {name: build / "bin" / name for name in EXTRA_TOOLS}
    missing = [name for name, path in tools.items() if not path.is_file()]
    if missing:
        log(f"building {', '.join(missing)} in {build}")
        with open(build / "build.log", "a") as logfile:
            r = subprocess.run(["nice", "-n", "10", "cmake", "--build", str(build), "--config", "Release",
                                "-j", str(jobs), "--target", *missing], stdout=logfile, stderr=subprocess.STDOUT)
        if r.returncode:
            raise PeerError(f"building {', '.join(missing)} failed; see {build / 'build.log'}")
    return tools


# -- the Hugging Face folder ---------------------------------------------------------------------


def hf_permute(w, n_heads: int):
    """Hugging Face's q/k row order (rotate-half) from Meta's interleaved pairs, as its conversion
    script writes it; llama.cpp's converter undoes exactly this."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def export_hf(meta_dir: Path, out: Path) -> Path:
    """``out/`` as the Hugging Face checkpoint of the Meta one, written once."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    p = json.loads((meta_dir / "params.json").read_text())
    state = torch.load(meta_dir / "consolidated.00.pth", map_location="cpu", mmap=True, weights_only=True)
    n_kv = p.get("n_kv_heads") or p["n_heads"]
    config = LlamaConfig(vocab_size=p["vocab_size"], hidden_size=p["dim"], intermediate_size=p["hidden_dim"],
                         num_hidden_layers=p["n_layers"], num_attention_heads=p["n_heads"],
                         num_key_value_heads=n_kv, max_position_embeddings=p["max_seq_len"],
                         rms_norm_eps=p["norm_eps"], rope_theta=p["rope_theta"],
                         tie_word_embeddings=p["tie_embeddings"], bos_token_id=1, eos_token_id=2,
                         pad_token_id=None)
    hf = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"]}
    hf["lm_head.weight"] = state.get("output.weight", state["tok_embeddings.weight"])
    names = {"attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
             "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    for i in range(p["n_layers"]):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        hf[dst + "self_attn.q_proj.weight"] = hf_permute(state[src + "attention.wq.weight"], p["n_heads"])
        hf[dst + "self_attn.k_proj.weight"] = hf_permute(state[src + "attention.wk.weight"], n_kv)
        for meta, name in names.items():
            hf[f"{dst}{name}.weight"] = state[f"{src}{meta}.weight"]
    model = LlamaForCausalLM(config).to(torch.float16)
    model.load_state_dict({k: v.contiguous() for k, v in hf.items()}, strict=True)
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    shutil.copyfile(meta_dir / "tokenizer.model", tmp / "tokenizer.model")
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": None, "clean_up_tokenization_spaces": False,
        # The model was trained on ``sp.encode`` of each turn: a dummy prefix after every <s>,
        # which is Hugging Face's legacy SentencePiece behaviour.
        "legacy": True, "model_max_length": p["max_seq_len"], "sp_model_kwargs": {},
        "tokenizer_class": "LlamaTokenizer", "chat_template": LLAMA2_CHAT_TEMPLATE}, indent=2) + "\n")
    (tmp / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out


def check_export(hf_dir: Path) -> None:
    """transformers on the folder against llama-chat's float32 Meta model: logits and chat ids."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from llama_chat.model.chat_format import Message
    from llama_chat.model.loader import load_model

    ours = load_model(META_DIR, device="cpu", dtype="float32")
    dialog = [Message("system", SYSTEM), Message("user", CHAT_TURNS[0]), Message("assistant", "Once upon a time."),
              Message("user", CHAT_TURNS[1])]
    ids = ours.chat_format.encode_dialog(dialog)
    with torch.inference_mode():
        theirs = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        ref = theirs(torch.tensor([ids])).logits[0]
        got = ours.model.eval()(torch.tensor([ids]))[0]
    print(f"- transformers on the exported folder vs llama-chat's float32 model: {len(ids)} tokens of a "
          f"two-turn dialog, max |logit difference| {float((ref - got).abs().max()):.2e}, greedy next "
          f"tokens equal at {int((ref.argmax(-1) == got.argmax(-1)).sum())}/{len(ids)} positions")
    try:
        tok = AutoTokenizer.from_pretrained(hf_dir)
        hf_ids = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in dialog],
                                         tokenize=True, add_generation_prompt=True)
        hf_ids = list(hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids)
        same = hf_ids == ids
        print(f"- transformers' apply_chat_template on the folder vs llama-chat's llama2 format: "
              f"{'the same ids' if same else 'DIFFERENT ids: ' + first_difference(hf_ids, ids)}")
    except Exception as exc:  # noqa: BLE001 - a report line, not a failure of the run
        print(f"- transformers' tokenizer could not be used on the folder: {type(exc).__name__}: {exc}")


# -- the files -----------------------------------------------------------------------------------


def make_files(peer: LlamaCpp, hf_dir: Path, folder: Path, threads: int) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    for kind, (how, ftype) in FILES.items():
        out = folder / f"default-model-{kind}.gguf"
        if not out.is_file():
            t0 = time.perf_counter()
            if how == "convert":
                peer_mod.convert(peer, hf_dir, out, ftype)
            else:
                peer_mod.quantize(peer, files["F16"], out, ftype, threads)
            log(f"wrote {out.name} ({out.stat().st_size:,} bytes) in {time.perf_counter() - t0:.0f} s")
        files[kind] = out
    return files


def describe_file(path: Path) -> str:
    """``N tensors: TYPE xN, ...``, and which matrices are in a type other than the file's main one."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    field = reader.get_field("general.file_type")
    ftype = int(field.parts[field.data[0]][0]) if field is not None else None
    kinds = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"{path.stat().st_size:,} bytes, file_type {ftype}, {len(reader.tensors)} tensors: {kinds}"


def tensor_types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def check_f16_bits(f16: Path) -> None:
    """The F16 file's tensors against the shipped float16 weights, bit for bit."""
    import numpy as np
    import torch
    from gguf import GGUFReader

    state = torch.load(META_DIR / "consolidated.00.pth", map_location="cpu", mmap=True, weights_only=True)
    names = {"token_embd": "tok_embeddings", "output_norm": "norm", "attn_q": "attention.wq",
             "attn_k": "attention.wk", "attn_v": "attention.wv", "attn_output": "attention.wo",
             "ffn_gate": "feed_forward.w1", "ffn_down": "feed_forward.w2", "ffn_up": "feed_forward.w3",
             "attn_norm": "attention_norm", "ffn_norm": "ffn_norm"}
    equal, differ, unmatched = 0, [], []
    for t in GGUFReader(f16).tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            meta = f"layers.{parts[1]}.{names.get(parts[2], parts[2])}.{parts[3]}"
        else:
            meta = f"{names.get(parts[0], parts[0])}.{parts[1]}"
        if meta not in state:
            unmatched.append(t.name)
            continue
        want = state[meta].numpy()
        got = np.asarray(t.data).reshape(want.shape)
        if got.dtype == np.float32:  # norms are written as F32: compare the float16 values they hold
            got = got.astype(np.float16)
        if np.array_equal(got.view(np.uint16), want.view(np.uint16)):
            equal += 1
        else:
            differ.append(t.name)
    print(f"- F16 file vs the shipped float16 weights: {equal} tensors bit-identical"
          + (f", DIFFERENT: {', '.join(differ)}" if differ else "")
          + (f", not in the checkpoint: {', '.join(unmatched)}" if unmatched else ""))


# -- held-out text -------------------------------------------------------------------------------


def heldout_text(cache: Path, n_docs: int) -> Path:
    """The training script's validation documents, one segment a line."""
    path = cache / f"heldout-{n_docs}.txt"
    if not path.is_file():
        from default_model import corpus

        lines = [segment.strip() for doc in corpus.documents(VAL_SEED, n_docs) for segment in doc]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def llama_cpp_ids(tools: dict[str, Path], gguf: Path, text_file: Path) -> list[int]:
    r = subprocess.run([str(tools["llama-tokenize"]), "-m", str(gguf), "-f", str(text_file), "--ids",
                        "--log-disable"], capture_output=True, text=True)
    if r.returncode:
        raise PeerError(f"llama-tokenize failed on {gguf.name}: {r.stderr.strip()[-400:]}")
    line = [s for s in r.stdout.splitlines() if s.startswith("[")][-1]
    return json.loads(line)


def first_difference(a: list, b: list) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at index {n} of {len(a)}/{len(b)} ({a[n:n + 3]} vs {b[n:n + 3]})"


def check_tokenizer(tools: dict[str, Path], files: dict[str, Path], text_file: Path) -> None:
    import sentencepiece as spm

    from llama_chat.model.loader import load_model

    text = text_file.read_text(encoding="utf-8")
    sp = spm.SentencePieceProcessor(model_file=str(META_DIR / "tokenizer.model"))
    reference = [sp.bos_id(), *sp.encode(text)]
    for kind, path in files.items():
        theirs = llama_cpp_ids(tools, path, text_file)
        ours = load_model(path, device="cpu").tokenizer.encode(text, bos=True)
        verdict = "equal" if ours == theirs else "DIFFERENT: " + first_difference(ours, theirs)
        spv = "equal" if ours == reference else "DIFFERENT: " + first_difference(ours, reference)
        print(f"- {kind}: llama-chat {len(ours):,} ids vs llama-tokenize: {verdict}; vs sentencepiece on "
              f"tokenizer.model: {spv}")


# -- one-shot runs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shot:
    text: str
    ids: list[int]
    finish: str
    prompt_tokens: int
    weights: str
    peak_rss: int
    error: str = ""


def one_shot(model: str, prompt: str, template: str, n: int, threads: int) -> Shot:
    cmd = [llama_chat_bin(), "-m", model, "-p", prompt, "-t", "0", "-n", str(n), "--template", template,
           "--json", "--stats", "--no-stdin"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    m = run_measured(cmd, env=env)
    if m.returncode:
        return Shot("", [], "", 0, "", m.peak_rss_bytes, error=f"exit {m.returncode}: {m.stderr.strip()[-300:]}")
    out = json.loads(m.stdout)
    weights = re.search(r"weights: (.*)$", m.stderr, re.M)
    return Shot(out["text"], out["token_ids"], out["finish_reason"], out["prompt_tokens"],
                weights.group(1).strip() if weights else "?", m.peak_rss_bytes)


def llama_cpp_generate(tools: dict[str, Path], gguf: Path, raw_prompt: str, n: int, threads: int) -> str:
    """llama.cpp's greedy continuation of ``raw_prompt`` (bos added, as the vocabulary asks)."""
    r = subprocess.run([str(tools["llama-completion"]), "-m", str(gguf), "-p", raw_prompt, "-n", str(n),
                        "--temp", "0", "-no-cnv", "--no-display-prompt", "-t", str(threads), "-c", str(PPL_CTX),
                        "--seed", "0", "--no-warmup", "--simple-io"],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode:
        raise PeerError(f"llama-completion failed on {gguf.name}: {r.stderr.strip()[-400:]}")
    return r.stdout.rstrip("\n").removesuffix(" [end of text]")


def divergence(text: str, ref: str) -> str:
    if text == ref:
        return "same text"
    n = next((i for i, (a, b) in enumerate(zip(text, ref)) if a != b), min(len(text), len(ref)))
    return f"differs from char {n} ({len(text)} vs {len(ref)} chars): ...{text[max(0, n - 20):n + 30]!r}"


def token_divergence(ids: list[int], ref: list[int]) -> str:
    if ids == ref:
        return f"{len(ids)} tokens equal"
    n = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
    return f"first {n} of {len(ref)} tokens equal"


_LOADED: dict = {}


def float32_model(path: Path):
    """``path`` loaded in float32 (a GGUF file's blocks expanded exactly), kept for the run."""
    from llama_chat.model.loader import load_model

    if path not in _LOADED:
        _LOADED[path] = load_model(path, device="cpu", dtype="float32")
    return _LOADED[path]


def parting(path: Path, prompt: str, template: str, ref: list[int], other: list[int]) -> str:
    """Where two greedy runs part, how ``path``'s weights in float32 rank the two tokens: a near
    tie shows as probabilities close to each other."""
    import torch

    from llama_chat.model.chat_format import Message

    n = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), None)
    if n is None:
        return ""
    loaded = float32_model(path)
    tok = loaded.tokenizer
    ids = (tok.encode(prompt, bos=True) if template == "none"
           else loaded.chat_format.encode_dialog([Message("user", prompt)]))
    with torch.inference_mode():
        probs = loaded.model.eval()(torch.tensor([ids + ref[:n]]))[0, -1].softmax(-1)
    a, b = ref[n], other[n]
    return (f"token {n}: {tok.decode([a])!r} p={float(probs[a]):.3f} vs {tok.decode([b])!r} "
            f"p={float(probs[b]):.3f}")


def raw_prompt(prompt: str, template: str) -> str:
    """The text the chat template makes of ``prompt`` without its bos (llama.cpp adds that)."""
    return f"[INST] {prompt.strip()} [/INST]" if template != "none" else prompt


def run_one_shots(tools, hf_dir: Path, files: dict[str, Path], n: int, threads: int) -> None:
    models = {"shipped (Meta, float32)": str(META_DIR), "exported HF folder": str(hf_dir),
              **{k: str(v) for k, v in files.items()}}
    for model in models.values():  # untimed: builds llama-chat's CPU kernels if their cache is cold
        one_shot(model, PROMPTS[0][0], PROMPTS[0][1], 1, threads)
    baseline = None
    for prompt, template in PROMPTS:
        print(f"\n`-p {prompt!r} --template {template}` (greedy, -n {n}):\n")
        print("| model | prompt ids | tokens, finish | vs shipped | weights (--stats) | peak RSS "
              "| llama.cpp on the file |")
        print("|---|---|---|---|---|---|---|")
        ref = None
        for name, model in models.items():
            shot = one_shot(model, prompt, template, n, threads)
            if shot.error:
                print(f"| {name} | | | ERROR {shot.error} | | | |")
                continue
            if ref is None:
                ref = shot
                baseline = baseline or shot.peak_rss
            peer = ""
            if name in files:
                # llama.cpp prints the reply's first piece as it is (" Once"); llama-chat leaves out
                # the space a chat reply starts with, so the two are compared without it.
                theirs = llama_cpp_generate(tools, files[name], raw_prompt(prompt, template), n, threads).lstrip(" ")
                mine = shot.text.lstrip(" ")
                if theirs == mine:
                    peer = "same text as llama-chat's"
                else:
                    tok = float32_model(files[name]).tokenizer
                    peer = (f"{divergence(theirs, mine)}; the file's weights in float32 at "
                            f"{parting(files[name], prompt, template, tok.encode(mine), tok.encode(theirs))}")
            versus = "reference" if shot is ref else (
                f"same text ({token_divergence(shot.ids, ref.ids)})" if shot.text == ref.text
                else f"{token_divergence(shot.ids, ref.ids)}; shipped float32 at "
                     f"{parting(META_DIR, prompt, template, ref.ids, shot.ids)}")
            print(f"| {name} | {shot.prompt_tokens} | {len(shot.ids)}, {shot.finish} | {versus} | {shot.weights} | "
                  f"{shot.peak_rss / 1e6:.0f} MB | {peer} |")
        if ref is not None:
            print(f"\nshipped model's text: {ref.text!r}")
    if baseline:
        print(f"\npeak RSS of the shipped model's run (the baseline): {baseline / 1e6:.0f} MB; the files are "
              + ", ".join(f"{k} {v.stat().st_size / 1e6:.1f} MB" for k, v in files.items()))


# -- perplexity ----------------------------------------------------------------------------------


def llama_cpp_perplexity(tools, gguf: Path, text_file: Path, chunks: int, threads: int) -> float:
    """llama-perplexity's figure after the last chunk. Its log is written by a thread of its own,
    and the last lines are sometimes lost at exit when it writes to a pipe: read the running
    figure of the last chunk, and run it again when that was lost."""
    for _ in range(3):
        r = subprocess.run([str(tools["llama-perplexity"]), "-m", str(gguf), "-f", str(text_file), "-c",
                            str(PPL_CTX), "--chunks", str(chunks), "-t", str(threads)], capture_output=True, text=True)
        if r.returncode:
            raise PeerError(f"llama-perplexity failed on {gguf.name}: {(r.stderr or r.stdout).strip()[-400:]}")
        running = dict(re.findall(r"\[(\d+)\]([0-9.]+),", r.stdout + r.stderr))
        if str(chunks) in running:
            return float(running[str(chunks)])
    raise PeerError(f"llama-perplexity on {gguf.name}: no figure for chunk {chunks} in three runs")


def llama_chat_perplexity(model_path: Path, text: str, chunks: int) -> float:
    """llama-perplexity's figure computed by llama-chat: the text's ids (bos first) cut into
    ``PPL_CTX`` chunks, each chunk's first id made bos, the second half of each chunk scored."""
    import math

    import torch
    import torch.nn.functional as F

    from llama_chat.ml.cpu import kernels as cpu_kernels
    from llama_chat.model.loader import load_model

    loaded = load_model(model_path, device="cpu")
    model = loaded.model.eval()
    cpu_kernels.prepare(model)  # as an engine prepares the model it is given
    model.fuse_projections()
    ids = loaded.tokenizer.encode(text, bos=True)
    chunks = min(chunks, len(ids) // PPL_CTX)
    first = PPL_CTX // 2
    nll, count = 0.0, 0
    with torch.inference_mode():
        for c in range(chunks):
            chunk = torch.tensor([ids[c * PPL_CTX:(c + 1) * PPL_CTX]])
            chunk[0, 0] = loaded.tokenizer.bos_id
            logits = model(chunk)[0, first:-1].float()
            nll += F.cross_entropy(logits, chunk[0, first + 1:], reduction="sum").item()
            count += PPL_CTX - first - 1
    return math.exp(nll / count)


def run_perplexity(tools, files: dict[str, Path], text_file: Path, chunks: int, threads: int) -> None:
    text = text_file.read_text(encoding="utf-8")
    ours_ref = llama_chat_perplexity(META_DIR, text, chunks)
    print(f"held-out text: {text_file.name}, {chunks} chunks of {PPL_CTX} tokens, the last {PPL_CTX // 2 - 1} "
          f"of each scored (llama-perplexity's rule).\n")
    print("| weights | llama.cpp PPL | llama-chat PPL | llama-chat / llama.cpp | rise over float32 (llama-chat) |")
    print("|---|---|---|---|---|")
    print(f"| shipped, float32 | | {ours_ref:.4f} | | |")
    for kind, path in files.items():
        theirs = llama_cpp_perplexity(tools, path, text_file, chunks, threads)
        ours = llama_chat_perplexity(path, text, chunks)
        print(f"| {kind} | {theirs:.4f} | {ours:.4f} | {ours / theirs:.4f} | {ours / ours_ref - 1:+.2%} |")


# -- the chat ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chat:
    banner: str
    replies: list[str]
    prompt_tokens: list[int]  # each turn's prompt, from /stats
    stats: str  # /stats after the last turn


def chat_session(model: str, threads: int) -> Chat:
    """Two turns in a pseudo-terminal with a system message, /stats after each; the replies as
    ``/save`` writes them."""
    import pexpect

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, XDG_STATE_HOME=tmp, OMP_NUM_THREADS=str(threads))
        child = pexpect.spawn(llama_chat_bin(), ["-m", model, "-t", "0", "--no-history", "-s", SYSTEM], env=env,
                              encoding="utf-8", timeout=WAIT_S, dimensions=(40, 160))
        child.expect_exact(">>> ")
        # the last line: a cold kernel cache draws a spinner before it
        banner = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", child.before).replace("\r", "\n").strip().splitlines()[-1]
        prompts, stats = [], ""
        for turn in CHAT_TURNS:
            child.sendline(turn)
            child.expect_exact(">>> ")
            child.sendline("/stats")
            child.expect_exact(">>> ")
            stats = " ".join(child.before.split("\n", 1)[-1].split())
            prompts.append(int(re.search(r"prompt: (\d+) tokens", stats).group(1)))
        saved = Path(tmp) / "chat.json"
        child.sendline(f"/save {saved}")
        child.expect_exact(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
        child.close()
        if child.exitstatus != 0:
            raise RuntimeError(f"the chat on {model} ended with status {child.exitstatus}")
        messages = json.loads(saved.read_text())["messages"]
    return Chat(banner, [m["content"] for m in messages if m["role"] == "assistant"], prompts, stats)


def llama_cpp_chat_turn(tools, gguf: Path, threads: int) -> tuple[int | None, str]:
    """llama.cpp's own chat, one turn, with the file's template (``-cnv -st --jinja``): the prompt's
    token count (None when its log line was lost at exit three times) and the reply (its output
    echoes the templated prompt first)."""
    for _ in range(3):
        r = subprocess.run([str(tools["llama-completion"]), "-m", str(gguf), "-cnv", "-st", "--jinja", "-sys", SYSTEM,
                            "-p", CHAT_TURNS[0], "--temp", "0", "-n", "400", "-t", str(threads), "-c", str(PPL_CTX),
                            "--simple-io", "--no-warmup"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if r.returncode or "[/INST]" not in r.stdout:
            raise PeerError(f"llama-completion -cnv failed on {gguf.name}: {r.stderr.strip()[-400:]}")
        reply = r.stdout.split("[/INST]", 1)[1].strip().removesuffix("[end of text]").strip()
        prompt = re.search(r"prompt eval time =.*?/\s*(\d+) tokens", r.stderr)
        if prompt:
            return int(prompt.group(1)), reply
    return None, reply


def run_chats(tools, hf_dir: Path, files: dict[str, Path], threads: int) -> None:
    models = {"shipped (Meta, float32)": str(META_DIR), "exported HF folder": str(hf_dir),
              **{k: str(v) for k, v in files.items()}}
    print(f"`llama-chat -m MODEL -t 0 -s {SYSTEM!r}`, then {' / '.join(repr(t) for t in CHAT_TURNS)} "
          f"(/stats after each), /save and Ctrl+D, in a pseudo-terminal. llama.cpp: `llama-completion -m FILE "
          f"-cnv -st --jinja -sys ... -p {CHAT_TURNS[0]!r} --temp 0`, its first turn with the file's template.\n")
    ref: Chat | None = None
    for name, model in models.items():
        chat = chat_session(model, threads)
        if ref is None:
            ref = chat
            verdict = "reference"
        else:
            verdict = "; ".join(f"turn {i + 1}: {divergence(r, s)}" for i, (r, s) in
                                enumerate(zip(chat.replies, ref.replies)))
        print(f"- **{name}**: {chat.banner!r}\n  - prompts of {' and '.join(map(str, chat.prompt_tokens))} tokens; "
              f"{verdict}\n  - /stats: {chat.stats}")
        if name in files:
            n, reply = llama_cpp_chat_turn(tools, files[name], threads)
            same = reply == chat.replies[0].strip()
            print(f"  - llama.cpp's first turn: a prompt of {n if n is not None else '?'} tokens, "
                  + ("the same reply" if same else divergence(reply, chat.replies[0].strip())))
    for i, reply in enumerate(ref.replies if ref else []):
        print(f"\nshipped model's reply {i + 1}: {reply!r}")


# -- --list --------------------------------------------------------------------------------------


def run_list(hf_dir: Path, files: dict[str, Path]) -> None:
    """``llama-chat --list`` over a Hugging Face cache holding the folder and a GGUF repository
    with the four files (blobs and snapshot links, as the hub writes them)."""
    import hashlib

    with tempfile.TemporaryDirectory() as cache:
        repos = {"llama-chat/default-model": [*hf_dir.iterdir()],
                 "llama-chat/default-model-GGUF": list(files.values())}
        for repo, paths in repos.items():
            repo_dir = Path(cache) / f"models--{repo.replace('/', '--')}"
            commit = hashlib.sha1(repo.encode()).hexdigest()
            (repo_dir / "blobs").mkdir(parents=True)
            (repo_dir / "refs").mkdir()
            (repo_dir / "refs" / "main").write_text(commit)
            snap = repo_dir / "snapshots" / commit
            snap.mkdir(parents=True)
            for p in paths:
                blob = repo_dir / "blobs" / hashlib.sha256(str(p).encode()).hexdigest()
                try:
                    os.link(p, blob)
                except OSError:  # another file system
                    shutil.copyfile(p, blob)
                (snap / p.name).symlink_to(os.path.relpath(blob, snap))
        env = dict(os.environ, HF_HUB_CACHE=cache)
        r = subprocess.run([llama_chat_bin(), "--list"], capture_output=True, text=True, env=env)
        print("```\n$ llama-chat --list\n" + (r.stdout + r.stderr).rstrip().replace(cache, "$HF_HUB_CACHE"))
        # What a user who downloaded the repository types first.
        repo = "llama-chat/default-model-GGUF"
        r = subprocess.run([llama_chat_bin(), "-m", repo, "-p", "Hi", "-n", "1", "--no-stdin"], capture_output=True,
                           text=True, env=env)
        print(f"$ llama-chat -m {repo} -p Hi -n 1   # exit {r.returncode}\n"
              + (r.stdout + r.stderr).rstrip().replace(cache, "$HF_HUB_CACHE") + "\n```")


# -- main ----------------------------------------------------------------------------------------


PARTS = ("tokenizer", "oneshot", "perplexity", "chat", "list")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "llama-chat-bench")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=2, help="build jobs for llama.cpp")
    ap.add_argument("-n", "--max-tokens", type=int, default=200, help="tokens per one-shot run")
    ap.add_argument("--chunks", type=int, default=16, help="perplexity chunks of 512 tokens")
    ap.add_argument("--docs", type=int, default=300, help="validation documents in the held-out text")
    ap.add_argument("--skip", default="", help=f"comma-separated parts to leave out: {','.join(PARTS)}")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    if skip - set(PARTS):
        ap.error(f"--skip: unknown part {sorted(skip - set(PARTS))[0]!r} (expected some of {', '.join(PARTS)})")
    try:
        report(a, skip)
    except PeerError as e:
        print(f"real_gguf: {e}", file=sys.stderr)
        return 1
    return 0


def report(a: argparse.Namespace, skip: set[str]) -> None:
    a.cache.mkdir(parents=True, exist_ok=True)
    peer = peer_mod.ensure_llama_cpp(a.cache, jobs=a.jobs, log=log)
    tools = ensure_tools(peer, a.jobs)
    folder = a.cache / "models" / "default-model"
    hf_dir = export_hf(META_DIR, folder / "default-model")  # the converter names the file after it
    files = make_files(peer, hf_dir, folder, a.threads)
    text_file = heldout_text(a.cache, a.docs)

    print(f"# The shipped model through llama.cpp's tools\n\nllama.cpp {peer.commit} (llama-cpp-python "
          f"{peer.version}); files in {folder}")
    section("Export and files")
    check_export(hf_dir)
    check_f16_bits(files["F16"])
    for kind, path in files.items():
        print(f"- {path.name}: {describe_file(path)}")
    f16 = tensor_types(files["F16"])
    q4km = tensor_types(files["Q4_K_M"])
    other = [f"{name} {kind}" for name, kind in q4km.items() if f16.get(name) != "F32" and kind not in ("Q4_K", "Q6_K")]
    print(f"- Q4_K_M tensors in neither Q4_K nor Q6_K: {', '.join(other) or 'none'}")
    if "tokenizer" not in skip:
        section("Tokenizer")
        check_tokenizer(tools, files, text_file)
    if "oneshot" not in skip:
        section("One-shot, greedy")
        run_one_shots(tools, hf_dir, files, a.max_tokens, a.threads)
    if "perplexity" not in skip:
        section("Perplexity")
        run_perplexity(tools, files, text_file, a.chunks, a.threads)
    if "chat" not in skip:
        section("Chat")
        run_chats(tools, hf_dir, files, a.threads)
    if "list" not in skip:
        section("--list")
        run_list(hf_dir, files)


if __name__ == "__main__":
    sys.exit(main())

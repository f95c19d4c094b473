"""How faithful llama-chat and llama.cpp are to a GGUF file: each one's next-token distributions
against the same file read by ``transformers`` as float32.

For each file:

1. The text's ids (llama-chat's tokenizer of the file), cut into ``--ctx``-token chunks, each
   chunk's first id made bos where the file adds one: llama.cpp's ``llama-perplexity`` chunks.
2. The reference: ``transformers`` loads the file (``from_pretrained(gguf_file=...)``: every
   tensor dequantized to float32) and gives each chunk's logits. They are written as
   ``llama-perplexity``'s base file of log-probabilities (its own format: the ids, then per chunk
   the log-probabilities of the second half's positions, 16-bit codes over the top 16 nats).
3. llama.cpp: ``llama-perplexity --kl-divergence-base BASE --kl-divergence`` reads that file and
   reports its mean KL divergence from it and how often its top token is the reference's.
4. llama-chat, as the command generates: the file loaded as the command loads it (packed blocks
   on the CPU, fused projections, the CPU operator where it takes the family), the first half of
   each chunk as a prompt in one pass, then one token per step; the same statistics over the
   same positions, against the same reference.

    python benchmarks/bench_fidelity.py FILE.gguf [FILE.gguf ...] --ctx 128 --chunks 4
    python benchmarks/bench_fidelity.py --families --chunks 4   # random models of each family's
                                                                # shape, converted and quantized by
                                                                # llama.cpp's own tools

``--families`` makes, for each family, a random ``transformers`` model of the family's layout
(small: see ``FAMILY_SHAPES``), converts it with llama.cpp's ``convert_hf_to_gguf.py`` and
quantizes it with ``llama-quantize`` to Q8_0 and Q4_K_M. llama.cpp is built once into the cache
(``llama_cpp_peer.py``). transformers reads GGUF files through ``accelerate`` (``pip install
accelerate``), which the project does not otherwise need. Nothing is written into the repository.
"""

from __future__ import annotations

import argparse
import math
import re
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import llama_cpp_peer as peer_mod
from llama_cpp_peer import PeerError

REPO = Path(__file__).resolve().parent.parent
# The layouts of the families' small members, shrunk in depth so that a run takes minutes: what
# is measured is each family's switches, not its size.
FAMILY_SHAPES = {
    "qwen2": dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                  num_hidden_layers=4, tie_word_embeddings=True, rope_theta=1e6),
    "qwen3": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, num_hidden_layers=4, tie_word_embeddings=True, rope_theta=1e6),
    "gemma2": dict(hidden_size=1152, intermediate_size=4608, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, query_pre_attn_scalar=256, num_hidden_layers=4, sliding_window=64),
    "gemma3": dict(hidden_size=640, intermediate_size=2048, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=256, query_pre_attn_scalar=256, num_hidden_layers=6, sliding_window=64),
    "phi3": dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=16,
                 num_hidden_layers=4),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Agreement:
    """Mean KL divergence from the reference and the share of positions whose top token is the
    reference's, over ``count`` positions."""

    kld: float
    same_top: float
    count: int


# -- the text and its chunks ---------------------------------------------------------------------


def text_of_docs() -> str:
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("*.md")))


def chunks_of(ids: list[int], ctx: int, n: int, bos: int | None) -> list[list[int]]:
    out = []
    for c in range(min(n, len(ids) // ctx)):
        chunk = ids[c * ctx:(c + 1) * ctx]
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


# -- the reference and llama.cpp's base file -----------------------------------------------------


def reference_log_probs(path: Path, chunks: list[list[int]]) -> list[torch.Tensor]:
    """Each chunk's log-probabilities (positions, vocab) from transformers reading the file."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for chunk in chunks:
            out.append(torch.log_softmax(model(torch.tensor([chunk])).logits[0].float(), dim=-1))
    return out


def write_base_file(out: Path, chunks: list[list[int]], log_probs: list[torch.Tensor], vocab: int) -> None:
    """``llama-perplexity --kl-divergence-base``'s file: magic, context, vocabulary, chunks, the
    ids, then per chunk the scored positions' log-probabilities as it codes them (the scale and
    the least log-probability as two floats, then a 16-bit code per token over the top 16 nats)."""
    ctx = len(chunks[0])
    first = ctx // 2
    nv = 2 * ((vocab + 1) // 2) + 4
    with open(out, "wb") as f:
        f.write(b"_logits_")
        f.write(struct.pack("<Iii", ctx, vocab, len(chunks)))
        f.write(np.asarray(chunks, dtype=np.int32).tobytes())
        for lp in log_probs:
            rows = lp[first:ctx - 1, :vocab].double().numpy()
            for row in rows:
                top = row.max()
                least = max(row.min(), top - 16)
                scale = (top - least) / 65535.0
                codes = np.zeros(nv - 4, dtype=np.uint16)
                if scale:
                    codes[:vocab] = np.where(row > least, np.rint((row - least) / scale), 0).astype(np.uint16)
                f.write(struct.pack("<ff", scale, least))
                f.write(codes.tobytes())


def llama_cpp_agreement(tool: Path, path: Path, base: Path, ctx: int, threads: int) -> Agreement:
    r = subprocess.run([str(tool), "-m", str(path), "--kl-divergence-base", str(base), "--kl-divergence",
                        "-c", str(ctx), "-b", str(ctx), "-t", str(threads)], capture_output=True, text=True)
    text = r.stdout + r.stderr
    kld = re.search(r"Mean\s+KLD:\s+(-?[0-9.]+)", text)
    same = re.search(r"Same top p:\s+([0-9.]+)", text)
    if r.returncode or not kld or not same:
        raise PeerError(f"llama-perplexity --kl-divergence on {path.name}: {text.strip()[-600:]}")
    count = len(re.findall(r"^\s*\d+\s+\S", text, flags=re.M))
    return Agreement(float(kld.group(1)), float(same.group(1)) / 100, count)


# -- llama-chat --------------------------------------------------------------------------------------


def llama_chat_agreement(path: Path, chunks: list[list[int]], reference: list[torch.Tensor]) -> Agreement:
    """As the command generates: the prompt half in one pass, then a token per step."""
    from llama_chat.ml.cpu import kernels as cpu_kernels
    from llama_chat.model.kv_cache import KVCache
    from llama_chat.model.loader import load_model

    loaded = load_model(path, device="cpu")
    model = loaded.model.eval()
    cpu_kernels.prepare(model)  # as an engine prepares the model it is given
    model.fuse_projections()
    kld, same, count = 0.0, 0, 0
    with torch.inference_mode():
        for chunk, ref in zip(chunks, reference):
            ctx = len(chunk)
            first = ctx // 2
            cache = KVCache.for_model(loaded.args, 1, max_seq_len=ctx)
            ids = torch.tensor([chunk])
            rows = [model(ids[:, :first + 1], torch.arange(first + 1).unsqueeze(0), cache, last_only=True)[0, -1]]
            for pos in range(first + 1, ctx - 1):
                rows.append(model(ids[:, pos:pos + 1], torch.tensor([[pos]]), cache)[0, -1])
            ours = torch.log_softmax(torch.stack(rows).float(), dim=-1)
            base = ref[first:ctx - 1, :ours.shape[-1]]
            p = base.exp()
            kld += float((p * (base - ours)).sum(-1).sum())
            same += int((ours.argmax(-1) == base.argmax(-1)).sum())
            count += ours.shape[0]
    return Agreement(kld / count, same / count, count)


# -- the families' files -----------------------------------------------------------------------------


def family_files(peer, cache: Path, threads: int) -> list[Path]:
    """Each family's random model, converted and quantized by llama.cpp's tools (cached)."""
    import transformers

    sys.path.insert(0, str(REPO / "tests"))
    from builders_families import SPECS

    files = []
    for family, shape in FAMILY_SHAPES.items():
        folder = cache / "families" / family
        f16, outs = folder / f"{family}-F16.gguf", [folder / f"{family}-{t}.gguf" for t in ("Q8_0", "Q4_K_M")]
        if not all(p.is_file() for p in outs):
            config_class, model_class, _ = SPECS[family]
            hf_dir = folder / "hf"
            if not (hf_dir / "config.json").is_file():
                tokenizer = REPO / "model" / "default_model"
                fields = dict(vocab_size=32000, rms_norm_eps=1e-6, max_position_embeddings=4096,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape)
                config = config_class(**fields)
                torch.manual_seed(0)
                model = model_class(config).eval()
                with torch.no_grad():  # weights scaled by their inputs, so activations stay near one
                    for name, p in model.named_parameters():
                        if p.dim() == 2:
                            p.normal_(0, 1 / p.shape[-1] ** 0.5)
                model.save_pretrained(hf_dir)
                write_llama_tokenizer(hf_dir, tokenizer, 32000)
            peer_mod.convert(peer, hf_dir, f16, "f16")
            for out, kind in zip(outs, ("Q8_0", "Q4_K_M")):
                peer_mod.quantize(peer, f16, out, kind, threads)
        files += outs
    return files


def write_llama_tokenizer(hf_dir: Path, default_model: Path, vocab: int) -> None:
    """A SentencePiece vocabulary of ``vocab`` pieces for the converter: the shipped model's 1024
    pieces, padded with user pieces the text never reaches."""
    import sentencepiece.sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString((default_model / "tokenizer.model").read_bytes())
    for i in range(len(proto.pieces), vocab):
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = f"<unused{i}>", 0.0, pb.ModelProto.SentencePiece.USER_DEFINED
    (hf_dir / "tokenizer.model").write_bytes(proto.SerializeToString())


# -- the run -------------------------------------------------------------------------------------------


def measure(path: Path, tool: Path, args, work: Path) -> tuple[Agreement, Agreement]:
    from llama_chat.model.loader import load_model
    from llama_chat.model.tokenizers.base import encode_prompt

    tokenizer = load_model(path, device="cpu").tokenizer
    bos = tokenizer.bos_id if getattr(tokenizer, "add_bos", True) else None
    chunks = chunks_of(encode_prompt(tokenizer, text_of_docs()), args.ctx, args.chunks, bos)
    log(f"{path.name}: {len(chunks)} chunks of {args.ctx} ids; the reference (transformers, float32)")
    reference = reference_log_probs(path, chunks)
    vocab = reference[0].shape[-1]
    base = work / f"{path.stem}.kld"
    write_base_file(base, chunks, reference, vocab)
    log(f"{path.name}: llama.cpp")
    theirs = llama_cpp_agreement(tool, path, base, args.ctx, args.threads)
    log(f"{path.name}: llama-chat")
    ours = llama_chat_agreement(path, chunks, reference)
    return ours, theirs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--families", action="store_true", help="random models of each family, made by llama.cpp's tools")
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "llama-chat-bench")
    args = p.parse_args(argv)
    peer = peer_mod.ensure_llama_cpp(args.cache, log=log)
    tool = peer.bench.parent / "llama-perplexity"
    files = list(args.files) + (family_files(peer, args.cache, args.threads) if args.families else [])
    print("| file | positions | mean KLD llama-chat | mean KLD llama.cpp | ratio | same top llama-chat "
          "| same top llama.cpp |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for path in files:
            ours, theirs = measure(path, tool, args, Path(tmp))
            ratio = ours.kld / theirs.kld if theirs.kld > 0 else math.inf
            print(f"| {path.name} | {ours.count} | {ours.kld:.6f} | {theirs.kld:.6f} | {ratio:.2f}x | "
                  f"{ours.same_top:.1%} | {theirs.same_top:.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tiny random BERT models and WordPiece vocabularies, saved as a Hugging Face ``BertModel``
folder and as a sentence-transformers folder (modules.json, pooling, normalization, length);
tiny Qwen3 embedders and rerankers; the references they are checked against; and ``embed_cli``,
the embed and rerank commands run in this process."""

from __future__ import annotations

import io
import json
import string
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "quick", "brown", "fox", "jump", "over", "lazy", "dog", "cafe", "café", "naive", "hello",
         "world", "##s", "##ed", "##ing", "##ly", "un", "##able", "東", "京", "中", "文", "é", "ü", "ß"]


def vocab_tokens() -> list[str]:
    """Specials, whole words, every ASCII letter, digit and punctuation mark, and each letter and
    digit as a piece inside a word (so that any ASCII word has pieces)."""
    chars = list(string.ascii_letters + string.digits + string.punctuation)
    pieces = ["##" + c for c in string.ascii_letters + string.digits]
    return list(dict.fromkeys(SPECIALS + WORDS + chars + pieces))


def write_vocab(path: Path) -> Path:
    path.write_text("\n".join(vocab_tokens()) + "\n", encoding="utf-8")
    return path


def hf_tokenizer(folder: Path, *, lowercase: bool = True, strip_accents: bool | None = None):
    """transformers' ``BertTokenizerFast`` over our vocabulary (the ids every test compares with)."""
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    write_vocab(folder / "vocab.txt")
    vocab = {token: i for i, token in enumerate(vocab_tokens())}
    return BertTokenizerFast(vocab=vocab, do_lower_case=lowercase, strip_accents=strip_accents)


def bert_model(*, seed: int = 0, positions: int = 64, hidden_act: str = "gelu"):
    """A random tiny ``BertModel`` (float32, eval mode) over ``vocab_tokens``."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(vocab_tokens()), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=positions, type_vocab_size=2,
                        hidden_act=hidden_act, layer_norm_eps=1e-12)
    model = BertModel(config).eval()
    with torch.no_grad():  # norms away from their start, so that a misplaced one shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    return model


def save_bert(folder: Path, *, seed: int = 0, pooling: str | None = "mean", normalize: bool = True,
              max_seq_length: int | None = 24, lowercase: bool = True):
    """A ``BertModel`` folder; with ``pooling``, a sentence-transformers one around it.
    Returns (model, tokenizer)."""
    model = bert_model(seed=seed)
    tokenizer = hf_tokenizer(folder, lowercase=lowercase)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling").mkdir()
        flags = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "lasttoken": "pooling_mode_lasttoken"}
        config = {"word_embedding_dimension": 32, **{flag: mode == pooling for mode, flag in flags.items()}}
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
        bert_config = {"do_lower_case": False}
        if max_seq_length is not None:
            bert_config["max_seq_length"] = max_seq_length
        (folder / "sentence_bert_config.json").write_text(json.dumps(bert_config))
    return model, tokenizer


def reference_embeddings(model, tokenizer, texts: list[str], *, pooling: str, normalize: bool,
                         max_length: int) -> torch.Tensor:
    """What sentence-transformers computes, spelled with transformers: the texts tokenized with
    padding and truncation at ``max_length``, the model's last states pooled over the attention
    mask (mean, CLS or last token), then normalized where asked."""
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    if pooling == "mean":
        pooled = (hidden * mask).sum(1) / mask.sum(1)
    elif pooling == "cls":
        pooled = hidden[:, 0]
    else:
        pooled = hidden[torch.arange(len(texts)), batch["attention_mask"].sum(1) - 1]
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


def save_cross_encoder(folder: Path, *, seed: int = 0, max_length: int = 32):
    """A random ``BertForSequenceClassification`` of one label (a cross-encoder reranker) with
    its tokenizer, whose ``model_max_length`` is ``max_length``. Returns (model, tokenizer)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(vocab_tokens()), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, type_vocab_size=2, num_labels=1)
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():  # the types' table and the head away from their start too
        model.bert.embeddings.token_type_embeddings.weight.normal_(0.0, 0.5)
        model.classifier.weight.normal_(0.0, 1.0)
    tokenizer = hf_tokenizer(folder)
    tokenizer.model_max_length = max_length
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def reference_scores(model, tokenizer, query: str, documents: list[str], *, max_length: int) -> torch.Tensor:
    """sentence-transformers' ``CrossEncoder.predict`` spelled with transformers: the pairs cut
    longest-first at ``max_length``, one logit each, through a sigmoid."""
    batch = tokenizer([query] * len(documents), documents, padding=True, truncation=True, max_length=max_length,
                      return_tensors="pt")
    with torch.no_grad():
        return torch.sigmoid(model(**batch).logits[:, 0])


def write_bert_gguf(path: Path, model, *, qtype=None, pooling_type: int = 1, leave_out: tuple[str, ...] = ()) -> Path:
    """``model`` (a ``BertModel`` or a one-label ``BertForSequenceClassification``) as llama.cpp's
    converter writes a ``bert`` file: its names, its phantom-space vocabulary (``▁`` before a whole
    word, ``##`` taken off a piece inside one), ``[CLS]`` as bos and ``[SEP]`` as the separator;
    matrices in ``qtype`` (F32 by default), vectors in F32; the GGUF tensors in ``leave_out`` left out."""
    import gguf
    import numpy as np

    from builders_gguf import T, encode_tensor

    qtype = T.F32 if qtype is None else qtype
    c = model.config
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_head_count(c.num_attention_heads)
    writer.add_layer_norm_eps(c.layer_norm_eps)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(4 if hasattr(model, "classifier") else pooling_type))
    writer.add_file_type({T.F32: 0, T.F16: 1}.get(qtype, 7))
    _write_wordpiece_vocab(writer, c.type_vocab_size)
    top = {"embeddings.word_embeddings.weight": "token_embd.weight",
           "embeddings.position_embeddings.weight": "position_embd.weight",
           "embeddings.token_type_embeddings.weight": "token_types.weight",
           "embeddings.LayerNorm.weight": "token_embd_norm.weight", "embeddings.LayerNorm.bias": "token_embd_norm.bias",
           "pooler.dense.weight": "cls.weight", "pooler.dense.bias": "cls.bias",
           "classifier.weight": "cls.output.weight", "classifier.bias": "cls.output.bias"}
    layer = {"attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
             "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
             "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
    classifier = hasattr(model, "classifier")
    for hf_name, tensor in model.state_dict().items():
        short = hf_name.removeprefix("bert.")
        if short == "embeddings.position_ids" or (short.startswith("pooler.") and not classifier):
            continue
        if short in top:
            name = top[short]
        else:
            parts = short.split(".")  # encoder.layer.N.<module>.<weight|bias>
            name = f"blk.{parts[2]}.{layer['.'.join(parts[3:-1])]}.{parts[-1]}"
        if name in leave_out:
            continue
        x = tensor.detach().float().numpy()
        if x.ndim == 1 or name in ("position_embd.weight", "token_types.weight"):
            writer.add_tensor(name, x.astype(np.float32))
        else:
            writer.add_tensor(name, encode_tensor(x, qtype), raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Qwen3-Embedding's prompts, as its config_sentence_transformers.json names them.
QWEN3_EMBEDDING_PROMPTS = {"query": "Instruct: Given a web search query, retrieve relevant passages that answer "
                                    "the query\nQuery:", "document": ""}


def _write_wordpiece_vocab(writer, type_count: int) -> None:
    """``vocab_tokens`` as llama.cpp's converter writes a WordPiece vocabulary: ``▁`` before a whole
    word, ``##`` taken off a piece inside one, ``[CLS]`` as bos and ``[SEP]`` as the separator."""
    import gguf

    tokens = vocab_tokens()
    phantom = [t if t.startswith("[") and t.endswith("]") else t[2:] if t.startswith("##") else "\u2581" + t
               for t in tokens]
    writer.add_tokenizer_model("bert")
    writer.add_token_list(phantom)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_type_count(type_count)
    for role, token in (("bos", "[CLS]"), ("sep", "[SEP]"), ("unk", "[UNK]"), ("pad", "[PAD]"), ("mask", "[MASK]")):
        getattr(writer, f"add_{role}_token_id")(tokens.index(token))
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)


@dataclass(frozen=True)
class NomicBert:
    """A tiny random nomic-bert's sizes and weights, named as llama.cpp's converter names them
    (its q and k rows in the halves order that llama.cpp rotates as NEOX)."""

    dim: int
    heads: int
    eps: float
    theta: float
    weights: dict[str, torch.Tensor]


def nomic_bert(*, seed: int = 0, dim: int = 32, heads: int = 4, layers: int = 2, hidden: int = 48,
               theta: float = 1000.0) -> NomicBert:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, mean: float = 0.0, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std + mean

    w = {"token_embd.weight": rand(len(vocab_tokens()), dim, std=0.5), "token_types.weight": rand(2, dim, std=0.5),
         "token_embd_norm.weight": rand(dim, mean=1.0), "token_embd_norm.bias": rand(dim)}
    for i in range(layers):
        w |= {f"blk.{i}.attn_qkv.weight": rand(3 * dim, dim), f"blk.{i}.attn_output.weight": rand(dim, dim),
              f"blk.{i}.attn_output_norm.weight": rand(dim, mean=1.0), f"blk.{i}.attn_output_norm.bias": rand(dim),
              f"blk.{i}.ffn_up.weight": rand(hidden, dim), f"blk.{i}.ffn_gate.weight": rand(hidden, dim),
              f"blk.{i}.ffn_down.weight": rand(dim, hidden),
              f"blk.{i}.layer_output_norm.weight": rand(dim, mean=1.0), f"blk.{i}.layer_output_norm.bias": rand(dim)}
    return NomicBert(dim, heads, 1e-12, theta, w)


def write_nomic_bert_gguf(path: Path, model: NomicBert, *, context: int = 64, pooling_type: int = 1,
                          qtype=None, leave_out: tuple[str, ...] = ()) -> Path:
    """``model`` as llama.cpp's converter writes a ``nomic-bert`` file (nomic-embed-text): matrices
    in ``qtype`` (F32 by default), the embeddings' tables and the norms in F32."""
    import gguf
    import numpy as np

    from builders_gguf import T, encode_tensor

    qtype = T.F32 if qtype is None else qtype

    w = model.weights
    writer = gguf.GGUFWriter(str(path), "nomic-bert")
    writer.add_context_length(context)
    writer.add_embedding_length(model.dim)
    writer.add_feed_forward_length(w["blk.0.ffn_up.weight"].shape[0])
    writer.add_block_count(sum(name.endswith(".attn_qkv.weight") for name in w))
    writer.add_head_count(model.heads)
    writer.add_layer_norm_eps(model.eps)
    writer.add_causal_attention(False)
    writer.add_rope_freq_base(model.theta)
    writer.add_pooling_type(gguf.PoolingType(pooling_type))
    writer.add_file_type({T.F32: 0, T.F16: 1}.get(qtype, 7))
    _write_wordpiece_vocab(writer, w["token_types.weight"].shape[0])
    for name, tensor in w.items():
        x = tensor.numpy().astype(np.float32)
        if name in leave_out:
            continue
        if x.ndim == 1 or not name.startswith("blk."):
            writer.add_tensor(name, x)
        else:
            writer.add_tensor(name, encode_tensor(x, qtype), raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def nomic_bert_hidden(model: NomicBert, ids: list[int]) -> torch.Tensor:
    """One text's last hidden states ``(len(ids), dim)``, spelled out from llama.cpp's graph for
    nomic-bert (``src/models/bert.cpp``): token embedding plus type 0, a LayerNorm; per layer the
    fused q/k/v, NEOX rotary (the halves of each head), attention over every token, the output
    added to the layer's input and normed, then ``down(silu(gate x) * up x)`` added and normed."""
    F = torch.nn.functional
    w, dim, heads = model.weights, model.dim, model.heads
    head_dim, n = dim // heads, len(ids)

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (dim,), w[f"{name}.weight"], w[f"{name}.bias"], model.eps)

    x = norm(w["token_embd.weight"][ids] + w["token_types.weight"][0], "token_embd_norm")
    freqs = model.theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * freqs[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()

    def rotate(t: torch.Tensor) -> torch.Tensor:  # (n, heads, head_dim), NEOX: pairs (i, i + head_dim / 2)
        first, second = t[..., :head_dim // 2], t[..., head_dim // 2:]
        return t * cos[:, None] + torch.cat([-second, first], -1) * sin[:, None]

    layer = 0
    while f"blk.{layer}.attn_qkv.weight" in w:
        b = f"blk.{layer}"
        q, k, v = (x @ w[f"{b}.attn_qkv.weight"].T).view(n, 3, heads, head_dim).unbind(1)
        q, k = rotate(q), rotate(k)
        scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim ** 0.5
        attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, dim)
        x = norm(attended @ w[f"{b}.attn_output.weight"].T + x, f"{b}.attn_output_norm")
        ffn = (F.silu(x @ w[f"{b}.ffn_gate.weight"].T) * (x @ w[f"{b}.ffn_up.weight"].T)) @ w[f"{b}.ffn_down.weight"].T
        x = norm(ffn + x, f"{b}.layer_output_norm")
        layer += 1
    return x


def save_qwen3_embedder(folder: Path, *, seed: int = 0, max_seq_length: int = 32):
    """A random tiny ``Qwen3Model`` in a sentence-transformers folder pooled at the last token and
    normalized, with its query prompt, as Qwen3-Embedding is; its byte-level tokenizer appends
    ``</s>`` to every text, as Qwen3-Embedding's appends its end of text. Returns (model,
    transformers' tokenizer)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

    from tokenizer_builders import write_bytelevel_tokenizer_json

    path = write_bytelevel_tokenizer_json(folder, vocab_size=400)
    raw = Tokenizer.from_file(str(path))
    eos = raw.token_to_id("</s>")
    raw.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", eos)])
    raw.save(str(path))
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=raw.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         tie_word_embeddings=False)
    model = Qwen3Model(config).eval()
    model.save_pretrained(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                  "pooling_mode": "lasttoken"}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": QWEN3_EMBEDDING_PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"}))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="</s>", pad_token="</s>")
    return model, tokenizer


def save_qwen3_reranker(folder: Path, *, seed: int = 0, positions: int = 128):
    """A random tiny ``Qwen3ForCausalLM`` folder that is a Qwen3-Reranker as llama.cpp's converter
    finds one (its README's title); its byte-level tokenizer has "yes" and "no" as tokens, the chat
    markers as special tokens and no markers around a text, as Qwen3's. Returns (model, tokenizer)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from tokenizer_builders import CORPUS, write_bytelevel_tokenizer_json

    path = write_bytelevel_tokenizer_json(folder, vocab_size=420, lines=CORPUS + ["yes", "no"] * 40)
    raw = Tokenizer.from_file(str(path))
    raw.post_processor = processors.ByteLevel(trim_offsets=False)
    raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    raw.add_tokens(["<think>", "</think>"])
    raw.save(str(path))
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=raw.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=positions,
                         tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # "yes" and "no" apart, so that the scores spread
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(folder)
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# Qwen3-Reranker-tiny\n\nA test model.\n")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="</s>", pad_token="</s>",
                                        padding_side="left")
    return model, tokenizer


def reference_decoder_scores(model, tokenizer, query: str, documents: list[str], *, max_length: int,
                             instruction: str | None = None) -> torch.Tensor:
    """Qwen3-Reranker's model card, line for line: the prompt around each pair, the middle cut to
    fit, left padding, and the softmax of the "yes" and "no" logits at the last position."""
    from llama_chat.model.pooling import QWEN3_RERANK_PROMPT as P

    instruction = instruction or P.instruction
    prefix = tokenizer.encode(P.prefix, add_special_tokens=False)
    suffix = tokenizer.encode(P.suffix, add_special_tokens=False)
    pairs = [P.body.format(instruction=instruction, query=query, document=d) for d in documents]
    inputs = tokenizer(pairs, padding=False, truncation="longest_first", return_attention_mask=False,
                       max_length=max_length - len(prefix) - len(suffix))
    inputs["input_ids"] = [prefix + ids + suffix for ids in inputs["input_ids"]]
    inputs = tokenizer.pad(inputs, padding=True, return_tensors="pt", max_length=max_length)
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    with torch.no_grad():
        logits = model(**inputs).logits[:, -1, :]
    pair = torch.nn.functional.log_softmax(torch.stack([logits[:, no], logits[:, yes]], dim=1), dim=1)
    return pair[:, 1].exp()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def embed_cli(monkeypatch, capsys, *args: str, stdin: str = "", terminal: bool = False) -> tuple[int, str, str]:
    """``llama-chat embed|rerank ARGS`` in this process, as ``cmd/main.py`` runs it (a parser's
    usage error as one line), stdin given: (status, stdout, stderr). ``terminal``: stderr is one."""
    from llama_chat.cmd.embed_command import embed_app, rerank_app
    from llama_chat.cmd.main import ClickException, usage_error
    from llama_chat.cmd.typer_command import parse

    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    err = _Terminal() if terminal else None
    if err is not None:
        monkeypatch.setattr(sys, "stderr", err)
    app = embed_app if args[0] == "embed" else rerank_app
    try:
        status = parse(app, list(args[1:]), f"llama-chat {args[0]}")()
    except ClickException as e:
        status = usage_error(e, f"llama-chat {args[0]}")
    out, captured = capsys.readouterr()
    return status, out, err.getvalue() if err is not None else captured


def thread_niceness(pid: int) -> list[int]:
    """Each thread's nice value (field 19 of /proc/PID/task/TID/stat, counted after the name)."""
    return [int(stat.read_text().rpartition(")")[2].split()[16]) for stat in Path(f"/proc/{pid}/task").glob("*/stat")]

"""A sentence-transformers folder: the pooling, normalization and length limit that turn an
encoder's hidden states into its embeddings.

``modules.json`` lists the modules in order: the ``Transformer`` (the Hugging Face model in the
folder itself), then ``Pooling`` (its ``config.json`` names the mode: the ``pooling_mode_*`` flags
of sentence-transformers 2-5, or ``pooling_mode`` of 6), then ``Normalize``. A ``Dense`` or any
other module is refused in one line. ``sentence_bert_config.json`` gives ``max_seq_length`` and
``do_lower_case``. A Hugging Face ``BertModel`` folder without ``modules.json`` is pooled as
sentence-transformers pools it: the mean of its tokens, not normalized.
``config_sentence_transformers.json`` names the texts put before inputs (``prompts``, and
``default_prompt_name``): Qwen3-Embedding's query instruction.

A Qwen3 causal model whose README is Qwen3-Reranker's is a decoder reranker, found as llama.cpp's
converter finds it (the folder's config says nothing else of it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llama_chat.model.args import ModelArgs, integer
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.formats.json_files import read_json
from llama_chat.model.pooling import QWEN3_RERANK_PROMPT, Pooling, Ranking

# sentence-transformers' names for the pooling modes, ours beside them.
_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "lasttoken",
          "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
          "pooling_mode_weightedmean_tokens": "weightedmean"}


def is_sentence_transformers(model_dir: Path) -> bool:
    return (model_dir / "modules.json").is_file()


def read_pooling(model_dir: Path, args: ModelArgs) -> Pooling:
    """The pooling of the encoder in ``model_dir`` (its length limit at most the model's positions)."""
    longest = args.position_table or args.max_seq_len
    if not is_sentence_transformers(model_dir):
        return Pooling("mean", normalize=False, max_tokens=longest)
    modules = _modules(model_dir / "modules.json")
    mode, normalize = "mean", False
    for kind, path in modules:
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            mode = _pooling_mode(model_dir / path / "config.json")
        elif kind == "Normalize":
            normalize = True
        else:
            raise ModelLoadError(f"{model_dir / 'modules.json'}: module {kind!r:.60} is not supported "
                                 "(expected Transformer, Pooling and Normalize)")
    config_path = model_dir / "sentence_bert_config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    try:
        limit = config.get("max_seq_length")
        max_tokens = min(longest, integer(limit, "max_seq_length")) if limit is not None else longest
    except ValueError as e:
        raise ModelLoadError(f"{config_path}: {e}") from None
    if max_tokens < 3:
        raise ModelLoadError(f"{config_path}: max_seq_length {max_tokens} leaves no room for a token")
    prompts, default_prompt = _prompts(model_dir / "config_sentence_transformers.json")
    return Pooling(_MODES[mode], normalize=normalize, max_tokens=max_tokens,
                   lowercase=bool(config.get("do_lower_case", False)), prompts=prompts, default_prompt=default_prompt)


def _prompts(path: Path) -> tuple[tuple[tuple[str, str], ...], str | None]:
    if not path.is_file():
        return (), None
    config = read_json(path)
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise ModelLoadError(f"{path}: prompts must map names to texts")
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ModelLoadError(f"{path}: default_prompt_name {default!r:.40} is not one of its prompts")
    return tuple(prompts.items()), default


def is_decoder_reranker(model_dir: Path, args: ModelArgs) -> bool:
    """A Qwen3-Reranker folder: a qwen3 causal model whose README is that model card's."""
    readme = model_dir / "README.md"
    if args.family != "qwen3" or args.encoder or args.pooled or not readme.is_file():
        return False
    try:
        return "# Qwen3-Reranker" in readme.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def decoder_ranking(where: str, args: ModelArgs, tokenizer) -> Ranking:
    """Qwen3-Reranker's scoring: its "yes" and "no" tokens' ids, its prompt, the model's context."""
    answers = []
    for word in ("yes", "no"):
        ids = tokenizer.encode(word)
        if len(ids) != 1:
            raise ModelLoadError(f"{where}: a decoder reranker answers 'yes' or 'no', and its vocabulary has no "
                                 f"{word!r} token")
        answers.append(ids[0])
    return Ranking(sigmoid=False, max_tokens=args.max_seq_len, answers=(answers[0], answers[1]),
                   prompt=QWEN3_RERANK_PROMPT)


def read_ranking(model_dir: Path, args: ModelArgs) -> Ranking:
    """A cross-encoder's scoring: ``config.json``'s ``sentence_transformers.activation_fn``
    (Sigmoid by default, or Identity for raw logits), its length the tokenizer's
    ``model_max_length`` within the model's positions."""
    config = read_json(model_dir / "config.json")
    settings = config.get("sentence_transformers") or {}
    activation = (settings.get("activation_fn") if isinstance(settings, dict) else None) or "Sigmoid"
    name = str(activation).rpartition(".")[2]
    if name not in ("Sigmoid", "Identity"):
        raise ModelLoadError(f"{model_dir / 'config.json'}: activation_fn {activation!r:.60} is not supported "
                             "(expected Sigmoid or Identity)")
    longest = args.position_table or args.max_seq_len
    tokenizer_path = model_dir / "tokenizer_config.json"
    limit = read_json(tokenizer_path).get("model_max_length") if tokenizer_path.is_file() else None
    if isinstance(limit, int) and not isinstance(limit, bool) and 3 <= limit < longest:
        longest = limit
    return Ranking(sigmoid=name == "Sigmoid", max_tokens=longest)


def _modules(path: Path) -> list[tuple[str, str]]:
    """``modules.json``'s modules as (class name, folder), in order."""
    from llama_chat.model.safe_input import loads

    try:
        data = loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise ModelLoadError(f"{path}: expected a list of modules")
    found = []
    for module in data:
        kind, folder = module.get("type"), module.get("path", "")
        if not isinstance(kind, str) or not isinstance(folder, str) or ".." in Path(folder).parts \
                or Path(folder).is_absolute():
            raise ModelLoadError(f"{path}: a module needs a 'type' and a 'path' inside the folder, found {module!r:.80}")
        found.append((kind.rpartition(".")[2], folder))
    return found


def _pooling_mode(path: Path) -> str:
    config: dict[str, Any] = read_json(path)
    mode = config.get("pooling_mode")
    if mode is None:
        on = [name for flag, name in _FLAGS.items() if config.get(flag)]
        mode = on[0] if len(on) == 1 else on
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode not in _MODES:
        raise ModelLoadError(f"{path}: pooling {mode!r:.60} is not supported (expected one of {', '.join(_MODES)})")
    return mode

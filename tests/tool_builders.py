"""Tiny models that speak a real model's chat template: the template's own text (tests/data/templates),
a byte-level tokenizer with that family's special tokens, and random Llama weights that end their
replies now and then (the stop tokens keep their output rows)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from builders import random_model, tiny_args
from builders_formats import write_hf_checkpoint

TEMPLATES = Path(__file__).parent / "data" / "templates"
CORPUS = [
    "The weather in Paris is sunny and the city is warm today.",
    "Call the function get_weather with the city name and the unit celsius or fahrenheit.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "unit": "celsius"}}',
    "Once upon a time a little fox jumped over the lazy dog and ran into the forest.",
    "You are a helpful assistant. Answer the user's question, or call a tool.",
    '[{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]',
    "0123456789 true false null , : [ ] { } \" \\ \n\t",
]


@dataclass(frozen=True)
class Family:
    """One chat template's family: its file, special tokens (control: no text), added tokens that
    are text (Qwen's ``<tool_call>``), and its ``bos``/``eos`` names."""

    template: str
    specials: tuple[str, ...]
    added: tuple[str, ...]
    bos: str
    eos: str


FAMILIES = {
    "hermes": Family("qwen2.5.jinja", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                     ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
                     "<|endoftext|>", "<|im_end|>"),
    "llama3_json": Family("llama3.1.jinja", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                             "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
                          (), "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": Family("mistral-nemo.jinja", ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                                             "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                                             "[/TOOL_RESULTS]"), (), "<s>", "</s>"),
    # No tool markup in its template: the generic format.
    "generic": Family("qwen2.5.jinja", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), (), "<|endoftext|>",
                      "<|im_end|>"),
}
# Thinking models (tests/test_reasoning_serve.py), apart from the tool formats' families: Qwen3 (its
# tags are added tokens; its template reads enable_thinking and drops earlier turns' thinking), an R1
# distill whose template opens the thinking, and the same with tags that are plain text.
THINKING_FAMILIES = {
    "qwen3": Family("qwen3.jinja", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                    ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
                    "<|endoftext|>", "<|im_end|>"),
    "r1": Family("r1-distill.jinja", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), ("<think>", "</think>"),
                 "<|endoftext|>", "<|im_end|>"),
    "r1_text": Family("r1-distill.jinja", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), (),
                      "<|endoftext|>", "<|im_end|>"),
}
GENERIC_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def template_text(family: str) -> str:
    return GENERIC_TEMPLATE if family == "generic" else (TEMPLATES / _family(family).template).read_text()


def _family(name: str) -> Family:
    return FAMILIES[name] if name in FAMILIES else THINKING_FAMILIES[name]


def write_tokenizer(out_dir: Path, family: str) -> int:
    """``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template); the vocabulary's size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = _family(family)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=list(spec.specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.added])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"bos_token": spec.bos, "eos_token": spec.eos, "add_bos_token": False,
              "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template_text(family)}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size(with_added_tokens=True)


def build_tool_model(out_dir: Path, family: str, *, seed: int = 5, max_seq_len: int = 4096) -> Path:
    """A random Llama in Hugging Face layout with ``family``'s tokenizer and template."""
    vocab = write_tokenizer(out_dir, family)
    write_hf_checkpoint(random_model(tiny_args(vocab, max_seq_len=max_seq_len), seed=seed), out_dir)
    return out_dir


def hf_tokenizer(model_dir: Path):
    """transformers' tokenizer of ``model_dir``: the reference ``apply_chat_template``."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    return PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), bos_token=config["bos_token"],
                                   eos_token=config["eos_token"], chat_template=config["chat_template"])

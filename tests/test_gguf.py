"""GGUF files: parity with the Hugging Face checkpoint they were converted from, every tensor type,
the tokenizers they carry, their chat templates and their bad forms.

Every GGUF here is written with the ``gguf`` package's writer from the same random weights as a
``transformers.LlamaForCausalLM`` (``builders_gguf.write_gguf``, which follows llama.cpp's
converter: names, q/k permutation, rope_freqs, vocabularies).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from builders import cached_greedy, train_sentencepiece, weights_only_int8  # noqa: E402
from builders_gguf import DEFAULT_ROPE, T, hf_config, hf_llama, hf_with_file_weights, write_gguf  # noqa: E402
from tokenizer_builders import CORPUS, train_llama_sentencepiece, write_tiktoken_file  # noqa: E402
from llama_chat.model.errors import ModelLoadError  # noqa: E402
from llama_chat.model.loader import detect_layout, load_model  # noqa: E402
from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer  # noqa: E402
from llama_chat.model.tokenizers.tiktoken import TiktokenTokenizer  # noqa: E402

PROMPT_LEN = 48
NEW_TOKENS = 24

LLAMA31_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
}

# Stated tolerances per type, against the float32 checkpoint the file was made from (the
# quantizers are those of builders_gguf: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 the gguf package's, the K
# and IQ4 types simple round-to-nearest ones, coarser than llama.cpp's searched scales; weights are
# Gaussian, the hardest case for block quantization; at 2 and 3 bits the logits of this random
# 2-layer model keep little of the original's). Measured values in docs/formats.md; bounds ~1.5x those.
# Weights: ||w_file - w|| / ||w|| for the dequantized weights.
WEIGHT_TOLERANCE = {T.F16: 0.001, T.BF16: 0.004, T.Q8_0: 0.008, T.Q6_K: 0.03, T.Q5_K: 0.06, T.Q4_K: 0.12,
                    T.Q4_0: 0.15, T.Q5_1: 0.06, T.Q5_0: 0.065, T.Q4_1: 0.12, T.IQ4_XS: 0.12, T.IQ4_NL: 0.12,
                    T.Q3_K: 0.27, T.Q2_K: 0.5}
# Logits: ||ours - hf|| / ||hf - mean(hf)|| over a 48-token prompt (errors grow through the layers).
RELATIVE_TOLERANCE = {T.F16: 0.005, T.BF16: 0.02, T.Q8_0: 0.06, T.Q6_K: 0.2, T.Q5_K: 0.4, T.Q4_K: 0.75,
                      T.Q4_0: 0.75, T.Q5_1: 0.4, T.Q5_0: 0.45, T.Q4_1: 0.75, T.IQ4_XS: 0.75, T.IQ4_NL: 0.75,
                      T.Q3_K: 1.4, T.Q2_K: 1.8}
HOLD_OUT = [
    "A quick brown dog jumps over the lazy fox, twice!",
    "Numbers: 3.14159, 2718, and 1,000,000 — all of them.",
    "Ünïcödé wörds: naïveté, Zürich, smörgåsbord; 日本語のテキスト；한국어 문장.",
    "Emoji run: 🤖🚀✨ plus 👩🏽‍💻 and a flag 🇨🇦.",
    "    indented code\n\tfn main() { println!(\"hi\"); }\n\n\n",
    "trailing spaces   \nand\r\nwindows line ends",
    "<s> and </s> and <|eot_id|> typed as plain text",
    "",
    " ",
    "x" * 300,
]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("spm"), vocab_size=400)


@pytest.fixture(scope="module")
def reference(sp_model):
    """The grouped-query model every type is written from, and its float32 logits."""
    hf = hf_llama(416, heads=8, kv_heads=2, tied=False, rope=DEFAULT_ROPE, seed=3)
    prompt = torch.randint(3, 400, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logits = hf(prompt).logits.float()
    return hf, prompt, logits


# -- parity ----------------------------------------------------------------------------------


CONFIGS = {
    "mha-untied": dict(heads=4, kv_heads=4, tied=False, rope=DEFAULT_ROPE),
    "gqa-tied": dict(heads=8, kv_heads=2, tied=True, rope=DEFAULT_ROPE),
    # Llama 3.1: scaled rotary frequencies, which GGUF keeps as a rope_freqs tensor
    "llama3.1-rope": dict(heads=4, kv_heads=2, tied=False, rope=LLAMA31_ROPE, context=131072),
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("qtype", [T.F32, T.F16], ids=["F32", "F16"])
def test_f32_and_f16_files_match_the_hf_checkpoint(tmp_path, sp_model, name, qtype):
    hf = hf_llama(416, seed=len(name), **CONFIGS[name])
    path = write_gguf(tmp_path / "m.gguf", hf.state_dict(), hf_config(hf), qtype=qtype, sp_model=sp_model)
    loaded = load_model(path, device="cpu", dtype="float32")
    assert loaded.layout == "gguf" and loaded.name == "m"
    assert loaded.args.tie_embeddings == hf.config.tie_word_embeddings
    assert loaded.args.n_kv_heads == CONFIGS[name]["kv_heads"]
    if name == "llama3.1-rope":
        assert loaded.args.rope_scaling is not None and loaded.args.rope_theta == 500000.0

    prompt = torch.randint(3, 400, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = hf(prompt).logits.float()
        got = loaded.model(prompt)
        diff = (got - want).abs().max().item()
        print(f"{name} {qtype.name}: max |logit diff| {diff:.2e}")
        if qtype == T.F32:
            assert diff <= 1e-4
        else:
            rel = _relative_error(got, want)
            print(f"{name} F16: relative logit error {rel:.5f}")
            assert rel <= RELATIVE_TOLERANCE[T.F16]
        hf_tokens = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                max_new_tokens=NEW_TOKENS)[0, PROMPT_LEN:].tolist()
        ours = cached_greedy(loaded.model, prompt, NEW_TOKENS)
    assert ours == hf_tokens


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    spread = (want - want.mean(-1, keepdim=True)).norm()
    return ((got - want).norm() / spread).item()


QUANTIZED = [T.BF16, T.Q8_0, T.Q6_K, T.Q5_1, T.Q5_0, T.Q5_K, T.Q4_1, T.Q4_K, T.Q4_0, T.IQ4_XS, T.IQ4_NL, T.Q3_K,
             T.Q2_K]


@pytest.mark.parametrize("qtype", QUANTIZED, ids=[q.name for q in QUANTIZED])
def test_quantized_files_are_exact_against_their_own_values_and_near_the_original(tmp_path, sp_model,
                                                                                 reference, qtype):
    hf, prompt, want = reference
    path = write_gguf(tmp_path / "m.gguf", hf.state_dict(), hf_config(hf), qtype=qtype, sp_model=sp_model)
    loaded = load_model(path, device="cpu", dtype="float32")
    # 1. Exact: the same model with the weights the gguf package's numpy dequantizer reads from
    # the file (q/k rows taken back to Hugging Face's order): the whole path, to 1e-4.
    same = hf_with_file_weights(hf, path)
    with torch.inference_mode():
        got = loaded.model(prompt)
        exact = same(prompt).logits.float()
    assert (got - exact).abs().max().item() <= 1e-4
    # 2. Near the float32 original, within the type's stated bounds.
    original = hf.state_dict()["model.layers.0.mlp.gate_proj.weight"]
    ours = loaded.model.layers[0].feed_forward.w1.weight
    weight_error = ((ours - original).norm() / original.norm()).item()
    rel = _relative_error(got, want)
    print(f"{qtype.name}: relative weight error {weight_error:.4f} (bound {WEIGHT_TOLERANCE[qtype]}), "
          f"relative logit error {rel:.4f} (bound {RELATIVE_TOLERANCE[qtype]})")
    assert weight_error <= WEIGHT_TOLERANCE[qtype]
    assert rel <= RELATIVE_TOLERANCE[qtype]


def test_a_mixed_file_like_q4_k_m_loads(tmp_path, sp_model, reference):
    """Q4_K_M-like: most weights Q4_K, some Q6_K, norms F32, all in one file."""
    hf, prompt, want = reference
    state = hf.state_dict()
    path = write_gguf(tmp_path / "mixed.gguf", state, hf_config(hf), qtype=T.Q4_K, sp_model=sp_model,
                      qtype_for={"model.layers.0.mlp.down_proj.weight": T.Q6_K, "lm_head.weight": T.Q6_K,
                                 "model.embed_tokens.weight": T.Q8_0})
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert {types["blk.0.ffn_down.weight"], types["blk.1.ffn_down.weight"], types["token_embd.weight"]} == {
        T.Q6_K, T.Q4_K, T.Q8_0}
    loaded = load_model(path, device="cpu", dtype="float32")
    with torch.inference_mode():
        assert _relative_error(loaded.model(prompt), want) <= RELATIVE_TOLERANCE[T.Q4_K]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_quantized_weights_load_in_half_precision(tmp_path, sp_model, reference, dtype):
    hf, prompt, want = reference
    path = write_gguf(tmp_path / "m.gguf", hf.state_dict(), hf_config(hf), qtype=T.Q8_0, sp_model=sp_model)
    loaded = load_model(path, device="cpu", dtype=dtype)
    assert loaded.model.tok_embeddings.weight.dtype == getattr(torch, dtype)
    with torch.inference_mode():
        assert _relative_error(loaded.model(prompt).float(), want) <= 0.06


# -- tokenizers ------------------------------------------------------------------------------


def _vocab_only_gguf(path: Path, *, sp_model: Path | None = None, tiktoken_file: Path | None = None,
                     vocab: int, template: str | None = None) -> Path:
    hf = hf_llama(vocab, heads=4, kv_heads=4, tied=True, rope=DEFAULT_ROPE, seed=0, dim=64)
    return write_gguf(path, hf.state_dict(), hf_config(hf), sp_model=sp_model, tiktoken_file=tiktoken_file,
                      chat_template=template)


def test_sentencepiece_vocabulary_gives_the_original_ids(tmp_path):
    original_path = train_llama_sentencepiece(tmp_path / "sp", vocab_size=600, user_defined=("<|im_end|>",))
    original = SentencePieceTokenizer(original_path)
    path = _vocab_only_gguf(tmp_path / "sp.gguf", sp_model=original_path, vocab=original.vocab_size + 8)
    loaded = load_model(path, device="cpu")
    tok = loaded.tokenizer
    assert tok.vocab_size == original.vocab_size  # the converter's [PADn] padding is left out
    for text in HOLD_OUT + CORPUS:
        assert tok.encode(text) == original.encode(text), text
        ids = original.encode(text, bos=True)
        assert tok.encode(text, bos=True) == ids
        assert tok.decode(ids) == original.decode(ids)
        assert [tok.token_bytes(i) for i in ids] == [original.token_bytes(i) for i in ids]
    assert (tok.bos_id, tok.eos_id) == (original.bos_id, original.eos_id)
    assert tok.stop_ids >= original.stop_ids
    assert tok.strips_leading_space and tok.add_bos
    assert tok.special_tokens["<|im_end|>"] == original.special_tokens["<|im_end|>"]


def test_tiktoken_vocabulary_gives_the_original_ids(tmp_path):
    rank_file = write_tiktoken_file(tmp_path / "tt", n_merges=300)
    original = TiktokenTokenizer(rank_file)
    path = _vocab_only_gguf(tmp_path / "tt.gguf", tiktoken_file=rank_file, vocab=original.vocab_size)
    loaded = load_model(path, device="cpu")
    tok = loaded.tokenizer
    assert tok.vocab_size == original.vocab_size
    for text in HOLD_OUT + CORPUS:
        assert tok.encode(text) == original.encode(text), text
        ids = original.encode(text)
        assert tok.decode(ids) == original.decode(ids)
        assert [tok.token_bytes(i) for i in ids] == [original.token_bytes(i) for i in ids]
    assert tok.bos_id == original.bos_id
    assert tok.special_tokens["<|eot_id|>"] == original.special_tokens["<|eot_id|>"]
    assert original.special_tokens["<|eot_id|>"] in tok.stop_ids
    rendered = "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    assert tok.encode_allowing_special(rendered) == original.encode_allowing_special(rendered)
    # Without a template in the file, a vocabulary with Llama 3's header tokens chats as Llama 3.
    assert loaded.chat_format is not None and loaded.chat_format.name == "llama3"


def test_the_chat_template_in_the_file_is_used(tmp_path):
    from llama_chat.model.chat_format import Message

    rank_file = write_tiktoken_file(tmp_path / "tt", n_merges=100)
    n = TiktokenTokenizer(rank_file).vocab_size
    template = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
                "{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
    path = _vocab_only_gguf(tmp_path / "chat.gguf", tiktoken_file=rank_file, vocab=n, template=template)
    loaded = load_model(path, device="cpu")
    assert loaded.chat_format is not None and loaded.chat_format.name == "hf"
    ids = loaded.chat_format.encode_dialog([Message("user", "hi")])
    specials = loaded.tokenizer.special_tokens
    assert ids[:2] == [specials["<|begin_of_text|>"], specials["<|start_header_id|>"]]
    assert ids.count(specials["<|begin_of_text|>"]) == 1
    assert load_model(path, device="cpu", chat_format="none").chat_format is None


# -- finding, layouts and errors -------------------------------------------------------------


def test_layout_is_found_by_magic_and_in_a_directory(tmp_path, sp_model, reference):
    hf, _, _ = reference
    (tmp_path / "d").mkdir()
    path = write_gguf(tmp_path / "d" / "model.gguf", hf.state_dict(), hf_config(hf), sp_model=sp_model)
    blob = tmp_path / "sha256-0123abcd"
    blob.write_bytes(path.read_bytes())
    assert detect_layout(path) == "gguf"
    assert detect_layout(tmp_path / "d") == "gguf"
    assert detect_layout(blob) == "gguf"  # Ollama's blobs have no extension
    assert load_model(blob, device="cpu", name="tiny:latest").name == "tiny:latest"
    (tmp_path / "d" / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(ModelLoadError, match=r"holds 2 GGUF files \(model.gguf, other.gguf\); name one"):
        detect_layout(tmp_path / "d")


def _error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(path, device="cpu")
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="module")
def good_file(tmp_path_factory, sp_model) -> Path:
    hf = hf_llama(416, heads=4, kv_heads=2, tied=False, rope=DEFAULT_ROPE, seed=0, dim=64)
    return write_gguf(tmp_path_factory.mktemp("good") / "good.gguf", hf.state_dict(), hf_config(hf),
                      qtype=T.Q8_0, sp_model=sp_model)


def test_truncated_and_damaged_files_are_one_line_errors(tmp_path, good_file):
    data = good_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    assert _error(cut).startswith("cut.gguf: ")
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:200])
    assert "header.gguf: not a valid GGUF file" in _error(header_only)
    not_gguf = tmp_path / "fake.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + data[4:100])
    assert "fake.gguf: not a GGUF file (it does not start with 'GGUF')" in _error(not_gguf)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert "empty.gguf" in _error(empty)


def _rewrite(src: Path, dst: Path, *, drop: set[str] = frozenset(), change: dict | None = None,
             arch: str = "llama", skip_tensors: set[str] = frozenset()) -> Path:
    """A copy of ``src`` through the gguf writer with some metadata dropped or replaced."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), arch)
    change = dict(change or {})
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop:
            continue
        value_type = field.types[0]
        if name in change:
            value = change.pop(name)
        elif value_type == gguf.GGUFValueType.ARRAY:
            value = field.contents()
        else:
            value = field.contents()
        sub = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, value_type, sub_type=sub)
    for name, (value, value_type) in change.items():
        writer.add_key_value(name, value, value_type)
    for t in reader.tensors:
        if t.name in skip_tensors:
            continue
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_bad_metadata_is_named(tmp_path, good_file):
    assert _error(_rewrite(good_file, tmp_path / "a.gguf", arch="falcon")) == (
        "a.gguf: architecture 'falcon' is not supported (expected one of llama, qwen2, qwen3, gemma2, gemma3, phi3, bert, nomic-bert)")
    assert _error(_rewrite(good_file, tmp_path / "b.gguf", drop={"llama.block_count"})) == (
        "b.gguf: missing metadata 'llama.block_count'")
    message = _error(_rewrite(good_file, tmp_path / "c.gguf", change={"llama.block_count": 10**6}))
    assert message.startswith("c.gguf: describes a model of ") and "but the file holds only" in message
    message = _error(_rewrite(good_file, tmp_path / "d.gguf", change={"llama.block_count": 2**31}))
    assert message.startswith("d.gguf: ") and "larger than any model's" in message
    assert _error(_rewrite(good_file, tmp_path / "e.gguf", drop={"tokenizer.ggml.model"})).startswith(
        "e.gguf: no tokenizer in the file")
    assert _error(_rewrite(good_file, tmp_path / "f.gguf", change={"tokenizer.ggml.bos_token_id": 99999})) == (
        "f.gguf: metadata 'tokenizer.ggml.bos_token_id' is 99999, not a token id (0 to 415)")
    message = _error(_rewrite(good_file, tmp_path / "g.gguf", skip_tensors={"blk.1.ffn_up.weight"}))
    assert message == "g.gguf: missing tensor 'layers.1.feed_forward.w3.weight'"
    hostile = _rewrite(good_file, tmp_path / "i.gguf", change={"tokenizer.ggml.model": "\x1b[2Jevil"})
    assert _error(hostile) == "i.gguf: tokenizer.ggml.model '\\x1b[2Jevil' is not supported (expected 'llama', 'gpt2' or 'bert')"


def test_unsupported_tensor_types_are_named(tmp_path, sp_model):
    hf = hf_llama(416, heads=4, kv_heads=2, tied=True, rope=DEFAULT_ROPE, seed=0, dim=256)
    path = write_gguf(tmp_path / "tq1_0.gguf", hf.state_dict(), hf_config(hf), qtype=T.TQ1_0, sp_model=sp_model)
    assert _error(path) == ("tq1_0.gguf: tensor 'token_embd.weight' has type TQ1_0, which is not supported "
                            "(expected F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, "
                            "IQ4_NL or IQ4_XS)")


def test_the_header_parser_agrees_with_gguf_readers(tmp_path, good_file):
    """Metadata and tensor places as the gguf package's own reader sees them."""
    from llama_chat.model.formats.gguf import open_gguf

    rank_file = write_tiktoken_file(tmp_path / "tt", n_merges=50)
    merged = _vocab_only_gguf(tmp_path / "tt.gguf", tiktoken_file=rank_file,
                              vocab=TiktokenTokenizer(rank_file).vocab_size, template="{{ 'x' }}")
    for path in (good_file, merged):
        ours = open_gguf(path)
        reader = gguf.GGUFReader(path)
        fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        assert set(ours.metadata) == set(fields)
        for key, field in fields.items():
            want = field.contents()
            got = ours.metadata[key]
            if isinstance(want, float) or (isinstance(want, list) and want and isinstance(want[0], float)):
                assert got == pytest.approx(want), key
            else:
                assert got == want, key
        assert [t.name for t in reader.tensors] == list(ours.tensors)
        for t in reader.tensors:
            info = ours.tensors[t.name]
            assert (info.offset, info.nbytes, info.ggml_type) == (t.data_offset, t.n_bytes, int(t.tensor_type))
            assert info.shape == tuple(reversed([int(d) for d in t.shape]))


def test_absurd_counts_in_the_header_fail_before_anything_is_sized(tmp_path, good_file):
    import struct

    data = bytearray(good_file.read_bytes())
    data[16:24] = struct.pack("<Q", 2**60)  # the metadata count
    bad = tmp_path / "count.gguf"
    bad.write_bytes(bytes(data))
    message = _error(bad)
    assert message.startswith("count.gguf: not a valid GGUF file (the metadata count claims 1,152,921,504,606,846,976 "
                              "items, more than the ")


def test_weights_in_the_target_dtype_stay_the_file_mapping(tmp_path, sp_model, reference):
    """F32 loaded as float32 and F16 as float16 on the CPU are views of the file, never copied."""
    hf, _, _ = reference
    for qtype, dtype in ((T.F32, torch.float32), (T.F16, torch.float16)):
        path = write_gguf(tmp_path / f"{qtype.name}.gguf", hf.state_dict(), hf_config(hf), qtype=qtype,
                          sp_model=sp_model)
        loaded = load_model(path, device="cpu", dtype=dtype)
        w = loaded.model.layers[1].feed_forward.w2.weight
        assert w.dtype == dtype
        assert w.untyped_storage().nbytes() == path.stat().st_size  # the whole file's mapping


def test_a_hostile_file_through_the_command_is_one_clean_line(tmp_path, good_file):
    from cli_support import run_cli

    evil = _rewrite(good_file, tmp_path / "evil.gguf", arch="\x1b]0;pwned\x07\x1b[2J")
    proc = run_cli("-m", str(evil), "-p", "hi", "--no-stdin")
    assert proc.returncode == 2
    err = proc.stderr.decode()
    assert err.count("\n") == 1 and "\x1b" not in err and "\x07" not in err
    assert err.startswith("llama-chat: error: evil.gguf: architecture '\\x1b]0;pwned\\x07\\x1b[2J' is not supported")


def test_the_command_chats_with_a_llama3_style_file(tmp_path):
    """A byte-level vocabulary and the file's own template, through ``llama-chat -m file.gguf``."""
    from cli_support import run_cli
    from llama_chat.model.chat_format import Message

    rank_file = write_tiktoken_file(tmp_path / "tt", n_merges=100)
    template = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
                "{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
    path = _vocab_only_gguf(tmp_path / "chat.gguf", tiktoken_file=rank_file,
                            vocab=TiktokenTokenizer(rank_file).vocab_size, template=template)
    want = load_model(path, device="cpu").chat_format.encode_dialog([Message("user", "hello there")])
    proc = run_cli("-m", str(path), "-p", "hello there", "-n", "3", "-t", "0", "--json", "--no-stdin")
    assert proc.returncode == 0, proc.stderr.decode()
    result = json.loads(proc.stdout)
    assert result["model"] == "chat" and result["prompt_tokens"] == len(want)


def test_q8_0_loads_straight_into_the_int8_path(tmp_path, sp_model, reference):
    """``quantize="int8"``: each projection goes from its blocks to per-row int8 as it is loaded;
    the model is the one ``quantize_model`` makes of the float model, without the float model."""
    from llama_chat.ml.quantize import Int8Linear, quantize_model

    hf, prompt, want = reference
    for tied in (False, True):
        state = hf.state_dict()
        config = hf_config(hf) | {"tie_word_embeddings": tied}
        path = write_gguf(tmp_path / f"q8-{tied}.gguf", state, config, qtype=T.Q8_0, sp_model=sp_model)
        direct = load_model(path, device="cpu", quantize="int8").model
        assert isinstance(direct.layers[0].attention.wq, Int8Linear) and isinstance(direct.output, Int8Linear)
        assert direct.tok_embeddings.weight.dtype == torch.float32
        after = load_model(path, device="cpu", dtype="float32").model  # the float model (auto keeps the blocks)
        assert quantize_model(after) == 7 * 2 + 1
        with torch.inference_mode():
            got, expected = direct(prompt), after(prompt)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
            direct.fuse_projections()  # as the engine does: per-row scales concatenate exactly
            torch.testing.assert_close(direct(prompt), expected, atol=1e-5, rtol=0)
            if not tied:
                with weights_only_int8(direct):
                    weights_only = direct(prompt)
                assert _relative_error(weights_only, want) <= RELATIVE_TOLERANCE[T.Q8_0] * 1.5
                # fbgemm's product (x86) also rounds the activations to 7 bits, 64 rows to a range;
                # this random model's activations are large (the shipped model's perplexity moves
                # by 0.01 % with it, scripts/evaluate_quantized.py).
                assert _relative_error(got, want) <= RELATIVE_TOLERANCE[T.Q8_0] * 3
    with pytest.raises(ModelLoadError, match="quantization 'int4' is not supported"):
        load_model(path, device="cpu", quantize="int4")

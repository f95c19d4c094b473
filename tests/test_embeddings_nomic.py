"""nomic-bert (nomic-embed-text) from GGUF files as llama.cpp's converter writes them. transformers
has no nomic_bert without the model's own remote code, so the reference is llama.cpp's graph for
the architecture spelled out in plain torch (``builders_embeddings.nomic_bert_hidden``)."""

from __future__ import annotations

import pytest
import torch

from builders_embeddings import hf_tokenizer, nomic_bert, nomic_bert_hidden, write_nomic_bert_gguf
from llama_chat.inference.embedding import Embedder
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.loader import load_model

CONTEXT = 24
TEXTS = ["a", "The quick brown fox jumps over the lazy dog!", "Café naïve, ÜBER straße: 東京 中文 😀 emoji 👩‍👩‍👧",
         " ".join(["hello world"] * 30),  # past the file's context: cut to it
         "unjumpable foxes, 42 dogs; (quick) [MASK] x"]


@pytest.mark.parametrize("pooling_type,mode", [(1, "mean"), (2, "cls")])
def test_a_nomic_bert_file_embeds_as_llama_cpps_graph(tmp_path, pooling_type, mode):
    model = nomic_bert(seed=31)
    path = write_nomic_bert_gguf(tmp_path / "nomic.gguf", model, context=CONTEXT, pooling_type=pooling_type)
    loaded = load_model(path, device="cpu")
    assert (loaded.kind, loaded.args.family, loaded.args.position_table) == ("embedding", "nomic-bert", 0)
    embedder = Embedder(loaded)
    assert (embedder.pooling.mode, embedder.pooling.normalize, embedder.max_tokens) == (mode, True, CONTEXT)
    tokenizer = hf_tokenizer(tmp_path / "tok")
    ids = [embedder.text_ids(t, truncate=True) for t in TEXTS]
    assert ids == [tokenizer(t, truncation=True, max_length=CONTEXT)["input_ids"] for t in TEXTS]
    ours = torch.stack([e.vector for e in embedder.embed(ids)])  # padded together, by length
    with torch.no_grad():
        hidden = [nomic_bert_hidden(model, row) for row in ids]
    pooled = torch.stack([h.mean(0) if mode == "mean" else h[0] for h in hidden])
    torch.testing.assert_close(ours, torch.nn.functional.normalize(pooled, dim=-1), atol=1e-5, rtol=1e-4)


def test_a_q8_0_nomic_bert_file_keeps_its_blocks_and_its_vectors(tmp_path):
    from builders_gguf import T
    from llama_chat.ml.packed import PackedLinear

    model = nomic_bert(seed=33, dim=64, hidden=64)  # rows of whole Q8_0 blocks (32 values)
    loaded = load_model(write_nomic_bert_gguf(tmp_path / "nomic-q8_0.gguf", model, qtype=T.Q8_0), device="cpu")
    embedder = Embedder(loaded)  # q, k and v fused again: the file's blocks, in our rotary's pairs
    layer = loaded.model.layers[0]
    assert isinstance(layer.attention.wqkv, PackedLinear) and isinstance(layer.feed_forward.w13, PackedLinear)
    ids = [embedder.text_ids(t, truncate=True) for t in TEXTS]
    ours = torch.stack([e.vector for e in embedder.embed(ids)])
    with torch.no_grad():
        expected = torch.stack([nomic_bert_hidden(model, row).mean(0) for row in ids])
    cosines = torch.nn.functional.cosine_similarity(ours, expected, dim=-1)
    assert cosines.min() > 0.99, cosines


def test_a_nomic_bert_file_missing_a_tensor_is_refused_in_one_line(tmp_path):
    model = nomic_bert(seed=32)
    path = write_nomic_bert_gguf(tmp_path / "broken.gguf", model, leave_out=("blk.1.ffn_gate.weight",))
    with pytest.raises(ModelLoadError, match=r"^broken.gguf: missing tensor 'layers.1.feed_forward.w1.weight'$"):
        load_model(path, device="cpu")
    path = write_nomic_bert_gguf(tmp_path / "untyped.gguf", model, leave_out=("token_types.weight",))
    with pytest.raises(ModelLoadError, match=r"^untyped.gguf: missing tensor 'token_types.weight'$"):
        load_model(path, device="cpu")

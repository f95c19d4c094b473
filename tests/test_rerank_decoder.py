"""Decoder rerankers (Qwen3-Reranker): its prompt around the instruction, query and document, scored
by the softmax of its "yes" and "no" logits, against the model card's code on transformers'
``Qwen3ForCausalLM`` with the same random weights."""

from __future__ import annotations

import pytest
import torch

from builders_embeddings import reference_decoder_scores, save_qwen3_reranker
from llama_chat.inference.embedding import EmbeddingInputError, Reranker
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.loader import load_model

POSITIONS = 384
QUERY = "the quick fox"
DOCUMENTS = ["a", "The fox liked to play with the rabbit and the bird near the river.", "東京は大きな都市です 😀 👩‍👩‍👧",
             "Once upon a time there was a little fox who lived in the forest. " * 12,  # past the length: cut
             "yes", "no <think> the cat"]


@pytest.fixture(scope="module")
def qwen3_reranker(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qr") / "qwen3-reranker"
    model, tokenizer = save_qwen3_reranker(folder, seed=11, positions=POSITIONS)
    return folder, model, tokenizer


def test_a_qwen3_reranker_scores_as_its_model_card_does(qwen3_reranker):
    folder, model, tokenizer = qwen3_reranker
    loaded = load_model(folder, device="cpu")
    assert (loaded.kind, loaded.chat_format, loaded.ranking.max_tokens) == ("rerank", None, POSITIONS)
    reranker = Reranker(loaded, max_batch_tokens=1)  # one document a forward, then all in one
    alone, tokens = reranker.scores(QUERY, DOCUMENTS)
    together, _ = Reranker(loaded, max_batch_tokens=10_000).scores(QUERY, DOCUMENTS)
    expected = reference_decoder_scores(model, tokenizer, QUERY, DOCUMENTS, max_length=POSITIONS)
    torch.testing.assert_close(torch.tensor(alone), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(together), expected, atol=1e-5, rtol=0)
    assert (expected - 0.5).abs().min() > 0.1  # away from a half: a swapped "yes" and "no" shows
    assert len(reranker.prompt_ids(QUERY, DOCUMENTS[3])) == POSITIONS
    assert tokens == sum(len(reranker.prompt_ids(QUERY, d)) for d in DOCUMENTS)
    instruction = "Given a question, find the passage that answers it"
    told, _ = reranker.scores(QUERY, DOCUMENTS, instruction)
    torch.testing.assert_close(torch.tensor(told), reference_decoder_scores(
        model, tokenizer, QUERY, DOCUMENTS, max_length=POSITIONS, instruction=instruction), atol=1e-5, rtol=0)
    with pytest.raises(EmbeddingInputError, match="instruction is an empty string"):
        reranker.scores(QUERY, DOCUMENTS, "")
    short = load_model(folder, device="cpu", max_seq_len=64)  # a context its prompt does not fit in
    with pytest.raises(EmbeddingInputError, match="the model's context of 64 tokens is shorter than its rerank prompt"):
        Reranker(short).scores(QUERY, DOCUMENTS)


def test_llama_chat_rerank_ranks_with_a_decoder_reranker_and_its_instruction(qwen3_reranker, monkeypatch, capsys):
    import json

    from builders_embeddings import embed_cli

    folder, model, tokenizer = qwen3_reranker
    documents = [d for d in DOCUMENTS if "\n" not in d]
    instruction = "Find the passage about animals"
    status, out, err = embed_cli(monkeypatch, capsys, "rerank", "-m", str(folder), "--query", QUERY,
                                 "--instruction", instruction, stdin="\n".join(documents))
    assert status == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    expected = reference_decoder_scores(model, tokenizer, QUERY, documents, max_length=POSITIONS,
                                        instruction=instruction)
    order = sorted(range(len(documents)), key=lambda i: -float(expected[i]))
    assert [line["index"] for line in lines] == order
    torch.testing.assert_close(torch.tensor([line["relevance_score"] for line in lines]), expected[order],
                               atol=1e-5, rtol=0)
    status, out, err = embed_cli(monkeypatch, capsys, "embed", "-m", str(folder), "a")
    assert status == 2 and out == "" and "is a reranker: it ranks documents; give -m an embedding model" in err


def test_a_qwen3_reranker_gguf_file_scores_as_llama_cpp_does(tmp_path, sp_model_path):
    """llama.cpp's converter writes Qwen3-Reranker as a qwen3 file of pooling type rank whose
    output is only its "yes" and "no" rows (``cls.output``); llama.cpp scores it by their softmax
    at the last token. The reference: transformers' logits of those two ids on the same prompt."""
    import numpy as np
    import sentencepiece as spm
    from builders_families import hf_family_model, write_family_gguf

    vocab = spm.SentencePieceProcessor(model_file=str(sp_model_path)).vocab_size()
    hf = hf_family_model("qwen3", vocab, seed=12, max_position_embeddings=512)
    with torch.no_grad():
        hf.lm_head.weight.mul_(20.0)
    yes, no = 7, 11  # the file says which rows are which by their order alone

    def head(writer) -> None:
        writer.add_classifier_output_labels(["yes", "no"])
        rows = hf.lm_head.weight.detach()[[yes, no]].float().numpy()
        writer.add_tensor("cls.output.weight", rows.astype(np.float32))

    path = write_family_gguf(tmp_path / "qwen3-reranker.gguf", hf, "qwen3", sp_model_path, pooling_type=4,
                             leave_out=("output.weight",), more=head)
    loaded = load_model(path, device="cpu")
    assert (loaded.kind, loaded.chat_format, loaded.args.pooled) == ("rerank", None, True)
    reranker = Reranker(loaded)
    scores, _ = reranker.scores(QUERY, DOCUMENTS)
    rows = [reranker.prompt_ids(QUERY, d) for d in DOCUMENTS]
    with torch.no_grad():
        logits = torch.stack([hf(torch.tensor([ids])).logits[0, -1, [yes, no]] for ids in rows])
    expected = torch.softmax(logits, dim=-1)[:, 0]
    assert (expected - 0.5).abs().min() > 0.05
    torch.testing.assert_close(torch.tensor(scores), expected, atol=1e-5, rtol=0)
    qwen2 = write_family_gguf(tmp_path / "qwen2-rank.gguf", hf_family_model("qwen2", vocab, seed=13), "qwen2",
                              sp_model_path, pooling_type=4, more=head)
    with pytest.raises(ModelLoadError, match="^qwen2-rank.gguf: a qwen2 file of pooling type 4 \\(rank\\) is not"):
        load_model(qwen2, device="cpu")

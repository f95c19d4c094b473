"""Embeddings: BERT on the one model (its switches), the WordPiece tokenizer, pooling, batching,
and the server's /v1/embeddings and /api/embed against real clients. References are transformers'
BertModel and BertTokenizerFast on the same random weights and vocabulary."""

from __future__ import annotations

import base64
import json
import os
import random
from dataclasses import replace

import httpx
import openai
import pytest
import torch

from builders_embeddings import hf_tokenizer, reference_embeddings, save_bert, vocab_tokens
from llama_chat.inference.embedding import Embedder, EmbeddingInputError
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.loader import load_model
from llama_chat.model.tokenizers.loading import load_tokenizer
from serve_support import WAIT_S, start_server, stop_server, wait_for

MAX_LENGTH = 24
TEXTS = [
    "a",  # one token
    "The quick brown fox jumps over the lazy dog!",
    "Café naïve, ÜBER straße: 東京 中文 😀 emoji 👩‍👩‍👧",
    " ".join(["hello world"] * 30),  # past the length: cut as sentence-transformers cuts it
    "unjumpable foxes, 42 dogs; (quick) [MASK] x",
]
FUZZ_ALPHABET = "abcXYZ é ü ß 東京 ,.!?-'\" \t\n\u00a0\u200b\x00\x07 [MASK] ##s 😀 \u0301 Ǆ İ"


def _fuzz_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(FUZZ_ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("st") / "tiny-st"
    model, tokenizer = save_bert(folder, pooling="mean", normalize=True, max_seq_length=MAX_LENGTH)
    return folder, model, tokenizer


# -- the tokenizer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("lowercase,strip_accents", [(True, None), (False, None), (True, False), (False, True)])
def test_wordpiece_ids_are_bert_tokenizer_fasts(tmp_path, lowercase, strip_accents):
    reference = hf_tokenizer(tmp_path, lowercase=lowercase, strip_accents=strip_accents)
    reference.save_pretrained(tmp_path)
    from_json = load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    from_vocab = load_tokenizer(tmp_path)
    assert type(from_json).__name__ == type(from_vocab).__name__ == "WordPieceTokenizer"
    for text in TEXTS + _fuzz_texts(300, seed=1 + lowercase):
        expected = reference(text)["input_ids"]
        assert from_json.encode(text, bos=True, eos=True) == expected, repr(text)
        assert from_vocab.encode(text, bos=True, eos=True) == expected, repr(text)


def test_a_word_longer_than_bert_takes_is_one_unknown_token(tmp_path):
    reference = hf_tokenizer(tmp_path)
    reference.save_pretrained(tmp_path)
    ours = load_tokenizer(tmp_path)
    for text in ("a" * 100 + " b", "a" * 101 + " b", "xyz" + "é" * 99):
        assert ours.encode(text) == reference(text, add_special_tokens=False)["input_ids"]


# -- the model -------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("cls", False), ("lasttoken", True)])
def test_sentence_transformers_folder_embeds_as_transformers_with_its_pooling(tmp_path, pooling, normalize):
    model, tokenizer = save_bert(tmp_path, seed=2, pooling=pooling, normalize=normalize, max_seq_length=MAX_LENGTH)
    loaded = load_model(tmp_path, device="cpu")
    assert loaded.kind == "embedding" and loaded.args.family == "bert" and loaded.chat_format is None
    embedder = Embedder(loaded)
    assert embedder.max_tokens == MAX_LENGTH and embedder.pooling.normalize == normalize
    ours = torch.stack([e.vector for e in embedder.embed(
        [embedder.text_ids(t, truncate=True) for t in TEXTS])])
    expected = reference_embeddings(model, tokenizer, TEXTS, pooling=pooling, normalize=normalize,
                                    max_length=MAX_LENGTH)
    assert _cosines(ours, expected).min() > 0.9999
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)
    if normalize:
        torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(TEXTS)))


def test_a_bert_model_folder_is_mean_pooled_unnormalized_at_its_positions(tmp_path):
    model, tokenizer = save_bert(tmp_path, seed=3, pooling=None)
    loaded = load_model(tmp_path, device="cpu")
    embedder = Embedder(loaded)
    assert (embedder.pooling.mode, embedder.pooling.normalize, embedder.max_tokens) == ("mean", False, 64)
    ours = torch.stack([e.vector for e in embedder.embed([embedder.text_ids(t, truncate=True) for t in TEXTS])])
    expected = reference_embeddings(model, tokenizer, TEXTS, pooling="mean", normalize=False, max_length=64)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)
    cls = Embedder(loaded, pooling="cls")
    first = cls.embed([cls.text_ids(TEXTS[1], truncate=True)])[0].vector
    torch.testing.assert_close(first, reference_embeddings(model, tokenizer, TEXTS[1:2], pooling="cls",
                                                           normalize=False, max_length=64)[0], atol=1e-5, rtol=1e-4)


def test_padding_and_batching_change_no_vector(st_folder):
    folder, _, _ = st_folder
    texts = TEXTS + _fuzz_texts(40, seed=7)
    together = Embedder(load_model(folder, device="cpu"), max_batch_tokens=1, max_batch_rows=64)
    ids = [together.text_ids(t, truncate=True) for t in texts if t.strip("\x00\x07\u200b")]
    one_by_one = [together.embed([i])[0].vector for i in ids]
    batched = Embedder(together.loaded, max_batch_tokens=10_000, max_batch_rows=64).embed(ids)
    torch.testing.assert_close(torch.stack([e.vector for e in batched]), torch.stack(one_by_one), atol=1e-5, rtol=1e-4)
    assert [e.tokens for e in batched] == [len(i) for i in ids]


def test_requests_waiting_together_share_a_round_and_get_their_own_vectors(st_folder):
    from llama_chat.inference.embedding import EmbeddingRounds

    embedder = Embedder(load_model(st_folder[0], device="cpu"))
    requests = [[embedder.text_ids(t, truncate=True) for t in TEXTS[i:i + 2]] for i in range(4)]
    alone = [embedder.embed(ids, dimensions=8 if i == 2 else None) for i, ids in enumerate(requests)]
    rounds = EmbeddingRounds(embedder)
    try:
        with embedder.lock:  # the first request's round waits on the forwards; the others queue behind it
            futures = [rounds.submit(requests[0])]
            wait_for(lambda: not rounds._waiting, "the first request's round to start")
            futures += [rounds.submit(ids, 8 if i == 2 else None) for i, ids in enumerate(requests[1:], 1)]
        results = [f.result(timeout=WAIT_S) for f in futures]
    finally:
        rounds.close()
    assert rounds.rounds == 2
    for got, expected in zip(results, alone):
        assert [e.tokens for e in got] == [e.tokens for e in expected]
        torch.testing.assert_close(torch.stack([e.vector for e in got]), torch.stack([e.vector for e in expected]),
                                   atol=1e-5, rtol=1e-4)


def test_batches_are_longest_first_within_the_bounds(st_folder):
    embedder = Embedder(load_model(st_folder[0], device="cpu"), max_batch_tokens=40, max_batch_rows=3)
    lengths = [5, 20, 3, 20, 7, 8, 9, 2]
    groups = embedder.batches(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        assert len(group) <= 3 and max(lengths[i] for i in group) * len(group) <= max(40, embedder.max_tokens)
        assert [lengths[i] for i in group] == sorted((lengths[i] for i in group), reverse=True)
    padded_rows = Embedder(embedder.loaded, max_batch_tokens=10_000, max_batch_rows=64).batches(
        [100, 3, 90, 60, 5, 76, 4, 40, 120])
    assert padded_rows == [[8, 0, 2], [5, 3], [7], [4, 6, 1]]  # none padded by over a quarter (or 8 tokens)


def test_dimensions_cut_and_renormalize(st_folder):
    embedder = Embedder(load_model(st_folder[0], device="cpu"))
    ids = [embedder.text_ids(TEXTS[1], truncate=False)]
    whole = embedder.embed(ids)[0].vector
    cut = embedder.embed(ids, dimensions=8)[0].vector
    torch.testing.assert_close(cut, torch.nn.functional.normalize(whole[:8], dim=0))
    for bad in (0, 33):
        with pytest.raises(EmbeddingInputError, match="dimensions must be from 1 to 32"):
            embedder.embed(ids, dimensions=bad)


def test_inputs_the_model_cannot_take_are_named(st_folder):
    embedder = Embedder(load_model(st_folder[0], device="cpu"))
    with pytest.raises(EmbeddingInputError, match="input is an empty string"):
        embedder.text_ids("", truncate=True)
    with pytest.raises(EmbeddingInputError, match=f"62 tokens long; the model takes at most {MAX_LENGTH}"):
        embedder.text_ids(TEXTS[3], truncate=False)
    assert len(embedder.text_ids(TEXTS[3], truncate=True)) == MAX_LENGTH
    with pytest.raises(EmbeddingInputError, match=f"token id {len(vocab_tokens())}, outside the vocabulary"):
        embedder.token_ids([3, len(vocab_tokens())], truncate=True)


def test_a_modules_file_with_a_module_not_read_here_is_refused_in_one_line(tmp_path):
    save_bert(tmp_path, pooling="mean")
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match=r"modules.json: module 'Dense' is not supported"):
        load_model(tmp_path, device="cpu")
    (tmp_path / "modules.json").write_text(json.dumps(modules[:2]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ModelLoadError, match=r"config.json: pooling 'max' is not supported"):
        load_model(tmp_path, device="cpu")


# -- the server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedding_server(st_folder):
    server = start_server(st_folder[0])
    yield server
    assert stop_server(server) == 0, server.log()


def test_openai_client_gets_the_models_embeddings_as_floats_and_base64(st_folder, embedding_server):
    folder, model, tokenizer = st_folder
    client = embedding_server.client()
    texts = TEXTS[:3] + TEXTS[4:]
    floats = client.embeddings.create(model="tiny-st", input=texts, encoding_format="float")
    default = client.embeddings.create(model="tiny-st", input=texts)  # the client asks for base64
    assert floats.model == "tiny-st" and [d.index for d in floats.data] == list(range(len(texts)))
    got = torch.tensor([d.embedding for d in floats.data])
    torch.testing.assert_close(torch.tensor([d.embedding for d in default.data]), got)
    expected = reference_embeddings(model, tokenizer, texts, pooling="mean", normalize=True, max_length=MAX_LENGTH)
    assert _cosines(got, expected).min() > 0.9999
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(texts)))
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in texts)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    raw = httpx.post(f"{embedding_server.url}/v1/embeddings", timeout=WAIT_S,
                     json={"input": texts[1], "encoding_format": "base64"}).json()
    decoded = torch.frombuffer(bytearray(base64.b64decode(raw["data"][0]["embedding"])), dtype=torch.float32)
    torch.testing.assert_close(decoded, got[1])


def test_concurrent_requests_each_get_their_own_vectors(embedding_server):
    from concurrent.futures import ThreadPoolExecutor

    client = embedding_server.client()
    bodies = [[f"{text} {i}" for text in TEXTS[:3]] for i in range(8)]

    def vectors(texts: list[str]) -> torch.Tensor:
        reply = client.embeddings.create(model="tiny-st", input=texts, encoding_format="float")
        return torch.tensor([d.embedding for d in reply.data])

    one_by_one = [vectors(texts) for texts in bodies]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(vectors, bodies))
    for got, expected in zip(together, one_by_one):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    from builders_embeddings import thread_niceness

    # Alone, its rounds yield to nothing: every thread at the niceness it started with, this process's.
    assert set(thread_niceness(embedding_server.proc.pid)) == {os.getpriority(os.PRIO_PROCESS, 0)}


def test_ids_embed_as_their_text_and_dimensions_cut(st_folder, embedding_server):
    _, _, tokenizer = st_folder
    client = embedding_server.client()
    ids = tokenizer(TEXTS[1], add_special_tokens=False)["input_ids"]
    by_text = client.embeddings.create(model="x", input=TEXTS[1], encoding_format="float").data[0].embedding
    by_ids = client.embeddings.create(model="x", input=[ids, ids[:3]], encoding_format="float").data
    torch.testing.assert_close(torch.tensor(by_ids[0].embedding), torch.tensor(by_text))
    one_list = client.embeddings.create(model="x", input=ids, encoding_format="float").data
    assert len(one_list) == 1
    cut = client.embeddings.create(model="x", input=TEXTS[1], dimensions=8, encoding_format="float").data[0].embedding
    torch.testing.assert_close(torch.tensor(cut), torch.nn.functional.normalize(torch.tensor(by_text[:8]), dim=0))


@pytest.mark.parametrize("body,param,message", [
    ({"input": []}, "input", "input is an empty list"),
    ({"input": ""}, "input", "input is an empty string"),
    ({"input": ["ok", ""]}, "input[1]", "input[1] is an empty string"),
    ({}, "input", "input is required"),
    ({"input": 5}, "input", "input must be a string"),
    ({"input": ["a", 1]}, "input", "not a mixture"),
    ({"input": [[1, "a"]]}, "input[0]", "input[0] must be a list of token ids"),
    ({"input": [[3, 100000]]}, "input", "token id 100000, outside the vocabulary"),
    ({"input": " ".join(["hello world"] * 30)}, "input", "the model takes at most 24"),
    ({"input": "a", "dimensions": 0}, "dimensions", "dimensions must be from 1 to 32"),
    ({"input": "a", "dimensions": 33}, "dimensions", "dimensions must be from 1 to 32"),
    ({"input": "a", "dimensions": "8"}, "dimensions", "dimensions must be an integer"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "encoding_format must be float or base64"),
    ({"input": ["a"] * 2049}, "input", "at most 2048"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(embedding_server, body, param, message):
    response = httpx.post(f"{embedding_server.url}/v1/embeddings", json=body, timeout=WAIT_S)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"


def test_ollama_embed_cuts_long_texts_unless_told_not_to(embedding_server):
    url = f"{embedding_server.url}/api/embed"
    long = " ".join(["hello world"] * 30)
    reply = httpx.post(url, json={"model": "tiny-st", "input": ["a", long]}, timeout=WAIT_S).json()
    assert len(reply["embeddings"]) == 2 and len(reply["embeddings"][0]) == 32
    assert reply["prompt_eval_count"] == 3 + MAX_LENGTH and reply["total_duration"] > 0
    refused = httpx.post(url, json={"input": long, "truncate": False}, timeout=WAIT_S)
    assert refused.status_code == 400 and "at most 24" in refused.json()["error"]


def test_an_embedding_model_refuses_to_chat_and_lists_its_kind(embedding_server):
    client = embedding_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-st", messages=[{"role": "user", "content": "hi"}])
    assert "is an embedding model" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-st", prompt="hi")
    model = client.models.list().data[0]
    assert model.id == "tiny-st" and model.kind == "embedding" and model.context_length == MAX_LENGTH
    assert httpx.get(f"{embedding_server.url}/health", timeout=WAIT_S).status_code == 200


# -- reranking -------------------------------------------------------------------------------------

QUERY = "the quick fox"
DOCUMENTS = ["a lazy dog", "the quick brown fox jumps", "東京 café", " ".join(["hello world"] * 30), "fox"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    from builders_embeddings import save_cross_encoder

    folder = tmp_path_factory.mktemp("ce") / "tiny-reranker"
    model, tokenizer = save_cross_encoder(folder, seed=4, max_length=20)
    return folder, model, tokenizer


def test_a_cross_encoder_scores_as_transformers_with_a_sigmoid(cross_encoder):
    from builders_embeddings import reference_scores
    from llama_chat.inference.embedding import Reranker

    folder, model, tokenizer = cross_encoder
    loaded = load_model(folder, device="cpu")
    assert loaded.kind == "rerank" and loaded.ranking.sigmoid and loaded.ranking.max_tokens == 20
    reranker = Reranker(loaded, max_batch_tokens=1)
    scores, tokens = reranker.scores(QUERY, DOCUMENTS)
    expected = reference_scores(model, tokenizer, QUERY, DOCUMENTS, max_length=20)
    torch.testing.assert_close(torch.tensor(scores), expected, atol=1e-5, rtol=1e-4)
    assert tokens == sum(len(tokenizer(QUERY, d, truncation=True, max_length=20)["input_ids"]) for d in DOCUMENTS)
    with pytest.raises(EmbeddingInputError, match="query is an empty string"):
        reranker.scores("", DOCUMENTS)


def test_a_classifier_of_two_labels_is_refused_in_one_line(tmp_path, cross_encoder):
    folder = cross_encoder[0]
    for path in folder.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["id2label"] = {"0": "NO", "1": "YES"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="config.json: a classifier of 2 labels is not supported"):
        load_model(tmp_path, device="cpu")


@pytest.fixture(scope="module")
def rerank_server(cross_encoder):
    server = start_server(cross_encoder[0])
    yield server
    assert stop_server(server) == 0, server.log()


def test_cohere_client_ranks_documents_by_the_models_scores(cross_encoder, rerank_server):
    import cohere
    from builders_embeddings import reference_scores

    _, model, tokenizer = cross_encoder
    expected = reference_scores(model, tokenizer, QUERY, DOCUMENTS, max_length=20)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -float(expected[i]))
    for client in (cohere.Client(base_url=rerank_server.url, api_key="none"),
                   cohere.ClientV2(base_url=rerank_server.url, api_key="none")):
        reply = client.rerank(model="tiny-reranker", query=QUERY, documents=DOCUMENTS, top_n=3)
        assert [r.index for r in reply.results] == order[:3]
        torch.testing.assert_close(torch.tensor([r.relevance_score for r in reply.results]),
                                   expected[order[:3]], atol=1e-5, rtol=1e-4)


def test_rerank_in_jinas_shape_and_its_bad_requests(rerank_server, embedding_server):
    url = f"{rerank_server.url}/rerank"
    reply = httpx.post(url, timeout=WAIT_S, json={"query": QUERY, "return_documents": True,
                                                  "documents": [{"text": d} for d in DOCUMENTS]}).json()
    assert sorted(r["index"] for r in reply["results"]) == list(range(len(DOCUMENTS)))
    assert all(r["document"]["text"] == DOCUMENTS[r["index"]] for r in reply["results"])
    scores = [r["relevance_score"] for r in reply["results"]]
    assert scores == sorted(scores, reverse=True) and reply["usage"]["total_tokens"] > 0
    for body, param in (({"query": QUERY, "documents": []}, "documents"), ({"documents": ["a"]}, "query"),
                        ({"query": "", "documents": ["a"]}, "query"),
                        ({"query": QUERY, "documents": ["a", 3]}, "documents[1]"),
                        ({"query": QUERY, "documents": ["a"], "top_n": 0}, "top_n")):
        response = httpx.post(url, json=body, timeout=WAIT_S)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    wrong = httpx.post(f"{embedding_server.url}/v1/rerank", json={"query": "a", "documents": ["b"]}, timeout=WAIT_S)
    assert wrong.status_code == 400 and "is an embedding model" in wrong.json()["error"]["message"]
    embed = httpx.post(f"{rerank_server.url}/v1/embeddings", json={"input": "a"}, timeout=WAIT_S)
    assert embed.status_code == 400 and "is a reranker" in embed.json()["error"]["message"]
    chat = httpx.post(f"{rerank_server.url}/v1/chat/completions", timeout=WAIT_S,
                      json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "is a reranker: it ranks documents" in chat.json()["error"]["message"]


# -- GGUF ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling_type,pooling", [(1, "mean"), (2, "cls")])
def test_a_bert_gguf_file_embeds_as_transformers(tmp_path, pooling_type, pooling):
    from builders_embeddings import bert_model, write_bert_gguf

    model = bert_model(seed=5)
    tokenizer = hf_tokenizer(tmp_path / "tok")
    path = write_bert_gguf(tmp_path / "bert.gguf", model, pooling_type=pooling_type)
    loaded = load_model(path, device="cpu")
    assert loaded.kind == "embedding" and loaded.pooling.mode == pooling and loaded.pooling.normalize
    embedder = Embedder(loaded)
    for text in TEXTS + _fuzz_texts(50, seed=3):
        assert loaded.tokenizer.encode(text, bos=True, eos=True) == tokenizer(text)["input_ids"], repr(text)
    ours = torch.stack([e.vector for e in embedder.embed([embedder.text_ids(t, truncate=True) for t in TEXTS])])
    expected = reference_embeddings(model, tokenizer, TEXTS, pooling=pooling, normalize=True, max_length=64)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)


def test_a_q8_0_bert_file_keeps_its_blocks_and_its_vectors(tmp_path):
    from builders_embeddings import bert_model, write_bert_gguf
    from builders_gguf import T
    from llama_chat.ml.packed import PackedLinear

    model = bert_model(seed=6)
    tokenizer = hf_tokenizer(tmp_path / "tok")
    loaded = load_model(write_bert_gguf(tmp_path / "bert-q8_0.gguf", model, qtype=T.Q8_0), device="cpu")
    layer = loaded.model.layers[0]
    assert isinstance(layer.feed_forward.w1, PackedLinear) and isinstance(layer.attention.wq, PackedLinear)
    embedder = Embedder(loaded)
    ours = torch.stack([e.vector for e in embedder.embed([embedder.text_ids(t, truncate=True) for t in TEXTS])])
    expected = reference_embeddings(model, tokenizer, TEXTS, pooling="mean", normalize=True, max_length=64)
    assert _cosines(ours, expected).min() > 0.99


def test_a_bert_reranker_gguf_file_scores_as_transformers(tmp_path, cross_encoder):
    from builders_embeddings import reference_scores, write_bert_gguf
    from llama_chat.inference.embedding import Reranker

    _, model, tokenizer = cross_encoder
    loaded = load_model(write_bert_gguf(tmp_path / "reranker.gguf", model), device="cpu")
    assert loaded.kind == "rerank"
    scores, _ = Reranker(loaded).scores(QUERY, DOCUMENTS)
    expected = reference_scores(model, tokenizer, QUERY, DOCUMENTS, max_length=64)
    torch.testing.assert_close(torch.tensor(scores), expected, atol=1e-5, rtol=1e-4)


def test_a_bert_gguf_file_missing_a_tensor_is_refused_in_one_line(tmp_path):
    from builders_embeddings import bert_model, write_bert_gguf

    path = write_bert_gguf(tmp_path / "broken.gguf", bert_model(seed=7), leave_out=("blk.1.attn_k.bias",))
    with pytest.raises(ModelLoadError, match=r"^broken.gguf: missing tensor 'layers.1.attention.bk'$"):
        load_model(path, device="cpu")


# -- decoder embedders -----------------------------------------------------------------------------


def test_a_qwen3_embedder_is_pooled_at_its_last_token_as_transformers(tmp_path, monkeypatch, capsys):
    from builders_embeddings import QWEN3_EMBEDDING_PROMPTS, save_qwen3_embedder

    model, tokenizer = save_qwen3_embedder(tmp_path / "qwen3-embedding", seed=8, max_seq_length=32)
    loaded = load_model(tmp_path / "qwen3-embedding", device="cpu")
    assert (loaded.kind, loaded.args.family, loaded.args.pooled, loaded.chat_format) == ("embedding", "qwen3", True, None)
    embedder = Embedder(loaded)
    assert (embedder.pooling.mode, embedder.pooling.normalize, embedder.max_tokens) == ("last", True, 32)
    texts = ["a", "The quick brown fox jumps over the lazy dog.", "Once upon a time " * 12, "東京 😀"]
    for text in texts[:2]:  # the end of text after every input, as the tokenizer's post-processor puts it
        assert embedder.text_ids(text, truncate=True) == tokenizer(text, truncation=True, max_length=32)["input_ids"]
    ours = torch.stack([e.vector for e in embedder.embed([embedder.text_ids(t, truncate=True) for t in texts])])
    expected = reference_embeddings(model, tokenizer, texts, pooling="lasttoken", normalize=True, max_length=32)
    assert _cosines(ours, expected).min() > 0.9999
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)
    # A query after its instruction, as sentence-transformers' encode(prompt_name="query") reads it
    # (at the model's whole length: the instruction alone is longer than 32 of these tokens).
    embedder = Embedder(replace(loaded, pooling=replace(loaded.pooling, max_tokens=128)))
    prompt = embedder.prompt("query")
    assert prompt == QWEN3_EMBEDDING_PROMPTS["query"] and embedder.prompt(None) == embedder.prompt("document") == ""
    ids = [embedder.text_ids(t, truncate=True, prompt=prompt) for t in texts]
    assert 32 < len(ids[1]) < 128
    ours = torch.stack([e.vector for e in embedder.embed(ids)])
    expected = reference_embeddings(model, tokenizer, [prompt + t for t in texts], pooling="lasttoken",
                                    normalize=True, max_length=128)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(EmbeddingInputError, match=r"prompt_name 'passage' is not one of the model's prompts "
                                                  r"\('query', 'document'\)"):
        embedder.prompt("passage")
    # The command's --prompt-name: the query's prompt before each line, cut at the folder's 32 tokens.
    from builders_embeddings import embed_cli

    status, out, err = embed_cli(monkeypatch, capsys, "embed", "-m", str(tmp_path / "qwen3-embedding"),
                                 "--prompt-name", "query", *texts[:2])
    assert status == 0, err
    short = Embedder(loaded)
    expected = short.embed([short.text_ids(t, truncate=True, prompt=prompt) for t in texts[:2]])
    torch.testing.assert_close(torch.tensor([json.loads(line)["embedding"] for line in out.splitlines()]),
                               torch.stack([e.vector for e in expected]))


def test_a_qwen3_gguf_file_with_a_pooling_type_embeds_at_its_last_token(tmp_path, sp_model_path):
    import sentencepiece as spm
    from builders_families import hf_family_model, write_family_gguf

    vocab = spm.SentencePieceProcessor(model_file=str(sp_model_path)).vocab_size()
    hf = hf_family_model("qwen3", vocab, seed=9)
    path = write_family_gguf(tmp_path / "qwen3-embedding.gguf", hf, "qwen3", sp_model_path, pooling_type=3)
    loaded = load_model(path, device="cpu", max_seq_len=64)
    assert (loaded.kind, loaded.args.pooled, loaded.pooling.mode, loaded.pooling.normalize) == ("embedding", True, "last", True)
    embedder = Embedder(loaded)
    texts = ["Once upon a time", "a", "the cat sat on the mat and looked at the dog for a long while"]
    ids = [embedder.text_ids(t, truncate=True) for t in texts]
    ours = torch.stack([e.vector for e in embedder.embed(ids)])
    with torch.no_grad():
        expected = torch.stack([hf.model(torch.tensor([i])).last_hidden_state[0, -1] for i in ids])
    torch.testing.assert_close(ours, torch.nn.functional.normalize(expected, dim=-1), atol=1e-5, rtol=1e-4)


def test_ollamas_and_langchains_clients_get_the_same_vectors(embedding_server):
    import ollama
    from langchain_openai import OpenAIEmbeddings

    texts = TEXTS[:3]
    reference = torch.tensor([d.embedding for d in embedding_server.client().embeddings.create(
        model="tiny-st", input=texts, encoding_format="float").data])
    by_ollama = ollama.Client(host=embedding_server.url).embed(model="tiny-st", input=texts)
    torch.testing.assert_close(torch.tensor(by_ollama.embeddings), reference)
    # LangChain sends tiktoken's ids unless told to send the texts: a local model has its own vocabulary.
    langchain = OpenAIEmbeddings(model="tiny-st", base_url=f"{embedding_server.url}/v1", api_key="none",
                                 check_embedding_ctx_length=False)
    torch.testing.assert_close(torch.tensor(langchain.embed_documents(texts)), reference)
    torch.testing.assert_close(torch.tensor(langchain.embed_query(texts[1])), reference[1])


# -- the command line ------------------------------------------------------------------------------


def test_llama_chat_embed_writes_a_json_line_per_text_or_an_npy_array(st_folder, tmp_path, monkeypatch, capsys):
    import numpy as np
    from builders_embeddings import embed_cli
    from cli_support import run_cli

    folder, model, tokenizer = st_folder
    texts = TEXTS[:3]
    expected = reference_embeddings(model, tokenizer, texts, pooling="mean", normalize=True, max_length=MAX_LENGTH)
    proc = run_cli("embed", "-m", str(folder), *texts)
    assert proc.returncode == 0, proc.stderr.decode()
    lines = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2]
    torch.testing.assert_close(torch.tensor([line["embedding"] for line in lines]), expected, atol=1e-5, rtol=1e-4)
    out = tmp_path / "vectors.npy"  # the lines of stdin this time, in this process: the process adds nothing new
    status, stdout, err = embed_cli(monkeypatch, capsys, "embed", "-m", str(folder), "-o", str(out),
                                    "--dimensions", "8", stdin="\n".join(texts) + "\n\n")
    assert status == 0 and stdout == "", err
    saved = torch.from_numpy(np.load(out))
    torch.testing.assert_close(saved, torch.nn.functional.normalize(expected[:, :8], dim=-1), atol=1e-5, rtol=1e-4)


def test_llama_chat_embed_shows_its_progress_on_a_terminal_only(st_folder, monkeypatch, capsys):
    from builders_embeddings import embed_cli

    texts = "".join(f"{TEXTS[i % 3]} {i}\n" for i in range(300))
    status, out, err = embed_cli(monkeypatch, capsys, "embed", "-m", str(st_folder[0]), stdin=texts, terminal=True)
    assert status == 0 and len(out.splitlines()) == 300
    assert "300/300 texts" in err and err.startswith("\r\x1b[K[") and err.endswith("\r\x1b[K")  # drawn, then gone
    status, out, err = embed_cli(monkeypatch, capsys, "embed", "-m", str(st_folder[0]), stdin=texts)
    assert status == 0 and len(out.splitlines()) == 300 and "texts" not in err


def test_llama_chat_rerank_ranks_the_lines_of_stdin(cross_encoder):
    from builders_embeddings import reference_scores
    from cli_support import run_cli

    folder, model, tokenizer = cross_encoder
    documents = [d for d in DOCUMENTS if "\n" not in d]
    proc = run_cli("rerank", "-m", str(folder), "--query", QUERY, "--top-n", "3",
                   stdin="\n".join(documents).encode())
    assert proc.returncode == 0, proc.stderr.decode()
    lines = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    expected = reference_scores(model, tokenizer, QUERY, documents, max_length=20)
    order = sorted(range(len(documents)), key=lambda i: -float(expected[i]))[:3]
    assert [line["index"] for line in lines] == order
    assert [line["document"] for line in lines] == [documents[i] for i in order]
    torch.testing.assert_close(torch.tensor([line["relevance_score"] for line in lines]), expected[order],
                               atol=1e-5, rtol=1e-4)


def test_embed_and_rerank_refuse_bad_input_in_one_line(st_folder, cross_encoder, tiny_meta_dir, monkeypatch,
                                                        capsys):
    from builders_embeddings import embed_cli
    from cli_support import run_cli

    # The real process once: the exit status and stderr as a user's shell sees them.
    proc = run_cli("embed", "-m", str(tiny_meta_dir), "hi")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and proc.stdout == b"" and err.count("\n") == 1 and "Traceback" not in err, err
    assert "is a chat model: it generates text; give -m an embedding model" in err
    st, ce = str(st_folder[0]), str(cross_encoder[0])
    # And the other way round: the commands that generate, given a model that writes no text.
    for args, said in ((("-m", st, "-p", "hi", "-n", "2", "--no-stdin"), "is an embedding model, which writes no text"),
                       (("-m", ce, "--batch", "-"), "is a reranker, which writes no text: use `llama-chat rerank`")):
        proc = run_cli(*args, stdin=b"hi\n")
        err = proc.stderr.decode()
        assert proc.returncode == 2 and proc.stdout == b"" and err.count("\n") == 1 and said in err, (args, err)
    # The rest in this process, run as the process runs them: each its own line and status.
    for args, stdin, message in (
            (("embed", "-m", ce, "hi"), "", "is a reranker"),
            (("rerank", "-m", st, "--query", "q"), "a\n", "is an embedding model"),
            (("embed", "-m", st), "\n\n", "stdin: no text to read"),
            (("embed", "-m", st, "a", ""), "", "text 2 is an empty string"),
            (("rerank", "-m", ce, "--query", "q"), "", "stdin: no text to read"),
            (("embed", "-m", st, "--no-truncate", TEXTS[3]), "",
             "text 1 is 62 tokens long; the model takes at most 24"),
            (("embed", "-m", st, "--dimensions", "33", "a"), "", "--dimensions must be from 1 to 32"),
            (("embed", "-m", st, "--dimensions", "0", "a"), "", "greater than or equal to 1"),
            (("embed", "-m", st, "--prompt-name", "query", "a"), "", "--prompt-name 'query' is not one of the "
                                                                     "model's prompts (none)"),
            (("embed", "-m", st, "--pooling", "max", "a"), "", "--pooling must be mean, cls or last"),
            (("embed", "-m", st, "-o", "vectors.txt", "a"), "", "expected a .npy file name"),
            (("rerank", "-m", ce, "--query", ""), "a\n", "--query is an empty string"),
            (("rerank", "-m", ce, "--query", "q", "--instruction", "x"), "a\n", "--instruction is for a decoder "
                                                                               "reranker")):
        status, out, err = embed_cli(monkeypatch, capsys, *args, stdin=stdin)
        assert status == 2 and out == "", (args, err)
        assert err.count("\n") == 1 and message in err and "Traceback" not in err, (args, err)

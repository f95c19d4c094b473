"""A chat model, a decoder embedder and a decoder reranker behind one ``serve`` process
(``-m NAME=MODEL`` each): each answers what it is for and refuses the rest in a 400, a query
prompt asked for by name or by Cohere's and Jina's words, Qwen3-Reranker's scores through Cohere's
client and in Jina's shape, and a chat stream that keeps streaming while embeddings are made."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import torch

from builders_embeddings import (QWEN3_EMBEDDING_PROMPTS, reference_decoder_scores, reference_embeddings,
                                 save_qwen3_embedder, save_qwen3_reranker, thread_niceness)
from llama_chat.inference.embedding import BESIDE_CHAT_NICENESS
from serve_support import WAIT_S, start_server, stop_server, wait_for

QUERY = "the quick fox"
DOCUMENTS = ["a", "The fox liked to play with the rabbit and the bird near the river.", "東京は大きな都市です 😀",
             "Once upon a time there was a little fox who lived in the forest."]
POSITIONS = 384


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_meta_dir):
    root = tmp_path_factory.mktemp("several")
    embedder = save_qwen3_embedder(root / "emb", seed=21, max_seq_length=POSITIONS)
    reranker = save_qwen3_reranker(root / "rr", seed=22, positions=POSITIONS)
    server = start_server(f"chat={tiny_meta_dir}", "-m", f"emb={root / 'emb'}", "-m", f"rr={root / 'rr'}")
    yield server, embedder, reranker
    assert stop_server(server) == 0, server.log()


def _vectors(reply) -> torch.Tensor:
    return torch.tensor([d.embedding for d in reply.data])


def test_a_query_prompt_by_name_or_by_the_part_the_input_plays(models):
    server, (model, tokenizer), _ = models
    client = server.client()
    texts = DOCUMENTS[:3]
    plain = _vectors(client.embeddings.create(model="emb", input=texts, encoding_format="float"))
    expected = reference_embeddings(model, tokenizer, texts, pooling="lasttoken", normalize=True, max_length=POSITIONS)
    torch.testing.assert_close(plain, expected, atol=1e-5, rtol=1e-4)
    prompt = QWEN3_EMBEDDING_PROMPTS["query"]
    expected = reference_embeddings(model, tokenizer, [prompt + t for t in texts], pooling="lasttoken",
                                    normalize=True, max_length=POSITIONS)
    for extra in ({"prompt_name": "query"}, {"input_type": "search_query"}, {"task": "retrieval.query"}):
        asked = _vectors(client.embeddings.create(model="emb", input=texts, encoding_format="float", extra_body=extra))
        torch.testing.assert_close(asked, expected, atol=1e-5, rtol=1e-4)
    # A part the model has no prompt for means none; a prompt named outright must be the model's.
    document = _vectors(client.embeddings.create(model="emb", input=texts, encoding_format="float",
                                                 extra_body={"input_type": "classification"}))
    torch.testing.assert_close(document, plain)
    refused = httpx.post(f"{server.url}/v1/embeddings", timeout=WAIT_S,
                         json={"model": "emb", "input": "a", "prompt_name": "passage"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_name", refused.text
    ollama = httpx.post(f"{server.url}/api/embed", timeout=WAIT_S,
                        json={"model": "emb", "input": texts, "prompt_name": "query"}).json()
    torch.testing.assert_close(torch.tensor(ollama["embeddings"]), expected, atol=1e-5, rtol=1e-4)


def test_qwen3_reranker_through_cohere_and_jinas_shape(models):
    import cohere

    server, _, (model, tokenizer) = models
    expected = reference_decoder_scores(model, tokenizer, QUERY, DOCUMENTS, max_length=POSITIONS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -float(expected[i]))
    reply = cohere.ClientV2(base_url=server.url, api_key="none").rerank(model="rr", query=QUERY, documents=DOCUMENTS,
                                                                       top_n=3)
    assert [r.index for r in reply.results] == order[:3]
    torch.testing.assert_close(torch.tensor([r.relevance_score for r in reply.results]), expected[order[:3]],
                               atol=1e-5, rtol=0)
    instruction = "Find the passage about animals"
    jina = httpx.post(f"{server.url}/v1/rerank", timeout=WAIT_S, json={
        "model": "rr", "query": QUERY, "documents": DOCUMENTS, "instruction": instruction}).json()
    told = reference_decoder_scores(model, tokenizer, QUERY, DOCUMENTS, max_length=POSITIONS, instruction=instruction)
    got = {r["index"]: r["relevance_score"] for r in jina["results"]}
    torch.testing.assert_close(torch.tensor([got[i] for i in range(len(DOCUMENTS))]), told, atol=1e-5, rtol=0)
    for body, param in (({"query": QUERY, "documents": []}, "documents"),
                        ({"query": QUERY, "documents": ["a"], "instruction": ""}, "instruction"),
                        ({"query": QUERY, "documents": ["a"], "instruction": 3}, "instruction")):
        response = httpx.post(f"{server.url}/rerank", json={"model": "rr", **body}, timeout=WAIT_S)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_each_model_refuses_what_it_is_not_for_and_lists_its_kind(models):
    server = models[0]
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="chat", input="hello")
    assert "is a chat model" in e.value.message
    refused = httpx.post(f"{server.url}/api/embed", json={"model": "chat", "input": "hello"}, timeout=WAIT_S)
    assert refused.status_code == 400 and "is a chat model" in refused.json()["error"]
    for name, kind in (("emb", "an embedding model"), ("rr", "a reranker")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
        assert f"is {kind}" in e.value.message
    rank = httpx.post(f"{server.url}/v1/rerank", json={"model": "emb", "query": "a", "documents": ["b"]},
                      timeout=WAIT_S)
    assert rank.status_code == 400 and "is an embedding model" in rank.json()["error"]["message"]
    kinds = {m.id: getattr(m, "kind", None) for m in client.models.list().data}
    assert kinds == {"chat": "chat", "emb": "embedding", "rr": "rerank"}


def test_a_chat_stream_keeps_streaming_while_embeddings_are_made(models):
    server = models[0]
    client = server.client()
    request = dict(model="chat", prompt="Once upon a time", max_tokens=48, temperature=0, seed=1)
    alone = client.completions.create(**request).choices[0].text
    stop, in_flight = threading.Event(), threading.Event()
    made = []

    def embed() -> None:
        while not stop.is_set():
            in_flight.set()
            made.append(len(client.embeddings.create(model="emb", input=DOCUMENTS * 8, encoding_format="float").data))
            in_flight.clear()

    worker = threading.Thread(target=embed)
    worker.start()
    pieces, beside = [], 0
    try:
        wait_for(lambda: made, "a first embedding reply")
        for chunk in client.completions.create(**request, stream=True):
            pieces.append(chunk.choices[0].text)
            beside += in_flight.is_set()  # this piece came while an embedding request was being answered
    finally:
        stop.set()
        worker.join(WAIT_S)
    assert "".join(pieces) == alone and len(pieces) > 1
    assert beside > 0 and set(made) == {len(DOCUMENTS) * 8}
    # The embedding rounds' thread yields to the decode: its niceness, and the threads it started.
    assert max(thread_niceness(server.proc.pid)) == BESIDE_CHAT_NICENESS

"""Several models behind one ``llama-chat serve``: loaded when a request names them, unloaded when
idle, when asked, or to make room under ``--models-max``.

Two servers of tiny random models: a pair (``tiny`` and ``b``, both may be loaded, beside an
embedding model and a folder that fails to load) and one slot (``small`` and ``big``,
``--models-max 1``, no queue), where ``small`` is ``tiny``'s files and ``big`` is large enough for
its unload to show in the server's resident memory. Every wait is for a condition,
with a generous bound: the machine is busy.
"""

from __future__ import annotations

import concurrent.futures
import math
from pathlib import Path

import httpx
import openai
import pytest
import torch

from builders import random_model, tiny_args, train_sentencepiece, write_meta_checkpoint
from builders_embeddings import save_bert
from cli_support import STOP_IDS, build_tiny_model, run_cli
from llama_chat.cmd.models import keep_alive_seconds, split_alias
from serve_support import WAIT_S, start_server, stop_server, wait_for

CONTEXT = 1024
ASK = [{"role": "user", "content": "Tell me about the fox"}]


def _other_model(out_dir: Path, *, seed: int, **sizes) -> Path:
    """A random model unlike ``build_tiny_model``'s (another seed, other sizes), that never ends on its own."""
    tok = train_sentencepiece(out_dir / "spm", vocab_size=512)
    model = random_model(tiny_args(512, max_seq_len=CONTEXT, **sizes), seed=seed)
    with torch.no_grad():
        model.output.weight[list(STOP_IDS)] = 0.0
    write_meta_checkpoint(model, out_dir / "model", tok)
    return out_dir / "model"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    a = build_tiny_model(tmp_path_factory.mktemp("a"), max_seq_len=CONTEXT).path
    b = _other_model(tmp_path_factory.mktemp("b"), seed=11)
    # About a hundred megabytes of weights: their going is plain in the process's resident memory.
    big = _other_model(tmp_path_factory.mktemp("big"), seed=5, dim=512, n_layers=8, n_heads=8, n_kv_heads=4,
                       hidden_dim=1536)
    return a, b, big


@pytest.fixture(scope="module")
def pair(files, tmp_path_factory):
    a, b, _ = files
    embed = tmp_path_factory.mktemp("embed") / "st"
    save_bert(embed)
    broken = tmp_path_factory.mktemp("broken")
    (broken / "params.json").write_text('{"dim": ')
    s = start_server(a, "-m", f"b={b}", "-m", f"embed={embed}", "-m", f"broken={broken}", "--max-batch", "4")
    yield s
    assert stop_server(s) == 0, s.log()


@pytest.fixture(scope="module")
def one_slot(files):
    a, _, big = files
    # start_server's -m comes first: name it by its folder, "tiny"; then the two named ones.
    s = start_server(a, "-m", f"small={a}", "-m", f"big={big}", "--models-max", "1", "--queue-limit", "0")
    yield s
    assert stop_server(s) == 0, s.log()


def statuses(server) -> dict[str, str]:
    response = httpx.get(f"{server.url}/v1/models", timeout=WAIT_S)
    assert response.status_code == 200, response.text
    return {m["id"]: m["status"] for m in response.json()["data"]}


def reply(server, model: str, max_tokens: int = 8) -> str:
    answer = server.client().chat.completions.create(model=model, messages=ASK, max_tokens=max_tokens, temperature=0)
    assert answer.model == model and answer.choices[0].finish_reason == "length"
    return answer.choices[0].message.content


def resident_bytes(server) -> int:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


# -- names and durations, without a server -------------------------------------------------------


@pytest.mark.parametrize("value,seconds", [
    (0, 0.0), (30, 30.0), (2.5, 2.5), ("300", 300.0), ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25),
    ("1.5s", 1.5), (-1, math.inf), ("-1", math.inf), ("-5m", math.inf)])
def test_keep_alive_is_read_as_ollama_reads_it(value, seconds):
    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["soon", "", "m5", "5 m", "5mm", "5x", True, None, [5], "nan"])
def test_a_keep_alive_that_is_not_a_duration_is_refused(value):
    with pytest.raises(ValueError, match="keep_alive"):
        keep_alive_seconds(value)


def test_a_name_is_given_before_an_equals_sign(tmp_path):
    assert split_alias("coder=path/to/file.gguf") == ("coder", "path/to/file.gguf")
    assert split_alias("qwen2.5:7b=ollama:qwen2.5:7b") == ("qwen2.5:7b", "ollama:qwen2.5:7b")
    assert split_alias("ollama:qwen2.5") == (None, "ollama:qwen2.5")
    odd = tmp_path / "a=b"
    odd.mkdir()
    assert split_alias(str(odd)) == (None, str(odd))  # a path that holds "=" is a path
    assert split_alias("=x")[0] is None and split_alias("x=")[0] is None


def test_two_models_under_one_name_or_a_missing_one_are_one_line_at_start(files):
    a = str(files[0])
    twice = run_cli("serve", "-m", a, "-m", f"tiny={files[1]}", "--port", "0")
    assert twice.returncode == 2 and b"two models are named 'tiny'" in twice.stderr, twice.stderr
    missing = run_cli("serve", "-m", a, "-m", "gone=/nonexistent/model.gguf", "--port", "0")
    assert missing.returncode == 2 and b"/nonexistent/model.gguf" in missing.stderr, missing.stderr
    assert len(missing.stderr.decode().strip().splitlines()) == 1
    bad = run_cli("serve", "-m", a, "--keep-alive", "soon")
    assert bad.returncode == 2 and b"keep_alive" in bad.stderr


# -- the pair -----------------------------------------------------------------------------------


def test_models_are_listed_unloaded_then_loaded_on_demand(pair):
    assert statuses(pair) == {"tiny": "unloaded", "b": "unloaded", "embed": "unloaded", "broken": "unloaded"}
    assert "each loaded when a request names it" in pair.log()
    reply(pair, "b")
    listed = {m["id"]: m for m in httpx.get(f"{pair.url}/v1/models", timeout=WAIT_S).json()["data"]}
    assert listed["b"]["status"] == "loaded" and listed["b"]["kind"] == "chat"
    assert listed["b"]["context_length"] == CONTEXT
    assert listed["tiny"]["status"] == "unloaded"
    one = httpx.get(f"{pair.url}/v1/models/b", timeout=WAIT_S).json()
    assert one["id"] == "b" and one["status"] == "loaded"


def test_requests_alternating_between_models_are_each_answered_by_their_own(pair):
    first = {name: reply(pair, name) for name in ("tiny", "b")}
    assert first["tiny"] != first["b"]  # two random models: their greedy replies differ
    for name in ("b", "tiny", "b", "tiny"):
        assert reply(pair, name) == first[name]
    assert statuses(pair)["tiny"] == statuses(pair)["b"] == "loaded"
    # A request that names no model goes to the first one.
    whole = httpx.post(f"{pair.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 8, "temperature": 0},
                       timeout=WAIT_S).json()
    assert whole["model"] == "tiny" and whole["choices"][0]["message"]["content"] == first["tiny"]


def test_concurrent_streams_to_both_models_finish(pair):
    def stream(model: str) -> tuple[str, str]:
        chunks = pair.client().chat.completions.create(model=model, messages=ASK, max_tokens=24, stream=True)
        text, finish = [], None
        for chunk in chunks:
            assert chunk.model == model
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(text), finish

    names = ["tiny", "b"] * 4
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        results = list(pool.map(stream, names))
    assert all(finish == "length" and text for text, finish in results), results


def test_an_unknown_model_is_a_404_that_names_the_models(pair):
    with pytest.raises(openai.NotFoundError) as caught:
        pair.client().chat.completions.create(model="gpt-4o-mini", messages=ASK, max_tokens=4)
    error = caught.value.body
    assert error["code"] == "model_not_found" and "'tiny'" in error["message"] and "'b'" in error["message"]
    ollama = httpx.post(f"{pair.url}/api/chat", json={"model": "nope", "messages": ASK}, timeout=WAIT_S)
    assert ollama.status_code == 404 and "'b'" in ollama.json()["error"]
    assert httpx.get(f"{pair.url}/v1/models/nope", timeout=WAIT_S).status_code == 404
    unload = httpx.post(f"{pair.url}/models/unload", json={"model": "nope"}, timeout=WAIT_S)
    assert unload.status_code == 404 and unload.json()["error"]["code"] == "model_not_found"


def test_keep_alive_zero_unloads_at_once_and_a_duration_later(pair):
    generate = {"model": "b", "prompt": "Once upon", "stream": False, "options": {"num_predict": 4}}
    answer = httpx.post(f"{pair.url}/api/generate", json={**generate, "keep_alive": 0}, timeout=WAIT_S)
    assert answer.status_code == 200, answer.text
    wait_for(lambda: statuses(pair)["b"] == "unloaded", "b to unload")
    assert "unloading model 'b': idle past its keep-alive" in pair.log()
    answer = httpx.post(f"{pair.url}/api/generate", json={**generate, "keep_alive": "1s"}, timeout=WAIT_S)
    assert answer.status_code == 200, answer.text
    wait_for(lambda: statuses(pair)["b"] == "unloaded", "b to unload after its keep-alive")
    bad = httpx.post(f"{pair.url}/api/generate", json={**generate, "keep_alive": "soon"}, timeout=WAIT_S)
    assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]


def test_load_unload_and_ollamas_ps(pair):
    loaded = httpx.post(f"{pair.url}/models/load", json={"model": "b"}, timeout=WAIT_S)
    assert loaded.status_code == 200 and loaded.json()["status"] == "loaded", loaded.text
    running = httpx.get(f"{pair.url}/api/ps", timeout=WAIT_S).json()["models"]
    assert "b" in [m["name"] for m in running]
    assert all(m["expires_at"].endswith("Z") and m["context_length"] == CONTEXT for m in running)
    assert pair.metrics()['llama_chat_model_loaded{model="b"}'] == 1
    tags = {m["name"] for m in httpx.get(f"{pair.url}/api/tags", timeout=WAIT_S).json()["models"]}
    assert tags == {"tiny", "b", "embed", "broken"}
    unloaded = httpx.post(f"{pair.url}/models/unload", json={"model": "b"}, timeout=WAIT_S)
    assert unloaded.status_code == 200 and unloaded.json()["status"] == "unloaded", unloaded.text
    assert statuses(pair)["b"] == "unloaded"
    metrics = pair.metrics()
    assert metrics['llama_chat_model_loaded{model="b"}'] == 0
    assert metrics['llama_chat_model_jobs_running{model="b"}'] == 0 and metrics["llama_chat_ready"] == 1
    assert "b" not in [m["name"] for m in httpx.get(f"{pair.url}/api/ps", timeout=WAIT_S).json()["models"]]


def test_ollamas_stop_unloads_without_loading(pair):
    stop = {"model": "b", "keep_alive": 0}
    loads = pair.log().count(": loading model 'b'")
    httpx.post(f"{pair.url}/models/load", json={"model": "b"}, timeout=WAIT_S).raise_for_status()
    said = httpx.post(f"{pair.url}/api/generate", json=stop, timeout=WAIT_S).json()
    assert said["done"] and said["done_reason"] == "unload" and said["model"] == "b"
    wait_for(lambda: statuses(pair)["b"] == "unloaded", "b to unload")
    said = httpx.post(f"{pair.url}/api/chat", json=stop, timeout=WAIT_S).json()  # not loaded: stays so
    assert said["done_reason"] == "unload" and said["message"]["content"] == ""
    assert statuses(pair)["b"] == "unloaded" and pair.log().count(": loading model 'b'") == loads + 1


def test_an_embedding_model_beside_the_chat_models(pair):
    got = pair.client().embeddings.create(model="embed", input=["a fox", "a lazy dog"])
    assert got.model == "embed" and len(got.data) == 2 and len(got.data[0].embedding) > 1
    with pytest.raises(openai.BadRequestError):
        pair.client().chat.completions.create(model="embed", messages=ASK, max_tokens=4)
    listed = {m["id"]: m for m in httpx.get(f"{pair.url}/v1/models", timeout=WAIT_S).json()["data"]}
    assert listed["embed"]["status"] == "loaded" and listed["embed"]["kind"] == "embedding"


def test_a_model_that_fails_to_load_is_a_500_naming_it_and_the_others_go_on(pair):
    with pytest.raises(openai.InternalServerError) as caught:
        pair.client().chat.completions.create(model="broken", messages=ASK, max_tokens=4)
    error = caught.value.body
    assert error["code"] == "model_load_failed" and "'broken'" in error["message"]
    assert "unknown model layout" in error["message"]  # the loader's own words on the folder
    assert statuses(pair)["broken"] == "unloaded"
    assert reply(pair, "b")


# -- one slot -----------------------------------------------------------------------------------


def test_one_slot_a_switch_unloads_the_other_and_gives_its_memory_back(one_slot, pair, files):
    assert reply(one_slot, "small") == reply(pair, "tiny")  # the same files, the same greedy reply
    reply(one_slot, "big")
    assert statuses(one_slot) == {"tiny": "unloaded", "small": "unloaded", "big": "loaded"}
    with_big = resident_bytes(one_slot)
    reply(one_slot, "small")
    assert statuses(one_slot) == {"tiny": "unloaded", "small": "loaded", "big": "unloaded"}
    assert "unloading model 'big': to make room for 'small' (--models-max 1)" in one_slot.log()
    assert "unloaded model 'big'" in one_slot.log()
    weights = sum(f.stat().st_size for f in files[2].iterdir() if f.suffix == ".pth")
    fallen = with_big - resident_bytes(one_slot)
    assert fallen >= 0.8 * weights, (fallen, weights)


def test_one_slot_busy_is_a_503_and_a_model_is_never_unloaded_under_its_jobs(one_slot):
    running = one_slot.client().chat.completions.create(model="big", messages=ASK, max_tokens=CONTEXT - 64,
                                                        stream=True)
    next(iter(running))  # its job is generating
    refused = httpx.post(f"{one_slot.url}/v1/chat/completions",
                         json={"model": "small", "messages": ASK, "max_tokens": 4}, timeout=WAIT_S)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "models_busy", refused.text
    assert int(refused.headers["retry-after"]) > 0
    assert statuses(one_slot)["big"] == "loaded"
    running.close()  # the client goes away: its job is cancelled, and the slot is free

    def answered() -> bool:
        response = httpx.post(f"{one_slot.url}/v1/chat/completions",
                              json={"model": "small", "messages": ASK, "max_tokens": 4}, timeout=WAIT_S)
        assert response.status_code in (200, 503), response.text
        return response.status_code == 200

    wait_for(answered, "the slot to be free", every=0.5)
    assert statuses(one_slot)["big"] == "unloaded"


# -- one model ------------------------------------------------------------------------------------


def test_one_model_with_a_name_is_served_as_before_under_it(files, pair):
    server = start_server(f"solo={files[0]}")
    try:
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=WAIT_S).json()["data"]] == ["solo"]
        # A one-model server's greedy reply is the one its files give among several.
        assert reply(server, "solo") == reply(pair, "tiny")
        # Any name is answered by the one model, which the response names.
        answer = server.client().chat.completions.create(model="gpt-4o-mini", messages=ASK, max_tokens=4)
        assert answer.model == "solo"
        refused = httpx.post(f"{server.url}/models/load", json={"model": "solo"}, timeout=WAIT_S)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "one_model", refused.text
    finally:
        assert stop_server(server) == 0, server.log()


def test_a_models_dir_serves_every_model_in_it_beside_the_m_ones(files, tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "beta").symlink_to(files[1], target_is_directory=True)
    (folder / "README.md").write_text("not a model\n")
    server = start_server(files[0], "--models-dir", str(folder))
    try:
        assert statuses(server) == {"tiny": "unloaded", "beta": "unloaded"}
        assert reply(server, "beta")
        assert statuses(server)["beta"] == "loaded"
    finally:
        assert stop_server(server) == 0, server.log()
    (folder / "beta").unlink()
    empty = run_cli("serve", "--models-dir", str(folder), "--port", "0")
    assert empty.returncode == 2 and b"no model in it" in empty.stderr, empty.stderr

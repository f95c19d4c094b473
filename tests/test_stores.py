"""Models by name: a fake Hugging Face cache and a fake Ollama store, built here, resolve offline;
``--list`` shows them; missing models say how to get them.

The cache is laid out as ``huggingface_hub`` writes it (``models--org--name/{blobs,refs,snapshots}``,
snapshot files as links to blobs named by their hash) and the store as Ollama does
(``manifests/registry.ollama.ai/library/NAME/TAG`` JSON naming ``blobs/sha256-HEX``).
"""

from __future__ import annotations

import hashlib
import json
import os
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("huggingface_hub")

from builders import random_model, tiny_args, train_sentencepiece  # noqa: E402
from builders_formats import hf_config, hf_state, write_hf_checkpoint  # noqa: E402
from builders_gguf import write_gguf  # noqa: E402
from cli_support import run_cli  # noqa: E402
from llama_chat.model.errors import ModelLoadError  # noqa: E402
from llama_chat.model.loader import load_model  # noqa: E402
from llama_chat.model.stores import default_model_dir, hf_cache_dir, list_models, resolve_model  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    sp = train_sentencepiece(out / "spm", vocab_size=400)
    import sentencepiece as spm

    model = random_model(tiny_args(spm.SentencePieceProcessor(model_file=str(sp)).vocab_size()), seed=5)
    hf_dir = write_hf_checkpoint(model, out / "hf", sp)
    gguf_file = write_gguf(out / "tiny.gguf", hf_state(model), hf_config(model), sp_model=sp)
    return model, hf_dir, gguf_file


def make_hf_cache(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """One repository in a Hugging Face cache, as huggingface_hub lays it out; the snapshot path."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    return snapshot


def make_ollama_store(store: Path, name: str, tag: str, gguf_bytes: bytes, *, namespace: str = "library",
                      digest: str | None = None) -> Path:
    """One model in an Ollama store: its manifest and blobs; the model blob's path."""
    hexdigest = hashlib.sha256(gguf_bytes).hexdigest()
    blobs = store / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    blob = blobs / f"sha256-{hexdigest}"
    blob.write_bytes(gguf_bytes)
    template = b"{{ .Prompt }}"
    (blobs / f"sha256-{hashlib.sha256(template).hexdigest()}").write_bytes(template)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": "sha256:" + "0" * 64, "size": 2},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.model", "digest": digest or f"sha256:{hexdigest}",
             "size": len(gguf_bytes)},
            {"mediaType": "application/vnd.ollama.image.template",
             "digest": f"sha256:{hashlib.sha256(template).hexdigest()}", "size": len(template)},
        ],
    }
    path = store / "manifests" / "registry.ollama.ai" / namespace / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return blob


@pytest.fixture
def stores(tmp_path, monkeypatch, tiny):
    """A Hugging Face cache with an HF-layout repo and a GGUF repo, and an Ollama store."""
    _, hf_dir, gguf_file = tiny
    cache = tmp_path / "hf-home" / "hub"
    make_hf_cache(cache, "acme/tiny-llama", {p.name: p.read_bytes() for p in hf_dir.iterdir()})
    make_hf_cache(cache, "acme/tiny-llama-GGUF", {"tiny.Q8_0.gguf": gguf_file.read_bytes(), "README.md": b"hi"})
    store = tmp_path / "ollama"
    blob = make_ollama_store(store, "tiny", "latest", gguf_file.read_bytes())
    make_ollama_store(store, "tiny", "q8", gguf_file.read_bytes(), namespace="someone")
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    return cache, store, blob


def test_hub_ids_resolve_from_the_cache_offline(stores, tiny):
    model, _, _ = tiny
    cache, _, _ = stores
    assert hf_cache_dir() == cache  # HF_HOME/hub
    found = resolve_model("acme/tiny-llama")
    assert found.source == "hf" and found.name == "acme/tiny-llama"
    assert found.path == cache / "models--acme--tiny-llama" / "snapshots" / COMMIT
    loaded = load_model(found.path, device="cpu", name=found.name)
    assert loaded.layout == "hf" and loaded.name == "acme/tiny-llama"
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.inference_mode():
        torch.testing.assert_close(loaded.model(ids), model(ids), atol=1e-4, rtol=0)
    # A repository of one GGUF file resolves to it.
    gguf_repo = resolve_model("acme/tiny-llama-GGUF")
    assert load_model(gguf_repo.path, device="cpu").layout == "gguf"


def test_hf_hub_cache_wins_over_hf_home(stores, monkeypatch, tmp_path):
    cache, _, _ = stores
    other = tmp_path / "elsewhere"
    make_hf_cache(other, "acme/other", {"config.json": b"{}", "model.safetensors": b"x"})
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert resolve_model("acme/other").path == other / "models--acme--other" / "snapshots" / COMMIT
    with pytest.raises(ModelLoadError, match="acme/tiny-llama: not in the Hugging Face cache"):
        resolve_model("acme/tiny-llama")


def test_ollama_names_resolve_through_manifests(stores, tiny):
    model, _, _ = tiny
    _, store, blob = stores
    for spec in ("ollama:tiny", "ollama:tiny:latest", "ollama:library/tiny:latest"):
        found = resolve_model(spec)
        assert (found.path, found.name, found.source) == (blob, "tiny:latest", "ollama")
    other = resolve_model("ollama:someone/tiny:q8")
    assert other.name == "someone/tiny:q8"
    loaded = load_model(other.path, device="cpu", name=other.name)
    assert loaded.layout == "gguf" and loaded.name == "someone/tiny:q8"
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.inference_mode():
        torch.testing.assert_close(loaded.model(ids), model(ids), atol=1e-4, rtol=0)


def test_missing_models_say_how_to_get_them(stores):
    cache, store, _ = stores
    with pytest.raises(ModelLoadError) as info:
        resolve_model("acme/missing")
    assert str(info.value) == (f"acme/missing: not in the Hugging Face cache ({cache}); fetch it with "
                               "`llama-chat -m acme/missing --download`")
    with pytest.raises(ModelLoadError) as info:
        resolve_model("ollama:llama3.2")
    assert str(info.value) == (f"ollama:llama3.2:latest: not in Ollama's store ({store}); fetch it with "
                               "`ollama pull llama3.2`")
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set, so it cannot be downloaded"):
        resolve_model("acme/missing", download=True)
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        resolve_model("./not/here/at/all")


@pytest.mark.parametrize("spec", ["ollama:../../etc/passwd", "ollama:a/b/c/d", "ollama:tiny:", "ollama:.hidden",
                                  "ollama:tiny:../x"])
def test_bad_ollama_names_are_refused(stores, spec):
    with pytest.raises(ModelLoadError, match="not an Ollama model name"):
        resolve_model(spec)


def test_a_manifest_cannot_point_outside_the_blobs(stores, tiny):
    _, store, _ = stores
    _, _, gguf_file = tiny
    make_ollama_store(store, "evil", "latest", gguf_file.read_bytes(), digest="sha256:../../../../etc/passwd")
    with pytest.raises(ModelLoadError, match="digest '.*' is not 'sha256:' and 64 hex digits"):
        resolve_model("ollama:evil")
    hexdigest = "f" * 64
    make_ollama_store(store, "gone", "latest", gguf_file.read_bytes(), digest=f"sha256:{hexdigest}")
    with pytest.raises(ModelLoadError, match=f"its model blob sha256-{hexdigest} is missing"):
        resolve_model("ollama:gone")


def test_list_shows_both_stores(stores):
    models = {m.name: m for m in list_models()}
    assert set(models) == {"default", "acme/tiny-llama", "acme/tiny-llama-GGUF", "ollama:tiny:latest",
                           "ollama:someone/tiny:q8"}
    assert models["acme/tiny-llama"].format == "hf" and models["acme/tiny-llama-GGUF"].format == "gguf"
    assert models["ollama:tiny:latest"].size == models["ollama:tiny:latest"].path.stat().st_size


def test_the_command_lists_and_runs_models_by_name(stores, tmp_path):
    env = {"HF_HOME": os.environ["HF_HOME"], "HF_HUB_OFFLINE": "1", "OLLAMA_MODELS": os.environ["OLLAMA_MODELS"]}
    listed = run_cli("--list", **env)
    assert listed.returncode == 0, listed.stderr.decode()
    lines = listed.stdout.decode().splitlines()
    assert lines[0].split() == ["MODEL", "FORMAT", "SIZE", "PATH"]
    assert lines[1].split()[:2] == ["default", "meta"]  # the shipped model comes first
    assert any(line.split()[:2] == ["ollama:tiny:latest", "gguf"] for line in lines)
    assert any(line.split()[:2] == ["acme/tiny-llama", "hf"] for line in lines)
    assert any(line.endswith("snapshots/" + COMMIT) and line.startswith("acme/tiny-llama ") for line in lines)

    for spec in ("ollama:tiny", "acme/tiny-llama"):
        proc = run_cli("-m", spec, "-p", "hello", "-n", "4", "-t", "0", "--json", "--no-stdin", **env)
        assert proc.returncode == 0, proc.stderr.decode()
        result = json.loads(proc.stdout)
        assert result["model"] == ("tiny:latest" if spec.startswith("ollama") else spec)

    missing = run_cli("-m", "acme/missing", "-p", "hi", "--no-stdin", **env)
    assert missing.returncode == 2
    assert missing.stderr.decode().strip().splitlines() == [
        f"llama-chat: error: acme/missing: not in the Hugging Face cache ({stores[0]}); fetch it with "
        "`llama-chat -m acme/missing --download`"]

    empty = run_cli("--list", HF_HOME=str(tmp_path / "none"), OLLAMA_MODELS=str(tmp_path / "none2"))
    assert empty.returncode == 0 and empty.stdout.decode().splitlines()[1].split()[:2] == ["default", "meta"]
    assert empty.stderr.decode().startswith("nothing in the Hugging Face cache")


def test_the_shipped_model_is_listed_first_and_runs_by_the_name_it_is_reported_under(tmp_path):
    """--list names it `default` (with its path, format and size); -m default runs it, and --json
    reports it, with or without -m, by that same name."""
    env = {"HF_HOME": str(tmp_path / "none"), "OLLAMA_MODELS": str(tmp_path / "none2")}
    listed = run_cli("--list", **env)
    assert listed.returncode == 0, listed.stderr.decode()
    header, shipped = listed.stdout.decode().splitlines()
    name, fmt, size, unit, path = shipped.split()
    assert (name, fmt, unit) == ("default", "meta", "MB") and float(size) > 1
    assert Path(path).expanduser() == default_model_dir()
    assert (Path(path).expanduser() / "params.json").is_file()
    reported = set()
    for args in (("-m", name), ()):
        proc = run_cli(*args, "-p", "Hi", "-n", "2", "-t", "0", "--json", **env)
        assert proc.returncode == 0, proc.stderr.decode()
        reported.add(json.loads(proc.stdout)["model"])
    assert reported == {"default"}
    found = resolve_model("default")
    assert (found.path, found.name, found.source) == (default_model_dir(), "default", "shipped")


def test_download_without_a_network_fails_at_once_in_one_line(tmp_path):
    """An unreachable hub (a port nobody listens on) is one line and status 2, with none of the
    retries huggingface_hub's listing calls would make."""
    import socket

    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
        proc = run_cli("-m", "acme/not-cached", "--download", "-p", "Hi", "--no-stdin",
                       HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="0")
    lines = proc.stderr.decode().splitlines()
    assert proc.returncode == 2 and proc.stdout == b""
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"llama-chat: error: acme/not-cached: cannot download it: the Hugging Face hub "
                               f"({endpoint}) cannot be reached (") and "refused" in lines[0], lines


def test_an_incomplete_cached_copy_says_how_to_complete_it(stores):
    cache, _, _ = stores
    make_hf_cache(cache, "acme/partial", {"config.json": b"{}", "README.md": b"hi"})
    with pytest.raises(ModelLoadError, match=r"acme/partial: the cached copy \(.*\) has no config.json with "
                                             r"weights nor a GGUF file; complete it with `llama-chat -m "
                                             r"acme/partial --download`"):
        resolve_model("acme/partial")
    assert {m.name: m.format for m in list_models()}["acme/partial"] == "incomplete"


def test_download_fetches_only_what_running_needs(stores, monkeypatch, tmp_path):
    """--download, with the hub replaced by a stand-in: the files asked for, the cache used."""
    import huggingface_hub

    calls = {}

    def info(*names):
        return types.SimpleNamespace(siblings=[types.SimpleNamespace(rfilename=n) for n in names])

    class FakeApi:
        def model_info(self, repo_id, **kwargs):
            return info("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                        "model.safetensors.index.json", "pytorch_model.bin", "tokenizer.json", "README.md",
                        "original/consolidated.00.pth")

    def fake_snapshot_download(repo_id, **kwargs):
        if kwargs.get("local_files_only"):
            from huggingface_hub.errors import LocalEntryNotFoundError

            raise LocalEntryNotFoundError("not cached")
        calls.update(kwargs, repo_id=repo_id)
        return str(make_hf_cache(kwargs["cache_dir"], repo_id, {"model.gguf": b"GGUF"}))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    found = resolve_model("acme/new-model", download=True, progress=False)
    assert found.name == "acme/new-model" and found.path.name == COMMIT
    assert calls["repo_id"] == "acme/new-model" and calls["cache_dir"] == stores[0]
    assert "*.safetensors" in calls["allow_patterns"] and "pytorch_model*.bin" not in calls["allow_patterns"]
    assert "config.json" in calls["allow_patterns"] and "tokenizer.json" in calls["allow_patterns"]
    assert "tqdm_class" in calls  # no bar when stderr is not a terminal

    class GGUFOnlyApi:
        def model_info(self, repo_id, **kwargs):
            return info("a.Q4_K_M.gguf", "a.Q8_0.gguf", "README.md")

    monkeypatch.setattr(huggingface_hub, "HfApi", GGUFOnlyApi)
    with pytest.raises(ModelLoadError, match="acme/gguf-only: the repository has no Hugging Face weights"):
        resolve_model("acme/gguf-only", download=True)

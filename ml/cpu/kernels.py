"""Our own CPU matrix-vector products (``kernels.cpp``), built on first use and cached.

A decode step multiplies one row by every weight, and PyTorch's CPU kernels read the weights
well below the memory's speed, bfloat16 and int8 ones most of all on CPUs without bf16 or
AVX-512 instructions (``benchmarks/bench_cpu_kernels.py``; docs/benchmarks.md, "Products: the
operator's, MKL's and oneDNN's"). ``kernels.cpp`` is one operator,
``torch.ops.llama_chat_cpu.matvec(x, weight, scales=None)``: ``x @ weight.T`` (times ``scales``
per output row) for float32, bfloat16, float16 and int8 weights and a few rows of ``x`` (16-bit
weights under float32 rows: any rows), in ``x``'s dtype (``dot.h`` and ``kernels.cpp`` state the
numerics: 16-bit weights converted exactly, float32 sums).
It is compiled with the machine's C++ compiler (``$CXX``, else ``c++``), the one inductor uses too,
against the installed
torch, for this CPU (``-march=native``), into ``~/.cache/llama-chat/kernels`` (or
``$LLAMA_CHAT_KERNEL_DIR``), under a name that changes with the source, torch, Python and the CPU.
The first build takes a while (docs/usage.md says how long); later processes load the file.

The cache is trusted only as far as it is checked, since a file loaded into the process runs
with it and a damaged one can crash it outright (a library cut short ends the process with
SIGBUS when it is mapped):

* a build holds a lock file beside the library, so processes started together (test workers, a
  server and a command) build it once and the others load that build;
* a build is compiled under a temporary name, sealed (its size and SHA-256 appended as a
  trailer, which the dynamic loader ignores) and renamed into place, so two processes building
  at once (where the lock cannot be taken) each load a whole library and neither ever sees half
  of one;
* a library is loaded only if it is a regular file whose trailer matches its bytes (anything
  else, a truncated file or an unrelated library under the name, is built again), and kept only
  if every operator the sources define is there once it is loaded (else PyTorch's products, and
  the file is removed so the next process builds it);
* the ``.failed`` note is read only when it is a small regular file, and written through a
  rename, so a FIFO in its place neither blocks a reader nor a writer;
* a cache directory that cannot be written means PyTorch's products and one line saying why.

The API other modules use:

* ``prepare(model, quantize)``: build or load the operator when ``model`` has CPU weights it is
  for (16-bit, int8, packed blocks, or float32 in models of 10 M parameters or more); returns
  whether it is loaded. Engines and schedulers call it, so whether a product takes the operator
  is settled before the first token.
* ``wanted(model, quantize)`` and ``cached()``: whether ``prepare`` would build, so the command
  can say so. A build that failed leaves a ``.failed`` note beside where the file would be, with
  the reason, and is not tried again for the same source, torch and CPU.
* ``loaded()``: whether the operator is there; ``ops`` and ``quantize`` consult it per product.
* ``failure()``: why the last build failed, one line, or None; ``failed_before()``: whether
  that is an earlier process's failure, read from its note.

``LLAMA_CHAT_CPU_KERNELS=0`` keeps PyTorch's kernels. A machine without a compiler, or a build
that fails, does too: the operator is a speed-up, never a requirement.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from llama_chat.ml.safe_files import open_regular, read_regular, write_atomic
from llama_chat.ml.user_cache import wanted_cache_dir, writable_dir

HERE = Path(__file__).parent
# Compiled together into one library; the headers are shared.
SOURCES = (HERE / "kernels.cpp", HERE / "decode.cpp", HERE / "memory.cpp", HERE / "attention.cpp")
HEADERS = (HERE / "dot.h", HERE / "panels.h", HERE / "pick.h", HERE / "blocks.h", HERE / "vectors.h",
           HERE / "memory.h", HERE / "kv_rows.h")
DISABLE_ENV = "LLAMA_CHAT_CPU_KERNELS"
DIR_ENV = "LLAMA_CHAT_KERNEL_DIR"
# A product of up to this many rows takes the operator (a decode step, or the packed decode rows
# of the scheduler's jobs); longer ones are matrix products, where BLAS's blocking wins: ours is
# ahead of oneDNN up to 16 rows and not from 32 (docs/benchmarks.md, "Products: the operator's,
# MKL's and oneDNN's"). int8 rows stop at 8, past which fbgemm's product takes them.
MAX_ROWS = 16
MAX_INT8_ROWS = 8
BUILD_TIMEOUT_S = 300
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
HALF_DTYPES = (torch.float16, torch.bfloat16)  # the 16-bit float weights (ml/half.py)
# Smaller float32 models do not build the operator for themselves: their decode steps are short
# whatever the product, and a first run would wait for the build. They take it when it is loaded anyway.
MIN_FLOAT32_PARAMETERS = 10_000_000

# The seal appended to a built library: a fixed-size line with the magic, the size of the bytes
# before it and their SHA-256.
SEAL_MAGIC = b"llama-chat-cpu-kernels/1"
SEAL_SIZE = 128
MAX_LIBRARY_BYTES = 256 << 20
MAX_NOTE_BYTES = 4096
_DEFINED = re.compile(rb'm\.def\(\s*"(\w+)\(')

# "earlier": the failure is an earlier process's, read from its note (and said by that process).
_state: dict[str, object] = {"loaded": False, "failure": None, "tried": False, "earlier": False}


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def loaded() -> bool:
    return bool(_state["loaded"])


def attends_prompts() -> bool:
    """Whether the loaded operator has the prompt attention (``attention.cpp``), which builds
    with AVX-512 BF16 only."""
    if not loaded():
        return False
    if _state.get("attends") is None:
        _state["attends"] = bool(torch.ops.llama_chat_cpu.prompt_attention_built())
    return bool(_state["attends"])


def failure() -> str | None:
    return _state["failure"]  # type: ignore[return-value]


def failed_before() -> bool:
    """Whether ``failure`` is an earlier process's build failure (its ``.failed`` note), already
    said there; a failure of this process's own is not."""
    return bool(_state["earlier"]) and failure() is not None


def wanted(model: torch.nn.Module, quantize: str = "none") -> bool:
    """Whether ``model`` has CPU weights the operator is for: 16-bit or int8 ones (or int8 asked
    for with ``quantize``), packed blocks, or float32 ones in a model of ``MIN_FLOAT32_PARAMETERS``
    or more."""
    if not enabled():
        return False
    params = [p for p in model.parameters() if p.device.type == "cpu"]
    if not params:
        return False
    if quantize == "int8" or any(b.dtype == torch.int8 for b in model.buffers()):
        return True
    if any(b.dtype == torch.uint8 for b in model.buffers()):  # packed quant blocks (ml/packed.py)
        return True
    # 16-bit weights: parameters (``--dtype bfloat16``), or a GGUF file's own (ml/half.py's buffers)
    if any(t.dtype in HALF_DTYPES for t in (*params, *model.buffers())):
        return True
    return sum(p.numel() for p in params if p.dtype == torch.float32) >= MIN_FLOAT32_PARAMETERS


def cache_dir() -> Path:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    return wanted_cache_dir("kernels")  # never a temporary one: a build each run would cost more than it saves


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
    """Whether ``load`` would not build: loaded, built (and sealed), or a build failed here before."""
    if loaded() or _sources_missing():
        return True
    path = library_path()
    return _untrusted(path) is None or _failure_note(path.with_suffix(".failed")) is not None


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
    if _untrusted(target) is not None:  # missing, cut short, or not one of our builds: build it
        if not build:
            return False
        if _state["tried"]:  # a build that failed once in this process fails again
            return False
        _state["tried"] = True
        marker = target.with_suffix(".failed")
        note = _failure_note(marker)
        if note is not None:  # and so does one that failed in an earlier process on this machine
            _state["failure"], _state["earlier"] = note, True
            return False
        try:
            writable_dir(target.parent)
        except OSError as e:
            _state["failure"] = f"cannot write its cache {target.parent} ({e.strerror or e})"
            return False
        with _building(target):  # a process beside this one building the same file: its build is loaded
            problem = None if _untrusted(target) is None else _build(target)
        if problem is not None:
            _state["failure"] = problem
            try:
                write_atomic(marker, (problem + "\n").encode("utf-8", errors="replace"))
            except OSError:
                pass
            return False
        why = _untrusted(target)
        if why is not None:  # replaced by something else between the rename and now
            _state["failure"] = f"the library just built at {target} {why}"
            return False
    try:
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError) as exc:
        _state["failure"] = f"could not load {target}: {str(exc).splitlines()[0][:200]}"
        return False
    absent = _operators_absent()
    if absent:
        _state["failure"] = f"{target} does not define the operator {absent[0]}; it is removed, to be built again"
        try:
            target.unlink()
        except OSError:
            pass
        return False
    _register_fake()
    _state["loaded"] = True
    return True


@contextlib.contextmanager
def _building(target: Path):
    """Held while ``target`` is built: test workers or a server and a command started together on
    a fresh machine would each compile the whole library at once, on the same cores. The lock is
    a regular file beside the target, taken for at most ``BUILD_TIMEOUT_S``; where it cannot be
    made or is something else (a FIFO, say), the build goes on without it."""
    try:
        fd = os.open(target.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW
                     | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError:
        yield
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            deadline = time.monotonic() + BUILD_TIMEOUT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # and the lock with it


def _failure_note(marker: Path) -> str | None:
    """The reason an earlier build failed, from a small regular ``.failed`` file; None when there
    is none (or something that is not one: it is replaced when a build fails again)."""
    try:
        text = read_regular(marker, MAX_NOTE_BYTES).decode("utf-8", errors="replace").strip()
    except OSError:
        return None
    return text.splitlines()[0] if text else "an earlier build failed"


def _seal(path: Path) -> None:
    """Append the seal (size and SHA-256 of the library's bytes) to the library at ``path``."""
    body = path.read_bytes()
    line = b"%s %d %s" % (SEAL_MAGIC, len(body), hashlib.sha256(body).hexdigest().encode())
    with open(path, "ab") as f:
        f.write(b"\n" + line.ljust(SEAL_SIZE - 2) + b"\n")


def _untrusted(path: Path) -> str | None:
    """None when ``path`` is a regular file whose seal matches its bytes; else why it is not."""
    try:
        with open_regular(path, max_bytes=MAX_LIBRARY_BYTES) as f:
            data = f.read(MAX_LIBRARY_BYTES + 1)
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    body, seal = data[:-SEAL_SIZE], data[-SEAL_SIZE:]
    fields = seal.split()
    if len(data) <= SEAL_SIZE or len(fields) != 3 or fields[0] != SEAL_MAGIC:
        return "is not sealed (cut short, or not a library built here)"
    if fields[1] != str(len(body)).encode() or fields[2] != hashlib.sha256(body).hexdigest().encode():
        return "does not match its seal (changed or cut short since it was built)"
    return None


def _operators_absent() -> list[str]:
    """The operators the sources define that are not registered (a library that is not ours)."""
    names = []
    for path in SOURCES:
        try:
            names += [m.decode() for m in _DEFINED.findall(path.read_bytes())]
        except OSError:
            pass
    absent = []
    for name in names:
        try:
            getattr(torch.ops.llama_chat_cpu, name)
        except (AttributeError, RuntimeError):
            absent.append(name)
    return absent


def matvec(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.llama_chat_cpu.matvec(x, weight, scales)


# Rows up to which a greedy pick takes ``argmax_rows``, on the calling thread; torch's threaded
# argmax of vocabulary-wide rows was several times slower at 4 to 64 rows (the old benchmark log,
# "Measurements once in the CPU operator's comments": `git show fcfebb0:docs/benchmark-log.md`), so
# the bound only keeps a very large step off one thread.
MAX_ARGMAX_ROWS = 256


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of ``(rows, vocab)`` logits, through the operator where it pays."""
    if (loaded() and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and 0 < logits.shape[0] <= MAX_ARGMAX_ROWS and logits.shape[1] > 0):
        return torch.ops.llama_chat_cpu.argmax_rows.default(logits)
    return logits.argmax(dim=-1)


def near_largest(row: torch.Tensor, margin: float, most: int) -> torch.Tensor | None:
    """The places of ``row``'s values within ``margin`` of its largest, in order of place, through
    the operator; None where it is not loaded, the row is not float32 on the CPU, more than
    ``most`` are, or the row's largest is not a finite number."""
    if not (loaded() and row.device.type == "cpu" and row.dtype == torch.float32 and row.dim() == 1
            and row.numel() > 0):
        return None
    found = torch.ops.llama_chat_cpu.near_largest.default(row.contiguous(), margin, most)
    return found if found.numel() else None


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
    """Whether the product ``x @ weight.T`` goes to the operator: loaded, on the CPU, few rows; or
    16-bit weights under float32 rows (a GGUF file's: ``ml/half.py``), any rows: a prompt's are
    multiplied by panels converted a few at a time (``kernels.cpp``), faster than converting
    tiles for a library's float32 product."""
    if not (loaded() and x.device.type == "cpu" and weight.device.type == "cpu"
            and weight.dtype in KERNEL_DTYPES and x.dtype in (torch.float32, torch.bfloat16)
            and weight.dim() == 2 and weight.is_contiguous()):
        return False
    if weight.dtype in HALF_DTYPES and x.dtype == torch.float32:
        return True
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

    if hasattr(torch.ops.llama_chat_cpu, "gated_rows"):  # not in a build of the products alone
        @torch.library.register_fake("llama_chat_cpu::gated_rows")
        def _(gate_up, gelu):
            return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


def _build(target: Path) -> str | None:
    """Compile the source into ``target``; None, or one line saying why it failed."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libraries = [f"-L{p}" for p in cpp_extension.library_paths()]
    abi = int(torch.compiled_with_cxx11_abi())
    base = ["-O3", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes]
    link = [*libraries, "-ltorch", "-ltorch_cpu", "-lc10"]
    # Newer torch headers want C++20, older compilers only know C++17; -march=native and OpenMP
    # are dropped for compilers that refuse them (the product is then plain and single-threaded).
    attempts = [["-std=c++20", "-march=native", "-fopenmp"], ["-std=c++17", "-march=native", "-fopenmp"],
                ["-std=c++17"]]
    problem = "not built"
    for extra in attempts:
        try:
            with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".build-", suffix=".so", delete=False) as tmp:
                partial = Path(tmp.name)
        except OSError as exc:
            return f"cannot write its cache {target.parent} ({exc.strerror or exc})"
        objects = [partial.with_name(f"{partial.stem}-{source.stem}.o") for source in SOURCES]
        try:
            # Each source its own compiler, all at once (the largest takes most of the wait), then
            # one link.
            runs = _compile_all([[compiler, *base, *extra, "-c", str(source), "-o", str(obj)]
                                 for source, obj in zip(SOURCES, objects)])
            run = next((r for r in runs if r.returncode != 0), None)
            if run is None:
                run = _compile([compiler, "-shared", *extra, *map(str, objects), *link, "-o", str(partial)])
            if run.returncode == 0:
                _seal(partial)
                os.replace(partial, target)  # atomic: a process beside this one sees all or nothing
                return None
        except subprocess.TimeoutExpired:
            return f"{compiler} ran for more than {BUILD_TIMEOUT_S} s"
        except OSError as exc:
            return f"{compiler}: {exc.strerror or exc}"
        finally:
            for made in (partial, *objects):
                made.unlink(missing_ok=True)
        lines = [line for line in run.stderr.splitlines() if "error" in line] or run.stderr.splitlines() or [""]
        problem = f"{compiler} failed: {lines[0].strip()[:200]}"
    return problem


def _compile(argv: list[str]) -> subprocess.CompletedProcess:
    """``_compile_all`` of one compiler."""
    return _compile_all([argv])[0]


def _compile_all(argvs: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Run the compilers side by side, their output captured; all killed once ``BUILD_TIMEOUT_S``
    has passed since they started, or at once when the wait ends otherwise (Ctrl+C).

    A compiler is a driver that runs others (cc1plus, as, ld), and a wrapper in ``CXX`` may add
    more: each holds the output pipes, and killing the driver alone left the wait for their end
    running past any limit. So the compiler starts a process group of its own, and the whole group
    is killed. (Being in its own group, it no longer gets the terminal's Ctrl+C itself.)"""
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    processes: list[subprocess.Popen] = []
    try:
        with _signals_taken():
            for argv in argvs:
                processes.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                  errors="replace", process_group=0))
        # One at a time: the others go on meanwhile (a full pipe holds one only until it is read).
        done = [process.communicate(timeout=max(0.0, deadline - time.monotonic())) for process in processes]
    except BaseException:
        for process in processes:
            if process.returncode is None:
                _kill_group(process)
        raise
    return [subprocess.CompletedProcess(argv, process.returncode, out, err)
            for argv, process, (out, err) in zip(argvs, processes, done)]


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the compiler's process group (its leader not yet reaped, so the group id is its own)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already
    process.wait()
    for pipe in (process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()


@contextlib.contextmanager
def _signals_taken():
    """The calling thread's signals unblocked while a child starts. Every thread but the main one
    blocks the process's signals (inference/thread_signals.py) and a child starts with its
    thread's mask: a compiler started by the server's loading thread would outlive a Ctrl+C."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


@functools.cache
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor()

"""This CPU's multiply-add peak, int8 and floating point, with the instructions it has.

The denominator of every prefill figure (docs/benchmarks.md, "Prefill"): a prompt's products are
compute-bound, so how far a prefill is from the machine's limit is its multiply-adds a second
over the rate that the CPU's own instructions reach in a loop that does nothing else.

A small C++ library (the source below, compiled with ``$CXX`` or ``c++ -O2 -march=native`` into
a temporary folder, loaded with ctypes) runs, for each instruction sequence this CPU has, a
register-blocked loop: independent accumulators (twelve; six in the AVX2 int8 loops, written in
assembly), each instruction's inputs in registers, so that nothing but the instructions'
throughput bounds it. It runs on one thread and on every
thread asked for (``std::thread``, each with its own loop), best of ``--repeats`` runs.
A multiply-add is one product added to a sum (an int8 x int8 product counts one, whatever
instruction sums it):

* ``int8 avx2 maddubs+madd``: ``vpmaddubsw`` then ``vpmaddwd`` and ``vpaddd`` into int32, the
  sequence llama-chat's packed products use on AVX2 (ml/cpu/blocks.h): 32 a ``vpmaddubsw``;
* ``int8 avx2 maddubs+add16``: ``vpmaddubsw`` and ``vpaddw`` into int16 sums, ``vpmaddubsw``'s
  own ceiling (int16 sums overflow past a few products: a bound, not a usable kernel);
* ``int8 avx-vnni`` / ``int8 avx512-vnni``: ``vpdpbusd`` on 256 / 512 bits (32 / 64 each);
* ``int8 avx512-vnni, block steps`` (``+offsets``): the same with the float step that each
  32-value block of eight input rows takes under the packed products' numerics (ml/cpu/blocks.h):
  per row the block's int32 sum converted, scaled and added (and for Q4_K and Q5_K the offset's
  multiply-add): the most a prompt's products can reach with those numerics, below the peak;
* ``int8 amx``: ``tdpbusd`` on 16x64 tiles, where the CPU has AMX and the kernel grants its tile
  state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); else said so;
* ``fp32 fma``: ``vfmadd231ps`` on 256 (and 512) bits; ``bf16 avx512``: ``vdpbf16ps`` where the
  CPU has AVX512_BF16 (without it, bfloat16 products convert to float32 and run at fp32's peak).

    python benchmarks/bench_peak.py                 # one thread and 2
    python benchmarks/bench_peak.py --threads 16 --seconds 0.5 --json

Printed: a table of GOPS (10^9 multiply-adds a second) per thread and in total, with the load
average; ``--json`` prints the same as one JSON object (``bench_prefill.py`` reads it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#include <chrono>
#include <ctime>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int kAcc = 12;  // independent accumulators: enough for any of these latencies

#if defined(__AVX2__) && defined(__x86_64__)
// Written as assembly: every vpmaddubsw here has the same inputs, and from intrinsics the
// compiler computes one and adds it twelve times. Six chains an iteration, each a vpmaddubsw
// (32 multiply-adds), its pairs summed into int32 lanes by vpmaddwd with ones, added by vpaddd.
#define PEAK_MADD(c) "vpmaddubsw %[b], %[a], %%ymm" #c "\n\tvpmaddwd %[ones], %%ymm" #c ", %%ymm" #c \
                     "\n\tvpaddd %%ymm" #c ", %[acc" #c "], %[acc" #c "]\n\t"
#define PEAK_ADD16(c) "vpmaddubsw %[b], %[a], %%ymm" #c "\n\tvpaddw %%ymm" #c ", %[acc" #c "], %[acc" #c "]\n\t"
#define PEAK_OPERANDS                                                                               \
  : [acc10] "+x"(acc0), [acc11] "+x"(acc1), [acc12] "+x"(acc2), [acc13] "+x"(acc3), [acc14] "+x"(acc4), \
    [acc15] "+x"(acc5)                                                                              \
  : [a] "x"(a), [b] "x"(b), [ones] "x"(ones)                                                        \
  : "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"

uint64_t avx2_maddubs_madd(uint64_t iters) {
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
  // Six variables, not an array: an array's elements were stored to memory after every
  // iteration, and those stores, not the multiplies, bounded the loop.
  __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0, acc2 = acc0, acc3 = acc0, acc4 = acc0, acc5 = acc0;
  for (uint64_t n = 0; n < iters; ++n) {
    __asm__ volatile(PEAK_MADD(10) PEAK_MADD(11) PEAK_MADD(12) PEAK_MADD(13) PEAK_MADD(14) PEAK_MADD(15)
                     PEAK_OPERANDS);
  }
  const __m256i acc[6] = {acc0, acc1, acc2, acc3, acc4, acc5};
  __m256i s = acc[0];
  for (int i = 1; i < 6; ++i) s = _mm256_add_epi32(s, acc[i]);
  return static_cast<uint64_t>(_mm256_extract_epi32(s, 0));
}
// vpmaddubsw into int16 sums: the instruction's own ceiling.
uint64_t avx2_maddubs_add16(uint64_t iters) {
  const __m256i a = _mm256_set1_epi8(1), b = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
  // Six variables, not an array: an array's elements were stored to memory after every
  // iteration, and those stores, not the multiplies, bounded the loop.
  __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0, acc2 = acc0, acc3 = acc0, acc4 = acc0, acc5 = acc0;
  for (uint64_t n = 0; n < iters; ++n) {
    __asm__ volatile(PEAK_ADD16(10) PEAK_ADD16(11) PEAK_ADD16(12) PEAK_ADD16(13) PEAK_ADD16(14) PEAK_ADD16(15)
                     PEAK_OPERANDS);
  }
  const __m256i acc[6] = {acc0, acc1, acc2, acc3, acc4, acc5};
  __m256i s = acc[0];
  for (int i = 1; i < 6; ++i) s = _mm256_add_epi16(s, acc[i]);
  return static_cast<uint64_t>(_mm256_extract_epi16(s, 0));
}
#endif

#if defined(__FMA__) && defined(__AVX__)
uint64_t fma256(uint64_t iters) {
  __m256 a = _mm256_set1_ps(1.0000001f), b = _mm256_set1_ps(0.9999999f);
  __m256 acc[kAcc];
  for (auto& v : acc) v = _mm256_setzero_ps();
  for (uint64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
    __asm__ volatile("" : "+x"(a), "+x"(b));
  }
  __m256 s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm256_add_ps(s, acc[i]);
  return static_cast<uint64_t>(_mm256_cvtss_f32(s));
}
#endif

#if defined(__AVXVNNI__)
uint64_t avx_vnni256(uint64_t iters) {
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
  __m256i acc[kAcc];
  for (auto& v : acc) v = _mm256_setzero_si256();
  for (uint64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_dpbusd_avx_epi32(acc[i], a, b);
    __asm__ volatile("" : "+x"(a), "+x"(b));
  }
  __m256i s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm256_add_epi32(s, acc[i]);
  return static_cast<uint64_t>(_mm256_extract_epi32(s, 0));
}
#endif

#if defined(__AVX512F__)
uint64_t fma512(uint64_t iters) {
  __m512 a = _mm512_set1_ps(1.0000001f), b = _mm512_set1_ps(0.9999999f);
  __m512 acc[kAcc];
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (uint64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  __m512 s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm512_add_ps(s, acc[i]);
  return static_cast<uint64_t>(_mm512_reduce_add_ps(s));
}
#endif

#if defined(__AVX512VNNI__)
uint64_t avx512_vnni(uint64_t iters) {
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  __m512i acc[kAcc];
  for (auto& v : acc) v = _mm512_setzero_si512();
  for (uint64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  __m512i s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm512_add_epi32(s, acc[i]);
  return static_cast<uint64_t>(_mm512_reduce_add_epi32(s));
}
#endif

#if defined(__AVX512VNNI__)
// The sequence of a prompt's products under their numerics (ml/cpu/blocks.h, "Many rows"): a
// 32-value block is eight vpdpbusd into a fresh int32 sum for each of eight input rows (the rows
// share each weight vector), then the block's float step for each row: the sum converted, times
// the weights' scale times the row's step, added to the row's float sum; and with Offset (Q4_K,
// Q5_K) the weights' offset times the row's step sum added too. The rate those numerics allow.
template <bool Offset>
uint64_t avx512_vnni_blocks(uint64_t iters) {
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  __m512 scale = _mm512_set1_ps(1e-3f), offset = _mm512_set1_ps(-1e-3f);
  alignas(64) static float steps[8] = {1e-3f, 2e-3f, 3e-3f, 4e-3f, 5e-3f, 6e-3f, 7e-3f, 8e-3f};
  __m512 acc[8];
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (uint64_t n = 0; n < iters; ++n) {
    __m512i s[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) s[i] = _mm512_set1_epi32(i);  // unequal: each row's sums computed
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) s[i] = _mm512_dpbusd_epi32(s[i], a, b);
      __asm__ volatile("" : "+v"(a), "+v"(b));
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(scale, _mm512_set1_ps(steps[i])), acc[i]);
      if (Offset) acc[i] = _mm512_fmadd_ps(offset, _mm512_set1_ps(steps[i]), acc[i]);
    }
    __asm__ volatile("" : "+v"(scale), "+v"(offset) : : "memory");
  }
  __m512 s = acc[0];
  for (int i = 1; i < 8; ++i) s = _mm512_add_ps(s, acc[i]);
  return static_cast<uint64_t>(_mm512_reduce_add_ps(s));
}
#endif

#if defined(__AVX512BF16__)
uint64_t avx512_bf16(uint64_t iters) {
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f80);
  __m512 acc[kAcc];
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (uint64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  __m512 s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm512_add_ps(s, acc[i]);
  return static_cast<uint64_t>(_mm512_reduce_add_ps(s));
}
#endif

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__linux__)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
// Tiles 0-3 accumulate, 4-5 and 6-7 are the two operands: four tdpbusd of 16x16 int32 results,
// 16 x 64 x 16 multiply-adds each, per iteration.
uint64_t amx_int8(uint64_t iters) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  alignas(64) static int8_t buf[16 * 64];
  std::memset(buf, 1, sizeof buf);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, buf, 64); _tile_loadd(5, buf, 64); _tile_loadd(6, buf, 64); _tile_loadd(7, buf, 64);
  for (uint64_t n = 0; n < iters; ++n) {
    _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
  }
  alignas(64) static int32_t out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  return static_cast<uint64_t>(out[0]);
}
#endif

using Loop = uint64_t (*)(uint64_t);
struct Kernel {
  const char* name;
  Loop loop;
  double ops_per_iter;  // multiply-adds one iteration does
};

const std::vector<Kernel>& kernels() {
  static const std::vector<Kernel> all = {
#if defined(__AVX2__) && defined(__x86_64__)
      {"int8 avx2 maddubs+madd", avx2_maddubs_madd, 32.0 * 6},
      {"int8 avx2 maddubs+add16", avx2_maddubs_add16, 32.0 * 6},
#endif
#if defined(__AVXVNNI__)
      {"int8 avx-vnni", avx_vnni256, 32.0 * kAcc},
#endif
#if defined(__AVX512VNNI__)
      {"int8 avx512-vnni", avx512_vnni, 64.0 * kAcc},
      {"int8 avx512-vnni, block steps", avx512_vnni_blocks<false>, 64.0 * 8 * 8},
      {"int8 avx512-vnni, block steps+offsets", avx512_vnni_blocks<true>, 64.0 * 8 * 8},
#endif
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__linux__)
      {"int8 amx", amx_int8, 4.0 * 16 * 16 * 64},
#endif
#if defined(__FMA__) && defined(__AVX__)
      {"fp32 fma256", fma256, 8.0 * kAcc},
#endif
#if defined(__AVX512F__)
      {"fp32 fma512", fma512, 16.0 * kAcc},
#endif
#if defined(__AVX512BF16__)
      {"bf16 avx512", avx512_bf16, 32.0 * kAcc},
#endif
  };
  return all;
}

}  // namespace

extern "C" {

int peak_count() { return static_cast<int>(kernels().size()); }
const char* peak_name(int i) { return kernels()[i].name; }

// Whether the kernel lets this process use AMX tiles (Linux asks for the tile state first).
int peak_amx_granted() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) == 0 ? 1 : 0;
#else
  return 0;
#endif
}

double thread_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// Kernel i on `threads` threads, each `iters` iterations: multiply-adds a second, all threads,
// by the wall clock; *per_cpu_second gets them per second of the threads' own CPU time (what
// a core does while it runs the loop, however many other processes share the cores).
double peak_run(int i, int threads, uint64_t iters, double* per_cpu_second) {
  const Kernel& k = kernels()[i];
  std::vector<std::thread> pool;
  std::vector<uint64_t> sink(threads);
  std::vector<double> cpu(threads);
  const auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      const double c0 = thread_seconds();
      sink[t] = k.loop(iters);
      cpu[t] = thread_seconds() - c0;
    });
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile uint64_t keep = 0;
  for (auto v : sink) keep = keep + v;
  double cpu_total = 0;
  for (double c : cpu) cpu_total += c;
  *per_cpu_second = k.ops_per_iter * static_cast<double>(iters) * threads / cpu_total;
  return k.ops_per_iter * static_cast<double>(iters) * threads / s;
}

}  // extern "C"
"""


@dataclass(frozen=True)
class Peak:
    name: str  # the instruction sequence
    threads: int
    gops_total: float  # 10^9 multiply-adds a second, all threads together
    gops_per_thread: float
    gops_per_cpu_second: float  # per second of a thread's own CPU time: one core's rate while it runs


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def build(folder: Path) -> ctypes.CDLL:
    """The peak library, compiled for this CPU; a missing compiler or a failed build ends the run."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise SystemExit("bench_peak: no C++ compiler (set CXX or install g++)")
    src, lib = folder / "peak.cpp", folder / "peak.so"
    src.write_text(SOURCE)
    # AMX is compiled in where -march=native has it, and run only where the kernel grants the
    # tile state (without it the first tile instruction faults, and the whole process with it).
    cmd = [compiler, "-O2", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread", str(src), "-o", str(lib)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"bench_peak: the build failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    so = ctypes.CDLL(str(lib))
    so.peak_name.restype = ctypes.c_char_p
    so.peak_run.restype = ctypes.c_double
    so.peak_run.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_double))
    return so


def has_amx_flag() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def measure(so: ctypes.CDLL, index: int, threads: int, seconds: float, repeats: int) -> tuple[float, float]:
    """Best multiply-adds a second over `repeats` runs of about `seconds` each: by the wall clock,
    and per second of the threads' CPU time (per core)."""
    cpu = ctypes.c_double()
    iters = 1000
    while True:  # calibrate on one thread: the loop's length for about `seconds`
        t0 = time.perf_counter()
        so.peak_run(index, 1, iters, ctypes.byref(cpu))
        if time.perf_counter() - t0 > seconds / 4 or iters > 1 << 40:
            break
        iters *= 4
    iters = max(1000, int(iters * seconds / max(1e-6, time.perf_counter() - t0)))
    wall, per_cpu = 0.0, 0.0
    for _ in range(repeats):
        wall = max(wall, so.peak_run(index, threads, iters, ctypes.byref(cpu)))
        per_cpu = max(per_cpu, cpu.value)
    return wall, per_cpu


def run(threads: int, seconds: float, repeats: int) -> list[Peak]:
    with tempfile.TemporaryDirectory(prefix="bench-peak-") as tmp:
        so = build(Path(tmp))
        amx_granted = bool(so.peak_amx_granted())
        peaks = []
        for i in range(so.peak_count()):
            name = so.peak_name(i).decode()
            if name == "int8 amx" and not amx_granted:
                continue
            for t in sorted({1, threads}):
                wall, per_cpu = measure(so, i, t, seconds, repeats)
                peaks.append(Peak(name, t, wall / 1e9, wall / 1e9 / t, per_cpu / 1e9))
    return peaks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="threads for the all-threads figure (default 2)")
    parser.add_argument("--seconds", type=float, default=0.3, help="length of one run (default 0.3)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure, the best kept (default 5)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.seconds <= 0 or args.repeats < 1:
        parser.error("--threads and --repeats must be at least 1, --seconds above 0")
    load_before = load_average()
    peaks = run(args.threads, args.seconds, args.repeats)
    info = {"cpu": cpu_model(), "threads": args.threads, "load_before": load_before, "load_after": load_average(),
            "amx": ("granted" if any(p.name == "int8 amx" for p in peaks) else
                    "in the CPU, not granted or not compiled" if has_amx_flag() else "absent"),
            "peaks": [asdict(p) for p in peaks]}
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"CPU: {info['cpu']}; AMX: {info['amx']}; load average before {load_before}, after {info['load_after']}")
    print()
    print("| instructions | threads | GOPS per thread | GOPS total | GOPS per core (CPU time) |")
    print("|---|---:|---:|---:|---:|")
    for p in peaks:
        print(f"| {p.name} | {p.threads} | {p.gops_per_thread:.1f} | {p.gops_total:.1f} | {p.gops_per_cpu_second:.1f} |")
    return 0


def int8_peak(info: dict, threads: int) -> Peak | None:
    """The fastest int8 sequence that sums into int32 (a usable kernel's) at `threads` threads,
    from ``run``'s JSON: the denominator of the prefill figures."""
    usable = [Peak(**p) for p in info["peaks"] if p["name"].startswith("int8") and "add16" not in p["name"]
              and p["threads"] == threads]
    return max(usable, key=lambda p: p.gops_total, default=None)


if __name__ == "__main__":
    sys.exit(main())

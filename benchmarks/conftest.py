"""Shared benchmark helpers (pytest-benchmark): a measured read-bandwidth ceiling and bytes/s reporting.

- ``read_bandwidth`` (fixture): this machine's single-pass read bandwidth in bytes/s, measured once per pytest
  run as the best of several ``torch.sum`` passes over a tensor far larger than the last-level cache (the
  ceiling a memory-bound kernel that reads its input once can reach; on a GPU, the same on a CUDA tensor).
- ``report_bytes(benchmark, nbytes, ceiling)``: after a benchmark ran, records in ``benchmark.extra_info`` the bytes
  one call reads, the effective bandwidth from the median time, and the fraction of the ceiling.
- ``full_grid()``: FASTVERIFY_BENCH_FULL=1 selects the full parameter grid; the default is a short subset.
- FASTVERIFY_BENCH_THREADS=n sets torch's intra-op threads (CPU kernels) for the run: on a machine shared
  with other jobs, n = 1 avoids timing the scheduler (a parallel region waits for its slowest, descheduled thread).
- At the end of the run a table (name, median, IQR, GB/s, % of ceiling) is printed, tagged with the machine.

Run: ``pytest benchmarks/bench_verify.py`` (add ``--benchmark-json out.json`` to keep the raw numbers).
"""

import os
import platform
import time

import pytest
import torch

_RESULTS = []
_CEILING = {}

if os.environ.get("FASTVERIFY_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["FASTVERIFY_BENCH_THREADS"]))


def full_grid() -> bool:
    """True when FASTVERIFY_BENCH_FULL=1: benchmark files use their full parameter grid."""
    return os.environ.get("FASTVERIFY_BENCH_FULL", "0") not in ("", "0")


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measure_read_bandwidth(device="cpu", nbytes=512 * 2**20, repeats=7):
    """Best-of-``repeats`` bytes/s of one ``torch.sum`` over an ``nbytes`` float32 tensor on ``device``."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    x.sum()  # warm up (page faults, thread pool)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


@pytest.fixture(scope="session")
def read_bandwidth():
    """bytes/s: this machine's single-pass read bandwidth on CPU (measured once per pytest run)."""
    if "cpu" not in _CEILING:
        _CEILING["cpu"] = measure_read_bandwidth("cpu")
    return _CEILING["cpu"]


@pytest.fixture(scope="session")
def gpu_read_bandwidth():
    """bytes/s: the single-pass read bandwidth of the current CUDA device (skips without a GPU)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if "cuda" not in _CEILING:
        _CEILING["cuda"] = measure_read_bandwidth("cuda", nbytes=4 * 2**30)
    return _CEILING["cuda"]


def report_bytes(benchmark, nbytes, ceiling=None, **info):
    """Record bytes per call, effective bytes/s (from the median) and the fraction of ``ceiling`` (bytes/s).
    Under ``--benchmark-disable`` (each benchmark run once, as a smoke test) there are no timings to record."""
    if benchmark.stats is None:
        return
    stats = benchmark.stats.stats
    median = stats.median
    iqr = stats.iqr
    rate = nbytes / median if median > 0 else float("nan")
    benchmark.extra_info.update(info)
    benchmark.extra_info["bytes"] = int(nbytes)
    benchmark.extra_info["GB/s"] = round(rate / 1e9, 3)
    if ceiling:
        benchmark.extra_info["ceiling_GB/s"] = round(ceiling / 1e9, 3)
        benchmark.extra_info["of_ceiling"] = round(rate / ceiling, 3)
    _RESULTS.append((benchmark.name, median, iqr, rate, ceiling, dict(info)))


def pytest_terminal_summary(terminalreporter):
    if not _RESULTS:
        return
    tr = terminalreporter
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    tr.write_sep("=", "bandwidth (median time; bytes = input bytes one call reads)")
    tr.write_line(f"machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
                  f"{torch.get_num_threads()} threads; "
                  + ", ".join(f"{d} read ceiling {c / 1e9:.2f} GB/s" for d, c in _CEILING.items()))
    tr.write_line(f"{'benchmark':<72} {'median ms':>10} {'IQR ms':>8} {'GB/s':>7} {'ceil':>6}")
    for name, median, iqr, rate, ceiling, _ in _RESULTS:
        frac = f"{rate / ceiling:6.0%}" if ceiling else "     -"
        tr.write_line(f"{name[:72]:<72} {median * 1e3:10.3f} {iqr * 1e3:8.3f} {rate / 1e9:7.2f} {frac}")

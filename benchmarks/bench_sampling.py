"""Benchmarks of cdf_sample against the usual torch sampling pipelines.

  plain:      fastverify.cdf_sample vs torch.softmax + torch.multinomial, and softmax + cumsum + searchsorted
  topk_topp:  fastverify.cdf_sample(top_k=50, top_p=0.9) vs the sort-based pipeline (transformers-style top-k
              with torch.topk, top-p with a full sort + cumsum, then softmax + torch.multinomial)

  temp0.7 / topp0.9: fastverify.cdf_sample with temperature 0.7 (a division per logit), and with top-p alone
              (threshold search over the weights; no sort-based torch counterpart is timed for it)

Run:  pytest benchmarks/bench_sampling.py --benchmark-only  [FASTVERIFY_BENCH_FULL=1 for the full grid
V in {32000, 128256, 151936} x B in {1, 8, 64}; default: V = 128256, B in {1, 64}]. Each case records the
effective bandwidth (logits bytes / median time) in extra_info["GB/s"], and, to show how much of the machine the
run actually had, the process CPU time per call and its ratio to the wall time (extra_info["cpu/wall"]: about
torch.get_num_threads() on an idle machine for the parallel ops, lower when other processes hold the cores).
See extra_info with --benchmark-json or --benchmark-verbose.
"""

import os
import platform
import time

import pytest
import torch

import fastverify

FULL = os.environ.get("FASTVERIFY_BENCH_FULL", "0") == "1"
VOCABS = (32000, 128256, 151936) if FULL else (128256,)
BATCHES = (1, 8, 64) if FULL else (1, 64)


def pytest_report_header(config):  # noqa: D103  (picked up only when this file is a conftest; kept for clarity)
    return f"machine: {platform.processor()} threads={torch.get_num_threads()}"


def _softmax_multinomial(logits, u):
    return torch.multinomial(torch.softmax(logits.float(), -1), 1)[:, 0]


def _softmax_cumsum_searchsorted(logits, u):
    c = torch.softmax(logits.float(), -1).cumsum(-1)
    return torch.searchsorted(c, u[:, None].to(c.dtype) * c[:, -1:])[:, 0].clamp(max=logits.shape[1] - 1)


def _sort_pipeline(logits, u, top_k=50, top_p=0.9):
    x = logits.float()
    kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
    x = x.masked_fill(x < kth, float("-inf"))
    sorted_x, idx = torch.sort(x, descending=False)
    cum = sorted_x.softmax(-1).cumsum(-1)
    remove = cum <= 1 - top_p
    remove[:, -1] = False
    x = x.scatter(1, idx, sorted_x.masked_fill(remove, float("-inf")))
    return torch.multinomial(torch.softmax(x, -1), 1)[:, 0]


CASES = {
    "plain/fastverify": lambda l, u: fastverify.cdf_sample(l, u),
    "plain/softmax+multinomial": _softmax_multinomial,
    "plain/softmax+cumsum+searchsorted": _softmax_cumsum_searchsorted,
    "topk50_topp0.9/fastverify": lambda l, u: fastverify.cdf_sample(l, u, top_k=50, top_p=0.9),
    "topk50_topp0.9/sort+multinomial": _sort_pipeline,
    "topp0.9/fastverify": lambda l, u: fastverify.cdf_sample(l, u, top_p=0.9),
    "temp0.7/fastverify": lambda l, u: fastverify.cdf_sample(l, u, temperature=0.7),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("V", VOCABS)
def test_cdf_sample(benchmark, case, B, V):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, V, generator=g) * 3
    u = fastverify.uniform(0, torch.arange(B))
    fn = CASES[case]
    fn(logits, u)  # warm-up
    benchmark.group = f"cdf_sample V={V} B={B}"
    benchmark.pedantic(fn, args=(logits, u), rounds=15 if B * V < 2_000_000 else 7, iterations=1, warmup_rounds=1)
    if benchmark.stats is None:  # --benchmark-disable: a smoke run, no timings
        return
    med = benchmark.stats.stats.median
    benchmark.extra_info["GB/s"] = round(logits.numel() * logits.element_size() / med / 1e9, 2)
    n = max(3, int(0.2 / med))  # process_time may tick in 4 ms steps: time >= 0.2 s of calls
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        fn(logits, u)
    cpu, wall = (time.process_time() - c0) / n, (time.perf_counter() - w0) / n
    benchmark.extra_info["cpu_s_per_call"] = round(cpu, 6)
    benchmark.extra_info["cpu/wall"] = round(cpu / wall, 2)
    benchmark.extra_info["machine"] = (f"{platform.machine()} {os.cpu_count()} cores, "
                                       f"torch threads={torch.get_num_threads()}")

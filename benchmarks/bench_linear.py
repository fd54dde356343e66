"""Microbenchmarks of fastverify.skinny_linear (CPU) against torch.nn.functional.linear at the layer shapes of
SmolLM2-135M, for the row counts a verify forward has (1 + draft nodes). Effective bandwidth = weight bytes /
median time (a skinny GEMM that reads its weight once is bound by it).

Default run: the LM head (49152 x 576) and the MLP up projection (1536 x 576) at M in {1, 2, 4, 8, 16}.
FASTVERIFY_BENCH_FULL=1 adds the other projections (576 x 576, 192 x 576, 576 x 1536) and M = 32.
The small layers fit in the last-level cache when benchmarked alone, so their GB/s exceed DRAM's; in a forward
each layer's weight comes from memory.

    pytest benchmarks/bench_linear.py [--benchmark-json out.json]
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import full_grid, report_bytes

import fastverify  # noqa: F401  (loads the compiled extension)
from fastverify.ops.tree import implemented_backends

SHAPES = [(49152, 576), (1536, 576)] + ([(576, 576), (192, 576), (576, 1536)] if full_grid() else [])
ROWS = [1, 2, 4, 8, 16] + ([32] if full_grid() else [])


@pytest.mark.parametrize("impl", ["skinny", "torch"])
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("N, K", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_linear(benchmark, read_bandwidth, N, K, M, impl):
    if impl == "skinny" and "cpp" not in implemented_backends("skinny_linear"):
        pytest.skip("cpp backend: fastverify._C has no skinny_linear kernel")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g)
    x = torch.randn(1, M, K, generator=g)
    op = torch.ops.fastverify.skinny_linear
    fn = (lambda: op(x, w, None)) if impl == "skinny" else (lambda: F.linear(x, w))  # noqa: E731
    benchmark.pedantic(fn, rounds=15 if N * K < 1e7 else 7, warmup_rounds=2, iterations=1 if N * K > 1e6 else 20)
    report_bytes(benchmark, w.numel() * 4, read_bandwidth, N=N, K=K, M=M, impl=impl)

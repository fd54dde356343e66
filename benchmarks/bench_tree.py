"""Microbenchmarks of the tree ops (pytest-benchmark), CPU.

  mask building    8 trees of 64 nodes over 2048-token prefixes: the additive [B, 1, n, P + n] mask and the
                   position ids, built (a) by a Python loop as Medusa's generate_medusa_buffers does (walk each
                   node's ancestors, set mask entries one by one), (b) by vectorised torch (fastverify's reference:
                   pointer jumping over all nodes at once, then cat / where), (c) by the C++ kernels.
  packed vs bool   bytes of the draft part of a 256-node tree's mask (extra_info; expected ratio 1/8), and the time
                   to build each.
  tree attention   fastverify.tree_attention (cpp: the masked-attention kernel in blocks of 16 query rows, bf16 /
                   fp16 converted to float32 a head at a time), every request's prefix full, or the first request's
                   a twentieth of the cache (ragged: its unused slots are not read), against
                   torch.nn.functional.scaled_dot_product_attention with the dense bool mask (enable_gqa), and the
                   reference. Memory: torch has no CPU allocator statistics, so the bytes of the masks each path
                   needs are computed analytically (bool mask B * n * (P + n) bytes vs packed B * n * ceil(n / 32) * 4)
                   and, where torch.profiler reports it, the bytes allocated during the call are recorded too.

Default run is short (one shape per group); FASTVERIFY_BENCH_FULL=1 runs the full grid; FASTVERIFY_BENCH_THREADS
sets torch's intra-op threads (default 1, 0 = torch's default):

  pytest benchmarks/bench_tree.py --benchmark-columns=median,iqr,min,rounds --benchmark-sort=name
"""

import os
import platform
import random

import pytest
import torch
import torch.nn.functional as F

import fastverify
from fastverify import _ext
from fastverify.reference import tree as ref_tree

FULL = os.environ.get("FASTVERIFY_BENCH_FULL", "0") == "1"
# Intra-op threads for every method (torch's own kernels and ours alike). Default 1: on a small shared machine
# waking a second OpenMP thread can cost more than the work; set FASTVERIFY_BENCH_THREADS=0 for torch's default.
THREADS = int(os.environ.get("FASTVERIFY_BENCH_THREADS", "1"))
if THREADS > 0:
    torch.set_num_threads(THREADS)
HAS_CPP = "cpp" in fastverify.ops.tree.implemented_backends("tree_mask_additive")
needs_cpp = pytest.mark.skipif(not HAS_CPP, reason=f"fastverify._C not built: {_ext._EXT_ERROR}")
MACHINE = f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def random_trees(B, n, seed=0):
    """Medusa-like bushy trees: each node's parent among the root and the earlier nodes, biased to recent ones."""
    rng = random.Random(seed)
    return [[-1 if j == 0 else rng.randint(max(-1, j - 8), j - 1) for j in range(n)] for _ in range(B)]


def batch(trees, P):
    parents = torch.tensor([p for t in trees for p in t], dtype=torch.int32)
    cu = torch.tensor([0] + [sum(len(t) for t in trees[:b + 1]) for b in range(len(trees))], dtype=torch.int32)
    return parents, cu, torch.full((len(trees),), P, dtype=torch.int32)


def python_loop_mask_and_positions(trees, prefix_len, dtype=torch.float32):
    """Medusa's generate_medusa_buffers style: per tree, per node, walk the ancestors and set entries one by one."""
    B, n, P = len(trees), max(len(t) for t in trees), max(prefix_len)
    mask = torch.full((B, 1, n, P + n), float("-inf"), dtype=dtype)
    positions = []
    for b, par in enumerate(trees):
        mask[b, 0, :, :prefix_len[b]] = 0
        for i in range(len(par)):
            depth, j = 0, i
            while j != -1:
                mask[b, 0, i, P + j] = 0
                depth += 1
                j = par[j]
            positions.append(prefix_len[b] + depth - 1)
    return mask, torch.tensor(positions, dtype=torch.int64)


MASK_SHAPES = [(8, 64, 2048)] + ([(8, 64, 512), (8, 256, 2048), (32, 64, 4096), (1, 512, 8192)] if FULL else [])


@pytest.mark.parametrize("B,n,P", MASK_SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("method", ["python_loop", "torch_vectorised", "cpp"])
def test_mask_and_positions(benchmark, method, B, n, P):
    if method == "cpp" and not HAS_CPP:
        pytest.skip("fastverify._C not built")
    if method == "python_loop" and B * n > 2048:
        pytest.skip("Python loop: only the small shapes")
    trees = random_trees(B, n)
    parents, cu, plen = batch(trees, P)
    benchmark.group = f"mask+positions B={B} n={n} P={P}"
    benchmark.extra_info["machine"] = MACHINE
    benchmark.extra_info["mask_bytes"] = B * n * (P + n) * 4
    if method == "python_loop":
        fn = lambda: python_loop_mask_and_positions(trees, [P] * B)  # noqa: E731
    else:
        backend = "torch" if method == "torch_vectorised" else "cpp"
        fn = lambda: (fastverify.tree_mask(parents, cu, plen, format="additive", backend=backend),  # noqa: E731
                      fastverify.tree_positions(parents, cu, plen, backend=backend))
    mask, pos = benchmark(fn)
    exp_mask, exp_pos = python_loop_mask_and_positions(trees, [P] * B)
    assert torch.equal(mask, exp_mask) and torch.equal(pos, exp_pos)


@pytest.mark.parametrize("fmt", ["bool", "packed"])
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_packed_vs_bool_256(benchmark, fmt, backend):
    if backend == "cpp" and not HAS_CPP:
        pytest.skip("fastverify._C not built")
    n = 256
    parents, cu, plen = batch(random_trees(1, n, seed=1), 0)
    benchmark.group = "packed vs bool, one 256-node tree (draft part)"
    out = benchmark(lambda: fastverify.tree_mask(parents, cu, plen, format=fmt, backend=backend))
    nbytes = out.numel() * out.element_size()
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["bytes_ratio_to_bool"] = nbytes / (n * n)
    assert nbytes == (n * n if fmt == "bool" else n * n // 8)


ATTN_SHAPES = [(2, 8, 2, 64, 64, 2048)]
if FULL:
    ATTN_SHAPES += [(1, 8, 2, 128, 256, 2048), (1, 8, 8, 128, 64, 8192), (4, 16, 4, 64, 16, 512),
                    (1, 8, 2, 128, 256, 8192)]


def _bytes_allocated(fn):
    """Bytes allocated on the CPU during fn() as torch.profiler reports them (sum over ops), or None."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        return sum(max(e.self_cpu_memory_usage, 0) for e in prof.key_averages())
    except Exception:  # profiler unavailable or changed: fall back to the analytic numbers only
        return None


@pytest.mark.parametrize("B,Hq,Hkv,D,n,P", ATTN_SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("prefixes", ["full", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["sdpa_dense_mask", "cpp", "torch_reference"])
def test_tree_attention(benchmark, method, dtype, prefixes, B, Hq, Hkv, D, n, P):
    if method == "cpp" and not HAS_CPP:
        pytest.skip("fastverify._C not built")
    if method == "torch_reference" and not FULL:
        pytest.skip("reference timing only in the full grid")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, n, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, P + n, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, P + n, D, generator=g).to(dtype)
    parents, cu, plen = batch(random_trees(B, n, seed=2), P)
    if prefixes == "ragged":
        plen[0] = P // 20
    packed = fastverify.tree_mask(parents, cu, plen, format="packed")
    dense = fastverify.tree_mask(parents, cu, plen, format="bool", max_prefix=P)[:, None]
    if method == "sdpa_dense_mask":
        fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)  # noqa: E731
        mask_bytes = dense.numel() * dense.element_size()
    else:
        backend = "cpp" if method == "cpp" else "torch"
        fn = lambda: fastverify.tree_attention(q, k, v, packed, plen, backend=backend)  # noqa: E731
        mask_bytes = packed.numel() * packed.element_size()
    benchmark.group = f"tree_attention B={B} Hq={Hq} Hkv={Hkv} D={D} n={n} P={P} {prefixes} {str(dtype)[6:]}"
    benchmark.extra_info["machine"] = MACHINE
    benchmark.extra_info["mask_bytes_analytic"] = mask_bytes
    benchmark.extra_info["bytes_allocated_profiler"] = _bytes_allocated(fn)
    out = benchmark(fn)
    exp = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=dense, enable_gqa=True)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), exp, atol=tol, rtol=tol)


def test_reference_masks_agree():
    """Sanity: the benchmark's Python loop and fastverify's reference build the same mask."""
    trees = random_trees(2, 10)
    parents, cu, plen = batch(trees, 5)
    m, pos = python_loop_mask_and_positions(trees, [5, 5])
    assert torch.equal(ref_tree.tree_mask_additive(parents, cu, plen, 10, 5, torch.float32), m)
    assert torch.equal(ref_tree.tree_positions(parents, cu, plen), pos)

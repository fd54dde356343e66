"""GPU benchmarks of the Triton backend (kernels/) against the torch reference, with pytest-benchmark.

    pytest benchmarks/bench_triton.py --benchmark-columns=median,iqr,ops --benchmark-group-by=param

Skipped without CUDA: the interpreter (TRITON_INTERPRET=1) is for correctness only and timing it means nothing.
Each case also records the bytes it must move (``extra_info["bytes"]``) so that bytes / median can be read
against the GPU's memory bandwidth; the machine name is recorded in ``extra_info["device"]``.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton benchmarks need a CUDA GPU")


def _sync_call(fn, *args):
    def run():
        out = fn(*args)
        torch.cuda.synchronize()
        return out

    return run


def _info(benchmark, nbytes):
    benchmark.extra_info["bytes"] = int(nbytes)
    benchmark.extra_info["device"] = torch.cuda.get_device_name()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("B,K,V", [(1, 8, 32000), (16, 8, 151936), (64, 4, 128256)])
def test_bench_verify_greedy(benchmark, backend, B, K, V):
    from fastverify.kernels import verify as kv
    from fastverify.reference import verify as rv

    dev = torch.device("cuda")
    N = B * K
    logits = torch.randn(N + B, V, device=dev, dtype=torch.bfloat16)
    tokens = torch.randint(0, V, (N,), device=dev)
    cu = torch.arange(0, N + 1, K, dtype=torch.int32, device=dev)
    parents = torch.arange(N, device=dev, dtype=torch.int32) % K - 1
    args = (logits, tokens, cu, parents, torch.zeros(B, 2, device=dev), torch.ones(B, 4, device=dev), None, None,
            None, None, 0, 0, K)
    fn = kv.verify if backend == "triton" else rv.verify
    _info(benchmark, logits.numel() * logits.element_size())
    benchmark(_sync_call(fn, *args))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("R,V,warp", [(64, 151936, (1.0, 0, 1.0, 0.0)), (64, 151936, (0.8, 50, 0.9, 0.0))])
def test_bench_cdf_sample(benchmark, backend, R, V, warp):
    from fastverify.kernels import sampling as ks
    from fastverify.reference import sampling as rs

    dev = torch.device("cuda")
    logits = torch.randn(R, V, device=dev, dtype=torch.bfloat16)
    u = torch.rand(R, device=dev)
    w = torch.tensor([warp] * R, device=dev, dtype=torch.float32)
    fn = ks.cdf_sample if backend == "triton" else rs.cdf_sample
    _info(benchmark, logits.numel() * logits.element_size())
    benchmark(_sync_call(fn, logits, u, w))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("B,Hq,Hkv,n,P,D", [(1, 32, 8, 64, 2048, 128), (8, 32, 8, 16, 4096, 128)])
def test_bench_tree_attention(benchmark, backend, B, Hq, Hkv, n, P, D):
    from fastverify.kernels import attention as ka
    from fastverify.kernels import tree as kt
    from fastverify.reference import attention as ra

    dev = torch.device("cuda")
    parents = (torch.arange(B * n, device=dev, dtype=torch.int32) % n) // 2 - 1  # a binary-ish tree
    cu = torch.arange(0, B * n + 1, n, dtype=torch.int32, device=dev)
    packed = kt.tree_mask_packed(parents, cu, n)
    plen = torch.full((B,), P, dtype=torch.int32, device=dev)
    q = torch.randn(B, Hq, n, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, P + n, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fn = ka.tree_attention if backend == "triton" else ra.tree_attention
    _info(benchmark, (q.numel() * 2 + k.numel() + v.numel()) * 2)
    benchmark(_sync_call(fn, q, k, v, packed, plen, D ** -0.5))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("B,n,P", [(8, 64, 4096)])
def test_bench_tree_mask(benchmark, backend, B, n, P):
    from fastverify.kernels import tree as kt
    from fastverify.reference import tree as rt

    dev = torch.device("cuda")
    parents = (torch.arange(B * n, device=dev, dtype=torch.int32) % n) // 2 - 1
    cu = torch.arange(0, B * n + 1, n, dtype=torch.int32, device=dev)
    plen = torch.full((B,), P, dtype=torch.int32, device=dev)
    fn = kt.tree_mask_additive if backend == "triton" else rt.tree_mask_additive
    _info(benchmark, B * n * (P + n) * 2)
    benchmark(_sync_call(fn, parents, cu, plen, n, P, torch.bfloat16))

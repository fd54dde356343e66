"""The CUDA backend (csrc/cuda/*.cu): every op of OPS has a CUDA kernel registered when the extension is built with
CUDA, the ops of NO_CUDA_KERNEL have none in any build, and, where a GPU is present, each CUDA kernel agrees with the
torch reference on small random inputs.

By default this checks the installed extension (fastverify._C). `.ci/cuda_build_check.sh` builds a CUDA extension
into a scratch directory and points FASTVERIFY_CUDA_SO at it (with FASTVERIFY_DISABLE_EXT=1, so that the in-place
build is not loaded beside it).
"""

import os

import pytest
import torch

OPS = (
    "verify",
    "uniform",
    "cdf_sample",
    "cdf_invert",
    "aux_bits",
    "tree_mask_bool",
    "tree_mask_additive",
    "tree_mask_packed",
    "tree_positions",
    "compact_cache",
    "compact_cache_layers",
)
# Ops with a CPU kernel and no CUDA one: on CUDA tensors tree_attention runs on Triton (the Triton kernel is its GPU
# kernel); masked_attention and skinny_linear are the CPU loop's (SDPA and cuBLAS serve a GPU).
NO_CUDA_KERNEL = ("tree_attention", "masked_attention", "skinny_linear", "skinny_linear_packed")


def _load():
    """(loaded, built_with_cuda, why-not) for the extension under test."""
    so = os.environ.get("FASTVERIFY_CUDA_SO")
    if so:
        torch.ops.load_library(so)
        return True, bool(torch.ops.fastverify.has_cuda()), ""
    from fastverify import _ext

    if not _ext.HAS_CPP:
        return False, False, f"fastverify._C is not loaded ({_ext._EXT_ERROR})"
    return True, bool(_ext.HAS_CUDA_KERNELS), ""


LOADED, WITH_CUDA, WHY = _load()
needs_cuda_build = pytest.mark.skipif(
    not (LOADED and WITH_CUDA),
    reason=WHY or "fastverify._C was built without CUDA (FASTVERIFY_NO_CUDA=1, or no CUDA torch / nvcc at build time); "
    "run .ci/cuda_build_check.sh to build and check the CUDA kernels",
)
needs_gpu = pytest.mark.skipif(
    not (LOADED and WITH_CUDA and torch.cuda.is_available()),
    reason="needs a CUDA build of fastverify._C and a GPU (none here)",
)


@needs_cuda_build
@pytest.mark.parametrize("op", OPS)
def test_cuda_kernel_registered(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fastverify::{op}", "CUDA"), (
        f"fastverify::{op} has no CUDA kernel although fastverify._C was built with CUDA")


@pytest.mark.parametrize("op", NO_CUDA_KERNEL)
def test_no_cuda_kernel(op):
    """Registered for CPU, not for CUDA, whether or not the extension was built with CUDA."""
    if not LOADED:
        pytest.skip(WHY)
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fastverify::{op}", "CPU"), f"{op}: no CPU kernel"
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"fastverify::{op}", "CUDA"), (
        f"fastverify::{op} has a CUDA kernel registered, but csrc/cuda defines none for it (a stale build?)")


def test_cpu_build_reports_no_cuda():
    """has_cuda() agrees with the CUDA registrations: a CPU-only build registers no CUDA kernel."""
    if not LOADED:
        pytest.skip(WHY)
    registered = [op for op in OPS if torch._C._dispatch_has_kernel_for_dispatch_key(f"fastverify::{op}", "CUDA")]
    if WITH_CUDA:
        assert registered == list(OPS)
    else:
        assert registered == []


# ---- GPU checks against the reference (skipped without a GPU) ----------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ragged(counts, seed=0):
    """cu_nodes, parents (random trees, parents[j] < j), draft tokens for node counts per request."""
    g = torch.Generator().manual_seed(seed)
    parents = []
    for n in counts:
        for j in range(n):
            parents.append(int(torch.randint(-1, j, (1,), generator=g)) if j > 0 else -1)
    cu = torch.tensor([0] + list(torch.tensor(counts).cumsum(0).tolist()), dtype=torch.int32)
    return cu, torch.tensor(parents, dtype=torch.int32)


@needs_gpu
def test_uniform_and_aux_bits_bit_identical():
    from fastverify.reference import sampling as ref

    seed = torch.randint(-2**63, 2**63 - 1, (1000,), dtype=torch.int64)
    pos = torch.randint(0, 2**40, (1000,), dtype=torch.int64)
    for stream in (0, 1, 7, 2**32 - 1):
        got = torch.ops.fastverify.uniform(seed.cuda(), pos.cuda(), torch.full_like(pos, stream).cuda()).cpu()
        want = ref.uniform(seed, pos, stream)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    u = torch.rand(77)
    assert torch.equal(torch.ops.fastverify.aux_bits(u.cuda()).cpu(), ref.aux_bits(u))


@needs_gpu
@pytest.mark.parametrize("counts", [[3, 0, 5], [1], [0], [40, 33]])
def test_tree_ops_match_reference(counts):
    from fastverify.reference import tree as ref

    cu, parents = _ragged(counts)
    B = len(counts)
    n = max(counts)
    prefix_len = torch.randint(0, 6, (B,), dtype=torch.int32)
    P = int(prefix_len.max())
    args = (parents.cuda(), cu.cuda())
    assert torch.equal(torch.ops.fastverify.tree_mask_packed(*args, n).cpu(), ref.tree_mask_packed(parents, cu, n))
    assert torch.equal(torch.ops.fastverify.tree_mask_bool(*args, prefix_len.cuda(), n, P).cpu(),
                       ref.tree_mask_bool(parents, cu, prefix_len, n, P))
    for dt in DTYPES:
        assert torch.equal(torch.ops.fastverify.tree_mask_additive(*args, prefix_len.cuda(), n, P, dt).cpu(),
                           ref.tree_mask_additive(parents, cu, prefix_len, n, P, dt))
    assert torch.equal(torch.ops.fastverify.tree_positions(*args, prefix_len.cuda()).cpu(),
                       ref.tree_positions(parents, cu, prefix_len))


@needs_gpu
def test_compact_cache_matches_reference():
    from fastverify.reference import tree as ref

    B, H, S, D = 3, 2, 20, 8
    k = torch.randn(B, H, S, D)
    v = torch.randn(B, H, S, D)
    prefix_len = torch.tensor([5, 10, 12], dtype=torch.int32)
    draft_start = 12
    accepted = torch.tensor([[0, 2, 5], [1, 3, -1], [-1, -1, -1]], dtype=torch.int32)
    accept_len = torch.tensor([3, 2, 0], dtype=torch.int32)
    kc, vc = k.clone().cuda(), v.clone().cuda()
    torch.ops.fastverify.compact_cache(kc, vc, prefix_len.cuda(), draft_start, accepted.cuda(), accept_len.cuda())
    ref.compact_cache(k, v, prefix_len, draft_start, accepted, accept_len)
    assert torch.equal(kc.cpu(), k) and torch.equal(vc.cpu(), v)


def _warp(R, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return torch.tensor([[temperature, top_k, top_p, min_p]] * R, dtype=torch.float32)


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [1, 3, 1000, 32000])
@pytest.mark.parametrize("w", [(1.0, 0, 1.0, 0.0), (0.7, 50, 0.9, 0.0), (1.3, 0, 0.8, 0.05), (0.0, 0, 1.0, 0.0)])
def test_cdf_sample_and_invert(dtype, V, w):
    from fastverify.reference import sampling as ref

    R = 6
    logits = (torch.randn(R, V) * 3).to(dtype)
    warp = _warp(R, *w)
    u = torch.rand(R, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
    got = torch.ops.fastverify.cdf_sample(logits.cuda(), u.cuda(), warp.cuda()).cpu()
    want = ref.cdf_sample(logits, u, warp)
    # summation order differs from the reference only in the last bits: allow a token at a bin edge to differ
    assert (got == want).float().mean() >= 0.8, (got, want)
    # the CUDA pair is exact with itself: cdf_sample(cdf_invert(t)) == t for every sampled t
    vaux = torch.rand(R, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
    uu = torch.ops.fastverify.cdf_invert(logits.cuda(), got.cuda(), vaux.cuda(), warp.cuda())
    back = torch.ops.fastverify.cdf_sample(logits.cuda(), uu, warp.cuda()).cpu()
    assert torch.equal(back, got)


@needs_gpu
@pytest.mark.parametrize("rule", range(8))
@pytest.mark.parametrize("dtype", DTYPES)
def test_verify_matches_reference(rule, dtype):
    from fastverify.reference import verify as ref

    counts = [4, 0, 6]
    cu, parents = _ragged(counts, seed=2)
    B, N, V = len(counts), sum(counts), 50
    g = torch.Generator().manual_seed(rule)
    logits = (torch.randn(N + B, V, generator=g) * 2).to(dtype)
    # draft tokens: mostly the parent row's argmax, so that paths get accepted
    tokens = torch.empty(N, dtype=torch.int64)
    for b in range(B):
        for j in range(counts[b]):
            gj = int(cu[b]) + j
            row = int(cu[b]) + b + 1 + int(parents[gj])
            tokens[gj] = int(logits[row].float().argmax()) if torch.rand(1, generator=g) < 0.7 else int(
                torch.randint(0, V, (1,), generator=g))
    rule_params = torch.tensor([[2.0, 3.0]] * B) if rule in (1, 2, 3) else torch.tensor([[0.05, 0.3]] * B)
    warp = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.8, 10.0, 0.9, 0.0], [0.0, 0.0, 1.0, 0.0]])
    u_sample = torch.rand(N + B, generator=g)
    u_accept = torch.rand(N, generator=g)
    max_depth = 6
    args = (parents, rule_params, warp, None, u_sample, u_accept, None, rule, 1 if rule < 6 else 0, max_depth)
    want = ref.verify(logits, tokens, cu, *args)
    dev = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    got = torch.ops.fastverify.verify(logits.cuda(), tokens.cuda(), cu.cuda(), *dev)
    for gt, wt in zip(got, want):
        assert torch.equal(gt.cpu(), wt), (rule, got, want)

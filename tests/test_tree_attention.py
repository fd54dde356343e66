"""tree_attention on every backend against torch's scaled_dot_product_attention with the dense tree mask. The op
has no CUDA C++ kernel: on CUDA tensors it runs on Triton, and backend="cuda" raises."""

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fastverify import _ext  # noqa: E402
from fastverify.ops import dispatch  # noqa: E402
from fastverify.ops.attention import tree_attention  # noqa: E402
from fastverify.ops.tree import implemented_backends, tree_mask  # noqa: E402

TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _skip_reason(backend):
    if backend == "torch":
        return None
    if backend not in implemented_backends("tree_attention", "attention"):
        return f"{backend} backend does not implement tree_attention here (not built / not written / not importable)"
    device = device_of(backend)
    if not _ext.backends(device)[backend]:
        return f"{backend} backend is not usable on {device} here"
    return None


def device_of(backend):
    if backend == "triton" and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(_skip_reason(b) is not None, reason=str(_skip_reason(b))))
            for b in ("torch", "cpp", "triton")]


def interpreted(backend):
    return backend == "triton" and device_of(backend).type == "cpu"


def random_batch(sizes, plens, seed):
    rng = random.Random(seed)
    parents = [rng.randint(-1, j - 1) if rng.random() < 0.6 else j - 1 for s in sizes for j in range(s)]
    cu = [0]
    for s in sizes:
        cu.append(cu[-1] + s)
    return torch.tensor(parents, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32), \
        torch.tensor(plens, dtype=torch.int32)


def sdpa_expected(q, k, v, parents, cu, plen):
    """SDPA in float32 with the dense bool tree mask, kv heads repeated for GQA."""
    visible = tree_mask(parents, cu, plen, format="bool", backend="torch", max_prefix=k.shape[2] - q.shape[2])[:, None]
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(g, 1),
                                          v.float().repeat_interleave(g, 1), attn_mask=visible)


# (D, sizes of the requests, prefix lengths, Hq, Hkv)
SHAPES = [
    pytest.param(64, [1], [1], 2, 2, id="D64-n1-P1"),
    pytest.param(128, [7, 3], [33, 5], 4, 2, id="D128-ragged-gqa"),
    pytest.param(64, [256], [17], 2, 1, id="D64-n256"),
    pytest.param(128, [40, 13], [8192, 100], 4, 1, id="D128-P8192"),
    pytest.param(64, [33, 0, 64], [3, 9, 70], 2, 2, id="D64-empty-request"),
    pytest.param(256, [20, 3], [50, 0], 2, 1, id="D256-ragged-gqa"),  # Triton's narrowest key tiles
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D,sizes,plens,Hq,Hkv", SHAPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_sdpa(backend, D, sizes, plens, Hq, Hkv, dtype):
    if interpreted(backend) and (max(plens) > 128 or max(sizes) > 64):
        pytest.skip("interpreted Triton: small shapes only, to keep the run short")
    dev = device_of(backend)
    parents, cu, plen = random_batch(sizes, plens, seed=D + len(sizes))
    B, n, P = len(sizes), max(sizes), max(plens)
    gen = torch.Generator().manual_seed(sum(sizes) + P)
    q = torch.randn(B, Hq, n, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, P + n, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, P + n, D, generator=gen).to(dtype)
    packed = tree_mask(parents, cu, plen, format="packed", backend="torch")
    exp = sdpa_expected(q, k, v, parents, cu, plen)
    got = tree_attention(q.to(dev), k.to(dev), v.to(dev), packed.to(dev), plen.to(dev), backend=backend)
    assert got.dtype == dtype and got.shape == (B, Hq, n, D)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.cpu().float(), exp, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_and_scale(backend, dtype):
    """q in [B, n, H, D] memory order (as projections produce it), k / v slices of a longer cache."""
    dev = device_of(backend)
    parents, cu, plen = random_batch([9, 4], [12, 3], seed=5)
    B, n, P, H, D = 2, 9, 12, 2, 64
    q = torch.randn(B, n, H, D).transpose(1, 2).to(dtype)
    cache = torch.randn(2, B, H, P + n + 20, D).to(dtype)
    k, v = cache[0, :, :, :P + n], cache[1, :, :, :P + n]
    assert not q.is_contiguous() and not k.is_contiguous()
    packed = tree_mask(parents, cu, plen, format="packed")
    visible = tree_mask(parents, cu, plen, format="bool", backend="torch")[:, None]
    exp = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible, scale=0.3)
    got = tree_attention(q.to(dev), k.to(dev), v.to(dev), packed.to(dev), plen.to(dev), scale=0.3, backend=backend)
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), exp, atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_random_layouts(backend, dtype):
    """Fresh random batches: 1-5 requests of 0-40 nodes, prefixes from 0 to the cache's length (the unused slots
    filled with NaN, which no backend may read), head sizes the SIMD paths take and others, GQA groups of 1-3."""
    if interpreted(backend):
        pytest.skip("interpreted Triton: covered by the fixed shapes")
    dev = device_of(backend)
    rng = random.Random(11)
    for case in range(12):
        B = rng.randint(1, 5)
        sizes = [rng.choice([0, 1, rng.randint(2, 40)]) for _ in range(B)]
        P = rng.choice([0, 5, 70, 300])
        plens = [rng.choice([0, P, rng.randint(0, P)]) for _ in range(B)]
        D = rng.choice([16, 40, 64, 80, 128])
        Hkv = rng.randint(1, 2)
        Hq = Hkv * rng.randint(1, 3)
        parents, cu, plen = random_batch(sizes, plens, seed=case)
        n = max(sizes)
        gen = torch.Generator().manual_seed(case)
        q = torch.randn(B, Hq, n, D, generator=gen).to(dtype)
        k = torch.randn(B, Hkv, P + n, D, generator=gen).to(dtype)
        v = torch.randn(B, Hkv, P + n, D, generator=gen).to(dtype)
        for b, pl in enumerate(plens):
            k[b, :, pl:P], v[b, :, pl:P] = float("nan"), float("nan")
        packed = tree_mask(parents, cu, plen, format="packed", backend="torch")
        exp = sdpa_expected(q, k.nan_to_num(), v.nan_to_num(), parents, cu, plen)
        got = tree_attention(q.to(dev), k.to(dev), v.to(dev), packed.to(dev), plen.to(dev), backend=backend)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(got.cpu().float(), exp.nan_to_num(), atol=atol, rtol=rtol,
                                   msg=lambda m: f"case {case}: B {B} sizes {sizes} P {P} plens {plens} D {D} "
                                                 f"Hq {Hq} Hkv {Hkv}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_keys_are_zero(backend):
    """A padding row of a request with an empty prefix sees no key: output 0, never NaN."""
    dev = device_of(backend)
    parents, cu, plen = random_batch([2, 5], [0, 4], seed=9)
    B, n, P, D = 2, 5, 4, 64
    q, k, v = torch.randn(B, 2, n, D), torch.randn(B, 2, P + n, D), torch.randn(B, 2, P + n, D)
    packed = tree_mask(parents, cu, plen, format="packed")
    got = tree_attention(q.to(dev), k.to(dev), v.to(dev), packed.to(dev), plen.to(dev), backend=backend).cpu()
    assert torch.isfinite(got).all()
    assert torch.equal(got[0, :, 2:], torch.zeros(2, 3, D))
    exp = sdpa_expected(q, k, v, parents, cu, plen)
    torch.testing.assert_close(got[0, :, :2], exp[0, :, :2], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[1], exp[1], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_unused_prefix_slots_are_never_read(backend, dtype):
    """A preallocated cache's slots [prefix_len, P) may hold anything: NaN or inf there changes no bit of the result
    (requests with a few unused slots and with many, which take different cpp paths). A NaN in one query reaches its
    own row and no other, on every backend."""
    dev = device_of(backend)
    parents, cu, plen = random_batch([6, 4, 5], [40, 37, 3], seed=31)
    B, n, P, D = 3, 6, 40, 64
    gen = torch.Generator().manual_seed(31)
    q = torch.randn(B, 4, n, D, generator=gen).to(dtype)
    k = torch.randn(B, 2, P + n, D, generator=gen).to(dtype)
    v = torch.randn(B, 2, P + n, D, generator=gen).to(dtype)
    packed = tree_mask(parents, cu, plen, format="packed")

    def run(q, k, v):
        return tree_attention(q.to(dev), k.to(dev), v.to(dev), packed.to(dev), plen.to(dev), backend=backend).cpu()

    clean = run(q, k, v)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(clean.float(), sdpa_expected(q, k, v, parents, cu, plen), atol=atol, rtol=rtol)
    dirty_k, dirty_v = k.clone(), v.clone()
    dirty_k[1, :, 37:P], dirty_v[1, :, 37:P] = float("nan"), float("inf")
    dirty_k[2, :, 3:P], dirty_v[2, :, 3:P] = float("inf"), float("nan")
    assert torch.equal(run(q, dirty_k, dirty_v), clean)
    bad = q.clone()
    bad[1, 3, 2, 5] = float("nan")
    got = run(bad, k, v)
    assert got[1, 3, 2].isnan().all() and got.isnan().sum() == D
    assert torch.equal(got.nan_to_num(), clean.masked_fill(got.isnan(), 0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_draft(backend):
    dev = device_of(backend)
    q = torch.randn(2, 2, 0, 64, device=dev)
    k = torch.randn(2, 2, 5, 64, device=dev)
    packed = torch.zeros(2, 0, 0, dtype=torch.int32, device=dev)
    assert tree_attention(q, k, k, packed, torch.tensor([5, 3], device=dev), backend=backend).shape == (2, 2, 0, 64)


def test_bad_input():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 7, 8)
    packed = tree_mask(torch.tensor([-1, 0, 0]), None, 4, format="packed")
    with pytest.raises(TypeError, match="packed_mask: expected int32"):
        tree_attention(q, k, k, packed.long(), 4)
    with pytest.raises(ValueError, match=r"packed_mask: expected shape \[B, n, ceil\(n / 32\)\]"):
        tree_attention(q, k, k, packed[:, :2], 4)
    with pytest.raises(ValueError, match=r"prefix_len: expected values in \[0, P = k.shape\[2\] - n = 4\]"):
        tree_attention(q, k, k, packed, 5)
    with pytest.raises(TypeError, match="k, v: expected q's dtype"):
        tree_attention(q, k.half(), k.half(), packed, 4)
    with pytest.raises(ValueError, match="must be a multiple of the kv heads"):
        tree_attention(torch.randn(1, 3, 3, 8), k, k, packed, 4)
    with pytest.raises(TypeError, match="q: expected one of"):
        tree_attention(q.double(), k.double(), k.double(), packed, 4)
    with pytest.raises(ValueError, match="q, k, v: expected 4-D"):
        tree_attention(q[0], k, k, packed, 4)
    with pytest.raises(ValueError, match="k: expected at least n = 3 key slots"):
        tree_attention(q, k[:, :, :2], k[:, :, :2], packed, 0)


@pytest.mark.skipif(_skip_reason("cpp") is not None, reason=str(_skip_reason("cpp")))
def test_cpp_checks_prefix_itself():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 7, 8)
    packed = tree_mask(torch.tensor([-1, 0, 0]), None, 4, format="packed")
    with pytest.raises(RuntimeError, match="prefix_len: entry 0 = 9 not in"):
        torch.ops.fastverify.tree_attention(q, k, k, packed, torch.tensor([9], dtype=torch.int32), 1.0)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values[0] == "cpp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(backend, dtype):
    dev = device_of(backend)
    parents, cu, plen = random_batch([5, 37], [3, 6], seed=2)
    q = torch.randn(2, 4, 37, 64, device=dev, dtype=dtype)
    k = torch.randn(2, 2, 43, 64, device=dev, dtype=dtype)
    v = torch.randn(2, 2, 43, 64, device=dev, dtype=dtype)
    packed = tree_mask(parents, cu, plen, format="packed").to(dev)
    torch.library.opcheck(torch.ops.fastverify.tree_attention, (q, k, v, packed, plen.to(dev), 0.125))


@pytest.mark.parametrize("backend", BACKENDS)
def test_stray_bits_past_n_are_ignored(backend):
    """Bits of the last mask word past node n - 1 name no key: they must not be read as visible keys."""
    dev = device_of(backend)
    parents, cu, plen = random_batch([5, 3], [4, 2], seed=13)
    q, k, v = torch.randn(2, 2, 5, 64), torch.randn(2, 2, 9, 64), torch.randn(2, 2, 9, 64)
    packed = tree_mask(parents, cu, plen, format="packed")
    dirty = packed | torch.tensor(-(1 << 5), dtype=torch.int32)  # set bits 5..31
    clean = tree_attention(q.to(dev), k.to(dev), v.to(dev), packed.to(dev), plen.to(dev), backend=backend)
    got = tree_attention(q.to(dev), k.to(dev), v.to(dev), dirty.to(dev), plen.to(dev), backend=backend)
    torch.testing.assert_close(got.cpu(), clean.cpu(), atol=0, rtol=0)


def test_no_cuda_backend():
    """Discovery reports no cuda backend (fastverify._C registers tree_attention for CPU only), and asking for it
    raises the error of any op without a CUDA kernel, whatever the device."""
    assert "cuda" not in implemented_backends("tree_attention")
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 7, 8)
    packed = tree_mask(torch.tensor([-1, 0, 0]), None, 4, format="packed")
    with pytest.raises(ValueError, match="backend: 'cuda' does not implement tree_attention"):
        tree_attention(q, k, k, packed, 4, backend="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_run_on_triton():
    """backend="auto" on CUDA tensors: the Triton kernel, or the reference where Triton is not usable; any head dim."""
    dev = torch.device("cuda")
    want = "triton" if "triton" in implemented_backends("tree_attention") and _ext.backends(dev)["triton"] else "torch"
    assert dispatch.resolve("tree_attention", "auto", dev) == want
    parents, cu, plen = random_batch([5, 3], [6, 2], seed=4)
    for D in (64, 256):
        q, k, v = torch.randn(2, 4, 5, D), torch.randn(2, 2, 11, D), torch.randn(2, 2, 11, D)
        packed = tree_mask(parents, cu, plen, format="packed")
        got = tree_attention(q.to(dev), k.to(dev), v.to(dev), packed.to(dev), plen.to(dev))
        torch.testing.assert_close(got.cpu(), sdpa_expected(q, k, v, parents, cu, plen), atol=2e-5, rtol=2e-5)

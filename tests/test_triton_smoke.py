"""Smoke tests of the Triton backend (kernels/): Philox known answers, bit-identity of uniform with the reference,
cdf_sample / cdf_invert against the reference and round trips, and torch.library.opcheck of every
``fastverify::<op>_triton`` op. The op test files (test_masks.py, test_tree_attention.py, test_verify.py, ...)
compare the Triton backend with the reference in depth; this file covers what they do not.

On CPU these run under TRITON_INTERPRET=1 (set by conftest.py before triton loads), so sizes stay small.
"""

import importlib.util
import os

import pytest
import torch



pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton needs a GPU, or CPU tensors with TRITON_INTERPRET=1",
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from fastverify.kernels._common import philox4x32_10  # noqa: E402


@triton.jit
def _philox_kat_kernel(ctr_ptr, key_ptr, out_ptr):
    i = tl.arange(0, 4)
    c = tl.load(ctr_ptr + i).to(tl.uint32, bitcast=True)
    c0 = tl.sum(tl.where(i == 0, c, 0), axis=0)
    c1 = tl.sum(tl.where(i == 1, c, 0), axis=0)
    c2 = tl.sum(tl.where(i == 2, c, 0), axis=0)
    c3 = tl.sum(tl.where(i == 3, c, 0), axis=0)
    k = tl.load(key_ptr + i, mask=i < 2, other=0).to(tl.uint32, bitcast=True)
    k0 = tl.sum(tl.where(i == 0, k, 0), axis=0)
    k1 = tl.sum(tl.where(i == 1, k, 0), axis=0)
    x0, x1, x2, x3 = philox4x32_10(c0, c1, c2, c3, k0, k1)
    tl.store(out_ptr + 0, x0.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 1, x1.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 2, x2.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 3, x3.to(tl.int32, bitcast=True))



def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------------------
# Philox


def test_philox_known_answers():
    """Random123 known answers of Philox 4x32-10 (kat_vectors): the round function and key schedule."""
    def run(ctr, key):
        as_i32 = lambda xs: torch.tensor([x - (1 << 32) if x >= 1 << 31 else x for x in xs], dtype=torch.int32,
                                         device=DEV)
        out = torch.empty(4, dtype=torch.int32, device=DEV)
        _philox_kat_kernel[(1,)](as_i32(ctr), as_i32(key), out)
        return [x & 0xFFFFFFFF for x in out.tolist()]

    assert run([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = 0xFFFFFFFF
    assert run([ones] * 4, [ones, ones]) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    pi = [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]
    assert run(pi, [0xA4093822, 0x299F31D0]) == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


@pytest.mark.parametrize("stream", [0, 1, 12345, 2**32 - 1])
def test_uniform_bit_identical(stream):
    from fastverify.kernels import sampling as ks
    from fastverify.reference import sampling as rs

    g = _gen(stream % 1000)
    seed = torch.randint(-2**63, 2**63 - 1, (777,), generator=g, dtype=torch.int64)
    seed[:3] = torch.tensor([0, -1, 2**63 - 1])
    position = torch.randint(0, 2**62, (777,), generator=g, dtype=torch.int64)
    position[:3] = torch.tensor([0, -1, 2**32])
    got = ks.uniform(seed.to(DEV), position.to(DEV), torch.full_like(position, stream).to(DEV)).cpu()
    want = rs.uniform(seed, position, stream)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert bool(((got > 0) & (got <= 1)).all())


# ------------------------------------------------------------------------------------------------------------
# cdf_sample / cdf_invert


def _warps(R, V, g):
    """A mix of warps: plain, temperature, top-k (ties), top-p, min-p, greedy, everything at once."""
    base = [[1.0, 0, 1.0, 0.0], [0.7, 0, 1.0, 0.0], [1.0, 5, 1.0, 0.0], [1.3, 0, 0.8, 0.0], [1.0, 0, 1.0, 0.1],
            [0.0, 0, 1.0, 0.0], [0.6, 7, 0.9, 0.02], [2.0, V, 0.5, 0.0], [1.0, 1, 1.0, 0.0]]
    return torch.tensor([base[i % len(base)] for i in range(R)], dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [1, 3, 257, 1500])
def test_cdf_sample_matches_reference_and_inverts(dtype, V):
    from fastverify.kernels import sampling as ks
    from fastverify.reference import sampling as rs

    g = _gen(V)
    R = 9
    logits = (torch.randn(R, V, generator=g) * 3).to(dtype)
    if V > 8:
        logits[:, 4] = logits[:, 6]  # exact ties
        logits[1, : V // 2] = float("-inf")
    warp = _warps(R, V, g)
    u = torch.rand(R, generator=g)
    got = ks.cdf_sample(logits.to(DEV), u.to(DEV), warp.to(DEV)).cpu()
    assert torch.equal(got, rs.cdf_sample(logits, u, warp))

    v = torch.rand(R, generator=g, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
    inv = ks.cdf_invert(logits.to(DEV), got.to(DEV), v.to(DEV), warp.to(DEV)).cpu()
    assert inv.dtype == torch.float64 and not bool(inv.isnan().any())
    assert torch.equal(ks.cdf_sample(logits.to(DEV), inv.to(DEV), warp.to(DEV)).cpu(), got)
    ref = rs.cdf_invert(logits, got, v, warp)
    torch.testing.assert_close(inv, ref, atol=1e-6, rtol=0)

    # Arbitrary tokens: NaN exactly where the reference says the token cannot be drawn.
    tok = torch.randint(0, V, (R,), generator=g)
    inv = ks.cdf_invert(logits.to(DEV), tok.to(DEV), v.to(DEV), warp.to(DEV)).cpu()
    ref = rs.cdf_invert(logits, tok, v, warp)
    assert torch.equal(inv.isnan(), ref.isnan())
    ok = ~inv.isnan()
    back = ks.cdf_sample(logits.to(DEV), inv.nan_to_num(0.5).to(DEV), warp.to(DEV)).cpu()
    assert torch.equal(back[ok], tok[ok])


def test_cdf_invalid_rows():
    from fastverify.kernels import sampling as ks

    logits = torch.randn(4, 10)
    logits[0, 3] = float("nan")
    logits[1] = float("-inf")
    logits[2, 1] = float("inf")
    logits[3] = 3e38
    warp = torch.tensor([[1.0, 0, 1, 0]] * 3 + [[0.01, 0, 1, 0]])
    out = ks.cdf_sample(logits.to(DEV), torch.full((4,), 0.5, device=DEV), warp.to(DEV)).cpu()
    assert out.tolist() == [-1, -1, -1, -1]
    inv = ks.cdf_invert(logits.to(DEV), torch.zeros(4, dtype=torch.int64, device=DEV),
                        torch.full((4,), 0.5, device=DEV), warp.to(DEV)).cpu()
    assert bool(inv.isnan().all())


# ------------------------------------------------------------------------------------------------------------
# opcheck of every registered Triton op


def _tree_batch():
    parents = torch.tensor([-1, 0, 0, 1, -1, -1, 0, 1, 2], dtype=torch.int32, device=DEV)
    cu_nodes = torch.tensor([0, 4, 4, 9], dtype=torch.int32, device=DEV)
    prefix_len = torch.tensor([3, 0, 5], dtype=torch.int32, device=DEV)
    return parents, cu_nodes, prefix_len


OPCHECK_TESTS = ("test_schema", "test_faketensor", "test_autograd_registration")


def test_opcheck_tree_ops():
    from fastverify.kernels import tree as kt  # noqa: F401  (registers the ops)

    parents, cu_nodes, prefix_len = _tree_batch()
    ops = torch.ops.fastverify
    torch.library.opcheck(ops.tree_mask_bool_triton, (parents, cu_nodes, prefix_len, 5, 5), test_utils=OPCHECK_TESTS)
    torch.library.opcheck(ops.tree_mask_additive_triton, (parents, cu_nodes, prefix_len, 5, 5, torch.bfloat16),
                          test_utils=OPCHECK_TESTS)
    torch.library.opcheck(ops.tree_mask_packed_triton, (parents, cu_nodes, 5), test_utils=OPCHECK_TESTS)
    torch.library.opcheck(ops.tree_positions_triton, (parents, cu_nodes, prefix_len), test_utils=OPCHECK_TESTS)


def test_opcheck_tree_attention():
    from fastverify.kernels import attention as ka  # noqa: F401
    from fastverify.kernels import tree as kt

    parents, cu_nodes, prefix_len = _tree_batch()
    packed = kt.tree_mask_packed(parents, cu_nodes, 5)
    g = _gen(0)
    q = torch.randn(3, 4, 5, 16, generator=g).to(DEV)
    k = torch.randn(3, 2, 10, 16, generator=g).to(DEV)
    v = torch.randn(3, 2, 10, 16, generator=g).to(DEV)
    torch.library.opcheck(torch.ops.fastverify.tree_attention_triton, (q, k, v, packed, prefix_len, 0.25),
                          test_utils=OPCHECK_TESTS)


def test_opcheck_sampling_ops():
    from fastverify.kernels import sampling as ks  # noqa: F401

    g = _gen(1)
    ops = torch.ops.fastverify
    seed = torch.randint(0, 2**40, (6,), generator=g).to(DEV)
    pos = torch.arange(6, device=DEV)
    torch.library.opcheck(ops.uniform_triton, (seed, pos, torch.full_like(pos, 3)), test_utils=OPCHECK_TESTS)
    logits = torch.randn(3, 40, generator=g).to(DEV)
    warp = _warps(3, 40, g).to(DEV)
    u = torch.rand(3, generator=g).to(DEV)
    torch.library.opcheck(ops.cdf_sample_triton, (logits, u, warp), test_utils=OPCHECK_TESTS)
    tok = ops.cdf_sample_triton(logits, u, warp)
    torch.library.opcheck(ops.cdf_invert_triton, (logits, tok, u.double(), warp), test_utils=OPCHECK_TESTS)
    torch.library.opcheck(ops.aux_bits_triton, (torch.rand(70, generator=g).to(DEV),), test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("rule", [0, 4, 6, 7])
def test_opcheck_verify(rule):
    from fastverify.kernels import verify as kv  # noqa: F401

    parents, cu_nodes, _ = _tree_batch()
    g = _gen(rule)
    N, B, V = 9, 3, 50
    logits = torch.randn(N + B, V, generator=g).to(DEV)
    tokens = torch.randint(0, V, (N,), generator=g).to(DEV)
    rule_params = torch.tensor([[0.1, 0.3]] * B, device=DEV)
    warp = torch.tensor([[1.0, 0, 1, 0]] * B, device=DEV)
    u_sample = torch.rand(N + B, generator=g).to(DEV)
    u_accept = torch.rand(N, generator=g).to(DEV)
    args = (logits, tokens, cu_nodes, parents, rule_params, warp, None, u_sample, u_accept, None, rule, 1, 3)
    torch.library.opcheck(torch.ops.fastverify.verify_triton, args, test_utils=OPCHECK_TESTS)


def test_verify_empty_and_invalid():
    """No drafts at all (accept nothing, next token = the root row's argmax) and a request with a NaN row."""
    from fastverify.kernels import verify as kv
    from fastverify.reference import verify as rv

    g = _gen(5)
    B, V = 3, 33
    logits = torch.randn(B, V, generator=g)
    args = (logits, torch.zeros(0, dtype=torch.int64), torch.zeros(B + 1, dtype=torch.int32),
            torch.zeros(0, dtype=torch.int32), torch.zeros(B, 2), torch.tensor([[1.0, 0, 1, 0]] * B),
            None, torch.rand(B, generator=g), torch.zeros(0), None)
    for rule in range(8):
        got = kv.verify(*(a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args), rule, 0, 0)
        want = rv.verify(*args, rule, 0, 0)
        for x, y in zip(got, want):
            assert torch.equal(x.cpu(), y)
    parents, cu_nodes, _ = _tree_batch()
    logits = torch.randn(12, V, generator=g)
    logits[5, 2] = float("nan")  # the only row of request 1 (cu_nodes [0, 4, 4, 9]: its rows are 5 .. 5)
    tokens = torch.randint(0, V, (9,), generator=g)
    for rule in (0, 7):
        got = kv.verify(logits.to(DEV), tokens.to(DEV), cu_nodes, parents, torch.zeros(3, 2, device=DEV),
                        torch.tensor([[1.0, 0, 1, 0]] * 3, device=DEV), None, torch.rand(12, device=DEV),
                        torch.rand(9, device=DEV), None, rule, 0, 3)
        assert got[0].tolist()[1] == -1 and got[2].tolist()[1] == -1
        assert got[1][1].tolist() == [-1, -1, -1]

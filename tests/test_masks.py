"""Tree / block attention masks and positions: every backend against a plain-Python ancestor walk.

Backends: torch (reference), cpp (fastverify._C), triton (fastverify.kernels.tree, under TRITON_INTERPRET=1 on
CPU), cuda (csrc/cuda/tree.cu; skipped without a GPU).
"""

import os
import random

import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fastverify import _ext  # noqa: E402
from fastverify.ops.tree import block_mask, implemented_backends, tree_mask, tree_positions  # noqa: E402
from fastverify.tree import Tree, pack  # noqa: E402

MASK_OPS = ("tree_mask_bool", "tree_mask_additive", "tree_mask_packed", "tree_positions")


def _skip_reason(backend, ops, module="tree"):
    if backend == "torch":
        return None
    have = [op for op in ops if backend in implemented_backends(op, module)]
    if len(have) < len(ops):
        missing = sorted(set(ops) - set(have))
        return f"{backend} backend does not implement {missing} here (not built / not written / not importable)"
    device = torch.device("cuda" if backend in ("cuda",) or (backend == "triton" and torch.cuda.is_available())
                          else "cpu")
    if backend == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    if not _ext.backends(device)[backend]:
        return f"{backend} backend is not usable on {device} here"
    return None


def backend_params(ops, module="tree"):
    return [pytest.param(b, marks=pytest.mark.skipif(_skip_reason(b, ops, module) is not None,
                                                     reason=str(_skip_reason(b, ops, module))))
            for b in ("torch", "cpp", "triton", "cuda")]


def device_of(backend):
    if backend == "cuda" or (backend == "triton" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


# ------------------------------------------------------------------------------------------------------------
# Plain-Python references


def random_parents(n, rng, shape="random"):
    if shape == "chain":
        return [j - 1 for j in range(n)]
    if shape == "star":
        return [-1] * n
    if shape == "deep":  # mostly chains, occasional branches
        return [j - 1 if rng.random() < 0.85 else rng.randint(-1, j - 1) for j in range(n)]
    return [rng.randint(-1, j - 1) for j in range(n)]


def walk_ancestors(par, i):
    out = []
    while i != -1:
        out.append(i)
        i = par[i]
    return out


def walk_mask(trees, prefix_lens):
    """bool [B, n, P + n] by walking each node up to the root in Python."""
    B = len(trees)
    n = max([len(p) for p in trees], default=0)
    P = max(prefix_lens, default=0)
    m = torch.zeros(B, n, P + n, dtype=torch.bool)
    for b, par in enumerate(trees):
        m[b, :, :prefix_lens[b]] = True
        for i in range(len(par)):
            for j in walk_ancestors(par, i):
                m[b, i, P + j] = True
    return m


def walk_positions(trees, prefix_lens):
    return torch.tensor([prefix_lens[b] + len(walk_ancestors(par, i)) - 1
                         for b, par in enumerate(trees) for i in range(len(par))], dtype=torch.int64)


def batch(trees, device):
    parents = torch.tensor([p for par in trees for p in par], dtype=torch.int32, device=device)
    cu = [0]
    for par in trees:
        cu.append(cu[-1] + len(par))
    return parents, torch.tensor(cu, dtype=torch.int32, device=device)


def packed_from_bool(draft):
    n = draft.shape[-1]
    W = (n + 31) // 32
    out = torch.zeros(*draft.shape[:-1], W, dtype=torch.int64)
    for j in range(n):
        out[..., j // 32] |= draft[..., j].long() << (j % 32)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


CASES = {
    "single": ([7], [3]),
    "ragged": ([5, 0, 17, 1, 33], [4, 9, 0, 2, 11]),
    "empty_requests": ([0, 0, 0], [3, 0, 5]),
    "one_empty": ([0], [0]),
    "wide": ([64, 64], [16, 1]),
    "n512": ([512, 100], [8, 3]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", ["random", "chain", "star", "deep"])
@pytest.mark.parametrize("fmt", ["bool", "additive", "packed"])
@pytest.mark.parametrize("backend", backend_params(MASK_OPS))
def test_tree_mask_matches_ancestor_walk(backend, fmt, shape, case):
    sizes, plens = CASES[case]
    if backend == "triton" and device_of(backend).type == "cpu" and (max(sizes) > 64 or shape != "random"):
        pytest.skip("interpreted Triton: small random trees only, to keep the run short")
    rng = random.Random(hash((shape, case, fmt)) & 0xFFFF)
    trees = [random_parents(s, rng, shape) for s in sizes]
    dev = device_of(backend)
    parents, cu = batch(trees, dev)
    expected = walk_mask(trees, plens)
    prefix_len = torch.tensor(plens, dtype=torch.int32, device=dev)
    got = tree_mask(parents, cu, prefix_len, format=fmt, backend=backend)
    B, n, P = len(sizes), max(sizes), max(plens)
    if fmt == "bool":
        assert got.dtype == torch.bool and got.shape == (B, n, P + n)
        assert torch.equal(got.cpu(), expected)
    elif fmt == "additive":
        assert got.dtype == torch.float32 and got.shape == (B, 1, n, P + n)
        exp = torch.where(expected, 0.0, float("-inf"))[:, None]
        assert torch.equal(got.cpu(), exp)
    else:
        assert got.dtype == torch.int32 and got.shape == (B, n, (n + 31) // 32)
        assert torch.equal(got.cpu(), packed_from_bool(expected[:, :, P:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", backend_params(MASK_OPS))
def test_additive_dtypes(backend, dtype):
    rng = random.Random(1)
    trees = [random_parents(s, rng) for s in (9, 3, 0)]
    dev = device_of(backend)
    parents, cu = batch(trees, dev)
    got = tree_mask(parents, cu, torch.tensor([2, 0, 5], device=dev), format="additive", dtype=dtype,
                    backend=backend)
    assert got.dtype == dtype
    exp = torch.where(walk_mask(trees, [2, 0, 5]), 0.0, float("-inf")).to(dtype)[:, None]
    assert torch.equal(got.cpu(), exp)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", backend_params(MASK_OPS))
def test_positions_match_ancestor_walk(backend, case):
    sizes, plens = CASES[case]
    rng = random.Random(7)
    trees = [random_parents(s, rng, "deep") for s in sizes]
    dev = device_of(backend)
    parents, cu = batch(trees, dev)
    got = tree_positions(parents, cu, torch.tensor(plens, device=dev), backend=backend)
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), walk_positions(trees, plens))


@pytest.mark.parametrize("backend", backend_params(MASK_OPS))
def test_no_draft_at_all(backend):
    """N = 0 (every request empty) and B = 0: well-formed empty outputs."""
    dev = device_of(backend)
    parents = torch.zeros(0, dtype=torch.int32, device=dev)
    cu = torch.zeros(3, dtype=torch.int32, device=dev)
    plen = torch.tensor([4, 0], dtype=torch.int32, device=dev)
    assert tree_mask(parents, cu, plen, backend=backend).shape == (2, 0, 4)
    assert tree_mask(parents, cu, plen, format="additive", backend=backend).shape == (2, 1, 0, 4)
    assert tree_mask(parents, cu, plen, format="packed", backend=backend).shape == (2, 0, 0)
    assert tree_positions(parents, cu, plen, backend=backend).shape == (0,)
    cu0 = torch.zeros(1, dtype=torch.int32, device=dev)
    empty = torch.zeros(0, dtype=torch.int32, device=dev)
    assert tree_mask(parents, cu0, empty, backend=backend).shape == (0, 0, 0)
    assert tree_positions(parents, cu0, empty, backend=backend).shape == (0,)


@pytest.mark.parametrize("backend", backend_params(MASK_OPS))
def test_input_forms(backend):
    """int64 / non-contiguous parents, int prefix_len, parents=None (chains), cu_nodes=None (one request)."""
    dev = device_of(backend)
    trees = [[-1, 0, 0, 1], [-1, -1]]
    parents, cu = batch(trees, dev)
    exp = walk_mask(trees, [3, 3])
    strided = torch.stack([parents.long(), torch.zeros_like(parents.long())], 1)[:, 0]  # stride 2, int64
    assert not strided.is_contiguous()
    assert torch.equal(tree_mask(strided, cu.long(), 3, backend=backend).cpu(), exp)
    chains = walk_mask([[-1, 0, 1], [-1]], [2, 5])
    cu2 = torch.tensor([0, 3, 4], device=dev)
    assert torch.equal(tree_mask(None, cu2, torch.tensor([2, 5], device=dev), backend=backend).cpu(), chains)
    one = walk_mask([trees[0]], [6])
    assert torch.equal(tree_mask(parents[:4], None, 6, backend=backend).cpu(), one)


@pytest.mark.parametrize("fmt", ["bool", "additive", "packed"])
@pytest.mark.parametrize("backend", backend_params(MASK_OPS))
def test_block_masks(backend, fmt):
    dev = device_of(backend)
    sizes = torch.tensor([3, 0, 5], device=dev)
    plen = torch.tensor([2, 4, 1], device=dev)
    causal = block_mask(sizes, plen, kind="causal", format=fmt, backend=backend)
    chains = tree_mask(None, torch.tensor([0, 3, 3, 8], device=dev), plen, format=fmt, backend="torch")
    assert torch.equal(causal.cpu(), chains.cpu())
    bidi = block_mask(sizes, plen, kind="bidirectional", format="bool", backend=backend).cpu()
    exp = torch.zeros(3, 5, 4 + 5, dtype=torch.bool)
    for b, (k, p) in enumerate(zip([3, 0, 5], [2, 4, 1])):
        exp[b, :, :p] = True
        exp[b, :k, 4:4 + k] = True
    assert torch.equal(bidi, exp)
    got = block_mask(sizes, plen, kind="bidirectional", format=fmt, backend=backend).cpu()
    if fmt == "packed":
        assert torch.equal(got, packed_from_bool(exp[:, :, 4:]))
    elif fmt == "additive":
        assert torch.equal(got, torch.where(exp, 0.0, float("-inf"))[:, None])
    # an int block size with an int prefix: one request
    assert block_mask(4, 2, kind="bidirectional").shape == (1, 4, 6)
    assert block_mask(4, torch.tensor([1, 2]), kind="causal").shape == (2, 4, 6)
    assert torch.equal(block_mask(cu_nodes=torch.tensor([0, 3, 3, 8], device=dev), prefix_len=plen).cpu(),
                       block_mask(sizes, plen).cpu())


def test_tree_objects_through_pack():
    trees = [Tree.from_sequences([[1, 2, 3], [1, 2, 4], [1, 5]]), Tree([], []), Tree.from_choices(
        [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], [[5, 6], [7, 8], [9]])]
    tokens, cu, parents = pack(trees)
    got = tree_mask(parents, cu, torch.tensor([2, 3, 1]), backend="torch")
    assert torch.equal(got, walk_mask([t.parents.tolist() for t in trees], [2, 3, 1]))
    pos = tree_positions(parents, cu, torch.tensor([2, 3, 1]))
    assert torch.equal(pos, torch.cat([t.depth.long() + p - 1 for t, p in zip(trees, [2, 3, 1])]))


# ------------------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("backend", backend_params(MASK_OPS))
def test_bad_input(backend):
    dev = device_of(backend)
    cu = torch.tensor([0, 3], dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="parents: node 1 of request 0 has parent 1, which does not precede"):
        tree_mask(torch.tensor([-1, 1, 0], device=dev), cu, 0, backend=backend)
    with pytest.raises(ValueError, match="parents: node 2 of request 0 has parent 5, which is out of range"):
        tree_mask(torch.tensor([-1, 0, 5], device=dev), cu, 0, backend=backend)
    with pytest.raises(ValueError, match="parents: node 0 of request 0 has parent -2"):
        tree_positions(torch.tensor([-2, 0, 1], device=dev), cu, 0, backend=backend)
    with pytest.raises(TypeError, match="parents: expected an integer tensor"):
        tree_mask(torch.tensor([-1.0, 0.0, 1.0], device=dev), cu, 0, backend=backend)
    with pytest.raises(ValueError, match=r"parents: expected 3 entries \(cu_nodes\[-1\]\), got 2"):
        tree_mask(torch.tensor([-1, 0], device=dev), cu, 0, backend=backend)
    with pytest.raises(ValueError, match="cu_nodes: must start at 0"):
        tree_mask(torch.tensor([-1, 0], device=dev), torch.tensor([1, 2], device=dev), 0, backend=backend)
    with pytest.raises(ValueError, match="cu_nodes: offsets must be non-decreasing"):
        tree_mask(torch.tensor([-1, 0], device=dev), torch.tensor([0, 3, 2], device=dev), 0, backend=backend)
    with pytest.raises(ValueError, match="prefix_len: must be >= 0"):
        tree_mask(torch.tensor([-1, 0, 1], device=dev), cu, -1, backend=backend)
    with pytest.raises(ValueError, match=r"prefix_len: expected 1 entries \(one per request\), got 2"):
        tree_mask(torch.tensor([-1, 0, 1], device=dev), cu, torch.tensor([1, 2], device=dev), backend=backend)
    with pytest.raises(ValueError, match="format: expected one of"):
        tree_mask(torch.tensor([-1, 0, 1], device=dev), cu, 0, format="dense", backend=backend)
    with pytest.raises(TypeError, match="dtype: the additive mask needs a floating dtype"):
        tree_mask(torch.tensor([-1, 0, 1], device=dev), cu, 0, format="additive", dtype=torch.int32,
                  backend=backend)
    with pytest.raises(ValueError, match="kind: expected 'causal' or 'bidirectional'"):
        block_mask(3, 0, kind="full")


def test_bad_backend_name():
    with pytest.raises(ValueError, match="backend: expected one of"):
        tree_mask(torch.tensor([-1]), None, 0, backend="numpy")


@pytest.mark.skipif(_skip_reason("cpp", MASK_OPS) is not None, reason=str(_skip_reason("cpp", MASK_OPS)))
def test_cpp_kernel_checks_without_python_validation():
    """The C++ binding re-checks the layout itself: no out-of-bounds read even when the wrapper skips it."""
    ops = torch.ops.fastverify
    cu = torch.tensor([0, 3], dtype=torch.int32)
    plen = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="parents: node 2 of request 0 has parent 7"):
        ops.tree_mask_bool(torch.tensor([-1, 0, 7], dtype=torch.int32), cu, plen, 3, 2)
    with pytest.raises(RuntimeError, match="n: request 0 has 3 nodes, more than n = 2"):
        ops.tree_mask_packed(torch.tensor([-1, 0, 1], dtype=torch.int32), cu, 2)
    with pytest.raises(RuntimeError, match="prefix_len: entry 0 = 2 not in"):
        ops.tree_mask_additive(torch.tensor([-1, 0, 1], dtype=torch.int32), cu, plen, 3, 1, torch.float32)
    with pytest.raises(RuntimeError, match="cu_nodes: last offset 4 must equal the number of nodes 3"):
        ops.tree_positions(torch.tensor([-1, 0, 1], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
                           plen)
    with pytest.raises(ValueError, match="parents: node 1"):  # the wrapper with validate=False still hits the check
        try:
            tree_mask(torch.tensor([-1, 1, 0]), None, 0, backend="cpp", validate=False)
        except RuntimeError as e:
            raise ValueError(str(e)) from e


# ------------------------------------------------------------------------------------------------------------
# opcheck of the compiled ops


def _opcheck_args(device):
    rng = random.Random(3)
    trees = [random_parents(s, rng) for s in (6, 0, 40)]
    parents, cu = batch(trees, device)
    plen = torch.tensor([3, 1, 5], dtype=torch.int32, device=device)
    return parents, cu, plen, 40, 5


@pytest.mark.parametrize("backend", [b for b in backend_params(MASK_OPS) if b.values[0] in ("cpp", "cuda")])
def test_opcheck(backend):
    parents, cu, plen, n, P = _opcheck_args(device_of(backend))
    ops = torch.ops.fastverify
    torch.library.opcheck(ops.tree_mask_bool, (parents, cu, plen, n, P))
    torch.library.opcheck(ops.tree_mask_additive, (parents, cu, plen, n, P, torch.bfloat16))
    torch.library.opcheck(ops.tree_mask_packed, (parents, cu, n))
    torch.library.opcheck(ops.tree_positions, (parents, cu, plen))

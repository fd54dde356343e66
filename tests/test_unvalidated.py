"""validate=False: the ops skip their data checks (no host read-back), and promise for malformed input only that
nothing is accessed out of bounds: results unspecified, or an error from a backend that checks on its own (the C++
kernels do, for free on the CPU). Here malformed offsets, parents and draft tokens go through verify under every
rule and through the tree ops, on every backend; the Triton kernels run under checked_memory (tests/triton_bounds.py),
which fails a load or store outside the launch's tensors, which the interpreter itself would not notice.
scripts/gpu_check.sh runs this file under compute-sanitizer on a GPU for the CUDA kernels."""

import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import fastverify as fv  # noqa: E402
from fastverify.ops.verify import available_backends  # noqa: E402
from fastverify.ops.tree import implemented_backends  # noqa: E402

from conftest import backend_params, device_of  # noqa: E402
from triton_bounds import OutOfBounds, checked_memory  # noqa: E402

V = 11
GOOD_CU, GOOD_PARENTS, GOOD_TOKENS = [0, 2, 5], [-1, 0, -1, 0, 1], [3, 4, 5, 6, 7]
MALFORMED = {  # (cu_nodes, parents, draft tokens) over N = 5 nodes
    "offsets past N": ([0, 2, 9], GOOD_PARENTS, GOOD_TOKENS),
    "negative offset": ([0, -3, 5], GOOD_PARENTS, GOOD_TOKENS),
    "decreasing offsets": ([0, 4, 2], GOOD_PARENTS, GOOD_TOKENS),
    "offsets not from 0": ([3, 4, 5], GOOD_PARENTS, GOOD_TOKENS),
    "parents past their node": (GOOD_CU, [-1, 7, -1, 0, 9], GOOD_TOKENS),
    "parents at their node": (GOOD_CU, [0, 1, -1, 1, 2], GOOD_TOKENS),
    "parents below -1": (GOOD_CU, [-1, -5, -1, 0, -9], GOOD_TOKENS),
    "tokens outside the vocabulary": (GOOD_CU, GOOD_PARENTS, [3, V, -4, 1 << 40, 2]),
}
RULES = [("greedy", {}), ("topk", {"k": 2}), ("distance", {"eps": 2.0}), ("gad", {"beta": 3, "tau": 1.0}),
         ("typical", {"eps": 0.3, "delta": 2.0}), ("confidence", {"beta": 0.2}),
         ("speculative", {"temperature": 1.0}), ("speculative", {"temperature": 1.0, "draft_probs": True}),
         ("speculative", {"temperature": 0.0}), ("coupled", {"temperature": 0.7})]


def _guard(backend):
    return checked_memory() if backend == "triton" and device_of(backend).type == "cpu" else contextlib.nullcontext()


@pytest.mark.parametrize("backend", backend_params(available_backends()))
@pytest.mark.parametrize("case", list(MALFORMED))
def test_verify_never_reads_out_of_bounds(backend, case):
    dev = device_of(backend)
    cu, parents, tokens = MALFORMED[case]
    g = torch.Generator().manual_seed(len(case))
    N, B = len(tokens), len(cu) - 1
    for rule, params in RULES:
        kw = dict(params)
        if kw.pop("draft_probs", False):
            kw["draft_probs"] = torch.rand(N, V, generator=g).to(dev)
        if rule in ("speculative", "coupled"):
            kw.update(seed=torch.tensor([1, 2], device=dev), position=torch.tensor([0, 4], device=dev))
        for max_depth in (4, None):
            args = (torch.randn(N + B, V, generator=g).to(dev), torch.tensor(tokens, device=dev),
                    torch.tensor(cu, dtype=torch.int32, device=dev), torch.tensor(parents, dtype=torch.int32,
                                                                                  device=dev))
            try:
                with _guard(backend):
                    out = fv.verify(*args, rule=rule, backend=backend, validate=False, max_depth=max_depth, **kw)
            except OutOfBounds:
                raise
            except Exception as e:  # a backend that checks on its own: a clear error naming the argument
                cause = e.__cause__ or e
                if isinstance(cause, OutOfBounds):
                    raise cause
                assert isinstance(e, (ValueError, RuntimeError)), (rule, repr(e))
                assert any(name in str(e) for name in ("cu_nodes", "parents", "draft_tokens")), (rule, str(e))
                continue
            assert out.accept_len.shape == (B,) and out.next_token.shape == (B,), rule
            assert out.accepted.shape[0] == B and (max_depth is None or out.accepted.shape[1] == max_depth), rule


@pytest.mark.parametrize("backend", backend_params(implemented_backends("tree_mask_bool")))
@pytest.mark.parametrize("case", [c for c in MALFORMED if "tokens" not in c])
def test_tree_ops_never_read_out_of_bounds(backend, case):
    dev = device_of(backend)
    cu, parents, _ = MALFORMED[case]
    par, cu = torch.tensor(parents, dtype=torch.int32, device=dev), torch.tensor(cu, dtype=torch.int32, device=dev)
    plen = torch.tensor([3, 4], dtype=torch.int32, device=dev)
    calls = [lambda f=f: fv.tree_mask(par, cu, plen, format=f, backend=backend, validate=False, max_nodes=4,
                                      max_prefix=4) for f in ("bool", "additive", "packed")]
    calls.append(lambda: fv.tree_positions(par, cu, plen, backend=backend, validate=False))
    for call in calls:
        try:
            with _guard(backend):
                call()
        except Exception as e:
            cause = e.__cause__ or e
            if isinstance(cause, OutOfBounds):
                raise cause
            assert isinstance(e, (ValueError, RuntimeError)) and ("cu_nodes" in str(e) or "parents" in str(e)), \
                repr(e)


def test_checked_memory_catches_a_stray_load():
    """The checker itself: a kernel told a longer length than its tensor reads past it, and is caught."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    if torch.cuda.is_available():
        pytest.skip("checked_memory works on the interpreter (CPU) only")

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)

    src, dst = torch.arange(8, dtype=torch.float32), torch.empty(16)
    with checked_memory():
        copy[(1,)](src, dst, 8, BLOCK=16)
        assert torch.equal(dst[:8], src)
        with pytest.raises(Exception) as info:
            copy[(1,)](src, dst, 12, BLOCK=16)
    assert "outside every tensor argument" in str(info.value)


@pytest.mark.parametrize("backend", backend_params(available_backends()))
def test_tokens_outside_the_vocabulary_are_never_accepted(backend):
    """Read as any token of the vocabulary, each out-of-vocabulary node here would be accepted: its row's argmax is
    token 0 (the id a clamp gives), and min_accept forces the most likely path. Every backend that does not refuse
    the input accepts none of them, and the deterministic rules agree with the reference."""
    dev = device_of(backend)
    parents, tokens = [-1, 0, -1, 2, -1, 4], [V, 0, -1, 0, 1 << 40, 0]  # three chains, each headed by a bad token
    cu = [0, 6]
    logits = torch.full((7, V), -30.0)
    logits[:, 0] = 5.0  # every row's argmax is token 0
    for rule, params in RULES:
        kw = dict(params)
        if kw.pop("draft_probs", False):
            kw["draft_probs"] = torch.full((6, V), 1.0 / V).to(dev)
        if rule in ("speculative", "coupled"):
            kw.update(seed=torch.tensor([1], device=dev), position=torch.tensor([0], device=dev))
        for min_accept in ((0, 2) if rule not in ("speculative", "coupled") else (0,)):
            if min_accept:
                kw["min_accept"] = min_accept
            args = (logits.to(dev), torch.tensor(tokens, device=dev), torch.tensor(cu, dtype=torch.int32, device=dev),
                    torch.tensor(parents, dtype=torch.int32, device=dev))
            try:
                with _guard(backend):
                    out = fv.verify(*args, rule=rule, backend=backend, validate=False, **kw)
            except (ValueError, RuntimeError) as e:
                assert not isinstance(e.__cause__, OutOfBounds) and "draft_tokens" in str(e), (rule, str(e))
                continue
            assert int(out.accept_len[0]) == 0 and int(out.next_token[0]) == 0, (rule, min_accept, out)
            if rule not in ("speculative", "coupled"):
                ref = fv.verify(*(a.cpu() for a in args), rule=rule, backend="torch", validate=False,
                                **{k: v.cpu() if torch.is_tensor(v) else v for k, v in kw.items()})
                assert torch.equal(out.accepted.cpu(), ref.accepted), (rule, min_accept)

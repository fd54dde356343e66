"""The backend choice shared by every op (fastverify/ops/dispatch.py)."""

import pytest
import torch

import fastverify
from fastverify import _ext
from fastverify.ops import dispatch

CPU = torch.device("cpu")
OPS = tuple(dispatch._MODULE)


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_its_reference(op):
    has = dispatch.implemented_backends(op)
    assert has[0] == "torch" and set(has) <= set(dispatch.BACKENDS)
    assert dispatch.resolve(op, "torch", CPU) == "torch"
    assert callable(dispatch._lookup(op, "torch", CPU)[1])
    if _ext.HAS_CPP:
        assert "cpp" in has, f"fastverify._C registers no CPU kernel for {op}"
        assert dispatch.resolve(op, "auto", CPU) == "cpp"


def test_unknown_op_and_backend():
    with pytest.raises(KeyError, match="unknown op"):
        dispatch.implemented_backends("no_such_op")
    with pytest.raises(ValueError, match="backend: expected one of"):
        dispatch.resolve("verify", "nope", CPU)
    with pytest.raises(ValueError, match="does not implement"):
        dispatch.resolve("skinny_linear", "triton", CPU)


def test_resolved_once(monkeypatch):
    """After its first call, an op call pays a dictionary look-up for its backend, not the checks behind it."""
    calls = [
        lambda: fastverify.tree_positions(torch.tensor([-1, 0]), None, 3),
        lambda: fastverify.verify(torch.randn(2, 3, 5), torch.zeros(2, 2, dtype=torch.int64)),
        lambda: fastverify.verify(torch.randn(2, 3, 5), torch.zeros(2, 2, dtype=torch.int64), rule="coupled",
                                  seed=1, position=torch.arange(2)),
        lambda: fastverify.cdf_sample(torch.randn(2, 5), torch.full((2,), 0.5)),
    ]
    for call in calls:
        call()
    resolved = []
    real = dispatch.resolve_backend
    monkeypatch.setattr(dispatch, "resolve_backend", lambda *a, **k: resolved.append(a) or real(*a, **k))
    for call in calls * 2:
        call()
    assert resolved == []


def test_explicit_backend_that_cannot_run_here():
    if _ext.backends(CPU)["cuda"]:
        pytest.skip("cuda is usable on CPU tensors here")
    with pytest.raises((RuntimeError, ValueError), match="backend"):
        fastverify.verify(torch.randn(1, 2, 4), torch.zeros(1, 1, dtype=torch.int64), backend="cuda")


@pytest.mark.parametrize("op", ["tree_attention", "masked_attention", "skinny_linear"])
def test_op_without_cuda_kernel(monkeypatch, op):
    """An op fastverify._C registers for CPU only has no cuda backend, even in a build with CUDA kernels, and an
    explicit backend="cuda" says so."""
    monkeypatch.setattr(_ext, "HAS_CUDA_KERNELS", True)  # as in a CUDA build: the registrations decide
    has = dispatch.implemented_backends.__wrapped__(op)
    assert "cuda" not in has
    if _ext.HAS_CPP:
        assert "cpp" in has
    with pytest.raises(ValueError, match=f"backend: 'cuda' does not implement {op}"):
        dispatch.resolve_backend("cuda", CPU, has=has, op=op)

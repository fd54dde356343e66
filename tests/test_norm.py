"""fastverify::rms_norm (csrc/norm.cpp): transformers' RMSNorm of a float32 tensor, bit for bit, in one call."""

import pytest
import torch

import fastverify  # noqa: F401  (loads fastverify._C)
from fastverify import _ext
from fastverify.hf import layers as hf_layers

from conftest import float_bits

transformers = pytest.importorskip("transformers")

needs_op = pytest.mark.skipif(_ext.compiled_op("rms_norm") is None,
                              reason="fastverify._C is not built or has no rms_norm kernel")


def module_norm(weight, eps):
    """transformers' LlamaRMSNorm with this weight and eps: the reference."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    m = LlamaRMSNorm(weight.shape[0], eps=eps)
    with torch.no_grad():
        m.weight.copy_(weight)
    return m


@needs_op
@pytest.mark.parametrize("D", [1, 3, 64, 576, 2048])
@pytest.mark.parametrize("rows", [1, 7, 130, 700])
def test_rms_norm_is_the_module_bit_for_bit(D, rows):
    g = torch.Generator().manual_seed(D * 1000 + rows)
    for eps in (1e-5, 1e-6, 0.0):
        x = torch.randn(rows, D, generator=g) * float(torch.rand(1, generator=g) * 50 + 0.01)
        w = torch.randn(D, generator=g)
        with torch.no_grad():
            want = module_norm(w, eps)(x)
        got = torch.ops.fastverify.rms_norm(x, w, eps)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert torch.equal(float_bits(got), float_bits(want)), (D, rows, eps)


@needs_op
def test_rms_norm_leading_dims_empty_rows_and_special_values():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, generator=g)
    x = torch.randn(2, 3, 96, generator=g)
    x[0, 0] = 0.0                # a zero row: rsqrt(eps)
    x[0, 1, 7] = float("nan")    # NaN spreads over its row, as in torch
    x[1, 2, 3] = float("inf")
    x[1, 0, :4] = 3e38           # squares overflow to inf
    for eps in (1e-5, 0.0):
        want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        assert torch.equal(float_bits(torch.ops.fastverify.rms_norm(x, w, eps)), float_bits(want))
    empty = torch.ops.fastverify.rms_norm(torch.empty(0, 4, 96), w, 1e-5)
    assert empty.shape == (0, 4, 96)


@needs_op
def test_rms_norm_of_a_non_contiguous_x_is_that_of_its_contiguous_copy():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 10, generator=g).t()  # [10, 64], the last dimension strided
    w = torch.randn(64, generator=g)
    assert torch.equal(torch.ops.fastverify.rms_norm(x, w, 1e-6), torch.ops.fastverify.rms_norm(x.contiguous(), w, 1e-6))
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(torch.ops.fastverify.rms_norm(x, w, 1e-6), want)


@needs_op
def test_rms_norm_opcheck():
    g = torch.Generator().manual_seed(7)
    torch.library.opcheck(torch.ops.fastverify.rms_norm.default, (torch.randn(3, 40, generator=g),
                                                                  torch.randn(40, generator=g), 1e-5))


@needs_op
@pytest.mark.parametrize("x, w, eps, match", [
    (torch.zeros(2, 8, dtype=torch.float64), torch.zeros(8), 1e-5, "x: expected a float32"),
    (torch.zeros(()), torch.zeros(1), 1e-5, "x: expected a float32 CPU tensor"),
    (torch.zeros(2, 8), torch.zeros(7), 1e-5, r"weight: expected a float32 CPU tensor of shape \[8\]"),
    (torch.zeros(2, 8), torch.zeros(8, dtype=torch.float16), 1e-5, "weight: expected a float32"),
    (torch.zeros(2, 8), torch.zeros(8), -1e-5, "eps: expected a finite number >= 0"),
    (torch.zeros(2, 8), torch.zeros(8), float("nan"), "eps: expected a finite number >= 0"),
])
def test_rms_norm_bad_input_names_the_argument(x, w, eps, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.fastverify.rms_norm(x, w, eps)


@needs_op
def test_lean_layers_norm_takes_the_op_only_where_it_gives_the_same_float_bits(monkeypatch):
    calls = []
    op = torch.ops.fastverify.rms_norm
    monkeypatch.setattr(hf_layers, "_rms_op", lambda *a: calls.append(a[0].shape) or op(*a))
    w, x = torch.randn(32), torch.randn(3, 32)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    with torch.no_grad():
        assert torch.equal(hf_layers._rms(w, 1e-6, x), want)
        assert len(calls) == 1
        hf_layers._rms(w, 1e-6, x.t().contiguous().t())  # not contiguous: torch's ops
        hf_layers._rms(w.half(), 1e-6, x.half())         # not float32
    hf_layers._rms(w, 1e-6, x.requires_grad_())          # autograd: torch's ops (the op has no backward)
    assert len(calls) == 1

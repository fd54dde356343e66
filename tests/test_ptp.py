"""Tests of fastverify.ptp: the auxiliary-variable embedding and the Beta(a, a) in-bin positions."""

import pytest
import torch

import fastverify
from fastverify import ptp


def test_bits_mode_is_linear_in_aux_bits():
    torch.manual_seed(0)
    emb = ptp.AuxiliaryEmbedding(16, mode="bits")
    u = fastverify.uniform(5, torch.arange(12).reshape(3, 4))
    out = emb(u)
    assert out.shape == (3, 4, 16) and out.dtype == torch.float32
    bits = fastverify.aux_bits(u)
    assert torch.allclose(out, bits @ emb.proj.weight.t() + emb.proj.bias, atol=1e-6)
    # different u -> different embeddings; gradients reach the projection
    assert not torch.allclose(out[0, 0], out[0, 1])
    out.sum().backward()
    assert emb.proj.weight.grad is not None and emb.proj.weight.grad.abs().sum() > 0


def test_interp_mode_interpolates():
    torch.manual_seed(0)
    emb = ptp.AuxiliaryEmbedding(8, mode="interp", dtype=torch.float64)
    u = torch.tensor([0.0, 0.25, 1.0])
    out = emb(u)
    e0, e1 = emb.ends[0], emb.ends[1]
    assert torch.allclose(out[0], e0) and torch.allclose(out[2], e1)
    assert torch.allclose(out[1], 0.75 * e0 + 0.25 * e1)
    assert out.dtype == torch.float64


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        ptp.AuxiliaryEmbedding(8, mode="sin")
    with pytest.raises(ValueError, match="hidden_size"):
        ptp.AuxiliaryEmbedding(0)
    with pytest.raises(TypeError, match="u:"):
        ptp.AuxiliaryEmbedding(8)(torch.arange(3))


def test_beta_v_and_training_round_trip():
    """PTP training data: u = cdf_invert(teacher token, v ~ Beta(a, a)) maps back to the token."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 500, generator=g) * 2
    token = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[:, 0]
    v = ptp.beta_v(64, a=4.0, generator=g)
    assert v.dtype == torch.float32 and bool(((v > 0) & (v < 1)).all())
    u = fastverify.cdf_invert(logits, token, v, top_p=0.95)
    ok = ~torch.isnan(u)
    assert torch.equal(fastverify.cdf_sample(logits[ok], u[ok], top_p=0.95), token[ok])
    emb = ptp.AuxiliaryEmbedding(32)
    assert emb(u[ok].float()).shape == (int(ok.sum()), 32)

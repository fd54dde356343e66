"""fastverify::rotary_embedding (csrc/rotary.cpp): transformers' rotary embedding of one float32 tensor, bit for bit,
in one call."""

import pytest
import torch

import fastverify  # noqa: F401  (loads fastverify._C)
from fastverify import _ext

from conftest import float_bits

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import rotate_half  # noqa: E402

needs_op = pytest.mark.skipif(_ext.compiled_op("rotary_embedding") is None,
                              reason="fastverify._C is not built or has no rotary_embedding kernel")


def reference(x, cos, sin):
    """transformers' apply_rotary_pos_emb for one tensor (cos / sin already with their head dimension)."""
    return (x * cos) + (rotate_half(x) * sin)


@needs_op
@pytest.mark.parametrize("D", [2, 16, 64, 128])
@pytest.mark.parametrize("B, H, n", [(1, 12, 1), (1, 12, 7), (3, 5, 9), (2, 4, 700)])
def test_rotary_embedding_is_transformers_bit_for_bit(D, B, H, n):
    g = torch.Generator().manual_seed(D * 7 + n)
    # x as the lean layers pass it: q and k heads of a [B, n, heads, D] projection, transposed (a view)
    x = torch.randn(B, n, H + 3, D, generator=g)[:, :, :H].transpose(1, 2) * 10
    angles = torch.rand(B, n, D // 2, generator=g).repeat(1, 1, 2) * 50
    for cb in (B, 1):
        cos, sin = angles[:cb].cos().unsqueeze(1), angles[:cb].sin().unsqueeze(1)
        got = torch.ops.fastverify.rotary_embedding(x, cos, sin)
        want = reference(x, cos, sin)
        assert got.shape == want.shape and got.is_contiguous()
        assert torch.equal(float_bits(got), float_bits(want)), (D, B, H, n, cb)


@needs_op
def test_rotary_embedding_special_values_broadcast_and_empty():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 4, 8, generator=g)
    x[0, 0, 0, 1] = float("nan")
    x[1, 2, 3, 6] = float("inf")
    x[0, 1, 2] = 3e38
    cos, sin = torch.randn(1, 1, 4, 8, generator=g), torch.randn(1, 1, 4, 8, generator=g)
    cos[0, 0, 1, 2] = 0.0
    assert torch.equal(float_bits(torch.ops.fastverify.rotary_embedding(x, cos, sin)), float_bits(reference(x, cos, sin)))
    per_head = torch.randn(2, 3, 1, 8, generator=g)  # one angle set per (batch, head), broadcast over the rows
    assert torch.equal(float_bits(torch.ops.fastverify.rotary_embedding(x, per_head, per_head)),
                       float_bits(reference(x, per_head, per_head)))
    empty = torch.ops.fastverify.rotary_embedding(torch.empty(1, 3, 0, 8), torch.empty(1, 1, 0, 8),
                                                  torch.empty(1, 1, 0, 8))
    assert empty.shape == (1, 3, 0, 8)


@needs_op
def test_rotary_embedding_strided_last_dimension():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 2, 16, 5, generator=g).transpose(2, 3)  # [1, 2, 5, 16], last dimension strided
    cos = torch.randn(1, 1, 16, 5, generator=g).transpose(2, 3)
    sin = torch.randn(1, 1, 5, 16, generator=g)
    assert torch.equal(float_bits(torch.ops.fastverify.rotary_embedding(x, cos, sin)), float_bits(reference(x, cos, sin)))


@needs_op
def test_rotary_embedding_opcheck():
    g = torch.Generator().manual_seed(5)
    torch.library.opcheck(torch.ops.fastverify.rotary_embedding.default,
                          (torch.randn(1, 3, 2, 8, generator=g), torch.randn(1, 1, 2, 8, generator=g),
                           torch.randn(1, 1, 2, 8, generator=g)))


@needs_op
@pytest.mark.parametrize("x, cos, sin, match", [
    (torch.zeros(1, 2, 3, 8, dtype=torch.float64), torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8),
     "x: expected a 4-D float32 CPU tensor"),
    (torch.zeros(2, 3, 8), torch.zeros(1, 3, 8), torch.zeros(1, 3, 8), "x: expected a 4-D float32 CPU tensor"),
    (torch.zeros(1, 2, 3, 7), torch.zeros(1, 1, 3, 7), torch.zeros(1, 1, 3, 7), "x: expected an even last dimension"),
    (torch.zeros(1, 2, 3, 8), torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 2, 8), "cos, sin: expected the same shape"),
    (torch.zeros(1, 2, 3, 8), torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8), "cos, sin: expected a shape that"),
    (torch.zeros(1, 2, 3, 8), torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), "cos, sin: expected a shape that"),
    (torch.zeros(1, 2, 3, 8), torch.zeros(1, 1, 3, 8, dtype=torch.float16), torch.zeros(1, 1, 3, 8),
     "cos: expected a 4-D float32"),
])
def test_rotary_embedding_bad_input_names_the_argument(x, cos, sin, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.fastverify.rotary_embedding(x, cos, sin)

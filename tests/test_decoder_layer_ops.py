"""fastverify::decoder_pre_attention / decoder_post_attention (csrc/layer.cpp): the lean decoder layer's steps
around its attention, from C++, bit for bit the ops that fastverify.hf.layers' Python forward calls."""

import pytest
import torch
import torch.nn.functional as F

import fastverify  # noqa: F401  (loads fastverify._C)
from fastverify import _ext
from fastverify.ops.linear import pack_blocks

from conftest import float_bits
from test_linear import gguf_quantised

needs_ops = pytest.mark.skipif(_ext.compiled_op("decoder_pre_attention") is None,
                               reason="fastverify._C is not built or has no decoder layer ops")
ops = torch.ops.fastverify


def packed(N, K, kind, g):
    p = pack_blocks(gguf_quantised(N, K, kind, g))
    assert p is not None
    return p


def layer(g, E=64, D=16, n_q=4, n_kv=2, inter=96, bias=False):
    """Random packed weights of one layer: norms, q / k / v stacked, o, gate / up stacked, down (+ biases)."""
    qkv = packed((n_q + 2 * n_kv) * D, E, "q4_1", g)
    o = packed(E, n_q * D, "q8_0", g)
    gate_up = packed(2 * inter, E, "q4_1", g)
    down = packed(E, inter, "q4_0", g)
    b = (lambda n: torch.randn(n, generator=g) * 0.1) if bias else (lambda n: None)
    return dict(E=E, D=D, n_q=n_q, n_kv=n_kv, inter=inter, w1=torch.rand(E, generator=g) + 0.5,
                w2=torch.rand(E, generator=g) + 0.5, eps=1e-5, qkv=qkv, qkv_b=b(qkv.q.shape[0]), o=o, o_b=b(E),
                gate_up=gate_up, gate_up_b=b(2 * inter), down=down, down_b=b(E))


def lin(x, p, bias):
    return ops.skinny_linear_packed(x, p.q, p.d, p.m, p.bits, bias)


def python_pre(h, L, cos, sin):
    """fastverify.hf.layers._forward's steps before the attention (its float32 CPU path)."""
    B, S = h.shape[:2]
    qkv = lin(ops.rms_norm(h, L["w1"], L["eps"]), L["qkv"], L["qkv_b"]).view(B, S, -1, L["D"])
    nqk = L["n_q"] + L["n_kv"]
    qk = ops.rotary_embedding(qkv[..., :nqk, :].transpose(1, 2), cos, sin)
    return qk, qkv.transpose(1, 2)[:, nqk:]


def python_post(h, attn, L):
    """... and after it."""
    h = h + lin(attn.reshape(*h.shape[:2], -1).contiguous(), L["o"], L["o_b"])
    gu = lin(ops.rms_norm(h, L["w2"], L["eps"]), L["gate_up"], L["gate_up_b"])
    return h + lin(F.silu(gu[..., :L["inter"]]) * gu[..., L["inter"]:], L["down"], L["down_b"])


def pre_args(L):
    p = L["qkv"]
    return (L["w1"], L["eps"], p.q, p.d, p.m, p.bits, L["qkv_b"])


def post_args(L):
    o, gu, dn = L["o"], L["gate_up"], L["down"]
    return (o.q, o.d, o.m, o.bits, L["o_b"], L["w2"], L["eps"], gu.q, gu.d, gu.m, gu.bits, L["gate_up_b"],
            dn.q, dn.d, dn.m, dn.bits, L["down_b"])


def rotary_tables(B, S, D, g):
    angles = torch.rand(B, S, D // 2, generator=g).repeat(1, 1, 2) * 6.0
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


@needs_ops
@pytest.mark.parametrize("B,S", [(1, 1), (1, 5), (3, 2), (2, 17)])
@pytest.mark.parametrize("bias", [False, True])
def test_decoder_ops_are_the_python_steps_bit_for_bit(B, S, bias):
    g = torch.Generator().manual_seed(B * 100 + S + bias)
    L = layer(g, bias=bias)
    h = torch.randn(B, S, L["E"], generator=g)
    cos, sin = rotary_tables(B, S, L["D"], g)
    got = ops.decoder_pre_attention(h, *pre_args(L), cos, sin, L["n_q"], L["n_kv"])
    want = python_pre(h, L, cos, sin)
    for a, b, n in zip(got, want, (L["n_q"] + L["n_kv"], L["n_kv"])):
        assert a.shape == b.shape == (B, n, S, L["D"])
        assert torch.equal(float_bits(a), float_bits(b))
    attn = torch.randn(B, S, L["n_q"], L["D"], generator=g)  # the attention's output layout
    got = ops.decoder_post_attention(h, attn, *post_args(L))
    assert got.shape == h.shape
    assert torch.equal(float_bits(got), float_bits(python_post(h, attn, L)))


def head_norms(L, g):
    """Qwen3's q_norm / k_norm weights over a head's D dimensions, with their eps: (wq, eq, wk, ek)."""
    return (torch.rand(L["D"], generator=g) + 0.5, 1e-6, torch.rand(L["D"], generator=g) + 0.5, 1e-5)


def normed_qk(qkv, L, heads):
    """fastverify.hf.layers._forward's Qwen3 q / k: each head RMS-normed (its ``_rms``), q and k concatenated."""
    from fastverify.hf.layers import _rms
    wq, eq, wk, ek = heads
    nq, nqk = L["n_q"], L["n_q"] + L["n_kv"]
    return torch.cat((_rms(wq, eq, qkv[..., :nq, :]), _rms(wk, ek, qkv[..., nq:nqk, :])), -2).transpose(1, 2)


@needs_ops
@pytest.mark.parametrize("B,S", [(1, 1), (1, 5), (2, 3)])
@pytest.mark.parametrize("live", [False, True])
def test_decoder_pre_attention_with_head_norms_is_the_python_steps_bit_for_bit(B, S, live):
    """Qwen3: q_norm / k_norm over each head before the rotation (at B = S = 1 a head's slice is contiguous and
    ``_rms`` takes the rms_norm op; otherwise its expression); with and without live rows."""
    from fastverify.hf.layers import scatter_rows
    g = torch.Generator().manual_seed(B * 10 + S + live)
    L = layer(g)
    heads = head_norms(L, g)
    h = torch.randn(B, S, L["E"], generator=g)
    cos, sin = rotary_tables(B, S, L["D"], g)
    index = torch.arange(0, B * S, 2) if live else None
    x = h.reshape(-1, L["E"]) if index is None else h.reshape(-1, L["E"]).index_select(0, index)
    qkv = lin(ops.rms_norm(x, L["w1"], L["eps"]), L["qkv"], L["qkv_b"])
    qkv = (qkv if index is None else scatter_rows(qkv, index, B * S)).view(B, S, -1, L["D"])
    want = ops.rotary_embedding(normed_qk(qkv, L, heads), cos, sin), qkv.transpose(1, 2)[:, L["n_q"] + L["n_kv"]:]
    got = ops.decoder_pre_attention(h, *pre_args(L), cos, sin, L["n_q"], L["n_kv"], index, *heads)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(float_bits(a), float_bits(b))
    torch.library.opcheck(ops.decoder_pre_attention.default,
                          (h, *pre_args(L), cos, sin, L["n_q"], L["n_kv"], index, *heads))
    with pytest.raises(RuntimeError, match="q_norm_weight, k_norm_weight: expected both or neither"):
        ops.decoder_pre_attention(h, *pre_args(L), cos, sin, L["n_q"], L["n_kv"], index, heads[0], 1e-6)
    with pytest.raises(RuntimeError, match=r"k_norm_weight: expected \[D = 16\]"):
        ops.decoder_pre_attention(h, *pre_args(L), cos, sin, L["n_q"], L["n_kv"], index, heads[0], 1e-6,
                                  torch.ones(8), 1e-6)


@needs_ops
@pytest.mark.parametrize("bias", [False, True])
def test_decoder_ops_on_live_rows_are_the_python_steps_bit_for_bit(bias):
    """index: the live rows of a batch's forward (fastverify.hf.layers.LiveRows), computed alone and scattered back
    between zeros, as the Python forward's index_select / scatter_rows do."""
    from fastverify.hf.layers import scatter_rows
    g = torch.Generator().manual_seed(21 + bias)
    L = layer(g, bias=bias)
    B, S = 3, 4
    index = torch.tensor([0, 1, 2, 3, 4, 8, 9])
    h = torch.randn(B, S, L["E"], generator=g)
    cos, sin = rotary_tables(B, S, L["D"], g)
    rows = h.reshape(-1, L["E"]).index_select(0, index)
    qkv = lin(ops.rms_norm(rows, L["w1"], L["eps"]), L["qkv"], L["qkv_b"])
    qkv = scatter_rows(qkv, index, B * S).view(B, S, -1, L["D"])
    nqk = L["n_q"] + L["n_kv"]
    want = ops.rotary_embedding(qkv[..., :nqk, :].transpose(1, 2), cos, sin), qkv.transpose(1, 2)[:, nqk:]
    got = ops.decoder_pre_attention(h, *pre_args(L), cos, sin, L["n_q"], L["n_kv"], index)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(float_bits(a), float_bits(b))
    attn = torch.randn(B, S, L["n_q"], L["D"], generator=g)
    h1 = rows + lin(attn.reshape(B * S, -1).index_select(0, index).contiguous(), L["o"], L["o_b"])
    gu = lin(ops.rms_norm(h1, L["w2"], L["eps"]), L["gate_up"], L["gate_up_b"])
    h2 = h1 + lin(F.silu(gu[..., :L["inter"]]) * gu[..., L["inter"]:], L["down"], L["down_b"])
    want = scatter_rows(h2, index, B * S).view(B, S, -1)
    got = ops.decoder_post_attention(h, attn, *post_args(L), index)
    assert got.shape == h.shape and torch.equal(float_bits(got), float_bits(want))
    with pytest.raises(RuntimeError, match="index: expected an int64 CPU tensor"):
        ops.decoder_pre_attention(h, *pre_args(L), cos, sin, L["n_q"], L["n_kv"], index.int())
    with pytest.raises((RuntimeError, IndexError), match="out of range"):
        ops.decoder_post_attention(h, attn, *post_args(L), torch.tensor([0, B * S]))


@needs_ops
def test_decoder_ops_opcheck():
    g = torch.Generator().manual_seed(5)
    L = layer(g, bias=True)
    h = torch.randn(1, 3, L["E"], generator=g)
    cos, sin = rotary_tables(1, 3, L["D"], g)
    torch.library.opcheck(ops.decoder_pre_attention.default, (h, *pre_args(L), cos, sin, L["n_q"], L["n_kv"]))
    attn = torch.randn(1, 3, L["n_q"] * L["D"], generator=g)
    torch.library.opcheck(ops.decoder_post_attention.default, (h, attn, *post_args(L)))
    index = torch.tensor([0, 2])
    torch.library.opcheck(ops.decoder_pre_attention.default,
                          (h, *pre_args(L), cos, sin, L["n_q"], L["n_kv"], index))
    torch.library.opcheck(ops.decoder_post_attention.default, (h, attn, *post_args(L), index))


@needs_ops
def test_decoder_ops_bad_input_names_the_argument():
    g = torch.Generator().manual_seed(6)
    L = layer(g)
    h = torch.randn(1, 2, L["E"], generator=g)
    cos, sin = rotary_tables(1, 2, L["D"], g)
    with pytest.raises(RuntimeError, match="h: expected a float32 CPU tensor"):
        ops.decoder_pre_attention(h.double(), *pre_args(L), cos, sin, L["n_q"], L["n_kv"])
    with pytest.raises(RuntimeError, match="h: expected a float32 CPU tensor"):
        ops.decoder_pre_attention(h[0], *pre_args(L), cos, sin, L["n_q"], L["n_kv"])
    with pytest.raises(RuntimeError, match="qkv_q: expected 160 output rows"):
        ops.decoder_pre_attention(h, *pre_args(L), cos, sin, L["n_q"], L["n_kv"] + 1)
    with pytest.raises(RuntimeError, match="n_q, n_kv: expected >= 1"):
        ops.decoder_pre_attention(h, *pre_args(L), cos, sin, 0, L["n_kv"])
    with pytest.raises(RuntimeError, match="cos: expected"):
        ops.decoder_pre_attention(h, *pre_args(L), cos[0], sin[0], L["n_q"], L["n_kv"])
    with pytest.raises(RuntimeError, match="attn: expected"):
        ops.decoder_post_attention(h, torch.randn(1, 3, 64), *post_args(L))
    args = list(post_args(L))
    args[7] = args[7][:-1]  # gate / up stacked: an even number of rows
    with pytest.raises(RuntimeError, match="gate_up_q: expected"):
        ops.decoder_post_attention(h, torch.randn(1, 2, 64), *args)
    attn = torch.randn(1, 2, L["n_q"] * L["D"], generator=g)
    with pytest.raises(RuntimeError, match="attn: expected a float32 CPU tensor"):
        ops.decoder_post_attention(h, attn.double(), *post_args(L))
    args = list(post_args(L))
    args[5] = args[5][:-1]  # the post-attention norm's weight
    with pytest.raises(RuntimeError, match=r"norm_weight: expected \[E = 64\]"):
        ops.decoder_post_attention(h, attn, *args)
    args = list(post_args(L))
    args[12:15] = (L["o"].q, L["o"].d, L["o"].m)  # a down projection from the attention's width, not I
    with pytest.raises(RuntimeError, match=r"down_q: expected shape \[N, K \* bits / 8\] = \[64, 48\] for x's K = 96"):
        ops.decoder_post_attention(h, attn, *args)
    with pytest.raises(RuntimeError, match="norm_weight's eps: expected a finite number"):
        ops.decoder_pre_attention(h, L["w1"], float("nan"), *pre_args(L)[2:], cos, sin, L["n_q"], L["n_kv"])
    with pytest.raises(RuntimeError, match="cos, sin: expected a shape that broadcasts"):
        ops.decoder_pre_attention(h, *pre_args(L), cos.expand(1, 5, 2, L["D"]), sin.expand(1, 5, 2, L["D"]),
                                  L["n_q"], L["n_kv"])


@needs_ops
def test_decoder_ops_take_strided_inputs():
    """A transposed h and the attention's output as SDPA leaves it ([B, n_q, S, D] transposed to [B, S, n_q, D]),
    and cos / sin broadcast over the batch: the results of their contiguous copies, bit for bit."""
    g = torch.Generator().manual_seed(7)
    L = layer(g, bias=True)
    B, S = 2, 3
    h = torch.randn(S, B, L["E"], generator=g).transpose(0, 1)
    cos, sin = rotary_tables(1, S, L["D"], g)
    got = ops.decoder_pre_attention(h, *pre_args(L), cos, sin, L["n_q"], L["n_kv"])
    want = ops.decoder_pre_attention(h.contiguous(), *pre_args(L), cos.expand(B, -1, -1, -1).contiguous(),
                                     sin.expand(B, -1, -1, -1).contiguous(), L["n_q"], L["n_kv"])
    for a, b in zip(got, want):
        assert torch.equal(float_bits(a), float_bits(b))
    attn = torch.randn(B, L["n_q"], S, L["D"], generator=g).transpose(1, 2)
    got = ops.decoder_post_attention(h, attn, *post_args(L))
    assert torch.equal(float_bits(got), float_bits(ops.decoder_post_attention(h.contiguous(), attn.contiguous(),
                                                                              *post_args(L))))
    assert torch.equal(float_bits(got), float_bits(python_post(h.contiguous(), attn, L)))


def dense_layer(g, dtype, E=64, D=16, n_q=4, n_kv=2, inter=96, bias=False):
    """Random unpacked weights of one layer in ``dtype``."""
    w = lambda *shape: (torch.randn(*shape, generator=g) * 0.1).to(dtype)  # noqa: E731
    b = (lambda n: w(n)) if bias else (lambda n: None)
    return dict(E=E, D=D, n_q=n_q, n_kv=n_kv, inter=inter, eps=1e-6, w1=(torch.rand(E, generator=g) + 0.5).to(dtype),
                w2=(torch.rand(E, generator=g) + 0.5).to(dtype),
                qkv=[w(n_q * D, E), w(n_kv * D, E), w(n_kv * D, E)], qkv_b=[b(n_q * D), b(n_kv * D), b(n_kv * D)],
                o=w(E, n_q * D), o_b=b(E), gate_up=[w(inter, E), w(inter, E)], gate_up_b=[b(inter), b(inter)],
                down=w(E, inter), down_b=b(E))


def rms_expression(h, weight, eps):
    """transformers' RMSNorm, as fastverify.hf.layers._rms writes it outside the rms_norm op."""
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(h.dtype)


def linear_ref(x, w, b, skinny_rows):
    """A projection as its nn.Linear forward computes it (F.linear), or under skinny_linears' forward."""
    if skinny_rows and x.dtype == torch.float32 and x.numel() <= skinny_rows * x.shape[-1]:
        return ops.skinny_linear(x, w, b)
    return F.linear(x, w, b)


def python_pre_dense(h, L, cos, sin_rolled, skinny_rows=0):
    B, S = h.shape[:2]
    x = rms_expression(h, L["w1"], L["eps"])
    qkv = torch.cat([linear_ref(x, w, b, skinny_rows) for w, b in zip(L["qkv"], L["qkv_b"])], -1)
    qkv = qkv.view(B, S, -1, L["D"])
    nqk = L["n_q"] + L["n_kv"]
    qk = qkv[..., :nqk, :].transpose(1, 2)
    qk = qk * cos + qk.roll(L["D"] // 2, -1) * sin_rolled
    return qk, qkv.transpose(1, 2)[:, nqk:]


def python_post_dense(h, attn, L, skinny_rows=0):
    h = h + linear_ref(attn.reshape(*h.shape[:2], -1).contiguous(), L["o"], L["o_b"], skinny_rows)
    x = rms_expression(h, L["w2"], L["eps"])
    gu = torch.cat([linear_ref(x, w, b, skinny_rows) for w, b in zip(L["gate_up"], L["gate_up_b"])], -1)
    return h + linear_ref(F.silu(gu[..., :L["inter"]]) * gu[..., L["inter"]:], L["down"], L["down_b"], skinny_rows)


def dense_pre_args(L):
    return (L["w1"], L["eps"], L["qkv"], L["qkv_b"])


def dense_post_args(L):
    return (L["o"], L["o_b"], L["w2"], L["eps"], L["gate_up"], L["gate_up_b"], L["down"], L["down_b"])


def dense_tables(B, S, D, g, dtype):
    """cos, sin and sin_rolled = [-sin_lo, sin_hi]."""
    cos, sin = (t.to(dtype) for t in rotary_tables(B, S, D, g))
    return cos, sin, torch.cat((-sin[..., :D // 2], sin[..., D // 2:]), -1)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,S", [(1, 1), (3, 2), (2, 17)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("skinny_rows", [0, 6])
def test_dense_decoder_ops_are_the_python_steps_bit_for_bit(dtype, B, S, bias, skinny_rows):
    """The Python forward's steps on unpacked weights: F.linear, or skinny_linear for float32 inputs of at most
    skinny_rows rows (here some calls of the 34-row case go to F.linear); the norm and rotary ops on float32 CPU
    tensors, whose bits are the expressions'."""
    g = torch.Generator().manual_seed(B * 100 + S + bias)
    L = dense_layer(g, dtype, bias=bias)
    h = torch.randn(B, S, L["E"], generator=g).to(dtype)
    cos, sin, sin_rolled = dense_tables(B, S, L["D"], g, dtype)
    got = ops.decoder_pre_attention_dense(h, *dense_pre_args(L), cos, sin, sin_rolled, L["n_q"], L["n_kv"],
                                          skinny_rows)
    want = python_pre_dense(h, L, cos, sin_rolled, skinny_rows)
    for a, b, n in zip(got, want, (L["n_q"] + L["n_kv"], L["n_kv"])):
        assert a.shape == b.shape == (B, n, S, L["D"]) and a.dtype == dtype
        assert torch.equal(a, b)
    attn = torch.randn(B, S, L["n_q"], L["D"], generator=g).to(dtype)
    got = ops.decoder_post_attention_dense(h, attn, *dense_post_args(L), skinny_rows)
    assert got.dtype == dtype and torch.equal(got, python_post_dense(h, attn, L, skinny_rows))


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S", [(1, 1), (2, 3)])
@pytest.mark.parametrize("skinny_rows", [0, 6])
def test_dense_decoder_pre_attention_with_head_norms_is_the_python_steps_bit_for_bit(dtype, B, S, skinny_rows):
    g = torch.Generator().manual_seed(B * 10 + S + skinny_rows)
    L = dense_layer(g, dtype)
    heads = tuple(x.to(dtype) if isinstance(x, torch.Tensor) else x for x in head_norms(L, g))
    h = torch.randn(B, S, L["E"], generator=g).to(dtype)
    cos, sin, sin_rolled = dense_tables(B, S, L["D"], g, dtype)
    x = rms_expression(h, L["w1"], L["eps"])
    qkv = torch.cat([linear_ref(x, w, b, skinny_rows) for w, b in zip(L["qkv"], L["qkv_b"])], -1)
    qkv = qkv.view(B, S, -1, L["D"])
    qk = normed_qk(qkv, L, heads)
    if dtype == torch.float32:  # as _forward: the rotary op on float32 CPU tensors, else the expression
        qk = ops.rotary_embedding(qk, cos, sin)
    else:
        qk = qk * cos + qk.roll(L["D"] // 2, -1) * sin_rolled
    got = ops.decoder_pre_attention_dense(h, *dense_pre_args(L), cos, sin, sin_rolled, L["n_q"], L["n_kv"],
                                          skinny_rows, *heads)
    for a, b in zip(got, (qk, qkv.transpose(1, 2)[:, L["n_q"] + L["n_kv"]:])):
        assert a.shape == b.shape and a.dtype == dtype and torch.equal(a, b)
    torch.library.opcheck(ops.decoder_pre_attention_dense.default,
                          (h, *dense_pre_args(L), cos, sin, sin_rolled, L["n_q"], L["n_kv"], skinny_rows, *heads))


@needs_ops
def test_dense_decoder_ops_opcheck():
    g = torch.Generator().manual_seed(7)
    L = dense_layer(g, torch.float32, bias=True)
    h = torch.randn(2, 3, L["E"], generator=g)
    cos, sin, sin_rolled = dense_tables(2, 3, L["D"], g, torch.float32)
    attn = torch.randn(2, 3, L["n_q"] * L["D"], generator=g)
    for skinny_rows in (0, 8):
        torch.library.opcheck(ops.decoder_pre_attention_dense.default,
                              (h, *dense_pre_args(L), cos, sin, sin_rolled, L["n_q"], L["n_kv"], skinny_rows))
        torch.library.opcheck(ops.decoder_post_attention_dense.default, (h, attn, *dense_post_args(L), skinny_rows))
    bf = {k: v.bfloat16() if isinstance(v, torch.Tensor) else [t.bfloat16() for t in v] if isinstance(v, list)
          else v for k, v in L.items()}
    torch.library.opcheck(ops.decoder_pre_attention_dense.default,
                          (h.bfloat16(), *dense_pre_args(bf), cos.bfloat16(), sin.bfloat16(), sin_rolled.bfloat16(),
                           L["n_q"], L["n_kv"]))


@needs_ops
def test_dense_decoder_ops_bad_input_names_the_argument():
    g = torch.Generator().manual_seed(8)
    L = dense_layer(g, torch.float32)
    h = torch.randn(1, 2, L["E"], generator=g)
    cos, sin, sin_rolled = dense_tables(1, 2, L["D"], g, torch.float32)
    with pytest.raises(RuntimeError, match="h: expected a floating-point tensor"):
        ops.decoder_pre_attention_dense(h[0], *dense_pre_args(L), cos, sin, sin_rolled, L["n_q"], L["n_kv"])
    args = list(dense_pre_args(L))
    args[2] = args[2][:2]
    with pytest.raises(RuntimeError, match=r"qkv_weight: expected \[W_q, W_k, W_v\]"):
        ops.decoder_pre_attention_dense(h, *args, cos, sin, sin_rolled, L["n_q"], L["n_kv"])
    args[2], args[3] = L["qkv"], L["qkv_b"][:2]
    with pytest.raises(RuntimeError, match="biases: expected one"):
        ops.decoder_pre_attention_dense(h, *args, cos, sin, sin_rolled, L["n_q"], L["n_kv"])
    with pytest.raises(RuntimeError, match="qkv_weight: expected 160 output rows"):
        ops.decoder_pre_attention_dense(h, *dense_pre_args(L), cos, sin, sin_rolled, L["n_q"], L["n_kv"] + 1)
    with pytest.raises(RuntimeError, match="cos, sin, sin_rolled: expected"):
        ops.decoder_pre_attention_dense(h, *dense_pre_args(L), cos, sin, sin_rolled[..., :8], L["n_q"], L["n_kv"])
    with pytest.raises(RuntimeError, match="attn: expected"):
        ops.decoder_post_attention_dense(h, torch.randn(2, 2, 64), *dense_post_args(L))
    args = list(dense_post_args(L))
    args[4] = args[4][:1]
    with pytest.raises(RuntimeError, match=r"gate_up_weight: expected \[W_gate, W_up\]"):
        ops.decoder_post_attention_dense(h, torch.randn(1, 2, 64), *args)


def stack_entries(L, heads=None, scale=0.25):
    """One layer's entries of decoder_stack's weights, ints and floats (csrc/layer.cpp)."""
    wq, eq, wk, ek = heads or (None, 0.0, None, 0.0)
    qkv, o, gu, dn = L["qkv"], L["o"], L["gate_up"], L["down"]
    weights = [L["w1"], qkv.q, qkv.d, qkv.m, L["qkv_b"], wq, wk, o.q, o.d, o.m, L["o_b"], L["w2"], gu.q, gu.d, gu.m,
               L["gate_up_b"], dn.q, dn.d, dn.m, L["down_b"]]
    return weights, [qkv.bits, o.bits, gu.bits, dn.bits, L["n_q"], L["n_kv"]], [L["eps"], eq, ek, L["eps"], scale]


@needs_ops
@pytest.mark.parametrize("bias,heads,live", [(False, False, False), (True, False, False), (False, True, False),
                                             (True, False, True), (False, True, True)])
def test_decoder_stack_is_the_layers_calls_bit_for_bit(bias, heads, live):
    """decoder_stack over three layers: each layer's decoder_pre_attention, append_attention into its caches and
    decoder_post_attention in turn, the outputs and the caches bit for bit."""
    g = torch.Generator().manual_seed(40 + 4 * bias + 2 * heads + live)
    B, S, C, start = 2, 3, 12, 5
    layers = [layer(g, bias=bias) for _ in range(3)]
    norms = [head_norms(L, g) if heads else None for L in layers]
    E, D, n_q, n_kv = (layers[0][k] for k in ("E", "D", "n_q", "n_kv"))
    h = torch.randn(B, S, E, generator=g)
    cos, sin = rotary_tables(B, S, D, g)
    caches = [(torch.randn(B, n_kv, C, D, generator=g), torch.randn(B, n_kv, C, D, generator=g)) for _ in layers]
    mask = torch.zeros(B, 1, S, start + S)
    mask[0, :, :, :2] = float("-inf")  # a left-padded row
    mask[:, :, 0, start + 1:] = float("-inf")
    index = torch.tensor([0, 1, 2, 4]) if live else None
    want_caches = [(k.clone(), v.clone()) for k, v in caches]
    x = h
    for L, hn, (kc, vc) in zip(layers, norms, want_caches):
        qk, v = ops.decoder_pre_attention(x, *pre_args(L), cos, sin, n_q, n_kv, index, *(hn or ()))
        attn = ops.append_attention(qk[:, :n_q], qk[:, n_q:], v, kc, vc, start, mask, 0.25)
        x = ops.decoder_post_attention(x, attn, *post_args(L), index)
    entries = [stack_entries(L, hn) for L, hn in zip(layers, norms)]
    args = ([w for e in entries for w in e[0]], [i for e in entries for i in e[1]], [f for e in entries for f in e[2]])
    got = ops.decoder_stack(h, *args, cos, sin, [k for k, _ in caches], [v for _, v in caches], start, mask, index)
    assert torch.equal(float_bits(got), float_bits(x))
    for (k, v), (wk, wv) in zip(caches, want_caches):
        assert torch.equal(float_bits(k), float_bits(wk)) and torch.equal(float_bits(v), float_bits(wv))
    with pytest.raises(RuntimeError, match="weights, ints, floats: expected 20, 6 and 5 entries per layer"):
        ops.decoder_stack(h, args[0][:-1], *args[1:], cos, sin, [k for k, _ in caches], [v for _, v in caches],
                          start, mask, index)
    with pytest.raises(RuntimeError, match="v_caches: expected one per layer"):
        ops.decoder_stack(h, *args, cos, sin, [k for k, _ in caches], [v for _, v in caches][:2], start, mask, index)
    weights = list(args[0])
    weights[20 + 17] = None
    with pytest.raises(RuntimeError, match="weights: entry 37 \\(layer 1's down_d\\) is None"):
        ops.decoder_stack(h, weights, *args[1:], cos, sin, [k for k, _ in caches], [v for _, v in caches], start,
                          mask, index)
    with pytest.raises(RuntimeError, match="start: expected 0 <= start and start \\+ n <= C"):
        ops.decoder_stack(h, *args, cos, sin, [k for k, _ in caches], [v for _, v in caches], C - 1,
                          torch.zeros(B, 1, S, C - 1 + S), index)
    torch.library.opcheck(ops.decoder_stack.default, (h, *args, cos, sin, [k for k, _ in caches],
                                                      [v for _, v in caches], start, mask, index))


@needs_ops
@pytest.mark.parametrize("live", [False, True])
def test_decoder_stack_strided_caches_and_checks_before_writing(live):
    """Caches whose keys are not contiguous rows (a [B, C, Hkv, D] buffer seen as [B, Hkv, C, D]) give the contiguous
    caches' result bit for bit; a bad entry of a later layer is refused before any cache is written."""
    g = torch.Generator().manual_seed(60 + live)
    B, S, C, start = 2, 2, 9, 4
    layers = [layer(g) for _ in range(2)]
    E, D, n_kv = (layers[0][k] for k in ("E", "D", "n_kv"))
    h = torch.randn(B, S, E, generator=g)
    cos, sin = rotary_tables(B, S, D, g)
    mask = torch.zeros(B, 1, S, start + S)
    mask[1, :, :, :3] = float("-inf")
    mask[:, :, 0, start + 1:] = float("-inf")
    index = torch.tensor([1, 2, 3]) if live else None
    entries = [stack_entries(L) for L in layers]
    args = ([w for e in entries for w in e[0]], [i for e in entries for i in e[1]], [f for e in entries for f in e[2]])
    dense = [(torch.randn(B, n_kv, C, D, generator=g), torch.randn(B, n_kv, C, D, generator=g)) for _ in layers]
    strided = [tuple(c.transpose(1, 2).contiguous().transpose(1, 2) for c in kv) for kv in dense]
    assert not strided[0][0].is_contiguous()
    want = ops.decoder_stack(h, *args, cos, sin, [k for k, _ in dense], [v for _, v in dense], start, mask, index)
    got = ops.decoder_stack(h, *args, cos, sin, [k for k, _ in strided], [v for _, v in strided], start, mask, index)
    assert torch.equal(float_bits(got), float_bits(want))
    for (k, v), (wk, wv) in zip(strided, dense):
        assert torch.equal(float_bits(k), float_bits(wk)) and torch.equal(float_bits(v), float_bits(wv))
    before = [(k.clone(), v.clone()) for k, v in dense]
    ints = list(args[1])
    ints[6 + 5] = 2 * n_kv  # layer 1's n_kv
    with pytest.raises(RuntimeError, match="ints: layer 1's n_q, n_kv: expected layer 0's"):
        ops.decoder_stack(h, args[0], ints, args[2], cos, sin, [k for k, _ in dense], [v for _, v in dense], start,
                          mask, index)
    weights = list(args[0])
    weights[20 + 11] = torch.ones(E + 1)  # layer 1's post-attention norm weight
    with pytest.raises(RuntimeError, match="norm_weight: expected \\[E = "):
        ops.decoder_stack(h, weights, *args[1:], cos, sin, [k for k, _ in dense], [v for _, v in dense], start,
                          mask, index)
    for (k, v), (bk, bv) in zip(dense, before):
        assert torch.equal(k, bk) and torch.equal(v, bv)

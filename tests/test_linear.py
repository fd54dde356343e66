"""skinny_linear (csrc/linear.h) against F.linear in float64, its batch invariance, bad input, and the routing of a
Hugging Face model's linear layers through it (fastverify.hf.linear)."""

import pytest
import torch
import torch.nn.functional as F

import fastverify
from fastverify.hf.linear import MAX_ROWS, skinny_available, skinny_linears
from fastverify.ops.tree import implemented_backends

needs_cpp = pytest.mark.skipif("cpp" not in implemented_backends("skinny_linear"),
                               reason="cpp backend: fastverify._C is not built or has no skinny_linear kernel")


def _ref(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _check(y, x, w, b):
    # fp32 dot products of length K: error grows like sqrt(K) * eps * |x| |w|
    ref = _ref(x, w, b)
    scale = (x.double().abs() @ w.double().abs().T) + (0 if b is None else b.double().abs())
    err = (y.double() - ref).abs()
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert bool((err <= 1e-6 * scale * max(1.0, x.shape[-1] ** 0.5) + 1e-30).all()), float(err.max())


@needs_cpp
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 12, 13, 16, 17, 33])
@pytest.mark.parametrize("K, N", [(1, 1), (7, 3), (8, 4), (9, 5), (16, 9), (17, 11), (576, 49), (1000, 13), (1536, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_reference(M, K, N, bias):
    g = torch.Generator().manual_seed(M * 7919 + K * 31 + N)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    _check(fastverify.skinny_linear(x, w, b, backend="cpp"), x, w, b)


@needs_cpp
def test_row_result_does_not_depend_on_the_batch_or_threads():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(17, 577, generator=g)
    w = torch.randn(1027, 577, generator=g)
    b = torch.randn(1027, generator=g)
    full = fastverify.skinny_linear(x, w, b, backend="cpp")
    for m in (0, 1, 5, 16):
        assert torch.equal(fastverify.skinny_linear(x[m:m + 1], w, b, backend="cpp")[0], full[m])
        assert torch.equal(fastverify.skinny_linear(x[:m + 1], w, b, backend="cpp"), full[:m + 1])
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fastverify.skinny_linear(x, w, b, backend="cpp")
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, full)


@needs_cpp
def test_leading_dims_non_contiguous_and_empty():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 40, generator=g)
    w = torch.randn(24, 80, generator=g)[:, ::2]  # non-contiguous weight
    xt = torch.randn(40, 6, generator=g).T          # non-contiguous input
    y = fastverify.skinny_linear(x, w, backend="cpp")
    assert y.shape == (2, 3, 24)
    _check(y.reshape(6, 24), x.reshape(6, 40), w, None)
    _check(fastverify.skinny_linear(xt, w, backend="cpp"), xt, w, None)
    assert fastverify.skinny_linear(torch.zeros(0, 40), w, backend="cpp").shape == (0, 24)
    assert fastverify.skinny_linear(x, torch.zeros(0, 40), backend="cpp").shape == (2, 3, 0)
    b = torch.randn(5, generator=g)
    assert torch.equal(fastverify.skinny_linear(torch.zeros(3, 0), torch.zeros(5, 0), b, backend="cpp"),
                       b.expand(3, 5))


@needs_cpp
def test_opcheck():
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(3, 20, generator=g), torch.randn(9, 20, generator=g), torch.randn(9, generator=g)
    torch.library.opcheck(torch.ops.fastverify.skinny_linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.fastverify.skinny_linear.default, (x, w, None))


def test_torch_backend_and_auto_fallback_for_other_dtypes():
    x, w = torch.randn(3, 20, dtype=torch.float64), torch.randn(9, 20, dtype=torch.float64)
    assert torch.equal(fastverify.skinny_linear(x, w), F.linear(x, w))  # auto: not float32 -> F.linear
    x32, w32 = x.float(), w.float()
    assert torch.equal(fastverify.skinny_linear(x32, w32, backend="torch"), F.linear(x32, w32))


@needs_cpp
@pytest.mark.parametrize("M", [1, 2, 3, 4, 6, 7, 13, 17])
@pytest.mark.parametrize("K, N", [(1, 1), (17, 11), (576, 49), (1536, 9)])
def test_float16_weight_gives_the_result_of_its_float32_copy(M, K, N):
    # read as its exact float32 values: bit for bit the float32 copy's result, on every tile shape and the K tail
    g = torch.Generator().manual_seed(M * 131 + K + N)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).half(), torch.randn(N, generator=g)
    y = fastverify.skinny_linear(x, w, b, backend="cpp")
    assert y.dtype == torch.float32 and torch.equal(y, fastverify.skinny_linear(x, w.float(), b, backend="cpp"))
    ref = fastverify.skinny_linear(x, w, b, backend="torch")  # the reference: the weight's values in x's dtype
    assert torch.equal(ref, F.linear(x, w.float(), b))
    _check(y, x, w.float(), b)
    assert torch.equal(fastverify.skinny_linear(x, w, b), y)  # auto takes the kernel


def test_bad_input_names_the_argument():
    x, w = torch.randn(3, 20), torch.randn(9, 20)
    with pytest.raises(ValueError, match="weight"):
        fastverify.skinny_linear(x, w[0])
    with pytest.raises(ValueError, match="x: expected shape"):
        fastverify.skinny_linear(torch.randn(3, 21), w)
    with pytest.raises(ValueError, match="bias"):
        fastverify.skinny_linear(x, w, torch.randn(8))
    with pytest.raises(TypeError, match="x"):
        fastverify.skinny_linear([1.0], w)
    with pytest.raises(TypeError, match="floating"):
        fastverify.skinny_linear(x.long(), w)
    if "cpp" in implemented_backends("skinny_linear"):
        with pytest.raises(TypeError, match="float32"):
            fastverify.skinny_linear(x.double(), w.double(), backend="cpp")
        with pytest.raises(TypeError, match="weight float32 or float16"):
            fastverify.skinny_linear(x, w.bfloat16(), backend="cpp")
        with pytest.raises(RuntimeError, match="weight: expected float32 or float16"):
            torch.ops.fastverify.skinny_linear(x, w.bfloat16(), None)
        # the kernel's own checks (what a direct torch.ops call meets)
        with pytest.raises(RuntimeError, match="x: expected float32"):
            torch.ops.fastverify.skinny_linear(x.double(), w, None)
        with pytest.raises(RuntimeError, match="weight's K"):
            torch.ops.fastverify.skinny_linear(torch.randn(3, 21), w, None)
        with pytest.raises(RuntimeError, match="bias"):
            torch.ops.fastverify.skinny_linear(x, w, torch.randn(8))


class _MyLinear(torch.nn.Linear):
    pass


@pytest.mark.skipif(not skinny_available(), reason="cpp backend: fastverify._C has no skinny_linear kernel")
def test_skinny_linears_reroutes_few_rows_and_restores_the_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 16, bias=False),
                                _MyLinear(16, 8), torch.nn.Linear(8, 8).double(), torch.nn.Linear(8, 8))
    model[5].weight = torch.nn.Parameter(torch.randn(8, 8).T)  # non-contiguous: left to F.linear
    before = [dict(m.__dict__) for m in model]
    op = torch.ops.fastverify.skinny_linear

    x_few, x_many = torch.randn(MAX_ROWS, 32), torch.randn(MAX_ROWS + 1, 32)
    with torch.no_grad():
        ref_few, ref_many = model[:4](x_few), model[:4](x_many)
        with skinny_linears(model) as n:
            assert n == 2  # the exact nn.Linear float32 contiguous layers; not the subclass, float64 or transposed
            for i in (0, 2):
                assert "forward" in model[i].__dict__
            assert not any("forward" in model[i].__dict__ for i in (3, 4, 5))
            few = model[:4](x_few)
            many = model[:4](x_many)
        # the rerouted layers ran the kernel: bit for bit what the op gives
        h = op(F.gelu(op(x_few, model[0].weight, model[0].bias)), model[2].weight, None)
        assert torch.equal(few, model[3](h))
    torch.testing.assert_close(few, ref_few, rtol=1e-5, atol=1e-5)
    assert torch.equal(many, ref_many)  # more than MAX_ROWS rows: F.linear, bit for bit
    assert [dict(m.__dict__) for m in model] == before
    # gradients: F.linear, so autograd works inside the context
    with skinny_linears(model):
        out = model[:3](torch.randn(2, 32, requires_grad=True)).sum()
    out.backward()
    assert model[0].weight.grad is not None


# ---------------------------------------------------------------------------------------------------------------
# gated_lora_add_: a gated LoRA adapter's update of its slot rows in one call (fastverify/lora.py's inference path)

needs_fused = pytest.mark.skipif(not hasattr(torch.ops.fastverify, "gated_lora_add_"),
                                 reason="fastverify._C is not built or has no gated_lora_add_ kernel")


@needs_fused
@pytest.mark.parametrize("R, K, N, r", [(1, 1, 1, 1), (7, 37, 29, 3), (16, 576, 192, 8), (5, 64, 1536, 16)])
def test_gated_lora_add_matches_float64_and_leaves_other_rows(R, K, N, r):
    g = torch.Generator().manual_seed(R * 1000 + K)
    x, y = torch.randn(R, K, generator=g), torch.randn(R, N, generator=g)
    A, B = torch.randn(r, K, generator=g), torch.randn(N, r, generator=g)
    for idx in ([], [0], sorted({0, R - 1, R // 2}), [R - 1, 0, R - 1]):  # duplicates add twice, like index_add
        index = torch.tensor(idx, dtype=torch.int64)
        out = y.clone()
        torch.ops.fastverify.gated_lora_add_(out, x, index, A, B, 0.5)
        ref = y.double().index_add(0, index, 0.5 * (x.double()[index] @ A.double().T) @ B.double().T)
        untouched = torch.ones(R, dtype=torch.bool)
        untouched[index] = False
        assert torch.equal(out[untouched], y[untouched])  # bit for bit
        bound = 1e-5 * (1 + (x.double().abs()[index] @ A.double().abs().T) @ B.double().abs().T).max() if idx else 0
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=float(bound) + 1e-6)


@needs_fused
def test_gated_lora_layer_fused_path_equals_the_torch_path():
    from fastverify.lora import GatedLoRALinear, slot_gate

    torch.manual_seed(0)
    layer = GatedLoRALinear(torch.nn.Linear(48, 40), rank=4, alpha=8.0)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(2, 9, 48)
    gate = torch.zeros(2, 9, dtype=torch.bool)
    gate[0, 6:] = True
    gate[1, 2] = True
    with slot_gate(gate):
        torch_path = layer(x)  # autograd on: the torch ops
        with torch.no_grad():
            fused = layer(x)  # no grad, float32 CPU: the C++ op
            with skinny_linears(torch.nn.Sequential(layer)):
                fused_skinny = layer(x)
    assert torch.equal(fused[~gate], layer.base(x)[~gate])
    torch.testing.assert_close(fused, torch_path.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_skinny, torch_path.detach(), rtol=1e-5, atol=1e-5)


@needs_fused
def test_gated_lora_add_bad_input_names_the_argument():
    y, x = torch.zeros(4, 6), torch.zeros(4, 5)
    A, B, idx = torch.zeros(2, 5), torch.zeros(6, 2), torch.tensor([1])
    op = torch.ops.fastverify.gated_lora_add_
    with pytest.raises(RuntimeError, match="index: row 4 is outside"):
        op(y, x, torch.tensor([4]), A, B, 1.0)
    with pytest.raises(RuntimeError, match="index: row -1 is outside"):
        op(y, x, torch.tensor([-1]), A, B, 1.0)
    with pytest.raises(RuntimeError, match="A: expected shape"):
        op(y, x, idx, torch.zeros(2, 4), B, 1.0)
    with pytest.raises(RuntimeError, match="B: expected shape"):
        op(y, x, idx, A, torch.zeros(5, 2), 1.0)
    with pytest.raises(RuntimeError, match="x: expected 4 rows"):
        op(y, torch.zeros(3, 5), idx, A, B, 1.0)
    with pytest.raises(RuntimeError, match="y: expected a contiguous 2-D float32"):
        op(y.double(), x, idx, A, B, 1.0)
    with pytest.raises(RuntimeError, match="index: expected an int64"):
        op(y, x, idx.int(), A, B, 1.0)

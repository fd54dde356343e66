"""skinny_linear (csrc/linear.h) against F.linear in float64, its batch invariance, bad input, and the routing of a
Hugging Face model's linear layers through it (fastverify.hf.linear)."""

import re

import pytest
import torch
import torch.nn.functional as F

import fastverify
from fastverify.hf.linear import (MAX_ROWS, module_classes, modules, row_aligned, row_gelu, skinny_available,
                                  skinny_linears, walked)
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
@pytest.mark.parametrize("transposed", [False, True], ids=["skinny_linear", "skinny_linear_t"])
def test_row_result_does_not_depend_on_the_batch_or_threads(transposed):
    # (skinny_linear_t: up to 4 rows in panels of the weight's rows, more in one pass; 6 rows a tile)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(19, 577, generator=g)
    w = torch.randn(577, 1027, generator=g) if transposed else torch.randn(1027, 577, generator=g)
    b = torch.randn(1027, generator=g)
    op = torch.ops.fastverify.skinny_linear_t if transposed else torch.ops.fastverify.skinny_linear
    full = op(x, w, b)
    for m in (0, 1, 3, 4, 5, 6, 11, 16, 18):
        assert torch.equal(op(x[m:m + 1], w, b)[0], full[m])
        assert torch.equal(op(x[:m + 1], w, b), full[:m + 1])
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(x, w, b)
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


def _check_t(y, x, w, b):
    _check(y, x, w.T, b)  # x @ w + b is F.linear's x @ (w^T)^T + b


@needs_cpp
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 12, 13, 33])
@pytest.mark.parametrize("K, N", [(1, 1), (7, 3), (9, 16), (17, 47), (64, 64), (33, 80), (768, 113), (100, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_t_matches_float64_reference(M, K, N, bias):
    g = torch.Generator().manual_seed(M * 7919 + K * 31 + N + 5)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(K, N, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    y = fastverify.ops.linear.skinny_linear_t(x, w, b, backend="cpp")
    _check_t(y, x, w, b)
    assert torch.equal(fastverify.ops.linear.skinny_linear_t(x, w, b), y)  # auto takes the kernel
    _check_t(fastverify.ops.linear.skinny_linear_t(x, w, b, backend="torch"), x, w, b)


@needs_cpp
def test_skinny_linear_t_leading_dims_non_contiguous_empty_and_opcheck():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 3, 40, generator=g)
    w = torch.randn(80, 24, generator=g)[::2]  # non-contiguous weight [40, 24]
    y = fastverify.ops.linear.skinny_linear_t(x, w, backend="cpp")
    assert y.shape == (2, 3, 24)
    _check_t(y.reshape(6, 24), x.reshape(6, 40), w, None)
    xt = torch.randn(40, 6, generator=g).T  # non-contiguous input
    _check_t(fastverify.ops.linear.skinny_linear_t(xt, w, backend="cpp"), xt, w, None)
    assert fastverify.ops.linear.skinny_linear_t(torch.zeros(0, 40), w, backend="cpp").shape == (0, 24)
    assert fastverify.ops.linear.skinny_linear_t(x, torch.zeros(40, 0), backend="cpp").shape == (2, 3, 0)
    b = torch.randn(5, generator=g)
    assert torch.equal(fastverify.ops.linear.skinny_linear_t(torch.zeros(3, 0), torch.zeros(0, 5), b, backend="cpp"),
                       b.expand(3, 5))
    xs, ws, bs = torch.randn(3, 20, generator=g), torch.randn(20, 9, generator=g), torch.randn(9, generator=g)
    torch.library.opcheck(torch.ops.fastverify.skinny_linear_t.default, (xs, ws, bs))
    torch.library.opcheck(torch.ops.fastverify.skinny_linear_t.default, (xs, ws, None))


def test_skinny_linear_t_bad_input_names_the_argument():
    from fastverify.ops.linear import skinny_linear_t
    x, w = torch.randn(3, 20), torch.randn(20, 9)
    with pytest.raises(ValueError, match=r"weight: expected shape \[K, N\]"):
        skinny_linear_t(x, w[0])
    with pytest.raises(ValueError, match="x: expected shape"):
        skinny_linear_t(torch.randn(3, 9), w)
    with pytest.raises(ValueError, match="bias"):
        skinny_linear_t(x, w, torch.randn(20))
    with pytest.raises(TypeError, match="floating"):
        skinny_linear_t(x.long(), w)
    assert torch.equal(skinny_linear_t(x.double(), w.double()), x.double() @ w.double())  # auto: the reference
    if "cpp" in implemented_backends("skinny_linear_t"):
        with pytest.raises(TypeError, match="weight float32"):
            skinny_linear_t(x, w.half(), backend="cpp")
        with pytest.raises(RuntimeError, match="weight: expected float32"):
            torch.ops.fastverify.skinny_linear_t(x, w.half(), None)
        with pytest.raises(RuntimeError, match="weight's K"):
            torch.ops.fastverify.skinny_linear_t(torch.randn(3, 21), w, None)
        with pytest.raises(RuntimeError, match="bias"):
            torch.ops.fastverify.skinny_linear_t(x, w, torch.randn(20))


@pytest.mark.skipif(not skinny_available(), reason="cpp backend: fastverify._C has no skinny_linear kernel")
def test_skinny_linears_reroutes_conv1d_layers_and_restores_them():
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    model = torch.nn.Sequential(Conv1D(48, 32), torch.nn.GELU(), Conv1D(32, 48))
    x = torch.randn(5, 32)
    before = model(x).detach()
    with torch.no_grad(), skinny_linears(model) as n:  # (inputs that need gradients go to Conv1D's own addmm)
        assert n == 2 and all("forward" in m.__dict__ for m in (model[0], model[2]))
        y = model(x)
        rows = [model(x[i:i + 1]) for i in range(5)]
        big = model(torch.randn(MAX_ROWS + 1, 32))  # past max_rows: Conv1D's own addmm
        assert big.shape == (MAX_ROWS + 1, 32)
    assert all("forward" not in m.__dict__ for m in (model[0], model[2]))
    assert torch.allclose(y, before, atol=1e-5)
    assert all(torch.equal(r[0], y[i]) for i, r in enumerate(rows))  # each row its own: bit for bit
    assert torch.equal(model(x), before)


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
        # the rerouted layers ran the kernel: bit for bit what the op gives (16 columns: handed out row-aligned)
        h = row_aligned(op(F.gelu(op(x_few, model[0].weight, model[0].bias)), model[2].weight, None))
        assert torch.equal(few, model[3](h))
    torch.testing.assert_close(few, ref_few, rtol=1e-5, atol=1e-5)
    assert torch.equal(many, ref_many)  # more than MAX_ROWS rows: F.linear, bit for bit
    assert [dict(m.__dict__) for m in model] == before
    # gradients: F.linear, so autograd works inside the context
    with skinny_linears(model):
        out = model[:3](torch.randn(2, 32, requires_grad=True)).sum()
    out.backward()
    assert model[0].weight.grad is not None


@needs_cpp
def test_skinny_linears_reroutes_falcon_linear_and_no_other_subclass():
    """transformers' FalconLinear (x @ W.T, then + bias) is rerouted as nn.Linear is: the kernel's bits, F.linear's
    value to float32 rounding; another nn.Linear subclass keeps its own forward."""
    from transformers.models.falcon.modeling_falcon import FalconLinear

    class Other(torch.nn.Linear):
        pass

    torch.manual_seed(0)
    model = torch.nn.ModuleList([FalconLinear(64, 48), FalconLinear(64, 48, bias=False), Other(64, 48)])
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = [m(x) for m in model]
        with skinny_linears(model) as rerouted:
            assert rerouted == 2 and "forward" not in model[2].__dict__
            got = [m(x) for m in model]
    for m, a, b in zip(model[:2], got, want):
        assert torch.equal(a, torch.ops.fastverify.skinny_linear(x, m.weight, m.bias))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], want[2]) and all("forward" not in m.__dict__ for m in model)


@pytest.mark.parametrize("N", [5, 1, 31])
def test_skinny_linears_hands_out_narrow_outputs_row_aligned(N):
    """torch's elementwise kernels take a contiguous tensor's last numel mod 32 elements through their scalar
    functions, whose sigmoid, tanh and exp round differently from the vector ones. A rerouted layer's output of
    N < 32 columns (a router's logits, Qwen2-MoE's one-column gate) lies row-aligned in a wider buffer, so these
    functions compute each row as they compute it alone (fastverify.hf.linear.row_aligned)."""
    from fastverify.hf.experts import _ROW_F
    from fastverify.hf.linear import ROW_ALIGN
    torch.manual_seed(N)
    layer = torch.nn.Linear(64, N)
    x = torch.randn(MAX_ROWS, 64) * 3
    with torch.no_grad(), skinny_linears(layer):
        outs = {"layer": (layer(x), [layer(x[i:i + 1]) for i in range(MAX_ROWS)]),
                "router F": (_ROW_F.linear(x, layer.weight, layer.bias),
                             [_ROW_F.linear(x[i:i + 1], layer.weight, layer.bias) for i in range(MAX_ROWS)])}
        for name, (out, alone) in outs.items():
            assert out.stride() == (ROW_ALIGN, 1), name
            assert torch.equal(out, torch.ops.fastverify.skinny_linear(x, layer.weight, layer.bias)), name
            for f in (torch.sigmoid, torch.tanh, torch.exp, F.silu):
                together = f(out)
                for i in range(MAX_ROWS):
                    assert torch.equal(together[i:i + 1], f(alone[i])), (name, f, i)
        three = layer(x.view(2, MAX_ROWS // 2, 64))  # leading dims keep their shape
        assert three.shape == (2, MAX_ROWS // 2, N) and torch.equal(three.reshape(MAX_ROWS, N), outs["layer"][0])
    for wide in (torch.randn(3, 64), torch.randn(3, 48)):
        assert row_aligned(wide) is wide  # ROW_ALIGN columns or more: as it is


@pytest.mark.parametrize("N", [48, 5, 77, 64])
def test_row_padded_computes_each_row_alone_at_any_width(N):
    """An elementwise function of a contiguous [rows, N] tensor takes its scalar tail at the last numel mod 32
    elements, which fall on other elements of the last row as the rows change (Laguna's attention gate: a softplus of
    48 columns, one per head). ``row_padded`` lays the rows a multiple of ROW_ALIGN floats apart, so each row computes
    as it does alone, under any leading dims; a width that is a multiple of ROW_ALIGN, or one row, comes back as it
    is."""
    from fastverify.hf.linear import ROW_ALIGN, row_padded
    torch.manual_seed(N)
    x = torch.randn(2, 9, N) * 4
    padded = row_padded(x)
    assert torch.equal(padded, x)
    if N % ROW_ALIGN == 0:
        assert padded is x
    else:
        assert padded.stride()[-2] % ROW_ALIGN == 0 and padded.stride()[-2] >= N
    for f in (F.softplus, torch.sigmoid, torch.tanh, torch.exp, F.silu):
        together = f(padded)
        for b in range(2):
            for i in range(9):  # each row alone, and the first i + 1 rows of a batch of one
                for rows in ((slice(b, b + 1), slice(i, i + 1)), (slice(b, b + 1), slice(0, i + 1))):
                    assert torch.equal(f(row_padded(x[rows].contiguous())), together[rows]), (f, b, i)
    for same in (torch.empty(0, N), x[:1, :1], x[1, 4]):  # nothing, or one row: as it is
        assert row_padded(same) is same


def test_row_gelu_computes_a_glu_slice_as_one_row_alone():
    """A GLU's chunk of a [rows, 2N] output is contiguous at one row and strided at several, and torch's GELU (erf)
    rounds a strided input otherwise than a contiguous one (so does a narrow output handed out ``row_aligned``).
    Within ``row_gelu`` transformers' GELUActivation and torch's nn.GELU (not the tanh approximation, whose kernel
    computes both alike) compute each row as they compute it alone, at any width; outside, the instances are as they
    were."""
    from transformers.activations import GELUActivation
    torch.manual_seed(0)
    model = torch.nn.ModuleList([GELUActivation(), torch.nn.GELU(), torch.nn.GELU(approximate="tanh"),
                                 GELUActivation(use_gelu_python=True)])
    before = [dict(m.__dict__) for m in model]

    def rows_alone_differ(act, x, glu):
        half = (lambda t: t.chunk(2, dim=-1)[0]) if glu else (lambda t: t)
        together = act(half(x))
        return [i for i in range(x.shape[0]) if not torch.equal(together[i:i + 1], act(half(x[i:i + 1])))]

    glu, odd, narrow = torch.randn(17, 2 * 64) * 3, torch.randn(17, 48) * 3, torch.randn(17, 5) * 3
    assert rows_alone_differ(model[0], glu, True) and rows_alone_differ(model[1], glu, True)  # strided rounds otherwise
    aligned = row_aligned(narrow)  # a narrow output as the rerouted layers hand it out: strided at several rows
    assert rows_alone_differ(model[0], aligned, False)
    with row_gelu(model) as rebound:
        assert rebound == 2
        for act in model:
            assert rows_alone_differ(act, glu, True) == []
        for act in model[:2]:
            for x in (odd, narrow, aligned, glu.view(17, 2, 64)):
                assert rows_alone_differ(act, x, False) == []
                assert torch.equal(act(x), F.gelu(x.contiguous()))
    assert [dict(m.__dict__) for m in model] == before


def test_modules_walks_as_model_modules_and_walked_keeps_one_walk():
    """``modules(model)`` is ``list(model.modules())``: the same modules in the same order, a module held twice
    (tied) once. Within ``walked(model)`` it is the one list made on entering, for that model only; after the block
    a module added since is seen. ``module_classes(model)`` is the set of their classes, likewise."""
    shared = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(shared, torch.nn.ReLU(), None), shared)
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert modules(model) == list(model.modules()) and len(modules(model)) == 5
    with walked(model):
        first = modules(model)
        assert modules(model) is first and modules(other) == list(other.modules())
        with walked(other):
            assert modules(other) is modules(other)  # the inner block's walk
            assert modules(model) is not first and modules(model) == first  # not its block: walked afresh
        assert modules(model) is first
        classes = module_classes(model)
        assert classes == {torch.nn.Sequential, torch.nn.Linear, torch.nn.ReLU} and module_classes(model) is classes
        model.append(torch.nn.Tanh())
        assert modules(model) is first and module_classes(model) is classes  # not walked again within the block
    assert modules(model) == list(model.modules()) and len(modules(model)) == 6
    assert torch.nn.Tanh in module_classes(model)


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


# ---------------------------------------------------------------------------------------------------------------
# Block-packed weights: a float32 weight dequantised from GGUF Q4_0 / Q4_1 / Q8_0 blocks, streamed packed

from conftest import gguf_blocks  # noqa: E402
from fastverify.hf.linear import packed_weight  # noqa: E402
from fastverify.ops.linear import PackedWeight, pack_blocks, skinny_linear_packed, unpack_blocks  # noqa: E402

needs_packed = pytest.mark.skipif("cpp" not in implemented_backends("skinny_linear_packed"),
                                  reason="fastverify._C is not built or has no skinny_linear_packed kernel")


def gguf_quantised(N, K, kind, gen):
    """A float32 [N, K] weight as a GGUF reader returns it (conftest's ``gguf_blocks``) from random values. A few
    blocks are constant and one is all zero."""
    x = torch.randn(N, K // 32, 32, generator=gen) * torch.rand(N, K // 32, 1, generator=gen) * 0.2
    if N > 1:  # (a weight that is one zero block packs in 4 bits, whatever its kind)
        x[0, 0] = 0.0
        x[1, -1] = 0.37
    return gguf_blocks(x.reshape(N, K), kind)


@pytest.mark.parametrize("kind, bits", [("q4_1", 4), ("q4_0", 4), ("q8_0", 8)])
@pytest.mark.parametrize("N, K", [(1, 32), (7, 64), (49, 576), (9, 1536)])
def test_pack_blocks_holds_gguf_quantised_weights_exactly(kind, bits, N, K):
    w = gguf_quantised(N, K, kind, torch.Generator().manual_seed(N * K + bits))
    p = pack_blocks(w)
    assert isinstance(p, PackedWeight) and p.bits == bits and p.shape == (N, K)
    assert p.q.dtype == torch.uint8 and p.q.shape == (N, K * bits // 8) and p.d.shape == p.m.shape == (N, K // 32)
    assert torch.equal(unpack_blocks(p.q, p.d, p.m, p.bits), w)


def test_pack_blocks_refuses_what_it_cannot_hold_exactly():
    g = torch.Generator().manual_seed(5)
    w = gguf_quantised(8, 64, "q4_1", g)
    assert pack_blocks(torch.randn(8, 64, generator=g)) is None  # plain float32 weights
    assert pack_blocks(w[:, :48].contiguous()) is None  # K not a multiple of 32
    assert pack_blocks(w.half()) is None and pack_blocks(w.double()) is None
    assert pack_blocks(w[0]) is None and pack_blocks(torch.empty(0, 32)) is None
    nudged = w.clone()
    nudged[3, 40] = torch.nextafter(nudged[3, 40], torch.tensor(1.0))  # one weight one ulp off
    assert pack_blocks(nudged) is None
    nan = w.clone()
    nan[0, 0] = float("nan")
    assert pack_blocks(nan) is None


def _pack_cases(gen):
    """Weights for pack_blocks' backends: GGUF kinds at odd shapes, blocks of two kinds in one weight (each block
    fits another scale, in 4 and in 8 bits), zero blocks, and weights that do not pack at all."""
    cases = [gguf_quantised(N, K, kind, gen) for kind in ("q4_1", "q4_0", "q8_0")
             for N, K in [(1, 32), (3, 96), (49, 576), (130, 64)]]
    cases.append(torch.cat([gguf_quantised(5, 64, "q4_1", gen), gguf_quantised(4, 64, "q4_0", gen)]))
    levels = torch.randint(0, 256, (3, 2, 32), generator=gen).float()
    levels[..., 0], levels[..., 1] = 0.0, 255.0  # blocks of span / 255 = 2^-7: the second 8-bit scale
    cases.append(torch.cat([gguf_quantised(4, 64, "q8_0", gen), (levels / 128 - 1).reshape(3, 64)]))
    cases.append(torch.zeros(4, 64))
    cases.append(-torch.zeros(2, 32))
    cases.append(torch.randn(7, 64, generator=gen))
    huge = gguf_quantised(4, 64, "q4_1", gen) * 1e36  # scales past float16's range
    cases.append(huge)
    for bad in (float("nan"), float("inf")):
        w = gguf_quantised(6, 64, "q4_1", gen)
        w[5, 63] = bad
        cases.append(w)
    nudged = gguf_quantised(40, 64, "q8_0", gen)
    nudged[39, 1] = torch.nextafter(nudged[39, 1], torch.tensor(1.0))
    cases.append(nudged)
    return cases


@pytest.mark.skipif("cpp" not in implemented_backends("pack_blocks"), reason="fastverify._C has no pack_blocks")
def test_pack_blocks_cpp_gives_the_reference_tensors():
    """The C++ packer against the reference (fastverify.reference.linear.pack_blocks) on every case, with one and
    two threads: the same bits, the same q / d / m, or both None."""
    threads = torch.get_num_threads()
    try:
        for w in _pack_cases(torch.Generator().manual_seed(11)):
            want = pack_blocks(w, backend="torch")
            for n in (1, 2):
                torch.set_num_threads(n)
                got = pack_blocks(w, backend="cpp")
                assert (got is None) == (want is None), (tuple(w.shape), want, got)
                if want is not None:
                    assert got.bits == want.bits
                    for a, b in zip(got[:3], want[:3]):
                        assert a.dtype == b.dtype and torch.equal(a, b)
                    assert torch.equal(unpack_blocks(*got), w)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif("cpp" not in implemented_backends("pack_blocks"), reason="fastverify._C has no pack_blocks")
def test_pack_blocks_op_bad_input_names_the_argument():
    op = torch.ops.fastverify.pack_blocks
    for bad, what in [(torch.zeros(4, 32, dtype=torch.float64), "float32"), (torch.zeros(2, 4, 32), "2-D"),
                      (torch.zeros(4, 48), "multiple of 32")]:
        with pytest.raises(RuntimeError, match=f"weight: .*{what}"):
            op(bad)
    q, d, m, bits = op(torch.zeros(0, 64))  # no rows: nothing to refuse
    assert bits == 4 and q.shape == (0, 32) and d.shape == m.shape == (0, 2)


def test_pack_blocks_cases_pack_as_expected():
    """The cases above do what they are for (so that the backend comparison covers each kind of outcome)."""
    bits = [None if p is None else p.bits for p in map(lambda w: pack_blocks(w, backend="torch"),
                                                        _pack_cases(torch.Generator().manual_seed(11)))]
    assert bits == [4] * 8 + [8] * 4 + [4, 8, 4, 4, None, None, None, None, None]


@needs_packed
@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8_0"])
# fused to 128 rows (tiles of up to 8), then buffered
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 17, 18, 19, 24, 40, 128, 130])
@pytest.mark.parametrize("N, K, bias", [(1, 32, False), (5, 64, True), (49, 576, True), (9, 1536, False)])
def test_skinny_linear_packed_is_the_float32_kernel_bit_for_bit(kind, M, N, K, bias):
    g = torch.Generator().manual_seed(M * 7 + N + K)
    w = gguf_quantised(N, K, kind, g)
    x, b = torch.randn(M, K, generator=g), (torch.randn(N, generator=g) if bias else None)
    p = pack_blocks(w)
    y = skinny_linear_packed(x, p, b)
    assert torch.equal(y, fastverify.skinny_linear(x, w, b, backend="cpp"))
    assert torch.equal(skinny_linear_packed(x, p, b, backend="torch"), F.linear(x, w, b))
    _check(y, x, w, b)
    assert skinny_linear_packed(x.reshape(1, M, K), p, b).shape == (1, M, N)
    xt = x.T.contiguous().T  # a non-contiguous x: the same rows
    assert not xt.is_contiguous() or M == 1
    assert torch.equal(skinny_linear_packed(xt, p, b), y)


@needs_packed
def test_skinny_linear_packed_opcheck_and_bad_input():
    g = torch.Generator().manual_seed(9)
    p = pack_blocks(gguf_quantised(6, 64, "q4_1", g))
    x, b = torch.randn(3, 64, generator=g), torch.randn(6, generator=g)
    op = torch.ops.fastverify.skinny_linear_packed
    torch.library.opcheck(op.default, (x, p.q, p.d, p.m, p.bits, b))
    for args, words in (((x, p.q, p.d, p.m, 5, b), "bits: expected 4 or 8"),
                        ((x, p.q.float(), p.d, p.m, 4, b), "q: expected a uint8 tensor"),
                        ((x, p.q[:, :16], p.d, p.m, 4, b), "q: expected shape [N, K * bits / 8] = [6, 32]"),
                        ((x, p.q, p.d[:, :1], p.m, 4, b), "d: expected float32 [N, K / 32] = [6, 2]"),
                        ((x, p.q, p.d, p.m.double(), 4, b), "m: expected float32"),
                        ((x.double(), p.q, p.d, p.m, 4, b), "x: expected float32"),
                        ((x, p.q, p.d, p.m, 4, b[:3]), "bias: expected a CPU float32 tensor of shape [6]")):
        with pytest.raises(RuntimeError, match=re.escape(words)):
            op(*args)
    with pytest.raises(TypeError, match="packed: expected a PackedWeight"):
        skinny_linear_packed(x, (p.q, p.d, p.m, 4))
    with pytest.raises(ValueError, match=r"x: expected a tensor of shape \[\.\.\., K = 64\]"):
        skinny_linear_packed(x[:, :32], p)


@needs_packed
def test_skinny_linears_streams_packed_weights_and_repacks_a_changed_weight():
    from fastverify.hf import linear as hf_linear
    g = torch.Generator().manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32), torch.nn.Linear(32, 16))
    with torch.no_grad():
        model[0].weight.copy_(gguf_quantised(96, 64, "q4_1", g))
        model[1].weight.copy_(gguf_quantised(32, 96, "q8_0", g))  # model[2]: random float32, not packable
    x = torch.randn(3, 64, generator=g)
    with torch.no_grad():
        with skinny_linears(model, pack=False):
            unpacked = model(x)
        with skinny_linears(model):
            packed = model(x)
        assert torch.equal(packed, unpacked)  # the same arithmetic on the same float32 values
        p0, p1, p2 = (packed_weight(m) for m in model)
        assert p0.bits == 4 and p1.bits == 8 and p2 is None
        assert packed_weight(model[0]) is p0  # kept
        model[0].weight.mul_(2.0)  # an in-place change: packed again (scaled by 2, still exact)
        p0b = packed_weight(model[0])
        assert p0b is not p0 and torch.equal(unpack_blocks(p0b.q, p0b.d, p0b.m, 4), model[0].weight)
        with skinny_linears(model, pack=False):
            unpacked = model(x)
        with skinny_linears(model):
            assert torch.equal(model(x), unpacked)  # the new packed copy, not the stale one
        # in-place writes through .data leave the version counter as it was; the sample of values sees them
        for write in (lambda w: w.data.mul_(-0.5), lambda w: w.data.copy_(gguf_quantised(96, 64, "q4_1", g))):
            before, version = packed_weight(model[0]), model[0].weight._version
            write(model[0].weight)
            assert model[0].weight._version == version
            p0c = packed_weight(model[0])
            assert p0c is not before and torch.equal(unpack_blocks(p0c.q, p0c.d, p0c.m, 4), model[0].weight)
        # one element off the sample (given its block neighbour's value, so that the weight still packs): not seen
        # until forget_packed
        flat, sample = model[0].weight.view(-1), set(hf_linear._sample_index(96 * 64).tolist())
        i = next(i for i in range(flat.numel()) if i % 32 and i not in sample and flat[i] != flat[i - 1])
        before = packed_weight(model[0])
        model[0].weight.data.view(-1)[i] = flat[i - 1].item()
        assert packed_weight(model[0]) is before
        hf_linear.forget_packed(model)
        p0d = packed_weight(model[0])
        assert p0d is not before and torch.equal(unpack_blocks(p0d.q, p0d.d, p0d.m, 4), model[0].weight)


@needs_packed
def test_patched_generate_on_a_gguf_quantised_model_streams_packed_weights_and_stays_exact():
    from conftest import assert_greedy_exact, patched_generate, repetitive, tiny_llama

    model = tiny_llama(vocab=96, hidden=64)
    g = torch.Generator().manual_seed(2)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    with torch.no_grad():
        for m in linears:  # every layer as a GGUF file's: Q4_1 blocks, the output head Q8_0
            m.weight.copy_(gguf_quantised(*m.weight.shape, "q8_0" if m is model.lm_head else "q4_1", g))
    from fastverify.hf import linear as hf_linear
    fastverify.patch(model)  # packs the layers here, not inside the first generate
    assert all(hf_linear._PACKED.get(m, (None, None))[1] is not None for m in linears)
    fastverify.unpatch(model)
    ids = torch.tensor([repetitive(40, 96, seed=4)])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert_greedy_exact(model, fastverify.NGramDrafter(), ids, max_new_tokens=24)
    calls = sum(e.count for e in prof.key_averages() if e.key == "fastverify::skinny_linear_packed")
    assert calls >= len(linears)  # every layer of every verify forward took the packed kernel
    # seeded sampling: the same stream with and without packing (the same arithmetic)
    a, _ = patched_generate(model, fastverify.NGramDrafter(), ids, do_sample=True, max_new_tokens=24, seed=5)
    b, _ = patched_generate(model, fastverify.NGramDrafter(), ids, options={"pack_weights": False}, do_sample=True,
                            max_new_tokens=24, seed=5)
    assert torch.equal(a, b)

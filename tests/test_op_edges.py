"""Inputs a mutation fuzz of the public ops found mishandled (each argument of a valid call changed in turn: dtype,
layout, shape, values, ranges), each on the reference and the C++ backend: offsets that would have the C++ tree
kernels read past ``parents``, logits of a large magnitude under the entropy rules, parameters outside their range
accepted by one backend, a strided single-column vocabulary, and arguments refused without their name."""

import pytest
import torch

import fastverify as fv
from fastverify.ops.verify import available_backends

from conftest import backend_params

BACKENDS = backend_params(available_backends(), ("torch", "cpp"))
CU = torch.tensor([0, 1], dtype=torch.int32)


@pytest.mark.parametrize("backend", backend_params(available_backends(), ("cpp",)))
@pytest.mark.parametrize("op", ["bool", "packed", "positions"])
def test_unvalidated_offsets_past_the_nodes_are_refused_before_any_read(backend, op):
    """validate=False promises no access out of bounds (its results unspecified otherwise: the reference's are
    sized by the offsets): offsets [0, 5, 2] over 2 nodes had the C++ kernels read parents[2:5] (a garbage parent
    in the error, another each run) before seeing the offsets go down."""
    par = torch.tensor([-1, 0], dtype=torch.int32)
    for cu in ([0, 5, 2], [0, 100000000, 2]):
        cu = torch.tensor(cu, dtype=torch.int32)
        with pytest.raises((ValueError, RuntimeError), match="cu_nodes"):
            if op == "positions":
                fv.tree_positions(par, cu, 0, validate=False, backend=backend)
            else:
                fv.tree_mask(par, cu, 0, format=op, validate=False, max_nodes=8, max_prefix=0, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule, params", [("confidence", {"beta": 0.3}), ("typical", {"eps": 0.5, "delta": 2.0})])
def test_entropy_rules_keep_the_differences_of_large_logits(backend, rule, params):
    """Seven tokens at 1e30: each has p = 1/7 and the row's entropy is log 7. The reference's log-softmax in
    float32 absorbed log(V) into 1e30 and gave every token p = 1 (entropy 0: accepted), where the C++ kernel gave
    1/7 (refused: below beta 0.3; below typical's min(0.5, 2 exp(-log 7)) = 2/7)."""
    logits = torch.zeros(2, 7)
    logits[0] = 1e30
    logits[1, 0] = 5.0
    out = fv.verify(logits, torch.tensor([1]), CU, None, rule=rule, backend=backend, **params)
    assert out.accept_len.tolist() == [0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_infinite_temperature_is_refused_as_cdf_sample_refuses_it(backend):
    logits = torch.randn(3, 4)
    args = (logits, torch.tensor([1, 2]), torch.tensor([0, 2], dtype=torch.int32), torch.tensor([-1, 0]))
    for temperature in (float("inf"), torch.tensor([float("inf")])):
        with pytest.raises(ValueError, match="temperature: expected"):
            fv.verify(*args, rule="coupled", temperature=temperature, u_sample=torch.full((3,), 0.5),
                      backend=backend)
    with pytest.raises(ValueError, match="temperature: expected"):
        fv.cdf_sample(logits, torch.full((3,), 0.5), temperature=float("inf"), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_seed_of_64_bits_is_its_bits_as_uniform_takes_it(backend):
    """A seed in [2**63, 2**64) is the int64 of its bits, as ``uniform`` reads it (it raised an overflow error that
    named no argument); outside 64 bits, a ValueError naming the seed."""
    logits = torch.randn(3, 5)
    args = (logits, torch.tensor([1, 2]), torch.tensor([0, 2], dtype=torch.int32), torch.tensor([-1, 0]))
    position = torch.tensor([5])
    big = fv.verify(*args, rule="coupled", seed=2**63 + 7, position=position, backend=backend)
    same = fv.verify(*args, rule="coupled", seed=7 - 2**63, position=position, backend=backend)
    assert torch.equal(big.next_token, same.next_token) and torch.equal(big.accept_len, same.accept_len)
    with pytest.raises(ValueError, match="seed"):
        fv.verify(*args, rule="coupled", seed=2**64, position=position, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_root_tokens_outside_the_vocabulary_are_refused(backend):
    logits = torch.randn(2, 4)
    for root, match in ((torch.tensor([10**6]), "token ids in"), (torch.tensor([-1]), "token ids in"),
                        (torch.tensor([[1]]), "shape")):
        with pytest.raises(ValueError, match="root_tokens: expected " + match):
            fv.verify(logits, torch.tensor([1]), CU, None, rule="confidence", beta=0.5, root_tokens=root,
                      backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_single_column_vocabulary_with_any_stride_samples(backend):
    """V = 1 from a transposed [1, 4]: its one column's stride is 4, which the C++ kernel refused naming no
    argument ("contiguous last dimension"); every row has token 0."""
    logits = torch.randn(1, 4).t()
    assert logits.stride(1) != 1
    u = torch.full((4,), 0.5)
    assert fv.cdf_sample(logits, u, backend=backend).tolist() == [0, 0, 0, 0]
    v = fv.cdf_invert(logits, torch.zeros(4, dtype=torch.int64), u, backend=backend)
    assert v.shape == (4,)
    empty = torch.randn(1, 0).t()  # [0, 1]
    assert fv.cdf_sample(empty, torch.full((0,), 0.5), backend=backend).shape == (0,)


def test_prefix_len_none_or_past_int32_is_named():
    par = torch.tensor([-1, 0])
    for call in (lambda p: fv.tree_positions(par, None, p), lambda p: fv.tree_mask(par, None, p),
                 lambda p: fv.block_mask(torch.tensor([1, 2]), p)):
        with pytest.raises(TypeError, match="prefix_len"):
            call(None)
        with pytest.raises(ValueError, match="prefix_len: values must fit in int32"):
            call(2**31)
    assert fv.tree_mask(par, None, None, format="packed").shape == (1, 2, 1)  # (the packed mask has no prefix)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_without_head_size_or_with_a_non_finite_scale_is_refused(backend):
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="D >= 1"):
        fv.masked_attention(q[..., :0], k[..., :0], v, backend=backend)
    for scale in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale"):
            fv.masked_attention(q, k, v, scale=scale, backend=backend)
        packed = fv.tree_mask(torch.tensor([-1, 0], dtype=torch.int32), None, 0, format="packed")
        with pytest.raises(ValueError, match="scale"):
            fv.tree_attention(q, k, v, packed, 1, scale=scale, backend=backend)

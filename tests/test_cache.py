"""compact_cache: every backend against a plain-Python slot-by-slot copy; DynamicCache; overlap; bad input."""

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fastverify import _ext  # noqa: E402
from fastverify.ops.cache import compact_cache  # noqa: E402
from fastverify.ops.tree import implemented_backends  # noqa: E402


def device_of(backend):
    if backend == "cuda" or (backend == "triton" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def _skip_reason(backend):
    if backend == "torch":
        return None
    if backend not in implemented_backends("compact_cache", "tree"):
        return f"{backend} backend does not implement compact_cache here (not built / not written / not importable)"
    if backend == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    if not _ext.backends(device_of(backend))[backend]:
        return f"{backend} backend is not usable on {device_of(backend)} here"
    return None


BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(_skip_reason(b) is not None, reason=str(_skip_reason(b))))
            for b in ("torch", "cpp", "triton", "cuda")]


def python_compact(t, prefix_len, draft_start, accepted, accept_len):
    """Slot-by-slot copy from an untouched clone (so overlap cannot matter)."""
    src = t.clone()
    out = t.clone()
    for b in range(t.shape[0]):
        for i in range(int(accept_len[b])):
            out[b, :, int(prefix_len[b]) + i] = src[b, :, draft_start + int(accepted[b, i])]
    return out


def random_accepts(B, n, depth, rng):
    """Accepted paths: strictly increasing local indices (as along a tree path), -1 padded."""
    accepted = torch.full((B, depth), -1, dtype=torch.int32)
    accept_len = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        L = rng.randint(0, min(depth, n))
        idx = sorted(rng.sample(range(n), L))
        accepted[b, :L] = torch.tensor(idx, dtype=torch.int32)
        accept_len[b] = L
    return accepted, accept_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_pair_matches_python(backend, dtype):
    dev = device_of(backend)
    rng = random.Random(0)
    B, H, P, n, D = 5, 3, 20, 12, 16
    S = P + n + 4
    prefix_len = torch.tensor([20, 3, 0, 11, 20], dtype=torch.int32)
    accepted, accept_len = random_accepts(B, n, 6, rng)
    k = torch.randn(B, H, S, D).to(dtype)
    v = torch.randn(B, H + 1, S, D + 8).to(dtype)  # another head count and head dim, as some models have
    ek = python_compact(k, prefix_len, P, accepted, accept_len)
    ev = python_compact(v, prefix_len, P, accepted, accept_len)
    kd, vd = k.to(dev), v.to(dev)
    out = compact_cache((kd, vd), prefix_len.to(dev), P, accepted.to(dev), accept_len.to(dev), backend=backend)
    assert out[0] is kd and out[1] is vd  # in place
    assert torch.equal(kd.cpu(), ek) and torch.equal(vd.cpu(), ev)


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapping_ranges(backend):
    """Destinations after their sources (a forward copy would read clobbered slots) and before them."""
    dev = device_of(backend)
    k = torch.arange(2 * 1 * 12 * 2, dtype=torch.float32).view(2, 1, 12, 2)
    v = -k.clone()
    k0 = k.clone()
    prefix_len = torch.tensor([5, 0], dtype=torch.int32)
    accepted = torch.tensor([[0, 1, 2, 3], [1, 2, 4, -1]], dtype=torch.int32)
    accept_len = torch.tensor([4, 3], dtype=torch.int32)
    ek = python_compact(k, prefix_len, 3, accepted, accept_len)
    ev = python_compact(v, prefix_len, 3, accepted, accept_len)
    kd, vd = k.to(dev), v.to(dev)
    compact_cache((kd, vd), prefix_len.to(dev), 3, accepted.to(dev), accept_len.to(dev), backend=backend)
    assert torch.equal(kd.cpu(), ek) and torch.equal(vd.cpu(), ev)
    assert torch.equal(kd.cpu()[0, 0, 5:9], k0[0, 0, 3:7])  # slots 3..6 moved to 5..8


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_cache(backend):
    """A cache stored [B, S, H, D] and viewed as [B, H, S, D]; a head-dim stride other than 1."""
    dev = device_of(backend)
    rng = random.Random(4)
    B, H, S, D = 3, 2, 30, 8
    k = torch.randn(B, S, H, D).transpose(1, 2)
    v = torch.randn(B, H, S, D, 2)[..., 0]
    assert not k.is_contiguous() and v.stride(-1) == 2
    prefix_len = torch.tensor([10, 4, 17], dtype=torch.int32)
    accepted, accept_len = random_accepts(B, 8, 5, rng)
    ek = python_compact(k, prefix_len, 18, accepted, accept_len)
    ev = python_compact(v, prefix_len, 18, accepted, accept_len)
    kd, vd = k.to(dev), v.to(dev)
    compact_cache((kd, vd), prefix_len.to(dev), 18, accepted.to(dev), accept_len.to(dev), backend=backend)
    assert torch.equal(kd.cpu(), ek) and torch.equal(vd.cpu(), ev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_long_paths_and_unaligned_rows(backend, dtype):
    """Paths longer than the CUDA kernel stages in registers (16: the rest go through its scratch), and rows whose
    bytes are not a multiple of 16 (moved element by element) beside rows that are (moved 16 bytes at a time);
    the Triton kernel holds 32 x 64 elements of a path at once, so its 128-wide rows take two programs."""
    dev = device_of(backend)
    rng = random.Random(7)
    B, H, P, n = 3, 2, 9, 40
    S = P + n
    prefix_len = torch.tensor([9, 0, 4], dtype=torch.int32)
    accepted, accept_len = random_accepts(B, n, 24, rng)
    accept_len[0] = 24
    accepted[0] = torch.tensor(sorted(rng.sample(range(n), 24)), dtype=torch.int32)  # the longest path
    k = torch.randn(B, H, S, 128).to(dtype)
    v = torch.randn(B, H, S, 3).to(dtype)  # 6 or 12 bytes a row
    ek = python_compact(k, prefix_len, P, accepted, accept_len)
    ev = python_compact(v, prefix_len, P, accepted, accept_len)
    kd, vd = k.to(dev), v.to(dev)
    compact_cache((kd, vd), prefix_len.to(dev), P, accepted.to(dev), accept_len.to(dev), backend=backend)
    assert torch.equal(kd.cpu(), ek) and torch.equal(vd.cpu(), ev)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_accepted_is_a_no_op(backend):
    dev = device_of(backend)
    k = torch.randn(2, 2, 9, 4, device=dev)
    before = k.clone()
    compact_cache((k, k), torch.tensor([3, 5], device=dev), 5, torch.zeros(2, 0, dtype=torch.int32, device=dev),
                  torch.zeros(2, dtype=torch.int32, device=dev), backend=backend)
    assert torch.equal(k, before)


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_cache(backend, ragged):
    transformers = pytest.importorskip("transformers")
    dev = device_of(backend)
    B, H, P, n, D, layers = 2, 2, 7, 6, 4, 3
    cache = transformers.DynamicCache()
    originals = []
    for layer in range(layers):
        k = torch.randn(B, H, P + n, D, device=dev)
        v = torch.randn(B, H, P + n, D, device=dev)
        originals.append((k.clone(), v.clone()))
        cache.update(k, v, layer)
    prefix_len = torch.tensor([7, 7] if not ragged else [7, 4], dtype=torch.int32)
    accepted = torch.tensor([[0, 2, 5], [1, 3, -1]], dtype=torch.int32)
    accept_len = torch.tensor([3, 2] if not ragged else [3, 3], dtype=torch.int32)
    if ragged:
        accepted[1, 2] = 4
    out = compact_cache(cache, prefix_len.to(dev), P, accepted.to(dev), accept_len.to(dev), backend=backend)
    assert out is cache
    new_len = int((prefix_len + accept_len).max())
    assert cache.get_seq_length() == new_len
    for layer, (k0, v0) in enumerate(originals):
        ek = python_compact(k0.cpu(), prefix_len, P, accepted, accept_len)[:, :, :new_len]
        ev = python_compact(v0.cpu(), prefix_len, P, accepted, accept_len)[:, :, :new_len]
        assert torch.equal(cache.layers[layer].keys.cpu(), ek)
        assert torch.equal(cache.layers[layer].values.cpu(), ev)
    if not ragged:  # the next step appends after the compacted path, as after transformers' crop
        cache.update(torch.zeros(B, H, 1, D, device=dev), torch.zeros(B, H, 1, D, device=dev), 0)
        assert cache.layers[0].keys.shape[2] == new_len + 1


def test_list_of_layer_pairs():
    layers = [(torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)) for _ in range(2)]
    exp = [(python_compact(k, [3], 3, torch.tensor([[1, 2]]), [2]),
            python_compact(v, [3], 3, torch.tensor([[1, 2]]), [2])) for k, v in layers]
    compact_cache(layers, 3, 3, torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([2]))
    for (k, v), (ek, ev) in zip(layers, exp):
        assert torch.equal(k, ek) and torch.equal(v, ev)


def test_bad_input():
    k = torch.randn(2, 1, 10, 4)
    acc = torch.tensor([[0, 1], [0, -1]], dtype=torch.int32)
    alen = torch.tensor([2, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"accept_len: expected values in \[0, max_depth = 2\]"):
        compact_cache((k, k), 3, 5, acc, torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="accepted: the accepted slots"):
        compact_cache((k, k), 3, 9, acc, alen)
    with pytest.raises(ValueError, match="accepted: the accepted slots"):
        compact_cache((k, k), 3, 5, torch.tensor([[0, 1], [-1, -1]], dtype=torch.int32), alen)
    with pytest.raises(ValueError, match="prefix_len: prefix_len \\+ accept_len must lie"):
        compact_cache((k, k), torch.tensor([9, 0]), 5, acc, alen)
    with pytest.raises(TypeError, match="accepted: expected an integer tensor"):
        compact_cache((k, k), 3, 5, acc.float(), alen)
    with pytest.raises(ValueError, match=r"accepted: expected shape \[B=2, max_depth\]"):
        compact_cache((k, k), 3, 5, acc[0], alen)
    with pytest.raises(TypeError, match="draft_start: expected an int"):
        compact_cache((k, k), 3, 5.0, acc, alen)
    with pytest.raises(ValueError, match=r"cache: expected k of shape \[B, H, S, D\]"):
        compact_cache((k[0], k[0]), 3, 5, acc, alen)
    with pytest.raises(TypeError, match="cache: expected a transformers DynamicCache"):
        compact_cache(object(), 3, 5, acc, alen)


@pytest.mark.skipif(_skip_reason("cpp") is not None, reason=str(_skip_reason("cpp")))
def test_cpp_checks_itself():
    k = torch.randn(2, 1, 10, 4)
    acc = torch.tensor([[0, 7], [0, -1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="accepted: request 0 entry 1 = 7"):
        torch.ops.fastverify.compact_cache(k, k, torch.tensor([3, 3], dtype=torch.int32), 5, acc,
                                           torch.tensor([2, 1], dtype=torch.int32))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values[0] != "torch"])
def test_opcheck(backend):
    dev = device_of(backend)
    k = torch.randn(3, 2, 16, 8, device=dev)
    v = torch.randn(3, 2, 16, 8, device=dev)
    args = (k, v, torch.tensor([4, 2, 6], dtype=torch.int32, device=dev), 6,
            torch.tensor([[0, 3, 4], [1, -1, -1], [2, 5, -1]], dtype=torch.int32, device=dev),
            torch.tensor([3, 1, 2], dtype=torch.int32, device=dev))
    if backend == "triton":
        from fastverify.kernels import tree as kt  # noqa: F401, PLC0415  (registers the op)

        torch.library.opcheck(torch.ops.fastverify.compact_cache_triton, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    else:
        torch.library.opcheck(torch.ops.fastverify.compact_cache, args)


LAYER_BACKENDS = [b for b in BACKENDS if b.values[0] != "triton"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", LAYER_BACKENDS)
def test_layers_in_one_call(backend, dtype, monkeypatch):
    """A list of layers (each its own head count and head dim) against the slot-by-slot copy, and on the cpp / cuda
    kernels in one compact_cache_layers call; two sequence lengths make two groups, one call each."""
    from fastverify.ops import cache as cache_mod

    dev = device_of(backend)
    rng = random.Random(1)
    B, P, n = 3, 9, 7
    prefix_len = torch.tensor([9, 2, 5], dtype=torch.int32)
    accepted, accept_len = random_accepts(B, n, 5, rng)
    shapes = [(2, 8), (1, 16), (3, 4), (2, 8)]
    layers, expected = [], []
    for i, (H, D) in enumerate(shapes):
        S = P + n + (1 if i < 3 else 5)  # the last layer has more slots: a group of its own
        k, v = torch.randn(B, H, S, D).to(dtype), torch.randn(B, H + 1, S, D + 2).to(dtype)
        expected.append((python_compact(k, prefix_len, P, accepted, accept_len),
                         python_compact(v, prefix_len, P, accepted, accept_len)))
        layers.append((k.to(dev), v.to(dev)))
    calls = []
    real = cache_mod.dispatch.call
    monkeypatch.setattr(cache_mod.dispatch, "call", lambda op, *a: calls.append(op) or real(op, *a))
    compact_cache(layers, prefix_len.to(dev), P, accepted.to(dev), accept_len.to(dev), backend=backend)
    for (k, v), (ek, ev) in zip(layers, expected):
        assert torch.equal(k.cpu(), ek) and torch.equal(v.cpu(), ev)
    assert calls == ["compact_cache_layers", "compact_cache"]  # 3 layers of one S in one call; the fourth alone


@pytest.mark.parametrize("depth", [5, 24], ids=["staged", "long-paths"])
@pytest.mark.parametrize("backend", LAYER_BACKENDS)
def test_many_layers_of_mixed_rows_in_one_call(backend, depth):
    """More tensors than one CUDA launch takes (its kernel moves up to 32 tensors of one word size per launch): 24
    layers, 36 tensors whose rows are 16-byte words and 12 whose rows are not (3 float16 elements, moved element by
    element), one key in every four a non-contiguous view; paths within and past the 16 moves the kernel stages in
    registers (past them each tensor uses its own scratch)."""
    dev = device_of(backend)
    rng = random.Random(depth)
    B, P, n = 2, 6, 30
    S = P + n
    prefix_len = torch.tensor([6, 3], dtype=torch.int32)
    accepted, accept_len = random_accepts(B, n, depth, rng)
    accept_len[0] = depth
    accepted[0] = torch.tensor(sorted(rng.sample(range(n), depth)), dtype=torch.int32)
    layers, expected = [], []
    for i in range(24):
        k = torch.randn(B, 2, S, 8 * (1 + i % 3)).half()
        v = torch.randn(B, 1 + i % 3, S, 8 if i % 2 else 3).half()
        if i % 4 == 3:  # slots strided apart (a view of a larger buffer)
            k = torch.randn(B, 2, 2 * S, 8).half()[:, :, ::2]
        expected.append((python_compact(k, prefix_len, P, accepted, accept_len),
                         python_compact(v, prefix_len, P, accepted, accept_len)))
        layers.append((k.to(dev), v.to(dev)))
    compact_cache(layers, prefix_len.to(dev), P, accepted.to(dev), accept_len.to(dev), backend=backend)
    for (k, v), (ek, ev) in zip(layers, expected):
        assert torch.equal(k.cpu(), ek) and torch.equal(v.cpu(), ev)


@pytest.mark.parametrize("backend", [b for b in LAYER_BACKENDS if b.values[0] != "torch"])
def test_layers_op_checks_itself(backend):
    dev = device_of(backend)
    op = torch.ops.fastverify.compact_cache_layers
    k = [torch.randn(2, 1, 10, 4, device=dev) for _ in range(3)]
    pl, acc = torch.tensor([3, 3], dtype=torch.int32, device=dev), torch.zeros(2, 2, dtype=torch.int32, device=dev)
    alen = torch.ones(2, dtype=torch.int32, device=dev)
    with pytest.raises(RuntimeError, match="as many value tensors as key tensors"):
        op(k, k[:2], pl, 5, acc, alen)
    with pytest.raises(RuntimeError, match="slots"):
        op(k, k[:2] + [torch.randn(2, 1, 12, 4, device=dev)], pl, 5, acc, alen)
    op([], [], pl, 5, acc, alen)  # no layers: nothing to move


@pytest.mark.parametrize("backend", [b for b in LAYER_BACKENDS if b.values[0] != "torch"])
def test_layers_opcheck(backend):
    dev = device_of(backend)
    ks = [torch.randn(3, 2, 16, 8, device=dev) for _ in range(2)]
    vs = [torch.randn(3, 1, 16, 4, device=dev) for _ in range(2)]
    args = (ks, vs, torch.tensor([4, 2, 6], dtype=torch.int32, device=dev), 6,
            torch.tensor([[0, 3, 4], [1, -1, -1], [2, 5, -1]], dtype=torch.int32, device=dev),
            torch.tensor([3, 1, 2], dtype=torch.int32, device=dev))
    torch.library.opcheck(torch.ops.fastverify.compact_cache_layers, args)


def test_buffered_cache_pairs():
    """The loop's cache: compact_cache on the buffered layers' buffers (cache_pairs), then cropped, leaves what it
    leaves a plain DynamicCache with the same contents."""
    transformers = pytest.importorskip("transformers")
    from fastverify.hf.attention import cache_pairs, crop_cache, new_cache

    B, H, P, n, D = 2, 2, 5, 6, 4
    buffered, plain = new_cache(), transformers.DynamicCache()
    for layer in range(3):
        k, v = torch.randn(B, H, P + n, D), torch.randn(B, H, P + n, D)
        buffered.update(k.clone(), v.clone(), layer)
        plain.update(k.clone(), v.clone(), layer)
    pairs = cache_pairs(buffered)
    assert len(pairs) == 3 and all(kb.shape[2] > P + n for kb, _ in pairs)  # the buffers, not views of the length
    prefix_len = torch.tensor([5, 3], dtype=torch.int32)
    accepted = torch.tensor([[0, 2, 5], [1, -1, -1]], dtype=torch.int32)
    accept_len = torch.tensor([3, 1], dtype=torch.int32)
    compact_cache(pairs, prefix_len, P, accepted, accept_len, validate=False)
    crop_cache(buffered, 8)
    compact_cache(plain, prefix_len, P, accepted, accept_len)
    for a, b in zip(buffered.layers, plain.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    buffered.layers[1].is_sliding = True  # a sliding window's layer is refused, as compact_cache refuses it
    with pytest.raises(ValueError, match=r"cache.layers\[1\]: sliding-window layers are not supported"):
        cache_pairs(buffered)

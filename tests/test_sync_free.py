"""The validate=False paths of the ops read nothing back from the device, so that a serving loop can call them
without host synchronisation, capture them in a CUDA graph, and trace them with torch.compile(fullgraph=True).

On the CPU a guard makes every read of a tensor's values into Python fail (``.item()``, ``.tolist()``, ``bool()``,
``int()``, ``float()``, ``__index__``, ``nonzero``); where a GPU exists the same calls also run under
``torch.cuda.set_sync_debug_mode("error")``, which catches synchronisations inside torch's own kernels too. Every
guarded call is checked equal to the validated call on the same inputs.
"""

import contextlib

import pytest
import torch

import fastverify
from fastverify.ops.cache import compact_cache

HAS_GPU = torch.cuda.is_available()


@contextlib.contextmanager
def no_device_reads():
    """Fail on any read of a tensor's values into Python (what a device-to-host synchronisation would be)."""
    def refuse(name):
        def f(*args, **kwargs):
            raise AssertionError(f"the path read a tensor's values back: Tensor.{name}")
        return f

    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")
    saved = {n: torch.Tensor.__dict__.get(n) for n in names}
    saved_nonzero = torch.nonzero
    try:
        for n in names:
            setattr(torch.Tensor, n, refuse(n))
        torch.nonzero = refuse("nonzero")
        yield
    finally:
        for n, f in saved.items():
            if f is None:
                delattr(torch.Tensor, n)
            else:
                setattr(torch.Tensor, n, f)
        torch.nonzero = saved_nonzero


def test_the_guard_catches_reads():
    t = torch.ones(3)
    for read in (lambda: t.sum().item(), lambda: t.tolist(), lambda: bool(t[0]), lambda: int(t[0]),
                 lambda: float(t[0]), lambda: [0, 1][torch.tensor(1)], lambda: t.nonzero(),
                 lambda: torch.nonzero(t)):
        with no_device_reads(), pytest.raises(AssertionError, match="read a tensor's values"):
            read()
    assert bool(t[0]) and t.tolist() == [1.0, 1.0, 1.0]  # restored


# A batch of three requests: a 5-node tree, no draft, a 3-node chain (V = 37).
PARENTS = [-1, 0, 0, 1, -1, -1, 0, 1]
CU = [0, 5, 5, 8]


def _batch(device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    N, B, V = len(PARENTS), len(CU) - 1, 37
    logits = (torch.randn(N + B, V, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, V, (N,), generator=g)
    # make a few drafts the argmax so that paths get accepted
    tokens[0] = logits[0].float().argmax()
    tokens[1] = logits[1].float().argmax()
    return dict(logits=logits.to(device), draft_tokens=tokens.to(device),
                cu_nodes=torch.tensor(CU, dtype=torch.int32, device=device),
                parents=torch.tensor(PARENTS, dtype=torch.int32, device=device))


def _verify_cases(device):
    b = _batch(device)
    N, V = len(PARENTS), 37
    seed = torch.tensor([1, 2, 3], device=device)
    pos = torch.tensor([10, 20, 30], device=device)
    probs = torch.softmax(torch.randn(N, V, generator=torch.Generator().manual_seed(1)), -1).to(device)
    k = torch.tensor([1.0, 2.0, 3.0], device=device)
    yield "greedy", dict(b, rule="greedy", max_depth=4)
    yield "topk tensor k", dict(b, rule="topk", k=k, max_depth=4)
    yield "gad", dict(b, rule="gad", beta=3, tau=2.0, max_depth=4)
    yield "typical", dict(b, rule="typical", eps=0.1, max_depth=4)
    yield "confidence", dict(b, rule="confidence", beta=0.2, root_tokens=torch.tensor([1, 2, 3], device=device),
                             max_depth=4)
    yield "min_accept", dict(b, rule="greedy", min_accept=2, max_depth=4)
    yield "speculative seeded", dict(b, rule="speculative", seed=seed, position=pos, temperature=0.8, top_k=20,
                                     max_depth=4)
    yield "speculative draft_probs", dict(b, rule="speculative", draft_probs=probs, seed=7, position=pos,
                                          max_depth=4)
    yield "coupled seeded", dict(b, rule="coupled", seed=seed, position=pos, top_p=0.9, max_depth=4)
    yield "coupled tensor warping", dict(b, rule="coupled", seed=seed, position=pos,
                                         temperature=torch.tensor([0.5, 1.0, 0.0], device=device), max_depth=4)
    yield "chains, ragged", dict(b, parents=None, rule="greedy", max_depth=5)
    dense = dict(logits=b["logits"][:4].reshape(2, 2, V), draft_tokens=b["draft_tokens"][:2].reshape(2, 1))
    yield "dense chains", dict(dense, rule="greedy")
    yield "dense seeded", dict(dense, rule="speculative", seed=seed[:2], position=pos[:2])
    tree = dict(logits=b["logits"][:8].reshape(2, 4, V), draft_tokens=b["draft_tokens"][:6].reshape(2, 3),
                parents=torch.tensor([-1, 0, 0], dtype=torch.int32, device=device))
    yield "dense tree seeded", dict(tree, rule="coupled", seed=seed[:2], position=pos[:2])


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("case", [c for c, _ in _verify_cases("cpu")])
def test_verify_reads_nothing_back(case):
    kw = dict(_verify_cases("cpu"))[case]
    want = fastverify.verify(**kw)
    fastverify.verify(**kw, validate=False)  # the constant-parameter cache is filled on a first call
    with no_device_reads():
        got = fastverify.verify(**kw, validate=False)
    assert _same(got, want)
    assert got.accepted.shape[1] == kw.get("max_depth", kw["draft_tokens"].shape[-1])


# the Triton wrappers under the CPU guard (the interpreter); on a GPU the test_gpu_* cases run them under the sync
# debug mode instead
triton_cpu = pytest.mark.skipif(HAS_GPU or not fastverify._ext.backends("cpu")["triton"],
                                reason="on a GPU: test_gpu_*; on a CPU the Triton backend needs TRITON_INTERPRET=1")


@triton_cpu
@pytest.mark.parametrize("case", [c for c, _ in _verify_cases("cpu")])
def test_triton_verify_reads_nothing_back(case):
    """The Triton wrapper sizes its launches from host-known sizes, never from values read back (an H100 run
    caught int(counts.max()) under the sync debug mode; the guard catches the same read under the interpreter)."""
    kw = dict(_verify_cases("cpu"))[case]
    want = fastverify.verify(**kw)
    fastverify.verify(**kw, backend="triton", validate=False)
    with no_device_reads():
        got = fastverify.verify(**kw, backend="triton", validate=False)
    assert _same(got, want)


def test_verify_max_depth():
    b = _batch("cpu")
    full = fastverify.verify(**b)
    assert full.accepted.shape == (3, 3)  # the deepest node has depth 3
    wide = fastverify.verify(**b, max_depth=6)
    assert torch.equal(wide.accepted[:, :3], full.accepted) and bool((wide.accepted[:, 3:] == -1).all())
    narrow = fastverify.verify(**b, max_depth=1, validate=False)  # cut: the path's first node only
    assert torch.equal(narrow.accept_len, full.accept_len) and torch.equal(narrow.accepted, full.accepted[:, :1])
    with pytest.raises(ValueError, match="max_depth: the deepest node has depth 3"):
        fastverify.verify(**b, max_depth=2)
    with pytest.raises(ValueError, match="max_depth: expected None or an int"):
        fastverify.verify(**b, max_depth=-1)


def test_device_depth_matches_the_host_walk():
    """Seeded uniforms of an unvalidated tree come from depths found on the device (pointer jumping)."""
    from fastverify.ops.verify import _device_depth
    g = torch.Generator().manual_seed(3)
    for n_max in (1, 2, 7, 16, 33):
        counts = torch.randint(0, n_max + 1, (5,), generator=g).tolist()
        parents, depth = [], []
        for c in counts:
            d = []
            for j in range(c):
                p = int(torch.randint(-1, j, (1,), generator=g)) if j else -1
                parents.append(p)
                d.append(1 if p < 0 else d[p] + 1)
            depth += d
        cu = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
        got = _device_depth(torch.tensor(parents, dtype=torch.int32), cu, len(parents), n_max)
        assert got.tolist() == depth


def _sampling_cases(device):
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 101, generator=g) * 2).to(device)
    u = fastverify.uniform(torch.arange(6, device=device), torch.arange(6, device=device) + 40)
    tok = torch.randint(0, 101, (6,), generator=g).to(device)
    temps = torch.tensor([0.0, 0.5, 1.0, 1.5, 0.7, 1.0], device=device)
    yield "cdf_sample", fastverify.cdf_sample, (logits, u), dict(top_k=20, top_p=0.9)
    yield "cdf_sample tensors", fastverify.cdf_sample, (logits, u), dict(temperature=temps, top_k=temps * 0 + 5)
    yield "cdf_invert", fastverify.cdf_invert, (logits, tok, u), dict(top_k=0, min_p=0.01)
    yield "uniform int seed", fastverify.uniform, (7, torch.arange(9, device=device)), dict(stream=3)
    yield "uniform tensors", fastverify.uniform, (torch.arange(9, device=device), torch.arange(9, device=device)), \
        dict(stream=torch.arange(9, device=device))


@pytest.mark.parametrize("case", [c[0] for c in _sampling_cases("cpu")])
def test_sampling_reads_nothing_back(case):
    _, fn, args, kw = next(c for c in _sampling_cases("cpu") if c[0] == case)
    want = fn(*args, **kw)
    fn(*args, **kw, validate=False)
    with no_device_reads():
        got = fn(*args, **kw, validate=False)
    assert torch.equal(got, want) or (got.isnan() == want.isnan()).all() and torch.equal(got[~got.isnan()],
                                                                                          want[~want.isnan()])


def test_sampling_unvalidated_bad_rows():
    logits = torch.randn(3, 11)
    logits[1, 4] = float("nan")
    u = torch.full((3,), 0.5)
    out = fastverify.cdf_sample(logits, u, validate=False)
    assert out[1] == -1 and out[0] >= 0 and out[2] >= 0
    with pytest.raises(ValueError, match="logits: row 1"):
        fastverify.cdf_sample(logits, u)
    inv = fastverify.cdf_invert(torch.randn(2, 11), torch.tensor([3, 11]), torch.full((2,), 0.5), validate=False)
    assert inv[0] > 0 and inv[0] < 1 and inv.shape == (2,)  # token 11 is out of range: unspecified, in bounds


def _mask_cases(device):
    par = torch.tensor(PARENTS, dtype=torch.int32, device=device)
    cu = torch.tensor(CU, dtype=torch.int32, device=device)
    plen = torch.tensor([4, 0, 9], device=device)
    for fmt in ("bool", "additive", "packed"):
        yield f"tree_mask {fmt}", fastverify.tree_mask, (par, cu, plen), dict(format=fmt, max_nodes=5, max_prefix=9)
    yield "tree_mask int prefix", fastverify.tree_mask, (par, cu, 6), dict(max_nodes=5)
    yield "tree_positions", fastverify.tree_positions, (par, cu, plen), {}
    yield "block_mask bidirectional", fastverify.block_mask, (4, plen), dict(kind="bidirectional", max_prefix=9)
    yield "block_mask causal", fastverify.block_mask, (4, plen), dict(kind="causal", max_prefix=9)
    sizes = torch.tensor([2, 0, 3], device=device)
    yield "block_mask sizes", fastverify.block_mask, (sizes, 5), dict(kind="bidirectional", max_nodes=3)


@pytest.mark.parametrize("case", [c[0] for c in _mask_cases("cpu")])
def test_masks_read_nothing_back(case):
    _, fn, args, kw = next(c for c in _mask_cases("cpu") if c[0] == case)
    want = fn(*args, **kw)
    with no_device_reads():
        got = fn(*args, **kw, validate=False)
    assert torch.equal(got, want)


@triton_cpu
@pytest.mark.parametrize("case", [c[0] for c in _mask_cases("cpu")])
def test_triton_masks_read_nothing_back(case):
    _, fn, args, kw = next(c for c in _mask_cases("cpu") if c[0] == case)
    want = fn(*args, **kw)
    with no_device_reads():
        got = fn(*args, **kw, backend="triton", validate=False)
    assert torch.equal(got, want)


def test_mask_sizes_checked():
    par = torch.tensor(PARENTS, dtype=torch.int32)
    cu = torch.tensor(CU, dtype=torch.int32)
    with pytest.raises(ValueError, match="max_nodes: request sizes go up to 5"):
        fastverify.tree_mask(par, cu, 0, max_nodes=4)
    with pytest.raises(ValueError, match="max_prefix: prefix_len goes up to 9"):
        fastverify.tree_mask(par, cu, torch.tensor([4, 0, 9]), max_prefix=8)
    tight = fastverify.tree_mask(par, cu, 2)  # n = 5, P = 2
    wide = fastverify.tree_mask(par, cu, 2, max_nodes=7, max_prefix=3)  # padding rows and columns
    assert wide.shape == (3, 7, 10)
    assert torch.equal(wide[:, :5, :2], tight[:, :, :2]) and torch.equal(wide[:, :5, 3:8], tight[:, :, 2:])
    assert not wide[:, :, 2].any() and not wide[:, :, 8:].any() and not wide[:, 5:, 2:].any()
    assert wide[:, 5:, :2].all()


def _cache_case(device):
    g = torch.Generator().manual_seed(2)
    k = torch.randn(3, 2, 12, 4, generator=g).to(device)
    v = torch.randn(3, 2, 12, 5, generator=g).to(device)
    accepted = torch.tensor([[0, 2], [-1, -1], [1, -1]], dtype=torch.int32, device=device)
    accept_len = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    return k, v, torch.tensor([3, 5, 4], device=device), 6, accepted, accept_len


@pytest.mark.parametrize("form", ["pair", "list", "layers"])
def test_compact_cache_reads_nothing_back(form):
    k, v, plen, start, acc, alen = _cache_case("cpu")
    k2, v2, k3, v3 = k.clone(), v.clone(), k.clone(), v.clone()
    compact_cache((k, v), plen, start, acc, alen)
    with no_device_reads():  # "layers": two layers, in one compact_cache_layers call
        cache = {"pair": (k2, v2), "list": [(k2, v2)], "layers": [(k2, v2), (k3, v3)]}[form]
        compact_cache(cache, plen, start, acc, alen, validate=False)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    if form == "layers":
        assert torch.equal(k, k3) and torch.equal(v, v3)


def test_torch_compile_fullgraph():
    """The unvalidated calls of a decoding step trace into one graph (no graph break)."""
    torch._dynamo.reset()
    b = _batch("cpu")
    seed = torch.tensor([1, 2, 3])

    def step(logits, draft_tokens, cu_nodes, parents, position):
        out = fastverify.verify(logits, draft_tokens, cu_nodes, parents, rule="coupled", seed=seed,
                                position=position, top_k=10, max_depth=4, validate=False)
        rows = cu_nodes[1:].long() + torch.arange(3)  # each request's last row
        u = fastverify.uniform(seed, position + 5, validate=False)
        nxt = fastverify.cdf_sample(logits[rows], u, top_k=10, validate=False)
        return out.accept_len, out.accepted, out.next_token, nxt

    pos = torch.tensor([3, 4, 5])
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for p in (pos, pos + 1):
        assert all(torch.equal(x, y) for x, y in zip(compiled(**b, position=p), step(**b, position=p)))


# ---------------------------------------------------------------------------------------------------------------
# On a GPU: torch's sync debug mode, and CUDA-graph capture with replays that draw fresh uniforms

gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


@contextlib.contextmanager
def sync_debug_error():
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


def _gpu_backends(op):
    return [b for b in ("cuda", "triton") if b in fastverify.ops.dispatch.implemented_backends(op)]


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("case", [c for c, _ in _verify_cases("cpu")])
def test_gpu_verify_no_sync(case, backend):
    if backend not in _gpu_backends("verify"):
        pytest.skip(f"no {backend} verify here")
    kw = dict(_verify_cases("cuda"))[case]
    want = fastverify.verify(**kw, backend=backend)
    fastverify.verify(**kw, backend=backend, validate=False)
    with sync_debug_error():
        got = fastverify.verify(**kw, backend=backend, validate=False)
    assert _same(got, want)


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("case", [c[0] for c in _sampling_cases("cpu")] + [c[0] for c in _mask_cases("cpu")])
def test_gpu_ops_no_sync(case, backend):
    _, fn, args, kw = next(c for c in list(_sampling_cases("cuda")) + list(_mask_cases("cuda")) if c[0] == case)
    want = fn(*args, **kw, backend=backend)
    fn(*args, **kw, backend=backend, validate=False)
    with sync_debug_error():
        got = fn(*args, **kw, backend=backend, validate=False)
    assert torch.equal(got, want) or torch.equal(got.isnan(), want.isnan())


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_compact_cache_no_sync(backend):
    k, v, plen, start, acc, alen = _cache_case("cuda")
    layers = [(k.clone(), v.clone()) for _ in range(3)]
    compact_cache((k, v), plen, start, acc, alen, backend=backend)
    with sync_debug_error():
        compact_cache(layers[0], plen, start, acc, alen, backend=backend, validate=False)
        # two layers: one compact_cache_layers call on cuda
        compact_cache(layers[1:], plen, start, acc, alen, backend=backend, validate=False)
    for k2, v2 in layers:
        assert torch.equal(k, k2) and torch.equal(v, v2)


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_cuda_graph_replays_draw_fresh_uniforms(backend):
    """A captured step (seeded speculative verify + sampling of the next token) replayed after the position
    tensor advances gives exactly the eager results at the new positions: fresh draws on every replay, not the
    captured ones."""
    b = _batch("cuda")
    seed = torch.tensor([11, 12, 13], device="cuda")
    position = torch.tensor([100, 200, 300], device="cuda")
    rows = b["cu_nodes"][1:].long() + torch.arange(3, device="cuda")

    def step():
        out = fastverify.verify(**b, rule="speculative", seed=seed, position=position, temperature=0.9, top_k=10,
                                max_depth=4, backend=backend, validate=False)
        u = fastverify.uniform(seed, position + 7, validate=False)
        nxt = fastverify.cdf_sample(b["logits"][rows], u, temperature=0.9, top_k=10, backend=backend,
                                    validate=False)
        return out.accept_len, out.accepted, out.next_token, nxt, u

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()  # warm up: caches filled, kernels loaded
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    seen_u = set()
    for shift in range(4):
        position.copy_(torch.tensor([100, 200, 300], device="cuda") + 13 * shift)
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        assert all(torch.equal(x, y) for x, y in zip(outs, want)), shift
        seen_u.add(tuple(outs[-1].tolist()))
    assert len(seen_u) == 4  # every replay drew new uniforms

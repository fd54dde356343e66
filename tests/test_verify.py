"""fastverify.verify: every rule, every backend against the torch reference (fastverify/reference/verify.py), plus
hand-checked cases of the reference itself and every bad input.

Backends: torch (the reference), cpp (csrc/cpu/verify.cpp), triton (kernels/verify.py, TRITON_INTERPRET=1 on CPU),
cuda (csrc/cuda/verify.cu; skipped without a GPU). A backend whose code does not exist yet is skipped with a reason.
"""

import math

import pytest
import torch
from conftest import LOGIT_DTYPES, backend_params, device_of, random_batch, to_device

import fastverify
from fastverify.ops.verify import RULES, available_backends, verify
from fastverify.reference import sampling as ref_sampling
from fastverify.reference import verify as ref_verify

FAST = backend_params(available_backends(), ("cpp", "triton", "cuda"))
ALL = backend_params(available_backends())

# Deterministic rules with parameters that accept a fair share of random drafts (see random_batch's p_argmax).
DET_CASES = [
    ("greedy", {}),
    ("topk", {"k": 3}),
    ("distance", {"eps": 2}),
    ("gad", {"beta": 3, "tau": 1.5}),
    ("typical", {"eps": 0.3, "delta": 0.2}),
    ("confidence", {"beta": 0.15}),
]
SAMPLING_CASES = [
    ("speculative", {}),
    ("speculative", {"temperature": 0.7, "top_k": 5, "top_p": 0.9}),
    ("coupled", {}),
    ("coupled", {"temperature": 1.3, "top_p": 0.8, "min_p": 0.05}),
]


def _args(batch):
    return batch["logits"], batch["draft_tokens"], batch["cu_nodes"], batch["parents"]


def _assert_same(out, ref, what=""):
    for name, a, b in zip(("accept_len", "accepted", "next_token"), out, ref):
        assert torch.equal(a.cpu(), b.cpu()), f"{what} {name}: backend {a.tolist()} != reference {b.tolist()}"


def _compare(backend, batch, rule, seed=0, **kw):
    """Run one backend and the reference on the same batch and uniforms; assert equal outputs."""
    device = device_of(backend)
    if rule in ref_verify.SAMPLING_RULES:
        g = torch.Generator().manual_seed(seed)
        N = batch["draft_tokens"].numel()
        B = batch["cu_nodes"].numel() - 1
        kw.setdefault("u_sample", torch.rand(N + B, generator=g).clamp(1e-6, 1 - 1e-6))
        if rule == "speculative":
            kw.setdefault("u_accept", torch.rand(N, generator=g).clamp(1e-6, 1 - 1e-6))
    ref = verify(*_args(batch), rule=rule, backend="torch", **kw)
    kw_dev = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out = verify(*_args(to_device(batch, device)), rule=rule, backend=backend, **kw_dev)
    _assert_same(out, ref, f"{backend} {rule} {kw if len(str(kw)) < 200 else ''}")
    return ref


# ---------------------------------------------------------------------------------------------------------------
# Backends against the reference


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", ["chain", "random", "star"])
@pytest.mark.parametrize("rule,params", DET_CASES, ids=[c[0] for c in DET_CASES])
def test_deterministic_rules_match_reference(backend, dtype, shape, rule, params):
    for i, V in enumerate((1, 3, 1000)):
        gen = torch.Generator().manual_seed(1000 * i + 7)
        batch = random_batch(5, V, max_nodes=7, shape=shape, dtype=dtype, gen=gen)
        _compare(backend, batch, rule, **params)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("rule,params", DET_CASES, ids=[c[0] for c in DET_CASES])
def test_min_accept_matches_reference(backend, rule, params):
    gen = torch.Generator().manual_seed(3)
    batch = random_batch(6, 300, max_nodes=8, dtype=torch.float32, gen=gen, p_argmax=0.2)
    for m in (1, 2, 5):
        _compare(backend, batch, rule, min_accept=m, **params)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("rule,params", SAMPLING_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(SAMPLING_CASES)])
@pytest.mark.parametrize("shape", ["chain", "random"])
def test_sampling_rules_match_reference(backend, rule, params, shape):
    for i, (V, dtype) in enumerate(((3, torch.float32), (500, torch.bfloat16), (1000, torch.float16))):
        gen = torch.Generator().manual_seed(100 + i)
        batch = random_batch(4, V, max_nodes=6, shape=shape, dtype=dtype, gen=gen, scale=1.0)
        _compare(backend, batch, rule, seed=i, **params)


@pytest.mark.parametrize("backend", FAST)
def test_speculative_draft_probs_match_reference(backend):
    for i, shape in enumerate(("chain", "random")):
        gen = torch.Generator().manual_seed(50 + i)
        batch = random_batch(4, 200, max_nodes=6, shape=shape, gen=gen, scale=1.0)
        N = batch["draft_tokens"].numel()
        q = torch.softmax(torch.randn(N, 200, generator=gen), -1)
        # Drafts drawn from q, as a drafter would.
        batch["draft_tokens"] = torch.multinomial(q, 1, generator=gen)[:, 0] if N else batch["draft_tokens"]
        _compare(backend, batch, "speculative", seed=i, draft_probs=q)
        _compare(backend, batch, "speculative", seed=i, draft_probs=q.to(torch.bfloat16), temperature=0.8)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("warping", [{}, {"top_k": 7}, {"top_k": 900, "temperature": 1.5}, {"top_p": 0.7},
                                     {"min_p": 0.02, "temperature": 0.6}], ids=str)
def test_speculative_one_hot_residual_matches_reference(backend, warping):
    """One-hot drafts rejected one after another (stars: many siblings, duplicates among them, few argmax drafts):
    the residual without the rejected tokens, over several sampling blocks (V = 3000) and the top-k sparse path."""
    for i in range(4):
        gen = torch.Generator().manual_seed(300 + i)
        batch = random_batch(5, 3000, max_nodes=9, min_nodes=1, shape=("star", "random")[i % 2], gen=gen,
                             scale=3.0, p_argmax=0.1, p_duplicate=0.3)
        _compare(backend, batch, "speculative", seed=i, **warping)


@pytest.mark.parametrize("backend", backend_params(available_backends(), ("cuda",)))
def test_cuda_speculative_deferred_draw(backend, monkeypatch):
    """FASTVERIFY_CUDA_SPECULATIVE=deferred: the rows pass tests every row's children without drawing and the final
    pass draws at each request's final row, redoing rows the rows pass left unresolved (a child tested after two
    rejections). Both ways give the reference's outputs: chains accepted several rows deep, stars of up to 12
    siblings with duplicates, draft_probs, warpings, requests at temperature 0 beside sampled ones, and more requests
    than the final pass's 128 CTAs."""
    cases = []
    for i, dtype in enumerate((torch.float32, torch.bfloat16)):
        gen = torch.Generator().manual_seed(700 + i)
        cases.append((random_batch(3, 151936, max_nodes=8, min_nodes=1, shape="chain", dtype=dtype, gen=gen,
                                   scale=1.0, p_argmax=0.8), {}))
    for i, shape in enumerate(("star", "random")):
        gen = torch.Generator().manual_seed(710 + i)
        batch = random_batch(6, 3000, max_nodes=12, shape=shape, gen=gen, scale=3.0, p_argmax=0.2, p_duplicate=0.3)
        cases += [(batch, {}), (batch, {"top_k": 7}), (batch, {"top_p": 0.7, "temperature": 1.5}),
                  (batch, {"temperature": torch.tensor([1.0, 0.0, 0.7, 1.0, 2.0, 0.0]),
                           "min_p": torch.tensor([0.0, 0.1, 0.0, 0.2, 0.0, 0.0])})]
        N = batch["draft_tokens"].numel()
        q = torch.softmax(torch.randn(N, 3000, generator=gen), -1)
        cases.append((batch, {"draft_probs": q}))
        cases.append((batch, {"draft_probs": q.to(torch.bfloat16), "temperature": 0.8}))
    gen = torch.Generator().manual_seed(720)
    cases.append((random_batch(300, 64, max_nodes=5, shape="random", gen=gen, scale=1.0), {}))
    for mode in (None, "deferred"):
        if mode is None:
            monkeypatch.delenv("FASTVERIFY_CUDA_SPECULATIVE", raising=False)
        else:
            monkeypatch.setenv("FASTVERIFY_CUDA_SPECULATIVE", mode)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i, (batch, kw) in enumerate(cases):
                _compare(backend, batch, "speculative", seed=i, **kw)
            torch.cuda.synchronize()
        final_pass = any("speculative_final" in e.name for e in prof.events())
        assert final_pass == (mode == "deferred"), f"mode {mode}: the final pass ran: {final_pass}"


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("V", [32000, 49152, 151936])
def test_large_vocab(backend, V):
    gen = torch.Generator().manual_seed(V)
    for dtype, rules in ((torch.float32, ("greedy", "gad", "typical")), (torch.bfloat16, ("topk", "confidence"))):
        batch = random_batch(2, V, max_nodes=4, min_nodes=1, dtype=dtype, gen=gen)
        for rule, params in DET_CASES:
            if rule in rules:
                _compare(backend, batch, rule, **params)
    if V == 49152 and not (backend == "triton" and device_of(backend).type == "cpu"):  # ~1 min in the interpreter
        batch = random_batch(2, V, max_nodes=3, min_nodes=1, gen=gen)
        _compare(backend, batch, "coupled", temperature=0.9, top_p=0.95)
        _compare(backend, batch, "speculative", top_k=50)


@pytest.mark.parametrize("backend", FAST)
def test_requests_wider_than_the_walk(backend):
    """Requests of 129-168 nodes: more than the node lanes the Triton walk and speculative kernels hold at once
    (kernels/verify.py, WALK_BLOCK_N), so accepted paths, forced paths, siblings with the same token and bad rows
    lie across their chunks; greedy, GAD++ with min_accept, top-k, coupled and speculative against the
    reference."""
    from fastverify.kernels.verify import WALK_BLOCK_N
    gen = torch.Generator().manual_seed(5)
    wide = dict(min_nodes=WALK_BLOCK_N + 1, max_nodes=WALK_BLOCK_N + 40, gen=gen)
    chain = random_batch(2, 40, shape="chain", p_argmax=1.0, **wide)
    ref = _compare(backend, chain, "greedy")
    assert ref[0].min() > WALK_BLOCK_N  # whole chains accepted: ancestors across chunks
    chain = random_batch(2, 40, shape="chain", p_argmax=0.3, **wide)
    ref = _compare(backend, chain, "gad", beta=3, tau=1.5, min_accept=WALK_BLOCK_N + 1)
    assert ref[0].min() == WALK_BLOCK_N + 1
    for shape in ("random", "star"):  # (the rules differ in the node kernel, one program per node, not here)
        batch = random_batch(2, 40, shape=shape, scale=1.0, p_duplicate=0.3, **wide)
        _compare(backend, batch, "topk", k=2)
        _compare(backend, batch, "coupled", seed=1)  # the first of the siblings holding the draw
        _compare(backend, batch, "speculative", seed=2)
        _compare(backend, batch, "speculative", temperature=0.0)  # its greedy walk
    bad = random_batch(2, 40, **wide)
    bad["logits"][bad["cu_nodes"][1] - 1, 3] = float("nan")  # a row of request 0 past its first chunk of rows
    out = verify(*_args(bad), rule="greedy", backend=backend, validate=False)
    assert out[0].tolist()[0] == -1 and out[0].tolist()[1] >= 0


@pytest.mark.parametrize("backend", FAST)
def test_ties(backend):
    """Integer-valued logits: many ties, so argmax and rank must break them by the lower token id."""
    gen = torch.Generator().manual_seed(11)
    for dtype in LOGIT_DTYPES:
        batch = random_batch(6, 64, max_nodes=6, dtype=dtype, gen=gen, p_argmax=0.3)
        batch["logits"] = torch.randint(0, 4, batch["logits"].shape, generator=gen).to(dtype)
        for rule, params in DET_CASES:
            _compare(backend, batch, rule, **params)
        _compare(backend, batch, "topk", k=1)
        _compare(backend, batch, "topk", k=17)


@pytest.mark.parametrize("backend", FAST)
def test_rank_across_blocks_with_ties(backend):
    """topk accepts x iff rank(x) < k, rank(x) = #{l_v > l_x} + #{l_v == l_x, v < x}: probe k = rank and rank + 1
    with many ties spread over a row long enough for several kernel blocks, x at block edges and inside."""
    gen = torch.Generator().manual_seed(21)
    V = 10007
    device = device_of(backend)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randint(0, 5, (2, V), generator=gen).float()
        logits[0, 9000:] = -math.inf                       # -inf ties too (x = 9500 below)
        for x in (0, 7, 2047, 2048, 2049, 5000, 9500, V - 1):
            row = logits.to(dtype).float()[0]
            lx = row[x]
            rank = int((row > lx).sum()) + int((row[:x] == lx).sum())
            for k, accepted in ((rank, 0), (rank + 1, 1)):
                if k < 1:
                    continue
                out = verify(logits.to(dtype).to(device), torch.tensor([x], device=device),
                             torch.tensor([0, 1], dtype=torch.int32, device=device), rule="topk", k=k, backend=backend)
                assert int(out.accept_len[0]) == accepted, (dtype, x, k, rank)
        # Several children of one row (the C++ kernel counts up to 4 children's ranks within its max traversal,
        # more in a pass of their own): probe every child's rank.
        for n_kids in (2, 3, 4, 5):
            kids = torch.tensor([9500, 2048, 7, 5000, 2049][:n_kids])
            rows = torch.randint(0, 5, (n_kids + 1, V), generator=gen).float()
            rows[0, 9000:] = -math.inf
            batch = {"logits": rows.to(dtype), "draft_tokens": kids,
                     "cu_nodes": torch.tensor([0, n_kids], dtype=torch.int32),
                     "parents": torch.full((n_kids,), -1, dtype=torch.int32)}
            row = rows.to(dtype).float()[0]
            for x in kids.tolist():
                rank = int((row > row[x]).sum()) + int((row[:x] == row[x]).sum())
                for k in (rank, rank + 1):
                    if k >= 1:
                        _compare(backend, batch, "topk", k=k)


@pytest.mark.parametrize("backend", FAST)
def test_non_contiguous_logits(backend):
    gen = torch.Generator().manual_seed(12)
    batch = random_batch(4, 257, max_nodes=5, gen=gen)
    wide = torch.randn(batch["logits"].shape[0], 300, generator=gen)
    wide[:, 20:277] = batch["logits"]
    sliced = dict(batch, logits=wide[:, 20:277])  # row stride 300 > V = 257
    assert not sliced["logits"].is_contiguous()
    for rule, params in DET_CASES:
        ref = verify(*_args(batch), rule=rule, backend="torch", **params)
        _assert_same(_compare(backend, sliced, rule, **params), ref, rule)
    transposed = dict(batch, logits=batch["logits"].t().contiguous().t())  # column-major: last dim not contiguous
    _compare(backend, transposed, "typical", eps=0.3)


@pytest.mark.parametrize("backend", FAST)
def test_per_request_parameters(backend):
    gen = torch.Generator().manual_seed(13)
    batch = random_batch(5, 100, max_nodes=6, gen=gen)
    _compare(backend, batch, "topk", k=torch.tensor([1, 2, 3, 5, 100]))
    _compare(backend, batch, "distance", eps=torch.tensor([0.0, 1, 2, 5, 50]))
    _compare(backend, batch, "gad", beta=torch.tensor([1, 2, 3, 4, 5]), tau=torch.tensor([0.5, 1, 2, 3, 100.0]))
    _compare(backend, batch, "typical", eps=torch.tensor([0.01, 0.1, 0.2, 0.3, 0.5]), delta=0.3)
    _compare(backend, batch, "confidence", beta=torch.tensor([0.01, 0.05, 0.1, 0.5, 1.0]))
    _compare(backend, batch, "coupled", temperature=torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0]),
             top_k=torch.tensor([0, 1, 3, 10, 0]), top_p=torch.tensor([1.0, 0.5, 0.9, 1.0, 0.3]))
    _compare(backend, batch, "speculative", temperature=torch.tensor([1.0, 0.0, 0.7, 1.0, 2.0]),
             min_p=torch.tensor([0.0, 0.1, 0.0, 0.2, 0.0]))


@pytest.mark.parametrize("backend", FAST)
def test_confidence_root_tokens(backend):
    gen = torch.Generator().manual_seed(14)
    batch = random_batch(4, 50, max_nodes=5, min_nodes=1, shape="chain", gen=gen, p_argmax=1.0)
    roots = batch["draft_tokens"][batch["cu_nodes"][:-1].long()].clone()  # repeat the first draft token
    out = _compare(backend, batch, "confidence", beta=0.01, root_tokens=roots)
    assert (out.accept_len == 0).all()


@pytest.mark.parametrize("backend", ALL)
def test_empty_drafts_and_edge_sizes(backend):
    device = device_of(backend)
    # Every request without drafts.
    logits = torch.randn(3, 10, device=device)
    out = verify(logits, torch.empty(0, dtype=torch.long, device=device),
                 torch.zeros(4, dtype=torch.int32, device=device), backend=backend)
    assert out.accept_len.tolist() == [0, 0, 0] and out.accepted.shape == (3, 0)
    assert out.next_token.tolist() == logits.argmax(-1).tolist()
    # No requests at all.
    out = verify(torch.randn(0, 10, device=device), torch.empty(0, dtype=torch.long, device=device),
                 torch.zeros(1, dtype=torch.int32, device=device), backend=backend)
    assert out.accept_len.shape == (0,) and out.accepted.shape == (0, 0)
    # V = 1: every draft is the argmax.
    out = verify(torch.randn(1, 4, 1, device=device), torch.zeros(1, 3, dtype=torch.long, device=device),
                 backend=backend)
    assert out.accept_len.tolist() == [3] and out.next_token.tolist() == [0]
    out = verify(torch.randn(1, 4, 1, device=device), torch.zeros(1, 3, dtype=torch.long, device=device),
                 rule="coupled", seed=1, position=torch.tensor([0], device=device), backend=backend)
    assert out.accept_len.tolist() == [3] and out.next_token.tolist() == [0]


@pytest.mark.parametrize("backend", ALL)
def test_dense_form_equals_ragged(backend):
    device = device_of(backend)
    gen = torch.Generator().manual_seed(15)
    B, K, V = 3, 5, 40
    logits = torch.randn(B, K + 1, V, generator=gen)
    drafts = logits[:, :-1].argmax(-1)
    drafts[1, 2] = (drafts[1, 2] + 1) % V
    drafts[2, 0] = (drafts[2, 0] + 1) % V
    cu = torch.arange(B + 1, dtype=torch.int32) * K
    for rule, params in DET_CASES:
        dense = verify(logits.to(device), drafts.to(device), rule=rule, backend=backend, **params)
        ragged = verify(logits.reshape(-1, V), drafts.reshape(-1), cu, rule=rule, backend="torch", **params)
        _assert_same(dense, ragged, rule)
    # Dense trees: one shared parents row.
    parents = torch.tensor([-1, 0, 0, 1, -1], dtype=torch.int32)
    dense = verify(logits.to(device), drafts.to(device), parents=parents.to(device), backend=backend)
    # the dense form's `accepted` is K wide (a fixed shape); the ragged form's is as wide as asked
    ragged = verify(logits.reshape(-1, V), drafts.reshape(-1), cu, parents.repeat(B), backend="torch", max_depth=K)
    _assert_same(dense, ragged, "dense tree")


# ---------------------------------------------------------------------------------------------------------------
# The reference itself, on hand-checked cases and against the torch composition users write today


def _greedy_composition(logits, drafts):
    """accept_len = cumprod(draft == argmax).sum(); next = argmax at that row."""
    match = (drafts == logits[:, :-1].argmax(-1)).long()
    n = match.cumprod(-1).sum(-1)
    return n, logits.argmax(-1).gather(1, n[:, None])[:, 0]


@pytest.mark.parametrize("backend", ALL)
def test_greedy_chain_equals_user_composition(backend):
    gen = torch.Generator().manual_seed(16)
    B, K, V = 8, 6, 30
    logits = torch.randn(B, K + 1, V, generator=gen)
    drafts = logits[:, :-1].argmax(-1)
    flip = torch.rand(B, K, generator=gen) < 0.2
    drafts = torch.where(flip, (drafts + 1) % V, drafts)
    n, nxt = _greedy_composition(logits, drafts)
    out = verify(logits.to(device_of(backend)), drafts.to(device_of(backend)), backend=backend)
    assert out.accept_len.cpu().long().tolist() == n.tolist()
    assert out.next_token.cpu().tolist() == nxt.tolist()


def test_reference_tree_deepest_path_first_in_node_order():
    V = 6
    # Root children: nodes 0 and 1 (both the argmax token 2 -> duplicates); node 2 child of 0, node 3 child of 1.
    parents = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    tokens = torch.tensor([2, 2, 4, 4])
    logits = torch.zeros(5, V)
    logits[0, 2] = 5  # root row: argmax 2
    logits[1, 4] = 5  # row of node 0: argmax 4
    logits[2, 4] = 5  # row of node 1: argmax 4
    logits[3, 1] = 5  # row of node 2: argmax 1
    logits[4, 3] = 5
    out = verify(logits, tokens, torch.tensor([0, 4], dtype=torch.int32), parents, backend="torch")
    assert out.accept_len.tolist() == [2] and out.accepted.tolist() == [[0, 2]] and out.next_token.tolist() == [1]


def test_reference_rules_by_hand():
    # One row of logits scoring one child; V = 5, logits (0, 3, 1, 3, 2): argmax = 1 (tie with 3, lower id).
    row = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0], [0, 0, 0, 0, 0]])
    cu = torch.tensor([0, 1], dtype=torch.int32)

    def run(token, rule, **kw):
        return verify(row, torch.tensor([token]), cu, rule=rule, backend="torch", **kw).accept_len.item()

    assert [run(t, "greedy") for t in range(5)] == [0, 1, 0, 0, 0]
    # ranks: token 1 -> 0, token 3 -> 1 (tie, larger id), token 4 -> 2, token 2 -> 3, token 0 -> 4
    assert [run(t, "topk", k=2) for t in range(5)] == [0, 1, 0, 1, 0]
    assert [run(t, "topk", k=3) for t in range(5)] == [0, 1, 0, 1, 1]
    assert [run(t, "distance", eps=1) for t in range(5)] == [1, 1, 1, 0, 0]
    assert [run(t, "gad", beta=5, tau=1.0) for t in range(5)] == [0, 1, 0, 1, 1]
    assert [run(t, "gad", beta=2, tau=10.0) for t in range(5)] == [0, 1, 0, 1, 0]
    p = torch.softmax(row[0].double(), 0)
    h = float(-(p * p.log()).sum())
    thr = min(0.2, 0.5 * math.exp(-h))
    assert [run(t, "typical", eps=0.2, delta=0.5) for t in range(5)] == [int(float(p[t]) > thr) for t in range(5)]
    assert [run(t, "confidence", beta=0.3) for t in range(5)] == [int(float(p[t]) >= 0.3) for t in range(5)]
    assert run(1, "confidence", beta=0.3, root_tokens=torch.tensor([1])) == 0  # repetition stop


def test_reference_min_accept_forces_most_likely_path():
    V = 4
    parents = torch.tensor([-1, -1, 1, 2], dtype=torch.int32)
    tokens = torch.tensor([0, 1, 2, 3])
    logits = torch.full((5, V), -5.0)
    logits[0] = torch.tensor([1.0, 2.0, 9.0, 0.0])  # argmax 2: neither root child is greedy; child 1 is more likely
    logits[2, 0] = 9  # row of node 1: node 2 (token 2) is not the argmax
    logits[3, 3] = 9  # row of node 2: node 3 (token 3) is the argmax
    cu = torch.tensor([0, 4], dtype=torch.int32)
    assert verify(logits, tokens, cu, parents, backend="torch").accept_len.tolist() == [0]
    out = verify(logits, tokens, cu, parents, min_accept=1, backend="torch")
    assert out.accepted.tolist() == [[1, -1, -1]]
    out = verify(logits, tokens, cu, parents, min_accept=2, backend="torch")
    assert out.accepted.tolist() == [[1, 2, 3]]  # node 3 accepted by the rule itself after the forced prefix


@pytest.mark.parametrize("backend", ALL)
def test_sampling_rules_at_temperature_zero_are_greedy(backend):
    device = device_of(backend)
    gen = torch.Generator().manual_seed(17)
    batch = to_device(random_batch(6, 80, max_nodes=6, gen=gen), device)
    greedy = verify(*_args(batch), backend=backend)
    for rule in ("speculative", "coupled"):
        _assert_same(verify(*_args(batch), rule=rule, temperature=0.0, backend=backend), greedy, rule)


def _cdf_sample(logits, u, **warp):
    w = torch.tensor([[warp.get("temperature", 1.0), warp.get("top_k", 0), warp.get("top_p", 1.0),
                       warp.get("min_p", 0.0)]]).expand(logits.shape[0], 4)
    return ref_sampling.cdf_sample(logits, u, w)


@pytest.mark.parametrize("backend", ALL)
def test_coupled_with_seed_equals_autoregressive_sampling(backend):
    """PTP §2.3: with a seed, coupled verification commits exactly the tokens plain sampling would."""
    device = device_of(backend)
    gen = torch.Generator().manual_seed(18)
    K, V, pos, seed = 6, 50, 123, 99
    logits = torch.randn(1, K + 1, V, generator=gen)
    u = ref_sampling.uniform(torch.tensor([seed] * (K + 1)), torch.arange(pos, pos + K + 1), 0)
    sampled = _cdf_sample(logits[0], u, temperature=0.8, top_p=0.9)
    for m in range(K + 1):  # the first m drafts are what sampling would produce, the next one differs
        drafts = sampled[:K].clone()
        if m < K:
            drafts[m] = (drafts[m] + 1) % V
        out = verify(logits.to(device), drafts[None].to(device), rule="coupled", temperature=0.8, top_p=0.9,
                     seed=seed, position=torch.tensor([pos], device=device), backend=backend)
        assert out.accept_len.item() == m and out.next_token.item() == sampled[m].item()


def test_seeded_uniform_layout():
    """u_sample of a row at depth d is uniform(seed, position + d); u_accept of node j uses stream 1 + j."""
    gen = torch.Generator().manual_seed(19)
    batch = random_batch(3, 20, max_nodes=5, min_nodes=1, gen=gen)
    seed, position = torch.tensor([1, 2, 3]), torch.tensor([10, 20, 30])
    a = verify(*_args(batch), rule="speculative", seed=seed, position=position, backend="torch")
    cu, par = batch["cu_nodes"].tolist(), batch["parents"].tolist()
    us, ua = [], []
    for b in range(3):
        depth = []
        for j in range(cu[b + 1] - cu[b]):
            p = par[cu[b] + j]
            depth.append(1 if p < 0 else depth[p] + 1)
        us += [ref_sampling.uniform(seed[b:b + 1], position[b:b + 1] + d, 0) for d in [0] + depth]
        ua += [ref_sampling.uniform(seed[b:b + 1], position[b:b + 1] + depth[j] - 1, 1 + j) for j in range(len(depth))]
    b_ = verify(*_args(batch), rule="speculative", u_sample=torch.cat(us), u_accept=torch.cat(ua), backend="torch")
    _assert_same(a, b_, "seeded")


def test_generator_reproducible():
    gen = torch.Generator().manual_seed(20)
    batch = random_batch(4, 30, max_nodes=5, gen=gen)
    a = verify(*_args(batch), rule="speculative", generator=torch.Generator().manual_seed(5), backend="torch")
    b = verify(*_args(batch), rule="speculative", generator=torch.Generator().manual_seed(5), backend="torch")
    _assert_same(a, b)


def test_public_exports():
    assert fastverify.verify is verify and fastverify.RULES == RULES
    assert isinstance(verify(torch.randn(1, 2, 3), torch.zeros(1, 1, dtype=torch.long)), fastverify.VerifyOutput)


# ---------------------------------------------------------------------------------------------------------------
# Invalid logits and bad input


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("rule,params", DET_CASES[:1] + DET_CASES[4:5] + SAMPLING_CASES[:1] + SAMPLING_CASES[2:3])
@pytest.mark.parametrize("poison", ["nan", "posinf", "all_neginf"])
def test_invalid_logits(backend, rule, params, poison):
    device = device_of(backend)
    gen = torch.Generator().manual_seed(21)
    batch = to_device(random_batch(3, 40, max_nodes=4, min_nodes=2, gen=gen), device)
    logits = batch["logits"].clone()
    row = int(batch["cu_nodes"][1]) + 1 + 1  # request 1's first node row
    if poison == "nan":
        logits[row, 7] = float("nan")
    elif poison == "posinf":
        logits[row, 3] = float("inf")
    else:
        logits[row] = float("-inf")
    with pytest.raises(ValueError, match="logits"):
        verify(logits, *_args(batch)[1:], rule=rule, backend=backend, **params)
    out = verify(logits, *_args(batch)[1:], rule=rule, backend=backend, validate=False, **params)
    assert out.accept_len.tolist()[1] == -1 and out.next_token.tolist()[1] == -1
    assert out.accept_len.tolist()[0] >= 0 and out.accept_len.tolist()[2] >= 0
    logits = batch["logits"].clone()
    logits[row, 5:] = float("-inf")  # partially -inf is fine
    verify(logits, *_args(batch)[1:], rule=rule, backend=backend, **params)


def _ok():
    gen = torch.Generator().manual_seed(22)
    b = random_batch(2, 10, max_nodes=3, min_nodes=2, gen=gen)
    return b["logits"], b["draft_tokens"], b["cu_nodes"], b["parents"]


BAD_INPUTS = [
    # (name, builder returning (args, kwargs), exception, message fragment)
    ("rule", lambda L, T, C, P: ((L, T, C, P), {"rule": "beam"}), ValueError, "rule"),
    ("logits dtype", lambda L, T, C, P: ((L.long(), T, C, P), {}), TypeError, "logits"),
    ("logits float64", lambda L, T, C, P: ((L.double(), T, C, P), {}), TypeError, "logits"),
    ("logits rows", lambda L, T, C, P: ((L[:-1], T, C, P), {}), ValueError, "logits"),
    ("logits 3d ragged", lambda L, T, C, P: ((L[None], T, C, P), {}), ValueError, "logits"),
    ("tokens dtype", lambda L, T, C, P: ((L, T.float(), C, P), {}), TypeError, "draft_tokens"),
    ("tokens >= V", lambda L, T, C, P: ((L, T.clone().fill_(10), C, P), {}), ValueError, "draft_tokens"),
    ("tokens < 0", lambda L, T, C, P: ((L, T.clone().fill_(-1), C, P), {}), ValueError, "draft_tokens"),
    ("tokens device", lambda L, T, C, P: ((L, T.to("meta"), C, P), {}), ValueError, "draft_tokens"),
    ("cu start", lambda L, T, C, P: ((L, T, C + 1, P), {}), ValueError, "cu_nodes"),
    ("cu decreasing", lambda L, T, C, P: ((L, T, torch.tensor([0, int(C[2]) + 1, int(C[2])], dtype=torch.int32), P),
                                          {}),
     ValueError, "cu_nodes"),
    ("cu float", lambda L, T, C, P: ((L, T, C.float(), P), {}), TypeError, "cu_nodes"),
    ("parents forward", lambda L, T, C, P: ((L, T, C, torch.zeros_like(P)), {}), ValueError, "parents"),
    ("parents < -1", lambda L, T, C, P: ((L, T, C, P.clone().fill_(-2)), {}), ValueError, "parents"),
    ("parents cross request", lambda L, T, C, P: ((L, T, C, torch.cat([P[:int(C[1])], P[int(C[1]):] + 1 + 0 * P[
        int(C[1]):]]).clamp(max=1)), {}), ValueError, "parents"),
    ("parents length", lambda L, T, C, P: ((L, T, C, P[:-1]), {}), ValueError, "parents"),
    ("k missing", lambda L, T, C, P: ((L, T, C, P), {"rule": "topk"}), ValueError, "k"),
    ("k zero", lambda L, T, C, P: ((L, T, C, P), {"rule": "topk", "k": 0}), ValueError, "k"),
    ("k fractional", lambda L, T, C, P: ((L, T, C, P), {"rule": "topk", "k": 1.5}), ValueError, "k"),
    ("k shape", lambda L, T, C, P: ((L, T, C, P), {"rule": "topk", "k": torch.ones(3)}), ValueError, "k"),
    ("k for greedy", lambda L, T, C, P: ((L, T, C, P), {"k": 2}), ValueError, "k"),
    ("eps negative", lambda L, T, C, P: ((L, T, C, P), {"rule": "distance", "eps": -1}), ValueError, "eps"),
    ("gad beta", lambda L, T, C, P: ((L, T, C, P), {"rule": "gad", "beta": 0, "tau": 1}), ValueError, "beta"),
    ("gad tau", lambda L, T, C, P: ((L, T, C, P), {"rule": "gad", "beta": 2, "tau": -1}), ValueError, "tau"),
    ("gad tau missing", lambda L, T, C, P: ((L, T, C, P), {"rule": "gad", "beta": 2}), ValueError, "tau"),
    ("typical eps", lambda L, T, C, P: ((L, T, C, P), {"rule": "typical", "eps": -0.1}), ValueError, "eps"),
    ("typical delta", lambda L, T, C, P: ((L, T, C, P), {"rule": "typical", "eps": 0.1, "delta": -1}), ValueError,
     "delta"),
    ("confidence beta 0", lambda L, T, C, P: ((L, T, C, P), {"rule": "confidence", "beta": 0.0}), ValueError, "beta"),
    ("confidence beta > 1", lambda L, T, C, P: ((L, T, C, P), {"rule": "confidence", "beta": 1.5}), ValueError,
     "beta"),
    ("param nan", lambda L, T, C, P: ((L, T, C, P), {"rule": "distance", "eps": float("nan")}), ValueError, "eps"),
    ("temperature", lambda L, T, C, P: ((L, T, C, P), {"rule": "coupled", "temperature": -1.0}), ValueError,
     "temperature"),
    ("top_p 0", lambda L, T, C, P: ((L, T, C, P), {"rule": "coupled", "top_p": 0.0}), ValueError, "top_p"),
    ("top_p > 1", lambda L, T, C, P: ((L, T, C, P), {"rule": "coupled", "top_p": 1.5}), ValueError, "top_p"),
    ("top_k < 0", lambda L, T, C, P: ((L, T, C, P), {"rule": "coupled", "top_k": -1}), ValueError, "top_k"),
    ("min_p > 1", lambda L, T, C, P: ((L, T, C, P), {"rule": "coupled", "min_p": 2.0}), ValueError, "min_p"),
    ("min_accept < 0", lambda L, T, C, P: ((L, T, C, P), {"min_accept": -1}), ValueError, "min_accept"),
    ("min_accept sampling", lambda L, T, C, P: ((L, T, C, P), {"rule": "speculative", "min_accept": 1}), ValueError,
     "min_accept"),
    ("draft_probs negative", lambda L, T, C, P: ((L, T, C, P), {"rule": "speculative",
                                                                "draft_probs": -torch.ones(T.numel(), 10)}),
     ValueError, "draft_probs"),
    ("draft_probs nan", lambda L, T, C, P: ((L, T, C, P), {"rule": "speculative",
                                                           "draft_probs": torch.full((T.numel(), 10), float("nan"))}),
     ValueError, "draft_probs"),
    ("draft_probs shape", lambda L, T, C, P: ((L, T, C, P), {"rule": "speculative",
                                                             "draft_probs": torch.ones(T.numel(), 9)}),
     ValueError, "draft_probs"),
    ("draft_probs greedy", lambda L, T, C, P: ((L, T, C, P), {"draft_probs": torch.ones(T.numel(), 10)}), ValueError,
     "draft_probs"),
    ("u_sample 0", lambda L, T, C, P: ((L, T, C, P), {"rule": "coupled", "u_sample": torch.zeros(L.shape[0])}),
     ValueError, "u_sample"),
    ("u_sample > 1", lambda L, T, C, P: ((L, T, C, P), {"rule": "coupled", "u_sample": torch.full((L.shape[0],), 1.5)}),
     ValueError, "u_sample"),
    ("u_sample shape", lambda L, T, C, P: ((L, T, C, P), {"rule": "coupled", "u_sample": torch.rand(2)}), ValueError,
     "u_sample"),
    ("u_accept range", lambda L, T, C, P: ((L, T, C, P), {"rule": "speculative", "u_accept": torch.zeros(T.numel())}),
     ValueError, "u_accept"),
    ("seed without position", lambda L, T, C, P: ((L, T, C, P), {"rule": "coupled", "seed": 1}), ValueError, "seed"),
    ("root_tokens shape", lambda L, T, C, P: ((L, T, C, P), {"rule": "confidence", "beta": 0.1,
                                                             "root_tokens": torch.zeros(5, dtype=torch.long)}),
     ValueError, "root_tokens"),
    ("backend", lambda L, T, C, P: ((L, T, C, P), {"backend": "fortran"}), ValueError, "backend"),
    ("dense tokens shape", lambda L, T, C, P: ((L[None, :4], T[:2]), {}), ValueError, "draft_tokens"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(case):
    _, build, exc, fragment = case
    args, kwargs = build(*_ok())
    with pytest.raises(exc, match=fragment):
        verify(*args, **kwargs)


@pytest.mark.skipif("cpp" not in available_backends(), reason="cpp backend: fastverify._C has no verify CPU kernel")
def test_cpp_op_rejects_bad_structure_without_crashing():
    """The compiled op checks the structure itself (validate=False callers never read out of bounds)."""
    L, T, C, P = _ok()
    B = C.numel() - 1
    rp, warp = torch.zeros(B, 2), torch.tensor([[1.0, 0, 1, 0]]).expand(B, 4).contiguous()
    op = torch.ops.fastverify.verify

    def call(L=L, T=T, C=C, P=P, max_depth=3, rule=0):
        return op(L, T, C, P, rp, warp, None, None, None, None, rule, 0, max_depth)

    call()
    with pytest.raises(RuntimeError, match="draft_tokens"):
        call(T=T.clone().fill_(1 << 40))
    with pytest.raises(RuntimeError, match="parents"):
        call(P=P.clone().fill_(5))
    with pytest.raises(RuntimeError, match="cu_nodes"):
        call(C=torch.tensor([0, 100, int(C[-1])], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="max_depth"):
        call(max_depth=-1)
    with pytest.raises(RuntimeError, match="logits"):
        call(L=L[:-1])
    with pytest.raises(RuntimeError, match="rule"):
        call(rule=99)
    with pytest.raises(RuntimeError, match="u_sample"):
        call(rule=RULES.index("coupled"))


@pytest.mark.skipif("cpp" not in available_backends(), reason="cpp backend: fastverify._C has no verify CPU kernel")
@pytest.mark.parametrize("rule", RULES)
def test_opcheck(rule):
    gen = torch.Generator().manual_seed(23)
    b = random_batch(3, 64, max_nodes=4, min_nodes=1, gen=gen)
    B, N = 3, b["draft_tokens"].numel()
    rp = torch.tensor([[2.0, 1.0]] * B) if rule != "confidence" else torch.tensor([[0.1, 0.0]] * B)
    warp = torch.tensor([[0.9, 5.0, 0.9, 0.0]] * B)
    us = torch.rand(N + B, generator=gen).clamp(1e-3, 1 - 1e-3) if rule in ("speculative", "coupled") else None
    ua = torch.rand(N, generator=gen).clamp(1e-3, 1 - 1e-3) if rule == "speculative" else None
    idx = RULES.index(rule)
    depth = max(len(b["counts"]) and max(b["counts"]), 1)
    args = (b["logits"], b["draft_tokens"], b["cu_nodes"], b["parents"], rp, warp, None, us, ua, None, idx, 0,
            depth)
    torch.library.opcheck(torch.ops.fastverify.verify.default, args)


def test_wrapper_under_torch_compile():
    """The public wrapper traced by torch.compile (graph breaks allowed) gives the eager result, and eager calls
    after it still do (the wrapper's cached parameter tensors are not traced values)."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 5, 50, generator=gen)
    drafts = logits.argmax(-1)[:, :-1]
    drafts[1, 2] = (drafts[1, 2] + 1) % 50

    def f(lg, d):
        return verify(lg, d, rule="gad", beta=3, tau=1.0, validate=False)

    ref = f(logits, drafts)
    for out in (torch.compile(f)(logits, drafts), f(logits, drafts)):
        _assert_same(out, ref, "compiled")

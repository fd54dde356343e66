"""Microbenchmarks of fastverify.verify (CPU): the C++ kernel against the torch reference and against the torch
composition a user writes today, with effective bandwidth = logits bytes / median time.

Implementations:
  cpp          fastverify.verify(..., backend="cpp", validate=False)   (the public API, kernel + normalisation)
  torch        fastverify.verify(..., backend="torch", validate=False) (the reference: a readable spec, not fast)
  composition  what a user writes today, chains only (a tree needs per-path bookkeeping that has no short form):
               greedy:      argmax + compare + cumprod
               topk:        topk + compare + cumprod + argmax
               distance:    argmax + abs + compare + cumprod
               gad:         log_softmax + topk + gather + cumprod   (GAD++ top-beta and tau tests)
               confidence:  softmax + gather + compare with the previous token + cumprod + argmax   (LUD)
               typical:     softmax + entropy + gather + cumprod   (Medusa's p(x) > min(eps, delta exp(-H)))
               speculative: softmax + gather + rand + cumprod + multinomial (one-hot drafts, residual at the
                            rejected row)
               coupled:     softmax + cumsum + searchsorted (inverse CDF at every row) + cumprod

Default run (short): rules greedy / gad / typical / speculative / coupled, chain and tree, fp32 and bf16, at
(B, K, V) = (8, 16, 128256), cpp and composition; the torch reference only at (1, 8, 49152).
FASTVERIFY_BENCH_FULL=1: every rule x {chain, tree} x {(1, 8, 49152), (8, 16, 128256), (32, 16, 151936)} x
{fp32, bf16} x {cpp, torch, composition} (the reference is skipped where it would take minutes per call).

    pytest benchmarks/bench_verify.py [--benchmark-json out.json]
"""

import pytest
import torch
from conftest import full_grid, report_bytes

import fastverify
from fastverify.ops.verify import RULES, available_backends

SIZES = [(1, 8, 49152), (8, 16, 128256), (32, 16, 151936)]
RULE_PARAMS = {
    "greedy": {},
    "topk": {"k": 4},
    "distance": {"eps": 2},
    "gad": {"beta": 4, "tau": 2.0},
    "typical": {"eps": 0.09, "delta": 0.3},
    "confidence": {"beta": 0.01},
    "speculative": {"temperature": 1.0},
    "coupled": {"temperature": 1.0},
}
COMPOSED = tuple(RULE_PARAMS)


def _grid():
    cases = []
    for rule in RULES:
        for shape in ("chain", "tree"):
            for size in SIZES:
                for dtype in (torch.float32, torch.bfloat16):
                    for impl in ("cpp", "torch", "composition"):
                        if impl == "composition" and (rule not in COMPOSED or shape == "tree"):
                            continue
                        if impl == "torch" and size[0] * (size[1] + 1) * size[2] > 20e6:
                            continue  # the reference's Python loop over nodes with float64 rows: minutes per call
                        quick = (rule in ("greedy", "gad", "typical", "speculative", "coupled")
                                 and ((impl != "torch" and size == SIZES[1])
                                      or (impl == "torch" and size == SIZES[0] and dtype == torch.float32)))
                        if full_grid() or quick:
                            cases.append((rule, shape, size, dtype, impl))
    return cases


def _ids(case):
    rule, shape, (B, K, V), dtype, impl = case
    return f"{rule}-{shape}-B{B}K{K}V{V}-{str(dtype)[6:]}-{impl}"


_INPUTS = {}


def _inputs(shape, size, dtype):
    """Logits [B, K + 1, V] (randn * 2) and drafts: the argmax of the parent row for the first ~3/4 of each chain
    (or path), then a mismatch, so that walks run deep as with a good drafter. Trees: binary, two root children,
    parents[j] = j // 2 - 1. Cached per (shape, size, dtype)."""
    key = (shape, size, dtype)
    if key not in _INPUTS:
        _INPUTS.clear()  # keep one set of (large) inputs alive
        B, K, V = size
        g = torch.Generator().manual_seed(0)
        logits = (torch.randn(B, K + 1, V, generator=g) * 2).to(dtype)
        amax = logits.float().argmax(-1)  # [B, K + 1]
        if shape == "chain":
            parents = None
            drafts = amax[:, :-1].clone()
            stop = (3 * K) // 4
            drafts[:, stop] = (drafts[:, stop] + 1) % V
        else:
            parents = torch.tensor([j // 2 - 1 for j in range(K)], dtype=torch.int32)
            drafts = amax[:, (parents + 1).long()].clone()  # each node = argmax of its parent's row
            drafts[:, 1::2] = (drafts[:, 1::2] + 1) % V  # second children mismatch
        _INPUTS[key] = (logits, drafts, parents)
    return _INPUTS[key]


# -------------------------------------------------------------------------------------------------------------
# The torch compositions a user writes today (chains, dense [B, K + 1, V] logits, [B, K] drafts)


def composed_greedy(logits, drafts):
    pred = logits.argmax(-1)
    n = (drafts == pred[:, :-1]).long().cumprod(-1).sum(-1)
    return n, pred.gather(1, n[:, None])[:, 0]


def composed_topk(logits, drafts, k):
    top = logits.topk(k, dim=-1).indices  # [B, K + 1, k]
    ok = (top[:, :-1] == drafts[..., None]).any(-1)
    n = ok.long().cumprod(-1).sum(-1)
    return n, top[:, :, 0].gather(1, n[:, None])[:, 0]


def composed_distance(logits, drafts, eps):
    pred = logits.argmax(-1)
    n = ((drafts - pred[:, :-1]).abs() <= eps).long().cumprod(-1).sum(-1)
    return n, pred.gather(1, n[:, None])[:, 0]


def composed_confidence(logits, drafts, beta):
    p = logits.float().softmax(-1)
    px = p[:, :-1].gather(-1, drafts[..., None])[..., 0]
    prev = torch.cat([torch.full_like(drafts[:, :1], -1), drafts[:, :-1]], 1)  # the root token is not known here
    n = ((px >= beta) & (drafts != prev)).long().cumprod(-1).sum(-1)
    return n, logits.argmax(-1).gather(1, n[:, None])[:, 0]


def composed_gad(logits, drafts, beta, tau):
    logp = logits.float().log_softmax(-1)
    top = logp.topk(beta, dim=-1)
    x_logp = logp[:, :-1].gather(-1, drafts[..., None])[..., 0]
    in_top = (top.indices[:, :-1] == drafts[..., None]).any(-1)
    ok = in_top & (top.values[:, :-1, 0] - x_logp <= tau)
    n = ok.long().cumprod(-1).sum(-1)
    return n, top.indices[:, :, 0].gather(1, n[:, None])[:, 0]


def composed_typical(logits, drafts, eps, delta):
    logp = logits.float().log_softmax(-1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1)  # [B, K + 1]
    threshold = torch.minimum(torch.full_like(entropy, eps), delta * torch.exp(-entropy))
    px = p[:, :-1].gather(-1, drafts[..., None])[..., 0]
    n = (px > threshold[:, :-1]).long().cumprod(-1).sum(-1)
    return n, logits.argmax(-1).gather(1, n[:, None])[:, 0]


def composed_coupled(logits, drafts, temperature=1.0):
    cdf = (logits.float() / temperature).softmax(-1).cumsum(-1)  # [B, K + 1, V]
    u = torch.rand(cdf.shape[:-1], device=cdf.device) * cdf[..., -1]
    sampled = torch.searchsorted(cdf, u[..., None], right=True)[..., 0].clamp(max=cdf.shape[-1] - 1)
    n = (drafts == sampled[:, :-1]).long().cumprod(-1).sum(-1)
    return n, sampled.gather(1, n[:, None])[:, 0]


def composed_speculative(logits, drafts, temperature=1.0):
    p = (logits.float() / temperature).softmax(-1)
    px = p[:, :-1].gather(-1, drafts[..., None])[..., 0]  # one-hot drafts: q(x) = 1
    u = torch.rand_like(px)
    n = (u <= px).long().cumprod(-1).sum(-1)
    B, K = drafts.shape
    rows = p[torch.arange(B), n]  # [B, V]
    rejected = n < K
    x = drafts.gather(1, n.clamp(max=K - 1)[:, None])[:, 0]
    rows = rows.scatter(1, x[:, None], torch.where(rejected[:, None], 0.0, rows.gather(1, x[:, None])))
    return n, torch.multinomial(rows, 1)[:, 0]


def composition(rule, logits, drafts):
    """The torch composition of ``rule`` with its RULE_PARAMS, on dense chains: a callable."""
    p = RULE_PARAMS[rule]
    return {
        "greedy": lambda: composed_greedy(logits, drafts),
        "topk": lambda: composed_topk(logits, drafts, p.get("k")),
        "distance": lambda: composed_distance(logits, drafts, p.get("eps")),
        "gad": lambda: composed_gad(logits, drafts, p.get("beta"), p.get("tau")),
        "typical": lambda: composed_typical(logits, drafts, p.get("eps"), p.get("delta")),
        "confidence": lambda: composed_confidence(logits, drafts, p.get("beta")),
        "speculative": lambda: composed_speculative(logits, drafts),
        "coupled": lambda: composed_coupled(logits, drafts),
    }[rule]


@pytest.mark.parametrize("case", _grid(), ids=_ids)
def test_verify(benchmark, read_bandwidth, case):
    rule, shape, size, dtype, impl = case
    if impl == "cpp" and "cpp" not in available_backends():
        pytest.skip("cpp backend: fastverify._C has no verify CPU kernel")
    logits, drafts, parents = _inputs(shape, size, dtype)
    params = RULE_PARAMS[rule]
    if impl == "composition":
        fn = composition(rule, logits, drafts)
    else:
        kwargs = dict(params, rule=rule, parents=parents, backend=impl, validate=False)
        if rule in ("speculative", "coupled"):
            kwargs["generator"] = torch.Generator().manual_seed(1)
        fn = lambda: fastverify.verify(logits, drafts, **kwargs)  # noqa: E731
    rounds = 3 if impl == "torch" else 15
    benchmark.pedantic(fn, rounds=rounds, warmup_rounds=1, iterations=1)
    report_bytes(benchmark, logits.numel() * logits.element_size(), read_bandwidth, rule=rule, shape=shape,
                 B=size[0], K=size[1], V=size[2], dtype=str(dtype), impl=impl)

"""Speculative sampling preserves the target distribution (Leviathan et al. 2023, Theorem 1; SpecInfer for trees).

Each test verifies the same draft chain / tree in many independent trials (one request per trial, fresh uniforms,
and fresh draft tokens drawn from q when draft_probs are given) and compares the emitted tokens with the warped
target distribution by a chi-square goodness-of-fit test:

  * the first emitted token (the accepted root child's token, or next_token when every root child is rejected)
    must follow p_root, the warped distribution of the root row;
  * given that node c was accepted, the next emitted token must follow the warped distribution of c's row.

Critical value: the upper 1e-6 quantile of chi-square(df), computed exactly (bisection on the regularised upper
incomplete gamma function torch.special.gammaincc, no scipy). Seeds are fixed, so a run is deterministic; with a correct
sampler a fresh seed would fail with probability ~1e-6 per comparison. The power check at the end shows the test
rejects the classic bug (sampling from p instead of the residual after a rejection) at these trial counts.
Cells with expected count < 5 are merged; a token with zero target probability must never appear.
"""

import os

import pytest
import torch
from conftest import backend_params, device_of

from fastverify.ops.verify import available_backends, verify
from fastverify.reference.sampling import warp_weights

# Trials per backend: the reference loops over requests in Python, so it gets fewer (still ample power, see below);
# so does Triton under the CPU interpreter, which runs only the two one-hot cases and only with
# FASTVERIFY_SLOW_TESTS=1 (about 80 s and 130 s each; the kernel is compared with the reference on every case in
# test_verify.py).
TRITON_INTERPRETED = not torch.cuda.is_available()
SLOW = os.environ.get("FASTVERIFY_SLOW_TESTS", "0") not in ("", "0")
TRIALS = {"torch": 3000, "cpp": 40000, "triton": 600 if TRITON_INTERPRETED else 40000, "cuda": 40000}
INTERPRETER_CASES = {("chain", False), ("tree", False)}
BACKENDS = backend_params(available_backends())
V = 8


def chi2_critical(df, tail=1e-6):
    """Upper ``tail`` quantile of chi-square(df), by bisection on its survival function Q(df/2, x/2)."""
    half = torch.tensor(df / 2.0, dtype=torch.float64)
    lo, hi = 0.0, 10.0 * df + 100.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if float(torch.special.gammaincc(half, torch.tensor(mid / 2.0, dtype=torch.float64))) > tail:
            lo = mid
        else:
            hi = mid
    return hi


def chi_square(samples, probs):
    """(statistic, df) of the goodness of fit of int samples [n] to probs [V]; asserts no zero-probability token."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    probs = probs.double()
    assert counts[probs == 0].sum() == 0, f"tokens with zero target probability were emitted: {counts.tolist()}"
    exp = probs * n
    keep = exp >= 5
    obs_c = torch.cat([counts[keep], counts[~keep & (probs > 0)].sum().reshape(1)])
    exp_c = torch.cat([exp[keep], exp[~keep & (probs > 0)].sum().reshape(1)])
    nz = exp_c > 0
    obs_c, exp_c = obs_c[nz], exp_c[nz]
    stat = float(((obs_c - exp_c) ** 2 / exp_c).sum())
    return stat, int(nz.sum()) - 1


def assert_fits(samples, probs, what):
    stat, df = chi_square(samples, probs)
    assert df >= 1, what
    crit = chi2_critical(df)
    assert stat < crit, f"{what}: chi-square {stat:.1f} >= critical {crit:.1f} (df {df}, n {samples.numel()})"


def target(row_logits, warp):
    w = warp_weights(row_logits[None], torch.tensor([warp], dtype=torch.float32))[0].double()
    return w / w.sum()


def run_trials(backend, rows, parents, n, *, q_rows=None, tokens=None, warp=(1.0, 0, 1.0, 0.0), seed=0):
    """n trials of one tree. rows [K + 1, V] float32 logits; parents list of K; either fixed ``tokens`` (one-hot
    drafts) or ``q_rows`` [K, V] from which every trial draws its own tokens. Returns the VerifyOutput and the drafts
    [n, K]."""
    g = torch.Generator().manual_seed(seed)
    K = len(parents)
    if q_rows is not None:
        drafts = torch.stack([torch.multinomial(q_rows[j], n, replacement=True, generator=g) for j in range(K)], 1)
    else:
        drafts = torch.tensor(tokens).expand(n, K).contiguous()
    device = device_of(backend)
    logits = rows[None].expand(n, K + 1, V).contiguous()
    kw = dict(temperature=warp[0], top_k=int(warp[1]), top_p=warp[2], min_p=warp[3])
    if q_rows is not None:
        kw["draft_probs"] = q_rows[None].expand(n, K, V).to(device)
    out = verify(logits.to(device), drafts.to(device), parents=torch.tensor(parents, dtype=torch.int32).to(device),
                 rule="speculative", generator=torch.Generator(device=device).manual_seed(seed + 1), backend=backend,
                 **kw)
    return [t.cpu() for t in out], drafts


def emitted(out, drafts, level):
    """(token emitted at position `level` (0 = first), the local node whose row produced it) per trial, or -1 where
    the step emitted fewer tokens. Node -1 = the root row."""
    accept_len, accepted, next_token = out
    n = drafts.shape[0]
    tok = torch.full((n,), -1, dtype=torch.long)
    row_node = torch.full((n,), -2, dtype=torch.long)
    deep = accept_len > level
    at = accept_len == level
    node = accepted[:, level].long() if accepted.shape[1] > level else torch.full((n,), -1, dtype=torch.long)
    tok[deep] = drafts[deep, node[deep]]
    tok[at] = next_token[at]
    prev = accepted[:, level - 1].long() if level > 0 else torch.full((n,), -1, dtype=torch.long)
    row_node[deep | at] = prev[deep | at]
    return tok, row_node


def _rows(seed, K):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(K + 1, V, generator=g) * 1.2


def _q(seed, K):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)


CASES = {
    # name: (parents, one-hot drafts as the rank of the token in its parent's row (0 = the most likely), warp)
    "chain": ([-1, 0, 1], [1, 0, 1], (1.0, 0, 1.0, 0.0)),
    "chain-warped": ([-1, 0, 1], [1, 0, 2], (0.8, 6, 0.9, 0.0)),
    "tree": ([-1, -1, -1, 0, 1, 2], [0, 1, 0, 0, 1, 0], (1.0, 0, 1.0, 0.0)),  # nodes 0 and 2: duplicate siblings
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft_probs", [False, True], ids=["one-hot", "draft_probs"])
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_preserves_target(backend, case, draft_probs):
    if backend == "triton" and TRITON_INTERPRETED and (not SLOW or (case, draft_probs) not in INTERPRETER_CASES):
        pytest.skip("Triton interpreter (no GPU): minutes per case; FASTVERIFY_SLOW_TESTS=1 runs the one-hot chain "
                    "and tree cases")
    parents, ranks, warp = CASES[case]
    K = len(parents)
    n = TRIALS[backend]
    rows = _rows(len(case), K)
    q = _q(7 + len(case), K) if draft_probs else None
    tokens = [int(rows[p + 1].argsort(descending=True)[r]) for p, r in zip(parents, ranks)]
    out, drafts = run_trials(backend, rows, parents, n, q_rows=q, tokens=None if draft_probs else tokens, warp=warp,
                             seed=len(case))
    # First emitted token ~ warped root row.
    t0, _ = emitted(out, drafts, 0)
    assert (t0 >= 0).all()
    assert_fits(t0, target(rows[0], warp), f"{case} first token")
    # Given node c accepted first, the next token ~ warped row of c (for each root child with enough trials).
    t1, via = emitted(out, drafts, 1)
    checked = 0
    for c in [j for j, p in enumerate(parents) if p == -1]:
        sel = (via == c) & (t1 >= 0)
        if int(sel.sum()) >= 100:
            assert_fits(t1[sel], target(rows[c + 1], warp), f"{case} token after node {c}")
            checked += 1
    assert checked >= 1


def test_chi_square_detects_missing_residual():
    """Power: accepting x with probability p(x) and otherwise resampling from p (instead of the residual) emits x
    with probability p(x) (2 - p(x)); at the smallest trial count above the test rejects it."""
    rows = _rows(5, 1)
    p = target(rows[0], (1.0, 0, 1.0, 0.0))
    x = int(p.argmax())
    g = torch.Generator().manual_seed(0)
    n = min(TRIALS.values())
    accept = torch.rand(n, generator=g, dtype=torch.float64) < p[x]
    resample = torch.multinomial(p, n, replacement=True, generator=g)
    wrong = torch.where(accept, torch.full_like(resample, x), resample)
    stat, df = chi_square(wrong, p)
    assert stat > chi2_critical(df)
    # ... and the correct sampler passes at the same n.
    res = p.clone()
    res[x] = 0
    right = torch.where(accept, torch.full_like(resample, x), torch.multinomial(res / res.sum(), n, replacement=True,
                                                                                 generator=g))
    assert_fits(right, p, "correct residual sampler")


def test_chi2_critical_matches_tables():
    # chi-square upper quantiles from tables: 1e-6 at df 1 -> 23.928, df 5 -> 35.888; 0.05 at df 3 -> 7.815
    assert abs(chi2_critical(1) - 23.928) < 0.01 and abs(chi2_critical(5) - 35.888) < 0.01
    assert abs(chi2_critical(3, tail=0.05) - 7.815) < 0.01

"""Reference implementation of ``fastverify::verify``: batched verification of draft chains and trees.

This is the executable specification every backend (cpp, triton, cuda) is tested against. It takes the
normalised arguments of the op schema (csrc/verify.cpp) and is written for reading: a Python loop over
requests and nodes, float64 arithmetic on every logit, no fusion.

Batch layout (DESIGN.md "Batch layout"). Request b owns draft nodes ``cu_nodes[b] .. cu_nodes[b+1] - 1``
(local indices j = 0 .. n_b - 1) and logits rows ``cu_nodes[b] + b .. cu_nodes[b+1] + b``: first the root
row (the scores of the root's children), then the row of node j at ``cu_nodes[b] + b + 1 + j`` (the scores of
node j's children). Node j is scored at its *parent's* row.

Acceptance (all rules)::

    accept(j) = accept(parent(j)) and (cond(j) or forced(j))        (the root is accepted)

The accepted path ends at the deepest accepted node (ties: first in node order); ``accepted`` lists its
local node indices from the root's child to that node; ``next_token`` comes from that node's row (the root
row when nothing is accepted).

Deterministic rules read the raw logits l of the parent's row (no warping); x is the node's token::

    rank(x)  = #{v : l_v > l_x} + #{v : l_v == l_x and v < x}        (ties broken by lower token id)
    argmax   = the lowest token id with the largest logit
    greedy      x == argmax                                         Stern et al. 2018, §3
    topk(k)     rank(x) < k                                         Stern et al. 2018, §5.1
    distance(e) |x - argmax| <= e   (token ids as ordinal values)   Stern et al. 2018, §5.2
    gad(b, t)   rank(x) < b and l_max - l_x <= t                    GAD++, Xia et al., Eq. 6-7
                (log-softmax differences equal logit differences)
    typical(e, d)  p(x) > min(e, d * exp(-H(p))), p = softmax(l)    Medusa, Cai et al., §2.3.1
    confidence(b)  p(x) >= b and x != token of the parent           LUD (repetition stop)
                   (for a child of the root: root_tokens[b], when given)
    next token: argmax of the final row.

    min_accept (Stern et al. 2018, §5.3): the "most likely path" starts at the root row, goes to the child
    whose token has the highest logit at that row (ties: first in node order), and on from that child's
    row; its nodes of depth <= min_accept are forced (accepted whatever cond says).

Sampling rules warp each row first (temperature, top_k, top_p, min_p: fastverify.reference.sampling.
warp_weights) and draw with the inverse-CDF row sampler (fastverify.reference.sampling.sample_from_weights,
the function behind ``cdf_sample``). A request with temperature 0 behaves as greedy (argmax, no uniforms).

    speculative  (Leviathan et al. 2023, Alg. 1; SpecInfer, Miao et al. 2024, Alg. 2 for trees)
        at a row with children c_1..c_m (node order), p' = warped p of the row; for each c_i in order:
        accept iff u_accept[c_i] <= p'(x_i) / q_i(x_i), with q_i = draft_probs[c_i] (or one-hot(x_i) when
        draft_probs is None); when q_i(x_i) = 0, accept iff p'(x_i) > 0. On rejection
        p' <- normalise(max(p' - q_i, 0)) (kept unchanged when that has zero mass). The first accepted child is
        descended into (p' restarts from that child's row). At the final row (no child accepted, or a leaf)
        next_token is sampled from the current p' with u_sample[row]; when p' was never modified this is exactly
        cdf_sample(row, u_sample[row]).
    coupled      (Parallel Token Prediction, Draxler et al., §2.3)
        at each row t = F^-1_{warped p}(u_sample[row]) = cdf_sample(row, u_sample[row]); the first child with
        token t is accepted and descended into; otherwise next_token = t.

Invalid logits: a request any of whose rows holds NaN or +inf, or a row that is entirely -inf, gets
accept_len = -1, next_token = -1 and an all -1 ``accepted`` row (the Python API raises a ValueError).
"""

import torch

RULES = ("greedy", "topk", "distance", "gad", "typical", "confidence", "speculative", "coupled")
DETERMINISTIC_RULES = RULES[:6]
SAMPLING_RULES = RULES[6:]


def _tree(parents_b):
    """children[r]: local node indices whose parent row is r (row 0 = root, row j + 1 = node j), in node
    order; depth[j] (a child of the root has depth 1)."""
    n = len(parents_b)
    children = [[] for _ in range(n + 1)]
    depth = [0] * n
    for j, p in enumerate(parents_b):
        children[p + 1].append(j)
        depth[j] = 1 if p < 0 else depth[p] + 1
    return children, depth


def _argmax(row):
    """Lowest token id holding the row's maximum (row float64 [V])."""
    ids = torch.arange(row.numel(), device=row.device)
    return int(torch.where(row == row.max(), ids, row.numel()).min())


def _rank(row, x):
    """#tokens with a strictly larger logit + #tokens with an equal logit and a smaller id."""
    lx = row[x]
    ids = torch.arange(row.numel(), device=row.device)
    return int((row > lx).sum() + ((row == lx) & (ids < x)).sum())


def _softmax_and_entropy(row):
    """p = softmax(row) and H(p) in nats, float64 (tokens at -inf contribute 0 to H). The row's maximum is
    subtracted first, so that logits of a large magnitude (1e30) keep their differences."""
    row = row.double()
    top = row.max()
    row = row - top if bool(torch.isfinite(top)) else row
    lse = torch.logsumexp(row, dim=0)
    logp = row - lse
    p = logp.exp()
    h = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum()
    return p, float(h)


def _deterministic_cond(rule, rows, parent_row, x, parent_token, params):
    """cond(j) of a deterministic rule for a node with token x scored at rows[parent_row]."""
    row = rows[parent_row]
    if rule == "greedy":
        return x == _argmax(row)
    if rule == "topk":
        return _rank(row, x) < params[0]
    if rule == "distance":
        return abs(x - _argmax(row)) <= params[0]
    if rule == "gad":
        return _rank(row, x) < params[0] and float(row.max() - row[x]) <= params[1]
    if rule == "typical":
        p, h = _softmax_and_entropy(row)
        eps, delta = params
        return float(p[x]) > min(eps, delta * float(torch.exp(torch.tensor(-h, dtype=torch.float64))))
    if rule == "confidence":
        p, _ = _softmax_and_entropy(row)
        return float(p[x]) >= params[0] and (parent_token is None or x != parent_token)
    raise AssertionError(rule)


def _forced_nodes(rows, tokens, children, min_accept):
    """Nodes of depth <= min_accept on the most likely path (Stern et al. 2018, §5.3)."""
    forced = set()
    r = 0
    for _ in range(min_accept):
        kids = children[r]
        if not kids:
            break
        best = kids[0]
        for c in kids[1:]:  # strict >: ties keep the first child in node order
            if rows[r, tokens[c]] > rows[r, tokens[best]]:
                best = c
        forced.add(best)
        r = best + 1
    return forced


def _slice(t, lo, hi):
    return None if t is None else t[lo:hi]


def _sampling():
    try:
        from fastverify.reference import sampling
    except ImportError as e:  # pragma: no cover - only while the sampling reference is being written
        raise RuntimeError("verify: the sampling rules need fastverify.reference.sampling "
                           f"(warp_weights, sample_from_weights), which is not importable: {e}") from e
    return sampling


def _warped(sampling, row_logits, warp_b):
    """Warped weights of one row: float32 [V] (w = exp(l / T - m) on kept tokens, 0 elsewhere)."""
    return sampling.warp_weights(row_logits.unsqueeze(0), warp_b.unsqueeze(0))[0]


def _sample(sampling, w, u):
    """Inverse-CDF draw from weights w [V] with the uniform u (0-dim float32 tensor): int."""
    return int(sampling.sample_from_weights(w.unsqueeze(0), u.reshape(1))[0])


def _speculative_walk(sampling, logits_b, rows64, tokens, children, warp_b, q_rows, u_accept_b, u_sample_b):
    """Leviathan et al. 2023 Alg. 1 / SpecInfer Alg. 2. Returns (last accepted local node or -1, next token)."""
    node, r = -1, 0
    greedy = float(warp_b[0]) == 0.0
    while True:
        kids = children[r]
        if greedy:
            a = _argmax(rows64[r])
            hit = next((c for c in kids if tokens[c] == a), None)
            if hit is None:
                return node, a
            node, r = hit, hit + 1
            continue
        w = _warped(sampling, logits_b[r], warp_b)
        p = w.double() / w.double().sum()
        w_draw = w  # the weights the final draw uses: the row's own warped weights until a rejection
        hit = None
        for c in kids:
            x = tokens[c]
            if q_rows is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            else:
                q = q_rows[c].double()
            qx, px = float(q[x]), float(p[x])
            ok = (float(u_accept_b[c]) <= px / qx) if qx > 0 else (px > 0)
            if ok:
                hit = c
                break
            residual = (p - q).clamp_min(0)
            mass = residual.sum()
            if mass > 0:
                p = residual / mass
                w_draw = p
        if hit is None:
            return node, _sample(sampling, w_draw, u_sample_b[r])
        node, r = hit, hit + 1


def _coupled_walk(sampling, logits_b, rows64, tokens, children, warp_b, u_sample_b):
    """PTP §2.3: t = F^-1(u) at each row; follow the first child with token t. Returns (node, next token)."""
    node, r = -1, 0
    greedy = float(warp_b[0]) == 0.0
    while True:
        if greedy:
            t = _argmax(rows64[r])
        else:
            t = _sample(sampling, _warped(sampling, logits_b[r], warp_b), u_sample_b[r])
        hit = next((c for c in children[r] if tokens[c] == t), None)
        if hit is None:
            return node, t
        node, r = hit, hit + 1


def verify(logits, draft_tokens, cu_nodes, parents, rule_params, warp, draft_probs, u_sample, u_accept,
           root_tokens, rule, min_accept, max_depth):
    """Reference of ``fastverify::verify`` on normalised arguments (see csrc/verify.cpp).

    Args:
        logits:       [N + B, V] float32 / bfloat16 / float16 target scores (rows laid out per request).
        draft_tokens: int64 [N] token of each draft node.
        cu_nodes:     int32 [B + 1] node offsets.
        parents:      int32 [N] local parent index (-1 = child of the root), parents[j] < j.
        rule_params:  float32 [B, 2] per-request parameters (topk: k; distance: eps; gad: beta, tau;
                      typical: eps, delta; confidence: beta).
        warp:         float32 [B, 4] (temperature, top_k, top_p, min_p), sampling rules only.
        draft_probs:  [N, V] float or None, the drafter's distribution of each node (speculative).
        u_sample:     float32 [N + B] or None, one uniform per logits row (sampling rules).
        u_accept:     float32 [N] or None, one uniform per node (speculative).
        root_tokens:  int64 [B] or None, the last committed token of each request (confidence).
        rule:         int index into RULES.
        min_accept:   int >= 0 (deterministic rules).
        max_depth:    int >= 0, width of ``accepted`` (a longer path keeps its first max_depth nodes).

    Returns:
        accept_len int32 [B], accepted int32 [B, max_depth] (-1 padded), next_token int64 [B].
    """
    name = RULES[rule]
    device = logits.device
    B, V = cu_nodes.numel() - 1, logits.shape[1]
    cu = cu_nodes.tolist()
    tokens_all = draft_tokens.tolist()
    parents_all = parents.tolist()
    params_all = rule_params.double().tolist()
    accept_len = torch.zeros(B, dtype=torch.int32, device=device)
    accepted = torch.full((B, max_depth), -1, dtype=torch.int32, device=device)
    next_token = torch.zeros(B, dtype=torch.int64, device=device)

    x64 = logits.double()  # exact for every input dtype
    bad_row = torch.isnan(x64).any(-1) | torch.isposinf(x64).any(-1) | torch.isneginf(x64).all(-1)
    sampling = _sampling() if name in SAMPLING_RULES else None
    if sampling is not None:
        # Sampling rules also reject rows whose l / T overflows float32 (sampling.invalid_rows).
        row_request = torch.repeat_interleave(torch.arange(B, device=device), cu_nodes.diff().long() + 1)
        bad_row |= sampling.invalid_rows(logits, warp[row_request])

    for b in range(B):
        lo, hi = cu[b], cu[b + 1]
        n = hi - lo
        row0 = lo + b
        if bool(bad_row[row0:row0 + n + 1].any()):
            accept_len[b], next_token[b] = -1, -1
            continue
        rows = x64[row0:row0 + n + 1]
        tokens = tokens_all[lo:hi]
        # unvalidated input (validate=False): a parent that does not precede its node is the root, and a node whose
        # token is outside the vocabulary is no row's child (never accepted)
        par = [p if -1 <= p < j else -1 for j, p in enumerate(parents_all[lo:hi])]
        children, depth = _tree(par)
        children = [[c for c in kids if 0 <= tokens[c] < V] for kids in children]

        if name in DETERMINISTIC_RULES:
            forced = _forced_nodes(rows, tokens, children, min_accept)
            ok = [False] * n
            for j in range(n):
                p = par[j]
                if (p >= 0 and not ok[p]) or not 0 <= tokens[j] < V:
                    continue
                parent_token = tokens[p] if p >= 0 else (
                    int(root_tokens[b]) if root_tokens is not None else None)
                ok[j] = j in forced or _deterministic_cond(name, rows, p + 1, tokens[j], parent_token,
                                                           params_all[b])
            node = -1
            for j in range(n):  # deepest accepted node; strict > keeps the first in node order
                if ok[j] and (node < 0 or depth[j] > depth[node]):
                    node = j
            nxt = _argmax(rows[node + 1])
        elif name == "speculative":
            q_rows = draft_probs[lo:hi] if draft_probs is not None else None
            node, nxt = _speculative_walk(sampling, logits[row0:row0 + n + 1], rows, tokens, children, warp[b],
                                          q_rows, _slice(u_accept, lo, hi), _slice(u_sample, row0, row0 + n + 1))
        else:
            node, nxt = _coupled_walk(sampling, logits[row0:row0 + n + 1], rows, tokens, children, warp[b],
                                      _slice(u_sample, row0, row0 + n + 1))

        path = []
        while node >= 0:
            path.append(node)
            node = par[node]
        path.reverse()
        accept_len[b] = len(path)
        if path:
            accepted[b, :min(len(path), max_depth)] = torch.tensor(path[:max_depth], dtype=torch.int32)
        next_token[b] = nxt
    return accept_len, accepted, next_token

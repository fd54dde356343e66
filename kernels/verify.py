"""Triton kernels of ``fastverify::verify``: batched verification of draft chains and trees under every rule.

Schema: csrc/verify.cpp; specification: fastverify/reference/verify.py (its docstring states every rule).
``verify`` takes the normalised arguments of the schema and is registered as ``fastverify::verify_triton``.

Launches (R = N + B logits rows, N draft nodes):

  deterministic rules (greedy, topk, distance, gad, typical, confidence)
    1. ``_verify_row_stats_kernel``, one program per row, one pass over V in BLOCK_V chunks: max, argmax
       (lowest id on ties), NaN / +inf / all -inf check and, for typical / confidence only, the online
       log-sum-exp and entropy in float64 (per-lane running max, rescaled sums merged at the end).
    2. ``_verify_node_kernel``, one program per node: its token's logit at the parent row and the rule's
       condition; topk / gad also count the node's rank in one more pass over its parent row.
    3. ``_verify_walk_kernel``, one program per request, over its nodes in chunks of BLOCK_N lanes (at most
       WALK_BLOCK_N, whatever the batch's N): the min_accept forced path (its nodes' conditions set in place),
       accept(j) = AND over j and its ancestors of the conditions (a walk up the tree, one level per step,
       reading the node kernel's output), the deepest accepted node (first in node order), the path and argmax.
  coupled
    1. cdf_sample of every row with its u_sample (kernels/sampling.py, the very kernel behind cdf_sample);
    2-3. as above with cond(j) = token(j) == the parent row's draw, the first such sibling only (no earlier
       sibling holds its token: checked in the node kernel).
  speculative (sequential by nature: each rejection changes the distribution of the next sibling)
    1. row stats (for the invalid-row check, including l / T overflowing);
    2. ``_verify_speculative_kernel``, one program per request, down its accepted path: at each row, the
       warp and Z. With draft_probs, p' = w / Z written to a float64 scratch row, siblings tried in order with
       u_accept <= p'(x) / q(x) and the residual max(p' - q, 0) renormalised in place after each rejection;
       with one-hot drafts nothing is materialised (the residual is the row without the rejected tokens:
       u_accept <= w(x) / (Z less their weights)). The final draw inverts the CDF of the row's own warped
       weights (exactly this backend's cdf_sample), of the residual (float64), or of the weights without the
       rejected tokens.
"""

import torch
import triton
import triton.language as tl

from ._common import next_pow2
from .sampling import (_block_find, _block_last, _block_weights, _cdf_find, _cdf_total, _row_state, _scaled,
                       _warped_block, cdf_block_v, cdf_sample as _cdf_sample_op)

RULES = ("greedy", "topk", "distance", "gad", "typical", "confidence", "speculative", "coupled")
STATS_BLOCK_V = 1024
WALK_BLOCK_N = 128  # the node lanes of the walk and the speculative kernel (a request's nodes read in chunks)


# --------------------------------------------------------------------------------------------------------
# 1. per-row statistics
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _verify_row_stats_kernel(logits_ptr, stride_r, V, warp_ptr, row_req_ptr,
                             row_tok_ptr, bad_ptr, lse_ptr, ent_ptr,
                             SOFTMAX: tl.constexpr, SAMPLING: tl.constexpr, BLOCK_V: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + r * stride_r
    cols0 = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_id = tl.full([BLOCK_V], 2147483647, tl.int32)
    badv = tl.zeros([BLOCK_V], tl.int32)
    m_l = tl.full([BLOCK_V], float("-inf"), tl.float64)
    s0 = tl.zeros([BLOCK_V], tl.float64)
    s1 = tl.zeros([BLOCK_V], tl.float64)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + cols0
        x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        badv = badv | ((x != x) | (x == float("inf"))).to(tl.int32)
        better = x > best
        best_id = tl.where(better, cols, best_id)
        best = tl.where(better, x, best)
        if SOFTMAX:
            # Online log-sum-exp and sum of e^(l - m) (l - m), per lane, float64 like the reference.
            x64 = tl.where(x == x, x, float("-inf")).to(tl.float64)
            m_new = tl.maximum(m_l, x64)
            alpha = tl.where(m_l > float("-inf"), tl.exp(m_l - m_new), 0.0)
            shift = tl.where(s0 > 0.0, s0 * (m_l - m_new), 0.0)
            e = tl.where(x64 > float("-inf"), tl.exp(x64 - tl.where(m_new > float("-inf"), m_new, 0.0)), 0.0)
            term = tl.where(e > 0.0, e * (x64 - m_new), 0.0)
            s1 = alpha * (s1 + shift) + term
            s0 = alpha * s0 + e
            m_l = m_new
    xmax = tl.max(best, axis=0)
    arg = tl.min(tl.where(best == xmax, best_id, 2147483647), axis=0)
    arg = tl.where(arg >= V, 0, arg)
    bad = (tl.max(badv, axis=0) > 0) | (xmax == float("-inf"))
    if SAMPLING:
        b = tl.load(row_req_ptr + r)
        temp = tl.load(warp_ptr + b * 4)
        bad = bad | ((temp > 0.0) & (_scaled(xmax, tl.where(temp > 0.0, temp, 1.0)) == float("inf")))
    tl.store(row_tok_ptr + r, arg.to(tl.int64))
    tl.store(bad_ptr + r, bad.to(tl.int8))
    if SOFTMAX:
        M = tl.max(m_l, axis=0)
        live = m_l > float("-inf")
        sc = tl.where(live, tl.exp(m_l - M), 0.0)
        S0 = tl.sum(s0 * sc, axis=0)
        S1 = tl.sum(tl.where(live & (s0 > 0.0), sc * (s1 + s0 * (m_l - M)), 0.0), axis=0)
        S0s = tl.where(S0 > 0.0, S0, 1.0)
        tl.store(lse_ptr + r, M + tl.log(S0s))
        tl.store(ent_ptr + r, tl.log(S0s) - S1 / S0s)


# --------------------------------------------------------------------------------------------------------
# 2. per-node conditions
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _verify_node_kernel(logits_ptr, stride_r, V, tokens_ptr, cu_ptr, parents_ptr, node_req_ptr, params_ptr,
                        root_tokens_ptr, row_tok_ptr, lse_ptr, ent_ptr, cond_ptr, lx_ptr,
                        RULE: tl.constexpr, HAS_ROOT: tl.constexpr, BLOCK_V: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    b = tl.load(node_req_ptr + g)
    node0 = tl.load(cu_ptr + b)
    p = _parent(parents_ptr, node0, g - node0)  # the root where it does not precede its node (unvalidated input)
    row = (node0 + b + 1 + p).to(tl.int64)  # the parent's row (the root row when p == -1)
    row_ptr = logits_ptr + row * stride_r
    x = tl.load(tokens_ptr + g)
    in_vocab = (x >= 0) & (x < V)  # a token outside it (unvalidated input) is never accepted, nor forced
    x = tl.where(in_vocab, x, 0)
    lx = tl.load(row_ptr + x).to(tl.float32)
    tl.store(lx_ptr + g, lx)
    a = tl.load(row_tok_ptr + row)
    prm0 = tl.load(params_ptr + b * 2).to(tl.float64)
    prm1 = tl.load(params_ptr + b * 2 + 1).to(tl.float64)
    if RULE == 1 or RULE == 3:
        # rank(x): tokens with a strictly larger logit, plus equal logits at a lower id.
        cnt = tl.zeros([BLOCK_V], tl.int32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            xs = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            above = (xs > lx) | ((xs == lx) & (cols < x))
            cnt += (above & (cols < V)).to(tl.int32)
        rank = tl.sum(cnt, axis=0).to(tl.float64)
    if RULE == 0 or RULE == 7:  # greedy: the argmax; coupled: the row's inverse-CDF draw
        ok = x == a
    elif RULE == 1:
        ok = rank < prm0
    elif RULE == 2:
        ok = tl.abs((x - a).to(tl.float64)) <= prm0
    elif RULE == 3:
        lmax = tl.load(row_ptr + a).to(tl.float64)
        ok = (rank < prm0) & ((lmax - lx.to(tl.float64)) <= prm1)
    elif RULE == 4:
        px = tl.exp(lx.to(tl.float64) - tl.load(lse_ptr + row))
        ok = px > tl.minimum(prm0, prm1 * tl.exp(-tl.load(ent_ptr + row)))
    else:  # RULE == 5, confidence (LUD): p(x) >= beta and x differs from its parent's token
        px = tl.exp(lx.to(tl.float64) - tl.load(lse_ptr + row))
        ok = px >= prm0
        if HAS_ROOT:
            ptok = tl.where(p >= 0, tl.load(tokens_ptr + node0 + tl.maximum(p, 0)), tl.load(root_tokens_ptr + b))
            ok = ok & (x != ptok)
        else:
            ptok = tl.load(tokens_ptr + node0 + tl.maximum(p, 0))
            ok = ok & ((p < 0) | (x != ptok))
    if RULE == 7:
        # coupled: of the siblings holding the drawn token only the first (in node order) is followed, so a node
        # whose earlier sibling holds its token is not.
        ok = ok & (_earlier_sibling_has(tokens_ptr, parents_ptr, node0, p, g - node0, x, BLOCK_N) == 0)
    tl.store(cond_ptr + g, tl.where(in_vocab, ok.to(tl.int8), 2))  # 2: outside the vocabulary


# --------------------------------------------------------------------------------------------------------
# 3. acceptance walk (and the path writer shared with speculative)
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _preceding(p, j):
    """Parent p of local node j (scalars or vectors), or -1 where it does not precede j (unvalidated input)."""
    return tl.where((p >= -1) & (p < j), p, -1)


@triton.jit
def _parent(parents_ptr, node0, j):
    """Local node j's parent, or -1 where it does not precede j (unvalidated input)."""
    return _preceding(tl.load(parents_ptr + node0 + j), j)


@triton.jit
def _earlier_sibling_has(tokens_ptr, parents_ptr, node0, p, j, x, BLOCK_N: tl.constexpr):
    """1 if a node before local node j with parent p (parents that do not precede their node read as -1) holds
    token x, else 0; the request's nodes read in chunks of BLOCK_N lanes."""
    dup = tl.zeros([], tl.int32)
    for i0 in range(0, j, BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        earlier = i < j
        pi = _preceding(tl.load(parents_ptr + node0 + i, mask=earlier, other=-1), i)
        ti = tl.load(tokens_ptr + node0 + i, mask=earlier, other=-1)
        dup = tl.maximum(dup, tl.max((earlier & (pi == p) & (ti == x)).to(tl.int32), axis=0))
    return dup


@triton.jit
def _request(cu_ptr, bad_ptr, BLOCK_N: tl.constexpr):
    """This program's request b: its first node, its node count, its first logits row, and whether any of its
    n_b + 1 rows is bad (the request is then invalid)."""
    b = tl.program_id(0)
    node0 = tl.load(cu_ptr + b)
    n_b = tl.load(cu_ptr + b + 1) - node0
    row0 = (node0 + b).to(tl.int64)
    bad = tl.zeros([], tl.int32)
    for r0 in range(0, n_b + 1, BLOCK_N):
        r = r0 + tl.arange(0, BLOCK_N)
        bad = tl.maximum(bad, tl.max(tl.load(bad_ptr + row0 + r, mask=r <= n_b, other=0).to(tl.int32), axis=0))
    return b, node0, n_b, row0, bad > 0


@triton.jit
def _write_path(parents_ptr, node0, node, accepted_ptr, accept_len_ptr, b, max_depth, BLOCK_D: tl.constexpr):
    """accept_len[b] = depth(node); accepted[b] = the path root child .. node, -1 padded. Stores touch
    disjoint addresses (padding [L, max_depth) first, then the path), so no ordering hazard. A parent that does
    not precede its node (unvalidated input) ends the path, as the walk reads it."""
    L = tl.zeros([], tl.int32)
    cur = node
    while cur >= 0:
        L += 1
        cur = _parent(parents_ptr, node0, cur)
    row = accepted_ptr + b.to(tl.int64) * max_depth
    for d0 in range(0, max_depth, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        tl.store(row + d, tl.full([BLOCK_D], -1, tl.int32), mask=(d >= L) & (d < max_depth))
    cur = node
    d = L - 1
    while cur >= 0:
        tl.store(row + d, cur.to(tl.int32), mask=d < max_depth)
        cur = _parent(parents_ptr, node0, cur)
        d -= 1
    tl.store(accept_len_ptr + b, L)


@triton.jit
def _write_invalid(accepted_ptr, accept_len_ptr, next_ptr, b, max_depth, BLOCK_D: tl.constexpr):
    row = accepted_ptr + b.to(tl.int64) * max_depth
    for d0 in range(0, max_depth, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        tl.store(row + d, tl.full([BLOCK_D], -1, tl.int32), mask=d < max_depth)
    tl.store(accept_len_ptr + b, -1)
    tl.store(next_ptr + b, -1)


@triton.jit
def _verify_walk_kernel(cu_ptr, parents_ptr, cond_ptr, lx_ptr, row_tok_ptr, bad_ptr,
                        accept_len_ptr, accepted_ptr, next_ptr, min_accept, max_depth,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b, node0, n_b, row0, invalid = _request(cu_ptr, bad_ptr, BLOCK_N)
    if invalid:
        _write_invalid(accepted_ptr, accept_len_ptr, next_ptr, b, max_depth, BLOCK_D)
    else:
        lanes = tl.arange(0, BLOCK_N)
        conds = cond_ptr + node0  # 0 / 1: the node's condition; 2: its token is outside the vocabulary
        # min_accept: force the most likely path (highest logit child, first on ties) to that depth; a forced
        # node's condition is set in place (the node kernel's output, this call's scratch).
        cur = tl.full([], -1, tl.int32)
        step = tl.zeros([], tl.int32)
        alive = n_b > 0
        while alive & (step < min_accept):
            found = tl.zeros([], tl.int32)
            best = tl.full([], float("-inf"), tl.float32)
            chosen = tl.full([], -1, tl.int32)
            for j0 in range(0, n_b, BLOCK_N):
                j = j0 + lanes
                valid = j < n_b
                par = _preceding(tl.load(parents_ptr + node0 + j, mask=valid, other=-1), j)
                cand = valid & (par == cur) & (tl.load(conds + j, mask=valid, other=2) != 2)
                lx = tl.where(cand, tl.load(lx_ptr + node0 + j, mask=valid, other=float("-inf")), float("-inf"))
                top = tl.max(lx, axis=0)
                first = tl.min(tl.where(cand & (lx == top), j, 2147483647), axis=0)
                # the earliest chunk holding the highest logit keeps it (its nodes come first)
                take = (tl.max(cand.to(tl.int32), axis=0) > 0) & ((found == 0) | (top > best))
                best = tl.where(take, top, best)
                chosen = tl.where(take, first, chosen)
                found = tl.maximum(found, take.to(tl.int32))
            alive = found > 0
            if alive:
                tl.store(conds + chosen, tl.full([], 1, tl.int8))
                cur = chosen
            step += 1
        tl.debug_barrier()  # the forced conditions stored above, visible to every lane below
        # accept(j) = AND of the conditions over j and its ancestors, its depth counted on the way up; the
        # deepest accepted node, first in node order.
        dmax = tl.zeros([], tl.int32)
        node = tl.full([], -1, tl.int32)
        for j0 in range(0, n_b, BLOCK_N):
            j = j0 + lanes
            valid = j < n_b
            ok = valid & (tl.load(conds + j, mask=valid, other=0) == 1)
            depth = valid.to(tl.int32)
            anc = tl.where(ok, _preceding(tl.load(parents_ptr + node0 + j, mask=valid, other=-1), j), -1)
            while tl.max(anc, axis=0) >= 0:
                up = anc >= 0
                ok = ok & ((tl.load(conds + anc, mask=up, other=1) == 1) | ~up)
                depth += up.to(tl.int32)
                anc = tl.where(up & ok, _preceding(tl.load(parents_ptr + node0 + anc, mask=up, other=-1), anc), -1)
            score = tl.where(ok, depth, 0)
            top = tl.max(score, axis=0)
            first = tl.min(tl.where((score == top) & ok, j, 2147483647), axis=0)
            better = top > dmax
            node = tl.where(better, first, node)
            dmax = tl.maximum(dmax, top)
        _write_path(parents_ptr, node0, node, accepted_ptr, accept_len_ptr, b, max_depth, BLOCK_D)
        tl.store(next_ptr + b, tl.load(row_tok_ptr + row0 + 1 + node))


# --------------------------------------------------------------------------------------------------------
# speculative sampling
# --------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_r"])  # C(t) summed as cdf_sample does: kernels/sampling.py
def _verify_speculative_kernel(logits_ptr, stride_r, V, tokens_ptr, cu_ptr, parents_ptr, warp_ptr,
                               q_ptr, stride_q, u_sample_ptr, u_accept_ptr, row_tok_ptr, bad_ptr, scratch_ptr,
                               accept_len_ptr, accepted_ptr, next_ptr, max_depth,
                               HAS_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               BLOCK_V: tl.constexpr):
    b, node0, n_b, row0, invalid = _request(cu_ptr, bad_ptr, BLOCK_N)
    if invalid:
        _write_invalid(accepted_ptr, accept_len_ptr, next_ptr, b, max_depth, BLOCK_D)
    else:
        lanes = tl.arange(0, BLOCK_N)
        wp = warp_ptr + b * 4
        greedy = tl.load(wp) == 0.0
        node = tl.full([], -1, tl.int32)
        nxt = tl.full([], -1, tl.int64)
        done = n_b < 0
        while done == 0:
            row = row0 + 1 + node
            row_ptr = logits_ptr + row * stride_r
            if greedy:
                # the first child holding the row's argmax, the request's nodes read in chunks of BLOCK_N
                a = tl.load(row_tok_ptr + row)
                hit = tl.full([], -1, tl.int32)
                c0 = tl.zeros([], tl.int32)
                while (c0 < n_b) & (hit < 0):
                    c = c0 + lanes
                    valid = c < n_b
                    kid = valid & (tl.load(parents_ptr + node0 + c, mask=valid, other=-2) == node)
                    kid = kid & (tl.load(tokens_ptr + node0 + c, mask=valid, other=-1) == a)
                    first = tl.min(tl.where(kid, c, 2147483647), axis=0)
                    hit = tl.where(first < 2147483647, first, -1)
                    c0 += BLOCK_N
                if hit >= 0:
                    node = hit
                else:
                    nxt = a
                    done = n_b >= 0
            else:
                temp, min_p, m, kkey, pkey, arg, bad = _row_state(row_ptr, V, wp, BLOCK_V)
                z, last = _cdf_total(row_ptr, V, temp, min_p, m, kkey, pkey, arg, bad, BLOCK_V)
                u = tl.load(u_sample_ptr + row).to(tl.float64)
                if HAS_Q:
                    hit, t = _speculative_row_q(row_ptr, V, tokens_ptr, parents_ptr, node0, n_b, node, q_ptr,
                                                stride_q, u_accept_ptr, scratch_ptr + b.to(tl.int64) * V, z, last,
                                                u, temp, min_p, m, kkey, pkey, arg, bad, BLOCK_V)
                else:
                    hit, t = _speculative_row_one_hot(row_ptr, V, tokens_ptr, parents_ptr, node0, n_b, node,
                                                      u_accept_ptr, z, last, u, temp, min_p, m, kkey, pkey, arg,
                                                      bad, BLOCK_V, BLOCK_N)
                if hit >= 0:
                    node = hit
                else:
                    nxt = t
                    done = n_b >= 0
        _write_path(parents_ptr, node0, node, accepted_ptr, accept_len_ptr, b, max_depth, BLOCK_D)
        tl.store(next_ptr + b, nxt)


@triton.jit
def _speculative_row_q(row_ptr, V, tokens_ptr, parents_ptr, node0, n_b, node, q_ptr, stride_q, u_accept_ptr, P,
                       z, last, u, temp, min_p, m, kkey, pkey, arg, bad, BLOCK_V: tl.constexpr):
    """A row's speculative step with the drafter's draft_probs: p' = w / Z in the float64 scratch row P, the
    children tried in node order against it, the residual max(p' - q, 0) renormalised in place after each
    rejection. Returns (the accepted local child or -1, the drawn token when none is accepted)."""
    cols0 = tl.arange(0, BLOCK_V)
    # p' = w / Z, float64, in the scratch row (each lane rewrites and rereads its own elements).
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + cols0
        x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        from_sampling = _warped_block(x, cols, V, temp, min_p, m, kkey, pkey, arg, bad)
        tl.store(P + cols, from_sampling.to(tl.float64) / z, mask=cols < V)
    tl.debug_barrier()
    modified = n_b < 0
    hit = tl.full([], -1, tl.int32)
    c = tl.zeros([], tl.int32)
    while (c < n_b) & (hit < 0):
        xt = tl.load(tokens_ptr + node0 + c)
        # a child whose token is outside the vocabulary (unvalidated input) is never accepted
        is_kid = (tl.load(parents_ptr + node0 + c) == node) & (xt >= 0) & (xt < V)
        if is_kid:
            px = tl.load(P + xt)
            q_row = q_ptr + (node0 + c).to(tl.int64) * stride_q
            qx = tl.load(q_row + xt).to(tl.float64)
            ua = tl.load(u_accept_ptr + node0 + c).to(tl.float64)
            ok = tl.where(qx > 0.0, ua <= px / tl.where(qx > 0.0, qx, 1.0), px > 0.0)
            if ok:
                hit = c
            else:
                # residual max(p' - q, 0), renormalised; p' kept when it has no mass.
                acc = tl.zeros([BLOCK_V], tl.float64)
                for v0 in range(0, V, BLOCK_V):
                    cols = v0 + cols0
                    pv = tl.load(P + cols, mask=cols < V, other=0.0)
                    qv = tl.load(q_row + cols, mask=cols < V, other=0.0).to(tl.float64)
                    acc += tl.maximum(pv - qv, 0.0)
                mass = tl.sum(acc, axis=0)
                if mass > 0.0:
                    for v0 in range(0, V, BLOCK_V):
                        cols = v0 + cols0
                        pv = tl.load(P + cols, mask=cols < V, other=0.0)
                        qv = tl.load(q_row + cols, mask=cols < V, other=0.0).to(tl.float64)
                        tl.store(P + cols, tl.maximum(pv - qv, 0.0) / mass, mask=cols < V)
                    tl.debug_barrier()
                    modified = n_b >= 0
        c += 1
    t = tl.full([], -1, tl.int64)
    if hit < 0:
        if modified:
            t = _sample_scratch(P, V, u, BLOCK_V).to(tl.int64)
        else:
            t = _cdf_find(row_ptr, V, temp, min_p, m, kkey, pkey, arg, bad, u * z, last, BLOCK_V).to(tl.int64)
    return hit, t


@triton.jit
def _speculative_row_one_hot(row_ptr, V, tokens_ptr, parents_ptr, node0, n_b, node, u_accept_ptr, z, last, u,
                             temp, min_p, m, kkey, pkey, arg, bad, BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr):
    """A row's speculative step with one-hot drafts (no draft_probs): max(p' - one_hot(x), 0) renormalised is p'
    without x, so nothing is materialised (as the C++ kernel). The children in node order: w(x) = 0 for a token an
    earlier sibling already took out; accept iff rest > 0 and u_accept <= w(x) / rest, rest = Z less the weights
    taken out; a rejected x with w(x) > 0 is taken out. Returns (the accepted local child or -1, the drawn token
    when none is accepted: the row's own cdf_sample draw when nothing was taken out, else the smallest t with
    C'(t) > u * rest, C' the prefix sums of the weights without the taken-out tokens)."""
    rest = z
    taken = n_b < 0
    hit = tl.full([], -1, tl.int32)
    c = tl.zeros([], tl.int32)
    while (c < n_b) & (hit < 0):
        xt = tl.load(tokens_ptr + node0 + c)
        # a child whose token is outside the vocabulary (unvalidated input) is never accepted
        if (tl.load(parents_ptr + node0 + c) == node) & (xt >= 0) & (xt < V):
            wx = _warped_block(tl.load(row_ptr + xt).to(tl.float32), xt, V, temp, min_p, m, kkey, pkey, arg,
                               bad).to(tl.float64)
            if _earlier_sibling_has(tokens_ptr, parents_ptr, node0, node, c, xt, BLOCK_N) > 0:
                wx = tl.zeros([], tl.float64)
            ua = tl.load(u_accept_ptr + node0 + c).to(tl.float64)
            if (rest > 0.0) & (ua <= wx / tl.where(rest > 0.0, rest, 1.0)):
                hit = c
            elif wx > 0.0:
                rest = rest - wx
                taken = n_b >= 0
        c += 1
    t = tl.full([], -1, tl.int64)
    if hit < 0:
        if taken:
            t = _find_without_children(row_ptr, V, tokens_ptr, parents_ptr, node0, n_b, node, temp, min_p, m, kkey,
                                       pkey, arg, bad, u * rest, BLOCK_V).to(tl.int64)
        else:
            t = _cdf_find(row_ptr, V, temp, min_p, m, kkey, pkey, arg, bad, u * z, last, BLOCK_V).to(tl.int64)
    return hit, t


@triton.jit
def _find_without_children(row_ptr, V, tokens_ptr, parents_ptr, node0, n_b, node, temp, min_p, m, kkey, pkey, arg,
                           bad, target, BLOCK_V: tl.constexpr):
    """Smallest t with C'(t) > target, C' the blockwise float64 prefix sums of the row's warped weights with the
    tokens of node's children (all rejected) set to 0; the last such token with a weight when rounding leaves
    none."""
    base = tl.zeros([], tl.float64)
    found = tl.full([], -1, tl.int32)
    last = tl.full([], -1, tl.int32)
    v0 = 0
    while (found < 0) & (v0 < V):
        cols, w = _block_weights(row_ptr, v0, V, temp, min_p, m, kkey, pkey, arg, bad, BLOCK_V)
        c = tl.zeros([], tl.int32)
        while c < n_b:
            if tl.load(parents_ptr + node0 + c) == node:
                w = tl.where(cols == tl.load(tokens_ptr + node0 + c), 0.0, w)
            c += 1
        found, base = _block_find(w, cols, V, base, target, BLOCK_V)
        last = tl.maximum(last, tl.max(tl.where(w > 0.0, cols, -1), axis=0))
        v0 += BLOCK_V
    return tl.where(found < 0, last, found)


@triton.jit
def _sample_scratch(P, V, u, BLOCK_V: tl.constexpr):
    """Inverse CDF of float64 weights P[0:V] (reference sample_from_weights): smallest t with C(t) > u Z,
    else the last t with P(t) > 0."""
    cols0 = tl.arange(0, BLOCK_V)
    base = tl.zeros([], tl.float64)
    last = tl.full([], -1, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + cols0
        pv = tl.load(P + cols, mask=cols < V, other=0.0)
        base = base + _block_last(tl.cumsum(pv, axis=0), BLOCK_V)
        last = tl.maximum(last, tl.max(tl.where(pv > 0.0, cols, -1), axis=0))
    target = u * base
    found = tl.full([], -1, tl.int32)
    acc = tl.zeros([], tl.float64)
    v0 = 0
    while (found < 0) & (v0 < V):
        cols = v0 + cols0
        found, acc = _block_find(tl.load(P + cols, mask=cols < V, other=0.0), cols, V, acc, target, BLOCK_V)
        v0 += BLOCK_V
    return tl.where(found < 0, last, found)


# --------------------------------------------------------------------------------------------------------
# the op
# --------------------------------------------------------------------------------------------------------


@torch.library.custom_op("fastverify::verify_triton", mutates_args=())
def verify(logits: torch.Tensor, draft_tokens: torch.Tensor, cu_nodes: torch.Tensor, parents: torch.Tensor,
           rule_params: torch.Tensor, warp: torch.Tensor, draft_probs: torch.Tensor | None,
           u_sample: torch.Tensor | None, u_accept: torch.Tensor | None, root_tokens: torch.Tensor | None,
           rule: int, min_accept: int, max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalised arguments of csrc/verify.cpp: logits [N + B, V] fp32/bf16/fp16 (unit last stride),
    draft_tokens int64 [N], cu_nodes int32 [B + 1], parents int32 [N], rule_params float32 [B, 2],
    warp float32 [B, 4], draft_probs [N, V] or None, u_sample float32 [N + B] or None, u_accept float32 [N] or
    None, root_tokens int64 [B] or None, rule (index into RULES), min_accept, max_depth.
    Returns accept_len int32 [B], accepted int32 [B, max_depth], next_token int64 [B]."""
    dev = logits.device
    B = cu_nodes.numel() - 1
    R, V = logits.shape
    N = draft_tokens.numel()
    assert R == N + B, "verify: logits must have N + B rows"
    accept_len = torch.empty(B, dtype=torch.int32, device=dev)
    accepted = torch.empty((B, max_depth), dtype=torch.int32, device=dev)
    next_token = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return accept_len, accepted, next_token
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    draft_tokens = draft_tokens.to(torch.int64).contiguous()
    cu_nodes = cu_nodes.to(torch.int32).contiguous()
    parents = parents.to(torch.int32).contiguous()
    rule_params = rule_params.float().contiguous()
    warp = warp.float().contiguous()
    counts = cu_nodes[1:] - cu_nodes[:-1]
    # The walk and the speculative kernel read a request's nodes (and rows) in chunks of BLOCK_N lanes: a width
    # that does not grow with the batch's N (nothing per request is read back from the device, so that the call
    # stays sync-free and CUDA-graph capturable).
    BLOCK_N = min(next_pow2(N + 1, 16), WALK_BLOCK_N)
    BLOCK_D = min(next_pow2(max_depth, 16), 1024)
    row_req = torch.repeat_interleave(torch.arange(B, device=dev, dtype=torch.int32), counts + 1, output_size=R)
    row_tok = torch.empty(R, dtype=torch.int64, device=dev)
    bad = torch.empty(R, dtype=torch.int8, device=dev)
    name = RULES[rule]
    sampling = name in ("speculative", "coupled")

    if name == "coupled":
        u = u_sample if u_sample is not None else torch.rand(R, device=dev)
        row_tok = _cdf_sample_op(logits, u.contiguous(), warp[row_req.long()].contiguous())
        bad = (row_tok < 0).to(torch.int8)
    else:
        softmax = name in ("typical", "confidence")
        lse = torch.empty(R if softmax else 1, dtype=torch.float64, device=dev)
        ent = torch.empty_like(lse)
        _verify_row_stats_kernel[(R,)](logits, logits.stride(0), V, warp, row_req, row_tok, bad, lse, ent,
                                       SOFTMAX=softmax, SAMPLING=sampling,
                                       BLOCK_V=min(next_pow2(V, 16), STATS_BLOCK_V))

    if name == "speculative":
        has_q = draft_probs is not None  # one-hot drafts materialise nothing: no scratch rows
        scratch = torch.empty((B, V) if has_q else (1,), dtype=torch.float64, device=dev)
        q = draft_probs.contiguous() if has_q else scratch
        ua = u_accept.contiguous() if u_accept is not None else torch.rand(max(N, 1), device=dev)
        us = u_sample.contiguous() if u_sample is not None else torch.rand(R, device=dev)
        _verify_speculative_kernel[(B,)](logits, logits.stride(0), V, draft_tokens, cu_nodes, parents, warp,
                                         q, q.stride(0) if has_q else 0, us, ua, row_tok, bad, scratch,
                                         accept_len, accepted, next_token, max_depth,
                                         HAS_Q=has_q, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
                                         BLOCK_V=cdf_block_v(V))
        return accept_len, accepted, next_token

    cond = torch.zeros(max(N, 1), dtype=torch.int8, device=dev)
    lx = torch.zeros(max(N, 1), dtype=torch.float32, device=dev)
    if N:
        node_req = torch.repeat_interleave(torch.arange(B, device=dev, dtype=torch.int32), counts, output_size=N)
        has_root = root_tokens is not None
        roots = root_tokens.to(torch.int64).contiguous() if has_root else draft_tokens
        if name == "coupled":
            lse = ent = torch.empty(1, dtype=torch.float64, device=dev)
        _verify_node_kernel[(N,)](logits, logits.stride(0), V, draft_tokens, cu_nodes, parents, node_req,
                                  rule_params, roots, row_tok, lse, ent, cond, lx,
                                  RULE=rule, HAS_ROOT=has_root, BLOCK_V=min(next_pow2(V, 16), STATS_BLOCK_V),
                                  BLOCK_N=BLOCK_N if name == "coupled" else 16)  # (coupled's alone reads it)
    _verify_walk_kernel[(B,)](cu_nodes, parents, cond, lx, row_tok, bad, accept_len, accepted, next_token,
                              min_accept if name != "coupled" else 0, max_depth, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
    return accept_len, accepted, next_token


@verify.register_fake
def _(logits, draft_tokens, cu_nodes, parents, rule_params, warp, draft_probs, u_sample, u_accept, root_tokens,
      rule, min_accept, max_depth):
    B = cu_nodes.shape[0] - 1
    return (logits.new_empty((B,), dtype=torch.int32), logits.new_empty((B, max_depth), dtype=torch.int32),
            logits.new_empty((B,), dtype=torch.int64))

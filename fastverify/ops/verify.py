"""Public API of ``verify``: normalise the arguments -> dispatch -> check the result.

The backends implement one normalised signature (csrc/verify.cpp), dispatched by fastverify/ops/dispatch.py:

  torch   fastverify.reference.verify.verify        (the specification)
  cpp     torch.ops.fastverify.verify, CPU kernel    (csrc/cpu/verify.cpp)
  cuda    torch.ops.fastverify.verify, CUDA kernel   (csrc/cuda/verify.cu)
  triton  fastverify.kernels.verify.verify           (kernels/verify.py)
"""

import math
from typing import NamedTuple

import torch

from fastverify import _ext
from fastverify.ops import dispatch
from fastverify.ops.checks import FLOAT_DTYPES, INT_DTYPES, LOGIT_DTYPES, check_range, check_tensor
from fastverify.ops.sampling import _uniform_op, sample_v
from fastverify.reference.verify import RULES, SAMPLING_RULES

__all__ = ["RULES", "VerifyOutput", "verify"]

# Which parameters each rule takes (user-facing names), in the order they fill rule_params[:, 0:2].
_RULE_PARAMS = {
    "greedy": (),
    "topk": ("k",),
    "distance": ("eps",),
    "gad": ("beta", "tau"),
    "typical": ("eps", "delta"),
    "confidence": ("beta",),
    "speculative": (),
    "coupled": (),
}


class VerifyOutput(NamedTuple):
    """Result of ``verify`` for B requests.

    accept_len: int32 [B], accepted draft nodes (0 .. depth of the tree).
    accepted:   int32 [B, max_depth], local node indices of the accepted path from the root's child down, -1 padded.
    next_token: int64 [B], the correction / bonus token after the path. Each step commits accept_len + 1 tokens.
    """

    accept_len: torch.Tensor
    accepted: torch.Tensor
    next_token: torch.Tensor


def available_backends():
    """The backends whose verify code exists here (before checking the device): a tuple of names."""
    return dispatch.implemented_backends("verify")


if _ext.HAS_CPP:
    try:

        @torch.library.register_fake("fastverify::verify")
        def _verify_fake(logits, draft_tokens, cu_nodes, parents, rule_params, warp, draft_probs, u_sample, u_accept,
                         root_tokens, rule, min_accept, max_depth):
            B = cu_nodes.shape[0] - 1
            return (logits.new_empty((B,), dtype=torch.int32),
                    logits.new_empty((B, max_depth), dtype=torch.int32),
                    logits.new_empty((B,), dtype=torch.int64))
    except RuntimeError:  # schema missing from an old build; the torch backend still works
        pass


def verify(logits, draft_tokens, cu_nodes=None, parents=None, *, rule="greedy", k=None, eps=None, beta=None, tau=None,
           delta=None, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, min_accept=0, draft_probs=None, u_sample=None,
           u_accept=None, seed=None, position=None, root_tokens=None, generator=None, backend="auto",
           validate=True) -> VerifyOutput:
    """Verify B requests' draft chains or trees against the target's logits under one acceptance rule.

    Ragged form (DESIGN.md "Batch layout"): request b drafts n_b >= 0 nodes, N = sum n_b.
        logits        [N + B, V] float32 / bfloat16 / float16: request b's rows cu_nodes[b] + b .. cu_nodes[b+1] + b
                      (its root row, then one row per node; row i scores the children of node i - 1).
        draft_tokens  int64 [N]; cu_nodes int32 [B + 1] (0 .. N, non-decreasing);
        parents       int32 [N] local parent index (-1 = child of the root, parents[j] < j), or None for chains.
    Dense form (cu_nodes None): logits [B, K + 1, V], draft_tokens [B, K]: chains of K nodes, or trees with parents
        [K] (shared) or [B, K]; draft_probs [B, K, V], u_sample [B, K + 1], u_accept [B, K].

    Rules (see fastverify.reference.verify for the exact definitions):
        "greedy", "topk" (k >= 1), "distance" (eps >= 0), "gad" (beta >= 1, tau >= 0),
        "typical" (eps >= 0, delta >= 0; delta defaults to sqrt(eps) as in Medusa), "confidence" (beta in (0, 1]),
        "speculative" (draft_probs [N, V] optional; one-hot drafts when None), "coupled".
        Rule parameters and the warping (temperature >= 0, top_k >= 0, top_p in (0, 1], min_p in [0, 1]) are
        Python numbers or per-request tensors [B]. Warping applies to the sampling rules only; temperature 0
        makes them greedy. ``min_accept`` (deterministic rules only) forces that many nodes along the most
        likely path; ``root_tokens`` int64 [B] (the last committed tokens) feeds confidence's repetition stop.

    Random numbers (sampling rules): ``u_sample`` float32 [N + B] (one per row) and ``u_accept`` float32 [N] (one
    per node) when given; otherwise from ``seed`` (int or int64 [B]) and ``position`` (int64 [B], the absolute
    position of the token sampled at the root row): u_sample of a row at depth d = uniform(seed, position + d,
    stream 0), u_accept of local node j = uniform(seed, position + depth(j) - 1, stream 1 + j); otherwise
    uniforms from ``generator``.

    backend: "auto" (cpp on CPU tensors, cuda > triton on CUDA tensors), or "torch", "cpp", "triton", "cuda".
    validate=False skips the data checks (no host synchronisation beyond computing the tree depth); a request
    with NaN / +inf logits then reports accept_len = -1 instead of raising.

    Returns VerifyOutput(accept_len int32 [B], accepted int32 [B, max_depth], next_token int64 [B]).
    """
    if rule not in RULES:
        raise ValueError(f"rule: expected one of {RULES}, got {rule!r}")
    # ---- normalise
    logits, draft_tokens, cu_nodes, parents, draft_probs, u_sample, u_accept, cu = _batch_layout(
        logits, draft_tokens, cu_nodes, parents, draft_probs, u_sample, u_accept, validate)
    device, B, N = logits.device, len(cu) - 1, draft_tokens.numel()
    parents, depth, max_depth = _tree(parents, cu, device, validate)
    rule_params = _rule_params(rule, B, device, {"k": k, "eps": eps, "beta": beta, "tau": tau, "delta": delta},
                               validate)
    warp = _warp(B, device, temperature, top_k, top_p, min_p, validate)
    root_tokens = _rule_options(rule, min_accept, root_tokens, B, device)
    if rule in SAMPLING_RULES:
        draft_probs = _draft_probs(rule, draft_probs, N, logits.shape[1], device, validate)
        u_sample, u_accept = _uniforms(rule, u_sample, u_accept, seed, position, generator, cu_nodes, depth, B, N,
                                       device, validate)
    else:
        for name, val in (("draft_probs", draft_probs), ("u_sample", u_sample), ("u_accept", u_accept),
                          ("seed", seed), ("position", position)):
            if val is not None:
                raise ValueError(f"{name}: only used by the sampling rules {SAMPLING_RULES}, got rule {rule!r}")
    # ---- dispatch
    accept_len, accepted, next_token = dispatch.call(
        "verify", backend, device, logits, draft_tokens, cu_nodes, parents, rule_params, warp, draft_probs, u_sample,
        u_accept, root_tokens, RULES.index(rule), min_accept, max_depth)
    # ---- check the result
    if validate and B and bool((accept_len < 0).any()):
        bad = torch.nonzero(accept_len < 0).flatten().tolist()
        raise ValueError(f"logits: requests {bad[:8]} have rows with NaN or +inf, or a row that is entirely -inf"
                         + (" (or whose logits / temperature overflow float32)" if rule in SAMPLING_RULES else ""))
    return VerifyOutput(accept_len, accepted, next_token)


# --------------------------------------------------------------------------------------------------------------
# Normalisation: the batch layout and the tree


def _batch_layout(logits, draft_tokens, cu_nodes, parents, draft_probs, u_sample, u_accept, validate):
    """The ragged layout of DESIGN.md "Batch layout" from either form, checked: logits [N + B, V] (unit inner
    stride), draft_tokens int64 [N], cu_nodes int32 [B + 1], parents [N] or None, the dense form's optional
    per-node / per-row tensors flattened, and the offsets as a host list."""
    check_tensor("logits", logits, logits.device if isinstance(logits, torch.Tensor) else None, LOGIT_DTYPES)
    device = logits.device
    check_tensor("draft_tokens", draft_tokens, device, INT_DTYPES)
    if cu_nodes is None:
        if logits.dim() != 3:
            raise ValueError(f"logits: without cu_nodes expected the dense form [B, K + 1, V], got shape "
                             f"{tuple(logits.shape)}")
        B, K1, V = logits.shape
        K = K1 - 1
        if K < 0:
            raise ValueError(f"logits: dense form needs K + 1 >= 1 rows per request, got shape {tuple(logits.shape)}")
        if tuple(draft_tokens.shape) != (B, K):
            raise ValueError(f"draft_tokens: expected shape [{B}, {K}] to match logits {tuple(logits.shape)}, "
                             f"got {tuple(draft_tokens.shape)}")
        logits = logits.reshape(B * K1, V)
        draft_tokens = draft_tokens.reshape(B * K)
        cu = [b * K for b in range(B + 1)]  # known on the host: no device read-back below
        cu_nodes = torch.arange(B + 1, device=device, dtype=torch.int32) * K
        if parents is not None:
            check_tensor("parents", parents, device, INT_DTYPES)
            if parents.shape not in ((K,), (B, K)):
                raise ValueError(f"parents: dense form expects shape [{K}] or [{B}, {K}], got {tuple(parents.shape)}")
            parents = parents.expand(B, K).reshape(B * K)
        for name, val, shape in (("draft_probs", draft_probs, (B, K, V)), ("u_sample", u_sample, (B, K1)),
                                 ("u_accept", u_accept, (B, K))):
            if val is not None:
                check_tensor(name, val, device)
                if tuple(val.shape) != shape:
                    raise ValueError(f"{name}: dense form expects shape {list(shape)}, got {tuple(val.shape)}")
        draft_probs = None if draft_probs is None else draft_probs.reshape(B * K, V)
        u_sample = None if u_sample is None else u_sample.reshape(B * K1)
        u_accept = None if u_accept is None else u_accept.reshape(B * K)
    else:
        check_tensor("cu_nodes", cu_nodes, device, INT_DTYPES, dim=1)
        if cu_nodes.numel() < 1:
            raise ValueError("cu_nodes: expected shape [B + 1] with B >= 0, got an empty tensor")
        if logits.dim() != 2:
            raise ValueError(f"logits: with cu_nodes expected [N + B, V], got shape {tuple(logits.shape)}")
        if draft_tokens.dim() != 1:
            raise ValueError(f"draft_tokens: expected shape [N], got {tuple(draft_tokens.shape)}")
        B = cu_nodes.numel() - 1
        V = logits.shape[1]
        cu = None
    N = draft_tokens.numel()
    if logits.shape[0] != N + B:
        raise ValueError(f"logits: expected N + B = {N} + {B} = {N + B} rows, got {logits.shape[0]}")
    if V < 1:
        raise ValueError("logits: expected a vocabulary of at least one token, got V = 0")
    if logits.stride(-1) != 1:  # kernels need a contiguous last dim; any row stride is fine
        logits = logits.contiguous()
    cu_nodes = cu_nodes.to(torch.int32)
    draft_tokens = draft_tokens.to(torch.int64)
    if cu is None:
        cu = cu_nodes.tolist()
    if validate:
        if cu[0] != 0 or cu[-1] != N or any(b > a for a, b in zip(cu[1:], cu[:-1])):
            raise ValueError(f"cu_nodes: expected non-decreasing offsets from 0 to N = {N}, got {cu}")
        if N and bool(((draft_tokens < 0) | (draft_tokens >= V)).any()):
            bad = draft_tokens[(draft_tokens < 0) | (draft_tokens >= V)]
            raise ValueError(f"draft_tokens: expected token ids in [0, V = {V}), got {bad[:4].tolist()}")
    return logits, draft_tokens, cu_nodes, parents, draft_probs, u_sample, u_accept, cu


def _tree(parents, cu, device, validate):
    """(parents int32 [N] with chains materialised, node depths as a host list or None for chains, max depth)."""
    B, N = len(cu) - 1, cu[-1]
    counts = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if parents is None:
        if B and len(set(counts)) == 1:  # equal chains (the dense form): built on the device, no host copy
            parents = (torch.arange(counts[0], dtype=torch.int32, device=device) - 1).repeat(B)
        else:
            parents = torch.tensor([j - 1 for c in counts for j in range(c)], dtype=torch.int32, device=device)
        return parents, None, max(counts, default=0)  # chain depths are computed on demand (seeded uniforms)
    check_tensor("parents", parents, device, INT_DTYPES, dim=1)
    if parents.numel() != N:
        raise ValueError(f"parents: expected shape [N = {N}], got {tuple(parents.shape)}")
    parents = parents.to(torch.int32)
    par = parents.tolist()
    depth = [0] * N
    for b in range(B):
        for j in range(counts[b]):
            p = par[cu[b] + j]
            if validate and not -1 <= p < j:
                raise ValueError(f"parents: request {b} node {j} has parent {p}; expected -1 (the root) or a "
                                 f"node of the same request that precedes it (0 <= parent < {j})")
            depth[cu[b] + j] = 1 if p < 0 else depth[cu[b] + p] + 1
    return parents, depth, max(depth, default=0)


# --------------------------------------------------------------------------------------------------------------
# Normalisation: rule and warping parameters


def _per_request(name, value, B, device, *, integral=False):
    """A Python scalar or a tensor [B] (or 0-dim) -> float32 [B] on device."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 1 or (value.dim() == 1 and value.numel() not in (1, B)):
            raise ValueError(f"{name}: expected a scalar or a tensor of shape [{B}], got shape {tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name}: expected a real number tensor, got {value.dtype}")
        if value.device != device:
            raise ValueError(f"{name}: expected a tensor on {device}, got {value.device}")
        if integral and value.is_floating_point() and bool((value != value.round()).any()):
            raise ValueError(f"{name}: expected integers, got {value}")
        return value.to(torch.float32).reshape(-1).expand(B).contiguous()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number or a tensor, got {type(value).__name__}")
    if integral and math.isfinite(value) and value != int(value):
        raise ValueError(f"{name}: expected an integer, got {value}")
    return float(value)  # Python scalars stay on the host: one tensor for all of them (see _columns)


_CONST_COLUMNS = {}  # (values, B, device) -> read-only float32 [B, n]; bounded, see _columns


def _columns(cols, B, device):
    """float32 [B, len(cols)] from Python floats and / or float32 [B] tensors. All-scalar parameters (the usual
    case: the same rule and warping every step) come from a small cache, so that a CUDA call does not pay a
    host-to-device copy, which waits for the stream, for each of its two parameter tensors. The kernels only
    read these tensors."""
    if not any(isinstance(c, torch.Tensor) for c in cols):
        # While torch.compile traces, a constant tensor and nothing kept across calls.
        key = None if torch.compiler.is_compiling() else (tuple(cols), B, device)
        t = _CONST_COLUMNS.get(key)
        if t is None:
            t = torch.tensor(cols, dtype=torch.float32, device=device).expand(B, len(cols)).contiguous()
            if key is not None:
                if len(_CONST_COLUMNS) >= 64:
                    _CONST_COLUMNS.clear()
                _CONST_COLUMNS[key] = t
        return t
    return torch.stack([c if isinstance(c, torch.Tensor) else torch.full((B,), c, dtype=torch.float32, device=device)
                        for c in cols], dim=1)


def _rule_params(rule, B, device, given, validate):
    """float32 [B, 2] rule parameters (schema layout), with defaults and range checks."""
    names = _RULE_PARAMS[rule]
    for name, value in given.items():
        if value is not None and name not in names:
            raise ValueError(f"{name}: not a parameter of rule {rule!r} (its parameters: {names or 'none'})")
    if rule == "typical" and given["delta"] is None and given["eps"] is not None:
        # Medusa's default: posterior_alpha = sqrt(posterior_threshold).
        e = given["eps"]
        given = dict(given, delta=e.sqrt() if isinstance(e, torch.Tensor) else math.sqrt(e) if e >= 0 else e)
    cols = []
    for name in names:
        if given[name] is None:
            raise ValueError(f"{name}: rule {rule!r} needs {' and '.join(names)}")
        cols.append(_per_request(name, given[name], B, device, integral=(rule, name) in (("topk", "k"),)))
    if validate:
        if rule == "topk":
            check_range("k", cols[0], lo=1)
        elif rule == "distance":
            check_range("eps", cols[0], lo=0)
        elif rule == "gad":
            check_range("beta", cols[0], lo=1)
            check_range("tau", cols[1], lo=0)
        elif rule == "typical":
            check_range("eps", cols[0], lo=0)
            check_range("delta", cols[1], lo=0)
        elif rule == "confidence":
            check_range("beta", cols[0], lo=0, hi=1, lo_open=True)
    while len(cols) < 2:
        cols.append(0.0)
    return _columns(cols, B, device)


def _warp(B, device, temperature, top_k, top_p, min_p, validate):
    t = _per_request("temperature", temperature, B, device)
    k = _per_request("top_k", top_k, B, device, integral=True)
    p = _per_request("top_p", top_p, B, device)
    mp = _per_request("min_p", min_p, B, device)
    if validate:
        check_range("temperature", t, lo=0)
        check_range("top_k", k, lo=0)
        check_range("top_p", p, lo=0, hi=1, lo_open=True)
        check_range("min_p", mp, lo=0, hi=1)
    return _columns([t, k, p, mp], B, device)


def _rule_options(rule, min_accept, root_tokens, B, device):
    """Checks min_accept; root_tokens as int64 [B] (rule 'confidence' only) or None."""
    if isinstance(min_accept, bool) or not isinstance(min_accept, int) or min_accept < 0:
        raise ValueError(f"min_accept: expected an int >= 0, got {min_accept!r}")
    if min_accept and rule in SAMPLING_RULES:
        raise ValueError(f"min_accept: must be 0 for the sampling rule {rule!r} (forcing nodes would bias the "
                         f"sampled distribution), got {min_accept}")
    if root_tokens is None:
        return None
    if rule != "confidence":
        raise ValueError(f"root_tokens: only used by rule 'confidence', got rule {rule!r}")
    check_tensor("root_tokens", root_tokens, device, INT_DTYPES)
    if root_tokens.numel() != B:
        raise ValueError(f"root_tokens: expected shape [B = {B}], got {tuple(root_tokens.shape)}")
    return root_tokens.reshape(B).to(torch.int64)


# --------------------------------------------------------------------------------------------------------------
# Normalisation: the sampling rules' inputs


def _draft_probs(rule, draft_probs, N, V, device, validate):
    """float32 / bf16 / fp16 [N, V] with a unit inner stride, or None (one-hot drafts)."""
    if draft_probs is None:
        return None
    if rule != "speculative":
        raise ValueError("draft_probs: only used by rule 'speculative'")
    check_tensor("draft_probs", draft_probs, device, FLOAT_DTYPES, dim=2)
    if tuple(draft_probs.shape) != (N, V):
        raise ValueError(f"draft_probs: expected shape [N, V] = [{N}, {V}], got {tuple(draft_probs.shape)}")
    if draft_probs.dtype == torch.float64:
        draft_probs = draft_probs.float()
    if draft_probs.stride(-1) != 1:
        draft_probs = draft_probs.contiguous()
    if validate and N and bool((~torch.isfinite(draft_probs) | (draft_probs < 0)).any()):
        raise ValueError("draft_probs: expected finite, non-negative probabilities")
    return draft_probs


def _uniforms(rule, u_sample, u_accept, seed, position, generator, cu_nodes, depth, B, N, device, validate):
    """(u_sample float32 [N + B], u_accept float32 [N] or None): given, drawn from (seed, position), or drawn
    with ``generator`` (see ``verify``)."""
    need_accept = rule == "speculative"
    if (seed is None) != (position is None):
        raise ValueError("seed, position: give both (seeded uniforms) or neither")
    if seed is not None:
        if isinstance(seed, int) and not isinstance(seed, bool):
            seed = torch.full((B,), seed, dtype=torch.int64, device=device)
        check_tensor("seed", seed, device, INT_DTYPES)
        check_tensor("position", position, device, INT_DTYPES)
        if seed.numel() not in (1, B) or position.numel() != B:
            raise ValueError(f"seed, position: expected shape [B = {B}], got {tuple(seed.shape)}, "
                             f"{tuple(position.shape)}")
        seed = seed.to(torch.int64).reshape(-1).expand(B)
        position = position.to(torch.int64).reshape(B)
        # Request and local index of every node, computed where the tensors live (no host round trip).
        cu_long = cu_nodes.long()
        node_ids = torch.arange(N, device=device)
        node_request = torch.searchsorted(cu_long[1:], node_ids, right=True)
        local = node_ids - cu_long[node_request]
        # chains: depth of local node j is j + 1
        node_depth = local + 1 if depth is None else torch.tensor(depth, dtype=torch.int64, device=device)
    for name, val, n in (("u_sample", u_sample, N + B), ("u_accept", u_accept, N)):
        if val is None:
            continue
        if name == "u_accept" and not need_accept:
            raise ValueError(f"u_accept: only used by rule 'speculative', got rule {rule!r}")
        check_tensor(name, val, device, FLOAT_DTYPES)
        if val.numel() != n:
            raise ValueError(f"{name}: expected {n} values, got shape {tuple(val.shape)}")
    if u_sample is None:
        if seed is not None:
            # Row order per request: the root row (depth 0), then the row of node j (depth(j)).
            row_request = torch.searchsorted(cu_long[1:] + torch.arange(1, B + 1, device=device),
                                             torch.arange(N + B, device=device), right=True)
            row_depth = torch.zeros(N + B, dtype=torch.int64, device=device)
            row_depth[node_ids + node_request + 1] = node_depth  # node g's own row
            u_sample = _uniform(seed[row_request], position[row_request] + row_depth, 0)
        else:
            u_sample = sample_v(N + B, generator=generator, device=device)
    if need_accept and u_accept is None and N:
        if seed is not None:
            # local node j draws from Philox stream 1 + j: one call with a stream per node
            u_accept = _uniform(seed[node_request], position[node_request] + node_depth - 1, 1 + local)
        else:
            u_accept = sample_v(N, generator=generator, device=device)
    elif need_accept and u_accept is None:
        u_accept = torch.empty(0, dtype=torch.float32, device=device)
    u_sample = u_sample.reshape(-1).to(torch.float32).contiguous()
    if u_accept is not None:
        u_accept = u_accept.reshape(-1).to(torch.float32).contiguous()
    if validate:
        for name, val in (("u_sample", u_sample), ("u_accept", u_accept)):
            if val is not None and val.numel():
                check_range(name, val, lo=0, hi=1, lo_open=True, hi_open=True)
    return u_sample, u_accept


def _uniform(seed, position, stream):
    """uniform() on int64 tensors of one shape, unchecked; stream an int or a tensor of that shape (verify's
    streams, 0 and 1 + j, are in [0, 2^32) by construction)."""
    if isinstance(stream, int):
        stream = torch.full_like(position, stream)
    return _uniform_op(seed, position, stream)

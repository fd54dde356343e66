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
from fastverify.ops.checks import FLOAT_DTYPES, INT_DTYPES, LOGIT_DTYPES, check_range, check_tensor, constant_rows
from fastverify.ops.sampling import sample_v
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
           u_accept=None, seed=None, position=None, root_tokens=None, generator=None, max_depth=None,
           backend="auto", validate=True) -> VerifyOutput:
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
        Rule parameters and the warping (temperature in [0, inf), top_k >= 0, top_p in (0, 1], min_p in [0, 1]) are
        Python numbers or per-request tensors [B]. Warping applies to the sampling rules only; temperature 0
        makes them greedy. ``min_accept`` (deterministic rules only) forces that many nodes along the most
        likely path; ``root_tokens`` int64 [B] (the last committed tokens) feeds confidence's repetition stop.

    Random numbers (sampling rules): ``u_sample`` float32 [N + B] (one per row) and ``u_accept`` float32 [N] (one
    per node) when given; otherwise from ``seed`` (int or int64 [B]) and ``position`` (int64 [B], the absolute
    position of the token sampled at the root row): u_sample of a row at depth d = uniform(seed, position + d,
    stream 0), u_accept of local node j = uniform(seed, position + depth(j) - 1, stream 1 + j); otherwise
    uniforms from ``generator``.

    max_depth: the width of ``accepted`` (an int >= 0). Default: K in the dense form; in the ragged form the
        deepest node's depth, which is read back from the device. Give it (for example the drafter's budget) for
        fixed-shape outputs; ``accepted`` then holds the first max_depth nodes of the path (accept_len is never
        truncated), and validate=True checks that no node is deeper.
    backend: "auto" (cpp on CPU tensors, cuda > triton on CUDA tensors), or "torch", "cpp", "triton", "cuda".
    validate=False skips the data checks. Then, in the dense form or with ``max_depth`` given, the call reads
    nothing back from the device (no host synchronisation: CUDA-graph capturable, no graph break under
    torch.compile) and its outputs' shapes depend on the inputs' shapes alone. A request with NaN / +inf logits
    reports accept_len = -1 instead of raising; malformed trees or offsets give unspecified results, never an
    out-of-bounds access; a draft token outside the vocabulary is never accepted, nor forced by min_accept (the C++
    backend checks tokens and parents on its own, and raises).

    Returns VerifyOutput(accept_len int32 [B], accepted int32 [B, max_depth], next_token int64 [B]).
    """
    if rule not in RULES:
        raise ValueError(f"rule: expected one of {RULES}, got {rule!r}")
    # ---- normalise
    logits, draft_tokens, cu_nodes, parents, draft_probs, u_sample, u_accept, cu, K = _batch_layout(
        logits, draft_tokens, cu_nodes, parents, draft_probs, u_sample, u_accept, validate, max_depth is None)
    device, B, N = logits.device, cu_nodes.numel() - 1, draft_tokens.numel()
    if max_depth is not None and (isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0):
        raise ValueError(f"max_depth: expected None or an int >= 0, got {max_depth!r}")
    chain = parents is None
    parents, depth, deepest = _tree(parents, cu_nodes, cu, K, N, device, validate)
    if not chain and depth is None:
        depth = "tree"  # depths found on the device where seeded uniforms need them
    if max_depth is None:
        max_depth = K if K is not None else deepest
    elif validate and deepest > max_depth:
        raise ValueError(f"max_depth: the deepest node has depth {deepest}, more than max_depth = {max_depth}")
    rule_params = _rule_params(rule, B, device, {"k": k, "eps": eps, "beta": beta, "tau": tau, "delta": delta},
                               validate)
    warp = _warp(B, device, temperature, top_k, top_p, min_p, validate)
    root_tokens = _rule_options(rule, min_accept, root_tokens, B, logits.shape[1], device, validate)
    if rule in SAMPLING_RULES:
        draft_probs = _draft_probs(rule, draft_probs, N, logits.shape[1], device, validate)
        u_sample, u_accept = _uniforms(rule, u_sample, u_accept, seed, position, generator, cu_nodes, parents,
                                       None if chain else depth, K, B, N, device, validate)
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


def _batch_layout(logits, draft_tokens, cu_nodes, parents, draft_probs, u_sample, u_accept, validate, host_offsets):
    """The ragged layout of DESIGN.md "Batch layout" from either form, checked: logits [N + B, V] (unit inner
    stride), draft_tokens int64 [N], cu_nodes int32 [B + 1], parents [N] or None, the dense form's optional
    per-node / per-row tensors flattened; the offsets as a host list when validating (read back from the device in
    the ragged form), or in the ragged form when ``host_offsets``; else None; and the dense form's K (None for the
    ragged form)."""
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
        cu = [b * K for b in range(B + 1)] if validate else None  # known on the host: no device read-back
        cu_nodes = constant_rows.build(("dense cu_nodes", B, K, device),
                                       lambda: torch.arange(B + 1, device=device, dtype=torch.int32) * K)
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
        cu = K = None
    N = draft_tokens.numel()
    if logits.shape[0] != N + B:
        raise ValueError(f"logits: expected N + B = {N} + {B} = {N + B} rows, got {logits.shape[0]}")
    if V < 1:
        raise ValueError("logits: expected a vocabulary of at least one token, got V = 0")
    if logits.stride(-1) != 1:  # kernels need a contiguous last dim; any row stride is fine
        logits = logits.contiguous()
    cu_nodes = _as(cu_nodes, torch.int32)
    if K is None and not validate:
        cu_nodes = _offsets_in_bounds(cu_nodes, N)
    draft_tokens = _as(draft_tokens, torch.int64)
    if K is None and (validate or host_offsets):
        cu = cu_nodes.tolist()
    if validate:
        if cu[0] != 0 or cu[-1] != N or any(b > a for a, b in zip(cu[1:], cu[:-1])):
            raise ValueError(f"cu_nodes: expected non-decreasing offsets from 0 to N = {N}, got {cu}")
        if N and bool(((draft_tokens < 0) | (draft_tokens >= V)).any()):
            bad = draft_tokens[(draft_tokens < 0) | (draft_tokens >= V)]
            raise ValueError(f"draft_tokens: expected token ids in [0, V = {V}), got {bad[:4].tolist()}")
    return logits, draft_tokens, cu_nodes, parents, draft_probs, u_sample, u_accept, cu, K


def _offsets_in_bounds(cu_nodes, N):
    """Unvalidated offsets clamped into [0, N], non-decreasing, from 0 to N, on the device: the offsets themselves
    where they are valid, and otherwise a layout whose every row and node lies inside the tensors, so that
    malformed offsets give unspecified results, never an access out of bounds (nor a device-side assert)."""
    inner = cu_nodes[1:-1].clamp(0, N)
    if inner.numel():
        inner = inner.cummax(0).values
    return torch.cat([cu_nodes.new_zeros(1), inner, cu_nodes.new_full((1,), N)])


def _as(x, dtype):
    """x in dtype (the tensor itself when it already is: a call's worth of torch overhead saved per argument)."""
    return x if x.dtype == dtype else x.to(dtype)


def _node_index(cu_nodes, N):
    """(request, local index) of every node, int64 [N] each, computed on the device."""
    cu_long = cu_nodes.long()
    node_ids = torch.arange(N, device=cu_nodes.device)
    request = torch.searchsorted(cu_long[1:], node_ids, right=True)
    return request, node_ids - cu_long[request]


def _tree(parents, cu_nodes, cu, K, N, device, validate):
    """(parents int32 [N] with chains materialised; node depths int64 [N] on the device, or None where they are
    not known yet (chains: local index + 1; trees not validated: ``_device_depth`` on demand); the deepest
    node's depth, or None where it would need a host read that ``cu`` (None) says to avoid)."""
    if parents is None:
        if K is not None:  # the dense form: equal chains, built on the device
            B = cu_nodes.numel() - 1
            parents = constant_rows.build(("dense chains", B, K, device), lambda: (
                torch.arange(K, dtype=torch.int32, device=device) - 1).repeat(B))
        else:
            parents = (_node_index(cu_nodes, N)[1] - 1).to(torch.int32)
        deepest = K if K is not None else None if cu is None else max((b - a for a, b in zip(cu[:-1], cu[1:])),
                                                                      default=0)
        return parents, None, deepest
    check_tensor("parents", parents, device, INT_DTYPES, dim=1)
    if parents.numel() != N:
        raise ValueError(f"parents: expected shape [N = {N}], got {tuple(parents.shape)}")
    parents = _as(parents, torch.int32)
    if cu is None or (K is not None and not validate):  # depths left to the device (the dense form's width is K)
        return parents, None, None
    par = parents.tolist()
    depth = [0] * N
    for b in range(len(cu) - 1):
        for j in range(cu[b + 1] - cu[b]):
            p = par[cu[b] + j]
            if validate and not -1 <= p < j:
                raise ValueError(f"parents: request {b} node {j} has parent {p}; expected -1 (the root) or a "
                                 f"node of the same request that precedes it (0 <= parent < {j})")
            depth[cu[b] + j] = 1 if not 0 <= p < j else depth[cu[b] + p] + 1
    return parents, torch.tensor(depth, dtype=torch.int64, device=device), max(depth, default=0)


def _device_depth(parents, cu_nodes, N, n_max):
    """Depth of every node (a child of the root has depth 1), int64 [N], without leaving the device: pointer
    jumping over the parent links, ceil(log2(n_max)) rounds for requests of at most n_max nodes. A parent that
    does not precede its node counts as the root (unvalidated input stays in bounds)."""
    request, local = _node_index(cu_nodes, N)
    p = parents.long()
    anc = torch.where((p >= 0) & (p < local), cu_nodes.long()[request] + p, N)  # N: a sentinel of depth 0
    anc = torch.cat([anc, torch.full((1,), N, dtype=torch.int64, device=anc.device)])
    d = torch.cat([torch.ones(N, dtype=torch.int64, device=anc.device),
                   torch.zeros(1, dtype=torch.int64, device=anc.device)])
    for _ in range(math.ceil(math.log2(n_max)) if n_max > 1 else 0):
        d = d + d[anc]
        anc = anc[anc]
    return d[:N]


# --------------------------------------------------------------------------------------------------------------
# Normalisation: rule and warping parameters


def _per_request(name, value, B, device, *, integral=False, validate=True):
    """A Python scalar or a tensor [B] (or 0-dim) -> float32 [B] on device."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 1 or (value.dim() == 1 and value.numel() not in (1, B)):
            raise ValueError(f"{name}: expected a scalar or a tensor of shape [{B}], got shape {tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name}: expected a real number tensor, got {value.dtype}")
        if value.device != device:
            raise ValueError(f"{name}: expected a tensor on {device}, got {value.device}")
        if validate and integral and value.is_floating_point() and bool((value != value.round()).any()):
            raise ValueError(f"{name}: expected integers, got {value}")
        return value.to(torch.float32).reshape(-1).expand(B).contiguous()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number or a tensor, got {type(value).__name__}")
    if integral and math.isfinite(value) and value != int(value):
        raise ValueError(f"{name}: expected an integer, got {value}")
    return float(value)  # Python scalars stay on the host: one tensor for all of them (see _columns)


def _columns(cols, B, device, key):
    """float32 [B, len(cols)] from Python floats and / or float32 [B] tensors; all-scalar columns come from the
    ``constant_rows`` cache under ``key`` (no host-to-device copy per call). The kernels only read these tensors."""
    if not any(isinstance(c, torch.Tensor) for c in cols):
        return constant_rows(key, cols, B, device)
    return torch.stack([c if isinstance(c, torch.Tensor) else torch.full((B,), c, dtype=torch.float32, device=device)
                        for c in cols], dim=1)


def _scalars_key(what, values, B, device):
    """The cache key of a call whose parameters are all Python numbers (or None), else None. Exact types: True
    must not hit the entry of 1."""
    return (what, values, B, device) if all(type(v) in (int, float, type(None)) for v in values) else None


def _check(name, x, validate, **bounds):
    """Range check of a Python number (always: it reads nothing from the device) or of a tensor (with validate)."""
    if validate or not isinstance(x, torch.Tensor):
        check_range(name, x, **bounds)


# rule -> its parameters' bounds (check_range keywords), in schema column order
_RULE_BOUNDS = {"topk": ({"lo": 1},), "distance": ({"lo": 0},), "gad": ({"lo": 1}, {"lo": 0}),
                "typical": ({"lo": 0}, {"lo": 0}), "confidence": ({"lo": 0, "hi": 1, "lo_open": True},)}


def _rule_params(rule, B, device, given, validate):
    """float32 [B, 2] rule parameters (schema layout), with defaults and range checks."""
    key = _scalars_key(rule, tuple(given.values()), B, device)
    hit = None if key is None else constant_rows.get(key)  # an entry is only made after its values were checked
    if hit is not None:
        return hit
    names = _RULE_PARAMS[rule]
    for name, value in given.items():
        if value is not None and name not in names:
            raise ValueError(f"{name}: not a parameter of rule {rule!r} (its parameters: {names or 'none'})")
    if rule == "typical" and given["delta"] is None and given["eps"] is not None:
        # Medusa's default: posterior_alpha = sqrt(posterior_threshold).
        e = given["eps"]
        given = dict(given, delta=e.sqrt() if isinstance(e, torch.Tensor) else math.sqrt(e) if e >= 0 else e)
    cols = []
    for name, bounds in zip(names, _RULE_BOUNDS.get(rule, ())):
        if given[name] is None:
            raise ValueError(f"{name}: rule {rule!r} needs {' and '.join(names)}")
        cols.append(_per_request(name, given[name], B, device, integral=(rule, name) in (("topk", "k"),),
                                 validate=validate))
        _check(name, cols[-1], validate, **bounds)
    while len(cols) < 2:
        cols.append(0.0)
    return _columns(cols, B, device, key)


def _warp(B, device, temperature, top_k, top_p, min_p, validate):
    key = _scalars_key("warp", (temperature, top_k, top_p, min_p), B, device)
    hit = None if key is None else constant_rows.get(key)  # an entry is only made after its values were checked
    if hit is not None:
        return hit
    t = _per_request("temperature", temperature, B, device)
    k = _per_request("top_k", top_k, B, device, integral=True, validate=validate)
    p = _per_request("top_p", top_p, B, device)
    mp = _per_request("min_p", min_p, B, device)
    _check("temperature", t, validate, lo=0, hi=math.inf, hi_open=True)  # (as cdf_sample: inf is no warping)
    _check("top_k", k, validate, lo=0)
    _check("top_p", p, validate, lo=0, hi=1, lo_open=True)
    _check("min_p", mp, validate, lo=0, hi=1)
    return _columns([t, k, p, mp], B, device, key)


def _rule_options(rule, min_accept, root_tokens, B, V, device, validate):
    """Checks min_accept; root_tokens as int64 [B] of ids in [0, V) (rule 'confidence' only; the range checked with
    ``validate``, a device read) or None."""
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
    if root_tokens.dim() != 1 or root_tokens.numel() != B:
        raise ValueError(f"root_tokens: expected shape [B = {B}], got {tuple(root_tokens.shape)}")
    if validate and B and bool(((root_tokens < 0) | (root_tokens >= V)).any()):
        raise ValueError(f"root_tokens: expected token ids in [0, V = {V}), got {root_tokens[:4].tolist()}")
    return root_tokens.to(torch.int64)


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


def _uniforms(rule, u_sample, u_accept, seed, position, generator, cu_nodes, parents, depth, K, B, N, device,
              validate):
    """(u_sample float32 [N + B], u_accept float32 [N] or None): given, drawn from (seed, position), or drawn
    with ``generator`` (see ``verify``). ``depth``: node depths int64 [N], or None for chains, or the string
    "tree" for a tree whose depths are found on the device. K: the dense form's nodes per request, else None."""
    need_accept = rule == "speculative"
    if (seed is None) != (position is None):
        raise ValueError("seed, position: give both (seeded uniforms) or neither")
    if seed is not None:
        if isinstance(seed, int) and not isinstance(seed, bool):
            if not -(2**63) <= seed < 2**64:  # (as uniform: a 64-bit seed's bits, as int64)
                raise ValueError(f"seed: expected a 64-bit integer, got {seed}")
            seed = torch.full((B,), seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64, device=device)
        check_tensor("seed", seed, device, INT_DTYPES)
        check_tensor("position", position, device, INT_DTYPES)
        if seed.numel() not in (1, B) or position.numel() != B:
            raise ValueError(f"seed, position: expected shape [B = {B}], got {tuple(seed.shape)}, "
                             f"{tuple(position.shape)}")
        seed, position = _as(seed, torch.int64), _as(position, torch.int64)
        seed = seed if seed.dim() == 1 else seed.reshape(-1)  # [1] (every request's) or [B]
        position = position if position.dim() == 1 else position.reshape(B)
    given = [u_sample, u_accept]
    for i, (name, val, n) in enumerate((("u_sample", u_sample, N + B), ("u_accept", u_accept, N))):
        if val is None:
            continue
        if name == "u_accept" and not need_accept:
            raise ValueError(f"u_accept: only used by rule 'speculative', got rule {rule!r}")
        check_tensor(name, val, device, FLOAT_DTYPES)
        if val.numel() != n:
            raise ValueError(f"{name}: expected {n} values, got shape {tuple(val.shape)}")
        if validate and n:
            check_range(name, val, lo=0, hi=1, lo_open=True, hi_open=True)
        if val.dtype != torch.float32 or val.dim() != 1 or not val.is_contiguous():
            given[i] = val.reshape(-1).to(torch.float32).contiguous()
    u_sample, u_accept = given
    if seed is not None and (u_sample is None or (need_accept and u_accept is None)):
        # Every row's and node's uniform in one call (verify_uniforms; the layout: _seeded_layout)
        if K is not None and depth is None:  # equal chains: the layout depends on the shapes alone
            layout = constant_rows.build(("seeded chains", B, K, need_accept, device),
                                         lambda: _seeded_layout(cu_nodes, parents, None, K, B, N, need_accept, device))
        else:
            layout = _seeded_layout(cu_nodes, parents, depth, K if K is not None else N, B, N, need_accept, device)
        rows, nodes = dispatch.call("verify_uniforms", "auto", device, seed, position, *layout, N + B)
        u_sample = rows if u_sample is None else u_sample
        u_accept = nodes if need_accept and u_accept is None else u_accept
    if u_sample is None:
        u_sample = sample_v(N + B, generator=generator, device=device)
    if need_accept and u_accept is None:
        u_accept = sample_v(N, generator=generator, device=device)
    return u_sample, u_accept


def _seeded_layout(cu_nodes, parents, depth, n_max, B, N, need_accept, device):
    """(request, position offset, Philox stream), int64 [N + B (+ N with need_accept)] each, computed on the device:
    first every logits row (its request, its depth, stream 0), then every node (its request, depth - 1, stream 1 +
    its local index). ``depth`` as in ``_uniforms``; requests of at most n_max nodes."""
    node_request, local = _node_index(cu_nodes, N)
    if depth is None:  # chains: depth of local node j is j + 1
        node_depth = local + 1
    elif isinstance(depth, str):
        node_depth = _device_depth(parents, cu_nodes, N, n_max)
    else:
        node_depth = depth
    # Row order per request: the root row (depth 0), then the row of node j (depth(j)).
    row_request = torch.searchsorted(cu_nodes.long()[1:] + torch.arange(1, B + 1, device=device),
                                     torch.arange(N + B, device=device), right=True)
    row_depth = torch.zeros(N + B, dtype=torch.int64, device=device)
    row_depth[torch.arange(N, device=device) + node_request + 1] = node_depth  # node g's own row
    if not need_accept:
        return row_request, row_depth, torch.zeros_like(row_depth)
    return (torch.cat([row_request, node_request]), torch.cat([row_depth, node_depth - 1]),
            torch.cat([torch.zeros_like(row_depth), local + 1]))


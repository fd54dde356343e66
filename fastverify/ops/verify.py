"""Public API of ``verify``: validation, normalisation, random numbers and backend dispatch.

The backends implement one normalised signature (csrc/verify.cpp):

  torch   fastverify.reference.verify.verify        (the specification)
  cpp     torch.ops.fastverify.verify, CPU kernel    (csrc/cpu/verify.cpp)
  cuda    torch.ops.fastverify.verify, CUDA kernel   (csrc/cuda/verify.cu)
  triton  fastverify.kernels.verify.verify           (kernels/verify.py)
"""

import importlib.util
import math
import os
import time
from typing import NamedTuple

import torch

from fastverify import _ext
from fastverify.ops.sampling import _uniform_op, sample_v
from fastverify.reference import verify as _reference
from fastverify.reference.verify import DETERMINISTIC_RULES, RULES, SAMPLING_RULES

__all__ = ["RULES", "VerifyOutput", "verify"]

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

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


# --------------------------------------------------------------------------------------------------------------
# Backends


_HAS_KERNEL = {}  # dispatch key -> True once found (kernels do not disappear from a running process)
_FOUND_TRITON = [False, -1.0]  # [found, time of the last negative look-up]


def _has_compiled(dispatch_key: str) -> bool:
    if not _ext.HAS_CPP:
        return False
    if _HAS_KERNEL.get(dispatch_key):
        return True
    try:
        found = torch._C._dispatch_has_kernel_for_dispatch_key("fastverify::verify", dispatch_key)
    except RuntimeError:  # the schema is not registered (an old build of _C)
        found = False
    if found:
        _HAS_KERNEL[dispatch_key] = True
    return found


def _has_triton_module() -> bool:
    """Whether kernels/verify.py exists; positive answers are cached, negative ones re-checked once a second."""
    if _FOUND_TRITON[0]:
        return True
    now = time.monotonic()
    if now - _FOUND_TRITON[1] < 1.0:
        return False
    _FOUND_TRITON[0] = importlib.util.find_spec("fastverify.kernels.verify") is not None
    _FOUND_TRITON[1] = now
    return _FOUND_TRITON[0]


def _triton_verify():
    """fastverify.kernels.verify.verify (the module exists: see _has_triton_module)."""
    from fastverify.kernels import verify as triton_verify  # noqa: PLC0415  (triton is optional)

    return triton_verify.verify


def available_backends():
    """The backends whose verify code exists here (before checking the device): a tuple of names."""
    has = ["torch"]
    if _has_compiled("CPU"):
        has.append("cpp")
    if _ext.HAS_CUDA_KERNELS and _has_compiled("CUDA"):
        has.append("cuda")
    if _has_triton_module():
        has.append("triton")
    return tuple(has)


_RESOLVED = {}


def _resolve(backend, device):
    """_ext.resolve_backend, memoised per (backend, device type, implemented backends, TRITON_INTERPRET): its
    usability checks (package look-ups) cost more than a small verify call."""
    has = available_backends()
    key = (backend, device.type, has, os.environ.get("TRITON_INTERPRET"))
    if key not in _RESOLVED:
        _RESOLVED[key] = _ext.resolve_backend(backend, device, has=has)
    return _RESOLVED[key]


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


def _run(backend, args):
    if backend == "torch":
        return _reference.verify(*args)
    if backend == "triton":
        return _triton_verify()(*args)
    return torch.ops.fastverify.verify(*args)


# --------------------------------------------------------------------------------------------------------------
# Argument handling


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


def _check_range(name, t, lo=None, hi=None, lo_open=False, hi_open=False, what=None):
    if not isinstance(t, torch.Tensor):
        if not (math.isnan(t) or (lo is not None and (t <= lo if lo_open else t < lo))
                or (hi is not None and (t >= hi if hi_open else t > hi))):
            return
        t = torch.tensor([t], dtype=torch.float64)
    bad = torch.isnan(t)
    if lo is not None:
        bad |= (t <= lo) if lo_open else (t < lo)
    if hi is not None:
        bad |= (t >= hi) if hi_open else (t > hi)
    if bool(bad.any()):
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        rng = what or f"in {lb}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{rb}"
        raise ValueError(f"{name}: expected values {rng}, got {t[bad][:4].tolist()}")


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
            _check_range("k", cols[0], lo=1)
        elif rule == "distance":
            _check_range("eps", cols[0], lo=0)
        elif rule == "gad":
            _check_range("beta", cols[0], lo=1)
            _check_range("tau", cols[1], lo=0)
        elif rule == "typical":
            _check_range("eps", cols[0], lo=0)
            _check_range("delta", cols[1], lo=0)
        elif rule == "confidence":
            _check_range("beta", cols[0], lo=0, hi=1, lo_open=True)
    while len(cols) < 2:
        cols.append(0.0)
    return _columns(cols, B, device)


def _warp(B, device, temperature, top_k, top_p, min_p, validate):
    t = _per_request("temperature", temperature, B, device)
    k = _per_request("top_k", top_k, B, device, integral=True)
    p = _per_request("top_p", top_p, B, device)
    mp = _per_request("min_p", min_p, B, device)
    if validate:
        _check_range("temperature", t, lo=0)
        _check_range("top_k", k, lo=0)
        _check_range("top_p", p, lo=0, hi=1, lo_open=True)
        _check_range("min_p", mp, lo=0, hi=1)
    return _columns([t, k, p, mp], B, device)


def _check_tensor(name, t, device, dtypes=None, dim=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of logits), got {t.device}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-d tensor, got shape {tuple(t.shape)}")


_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _uniform(seed, position, stream):
    """uniform() on int64 tensors of one shape, unchecked; stream an int or a tensor of that shape (verify's
    streams, 0 and 1 + j, are in [0, 2^32) by construction)."""
    if isinstance(stream, int):
        stream = torch.full_like(position, stream)
    return _uniform_op(seed, position, stream)


def _rand_open(n, device, generator):
    """float32 [n] uniforms strictly inside (0, 1), drawn with ``generator`` on the grid ``uniform`` uses."""
    return sample_v(n, generator=generator, device=device)


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
    rule_idx = RULES.index(rule)
    _check_tensor("logits", logits, logits.device if isinstance(logits, torch.Tensor) else None, _LOGIT_DTYPES)
    device = logits.device
    _check_tensor("draft_tokens", draft_tokens, device, _INT_DTYPES)

    # ---- dense form -> ragged form
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
            _check_tensor("parents", parents, device, _INT_DTYPES)
            if parents.shape not in ((K,), (B, K)):
                raise ValueError(f"parents: dense form expects shape [{K}] or [{B}, {K}], got {tuple(parents.shape)}")
            parents = parents.expand(B, K).reshape(B * K)
        for name, val, shape in (("draft_probs", draft_probs, (B, K, V)), ("u_sample", u_sample, (B, K1)),
                                 ("u_accept", u_accept, (B, K))):
            if val is not None:
                _check_tensor(name, val, device)
                if tuple(val.shape) != shape:
                    raise ValueError(f"{name}: dense form expects shape {list(shape)}, got {tuple(val.shape)}")
        draft_probs = None if draft_probs is None else draft_probs.reshape(B * K, V)
        u_sample = None if u_sample is None else u_sample.reshape(B * K1)
        u_accept = None if u_accept is None else u_accept.reshape(B * K)
    else:
        _check_tensor("cu_nodes", cu_nodes, device, _INT_DTYPES, dim=1)
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
    counts = [b - a for a, b in zip(cu[:-1], cu[1:])]

    # ---- parents (chains materialised) and depths
    if parents is None:
        if B and len(set(counts)) == 1:  # equal chains (the dense form): built on the device, no host copy
            parents = (torch.arange(counts[0], dtype=torch.int32, device=device) - 1).repeat(B)
        else:
            parents = torch.tensor([j - 1 for c in counts for j in range(c)], dtype=torch.int32, device=device)
        max_depth = max(counts, default=0)
        depth = None  # computed on demand (seeded uniforms)
    else:
        _check_tensor("parents", parents, device, _INT_DTYPES, dim=1)
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
        max_depth = max(depth, default=0)

    # ---- parameters
    rule_params = _rule_params(rule, B, device, {"k": k, "eps": eps, "beta": beta, "tau": tau, "delta": delta},
                               validate)
    warp = _warp(B, device, temperature, top_k, top_p, min_p, validate)
    if isinstance(min_accept, bool) or not isinstance(min_accept, int) or min_accept < 0:
        raise ValueError(f"min_accept: expected an int >= 0, got {min_accept!r}")
    if min_accept and rule in SAMPLING_RULES:
        raise ValueError(f"min_accept: must be 0 for the sampling rule {rule!r} (forcing nodes would bias the "
                         f"sampled distribution), got {min_accept}")
    if root_tokens is not None:
        if rule != "confidence":
            raise ValueError(f"root_tokens: only used by rule 'confidence', got rule {rule!r}")
        _check_tensor("root_tokens", root_tokens, device, _INT_DTYPES)
        if root_tokens.numel() != B:
            raise ValueError(f"root_tokens: expected shape [B = {B}], got {tuple(root_tokens.shape)}")
        root_tokens = root_tokens.reshape(B).to(torch.int64)

    # ---- sampling inputs
    if rule in SAMPLING_RULES:
        if draft_probs is not None:
            if rule != "speculative":
                raise ValueError("draft_probs: only used by rule 'speculative'")
            _check_tensor("draft_probs", draft_probs, device, _FLOAT_DTYPES, dim=2)
            if tuple(draft_probs.shape) != (N, V):
                raise ValueError(f"draft_probs: expected shape [N, V] = [{N}, {V}], got {tuple(draft_probs.shape)}")
            if draft_probs.dtype == torch.float64:
                draft_probs = draft_probs.float()
            if draft_probs.stride(-1) != 1:
                draft_probs = draft_probs.contiguous()
            if validate and N and bool((~torch.isfinite(draft_probs) | (draft_probs < 0)).any()):
                raise ValueError("draft_probs: expected finite, non-negative probabilities")
        need_accept = rule == "speculative"
        if (seed is None) != (position is None):
            raise ValueError("seed, position: give both (seeded uniforms) or neither")
        if seed is not None:
            if isinstance(seed, int) and not isinstance(seed, bool):
                seed = torch.full((B,), seed, dtype=torch.int64, device=device)
            _check_tensor("seed", seed, device, _INT_DTYPES)
            _check_tensor("position", position, device, _INT_DTYPES)
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
            _check_tensor(name, val, device, _FLOAT_DTYPES)
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
                u_sample = _rand_open(N + B, device, generator)
        if need_accept and u_accept is None and N:
            if seed is not None:
                # local node j draws from Philox stream 1 + j: one call with a stream per node
                u_accept = _uniform(seed[node_request], position[node_request] + node_depth - 1, 1 + local)
            else:
                u_accept = _rand_open(N, device, generator)
        elif need_accept and u_accept is None:
            u_accept = torch.empty(0, dtype=torch.float32, device=device)
        u_sample = u_sample.reshape(-1).to(torch.float32).contiguous()
        if u_accept is not None:
            u_accept = u_accept.reshape(-1).to(torch.float32).contiguous()
        if validate:
            for name, val in (("u_sample", u_sample), ("u_accept", u_accept)):
                if val is not None and val.numel():
                    _check_range(name, val, lo=0, hi=1, lo_open=True, hi_open=True)
    else:
        for name, val in (("draft_probs", draft_probs), ("u_sample", u_sample), ("u_accept", u_accept),
                          ("seed", seed), ("position", position)):
            if val is not None:
                raise ValueError(f"{name}: only used by the sampling rules {SAMPLING_RULES}, got rule {rule!r}")
        draft_probs = u_sample = u_accept = None

    # ---- dispatch
    name = _resolve(backend, device)
    args = (logits, draft_tokens, cu_nodes, parents, rule_params, warp, draft_probs, u_sample, u_accept, root_tokens,
            rule_idx, min_accept, max_depth)
    accept_len, accepted, next_token = _run(name, args)
    if validate and B and bool((accept_len < 0).any()):
        bad = torch.nonzero(accept_len < 0).flatten().tolist()
        raise ValueError(f"logits: requests {bad[:8]} have rows with NaN or +inf, or a row that is entirely -inf"
                         + (" (or whose logits / temperature overflow float32)" if rule in SAMPLING_RULES else ""))
    return VerifyOutput(accept_len, accepted, next_token)

"""Reference (executable specification) of the sampling ops: Philox uniforms, warping, inverse-CDF sampling
and its inverse (PTP), and the auxiliary-variable bits.

Schemas: csrc/sampling.cpp. Every fast backend (csrc/cpu/sampling.cpp + csrc/sampling.h, kernels/sampling.py,
csrc/cuda/sampling.cu) is tested against these functions.

Warping (the same in every backend and in ``verify``'s sampling rules). ``warp`` is float32 [R, 4] holding
(temperature T, top_k k, top_p p, min_p) per row; l is a logits row of V entries.

1. Temperature. T > 0: l' = l / T, computed in float32 (a division, not a multiplication by 1 / T).
   T == 0 means greedy: the row's distribution is one-hot at argmax l (ties -> lowest token id).
2. top_k. k == 0 or k >= V: off. Otherwise keep the tokens with l' >= the k-th largest l' (ties at the
   threshold are kept, as transformers' TopKLogitsWarper).
3. top_p. p == 1: off; p in (0, 1). On the top-k-kept set, with w = exp(l' - m), keep token i iff
   sum_{j kept, w_j > w_i} w_j < p * Z_k  (Z_k = sum of w over the top-k-kept set, float64 sums).
   Equal weights are kept or dropped together; the top token is always kept (its left side is 0).
   This is the nucleus of Holtzman et al. (and transformers' TopPLogitsWarper up to its tie handling).
4. min_p. 0: off; in [0, 1]. Keep i iff w_i >= min_p (w of the top token is exp(0) = 1, so this is
   p_i >= min_p * p_max as in transformers' MinPLogitsWarper).
5. Weights w_i = exp(l'_i - m) in float32 on the kept tokens, 0 elsewhere, m = max l' (the top token is
   kept by every filter). Sampling uses float64 prefix sums of w in token-id order: C(t) = sum_{i <= t} w_i,
   Z = C(V - 1).

cdf_sample(u) returns the smallest t with C(t) > u * Z (PTP Eq. 8: the inverse CDF); cdf_invert(t, v)
returns u = (C(t - 1) + v * w(t)) / Z (PTP Eq. 9), nudged by float64 ulps so that cdf_sample(u) == t.

Invalid rows (NaN or +inf anywhere in the row, every entry -inf, or l / T overflowing float32 to +inf) have
no distribution: ``sample_from_weights`` returns -1 and ``cdf_invert`` NaN for them; the Python API turns
that into an error naming ``logits``.
"""

import torch

__all__ = [
    "philox4x32_10",
    "uniform",
    "verify_uniforms",
    "warp_weights",
    "sample_from_weights",
    "cdf_sample",
    "cdf_invert",
    "aux_bits",
    "invalid_rows",
]

_M32 = 0xFFFFFFFF
# Philox 4x32 round multipliers and Weyl key increments (Salmon et al., "Parallel random numbers: as easy as
# 1, 2, 3", SC'11; Random123's philox.h).
_PHILOX_M0 = 0xD2511F53
_PHILOX_M1 = 0xCD9E8D57
_PHILOX_W0 = 0x9E3779B9
_PHILOX_W1 = 0xBB67AE85


def _mulhilo32(a, b):
    """(hi, lo) 32-bit halves of the 64-bit product of two uint32 values held in int64 tensors.

    a * b can reach 2^64 - 2^33 + 1, which overflows int64; split a into 16-bit halves so every partial
    product stays below 2^48."""
    a_lo = a & 0xFFFF
    a_hi = a >> 16
    p_lo = a_lo * b  # < 2^48
    p_hi = a_hi * b  # < 2^48; the full product is p_hi * 2^16 + p_lo
    lo = (p_lo + ((p_hi & 0xFFFF) << 16)) & _M32
    hi = (p_hi + (p_lo >> 16)) >> 16
    return hi & _M32, lo


def philox4x32_10(counter, key):
    """Philox 4x32-10 block function, in int64 torch arithmetic with 32-bit masks.

    Args:
        counter: int64 [..., 4], each entry in [0, 2^32).
        key: int64 [..., 2], each entry in [0, 2^32) (broadcast against counter's leading dims).
    Returns:
        int64 [..., 4], the four output words in [0, 2^32).
    """
    c0, c1, c2, c3 = (counter[..., i].to(torch.int64) & _M32 for i in range(4))
    k0 = key[..., 0].to(torch.int64) & _M32
    k1 = key[..., 1].to(torch.int64) & _M32
    for r in range(10):
        if r > 0:
            k0 = (k0 + _PHILOX_W0) & _M32
            k1 = (k1 + _PHILOX_W1) & _M32
        hi0, lo0 = _mulhilo32(torch.full_like(c0, _PHILOX_M0), c0)
        hi1, lo1 = _mulhilo32(torch.full_like(c2, _PHILOX_M1), c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack(torch.broadcast_tensors(c0, c1, c2, c3), dim=-1)


def uniform(seed, position, stream):
    """Counter-based uniforms in the open interval (0, 1).

    Args:
        seed: int64 [R] (any int64 value; its two's-complement bits are the Philox key).
        position: int64 [R] (absolute sequence position).
        stream: int, or int64 tensor broadcastable to position, in [0, 2^32).
    Returns:
        float32 [R]: ((x >> 9) + 0.5) * 2^-23, exact in float32 and in [2^-24, 1 - 2^-24], with x the first
        output word of Philox 4x32-10 under key (seed low 32 bits, seed high 32 bits) and counter (position
        low, position high, stream, 0).
    """
    seed = seed.to(torch.int64)
    position = position.to(torch.int64)
    key = torch.stack([seed & _M32, (seed >> 32) & _M32], dim=-1)
    stream_t = (torch.as_tensor(stream, dtype=torch.int64, device=position.device) & _M32).expand(position.shape)
    counter = torch.stack([position & _M32, (position >> 32) & _M32, stream_t, torch.zeros_like(position)], -1)
    x = philox4x32_10(counter, key)[..., 0]
    return (((x >> 9).to(torch.float64) + 0.5) * 2.0**-23).to(torch.float32)


def verify_uniforms(seed, position, request, offset, stream, rows):
    """verify's seeded draws in one call: u[i] = uniform(seed[request[i]], position[request[i]] + offset[i],
    stream[i]) for int64 seed [B] (or [1]: every request's), position [B], request / offset / stream [M];
    returns (u[:rows], u[rows:]), float32."""
    if not 0 <= rows <= request.numel():
        raise ValueError(f"rows: expected a value in [0, {request.numel()}], got {rows}")
    seed = seed.reshape(-1).expand(position.numel())
    u = uniform(seed[request], position[request] + offset, stream)
    return u[:rows], u[rows:]


def invalid_rows(logits, warp):
    """bool [R]: rows without a distribution (NaN or +inf, all -inf, or l / T overflowing to +inf)."""
    x = logits.float()
    bad = torch.isnan(x).any(-1) | torch.isposinf(x).any(-1) | torch.isneginf(x).all(-1)
    temp = warp[:, 0].float()
    safe_t = torch.where(temp > 0, temp, torch.ones_like(temp))
    scaled_max = x.max(-1).values / safe_t
    return bad | ((temp > 0) & torch.isposinf(scaled_max))


def warp_weights(logits, warp):
    """Unnormalised warped weights (steps 1-5 of the module docstring).

    Args:
        logits: [R, V] float32 / bfloat16 / float16.
        warp: float32 [R, 4]: (temperature, top_k, top_p, min_p) per row, already validated.
    Returns:
        float32 [R, V]: w = exp(l / T - m) on the kept tokens, 0 elsewhere. Rows with temperature 0 get
        the one-hot weights of their argmax (callers may also take the argmax themselves). Invalid rows
        (see ``invalid_rows``) are all zero.
    """
    R, V = logits.shape
    x = logits.float()
    temp, top_k, top_p, min_p = (warp[:, i].float() for i in range(4))
    greedy = temp == 0
    safe_t = torch.where(greedy, torch.ones_like(temp), temp)

    # 1. temperature, in float32 like every backend.
    scaled = x / safe_t[:, None]
    keep = torch.ones_like(scaled, dtype=torch.bool)

    # 2. top-k: keep l' >= the k-th largest l' (ties kept). Sorting is fine here: this is the readable spec.
    k = top_k.to(torch.int64)
    use_k = (k > 0) & (k < V)
    if bool(use_k.any()):
        desc = scaled.sort(dim=-1, descending=True).values
        kth = desc.gather(1, (k.clamp(1, V) - 1)[:, None])
        keep &= ~use_k[:, None] | (scaled >= kth)

    m = scaled.max(dim=-1, keepdim=True).values
    w = torch.exp(scaled - m)  # float32, as every backend computes it
    w = torch.where(keep, w, torch.zeros_like(w))

    # 3. top-p on the top-k-kept set: the mass strictly above w_i must stay below p * Z_k.
    use_p = top_p < 1
    if bool(use_p.any()):
        w_desc = w.sort(dim=-1, descending=True).values
        csum = w_desc.double().cumsum(dim=-1)
        excl = torch.cat([torch.zeros_like(csum[:, :1]), csum[:, :-1]], dim=-1)  # mass of the earlier ranks
        # Mass strictly above w_i = excl at the first rank holding the value w_i = #{j: w_j > w_i}.
        n_greater = torch.searchsorted(-w_desc.contiguous(), -w.contiguous(), right=False)
        greater_mass = excl.gather(1, n_greater.clamp(max=V - 1))
        z_k = csum[:, -1:]
        keep_p = greater_mass < top_p.double()[:, None] * z_k
        w = torch.where(use_p[:, None] & ~keep_p, torch.zeros_like(w), w)

    # 4. min-p: w_max = 1, so w_i >= min_p is p_i >= min_p * p_max.
    w = torch.where(w >= min_p[:, None], w, torch.zeros_like(w))

    # Temperature 0: one-hot at the argmax (torch.argmax returns the first maximal index).
    if bool(greedy.any()):
        onehot = torch.zeros_like(w)
        onehot.scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
        w = torch.where(greedy[:, None], onehot, w)

    bad = invalid_rows(logits, warp)
    return torch.where(bad[:, None], torch.zeros_like(w), w)


def sample_from_weights(w, u):
    """Inverse-CDF sampling from unnormalised weights.

    Args:
        w: [R, V] float32 or float64, non-negative weights.
        u: [R] float32 or float64 in (0, 1).
    Returns:
        int64 [R]: the smallest t with C(t) > u * Z, C the float64 prefix sum of w in token-id order and
        Z = C(V - 1); if rounding leaves no such t, the last token with w > 0; -1 for a row whose Z is 0.
    """
    csum = w.double().cumsum(dim=-1)
    z = csum[:, -1]
    target = u.double() * z
    t = torch.searchsorted(csum, target[:, None], right=True)[:, 0]
    V = w.shape[-1]
    idx = torch.arange(V, device=w.device).expand_as(w)
    last_pos = torch.where(w > 0, idx, torch.full_like(idx, -1)).max(dim=-1).values
    t = torch.where(t >= V, last_pos, t)
    return torch.where(z > 0, t, torch.full_like(t, -1))


def cdf_sample(logits, u, warp):
    """int64 [R]: inverse-CDF sample of each warped row (schema in csrc/sampling.cpp).

    logits [R, V] fp32/bf16/fp16; u float32/float64 [R] in (0, 1); warp float32 [R, 4]. -1 for invalid rows."""
    return sample_from_weights(warp_weights(logits, warp), u)


def _nextafter(x, toward):
    return torch.nextafter(x, torch.full_like(x, toward))


def cdf_invert(logits, token, v, warp):
    """float64 [R]: the auxiliary variable u with cdf_sample(u) == token (PTP Eq. 9).

    Args:
        logits: [R, V] fp32/bf16/fp16. token: int64 [R] in [0, V). v: float [R] in (0, 1).
        warp: float32 [R, 4].
    Returns:
        float64 [R]: u = (C(t - 1) + v * w(t)) / Z, then moved by float64 ulps until C(t - 1) <= u * Z < C(t)
        holds in float64 (which is what cdf_sample tests), clamped to the open interval (0, 1). NaN where
        w(t) = 0 (t not sampleable), where the bin of t is absorbed in float64 (C(t) == C(t - 1)) or where
        no float64 u lands in it, and for invalid rows.
    """
    w = warp_weights(logits, warp).double()
    csum = w.cumsum(dim=-1)
    z = csum[:, -1]
    t = token.to(torch.int64)[:, None]
    c_hi = csum.gather(1, t)[:, 0]
    w_t = w.gather(1, t)[:, 0]
    c_lo = torch.where(token > 0, csum.gather(1, (t - 1).clamp(min=0))[:, 0], torch.zeros_like(z))
    u = (c_lo + v.double() * w_t) / z
    u = u.clamp(min=torch.finfo(torch.float64).tiny, max=1.0 - 2.0**-53)
    # Nudge: a handful of ulps always suffices when the bin holds a representable u * Z (the division and
    # the product each round once); give up (NaN) otherwise.
    for _ in range(64):
        prod = u * z
        low = prod < c_lo
        high = prod >= c_hi
        if not bool((low | high).any()):
            break
        u = torch.where(low, _nextafter(u, 1.0), torch.where(high, _nextafter(u, 0.0), u))
    prod = u * z
    ok = (w_t > 0) & (c_hi > c_lo) & (prod >= c_lo) & (prod < c_hi) & (u > 0) & (u < 1) & (z > 0)
    return torch.where(ok, u, torch.full_like(u, float("nan")))


def aux_bits(u):
    """float32 [R, 32]: the IEEE-754 bits of float32 u, most significant first (PTP §3.1)."""
    bits = u.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & _M32
    shifts = torch.arange(31, -1, -1, device=u.device, dtype=torch.int64)
    return ((bits[..., None] >> shifts) & 1).to(torch.float32)

"""Triton kernels of the sampling ops: Philox uniforms, aux_bits, inverse-CDF sampling and its inverse (PTP).

Schemas: csrc/sampling.cpp; specification: fastverify/reference/sampling.py (its docstring defines the warping:
temperature, top-k, top-p, min-p, greedy at temperature 0, invalid rows). Each public function takes the
normalised arguments of its schema and is registered as the torch op ``fastverify::<op>_triton``.

cdf_sample / cdf_invert: one program per row, several streaming passes over the V logits of the row, BLOCK_V
at a time, none of which sorts:

  1. prologue: max and argmax (lowest id) of the row, NaN / +inf / all -inf check;
  2. top-k (when on): the k-th largest l / T by binary search over the order-preserving int32 keys of the
     float32 values (count of keys >= mid, ~32 passes): exact, ties at the threshold kept;
  3. top-p (when on): the smallest kept weight by binary search over the int32 keys of w = exp(l / T - m) >= 0,
     testing "mass strictly above < p * Z_k" with float64 sums (~30 passes): exact up to the order of the
     float64 sums;
  4. the cumulative distribution C(t): float64, token-id order, C(t) = (sum of the earlier BLOCK_V blocks'
     totals, added one block at a time) + (in-block inclusive scan). ``_cdf_total`` and ``_cdf_find`` /
     ``_cdf_bounds`` evaluate exactly this expression with the same BLOCK_V, so cdf_sample(cdf_invert(t)) == t
     on this backend. Because a parallel scan need not be monotone to the last ulp, cdf_invert bounds u * Z
     below by the running maximum of C over all tokens before t (not just C(t - 1)), which is what makes
     "the smallest t with C(t) > u Z" land on t.
     The association order of tl.cumsum follows the register layout the compiler gives the block, and that
     layout follows what it can prove of the row pointer's alignment (16-byte vector loads or scalar ones).
     A row stride specialised as "divisible by 16" in one kernel and not in the other (seen on an H100:
     cdf_invert on an expanded row, stride 0, then cdf_sample on a compacted copy, stride 1000) gave the
     two kernels different scans and broke the round trip by float64 ulps. So every kernel that evaluates C
     takes its row stride unspecialised (``do_not_specialize``): the same alignment, layout and sums in each.

The helpers here (``_row_prologue``, ``_warp_params``, ``_warped_block``, ``_cdf_*``) are reused by the
sampling rules of kernels/verify.py so verify's draws are exactly this backend's cdf_sample draws.

Arithmetic matching the reference: l / T uses IEEE division (tl.math.div_rn), comparisons are on float32
values, sums are float64. exp is Triton's float32 exp, which may differ from torch's by an ulp; that moves a
draw only when u falls within an ulp of a CDF boundary.
"""

import torch
import triton
import triton.language as tl

from ._common import next_pow2, philox_uniform

# One BLOCK_V for every CDF evaluation of a given V: cdf_sample and cdf_invert must add in the same order.
CDF_BLOCK_V = 1024


def cdf_block_v(V: int) -> int:
    return min(next_pow2(V, 16), CDF_BLOCK_V)


# --------------------------------------------------------------------------------------------------------
# uniform
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _uniform_kernel(seed_ptr, position_ptr, stream_ptr, out_ptr, R, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < R
    seed = tl.load(seed_ptr + offs, mask=ok, other=0)
    position = tl.load(position_ptr + offs, mask=ok, other=0)
    stream = tl.load(stream_ptr + offs, mask=ok, other=0)
    tl.store(out_ptr + offs, philox_uniform(seed, position, stream), mask=ok)


@torch.library.custom_op("fastverify::uniform_triton", mutates_args=())
def uniform(seed: torch.Tensor, position: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """seed, position, stream int64 [R] (stream in [0, 2^32), validated by fastverify.uniform) -> float32 [R] in
    (0, 1): Philox 4x32-10 (csrc/sampling.cpp), bit-identical to the reference."""
    assert seed.dtype == position.dtype == stream.dtype == torch.int64, "uniform: seed/position/stream must be int64"
    shape = position.shape
    seed = seed.expand(shape).reshape(-1).contiguous()
    stream = stream.expand(shape).reshape(-1).contiguous()
    position = position.reshape(-1).contiguous()
    R = position.numel()
    out = torch.empty(R, dtype=torch.float32, device=position.device)
    if R:
        BLOCK = 1024
        _uniform_kernel[(triton.cdiv(R, BLOCK),)](seed, position, stream, out, R, BLOCK=BLOCK)
    return out.reshape(shape)


@uniform.register_fake
def _(seed, position, stream):
    return torch.empty_like(position, dtype=torch.float32)


@triton.jit
def _aux_bits_kernel(u_ptr, out_ptr, R, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < R
    bits = tl.load(u_ptr + rows, mask=ok, other=0.0).to(tl.int32, bitcast=True)
    j = tl.arange(0, 32)
    bit = (bits[:, None] >> (31 - j)[None, :]) & 1  # arithmetic shift; & 1 keeps the one bit, sign bit first
    tl.store(out_ptr + rows[:, None] * 32 + j[None, :], bit.to(tl.float32), mask=ok[:, None])


@torch.library.custom_op("fastverify::aux_bits_triton", mutates_args=())
def aux_bits(u: torch.Tensor) -> torch.Tensor:
    """u float32 [R] -> float32 [R, 32]: the IEEE-754 bits of u, most significant first (PTP §3.1)."""
    assert u.dtype == torch.float32 and u.dim() == 1, "aux_bits: u must be float32 [R]"
    u = u.contiguous()
    R = u.numel()
    out = torch.empty((R, 32), dtype=torch.float32, device=u.device)
    if R:
        BLOCK = 64
        _aux_bits_kernel[(triton.cdiv(R, BLOCK),)](u, out, R, BLOCK=BLOCK)
    return out


@aux_bits.register_fake
def _(u):
    return u.new_empty((u.shape[0], 32))


# --------------------------------------------------------------------------------------------------------
# warping helpers (device functions)
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _order_key(x):
    """float32 block -> int32 block with the same order (-0.0 folded onto +0.0; no NaN expected)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _row_prologue(row_ptr, V, BLOCK_V: tl.constexpr):
    """(max, argmax with the lowest id, bad) of one logits row; bad = NaN or +inf anywhere, or all -inf."""
    cols0 = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_id = tl.full([BLOCK_V], 2147483647, tl.int32)
    bad = tl.zeros([BLOCK_V], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + cols0
        x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        bad = bad | ((x != x) | (x == float("inf"))).to(tl.int32)
        better = x > best  # strict: an earlier block keeps its (lower) id on ties
        best_id = tl.where(better, cols, best_id)
        best = tl.where(better, x, best)
    xmax = tl.max(best, axis=0)
    arg = tl.min(tl.where(best == xmax, best_id, 2147483647), axis=0)
    # All -inf: every lane kept the initial id, and no token is sampleable.
    is_bad = (tl.max(bad, axis=0) > 0) | (xmax == float("-inf"))
    arg = tl.where(arg >= V, 0, arg)
    return xmax, arg, is_bad


@triton.jit
def _scaled(x, temp):
    """l / T in float32 with IEEE division (temp > 0; greedy rows pass 1)."""
    return tl.math.div_rn(x, temp)


@triton.jit
def _warp_params(row_ptr, V, temp, top_k, top_p, xmax, BLOCK_V: tl.constexpr):
    """Thresholds of one row. Returns (m, kkey, pkey): m = max l / T; keep a token iff
    order_key(l / T) >= kkey and int32 bits of w >= pkey (w = exp(l / T - m), zeroed off the top-k set)."""
    cols0 = tl.arange(0, BLOCK_V)
    greedy = temp == 0.0
    t = tl.where(greedy, 1.0, temp)
    m = _scaled(xmax, t)  # division by T > 0 is monotone, so max(l / T) = max(l) / T exactly
    k = top_k.to(tl.int32)
    kkey = tl.full([], -2147483648, tl.int32)  # INT32_MIN: keep everything
    if (k > 0) & (k < V) & (greedy == 0):
        # Largest key K with #{key >= K} >= k: the k-th largest value's key.
        lo = tl.full([], -2147483648, tl.int64)
        hi = _order_key(m).to(tl.int64)
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            cnt = tl.zeros([], tl.int32)
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + cols0
                x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
                key = _order_key(_scaled(x, t)).to(tl.int64)
                cnt += tl.sum(((key >= mid) & (cols < V)).to(tl.int32), axis=0)
            if cnt >= k:
                lo = mid
            else:
                hi = mid - 1
        kkey = lo.to(tl.int32)
    pkey = tl.zeros([], tl.int32)  # w >= 0 always: keep everything
    if (top_p < 1.0) & (greedy == 0):
        zk = tl.zeros([BLOCK_V], tl.float64)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + cols0
            x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            s = _scaled(x, t)
            w = tl.where((_order_key(s) >= kkey) & (cols < V), tl.exp(s - m), 0.0)
            zk += w.to(tl.float64)
        limit = top_p.to(tl.float64) * tl.sum(zk, axis=0)
        # Smallest key K of w with mass(key(w) > K) < p * Z_k; G(-1) = Z_k >= limit, G(key(1.0)) = 0 < limit.
        lo2 = tl.full([], -1, tl.int32)
        hi2 = tl.full([], 0x3F800000, tl.int32)
        while hi2 - lo2 > 1:
            mid2 = lo2 + (hi2 - lo2) // 2
            g = tl.zeros([BLOCK_V], tl.float64)
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + cols0
                x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
                s = _scaled(x, t)
                w = tl.where((_order_key(s) >= kkey) & (cols < V), tl.exp(s - m), 0.0)
                g += tl.where(w.to(tl.int32, bitcast=True) > mid2, w, 0.0).to(tl.float64)
            if tl.sum(g, axis=0) < limit:
                hi2 = mid2
            else:
                lo2 = mid2
        pkey = hi2
    return m, kkey, pkey


@triton.jit
def _warped_block(x, cols, V, temp, min_p, m, kkey, pkey, arg, bad):
    """float32 warped weights of a block of logits x (float32) at token ids cols."""
    greedy = temp == 0.0
    t = tl.where(greedy, 1.0, temp)
    s = _scaled(x, t)
    w = tl.exp(s - m)
    keep = (_order_key(s) >= kkey) & (cols < V)
    keep = keep & (w.to(tl.int32, bitcast=True) >= pkey) & (w >= min_p)
    w = tl.where(keep, w, 0.0)
    w = tl.where(greedy, tl.where(cols == arg, 1.0, 0.0), w)
    return tl.where(bad, 0.0, w)


@triton.jit
def _row_state(row_ptr, V, warp_ptr, BLOCK_V: tl.constexpr):
    """Everything a row's warped weights depend on: (temp, min_p, m, kkey, pkey, arg, bad)."""
    temp = tl.load(warp_ptr + 0)
    top_k = tl.load(warp_ptr + 1)
    top_p = tl.load(warp_ptr + 2)
    min_p = tl.load(warp_ptr + 3)
    xmax, arg, bad = _row_prologue(row_ptr, V, BLOCK_V)
    # l / T overflowing to +inf leaves no distribution either (reference invalid_rows).
    bad = bad | ((temp > 0.0) & (_scaled(xmax, tl.where(temp > 0.0, temp, 1.0)) == float("inf")))
    # Computed for bad rows too (their weights are zeroed): every search is bounded, so this terminates.
    m, kkey, pkey = _warp_params(row_ptr, V, temp, top_k, top_p, xmax, BLOCK_V)
    return temp, min_p, m, kkey, pkey, arg, bad


# --------------------------------------------------------------------------------------------------------
# the cumulative distribution (shared by cdf_sample, cdf_invert and verify)
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _block_weights(row_ptr, v0, V, temp, min_p, m, kkey, pkey, arg, bad, BLOCK_V: tl.constexpr):
    cols = v0 + tl.arange(0, BLOCK_V)
    x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    return cols, _warped_block(x, cols, V, temp, min_p, m, kkey, pkey, arg, bad).to(tl.float64)


@triton.jit
def _block_last(cs, BLOCK_V: tl.constexpr):
    """The last element of a block (exactly: the other lanes add zeros)."""
    return tl.sum(tl.where(tl.arange(0, BLOCK_V) == BLOCK_V - 1, cs, 0.0), axis=0)


@triton.jit
def _cdf_total(row_ptr, V, temp, min_p, m, kkey, pkey, arg, bad, BLOCK_V: tl.constexpr):
    """(Z, last token with w > 0 or -1): Z = the blockwise float64 sum that C(t) is built from."""
    base = tl.zeros([], tl.float64)
    last = tl.full([], -1, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols, w = _block_weights(row_ptr, v0, V, temp, min_p, m, kkey, pkey, arg, bad, BLOCK_V)
        base = base + _block_last(tl.cumsum(w, axis=0), BLOCK_V)
        last = tl.maximum(last, tl.max(tl.where(w > 0.0, cols, -1), axis=0))
    return base, last


@triton.jit
def _block_find(w, cols, V, base, target, BLOCK_V: tl.constexpr):
    """One block of an inverse-CDF search over weights w at columns cols, base = the sum of the blocks before:
    (the smallest column < V with base + its inclusive prefix sum > target, or -1; base plus this block's sum)."""
    cs = tl.cumsum(w, axis=0)
    f = tl.min(tl.where(((base + cs) > target) & (cols < V), cols, 2147483647), axis=0)
    return tl.where(f == 2147483647, -1, f), base + _block_last(cs, BLOCK_V)


@triton.jit
def _cdf_find(row_ptr, V, temp, min_p, m, kkey, pkey, arg, bad, target, last, BLOCK_V: tl.constexpr):
    """Smallest t with C(t) > target; `last` (the last token with w > 0) when rounding leaves none."""
    base = tl.zeros([], tl.float64)
    found = tl.full([], -1, tl.int32)
    v0 = 0
    while (found < 0) & (v0 < V):
        cols, w = _block_weights(row_ptr, v0, V, temp, min_p, m, kkey, pkey, arg, bad, BLOCK_V)
        found, base = _block_find(w, cols, V, base, target, BLOCK_V)
        v0 += BLOCK_V
    return tl.where(found < 0, last, found)


@triton.jit
def _cdf_bounds(row_ptr, V, temp, min_p, m, kkey, pkey, arg, bad, tok, BLOCK_V: tl.constexpr):
    """(c_lo, c_hi, w_t) of token tok: c_lo = max(0, C(t') for every t' < tok), c_hi = C(tok), w_t = w(tok)."""
    base = tl.zeros([], tl.float64)
    c_lo = tl.zeros([], tl.float64)
    c_hi = tl.zeros([], tl.float64)
    w_t = tl.zeros([], tl.float64)
    v0 = 0
    while v0 <= tok:
        cols, w = _block_weights(row_ptr, v0, V, temp, min_p, m, kkey, pkey, arg, bad, BLOCK_V)
        cs = tl.cumsum(w, axis=0)
        c = base + cs
        c_lo = tl.maximum(c_lo, tl.max(tl.where(cols < tok, c, 0.0), axis=0))
        c_hi = c_hi + tl.sum(tl.where(cols == tok, c, 0.0), axis=0)
        w_t = w_t + tl.sum(tl.where(cols == tok, w, 0.0), axis=0)
        base = base + _block_last(cs, BLOCK_V)
        v0 += BLOCK_V
    return c_lo, c_hi, w_t


@triton.jit
def _sample_row(row_ptr, V, warp_ptr, u, BLOCK_V: tl.constexpr):
    """cdf_sample of one row with the uniform u (float64 scalar): token id, or -1 for an invalid row."""
    temp, min_p, m, kkey, pkey, arg, bad = _row_state(row_ptr, V, warp_ptr, BLOCK_V)
    z, last = _cdf_total(row_ptr, V, temp, min_p, m, kkey, pkey, arg, bad, BLOCK_V)
    tok = _cdf_find(row_ptr, V, temp, min_p, m, kkey, pkey, arg, bad, u * z, last, BLOCK_V)
    return tl.where(bad | (z <= 0.0), -1, tok)


# --------------------------------------------------------------------------------------------------------
# kernels and ops
# --------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_r"])
def _cdf_sample_kernel(logits_ptr, stride_r, u_ptr, warp_ptr, out_ptr, V, BLOCK_V: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    u = tl.load(u_ptr + r).to(tl.float64)
    tl.store(out_ptr + r, _sample_row(logits_ptr + r * stride_r, V, warp_ptr + r * 4, u, BLOCK_V).to(tl.int64))


@triton.jit
def _next_down(x):
    return (x.to(tl.int64, bitcast=True) - 1).to(tl.float64, bitcast=True)


@triton.jit
def _next_up(x):
    return (x.to(tl.int64, bitcast=True) + 1).to(tl.float64, bitcast=True)


@triton.jit(do_not_specialize=["stride_r"])
def _cdf_invert_kernel(logits_ptr, stride_r, token_ptr, v_ptr, warp_ptr, out_ptr, V, BLOCK_V: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + r * stride_r
    tok = tl.load(token_ptr + r)
    tok = tl.where((tok >= 0) & (tok < V), tok, 0).to(tl.int32)
    v = tl.load(v_ptr + r).to(tl.float64)
    temp, min_p, m, kkey, pkey, arg, bad = _row_state(row_ptr, V, warp_ptr + r * 4, BLOCK_V)
    z, last = _cdf_total(row_ptr, V, temp, min_p, m, kkey, pkey, arg, bad, BLOCK_V)
    c_lo, c_hi, w_t = _cdf_bounds(row_ptr, V, temp, min_p, m, kkey, pkey, arg, bad, tok, BLOCK_V)
    zs = tl.where(z > 0.0, z, 1.0)
    u = (c_lo + v * w_t) / zs
    u = tl.minimum(tl.maximum(u, 2.2250738585072014e-308), 1.0 - 1.1102230246251565e-16)
    # Nudge by float64 ulps until C(t') <= u Z for all t' < t and u Z < C(t), the test cdf_sample makes.
    it = tl.zeros([], tl.int32)
    prod = u * zs
    while ((prod < c_lo) | (prod >= c_hi)) & (it < 64):
        u = tl.where(prod < c_lo, _next_up(u), _next_down(u))
        prod = u * zs
        it += 1
    ok = (w_t > 0.0) & (c_hi > c_lo) & (prod >= c_lo) & (prod < c_hi) & (u > 0.0) & (u < 1.0) & (z > 0.0)
    ok = ok & (bad == 0)
    tl.store(out_ptr + r, tl.where(ok, u, float("nan")))


def _rows(logits):
    assert logits.dim() == 2, "logits must be [R, V]"
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return logits


@torch.library.custom_op("fastverify::cdf_sample_triton", mutates_args=())
def cdf_sample(logits: torch.Tensor, u: torch.Tensor, warp: torch.Tensor) -> torch.Tensor:
    """logits [R, V] fp32/bf16/fp16, u float32/float64 [R] in (0, 1), warp float32 [R, 4] -> int64 [R]
    (-1 for a row without a distribution)."""
    logits = _rows(logits)
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if R == 0:
        return out
    if V == 0:
        return out.fill_(-1)
    _cdf_sample_kernel[(R,)](logits, logits.stride(0), u.contiguous(), warp.float().contiguous(), out, V,
                             BLOCK_V=cdf_block_v(V))
    return out


@cdf_sample.register_fake
def _(logits, u, warp):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@torch.library.custom_op("fastverify::cdf_invert_triton", mutates_args=())
def cdf_invert(logits: torch.Tensor, token: torch.Tensor, v: torch.Tensor, warp: torch.Tensor) -> torch.Tensor:
    """logits [R, V] fp32/bf16/fp16, token int64 [R], v float [R] in (0, 1), warp float32 [R, 4] ->
    float64 [R]: u with cdf_sample(u) == token on this backend, NaN where token has weight 0."""
    logits = _rows(logits)
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.float64, device=logits.device)
    if R == 0:
        return out
    if V == 0:
        return out.fill_(float("nan"))
    _cdf_invert_kernel[(R,)](logits, logits.stride(0), token.to(torch.int64).contiguous(), v.contiguous(),
                             warp.float().contiguous(), out, V, BLOCK_V=cdf_block_v(V))
    return out


@cdf_invert.register_fake
def _(logits, token, v, warp):
    return logits.new_empty((logits.shape[0],), dtype=torch.float64)

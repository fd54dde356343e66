"""Helpers shared by the Triton kernels: Philox 4x32-10, launch utilities.

Everything here is either a ``@triton.jit`` device function (inlined into the kernels that call it) or a tiny
host helper. No op lives here.
"""

import triton
import triton.language as tl

# Philox 4x32-10 constants (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; Random123).
PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox 4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1); all uint32 blocks of one shape.

    Written out rather than calling ``tl.philox`` so that the keying and the round count are visibly those of
    Random123 (they coincide with Triton's ``philox_impl`` at 10 rounds; the test checks the known answers)."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, PHILOX_M0)
        lo0 = c0 * PHILOX_M0
        hi1 = tl.umulhi(c2, PHILOX_M1)
        lo1 = c2 * PHILOX_M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + PHILOX_W0
        k1 = k1 + PHILOX_W1
    return c0, c1, c2, c3


@triton.jit
def split64(x):
    """int64 block -> (low 32 bits, high 32 bits) as uint32 blocks (two's complement: -1 -> all ones)."""
    lo = (x & 0xFFFFFFFF).to(tl.uint32)
    hi = ((x >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return lo, hi


@triton.jit
def philox_uniform(seed, position, stream):
    """The fastverify uniform of csrc/sampling.cpp: key = (seed lo, seed hi), counter = (position lo,
    position hi, stream, 0); word 0 -> ((x >> 9) + 0.5) * 2^-23. seed, position: int64 blocks; stream: int64
    block or scalar. Returns float32."""
    k0, k1 = split64(seed)
    c0, c1 = split64(position)
    c2 = (position * 0 + stream).to(tl.uint32)
    c3 = c2 * 0
    x0, _, _, _ = philox4x32_10(c0, c1, c2, c3, k0, k1)
    return uint32_to_open_unit(x0)


@triton.jit
def uint32_to_open_unit(x):
    """uint32 -> float32 in [2^-24, 1 - 2^-24]: ((x >> 9) + 0.5) * 2^-23 = (2 (x >> 9) + 1) / 2^24, exact in
    float32 (24 significant bits), as the schema says."""
    k = (x >> 9).to(tl.int64)
    return ((2 * k + 1).to(tl.float64) * (1.0 / 16777216.0)).to(tl.float32)


def next_pow2(x: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(max(int(x), 1)))

"""Reference of the block-packed skinny linear (csrc/linear.h, "Block-packed weights"): the weight unpacked to
float32, then ``torch.nn.functional.linear``. (The plain skinny_linear's reference is ``F.linear`` itself.)"""

import torch
import torch.nn.functional as F

__all__ = ["unpack_blocks", "skinny_linear_packed"]


def unpack_blocks(q, d, m, bits):
    """The float32 weight [N, K] of a packed one: w[n, k] = d[n, k // 32] * q[n, k] + m[n, k // 32], with q
    uint8 [N, K * bits // 8] (4 bits: per block of 32, 16 bytes, byte l holding q[l] in its low nibble and
    q[16 + l] in its high one; 8 bits: q in order), d and m float32 [N, K // 32]."""
    N, nb = d.shape
    if bits == 4:
        b = q.reshape(N, nb, 1, 16)
        qq = torch.cat([b & 0xF, b >> 4], dim=2).reshape(N, nb, 32)  # [nibble, l] -> k = 16 * nibble + l
    elif bits == 8:
        qq = q.reshape(N, nb, 32)
    else:
        raise ValueError(f"bits: expected 4 or 8, got {bits}")
    return (qq.float() * d[..., None] + m[..., None]).reshape(N, nb * 32)


def skinny_linear_packed(x, q, d, m, bits, bias):
    w = unpack_blocks(q, d, m, bits)
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))

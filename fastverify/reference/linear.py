"""Reference of the block-packed skinny linear (csrc/linear.h, "Block-packed weights"): how a weight is packed,
and the weight unpacked to float32, then ``torch.nn.functional.linear``. (The plain skinny_linear's reference is
``F.linear`` itself; skinny_linear_t's, for a weight stored [K, N], ``x @ weight + bias``.)"""

import torch
import torch.nn.functional as F

__all__ = ["pack_blocks", "unpack_blocks", "skinny_linear_packed", "skinny_linear_t"]


def _fit(w, bits, d, m):
    """(q uint8 [N, nb, 32], ok bool [N, nb]): the blocks of w [N, nb, 32] that d and m [N, nb] give exactly,
    with 0 <= q < 2^bits. d holds float16 values (11 significant bits), so every product d * q (q < 2^8) is exact
    in float32 and a fused multiply-add gives what the check below computes."""
    safe = torch.where(d > 0, d, torch.ones_like(d))
    qf = torch.where((d > 0)[..., None], ((w - m[..., None]) / safe[..., None]).round_(), torch.zeros_like(w))
    ok = ((qf >= 0) & (qf < 2 ** bits)).all(-1)
    qf.clamp_(0, 2 ** bits - 1)
    ok &= (torch.addcmul(m[..., None], qf, d[..., None]) == w).all(-1)
    return qf.to(torch.uint8), ok


def pack_blocks(weight):
    """(q, d, m, bits) of a float32 weight [N, K] (K a multiple of 32) whose every block of 32 weights along K is
    exactly d * q + m (the layout of ``unpack_blocks``): 4 bits when every block fits one of the 4-bit scales, else
    8 when every block fits one of the 8-bit ones; bits 0 and empty tensors otherwise (a non-finite value too).
    A block's m is its minimum and its scales, tried in order, the first that fits kept, are float16 roundings of:
    4 bits its span / 15 (Q4_1), its largest magnitude / 8 (Q4_0); 8 bits its largest magnitude / 127 (Q8_0), its
    span / 255."""
    N, K = weight.shape
    w = weight.reshape(N, K // 32, 32)
    none = (torch.empty(0, dtype=torch.uint8), weight.new_empty(0), weight.new_empty(0), 0)
    if not bool(torch.isfinite(w).all()):
        return none
    lo, hi = w.amin(-1), w.amax(-1)
    amax = w.abs().amax(-1)
    candidates = {4: [(hi - lo) / 15, amax / 8], 8: [amax / 127, (hi - lo) / 255]}
    for bits, scales in candidates.items():
        q = ok = None
        for scale in scales:
            d = scale.half().float()
            qc, okc = _fit(w, bits, d, lo)
            if q is None:
                q, ok, dd = qc, okc, d
            else:  # keep the blocks an earlier candidate already fits
                take = okc & ~ok
                q, dd, ok = torch.where(take[..., None], qc, q), torch.where(take, d, dd), ok | okc
            if bool(ok.all()):
                break
        if bool(ok.all()):
            if bits == 4:
                b = q.reshape(N, K // 32, 2, 16)  # byte l of a block: q[l] | q[16 + l] << 4
                packed = (b[..., 0, :] | (b[..., 1, :] << 4)).reshape(N, K // 2)
            else:
                packed = q.reshape(N, K)
            return packed.contiguous(), dd.contiguous(), lo.contiguous(), bits
    return none


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


def skinny_linear_t(x, weight, bias):
    y = torch.matmul(x, weight.to(x.dtype))
    return y if bias is None else y + bias.to(x.dtype)

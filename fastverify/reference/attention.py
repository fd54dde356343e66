"""Reference (plain torch) tree attention: the specification of fastverify::tree_attention.

It builds the dense [B, n, P + n] mask from the packed bits (the fast kernels never do) and computes the
softmax in float32. Key layout as in csrc/tree.cpp: request b's prefix is key slots [0, prefix_len[b]) of the
first P = S - n slots, draft node j is key P + j.
"""

import math

import torch

from fastverify.reference.tree import unpack_bits

__all__ = ["dense_tree_attention_mask", "tree_attention", "masked_attention"]


def dense_tree_attention_mask(packed_mask: torch.Tensor, prefix_len: torch.Tensor, P: int) -> torch.Tensor:
    """bool [B, n, P + n] from packed int32 [B, n, ceil(n / 32)] bits and prefix lengths int32 [B]."""
    B, n, _ = packed_mask.shape
    prefix = torch.arange(P, device=packed_mask.device)[None, :] < prefix_len.long()[:, None]
    return torch.cat([prefix[:, None, :].expand(B, n, P), unpack_bits(packed_mask, n)], dim=-1)


def tree_attention(q, k, v, packed_mask, prefix_len, scale: float) -> torch.Tensor:
    """[B, Hq, n, D] in q's dtype: softmax(q k^T * scale) v over the keys visible to each draft query.

    q [B, Hq, n, D]; k, v [B, Hkv, P + n, D] (Hq a multiple of Hkv: query head h reads kv head
    h // (Hq // Hkv)); packed_mask int32 [B, n, ceil(n / 32)]; prefix_len int32 [B]. Accumulates in
    float32. A query that sees no key at all (a padding row of a request with an empty prefix) gets 0.
    The unused prefix slots [prefix_len, P) do not reach the result: they may hold anything (a preallocated
    cache's).
    A NaN in a query, or in a key or value it sees, makes its row NaN; a draft key's value enters every
    query's product, with weight 0 where the query does not see it (as in SDPA: keep it finite).
    """
    B, Hq, n, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    P = S - n
    group = Hq // Hkv
    unused = torch.arange(S, device=k.device)[None, :] >= prefix_len.long()[:, None]
    unused[:, P:] = False  # the unused prefix slots; their scores are masked below, their values zeroed here
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().masked_fill(unused[:, None, :, None], 0.0).repeat_interleave(group, dim=1)
    visible = dense_tree_attention_mask(packed_mask, prefix_len, P)[:, None]  # [B, 1, n, P + n]
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(~visible.any(-1, keepdim=True), 0.0)  # sees nothing: 0
    return (probs @ vf).to(q.dtype)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


MASKED = -1e30  # a mask value at or below it excludes its key outright (csrc/cpu/attention.cpp's kSkippedMask)


def masked_prefix(mask: torch.Tensor) -> list:
    """Per batch row of an additive mask [B, 1 or Hq, n, S], the keys that ``skip_masked_prefix`` leaves unread:
    16 * floor(f / 16), f the first key any of its query rows sees (0 if a row sees no key)."""
    seen = ~(mask <= MASKED)  # NaN: not excluded
    out = []
    for b in range(mask.shape[0]):
        rows = seen[b].reshape(-1, mask.shape[-1])
        if rows.shape[0] == 0 or not bool(rows.any(-1).all()):
            out.append(0)
            continue
        first = int(rows.int().argmax(-1).min())
        out.append(first // 16 * 16)
    return out


def _eager(q, k, v, mask, scale: float, softcap: float, sinks) -> torch.Tensor:
    """Eager attention with a soft cap and sinks, in transformers' steps (Gemma 2's, gpt-oss's): scores q k^T * scale,
    capped (softcap * tanh(scores / softcap)), plus the mask, a softmax over them and query head h's sink logit, the
    sink's weight dropped, then times v."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap:
        w = torch.tanh(w / softcap) * softcap
    if mask is not None:
        w = w + mask
    if sinks is not None:
        w = torch.cat([w, sinks.to(w.dtype).reshape(1, -1, 1, 1).expand(*w.shape[:-1], 1)], dim=-1)
    p = torch.softmax(w, dim=-1)
    return torch.matmul(p[..., :k.shape[2]] if sinks is not None else p, v)


def masked_attention(q, k, v, mask, scale: float, skip_masked_prefix: bool = False, softcap: float = 0.0,
                     sinks=None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v: torch's scaled_dot_product_attention with the additive mask (or none) and
    enable_gqa (query head h reads key / value head h // (Hq // Hkv)); with a soft cap (``softcap`` > 0) or
    ``sinks`` [Hq], eager attention's steps (``_eager``); ``skip_masked_prefix``: per batch row over the keys from
    ``masked_prefix(mask)[b]`` on only. The specification of fastverify::masked_attention."""
    if softcap or sinks is not None:
        def attend(q, k, v, mask):
            return _eager(q, k, v, mask, scale, softcap, sinks)
    else:
        def attend(q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                    enable_gqa=True)
    if mask is None or not skip_masked_prefix or q.shape[0] == 0 or q.shape[2] == 0:
        return attend(q, k, v, mask)
    return torch.cat([attend(q[b:b + 1], k[b:b + 1, :, s:], v[b:b + 1, :, s:], mask[b:b + 1, ..., s:])
                      for b, s in enumerate(masked_prefix(mask))])

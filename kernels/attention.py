"""Triton tree attention: the n draft queries of each request over its prefix keys and its draft keys, with
the tree given as packed bits (csrc/tree.cpp, ``tree_attention``; specification
fastverify/reference/attention.py).

Flash-attention style (Dao et al. 2022): one program per (block of BLOCK_M draft queries, request, query
head). It streams the request's prefix keys [0, prefix_len[b]) in BLOCK_N tiles with no mask at all (every draft
query sees the whole prefix), then the draft keys [P, P + n), where the visibility of key j to query i is bit
j % 32 of word j // 32 of packed_mask[b, i]: read from the packed words inside the kernel, never expanded
into a dense mask in memory. Online softmax with running max and sum in float32; scores and the output
accumulate in float32 whatever the input dtype. GQA: query head h reads kv head h // (Hq // Hkv).

Head dims: any D; the tile is padded to the next power of two >= 16 (masked loads), so 64 / 128 / 256 run
unpadded. A query that sees no key at all gets 0, as the reference.
"""

import torch
import triton
import triton.language as tl

from ._common import next_pow2


@triton.jit
def _tile_update(q, k_ptrs, v_ptrs, key_ok, visible, m_i, l_i, acc, scale_log2e,
                 D_OK, IEEE: tl.constexpr):
    """One BLOCK_N tile of keys: update the running max m_i, sum l_i and output acc (all float32)."""
    k = tl.load(k_ptrs, mask=key_ok[:, None] & D_OK[None, :], other=0.0)
    if IEEE:
        k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * scale_log2e, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row that has seen nothing yet keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptrs, mask=key_ok[:, None] & D_OK[None, :], other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, prefix_len_ptr, out_ptr,
                           Hq, n, P, D, W, group, scale_log2e,
                           sq_b, sq_h, sq_n, sq_d,
                           sk_b, sk_h, sk_n, sk_d,
                           sv_b, sv_h, sv_n, sv_d,
                           so_b, so_h, so_n, so_d,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // group
    b64 = b.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < n
    d_ok = dims < D

    q_base = q_ptr + b64 * sq_b + h.to(tl.int64) * sq_h
    q = tl.load(q_base + rows[:, None].to(tl.int64) * sq_n + dims[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    k_base = k_ptr + b64 * sk_b + hk.to(tl.int64) * sk_h
    v_base = v_ptr + b64 * sv_b + hk.to(tl.int64) * sv_h

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    plen = tl.load(prefix_len_ptr + b)
    # Prefix keys: visible to every real query row.
    for n0 in range(0, plen, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < plen
        k_ptrs = k_base + keys[:, None].to(tl.int64) * sk_n + dims[None, :] * sk_d
        v_ptrs = v_base + keys[:, None].to(tl.int64) * sv_n + dims[None, :] * sv_d
        visible = row_ok[:, None] & key_ok[None, :]
        m_i, l_i, acc = _tile_update(q, k_ptrs, v_ptrs, key_ok, visible, m_i, l_i, acc, scale_log2e,
                                     d_ok, IEEE)

    # Draft keys P + j: a query row sees only its ancestors and itself, so keys past the block's last row
    # are never visible (j <= i): stop there.
    mask_rows = mask_ptr + (b64 * n + rows[:, None].to(tl.int64)) * W
    last = tl.minimum((pid_m + 1) * BLOCK_M, n)
    for j0 in range(0, last, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        key_ok = j < n
        words = tl.load(mask_rows + (j[None, :] // 32), mask=row_ok[:, None] & key_ok[None, :], other=0)
        bit = (words >> (j[None, :] % 32)) & 1
        visible = bit != 0
        k_ptrs = k_base + (P + j[:, None]).to(tl.int64) * sk_n + dims[None, :] * sk_d
        v_ptrs = v_base + (P + j[:, None]).to(tl.int64) * sv_n + dims[None, :] * sv_d
        m_i, l_i, acc = _tile_update(q, k_ptrs, v_ptrs, key_ok, visible, m_i, l_i, acc, scale_log2e,
                                     d_ok, IEEE)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_base = out_ptr + b64 * so_b + h.to(tl.int64) * so_h
    tl.store(o_base + rows[:, None].to(tl.int64) * so_n + dims[None, :] * so_d,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def fp32_products(q: torch.Tensor) -> bool:
    """Whether the kernel's dots take float32 operands at full precision (IEEE) rather than q's dtype (tensor
    cores). float32 inputs: full float32 products (no TF32), to match the reference. CPU tensors
    (TRITON_INTERPRET=1): always, because the interpreter's tl.dot mis-handles bfloat16 operands (it returns
    garbage of order 1e10; checked with triton 3.8), and float32 is what the reference computes anyway."""
    return q.dtype == torch.float32 or q.device.type != "cuda"


def tiles(n: int, block_d: int, fp32: bool) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps) for n draft queries, head tile block_d, float32 (IEEE) or half products.

    Chosen from ptxas's figures (tests/triton_compile.py --resources; sm_80, sm_86, sm_90, sm_100) so that no
    launch spills registers and the pipelined K / V tiles (Triton's default 3 stages) fit the 99 KiB of shared
    memory a block gets on sm_86 / sm_89: K tiles of 8192 half or 4096 float32 elements (64 keys up to D 128 and
    32 at D 256 in half precision; 64 / 32 / 16 keys at D 64 / 128 / 256 in float32), 8 warps but for the small
    half tiles, and blocks of 32 queries where n > 16 except for float32 at D >= 128 (16 x 128 float32 products
    already fill the registers). The tiles these replaced (16 or 32 queries x 64 keys at 4 warps, 32 keys at
    D 256) spilled 32-864 bytes a thread in float32 at D <= 128 and 22-38 KB at D 256 or 32 queries x 128, whose
    148-172 KiB of shared memory sm_86 / sm_89 cannot launch (nor sm_80, 163 KiB, at 168-172); and 40-232 bytes
    in half precision from D 64 up (sm_90). tests/test_triton_compile.py holds every launch to both limits."""
    block_m = 16 if n <= 16 or (fp32 and block_d >= 128) else 32
    block_n = max(16, min(64, (4096 if fp32 else 8192) // block_d))
    four_warps = not fp32 and (block_d <= 16 or (block_d <= 64 and block_m == 16))  # the small half tiles
    return block_m, block_n, 4 if four_warps else 8


@torch.library.custom_op("fastverify::tree_attention_triton", mutates_args=())
def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed_mask: torch.Tensor,
                   prefix_len: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, n, D]; k, v [B, Hkv, P + n, D] (same dtype as q: fp32 / bf16 / fp16; any strides);
    packed_mask int32 [B, n, ceil(n / 32)]; prefix_len int32 [B] -> [B, Hq, n, D] in q's dtype."""
    B, Hq, n, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    assert Hq % Hkv == 0 and S >= n and v.shape == k.shape, "tree_attention: bad shapes"
    out = torch.empty((B, Hq, n, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    W = packed_mask.shape[-1]
    packed_mask = packed_mask.contiguous()
    prefix_len = prefix_len.to(torch.int32).contiguous()
    BLOCK_D = next_pow2(D, 16)
    ieee = fp32_products(q)
    BLOCK_M, BLOCK_N, num_warps = tiles(n, BLOCK_D, ieee)
    grid = (triton.cdiv(n, BLOCK_M), B * Hq)
    _tree_attention_kernel[grid](
        q, k, v, packed_mask, prefix_len, out,
        Hq, n, S - n, D, W, Hq // Hkv, float(scale) * 1.4426950408889634,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, IEEE=ieee, num_warps=num_warps)
    return out


@tree_attention.register_fake
def _(q, k, v, packed_mask, prefix_len, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)

"""Triton kernels of the tree ops: attention masks (bool, additive, packed), positions and compact_cache.

Schemas: csrc/tree.cpp; specification: fastverify/reference/tree.py. Each function takes the normalised
arguments of its schema (the op wrappers in fastverify/ops/tree.py validate them) and is registered as the torch
op ``fastverify::<op>_triton`` with a fake (meta) implementation, so torch.compile can trace it.

One program per (request b, query row i). A row's ancestor set is found by walking parents from i up to the
root; parents precede children (parents[j] < j), so the walk takes depth(i) <= i + 1 steps and never leaves the
request. The walk is bounded by i + 1 steps and stops at any parent that does not precede its child, so even a
malformed tree cannot loop or read outside the request.
"""

import torch
import triton
import triton.language as tl

from ._common import next_pow2


@triton.jit
def _request_nodes(cu_nodes_ptr, b, N):
    """(node0, n_b): the global index of request b's node 0 and its node count, or (0, 0) where its nodes
    [cu_nodes[b], cu_nodes[b + 1]) do not lie in order within [0, N) (unvalidated input): no row of it then reads
    or writes a node."""
    node0 = tl.load(cu_nodes_ptr + b)
    node1 = tl.load(cu_nodes_ptr + b + 1)
    ok = (node0 >= 0) & (node0 <= node1) & (node1 <= N)
    return tl.where(ok, node0, 0), tl.where(ok, node1 - node0, 0)


@triton.jit
def _walk_ancestors(parents_ptr, node0, i, cols, valid):
    """Bool block over draft columns `cols`: True where cols is node i or one of its ancestors.
    `node0` is the global index of the request's node 0; `valid` says whether row i is a real node."""
    hit = (cols == i) & valid
    cur = tl.where(valid, i, -1)
    steps = 0
    while (cur >= 0) & (steps <= i):
        par = tl.load(parents_ptr + node0 + cur).to(tl.int32)
        par = tl.where(par < cur, par, -1)  # defensive: a malformed parent ends the walk
        hit = hit | ((cols == par) & (par >= 0))
        cur = par
        steps += 1
    return hit


@triton.jit
def _tree_mask_kernel(parents_ptr, cu_nodes_ptr, prefix_len_ptr, out_ptr, N, n, P,
                      stride_b, stride_i,
                      ADDITIVE: tl.constexpr, BLOCK: tl.constexpr):
    """Row i of request b of the bool mask [B, n, P + n] (ADDITIVE: 0 / -inf in out's dtype)."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    node0, n_b = _request_nodes(cu_nodes_ptr, b, N)
    plen = tl.load(prefix_len_ptr + b)
    valid = i < n_b
    row_ptr = out_ptr + b.to(tl.int64) * stride_b + i.to(tl.int64) * stride_i
    for c0 in range(0, P + n, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        in_prefix = cols < plen
        dcols = cols - P
        anc = _walk_ancestors(parents_ptr, node0, i, dcols, valid) & (cols >= P)
        vis = in_prefix | anc
        if ADDITIVE:
            val = tl.where(vis, 0.0, float("-inf"))
            tl.store(row_ptr + cols, val.to(out_ptr.dtype.element_ty), mask=cols < P + n)
        else:
            tl.store(row_ptr + cols, vis.to(tl.int8), mask=cols < P + n)


@triton.jit
def _tree_mask_packed_kernel(parents_ptr, cu_nodes_ptr, out_ptr, N, n, W, BLOCK_W: tl.constexpr):
    """Row i of request b of the packed mask [B, n, W]: bit j % 32 of word j // 32 set iff j is i or an
    ancestor of i."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    node0, n_b = _request_nodes(cu_nodes_ptr, b, N)
    valid = i < n_b
    words = tl.arange(0, BLOCK_W)
    one = tl.full([BLOCK_W], 1, tl.uint32)
    acc = tl.zeros([BLOCK_W], tl.uint32)
    acc = acc | tl.where((words == i // 32) & valid, one << (i % 32).to(tl.uint32), 0)
    cur = tl.where(valid, i, -1)
    steps = 0
    while (cur >= 0) & (steps <= i):
        par = tl.load(parents_ptr + node0 + cur).to(tl.int32)
        par = tl.where(par < cur, par, -1)
        ok = par >= 0
        acc = acc | tl.where((words == par // 32) & ok, one << (tl.maximum(par, 0) % 32).to(tl.uint32), 0)
        cur = par
        steps += 1
    row = out_ptr + (b.to(tl.int64) * n + i) * W
    tl.store(row + words, acc.to(tl.int32, bitcast=True), mask=words < W)


@triton.jit
def _tree_positions_kernel(parents_ptr, cu_nodes_ptr, prefix_len_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """positions of request b's nodes: prefix_len[b] + depth(j) - 1 (a child of the root has depth 1)."""
    b = tl.program_id(0)
    blk = tl.program_id(1)
    node0, n_b = _request_nodes(cu_nodes_ptr, b, N)
    plen = tl.load(prefix_len_ptr + b).to(tl.int64)
    j = blk * BLOCK + tl.arange(0, BLOCK)
    live = j < n_b
    depth = tl.zeros([BLOCK], tl.int64)
    cur = tl.where(live, j, -1)
    # Walk every lane of the block up together; each step moves the live lanes one level up.
    steps = 0
    while (tl.max(cur, axis=0) >= 0) & (steps <= blk * BLOCK + BLOCK):
        on = cur >= 0
        depth += on.to(tl.int64)
        par = tl.load(parents_ptr + node0 + tl.maximum(cur, 0), mask=on, other=-1).to(tl.int32)
        cur = tl.where(on & (par < cur), par, -1)
        steps += 1
    tl.store(out_ptr + node0 + j, plen + depth - 1, mask=live)


def _check(parents, cu_nodes):
    assert parents.dtype == torch.int32 and cu_nodes.dtype == torch.int32, "parents/cu_nodes must be int32"
    assert parents.dim() == 1 and cu_nodes.dim() == 1


@torch.library.custom_op("fastverify::tree_mask_bool_triton", mutates_args=())
def tree_mask_bool(parents: torch.Tensor, cu_nodes: torch.Tensor, prefix_len: torch.Tensor, n: int,
                   P: int) -> torch.Tensor:
    """parents int32 [N], cu_nodes int32 [B + 1], prefix_len int32 [B] -> bool [B, n, P + n]."""
    _check(parents, cu_nodes)
    B = cu_nodes.numel() - 1
    out = torch.empty((B, n, P + n), dtype=torch.bool, device=parents.device)
    if out.numel() == 0:
        return out
    parents, cu_nodes, prefix_len = parents.contiguous(), cu_nodes.contiguous(), prefix_len.contiguous()
    view = out.view(torch.int8)
    _tree_mask_kernel[(B, n)](parents, cu_nodes, prefix_len, view, parents.numel(), n, P, view.stride(0),
                              view.stride(1), ADDITIVE=False, BLOCK=min(next_pow2(P + n, 16), 1024))
    return out


@tree_mask_bool.register_fake
def _(parents, cu_nodes, prefix_len, n, P):
    return parents.new_empty((cu_nodes.shape[0] - 1, n, P + n), dtype=torch.bool)


@torch.library.custom_op("fastverify::tree_mask_additive_triton", mutates_args=())
def tree_mask_additive(parents: torch.Tensor, cu_nodes: torch.Tensor, prefix_len: torch.Tensor, n: int, P: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """parents int32 [N], cu_nodes int32 [B + 1], prefix_len int32 [B] -> [B, 1, n, P + n] in dtype, 0 where
    visible and -inf elsewhere."""
    _check(parents, cu_nodes)
    B = cu_nodes.numel() - 1
    out = torch.empty((B, 1, n, P + n), dtype=dtype, device=parents.device)
    if out.numel() == 0:
        return out
    parents, cu_nodes, prefix_len = parents.contiguous(), cu_nodes.contiguous(), prefix_len.contiguous()
    _tree_mask_kernel[(B, n)](parents, cu_nodes, prefix_len, out, parents.numel(), n, P, out.stride(0),
                              out.stride(2), ADDITIVE=True, BLOCK=min(next_pow2(P + n, 16), 1024))
    return out


@tree_mask_additive.register_fake
def _(parents, cu_nodes, prefix_len, n, P, dtype):
    return parents.new_empty((cu_nodes.shape[0] - 1, 1, n, P + n), dtype=dtype)


@torch.library.custom_op("fastverify::tree_mask_packed_triton", mutates_args=())
def tree_mask_packed(parents: torch.Tensor, cu_nodes: torch.Tensor, n: int) -> torch.Tensor:
    """parents int32 [N], cu_nodes int32 [B + 1] -> int32 [B, n, ceil(n / 32)]."""
    _check(parents, cu_nodes)
    B = cu_nodes.numel() - 1
    W = (n + 31) // 32
    out = torch.empty((B, n, W), dtype=torch.int32, device=parents.device)
    if out.numel() == 0:
        return out
    _tree_mask_packed_kernel[(B, n)](parents.contiguous(), cu_nodes.contiguous(), out, parents.numel(), n, W,
                                     BLOCK_W=next_pow2(W))
    return out


@tree_mask_packed.register_fake
def _(parents, cu_nodes, n):
    return parents.new_empty((cu_nodes.shape[0] - 1, n, (n + 31) // 32), dtype=torch.int32)


@torch.library.custom_op("fastverify::tree_positions_triton", mutates_args=())
def tree_positions(parents: torch.Tensor, cu_nodes: torch.Tensor, prefix_len: torch.Tensor) -> torch.Tensor:
    """parents int32 [N], cu_nodes int32 [B + 1], prefix_len int32 [B] -> int64 [N]."""
    _check(parents, cu_nodes)
    N = parents.numel()
    B = cu_nodes.numel() - 1
    out = torch.full((N,), -1, dtype=torch.int64, device=parents.device)  # -1: a node of no request
    if N == 0 or B == 0:
        return out
    # The grid covers the widest request a batch of N nodes can hold (N itself), so it is sized without reading
    # cu_nodes back; blocks past their request's nodes store nothing.
    BLOCK = min(next_pow2(N, 16), 256)
    _tree_positions_kernel[(B, triton.cdiv(N, BLOCK))](parents.contiguous(), cu_nodes.contiguous(),
                                                        prefix_len.contiguous(), out, N, BLOCK=BLOCK)
    return out


@tree_positions.register_fake
def _(parents, cu_nodes, prefix_len):
    return parents.new_empty(parents.shape, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------------------------
# compact_cache: one program per (request, head, block of D); it loads the sources of all of the request's moves
# ([DEPTH, BLOCK_D] elements, as raw bits), waits for every thread of the program (debug_barrier), then writes
# them to their destinations: the reference's gather-then-write semantics, so overlapping source and destination
# slots are safe. Programs touch disjoint elements.


@triton.jit
def _compact_cache_kernel(cache_ptr, sB, sH, sS, sD, H, S, D, prefix_len_ptr, draft_start, accepted_ptr, max_depth,
                          accept_len_ptr, DEPTH: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    i = tl.arange(0, DEPTH)
    n = tl.minimum(tl.load(accept_len_ptr + b), max_depth)
    acc = tl.load(accepted_ptr + b.to(tl.int64) * max_depth + i, mask=i < n, other=-1)
    src = draft_start + acc.to(tl.int64)
    dst = tl.load(prefix_len_ptr + b).to(tl.int64) + i
    ok = (i < n) & (acc >= 0) & (src < S) & (dst >= 0) & (dst < S)  # the wrapper rejects the rest beforehand
    m = ok[:, None] & (d[None, :] < D)
    base = cache_ptr + b.to(tl.int64) * sB + h.to(tl.int64) * sH
    vals = tl.load(base + src[:, None] * sS + d[None, :] * sD, mask=m)
    tl.debug_barrier()
    tl.store(base + dst[:, None] * sS + d[None, :] * sD, vals, mask=m)


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _compact_one(t, prefix_len, draft_start, accepted, accept_len):
    B, H, S, D = t.shape
    max_depth = accepted.shape[1]
    if B * H * D == 0 or max_depth == 0:
        return
    raw = t.view(_RAW[t.element_size()])  # moved as bits: any dtype, NaN payloads kept
    DEPTH = next_pow2(max_depth, 1)
    # every move's [DEPTH, BLOCK_D] elements are held at once (gather, then write): 2048 of them per program
    # (16 x 128) keep to ~80 registers a thread on sm_90, where 64 x 128 spilled (tests/triton_compile.py)
    BLOCK_D = max(16, min(next_pow2(D, 16), 128, 2048 // DEPTH))
    _compact_cache_kernel[(B * H, triton.cdiv(D, BLOCK_D))](
        raw, *raw.stride(), H, S, D, prefix_len, draft_start, accepted, max_depth, accept_len,
        DEPTH=DEPTH, BLOCK_D=BLOCK_D)


@torch.library.custom_op("fastverify::compact_cache_triton", mutates_args=("k", "v"))
def compact_cache(k: torch.Tensor, v: torch.Tensor, prefix_len: torch.Tensor, draft_start: int,
                  accepted: torch.Tensor, accept_len: torch.Tensor) -> None:
    """In place on k and v [B, H, S, D] (any strides; k and v may differ in H, D and dtype): for i < accept_len[b],
    slot draft_start + accepted[b, i] moves to slot prefix_len[b] + i. prefix_len, accept_len int32 [B],
    accepted int32 [B, max_depth], validated by fastverify.compact_cache."""
    prefix_len, accepted, accept_len = prefix_len.contiguous(), accepted.contiguous(), accept_len.contiguous()
    for t in (k, v):
        _compact_one(t, prefix_len, draft_start, accepted, accept_len)


@compact_cache.register_fake
def _(k, v, prefix_len, draft_start, accepted, accept_len):
    return None

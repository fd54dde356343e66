"""Reference (plain torch) implementations of the tree ops: masks, positions and cache compaction.

These are the specification every backend is tested against. They take the normalised arguments of the
schemas in csrc/tree.cpp:

  parents     int32 [N]      local parent index of each draft node, -1 = child of the root; parents[j] < j
  cu_nodes    int32 [B + 1]  node offsets of the B requests (request b owns nodes cu_nodes[b] .. cu_nodes[b+1])
  prefix_len  int32 [B]      committed tokens of each request already in the key/value cache
  n           int            max nodes per request (max of cu_nodes[b+1] - cu_nodes[b])
  P           int            key slots reserved for the prefix (max of prefix_len)

Key layout: request b's prefix is key slots [0, prefix_len[b]); draft node j (of every request) is key P + j.
Query row i of request b may attend to its prefix, to its ancestors and to itself. Padding rows (i >= n_b)
see only the prefix, and padding columns (j >= n_b) are never visible, so a padded softmax row is never
entirely -inf as long as the request has a prefix.

Packed masks hold only the draft part: int32 [B, n, ceil(n / 32)], bit (j % 32) of word j // 32 of row i
(little-endian within a word, as FlashInfer's packed custom masks) set iff node j is an ancestor of i or i.
"""

import torch

__all__ = [
    "padded_parents",
    "ancestor_matrix",
    "tree_depth",
    "tree_mask_bool",
    "tree_mask_additive",
    "tree_mask_packed",
    "tree_positions",
    "pack_bits",
    "unpack_bits",
    "block_mask_bool",
    "compact_cache",
    "compact_cache_layers",
]


def padded_parents(parents: torch.Tensor, cu_nodes: torch.Tensor, n: int):
    """Per-request parents padded to [B, n] (int64, -1 in padding) and the mask of real nodes bool [B, n]."""
    B = cu_nodes.numel() - 1
    cu = cu_nodes.long()
    counts = cu[1:] - cu[:-1]
    j = torch.arange(n, device=parents.device)
    valid = j[None, :] < counts[:, None]
    if parents.numel() == 0:
        return torch.full((B, n), -1, dtype=torch.long, device=parents.device), valid
    flat = (cu[:-1, None] + j[None, :]).clamp(0, parents.numel() - 1)
    pp = torch.where(valid, parents.long()[flat], torch.full_like(flat, -1))
    # unvalidated input (validate=False): a parent that does not precede its node is the root, so walks end
    return torch.where((pp >= -1) & (pp < j), pp, torch.full_like(pp, -1)), valid


def ancestor_matrix(parents: torch.Tensor, cu_nodes: torch.Tensor, n: int) -> torch.Tensor:
    """bool [B, n, n]: entry (b, i, j) is True iff node j of request b is node i or one of its ancestors.

    Walks every node up to the root at once (one step per tree level), so the loop runs max-depth times."""
    pp, valid = padded_parents(parents, cu_nodes, n)
    B = pp.shape[0]
    anc = torch.zeros(B, n, n, dtype=torch.bool, device=parents.device)
    cur = torch.where(valid, torch.arange(n, device=parents.device).expand(B, n), torch.full_like(pp, -1))
    rows = torch.arange(n, device=parents.device).expand(B, n)
    bidx = torch.arange(B, device=parents.device)[:, None].expand(B, n)
    while bool((cur >= 0).any()):
        live = cur >= 0
        anc[bidx[live], rows[live], cur[live]] = True
        cur = torch.where(live, pp.gather(1, cur.clamp(min=0)), cur)
    return anc


def tree_depth(parents: torch.Tensor, cu_nodes: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [B, n]: depth of each node (a child of the root has depth 1); 0 in padding."""
    return ancestor_matrix(parents, cu_nodes, n).sum(-1)


def tree_mask_bool(parents, cu_nodes, prefix_len, n: int, P: int) -> torch.Tensor:
    """bool [B, n, P + n]: prefix keys [0, prefix_len[b]) visible to every row; draft keys P + j visible
    to row i iff j is an ancestor of i or i itself (both real nodes)."""
    B = cu_nodes.numel() - 1
    prefix = torch.arange(P, device=parents.device)[None, :] < prefix_len.long()[:, None]  # [B, P]
    return torch.cat([prefix[:, None, :].expand(B, n, P), ancestor_matrix(parents, cu_nodes, n)], dim=-1)


def tree_mask_additive(parents, cu_nodes, prefix_len, n: int, P: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, n, P + n] in dtype: 0 where tree_mask_bool is True, -inf elsewhere (Hugging Face 4D mask)."""
    visible = tree_mask_bool(parents, cu_nodes, prefix_len, n, P)
    zero = torch.zeros((), dtype=dtype, device=parents.device)
    ninf = torch.full((), float("-inf"), dtype=dtype, device=parents.device)
    return torch.where(visible, zero, ninf)[:, None]


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool [..., m] -> int32 [..., ceil(m / 32)]: bit (j % 32) of word j // 32 is bits[..., j]."""
    m = bits.shape[-1]
    W = (m + 31) // 32
    padded = torch.zeros(*bits.shape[:-1], W * 32, dtype=torch.int64, device=bits.device)
    padded[..., :m] = bits.long()
    weights = torch.ones(32, dtype=torch.int64, device=bits.device) << torch.arange(32, device=bits.device)
    words = (padded.view(*bits.shape[:-1], W, 32) * weights).sum(-1)  # in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement into int32
    return words.to(torch.int32)


def unpack_bits(words: torch.Tensor, m: int) -> torch.Tensor:
    """int32 [..., W] -> bool [..., m], the inverse of pack_bits (bits past m are ignored)."""
    shifts = torch.arange(32, device=words.device)
    bits = (words.long()[..., None] >> shifts) & 1
    return bits.flatten(-2)[..., :m].bool()


def tree_mask_packed(parents, cu_nodes, n: int) -> torch.Tensor:
    """int32 [B, n, ceil(n / 32)]: the draft part of tree_mask_bool, packed little-endian."""
    return pack_bits(ancestor_matrix(parents, cu_nodes, n))


def tree_positions(parents, cu_nodes, prefix_len) -> torch.Tensor:
    """int64 [N]: position id of each draft node, prefix_len[b] + depth(j) - 1."""
    B = cu_nodes.numel() - 1
    counts = (cu_nodes[1:] - cu_nodes[:-1]).long()
    n = int(counts.max()) if B > 0 else 0
    depth, valid = tree_depth(parents, cu_nodes, n), padded_parents(parents, cu_nodes, n)[1]
    pos = prefix_len.long()[:, None] + depth - 1
    N = parents.numel()
    node = (cu_nodes.long()[:-1, None] + torch.arange(n, device=parents.device))[valid]  # 0 .. N - 1 when valid
    inside = (node >= 0) & (node < N)  # unvalidated offsets: nodes of no request keep -1
    out = torch.full((N,), -1, dtype=torch.int64, device=parents.device)
    out[node[inside]] = pos[valid][inside]
    return out


def block_mask_bool(sizes, prefix_len, n: int, P: int, causal: bool) -> torch.Tensor:
    """bool [B, n, P + n] for blocks of sizes[b] positions: each sees the prefix, and within the block its
    predecessors and itself (causal: Stern et al.'s blockwise drafts) or every block position
    (bidirectional: GAD's [MASK] block). Padding rows see only the prefix; padding columns nothing."""
    B = sizes.numel()
    dev = sizes.device
    prefix = torch.arange(P, device=dev)[None, :] < prefix_len.long()[:, None]
    i = torch.arange(n, device=dev)
    real = i[None, :] < sizes.long()[:, None]  # [B, n]
    draft = real[:, :, None] & real[:, None, :]
    if causal:
        draft = draft & (i[None, :, None] >= i[None, None, :])
    return torch.cat([prefix[:, None, :].expand(B, n, P), draft], dim=-1)


def compact_cache(k, v, prefix_len, draft_start: int, accepted, accept_len) -> None:
    """In place: for each request b, slot draft_start + accepted[b, i] -> slot prefix_len[b] + i for
    i < accept_len[b], in k and v [B, H, S, D]. Gathers all sources before writing, so overlapping
    source and destination ranges are handled. Slots past prefix_len[b] + accept_len[b] are left as they are."""
    for b in range(k.shape[0]):
        L = int(accept_len[b])
        if L == 0:
            continue
        src = draft_start + accepted[b, :L].long()
        dst = int(prefix_len[b]) + torch.arange(L, device=k.device)
        for cache in (k, v):
            rows = cache[b].index_select(1, src.to(cache.device))  # a copy: gather first
            cache[b].index_copy_(1, dst, rows)


def compact_cache_layers(k, v, prefix_len, draft_start: int, accepted, accept_len) -> None:
    """``compact_cache`` on each layer's (k[l], v[l]): lists of [B, H_l, S, D_l] tensors of one batch and S."""
    for kl, vl in zip(k, v):
        compact_cache(kl, vl, prefix_len, draft_start, accepted, accept_len)

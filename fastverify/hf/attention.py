"""Attention masks, position ids and cache helpers for the draft-and-verify loop on a Hugging Face model.

The loop never touches a model's attention code: it hands the model a ready 4D additive mask
[B, 1, q, S + q] (transformers returns a 4D mask as-is, ``masking_utils._preprocess_mask_arguments``) and
explicit ``position_ids`` [B, q]; the keys and values live in a plain ``DynamicCache``.

Cache layout (one physical length S for the whole batch, as a DynamicCache requires):

  request b's committed tokens occupy slots [0, cache_len[b]) of the cache, its left padding the first
  pad_len[b] of them; slots [cache_len[b], S) are stale (rejected drafts of earlier steps) and masked.
  S == max(cache_len) always (the cache is cropped after every step).

A step's query block for request b is [root, draft node 0, ..., draft node n_b - 1], padded to q = 1 +
max(n_b) across the batch. The root (the last committed token, not yet in the cache) is made node 0 of a
tree with n_b + 1 nodes, so ``fastverify.tree_mask`` / ``fastverify.tree_positions`` build the whole block:
query i sees request b's prefix slots [pad_len[b], cache_len[b]), its ancestors and itself.
"""

from dataclasses import dataclass

import torch

from fastverify.ops.tree import tree_mask, tree_positions

__all__ = ["StepInputs", "prefill_inputs", "step_inputs", "crop_cache", "cache_length"]


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, q, K] -> [B, 1, q, K] additive mask in ``dtype``: 0 where visible, finfo.min elsewhere.

    finfo.min rather than -inf, as transformers' own masks: a row that sees nothing stays finite."""
    out = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    out.masked_fill_(~visible, torch.finfo(dtype).min)
    return out.unsqueeze(1)


def prefill_inputs(attention_mask: torch.Tensor, dtype: torch.dtype):
    """Mask and positions for the prompt forward.

    attention_mask: int/bool [B, L], 1 on real tokens, left padded.
    Returns (mask [B, 1, L, L] in ``dtype``, position_ids int64 [B, L]). Positions count the real tokens
    before each one (transformers' ``cumsum(mask) - 1``; padding gets 1, as transformers does). A padding
    query also sees itself so that no row is empty (its keys/values stay finite; they are masked later).
    """
    valid = attention_mask.bool()
    B, L = valid.shape
    causal = torch.ones(L, L, dtype=torch.bool, device=valid.device).tril_()
    visible = causal[None] & valid[:, None, :]
    visible |= torch.eye(L, dtype=torch.bool, device=valid.device)[None]
    pos = attention_mask.long().cumsum(-1) - 1
    pos.masked_fill_(~valid, 1)
    return _additive(visible, dtype), pos


@dataclass
class StepInputs:
    """Model inputs of one step and the map from the padded [B, q] block back to verify's row layout.

    input_ids int64 [B, q]; position_ids int64 [B, q]; mask [B, 1, q, S + q] additive in the model's dtype;
    row_batch / row_local int64 [N + B]: logits row r of verify's layout is model output [row_batch[r],
    row_local[r]] (the root at local 0, draft node j at 1 + j)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    row_batch: torch.Tensor
    row_local: torch.Tensor


def step_inputs(draft_tokens, cu_nodes, parents, root_tokens, cache_len, pad_len, dtype) -> StepInputs:
    """Build one step's inputs.

    draft_tokens int64 [N], cu_nodes int32 [B + 1], parents int32 [N] (``fastverify.tree.pack``);
    root_tokens int64 [B]; cache_len, pad_len int32 [B] (see the module docstring; max(cache_len) must equal
    the cache's length S). dtype: the model's floating dtype for the additive mask.
    """
    device = root_tokens.device
    B = root_tokens.numel()
    N = draft_tokens.numel()
    counts = (cu_nodes[1:] - cu_nodes[:-1]).long()
    ar = torch.arange(B, device=device)
    # Root-augmented tree: request b's root is node 0, draft node j becomes node j + 1.
    cu_aug = cu_nodes.long() + torch.arange(B + 1, device=device)
    node_batch = torch.repeat_interleave(ar, counts)
    node_new = torch.arange(N, device=device) + node_batch + 1
    root_new = cu_aug[:-1]
    tokens_aug = torch.empty(N + B, dtype=torch.int64, device=device)
    tokens_aug[root_new] = root_tokens
    tokens_aug[node_new] = draft_tokens
    parents_aug = torch.empty(N + B, dtype=torch.int32, device=device)
    parents_aug[root_new] = -1
    parents_aug[node_new] = parents.to(torch.int32) + 1
    cu_aug32 = cu_aug.to(torch.int32)

    q = int(counts.max()) + 1 if B else 1
    S = int(cache_len.max()) if B else 0
    visible = tree_mask(parents_aug, cu_aug32, cache_len, format="bool", validate=False)  # [B, q, S + q]
    if S:
        slot = torch.arange(S, device=device)
        visible[:, :, :S] &= (slot[None, :] >= pad_len[:, None].long())[:, None, :]
    diag = torch.arange(q, device=device)
    visible[:, diag, S + diag] = True  # padding rows see themselves: never an empty row

    row_batch = torch.repeat_interleave(ar, counts + 1)
    row_local = torch.arange(N + B, device=device) - cu_aug[row_batch]
    positions = tree_positions(parents_aug, cu_aug32, cache_len - pad_len, validate=False)
    input_ids = root_tokens[:, None].expand(B, q).clone()
    input_ids[row_batch, row_local] = tokens_aug
    position_ids = (cache_len - pad_len).long()[:, None].expand(B, q).clone()
    position_ids[row_batch, row_local] = positions
    return StepInputs(input_ids, position_ids, _additive(visible, dtype), row_batch, row_local)


def _layers(cache):
    return getattr(cache, "layers", None) or []


def cache_length(cache) -> int:
    """Number of slots held by a DynamicCache (0 when empty)."""
    for layer in _layers(cache):
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel():
            return keys.shape[-2]
    return 0


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` slots of every layer of a DynamicCache, in place.

    Written against the layers' tensors because ``DynamicCache.crop``'s meaning changed across transformers
    versions (absolute length in 4.x, a negative count per layer in 5.x)."""
    for layer in _layers(cache):
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel() and keys.shape[-2] > length:
            layer.keys = keys[..., :length, :]
            layer.values = layer.values[..., :length, :]

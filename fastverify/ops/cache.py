"""Key/value cache compaction after verification: keep the accepted path, in consecutive slots.

Backends: torch (fastverify/reference/tree.py: index_select then index_copy), cpp (csrc/cpu/tree.cpp, parallel
over (request, head), gathering the accepted rows into a buffer before writing them back), triton
(fastverify.kernels.tree.compact_cache when it exists), cuda (csrc/cuda/tree.cu). A cache of several layers goes
to the cpp / cuda kernels in one call (``compact_cache_layers``: the arguments checked once, then every layer's
moves), not one call per layer (SmolLM2's 30 layers, unchecked: 155 -> 94 us a call; the kernel calls alone
75 -> 19 us).
"""

import torch

from fastverify import _ext
from fastverify.ops import dispatch
from fastverify.ops.checks import index_tensor

__all__ = ["compact_cache"]


def _check_pair(k, v, where):
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"cache{where}: expected {name} to be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"cache{where}: expected {name} of shape [B, H, S, D], got {tuple(t.shape)}")
    if k.shape[0] != v.shape[0] or k.shape[2] != v.shape[2] or k.device != v.device:
        raise ValueError(f"cache{where}: k and v must share batch, sequence length and device, got "
                         f"{tuple(k.shape)} on {k.device} and {tuple(v.shape)} on {v.device}")


def _normalise(B, S, device, prefix_len, draft_start, accepted, accept_len, validate):
    plen = index_tensor(prefix_len, "prefix_len", device, length=B, validate=validate)
    if isinstance(draft_start, torch.Tensor):
        if draft_start.numel() != 1:
            raise ValueError("draft_start: expected an int (the cache slot of draft node 0)")
        draft_start = int(draft_start)  # a host read: pass an int for a call without one
    if not isinstance(draft_start, int) or isinstance(draft_start, bool):
        raise TypeError(f"draft_start: expected an int, got {type(draft_start).__name__}")
    if not isinstance(accepted, torch.Tensor) or accepted.dtype.is_floating_point or accepted.dtype == torch.bool:
        raise TypeError("accepted: expected an integer tensor [B, max_depth] (VerifyOutput.accepted)")
    if accepted.dim() != 2 or accepted.shape[0] != B:
        raise ValueError(f"accepted: expected shape [B={B}, max_depth], got {tuple(accepted.shape)}")
    if accepted.device != device:
        raise ValueError(f"accepted: expected a tensor on {device}, got {accepted.device}")
    acc = accepted.to(torch.int32).contiguous()
    alen = index_tensor(accept_len, "accept_len", device, length=B, validate=validate)
    depth = acc.shape[1]
    if draft_start < 0:
        raise ValueError(f"draft_start: must be >= 0, got {draft_start}")
    if B == 0 or not validate:
        return plen, draft_start, acc, alen
    if bool(((alen < 0) | (alen > depth)).any()):
        raise ValueError(f"accept_len: expected values in [0, max_depth = {depth}], got {alen.tolist()}")
    if bool((plen < 0).any()) or bool((plen + alen > S).any()):
        raise ValueError(f"prefix_len: prefix_len + accept_len must lie in [0, S = {S}], got prefix_len = "
                         f"{plen.tolist()}, accept_len = {alen.tolist()}")
    used = torch.arange(depth, device=device)[None, :] < alen[:, None]
    src = draft_start + acc.long()
    if bool((used & ((acc < 0) | (src >= S))).any()):
        raise ValueError(f"accepted: the accepted slots draft_start + accepted[b, i] (i < accept_len[b]) must lie "
                         f"in [draft_start, S = {S}); got draft_start = {draft_start}, accepted = {acc.tolist()}")
    return plen, draft_start, acc, alen


def _arguments(k, prefix_len, draft_start, accepted, accept_len, validate, seen):
    """The normalised (and, with validate, checked) arguments for k's (B, S, device), kept in the dict ``seen``, which
    the layers of one cache share: normalised once per (B, S, device), not once per layer."""
    key = (k.shape[0], k.shape[2], k.device)
    if key not in seen:
        seen[key] = _normalise(*key, prefix_len, draft_start, accepted, accept_len, validate)
    return seen[key]


def _compact_layers(pairs, prefix_len, draft_start, accepted, accept_len, backend, validate, names):
    """Every (k, v) pair of ``pairs`` (named ``names`` in errors) compacted; the pairs of one (B, S, device) in one
    ``compact_cache_layers`` call where their backend implements it (the cpp and cuda kernels: one call in place
    of one per layer), else pair by pair. Returns the normalised (prefix_len, accept_len) of the first pair."""
    seen, groups = {}, {}
    for (k, v), where in zip(pairs, names):
        _check_pair(k, v, where)
        _arguments(k, prefix_len, draft_start, accepted, accept_len, validate, seen)
        groups.setdefault((k.shape[0], k.shape[2], k.device), []).append((k, v))
    for key, group in groups.items():
        plen, ds, acc, alen = seen[key]
        device = key[2]
        name = dispatch.resolve("compact_cache", backend, device)
        if len(group) > 1 and name in dispatch.implemented_backends("compact_cache_layers"):
            dispatch.call("compact_cache_layers", name, device, [k for k, _ in group], [v for _, v in group],
                          plen, ds, acc, alen)
        else:
            for k, v in group:
                dispatch.call("compact_cache", name, device, k, v, plen, ds, acc, alen)
    first = next(iter(seen.values()), None)
    return (first[0], first[3]) if first is not None else (None, None)


def cache_layers(cache):
    """[(index, layer, keys, values)] of every initialised layer of a transformers DynamicCache (a layer without
    tensors yet, e.g. under KV sharing, is left out); a sliding-window layer is refused (ValueError)."""
    out = []
    for i, layer in enumerate(getattr(cache, "layers", None) or []):
        if getattr(layer, "is_sliding", False):
            raise ValueError(f"cache.layers[{i}]: sliding-window layers are not supported by compact_cache")
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and keys.numel():
            out.append((i, layer, keys, values))
    return out


def compact_cache(cache, prefix_len, draft_start, accepted, accept_len, backend: str = "auto", validate: bool = True):
    """Move each request's accepted draft keys/values into consecutive slots after its prefix, in place.

    cache: a transformers ``DynamicCache`` (every layer's ``keys`` / ``values``), a (k, v) pair of
    [B, H, S, D] tensors (k and v may differ in H and D), or a list of such pairs (one per layer).
    prefix_len int or integer tensor [B]: committed tokens before the draft; draft_start int: cache slot of
    draft node 0 (P in csrc/tree.cpp's key layout); accepted int32 [B, max_depth] and accept_len int32 [B]
    as returned by ``fastverify.verify``. For i < accept_len[b], slot draft_start + accepted[b, i] moves to
    slot prefix_len[b] + i; all sources are read before any write, so overlapping ranges are safe.

    Slots past prefix_len[b] + accept_len[b] are left stale. A (k, v) pair keeps its shape: the caller masks
    or overwrites those slots. A DynamicCache is truncated to L = max_b(prefix_len[b] + accept_len[b]): when
    every request has the same new length this is exactly transformers' ``crop``; with ragged lengths the
    shorter requests keep stale slots in [their length, L), which the caller must mask (left as padding
    columns in the next step's attention mask) or overwrite. Sliding-window layers are refused. The layers of a
    list or a DynamicCache go to the cpp / cuda kernels in one ``compact_cache_layers`` call (per batch size,
    slot count and device), and a DynamicCache's new length is read back from the device: a caller that knows
    its lengths passes the layers' pairs and crops itself (the patched loop: ``fastverify.hf.attention``'s
    ``cache_pairs`` and ``crop_cache``). Returns the cache.
    """
    if isinstance(cache, tuple) and len(cache) == 2 and all(isinstance(t, torch.Tensor) for t in cache):
        _compact_layers([cache], prefix_len, draft_start, accepted, accept_len, backend, validate, [""])
        return cache
    if isinstance(cache, (list, tuple)):
        for i, pair in enumerate(cache):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
                raise TypeError(f"cache[{i}]: expected a (k, v) pair of tensors")
        _compact_layers(cache, prefix_len, draft_start, accepted, accept_len, backend, validate,
                        [f"[{i}]" for i in range(len(cache))])
        return cache
    if getattr(cache, "layers", None) is None:
        raise TypeError(f"cache: expected a transformers DynamicCache or a (k, v) pair of tensors, got "
                        f"{type(cache).__name__}")
    live = cache_layers(cache)
    plen, alen = _compact_layers([(k, v) for _, _, k, v in live], prefix_len, draft_start, accepted, accept_len,
                                 backend, validate, [f".layers[{i}]" for i, _, _, _ in live])
    if live:
        new_len = int((plen + alen).max()) if plen.numel() else 0
        for _, layer, keys, values in live:
            layer.keys = keys[..., :new_len, :]
            layer.values = values[..., :new_len, :]
    return cache


if _ext.HAS_CPP:
    @torch.library.register_fake("fastverify::compact_cache")
    def _compact_cache_fake(k, v, prefix_len, draft_start, accepted, accept_len):
        return None

    @torch.library.register_fake("fastverify::compact_cache_layers")
    def _compact_cache_layers_fake(k, v, prefix_len, draft_start, accepted, accept_len):
        return None

"""Tree attention: the draft queries attend over their prefix and their ancestors, mask applied in-kernel.

Backends: torch (fastverify/reference/attention.py: builds the dense mask, the spec), cpp (csrc/cpu/tree.cpp: the
masked-attention kernel, blocks of 16 query rows with their mask rows made from the packed bits, a request's unused
cache slots never read; bfloat16 / float16 keys and values converted to float32 a head at a time; never an
[n, P + n] mask), triton (fastverify.kernels.attention.tree_attention, the GPU kernel). There is no CUDA C++ kernel: on CUDA
tensors ``backend="auto"`` runs the Triton kernel (the reference where Triton is absent), and ``backend="cuda"``
raises as for any op without a CUDA kernel.

Masked attention (``masked_attention``): scaled_dot_product_attention with an additive mask and grouped-query
heads for the query rows of a verify forward or a prompt's chunk, on the CPU (csrc/attention.h): what the patched
loop's attention runs there (fastverify.hf.attention). On the cpp backend a query row's result is a function of the
keys it sees alone, in their order, bit for bit (masked keys between or after them change nothing), which is what
makes the loop's drafted rows its undrafted rows. Backends: torch (SDPA itself, the spec) and cpp.
"""

import math

import torch

from fastverify import _ext
from fastverify.ops import dispatch
from fastverify.ops.checks import index_tensor

__all__ = ["tree_attention", "masked_attention"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed_mask: torch.Tensor, prefix_len,
                   scale: float = None, backend: str = "auto") -> torch.Tensor:
    """Attention of n draft queries over prefix and draft keys.

    q [B, Hq, n, D]; k, v [B, Hkv, P + n, D] (the same dtype: fp32, bf16 or fp16; Hq a multiple of Hkv, query
    head h reading kv head h // (Hq // Hkv)); packed_mask int32 [B, n, ceil(n / 32)] from
    ``tree_mask(..., format="packed")``; prefix_len int or integer tensor [B], each <= P = k.shape[2] - n.
    Query i of request b sees keys [0, prefix_len[b]) and the draft keys P + j whose bit j is set in row i.
    Returns [B, Hq, n, D] in q's dtype; softmax and accumulation in float32; scale defaults to 1 / sqrt(D).
    A query that sees no key (padding row of a request with an empty prefix) returns zeros. The unused prefix
    slots [prefix_len, P) do not reach the result: a preallocated cache may hold anything there. A NaN in a query,
    or in a key or value it sees, makes its row NaN; the draft keys' values must be finite, since a query
    multiplies those it does not see by weight 0 (as SDPA does with masked keys).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("packed_mask", packed_mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v: expected 4-D [B, H, seq, D] tensors, got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q: expected one of {_DTYPES}, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k, v: expected q's dtype {q.dtype}, got {k.dtype} and {v.dtype}")
    if k.device != q.device or v.device != q.device or packed_mask.device != q.device:
        raise ValueError("q, k, v, packed_mask: expected tensors on one device, got "
                         f"{q.device}, {k.device}, {v.device}, {packed_mask.device}")
    B, Hq, n, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k: expected [B={B}, Hkv, P + n, D={D}], got {tuple(k.shape)}")
    Hkv, S = k.shape[1], k.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"k: the number of query heads ({Hq}) must be a multiple of the kv heads ({Hkv})")
    if S < n:
        raise ValueError(f"k: expected at least n = {n} key slots (P + n), got {S}")
    W = (n + 31) // 32
    if packed_mask.dtype != torch.int32:
        raise TypeError(f"packed_mask: expected int32 (tree_mask(..., format='packed')), got {packed_mask.dtype}")
    if tuple(packed_mask.shape) != (B, n, W):
        raise ValueError(f"packed_mask: expected shape [B, n, ceil(n / 32)] = {(B, n, W)}, "
                         f"got {tuple(packed_mask.shape)}")
    plen = index_tensor(prefix_len, "prefix_len", q.device, length=B)
    P = S - n
    if B and (bool((plen < 0).any()) or int(plen.max()) > P):
        raise ValueError(f"prefix_len: expected values in [0, P = k.shape[2] - n = {P}], got {plen.tolist()}")
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D else 1.0
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    # The kernels need only a unit stride in the head dimension; other strides are read as given.
    q, k, v = (t if t.stride(-1) == 1 or t.numel() == 0 else t.contiguous() for t in (q, k, v))
    return dispatch.call("tree_attention", backend, q.device, q, k, v, packed_mask.contiguous(), plen, scale)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor = None,
                     scale: float = None, backend: str = "auto", skip_masked_prefix: bool = False,
                     softcap: float = None, sinks: torch.Tensor = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with grouped-query heads, as ``F.scaled_dot_product_attention(q, k, v,
    attn_mask=mask, scale=scale, enable_gqa=True)`` computes it, to float32 rounding.

    q [B, Hq, n, D]; k [B, Hkv, S, D]; v [B, Hkv, S, Dv] (Hq a multiple of Hkv: query head h reads key / value
    head h // (Hq // Hkv); Dv is D but for latent attention's narrower values, as SDPA allows); mask: additive
    [B, 1 or Hq, n, S] in q's dtype (0 where visible, a large negative number such as finfo.min elsewhere), or None.
    scale defaults to 1 / sqrt(D). Returns [B, Hq, n, Dv]. The cpp backend
    takes float32 CPU tensors ("auto" uses it for those and the reference elsewhere); it is meant for a few query
    rows per head (a verify forward's), where it streams each key / value head once for all of its query rows.
    skip_masked_prefix: per batch row, the leading keys that every query row masks (at or below -1e30; a
    left-padded prompt's padding) are not read, from the last multiple of 16 at or before the first key any row
    sees (``fastverify.reference.attention.masked_prefix``); their weight would be 0, so the result is the same,
    unless they hold NaN or inf (which then does not reach it). The patched loop's attention sets it.
    Two variants of eager attention: ``softcap`` (a number > 0, or None) caps the scores q k^T * scale at
    softcap * tanh(q k^T * scale / softcap) before the mask (Gemma 2); ``sinks`` [Hq] (or None) gives query head h's
    softmax one more logit, sinks[h], with no value row (gpt-oss's attention sinks). A query row whose mask is -inf
    for every key gets 0, as in SDPA (with a soft cap or sinks: NaN, as in eager attention); a NaN reaching a row's
    scores makes it NaN.
    """
    optional = (("mask", mask),) if mask is not None else ()
    optional += (("sinks", sinks),) if sinks is not None else ()
    for name, t in (("q", q), ("k", k), ("v", v)) + optional:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v: expected 4-D [B, H, seq, D] tensors, got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, n, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or v.shape[:3] != k.shape[:3] or v.shape[3] < 1:
        raise ValueError(f"k, v: expected k [B = {B}, Hkv, S, D = {D}] and v [B, Hkv, S, Dv >= 1], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[1] < 1 or Hq % k.shape[1]:
        raise ValueError(f"q, k: the query heads ({Hq}) must be a multiple of the key / value heads ({k.shape[1]})")
    if k.shape[2] < 1:
        raise ValueError("k, v: expected at least one key (S >= 1)")
    if mask is not None and (mask.dim() != 4 or tuple(mask.shape) != (B, mask.shape[1], n, k.shape[2])
                             or mask.shape[1] not in (1, Hq)):
        raise ValueError(f"mask: expected [B = {B}, 1 or Hq = {Hq}, n = {n}, S = {k.shape[2]}], got "
                         f"{tuple(mask.shape)}")
    if sinks is not None and tuple(sinks.shape) != (Hq,):
        raise ValueError(f"sinks: expected [Hq = {Hq}], got {tuple(sinks.shape)}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap: expected a finite number > 0 or None, got {softcap!r}")
    tensors = (q, k, v) + tuple(t for _, t in optional)
    if any(t.device != q.device for t in tensors):
        raise ValueError(f"q, k, v, mask, sinks: expected one device, got {[str(t.device) for t in tensors]}")
    if any(t.dtype != q.dtype for t in tensors) or q.dtype not in _DTYPES:
        raise TypeError(f"q, k, v, mask, sinks: expected one dtype of {_DTYPES}, got {[t.dtype for t in tensors]}")
    if D < 1:
        raise ValueError(f"q, k: expected a head size D >= 1, got {tuple(q.shape)}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    fits_cpp = q.dtype == torch.float32 and q.device.type == "cpu"
    if backend == "auto":
        backend = "cpp" if fits_cpp and "cpp" in dispatch.implemented_backends("masked_attention") else "torch"
    if dispatch.resolve("masked_attention", backend, q.device) == "cpp" and not fits_cpp:
        raise TypeError(f"q, k, v, mask: the cpp backend takes float32 CPU tensors, got {q.dtype} on {q.device}")
    if not isinstance(skip_masked_prefix, bool):
        raise TypeError(f"skip_masked_prefix: expected a bool, got {skip_masked_prefix!r}")
    return dispatch.call("masked_attention", backend, q.device, q, k, v, mask, scale, skip_masked_prefix,
                         float(softcap or 0.0), sinks)


if _ext.HAS_CPP:
    @torch.library.register_fake("fastverify::tree_attention")
    def _tree_attention_fake(q, k, v, packed_mask, prefix_len, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    try:
        @torch.library.register_fake("fastverify::masked_attention")
        def _masked_attention_fake(q, k, v, mask, scale, skip_masked_prefix=False, softcap=0.0, sinks=None):
            return q.new_empty(q.shape[:3] + v.shape[3:])
    except RuntimeError:  # the schema is missing from an old build of _C
        pass
    if _ext.compiled_op("append_attention") is not None:
        @torch.library.register_fake("fastverify::append_attention")
        def _append_attention_fake(q, k, v, k_cache, v_cache, start, mask, scale):
            return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])

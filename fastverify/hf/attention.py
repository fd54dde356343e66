"""Attention masks, position ids and cache helpers for the draft-and-verify loop on a Hugging Face model.

The loop never edits a model's attention code: it hands the model a ready 4D additive mask
[B, 1, q, S + q] (transformers returns a 4D mask as-is, ``masking_utils._preprocess_mask_arguments``) and
explicit ``position_ids`` [B, q]; the keys and values live in a ``DynamicCache`` (``new_cache``: its layers write
into preallocated buffers instead of concatenating). On the CPU an ``sdpa`` model runs, for the loop's duration,
under ``gqa_attention``: transformers' sdpa attention registered through its ``AttentionInterface``, except that
float32 verify rows go to fastverify's ``masked_attention`` and grouped-query heads are not repeated
(``_gqa_sdpa``); a modeling file that calls torch's SDPA itself (Falcon's, before transformers 5.25) keeps sdpa, and
its calls take the same route (``_sdpa_rows``).

Cache layout (one physical length S for the whole batch, as a DynamicCache requires):

  request b's committed tokens occupy slots [0, cache_len[b]) of the cache, its left padding the first
  pad_len[b] of them; slots [cache_len[b], S) are stale (rejected drafts of earlier steps) and masked.
  S == max(cache_len) always (the cache is cropped after every step).

A step's query block for request b is [root, draft node 0, ..., draft node n_b - 1], padded to q = 1 +
max(n_b) across the batch. The root (the last committed token, not yet in the cache) is made node 0 of a
tree with n_b + 1 nodes, so ``fastverify.tree_mask`` builds the whole block: query i sees request b's prefix
slots [pad_len[b], cache_len[b]), its ancestors and itself; its position is the number of real tokens before
the root + its depth (``fastverify.tree_positions``' rule, computed here from the trees' depths).

Slot blocks (drafters that fill placeholder rows in the verify forward, fastverify.hf.slots): a block of m slot
rows attached to node a (or to the root) is laid out as m more nodes after the request's draft nodes, a chain
under a: slot i (1-based) sits at a's position + i and sees the prefix, a with its ancestors, and the slots
before it (causal: LUD, PTP); a bidirectional block (GAD) also sees the slots after it. Slot rows are left out
of verify's layout, and the cache slots they write are stale after the step (never kept).
"""

import contextlib
import functools
import inspect
import sys
import threading
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastverify.hf.linear import (MAX_ROWS, config_of, module_classes, modules, on_loop_threads, substitutes_here,
                                  substituting)
from fastverify.ops.cache import cache_layers
from fastverify.ops.tree import tree_mask

__all__ = ["StepInputs", "prefill_inputs", "step_inputs", "crop_cache", "cache_length", "cache_kwargs",
           "forward_takes", "new_cache", "gqa_attention", "eager_attention", "own_attention", "bound_methods",
           "files_of", "module_globals", "switched", "ModuleWith"]

_FORWARD_PARAMS = {}  # model class -> the parameter names of its forward (reading a signature costs ~25 us)


def forward_takes(model, name: str) -> bool:
    """Whether ``model``'s forward has a parameter ``name`` (False where its signature cannot be read); looked up
    once per model class, since the loop asks at every step."""
    key = type(model)
    if key not in _FORWARD_PARAMS:
        try:
            _FORWARD_PARAMS[key] = frozenset(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            _FORWARD_PARAMS[key] = frozenset()
    return name in _FORWARD_PARAMS[key]


def cache_kwargs(model, cache) -> dict:
    """The keyword that hands ``cache`` to ``model``'s forward: ``cache`` where the forward takes it (transformers
    >= 5.2x renamed the argument and warns on the old name), ``past_key_values`` before."""
    return {"cache": cache} if forward_takes(model, "cache") else {"past_key_values": cache}


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, q, K] -> [B, 1, q, K] additive mask in ``dtype``: 0 where visible, finfo.min elsewhere.

    finfo.min rather than -inf, as transformers' own masks: a row that sees nothing stays finite."""
    out = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=visible.device)
    return out.masked_fill_(visible, 0).unsqueeze(1)


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
    """Model inputs of one step, the draft in verify's batch layout, and the map between the two.

    input_ids int64 [B, q]; position_ids int64 [B, q]; mask [B, 1, q, S + q] additive in the model's dtype;
    draft_tokens int64 [N], cu_nodes int32 [B + 1], parents int32 [N] (as ``fastverify.tree.pack``);
    row_batch / row_local int64 [N + B]: logits row r of verify's layout is model output [row_batch[r],
    row_local[r]] (the root at local 0, draft node j at 1 + j). slot_rows bool [B, q] or None: the rows of slot
    blocks (the gate of fastverify.lora); slot_local: per request, per block, the local rows of its slots."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    draft_tokens: torch.Tensor
    cu_nodes: torch.Tensor
    parents: torch.Tensor
    row_batch: torch.Tensor
    row_local: torch.Tensor
    slot_rows: torch.Tensor = None
    slot_local: list = None
    cu_host: list = None  # cu_nodes and draft_tokens as Python lists (the loop reads them without a device copy)
    tokens_host: list = None


def step_inputs(trees, root_tokens, cache_len, pad_len, dtype, device, blocks=None, block_size=0,
                bidirectional=False, slot_token=0) -> StepInputs:
    """Build one step's inputs.

    trees: B ``fastverify.tree.Tree`` (possibly empty); root_tokens, cache_len, pad_len: lists of B ints
    (see the module docstring; max(cache_len) must equal the cache's length S). dtype: the model's floating
    dtype for the additive mask. The small per-node bookkeeping is done on Python lists (trees hold tens of
    nodes; a handful of tensor constructions beats a chain of tiny tensor ops); the mask comes from
    ``fastverify.tree_mask`` on the root-augmented trees.

    blocks: None, or per request a list of attachment nodes (local node index, -1 = the root), each getting a
    block of ``block_size`` slot rows (module docstring); ``bidirectional``: slots of a block see each other;
    slot_token: the input id of slot rows (their embeddings are the drafter's, see fastverify.hf.slots).
    """
    B = len(trees)
    m = block_size if blocks is not None else 0
    q = max(len(t) + m * (len(blocks[b]) if blocks is not None else 0) for b, t in enumerate(trees)) + 1
    S = max(cache_len)
    ids, pos, row_batch, row_local = [], [], [], []
    flat_tokens, flat_parents, cu = [], [], [0]
    parents_aug, cu_aug = [], [0]
    padded = False  # whether a request has rows past its nodes (q is the longest request's)
    slot_local = [] if blocks is not None else None
    for b, tree in enumerate(trees):
        toks, par = tree.tokens.tolist(), tree.parents.tolist()
        n = len(toks)
        base = cache_len[b] - pad_len[b]  # the root's position: real tokens before it
        depth = tree.depth.tolist() if n else []
        row_batch += [b] * (n + 1)
        row_local += range(n + 1)
        flat_tokens += toks
        flat_parents += par
        cu.append(cu[-1] + n)
        aug = [-1] + [p + 1 for p in par]  # root-augmented: node j -> j + 1, child of the root -> child of 0
        row_pos = [base] + [base + d for d in depth]
        row_ids = [root_tokens[b]] + toks
        if blocks is not None:
            slot_local.append([])
            for a in blocks[b]:
                if not -1 <= a < n:
                    raise ValueError(f"blocks: request {b} attaches slots to node {a}; expected -1 (the root) or a "
                                     f"draft node (0 <= node < {n})")
                first = len(aug)
                aug += [a + 1] + list(range(first, first + m - 1))  # a chain under the attachment
                row_pos += [row_pos[a + 1] + i for i in range(1, m + 1)]
                row_ids += [slot_token] * m
                slot_local[b].append(list(range(first, first + m)))
        fill = q - len(aug)
        padded |= fill > 0
        ids.append(row_ids + [root_tokens[b]] * fill)
        pos.append(row_pos + [base] * fill)
        parents_aug += aug
        cu_aug.append(cu_aug[-1] + len(aug))

    # every list reaches the device in one copy per dtype (each torch.tensor(list, device=cuda) would be a copy of
    # its own, and the host waits for each)
    long = upload_lists([ids, pos, flat_tokens, row_batch, row_local, pad_len], torch.int64, device)
    ids_t, pos_t = long[0].view(B, q), long[1].view(B, q)
    parents_t, cu_aug_t, cache_t, cu_t, flat_parents_t = upload_lists(
        [parents_aug, cu_aug, cache_len, cu, flat_parents], torch.int32, device)

    def t(x, dt=torch.int64):
        return torch.tensor(x, dtype=dt, device=device)

    visible = tree_mask(parents_t, cu_aug_t, cache_t, format="bool", validate=False, max_nodes=q,
                        max_prefix=S)  # [B, q, S + q], no read-back
    if S and any(pad_len):
        slot = torch.arange(S, device=device)
        visible[:, :, :S] &= (slot[None, :] >= long[5][:, None])[:, None, :]
    if padded:  # padding rows see themselves: never an empty row (a node's row sees itself already)
        diag = torch.arange(q, device=device)
        visible[:, diag, S + diag] = True
    slot_rows = None
    if blocks is not None:
        slot_rows = torch.zeros(B, q, dtype=torch.bool, device=device)
        for b, rows in enumerate(slot_local):
            for block in rows:
                r = t(block)
                slot_rows[b, r] = True
                if bidirectional:  # every slot of the block sees every other (GAD's non-autoregressive block)
                    visible[b, r[:, None], S + r[None, :]] = True
    return StepInputs(ids_t, pos_t, _additive(visible, dtype), long[2], cu_t, flat_parents_t, long[3], long[4],
                      slot_rows, slot_local, cu, flat_tokens)


def upload_lists(parts, dtype, device):
    """Lists of ints (a list of rows for a 2-D part) -> one tensor each on ``device``, from one host tensor and one
    copy; each part a contiguous slice of it."""
    flat = [[v for row in x for v in row] if x and isinstance(x[0], list) else x for x in parts]
    sizes = [len(x) for x in flat]
    whole = torch.tensor([v for x in flat for v in x], dtype=dtype).to(device)
    return list(whole.split(sizes))


def _layers(cache):
    return getattr(cache, "layers", None) or []


def cache_length(cache) -> int:
    """Number of slots held by a DynamicCache (0 when empty)."""
    for layer in _layers(cache):
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel():
            return keys.shape[-2]
    return 0


def cache_pairs(cache) -> list:
    """Every initialised layer's (keys, values) of a DynamicCache, as ``compact_cache`` takes a cache's layers: a
    buffered layer's buffers (``_buffered_layer_class``; no view made, and their slots past the layer's length are
    never moved into), another layer's tensors."""
    pairs = []
    for _, layer, keys, values in cache_layers(cache):  # (sliding windows refused; the loop's caches have none)
        bufs = layer.buffers() if callable(getattr(layer, "buffers", None)) else None
        pairs.append(bufs if bufs is not None else (keys, values))
    return pairs


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` slots of every layer of a DynamicCache, in place.

    Written against the layers' tensors because ``DynamicCache.crop``'s meaning changed across transformers
    versions (absolute length in 4.x, a negative count per layer in 5.x)."""
    for layer in _layers(cache):
        crop = getattr(layer, "crop_to", None)  # the loop's buffered layers: their lengths, no views made
        if crop is not None and crop(length):
            continue
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel() and keys.shape[-2] > length:
            layer.keys = keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


@functools.cache
def _buffered_layer_class():
    """A transformers ``DynamicLayer`` that appends into a preallocated buffer (grown by half when full) instead of
    ``torch.cat``: a DynamicLayer copies the whole layer's cache at every step, an O(context) copy per layer that
    the loop's cropping (a view) does not avoid. ``keys`` / ``values`` read as [B, H, length, D] views of the
    buffers (made when read: a view made from Python costs a few microseconds, and the loop's own append and
    attention, ``append_attention``, reads the buffers instead), so ``crop_cache`` and ``compact_cache`` work on
    them in place; a tensor assigned from outside that is not such a view (another storage, another batch) is kept
    as it is and copied into a new buffer at the next update."""
    from transformers.cache_utils import DynamicLayer

    class BufferedLayer(DynamicLayer):
        # the buffers, the rows of each that hold the layer's keys / values, and a tensor assigned from outside
        # that is not a prefix of its buffer (None: the buffer's prefix is the tensor)
        _kbuf = _vbuf = _kout = _vout = None
        _klen = _vlen = 0

        @staticmethod
        def _prefix(t, buf):
            return (buf is not None and isinstance(t, torch.Tensor) and t.data_ptr() == buf.data_ptr()
                    and t.stride() == buf.stride() and t.dtype == buf.dtype and t.shape[:2] == buf.shape[:2]
                    and t.shape[-1] == buf.shape[-1])

        @property
        def keys(self):
            return self._kout if self._kout is not None or self._kbuf is None else self._kbuf[:, :, :self._klen]

        @keys.setter
        def keys(self, t):
            if self._prefix(t, self._kbuf):
                self._kout, self._klen = None, t.shape[-2]
            else:
                self._kout, self._kbuf = t, None

        @property
        def values(self):
            return self._vout if self._vout is not None or self._vbuf is None else self._vbuf[:, :, :self._vlen]

        @values.setter
        def values(self, t):
            if self._prefix(t, self._vbuf):
                self._vout, self._vlen = None, t.shape[-2]
            else:
                self._vout, self._vbuf = t, None

        def buffers(self):
            """(keys buffer, values buffer), [B, H, capacity, D] each, when the layer's tensors are their prefixes
            (what ``compact_cache`` may move slots in without a view made), else None."""
            if self._kbuf is None or self._vbuf is None or self._kout is not None or self._vout is not None:
                return None
            return self._kbuf, self._vbuf

        def crop_to(self, length: int) -> bool:
            """Keep the first ``length`` rows, if the layer's tensors are its buffers' prefixes (True), else
            nothing (False)."""
            if self._kbuf is None or self._vbuf is None or self._kout is not None or self._vout is not None:
                return False
            self._klen, self._vlen = min(self._klen, length), min(self._vlen, length)
            return True

        def room(self, n: int, batch_heads) -> int:
            """The row where ``n`` new rows of keys / values go when they fit the buffers as they stand (the
            layer's tensors their prefixes, of the same length; batch and heads ``batch_heads``), else -1."""
            kbuf = self._kbuf
            if (kbuf is None or self._vbuf is None or self._klen != self._vlen
                    or self._klen + n > kbuf.shape[2] or kbuf.shape[:2] != batch_heads):
                return -1
            return self._klen

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            old = self.room(n, key_states.shape[:2])
            if old < 0:  # new buffers, the layer's rows copied over
                keys, values = self.keys, self.values
                old = keys.shape[-2] if keys is not None and keys.numel() else 0
                cap = old + n + max(64, (old + n) // 2)
                kbuf = key_states.new_empty(key_states.shape[:2] + (cap, key_states.shape[-1]))
                vbuf = value_states.new_empty(value_states.shape[:2] + (cap, value_states.shape[-1]))
                if old:
                    kbuf[:, :, :old].copy_(keys)
                    vbuf[:, :, :old].copy_(values)
                self._kbuf, self._vbuf, self._kout, self._vout = kbuf, vbuf, None, None
            self._kbuf[:, :, old:old + n].copy_(key_states)
            self._vbuf[:, :, old:old + n].copy_(value_states)
            self._klen = self._vlen = old + n
            return self.keys, self.values

    return BufferedLayer


def new_cache():
    """An empty ``DynamicCache`` whose layers append into preallocated buffers (``_buffered_layer_class``); a plain
    one where this transformers' DynamicCache does not build its layers lazily from a layer class."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
    cache = DynamicCache()
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer and not cache.layers:
        cache.layer_class_to_replicate = _buffered_layer_class()
    return cache


GQA_ATTENTION = "fastverify_sdpa"


# Query rows per head up to which the loop's attention on the CPU runs fastverify's masked_attention (below): every
# forward the loop's kernels take (a verify forward, a long prompt's chunk; fastverify.hf.linear.MAX_ROWS). On
# SmolLM2-135M's shapes it beats SDPA at every size measured (128 rows over 768 keys 0.95 against 1.44 ms; over
# 4096 keys 5.9 against 8.8 ms), and it makes every row of the loop's forwards row-invariant (csrc/attention.h).
MASKED_ATTENTION_ROWS = MAX_ROWS


def _masked_cpu_call(query, kv_heads: int, attention_mask, dropout, kwargs) -> bool:
    """What both of ``_gqa_sdpa``'s own routes need: a CPU query [B, Hq, n, D] whose heads group over ``kv_heads``,
    a mask, no dropout, and nothing transformers' function would add (position bias, softcap, attention weights)."""
    return (attention_mask is not None and query.device.type == "cpu" and query.shape[1] % kv_heads == 0
            and not dropout and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions", False))


def masked_rows(query, kv_heads: int, kv_len: int, kv_dtype, attention_mask, dropout, kwargs) -> bool:
    """Whether ``_gqa_sdpa`` computes the attention of ``query`` [B, Hq, n, D] over ``kv_len`` keys of ``kv_heads``
    heads with ``fastverify::masked_attention``: float32 CPU tensors, at most ``MASKED_ATTENTION_ROWS`` query rows,
    an additive 4D mask [B, 1 or Hq, n, kv_len], no dropout, nothing transformers' function would add."""
    return (_masked_cpu_call(query, kv_heads, attention_mask, dropout, kwargs)
            and query.shape[2] <= MASKED_ATTENTION_ROWS
            and query.dtype == kv_dtype == attention_mask.dtype == torch.float32
            and attention_mask.dim() == 4 and attention_mask.shape[0] == query.shape[0]
            and attention_mask.shape[1] in (1, query.shape[1])
            and attention_mask.shape[2:] == (query.shape[2], kv_len) and _masked_attention_op() is not None)


def _masked_fits(query, key, value, attention_mask, dropout, kwargs) -> bool:
    """``masked_rows`` for an attention function's query, key and value (one dtype for both)."""
    return masked_rows(query, key.shape[1], key.shape[2], key.dtype if key.dtype == value.dtype else None,
                       attention_mask, dropout, kwargs)


def _masked(query, key, value, attention_mask, scaling, softcap=None, sinks=None):
    """``fastverify::masked_attention`` in the layout transformers' attention functions return ([B, n, Hq, Dv]);
    ``scaling`` None: 1 / sqrt(D)."""
    out = _masked_attention_op()(query, key, value, attention_mask,
                                 query.shape[-1] ** -0.5 if scaling is None else scaling, True, float(softcap or 0.0),
                                 sinks)
    return out.transpose(1, 2).contiguous()


@functools.cache
def _sdpa_drops_softcap() -> bool:
    """Whether transformers' sdpa attention function computes a call with a soft cap as one without it (releases
    before 5.21, where Gemma 2 could load with sdpa; later ones refuse the call): asked of the function once."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    q = torch.zeros(1, 1, 1, 2, dtype=torch.float32)
    try:
        sdpa_attention_forward(torch.nn.Module(), q, q, q, None, softcap=1.0)
    except ValueError:
        return False
    return True


def _gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' ``sdpa`` attention, except on the CPU with a mask:

    - float32, at most ``MASKED_ATTENTION_ROWS`` query rows (the loop's verify forwards; ``masked_rows``), values as
      wide as the keys or narrower (latent attention's):
      ``fastverify::masked_attention`` (csrc/attention.h), SDPA's softmax(q k^T * scale + mask) v to float32
      rounding, each key / value head read once for all of its grouped query heads; on SmolLM2-135M's shapes (9
      query heads on 3 key / value heads, D = 64, 400 cached tokens, 2-core Intel Xeon) 19 against 38 us per call
      at one query row, 35 against 52 at 4, 64 against 86 at 8; at 1500 cached tokens 74 against 171 at one row;
      with ``skip_masked_prefix``: a batch's left-padded prompts' padding keys are not read (fastverify.hf.layers
      takes the same path with the cache's append in the same call, ``append_attention``);
    - otherwise, with more than one query row, torch's SDPA with ``enable_gqa`` instead of transformers'
      ``repeat_kv`` (which copies every layer's keys and values at every step): the same result bit for bit
      (tests/test_hf_attention.py).

    Anything else goes to transformers' own function, and so does every call on a thread outside the loop's contexts
    (``substitutes_here``: another thread's forward of the model meanwhile). A soft cap, which transformers' function
    refuses or (before 5.21) leaves out, is left out here too where it does."""
    if substitutes_here():
        if kwargs.get("softcap") is not None and _sdpa_drops_softcap():
            kwargs = {k: v for k, v in kwargs.items() if k != "softcap"}
        if _masked_fits(query, key, value, attention_mask, dropout, kwargs):
            return _masked(query, key, value, attention_mask, scaling), None
        if (_masked_cpu_call(query, key.shape[1], attention_mask, dropout, kwargs)
                and query.shape[2] > 1 and key.shape[1] != query.shape[1]):
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                 scale=scaling, enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


# modeling files whose attention calls torch's scaled_dot_product_attention itself under sdpa, not through
# transformers' attention functions (Falcon's ``torch.nn.functional.scaled_dot_product_attention``): ``gqa_attention``
# leaves their configs at sdpa and binds their global ``torch`` to ``_SDPA_TORCH`` instead
_OWN_SDPA_FILES = ("transformers.models.falcon.modeling_falcon",)


def _calls_sdpa_itself(name: str) -> bool:
    """Whether the modeling file ``name`` calls torch's SDPA itself: a file of ``_OWN_SDPA_FILES`` that does not
    dispatch through transformers' attention functions (Falcon's from transformers 5.25 does: it imports
    ``ALL_ATTENTION_FUNCTIONS``, and ``gqa_attention`` then switches its config as any other's)."""
    return name in _OWN_SDPA_FILES and not hasattr(sys.modules.get(name), "ALL_ATTENTION_FUNCTIONS")


def _sdpa_rows(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's ``scaled_dot_product_attention`` as a file of ``_OWN_SDPA_FILES`` calls it while the loop runs on the
    CPU: float32 verify rows with an additive mask (``masked_rows``) through ``fastverify::masked_attention``, so that
    a row's result is a function of that row alone; anything else through torch's, as called (key / value heads
    grouped under the query heads only with enable_gqa, else one or as many as the query's, as torch takes them)."""
    fits = (not is_causal and query.dim() == key.dim() == value.dim() == 4 and key.shape[0] == query.shape[0]
            and value.shape[:3] == key.shape[:3] and (enable_gqa or key.shape[1] in (1, query.shape[1])))
    if fits and _masked_fits(query, key, value, attn_mask, dropout_p, {}):
        return _masked_attention_op()(query, key, value, attn_mask,
                                      query.shape[-1] ** -0.5 if scale is None else scale, True, 0.0, None)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


class ModuleWith(types.ModuleType):
    """The module ``base`` but for the attributes given (``own``): what ``module_globals`` binds in a modeling file
    in place of ``torch``, ``torch.nn`` or ``torch.nn.functional``. The own attributes on a thread inside the loop's
    contexts only (``substitutes_here``); on any other, the base module's."""

    def __init__(self, base, **own):
        super().__init__(base.__name__)
        self.__dict__.update(_own=own, _base=base)

    def __getattr__(self, name):
        own = self.__dict__["_own"]
        if name in own and substitutes_here():
            return own[name]
        return getattr(self.__dict__["_base"], name)


# ``torch`` with nn.functional.scaled_dot_product_attention bound to ``_sdpa_rows``
_SDPA_TORCH = ModuleWith(torch, nn=ModuleWith(torch.nn, functional=ModuleWith(
    F, scaled_dot_product_attention=_sdpa_rows)))


@functools.cache
def _masked_attention_op():
    """torch.ops.fastverify.masked_attention where the cpp kernels are built, else None."""
    from fastverify.ops.dispatch import implemented_backends
    return torch.ops.fastverify.masked_attention if "cpp" in implemented_backends("masked_attention") else None


def _register_gqa_attention() -> bool:
    """Register ``_gqa_sdpa`` (and sdpa's mask function under the same name) once; False where this transformers
    has no such registries (the loop then keeps the model's own attention)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        if GQA_ATTENTION not in AttentionInterface._global_mapping:
            ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
            AttentionInterface.register(GQA_ATTENTION, _gqa_sdpa)
    except (ImportError, AttributeError, KeyError):
        return False
    return True


@contextlib.contextmanager
def gqa_attention(model):
    """For the loop's duration, a CPU model whose attention is transformers' ``sdpa`` runs ``_gqa_sdpa`` instead
    (its configs' ``_attn_implementation`` switched to the registered name, then restored); one whose modeling file
    calls torch's SDPA itself (``_calls_sdpa_itself``: Falcon before transformers 5.25) keeps sdpa, and the file's
    ``torch`` is ``_SDPA_TORCH`` (``module_globals``; ``files_of``: not where something else holds it), whose SDPA is
    ``_sdpa_rows``. Other models and devices are left as they are. Yields whether anything was switched."""
    configs, files = [], []
    if next(model.parameters()).device.type == "cpu" and _register_gqa_attention():
        sdpa = [(type(m).__module__, cfg) for m in modules(model) for cfg in (config_of(m),)
                if cfg is not None and getattr(cfg, "_attn_implementation", None) == "sdpa"]
        names = {name for name, _ in sdpa if _calls_sdpa_itself(name)}
        own = {id(cfg) for name, cfg in sdpa if name in names}
        configs = list({id(cfg): cfg for _, cfg in sdpa if id(cfg) not in own}.values())
        if _masked_attention_op() is not None:
            files = files_of(model, lambda cls: cls.__module__ in names, "torch", torch, _SDPA_TORCH)
    with (switched(configs, "_attn_implementation", GQA_ATTENTION), module_globals(files, "torch", _SDPA_TORCH),
          substituting()):
        yield bool(configs or files)


_GLOBALS_LOCK = threading.Lock()  # guards _SWITCHED and _GLOBALS_HELD
_SWITCHED = {}  # (id(config), name) -> [how many ``switched`` blocks hold it, its value before the first]


@contextlib.contextmanager
def switched(configs, name: str, value):
    """Each config's implementation ``name`` (``_attn_implementation``, ``_experts_implementation``) set to ``value``
    for the block, then restored. The stored field (``name + "_internal"``) where a config has one, not the
    property: transformers' setter also rewrites a config's sub-configs. Meanwhile ``switched_from`` gives the
    value it had before (for a forward on a thread outside the loop's contexts)."""
    fields = [name + "_internal" if hasattr(cfg, name + "_internal") else name for cfg in configs]
    saved = [getattr(cfg, field) for cfg, field in zip(configs, fields)]
    with _GLOBALS_LOCK:
        for cfg, old in zip(configs, saved):
            _SWITCHED.setdefault((id(cfg), name), [0, old])[0] += 1
    for cfg, field in zip(configs, fields):
        setattr(cfg, field, value)
    try:
        yield
    finally:
        for cfg, field, old in zip(configs, fields, saved):
            setattr(cfg, field, old)
        with _GLOBALS_LOCK:
            for cfg in configs:
                held = _SWITCHED[(id(cfg), name)]
                held[0] -= 1
                if not held[0]:
                    del _SWITCHED[(id(cfg), name)]


def switched_from(config, name: str):
    """The value ``switched`` found in ``config``'s implementation ``name`` (the outermost block's), or None where no
    block holds it switched."""
    with _GLOBALS_LOCK:
        held = _SWITCHED.get((id(config), name))
    return None if held is None else held[1]


_GLOBALS_HELD = {}  # (module, name) -> [how many contexts hold it swapped, the original value]


@contextlib.contextmanager
def module_globals(files, name: str, value):
    """For the block, the global ``name`` of each module in ``files`` (a model's modeling files) bound to ``value``,
    then restored; reference-counted, so nested or concurrent loops over models of one file restore it once, when
    the last ends. Process-wide for that file while held: what another model of the file calls then is ``value``,
    which computes the file's own code on a thread outside the loop's contexts (``linear.substitutes_here``)."""
    with _GLOBALS_LOCK:
        for mod in files:
            held = _GLOBALS_HELD.setdefault((mod, name), [0, getattr(mod, name)])
            held[0] += 1
            setattr(mod, name, value)
    try:
        yield
    finally:
        with _GLOBALS_LOCK:
            for mod in files:
                held = _GLOBALS_HELD[(mod, name)]
                held[0] -= 1
                if not held[0]:
                    del _GLOBALS_HELD[(mod, name)]
                    setattr(mod, name, held[1])


def files_of(model, pick, name: str, module, proxy) -> list:
    """The modeling modules of ``model``'s module classes that ``pick`` (a function of the class) whose global
    ``name`` is ``module`` (``torch``, ``torch.nn``, ``torch.nn.functional``) or already its ``proxy``: the files that
    ``module_globals`` may bind to the proxy (a file whose global something else holds is left alone)."""
    files = []
    for cls in module_classes(model):
        if pick(cls):
            mod = sys.modules.get(cls.__module__)
            if mod is not None and mod not in files and getattr(mod, name, None) in (module, proxy):
                files.append(mod)
    return files


def _original(mod, name: str):
    """A module's global ``name`` as it is outside ``module_globals`` (None for no module)."""
    with _GLOBALS_LOCK:
        held = _GLOBALS_HELD.get((mod, name))
    return held[1] if held is not None else getattr(mod, name, None)


def _own_eager(module, caller_globals):
    """The eager attention function that ``_eager_rows`` stands in for: the original of the file whose global
    lookup called it (``caller_globals``), else of the attention class's own file."""
    for name in (caller_globals.get("__name__"), type(module).__module__):
        fn = _original(sys.modules.get(name), "eager_attention_forward")
        if callable(fn) and fn is not _eager_rows:
            return fn
    raise RuntimeError(f"{type(module).__name__}: no eager_attention_forward found in its modeling file "
                       f"({type(module).__module__}) or its caller's ({caller_globals.get('__name__')})")


# (attention module class, soft cap given, sinks given, scaling None, the other keyword names) -> whether
# masked_attention computes what the class's own eager function does (checked on the first call: a modeling file's
# eager attention may hold more than the arguments show; ``eager_agrees`` reads the first three)
_EAGER_AGREES = {}
EAGER_CHECK_TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def _eager_rows(module, query, key, value, attention_mask, *args, **kwargs):
    """A modeling file's ``eager_attention_forward`` while the loop runs on the CPU (``eager_attention``): its float32
    verify rows (``masked_rows``: at most ``MASKED_ATTENTION_ROWS`` query rows, an additive 4D mask, no dropout, no
    attention weights asked for) through ``fastverify::masked_attention`` with the variant's soft cap (``softcap``:
    Gemma 2) and sink logits (``s_aux`` or the module's ``sinks``: gpt-oss), so that a row's result is a function of
    that row alone; anything else through the file's own function, called as it was. On the first call per attention
    class and variant both run and must agree to ``EAGER_CHECK_TOLERANCE``, else the class keeps its own function."""
    caller = sys._getframe(1).f_globals  # the file whose global lookup called this (its function: the fallback)
    softcap, sinks, scaling = kwargs.get("softcap"), kwargs.get("s_aux"), kwargs.get("scaling")
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        sinks = module.sinks
    rest = {k: v for k, v in kwargs.items() if k not in ("dropout", "scaling", "softcap", "s_aux", "sliding_window")}
    # (on a thread outside the loop's contexts, another thread's forward meanwhile: the file's own, as called)
    if (substitutes_here() and not args
            and _masked_fits(query, key, value, attention_mask, kwargs.get("dropout", 0.0) if module.training else 0.0,
                             rest)
            and (sinks is None or (sinks.dtype == torch.float32 and tuple(sinks.shape) == (query.shape[1],)))
            and (softcap is None or softcap > 0)):
        out = _masked(query, key, value, attention_mask, scaling, softcap, None if sinks is None else sinks.detach())
        variant = (type(module), softcap is not None, sinks is not None, scaling is None, tuple(sorted(rest)))
        agrees = _EAGER_AGREES.get(variant)
        if agrees is None:
            want = _own_eager(module, caller)(module, query, key, value, attention_mask, **kwargs)[0]
            agrees = _EAGER_AGREES[variant] = (want.shape == out.shape
                                               and torch.allclose(out, want, **EAGER_CHECK_TOLERANCE))
        if agrees:
            return out, None
    return _own_eager(module, caller)(module, query, key, value, attention_mask, *args, **kwargs)


def eager_agrees(module, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether ``module``'s class, while its file runs ``_eager_rows``, computes its plain attention (no soft cap, no
    sinks) with ``masked_attention``: every such variant checked so far agreed with the file's own function. With
    none checked yet, one is checked here on random float32 rows (three query rows over seven keys, a causal
    mask), as the class's first call would be; the fallback is the class's own file's function."""
    def plain(variant):
        return variant[0] is type(module) and not variant[1] and not variant[2]

    if not any(plain(v) for v in list(_EAGER_AGREES)) and _masked_attention_op() is not None:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, 3, head_dim, generator=g, dtype=torch.float32)
        k, v = (torch.randn(1, kv_heads, 7, head_dim, generator=g, dtype=torch.float32) for _ in range(2))
        mask = torch.zeros(1, 1, 3, 7, dtype=torch.float32).masked_fill_(torch.ones(3, 7, dtype=torch.bool).triu_(5),
                                                                         float("-inf"))
        with torch.no_grad():
            _eager_rows(module, q, k, v, mask, dropout=0.0, scaling=getattr(module, "scaling", None))
    verdicts = [agrees for v, agrees in list(_EAGER_AGREES.items()) if plain(v)]
    return bool(verdicts) and all(verdicts)


def _eager_files(model) -> list:
    """The modeling files of ``model``'s modules that define ``eager_attention_forward``, where a config of the model
    runs eager attention."""
    if not any(getattr(config_of(m), "_attn_implementation", None) == "eager" for m in modules(model)):
        return []
    files = []
    for m in modules(model):
        mod = sys.modules.get(type(m).__module__)
        if mod is not None and mod not in files and callable(_original(mod, "eager_attention_forward")):
            files.append(mod)
    return files


@contextlib.contextmanager
def bound_methods(model, table):
    """For the block, each module of ``model`` whose class is a key of ``table`` ((modeling module, class name) ->
    (method name, function)) has that method bound on the instance to the function, then removed again; a module
    with such a method of its own, or whose class has no such method (another release's), is left as it is. Yields
    how many modules were bound."""
    hits = {}  # the model's classes in table that have the method -> (method, function)
    for cls in module_classes(model) if table else ():
        method, fn = table.get((cls.__module__, cls.__qualname__), (None, None))
        if method is not None and hasattr(cls, method):
            hits[cls] = (method, fn)
    bound = [(m, hits[type(m)]) for m in (modules(model) if hits else ())
             if type(m) in hits and hits[type(m)][0] not in m.__dict__]
    for m, (method, fn) in bound:
        setattr(m, method, types.MethodType(on_loop_threads(fn, method), m))
    try:
        yield len(bound)
    finally:
        for m, (method, _) in bound:
            m.__dict__.pop(method, None)


@contextlib.contextmanager
def eager_attention(model):
    """For the loop's duration, a CPU model whose attention is eager (Gemma 2, gpt-oss: transformers has no sdpa
    path for their soft cap and sinks; or a model loaded with attn_implementation="eager") runs ``_eager_rows`` as
    its modeling files' ``eager_attention_forward`` (``module_globals``); yields how many files. Other models and
    devices are left as they are."""
    files = []
    if next(model.parameters()).device.type == "cpu" and _masked_attention_op() is not None:
        files = _eager_files(model)
    with module_globals(files, "eager_attention_forward", _eager_rows), substituting():
        yield len(files)


def _xglm_rows(self, hidden_states, key_value_states=None, attention_mask=None, **kwargs):
    """XGLM's attention (``XGLMAttention``, its own code: ``torch.bmm`` of the scaled queries with every key, the
    mask, a softmax over them, ``torch.bmm`` with the values, each rounding by the rows and keys beside a row) with
    float32 CPU rows under an additive mask (``masked_rows``) on ``masked_attention``: its projections and cache
    update as the class makes them, then softmax(q k^T + mask) v per row. Cross-attention, a cache of two parts,
    training and anything else through the class's own forward."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    B, n, E = hidden_states.shape
    query_shaped = hidden_states.unsqueeze(1).expand(B, self.num_heads, n, E)  # what masked_rows reads: [B, H, n]
    from transformers.cache_utils import EncoderDecoderCache
    if (key_value_states is not None or self.training or isinstance(cache, EncoderDecoderCache)
            or attention_mask is None or not masked_rows(query_shaped, self.num_heads, attention_mask.shape[-1],
                                                         hidden_states.dtype, attention_mask, 0.0, kwargs)):
        return type(self).forward(self, hidden_states, key_value_states=key_value_states,
                                  attention_mask=attention_mask, **kwargs)
    q = (self.q_proj(hidden_states) * self.scaling).view(B, n, self.num_heads, self.head_dim).transpose(1, 2)
    k = self.k_proj(hidden_states).view(B, n, -1, self.head_dim).transpose(1, 2)
    v = self.v_proj(hidden_states).view(B, n, -1, self.head_dim).transpose(1, 2)
    if cache is not None:
        rest = {key: value for key, value in kwargs.items() if key not in ("cache", "past_key_values")}
        k, v = cache.update(k, v, self.layer_idx, kwargs=rest)
    out = _masked_attention_op()(q, k, v, attention_mask, 1.0, True, 0.0, None)  # the queries come scaled
    return self.out_proj(out.transpose(1, 2).reshape(B, n, self.embed_dim)), None


def _attn_rows(self, query, key, value, attention_mask=None):
    """An attention class's own ``_attn`` (GPT-NeoX-Japanese's: ``torch.baddbmm`` of the queries with every key scaled
    by 1 / norm_factor, the mask, a softmax, ``torch.matmul`` with the values; GPT-J's before transformers 5.24 the
    same with ``torch.matmul`` and 1 / scale_attn; CodeGen's before 5.24 adds the mask before the scale, which for
    the loop's masks of zeros and large negatives gives the same weights) with float32 CPU rows under an additive
    mask (``masked_rows``) on ``masked_attention``; anything else through the class's own."""
    dropout = getattr(self, "attention_dropout", getattr(self, "attn_dropout", None))
    if not _masked_fits(query, key, value, attention_mask, dropout.p if self.training else 0.0, {}):
        return type(self)._attn(self, query, key, value, attention_mask)
    scale = 1.0 / (self.norm_factor if hasattr(self, "norm_factor") else self.scale_attn)
    return _masked_attention_op()(query, key, value, attention_mask, scale, True, 0.0, None), None


# attention modules whose attention is their modeling file's own code, outside transformers' attention functions,
# and the method each runs in its place while the loop does on the CPU (``own_attention``; CodeGen's and GPT-J's have
# an ``_attn`` before transformers 5.24 only)
_OWN_ATTENTION = {
    ("transformers.models.xglm.modeling_xglm", "XGLMAttention"): ("forward", _xglm_rows),
    ("transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese", "GPTNeoXJapaneseAttention"):
        ("_attn", _attn_rows),
    ("transformers.models.codegen.modeling_codegen", "CodeGenAttention"): ("_attn", _attn_rows),
    ("transformers.models.gptj.modeling_gptj", "GPTJAttention"): ("_attn", _attn_rows)}


def _polar_rows(magnitude, angle):
    """``torch.polar`` of contiguous copies, its output laid out position by position. Llama 4's and DeepSeek-V2's
    rotary embeddings before transformers 5.19 take their angles as a matmul's output transposed ([B, positions, D / 2],
    positions innermost in memory); polar's output keeps that layout, and the complex product that rotates the queries
    and keys by it then rounds a position's values by how many positions the forward has."""
    return torch.polar(magnitude.contiguous(), angle.contiguous())


# ``torch`` with polar bound to ``_polar_rows``, for the files of ``_OWN_POLAR_FILES``
_POLAR_TORCH = ModuleWith(torch, polar=_polar_rows)
_OWN_POLAR_FILES = ("transformers.models.llama4.modeling_llama4",
                    "transformers.models.deepseek_v2.modeling_deepseek_v2")


@contextlib.contextmanager
def own_attention(model):
    """For the loop's duration, a CPU model's attention modules of ``_OWN_ATTENTION`` (XGLM's, GPT-NeoX-Japanese's;
    CodeGen's and GPT-J's before transformers 5.24) run their rows on ``masked_attention`` (``bound_methods``), as
    ``gqa_attention`` and ``eager_attention`` run transformers' attention functions, and the files of
    ``_OWN_POLAR_FILES`` (Llama 4's and DeepSeek-V2's rotary embeddings) take ``_polar_rows`` as their ``torch.polar``;
    yields how many modules were bound. Other models and devices are left as they are."""
    cpu = next(model.parameters()).device.type == "cpu" and _masked_attention_op() is not None
    files = files_of(model, lambda cls: cls.__module__ in _OWN_POLAR_FILES, "torch", torch, _POLAR_TORCH) if cpu else []
    with (bound_methods(model, _OWN_ATTENTION if cpu else {}) as n, module_globals(files, "torch", _POLAR_TORCH),
          substituting()):
        yield n

"""The loop's forward of Llama-style decoder layers: the model's own arithmetic, op for op, in fewer calls.

On the CPU a decoding step of a small model is largely the Python around its kernels: SmolLM2-135M's one-row
forward took 17.6 ms on a 2-core Intel Xeon, of which its 211 linear layers 5.5 ms and attention 1.5 ms; the rest
is some 60 small torch calls and a dozen module calls per decoder layer. Within ``lean_layers(model)`` every
eligible decoder layer runs ``_forward`` instead of its own forward (rebound on the instance, removed on exit):

- the q / k / v projections, and the gate / up projections, in one ``skinny_linear_packed`` call each on their
  stacked packed weight (``fastverify.hf.linear.packed_group``: every output column computed as it is alone), when
  the layers pack and the rows are few; otherwise each projection's own forward;
- the rotary embedding of q and k together: on float32 CPU tensors one ``fastverify::rotary_embedding`` call
  (csrc/rotary.cpp), else ``x * cos + roll(x, D / 2) * sin'`` with ``sin' = [-sin_lo, sin_hi]``; either way the
  products and sums of transformers' ``x * cos + rotate_half(x) * sin`` (a negation is exact), in one or four
  calls instead of fourteen (``sin'`` made once per forward, every layer shares it);
- RMSNorm's ops without the casts that are no-ops on a float32 input, and on float32 CPU tensors as one
  ``fastverify::rms_norm`` call (csrc/norm.cpp: the same six steps, torch's own sum of squares, 4.5 instead of
  15.9 us a row); no module calls for the norms, the attention and the MLP themselves, no deprecation wrappers;
- where every projection streams packed (a GGUF model's float32 weights on the CPU; a plain SiLU) and the rows are
  few, the steps before the attention (norm, q / k / v, Qwen3's q / k norms, rotary embedding) and after it (output
  projection, residual, norm, gate / up, SiLU x up, down, residual) as one C++ call each
  (``fastverify::decoder_pre_attention`` / ``decoder_post_attention``, csrc/layer.cpp: the arithmetic of the same
  registered and ATen ops, so the same bits, run on raw rows in one workspace, csrc/cpu/layer.cpp; a batch's live
  rows alone, as below), which leaves the cache's append and the attention to Python;
  where every projection runs its own ``nn.Linear`` forward (on a GPU, whose host pays a Python call and a kernel
  launch per op), the same two halves on the unpacked weights as ``decoder_pre_attention_dense`` /
  ``decoder_post_attention_dense`` (a composite for every device: ATen ops, and on float32 CPU tensors the norm,
  rotary and skinny_linear ops; on the CPU for float32 weights that do not pack, streamed by skinny_linear).

Live rows (``LiveRows``): a batched verify forward pads every request's rows to the largest tree's (the first one
also every prompt to the longest), and on the CPU a padding row costs the linear layers what a real one does (at 4
requests, trees of 9, 1, 1 and 0 nodes are 40 rows for 15). While the loop sets ``LiveRows.index`` (the flat
indices of the rows it reads), ``_forward`` runs the norms, projections and MLP on those rows only and gives the
padding rows zeros (their keys and values, never attended by a live row, and their outputs, never read); the
attention still sees the whole [B, q] layout. Every op is row-wise and the skinny kernels' result for a row does
not depend on the other rows, so each live row's result is the padded forward's, bit for bit.

Each result is the layer's own, bit for bit: the same ops on the same values in the same order. Eligible: the
exact classes of transformers' Llama, Mistral, Qwen2 and Qwen3 decoder layers (``_LAYERS``) with their own
attention, MLP and RMSNorm classes, exactly ``nn.Linear`` projections, no hooks on the submodules whose calls it
skips (transformers' inactive output-capturing hooks aside; the layer's own hooks run around it) and no forward
rebound on an instance (other than the linears' by ``skinny_linears``), no global module hooks. And the first
time a layer class meets an attention implementation, one of its layers is run both ways on random rows and must
agree bit for bit (the verdict kept for the process), so a transformers release whose layer computes otherwise
keeps its own forward. Measured on SmolLM2-135M (2-core Intel Xeon, ``benchmarks/patch_option.py lean_layers``:
patched generate on four Spec-Bench questions, on and off side by side, outputs identical to ``generate``): the
model forward of a step 13.9 -> 10.8 ms with the n-gram drafter (the whole generate 21% faster), 15.4 -> 12.3 ms
with heads + n-gram (17%).
"""

import contextlib
import sys
import threading
import types

import torch

from fastverify import _ext
from fastverify.hf.attention import _buffered_layer_class, _eager_rows, _gqa_sdpa, eager_agrees, masked_rows
from fastverify.hf.linear import (MAX_ROWS, modules, on_loop_threads, packed_group, packed_weight, skinny_available,
                                  substituting, takes_skinny)

__all__ = ["lean_layers", "projection_groups", "LiveRows", "scatter_rows"]

# decoder layer class -> the attention call's extra keyword arguments (what its attention forward passes beyond
# Llama's); the layer's attention, MLP and RMSNorm classes share its prefix
_LAYERS = {
    "LlamaDecoderLayer": lambda attn: {},
    "MistralDecoderLayer": lambda attn: {"sliding_window": getattr(attn.config, "sliding_window", None)},
    "Qwen2DecoderLayer": lambda attn: {"sliding_window": attn.sliding_window},
    "Qwen3DecoderLayer": lambda attn: {"sliding_window": attn.sliding_window},
}
_HEAD_NORMS = ("Qwen3DecoderLayer",)  # q_norm / k_norm: RMSNorm over each head's dimensions before the rotation
_VERDICT = {}  # (layer class, attention implementation) -> whether ``_forward`` reproduced its forward bit for bit


def _capturing(hook) -> bool:
    """transformers' output-capturing hook (installed for good by the first call that asks for attentions or hidden
    states; it records nothing unless the running forward asks, and the loop never asks)."""
    return getattr(hook, "__name__", "") == "output_capturing_hook" and "transformers" in getattr(
        hook, "__module__", "")


def _hooked(module) -> bool:
    """A module whose call does more than its forward (a hook other than transformers' output capturing), or whose
    forward was rebound: ``_forward`` skips its call."""
    return bool(any(not _capturing(h) for h in module._forward_hooks.values()) or module._forward_pre_hooks
                or getattr(module, "_backward_hooks", None) or "forward" in module.__dict__)


def _own_forward(linear) -> bool:
    """The linear layer's forward is its class's, or the one ``skinny_linears`` rebinds."""
    f = linear.__dict__.get("forward")
    return f is None or getattr(getattr(f, "__func__", None), "skinny", False)


def _eager(attn):
    """The modeling file's own ``eager_attention_forward`` (what its attention runs when no interface is set)."""
    return getattr(sys.modules.get(type(attn).__module__), "eager_attention_forward", None)


def _structure(layer) -> bool:
    """The layer is one of ``_LAYERS`` with its family's submodules, none of them hooked."""
    name = type(layer).__name__
    if name not in _LAYERS or not type(layer).__module__.startswith("transformers.models."):
        return False
    prefix = name[:-len("DecoderLayer")]
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if name in _HEAD_NORMS:
        norms += (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
    if (type(attn).__name__ != prefix + "Attention" or type(mlp).__name__ != prefix + "MLP"
            or any(type(n).__name__ != prefix + "RMSNorm" for n in norms) or _eager(attn) is None):
        return False
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if any(type(m) is not torch.nn.Linear or m._forward_hooks or m._forward_pre_hooks or not _own_forward(m)
           for m in linears):
        return False
    # the layer's own hooks run around ``_forward`` as around its forward; its submodules' calls are skipped
    return "forward" not in layer.__dict__ and not any(_hooked(m) for m in (attn, mlp, *norms, mlp.act_fn))


def projection_groups(model):
    """The projections that ``_forward`` computes together, per eligible layer: [q, k, v] and [gate, up]."""
    out = []
    for layer in modules(model):
        if _structure(layer):
            a, m = layer.self_attn, layer.mlp
            out += [[a.q_proj, a.k_proj, a.v_proj], [m.gate_proj, m.up_proj]]
    return out


def _rms(weight, eps, h):
    """transformers' Llama / Mistral / Qwen2 / Qwen3 RMSNorm, its float32 casts skipped where they are no-ops; on
    float32 CPU tensors outside autograd one ``fastverify::rms_norm`` call (csrc/norm.cpp: the same bits, 4.5
    instead of 15.9 us a row of 576 on a 2-core Intel Xeon)."""
    dtype = h.dtype
    if _rms_op is not None and _fused(h, weight) and h.is_contiguous():
        return _rms_op(h, weight, eps)
    x = h if dtype == torch.float32 else h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x if dtype == torch.float32 else x.to(dtype))


# csrc/norm.cpp, csrc/rotary.cpp, csrc/layer.cpp; None where not built: then torch's ops run
_rms_op, _rotary_op = _ext.compiled_op("rms_norm"), _ext.compiled_op("rotary_embedding")
_pre_op, _post_op = _ext.compiled_op("decoder_pre_attention"), _ext.compiled_op("decoder_post_attention")
_dense_pre_op = _ext.compiled_op("decoder_pre_attention_dense")
_dense_post_op = _ext.compiled_op("decoder_post_attention_dense")
_append_op = _ext.compiled_op("append_attention")
_stack_op = _ext.compiled_op("decoder_stack")

if _rms_op is not None:
    @torch.library.register_fake("fastverify::rms_norm")
    def _rms_norm_fake(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

if _rotary_op is not None:
    @torch.library.register_fake("fastverify::rotary_embedding")
    def _rotary_embedding_fake(x, cos, sin):
        return x.new_empty(x.shape)


def _pre_attention_fakes(h, cos, n_q, n_kv, contiguous_qk: bool):
    """Shapes of a pre-attention op's (qk [B, n_q + n_kv, S, D], v [B, n_kv, S, D]): v a view of the [B, S, heads, D]
    projection; qk contiguous (the rotary_embedding op's output) or in that layout (torch's elementwise ops)."""
    B, S, D = h.shape[0], h.shape[1], cos.shape[-1]
    v = h.new_empty(B, S, n_q + 2 * n_kv, D).transpose(1, 2)[:, n_q + n_kv:]
    qk = h.new_empty(B, n_q + n_kv, S, D) if contiguous_qk else h.new_empty(B, S, n_q + n_kv, D).transpose(1, 2)
    return qk, v


def _post_attention_fake(h, attn, *weights):
    return torch.empty_like(h, memory_format=torch.contiguous_format)


if _pre_op is not None:
    @torch.library.register_fake("fastverify::decoder_pre_attention")
    def _decoder_pre_attention_fake(h, norm_weight, eps, qkv_q, qkv_d, qkv_m, qkv_bits, qkv_bias, cos, sin, n_q, n_kv,
                                    index=None, q_norm_weight=None, q_norm_eps=0.0, k_norm_weight=None,
                                    k_norm_eps=0.0):
        return _pre_attention_fakes(h, cos, n_q, n_kv, True)

    torch.library.register_fake("fastverify::decoder_post_attention")(_post_attention_fake)

if _stack_op is not None:
    @torch.library.register_fake("fastverify::decoder_stack")
    def _decoder_stack_fake(h, weights, ints, floats, cos, sin, k_caches, v_caches, start, mask, index=None):
        return torch.empty_like(h, memory_format=torch.contiguous_format)

if _dense_pre_op is not None:
    @torch.library.register_fake("fastverify::decoder_pre_attention_dense")
    def _decoder_pre_attention_dense_fake(h, norm_weight, eps, qkv_weight, qkv_bias, cos, sin, sin_rolled, n_q, n_kv,
                                          skinny_rows=0, q_norm_weight=None, q_norm_eps=0.0, k_norm_weight=None,
                                          k_norm_eps=0.0):
        rotary_op = h.device.type == "cpu" and h.dtype == cos.dtype == torch.float32
        return _pre_attention_fakes(h, cos, n_q, n_kv, rotary_op)

    torch.library.register_fake("fastverify::decoder_post_attention_dense")(_post_attention_fake)


def _fused(x, other) -> bool:
    """Whether a fused C++ op (no autograd, float32 CPU kernels) may take x and its second operand."""
    return (x.dtype == other.dtype == torch.float32 and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or other.requires_grad)))


def _fusable(h, cos, plan, index) -> bool:
    """Whether ``decoder_pre_attention`` / ``decoder_post_attention`` may run a layer on h [B, S, E] (outside
    autograd) and its live rows ``index`` (or all): float32 and contiguous, at most ``max_rows`` rows computed (the
    skinny kernels' range), float32 cos / sin of the head dimension."""
    rows = h.numel() // h.shape[-1] if index is None else index.numel()
    return (h.dtype == torch.float32 and h.is_contiguous() and rows <= plan.max_rows
            and cos.dtype == torch.float32 and cos.shape[-1] == plan.head_dim)


def _silu(act):
    """F.silu where the activation module is a plain SiLU (what its forward returns), else the module."""
    plain = type(act) is torch.nn.SiLU and not act.inplace
    plain = plain or (type(act).__name__ == "SiLUActivation" and type(act).__module__ == "transformers.activations")
    return torch.nn.functional.silu if plain else act


class _Plan:
    """What ``_forward`` reads of one layer, looked up once per ``lean_layers``: its modules' attributes, the
    attention function, the stacked packed projections (or None) and their biases."""

    def __init__(self, layer, pack: bool, max_rows: int):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        a, m = layer.self_attn, layer.mlp
        self.attn, self.head_dim, self.layer_idx, self.scaling = a, a.head_dim, a.layer_idx, a.scaling
        self.norms = [(n.weight, n.variance_epsilon) for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.head_norms = ([(n.weight, n.variance_epsilon) for n in (a.q_norm, a.k_norm)]
                           if type(layer).__name__ in _HEAD_NORMS else None)
        self.qkv_mods, self.gate_up_mods = (a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)
        self.qkv, self.qkv_bias = self._stack(self.qkv_mods, pack)
        self.gate_up, self.gate_up_bias = self._stack(self.gate_up_mods, pack)
        self.o_proj, self.down_proj, self.act = a.o_proj.forward, m.down_proj.forward, _silu(m.act_fn)
        self.nq = a.q_proj.out_features // a.head_dim
        self.nk = a.k_proj.out_features // a.head_dim
        self.inter = m.gate_proj.out_features
        self.extra = _LAYERS[type(layer).__name__](a)
        self.attention = ALL_ATTENTION_FUNCTIONS.get_interface(a.config._attn_implementation, _eager(a))
        # the cache's append and the attention in one call where the attention is masked_attention's: the loop's
        # fastverify_sdpa, or its eager stand-in where that agrees with the file's own eager function
        self.append_attention = _append_op if (self.attention is _gqa_sdpa or (
            self.attention is _eager_rows and eager_agrees(a, self.nq, self.nk, self.head_dim))) else None
        self.max_rows = max_rows
        # the pre-attention ops' last arguments: Qwen3's q / k norms (weights and eps), or none
        self.head_args = tuple(x for w, eps in self.head_norms for x in (w, eps)) if self.head_norms else ()
        self.fused = self._fused_args(a, m) if pack else None
        self.dense = self._dense_args(a, m) if self.fused is None else None
        self.stack = None  # the ``_Stack`` this layer belongs to, if any (set by ``lean_layers``)

    def stack_entries(self):
        """This layer's entries of ``decoder_stack``'s weights, ints and floats (csrc/layer.cpp), or None unless it
        runs the packed ops and the loop's append_attention."""
        if self.fused is None or self.append_attention is None:
            return None
        (w1, eps1, qkv_q, qkv_d, qkv_m, qkv_bits, qkv_bias), post = self.fused
        o_q, o_d, o_m, o_bits, o_bias, w2, eps2, gu_q, gu_d, gu_m, gu_bits, gu_bias, dn_q, dn_d, dn_m, dn_bits, \
            dn_bias = post
        wq, eq, wk, ek = self.head_args or (None, 0.0, None, 0.0)
        scale = self.head_dim ** -0.5 if self.scaling is None else self.scaling
        weights = [w1, qkv_q, qkv_d, qkv_m, qkv_bias, wq, wk, o_q, o_d, o_m, o_bias, w2, gu_q, gu_d, gu_m, gu_bias,
                   dn_q, dn_d, dn_m, dn_bias]
        return (weights, [qkv_bits, o_bits, gu_bits, dn_bits, self.nq, self.nk],
                [float(eps1), float(eq), float(ek), float(eps2), float(scale)])

    def _fused_args(self, a, m):
        """The packed weights of ``decoder_pre_attention`` / ``decoder_post_attention`` (csrc/layer.cpp), or None
        unless the ops are built and every projection streams packed (the q / k / v and gate / up stacks, the output
        and down projections through ``skinny_linears``), with float32 norms and a plain SiLU."""
        if (_pre_op is None or _post_op is None or self.act is not torch.nn.functional.silu
                or any(w.dtype != torch.float32 for w, _ in self.norms + (self.head_norms or []))):
            return None
        if self.qkv is None or self.gate_up is None:
            return None
        out = []
        for proj in (a.o_proj, m.down_proj):
            p = packed_weight(proj) if getattr(proj.forward, "skinny", False) else None
            if p is None:
                return None
            out.append((p.q, p.d, p.m, p.bits, proj.bias))
        (w1, eps1), (w2, eps2) = self.norms
        g = self.gate_up
        return ((w1, eps1, self.qkv.q, self.qkv.d, self.qkv.m, self.qkv.bits, self.qkv_bias),
                (*out[0], w2, eps2, g.q, g.d, g.m, g.bits, self.gate_up_bias, *out[1]))

    def _dense_args(self, a, m):
        """The weights of ``decoder_pre_attention_dense`` / ``decoder_post_attention_dense`` (csrc/layer.cpp) and the
        rows up to which their projections run skinny_linear, or None unless the ops are built, every projection
        runs its own ``nn.Linear`` forward (F.linear: on a GPU) or every one ``skinny_linears``' forward on its
        float32 weight (on the CPU, weights that do not pack), with a plain SiLU."""
        projections = (*self.qkv_mods, a.o_proj, *self.gate_up_mods, m.down_proj)
        if _dense_pre_op is None or _dense_post_op is None or self.act is not torch.nn.functional.silu:
            return None
        forwards = [p.__dict__.get("forward") for p in projections]
        if all(f is None for f in forwards):
            rows = 0
        elif all(getattr(f, "skinny", False) for f in forwards):
            rows = forwards[0].max_rows
            if any(f.max_rows != rows or (f.pack and packed_weight(p) is not None)
                   for f, p in zip(forwards, projections)):
                return None
        else:
            return None
        (w1, eps1), (w2, eps2) = self.norms
        return ((w1, eps1, [p.weight for p in self.qkv_mods], [p.bias for p in self.qkv_mods]),
                (a.o_proj.weight, a.o_proj.bias, w2, eps2, [p.weight for p in self.gate_up_mods],
                 [p.bias for p in self.gate_up_mods], m.down_proj.weight, m.down_proj.bias), rows)

    @staticmethod
    def _stack(mods, pack):
        packed = packed_group(mods) if pack and skinny_available() else None
        biases = [m.bias for m in mods]
        if packed is None or (any(b is None for b in biases) and any(b is not None for b in biases)):
            return None, None
        return packed, None if biases[0] is None else torch.cat([b.detach() for b in biases])

    def project(self, packed, bias, mods, x):
        """The projections ``mods`` of x, concatenated along the last dimension."""
        if packed is not None and x.device.type == "cpu" and takes_skinny(x, mods[0].weight, self.max_rows):
            return torch.ops.fastverify.skinny_linear_packed(x, packed.q, packed.d, packed.m, packed.bits, bias)
        return torch.cat([mod.forward(x) for mod in mods], -1)


class _Rotary:
    """``(cos, sin, sin')`` of the last forward's rotary embedding ``(cos, sin)``, each with a head dimension, where
    ``sin' = [-sin_lo, sin_hi]`` (for torch's ops: ``rotate_half(x) * sin = roll(x, D / 2) * sin'``): made once per
    forward, shared by every layer. One attribute holds the set, so that two threads generating with the model at
    once never pair one's ``cos`` with the other's ``sin``."""

    def __init__(self):
        self.last = (None, None, None, None, None)

    def __call__(self, cos, sin):
        last = self.last
        if last[0] is not cos or last[1] is not sin:
            half = sin.shape[-1] // 2
            sin4 = sin.unsqueeze(1)
            last = (cos, sin, cos.unsqueeze(1), sin4, torch.cat((-sin4[..., :half], sin4[..., half:]), -1))
            self.last = last
        return last[2:]


class LiveRows(threading.local):
    """The rows of the next forward that matter (module docstring): ``index`` int64 [M] of flat row indices into
    its [B, q] hidden states, with ``total`` = B * q; None: every row. Set by the caller around a forward, for its
    own thread: another thread's forward of the model meanwhile (a plain ``model(...)`` call) sees None."""

    def __init__(self):
        self.index, self.total = None, 0


def scatter_rows(rows, index, total):
    """[total, ...] zeros holding ``rows`` at ``index`` (the live rows back in their padded layout)."""
    return rows.new_zeros(total, *rows.shape[1:]).index_copy_(0, index, rows)


def _attend(plan, q, k, v, cache, attention_mask, kwargs):
    """The layer's attention of q [B, n_q, S, D] over the cache with k / v [B, n_kv, S, D] appended; [B, S, n_q, D].
    Where the attention is the loop's ``_gqa_sdpa`` (or ``_eager_rows``, where that agrees with the file's own eager
    function) taking ``masked_attention`` and the layer of the cache is the loop's buffered one with room for k / v,
    both in one ``append_attention`` call (csrc/attention.cpp): the same rows written, the same op on the same keys,
    values and mask, without the views and copies made from Python."""
    a = plan.attn
    if plan.append_attention is not None and cache is not None and not a.training:
        layers = getattr(cache, "layers", None)
        layer = layers[plan.layer_idx] if layers is not None and plan.layer_idx < len(layers) else None
        start = layer.room(k.shape[2], k.shape[:2]) if type(layer) is _buffered_layer_class() else -1
        kv_dtype = k.dtype if start >= 0 and k.dtype == v.dtype == layer._kbuf.dtype == layer._vbuf.dtype else None
        if (start >= 0 and not getattr(cache, "offloading", False)
                and masked_rows(q, k.shape[1], start + k.shape[2], kv_dtype, attention_mask, 0.0, kwargs)):
            out = plan.append_attention(q, k, v, layer._kbuf, layer._vbuf, start, attention_mask,
                                        q.shape[-1] ** -0.5 if plan.scaling is None else plan.scaling)
            layer._klen = layer._vlen = start + k.shape[2]
            return out
    if cache is not None:
        k, v = cache.update(k, v, plan.layer_idx, kwargs=kwargs)
    out, _ = plan.attention(a, q, k, v, attention_mask, dropout=0.0 if not a.training else a.attention_dropout,
                            scaling=plan.scaling, **plan.extra, **kwargs)
    return out


class _Stack:
    """Every decoder layer of a model in one ``fastverify::decoder_stack`` call (csrc/layer.cpp): the layers' packed
    ops and their append_attention, bit for bit, without a Python call, a module call and three op calls per layer
    (SmolLM2-135M: ~1.5 ms of a 9 ms one-row step on a 2-core AMD EPYC VM). transformers' model forward still calls
    each layer: the first runs the stack where the forward qualifies (where ``_forward`` would run each layer's
    packed ops and append_attention), and each later one then hands on what it is given, the stack's result (per
    thread: the layer next to do so and that tensor). Where the forward does not qualify, every layer runs its own
    ``_forward``."""

    def __init__(self, plans, entries):
        self.plans = plans
        self.weights = [w for e in entries for w in e[0]]
        self.ints = [i for e in entries for i in e[1]]
        self.floats = [f for e in entries for f in e[2]]
        self.passing = threading.local()

    @staticmethod
    def build(layers):
        """The stack of ``layers`` (the model's decoder layers in their order, each with its ``_fastverify``), or
        None: every one must take the packed ops and append_attention as layer i of the cache, with the same heads,
        under one mask (one attention type, one sliding window or none: the loop's mask then holds the window, as
        each layer's own append_attention reads it) and without hooks (which would see the stack's result, not
        their layer's)."""
        if _stack_op is None or not layers:
            return None
        plans = [layer._fastverify[0] for layer in layers]
        entries = [p.stack_entries() for p in plans]
        first, kind = plans[0], getattr(layers[0], "attention_type", None)
        window = first.extra.get("sliding_window")
        if any(p.layer_idx != i or e is None or p.extra.get("sliding_window") != window
               or (p.nq, p.nk, p.head_dim) != (first.nq, first.nk, first.head_dim)
               or getattr(layer, "attention_type", None) != kind
               or any(not _capturing(h) for h in layer._forward_hooks.values()) or layer._forward_pre_hooks
               for i, (p, e, layer) in enumerate(zip(plans, entries, layers))):
            return None
        return _Stack(plans, entries)

    def run(self, h, attention_mask, cache, cos, sin, index, kwargs):
        """The stack's output for the first layer's input h, or None where this forward does not qualify."""
        plan, passing = self.plans[0], self.passing
        passing.out = None
        if h.dim() != 3 or cos.dim() != 4 or torch.is_grad_enabled() or not _fusable(h, cos, plan, index):
            return None
        layers = getattr(cache, "layers", None)
        if (layers is None or len(layers) < len(self.plans) or getattr(cache, "offloading", False)
                or any(p.attn.training for p in self.plans)):
            return None
        layers = layers[:len(self.plans)]
        B, n = h.shape[0], h.shape[1]
        buffered, start = _buffered_layer_class(), -1
        for c in layers:
            at = c.room(n, (B, plan.nk)) if type(c) is buffered else -1
            if at < 0 or (start >= 0 and at != start) or not c._kbuf.dtype == c._vbuf.dtype == torch.float32:
                return None
            start = at
        query = h.new_empty(1).expand(B, plan.nq, n, plan.head_dim)  # the shape the layers' q will have
        if not masked_rows(query, plan.nk, start + n, torch.float32, attention_mask, 0.0, kwargs):
            return None
        out = _stack_op(h, self.weights, self.ints, self.floats, cos, sin, [c._kbuf for c in layers],
                        [c._vbuf for c in layers], start, attention_mask, index)
        for c in layers:
            c._klen = c._vlen = start + n
        if len(self.plans) > 1:
            passing.next, passing.out = 1, out
        return out

    def hands_on(self, layer_idx, hidden_states) -> bool:
        """Whether the layer ``layer_idx`` (> 0) hands on ``hidden_states``: the stack ran this forward (and this
        must then be its result, reaching the layers in their order)."""
        passing = self.passing
        out = getattr(passing, "out", None)
        if out is None:
            return False
        if layer_idx != passing.next or hidden_states is not out:
            passing.out = None
            raise RuntimeError(f"fastverify: decoder layer {layer_idx} was called after the decoder stack ran "
                               f"every layer, out of order or on another tensor than its result (expected layer "
                               f"{passing.next} on it): the model's forward is not the one fastverify.hf.layers "
                               f"knows (patch with lean_layers=False)")
        passing.next += 1
        if passing.next == len(self.plans):
            passing.out = None
        return True


def _forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
             position_embeddings=None, **kwargs):
    """The decoder layer's forward (transformers' Llama / Mistral / Qwen2 / Qwen3), op for op;
    ``self._fastverify``: its ``_Plan``, the shared ``_Rotary`` and the caller's ``LiveRows`` (or None)."""
    plan, rotary, live = self._fastverify
    stack = plan.stack
    if stack is not None and plan.layer_idx > 0 and stack.hands_on(plan.layer_idx, hidden_states):
        return hidden_states
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    kwargs = dict(kwargs, position_ids=position_ids, use_cache=use_cache)
    shape = hidden_states.shape[:-1]
    index = live.index if live is not None and shape.numel() == live.total else None
    cos, sin, sin_rolled = rotary(*position_embeddings)
    if stack is not None and plan.layer_idx == 0:
        out = stack.run(hidden_states, attention_mask, cache, cos, sin, index, kwargs)
        if out is not None:
            return out
    ops = None  # the steps around the attention from C++ (csrc/layer.cpp): the same ops, the same bits
    if hidden_states.dim() == 3 and cos.dim() == 4 and not torch.is_grad_enabled():
        if plan.fused is not None and _fusable(hidden_states, cos, plan, index):
            ops = _pre_op, _post_op, *plan.fused, (sin,), index
        elif plan.dense is not None and index is None and cos.shape[-1] == plan.head_dim:
            ops = _dense_pre_op, _dense_post_op, *plan.dense[:2], (sin, sin_rolled), plan.dense[2]
    if ops is not None:  # the last argument of both: the live rows (packed) / the rows up to which skinny (dense)
        pre, post, pre_args, post_args, tables, last = ops
        qk, v = pre(hidden_states, *pre_args, cos, *tables, plan.nq, plan.nk, last, *plan.head_args)
        out = _attend(plan, qk[:, :plan.nq], qk[:, plan.nq:], v, cache, attention_mask, kwargs)
        return post(hidden_states, out, *post_args, last)
    (w1, eps1), (w2, eps2) = plan.norms
    h0 = hidden_states if index is None else hidden_states.reshape(-1, hidden_states.shape[-1]).index_select(0, index)
    x = _rms(w1, eps1, h0)
    qkv = plan.project(plan.qkv, plan.qkv_bias, plan.qkv_mods, x)
    if index is not None:
        qkv = scatter_rows(qkv, index, live.total)
    qkv = qkv.view(*shape, -1, plan.head_dim)
    nq, nqk = plan.nq, plan.nq + plan.nk
    if plan.head_norms is None:
        qk = qkv[..., :nqk, :].transpose(1, 2)
    else:  # Qwen3: q_norm over q's heads, k_norm over k's, each head's dimensions
        (wq, eq), (wk, ek) = plan.head_norms
        qk = torch.cat((_rms(wq, eq, qkv[..., :nq, :]), _rms(wk, ek, qkv[..., nq:nqk, :])), -2).transpose(1, 2)
    qkv = qkv.transpose(1, 2)
    if _rotary_op is not None and _fused(qk, cos) and cos.dim() == 4 and cos.shape[-1] == qk.shape[-1]:
        qk = _rotary_op(qk, cos, sin)
    else:
        qk = qk * cos + qk.roll(cos.shape[-1] // 2, -1) * sin_rolled
    out = _attend(plan, qk[:, :nq], qk[:, nq:], qkv[:, nqk:], cache, attention_mask, kwargs)
    out = out.reshape(*shape, -1) if index is None else out.reshape(live.total, -1).index_select(0, index)
    h = h0 + plan.o_proj(out.contiguous())
    x = _rms(w2, eps2, h)
    gu = plan.project(plan.gate_up, plan.gate_up_bias, plan.gate_up_mods, x)
    h = h + plan.down_proj(plan.act(gu[..., :plan.inter]) * gu[..., plan.inter:])
    return h if index is None else scatter_rows(h, index, live.total).view(*shape, -1)


def _decoder_layers(model, lean):
    """The model's decoder layers in the order its forward calls them (the ModuleList holding the lean layers, cut
    to ``config.num_hidden_layers``), if every one of them is lean; else []."""
    if not lean:
        return []
    for module in modules(model):
        if isinstance(module, torch.nn.ModuleList) and len(module) and module[0] is lean[0]:
            layers = list(module)[:getattr(getattr(lean[0].self_attn, "config", None), "num_hidden_layers", None)]
            return layers if len(layers) == len(lean) and all(a is b for a, b in zip(layers, lean)) else []
    return []


@torch.no_grad()
def _agrees(layer) -> bool:
    """Whether ``_forward`` (already bound) gives the class's forward's result on random rows, bit for bit."""
    try:
        p = next(layer.parameters())
        dim, hd = layer.input_layernorm.weight.shape[0], layer.self_attn.head_dim
        g = torch.Generator(device="cpu").manual_seed(0)
        h = torch.randn(1, 3, dim, generator=g, dtype=torch.float32).to(p.device, p.dtype)
        angles = torch.rand(1, 3, hd // 2, generator=g, dtype=torch.float32).repeat(1, 1, 2) * 6.0
        emb = (angles.cos().to(p.device, p.dtype), angles.sin().to(p.device, p.dtype))
        want = type(layer).forward(layer, h, position_embeddings=emb)
        got = layer.forward(h, position_embeddings=emb)
        return isinstance(want, torch.Tensor) and want.shape == got.shape and torch.equal(want, got)
    except Exception:  # a signature or behaviour this forward does not mirror: keep the layer's own
        return False


# ``_forward`` on a thread inside the loop's contexts, the class's own forward on any other (another thread's forward
# of the model meanwhile)
_LOOP_FORWARD = on_loop_threads(_forward, "forward")


@contextlib.contextmanager
def lean_layers(model, pack: bool = True, max_rows: int = MAX_ROWS, live: LiveRows = None):
    """Context manager: every eligible decoder layer of ``model`` runs ``_forward`` (module docstring); yields
    how many. pack: use the stacked packed projections (with ``skinny_linears(model, pack=True)``); live: a
    ``LiveRows`` whose index, while set, limits the layers' row-wise work to those rows."""
    from torch.nn.modules import module as nn_module
    global_hooks = nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks  # they see every call
    layers = [] if global_hooks else [m for m in modules(model) if _structure(m)]
    rotary, done = _Rotary(), []
    with substituting():  # (the check of each layer class below runs its forward the loop's way)
        try:
            for layer in layers:
                try:
                    plan = _Plan(layer, pack, max_rows)
                except AttributeError:  # a release whose modules lack what the plan reads: the layer's own forward
                    continue
                layer._fastverify = (plan, rotary, live)
                layer.forward = types.MethodType(_LOOP_FORWARD, layer)
                done.append(layer)
                cls = (type(layer), getattr(layer.self_attn.config, "_attn_implementation", None))
                if cls not in _VERDICT:
                    _VERDICT[cls] = _agrees(layer)
                if not _VERDICT[cls]:
                    del layer.forward, layer._fastverify
                    done.pop()
            stack = _Stack.build(_decoder_layers(model, done))
            for layer in done:
                layer._fastverify[0].stack = stack
            yield len(done)
        finally:
            for layer in done:
                layer.__dict__.pop("forward", None)
                layer.__dict__.pop("_fastverify", None)

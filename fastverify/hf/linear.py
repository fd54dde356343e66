"""Route a model's few-row linear layers through ``fastverify.skinny_linear`` while the loop runs.

Within ``skinny_linears(model)``, every ``torch.nn.Linear`` of the model (the exact class, and transformers'
``FalconLinear``, the same product with its bias added after it; quantised or otherwise specialised subclasses are
left alone) whose weight is a contiguous float32 CPU tensor (streamed in place by the kernel) computes inputs of at
most ``max_rows`` rows with the skinny kernel (latent attention's ``kv_b_proj``, which expands the whole cache at
every step: any number); larger inputs (the prefill), other dtypes, devices and anything that needs gradients go to
``F.linear`` as before. The forward is rebound on the instance and the instance attribute removed on exit, so the
model is left exactly as it was. Modules whose forward is already rebound on the instance (accelerate hooks) are
skipped. transformers' ``Conv1D`` layers (GPT-2's: ``x @ weight + bias`` with the weight stored [K, N]) are rerouted
likewise, to ``skinny_linear_t``, which reads that weight in place; so every linear layer of a GPT-2 computes a
row's result from that row alone, as the skinny kernels do (torch's GEMM does not: there a row rounds differently
beside other rows).

With ``pack`` (the default), a layer whose float32 weight is exactly 4- or 8-bit block-quantised values (a model
dequantised from a GGUF file's Q4_0 / Q4_1 / Q8_0 tensors, as fastverify.models.load_smollm2 loads SmolLM2) runs
``skinny_linear_packed`` on a packed copy of it (fastverify.ops.linear.pack_blocks: 0.75 or 1.25 bytes per weight
instead of 4): the same result, bit for bit, for a fraction of the memory traffic. The packed copy is made by
``fastverify.patch`` (``pack_model``; SmolLM2-135M: 0.5-0.6 s on a 2-core Intel Xeon with the C++ packer, 3.3 s
with the torch reference's tensor passes; 115 MB beside the 540 MB of float32 weights), or at the first use, and
kept while the layer lives, made again when its weight changes (another tensor, or an in-place update).
"""

import contextlib
import functools
import threading
import types
import weakref
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from fastverify.ops.linear import PackedWeight, pack_blocks
from fastverify.ops.tree import implemented_backends

__all__ = ["skinny_linears", "skinny_available", "streamable", "takes_skinny", "packed_weight", "packed_group",
           "pack_model", "row_aligned", "row_padded", "row_gelu", "modules", "module_classes", "walked",
           "config_of", "substituting", "substitutes_here", "on_loop_threads", "MAX_ROWS", "ROW_ALIGN"]

# SmolLM2-135M's linear layers (30 layers + the LM head, fp32, 2 threads, 2-core AMD EPYC (Zen 5) VM), skinny
# vs torch's GEMM: 2.4x faster at M = 1, 2.4x at 17, 2.4x at 33, 2.0x at 128, 1.7x at 256 (benchmarks/RESULTS.md,
# "skinny_linear against F.linear"). A batch of requests' trees (4 x (1 + 16) rows and more) stays on the kernel;
# prefills of long prompts go to torch, as in plain generate. (With the AVX2-only kernel the crossover was ~33.)
MAX_ROWS = 128


class _Walk(NamedTuple):
    """What ``walked(model)`` keeps for its block (``_WALKED.walk`` on the thread in it)."""
    model: torch.nn.Module
    mods: list  # the model's modules, in ``model.modules()``'s order
    classes: set  # their classes
    keys: dict  # module -> the ``_key`` of its weight, for each one asked so far


_WALKED = threading.local()


def _walk(module, out: list, seen: set) -> list:
    seen.add(id(module))
    out.append(module)
    for child in module._modules.values():
        if child is not None and id(child) not in seen:
            _walk(child, out, seen)
    return out


def modules(model) -> list:
    """``list(model.modules())`` (the same modules in the same order); inside ``walked(model)`` the list made on
    entering it."""
    walk = getattr(_WALKED, "walk", None)
    if walk is not None and walk.model is model:
        return walk.mods
    return _walk(model, [], set())


def module_classes(model) -> set:
    """The classes of ``modules(model)``; inside ``walked(model)`` the set made on entering it."""
    walk = getattr(_WALKED, "walk", None)
    if walk is not None and walk.model is model:
        return walk.classes
    return {type(m) for m in modules(model)}


_LOCKS = weakref.WeakKeyDictionary()  # model or drafter -> the lock the loop's calls hold (``model_lock``)
_UNHASHABLE_LOCKS = {}  # id -> lock, for a drafter that cannot be a weak dictionary's key (a dataclass: no hash);
# an entry leaves with its object (weakref.finalize), so a later object of the same id gets a lock of its own
_LOCKS_LOCK = threading.Lock()


def model_lock(model) -> threading.RLock:
    """The lock that ``decode`` holds on ``model`` for a call's duration. The loop's contexts rebind the model's own
    modules (their forwards, configs, modeling files' globals) and restore them on exit, so two loops over one
    model at once would see each other's bindings come and go mid-call (a decoder stack's layers run twice, a
    cache appended twice): a second thread's call waits for the first. Re-entrant: a call that decodes within a
    call on the same thread (the probe's checks) goes on. A drafter that binds a draft model's layers for its own
    forwards takes it without waiting, and binds nothing where another thread's loop holds it. ``decode`` holds its
    drafter's lock too (a drafter keeps a call's requests between its steps: two models patched with one drafter
    decode one at a time)."""
    with _LOCKS_LOCK:
        try:
            lock = _LOCKS.get(model)
            if lock is None:
                lock = _LOCKS[model] = threading.RLock()
        except TypeError:
            lock = _UNHASHABLE_LOCKS.get(id(model))
            if lock is None:
                lock = _UNHASHABLE_LOCKS[id(model)] = threading.RLock()
                try:
                    weakref.finalize(model, _UNHASHABLE_LOCKS.pop, id(model), None)
                except TypeError:  # no weak references (__slots__ without __weakref__): kept for the process
                    pass
    return lock



_SUBSTITUTING = threading.local()  # .depth: how many of the loop's contexts this thread is inside


@contextlib.contextmanager
def substituting():
    """For the block, this thread runs the code the loop's contexts bind in (``skinny_linears``, ``row_gelu``, the
    attention functions of fastverify.hf.attention, the decoder layers' forward of fastverify.hf.layers, the experts
    of fastverify.hf.experts). Each context enters it on the thread that enters the context. The bindings sit on the
    model's modules and configs, or on a modeling file, where every thread's forwards find them: each bound function
    asks ``substitutes_here`` first and, on a thread outside every such block (a plain ``model(...)`` beside a
    patched call, another model of the same modeling file), computes the model's own code instead, bit for bit."""
    _SUBSTITUTING.depth = getattr(_SUBSTITUTING, "depth", 0) + 1
    try:
        yield
    finally:
        _SUBSTITUTING.depth -= 1


def substitutes_here() -> bool:
    """Whether this thread is inside one of the loop's contexts (``substituting``)."""
    return getattr(_SUBSTITUTING, "depth", 0) > 0


def on_loop_threads(fn, method: str):
    """``fn`` as a module's ``method`` on a thread inside the loop's contexts (``substitutes_here``); the class's
    own ``method`` on any other."""
    @functools.wraps(fn)
    def bound(self, *args, **kwargs):
        if substitutes_here():
            return fn(self, *args, **kwargs)
        return getattr(type(self), method)(self, *args, **kwargs)
    return bound

def config_of(module):
    """The module's own ``config`` attribute, or None: read from its ``__dict__``, where transformers' modules keep
    it (``getattr`` goes through nn.Module's ``__getattr__``, which raises and catches for every module without one)."""
    return module.__dict__.get("config")


@contextlib.contextmanager
def walked(model):
    """For the block, ``modules(model)`` on this thread is the list of the model's modules made on entering it: the
    loop's contexts each look through the model's modules as they enter (~400 for SmolLM2-135M, each walk ~0.2 ms
    through ``model.modules()``), and none adds or removes one. Enter it after anything that does. Each layer's
    ``_key`` is read once in the block, too (the contexts ask for a layer's packed weight two or three times)."""
    saved = getattr(_WALKED, "walk", None)
    mods = _walk(model, [], set())
    _WALKED.walk = _Walk(model, mods, {type(m) for m in mods}, {})
    try:
        yield
    finally:
        _WALKED.walk = saved


# torch's CPU elementwise kernels (sigmoid, exp, tanh, SiLU) run a contiguous tensor's elements in vectors of twice
# the SIMD width (32 floats with AVX-512) and the last (numel mod 32) through the scalar function, which rounds
# differently. On an output [rows, N] of N < 32 columns (a router's logits over a few experts, Qwen2-MoE's one-column
# shared-expert gate) which of a row's elements take the scalar path depends on how many rows there are. Rows ROW_ALIGN
# floats apart are run one row at a time instead, every row the same way. Wider outputs stay contiguous: their rows
# are mostly whole vectors, and some kernels (GELU) compute a contiguous tensor in vectors, tail included, but a
# strided one otherwise, so there the wider buffer would cost a one-row call its agreement (``row_gelu`` hands GELU
# modules a contiguous copy of a strided input; a modeling file's own F.gelu call does not get one).
ROW_ALIGN = 32


def row_aligned(out: torch.Tensor) -> torch.Tensor:
    """``out`` [..., N] as it is when N >= ``ROW_ALIGN``, else a copy whose rows lie ROW_ALIGN floats apart in a wider
    buffer (a view [..., N] of [..., ROW_ALIGN]): torch's elementwise functions then compute each row alone, the same
    bits whatever the rows beside it."""
    return out if out.shape[-1] >= ROW_ALIGN else row_padded(out)


def row_padded(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., N] as it is when N is a multiple of ``ROW_ALIGN`` or ``x`` is one row (which torch's kernels run
    as they run one of such rows), else a copy whose rows lie N rounded up to one apart: ``row_aligned`` for any
    width, for an elementwise function a modeling file applies to an output of, say, 48 columns, whose contiguous tail
    (the last numel mod 32 elements) would otherwise fall on different elements of the last row as the rows change."""
    n = x.shape[-1]
    if n % ROW_ALIGN == 0 or x.numel() <= n:
        return x
    return x.new_empty(x.shape[:-1] + (-(-n // ROW_ALIGN) * ROW_ALIGN,))[..., :n].copy_(x)


def _gelu(x, approximate: str = "none"):
    return F.gelu(x.contiguous() if substitutes_here() else x, approximate=approximate)


@contextlib.contextmanager
def row_gelu(model):
    """For the block, the model's GELU (erf) modules (transformers' ``GELUActivation``, torch's ``nn.GELU``) compute
    a strided input as a contiguous copy. torch's GELU computes a contiguous tensor in vectors (its tail too, unlike
    sigmoid's: any width is row-invariant) and a strided one on another path that rounds otherwise, and a one-row
    slice of a wider output (a GLU's ``chunk``: ModernBERT's decoder; a ``row_aligned`` output) is contiguous where a
    slice of several rows is not: so a row's activations would depend on whether rows stand beside it. Yields the
    number of modules rebound; the instances' own attributes are restored on exit."""
    from transformers.activations import GELUActivation
    acts = [m for m in modules(model) if type(m) is GELUActivation and m.act is F.gelu]
    mods = [m for m in modules(model) if type(m) is torch.nn.GELU and m.approximate == "none"
            and "forward" not in m.__dict__]
    for m in acts:
        m.act = _gelu
    for m in mods:
        m.forward = _gelu
    try:
        with substituting():
            yield len(acts) + len(mods)
    finally:
        for m in acts:
            m.act = F.gelu
        for m in mods:
            m.__dict__.pop("forward", None)


def skinny_available() -> bool:
    return "cpp" in implemented_backends("skinny_linear")  # a CPU kernel registered by fastverify._C


def streamable(weight, bias=None) -> bool:
    """A weight the skinny kernels stream in place: a contiguous (else every call would copy it) 2-D float32 CPU
    tensor, with a float32 bias or none."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.is_contiguous() and (bias is None or bias.dtype == torch.float32))


# nn.Linear subclasses whose forward is the same product, the bias added after it: rerouted as nn.Linear is
_PLAIN_SUBCLASSES = (("transformers.models.falcon.modeling_falcon", "FalconLinear"),)


def _eligible(module) -> bool:
    cls = type(module)
    return ((cls is torch.nn.Linear or (cls.__module__, cls.__qualname__) in _PLAIN_SUBCLASSES)
            and "forward" not in module.__dict__ and streamable(module.weight, module.bias))


def _conv1d_type():
    """transformers' ``Conv1D`` class (None where transformers does not import)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def _eligible_t(module, conv1d) -> bool:
    """A ``Conv1D`` (the exact class) with a contiguous float32 CPU weight [K, N] and a float32 bias."""
    return (conv1d is not None and type(module) is conv1d and "forward" not in module.__dict__
            and streamable(module.weight, module.bias))


def takes_skinny(x, weight, max_rows: int) -> bool:
    """Whether an input of an eligible layer goes to the skinny kernels: float32, at most ``max_rows`` rows, and
    nothing that needs gradients (anything else goes to ``F.linear``)."""
    return (x.dtype == torch.float32 and x.numel() <= max_rows * x.shape[-1]
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


_PACKED = weakref.WeakKeyDictionary()  # nn.Linear -> (its weight's ``_key``, PackedWeight or None)
_SAMPLES = {}  # numel -> the flat indices of ``_key``'s sample of a weight of that many elements
SAMPLE = 16  # elements of a weight in ``_key``'s sample


def _sample_index(numel: int):
    """``SAMPLE`` flat indices spread over a tensor of ``numel`` elements (a multiplicative hash of 0, 1, ...; all
    of them when there are no more)."""
    idx = _SAMPLES.get(numel)
    if idx is None:
        i = np.arange(min(numel, SAMPLE), dtype=np.int64)
        idx = _SAMPLES[numel] = i if numel <= SAMPLE else (i * 2654435761 + 12345) % numel
    return idx


def _key(module):
    """What a packed copy of ``module.weight`` was made from: the tensor (its storage, shape and version counter)
    and the bytes of ``SAMPLE`` of its values spread over it. An in-place write through ``weight.data``
    (``.data.copy_``, ``.data.mul_``, an old-style optimizer step) leaves the version counter as it was; the sample
    sees such a write to the whole tensor, so the next call packs the weight again instead of streaming the stale
    copy. A write to a few rows or elements may miss the sample: ``forget_packed`` after one. Within
    ``walked(model)``, read once per layer."""
    walk = getattr(_WALKED, "walk", None)
    key = walk.keys.get(module) if walk is not None else None
    if key is None:
        w = module.weight
        sample = None
        if streamable(w):
            sample = w.detach().numpy().reshape(-1)[_sample_index(w.numel())].tobytes()
        key = (w.data_ptr(), w._version, tuple(w.shape), sample)
        if walk is not None:
            walk.keys[module] = key
    return key


def forget_packed(model) -> None:
    """Drop the packed copies of ``model``'s weights: the next call packs them again. For a write to a weight that
    ``_key`` cannot see (single elements through ``weight.data``)."""
    for m in modules(model):
        _PACKED.pop(m, None)
        _GROUPS.pop(m, None)


def packed_weight(module):
    """The block-packed copy of ``module.weight`` (fastverify.ops.linear.PackedWeight), or None when the weight is
    not exactly of that form; made once per weight tensor and version."""
    key = _key(module)
    hit = _PACKED.get(module)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = (key, pack_blocks(module.weight.detach()))
        _PACKED[module] = hit
    return hit[1]


_GROUPS = weakref.WeakKeyDictionary()  # first nn.Linear of a group -> (the members' keys, PackedWeight or None)


def packed_group(layers):
    """One block-packed weight for layers that read the same input (a layer's q / k / v projections, its gate /
    up projections): their weights stacked along the outputs, so that one ``skinny_linear_packed`` call computes
    them all (each output column is computed as it is alone: the same result bit for bit). None unless every layer
    is eligible (as for ``skinny_linears``) and the stack packs exactly at one bit width. Each member's own packed
    weight (``packed_weight``) then becomes its rows of the stack (a view: no second copy). Made once per weight
    version of the members."""
    layers = list(layers)
    keys = tuple(_key(m) for m in layers)
    hit = _GROUPS.get(layers[0])
    if hit is not None and hit[0] == keys:
        return hit[1]
    packed = None
    if (len(layers) > 1 and all(_eligible(m) for m in layers)
            and len({m.in_features for m in layers}) == 1):
        with torch.no_grad():
            packed = pack_blocks(torch.cat([m.weight.detach() for m in layers]))
    if packed is not None:
        start = 0
        for m, key in zip(layers, keys):
            rows = slice(start, start + m.out_features)
            _PACKED[m] = (key, PackedWeight(packed.q[rows], packed.d[rows], packed.m[rows], packed.bits))
            start = rows.stop
    _GROUPS[layers[0]] = (keys, packed)
    return packed


def _pack_groups(model) -> None:
    """``packed_group`` of every group ``fastverify.hf.layers`` computes together, before the layers are packed
    one by one, so that their members' packed weights are views of the stacks."""
    from fastverify.hf.layers import projection_groups
    for group in projection_groups(model):
        packed_group(group)


def pack_model(model) -> int:
    """Pack every layer that ``skinny_linears`` would reroute and whose weight packs exactly (``packed_weight``),
    ahead of the first generate, the projections that ``fastverify.hf.layers`` computes together stacked
    (``packed_group``); returns how many layers packed."""
    if not skinny_available():
        return 0
    _pack_groups(model)
    return sum(packed_weight(m) is not None for m in modules(model) if _eligible(m))


@contextlib.contextmanager
def skinny_linears(model, max_rows: int = MAX_ROWS, pack: bool = True):
    """Context manager; yields the number of layers rerouted (0 when the kernel is not built): ``nn.Linear`` layers
    and transformers' ``Conv1D`` ones. ``pack``: linear layers whose weight packs exactly (``packed_weight``) stream
    the packed copy."""
    mods = [m for m in modules(model) if _eligible(m)] if skinny_available() else []
    conv1d = _conv1d_type() if skinny_available() and "cpp" in implemented_backends("skinny_linear_t") else None
    convs = [m for m in modules(model) if _eligible_t(m, conv1d)] if conv1d is not None else []
    op = torch.ops.fastverify.skinny_linear if mods else None
    op_packed = torch.ops.fastverify.skinny_linear_packed if mods and pack else None
    if op_packed is not None:
        _pack_groups(model)
    packs = {m: packed_weight(m) for m in mods} if op_packed is not None else {}
    # latent attention's up-projection (``kv_b_proj``: DeepSeek V2 / V3, MiniCPM3 and their kin) expands every cached
    # latent at every step, B x the sequence's length rows, past max_rows once a sequence is long enough; it stays on
    # the kernel at any row count (within ~8% of torch's GEMM at 2,048 rows of DeepSeek-V2-Lite's shape), so that a
    # position's keys and values are the same bits whatever the rows beside them
    unbounded = {c for m in modules(model) for c in [m._modules.get("kv_b_proj")] if c is not None}

    def forward(self, x):
        if not substitutes_here():  # another thread's forward of the model meanwhile: the layer's own
            return type(self).forward(self, x)
        if takes_skinny(x, self.weight, x.numel() if self in unbounded else max_rows):
            p = packs.get(self)
            if p is not None:
                return row_aligned(op_packed(x, p.q, p.d, p.m, p.bits, self.bias))
            return row_aligned(op(x, self.weight, self.bias))
        return F.linear(x, self.weight, self.bias)

    def forward_t(self, x):  # Conv1D: x @ weight + bias
        if not substitutes_here():
            return type(self).forward(self, x)
        if takes_skinny(x, self.weight, max_rows):
            return row_aligned(torch.ops.fastverify.skinny_linear_t(x, self.weight, self.bias))
        return conv1d.forward(self, x)

    forward.skinny = True  # fastverify.hf.layers tells this rebinding from others' (and mirrors it: max_rows, pack)
    forward.max_rows, forward.pack = max_rows, op_packed is not None
    for m in mods:
        m.forward = types.MethodType(forward, m)
    for m in convs:
        m.forward = types.MethodType(forward_t, m)
    try:
        with substituting():
            yield len(mods) + len(convs)
    finally:
        for m in mods + convs:
            m.__dict__.pop("forward", None)

"""Gated low-rank adapters: LoRA that acts on slot rows only, so that every other row is the base model, bit for bit.

Slot drafters (GAD's [MASK] block, LUD's [PAD] lookahead, PTP's auxiliary-variable slots) append slot rows to
the target's own verify forward; an adapter teaches the target to fill them. The verify rows of that forward
must still compute exactly what the base model computes, or the exact rules would not be exact:

- the adapter wraps the frozen ``nn.Linear`` (PEFT's layout: ``lora_A`` [r, in], ``lora_B`` [out, r], scale
  alpha / r; ``lora_B`` starts at zero, so a new adapter is a no-op);
- its forward computes ``y = base(x)`` for every row, then adds ``scale * B(A(x))`` to the gated rows only (an
  index, not a multiply by a 0/1 gate: the other rows of ``y`` are never written);
- it is never merged into the weight (W + BA, then subtracting it again, is not bit-exact: near-ties would flip).

Inference on float32 CPU tensors does the gather, the two rank-r products and the scatter-add in one C++ call
(``fastverify::gated_lora_add_``, csrc/cpu/linear.cpp) instead of a dozen small torch ops per adapted layer;
training (autograd on) and other devices take the torch path.

The gate is a bool tensor [..., rows] over the leading dimensions of the layer's input, set for one forward by
``slot_gate(gate)`` on the forward's thread; outside that context (or with an all-False gate) the adapters do
nothing. The base layer stays the module's child ``base`` (the skinny-linear routing of fastverify.hf.linear still
reaches it).
"""

import contextlib
import math
import threading

import torch
from torch import nn

from fastverify import _ext

__all__ = ["GatedLoRALinear", "add_gated_lora", "remove_gated_lora", "gated_lora_layers", "slot_gate",
           "DEFAULT_TARGETS"]

# the projections of a decoder layer (Llama / Qwen / Mistral / Gemma names, and Phi-3's fused ones); the output
# projection is left alone
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                   "gate_up_proj")

# .value: (gate bool [..., rows], its flat row indices int64 [n]) of this thread's forward in progress, or None
# (another thread's forward of the model meanwhile, a plain ``model(...)`` call, runs without the adapters; so
# would a forward recomputed on autograd's device threads: the recipes do not checkpoint activations)
_GATE = threading.local()


@contextlib.contextmanager
def slot_gate(gate):
    """Within this context the gated adapters act on the rows where ``gate`` (bool, the leading shape of the
    layers' inputs, e.g. [B, q]) is True, in forwards on this thread. Nests; restores the previous gate on exit."""
    if gate is not None and gate.dtype != torch.bool:
        raise TypeError(f"gate: expected a bool tensor, got {gate.dtype}")
    previous = getattr(_GATE, "value", None)
    # the selected rows' flat indices, found once per forward rather than once per adapted layer
    _GATE.value = None if gate is None else (gate, gate.reshape(-1).nonzero().squeeze(1))
    try:
        yield
    finally:
        _GATE.value = previous


class GatedLoRALinear(nn.Module):
    """``base(x)``, plus ``scale * lora_B(lora_A(x))`` on the rows the current ``slot_gate`` selects.

    base: the frozen nn.Linear [out, in]; rank r >= 1; alpha: scale = alpha / r."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"base: expected an nn.Linear, got {type(base).__name__}")
        if not (isinstance(rank, int) and rank >= 1):
            raise ValueError(f"rank: expected an int >= 1, got {rank!r}")
        self.base = base
        self.rank, self.alpha, self.scale = rank, float(alpha), float(alpha) / rank
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's default; B = 0 makes it a no-op

    @property
    def in_features(self):
        return self.base.in_features

    @property
    def out_features(self):
        return self.base.out_features

    @property
    def weight(self):  # code that reads layer.weight (tied heads, dtype probes) sees the base weight
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x):
        y = self.base(x)
        state = getattr(_GATE, "value", None)
        if state is None or state[0].shape != x.shape[:-1] or state[1].numel() == 0:
            return y
        idx = state[1]
        if _fused(x, y, self.lora_A):  # inference on the CPU: one C++ call (csrc/cpu/linear.cpp)
            y2 = y.reshape(-1, y.shape[-1])
            torch.ops.fastverify.gated_lora_add_(y2, x.reshape(-1, x.shape[-1]).contiguous(), idx, self.lora_A,
                                                 self.lora_B, self.scale)
            return y2.view_as(y)
        rows = x.reshape(-1, x.shape[-1]).index_select(0, idx)
        delta = (rows.to(self.lora_A.dtype) @ self.lora_A.t()) @ self.lora_B.t()
        # out of place: the other rows of y are copied, never recomputed
        return y.reshape(-1, y.shape[-1]).index_add(0, idx, (self.scale * delta).to(y.dtype)).view_as(y)

    def extra_repr(self):
        return f"rank={self.rank}, alpha={self.alpha}"


def _fused(x, y, A):
    """Whether the fused C++ update applies: float32 CPU tensors, no autograd, a contiguous fresh ``y`` (the base
    layer's output, updated in place), and the op built (``FASTVERIFY_DISABLE_EXT`` and old builds fall back)."""
    return (_HAS_FUSED and not torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype == torch.float32
            and y.dtype == torch.float32 and A.dtype == torch.float32 and y.is_contiguous())


_HAS_FUSED = _ext.compiled_op("gated_lora_add_") is not None

if _HAS_FUSED:
    @torch.library.register_fake("fastverify::gated_lora_add_")
    def _gated_lora_add_fake(y, x, index, A, B, scale):
        return None


def gated_lora_layers(model):
    """[(qualified name, GatedLoRALinear)] of a model, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, GatedLoRALinear)]


def add_gated_lora(model, rank: int = 16, alpha: float = 32.0, targets=DEFAULT_TARGETS):
    """Wrap every ``nn.Linear`` whose attribute name is in ``targets`` with a GatedLoRALinear, in place. Returns
    the list of wrapped qualified names. The base parameters are untouched (freeze them yourself for training).
    Raises ValueError when nothing matches, or when the model already holds adapters."""
    if gated_lora_layers(model):
        raise ValueError("model: already holds gated LoRA adapters (remove_gated_lora first)")
    wrapped = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if name in targets and type(child) is nn.Linear:
                setattr(parent, name, GatedLoRALinear(child, rank, alpha))
                wrapped.append(f"{parent_name}.{name}" if parent_name else name)
    if not wrapped:
        raise ValueError(f"targets: no nn.Linear named {tuple(targets)} in {type(model).__name__}")
    return wrapped


def remove_gated_lora(model):
    """Put every wrapped base layer back, in place: the model is again exactly the base model."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, GatedLoRALinear):
                setattr(parent, name, child.base)
    return model

"""Route a model's few-row linear layers through ``fastverify.skinny_linear`` while the loop runs.

Within ``skinny_linears(model)``, every ``torch.nn.Linear`` of the model (the exact class, so quantised or
otherwise specialised subclasses are left alone) whose weight is a contiguous float32 CPU tensor (streamed in
place by the kernel) computes inputs of at most ``max_rows`` rows with the skinny kernel; larger inputs (the
prefill), other dtypes, devices and anything that needs gradients go to ``F.linear`` as before. The forward is rebound on the instance and the instance attribute
removed on exit, so the model is left exactly as it was. Modules whose forward is already rebound on the
instance (accelerate hooks) are skipped.
"""

import contextlib
import types

import torch
import torch.nn.functional as F

from fastverify.ops.tree import implemented_backends

__all__ = ["skinny_linears", "skinny_available", "MAX_ROWS"]

# SmolLM2-135M's linear layers (30 layers + the LM head, fp32, 2 threads, 2-core AMD EPYC (Zen 5) VM), skinny
# vs torch's GEMM: 2.4x faster at M = 1, 2.4x at 17, 2.4x at 33, 2.0x at 128, 1.7x at 256 (benchmarks/RESULTS.md,
# "skinny_linear against F.linear"). A batch of requests' trees (4 x (1 + 16) rows and more) stays on the kernel;
# prefills of long prompts go to torch, as in plain generate. (With the AVX2-only kernel the crossover was ~33.)
MAX_ROWS = 128


def skinny_available() -> bool:
    return "cpp" in implemented_backends("skinny_linear")  # a CPU kernel registered by fastverify._C


def _eligible(module) -> bool:
    return (type(module) is torch.nn.Linear and "forward" not in module.__dict__
            and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32
            and module.weight.is_contiguous()  # else every call would copy the weight
            and (module.bias is None or module.bias.dtype == torch.float32))


@contextlib.contextmanager
def skinny_linears(model, max_rows: int = MAX_ROWS):
    """Context manager; yields the number of layers rerouted (0 when the kernel is not built)."""
    mods = [m for m in model.modules() if _eligible(m)] if skinny_available() else []
    op = torch.ops.fastverify.skinny_linear if mods else None

    def forward(self, x):
        if (x.dtype == torch.float32 and x.numel() <= max_rows * x.shape[-1]
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return op(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    for m in mods:
        m.forward = types.MethodType(forward, m)
    try:
        yield len(mods)
    finally:
        for m in mods:
            m.__dict__.pop("forward", None)

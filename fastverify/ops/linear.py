"""Skinny linear: ``x @ weight.T + bias`` for a few rows, streaming the weight once (csrc/linear.h).

A verify forward scores 1 + k tokens; on the CPU torch's fp32 GEMM costs 2-3x a one-token matrix-vector product
at 2 <= M <= 16, which is what makes drafting expensive there. ``skinny_linear`` keeps the cost of M rows close to
that of one while the weight dominates the traffic (M up to ~8 with AVX-512, ~4 with AVX2 + FMA), and its result for a row does
not depend on the other rows (fixed summation order, see csrc/linear.h).

Backends: torch (``torch.nn.functional.linear``, the reference) and cpp (csrc/cpu/linear.cpp, float32 CPU
tensors; the weight may be float16, read as its exact float32 values: half the bytes to stream, the result of its
float32 copy bit for bit). There is no GPU kernel: cuBLAS already keeps small-M GEMMs bandwidth-bound, so on a GPU
the op is ``F.linear``.
"""

import torch

from fastverify import _ext
from fastverify.ops import dispatch

__all__ = ["skinny_linear"]


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor = None, *,
                  backend: str = "auto") -> torch.Tensor:
    """``x @ weight.T + bias``.

    x: float [..., K]; weight: float [N, K]; bias: float [N] or None. Returns [..., N] in x's dtype: a weight or
    bias of another dtype is used as its values in x's dtype. The cpp backend takes float32 CPU tensors and a
    float32 or float16 weight; "auto" uses it for those and ``F.linear`` otherwise.
    """
    for name, t in (("x", x), ("weight", weight)) + ((("bias", bias),) if bias is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected shape [N, K], got {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x: expected shape [..., K = {weight.shape[1]}], got {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias: expected shape [{weight.shape[0]}], got {tuple(bias.shape)}")
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"x, weight, bias: expected one device, got {[str(t.device) for t in tensors]}")
    if any(not t.dtype.is_floating_point for t in tensors):
        raise TypeError(f"x, weight, bias: expected floating dtypes, got {[t.dtype for t in tensors]}")
    fits_cpp = (x.dtype == torch.float32 and weight.dtype in (torch.float32, torch.float16)
                and (bias is None or bias.dtype == torch.float32) and x.device.type == "cpu")
    if backend == "auto":  # the C++ kernel where it applies, F.linear (the reference) everywhere else
        backend = "cpp" if fits_cpp and "cpp" in dispatch.implemented_backends("skinny_linear") else "torch"
    if not fits_cpp or weight.dtype != x.dtype:  # all float32 on the CPU, the common call, needs neither
        if dispatch.resolve("skinny_linear", backend, x.device) != "cpp":  # the reference: values in x's dtype
            weight = weight.to(x.dtype)
            bias = None if bias is None else bias.to(x.dtype)
        elif not fits_cpp:
            raise TypeError(f"x, weight, bias: the cpp backend takes float32 CPU tensors (weight float32 or "
                            f"float16), got {[t.dtype for t in tensors]}")
    return dispatch.call("skinny_linear", backend, x.device, x, weight, bias)


if _ext.HAS_CPP:
    @torch.library.register_fake("fastverify::skinny_linear")
    def _skinny_linear_fake(x, weight, bias):
        return x.new_empty(tuple(x.shape[:-1]) + (weight.shape[0],))

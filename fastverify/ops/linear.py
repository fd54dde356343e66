"""Skinny linear: ``x @ weight.T + bias`` for a few rows, streaming the weight once (csrc/linear.h).

A verify forward scores 1 + k tokens; on the CPU torch's fp32 GEMM costs 2-3x a one-token matrix-vector product
at 2 <= M <= 16, which is what makes drafting expensive there. ``skinny_linear`` keeps the cost of M rows close to
that of one while the weight dominates the traffic (M up to ~8 with AVX-512, ~4 with AVX2 + FMA), and its result
for a row does not depend on the other rows (fixed summation order, see csrc/linear.h).

``skinny_linear_t`` is the same for a weight stored [K, N] (transformers' ``Conv1D``, GPT-2's layers): ``x @ weight
+ bias`` with the weight read in place, each output one chain of fused multiply-adds over k in order.

Backends: torch (``torch.nn.functional.linear``, the reference) and cpp (csrc/cpu/linear.cpp, float32 CPU
tensors; the weight may be float16, read as its exact float32 values: half the bytes to stream, the result of its
float32 copy bit for bit). There is no GPU kernel: cuBLAS already keeps small-M GEMMs bandwidth-bound, so on a GPU
the op is ``F.linear``.

Block-packed weights (``pack_blocks`` / ``skinny_linear_packed``): a float32 weight dequantised from a 4- or 8-bit
block format (a GGUF file's Q4_0 / Q4_1 / Q8_0: w = d * q + m per block of 32 weights along K, d a float16 scale)
holds only 16 or 256 values per block, so it is stored exactly in 0.75 or 1.25 bytes per weight instead of 4; the
kernel dequantises in registers (up to 128 rows, in tiles of up to 8; beyond, four weight rows at a time into the
thread's cache) and runs skinny_linear's own arithmetic on them, so the result is skinny_linear's on the float32
weight, bit for bit, for a fifth (4 bits) of the memory traffic. ``pack_blocks`` returns None for a weight of any
other form: nothing is ever approximated.
"""

from typing import NamedTuple, Optional

import torch

from fastverify import _ext
from fastverify.ops import dispatch
from fastverify.reference.linear import unpack_blocks

__all__ = ["skinny_linear", "skinny_linear_t", "PackedWeight", "pack_blocks", "unpack_blocks", "skinny_linear_packed"]


def _check_dense(x, weight, bias, transposed: bool) -> bool:
    """Checks of skinny_linear's / skinny_linear_t's arguments (weight [N, K] / [K, N]); returns whether the cpp
    kernel takes them as they are (float32 CPU tensors; skinny_linear's weight may be float16)."""
    for name, t in (("x", x), ("weight", weight)) + ((("bias", bias),) if bias is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    layout = "[K, N]" if transposed else "[N, K]"
    if weight.dim() != 2:
        raise ValueError(f"weight: expected shape {layout}, got {tuple(weight.shape)}")
    K, N = weight.shape if transposed else weight.shape[::-1]
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x: expected shape [..., K = {K}], got {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"bias: expected shape [{N}], got {tuple(bias.shape)}")
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"x, weight, bias: expected one device, got {[str(t.device) for t in tensors]}")
    if any(not t.dtype.is_floating_point for t in tensors):
        raise TypeError(f"x, weight, bias: expected floating dtypes, got {[t.dtype for t in tensors]}")
    weights = (torch.float32,) if transposed else (torch.float32, torch.float16)
    return (x.dtype == torch.float32 and weight.dtype in weights and (bias is None or bias.dtype == torch.float32)
            and x.device.type == "cpu")


def _call_dense(op, x, weight, bias, fits_cpp, backend):
    """The op on ``backend`` ("auto": cpp where it takes the arguments, else the reference, which computes in x's
    dtype)."""
    if backend == "auto":  # the C++ kernel where it applies, the reference everywhere else
        backend = "cpp" if fits_cpp and "cpp" in dispatch.implemented_backends(op) else "torch"
    if not fits_cpp or weight.dtype != x.dtype:  # all float32 on the CPU, the common call, needs neither
        if dispatch.resolve(op, backend, x.device) != "cpp":  # the reference: values in x's dtype
            weight = weight.to(x.dtype)
            bias = None if bias is None else bias.to(x.dtype)
        elif not fits_cpp:
            kinds = "float32 or float16" if op == "skinny_linear" else "float32"
            raise TypeError(f"x, weight, bias: the cpp backend takes float32 CPU tensors (weight {kinds}), got "
                            f"{[t.dtype for t in ((x, weight) if bias is None else (x, weight, bias))]}")
    return dispatch.call(op, backend, x.device, x, weight, bias)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor = None, *,
                  backend: str = "auto") -> torch.Tensor:
    """``x @ weight.T + bias``.

    x: float [..., K]; weight: float [N, K]; bias: float [N] or None. Returns [..., N] in x's dtype: a weight or
    bias of another dtype is used as its values in x's dtype. The cpp backend takes float32 CPU tensors and a
    float32 or float16 weight; "auto" uses it for those and ``F.linear`` otherwise.
    """
    fits_cpp = _check_dense(x, weight, bias, transposed=False)
    return _call_dense("skinny_linear", x, weight, bias, fits_cpp, backend)


def skinny_linear_t(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor = None, *,
                    backend: str = "auto") -> torch.Tensor:
    """``x @ weight + bias``: skinny_linear for a weight stored [K, N], as transformers' ``Conv1D`` (GPT-2's
    layers) holds it, read in place (csrc/linear.h: each output one chain of fused multiply-adds over k in order,
    so a row's result does not depend on the other rows).

    x: float [..., K]; weight: float [K, N]; bias: float [N] or None. Returns [..., N] in x's dtype. The cpp
    backend takes float32 CPU tensors; "auto" uses it for those and the reference (``torch.matmul``) otherwise.
    """
    fits_cpp = _check_dense(x, weight, bias, transposed=True)
    return _call_dense("skinny_linear_t", x, weight, bias, fits_cpp, backend)


class PackedWeight(NamedTuple):
    """A float32 weight [N, K] in block-packed form (csrc/linear.h): w[n, k] = d[n, k // 32] * q[n, k] +
    m[n, k // 32] exactly. q uint8 [N, K * bits // 8], d / m float32 [N, K // 32], bits 4 or 8."""
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    bits: int

    @property
    def shape(self):
        return (self.q.shape[0], self.d.shape[1] * 32)


def pack_blocks(weight: torch.Tensor, *, backend: str = "auto") -> Optional[PackedWeight]:
    """``weight`` (float32 [N, K], K a multiple of 32) as a PackedWeight when every block of 32 weights along K
    is exactly d * q + m with q of 4 bits (tried first) or 8 bits (see the module docstring); else None. The
    scale d of a block is found as a GGUF quantiser sets it, rounded to float16: the block's span / 15 (Q4_1),
    its largest magnitude / 8 (Q4_0) or / 127 (Q8_0), or its span / 255; m is the block's minimum. Every block
    is checked exactly: a weight that is not of this form, or whose blocks these scales do not reproduce, gives
    None. Backends: torch (fastverify.reference.linear.pack_blocks, the specification) and cpp (csrc/cpu/linear.cpp:
    the same tensors, one pass over the weight per bit width tried; SmolLM2-135M's 211 layers in 0.53 instead of
    3.3 s on a 2-core Intel Xeon)."""
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != torch.float32
            or weight.shape[1] % 32 or weight.numel() == 0 or weight.device.type != "cpu"):
        return None
    w = weight.detach()
    if dispatch.resolve("pack_blocks", backend, w.device) == "torch":
        N, K = w.shape
        rows = torch.linspace(0, N - 1, min(N, 16), dtype=torch.float64).long().unique()
        if N * K > 1 << 16 and dispatch.call("pack_blocks", "torch", w.device, w[rows])[3] == 0:
            return None  # a few rows first: other weights are refused in ~1 ms
    q, d, m, bits = dispatch.call("pack_blocks", backend, w.device, w)
    return PackedWeight(q, d, m, bits) if bits else None


def skinny_linear_packed(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor = None, *,
                         backend: str = "auto") -> torch.Tensor:
    """``x @ w.T + bias`` for the weight w that ``packed`` holds (``pack_blocks``): skinny_linear's result on w,
    bit for bit, on the cpp backend (float32 CPU x and bias); the reference (``F.linear`` on the unpacked
    weight) elsewhere."""
    if not isinstance(packed, PackedWeight):
        raise TypeError(f"packed: expected a PackedWeight (fastverify.ops.linear.pack_blocks), got "
                        f"{type(packed).__name__}")
    N, K = packed.shape
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x: expected a tensor of shape [..., K = {K}], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (N,)):
        raise ValueError(f"bias: expected a tensor of shape [{N}]")
    fits_cpp = (x.dtype == torch.float32 and x.device.type == "cpu" and packed.q.device.type == "cpu"
                and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu")))
    if backend == "auto":
        backend = "cpp" if fits_cpp and "cpp" in dispatch.implemented_backends("skinny_linear_packed") else "torch"
    if dispatch.resolve("skinny_linear_packed", backend, x.device) == "cpp" and not fits_cpp:
        raise TypeError("x, bias: the cpp backend takes float32 CPU tensors")
    return dispatch.call("skinny_linear_packed", backend, x.device, x, packed.q, packed.d, packed.m, packed.bits,
                         bias)


if _ext.HAS_CPP:
    @torch.library.register_fake("fastverify::skinny_linear")
    def _skinny_linear_fake(x, weight, bias):
        return x.new_empty(tuple(x.shape[:-1]) + (weight.shape[0],))

    try:
        @torch.library.register_fake("fastverify::skinny_linear_t")
        def _skinny_linear_t_fake(x, weight, bias):
            return x.new_empty(tuple(x.shape[:-1]) + (weight.shape[1],))

        @torch.library.register_fake("fastverify::skinny_linear_packed")
        def _skinny_linear_packed_fake(x, q, d, m, bits, bias):
            return x.new_empty(tuple(x.shape[:-1]) + (q.shape[0],))
    except RuntimeError:  # the schema is missing from an old build of _C
        pass

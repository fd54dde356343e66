"""Loading the compiled extension, and choosing a backend for an op.

Backends (DESIGN.md, "Backends and dispatch"):

  torch   the pure-torch reference, fastverify.reference; runs anywhere
  cpp     C++ CPU kernels in fastverify._C (csrc/cpu)
  triton  Triton kernels in fastverify.kernels; CUDA tensors, or CPU tensors under TRITON_INTERPRET=1
  cuda    CUDA C++ kernels in fastverify._C (csrc/cuda)

``backend="auto"`` picks cuda > triton on a CUDA tensor and cpp > torch on a CPU tensor, except for the ops
in CUDA_ORDER, where the Triton kernel was measured much faster than the CUDA one (benchmarks/RESULTS.md).
Set FASTVERIFY_DISABLE_EXT=1 to skip loading the compiled extension (torch / Triton only).
"""

import importlib.util
import os
import warnings

import torch

BACKENDS = ("torch", "cpp", "triton", "cuda")

_C = None
_EXT_ERROR = None
if os.environ.get("FASTVERIFY_DISABLE_EXT", "0") not in ("", "0"):
    _EXT_ERROR = "disabled by FASTVERIFY_DISABLE_EXT"
else:
    try:
        from fastverify import _C  # noqa: F811  (registers torch.ops.fastverify.*)
    except ImportError as e:  # not built, or built against another torch
        _EXT_ERROR = f"{type(e).__name__}: {e}"
        warnings.warn(
            f"fastverify: compiled extension fastverify._C not loaded ({_EXT_ERROR}); "
            "running on the torch (and Triton) backends only. Reinstall with `pip install --no-build-isolation .` "
            "to build it.",
            RuntimeWarning,
            stacklevel=2,
        )

HAS_CPP = _C is not None
HAS_CUDA_KERNELS = HAS_CPP and bool(torch.ops.fastverify.has_cuda())


def triton_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def backends(device="cpu"):
    """Which backends are built and usable for tensors on ``device``: {name: True/False or reason}."""
    device = torch.device(device)
    return {
        "torch": True,
        "cpp": device.type == "cpu" and HAS_CPP,
        "triton": triton_usable(device),
        "cuda": device.type == "cuda" and HAS_CUDA_KERNELS and torch.cuda.is_available(),
    }


# Per-op preference on CUDA tensors where it departs from DESIGN.md's cuda > triton, with the measurement behind
# it (H100, 2026-11-23, benchmarks/bench_gpu.py): tree_attention B8 Hq32 Hkv8 n16 P4096 D128 bf16 took 2.9 ms in
# the CUDA kernel (a CTA per query head re-reads its group's K / V; float32 dot products on CUDA cores) and
# 0.095 ms in the Triton one (tl.dot tiles on the tensor cores).
CUDA_ORDER = {"tree_attention": ("triton", "cuda")}


def resolve_backend(backend: str, device: torch.device, *, has=BACKENDS, op: str = None) -> str:
    """The backend an op call runs on. ``has`` lists the backends this op implements; ``op`` its name."""
    if backend == "auto":
        order = CUDA_ORDER.get(op, ("cuda", "triton")) if device.type == "cuda" else ("cpp", "torch")
        usable = backends(device)
        for name in order:
            if name in has and usable[name]:
                return name
        return "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {('auto',) + BACKENDS}, got {backend!r}")
    if backend not in has:
        raise ValueError(f"backend: {backend!r} does not implement this op (implemented: {has})")
    if not backends(device)[backend]:
        why = {
            "cpp": f"the C++ kernels run on CPU tensors and need fastverify._C ({_EXT_ERROR or 'loaded'})",
            "cuda": "the CUDA kernels need CUDA tensors and a fastverify._C built with CUDA",
            "triton": "Triton needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1, and `pip install triton`",
        }.get(backend, "")
        raise RuntimeError(f"backend={backend!r} is not usable for {device.type} tensors here: {why}")
    return backend

"""Loading the compiled extension, and which backends can run on a device.

Backends (DESIGN.md, "Backends and dispatch"):

  torch   the pure-torch reference, fastverify.reference; runs anywhere
  cpp     C++ CPU kernels in fastverify._C (csrc/cpu)
  triton  Triton kernels in fastverify.kernels; CUDA tensors, or CPU tensors under TRITON_INTERPRET=1
  cuda    CUDA C++ kernels in fastverify._C (csrc/cuda)

Which backend an op call runs on (``backend="auto"`` and the rest) is decided in fastverify/ops/dispatch.py.
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


def compiled_op(name):
    """torch.ops.fastverify.<name> where fastverify._C is loaded and registers it, else None (FASTVERIFY_DISABLE_EXT,
    not built, or a build without that op): for the CPU helper ops outside the dispatch registry, whose callers then
    run torch's ops."""
    return getattr(torch.ops.fastverify, name) if HAS_CPP and hasattr(torch.ops.fastverify, name) else None


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

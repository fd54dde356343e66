"""Choosing and calling an op's backend: one rule for every op, resolved once per call site kind.

Every op has up to four implementations with one normalised signature (DESIGN.md "Backends and dispatch"):

  torch   the reference, fastverify.reference.<module>.<op> (the executable specification)
  cpp     torch.ops.fastverify.<op>, the CPU kernel fastverify._C registers (csrc/cpu)
  cuda    torch.ops.fastverify.<op>, the CUDA kernel fastverify._C registers (csrc/cuda)
  triton  fastverify.kernels.<module>.<op>

An op implements a backend when that code exists here: a kernel registered for the dispatch key, a Triton module
that imports and defines the op (``implemented_backends``). ``backend="auto"`` picks cuda > triton on a CUDA
tensor and cpp > torch on a CPU tensor, among the backends the op implements; an explicit backend that is missing
or unusable on the device raises. What is built and importable does not change while the process runs, so the
choice is made once per (op, backend, device type; and TRITON_INTERPRET for Triton on CPU tensors) and the resolved
function is kept: a small op call pays one dictionary look-up for it.
"""

import functools
import importlib
import os

import torch
import torch.nn.functional as F

from fastverify import _ext

__all__ = ["BACKENDS", "implemented_backends", "resolve", "call", "resolve_backend"]

BACKENDS = _ext.BACKENDS

# op -> the module of fastverify.reference and fastverify.kernels that holds it (None: no such module).
_MODULE = {
    "verify": "verify",
    "uniform": "sampling", "verify_uniforms": "sampling", "cdf_sample": "sampling", "cdf_invert": "sampling",
    "aux_bits": "sampling",
    "tree_mask_bool": "tree", "tree_mask_additive": "tree", "tree_mask_packed": "tree", "tree_positions": "tree",
    "compact_cache": "tree", "compact_cache_layers": "tree",
    "tree_attention": "attention",  # no CUDA kernel: CUDA tensors run on Triton
    "masked_attention": "attention",  # CPU only (the loop's few-row attention); no Triton / CUDA kernel
    "skinny_linear": None,  # reference: F.linear; no Triton kernel (cuBLAS keeps small-M GEMMs bandwidth-bound)
    "skinny_linear_packed": "linear",  # no Triton kernel (CPU only, as skinny_linear)
    "skinny_linear_t": "linear",  # CPU only, as skinny_linear
    "pack_blocks": "linear",  # CPU only
}


def _kernel_module(module):
    """fastverify.kernels.<module>, or None when it does not import (triton missing or broken)."""
    return _import(f"fastverify.kernels.{module}") if module else None


@functools.lru_cache(maxsize=None)
def _import(name):
    try:
        return importlib.import_module(name)
    except Exception:  # the op then runs on its other backends
        return None


def _has_compiled(op, dispatch_key):
    if not _ext.HAS_CPP:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"fastverify::{op}", dispatch_key)
    except RuntimeError:  # the schema is not registered (an old build of _C)
        return False


@functools.lru_cache(maxsize=None)
def implemented_backends(op):
    """The backends whose code for ``op`` exists here (before asking whether a device can run them): torch
    always; cpp / cuda when fastverify._C registers a CPU / CUDA kernel for fastverify::<op>; triton when
    fastverify.kernels.<module> imports and defines the op."""
    if op not in _MODULE:
        raise KeyError(f"fastverify: unknown op {op!r}")
    has = ["torch"]
    if _has_compiled(op, "CPU"):
        has.append("cpp")
    mod = _kernel_module(_MODULE[op])
    if mod is not None and hasattr(mod, op):
        has.append("triton")
    if _ext.HAS_CUDA_KERNELS and _has_compiled(op, "CUDA"):
        has.append("cuda")
    return tuple(has)


def resolve_backend(backend, device, *, has=BACKENDS, op=None):
    """The backend a call runs on, by the rule above; ``has`` lists the backends the op implements, ``op`` names it
    in errors. Not memoised: ``resolve`` is the memoised form."""
    if backend == "auto":
        order = ("cuda", "triton") if device.type == "cuda" else ("cpp", "torch")
        usable = _ext.backends(device)
        for name in order:
            if name in has and usable[name]:
                return name
        return "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {('auto',) + BACKENDS}, got {backend!r}")
    if backend not in has:
        raise ValueError(f"backend: {backend!r} does not implement {op or 'this op'} (implemented: {has})")
    if not _ext.backends(device)[backend]:
        why = {
            "cpp": f"the C++ kernels run on CPU tensors and need fastverify._C ({_ext._EXT_ERROR or 'loaded'})",
            "cuda": "the CUDA kernels need CUDA tensors and a fastverify._C built with CUDA",
            "triton": "Triton needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1, and `pip install triton`",
        }.get(backend, "")
        raise RuntimeError(f"backend={backend!r} is not usable for {device.type} tensors here: {why}")
    return backend


def _implementation(op, name):
    if name == "torch":
        if op == "skinny_linear":
            return F.linear
        return getattr(importlib.import_module(f"fastverify.reference.{_MODULE[op]}"), op)
    if name == "triton":
        return getattr(_kernel_module(_MODULE[op]), op)
    return getattr(torch.ops.fastverify, op)


_RESOLVED = {}  # (op, backend, device type[, TRITON_INTERPRET]) -> (backend name, function)


def _lookup(op, backend, device):
    key = (op, backend, device.type)
    if backend == "triton" and device.type == "cpu":  # usable only under TRITON_INTERPRET=1 (an environment read
        key += (os.environ.get("TRITON_INTERPRET"),)  # costs ~1 us: not on the other backends' path)
    hit = _RESOLVED.get(key)
    if hit is None:
        name = _resolve_key(key, device)
        if name in ("cpp", "cuda"):  # traceable: torch.compile meets the first call of an op with no graph break
            return name, getattr(torch.ops.fastverify, op)
        hit = _RESOLVED[key]
    return hit


@torch.compiler.assume_constant_result  # run, not traced, by torch.compile
def _resolve_key(key, device):
    op, backend = key[:2]
    name = resolve_backend(backend, device, has=implemented_backends(op), op=op)
    _RESOLVED[key] = (name, _implementation(op, name))
    return name


def resolve(op, backend, device):
    """The name of the backend ``op`` runs on for ``backend`` ("auto" or a name) and tensors on ``device``."""
    return _lookup(op, backend, device)[0]


def call(op, backend, device, *args):
    """Run ``op`` on the backend ``resolve`` picks, with the op's normalised arguments."""
    return _lookup(op, backend, device)[1](*args)

"""Every Triton kernel the ops launch, compiled for a GPU on a machine that has none.

The CPU suite runs the Triton kernels under ``TRITON_INTERPRET=1``, which executes them as Python: code that the
interpreter runs but the compiler refuses (a loop-carried value that changes type, a helper returning a tuple the
frontend cannot unpack, a constexpr used as a value) would only show where a GPU is lent. Here the kernels are
imported as compiled kernels (the interpreter off), every launch the ops make is recorded instead of run (the
ops are called on CPU tensors through their public API with ``backend="triton"``; their outputs stay
uninitialised), and each distinct (kernel, argument types, constexpr values, options) is compiled to a cubin for
the given target with Triton's own compiler and ptxas.

    python tests/triton_compile.py [--arch 90] [--list] [--resources] [--kernel NAME ...]

Prints one JSON object: the kernels defined, the launches recorded, and per launch "ok" or the compiler's error
(with --resources also the registers per thread and bytes of spill stores that ptxas reports, and the shared
memory: what a kernel's occupancy on the GPU starts from). tests/test_triton_compile.py runs it in a process of
its own.
"""

import argparse
import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # before triton.jit decorates the kernels: compiled kernels

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fastverify.kernels import attention, sampling, tree, verify  # noqa: E402

MODULES = (attention, sampling, tree, verify)
# fastverify's dispatch takes backend="triton" for CPU tensors only under the interpreter; the kernels above are
# already decorated as compiled ones, so this only opens the dispatch.
os.environ["TRITON_INTERPRET"] = "1"
# The wrappers' one choice by device: tree attention's dots on a CUDA device (tensor cores for half inputs).
attention.fp32_products = lambda q: q.dtype == torch.float32

import fastverify  # noqa: E402

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
         torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
         torch.bool: "i1"}


def _type(value):
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"an argument of type {type(value).__name__}")


LAUNCHES = {}  # key -> (kernel, signature, constexprs, options)


def _record(kernel, grid):
    def launch(*args, **kwargs):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k not in kernel.arg_names}
        bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        signature, constexprs = {}, {}
        for i, (name, value) in enumerate(bound.arguments.items()):
            if kernel.params[i].is_constexpr or value is None:
                signature[name] = "constexpr"
                constexprs[(i,)] = value
            else:
                signature[name] = _type(value)
        key = (kernel.__name__, tuple(signature.items()), repr(sorted(constexprs.items())),
               repr(sorted(options.items())))
        LAUNCHES.setdefault(key, (kernel, signature, constexprs, options))
    return launch


def _exercise():
    """The ops' Triton paths: every verify rule (chains and trees, every logits dtype, draft probabilities or
    none, min_accept), the samplers, the tree masks and positions, the cache compaction, tree attention; then
    the block sizes of a large vocabulary, of a batch of many nodes, of long accepted paths to compact, and tree
    attention's tiles at every head size and query count."""
    g = torch.Generator().manual_seed(0)
    _small(g)
    V = 151936  # the kernels' block sizes at a real vocabulary (the small case above runs its smallest)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    parents = torch.tensor([-1, 0, 0], dtype=torch.int32)
    tokens = torch.randint(0, V, (3,), generator=g)
    seeds = dict(seed=torch.tensor([1]), position=torch.tensor([4]))
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(4, V, generator=g).to(dtype)
        for rule, params in (("greedy", {}), ("gad", {"beta": 3, "tau": 1.0}), ("typical", {"eps": 0.3})):
            fastverify.verify(logits, tokens, cu, parents, rule=rule, backend="triton", validate=False, max_depth=3,
                              **params)
        for rule in ("speculative", "coupled"):
            fastverify.verify(logits, tokens, cu, parents, rule=rule, backend="triton", validate=False, max_depth=3,
                              top_k=50, top_p=0.9, **seeds)
        fastverify.cdf_sample(logits, torch.rand(4, generator=g), top_k=50, top_p=0.9, backend="triton",
                              validate=False)
    # a batch of more nodes (1280) than the walk's and the speculative kernel's lanes, which read them in chunks
    B, n = 64, 20
    cu = torch.arange(0, B * n + 1, n, dtype=torch.int32)
    parents = (torch.arange(B * n, dtype=torch.int32) % n) - 1
    tokens = torch.randint(0, 50, (B * n,), generator=g)
    logits = torch.randn(B * n + B, 50, generator=g)
    seeds = dict(seed=torch.arange(B), position=torch.arange(B))
    fastverify.verify(logits, tokens, cu, parents, rule="greedy", min_accept=2, backend="triton", validate=False,
                      max_depth=n)
    for rule in ("speculative", "coupled"):
        fastverify.verify(logits, tokens, cu, parents, rule=rule, backend="triton", validate=False, max_depth=n,
                          **seeds)
    for depth, dtype in itertools.product((16, 64, 256), (torch.float32, torch.bfloat16)):  # compaction's tiles
        k = torch.randn(2, 2, 2 * depth + 8, 128, generator=g).to(dtype)
        fastverify.compact_cache((k, k.clone()), torch.tensor([4, 2], dtype=torch.int32), depth + 4,
                                 torch.arange(depth, dtype=torch.int32).repeat(2, 1),
                                 torch.tensor([depth, 1], dtype=torch.int32), backend="triton", validate=False)
    for dtype in (torch.float32, torch.bfloat16):
        for n, D in itertools.product((16, 40), (16, 32, 64, 128, 256)):  # every tile tree_attention picks
            q = torch.randn(1, 8, n, D, generator=g).to(dtype)
            k = torch.randn(1, 2, n + 256, D, generator=g).to(dtype)
            mask = fastverify.tree_mask(torch.arange(n, dtype=torch.int32) - 1, torch.tensor([0, n], dtype=torch.int32),
                                        256, format="packed", backend="torch")
            fastverify.tree_attention(q, k, k.clone(), mask, 256, backend="triton")


def _small(g):
    V = 50
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    parents = torch.tensor([-1, 0, 0, -1, 0], dtype=torch.int32)
    tokens = torch.randint(0, V, (5,), generator=g)
    seeds = dict(seed=torch.tensor([1, 2, 3]), position=torch.tensor([4, 5, 6]))
    rules = {"greedy": {}, "topk": {"k": 2}, "distance": {"eps": 2}, "gad": {"beta": 3, "tau": 1.0},
             "typical": {"eps": 0.3, "delta": 0.1}, "confidence": {"beta": 0.5}}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.randn(8, V, generator=g).to(dtype)
        for rule, params in rules.items():
            for min_accept in (0, 1):
                fastverify.verify(logits, tokens, cu, parents, rule=rule, min_accept=min_accept, backend="triton",
                                  validate=False, max_depth=3, **params)
        fastverify.verify(logits, tokens, cu, parents, rule="confidence", beta=0.5, backend="triton",
                          validate=False, max_depth=3, root_tokens=torch.tensor([1, 2, 3]))
        for rule in ("speculative", "coupled"):
            fastverify.verify(logits, tokens, cu, parents, rule=rule, backend="triton", validate=False, max_depth=3,
                              temperature=0.7, top_k=5, top_p=0.9, **seeds)
        probs = torch.softmax(torch.randn(5, V, generator=g), -1).to(dtype)
        fastverify.verify(logits, tokens, cu, parents, rule="speculative", draft_probs=probs, backend="triton",
                          validate=False, max_depth=3, **seeds)
        u = torch.rand(4, generator=g)
        fastverify.cdf_sample(logits[:4], u, backend="triton", validate=False)
        fastverify.cdf_sample(logits[:4], u, temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, backend="triton",
                              validate=False)
        fastverify.cdf_invert(logits[:4], tokens[:4], u, temperature=0.8, top_k=5, backend="triton", validate=False)
    fastverify.uniform(seeds["seed"], seeds["position"], backend="triton")
    fastverify.aux_bits(torch.rand(6, generator=g), backend="triton")
    for fmt in ("bool", "additive", "packed"):
        fastverify.tree_mask(parents, cu, torch.tensor([4, 0, 2], dtype=torch.int32), format=fmt, max_nodes=3,
                             max_prefix=4, backend="triton", validate=False)
    fastverify.tree_positions(parents, cu, torch.tensor([4, 0, 2], dtype=torch.int32), backend="triton",
                              validate=False)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        k = torch.randn(3, 2, 12, 16, generator=g).to(dtype)
        fastverify.compact_cache((k, k.clone()), torch.tensor([4, 2, 6], dtype=torch.int32), 6,
                                 torch.tensor([[0, 1, -1], [1, -1, -1], [2, 0, -1]], dtype=torch.int32),
                                 torch.tensor([2, 1, 2], dtype=torch.int32), backend="triton", validate=False)
        q = torch.randn(3, 4, 3, 16, generator=g).to(dtype)
        packed = fastverify.tree_mask(parents, cu, 6, format="packed", max_nodes=3, backend="torch")
        fastverify.tree_attention(q, k[:, :, :9], k[:, :, :9].clone(), packed, torch.tensor([6, 4, 6]),
                                  backend="triton")


def _resources(compiled, arch):
    """Registers per thread and bytes of spill stores, from ptxas -v on the kernel's PTX (the figures the
    driver would report once the cubin is loaded on a GPU)."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(arch)
    ptxas = getattr(ptxas, "path", None) or ptxas[0]
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}{'a' if arch >= 90 else ''}", ptx, "-o",
                              os.path.join(d, "k.cubin")], capture_output=True, text=True).stderr
    regs, spills = re.search(r"Used (\d+) registers", log), re.search(r"(\d+) bytes spill stores", log)
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": int(spills.group(1)) if spills else None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80 or 90")
    p.add_argument("--list", action="store_true", help="record the launches; compile nothing")
    p.add_argument("--resources", action="store_true", help="registers, spill stores and shared memory per launch")
    p.add_argument("--kernel", action="append", help="only this kernel's launches (repeatable)")
    args = p.parse_args(argv)
    defined = sorted(name for m in MODULES for name, obj in vars(m).items()
                     if isinstance(obj, JITFunction) and name.endswith("_kernel"))
    JITFunction.__getitem__ = _record
    _exercise()
    target = GPUTarget("cuda", args.arch, 32)
    results = []
    for kernel, signature, constexprs, options in LAUNCHES.values():
        if args.kernel and kernel.__name__ not in args.kernel:
            continue
        entry = {"kernel": kernel.__name__, "signature": signature,
                 "constexprs": {list(signature)[i[0]]: repr(v) for i, v in constexprs.items()}, "options": options}
        if not args.list:
            start = time.perf_counter()
            try:
                compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                          target=target, options=options)
                entry["result"] = "ok" if compiled.asm.get("cubin") else "no cubin"
                if args.resources:
                    entry.update(_resources(compiled, args.arch), shared=compiled.metadata.shared)
            except Exception as e:  # the compiler's own message is the finding
                entry["result"] = f"{type(e).__name__}: {e}"[:2000]
            entry["seconds"] = round(time.perf_counter() - start, 2)
        results.append(entry)
    print(json.dumps({"triton": triton.__version__, "arch": args.arch, "defined": defined,
                      "launched": sorted({r["kernel"] for r in results}), "launches": results}))


if __name__ == "__main__":
    main()

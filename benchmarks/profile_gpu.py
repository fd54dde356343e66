"""Where a GPU call's time goes: torch.profiler over a few fastverify calls, kernel time against wall time.

    python benchmarks/profile_gpu.py
"""

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fastverify  # noqa: E402
from bench_verify import RULE_PARAMS, _inputs  # noqa: E402


def show(title, fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    ev = prof.key_averages()
    kernels = sorted((e for e in ev if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    total_dev = sum(e.self_device_time_total for e in ev) / reps
    print(f"\n=== {title}: device time per call {total_dev:.1f} us")
    for e in kernels[:8]:
        print(f"  {e.key[:90]:90s} {e.device_time_total / reps:9.1f} us  x{e.count // reps}")
    cpu = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:6]
    for e in cpu:
        print(f"  cpu {e.key[:86]:86s} {e.self_cpu_time_total / reps:9.1f} us  x{e.count // reps}")


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"profile_gpu.py: needs a CUDA device; this torch ({torch.__version__}) sees none")
    for size, dtype in (((1, 8, 49152), torch.float32), ((32, 16, 151936), torch.float32)):
        for shape in ("chain", "tree"):
            logits, drafts, parents = _inputs(shape, size, dtype)
            logits, drafts = logits.cuda(), drafts.cuda()
            parents = None if parents is None else parents.cuda()
            for rule in ("greedy", "gad", "speculative", "coupled"):
                for be in ("cuda", "triton"):
                    kw = dict(RULE_PARAMS[rule], rule=rule, parents=parents, backend=be, validate=False)
                    if rule in ("speculative", "coupled"):
                        kw.update(seed=7, position=torch.arange(size[0], device="cuda"))
                    show(f"verify {rule} {shape} {size} {be}", lambda: fastverify.verify(logits, drafts, **kw))
    for B, V in ((1, 128256), (64, 151936)):
        logits = torch.randn(B, V, device="cuda") * 3
        u = fastverify.uniform(0, torch.arange(B, device="cuda"))
        for be in ("cuda", "triton"):
            show(f"cdf_sample plain B{B} V{V} {be}", lambda: fastverify.cdf_sample(logits, u, backend=be))
            show(f"cdf_sample topk50 topp0.9 B{B} V{V} {be}",
                 lambda: fastverify.cdf_sample(logits, u, top_k=50, top_p=0.9, backend=be))
    B, Hq, Hkv, n, P, D = 8, 32, 8, 16, 4096, 128
    parents = (torch.arange(B * n, device="cuda", dtype=torch.int32) % n) // 2 - 1
    cu = torch.arange(0, B * n + 1, n, dtype=torch.int32, device="cuda")
    packed = fastverify.tree_mask(parents, cu, n, format="packed")
    q = torch.randn(B, Hq, n, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, P + n, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    show("tree_attention triton", lambda: fastverify.tree_attention(q, k, v, packed, P, backend="triton"))


if __name__ == "__main__":
    main()

"""GPU benchmarks of the CUDA and Triton backends, one table per op, in one process (ratios side by side).

    python benchmarks/bench_gpu.py [--quick] [--json out.json]

Times are medians of 100 (--reps) CUDA-event-timed calls, the L2 cache flushed before each. Two per backend: "api" is the public call (``fastverify.verify(...,
backend=X, validate=False)``, ``fastverify.cdf_sample(..., backend=X)``), Python wrapper and its host
synchronisations included; "op" is the registered op alone on the arguments the wrapper normalised
(torch.ops.fastverify.verify / the Triton custom op), i.e. the kernels plus one dispatch. Effective bandwidth =
logits bytes / median, read against the card's measured read bandwidth (a large ``torch.sum``) and copy
bandwidth (a large device-to-device copy, bytes read + written).
The smallest cases time launch and wrapper overhead rather than memory. Tables: ceilings, verify (every rule,
fp32 / bf16, chains / trees, against torch's composition), cdf_sample (against softmax + multinomial and torch's
sort pipeline), tree attention (CUDA against Triton), compact_cache (against the copy ceiling), and FlashInfer's
top-k / top-p and chain speculative sampling beside ours where ``flashinfer`` imports.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fastverify  # noqa: E402
from fastverify.ops import dispatch  # noqa: E402
from bench_sampling import _softmax_cumsum_searchsorted, _sort_pipeline  # noqa: E402
from bench_verify import RULE_PARAMS, _inputs, composition  # noqa: E402

ROWS = []


REPS = 100  # samples per median (--reps)
_FLUSH = []  # a buffer larger than the L2 cache, rewritten before every sample (outside the timed region)


def timed(fn, reps=None, warmup=3):
    """Median milliseconds of fn() over ``reps`` calls (default REPS), each bracketed by CUDA events, with the L2
    cache flushed before each (a 256 MiB write), so inputs come from HBM as they would in a decoding step."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(64 * 2**20, dtype=torch.float32, device="cuda"))
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps or REPS):
        _FLUSH[0].zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def record(table, case, impl, ms, nbytes):
    gbs = nbytes / (ms * 1e-3) / 1e9
    ROWS.append({"table": table, "case": case, "impl": impl, "ms": ms, "GB/s": gbs})
    print(f"{table:12s} {case:44s} {impl:28s} {ms * 1e3:10.1f} us {gbs:8.0f} GB/s", flush=True)


def captured(op, call):
    """The arguments of the last dispatch of ``op`` during call(): (op, backend, device, normalised arguments)."""
    seen = []
    real = dispatch.call

    def spy(*a):
        if a[0] == op:
            seen.append(a)
        return real(*a)

    dispatch.call = spy
    try:
        call()
    finally:
        dispatch.call = real
    return seen[-1]


def op_only(op, call):
    """A function that re-runs just the op call() ends in (same backend, same normalised arguments)."""
    a = captured(op, call)
    return lambda: dispatch.call(*a)


def ceilings():
    x = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), reps=30)
    record("ceiling", "copy 1 GiB (read + write)", "torch", ms, 2 * x.numel() * 4)
    ms = timed(lambda: x.sum(), reps=30)
    record("ceiling", "read 1 GiB (torch.sum)", "torch", ms, x.numel() * 4)


def bench_verify(quick):
    sizes = [(8, 16, 128256)] if quick else [(1, 8, 49152), (8, 16, 128256), (32, 16, 151936)]
    rules = ("greedy", "gad", "typical", "speculative", "coupled") if quick else tuple(RULE_PARAMS)
    backends = [b for b in ("cuda", "triton") if b in fastverify.backends("cuda")]
    for size in sizes:
        for dtype in (torch.float32, torch.bfloat16):
            for shape in ("chain", "tree"):
                logits, drafts, parents = _inputs(shape, size, dtype)
                logits = logits.cuda()
                drafts = drafts.cuda()
                parents = None if parents is None else parents.cuda()
                nbytes = logits.numel() * logits.element_size()
                for rule in rules:
                    case = f"{rule} {shape} B{size[0]} K{size[1]} V{size[2]} {str(dtype)[6:]}"
                    outs = {}
                    for be in backends:
                        kw = dict(RULE_PARAMS[rule], rule=rule, parents=parents, backend=be, validate=False)
                        if rule in ("speculative", "coupled"):
                            kw.update(seed=7, position=torch.arange(size[0], device="cuda"))
                        fn = lambda: fastverify.verify(logits, drafts, **kw)  # noqa: E731
                        outs[be] = fn()
                        record("verify", case, be + " api", timed(fn), nbytes)
                        record("verify", case, be + " op", timed(op_only("verify", fn)), nbytes)
                    if len(outs) == 2 and rule not in ("speculative",):
                        a, b = outs["cuda"], outs["triton"]
                        same = torch.equal(a.accept_len, b.accept_len) and torch.equal(a.next_token, b.next_token)
                        if not same:
                            print(f"MISMATCH cuda vs triton: {case}", flush=True)
                    if shape == "chain":
                        record("verify", case, "torch composition", timed(composition(rule, logits, drafts)), nbytes)
                del logits


def bench_sampling(quick):
    backends = [b for b in ("cuda", "triton") if b in fastverify.backends("cuda")]
    vocabs = (128256,) if quick else (32000, 128256, 151936)
    for V in vocabs:
        for B in (1, 8, 64):
            logits = torch.randn(B, V, device="cuda") * 3
            u = fastverify.uniform(0, torch.arange(B, device="cuda"))
            nbytes = logits.numel() * 4
            for warp, kw in (("plain", {}), ("topk50 topp0.9", {"top_k": 50, "top_p": 0.9})):
                case = f"{warp} B{B} V{V} fp32"
                for be in backends:
                    fn = lambda: fastverify.cdf_sample(logits, u, backend=be, **kw)  # noqa: E731
                    record("cdf_sample", case, be + " api", timed(fn), nbytes)
                    record("cdf_sample", case, be + " op", timed(op_only("cdf_sample", fn)), nbytes)
                if warp == "plain":
                    record("cdf_sample", case, "softmax+cumsum+searchsorted",
                           timed(lambda: _softmax_cumsum_searchsorted(logits, u)), nbytes)
                    record("cdf_sample", case, "softmax+multinomial",
                           timed(lambda: torch.multinomial(torch.softmax(logits, -1), 1)), nbytes)
                else:
                    record("cdf_sample", case, "sort pipeline", timed(lambda: _sort_pipeline(logits, u)), nbytes)


def bench_attention(quick):
    backends = [b for b in ("cuda", "triton", "torch") if b in fastverify.backends("cuda")]
    shapes = [(1, 32, 8, 64, 2048, 128), (8, 32, 8, 16, 4096, 128)]
    for B, Hq, Hkv, n, P, D in shapes:
        parents = (torch.arange(B * n, device="cuda", dtype=torch.int32) % n) // 2 - 1
        cu = torch.arange(0, B * n + 1, n, dtype=torch.int32, device="cuda")
        packed = fastverify.tree_mask(parents, cu, n, format="packed")
        q = torch.randn(B, Hq, n, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, P + n, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        nbytes = (2 * q.numel() + k.numel() + v.numel()) * 2
        case = f"B{B} Hq{Hq} Hkv{Hkv} n{n} P{P} D{D} bf16"
        ref = None
        for be in backends:
            fn = lambda: fastverify.tree_attention(q, k, v, packed, P, backend=be)  # noqa: E731
            out = fn().float()
            if ref is None:
                ref = out
            err = ((out - ref).norm() / ref.norm()).item()
            record("attention", case + f" (rel err vs {backends[0]} {err:.1e})", be, timed(fn), nbytes)


def bench_cache(quick):
    """compact_cache against the copy ceiling: bytes moved (read + written) per second."""
    backends = [b for b in ("cuda", "triton") if b in fastverify.backends("cuda")]
    shapes = [(8, 8, 4096, 128, 16)] if quick else [(1, 8, 4096, 128, 16), (8, 8, 4096, 128, 16), (32, 8, 2048, 128, 8)]
    for B, H, S, D, K in shapes:
        k = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        start = S - K
        plen = torch.full((B,), start - 64, dtype=torch.int32, device="cuda")  # the moves go back 64 slots
        acc = torch.arange(K, dtype=torch.int32, device="cuda").repeat(B, 1)
        alen = torch.full((B,), K, dtype=torch.int32, device="cuda")
        nbytes = 2 * 2 * B * H * K * D * 2  # k and v, read + written, bf16
        case = f"B{B} H{H} S{S} D{D}, {K} slots moved bf16"
        for be in backends:
            fn = lambda: fastverify.compact_cache((k, v), plen, start, acc, alen, backend=be, validate=False)  # noqa
            record("compact_cache", case, be + " api", timed(fn), nbytes)
        record("compact_cache", case, "torch index_copy", timed(
            lambda: (k[:, :, start - 64:start - 64 + K].copy_(k[:, :, start:start + K]),
                     v[:, :, start - 64:start - 64 + K].copy_(v[:, :, start:start + K]))), nbytes)


def bench_flashinfer(quick):
    """FlashInfer's top-k / top-p sampling and chain speculative sampling beside ours, where it imports."""
    try:
        import flashinfer  # noqa: PLC0415
    except Exception as e:  # not installed on the device, or no build for this torch
        print(f"flashinfer: not available ({type(e).__name__}: {e})", flush=True)
        return
    V = 151936
    for B in (1, 8, 64):
        logits = torch.randn(B, V, device="cuda") * 3
        u = fastverify.uniform(0, torch.arange(B, device="cuda"))
        case = f"topk50 topp0.9 B{B} V{V} fp32"
        nbytes = logits.numel() * 4
        record("flashinfer", case, "fastverify cdf_sample", timed(
            lambda: fastverify.cdf_sample(logits, u, top_k=50, top_p=0.9, validate=False)), nbytes)
        try:
            fn = lambda: flashinfer.sampling.top_k_top_p_sampling_from_logits(logits, 50, 0.9)  # noqa: E731
            record("flashinfer", case, "flashinfer top_k_top_p_sampling_from_logits", timed(fn), nbytes)
        except Exception as e:
            print(f"flashinfer top_k_top_p_sampling_from_logits: {type(e).__name__}: {e}", flush=True)
    B, K = 8, 8
    target = torch.softmax(torch.randn(B, K + 1, V, device="cuda"), -1)
    draft = torch.softmax(torch.randn(B, K, V, device="cuda"), -1)
    tokens = torch.randint(0, V, (B, K), device="cuda")
    nbytes = (target.numel() + draft.numel()) * 4
    case = f"chain speculative B{B} K{K} V{V} fp32 probs"
    seed, pos = torch.arange(B, device="cuda"), torch.zeros(B, dtype=torch.int64, device="cuda")
    target_logits = target.log()
    record("flashinfer", case, "fastverify verify speculative", timed(lambda: fastverify.verify(
        target_logits, tokens, rule="speculative", draft_probs=draft, seed=seed, position=pos, validate=False)),
        nbytes)
    try:
        fn = lambda: flashinfer.sampling.chain_speculative_sampling(draft, tokens.int(), target)  # noqa: E731
        record("flashinfer", case, "flashinfer chain_speculative_sampling", timed(fn), nbytes)
    except Exception as e:
        print(f"flashinfer chain_speculative_sampling: {type(e).__name__}: {e}", flush=True)


def write_markdown(path, argv):
    """A RESULTS.md section of every row measured, one table per op (append it to benchmarks/RESULTS.md)."""
    import datetime  # noqa: PLC0415
    import triton  # noqa: PLC0415

    read = max((r["GB/s"] for r in ROWS if r["table"] == "ceiling" and r["case"].startswith("read")), default=None)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## GPU microbenchmarks, {now}: {torch.cuda.get_device_name()}", "",
             f"torch {torch.__version__}, triton {triton.__version__}; command `python benchmarks/bench_gpu.py "
             f"{' '.join(argv)}`. Medians of {REPS} CUDA-event-timed calls, L2 flushed before each; api = the public call (Python wrapper "
             f"included), op = the registered op on normalised arguments; GB/s = input bytes / median"
             + (f"; % = of the measured read ceiling {read:.0f} GB/s." if read else "."), ""]
    for table in dict.fromkeys(r["table"] for r in ROWS):
        lines += [f"### {table}", "", "| case | implementation | us | GB/s | % of read |", "| --- | --- | --- | --- | --- |"]
        for r in ROWS:
            if r["table"] == table:
                pct = f"{100 * r['GB/s'] / read:.0f}" if read else ""
                lines.append(f"| {r['case']} | {r['impl']} | {r['ms'] * 1e3:.1f} | {r['GB/s']:.0f} | {pct} |")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--markdown", help="also write the tables as a RESULTS.md section to this file")
    ap.add_argument("--only", default="ceilings,verify,sampling,attention,cache,flashinfer")
    ap.add_argument("--reps", type=int, default=REPS, help="samples per median")
    args = ap.parse_args()
    globals()["REPS"] = args.reps
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  backends(cuda): "
          f"{fastverify.backends('cuda')}", flush=True)
    for part in args.only.split(","):
        try:
            {"ceilings": ceilings, "verify": lambda: bench_verify(args.quick),
             "sampling": lambda: bench_sampling(args.quick), "attention": lambda: bench_attention(args.quick),
             "cache": lambda: bench_cache(args.quick), "flashinfer": lambda: bench_flashinfer(args.quick)}[part]()
        except Exception as e:  # keep the other tables when one op fails on the device
            print(f"FAILED {part}: {type(e).__name__}: {e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": ROWS}, f, indent=1)
    if args.markdown:
        write_markdown(args.markdown, sys.argv[1:])


if __name__ == "__main__":
    main()

"""GPU benchmarks of the CUDA and Triton backends: one table per op, every figure from one process (ratios side by
side, against ceilings measured in the same run).

    python benchmarks/bench_gpu.py [--quick] [--reps 100] [--json out.json] [--markdown out.md] [--only verify,..]
    python benchmarks/bench_gpu.py --dry-run       # on a CPU: every code path at tiny sizes (no GPU figure)

How a figure is measured:

- Samples: --reps (default 100) per timing, after 5 warm-up calls; the median is reported, with the 10th-90th
  percentile spread of the GPU timing.
- L2: a 256 MiB buffer (five times an H100's 50 MB L2) is written before every sample, outside the timed region, so
  every sample reads its inputs from device memory, not from the cache.
- Two CUDA-event timings per implementation:
    call  the GPU is idle when a sample starts (synchronised after the flush), so the events time one call as a
          caller sees it: Python wrapper, dispatch and launches included;
    gpu   the samples are queued back to back with no synchronisation (as triton.testing.do_bench does): the host
          runs ahead and the events time the call's kernels on the GPU, host work hidden unless it takes longer.
- Implementations: "<backend> api" is the public call with validate=False (``fastverify.verify``,
  ``fastverify.cdf_sample``, ``fastverify.compact_cache``; ``fastverify.tree_attention`` has no such option);
  "<backend> op" is the registered op alone, re-run on the arguments the public call normalised (captured from
  fastverify.ops.dispatch), i.e. the kernels plus one dispatch (seeded verify's uniforms are drawn before it, so
  they are not in "op"); then the torch code a user writes today (benchmarks/bench_verify.py ``composition``,
  benchmarks/bench_sampling.py) and, where it imports, FlashInfer.
- Ceilings, same process: read = ``torch.sum`` of a 1 GiB float32 tensor (bytes read / time), copy = a 1 GiB
  device-to-device copy (bytes read + written / time). A row's GB/s = the bytes its op must move at least / its gpu
  median: the logits (plus draft_probs where given) for verify and cdf_sample, q, k, v and the output for
  tree_attention, the accepted rows read and written for compact_cache (against the copy ceiling; the rest against
  the read ceiling). "x base" = the baseline's median / this row's median (call, gpu): above 1 is faster.
- Agreement: backends that ran the same inputs are compared (cuda vs triton; for tree_attention, which has no CUDA
  kernel, each backend against the torch reference); a difference prints MISMATCH.

--dry-run runs the same tables on CPU tensors at tiny sizes with the CPU backends (cpp, torch), timed with
time.perf_counter (call and gpu are then the same timing) and a 4 MiB flush: it proves the script, not the kernels.
"""

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fastverify  # noqa: E402
from fastverify.ops import dispatch  # noqa: E402
from bench_sampling import _softmax_cumsum_searchsorted, _softmax_multinomial, _sort_pipeline  # noqa: E402
from bench_verify import RULE_PARAMS, _inputs, composed_gad, composition  # noqa: E402

# GAD++ at beta 3, tau 1.0 here (Xia et al.'s setting); every other rule as in bench_verify.
PARAMS = dict(RULE_PARAMS, gad={"beta": 3, "tau": 1.0})
TABLES = ("ceilings", "verify", "sampling", "flashinfer", "attention", "compact")


# ----------------------------------------------------------------------------------------------- measuring

class Run:
    """One benchmark run: the device, how samples are taken, the ceilings and every row measured."""

    def __init__(self, dry_run, reps, warmup=5):
        self.dry = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.reps, self.warmup = reps, warmup
        self.flush_mib = 4 if dry_run else 256
        self.flush_buffer = torch.empty(self.flush_mib * 2**20 // 4, dtype=torch.float32, device=self.device)
        self.ceiling = {}  # "read" / "copy" -> GB/s
        self.rows = []

    def backends(self, op):
        """The backends of ``op`` measured here, in order: cuda, triton on a GPU; cpp, torch in a dry run."""
        names = ("cpp", "torch") if self.dry else ("cuda", "triton")
        usable = fastverify.backends(self.device)
        return [b for b in names if b in dispatch.implemented_backends(op) and usable[b] is True]

    def _flush(self):
        self.flush_buffer.zero_()

    def _events(self, fn, queued):
        """Per-sample milliseconds of fn() between two CUDA events, L2 flushed before each sample."""
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(self.reps)]
        torch.cuda.synchronize()
        for start, end in pairs:
            self._flush()
            if not queued:
                torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            if not queued:
                end.synchronize()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in pairs]

    def _perf_counter(self, fn):
        times = []
        for _ in range(self.reps):
            self._flush()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    def sample(self, fn):
        """(call, gpu): per-sample milliseconds of fn() in the two timings (one timing, twice, in a dry run)."""
        for _ in range(self.warmup):
            fn()
        if self.dry:
            times = self._perf_counter(fn)
            return times, times
        return self._events(fn, queued=False), self._events(fn, queued=True)

    def record(self, table, case, impl, fn, nbytes=None, ceiling="read", base=None, note=""):
        """Time fn and keep the row; ``base``: the row this one is compared with. Returns the row, or None when
        fn raised (the error is printed as a FAILED line and the run goes on)."""
        try:
            call, gpu = self.sample(fn)
        except Exception as e:  # a backend that fails on this device, a third-party signature that changed
            first = str(e).splitlines()[0][:300] if str(e) else ""
            print(f"FAILED {table} | {case} | {impl}: {type(e).__name__}: {first}", flush=True)
            return None
        row = {"table": table, "case": case, "impl": impl, "call_us": _median(call) * 1e3,
               "gpu_us": _median(gpu) * 1e3, "gpu_p10_us": _quantile(gpu, 0.1) * 1e3,
               "gpu_p90_us": _quantile(gpu, 0.9) * 1e3, "samples": len(gpu), "bytes": nbytes, "note": note}
        if nbytes:
            row["GB/s"] = nbytes / (row["gpu_us"] * 1e-6) / 1e9
            if self.ceiling.get(ceiling):
                row["ceiling"] = ceiling
                row["pct"] = 100 * row["GB/s"] / self.ceiling[ceiling]
        if base is not None:
            row["base"] = base["impl"]
            row["x_call"] = base["call_us"] / row["call_us"]
            row["x_gpu"] = base["gpu_us"] / row["gpu_us"]
        self.rows.append(row)
        print(_line(row), flush=True)
        return row


def _median(xs):
    return _quantile(xs, 0.5)


def _quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _line(r):
    bw = f"{r['GB/s']:8.1f} GB/s" if "GB/s" in r else " " * 13
    pct = f"{r['pct']:5.1f}% {r['ceiling']}" if "pct" in r else " " * 11
    vs = f"  x{r['x_call']:.2f} / x{r['x_gpu']:.2f} vs {r['base']}" if "base" in r else ""
    note = f"  ({r['note']})" if r["note"] else ""
    return (f"{r['table']:10s} {r['case']:44s} {r['impl']:28s} call {r['call_us']:9.1f} us  gpu {r['gpu_us']:9.1f} us"
            f"  {bw} {pct}{vs}{note}")


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


def measure_backends(run, table, case, op, public, nbytes, ceiling="read", base=None):
    """Time ``public(backend)`` (the public call) and the op it dispatches, for every backend of ``op``; ``base``:
    the row both are compared with. Returns {backend: the public call's result} for the agreement checks."""
    outs = {}
    for be in run.backends(op):
        fn = lambda be=be: public(be)  # noqa: E731
        try:
            outs[be] = fn()
            op_fn = op_only(op, fn)
        except Exception as e:
            print(f"FAILED {table} | {case} | {be}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        run.record(table, case, be + " api", fn, nbytes, ceiling, base)
        run.record(table, case, be + " op", op_fn, nbytes, ceiling, base)
    return outs


def check_agreement(case, outs, same):
    """Print MISMATCH when two backends' results differ (``same(a, b)`` says whether they agree)."""
    names = list(outs)
    for other in names[1:]:
        try:
            ok = same(outs[names[0]], outs[other])
        except Exception as e:  # noqa: BLE001
            ok, why = False, f" ({type(e).__name__}: {e})"
        else:
            why = ""
        if not ok:
            print(f"MISMATCH {names[0]} vs {other}: {case}{why}", flush=True)


def _free(run):
    if not run.dry:
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------- tables

def bench_ceilings(run, quick):
    """Read and copy bandwidth of the device: the 100% of every other table."""
    mib = 16 if run.dry else 1024
    x = torch.randn(mib * 2**20 // 4, device=run.device)
    y = torch.empty_like(x)
    read = run.record("ceiling", f"read {mib} MiB (torch.sum)", "torch", lambda: x.sum(), x.numel() * 4)
    copy = run.record("ceiling", f"copy {mib} MiB (read + write)", "torch", lambda: y.copy_(x), 2 * x.numel() * 4)
    run.ceiling = {"read": read and read["GB/s"], "copy": copy and copy["GB/s"]}
    _free(run)


def _verify_grid(run, quick):
    """(sizes, dtypes, shapes, rules). 'speculative+q' is speculative with the drafter's own draft_probs."""
    if run.dry:
        return [(2, 4, 1000)], (torch.float32, torch.bfloat16), ("chain", "tree"), tuple(PARAMS) + ("speculative+q",)
    if quick:
        return [(32, 16, 151936), (8, 16, 128256)], (torch.float32, torch.bfloat16), ("chain",), \
            ("greedy", "gad", "typical", "speculative", "coupled")
    return [(32, 16, 151936), (8, 16, 128256), (1, 8, 49152)], (torch.float32, torch.bfloat16), ("chain", "tree"), \
        tuple(PARAMS) + ("speculative+q",)


def _composition(rule, logits, drafts):
    """The torch composition of ``rule`` with this file's parameters (dense chains)."""
    if rule == "gad":
        return lambda: composed_gad(logits, drafts, PARAMS["gad"]["beta"], PARAMS["gad"]["tau"])
    return composition(rule, logits, drafts)


def _draft_probs(shape, device, seed=1):
    """A drafter's distributions [B, K, V] float32 (softmax of random scores)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.softmax(torch.randn(shape, generator=g, device=device) * 2, dim=-1)


def bench_verify(run, quick):
    """verify under each rule, chains and trees, fp32 and bf16: % of the read ceiling, and the ratio to the torch
    composition of the rule (chains). The sampling rules are seeded (seed + position tensors) and read the logits,
    plus the draft_probs where given ('speculative+q')."""
    sizes, dtypes, shapes, rules = _verify_grid(run, quick)
    for size in sizes:
        B, K, V = size
        for dtype in dtypes:
            for shape in shapes:
                logits, drafts, parents = (t if t is None else t.to(run.device) for t in _inputs(shape, size, dtype))
                position = torch.arange(B, device=run.device)
                for name in rules:
                    rule = "speculative" if name == "speculative+q" else name
                    kw = dict(PARAMS[rule], rule=rule, parents=parents, validate=False)
                    nbytes = logits.numel() * logits.element_size()
                    if rule in ("speculative", "coupled"):
                        kw.update(seed=7, position=position)
                    if name == "speculative+q":
                        kw["draft_probs"] = _draft_probs((B, K, V), run.device)
                        nbytes += kw["draft_probs"].numel() * 4
                    case = f"{name} {shape} ({B}, {K}, {V}) {str(dtype)[6:]}"
                    base = None
                    if shape == "chain" and name != "speculative+q":
                        base = run.record("verify", case, "torch composition", _composition(rule, logits, drafts),
                                          nbytes)
                    outs = measure_backends(run, "verify", case, "verify",
                                            lambda be: fastverify.verify(logits, drafts, backend=be, **kw),
                                            nbytes, base=base)
                    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))  # noqa: E731
                    if rule != "speculative":  # seeded speculative may round its residual differently per backend
                        check_agreement(case, outs, same)
                    elif "cuda" in outs:
                        bench_speculative_deferred(run, case, kw, logits, drafts, nbytes, outs["cuda"], same)
                    kw.pop("draft_probs", None)
                _free(run)


def bench_speculative_deferred(run, case, kw, logits, drafts, nbytes, one_pass, same):
    """The CUDA speculative kernel in two passes (FASTVERIFY_CUDA_SPECULATIVE=deferred: no draw but at each
    request's final row), beside the one-pass rows of the same case; its outputs must be the one-pass kernel's."""
    os.environ["FASTVERIFY_CUDA_SPECULATIVE"] = "deferred"
    try:
        fn = lambda: fastverify.verify(logits, drafts, backend="cuda", **kw)  # noqa: E731
        check_agreement(case, {"cuda": one_pass, "cuda deferred": fn()}, same)
        run.record("verify", case, "cuda deferred api", fn, nbytes)
        run.record("verify", case, "cuda deferred op", op_only("verify", fn), nbytes)
    finally:
        del os.environ["FASTVERIFY_CUDA_SPECULATIVE"]


def bench_sampling(run, quick):
    """cdf_sample, plain and top-k 50 + top-p 0.9, at V = 151936 for batches of 1, 4, 8 and 64 rows: latency
    (call), % of the read ceiling (gpu), against softmax + torch.multinomial (plain) and torch's sort pipeline
    (top-k + top-p)."""
    V = 1000 if run.dry else 151936
    batches = (1, 4) if run.dry else (1, 64) if quick else (1, 4, 8, 64)
    for B in batches:
        g = torch.Generator(device=run.device).manual_seed(0)
        logits = torch.randn(B, V, generator=g, device=run.device) * 3
        u = fastverify.uniform(0, torch.arange(B, device=run.device))
        nbytes = logits.numel() * 4
        for warp, kw in (("plain", {}), ("top-k 50 + top-p 0.9", {"top_k": 50, "top_p": 0.9})):
            case = f"{warp} ({B}, {V}) fp32"
            if warp == "plain":
                base = run.record("cdf_sample", case, "softmax + multinomial",
                                  lambda: _softmax_multinomial(logits, u), nbytes)
                run.record("cdf_sample", case, "softmax + cumsum + searchsorted",
                           lambda: _softmax_cumsum_searchsorted(logits, u), nbytes)
            else:
                base = run.record("cdf_sample", case, "sort pipeline", lambda: _sort_pipeline(logits, u), nbytes)
            outs = measure_backends(run, "cdf_sample", case, "cdf_sample",
                                    lambda be: fastverify.cdf_sample(logits, u, backend=be, validate=False, **kw),
                                    nbytes, base=base)
            check_agreement(case, outs, torch.equal)
        _free(run)


def bench_flashinfer(run, quick):
    """Side by side with FlashInfer (when it imports): top-k + top-p sampling from logits and chain speculative
    sampling, on the same inputs as fastverify's cdf_sample and verify(rule="speculative", draft_probs=...).
    FlashInfer's chain kernel takes probabilities: it is timed on probabilities computed beforehand, and with the
    target's softmax included (fastverify reads the logits)."""
    try:
        import flashinfer  # noqa: PLC0415
        import flashinfer.sampling as fs  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001  (absent, or built for another torch / CUDA)
        print(f"flashinfer: absent ({type(e).__name__}: {str(e)[:200]}); its side-by-side rows are skipped", flush=True)
        return
    version = getattr(flashinfer, "__version__", "?")
    print(f"flashinfer {version}", flush=True)
    V = 151936
    for B in (64,) if quick else (1, 64):
        logits = torch.randn(B, V, device=run.device) * 3
        u = fastverify.uniform(0, torch.arange(B, device=run.device))
        nbytes = logits.numel() * 4
        case = f"top-k 50 + top-p 0.9 ({B}, {V}) fp32"
        base = run.record("flashinfer", case, f"flashinfer {version}",
                          lambda: fs.top_k_top_p_sampling_from_logits(logits, 50, 0.9), nbytes)
        measure_backends(run, "flashinfer", case, "cdf_sample",
                         lambda be: fastverify.cdf_sample(logits, u, top_k=50, top_p=0.9, backend=be, validate=False),
                         nbytes, base=base)
        case = f"plain ({B}, {V}) fp32"
        base = run.record("flashinfer", case, f"flashinfer {version}", lambda: fs.sampling_from_logits(logits), nbytes)
        measure_backends(run, "flashinfer", case, "cdf_sample",
                         lambda be: fastverify.cdf_sample(logits, u, backend=be, validate=False), nbytes, base=base)
    for B, K, V in [(8, 16, 128256)] if quick else [(8, 16, 128256), (32, 16, 151936)]:
        logits, drafts, _ = (t if t is None else t.to(run.device) for t in _inputs("chain", (B, K, V), torch.float32))
        q = _draft_probs((B, K, V), run.device)
        p = torch.softmax(logits, dim=-1)
        drafts32 = drafts.to(torch.int32)
        nbytes = (logits.numel() + q.numel()) * 4
        case = f"chain speculative ({B}, {K}, {V}) fp32"
        base = run.record("flashinfer", case, "flashinfer, from probabilities",
                          lambda: fs.chain_speculative_sampling(q, drafts32, p), nbytes)
        run.record("flashinfer", case, "flashinfer, softmax + sampling",
                   lambda: fs.chain_speculative_sampling(q, drafts32, torch.softmax(logits, dim=-1)), nbytes)
        position = torch.arange(B, device=run.device)
        measure_backends(run, "flashinfer", case, "verify",
                         lambda be: fastverify.verify(logits, drafts, rule="speculative", draft_probs=q, seed=7,
                                                      position=position, backend=be, validate=False),
                         nbytes, base=base)
        _free(run)


def bench_attention(run, quick):
    """tree_attention (on a GPU the Triton kernel: the op has no CUDA one) against what torch does today, SDPA with
    the dense bool tree mask (benchmarks/bench_tree.py's sdpa_dense_mask), each output's error against the torch
    reference."""
    if run.dry:
        shapes, dtype = [(2, 4, 2, 8, 64, 16)], torch.float32
    else:
        shapes = [(8, 32, 8, 16, 4096, 128)] if quick else [(1, 32, 8, 64, 2048, 128), (8, 32, 8, 16, 4096, 128)]
        dtype = torch.bfloat16
    for B, Hq, Hkv, n, P, D in shapes:
        parents = (torch.arange(B * n, device=run.device, dtype=torch.int32) % n) // 2 - 1  # binary trees
        cu = torch.arange(0, B * n + 1, n, dtype=torch.int32, device=run.device)
        packed = fastverify.tree_mask(parents, cu, n, format="packed")
        dense = fastverify.tree_mask(parents, cu, P, format="bool")[:, None]  # [B, 1, n, P + n]
        q = torch.randn(B, Hq, n, D, device=run.device, dtype=dtype)
        k = torch.randn(B, Hkv, P + n, D, device=run.device, dtype=dtype)
        v = torch.randn_like(k)
        ref = fastverify.tree_attention(q.float(), k.float(), v.float(), packed, P, backend="torch")
        nbytes = (2 * q.numel() + k.numel() + v.numel()) * q.element_size()
        case = f"B{B} Hq{Hq} Hkv{Hkv} n{n} P{P} D{D} {str(dtype)[6:]}"
        base = run.record("attention", case, "torch SDPA, dense bool mask",
                          lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True), nbytes)
        for be in run.backends("tree_attention"):
            fn = lambda be=be: fastverify.tree_attention(q, k, v, packed, P, backend=be)  # noqa: E731
            try:
                err = ((fn().float() - ref).norm() / ref.norm()).item()
                op_fn = op_only("tree_attention", fn)
            except Exception as e:  # noqa: BLE001
                print(f"FAILED attention | {case} | {be}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            if not err < (1e-4 if dtype == torch.float32 else 2e-2):
                print(f"MISMATCH {be} vs torch reference: {case} (relative error {err:.1e})", flush=True)
            note = f"rel. error vs reference {err:.1e}"
            run.record("attention", case, be + " api", fn, nbytes, base=base, note=note)
            run.record("attention", case, be + " op", op_fn, nbytes, base=base, note=note)
        _free(run)


def _torch_compact(k, v, draft_start, accepted, prefix_len):
    """What a user writes in torch for compact_cache (every request keeps all its accepted rows): gather the
    accepted slots, scatter them after the prefix."""
    B, H, _, D = k.shape
    src = (draft_start + accepted.long())[:, None, :, None].expand(B, H, -1, D)
    dst = (prefix_len.long()[:, None] + torch.arange(accepted.shape[1], device=k.device))[:, None, :, None]
    dst = dst.expand(B, H, -1, D)

    def fn():
        k.scatter_(2, dst, k.gather(2, src))
        v.scatter_(2, dst, v.gather(2, src))
    return fn


def _compact_agreement(run, case, k, v, draft_start, accepted, accept_len, prefix_len):
    """Each backend's compact_cache on copies of (k, v) against torch's gather + scatter (MISMATCH where one
    differs)."""
    outs = {"torch gather + scatter": (k.clone(), v.clone())}
    _torch_compact(*outs["torch gather + scatter"], draft_start, accepted, prefix_len)()
    for be in run.backends("compact_cache"):
        kk, vv = k.clone(), v.clone()
        try:
            fastverify.compact_cache((kk, vv), prefix_len, draft_start, accepted, accept_len, backend=be,
                                     validate=False)
            outs[be] = (kk, vv)
        except Exception as e:  # noqa: BLE001
            print(f"FAILED compact | {case} | {be}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    check_agreement(case, outs, lambda a, b: torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))


def bench_compact(run, quick):
    """compact_cache of one layer's (k, v): every request keeps ``depth`` of its n draft slots (a path through a
    tree: increasing, non-consecutive slots), moved to the slots after its prefix. % of the copy ceiling, counting
    the accepted rows read and written."""
    if run.dry:
        shapes, dtype = [(2, 2, 64, 8, 4, 8)], torch.float32
    else:
        shapes = [(8, 8, 4096, 128, 12, 16)] if quick else [(8, 8, 4096, 128, 12, 16), (64, 32, 4096, 128, 32, 64)]
        dtype = torch.bfloat16
    for B, H, P, D, depth, n in shapes:
        g = torch.Generator(device=run.device).manual_seed(0)
        k = torch.randn(B, H, P + n, D, device=run.device, dtype=dtype)
        v = torch.randn_like(k)
        accepted = torch.rand(B, n, generator=g, device=run.device).argsort(1)[:, :depth].sort(1).values
        accepted = accepted.to(torch.int32)
        accept_len = torch.full((B,), depth, dtype=torch.int32, device=run.device)
        prefix_len = torch.full((B,), P, dtype=torch.int32, device=run.device)
        nbytes = 2 * 2 * B * H * depth * D * k.element_size()  # k and v, read and written
        case = f"B{B} H{H} S{P + n} D{D} keep {depth} of {n} {str(dtype)[6:]}"
        _compact_agreement(run, case, k, v, P, accepted, accept_len, prefix_len)
        base = run.record("compact", case, "torch gather + scatter", _torch_compact(k, v, P, accepted, prefix_len),
                          nbytes, ceiling="copy")
        measure_backends(run, "compact", case, "compact_cache",
                         lambda be: fastverify.compact_cache((k, v), prefix_len, P, accepted, accept_len, backend=be,
                                                             validate=False),
                         nbytes, ceiling="copy", base=base)
        _free(run)


# ----------------------------------------------------------------------------------------------- output

def device_name(run):
    if run.dry:
        return f"DRY RUN on CPU ({platform.processor() or platform.machine()}), not a GPU figure"
    return torch.cuda.get_device_name()


def versions():
    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers", "flashinfer"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            out[name] = None
    return out


def write_markdown(path, run, argv, date):
    """A RESULTS.md section of every row measured, one table per op (paste it into benchmarks/RESULTS.md)."""
    v = versions()
    ceil = ", ".join(f"{k} {g:.0f} GB/s" for k, g in run.ceiling.items() if g)
    lines = [f"## GPU microbenchmarks, {date}: {device_name(run)}", "",
             f"torch {v['torch']} (CUDA {v['cuda']}), triton {v['triton']}, flashinfer {v['flashinfer'] or 'absent'};"
             f" command `python benchmarks/bench_gpu.py {' '.join(argv)}`. Medians of {run.reps} samples each, the L2"
             f" flushed ({run.flush_mib} MiB written) before every sample. call = CUDA events around one call on an"
             " idle GPU (host work included); gpu = the same with samples queued back to back (the kernels' time;"
             " p10-p90 in brackets); a dry run times both with time.perf_counter. api = the public call with"
             " validate=False, op = the registered op on the normalised arguments. GB/s = the bytes the op must"
             f" move / gpu median; % of the ceiling measured in this run ({ceil or 'not measured'}). x base ="
             " baseline median / this median (call / gpu).", ""]
    for table in dict.fromkeys(r["table"] for r in run.rows):
        lines += [f"### {table}", "",
                  "| case | implementation | call us | gpu us (p10-p90) | GB/s | % of ceiling | x base (call / gpu) |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in run.rows:
            if r["table"] != table:
                continue
            gbs = f"{r['GB/s']:.0f}" if "GB/s" in r else ""
            pct = f"{r['pct']:.0f} ({r['ceiling']})" if "pct" in r else ""
            vs = f"{r['x_call']:.2f} / {r['x_gpu']:.2f} vs {r['base']}" if "base" in r else ""
            impl = r["impl"] + (f" ({r['note']})" if r["note"] else "")
            lines.append(f"| {r['case']} | {impl} | {r['call_us']:.1f} | {r['gpu_us']:.1f} ({r['gpu_p10_us']:.1f}-"
                         f"{r['gpu_p90_us']:.1f}) | {gbs} | {pct} | {vs} |")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one case per table (a few minutes less)")
    ap.add_argument("--dry-run", action="store_true", help="CPU tensors, tiny sizes, CPU backends: checks the script")
    ap.add_argument("--reps", type=int, default=None, help="samples per timing (default 100; 5 with --dry-run)")
    ap.add_argument("--json")
    ap.add_argument("--markdown", help="also write the tables as a RESULTS.md section to this file")
    ap.add_argument("--only", default=",".join(TABLES), help=f"comma-separated subset of {','.join(TABLES)}")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py: no CUDA device (use --dry-run to check the script on a CPU)")
    if args.dry_run:
        torch.set_num_threads(1)  # a check of the script: keep the CPU for other work
    run = Run(args.dry_run, args.reps or (5 if args.dry_run else 100))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"device: {device_name(run)}; {versions()}; backends: {fastverify.backends(run.device)}; {date}", flush=True)
    tables = {"ceilings": bench_ceilings, "verify": bench_verify, "sampling": bench_sampling,
              "flashinfer": bench_flashinfer, "attention": bench_attention, "compact": bench_compact}
    for part in args.only.split(","):
        try:
            tables[part](run, args.quick)
        except Exception as e:  # keep the other tables when one fails on the device
            print(f"FAILED {part}: {type(e).__name__}: {e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name(run), "dry_run": run.dry, "date": date, "versions": versions(),
                       "reps": run.reps, "ceilings": run.ceiling, "rows": run.rows}, f, indent=1, default=str)
    if args.markdown:
        write_markdown(args.markdown, run, sys.argv[1:], date)


if __name__ == "__main__":
    main()

"""Microbenchmarks of fastverify.skinny_linear (CPU) against torch.nn.functional.linear at the layer shapes of
SmolLM2-135M, for the row counts a verify forward has (1 + draft nodes). Effective bandwidth = weight bytes /
median time (a skinny GEMM that reads its weight once is bound by it).

Default run: the LM head (49152 x 576) and the MLP up projection (1536 x 576) at M in {1, 2, 4, 8, 16}, and
every linear layer of the model in turn (test_model_linears) at M up to 128, also with GGUF-quantised values
streamed packed (skinny_linear_packed); GPT-2 small's Conv1D layers in turn (test_gpt2_conv1d_layers: weights
stored [K, N], skinny_linear_t against Conv1D's torch.addmm).
FASTVERIFY_BENCH_FULL=1 adds the other projections (576 x 576, 192 x 576, 576 x 1536) and M = 32.
The small layers fit in the last-level cache when benchmarked alone, so their GB/s exceed DRAM's; in a forward
each layer's weight comes from memory.

    pytest benchmarks/bench_linear.py [--benchmark-json out.json]
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import full_grid, report_bytes

import fastverify  # noqa: F401  (loads the compiled extension)
from fastverify.ops.tree import implemented_backends

SHAPES = [(49152, 576), (1536, 576)] + ([(576, 576), (192, 576), (576, 1536)] if full_grid() else [])
ROWS = [1, 2, 4, 8, 16] + ([32] if full_grid() else [])


@pytest.mark.parametrize("impl", ["skinny", "torch"])
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("N, K", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_linear(benchmark, read_bandwidth, N, K, M, impl):
    if impl == "skinny" and "cpp" not in implemented_backends("skinny_linear"):
        pytest.skip("cpp backend: fastverify._C has no skinny_linear kernel")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g)
    x = torch.randn(1, M, K, generator=g)
    op = torch.ops.fastverify.skinny_linear
    fn = (lambda: op(x, w, None)) if impl == "skinny" else (lambda: F.linear(x, w))  # noqa: E731
    benchmark.pedantic(fn, rounds=15 if N * K < 1e7 else 7, warmup_rounds=2, iterations=1 if N * K > 1e6 else 20)
    report_bytes(benchmark, w.numel() * 4, read_bandwidth, N=N, K=K, M=M, impl=impl)


MODEL_ROWS = [1, 4, 9, 17, 33, 65, 128] + ([256] if full_grid() else [])


def gguf_like(n, k, bits, g):
    """A float32 [n, k] weight as a GGUF file's Q4_1 (bits 4) or Q8_0 (bits 8) blocks dequantise to (float16
    scales; SmolLM2-135M-Instruct.Q4_1.gguf holds its layers in Q4_1 and its embedding / head in Q8_0)."""
    x = torch.randn(n, k // 32, 32, generator=g) * 0.05
    if bits == 4:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        q = ((x - lo) / (hi - lo) * 15 + 0.5).floor().clamp(max=15)
        w = ((hi - lo) / 15).half().float() * q + lo.half().float()
    else:
        d = x.abs().amax(-1, keepdim=True) / 127
        w = (x / d).round() * d.half().float()
    return w.reshape(n, k)


@pytest.mark.parametrize("impl", ["skinny", "packed", "torch"])
@pytest.mark.parametrize("M", MODEL_ROWS)
def test_model_linears(benchmark, read_bandwidth, M, impl):
    """Every linear layer of SmolLM2-135M in turn (30 x q, k, v, o, gate, up, down, then the LM head; 540 MB of
    fp32 weights, so each comes from memory as in a forward): the choice of fastverify.hf.linear.MAX_ROWS.
    "packed": the same layers with GGUF-quantised values (Q4_1 layers, Q8_0 head, as the real model's), streamed
    by skinny_linear_packed (115 MB; bytes reported are the packed ones)."""
    op_name = "skinny_linear_packed" if impl == "packed" else "skinny_linear"
    if impl != "torch" and "cpp" not in implemented_backends(op_name):
        pytest.skip(f"cpp backend: fastverify._C has no {op_name} kernel")
    g = torch.Generator().manual_seed(0)
    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30
    xs = {k: torch.randn(1, M, k, generator=g) for k in (576, 1536)}
    if impl == "packed":
        from fastverify.ops.linear import pack_blocks
        ps = [pack_blocks(gguf_like(n, k, 4, g)) for n, k in shapes] + [pack_blocks(gguf_like(49152, 576, 8, g))]
        op = torch.ops.fastverify.skinny_linear_packed
        nbytes = sum(p.q.numel() + 4 * (p.d.numel() + p.m.numel()) for p in ps)

        def run():
            for p in ps:
                op(xs[p.d.shape[1] * 32], p.q, p.d, p.m, p.bits, None)
    else:
        ws = [torch.randn(n, k, generator=g) for n, k in shapes] + [torch.randn(49152, 576, generator=g)]
        op = torch.ops.fastverify.skinny_linear if impl == "skinny" else None
        nbytes = sum(w.numel() for w in ws) * 4

        def run():
            for w in ws:
                (op(xs[w.shape[1]], w, None) if op is not None else F.linear(xs[w.shape[1]], w))

    benchmark.pedantic(run, rounds=5, warmup_rounds=1, iterations=1)
    report_bytes(benchmark, nbytes, read_bandwidth, M=M, impl=impl)


GPT2_ROWS = [1, 2, 4, 9, 17] + ([33, 65, 128] if full_grid() else [])


@pytest.mark.parametrize("impl", ["skinny_t", "skinny", "torch"])
@pytest.mark.parametrize("M", GPT2_ROWS)
def test_gpt2_conv1d_layers(benchmark, read_bandwidth, M, impl):
    """GPT-2 small's Conv1D layers in turn (12 x c_attn 768 -> 2304, attention c_proj 768 -> 768, c_fc 768 -> 3072,
    MLP c_proj 3072 -> 768; weights stored [K, N], 340 MB of fp32, each from memory as in a forward): "skinny_t"
    streams them in place (skinny_linear_t, what the loop runs), "torch" is Conv1D's own ``torch.addmm``, "skinny"
    the same weights stored [N, K] through skinny_linear (what they would cost as nn.Linear layers)."""
    op_name = {"skinny_t": "skinny_linear_t", "skinny": "skinny_linear"}.get(impl)
    if op_name is not None and "cpp" not in implemented_backends(op_name):
        pytest.skip(f"cpp backend: fastverify._C has no {op_name} kernel")
    g = torch.Generator().manual_seed(0)
    shapes = [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12  # (K, N)
    xs = {k: torch.randn(1, M, k, generator=g) for k in (768, 3072)}
    ws = [torch.randn(k, n, generator=g) for k, n in shapes]
    bs = [torch.randn(n, generator=g) for _, n in shapes]
    if impl == "skinny":
        ws = [w.T.contiguous() for w in ws]
    op = torch.ops.fastverify.skinny_linear_t if impl == "skinny_t" else torch.ops.fastverify.skinny_linear

    def run():
        for w, b in zip(ws, bs):
            if impl == "torch":
                torch.addmm(b, xs[w.shape[0]].view(M, -1), w)
            else:
                op(xs[w.shape[0] if impl == "skinny_t" else w.shape[1]], w, b)

    benchmark.pedantic(run, rounds=5, warmup_rounds=1, iterations=1)
    report_bytes(benchmark, sum(w.numel() for w in ws) * 4, read_bandwidth, M=M, impl=impl)


@pytest.mark.parametrize("M", [1, 2, 4])
def test_heads_levels_linears(benchmark, read_bandwidth, M):
    """A tree level of the shipped proposal heads' shape, five in turn (fastverify.hf.bpd: a sequential head's step
    [1152, 1152] and output [576, 1152] linears, then the 8192-token projection [8192, 576]; Q8_0 values streamed
    packed, 1.25 bytes a weight; 42 MB in all, so that each level's weights come from memory, as a step's first
    level reads them after the model's forward) at the frontier's row counts."""
    if "cpp" not in implemented_backends("skinny_linear_packed"):
        pytest.skip("cpp backend: fastverify._C has no skinny_linear_packed kernel")
    from fastverify.ops.linear import pack_blocks
    g = torch.Generator().manual_seed(0)
    levels = [[pack_blocks(gguf_like(n, k, 8, g)) for n, k in ((1152, 1152), (576, 1152), (8192, 576))]
              for _ in range(5)]
    xs = {k: torch.randn(1, M, k, generator=g) for k in (576, 1152)}
    op = torch.ops.fastverify.skinny_linear_packed
    nbytes = sum(p.q.numel() + 4 * (p.d.numel() + p.m.numel()) for level in levels for p in level)

    def run():
        for level in levels:
            for p in level:
                op(xs[p.d.shape[1] * 32], p.q, p.d, p.m, p.bits, None)

    benchmark.pedantic(run, rounds=15, warmup_rounds=1, iterations=1)
    report_bytes(benchmark, nbytes, read_bandwidth, M=M, impl="packed")

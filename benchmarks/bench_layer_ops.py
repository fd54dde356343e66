"""Microbenchmarks of the lean decoder layers' fused CPU ops against the torch expressions they replace, at
SmolLM2-135M's shapes: ``fastverify::rms_norm`` (hidden size 576) and ``fastverify::rotary_embedding`` (q and k of a
layer together: 12 heads of 64, the lean layers' strided view). A decoding step calls them with a few rows, where a
call costs its dispatch and set-up far more than its bytes, so the figure that matters is microseconds per call;
the effective bandwidth (bytes read and written / median) is recorded beside it. Each op's result is the torch
expression's bit for bit (tests/test_norm.py, tests/test_rotary.py).

    pytest benchmarks/bench_layer_ops.py [--benchmark-json out.json]
"""

import pytest
import torch
from conftest import report_bytes

import fastverify  # noqa: F401  (loads the compiled extension)
from fastverify import _ext

ROWS = [1, 7, 700]


def _has(op):
    if _ext.compiled_op(op) is None:
        pytest.skip(f"fastverify._C has no {op} kernel")


@pytest.mark.parametrize("impl", ["fused", "torch"])
@pytest.mark.parametrize("M", ROWS)
def test_rms_norm(benchmark, read_bandwidth, M, impl):
    _has("rms_norm")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, M, 576, generator=g), torch.randn(576, generator=g)
    op = torch.ops.fastverify.rms_norm
    fn = ((lambda: op(x, w, 1e-5)) if impl == "fused"  # noqa: E731
          else (lambda: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))))
    benchmark.pedantic(fn, rounds=15, warmup_rounds=2, iterations=200 if M < 100 else 20)
    report_bytes(benchmark, 2 * x.numel() * 4, read_bandwidth, M=M, impl=impl)


@pytest.mark.parametrize("impl", ["fused", "torch"])
@pytest.mark.parametrize("M", ROWS)
def test_rotary_embedding(benchmark, read_bandwidth, M, impl):
    _has("rotary_embedding")
    g = torch.Generator().manual_seed(1)
    qk = torch.randn(1, M, 15, 64, generator=g)[:, :, :12].transpose(1, 2)  # q and k heads of the q / k / v rows
    angles = torch.rand(1, M, 32, generator=g).repeat(1, 1, 2)
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    sin_rolled = torch.cat((-sin[..., :32], sin[..., 32:]), -1)  # what the torch path of the lean layers uses
    op = torch.ops.fastverify.rotary_embedding
    fn = ((lambda: op(qk, cos, sin)) if impl == "fused"  # noqa: E731
          else (lambda: qk * cos + qk.roll(32, -1) * sin_rolled))
    benchmark.pedantic(fn, rounds=15, warmup_rounds=2, iterations=200 if M < 100 else 20)
    report_bytes(benchmark, 2 * qk.numel() * 4 + 2 * cos.numel() * 4, read_bandwidth, M=M, impl=impl)

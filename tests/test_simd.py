"""The C++ kernels take their AVX2 paths where the CPU has AVX2 + FMA + F16C, and their scalar paths under
FASTVERIFY_NO_SIMD=1 (scripts/test.sh runs the cpp tests a second time that way)."""

import os

import pytest
import torch

from fastverify import _ext


@pytest.mark.skipif(not _ext.HAS_CPP, reason="cpp backend: fastverify._C is not built")
def test_cpp_simd_path_follows_the_environment():
    disabled = os.environ.get("FASTVERIFY_NO_SIMD", "") not in ("", "0")
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    has = all(f in flags for f in ("avx2", "fma"))
    assert bool(torch.ops.fastverify.cpu_simd()) == (has and not disabled)


_SKINNY = """
import sys, torch, fastverify
g = torch.Generator().manual_seed(0)
x, w, b = torch.randn(7, 581, generator=g), torch.randn(203, 581, generator=g), torch.randn(203, generator=g)
torch.save(torch.ops.fastverify.skinny_linear(x, w, b), sys.argv[1])
"""


@pytest.mark.skipif(not _ext.HAS_CPP or not torch.ops.fastverify.cpu_simd(),
                    reason="needs the cpp backend on a CPU with AVX2 + FMA (and FASTVERIFY_NO_SIMD unset)")
def test_skinny_linear_is_bit_identical_on_both_paths(tmp_path):
    # csrc/linear.h spells out the same fused multiply-adds and reduction order on the scalar path
    import subprocess
    import sys
    out = {}
    for name, flag in (("simd", "0"), ("scalar", "1")):
        path = str(tmp_path / f"{name}.pt")
        subprocess.run([sys.executable, "-c", _SKINNY, path], check=True,
                       env=dict(os.environ, FASTVERIFY_NO_SIMD=flag))
        out[name] = torch.load(path)
    assert torch.equal(out["simd"], out["scalar"])

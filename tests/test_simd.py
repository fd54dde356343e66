"""The C++ kernels take their AVX2 paths where the CPU has AVX2 + FMA + F16C, and their scalar paths under
FASTVERIFY_NO_SIMD=1 (scripts/test.sh runs the cpp tests a second time that way); skinny_linear also has an
AVX-512 path, which FASTVERIFY_NO_AVX512=1 turns off."""

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
    no512 = os.environ.get("FASTVERIFY_NO_AVX512", "") not in ("", "0")
    assert bool(torch.ops.fastverify.cpu_avx512()) == (has and "avx512f" in flags and not disabled and not no512)


_SKINNY = """
import sys, torch, fastverify
g = torch.Generator().manual_seed(0)
out = []
for M, K, N in ((7, 581, 203), (16, 576, 37), (1, 15, 5), (13, 1536, 9)):
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    out.append(torch.ops.fastverify.skinny_linear(x, w, b))
    out.append(torch.ops.fastverify.skinny_linear(x, w.half(), b))  # float16 weights: converted as they are read
for M, K, N in ((7, 581, 203), (13, 64, 112), (1, 15, 5), (6, 33, 64), (17, 100, 80), (4, 37, 83), (3, 9, 16)):
    x, w, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g), torch.randn(N, generator=g)
    out.append(torch.ops.fastverify.skinny_linear_t(x, w, b))
    out.append(torch.ops.fastverify.skinny_linear_t(x, w, None))
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(not _ext.HAS_CPP or not torch.ops.fastverify.cpu_simd(),
                    reason="needs the cpp backend on a CPU with AVX2 + FMA (and FASTVERIFY_NO_SIMD unset)")
def test_skinny_linear_is_bit_identical_on_every_path(tmp_path):
    # csrc/linear.h spells out the same fused multiply-adds and reduction order on the AVX-512, AVX2 and scalar
    # paths (odd K: the tail; M past one tile; N not a multiple of the block), skinny_linear_t's too (N past and
    # short of a band, the scalar columns after the registers)
    import subprocess
    import sys
    out = {}
    for name, no_simd, no512 in (("avx512", "0", "0"), ("avx2", "0", "1"), ("scalar", "1", "0")):
        path = str(tmp_path / f"{name}.pt")
        subprocess.run([sys.executable, "-c", _SKINNY, path], check=True,
                       env=dict(os.environ, FASTVERIFY_NO_SIMD=no_simd, FASTVERIFY_NO_AVX512=no512))
        out[name] = torch.load(path)
    for name in ("avx2", "scalar"):
        for a, b in zip(out["avx512"], out[name]):
            assert torch.equal(a, b), name

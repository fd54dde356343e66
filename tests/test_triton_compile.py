"""The Triton kernels compile for a GPU (tests/triton_compile.py: every launch the ops make, compiled to a cubin
with Triton's compiler and ptxas, no GPU needed), beside the interpreter runs of the other tests."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")
HERE = os.path.dirname(os.path.abspath(__file__))


def _run(*args, timeout=900):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _compiler_available():
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except Exception as e:  # a Triton without its NVIDIA backend
        pytest.skip(f"Triton's NVIDIA backend is not importable here: {e}")


# The shared memory a block may use on sm_86 / sm_89, the least of the GPUs Triton targets (sm_80: 163 KiB,
# sm_90: 227 KiB): a launch asking for more fails there with OutOfResources.
SHARED_LIMIT = 99 * 1024


@pytest.mark.parametrize("arch", [90, 80, 100])  # Hopper (the GPUs measured on), Ampere, Blackwell
def test_every_launch_compiles(arch):
    _compiler_available()
    report = json.loads(_run(os.path.join(HERE, "triton_compile.py"), "--arch", str(arch), "--resources"))
    assert report["defined"] and report["launched"] == report["defined"], (
        f"kernels no op launched here: {sorted(set(report['defined']) - set(report['launched']))}")
    failed = [f"{r['kernel']} {r['constexprs']}: {r['result']}" for r in report["launches"] if r["result"] != "ok"]
    assert not failed, "\n".join(failed)
    assert len(report["launches"]) >= 50  # every rule, dtype and option combination above, not one per kernel
    large = [f"{r['kernel']} {r['constexprs']}: {r['shared']} bytes" for r in report["launches"]
             if r["shared"] > SHARED_LIMIT]
    assert not large, "shared memory past what sm_86 / sm_89 give a block:\n" + "\n".join(large)


@pytest.mark.parametrize("arch", [80, 86, 90, 100])
def test_sized_tiles_do_not_spill(arch):
    """The kernels whose tiles the wrappers size by the input keep their state in registers, within the shared
    memory every GPU gives a block: tree_attention's (kernels/attention.py, ``tiles``) at every head size, query
    block and dtype; compact_cache's at paths of 16-256 nodes; verify's walk at a batch of 1,280 nodes."""
    _compiler_available()
    report = json.loads(_run(os.path.join(HERE, "triton_compile.py"), "--arch", str(arch), "--resources",
                             "--kernel", "_tree_attention_kernel", "--kernel", "_compact_cache_kernel",
                             "--kernel", "_verify_walk_kernel"))
    launches = report["launches"]
    attention = [r for r in launches if r["kernel"] == "_tree_attention_kernel"]
    assert {r["constexprs"]["BLOCK_D"] for r in attention} == {"16", "32", "64", "128", "256"}
    assert {r["constexprs"]["BLOCK_M"] for r in attention} == {"16", "32"}
    assert {r["constexprs"]["DEPTH"] for r in launches if r["kernel"] == "_compact_cache_kernel"} >= {"64", "256"}
    assert "128" in {r["constexprs"]["BLOCK_N"] for r in launches if r["kernel"] == "_verify_walk_kernel"}
    bad = [f"{r['kernel']} {r['signature']} {r['constexprs']} {r['options']}: {r['result']}, {r.get('registers')} "
           f"registers, {r.get('spill_bytes')} bytes spilled, {r.get('shared')} bytes shared" for r in launches
           if r["result"] != "ok" or r["spill_bytes"] != 0 or r["shared"] > SHARED_LIMIT]
    assert not bad, "\n".join(bad)


def test_the_harness_sees_a_kernel_the_compiler_refuses(tmp_path):
    """A kernel the interpreter runs (a loop-carried value that changes type) is refused by the compiler the
    harness calls, and the same kernel typed consistently compiles."""
    _compiler_available()
    script = textwrap.dedent("""
        import os
        os.environ.pop("TRITON_INTERPRET", None)
        import triton, triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        @triton.jit
        def refused(x_ptr, n):
            acc = 0
            for i in range(n):
                acc = acc + tl.load(x_ptr + i)  # int32 before the loop, float32 in it
            tl.store(x_ptr, acc)

        @triton.jit
        def accepted(x_ptr, n):
            acc = 0.0
            for i in range(n):
                acc = acc + tl.load(x_ptr + i)
            tl.store(x_ptr, acc)

        for kernel in (refused, accepted):
            try:
                triton.compile(ASTSource(fn=kernel, signature={"x_ptr": "*fp32", "n": "i32"}, constexprs={}),
                               target=GPUTarget("cuda", 90, 32))
                print("compiled")
            except Exception as e:
                print("refused", type(e).__name__)
    """)
    path = tmp_path / "refused.py"  # (triton.jit reads a kernel's source from its file)
    path.write_text(script)
    assert _run(str(path)).split("\n")[:2] == ["refused CompilationError", "compiled"]

"""Build fastverify and its compiled extension fastverify._C.

Environment flags (all optional):

  FASTVERIFY_NO_EXT=1        build no compiled extension; the package runs on the torch / Triton backends.
  FASTVERIFY_NO_CUDA=1       build the C++ CPU kernels only, even where a CUDA torch and nvcc exist.
  FASTVERIFY_FORCE_CUDA=1    build the CUDA kernels too; fail if CUDA torch or nvcc is missing.
  TORCH_CUDA_ARCH_LIST       GPU architectures to compile for (default "9.0", Hopper: the H100/H200 we test on;
                             no GPU is needed at build time).
  MAX_JOBS                   parallel compile jobs (default: from cores and memory, ~3 GiB per nvcc job).
  FASTVERIFY_DEBUG=1         -O0 -g, no -DNDEBUG.

The CPU kernels are always built when the extension is. CUDA kernels are built iff torch is a CUDA build
and nvcc is found (CUDA_HOME), unless FASTVERIFY_NO_CUDA is set.
"""

import glob
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _default_max_jobs():
    cores = os.cpu_count() or 1
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = 4
    return max(1, min(cores, int(mem_gib // 3)))


def _resolve_cuda_home():
    """torch derives CUDA_HOME from `which nvcc`; where nvcc is a wrapper script (/usr/local/bin/nvcc exec'ing
    /usr/local/cuda-X.Y/bin/nvcc) that gives /usr/local, whose lib dir has no libcudart. Follow the wrapper."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    for candidate in ("/usr/local/cuda",):
        if os.path.isfile(os.path.join(candidate, "bin", "nvcc")):
            os.environ["CUDA_HOME"] = candidate
            return


def _extensions():
    if _flag("FASTVERIFY_NO_EXT"):
        return [], {}
    _resolve_cuda_home()  # before torch.utils.cpp_extension reads it
    import torch
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise RuntimeError("fastverify's extension build requires ninja: pip install ninja")
    os.environ.setdefault("MAX_JOBS", str(_default_max_jobs()))

    debug = _flag("FASTVERIFY_DEBUG")
    opt = ["-O0", "-g"] if debug else ["-O3", "-DNDEBUG"]
    # -g0 (the C++ compiles; nvcc has no such option and is not given Python's flags): Python's own compile flags
    # (sysconfig CFLAGS) carry -g, which put ~32 MB of debug information around ~1 MB of code in a release build
    cxx = opt + ([] if debug else ["-g0"]) + ["-std=c++20", "-fopenmp", "-Wno-unused-function"]
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    include_dirs = [os.path.join(ROOT, "csrc")]

    want_cuda = not _flag("FASTVERIFY_NO_CUDA")
    have_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if _flag("FASTVERIFY_FORCE_CUDA") and not have_cuda:
        raise RuntimeError(
            f"FASTVERIFY_FORCE_CUDA=1 but torch.version.cuda={torch.version.cuda!r}, "
            f"CUDA_HOME={cpp_extension.CUDA_HOME!r}: need a CUDA build of torch and nvcc")
    build_cuda = want_cuda and have_cuda
    extra = {"cxx": cxx}
    if build_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        extra["cxx"] = cxx + ["-DFASTVERIFY_WITH_CUDA"]
        extra["nvcc"] = opt + ["-std=c++20", "-DFASTVERIFY_WITH_CUDA", "--expt-relaxed-constexpr", "-lineinfo"]
        # torch's CUDA headers include cuBLAS/cuSPARSE headers; those ship in torch's own nvidia wheels. The wheels
        # also carry their CUDA runtime's headers, of torch's CUDA release, which may be newer than nvcc's (torch
        # 2.15's 13.2 against a 13.0 toolkit): nvcc refuses to mix them. The toolkit's own include directory goes
        # first, so the wheels only supply what the toolkit lacks (cuBLAS, cuSPARSE, cuSOLVER, cuFFT).
        include_dirs.append(os.path.join(cpp_extension.CUDA_HOME, "include"))
        for site in sys.path:
            for inc in glob.glob(os.path.join(site, "nvidia", "*", "include")):
                if os.path.isdir(inc) and inc not in include_dirs:
                    include_dirs.append(inc)
        ext_cls = cpp_extension.CUDAExtension
    else:
        ext_cls = cpp_extension.CppExtension
    print(f"fastverify: building _C with {'CPU + CUDA' if build_cuda else 'CPU'} kernels "
          f"({len(sources)} sources, MAX_JOBS={os.environ['MAX_JOBS']})", file=sys.stderr)
    ext = ext_cls(
        "fastverify._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args=extra,
        extra_link_args=["-fopenmp"],
        py_limited_api=True,
    )
    cmdclass = {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}
    return [ext], cmdclass


ext_modules, cmdclass = _extensions()

setup(
    name="fastverify",
    version="0.1.0",
    description="Fast, exact draft-and-verify decoding kernels for PyTorch and Hugging Face models",
    packages=find_packages(include=["fastverify", "fastverify.*"]) + ["fastverify.kernels"],
    package_dir={"fastverify.kernels": "kernels"},
    # shipped drafter checkpoints (fastverify.load_drafter("smollm2-bpd" | "-gad" | "-lud" | "-ptp", model)):
    # data, not a package
    package_data={"fastverify": ["checkpoints/*/config.json", "checkpoints/*/heads.safetensors",
                                 "checkpoints/*/slots.safetensors"]},
    python_requires=">=3.10",
    # the oldest torch the tests ran on (2.11: the GPU machine's; 2.13, 2.14 and 2.15 here)
    install_requires=["torch>=2.11"],
    extras_require={
        "triton": ["triton"],
        "hf": ["transformers>=5.17,<6", "gguf", "accelerate"],
        "test": ["pytest", "pytest-benchmark", "transformers>=5.17,<6", "gguf", "accelerate"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": "cp39"}} if ext_modules else {},
)

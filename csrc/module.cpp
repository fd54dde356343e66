// fastverify._C: the compiled kernels. Importing the module loads this shared library, whose static
// initialisers register every op with the dispatcher (TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL in the
// other sources). The Python module itself is empty; ops are reached as torch.ops.fastverify.<name>.
#include <Python.h>
#include <torch/library.h>

#include "cpu_features.h"

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace {
bool has_cuda() {
#ifdef FASTVERIFY_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// Whether the CPU kernels take their AVX2 + FMA paths (false on other CPUs and under FASTVERIFY_NO_SIMD=1).
bool cpu_simd() { return fastverify::cpu_has_avx2_fma(); }
// Whether skinny_linear takes its AVX-512 path (false on other CPUs and under FASTVERIFY_NO_SIMD=1 or
// FASTVERIFY_NO_AVX512=1).
bool cpu_avx512() { return fastverify::cpu_has_avx512(); }
}  // namespace

// The namespace owner. Each op declares its schema once, in csrc/<op>.cpp, with TORCH_LIBRARY_FRAGMENT;
// its CPU kernel lives in csrc/cpu/<op>.cpp, its CUDA kernel in csrc/cuda/<op>.cu.
TORCH_LIBRARY(fastverify, m) {
  m.def("has_cuda() -> bool", &has_cuda);
  m.def("cpu_simd() -> bool", &cpu_simd);
  m.def("cpu_avx512() -> bool", &cpu_avx512);
}

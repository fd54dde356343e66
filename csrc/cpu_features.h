// Run-time choice between the AVX2 + FMA paths of the CPU kernels and their portable scalar paths. The extension
// is compiled for baseline x86-64, so the SIMD paths are taken only where the CPU has the instructions; setting
// FASTVERIFY_NO_SIMD=1 (read once per process) forces the scalar paths, so that tests check them too on a machine
// that has AVX2.
#pragma once

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FASTVERIFY_X86 1  // the AVX2 paths exist (compiled with target attributes), chosen by cpu_has_avx2_fma()
#endif

namespace fastverify {

inline bool simd_disabled() {
  static const bool off = [] {
    const char* v = std::getenv("FASTVERIFY_NO_SIMD");
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }();
  return off;
}

// AVX2 and FMA (and F16C when f16c is true) present and not disabled.
inline bool cpu_has_avx2_fma(bool f16c = false) {
#ifdef FASTVERIFY_X86
  static const bool base = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  static const bool half = __builtin_cpu_supports("f16c");
  return !simd_disabled() && base && (!f16c || half);
#else
  (void)f16c;
  return false;
#endif
}

}  // namespace fastverify

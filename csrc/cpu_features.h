// Run-time choice between the AVX-512 / AVX2 + FMA paths of the CPU kernels and their portable scalar paths. The
// extension is compiled for baseline x86-64, so the SIMD paths are taken only where the CPU has the instructions.
// Environment flags (read once per process), so that tests check every path on a machine that has them all:
// FASTVERIFY_NO_SIMD=1 forces the scalar paths; FASTVERIFY_NO_AVX512=1 keeps the AVX2 paths on an AVX-512 CPU.
#pragma once

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FASTVERIFY_X86 1  // the AVX2 paths exist (compiled with target attributes), chosen by cpu_has_avx2_fma()
#endif

namespace fastverify {

inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

inline bool simd_disabled() {
  static const bool off = env_flag("FASTVERIFY_NO_SIMD");
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

// AVX-512 F (and AVX2 + FMA) present and neither FASTVERIFY_NO_SIMD nor FASTVERIFY_NO_AVX512 set.
inline bool cpu_has_avx512() {
#ifdef FASTVERIFY_X86
  static const bool on = __builtin_cpu_supports("avx512f") && !env_flag("FASTVERIFY_NO_AVX512");
  return on && cpu_has_avx2_fma();
#else
  return false;
#endif
}

}  // namespace fastverify

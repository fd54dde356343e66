// Framework-free skinny GEMM of fastverify::skinny_linear (CPU): y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for
// a few rows m (a verify forward scores 1 + k draft tokens). Raw pointers and sizes only; the binding
// (csrc/cpu/linear.cpp) checks inputs and splits the output columns n across threads.
//
// Why: a decoding step is bound by reading the weights, so scoring a handful of tokens should cost what scoring
// one does. torch's fp32 CPU GEMM does not behave so at M = 2..16 (SmolLM2's 49152 x 576 head: 9.5 ms at M = 1,
// 20.5 ms at M = 2, 31.7 ms at M = 3, one thread). Here each block of NR weight rows is read from memory once and
// stays in L1 while every x row is multiplied with it, so the time is that of streaming W until the FMA units
// saturate (about 16 rows with AVX2).
//
// Arithmetic, identical on both paths and independent of M and of the tiling (so a row's result does not depend
// on what else is in the batch): 8 lane sums over k = 8i + lane with fused multiply-adds, reduced as
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then the K % 8 tail added in order with fused multiply-adds,
// then the bias. The AVX2 + FMA path is chosen at run time (__builtin_cpu_supports); the scalar path spells out
// the same operations with std::fma.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu_features.h"

namespace fastverify {
namespace linear {

// Scalar path: one output at a time, the same lane sums and reduction order as the AVX2 path.
inline float dot_scalar(const float* x, const float* w, int64_t K) {
  float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8)
    for (int j = 0; j < 8; ++j) l[j] = std::fma(x[k + j], w[k + j], l[j]);
  float s = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
  for (int64_t k = K8; k < K; ++k) s = std::fma(x[k], w[k], s);
  return s;
}

inline void rows_scalar(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K,
                        int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      const float s = dot_scalar(x + m * K, w + n * K, K);
      y[m * N + n] = bias ? s + bias[n] : s;
    }
}

#ifdef FASTVERIFY_X86
#define FASTVERIFY_AVX2 __attribute__((target("avx2,fma")))

FASTVERIFY_AVX2 inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l_i + l_{i+4}
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));                                   // (s0 + s2), (s1 + s3)
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// One tile: NR weight rows x MR x rows, all NR * MR dot products in registers (NR * MR + NR + MR <= 16 ymm).
// pf: if not null, the next block of NR weight rows (NR * K contiguous floats), prefetched into L1 while this tile
// computes, so that memory keeps streaming while the block in L1 is reused by the other x tiles.
template <int NR, int MR>
FASTVERIFY_AVX2 inline void tile_avx2(const float* x, const float* w, const float* bias, float* y, int64_t K,
                                      int64_t N, int64_t n, int64_t m, const float* pf) {
  __m256 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
  const float* wr[NR];
  const float* xr[MR];
  for (int i = 0; i < NR; ++i) wr[i] = w + (n + i) * K;
  for (int j = 0; j < MR; ++j) xr[j] = x + (m + j) * K;
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    if (pf)  // NR * 8 floats of the next block per step: all NR * K of it over the loop, one line per 16 floats
      for (int i = 0; i < NR * 8; i += 16) _mm_prefetch(reinterpret_cast<const char*>(pf + NR * k + i), _MM_HINT_T0);
    __m256 xv[MR];
    for (int j = 0; j < MR; ++j) xv[j] = _mm256_loadu_ps(xr[j] + k);
    for (int i = 0; i < NR; ++i) {
      const __m256 wv = _mm256_loadu_ps(wr[i] + k);
      for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_fmadd_ps(xv[j], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t k = K8; k < K; ++k) s = std::fma(xr[j][k], wr[i][k], s);
      y[(m + j) * N + n + i] = bias ? s + bias[n + i] : s;
    }
}

// Columns [n0, n1): for each block of 4 weight rows (read from memory once), every x row in tiles of 3.
template <int NR>
FASTVERIFY_AVX2 inline void block_avx2(const float* x, const float* w, const float* bias, float* y, int64_t M,
                                       int64_t K, int64_t N, int64_t n, const float* pf) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3, pf = nullptr) tile_avx2<NR, 3>(x, w, bias, y, K, N, n, m, pf);
  if (M - m == 2) tile_avx2<NR, 2>(x, w, bias, y, K, N, n, m, pf);
  if (M - m == 1) tile_avx2<NR, 1>(x, w, bias, y, K, N, n, m, pf);
}

FASTVERIFY_AVX2 inline void rows_avx2(const float* x, const float* w, const float* bias, float* y, int64_t M,
                                      int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) block_avx2<4>(x, w, bias, y, M, K, N, n, n + 8 <= n1 ? w + (n + 4) * K : nullptr);
  for (; n < n1; ++n) block_avx2<1>(x, w, bias, y, M, K, N, n, nullptr);
}
#endif

// y[m * N + n] for m < M and n in [n0, n1); x [M, K], w [N, K] row-major, bias [N] or nullptr.
inline void skinny_rows(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K,
                        int64_t N, int64_t n0, int64_t n1) {
#ifdef FASTVERIFY_X86
  if (cpu_has_avx2_fma()) return rows_avx2(x, w, bias, y, M, K, N, n0, n1);
#endif
  rows_scalar(x, w, bias, y, M, K, N, n0, n1);
}

}  // namespace linear
}  // namespace fastverify

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
// Arithmetic, identical on every path and independent of M and of the tiling (so a row's result does not depend
// on what else is in the batch): 16 lane sums l_j over k = 16i + j with fused multiply-adds, folded to s_j = l_j +
// l_{j+8} and reduced as ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)), then the K % 16 tail added in order with
// fused multiply-adds, then the bias. Three paths chosen at run time (cpu_features.h): AVX-512 (one zmm register
// per dot product; 32 registers hold a tile of 4 weight rows x 6 x rows), AVX2 + FMA (two ymm registers per dot
// product, lanes 0-7 and 8-15) and scalar (std::fma). Why 16 lanes: a CPU with 512-bit FMA units (AMD Zen 5, Intel
// server cores) does twice the work per instruction, and past a few rows the kernel is bound by FMA throughput.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include <c10/util/Half.h>

#include "cpu_features.h"

namespace fastverify {
namespace linear {

// The reduction of the 16 lane sums, spelled out (the SIMD paths do the same adds in vector registers).
inline float fold16(const float* l) {
  float s[8];
  for (int j = 0; j < 8; ++j) s[j] = l[j] + l[j + 8];
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

// Weights are float32 or float16 (W = c10::Half: converted exactly to float32 as they are read, so a float16
// weight gives the result of its float32 copy, bit for bit).
inline float wf(float w) { return w; }
inline float wf(c10::Half w) { return static_cast<float>(w); }

// Scalar path: one output at a time.
template <typename W>
inline float dot_scalar(const float* x, const W* w, int64_t K) {
  float l[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k = 0; k < K16; k += 16)
    for (int j = 0; j < 16; ++j) l[j] = std::fma(x[k + j], wf(w[k + j]), l[j]);
  float s = fold16(l);
  for (int64_t k = K16; k < K; ++k) s = std::fma(x[k], wf(w[k]), s);
  return s;
}

template <typename W>
inline void rows_scalar(const float* x, const W* w, const float* bias, float* y, int64_t M, int64_t K,
                        int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      const float s = dot_scalar(x + m * K, w + n * K, K);
      y[m * N + n] = bias ? s + bias[n] : s;
    }
}

#ifdef FASTVERIFY_X86
#define FASTVERIFY_AVX2 __attribute__((target("avx2,fma,f16c")))
#define FASTVERIFY_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

// 8 / 16 weights as float32 (float16: F16C's exact vcvtph2ps).
FASTVERIFY_AVX2 inline __m256 wload8(const float* p) { return _mm256_loadu_ps(p); }
FASTVERIFY_AVX2 inline __m256 wload8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
FASTVERIFY_AVX512 inline __m512 wload16(const float* p) { return _mm512_loadu_ps(p); }
FASTVERIFY_AVX512 inline __m512 wload16(const c10::Half* p) {  // zero-masked: GCC 12's unmasked one warns (hsum16)
  return _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)) of the 8 lanes of s.
FASTVERIFY_AVX2 inline float hsum8(__m256 s) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));  // s_i + s_{i+4}
  const __m128 t = _mm_add_ps(a, _mm_movehl_ps(a, a));                                   // (a0 + a2), (a1 + a3)
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// The tail k in [K16, K) in order, then the bias; stores y[m, n].
template <typename W>
inline void finish(float s, const float* x, const W* w, const float* bias, float* y, int64_t K16, int64_t K,
                   int64_t N, int64_t m, int64_t n) {
  for (int64_t k = K16; k < K; ++k) s = std::fma(x[k], wf(w[k]), s);
  y[m * N + n] = bias ? s + bias[n] : s;
}

// Streaming the next block of weight rows into L1 while the current block computes, so that memory keeps streaming
// while the block in L1 is reused by every x tile: the block's tiles prefetch the next block one after the other, PF
// cache lines per k step each (PF = NR / tiles, rounded to 1, 2 or 4, so that the whole block is spread over them).
// pf: the tile's first line to prefetch; end: the next block's end (pf == end: nothing to prefetch). Spelled out
// without a loop over the lines: GCC 12 deletes a loop whose only statements are prefetches. L2: prefetch into L2
// only, where the x rows and two blocks (the current one and the next) take more than 32 KB (far_prefetch): there
// the next block fetched into L1 evicts x rows that the current block's tiles still read. Measured through
// SmolLM2-135M's linear layers on an Intel Xeon with 48 KB of L1: the down projection (K = 1536) at 4-8 rows 10-17%
// faster than into L1; every layer at 9-17 rows 3-5% faster; at K = 576 and up to 6 rows, into L1 is faster.
template <bool L2>
inline void prefetch_line(const char* p) {
  if constexpr (L2) _mm_prefetch(p, _MM_HINT_T1);
  else _mm_prefetch(p, _MM_HINT_T0);
}

template <int PF, bool L2>
inline void prefetch_lines(const char*& pf, const char* end) {
  if (pf < end) {
    prefetch_line<L2>(pf);
    if constexpr (PF >= 2) prefetch_line<L2>(pf + 64);
    if constexpr (PF >= 4) {
      prefetch_line<L2>(pf + 128);
      prefetch_line<L2>(pf + 192);
    }
    pf += 64 * PF;
  }
}

// nr: the block's rows counted in float32 weights (a block of 4 float16 rows counts 2).
inline bool far_prefetch(int nr, int64_t M, int64_t K) { return (M + 2 * nr) * K * int64_t(sizeof(float)) > 32768; }

// Lines per k step for a block of NR rows computed in `tiles` tiles (1, 2 or 4): NR / tiles rounded up, so that the
// tiles together reach the next block's end (rounded down, 3 tiles of a 4-row block prefetched 3/4 of it: 13-18 rows
// ran 3-4% slower through SmolLM2's linear layers on an Intel Xeon).
inline int prefetch_rate(int nr, int64_t tiles) {
  const int64_t t = tiles > 0 ? tiles : 1, r = (nr + t - 1) / t;
  return r >= 4 ? 4 : r >= 2 ? 2 : 1;
}

// AVX2 tile: NR weight rows x MR x rows, each dot product in two ymm registers (lanes 0-7, 8-15):
// 2 * NR * MR accumulators + loads <= 16 ymm.
template <int NR, int MR, int PF, typename W>
FASTVERIFY_AVX2 inline void tile_avx2(const float* x, const W* w, const float* bias, float* y, int64_t K,
                                      int64_t N, int64_t n, int64_t m, const char*& pf, const char* end) {
  __m256 lo[NR][MR], hi[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) lo[i][j] = hi[i][j] = _mm256_setzero_ps();
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k = 0; k < K16; k += 16) {
    prefetch_lines<PF, false>(pf, end);
    for (int j = 0; j < MR; ++j) {
      const __m256 x0 = _mm256_loadu_ps(x + (m + j) * K + k), x1 = _mm256_loadu_ps(x + (m + j) * K + k + 8);
      for (int i = 0; i < NR; ++i) {
        lo[i][j] = _mm256_fmadd_ps(x0, wload8(w + (n + i) * K + k), lo[i][j]);
        hi[i][j] = _mm256_fmadd_ps(x1, wload8(w + (n + i) * K + k + 8), hi[i][j]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j)
      finish(hsum8(_mm256_add_ps(lo[i][j], hi[i][j])), x + (m + j) * K, w + (n + i) * K, bias, y, K16, K, N, m + j,
             n + i);
}

template <int PF, typename W>
FASTVERIFY_AVX2 inline void block_avx2(const float* x, const W* w, const float* bias, float* y, int64_t M,
                                       int64_t K, int64_t N, int64_t n, const char* pf, const char* end) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile_avx2<2, 3, PF>(x, w, bias, y, K, N, n, m, pf, end);
  if (M - m == 2) tile_avx2<2, 2, PF>(x, w, bias, y, K, N, n, m, pf, end);
  if (M - m == 1) tile_avx2<2, 1, PF>(x, w, bias, y, K, N, n, m, pf, end);
}

// Columns [n0, n1): for each block of 2 weight rows (read from memory once), every x row in tiles of 3.
template <typename W>
FASTVERIFY_AVX2 inline void rows_avx2(const float* x, const W* w, const float* bias, float* y, int64_t M,
                                      int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int rate = prefetch_rate(2 * int(sizeof(W)) / int(sizeof(float)), (M + 2) / 3);  // 2 rows, in float32 bytes
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    const char* pf = reinterpret_cast<const char*>(w + (n + 2) * K);
    const char* end = n + 4 <= n1 ? reinterpret_cast<const char*>(w + (n + 4) * K) : pf;
    if (rate == 2) block_avx2<2>(x, w, bias, y, M, K, N, n, pf, end);
    else block_avx2<1>(x, w, bias, y, M, K, N, n, pf, end);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      const char* none = nullptr;
      tile_avx2<1, 1, 1>(x, w, bias, y, K, N, n, m, none, nullptr);
    }
}

// ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)) of s_j = l_j + l_{j+8}, the 16 lanes of v.
FASTVERIFY_AVX512 inline float hsum16(__m512 v) {
  // the zero-masked extracts: GCC 12's unmasked ones (and the 512 -> 256 cast) trip -Wmaybe-uninitialized
  const __m512d d = _mm512_castps_pd(v);
  const __m256 lo = _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xF, d, 0));
  const __m256 hi = _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xF, d, 1));
  return hsum8(_mm256_add_ps(lo, hi));
}

// AVX-512 tile: NR weight rows x MR x rows, one zmm accumulator per dot product (NR * MR + MR + 1 <= 32 zmm).
template <int NR, int MR, int PF, bool L2, typename W>
FASTVERIFY_AVX512 inline void tile_avx512(const float* x, const W* w, const float* bias, float* y, int64_t K,
                                          int64_t N, int64_t n, int64_t m, const char*& pf, const char* end) {
  __m512 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k = 0; k < K16; k += 16) {
    prefetch_lines<PF, L2>(pf, end);
    __m512 xv[MR];
    for (int j = 0; j < MR; ++j) xv[j] = _mm512_loadu_ps(x + (m + j) * K + k);
    for (int i = 0; i < NR; ++i) {
      __m512 wv = wload16(w + (n + i) * K + k);
      asm("" : "+v"(wv));  // one load per weight vector: GCC would fold it into each of the MR FMAs
      for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_fmadd_ps(xv[j], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j)
      finish(hsum16(acc[i][j]), x + (m + j) * K, w + (n + i) * K, bias, y, K16, K, N, m + j, n + i);
}

template <int NR, int PF, bool L2, typename W>
FASTVERIFY_AVX512 inline void block_avx512(const float* x, const W* w, const float* bias, float* y, int64_t M,
                                           int64_t K, int64_t N, int64_t n, const char* pf, const char* end) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) tile_avx512<NR, 6, PF, L2>(x, w, bias, y, K, N, n, m, pf, end);
  switch (M - m) {
    case 5: tile_avx512<NR, 5, PF, L2>(x, w, bias, y, K, N, n, m, pf, end); break;
    case 4: tile_avx512<NR, 4, PF, L2>(x, w, bias, y, K, N, n, m, pf, end); break;
    case 3: tile_avx512<NR, 3, PF, L2>(x, w, bias, y, K, N, n, m, pf, end); break;
    case 2: tile_avx512<NR, 2, PF, L2>(x, w, bias, y, K, N, n, m, pf, end); break;
    case 1: tile_avx512<NR, 1, PF, L2>(x, w, bias, y, K, N, n, m, pf, end); break;
    default: break;
  }
}

// One block of 4 weight rows, its tiles prefetching the next block at `rate` lines per k step.
template <bool L2, typename W>
FASTVERIFY_AVX512 inline void block4_avx512(int rate, const float* x, const W* w, const float* bias, float* y,
                                            int64_t M, int64_t K, int64_t N, int64_t n, const char* pf,
                                            const char* end) {
  if (rate == 4) block_avx512<4, 4, L2>(x, w, bias, y, M, K, N, n, pf, end);
  else if (rate == 2) block_avx512<4, 2, L2>(x, w, bias, y, M, K, N, n, pf, end);
  else block_avx512<4, 1, L2>(x, w, bias, y, M, K, N, n, pf, end);
}

// Columns [n0, n1): for each block of 4 weight rows (read from memory once), every x row in tiles of 6.
template <typename W>
FASTVERIFY_AVX512 inline void rows_avx512(const float* x, const W* w, const float* bias, float* y, int64_t M,
                                          int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int nr = 4 * int(sizeof(W)) / int(sizeof(float));  // the block's 4 rows, counted in float32 bytes
  const int rate = prefetch_rate(nr, (M + 5) / 6);
  const bool far = far_prefetch(nr, M, K);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const char* pf = reinterpret_cast<const char*>(w + (n + 4) * K);
    const char* end = n + 8 <= n1 ? reinterpret_cast<const char*>(w + (n + 8) * K) : pf;
    if (far) block4_avx512<true>(rate, x, w, bias, y, M, K, N, n, pf, end);
    else block4_avx512<false>(rate, x, w, bias, y, M, K, N, n, pf, end);
  }
  for (; n < n1; ++n) block_avx512<1, 1, false>(x, w, bias, y, M, K, N, n, nullptr, nullptr);
}
#endif

// y[m * N + n] for m < M and n in [n0, n1); x [M, K], w [N, K] row-major (float or c10::Half), bias [N] or nullptr.
template <typename W>
inline void skinny_rows(const float* x, const W* w, const float* bias, float* y, int64_t M, int64_t K,
                        int64_t N, int64_t n0, int64_t n1) {
#ifdef FASTVERIFY_X86
  // M = 2, 3: the AVX2 tiles stream the weight faster (measured through SmolLM2-135M's verify forward: a 2- or
  // 3-row step 1-2 ms slower on the AVX-512 tiles, unexplained); the results are the same on both paths
  if (cpu_has_avx512() && (M == 1 || M >= 4)) return rows_avx512(x, w, bias, y, M, K, N, n0, n1);
  if (cpu_has_avx2_fma(/*f16c=*/!std::is_same_v<W, float>)) return rows_avx2(x, w, bias, y, M, K, N, n0, n1);
#endif
  rows_scalar(x, w, bias, y, M, K, N, n0, n1);
}

// ---------------------------------------------------------------------------------------------------------------
// Block-packed weights (skinny_linear_packed): w[n, k] = d[n, k / 32] * q[n, k] + m[n, k / 32] with q an unsigned
// integer of `bits` = 4 or 8 bits and d, m float32 per block of 32 weights along k, every product d * q exact in
// float32 (so a fused multiply-add, a multiply then an add, and the packer's check all give the same float32 w:
// fastverify.ops.linear.pack_blocks keeps only such weights). Weights dequantised from a GGUF file (Q4_0, Q4_1,
// Q8_0: a float16 scale times a 4- or 8-bit integer) have this form exactly, so the packed weight *is* the float32
// weight, in 5 (4 bits) or 9 (8 bits) bits per weight plus the two scales.
// Layout of a row: K / 32 blocks; a 4-bit block is 16 bytes, byte l holding q[l] in its low nibble and q[16 + l] in
// its high one; an 8-bit block is 32 bytes, q in order.
struct Packed {
  const uint8_t* q;
  const float* d;
  const float* m;
  int bits;
  int64_t K;
  int64_t row_bytes() const { return K * bits / 8; }
};

// q[k] of one row (k < K).
inline int packed_q(const uint8_t* row, int bits, int64_t k) {
  if (bits == 8) return row[k];
  const uint8_t byte = row[(k / 32) * 16 + (k % 16)];
  return (k % 32) < 16 ? (byte & 0xF) : (byte >> 4);
}

// Rows [n, n + rows) of the packed weight as float32, into out [rows, K].
inline void dequant_scalar(const Packed& p, int64_t n, int rows, float* out) {
  for (int i = 0; i < rows; ++i) {
    const uint8_t* q = p.q + (n + i) * p.row_bytes();
    const float* d = p.d + (n + i) * (p.K / 32);
    const float* m = p.m + (n + i) * (p.K / 32);
    for (int64_t k = 0; k < p.K; ++k)
      out[i * p.K + k] = std::fma(d[k / 32], static_cast<float>(packed_q(q, p.bits, k)), m[k / 32]);
  }
}

#ifdef FASTVERIFY_X86
// Software prefetch kPackedAhead bytes ahead in the packed bytes (and the matching distance in the scales), one
// line per block of 32 weights: as for the float32 weight (prefetch_lines), the hardware prefetchers alone stream
// well below the read bandwidth on the hosts measured. SmolLM2-135M's 211 linear layers (2 threads, Intel Xeon,
// one row): dequantisation alone 9.3 ms without, 7.9 ms at 1-4 KB ahead; a burst of a whole row's lines per row
// did not help.
constexpr int64_t kPackedAhead = 2048;

// AVX-512: the 32 weights of one block (bytes qb, scale d, minimum m) as w0 (k = 32b + l) and w1 (32b + 16 + l). A
// 4-bit block's 16 possible weights d * j + m (j < 16) are one zmm register, and vpermps looks each weight up by the
// low 4 bits of its lane: the 16 bytes widened to 16 lanes give q[l] (low nibble) directly and q[16 + l] after a
// shift by 4, five instructions per 32 weights. An 8-bit block widens and converts its bytes. (Zero-masked
// conversions: GCC 12's unmasked ones warn.)
template <int BITS>
FASTVERIFY_AVX512 inline void block_weights_avx512(const uint8_t* qb, float d, float m, __m512& w0, __m512& w1) {
  if (BITS == 4) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(m));
    const __m512i v = _mm512_maskz_cvtepu8_epi32(0xFFFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)));
    w0 = _mm512_maskz_permutexvar_ps(0xFFFF, v, table);
    w1 = _mm512_maskz_permutexvar_ps(0xFFFF, _mm512_maskz_srli_epi32(0xFFFF, v, 4), table);
  } else {
    const __m512 db = _mm512_set1_ps(d), mb = _mm512_set1_ps(m);
    for (int h = 0; h < 2; ++h) {
      const __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16 * h));
      (h ? w1 : w0) = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(0xFFFF, _mm512_maskz_cvtepu8_epi32(0xFFFF, q8)), db, mb);
    }
  }
}

// Rows [n, n + rows) of the packed weight as float32, into out [rows, K].
template <int BITS>
FASTVERIFY_AVX512 inline void dequant_avx512(const Packed& p, int64_t n, int rows, float* out) {
  const int64_t blocks = p.K / 32;
  for (int i = 0; i < rows; ++i) {
    const uint8_t* q = p.q + (n + i) * p.row_bytes();
    const float* d = p.d + (n + i) * blocks;
    const float* m = p.m + (n + i) * blocks;
    float* o = out + i * p.K;
    for (int64_t b = 0; b < blocks; ++b, o += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(q + BITS * 4 * b) + kPackedAhead, _MM_HINT_T0);
      if ((b & 3) == 0) {  // 16 bytes of scales per 4 blocks: a line per 16 blocks, asked for every 4
        _mm_prefetch(reinterpret_cast<const char*>(d + b) + kPackedAhead / 4, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(m + b) + kPackedAhead / 4, _MM_HINT_T0);
      }
      __m512 w0, w1;
      block_weights_avx512<BITS>(q + BITS * 4 * b, d[b], m[b], w0, w1);
      _mm512_storeu_ps(o, w0);
      _mm512_storeu_ps(o + 16, w1);
    }
  }
}

// 8 unsigned bytes (the low half of q8) -> 8 float32 lanes, then d * q + m.
FASTVERIFY_AVX2 inline void dequant8_avx2(__m128i q8, __m256 d, __m256 m, float* out) {
  _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8)), d, m));
}

FASTVERIFY_AVX2 inline void dequant_avx2(const Packed& p, int64_t n, int rows, float* out) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const int64_t blocks = p.K / 32;
  for (int i = 0; i < rows; ++i) {
    const uint8_t* q = p.q + (n + i) * p.row_bytes();
    const float* d = p.d + (n + i) * blocks;
    const float* m = p.m + (n + i) * blocks;
    float* o = out + i * p.K;
    for (int64_t b = 0; b < blocks; ++b, o += 32) {
      const __m256 db = _mm256_set1_ps(d[b]), mb = _mm256_set1_ps(m[b]);
      __m128i g[2];
      if (p.bits == 4) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b));
        g[0] = _mm_and_si128(v, low4);
        g[1] = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
      } else {
        g[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * b));
        g[1] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * b + 16));
      }
      for (int h = 0; h < 2; ++h) {
        dequant8_avx2(g[h], db, mb, o + 16 * h);
        dequant8_avx2(_mm_srli_si128(g[h], 8), db, mb, o + 16 * h + 8);
      }
    }
  }
}

// The fused AVX-512 path for a few x rows: NR packed weight rows x MR x rows, the weights dequantised in registers
// (block_weights_avx512) straight into the FMAs, whose order per lane (k = 32b + l, then 32b + 16 + l, block after
// block) is the float32 tile's; then the same reduction and bias. Per block of 32 weights the NR rows are dequantised
// first and each x row is then loaded once for all of them (2 MR loads a block instead of 2 NR MR): with the x rows
// reloaded per weight row, a tile of 6-8 rows ran 1.4-1.6x slower than in this order (measured alongside the
// kPackedTileRows figures below), which had kept the tiles to 5 rows. The tile prefetches the next block of weight
// rows [next, end) (bytes, scales and minima, one line per k step) as the float32 tiles do.
template <int NR, int MR, int BITS>
FASTVERIFY_AVX512 inline void tile_packed_avx512(const float* x, const Packed& p, const float* bias, float* y,
                                                 int64_t N, int64_t n, int64_t m, int64_t next, int64_t end) {
  const int64_t K = p.K, blocks = K / 32, rb = p.row_bytes();
  __m512 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint8_t* q = p.q + n * rb;
  const float* d = p.d + n * blocks;
  const float* mn = p.m + n * blocks;
  const bool ahead = next < end;
  const char* pq = reinterpret_cast<const char*>(p.q + next * rb);
  const char* pd = reinterpret_cast<const char*>(p.d + next * blocks);
  const char* pm = reinterpret_cast<const char*>(p.m + next * blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    if (ahead) {  // the next block: NR * rb bytes (one line per step at 4 bits) and NR * blocks scales
      _mm_prefetch(pq + 64 * b, _MM_HINT_T0);
      if (BITS == 8) _mm_prefetch(pq + 64 * (b + blocks), _MM_HINT_T0);
      if ((b & 3) == 0) {
        _mm_prefetch(pd + 16 * b, _MM_HINT_T0);
        _mm_prefetch(pm + 16 * b, _MM_HINT_T0);
      }
    }
    __m512 w[NR][2];
    for (int i = 0; i < NR; ++i)
      block_weights_avx512<BITS>(q + i * rb + BITS * 4 * b, d[i * blocks + b], mn[i * blocks + b], w[i][0], w[i][1]);
    for (int j = 0; j < MR; ++j) {
      const float* xr = x + (m + j) * K + 32 * b;
      const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
      for (int i = 0; i < NR; ++i) {
        acc[i][j] = _mm512_fmadd_ps(x0, w[i][0], acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(x1, w[i][1], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) {
      const float s = hsum16(acc[i][j]);
      y[(m + j) * N + n + i] = bias ? s + bias[n + i] : s;
    }
}

// The x rows in tiles of at most kPackedTileRows, as even as possible (17 rows: 6, 6, 5). Each tile dequantises the
// weights again, so fewer tiles save that work; with each x row loaded once per block, 4 weight rows x 8 x rows
// still beat two tiles although their 32 accumulators fill the registers. SmolLM2-135M's 120 Q4_1 decoder
// projections streamed from memory, one thread, Intel Xeon (2026-11-27; tiles of at most 5 with the x rows reloaded
// per weight row before): 6 / 7 / 8 rows 13.4 / 15.1 / 16.8 ms against 17.0 / 18.3 / 19.5, 1-5 rows and 9-10 the
// same, 11-16 rows 1.06-1.19x faster; its Q8_0 head alike (benchmarks/RESULTS.md, "Block-packed weights").
constexpr int64_t kPackedTileRows = 8;

template <int NR, int BITS>
FASTVERIFY_AVX512 inline void block_packed_avx512(const float* x, const Packed& p, const float* bias, float* y,
                                                  int64_t M, int64_t N, int64_t n, int64_t next, int64_t end) {
  const int64_t tiles = (M + kPackedTileRows - 1) / kPackedTileRows;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t rows = (M - m + tiles - t - 1) / (tiles - t);  // the rows left over the tiles left, rounded up
    switch (rows) {
      case 8: tile_packed_avx512<NR, 8, BITS>(x, p, bias, y, N, n, m, next, end); break;
      case 7: tile_packed_avx512<NR, 7, BITS>(x, p, bias, y, N, n, m, next, end); break;
      case 6: tile_packed_avx512<NR, 6, BITS>(x, p, bias, y, N, n, m, next, end); break;
      case 5: tile_packed_avx512<NR, 5, BITS>(x, p, bias, y, N, n, m, next, end); break;
      case 4: tile_packed_avx512<NR, 4, BITS>(x, p, bias, y, N, n, m, next, end); break;
      case 3: tile_packed_avx512<NR, 3, BITS>(x, p, bias, y, N, n, m, next, end); break;
      case 2: tile_packed_avx512<NR, 2, BITS>(x, p, bias, y, N, n, m, next, end); break;
      case 1: tile_packed_avx512<NR, 1, BITS>(x, p, bias, y, N, n, m, next, end); break;
      default: break;
    }
    m += rows;
  }
}

template <int BITS>
FASTVERIFY_AVX512 inline void rows_packed_avx512(const float* x, const Packed& p, const float* bias, float* y,
                                                 int64_t M, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) block_packed_avx512<4, BITS>(x, p, bias, y, M, N, n, n + 4, std::min(n + 8, n1));
  for (; n < n1; ++n) block_packed_avx512<1, BITS>(x, p, bias, y, M, N, n, n1, n1);
}
#endif

// x rows up to which the AVX-512 path dequantises in registers, once per tile of x rows; beyond, a block of weight
// rows is dequantised once into the thread's buffer and every x row multiplied with it (below). With the tiles of
// up to 8 rows the fused path is the faster one up to the loop's 128 rows (fastverify.hf.linear.MAX_ROWS):
// SmolLM2-135M's 120 Q4_1 decoder projections streamed from memory, 2 threads splitting the columns, the two paths
// alternating in one process (Intel Xeon, 2026-11-27), fused / buffered 19.3 / 24.5 ms at 17 rows, 28.2 / 37.0 at
// 24, 40.9 / 46.8 at 32, 75.5 / 89.2 at 64, 160.8 / 177.0 at 128; its Q8_0 head 1.1-1.2x at 17-32 rows, even at
// 96-128. (With tiles of at most 5 the buffer won from 24 rows.)
constexpr int64_t kPackedFusedRows = 128;

// y[m * N + n] for m < M and n in [n0, n1) from a packed weight, each block of 4 weight rows dequantised into a buffer
// (4 * K floats, the calling thread's own) and multiplied by every x row with skinny_rows: the path for many x rows,
// and for CPUs without AVX-512.
inline void rows_packed_buffered(const float* x, const Packed& p, const float* bias, float* y, int64_t M, int64_t N,
                                 int64_t n0, int64_t n1) {
  std::vector<float> block(4 * p.K);
  float* buf = block.data();
  for (int64_t n = n0; n < n1; n += 4) {
    const int rows = static_cast<int>(std::min<int64_t>(4, n1 - n));
#ifdef FASTVERIFY_X86
    if (cpu_has_avx512()) p.bits == 4 ? dequant_avx512<4>(p, n, rows, buf) : dequant_avx512<8>(p, n, rows, buf);
    else if (cpu_has_avx2_fma()) dequant_avx2(p, n, rows, buf);
    else dequant_scalar(p, n, rows, buf);
#else
    dequant_scalar(p, n, rows, buf);
#endif
    skinny_rows(x, buf, bias ? bias + n : nullptr, y + n, M, p.K, N, 0, rows);
  }
}

// y[m * N + n] for m < M and n in [n0, n1) from a packed weight: the fused tiles above up to kPackedFusedRows x rows
// on AVX-512, else rows_packed_buffered. Either way the result is the one of the float32 weight, bit for bit, and the
// memory traffic that of the packed bytes.
inline void skinny_rows_packed(const float* x, const Packed& p, const float* bias, float* y, int64_t M, int64_t N,
                               int64_t n0, int64_t n1) {
#ifdef FASTVERIFY_X86
  if (cpu_has_avx512() && M <= kPackedFusedRows)
    return p.bits == 4 ? rows_packed_avx512<4>(x, p, bias, y, M, N, n0, n1)
                       : rows_packed_avx512<8>(x, p, bias, y, M, N, n0, n1);
#endif
  rows_packed_buffered(x, p, bias, y, M, N, n0, n1);
}

// ---------------------------------------------------------------------------------------------------------------
// Weights stored [K, N] (skinny_linear_t: y = x @ w + bias, the layout of transformers' Conv1D, GPT-2's layers).
// Arithmetic, identical on every path and independent of M, the tiling and the threads: each output is one chain
// of fused multiply-adds over k = 0 .. K - 1 in order, from 0, then the bias added. The SIMD paths hold 16 (AVX-512)
// or 8 (AVX2) neighbouring columns of one x row in a register and broadcast x[m, k]: row k of w is read as it lies.
// A tile is up to 6 x rows x 4 column registers, each weight register loaded once per k for every x row of the tile.

// Scalar path: x row by x row, the output row itself the accumulator.
inline void rows_t_scalar(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K,
                          int64_t N, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; ++m) {
    float* out = y + m * N;
    std::fill(out + n0, out + n1, 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const float a = x[m * K + k];
      const float* row = w + k * N;
      for (int64_t n = n0; n < n1; ++n) out[n] = std::fma(a, row[n], out[n]);
    }
    if (bias)
      for (int64_t n = n0; n < n1; ++n) out[n] += bias[n];
  }
}

#ifdef FASTVERIFY_X86
// Rows of w per panel for up to kTPanelMaxM x rows (more rows: one panel). GPT-2 small's 48 Conv1D layers in turn
// (340 MB, 2 threads, AMD EPYC VM): at 1-2 x rows 14-15 ms in panels of 8 against 21-23 ms in one pass (the rows'
// stride defeats the hardware prefetchers: one panel is one stretch of memory), at 3-4 rows the same, at 6-9 rows
// 17-24 ms in one pass against 23-33 ms (each panel reloads and stores the tile's sums).
constexpr int64_t kTPanelRows = 8, kTPanelMaxM = 4;

// AVX-512 tile: MR x rows x NV registers of 16 columns from column n, rows [k0, k1) of w (MR * NV + NV + 1 <= 32
// zmm); the sums so far are y's (k0 > 0), the bias added after the last row. Unmasked loads only: with a masked
// one in the loop, GCC 12 stores every accumulator to the stack at every k.
template <int MR, int NV>
FASTVERIFY_AVX512 inline void tile_t_avx512(const float* x, const float* w, const float* bias, float* y, int64_t K,
                                            int64_t N, int64_t m, int64_t n, int64_t k0, int64_t k1) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      acc[r][v] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(y + (m + r) * N + n + 16 * v);
  const float* row = w + k0 * N + n;
  for (int64_t k = k0; k < k1; ++k, row += N) {
    __m512 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_ps(row + 16 * v);
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(x[(m + r) * K + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(a, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      _mm512_storeu_ps(y + (m + r) * N + n + 16 * v, bias && k1 == K
                       ? _mm512_add_ps(acc[r][v], _mm512_loadu_ps(bias + n + 16 * v)) : acc[r][v]);
}

// Every x row in tiles of 6 (the last one shorter) over NV column registers from column n, rows [k0, k1) of w.
template <int NV>
FASTVERIFY_AVX512 inline void band_t_avx512(const float* x, const float* w, const float* bias, float* y, int64_t M,
                                            int64_t K, int64_t N, int64_t n, int64_t k0, int64_t k1) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) tile_t_avx512<6, NV>(x, w, bias, y, K, N, m, n, k0, k1);
  switch (M - m) {
    case 5: tile_t_avx512<5, NV>(x, w, bias, y, K, N, m, n, k0, k1); break;
    case 4: tile_t_avx512<4, NV>(x, w, bias, y, K, N, m, n, k0, k1); break;
    case 3: tile_t_avx512<3, NV>(x, w, bias, y, K, N, m, n, k0, k1); break;
    case 2: tile_t_avx512<2, NV>(x, w, bias, y, K, N, m, n, k0, k1); break;
    case 1: tile_t_avx512<1, NV>(x, w, bias, y, K, N, m, n, k0, k1); break;
    default: break;
  }
}

// Rows of w in panels (consecutive rows: one stretch of memory; kTPanelRows), each panel swept across columns
// [n0, n1) in bands of 64 (4 registers), then one band of the 1-3 whole registers left, the outputs holding the sums
// between panels (a float32 stored and loaded back: the same chain); the last (n1 - n0) mod 16 columns on the scalar
// path (the same arithmetic).
FASTVERIFY_AVX512 inline void rows_t_avx512(const float* x, const float* w, const float* bias, float* y, int64_t M,
                                            int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t kb = M <= kTPanelMaxM ? kTPanelRows : K;
  const int64_t vec_end = n0 + 16 * ((n1 - n0) / 16);
  for (int64_t k0 = 0; k0 < K; k0 += kb) {
    const int64_t k1 = std::min(K, k0 + kb);
    int64_t n = n0;
    for (; n + 64 <= vec_end; n += 64) band_t_avx512<4>(x, w, bias, y, M, K, N, n, k0, k1);
    switch ((vec_end - n) / 16) {
      case 3: band_t_avx512<3>(x, w, bias, y, M, K, N, n, k0, k1); break;
      case 2: band_t_avx512<2>(x, w, bias, y, M, K, N, n, k0, k1); break;
      case 1: band_t_avx512<1>(x, w, bias, y, M, K, N, n, k0, k1); break;
      default: break;
    }
  }
  if (vec_end < n1) rows_t_scalar(x, w, bias, y, M, K, N, vec_end, n1);
}

// AVX2 tile: MR x rows x 2 registers of 8 columns from column n (2 * MR + 3 <= 16 ymm); full registers only.
template <int MR>
FASTVERIFY_AVX2 inline void tile_t_avx2(const float* x, const float* w, const float* bias, float* y, int64_t K,
                                        int64_t N, int64_t m, int64_t n) {
  __m256 lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * N + n), w1 = _mm256_loadu_ps(w + k * N + n + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_set1_ps(x[(m + r) * K + k]);
      lo[r] = _mm256_fmadd_ps(a, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, w1, hi[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    if (bias) {
      lo[r] = _mm256_add_ps(lo[r], _mm256_loadu_ps(bias + n));
      hi[r] = _mm256_add_ps(hi[r], _mm256_loadu_ps(bias + n + 8));
    }
    _mm256_storeu_ps(y + (m + r) * N + n, lo[r]);
    _mm256_storeu_ps(y + (m + r) * N + n + 8, hi[r]);
  }
}

// Columns [n0, n1) in bands of 16, every x row in tiles of 6; the last n1 - n0 mod 16 columns on the scalar path
// (the same arithmetic).
FASTVERIFY_AVX2 inline void rows_t_avx2(const float* x, const float* w, const float* bias, float* y, int64_t M,
                                        int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 16 <= n1; n += 16) {
    int64_t m = 0;
    for (; m + 6 <= M; m += 6) tile_t_avx2<6>(x, w, bias, y, K, N, m, n);
    switch (M - m) {
      case 5: tile_t_avx2<5>(x, w, bias, y, K, N, m, n); break;
      case 4: tile_t_avx2<4>(x, w, bias, y, K, N, m, n); break;
      case 3: tile_t_avx2<3>(x, w, bias, y, K, N, m, n); break;
      case 2: tile_t_avx2<2>(x, w, bias, y, K, N, m, n); break;
      case 1: tile_t_avx2<1>(x, w, bias, y, K, N, m, n); break;
      default: break;
    }
  }
  if (n < n1) rows_t_scalar(x, w, bias, y, M, K, N, n, n1);
}
#endif

// y[m * N + n] for m < M and n in [n0, n1); x [M, K], w [K, N] row-major float32, bias [N] or nullptr.
inline void skinny_rows_t(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K,
                          int64_t N, int64_t n0, int64_t n1) {
#ifdef FASTVERIFY_X86
  if (cpu_has_avx512()) return rows_t_avx512(x, w, bias, y, M, K, N, n0, n1);
  if (cpu_has_avx2_fma()) return rows_t_avx2(x, w, bias, y, M, K, N, n0, n1);
#endif
  rows_t_scalar(x, w, bias, y, M, K, N, n0, n1);
}

}  // namespace linear
}  // namespace fastverify

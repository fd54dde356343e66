// Warping and inverse-CDF sampling of one logits row: framework-free arithmetic on raw pointers, shared by the
// CPU kernels of cdf_sample / cdf_invert (csrc/cpu/sampling.cpp) and of verify's sampling rules
// (csrc/cpu/verify.cpp). The warping is specified in fastverify/reference/sampling.py (temperature, top-k,
// top-p, min-p, weights w = exp(l / T - m) on the kept tokens); this header computes the same thing without
// sorting the vocabulary:
//
//   * top-k: the k-th largest l / T by a threshold filter (one pass keeping a small candidate buffer that is
//     compacted with nth_element whenever it fills: selection instead of a sort), or nth_element on a copy
//     when k is a large fraction of V;
//   * top-p: the smallest kept weight by a radix select over the float bits of w with per-bucket float64 mass
//     (exponent, then 11 and 12 mantissa bits; the last level isolates one value, so ties are kept or dropped
//     together), run over a candidate list that shrinks at every level (it starts as the weights >= 2^-12 when
//     their mass reaches the target), the CPU analogue of FlashInfer's sorting-free pivot search; on the small
//     top-k set, a sort of those few;
//   * min-p: a threshold on w (w of the top token is 1).
// All three reduce to: keep token i iff l'_i >= l_min and w_i >= w_min (RowDist).
//
// Sums. C(t) is a float64 prefix sum of w in token-id order. When top-k is small the kept tokens are few and
// C is the plain sequential sum over them (equal to the reference's cumsum: the zeros in between change
// nothing). Otherwise C is blocked: P[b] = sequential sum of the float64 sums of blocks 0..b-1 (kBlock tokens
// each, a block's sum accumulated in 16 float64 lanes in a fixed order), and inside a block the sum runs
// sequentially from P[b]. Sampling picks the block (smallest b with P[b + 1] > u * Z), then the first token of
// the block whose running sum exceeds u * Z (the block's last positive token if rounding leaves none). These
// additions are associated differently from a sequential cumsum, so this backend may pick a neighbouring token
// of the reference's only when u * Z lies within a few float64 ulps (relative to Z) of a bin edge. (Float32
// partial sums inside a block would save ~10% of the weight pass but move P by up to 2^-24 Z, enough to make
// the last tokens of a block with p ~ 1e-9 unreachable: not done.) Within this backend sample and invert share
// every sum, and invert checks its answer with sample itself, so sample(invert(t)) == t exactly whenever invert
// returns a number.
//
// Speed (AVX2, chosen at run time; setup.py compiles without -mavx2, so the SIMD functions carry a target
// attribute). A plain dense row costs two passes: the max / NaN scan, and one fused pass computing every weight
// (an inline copy of SLEEF's expf, bit-identical to torch.exp) and the float64 block sums in registers, the row
// coming from L2; sampling then recomputes only the selected block. The row kernels pass the next row as a hint
// (RowWorkspace::prefetch): the fused pass, bound by FMA throughput, loads the next row meanwhile and takes its
// max scan, so consecutive rows do not wait on DRAM. Top-p stores the weights on the fused pass and adds the
// threshold search (a vector compaction plus scalar histograms over a few percent of the row) and a masked
// re-summation.
//
// Validity. A row holding NaN or +inf, a row that is all -inf, or a row whose largest l / T overflows to +inf
// has no distribution: RowDist::valid is false; sample returns -1 and invert NaN.
//
// Host functions below use std::vector workspaces (CPU). FV_HD functions (token weights, Philox, sampling from
// a weights array) also compile for CUDA devices.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_features.h"

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FV_HD __host__ __device__ __forceinline__
#else
#define FV_HD inline
#endif

#if __has_include(<c10/util/BFloat16.h>) && __has_include(<c10/util/Half.h>)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#define FV_SAMPLING_HAVE_C10 1
#endif

#if defined(__x86_64__) && !defined(__CUDACC__) && !defined(__HIPCC__) && !defined(FASTVERIFY_NO_SIMD)
#define FV_SAMPLING_AVX2 1
#include <immintrin.h>
#define FV_AVX2_FN __attribute__((target("avx2,fma,f16c")))
#endif

namespace fastverify {
namespace sampling {

// Tokens per block of the blocked float64 prefix sums (a multiple of the SIMD width).
constexpr int64_t kBlock = 512;
// top-k of at most this many (and at most V / 8) tokens takes the sparse path (threshold filter).
constexpr int64_t kSparseTopK = 2048;

// One row of the normalised warp tensor (float32 [R, 4]).
struct Warp {
  float temperature;  // 0 = greedy (argmax)
  float top_k;        // 0 or >= V = off
  float top_p;        // 1 = off, in (0, 1]
  float min_p;        // 0 = off, in [0, 1]
};

FV_HD Warp load_warp(const float* row) { return Warp{row[0], row[1], row[2], row[3]}; }

// The warped distribution of one row, as sampling needs it.
struct RowDist {
  bool valid = false;   // false: no distribution (NaN / +inf, all -inf, overflow of l / T)
  bool greedy = false;  // temperature 0: one-hot at argmax
  bool sparse = false;  // kept tokens listed in RowWorkspace::kept_idx (small top-k)
  int64_t argmax = -1;  // greedy rows: the top token (lowest id among ties)
  int64_t vocab = 0;
  float temperature = 1.f;
  float m = 0.f;                                          // max_i l_i / T
  float l_min = -std::numeric_limits<float>::infinity();  // keep iff l / T >= l_min (top-k)
  float w_min = 0.f;                                      // keep iff w >= w_min (top-p, min-p)
  double z = 0.0;                                         // Z = C(V - 1)
};

// Max of a row and whether it holds NaN or +inf.
struct RowScan {
  float max = -std::numeric_limits<float>::infinity();
  bool bad = false;  // NaN or +inf seen
};

// Scratch space of one row; keep one per thread and reuse it across rows. After warp_row it holds the row's
// prefix sums, which sample_row / invert_row read.
struct RowWorkspace {
  std::vector<double> prefix;     // dense: P[0..nblocks]; sparse: C over the kept list
  std::vector<int64_t> kept_idx;  // sparse: kept token ids, increasing
  std::vector<float> kept_w;      // sparse: their weights
  std::vector<float> w;           // dense weights before top-p / min-p (top-p only)
  std::vector<float> cand_val;    // top-k filter candidates (l / T) and their ids
  std::vector<int64_t> cand_idx;
  std::vector<float> scratch;
  std::vector<double> hist;
  // Optional: the next row this thread will warp (same dtype and V as the current one; prefetch_bytes = its
  // size). The dense path's last pass over the current row is compute-bound and works from L2; it pulls the next
  // row in meanwhile (and, without top-p, takes its max / NaN scan on the way: `scanned`), so that the next
  // row's own first pass does not wait on DRAM. warp_row clears the hint; nullptr = none.
  const void* prefetch = nullptr;
  int64_t prefetch_bytes = 0;
  const void* scanned = nullptr;  // the row whose scan is in next_scan (set by warp_row, used by the next call)
  int64_t scanned_v = 0;
  RowScan next_scan;
};

// ---------------------------------------------------------------------------------------------------------------
// Elements and exp.

// 0: float or anything convertible to float, 1: bfloat16, 2: float16.
template <typename T>
struct ElemKind {
  static constexpr int value = 0;
};
#if defined(FV_SAMPLING_HAVE_C10)
template <>
struct ElemKind<c10::BFloat16> {
  static constexpr int value = 1;
};
template <>
struct ElemKind<c10::Half> {
  static constexpr int value = 2;
};
#endif

template <typename T>
FV_HD float to_float(T x) {
  return static_cast<float>(x);
}

#if defined(FV_SAMPLING_AVX2)
inline bool cpu_has_avx2() { return cpu_has_avx2_fma(/*f16c=*/true); }

// 8 consecutive elements as float32 (bf16 -> f32 is a 16-bit shift, fp16 -> f32 is F16C's exact vcvtph2ps).
template <typename T>
FV_AVX2_FN inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (ElemKind<T>::value == 1) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  } else if constexpr (ElemKind<T>::value == 2) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    alignas(32) float tmp[8];
    for (int j = 0; j < 8; ++j) tmp[j] = static_cast<float>(p[j]);
    return _mm256_load_ps(tmp);
  }
}

// The last n < 8 elements, padded with `pad`.
template <typename T>
FV_AVX2_FN inline __m256 load_tail(const T* p, int64_t n, float pad) {
  alignas(32) float tmp[8];
  for (int j = 0; j < 8; ++j) tmp[j] = j < n ? static_cast<float>(p[j]) : pad;
  return _mm256_load_ps(tmp);
}

FV_AVX2_FN inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// 8-lane expf for d <= 88 (weights only ever need d = l / T - m <= 0): SLEEF's xexpf (1.0 ulp) written out
// operation for operation as libtorch_cpu's Sleef_expf8_u10avx2 (the function ATen's AVX2 Vectorized<float>::exp,
// hence torch.exp on CPU, calls) computes it: the same constants and FMA chain. Inline, because a call into
// libtorch per 8 elements (through SLEEF's dispatch pointer, constants reloaded per call) cost as much as the
// rest of the weight pass. The final u * 2^q: when every lane has d >= -86.5, q >= -125 and the result is a normal
// float, so adding q to the exponent field is exact, like SLEEF's two multiplies by 2^(q >> 1) and 2^(q - (q >> 1))
// (and its d < -104 -> 0 cut-off cannot apply); otherwise SLEEF's own steps. Checked bit for bit against
// Sleef_expf8_u10 on every float32 d in [-inf, 88] (SLEEF's d > 104 -> inf branch is left out: d <= 88 here).
FV_AVX2_FN inline __m256 exp8(__m256 d) {
  const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407359924681001892137f)));
  const __m256 qf = _mm256_cvtepi32_ps(q);
  const bool normal = _mm256_movemask_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-86.5f), _CMP_LT_OQ)) == 0;
  __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);  // -L2U
  s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);  // -L2L
  __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
  u = _mm256_add_ps(_mm256_set1_ps(1.f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
  if (__builtin_expect(normal, 1))
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(u), _mm256_slli_epi32(q, 23)));
  const __m256i h = _mm256_srai_epi32(q, 1), bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_add_epi32(q, bias), h), 23));
  u = _mm256_mul_ps(_mm256_mul_ps(u, p1), p2);
  return _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.f), _CMP_LT_OQ), u);
}

FV_AVX2_FN inline float exp_avx2_scalar(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }
#endif

// The exp of the weights: one function for every element on every path of this backend, so that a weight
// computed alone (token_weight) equals the same weight computed in a SIMD pass.
inline float weight_exp(float x) {
#if defined(FV_SAMPLING_AVX2)
  if (cpu_has_avx2()) return exp_avx2_scalar(x);
#endif
  return std::exp(x);
}

// Weight of one scaled logit lp = l / T under a row's thresholds (0 when not kept).
inline float weight_of(float lp, const RowDist& d) {
  if (!(lp >= d.l_min)) return 0.f;
  const float w = weight_exp(lp - d.m);
  return w >= d.w_min ? w : 0.f;
}

// w(t) of token t of a valid row (greedy rows: 1 at the argmax, 0 elsewhere).
template <typename T>
inline float token_weight(const T* logits, const RowDist& d, int64_t t) {
  if (!d.valid) return 0.f;
  if (d.greedy) return t == d.argmax ? 1.f : 0.f;
  return weight_of(to_float(logits[t]) / d.temperature, d);
}

// Weights of tokens [begin, end) into out[0 .. end - begin).
template <typename T>
inline void block_weights(const T* logits, int64_t begin, int64_t end, const RowDist& d, float* out);

// Calls fn.template operator()<kDiv, kLMin, kWMin>() with the row's warping as compile-time flags: kDiv when
// T != 1 (l / 1 == l exactly, so skipping the division changes no weight), kLMin when a top-k threshold is set
// (lp >= -inf holds for every non-NaN lp), kWMin when w_min > 0 (w >= 0 always holds). Every combination
// therefore computes the same weights as the full formula; the flags only drop work that cannot change them.
template <typename Fn>
inline decltype(auto) dispatch_flags(const RowDist& d, Fn&& fn) {
  const int f = (d.temperature != 1.f ? 4 : 0) | (d.l_min > -std::numeric_limits<float>::infinity() ? 2 : 0) |
                (d.w_min > 0.f ? 1 : 0);
  switch (f) {
    case 0: return fn.template operator()<false, false, false>();
    case 1: return fn.template operator()<false, false, true>();
    case 2: return fn.template operator()<false, true, false>();
    case 3: return fn.template operator()<false, true, true>();
    case 4: return fn.template operator()<true, false, false>();
    case 5: return fn.template operator()<true, false, true>();
    case 6: return fn.template operator()<true, true, false>();
    default: return fn.template operator()<true, true, true>();
  }
}

#if defined(FV_SAMPLING_AVX2)
// The row's constants, broadcast once per pass.
struct Weights8 {
  __m256 t, l_min, m, w_min;
};

FV_AVX2_FN inline Weights8 weights8_consts(const RowDist& d) {
  return Weights8{_mm256_set1_ps(d.temperature), _mm256_set1_ps(d.l_min), _mm256_set1_ps(d.m),
                  _mm256_set1_ps(d.w_min)};
}

// weight_of on 8 lanes.
template <bool kDiv, bool kLMin, bool kWMin>
FV_AVX2_FN inline __m256 weights8(__m256 x, const Weights8& c) {
  const __m256 lp = kDiv ? _mm256_div_ps(x, c.t) : x;
  __m256 e = exp8(_mm256_sub_ps(lp, c.m));
  if constexpr (kWMin) e = _mm256_and_ps(e, _mm256_cmp_ps(e, c.w_min, _CMP_GE_OQ));
  if constexpr (kLMin) e = _mm256_and_ps(e, _mm256_cmp_ps(lp, c.l_min, _CMP_GE_OQ));
  return e;
}

template <typename T, bool kDiv, bool kLMin, bool kWMin>
FV_AVX2_FN void block_weights_avx2(const T* logits, int64_t begin, int64_t end, const RowDist& d, float* out) {
  const Weights8 c = weights8_consts(d);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8)
    _mm256_storeu_ps(out + (i - begin), weights8<kDiv, kLMin, kWMin>(load8(logits + i), c));
  if (i < end) {  // padding with -inf gives weight 0 under every flag combination
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, weights8<kDiv, kLMin, kWMin>(load_tail(logits + i, end - i, -INFINITY), c));
    for (int64_t j = 0; j < end - i; ++j) out[i - begin + j] = tmp[j];
  }
}

// Sum of 4 doubles in a fixed order.
FV_AVX2_FN inline double hsum4(__m256d v) {
  alignas(32) double a[4];
  _mm256_store_pd(a, v);
  return (a[0] + a[2]) + (a[1] + a[3]);
}

FV_AVX2_FN inline __m256d lo_pd(__m256 v) { return _mm256_cvtps_pd(_mm256_castps256_ps128(v)); }
FV_AVX2_FN inline __m256d hi_pd(__m256 v) { return _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)); }

// A block's last 8-wide steps: the 8 weights at offset j go to lanes j % 16 .. j % 16 + 7 of the 16 float64 lanes
// (a0 a1 | a2 a3), where the 16-wide loop puts them: element i always goes to lane i % 16.
FV_AVX2_FN inline void add8_at(__m256 w, int64_t j, __m256d& a0, __m256d& a1, __m256d& a2, __m256d& a3) {
  if (j % 16 == 0) {
    a0 = _mm256_add_pd(a0, lo_pd(w));
    a1 = _mm256_add_pd(a1, hi_pd(w));
  } else {
    a2 = _mm256_add_pd(a2, lo_pd(w));
    a3 = _mm256_add_pd(a3, hi_pd(w));
  }
}

// The fused weight pass: P[b] = float64 sum of the weights of blocks 0..b-1 (P[nblocks] = Z), each block summed
// in 16 float64 lanes (4 vectors, so the adds do not wait on each other) reduced in a fixed order; the weights
// themselves are stored to w_out when it is not null (top-p needs them). One read of the row (from L2: the max
// pass just brought it there), exp and float64 adds in registers, no other memory traffic.
//
// With nx (the next row, same T and V), the pass also takes nx's max / NaN scan 16 elements at a time (a load and
// a max where the exp leaves the load and FP-add ports idle), so nx arrives in cache through this pass and its
// first pass is saved altogether: *nx_scan.
template <typename T, bool kDiv, bool kLMin, bool kWMin>
FV_AVX2_FN void dense_sums_avx2(const T* logits, int64_t V, const RowDist& d, double* P, float* w_out,
                                const T* nx, RowScan* nx_scan) {
  const Weights8 c = weights8_consts(d);
  const int64_t nblocks = (V + kBlock - 1) / kBlock;
  __m256 nm0 = _mm256_set1_ps(-INFINITY), nm1 = nm0, nnan = _mm256_setzero_ps();
  int64_t nx_done = 0;  // nx is scanned over [0, nx_done)
  double run = 0.0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * kBlock, len = std::min(kBlock, V - lo);
    const T* x = logits + lo;
    float* wo = w_out ? w_out + lo : nullptr;
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) {
      if (nx) {
        _mm_prefetch(reinterpret_cast<const char*>(nx + lo + j) + 2048, _MM_HINT_T0);
        const __m256 a = load8(nx + lo + j), b = load8(nx + lo + j + 8);
        nm0 = _mm256_max_ps(nm0, a);
        nm1 = _mm256_max_ps(nm1, b);
        nnan = _mm256_or_ps(nnan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
        nx_done = lo + j + 16;
      }
      const __m256 w0 = weights8<kDiv, kLMin, kWMin>(load8(x + j), c);
      const __m256 w1 = weights8<kDiv, kLMin, kWMin>(load8(x + j + 8), c);
      if (wo) {
        _mm256_storeu_ps(wo + j, w0);
        _mm256_storeu_ps(wo + j + 8, w1);
      }
      a0 = _mm256_add_pd(a0, lo_pd(w0));
      a1 = _mm256_add_pd(a1, hi_pd(w0));
      a2 = _mm256_add_pd(a2, lo_pd(w1));
      a3 = _mm256_add_pd(a3, hi_pd(w1));
    }
    for (; j < len; j += 8) {  // the last 8 of 16, and the padded tail of the row
      const int64_t n = std::min<int64_t>(8, len - j);
      const __m256 xv = n == 8 ? load8(x + j) : load_tail(x + j, n, -INFINITY);
      const __m256 w0 = weights8<kDiv, kLMin, kWMin>(xv, c);
      if (wo) {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, w0);
        for (int64_t k = 0; k < n; ++k) wo[j + k] = tmp[k];
      }
      add8_at(w0, j, a0, a1, a2, a3);
    }
    P[b] = run;
    run += hsum4(_mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
  }
  P[nblocks] = run;
  if (nx) {
    RowScan s;
    s.max = hmax8(_mm256_max_ps(nm0, nm1));
    s.bad = _mm256_movemask_ps(nnan) != 0;
    for (int64_t i = nx_done; i < V; ++i) {  // the last V % 16
      const float v = to_float(nx[i]);
      if (std::isnan(v)) s.bad = true;
      s.max = std::max(s.max, v);
    }
    s.bad = s.bad || s.max == std::numeric_limits<float>::infinity();
    *nx_scan = s;
  }
}

// P of the weights w[0..V) with those below w_min set to 0 (top-p's second pass, over the stored weights):
// the same blocks and lane order as dense_sums_avx2.
FV_AVX2_FN inline void masked_sums_avx2(const float* w, int64_t V, float w_min, double* P, const char* pf,
                                        int64_t pf_bytes) {
  const __m256 wm = _mm256_set1_ps(w_min);
  const int64_t nblocks = (V + kBlock - 1) / kBlock;
  int64_t pf_off = 0;
  double run = 0.0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * kBlock, len = std::min(kBlock, V - lo);
    const float* x = w + lo;
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) {
      if (pf_off < pf_bytes) {
        _mm_prefetch(pf + pf_off, _MM_HINT_T0);
        pf_off += 64;
      }
      __m256 w0 = _mm256_loadu_ps(x + j), w1 = _mm256_loadu_ps(x + j + 8);
      w0 = _mm256_and_ps(w0, _mm256_cmp_ps(w0, wm, _CMP_GE_OQ));
      w1 = _mm256_and_ps(w1, _mm256_cmp_ps(w1, wm, _CMP_GE_OQ));
      a0 = _mm256_add_pd(a0, lo_pd(w0));
      a1 = _mm256_add_pd(a1, hi_pd(w0));
      a2 = _mm256_add_pd(a2, lo_pd(w1));
      a3 = _mm256_add_pd(a3, hi_pd(w1));
    }
    for (; j < len; j += 8) {
      const int64_t n = std::min<int64_t>(8, len - j);
      __m256 w0 = n == 8 ? _mm256_loadu_ps(x + j) : load_tail(x + j, n, 0.f);
      w0 = _mm256_and_ps(w0, _mm256_cmp_ps(w0, wm, _CMP_GE_OQ));
      add8_at(w0, j, a0, a1, a2, a3);
    }
    P[b] = run;
    run += hsum4(_mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
  }
  P[nblocks] = run;
}
#endif

template <typename T>
inline void block_weights(const T* logits, int64_t begin, int64_t end, const RowDist& d, float* out) {
#if defined(FV_SAMPLING_AVX2)
  if (cpu_has_avx2())
    return dispatch_flags(d, [&]<bool A, bool B, bool C>() {
      block_weights_avx2<T, A, B, C>(logits, begin, end, d, out);
    });
#endif
  for (int64_t i = begin; i < end; ++i) out[i - begin] = weight_of(to_float(logits[i]) / d.temperature, d);
}

// float64 sum of n weights in 16 lanes (lane j takes elements i with i % 16 == j), reduced in a fixed order: the
// association of dense_sums_avx2, so the scalar fallback computes the same P.
inline double lane_sum(const float* w, int64_t n) {
  double acc[16] = {};
  for (int64_t i = 0; i < n; ++i) acc[i % 16] += static_cast<double>(w[i]);
  double v[4];
  for (int k = 0; k < 4; ++k) v[k] = (acc[k] + acc[4 + k]) + (acc[8 + k] + acc[12 + k]);
  return (v[0] + v[2]) + (v[1] + v[3]);
}

// P over the weights of the whole row (w_out: also store them); see dense_sums_avx2.
// nx / nx_scan: see dense_sums_avx2 (AVX2 only; without it nx_scan is left alone and false is returned).
template <typename T>
inline bool dense_sums(const T* logits, int64_t V, const RowDist& d, double* P, float* w_out,
                       const T* nx = nullptr, RowScan* nx_scan = nullptr) {
#if defined(FV_SAMPLING_AVX2)
  if (cpu_has_avx2()) {
    dispatch_flags(d, [&]<bool A, bool B, bool C>() {
      dense_sums_avx2<T, A, B, C>(logits, V, d, P, w_out, nx, nx_scan);
    });
    return nx != nullptr;
  }
#endif
  const int64_t nblocks = (V + kBlock - 1) / kBlock;
  alignas(32) float tmp[kBlock];
  double run = 0.0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * kBlock, len = std::min(kBlock, V - lo);
    block_weights(logits, lo, lo + len, d, tmp);
    if (w_out) std::copy(tmp, tmp + len, w_out + lo);
    P[b] = run;
    run += lane_sum(tmp, len);
  }
  P[nblocks] = run;
  return false;
}

inline void masked_sums(const float* w, int64_t V, float w_min, double* P, const char* pf = nullptr,
                        int64_t pf_bytes = 0) {
#if defined(FV_SAMPLING_AVX2)
  if (cpu_has_avx2()) return masked_sums_avx2(w, V, w_min, P, pf, pf_bytes);
#endif
  const int64_t nblocks = (V + kBlock - 1) / kBlock;
  alignas(32) float tmp[kBlock];
  double run = 0.0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * kBlock, len = std::min(kBlock, V - lo);
    for (int64_t j = 0; j < len; ++j) tmp[j] = w[lo + j] >= w_min ? w[lo + j] : 0.f;
    P[b] = run;
    run += lane_sum(tmp, len);
  }
  P[nblocks] = run;
}

// ---------------------------------------------------------------------------------------------------------------
// Row statistics.

#if defined(FV_SAMPLING_AVX2)
// Max and NaN / +inf detection over [0, V - V % 8); returns the index where the scalar tail starts.
template <typename T>
FV_AVX2_FN int64_t scan_row_avx2(const T* logits, int64_t V, RowScan& r) {
  // Four max chains (vmaxps waits 3 cycles on its accumulator); +inf shows up in the max, NaN (which vmaxps may
  // drop) in an unordered compare of two loads at a time.
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
  __m256 vnan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= V; i += 32) {
    const __m256 a = load8(logits + i), b = load8(logits + i + 8), c = load8(logits + i + 16),
                 e = load8(logits + i + 24);
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
    m2 = _mm256_max_ps(m2, c);
    m3 = _mm256_max_ps(m3, e);
    vnan = _mm256_or_ps(vnan, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, e, _CMP_UNORD_Q)));
  }
  for (; i + 8 <= V; i += 8) {
    const __m256 a = load8(logits + i);
    m0 = _mm256_max_ps(m0, a);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  r.max = hmax8(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
  r.bad = _mm256_movemask_ps(vnan) != 0 || r.max == std::numeric_limits<float>::infinity();
  return i;
}
#endif

template <typename T>
inline RowScan scan_row(const T* logits, int64_t V) {
  RowScan s;
  int64_t i = 0;
#if defined(FV_SAMPLING_AVX2)
  if (cpu_has_avx2()) i = scan_row_avx2(logits, V, s);
#endif
  for (; i < V; ++i) {
    const float x = to_float(logits[i]);
    if (std::isnan(x) || x == std::numeric_limits<float>::infinity()) s.bad = true;
    s.max = std::max(s.max, x);
  }
  return s;
}

template <typename T>
inline int64_t argmax_row(const T* logits, int64_t V, float max) {
  for (int64_t i = 0; i < V; ++i)
    if (to_float(logits[i]) == max) return i;
  return 0;
}

// Candidate buffer of the top-k threshold filter: (l / T, id) of every token seen with l / T >= thr, in id order.
struct TopKFilter {
  RowWorkspace& ws;
  int64_t k;
  int64_t cap;
  int64_t n = 0;
  float thr = -std::numeric_limits<float>::infinity();

  TopKFilter(RowWorkspace& w, int64_t k_) : ws(w), k(k_), cap(std::max<int64_t>(4 * k_, 256)) {
    ws.cand_val.resize(cap + 8);
    ws.cand_idx.resize(cap + 8);
  }
  void push(float lp, int64_t i) {
    ws.cand_val[n] = lp;
    ws.cand_idx[n] = i;
    ++n;
  }
  // Keep the k largest (with the ties at the k-th) and raise the threshold to the k-th largest.
  void compact() {
    auto& val = ws.cand_val;
    auto& idx = ws.cand_idx;
    auto& s = ws.scratch;
    s.assign(val.begin(), val.begin() + n);
    std::nth_element(s.begin(), s.begin() + (k - 1), s.end(), std::greater<float>());
    thr = s[k - 1];
    int64_t out = 0;
    for (int64_t j = 0; j < n; ++j)
      if (val[j] >= thr) {
        val[out] = val[j];
        idx[out] = idx[j];
        ++out;
      }
    n = out;
    if (n > cap / 2) {  // many ties at the threshold: grow rather than compact again and again
      cap *= 2;
      val.resize(cap + 8);
      idx.resize(cap + 8);
    }
  }
};

#if defined(FV_SAMPLING_AVX2)
// The filter over [0, V - V % 8); returns where the scalar tail starts. Sets bad on NaN / +inf.
// kDiv = false when T == 1 (l / 1 == l: the division, ~4 cycles per vector, is skipped).
template <typename T, bool kDiv>
FV_AVX2_FN int64_t topk_filter_avx2(const T* logits, int64_t V, float temperature, TopKFilter& f, bool& bad) {
  const __m256 tv = _mm256_set1_ps(temperature);
  const __m256 inf = _mm256_set1_ps(INFINITY);
  __m256 vbad = _mm256_setzero_ps();
  __m256 vthr = _mm256_set1_ps(f.thr);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 x = load8(logits + i);
    vbad = _mm256_or_ps(vbad, _mm256_cmp_ps(x, inf, _CMP_EQ_UQ));
    const __m256 lp = kDiv ? _mm256_div_ps(x, tv) : x;
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(lp, vthr, _CMP_GE_OQ));
    if (mask) {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, lp);
      while (mask) {
        const int j = __builtin_ctz(mask);
        mask &= mask - 1;
        f.push(tmp[j], i + j);
      }
      if (f.n >= f.cap) {
        f.compact();
        vthr = _mm256_set1_ps(f.thr);
      }
    }
  }
  bad = bad || _mm256_movemask_ps(vbad) != 0;
  return i;
}
#endif

// top-k threshold filter over l / T: leaves in ws.cand_val / ws.cand_idx the (l / T, id) of every token with
// l / T >= the k-th largest, in increasing id order. Returns false if a NaN or +inf was seen.
template <typename T>
inline bool topk_candidates(const T* logits, int64_t V, int64_t k, float temperature, RowWorkspace& ws) {
  TopKFilter f(ws, k);
  bool bad = false;
  int64_t i = 0;
#if defined(FV_SAMPLING_AVX2)
  if (cpu_has_avx2())
    i = temperature == 1.f ? topk_filter_avx2<T, false>(logits, V, temperature, f, bad)
                           : topk_filter_avx2<T, true>(logits, V, temperature, f, bad);
#endif
  for (; i < V; ++i) {
    const float x = to_float(logits[i]);
    if (std::isnan(x) || x == std::numeric_limits<float>::infinity()) bad = true;
    const float lp = x / temperature;
    if (lp >= f.thr) {
      f.push(lp, i);
      if (f.n >= f.cap) f.compact();
    }
  }
  if (bad) return false;
  if (f.n >= k) f.compact();
  ws.cand_val.resize(f.n);
  ws.cand_idx.resize(f.n);
  return true;
}

#if defined(FV_SAMPLING_AVX2)
// Lane indices of the set bits of an 8-bit mask, packed one per byte (the left-packing permutation).
inline const uint64_t* compress_lut() {
  static const std::vector<uint64_t> table = [] {
    std::vector<uint64_t> t(256);
    for (int m = 0; m < 256; ++m) {
      uint64_t v = 0;
      for (int j = 0, k = 0; j < 8; ++j)
        if (m >> j & 1) v |= static_cast<uint64_t>(j) << (8 * k++);
      t[m] = v;
    }
    return t;
  }();
  return table.data();
}

// out[0..m) = the w[i] >= floor in index order (branch-free left-packing; out has room for n + 8); returns m.
FV_AVX2_FN inline int64_t compress_ge_avx2(const float* w, int64_t n, float floor, float* out) {
  const uint64_t* lut = compress_lut();
  const __m256 fl = _mm256_set1_ps(floor);
  int64_t m = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(w + i);
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(x, fl, _CMP_GE_OQ));
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(lut[mask])));
    _mm256_storeu_ps(out + m, _mm256_permutevar8x32_ps(x, idx));
    m += __builtin_popcount(mask);
  }
  for (; i < n; ++i)
    if (w[i] >= floor) out[m++] = w[i];
  return m;
}

// In place: c[0..out) = the c[i] in [lo, hi], in order; returns out. Safe in place: the 8 lanes stored at out <= i
// were all loaded already.
FV_AVX2_FN inline int64_t compress_range_avx2(float* c, int64_t m, float lo, float hi) {
  const uint64_t* lut = compress_lut();
  const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
  int64_t out = 0, i = 0;
  for (; i + 8 <= m; i += 8) {
    const __m256 x = _mm256_loadu_ps(c + i);
    const int mask = _mm256_movemask_ps(
        _mm256_and_ps(_mm256_cmp_ps(x, vlo, _CMP_GE_OQ), _mm256_cmp_ps(x, vhi, _CMP_LE_OQ)));
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(lut[mask])));
    _mm256_storeu_ps(c + out, _mm256_permutevar8x32_ps(x, idx));
    out += __builtin_popcount(mask);
  }
  for (; i < m; ++i) {
    const float x = c[i];
    c[out] = x;
    out += (x >= lo) & (x <= hi);
  }
  return out;
}

#endif

// Smallest weight kept by top-p: keep i iff sum_{w_j > w_i} w_j < target (= p * Z_k), over w[0..n) (zeros
// allowed, never kept). A radix select on the float bits (w >= 0, so bit patterns order like the values) over a
// shrinking candidate list (cand[0..m)) instead of rescanning the row at every level:
//   0. cand = the weights >= 2^-12 (branch-free vector compaction): the threshold is among them when their mass
//      reaches the target, which level 1 finds out exactly; else the weights >= 2^-18, else all of them (and
//      all of them at once without AVX2). Typical rows keep the mass in few tokens, so level 1 sees a few percent
//      of the row instead of all of it (its scatter-add costs ~1.5 cycles per weight);
//   1. float64 mass per exponent field (bits 30..23) of cand (two interleaved histograms, so that neighbours of
//      one exponent do not wait on each other's store), scanned from the top; cand keeps the chosen exponent;
//   2, 3. the same on bits 22..12 and 11..0, while more than kSortBelow candidates remain;
//   then the survivors are sorted and walked in descending order exactly like the sparse path (equal weights kept
//   or dropped together). `above` is the float64 mass strictly above the candidates' bucket throughout.
inline float top_p_threshold(const float* w, int64_t n, double target, std::vector<double>& hist,
                             std::vector<float>& cand_buf) {
  constexpr int64_t kSortBelow = 64;
  auto bits_of = [](float x) {
    uint32_t b;
    std::memcpy(&b, &x, 4);
    return b;
  };
  auto min_positive = [](const float* x, int64_t m) {
    float mn = std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < m; ++i)
      if (x[i] > 0.f) mn = std::min(mn, x[i]);
    return mn;
  };
  if (static_cast<int64_t>(cand_buf.size()) < n + 8) cand_buf.resize(n + 8);  // grown once, never shrunk
  float* cand = cand_buf.data();
  int64_t m = 0;
  int e_floor = 0;  // cand holds the weights whose exponent field is >= e_floor
#if defined(FV_SAMPLING_AVX2)
  const bool simd = cpu_has_avx2();
  if (simd) e_floor = 127 - 12;
#endif
  int e;
  double above;
  for (;;) {
#if defined(FV_SAMPLING_AVX2)
    if (simd && e_floor > 0) {
      float floor_w;
      const uint32_t fb = static_cast<uint32_t>(e_floor) << 23;
      std::memcpy(&floor_w, &fb, 4);
      m = compress_ge_avx2(w, n, floor_w, cand);
    } else
#endif
    {
      std::copy(w, w + n, cand);
      m = n;
    }
    hist.assign(512, 0.0);
    double* h0 = hist.data();
    for (int64_t i = 0; i < m; ++i) h0[((i & 1) << 8) + (bits_of(cand[i]) >> 23)] += static_cast<double>(cand[i]);
    above = 0.0;
    for (e = 255; e >= e_floor; --e) {
      const double s = h0[e] + h0[256 + e];
      if (above + s >= target) break;
      above += s;
    }
    if (e >= e_floor || e_floor == 0) break;
    e_floor = e_floor > 127 - 18 ? 127 - 18 : 0;  // not enough mass above 2^-12: 2^-18, then everything
  }
  if (e < 0) return min_positive(w, n);  // rounding kept everything: the smallest positive weight
  // Keeps the candidates whose bits lie in [lo, hi] (positive floats: the same as their values), branch-free.
  auto keep_bits = [&](uint32_t lo, uint32_t hi) {
    float flo, fhi;
    std::memcpy(&flo, &lo, 4);
    std::memcpy(&fhi, &hi, 4);
#if defined(FV_SAMPLING_AVX2)
    if (cpu_has_avx2()) {
      m = compress_range_avx2(cand, m, flo, fhi);
      return;
    }
#endif
    int64_t out = 0;
    for (int64_t i = 0; i < m; ++i) {
      const float x = cand[i];
      cand[out] = x;
      out += (x >= flo) & (x <= fhi);
    }
    m = out;
  };
  uint32_t prefix = static_cast<uint32_t>(e) << 23;
  keep_bits(std::max<uint32_t>(prefix, 1u), prefix | ((1u << 23) - 1));  // exponent e, zeros never kept
  const int shifts[2] = {12, 0};
  const int widths[2] = {11, 12};
  for (int level = 0; level < 2 && m > kSortBelow; ++level) {
    const int shift = shifts[level];
    const uint32_t nb = 1u << widths[level];
    hist.assign(nb, 0.0);
    for (int64_t i = 0; i < m; ++i) hist[(bits_of(cand[i]) >> shift) & (nb - 1)] += static_cast<double>(cand[i]);
    int64_t b = nb - 1;
    for (; b >= 0; --b) {
      if (above + hist[b] >= target) break;
      above += hist[b];
    }
    if (b < 0) return min_positive(cand, m);  // rounding: all kept
    prefix |= static_cast<uint32_t>(b) << shift;
    keep_bits(std::max<uint32_t>(prefix, 1u), prefix | ((1u << shift) - 1));
  }
  // At most kSortBelow candidates left, or all 32 bits fixed (one value): the descending walk.
  std::sort(cand, cand + m, std::greater<float>());
  double run = above, group_start = above;
  float thr = m == 0 ? min_positive(w, n) : cand[0];
  for (int64_t j = 0; j < m; ++j) {
    if (j == 0 || cand[j] != cand[j - 1]) group_start = run;
    if (!(group_start < target)) break;
    thr = cand[j];
    run += static_cast<double>(cand[j]);
  }
  return thr;
}

// ---------------------------------------------------------------------------------------------------------------
// warp_row: the thresholds and prefix sums of one row.

template <typename T>
inline RowDist warp_row(const T* logits, int64_t V, Warp p, RowWorkspace& ws) {
  // The hint for this call only; the scan the previous call took of this row, if it did.
  const T* nx = static_cast<const T*>(ws.prefetch);
  const int64_t pf_bytes = ws.prefetch_bytes;
  ws.prefetch = nullptr;
  ws.prefetch_bytes = 0;
  const bool have_scan = ws.scanned == static_cast<const void*>(logits) && ws.scanned_v == V;
  ws.scanned = nullptr;
  auto row_scan = [&] { return have_scan ? ws.next_scan : scan_row(logits, V); };
  RowDist d;
  d.vocab = V;
  d.temperature = p.temperature;
  if (V <= 0) return d;
  const int64_t k = static_cast<int64_t>(p.top_k);
  const bool use_k = k > 0 && k < V && !(p.temperature == 0.f);
  const bool sparse = use_k && k <= kSparseTopK && 8 * k <= V;

  if (p.temperature == 0.f) {
    const RowScan s = row_scan();
    if (s.bad || s.max == -std::numeric_limits<float>::infinity()) return d;
    d.valid = d.greedy = true;
    d.argmax = argmax_row(logits, V, s.max);
    d.z = 1.0;
    return d;
  }

  if (sparse) {
    if (!topk_candidates(logits, V, k, p.temperature, ws)) return d;
    const auto& val = ws.cand_val;
    const int64_t n = static_cast<int64_t>(val.size());
    float mx = -std::numeric_limits<float>::infinity(), kth = std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      mx = std::max(mx, val[j]);
      kth = std::min(kth, val[j]);
    }
    if (n == 0 || mx == -std::numeric_limits<float>::infinity() ||
        mx == std::numeric_limits<float>::infinity())
      return d;
    d.m = mx;
    d.l_min = kth;
    // Weights of the top-k set; top-p over it exactly as the reference (descending order, float64 running
    // sum, equal weights kept or dropped together).
    ws.kept_w.resize(n);
    for (int64_t j = 0; j < n; ++j) ws.kept_w[j] = weight_exp(val[j] - d.m);
    float w_min = 0.f;
    if (p.top_p < 1.f) {
      auto& s = ws.scratch;
      s.assign(ws.kept_w.begin(), ws.kept_w.end());
      std::sort(s.begin(), s.end(), std::greater<float>());
      double zk = 0.0;
      for (float x : s) zk += static_cast<double>(x);
      const double target = static_cast<double>(p.top_p) * zk;
      double run = 0.0, group_start = 0.0;
      w_min = s[0];
      for (int64_t j = 0; j < n; ++j) {
        if (j == 0 || s[j] != s[j - 1]) group_start = run;
        if (!(group_start < target)) break;
        w_min = s[j];
        run += static_cast<double>(s[j]);
      }
    }
    d.w_min = std::max(w_min, p.min_p);
    // The kept list, in id order, and its sequential float64 prefix sums.
    ws.kept_idx.clear();
    ws.prefix.clear();
    double c = 0.0;
    int64_t out = 0;
    for (int64_t j = 0; j < n; ++j) {
      const float w = ws.kept_w[j];
      if (w >= d.w_min && w > 0.f) {
        ws.kept_idx.push_back(ws.cand_idx[j]);
        ws.kept_w[out++] = w;
        c += static_cast<double>(w);
        ws.prefix.push_back(c);
      }
    }
    ws.kept_w.resize(out);
    d.z = c;
    d.sparse = true;
    d.valid = d.z > 0.0;
    return d;
  }

  // Dense path.
  const RowScan s = row_scan();
  if (s.bad || s.max == -std::numeric_limits<float>::infinity()) return d;
  d.m = s.max / p.temperature;
  if (std::isinf(d.m)) return d;
  if (use_k) {  // large k: nth_element on a copy of l / T
    auto& sc = ws.scratch;
    sc.resize(V);
    for (int64_t i = 0; i < V; ++i) sc[i] = to_float(logits[i]) / p.temperature;
    std::nth_element(sc.begin(), sc.begin() + (k - 1), sc.end(), std::greater<float>());
    d.l_min = sc[k - 1];
  }
  const int64_t nblocks = (V + kBlock - 1) / kBlock;
  ws.prefix.resize(nblocks + 1);
  if (p.top_p < 1.f) {
    ws.w.resize(V);
    dense_sums(logits, V, d, ws.prefix.data(), ws.w.data());  // w_min is still 0 here: top-k only
    const double zk = ws.prefix[nblocks];
    const float wp = top_p_threshold(ws.w.data(), V, static_cast<double>(p.top_p) * zk, ws.hist, ws.scratch);
    d.w_min = std::max(wp, p.min_p);
    masked_sums(ws.w.data(), V, d.w_min, ws.prefix.data(), reinterpret_cast<const char*>(nx), pf_bytes);
  } else {
    d.w_min = p.min_p;
    if (dense_sums(logits, V, d, ws.prefix.data(), nullptr, nx, &ws.next_scan)) {
      ws.scanned = nx;
      ws.scanned_v = V;
    }
  }
  d.z = ws.prefix[nblocks];
  d.valid = d.z > 0.0;
  return d;
}

// ---------------------------------------------------------------------------------------------------------------
// Sampling and its inverse.

// Tokens taken out of a row's distribution, with their weights: verify's residual after rejecting one-hot
// drafts (the kept weights minus those tokens, renormalised). Distinct ids, few of them.
struct Excluded {
  int64_t n = 0;
  const int64_t* ids = nullptr;
  const double* w = nullptr;
  bool has(int64_t t) const {
    for (int64_t i = 0; i < n; ++i)
      if (ids[i] == t) return true;
    return false;
  }
  double before(int64_t t) const {  // weight excluded below id t
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i)
      if (ids[i] < t) s += w[i];
    return s;
  }
};

// The token of a valid, non-greedy row for the float64 target u * Z (see the header comment); with `ex`, of the
// row without the excluded tokens (target = u * (Z - their weight); C(t) less the excluded weight up to t).
template <typename T>
inline int64_t select_target(const T* logits, const RowDist& d, const RowWorkspace& ws, double target,
                             const Excluded& ex = {}) {
  if (d.sparse) {
    const auto& c = ws.prefix;
    const auto& ids = ws.kept_idx;
    if (ex.n == 0) {
      const auto it = std::upper_bound(c.begin(), c.end(), target);
      if (it == c.end()) return ids.back();  // rounding: the last kept token (all have w > 0)
      return ids[it - c.begin()];
    }
    int64_t last = -1;
    for (size_t j = 0; j < ids.size(); ++j) {
      if (ex.has(ids[j])) continue;
      if (c[j] - ex.before(ids[j]) > target) return ids[j];
      last = ids[j];
    }
    return last;
  }
  const int64_t V = d.vocab, nblocks = (V + kBlock - 1) / kBlock;
  const auto& P = ws.prefix;
  auto P_at = [&](int64_t b) { return ex.n ? P[b] - ex.before(b * kBlock) : P[b]; };
  // Smallest b with P[b + 1] > target.
  int64_t b = 0;
  for (int64_t hi = nblocks; b < hi;) {
    const int64_t mid = b + (hi - b) / 2;
    if (P_at(mid + 1) > target) hi = mid; else b = mid + 1;
  }
  alignas(32) float tmp[kBlock];
  auto weights = [&](int64_t lo, int64_t len) {
    block_weights(logits, lo, lo + len, d, tmp);
    for (int64_t i = 0; i < ex.n; ++i)
      if (ex.ids[i] >= lo && ex.ids[i] < lo + len) tmp[ex.ids[i] - lo] = 0.f;
  };
  // The first positive token whose running sum passes the target; a block that rounding (or an exclusion) left
  // without one passes the search on to the next block.
  for (; b < nblocks; ++b) {
    const int64_t lo = b * kBlock, len = std::min(kBlock, V - lo);
    weights(lo, len);
    double c = P_at(b);
    int64_t last = -1;
    for (int64_t j = 0; j < len; ++j) {
      c += static_cast<double>(tmp[j]);
      if (tmp[j] > 0.f) {
        last = j;
        if (c > target) return lo + j;
      }
    }
    if (last >= 0) return lo + last;  // rounding inside the block: its last positive token
  }
  // Rounding past the end: the last token with w > 0.
  for (b = nblocks - 1; b >= 0; --b) {
    if (!(P[b + 1] > P[b])) continue;
    const int64_t lo = b * kBlock, len = std::min(kBlock, V - lo);
    weights(lo, len);
    for (int64_t j = len - 1; j >= 0; --j)
      if (tmp[j] > 0.f) return lo + j;
  }
  return -1;
}

// cdf_sample of one row: the smallest t with C(t) > u * Z; -1 for an invalid row.
template <typename T>
inline int64_t sample_row(const T* logits, const RowDist& d, const RowWorkspace& ws, double u) {
  if (!d.valid) return -1;
  if (d.greedy) return d.argmax;
  return select_target(logits, d, ws, u * d.z);
}

// The float64 prefix sum C(t - 1) before token t and w(t), as this backend associates them.
template <typename T>
inline void bin_of(const T* logits, const RowDist& d, const RowWorkspace& ws, int64_t t, double* c_lo,
                   float* w_t) {
  if (d.sparse) {
    const auto it = std::lower_bound(ws.kept_idx.begin(), ws.kept_idx.end(), t);
    if (it == ws.kept_idx.end() || *it != t) {
      *w_t = 0.f;
      *c_lo = 0.0;
      return;
    }
    const int64_t j = it - ws.kept_idx.begin();
    *w_t = ws.kept_w[j];
    *c_lo = j > 0 ? ws.prefix[j - 1] : 0.0;
    return;
  }
  const int64_t b = t / kBlock, lo = b * kBlock, len = std::min(kBlock, d.vocab - lo);
  alignas(32) float tmp[kBlock];
  block_weights(logits, lo, lo + len, d, tmp);
  double c = ws.prefix[b];
  for (int64_t j = 0; j < t - lo; ++j) c += static_cast<double>(tmp[j]);
  *c_lo = c;
  *w_t = tmp[t - lo];
}

// cdf_invert of one row: u in (0, 1) with sample_row(u) == t, from u = (C(t - 1) + v * w(t)) / Z (PTP Eq. 9),
// moved along the float64 numbers (exponential then binary search, with sample_row as the judge) when
// rounding put it in a neighbouring bin. NaN where w(t) = 0, for invalid rows, and where no float64 u selects t
// (its bin absorbed by rounding).
template <typename T>
inline double invert_row(const T* logits, const RowDist& d, const RowWorkspace& ws, int64_t t, double v) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (!d.valid || t < 0 || t >= d.vocab) return nan;
  const double u_lo = std::numeric_limits<double>::min(), u_hi = 1.0 - 0x1p-53;
  if (d.greedy) return t == d.argmax ? std::clamp(v, u_lo, u_hi) : nan;
  double c_lo;
  float w_t;
  bin_of(logits, d, ws, t, &c_lo, &w_t);
  if (!(w_t > 0.f)) return nan;
  double u = std::clamp((c_lo + v * static_cast<double>(w_t)) / d.z, u_lo, u_hi);
  auto at = [&](uint64_t bits) {
    double x;
    std::memcpy(&x, &bits, 8);
    return select_target(logits, d, ws, x * d.z);
  };
  uint64_t ub;
  std::memcpy(&ub, &u, 8);
  uint64_t lo_b, hi_b;
  std::memcpy(&lo_b, &u_lo, 8);
  std::memcpy(&hi_b, &u_hi, 8);
  const int64_t r = at(ub);
  if (r == t) return u;
  // sample is non-decreasing in u: search the first u with sample >= t (r < t), or the last with sample <= t.
  if (r < t) {
    uint64_t a = ub, step = 1, bnd = ub;
    for (;;) {  // exponential search for bnd with sample(bnd) >= t
      bnd = (hi_b - a > step) ? a + step : hi_b;
      if (at(bnd) >= t) break;
      if (bnd == hi_b) return nan;
      a = bnd;
      step *= 2;
    }
    while (bnd - a > 1) {  // invariant: sample(a) < t <= sample(bnd)
      const uint64_t mid = a + (bnd - a) / 2;
      (at(mid) >= t ? bnd : a) = mid;
    }
    if (at(bnd) != t) return nan;
    double x;
    std::memcpy(&x, &bnd, 8);
    return x;
  }
  uint64_t a = ub, step = 1, bnd = ub;
  for (;;) {  // exponential search downwards for bnd with sample(bnd) <= t
    bnd = (a - lo_b > step) ? a - step : lo_b;
    if (at(bnd) <= t) break;
    if (bnd == lo_b) return nan;
    a = bnd;
    step *= 2;
  }
  while (a - bnd > 1) {  // invariant: sample(bnd) <= t < sample(a)
    const uint64_t mid = bnd + (a - bnd) / 2;
    (at(mid) <= t ? bnd : a) = mid;
  }
  if (at(bnd) != t) return nan;
  double x;
  std::memcpy(&x, &bnd, 8);
  return x;
}

// Dense warped weights of a row (out[0..V)): what the reference's warp_weights returns for it.
template <typename T>
inline void row_weights(const T* logits, const RowDist& d, const RowWorkspace& ws, float* out) {
  const int64_t V = d.vocab;
  if (!d.valid) {
    std::fill(out, out + V, 0.f);
    return;
  }
  if (d.greedy) {
    std::fill(out, out + V, 0.f);
    out[d.argmax] = 1.f;
    return;
  }
  if (d.sparse) {
    std::fill(out, out + V, 0.f);
    for (size_t j = 0; j < ws.kept_idx.size(); ++j) out[ws.kept_idx[j]] = ws.kept_w[j];
    return;
  }
  block_weights(logits, 0, V, d, out);
}

// Inverse-CDF sampling from an arbitrary non-negative weights array (e.g. verify's residual max(p - q, 0)):
// the smallest t with C(t) > u * Z, C the sequential float64 prefix sum in token-id order, Z = C(V - 1); the last
// positive token if rounding leaves none; -1 if Z is 0. Host and device.
template <typename W>
FV_HD int64_t sample_weights(const W* w, int64_t V, double u) {
  double z = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < V; ++i) {
    const double x = static_cast<double>(w[i]);
    z += x;
    if (x > 0.0) last = i;
  }
  if (!(z > 0.0)) return -1;
  const double target = u * z;
  double c = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    c += static_cast<double>(w[i]);
    if (c > target) return i;
  }
  return last;
}

}  // namespace sampling
}  // namespace fastverify

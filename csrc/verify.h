// Framework-free row statistics of fastverify::verify (CPU). Raw pointers, sizes and strides only; the binding
// (csrc/cpu/verify.cpp) checks inputs and calls these per logits row inside at::parallel_for.
//
// One pass over a row of V logits (fp32, bf16 or fp16, converted per element, never copied) yields what every
// deterministic rule needs: the maximum and the lowest id holding it (argmax), whether the row holds NaN / +inf
// or is entirely -inf, and on demand
//   - the rank of each child token x of the row: #{l_v > l_x} + #{l_v == l_x, v < x};
//   - S = sum_v exp(l_v - m) and the entropy H = log S - sum_v exp(l_v - m) (l_v - m) / S (nats), both with an
//     online rescale per block: the block's maximum comes from the same traversal (the block is still in L1
//     when its exponentials are summed), so memory is read once.
// The hot loop has an AVX2 + FMA (+ F16C) path chosen at run time (__builtin_cpu_supports) and a portable
// scalar path; the extension is compiled without -mavx2 so that it loads on any x86-64, and torch's
// at::vec::Vectorized would fall back to its scalar DEFAULT flavour in such a translation unit.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu_features.h"

namespace fastverify {
namespace verify_detail {

// Element types as stored in memory: float, and the raw 16-bit patterns of bfloat16 / float16.
struct F32 { using raw = float; };
struct BF16 { using raw = uint16_t; };
struct F16 { using raw = uint16_t; };

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float load_scalar(const float* p) { return *p; }

template <typename T>
inline float to_float(typename T::raw v);
template <>
inline float to_float<F32>(float v) { return v; }
template <>
inline float to_float<BF16>(uint16_t v) { return bits_to_float(uint32_t(v) << 16); }
template <>
inline float to_float<F16>(uint16_t h) {  // IEEE binary16 -> binary32, exact (subnormals, inf, NaN)
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    float f = float(man) * 5.9604644775390625e-8f;  // man * 2^-24
    return sign ? -f : f;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// What the rule needs from a row (template flags of the pass).
struct RowNeeds {
  bool rank;     // topk, gad
  bool softmax;  // typical, confidence: S
  bool entropy;  // typical: H
};

struct RowStats {
  float max;
  int64_t argmax;
  bool bad;      // NaN or +inf somewhere, or every entry -inf
  double sum;    // S = sum exp(l - max)
  double ent;    // H in nats
};

// Children of the row: their tokens and (read before the pass) their logits; the pass fills their ranks.
struct RowChildren {
  int n;
  const int64_t* tokens;  // [n]
  const float* logit;     // [n]
  int64_t* rank;          // [n] out (when needs.rank)
};

// Rescaled online sums: (S, T) relative to m, with T = sum e (l - m); merge a block summed relative to mb >= m.
struct OnlineSum {
  double m = -std::numeric_limits<double>::infinity();
  double s = 0.0;
  double t = 0.0;
  void rebase(double m_new) {  // m_new >= m
    if (m_new == m) return;
    if (s > 0.0) {
      double scale = std::exp(m - m_new);
      t = scale * (t + (m - m_new) * s);
      s *= scale;
    }
    m = m_new;
  }
};

constexpr float kExpFloor = -87.0f;  // exp(-87) ~ 1.6e-38: still normal; terms below it do not change S

template <typename T>
void row_stats_scalar(const typename T::raw* row, int64_t V, RowNeeds needs, RowChildren ch, RowStats& out) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t am = 0;
  bool bad = false;
  for (int c = 0; c < ch.n; ++c) ch.rank[c] = 0;
  for (int64_t v = 0; v < V; ++v) {
    float x = to_float<T>(row[v]);
    if (std::isnan(x)) bad = true;
    if (x > m) { m = x; am = v; }
    if (needs.rank)
      for (int c = 0; c < ch.n; ++c)
        ch.rank[c] += (x > ch.logit[c]) || (x == ch.logit[c] && v < ch.tokens[c]);
  }
  out.max = m;
  out.argmax = am;
  out.bad = bad || m == std::numeric_limits<float>::infinity() || m == -std::numeric_limits<float>::infinity();
  out.sum = 0.0;
  out.ent = 0.0;
  if (out.bad || !needs.softmax) return;
  double s = 0.0, t = 0.0;
  for (int64_t v = 0; v < V; ++v) {
    float d = to_float<T>(row[v]) - m;
    if (d < kExpFloor) continue;
    float e = std::exp(d);
    s += e;
    t += double(e) * d;
  }
  out.sum = s;
  out.ent = std::log(s) - t / s;
}

#ifdef FASTVERIFY_X86
#define FV_AVX2 __attribute__((target("avx2,fma,f16c")))
#define FV_AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

template <typename T>
FV_AVX2_INLINE __m256 load8(const typename T::raw* p);
template <>
FV_AVX2_INLINE __m256 load8<F32>(const float* p) { return _mm256_loadu_ps(p); }
template <>
FV_AVX2_INLINE __m256 load8<BF16>(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
template <>
FV_AVX2_INLINE __m256 load8<F16>(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 2^d for d in [-126, 0] (callers clamp): d = n + f with n = round(d), f in [-1/2, 1/2]; 2^f by its degree-6
// Taylor polynomial in f ln 2 (relative error < 1.3e-7, about one float ulp), 2^n added to the exponent bits.
FV_AVX2_INLINE __m256 exp2_8(__m256 d) {
  const __m256 n = _mm256_round_ps(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(d, n);
  __m256 p = _mm256_set1_ps(1.5403530393381609e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

FV_AVX2_INLINE float hmax8(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_shuffle_ps(a, a, 1));
  return _mm_cvtss_f32(a);
}

FV_AVX2_INLINE double hsum8d(__m256 v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  double s = 0.0;
  for (int i = 0; i < 8; ++i) s += f[i];
  return s;
}

// Elements per block: the block's max comes from the first traversal, its exponentials from a second one
// while the block is still in L1 (2048 fp32 = 8 KiB).
constexpr int64_t kBlock = 2048;
constexpr int kMaxVecChildren = 16;  // rank counting in registers for up to this many children per pass

// Sums over one block of e = 2^(d log2 e), d = max(x - m, -87) (e^-87 ~ 1.6e-38 is still a normal float; the max
// also maps -inf and NaN to the floor), in float lanes s0 / s1, and with Entropy of e * d (the same floored d, so
// -inf entries add a vanishing finite amount, never NaN) in t0 / t1. The pass is bound by arithmetic while the
// block sits in L1, so it prefetches the next block (row + b1 on) meanwhile, overlapping DRAM with the exponentials.
template <typename T, bool Entropy>
FV_AVX2_INLINE void block_exp_sums(const typename T::raw* row, int64_t b0, int64_t b1, __m256 mv, __m256& s0,
                                   __m256& s1, __m256& t0, __m256& t1) {
  const __m256 kLog2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 kFloorE = _mm256_set1_ps(kExpFloor);
  int64_t w = b0;
  for (; w + 16 <= b1; w += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(row + b1 + (w - b0)), _MM_HINT_T0);
    const __m256 d0 = _mm256_max_ps(_mm256_sub_ps(load8<T>(row + w), mv), kFloorE);
    const __m256 d1 = _mm256_max_ps(_mm256_sub_ps(load8<T>(row + w + 8), mv), kFloorE);
    const __m256 e0 = exp2_8(_mm256_mul_ps(d0, kLog2e)), e1 = exp2_8(_mm256_mul_ps(d1, kLog2e));
    s0 = _mm256_add_ps(s0, e0);
    s1 = _mm256_add_ps(s1, e1);
    if constexpr (Entropy) {
      t0 = _mm256_fmadd_ps(e0, d0, t0);
      t1 = _mm256_fmadd_ps(e1, d1, t1);
    }
  }
  for (; w < b1; w += 8) {
    const __m256 d0 = _mm256_max_ps(_mm256_sub_ps(load8<T>(row + w), mv), kFloorE);
    const __m256 e0 = exp2_8(_mm256_mul_ps(d0, kLog2e));
    s0 = _mm256_add_ps(s0, e0);
    if constexpr (Entropy) t0 = _mm256_fmadd_ps(e0, d0, t0);
  }
}

// The max / NaN traversal of block [b0, b1); with NC > 0 children, also rank[c] += #{x > thr[c]} over the block.
template <typename T, int NC>
FV_AVX2_INLINE void block_max(const typename T::raw* row, int64_t b0, int64_t b1, const __m256* thr, __m256& vbad,
                              __m256& bmax0, __m256& bmax1, int64_t* rank) {
  __m256i cnt[NC > 0 ? NC : 1];  // mask lanes are -1
  for (int c = 0; c < NC; ++c) cnt[c] = _mm256_setzero_si256();
  int64_t v = b0;
  for (; v + 16 <= b1; v += 16) {
    const __m256 x0 = load8<T>(row + v), x1 = load8<T>(row + v + 8);
    vbad = _mm256_or_ps(vbad, _mm256_or_ps(_mm256_cmp_ps(x0, x0, _CMP_UNORD_Q), _mm256_cmp_ps(x1, x1, _CMP_UNORD_Q)));
    bmax0 = _mm256_max_ps(x0, bmax0);  // x first: a NaN x leaves bmax unchanged
    bmax1 = _mm256_max_ps(x1, bmax1);
    for (int c = 0; c < NC; ++c) {
      const __m256i m0 = _mm256_castps_si256(_mm256_cmp_ps(x0, thr[c], _CMP_GT_OQ));
      const __m256i m1 = _mm256_castps_si256(_mm256_cmp_ps(x1, thr[c], _CMP_GT_OQ));
      cnt[c] = _mm256_sub_epi32(_mm256_sub_epi32(cnt[c], m0), m1);
    }
  }
  for (; v < b1; v += 8) {
    const __m256 x = load8<T>(row + v);
    vbad = _mm256_or_ps(vbad, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    bmax0 = _mm256_max_ps(x, bmax0);
    for (int c = 0; c < NC; ++c)
      cnt[c] = _mm256_sub_epi32(cnt[c], _mm256_castps_si256(_mm256_cmp_ps(x, thr[c], _CMP_GT_OQ)));
  }
  for (int c = 0; c < NC; ++c) {
    alignas(32) int32_t f[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(f), cnt[c]);
    for (int i = 0; i < 8; ++i) rank[c] += f[i];
  }
}
constexpr int kMaxFusedChildren = 4;

template <typename T>
FV_AVX2 void row_stats_avx2(const typename T::raw* row, int64_t V, RowNeeds needs, RowChildren ch, RowStats& out) {
  const float kInf = std::numeric_limits<float>::infinity();
  __m256 vbad = _mm256_setzero_ps();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  // Ranks: children in groups of kMaxVecChildren (a tree row rarely has more); one extra pass per group.
  const int groups = needs.rank ? (ch.n + kMaxVecChildren - 1) / kMaxVecChildren : 0;
  for (int c = 0; c < ch.n; ++c) ch.rank[c] = 0;
  OnlineSum acc;
  const int64_t V8 = V & ~int64_t(7);
  // The argmax is located lazily: the first block whose maximum is the row's maximum is rescanned at the end,
  // so the main loop carries only a max (no index blends).
  float run_max = -kInf;
  int64_t best_b0 = -1;

  for (int64_t b0 = 0; b0 < V8; b0 += kBlock) {
    const int64_t b1 = b0 + kBlock < V8 ? b0 + kBlock : V8;
    __m256 bmax0 = _mm256_set1_ps(-kInf), bmax1 = bmax0;
    // A row with few children (every row of a chain, most rows of a tree) none of whose ids lies in this block:
    // their rank compares (the one-compare form below) ride along this traversal, so the block is read once.
    bool fused = needs.rank && ch.n > 0 && ch.n <= kMaxFusedChildren;
    __m256 fused_thr[kMaxFusedChildren];
    for (int c = 0; c < ch.n && fused; ++c) {
      const float lx = ch.logit[c];
      const int64_t t = ch.tokens[c];
      fused = lx != -kInf && !(t >= b0 && t < b1);
      fused_thr[c] = _mm256_set1_ps(t >= b1 ? std::nextafter(lx, -kInf) : lx);
    }
    switch (fused ? ch.n : 0) {
      case 1: block_max<T, 1>(row, b0, b1, fused_thr, vbad, bmax0, bmax1, ch.rank); break;
      case 2: block_max<T, 2>(row, b0, b1, fused_thr, vbad, bmax0, bmax1, ch.rank); break;
      case 3: block_max<T, 3>(row, b0, b1, fused_thr, vbad, bmax0, bmax1, ch.rank); break;
      case 4: block_max<T, 4>(row, b0, b1, fused_thr, vbad, bmax0, bmax1, ch.rank); break;
      default: block_max<T, 0>(row, b0, b1, fused_thr, vbad, bmax0, bmax1, nullptr);
    }
    const float bm = hmax8(_mm256_max_ps(bmax0, bmax1));
    if (bm > run_max) {  // strict: the first block holding the maximum
      run_max = bm;
      best_b0 = b0;
    }
    for (int g = fused ? groups : 0; g < groups; ++g) {
      const int c0 = g * kMaxVecChildren;
      const int nc = ch.n - c0 < kMaxVecChildren ? ch.n - c0 : kMaxVecChildren;
      // rank(x) counts l_v > l_x, and l_v == l_x for v < x. In a block that does not hold x's own id the tie rule
      // is the same for every element: after x, l_v > l_x; before x, l_v >= l_x, i.e. l_v > the float below l_x.
      // So one compare per element against a per-block threshold; the block holding x (and l_x = -inf, which has
      // no float below it) takes the exact two-compare form.
      bool exact = false;
      __m256i cnt[kMaxVecChildren];
      __m256 thr[kMaxVecChildren];
      for (int c = 0; c < nc; ++c) {
        const float lx = ch.logit[c0 + c];
        const int64_t t = ch.tokens[c0 + c];
        cnt[c] = _mm256_setzero_si256();
        exact |= (t >= b0 && t < b1) || lx == -kInf;
        thr[c] = _mm256_set1_ps(t >= b1 ? std::nextafter(lx, -kInf) : lx);
      }
      if (!exact) {
        for (int64_t w = b0; w < b1; w += 8) {
          if (g == 0 && ((w - b0) & 15) == 0)  // the next block, from DRAM while this one is counted from L1
            _mm_prefetch(reinterpret_cast<const char*>(row + b1 + (w - b0)), _MM_HINT_T0);
          const __m256 x = load8<T>(row + w);
          for (int c = 0; c < nc; ++c)  // mask lanes are -1
            cnt[c] = _mm256_sub_epi32(cnt[c], _mm256_castps_si256(_mm256_cmp_ps(x, thr[c], _CMP_GT_OQ)));
        }
      } else {
        for (int c = 0; c < nc; ++c) thr[c] = _mm256_set1_ps(ch.logit[c0 + c]);
        for (int64_t w = b0; w < b1; w += 8) {
          const __m256 x = load8<T>(row + w);
          const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(int32_t(w)), lane);
          for (int c = 0; c < nc; ++c) {
            const __m256i tok = _mm256_set1_epi32(int32_t(ch.tokens[c0 + c]));
            const __m256i gt = _mm256_castps_si256(_mm256_cmp_ps(x, thr[c], _CMP_GT_OQ));
            const __m256i eq = _mm256_castps_si256(_mm256_cmp_ps(x, thr[c], _CMP_EQ_OQ));
            const __m256i before = _mm256_and_si256(eq, _mm256_cmpgt_epi32(tok, idx));
            cnt[c] = _mm256_sub_epi32(cnt[c], _mm256_or_si256(gt, before));
          }
        }
      }
      for (int c = 0; c < nc; ++c) {
        alignas(32) int32_t f[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(f), cnt[c]);
        int64_t sum = 0;
        for (int i = 0; i < 8; ++i) sum += f[i];
        ch.rank[c0 + c] += sum;
      }
    }
    if (needs.softmax) {
      const double m_new = bm > acc.m ? double(bm) : acc.m;
      if (m_new == -double(kInf) || bm == kInf) continue;  // all -inf so far, or a bad row
      acc.rebase(m_new);
      // Summed in float lanes per block (at most 256 terms per lane), then in double.
      const __m256 mv = _mm256_set1_ps(float(m_new));
      __m256 s0 = _mm256_setzero_ps(), s1 = s0, t0 = s0, t1 = s0;
      if (needs.entropy)
        block_exp_sums<T, true>(row, b0, b1, mv, s0, s1, t0, t1);
      else
        block_exp_sums<T, false>(row, b0, b1, mv, s0, s1, t0, t1);
      acc.s += hsum8d(_mm256_add_ps(s0, s1));
      if (needs.entropy) acc.t += hsum8d(_mm256_add_ps(t0, t1));
    }
  }

  // The argmax: the first element equal to the maximum inside the first block that holds it.
  float m = run_max;
  int64_t am = 0;
  if (best_b0 >= 0) {
    const int64_t b1 = best_b0 + kBlock < V8 ? best_b0 + kBlock : V8;
    for (int64_t v = best_b0; v < b1; ++v)
      if (to_float<T>(row[v]) == m) {
        am = v;
        break;
      }
  }
  bool bad = _mm256_movemask_ps(vbad) != 0;
  // Tail (V not a multiple of 8), scalar; its ids are larger, so ties keep the earlier argmax.
  for (int64_t v = V8; v < V; ++v) {
    const float x = to_float<T>(row[v]);
    if (std::isnan(x)) bad = true;
    if ((V8 == 0 && v == 0) || x > m) {
      m = x;
      am = v;
    }
    if (needs.rank)
      for (int c = 0; c < ch.n; ++c)
        ch.rank[c] += (x > ch.logit[c]) || (x == ch.logit[c] && v < ch.tokens[c]);
  }
  out.max = m;
  out.argmax = am;
  out.bad = bad || m == kInf || m == -kInf;
  out.sum = 0.0;
  out.ent = 0.0;
  if (out.bad || !needs.softmax) return;
  if (double(m) > acc.m) acc.rebase(double(m));
  for (int64_t v = V8; v < V; ++v) {
    const float d = to_float<T>(row[v]) - float(acc.m);
    if (d < kExpFloor) continue;
    const float e = std::exp(d);
    acc.s += e;
    acc.t += double(e) * d;
  }
  out.sum = acc.s;
  out.ent = std::log(acc.s) - acc.t / acc.s;
}
#undef FV_AVX2_INLINE
#endif  // FASTVERIFY_X86

inline bool has_avx2() {
#ifdef FASTVERIFY_X86
  return cpu_has_avx2_fma(/*f16c=*/true);
#else
  return false;
#endif
}

// Statistics of one row; `row` points at its first element (raw storage of T).
template <typename T>
void row_stats(const typename T::raw* row, int64_t V, RowNeeds needs, RowChildren ch, RowStats& out) {
#ifdef FASTVERIFY_X86
  if (has_avx2()) return row_stats_avx2<T>(row, V, needs, ch, out);
#endif
  row_stats_scalar<T>(row, V, needs, ch, out);
}

}  // namespace verify_detail
}  // namespace fastverify

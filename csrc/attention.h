// Framework-free CPU kernel of fastverify::masked_attention: softmax(q k^T * scale + mask) v for the few query rows
// of a verify forward (its root and draft rows), every query head of a grouped-query group read against its key /
// value head in one pass. Raw pointers and sizes only; csrc/cpu/attention.cpp checks inputs and splits the work.
//
// Why: torch's CPU SDPA costs ~40 us per call at one query row against 400 keys on a 2-core Intel Xeon (its tiling
// and bookkeeping, for ~0.5 MFLOP), which is 30 calls (one per layer of SmolLM2-135M) and ~1.2 ms of every decoding
// step. Here one (key / value head, batch row) is one small GEMM pair on the rows of its G query heads:
//
//   scores [R, S] = Q [R, D] K^T            AVX-512 with D a multiple of 16: tiles of 4 query rows x 4 keys, each
//                                           score 16 lane sums over D then reduce16's fold (scores_avx512; over 256
//                                           KB of keys, in chunks that stay in L1 across the row tiles); else
//                                           skinny_rows (linear.h)
//   p = softmax(scores * scale + mask)      per row: the maximum, exp(s - max) (torch's expf, sampling.h), the sum
//                                           (on AVX2 8 lane sums, the r-th non-zero weight in lane r mod 8; in key
//                                           order on the scalar path), times 1 / sum. Two variants of eager
//                                           attention: a soft cap c (Gemma 2: scores c * tanh(s * scale / c) before
//                                           the mask) and a sink logit per head (gpt-oss: one more logit in the
//                                           maximum and the sum, no value row)
//   out [R, D] = p V                        V's rows streamed once per tile of query rows (over 256 KB of values, in
//                                           chunks of keys that stay in L1 across the tiles); per output element the
//                                           sum in key order (pv)
//
// with R = G * n (n query rows per head). Results agree with SDPA to float32 rounding, not bit for bit (another
// order of sums). On each path a query row's result depends on nothing but its own q, mask row and the keys and
// values: every score, softmax and output element is computed in the same order whatever the other rows. More: it
// depends on the keys it sees alone, in their order, not on the masked keys between or after them (their weights
// are 0: a sum adds nothing for them, the AVX2 sum's lanes count the non-zero weights only, and pv's p * v + acc is
// acc for them), so a verify forward's draft row gives what the one-row forward of the same token gives once its
// path is committed, bit for bit: the loop's drafts change which forwards run, never a row's logits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_features.h"
#include "linear.h"
#include "sampling.h"

namespace fastverify {
namespace attention {

constexpr float kNoSink = -std::numeric_limits<float>::infinity();

// A row whose logits are all -inf (mx, their maximum, is -inf) and none NaN: SDPA gives it weights 0 (an output of
// 0), where exp(s - mx) would be NaN. A NaN logit keeps the row NaN, as in SDPA and eager attention.
inline bool sees_nothing(const float* s, int64_t S, float mx) {
  if (mx != kNoSink) return false;
  for (int64_t j = 0; j < S; ++j)
    if (std::isnan(s[j])) return false;
  return true;
}

// Row s [S] in place: s * scale + mask (mask may be nullptr), then its softmax: exp(s - max) / sum, with the sink
// logit (kNoSink: none) one more term of the maximum and of the sum, after the keys' (its weight is not kept).
// zero_unseen: a row of -inf logits gets weights 0 (SDPA's rule); else NaN (eager attention's softmax).
inline void softmax_row_scalar(float* s, const float* mask, int64_t S, float scale, float sink, bool zero_unseen) {
  float mx = sink;
  for (int64_t j = 0; j < S; ++j) {
    s[j] = mask ? s[j] * scale + mask[j] : s[j] * scale;
    mx = std::max(mx, s[j]);
  }
  if (zero_unseen && sees_nothing(s, S, mx)) return std::fill(s, s + S, 0.f);
  float sum = 0.f;
  for (int64_t j = 0; j < S; ++j) sum += (s[j] = sampling::weight_exp(s[j] - mx));
  if (sink != kNoSink) sum += sampling::weight_exp(sink - mx);
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < S; ++j) s[j] *= inv;
}

#if defined(FV_SAMPLING_AVX2)
// The lanes of the row's sum (softmax_row_avx2): the r-th non-zero weight of the row, in key order, is added to lane
// r mod 8. A masked key's weight is exactly 0, and so is one that underflows; leaving the zeros out of the lane
// count makes the sum a function of the non-zero weights in order alone, so a query row's softmax does not depend on
// how many masked keys lie between or after its visible ones (a verify forward's sibling draft rows, the rows after
// its own): the row's result equals the one-row forward's bit for bit (tests/test_masked_attention.py).
struct RankLanes {
  // per 8-bit mask of non-zero lanes: their lane indices in order, then the index of a zero lane (any; all zeros)
  alignas(32) int32_t compress[256][8];
  // per count k: lane i takes lane (i + k) mod 8 (add_by_rank's frame moved on by k ranks)
  alignas(32) int32_t rotate[8][8];
  RankLanes() {
    for (int m = 0; m < 256; ++m) {
      int k = 0, zero = 0;
      for (int j = 0; j < 8; ++j) {
        if (m >> j & 1) compress[m][k++] = j;
        else zero = j;
      }
      for (; k < 8; ++k) compress[m][k] = zero;
    }
    for (int k = 0; k < 8; ++k)
      for (int i = 0; i < 8; ++i) rotate[k][i] = (i + k) & 7;
  }
};

inline const RankLanes& rank_lanes() {
  static const RankLanes lanes;
  return lanes;
}

// Adds the 8 weights e (zeros where masked) by rank. acc is kept in a moving frame: its lane i holds rank lane
// (count + i) mod 8, so 8 non-zero weights add as they are; fewer are packed to the low lanes (compress), added,
// and the frame moves on by their number (rotate). rank_lane_sum folds the lanes back in rank order.
FV_AVX2_FN inline void add_by_rank(__m256 e, __m256& acc, uint32_t& count) {
  const int m = _mm256_movemask_ps(_mm256_cmp_ps(e, _mm256_setzero_ps(), _CMP_NEQ_UQ));
  if (m == 0xFF) {
    acc = _mm256_add_ps(acc, e);
    count += 8;
    return;
  }
  if (m == 0) return;
  const RankLanes& t = rank_lanes();
  const int k = __builtin_popcount(static_cast<unsigned>(m));
  acc = _mm256_add_ps(acc, _mm256_permutevar8x32_ps(
                               e, _mm256_load_si256(reinterpret_cast<const __m256i*>(t.compress[m]))));
  acc = _mm256_permutevar8x32_ps(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(t.rotate[k])));
  count += static_cast<uint32_t>(k);
}

// The sum of add_by_rank's lanes, rank lane l = frame lane (l - count) mod 8, folded in a fixed order.
FV_AVX2_FN inline float rank_lane_sum(__m256 acc, uint32_t count) {
  alignas(32) float f[8];
  _mm256_store_ps(f, acc);
  float l[8];
  for (int i = 0; i < 8; ++i) l[i] = f[(i - static_cast<int>(count & 7)) & 7];
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

// The same on 8 lanes (exp: torch's expf, sampling::exp8; the tail through weight_exp, the same function); the sum
// by rank of the non-zero weights (add_by_rank), its 8 lanes folded in a fixed order.
FV_AVX2_FN inline void softmax_row_avx2(float* s, const float* mask, int64_t S, float scale, float sink,
                                        bool zero_unseen) {
  const int64_t S8 = S & ~int64_t(7);
  const __m256 sc = _mm256_set1_ps(scale);
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < S8; j += 8) {
    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + j), sc);
    if (mask) x = _mm256_add_ps(x, _mm256_loadu_ps(mask + j));
    _mm256_storeu_ps(s + j, x);
    mv = _mm256_max_ps(mv, x);
  }
  float mx = std::max(sampling::hmax8(mv), sink);
  for (int64_t j = S8; j < S; ++j) {
    s[j] = mask ? s[j] * scale + mask[j] : s[j] * scale;
    mx = std::max(mx, s[j]);
  }
  if (zero_unseen && sees_nothing(s, S, mx)) return std::fill(s, s + S, 0.f);
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  uint32_t count = 0;
  for (int64_t j = 0; j < S8; j += 8) {
    const __m256 e = sampling::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, e);
    add_by_rank(e, acc, count);
  }
  if (S8 < S) {
    alignas(32) float tail[8] = {};
    for (int64_t j = S8; j < S; ++j) tail[j - S8] = s[j] = sampling::weight_exp(s[j] - mx);
    add_by_rank(_mm256_load_ps(tail), acc, count);
  }
  float sum = rank_lane_sum(acc, count);
  if (sink != kNoSink) sum += sampling::weight_exp(sink - mx);
  const float inv = 1.f / sum;
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (int64_t j = 0; j < S8; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv8));
  for (int64_t j = S8; j < S; ++j) s[j] *= inv;
}
#endif

inline void softmax_row(float* s, const float* mask, int64_t S, float scale, float sink, bool zero_unseen) {
#if defined(FV_SAMPLING_AVX2)
  if (sampling::cpu_has_avx2()) return softmax_row_avx2(s, mask, S, scale, sink, zero_unseen);
#endif
  softmax_row_scalar(s, mask, S, scale, sink, zero_unseen);
}

// Row s [S] in place: the soft cap's c * tanh(s * scale / c), in eager attention's steps (scale, divide, tanh,
// multiply; std::tanh, one function for every element).
inline void softcap_row(float* s, int64_t S, float scale, float cap) {
  for (int64_t j = 0; j < S; ++j) s[j] = std::tanh(s[j] * scale / cap) * cap;
}

#ifdef FASTVERIFY_X86
// The 16 lane sums of a[0..15] as one vector (lane i: a[i]'s lanes summed): pairwise unpacks within 128-bit
// blocks, then the blocks transposed and added.
FASTVERIFY_AVX512 inline __m512 reduce16(const __m512* a) {
  // zero-masked forms: GCC 12's unmasked unpacks and shuffles trip -Wmaybe-uninitialized
  constexpr __mmask16 all = 0xFFFF;
  __m512 s2[8], s4[4];
  for (int i = 0; i < 8; ++i)
    s2[i] = _mm512_add_ps(_mm512_maskz_unpacklo_ps(all, a[2 * i], a[2 * i + 1]),
                          _mm512_maskz_unpackhi_ps(all, a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(s2[2 * i]), y = _mm512_castps_pd(s2[2 * i + 1]);
    s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_maskz_unpacklo_pd(0xFF, x, y)),
                          _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(0xFF, x, y)));
  }
  const __m512 x01 = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(all, s4[0], s4[1], 0x44),
                                   _mm512_maskz_shuffle_f32x4(all, s4[0], s4[1], 0xEE));
  const __m512 x23 = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(all, s4[2], s4[3], 0x44),
                                   _mm512_maskz_shuffle_f32x4(all, s4[2], s4[3], 0xEE));
  return _mm512_add_ps(_mm512_maskz_shuffle_f32x4(all, x01, x23, 0x88),
                       _mm512_maskz_shuffle_f32x4(all, x01, x23, 0xDD));
}

// The lane sum of one accumulator in reduce16's order: per 128-bit block (e0 + e2) + (e1 + e3), then the blocks as
// (b0 + b2) + (b1 + b3). So every score has the same rounding whichever tile computed it.
FASTVERIFY_AVX512 inline float reduce1(__m512 a) {
  alignas(64) float l[16];
  _mm512_store_ps(l, a);
  float b[4];
  for (int i = 0; i < 4; ++i) b[i] = (l[4 * i] + l[4 * i + 2]) + (l[4 * i + 1] + l[4 * i + 3]);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// One score q . k (D a multiple of 16): 16 lane sums over D, then reduce1.
FASTVERIFY_AVX512 inline float dot_avx512(const float* q, const float* k, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(k + c), acc);
  return reduce1(acc);
}

// scores [R, S] = q [R, D] k^T for the keys [j0, j1), D a multiple of 16; per score 16 lane sums over D in order,
// then reduce16's fold. Tiles of 4 query rows x 4 keys (16 accumulators: each loaded key vector serves 4 rows), the
// remaining rows 16 keys at a time, the remaining keys one by one.
FASTVERIFY_AVX512 inline void scores_avx512(const float* q, int64_t R, int64_t D, const float* k, int64_t S,
                                            float* out, int64_t j0, int64_t j1) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) {
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < D; c += 16) {
        __m512 qv[4], kv[4];
        for (int i = 0; i < 4; ++i) qv[i] = _mm512_loadu_ps(q + (r + i) * D + c);
        for (int i = 0; i < 4; ++i) kv[i] = _mm512_loadu_ps(k + (j + i) * D + c);
        for (int a = 0; a < 4; ++a)
          for (int b = 0; b < 4; ++b) acc[4 * a + b] = _mm512_fmadd_ps(qv[a], kv[b], acc[4 * a + b]);
      }
      const __m512 sums = reduce16(acc);  // lane 4a + b: row r + a, key j + b
      for (int a = 0; a < 4; ++a)
        _mm_storeu_ps(out + (r + a) * S + j, _mm512_maskz_extractf32x4_ps(0xF, sums, a));
    }
    for (; j < j1; ++j)
      for (int a = 0; a < 4; ++a) out[(r + a) * S + j] = dot_avx512(q + (r + a) * D, k + j * D, D);
  }
  for (; r < R; ++r) {
    const float* qr = q + r * D;
    float* o = out + r * S;
    int64_t j = j0;
    for (; j + 16 <= j1; j += 16) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < D; c += 16) {
        const __m512 qv = _mm512_loadu_ps(qr + c);
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + (j + i) * D + c), acc[i]);
      }
      _mm512_storeu_ps(o + j, reduce16(acc));
    }
    for (; j < j1; ++j) o[j] = dot_avx512(qr, k + j * D, D);
  }
}
#endif

// A gap in the keys: the rows of k and v that a call's S keys occupy are [0, at) and [at + gap, S + gap), key j at
// row j + gap from j = at on (gap 0: the rows [0, S)). The rows of the gap are never read.

// out [R, D] = p [R, S] v, v's rows at stride vs (floats), a gap of `gap` rows after key `at`; per output element
// the sum over keys in order.
inline void pv_scalar(const float* p, int64_t R, int64_t S, const float* v, int64_t vs, int64_t D, float* out,
                      int64_t at, int64_t gap) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.f;
      for (int64_t j = 0; j < at; ++j) acc = std::fma(p[r * S + j], v[j * vs + d], acc);
      for (int64_t j = at; j < S; ++j) acc = std::fma(p[r * S + j], v[(j + gap) * vs + d], acc);
      out[r * D + d] = acc;
    }
}

#ifdef FASTVERIFY_X86
// AVX-512 (D a multiple of 16, at most 128): tiles of up to TR rows x D, each V row loaded once per tile; the same
// fused multiply-adds in the same order as pv_scalar, so the same result.
template <int DV, int TR>
FASTVERIFY_AVX512 inline void pv_tile_avx512(const float* p, int64_t rows, int64_t S, const float* v, int64_t vs,
                                             float* out, int64_t D, int64_t at, int64_t gap, int64_t k0, int64_t k1) {
  __m512 acc[TR][DV];
  for (int r = 0; r < TR; ++r)
    for (int c = 0; c < DV; ++c)
      acc[r][c] = k0 > 0 && r < rows ? _mm512_loadu_ps(out + r * D + 16 * c) : _mm512_setzero_ps();
  for (int part = 0; part < 2; ++part) {  // the keys before the gap, then those after it
    const int64_t j0 = std::max(k0, part ? at : 0), j1 = std::min(k1, part ? S : at);
    const float* vp = part ? v + gap * vs : v;
    for (int64_t j = j0; j < j1; ++j) {
      __m512 vr[DV];
      for (int c = 0; c < DV; ++c) vr[c] = _mm512_loadu_ps(vp + j * vs + 16 * c);
      for (int r = 0; r < TR; ++r) {
        if (r >= rows) break;
        const __m512 pr = _mm512_set1_ps(p[r * S + j]);
        for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_fmadd_ps(pr, vr[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < TR && r < rows; ++r)
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(out + r * D + 16 * c, acc[r][c]);
}

// Keys per pass of a product over `keys` rows of D floats: all of them where one row tile reads them or they fit 256 KB,
// else chunks of 32 KB of rows, which stay in L1 while every row tile reads them.
inline int64_t key_chunk(int64_t keys, int64_t D, bool several_tiles) {
  if (!several_tiles || keys * D * 4 <= (256 << 10)) return std::max<int64_t>(keys, 1);
  return std::max<int64_t>(16, 8192 / D);
}

// Rows in tiles of TR, the keys in passes of key_chunk: every tile through a chunk before the next (the chunk's V
// rows read from L1, not once per tile from memory; each tile's sums carried through `out`, in key order as before,
// so the same result).
template <int DV>
FASTVERIFY_AVX512 inline void pv_avx512(const float* p, int64_t R, int64_t S, const float* v, int64_t vs, float* out,
                                         int64_t at, int64_t gap) {
  constexpr int TR = DV >= 8 ? 2 : 24 / DV;  // TR * DV accumulators + DV V vectors + 1 broadcast <= 32 zmm
  const int64_t chunk = key_chunk(S, 16 * DV, R > TR);
  int64_t k0 = 0;
  do {  // (no key at all: one pass, zeros)
    for (int64_t r = 0; r < R; r += TR)
      pv_tile_avx512<DV, TR>(p + r * S, std::min<int64_t>(TR, R - r), S, v, vs, out + r * 16 * DV, 16 * DV, at, gap,
                             k0, std::min(S, k0 + chunk));
    k0 += chunk;
  } while (k0 < S);
}
#endif

inline void pv(const float* p, int64_t R, int64_t S, const float* v, int64_t vs, int64_t D, float* out, int64_t at,
               int64_t gap) {
#ifdef FASTVERIFY_X86
  if (cpu_has_avx512()) {
    switch (D) {
      case 16: return pv_avx512<1>(p, R, S, v, vs, out, at, gap);
      case 32: return pv_avx512<2>(p, R, S, v, vs, out, at, gap);
      case 48: return pv_avx512<3>(p, R, S, v, vs, out, at, gap);
      case 64: return pv_avx512<4>(p, R, S, v, vs, out, at, gap);
      case 80: return pv_avx512<5>(p, R, S, v, vs, out, at, gap);
      case 96: return pv_avx512<6>(p, R, S, v, vs, out, at, gap);
      case 128: return pv_avx512<8>(p, R, S, v, vs, out, at, gap);
      default: break;
    }
  }
#endif
  pv_scalar(p, R, S, v, vs, D, out, at, gap);
}

// scores [R, S] = q [R, D] k^T for the keys [j0, j1), key j at k's row j + shift; a score's arithmetic is the same
// whichever range holds it.
inline void qk_scores(const float* q, int64_t R, int64_t D, const float* k, int64_t shift, int64_t S, float* out,
                      int64_t j0, int64_t j1) {
  if (j1 <= j0) return;
  k += shift * D;  // the first key's row: row j0 + shift >= 0
#ifdef FASTVERIFY_X86
  if (cpu_has_avx512() && D % 16 == 0) {  // row tiles of 4, the keys in passes of key_chunk
    const int64_t chunk = key_chunk(j1 - j0, D, R > 4);
    for (int64_t c0 = j0; c0 < j1; c0 += chunk) scores_avx512(q, R, D, k, S, out, c0, std::min(j1, c0 + chunk));
    return;
  }
#endif
  linear::skinny_rows(q, k, nullptr, out, R, D, S, j0, j1);
}

// One (batch row, key / value head): q [R, D] (the group's query rows), k [S, D] and v [S, Dv] (row-major; Dv is D
// but for latent attention's narrower values), mask_rows[r] the additive mask row of query row r (or nullptr: no
// mask). softcap: the scores' soft cap (0: none); sinks[r]: query row r's sink logit (or nullptr: none). scores:
// [R, S] scratch; out [R, Dv]. gap > 0: k and v hold S + gap rows, a gap of `gap` rows after key `at` that is never
// read (a tree attention's unused cache slots, which may hold anything).
inline void group(const float* q, int64_t R, int64_t D, const float* k, const float* v, int64_t Dv, int64_t S,
                  const float* const* mask_rows, float scale, float* scores, float* out, float softcap = 0.f,
                  const float* sinks = nullptr, int64_t at = 0, int64_t gap = 0) {
  qk_scores(q, R, D, k, 0, S, scores, 0, gap ? at : S);
  if (gap) qk_scores(q, R, D, k, gap, S, scores, at, S);
  const bool sdpa = softcap == 0.f && !sinks;  // SDPA's softmax; a soft cap or sinks: eager attention's
  for (int64_t r = 0; r < R; ++r) {
    float* row = scores + r * S;
    const float* mask = mask_rows ? mask_rows[r] : nullptr;
    const float sink = sinks ? sinks[r] : kNoSink;
    if (softcap > 0.f) {
      softcap_row(row, S, scale, softcap);
      softmax_row(row, mask, S, 1.f, sink, sdpa);
    } else {
      softmax_row(row, mask, S, scale, sink, sdpa);
    }
  }
  pv(scores, R, S, v, Dv, Dv, out, at, gap);
}

}  // namespace attention
}  // namespace fastverify

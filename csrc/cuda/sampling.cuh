// Row-level sampling machinery for the CUDA kernels: one CTA of BLOCK threads works on one logits row of V
// entries, or on one segment of kSegment tokens of it. Used by cdf_sample / cdf_invert (csrc/cuda/sampling.cu) and
// by verify's sampling rules (csrc/cuda/verify.cu). Semantics: fastverify/reference/sampling.py (module docstring,
// steps 1-5).
//
// No sort: the top-k threshold (the k-th largest l / T) is found by a radix select over the 32-bit ordered keys of
// the scaled logits (four histogram passes); the top-p threshold, when top-k keeps few tokens, from their weights
// gathered into shared memory, else by a binary search over the float bits of w in [0, 1] (float64 mass strictly
// above the candidate, ~30 block reductions): pivot searches in the spirit of FlashInfer's sorting-free samplers,
// exact rather than approximate; the passes read the row 16 bytes per load (for_each_owned, common.cuh). The inverse
// CDF uses float64 prefix sums in token-id order, segment by segment (segment_walk below defines C exactly);
// cdf_sample, cdf_invert and verify evaluate C with the same functions, so cdf_sample(cdf_invert(t)) == t and
// verify's draws are cdf_sample's.
//
// Every helper must be called by all threads of the CTA (they synchronise).
#pragma once

#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cmath>
#include <cstdint>

#include "common.cuh"

namespace fastverify {
namespace cuda {

// ---- block reductions (result broadcast to every thread) -----------------------------------------------------

struct SumOp {
  template <typename T>
  __device__ T operator()(const T& a, const T& b) const { return a + b; }
};
struct MinOp {
  template <typename T>
  __device__ T operator()(const T& a, const T& b) const { return b < a ? b : a; }
};
struct MaxOp {
  template <typename T>
  __device__ T operator()(const T& a, const T& b) const { return a < b ? b : a; }
};

// op over the CTA's x, returned to every thread. One shared scratch per (type, op) instantiation, rewritten only
// after the trailing barrier, so calls may follow one another directly.
template <int BLOCK, typename V, typename Op>
__device__ V block_reduce(V x, Op op) {
  using R = cub::BlockReduce<V, BLOCK>;
  __shared__ typename R::TempStorage ts;
  __shared__ V out;
  const V r = R(ts).Reduce(x, op);
  if (threadIdx.x == 0) out = r;
  __syncthreads();
  const V res = out;
  __syncthreads();
  return res;
}
template <int BLOCK>
__device__ double block_sum(double x) { return block_reduce<BLOCK>(x, SumOp()); }
template <int BLOCK>
__device__ long long block_sum_ll(long long x) { return block_reduce<BLOCK>(x, SumOp()); }

// (value, index) with the larger value winning and, among equal values, the lower index (argmax semantics).
struct ArgMax {
  float v;
  long long i;
};
struct ArgMaxOp {
  __device__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    if (a.v > b.v) return a;
    if (b.v > a.v) return b;
    return a.i <= b.i ? a : b;
  }
};

template <int BLOCK>
__device__ ArgMax block_argmax(ArgMax x) { return block_reduce<BLOCK>(x, ArgMaxOp()); }

// ---- per-row statistics of the raw logits ------------------------------------------------------------------------

// Ordered 32-bit key of a non-NaN float: key(a) < key(b) iff a < b; -0.0 and +0.0 share a key (they compare equal).
__device__ __forceinline__ uint32_t ordered_key(float x) {
  uint32_t u = __float_as_uint(x);
  if (u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct RawRowStats {
  bool bad;            // NaN or +inf somewhere
  float max;           // max over the row (-inf if every entry is -inf)
  long long argmax;    // lowest id holding max
};

// Max (lowest id among equal maxima; {-inf, lowest id} when every entry is -inf; id kNoToken when n == 0 or every
// entry is NaN / +inf) and NaN / +inf flag of the n entries at p, ids offset by `first`.
constexpr long long kNoToken = 0x7fffffffffffffffLL;

template <int BLOCK, typename T>
__device__ ArgMax raw_partial(const T* p, int64_t n, int64_t first, bool* bad_out) {
  ArgMax best{-INFINITY, kNoToken};
  long long bad = 0;
  for_each_owned<BLOCK>(p, n, [&](int64_t v, float x) {
    if (isnan(x) || x == INFINITY) {
      bad = 1;
    } else if (x > best.v || (x == best.v && first + v < best.i)) {
      best = ArgMax{x, first + v};
    }
  });
  *bad_out = block_sum_ll<BLOCK>(bad) > 0;
  return block_argmax<BLOCK>(best);
}

__device__ __forceinline__ RawRowStats stats_from_partial(ArgMax best, bool bad) {
  RawRowStats s;
  s.bad = bad;
  s.max = best.v;
  s.argmax = best.i == kNoToken ? 0 : best.i;
  return s;
}

template <int BLOCK, typename T>
__device__ RawRowStats raw_row_stats(const T* row, int64_t V) {
  bool bad;
  const ArgMax best = raw_partial<BLOCK>(row, V, 0, &bad);
  return stats_from_partial(best, bad);
}

// ---- warping (reference steps 1-5) -------------------------------------------------------------------------------

// The resolved warp of one row: weight(v) is the reference's warp_weights entry for token v.
struct RowWarp {
  bool valid;       // false: no distribution (NaN / +inf, all -inf, or l / T overflowing)
  bool greedy;      // temperature 0: one-hot at argmax
  long long argmax;
  float T;          // temperature (> 0 unless greedy)
  float m;          // max of l / T
  bool use_k;
  uint32_t k_key;   // keep l / T with ordered_key >= k_key
  bool use_p;
  float p_min_w;    // keep w >= p_min_w (top-p threshold)
  float min_p;      // keep w >= min_p
};

// w before the top-p and min-p filters (steps 1, 2, 5); 0 for tokens dropped by top-k.
__device__ __forceinline__ float weight_topk_of(float x, const RowWarp& w) {
  const float l = __fdiv_rn(x, w.T);  // a division, as the reference
  if (w.use_k && ordered_key(l) < w.k_key) return 0.0f;
  return expf(__fsub_rn(l, w.m));
}
template <typename T>
__device__ __forceinline__ float weight_topk(const T* row, int64_t v, const RowWarp& w) {
  return weight_topk_of(load_as_float(row + v), w);
}

template <typename T>
__device__ __forceinline__ float row_weight(const T* row, int64_t v, const RowWarp& w) {
  if (!w.valid) return 0.0f;
  if (w.greedy) return v == w.argmax ? 1.0f : 0.0f;
  const float x = weight_topk(row, v, w);
  if (w.use_p && !(x >= w.p_min_w)) return 0.0f;
  if (!(x >= w.min_p)) return 0.0f;
  return x;
}

// The warp of a row from its raw statistics, before the top-k / top-p thresholds (use_k = use_p = false): every
// thread computes the same from the same values, without synchronising.
__device__ __forceinline__ RowWarp warp_from_stats(const RawRowStats& s, float temperature, float min_p) {
  RowWarp w;
  w.argmax = s.argmax;
  w.greedy = temperature == 0.0f;
  w.T = w.greedy ? 1.0f : temperature;
  w.valid = !s.bad && s.max != -INFINITY;
  w.m = __fdiv_rn(s.max, w.T);  // x / T is monotone in x, so max(x / T) = max(x) / T
  if (!w.greedy && w.m == INFINITY) w.valid = false;
  w.use_k = false;
  w.k_key = 0;
  w.use_p = false;
  w.p_min_w = 0.0f;
  w.min_p = w.greedy ? 0.0f : min_p;
  return w;
}

// top_k as a count, truncated like the reference's .to(int64) (NaN: 0, off).
__device__ __forceinline__ long long topk_count(float top_k) {
  return isnan(top_k) ? 0 : static_cast<long long>(top_k);
}

// Whether a row's warp needs the top-k or top-p threshold (a search over the whole row).
__device__ __forceinline__ bool warp_needs_thresholds(int64_t V, float top_k, float top_p) {
  const long long k = topk_count(top_k);
  return (k > 0 && k < V) || top_p < 1.0f;
}

// The key of the k-th largest l' = l / T (0 < k < V): a radix select, 8 bits a pass from the top. Each pass counts
// the next digit of the keys that match the digits chosen so far (a shared histogram; lanes of a warp that hit the
// same bin add once) and takes the largest digit j with #{keys above the prefix} + #{digit >= j} >= k. Four passes
// over the row; the result is the largest K with #{key(l') >= K} >= k, i.e. exactly the k-th largest key.
template <int BLOCK, typename T>
__device__ uint32_t kth_largest_key(const T* row, int64_t V, float temp, long long k) {
  __shared__ unsigned int hist[256];
  __shared__ uint32_t s_digit;
  __shared__ long long s_above;
  uint32_t prefix = 0, mask = 0;
  long long kk = k;  // rank still to find among the keys that match the prefix (their count is >= kk)
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += BLOCK) hist[i] = 0;
    __syncthreads();
    for_each_owned<BLOCK>(row, V, [&](int64_t, float x) {
      const uint32_t key = ordered_key(__fdiv_rn(x, temp));
      if ((key & mask) == prefix) {
        const unsigned bin = (key >> shift) & 255u;
        const auto peers = cooperative_groups::labeled_partition(cooperative_groups::coalesced_threads(), bin);
        if (peers.thread_rank() == 0) atomicAdd(&hist[bin], peers.size());
      }
    });
    __syncthreads();
    if (threadIdx.x == 0) {
      long long above = 0;
      int j = 255;
      for (; j > 0 && above + hist[j] < kk; --j) above += hist[j];
      s_digit = static_cast<uint32_t>(j);
      s_above = above;
    }
    __syncthreads();
    prefix |= s_digit << shift;
    mask |= 255u << shift;
    kk -= s_above;
    __syncthreads();  // hist, s_digit and s_above are rewritten by the next pass
  }
  return prefix;
}

// top-p's threshold X when top-k keeps few tokens (<= kKeptCap): their weights are gathered into shared memory in
// for_each_owned order (a block scan of per-thread counts, so the same order every call), Z_k = their float64 sum in
// that order, and X = the smallest kept weight w_i with G(w_i) < p * Z_k (G is constant between kept weights, so
// the smallest float with G(X) < p * Z_k is one of them). Sets w->p_min_w and returns true; returns false (nothing
// set) when more than kKeptCap tokens tie into the top-k set.
constexpr int kKeptCap = 2048;

template <int BLOCK, typename T>
__device__ bool top_p_from_kept(const T* row, int64_t V, float top_p, RowWarp* wp) {
  using Scan = cub::BlockScan<int, BLOCK>;
  __shared__ typename Scan::TempStorage ts;
  __shared__ float kept[kKeptCap];
  __shared__ double s_zk;
  const RowWarp w = *wp;
  auto is_kept = [&](float x) { return ordered_key(__fdiv_rn(x, w.T)) >= w.k_key; };
  int mine = 0, off = 0, n = 0;
  for_each_owned<BLOCK>(row, V, [&](int64_t, float x) { mine += is_kept(x); });
  Scan(ts).ExclusiveSum(mine, off, n);
  __syncthreads();
  if (n > kKeptCap) return false;  // n is the same for every thread
  for_each_owned<BLOCK>(row, V, [&](int64_t, float x) {
    if (is_kept(x)) kept[off++] = weight_topk_of(x, w);
  });
  __syncthreads();
  if (threadIdx.x == 0) {
    double zk = 0.0;
    for (int i = 0; i < n; ++i) zk += kept[i];
    s_zk = zk;
  }
  __syncthreads();
  const double target = static_cast<double>(top_p) * s_zk;
  float x_min = INFINITY;  // nothing is kept when p * Z_k <= 0 (as the reference)
  if (target > 0.0) {
    for (int i = threadIdx.x; i < n; i += BLOCK) {
      double g = 0.0;
      for (int j = 0; j < n; ++j) g += kept[j] > kept[i] ? static_cast<double>(kept[j]) : 0.0;
      if (g < target) x_min = fminf(x_min, kept[i]);
    }
  }
  wp->p_min_w = block_reduce<BLOCK>(x_min, MinOp());  // its trailing barrier also ends the reads of kept / s_zk
  return true;
}

// The top-k and top-p thresholds of a row (top_k as float, truncated like the reference's .to(int64)) into the
// warp w that warp_from_stats gave it (valid, not greedy). All threads must call it; all get the same result.
template <int BLOCK, typename T>
__device__ void resolve_thresholds(const T* row, int64_t V, float top_k, float top_p, RowWarp& w) {
  // top-k: the key of the k-th largest l' (kth_largest_key).
  const long long k = topk_count(top_k);
  if (k > 0 && k < V) {
    w.use_k = true;
    w.k_key = kth_largest_key<BLOCK>(row, V, w.T, k);
  }

  // top-p: keep i iff G(w_i) < p * Z_k with G(x) = sum_{w_j > x} w_j over the top-k-kept set. G is
  // non-increasing, so the kept set is {w_i >= X} for the smallest float X in [0, 1] with G(X) < p * Z_k.
  if (top_p < 1.0f) {
    w.use_p = true;
    if (w.use_k && top_p_from_kept<BLOCK>(row, V, top_p, &w)) return;
    double zk = 0.0;
    for_each_owned<BLOCK>(row, V, [&](int64_t, float x) { zk += weight_topk_of(x, w); });
    zk = block_sum<BLOCK>(zk);
    const double target = static_cast<double>(top_p) * zk;
    if (!(target > 0.0)) {
      w.p_min_w = INFINITY;  // nothing is kept (the reference drops every token when p * Z_k <= 0)
    } else {
      // G(1.0f) = 0 < target: hi is true. lo = -1 stands for "below 0", false by convention.
      long long lo = -1, hi = static_cast<long long>(__float_as_uint(1.0f));
      while (hi - lo > 1) {
        const long long mid = lo + (hi - lo) / 2;
        const float x = __uint_as_float(static_cast<uint32_t>(mid));
        double g = 0.0;
        for_each_owned<BLOCK>(row, V, [&](int64_t, float l) {
          const float wv = weight_topk_of(l, w);
          if (wv > x) g += wv;
        });
        if (block_sum<BLOCK>(g) < target) hi = mid; else lo = mid;
      }
      w.p_min_w = __uint_as_float(static_cast<uint32_t>(hi));
    }
  }
}

// Resolve the warp of one row: temperature, top_k, top_p, min_p. All threads must call it; all get the same result.
template <int BLOCK, typename T>
__device__ RowWarp resolve_warp(const T* row, int64_t V, float temperature, float top_k, float top_p, float min_p) {
  RowWarp w = warp_from_stats(raw_row_stats<BLOCK>(row, V), temperature, min_p);
  if (w.valid && !w.greedy) resolve_thresholds<BLOCK>(row, V, top_k, top_p, w);
  return w;
}

// ---- float64 prefix sums in token-id order ----------------------------------------------------------------------

// C is defined segment by segment. A row splits into segments of kSegment tokens; within segment s the walk below
// gives c_s(v), the float64 sum of the weights from the segment's first token to v; the segment totals are added in
// order, P_s = total_0 + ... + total_{s-1}; then C(v) = P_s + c_s(v) and Z = P_S (= C(V - 1)). One CTA may walk a
// whole row, or one CTA per segment may walk the segments in parallel (cdf_sample / cdf_invert) and a last CTA
// combine their totals: both evaluate the same expression, so cdf_sample, cdf_invert and verify's sampling rules
// draw from the same C, and cdf_sample(cdf_invert(t)) == t.
//
// The walk of a segment goes in chunks of BLOCK * kScanItems tokens: thread i owns the kScanItems consecutive tokens
// base + i * kScanItems + k. Per chunk: the weights w (float64, 0 past the segment), each thread's sequential sum,
// one cub::BlockScan of those sums (excl), then, per thread, r = carry + excl and c(v) = (r += w(v)) token by token;
// carry becomes c of the chunk's last token. c is non-decreasing within a thread but need not be across threads to
// the last ulp; the searches below therefore use the maximum of C over a range (rounding of P_s + c is monotone in
// c, so that maximum is P_s + the maximum of c_s), and cdf_invert bounds u * Z below by the maximum of C over all
// earlier tokens.
constexpr int kScanItems = 8;
constexpr int64_t kSegment = 8192;

// Walk of the tokens [begin, end) of one segment, carry from 0. visit(v, c, w_v) is called for each owned token (no
// synchronisation allowed); chunk_done() is called by every thread after each chunk (it may synchronise) and
// returns true, block-uniformly, to stop the walk. Returns the carry after the last chunk walked (the segment's
// total when the walk ran to its end).
template <int BLOCK, typename WeightFn, typename VisitFn, typename DoneFn>
__device__ double segment_walk(int64_t begin, int64_t end, WeightFn weight, VisitFn visit, DoneFn chunk_done) {
  using Scan = cub::BlockScan<double, BLOCK>;
  __shared__ typename Scan::TempStorage ts;
  __shared__ double last_c;
  constexpr int64_t kChunk = static_cast<int64_t>(BLOCK) * kScanItems;
  static_assert(kSegment % kChunk == 0, "a segment holds whole chunks");
  double carry = 0.0;
  for (int64_t base = begin; base < end; base += kChunk) {
    const int64_t v0 = base + static_cast<int64_t>(threadIdx.x) * kScanItems;
    const int64_t last = (end - base < kChunk ? end : base + kChunk) - 1;  // the chunk's last real token
    double w[kScanItems];
    double local = 0.0;
#pragma unroll
    for (int k = 0; k < kScanItems; ++k) {
      w[k] = v0 + k < end ? weight(v0 + k) : 0.0;
      local += w[k];
    }
    double excl;
    Scan(ts).ExclusiveSum(local, excl);
    double r = carry + excl;
#pragma unroll
    for (int k = 0; k < kScanItems; ++k) {
      r += w[k];
      if (v0 + k < end) visit(v0 + k, r, w[k]);
      if (v0 + k == last) last_c = r;
    }
    __syncthreads();
    carry = last_c;
    const bool stop = chunk_done();
    __syncthreads();  // ts and last_c are rewritten by the next chunk
    if (stop) return carry;
  }
  return carry;
}

// One segment's total, the maximum of its c (0 for an empty or all-zero segment) and its last token with w > 0
// (-1 if none).
struct SegmentStats {
  double total, cmax;
  long long last;
};

template <int BLOCK, typename WeightFn>
__device__ SegmentStats segment_stats(int64_t begin, int64_t end, WeightFn weight) {
  double cmax = 0.0;
  long long last = -1;
  SegmentStats st;
  st.total = segment_walk<BLOCK>(
      begin, end, weight,
      [&](int64_t v, double c, double wv) {
        cmax = fmax(cmax, c);
        if (wv > 0.0) last = v;
      },
      [] { return false; });
  st.cmax = block_reduce<BLOCK>(cmax, MaxOp());
  st.last = block_reduce<BLOCK>(last, MaxOp());
  return st;
}

// The smallest v in [begin, end) with P + c(v) > target, kNoToken if none; the walk stops after the chunk holding it.
template <int BLOCK, typename WeightFn>
__device__ long long segment_search(int64_t begin, int64_t end, WeightFn weight, double P, double target) {
  long long cand = kNoToken, found = kNoToken;
  segment_walk<BLOCK>(
      begin, end, weight, [&](int64_t v, double c, double) { if (cand == kNoToken && P + c > target) cand = v; },
      [&] {
        found = block_reduce<BLOCK>(cand, MinOp());
        return found != kNoToken;
      });
  return found;
}

// C(t - 1)'s bound, C(t) and w(t) of token t in [begin, end), from a walk of t's segment: c_lo = the maximum of
// P + c over the segment's tokens before t (and of c_lo_in), c_hi = P + c(t). All threads get the results; returns
// the segment's total.
template <int BLOCK, typename WeightFn>
__device__ double segment_bin(int64_t begin, int64_t end, WeightFn weight, double P, long long t, double c_lo_in,
                            double* c_lo, double* c_hi, double* w_t) {
  double lo = c_lo_in, hi = -1.0, wt = -1.0;
  const double total = segment_walk<BLOCK>(
      begin, end, weight,
      [&](int64_t v, double c, double wv) {
        if (v < t) lo = fmax(lo, P + c);
        if (v == t) {
          hi = P + c;
          wt = wv;
        }
      },
      [] { return false; });
  *c_lo = block_reduce<BLOCK>(lo, MaxOp());
  *c_hi = block_reduce<BLOCK>(hi, MaxOp());  // only t's owner holds a value >= 0
  *w_t = block_reduce<BLOCK>(wt, MaxOp());
  return total;
}

__host__ __device__ __forceinline__ int64_t num_segments(int64_t V) { return (V + kSegment - 1) / kSegment; }
// One past segment s's last token.
__device__ __forceinline__ int64_t segment_end(int64_t s, int64_t V) { return min(V, (s + 1) * kSegment); }

// The segment holding a draw: the first s with P_s + cmax_s > target (every C before it is <= target), with its
// P_s; -1 if none. total / cmax: the S segments' values (every thread reads the same).
__device__ __forceinline__ int find_segment(const double* total, const double* cmax, int64_t S, double target,
                                            double* P_out) {
  double P = 0.0;
  for (int64_t s = 0; s < S; ++s) {
    if (P + cmax[s] > target) {
      *P_out = P;
      return static_cast<int>(s);
    }
    P += total[s];
  }
  *P_out = P;
  return -1;
}

__device__ __forceinline__ double sum_in_order(const double* total, int64_t S) {
  double z = 0.0;
  for (int64_t s = 0; s < S; ++s) z += total[s];
  return z;
}

// Inverse-CDF draw by one CTA: the smallest t with C(t) > u * Z; the last token with w > 0 if rounding leaves none;
// -1 if Z == 0. One walk over the row gives each segment's total and maximum (kept in shared memory for the first
// kMaxSegments segments, walked again for later ones), then only the segment holding t is walked again.
constexpr int kMaxSegments = 64;

template <int BLOCK, typename WeightFn>
__device__ long long inverse_cdf_sample(int64_t V, WeightFn weight, double u) {
  __shared__ double seg_total[kMaxSegments], seg_cmax[kMaxSegments];
  const int64_t S = num_segments(V);
  auto stats_of = [&](int64_t s) {
    return segment_stats<BLOCK>(s * kSegment, segment_end(s, V), weight);
  };
  double z = 0.0;
  long long last = -1;
  for (int64_t s = 0; s < S; ++s) {
    const SegmentStats st = stats_of(s);
    if (s < kMaxSegments && threadIdx.x == 0) {
      seg_total[s] = st.total;
      seg_cmax[s] = st.cmax;
    }
    z += st.total;
    last = max(last, st.last);
  }
  __syncthreads();
  if (!(z > 0.0)) return -1;
  const double target = u * z;
  double P = 0.0;
  int64_t hit = find_segment(seg_total, seg_cmax, S < kMaxSegments ? S : kMaxSegments, target, &P);
  for (int64_t s = kMaxSegments; hit < 0 && s < S; ++s) {  // rows of more than kMaxSegments segments only
    const SegmentStats st = stats_of(s);
    if (P + st.cmax > target) hit = s; else P += st.total;
  }
  __syncthreads();  // seg_total / seg_cmax are rewritten by the next call
  if (hit < 0) return last;
  const long long t = segment_search<BLOCK>(hit * kSegment, segment_end(hit, V), weight, P, target);
  return t != kNoToken ? t : last;
}

// cdf_invert of token t with v_aux in (0, 1): u = (C(t - 1) + v * w(t)) / Z, nudged by float64 ulps until
// C(t - 1) <= u * Z < C(t), clamped to (0, 1); NaN when w(t) = 0, C(t) == C(t - 1), Z == 0, or no u lands.
// Single-thread arithmetic on values every thread holds (no synchronisation inside the nudge loop).
__device__ __forceinline__ double invert_from_bin(double c_lo, double c_hi, double w_t, double z, double v_aux) {
  const double nan = __longlong_as_double(0x7ff8000000000000LL);
  if (!(z > 0.0) || !(w_t > 0.0)) return nan;
  // __dmul_rn / __dadd_rn / __ddiv_rn: no FMA contraction, the same roundings as the reference.
  double u = __ddiv_rn(__dadd_rn(c_lo, __dmul_rn(v_aux, w_t)), z);
  const double tiny = 2.2250738585072014e-308, below_one = 1.0 - 0x1p-53;
  u = fmin(fmax(u, tiny), below_one);
  for (int it = 0; it < 64; ++it) {
    const double prod = __dmul_rn(u, z);
    const bool low = prod < c_lo, high = prod >= c_hi;
    if (!low && !high) break;
    u = low ? nextafter(u, 1.0) : nextafter(u, 0.0);
  }
  const double prod = __dmul_rn(u, z);
  const bool ok = (c_hi > c_lo) && (prod >= c_lo) && (prod < c_hi) && (u > 0.0) && (u < 1.0);
  return ok ? u : nan;
}

}  // namespace cuda
}  // namespace fastverify

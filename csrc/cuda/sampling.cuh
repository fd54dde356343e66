// Row-level sampling machinery for the CUDA kernels: one CTA of BLOCK threads works on one logits row of V
// entries. Used by cdf_sample / cdf_invert (csrc/cuda/sampling.cu) and by verify's sampling rules
// (csrc/cuda/verify.cu). Semantics: fastverify/reference/sampling.py (module docstring, steps 1-5).
//
// No sort: the top-k threshold (the k-th largest l / T) is found by a binary search over the 32-bit ordered
// keys of the scaled logits (count of l' >= key, 32 block reductions), the top-p threshold by a binary search
// over the float bits of w in [0, 1] (float64 mass strictly above the candidate, ~30 block reductions): pivot
// searches in the spirit of FlashInfer's sorting-free samplers, exact rather than fast; the passes read the row
// 16 bytes per load (for_each_owned, common.cuh). The inverse CDF uses float64 prefix sums in token-id order
// (prefix_walk below defines C exactly); cdf_sample and cdf_invert evaluate C with the same function, so
// cdf_sample(cdf_invert(t)) == t.
//
// Every helper must be called by all threads of the CTA (they synchronise).
#pragma once

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

template <int BLOCK, typename T>
__device__ RawRowStats raw_row_stats(const T* row, int64_t V) {
  ArgMax best{-INFINITY, 0x7fffffffffffffffLL};
  long long bad = 0;
  for_each_owned<BLOCK>(row, V, [&](int64_t v, float x) {
    if (isnan(x) || x == INFINITY) {
      bad = 1;
    } else if (x > best.v || (x == best.v && v < best.i)) {
      best = ArgMax{x, v};
    }
  });
  const ArgMax r = block_argmax<BLOCK>(best);
  const long long nbad = block_sum_ll<BLOCK>(bad);
  RawRowStats s;
  s.bad = nbad > 0;
  s.max = r.v;
  s.argmax = r.i == 0x7fffffffffffffffLL ? 0 : r.i;
  return s;
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

// Resolve the warp of one row: temperature, top_k (as float, truncated like the reference's .to(int64)),
// top_p, min_p. All threads must call it; all get the same result.
template <int BLOCK, typename T>
__device__ RowWarp resolve_warp(const T* row, int64_t V, float temperature, float top_k, float top_p, float min_p) {
  RowWarp w;
  const RawRowStats s = raw_row_stats<BLOCK>(row, V);
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
  if (!w.valid || w.greedy) return w;

  // top-k: the largest key K with #{v : key(l'_v) >= K} >= k is the key of the k-th largest l'.
  const long long k = isnan(top_k) ? 0 : static_cast<long long>(top_k);
  if (k > 0 && k < V) {
    unsigned long long lo = 0, hi = 0x100000000ull;  // count(lo) = V >= k; count(hi) = 0 < k
    while (hi - lo > 1) {
      const unsigned long long mid = lo + (hi - lo) / 2;
      long long c = 0;
      for_each_owned<BLOCK>(row, V, [&](int64_t, float x) {
        c += ordered_key(__fdiv_rn(x, w.T)) >= static_cast<uint32_t>(mid);
      });
      if (block_sum_ll<BLOCK>(c) >= k) lo = mid; else hi = mid;
    }
    w.use_k = true;
    w.k_key = static_cast<uint32_t>(lo);
  }

  // top-p: keep i iff G(w_i) < p * Z_k with G(x) = sum_{w_j > x} w_j over the top-k-kept set. G is
  // non-increasing, so the kept set is {w_i >= X} for the smallest float X in [0, 1] with G(X) < p * Z_k.
  if (top_p < 1.0f) {
    double zk = 0.0;
    for_each_owned<BLOCK>(row, V, [&](int64_t, float x) { zk += weight_topk_of(x, w); });
    zk = block_sum<BLOCK>(zk);
    const double target = static_cast<double>(top_p) * zk;
    w.use_p = true;
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
  return w;
}

// ---- float64 prefix sums in token-id order ----------------------------------------------------------------------

// The walk over a row in chunks of BLOCK * kScanItems tokens: thread i owns the kScanItems consecutive tokens
// base + i * kScanItems + k. Per chunk: the weights w (float64, 0 past V), each thread's sequential sum, one
// cub::BlockScan of those sums (excl), then, per thread, r = carry + excl and C(v) = (r += w(v)) token by token;
// carry becomes C of the chunk's last token. That expression *is* C (cdf_sample and cdf_invert both evaluate it
// through this function, with the same BLOCK), Z = C(V - 1). It is non-decreasing within a thread but need not be
// across threads to the last ulp, so cdf_invert bounds u * Z below by the maximum of C over all earlier tokens.
//
// visit(v, c_incl, w_v) is called for each owned token v < V (no synchronisation allowed); chunk_done() is called
// by every thread after each chunk (it may synchronise) and returns true, block-uniformly, to stop the walk.
// Returns the carry after the last chunk walked (Z when the walk ran to the end).
constexpr int kScanItems = 8;

template <int BLOCK, typename WeightFn, typename VisitFn, typename DoneFn>
__device__ double prefix_walk(int64_t V, WeightFn weight, VisitFn visit, DoneFn chunk_done) {
  using Scan = cub::BlockScan<double, BLOCK>;
  __shared__ typename Scan::TempStorage ts;
  __shared__ double last_c;
  constexpr int64_t kChunk = static_cast<int64_t>(BLOCK) * kScanItems;
  double carry = 0.0;
  for (int64_t base = 0; base < V; base += kChunk) {
    const int64_t v0 = base + static_cast<int64_t>(threadIdx.x) * kScanItems;
    const int64_t last = (V - base < kChunk ? V : base + kChunk) - 1;  // the chunk's last real token
    double w[kScanItems];
    double local = 0.0;
#pragma unroll
    for (int k = 0; k < kScanItems; ++k) {
      w[k] = v0 + k < V ? weight(v0 + k) : 0.0;
      local += w[k];
    }
    double excl;
    Scan(ts).ExclusiveSum(local, excl);
    double r = carry + excl;
#pragma unroll
    for (int k = 0; k < kScanItems; ++k) {
      r += w[k];
      if (v0 + k < V) visit(v0 + k, r, w[k]);
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

// Sum of a row's weights in the walk's order: Z = C(V - 1); also the last token with w > 0 (-1 if none).
template <int BLOCK, typename WeightFn>
__device__ double prefix_total(int64_t V, WeightFn weight, long long* last_pos) {
  long long lp = -1;
  const double z = prefix_walk<BLOCK>(
      V, weight, [&](int64_t v, double, double wv) { if (wv > 0.0) lp = v; }, [] { return false; });
  *last_pos = block_reduce<BLOCK>(lp, MaxOp());
  return z;
}

// Inverse-CDF draw: the smallest t with C(t) > u * Z; the last token with w > 0 if rounding leaves none; -1 if
// Z == 0. Two walks (Z first, then the search, which stops after the chunk holding t).
template <int BLOCK, typename WeightFn>
__device__ long long inverse_cdf_sample(int64_t V, WeightFn weight, double u) {
  constexpr long long kNone = 0x7fffffffffffffffLL;
  long long last_pos;
  const double z = prefix_total<BLOCK>(V, weight, &last_pos);
  if (!(z > 0.0)) return -1;
  const double target = u * z;
  long long cand = kNone, found = kNone;
  prefix_walk<BLOCK>(
      V, weight, [&](int64_t v, double c_incl, double) { if (cand == kNone && c_incl > target) cand = v; },
      [&] {
        found = block_reduce<BLOCK>(cand, MinOp());
        return found != kNone;
      });
  return found != kNone ? found : last_pos;
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

template <int BLOCK, typename WeightFn>
__device__ double inverse_cdf_invert(int64_t V, WeightFn weight, long long t, double v_aux) {
  double c_lo = 0.0, c_hi = -1.0, w_t = -1.0;  // c_lo: max of C over the tokens before t (and 0)
  const double z = prefix_walk<BLOCK>(
      V, weight,
      [&](int64_t v, double c_incl, double wv) {
        if (v < t) c_lo = fmax(c_lo, c_incl);
        if (v == t) {
          c_hi = c_incl;
          w_t = wv;
        }
      },
      [] { return false; });
  c_lo = block_reduce<BLOCK>(c_lo, MaxOp());
  c_hi = block_reduce<BLOCK>(c_hi, MaxOp());  // only t's owner holds a value >= 0
  w_t = block_reduce<BLOCK>(w_t, MaxOp());
  return invert_from_bin(c_lo, c_hi, w_t, z, v_aux);
}

}  // namespace cuda
}  // namespace fastverify

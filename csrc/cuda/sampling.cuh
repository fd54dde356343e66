// Row-level sampling machinery for the CUDA kernels: one CTA of BLOCK threads works on one logits row of V
// entries. Used by cdf_sample / cdf_invert (csrc/cuda/sampling.cu) and by verify's sampling rules
// (csrc/cuda/verify.cu). Semantics: fastverify/reference/sampling.py (module docstring, steps 1-5).
//
// No sort: the top-k threshold (the k-th largest l / T) is found by a binary search over the 32-bit ordered
// keys of the scaled logits (count of l' >= key, 32 block reductions), the top-p threshold by a binary search
// over the float bits of w in [0, 1] (float64 mass strictly above the candidate, ~30 block reductions): pivot
// searches in the spirit of FlashInfer's sorting-free samplers, exact rather than fast. The inverse CDF uses
// float64 prefix sums in token-id order computed chunk by chunk with cub::BlockScan; C(t) is defined as
// carry + (inclusive scan within the chunk), the carry being C of the chunk's last element, and Z = C(V - 1).
// cdf_sample and cdf_invert evaluate C with the same function, so cdf_sample(cdf_invert(t)) == t.
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

template <int BLOCK>
__device__ double block_sum(double x) {
  using R = cub::BlockReduce<double, BLOCK>;
  __shared__ typename R::TempStorage ts;
  __shared__ double out;
  const double r = R(ts).Sum(x);
  if (threadIdx.x == 0) out = r;
  __syncthreads();
  const double res = out;
  __syncthreads();  // ts and out may be reused by the next call
  return res;
}

template <int BLOCK>
__device__ long long block_sum_ll(long long x) {
  using R = cub::BlockReduce<long long, BLOCK>;
  __shared__ typename R::TempStorage ts;
  __shared__ long long out;
  const long long r = R(ts).Sum(x);
  if (threadIdx.x == 0) out = r;
  __syncthreads();
  const long long res = out;
  __syncthreads();
  return res;
}

struct MinOp {
  template <typename T>
  __device__ T operator()(const T& a, const T& b) const { return b < a ? b : a; }
};
struct MaxOp {
  template <typename T>
  __device__ T operator()(const T& a, const T& b) const { return a < b ? b : a; }
};

template <int BLOCK>
__device__ long long block_min_ll(long long x) {
  using R = cub::BlockReduce<long long, BLOCK>;
  __shared__ typename R::TempStorage ts;
  __shared__ long long out;
  const long long r = R(ts).Reduce(x, MinOp());
  if (threadIdx.x == 0) out = r;
  __syncthreads();
  const long long res = out;
  __syncthreads();
  return res;
}

template <int BLOCK>
__device__ long long block_max_ll(long long x) {
  using R = cub::BlockReduce<long long, BLOCK>;
  __shared__ typename R::TempStorage ts;
  __shared__ long long out;
  const long long r = R(ts).Reduce(x, MaxOp());
  if (threadIdx.x == 0) out = r;
  __syncthreads();
  const long long res = out;
  __syncthreads();
  return res;
}

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
__device__ ArgMax block_argmax(ArgMax x) {
  using R = cub::BlockReduce<ArgMax, BLOCK>;
  __shared__ typename R::TempStorage ts;
  __shared__ ArgMax out;
  const ArgMax r = R(ts).Reduce(x, ArgMaxOp());
  if (threadIdx.x == 0) out = r;
  __syncthreads();
  const ArgMax res = out;
  __syncthreads();
  return res;
}

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
  for (int64_t v = threadIdx.x; v < V; v += BLOCK) {
    const float x = load_as_float(row + v);
    if (isnan(x) || x == INFINITY) {
      bad = 1;
      continue;
    }
    if (x > best.v || (x == best.v && v < best.i)) best = ArgMax{x, v};
  }
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
template <typename T>
__device__ __forceinline__ float weight_topk(const T* row, int64_t v, const RowWarp& w) {
  const float l = __fdiv_rn(load_as_float(row + v), w.T);  // a division, as the reference
  if (w.use_k && ordered_key(l) < w.k_key) return 0.0f;
  return expf(__fsub_rn(l, w.m));
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
      for (int64_t v = threadIdx.x; v < V; v += BLOCK)
        c += ordered_key(__fdiv_rn(load_as_float(row + v), w.T)) >= static_cast<uint32_t>(mid);
      if (block_sum_ll<BLOCK>(c) >= k) lo = mid; else hi = mid;
    }
    w.use_k = true;
    w.k_key = static_cast<uint32_t>(lo);
  }

  // top-p: keep i iff G(w_i) < p * Z_k with G(x) = sum_{w_j > x} w_j over the top-k-kept set. G is
  // non-increasing, so the kept set is {w_i >= X} for the smallest float X in [0, 1] with G(X) < p * Z_k.
  if (top_p < 1.0f) {
    double zk = 0.0;
    for (int64_t v = threadIdx.x; v < V; v += BLOCK) zk += weight_topk(row, v, w);
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
        for (int64_t v = threadIdx.x; v < V; v += BLOCK) {
          const float wv = weight_topk(row, v, w);
          if (wv > x) g += wv;
        }
        if (block_sum<BLOCK>(g) < target) hi = mid; else lo = mid;
      }
      w.p_min_w = __uint_as_float(static_cast<uint32_t>(hi));
    }
  }
  return w;
}

// ---- float64 prefix sums in token-id order ----------------------------------------------------------------------

// Walks the row in chunks of BLOCK tokens, calling visit(v, c_excl, c_incl, w_v) on every thread for its token v
// of the chunk (v may be >= V in the last chunk, with w_v = 0), where c_incl = C(v) and c_excl = C(v - 1), both
// as defined in the header comment. visit returns true to stop after this chunk (block-uniform decision made by
// the caller through its own reduction); the walk returns C(V - 1) when it ran to the end.
//
// Weights come from a functor weight(v) -> double, evaluated once per token per walk.
template <int BLOCK, typename WeightFn, typename ChunkFn>
__device__ double prefix_walk(int64_t V, WeightFn weight, ChunkFn on_chunk) {
  using Scan = cub::BlockScan<double, BLOCK>;
  __shared__ typename Scan::TempStorage ts;
  __shared__ double incl_sh[BLOCK];
  __shared__ double last_c;
  double carry = 0.0;
  for (int64_t base = 0; base < V; base += BLOCK) {
    const int64_t v = base + threadIdx.x;
    const double wv = v < V ? weight(v) : 0.0;
    double incl;
    Scan(ts).InclusiveSum(wv, incl);
    const double c_incl = carry + incl;
    incl_sh[threadIdx.x] = c_incl;
    __syncthreads();
    const double c_excl = threadIdx.x == 0 ? carry : incl_sh[threadIdx.x - 1];
    const int64_t last = (V - base < BLOCK ? V - base : BLOCK) - 1;  // the chunk's last real token
    if (threadIdx.x == 0) last_c = incl_sh[last];
    __syncthreads();
    carry = last_c;
    const bool stop = on_chunk(v, c_excl, c_incl, wv);  // may synchronise; block-uniform result
    __syncthreads();  // ts, incl_sh and last_c are rewritten by the next chunk
    if (stop) return carry;
  }
  return carry;
}

// Sum of a row's weights in the walk's order: Z = C(V - 1); also the last token with w > 0 (-1 if none).
template <int BLOCK, typename WeightFn>
__device__ double prefix_total(int64_t V, WeightFn weight, long long* last_pos) {
  long long lp = -1;
  const double z = prefix_walk<BLOCK>(V, weight, [&](int64_t v, double, double, double wv) {
    if (v < V && wv > 0.0) lp = v;
    return false;
  });
  *last_pos = block_max_ll<BLOCK>(lp);
  return z;
}

// Inverse-CDF draw: the smallest t with C(t) > u * Z; the last token with w > 0 if rounding leaves none; -1 if
// Z == 0. Two walks (Z first, then the search, which stops at the first chunk holding t).
template <int BLOCK, typename WeightFn>
__device__ long long inverse_cdf_sample(int64_t V, WeightFn weight, double u) {
  long long last_pos;
  const double z = prefix_total<BLOCK>(V, weight, &last_pos);
  if (!(z > 0.0)) return -1;
  const double target = u * z;
  long long found = 0x7fffffffffffffffLL;
  prefix_walk<BLOCK>(V, weight, [&](int64_t v, double, double c_incl, double) {
    const long long cand = (v < V && c_incl > target) ? static_cast<long long>(v) : 0x7fffffffffffffffLL;
    found = block_min_ll<BLOCK>(cand);
    return found != 0x7fffffffffffffffLL;
  });
  return found != 0x7fffffffffffffffLL ? found : last_pos;
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
  __shared__ double bin[3];  // C(t - 1), C(t), w(t)
  if (threadIdx.x == 0) bin[0] = bin[1] = bin[2] = 0.0;
  __syncthreads();
  const double z = prefix_walk<BLOCK>(V, weight, [&](int64_t v, double c_excl, double c_incl, double wv) {
    if (v == t) {
      bin[0] = c_excl;
      bin[1] = c_incl;
      bin[2] = wv;
    }
    return false;
  });
  __syncthreads();
  const double c_lo = bin[0], c_hi = bin[1], w_t = bin[2];
  __syncthreads();
  return invert_from_bin(c_lo, c_hi, w_t, z, v_aux);
}

}  // namespace cuda
}  // namespace fastverify

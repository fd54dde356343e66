// CUDA kernels of the sampling ops (schemas: csrc/sampling.cpp; reference: fastverify/reference/sampling.py):
// uniform (Philox 4x32-10, bit-identical with the CPU), aux_bits, cdf_sample and cdf_invert.
#include <torch/library.h>

#include "common.cuh"
#include "philox.h"  // csrc/philox.h: the CPU kernel's own Philox, __host__ __device__
#include "sampling.cuh"


namespace fastverify {
namespace cuda {

// ---------------------------------------------------------------------------------------------
// kernels (framework-free)
// ---------------------------------------------------------------------------------------------

// seed and stream are indexed with their own strides so that a broadcast one (stride 0) needs no copy.
__global__ void _uniform_kernel(const int64_t* __restrict__ seed, int64_t seed_stride,
                                const int64_t* __restrict__ position, const int64_t* __restrict__ stream,
                                int64_t stream_stride, int64_t R, float* __restrict__ out) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < R;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[r] = ::fastverify::philox_uniform(seed[r * seed_stride], position[r],
                                          static_cast<uint32_t>(stream[r * stream_stride]));
  }
}

// verify's seeded draws: entry i of request[i] (clamped into [0, B): never an out-of-bounds read), position offset
// by offset[i], stream i; entries before `rows` go to first, the rest to second.
__global__ void _verify_uniforms_kernel(const int64_t* __restrict__ seed, int64_t seed_step,
                                        const int64_t* __restrict__ position, int64_t B,
                                        const int64_t* __restrict__ request, const int64_t* __restrict__ offset,
                                        const int64_t* __restrict__ stream, int64_t M, int64_t rows,
                                        float* __restrict__ first, float* __restrict__ second) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < M;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = min(max(request[i], int64_t{0}), B - 1);
    const float u = ::fastverify::philox_uniform(seed[r * seed_step], position[r] + offset[i],
                                                 static_cast<uint32_t>(stream[i]));
    if (i < rows) first[i] = u; else second[i - rows] = u;
  }
}

// out [R, 32]: bit (31 - c) of u's IEEE-754 pattern at column c, as 0.0 / 1.0.
__global__ void _aux_bits_kernel(const float* __restrict__ u, int64_t R, float* __restrict__ out) {
  const int64_t total = R * 32;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(idx % 32);
    const uint32_t bits = __float_as_uint(u[idx / 32]);
    out[idx] = static_cast<float>((bits >> (31 - c)) & 1u);
  }
}


constexpr int kRowBlock = 512;    // every CDF walk of a row (C depends on the block size: csrc/cuda/sampling.cuh)
constexpr int kStatsBlock = 256;  // the segments' raw statistics

// cdf_sample / cdf_invert in four launches, so that a few rows still spread over the GPU: (1) one CTA per (row,
// segment of kSegment tokens) finds the segment's max, argmax and NaN / +inf flag; (2) one CTA per row combines its
// partials into its warp and, for a row with a top-k or top-p threshold, resolves them (resolve_thresholds; the other
// rows' CTAs return at once); (3) one CTA per (row, segment) walks its segment's CDF (total, maximum, last token with
// w > 0); (4) one CTA per row combines the segments' totals, finds the segment holding the draw (or t's bin) and walks
// only that segment. Workspace: 8-byte slots, entry r * S + s, and two per row for the thresholds.
struct SegmentScratch {
  double* max;       // the segment's max logit (widened from float)
  long long* arg;    // its lowest argmax, kNoToken if none
  long long* bad;    // 1 if the segment holds NaN or +inf
  double* total;     // valid, non-greedy rows: the segment's CDF total
  double* cmax;      // the maximum of its c
  long long* last;   // its last token with w > 0, -1 if none
  long long* thr;    // [R] rows with thresholds: k_key | use_k << 32 | use_p << 33
  double* p_min_w;   // [R] rows with thresholds: top-p's threshold
};

// The raw statistics of row r from its S segments' partials, combined in order (every thread the same).
__device__ __forceinline__ RawRowStats combine_partials(const SegmentScratch& sc, int64_t r, int64_t S) {
  ArgMax best{-INFINITY, kNoToken};
  bool bad = false;
  for (int64_t i = r * S; i < (r + 1) * S; ++i) {
    best = ArgMaxOp()(best, ArgMax{static_cast<float>(sc.max[i]), sc.arg[i]});
    bad |= sc.bad[i] != 0;
  }
  return stats_from_partial(best, bad);
}

// Row r's warp before its thresholds: temperature and min_p over its statistics from the partials.
__device__ __forceinline__ RowWarp stats_warp(const SegmentScratch& sc, int64_t r, int64_t S, const float* wp) {
  return warp_from_stats(combine_partials(sc, r, S), wp[0], wp[3]);
}

// Whether row r (warp w from stats_warp, parameters wp) has top-k / top-p thresholds, which (2) resolves.
__device__ __forceinline__ bool has_thresholds(const RowWarp& w, int64_t V, const float* wp) {
  return w.valid && !w.greedy && warp_needs_thresholds(V, wp[1], wp[2]);
}

// Row r's warp: its statistics from the partials, its thresholds from (2) (every thread the same).
__device__ __forceinline__ RowWarp row_warp(const SegmentScratch& sc, int64_t r, int64_t S, int64_t V,
                                            const float* wp) {
  RowWarp w = stats_warp(sc, r, S, wp);
  if (has_thresholds(w, V, wp)) {
    const long long thr = sc.thr[r];
    w.k_key = static_cast<uint32_t>(thr & 0xffffffffLL);
    w.use_k = (thr >> 32) & 1;
    w.use_p = (thr >> 33) & 1;
    w.p_min_w = static_cast<float>(sc.p_min_w[r]);
  }
  return w;
}

// (1) grid (S, rows): segment blockIdx.x of rows blockIdx.y, blockIdx.y + gridDim.y, ...
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    _segment_raw_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t R, int64_t V, SegmentScratch sc) {
  const int64_t S = gridDim.x, s = blockIdx.x, begin = s * kSegment;
  for (int64_t r = blockIdx.y; r < R; r += gridDim.y) {
    bool bad;
    const ArgMax best = raw_partial<BLOCK>(logits + r * row_stride + begin, segment_end(s, V) - begin, begin, &bad);
    if (threadIdx.x == 0) {
      sc.max[r * S + s] = best.v;
      sc.arg[r * S + s] = best.i;
      sc.bad[r * S + s] = bad ? 1 : 0;
    }
  }
}

// (2) one CTA per row: the thresholds of the rows that have them.
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    _row_thresholds_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t R, int64_t V,
                           const float* __restrict__ warp, SegmentScratch sc) {
  const int64_t S = num_segments(V);
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const float* wp = warp + r * 4;
    RowWarp w = stats_warp(sc, r, S, wp);
    if (!has_thresholds(w, V, wp)) continue;  // the same for every thread
    resolve_thresholds<BLOCK>(logits + r * row_stride, V, wp[1], wp[2], w);
    if (threadIdx.x == 0) {
      sc.thr[r] = static_cast<long long>(w.k_key) | (static_cast<long long>(w.use_k) << 32) |
                  (static_cast<long long>(w.use_p) << 33);
      sc.p_min_w[r] = w.p_min_w;
    }
    __syncthreads();  // the helpers' shared memory is rewritten for the next row
  }
}

// (3) grid (S, rows): the CDF of segment blockIdx.x of each valid, non-greedy row.
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    _segment_cdf_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t R, int64_t V,
                        const float* __restrict__ warp, SegmentScratch sc) {
  const int64_t S = gridDim.x, s = blockIdx.x;
  for (int64_t r = blockIdx.y; r < R; r += gridDim.y) {
    const RowWarp w = row_warp(sc, r, S, V, warp + r * 4);
    if (!w.valid || w.greedy) continue;  // the same for every thread
    const T* row = logits + r * row_stride;
    const SegmentStats st = segment_stats<BLOCK>(
        s * kSegment, segment_end(s, V), [&](int64_t v) { return static_cast<double>(row_weight(row, v, w)); });
    if (threadIdx.x == 0) {
      sc.total[r * S + s] = st.total;
      sc.cmax[r * S + s] = st.cmax;
      sc.last[r * S + s] = st.last;
    }
  }
}

// (4) one CTA per row: the draw. out[r] = -1 for rows without a distribution.
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    _cdf_sample_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t R, int64_t V,
                       const double* __restrict__ u, const float* __restrict__ warp, SegmentScratch sc,
                       int64_t* __restrict__ out) {
  const int64_t S = num_segments(V);
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const T* row = logits + r * row_stride;
    const RowWarp w = row_warp(sc, r, S, V, warp + r * 4);
    auto weight = [&](int64_t v) { return static_cast<double>(row_weight(row, v, w)); };
    long long t = -1;
    if (w.valid && w.greedy) {
      t = w.argmax;  // the one-hot row: C(t) > u * 1 first at the argmax for every u in [0, 1)
    } else if (w.valid) {
      const double* total = sc.total + r * S;
      const double z = sum_in_order(total, S);
      if (z > 0.0) {
        const double target = u[r] * z;
        for (int64_t s = 0; s < S; ++s) t = max(t, sc.last[r * S + s]);  // if rounding leaves no C(t) > target
        double P;
        const int64_t hit = find_segment(total, sc.cmax + r * S, S, target, &P);
        if (hit >= 0) {
          const long long f = segment_search<BLOCK>(hit * kSegment, segment_end(hit, V), weight, P, target);
          if (f != kNoToken) t = f;
        }
      }
    }
    if (threadIdx.x == 0) out[r] = t;
    __syncthreads();
  }
}

// (4) one CTA per row: out[r] = the auxiliary variable u with cdf_sample(u) == token[r] (NaN where none exists).
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    _cdf_invert_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t R, int64_t V,
                       const int64_t* __restrict__ token, const double* __restrict__ v_aux,
                       const float* __restrict__ warp, SegmentScratch sc, double* __restrict__ out) {
  const double nan = __longlong_as_double(0x7ff8000000000000LL);
  const int64_t S = num_segments(V);
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const T* row = logits + r * row_stride;
    const long long t = token[r];
    const RowWarp w = row_warp(sc, r, S, V, warp + r * 4);
    auto weight = [&](int64_t v) { return static_cast<double>(row_weight(row, v, w)); };
    double res = nan;
    if (w.valid && t >= 0 && t < V) {
      if (w.greedy) {
        // one-hot at the argmax: C(t - 1) = 0, C(t) = w(t) = Z = 1 for t == argmax, w(t) = 0 otherwise
        res = t == w.argmax ? invert_from_bin(0.0, 1.0, 1.0, 1.0, v_aux[r]) : nan;
      } else {
        const double* total = sc.total + r * S;
        const int64_t st = t / kSegment;
        double P = 0.0, c_lo = 0.0, c_hi, w_t;  // c_lo: max of C over the tokens before t (and 0)
        for (int64_t s = 0; s < st; ++s) {
          c_lo = fmax(c_lo, P + sc.cmax[r * S + s]);
          P += total[s];
        }
        segment_bin<BLOCK>(st * kSegment, segment_end(st, V), weight, P, t, c_lo, &c_lo, &c_hi, &w_t);
        res = invert_from_bin(c_lo, c_hi, w_t, sum_in_order(total, S), v_aux[r]);
      }
    }
    if (threadIdx.x == 0) out[r] = res;
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------------
// bindings
// ---------------------------------------------------------------------------------------------
namespace {

constexpr int kThreads = 256;

// Streams are not range-checked here (that would synchronise with the device): fastverify.uniform validates them.
at::Tensor uniform_cuda(const at::Tensor& seed, const at::Tensor& position, const at::Tensor& stream) {
  for (const auto& [t, name] : {std::pair{&seed, "seed"}, {&position, "position"}, {&stream, "stream"}}) {
    check_cuda(*t, name);
    check_same_device(*t, position, name, "position");
    check_dtype(*t, at::kLong, name);
    TORCH_CHECK(t->numel() == position.numel() || t->numel() == 1, name, ": expected ", position.numel(),
                " elements (one per position) or 1, got shape ", t->sizes());
  }
  const c10::cuda::CUDAGuard guard(position.device());
  auto pos = position.contiguous();
  auto sd = seed.contiguous();
  auto st = stream.contiguous();
  auto out = at::empty(position.sizes(), position.options().dtype(at::kFloat));
  const int64_t R = pos.numel();
  if (R == 0) return out;
  _uniform_kernel<<<grid_for(R, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      sd.data_ptr<int64_t>(), sd.numel() == 1 ? 0 : 1, pos.data_ptr<int64_t>(), st.data_ptr<int64_t>(),
      st.numel() == 1 ? 0 : 1, R, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// No value is checked here (that would synchronise): request is clamped, a stream's low 32 bits are used.
std::tuple<at::Tensor, at::Tensor> verify_uniforms_cuda(const at::Tensor& seed, const at::Tensor& position,
                                                       const at::Tensor& request, const at::Tensor& offset,
                                                       const at::Tensor& stream, int64_t rows) {
  for (const auto& [t, name] : {std::pair{&seed, "seed"}, {&position, "position"}, {&request, "request"},
                                {&offset, "offset"}, {&stream, "stream"}}) {
    check_cuda(*t, name);
    check_same_device(*t, position, name, "position");
    check_dtype(*t, at::kLong, name);
    check_dim(*t, 1, name);
  }
  const int64_t B = position.numel(), M = request.numel();
  TORCH_CHECK(seed.numel() == B || seed.numel() == 1, "seed: expected B = ", B, " elements (position's) or 1, got ",
              seed.numel());
  TORCH_CHECK(offset.numel() == M && stream.numel() == M, "request, offset, stream: expected one length, got ", M,
              ", ", offset.numel(), ", ", stream.numel());
  TORCH_CHECK(0 <= rows && rows <= M, "rows: expected a value in [0, ", M, "], got ", rows);
  TORCH_CHECK(B > 0 || M == 0, "request: expected no entries when position is empty, got ", M);
  const c10::cuda::CUDAGuard guard(position.device());
  auto sd = seed.contiguous(), pos = position.contiguous(), rq = request.contiguous(), of = offset.contiguous(),
       st = stream.contiguous();
  auto first = at::empty({rows}, position.options().dtype(at::kFloat));
  auto second = at::empty({M - rows}, position.options().dtype(at::kFloat));
  if (M == 0) return {first, second};
  _verify_uniforms_kernel<<<grid_for(M, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      sd.data_ptr<int64_t>(), sd.numel() == 1 ? 0 : 1, pos.data_ptr<int64_t>(), B, rq.data_ptr<int64_t>(),
      of.data_ptr<int64_t>(), st.data_ptr<int64_t>(), M, rows, first.data_ptr<float>(), second.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {first, second};
}

at::Tensor aux_bits_cuda(const at::Tensor& u) {
  check_cuda(u, "u");
  check_dtype(u, at::kFloat, "u");
  const c10::cuda::CUDAGuard guard(u.device());
  auto uc = u.contiguous();
  std::vector<int64_t> shape(u.sizes().begin(), u.sizes().end());
  shape.push_back(32);
  auto out = at::empty(shape, u.options());
  const int64_t R = uc.numel();
  if (R == 0) return out;
  _aux_bits_kernel<<<grid_for(R * 32, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      uc.data_ptr<float>(), R, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

unsigned row_grid(int64_t R) { return static_cast<unsigned>(R < 65535 ? R : 65535); }

// Launches (1), (2) and (3) of the segmented kernels over x [R, V] (R > 0); the workspace lives in `buf`.
template <typename T>
SegmentScratch launch_segments(const at::Tensor& x, const at::Tensor& warp, at::Tensor& buf, cudaStream_t stream) {
  const int64_t R = x.size(0), V = x.size(1), S = num_segments(V), n = R * S;
  TORCH_CHECK(S <= INT32_MAX, "logits: too many columns, got shape ", x.sizes());
  buf = at::empty({6 * n + 2 * R}, x.options().dtype(at::kLong));
  auto* base = buf.data_ptr<int64_t>();
  SegmentScratch sc;
  sc.max = reinterpret_cast<double*>(base);
  sc.arg = reinterpret_cast<long long*>(base + n);
  sc.bad = reinterpret_cast<long long*>(base + 2 * n);
  sc.total = reinterpret_cast<double*>(base + 3 * n);
  sc.cmax = reinterpret_cast<double*>(base + 4 * n);
  sc.last = reinterpret_cast<long long*>(base + 5 * n);
  sc.thr = reinterpret_cast<long long*>(base + 6 * n);
  sc.p_min_w = reinterpret_cast<double*>(base + 6 * n + R);
  const dim3 grid(static_cast<unsigned>(S), row_grid(R));
  const T* logits = reinterpret_cast<const T*>(x.data_ptr());
  _segment_raw_kernel<T, kStatsBlock><<<grid, kStatsBlock, 0, stream>>>(logits, x.stride(0), R, V, sc);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  _row_thresholds_kernel<T, kRowBlock><<<row_grid(R), kRowBlock, 0, stream>>>(logits, x.stride(0), R, V,
                                                                               warp.data_ptr<float>(), sc);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  _segment_cdf_kernel<T, kRowBlock><<<grid, kRowBlock, 0, stream>>>(logits, x.stride(0), R, V,
                                                                     warp.data_ptr<float>(), sc);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return sc;
}

void check_rows(const at::Tensor& logits, const at::Tensor& warp) {
  check_cuda(logits, "logits");
  check_logits_dtype(logits, "logits");
  check_dim(logits, 2, "logits");
  TORCH_CHECK(logits.size(1) >= 1, "logits: expected V >= 1 columns, got shape ", logits.sizes());
  check_cuda(warp, "warp");
  check_same_device(warp, logits, "warp", "logits");
  check_dtype(warp, at::kFloat, "warp");
  TORCH_CHECK(warp.dim() == 2 && warp.size(0) == logits.size(0) && warp.size(1) == 4, "warp: expected shape [",
              logits.size(0), ", 4], got ", warp.sizes());
}

at::Tensor cdf_sample_cuda(const at::Tensor& logits, const at::Tensor& u, const at::Tensor& warp) {
  check_rows(logits, warp);
  check_cuda(u, "u");
  check_same_device(u, logits, "u", "logits");
  TORCH_CHECK(u.scalar_type() == at::kFloat || u.scalar_type() == at::kDouble, "u: expected float32 or float64, got ",
              u.scalar_type());
  TORCH_CHECK(u.dim() == 1 && u.size(0) == logits.size(0), "u: expected shape [", logits.size(0), "], got ", u.sizes());
  const c10::cuda::CUDAGuard guard(logits.device());
  auto x = logits.stride(1) == 1 ? logits : logits.contiguous();
  auto ud = u.to(at::kDouble).contiguous();  // float32 -> float64 is exact
  auto wp = warp.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  auto out = at::empty({R}, logits.options().dtype(at::kLong));
  if (R == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor buf;
  FASTVERIFY_DISPATCH_FLOATING(x.scalar_type(), "logits", [&] {
    const SegmentScratch sc = launch_segments<scalar_t>(x, wp, buf, stream);
    _cdf_sample_kernel<scalar_t, kRowBlock><<<row_grid(R), kRowBlock, 0, stream>>>(
        reinterpret_cast<const scalar_t*>(x.data_ptr()), x.stride(0), R, V, ud.data_ptr<double>(),
        wp.data_ptr<float>(), sc, out.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor cdf_invert_cuda(const at::Tensor& logits, const at::Tensor& token, const at::Tensor& v,
                           const at::Tensor& warp) {
  check_rows(logits, warp);
  check_cuda(token, "token");
  check_cuda(v, "v");
  check_same_device(token, logits, "token", "logits");
  check_same_device(v, logits, "v", "logits");
  check_dtype(token, at::kLong, "token");
  TORCH_CHECK(token.dim() == 1 && token.size(0) == logits.size(0), "token: expected shape [", logits.size(0),
              "], got ", token.sizes());
  TORCH_CHECK(v.scalar_type() == at::kFloat || v.scalar_type() == at::kDouble, "v: expected float32 or float64, got ",
              v.scalar_type());
  TORCH_CHECK(v.dim() == 1 && v.size(0) == logits.size(0), "v: expected shape [", logits.size(0), "], got ", v.sizes());
  const c10::cuda::CUDAGuard guard(logits.device());
  auto x = logits.stride(1) == 1 ? logits : logits.contiguous();
  auto tok = token.contiguous();
  auto vd = v.to(at::kDouble).contiguous();
  auto wp = warp.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  auto out = at::empty({R}, logits.options().dtype(at::kDouble));
  if (R == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor buf;
  FASTVERIFY_DISPATCH_FLOATING(x.scalar_type(), "logits", [&] {
    const SegmentScratch sc = launch_segments<scalar_t>(x, wp, buf, stream);
    _cdf_invert_kernel<scalar_t, kRowBlock><<<row_grid(R), kRowBlock, 0, stream>>>(
        reinterpret_cast<const scalar_t*>(x.data_ptr()), x.stride(0), R, V, tok.data_ptr<int64_t>(),
        vd.data_ptr<double>(), wp.data_ptr<float>(), sc, out.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastverify, CUDA, m) {
  m.impl("uniform", &uniform_cuda);
  m.impl("verify_uniforms", &verify_uniforms_cuda);
  m.impl("aux_bits", &aux_bits_cuda);
  m.impl("cdf_sample", &cdf_sample_cuda);
  m.impl("cdf_invert", &cdf_invert_cuda);
}

}  // namespace cuda
}  // namespace fastverify

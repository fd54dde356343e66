// Shared pieces of the CUDA kernels (csrc/cuda/*.cu): framework-free device helpers, and a few
// host-side helpers for the thin bindings (input checks, dtype dispatch, launch geometry).
//
// Device code below this header's "device helpers" section uses only CUDA types (float, __half,
// __nv_bfloat16, raw pointers, int64 sizes and strides), never at::Tensor.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace fastverify {
namespace cuda {

// ---------------------------------------------------------------------------------------------
// device helpers
// ---------------------------------------------------------------------------------------------

// Scores are read in their storage dtype and widened to float: fp32 / bf16 / fp16 are all exactly
// representable in float, so every backend sees the same values.
__device__ __forceinline__ float load_as_float(const float* p) { return *p; }
__device__ __forceinline__ float load_as_float(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load_as_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// Row traversal of one CTA: calls f(v, row[v] as float) for the tokens this thread owns. Tokens come in chunks
// of W = 16 / sizeof(T) consecutive ids (4 fp32, 8 bf16 / fp16), chunk i owned by thread i % BLOCK and visited
// in id order; a 16-byte load per chunk where the row is 16-byte aligned, else W element loads of the same
// tokens. Which thread sees which token, and in which order, does not depend on the row's alignment, so float
// sums accumulated in f come out bit-identical for any row pointer. (On an H100, 2026-11-23, the one-element-
// per-thread loop this replaces read rows at 0.34 TB/s of the card's 2.9 in greedy verify: too few loads in flight.)
template <int BLOCK, typename T, typename F>
__device__ __forceinline__ void for_each_owned(const T* row, int64_t V, F&& f) {
  constexpr int W = 16 / sizeof(T);
  const bool aligned = (reinterpret_cast<uintptr_t>(row) & 15) == 0;
  const int64_t nfull = V / W;
  if (aligned) {
#pragma unroll 2
    for (int64_t i = threadIdx.x; i < nfull; i += BLOCK) {
      const int4 raw = *reinterpret_cast<const int4*>(row + i * W);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < W; ++k) f(i * W + k, load_as_float(e + k));
    }
  } else {
    for (int64_t i = threadIdx.x; i < nfull; i += BLOCK) {
#pragma unroll
      for (int k = 0; k < W; ++k) f(i * W + k, load_as_float(row + i * W + k));
    }
  }
  if (threadIdx.x == nfull % BLOCK) {  // the last, partial chunk
    for (int64_t v = nfull * W; v < V; ++v) f(v, load_as_float(row + v));
  }
}

// Whether request b's nodes [cu_nodes[b], cu_nodes[b + 1]) lie in order within parents' [0, N): the Python layer
// validates cu_nodes unless validate=False; a request outside gets no rows, so no kernel reads or writes past N.
__device__ __forceinline__ bool request_in_range(const int32_t* cu_nodes, int64_t N, int b) {
  return cu_nodes[b] >= 0 && cu_nodes[b] <= cu_nodes[b + 1] && cu_nodes[b + 1] <= N;
}

// Request of global node g: the b with cu_nodes[b] <= g < cu_nodes[b + 1] (cu_nodes non-decreasing;
// empty requests are skipped because their two offsets are equal). Returns -1 when g is outside.
__device__ __forceinline__ int request_of_node(const int32_t* cu_nodes, int B, int64_t g) {
  int lo = 0, hi = B;  // invariant: cu_nodes[lo] <= g < cu_nodes[hi]
  if (g < cu_nodes[0] || g >= cu_nodes[B]) return -1;
  while (hi - lo > 1) {
    int mid = (lo + hi) / 2;
    if (cu_nodes[mid] <= g) lo = mid; else hi = mid;
  }
  return lo;
}

// Depth of local node j (a child of the root has depth 1), walking the parents. Parents must precede
// children (the Python layer validates that); the walk is nevertheless bounded by j + 1 steps and
// stops at any parent outside [-1, current), so malformed input cannot loop or read out of bounds.
__device__ __forceinline__ int node_depth(const int32_t* parents_b, int j) {
  int depth = 0;
  int cur = j;
  for (int steps = 0; steps <= j && cur >= 0; ++steps) {
    ++depth;
    int p = parents_b[cur];
    if (p >= cur || p < -1) break;
    cur = p;
  }
  return depth;
}

}  // namespace cuda
}  // namespace fastverify

// ---------------------------------------------------------------------------------------------
// host helpers for the bindings (framework types allowed here)
// ---------------------------------------------------------------------------------------------
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace fastverify {
namespace cuda {

inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, ": expected a CUDA tensor, got device ", t.device());
}
inline void check_dtype(const at::Tensor& t, at::ScalarType dt, const char* name) {
  TORCH_CHECK(t.scalar_type() == dt, name, ": expected dtype ", dt, ", got ", t.scalar_type());
}
inline void check_dim(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.dim() == dim, name, ": expected ", dim, " dimensions, got shape ", t.sizes());
}
inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), name, ": expected the device of ", ref_name, " (", ref.device(), "), got ",
              t.device());
}
inline void check_logits_dtype(const at::Tensor& t, const char* name) {
  auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, name,
              ": expected dtype float32, bfloat16 or float16, got ", dt);
}

// Blocks for a grid-stride loop over `work` items: enough to fill the GPU a few times, never zero.
inline unsigned grid_for(int64_t work, int threads) {
  int64_t blocks = (work + threads - 1) / threads;
  int64_t cap = 65535;  // generous; grid-stride loops cover the rest
  if (blocks < 1) blocks = 1;
  if (blocks > cap) blocks = cap;
  return static_cast<unsigned>(blocks);
}

}  // namespace cuda
}  // namespace fastverify

// Dispatch on the floating dtype of a scores tensor, binding `scalar_t` to the CUDA storage type
// (float, __half, __nv_bfloat16), so that kernels never see at::Half / at::BFloat16.
#define FASTVERIFY_DISPATCH_FLOATING(DTYPE, NAME, ...)                                              \
  [&] {                                                                                            \
    switch (DTYPE) {                                                                               \
      case at::kFloat: {                                                                           \
        using scalar_t = float;                                                                    \
        return __VA_ARGS__();                                                                      \
      }                                                                                            \
      case at::kHalf: {                                                                            \
        using scalar_t = __half;                                                                   \
        return __VA_ARGS__();                                                                      \
      }                                                                                            \
      case at::kBFloat16: {                                                                        \
        using scalar_t = __nv_bfloat16;                                                            \
        return __VA_ARGS__();                                                                      \
      }                                                                                            \
      default:                                                                                     \
        TORCH_CHECK(false, NAME, ": expected dtype float32, bfloat16 or float16, got ", DTYPE);    \
    }                                                                                              \
  }()

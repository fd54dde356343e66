// CUDA kernels of the tree ops (schemas and semantics: csrc/tree.cpp; reference: fastverify/reference/tree.py):
// tree_mask_packed / tree_mask_bool / tree_mask_additive, tree_positions, compact_cache.
// tree_attention has no CUDA kernel: on CUDA tensors it runs on Triton (kernels/attention.py).
//
// The masks are built in two steps: the packed ancestor bits (one thread per 32-bit word of a query row,
// walking that query's ancestor chain), then, for the dense formats, one thread per output element reading
// one bit. Every walk is bounded by the node's index, so malformed parents cannot loop or read past the
// request's nodes.
#include <torch/library.h>

#include "common.cuh"

namespace fastverify {
namespace cuda {

// ---------------------------------------------------------------------------------------------
// kernels (framework-free)
// ---------------------------------------------------------------------------------------------

// packed [B, n, W] int32, W = ceil(n / 32): bit (j % 32) of word j / 32 of row (b, i) is set iff local node j
// is i or an ancestor of i (i < n_b). Rows of padding nodes (i >= n_b) are all zero.
__global__ void _tree_mask_packed_kernel(const int32_t* __restrict__ parents, const int32_t* __restrict__ cu_nodes,
                                         int64_t N, int B, int n, int W, int32_t* __restrict__ packed) {
  const int64_t total = static_cast<int64_t>(B) * n * W;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int w = static_cast<int>(idx % W);
    const int i = static_cast<int>((idx / W) % n);
    const int b = static_cast<int>(idx / (static_cast<int64_t>(W) * n));
    const int32_t start = cu_nodes[b];
    const int n_b = request_in_range(cu_nodes, N, b) ? cu_nodes[b + 1] - start : 0;
    uint32_t word = 0;
    if (i < n_b) {
      const int32_t* par = parents + start;
      const int lo = w * 32, hi = lo + 32;
      int cur = i;
      // Ancestors have strictly smaller indices: once cur < lo no later ancestor lands in this word.
      for (int steps = 0; steps <= i && cur >= lo; ++steps) {
        if (cur < hi) word |= 1u << (cur - lo);
        const int p = par[cur];
        if (p >= cur || p < -1) break;
        cur = p;
      }
    }
    packed[idx] = static_cast<int32_t>(word);
  }
}

// One output element of the dense masks: key slot `col` of query row (b, i). Prefix slots [0, P) are visible
// iff col < prefix_len[b]; draft slot P + j iff bit j of the packed row.
__device__ __forceinline__ bool mask_visible(const int32_t* packed, const int32_t* prefix_len, int n, int W, int P,
                                             int b, int i, int col) {
  if (col < P) return col < prefix_len[b];
  const int j = col - P;
  const uint32_t word = static_cast<uint32_t>(packed[(static_cast<int64_t>(b) * n + i) * W + j / 32]);
  return (word >> (j % 32)) & 1u;
}

// One mask element per thread: ``shown`` where mask_visible, else ``hidden`` (bool true / false, or an additive mask's
// 0 / -inf in its dtype).
template <typename T>
__global__ void _tree_mask_kernel(const int32_t* __restrict__ packed, const int32_t* __restrict__ prefix_len, int B,
                                  int n, int W, int P, T shown, T hidden, T* __restrict__ out) {
  const int L = P + n;
  const int64_t total = static_cast<int64_t>(B) * n * L;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int col = static_cast<int>(idx % L);
    const int i = static_cast<int>((idx / L) % n);
    const int b = static_cast<int>(idx / (static_cast<int64_t>(L) * n));
    out[idx] = mask_visible(packed, prefix_len, n, W, P, b, i, col) ? shown : hidden;
  }
}

// positions [N] int64: prefix_len[b] + depth(j) - 1 for global node g = cu_nodes[b] + j.
__global__ void _tree_positions_kernel(const int32_t* __restrict__ parents, const int32_t* __restrict__ cu_nodes,
                                       const int32_t* __restrict__ prefix_len, int B, int64_t N,
                                       int64_t* __restrict__ positions) {
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < N;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int b = request_of_node(cu_nodes, B, g);
    if (b < 0 || !request_in_range(cu_nodes, N, b)) {  // unvalidated cu_nodes: a node of no request
      positions[g] = -1;
      continue;
    }
    const int j = static_cast<int>(g - cu_nodes[b]);
    positions[g] = static_cast<int64_t>(prefix_len[b]) + node_depth(parents + cu_nodes[b], j) - 1;
  }
}

// compact_cache on tensors [B, H, S, D] with arbitrary strides, one launch for up to kBatchTensors of them (a
// cache's layers: blockIdx.y picks the tensor), elements moved as raw bits in words (Word has the element's size, or
// 16 bytes where the rows and strides allow: prepare_compact), D words per row. One thread per (b, h, word d) of its
// tensor first gathers the sources of all of request b's moves, then writes them to their destinations: the
// reference's gather-then-write semantics, so overlapping source and destination slots are handled, without any
// synchronisation between threads (each thread touches only its own word of every slot). Up to kStagedRows moves are
// staged in registers (STAGED); more go through the thread's own column of its tensor's `scratch`
// [max_depth, B * H * D]. Moves whose slots fall outside [0, S) are skipped (the Python layer rejects them before
// launching).
constexpr int kStagedRows = 16;
constexpr int kBatchTensors = 32;  // 32 x 64 bytes of kernel parameters

struct CompactTensor {
  void* data;
  void* scratch;  // (not STAGED) [max_depth, total] words
  int64_t total;  // B * H * D words
  int64_t sB, sH, sS, sD;  // strides in words
  int H, D;  // heads, words per row
};

struct CompactBatch {
  CompactTensor t[kBatchTensors];
};

template <typename Word, bool STAGED>
__global__ void __launch_bounds__(256)
    _compact_cache_kernel(const CompactBatch batch, int64_t S, const int32_t* __restrict__ prefix_len,
                          int64_t draft_start, const int32_t* __restrict__ accepted, int max_depth,
                          const int32_t* __restrict__ accept_len) {
  const CompactTensor& t = batch.t[blockIdx.y];
  Word* cache = static_cast<Word*>(t.data);
  Word* scratch = static_cast<Word*>(t.scratch);
  const int64_t total = t.total;
  const int H = t.H, D = t.D;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int d = static_cast<int>(idx % D);
    const int h = static_cast<int>((idx / D) % H);
    const int b = static_cast<int>(idx / (static_cast<int64_t>(D) * H));
    Word* base = cache + b * t.sB + h * t.sH + d * t.sD;
    const int64_t sS = t.sS;
    const int len = min(accept_len[b], max_depth);
    const int32_t* acc = accepted + static_cast<int64_t>(b) * max_depth;
    const int64_t dst0 = prefix_len[b];
    if constexpr (STAGED) {  // max_depth <= kStagedRows
      Word staged[kStagedRows];
#pragma unroll
      for (int i = 0; i < kStagedRows; ++i) {
        const int64_t src = draft_start + acc[i < len ? i : 0];
        if (i < len && acc[i] >= 0 && src < S) staged[i] = base[src * sS];
      }
#pragma unroll
      for (int i = 0; i < kStagedRows; ++i) {
        const int64_t src = draft_start + acc[i < len ? i : 0], dst = dst0 + i;
        if (i < len && acc[i] >= 0 && src < S && dst >= 0 && dst < S) base[dst * sS] = staged[i];
      }
    } else {
      for (int i = 0; i < len; ++i) {
        const int64_t src = draft_start + acc[i];
        if (acc[i] >= 0 && src < S) scratch[i * total + idx] = base[src * sS];
      }
      for (int i = 0; i < len; ++i) {
        const int64_t src = draft_start + acc[i];
        const int64_t dst = dst0 + i;
        if (acc[i] >= 0 && src < S && dst >= 0 && dst < S) base[dst * sS] = scratch[i * total + idx];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// bindings
// ---------------------------------------------------------------------------------------------
namespace {

constexpr int kThreads = 256;

void check_tree_inputs(const at::Tensor& parents, const at::Tensor& cu_nodes) {
  check_cuda(parents, "parents");
  check_cuda(cu_nodes, "cu_nodes");
  check_same_device(parents, cu_nodes, "parents", "cu_nodes");
  check_dtype(parents, at::kInt, "parents");
  check_dtype(cu_nodes, at::kInt, "cu_nodes");
  check_dim(parents, 1, "parents");
  check_dim(cu_nodes, 1, "cu_nodes");
  TORCH_CHECK(cu_nodes.numel() >= 1, "cu_nodes: expected shape [B + 1] with B >= 0, got ", cu_nodes.sizes());
}

void check_prefix_len(const at::Tensor& prefix_len, const at::Tensor& cu_nodes) {
  check_cuda(prefix_len, "prefix_len");
  check_same_device(prefix_len, cu_nodes, "prefix_len", "cu_nodes");
  check_dtype(prefix_len, at::kInt, "prefix_len");
  check_dim(prefix_len, 1, "prefix_len");
  TORCH_CHECK(prefix_len.numel() == cu_nodes.numel() - 1, "prefix_len: expected shape [B] = [", cu_nodes.numel() - 1,
              "] (B from cu_nodes), got ", prefix_len.sizes());
}

at::Tensor packed_mask(const at::Tensor& parents, const at::Tensor& cu_nodes, int64_t n) {
  TORCH_CHECK(n >= 0 && n <= INT32_MAX, "n: expected 0 <= n < 2^31, got ", n);
  const int B = static_cast<int>(cu_nodes.numel() - 1);
  const int W = static_cast<int>((n + 31) / 32);
  auto packed = at::empty({B, n, W}, cu_nodes.options().dtype(at::kInt));
  const int64_t total = static_cast<int64_t>(B) * n * W;
  if (total == 0) return packed;
  auto par = parents.contiguous();
  auto cu = cu_nodes.contiguous();
  _tree_mask_packed_kernel<<<grid_for(total, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      par.data_ptr<int32_t>(), cu.data_ptr<int32_t>(), par.numel(), B, static_cast<int>(n), W,
      packed.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return packed;
}

at::Tensor tree_mask_packed_cuda(const at::Tensor& parents, const at::Tensor& cu_nodes, int64_t n) {
  check_tree_inputs(parents, cu_nodes);
  const c10::cuda::CUDAGuard guard(cu_nodes.device());
  return packed_mask(parents, cu_nodes, n);
}

at::Tensor tree_mask_bool_cuda(const at::Tensor& parents, const at::Tensor& cu_nodes, const at::Tensor& prefix_len,
                               int64_t n, int64_t P) {
  check_tree_inputs(parents, cu_nodes);
  check_prefix_len(prefix_len, cu_nodes);
  TORCH_CHECK(P >= 0 && P + n <= INT32_MAX, "P: expected 0 <= P and P + n < 2^31, got P = ", P, ", n = ", n);
  const c10::cuda::CUDAGuard guard(cu_nodes.device());
  const int B = static_cast<int>(cu_nodes.numel() - 1);
  auto packed = packed_mask(parents, cu_nodes, n);
  auto out = at::empty({B, n, P + n}, cu_nodes.options().dtype(at::kBool));
  const int64_t total = out.numel();
  if (total == 0) return out;
  auto pre = prefix_len.contiguous();
  _tree_mask_kernel<bool><<<grid_for(total, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      packed.data_ptr<int32_t>(), pre.data_ptr<int32_t>(), B, static_cast<int>(n), static_cast<int>(packed.size(2)),
      static_cast<int>(P), true, false, out.data_ptr<bool>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor tree_mask_additive_cuda(const at::Tensor& parents, const at::Tensor& cu_nodes, const at::Tensor& prefix_len,
                                   int64_t n, int64_t P, at::ScalarType dtype) {
  check_tree_inputs(parents, cu_nodes);
  check_prefix_len(prefix_len, cu_nodes);
  TORCH_CHECK(P >= 0 && P + n <= INT32_MAX, "P: expected 0 <= P and P + n < 2^31, got P = ", P, ", n = ", n);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble,
              "dtype: expected float32, float16, bfloat16 or float64, got ", dtype);
  const c10::cuda::CUDAGuard guard(cu_nodes.device());
  const int B = static_cast<int>(cu_nodes.numel() - 1);
  auto packed = packed_mask(parents, cu_nodes, n);
  auto out = at::empty({B, 1, n, P + n}, cu_nodes.options().dtype(dtype));
  const int64_t total = out.numel();
  if (total == 0) return out;
  auto pre = prefix_len.contiguous();
  const unsigned grid = grid_for(total, kThreads);
  auto stream = at::cuda::getCurrentCUDAStream();
  const int W = static_cast<int>(packed.size(2));
  const float inf = INFINITY;
#define FV_LAUNCH_ADDITIVE(T, ZERO, NEG_INF)                                                                      \
  _tree_mask_kernel<T><<<grid, kThreads, 0, stream>>>(packed.data_ptr<int32_t>(), pre.data_ptr<int32_t>(), B,       \
                                                      static_cast<int>(n), W, static_cast<int>(P), ZERO, NEG_INF,    \
                                                      reinterpret_cast<T*>(out.data_ptr()))
  switch (dtype) {
    case at::kFloat: FV_LAUNCH_ADDITIVE(float, 0.0f, -inf); break;
    case at::kDouble: FV_LAUNCH_ADDITIVE(double, 0.0, -static_cast<double>(inf)); break;
    case at::kHalf: FV_LAUNCH_ADDITIVE(__half, __float2half(0.0f), __float2half(-inf)); break;
    default: FV_LAUNCH_ADDITIVE(__nv_bfloat16, __float2bfloat16(0.0f), __float2bfloat16(-inf)); break;
  }
#undef FV_LAUNCH_ADDITIVE
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor tree_positions_cuda(const at::Tensor& parents, const at::Tensor& cu_nodes, const at::Tensor& prefix_len) {
  check_tree_inputs(parents, cu_nodes);
  check_prefix_len(prefix_len, cu_nodes);
  const c10::cuda::CUDAGuard guard(cu_nodes.device());
  const int B = static_cast<int>(cu_nodes.numel() - 1);
  const int64_t N = parents.numel();
  auto out = at::empty({N}, parents.options().dtype(at::kLong));
  if (N == 0) return out;
  auto par = parents.contiguous();
  auto cu = cu_nodes.contiguous();
  auto pre = prefix_len.contiguous();
  _tree_positions_kernel<<<grid_for(N, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      par.data_ptr<int32_t>(), cu.data_ptr<int32_t>(), pre.data_ptr<int32_t>(), B, N, out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// One tensor's launch record: its words of 16 bytes where a row is contiguous and every row starts 16-byte aligned,
// else of one element (word_size: the returned words' size in bytes).
CompactTensor prepare_compact(const at::Tensor& cache, int64_t& word_size) {
  const int64_t es = cache.element_size();
  int64_t D = cache.size(3), st[4] = {cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3)};
  word_size = es;
  const bool vec = D > 0 && st[3] == 1 && (D * es) % 16 == 0 && (st[0] * es) % 16 == 0 && (st[1] * es) % 16 == 0 &&
                   (st[2] * es) % 16 == 0 && reinterpret_cast<uintptr_t>(cache.data_ptr()) % 16 == 0;
  if (vec) {
    word_size = 16;
    D = D * es / 16;
    for (int i = 0; i < 3; ++i) st[i] = st[i] * es / 16;
  }
  TORCH_CHECK(word_size == 1 || word_size == 2 || word_size == 4 || word_size == 8 || word_size == 16,
              "compact_cache: unsupported element size ", es);
  CompactTensor t{};
  t.data = cache.data_ptr();
  t.H = static_cast<int>(cache.size(1));
  t.D = static_cast<int>(D);
  t.total = cache.size(0) * cache.size(1) * D;
  t.sB = st[0];
  t.sH = st[1];
  t.sS = st[2];
  t.sD = st[3];
  return t;
}

// One launch over `count` tensors of words of `word_size` bytes (blockIdx.y: the tensor).
void launch_compact(const CompactBatch& batch, int count, int64_t word_size, int64_t S, const at::Tensor& prefix_len,
                    int64_t draft_start, const at::Tensor& accepted, const at::Tensor& accept_len) {
  int64_t most = 0;
  for (int i = 0; i < count; ++i) most = std::max(most, batch.t[i].total);
  if (count == 0 || most == 0) return;
  const dim3 grid(grid_for(most, kThreads), static_cast<unsigned>(count));
  auto stream = at::cuda::getCurrentCUDAStream();
  const int max_depth = static_cast<int>(accepted.size(1));
  const bool staged = max_depth <= kStagedRows;
#define FV_LAUNCH_COMPACT(WORD)                                                                                     \
  (staged ? _compact_cache_kernel<WORD, true> : _compact_cache_kernel<WORD, false>)<<<grid, kThreads, 0, stream>>>(  \
      batch, S, prefix_len.data_ptr<int32_t>(), draft_start, accepted.data_ptr<int32_t>(), max_depth,              \
      accept_len.data_ptr<int32_t>())
  switch (word_size) {
    case 1: FV_LAUNCH_COMPACT(uint8_t); break;
    case 2: FV_LAUNCH_COMPACT(uint16_t); break;
    case 4: FV_LAUNCH_COMPACT(uint32_t); break;
    case 8: FV_LAUNCH_COMPACT(uint64_t); break;
    default: FV_LAUNCH_COMPACT(uint4); break;  // 16 (prepare_compact allows no other size)
  }
#undef FV_LAUNCH_COMPACT
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// compact_cache's index arguments checked against k (their devices, dtypes and shapes; the slots themselves are
// checked by the Python layer, and a move outside [0, S) is skipped by the kernel).
void check_compact_args(const at::Tensor& k, const at::Tensor& prefix_len, int64_t draft_start,
                        const at::Tensor& accepted, const at::Tensor& accept_len) {
  check_cuda(prefix_len, "prefix_len");
  check_cuda(accepted, "accepted");
  check_cuda(accept_len, "accept_len");
  check_same_device(prefix_len, k, "prefix_len", "k");
  check_same_device(accepted, k, "accepted", "k");
  check_same_device(accept_len, k, "accept_len", "k");
  const int64_t B = k.size(0);
  check_dtype(prefix_len, at::kInt, "prefix_len");
  check_dtype(accepted, at::kInt, "accepted");
  check_dtype(accept_len, at::kInt, "accept_len");
  check_dim(accepted, 2, "accepted");
  TORCH_CHECK(prefix_len.dim() == 1 && prefix_len.size(0) == B, "prefix_len: expected shape [", B, "], got ",
              prefix_len.sizes());
  TORCH_CHECK(accepted.size(0) == B, "accepted: expected shape [", B, ", max_depth], got ", accepted.sizes());
  TORCH_CHECK(accept_len.dim() == 1 && accept_len.size(0) == B, "accept_len: expected shape [", B, "], got ",
              accept_len.sizes());
  TORCH_CHECK(draft_start >= 0 && draft_start <= k.size(2), "draft_start: expected 0 <= draft_start <= S = ",
              k.size(2), ", got ", draft_start);
}

// One layer's k and v: CUDA tensors of k's batch and slots on k's device.
void check_cache_pair(const at::Tensor& k0, const at::Tensor& k, const at::Tensor& v) {
  check_cuda(k, "k");
  check_cuda(v, "v");
  check_same_device(k, k0, "k", "k[0]");
  check_same_device(v, k0, "v", "k[0]");
  check_dim(k, 4, "k");
  check_dim(v, 4, "v");
  TORCH_CHECK(k.size(0) == k0.size(0) && k.size(2) == k0.size(2) && v.size(0) == k0.size(0) &&
                  v.size(2) == k0.size(2),
              "k, v: expected batch ", k0.size(0), " and ", k0.size(2), " slots, got ", k.sizes(), " and ",
              v.sizes());
}

// compact_cache over every layer of a cache in one call: the arguments checked once, then one launch for every
// kBatchTensors tensors of one word size (no Python between them).
void compact_cache_layers_cuda(at::TensorList k, at::TensorList v, const at::Tensor& prefix_len, int64_t draft_start,
                               const at::Tensor& accepted, const at::Tensor& accept_len) {
  TORCH_CHECK(k.size() == v.size(), "k, v: expected as many value tensors as key tensors, got ", k.size(), " and ",
              v.size());
  if (k.empty()) return;
  check_cuda(k[0], "k[0]");
  check_dim(k[0], 4, "k[0]");
  for (size_t i = 0; i < k.size(); ++i) check_cache_pair(k[0], k[i], v[i]);
  check_compact_args(k[0], prefix_len, draft_start, accepted, accept_len);
  const c10::cuda::CUDAGuard guard(k[0].device());
  if (accepted.size(1) == 0) return;
  auto pre = prefix_len.contiguous();
  auto acc = accepted.contiguous();
  auto len = accept_len.contiguous();
  const int64_t S = k[0].size(2), max_depth = accepted.size(1);
  // the tensors by word size, each group in launches of up to kBatchTensors (a cache's layers share one: one or two
  // launches for all of them, where a launch per tensor cost the host a few microseconds each); past kStagedRows
  // moves each tensor takes its own scratch, as its launch's record holds
  std::vector<std::pair<int64_t, CompactTensor>> tensors;  // (word size, launch record)
  std::vector<at::Tensor> scratch;
  for (size_t i = 0; i < 2 * k.size(); ++i) {
    const at::Tensor& cache = i % 2 ? v[i / 2] : k[i / 2];
    int64_t word_size = 0;
    CompactTensor t = prepare_compact(cache, word_size);
    if (t.total == 0) continue;
    if (max_depth > kStagedRows) {
      scratch.push_back(at::empty({max_depth, t.total * word_size}, cache.options().dtype(at::kByte)));
      t.scratch = scratch.back().data_ptr();
    }
    tensors.emplace_back(word_size, t);
  }
  for (const int64_t size : {16, 8, 4, 2, 1}) {
    CompactBatch batch{};
    int count = 0;
    for (const auto& [word_size, t] : tensors) {
      if (word_size != size) continue;
      batch.t[count++] = t;
      if (count == kBatchTensors) {
        launch_compact(batch, count, size, S, pre, draft_start, acc, len);
        count = 0;
      }
    }
    launch_compact(batch, count, size, S, pre, draft_start, acc, len);
  }
}

// compact_cache: the one layer (k, v).
void compact_cache_cuda(at::Tensor& k, at::Tensor& v, const at::Tensor& prefix_len, int64_t draft_start,
                        const at::Tensor& accepted, const at::Tensor& accept_len) {
  compact_cache_layers_cuda({k}, {v}, prefix_len, draft_start, accepted, accept_len);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastverify, CUDA, m) {
  m.impl("tree_mask_packed", &tree_mask_packed_cuda);
  m.impl("tree_mask_bool", &tree_mask_bool_cuda);
  m.impl("tree_mask_additive", &tree_mask_additive_cuda);
  m.impl("tree_positions", &tree_positions_cuda);
  m.impl("compact_cache", &compact_cache_cuda);
  m.impl("compact_cache_layers", &compact_cache_layers_cuda);
}

}  // namespace cuda
}  // namespace fastverify
